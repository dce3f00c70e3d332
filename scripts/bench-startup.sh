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
# A storm: 1000 processes started at once on one region, each keeping its slot for a while; then
# cuInit of later processes while those 1000 are live (against the median above, with none).
rm -f "$region"
storm="$work/storm"; rm -rf "$storm"; mkdir -p "$storm"
start=$(date +%s.%N)
for i in $(seq 1000); do LD_PRELOAD="$hook" "$work/init_time" 40 > "$storm/$i" 2>&1 & done
while [ "$(cat "$storm"/* 2>/dev/null | wc -l)" -lt 1000 ]; do sleep 0.1; done
end=$(date +%s.%N)
failed=$(cat "$storm"/* | awk '$1 != 0' | wc -l)
slowest=$(cat "$storm"/* | awk '$1 == 0 {print $2}' | sort -n | tail -1)
printf '1000 processes at once, hooked: all through cuInit in %.3f s, %s failed, slowest cuInit %s us\n' \
  "$(echo "$end - $start" | bc)" "$failed" "$slowest"
busy=$(for i in $(seq 21); do LD_PRELOAD="$hook" "$work/init_time" | awk '{print $2}'; done | median)
printf 'cuInit with 1000 live processes in the region: %s us (median of 21; with none: %s us)\n' "$busy" "$joined"
pkill -f "$work/init_time 40" || true
wait 2>/dev/null || true
