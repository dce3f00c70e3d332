//! Compensation for the GPU's boost clock.
//!
//! Held to part of its time, a GPU stays under its power limit and runs at a higher clock than
//! busy all the time, so half its time does more than half the unlimited work
//! (results/2026-11-30-h200-compute-time-share.txt). On a board with a profile ([`Profile`], from
//! `boards.toml` by NVML's name: [`super::boards`]) a kernel is charged what it would take on the
//! GPU busy with this container's work alone, so the limit holds in work done. Without a profile,
//! or with `VGPU_COMPUTE_PROFILE=off`, the factor is 1 ([`Compensation::TimeShare`]).
//!
//! The model, fed by NVML once a second:
//! - the GPU's power `P`, its enforced limit `P_cap`, an idle power of [`Profile::idle_share`] of
//!   the board's default limit `P_rated` (idle power is the board's, whatever limit is set), and
//!   the share `s` of the GPU's time the container's kernels take, trimmed to NVML's busy time
//!   (the brackets also read gaps between kernels, which draw no dynamic power; [`busy_share`]);
//! - dynamic power at full load at this clock: `(P - P_idle) / s`;
//! - dynamic power grows as the clock to [`Profile::alpha`], a kernel's time shrinks as the clock
//!   to [`Profile::beta`], so at full load each kernel would run slower by
//!   `((P - P_idle) / s / (P_cap - P_idle)) ^ (beta / alpha)`: the factor charged.
//!
//! NVML's power counts other containers' work as this one's, so the clock bounds the factor: no
//! work draws more than [`Profile::heaviest_work`] times `P_rated` at the highest clock `f_max`,
//! so no GPU busy all the time settles below `f_floor = f_max * ((P_cap - P_idle) /
//! (heaviest_work * P_rated))^(1 / alpha)`, and a kernel at the present clock `f` takes at most
//! `(f / f_floor)^beta` less time than at full load. The clock is one instantaneous reading; the
//! factor's smoothing averages it. Without a clock reading the factor is 1 while the GPU reports a
//! power or thermal slowdown; it never exceeds [`Profile::max_factor`]; without NVML's power
//! readings it is 1.

/// A board's power model: the constants of the model above, fitted to one kind of GPU
/// (`boards.toml`, which documents each; [`super::boards`] reads and checks them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Profile {
    /// Idle power with the clocks up, as a share of the board's default power limit.
    pub idle_share: f64,
    /// Dynamic power grows as the SM clock to this power over the boost range.
    pub alpha: f64,
    /// A kernel's time shrinks as the SM clock to this power.
    pub beta: f64,
    /// The most dynamic power any work draws were the GPU busy all the time at its highest
    /// clock, as a share of the board's default power limit.
    pub heaviest_work: f64,
    /// The largest factor charged.
    pub max_factor: f64,
}

/// How a device's charges follow its power readings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compensation {
    /// The board's power model: the limit is a share of the work the GPU does unlimited.
    Modelled(Profile),
    /// No power model: the limit is a share of the GPU's time (a factor of 1).
    TimeShare,
}

impl Compensation {
    /// Whether the power readings are needed at all.
    pub fn reads_power(self) -> bool {
        matches!(self, Compensation::Modelled(_))
    }

    /// The factor a reading calls for (1 without a model or a reading), given the share of the
    /// GPU's time the container's kernels took (0..=1, before compensation).
    pub fn target_factor(self, reading: Option<PowerReading>, busy_share: f64) -> f64 {
        match (self, reading) {
            (Compensation::Modelled(profile), Some(reading)) => profile.target_factor(reading, busy_share),
            _ => 1.0,
        }
    }

    /// The factor applied now ([`Profile::smoothed`]); 1 without a model.
    pub fn smoothed(self, previous: f64, target: f64, whole: bool) -> f64 {
        match self {
            Compensation::Modelled(profile) => profile.smoothed(previous, target, whole),
            Compensation::TimeShare => 1.0,
        }
    }
}

/// Below this measured share a reading says nothing of the container's work (NVML's figures are
/// whole percent; the power of a GPU this idle is mostly idle power).
pub const MIN_SHARE: f64 = 0.05;
/// Weight of a new reading in the factor (NVML's power is itself a one-second average); the first
/// readings are taken whole, so that a job is charged its boost from its second second.
const SMOOTHING: f64 = 0.5;

/// NVML's clock event reasons that mean the clock is held down by power or heat.
fn slowed_by_power_or_heat(reasons: u64) -> bool {
    use crate::sys::nvml::{
        nvmlClocksEventReasonSwPowerCap, nvmlClocksEventReasonSwThermalSlowdown,
        nvmlClocksThrottleReasonHwPowerBrakeSlowdown, nvmlClocksThrottleReasonHwSlowdown,
        nvmlClocksThrottleReasonHwThermalSlowdown,
    };
    let slowdowns = nvmlClocksEventReasonSwPowerCap
        | nvmlClocksThrottleReasonHwSlowdown
        | nvmlClocksEventReasonSwThermalSlowdown
        | nvmlClocksThrottleReasonHwThermalSlowdown
        | nvmlClocksThrottleReasonHwPowerBrakeSlowdown;
    reasons & u64::from(slowdowns) != 0
}

/// One NVML reading of a GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerReading {
    pub watts: f64,
    /// The enforced power limit.
    pub limit_watts: f64,
    /// The board's default power limit, where NVML gives it (else the enforced one).
    pub rated_watts: Option<f64>,
    /// The GPU reports a power or thermal slowdown now.
    pub slowed: bool,
    /// The SM clock now and its highest (MHz), where NVML gives them.
    pub clock: Option<ClockReading>,
}

/// The SM clock, in MHz.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClockReading {
    pub sm_mhz: f64,
    pub max_sm_mhz: f64,
}

impl ClockReading {
    /// The most a kernel can run faster at this clock than on a GPU busy all the time:
    /// `(f / f_floor)^beta`, at least 1, where the heaviest work at full load would need
    /// `heaviest_over_limit` times the dynamic power the limit allows; `None` for a clock no GPU
    /// reports.
    fn bound(&self, profile: &Profile, heaviest_over_limit: f64) -> Option<f64> {
        let positive = |value: f64| value.is_finite() && value > 0.0;
        if !positive(self.sm_mhz) || !positive(self.max_sm_mhz) || !positive(heaviest_over_limit) {
            return None;
        }
        let floor_ratio = heaviest_over_limit.powf(-1.0 / profile.alpha).min(1.0);
        let ratio = (self.sm_mhz / self.max_sm_mhz).min(1.0);
        Some((ratio / floor_ratio).powf(profile.beta).max(1.0))
    }
}

/// The busy share `s` the power is divided by: the container's own (`own`, its kernels' measured
/// time, trimmed), or without a clock reading NVML's utilisation of the whole GPU (`gpu`) when it
/// is more. With a clock reading the clock bounds other containers' power, and NVML's figure,
/// which counts context switches as busy, would under-charge two processes of one container
/// (results/2026-12-01-h200-compute-two-processes.txt).
pub fn busy_share(own: f64, gpu: Option<f64>, clock_known: bool) -> f64 {
    match gpu {
        Some(gpu) if !clock_known && gpu > own => gpu,
        _ => own,
    }
}

impl Profile {
    /// The factor for one reading, given the share of the GPU's time the container's kernels took
    /// (0..=1, before compensation).
    pub fn target_factor(&self, reading: PowerReading, busy_share: f64) -> f64 {
        let unusable = |value: f64, least: f64| value.is_nan() || value < least;
        if unusable(busy_share, MIN_SHARE)
            || unusable(reading.limit_watts, f64::MIN_POSITIVE)
            || !reading.watts.is_finite()
            || !reading.limit_watts.is_finite()
        {
            return 1.0;
        }
        let rated = reading
            .rated_watts
            .filter(|watts| watts.is_finite() && *watts > 0.0)
            .unwrap_or(reading.limit_watts);
        let idle = self.idle_share * rated;
        // The dynamic power the enforced limit leaves (none for a limit at or below idle power).
        let headroom = reading.limit_watts - idle;
        if headroom.is_nan() || headroom <= 0.0 {
            return 1.0;
        }
        let clock_bound = reading
            .clock
            .and_then(|clock| clock.bound(self, self.heaviest_work * rated / headroom));
        let bound = match (clock_bound, reading.slowed) {
            (Some(bound), _) => bound,
            (None, true) => return 1.0,
            (None, false) => self.max_factor,
        };
        let full_load_dynamic = (reading.watts - idle).max(0.0) / busy_share.min(1.0);
        let over_limit = full_load_dynamic / headroom;
        if over_limit <= 1.0 {
            1.0
        } else {
            over_limit.powf(self.beta / self.alpha).min(bound).min(self.max_factor)
        }
    }

    /// The factor applied now: the target itself while `whole` (the first readings), then moved a
    /// step towards the target at each reading.
    pub fn smoothed(&self, previous: f64, target: f64, whole: bool) -> f64 {
        let weight = if whole { 1.0 } else { SMOOTHING };
        let next = previous + weight * (target - previous);
        // Never a panic, even for a profile that broke the rules boards.rs checks.
        next.clamp(1.0, self.max_factor.max(1.0))
    }
}

/// NVML's reading of the GPU with this handle; `None` where NVML has no power readings.
pub fn read(device: crate::sys::nvml::nvmlDevice_t) -> Option<PowerReading> {
    use crate::hooks::real;
    use crate::sys::nvml::NVML_SUCCESS;
    let (power, limit) = (
        real::nvmlDeviceGetPowerUsage()?,
        real::nvmlDeviceGetEnforcedPowerLimit()?,
    );
    let (mut milliwatts, mut limit_milliwatts) = (0u32, 0u32);
    // SAFETY: a handle NVML gave and local out-pointers.
    let read = unsafe {
        power(device, &mut milliwatts) == NVML_SUCCESS && limit(device, &mut limit_milliwatts) == NVML_SUCCESS
    };
    if !read || limit_milliwatts == 0 {
        return None;
    }
    // The reasons' newer name (R535 on); older drivers have the same function as
    // ...ThrottleReasons. Without either, the slowdown safeguard cannot work: no compensation.
    let get_reasons = real::quiet::nvmlDeviceGetCurrentClocksEventReasons()
        .or_else(real::quiet::nvmlDeviceGetCurrentClocksThrottleReasons)?;
    let mut reasons = 0u64;
    // SAFETY: a device handle NVML gave and a local out-pointer.
    if unsafe { get_reasons(device, &mut reasons) } != NVML_SUCCESS {
        return None;
    }
    let slowed = slowed_by_power_or_heat(reasons);
    Some(PowerReading {
        watts: f64::from(milliwatts) / 1000.0,
        limit_watts: f64::from(limit_milliwatts) / 1000.0,
        rated_watts: read_default_limit(device),
        slowed,
        clock: read_clock(device),
    })
}

/// NVML's default power limit of the board (watts); `None` where NVML does not give it.
fn read_default_limit(device: crate::sys::nvml::nvmlDevice_t) -> Option<f64> {
    use crate::sys::nvml::NVML_SUCCESS;
    let default_limit = crate::hooks::real::nvmlDeviceGetPowerManagementDefaultLimit()?;
    let mut milliwatts = 0u32;
    // SAFETY: a handle NVML gave and a local out-pointer.
    let read = unsafe { default_limit(device, &mut milliwatts) } == NVML_SUCCESS;
    (read && milliwatts > 0).then(|| f64::from(milliwatts) / 1000.0)
}

/// NVML's SM clock and highest SM clock; `None` where NVML does not give them.
fn read_clock(device: crate::sys::nvml::nvmlDevice_t) -> Option<ClockReading> {
    use crate::hooks::real;
    use crate::sys::nvml::{NVML_CLOCK_SM, NVML_SUCCESS};
    let (clock, max_clock) = (real::nvmlDeviceGetClockInfo()?, real::nvmlDeviceGetMaxClockInfo()?);
    let (mut sm_mhz, mut max_sm_mhz) = (0u32, 0u32);
    // SAFETY: a handle NVML gave and local out-pointers.
    let read = unsafe {
        clock(device, NVML_CLOCK_SM, &mut sm_mhz) == NVML_SUCCESS
            && max_clock(device, NVML_CLOCK_SM, &mut max_sm_mhz) == NVML_SUCCESS
    };
    read.then_some(ClockReading {
        sm_mhz: f64::from(sm_mhz),
        max_sm_mhz: f64::from(max_sm_mhz),
    })
}

#[cfg(test)]
mod tests {
    use vgpu_config::ComputeProfile;

    use super::*;
    use crate::throttle::boards;

    /// The H200's profile, looked up by its NVML name.
    fn board() -> Profile {
        match boards::choose(ComputeProfile::Auto, Some("NVIDIA H200")).compensation {
            Compensation::Modelled(profile) => profile,
            Compensation::TimeShare => panic!("the H200 has no board profile"),
        }
    }

    fn h200(watts: f64) -> PowerReading {
        PowerReading {
            watts,
            limit_watts: 700.0,
            rated_watts: Some(700.0),
            slowed: false,
            clock: None,
        }
    }

    fn at_clock(watts: f64, sm_mhz: f64, slowed: bool) -> PowerReading {
        PowerReading {
            slowed,
            clock: Some(ClockReading {
                sm_mhz,
                max_sm_mhz: 1980.0,
            }),
            ..h200(watts)
        }
    }

    #[test]
    fn nvml_utilisation_counts_only_without_a_clock_reading() {
        // Two processes of one container on the H200: kernels 0.47 of the time, NVML 0.6.
        assert_eq!(busy_share(0.47, Some(0.6), true), 0.47);
        assert_eq!(busy_share(0.47, Some(0.6), false), 0.6);
        assert_eq!(busy_share(0.47, Some(0.3), false), 0.47);
        assert_eq!(busy_share(0.47, None, false), 0.47);
        // The GEMM held to half the GPU by two processes is charged about its boost (1.16, under
        // the clock's bound of 1.18 at 1980 MHz), not the 1.08-1.10 that NVML's share gave.
        let reading = at_clock(501.0, 1980.0, false);
        let two = board().target_factor(reading, busy_share(0.47, Some(0.6), true));
        assert!((1.15..=1.19).contains(&two), "{two}");
        assert!(board().target_factor(reading, 0.6) < 1.11);
    }

    #[test]
    fn a_boosted_gemm_is_charged_its_time_at_full_load() {
        // The H200 GEMM held to half its time: 501 W at 1980 MHz, 176 us per product against
        // 206 us unlimited (a factor of 1.17; results/2026-11-30-h200-compute-time-share.txt).
        let factor = board().target_factor(h200(501.0), 0.5);
        assert!((1.12..=1.19).contains(&factor), "{factor}");
        assert_eq!(board().target_factor(at_clock(501.0, 1980.0, false), 0.5), factor);
        // The same GPU at a tenth and at a quarter of its time: the same full-load power, so
        // about the same factor.
        for (watts, share) in [(201.0, 0.1), (318.0, 0.25)] {
            let other = board().target_factor(h200(watts), share);
            assert!(
                (other - factor).abs() < 0.06,
                "{watts} W at {share}: {other} against {factor}"
            );
        }
    }

    #[test]
    fn a_gpu_at_its_power_limit_keeps_the_boost_its_clock_shows() {
        // The H200 GEMM held to 75% and unlimited (results/2026-11-30-h200-gemm75-clock-trace.txt,
        // results/2026-11-30-h200-compute-boost-clock-branch.txt): each product takes
        // (1860 / 1625)^0.66 = 1.09 less time held.
        let factor = board().target_factor(at_clock(658.0, 1860.0, true), 0.75);
        assert!((1.07..=1.13).contains(&factor), "{factor}");
        // Without the clock, a slowed GPU is charged its time.
        assert_eq!(
            board().target_factor(
                PowerReading {
                    slowed: true,
                    ..h200(658.0)
                },
                0.75
            ),
            1.0
        );
    }

    #[test]
    fn a_saturated_shared_gpu_is_charged_the_boost_its_clock_shows() {
        // Two containers at 30 and 70 saturate the H200 with GEMMs: 1568-1618 MHz, 690 W
        // (-trimmed-share-compute-jobs-part1.txt), where one GEMM alone busy all the time runs at
        // 1478-1494 MHz. Each sees all the power as its own; the clock bounds the charge, the
        // same for both: (1618 / 1468)^0.66 = 1.066 (the old floor's 1549 MHz gave 1.029).
        let reading = at_clock(690.0, 1618.0, true);
        let small = board().target_factor(reading, busy_share(0.3, Some(1.0), true));
        assert!((1.05..1.08).contains(&small), "{small}");
        assert_eq!(small, board().target_factor(reading, busy_share(0.63, Some(1.0), true)));
        // A GEMM held to 90% alone at 1630 MHz: the power (685 W over a trimmed share of 0.86)
        // calls for 1.056, under the clock's bound of (1630 / 1468)^0.66 = 1.072; the old floor
        // cut it to 1.034.
        let held = board().target_factor(at_clock(685.0, 1630.0, true), 0.86);
        assert!((1.045..=1.075).contains(&held), "{held}");
        // Without the clock the power alone charges the whole range.
        assert_eq!(board().target_factor(h200(671.0), 0.3), board().max_factor);
    }

    #[test]
    fn a_lowered_power_limit_is_modelled_in_the_boards_watts() {
        // An administrator set 500 W on a 700 W board; the GEMM held to 75% runs at 1500 MHz,
        // slowed, at 480 W. Busy all the time it would settle near 1100 MHz, so a factor of
        // about 1.1 is due.
        let lowered = |rated_watts| PowerReading {
            limit_watts: 500.0,
            rated_watts,
            ..at_clock(480.0, 1500.0, true)
        };
        let factor = board().target_factor(lowered(Some(700.0)), 0.75);
        assert!((1.05..=1.15).contains(&factor), "{factor}");
        // Scaled by the enforced limit instead, the idle power and the heaviest work shrink with
        // it and 1500 MHz looks like full load (the floor's 1468 MHz: at most 1.02).
        assert!(board().target_factor(lowered(None), 0.75) < 1.02);
        // A limit at or below the idle power leaves nothing to model.
        let starved = PowerReading {
            limit_watts: 100.0,
            ..lowered(Some(700.0))
        };
        assert_eq!(board().target_factor(starved, 0.75), 1.0);
    }

    #[test]
    fn light_work_is_charged_its_time() {
        // Small kernels: 130 W at half the time is far below the limit at full load.
        assert_eq!(board().target_factor(h200(130.0), 0.5), 1.0);
        assert_eq!(board().target_factor(at_clock(130.0, 1980.0, false), 0.5), 1.0);
    }

    #[test]
    fn the_factor_is_bounded_whatever_the_readings() {
        // Another container's power counted as ours: at most the board's largest factor.
        assert_eq!(board().target_factor(h200(650.0), 0.05), board().max_factor);
        for reading in [
            h200(f64::NAN),
            h200(-5.0),
            PowerReading {
                limit_watts: 0.0,
                ..h200(300.0)
            },
            at_clock(600.0, 0.0, true),
            at_clock(600.0, f64::NAN, true),
            at_clock(600.0, 1900.0, true).with_max_clock(0.0),
            PowerReading {
                rated_watts: Some(f64::NAN),
                limit_watts: f64::INFINITY,
                ..at_clock(600.0, 1900.0, true)
            },
        ] {
            assert_eq!(board().target_factor(reading, 0.5), 1.0, "{reading:?}");
        }
        assert_eq!(board().target_factor(h200(500.0), f64::NAN), 1.0);
        assert_eq!(board().target_factor(h200(500.0), 0.0), 1.0);
        assert!(board().target_factor(h200(5000.0), 1.5) <= board().max_factor);
        // A clock above the highest counts as the highest.
        let over = board().target_factor(at_clock(650.0, 5000.0, false), 0.05);
        assert!(over <= board().max_factor && over == board().target_factor(at_clock(650.0, 1980.0, false), 0.05));
    }

    impl PowerReading {
        fn with_max_clock(self, max_sm_mhz: f64) -> Self {
            let clock = self.clock.map(|clock| ClockReading { max_sm_mhz, ..clock });
            Self { clock, ..self }
        }
    }

    #[test]
    fn smoothing_moves_towards_the_target_within_bounds() {
        let mut factor = 1.0;
        for _ in 0..20 {
            factor = board().smoothed(factor, 1.15, false);
        }
        assert!((factor - 1.15).abs() < 0.01, "{factor}");
        assert_eq!(board().smoothed(1.0, 1.2, false), 1.1);
        assert_eq!(
            board().smoothed(1.0, 1.2, true),
            1.2,
            "the first reading is taken whole"
        );
        assert_eq!(board().smoothed(1.0, 0.5, true), 1.0);
        assert_eq!(board().smoothed(1.2, 9.0, false), board().max_factor);
    }

    #[test]
    fn without_a_profile_or_with_off_a_board_is_charged_its_time_whatever_the_power() {
        let modelled = boards::choose(ComputeProfile::Auto, Some("NVIDIA H200")).compensation;
        let unknown = boards::choose(ComputeProfile::Auto, Some("NVIDIA A100-SXM4-80GB")).compensation;
        let off = boards::choose(ComputeProfile::Off, Some("NVIDIA H200")).compensation;
        assert!(modelled.reads_power());
        for time_share in [unknown, off] {
            assert_eq!(time_share, Compensation::TimeShare);
            assert!(!time_share.reads_power());
            assert_eq!(time_share.smoothed(1.0, 1.2, true), 1.0);
            assert_eq!(time_share.smoothed(1.2, 1.2, false), 1.0);
        }
        // Readings that call for every factor the H200's model gives, up to its largest.
        let hungry = [
            (h200(501.0), 0.5),
            (at_clock(501.0, 1980.0, false), 0.5),
            (at_clock(658.0, 1860.0, true), 0.75),
            (h200(650.0), 0.05),
            (h200(5000.0), 1.5),
        ];
        for (reading, share) in hungry {
            let factor = modelled.target_factor(Some(reading), share);
            assert_eq!(factor, board().target_factor(reading, share));
            assert!(factor > 1.05, "{reading:?}");
            for time_share in [unknown, off] {
                assert_eq!(time_share.target_factor(Some(reading), share), 1.0, "{reading:?}");
            }
        }
        assert_eq!(modelled.smoothed(1.0, 1.2, true), 1.2);
        // Without a power reading even the model charges the time.
        assert_eq!(modelled.target_factor(None, 0.5), 1.0);
    }
}
