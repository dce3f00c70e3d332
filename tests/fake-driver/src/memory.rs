//! Linear device memory: allocation, free, queries and (no-op) copies and sets.
//!
//! Device memory is never backed by host memory: a device pointer is an address from a
//! per-device window (`0x7f00_0000_0000 + (device << 40)`, 1 TiB, 512-byte aligned, first fit
//! with wrap-around so freed ranges are reused), and only the bytes are charged to the truth.
//! Charges: `cuMemAlloc_v2` the requested size, `cuMemAllocPitch_v2` pitch × height with the
//! pitch the width rounded up to 512; managed memory is charged where it lives (`managed.rs`).

use std::collections::BTreeMap;
use std::ffi::{c_uint, c_void};

use crate::cuda::*;
use crate::ffi::{CuResult, cu, put, round_up};
use crate::state::{self, Current, State, initialised};

pub const ALIGNMENT: u64 = 512;

/// One live allocation with a device address.
pub struct Alloc {
    pub size: u64,
    /// Bytes charged to the truth for it (0 for pool and graph allocations, charged elsewhere).
    pub charge: u64,
    pub phys: usize,
    pub ordinal: i32,
    /// The context it was allocated in (0 if none).
    pub ctx: usize,
    /// The pool it came from.
    pub pool: Option<usize>,
    /// Memory of a graph's allocation node: freed with the graph, never by `cuMemFree`.
    pub graph: bool,
}

impl Alloc {
    /// An allocation of `size` bytes in the current context, charging `charge`, of no pool or graph.
    pub fn plain(current: Current, size: u64, charge: u64) -> Alloc {
        Alloc {
            size,
            charge,
            phys: current.phys,
            ordinal: current.ordinal,
            ctx: current.ctx,
            pool: None,
            graph: false,
        }
    }
}

/// A window of device addresses handing out 512-aligned ranges, first fit from a cursor.
pub struct VaSpace {
    lo: u64,
    hi: u64,
    cursor: u64,
    live: BTreeMap<u64, u64>,
}

impl VaSpace {
    pub fn new(lo: u64, hi: u64) -> VaSpace {
        VaSpace {
            lo,
            hi,
            cursor: lo,
            live: BTreeMap::new(),
        }
    }

    /// A free range of at least `len` bytes aligned to `align` (a power of two, at least 512).
    pub fn take(&mut self, len: u64, align: u64) -> Option<u64> {
        let align = align.max(ALIGNMENT);
        let len = round_up(len.max(1), ALIGNMENT)?;
        for from in [self.cursor, self.lo] {
            if let Some(start) = self.fit(from, len, align) {
                self.live.insert(start, len);
                self.cursor = start + len;
                return Some(start);
            }
        }
        None
    }

    fn fit(&self, from: u64, len: u64, align: u64) -> Option<u64> {
        let mut candidate = round_up(from, align)?;
        loop {
            // A range that starts at or before the candidate and covers it.
            if let Some((&start, &size)) = self.live.range(..=candidate).next_back()
                && start + size > candidate
            {
                candidate = round_up(start + size, align)?;
                continue;
            }
            let end = candidate.checked_add(len)?;
            if end > self.hi {
                return None;
            }
            match self.live.range(candidate..end).next() {
                None => return Some(candidate),
                Some((&start, &size)) => candidate = round_up(start + size, align)?,
            }
        }
    }

    pub fn give_back(&mut self, start: u64) -> bool {
        self.live.remove(&start).is_some()
    }
}

impl State {
    /// Records an allocation at a fresh address; the caller has charged it.
    pub fn place(&mut self, phys: usize, alloc: Alloc) -> CuResult<u64> {
        let space = self.va.get_mut(phys).ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        let ptr = space.take(alloc.size, ALIGNMENT).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        self.allocs.insert(ptr, alloc);
        Ok(ptr)
    }

    /// Charges and places a plain allocation of `size` bytes charging `charge`.
    pub fn alloc_plain(&mut self, current: Current, size: u64, charge: u64) -> CuResult<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.charge(current.phys, charge)?;
        self.place(current.phys, Alloc::plain(current, size, charge))
            .inspect_err(|_| self.uncharge(current.phys, charge))
    }

    /// Removes an allocation, returning its bytes to the truth (or to its pool).
    pub fn release_alloc(&mut self, ptr: u64) -> Option<Alloc> {
        let alloc = self.allocs.remove(&ptr)?;
        if let Some(space) = self.va.get_mut(alloc.phys) {
            space.give_back(ptr);
        }
        match alloc.pool {
            Some(pool) => self.pool_give_back(pool, alloc.size),
            None => self.uncharge(alloc.phys, alloc.charge),
        }
        self.forget_managed(ptr, alloc.size);
        Some(alloc)
    }

    /// The allocation containing `ptr`: (base, allocation).
    pub fn find(&self, ptr: u64) -> Option<(u64, &Alloc)> {
        let (&base, alloc) = self.allocs.range(..=ptr).next_back()?;
        (ptr - base < alloc.size.max(1)).then_some((base, alloc))
    }

    /// Checks that `[ptr, ptr + len)` lies in one allocation or VMM mapping; returns its device.
    pub fn check_range(&self, ptr: u64, len: u64) -> CuResult<Option<usize>> {
        let end = ptr.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((base, alloc)) = self.find(ptr) {
            return if end <= base + alloc.size {
                Ok(Some(alloc.phys))
            } else {
                Err(CUDA_ERROR_INVALID_VALUE)
            };
        }
        if let Some((&base, &(size, handle))) = self.mappings.range(..=ptr).next_back()
            && ptr - base < size
        {
            return if end <= base + size {
                Ok(self.physical.get(&handle).and_then(|p| p.phys))
            } else {
                Err(CUDA_ERROR_INVALID_VALUE)
            };
        }
        Err(CUDA_ERROR_INVALID_VALUE)
    }

    fn free(&mut self, ptr: u64) -> CuResult {
        match self.allocs.get(&ptr) {
            Some(alloc) if !alloc.graph => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        self.release_alloc(ptr);
        Ok(())
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    cu(|| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let delay = crate::config::get().alloc_us;
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        let mut state = initialised()?;
        let current = state.current()?;
        let ptr = state.alloc_plain(current, bytesize as u64, bytesize as u64)?;
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(dptr, ptr) }
    })
}

/// `cuMemAllocPitch` rule: ElementSizeBytes 4, 8 or 16; pitch = width rounded up to 512.
pub fn pitch_for(width: u64, height: u64, element: u32) -> CuResult<(u64, u64)> {
    if width == 0 || height == 0 || !matches!(element, 4 | 8 | 16) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let pitch = round_up(width, ALIGNMENT).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let bytes = pitch.checked_mul(height).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    Ok((pitch, bytes))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pPitch: *mut usize,
    WidthInBytes: usize,
    Height: usize,
    ElementSizeBytes: c_uint,
) -> CUresult {
    cu(|| {
        if dptr.is_null() || pPitch.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (pitch, bytes) = pitch_for(WidthInBytes as u64, Height as u64, ElementSizeBytes)?;
        let mut state = initialised()?;
        let current = state.current()?;
        let ptr = state.alloc_plain(current, bytes, bytes)?;
        // SAFETY: out-pointers from the caller, checked non-null.
        unsafe {
            put(dptr, ptr)?;
            put(pPitch, pitch as usize)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        state.current()?;
        state.free(dptr)
    })
}

/// `cuMemGetInfo`'s answer for these outputs: the real driver fills whichever output is given
/// and accepts one NULL (OptiX asks for the total alone), so the fake does too; with both NULL
/// there is nothing to answer.
fn mem_get_info_outputs<T>(free: *mut T, total: *mut T) -> CuResult<(u64, u64)> {
    if free.is_null() && total.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    mem_get_info()
}

/// Writes `value` through `ptr` unless it is null.
///
/// # Safety
/// `ptr` is null or valid for writes.
unsafe fn put_if_given<T>(ptr: *mut T, value: T) {
    if !ptr.is_null() {
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { ptr.write(value) };
    }
}

fn mem_get_info() -> CuResult<(u64, u64)> {
    let state = initialised()?;
    let current = state.current()?;
    let truth = state.truth()?;
    truth.reclaim_dead();
    let total = state.capacity(current.phys);
    Ok((total.saturating_sub(truth.device(current.phys).used()), total))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    cu(|| {
        let (f, t) = mem_get_info_outputs(free, total)?;
        // SAFETY: out-pointers from the caller; a null one is skipped.
        unsafe {
            put_if_given(free, f as usize);
            put_if_given(total, t as usize);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> CUresult {
    cu(|| {
        let (f, t) = mem_get_info_outputs(free, total)?;
        // SAFETY: out-pointers from the caller; a null one is skipped.
        unsafe {
            put_if_given(free, c_uint::try_from(f).unwrap_or(c_uint::MAX));
            put_if_given(total, c_uint::try_from(t).unwrap_or(c_uint::MAX));
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: CUpointer_attribute,
    ptr: CUdeviceptr,
) -> CUresult {
    cu(|| {
        if data.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let state = initialised()?;
        // (base, size, ordinal, context, pool)
        let (base, size, ordinal, ctx, pool) = match state.find(ptr) {
            Some((base, alloc)) => (base, alloc.size, alloc.ordinal, alloc.ctx, alloc.pool.unwrap_or(0)),
            None => {
                let (&base, &(size, handle)) = state
                    .mappings
                    .range(..=ptr)
                    .next_back()
                    .ok_or(CUDA_ERROR_INVALID_VALUE)?;
                if ptr - base >= size {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                let ordinal = state.physical.get(&handle).map(|p| p.ordinal).unwrap_or(0);
                (base, size, ordinal, 0, 0)
            }
        };
        // SAFETY: `data` points to storage of the attribute's documented type.
        unsafe {
            match attribute {
                CU_POINTER_ATTRIBUTE_CONTEXT => put(data.cast::<CUcontext>(), ctx as CUcontext),
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE => put(data.cast::<c_uint>(), CU_MEMORYTYPE_DEVICE),
                CU_POINTER_ATTRIBUTE_DEVICE_POINTER => put(data.cast::<CUdeviceptr>(), ptr),
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => put(data.cast::<i32>(), ordinal),
                CU_POINTER_ATTRIBUTE_RANGE_START_ADDR => put(data.cast::<CUdeviceptr>(), base),
                CU_POINTER_ATTRIBUTE_RANGE_SIZE => put(data.cast::<usize>(), size as usize),
                CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE => put(data.cast::<CUmemoryPool>(), pool as CUmemoryPool),
                _ => Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
    })
}

/// One side of a copy or set.
enum End {
    /// Must be a known device range.
    Device(CUdeviceptr),
    /// Host memory: must not be null.
    Host(*const c_void),
    /// `cuMemcpy`: a device range if known, host memory otherwise.
    Unified(CUdeviceptr),
}

/// Validates a copy or set (a no-op otherwise). `stream`: the async variants' stream. `wait`:
/// the synchronous copies wait for the device's queued work, as legacy-stream copies do.
fn transfer(ends: &[End], len: u64, stream: Option<CUstream>, wait: bool) -> CuResult {
    let state = initialised()?;
    let current = state.current()?;
    let mut phys = current.phys;
    for end in ends {
        match *end {
            End::Device(ptr) => {
                phys = state.check_range(ptr, len)?.unwrap_or(phys);
            }
            End::Host(ptr) => {
                if ptr.is_null() && len > 0 {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
            }
            End::Unified(ptr) => {
                if state.find(ptr).is_some()
                    || state
                        .mappings
                        .range(..=ptr)
                        .next_back()
                        .is_some_and(|(b, m)| ptr - b < m.0)
                {
                    phys = state.check_range(ptr, len)?.unwrap_or(phys);
                } else if ptr == 0 && len > 0 {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
            }
        }
    }
    if let Some(stream) = stream {
        state.stream_target(stream)?;
    }
    let deadline = state.engine_end[phys];
    drop(state);
    if wait {
        state::sleep_until(deadline);
    }
    Ok(())
}

fn elements(count: usize, size: u64) -> CuResult<u64> {
    (count as u64).checked_mul(size).ok_or(CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dstDevice: CUdeviceptr, srcHost: *const c_void, ByteCount: usize) -> CUresult {
    cu(|| {
        transfer(
            &[End::Device(dstDevice), End::Host(srcHost)],
            ByteCount as u64,
            None,
            true,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2_ptds(
    dstDevice: CUdeviceptr,
    srcHost: *const c_void,
    ByteCount: usize,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Device(dstDevice), End::Host(srcHost)],
            ByteCount as u64,
            None,
            true,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dstHost: *mut c_void, srcDevice: CUdeviceptr, ByteCount: usize) -> CUresult {
    cu(|| {
        transfer(
            &[End::Host(dstHost), End::Device(srcDevice)],
            ByteCount as u64,
            None,
            true,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2_ptds(
    dstHost: *mut c_void,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Host(dstHost), End::Device(srcDevice)],
            ByteCount as u64,
            None,
            true,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dstDevice: CUdeviceptr, srcDevice: CUdeviceptr, ByteCount: usize) -> CUresult {
    cu(|| {
        transfer(
            &[End::Device(dstDevice), End::Device(srcDevice)],
            ByteCount as u64,
            None,
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2_ptds(
    dstDevice: CUdeviceptr,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Device(dstDevice), End::Device(srcDevice)],
            ByteCount as u64,
            None,
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, ByteCount: usize) -> CUresult {
    cu(|| transfer(&[End::Unified(dst), End::Unified(src)], ByteCount as u64, None, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, ByteCount: usize) -> CUresult {
    cu(|| transfer(&[End::Unified(dst), End::Unified(src)], ByteCount as u64, None, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Unified(dst), End::Unified(src)],
            ByteCount as u64,
            Some(hStream),
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyAsync_ptsz(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Unified(dst), End::Unified(src)],
            ByteCount as u64,
            Some(hStream),
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dstDevice: CUdeviceptr,
    srcHost: *const c_void,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Device(dstDevice), End::Host(srcHost)],
            ByteCount as u64,
            Some(hStream),
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2_ptsz(
    dstDevice: CUdeviceptr,
    srcHost: *const c_void,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Device(dstDevice), End::Host(srcHost)],
            ByteCount as u64,
            Some(hStream),
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dstHost: *mut c_void,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Host(dstHost), End::Device(srcDevice)],
            ByteCount as u64,
            Some(hStream),
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2_ptsz(
    dstHost: *mut c_void,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Host(dstHost), End::Device(srcDevice)],
            ByteCount as u64,
            Some(hStream),
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dstDevice: CUdeviceptr,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Device(dstDevice), End::Device(srcDevice)],
            ByteCount as u64,
            Some(hStream),
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2_ptsz(
    dstDevice: CUdeviceptr,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        transfer(
            &[End::Device(dstDevice), End::Device(srcDevice)],
            ByteCount as u64,
            Some(hStream),
            false,
        )
    })
}

fn memset(dst: CUdeviceptr, count: usize, element: u64, stream: Option<CUstream>) -> CuResult {
    transfer(&[End::Device(dst)], elements(count, element)?, stream, false)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2(dstDevice: CUdeviceptr, _uc: u8, N: usize) -> CUresult {
    cu(|| memset(dstDevice, N, 1, None))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2_ptds(dstDevice: CUdeviceptr, _uc: u8, N: usize) -> CUresult {
    cu(|| memset(dstDevice, N, 1, None))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD16_v2(dstDevice: CUdeviceptr, _us: u16, N: usize) -> CUresult {
    cu(|| memset(dstDevice, N, 2, None))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD16_v2_ptds(dstDevice: CUdeviceptr, _us: u16, N: usize) -> CUresult {
    cu(|| memset(dstDevice, N, 2, None))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32_v2(dstDevice: CUdeviceptr, _ui: c_uint, N: usize) -> CUresult {
    cu(|| memset(dstDevice, N, 4, None))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32_v2_ptds(dstDevice: CUdeviceptr, _ui: c_uint, N: usize) -> CUresult {
    cu(|| memset(dstDevice, N, 4, None))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8Async(dstDevice: CUdeviceptr, _uc: u8, N: usize, hStream: CUstream) -> CUresult {
    cu(|| memset(dstDevice, N, 1, Some(hStream)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8Async_ptsz(
    dstDevice: CUdeviceptr,
    _uc: u8,
    N: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| memset(dstDevice, N, 1, Some(hStream)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD16Async(dstDevice: CUdeviceptr, _us: u16, N: usize, hStream: CUstream) -> CUresult {
    cu(|| memset(dstDevice, N, 2, Some(hStream)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD16Async_ptsz(
    dstDevice: CUdeviceptr,
    _us: u16,
    N: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| memset(dstDevice, N, 2, Some(hStream)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32Async(
    dstDevice: CUdeviceptr,
    _ui: c_uint,
    N: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| memset(dstDevice, N, 4, Some(hStream)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32Async_ptsz(
    dstDevice: CUdeviceptr,
    _ui: c_uint,
    N: usize,
    hStream: CUstream,
) -> CUresult {
    cu(|| memset(dstDevice, N, 4, Some(hStream)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pitch_rule() {
        assert_eq!(pitch_for(1, 1, 4), Ok((512, 512)));
        assert_eq!(pitch_for(1000, 3, 8), Ok((1024, 3072)));
        assert_eq!(pitch_for(0, 3, 8), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(pitch_for(100, 3, 3), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(pitch_for(u64::MAX, 1, 4), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(pitch_for(1 << 40, 1 << 40, 4), Err(CUDA_ERROR_OUT_OF_MEMORY));
    }

    #[test]
    fn address_space_reuses_freed_ranges() {
        let mut space = VaSpace::new(0x1000_0000, 0x1000_0000 + 4096);
        let a = space.take(1, 0).unwrap();
        let b = space.take(1024, 0).unwrap();
        assert_eq!((a, b), (0x1000_0000, 0x1000_0200));
        let c = space.take(2048, 0).unwrap();
        assert_eq!(c, 0x1000_0600);
        assert_eq!(space.take(1024, 0), None);
        assert!(space.give_back(b));
        // Wraps to the start and finds the freed range.
        assert_eq!(space.take(600, 0), Some(0x1000_0200));
        assert_eq!(space.take(512, 1024), None);
        assert!(space.give_back(a));
        // First fit from the cursor (after the last range taken), then from the start.
        assert_eq!(space.take(512, 0), Some(0x1000_0e00));
        assert_eq!(space.take(512, 0), Some(0x1000_0000));
        assert_eq!(space.take(u64::MAX, 0), None);
    }
}
