"""The medusa-heads command line: generate, chat, demo, distill, features, train, calibrate, bench, export."""
from __future__ import annotations

import argparse

from medusa_heads.cli.commands import (
    cmd_bench, cmd_calibrate, cmd_chat, cmd_demo, cmd_distill, cmd_export, cmd_features, cmd_generate, cmd_train,
)
from medusa_heads.default_model import DEFAULT_MODEL


def _model_args(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The options every generating command shares."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the default's name, a local HF directory or a hub id")
    parser.add_argument("--heads", default=None, help="heads directory (default: the shipped heads, if they fit)")
    parser.add_argument("--tree", default=None, help="tree preset from configs/trees (default: the heads' own tree)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the model's dtype (bf16: faster on CPUs with AVX512-BF16 or AMX, and on GPUs)")
    _prepack_arg(parser)


def _prepack_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=True,
                        help="on a CPU, run the model's linears through oneDNN with prepacked weights (default: on)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="medusa-heads", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt (streamed)")
    g.add_argument("--prompt", required=True)
    _model_args(g, max_new_tokens=256)
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.set_defaults(fn=cmd_generate)

    ch = sub.add_parser("chat", help="interactive chat, streamed, with a tokens/s and tau status line")
    _model_args(ch, max_new_tokens=256)
    ch.add_argument("--do-sample", action="store_true")
    ch.add_argument("--temperature", type=float, default=0.7)
    ch.set_defaults(fn=cmd_chat)

    d = sub.add_parser("demo", help="plain generate vs medusa on a few prompts: tokens/s, tau, equality")
    _model_args(d, max_new_tokens=128)
    d.add_argument("--threads", type=int, default=2)
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("distill", help="the target answers prompts itself (resumable: rerun continues)")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--prompts", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--limit", type=int, default=None)
    s.add_argument("--cap", action="append", default=[], metavar="SOURCE=N", help="keep at most N rows of SOURCE")
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--variant", default=None, metavar="NAME",
                   help="a further answer per prompt, under ids <id>~NAME (with --temperature > 0); the held-out "
                        "split follows the prompt")
    s.add_argument("--heads", default=None, help="draft with these heads (MedusaModel, one prompt at a time)")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    _prepack_arg(s)
    s.add_argument("--features", default=None, help="also keep the target's hidden states here (safetensors shards)")
    s.set_defaults(fn=cmd_distill)

    f = sub.add_parser("features", help="hidden-state features for distilled conversations that have none")
    f.add_argument("--model", default=DEFAULT_MODEL)
    f.add_argument("--data", required=True)
    f.add_argument("--features", required=True)
    _prepack_arg(f)
    f.add_argument("--threads", type=int, default=2)
    f.set_defaults(fn=cmd_features)

    t = sub.add_parser("train", help="train heads on distilled data (a YAML recipe; --resume continues)")
    t.add_argument("--config", default=None, help="recipe YAML (configs/train/...)")
    t.add_argument("--data", default=None)
    t.add_argument("--features", default=None)
    t.add_argument("--out", default=None)
    t.add_argument("--max-steps", dest="max_steps", type=int, default=None)
    t.add_argument("--resume", action="store_true")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    t.add_argument("--threads", type=int, default=None)
    t.set_defaults(fn=cmd_train)

    c = sub.add_parser("calibrate", help="choose the fastest tree for these heads on this machine, and measure what "
                                         "the per-step tree runs on (acceptance, prompt lookup, cost)")
    c.add_argument("--heads", required=True)
    c.add_argument("--parts", default="tree,acceptance,lookup,cost",
                   help="what to measure: tree (the fixed tree, config.tree), acceptance, lookup, cost (config.adaptive; "
                        "cost is stored per kernels, beside the other kernels' entries)")
    c.add_argument("--model", default=DEFAULT_MODEL)
    c.add_argument("--data", default="data/distilled.jsonl")
    c.add_argument("--features", default="data/features")
    c.add_argument("--max-nodes", type=int, default=64)
    c.add_argument("--topk", type=int, default=10)
    c.add_argument("--context", type=int, default=300, help="cached tokens when timing the verify pass")
    c.add_argument("--repeats", type=int, default=5, help="timed forwards per size (the median is used)")
    c.add_argument("--overhead-ms", type=float, default=3.0, help="per-step Python work besides heads and verify")
    c.add_argument("--accept-topk", type=int, default=8, help="candidates per head in the acceptance calibration and "
                                                              "per parent when timing a drafting level")
    c.add_argument("--lookup-tokens", type=int, default=10, help="prompt-lookup continuation length measured")
    c.add_argument("--contexts", default="256,1024,4096", help="cached context lengths of the cost model")
    c.add_argument("--report", default=None, help="folder for a calibration report (report.md, reliability.png)")
    c.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    _prepack_arg(c)
    c.add_argument("--device", default=None)
    c.add_argument("--threads", type=int, default=2)
    c.set_defaults(fn=cmd_calibrate)

    b = sub.add_parser("bench", help="hf vs prompt lookup vs medusa, same process, alternating order")
    b.add_argument("--prompts", required=True)
    b.add_argument("--model", default=DEFAULT_MODEL)
    b.add_argument("--heads", default=None)
    _prepack_arg(b)
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    b.add_argument("--methods", default="hf,pld,medusa,medusa-static",
                   help="hf, hf-stock (stock kernels), pld, medusa (as configured: the per-step tree for calibrated "
                        "heads), medusa-static (the heads' fixed tree), medusa-preset, medusa:PRESET; a medusa method "
                        "+ '+pldN' sets prompt lookup to N tokens ('+pld0': heads only; default: the heads' own)")
    b.add_argument("--preset", default="cpu-16")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--do-sample", action="store_true")
    b.add_argument("--temperature", type=float, default=0.7)
    b.add_argument("--top-p", type=float, default=0.9)
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--batch-sizes", default=None, help="e.g. 1,4,8: batched greedy throughput, hf vs medusa, instead")
    b.add_argument("--long-tokens", type=int, default=512,
                   help="also time one open-writing answer of this many new tokens, EOS ignored (0: skip)")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--out", default="results")
    b.set_defaults(fn=cmd_bench)

    e = sub.add_parser("export", help="write heads in another layout (--format vllm: what vLLM serves; medusa: the reference layout)")
    e.add_argument("heads_dir")
    e.add_argument("out")
    e.add_argument("--format", choices=["vllm", "medusa"], default="medusa")
    e.add_argument("--model", default=DEFAULT_MODEL)
    e.set_defaults(fn=cmd_export)

    args = p.parse_args(argv)
    args.fn(args)

