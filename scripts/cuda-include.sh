#!/usr/bin/env bash
# Prints the CUDA include folder the build uses, as vgpu-codegen finds it: CUDA_INCLUDE_DIR, then
# $CUDA_HOME/include, then the fetched copy of the default version (the first of cuda-versions.txt).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
for dir in "${CUDA_INCLUDE_DIR:-}" "${CUDA_HOME:+$CUDA_HOME/include}"; do
  if [ -n "$dir" ] && [ -f "$dir/cuda.h" ] && [ -f "$dir/nvml.h" ]; then
    echo "$dir"
    exit 0
  fi
done
default=$(grep -Ev '^[[:space:]]*(#|$)' "$root/cuda-versions.txt" | awk '{print $1; exit}')
echo "$root/.cuda-headers/$default/include"
