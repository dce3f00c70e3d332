//! Compensation for the GPU's boost clock.
//!
//! A GPU that a workload keeps busy all the time runs at the clock its power limit allows (a bf16
//! GEMM on the H200: about 1600 MHz at 690 W). Held to half of its time by the limiter, the same
//! GPU stays under its power limit and runs at its highest clock (1980 MHz), so each kernel takes
//! less time (178 us instead of 205 us) and half of the GPU's time does 58% of the unlimited
//! work. The limit is a share of the GPU; so that it holds in work done, and not only in time,
//! a kernel is charged what it would take on the GPU busy with this container's work alone.
//!
//! That time comes from a model of the GPU's power and clock, fed by NVML once a second:
//!
//! - the GPU's power `P` (NVML's average), its enforced power limit `P_cap`, an idle power of
//!   [`IDLE_SHARE`] of the limit (the clocks stay up between kernels), its SM clock `f` and
//!   highest SM clock `f_max`, and the share `s` of the GPU's time that kernels take: the
//!   container's own (measured by the sensor, before compensation), or NVML's utilisation of the
//!   whole GPU where NVML measures it and it is more;
//! - dynamic power grows as the clock to the power [`ALPHA`], and a kernel's time shrinks as the
//!   clock to the power [`BETA`] (both measured on the H200: a GEMM's time is not all compute);
//! - while the GPU reports no power or thermal slowdown, the work's dynamic power were the GPU
//!   busy all the time at its highest clock is learnt: `D = (P - P_idle) / s * (f_max / f)^ALPHA`;
//! - busy all the time, the GPU would settle at the clock where that power meets the limit,
//!   `f_full = f_max * ((P_cap - P_idle) / D)^(1 / ALPHA)` (or `f_max` if it never reaches it),
//!   and each kernel would take `(f / f_full)^BETA` times what it takes now: the factor charged.
//!
//! So a GPU held below its limit (at `f_max`) charges the whole boost, a GPU that alternates
//! between slowdown and none (a limit of 75 on the H200) charges the part of it that its present
//! clock shows, and a GPU saturated by several containers, already at `f_full`, charges none.
//! Safeguards, because NVML cannot tell whose work the GPU's power is for:
//!
//! - `D` is learnt only while the GPU reports no slowdown, and is not known before: until then
//!   the factor is 1;
//! - the factor never exceeds [`MAX_FACTOR`], the H200's whole boost range (1980 MHz over 1470
//!   MHz, to the power [`BETA`]). Where NVML reports no utilisation (the H200 VM), another
//!   container's work is counted as this one's while the GPU is shared below its limit: the
//!   over-charge is then bounded by that, and since such a GPU does boost, part of it is due;
//! - without NVML's power or clock readings the factor stays 1 (time share).

/// Idle power with the clocks up, as a share of the power limit (H200: the GEMM held to 10, 25
/// and 50% of the time draws 204, 316 and 521 W, a line through about 120 W of 700 W at 0%).
pub const IDLE_SHARE: f64 = 0.17;
/// Dynamic power ~ clock^ALPHA over the boost range (H200: 555 W at 1554 MHz, 793 W at 1980 MHz).
pub const ALPHA: f64 = 1.5;
/// Kernel time ~ clock^-BETA (H200 bf16 GEMM: 209 us at 1552 MHz, 178 us at 1980 MHz).
pub const BETA: f64 = 0.66;
/// The largest factor charged.
pub const MAX_FACTOR: f64 = 1.25;
/// Below this busy share the power says nothing about the container's work.
const MIN_SHARE: f64 = 0.02;
/// Weight of a new reading in the factor (readings come once a second; NVML's power is itself
/// averaged over about a second).
const SMOOTHING: f64 = 0.5;

/// NVML's clock event reasons that mean the clock is held down by power or heat.
pub const SLOWDOWN_REASONS: u64 = 0x4 | 0x8 | 0x20 | 0x40 | 0x80;

/// One NVML reading of a GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerReading {
    pub watts: f64,
    pub limit_watts: f64,
    /// The GPU reports a power or thermal slowdown now.
    pub slowed: bool,
    pub sm_mhz: f64,
    pub max_sm_mhz: f64,
}

impl PowerReading {
    /// Whether every figure is one a GPU can report.
    fn plausible(&self) -> bool {
        let positive = |value: f64| value.is_finite() && value > 0.0;
        positive(self.limit_watts)
            && self.watts.is_finite()
            && self.watts >= 0.0
            && positive(self.sm_mhz)
            && positive(self.max_sm_mhz)
    }

    /// The present clock as a share of the highest (at most 1).
    fn clock_ratio(&self) -> f64 {
        (self.sm_mhz / self.max_sm_mhz).clamp(0.05, 1.0)
    }
}

/// What the model has learnt of one device.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BoostModel {
    /// The work's dynamic power were the GPU busy all the time at its highest clock (watts).
    full_speed_dynamic: Option<f64>,
}

impl BoostModel {
    /// The factor for one reading, given the share of the GPU's time that kernels took (0..=1,
    /// before compensation); learns from the reading when the GPU is not slowed down.
    pub fn target(&mut self, reading: PowerReading, busy_share: f64) -> f64 {
        if !reading.plausible() {
            return 1.0;
        }
        let idle = IDLE_SHARE * reading.limit_watts;
        let ratio = reading.clock_ratio();
        if !reading.slowed && !busy_share.is_nan() && busy_share >= MIN_SHARE {
            let dynamic = (reading.watts - idle).max(0.0) / busy_share.min(1.0) / ratio.powf(ALPHA);
            self.full_speed_dynamic = Some(dynamic);
        }
        let Some(dynamic) = self.full_speed_dynamic else {
            return 1.0;
        };
        let over_limit = dynamic / (reading.limit_watts - idle);
        if over_limit <= 1.0 {
            return 1.0;
        }
        // f_full / f_max, then (f / f_full)^BETA.
        let full_load_ratio = over_limit.powf(-1.0 / ALPHA);
        (ratio / full_load_ratio).powf(BETA).clamp(1.0, MAX_FACTOR)
    }
}

/// The factor applied now, moved a step towards the target at each reading.
pub fn smoothed(previous: f64, target: f64) -> f64 {
    let next = previous + SMOOTHING * (target - previous);
    next.clamp(1.0, MAX_FACTOR)
}

/// NVML's reading of the GPU with this UUID; `None` where NVML has no power or clock readings.
pub fn read(uuid: &str) -> Option<PowerReading> {
    use crate::hooks::real;
    use crate::sys::nvml::{NVML_CLOCK_SM, NVML_SUCCESS, nvmlDevice_t};
    let init = real::nvmlInit_v2()?;
    let by_uuid = real::nvmlDeviceGetHandleByUUID()?;
    let power = real::nvmlDeviceGetPowerUsage()?;
    let limit = real::nvmlDeviceGetEnforcedPowerLimit()?;
    let (clock, max_clock) = (real::nvmlDeviceGetClockInfo()?, real::nvmlDeviceGetMaxClockInfo()?);
    let uuid = std::ffi::CString::new(uuid).ok()?;
    let mut device: nvmlDevice_t = std::ptr::null_mut();
    let (mut milliwatts, mut limit_milliwatts, mut sm_mhz, mut max_sm_mhz) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: NVML's init is reference counted; the out-pointers are locals; uuid is NUL-terminated.
    let read = unsafe {
        init() == NVML_SUCCESS
            && by_uuid(uuid.as_ptr(), &mut device) == NVML_SUCCESS
            && power(device, &mut milliwatts) == NVML_SUCCESS
            && limit(device, &mut limit_milliwatts) == NVML_SUCCESS
            && clock(device, NVML_CLOCK_SM, &mut sm_mhz) == NVML_SUCCESS
            && max_clock(device, NVML_CLOCK_SM, &mut max_sm_mhz) == NVML_SUCCESS
    };
    if !read {
        return None;
    }
    let mut reasons = 0u64;
    let slowed = real::nvmlDeviceGetCurrentClocksEventReasons().is_some_and(|get_reasons| {
        // SAFETY: a device handle NVML just gave and a local out-pointer.
        unsafe { get_reasons(device, &mut reasons) == NVML_SUCCESS && reasons & SLOWDOWN_REASONS != 0 }
    });
    Some(PowerReading {
        watts: f64::from(milliwatts) / 1000.0,
        limit_watts: f64::from(limit_milliwatts) / 1000.0,
        slowed,
        sm_mhz: f64::from(sm_mhz),
        max_sm_mhz: f64::from(max_sm_mhz),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200(watts: f64, sm_mhz: f64, slowed: bool) -> PowerReading {
        PowerReading {
            watts,
            limit_watts: 700.0,
            slowed,
            sm_mhz,
            max_sm_mhz: 1980.0,
        }
    }

    #[test]
    fn a_boosted_gemm_is_charged_its_time_at_full_load() {
        // The H200 GEMM held to half its time: 521 W at 1980 MHz, 178 us per product against
        // 205 us unlimited (a factor of 1.15).
        let factor = BoostModel::default().target(h200(521.0, 1980.0, false), 0.5);
        assert!((1.12..=1.19).contains(&factor), "{factor}");
        // The same GPU at a tenth and at a quarter of its time: the same full-load power, so
        // about the same factor.
        for (watts, share) in [(204.0, 0.1), (316.0, 0.25)] {
            let other = BoostModel::default().target(h200(watts, 1980.0, false), share);
            assert!(
                (other - factor).abs() < 0.06,
                "{watts} W at {share}: {other} against {factor}"
            );
        }
    }

    #[test]
    fn the_factor_follows_the_clock_once_learnt() {
        let mut model = BoostModel::default();
        let boosted = model.target(h200(521.0, 1980.0, false), 0.5);
        // Slowed down to 1856 MHz (a limit of 75): part of the boost is left.
        let partial = model.target(h200(640.0, 1856.0, true), 0.7);
        assert!(1.0 < partial && partial < boosted, "{partial} between 1 and {boosted}");
        // Saturated by several containers at the full-load clock: nothing is left to charge.
        let saturated = model.target(h200(690.0, 1600.0, true), 0.3);
        assert!(saturated < 1.02, "{saturated}");
    }

    #[test]
    fn nothing_is_charged_before_the_model_knows_the_work() {
        let mut model = BoostModel::default();
        assert_eq!(
            model.target(h200(690.0, 1600.0, true), 0.3),
            1.0,
            "slowed from the start"
        );
        // Light work (small kernels: 130 W at half the time) never reaches the limit.
        assert_eq!(model.target(h200(130.0, 1980.0, false), 0.5), 1.0);
    }

    #[test]
    fn the_factor_is_bounded_whatever_the_readings() {
        // Another container's power counted as ours: at most MAX_FACTOR.
        assert_eq!(
            BoostModel::default().target(h200(650.0, 1980.0, false), 0.05),
            MAX_FACTOR
        );
        for reading in [
            h200(f64::NAN, 1980.0, false),
            h200(-5.0, 1980.0, false),
            h200(500.0, 0.0, false),
            h200(500.0, f64::INFINITY, false),
            PowerReading {
                limit_watts: 0.0,
                ..h200(300.0, 1980.0, false)
            },
        ] {
            assert_eq!(BoostModel::default().target(reading, 0.5), 1.0, "{reading:?}");
        }
        assert_eq!(BoostModel::default().target(h200(500.0, 1980.0, false), f64::NAN), 1.0);
        assert_eq!(BoostModel::default().target(h200(500.0, 1980.0, false), 0.0), 1.0);
        assert!(BoostModel::default().target(h200(5000.0, 1980.0, false), 1.5) <= MAX_FACTOR);
    }

    #[test]
    fn smoothing_moves_towards_the_target_within_bounds() {
        let mut factor = 1.0;
        for _ in 0..20 {
            factor = smoothed(factor, 1.15);
        }
        assert!((factor - 1.15).abs() < 0.01, "{factor}");
        assert_eq!(smoothed(1.0, 0.5), 1.0);
        assert_eq!(smoothed(1.2, 9.0), MAX_FACTOR);
    }
}
