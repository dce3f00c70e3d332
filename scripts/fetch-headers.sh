#!/usr/bin/env bash
# Fetch the pinned CUDA and NVML header wheels of every version in cuda-versions.txt into
# .cuda-headers/<version>/include.
# The headers are NVIDIA's and are never committed; this folder is ignored by git.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.cuda-headers"
# cuda-versions.txt: one line per supported version, `version wheel...` (the list lives there only).
grep -Ev '^[[:space:]]*(#|$)' "$root/cuda-versions.txt" | while read -r version pins; do
  include="$dest/$version/include"
  if [ -f "$include/cuda.h" ] && [ -f "$include/nvml.h" ] && [ -f "$include/cudaTypedefs.h" ] \
     && [ -f "$include/cudaGL.h" ]; then
    continue
  fi
  download=$(mktemp -d)
  # shellcheck disable=SC2086
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$download" $pins
  mkdir -p "$include"
  python3 - "$download" "$include" <<'PY'
import pathlib, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wanted = {"cuda.h", "cudaTypedefs.h", "nvml.h", "cudaGL.h", "cudaEGL.h", "cudaVDPAU.h"}
for wheel in src.glob("*.whl"):
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            base = name.rsplit("/", 1)[-1]
            if base in wanted and "/include/" in name:
                (dst / base).write_bytes(archive.read(name))
missing = wanted - {p.name for p in dst.iterdir()}
if missing:
    sys.exit(f"fetch-headers: wheels for {dst.parent.name} lack {sorted(missing)}")
PY
  rm -rf "$download"
  echo "fetch-headers: CUDA $version headers in $include"
done
