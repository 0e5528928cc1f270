"""The medusa-heads command line: generate, chat, demo, distill, features, train, calibrate, bench, export, fit."""
from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

# Nothing here imports torch or transformers: `medusa-heads --help` prints at once; a command imports what it needs.
from medusa_heads.cli.commands import (
    DEFAULT_TEMPERATURE, DEFAULT_TOP_P, cmd_bench, cmd_calibrate, cmd_chat, cmd_demo, cmd_distill, cmd_export,
    cmd_features, cmd_fit, cmd_generate, cmd_train,
)
from medusa_heads.calibration import PARTS, Settings
from medusa_heads.config import DEFAULT_TREE
from medusa_heads.default_model import DEFAULT_MODEL

MISTAKE = 1  # a check found a mistake (a file, a value, a model name, a device) or refused to overwrite / store
BAD_ARGUMENT = 2  # argparse: an unknown flag, a value of the wrong type or out of range
INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
EXIT_CODES = f"""exit status:
  0    done
  {MISTAKE}    a mistake found by a check, said in one line naming the cause and the fix, before any model loads
       where it can be found then: a missing, empty or damaged file (a truncated heads.safetensors, heads whose
       config.json disagrees with their weights), an unknown model name, a device this machine lacks, text that is
       not UTF-8, --temperature/--top-p without --do-sample, heads for another base model, an export into a
       non-empty folder (--force replaces it), calibrate timings taken on a loaded machine (--force-cost stores them)
  {BAD_ARGUMENT}    a bad argument: an unknown flag, a value of the wrong type, an unknown choice
  {INTERRUPTED}  interrupted (Ctrl-C); chat ends quietly with 0
--debug (before or after the command) shows the traceback instead of the one line."""


def list_presets() -> list[str]:
    """The tree presets shipped in configs/trees/ (tree/spec.py's list_presets, without importing torch)."""
    from importlib import resources

    folder = resources.files("medusa_heads.configs") / "trees"
    return sorted(f.name[: -len(".json")] for f in folder.iterdir() if f.name.endswith(".json"))


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after each help text, except where there is nothing to say (None, off flags); the
    description and epilog (the exit codes) as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument error is one line on stderr that points at --help."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


CAL = Settings()  # calibrate's defaults live with calibrate


def _int(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {'positive' if low == 1 else f'>= {low}'}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def _float(low: float, high: float | None = None, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < low or (low_open and value == low) or (high is not None and value > high):
            want = f"in ({low}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low}"
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value
    parse.__name__ = "number"
    return parse


positive, non_negative = _int(1), _int(0)
TREES = [*list_presets(), "adaptive", "plain"]


def _model_args(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The options every generating command shares."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the embedded default's name, a local HF directory or a hub id")
    _heads_args(parser, "heads directory (default: the shipped heads, if they fit the model; else untrained heads)")
    parser.add_argument("--tree", default=None, choices=TREES, metavar="TREE",
                        help=f"tree ({', '.join(TREES)}; plain: no drafting; default: adaptive where the heads were "
                             "calibrated, else their own tree)")
    parser.add_argument("--max-new-tokens", type=positive, default=max_new_tokens,
                        help="most tokens to generate per reply")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                        help="the model's dtype (bf16: faster on CPUs with AVX512-BF16 or AMX, and on GPUs; int8: "
                             "CPU only, int8 linears with bf16 elsewhere, exact against its own plain decoding)")
    _prepack_arg(parser)
    _device_arg(parser)
    _gguf_arg(parser)


def _gguf_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gguf", default=None, metavar="FILE|WEIGHTS",
                        help="run the target on llama.cpp (`make llamacpp-setup` builds it): a GGUF file of --model, "
                             "or a weight type (f32, bf16, q8_0, q4_1, q4_k_m) converted from --model once and cached; "
                             "greedy output is then llama.cpp's own greedy decoding of that file")


def _heads_args(parser: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    parser.add_argument("--heads", default=None, required=required, help=help)
    parser.add_argument("--allow-base-mismatch", action="store_true",
                        help="use heads trained for another base model of the same sizes (they will draft poorly)")


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    # None: not given (the commands refuse --temperature / --top-p without --do-sample, and sample with the defaults)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=_float(0.0, low_open=True), default=None,
                        help=f"sampling temperature (with --do-sample) (default: {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top-p", type=_float(0.0, 1.0, low_open=True), default=None,
                        help="nucleus sampling: keep the smallest set of tokens with this much probability (with "
                             f"--do-sample) (default: {DEFAULT_TOP_P})")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")


def _prepack_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=True,
                        help="on a CPU, run the model's linears through oneDNN with prepacked weights")


def _device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="device for the model, e.g. cuda (default: the CPU)")


def _engine_args(p: argparse.ArgumentParser, started: str, example: str) -> None:
    """--engine vllm and its two options (distill, fit): vLLM started `started`, `example` of its flags."""
    p.add_argument("--engine", choices=["vllm"], default=None,
                   help=f"take the answers from vLLM, started {started} in its own environment (--vllm-python) and "
                        "stopped after; as --server otherwise")
    p.add_argument("--vllm-python", default=None, help="--engine vllm: the python of an environment with vLLM "
                   "(default: $MEDUSA_HEADS_VLLM_PYTHON, else .venv-vllm/bin/python from `make vllm-setup`)")
    p.add_argument("--vllm-args", default=None, help=f"--engine vllm: more flags for vLLM's server, e.g. {example}")


def _threads_arg(parser: argparse.ArgumentParser, default: int | None) -> None:
    parser.add_argument("--threads", type=positive, default=default,
                        help="CPU threads" + ("" if default else " (default: PyTorch's choice)"))


# build_parser's command(name, help, fn): the parser of one subcommand, given to the _add_* that adds its arguments
Command = Callable[[str, str, Callable[[argparse.Namespace], None]], argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="medusa-heads", description=__doc__, formatter_class=HelpFormatter, epilog=EXIT_CODES)
    p.add_argument("--debug", action="store_true", help="on an error, show the full traceback instead of one line")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = Parser(add_help=False)  # --debug after the command name too
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, show the full traceback instead of one line")

    def command(name: str, help: str, fn) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help, description=help, parents=[common], formatter_class=HelpFormatter,
                                epilog=f"exit status: 0 done, {MISTAKE} a mistake (one line), {BAD_ARGUMENT} a bad "
                                       f"argument, {INTERRUPTED} interrupted; `medusa-heads --help` says more")
        parser.set_defaults(fn=fn)
        return parser

    _add_generate(command)
    _add_chat(command)
    _add_demo(command)
    _add_distill(command)
    _add_features(command)
    _add_train(command)
    _add_calibrate(command)
    _add_bench(command)
    _add_export(command)
    _add_fit(command)
    return p


def _add_generate(command: Command) -> None:
    g = command("generate", "generate a reply to one prompt (streamed)", cmd_generate)
    g.add_argument("--prompt", required=True, help="the user's message")
    _model_args(g, max_new_tokens=256)
    _sampling_args(g)


def _add_chat(command: Command) -> None:
    ch = command("chat", "interactive chat, streamed, with a tokens/s and tau status line", cmd_chat)
    _model_args(ch, max_new_tokens=256)
    _sampling_args(ch)


def _add_demo(command: Command) -> None:
    d = command("demo", "plain generate vs medusa on a few prompts: tokens/s, tau, equality", cmd_demo)
    _model_args(d, max_new_tokens=128)
    _threads_arg(d, 2)


def _add_distill(command: Command) -> None:
    s = command("distill", "the target answers prompts itself (resumable: rerun continues)", cmd_distill)
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help="the target: the embedded default's name, a local HF directory or a hub id")
    s.add_argument("--prompts", required=True, help='JSONL prompts: {"prompt": ...} or {"turns": [...]} per line')
    s.add_argument("--out", required=True, help="JSONL conversations to append to (rows already there are skipped)")
    s.add_argument("--limit", type=positive, default=None, help="answer at most this many prompts (default: all)")
    s.add_argument("--cap", action="append", default=[], metavar="SOURCE=N", help="keep at most N rows of SOURCE")
    s.add_argument("--max-new-tokens", type=positive, default=256, help="most tokens per answer")
    s.add_argument("--batch-size", type=positive, default=16, help="prompts answered together")
    s.add_argument("--temperature", type=_float(0.0), default=0.0,
                   help=f"0: the target's greedy answers (what heads are trained on); > 0: sampled answers "
                        f"(e.g. {DEFAULT_TEMPERATURE}, with --variant)")
    s.add_argument("--top-p", type=_float(0.0, 1.0, low_open=True), default=1.0,
                   help="nucleus of the sampled answers (1.0: the model's own distribution, which distillation wants)")
    s.add_argument("--variant", default=None, metavar="NAME",
                   help="a further answer per prompt, under ids <id>~NAME (with --temperature > 0, or greedy for "
                        "rows with follow-up turns); the held-out split follows the prompt")
    _heads_args(s, "draft with these heads (MedusaModel, one prompt at a time)")
    _threads_arg(s, None)
    s.add_argument("--seed", type=int, default=0, help="seed of the --cap choice, the shuffle and the sampling")
    _prepack_arg(s)
    s.add_argument("--features", default=None, help="also keep the target's hidden states here (safetensors shards)")
    s.add_argument("--server", default=None, metavar="URL",
                   help="take the answers from an OpenAI-compatible completions server that serves the target (vLLM, "
                        "SGLang, llama.cpp's server, ...), e.g. http://localhost:8000; checked first (tokenizer, a few "
                        "greedy answers against the target's own); --features then come from a separate pass")
    _engine_args(s, "here for this run", "'--dtype float32 --max-model-len 2048 --tensor-parallel-size 8'")
    s.add_argument("--server-model", default=None, help="--server: the served model's name (default: the first listed)")
    _device_arg(s)
    s.add_argument("--concurrency", type=positive, default=16, help="--server: requests in flight")
    s.add_argument("--reuse", default=None, metavar="JSONL",
                   help="conversations distilled before (e.g. the greedy answers to the same prompts): a turn they "
                        "already answered, after the same user turns, is taken from there instead of generated "
                        "again (marked reused: training counts it once)")


def _add_features(command: Command) -> None:
    f = command("features", "hidden-state features for distilled conversations that have none, in padded batches "
                "(under `accelerate launch --num_processes N`: each process a share)", cmd_features)
    f.add_argument("--model", default=DEFAULT_MODEL, help="the target the conversations were distilled from")
    f.add_argument("--data", required=True, help="distilled conversations (JSONL, from `medusa-heads distill`)")
    f.add_argument("--features", required=True, help="folder of feature shards to add to")
    f.add_argument("--batch-tokens", type=positive, default=8192, help="padded tokens per forward")
    f.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the dtype the target runs in for this pass (features are stored in bf16 either way); bf16 is "
                        "about 3x faster on a CPU with AMX or AVX-512 bf16, and the target's serving dtype on a GPU")
    _device_arg(f)
    _prepack_arg(f)
    _threads_arg(f, 2)


def _add_train(command: Command) -> None:
    t = command("train", "train heads on distilled data (a YAML recipe; --resume continues)", cmd_train)
    t.add_argument("--config", default=None, help="recipe YAML (configs/train/...; default: the recipe's defaults)")
    t.add_argument("--data", default=None, help="distilled conversations (overrides the recipe's data; where only "
                                                 "NAME.gz exists, that is read)")
    t.add_argument("--features", default=None, help="feature shards (overrides the recipe's features)")
    t.add_argument("--out", default=None, help="heads directory to write (overrides the recipe's out)")
    t.add_argument("--max-steps", dest="max_steps", type=positive, default=None,
                   help="overrides the recipe's max_steps")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    _threads_arg(t, None)


def _add_calibrate(command: Command) -> None:
    c = command("calibrate", "choose the fastest tree for these heads on this machine, and measure what the per-step "
                             "tree runs on (acceptance, prompt lookup, cost)", cmd_calibrate)
    _heads_args(c, "heads directory to calibrate (its config.json is rewritten)", required=True)
    c.add_argument("--parts", default=",".join(PARTS),
                   help="what to measure: tree (the fixed tree, config.tree), acceptance, lookup, cost "
                        "(config.adaptive; cost is stored per kernels, beside the other kernels' entries), batch (a "
                        "batch's verify, added to these kernels' cost: batches then draft per-step trees too), greedy "
                        "(a greedy verify, which skips the LM head through the screen, added likewise: greedy steps "
                        "are sized by it), ngrams (the target's phrasebook: an n-gram store of its distilled answers, "
                        "ngrams.safetensors, and its acceptance), loop (the decode loop's own work a step, a tree's "
                        "and a drafting level's, timed in greedy calls on held-out prompts, added likewise)")
    c.add_argument("--model", default=DEFAULT_MODEL, help="the base model the heads draft for")
    c.add_argument("--data", default="data/distilled.jsonl",
                   help="distilled conversations (the held-out split is used; where only NAME.gz exists, that is read)")
    c.add_argument("--features", default="data/features", help="their feature shards")
    c.add_argument("--ngram-data", nargs="+", default=None,
                   help="distilled conversations the phrasebook learns (--parts ngrams; default: --data); the heads' "
                        "held-out prompts measure it")
    c.add_argument("--max-nodes", type=positive, default=CAL.max_nodes, help="largest tree considered")
    c.add_argument("--topk", type=positive, default=CAL.topk, help="ranks per head considered for the tree")
    c.add_argument("--context", type=positive, default=CAL.context, help="cached tokens when timing the verify pass")
    c.add_argument("--repeats", type=positive, default=CAL.repeats, help="timed forwards per size (the median is used)")
    c.add_argument("--overhead-ms", type=float, default=CAL.overhead_ms,
                   help="per-step Python work a tree adds besides heads and verify (--parts loop measures it instead)")
    c.add_argument("--accept-topk", type=positive, default=CAL.accept_topk,
                   help="candidates per head in the acceptance calibration and per parent when timing a drafting level")
    c.add_argument("--lookup-tokens", type=positive, default=CAL.lookup_tokens,
                   help="prompt-lookup continuation length measured")
    c.add_argument("--contexts", default=",".join(map(str, CAL.contexts)),
                   help="cached context lengths of the cost model")
    c.add_argument("--batch-rows", default=",".join(map(str, CAL.batch_rows)),
                   help="batch sizes whose verify --parts batch measures")
    c.add_argument("--report", default=None, help="folder for a calibration report (report.md, reliability.png)")
    c.add_argument("--dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                   help="the model's dtype (int8: CPU only)")
    c.add_argument("--force-cost", action="store_true",
                   help="store timings (tree, cost, batch, greedy, loop) even when they cannot be trusted: taken while "
                        "other work loaded the machine, or implausible (by default they are not stored, and calibrate "
                        f"ends with status {MISTAKE} saying why)")
    _prepack_arg(c)
    _device_arg(c)
    _gguf_arg(c)
    _threads_arg(c, 2)


def _add_bench(command: Command) -> None:
    b = command("bench", "hf vs prompt lookup vs medusa, same process, alternating order", cmd_bench)
    b.add_argument("--prompts", required=True, help='JSONL prompts: {"prompt": ...} or {"turns": [...]} per line, '
                                                    'optionally with "category"')
    b.add_argument("--model", default=DEFAULT_MODEL,
                   help="the embedded default's name, a local HF directory or a hub id")
    _heads_args(b, "heads directory (default: the shipped heads, if they fit the model; else untrained heads)")
    _prepack_arg(b)
    _gguf_arg(b)
    b.add_argument("--dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                   help="the model's dtype (int8: CPU only, int8 linears with bf16 elsewhere; hf is then that int8 "
                        "model's plain decoding)")
    _device_arg(b)
    b.add_argument("--methods", default="hf,pld,medusa,medusa-static",
                   help="comma-separated: hf, hf-stock (stock kernels), pld (transformers' prompt lookup, 10 tokens), "
                        "medusa (as configured: the per-step tree for calibrated heads, plus the heads' own prompt "
                        "lookup), medusa-static (the heads' fixed tree), medusa-preset (--preset), medusa:PRESET; a "
                        "medusa method + '+pldN' sets prompt lookup to N tokens ('+pld0': heads only, '+pld': 10); "
                        "llamacpp: llama.cpp on the same prompts (plain decoding of F32, BF16 and Q8_0 GGUF files made "
                        "from the model, and its n-gram self-speculation modes; built for this CPU once, ~9 min), or "
                        "one of llamacpp-f32, -bf16, -q8_0, -ngram; hf is always run (the reference)")
    b.add_argument("--preset", default=DEFAULT_TREE, choices=list_presets(), help="the tree of medusa-preset")
    b.add_argument("--max-new-tokens", type=positive, default=128, help="most tokens per answer")
    _sampling_args(b)
    b.add_argument("--limit", type=positive, default=None, help="use the first N prompts only (default: all)")
    b.add_argument("--batch-sizes", default=None, help="e.g. 1,4,8: batched greedy throughput, hf vs medusa, instead")
    b.add_argument("--long-tokens", type=non_negative, default=512,
                   help="also time one open-writing answer of this many new tokens, EOS ignored (0: skip)")
    _threads_arg(b, 2)
    b.add_argument("--out", default=None, help="folder for results.md, results.json, speedup.png "
                                               "(default: a new runs/bench-YYYYmmdd-HHMMSS)")


def _add_export(command: Command) -> None:
    e = command("export", "write heads in another layout (--format vllm: for the vLLM plugin; vllm-stock: vLLM's own "
                "Medusa, Medusa-1 heads only; medusa: the reference layout)", cmd_export)
    e.add_argument("heads_dir", help="heads directory to export")
    e.add_argument("out", help="folder to write the exported heads to")
    e.add_argument("--format", choices=["vllm", "vllm-stock", "medusa"], default="medusa",
                   help="the layout to write: vllm (the plugin vllm_plugin/ serves any heads), vllm-stock (vLLM's "
                        "built-in Medusa: condition none, square blocks), medusa (the reference layout)")
    e.add_argument("--root", choices=["exact", "draft"], default="exact",
                   help="--format vllm: how the plugin finds the root token: the whole LM head (exact, the target's "
                        "greedy token) or its draft-vocabulary rows (cheaper; wrong where the token is outside them)")
    e.add_argument("--draft-dtype", choices=["engine", "bf16", "fp32"], default="engine",
                   help="--format vllm: the heads' dtype inside vLLM (engine: vLLM's --dtype)")
    e.add_argument("--model", default=DEFAULT_MODEL, help="the base model the heads draft for")
    e.add_argument("--allow-base-mismatch", action="store_true",
                   help="export heads trained for another base model of the same sizes")
    e.add_argument("--force", action="store_true",
                   help="export into a folder that holds files already: what an export writes (either layout's files) "
                        "is replaced, so the folder holds one layout")


def _add_fit(command: Command) -> None:
    fi = command("fit", "heads for a model within a time budget: distill, train, calibrate, bench (rerun continues)",
                 cmd_fit)
    fi.add_argument("--model", default=DEFAULT_MODEL, help="the base model (a name, a local HF folder or a hub id)")
    fi.add_argument("--budget", required=True,
                    help="wall-clock time for everything, model loading included: 6m, 90m, 2h, 1h30m")
    fi.add_argument("--out", default="runs/fit",
                    help="heads directory to write (then MedusaModel.from_pretrained(model, heads=OUT)); it also keeps "
                         "the answers, features, state and report")
    fi.add_argument("--prompts", nargs="+", default=None,
                    help="prompt files to distill (default: data/train_prompts.jsonl.gz, and the default model's own "
                         "data/self_prompts.jsonl.gz), less any prompt of a data/bench_prompts*.jsonl file")
    fi.add_argument("--bench-prompts", default="data/bench_prompts.jsonl", help="held-out prompts of the closing bench")
    fi.add_argument("--max-answers", type=positive, default=None,
                    help="at most this many answers, whatever the budget buys")
    fi.add_argument("--max-steps", type=positive, default=None, help="at most this many training steps")
    fi.add_argument("--force-cost", action="store_true",
                    help="store the kernels' timings even when taken on a loaded machine (otherwise such timings are "
                         "not stored, and the heads keep their fixed tree)")
    fi.add_argument("--seed", type=int, default=0, help="prompt order, sampling and training data order")
    fi.add_argument("--stop-after", choices=["distill", "train", "calibrate", "bench"], default=None,
                    help="stop after this phase (a rerun continues)")
    fi.add_argument("--server", default=None, metavar="URL",
                    help="take the answers from an OpenAI-compatible completions server that serves the model (vLLM, "
                         "SGLang, llama.cpp's server, ...), e.g. http://localhost:8000; checked first (tokenizer, a "
                         "few greedy answers against the model's own); their features then come from a separate pass "
                         "within distill's time")
    fi.add_argument("--server-model", default=None,
                    help="--server: the served model's name (default: the first listed)")
    _engine_args(fi, "for the distill phase", "'--dtype float32 --max-model-len 2048'")
    fi.add_argument("--concurrency", type=positive, default=None,
                    help="--server, --engine: requests in flight (default: 16)")
    _threads_arg(fi, None)


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def main(argv: list[str] | None = None) -> None:
    """Run a command. A mistake (a missing file, a bad value, heads for another model) ends in one line on stderr
    and a non-zero status; --debug shows the traceback instead. Ctrl-C: "interrupted", status 130."""
    args = build_parser().parse_args(argv)
    prog = f"medusa-heads {args.command}"
    interrupted = False
    try:
        args.fn(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        interrupted = True  # said below, once the interrupted frames are gone (a progress bar closes its line first)
    except SystemExit as e:  # the commands' own checks: SystemExit("message")
        if isinstance(e.code, str):
            if args.debug:
                traceback.print_exc()
            if not e.code.startswith(prog):
                raise SystemExit(f"{prog}: {e.code}") from None
        raise
    except (ValueError, OSError) as e:  # the library's messages for a user's mistake (a bug still shows its traceback)
        if args.debug:
            raise
        raise SystemExit(f"{prog}: {_one_line(e)}") from None
    except RuntimeError as e:  # a fit phase that failed says so in one line (its traceback: --debug)
        from medusa_heads.training.fit import PhaseFailed

        if args.debug or not isinstance(e, PhaseFailed):
            raise
        raise SystemExit(f"{prog}: {_one_line(e)}") from None
    if interrupted:
        print("interrupted", file=sys.stderr)
        raise SystemExit(INTERRUPTED)
