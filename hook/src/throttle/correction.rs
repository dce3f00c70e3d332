//! The one correction of the charges beyond the sensor's measurements: a factor per device that
//! every measured or planned time is charged at, followed once a second from NVML. Two parts:
//!
//! - **NVML's trim** (at most 1): a bracket reads a kernel's time plus some of the GPU's time
//!   between kernels (the front end, and on a busy stream more of the events' own time than
//!   [`super::sensor::BRACKET_OVERHEAD_NS`]), so where NVML sees the GPU busy for less than the
//!   sensor measured, the charges are trimmed to NVML's figure. NVML covers the whole GPU, so it
//!   can only show the measurements too high, never too low. A reading far below the measured
//!   share is a GPU whose NVML does not see the work (a VM, a broken figure) and is left out, as
//!   is a share too small to compare. The trim is NVML's busy time over the measured, summed over
//!   readings that decay with [`WINDOW_S`]; the ratio does not move with the charges, so the
//!   first readings already give it.
//! - **The boost compensation** (at least 1, only on a board with a profile): [`super::boost`],
//!   fed with the trimmed share (dynamic power is drawn while kernels run, not in the gaps).
//!
//! The measured share is the charged time divided by the factor it was charged at, so neither
//! part feeds back into the other. Without NVML's readings the factor is 1.

use super::boost::{self, Compensation, MIN_SHARE, PowerReading};

/// The lowest trim: a reading that would need less says NVML does not see this work.
pub const MIN_TRIM: f64 = 0.85;
/// Fewer NVML samples than this in a reading (the first second's 250 ms readings hold 1-3) say
/// too little: one sample of a job with phases swings by tens of points.
pub const MIN_SAMPLES: usize = 4;
/// The time constant of the trim's window, in seconds of readings: long enough to average
/// NVML's swings, short enough to follow a change of work within a few seconds.
pub const WINDOW_S: f64 = 5.0;

/// One NVML reading of a device, as the background thread takes it once a second.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reading {
    /// `nvmlDeviceGetUtilizationRates` (0..=1): NVML's last sample period only.
    pub utilisation: Option<f64>,
    /// The mean of NVML's utilisation samples since the last reading (0..=1), and their count.
    pub samples: Option<(f64, usize)>,
    pub power: Option<PowerReading>,
}

/// A device's correction: the boost compensation chosen for its board, the trim's window, and
/// the factor in force.
#[derive(Clone, Copy, Debug)]
pub struct Correction {
    compensation: Compensation,
    boost: f64,
    window: Window,
    readings: u32,
}

impl Correction {
    pub fn new(compensation: Compensation) -> Correction {
        Correction {
            compensation,
            boost: 1.0,
            window: Window::default(),
            readings: 0,
        }
    }

    /// Whether the power readings are needed at all.
    pub fn reads_power(&self) -> bool {
        self.compensation.reads_power()
    }

    /// The factor charges are scaled by now: the boost factor times the trim.
    pub fn factor(&self) -> f64 {
        self.boost * self.window.trim()
    }

    /// The boost factor and the trim, for the log.
    pub fn parts(&self) -> (f64, f64) {
        (self.boost, self.window.trim())
    }

    /// Follows one reading of `seconds`, in which the container was charged `charged` of the
    /// device's time (every process of it, at this factor); `starting`: the first readings of the
    /// process (every 250 ms), which NVML's utilisation cannot be compared in (its figure covers
    /// up to a second before the first launch) and which the boost factor takes whole. Returns the
    /// new factor.
    pub fn follow(&mut self, charged: f64, reading: Reading, seconds: f64, starting: bool) -> f64 {
        let measured = charged / self.factor();
        let nvml_share = reading.samples.map(|(mean, _)| mean).or(reading.utilisation);
        let enough = reading.samples.is_none_or(|(_, count)| count >= MIN_SAMPLES);
        if !starting && enough && self.readings > 0 {
            // A reading counts for at most two seconds (a poller late to read NVML).
            self.window.add(measured, nvml_share, seconds.min(2.0));
        }
        let clock_known = reading.power.is_some_and(|power| power.clock.is_some());
        let share = boost::busy_share(measured * self.window.trim(), reading.utilisation, clock_known);
        let target = self.compensation.target_factor(reading.power, share);
        self.boost = self
            .compensation
            .smoothed(self.boost, target, starting || self.readings == 0);
        self.readings = self.readings.saturating_add(1);
        self.factor()
    }
}

/// Busy time NVML saw and the sensor measured over the recent readings (seconds, decaying), and
/// how much of the recent time NVML could be compared at all.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    nvml: f64,
    measured: f64,
    /// Seconds of readings NVML's figure was compared in, and of readings where the container
    /// ran at all (decaying alike).
    compared: f64,
    busy: f64,
}

impl Window {
    /// Adds a reading of `seconds`: `measured`, the share of it the container's kernels took as
    /// the sensor measured them (before the boost factor and the trim); `nvml`, NVML's
    /// utilisation of the GPU over it (0..=1), `None` where it gives none. A reading where the
    /// container ran but NVML's figure says nothing (none, 0%, far below the measured share)
    /// moves the trim back towards 1: it is not kept from before for work NVML no longer sees.
    pub fn add(&mut self, measured: f64, nvml: Option<f64>, seconds: f64) {
        if !measured.is_finite() || measured < MIN_SHARE || !seconds.is_finite() || seconds <= 0.0 {
            return; // the container hardly ran: nothing to compare, nothing to forget
        }
        let keep = (-seconds / WINDOW_S).exp();
        self.busy = self.busy * keep + seconds;
        let usable = nvml.filter(|nvml| nvml.is_finite() && *nvml > 0.0 && nvml / measured >= MIN_TRIM);
        let Some(nvml) = usable else {
            self.compared *= keep;
            return;
        };
        // NVML's figure may exceed the measured share many times over (other work): kept at 2x,
        // so that such a stretch is forgotten as fast as any other once it ends.
        let nvml = nvml.min(2.0 * measured);
        self.nvml = self.nvml * keep + nvml * seconds;
        self.measured = self.measured * keep + measured * seconds;
        self.compared = self.compared * keep + seconds;
    }

    /// The trim: NVML's busy time over the measured, within [`MIN_TRIM`]..=1, weighed towards 1
    /// by the share of the recent time NVML could not be compared in; 1 before any reading.
    pub fn trim(&self) -> f64 {
        if self.measured <= 0.0 || self.busy <= 0.0 {
            return 1.0;
        }
        let ratio = (self.nvml / self.measured).clamp(MIN_TRIM, 1.0);
        let weight = (self.compared / self.busy).clamp(0.0, 1.0);
        1.0 - (1.0 - ratio) * weight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nvml(share: f64) -> Reading {
        Reading {
            utilisation: Some(share),
            samples: Some((share, 6)),
            power: None,
        }
    }

    #[test]
    fn the_correction_divides_out_its_own_factor_and_skips_the_first_readings() {
        let mut correction = Correction::new(Compensation::TimeShare);
        // The start: NVML's figure covers time before the first launch, so nothing is compared.
        for _ in 0..6 {
            assert_eq!(correction.follow(0.5, nvml(0.1), 0.25, true), 1.0);
        }
        // NVML sees 0.92 of what the sensor measured: the charges follow, and so does the
        // share charged, which the factor in force is taken out of.
        let mut factor = 1.0;
        for _ in 0..10 {
            let charged = 0.5 * factor;
            factor = correction.follow(charged, nvml(0.46), 1.0, false);
            assert!((factor - 0.92).abs() < 1e-9, "{factor}");
        }
        assert_eq!(correction.parts(), (1.0, factor));
        // Too few NVML samples in a reading: not compared, the factor stays.
        let sparse = Reading {
            samples: Some((0.3, MIN_SAMPLES - 1)),
            ..nvml(0.3)
        };
        assert_eq!(correction.follow(0.46, sparse, 1.0, false), factor);
    }

    #[test]
    fn nvml_below_the_measurements_trims_them_from_the_first_reading() {
        // About the H200 training step at 75 (NVML saw 0.97 of the measured time). The bucket charges
        // 75% of trimmed time, so the sensor measures 75/trim.
        let mut window = Window::default();
        assert_eq!(window.trim(), 1.0);
        for _ in 0..10 {
            let measured = 0.75 / window.trim();
            window.add(measured, Some(measured * 0.968), 1.0);
            assert!((window.trim() - 0.968).abs() < 1e-9, "{}", window.trim());
        }
    }

    #[test]
    fn the_window_follows_a_change_within_a_few_seconds() {
        let mut window = Window::default();
        for _ in 0..20 {
            window.add(0.5, Some(0.45), 1.0);
        }
        assert!((window.trim() - 0.9).abs() < 1e-9);
        for _ in 0..5 {
            window.add(0.5, Some(0.5), 1.0);
        }
        // After one time constant, about 1/e of the old ratio's weight is left.
        let trim = window.trim();
        assert!((0.96..0.97).contains(&trim), "{trim}");
        // Short readings weigh less than long ones.
        let mut short = Window::default();
        short.add(0.5, Some(0.45), 1.0);
        short.add(0.5, Some(0.5), 0.25);
        assert!(short.trim() < 0.93, "{}", short.trim());
    }

    #[test]
    fn nvml_above_the_measurements_leaves_the_trim_at_one() {
        // Another container's work, or NVML counting the gaps between kernels as busy.
        let mut window = Window::default();
        window.add(0.5, Some(0.95), 1.0);
        assert_eq!(window.trim(), 1.0);
        // Then alone again: the stretch of other work is forgotten like any other.
        let mut window = Window::default();
        for _ in 0..10 {
            window.add(0.2, Some(1.0), 1.0);
        }
        for _ in 0..10 {
            window.add(0.5, Some(0.46), 1.0);
        }
        let trim = window.trim();
        assert!(trim < 1.0, "{trim}");
    }

    #[test]
    fn readings_of_an_idle_container_or_bad_input_are_left_out() {
        let mut window = Window::default();
        window.add(0.5, Some(0.46), 1.0);
        let before = window;
        window.add(0.01, Some(0.009), 1.0);
        window.add(0.01, None, 1.0);
        window.add(f64::NAN, Some(0.4), 1.0);
        window.add(0.5, Some(0.46), 0.0);
        window.add(0.5, Some(0.46), -1.0);
        window.add(0.5, Some(0.46), f64::NAN);
        assert_eq!(window, before);
        assert!((window.trim() - 0.92).abs() < 1e-9);
    }

    #[test]
    fn readings_nvml_cannot_compare_move_the_trim_back_to_one() {
        for unusable in [None, Some(0.0), Some(0.2), Some(f64::INFINITY), Some(f64::NAN)] {
            let mut window = Window::default();
            for _ in 0..10 {
                window.add(0.5, Some(0.46), 1.0);
            }
            assert!((window.trim() - 0.92).abs() < 1e-9);
            window.add(0.5, unusable, 1.0);
            let after_one = window.trim();
            assert!(after_one > 0.92 && after_one < 0.94, "{unusable:?}: {after_one}");
            for _ in 0..30 {
                window.add(0.5, unusable, 1.0);
            }
            assert!(window.trim() > 0.999, "{unusable:?}: {}", window.trim());
        }
    }
}
