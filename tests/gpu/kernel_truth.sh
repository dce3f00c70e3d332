#!/usr/bin/env bash
# What a job's kernels really take (CUPTI, through PyTorch's profiler: kernel_truth.py) natively, with
# the hook and no limit, and at each limit of TRUTH_LIMITS (default "75 90") with the limiter's debug
# log, whose per-period lines say what the bucket charged (limiter_log.py). Tells a job held under
# its limit because it is charged more than its kernels take from one the bucket admitted less than
# the limit. TRUTH_JOB (default train), TRUTH_WARM seconds before the profiled window (default 4),
# TRUTH_STEPS profiled steps (default 60). Run from the repository root on the GPU machine after
# scripts/gpu-prepare.sh; the report is also written to $OUT/kernel-truth.txt.
set -u -o pipefail
root=$(pwd)
hook="${VGPU_HOOK:-$root/.device/libvgpu.so}"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-kernel-truth; rm -rf "$work"; mkdir -p "$work"
[ -f "$hook" ] || { echo "kernel_truth.sh: $hook is missing (run scripts/gpu-prepare.sh here first)" >&2; exit 1; }
job="${TRUTH_JOB:-train}"; warm="${TRUTH_WARM:-4}"; steps="${TRUTH_STEPS:-60}"
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
clean_env() {
  env -u LD_PRELOAD -u CUDA_DEVICE_SM_LIMIT -u CUDA_DEVICE_MEMORY_SHARED_CACHE -u GPU_CORE_UTILIZATION_POLICY "$@"
}
{
  echo "# kernel time against charges, $(date -u '+%F %T') UTC, ${gpu:-no nvidia-smi}"
  echo "# library: $hook; job $job, $warm s from the first launch, then $steps steps profiled"
  echo "native:   $(clean_env python3 tests/gpu/kernel_truth.py "$job" "$warm" "$steps" 2>"$work/native.err" | tail -1)"
  echo "unset:    $(clean_env LD_PRELOAD="$hook" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/unset.cache" \
    python3 tests/gpu/kernel_truth.py "$job" "$warm" "$steps" 2>"$work/unset.err" | tail -1)"
  for limit in ${TRUTH_LIMITS:-75 90}; do
    rm -f "$work/$limit.cache"
    echo "limit $limit: $(clean_env LD_PRELOAD="$hook" CUDA_DEVICE_SM_LIMIT="$limit" LIBCUDA_LOG_LEVEL=4 \
      CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/$limit.cache" \
      python3 tests/gpu/kernel_truth.py "$job" "$warm" "$steps" 2>"$work/$limit.err" | tail -1)"
    python3 tests/gpu/limiter_log.py "$work/$limit.err" | head -6 | sed 's/^/    /'
  done
  for run in native unset ${TRUTH_LIMITS:-75 90}; do
    grep -v "DEBUG" "$work/$run.err" | grep -i "error\|traceback" | head -3 | sed "s/^/    $run stderr: /"
  done
} 2>&1 | tee "$out/kernel-truth.txt"
