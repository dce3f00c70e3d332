//! Charging and releasing device memory in the shared region for this process, on top of the
//! session (the region, the devices, the slot): the process's ledger of what it charged, and the
//! queue of region updates the lock did not let through.

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use vgpu_region::{ChargeError, MAX_DEVICES, MemoryKind, Region, RegionError, Slot};

use super::ledger::{Charge, Ledger};
use super::spill::Spills;
use super::split::Splits;
use super::vmm::Lifetimes;
use crate::session::{self, DeviceEntry, Session};
use crate::sys::cuda::{CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUdevice, CUresult};

/// Memory accounting for one call: the session and this process's own part.
#[derive(Clone, Copy)]
pub struct Accounting {
    session: &'static Session,
    own: &'static Own,
}

/// What belongs to one process: what it has charged, and the region updates it still owes. A
/// forked child gets a new one (the parent's ledger and queue locks may be held by threads the
/// child does not have), so its queue starts empty; the old one is left as it is, never freed.
struct Own {
    /// The session's fork epoch this part belongs to.
    epoch: u64,
    ledger: Ledger,
    /// Region updates the lock did not let through, applied before the next one.
    pending: Mutex<Pending>,
    /// Whether `pending` holds anything (the fast path's one load).
    has_pending: AtomicBool,
    /// Whether a thread retries `pending` in the background (for a process that may never make
    /// another accounting call).
    retrying: AtomicBool,
    /// Allocations served from host memory (`CUDA_OVERSUBSCRIBE`).
    spills: Spills,
    /// VMM allocations split between the device and host memory (`CUDA_OVERSUBSCRIBE`).
    splits: Splits,
    /// VMM allocations retained or mapped.
    vmm: Lifetimes,
}

/// This process's part: the one of the current fork epoch (see [`session::epoch`]).
static OWN: AtomicPtr<Own> = AtomicPtr::new(std::ptr::null_mut());

impl Own {
    /// A process's own part with an empty ledger and an empty queue, leaked (never freed).
    fn leak(epoch: u64) -> &'static Own {
        Box::leak(Box::new(Own {
            epoch,
            ledger: Ledger::default(),
            pending: Mutex::new(Pending::default()),
            has_pending: AtomicBool::new(false),
            retrying: AtomicBool::new(false),
            spills: Spills::default(),
            splits: Splits::default(),
            vmm: Lifetimes::default(),
        }))
    }

    /// This process's part, if it has made one under the current epoch.
    #[inline(always)]
    fn current() -> Option<&'static Own> {
        let own = OWN.load(Ordering::Acquire);
        // SAFETY: a non-null pointer came from Box::leak and is never freed.
        let own = (!own.is_null()).then(|| unsafe { &*own })?;
        (own.epoch == session::epoch()).then_some(own)
    }

    /// This process's part, made on first use (in a forked child: a fresh one). Two threads
    /// racing agree on the first one stored; no lock, so a fork in the middle cannot block.
    fn get() -> &'static Own {
        if let Some(own) = Own::current() {
            return own;
        }
        let epoch = session::epoch();
        let fresh = Own::leak(epoch);
        let seen = OWN.load(Ordering::Acquire);
        match OWN.compare_exchange(
            seen,
            std::ptr::from_ref(fresh).cast_mut(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => fresh,
            // Another thread stored one meanwhile: it is of this epoch (or the next one, after a
            // fork by a third thread, which this thread does not see in the child).
            // SAFETY: a non-null pointer came from Box::leak and is never freed.
            Err(stored) if !stored.is_null() => unsafe { &*stored },
            Err(_) => fresh,
        }
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
    charges: vgpu_region::ChargeTable,
    /// Bytes to release, by region device index and kind.
    releases: vgpu_region::ChargeTable,
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
        let kind = charge.kind.index();
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
    matches!(
        error,
        RegionError::LockTimeout { .. } | RegionError::LockBusy { .. } | RegionError::LockFailed { .. }
    )
}

/// How often queued region updates are retried in the background.
const RETRY_INTERVAL: Duration = Duration::from_millis(100);

/// The process's accounting, once CUDA has initialised the session. In a forked child, the first
/// call attaches the child's slot and starts its own ledger.
#[inline]
pub fn accounting() -> Option<Accounting> {
    let session = session::get()?;
    Some(Accounting {
        session,
        own: Own::get(),
    })
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
    session::config().map_or(true, |config| config.memory_limit.iter().any(Option::is_some))
}

/// The table's fast path for the synchronisations: a process without pools or graph memory has
/// nothing to bring up to date there (three loads; nothing that can panic). A forked child that
/// has not made its own part yet has no pools of its own.
#[inline(always)]
pub fn no_pools() -> bool {
    Own::current().is_none_or(|own| !own.ledger.has_pools())
}

impl Accounting {
    /// The shared region.
    pub fn region(&self) -> &'static Region {
        self.session.region()
    }

    /// This process's ledger (after a fork, the child's own, empty one).
    pub fn ledger(&self) -> &'static Ledger {
        &self.own.ledger
    }

    pub fn device(&self, ordinal: CUdevice) -> Option<&'static DeviceEntry> {
        self.session.device(ordinal)
    }

    /// This process's allocations served from host memory.
    pub fn spills(&self) -> &'static Spills {
        &self.own.spills
    }

    /// This process's VMM allocations split between the device and host memory.
    pub fn splits(&self) -> &'static Splits {
        &self.own.splits
    }

    pub fn vmm(&self) -> &'static Lifetimes {
        &self.own.vmm
    }

    /// This process's slot in the region (none once detached).
    pub fn slot(&self) -> Option<&'static Slot> {
        self.session.slot()
    }

    /// The device of this UUID (as NVML writes it).
    pub fn device_by_uuid(&self, uuid: &str) -> Option<&'static DeviceEntry> {
        self.session.device_by_uuid(uuid)
    }

    /// The device's memory limit now: the region's (`crate::limits`).
    pub fn limit(&self, device: &DeviceEntry) -> Option<u64> {
        self.session.limit(device)
    }

    /// Bytes charged on the device by every process of the region.
    pub fn used(&self, device: &DeviceEntry) -> u64 {
        let own = self.own;
        if own.has_pending.load(Ordering::Acquire)
            && let Some(slot) = self.session.slot()
        {
            let _ = self.apply_pending(own, slot);
        }
        self.region().device_used(device.region_index)
    }

    /// Marks a data call under way on a region device, in this process's slot, until the guard
    /// drops, so that a context measurement in any process of the region never reads NVML in the
    /// middle of it (a process killed meanwhile takes its marks with its slot).
    pub fn in_flight(&self, region_index: usize) -> InFlight {
        let slot = self.session.slot();
        if let Some(slot) = slot {
            self.region().memory_call_begins(slot, region_index);
        }
        InFlight {
            region: self.region(),
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
        if session::detached() {
            return None;
        }
        let own = self.own;
        let Some(slot) = self.session.slot() else {
            tracing::error!(
                "this forked process has no slot in the region; {bytes} bytes the driver has taken are not accounted"
            );
            return None;
        };
        let charge = Charge {
            region_index: device.region_index,
            kind,
            bytes,
        };
        session::keep_region_path_now_and_then(self.session);
        // The queue's lock error stands for this charge too: one wait for the lock per call.
        let charged = match self.apply_pending(own, slot) {
            Ok(()) => self
                .region_for_update()
                .map_err(ChargeError::Region)
                .and_then(|region| region.try_charge(slot, device.region_index, kind, bytes, None)),
            Err(error) => Err(ChargeError::Region(error)),
        };
        match charged {
            Ok(()) => Some(charge),
            Err(ChargeError::Region(error)) if lock_not_taken(&error) => {
                tracing::warn!(
                    "{error}; {bytes} bytes the driver has taken will be charged at the next accounting call"
                );
                self.queue(slot, false, &charge);
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
        if session::detached() {
            tracing::debug!("allocation during exit, after the slot was given back: refused");
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let own = self.own;
        let Some(slot) = self.session.slot() else {
            tracing::error!("this forked process has no slot in the region; allocation refused");
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        session::keep_region_path_now_and_then(self.session);
        let charged = match self.apply_pending(own, slot) {
            Ok(()) => self
                .region_for_update()
                .map_err(ChargeError::Region)
                .and_then(|region| region.try_charge(slot, device.region_index, kind, bytes, limit)),
            Err(error) => Err(ChargeError::Region(error)),
        };
        match charged {
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
        if session::detached() {
            return;
        }
        let own = self.own;
        let Some(slot) = self.session.slot() else {
            return;
        };
        // The region's path is looked after from the calls that charge (and the tick): a release
        // cannot take the container past its limit.
        let released = match self.apply_pending(own, slot) {
            Ok(()) => self
                .region_for_update()
                .and_then(|region| region.uncharge(slot, charge.region_index, charge.kind, charge.bytes)),
            Err(error) => Err(error),
        };
        match released {
            Ok(_) => {}
            Err(error) if lock_not_taken(&error) => {
                tracing::warn!(
                    "{error}; {} bytes will be released at the next accounting call",
                    charge.bytes
                );
                self.queue(slot, true, &charge);
            }
            Err(error) => tracing::error!("{error}; {} bytes could not be released", charge.bytes),
        }
    }

    /// Queues an update in this process's own queue (a forked child's is its own, never the
    /// parent's), and makes sure a thread retries it.
    fn queue(self, slot: &'static Slot, release: bool, charge: &Charge) {
        let own = self.own;
        let mut pending = own.pending.lock();
        pending.add(release, charge);
        own.has_pending.store(!pending.is_empty(), Ordering::Release);
        drop(pending);
        if !own.retrying.swap(true, Ordering::AcqRel) {
            crate::loaded::keep_loaded();
            let spawned = std::thread::Builder::new()
                .name("vgpu-pending".into())
                .spawn(move || self.retry_pending(slot));
            if let Err(error) = spawned {
                own.retrying.store(false, Ordering::Release);
                tracing::warn!("cannot start a thread to retry queued region updates ({error}); the next call will");
            }
        }
    }

    /// The background retry: applies the queue every [`RETRY_INTERVAL`] until it is empty.
    fn retry_pending(self, slot: &Slot) {
        let own = self.own;
        loop {
            std::thread::sleep(RETRY_INTERVAL);
            // The slot was given back at exit, with everything queued for it.
            if session::detached() {
                return;
            }
            let _ = self.apply_pending(own, slot);
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
    /// The lock error that stopped it, if one did: the caller's own update would wait for the
    /// same lock again, so it takes that answer instead (one wait of at most the lock's timeout
    /// per call). While another thread writes the queue this one does not wait for it.
    #[inline]
    fn apply_pending(&self, own: &Own, slot: &Slot) -> Result<(), RegionError> {
        if own.has_pending.load(Ordering::Acquire) {
            self.apply_queue(own, slot)
        } else {
            Ok(())
        }
    }

    #[cold]
    #[inline(never)]
    fn apply_queue(&self, own: &Own, slot: &Slot) -> Result<(), RegionError> {
        if session::detached() {
            return Ok(());
        }
        let Some(mut pending) = own.pending.try_lock() else {
            return Ok(());
        };
        let mut stopped = None;
        'apply: for release in [false, true] {
            for device in 0..MAX_DEVICES {
                for kind in MemoryKind::ALL {
                    let table = if release {
                        &mut pending.releases
                    } else {
                        &mut pending.charges
                    };
                    let bytes = table[device][kind.index()];
                    if bytes == 0 {
                        continue;
                    }
                    let result = if release {
                        self.region_for_update()
                            .and_then(|region| region.uncharge(slot, device, kind, bytes))
                            .map(|_| ())
                    } else {
                        self.region_for_update()
                            .map_err(ChargeError::Region)
                            .and_then(|region| region.try_charge(slot, device, kind, bytes, None))
                            .map_err(|error| match error {
                                ChargeError::Region(error) => error,
                                // Without a limit only a total past 64 bits is refused.
                                ChargeError::Refused(_) => RegionError::NoSuchDevice {
                                    path: self.region().path().to_owned(),
                                    device,
                                },
                            })
                    };
                    match result {
                        Ok(()) => table[device][kind.index()] = 0,
                        Err(error) if lock_not_taken(&error) => {
                            stopped = Some(error);
                            break 'apply;
                        }
                        Err(error) => {
                            // After the slot was given back at exit there is nothing left to write.
                            if !session::detached() {
                                tracing::error!("{error}; {bytes} queued bytes could not be written");
                            }
                            table[device][kind.index()] = 0;
                        }
                    }
                }
            }
        }
        own.has_pending.store(!pending.is_empty(), Ordering::Release);
        stopped.map_or(Ok(()), Err)
    }

    /// The region for an update, or (the debug build's fault injection) the error of a lock that
    /// timed out.
    fn region_for_update(&self) -> Result<&'static Region, RegionError> {
        #[cfg(fault_injection)]
        if fault_injection::lock_times_out() {
            return Err(RegionError::LockTimeout {
                path: self.region().path().to_owned(),
            });
        }
        Ok(self.region())
    }

    /// What this process holds by its own account; `None` while updates wait in its queue (the
    /// slot and the ledger differ by them, rightly).
    pub(super) fn held(&self) -> Option<vgpu_region::ChargeTable> {
        if self.own.has_pending.load(Ordering::Acquire) {
            return None;
        }
        Some(self.own.ledger.held())
    }
}

#[cfg(fault_injection)]
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
pub struct InFlight {
    region: &'static Region,
    slot: Option<&'static Slot>,
    region_index: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            self.region.memory_call_done(slot, self.region_index);
        }
    }
}
