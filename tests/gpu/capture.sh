#!/usr/bin/env bash
# Graph capture beside another thread's limited launches (tests/gpu/capture_other_thread.py):
# natively, with the hook and no limit, and at limit 50 with a memory limit of 8g, for PyTorch's
# default allocator and for cudaMallocAsync, with the library in .device/ and, when
# scripts/gpu-prepare.sh --candidate built one, .device/candidate/. Run from the repository root
# on the GPU machine; the report is also written to $OUT/capture.txt.
set -u -o pipefail
root=$(pwd)
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-capture; rm -rf "$work"; mkdir -p "$work"
seconds="${CAPTURE_SECONDS:-5}"
libraries=("$root/.device/libvgpu.so")
[ -f "$root/.device/candidate/libvgpu.so" ] && libraries+=("$root/.device/candidate/libvgpu.so")
[ -f "${libraries[0]}" ] || { echo "capture.sh: ${libraries[0]} is missing (run scripts/gpu-prepare.sh here first)" >&2; exit 1; }
run() {  # <label> <env...>
  local label=$1; shift
  printf '%-40s ' "$label"
  env "$@" python3 tests/gpu/capture_other_thread.py "$seconds" 2>"$work/err" | tail -1
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED:"; tail -5 "$work/err"; }
}
{
  echo "# graph capture beside another thread's launches, $(date -u '+%F %T') UTC, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "## driver calls alone inside a global capture (capture_probe.py)"
  echo "### native"; python3 tests/gpu/capture_probe.py 2>&1
  for library in "${libraries[@]}"; do
    echo "### ${library#"$root/"}, no limit"
    LD_PRELOAD="$library" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/probe-unset.cache" python3 tests/gpu/capture_probe.py "$library" 2>&1
    echo "### ${library#"$root/"}, 8g"
    LD_PRELOAD="$library" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/probe-8g.cache" CUDA_DEVICE_MEMORY_LIMIT=8g python3 tests/gpu/capture_probe.py "$library" 2>&1
  done
  echo "## a graph's own memory, PyTorch cudaMallocAsync (capture_memory.py)"
  echo "### native"; PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 tests/gpu/capture_memory.py 2>&1
  for library in "${libraries[@]}"; do
    echo "### ${library#"$root/"}, 8g"
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync LD_PRELOAD="$library" \
      CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/memory-8g.cache" CUDA_DEVICE_MEMORY_LIMIT=8g \
      python3 tests/gpu/capture_memory.py 2>&1
  done
  for allocator in native backend:cudaMallocAsync; do
    alloc=()
    [ "$allocator" = native ] || alloc=(PYTORCH_CUDA_ALLOC_CONF="$allocator")
    echo "## PyTorch allocator: $allocator"
    run native ${alloc[@]+"${alloc[@]}"}
    for library in "${libraries[@]}"; do
      name=${library#"$root/"}
      rm -f "$work"/*.cache
      run "$name, no limit" ${alloc[@]+"${alloc[@]}"} LD_PRELOAD="$library" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/unset.cache"
      run "$name, limit 50, 8g" ${alloc[@]+"${alloc[@]}"} LD_PRELOAD="$library" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/50.cache" \
        CUDA_DEVICE_SM_LIMIT=50 CUDA_DEVICE_MEMORY_LIMIT=8g
    done
  done
} 2>&1 | tee "$out/capture.txt"
