#!/usr/bin/env bash
# The memory issue's GPU suite (issue 3): run from the repository root on the GPU machine with
# .device/ prepared by scripts/gpu-prepare.sh. Prints a report and writes it to $OUT/memory.txt.
set -u
root=$(pwd)
hook="$root/.device/libvgpu.so"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-mem; mkdir -p "$work"
cuda_inc=/usr/local/cuda/include; stubs=/usr/local/cuda/lib64/stubs
export PYTHONUNBUFFERED=1
report="$out/memory.txt"; : > "$report"
log() { echo "$@" | tee -a "$report"; }
run() { "$@" 2>&1 | tee -a "$report"; }
region() { echo "$work/region-$1.cache"; }
gpus=$(nvidia-smi -L | wc -l)
log "# memory GPU suite, $(date -u +%F), $gpus x $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
gcc -O1 -o $work/drvlimit tests/gpu/drvlimit.c -I$cuda_inc -L$stubs -lcuda || exit 1
gcc -O1 -o $work/init_time tests/programs/init_time.c -I$cuda_inc -L$stubs -lcuda || exit 1
nvcc -O2 -arch=sm_90 -o $work/hookbench tests/gpu/hookbench.cu || exit 1

log; log "## driver API, CUDA_DEVICE_MEMORY_LIMIT=1g"
CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region drv) CUDA_DEVICE_MEMORY_LIMIT=1g LD_PRELOAD=$hook run $work/drvlimit

for conf in "" "expandable_segments:True" "backend:cudaMallocAsync"; do
  log; log "## PyTorch, CUDA_DEVICE_MEMORY_LIMIT=4g, PYTORCH_CUDA_ALLOC_CONF=${conf:-default}"
  PYTORCH_CUDA_ALLOC_CONF=$conf CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region torch) CUDA_DEVICE_MEMORY_LIMIT=4g \
    LD_PRELOAD=$hook run python3 tests/gpu/torch_memory.py
done

log; log "## nvidia-smi while a PyTorch process of the container holds 2 GiB (limit 4g)"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region smi) CUDA_DEVICE_MEMORY_LIMIT=4g
LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 2048 20 > $work/hold.txt 2>&1 &
holder=$!
for i in $(seq 100); do grep -q holding $work/hold.txt 2>/dev/null && break; sleep 0.2; done
log "plain nvidia-smi:   $(nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv,noheader -i 0)"
log "preloaded nvidia-smi: $(LD_PRELOAD=$hook nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv,noheader -i 0)"
LD_PRELOAD=$hook nvidia-smi -i 0 | sed -n '1,20p' | tee -a "$report"
run python3 tests/gpu/region_dump.py $CUDA_DEVICE_MEMORY_SHARED_CACHE
kill $holder; wait $holder 2>/dev/null
unset CUDA_DEVICE_MEMORY_SHARED_CACHE CUDA_DEVICE_MEMORY_LIMIT

log; log "## two processes, one region, limit 4g: the second cannot take what the first holds until the first is killed"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region two) CUDA_DEVICE_MEMORY_LIMIT=4g
LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 3072 60 > $work/first.txt 2>&1 &
first=$!
for i in $(seq 100); do grep -q holding $work/first.txt 2>/dev/null && break; sleep 0.2; done
log "first: $(cat $work/first.txt)"
log "second, first alive: $(LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 2048 0 2>&1 | tail -1)"
kill -9 $first; wait $first 2>/dev/null
log "second, first killed with SIGKILL: $(LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 2048 0 2>&1 | tail -1)"
unset CUDA_DEVICE_MEMORY_SHARED_CACHE CUDA_DEVICE_MEMORY_LIMIT

log; log "## JAX, CUDA_DEVICE_MEMORY_LIMIT=4g"
CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region jax) CUDA_DEVICE_MEMORY_LIMIT=4g LD_PRELOAD=$hook run python3 tests/gpu/jax_memory.py

# Two GPUs (per-device limits, CUDA_VISIBLE_DEVICES reordered): tests/gpu/two_gpus.sh.

log; log "## overhead with a limit set (CUDA_DEVICE_MEMORY_LIMIT=100g, so every allocation is charged), 7 interleaved pairs, pinned to CPU 2"
for i in 1 2 3 4 5 6 7; do
  taskset -c 2 $work/hookbench > $work/hb-native-$i.txt
  CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region bench) CUDA_DEVICE_MEMORY_LIMIT=100g LD_PRELOAD=$hook taskset -c 2 $work/hookbench > $work/hb-hooked-$i.txt
done
python3 - $work <<'PY' | tee -a "$report"
import statistics, sys
work = sys.argv[1]
load = lambda kind: [{l.split()[0]: float(l.split()[1]) for l in open(f"{work}/hb-{kind}-{i}.txt")} for i in range(1, 8)]
n, h = load("native"), load("hooked")
print(f"{'measure':28} {'native ns':>10} {'hooked ns':>10} {'added ns':>9} {'ratio':>7}")
for key in n[0]:
    if key == "memgetinfo_total_MiB": continue
    mn = statistics.median(r[key] for r in n); mh = statistics.median(r[key] for r in h)
    print(f"{key:28} {mn:10.1f} {mh:10.1f} {mh-mn:9.1f} {mh/mn:7.3f}")
PY

log; log "## first cuInit (us), median of 11, native vs hooked with a region another process holds open"
CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region init) CUDA_DEVICE_MEMORY_LIMIT=4g LD_PRELOAD=$hook python3 tests/gpu/hold_memory.py 16 30 > $work/init-holder.txt 2>&1 &
keeper=$!
for i in $(seq 100); do grep -q holding $work/init-holder.txt 2>/dev/null && break; sleep 0.2; done
native=$(for i in $(seq 11); do $work/init_time | awk '{print $2}'; done | sort -n | sed -n 6p)
hooked=$(for i in $(seq 11); do CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region init) CUDA_DEVICE_MEMORY_LIMIT=4g LD_PRELOAD=$hook $work/init_time | awk '{print $2}'; done | sort -n | sed -n 6p)
log "cuInit native $native us, hooked $hooked us"
kill $keeper; wait $keeper 2>/dev/null
log; log "done"
