#!/usr/bin/env bash
# Every figure that needs a GPU, in one run (for a machine with one NVIDIA GPU; see docs/performance.md,
# "Kernels" and "The DDP hook"): the GPU-marked tests, the codecs on CUDA (and their codec-times file),
# the framework integrations, NCCL end to end, and, where
# `ip`/`tc` work (as root), the hook with 4 ranks of their own cores on emulated 1 Gbit/s links.
#
#   OUT=/some/dir bash benchmarks/gpu_figures.sh      # logs go to $OUT (default ./gpu-figures)
#
# Runs from a checkout with PYTHONPATH=src (no install needed). Each step's log is kept even when a
# step fails; the script goes on and reports the failures at the end.
set -u
OUT=${OUT:-gpu-figures}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src}
PY=${PYTHON:-python}
failed=()
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  if ! "$@" >>"$OUT/$name.log" 2>&1; then failed+=("$name"); echo "   failed (see $OUT/$name.log)"; fi
  tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv >"$OUT/gpu.txt" 2>&1 || true
$PY -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" >>"$OUT/gpu.txt" 2>&1
step gpu-tests "$PY" -m pytest -q -m gpu tests/kernels/test_triton_kernels.py tests/test_cuda_ranks.py
step codecs-cuda "$PY" benchmarks/bench_codecs.py --memory --device cuda --repeats 7 \
  --json "$OUT/codec_times_cuda.json"   # also the codec speeds `gradq perfmodel --codec-times` reads
step integrations-gpu "$PY" -m pytest -q tests/test_integrations.py   # the examples pick CUDA when present
step nccl-train "$PY" -m gradq.cli train --backend nccl --workers 1 --model mlp --data digits --epochs 1 \
  -c fp32 -c qsgd:bits=4,bucket=512 --out "$OUT/nccl-run"
if command -v tc >/dev/null && [ "$(id -u)" = 0 ]; then
  step hook-1gbit "$PY" benchmarks/bench_hook_step.py --network 1gbit --threads 3
  step collectives-1gbit "$PY" benchmarks/bench_collectives.py --network 1gbit --world 4 --repeats 7 \
    --only "all_reduce" "scatter qsgd:bits=4" "scatter qsgd:bits=2" "gradq qsgd" "whole step"
else
  echo "== emulated links skipped: needs root and tc (docs/performance.md says how to install them)" | tee "$OUT/netem.log"
fi
if [ ${#failed[@]} -gt 0 ]; then echo "failed steps: ${failed[*]}"; exit 1; fi
echo "all steps passed; logs in $OUT"
