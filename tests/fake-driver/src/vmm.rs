//! Virtual memory management. `cuMemCreate` charges device-located handles their size rounded
//! up to `FAKE_CUDA_GRANULARITY` (the real driver rejects sizes that are not a multiple of it;
//! host-located ones charge nothing). As the driver documents, the memory stays until its handle's
//! last reference is released (`cuMemRelease`, one for the create and one for each
//! `cuMemRetainAllocationHandle`) and its last mapping is unmapped (`cuMemUnmap`), in either
//! order; `cuMemAddressFree` of a range still mapped unmaps it here (the documentation does not
//! say). Address reservations, mappings and access are bookkeeping only.

use std::ffi::c_ulonglong;

use crate::cuda::*;
use crate::ffi::{CuResult, cu, get, put, round_up};
use crate::state::{self, initialised};

pub struct Physical {
    pub size: u64,
    pub ordinal: i32,
    /// The device charged; `None` for host-located memory.
    pub phys: Option<usize>,
    /// References to the handle not yet released; at 0 the handle is gone, and the memory with it
    /// once nothing maps it.
    pub references: u32,
    /// The shareable handle types it was made with (`requestedHandleTypes`).
    pub handle_types: u32,
}

/// Frees the memory of `handle` if no reference and no mapping holds it any longer.
fn free_if_unheld(state: &mut state::State, handle: u64) {
    let held = state
        .physical
        .get(&handle)
        .is_some_and(|physical| physical.references > 0)
        || state.mappings.values().any(|&(_, mapped)| mapped == handle);
    if held {
        return;
    }
    if let Some(physical) = state.physical.remove(&handle) {
        match physical.phys {
            Some(phys) => state.uncharge(phys, physical.size),
            None => state.record_host(physical.size, false),
        }
    }
}

/// Removes the mappings that start in `ptr..end`, and frees what only they held.
fn unmap_range(state: &mut state::State, ptr: u64, end: u64) -> usize {
    let inside: Vec<u64> = state.mappings.range(ptr..end).map(|(start, _)| *start).collect();
    let count = inside.len();
    for start in inside {
        if let Some((_, handle)) = state.mappings.remove(&start) {
            free_if_unheld(state, handle);
        }
    }
    count
}

/// Bytes `cuMemCreate(size)` charges: the size rounded up to the granularity.
pub fn vmm_charge(size: u64, granularity: u64) -> CuResult<u64> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    round_up(size, granularity).ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    _option: CUmemAllocationGranularity_flags,
) -> CUresult {
    cu(|| {
        state::ensure_initialised()?;
        if prop.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: out-pointer from the caller.
        unsafe { put(granularity, state::config().granularity as usize) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    _flags: c_ulonglong,
) -> CUresult {
    cu(|| {
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a valid CUmemAllocationProp (null is rejected).
        let prop = unsafe { get(prop) }?;
        let mut state = initialised()?;
        let bytes = vmm_charge(size as u64, state::config().granularity)?;
        let (ordinal, phys) = match prop.location.type_ {
            CU_MEM_LOCATION_TYPE_DEVICE => (prop.location.id(), Some(state.device(prop.location.id())?)),
            // CUDA 13.5: a locality domain of a device is that device's memory (the fake has one
            // domain per device); `localized.deviceId` is the union's first byte.
            #[cfg(cuda_api = "13050")]
            CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN => {
                let [device, domain, ..] = prop.location.id().to_ne_bytes();
                if domain != 0 {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                let ordinal = i32::from(device);
                (ordinal, Some(state.device(ordinal)?))
            }
            // As the driver documents: no shareable handles for memory of no particular node, and
            // HOST_NUMA_CURRENT is for pools only. Device features (GPUDirect RDMA, fabric
            // handles) are refused too, as a driver may refuse them for host memory
            // (results/2026-12-07-h100-elastic-jax-e945559.txt).
            CU_MEM_LOCATION_TYPE_HOST | CU_MEM_LOCATION_TYPE_HOST_NUMA => {
                let device_only = prop.allocFlags.gpuDirectRDMACapable != 0
                    || prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC != 0;
                let shareable = prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE;
                if device_only || (prop.location.type_ == CU_MEM_LOCATION_TYPE_HOST && shareable) {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                (0, None)
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        if prop.type_ == CU_MEM_ALLOCATION_TYPE_INVALID {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match phys {
            Some(phys) => state.charge(phys, bytes)?,
            None => state.record_host(bytes, true),
        }
        let value = state.new_handle() as u64;
        state.physical.insert(
            value,
            Physical {
                size: bytes,
                ordinal,
                phys,
                references: 1,
                handle_types: prop.requestedHandleTypes,
            },
        );
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(handle, value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let physical = state
            .physical
            .get_mut(&handle)
            .filter(|physical| physical.references > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        physical.references -= 1;
        free_if_unheld(&mut state, handle);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    _addr: CUdeviceptr,
    _flags: c_ulonglong,
) -> CUresult {
    cu(|| {
        if ptr.is_null() || size == 0 || (alignment != 0 && !alignment.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = initialised()?;
        let align = (alignment as u64).max(state::config().granularity);
        let start = state
            .reserved_va
            .take(size as u64, align)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        state.reservations.insert(start, size as u64);
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(ptr, start) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        if state.reservations.get(&ptr) != Some(&(size as u64)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        state.reservations.remove(&ptr);
        state.reserved_va.give_back(ptr);
        unmap_range(&mut state, ptr, ptr + size as u64);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    _flags: c_ulonglong,
) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let size = size as u64;
        let end = ptr.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (&base, &reserved) = state
            .reservations
            .range(..=ptr)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let physical = state
            .physical
            .get(&handle)
            .filter(|physical| physical.references > 0)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let fits_handle = (offset as u64).checked_add(size).is_some_and(|e| e <= physical.size);
        if size == 0 || end > base + reserved || !fits_handle {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let overlaps = state
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(start, (len, _))| start + len > ptr);
        if overlaps {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        state.mappings.insert(ptr, (size, handle));
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let result = cu(|| {
        let mut state = initialised()?;
        let end = ptr.checked_add(size as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if unmap_range(&mut state, ptr, end) == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    });
    let delay = state::config().unmap_return_us;
    if result == CUDA_SUCCESS && delay > 0 {
        std::thread::sleep(std::time::Duration::from_micros(delay));
    }
    result
}

/// The handle of the memory mapped at `addr`, with one more reference to release.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut std::ffi::c_void,
) -> CUresult {
    cu(|| {
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = initialised()?;
        let addr = addr as u64;
        let mapped = state
            .mappings
            .range(..=addr)
            .next_back()
            .filter(|(start, (len, _))| addr < *start + len)
            .map(|(_, &(_, mapped))| mapped)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let physical = state.physical.get_mut(&mapped).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        physical.references += 1;
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(handle, mapped) }
    })
}

/// A shareable handle of a type the allocation was made with: a file descriptor of `/dev/null`
/// stands for it (the fake imports nothing).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut std::ffi::c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: CUmemAllocationHandleType,
    flags: c_ulonglong,
) -> CUresult {
    cu(|| {
        let state = initialised()?;
        let physical = state
            .physical
            .get(&handle)
            .filter(|physical| physical.references > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if shareable.is_null() || flags != 0 || handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if physical.handle_types & handle_type == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(CUDA_ERROR_OPERATING_SYSTEM);
        }
        // SAFETY: out-pointer from the caller, checked non-null; a POSIX handle is an int.
        unsafe { put(shareable.cast::<i32>(), fd) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    cu(|| {
        let state = initialised()?;
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let end = ptr.checked_add(size as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mapped = state
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(start, (len, _))| start + len > ptr);
        if mapped { Ok(()) } else { Err(CUDA_ERROR_INVALID_VALUE) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charge_rounds_to_granularity() {
        let g = 2 << 20;
        assert_eq!(vmm_charge(1, g), Ok(g));
        assert_eq!(vmm_charge(g, g), Ok(g));
        assert_eq!(vmm_charge(g + 1, g), Ok(2 * g));
        assert_eq!(vmm_charge(0, g), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(vmm_charge(u64::MAX, g), Err(CUDA_ERROR_OUT_OF_MEMORY));
    }
}
