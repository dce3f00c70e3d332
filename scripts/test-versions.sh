#!/usr/bin/env bash
# Every supported CUDA release builds and works, not only the default one (cuda-versions.txt).
#
#   scripts/test-versions.sh older   for each release but the default: build the hook and the fake
#                                    driver from its headers (with the other programs the tests
#                                    run: scripts/build-test-programs.sh) and run the integration
#                                    tests that depend on the headers; keep that fake driver
#   scripts/test-versions.sh cross   the default build's hook against the fake driver of the next
#                                    older release: the library on a driver older than its headers,
#                                    as on the H200 (driver 13.0, library built from 13.5)
#
# Which tests: foundation (every entry point exported, cuGetProcAddress answers mapped, functions
# the driver lacks, the generated wrappers) for every release, and memory (every accounting path
# and the structs its handlers read) for a release of another major version than the default's,
# where those structs differ (12 to 13 renamed and reshaped several); a release of the default's
# major version mostly adds entry points, which foundation covers. The compute limiter, the monitor
# and the configuration use the same entry points and structs in every supported release and run
# once, on the default build (`make test`'s tests); the coverage snapshots of every release are
# part of that too. `make test` runs `older` before the default build and `cross` after its tests, so
# the target folder ends with the default build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
target=${CARGO_TARGET_DIR:-$root/target}
cargo=${CARGO:-cargo}
mapfile -t versions < <(grep -Ev '^[[:space:]]*(#|$)' cuda-versions.txt | awk '{print $1}')
saved="$target/cuda-versions"
elapsed() { echo "test-versions: $1 in $((SECONDS - $2)) s"; }

case "${1:-}" in
  older)
    for version in "${versions[@]:1}"; do
      start=$SECONDS
      include="$root/.cuda-headers/$version/include"
      tests=(--test foundation)
      [ "${version%%.*}" = "${versions[0]%%.*}" ] || tests+=(--test memory)
      echo "== CUDA $version headers: hook and fake driver, tests ${tests[*]}"
      CUDA_INCLUDE_DIR="$include" CARGO=$cargo scripts/build-test-programs.sh
      CUDA_INCLUDE_DIR="$include" $cargo test -p vgpu-integration "${tests[@]}"
      mkdir -p "$saved/$version"
      cp "$target/debug/libvgpu_fake_driver.so" "$saved/$version/"
      elapsed "CUDA $version" "$start"
    done
    ;;
  cross)
    older=${versions[1]:?cuda-versions.txt lists one release only}
    fake="$saved/$older/libvgpu_fake_driver.so"
    [ -f "$fake" ] || { echo "test-versions: $fake is missing: run scripts/test-versions.sh older first" >&2; exit 1; }
    start=$SECONDS
    echo "== the CUDA ${versions[0]} library on the CUDA $older fake driver: foundation tests"
    VGPU_TEST_FAKE_DRIVER="$fake" $cargo test -p vgpu-integration --test foundation
    elapsed "cross" "$start"
    ;;
  *)
    echo "usage: scripts/test-versions.sh older|cross" >&2
    exit 2
    ;;
esac
