#!/usr/bin/env bash
# The compute limit on jobs as users run them: run from the repository root on the GPU machine with
# the release libvgpu.so in .device/ (scripts/gpu-prepare.sh; VGPU_HOOK names another library).
# Each job of tests/gpu/compute_jobs.py (small ops, small ops with host pauses, GEMM, a CUDA graph,
# a GPT-style training step, a Triton kernel) runs from its first launch, with no warm-up in the
# measured process, at limits 10 25 50 75 90 and with the hook but no limit, against three native
# runs; each point prints its per-second throughput, GPU share and error against
# min(limit, natural share), then a summary table with pass/fail. Then two processes of one region
# at 50, two regions at 30 and 70, and one process on two GPUs (compute_two_gpus.py). See
# compute_jobs_bench.py for what is measured and its settings. The default matrix takes about
# 16 minutes: run COMPUTE_PART=1 (about 8) and COMPUTE_PART=2 (about 8.5) in two calls.
# The report is also written to $OUT/compute-jobs.txt (compute-jobs-part<n>.txt for a part).
set -u -o pipefail
root=$(pwd)
hook="${VGPU_HOOK:-$root/.device/libvgpu.so}"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-compute-jobs; rm -rf "$work"; mkdir -p "$work"
[ -f "$hook" ] || { echo "compute_jobs.sh: $hook is missing (run scripts/gpu-prepare.sh here first)" >&2; exit 1; }
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
{
  echo "# compute limit on jobs as users run them, $(date -u '+%F %T') UTC, ${gpu:-no nvidia-smi}"
  echo "# library: $hook${COMPUTE_POLICY:+, GPU_CORE_UTILIZATION_POLICY=$COMPUTE_POLICY}"
  echo "# ${COMPUTE_SECONDS:-10} s per point from the first launch, no warm-up in the measured process${COMPUTE_PART:+; part $COMPUTE_PART}"
  python3 tests/gpu/compute_jobs_bench.py "$hook" "$work"
} 2>&1 | tee "$out/compute-jobs${COMPUTE_PART:+-part$COMPUTE_PART}.txt"
