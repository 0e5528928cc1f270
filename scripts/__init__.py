"""Maintained tools (the Makefile, CI and docs/ run them), as modules from the root: `python -m scripts.NAME`."""
