#!/usr/bin/env bash
# Prepares .device/ for a run of tests/gpu/ on the GPU machine (which has no Rust): the release
# libvgpu.so, vgpu-smi, the list of driver entry-point base names for the cuGetProcAddress comparison,
# and the list of every driver entry point the library exports.
# Carry `.device` with the run.
#
#     scripts/gpu-prepare.sh [--candidate <git revision>]
#
# With --candidate, the library of that revision (a branch with a limiter change, say) is built
# too, into .device/candidate/libvgpu.so, from a worktree of it beside this one, so that one call of
# the GPU machine can run both (VGPU_HOOK=.device/candidate/libvgpu.so for the suites that take it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
candidate=""
case "${1:-}" in
  "") ;;
  --candidate)
    [ -n "${2:-}" ] || { echo "gpu-prepare.sh: --candidate needs a git revision" >&2; exit 2; }
    candidate=$(git rev-parse --verify --quiet "$2^{commit}") \
      || { echo "gpu-prepare.sh: --candidate $2: not a revision of this repository" >&2; exit 2; } ;;
  *) echo "gpu-prepare.sh: unknown argument $1 (expected --candidate <revision>)" >&2; exit 2 ;;
esac
scripts/fetch-headers.sh >/dev/null
cargo build --quiet --release -p vgpu-hook -p vgpu-codegen -p vgpu-monitor
# vgpu-codegen run by hand loads the fetched libclang, as cargo would set it (.cargo/config.toml).
export LIBCLANG_PATH="$root/.cuda-headers/libclang"
mkdir -p .device
cp target/release/libvgpu.so .device/libvgpu.so
strip --strip-debug .device/libvgpu.so
cp target/release/vgpu-smi .device/vgpu-smi
strip --strip-debug .device/vgpu-smi
target/release/vgpu-codegen | grep -v '^#' | awk '{print $1}' | grep '^cu' \
  | sed -E 's/_ptds$|_ptsz$//; s/_v[0-9]+$//' | sort -u > .device/proc-names.txt
# Every driver entry point the library exports, for the check of the ones the driver lacks.
target/release/vgpu-codegen | grep -v '^#' | awk '{print $1}' | grep '^cu' > .device/exports.txt
wc -l .device/proc-names.txt
ls -la .device
# The Vulkan suite (tests/gpu/vulkan.sh) unpacks the loader and its headers there (the GPU machine
# has neither, and no network), and the libraries NVIDIA's Vulkan driver (libGLX_nvidia.so.0) needs
# where the machine lacks them.
vulkan_debs="libvulkan1 libvulkan-dev libglvnd0 libegl1 libgl1 libglx0 libopengl0 libgles2 libx11-6 libxext6 libxcb1 libxau6 libxdmcp6 libbsd0 libmd0"
mkdir -p .device/vulkan
rm -f .device/vulkan/*.deb
(cd .device/vulkan && { apt-get download $vulkan_debs >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get download $vulkan_debs; }; })
ls -la .device/vulkan
if [ -n "$candidate" ]; then
  worktree="$root/target/candidate-worktree"
  git worktree remove --force "$worktree" 2>/dev/null || rm -rf "$worktree"
  git worktree add --quiet --detach "$worktree" "$candidate"
  # The fetched headers and libclang are the same pins; the candidate builds into its own target.
  ln -s "$root/.cuda-headers" "$worktree/.cuda-headers"
  (cd "$worktree" && cargo build --quiet --release -p vgpu-hook --target-dir "$root/target/candidate")
  git worktree remove --force "$worktree"
  mkdir -p .device/candidate
  cp target/candidate/release/libvgpu.so .device/candidate/libvgpu.so
  strip --strip-debug .device/candidate/libvgpu.so
  echo "candidate $(git log --oneline -1 "$candidate" | cut -c1-72): .device/candidate/libvgpu.so"
fi
