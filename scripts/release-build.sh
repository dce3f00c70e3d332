#!/usr/bin/env bash
# Builds libvgpu.so and vgpu-smi in release mode for one architecture (x86_64 or aarch64; default:
# the host's) and prints the folder that holds them. The host's architecture is built natively,
# the other one cross-built with Debian's cross compiler: on x86_64 that needs
# `rustup target add aarch64-unknown-linux-gnu` and apt's gcc-aarch64-linux-gnu and
# libc6-dev-arm64-cross (on aarch64: x86_64-unknown-linux-gnu, gcc-x86-64-linux-gnu and
# libc6-dev-amd64-cross). Used by scripts/dist.sh and dockerfiles/Dockerfile.
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-$(uname -m)}
case "$arch" in
  x86_64) machine=X86-64 ;;
  aarch64) machine=AArch64 ;;
  *) echo "release-build: unsupported architecture $arch (x86_64 or aarch64)" >&2; exit 1 ;;
esac
scripts/fetch-headers.sh >&2
if [ "$arch" = "$(uname -m)" ]; then
  cargo build --release -p vgpu-hook -p vgpu-monitor >&2
  built=target/release
else
  triple="$arch-unknown-linux-gnu"
  linker="$arch-linux-gnu-gcc"
  if ! command -v "$linker" >/dev/null; then
    echo "release-build: $linker is missing: install the $arch cross compiler and C library (see $0)" >&2
    exit 1
  fi
  env "CARGO_TARGET_$(echo "$triple" | tr 'a-z-' 'A-Z_')_LINKER=$linker" \
    cargo build --release --target "$triple" -p vgpu-hook -p vgpu-monitor >&2
  built="target/$triple/release"
fi
# A binary of the wrong machine would only fail on the node: check here.
for file in libvgpu.so vgpu-smi; do
  if ! LC_ALL=C readelf -h "$built/$file" | grep -q "Machine:.*$machine"; then
    echo "release-build: $built/$file is not an $arch binary" >&2
    exit 1
  fi
done
echo "$built"
