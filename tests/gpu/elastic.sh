#!/usr/bin/env bash
# Elastic memory (CUDA_OVERSUBSCRIBE, issue 31) as a user meets it: a process with no library holds
# all of the GPU but FREE_GIB (default 8), and jobs run beside it, each from its first step, with
# their per-step times against the same job on the card alone, the host-backed bytes vgpu-smi saw
# during the run and the card's memory (nvidia-smi). PARTS (default all of them) picks:
# - torch: a bf16 AdamW training loop of about 1.25, 1.5 and 2 times FREE_GIB (FACTORS) under a
#   limit of that size with CUDA_OVERSUBSCRIBE=true, and at 1.5 without it (PyTorch's
#   out-of-memory error expected);
# - torch-expandable: the training loop at 1.5 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#   (PyTorch's allocator maps VMM pages, which the library makes in host memory or splits when the
#   device has no room), alone and beside the other process;
# - cupy, jax: the same with tests/gpu/elastic_cupy.py (1 GiB arrays, each step reads and writes
#   all of them) and tests/gpu/elastic_jax.py (JAX with its defaults, sized to 70% of the limit);
# - jax-grow: the JAX job beside the other process with XLA_PYTHON_CLIENT_PREALLOCATE=false (XLA
#   allocates as it needs instead of one pool of three quarters of the device, which the device
#   cannot back and which is then host memory whole);
# - vmm: one VMM allocation of 1.5x FREE_GIB made, mapped, written whole and read back through the
#   driver API as XLA makes its pool (tests/gpu/vmm_split.py), under a limit of 2x with and
#   without CUDA_OVERSUBSCRIBE (the library splits it where the device ends), and on the card alone;
# - cold: a CuPy job that allocates 2x FREE_GIB and touches 0.8x FREE_GIB a step, under the
#   library with the cold arrays allocated first and with the hot ones first, and as unified memory
#   (no library, cold first): no advice, and preferring the device while mapped wherever it is;
# - hot: a CuPy job that touches 1.5x FREE_GIB every step, under the library and as unified memory
#   four ways (no advice, mapped where it is, preferring the device, preferring host memory);
# - moves: the training loop at 1.5, during which the other process exits (the spills move back).
# Run from the repository root with .device/ prepared (scripts/gpu-prepare.sh). Report in
# $OUT/elastic.txt.
set -u
root=$(pwd)
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
report="$out/elastic.txt"; : > "$report"
free_gib="${FREE_GIB:-8}"
steps="${STEPS:-6}"
factors="${FACTORS:-1.25 1.5 2}"
parts="${PARTS:-torch torch-expandable cupy jax jax-grow vmm cold hot moves}"
library="$root/.device/libvgpu.so"; smi="$root/.device/vgpu-smi"
export PYTHONUNBUFFERED=1
log() { echo "$@" | tee -a "$report"; }
card() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits | head -1; }
part() { [[ " $parts " == *" $1 "* ]]; }
gib_of() { python3 -c "print(round($free_gib * $1 + $2, 2))"; }
# JAX preallocates 75% of the memory the device reports (the limit) and serves its arrays from that:
# its job is sized to 70% of the limit.
jax_share() { python3 -c "print($1 * 0.7)"; }
limit_of() { echo "$(python3 -c "print(int($free_gib * $1 * 1024))")m"; }
log "# elastic memory, $(date -u '+%F %T') UTC, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
log "# the other process leaves $free_gib GiB free; $steps steps a run; parts: $parts"
# job NAME LIMIT OVERSUBSCRIBE RELEASE PROGRAM ARGS...: runs PROGRAM under the library (LIMIT
# none: no limit; OVERSUBSCRIBE unset: no variable; LIBRARY=none in the environment: without the
# library), samples vgpu-smi, prints a summary line and the program's output; with RELEASE, the
# other process exits once the program has printed that step.
job() {
  local name=$1 limit=$2 over=$3 release=$4 work
  shift 4
  work=$(mktemp -d /tmp/vgpu-elastic.XXXXXX)
  local env=(CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/region.cache")
  [ "${LIBRARY:-}" != none ] && env+=(LD_PRELOAD="$library")
  [ "$limit" != none ] && env+=(CUDA_DEVICE_MEMORY_LIMIT="$limit")
  [ "$over" != unset ] && env+=(CUDA_OVERSUBSCRIBE="$over")
  env "${env[@]}" timeout 180 python3 "$@" > "$work/job.txt" 2>&1 &
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
  log "== $name: $(basename "$1") ${*:2}, library ${LIBRARY:-yes}, limit $limit, CUDA_OVERSUBSCRIBE=$over: exit $status, peak host-backed $((host >> 20)) MiB, card used/total MiB now $(card)"
  sed 's/^/   /' "$work/job.txt" | grep -v "^   *$" | tail -n 40 | tee -a "$report"
  rm -rf "$work"
}
train=tests/gpu/elastic_train.py; cupy=tests/gpu/elastic_cupy.py; jax=tests/gpu/elastic_jax.py
vmm=tests/gpu/vmm_split.py
# The card alone: each job's reference.
for factor in $factors; do
  part torch && job "alone x$factor" none unset "" "$train" "$(gib_of "$factor" -2)" "$steps"
  part cupy && job "alone x$factor" none unset "" "$cupy" device "$(gib_of "$factor" -1)" 0 "$steps"
  part jax && job "alone x$factor" none unset "" "$jax" "$(gib_of "$(jax_share "$factor")" 0)" "$steps"
done
part vmm && job "alone" none unset "" "$vmm" "$(gib_of 1.5 0)" "$steps"
part torch-expandable && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True job "alone x1.5, expandable segments" \
  none unset "" "$train" "$(gib_of 1.5 -2)" "$steps"
part cold && job "cold alone" none unset "" "$cupy" device "$(gib_of 0.8 0)" "$(gib_of 1.2 0)" "$steps"
part hot && job "hot alone" none unset "" "$cupy" device "$(gib_of 1.5 0)" 0 "$steps"
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
hold_mib=$((total_mib - free_gib * 1024 - 600))
python3 tests/gpu/hold_memory.py "$hold_mib" 100000 > "$out/hold.txt" 2>&1 &
holder=$!
for _ in $(seq 60); do grep -q holding "$out/hold.txt" 2>/dev/null && break; sleep 1; done
log "# the other process holds $hold_mib MiB: card used/total MiB $(card)"
for factor in $factors; do
  part torch && job "shared x$factor" "$(limit_of "$factor")" true "" "$train" "$(gib_of "$factor" -2)" "$steps"
  part cupy && job "shared x$factor" "$(limit_of "$factor")" true "" "$cupy" device "$(gib_of "$factor" -1)" 0 "$steps"
  part jax && job "shared x$factor" "$(limit_of "$factor")" true "" "$jax" "$(gib_of "$(jax_share "$factor")" 0)" "$steps"
  part jax-grow && XLA_PYTHON_CLIENT_PREALLOCATE=false job "shared x$factor, XLA_PYTHON_CLIENT_PREALLOCATE=false" \
    "$(limit_of "$factor")" true "" "$jax" "$(gib_of "$(jax_share "$factor")" 0)" "$steps"
done
part vmm && job "shared x2" "$(limit_of 2)" true "" "$vmm" "$(gib_of 1.5 0)" "$steps"
part torch-expandable && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True job "shared x1.5, expandable segments" \
  "$(limit_of 1.5)" true "" "$train" "$(gib_of 1.5 -2)" "$steps"
part vmm && job "shared x2, no variable" "$(limit_of 2)" unset "" "$vmm" "$(gib_of 1.5 0)" "$steps"
part torch && job "shared x1.5, no variable" "$(limit_of 1.5)" unset "" "$train" "$(gib_of 1.5 -2)" "$steps"
part cupy && job "shared x1.5, no variable" "$(limit_of 1.5)" unset "" "$cupy" device "$(gib_of 1.5 -1)" 0 "$steps"
part jax && job "shared x1.5, no variable" "$(limit_of 1.5)" unset "" "$jax" "$(gib_of "$(jax_share 1.5)" 0)" "$steps"
if part cold; then
  job "cold shared" "$(limit_of 2.1)" true "" "$cupy" device "$(gib_of 0.8 0)" "$(gib_of 1.2 0)" "$steps"
  job "cold shared, hot first" "$(limit_of 2.1)" true "" "$cupy" device "$(gib_of 0.8 0)" "$(gib_of 1.2 0)" "$steps" hot-first
  for mode in managed managed-device; do
    LIBRARY=none job "cold shared, unified memory ($mode)" none unset "" "$cupy" "$mode" "$(gib_of 0.8 0)" "$(gib_of 1.2 0)" "$steps"
  done
fi
if part hot; then
  job "hot shared" "$(limit_of 1.6)" true "" "$cupy" device "$(gib_of 1.5 0)" 0 "$steps"
  for mode in managed managed-accessed-by managed-device managed-host; do
    LIBRARY=none job "hot shared, unified memory ($mode)" none unset "" "$cupy" "$mode" "$(gib_of 1.5 0)" 0 "$steps"
  done
fi
# Moves back: the other process exits while the loop runs; its steps should return to the
# card-alone time once the library has moved its spills onto the device.
part moves && job "shared x1.5, the other exits" "$(limit_of 1.5)" true 4 "$train" "$(gib_of 1.5 -2)" 24
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
