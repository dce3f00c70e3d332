//! NVML as the container should see it: `nvmlDeviceGetMemoryInfo` and `_v2` report the virtual
//! device (total = min(limit, physical), used = what the region's processes have charged on that
//! GPU, free = total - used, never below zero), so `nvidia-smi` inside the container shows it.

use std::ffi::{CStr, c_char, c_uint};
use std::sync::OnceLock;

use vgpu_region::{InitParams, OpenKind, Region};

use crate::hooks::real;
use crate::sys::nvml::{NVML_SUCCESS, nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlReturn_t};

/// Whether NVML is initialised for the library's own queries: 0 not tried, 1 ready, 2 failed.
/// Initialised once (its init is reference counted, and never shut down: the application may use
/// NVML too). An atomic rather than a once-cell, so a child forked in the middle cannot block.
static NVML_STATE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

fn nvml_ready() -> bool {
    use std::sync::atomic::Ordering;
    match NVML_STATE.load(Ordering::Acquire) {
        1 => true,
        2 => false,
        _ => {
            // SAFETY: nvmlInit_v2 takes no arguments; racing threads each add one reference.
            let ready = real::nvmlInit_v2().is_some_and(|init| unsafe { init() } == NVML_SUCCESS);
            NVML_STATE.store(if ready { 1 } else { 2 }, Ordering::Release);
            ready
        }
    }
}

/// NVML's handle of the GPU with this UUID, for the library's own queries. `None` where NVML is
/// missing or does not know the GPU.
pub fn device_handle(uuid: &str) -> Option<nvmlDevice_t> {
    if !nvml_ready() {
        return None;
    }
    let by_uuid = real::nvmlDeviceGetHandleByUUID()?;
    let uuid = std::ffi::CString::new(uuid).ok()?;
    let mut device: nvmlDevice_t = std::ptr::null_mut();
    // SAFETY: a NUL-terminated string and a local out-pointer.
    let found = unsafe { by_uuid(uuid.as_ptr(), &mut device) } == NVML_SUCCESS;
    found.then_some(device)
}

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

/// The virtual (total, used, free) from the physical (total, free), the limit and the usage. With
/// elastic memory (`CUDA_OVERSUBSCRIBE`) what the device lacks host memory backs, so free is the
/// limit's alone.
pub fn virtual_memory(physical_total: u64, physical_free: u64, limit: u64, used: u64) -> (u64, u64, u64) {
    let physical_free = if crate::memory::elastic() {
        u64::MAX
    } else {
        physical_free
    };
    let total = limit.min(physical_total);
    let used = used.min(total);
    let free = (total - used).min(physical_free);
    (total, used, free)
}

/// `nvmlDeviceGetMemoryInfo` and `_v2`.
pub fn device_memory_info<M: MemoryReport>(
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
            // With control disabled nothing is virtualised: NVML's own answers.
            let config = crate::session::config()
                .ok()
                .filter(|config| !config.control_disabled)?;
            crate::session::open_region(config, &InitParams::default())
                .map_err(|error| tracing::warn!("{error}; NVML reports physical memory"))
                .ok()
        })
        .as_ref()
}

/// (limit, bytes charged) for a GPU with a limit in this process's configuration.
fn limit_and_usage(device: nvmlDevice_t) -> Option<(u64, u64)> {
    let uuid = uuid_of(device)?;
    if let Some(session) = crate::session::get() {
        let entry = session.device_by_uuid(&uuid)?;
        let limit = session.limit(entry)?;
        let used = session.region().device_used(entry.region_index);
        return Some((
            limit,
            used.saturating_sub(held_by_dead(session.region(), entry.region_index)),
        ));
    }
    let region = monitor_region()?;
    let index = region.device_index(&uuid).ok()?;
    // The container's limit is the region's while its processes use it or once it was reused (it
    // keeps its limits); a region this process has just created (or rebuilt) holds no limits yet:
    // the variables say what it will get.
    let limit = if matches!(
        region.open_kind(),
        OpenKind::Joined | OpenKind::Repaired(_) | OpenKind::Reinitialised
    ) {
        let limit = region
            .hami()
            .limit
            .get(index)?
            .load(std::sync::atomic::Ordering::Relaxed);
        (limit != 0).then_some(limit)?
    } else {
        let config = crate::session::config().ok()?;
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        config.memory_limit_of(cuda_ordinal(visible.as_deref(), nvml_index_of(device)?, &uuid)?)?
    };
    let used = region.device_used(index);
    Some((limit, used.saturating_sub(held_by_dead(region, index))))
}

/// Whether a slot's process is alive, judged in this process's pid namespace (the container's):
/// the slots of processes that have ended but were not reaped yet are never shown.
fn alive(process: &vgpu_region::ProcessSnapshot) -> bool {
    process.status == vgpu_region::SLOT_LIVE
        && vgpu_region::process::is_alive(process.pid, process.start_time.unwrap_or(0))
}

/// Bytes the slots of dead processes (killed, not reaped yet) still hold on a region device: the
/// running total counts them until the next reap, what NVML shows never does.
fn held_by_dead(region: &Region, index: usize) -> u64 {
    region
        .snapshot()
        .processes
        .iter()
        .filter(|process| process.status == vgpu_region::SLOT_LIVE && !alive(process))
        .filter_map(|process| process.memory.get(index))
        .fold(0u64, |sum, usage| sum.saturating_add(usage.total))
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

// ---------------------------------------------------------------- processes and utilisation
//
// nvidia-smi inside the container lists the container's own processes (from the shared region,
// with the memory charged to them) and the library's own utilisation measurement where NVML has
// none (in a container NVML lists no processes; on the H200 VM not even the host's).

/// The region this process reports from: its own once CUDA is initialised; for a process that
/// never initialises CUDA (nvidia-smi), the configured region file if one exists.
fn region_for_queries() -> Option<&'static Region> {
    if let Some(session) = crate::session::get() {
        return Some(session.region());
    }
    let config = crate::session::config().ok()?;
    if !config.shared_cache.is_file() {
        return None;
    }
    monitor_region()
}

/// A live process of the region on one GPU: its pid (the container's), the bytes charged to it
/// there and its measured SM utilisation in percent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RegionProcess {
    pid: u32,
    used_bytes: u64,
    sm_util: u64,
}

/// The region's live processes holding memory on the GPU, in slot order; `None` when there are
/// none (or the region does not know the GPU, or there is no region): NVML's own answer then.
fn region_processes(device: nvmlDevice_t) -> Option<Vec<RegionProcess>> {
    let uuid = uuid_of(device)?;
    let snapshot = region_for_queries()?.snapshot();
    let index = snapshot.uuids.iter().position(|known| *known == uuid)?;
    let listed = processes_on(&snapshot, index);
    (!listed.is_empty()).then_some(listed)
}

fn processes_on(snapshot: &vgpu_region::Snapshot, index: usize) -> Vec<RegionProcess> {
    snapshot
        .processes
        .iter()
        .filter(|process| alive(process))
        .filter_map(|process| {
            let used_bytes = process.memory.get(index)?.total;
            let pid = u32::try_from(process.pid).ok()?;
            (used_bytes > 0).then(|| RegionProcess {
                pid,
                used_bytes,
                sm_util: process.sm_util.get(index).copied().unwrap_or(0),
            })
        })
        .collect()
}

/// The result structs of the running-process queries (`_v2` and `_v3` share one).
pub trait ProcessInfo {
    fn set(&mut self, pid: u32, used_bytes: u64);
}

impl ProcessInfo for crate::sys::nvml::nvmlProcessInfo_v1_t {
    fn set(&mut self, pid: u32, used_bytes: u64) {
        (self.pid, self.usedGpuMemory) = (pid, used_bytes);
    }
}

impl ProcessInfo for crate::sys::nvml::nvmlProcessInfo_v2_t {
    fn set(&mut self, pid: u32, used_bytes: u64) {
        (self.pid, self.usedGpuMemory) = (pid, used_bytes);
        // Not a MIG instance.
        (self.gpuInstanceId, self.computeInstanceId) = (u32::MAX, u32::MAX);
    }
}

/// Writes a process list with NVML's `infoCount` protocol: a count below the number of entries
/// (a size query, with `infos` allowed to be null) gets `NVML_ERROR_INSUFFICIENT_SIZE` and the
/// count needed; otherwise the entries and their count.
fn write_process_list<P: ProcessInfo>(
    listed: &[RegionProcess],
    info_count: *mut c_uint,
    infos: *mut P,
) -> nvmlReturn_t {
    use crate::sys::nvml::{NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_INVALID_ARGUMENT};
    // SAFETY: the caller's count pointer, checked for null.
    let Some(count) = (unsafe { info_count.as_mut() }) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    let needed = c_uint::try_from(listed.len()).unwrap_or(c_uint::MAX);
    if *count < needed {
        *count = needed;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if infos.is_null() && needed > 0 {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (offset, process) in listed.iter().enumerate() {
        // SAFETY: the caller's array holds at least `*count >= listed.len()` entries.
        unsafe { (*infos.add(offset)).set(process.pid, process.used_bytes) };
    }
    *count = needed;
    NVML_SUCCESS
}

/// `nvmlDeviceGetComputeRunningProcesses`, `_v2` and `_v3`: the region's live processes on the
/// GPU with the memory charged to them, when it has any there; NVML's own answer otherwise.
pub fn running_compute_processes<P: ProcessInfo>(
    call: impl FnOnce() -> nvmlReturn_t,
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut P,
) -> nvmlReturn_t {
    match region_processes(device) {
        Some(listed) => write_process_list(&listed, info_count, infos),
        None => call(),
    }
}

/// `nvmlDeviceGetGraphicsRunningProcesses`, `_v2` and `_v3`: while the region has processes on
/// the GPU, an empty list (the container's CUDA processes are compute processes: listing them
/// here too would make nvidia-smi show each as "C+G", and other containers' processes are not
/// the container's to see); NVML's own answer otherwise.
pub fn running_graphics_processes<P: ProcessInfo>(
    call: impl FnOnce() -> nvmlReturn_t,
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut P,
) -> nvmlReturn_t {
    match region_processes(device) {
        Some(_) => write_process_list::<P>(&[], info_count, infos),
        None => call(),
    }
}

/// The library's own SM utilisation of the GPU: the sum over the region's live processes on it,
/// capped at 100; `None` when the region has no process there.
fn measured_utilisation(device: nvmlDevice_t) -> Option<u32> {
    let listed = region_processes(device)?;
    let sum = listed
        .iter()
        .fold(0u64, |sum, process| sum.saturating_add(process.sm_util));
    Some(sum.min(100) as u32)
}

/// `nvmlDeviceGetUtilizationRates`: NVML's figure, unless it reports 0% (or cannot measure) while
/// the region's processes run on the GPU: then the library's own measurement.
pub fn utilization_rates(
    call: impl FnOnce() -> nvmlReturn_t,
    device: nvmlDevice_t,
    utilization: *mut crate::sys::nvml::nvmlUtilization_t,
) -> nvmlReturn_t {
    use crate::sys::nvml::NVML_ERROR_NOT_SUPPORTED;
    let result = call();
    if result != NVML_SUCCESS && result != NVML_ERROR_NOT_SUPPORTED {
        return result;
    }
    // SAFETY: the caller's struct, checked for null.
    let Some(rates) = (unsafe { utilization.as_mut() }) else {
        return result;
    };
    if result == NVML_SUCCESS && rates.gpu != 0 {
        return result;
    }
    match measured_utilisation(device) {
        Some(measured) => {
            if result != NVML_SUCCESS {
                rates.memory = 0;
            }
            rates.gpu = measured;
            NVML_SUCCESS
        }
        None => result,
    }
}

/// `nvmlDeviceGetProcessUtilization`: NVML's samples when it has any; when it has none
/// (`NVML_ERROR_NOT_FOUND`, as on the H200 VM), one sample per region process on the GPU with
/// the library's measurement, stamped now. Same sizing protocol as NVML: too small a count (or a
/// null buffer) gets `NVML_ERROR_INSUFFICIENT_SIZE` and the count needed.
pub fn process_utilization(
    call: impl FnOnce() -> nvmlReturn_t,
    device: nvmlDevice_t,
    utilization: *mut crate::sys::nvml::nvmlProcessUtilizationSample_t,
    process_samples_count: *mut c_uint,
    last_seen_time_stamp: std::ffi::c_ulonglong,
) -> nvmlReturn_t {
    let (samples, sample_count) = (utilization, process_samples_count);
    use crate::sys::nvml::{NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_FOUND};
    let result = call();
    if result != NVML_ERROR_NOT_FOUND {
        return result;
    }
    let Some(listed) = region_processes(device) else {
        return result;
    };
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_micros()).unwrap_or(u64::MAX));
    if now_us <= last_seen_time_stamp {
        return result;
    }
    // SAFETY: the caller's count pointer, checked for null.
    let Some(count) = (unsafe { sample_count.as_mut() }) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    let needed = c_uint::try_from(listed.len()).unwrap_or(c_uint::MAX);
    if samples.is_null() || *count < needed {
        *count = needed;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (offset, process) in listed.iter().enumerate() {
        let sample = crate::sys::nvml::nvmlProcessUtilizationSample_t {
            pid: process.pid,
            timeStamp: now_us,
            smUtil: process.sm_util.min(100) as u32,
            memUtil: 0,
            encUtil: 0,
            decUtil: 0,
        };
        // SAFETY: the caller's array holds at least `*count >= listed.len()` entries.
        unsafe { samples.add(offset).write(sample) };
    }
    *count = needed;
    NVML_SUCCESS
}

#[cfg(test)]
mod process_tests {
    use super::*;
    use crate::sys::nvml::{
        NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_INVALID_ARGUMENT, nvmlProcessInfo_v1_t, nvmlProcessInfo_v2_t,
    };

    fn listed() -> Vec<RegionProcess> {
        vec![
            RegionProcess {
                pid: 10,
                used_bytes: 100,
                sm_util: 30,
            },
            RegionProcess {
                pid: 11,
                used_bytes: 200,
                sm_util: 5,
            },
        ]
    }

    #[test]
    fn the_info_count_protocol_is_nvmls() {
        // A size query: count 0, null array.
        let mut count: c_uint = 0;
        let result = write_process_list::<nvmlProcessInfo_v1_t>(&listed(), &mut count, std::ptr::null_mut());
        assert_eq!((result, count), (NVML_ERROR_INSUFFICIENT_SIZE, 2));
        // Too small an array.
        let mut infos = [nvmlProcessInfo_v2_t::default(); 1];
        let mut count: c_uint = 1;
        let result = write_process_list(&listed(), &mut count, infos.as_mut_ptr());
        assert_eq!((result, count), (NVML_ERROR_INSUFFICIENT_SIZE, 2));
        // Room for more than needed.
        let mut infos = [nvmlProcessInfo_v2_t::default(); 4];
        let mut count: c_uint = 4;
        let result = write_process_list(&listed(), &mut count, infos.as_mut_ptr());
        assert_eq!((result, count), (NVML_SUCCESS, 2));
        assert_eq!((infos[0].pid, infos[0].usedGpuMemory), (10, 100));
        assert_eq!(
            (infos[1].pid, infos[1].usedGpuMemory, infos[1].gpuInstanceId),
            (11, 200, u32::MAX)
        );
        // An empty list with a zero count succeeds; a null count is an error.
        let mut count: c_uint = 0;
        let result = write_process_list::<nvmlProcessInfo_v1_t>(&[], &mut count, std::ptr::null_mut());
        assert_eq!((result, count), (NVML_SUCCESS, 0));
        let result = write_process_list::<nvmlProcessInfo_v1_t>(&listed(), std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(result, NVML_ERROR_INVALID_ARGUMENT);
    }
}
