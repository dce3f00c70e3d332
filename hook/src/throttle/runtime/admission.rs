//! Admission of a launch on the limited path: it waits while the shared bucket is in debt, is
//! charged its estimated GPU time, and may be sampled; HAMi's controls (`utilization_switch`,
//! `recent_kernel`) are read and written here.

use std::sync::atomic::Ordering;
use std::time::Duration;

use vgpu_config::UtilizationPolicy;
use vgpu_region::{ComputeDevice, RECENT_KERNEL_ACTIVE, SharedRegion};

use crate::capture::capturing;
use crate::sys::cuda::{CUDA_SUCCESS, CUresult, CUstream};
use crate::throttle::sensor::{InFlight, Member, SampleInfo};
use crate::throttle::{Stream, activity, bucket, now_ns};

use super::{Runtime, SHUTDOWN, runtime};

/// Shortest sleep of a waiting launch: below this, sleeping costs more than it saves, and the
/// budget that builds up meanwhile lets several small launches through at once.
pub(in crate::throttle) const MIN_WAIT_NS: u64 = 100_000;
/// Longest sleep before the controls (switch, `recent_kernel`, the limit) are looked at again: also
/// the poll period of a launch held by `recent_kernel` = -1.
pub(in crate::throttle) const MAX_WAIT_NS: u64 = 10_000_000;

/// What the limited path decided before a launch, finished by [`after`].
pub struct Ticket {
    runtime: &'static Runtime,
    key: u64,
    /// What the estimates planned (GPU time at the clock the kernels run at).
    planned: u64,
    /// What the bucket was charged (the plan times the correction and the overlap factor).
    charge: u64,
    region_index: usize,
    /// The limiter planned to measure this launch.
    planned_sample: bool,
    /// Boxed: most launches are not sampled, and a ticket this small moves in registers.
    sample: Option<Box<InFlight>>,
    /// The launch is bracketed for an overlap window (boxed as the sample).
    member: Option<Box<Member>>,
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

fn sleep_ns(ns: u64) {
    std::thread::sleep(Duration::from_nanos(ns));
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
        let session = crate::session::get()?;
        // With one device (the common case) every launch goes there: no need to ask the driver.
        let ordinal = if session.device(1).is_none() {
            0
        } else {
            crate::session::current_ordinal()?
        };
        let region_index = session.device(ordinal)?.region_index;
        let limit = session.sm_limit(region_index)?;
        let region = session.region();
        let hami = region.hami();
        let bucket = region.extension().compute.get(region_index)?;
        let device = self.devices.get(region_index)?;
        // With the switch off (HAMi lifted the limit) a launch neither waits nor is held, but is
        // still charged and measured: the container's share stays published for HAMi's monitor,
        // from the same measurements, as HAMi-core publishes it whenever a limit is set.
        let active = self.active(hami);
        self.start_poller();

        let now = now_ns();
        device.sensor.note_launch(stream, now);
        let plan = device.estimates().plan(key, now);
        let charge = self.scaled(region_index, plan.charge as i64) as u64;
        // A launch into a stream being captured does not run now: it must neither wait nor be
        // measured (an event recorded there would join the graph). Asking the driver costs about
        // as much as the rest of this path, so it is asked only when the launch would wait or be
        // measured; one that passes at once is charged like any other (at most one burst's worth
        // while a capture lasts).
        let first = if !active {
            Ok(())
        } else if hami.recent_kernel.load(Ordering::Relaxed) < 0 {
            Err(MAX_WAIT_NS)
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
                    self.admit(session, region_index, charge, wait, now)
                };
                let Some(waited) = admitted else {
                    device.estimates().forget(key, plan);
                    return None;
                };
                (waited, true)
            }
        };
        self.account(hami, bucket, region_index, charge as i64, waited, active);
        let info = SampleInfo {
            key,
            charged: plan.charge,
            region_index,
        };
        let sample = if plan.sample && measurable {
            if !checked && capturing(stream) {
                self.charge(bucket, region_index, -(charge as i64));
                device.estimates().forget(key, plan);
                return None;
            }
            device.sensor.begin(stream, info).map(|mut launch| {
                device.sensor.open_window(&mut launch, now);
                Box::new(launch)
            })
        } else {
            None
        };
        let member = (sample.is_none() && measurable)
            .then(|| device.sensor.begin_member(stream, now).map(Box::new))
            .flatten();
        Some(Ticket {
            member,
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
        if let Some(member) = ticket.member {
            device.sensor.end_member(*member, status);
        }
        let measured = ticket.sample.is_some_and(|sample| device.sensor.end(*sample, status));
        if ticket.planned_sample && !measured {
            device.estimates().not_measured(ticket.key, ticket.planned);
        }
        if status != CUDA_SUCCESS {
            // A launch the driver refused takes no GPU time.
            if let Some(session) = crate::session::get()
                && let Some(bucket) = session.region().extension().compute.get(ticket.region_index)
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
        session: &'static crate::session::Session,
        region_index: usize,
        cost: u64,
        mut wait: u64,
        since: u64,
    ) -> Option<u64> {
        let hami = session.region().hami();
        let bucket = session.region().extension().compute.get(region_index)?;
        loop {
            sleep_ns(wait.clamp(MIN_WAIT_NS, MAX_WAIT_NS));
            if SHUTDOWN.load(Ordering::Relaxed) || !self.active(hami) {
                return None;
            }
            let limit = session.sm_limit(region_index)?;
            let now = now_ns();
            wait = if hami.recent_kernel.load(Ordering::Relaxed) < 0 {
                // HAMi's monitor holds this container while a higher-priority one runs.
                MAX_WAIT_NS
            } else {
                match bucket::try_take(bucket, now, limit, cost) {
                    Ok(()) => return Some(now.saturating_sub(since)),
                    Err(wait) => wait,
                }
            };
        }
    }

    /// Records an admitted launch: this process's counters (the background thread adds them to
    /// the region's), the wait, and while the limit applies (`active`) HAMi's `recent_kernel`
    /// (`last_kernel_time` is every launch's: `activity`).
    fn account(
        &self,
        hami: &SharedRegion,
        bucket: &ComputeDevice,
        region_index: usize,
        charge: i64,
        waited: u64,
        active: bool,
    ) {
        if waited > 0 {
            bucket.held_ns.fetch_add(waited, Ordering::Relaxed);
        }
        if let Some(device) = self.devices.get(region_index) {
            device.charged.fetch_add(charge, Ordering::Relaxed);
            device.launches.fetch_add(1, Ordering::Relaxed);
            if !device.touched() {
                device.touched.store(true, Ordering::Relaxed);
            }
        }
        let recent = hami.recent_kernel.load(Ordering::Relaxed);
        if active && recent >= 0 && recent != RECENT_KERNEL_ACTIVE {
            // Only over the value read: a -1 the monitor writes meanwhile must stand.
            let _ =
                hami.recent_kernel
                    .compare_exchange(recent, RECENT_KERNEL_ACTIVE, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}
