#!/usr/bin/env bash
# vgpu-smi suspend --release and resume (issue 34) with PyTorch: a training loop holding GIB
# (default 20) GiB under the library is released between two steps; the card's used memory before,
# during and after (nvidia-smi); a second job uses the freed memory meanwhile; resume restores it
# and the loop's losses are compared, bitwise, with an uninterrupted run of the same seed; then
# CYCLES (default 20) release/resume cycles under the running loop, and the same release and
# restore through the bare API (checkpoint_bare.py) for the baseline; the host link's bandwidth
# (a pinned 4 GiB copy each way); then the same loop under CUDA_IDLE_RELEASE=IDLE (default 5s),
# idle for IDLE_GAP seconds after its 5th step (default 30: longer than IDLE and the checkpoint of
# 20 GiB together): the card's memory while it idles and how long its next step takes (the restore
# it waits for) against the steps before it. Run from the repository root with .device/ prepared
# (scripts/gpu-prepare.sh). Report in $OUT/release.txt.
set -u
root=$(pwd)
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
report="$out/release.txt"; : > "$report"
gib="${GIB:-20}"; cycles="${CYCLES:-20}"; steps="${STEPS:-40}"
library="$root/.device/libvgpu.so"; smi="$root/.device/vgpu-smi"
export PYTHONUNBUFFERED=1
log() { echo "$@" | tee -a "$report"; }
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
wait_for() { for _ in $(seq 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done; return 1; }
log "# suspend --release, $(date -u '+%F %T') UTC, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
python3 - <<'PY' | tee -a "$report"
import time, torch
host = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
device = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
for name, copy in (("host to device", lambda: device.copy_(host)), ("device to host", lambda: host.copy_(device))):
    copy(); torch.cuda.synchronize(); start = time.time(); copy(); torch.cuda.synchronize()
    print(f"# host link, {name}: {4 / (time.time() - start):.1f} GiB/s")
PY
work=$(mktemp -d /tmp/vgpu-release.XXXXXX)
python3 tests/gpu/release_train.py "$gib" "$steps" 0.05 > "$work/reference.txt" 2>&1
log "# reference run: $(grep -c '^step' "$work/reference.txt") steps"
env_run=(CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/region.cache" LD_PRELOAD="$library")
env "${env_run[@]}" python3 tests/gpu/release_train.py "$gib" "$steps" 0.5 > "$work/job.txt" 2>&1 &
job=$!
wait_for "$work/job.txt" "^step 3 " || log "the job did not reach step 3"
log "card used before: $(used) MiB"
start=$(date +%s.%N); "$smi" suspend --release --region "$work/region.cache" 2>&1 | tee -a "$report"
log "release took $(awk -v end="$(date +%s.%N)" -v start="$start" 'BEGIN { printf "%.2f", end - start }') s; card used during: $(used) MiB"
"$smi" --region "$work/region.cache" | tee -a "$report"
python3 tests/gpu/hold_memory.py $(( gib * 1024 - 2048 )) 3 2>&1 | sed 's/^/second job: /' | tee -a "$report"
start=$(date +%s.%N); "$smi" resume --region "$work/region.cache" 2>&1 | tee -a "$report"
log "resume took $(awk -v end="$(date +%s.%N)" -v start="$start" 'BEGIN { printf "%.2f", end - start }') s; card used after: $(used) MiB"
failed=0
for cycle in $(seq "$cycles"); do
  "$smi" suspend --release --region "$work/region.cache" > "$work/cycle.txt" 2>&1 || failed=$((failed + 1))
  "$smi" resume --region "$work/region.cache" >> "$work/cycle.txt" 2>&1 || { failed=$((failed + 1)); cat "$work/cycle.txt" >> "$report"; }
done
log "$cycles release/resume cycles under the running loop: $failed failed"
wait "$job"; log "job exit $?"
if diff <(grep '^step' "$work/reference.txt") <(grep '^step' "$work/job.txt") > "$work/diff.txt"; then
  log "losses: bitwise equal to the uninterrupted run over $(grep -c '^step' "$work/job.txt") steps"
else
  log "losses differ from the uninterrupted run:"; head -5 "$work/diff.txt" | tee -a "$report"
fi
# The bare API on a job of the same size, for the baseline.
env "${env_run[@]}" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/bare.cache" python3 tests/gpu/release_train.py "$gib" 8 0.5 > "$work/bare.txt" 2>&1 &
bare=$!
wait_for "$work/bare.txt" "^step 2 "
python3 tests/gpu/checkpoint_bare.py "$bare" release 2>&1 | sed 's/^/bare: /' | tee -a "$report"
log "bare: card used while checkpointed: $(used) MiB"
python3 tests/gpu/checkpoint_bare.py "$bare" restore 2>&1 | sed 's/^/bare: /' | tee -a "$report"
wait "$bare"; log "bare job exit $?"
# Idle release: the library releases the idle loop by itself; its next step waits for the restore.
idle="${IDLE:-5s}"; gap="${IDLE_GAP:-30}"
env "${env_run[@]}" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/idle.cache" CUDA_IDLE_RELEASE="$idle" \
  VGPU_SMI="$smi" python3 tests/gpu/release_train.py "$gib" 10 0.05 4 "$gap" > "$work/idle.txt" 2>&1 &
idler=$!
wait_for "$work/idle.txt" "^idle " || log "idle: the loop did not reach its idle time"
log "idle: card used as the loop starts idling: $(used) MiB"
sleep $(( gap - 3 ))
log "idle: card used after $(( gap - 3 )) s idle (CUDA_IDLE_RELEASE=$idle): $(used) MiB"
"$smi" --region "$work/idle.cache" | tee -a "$report"
wait "$idler"; log "idle job exit $?"
grep '^step\|^idle' "$work/idle.txt" | sed 's/^/idle: /' | tee -a "$report"
if diff <(grep '^step' "$work/reference.txt" | head -10) <(grep '^step' "$work/idle.txt" | sed 's/ took .*//') > /dev/null; then
  log "idle: losses bitwise equal to the uninterrupted run's first 10 steps"
else
  log "idle: losses differ from the uninterrupted run's first 10 steps"
fi
rm -rf "$work"
