"""What the scripts and experiments share: one argument parser (`parser`: the options most of them take, each with one
meaning and one help), the options and set-up of a greedy pass over prompt files with the shipped (or given) heads,
and a Markdown table printed and, with --out, written. Run them from the repository's root as modules:
`python -m scripts.NAME` / `python -m experiments.NAME`."""
from __future__ import annotations

import argparse
from pathlib import Path

REQUIRED = object()  # a shared option's "default" that makes the option required


class Option:
    """A shared option with this command's own help, where the shared one says too little (e.g. what --out holds)."""

    def __init__(self, default=None, help: str | None = None) -> None:
        self.default, self.help = default, help


# The options shared across scripts/ and experiments/: name -> (default, add_argument's keywords but the default).
# --prompts takes several files where its default is a list (or REQUIRED), one file where it is a path.
SHARED: dict[str, tuple[object, dict]] = {
    "prompts": ("data/bench_prompts.jsonl", {"help": "JSONL prompt file(s) (the first turn of each row)"}),
    "model": ("smollm2-135m-instruct", {"help": "the target: a model name or path"}),
    "limit": (None, {"type": int, "help": "only the first N prompts (of each file)"}),
    "max_new_tokens": (128, {"type": int, "help": "new tokens per answer, at most"}),
    "threads": (2, {"type": int, "help": "torch threads"}),
    "out": (None, {"help": "where the results go (see above)"}),
}


def shared(p: argparse.ArgumentParser, *names: str, **defaults) -> argparse.ArgumentParser:
    """Adds the shared options to `p` (a parser or a subcommand's): those named in `names` with the shared default,
    those given in `defaults` with this command's (REQUIRED: the option must be given; Option: its own help too)."""
    unknown = sorted(set(names) - set(SHARED) | set(defaults) - set(SHARED))
    if unknown:
        raise ValueError(f"not shared options: {unknown} (add a command's own with add_argument)")
    for name in SHARED:
        if name not in names and name not in defaults:
            continue
        default, kw = SHARED[name]
        kw = dict(kw)
        default = defaults.get(name, default)
        if isinstance(default, Option):
            kw["help"], default = default.help or kw["help"], default.default
        if name == "prompts" and (isinstance(default, list) or default is REQUIRED):
            kw["nargs"] = "+"
        if default is REQUIRED:
            kw["required"] = True
        else:
            kw["default"] = default
        p.add_argument("--" + name.replace("_", "-"), **kw)
    return p


def parser(description: str | None = None, *names: str, **defaults) -> argparse.ArgumentParser:
    """The parser every script and experiment builds its own on: `description` (the module's docstring, or part of
    it) above the options, laid out as written, and the shared options it takes (see `shared`); each command then
    adds its own with add_argument."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    return shared(p, *names, **defaults)


def greedy_pass(doc: str):
    """Parses --prompts, --heads, --model, --limit, --max-new-tokens, --threads, --out, --no-prepack; sets the threads; returns
    (args, the MedusaModel, its tokenizer, [(prompt file, row)] with the first --limit rows of each file)."""
    p = parser(doc, "model", "limit", "max_new_tokens", "threads", prompts=REQUIRED,
               out=Option(None, "Markdown file for the table"))
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped heads)")
    p.add_argument("--no-prepack", action="store_true", help="the stock kernels (a model loaded the user's way)")
    args = p.parse_args()
    import torch

    from medusa_heads import MedusaModel
    from medusa_heads.corpus import read_prompts
    from medusa_heads.loading import load_tokenizer

    torch.set_num_threads(args.threads)
    model = MedusaModel.from_pretrained(args.model, **({"heads": args.heads} if args.heads else {}),
                                        **({"prepack": False} if args.no_prepack else {}))
    rows = [(f, r) for f in args.prompts for r in read_prompts(f)[: args.limit]]
    return args, model, load_tokenizer(args.model), rows


def emit(lines: list[str], out: str | None) -> str:
    """Joins `lines` (a caption, then a Markdown table), prints them and writes them to `out` (its folder made)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return text
