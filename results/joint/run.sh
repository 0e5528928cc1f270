#!/bin/bash
# Medusa-2 stage 2 from the shipped heads; resumable (rerun continues).
# runs/heads-v5: the shipped heads in fp32, as `medusa-heads train --config configs/train/smollm2-135m.yaml --out runs/heads-v5` writes them.
# Then: python results/joint/compare_targets.py runs/joint-v5 runs/heads-v5 skip   (heads x target on the held-out split)
#       python results/joint/outputs_vs_original.py runs/joint-v5               (greedy answers and tau, original vs adapted)
#       medusa-heads bench --prompts data/bench_prompts.jsonl --heads runs/joint-v5 --methods hf,medusa+pld0,medusa --out results/joint
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=2
R=""; [ -d runs/joint-v5/checkpoint ] && R="--resume"
exec medusa-heads train --config configs/train/smollm2-135m.yaml --out runs/joint-v5 $R \
  --set lora_rank=8 --set lora_alpha=16 --set lora_lr=1e-4 --set lr=2e-4 --set kl_weight=1.0 --set lm_weight=0.0 \
  --set init_heads=runs/heads-v5 --set batch_size=8 --set max_steps=200 --set warmup_steps=20 \
  --set eval_every=200 --set save_every=25 --set max_length=512
