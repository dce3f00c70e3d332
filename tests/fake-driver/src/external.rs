//! External memory (`cuImportExternalMemory`, `cuExternalMemoryGetMappedBuffer`,
//! `cuDestroyExternalMemory`): memory another API allocated (Vulkan, through the fake ICD),
//! imported from an opaque file descriptor. It belongs to its exporter, so neither the import nor
//! its mapped buffers charge the truth; a mapped buffer is a device range `cuMemFree` frees.

use crate::cuda::*;
use crate::ffi::{CuResult, cu, get, put};
use crate::memory::Alloc;
use crate::state;

/// One imported memory object.
pub struct External {
    pub size: u64,
    pub phys: usize,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuImportExternalMemory(
    extMem_out: *mut CUexternalMemory,
    memHandleDesc: *const CUDA_EXTERNAL_MEMORY_HANDLE_DESC,
) -> CUresult {
    cu(|| {
        // SAFETY: null or the caller's descriptor.
        let desc = unsafe { get(memHandleDesc) }?;
        if extMem_out.is_null() || desc.type_ != CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD || desc.size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the descriptor's type says the union holds a file descriptor.
        let fd = unsafe { desc.handle.fd };
        // SAFETY: fcntl only asks whether the descriptor is open.
        if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = state::initialised()?;
        let current = state.current()?;
        let handle = state.new_handle();
        state.externals.insert(
            handle,
            External {
                size: desc.size,
                phys: current.phys,
            },
        );
        // The driver owns the descriptor once the import succeeded.
        // SAFETY: an open descriptor the caller handed over.
        unsafe { libc::close(fd) };
        // SAFETY: checked non-null above.
        unsafe { put(extMem_out, handle as CUexternalMemory) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuExternalMemoryGetMappedBuffer(
    devPtr: *mut CUdeviceptr,
    extMem: CUexternalMemory,
    bufferDesc: *const CUDA_EXTERNAL_MEMORY_BUFFER_DESC,
) -> CUresult {
    cu(|| {
        // SAFETY: null or the caller's descriptor.
        let desc = unsafe { get(bufferDesc) }?;
        if devPtr.is_null() || desc.size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = state::initialised()?;
        let current = state.current()?;
        let external = state
            .externals
            .get(&(extMem as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let end = desc.offset.checked_add(desc.size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if end > external.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let phys = external.phys;
        let alloc = Alloc {
            size: desc.size,
            charge: 0,
            phys,
            ordinal: current.ordinal,
            ctx: current.ctx,
            pool: None,
            graph: false,
        };
        let pointer = state.place(phys, alloc)?;
        // SAFETY: checked non-null above.
        unsafe { put(devPtr, pointer) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDestroyExternalMemory(extMem: CUexternalMemory) -> CUresult {
    cu(|| -> CuResult {
        let mut state = state::initialised()?;
        state
            .externals
            .remove(&(extMem as usize))
            .map(drop)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}
