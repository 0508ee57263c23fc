"""The docs generator: the reference pages (CLI, spec, run directory, environment, metrics) read
from the code (pages.py), from its models (models.py) and from its sources (sources.py)."""
