//! The process's place in the shared region: opened when CUDA initialises, one slot per process
//! (a new one after `fork`), and the charge / release operations the handlers use.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::time::Duration;

use vgpu_region::{ChargeError, InitParams, MAX_DEVICES, MemoryKind, OpenKind, Owners, Region, RegionError, Slot};

use super::devices::{self, DeviceEntry};
use super::ledger::{Charge, Ledger};
use crate::config::Config;
use crate::sys::cuda::{CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUdevice, CUresult};

/// Everything memory accounting needs, for the life of the process: the region and the devices
/// (the same in a forked child), and the process's own slot, ledger and queue of pending updates,
/// reached through [`OWN`].
pub struct Accounting {
    region: Region,
    devices: Vec<DeviceEntry>,
}

/// What belongs to one process: its slot, what it has charged, and the region updates it still
/// owes. A forked child gets a new one (the parent's ledger and queue locks may be held by threads
/// the child does not have), so its queue starts empty; the old one is left as it is, never freed.
struct Own {
    /// `None`: a forked child that could not attach and has no parent slot either.
    slot: Option<&'static Slot>,
    ledger: Ledger,
    /// Region updates the lock did not let through, applied before the next one.
    pending: Mutex<Pending>,
    /// Whether `pending` holds anything (the fast path's one load).
    has_pending: AtomicBool,
    /// Whether a thread retries `pending` in the background (for a process that may never make
    /// another accounting call).
    retrying: AtomicBool,
}

impl Own {
    /// A process's own part with an empty ledger and an empty queue, leaked (never freed).
    fn leak(slot: Option<&'static Slot>) -> &'static Own {
        Box::leak(Box::new(Own {
            slot,
            ledger: Ledger::default(),
            pending: Mutex::new(Pending::default()),
            has_pending: AtomicBool::new(false),
            retrying: AtomicBool::new(false),
        }))
    }
}

/// Charges and releases this process owes the region: a release, or a charge of memory the driver
/// has already taken (`record`), made while the region's lock could not be taken (a timeout). They
/// are kept here, never dropped, and written at the next accounting call that gets the lock (any
/// allocation, free or memory query of the process), or by a background thread that retries every
/// [`RETRY_INTERVAL`] while any are left (a process may never call again); the slot is freed at
/// exit in any case. Per process: a forked child starts with an empty queue of its own and never
/// touches the parent's.
#[derive(Default)]
struct Pending {
    /// Bytes to charge, by region device index and kind.
    charges: [[u64; KINDS]; MAX_DEVICES],
    /// Bytes to release, by region device index and kind.
    releases: [[u64; KINDS]; MAX_DEVICES],
}

const KINDS: usize = 3;
const ALL_KINDS: [MemoryKind; KINDS] = [MemoryKind::Context, MemoryKind::Module, MemoryKind::Data];

fn kind_index(kind: MemoryKind) -> usize {
    match kind {
        MemoryKind::Context => 0,
        MemoryKind::Module => 1,
        MemoryKind::Data => 2,
    }
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.charges
            .iter()
            .chain(&self.releases)
            .flatten()
            .all(|&bytes| bytes == 0)
    }

    /// Queues `bytes` on one side; what the other side owes for the same device and kind cancels
    /// first (a queued charge and a queued release of it leave the slot as it is).
    fn add(&mut self, release: bool, charge: &Charge) {
        let (Some(charges), Some(releases)) = (
            self.charges.get_mut(charge.region_index),
            self.releases.get_mut(charge.region_index),
        ) else {
            return;
        };
        let kind = kind_index(charge.kind);
        let (same, other) = if release {
            (&mut releases[kind], &mut charges[kind])
        } else {
            (&mut charges[kind], &mut releases[kind])
        };
        let cancelled = charge.bytes.min(*other);
        *other -= cancelled;
        *same = same.saturating_add(charge.bytes - cancelled);
    }
}

/// Whether a region error means the lock could not be taken (the update can be made later).
fn lock_not_taken(error: &RegionError) -> bool {
    matches!(error, RegionError::LockTimeout { .. } | RegionError::LockFailed { .. })
}

/// The process's accounting, from a leaked allocation: an atomic pointer rather than a once-cell,
/// whose initialisation a child forked in the middle would wait for forever.
static ACCOUNTING: AtomicPtr<Accounting> = AtomicPtr::new(std::ptr::null_mut());
/// This process's slot, ledger and queue; null in a forked child until its first use of
/// accounting.
static OWN: AtomicPtr<Own> = AtomicPtr::new(std::ptr::null_mut());
/// The parent's [`Own`] in a forked child, whose slot the child charges if it cannot attach.
static INHERITED: AtomicPtr<Own> = AtomicPtr::new(std::ptr::null_mut());
/// Held (true) while a thread opens the region ([`start`]), and while one attaches a forked
/// child. Flags, not locks: the child handler clears them, a held `Mutex` could not be.
static STARTING: AtomicBool = AtomicBool::new(false);
static ATTACHING: AtomicBool = AtomicBool::new(false);
/// How long a thread sleeps between looks while another one starts or attaches.
const WAIT_STEP: Duration = Duration::from_millis(1);
/// How often queued region updates are retried in the background.
const RETRY_INTERVAL: Duration = Duration::from_millis(100);
/// Set when this process has given its slot back at exit ([`detach_at_exit`]): later charges
/// (teardown code running after the library's destructor, other threads) are refused and
/// releases dropped, quietly: the slot and everything charged to it are gone already.
static DETACHED: AtomicBool = AtomicBool::new(false);

/// The process's accounting, once CUDA has initialised with it. In a forked child, the first
/// call attaches the child's own slot.
#[inline]
pub fn accounting() -> Option<&'static Accounting> {
    let accounting = ACCOUNTING.load(Ordering::Acquire);
    if accounting.is_null() {
        return None;
    }
    // SAFETY: a non-null pointer came from Box::leak in `start` and is never freed.
    let accounting: &'static Accounting = unsafe { &*accounting };
    if OWN.load(Ordering::Acquire).is_null() {
        accounting.after_fork();
    }
    Some(accounting)
}

/// This process's slot and ledger (after a fork, the child's own once it has attached).
#[inline]
fn own() -> Option<&'static Own> {
    let own = OWN.load(Ordering::Acquire);
    // SAFETY: a non-null pointer came from Box::leak and is never freed.
    (!own.is_null()).then(|| unsafe { &*own })
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

/// What an allocation path does when the process has no accounting: `cuInit` has not succeeded
/// here (the region could not be used, or `cuInit` failed or was never called; the first two
/// leave the real driver initialised). With a memory limit configured (or a configuration
/// `cuInit` refused) the call is refused with `CUDA_ERROR_NOT_INITIALIZED` before the driver is
/// asked, so no byte is ever allocated unaccounted (fail closed); without a limit the driver
/// answers.
///
/// `CUDA_ERROR_NOT_INITIALIZED` rather than out of memory: it is what `cuInit` already told the
/// application (CUDA is not usable here), what the driver itself answers after a failed
/// `cuInit`, and frameworks do not take it for a full device to be freed and retried.
#[cold]
pub fn unaccounted(call: impl FnOnce() -> CUresult) -> CUresult {
    if !limit_configured() {
        return call();
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::error!(
            "device memory is limited but the shared region is not in use (cuInit did not succeed): every allocation \
             is refused with CUDA_ERROR_NOT_INITIALIZED"
        );
    }
    CUDA_ERROR_NOT_INITIALIZED
}

/// Whether a memory limit is configured (or the configuration was refused): without accounting,
/// allocations must then be refused.
pub fn limit_configured() -> bool {
    crate::init::config().map_or(true, |config| config.memory_limit.iter().any(Option::is_some))
}

/// The table's fast path for the synchronisations: a process without pools has nothing to bring
/// up to date there (two loads; nothing that can panic). A forked child that has not attached yet
/// has no pools of its own.
#[inline(always)]
pub fn no_pools() -> bool {
    own().is_none_or(|own| !own.ledger.has_pools())
}

/// `pthread_atfork` child handler: only atomic loads and stores (async-signal-safe). The child
/// builds its own slot and ledger on its first use of accounting; the parent's are left alone.
extern "C" fn forked_child() {
    let parent = OWN.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if !parent.is_null() {
        INHERITED.store(parent, Ordering::Release);
    }
    STARTING.store(false, Ordering::Release);
    ATTACHING.store(false, Ordering::Release);
}

/// At normal exit or unload of the library (`crate::exit`): gives this process's slot back to
/// the region, releasing everything still charged to it. Only a slot attached for this very pid:
/// a forked child that never attached (or charges its parent's slot) leaves the parent's alone.
/// Never calls the driver; the region's lock is waited for at most its usual timeout.
pub fn detach_at_exit() {
    let accounting = ACCOUNTING.load(Ordering::Acquire);
    let (Some(own), false) = (own(), accounting.is_null()) else {
        return;
    };
    let Some(slot) = own
        .slot
        .filter(|slot| i64::from(slot.pid()) == i64::from(std::process::id()))
    else {
        return;
    };
    DETACHED.store(true, Ordering::SeqCst);
    // SAFETY: a non-null pointer came from Box::leak in `start` and is never freed.
    let region = &unsafe { &*accounting }.region;
    if let Err(error) = region.detach(slot) {
        // The slot is reaped later as a dead process's.
        tracing::debug!("exit: {error}; the slot is left to be reaped");
    }
}

/// Opens the region and attaches this process (after the real cuInit succeeded). Idempotent;
/// the error is one line for the log.
pub fn start(config: &Config) -> Result<(), String> {
    // Frameworks call cuInit again and again: once started, no lock.
    if !ACCOUNTING.load(Ordering::Acquire).is_null() {
        return Ok(());
    }
    // Before anything is held: a fork in the middle of starting leaves the child free to start.
    static ATFORK: AtomicBool = AtomicBool::new(false);
    if !ATFORK.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a plain function that only loads and stores atomics; no other effect.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    }
    let _serial = Flag::take(&STARTING);
    if !ACCOUNTING.load(Ordering::Acquire).is_null() {
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
    let own = Own::leak(Some(Box::leak(Box::new(slot))));
    let accounting: &'static Accounting = Box::leak(Box::new(Accounting {
        region,
        devices: entries,
    }));
    // The slot first: whoever sees the accounting sees this process's slot with it.
    OWN.store(std::ptr::from_ref(own).cast_mut(), Ordering::Release);
    ACCOUNTING.store(std::ptr::from_ref(accounting).cast_mut(), Ordering::Release);
    accounting.watch_suspend_flag();
    Ok(())
}

/// Writes now (unix seconds) into the region's `last_kernel_time`, which HAMi's monitor reads:
/// at attach, as HAMi-core does, and from the launches' tick (`throttle::activity`).
pub fn write_kernel_time(region: &Region) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX));
    region.hami().last_kernel_time.store(now, Ordering::Relaxed);
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

impl Accounting {
    /// The shared region, for the compute limiter's bucket and HAMi's control fields.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Points `vgpu-smi suspend`'s flag check at this process's slot.
    fn watch_suspend_flag(&'static self) {
        if let Some(slot) = self
            .slot_index()
            .and_then(|index| self.region.extension().slots.get(index))
        {
            crate::suspend::watch(&slot.suspend);
        }
    }

    /// Index of this process's slot (after a fork, the child's own one).
    pub fn slot_index(&self) -> Option<usize> {
        own().and_then(|own| own.slot).map(Slot::index)
    }

    /// This process's ledger (after a fork, the child's own, empty one).
    pub fn ledger(&self) -> &'static Ledger {
        match own() {
            Some(own) => &own.ledger,
            None => &self.own().ledger,
        }
    }

    /// This process's slot, ledger and queue, attaching a forked child's first.
    fn own(&self) -> &'static Own {
        match own() {
            Some(own) => own,
            None => self.after_fork(),
        }
    }

    pub fn device(&self, ordinal: CUdevice) -> Option<&DeviceEntry> {
        usize::try_from(ordinal).ok().and_then(|index| self.devices.get(index))
    }

    /// The device's memory limit now: the region's (`crate::limits`).
    pub fn limit(&self, device: &DeviceEntry) -> Option<u64> {
        crate::limits::memory(&self.region, device.region_index)
    }

    /// The region device's compute limit now, in percent: the region's (`crate::limits`).
    pub fn sm_limit(&self, region_index: usize) -> Option<u8> {
        crate::limits::sm(&self.region, region_index)
    }

    /// Whether any of this process's devices has a compute limit now.
    pub fn any_sm_limit(&self) -> bool {
        self.devices
            .iter()
            .any(|device| self.sm_limit(device.region_index).is_some())
    }

    pub fn device_by_uuid(&self, uuid: &str) -> Option<&DeviceEntry> {
        self.devices.iter().find(|device| device.uuid == uuid)
    }

    /// Bytes charged on the device by every process of the region.
    pub fn used(&self, device: &DeviceEntry) -> u64 {
        let own = self.own();
        if own.has_pending.load(Ordering::Acquire)
            && let Some(slot) = own.slot
        {
            self.apply_pending(own, slot);
        }
        self.region.device_used(device.region_index)
    }

    /// Marks a data call under way on a region device, in this process's slot, until the guard
    /// drops, so that a context measurement in any process of the region never reads NVML in the
    /// middle of it (a process killed meanwhile takes its marks with its slot).
    pub fn in_flight(&self, region_index: usize) -> InFlight<'_> {
        let slot = self.own().slot;
        if let Some(slot) = slot {
            self.region.memory_call_begins(slot, region_index);
        }
        InFlight {
            region: &self.region,
            slot,
            region_index,
        }
    }

    /// Charges `bytes` against the device's limit. `Err` is the status the application gets:
    /// out of memory when over the limit (or when the region cannot be updated: fail closed).
    pub fn charge(&self, ordinal: CUdevice, kind: MemoryKind, bytes: u64) -> Result<Option<Charge>, CUresult> {
        let Some(device) = self.device(ordinal) else {
            return Ok(None);
        };
        self.charge_with_limit(device, kind, bytes, self.limit(device))
    }

    /// Charges what the driver has already taken (a context, a module, a pool's reserve): never
    /// refused. When the region's lock cannot be taken the charge is queued (see [`Pending`]) and
    /// returned all the same, so that its release later is right.
    pub fn record(&self, ordinal: CUdevice, kind: MemoryKind, bytes: u64) -> Option<Charge> {
        let device = self.device(ordinal)?;
        if DETACHED.load(Ordering::Relaxed) {
            return None;
        }
        let own = self.own();
        let Some(slot) = own.slot else {
            tracing::error!(
                "this forked process has no slot in the region; {bytes} bytes the driver has taken are not accounted"
            );
            return None;
        };
        self.apply_pending(own, slot);
        let charge = Charge {
            region_index: device.region_index,
            kind,
            bytes,
        };
        match self.region_try_charge(slot, device.region_index, kind, bytes, None) {
            Ok(()) => Some(charge),
            Err(ChargeError::Region(error)) if lock_not_taken(&error) => {
                tracing::warn!(
                    "{error}; {bytes} bytes the driver has taken will be charged at the next accounting call"
                );
                self.queue(own, slot, false, &charge);
                Some(charge)
            }
            Err(error) => {
                tracing::error!("{error}; {bytes} bytes the driver has taken are not accounted");
                None
            }
        }
    }

    fn charge_with_limit(
        &self,
        device: &DeviceEntry,
        kind: MemoryKind,
        bytes: u64,
        limit: Option<u64>,
    ) -> Result<Option<Charge>, CUresult> {
        if DETACHED.load(Ordering::Relaxed) {
            tracing::debug!("allocation during exit, after the slot was given back: refused");
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let own = self.own();
        let Some(slot) = own.slot else {
            tracing::error!("this forked process has no slot in the region; allocation refused");
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        self.apply_pending(own, slot);
        match self.region_try_charge(slot, device.region_index, kind, bytes, limit) {
            Ok(()) => Ok(Some(Charge {
                region_index: device.region_index,
                kind,
                bytes,
            })),
            Err(ChargeError::Refused(refused)) => {
                tracing::info!("device {} ({}): {refused}", device.ordinal, device.uuid);
                Err(CUDA_ERROR_OUT_OF_MEMORY)
            }
            Err(ChargeError::Region(error)) => {
                tracing::error!("{error}; allocation refused");
                Err(CUDA_ERROR_OUT_OF_MEMORY)
            }
        }
    }

    /// Releases a charge made by this process. When the region's lock cannot be taken the
    /// release is queued (see [`Pending`]), never dropped.
    pub fn release(&self, charge: Charge) {
        if DETACHED.load(Ordering::Relaxed) {
            return;
        }
        let own = self.own();
        let Some(slot) = own.slot else {
            return;
        };
        self.apply_pending(own, slot);
        match self.region_uncharge(slot, charge.region_index, charge.kind, charge.bytes) {
            Ok(_) => {}
            Err(error) if lock_not_taken(&error) => {
                tracing::warn!(
                    "{error}; {} bytes will be released at the next accounting call",
                    charge.bytes
                );
                self.queue(own, slot, true, &charge);
            }
            Err(error) => tracing::error!("{error}; {} bytes could not be released", charge.bytes),
        }
    }

    /// Queues an update in this process's own queue (a forked child's is its own, never the
    /// parent's), and makes sure a thread retries it.
    fn queue(&self, own: &'static Own, slot: &'static Slot, release: bool, charge: &Charge) {
        let mut pending = own.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        pending.add(release, charge);
        own.has_pending.store(!pending.is_empty(), Ordering::Release);
        drop(pending);
        if !own.retrying.swap(true, Ordering::AcqRel) {
            crate::loaded::keep_loaded();
            let spawned = std::thread::Builder::new()
                .name("vgpu-pending".into())
                .spawn(move || match accounting() {
                    Some(accounting) => accounting.retry_pending(own, slot),
                    None => own.retrying.store(false, Ordering::Release),
                });
            if let Err(error) = spawned {
                own.retrying.store(false, Ordering::Release);
                tracing::warn!("cannot start a thread to retry queued region updates ({error}); the next call will");
            }
        }
    }

    /// The background retry: applies the queue every [`RETRY_INTERVAL`] until it is empty.
    fn retry_pending(&self, own: &Own, slot: &Slot) {
        loop {
            std::thread::sleep(RETRY_INTERVAL);
            // The slot was given back at exit, with everything queued for it.
            if DETACHED.load(Ordering::Relaxed) {
                return;
            }
            self.apply_pending(own, slot);
            if own.has_pending.load(Ordering::Acquire) {
                continue;
            }
            own.retrying.store(false, Ordering::Release);
            // Something queued between the look and the store, whose queuer saw this thread
            // running: take it on again, unless another thread did.
            if !own.has_pending.load(Ordering::Acquire) || own.retrying.swap(true, Ordering::AcqRel) {
                return;
            }
        }
    }

    /// Writes this process's queued charges, then its queued releases, as far as the lock lets
    /// them through (one load when there are none: every charge and release comes here first).
    #[inline]
    fn apply_pending(&self, own: &Own, slot: &Slot) {
        if own.has_pending.load(Ordering::Acquire) {
            self.apply_queue(own, slot);
        }
    }

    #[cold]
    #[inline(never)]
    fn apply_queue(&self, own: &Own, slot: &Slot) {
        if DETACHED.load(Ordering::Relaxed) {
            return;
        }
        let mut pending = own.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        'apply: for release in [false, true] {
            for device in 0..MAX_DEVICES {
                for kind in ALL_KINDS {
                    let table = if release {
                        &mut pending.releases
                    } else {
                        &mut pending.charges
                    };
                    let bytes = table[device][kind_index(kind)];
                    if bytes == 0 {
                        continue;
                    }
                    let result = if release {
                        self.region_uncharge(slot, device, kind, bytes).map(|_| ())
                    } else {
                        self.region_try_charge(slot, device, kind, bytes, None)
                            .map_err(|error| match error {
                                ChargeError::Region(error) => error,
                                // Without a limit only a total past 64 bits is refused.
                                ChargeError::Refused(_) => RegionError::NoSuchDevice {
                                    path: self.region.path().to_owned(),
                                    device,
                                },
                            })
                    };
                    match result {
                        Ok(()) => table[device][kind_index(kind)] = 0,
                        Err(error) if lock_not_taken(&error) => break 'apply,
                        Err(error) => {
                            // After the slot was given back at exit there is nothing left to write.
                            if !DETACHED.load(Ordering::Relaxed) {
                                tracing::error!("{error}; {bytes} queued bytes could not be written");
                            }
                            table[device][kind_index(kind)] = 0;
                        }
                    }
                }
            }
        }
        own.has_pending.store(!pending.is_empty(), Ordering::Release);
    }

    fn region_try_charge(
        &self,
        slot: &Slot,
        device: usize,
        kind: MemoryKind,
        bytes: u64,
        limit: Option<u64>,
    ) -> Result<(), ChargeError> {
        #[cfg(feature = "fault-injection")]
        if fault_injection::lock_times_out() {
            return Err(ChargeError::Region(self.fault_timeout()));
        }
        self.region.try_charge(slot, device, kind, bytes, limit)
    }

    fn region_uncharge(&self, slot: &Slot, device: usize, kind: MemoryKind, bytes: u64) -> Result<u64, RegionError> {
        #[cfg(feature = "fault-injection")]
        if fault_injection::lock_times_out() {
            return Err(self.fault_timeout());
        }
        self.region.uncharge(slot, device, kind, bytes)
    }

    #[cfg(feature = "fault-injection")]
    fn fault_timeout(&self) -> RegionError {
        RegionError::LockTimeout {
            path: self.region.path().to_owned(),
        }
    }

    /// In a forked child, on its first use of accounting: a slot of its own, an empty ledger and
    /// an empty queue (the parent's queued updates are the parent's to write).
    /// One thread attaches; the others wait for it (never on a lock of the parent's).
    #[cold]
    #[inline(never)]
    fn after_fork(&self) -> &'static Own {
        let _attaching = Flag::take(&ATTACHING);
        if let Some(own) = own() {
            return own;
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
                    .and_then(|own| own.slot)
            }
        };
        let own = Own::leak(slot);
        OWN.store(std::ptr::from_ref(own).cast_mut(), Ordering::Release);
        let accounting = ACCOUNTING.load(Ordering::Acquire);
        if !accounting.is_null() {
            // SAFETY: a non-null pointer came from Box::leak in `start` and is never freed.
            unsafe { &*accounting }.watch_suspend_flag();
        }
        own
    }
}

#[cfg(feature = "fault-injection")]
mod fault_injection {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    /// While the file named by `VGPU_FAULT_LOCK_TIMEOUT_FILE` exists, every charge and release
    /// fails as if the region's lock had timed out (without waiting).
    pub fn lock_times_out() -> bool {
        static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
        PATH.get_or_init(|| std::env::var_os("VGPU_FAULT_LOCK_TIMEOUT_FILE").map(PathBuf::from))
            .as_deref()
            .is_some_and(std::path::Path::exists)
    }
}

/// A data call under way (see [`Accounting::in_flight`]).
pub struct InFlight<'a> {
    region: &'a Region,
    slot: Option<&'static Slot>,
    region_index: usize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            self.region.memory_call_done(slot, self.region_index);
        }
    }
}
