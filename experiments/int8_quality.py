"""How far bf16 and int8 move the target from fp32: teacher-forced on the target's own answers (the first 40
conversations of data/distilled.jsonl.gz, up to 512 tokens each), at every answer token, the share of positions
whose top token is fp32's, and the mean KL divergence KL(fp32 || X) of the next-token distributions.

    python -m experiments.int8_quality > results/transformers/int8/quality.md
"""
from __future__ import annotations

import torch

from medusa_heads import MedusaModel
from medusa_heads.machine import cpu_name
from medusa_heads.corpus import read_conversations
from medusa_heads.loading import load_tokenizer
from medusa_heads.prompting import conversation_ids

CONVERSATIONS = 40


def main() -> None:
    torch.set_num_threads(2)
    tok = load_tokenizer()
    models = {
        "fp32 (SDPA)": MedusaModel.from_pretrained(heads=None).base_model,
        "bf16 (row-exact attention)": MedusaModel.from_pretrained(heads=None, dtype=torch.bfloat16).base_model,
        "int8 linears, bf16 otherwise": MedusaModel.from_pretrained(heads=None, quantize="int8").base_model,
    }
    stats = {name: [0, 0.0] for name in models}  # top-1 agreements, summed KL
    positions = 0
    with torch.inference_mode():
        for conv in read_conversations("data/distilled.jsonl.gz")[:CONVERSATIONS]:
            ids, mask = conversation_ids(tok, conv["messages"], 512)
            ids, mask = ids.view(1, -1), mask.view(-1)
            at = mask[1:].nonzero().view(-1)  # positions whose next token is an answer token
            logp = {name: torch.log_softmax(m(ids).logits[0, at].float(), -1) for name, m in models.items()}
            ref = logp["fp32 (SDPA)"]
            for name, lp in logp.items():
                stats[name][0] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
                stats[name][1] += float((ref.exp() * (ref - lp)).sum())
            positions += at.numel()
    print(f"# bf16 and int8 against fp32\n\n{cpu_name()}, SmolLM2-135M-Instruct, {CONVERSATIONS} conversations of "
          f"`data/distilled.jsonl.gz` teacher-forced, {positions} answer positions "
          "(`python -m experiments.int8_quality`).\n")
    print("| target | top token = fp32's | mean KL(fp32 ‖ it), nats |\n|---|---|---|")
    for name, (agree, kl) in stats.items():
        print(f"| {name} | {agree / positions:.4f} | {kl / positions:.5f} |")


if __name__ == "__main__":
    main()
