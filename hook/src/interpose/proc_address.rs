//! `cuGetProcAddress` and `cuGetProcAddress_v2`.
//!
//! cudart (CUDA >= 11.3) fetches every driver entry point through these, passing a CUDA version
//! and stream flags. We never guess which variant fits: the real driver answers, and its answer
//! (a real function's address) is mapped back to the exported variant it is, whose wrapper we
//! return. So the `_v2`/`_v3`/`_ptsz` choice is always the driver's own.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::hooks::EXPORTS;
use crate::real::Library;
use crate::sys::cuda::{CUDA_SUCCESS, CUresult, cuuint64_t};

/// Answers we returned unchanged because the real address is none of our exports.
static UNMAPPED: AtomicU64 = AtomicU64::new(0);
/// Answers mapped to one of our wrappers.
static MAPPED: AtomicU64 = AtomicU64::new(0);

/// Real address → index into `EXPORTS`, sorted by address, built on first use. Our own wrappers'
/// addresses are in it too: a driver whose internal references are interposed by our exports
/// (one linked without -Bsymbolic) answers with our wrapper already.
fn reverse_map() -> &'static [(usize, usize)] {
    static MAP: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    MAP.get_or_init(|| {
        let cuda = EXPORTS
            .iter()
            .enumerate()
            .filter(|(_, export)| export.library == Library::Cuda);
        let mut map: Vec<(usize, usize)> = cuda
            .clone()
            .filter_map(|(index, export)| export.probe().map(|address| (address as usize, index)))
            .chain(cuda.map(|(index, export)| (export.wrapper as usize, index)))
            .collect();
        map.sort_unstable();
        map
    })
}

/// The export whose real function is `address`. When the driver exports one function under
/// several names, prefer the name that starts with the symbol asked for.
fn export_for(address: usize, requested: &[u8]) -> Option<&'static crate::real::Export> {
    let map = reverse_map();
    let start = map.partition_point(|(known, _)| *known < address);
    let candidates = map[start..].iter().take_while(|(known, _)| *known == address);
    let mut first = None;
    for (_, index) in candidates {
        let export = &EXPORTS[*index];
        if export.name.to_bytes().starts_with(requested) {
            return Some(export);
        }
        first.get_or_insert(export);
    }
    first
}

/// Replaces the driver's answer in `*pfn` with our wrapper for the same variant.
///
/// # Safety
/// `symbol` is null or NUL-terminated; `pfn` is null or valid for reads and writes.
unsafe fn map_answer(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: cuuint64_t) {
    if pfn.is_null() {
        return;
    }
    // SAFETY: per the contract.
    let answer = unsafe { *pfn };
    if answer.is_null() {
        return;
    }
    let requested: &[u8] = if symbol.is_null() {
        b""
    } else {
        // SAFETY: per the contract.
        unsafe { CStr::from_ptr(symbol) }.to_bytes()
    };
    let mapped = match export_for(answer as usize, requested) {
        Some(export) => {
            let mapped = MAPPED.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::debug!(
                "cuGetProcAddress({}, {version}, {flags:#x}) -> {} (mapped {mapped}, unchanged {})",
                String::from_utf8_lossy(requested),
                export.name.to_string_lossy(),
                UNMAPPED.load(Ordering::Relaxed)
            );
            export.wrapper as *mut c_void
        }
        None => {
            let unmapped = UNMAPPED.fetch_add(1, Ordering::Relaxed) + 1;
            // A driver function we do not export: a driver newer than our headers.
            if let Some(name) = super::unmapped::driver_symbol(answer) {
                super::unmapped::report("cuGetProcAddress", &name);
            }
            if tracing::enabled!(tracing::Level::DEBUG) {
                tracing::debug!(
                    "cuGetProcAddress({}, {version}, {flags:#x}) -> {answer:p} ({}) unchanged (mapped {}, unchanged {unmapped})",
                    String::from_utf8_lossy(requested),
                    symbol_at(answer),
                    MAPPED.load(Ordering::Relaxed)
                );
            }
            answer
        }
    };
    // SAFETY: per the contract.
    unsafe { *pfn = mapped };
}

/// What the loader knows about an address: `file:symbol`, for the debug log of unmapped answers.
fn symbol_at(address: *mut c_void) -> String {
    // SAFETY: dladdr only reads loader tables; Dl_info is plain data and zero is a valid state.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above; any address may be asked about.
    if unsafe { libc::dladdr(address, &mut info) } == 0 {
        return "unknown".into();
    }
    let text = |pointer: *const c_char| {
        if pointer.is_null() {
            "-".to_string()
        } else {
            // SAFETY: dladdr filled it with a NUL-terminated string owned by the loader.
            unsafe { CStr::from_ptr(pointer) }.to_string_lossy().into_owned()
        }
    };
    format!("{}:{}", text(info.dli_fname), text(info.dli_sname))
}

/// `cuGetProcAddress` (CUDA 11.3 form).
pub fn get_proc_address(
    call: impl FnOnce() -> CUresult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
) -> CUresult {
    crate::log::ensure();
    let result = call();
    if result == CUDA_SUCCESS {
        // SAFETY: the driver accepted these pointers and wrote *pfn.
        unsafe { map_answer(symbol, pfn, cuda_version, flags) };
    }
    result
}
