#!/usr/bin/env bash
# Every figure that needs a GPU, in one run (for a machine with one NVIDIA GPU; see docs/performance.md,
# "Kernels" and "The DDP hook"): the GPU-marked tests, the codecs on CUDA (and their codec-times file),
# NCCL end to end, the framework integrations, and, where `ip`/`tc` work (as root), the hook and the
# collectives with 4 ranks of their own cores on emulated 1 Gbit/s links.
#
#   OUT=/some/dir bash benchmarks/gpu_figures.sh                 # every step; logs go to $OUT
#   STEPS="tests codecs" OUT=/some/dir bash benchmarks/gpu_figures.sh   # only these steps
#   GPU_TESTS_K="not runner" ...                                  # a -k expression for the tests step
#   TUNING_BUDGET=100 TUNING_GROUPS="sort orq" ...                 # the tuning step's seconds and groups (default all)
#   GPU_TESTS_N=14 ...                                            # pytest-xdist workers for the tests step (default 8)
#
# Steps: tuning codecs fields codecs50 tests profile nccl hook collectives integrations (tuning, fields,
# codecs50 and profile only when named in STEPS; codecs50 times a few schemes with 50 calls issued back to back,
# which shows the device-bound figure where codecs' batches of 5 include the host's time). `tuning` times the Triton launch settings (benchmarks/bench_triton_tuning.py) and,
# unless GRADQ_TRITON_TUNING is set already, the later steps run with the best ones it found (but `tests`, which
# checks the shipped settings: a tuned choice may trade a host read for device time);
# `profile` runs Nsight Compute (ncu, where installed) on one launch of the main encode kernels and of the Elias reader. Each runs under its own time limit
# (LIMIT_<step> seconds, defaults below), cut to what is left of END seconds (whole script; a step
# with under 30 s left is skipped), and writes $OUT/<step>.log, kept even when the step fails;
# the script goes on and names the failed and skipped steps at the end. Runs from a checkout with PYTHONPATH=src
# (no install needed); GRADQ_DATA may point at the MNIST archive for the nccl step.
set -u
OUT=${OUT:-gpu-figures}
STEPS=${STEPS:-tests codecs nccl hook collectives integrations}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python || command -v python3)}
END=${END:-100000}
failed=() skipped=()
step() {  # step NAME DEFAULT_LIMIT COMMAND...: run if NAME is in $STEPS, log to $OUT/NAME.log
  local name=$1 limit_var="LIMIT_$1" limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  limit=${!limit_var:-$limit}
  if [ $((END - SECONDS)) -lt "$limit" ]; then limit=$((END - SECONDS)); fi
  if [ "$limit" -lt 30 ]; then skipped+=("$name"); echo "== $name skipped: under 30 s left"; return 0; fi
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  if ! timeout -k 10 "$limit" "$@" >>"$OUT/$name.log" 2>&1; then failed+=("$name"); echo "   failed (see $OUT/$name.log)"; fi
  echo "   $name took $((SECONDS - t0)) s"
  tail -n 40 "$OUT/$name.log"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton, numba; print(torch.__version__, triton.__version__, numba.__version__, torch.cuda.get_device_name())"
  nproc; } >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
step tuning 200 "$PY" benchmarks/bench_triton_tuning.py --host --budget "${TUNING_BUDGET:-150}" ${TUNING_GROUPS:+--groups $TUNING_GROUPS} \
  --json "$OUT/tuning.json" --best "$OUT/best_tuning.json"
if [ -s "$OUT/best_tuning.json" ] && [ -z "${GRADQ_TRITON_TUNING:-}" ]; then
  export GRADQ_TRITON_TUNING="$OUT/best_tuning.json"; echo "== the next steps run with $GRADQ_TRITON_TUNING"
fi
step codecs 200 "$PY" benchmarks/bench_codecs.py --memory --device cuda --repeats 7 \
  --json "$OUT/codec_times_cuda.json"   # also the codec speeds `gradq perfmodel --codec-times` reads
step fields 60 "$PY" benchmarks/bench_fields.py --device cuda --repeats 5   # the all-reduce's codec
step codecs50 90 "$PY" benchmarks/bench_codecs.py --memory --device cuda --repeats 5 --batch 50 \
  --spec qsgd:bits=4,bucket=512 --spec signsgd --spec orq:levels=5 --spec qsgd:bits=4,coding=elias   # the device-bound figure
step tests 150 env -u GRADQ_TRITON_TUNING "$PY" -m pytest -q -n "${GPU_TESTS_N:-8}" -m gpu -rfE --tb=short -p no:cacheprovider ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
  tests/kernels/test_triton_kernels.py tests/kernels/test_triton_randk.py tests/kernels/test_triton_topk.py \
  tests/test_cuda_ranks.py
if command -v ncu >/dev/null; then
  step profile 60 ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    -k "regex:_binary_stats_kernel|_linear_levels_kernel|_norm_uniform_encode_kernel|_orq_levels_kernel|_pb_level_kernel|_elias_\w+_kernel" \
    -c 20 "$PY" -c "
import torch, gradq
x = torch.randn(25_000_000, device='cuda')
for spec in ('signsgd', 'bingrad-b', 'linear:levels=5', 'qsgd:bits=4,bucket=512', 'orq:levels=5', 'bingrad-pb',
             'qsgd:bits=4,coding=elias'):
    p = gradq.build(spec).encode(x, seed=1)
gradq.build('qsgd:bits=4,coding=elias').decode(p)   # the Elias reader's rounds and write pass
torch.cuda.synchronize()"
fi
step nccl 90 "$PY" -m gradq.cli train --backend nccl --workers 1 --model mlp-wide --data mnist --epochs 1 \
  -c fp32 -c qsgd:bits=4,bucket=512 --out "${TMPDIR:-/tmp}/gradq-nccl-run"
if command -v tc >/dev/null && [ "$(id -u)" = 0 ]; then
  step hook 150 "$PY" benchmarks/bench_hook_step.py --network 1gbit --world 4 --threads 3 --repeats 10 \
    --json "$OUT/hook_1gbit.json"
  step collectives 200 "$PY" benchmarks/bench_collectives.py --network 1gbit --world 4 --repeats 5 \
    --only "all_reduce" "scatter qsgd:bits=4" "scatter qsgd:bits=2" "gradq qsgd" "whole step" \
    --json "$OUT/collectives_1gbit.json"
else
  echo "== emulated links skipped: needs root and tc (docs/performance.md says how to install them)"
fi
step integrations 240 "$PY" -m pytest -q -n 3 -rfE --tb=short -p no:cacheprovider tests/test_integrations.py
if [ ${#skipped[@]} -gt 0 ]; then echo "skipped steps: ${skipped[*]}"; fi
if [ ${#failed[@]} -gt 0 ]; then echo "failed steps: ${failed[*]}"; exit 1; fi
echo "all steps passed; logs in $OUT"
