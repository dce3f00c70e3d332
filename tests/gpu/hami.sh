#!/usr/bin/env bash
# Issue 12's GPU checks (HAMi integration), with PyTorch: a process that exits normally leaves no
# slot and no memory in the region (vgpu-smi's USED and the slots HAMi sums); a killed one is listed
# dead and not counted; last_kernel_time follows an unlimited GEMM; a compute limit set live with
# vgpu-smi set holds a running unlimited GEMM within a second and lifting it frees it again; with a
# limit set and HAMi's utilization_switch at 0 a GEMM runs unheld and its share is published; a
# memory limit lowered below the usage refuses the next allocation. Run from the repository root
# with .device/ prepared by scripts/gpu-prepare.sh (libvgpu.so and vgpu-smi). About 1 minute.
# Report in $OUT/hami.txt; each check prints PASS or FAIL.
set -u
root=$(pwd)
hook="$root/.device/libvgpu.so"
smi="$root/.device/vgpu-smi"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-hami; rm -rf "$work"; mkdir -p "$work"
export PYTHONUNBUFFERED=1
report="$out/hami.txt"; : > "$report"
log() { echo "$@" | tee -a "$report"; }
check() { if [ "$1" = 0 ]; then log "PASS $2"; else log "FAIL $2"; fi; }
log "# issue 12 GPU checks, $(date -u +%F), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$work/region.cache
unset CUDA_DEVICE_SM_LIMIT CUDA_DEVICE_MEMORY_LIMIT GPU_CORE_UTILIZATION_POLICY

# The region's figures as HAMi's monitor computes them (slots in use) and as vgpu-smi shows them.
hami_sum() { python3 - "$CUDA_DEVICE_MEMORY_SHARED_CACHE" <<'EOF'
import struct, sys
data = open(sys.argv[1], "rb").read()
proc_num = max(0, min(struct.unpack_from("<i", data, 2008896)[0], 1024))
slots = [1856 + 1960 * s for s in range(proc_num)]
live = [b for b in slots if struct.unpack_from("<i", data, b + 1928)[0] != 0]
total = sum(struct.unpack_from("<Q", data, b + 8 + 32)[0] for b in live)
print(f"slots {len(live)} total_MiB {total >> 20}")
EOF
}
smi_used() { $smi --json | python3 -c 'import json,sys; r=json.load(sys.stdin)["regions"][0]; d=r["devices"][0]; print(d["memory_used_bytes"] >> 20, len(r["processes"]), d["memory_limit_bytes"], d["sm_limit_percent"])'; }
last_kernel_time() { python3 -c 'import struct,sys; print(struct.unpack_from("<q", open(sys.argv[1],"rb").read(), 2008912)[0])' "$CUDA_DEVICE_MEMORY_SHARED_CACHE"; }

log; log "## a process that exits normally (4 GiB held, limit 8g)"
# A keeper holds the region in use (otherwise the next process re-creates it): 100 MiB.
CUDA_DEVICE_MEMORY_LIMIT=8g LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 100 600 > $work/keeper.txt 2>&1 &
keeper=$!
for i in $(seq 100); do grep -q holding $work/keeper.txt 2>/dev/null && break; sleep 0.2; done
CUDA_DEVICE_MEMORY_LIMIT=8g LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 4096 3 > $work/exiting.txt 2>&1 &
exiting=$!
for i in $(seq 100); do grep -q holding $work/exiting.txt 2>/dev/null && break; sleep 0.2; done
during="$(hami_sum) | vgpu-smi used_MiB processes: $(smi_used)"
log "while both run: $during"
wait $exiting
after="$(hami_sum) | vgpu-smi used_MiB processes: $(smi_used)"
log "after it exited: $after"
$smi | tee -a "$report"
keeper_only=$(hami_sum | awk '{print $4}')
# Without this, a sum read before the exiting process allocated would pass the next check too.
[ "$(echo "$during" | awk '{print $2}')" = 2 ] && [ "$(echo "$during" | awk '{print $4}')" -ge 4096 ]
check $? "while both ran, HAMi's sum counted both (2 slots, over 4096 MiB: $during)"
[ "$(hami_sum | awk '{print $2}')" = 1 ] && [ "$keeper_only" -lt 2048 ]; check $? "the exited process's slot and 4 GiB are gone (HAMi's sum: $keeper_only MiB, the keeper's context and 100 MiB)"

log; log "## a killed process (2 GiB): listed dead, not counted by vgpu-smi, reaped by the next start"
CUDA_DEVICE_MEMORY_LIMIT=8g LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 2048 30 > $work/killed.txt 2>&1 &
killed=$!
for i in $(seq 100); do grep -q holding $work/killed.txt 2>/dev/null && break; sleep 0.2; done
kill -9 $killed; wait $killed 2>/dev/null
log "after SIGKILL: $(hami_sum) | vgpu-smi used_MiB processes: $(smi_used)"
$smi | tee -a "$report"
smi_mib=$(smi_used | awk '{print $1}')
[ "$smi_mib" -lt 2048 ]; check $? "vgpu-smi does not count the killed process ($smi_mib MiB used)"

log; log "## last_kernel_time during an unlimited GEMM (no compute limit)"
python3 - "$CUDA_DEVICE_MEMORY_SHARED_CACHE" <<'EOF'
import struct, sys
with open(sys.argv[1], "r+b") as f:
    f.seek(2008912); f.write(struct.pack("<q", 1000000000))
EOF
LD_PRELOAD=$hook python3 tests/gpu/monitor_gemm.py 4 > /dev/null 2>&1
ktime=$(last_kernel_time); now=$(date +%s)
log "last_kernel_time $ktime, now $now"
[ $((now - ktime)) -le 3 ]; check $? "an unlimited GEMM moved last_kernel_time (written 1000000000 before)"

log; log "## live compute limit: an unlimited GEMM, vgpu-smi set --sm 30 at its 4th second, --sm 0 at its 10th"
LD_PRELOAD=$hook python3 - > $work/rate.txt 2>&1 <<'EOF' &
import time, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
start = time.time()
second, count = 0, 0
while time.time() - start < 16:
    for _ in range(10):
        b = a @ a
    torch.cuda.synchronize()
    count += 10
    now = int(time.time() - start)
    if now != second:
        print(f"second {second} it/s {count}", flush=True)
        second, count = now, 0
EOF
gemm=$!
wait_second() { for i in $(seq 300); do grep -q "^second $1 " $work/rate.txt 2>/dev/null && return; sleep 0.1; done; }
# Set at the start of second 4 of the GEMM, lifted at the start of second 10.
wait_second 3; log "$($smi set --sm 30 | tail -1)"
wait_second 9; log "$($smi set --sm 0 | tail -1)"
wait $gemm
cat $work/rate.txt | tee -a "$report"
python3 - $work/rate.txt <<'EOF' | tee -a "$report"
import sys
rate = {int(l.split()[1]): float(l.split()[3]) for l in open(sys.argv[1]) if l.startswith("second")}
free = sum(rate[s] for s in (1, 2, 3)) / 3
held = sum(rate[s] for s in (5, 6, 7, 8, 9)) / 5
after = sum(rate[s] for s in (12, 13, 14)) / 3
print(f"unlimited {free:.0f} it/s, seconds 5-9 at 30%: {held:.0f} it/s ({100 * held / free:.1f}%), seconds 12-14 after lifting: {after:.0f} it/s")
print("PASS live compute limit" if abs(100 * held / free - 30) <= 8 and after > 0.9 * free else "FAIL live compute limit")
EOF

log; log "## the share published while HAMi lifts the limit (sm 30, utilization_switch 0)"
$smi set --sm 30 | tail -1 | tee -a "$report"
switch() { python3 - "$CUDA_DEVICE_MEMORY_SHARED_CACHE" "$1" <<'EOF'
import struct, sys
with open(sys.argv[1], "r+b") as f:
    f.seek(2008900); f.write(struct.pack("<i", int(sys.argv[2])))
EOF
}
switch 0
LD_PRELOAD=$hook python3 tests/gpu/monitor_gemm.py 6 > $work/lifted.txt 2>&1 &
lifted=$!
# Read 3 s into the GEMM's loop (PyTorch's start-up takes seconds of its own before it).
for i in $(seq 300); do grep -q "^reserved_MiB" $work/lifted.txt 2>/dev/null && break; sleep 0.1; done
sleep 3
published=$($smi --json | python3 -c 'import json,sys; r=json.load(sys.stdin)["regions"][0]; print(max([d["sm_util_percent"] for p in r["processes"] for d in p["devices"]] or [0]), r["hami"]["utilization_switch"])')
wait $lifted
log "a GEMM at sm 30 with the switch at 0, 3 s into its loop: published sm_util and switch: $published"
[ "$(echo $published | awk '{print ($1 >= 80 && $2 == 0)}')" = 1 ]; check $? "with the switch at 0 the GEMM runs unheld and its share is published (HAMi-core publishes it whenever a limit is set)"
switch 1
$smi set --sm 0 | tail -1 | tee -a "$report"

log; log "## live memory limit lowered below the usage (keeper holds 100 MiB and a context)"
$smi set --memory 64m | tail -1 | tee -a "$report"
CUDA_DEVICE_MEMORY_LIMIT=8g LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 16 1 > $work/refused.txt 2>&1
log "a new process allocating 16 MiB: $(cat $work/refused.txt | tail -1)"
grep -q oom $work/refused.txt; check $? "lowered below the usage: the next allocation is refused"
log "usage after: $(hami_sum)"
kill $keeper 2>/dev/null; sleep 1; kill -9 $keeper 2>/dev/null; wait $keeper 2>/dev/null
log "done $(date -u +%T)"
