//! Virtual memory management. `cuMemCreate` charges device-located handles their size rounded
//! up to `FAKE_CUDA_GRANULARITY` (the real driver rejects sizes that are not a multiple of it;
//! host-located ones charge nothing) until `cuMemRelease` (the
//! real driver keeps the memory until the last mapping goes too; here release is immediate).
//! Address reservations, mappings and access are bookkeeping only.

use std::ffi::c_ulonglong;

use crate::cuda::*;
use crate::ffi::{CuResult, cu, get, put, round_up};
use crate::state::{self, initialised};

pub struct Physical {
    pub size: u64,
    pub ordinal: i32,
    /// The device charged; `None` for host-located memory.
    pub phys: Option<usize>,
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
        let physical = state.physical.remove(&handle).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match physical.phys {
            Some(phys) => state.uncharge(phys, physical.size),
            None => state.record_host(physical.size, false),
        }
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
        let end = ptr + size as u64;
        let inside: Vec<u64> = state.mappings.range(ptr..end).map(|(start, _)| *start).collect();
        for start in inside {
            state.mappings.remove(&start);
        }
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
        let physical = state.physical.get(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
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
    cu(|| {
        let mut state = initialised()?;
        let end = ptr.checked_add(size as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let inside: Vec<u64> = state.mappings.range(ptr..end).map(|(start, _)| *start).collect();
        if inside.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for start in inside {
            state.mappings.remove(&start);
        }
        Ok(())
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
