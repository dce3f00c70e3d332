#!/usr/bin/env bash
# Native and hooked runs of a job alternated (tests/gpu/native_vs_hook.py): a job's own spread
# from process to process, set against the compute limit's error. Run from the repository root on
# the GPU machine after scripts/gpu-prepare.sh; the report is also written to $OUT/native-vs-hook.txt.
set -u -o pipefail
root=$(pwd)
hook="${VGPU_HOOK:-$root/.device/libvgpu.so}"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-native-vs-hook; rm -rf "$work"; mkdir -p "$work"
[ -f "$hook" ] || { echo "native_vs_hook.sh: $hook is missing (run scripts/gpu-prepare.sh here first)" >&2; exit 1; }
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
{
  echo "# native and hooked runs alternated, $(date -u '+%F %T') UTC, ${gpu:-no nvidia-smi}"
  echo "# library: $hook"
  python3 tests/gpu/native_vs_hook.py "$hook" "$work"
} 2>&1 | tee "$out/native-vs-hook.txt"
