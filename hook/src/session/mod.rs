//! The process's session: the configuration it runs under, the shared region and the devices it
//! opened when CUDA initialised, this process's slot in the region (a new one after `fork`), and
//! the suspend flag in that slot. Memory accounting, the compute limiter and the NVML views are
//! built on it; it knows none of them.
//!
//! Fork: the `pthread_atfork` child handler only stores atomics. The child keeps the session
//! (the region mapping and the devices are the same), gets a slot of its own on its first use of
//! the session, and sees [`epoch`] advance, by which the modules above know to drop their
//! parent's per-process state (its locks may be held by threads the child does not have).

mod devices;
pub mod self_release;
pub mod suspend;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::time::Duration;

use vgpu_config::{Config, ConfigError};
use vgpu_region::{InitParams, MAX_DEVICES, OpenKind, Owners, PathState, Region, Slot};

pub use devices::{DeviceEntry, current_ordinal, format_uuid};

use crate::sys::cuda::CUdevice;

/// The region and the devices, for the life of the process (the same in a forked child).
pub struct Session {
    region: Region,
    devices: Vec<DeviceEntry>,
}

/// What belongs to one process: its slot. `None`: a forked child that could not attach and has no
/// parent slot either.
struct Process {
    slot: Option<&'static Slot>,
}

/// The session, from a leaked allocation: an atomic pointer rather than a once-cell, whose
/// initialisation a child forked in the middle would wait for forever.
static SESSION: AtomicPtr<Session> = AtomicPtr::new(std::ptr::null_mut());
/// This process's slot; null in a forked child until its first use of the session.
static PROCESS: AtomicPtr<Process> = AtomicPtr::new(std::ptr::null_mut());
/// The parent's [`Process`] in a forked child, whose slot the child uses if it cannot attach.
static INHERITED: AtomicPtr<Process> = AtomicPtr::new(std::ptr::null_mut());
/// Forks this process descends through (0 in the process that loaded the library).
static EPOCH: AtomicU64 = AtomicU64::new(0);
/// Held (true) while a thread opens the region ([`start`]), and while one attaches a forked
/// child. Flags, not locks: the child handler clears them, a held lock could not be.
static STARTING: AtomicBool = AtomicBool::new(false);
static ATTACHING: AtomicBool = AtomicBool::new(false);
/// How long a thread sleeps between looks while another one starts or attaches.
const WAIT_STEP: Duration = Duration::from_millis(1);
/// Set when this process has given its slot back at exit ([`detach_at_exit`]): later charges
/// (teardown code running after the library's destructor, other threads) are refused and
/// releases dropped, quietly: the slot and everything charged to it are gone already.
static DETACHED: AtomicBool = AtomicBool::new(false);

/// The configuration, read from the environment once per process (a forked child inherits it,
/// which is right: it inherits the environment too).
pub fn config() -> Result<&'static Config, &'static ConfigError> {
    static CONFIG: OnceLock<Result<Config, ConfigError>> = OnceLock::new();
    CONFIG.get_or_init(Config::from_env).as_ref()
}

/// The session, once CUDA has initialised with it. In a forked child, the first call attaches the
/// child's own slot.
#[inline]
pub fn get() -> Option<&'static Session> {
    let session = SESSION.load(Ordering::Acquire);
    if session.is_null() {
        return None;
    }
    // SAFETY: a non-null pointer came from Box::leak in `start` and is never freed.
    let session: &'static Session = unsafe { &*session };
    if PROCESS.load(Ordering::Acquire).is_null() {
        session.after_fork();
    }
    Some(session)
}

/// How many forks separate this process from the one that loaded the library: per-process state
/// made under another epoch is a parent's.
#[inline(always)]
pub fn epoch() -> u64 {
    EPOCH.load(Ordering::Acquire)
}

/// This process's part (after a fork, the child's own once it has attached).
#[inline]
fn process() -> Option<&'static Process> {
    let process = PROCESS.load(Ordering::Acquire);
    // SAFETY: a non-null pointer came from Box::leak and is never freed.
    (!process.is_null()).then(|| unsafe { &*process })
}

fn leak_process(slot: Option<&'static Slot>) -> &'static Process {
    Box::leak(Box::new(Process { slot }))
}

/// A flag taken as a lock; cleared on drop.
struct Flag(&'static AtomicBool);

impl Flag {
    /// Waits (sleeping) until the flag is free, then takes it.
    fn take(flag: &'static AtomicBool) -> Flag {
        while flag
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::sleep(WAIT_STEP);
        }
        Flag(flag)
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// `pthread_atfork` child handler: only atomic loads and stores (async-signal-safe). The child
/// attaches its own slot on its first use of the session; the parent's is left alone.
extern "C" fn forked_child() {
    let parent = PROCESS.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if !parent.is_null() {
        INHERITED.store(parent, Ordering::Release);
    }
    EPOCH.fetch_add(1, Ordering::AcqRel);
    STARTING.store(false, Ordering::Release);
    ATTACHING.store(false, Ordering::Release);
}

/// Opens the region and attaches this process (after the real cuInit succeeded). Idempotent;
/// the error is one line for the log.
pub fn start(config: &Config) -> Result<(), String> {
    // Frameworks call cuInit again and again: once started, no lock.
    if !SESSION.load(Ordering::Acquire).is_null() {
        return Ok(());
    }
    // Before anything is held: a fork in the middle of starting leaves the child free to start.
    static ATFORK: AtomicBool = AtomicBool::new(false);
    if !ATFORK.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a plain function that only loads and stores atomics; no other effect.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    }
    let _serial = Flag::take(&STARTING);
    if !SESSION.load(Ordering::Acquire).is_null() {
        return Ok(());
    }
    let uuids = devices::visible_uuids()?;
    let mut init = InitParams {
        device_uuids: uuids.clone(),
        priority: config.task_priority,
        ..InitParams::default()
    };
    // Every index, not only this process's devices: a device another process registers later
    // gets the limit its index has here (the global variable's, when only that one is set).
    for index in 0..MAX_DEVICES {
        init.limits[index] = config.memory_limit_of(index).unwrap_or(0);
        init.sm_limits[index] = config.sm_limit_of(index).map_or(0, u64::from);
    }
    let region = open_region(config, &init)?;
    if let PathState::Restored { replaced } = region.path_at_open() {
        tracing::warn!(
            "the shared region {} was {} while this container's processes used it; put it back and joined it (it \
             holds the container's charges and limits: change a limit with vgpu-smi set, and delete the file only \
             when no process of the container runs)",
            config.shared_cache.display(),
            if replaced {
                "replaced by another file"
            } else {
                "deleted"
            }
        );
    }
    match region.open_kind() {
        OpenKind::Rebuilt(problem) => {
            tracing::warn!(
                "shared region {} was invalid ({problem}); rebuilt it",
                config.shared_cache.display()
            )
        }
        OpenKind::Repaired(problem) => {
            tracing::warn!(
                "shared region {}: {problem}; totals recomputed",
                config.shared_cache.display()
            )
        }
        _ => {}
    }
    // A reused region keeps the container's priority (HAMi reads it as the container's); the
    // limits are compared with the variables per device below (`limits::seed`).
    let priority = region.hami().priority.load(std::sync::atomic::Ordering::Relaxed);
    if priority != config.task_priority {
        tracing::warn!(
            "the shared region {} holds priority {priority} where CUDA_TASK_PRIORITY gives {}; the region's applies \
             (it is the container's, kept while the region is valid: delete the file to start afresh)",
            config.shared_cache.display(),
            config.task_priority
        );
    }
    let mut entries = Vec::with_capacity(uuids.len());
    for (ordinal, uuid) in uuids.into_iter().enumerate() {
        let region_index = region.device_index(&uuid).map_err(|e| e.to_string())?;
        crate::limits::seed(
            &region,
            region_index,
            ordinal,
            config.memory_limit_of(ordinal),
            config.sm_limit_of(ordinal),
        );
        entries.push(DeviceEntry {
            ordinal: ordinal as CUdevice,
            uuid,
            region_index,
        });
    }
    let slot = region.attach(std::process::id() as i32).map_err(|e| e.to_string())?;
    write_kernel_time(&region);
    let process = leak_process(Some(Box::leak(Box::new(slot))));
    let session: &'static Session = Box::leak(Box::new(Session {
        region,
        devices: entries,
    }));
    // The slot first: whoever sees the session sees this process's slot with it.
    PROCESS.store(std::ptr::from_ref(process).cast_mut(), Ordering::Release);
    SESSION.store(std::ptr::from_ref(session).cast_mut(), Ordering::Release);
    session.watch_suspend_flag();
    Ok(())
}

/// How often a process looks at its region's path from its memory calls.
const PATH_CHECK_PERIOD_NS: u64 = 500_000_000;

/// Set while the library's tick runs in this process (`throttle::activity`), which looks at the
/// region's path every period: the memory calls then leave it to the tick.
pub static TICK_KEEPS_PATH: AtomicBool = AtomicBool::new(false);

/// From a memory call that charges: [`keep_region_path`] at most every [`PATH_CHECK_PERIOD_NS`]
/// (one clock read otherwise), unless the tick runs (it launched kernels) and checks it. A process
/// that neither launches nor allocates leaves it to the next process that starts (which puts the
/// region back before it opens the path).
#[inline]
pub fn keep_region_path_now_and_then(session: &Session) {
    static CHECKED_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if TICK_KEEPS_PATH.load(Ordering::Relaxed) {
        return;
    }
    let now = vgpu_region::monotonic_ns();
    let last = CHECKED_NS.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= PATH_CHECK_PERIOD_NS
        && CHECKED_NS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        keep_region_path(session);
    }
}

/// From the process's tick, and from its memory calls now and then: puts the region back at its
/// path if the file was deleted or replaced while the container runs (`vgpu_region::anchor`), and
/// says so once per change.
pub fn keep_region_path(session: &Session) {
    static LAST: std::sync::Mutex<Option<PathState>> = std::sync::Mutex::new(None);
    let state = session.region.keep_path();
    let mut last = LAST.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if *last == Some(state) || (state == PathState::Intact && last.is_none()) {
        return;
    }
    *last = Some(state);
    let path = session.region.path().display();
    match state {
        PathState::Intact => {}
        PathState::Restored { replaced } => tracing::warn!(
            "the shared region {path} was {} while this container's processes used it; put it back (it holds the \
             container's charges and limits: change a limit with vgpu-smi set, and delete the file only when no \
             process of the container runs)",
            if replaced {
                "replaced by another file"
            } else {
                "deleted"
            }
        ),
        PathState::Contested => tracing::warn!(
            "the shared region {path} now names another region that processes use: this process stays with its own \
             (the two are not merged; restart the container's processes to make them one)"
        ),
        PathState::Lost => tracing::error!(
            "the shared region {path} and its anchor were deleted while this process used the region: processes \
             starting now do not see this container's usage"
        ),
    }
}

/// Writes now (unix seconds) into the region's `last_kernel_time`, which HAMi's monitor reads:
/// at attach, as HAMi-core does, and from the launches' tick (`throttle::activity`).
pub fn write_kernel_time(region: &Region) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX));
    region.hami().last_kernel_time.store(now, Ordering::Relaxed);
}

/// At normal exit or unload of the library (`crate::exit`): gives this process's slot back to
/// the region, releasing everything still charged to it. Only a slot attached for this very pid:
/// a forked child that never attached (or charges its parent's slot) leaves the parent's alone.
/// Never calls the driver; the region's lock is waited for at most its usual timeout.
pub fn detach_at_exit() {
    let session = SESSION.load(Ordering::Acquire);
    let (Some(process), false) = (process(), session.is_null()) else {
        return;
    };
    let Some(slot) = process
        .slot
        .filter(|slot| i64::from(slot.pid()) == i64::from(std::process::id()))
    else {
        return;
    };
    DETACHED.store(true, Ordering::SeqCst);
    // SAFETY: a non-null pointer came from Box::leak in `start` and is never freed.
    let region = &unsafe { &*session }.region;
    if let Err(error) = region.detach(slot) {
        // The slot is reaped later as a dead process's.
        tracing::debug!("exit: {error}; the slot is left to be reaped");
    }
}

/// Whether this process has given its slot back at exit ([`detach_at_exit`]).
#[inline(always)]
pub fn detached() -> bool {
    DETACHED.load(Ordering::Relaxed)
}

/// Opens the configured region file with the owners the configuration trusts; the error is one
/// line for the log (with the way out when the file belongs to another user).
pub fn open_region(config: &Config, init: &InitParams) -> Result<Region, String> {
    let owners = if config.shared_cache_any_owner {
        Owners::Any
    } else {
        Owners::SelfOrRoot
    };
    Region::open_with(&config.shared_cache, init, owners).map_err(|error| match &error {
        vgpu_region::RegionError::UnsafeFile {
            problem: vgpu_region::UnsafeFile::ForeignOwner { .. },
            ..
        } => format!("{error}; VGPU_SHARED_CACHE_ANY_OWNER=1 trusts it (docs/threat-model.md)"),
        _ => error.to_string(),
    })
}

impl Session {
    /// The shared region.
    pub fn region(&'static self) -> &'static Region {
        &self.region
    }

    /// The device of this CUDA ordinal.
    pub fn device(&'static self, ordinal: CUdevice) -> Option<&'static DeviceEntry> {
        usize::try_from(ordinal).ok().and_then(|index| self.devices.get(index))
    }

    /// The device's memory limit now: the region's (`crate::limits`).
    pub fn limit(&'static self, device: &DeviceEntry) -> Option<u64> {
        crate::limits::memory(&self.region, device.region_index)
    }

    /// The region device's compute limit now, in percent: the region's (`crate::limits`).
    pub fn sm_limit(&'static self, region_index: usize) -> Option<u8> {
        crate::limits::sm(&self.region, region_index)
    }

    /// Whether any of this process's devices has a compute limit now.
    pub fn any_sm_limit(&'static self) -> bool {
        self.devices
            .iter()
            .any(|device| self.sm_limit(device.region_index).is_some())
    }

    /// The device of this UUID (as NVML writes it).
    pub fn device_by_uuid(&'static self, uuid: &str) -> Option<&'static DeviceEntry> {
        self.devices.iter().find(|device| device.uuid == uuid)
    }

    /// This process's slot (after a fork, the child's own, attached on first use); `None` for a
    /// forked child that could attach none and has no parent slot.
    pub fn slot(&'static self) -> Option<&'static Slot> {
        match process() {
            Some(process) => process.slot,
            None => self.after_fork().slot,
        }
    }

    /// Index of this process's slot.
    pub fn slot_index(&'static self) -> Option<usize> {
        self.slot().map(Slot::index)
    }

    /// Points `vgpu-smi suspend`'s flag check at this process's slot.
    fn watch_suspend_flag(&'static self) {
        if let Some(slot) = self
            .slot_index()
            .and_then(|index| self.region.extension().slots.get(index))
        {
            suspend::watch(&slot.suspend);
        }
    }

    /// In a forked child, on its first use of the session: a slot of its own. One thread
    /// attaches; the others wait for it (never on a lock of the parent's).
    #[cold]
    #[inline(never)]
    fn after_fork(&'static self) -> &'static Process {
        let _attaching = Flag::take(&ATTACHING);
        if let Some(process) = process() {
            return process;
        }
        let slot = match self.region.attach(std::process::id() as i32) {
            Ok(slot) => {
                write_kernel_time(&self.region);
                Some(&*Box::leak(Box::new(slot)))
            }
            Err(error) => {
                tracing::error!("{error}; this forked process's allocations are charged to its parent's slot");
                let inherited = INHERITED.load(Ordering::Acquire);
                // SAFETY: a non-null pointer came from Box::leak and is never freed.
                (!inherited.is_null())
                    .then(|| unsafe { &*inherited })
                    .and_then(|process| process.slot)
            }
        };
        let process = leak_process(slot);
        PROCESS.store(std::ptr::from_ref(process).cast_mut(), Ordering::Release);
        self.watch_suspend_flag();
        process
    }
}
