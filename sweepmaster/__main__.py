"""``python -m sweepmaster``: the same as the ``sweepmaster`` command."""

from sweepmaster.cli import main

main()
