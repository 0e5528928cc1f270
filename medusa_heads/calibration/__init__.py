"""Calibration: what the heads' config learns from held-out data and this machine (the fixed tree, calibrated
acceptance, prompt lookup's acceptance, the verify cost model), measured in `measure`, reported in `report`.
The pure choice of a tree from measured rank accuracies is tree/calibrate.py (no model)."""
