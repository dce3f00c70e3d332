//! Device memory accounting entry points. `cuda-api.toml` routes every allocation, free and memory
//! query here, with the arguments each needs. Accounting is not built yet: each handler forwards
//! the call unchanged, which is the behaviour the foundation proves correct. Handlers are generic
//! over pointer and size types so the legacy 32-bit variants share them.

use std::ffi::c_uint;

use crate::sys::cuda::{
    CUDA_ARRAY3D_DESCRIPTOR, CUDA_MEM_ALLOC_NODE_PARAMS, CUarray, CUcontext, CUdevice, CUdeviceptr, CUgraph,
    CUgraphExec, CUgraphNode, CUgraphNodeParams, CUlibrary, CUmemAllocationProp, CUmemGenericAllocationHandle,
    CUmemoryPool, CUmipmappedArray, CUmodule, CUresult, CUstream,
};

/// `cuMemGetInfo` and `_v2`.
pub fn get_info<S>(_name: &'static str, call: impl FnOnce() -> CUresult, _free: *mut S, _total: *mut S) -> CUresult {
    call()
}

/// `cuDeviceTotalMem` and `_v2`.
pub fn device_total_mem<S>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _bytes: *mut S,
    _device: CUdevice,
) -> CUresult {
    call()
}

/// `cuMemAlloc` and `_v2`.
pub fn alloc<P, S>(_name: &'static str, call: impl FnOnce() -> CUresult, _dptr: *mut P, _size: S) -> CUresult {
    call()
}

/// `cuMemAllocPitch` and `_v2`.
pub fn alloc_pitch<P, S>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _dptr: *mut P,
    _pitch: *mut S,
    _width: S,
    _height: S,
    _element_size: c_uint,
) -> CUresult {
    call()
}

/// `cuMemAllocManaged`.
pub fn alloc_managed(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _dptr: *mut CUdeviceptr,
    _size: usize,
    _flags: c_uint,
) -> CUresult {
    call()
}

/// `cuMemAllocAsync` and `_ptsz`.
pub fn alloc_async(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _dptr: *mut CUdeviceptr,
    _size: usize,
    _stream: CUstream,
) -> CUresult {
    call()
}

/// `cuMemAllocFromPoolAsync` and `_ptsz`.
pub fn alloc_from_pool_async(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _dptr: *mut CUdeviceptr,
    _size: usize,
    _pool: CUmemoryPool,
    _stream: CUstream,
) -> CUresult {
    call()
}

/// `cuMemFree` and `_v2`.
pub fn free<P>(_name: &'static str, call: impl FnOnce() -> CUresult, _dptr: P) -> CUresult {
    call()
}

/// `cuMemFreeAsync` and `_ptsz`.
pub fn free_async(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _dptr: CUdeviceptr,
    _stream: CUstream,
) -> CUresult {
    call()
}

/// `cuMemPoolTrimTo`.
pub fn pool_trim(_name: &'static str, call: impl FnOnce() -> CUresult, _pool: CUmemoryPool, _keep: usize) -> CUresult {
    call()
}

/// `cuMemPoolDestroy`.
pub fn pool_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, _pool: CUmemoryPool) -> CUresult {
    call()
}

/// `cuMemCreate`.
pub fn create(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _handle: *mut CUmemGenericAllocationHandle,
    _size: usize,
    _prop: *const CUmemAllocationProp,
    _flags: u64,
) -> CUresult {
    call()
}

/// `cuMemRelease`.
pub fn release(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _handle: CUmemGenericAllocationHandle,
) -> CUresult {
    call()
}

/// `cuArrayCreate` and `_v2` (generic over the two descriptor versions).
pub fn array_create<D>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _array: *mut CUarray,
    _descriptor: *const D,
) -> CUresult {
    call()
}

/// `cuArray3DCreate` and `_v2`.
pub fn array3d_create<D>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _array: *mut CUarray,
    _descriptor: *const D,
) -> CUresult {
    call()
}

/// `cuArrayDestroy`.
pub fn array_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, _array: CUarray) -> CUresult {
    call()
}

/// `cuMipmappedArrayCreate`.
pub fn mipmapped_array_create(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _array: *mut CUmipmappedArray,
    _descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
    _levels: c_uint,
) -> CUresult {
    call()
}

/// `cuMipmappedArrayDestroy`.
pub fn mipmapped_array_destroy(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _array: CUmipmappedArray,
) -> CUresult {
    call()
}

/// `cuGraphAddMemAllocNode`.
pub fn graph_add_mem_alloc_node(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _node: *mut CUgraphNode,
    _graph: CUgraph,
    _params: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    call()
}

/// `cuGraphAddNode` and `_v2`.
pub fn graph_add_node(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _node: *mut CUgraphNode,
    _graph: CUgraph,
    _params: *mut CUgraphNodeParams,
) -> CUresult {
    call()
}

/// The `cuGraphInstantiate` family.
pub fn graph_instantiate(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _exec: *mut CUgraphExec,
    _graph: CUgraph,
) -> CUresult {
    call()
}

/// `cuGraphExecDestroy`.
pub fn graph_exec_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, _exec: CUgraphExec) -> CUresult {
    call()
}

/// `cuGraphDestroy`.
pub fn graph_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, _graph: CUgraph) -> CUresult {
    call()
}

/// `cuDeviceGraphMemTrim`.
pub fn graph_mem_trim(_name: &'static str, call: impl FnOnce() -> CUresult, _device: CUdevice) -> CUresult {
    call()
}

/// The `cuCtxCreate` family.
pub fn ctx_create(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _context: *mut CUcontext,
    _device: CUdevice,
) -> CUresult {
    call()
}

/// `cuCtxDestroy` and `_v2`.
pub fn ctx_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, _context: CUcontext) -> CUresult {
    call()
}

/// `cuDevicePrimaryCtxRetain`.
pub fn primary_ctx_retain(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _context: *mut CUcontext,
    _device: CUdevice,
) -> CUresult {
    call()
}

/// `cuDevicePrimaryCtxRelease`, `Reset` and their `_v2`.
pub fn primary_ctx_release(_name: &'static str, call: impl FnOnce() -> CUresult, _device: CUdevice) -> CUresult {
    call()
}

/// The `cuModuleLoad` family.
pub fn module_load(_name: &'static str, call: impl FnOnce() -> CUresult, _module: *mut CUmodule) -> CUresult {
    call()
}

/// `cuModuleUnload`.
pub fn module_unload(_name: &'static str, call: impl FnOnce() -> CUresult, _module: CUmodule) -> CUresult {
    call()
}

/// The `cuLibraryLoad` family.
pub fn library_load(_name: &'static str, call: impl FnOnce() -> CUresult, _library: *mut CUlibrary) -> CUresult {
    call()
}

/// `cuLibraryUnload`.
pub fn library_unload(_name: &'static str, call: impl FnOnce() -> CUresult, _library: CUlibrary) -> CUresult {
    call()
}
