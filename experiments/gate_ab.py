"""The per-step tree with its gate (inference/adaptive.DraftGate: the heads rest where their recent trees did not
pay) against the same tree without it, llama.cpp's plain decoding of the same GGUF beside them, one process, arms
alternating per prompt (ab_loop.alternate_by), by category: tokens/s over plain decoding, and outputs differing."""
from __future__ import annotations


from medusa_heads.inference.adaptive import DraftGate
from medusa_heads.cli.commands import _read_prompts

from experiments.ab_loop import against_plain, on_llamacpp
from scripts.common import parser


def main() -> None:
    p = parser(__doc__, "prompts", "max_new_tokens", "threads", "limit", "out")
    p.add_argument("--gguf", default="q8_0", help="the weight type llama.cpp runs")
    args = p.parse_args()
    tok, model, plain = on_llamacpp(args.gguf, args.threads)
    gate_open = DraftGate.open

    def heads(gated: bool):
        def run(ids):
            DraftGate.open = gate_open if gated else (lambda self: True)  # the call's own drafter, as generate makes it
            try:
                return model.generate(ids, max_new_tokens=args.max_new_tokens)
            finally:
                DraftGate.open = gate_open
        return run

    arms = {"no gate": heads(False), "gate": heads(True)}
    rows = _read_prompts(args.prompts)[: args.limit]
    title = f"# The gate on llama.cpp {args.gguf}: {len(rows)} prompts, {args.max_new_tokens} tokens, greedy"
    against_plain(tok, rows, plain, args.max_new_tokens, arms, [title], args.out)

if __name__ == "__main__":
    main()
