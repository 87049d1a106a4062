#!/usr/bin/env bash
# Issue 34 on a lent GPU: the 2-core recipes' training commands, on CUDA.
#   A. EAGLE's x4 scaling point: experiments/scaling_curve.sh's recipe on built-in + four Magpie files.
#   B. The draft on clean data: built-in + all 4,800 instruction prompts + four Magpie files, 3 epochs.
#      It starts once A has distilled its data, and reads A's Magpie chunks from the shared cache.
#   C. The batched-decoding correctness cases (python -m specdec.gpu_check --cases 'batch/*').
# The target stays fp32 (model.dtype=fp32; on CUDA `auto` would be bf16) and eager (model.compile=false),
# so the data and the losses are the CPU recipe's up to float rounding; model.matmul=numba (a CPU kernel)
# is dropped, and data.batch_size=auto generates 256 prompts at a time instead of the CPU's 64.
# On 2026-12-04 (64 at a time, B distilling its own copy of the Magpie data) the H200 had distilled
# 3.85 of A's 5 sources when its 7.5 minutes ran out.
#   bash experiments/gpu/train_drafters.sh OUT_DIR [SECONDS]    (EXTRA="k=v ..." adds overrides: dry runs)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: train_drafters.sh OUT_DIR [SECONDS]}
LIMIT=${2:-480}
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/specdec_gpu}
mkdir -p "$OUT" "$WORK"
M=heads/data/magpie-smollm2-135m-1turn
SOURCES="[builtin,$M.jsonl.gz,$M-seed1.jsonl.gz,$M-seed2.jsonl.gz,$M-seed3.jsonl.gz]"
COMMON=(model.dtype=fp32 model.compile=false "data.source=$SOURCES" data.max_minutes=60
        data.torch_threads=2 train.torch_threads=2 hydra.run.dir="$WORK/hydra_\${head.name}")
read -ra EXTRA_ARGS <<< "${EXTRA:-}"
COMMON+=("${EXTRA_ARGS[@]}")

$PY -c "from specdec.models.smollm2 import smollm2_folder; print(smollm2_folder())" || exit 1
START=$SECONDS
timeout "$LIMIT" $PY -m heads.train head=eagle "${COMMON[@]}" data.cache_dir="$WORK/distill" data.instructions=0 \
  train.epochs=2 train.max_minutes=75 output_dir="$WORK/smollm2-135m-eagle-x4" >"$OUT/eagle_x4.log" 2>&1 &
A=$!
timeout 120 $PY -m specdec.gpu_check --cases 'batch/*' --out "$OUT/gpu_batch" >"$OUT/gpu_batch.log" 2>&1 &
C=$!
until grep -q "trainable parameters" "$OUT/eagle_x4.log" 2>/dev/null || ! kill -0 $A 2>/dev/null; do sleep 5; done
timeout "$((LIMIT - SECONDS + START))" $PY -m heads.train head=draft "${COMMON[@]}" data.cache_dir="$WORK/distill" \
  data.instructions=4800 train.epochs=3 train.max_minutes=90 output_dir="$WORK/smollm2-135m-draft-x4i" \
  >"$OUT/draft_x4i.log" 2>&1 &
B=$!
wait $A; echo "eagle x4: rc $?"
wait $B; echo "draft x4i: rc $?"
wait $C; echo "gpu_check batch: rc $?"
for d in "$WORK"/smollm2-135m-*; do  # the artifacts and their cards, not the resumable checkpoints
  [ -d "$d" ] && mkdir -p "$OUT/$(basename "$d")" && find "$d" -maxdepth 1 -type f -exec cp {} "$OUT/$(basename "$d")/" \;
done
tail -n 3 "$OUT"/*.log
