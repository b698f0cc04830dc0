"""The dashboard front end (static files), installed as ``sweepmaster.web``."""
