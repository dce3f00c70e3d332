"""Where host memory for the GPU is fastest, through the driver API (ctypes, no library needed):
prints the GPU's host NUMA node as the driver reports it (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID) and as
Linux does (/sys/bus/pci/devices/<bus id>/numa_node), then times, for GIB GiB of host memory made
each way, a cuMemsetD32 over it (the GPU writing over the host link, PASSES times) and a copy of it
into device memory (the GPU reading it):

- VMM memory (cuMemCreate) located on each host NUMA node, and on no particular node, mapped and
  made accessible to the GPU, as elastic memory makes the VMM allocations the device cannot back;
- unified memory preferring the host and accessed by the GPU, as elastic memory's spills' tails.

    python3 host_vmm_numa.py [GIB] [PASSES]
"""

import ctypes
import glob
import os
import sys
import time

from cuda_vmm import (  # beside this script
    LOC_DEVICE,
    LOC_HOST,
    LOC_HOST_NUMA,
    MINIMUM,
    PINNED,
    READ_WRITE,
    AccessDesc,
    Location,
    Prop,
    cuda,
    u64,
)

GIB = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 3
ATTR_HOST_NUMA_ID = 134
ADVISE_SET_PREFERRED_LOCATION, ADVISE_SET_ACCESSED_BY = 3, 5
MEM_ATTACH_GLOBAL = 1


def ok(name, status):
    if status != 0:
        print(f"{name}: {status}", flush=True)
    return status == 0


ok("cuInit", cuda.cuInit(0))
device = ctypes.c_int()
ok("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
context = ctypes.c_void_p()
ok("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
ok("cuCtxSetCurrent", cuda.cuCtxSetCurrent(context))
numa = ctypes.c_int(-1)
status = cuda.cuDeviceGetAttribute(ctypes.byref(numa), ATTR_HOST_NUMA_ID, device)
bus = ctypes.create_string_buffer(64)
cuda.cuDeviceGetPCIBusId(bus, 64, device)
bus_id = bus.value.decode().lower()
sys_node = "?"
for path in glob.glob(f"/sys/bus/pci/devices/{bus_id}/numa_node") + glob.glob(f"/sys/bus/pci/devices/*{bus_id[-7:]}/numa_node"):
    sys_node = open(path).read().strip()
    break
nodes = sorted(int(os.path.basename(p)[4:]) for p in glob.glob("/sys/devices/system/node/node[0-9]*"))
print(f"GPU {bus_id}: driver's host NUMA id {numa.value} (status {status}), Linux numa_node {sys_node}, host nodes {nodes}", flush=True)

size = int(GIB * (1 << 30))
words = size // 4
target = u64()
if not ok("cuMemAlloc (device copy target)", cuda.cuMemAlloc_v2(ctypes.byref(target), ctypes.c_size_t(size))):
    sys.exit(1)


def measure(name, ptr):
    writes, reads = [], []
    for i in range(PASSES):
        start = time.perf_counter()
        status = cuda.cuMemsetD32_v2(ptr, ctypes.c_uint(i), ctypes.c_size_t(words)) or cuda.cuCtxSynchronize()
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        status = status or cuda.cuMemcpyDtoD_v2(target, ptr, ctypes.c_size_t(size)) or cuda.cuCtxSynchronize()
        reads.append(time.perf_counter() - start)
        if status != 0:
            print(f"{name}: status {status}", flush=True)
            return
    gb = size / 1e9
    print(
        f"{name}: write {gb / min(writes):.1f} GB/s, read {gb / min(reads):.1f} GB/s "
        f"(best of {PASSES}: {min(writes):.4f} s, {min(reads):.4f} s)",
        flush=True,
    )


def vmm(name, location):
    prop = Prop(type=PINNED, requestedHandleTypes=0, location=location)
    granule = ctypes.c_size_t()
    if not ok(f"{name} granularity", cuda.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(prop), MINIMUM)):
        return
    bytes_ = (size + granule.value - 1) // granule.value * granule.value
    handle, ptr = u64(), u64()
    if not ok(f"{name} cuMemCreate", cuda.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(bytes_), ctypes.byref(prop), u64(0))):
        return
    good = ok(f"{name} reserve", cuda.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(bytes_), ctypes.c_size_t(0), u64(0), u64(0)))
    good = good and ok(f"{name} map", cuda.cuMemMap(ptr, ctypes.c_size_t(bytes_), ctypes.c_size_t(0), handle, u64(0)))
    access = AccessDesc(location=Location(LOC_DEVICE, device.value), flags=READ_WRITE)
    good = good and ok(f"{name} access", cuda.cuMemSetAccess(ptr, ctypes.c_size_t(bytes_), ctypes.byref(access), ctypes.c_size_t(1)))
    if good:
        measure(f"{name} (granule {granule.value >> 10} KiB)", ptr)
        cuda.cuMemUnmap(ptr, ctypes.c_size_t(bytes_))
    if ptr.value:
        cuda.cuMemAddressFree(ptr, ctypes.c_size_t(bytes_))
    cuda.cuMemRelease(handle)


for node in nodes:
    vmm(f"VMM on host NUMA node {node}", Location(LOC_HOST_NUMA, node))
vmm("VMM on the host, no node", Location(LOC_HOST, 0))

managed = u64()
if ok("cuMemAllocManaged", cuda.cuMemAllocManaged(ctypes.byref(managed), ctypes.c_size_t(size), MEM_ATTACH_GLOBAL)):
    host = Location(LOC_HOST, 0)
    gpu = Location(LOC_DEVICE, device.value)
    ok("advise host", cuda.cuMemAdvise_v2(managed, ctypes.c_size_t(size), ADVISE_SET_PREFERRED_LOCATION, host))
    ok("advise accessed by", cuda.cuMemAdvise_v2(managed, ctypes.c_size_t(size), ADVISE_SET_ACCESSED_BY, gpu))
    measure("unified memory preferring the host, accessed by the GPU", managed)
    cuda.cuMemFree_v2(managed)
cuda.cuMemFree_v2(target)
print("done", flush=True)
