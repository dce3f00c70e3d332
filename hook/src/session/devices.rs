//! The CUDA devices this process sees: their UUIDs (the region indexes devices by UUID, so
//! processes with different `CUDA_VISIBLE_DEVICES` share one region correctly), and which one an
//! allocation lands on. Their limits are the region's (`crate::limits`).

use crate::hooks::real;
use crate::sys::cuda::{CUDA_SUCCESS, CUdevice, CUuuid};

/// One CUDA device as this process sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceEntry {
    /// The ordinal the application uses (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: CUdevice,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML and HAMi write it.
    pub uuid: String,
    /// Index of this GPU in the shared region.
    pub region_index: usize,
}

/// Formats a CUDA UUID the way NVML and HAMi do.
pub fn format_uuid(uuid: &CUuuid) -> String {
    let b: Vec<u8> = uuid.bytes.iter().map(|&byte| byte as u8).collect();
    format!(
        "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]
    )
}

/// The UUIDs of every device, in ordinal order, from the real driver (after cuInit).
pub fn visible_uuids() -> Result<Vec<String>, String> {
    let count_devices = real::cuDeviceGetCount().ok_or("the driver has no cuDeviceGetCount")?;
    let mut count = 0;
    // SAFETY: a valid out-pointer to a local.
    let status = unsafe { count_devices(&mut count) };
    if status != CUDA_SUCCESS {
        return Err(format!("cuDeviceGetCount failed ({status})"));
    }
    let get_uuid = real::cuDeviceGetUuid_v2()
        .or(real::cuDeviceGetUuid())
        .ok_or("the driver has no cuDeviceGetUuid")?;
    (0..count)
        .map(|ordinal| {
            let mut uuid = CUuuid::default();
            // SAFETY: a valid out-pointer to a local; ordinal is below the device count.
            let status = unsafe { get_uuid(&mut uuid, ordinal) };
            if status == CUDA_SUCCESS {
                Ok(format_uuid(&uuid))
            } else {
                Err(format!("cuDeviceGetUuid({ordinal}) failed ({status})"))
            }
        })
        .collect()
}

/// The device of the current context, where a plain allocation lands.
pub fn current_ordinal() -> Option<CUdevice> {
    let get_device = real::cuCtxGetDevice()?;
    let mut device: CUdevice = -1;
    // SAFETY: a valid out-pointer to a local.
    let status = unsafe { get_device(&mut device) };
    (status == CUDA_SUCCESS && device >= 0).then_some(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_format_matches_nvml() {
        let mut uuid = CUuuid::default();
        for (index, byte) in uuid.bytes.iter_mut().enumerate() {
            *byte = (index as u8 * 17) as std::ffi::c_char;
        }
        assert_eq!(format_uuid(&uuid), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }
}
