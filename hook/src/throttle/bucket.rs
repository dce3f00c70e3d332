//! The token bucket of GPU time per device, in the shared region so that every process of the
//! container draws on one budget. Lock-free: a refill is claimed by moving `refilled_ns` forward
//! with a compare-exchange, so exactly one process adds each stretch of wall time.
//!
//! The budget refills at `limit`% of wall time, up to [`BURST_NS`]; each admitted launch takes its
//! estimated cost, and measurements correct it later. A launch is admitted while the budget is
//! positive (it may take it below zero by its own cost: that debt is paid by waiting), so over any
//! stretch the GPU time admitted is `limit`% of it, plus at most one burst.

use std::sync::atomic::Ordering;

use vgpu_region::{ComputeDevice, DEVICE_BURST_OPEN};

/// Most GPU time the bucket holds: how far a process that was idle (or below its limit) may run
/// ahead at full speed. Short enough that a competitor never waits long, long enough that work
/// with pauses below the limit is never held back.
pub const BURST_NS: i64 = 30_000_000;
/// Debt is bounded, so a wrong measurement cannot stall a device for long.
pub const DEBT_FLOOR_NS: i64 = -2_000_000_000;
/// The most debt an open burst admits launches down to: long enough for the container's streams
/// to fill the GPU together, short enough that a burst and the pause after it stay far below the
/// one-second scale of every target and of HAMi's monitor.
pub const BURST_DEBT_NS: i64 = 4_000_000;
/// Refills closer together than this are skipped (fewer contended writes to the shared line).
const REFILL_QUANTUM_NS: u64 = 20_000;
/// A clock more than this far behind `refilled_ns` means the file outlived a reboot: restart.
const CLOCK_BACKWARDS_NS: u64 = 1_000_000_000;

/// Adds the wall time since the last refill at `limit` percent.
pub fn refill(device: &ComputeDevice, now: u64, limit: u8) {
    let last = device.refilled_ns.load(Ordering::Acquire);
    // First use, or a stale file: start with a full bucket.
    let restart = last == 0 || last > now.saturating_add(CLOCK_BACKWARDS_NS);
    if !restart && now < last.saturating_add(REFILL_QUANTUM_NS) {
        return;
    }
    if device
        .refilled_ns
        .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
        .is_err()
    {
        return; // another thread or process took this stretch
    }
    if restart {
        device.budget_ns.store(BURST_NS, Ordering::Release);
    } else {
        let added = ((now - last) as u128 * u128::from(limit) / 100).min(i64::MAX as u128) as i64;
        add(device, added);
    }
    device.limit_percent.store(u32::from(limit), Ordering::Relaxed);
}

/// Adds `delta` ns (negative: takes), keeping the budget within the floor and the burst.
pub fn add(device: &ComputeDevice, delta: i64) {
    let _ = device
        .budget_ns
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |budget| {
            Some(budget.saturating_add(delta).clamp(DEBT_FLOOR_NS, BURST_NS))
        });
}

/// Refills, then admits a launch of `cost` ns if the budget allows it. `Err` holds how long (ns
/// of wall time) until the budget is back at zero at this limit.
///
/// A positive budget opens a burst, which admits launches down to [`BURST_DEBT_NS`] of debt, then
/// closes until the budget is positive again: the container's streams run side by side in the
/// same stretches, as unlimited, not one by one as the refill trickles in. The long-run share is
/// the refill's either way.
pub fn try_take(device: &ComputeDevice, now: u64, limit: u8, cost: u64) -> Result<(), u64> {
    refill(device, now, limit);
    let budget = device.budget_ns.load(Ordering::Acquire);
    let open = device.flags.load(Ordering::Relaxed) & DEVICE_BURST_OPEN != 0;
    let admitted = budget > 0 || (open && budget > -BURST_DEBT_NS);
    let cost = cost.min(i64::MAX as u64) as i64;
    if admitted {
        add(device, -cost);
    }
    let stays_open = admitted && budget.saturating_sub(cost) > -BURST_DEBT_NS;
    if stays_open && !open {
        device.flags.fetch_or(DEVICE_BURST_OPEN, Ordering::Relaxed);
    } else if !stays_open && open {
        device.flags.fetch_and(!DEVICE_BURST_OPEN, Ordering::Relaxed);
    }
    if admitted {
        return Ok(());
    }
    let deficit = budget.unsigned_abs().max(1);
    Err((deficit as u128 * 100 / u128::from(limit.max(1))).min(u64::MAX as u128) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> Box<ComputeDevice> {
        // SAFETY: ComputeDevice is atomics only, for which all-zero bytes are valid values.
        Box::new(unsafe { std::mem::zeroed() })
    }

    #[test]
    fn first_use_fills_the_bucket() {
        let d = device();
        assert_eq!(try_take(&d, 1_000, 50, 10_000_000), Ok(()));
        assert_eq!(d.budget_ns.load(Ordering::Relaxed), BURST_NS - 10_000_000);
    }

    #[test]
    fn admitted_time_is_the_limit_share_of_wall_time() {
        // A launcher that always has work: 2 ms kernels, the clock advancing by the waits.
        for limit in [10u8, 20, 50, 80] {
            let d = device();
            let mut now = 1_000_000_000u64;
            let start = now;
            let mut admitted = 0u64;
            while now - start < 10_000_000_000 {
                match try_take(&d, now, limit, 2_000_000) {
                    Ok(()) => admitted += 2_000_000,
                    // Sleeps overshoot a little, as real ones do.
                    Err(wait) => now += wait.max(100_000) + 37_000,
                }
                now += 1_000; // the launch call itself
            }
            let share = admitted as f64 * 100.0 / (now - start) as f64;
            assert!(
                (share - f64::from(limit)).abs() < 0.5,
                "limit {limit}: admitted share {share:.2}"
            );
        }
    }

    #[test]
    fn a_burst_admits_down_to_its_debt_then_closes_until_the_budget_is_positive() {
        let d = device();
        let now = 1_000_000_000u64;
        try_take(&d, now, 50, 0).unwrap();
        d.budget_ns.store(1_000, Ordering::Relaxed);
        // Opened by the positive budget: launches pass until the debt reaches BURST_DEBT_NS.
        let mut admitted = 0;
        while try_take(&d, now, 50, 1_000_000).is_ok() {
            admitted += 1;
        }
        assert_eq!(admitted, 5, "1 us of budget and 4 ms of debt admit five 1 ms launches");
        assert_eq!(d.flags.load(Ordering::Relaxed) & DEVICE_BURST_OPEN, 0);
        // Closed: a small refill that leaves debt admits nothing.
        d.budget_ns.store(-1_000, Ordering::Relaxed);
        assert!(try_take(&d, now, 50, 1).is_err());
        d.budget_ns.store(1, Ordering::Relaxed);
        assert_eq!(try_take(&d, now, 50, 2_000_000), Ok(()));
        assert_eq!(d.flags.load(Ordering::Relaxed) & DEVICE_BURST_OPEN, DEVICE_BURST_OPEN);
        assert_eq!(try_take(&d, now, 50, 1_000_000), Ok(()), "open: admitted in debt");
    }

    #[test]
    fn budget_stays_within_burst_and_floor() {
        let d = device();
        try_take(&d, 1, 50, 0).unwrap();
        refill(&d, 100_000_000_000, 50);
        assert_eq!(d.budget_ns.load(Ordering::Relaxed), BURST_NS);
        add(&d, i64::MIN);
        assert_eq!(d.budget_ns.load(Ordering::Relaxed), DEBT_FLOOR_NS);
        // Paying the floor back at 50% takes 4 s of wall time.
        assert_eq!(try_take(&d, 100_000_000_000, 50, 1), Err(4_000_000_000));
    }

    #[test]
    fn a_clock_far_behind_restarts_the_bucket() {
        let d = device();
        try_take(&d, 50_000_000_000, 50, 0).unwrap();
        add(&d, -1_000_000_000);
        // After a reboot the monotonic clock starts again near zero.
        assert_eq!(try_take(&d, 5_000_000, 50, 1_000), Ok(()));
        assert_eq!(d.refilled_ns.load(Ordering::Relaxed), 5_000_000);
    }
}
