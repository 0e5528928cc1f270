"""Engines: what runs the target behind the decode loop (engines/base.py is the seam; docs/engines.md)."""
