#!/usr/bin/env python
"""This build's generate against an earlier build's, in one process on one base model, alternating per prompt, with
transformers' generate as the yardstick: greedy, the shipped heads, each build's default tree.

    python -m experiments.build_ab --old 3e4d292 --prompts data/bench_prompts.jsonl --out results/ab/build_ab.md

The earlier build is taken from git (`git archive REV`) into a temporary folder and imported under another package
name (medusa_old), so both run side by side on the same prepacked base and the same heads files."""
from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads.calibration.timing import alternate
from scripts.common import emit, parser

ROOT = Path(__file__).resolve().parents[1]

LAYOUT = {"medusa_heads": "", "inference": "inference", "tree": "tree", "training": "training", "configs": "configs"}


def old_build(rev: str, into: Path):
    """The package of git revision `rev`, laid out as installed and renamed medusa_old; returns the module."""
    raw = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    src = into / "src"
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tar.extractall(src, filter="data")
    pkg = into / "medusa_old"
    for folder, dest in LAYOUT.items():
        target = pkg / dest if dest else pkg
        target.mkdir(parents=True, exist_ok=True)
        for path in (src / folder).rglob("*"):
            out = target / path.relative_to(src / folder)
            if path.is_dir():
                out.mkdir(parents=True, exist_ok=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            data = path.read_bytes()
            if path.suffix == ".py":
                data = re.sub(rb"\bmedusa_heads\b", b"medusa_old", data)
            out.write_bytes(data)
    spec = importlib.util.spec_from_file_location("medusa_old", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["medusa_old"] = module  # its own imports of medusa_old.* find it, and its __path__ the rest
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = parser(__doc__, "limit", "max_new_tokens", "threads", "out", prompts=["data/bench_prompts.jsonl"])
    p.add_argument("--old", required=True, help="git revision of the earlier build")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from medusa_heads import MedusaModel, prompt_ids
    from medusa_heads.default_model import default_heads_path
    from medusa_heads.loading import load_tokenizer
    from medusa_heads.corpus import read_prompts

    new = MedusaModel.from_pretrained()  # the default model, prepacked, with the shipped heads
    base, tok = new.base_model, load_tokenizer("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory() as tmp:
        old_pkg = old_build(args.old, Path(tmp))
        old = old_pkg.MedusaModel.from_pretrained(base, heads=str(default_heads_path()))
        rows = [r for f in args.prompts for r in read_prompts(f)[: args.limit]]
        contenders = {
            "generate": lambda ids: base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                  max_new_tokens=args.max_new_tokens),
            "old": lambda ids: old.generate(ids, max_new_tokens=args.max_new_tokens),
            "new": lambda ids: new.generate(ids, max_new_tokens=args.max_new_tokens),
        }
        forwards = [0]  # the decoder's forwards: every target forward runs it once (a screened verify skips the LM head)
        base.get_decoder().register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        warm = prompt_ids(tok, "Hello")
        for run in contenders.values():
            run(warm)
        seconds, tokens, differ = dict.fromkeys(contenders, 0.0), dict.fromkeys(contenders, 0), dict.fromkeys(contenders, 0)
        calls = dict.fromkeys(contenders, 0)
        names = list(contenders)
        f0 = {}  # the forwards before each call, off its clock
        prompts = (prompt_ids(tok, row.turns[0]) for row in tqdm(rows, desc="A/B", unit="prompt"))
        for ids, results in alternate(contenders, prompts, before=lambda name: f0.__setitem__(name, forwards[0]),
                                      after=lambda name: calls.__setitem__(name, calls[name] + forwards[0] - f0[name])):
            for name, (out, dt) in results.items():
                seconds[name] += dt
                tokens[name] += out.shape[1] - ids.shape[1]
            for name in names:
                differ[name] += not torch.equal(results[name].output, results["generate"].output)
    rate = {n: tokens[n] / seconds[n] for n in names}
    lines = [f"This build against {args.old}, greedy, {len(rows)} prompts ({', '.join(args.prompts)}), "
             f"{args.max_new_tokens} new tokens, {args.threads} threads, one process, alternating per prompt.", "",
             "| contender | tokens/s | × generate | τ (tokens a forward) | outputs differing from generate |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {rate[n]:.1f} | {rate[n] / rate['generate']:.3f} | {tokens[n] / calls[n]:.2f} | {differ[n]} |"
              for n in names]
    lines += ["", f"new / old: **{rate['new'] / rate['old']:.3f}**"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
