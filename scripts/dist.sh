#!/usr/bin/env bash
# Release archives, one per architecture, in dist/:
#   vgpu-<version>-<arch>-linux.tar.gz         libvgpu.so, vgpu-smi, hami.json (the Vulkan layer's
#                                              manifest), LICENSE, README.md, SHA256SUMS
#   vgpu-<version>-<arch>-linux.tar.gz.sha256  the archive's own SHA-256 (sha256sum -c)
# The other architecture than the host's is cross-built: scripts/release-build.sh says what that
# needs. Archives are reproducible: fixed order, owner and times (the last commit's, or
# SOURCE_DATE_EPOCH).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/fetch-headers.sh >/dev/null
version=$(cargo pkgid -p vgpu-monitor | sed 's/.*[#@]//')
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
mkdir -p dist
for arch in x86_64 aarch64; do
  built=$(scripts/release-build.sh "$arch")
  name="vgpu-$version-$arch-linux"
  stage=$(mktemp -d)
  mkdir "$stage/$name"
  install -m 0755 "$built/libvgpu.so" "$built/vgpu-smi" "$stage/$name/"
  install -m 0644 vulkan-layer/hami.json LICENSE README.md "$stage/$name/"
  (cd "$stage/$name" && sha256sum libvgpu.so vgpu-smi hami.json LICENSE README.md >SHA256SUMS)
  touch -d "@$epoch" "$stage/$name" "$stage/$name"/*
  tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" -cf - "$name" \
    | gzip -n -9 >"dist/$name.tar.gz"
  (cd dist && sha256sum "$name.tar.gz" >"$name.tar.gz.sha256")
  rm -rf "$stage"
  # The newest glibc symbol version the binaries need: the oldest glibc a node can have.
  glibc=$(LC_ALL=C readelf -V "$built/libvgpu.so" "$built/vgpu-smi" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
  echo "dist: dist/$name.tar.gz ($(du -h "dist/$name.tar.gz" | cut -f1); needs glibc ${glibc#GLIBC_} or newer)"
done
