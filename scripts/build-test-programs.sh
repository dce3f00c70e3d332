#!/usr/bin/env bash
# Builds what the integration tests run and cargo does not build for them: the hook, the fake CUDA
# driver, the fake Vulkan driver and vgpu-smi, in one cargo invocation. The integration harness
# (tests/integration/src/lib.rs, PROGRAM_PACKAGES) builds the same packages the same way, so that
# cargo resolves the same features and the harness finds everything up to date: a build of another
# selection (`cargo build --workspace`, `-p vgpu-hook` alone) may unify the dependencies' features
# differently and leave the hook to be built again. Extra arguments go to cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${CARGO:-cargo}" build -p vgpu-hook -p vgpu-fake-driver -p vgpu-fake-icd -p vgpu-monitor "$@"
