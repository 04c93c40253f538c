#!/usr/bin/env bash
# The training comparisons of docs/results.md, at a scale two cores can run.
#
#   benchmarks/reproduce_results.sh [DATA] [OUT]      DATA: mnist (default; the shared 10 000 digits) or digits
#
# Every group trains an MLP on 4 local gloo workers with 3 seeds; finished runs are kept, so an interrupted
# call resumes. Each group then gets its own report (table + figures) under OUT/DATA-<group>/.
set -euo pipefail
DATA=${1:-mnist}
OUT=${2:-runs/results}
GRADQ=${GRADQ:-.venv/bin/gradq}
EPOCHS=${EPOCHS:-$([ "$DATA" = digits ] && echo 20 || echo 6)}
SEEDS=${SEEDS:-0,1,2}    # for the comparisons whose differences are small
SWEEP_SEEDS=${SWEEP_SEEDS:-0}  # for the level and bucket sweeps (quantization error is the measure there)
COMMON=(--workers 4 --model mlp --data "$DATA" --epochs "$EPOCHS" --batch-size 64 --measure-error --lr 0.1)
BASE="$OUT/$DATA-fp32"

train() {  # train GROUP SEEDS SPEC...
  local group=$1 seeds=$2; shift 2
  local args=()
  for c in "$@"; do args+=(-c "$c"); done
  "$GRADQ" train "${COMMON[@]}" --seeds "$seeds" "${args[@]}" --out "$OUT/$DATA-$group"
  "$GRADQ" report "$BASE" "$OUT/$DATA-$group" --out "$OUT/$DATA-$group" --title "$DATA: $group"
}

"$GRADQ" train "${COMMON[@]}" --seeds "$SEEDS" -c fp32 --out "$BASE"
# QSGD section 5: 4 and 8 bits match fp32; 2 bits with a large bucket loses some
train qsgd "$SEEDS" qsgd:bits=8,bucket=512 qsgd:bits=4,bucket=512 qsgd:bits=2,bucket=8192
# TernGrad table 2: with 2.5-sigma clipping within ~1 % of fp32, worse without
train terngrad "$SEEDS" terngrad terngrad:clip=none
# paper 002: MultiScale (2,6) against single-scale 2-bit
train multiscale "$SEEDS" multiscale:bits=2+6 maxnorm:bits=2
# ORQ tables 2-3: ORQ vs QSGD vs Linear with 3, 5 and 9 quantization points (QSGD's levels=s gives
# the 2s+1 points -s..s, so s = 1, 2, 4)
train levels "$SWEEP_SEEDS" orq:levels=3 qsgd:levels=1 linear:levels=3 orq:levels=5 qsgd:levels=2 linear:levels=5 \
  orq:levels=9 qsgd:levels=4 linear:levels=9
# ORQ table 3: bucket size sweep
train buckets "$SWEEP_SEEDS" orq:levels=5,bucket=128 orq:levels=5,bucket=512 orq:levels=5,bucket=2048 \
  orq:levels=5,bucket=8192 orq:levels=5,bucket=32768
# ORQ table 2: binary schemes
train binary "$SEEDS" bingrad-b bingrad-pb signsgd
