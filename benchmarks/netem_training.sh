#!/usr/bin/env bash
# Time to accuracy on an emulated network (docs/performance.md, "Training on an emulated network").
#
#   sudo benchmarks/netem_training.sh [RATE] [OUT]       RATE: tc rate of every link (default 1gbit)
#
# 4 workers, one per network namespace (gradq train --network RATE), each compressor in turn on the
# communication-heavy VGG-style net (conv layers + two 1024-wide fully-connected layers, 1.39M parameters
# on the 8x8 digits), Adam (lr 1e-3), batch 16 per worker. Without root, gradq train says so and runs nothing.
# Environment: MODEL (vgg), DATA (digits), EPOCHS (6), BATCH (16), OPTIMIZER (adam), LR (0.001), SEEDS (0),
# TARGET (0.9), GRADQ; e.g. the wide MLP on MNIST:
#   MODEL=mlp-wide DATA=mnist OPTIMIZER=sgd LR=0.05 EPOCHS=3 TARGET=0.93 benchmarks/netem_training.sh 1gbit
set -euo pipefail
RATE=${1:-1gbit}
OUT=${2:-runs/netem}
GRADQ=${GRADQ:-.venv/bin/gradq}
MODEL=${MODEL:-vgg}
DATA=${DATA:-digits}
EPOCHS=${EPOCHS:-6}
"$GRADQ" train --network "$RATE" --workers 4 --model "$MODEL" --data "$DATA" --epochs "$EPOCHS" \
  --batch-size "${BATCH:-16}" --optimizer "${OPTIMIZER:-adam}" --lr "${LR:-0.001}" --seeds "${SEEDS:-0}" --log-every 1 \
  -c fp32 -c powersgd:rank=1 -c qsgd:bits=4,bucket=512 -c qsgd:bits=8,bucket=512 -c terngrad \
  -c maxnorm:bits=4 -c orq:levels=5 --out "$OUT/$MODEL-$DATA-$RATE" "${@:3}"
"$GRADQ" report "$OUT/$MODEL-$DATA-$RATE" --target "${TARGET:-0.9}" --title "$MODEL on $DATA, 4 workers at $RATE"
