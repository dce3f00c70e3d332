#!/usr/bin/env bash
# Instructions the hook adds per call, counted by callgrind against the fake driver (repeatable,
# unlike timings). For each entry point: (I(N2) - I(N1)) / (N2 - N1), with and without the hook.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command -v valgrind >/dev/null || { echo "bench-callgrind: valgrind is not installed" >&2; exit 1; }
cargo build --quiet --release -p vgpu-hook -p vgpu-fake-driver
work="$root/target/bench"
mkdir -p "$work/fake"
for name in libcuda.so.1 libcuda.so libnvidia-ml.so.1; do ln -sf "$root/target/release/libvgpu_fake_driver.so" "$work/fake/$name"; done
cc -O2 -o "$work/passthrough_loop" tests/programs/passthrough_loop.c -I"$(scripts/cuda-include.sh)" -L"$work/fake" -lcuda
instructions() { # preload calls what [sm limit]
  rm -f "$work/region.cache"
  env LD_LIBRARY_PATH="$work/fake" LD_PRELOAD="$1" CUDA_DEVICE_MEMORY_LIMIT=8g ${4:+CUDA_DEVICE_SM_LIMIT=$4} \
    CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/region.cache" valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" \
    "$work/passthrough_loop" "$2" "$3" >/dev/null 2>&1
  awk '/^summary:/ {print $2}' "$work/cg.out"
}
low=1000; high=101000
printf '%-21s %14s %14s %10s\n' "entry point" "native Ir/call" "hooked Ir/call" "added"
# "limited": the same launches at limit 99, where the limited path runs on every launch (the fake's
# kernels take no time, so none waits): what the limiter itself costs a launch.
for row in count launch alloc pooled meminfo limited; do
  what=$row; limit=""
  [ "$row" = limited ] && { what=launch; limit=99; }
  n1=$(instructions "" $low $what); n2=$(instructions "" $high $what)
  h1=$(instructions "$root/target/release/libvgpu.so" $low $what $limit); h2=$(instructions "$root/target/release/libvgpu.so" $high $what $limit)
  case $row in count) label=cuDeviceGetCount;; launch) label=cuLaunchKernel;; alloc) label="cuMemAlloc+Free";; pooled) label="cuMemAllocAsync+Free";; meminfo) label=cuMemGetInfo;; limited) label="launch, limit 99";; esac
  # In decimals: truncating each side to an integer made +35.0 read as +36 (1740.999 and 1776.000).
  awk -v label="$label" -v n1="$n1" -v n2="$n2" -v h1="$h1" -v h2="$h2" -v calls=$((high - low)) \
    'BEGIN { native = (n2 - n1) / calls; hooked = (h2 - h1) / calls;
             printf "%-21s %14.1f %14.1f %10.1f\n", label, native, hooked, hooked - native }'
done
