#!/usr/bin/env bash
# Heads for a large model, the whole chain, timed phase by phase into $RUN/times.jsonl:
#   1. answers from vLLM (`vllm serve`, many requests in flight; `distill --server` checks it against the target),
#   2. the target's hidden states for them in padded batches (`features`, one process a GPU),
#   3. training (`train`, one process a GPU: the same heads as one process on the same global batch),
#   4. calibration on one GPU, then the heads exported for vLLM's Medusa proposer (`export --format vllm`).
# Each phase resumes where it stopped: rerun the script after an interruption.
#
#   MODEL=Qwen/Qwen2.5-7B-Instruct GPUS=8 RUN=runs/qwen7b bash scripts/gpu_chain.sh
#   MODEL=smollm2-135m-instruct GPUS=1 DEVICE=cpu LIMIT=64 bash scripts/gpu_chain.sh   # the same chain on a CPU, small
#
# MODEL: a hub id or local folder both environments can load (for the embedded names, its converted folder is used
# for vLLM). GPUS: processes for features and training (one a GPU). VLLM_PY: the python of an environment with vLLM
# (default .venv-vllm/bin/python, `make vllm-setup`); VLLM_ARGS: more `vllm serve` flags (e.g. --tensor-parallel-size
# 8 for a model that needs several GPUs). LIMIT: prompts to answer (default: all of data/train_prompts.jsonl.gz).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m-instruct}
GPUS=${GPUS:-1}
DEVICE=${DEVICE:-cuda}
RUN=${RUN:-runs/chain}
PY=${PY:-.venv/bin/python}
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
PORT=${PORT:-8321}
CONCURRENCY=${CONCURRENCY:-64}
MAX_NEW=${MAX_NEW:-256}
RECIPE=${RECIPE:-configs/train/smollm2-135m.yaml}
mkdir -p "$RUN"
TIMES="$RUN/times.jsonl"

phase() {  # phase NAME COMMAND...: runs it, appends {"phase", "seconds", "rc"} to $TIMES
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  echo "== $name: $*" >&2
  set +e; "$@"; local rc=$?; set -e
  local t1; t1=$(date +%s.%N)
  printf '{"phase": "%s", "seconds": %.1f, "rc": %d, "at": "%s"}\n' "$name" "$(echo "$t1 - $t0" | bc)" "$rc" "$(date -Is)" >> "$TIMES"
  return $rc
}

if [ "$DEVICE" = cpu ]; then
  LAUNCH=("$PY" -m accelerate.commands.launch --multi_gpu --num_processes "$GPUS" --num_machines 1
          --mixed_precision no --dynamo_backend no)
  export ACCELERATE_USE_CPU=true OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  DEVICE_ARGS=()
else
  LAUNCH=("$PY" -m accelerate.commands.launch --num_processes "$GPUS" --num_machines 1 --mixed_precision no
          --dynamo_backend no)
  DEVICE_ARGS=(--device cuda)
fi
[ "$GPUS" = 1 ] && LAUNCH=("$PY")   # one process: no launcher needed

# the folder vLLM loads: the embedded models' converted folders, else MODEL as it is
SERVED=$("$PY" -c "from medusa_heads.default_model import resolve_model; print(resolve_model('$MODEL'))")
PROMPTS=runs/chain_prompts.jsonl
if [ -n "${LIMIT:-}" ]; then
  "$PY" -c "import gzip,sys; [sys.stdout.write(l) for l in gzip.open('data/train_prompts.jsonl.gz','rt').readlines()[:$LIMIT]]" > "$PROMPTS"
else
  PROMPTS=data/train_prompts.jsonl.gz
fi

# 1. answers through vLLM
"$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$SERVED" --port "$PORT" ${VLLM_ARGS:-} > "$RUN/vllm.log" 2>&1 &
VLLM=$!
trap 'kill $VLLM 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
phase distill "$PY" -m medusa_heads.cli distill --model "$MODEL" --server "http://127.0.0.1:$PORT" \
  --prompts "$PROMPTS" --out "$RUN/distilled.jsonl" --concurrency "$CONCURRENCY" --max-new-tokens "$MAX_NEW"
kill $VLLM; wait $VLLM 2>/dev/null || true

# 2. features, 3. training: one process a GPU
phase features "${LAUNCH[@]}" -m medusa_heads.cli features --model "$MODEL" --data "$RUN/distilled.jsonl" \
  --features "$RUN/features" "${DEVICE_ARGS[@]}"
RESUME=(); [ -d "$RUN/heads/checkpoint" ] && RESUME=(--resume)
phase train "${LAUNCH[@]}" -m medusa_heads.cli train --config "$RECIPE" --set "model=$MODEL" \
  --set "data=$RUN/distilled.jsonl" --set "features=$RUN/features" --set "out=$RUN/heads" \
  ${TRAIN_SET:-} "${RESUME[@]}"

# 4. calibration (acceptance on held-out answers, the verify's cost on this device), export for vLLM
phase calibrate "$PY" -m medusa_heads.cli calibrate --model "$MODEL" --heads "$RUN/heads" --data "$RUN/distilled.jsonl" \
  --features "$RUN/features" "${DEVICE_ARGS[@]}"
phase export "$PY" -m medusa_heads.cli export --force --format vllm --model "$MODEL" "$RUN/heads" "$RUN/vllm-heads"
echo "times per phase: $TIMES" >&2
cat "$TIMES" >&2
