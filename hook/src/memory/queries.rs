//! Memory queries answered for the virtual device: `cuMemGetInfo` and `cuDeviceTotalMem`.

use super::accounting::{Accounting, accounting};
use super::units::{DriverInt, read, write};
use crate::hooks::real;
use crate::session::current_ordinal;
use crate::sys::cuda::*;

/// The virtual device's (total, free), from the physical ones: total = min(limit, physical),
/// free = min(total - used, physical free).
fn virtual_view(accounting: Accounting, ordinal: CUdevice, free: u64, total: u64) -> Option<(u64, u64)> {
    let device = accounting.device(ordinal)?;
    let (total, _, free) = crate::nvml::virtual_memory(total, free, accounting.limit(device)?, accounting.used(device));
    Some((total, free))
}

/// `cuMemGetInfo` and `_v2`. The driver accepts one NULL output and fills the other (OptiX asks
/// for the total alone), so either one is virtualised on its own; with both NULL there is nothing
/// to show and the driver's answer stands.
pub fn get_info<S: DriverInt>(call: impl FnOnce() -> CUresult, free: *mut S, total: *mut S) -> CUresult {
    let result = call();
    if result != CUDA_SUCCESS || (free.is_null() && total.is_null()) {
        return result;
    }
    let (Some(accounting), Some(ordinal)) = (accounting(), current_ordinal()) else {
        return result;
    };
    // SAFETY: the driver accepted the pointers and wrote the non-null ones.
    let (physical_free, physical_total) = unsafe { (read(free), read(total)) };
    let physical_total = match physical_total {
        Some(bytes) => bytes.to_u64(),
        // Free alone: the virtual free is capped by the virtual total, which needs the physical
        // one; if even that cannot be had, the limit stands in for it (free never exceeds
        // limit - used).
        None => physical_total_memory(ordinal).unwrap_or(u64::MAX),
    };
    // Total alone: the virtual total does not depend on free.
    let physical_free = physical_free.map_or(physical_total, S::to_u64);
    if let Some((virtual_total, virtual_free)) = virtual_view(accounting, ordinal, physical_free, physical_total) {
        // SAFETY: as above; a null pointer is skipped.
        unsafe {
            write(total, S::saturating_from(virtual_total));
            write(free, S::saturating_from(virtual_free));
        }
    }
    result
}

/// The device's physical memory, from the real driver.
fn physical_total_memory(ordinal: CUdevice) -> Option<u64> {
    let total_mem = real::cuDeviceTotalMem_v2()?;
    let mut bytes: usize = 0;
    // SAFETY: a valid out-pointer to a local.
    (unsafe { total_mem(&mut bytes, ordinal) } == CUDA_SUCCESS).then_some(bytes as u64)
}

/// `cuDeviceTotalMem` and `_v2`: the limit, when it is below the physical total.
pub fn device_total_mem<S: DriverInt>(call: impl FnOnce() -> CUresult, bytes: *mut S, dev: CUdevice) -> CUresult {
    let result = call();
    if result != CUDA_SUCCESS {
        return result;
    }
    let limit = accounting().and_then(|a| a.limit(a.device(dev)?)).or_else(|| {
        // Before cuInit's accounting starts (or without a region), the configuration still says.
        crate::session::config()
            .ok()
            .and_then(|config| config.memory_limit_of(usize::try_from(dev).ok()?))
    });
    // SAFETY: the driver accepted and wrote the pointer.
    if let (Some(limit), Some(physical)) = (limit, unsafe { read(bytes) }) {
        // SAFETY: as above.
        unsafe { write(bytes, S::saturating_from(limit.min(physical.to_u64()))) };
    }
    result
}
