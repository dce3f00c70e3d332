#!/usr/bin/env bash
# The compute limit's GPU benchmark (issue 4): run from the repository root on the GPU machine with
# the release libvgpu.so in .device/ (scripts/gpu-prepare.sh). Builds the small-kernel program,
# then prints one table: for each workload (bf16 4096^3 GEMM loop, a loop of small elementwise
# kernels on 64K elements, the same kernels as a CUDA graph, a GEMM job with host-side pauses) and
# each limit in 10, 25, 50, 75, 100, the throughput as % of the unlimited run of the same call and
# the error against min(limit, natural share); the mean absolute and the largest error; then two
# processes of one region at 50 and two regions at 30 and 70. About 7 minutes. The report is also
# written to $OUT/compute.txt ($OUT/compute-$COMPUTE_TAG.txt with COMPUTE_TAG). VGPU_HOOK runs
# another build of the library (a path to its libvgpu.so). COMPUTE_SECONDS, COMPUTE_WARMUP,
# COMPUTE_WORKLOADS and COMPUTE_LIMITS shorten it (see compute_bench.py).
set -u
root=$(pwd)
hook="${VGPU_HOOK:-$root/.device/libvgpu.so}"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-compute; rm -rf "$work"; mkdir -p "$work"
[ -f "$hook" ] || { echo "compute.sh: $hook is missing (run scripts/gpu-prepare.sh here first)" >&2; exit 1; }
nvcc -O2 -arch=sm_90 -o "$work/compute_small" tests/gpu/compute_small.cu -lcuda || exit 1
{
  echo "# compute limit benchmark, $(date -u +%F), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  echo "# library: $hook${COMPUTE_POLICY:+, GPU_CORE_UTILIZATION_POLICY=$COMPUTE_POLICY}"
  echo "# measured ${COMPUTE_SECONDS:-3} s per point after ${COMPUTE_WARMUP:-3} s of warm-up"
  python3 tests/gpu/compute_bench.py "$hook" "$work/compute_small" "$work"
} 2>&1 | tee "$out/compute${COMPUTE_TAG:+-$COMPUTE_TAG}.txt"
