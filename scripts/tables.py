"""What the measuring scripts share: a Markdown table printed and, with --out, written."""
from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: str | None) -> str:
    """Joins `lines` (a caption, then a Markdown table), prints them and writes them to `out` (its folder made)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return text
