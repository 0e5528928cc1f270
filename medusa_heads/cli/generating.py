"""The commands that generate: generate, chat and demo."""
from __future__ import annotations

import argparse
import sys
import time

from medusa_heads.cli.common import _check_sampling, _check_utf8, _load_medusa, _not_utf8, _note, _sampling


def cmd_generate(args: argparse.Namespace) -> None:
    _check_utf8(args.prompt, "--prompt")
    _check_sampling(args)
    from transformers import TextStreamer

    from medusa_heads.prompting import prompt_ids

    model, tok = _load_medusa(args)
    ids = prompt_ids(tok, args.prompt).to(model.base_model.device)
    t = time.perf_counter()
    res = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                         streamer=TextStreamer(tok, skip_prompt=True), **_sampling(args))
    dt = time.perf_counter() - t
    print(f"\n[{res.stats.new_tokens} tokens, {res.stats.new_tokens / dt:.1f} tokens/s, "
          f"tau {res.stats.mean_accepted:.2f}]", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    """Interactive chat with the chat template; replies stream as they are accepted, then tokens/s and tau.
    An empty line, Ctrl-D or Ctrl-C ends it; a line that is not UTF-8 is said and skipped, and the chat goes on."""
    _check_sampling(args)
    from transformers import TextStreamer

    from medusa_heads.prompting import prompt_ids

    model, tok = _load_medusa(args)
    messages: list[dict] = []
    print("medusa-heads chat: empty line, Ctrl-D or Ctrl-C to quit", file=sys.stderr)
    sampling = _sampling(args)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 arrive as lone surrogates, said below, and
        sys.stdin.reconfigure(errors="surrogateescape")  # never as a UnicodeDecodeError that would end the chat
    try:
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                break
            except UnicodeDecodeError as e:  # a stdin that could not be reconfigured
                _note(f"chat: that line is not valid UTF-8 (byte 0x{e.object[e.start]:02x}); "
                      "it was skipped: type it again")
                continue
            if not line:
                break
            bad = _not_utf8(line)
            if bad:
                _note(f"chat: that line {bad}; it was skipped: type it again")
                continue
            messages.append({"role": "user", "content": line})
            ids = prompt_ids(tok, messages).to(model.base_model.device)
            t = time.perf_counter()
            res = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                                 streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True), **sampling)
            dt = time.perf_counter() - t
            messages.append({"role": "assistant",
                             "content": tok.decode(res.sequences[0, ids.shape[1]:], skip_special_tokens=True)})
            print(f"[{res.stats.new_tokens} tokens, {res.stats.new_tokens / dt:.1f} tokens/s, "
                  f"tau {res.stats.mean_accepted:.2f}]", file=sys.stderr)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the prompt or the reply left open


DEMO_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for a job interview.",
]


def cmd_demo(args: argparse.Namespace) -> None:
    """Greedy generation with plain generate and with Medusa, alternating; prints tokens/s, tau and equality.
    With prepacked linears (the default on a CPU) transformers' generate also runs on the stock kernels."""
    import torch
    from tqdm import tqdm

    from medusa_heads.kernels.prepack import is_prepacked, stock_kernels
    from medusa_heads.prompting import prompt_ids

    torch.set_num_threads(args.threads)
    model, tok = _load_medusa(args)
    base = model.base_model
    packed = is_prepacked(base)
    _demo_describe(model, packed)

    def hf_stock(ids):
        with stock_kernels(base):
            return base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)

    _demo_plan(args, model, tok, packed)
    seconds = dict.fromkeys(["hf", "medusa"] + (["hf_stock"] if packed else []), 0.0)
    n_tok = same = 0
    taus = []
    bar = tqdm(total=len(DEMO_PROMPTS) * len(seconds), desc="demo", unit="run", file=sys.stderr)
    for i, prompt in enumerate(DEMO_PROMPTS):
        ids = prompt_ids(tok, prompt).to(base.device)
        runs = [("hf", lambda: base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)),
                ("medusa", lambda: model.generate(ids, max_new_tokens=args.max_new_tokens,
                                                  return_dict_in_generate=True))]
        if packed:
            runs.append(("hf_stock", lambda: hf_stock(ids)))
        out = {}
        for name, fn in runs if i % 2 == 0 else runs[::-1]:  # alternate the order
            bar.set_postfix_str(f"prompt {i + 1}, {name}")
            t = time.perf_counter()
            out[name] = fn()
            seconds[name] += time.perf_counter() - t
            bar.update(1)
        n_tok += out["hf"].shape[1] - ids.shape[1]
        same += int(torch.equal(out["hf"], out["medusa"].sequences))
        taus.append(out["medusa"].stats.mean_accepted)
        bar.write(f"[{i + 1}] {prompt}\n"
                  f"    {tok.decode(out['hf'][0, ids.shape[1]:], skip_special_tokens=True)[:160]!r}...",
                  file=sys.stdout)
    bar.close()
    _demo_table(seconds, n_tok, taus, same, packed)


def _demo_describe(model, packed: bool) -> None:
    """demo's first line: the heads, the tree and the linears it runs."""
    tree = ("chosen at each step" if model.adaptive else "none (plain decoding)" if model.default_tree == "plain"
            else f"fixed, {model.tree.num_nodes} nodes")
    print(f"heads: {'trained' if model.config.extra else 'untrained (zero-initialised)'}; tree: {tree}; "
          f"linears: {'oneDNN prepacked (both methods)' if packed else 'stock kernels'}")


def _demo_plan(args: argparse.Namespace, model, tok, packed: bool) -> None:
    """Warm both methods up, time a few plain tokens, and say what the demo runs and about how long it takes."""
    from medusa_heads.prompting import prompt_ids

    base = model.base_model
    ids = prompt_ids(tok, "Hi").to(base.device)
    base.generate(ids, max_new_tokens=4, do_sample=False), model.generate(ids, max_new_tokens=4)  # warm-up
    t = time.perf_counter()
    base.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    per_token = (time.perf_counter() - t) / 8  # plain generate's seconds a token: the estimate below
    methods = ["transformers"] + (["transformers, stock kernels"] if packed else []) + ["medusa-heads"]
    # plain generate at its own pace (the stock kernels ~1.5x slower), medusa at about half of it
    estimate = len(DEMO_PROMPTS) * args.max_new_tokens * per_token * (1 + (1.5 if packed else 0) + 0.5)
    print(f"demo: {len(DEMO_PROMPTS)} prompts x {len(methods)} methods ({'; '.join(methods)}) x up to "
          f"{args.max_new_tokens} new tokens, greedy, {args.threads} threads: about {_duration(estimate)} here "
          "(fewer --max-new-tokens is quicker)", flush=True)


def _demo_table(seconds: dict[str, float], n_tok: int, taus: list[float], same: int, packed: bool) -> None:
    """demo's closing table: tokens/s, tau and speed-up of each method, and how many outputs were identical."""
    print(f"\n{'method':<36}{'tokens/s':>10}{'tau':>7}{'speed-up':>10}")
    print(f"{'transformers' + (', prepacked' if packed else '') + ' (baseline)':<36}{n_tok / seconds['hf']:>10.1f}"
          f"{1.0:>7.2f}{1.0:>10.2f}")
    if packed:
        print(f"{'transformers, stock kernels':<36}{n_tok / seconds['hf_stock']:>10.1f}{1.0:>7.2f}"
              f"{seconds['hf'] / seconds['hf_stock']:>10.2f}")
    print(f"{'medusa-heads' + (', prepacked' if packed else ''):<36}{n_tok / seconds['medusa']:>10.1f}"
          f"{sum(taus) / len(taus):>7.2f}{seconds['hf'] / seconds['medusa']:>10.2f}")
    print("tau: tokens each forward of the model yields (plain generate: 1; medusa: the drafted tokens it accepts "
          "+ 1); speed-up: against the baseline row")
    print(f"identical outputs (medusa vs transformers on the same kernels): {same}/{len(DEMO_PROMPTS)}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
