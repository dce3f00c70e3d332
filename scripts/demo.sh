#!/usr/bin/env bash
# Builds libvgpu.so and runs the demo program three times: without the hook, with a 1 GiB limit, and with a
# 1 GiB limit and CUDA_DEVICE_SM_LIMIT=50.
# Uses the real GPU when a driver is present (nvidia-smi works), the project's fake driver otherwise.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/fetch-headers.sh >/dev/null
cargo build --quiet --release -p vgpu-hook -p vgpu-monitor
hook="$root/target/release/libvgpu.so"
# Which libclang generated the hook: the build script's warning, which --quiet hides.
output=$(ls -t "$root"/target/release/build/vgpu-hook-*/output 2>/dev/null | head -1)
if [ -n "$output" ]; then
  sed -n 's/^cargo:warning=generated with libclang /== libvgpu.so generated with libclang /p' "$output"
fi
work="$root/target/demo"
mkdir -p "$work"
include=$(scripts/cuda-include.sh)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "== real GPU: $(nvidia-smi -L | head -1)"
  driver_dir=""
  link_dir="${CUDA_HOME:-/usr/local/cuda}/lib64/stubs"
else
  echo "== no GPU driver here: using the fake driver (simulated 16 GiB device)"
  cargo build --quiet --release -p vgpu-fake-driver
  driver_dir="$work/fake-driver"
  mkdir -p "$driver_dir"
  for name in libcuda.so.1 libcuda.so libnvidia-ml.so.1 libnvidia-ml.so; do
    ln -sf "$root/target/release/libvgpu_fake_driver.so" "$driver_dir/$name"
  done
  link_dir="$driver_dir"
fi
cc -O1 -o "$work/demo" tests/programs/demo.c -I"$include" -L"$link_dir" -lcuda
run() { LD_LIBRARY_PATH="$driver_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
# A region of the demo's own (unless one is given): the machine's default one may be in use by other
# processes with other limits, or left by another version.
export CUDA_DEVICE_MEMORY_SHARED_CACHE="${CUDA_DEVICE_MEMORY_SHARED_CACHE:-$work/region.cache}"
rm -f "$work/region.cache"
echo
echo "== without libvgpu.so"
run "$work/demo"
echo
echo "== with LD_PRELOAD=libvgpu.so CUDA_DEVICE_MEMORY_LIMIT=1g"
LD_PRELOAD="$hook" CUDA_DEVICE_MEMORY_LIMIT=1g run "$work/demo"
echo
echo "== with LD_PRELOAD=libvgpu.so CUDA_DEVICE_MEMORY_LIMIT=1g CUDA_DEVICE_SM_LIMIT=50"
echo "   (the kernels get at most half of the GPU's time: their span about doubles, less the 30 ms of"
echo "   GPU time a fresh budget starts with, which they spend at full speed)"
# A valid region keeps the container's limits for its next process (HAMi's writes and vgpu-smi set
# last); to start from new variables, the file is deleted, as the HAMi-core README says.
rm -f "$CUDA_DEVICE_MEMORY_SHARED_CACHE"
LD_PRELOAD="$hook" CUDA_DEVICE_MEMORY_LIMIT=1g CUDA_DEVICE_SM_LIMIT=50 run "$work/demo"
echo
echo "== vgpu-smi --json on the region of the last run: the compute limiter's totals"
"$root/target/release/vgpu-smi" --region "$CUDA_DEVICE_MEMORY_SHARED_CACHE" --json > "$work/region.json"
python3 - "$work/region.json" <<'PY'
import json, sys
for region in json.load(open(sys.argv[1]))["regions"]:
    for device in region["devices"]:
        limiter = device["limiter"] or {}
        launches, charged, held = (limiter.get(name, 0) for name in ("launches", "charged_ns", "held_ns"))
        print(f"device {device['index']}: limit {device['sm_limit_percent']}%, {launches} launches through the"
              f" limiter, {charged / 1e6:.1f} ms of GPU time charged, held {held / 1e6:.1f} ms while over budget")
PY
