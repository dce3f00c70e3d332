//! The integer types the driver uses for byte counts and device pointers (the legacy entry points
//! use 32-bit ones), so one handler serves every variant.

/// A byte count or device pointer as the driver declares it.
pub trait DriverInt: Copy {
    fn to_u64(self) -> u64;
    /// The value, saturated to this type's range (a 32-bit report of a 64-bit size).
    fn saturating_from(value: u64) -> Self;
    /// Whether every 64-bit device pointer fits (not the legacy 32-bit `CUdeviceptr_v1`).
    const WIDE: bool = size_of::<Self>() == 8;
}

impl DriverInt for u32 {
    fn to_u64(self) -> u64 {
        u64::from(self)
    }
    fn saturating_from(value: u64) -> Self {
        u32::try_from(value).unwrap_or(u32::MAX)
    }
}

impl DriverInt for u64 {
    fn to_u64(self) -> u64 {
        self
    }
    fn saturating_from(value: u64) -> Self {
        value
    }
}

impl DriverInt for usize {
    fn to_u64(self) -> u64 {
        self as u64
    }
    fn saturating_from(value: u64) -> Self {
        usize::try_from(value).unwrap_or(usize::MAX)
    }
}

/// Reads `*pointer` if it is not null.
///
/// # Safety
/// `pointer` is null or valid for reads.
pub unsafe fn read<T: Copy>(pointer: *const T) -> Option<T> {
    // SAFETY: per the contract.
    (!pointer.is_null()).then(|| unsafe { *pointer })
}

/// Writes `*pointer` if it is not null.
///
/// # Safety
/// `pointer` is null or valid for writes.
pub unsafe fn write<T>(pointer: *mut T, value: T) {
    if !pointer.is_null() {
        // SAFETY: per the contract.
        unsafe { *pointer = value };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturates_into_narrow_types() {
        assert_eq!(u32::saturating_from(5 << 32), u32::MAX);
        assert_eq!(u32::saturating_from(7), 7);
        assert_eq!(usize::saturating_from(u64::MAX), usize::MAX);
        assert_eq!(7u32.to_u64(), 7);
    }

    #[test]
    fn null_pointers_are_skipped() {
        // SAFETY: null is allowed by both.
        assert_eq!(unsafe { read::<u64>(std::ptr::null()) }, None);
        unsafe { write::<u64>(std::ptr::null_mut(), 1) };
        let mut value = 3u64;
        // SAFETY: a valid local.
        unsafe { write(&mut value, 4) };
        assert_eq!(unsafe { read(&value) }, Some(4));
    }
}
