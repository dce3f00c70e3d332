//! NVML's readings of a whole GPU that the limiter's background thread takes: its utilisation,
//! once a second, for the correction ([`super::correction`]); its name, once, for the board's profile ([`super::boards`]).

/// NVML's utilisation of the GPU with this handle, in percent; `None` where NVML cannot say.
pub fn utilisation(device: crate::sys::nvml::nvmlDevice_t) -> Option<u32> {
    use crate::sys::nvml::{NVML_SUCCESS, nvmlUtilization_t};
    let rates = crate::hooks::real::nvmlDeviceGetUtilizationRates()?;
    let mut utilisation = nvmlUtilization_t::default();
    // SAFETY: a handle NVML gave and a local out-pointer.
    (unsafe { rates(device, &mut utilisation) } == NVML_SUCCESS).then_some(utilisation.gpu)
}

/// NVML's name of the GPU with this handle ("NVIDIA H200"); `None` where NVML cannot say.
pub fn device_name(device: crate::sys::nvml::nvmlDevice_t) -> Option<String> {
    use crate::sys::nvml::{NVML_DEVICE_NAME_V2_BUFFER_SIZE, NVML_SUCCESS};
    let get_name = crate::hooks::real::nvmlDeviceGetName()?;
    let mut buffer = [0u8; NVML_DEVICE_NAME_V2_BUFFER_SIZE as usize];
    // SAFETY: a handle NVML gave, and a local buffer of the length passed.
    let status = unsafe { get_name(device, buffer.as_mut_ptr().cast(), buffer.len() as std::ffi::c_uint) };
    if status != NVML_SUCCESS {
        return None;
    }
    // Up to the first NUL, within the buffer even where NVML wrote none.
    let name = std::ffi::CStr::from_bytes_until_nul(&buffer).ok()?;
    Some(name.to_string_lossy().into_owned())
}

/// Most samples read at once: more than NVML keeps (a few seconds of them).
const MAX_SAMPLES: usize = 256;

/// The mean of NVML's GPU utilisation samples taken since `last_seen` (NVML's own timestamp of the
/// newest sample read before, 0 for none), in percent, and how many there were; `last_seen`
/// moves to the newest. `None` where NVML keeps no samples, or none came since. A reading every
/// second then covers the whole second, where `nvmlDeviceGetUtilizationRates` covers only NVML's
/// last sample period (1/6 s to 1 s by GPU), which a job with phases (a training step) swings.
pub fn utilisation_samples(device: crate::sys::nvml::nvmlDevice_t, last_seen: &mut u64) -> Option<(f64, usize)> {
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
