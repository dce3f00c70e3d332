#!/usr/bin/env bash
# Builds HAMi-core's own libvgpu.so, for comparison runs against ours, on the GPU machine. Run it
# from the repository root: it takes the HAMi-core source from .device/hami-core-src (HAMI_SRC
# overrides; .device/ is git-ignored and only carried to the GPU machine: HAMi-core's source is
# never committed here), builds it the way HAMi-core's build.sh does (CMake Debug configuration
# with DLSYM_HOOK_ENABLE, MULTIPROCESS_LIMIT_ENABLE, HOOK_MEMINFO_ENABLE, HOOK_NVML_ENABLE; a
# Release build hides every hook but dlsym with -fvisibility=hidden) and prints the library's path,
# /tmp/hami-core/libvgpu.so unless a first argument names another output folder. With cmake it
# uses HAMi-core's CMakeLists; without it (or if that fails, or with HAMI_BUILD=direct) it compiles
# the same files with the same flags, defines and include paths directly with ${CC:-gcc}.
# CUDA_HOME (default /usr/local/cuda) must hold include/cuda.h and include/nvml.h.
set -euo pipefail

root=$(pwd)
src="${HAMI_SRC:-$root/.device/hami-core-src}"
out="${1:-/tmp/hami-core}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
cc="${CC:-gcc}"
mode="${HAMI_BUILD:-auto}"   # auto | cmake | direct

die() { echo "hami_core_build.sh: $*" >&2; exit 1; }
log() { echo "hami_core_build.sh: $*" >&2; }

[ -f "$src/CMakeLists.txt" ] && [ -f "$src/src/libvgpu.c" ] \
  || die "no HAMi-core source in $src (export it into .device/hami-core-src first)"
[ -f "$CUDA_HOME/include/cuda.h" ] || die "$CUDA_HOME/include/cuda.h is missing (set CUDA_HOME)"
[ -f "$CUDA_HOME/include/nvml.h" ] || die "$CUDA_HOME/include/nvml.h is missing"
mkdir -p "$out"
out=$(cd "$out" && pwd)
build="$out/build"
rm -rf "$build" "$out/libvgpu.so"
mkdir -p "$build"

# src/CMakeLists.txt links with plain -lcuda -lnvidia-ml (no -L): the driver's libcuda.so and
# libnvidia-ml.so in the default search path. Where the linker cannot find one there (no
# development symlink), use the toolkit's stubs (their soname is libcuda.so.1 / libnvidia-ml.so.1,
# so the result loads the real driver libraries at run time). HAMi-core reaches both only through
# dlopen/dlsym (src/cuda/hook.c, src/nvml/hook.c), so where neither exists the direct build leaves
# the -l out (with --as-needed it is dropped anyway).
link_dirs=() link_libs=()
for lib in cuda nvidia-ml; do
  if [ "$("$cc" -print-file-name="lib$lib.so")" != "lib$lib.so" ]; then link_libs+=("-l$lib"); continue; fi
  for d in "$CUDA_HOME/lib64/stubs" "$CUDA_HOME/targets/x86_64-linux/lib/stubs" "$CUDA_HOME/lib64"; do
    if [ -e "$d/lib$lib.so" ]; then
      case " ${link_dirs[*]-} " in *" -L$d "*) ;; *) link_dirs+=("-L$d") ;; esac
      link_libs+=("-l$lib")
      log "lib$lib.so is not in the default linker path; linking against $d/lib$lib.so"
      break
    fi
  done
  case " ${link_libs[*]-} " in *" -l$lib "*) ;; *) log "no lib$lib.so found; not linking it (HAMi-core dlopens it)" ;; esac
done

build_cmake() {
  local cmake="${CMAKE:-cmake}"
  # The options of HAMi-core's build.sh; CMAKE_POLICY_VERSION_MINIMUM lets CMake 4 accept its
  # cmake_minimum_required(2.8.11). Only the library target is built (not the tests).
  "$cmake" -S "$src" -B "$build" \
    -DDLSYM_HOOK_ENABLE=1 -DMULTIPROCESS_LIMIT_ENABLE=1 -DHOOK_MEMINFO_ENABLE=1 \
    -DHOOK_NVML_ENABLE=1 -DCMAKE_BUILD_TYPE=Debug -DTEST_DEVICE_ID=0 \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DCMAKE_C_COMPILER="$cc" \
    -DCMAKE_SHARED_LINKER_FLAGS="${link_dirs[*]-}" >&2 || return 1
  "$cmake" --build "$build" --target vgpu -j "$(nproc)" >&2 || return 1
  cp "$build/libvgpu.so" "$out/libvgpu.so"
}

build_direct() {
  local s="$src/src" cfg="$build/config" hash
  mkdir -p "$cfg"
  # config/static_config.h as configure_file(src/static_config.h.in) writes it with build.sh's
  # options: #cmakedefine VAR -> #define VAR for the options set, /* #undef VAR */ for the others.
  hash=$(head -c 7 "$src/COMMIT" 2>/dev/null || true)
  sed -E \
    -e 's/^#cmakedefine (MULTIPROCESS_LIMIT_ENABLE|DLSYM_HOOK_ENABLE|HOOK_MEMINFO_ENABLE|HOOK_NVML_ENABLE)\b.*$/#define \1/' \
    -e 's|^#cmakedefine ([A-Za-z0-9_]+).*$|/* #undef \1 */|' \
    -e "s/@GIT_HASH@/${hash}/" -e 's/@GIT_BRANCH@/main/' \
    "$s/static_config.h.in" >"$cfg/static_config.h"
  # The sources of add_library(vgpu SHARED ...) in src/CMakeLists.txt and of its object libraries
  # nvml_mod (src/nvml), cuda_mod (src/cuda), allocator_mod (src/allocator) and multiprocess_mod
  # (src/multiprocess); no .cu file is part of the library.
  local files=(libvgpu.c utils.c log_utils.c
    nvml/nvml_entry.c nvml/hook.c
    cuda/context.c cuda/device.c cuda/hook.c cuda/event.c cuda/memory.c cuda/stream.c cuda/graph.c
    allocator/allocator.c
    multiprocess/multiprocess_memory_limit.c multiprocess/multiprocess_utilization_watcher.c)
  # Debug: CMAKE_C_FLAGS_DEBUG (-g), -fPIC for a shared library's objects, then
  # LIBRARY_COMPILE_FLAGS; include directories in the top CMakeLists.txt's order.
  local cflags=(-g -fPIC -shared -fPIC -g -D_GNU_SOURCE -Wall
    -I"$CUDA_HOME/include" -I"$s" -I"$cfg")
  local f o objs=() pids=() rc=0
  for f in "${files[@]}"; do
    [ -f "$s/$f" ] || die "$s/$f is missing (is this the HAMi-core tree the script was written for?)"
    o="$build/obj/${f%.c}.o"; mkdir -p "$(dirname "$o")"; objs+=("$o")
    "$cc" "${cflags[@]}" -c "$s/$f" -o "$o" >"$o.log" 2>&1 &
    pids+=($!)
  done
  local i
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then rc=1; log "compiling ${files[$i]} failed:"; cat "${objs[$i]}.log" >&2; fi
  done
  [ "$rc" = 0 ] || return 1
  # CMake's link line for a Debug C shared library: -fPIC -g -shared -Wl,-soname,libvgpu.so.
  "$cc" -fPIC -g -shared -Wl,-soname,libvgpu.so -o "$out/libvgpu.so" "${objs[@]}" \
    ${link_dirs[@]+"${link_dirs[@]}"} ${link_libs[@]+"${link_libs[@]}"} >&2
}

case "$mode" in
  cmake) build_cmake || die "the cmake build failed" ;;
  direct) build_direct || die "the direct build failed" ;;
  auto)
    if command -v "${CMAKE:-cmake}" >/dev/null 2>&1; then
      if ! build_cmake; then
        log "the cmake build failed; compiling directly instead"
        rm -rf "$build"; mkdir -p "$build"
        build_direct || die "the direct build failed too"
      fi
    else
      log "no cmake; compiling the CMakeLists' sources directly with $cc"
      build_direct || die "the direct build failed"
    fi ;;
  *) die "HAMI_BUILD must be auto, cmake or direct" ;;
esac

for sym in cuLaunchKernel cuMemAlloc_v2 nvmlDeviceGetMemoryInfo; do
  nm -D --defined-only "$out/libvgpu.so" | grep -w "$sym" >/dev/null || die "$out/libvgpu.so does not export $sym"
done
rm -rf "$build"
echo "$out/libvgpu.so"
