//! Unified (managed) memory: where each managed allocation lives, and the calls that move it.
//!
//! A managed allocation lives on its device when the device has room for it at allocation time
//! (charged to the truth's `used`, as device memory is), and in host memory otherwise (charged to
//! the process's host-resident bytes instead): the real driver oversubscribes a device with
//! managed memory instead of failing. Residence is per allocation, not per page:
//! - `cuMemAdvise_v2` `SET_PREFERRED_LOCATION` to the host moves a device-resident allocation to
//!   the host; other advice is checked and recorded nowhere.
//! - `cuMemPrefetchAsync_v2` to a device moves a host-resident allocation there when the device
//!   has room for all of it (the real driver would evict other pages; the fake leaves it on the
//!   host and still succeeds); to the host, it moves it there.

use std::ffi::c_uint;

use crate::cuda::*;
use crate::ffi::{CuResult, cu, put};
use crate::memory::Alloc;
use crate::state::{Current, State, initialised};

/// Where a managed allocation's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    Device,
    Host,
}

impl State {
    /// A managed allocation of `size` bytes: on the device if it fits, in host memory otherwise.
    fn alloc_managed(&mut self, current: Current, size: u64) -> CuResult<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let residence = match self.charge(current.phys, size) {
            Ok(()) => Residence::Device,
            Err(CUDA_ERROR_OUT_OF_MEMORY) => Residence::Host,
            Err(error) => return Err(error),
        };
        let charge = if residence == Residence::Device { size } else { 0 };
        let ptr = self
            .place(current.phys, Alloc::plain(current, size, charge))
            .inspect_err(|_| self.uncharge(current.phys, charge))?;
        if residence == Residence::Host {
            self.record_host(size, true);
        }
        self.managed.insert(ptr, residence);
        Ok(ptr)
    }

    /// The managed allocation `[ptr, ptr + count)` lies in: (base, size, device, residence).
    fn managed_range(&self, ptr: u64, count: u64) -> CuResult<(u64, u64, usize, Residence)> {
        let (base, alloc) = self.find(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let residence = *self.managed.get(&base).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let end = ptr.checked_add(count).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if count == 0 || end > base + alloc.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok((base, alloc.size, alloc.phys, residence))
    }

    /// Moves the managed allocation at `base` to `to`; stays where it is when a device lacks room.
    fn move_managed(&mut self, base: u64, to: Residence) {
        let Some((size, phys)) = self.allocs.get(&base).map(|alloc| (alloc.size, alloc.phys)) else {
            return;
        };
        match (self.managed.get(&base).copied(), to) {
            (Some(Residence::Device), Residence::Host) => {
                self.uncharge(phys, size);
                self.record_host(size, true);
            }
            (Some(Residence::Host), Residence::Device) => {
                if self.charge(phys, size).is_err() {
                    return;
                }
                self.record_host(size, false);
            }
            _ => return,
        }
        if let Some(alloc) = self.allocs.get_mut(&base) {
            alloc.charge = if to == Residence::Device { size } else { 0 };
        }
        self.managed.insert(base, to);
    }

    /// Forgets a freed managed allocation, giving back its host bytes (its device bytes went with
    /// the allocation's charge).
    pub fn forget_managed(&mut self, base: u64, size: u64) {
        if self.managed.remove(&base) == Some(Residence::Host) {
            self.record_host(size, false);
        }
    }

    fn record_host(&mut self, bytes: u64, more: bool) {
        if let Some(truth) = self.truth {
            truth.record_host(self.slot, bytes, more);
        }
    }
}

/// Where a location puts managed memory: a device of this process (checked), or the host.
fn residence_of(state: &State, location: &CUmemLocation) -> CuResult<Residence> {
    match location.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => state.device(location.id()).map(|_| Residence::Device),
        CU_MEM_LOCATION_TYPE_HOST | CU_MEM_LOCATION_TYPE_HOST_NUMA | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => {
            Ok(Residence::Host)
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint) -> CUresult {
    cu(|| {
        if dptr.is_null() || !(flags == CU_MEM_ATTACH_GLOBAL || flags == CU_MEM_ATTACH_HOST) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = initialised()?;
        let current = state.current()?;
        let ptr = state.alloc_managed(current, bytesize as u64)?;
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(dptr, ptr) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAdvise_v2(
    devPtr: CUdeviceptr,
    count: usize,
    advice: CUmem_advise,
    location: CUmemLocation,
) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let (base, size, _, _) = state.managed_range(devPtr, count as u64)?;
        let residence = residence_of(&state, &location)?;
        match advice {
            CU_MEM_ADVISE_SET_PREFERRED_LOCATION => {
                // The whole allocation is one unit here: advice on part of it moves none of it.
                if residence == Residence::Host && devPtr == base && count as u64 == size {
                    state.move_managed(base, Residence::Host);
                }
                Ok(())
            }
            CU_MEM_ADVISE_SET_ACCESSED_BY
            | CU_MEM_ADVISE_UNSET_ACCESSED_BY
            | CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION
            | CU_MEM_ADVISE_SET_READ_MOSTLY
            | CU_MEM_ADVISE_UNSET_READ_MOSTLY => Ok(()),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPrefetchAsync_v2(
    devPtr: CUdeviceptr,
    count: usize,
    location: CUmemLocation,
    flags: c_uint,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = initialised()?;
        state.stream_target(hStream)?;
        let (base, size, _, _) = state.managed_range(devPtr, count as u64)?;
        let to = residence_of(&state, &location)?;
        if devPtr == base && count as u64 == size {
            state.move_managed(base, to);
        }
        Ok(())
    })
}
