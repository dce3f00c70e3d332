#!/usr/bin/env bash
# Start-up cost of the hook on the fake driver: the time of one cuInit with and without the hook
# (medians of 21 runs; the hook's includes creating or joining the shared region), and the wall
# time for 64 processes started at once on one region to all finish cuInit.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --quiet --release -p vgpu-hook -p vgpu-fake-driver
work="$root/target/bench"
mkdir -p "$work/fake"
for name in libcuda.so.1 libcuda.so libnvidia-ml.so.1; do ln -sf "$root/target/release/libvgpu_fake_driver.so" "$work/fake/$name"; done
cc -O2 -o "$work/init_time" tests/programs/init_time.c -I"$(scripts/cuda-include.sh)" -L"$work/fake" -lcuda
hook="$root/target/release/libvgpu.so"
region="$work/startup-region.cache"
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
export LD_LIBRARY_PATH="$work/fake" CUDA_DEVICE_MEMORY_SHARED_CACHE="$region" CUDA_DEVICE_MEMORY_LIMIT=4g
native=$(for i in $(seq 21); do "$work/init_time" | awk '{print $2}'; done | median)
rm -f "$region"
created=$(LD_PRELOAD="$hook" "$work/init_time" | awk '{print $2}')
joined=$( (sleep 30 & pid=$!; for i in $(seq 21); do LD_PRELOAD="$hook" "$work/init_time" | awk '{print $2}'; done; kill $pid) | median)
printf 'cuInit: native %s us; hooked, creating the region %s us; hooked, later processes %s us (median of 21)\n' \
  "$native" "$created" "$joined"
for mode in native hooked; do
  preload=""; [ "$mode" = hooked ] && preload="$hook"
  rm -f "$region"
  start=$(date +%s.%N)
  for i in $(seq 64); do LD_PRELOAD="$preload" "$work/init_time" >/dev/null & done
  wait
  end=$(date +%s.%N)
  printf '64 processes at once, %s: all done in %.3f s\n' "$mode" "$(echo "$end - $start" | bc)"
done
