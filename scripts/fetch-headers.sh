#!/usr/bin/env bash
# Fetches the pinned CUDA and NVML header wheels into .cuda-headers/<version>/include, and libclang
# (with clang's builtin headers) into .cuda-headers/libclang for bindgen. Neither is ever
# committed: .cuda-headers is ignored by git. Pins, architectures and why: scripts/fetch-wheels.py.
set -euo pipefail
exec python3 "$(dirname "$0")/fetch-wheels.py"
