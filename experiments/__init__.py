"""One-off studies, as modules from the repository's root: `python -m experiments.NAME`."""
