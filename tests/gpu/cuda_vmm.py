"""The CUDA driver's VMM structures and constants for the GPU suite's ctypes scripts
(`vmm_split.py`, `host_vmm_numa.py`), as cuda.h lays them out, and the driver library itself."""

import ctypes

cuda = ctypes.CDLL("libcuda.so.1")
u64 = ctypes.c_uint64


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


# CUmemAllocationType, CUmemAllocationHandleType, CUmemAccess_flags,
# CUmemAllocationGranularity_flags and CUmemLocationType values.
PINNED, POSIX_FD, READ_WRITE, MINIMUM = 1, 1, 3, 0
LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA = 1, 2, 3

