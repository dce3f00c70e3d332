//! Releasing this process's GPU memory on its own behalf (`CUDA_IDLE_RELEASE`,
//! `CUDA_PRIORITY_RELEASE`): the process's device memory is checkpointed into host memory while
//! it is idle, or while HAMi's monitor blocks the container by priority (`recent_kernel` -1), and
//! restored when it needs the GPU again.
//!
//! The driver's checkpoint API must be driven from another process (it locks every CUDA call of
//! the target), so the library starts `vgpu-smi suspend --release --pid <own pid>` and, later,
//! `vgpu-smi resume --pid <own pid>` (found in `$VGPU_SMI`, beside `libvgpu.so`, or on `PATH`),
//! from the library's tick (every half second in a process that has launched). The slot's flags
//! say why it was released ([`SLOT_IDLE_RELEASE`], [`SLOT_PRIORITY_RELEASE`]), so that only the
//! library's own releases are undone by it:
//!
//! - **Idle**: released after `CUDA_IDLE_RELEASE` without a launch (the tick sees launches);
//!   restored as soon as a launch or copy waits on the suspend flag (the release sets it), or a
//!   data allocation or free of the process is under way (its in-flight mark: the call waits in
//!   the driver's lock). The call that waits goes on once restored.
//! - **Priority**: released while `recent_kernel` is -1; restored once it is not.
//!
//! At most one helper runs at a time; a helper that fails is logged and tried again at a later
//! tick.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vgpu_region::{SLOT_IDLE_RELEASE, SLOT_PRIORITY_RELEASE, SLOT_RELEASED};

use super::Session;

/// A helper (`vgpu-smi`) is running.
static HELPER: AtomicBool = AtomicBool::new(false);
/// A launch or copy waits for an idle release to be undone.
static WANTED: AtomicBool = AtomicBool::new(false);
/// Monotonic ns of the last tick that saw a launch (0: none yet; the tick's start counts).
static LAST_LAUNCH_NS: AtomicU64 = AtomicU64::new(0);
/// Monotonic ns before which no helper is started again, after one failed.
static RETRY_AFTER_NS: AtomicU64 = AtomicU64::new(0);

/// How long after a failed helper the library tries again.
const RETRY_PERIOD_NS: u64 = 30_000_000_000;

/// Whether the tick must look at launches every period (an idle release is configured).
pub fn watches_launches() -> bool {
    super::config().is_ok_and(|config| config.idle_release.is_some())
}

/// From the tick: whether launches happened since the last one; releases or restores as the
/// configuration and the region say.
pub fn tick(session: &'static Session, launched: bool) {
    let Ok(config) = super::config() else { return };
    if config.idle_release.is_none() && !config.priority_release {
        return;
    }
    let now = vgpu_region::monotonic_ns();
    if launched || LAST_LAUNCH_NS.load(Ordering::Relaxed) == 0 {
        LAST_LAUNCH_NS.store(now, Ordering::Relaxed);
    }
    let (Some(slot), region) = (session.slot(), session.region()) else {
        return;
    };
    let Some(extension) = region.extension().slots.get(slot.index()) else {
        return;
    };
    if HELPER.load(Ordering::Acquire) || now < RETRY_AFTER_NS.load(Ordering::Relaxed) {
        return;
    }
    let mut flags = extension.flags.load(Ordering::Acquire);
    if flags & SLOT_RELEASED == 0 && flags & (SLOT_IDLE_RELEASE | SLOT_PRIORITY_RELEASE) != 0 {
        // The release asked for did not happen (the helper failed): its reason goes.
        extension
            .flags
            .fetch_and(!(SLOT_IDLE_RELEASE | SLOT_PRIORITY_RELEASE), Ordering::AcqRel);
        flags &= !(SLOT_IDLE_RELEASE | SLOT_PRIORITY_RELEASE);
    }
    let blocked = region.hami().recent_kernel.load(Ordering::Relaxed) < 0;
    if flags & SLOT_RELEASED == 0 {
        let reason = if config.priority_release && blocked {
            Some(SLOT_PRIORITY_RELEASE)
        } else {
            config
                .idle_release
                .filter(|idle| now.saturating_sub(LAST_LAUNCH_NS.load(Ordering::Relaxed)) >= idle.as_nanos() as u64)
                .map(|_| SLOT_IDLE_RELEASE)
        };
        if let Some(reason) = reason {
            extension.flags.fetch_or(reason, Ordering::AcqRel);
            WANTED.store(false, Ordering::Relaxed);
            let why = if reason == SLOT_IDLE_RELEASE {
                "idle for CUDA_IDLE_RELEASE"
            } else {
                "blocked by priority (CUDA_PRIORITY_RELEASE)"
            };
            tracing::info!("{why}: releasing this process's GPU memory to host memory");
            start_helper(&config.shared_cache, &["suspend", "--release"]);
        }
        return;
    }
    let in_flight = extension
        .memory_in_flight
        .iter()
        .any(|marks| marks.load(Ordering::Relaxed) > 0);
    let restore = (flags & SLOT_IDLE_RELEASE != 0 && (WANTED.load(Ordering::Relaxed) || in_flight))
        || (flags & SLOT_PRIORITY_RELEASE != 0 && !blocked);
    if restore {
        tracing::info!("restoring this process's GPU memory");
        start_helper(&config.shared_cache, &["resume"]);
    }
}

/// From a launch or copy waiting on the suspend flag: an idle release is undone at the next tick.
pub fn wanted() {
    WANTED.store(true, Ordering::Relaxed);
}

/// `vgpu-smi`: `$VGPU_SMI`, else beside this library, else on `PATH`.
fn vgpu_smi() -> PathBuf {
    if let Some(path) = std::env::var_os("VGPU_SMI") {
        return PathBuf::from(path);
    }
    own_directory()
        .map(|directory| directory.join("vgpu-smi"))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| PathBuf::from("vgpu-smi"))
}

/// The folder of the file this library was loaded from.
fn own_directory() -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: Dl_info is plain C data; all zeroes is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let address = own_directory as *const () as *const libc::c_void;
    // SAFETY: dladdr only reads loader tables and writes `info`.
    if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr set a NUL-terminated string owned by the loader.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    std::path::Path::new(std::ffi::OsStr::from_bytes(name.to_bytes()))
        .parent()
        .map(PathBuf::from)
}

/// Starts `vgpu-smi <arguments> --pid <own> --region <region>` on a thread that waits for it,
/// without this library preloaded into it.
fn start_helper(region: &std::path::Path, arguments: &[&str]) {
    if HELPER.swap(true, Ordering::AcqRel) {
        return;
    }
    let mut command = std::process::Command::new(vgpu_smi());
    command
        .args(arguments)
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg("--region")
        .arg(region)
        .env_remove("LD_PRELOAD")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    let started = std::thread::Builder::new().name("vgpu-release".into()).spawn(move || {
        match command.status() {
            Ok(status) if status.success() => {}
            Ok(status) => {
                tracing::warn!("{command:?} ended with {status}; tried again in 30 s");
                RETRY_AFTER_NS.store(vgpu_region::monotonic_ns() + RETRY_PERIOD_NS, Ordering::Relaxed);
            }
            Err(error) => {
                tracing::warn!("cannot start {command:?}: {error}; tried again in 30 s");
                RETRY_AFTER_NS.store(vgpu_region::monotonic_ns() + RETRY_PERIOD_NS, Ordering::Relaxed);
            }
        }
        HELPER.store(false, Ordering::Release);
    });
    if started.is_err() {
        HELPER.store(false, Ordering::Release);
    }
}
