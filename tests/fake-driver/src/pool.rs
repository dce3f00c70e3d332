//! Stream-ordered allocation and memory pools.
//!
//! A pool reserves physical memory in chunks of `FAKE_CUDA_GRANULARITY` as its use grows, and
//! keeps freed blocks reserved (still charged in the truth) until `cuMemPoolTrimTo`, pool
//! destruction, or a synchronisation (stream, event or context) that finds more reserved than
//! the pool's release threshold: the real pool's behaviour, with the default threshold 0. Frees
//! take effect at once (not in stream order). Host-located pools charge nothing.

use std::ffi::c_void;

use crate::cuda::*;
use crate::ffi::{CuResult, cu, get, put, round_up};
use crate::memory::Alloc;
use crate::state::{self, State, initialised};

pub struct Pool {
    pub ordinal: i32,
    /// The physical device charged; `None` for host pools.
    pub phys: Option<usize>,
    pub reserved: u64,
    pub used: u64,
    pub reserved_high: u64,
    pub used_high: u64,
    pub threshold: u64,
    pub default: bool,
    pub destroyed: bool,
}

impl Pool {
    fn new(ordinal: i32, phys: Option<usize>, default: bool) -> Pool {
        Pool {
            ordinal,
            phys,
            reserved: 0,
            used: 0,
            reserved_high: 0,
            used_high: 0,
            threshold: 0,
            default,
            destroyed: false,
        }
    }
}

/// What shrinking a pool to keep at least `keep` bytes reserved leaves reserved.
pub fn trim_target(reserved: u64, used: u64, keep: u64, chunk: u64) -> u64 {
    let in_use = round_up(used, chunk).unwrap_or(u64::MAX);
    in_use.max(keep).min(reserved)
}

impl State {
    fn chunk() -> u64 {
        state::config().granularity
    }

    pub fn default_pool(&mut self, ordinal: CUdevice) -> CuResult<usize> {
        let phys = self.device(ordinal)?;
        let index = usize::try_from(ordinal).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
        if let Some(Some(handle)) = self.default_pool.get(index) {
            return Ok(*handle);
        }
        let handle = self.new_handle();
        self.pools.insert(handle, Pool::new(ordinal, Some(phys), true));
        if let Some(entry) = self.default_pool.get_mut(index) {
            *entry = Some(handle);
        }
        Ok(handle)
    }

    fn current_pool(&mut self, ordinal: CUdevice) -> CuResult<usize> {
        match usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.current_pool.get(i).copied().flatten())
        {
            Some(handle) => Ok(handle),
            None => self.default_pool(ordinal),
        }
    }

    /// Allocates `size` bytes from `pool` on `stream` (a graph node while the stream captures).
    fn pool_alloc(&mut self, pool: usize, size: u64, stream: CUstream) -> CuResult<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let target = self.stream_target(stream)?;
        let (ordinal, phys) = match self.pools.get(&pool) {
            Some(p) if !p.destroyed => (p.ordinal, p.phys),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        if let Some(handle) = target.capturing {
            return self.capture_alloc(handle, size, ordinal);
        }
        let chunk = State::chunk();
        let (reserved, used) = self.pools.get(&pool).map(|p| (p.reserved, p.used)).unwrap_or_default();
        let needed = used.checked_add(size).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let mut grow = 0;
        if needed > reserved {
            grow = round_up(needed, chunk).ok_or(CUDA_ERROR_OUT_OF_MEMORY)? - reserved;
            if let Some(phys) = phys {
                self.charge(phys, grow)?;
            }
        }
        let alloc_phys = phys.unwrap_or(target.phys);
        let alloc = Alloc {
            size,
            charge: 0,
            phys: alloc_phys,
            ordinal,
            ctx: 0,
            pool: Some(pool),
            graph: false,
        };
        let placed = self.place(alloc_phys, alloc);
        let Some(p) = self.pools.get_mut(&pool) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        p.reserved += grow;
        p.reserved_high = p.reserved_high.max(p.reserved);
        if placed.is_ok() {
            p.used = needed;
            p.used_high = p.used_high.max(needed);
        }
        placed
    }

    /// A pool allocation of `size` bytes was freed.
    pub fn pool_give_back(&mut self, pool: usize, size: u64) {
        let Some(p) = self.pools.get_mut(&pool) else { return };
        p.used = p.used.saturating_sub(size);
        if p.destroyed {
            self.trim_pool(pool, 0);
            if self.pools.get(&pool).is_some_and(|p| p.used == 0) {
                self.pools.remove(&pool);
            }
        }
    }

    fn trim_pool(&mut self, pool: usize, keep: u64) {
        let chunk = State::chunk();
        let Some(p) = self.pools.get_mut(&pool) else { return };
        let target = trim_target(p.reserved, p.used, keep, chunk);
        let released = p.reserved - target;
        p.reserved = target;
        if let Some(phys) = p.phys
            && released > 0
        {
            self.uncharge(phys, released);
        }
    }

    /// At a synchronisation: pools of the device give back what exceeds their threshold.
    pub fn trim_pools_on_sync(&mut self, phys: usize) {
        let pools: Vec<(usize, u64)> = self
            .pools
            .iter()
            .filter(|(_, p)| p.phys == Some(phys))
            .map(|(h, p)| (*h, p.threshold))
            .collect();
        for (pool, threshold) in pools {
            self.trim_pool(pool, threshold);
        }
    }

    fn destroy_pool(&mut self, pool: usize) -> CuResult {
        match self.pools.get_mut(&pool) {
            Some(p) if !p.default && !p.destroyed => p.destroyed = true,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        for entry in self.current_pool.iter_mut() {
            if *entry == Some(pool) {
                *entry = None;
            }
        }
        self.pool_give_back(pool, 0);
        Ok(())
    }

    fn free_async(&mut self, ptr: u64, stream: CUstream) -> CuResult {
        let target = self.stream_target(stream)?;
        match self.allocs.get(&ptr) {
            Some(alloc) if alloc.graph => {
                return match target.capturing {
                    Some(stream) => self.capture_free(stream),
                    None => Err(CUDA_ERROR_INVALID_VALUE),
                };
            }
            Some(_) => {}
            None => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        self.release_alloc(ptr);
        Ok(())
    }
}

fn alloc_async(dptr: *mut CUdeviceptr, bytesize: usize, pool: Option<CUmemoryPool>, stream: CUstream) -> CuResult {
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut state = initialised()?;
    let pool = match pool {
        Some(pool) => pool as usize,
        None => {
            let ordinal = state.stream_target(stream)?.ordinal;
            state.current_pool(ordinal)?
        }
    };
    let ptr = state.pool_alloc(pool, bytesize as u64, stream)?;
    // SAFETY: out-pointer from the caller, checked non-null.
    unsafe { put(dptr, ptr) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) -> CUresult {
    cu(|| alloc_async(dptr, bytesize, None, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) -> CUresult {
    cu(|| alloc_async(dptr, bytesize, None, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    hStream: CUstream,
) -> CUresult {
    cu(|| alloc_async(dptr, bytesize, Some(pool), hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    hStream: CUstream,
) -> CUresult {
    cu(|| alloc_async(dptr, bytesize, Some(pool), hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    cu(|| initialised()?.free_async(dptr, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    cu(|| initialised()?.free_async(dptr, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(pool: *mut CUmemoryPool, poolProps: *const CUmemPoolProps) -> CUresult {
    cu(|| {
        if pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a valid CUmemPoolProps (null is rejected).
        let props = unsafe { get(poolProps) }?;
        let mut state = initialised()?;
        let (ordinal, phys) = match props.location.type_ {
            CU_MEM_LOCATION_TYPE_DEVICE => (props.location.id(), Some(state.device(props.location.id())?)),
            CU_MEM_LOCATION_TYPE_HOST | CU_MEM_LOCATION_TYPE_HOST_NUMA | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => {
                (0, None)
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        if props.allocType != CU_MEM_ALLOCATION_TYPE_PINNED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = state.new_handle();
        state.pools.insert(handle, Pool::new(ordinal, phys, false));
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(pool, handle as CUmemoryPool) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    cu(|| initialised()?.destroy_pool(pool as usize))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool_out: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    cu(|| {
        if pool_out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = initialised()?.default_pool(dev)?;
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(pool_out, handle as CUmemoryPool) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    cu(|| {
        if pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = initialised()?.current_pool(dev)?;
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(pool, handle as CUmemoryPool) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let phys = state.device(dev)?;
        match state.pools.get(&(pool as usize)) {
            Some(p) if !p.destroyed && p.phys == Some(phys) => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        let index = usize::try_from(dev).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
        if let Some(entry) = state.current_pool.get_mut(index) {
            *entry = Some(pool as usize);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        if !state.pools.contains_key(&(pool as usize)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        state.trim_pool(pool as usize, minBytesToKeep as u64);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: CUmemoryPool,
    attr: CUmemPool_attribute,
    value: *mut c_void,
) -> CUresult {
    cu(|| {
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = initialised()?;
        state.refuse_unsafe_call()?;
        let p = state.pools.get(&(pool as usize)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let word = match attr {
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => p.threshold,
            CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT => p.reserved,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => p.reserved_high,
            CU_MEMPOOL_ATTR_USED_MEM_CURRENT => p.used,
            CU_MEMPOOL_ATTR_USED_MEM_HIGH => p.used_high,
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES
            | CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC
            | CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                // SAFETY: these attributes are ints.
                return unsafe { put(value.cast::<i32>(), 1) };
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: the remaining attributes are cuuint64_t.
        unsafe { put(value.cast::<u64>(), word) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: CUmemoryPool,
    attr: CUmemPool_attribute,
    value: *mut c_void,
) -> CUresult {
    cu(|| {
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = initialised()?;
        let p = state.pools.get_mut(&(pool as usize)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match attr {
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => {
                // SAFETY: the attribute is a cuuint64_t.
                p.threshold = unsafe { get(value.cast::<u64>().cast_const()) }?;
            }
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => p.reserved_high = p.reserved,
            CU_MEMPOOL_ATTR_USED_MEM_HIGH => p.used_high = p.used,
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES
            | CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC
            | CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trimming() {
        let mb = 1 << 20;
        // 10 MiB reserved, 3 MiB used, chunk 2 MiB: keep 4 MiB.
        assert_eq!(trim_target(10 * mb, 3 * mb, 0, 2 * mb), 4 * mb);
        assert_eq!(trim_target(10 * mb, 3 * mb, 6 * mb, 2 * mb), 6 * mb);
        assert_eq!(trim_target(10 * mb, 3 * mb, u64::MAX, 2 * mb), 10 * mb);
        assert_eq!(trim_target(10 * mb, 0, 0, 2 * mb), 0);
    }
}
