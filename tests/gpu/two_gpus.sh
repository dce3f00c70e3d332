#!/usr/bin/env bash
# Issue 15 on a machine with two GPUs of one host: run from the repository root with .device/
# prepared by scripts/gpu-prepare.sh (libvgpu.so, vgpu-smi). About 4 minutes. Report in
# $OUT/two-gpus.txt; every check prints PASS or FAIL. With fewer than two GPUs it says so and stops.
#  1. memory: CUDA_DEVICE_MEMORY_LIMIT_0=2g, _1=3g, with CUDA_VISIBLE_DEVICES unset, 1,0 and the
#     UUIDs reversed: each CUDA ordinal shows and enforces its own limit (tests/gpu/mem_devices.c);
#  2. NCCL: two PyTorch ranks, one GPU each, limit 4g per device: the all-reduce is right, each rank
#     gets torch.OutOfMemoryError past the limit, vgpu-smi shows both ranks on their own devices
#     (tests/gpu/nccl_two_ranks.py);
#  3. compute: one process, one thread per GPU (compute_two_gpus.py through compute_jobs.sh,
#     COMPUTE_PART=two): per-device limits 25/75 every second from the 2nd, and 25 with FORCE on a
#     fixed amount of work per thread, the two completion times within 10%.
set -u
root=$(pwd)
hook="$root/.device/libvgpu.so"
smi="$root/.device/vgpu-smi"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-two-gpus; rm -rf "$work"; mkdir -p "$work"
cuda_inc=/usr/local/cuda/include; stubs=/usr/local/cuda/lib64/stubs
export PYTHONUNBUFFERED=1
report="$out/two-gpus.txt"; : > "$report"
log() { echo "$@" | tee -a "$report"; }
run() { "$@" 2>&1 | tee -a "$report"; }
check() { if [ "$1" = 0 ]; then log "PASS $2"; else log "FAIL $2"; fi; }
gpus=$(nvidia-smi -L | wc -l)
log "# issue 15, two GPUs, $(date -u +%F), $gpus x $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
if [ "$gpus" -lt 2 ]; then log "only $gpus GPU: the two-GPU checks need two (skipped)"; exit 0; fi
unset CUDA_DEVICE_SM_LIMIT CUDA_DEVICE_MEMORY_LIMIT GPU_CORE_UTILIZATION_POLICY CUDA_VISIBLE_DEVICES
gcc -O1 -o $work/mem_devices tests/gpu/mem_devices.c -I$cuda_inc -L$stubs -lcuda || exit 1

log; log "## 1. memory limits per device"
uuid0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0); uuid1=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 1)
log "(physical GPU 0 is $uuid0, GPU 1 is $uuid1)"
for visible in "" "1,0" "$uuid1,$uuid0"; do
  log; log "### CUDA_DEVICE_MEMORY_LIMIT_0=2g CUDA_DEVICE_MEMORY_LIMIT_1=3g CUDA_VISIBLE_DEVICES=${visible:-unset}"
  r=$work/region-multi-${#visible}.cache
  ( [ -n "$visible" ] && export CUDA_VISIBLE_DEVICES=$visible
    CUDA_DEVICE_MEMORY_SHARED_CACHE=$r CUDA_DEVICE_MEMORY_LIMIT_0=2g CUDA_DEVICE_MEMORY_LIMIT_1=3g LD_PRELOAD=$hook \
      $work/mem_devices 4 > $work/multi.txt 2>&1 ) &
  prog=$!
  for _ in $(seq 100); do grep -q holding $work/multi.txt 2>/dev/null && break; sleep 0.2; done
  run cat $work/multi.txt
  run python3 tests/gpu/region_dump.py "$r"
  wait $prog
  # Ordinal 0 shows 2 GiB and holds at most that, ordinal 1 3 GiB, whichever GPU each is.
  python3 - $work/multi.txt <<'EOF'
import sys
limits = {0: 2048, 1: 3072}
seen = {}
for line in open(sys.argv[1]):
    words = line.split()
    if words[:1] == ["device"]:
        fields = dict(zip(words[::2], words[1::2]))
        seen[int(fields["device"])] = (int(fields["total_MiB"]), int(fields["allocated_MiB"]))
bad = [f"ordinal {o}: total {t} MiB, allocated {a} MiB, limit {limits[o]} MiB"
       for o, (t, a) in seen.items() if o in limits and (t != limits[o] or a > limits[o] or a < limits[o] - 768)]
print("; ".join(bad) if bad else f"ordinals {sorted(seen)} each at their limit")
sys.exit(1 if bad or sorted(seen) != [0, 1] else 0)
EOF
  check $? "CUDA_VISIBLE_DEVICES=${visible:-unset}: each ordinal shows and enforces its own limit (2g, 3g)"
done

log; log "## 2. NCCL all-reduce, two ranks, CUDA_DEVICE_MEMORY_LIMIT=4g"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$work/region-nccl.cache
CUDA_DEVICE_MEMORY_LIMIT=4g LD_PRELOAD=$hook python3 tests/gpu/nccl_two_ranks.py 4 8 > $work/nccl.txt 2>&1 &
nccl=$!
for _ in $(seq 300); do [ "$(grep -c holding $work/nccl.txt 2>/dev/null)" -ge 2 ] && break; sleep 0.2; done
$smi --json > $work/nccl-smi.json 2>&1
run $smi
wait $nccl; status=$?
run grep -v "^\s*$" $work/nccl.txt
check $status "NCCL: the all-reduce is right and each rank gets torch.OutOfMemoryError at the 4g limit"
python3 - $work/nccl-smi.json $work/nccl.txt "$uuid0" "$uuid1" <<'EOF'
import json, sys
regions = json.load(open(sys.argv[1]))["regions"]
uuids = sys.argv[3:5]
ranks = [json.loads(line) for line in open(sys.argv[2]) if line.startswith('{"rank"')]
expected = {rank["pid"]: [uuids[rank["device"]]] for rank in ranks}
shown = {
    process["pid"]: [device["uuid"] for device in process["devices"] if device["total_bytes"] > 0]
    for region in regions
    for process in region["processes"]
    if process["pid"] in expected and process["status"] == "live"
}
print(f"expected {expected}; the region shows {shown}")
sys.exit(0 if len(expected) == 2 and shown == expected else 1)
EOF
check $? "NCCL: the region shows each rank on its own device only"
unset CUDA_DEVICE_MEMORY_SHARED_CACHE

log; log "## 3. compute: one process, one thread per GPU (COMPUTE_PART=two of compute_jobs.sh)"
COMPUTE_PART=two OUT=$work bash tests/gpu/compute_jobs.sh > /dev/null 2>&1
run cat $work/compute-jobs-parttwo.txt
