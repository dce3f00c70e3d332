#!/usr/bin/env bash
# The monitoring issue's GPU checks (issue 5): nvidia-smi under the preload during a PyTorch GEMM
# with a 4 GiB limit, and a vgpu-smi --watch recording (and its plot) while the GEMM runs at
# compute limits 100, 50 and 25 in turn. Run from the repository root with .device/ prepared by
# scripts/gpu-prepare.sh. Report in $OUT/monitor.txt, plot in $OUT/monitor-watch.png.
set -u
root=$(pwd)
hook="$root/.device/libvgpu.so"
smi="$root/.device/vgpu-smi"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-monitor; mkdir -p "$work"
export PYTHONUNBUFFERED=1
report="$out/monitor.txt"; : > "$report"
log() { echo "$@" | tee -a "$report"; }
log "# monitoring GPU checks, $(date -u +%F), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$work/region.cache CUDA_DEVICE_MEMORY_LIMIT=4g
rm -f $CUDA_DEVICE_MEMORY_SHARED_CACHE

log; log "## nvidia-smi during a PyTorch GEMM (limit 4g, CUDA_DEVICE_SM_LIMIT=50)"
CUDA_DEVICE_SM_LIMIT=50 LD_PRELOAD=$hook python3 tests/gpu/monitor_gemm.py 15 > $work/gemm.txt 2>&1 &
gemm=$!
for i in $(seq 150); do grep -q reserved_MiB $work/gemm.txt 2>/dev/null && break; sleep 0.1; done
sleep 4
log "PyTorch: $(cat $work/gemm.txt)"
log "plain nvidia-smi:     $(nvidia-smi --query-gpu=memory.total,memory.used,utilization.gpu --format=csv,noheader -i 0)"
log "preloaded nvidia-smi: $(LD_PRELOAD=$hook nvidia-smi --query-gpu=memory.total,memory.used,utilization.gpu --format=csv,noheader -i 0)"
log "preloaded nvidia-smi --query-compute-apps: $(LD_PRELOAD=$hook nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
LD_PRELOAD=$hook nvidia-smi -i 0 | tee -a "$report"
$smi | tee -a "$report"
wait $gemm

log; log "## vgpu-smi --watch while the GEMM runs at limits 100, 50, 25 (5 s each)"
rm -f $work/watch.jsonl
$smi --watch 0.25 --count 80 --record $work/watch.jsonl > /dev/null 2>&1 &
watcher=$!
for limit in 100 50 25; do
  CUDA_DEVICE_SM_LIMIT=$limit LD_PRELOAD=$hook python3 tests/gpu/monitor_gemm.py 5 > /dev/null 2>&1
done
wait $watcher
log "samples recorded: $(wc -l < $work/watch.jsonl)"
$smi plot --input $work/watch.jsonl --output $out/monitor-watch.png 2>&1 | tee -a "$report"
cp $work/watch.jsonl $out/monitor-watch.jsonl
log "done"
