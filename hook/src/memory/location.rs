//! The device whose memory a `CUmemLocation` names, under every supported header version.
//!
//! CUDA 13.5 added locality domains: a part of one device's memory, named by
//! `CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN` and a `localized` pair (device, domain) that
//! shares its four bytes with `id` in an anonymous union. That memory is the device's and is
//! charged to it. The field moved, the layout did not: the generated `id()` accessor reads the
//! union's four bytes under any header, `localized.deviceId` is their first byte, and the
//! constant is generated for older headers (vgpu-codegen's `compat`).

use crate::sys::cuda::{
    CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN, CUdevice, CUmemLocation,
    CUmemLocationType,
};

/// The device whose memory `location` names; `None` for host memory and anything else.
pub fn device_of(location: &CUmemLocation) -> Option<CUdevice> {
    match location.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => Some(location.id()),
        // `localized.deviceId`: the first byte of the union, in memory order.
        CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN => Some(CUdevice::from(location.id().to_ne_bytes()[0])),
        _ => None,
    }
}

/// A location of this type and `id` (a device ordinal, or 0 for the host), as a C caller fills it:
/// the type, then the union's four bytes.
pub fn located(type_: CUmemLocationType, id: i32) -> CUmemLocation {
    const _: () = assert!(size_of::<CUmemLocation>() == 8, "type and a four-byte union");
    let mut bytes = [0u8; 8];
    bytes[..4].copy_from_slice(&type_.to_ne_bytes());
    bytes[4..].copy_from_slice(&id.to_ne_bytes());
    // SAFETY: CUmemLocation is plain C data of these 8 bytes (checked above); any bits are a value.
    unsafe { std::mem::transmute::<[u8; 8], CUmemLocation>(bytes) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::cuda::CU_MEM_LOCATION_TYPE_HOST;

    /// A location whose union holds these bytes.
    fn location(type_: u32, union_bytes: [u8; 4]) -> CUmemLocation {
        located(type_, i32::from_ne_bytes(union_bytes))
    }

    #[test]
    fn devices_and_locality_domains_name_a_device() {
        assert_eq!(
            device_of(&location(CU_MEM_LOCATION_TYPE_DEVICE, 3i32.to_ne_bytes())),
            Some(3)
        );
        // localized = { deviceId 2, localityDomainId 1 }, the rest of the union zero.
        assert_eq!(
            device_of(&location(CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN, [2, 1, 0, 0])),
            Some(2)
        );
        assert_eq!(device_of(&location(CU_MEM_LOCATION_TYPE_HOST, [0; 4])), None);
        assert_eq!(device_of(&located(CU_MEM_LOCATION_TYPE_DEVICE, 5)), Some(5));
    }
}
