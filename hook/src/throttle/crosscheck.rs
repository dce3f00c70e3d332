//! NVML as a cross-check of the sensor, where NVML works.
//!
//! Per-process figures are missing in containers and VMs, so NVML is never the limiter's sensor; but
//! where NVML does measure the GPU, its device utilisation bounds what the container can have used:
//! the container's kernels are a subset of the GPU's. Over-counts of up to 15% are trimmed off the
//! charges ([`super::trim`]); here, a measured share more than [`TOLERANCE`] points above NVML's is
//! reported. Once a second the background thread compares
//! the region's measured share of a device (the sum of its processes' `sm_util`) with NVML's
//! `nvmlDeviceGetUtilizationRates`. A measured share above NVML's figure by more than
//! [`TOLERANCE`] points for [`PERSISTENCE`] checks in a row means the sensor over-counts: that is
//! logged as a warning (at most once a minute per device). NVML reporting 0% while the container
//! measures work, for [`PERSISTENCE`] checks in a row, means NVML does not see this GPU's work:
//! said once, at debug level.

use vgpu_region::MAX_DEVICES;

/// Points by which the measured share may exceed NVML's: the two figures cover slightly
/// different windows (NVML's sample period is 1/6 s to 1 s depending on the GPU).
pub const TOLERANCE: u32 = 10;
/// Consecutive disagreeing checks (one a second) before a warning.
pub const PERSISTENCE: u32 = 5;
/// Shortest time between two warnings for one device.
const WARNING_INTERVAL_NS: u64 = 60_000_000_000;

/// One comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// NVML's figure bounds the measured share.
    Agrees,
    /// NVML gives no figure, or 0% while the container measures work: it cannot check here.
    Unavailable,
    /// The measured share exceeds NVML's by more than the tolerance.
    OverCounts,
}

pub fn judge(measured: u32, nvml: Option<u32>) -> Verdict {
    match nvml {
        None => Verdict::Unavailable,
        Some(0) if measured > 0 => Verdict::Unavailable,
        Some(nvml) if measured > nvml.saturating_add(TOLERANCE) => Verdict::OverCounts,
        Some(_) => Verdict::Agrees,
    }
}

/// What the background thread should log after a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    Nothing,
    /// NVML cannot check on this machine (said once per process).
    Unavailable,
    /// The sensor has over-counted for [`PERSISTENCE`] checks in a row.
    Warning,
}

/// The cross-check's memory: disagreeing checks in a row and the last warning, per device.
#[derive(Default)]
pub struct CrossCheck {
    disagreeing: [u32; MAX_DEVICES],
    /// Blind verdicts in a row: one can be a transient (a burst that NVML's shorter window missed).
    blind: [u32; MAX_DEVICES],
    warned_ns: [u64; MAX_DEVICES],
    said_unavailable: bool,
}

impl CrossCheck {
    /// Records one comparison for a region device index at time `now` (monotonic ns).
    pub fn record(&mut self, index: usize, verdict: Verdict, now: u64) -> Report {
        let (Some(disagreeing), Some(blind)) = (self.disagreeing.get_mut(index), self.blind.get_mut(index)) else {
            return Report::Nothing;
        };
        if verdict != Verdict::Unavailable {
            *blind = 0;
        }
        match verdict {
            Verdict::Agrees => {
                *disagreeing = 0;
                Report::Nothing
            }
            Verdict::Unavailable => {
                *disagreeing = 0;
                *blind = blind.saturating_add(1);
                if *blind < PERSISTENCE || std::mem::replace(&mut self.said_unavailable, true) {
                    Report::Nothing
                } else {
                    Report::Unavailable
                }
            }
            Verdict::OverCounts => {
                *disagreeing = disagreeing.saturating_add(1);
                let warned = &mut self.warned_ns[index];
                if *disagreeing >= PERSISTENCE && (*warned == 0 || now.saturating_sub(*warned) >= WARNING_INTERVAL_NS) {
                    *warned = now.max(1);
                    Report::Warning
                } else {
                    Report::Nothing
                }
            }
        }
    }
}

/// NVML's utilisation of the GPU with this handle, in percent; `None` where NVML cannot say.
pub fn nvml_utilisation(device: crate::sys::nvml::nvmlDevice_t) -> Option<u32> {
    use crate::sys::nvml::{NVML_SUCCESS, nvmlUtilization_t};
    let rates = crate::hooks::real::nvmlDeviceGetUtilizationRates()?;
    let mut utilisation = nvmlUtilization_t::default();
    // SAFETY: a handle NVML gave and a local out-pointer.
    (unsafe { rates(device, &mut utilisation) } == NVML_SUCCESS).then_some(utilisation.gpu)
}

/// Most samples read at once: NVML keeps a few seconds of them (about six a second on the H200).
const MAX_SAMPLES: usize = 256;

/// The mean of NVML's GPU utilisation samples taken since `last_seen` (NVML's own timestamp of the
/// newest sample read before, 0 for none), in percent, and how many there were; `last_seen`
/// moves to the newest. `None` where NVML keeps no samples, or none came since. A reading every
/// second then covers the whole second, where `nvmlDeviceGetUtilizationRates` covers only NVML's
/// last sample period (1/6 s to 1 s by GPU), which a job with phases (a training step) swings.
pub fn nvml_utilisation_samples(device: crate::sys::nvml::nvmlDevice_t, last_seen: &mut u64) -> Option<(f64, usize)> {
    use crate::sys::nvml::{
        NVML_GPU_UTILIZATION_SAMPLES, NVML_SUCCESS, NVML_VALUE_TYPE_DOUBLE, NVML_VALUE_TYPE_UNSIGNED_INT,
        NVML_VALUE_TYPE_UNSIGNED_LONG, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlSample_t, nvmlValueType_t,
    };
    let samples_of = crate::hooks::real::nvmlDeviceGetSamples()?;
    let mut value_type: nvmlValueType_t = NVML_VALUE_TYPE_UNSIGNED_INT;
    let mut query = |count: &mut std::ffi::c_uint, buffer: *mut nvmlSample_t| {
        // SAFETY: a handle NVML gave and local out-pointers; `buffer` is null (NVML then says how
        // many samples it has) or holds `count` writable samples.
        unsafe {
            samples_of(
                device,
                NVML_GPU_UTILIZATION_SAMPLES,
                *last_seen,
                &mut value_type,
                count,
                buffer,
            )
        }
    };
    let mut count: std::ffi::c_uint = 0;
    if query(&mut count, std::ptr::null_mut()) != NVML_SUCCESS || count == 0 {
        return None;
    }
    let mut samples = vec![nvmlSample_t::default(); (count as usize).min(MAX_SAMPLES)];
    let mut count = samples.len() as std::ffi::c_uint;
    if query(&mut count, samples.as_mut_ptr()) != NVML_SUCCESS {
        return None;
    }
    let read = &samples[..(count as usize).min(samples.len())];
    let percent = |sample: &nvmlSample_t| -> Option<f64> {
        // SAFETY: NVML says which member it wrote; every member is plain data.
        let value = unsafe {
            match value_type {
                NVML_VALUE_TYPE_UNSIGNED_INT => f64::from(sample.sampleValue.uiVal),
                NVML_VALUE_TYPE_UNSIGNED_LONG => sample.sampleValue.ulVal as f64,
                NVML_VALUE_TYPE_UNSIGNED_LONG_LONG => sample.sampleValue.ullVal as f64,
                NVML_VALUE_TYPE_DOUBLE => sample.sampleValue.dVal,
                _ => return None,
            }
        };
        value.is_finite().then(|| value.clamp(0.0, 100.0))
    };
    let fresh: Vec<f64> = read
        .iter()
        .filter(|sample| sample.timeStamp > *last_seen)
        .filter_map(percent)
        .collect();
    if let Some(newest) = read.iter().map(|sample| sample.timeStamp).max() {
        *last_seen = (*last_seen).max(newest);
    }
    (!fresh.is_empty()).then(|| (fresh.iter().sum::<f64>() / fresh.len() as f64, fresh.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_bounds_the_measured_share() {
        assert_eq!(judge(50, Some(52)), Verdict::Agrees);
        assert_eq!(judge(50, Some(40)), Verdict::Agrees, "within the tolerance");
        assert_eq!(judge(50, Some(39)), Verdict::OverCounts);
        assert_eq!(judge(20, Some(95)), Verdict::Agrees, "others may use the GPU too");
        assert_eq!(judge(50, Some(0)), Verdict::Unavailable, "NVML blind");
        assert_eq!(judge(0, Some(0)), Verdict::Agrees);
        assert_eq!(judge(50, None), Verdict::Unavailable);
    }

    #[test]
    fn a_warning_needs_persistence_and_is_rate_limited() {
        let mut check = CrossCheck::default();
        let second = 1_000_000_000;
        for i in 1..PERSISTENCE {
            assert_eq!(
                check.record(0, Verdict::OverCounts, u64::from(i) * second),
                Report::Nothing
            );
        }
        assert_eq!(check.record(0, Verdict::OverCounts, 5 * second), Report::Warning);
        assert_eq!(
            check.record(0, Verdict::OverCounts, 6 * second),
            Report::Nothing,
            "once a minute"
        );
        // One agreeing check resets the count.
        check.record(0, Verdict::Agrees, 7 * second);
        for i in 0..PERSISTENCE {
            assert_eq!(check.record(0, Verdict::OverCounts, (70 + u64::from(i)) * second), {
                if i + 1 == PERSISTENCE {
                    Report::Warning
                } else {
                    Report::Nothing
                }
            });
        }
        // Another device keeps its own count: four over-counts there, then one on device 0 (whose
        // count the agreeing check reset) warn nowhere.
        for i in 0..PERSISTENCE - 1 {
            assert_eq!(
                check.record(1, Verdict::OverCounts, (200 + u64::from(i)) * second),
                Report::Nothing
            );
        }
        assert_eq!(check.record(0, Verdict::Agrees, 210 * second), Report::Nothing);
        assert_eq!(check.record(0, Verdict::OverCounts, 211 * second), Report::Nothing);
        assert_eq!(check.record(1, Verdict::OverCounts, 212 * second), Report::Warning);
        // An index out of range is ignored.
        assert_eq!(check.record(MAX_DEVICES, Verdict::OverCounts, 0), Report::Nothing);
    }

    #[test]
    fn unavailable_is_said_once_when_it_persists() {
        let mut check = CrossCheck::default();
        // A transient 0% (one reading) is not blindness.
        assert_eq!(check.record(0, Verdict::Unavailable, 1), Report::Nothing);
        assert_eq!(check.record(0, Verdict::Agrees, 2), Report::Nothing);
        for i in 1..PERSISTENCE {
            assert_eq!(check.record(0, Verdict::Unavailable, 2 + u64::from(i)), Report::Nothing);
        }
        assert_eq!(check.record(0, Verdict::Unavailable, 10), Report::Unavailable);
        for i in 0..2 * PERSISTENCE {
            assert_eq!(
                check.record(1, Verdict::Unavailable, 20 + u64::from(i)),
                Report::Nothing,
                "said once"
            );
        }
    }
}
