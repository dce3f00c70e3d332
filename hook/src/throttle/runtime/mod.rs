//! The limited path: the process's limiter state, made on the first limited launch and shared by
//! [`admission`] (a launch against the shared bucket, HAMi's controls) and [`poller`] (the
//! background thread that turns measurements into corrections and publishes the process's
//! utilisation).
//!
//! The state lives in one leaked allocation reached through an atomic pointer, made in one
//! session fork epoch ([`crate::session::epoch`]). A forked child finds the parent's state of an
//! older epoch: the parent's locks may be held by threads the child does not have, and its
//! background thread is gone, so the child builds fresh state on its first limited launch.

pub(super) mod admission;
pub(super) mod poller;

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use vgpu_config::{Config, UtilizationPolicy};
use vgpu_region::{ComputeDevice, MAX_DEVICES};

use super::estimates::Estimates;
use super::sensor::Sensor;
use super::{FACTOR_UNIT, MODE, Mode, activity, bucket};
use crate::sys::cuda::{CUDA_ERROR_NOT_INITIALIZED, CUresult, CUstream};

pub use admission::{after, before};

static RUNTIME: AtomicPtr<Runtime> = AtomicPtr::new(std::ptr::null_mut());
/// Set at process exit: the background thread stops calling the driver, launches stop waiting.
static SHUTDOWN: AtomicBool = AtomicBool::new(false);
/// True while the background thread is inside the driver.
static POLLER_IN_DRIVER: AtomicBool = AtomicBool::new(false);

/// The process's limiter.
pub struct Runtime {
    /// The session's fork epoch it was made in: a forked child makes its own.
    epoch: u64,
    config: &'static Config,
    /// Per region device index: each device's budget, sensor and estimates stand alone, so
    /// threads driving different GPUs never wait on each other.
    devices: [Device; MAX_DEVICES],
    poller: Once,
}

/// The limiter's state for one device.
struct Device {
    estimates: Mutex<Estimates>,
    sensor: Sensor,
    /// GPU time charged by this process (estimates plus corrections), for the utilisation it
    /// publishes.
    charged: AtomicI64,
    /// The correction's factor, in thousandths ([`super::correction`]).
    correction: AtomicU32,
    /// Launches admitted by this process.
    launches: AtomicU64,
    /// How much of `charged` (its i64 bits) and of `launches` has been added to the region's
    /// counters: atomics, so that the background thread and the exit handler can both flush
    /// ([`Runtime::flush`]).
    flushed_charged: AtomicU64,
    flushed_launches: AtomicU64,
    touched: AtomicBool,
}

impl Default for Device {
    fn default() -> Device {
        Device {
            estimates: Mutex::new(Estimates::default()),
            sensor: Sensor::default(),
            charged: AtomicI64::new(0),
            correction: AtomicU32::new(FACTOR_UNIT),
            launches: AtomicU64::new(0),
            flushed_charged: AtomicU64::new(0),
            flushed_launches: AtomicU64::new(0),
            touched: AtomicBool::new(false),
        }
    }
}

impl Device {
    fn estimates(&self) -> parking_lot::MutexGuard<'_, Estimates> {
        self.estimates.lock()
    }

    fn touched(&self) -> bool {
        self.touched.load(Ordering::Relaxed)
    }
}

extern "C" fn at_exit() {
    SHUTDOWN.store(true, Ordering::SeqCst);
    let runtime = RUNTIME.load(Ordering::Acquire);
    if !runtime.is_null() {
        // SAFETY: from Box::into_raw, never freed.
        let runtime = unsafe { &*runtime };
        for device in &runtime.devices {
            device.sensor.release_all_holds();
        }
        // What the process charged since the background thread's last flush would be lost to
        // the region's counters (monitors read them). A forked child's copy of its parent's
        // limiter is the parent's to flush.
        if runtime.epoch == crate::session::epoch() {
            runtime.flush();
        }
    }
    // Let a driver call of the background thread finish before the driver tears down (bounded).
    for _ in 0..50 {
        if !POLLER_IN_DRIVER.load(Ordering::SeqCst) {
            return;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// Decides once whether anything is limited; `Ok(None)` when launches go straight to the driver,
/// `Err` when a limited launch must be refused (no region to limit it with).
fn runtime() -> Result<Option<&'static Runtime>, CUresult> {
    let existing = RUNTIME.load(Ordering::Acquire);
    // SAFETY: the pointer comes from Box::into_raw in `create` and is never freed.
    if let Some(runtime) = (!existing.is_null()).then(|| unsafe { &*existing })
        && runtime.epoch == crate::session::epoch()
    {
        return Ok(Some(runtime));
    }
    create(existing)
}

/// Builds this process's limiter in place of `stale` (null, or a parent's before a fork).
#[cold]
fn create(stale: *mut Runtime) -> Result<Option<&'static Runtime>, CUresult> {
    // The process's first launch comes here, limited or not.
    activity::ensure_tick();
    if matches!(MODE.load(), Mode::Off | Mode::Idle) {
        return Ok(None);
    }
    let Ok(config) = crate::session::config() else {
        // cuInit refuses a malformed configuration before the driver is initialised, so no
        // launch can succeed anyway.
        MODE.store(Mode::Off);
        return Ok(None);
    };
    if config.utilization_policy == UtilizationPolicy::Disable {
        MODE.store(Mode::Off);
        return Ok(None);
    }
    // The limits are the region's, live (`crate::limits`); without a region, the variables say
    // whether a launch must be refused. A tick that turns the mode on meanwhile sees the limit
    // again within its period.
    let limited = match crate::session::get() {
        Some(session) => session.any_sm_limit(),
        None if config.sm_limit.iter().any(Option::is_some) => return without_region(config),
        None => false,
    };
    if !limited {
        MODE.store(Mode::Off);
        return Ok(None);
    }
    let fresh = Box::into_raw(Box::new(Runtime {
        epoch: crate::session::epoch(),
        config,
        devices: std::array::from_fn(|_| Device::default()),
        poller: Once::new(),
    }));
    // No lock (a forked child could inherit it held): the first pointer stored wins.
    let winner = match RUNTIME.compare_exchange(stale, fresh, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => fresh,
        Err(other) => {
            // SAFETY: `fresh` was never shared; it came from Box::into_raw just above.
            drop(unsafe { Box::from_raw(fresh) });
            other
        }
    };
    MODE.turn(Mode::Undecided, Mode::On);
    // SAFETY: from Box::into_raw (ours or the winner's), never freed.
    Ok(Some(unsafe { &*winner }))
}

/// The tick (`activity`): follows the region's compute limits in a process whose launches are not
/// limited now (turned on within the tick's period when a limit appears, so an unlimited process
/// starts limiting) and turns the limiter off when none is left (its launches go back to the fast
/// path). `GPU_CORE_UTILIZATION_POLICY=disable` never limits.
pub fn follow_live_limits(session: &'static crate::session::Session) {
    let Ok(config) = crate::session::config() else {
        return;
    };
    if config.utilization_policy == UtilizationPolicy::Disable {
        return;
    }
    let limited = session.any_sm_limit();
    let mode = MODE.load();
    if limited && matches!(mode, Mode::Off | Mode::Idle) {
        if MODE.turn(mode, Mode::On) && mode == Mode::Off {
            // Off stood for a launch since the tick last wrote last_kernel_time.
            activity::note_launch();
        }
    } else if !limited && mode == Mode::On {
        // Idle: the next launch goes back to the fast path, and shows the tick it happened.
        MODE.turn(Mode::On, Mode::Idle);
    }
}

/// A launch while a compute limit is configured but the process has no region: `cuInit` has not
/// succeeded here (the region could not be used, or `cuInit` failed or was never called; the
/// first two leave the real driver initialised). The limit's budget lives in the region, so the
/// launch cannot be limited, and no launch runs unlimited under the limit's name: it is refused
/// with `CUDA_ERROR_NOT_INITIALIZED` (what `cuInit` said; fail closed), unless it goes to a device
/// without a limit. Whatever `GPU_CORE_UTILIZATION_POLICY` says short of `disable`: the
/// region's switch cannot be read.
#[cold]
fn without_region(config: &Config) -> Result<Option<&'static Runtime>, CUresult> {
    let ordinal = crate::session::current_ordinal().and_then(|ordinal| usize::try_from(ordinal).ok());
    if ordinal.is_some_and(|ordinal| config.sm_limit_of(ordinal).is_none()) {
        return Ok(None);
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::error!(
            "the compute limit has no shared region to work with (cuInit did not succeed): every launch on a limited \
             device is refused with CUDA_ERROR_NOT_INITIALIZED"
        );
    }
    Err(CUDA_ERROR_NOT_INITIALIZED)
}

/// Held (shared) while a sample records probe events on other threads' streams, and (exclusive)
/// while a stream is forgotten before its destruction: no probe is recorded on a destroyed stream.
static PROBING: parking_lot::RwLock<()> = parking_lot::RwLock::new(());

/// Shared hold of [`PROBING`] for recording probes; `None` while a stream is being destroyed.
pub(super) fn probing() -> Option<parking_lot::RwLockReadGuard<'static, ()>> {
    PROBING.try_read()
}

/// Forgets `stream` on every device of this process's limiter, then destroys it (`call`).
pub fn forget_stream(stream: CUstream, call: impl FnOnce() -> CUresult) -> CUresult {
    let existing = RUNTIME.load(Ordering::Acquire);
    if !existing.is_null() {
        // Bounded: a forked child may inherit the lock held by a thread it does not have.
        let _exclusive = PROBING.try_write_for(Duration::from_millis(100));
        // SAFETY: from Box::into_raw in `create`, never freed.
        let runtime = unsafe { &*existing };
        for device in &runtime.devices {
            device.sensor.forget_stream(stream);
        }
    }
    call()
}

/// Adds a signed amount to a counter (a correction lowers it) without wrapping below zero.
fn add_signed(counter: &AtomicU64, delta: i64) {
    if delta >= 0 {
        counter.fetch_add(delta as u64, Ordering::Relaxed);
    } else {
        let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |value| {
            Some(value.saturating_sub(delta.unsigned_abs()))
        });
    }
}

impl Runtime {
    /// Adds `delta` ns of GPU time to what this process has taken from `bucket`.
    fn charge(&self, bucket: &ComputeDevice, region_index: usize, delta: i64) {
        bucket::add(bucket, -delta);
        if let Some(device) = self.devices.get(region_index) {
            device.charged.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// What a measured or planned time is charged, in thousandths of it: the correction's factor
    /// times the share of the brackets in which the container's kernels overlap on the GPU
    /// ([`super::overlap`]).
    fn factor(&self, region_index: usize) -> u64 {
        let unit = u64::from(FACTOR_UNIT);
        self.devices.get(region_index).map_or(unit, |device| {
            u64::from(device.correction.load(Ordering::Relaxed)) * device.sensor.overlap_permille() / unit
        })
    }

    /// `ns` of GPU time as the sensor measures it, as charged: times the device's factor.
    fn scaled(&self, region_index: usize, ns: i64) -> i64 {
        // Saturating in i64: a charge is at most the debt floor (2 s) times a factor of about 1,
        // far inside it; no 128-bit division on every launch.
        let factor = i64::try_from(self.factor(region_index)).unwrap_or(i64::MAX);
        ns.saturating_mul(factor) / i64::from(FACTOR_UNIT)
    }
}
