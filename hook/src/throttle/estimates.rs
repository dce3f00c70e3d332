//! What a launch costs: per launch key (a function with its grid, or a graph), an estimate of its
//! GPU time learnt from sampled measurements, and which launches to sample.
//!
//! A launch is charged its key's estimate when admitted. A measurement also stands for the
//! launches of its key charged since the previous one, so their charges are corrected to the new
//! estimate: the accounting stays unbiased however rarely a key is sampled.
//!
//! Samples are chosen by count, not by time: the first launch after the limiter's pause finds an
//! idle GPU and runs longer, so a time-based choice over-charges (docs/compute-limit.md, "Why by
//! count"). After each sample a key counts down a random number of launches, centred on about
//! [`KEY_RESAMPLE_NS`] at its rate: every launch is equally likely to be measured.
//!
//! A key's first launch is never measured: lazy module loading makes its time the host's. While
//! a key is young its estimate is the median of its measurements (of two, the smaller), which one
//! distorted measurement cannot set and which does not under-charge a varying kernel.

use super::bucket::DEBT_FLOOR_NS;

/// Launches of a new key that are all measured, so its estimate settles at once.
pub const YOUNG_SAMPLES: u32 = 4;
/// Measurements after which a key's estimate is trusted enough to bound outliers.
pub const SETTLED_SAMPLES: u32 = 3;
/// A key that keeps launching is measured again after this long.
pub const KEY_RESAMPLE_NS: u64 = 50_000_000;
/// A key whose measurements deviate from its estimate by this share (in percent) on average or
/// less is sampled every [`KEY_RESAMPLE_NS`].
pub const STEADY_DEVIATION_PERCENT: u64 = 10;
/// Samples over which a slow running figure follows a change: the deviation and mean that set a
/// key's sampling rate (a fast one would bias which estimates the launches are charged at), and a
/// key's recent high returning to its estimate.
pub const SLOW_SMOOTHING: u64 = 64;
/// Samples over which a quick running figure mostly follows a change: a key's launch rate (which
/// sets its sampling stride) and a device's overlap of streams ([`super::overlap`]).
pub const QUICK_SMOOTHING: u64 = 16;
/// How many times as often a key whose time varies most is sampled.
pub const VARYING_SAMPLE_BOOST: u64 = 16;
/// A sample that could not be taken is taken again within this many launches of its key.
pub const RETRY_SPREAD: u64 = 4;
/// A settled key is measured at most once in this many of its launches, on average: a sample
/// adds two event records to its launch.
pub const MIN_SAMPLE_STRIDE: u64 = 16;
/// How much a key's sampling stride may grow from one sample to the next.
pub const STRIDE_GROWTH: u32 = 2;
/// Beyond the young ones, at most one sample per this interval, process-wide (keeps the added
/// event records, a few microseconds each, below ~0.5% of a launching thread's time).
pub const GLOBAL_SAMPLE_INTERVAL_NS: u64 = 1_000_000;
/// A settled key's measurement counts for at most this many times its recent highs.
pub const HIGH_BOUND: u64 = 2;
/// A key's recent high is at most this many times its estimate.
pub const HIGH_CEILING: u64 = 16;
/// The charge of a key never measured, before any measurement at all: high, so that new work
/// cannot run ahead of the first measurements (an over-charge is refunded within milliseconds).
pub const PRIOR_NS: u64 = 1_000_000;

const TABLE_SIZE: usize = 1024;
const PROBES: usize = 8;

#[derive(Clone, Copy, Default)]
struct Entry {
    /// 0 = empty.
    key: u64,
    /// Smoothed measured cost in ns; 0 until the first measurement.
    estimate: u64,
    /// Launches of this key (saturating).
    launches: u32,
    /// Samples taken (issued) for this key.
    issued: u32,
    /// Measurements received for this key.
    received: u32,
    /// The first measurements (ns, saturated), while the key is young.
    young: [u32; YOUNG_SAMPLES as usize],
    last_sample_ns: u64,
    /// Launches of this key since its last sample.
    since_sample: u32,
    /// Slowly smoothed time between launches of this key (ns), 0 until two samples were taken:
    /// what the sampling stride follows ([`Estimates::plan`]).
    launch_gap_ns: u64,
    /// Launches to let pass before the next sample.
    countdown: u32,
    last_use_ns: u64,
    /// Launches charged since the last measurement arrived and not themselves measured.
    uncorrected: u64,
    /// What those launches were charged.
    uncorrected_charged: u64,
    /// The key's recent long measurements: the highest counted, decaying towards the estimate
    /// ([`Entry::bounded`]); 0 until the key settles.
    high: u64,
    /// Slowly smoothed absolute difference between a measurement and the estimate it arrived to
    /// (ns), and slowly smoothed measurement: what the sampling rate follows ([`Entry::resample_ns`]).
    deviation: u64,
    slow_mean: u64,
}

impl Entry {
    /// How long this key's launches go between samples: a key whose time varies is sampled up to
    /// [`VARYING_SAMPLE_BOOST`] times as often, as the square of its relative deviation beyond
    /// [`STEADY_DEVIATION_PERCENT`] (its estimate is only as good as its samples per second).
    fn resample_ns(&self) -> u64 {
        let relative = u128::from(self.deviation) * 100 / u128::from(self.slow_mean.max(1));
        let steady = u128::from(STEADY_DEVIATION_PERCENT);
        let boost = (relative.saturating_mul(relative) / (steady * steady)).clamp(1, u128::from(VARYING_SAMPLE_BOOST));
        KEY_RESAMPLE_NS / boost as u64
    }

    /// What a measurement of a settled key counts for: at most [`HIGH_BOUND`] times its recent
    /// highs, themselves at most [`HIGH_CEILING`] times its estimate. A long time is usually the
    /// kernel's own (one grid can run tensors of any size) and is reached within a few samples if
    /// it recurs; a rare stretch by the host or another context moves the estimate a bounded step
    /// (docs/compute-limit.md, "Long measurements").
    fn bounded(&mut self, measured_ns: u64) -> u64 {
        let high = self
            .high
            .max(self.estimate)
            .min(self.estimate.saturating_mul(HIGH_CEILING));
        let counted = measured_ns.min(high.saturating_mul(HIGH_BOUND));
        self.high = counted.max(high - (high - self.estimate) / SLOW_SMOOTHING);
        counted
    }

    /// A launch charged `charge` and not measured: corrected by the next measurement.
    fn leave_uncorrected(&mut self, charge: u64) {
        self.uncorrected += 1;
        self.uncorrected_charged = self.uncorrected_charged.saturating_add(charge);
    }
}

/// The launch plan: what to charge and whether to measure this launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub charge: u64,
    pub sample: bool,
}

pub struct Estimates {
    entries: Vec<Entry>,
    /// Smoothed cost over all keys: the charge of a key not measured yet.
    overall: u64,
    last_global_sample_ns: u64,
    /// State of the generator that spreads the samples (xorshift64).
    random: u64,
}

impl Default for Estimates {
    fn default() -> Self {
        Self {
            // Allocated at the first launch: most devices of a process never launch.
            entries: Vec::new(),
            overall: 0,
            last_global_sample_ns: 0,
            random: 0x2545_f491_4f6c_dd1d,
        }
    }
}

fn mix(key: u64) -> usize {
    (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize
}

impl Estimates {
    fn slot(&mut self, key: u64, now: u64) -> &mut Entry {
        if self.entries.is_empty() {
            self.entries = vec![Entry::default(); TABLE_SIZE];
        }
        let home = mix(key);
        let mut victim = home % TABLE_SIZE;
        for probe in 0..PROBES {
            let index = (home + probe) % TABLE_SIZE;
            let entry = self.entries[index];
            if entry.key == key || entry.key == 0 {
                victim = index;
                break;
            }
            if entry.last_use_ns < self.entries[victim].last_use_ns {
                victim = index;
            }
        }
        let entry = &mut self.entries[victim];
        if entry.key != key {
            // A new key, or the least recently used of the probed ones is forgotten (its pending
            // corrections with it: a bounded, rare loss).
            *entry = Entry {
                key,
                ..Entry::default()
            };
        }
        entry.last_use_ns = now;
        entry
    }

    fn find(&mut self, key: u64) -> Option<&mut Entry> {
        let home = mix(key);
        let index = (0..PROBES)
            .map(|probe| (home + probe) % TABLE_SIZE)
            .find(|&index| self.entries.get(index).is_some_and(|entry| entry.key == key))?;
        self.entries.get_mut(index)
    }

    /// A random number in `[0, bound)` (0 when `bound` is 0).
    fn random_below(&mut self, bound: u64) -> u64 {
        self.random ^= self.random << 13;
        self.random ^= self.random >> 7;
        self.random ^= self.random << 17;
        if bound == 0 { 0 } else { self.random % bound }
    }

    /// The charge of a launch of `key` now, and whether to measure it. A launch that is not
    /// measured is recorded for correction; one that is must be followed by [`Self::measured`]
    /// or, if the measurement could not be set up, [`Self::not_measured`].
    pub fn plan(&mut self, key: u64, now: u64) -> Plan {
        let prior = if self.overall > 0 { self.overall } else { PRIOR_NS };
        let global_due = now.saturating_sub(self.last_global_sample_ns) >= GLOBAL_SAMPLE_INTERVAL_NS;
        let spread = self.random_below(u64::MAX);
        let entry = self.slot(key, now);
        let charge = if entry.estimate > 0 { entry.estimate } else { prior };
        entry.since_sample = entry.since_sample.saturating_add(1);
        entry.launches = entry.launches.saturating_add(1);
        let sample = if entry.launches == 1 {
            // The first launch may load the function's module: its time is not the kernel's.
            false
        } else if entry.issued < YOUNG_SAMPLES {
            true
        } else if entry.countdown > 0 {
            entry.countdown -= 1;
            false
        } else if global_due {
            true
        } else {
            // Another key was measured less than the interval ago: a few launches later, at random.
            entry.countdown = (spread % 4) as u32 + 1;
            false
        };
        if sample {
            // About KEY_RESAMPLE_NS worth of launches at the key's rate (at least
            // MIN_SAMPLE_STRIDE), spread uniformly over half to one and a half times that. The
            // rate is smoothed: a limited key runs faster while its estimate is low, and following
            // the latest rate under-charges a varying key. The stride grows at most STRIDE_GROWTH
            // times a sample: the young samples' rate is a burst's.
            let elapsed = now.saturating_sub(entry.last_sample_ns).max(1);
            if entry.issued > 0 {
                let gap = elapsed / u64::from(entry.since_sample.max(1));
                let weight = u64::from(entry.issued).min(QUICK_SMOOTHING);
                // A key that slowed down by half or more is followed at once: sampled too rarely,
                // its estimate would lag; sampled too often, it only costs event records.
                entry.launch_gap_ns = if entry.launch_gap_ns == 0 || gap / 2 >= entry.launch_gap_ns {
                    gap
                } else {
                    (entry.launch_gap_ns.saturating_mul(weight - 1).saturating_add(gap)) / weight
                };
            }
            let per_interval = u128::from(entry.resample_ns()) / u128::from(entry.launch_gap_ns.max(1));
            let stride = per_interval
                .min(u128::from(entry.since_sample) * u128::from(STRIDE_GROWTH))
                .clamp(u128::from(MIN_SAMPLE_STRIDE), u128::from(u32::MAX / 2)) as u64;
            entry.countdown = (stride / 2 + spread % (stride + 1)) as u32;
            entry.issued = entry.issued.saturating_add(1);
            entry.last_sample_ns = now;
            entry.since_sample = 0;
        } else {
            entry.leave_uncorrected(charge);
        }
        if sample && entry.issued > YOUNG_SAMPLES {
            self.last_global_sample_ns = now;
        }
        Plan { charge, sample }
    }

    /// A planned launch that will not run now (its stream is being captured, or the limit was
    /// lifted while it waited): as if it had not been planned, so that a young key still gets its
    /// first measurements and no correction counts it. The process-wide sample slot and the rate
    /// window are not given back: off by one launch at most, and rare.
    pub fn forget(&mut self, key: u64, plan: Plan) {
        if let Some(entry) = self.find(key) {
            if plan.sample {
                entry.issued = entry.issued.saturating_sub(1);
                entry.countdown = 0;
            } else {
                entry.uncorrected = entry.uncorrected.saturating_sub(1);
                entry.uncorrected_charged = entry.uncorrected_charged.saturating_sub(plan.charge);
            }
        }
    }

    /// A planned sample that could not be taken or cannot be trusted (the launch call waited on the
    /// host long enough for the GPU to wait on it): the launch joins the uncorrected ones, and the
    /// key is measured again within its next [`RETRY_SPREAD`] launches, at random (the launch right
    /// after is no random choice: a kernel alternating its time would be measured at the other).
    pub fn not_measured(&mut self, key: u64, charge: u64) {
        let spread = self.random_below(RETRY_SPREAD);
        if let Some(entry) = self.find(key) {
            entry.leave_uncorrected(charge);
            entry.issued = entry.issued.saturating_sub(1);
            entry.countdown = spread as u32;
        }
    }

    /// A measurement of `measured_ns` for a launch of `key` that was charged `charged`. Returns
    /// the correction (ns to add to what was charged) for it and for the launches it stands for.
    pub fn measured(&mut self, key: u64, charged: u64, measured_ns: u64) -> i64 {
        // At most the bucket's deepest debt: the driver's elapsed time is a float, and a garbage
        // one must not become every new key's charge nor overflow the smoothing.
        let measured_ns = measured_ns.min(DEBT_FLOOR_NS.unsigned_abs());
        let measured_ns = match self.find(key) {
            Some(entry) if entry.received >= SETTLED_SAMPLES => entry.bounded(measured_ns),
            _ => measured_ns,
        };
        self.overall = if self.overall == 0 {
            measured_ns
        } else {
            (self.overall * 15 + measured_ns) / 16
        };
        let own = measured_ns as i64 - charged as i64;
        let Some(entry) = self.find(key) else {
            return own;
        };
        if entry.received > 0 {
            // The plain mean of the measurements so far, then smoothed over SLOW_SMOOTHING: a
            // varying key is sampled faster from its first samples on.
            let weight = u64::from(entry.received).min(SLOW_SMOOTHING);
            entry.deviation = (entry.deviation * (weight - 1) + measured_ns.abs_diff(entry.estimate)) / weight;
            entry.slow_mean = (entry.slow_mean * weight + measured_ns) / (weight + 1);
        } else {
            entry.slow_mean = measured_ns;
        }
        entry.received = entry.received.saturating_add(1);
        entry.estimate = if let Some(slot) = entry.young.get_mut(entry.received as usize - 1) {
            *slot = u32::try_from(measured_ns).unwrap_or(u32::MAX);
            young_median(&entry.young[..entry.received as usize])
        } else {
            // A quarter of the way to the new value: steady for a steady kernel, and a changed
            // kernel is followed within a few samples.
            (entry.estimate * 3 + measured_ns) / 4
        }
        .max(1);
        let others = (entry.uncorrected.saturating_mul(entry.estimate)) as i64 - entry.uncorrected_charged as i64;
        entry.uncorrected = 0;
        entry.uncorrected_charged = 0;
        own.saturating_add(others)
    }

    /// The current estimate of `key` (0 when unknown), for tests and logs.
    #[cfg(test)]
    pub fn estimate(&mut self, key: u64) -> u64 {
        self.find(key).map_or(0, |entry| entry.estimate)
    }
}

/// The median of a young key's measurements; of two, the smaller (one may be distorted).
fn young_median(measurements: &[u32]) -> u64 {
    let mut sorted = [0u32; YOUNG_SAMPLES as usize];
    let count = measurements.len().min(sorted.len());
    sorted[..count].copy_from_slice(&measurements[..count]);
    let sorted = &mut sorted[..count];
    sorted.sort_unstable();
    match count {
        0 => 0,
        1 | 2 => u64::from(sorted[0]),
        _ if count % 2 == 1 => u64::from(sorted[count / 2]),
        _ => (u64::from(sorted[count / 2 - 1]) + u64::from(sorted[count / 2])) / 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_key_is_charged_the_prior_and_measured_while_young() {
        let mut estimates = Estimates::default();
        assert_eq!(
            estimates.plan(7, 0),
            Plan {
                charge: PRIOR_NS,
                sample: false
            },
            "the first launch may load the module: never measured"
        );
        for i in 1..=YOUNG_SAMPLES {
            let plan = estimates.plan(7, u64::from(i));
            assert_eq!(
                plan,
                Plan {
                    charge: PRIOR_NS,
                    sample: true
                }
            );
        }
        let plan = estimates.plan(7, 10);
        assert!(!plan.sample, "old enough, and the global interval has not passed");
    }

    #[test]
    fn a_measurement_corrects_the_launches_it_stands_for() {
        let mut estimates = Estimates::default();
        // The first launch (not measured) and the young ones (measured, still in flight).
        for i in 0..=YOUNG_SAMPLES {
            estimates.plan(7, u64::from(i));
        }
        // Ten launches charged the prior, not measured.
        for i in 0..10 {
            assert!(!estimates.plan(7, 100 + i).sample);
        }
        // The first sample comes back: 2 ms.
        let correction = estimates.measured(7, PRIOR_NS, 2_000_000);
        assert_eq!(
            correction,
            12 * 1_000_000,
            "its own launch, the first one and the ten others, 1 ms short each"
        );
        assert_eq!(estimates.estimate(7), 2_000_000);
        // The next launches are charged the estimate.
        assert_eq!(estimates.plan(7, 200).charge, 2_000_000);
        // Another key is charged the overall average rather than the prior now.
        assert_eq!(estimates.plan(8, 201).charge, 2_000_000);
    }

    impl Estimates {
        /// Plans a launch of `key` at `now` and measures it at `took` when sampled; whether it was.
        fn launch(&mut self, key: u64, now: u64, took: u64) -> bool {
            let plan = self.plan(key, now);
            if plan.sample {
                self.measured(key, plan.charge, took);
            }
            plan.sample
        }
    }

    /// A settled key measured at `ns` for each of its samples, at one launch every 10 us.
    fn settled(estimates: &mut Estimates, key: u64, ns: u64, now: &mut u64) {
        while estimates
            .find(key)
            .is_none_or(|entry| entry.received < SETTLED_SAMPLES + 1)
        {
            *now += 10_000;
            estimates.launch(key, *now, ns);
        }
    }

    #[test]
    fn a_one_off_long_measurement_of_a_settled_key_counts_for_twice_its_highs_at_most() {
        let mut estimates = Estimates::default();
        settled(&mut estimates, 7, 200_000, &mut 0);
        // A sample stretched by the host or another context: 20 ms.
        let correction = estimates.measured(7, 200_000, 20_000_000);
        assert_eq!(correction, 200_000, "counted as 400 us: 200 us over its charge");
        assert_eq!(estimates.estimate(7), 250_000);
        // Shorter ones are taken as they are.
        estimates.measured(7, 250_000, 100_000);
        assert!(estimates.estimate(7) < 250_000);
    }

    #[test]
    fn a_long_time_that_recurs_is_counted_in_full_within_a_few_samples() {
        let mut estimates = Estimates::default();
        settled(&mut estimates, 7, 100_000, &mut 0);
        // The same kernel on a tensor ten times larger, now and then.
        let counted: Vec<u64> = (0..5)
            .map(|_| {
                let estimate = estimates.estimate(7);
                let counted = (estimates.measured(7, estimate, 1_000_000) + estimate as i64) as u64;
                for _ in 0..10 {
                    let estimate = estimates.estimate(7);
                    estimates.measured(7, estimate, 100_000);
                }
                counted
            })
            .collect();
        assert_eq!(counted[0], 200_000, "the first is bounded: {counted:?}");
        assert_eq!(counted[4], 1_000_000, "the fifth is counted in full: {counted:?}");
    }

    /// What a key of `times` (picked at random for each launch) was charged over its mean time,
    /// in a run of 400,000 launches 100 us apart after 200,000 more; `seed` sets both generators.
    fn charged_over_mean(times: &[u64], seed: u64) -> f64 {
        let mean = times.iter().sum::<u64>() as f64 / times.len() as f64;
        let mut estimates = Estimates::default();
        estimates.random ^= seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut picker = Estimates::default();
        picker.random ^= seed.wrapping_mul(0xbf58_476d_1ce4_e5b9) | 1;
        let (mut now, mut measured, mut charged) = (0u64, 0f64, 0f64);
        for launch in 0..600_000u64 {
            now += 100_000;
            let plan = estimates.plan(7, now);
            charged += plan.charge as f64;
            if plan.sample {
                let time = times[picker.random_below(times.len() as u64) as usize];
                charged += estimates.measured(7, plan.charge, time) as f64;
            }
            if launch == 200_000 {
                (measured, charged) = (0.0, 0.0);
            }
            measured += mean;
        }
        charged / measured
    }

    #[test]
    fn a_key_whose_time_varies_launch_by_launch_is_charged_its_mean() {
        // One key of a training step on the H200, by the share of each of its times (us): with
        // its settled measurements counted for at most 5/4 of its estimate, it was charged 0.70
        // of what it measured.
        let times: Vec<u64> = [(28, 32), (68, 28), (92, 91), (600, 7)]
            .iter()
            .flat_map(|&(us, count)| std::iter::repeat_n(us * 1000, count))
            .collect();
        let ratios: Vec<f64> = (1..=20).map(|seed| charged_over_mean(&times, seed)).collect();
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        eprintln!("charged over the mean time, 20 seeds: {mean:.3} on average, {ratios:.3?}");
        assert!(
            (0.98..=1.02).contains(&mean),
            "charged {mean:.3} of its mean time on average: {ratios:.3?}"
        );
        for ratio in &ratios {
            assert!(
                (0.93..=1.07).contains(ratio),
                "charged {ratio:.3} of its mean time in a run: {ratios:.3?}"
            );
        }
    }

    /// What a key of 50 and 150 us by turns was charged over its time, in a loop held at half the
    /// GPU by the limiter (each launch followed by twice its charge of wall time), 200,000 launches.
    fn throttled_charged_over_time(seed: u64) -> f64 {
        let mut estimates = Estimates::default();
        estimates.random ^= seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let (mut now, mut time, mut charged) = (0u64, 0f64, 0f64);
        for launch in 0..200_000u64 {
            let took = if launch % 2 == 0 { 50_000 } else { 150_000 };
            let plan = estimates.plan(7, now);
            now += 2 * plan.charge;
            charged += plan.charge as f64;
            time += took as f64;
            if plan.sample {
                charged += estimates.measured(7, plan.charge, took) as f64;
            }
        }
        charged / time
    }

    #[test]
    fn a_varying_key_held_by_the_limiter_is_charged_its_time() {
        // Held by the limiter, a key runs faster while its estimate is low. A stride that followed
        // the rate since the last sample gave the launches charged at a low estimate the longer
        // batches: 0.990 of the time on average over these seeds (0.979 to 0.996).
        let ratios: Vec<f64> = (1..=10).map(throttled_charged_over_time).collect();
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        eprintln!("charged over the time, 10 seeds: {mean:.4} on average, {ratios:.3?}");
        assert!(
            (0.995..=1.005).contains(&mean),
            "charged {mean:.4} of its time on average: {ratios:.3?}"
        );
    }

    #[test]
    fn a_busy_key_is_measured_again_soon_after_its_young_samples() {
        // The young samples come on consecutive launches, 2 us apart: their rate is a burst's. At
        // one launch every 10 us on, the next sample is due within a few strides, not seconds.
        let mut estimates = Estimates::default();
        // Past the process-wide interval since the clock's origin (the last sample's time).
        let mut now = GLOBAL_SAMPLE_INTERVAL_NS;
        for _ in 0..=YOUNG_SAMPLES {
            now += 2_000;
            estimates.launch(7, now, 5_000);
        }
        let next = (1..=100_000u64)
            .find(|_| {
                now += 10_000;
                estimates.plan(7, now).sample
            })
            .expect("measured again within a second");
        assert!(next <= 2 * MIN_SAMPLE_STRIDE, "measured again after {next} launches");
    }

    #[test]
    fn steady_keys_are_resampled_at_a_low_rate_and_varying_ones_more_often() {
        // One launch every 10 us for two seconds, the times taken in turn; the samples of the
        // second second, and the estimate.
        let samples = |times: [u64; 2]| {
            let mut estimates = Estimates::default();
            let (mut now, mut samples) = (0, 0);
            for launch in 0..200_000u64 {
                now += 10_000;
                if estimates.launch(7, now, times[(launch % 2) as usize]) {
                    samples += u64::from(launch >= 100_000);
                }
            }
            (samples, estimates.estimate(7))
        };
        let (steady, estimate) = samples([5_000, 5_000]);
        let (varying, _) = samples([2_500, 7_500]);
        assert!(
            (15..=25).contains(&steady),
            "steady: {steady} samples in the 2nd second"
        );
        assert_eq!(estimate, 5_000);
        assert!(
            varying >= 8 * steady,
            "varying: {varying} samples in the 2nd second (steady: {steady})"
        );
    }

    #[test]
    fn an_absurd_measurement_is_bounded() {
        // The driver's elapsed time is a float: a garbage one converts to u64::MAX.
        let mut estimates = Estimates::default();
        let mut now = 0;
        for _ in 0..2 {
            for measured in [u64::MAX, 1_000, u64::MAX] {
                now += 10_000;
                let plan = estimates.plan(7, now);
                estimates.measured(7, plan.charge, measured);
            }
        }
        settled(&mut estimates, 8, 1_000, &mut now);
        estimates.measured(8, 1_000, u64::MAX);
        assert!(estimates.estimate(7) <= DEBT_FLOOR_NS.unsigned_abs());
        assert!(estimates.estimate(8) <= 1_000 * HIGH_BOUND);
        // A key never measured is charged the prior, which follows the measurements.
        let plan = estimates.plan(9, now + 1);
        assert!(
            plan.charge <= DEBT_FLOOR_NS.unsigned_abs(),
            "a new key charged {} ns",
            plan.charge
        );
    }

    #[test]
    fn a_high_left_from_before_a_key_became_faster_does_not_let_a_stretch_through() {
        let mut estimates = Estimates::default();
        let mut now = 0;
        settled(&mut estimates, 7, 1_000_000, &mut now);
        // The same key, now 100 times faster (its tensors shrank): the estimate follows.
        for _ in 0..40 {
            let estimate = estimates.estimate(7);
            estimates.measured(7, estimate, 10_000);
        }
        let estimate = estimates.estimate(7);
        assert!(estimate < 20_000, "estimate {estimate} ns");
        // A sample stretched to 20 ms counts for at most twice the ceiling of its highs (2 x 16
        // times its estimate), not twice the 1 ms high it had (half of it left after 40 samples).
        let counted = (estimates.measured(7, estimate, 20_000_000) + estimate as i64) as u64;
        assert!(
            counted <= 32 * estimate,
            "counted {counted} ns on an estimate of {estimate} ns"
        );
    }

    #[test]
    fn slowly_repeated_keys_are_not_measured_at_every_few_launches() {
        // Eight kernels launched in turn every 1.7 ms (each key every 13.6 ms, a launch-bound
        // loop) for 10 s: 50 ms of a key is under four of its launches.
        let mut estimates = Estimates::default();
        let (mut now, mut launches, mut samples) = (0, 0u64, 0u64);
        while now < 10_000_000_000 {
            for key in 1..=8 {
                now += 1_700_000;
                launches += 1;
                samples += u64::from(estimates.launch(key, now, 500_000));
            }
        }
        let settled = samples - 8 * u64::from(YOUNG_SAMPLES);
        assert!(
            (launches / (2 * MIN_SAMPLE_STRIDE)..=launches / (MIN_SAMPLE_STRIDE / 2)).contains(&settled),
            "{settled} samples of {launches} launches after the young ones"
        );
        for key in 1..=8 {
            assert_eq!(estimates.estimate(key), 500_000);
        }
    }

    #[test]
    fn every_launch_is_equally_likely_to_be_measured() {
        // Bursts of 15 launches 3 us apart, then a 100 us pause, for 20 s: the position in the
        // burst of each sample must be spread evenly, not stuck on the first launch of a burst.
        let mut estimates = Estimates::default();
        let mut now = 0;
        let mut positions = [0u32; 15];
        for _burst in 0..(20_000_000_000u64 / 145_000) {
            now += 100_000;
            for count in positions.iter_mut() {
                now += 3_000;
                *count += u32::from(estimates.launch(7, now, 3_000));
            }
        }
        let total: u32 = positions.iter().sum();
        assert!((300..=500).contains(&total), "{total} samples in 20 s: {positions:?}");
        let expected = f64::from(total) / 15.0;
        for (position, count) in positions.iter().enumerate() {
            assert!(
                (f64::from(*count) - expected).abs() < expected * 0.6,
                "position {position}: {count} samples of {total}: {positions:?}"
            );
        }
    }

    #[test]
    fn a_cancelled_sample_is_taken_again() {
        let mut estimates = Estimates::default();
        assert!(!estimates.plan(7, 0).sample, "the first launch");
        for i in 1..=YOUNG_SAMPLES {
            let plan = estimates.plan(7, u64::from(i));
            assert!(plan.sample);
            estimates.forget(7, plan);
        }
        assert!(estimates.plan(7, 10).sample, "still young: nothing was measured");
        // A forgotten launch that was not to be measured is not corrected either.
        let mut estimates = Estimates::default();
        for i in 0..=YOUNG_SAMPLES {
            estimates.launch(7, u64::from(i), 1_000);
        }
        let plan = estimates.plan(7, 20);
        assert!(!plan.sample);
        estimates.forget(7, plan);
        let plan = estimates.plan(7, 21);
        // 2 us measured: its own launch is 1 us short, and the new estimate (1.25 us) corrects
        // the one uncorrected launch by 250 ns. Had the forgotten launch still counted, that
        // would be 500 ns.
        assert_eq!(estimates.measured(7, plan.charge, 2_000), 1_000 + 250);
    }

    #[test]
    fn a_young_key_is_charged_the_median_of_its_measurements() {
        // As on the H200 with lazy loading: a measurement stretched by the host (20 ms) among
        // the kernel's own (3.2-3.4 us). Whatever its place, the estimate is the kernel's.
        for stretched_at in 0..YOUNG_SAMPLES as usize {
            let mut estimates = Estimates::default();
            assert!(!estimates.plan(7, 0).sample);
            let mut measurements = [3_300u64, 3_200, 3_400, 3_300];
            measurements[stretched_at] = 20_000_000;
            for (i, measured) in measurements.into_iter().enumerate() {
                let plan = estimates.plan(7, 1 + i as u64);
                assert!(plan.sample, "young launch {i}");
                estimates.measured(7, plan.charge, measured);
            }
            let estimate = estimates.estimate(7);
            assert!(
                (3_200..=3_400).contains(&estimate),
                "stretched at {stretched_at}: {estimate}"
            );
        }
        // Varying times are not charged their smallest: 170-180 us gives 176.
        let mut estimates = Estimates::default();
        estimates.plan(7, 0);
        for (i, measured) in [180_000u64, 170_000, 178_000, 174_000].into_iter().enumerate() {
            let plan = estimates.plan(7, 1 + i as u64);
            estimates.measured(7, plan.charge, measured);
        }
        assert_eq!(estimates.estimate(7), 176_000);
        assert_eq!(young_median(&[5, 1]), 1, "of two, the smaller");
        assert_eq!(young_median(&[9, 1, 5]), 5);
    }

    #[test]
    fn an_untrusted_sample_is_taken_again_and_corrected_later() {
        let mut estimates = Estimates::default();
        assert!(!estimates.plan(7, 0).sample);
        let plan = estimates.plan(7, 1);
        assert!(plan.sample);
        // The launch call outlasted its hold: no measurement.
        estimates.not_measured(7, plan.charge);
        for i in 0..YOUNG_SAMPLES {
            let plan = estimates.plan(7, 2 + u64::from(i));
            assert!(plan.sample, "still young: measured again");
            let correction = estimates.measured(7, plan.charge, 5_000);
            if i == 0 {
                // Its own launch, the first launch and the untrusted one: each charged the
                // prior, each corrected to 5 us.
                assert_eq!(correction, 3 * (5_000 - PRIOR_NS as i64));
            }
        }
        assert!(!estimates.plan(7, 10).sample, "four measurements: no longer young");
        assert_eq!(estimates.estimate(7), 5_000);
    }

    #[test]
    fn a_full_table_forgets_the_least_recently_used_key() {
        let mut estimates = Estimates::default();
        for key in 1..=(TABLE_SIZE as u64 * 4) {
            estimates.plan(key, key);
        }
        // Every recent key is still found or re-created without panicking, and charges are sane.
        let plan = estimates.plan(3, 1 << 40);
        assert!(plan.charge > 0);
    }
}
