#!/usr/bin/env bash
# Issue 34 on a lent GPU, what is left of it after 2026-12-04 (EAGLE's x4 point trained on the CPU):
#   A. The eager generation profile (experiments/gpu/generation_profile.py), to set against
#      generation_profile.txt (the loop before 99800ec and before the eager-pass changes of ff73aed).
#   B. The batched decoder's speed cases (python -m specdec.gpu_check --cases 'speed/batch/*').
#   C. The draft on clean data: built-in + all 4,800 instruction prompts + four Magpie files, 3 epochs,
#      the 2-core recipe on CUDA. It starts after A and B, which time the device alone.
# The target stays fp32 (model.dtype=fp32; on CUDA `auto` would be bf16) and eager (model.compile=false),
# so the data and the losses are the CPU recipe's up to float rounding; model.matmul=numba (a CPU kernel)
# is dropped, and data.batch_size=auto generates 256 prompts at a time instead of the CPU's 64.
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
timeout 120 $PY experiments/gpu/generation_profile.py --out "$OUT/profile" >"$OUT/generation_profile.log" 2>&1
echo "generation profile: rc $?"
timeout 120 $PY -m specdec.gpu_check --cases 'speed/batch/*' --out "$OUT/gpu_speed_batch" >"$OUT/gpu_speed_batch.log" 2>&1
echo "gpu_check speed/batch: rc $?"
timeout "$((LIMIT - SECONDS + START))" $PY -m heads.train head=draft "${COMMON[@]}" data.cache_dir="$WORK/distill" \
  data.instructions=4800 train.epochs=3 train.max_minutes=90 output_dir="$WORK/smollm2-135m-draft-x4i" \
  >"$OUT/draft_x4i.log" 2>&1
echo "draft x4i: rc $?"
for d in "$WORK"/smollm2-135m-*; do  # the artifacts and their cards, not the resumable checkpoints
  [ -d "$d" ] && mkdir -p "$OUT/$(basename "$d")" && find "$d" -maxdepth 1 -type f -exec cp {} "$OUT/$(basename "$d")/" \;
done
tail -n 3 "$OUT"/*.log
