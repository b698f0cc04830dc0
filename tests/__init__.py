"""sweepmaster's tests; :mod:`tests.kit` holds what the test files share."""
