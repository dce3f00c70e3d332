#!/usr/bin/env bash
# Prepares .device/ for a run of tests/gpu/ on the GPU machine (which has no Rust): the release
# libvgpu.so, vgpu-smi, the list of driver entry-point base names for the cuGetProcAddress comparison,
# and the list of every driver entry point the library exports.
# Carry `.device` with the run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
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
