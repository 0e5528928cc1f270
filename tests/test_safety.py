"""Weights load from safetensors only: nothing in the package unpickles."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile(r"torch\.load\(|pickle\.loads?\(|weights_only\s*=\s*False|import pickle|cloudpickle|joblib\.load")


def test_no_unpickling_anywhere_in_the_package():
    files = [p for d in ("medusa_heads", "tree", "inference", "training") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert hits == []


def test_shipped_heads_are_safetensors_only():
    shipped = sorted(p.name for p in (ROOT / "medusa_heads" / "default_heads").iterdir() if not p.name.startswith("."))
    assert shipped == ["config.json", "heads.safetensors", "ngrams.safetensors"]
