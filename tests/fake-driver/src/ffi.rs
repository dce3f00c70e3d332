//! The small unsafe helpers every export uses: result conversion under `catch_unwind`, and
//! reads and writes through the caller's pointers.

use std::ffi::{CStr, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::cuda::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS, CUresult};

pub type CuResult<T = ()> = Result<T, CUresult>;

/// Runs an export's body; a panic becomes `CUDA_ERROR_UNKNOWN` instead of unwinding into C.
pub fn cu(body: impl FnOnce() -> CuResult) -> CUresult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes `value` through a caller's out-pointer; null is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `ptr` is null or valid for writing one `T`.
pub unsafe fn put<T>(ptr: *mut T, value: T) -> CuResult {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and valid for writes by the caller's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Reads a caller's struct; null is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `ptr` is null or valid for reading one `T`.
pub unsafe fn get<T: Copy>(ptr: *const T) -> CuResult<T> {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and valid for reads by the caller's contract.
    Ok(unsafe { ptr.read() })
}

/// A caller's NUL-terminated string (lossily decoded); null is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `ptr` is null or points to a NUL-terminated string.
pub unsafe fn string(ptr: *const c_char) -> CuResult<String> {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    Ok(unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
}

/// Copies `text` and a NUL into a caller's buffer of `len` bytes, truncating; returns whether
/// all of it fit. Writes nothing when `buf` is null or `len` is 0.
///
/// # Safety
/// `buf` is null or valid for writing `len` bytes.
pub unsafe fn write_c_string(buf: *mut c_char, len: usize, text: &str) -> bool {
    if buf.is_null() || len == 0 {
        return false;
    }
    let n = text.len().min(len - 1);
    // SAFETY: n + 1 <= len bytes of the caller's buffer; the source is a live &str.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
        buf.add(n).write(0);
    }
    n == text.len()
}

/// `value` rounded up to a multiple of `to` (unchanged for 0); `None` on overflow.
pub fn round_up(value: u64, to: u64) -> Option<u64> {
    if to == 0 {
        return Some(value);
    }
    value.checked_add(to - 1).map(|v| v / to * to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert_eq!(round_up(0, 512), Some(0));
        assert_eq!(round_up(1, 512), Some(512));
        assert_eq!(round_up(512, 512), Some(512));
        assert_eq!(round_up(u64::MAX, 512), None);
        assert_eq!(round_up(7, 0), Some(7));
    }

    #[test]
    fn c_strings() {
        let mut buf = [1 as c_char; 4];
        // SAFETY: a live 4-byte buffer.
        assert!(!unsafe { write_c_string(buf.as_mut_ptr(), 4, "hello") });
        assert_eq!(buf, [b'h' as c_char, b'e' as c_char, b'l' as c_char, 0]);
        // SAFETY: as above.
        assert!(unsafe { write_c_string(buf.as_mut_ptr(), 4, "hi") });
    }
}
