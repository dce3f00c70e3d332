#!/usr/bin/env bash
# The foundation's GPU suite (issue 2): run on the H200 machine from the repository root with the
# release libvgpu.so in .device/ (see tests/gpu/README.md). Prints a report; also writes it to $OUT.
set -u
root=$(pwd)
hook="$root/.device/libvgpu.so"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-gpu; mkdir -p "$work"
cuda_inc=/usr/local/cuda/include; stubs=/usr/local/cuda/lib64/stubs
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log() { echo "$@" | tee -a "$out/foundation.txt"; }
: > "$out/foundation.txt"
log "# foundation GPU suite, $(date -u +%F), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"

nvcc -O2 -arch=sm_90 -o $work/hookbench tests/gpu/hookbench.cu || exit 1
gcc -O1 -o $work/drvlimit tests/gpu/drvlimit.c -I$cuda_inc -L$stubs -lcuda || exit 1
gcc -O1 -o $work/ctxsize tests/gpu/ctxsize.c -I$cuda_inc -L$stubs -lcuda -lnvidia-ml -L/usr/lib/x86_64-linux-gnu || exit 1
for p in reach procaddr calls; do gcc -O1 -o $work/$p tests/programs/$p.c -I$cuda_inc -L$stubs -lcuda -lnvidia-ml -ldl || exit 1; done

log; log "## three ways to the driver (status, library of the pointer, symbol)"
log "native:"; $work/reach | tee -a "$out/foundation.txt"
log "hooked:"; LD_PRELOAD=$hook $work/reach | tee -a "$out/foundation.txt"

log; log "## cuGetProcAddress_v2 for every base name x 5 versions x 3 flags"
$work/procaddr < .device/proc-names.txt > $work/pa-native.txt
LD_PRELOAD=$hook $work/procaddr < .device/proc-names.txt > $work/pa-hooked.txt
python3 - $work/pa-native.txt $work/pa-hooked.txt <<'PY' | tee -a "$out/foundation.txt"
import sys
native = [l.split() for l in open(sys.argv[1])]
hooked = [l.split() for l in open(sys.argv[2])]
ok = status_diff = variant_diff = not_ours = 0
for n, h in zip(native, hooked):
    if n[:5] != h[:5]: status_diff += 1; print("status differs:", n, h); continue
    if n[5] != "-":  # the driver returned a function (it may say CUDA_SUCCESS with no pointer)
        if h[5] != "libvgpu.so": not_ours += 1; print("not mapped:", n, h)
        elif n[6] != h[6]: variant_diff += 1; print("variant differs:", n, h)
        else: ok += 1
print(f"lookups {len(native)}; answers with a function {ok + variant_diff + not_ours}, mapped to our wrapper of the same variant {ok}; status differs {status_diff}; variant differs {variant_diff}; not mapped {not_ours}")
PY

log; log "## entry points the driver lacks (the library's headers may be newer than the driver)"
# Each must answer CUDA_ERROR_NOT_FOUND (500) through the hook, with one error line each.
python3 - .device/exports.txt > $work/lacking.txt <<'PY'
import ctypes, sys
driver = ctypes.CDLL("libcuda.so.1")
for name in open(sys.argv[1]).read().split():
    if not hasattr(driver, name):
        print(name)
PY
: > $work/lacking-out.txt; : > $work/lacking-err.txt
if [ -s $work/lacking.txt ]; then
  LD_PRELOAD=$hook $work/calls init $(sed 's/^/call=/' $work/lacking.txt) $(sed 's/^/call=/' $work/lacking.txt) \
    > $work/lacking-out.txt 2> $work/lacking-err.txt
fi
python3 - $work/lacking.txt $work/lacking-out.txt $work/lacking-err.txt "$(wc -l < .device/exports.txt)" <<'PY' | tee -a "$out/foundation.txt"
import sys
lacking = open(sys.argv[1]).read().split()
answers = [l.split() for l in open(sys.argv[2]).read().splitlines() if l.startswith("call ")]
err = open(sys.argv[3]).read()
wrong = [a for a in answers if a[2] != "500"]
lines = {name: err.count(f" {name} is missing from") for name in lacking}
print(f"exported {sys.argv[4]}; the driver lacks {len(lacking)}: {' '.join(lacking[:12])}{' ...' if len(lacking) > 12 else ''}")
print(f"calls {len(answers)} (expected {2 * len(lacking)}), not CUDA_ERROR_NOT_FOUND: {len(wrong)} {wrong[:5]}; "
      f"functions with exactly one error line: {sum(1 for n in lines.values() if n == 1)} of {len(lacking)}")
PY

log; log "## same results with and without the hook"
for prog in drvlimit; do
  a=$($work/$prog 2>&1); b=$(LD_PRELOAD=$hook $work/$prog 2>&1)
  [ "$a" = "$b" ] && log "$prog: identical" || { log "$prog: DIFFERENT"; log "$a"; log "$b"; }
done
for fw in torch jax cupy; do
  a=$(python3 tests/gpu/same_results.py $fw 2>/dev/null | tail -1); b=$(LD_PRELOAD=$hook python3 tests/gpu/same_results.py $fw 2>/dev/null | tail -1)
  [ -n "$a" ] && [ "$a" = "$b" ] && log "$fw: identical $a" || { log "$fw: DIFFERENT"; log " native $a"; log " hooked $b"; }
done

log; log "## cuGetProcAddress answers during a PyTorch run (LIBCUDA_LOG_LEVEL=4)"
LIBCUDA_LOG_LEVEL=4 LD_PRELOAD=$hook python3 tests/gpu/same_results.py torch 2> $work/torch-debug.txt >/dev/null
mapped=$(grep -c 'cuGetProcAddress(.*-> cu[A-Za-z0-9_]* (mapped' $work/torch-debug.txt)
unchanged=$(grep -c 'unchanged (mapped' $work/torch-debug.txt)
log "answers mapped to our wrappers: $mapped; left unchanged: $unchanged"
grep 'unchanged (mapped' $work/torch-debug.txt | sed 's/.*cuGetProcAddress(\([^,]*\),.*-> [^ ]* (\([^)]*\)).*/  \1 \2/' | sort | uniq -c | sort -rn | head -20 | tee -a "$out/foundation.txt"
cp $work/torch-debug.txt "$out/torch-debug.txt"

log; log "## context size (for the memory issue)"
$work/ctxsize | tee -a "$out/foundation.txt"

log; log "## overhead: hookbench, 5 interleaved pairs (ns per call)"
for i in 1 2 3 4 5; do
  $work/hookbench > $work/hb-native-$i.txt; LD_PRELOAD=$hook $work/hookbench > $work/hb-hooked-$i.txt
done
python3 - $work <<'PY' | tee -a "$out/foundation.txt"
import statistics, sys, glob
work = sys.argv[1]
def load(kind):
    runs = []
    for i in range(1, 6):
        runs.append({l.split()[0]: float(l.split()[1]) for l in open(f"{work}/hb-{kind}-{i}.txt")})
    return runs
n, h = load("native"), load("hooked")
print(f"{'measure':28} {'native':>10} {'hooked':>10} {'ratio':>7}")
for key in n[0]:
    if key == "memgetinfo_total_MiB": continue
    mn = statistics.median(r[key] for r in n); mh = statistics.median(r[key] for r in h)
    print(f"{key:28} {mn:10.1f} {mh:10.1f} {mh/mn:7.3f}")
PY

log; log "## PyTorch throughput, 3 interleaved pairs of 3 s (iterations/s)"
for mode in gemm small; do
  for i in 1 2 3; do
    python3 tests/gpu/torch_limits.py $mode 3 | tail -1 >> $work/tl-native-$mode.txt
    LD_PRELOAD=$hook python3 tests/gpu/torch_limits.py $mode 3 | tail -1 >> $work/tl-hooked-$mode.txt
  done
  python3 - $work/tl-native-$mode.txt $work/tl-hooked-$mode.txt $mode <<'PY' | tee -a "$out/foundation.txt"
import json, statistics, sys
n = [json.loads(l)["iters_per_s"] for l in open(sys.argv[1])]
h = [json.loads(l)["iters_per_s"] for l in open(sys.argv[2])]
print(f"{sys.argv[3]:6} native {statistics.median(n):9.1f}  hooked {statistics.median(h):9.1f}  hooked/native {statistics.median(h)/statistics.median(n):.3f}   runs {n} {h}")
PY
done
log; log "done"
