//! Entry points the driver has and this library does not export. A driver newer than the headers
//! the library was built from answers `cuGetProcAddress` and `dlsym` with functions (a new `_v3`,
//! a new copy) that map to none of our wrappers: the application then calls the driver directly,
//! unaccounted and unlimited. The library cannot hook what it does not know, but it says so, once
//! per function, at warning level. The private entry points `cuda-api.toml` names as undeclared
//! (no header has them, and calling them unhooked is harmless) are noted at debug level instead.

use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::ffi::{CStr, c_char, c_void};

/// `CUDA_VERSION` of the headers this library was built from, as `13.5`.
fn header_version() -> String {
    let version: u32 = env!("VGPU_CUDA_HEADER_VERSION").parse().unwrap_or(0);
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

// The generated `UNDECLARED` list (hook/build.rs from cuda-api.toml).
include!(concat!(env!("OUT_DIR"), "/undeclared.rs"));

/// Says, once per function, that `via` answered with the driver's `name`, which this library
/// does not export: at warning level, or at debug level for a private entry point the table names.
/// Allocates: called on the `dlsym` path only for driver names (`cu*`, `nvml*`), which no
/// allocator looks up while it initialises.
pub fn report(via: &str, name: &str) {
    static WARNED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    if !WARNED.lock().insert(name.to_string()) {
        return;
    }
    crate::log::ensure();
    if UNDECLARED.binary_search(&name).is_ok() {
        tracing::debug!(
            target: crate::log::ONCE_PER_SUBJECT,
            "{via} answered with the driver's private {name}, which no header declares (cuda-api.toml: undeclared): \
             passed to the application unhooked"
        );
    } else {
        tracing::warn!(
            target: crate::log::ONCE_PER_SUBJECT,
            "{via} answered with the driver's {name}, which libvgpu.so does not export: the library (CUDA {} headers) \
             is older than the driver, and calls through this answer bypass it (no memory accounting, no compute limit)",
            header_version()
        );
    }
}

/// The driver or NVML entry point exported at exactly `address` (not the nearest symbol before
/// it) by `libcuda.so*` or `libnvidia-ml.so*`: a name of cuBLAS or cuDNN, which start with `cu`
/// too, is none of the driver's.
pub fn driver_symbol(address: *mut c_void) -> Option<String> {
    // SAFETY: dladdr only reads loader tables; Dl_info is plain data and zero is a valid state.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above; any address may be asked about.
    let known = unsafe { libc::dladdr(address, &mut info) } != 0;
    if !known || info.dli_sname.is_null() || info.dli_fname.is_null() || info.dli_saddr != address {
        return None;
    }
    // SAFETY: dladdr filled both with NUL-terminated strings owned by the loader.
    let (file, name) = unsafe { (CStr::from_ptr(info.dli_fname), CStr::from_ptr(info.dli_sname)) };
    let file = file.to_bytes().rsplit(|&byte| byte == b'/').next().unwrap_or_default();
    let in_driver = file.starts_with(b"libcuda.so") || file.starts_with(b"libnvidia-ml.so");
    (in_driver && is_driver_name(name.to_bytes())).then(|| name.to_string_lossy().into_owned())
}

/// Whether a symbol name is a CUDA driver or NVML entry point's.
pub fn is_driver_name(name: &[u8]) -> bool {
    name.starts_with(b"cu") || name.starts_with(b"nvml")
}

/// `dlsym(handle, symbol)` for a driver name we do not export: if the real `dlsym` finds it, the
/// application gets the driver's function unhooked; say so.
///
/// # Safety
/// `symbol` must point to a NUL-terminated string.
pub unsafe fn check_dlsym(handle: *mut c_void, symbol: *const c_char) {
    // SAFETY: per the contract.
    let name = unsafe { CStr::from_ptr(symbol) };
    if !is_driver_name(name.to_bytes()) {
        return;
    }
    // RTLD_NEXT is relative to its caller, which here would be this library: look it up globally.
    let handle = if handle == libc::RTLD_NEXT {
        libc::RTLD_DEFAULT
    } else {
        handle
    };
    let found = crate::real::real_dlsym(handle, name);
    if !found.is_null()
        && let Some(name) = driver_symbol(found)
    {
        report("dlsym", &name);
    }
}
