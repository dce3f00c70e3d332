"""A CuPy job for the elastic-memory measurement (tests/gpu/elastic.sh): allocates COLD_GIB GiB
(filled once, then never touched) and HOT_GIB GiB, in 1 GiB arrays, the cold ones first unless
ORDER is hot-first (a training job's weights and optimiser state, allocated first and touched
every step, before buffers it rarely reads); each step multiplies
every hot array in place (reads and writes each byte once). Prints one line per step with its
time, then 'done' with the mean step time after the first; 'oom' and status 3 on CuPy's
out-of-memory error.

MODE says where the arrays live:
- device: CuPy's default allocator (cudaMalloc), the path that libvgpu.so's elastic memory serves;
- managed: unified memory with no advice (naive oversubscription: pages migrate on demand);
- managed-accessed-by: unified memory that the GPU maps wherever it is (no preferred location);
- managed-device: unified memory that prefers the device and that the GPU maps wherever it is
  (pages the device has no room for stay in host memory, read in place);
- managed-host: unified memory that prefers host memory and that the GPU reads in place, as the
  library's spills are advised.

Usage: elastic_cupy.py MODE HOT_GIB COLD_GIB STEPS [ORDER: cold-first (default) or hot-first]"""
import ctypes
import sys
import time

import cupy

MODES = ("device", "managed", "managed-accessed-by", "managed-device", "managed-host")
mode, hot_gib, cold_gib, steps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
order = sys.argv[5] if len(sys.argv) > 5 else "cold-first"
if mode not in MODES:
    sys.exit(f"elastic_cupy.py: MODE {mode}: expected one of {', '.join(MODES)}")
if order not in ("cold-first", "hot-first"):
    sys.exit(f"elastic_cupy.py: ORDER {order}: expected cold-first or hot-first")

# cuMemAdvise_v2 takes the location by value: { CUmemLocationType type; int id; }.
ADVISE_PREFERRED_LOCATION, ADVISE_ACCESSED_BY = 3, 5
LOCATION_DEVICE, LOCATION_HOST = 1, 2


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def advise(pointer, size, advice, location):
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuMemAdvise_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, Location]
    status = driver.cuMemAdvise_v2(pointer, size, advice, location)
    if status != 0:
        sys.exit(f"elastic_cupy.py: cuMemAdvise_v2 advice {advice}: status {status}")


def managed(size):
    memory = cupy.cuda.memory.malloc_managed(size)
    if mode == "managed-host":
        advise(memory.ptr, size, ADVISE_PREFERRED_LOCATION, Location(LOCATION_HOST, 0))
    if mode == "managed-device":
        advise(memory.ptr, size, ADVISE_PREFERRED_LOCATION, Location(LOCATION_DEVICE, 0))
    if mode != "managed":
        advise(memory.ptr, size, ADVISE_ACCESSED_BY, Location(LOCATION_DEVICE, 0))
    return memory


if mode != "device":
    cupy.cuda.set_allocator(managed)

CHUNK = 1 << 30


def arrays(gib):
    """1 GiB float32 arrays (the last one smaller) adding up to GIB GiB, each filled once."""
    made, left = [], int(gib * CHUNK)
    while left > 0:
        size = min(CHUNK, left)
        array = cupy.empty(size // 4, dtype=cupy.float32)
        array.fill(1.0)
        made.append(array)
        left -= size
    return made


try:
    start = time.time()
    if order == "cold-first":
        cold = arrays(cold_gib)
        hot = arrays(hot_gib)
    else:
        hot = arrays(hot_gib)
        cold = arrays(cold_gib)
    cupy.cuda.Device().synchronize()
    print(f"allocated cold {cold_gib} GiB hot {hot_gib} GiB ({order}) in {time.time() - start:.2f} s", flush=True)
    times = []
    for step in range(steps):
        began = time.time()
        for array in hot:
            array *= 1.0001
        cupy.cuda.Device().synchronize()
        times.append(time.time() - began)
        print(f"step {step} {times[-1]:.4f} s", flush=True)
    later = times[1:] or times
    print(f"done mode {mode} mean_after_first_s {sum(later) / len(later):.4f}", flush=True)
except cupy.cuda.memory.OutOfMemoryError as error:
    print("oom", str(error).splitlines()[0][:160], flush=True)
    sys.exit(3)
