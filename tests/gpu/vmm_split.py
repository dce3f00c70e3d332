"""A VMM allocation as XLA makes its pool, through the driver API (ctypes, no framework): create
GIB GiB of pinned device memory with POSIX fd handles, reserve, map it whole, give the device
read-write access, write it all with cuMemsetD32 (timed, PASSES times), read words back at the
start, the middle and the end, retain the handle at its last byte, try to export it, release both
references, unmap and free the range. Under CUDA_OVERSUBSCRIBE=true on a card without room for it,
the library splits it where the device ends: every step must still work, the retain must answer
the created handle, and the export is refused (801). Prints one line per step.

    python3 vmm_split.py GIB [PASSES]
"""

import ctypes
import sys
import time

from cuda_vmm import LOC_DEVICE as DEVICE  # beside this script
from cuda_vmm import MINIMUM, PINNED, POSIX_FD, READ_WRITE, AccessDesc, Location, Prop, cuda, u64

GIB = float(sys.argv[1])
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 4


def check(name, status, expected=0):
    print(f"{name}: {status}" + ("" if status == expected else f" (expected {expected})"), flush=True)
    if status != expected:
        sys.exit(1)


check("cuInit", cuda.cuInit(0))
device = ctypes.c_int()
check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
context = ctypes.c_void_p()
check("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(context))
prop = Prop(type=PINNED, requestedHandleTypes=POSIX_FD, location=Location(DEVICE, device.value))
granule = ctypes.c_size_t()
check("cuMemGetAllocationGranularity", cuda.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(prop), MINIMUM))
size = int(GIB * (1 << 30)) // granule.value * granule.value
handle = u64()
check(f"cuMemCreate {size >> 20} MiB", cuda.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), u64(0)))
ptr = u64()
check("cuMemAddressReserve", cuda.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), u64(0), u64(0)))
check("cuMemMap, the whole allocation", cuda.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, u64(0)))
access = AccessDesc(location=Location(DEVICE, device.value), flags=READ_WRITE)
check("cuMemSetAccess, the whole range", cuda.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)))
words = size // 4
for i in range(PASSES):
    start = time.perf_counter()
    status = cuda.cuMemsetD32_v2(ptr, ctypes.c_uint(0x5A5A0000 + i), ctypes.c_size_t(words))
    status = status or cuda.cuCtxSynchronize()
    print(f"pass {i}: cuMemsetD32 over {size >> 20} MiB {time.perf_counter() - start:.4f} s", flush=True)
    check(f"pass {i}", status)
word = ctypes.c_uint32()
for name, offset in [("start", 0), ("middle", size // 2 // 4 * 4), ("end", size - 4)]:
    check(f"read at the {name}", cuda.cuMemcpyDtoH_v2(ctypes.byref(word), u64(ptr.value + offset), ctypes.c_size_t(4)))
    expected = 0x5A5A0000 + PASSES - 1
    print(f"word at the {name}: {word.value:#x}" + ("" if word.value == expected else f" (expected {expected:#x})"), flush=True)
    if word.value != expected:
        sys.exit(1)
retained = u64()
check("cuMemRetainAllocationHandle at the last byte", cuda.cuMemRetainAllocationHandle(ctypes.byref(retained), ctypes.c_void_p(ptr.value + size - 1)))
print(f"retained handle is the created one: {retained.value == handle.value}", flush=True)
fd = ctypes.c_int(-1)
print(f"cuMemExportToShareableHandle: {cuda.cuMemExportToShareableHandle(ctypes.byref(fd), handle, POSIX_FD, u64(0))}", flush=True)
check("cuMemRelease, the retained reference", cuda.cuMemRelease(retained))
check("cuMemRelease, the created reference", cuda.cuMemRelease(handle))
check("cuMemsetD32 after the releases, still mapped", cuda.cuMemsetD32_v2(ptr, ctypes.c_uint(1), ctypes.c_size_t(words)) or cuda.cuCtxSynchronize())
check("cuMemUnmap, the whole range", cuda.cuMemUnmap(ptr, ctypes.c_size_t(size)))
check("cuMemAddressFree", cuda.cuMemAddressFree(ptr, ctypes.c_size_t(size)))
print("done", flush=True)
