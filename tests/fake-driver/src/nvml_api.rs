//! NVML over the same simulated devices. NVML enumerates physical devices and ignores
//! `CUDA_VISIBLE_DEVICES`, as the real one does. Memory and processes come from the truth
//! (dead processes reclaimed first), utilisation from its 100 ms busy buckets; per-process
//! utilisation is `NVML_ERROR_NOT_FOUND` (as on the H200 VM) and no process is a graphics one.

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

use crate::config::uuid_string;
use crate::device::{DEVICE_NAME, DRIVER_VERSION};
use crate::nvml::*;
use crate::state;
use crate::truth::Truth;

type NvResult<T = ()> = Result<T, nvmlReturn_t>;

pub const SYSTEM_DRIVER_VERSION: &str = "580.65.06";
const HANDLE_BASE: usize = 0x4e56_0000;
const HANDLE_STRIDE: usize = 0x100;

/// `nvmlInit` calls not yet matched by `nvmlShutdown`.
static INIT_COUNT: Mutex<u32> = Mutex::new(0);

fn nv(body: impl FnOnce() -> NvResult) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

/// # Safety
/// `ptr` is null or valid for writing one `T`.
unsafe fn put<T>(ptr: *mut T, value: T) -> NvResult {
    if ptr.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null and valid for writes by the caller's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Copies a string into a caller's buffer, or `NVML_ERROR_INSUFFICIENT_SIZE`.
///
/// # Safety
/// `buf` is null or valid for writing `len` bytes.
unsafe fn put_string(buf: *mut c_char, len: c_uint, text: &str) -> NvResult {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (len as usize) <= text.len() {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds `len` > text.len() bytes.
    unsafe { crate::ffi::write_c_string(buf, len as usize, text) };
    Ok(())
}

fn init() -> NvResult {
    state::truth().map_err(|message| {
        eprintln!("vgpu-fake-driver: cannot open the truth file: {message}");
        NVML_ERROR_UNKNOWN
    })?;
    *INIT_COUNT.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    Ok(())
}

/// The truth, or `NVML_ERROR_UNINITIALIZED` outside `nvmlInit` .. `nvmlShutdown`.
fn truth() -> NvResult<&'static Truth> {
    if *INIT_COUNT.lock().unwrap_or_else(|p| p.into_inner()) == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    state::truth().map_err(|_| NVML_ERROR_UNINITIALIZED)
}

fn devices() -> usize {
    state::config().devices
}

fn handle_of(index: usize) -> nvmlDevice_t {
    (HANDLE_BASE + index * HANDLE_STRIDE) as nvmlDevice_t
}

/// The physical index behind a handle, or `NVML_ERROR_INVALID_ARGUMENT`.
fn index_of(device: nvmlDevice_t) -> NvResult<usize> {
    truth()?;
    let offset = (device as usize)
        .checked_sub(HANDLE_BASE)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let index = offset / HANDLE_STRIDE;
    if offset % HANDLE_STRIDE != 0 || index >= devices() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(index)
}

fn capacity(truth: &Truth, index: usize) -> u64 {
    match truth.device(index).capacity() {
        0 => state::config().memory.get(index).copied().unwrap_or(0),
        bytes => bytes,
    }
}

/// Stands for NVML's private `nvmlInternalGetExportTable` (no header declares it; nvidia-smi asks
/// for it): answers that the table asked for does not exist.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInternalGetExportTable(
    _table: *mut *const std::ffi::c_void,
    _id: *const std::ffi::c_void,
) -> nvmlReturn_t {
    NVML_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    nv(init)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit() -> nvmlReturn_t {
    nv(init)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nv(init)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    nv(|| {
        let mut count = INIT_COUNT.lock().unwrap_or_else(|p| p.into_inner());
        if *count == 0 {
            return Err(NVML_ERROR_UNINITIALIZED);
        }
        *count -= 1;
        Ok(())
    })
}

fn error_string(result: nvmlReturn_t) -> &'static CStr {
    match result {
        NVML_SUCCESS => c"Success",
        NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        NVML_ERROR_NOT_FOUND => c"Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        _ => c"Unknown Error",
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    error_string(result).as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    nv(|| {
        truth()?;
        // SAFETY: the caller's buffer holds `length` bytes.
        unsafe { put_string(version, length, SYSTEM_DRIVER_VERSION) }
    })
}

fn cuda_driver_version(out: *mut c_int) -> NvResult {
    truth()?;
    // SAFETY: out-pointer from the caller.
    unsafe { put(out, DRIVER_VERSION) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(cudaDriverVersion: *mut c_int) -> nvmlReturn_t {
    nv(|| cuda_driver_version(cudaDriverVersion))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion: *mut c_int) -> nvmlReturn_t {
    nv(|| cuda_driver_version(cudaDriverVersion))
}

fn device_count(out: *mut c_uint) -> NvResult {
    truth()?;
    // SAFETY: out-pointer from the caller.
    unsafe { put(out, devices() as c_uint) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(deviceCount: *mut c_uint) -> nvmlReturn_t {
    nv(|| device_count(deviceCount))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(deviceCount: *mut c_uint) -> nvmlReturn_t {
    nv(|| device_count(deviceCount))
}

fn handle_by_index(index: c_uint, device: *mut nvmlDevice_t) -> NvResult {
    truth()?;
    if index as usize >= devices() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: out-pointer from the caller.
    unsafe { put(device, handle_of(index as usize)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    nv(|| handle_by_index(index, device))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    nv(|| handle_by_index(index, device))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    nv(|| {
        truth()?;
        if uuid.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: a NUL-terminated string from the caller, checked non-null.
        let wanted = unsafe { CStr::from_ptr(uuid) }.to_string_lossy().into_owned();
        let index = (0..devices())
            .find(|&i| uuid_string(i).eq_ignore_ascii_case(&wanted))
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(device, handle_of(index)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) -> nvmlReturn_t {
    nv(|| {
        let index = index_of(device)?;
        // SAFETY: the caller's buffer holds `length` bytes.
        unsafe { put_string(uuid, length, &uuid_string(index)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint) -> nvmlReturn_t {
    nv(|| {
        index_of(device)?;
        // SAFETY: the caller's buffer holds `length` bytes.
        unsafe { put_string(name, length, DEVICE_NAME) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    nv(|| {
        let i = index_of(device)?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(index, i as c_uint) }
    })
}

/// (total, used) of a device, dead processes reclaimed.
fn memory(device: nvmlDevice_t) -> NvResult<(u64, u64)> {
    let index = index_of(device)?;
    let truth = truth()?;
    truth.reclaim_dead();
    Ok((capacity(truth, index), truth.device(index).used()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory_out: *mut nvmlMemory_t) -> nvmlReturn_t {
    nv(|| {
        let (total, used) = memory(device)?;
        let value = nvmlMemory_t {
            total,
            used,
            free: total.saturating_sub(used),
        };
        // SAFETY: out-pointer from the caller.
        unsafe { put(memory_out, value) }
    })
}

/// `nvmlMemory_v2`: the struct's size with version 2 in the top byte.
pub const MEMORY_V2: c_uint = std::mem::size_of::<nvmlMemory_v2_t>() as c_uint | (2 << 24);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory_out: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    nv(|| {
        if memory_out.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: a valid nvmlMemory_v2_t of the caller, checked non-null.
        let version = unsafe { (&raw const (*memory_out).version).read() };
        if version != MEMORY_V2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (total, used) = memory(device)?;
        let value = nvmlMemory_v2_t {
            version,
            total,
            reserved: 0,
            free: total.saturating_sub(used),
            used,
        };
        // SAFETY: as above.
        unsafe { put(memory_out, value) }
    })
}

/// Fills a process list following NVML's `infoCount` protocol.
fn running<T>(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut T,
    graphics: bool,
    make: impl Fn(c_uint, c_ulonglong) -> T,
) -> NvResult {
    let index = index_of(device)?;
    if count.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let truth = truth()?;
    // FAKE_NVML_NO_PROCESSES: list none, as on a VM (the H200's) or in a container (host pids).
    let list: Vec<(c_uint, c_ulonglong)> = if graphics || std::env::var_os("FAKE_NVML_NO_PROCESSES").is_some() {
        Vec::new()
    } else {
        truth.reclaim_dead();
        // One entry per process: one that also uses the fake Vulkan driver has a truth slot for
        // each driver, and NVML counts a process's memory as one.
        let mut list: Vec<(c_uint, c_ulonglong)> = Vec::new();
        for process in truth.processes().into_iter().filter(|p| p.used[index] > 0) {
            match list.iter_mut().find(|(pid, _)| *pid == process.pid) {
                Some(entry) => entry.1 = entry.1.saturating_add(process.used[index]),
                None => list.push((process.pid, process.used[index])),
            }
        }
        list
    };
    // SAFETY: `count` is a valid, non-null in/out pointer of the caller.
    let room = unsafe { count.read() } as usize;
    // SAFETY: as above.
    unsafe { put(count, list.len() as c_uint) }?;
    if list.len() > room || (infos.is_null() && !list.is_empty()) {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (i, (pid, used)) in list.into_iter().enumerate() {
        // SAFETY: the caller's array holds `room` >= list.len() entries.
        unsafe { put(infos.add(i), make(pid, used)) }?;
    }
    Ok(())
}

fn v1(pid: c_uint, usedGpuMemory: c_ulonglong) -> nvmlProcessInfo_v1_t {
    nvmlProcessInfo_v1_t { pid, usedGpuMemory }
}

fn v2(pid: c_uint, usedGpuMemory: c_ulonglong) -> nvmlProcessInfo_v2_t {
    nvmlProcessInfo_v2_t {
        pid,
        usedGpuMemory,
        gpuInstanceId: c_uint::MAX,
        computeInstanceId: c_uint::MAX,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    nv(|| running(device, infoCount, infos, false, v1))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_v2_t,
) -> nvmlReturn_t {
    nv(|| running(device, infoCount, infos, false, v2))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    nv(|| running(device, infoCount, infos, false, v2))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    nv(|| running(device, infoCount, infos, true, v1))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v2(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_v2_t,
) -> nvmlReturn_t {
    nv(|| running(device, infoCount, infos, true, v2))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    nv(|| running(device, infoCount, infos, true, v2))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    nv(|| {
        let index = index_of(device)?;
        // FAKE_NVML_UTILIZATION pins the answer (a GPU whose NVML disagrees with the truth).
        let pinned = std::env::var("FAKE_NVML_UTILIZATION")
            .ok()
            .and_then(|value| value.parse().ok());
        let gpu = match pinned {
            Some(percent) => percent,
            None => truth()?.device(index).utilisation_percent(),
        };
        // SAFETY: out-pointer from the caller.
        unsafe { put(utilization, nvmlUtilization_t { gpu, memory: 0 }) }
    })
}

/// GPU utilisation samples only: one per 100 ms bucket of the truth that ended after
/// `lastSeenTimeStamp` (monotonic microseconds; NVML's are CPU time, opaque to callers),
/// `NVML_ERROR_NOT_FOUND` when none did; with a null `samples`, the most it can return; a zero
/// count with a buffer is `NVML_ERROR_INVALID_ARGUMENT`. `FAKE_NVML_UTILIZATION` pins every
/// sample's value.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSamples(
    device: nvmlDevice_t,
    type_: nvmlSamplingType_t,
    lastSeenTimeStamp: c_ulonglong,
    sampleValType: *mut nvmlValueType_t,
    sampleCount: *mut c_uint,
    samples: *mut nvmlSample_t,
) -> nvmlReturn_t {
    nv(|| {
        let index = index_of(device)?;
        if sampleValType.is_null() || sampleCount.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if type_ != NVML_GPU_UTILIZATION_SAMPLES {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        // SAFETY: out-pointer from the caller, checked above.
        unsafe { put(sampleValType, NVML_VALUE_TYPE_UNSIGNED_INT)? };
        if samples.is_null() {
            // SAFETY: as above.
            return unsafe { put(sampleCount, crate::truth::BUCKETS as c_uint) };
        }
        let pinned: Option<u32> = std::env::var("FAKE_NVML_UTILIZATION")
            .ok()
            .and_then(|value| value.parse().ok());
        let found = truth()?.device(index).utilisation_samples(lastSeenTimeStamp);
        if found.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        // SAFETY: the caller's count of writable elements.
        let room = unsafe { *sampleCount } as usize;
        if room == 0 {
            // As nvml.h says: a zero count with a buffer is an invalid argument.
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let written = found.len().min(room);
        for (slot, &(at_us, percent)) in found.iter().take(written).enumerate() {
            let sample = nvmlSample_t {
                timeStamp: at_us,
                sampleValue: nvmlValue_t {
                    uiVal: pinned.unwrap_or(percent),
                },
            };
            // SAFETY: `slot` < the caller's count of writable elements.
            unsafe { samples.add(slot).write(sample) };
        }
        // SAFETY: as above.
        unsafe { put(sampleCount, written as c_uint) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    _utilization: *mut nvmlProcessUtilizationSample_t,
    processSamplesCount: *mut c_uint,
    _lastSeenTimeStamp: c_ulonglong,
) -> nvmlReturn_t {
    nv(|| {
        index_of(device)?;
        if processSamplesCount.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(NVML_ERROR_NOT_FOUND)
    })
}

/// The simulated power model, set by FAKE_NVML_BUSY_WATTS (the GPU's power were it busy all the
/// time; without it the fake has no power readings, like a GPU whose NVML lacks them),
/// FAKE_NVML_IDLE_WATTS (default 120) and FAKE_NVML_POWER_LIMIT_WATTS (default 700). The power is
/// idle + utilisation x (busy - idle), from the truth's utilisation.
struct PowerModel {
    busy_watts: f64,
    idle_watts: f64,
    limit_watts: f64,
}

fn power_model() -> NvResult<PowerModel> {
    let watts = |name: &str, default: Option<f64>| -> NvResult<f64> {
        match std::env::var(name) {
            Ok(value) => value.parse().map_err(|_| NVML_ERROR_INVALID_ARGUMENT),
            Err(_) => default.ok_or(NVML_ERROR_NOT_SUPPORTED),
        }
    };
    Ok(PowerModel {
        busy_watts: watts("FAKE_NVML_BUSY_WATTS", None)?,
        idle_watts: watts("FAKE_NVML_IDLE_WATTS", Some(120.0))?,
        limit_watts: watts("FAKE_NVML_POWER_LIMIT_WATTS", Some(700.0))?,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) -> nvmlReturn_t {
    nv(|| {
        let index = index_of(device)?;
        let model = power_model()?;
        let busy = f64::from(truth()?.device(index).utilisation_percent()) / 100.0;
        let watts = model.idle_watts + busy * (model.busy_watts - model.idle_watts);
        // SAFETY: out-pointer from the caller.
        unsafe { put(power, (watts * 1000.0) as c_uint) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(device: nvmlDevice_t, limit: *mut c_uint) -> nvmlReturn_t {
    nv(|| {
        index_of(device)?;
        let model = power_model()?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(limit, (model.limit_watts * 1000.0) as c_uint) }
    })
}

/// The board's default power limit: the fake's boards run at their default
/// (FAKE_NVML_POWER_LIMIT_WATTS).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementDefaultLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> nvmlReturn_t {
    nv(|| {
        index_of(device)?;
        let model = power_model()?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(limit, (model.limit_watts * 1000.0) as c_uint) }
    })
}

/// FAKE_NVML_SLOWDOWN=1 reports a power-cap slowdown (0x4).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> nvmlReturn_t {
    nv(|| {
        index_of(device)?;
        power_model()?;
        let slowed = std::env::var("FAKE_NVML_SLOWDOWN").is_ok_and(|value| value == "1");
        // SAFETY: out-pointer from the caller.
        unsafe { put(reasons, if slowed { 0x4 } else { 0 }) }
    })
}

/// The highest SM clock of the fake GPU (an H200's).
const MAX_SM_MHZ: c_uint = 1980;

/// The SM clocks, with the power model: FAKE_NVML_SM_MHZ is the present clock (default the
/// highest); FAKE_NVML_NO_CLOCKS=1 answers Not Supported (a driver without clock readings).
fn sm_clock(device: nvmlDevice_t, kind: nvmlClockType_t, highest: bool) -> Result<c_uint, nvmlReturn_t> {
    index_of(device)?;
    power_model()?;
    if kind != NVML_CLOCK_SM || std::env::var("FAKE_NVML_NO_CLOCKS").is_ok_and(|value| value == "1") {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    if highest {
        return Ok(MAX_SM_MHZ);
    }
    match std::env::var("FAKE_NVML_SM_MHZ") {
        Ok(text) => text.trim().parse().map_err(|_| NVML_ERROR_INVALID_ARGUMENT),
        Err(_) => Ok(MAX_SM_MHZ),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    kind: nvmlClockType_t,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    nv(|| {
        let clock = sm_clock(device, kind, false)?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(mhz, clock) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxClockInfo(
    device: nvmlDevice_t,
    kind: nvmlClockType_t,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    nv(|| {
        let clock = sm_clock(device, kind, true)?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(mhz, clock) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_v2_version() {
        assert_eq!(MEMORY_V2, 40 | (2 << 24));
        assert_eq!(error_string(NVML_ERROR_INSUFFICIENT_SIZE), c"Insufficient Size");
    }
}
