#!/usr/bin/env bash
# Contexts created together under a memory limit (issue 32, item 5), with PyTorch: PROCESSES
# processes (default 6) start at once, each creating its context and holding 1 MiB, under
# CUDA_DEVICE_MEMORY_LIMIT=LIMIT (default 1500m, room for two contexts of an H100 or H200). For each
# library given (default .device/libvgpu.so), prints how many processes got their context, how many
# were refused, the device's peak memory use above its idle use (nvidia-smi, every 100 ms; the
# machine must be otherwise idle) and what the region charged. Run from the repository root with
# .device/ prepared (scripts/gpu-prepare.sh). Report in $OUT/context-storm.txt.
#
#     tests/gpu/context_storm.sh [library...]
set -u
root=$(pwd)
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
report="$out/context-storm.txt"; : > "$report"
processes="${PROCESSES:-6}"
limit="${LIMIT:-1500m}"
libraries=("$@"); [ ${#libraries[@]} -gt 0 ] || libraries=("$root/.device/libvgpu.so")
export PYTHONUNBUFFERED=1
log() { echo "$@" | tee -a "$report"; }
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
log "# contexts created together, $(date -u '+%F %T') UTC, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
log "# $processes PyTorch processes at once, CUDA_DEVICE_MEMORY_LIMIT=$limit"
for library in "${libraries[@]}"; do
  work=$(mktemp -d /tmp/vgpu-context-storm.XXXXXX)
  smi="$(dirname "$library")/vgpu-smi"; [ -x "$smi" ] || smi="$root/.device/vgpu-smi"
  idle=$(used)
  for i in $(seq "$processes"); do
    CUDA_DEVICE_MEMORY_SHARED_CACHE=$work/region.cache CUDA_DEVICE_MEMORY_LIMIT=$limit LD_PRELOAD=$library \
      python3 tests/gpu/hold_memory.py 1 12 > "$work/process-$i.txt" 2>&1 &
  done
  peak=$idle
  for _ in $(seq 100); do
    now=$(used); [ "$now" -gt "$peak" ] && peak=$now
    sleep 0.1
  done
  charged=$(CUDA_DEVICE_MEMORY_SHARED_CACHE=$work/region.cache "$smi" --json 2>/dev/null \
    | python3 -c 'import json,sys; r=json.load(sys.stdin)["regions"][0]; print(sum(d["memory_used_bytes"] for d in r["devices"]) >> 20)' \
    2>/dev/null || echo "?")
  wait
  created=$(grep -l '^holding' "$work"/process-*.txt | wc -l)
  refused=$(grep -il 'out of memory' "$work"/process-*.txt | wc -l)
  log "$library: created $created, refused $refused (of $processes); device peak $((peak - idle)) MiB above idle; region charged $charged MiB while they held"
  grep -ih 'out of memory' "$work"/process-*.txt | head -1 | cut -c1-200 | sed 's/^/    first refusal: /' | tee -a "$report"
  rm -rf "$work"
done
