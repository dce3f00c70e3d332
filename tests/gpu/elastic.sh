#!/usr/bin/env bash
# Elastic memory (CUDA_OVERSUBSCRIBE, issue 31) as a user meets it, with PyTorch: a process with no
# library holds all of the GPU but FREE_GIB (default 8); a bf16 AdamW training loop sized to
# about 1.25, 1.5 and 2 times that (weights, gradients and optimizer state; activations on top)
# then runs under a limit of that size with CUDA_OVERSUBSCRIBE=true, and once without it; each
# from its first step, against the same loop on the card alone. Prints per-step times, the
# host-backed bytes vgpu-smi saw during the run, and the card's memory (nvidia-smi); then a loop
# during which the other process exits (the spills move back). Run from the
# repository root with .device/ prepared (scripts/gpu-prepare.sh). Report in $OUT/elastic.txt.
set -u
root=$(pwd)
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
report="$out/elastic.txt"; : > "$report"
free_gib="${FREE_GIB:-8}"
steps="${STEPS:-6}"
factors="${FACTORS:-1.25 1.5 2}"
library="$root/.device/libvgpu.so"; smi="$root/.device/vgpu-smi"
export PYTHONUNBUFFERED=1
log() { echo "$@" | tee -a "$report"; }
card() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits | head -1; }
log "# elastic memory, $(date -u '+%F %T') UTC, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
log "# the other process leaves $free_gib GiB free; $steps steps a run"
# job NAME GIB LIMIT OVERSUBSCRIBE [STEPS RELEASE]: runs the loop, samples vgpu-smi, prints a
# summary line; with RELEASE, the other process exits once the loop has done that many steps.
job() {
  local name=$1 gib=$2 limit=$3 over=$4 count=${5:-$steps} release=${6:-} work
  work=$(mktemp -d /tmp/vgpu-elastic.XXXXXX)
  local env=(CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/region.cache" LD_PRELOAD="$library")
  [ "$limit" != none ] && env+=(CUDA_DEVICE_MEMORY_LIMIT="$limit")
  [ "$over" != unset ] && env+=(CUDA_OVERSUBSCRIBE="$over")
  env "${env[@]}" timeout 120 python3 tests/gpu/elastic_train.py "$gib" "$count" > "$work/job.txt" 2>&1 &
  local pid=$! host=0
  while kill -0 "$pid" 2>/dev/null; do
    sample=$("$smi" --region "$work/region.cache" --json 2>/dev/null \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); print(max([dev["memory_host_backed_bytes"] for r in d["regions"] for dev in r["devices"]] or [0]))' 2>/dev/null)
    [ -n "$sample" ] && [ "$sample" -gt "$host" ] && host=$sample
    if [ -n "$release" ] && grep -q "^step $release " "$work/job.txt" && kill -0 "$holder" 2>/dev/null; then
      kill "$holder"; log "   (the other process exits after step $release; host-backed then $((sample >> 20)) MiB)"
    fi
    sleep 0.5
  done
  wait "$pid"; local status=$?
  log "== $name: loop of $gib GiB, limit $limit, CUDA_OVERSUBSCRIBE=$over: exit $status, peak host-backed $((host >> 20)) MiB, card used/total MiB now $(card)"
  sed 's/^/   /' "$work/job.txt" | grep -v "^   *$" | tail -n $((count + 3)) | tee -a "$report"
  rm -rf "$work"
}
for factor in $factors; do
  gib=$(python3 -c "print(round($free_gib * $factor - 2, 2))")
  job "alone x$factor" "$gib" none unset
done
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
hold_mib=$((total_mib - free_gib * 1024 - 600))
python3 tests/gpu/hold_memory.py "$hold_mib" 100000 > "$out/hold.txt" 2>&1 &
holder=$!
for _ in $(seq 60); do grep -q holding "$out/hold.txt" 2>/dev/null && break; sleep 1; done
log "# the other process holds $hold_mib MiB: card used/total MiB $(card)"
for factor in $factors; do
  gib=$(python3 -c "print(round($free_gib * $factor - 2, 2))")
  limit="$(python3 -c "print(int($free_gib * $factor * 1024))")m"
  job "shared x$factor" "$gib" "$limit" true
done
factor=1.5
gib=$(python3 -c "print(round($free_gib * $factor - 2, 2))")
job "shared x$factor, no variable" "$gib" "$(python3 -c "print(int($free_gib * $factor * 1024))")m" unset
# Moves back: the other process exits while the loop runs; its steps should return to the
# card-alone time once the library has moved its spills onto the device.
job "shared x$factor, the other exits" "$gib" "$(python3 -c "print(int($free_gib * $factor * 1024))")m" true 24 4
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
