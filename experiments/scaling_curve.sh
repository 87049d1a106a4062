#!/usr/bin/env bash
# Held-apart acceptance against training tokens (issue 34): EAGLE trained on growing prefixes of the
# shipped recipe's data (built-in + Magpie prompts, one shuffled split, the same held-out sequences),
# each point 2 epochs and at least 300 steps; then one point per further Magpie file, up to six (x5 is the
# shipped drafter; x6's 2 epochs would pass the 90-min budget, so it stops at 88 min); then all points in one
# interleaved held-apart run.
#   bash experiments/scaling_curve.sh            # train every point (skips finished ones), then evaluate
# Checkpoints go to heads/checkpoints/scaling/ (git-ignored); the run to experiments/results/heldapart_magpie/.
# head.kl_weight=1.0: the loss weights the committed curve was trained with (the default is 0.1 since 2026-12-07).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODEL=smollm2-135m
for point in 040k:40000 080k:80000 160k:160000 all:null; do
  name=${point%%:*}; cap=${point#*:}
  out=heads/checkpoints/scaling/$MODEL-eagle-$name
  [ -f "$out/eagle.safetensors" ] && continue
  # 2 epochs of the two smallest points are 92 and 180 steps: those run 300 steps instead
  case $name in 040k|080k) steps=300 ;; *) steps=null ;; esac
  $PY -m heads.train head=eagle head.kl_weight=1.0 model.matmul=numba \
    "data.source=[builtin,heads/data/magpie-$MODEL-1turn.jsonl.gz]" data.instructions=0 \
    data.max_minutes=45 data.torch_threads=2 train.torch_threads=2 \
    train.epochs=2 train.max_steps=$steps train.max_minutes=null train.max_train_tokens=$cap \
    output_dir=$out
done
# Past the one Magpie file: more files (other seeds, the same domains), all of them, 2 epochs within the
# budget; x5 is the shipped drafter. A mix of more sources shuffles into another split, so validation
# accuracy there is on other sequences.
sources="builtin,heads/data/magpie-$MODEL-1turn.jsonl.gz"
for seed in 1 2 3 4 5; do
  file=heads/data/magpie-$MODEL-1turn-seed$seed.jsonl.gz
  sources="$sources,$file"
  [ -f "$file" ] || $PY -m heads.magpie --n 3000 --turns 1 --seed $seed --batch-size 128 --out "$file"
  out=heads/checkpoints/scaling/$MODEL-eagle-x$((seed + 1))
  [ -f "$out/eagle.safetensors" ] || $PY -m heads.train head=eagle head.kl_weight=1.0 model.matmul=numba \
    "data.source=[$sources]" data.instructions=0 data.max_minutes=60 data.torch_threads=2 \
    train.torch_threads=2 train.epochs=2 train.max_minutes=$((seed < 5 ? 30 + 15 * seed : 88)) output_dir=$out
done
$PY -m specdec.run experiment=eagle_scaling
