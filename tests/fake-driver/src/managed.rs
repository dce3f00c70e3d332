//! Unified (managed) memory: where each page of a managed allocation lives, and the calls that
//! move it.
//!
//! A managed allocation lives on its device when the device has room for it at allocation time
//! (charged to the truth's `used`, as device memory is), and in host memory otherwise (charged to
//! the process's host-resident bytes instead): the real driver oversubscribes a device with
//! managed memory instead of failing. Residence is per page of [`PAGE`] bytes (the driver's large
//! page); a call on a range moves every page the range touches:
//! - `cuMemAdvise_v2` `SET_PREFERRED_LOCATION` to the host moves the range's device-resident
//!   pages to the host; other advice is checked and recorded nowhere.
//! - `cuMemPrefetchAsync_v2` to a device moves the range's host-resident pages there when the
//!   device has room for all of them, and fails with `CUDA_ERROR_OUT_OF_MEMORY` moving none when
//!   it has not (the real driver would evict other pages first); to the host, it moves them there.

use std::ffi::c_uint;

use crate::cuda::*;
use crate::ffi::{CuResult, cu, put};
use crate::memory::Alloc;
use crate::state::{Current, State, initialised};

/// The unit managed memory moves in.
pub const PAGE: u64 = 2 << 20;

/// Where a managed page's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    Device,
    Host,
}

/// Where each page of one managed allocation lives.
#[derive(Clone, Debug)]
pub struct Pages(Vec<Residence>);

impl Pages {
    fn host_bytes(&self, size: u64) -> u64 {
        (0..self.0.len())
            .filter(|page| self.0[*page] == Residence::Host)
            .map(|page| page_bytes(size, page))
            .sum()
    }
}

/// The bytes of page `page` of an allocation of `size` bytes (the last one may be short).
fn page_bytes(size: u64, page: usize) -> u64 {
    let start = page as u64 * PAGE;
    size.saturating_sub(start).min(PAGE)
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
        self.managed
            .insert(ptr, Pages(vec![residence; size.div_ceil(PAGE) as usize]));
        Ok(ptr)
    }

    /// The managed allocation `[ptr, ptr + count)` lies in, and the pages the range touches:
    /// (base, pages).
    fn managed_range(&self, ptr: u64, count: u64) -> CuResult<(u64, std::ops::Range<usize>)> {
        let (base, alloc) = self.find(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !self.managed.contains_key(&base) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let end = ptr.checked_add(count).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if count == 0 || end > base + alloc.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let first = ((ptr - base) / PAGE) as usize;
        let last = (end - base).div_ceil(PAGE) as usize;
        Ok((base, first..last))
    }

    /// Moves the pages `pages` of the managed allocation at `base` to `to`: to the device only
    /// when it has room for every page of them that is in host memory (else none moves).
    fn move_managed(&mut self, base: u64, pages: std::ops::Range<usize>, to: Residence) -> CuResult {
        let Some((size, phys)) = self.allocs.get(&base).map(|alloc| (alloc.size, alloc.phys)) else {
            return Ok(());
        };
        let moving: Vec<usize> = pages
            .filter(|page| {
                self.managed
                    .get(&base)
                    .and_then(|pages| pages.0.get(*page))
                    .is_some_and(|residence| *residence != to)
            })
            .collect();
        let bytes: u64 = moving.iter().map(|page| page_bytes(size, *page)).sum();
        match to {
            Residence::Device => {
                self.charge(phys, bytes)?;
                self.record_host(bytes, false);
            }
            Residence::Host => {
                self.uncharge(phys, bytes);
                self.record_host(bytes, true);
            }
        }
        if let Some(pages) = self.managed.get_mut(&base) {
            for page in moving {
                pages.0[page] = to;
            }
        }
        if let Some(alloc) = self.allocs.get_mut(&base) {
            alloc.charge = match to {
                Residence::Device => alloc.charge.saturating_add(bytes),
                Residence::Host => alloc.charge.saturating_sub(bytes),
            };
        }
        Ok(())
    }

    /// Forgets a freed managed allocation, giving back its host bytes (its device bytes went with
    /// the allocation's charge).
    pub fn forget_managed(&mut self, base: u64, size: u64) {
        if let Some(pages) = self.managed.remove(&base) {
            let host = pages.host_bytes(size);
            if host > 0 {
                self.record_host(host, false);
            }
        }
    }

    /// Adds (`more`) or takes away `bytes` of this process's memory that lives in host memory
    /// (managed memory there, VMM allocations located on the host).
    pub fn record_host(&mut self, bytes: u64, more: bool) {
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
        let (base, pages) = state.managed_range(devPtr, count as u64)?;
        let residence = residence_of(&state, &location)?;
        match advice {
            CU_MEM_ADVISE_SET_PREFERRED_LOCATION => {
                if residence == Residence::Host {
                    state.move_managed(base, pages, Residence::Host)?;
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
        let (base, pages) = state.managed_range(devPtr, count as u64)?;
        let to = residence_of(&state, &location)?;
        state.move_managed(base, pages, to)
    })
}
