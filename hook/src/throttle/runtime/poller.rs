//! The limiter's background thread: it collects the sampled launches' measurements and corrects
//! the charges, flushes this process's counters into the region, publishes its utilisation, and
//! once a second has the correction follow NVML's readings.

use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use vgpu_region::{ComputeDevice, MAX_DEVICES};

use crate::sys::cuda::CUdevice;
use crate::throttle::boost::{self, Compensation};
use crate::throttle::correction::{Correction, Reading};
use crate::throttle::now_ns;
use crate::throttle::sensor::Measured;
use crate::throttle::{boards, nvml_reading};

use super::{Device, POLLER_IN_DRIVER, RUNTIME, Runtime, SHUTDOWN, add_signed, at_exit};
use crate::throttle::FACTOR_UNIT;

/// The background thread's period while samples are in flight, and while none are.
pub(in crate::throttle) const POLL_BUSY: Duration = Duration::from_millis(1);
const POLL_IDLE: Duration = Duration::from_millis(20);
/// How often the process's utilisation is published.
pub(in crate::throttle) const PUBLISH_PERIOD_NS: u64 = 250_000_000;
/// How often NVML is read, for the correction ([`crate::throttle::correction`]).
pub(in crate::throttle) const NVML_PERIOD_NS: u64 = 1_000_000_000;
/// The published utilisation averages the publications of one NVML period: the second NVML's own
/// utilisation covers.
const PUBLISH_WINDOW: usize = (NVML_PERIOD_NS / PUBLISH_PERIOD_NS) as usize;
/// For this long after the poller starts, NVML is read at every publication and the boost factor
/// takes each reading whole: the factor follows the power as it ramps up, so a power-hungry job is
/// not run ahead of its share for its whole first second. NVML's utilisation is compared from then
/// on (its figure covers up to a second before it is read).
pub(in crate::throttle) const START_PHASE_NS: u64 = 1_500_000_000;

/// The background thread's own state between periods.
struct PollState {
    history: [[(u64, i64); PUBLISH_WINDOW]; MAX_DEVICES],
    last_publish: u64,
    publications: usize,
    /// When the poller started (the process's first limited launch).
    started: u64,
    last_nvml: u64,
    /// Per region device index: the region's counters when the correction last followed a
    /// reading.
    seen_at_nvml: [Seen; MAX_DEVICES],
    /// A step has panicked (said once).
    panicked: bool,
}

/// A device's region counters at one NVML reading, and what the factors have followed.
#[derive(Clone, Copy, Default)]
struct Seen {
    at: u64,
    charged_ns: u64,
    launches: u64,
    held_ns: u64,
    /// NVML's timestamp of the newest utilisation sample read.
    nvml_sample: u64,
    /// The device's correction: made at its first reading, with the compensation of its board
    /// ([`boards`]).
    correction: Option<Correction>,
}

impl Seen {
    /// The counters now, the rest carried over from `last`.
    fn now(compute: &ComputeDevice, at: u64, last: Seen) -> Seen {
        Seen {
            at,
            charged_ns: compute.charged_ns.load(Ordering::Relaxed),
            launches: compute.launches.load(Ordering::Relaxed),
            held_ns: compute.held_ns.load(Ordering::Relaxed),
            ..last
        }
    }
}

impl PollState {
    fn new() -> PollState {
        let now = now_ns();
        PollState {
            history: [[(0, 0); PUBLISH_WINDOW]; MAX_DEVICES],
            last_publish: now,
            publications: 0,
            started: now,
            last_nvml: now,
            // From the poller's start (the process's first limited launch), so that the first
            // reading already sets the factor.
            seen_at_nvml: std::array::from_fn(|index| {
                crate::session::get()
                    .and_then(|session| session.region().extension().compute.get(index))
                    .map_or(Seen::default(), |compute| Seen::now(compute, now, Seen::default()))
            }),
            panicked: false,
        }
    }
}

impl Runtime {
    pub(super) fn start_poller(&'static self) {
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
        crate::capture::relax_capture_mode();
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
            for measured in completed {
                self.correct(device, measured);
            }
        }
        self.flush();
        let now = now_ns();
        if now.saturating_sub(state.last_publish) >= PUBLISH_PERIOD_NS {
            state.last_publish = now;
            self.publish(&mut state.history, state.publications % PUBLISH_WINDOW, now);
            state.publications += 1;
        }
        let starting = now.saturating_sub(state.started) < START_PHASE_NS;
        let period = if starting { PUBLISH_PERIOD_NS } else { NVML_PERIOD_NS };
        if now.saturating_sub(state.last_nvml) >= period {
            state.last_nvml = now;
            self.nvml_step(state, now, starting);
        }
        true
    }

    /// Reads NVML for each device in use and has its correction follow the reading. Marked as
    /// inside the driver, and stopped at exit between devices.
    fn nvml_step(&self, state: &mut PollState, now: u64, starting: bool) {
        let Some(session) = crate::session::get() else {
            return;
        };
        for (ordinal, device) in self.devices_in_use(session) {
            POLLER_IN_DRIVER.store(true, Ordering::SeqCst);
            if SHUTDOWN.load(Ordering::SeqCst) {
                return;
            }
            let Some(seen) = state.seen_at_nvml.get_mut(device.region_index) else {
                continue;
            };
            // One handle lookup per device and step, for every reading.
            let handle = crate::nvml::device_handle(&device.uuid);
            let correction = *seen
                .correction
                .get_or_insert_with(|| Correction::new(self.choose_compensation(ordinal, handle)));
            // The first query returns NVML's whole buffer, seconds from before: it only sets
            // where the next one starts.
            let started = seen.nvml_sample != 0;
            let reading = Reading {
                utilisation: handle
                    .and_then(nvml_reading::utilisation)
                    .map(|percent| f64::from(percent) / 100.0),
                samples: handle
                    .and_then(|handle| nvml_reading::utilisation_samples(handle, &mut seen.nvml_sample))
                    .filter(|_| started)
                    .map(|(mean, count)| (mean / 100.0, count)),
                // Without a power model the power readings are not needed.
                power: handle.filter(|_| correction.reads_power()).and_then(boost::read),
            };
            self.follow_nvml(session, ordinal, device, reading, seen, (now, starting));
            POLLER_IN_DRIVER.store(false, Ordering::SeqCst);
        }
    }

    /// Adds what this process charged and launched since the last flush to the region's
    /// counters (kept locally so that a launch touches one shared line less). The background
    /// thread and the exit handler may flush at once: [`unflushed`] moves each change once.
    pub(super) fn flush(&self) {
        let Some(session) = crate::session::get() else {
            return;
        };
        let compute = &session.region().extension().compute;
        for (region_counters, device) in compute.iter().zip(&self.devices) {
            if !device.touched() {
                continue;
            }
            let charged = unflushed(&device.flushed_charged, || {
                device.charged.load(Ordering::Relaxed) as u64
            });
            add_signed(&region_counters.charged_ns, charged as i64);
            let launches = unflushed(&device.flushed_launches, || device.launches.load(Ordering::Relaxed));
            region_counters.launches.fetch_add(launches, Ordering::Relaxed);
        }
    }

    /// How a device's boost factor follows its power: its board's model, by NVML's name, unless
    /// `VGPU_COMPUTE_PROFILE=off` (then its name is not read). Said once per device, at info level.
    fn choose_compensation(&self, ordinal: CUdevice, handle: Option<crate::sys::nvml::nvmlDevice_t>) -> Compensation {
        let setting = self.config.compute_profile;
        let name = match setting {
            vgpu_config::ComputeProfile::Off => None,
            vgpu_config::ComputeProfile::Auto => handle.and_then(nvml_reading::device_name),
        };
        let choice = boards::choose(setting, name.as_deref());
        tracing::info!("compute limiter: device {ordinal}: {}", choice.why);
        choice.compensation
    }

    /// The visible devices this process has launched on, with their ordinals.
    fn devices_in_use<'a>(
        &'a self,
        session: &'static crate::session::Session,
    ) -> impl Iterator<Item = (CUdevice, &'a crate::session::DeviceEntry)> + 'a {
        (0..MAX_DEVICES as CUdevice)
            .map_while(move |ordinal| Some((ordinal, session.device(ordinal)?)))
            .filter(|(_, device)| self.devices.get(device.region_index).is_some_and(Device::touched))
    }

    /// Has a device's correction follow one NVML reading, given the container's share of the
    /// device over the last period (the region's charged time, which every process of the
    /// container adds to).
    fn follow_nvml(
        &self,
        session: &'static crate::session::Session,
        ordinal: CUdevice,
        device: &crate::session::DeviceEntry,
        reading: Reading,
        seen: &mut Seen,
        (now, starting): (u64, bool),
    ) {
        let index = device.region_index;
        let (Some(compute), Some(factors), Some(mut correction)) = (
            session.region().extension().compute.get(index),
            self.devices.get(index),
            seen.correction,
        ) else {
            return;
        };
        let last = *seen;
        let period = now.saturating_sub(last.at).max(1);
        let mut next_seen = Seen::now(compute, now, last);
        let charged = next_seen.charged_ns.saturating_sub(last.charged_ns) as f64 / period as f64;
        let factor = correction.follow(charged, reading, period as f64 / 1e9, starting);
        next_seen.correction = Some(correction);
        *seen = next_seen;
        factors
            .correction
            .store((factor * f64::from(FACTOR_UNIT)).round() as u32, Ordering::Relaxed);
        let (boost, trim) = correction.parts();
        // What the bucket admitted, period by period: a run's diagnosis compares it with the limit
        // and with NVML (its charges against the GPU's busy time).
        tracing::debug!(
            "compute limiter: device {ordinal} period {} ms: charged {charged:.3} of it, launches waited {:.3} of it, \
             {} launches, NVML utilisation {}, samples {}, budget {} us, boost {boost:.3}, trim {trim:.3}",
            period / 1_000_000,
            next_seen.held_ns.saturating_sub(last.held_ns) as f64 / period as f64,
            next_seen.launches.saturating_sub(last.launches),
            reading
                .utilisation
                .map_or_else(|| "unknown".to_owned(), |share| format!("{:.0}%", share * 100.0)),
            reading.samples.map_or_else(
                || "none".to_owned(),
                |(mean, count)| format!("{:.1}% of {count}", mean * 100.0)
            ),
            compute.budget_ns.load(Ordering::Relaxed) / 1000
        );
    }

    /// A measurement came back: correct the charges it stands for.
    fn correct(&self, device: &Device, sample: Measured) {
        let Measured { info, gpu_ns: measured } = sample;
        let correction = device.estimates().measured(info.key, info.charged, measured);
        let correction = self.scaled(info.region_index, correction);
        // One line per measurement: what a run's diagnosis needs (measured against charged).
        tracing::debug!(
            "compute limiter: device index {} key {:x} measured {measured} ns, charged {} ns, correction {correction} ns",
            info.region_index,
            info.key,
            info.charged,
        );
        if correction == 0 {
            return;
        }
        let Some(session) = crate::session::get() else {
            return;
        };
        if let Some(bucket) = session.region().extension().compute.get(info.region_index) {
            self.charge(bucket, info.region_index, correction);
        }
    }

    /// Writes the process's GPU share over the last second, in percent, into its slot's
    /// `device_util[d].sm_util` (what HAMi's monitor reports).
    fn publish(&self, history: &mut [[(u64, i64); PUBLISH_WINDOW]; MAX_DEVICES], position: usize, now: u64) {
        // Never into a slot the process has given back at exit (another may claim it).
        let Some(_writing) = crate::exit::slot_write() else {
            return;
        };
        let Some(session) = crate::session::get() else {
            return;
        };
        let Some(slot) = session
            .slot_index()
            .and_then(|index| session.region().hami().procs.get(index))
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

/// The change of a running total since its watermark, moving the watermark to the total read:
/// the total is read after the watermark and stored only over the watermark it was read after,
/// so two flushers at once never move a change twice nor take back one the other added (a
/// total that only grows never gives a negative change). Wrapping: `charged` is an i64 seen as
/// bits.
fn unflushed(watermark: &AtomicU64, total: impl Fn() -> u64) -> u64 {
    let mut before = watermark.load(Ordering::Relaxed);
    loop {
        let now = total();
        match watermark.compare_exchange(before, now, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return now.wrapping_sub(before),
            Err(seen) => before = seen,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use super::unflushed;

    /// The exit handler flushes between the background thread's read of the count and its
    /// store: the background thread's flush then moves nothing, and the watermark stays at the
    /// newer count (a stale store would take 2 launches back, for good at exit).
    #[test]
    fn a_flush_in_the_middle_of_another_moves_nothing_twice_and_takes_nothing_back() {
        let total = AtomicU64::new(10);
        let watermark = AtomicU64::new(0);
        let inner = Cell::new(None);
        let outer = unflushed(&watermark, || {
            let read = total.load(Ordering::Relaxed);
            if inner.get().is_none() {
                total.fetch_add(2, Ordering::Relaxed);
                inner.set(Some(unflushed(&watermark, || total.load(Ordering::Relaxed))));
            }
            read
        });
        assert_eq!(inner.get(), Some(12));
        assert_eq!(outer, 0);
        assert_eq!(watermark.load(Ordering::Relaxed), 12);
    }

    /// Two flushers racing while a count of launches grows: no flush ever takes back what the
    /// other moved (the region's counter would step back, and a flush at exit would lose it),
    /// and what they move adds up to the count.
    #[test]
    fn racing_flushers_never_step_a_count_back() {
        let total = AtomicU64::new(0);
        let watermark = AtomicU64::new(0);
        let moved = AtomicU64::new(0);
        let backwards = AtomicU64::new(0);
        let running = AtomicBool::new(true);
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| {
                    while running.load(Ordering::Relaxed) {
                        let change = unflushed(&watermark, || total.load(Ordering::Relaxed));
                        if (change as i64) < 0 {
                            backwards.fetch_add(1, Ordering::Relaxed);
                        }
                        moved.fetch_add(change, Ordering::Relaxed);
                    }
                });
            }
            for _ in 0..1_000_000 {
                total.fetch_add(1, Ordering::Relaxed);
            }
            running.store(false, Ordering::Relaxed);
        });
        let last = unflushed(&watermark, || total.load(Ordering::Relaxed));
        moved.fetch_add(last, Ordering::Relaxed);
        assert_eq!(
            backwards.load(Ordering::Relaxed),
            0,
            "flushes that stepped the count back"
        );
        assert_eq!(moved.load(Ordering::Relaxed), total.load(Ordering::Relaxed));
    }
}
