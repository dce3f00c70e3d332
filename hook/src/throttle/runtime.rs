//! The limited path: the process's limiter state, admission of a launch against the shared
//! bucket, HAMi's controls, and the background thread that turns measurements into corrections
//! and publishes the process's utilisation.
//!
//! The state lives in one leaked allocation reached through an atomic pointer. A forked child
//! clears the pointer (its `pthread_atfork` handler only stores an atomic): the parent's locks
//! may be held by threads the child does not have, and its background thread is gone, so the
//! child builds fresh state on its first limited launch.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use std::time::Duration;

use vgpu_region::{ComputeDevice, MAX_DEVICES, SharedRegion};

use super::boost;
use super::crosscheck::{self, CrossCheck, Report};
use super::estimates::Estimates;
use super::sensor::{InFlight, SampleInfo, Sensor};
use super::{IDLE, MODE, OFF, ON, Stream, UNDECIDED, activity, bucket, now_ns};
use crate::config::{Config, UtilizationPolicy};
use crate::hooks::real;
use crate::sys::cuda::{
    CU_STREAM_CAPTURE_STATUS_NONE, CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS, CUdevice, CUresult, CUstream,
    CUstreamCaptureStatus,
};

/// Shortest sleep of a waiting launch: below this, sleeping costs more than it saves, and the
/// budget that builds up meanwhile lets several small launches through at once.
const MIN_WAIT_NS: u64 = 100_000;
/// Longest sleep before the controls (switch, `recent_kernel`) are looked at again.
const MAX_WAIT_NS: u64 = 10_000_000;
/// Poll period of a launch held by `recent_kernel` = -1.
const BLOCKED_POLL_NS: u64 = 10_000_000;
/// The background thread's period while samples are in flight, and while none are.
const POLL_BUSY: Duration = Duration::from_millis(1);
const POLL_IDLE: Duration = Duration::from_millis(20);
/// How often the process's utilisation is published, and over how many periods it is averaged
/// (4 x 250 ms: the last second).
const PUBLISH_PERIOD_NS: u64 = 250_000_000;
const PUBLISH_WINDOW: usize = 4;
/// How often NVML is read: the measured share is compared with its utilisation ([`crosscheck`])
/// and the boost factor follows its power readings ([`boost`]).
const NVML_PERIOD_NS: u64 = 1_000_000_000;
/// For this long after the poller starts, NVML is read every [`START_NVML_PERIOD_NS`] and the
/// boost factor takes each reading whole: the factor follows the power as it ramps up, so a
/// power-hungry job is not run ahead of its share for its whole first second.
const START_PHASE_NS: u64 = 1_500_000_000;
const START_NVML_PERIOD_NS: u64 = 250_000_000;
/// The boost factor's unit: it is kept in thousandths.
const BOOST_UNIT: u32 = 1000;
/// HAMi-core writes this into `recent_kernel` at each limited launch; HAMi's monitor counts it
/// down to tell active containers from idle ones.
const RECENT_KERNEL_ACTIVE: i32 = 2;

static RUNTIME: AtomicPtr<Runtime> = AtomicPtr::new(std::ptr::null_mut());
/// Set at process exit: the background thread stops calling the driver, launches stop waiting.
static SHUTDOWN: AtomicBool = AtomicBool::new(false);
/// True while the background thread is inside the driver.
static POLLER_IN_DRIVER: AtomicBool = AtomicBool::new(false);

/// The process's limiter.
pub struct Runtime {
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
    /// The boost compensation factor, in thousandths ([`boost`]).
    boost: AtomicU32,
    /// Launches admitted by this process.
    launches: AtomicU64,
    touched: AtomicBool,
}

impl Default for Device {
    fn default() -> Device {
        Device {
            estimates: Mutex::new(Estimates::default()),
            sensor: Sensor::default(),
            charged: AtomicI64::new(0),
            boost: AtomicU32::new(BOOST_UNIT),
            launches: AtomicU64::new(0),
            touched: AtomicBool::new(false),
        }
    }
}

impl Device {
    fn estimates(&self) -> std::sync::MutexGuard<'_, Estimates> {
        self.estimates.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn touched(&self) -> bool {
        self.touched.load(Ordering::Relaxed)
    }
}

extern "C" fn forked_child() {
    RUNTIME.store(std::ptr::null_mut(), Ordering::Relaxed);
}

extern "C" fn at_exit() {
    SHUTDOWN.store(true, Ordering::SeqCst);
    let runtime = RUNTIME.load(Ordering::Acquire);
    if !runtime.is_null() {
        // SAFETY: from Box::into_raw, never freed.
        for device in &unsafe { &*runtime }.devices {
            device.sensor.release_all_holds();
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
    if !existing.is_null() {
        // SAFETY: the pointer comes from Box::into_raw in `create` and is never freed.
        return Ok(Some(unsafe { &*existing }));
    }
    create()
}

#[cold]
fn create() -> Result<Option<&'static Runtime>, CUresult> {
    // The process's first launch comes here, limited or not.
    activity::ensure_tick();
    if matches!(MODE.load(Ordering::Relaxed), OFF | IDLE) {
        return Ok(None);
    }
    let Ok(config) = crate::init::config() else {
        // cuInit refuses a malformed configuration before the driver is initialised, so no
        // launch can succeed anyway.
        MODE.store(OFF, Ordering::Relaxed);
        return Ok(None);
    };
    if config.utilization_policy == UtilizationPolicy::Disable {
        MODE.store(OFF, Ordering::Relaxed);
        return Ok(None);
    }
    // The limits are the region's, live (`crate::limits`); without a region, the variables say
    // whether a launch must be refused. A tick that turns the mode on meanwhile sees the limit
    // again within its period.
    let limited = match crate::memory::accounting() {
        Some(accounting) => accounting.any_sm_limit(),
        None if config.sm_limit.iter().any(Option::is_some) => return without_region(config),
        None => false,
    };
    if !limited {
        MODE.store(OFF, Ordering::Relaxed);
        return Ok(None);
    }
    let fresh = Box::into_raw(Box::new(Runtime {
        config,
        devices: std::array::from_fn(|_| Device::default()),
        poller: Once::new(),
    }));
    // No lock (a forked child could inherit it held): the first pointer stored wins.
    let winner = match RUNTIME.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => fresh,
        Err(other) => {
            // SAFETY: `fresh` was never shared; it came from Box::into_raw just above.
            drop(unsafe { Box::from_raw(fresh) });
            other
        }
    };
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // SAFETY: registers plain functions; the child handler only stores an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    });
    let _ = MODE.compare_exchange(UNDECIDED, ON, Ordering::Relaxed, Ordering::Relaxed);
    // SAFETY: from Box::into_raw (ours or the winner's), never freed.
    Ok(Some(unsafe { &*winner }))
}

/// The tick (`activity`): follows the region's compute limits in a process whose launches are not
/// limited now (turned on within the tick's period when a limit appears, so an unlimited process
/// starts limiting) and turns the limiter off when none is left (its launches go back to the fast
/// path). `GPU_CORE_UTILIZATION_POLICY=disable` never limits.
pub fn follow_live_limits(accounting: &crate::memory::Accounting) {
    let Ok(config) = crate::init::config() else {
        return;
    };
    if config.utilization_policy == UtilizationPolicy::Disable {
        return;
    }
    let limited = accounting.any_sm_limit();
    let mode = MODE.load(Ordering::Relaxed);
    if limited && matches!(mode, OFF | IDLE) {
        let turned = MODE.compare_exchange(mode, ON, Ordering::Relaxed, Ordering::Relaxed);
        if turned.is_ok() && mode == OFF {
            // OFF stood for a launch since the tick last wrote last_kernel_time.
            activity::note_launch();
        }
    } else if !limited && mode == ON {
        // IDLE: the next launch goes back to the fast path, and shows the tick it happened.
        let _ = MODE.compare_exchange(ON, IDLE, Ordering::Relaxed, Ordering::Relaxed);
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
    let ordinal = crate::memory::current_ordinal().and_then(|ordinal| usize::try_from(ordinal).ok());
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

/// The background thread's own state between periods.
struct PollState {
    history: [[(u64, i64); PUBLISH_WINDOW]; MAX_DEVICES],
    flushed: [(i64, u64); MAX_DEVICES],
    last_publish: u64,
    publications: usize,
    cross_check: CrossCheck,
    /// When the poller started (the process's first limited launch).
    started: u64,
    last_nvml: u64,
    /// Per region device index: when the boost factor last followed a reading, the region's busy
    /// time then, and how many readings it has followed.
    busy_seen: [(u64, u64, u32); MAX_DEVICES],
    /// A step has panicked (said once).
    panicked: bool,
}

impl PollState {
    fn new() -> PollState {
        let now = now_ns();
        PollState {
            history: [[(0, 0); PUBLISH_WINDOW]; MAX_DEVICES],
            flushed: [(0, 0); MAX_DEVICES],
            last_publish: now,
            publications: 0,
            cross_check: CrossCheck::default(),
            started: now,
            last_nvml: now,
            // From the poller's start (the process's first limited launch), so that the first
            // reading already sets the factor.
            busy_seen: std::array::from_fn(|index| {
                let busy = crate::memory::accounting()
                    .and_then(|accounting| accounting.region().extension().compute.get(index))
                    .map_or(0, |compute| compute.busy_ns.load(Ordering::Relaxed));
                (now, busy, 0)
            }),
            panicked: false,
        }
    }
}

/// What the limited path decided before a launch, finished by [`after`].
pub struct Ticket {
    runtime: &'static Runtime,
    key: u64,
    /// What the estimates planned (GPU time at the clock the kernels run at).
    planned: u64,
    /// What the bucket was charged (the plan times the boost factor).
    charge: u64,
    region_index: usize,
    /// The limiter planned to measure this launch.
    planned_sample: bool,
    sample: Option<InFlight>,
}

/// Before a launch on the limited path: waits for budget, charges, and starts a sample. `Ok(None)`
/// when the launch is not limited (then nothing is to be done after it); `Err` is the status of a
/// launch that must not run (a limit without a region: [`without_region`]).
#[inline(never)]
pub fn before(stream: Stream, key: u64, measurable: bool) -> Result<Option<Ticket>, CUresult> {
    if activity::launched() || SHUTDOWN.load(Ordering::Relaxed) {
        return Ok(None);
    }
    Ok(runtime()?.and_then(|runtime| runtime.before(stream.handle(), key, measurable)))
}

/// After the launch: ends the sample, refunds a launch the driver refused.
#[inline(never)]
pub fn after(ticket: Option<Ticket>, status: CUresult) {
    if let Some(ticket) = ticket {
        ticket.runtime.after(ticket, status);
    }
}

/// Whether `stream` is being captured (or cannot be asked): such launches do not run now.
fn capturing(stream: CUstream) -> bool {
    let Some(is_capturing) = real::cuStreamIsCapturing() else {
        return false;
    };
    let mut status: CUstreamCaptureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the application's stream and a valid out-pointer.
    let result = unsafe { is_capturing(stream, &mut status) };
    // An error means the launch itself will fail (an invalid stream, or the legacy stream during
    // a capture): nothing to gate.
    result != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE
}

fn sleep_ns(ns: u64) {
    std::thread::sleep(Duration::from_nanos(ns));
}

/// Adds a signed amount to a monotonic counter without wrapping below zero.
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
    /// Whether the limit applies now: HAMi's monitor turns `utilization_switch` on while the GPU
    /// is really shared, unless the policy overrides it.
    fn active(&self, hami: &SharedRegion) -> bool {
        match self.config.utilization_policy {
            UtilizationPolicy::Force => true,
            UtilizationPolicy::Disable => false,
            UtilizationPolicy::FollowRegion => hami.utilization_switch.load(Ordering::Relaxed) == 1,
        }
    }

    fn before(&'static self, stream: CUstream, key: u64, measurable: bool) -> Option<Ticket> {
        let accounting = crate::memory::accounting()?;
        // With one device (the common case) every launch goes there: no need to ask the driver.
        let ordinal = if accounting.device(1).is_none() {
            0
        } else {
            crate::memory::current_ordinal()?
        };
        let region_index = accounting.device(ordinal)?.region_index;
        let limit = accounting.sm_limit(region_index)?;
        let region = accounting.region();
        let hami = region.hami();
        let bucket = region.extension().compute.get(region_index)?;
        let device = self.devices.get(region_index)?;
        if !self.active(hami) {
            return None;
        }
        self.start_poller();

        let now = now_ns();
        let plan = device.estimates().plan(key, now);
        let charge = self.boosted(region_index, plan.charge as i64) as u64;
        // A launch into a stream being captured does not run now: it must neither wait nor be
        // measured (an event recorded there would join the graph). Asking the driver costs about
        // as much as the rest of this path, so it is asked only when the launch would wait or be
        // measured; one that passes at once is charged like any other (at most one burst's worth
        // while a capture lasts).
        let first = if hami.recent_kernel.load(Ordering::Relaxed) < 0 {
            Err(BLOCKED_POLL_NS)
        } else {
            bucket::try_take(bucket, now, limit, charge)
        };
        let (waited, checked) = match first {
            Ok(()) => (0, false),
            Err(wait) => {
                // None from admit: the limit was lifted while the launch waited.
                let admitted = if capturing(stream) {
                    None
                } else {
                    self.admit(accounting, region_index, charge, wait, now)
                };
                let Some(waited) = admitted else {
                    device.estimates().forget(key, plan);
                    return None;
                };
                (waited, true)
            }
        };
        self.account(hami, bucket, region_index, charge as i64, waited);
        let sample = if plan.sample && measurable {
            if !checked && capturing(stream) {
                self.charge(bucket, region_index, -(charge as i64));
                device.estimates().forget(key, plan);
                return None;
            }
            let info = SampleInfo {
                key,
                charged: plan.charge,
                region_index,
            };
            device.sensor.begin(stream, info)
        } else {
            None
        };
        Some(Ticket {
            runtime: self,
            key,
            planned: plan.charge,
            charge,
            region_index,
            planned_sample: plan.sample,
            sample,
        })
    }

    fn after(&self, ticket: Ticket, status: CUresult) {
        let Some(device) = self.devices.get(ticket.region_index) else {
            return;
        };
        let measured = ticket.sample.is_some_and(|sample| device.sensor.end(sample, status));
        if ticket.planned_sample && !measured {
            device.estimates().not_measured(ticket.key, ticket.planned);
        }
        if status != CUDA_SUCCESS {
            // A launch the driver refused takes no GPU time.
            if let Some(accounting) = crate::memory::accounting()
                && let Some(bucket) = accounting.region().extension().compute.get(ticket.region_index)
            {
                self.charge(bucket, ticket.region_index, -(ticket.charge as i64));
            }
        }
    }

    /// Sleeps (`wait` ns first) until the bucket admits `cost` and `recent_kernel` allows launches.
    /// Returns the time waited since `since`, or `None` when the limit was lifted meanwhile
    /// (nothing charged). The limit is the region's, read again at each wake-up.
    fn admit(
        &self,
        accounting: &crate::memory::Accounting,
        region_index: usize,
        cost: u64,
        mut wait: u64,
        since: u64,
    ) -> Option<u64> {
        let hami = accounting.region().hami();
        let bucket = accounting.region().extension().compute.get(region_index)?;
        loop {
            sleep_ns(wait.clamp(MIN_WAIT_NS, MAX_WAIT_NS));
            if SHUTDOWN.load(Ordering::Relaxed) || !self.active(hami) {
                return None;
            }
            let limit = accounting.sm_limit(region_index)?;
            let now = now_ns();
            wait = if hami.recent_kernel.load(Ordering::Relaxed) < 0 {
                // HAMi's monitor holds this container while a higher-priority one runs.
                BLOCKED_POLL_NS
            } else {
                match bucket::try_take(bucket, now, limit, cost) {
                    Ok(()) => return Some(now.saturating_sub(since)),
                    Err(wait) => wait,
                }
            };
        }
    }

    /// Records an admitted launch: this process's counters (the background thread adds them to
    /// the region's), the wait, HAMi's `recent_kernel` (`last_kernel_time` is every launch's:
    /// `activity`).
    fn account(&self, hami: &SharedRegion, bucket: &ComputeDevice, region_index: usize, charge: i64, waited: u64) {
        if waited > 0 {
            bucket.wait_ns.fetch_add(waited, Ordering::Relaxed);
        }
        if let Some(device) = self.devices.get(region_index) {
            device.charged.fetch_add(charge, Ordering::Relaxed);
            device.launches.fetch_add(1, Ordering::Relaxed);
            if !device.touched() {
                device.touched.store(true, Ordering::Relaxed);
            }
        }
        let recent = hami.recent_kernel.load(Ordering::Relaxed);
        if recent >= 0 && recent != RECENT_KERNEL_ACTIVE {
            // Only over the value read: a -1 the monitor writes meanwhile must stand.
            let _ =
                hami.recent_kernel
                    .compare_exchange(recent, RECENT_KERNEL_ACTIVE, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// Adds `delta` ns of GPU time to what this process has taken from `bucket`.
    fn charge(&self, bucket: &ComputeDevice, region_index: usize, delta: i64) {
        bucket::add(bucket, -delta);
        if let Some(device) = self.devices.get(region_index) {
            device.charged.fetch_add(delta, Ordering::Relaxed);
        }
    }

    fn start_poller(&'static self) {
        self.poller.call_once(|| {
            static AT_EXIT: Once = Once::new();
            AT_EXIT.call_once(|| {
                // SAFETY: registers a plain function that stores atomics and sleeps briefly.
                unsafe { libc::atexit(at_exit) };
            });
            crate::loaded::keep_loaded();
            let spawned = std::thread::Builder::new()
                .name("vgpu-limiter".into())
                .spawn(move || self.poll_loop());
            if let Err(error) = spawned {
                tracing::error!(
                    "cannot start the compute limiter's thread ({error}); launches are charged estimates only"
                );
            }
        });
    }

    fn poll_loop(&'static self) {
        super::sensor::relax_capture_mode();
        let mut state = PollState::new();
        loop {
            let outstanding = self
                .devices
                .iter()
                .map(|device| device.sensor.outstanding())
                .sum::<usize>();
            std::thread::sleep(if outstanding > 0 { POLL_BUSY } else { POLL_IDLE });
            if !std::ptr::eq(RUNTIME.load(Ordering::Acquire), self) {
                return;
            }
            // A panic here must not end the limiter silently: the step is skipped, said once.
            let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.poll_once(&mut state)));
            POLLER_IN_DRIVER.store(false, Ordering::SeqCst);
            match step {
                Ok(true) => {}
                Ok(false) => return,
                Err(_) => {
                    if !std::mem::replace(&mut state.panicked, true) {
                        tracing::error!("compute limiter: a background step failed; skipping it");
                    }
                }
            }
        }
    }

    /// One period of the background thread: collects measurements, corrects and flushes the
    /// charges, publishes the utilisation, and once a second reads NVML. False at exit.
    fn poll_once(&self, state: &mut PollState) -> bool {
        if SHUTDOWN.load(Ordering::SeqCst) {
            return false;
        }
        for device in self.devices.iter().filter(|device| device.touched()) {
            POLLER_IN_DRIVER.store(true, Ordering::SeqCst);
            if SHUTDOWN.load(Ordering::SeqCst) {
                return false;
            }
            let completed = device.sensor.completed();
            POLLER_IN_DRIVER.store(false, Ordering::SeqCst);
            device.sensor.release_stale_holds(now_ns());
            for (info, measured) in completed {
                self.correct(device, info, measured);
            }
        }
        self.flush(&mut state.flushed);
        let now = now_ns();
        if now.saturating_sub(state.last_publish) >= PUBLISH_PERIOD_NS {
            state.last_publish = now;
            self.publish(&mut state.history, state.publications % PUBLISH_WINDOW, now);
            state.publications += 1;
        }
        let starting = now.saturating_sub(state.started) < START_PHASE_NS;
        let period = if starting { START_NVML_PERIOD_NS } else { NVML_PERIOD_NS };
        if now.saturating_sub(state.last_nvml) >= period {
            state.last_nvml = now;
            self.nvml_step(state, now, starting);
        }
        true
    }

    /// Reads NVML for each device in use: the boost factor follows its power, and its utilisation
    /// cross-checks the sensor. Marked as inside the driver, and stopped at exit between devices.
    fn nvml_step(&self, state: &mut PollState, now: u64, starting: bool) {
        let Some(accounting) = crate::memory::accounting() else {
            return;
        };
        for (ordinal, device) in self.devices_in_use(accounting) {
            POLLER_IN_DRIVER.store(true, Ordering::SeqCst);
            if SHUTDOWN.load(Ordering::SeqCst) {
                return;
            }
            // One handle lookup per device and step, for both readings.
            let handle = crate::nvml::device_handle(&device.uuid);
            let utilisation = handle.and_then(crosscheck::nvml_utilisation);
            let power = handle.and_then(boost::read);
            self.follow_boost(
                accounting,
                ordinal,
                device,
                (utilisation, power),
                &mut state.busy_seen,
                (now, starting),
            );
            if !starting {
                // Its persistence counts readings a second apart.
                self.cross_check(accounting, ordinal, device, utilisation, &mut state.cross_check, now);
            }
            POLLER_IN_DRIVER.store(false, Ordering::SeqCst);
        }
    }

    /// Adds what this process charged and launched since the last flush to the region's
    /// counters (kept locally so that a launch touches one shared line less).
    fn flush(&self, flushed: &mut [(i64, u64); MAX_DEVICES]) {
        let Some(accounting) = crate::memory::accounting() else {
            return;
        };
        let compute = &accounting.region().extension().compute;
        for (index, ((charged, launches), device)) in flushed.iter_mut().zip(&self.devices).enumerate() {
            if !device.touched() {
                continue;
            }
            let now_charged = device.charged.load(Ordering::Relaxed);
            let now_launches = device.launches.load(Ordering::Relaxed);
            add_signed(&compute[index].busy_ns, now_charged - *charged);
            compute[index]
                .launches
                .fetch_add(now_launches - *launches, Ordering::Relaxed);
            (*charged, *launches) = (now_charged, now_launches);
        }
    }

    /// `ns` of GPU time at the clock the kernels run at, as charged: times the device's boost
    /// factor.
    fn boosted(&self, region_index: usize, ns: i64) -> i64 {
        let factor = self
            .devices
            .get(region_index)
            .map_or(BOOST_UNIT, |device| device.boost.load(Ordering::Relaxed));
        (i128::from(ns) * i128::from(factor) / i128::from(BOOST_UNIT)) as i64
    }

    /// The visible devices this process has launched on, with their ordinals.
    fn devices_in_use<'a>(
        &'a self,
        accounting: &'a crate::memory::Accounting,
    ) -> impl Iterator<Item = (CUdevice, &'a crate::memory::DeviceEntry)> + 'a {
        (0..MAX_DEVICES as CUdevice)
            .map_while(move |ordinal| Some((ordinal, accounting.device(ordinal)?)))
            .filter(|(_, device)| self.devices.get(device.region_index).is_some_and(Device::touched))
    }

    /// Moves a device's boost factor towards what NVML's power readings call for, given the
    /// container's share of the device over the last period (the region's charged time, which
    /// every process of the container adds to, divided by the factor it was charged at).
    fn follow_boost(
        &self,
        accounting: &crate::memory::Accounting,
        ordinal: CUdevice,
        device: &crate::memory::DeviceEntry,
        (utilisation, power): (Option<u32>, Option<boost::PowerReading>),
        busy_seen: &mut [(u64, u64, u32); MAX_DEVICES],
        (now, starting): (u64, bool),
    ) {
        let index = device.region_index;
        let (Some(compute), Some(seen), Some(boost)) = (
            accounting.region().extension().compute.get(index),
            busy_seen.get_mut(index),
            self.devices.get(index).map(|device| &device.boost),
        ) else {
            return;
        };
        let busy = compute.busy_ns.load(Ordering::Relaxed);
        let (then, busy_then, readings) = std::mem::replace(seen, (now, busy, seen.2.saturating_add(1)));
        let current = f64::from(boost.load(Ordering::Relaxed)) / f64::from(BOOST_UNIT);
        let own = busy.saturating_sub(busy_then) as f64 / now.saturating_sub(then).max(1) as f64 / current;
        let gpu = utilisation.map(|percent| f64::from(percent) / 100.0);
        let clock_known = power.is_some_and(|reading| reading.clock.is_some());
        let share = boost::busy_share(own, gpu, clock_known);
        let target = power.map_or(1.0, |reading| boost::target_factor(reading, share));
        let next = boost::smoothed(current, target, starting || readings == 0);
        boost.store((next * f64::from(BOOST_UNIT)).round() as u32, Ordering::Relaxed);
        if (next - current).abs() >= 0.01 {
            // Both sources of the share, so that a run can tell which one set the factor.
            tracing::debug!(
                "compute limiter: device {ordinal} boost factor {next:.3} (busy share {share:.3}: the container's \
                 {own:.3}, NVML's {:.3})",
                gpu.unwrap_or(0.0)
            );
        }
    }

    /// A measurement came back: correct the charges it stands for.
    fn correct(&self, device: &Device, info: SampleInfo, measured: u64) {
        let correction = device.estimates().measured(info.key, info.charged, measured);
        let correction = self.boosted(info.region_index, correction);
        // One line per measurement: what a run's diagnosis needs (measured against charged).
        tracing::debug!(
            "compute limiter: device index {} key {:x} measured {measured} ns, charged {} ns, correction {correction} ns",
            info.region_index,
            info.key,
            info.charged
        );
        if correction == 0 {
            return;
        }
        let Some(accounting) = crate::memory::accounting() else {
            return;
        };
        if let Some(bucket) = accounting.region().extension().compute.get(info.region_index) {
            self.charge(bucket, info.region_index, correction);
        }
    }

    /// Compares the region's measured share of a device with NVML's utilisation of the GPU, and
    /// logs what [`crosscheck`] finds.
    fn cross_check(
        &self,
        accounting: &crate::memory::Accounting,
        ordinal: CUdevice,
        device: &crate::memory::DeviceEntry,
        nvml: Option<u32>,
        check: &mut CrossCheck,
        now: u64,
    ) {
        let index = device.region_index;
        let Some(boost) = self.devices.get(index).map(|device| &device.boost) else {
            return;
        };
        // The region's share: every live process of the container on this device.
        let measured = accounting
            .region()
            .hami()
            .procs
            .iter()
            .filter(|slot| slot.status.load(Ordering::Relaxed) == vgpu_region::SLOT_LIVE)
            .filter_map(|slot| slot.device_util.get(index))
            .map(|util| util.sm_util.load(Ordering::Relaxed))
            .fold(0u64, u64::saturating_add)
            .min(100);
        // What the kernels took, before the boost compensation ([`boost`]) scaled the charges.
        let factor = u64::from(boost.load(Ordering::Relaxed).max(1));
        let measured = (measured * u64::from(BOOST_UNIT) / factor) as u32;
        match check.record(index, crosscheck::judge(measured, nvml), now) {
            Report::Nothing => {}
            Report::Unavailable => tracing::debug!(
                "NVML cannot cross-check the compute limiter here: it reports {} while the container's kernels use {measured}% of device {ordinal}",
                nvml.map_or_else(|| "no utilisation".to_owned(), |value| format!("{value}%"))
            ),
            Report::Warning => tracing::warn!(
                "compute limiter: the container measured {measured}% of device {ordinal} but NVML reports {}% for the whole GPU; the sensor may over-count (checked for {} s)",
                nvml.unwrap_or(0),
                crosscheck::PERSISTENCE
            ),
        }
    }

    /// Writes the process's GPU share over the last second, in percent, into its slot's
    /// `device_util[d].sm_util` (what HAMi's monitor reports).
    fn publish(&self, history: &mut [[(u64, i64); PUBLISH_WINDOW]; MAX_DEVICES], position: usize, now: u64) {
        // Never into a slot the process has given back at exit (another may claim it).
        let Some(_writing) = crate::exit::slot_write() else {
            return;
        };
        let Some(accounting) = crate::memory::accounting() else {
            return;
        };
        let Some(slot) = accounting
            .slot_index()
            .and_then(|index| accounting.region().hami().procs.get(index))
        else {
            return;
        };
        for (index, (ring, device)) in history.iter_mut().zip(&self.devices).enumerate() {
            if !device.touched() {
                continue;
            }
            let total = device.charged.load(Ordering::Relaxed);
            // The oldest entry of the ring is the one about to be replaced.
            let (then, before) = ring[position];
            ring[position] = (now, total);
            if then == 0 {
                continue;
            }
            let span = now.saturating_sub(then).max(1);
            let percent = (total.saturating_sub(before).max(0) as u128 * 100 / u128::from(span)).min(100) as u64;
            slot.device_util[index].sm_util.store(percent, Ordering::Relaxed);
        }
    }
}
