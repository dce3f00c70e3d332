//! `cuGetProcAddress` and `cuGetProcAddress_v2`, answering as the real driver does: `symbol` is
//! a base name; the variant is the newest one introduced at or before `cudaVersion` (from
//! `cudaTypedefs.h`, see `vgpu_codegen::variants`), preferring a per-thread-stream variant when
//! `flags` has `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` (`CU_GET_PROC_ADDRESS_DEFAULT`
//! is treated as the legacy stream). The pointer is this library's export of that variant. The
//! exports standing for a newer driver's functions (`NEWER_THAN_HEADERS`) are found by name.

use std::ffi::{c_char, c_int, c_void};

use crate::cuda::*;
use crate::exports::{NEWER_THAN_HEADERS, NOT_EXPORTED, VARIANTS, lookup};
use crate::ffi::{CuResult, cu, put, string};

/// The variants of one base name with the CUDA version that introduced each, oldest first.
pub struct VariantSet {
    pub base: &'static str,
    pub legacy_stream: &'static [(u32, &'static str)],
    pub per_thread: &'static [(u32, &'static str)],
}

#[derive(Debug, PartialEq, Eq)]
pub enum Choice {
    Found(&'static str),
    UnknownSymbol,
    VersionTooLow,
}

/// The variant of `base` for a CUDA version and stream mode.
pub fn select(sets: &[VariantSet], base: &str, version: c_int, per_thread: bool) -> Choice {
    let Ok(index) = sets.binary_search_by(|set| set.base.cmp(base)) else {
        return Choice::UnknownSymbol;
    };
    let set = &sets[index];
    let version = u32::try_from(version).unwrap_or(0);
    let newest =
        |list: &'static [(u32, &'static str)]| list.iter().rev().find(|(since, _)| *since <= version).map(|(_, n)| *n);
    let chosen = if per_thread {
        newest(set.per_thread).or_else(|| newest(set.legacy_stream))
    } else {
        newest(set.legacy_stream)
    };
    match chosen {
        Some(name) => Choice::Found(name),
        None => Choice::VersionTooLow,
    }
}

/// Resolves a symbol; returns the pointer and the query status.
fn resolve(
    symbol: *const c_char,
    version: c_int,
    flags: cuuint64_t,
) -> CuResult<(*mut c_void, CUdriverProcAddressQueryResult)> {
    // SAFETY: a NUL-terminated name from the caller (null is rejected).
    let name = unsafe { string(symbol) }?;
    let per_thread = flags & u64::from(CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    // A function of a driver newer than the headers: found under its own name.
    if NEWER_THAN_HEADERS.contains(&name.as_str())
        && let Some(address) = lookup(&name)
    {
        return Ok((address, CU_GET_PROC_ADDRESS_SUCCESS));
    }
    Ok(match select(VARIANTS, &name, version, per_thread) {
        Choice::Found(variant) if !NOT_EXPORTED.contains(&variant) => match lookup(variant) {
            Some(address) => (address, CU_GET_PROC_ADDRESS_SUCCESS),
            None => (std::ptr::null_mut(), CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND),
        },
        Choice::Found(_) | Choice::UnknownSymbol => (std::ptr::null_mut(), CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND),
        Choice::VersionTooLow => (std::ptr::null_mut(), CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT),
    })
}

fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: cuuint64_t,
    status: *mut CUdriverProcAddressQueryResult,
) -> CuResult {
    if pfn.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (address, result) = resolve(symbol, version, flags)?;
    // SAFETY: out-pointers from the caller; `pfn` checked non-null, `status` optional.
    unsafe {
        put(pfn, address)?;
        if !status.is_null() {
            put(status, result)?;
        }
    }
    if result == CU_GET_PROC_ADDRESS_SUCCESS {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_FOUND)
    }
}

/// A function no header declares, standing for one a driver newer than the headers adds (see
/// build.rs, `NEWER_THAN_HEADERS`): the hook does not export it and must say so when the
/// application is handed it.
#[unsafe(no_mangle)]
pub extern "C" fn cuFakeNewerDriverFunction() -> CUresult {
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: cuuint64_t,
) -> CUresult {
    cu(|| get_proc_address(symbol, pfn, cudaVersion, flags, std::ptr::null_mut()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: cuuint64_t,
    symbolStatus: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    cu(|| get_proc_address(symbol, pfn, cudaVersion, flags, symbolStatus))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selects_like_the_driver() {
        assert_eq!(
            select(VARIANTS, "cuMemAlloc", 12000, false),
            Choice::Found("cuMemAlloc_v2")
        );
        assert_eq!(select(VARIANTS, "cuMemAlloc", 3000, false), Choice::Found("cuMemAlloc"));
        assert_eq!(
            select(VARIANTS, "cuMemAlloc", 12000, true),
            Choice::Found("cuMemAlloc_v2")
        );
        assert_eq!(
            select(VARIANTS, "cuLaunchKernel", 12000, true),
            Choice::Found("cuLaunchKernel_ptsz")
        );
        assert_eq!(
            select(VARIANTS, "cuLaunchKernel", 12000, false),
            Choice::Found("cuLaunchKernel")
        );
        assert_eq!(
            select(VARIANTS, "cuMemcpyHtoD", 12000, true),
            Choice::Found("cuMemcpyHtoD_v2_ptds")
        );
        assert_eq!(
            select(VARIANTS, "cuCtxCreate", 11040, false),
            Choice::Found("cuCtxCreate_v3")
        );
        assert_eq!(
            select(VARIANTS, "cuCtxCreate", 13000, false),
            Choice::Found("cuCtxCreate_v4")
        );
        assert_eq!(
            select(VARIANTS, "cuStreamGetCaptureInfo", 12030, true),
            Choice::Found("cuStreamGetCaptureInfo_v3_ptsz")
        );
        assert_eq!(
            select(VARIANTS, "cuGetProcAddress", 12000, false),
            Choice::Found("cuGetProcAddress_v2")
        );
        assert_eq!(select(VARIANTS, "cuMemAllocAsync", 11000, false), Choice::VersionTooLow);
        assert_eq!(select(VARIANTS, "cuMemAlloc_v2", 12000, false), Choice::UnknownSymbol);
        assert_eq!(select(VARIANTS, "nvmlInit_v2", 12000, false), Choice::UnknownSymbol);
        assert_eq!(select(VARIANTS, "cuMemAlloc", -1, false), Choice::VersionTooLow);
    }

    #[test]
    fn not_exported_symbols_are_not_found() {
        assert_eq!(
            select(VARIANTS, "cuDeviceGetNvSciSyncAttributes", 12000, false),
            Choice::Found("cuDeviceGetNvSciSyncAttributes")
        );
        assert!(lookup("cuDeviceGetNvSciSyncAttributes").is_none());
        assert!(lookup("nvmlDeviceGetNvLinkRemotePciInfo_v2").is_none());
        assert!(lookup("cuMemAlloc_v2").is_some());
        assert!(lookup("nvmlInit_v2").is_some());
        assert!(crate::EXPORTED.contains(&"cuGraphUpload"));
        assert!(!crate::EXPORTED.iter().any(|n| NOT_EXPORTED.contains(n)));
    }

    #[test]
    fn resolves_through_the_exports() {
        let mut pfn = std::ptr::null_mut();
        let mut status = CU_GET_PROC_ADDRESS_SUCCESS;
        let call = |name: &std::ffi::CStr, version, flags, pfn: &mut *mut c_void, status: &mut u32| {
            get_proc_address(name.as_ptr(), pfn, version, flags, status)
        };
        assert_eq!(call(c"cuMemAlloc", 12000, 0, &mut pfn, &mut status), Ok(()));
        assert_eq!(pfn, lookup("cuMemAlloc_v2").unwrap());
        assert_eq!(
            call(c"cuNoSuchThing", 12000, 0, &mut pfn, &mut status),
            Err(CUDA_ERROR_NOT_FOUND)
        );
        assert_eq!(
            (pfn, status),
            (std::ptr::null_mut(), CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
        );
        assert_eq!(
            call(c"cuDeviceGetNvSciSyncAttributes", 12000, 0, &mut pfn, &mut status),
            Err(CUDA_ERROR_NOT_FOUND)
        );
        assert_eq!(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
        assert_eq!(
            call(c"cuMemAllocAsync", 11000, 0, &mut pfn, &mut status),
            Err(CUDA_ERROR_NOT_FOUND)
        );
        assert_eq!(status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
        assert_eq!(
            get_proc_address(std::ptr::null(), &mut pfn, 12000, 0, &mut status),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(
            get_proc_address(c"cuInit".as_ptr(), std::ptr::null_mut(), 12000, 0, &mut status),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
    }
}
