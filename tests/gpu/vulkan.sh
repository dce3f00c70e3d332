#!/usr/bin/env bash
# The Vulkan layer on the GPU machine (issue 14): run from the repository root with .device/
# prepared by scripts/gpu-prepare.sh (libvgpu.so, vgpu-smi, and the Vulkan loader's packages in
# .device/vulkan/, unpacked here with dpkg -x since the machine has no loader and no network).
# Drives tests/programs/vk_mem.c; prints a table of results and writes it to $OUT/vulkan.txt.
set -u
root=$(pwd)
hook="$root/.device/libvgpu.so"
out="${OUT:-/tmp/vgpu-out}"; mkdir -p "$out"
work=/tmp/vgpu-vk; rm -rf "$work"; mkdir -p "$work"
cuda_inc=${CUDA_INC:-/usr/local/cuda/include}; stubs=${CUDA_STUBS:-/usr/local/cuda/lib64/stubs}
report="$out/vulkan.txt"; : > "$report"
log() { echo "$@" | tee -a "$report"; }
MIB=$((1 << 20)); GIB=$((1 << 30))
export CUDA_DEVICE_ORDER=PCI_BUS_ID   # CUDA ordinal i = nvidia-smi index i

log "# Vulkan layer GPU suite, $(date -u +%F), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"

# --- the loader: the system's if it has one, else the packages brought in .device/vulkan/
unpack() { # deb dir
  if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$1" "$2"; else (cd "$2" && ar p "$1" data.tar.xz | tar -xJ); fi
}
mkdir -p "$work/root"
for deb in "$root"/.device/vulkan/*.deb; do [ -f "$deb" ] && unpack "$deb" "$work/root"; done
vk_inc="$work/root/usr/include"; vk_lib=$(dirname "$(find "$work/root" -name 'libvulkan.so.1' | head -1)" 2>/dev/null)
system_loader=$(ldconfig -p | awk '/libvulkan\.so\.1 /{print $NF; exit}')
# NVIDIA's driver (libGLX_nvidia.so.0) found no device with the loader and glvnd only on
# LD_LIBRARY_PATH (the loader: "Could not get 'vkCreateInstance' via 'vk_icdGetInstanceProcAddr'"),
# and found the GPU once the loader and glvnd's libraries were installed in / (2026-12-01). On a
# machine without a loader, as root, the brought loader and glvnd packages are installed there
# (only those: others could replace the machine's own libraries).
if [ -z "$system_loader" ] && [ "$(id -u)" = 0 ]; then
  for deb in "$root"/.device/vulkan/*.deb; do
    case "$(basename "$deb")" in libvulkan1_*|libglvnd0_*|libegl1_*|libgl1_*|libglx0_*|libopengl0_*|libgles2_*) unpack "$deb" / ;; esac
  done
  ldconfig
  system_loader=$(ldconfig -p | awk '/libvulkan\.so\.1 /{print $NF; exit}')
  log "installed the brought runtime packages in / (root, no system loader)"
fi
if [ -n "$system_loader" ]; then
  log "loader: the system's ($system_loader)"; loader_path=""
elif [ -n "$vk_lib" ] && [ -f "$vk_lib/libvulkan.so.1" ]; then
  log "loader: brought from .device/vulkan ($vk_lib/libvulkan.so.1)"; loader_path="$vk_lib"
else
  log "loader: NONE (no system libvulkan.so.1 and nothing in .device/vulkan: run scripts/gpu-prepare.sh)"; exit 1
fi
[ -f "$vk_inc/vulkan/vulkan.h" ] || vk_inc=/usr/include
[ -f "$vk_inc/vulkan/vulkan.h" ] || { log "Vulkan headers: NONE (libvulkan-dev missing from .device/vulkan)"; exit 1; }
[ -e "$vk_lib/libvulkan.so" ] || ln -sf libvulkan.so.1 "$vk_lib/libvulkan.so" 2>/dev/null

# --- NVIDIA's Vulkan driver: the manifests to try, in order (the first through which the loader
# finds a device is used): the caller's, the container toolkit's mount (/usr/local/nvidia/share, on
# the lent machines), the system's, and one written for libGLX_nvidia.so.0.
glx=$(ldconfig -p | awk '/libGLX_nvidia\.so\.0 /{print $NF; exit}')
spirv=$(ldconfig -p | awk '/libnvidia-glvkspirv\.so/{print $NF; exit}')
manifests=()
[ -n "${VK_ICD_FILENAMES:-}" ] && manifests+=("$VK_ICD_FILENAMES")
for f in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd*.json /usr/share/vulkan/icd.d/nvidia_icd*.json \
  /etc/vulkan/icd.d/nvidia_icd*.json; do [ -f "$f" ] && manifests+=("$f"); done
if [ -n "$glx" ]; then
  printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$glx" > "$work/nvidia_icd.json"
  manifests+=("$work/nvidia_icd.json")
fi
log "NVIDIA ICD manifests: ${manifests[*]:-none}; libGLX_nvidia.so.0: ${glx:-none}; libnvidia-glvkspirv: ${spirv:-none}"
[ ${#manifests[@]} -gt 0 ] || { log "no NVIDIA Vulkan driver (libGLX_nvidia.so.0) on this machine: nothing to test"; exit 1; }
# libGLX_nvidia.so.0 needs glvnd's libGLdispatch and X11's client libraries, which a machine without
# a desktop may lack: the brought ones (gpu-prepare.sh) fill in what ldd does not find.
if [ -n "$glx" ] && ldd "$glx" | grep -q "not found"; then
  log "libGLX_nvidia.so.0 lacks: $(ldd "$glx" | awk '/not found/{printf "%s ", $1}')"
  [ -n "$vk_lib" ] && export LD_LIBRARY_PATH="$vk_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "after adding the brought libraries, still missing: $(ldd "$glx" | awk '/not found/{printf "%s ", $1}')"
fi

# --- the layer: the shipped manifest, pointed at .device/libvgpu.so, in an implicit layer folder
layers="$work/config/vulkan/implicit_layer.d"; mkdir -p "$layers" "$work/none"
sed "s#/usr/local/vgpu/libvgpu.so#$hook#" vulkan-layer/hami.json > "$layers/hami.json"
export XDG_CONFIG_HOME="$work/config" XDG_CONFIG_DIRS="$work/none"
unset HAMI_VULKAN_ENABLE HAMI_VULKAN_DISABLE CUDA_DEVICE_MEMORY_LIMIT

gcc -O1 -o "$work/vk_mem" tests/programs/vk_mem.c -Itests/programs -I"$cuda_inc" -I"$vk_inc" \
  -L"$stubs" -L"${vk_lib:-/usr/lib/x86_64-linux-gnu}" -lcuda -lnvidia-ml -lvulkan -ldl -pthread || { log "compile failed"; exit 1; }
[ -n "$loader_path" ] && export LD_LIBRARY_PATH="$loader_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# vk <commands...>: runs vk_mem with one command per argument; the answers on stdout.
vk() { printf '%s\n' "$@" quit | "$work/vk_mem" 2>>"$work/stderr.txt"; }
answer() { sed -n "$1p"; }           # the n-th answer line
field() { awk -v n="$1" '{print $n}'; } # the n-th field of a line
results=()
check() { # name expected got
  local verdict=FAIL; [ -n "$3" ] && [ "$2" = "$3" ] && verdict=pass
  results+=("| $1 | $2 | $3 | $verdict |"); log "$verdict: $1: expected $2, got $3"
}
region() { echo "$work/region-$1.cache"; }
check_range() { # name lowest highest got
  local verdict=FAIL; [ -n "$4" ] && [ "$4" -ge "$2" ] && [ "$4" -le "$3" ] && verdict=pass
  results+=("| $1 | $2..$3 | $4 | $verdict |"); log "$verdict: $1: expected $2..$3, got $4"
}

# The Vulkan physical device that is CUDA device 0.
uuid0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 | sed 's/^GPU-//; s/-//g')
count=0
for icd in "${manifests[@]}"; do
  export VK_ICD_FILENAMES="$icd" VK_DRIVER_FILES="$icd"
  count=$(vk "instance 1" | answer 1 | field 3)
  log "through $icd: ${count:-no answer} Vulkan devices"
  [ "${count:-0}" -gt 0 ] 2>/dev/null && break
done
if ! [ "${count:-0}" -gt 0 ] 2>/dev/null; then
  log "no Vulkan physical device through any manifest: nothing to test. The loader says (last manifest):"
  printf 'instance 1\nquit\n' | VK_LOADER_DEBUG=error,warn,driver "$work/vk_mem" 2>&1 | tail -25 | tee -a "$report"; exit 1
fi
phys=0
for i in $(seq 0 $((${count:-1} - 1))); do
  [ "$(vk "instance 1" "uuid $i" | answer 2 | field 2)" = "$uuid0" ] && { phys=$i; break; }
done
log "Vulkan physical devices: ${count:-0}; CUDA device 0 ($uuid0) is Vulkan device $phys"
physical_heap=$(vk "instance 1" "heaps $phys" | answer 2 | field 3)
log "device-local heap without the layer: $physical_heap bytes"

log; log "## 1. Vulkan only, CUDA_DEVICE_MEMORY_LIMIT=1g, layer enabled, no preload"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region vk) CUDA_DEVICE_MEMORY_LIMIT=1g HAMI_VULKAN_ENABLE=1
a=$(vk "instance 1" "heaps $phys" "budget $phys" "device $phys" "vkalloc 0 device $((512 * MIB))" \
  "vkalloc 0 device $((600 * MIB))" "vkalloc 0 host $((2 * GIB))" "vkalloc 0 device $((400 * MIB))" "budget $phys")
echo "$a" | tee -a "$report"
check "heap shown at the limit" "$GIB" "$(echo "$a" | answer 2 | field 3)"
check "512 MiB device-local" 0 "$(echo "$a" | answer 5 | field 2)"
check "600 MiB more refused (VK_ERROR_OUT_OF_DEVICE_MEMORY)" -2 "$(echo "$a" | answer 6 | field 2)"
check "2 GiB host-visible not charged" 0 "$(echo "$a" | answer 7 | field 2)"
check "400 MiB more fits" 0 "$(echo "$a" | answer 8 | field 2)"
left=$(echo "$a" | answer 9 | awk '{print $4 - $5}')
# The driver's usage includes what it allocated for itself (192 KiB on the H200, not charged), and
# the budget is capped at the heap (the limit), so the room it shows may be that much smaller.
check_range "budget - usage = what the limit leaves (112 MiB, less the driver's own)" $((111 * MIB)) $((112 * MIB)) "$left"
python3 tests/gpu/region_dump.py "$CUDA_DEVICE_MEMORY_SHARED_CACHE" | tee -a "$report"

log; log "## 2. without HAMI_VULKAN_ENABLE the layer is not loaded"
b=$(env -u HAMI_VULKAN_ENABLE CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region off) "$work/vk_mem" <<< "instance 1
heaps $phys
device $phys
vkalloc 0 device $((2 * GIB))
quit")
check "heap physical" "$physical_heap" "$(echo "$b" | answer 2 | field 3)"
check "2 GiB allowed" 0 "$(echo "$b" | answer 4 | field 2)"

log; log "## 3. one process, Vulkan then CUDA, preloaded, limit 4g (a context takes some 500 MiB): never over it together"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region both) CUDA_DEVICE_MEMORY_LIMIT=4g
c=$(printf '%s\n' "instance 1" "device $phys" "vkalloc 0 device $((2 * GIB))" init "ctx 0" "alloc $((2560 * MIB))" \
  "alloc $GIB" "vkalloc 0 device $((1536 * MIB))" cuinfo quit | LD_PRELOAD=$hook "$work/vk_mem" 2>>"$work/stderr.txt")
echo "$c" | tee -a "$report"
check "CUDA 2.5 GiB over Vulkan's 2 refused" 2 "$(echo "$c" | answer 6 | field 2)"
check "CUDA 1 GiB fits" 0 "$(echo "$c" | answer 7 | field 2)"
check "Vulkan 1.5 GiB more refused" -2 "$(echo "$c" | answer 8 | field 2)"
check "cuMemGetInfo total = limit" $((4 * GIB)) "$(echo "$c" | answer 9 | field 4)"
python3 tests/gpu/region_dump.py "$CUDA_DEVICE_MEMORY_SHARED_CACHE" | tee -a "$report"
export CUDA_DEVICE_MEMORY_LIMIT=1g

log; log "## 4. interop: Vulkan export -> cuImportExternalMemory -> mapped buffer, charged once"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region interop)
mkfifo "$work/in"
LD_PRELOAD=$hook "$work/vk_mem" < "$work/in" > "$work/interop.txt" 2>>"$work/stderr.txt" &
pid=$!; exec 3>"$work/in"
say() { echo "$1" >&3; local n; n=$(($(wc -l < "$work/interop.txt") + 1)); for _ in $(seq 200); do [ "$(wc -l < "$work/interop.txt")" -ge "$n" ] && break; sleep 0.05; done; tail -1 "$work/interop.txt"; }
say init >/dev/null; say "ctx 0" >/dev/null; say "instance 1" >/dev/null; say "device $phys" >/dev/null
mem=$(say "vkalloc 0 export $((256 * MIB))" | field 3)
imp=$(say "cuimport 0 $mem $((256 * MIB))")
check "cuImportExternalMemory + mapped buffer" 0 "$(echo "$imp" | field 2)"
data=$(python3 tests/gpu/region_dump.py "$CUDA_DEVICE_MEMORY_SHARED_CACHE" | grep -o "data [0-9]* " | awk '{s+=$2} END {print s}')
check "charged once (data MiB)" 256 "$data"
check "cuMemFree of the mapped buffer" 0 "$(say "free $(echo "$imp" | field 4)" | field 2)"
check "cuDestroyExternalMemory" 0 "$(say "cudestroy $(echo "$imp" | field 3)" | field 2)"
say "vkfree 0 $mem" >/dev/null
data=$(python3 tests/gpu/region_dump.py "$CUDA_DEVICE_MEMORY_SHARED_CACHE" | grep -o "data [0-9]* " | awk '{s+=$2} END {print s+0}')
check "released with vkFreeMemory (data MiB)" 0 "$data"
exec 3>&-; wait $pid

log; log "## 5. two processes: one holds 600 MiB of Vulkan memory; NVML, vgpu-smi and the other see it"
export CUDA_DEVICE_MEMORY_SHARED_CACHE=$(region two)
(printf '%s\n' "instance 1" "device $phys" "vkalloc 0 device $((600 * MIB))"; sleep 8; echo quit) | "$work/vk_mem" > "$work/holder.txt" 2>>"$work/stderr.txt" &
holder=$!
for _ in $(seq 100); do grep -q '^vkalloc' "$work/holder.txt" 2>/dev/null && break; sleep 0.1; done
check "holder's 600 MiB" 0 "$(grep '^vkalloc' "$work/holder.txt" | field 2)"
d=$(vk "instance 1" "budget $phys" "device $phys" "vkalloc 0 device $((500 * MIB))" "vkalloc 0 device $((400 * MIB))")
check "other's budget - usage = 424 MiB" $((424 * MIB)) "$(echo "$d" | answer 2 | awk '{print $4 - $5}')"
check "other's 500 MiB refused" -2 "$(echo "$d" | answer 4 | field 2)"
check "other's 400 MiB fits" 0 "$(echo "$d" | answer 5 | field 2)"
used=$(LD_PRELOAD=$hook nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader,nounits -i 0)
log "nvidia-smi under the preload (total, used MiB): $used"
check "nvidia-smi total under the preload" 1024 "$(echo "$used" | cut -d, -f1 | tr -d ' ')"
check "nvidia-smi used under the preload" 600 "$(echo "$used" | cut -d, -f2 | tr -d ' ')"
[ -x "$root/.device/vgpu-smi" ] && "$root/.device/vgpu-smi" --region "$CUDA_DEVICE_MEMORY_SHARED_CACHE" 2>&1 | tee -a "$report"
log "plain nvidia-smi (physical, MiB): $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)"
wait $holder

log; log "## results"
log "| check | expected | got | result |"
log "|---|---|---|---|"
for row in "${results[@]}"; do log "$row"; done
passed=$(printf '%s\n' "${results[@]}" | grep -c '| pass |'); log "$passed of ${#results[@]} passed"
log "stderr of the runs:"; sort "$work/stderr.txt" | uniq -c | sort -rn | head -20 | tee -a "$report"
