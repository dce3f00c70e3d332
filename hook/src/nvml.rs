//! NVML as the container should see it: `nvmlDeviceGetMemoryInfo` and `_v2` report the virtual
//! device (total = min(limit, physical), used = what the region's processes have charged on that
//! GPU, free = total - used, never below zero), so `nvidia-smi` inside the container shows it.

use std::ffi::{CStr, c_char, c_uint};
use std::sync::OnceLock;

use vgpu_region::{InitParams, Region};

use crate::hooks::real;
use crate::sys::nvml::{NVML_SUCCESS, nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlReturn_t};

/// The two result structs of the memory query.
pub trait MemoryReport {
    fn physical(&self) -> (u64, u64);
    fn set(&mut self, total: u64, used: u64, free: u64);
}

impl MemoryReport for nvmlMemory_t {
    fn physical(&self) -> (u64, u64) {
        (self.total, self.free)
    }
    fn set(&mut self, total: u64, used: u64, free: u64) {
        (self.total, self.used, self.free) = (total, used, free);
    }
}

impl MemoryReport for nvmlMemory_v2_t {
    fn physical(&self) -> (u64, u64) {
        (self.total, self.free)
    }
    fn set(&mut self, total: u64, used: u64, free: u64) {
        // `reserved` (driver-reserved memory) stays as the driver said; it is not ours to hide.
        (self.total, self.used, self.free) = (total, used, free);
    }
}

/// The virtual (total, used, free) from the physical (total, free), the limit and the usage.
pub fn virtual_memory(physical_total: u64, physical_free: u64, limit: u64, used: u64) -> (u64, u64, u64) {
    let total = limit.min(physical_total);
    let used = used.min(total);
    let free = (total - used).min(physical_free);
    (total, used, free)
}

/// `nvmlDeviceGetMemoryInfo` and `_v2`.
pub fn device_memory_info<M: MemoryReport>(
    _name: &'static str,
    call: impl FnOnce() -> nvmlReturn_t,
    device: nvmlDevice_t,
    memory: *mut M,
) -> nvmlReturn_t {
    let result = call();
    if result != NVML_SUCCESS {
        return result;
    }
    // SAFETY: NVML accepted and filled the struct; null is checked.
    let Some(memory) = (unsafe { memory.as_mut() }) else {
        return result;
    };
    if let Some((limit, used)) = limit_and_usage(device) {
        let (physical_total, physical_free) = memory.physical();
        let (total, used, free) = virtual_memory(physical_total, physical_free, limit, used);
        memory.set(total, used, free);
    }
    result
}

fn uuid_of(device: nvmlDevice_t) -> Option<String> {
    let get_uuid = real::nvmlDeviceGetUUID()?;
    let mut buffer = [0 as c_char; 96];
    // SAFETY: the buffer and its length match.
    if unsafe { get_uuid(device, buffer.as_mut_ptr(), buffer.len() as c_uint) } != NVML_SUCCESS {
        return None;
    }
    // SAFETY: NVML wrote a NUL-terminated string into the zeroed buffer.
    Some(
        unsafe { CStr::from_ptr(buffer.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
}

fn nvml_index_of(device: nvmlDevice_t) -> Option<u32> {
    let get_index = real::nvmlDeviceGetIndex()?;
    let mut index = 0;
    // SAFETY: a valid out-pointer to a local.
    (unsafe { get_index(device, &mut index) } == NVML_SUCCESS).then_some(index)
}

/// The CUDA ordinal a GPU has in this process, by `CUDA_VISIBLE_DEVICES` (indices or UUID
/// prefixes, as the driver reads it), for processes that never initialise CUDA (nvidia-smi).
fn cuda_ordinal(visible: Option<&str>, nvml_index: u32, uuid: &str) -> Option<usize> {
    let Some(visible) = visible else {
        return Some(nvml_index as usize);
    };
    for (ordinal, entry) in visible.split(',').map(str::trim).enumerate() {
        let matches = if entry.starts_with("GPU-") {
            uuid.starts_with(entry)
        } else {
            match entry.parse::<u32>() {
                Ok(index) => index == nvml_index,
                // The driver stops at the first entry it cannot read.
                Err(_) => return None,
            }
        };
        if matches {
            return Some(ordinal);
        }
    }
    None
}

/// The region for a process that has not initialised CUDA: joined (or created) without a slot.
fn monitor_region() -> Option<&'static Region> {
    static REGION: OnceLock<Option<Region>> = OnceLock::new();
    REGION
        .get_or_init(|| {
            let config = crate::init::config().ok()?;
            Region::open(&config.shared_cache, &InitParams::default())
                .map_err(|error| tracing::warn!("{error}; NVML reports physical memory"))
                .ok()
        })
        .as_ref()
}

/// (limit, bytes charged) for a GPU with a limit in this process's configuration.
fn limit_and_usage(device: nvmlDevice_t) -> Option<(u64, u64)> {
    let uuid = uuid_of(device)?;
    if let Some(accounting) = crate::memory::accounting() {
        let entry = accounting.device_by_uuid(&uuid)?;
        return Some((entry.limit?, accounting.used(entry)));
    }
    let config = crate::init::config().ok()?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let ordinal = cuda_ordinal(visible.as_deref(), nvml_index_of(device)?, &uuid)?;
    let limit = config.memory_limit_of(ordinal)?;
    let region = monitor_region()?;
    let index = region.device_index(&uuid).ok()?;
    Some((limit, region.device_used(index)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_memory_never_underflows() {
        let gib = 1u64 << 30;
        assert_eq!(
            virtual_memory(80 * gib, 70 * gib, 4 * gib, gib),
            (4 * gib, gib, 3 * gib)
        );
        // Usage above the limit (charged before a limit change): used is capped, free is 0.
        assert_eq!(
            virtual_memory(80 * gib, 70 * gib, 4 * gib, 5 * gib),
            (4 * gib, 4 * gib, 0)
        );
        // Physical free below the virtual free.
        assert_eq!(virtual_memory(80 * gib, gib / 2, 4 * gib, gib), (4 * gib, gib, gib / 2));
        // A limit above the card.
        assert_eq!(
            virtual_memory(80 * gib, 70 * gib, 100 * gib, 0),
            (80 * gib, 0, 70 * gib)
        );
    }

    #[test]
    fn ordinals_follow_cuda_visible_devices() {
        let uuid = "GPU-00000000-0000-0000-0000-000000000002";
        assert_eq!(cuda_ordinal(None, 2, uuid), Some(2));
        assert_eq!(cuda_ordinal(Some("2,0"), 2, uuid), Some(0));
        assert_eq!(cuda_ordinal(Some("1,0"), 2, uuid), None);
        assert_eq!(
            cuda_ordinal(
                Some("GPU-00000000-0000-0000-0000-000000000001,GPU-00000000-0000-0000-0000-000000000002"),
                2,
                uuid
            ),
            Some(1)
        );
        assert_eq!(cuda_ordinal(Some("0,x,2"), 2, uuid), None);
    }
}
