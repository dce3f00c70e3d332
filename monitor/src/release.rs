//! `vgpu-smi suspend --release` and the `resume` that undoes it: the processes' device memory
//! checkpointed into host memory through the driver's checkpoint API (`cuCheckpointProcess*`,
//! r550 and later, called on another process by pid), so the GPU's memory is free for others
//! while they are held, and restored before they run again.
//!
//! The pid a slot records is acted on only when a live process with that start time is found
//! (`liveness::visible_pid`): in the container it is the slot's pid, on the host its host pid;
//! a forged or stale pid in the region is left alone.
//!
//! Release, per live process of the region: lock it (its CUDA calls wait; a process whose calls do
//! not drain within the timeout is reported and left running), checkpoint it (its memory goes to
//! host memory and its device allocations are released), then mark its slot released
//! ([`vgpu_region::SLOT_RELEASED`]). Its charges stay against the container's limit: it needs them
//! back. Resume, in the reverse order: restore (onto the same GPUs), unlock, clear the mark. A
//! restore that does not fit (someone took the memory meanwhile) fails cleanly: the process stays
//! checkpointed and marked, the message says how much its GPU lacks, and the next `resume` tries
//! again.
//!
//! The API is taken from `libcuda.so.1` (`VGPU_LIBCUDA` names another), and the GPUs' free
//! memory for the message from `libnvidia-ml.so.1`, both loaded only when a command needs them.

use std::ffi::{CString, c_int, c_uint, c_void};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use libloading::Library;
use vgpu_region::{ProcessSnapshot, SLOT_IDLE_RELEASE, SLOT_PRIORITY_RELEASE, SLOT_RELEASED, SlotExtension, Snapshot};

use crate::control::{self, Order, Target};
use crate::liveness::visible_pid;
use crate::read::shown;
use crate::units::human_bytes;

/// `CUcheckpointLockArgs` of cuda.h: the lock's timeout, then reserved words that must be zero.
#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

type ByPid = unsafe extern "C" fn(c_int, *mut c_void) -> c_int;
type ErrorName = unsafe extern "C" fn(c_int, *mut *const std::ffi::c_char) -> c_int;

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_NOT_READY: c_int = 600;

/// The driver's checkpoint entry points.
pub struct Checkpoint {
    _library: Library,
    lock: ByPid,
    checkpoint: ByPid,
    restore: ByPid,
    unlock: ByPid,
    error_name: Option<ErrorName>,
}

impl Checkpoint {
    /// Loads the driver (`VGPU_LIBCUDA`, else `libcuda.so.1`) and its checkpoint API.
    pub fn load() -> Result<Checkpoint, String> {
        let name = std::env::var_os("VGPU_LIBCUDA").unwrap_or_else(|| "libcuda.so.1".into());
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions.
        let library = unsafe { Library::new(&name) }
            .map_err(|error| format!("cannot load the CUDA driver {}: {error}", name.to_string_lossy()))?;
        let symbol = |name: &str| -> Result<ByPid, String> {
            // SAFETY: each of these takes (int pid, args*) and returns CUresult (cuda.h); the
            // pointer is only used while `library` is loaded (it is kept beside them).
            unsafe { library.get::<ByPid>(name.as_bytes()) }
                .map(|symbol| *symbol)
                .map_err(|_| format!("the CUDA driver has no {name} (it needs driver r550 or later)"))
        };
        // SAFETY: cuGetErrorName(CUresult, const char **) as cuda.h declares it, used only while
        // `library` is loaded.
        let error_name = unsafe { library.get::<ErrorName>(b"cuGetErrorName") }
            .ok()
            .map(|symbol| *symbol);
        Ok(Checkpoint {
            error_name,
            lock: symbol("cuCheckpointProcessLock")?,
            checkpoint: symbol("cuCheckpointProcessCheckpoint")?,
            restore: symbol("cuCheckpointProcessRestore")?,
            unlock: symbol("cuCheckpointProcessUnlock")?,
            _library: library,
        })
    }

    fn lock(&self, pid: i32, timeout: Duration) -> c_int {
        let mut args = LockArgs {
            timeout_ms: c_uint::try_from(timeout.as_millis()).unwrap_or(c_uint::MAX).max(1),
            reserved0: 0,
            reserved1: [0; 7],
        };
        // SAFETY: the driver's function, with arguments laid out as cuda.h declares them.
        unsafe { (self.lock)(pid, (&mut args as *mut LockArgs).cast()) }
    }

    /// The driver's name of a status (`cuGetErrorName`), or its number.
    fn status_name(&self, status: c_int) -> String {
        let mut name: *const std::ffi::c_char = std::ptr::null();
        let named = self.error_name.is_some_and(|error_name| {
            // SAFETY: a valid out-pointer to a local; the driver points it at a static string.
            (unsafe { error_name(status, &mut name) }) == CUDA_SUCCESS && !name.is_null()
        });
        if named {
            // SAFETY: non-null, NUL-terminated and static, as cuGetErrorName promises.
            unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned()
        } else {
            format!("CUDA error {status}")
        }
    }

    fn call(&self, function: ByPid, pid: i32) -> c_int {
        // SAFETY: the driver's function; its arguments are optional (null).
        unsafe { function(pid, std::ptr::null_mut()) }
    }
}

/// What one command did: lines were printed; `failed` says whether any process could not be done.
#[derive(Debug, Default)]
pub struct Outcome {
    pub done: usize,
    pub failed: bool,
}

/// Holds the targeted processes (the `suspend` flag) and checkpoints their device memory.
pub fn release(path: &Path, target: Target, driver: &Checkpoint, timeout: Duration) -> Result<Outcome, String> {
    let own = std::process::id() as i32;
    let mut outcome = Outcome::default();
    control::visit(path, target, Order::Slots, |_, process, extension| {
        if process.pid == own || extension.flags.load(Ordering::Acquire) & SLOT_RELEASED != 0 {
            return false;
        }
        let Some(pid) = visible_pid(process.pid, process.start_time) else {
            println!(
                "pid {} (slot {}) in {}: no live process here started when its slot says: left alone",
                process.pid,
                process.slot,
                shown(path)
            );
            outcome.failed = true;
            return false;
        };
        extension.suspend.store(1, Ordering::Release);
        let held = human_bytes(process.memory.iter().map(|usage| usage.total).sum());
        let started = Instant::now();
        let status = driver.lock(pid, timeout);
        if status != CUDA_SUCCESS {
            let why = if status == CUDA_ERROR_NOT_READY {
                format!("its CUDA calls did not drain within {timeout:?}")
            } else {
                driver.status_name(status)
            };
            println!(
                "pid {} (slot {}) in {}: not locked ({why}): left running, its memory on the GPU",
                process.pid,
                process.slot,
                shown(path)
            );
            extension.suspend.store(0, Ordering::Release);
            outcome.failed = true;
            return false;
        }
        let locked = started.elapsed();
        let status = driver.call(driver.checkpoint, pid);
        if status != CUDA_SUCCESS {
            let _ = driver.call(driver.unlock, pid);
            println!(
                "pid {} (slot {}) in {}: checkpoint failed ({}): unlocked, left running",
                process.pid,
                process.slot,
                shown(path),
                driver.status_name(status)
            );
            extension.suspend.store(0, Ordering::Release);
            outcome.failed = true;
            return false;
        }
        extension.flags.fetch_or(SLOT_RELEASED, Ordering::AcqRel);
        println!(
            "released pid {} (slot {}) in {}: {held} off the GPU in {:.3} s (lock {:.3} s, checkpoint {:.3} s)",
            process.pid,
            process.slot,
            shown(path),
            started.elapsed().as_secs_f64(),
            locked.as_secs_f64(),
            (started.elapsed() - locked).as_secs_f64()
        );
        outcome.done += 1;
        true
    })?;
    Ok(outcome)
}

/// Whether a targeted live process of the region is released (so `resume` needs the driver).
pub fn has_released(path: &Path, target: Target) -> bool {
    let mut any = false;
    let _ = control::visit(path, target, Order::Slots, |_, _, extension| {
        any |= extension.flags.load(Ordering::Acquire) & SLOT_RELEASED != 0;
        false
    });
    any
}

/// Restores the released processes among the targeted ones (in the reverse order) and lets every
/// targeted one run again. `driver` is loaded by the caller only when some slot is released.
pub fn resume(path: &Path, target: Target, driver: Option<&Checkpoint>) -> Result<Outcome, String> {
    let mut outcome = Outcome::default();
    control::visit(path, target, Order::Reversed, |snapshot, process, extension| {
        if extension.flags.load(Ordering::Acquire) & SLOT_RELEASED == 0 {
            extension.suspend.store(0, Ordering::Release);
            println!("resumed pid {} (slot {}) in {}", process.pid, process.slot, shown(path));
            outcome.done += 1;
            return true;
        }
        let Some(driver) = driver else {
            println!(
                "pid {} (slot {}) in {}: not restored (no CUDA driver to restore it with); it stays released",
                process.pid,
                process.slot,
                shown(path)
            );
            outcome.failed = true;
            return false;
        };
        match restore(driver, snapshot, process, extension) {
            Ok(seconds) => {
                println!(
                    "restored pid {} (slot {}) in {}: back on the GPU in {seconds:.3} s",
                    process.pid,
                    process.slot,
                    shown(path)
                );
                outcome.done += 1;
                true
            }
            Err(why) => {
                println!(
                    "pid {} (slot {}) in {}: not restored ({why}); it stays released: run resume again once the \
                     memory is free",
                    process.pid,
                    process.slot,
                    shown(path)
                );
                outcome.failed = true;
                false
            }
        }
    })?;
    Ok(outcome)
}

/// Restore and unlock; clears the marks. `Err` says why, with what the GPU lacks when known.
fn restore(
    driver: &Checkpoint,
    snapshot: &Snapshot,
    process: &ProcessSnapshot,
    extension: &SlotExtension,
) -> Result<f64, String> {
    let pid = visible_pid(process.pid, process.start_time)
        .ok_or_else(|| "no live process here started when its slot says".to_string())?;
    let started = Instant::now();
    let status = driver.call(driver.restore, pid);
    if status != CUDA_SUCCESS {
        return Err(format!(
            "{}{}",
            driver.status_name(status),
            shortfall(snapshot, process)
        ));
    }
    let status = driver.call(driver.unlock, pid);
    if status != CUDA_SUCCESS {
        return Err(format!("restored, but unlock failed: {}", driver.status_name(status)));
    }
    extension.flags.fetch_and(
        !(SLOT_RELEASED | SLOT_IDLE_RELEASE | SLOT_PRIORITY_RELEASE),
        Ordering::AcqRel,
    );
    extension.suspend.store(0, Ordering::Release);
    Ok(started.elapsed().as_secs_f64())
}

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// ": it needs X on GPU d, which has Y free (Z missing)" for each device the process held memory
/// on, with NVML's free memory of the device of the region's UUID when NVML can say.
fn shortfall(snapshot: &Snapshot, process: &ProcessSnapshot) -> String {
    let free_of = nvml_free();
    let mut text = String::new();
    for (device, usage) in process.memory.iter().enumerate().filter(|(_, usage)| usage.total > 0) {
        let needed = usage.total;
        let free = snapshot
            .uuids
            .get(device)
            .and_then(|uuid| free_of.as_ref().and_then(|free_of| free_of(uuid)));
        text += &match free {
            Some(free) if free < needed => format!(
                ": it needs {} on GPU {device}, which has {} free ({} missing)",
                human_bytes(needed),
                human_bytes(free),
                human_bytes(needed - free)
            ),
            _ => format!(": it needs {} on GPU {device}", human_bytes(needed)),
        };
    }
    text
}

type NvmlInit = unsafe extern "C" fn() -> c_int;
type NvmlHandleByUuid = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void) -> c_int;
type NvmlMemoryInfo = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_int;

/// The free memory of a device by its UUID, when NVML loads.
fn nvml_free() -> Option<impl Fn(&str) -> Option<u64>> {
    // SAFETY: loading NVML runs its initialisers, which have no preconditions.
    let library = unsafe { Library::new("libnvidia-ml.so.1") }.ok()?;
    // SAFETY: the prototypes are nvml.h's; the pointers are used only while `library` lives
    // (the closure keeps it).
    let (init, by_uuid, memory) = unsafe {
        (
            *library.get::<NvmlInit>(b"nvmlInit_v2").ok()?,
            *library.get::<NvmlHandleByUuid>(b"nvmlDeviceGetHandleByUUID").ok()?,
            *library.get::<NvmlMemoryInfo>(b"nvmlDeviceGetMemoryInfo").ok()?,
        )
    };
    // SAFETY: no arguments.
    if unsafe { init() } != 0 {
        return None;
    }
    Some(move |uuid: &str| {
        let _keep = &library;
        let uuid = CString::new(uuid).ok()?;
        let mut device: *mut c_void = std::ptr::null_mut();
        // SAFETY: a NUL-terminated UUID and a valid out-pointer to a local.
        if unsafe { by_uuid(uuid.as_ptr(), &mut device) } != 0 {
            return None;
        }
        let mut info = NvmlMemory::default();
        // SAFETY: the handle NVML gave and a valid out-pointer to a local.
        (unsafe { memory(device, &mut info) } == 0).then_some(info.free)
    })
}
