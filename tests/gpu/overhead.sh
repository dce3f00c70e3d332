#!/usr/bin/env bash
# Launch overhead at limit 100 and unset (issue 4 target: preloaded / native <= 1.02, interleaved
# runs, medians). Run from the repository root on the GPU machine with .device/libvgpu.so.
# Runs tests/gpu/launch_overhead.cu PAIRS times (default 15) as a triple: native, preloaded with no
# limit, preloaded with CUDA_DEVICE_SM_LIMIT=100, rotating the order each round, every process
# pinned to one CPU; prints each round's ns per launch and the median of the per-round ratios
# with their spread (25th-75th percentile), for a 1-block and a 1024-block empty kernel. Then the
# in-process A/B (tests/gpu/launch_ab.c: the hook's cuLaunchKernel against libcuda's own, in
# alternating blocks of one process), which the VM's noise does not reach: no preload (control),
# preloaded with no limit, preloaded at limit 100.
set -u
root=$(pwd)
hook="${VGPU_HOOK:-$root/.device/libvgpu.so}"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-overhead; rm -rf "$work"; mkdir -p "$work"
pairs="${PAIRS:-15}"
nvcc -O2 -arch=sm_90 -o "$work/launch_overhead" tests/gpu/launch_overhead.cu || exit 1
printf 'extern "C" __global__ void empty() {}\n' > "$work/empty.cu"
nvcc -cubin -arch=sm_90 -o "$work/empty.cubin" "$work/empty.cu" || exit 1
gcc -O1 -o "$work/launch_ab" tests/gpu/launch_ab.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs -lcuda || exit 1
pin=(); [ "$(nproc)" -ge 4 ] && command -v taskset >/dev/null && pin=(taskset -c 3)
export CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/region.cache"
run() { # kind grid
  case $1 in
    native) env -u LD_PRELOAD "${pin[@]}" "$work/launch_overhead" 7 20000 "$2" ;;
    unset) LD_PRELOAD="$hook" "${pin[@]}" "$work/launch_overhead" 7 20000 "$2" ;;
    limit100) LD_PRELOAD="$hook" CUDA_DEVICE_SM_LIMIT=100 "${pin[@]}" "$work/launch_overhead" 7 20000 "$2" ;;
  esac | awk '{print $2}'
}
{
  echo "# launch overhead, $(date -u +%F), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $pairs rounds"
  for grid in 1 1024; do
    echo "grid $grid: round native unset limit100 (ns per launch)"
    for i in $(seq 1 "$pairs"); do
      case $((i % 3)) in
        0) order="native unset limit100" ;;
        1) order="unset limit100 native" ;;
        2) order="limit100 native unset" ;;
      esac
      declare -A r=()
      for kind in $order; do r[$kind]=$(run $kind $grid); done
      echo "  $i ${r[native]} ${r[unset]} ${r[limit100]}"
    done
  done
} | tee "$work/raw.txt"
python3 - "$work/raw.txt" <<'PY' | tee -a "$out/overhead.txt"
import statistics, sys
grid = None
rows = {}
for line in open(sys.argv[1]):
    if line.startswith("grid "):
        grid = line.split()[1].rstrip(":"); rows[grid] = []
    elif grid and line.strip() and line.split()[0].isdigit():
        _, n, u, l = line.split(); rows[grid].append((float(n), float(u), float(l)))
print("| kernel | native ns | unset ns | limit 100 ns | unset / native | limit 100 / native | ratio spread (25-75%) |")
print("|---|---:|---:|---:|---:|---:|---|")
for grid, r in rows.items():
    n = statistics.median(x[0] for x in r); u = statistics.median(x[1] for x in r); l = statistics.median(x[2] for x in r)
    ru = sorted(x[1] / x[0] for x in r); rl = sorted(x[2] / x[0] for x in r)
    q = lambda v, p: v[min(len(v) - 1, int(p * len(v)))]
    print(f"| empty, {grid} block(s) | {n:.0f} | {u:.0f} | {l:.0f} | {statistics.median(ru):.3f} | {statistics.median(rl):.3f} | {q(ru,.25):.3f}-{q(ru,.75):.3f} / {q(rl,.25):.3f}-{q(rl,.75):.3f} |")
PY
{
  echo
  echo "in-process A/B, hook's cuLaunchKernel (A) against libcuda's (B), 60 pairs of 4000 launches:"
  echo "| kernel | run | A ns | B ns | A / B (median) | 25-75% |"
  echo "|---|---|---:|---:|---:|---|"
  for grid in 1 1024; do
    for kind in control unset limit100; do
      case $kind in
        control) line=$(env -u LD_PRELOAD "${pin[@]}" "$work/launch_ab" "$work/empty.cubin" 60 4000 $grid) ;;
        unset) line=$(LD_PRELOAD="$hook" "${pin[@]}" "$work/launch_ab" "$work/empty.cubin" 60 4000 $grid) ;;
        limit100) line=$(LD_PRELOAD="$hook" CUDA_DEVICE_SM_LIMIT=100 "${pin[@]}" "$work/launch_ab" "$work/empty.cubin" 60 4000 $grid) ;;
      esac
      set -- $line
      echo "| empty, $grid block(s) | $kind | $2 | $4 | $6 | $8-${10} |"
    done
  done
} | tee -a "$out/overhead.txt"
