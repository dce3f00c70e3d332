//! The real libraries and the lazily resolved real-function slots.
//!
//! Our own code always reaches the driver through these resolved pointers, never through our
//! exported symbols, so nothing we do re-enters the hooks.

use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

// ------------------------------------------------------------------ the real dlsym
//
// Our own lookups never go through the exported `dlsym` (interpose::dlsym), which would answer
// our wrappers' names with our wrappers: they call glibc's, found here.

/// Address of glibc's `dlsym`, read by the `dlsym` trampoline's tail jump (interpose::dlsym).
pub static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// Finds glibc's `dlsym` behind ours. `dlvsym` is not interposed, so this cannot recurse.
pub fn resolve_real_dlsym() -> usize {
    let known = REAL_DLSYM.load(Ordering::Acquire);
    if known != 0 {
        return known;
    }
    #[cfg(target_arch = "x86_64")]
    const VERSIONS: [&CStr; 2] = [c"GLIBC_2.34", c"GLIBC_2.2.5"];
    #[cfg(target_arch = "aarch64")]
    const VERSIONS: [&CStr; 2] = [c"GLIBC_2.34", c"GLIBC_2.17"];
    for version in VERSIONS {
        // SAFETY: both strings are NUL-terminated; RTLD_NEXT from this library finds libc's.
        let found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !found.is_null() {
            REAL_DLSYM.store(found as usize, Ordering::Release);
            return found as usize;
        }
    }
    // Cannot happen with glibc; keep the trampoline's jump target valid regardless.
    let fallback = no_dlsym as DlsymFn as usize;
    REAL_DLSYM.store(fallback, Ordering::Release);
    fallback
}

extern "C" fn no_dlsym(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    std::ptr::null_mut()
}

/// Calls the real `dlsym`; the runtime's own lookups go through here, never through ours.
pub fn real_dlsym(handle: *mut c_void, symbol: &CStr) -> *mut c_void {
    let address = resolve_real_dlsym();
    // SAFETY: address is glibc's dlsym (or the null-returning fallback), of this signature.
    let function = unsafe { std::mem::transmute::<usize, DlsymFn>(address) };
    // SAFETY: symbol is NUL-terminated; handle came from dlopen or is a pseudo-handle.
    unsafe { function(handle, symbol.as_ptr()) }
}

// ------------------------------------------------------------------ the real libraries

/// Which real library a function lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    Cuda,
    Nvml,
}

impl Library {
    fn soname(self) -> &'static CStr {
        match self {
            Library::Cuda => c"libcuda.so.1",
            Library::Nvml => c"libnvidia-ml.so.1",
        }
    }

    fn handle_slot(self) -> &'static AtomicPtr<c_void> {
        static CUDA: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
        static NVML: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
        match self {
            Library::Cuda => &CUDA,
            Library::Nvml => &NVML,
        }
    }

    /// The `dlopen` handle of the real library, opened on first use. No lock: two threads racing
    /// both get the same handle from the loader, which only counts a second reference.
    pub fn handle(self) -> Option<*mut c_void> {
        let slot = self.handle_slot();
        let known = slot.load(Ordering::Acquire);
        if !known.is_null() {
            return Some(known);
        }
        let opened = open_library(self.soname());
        if opened.is_null() {
            crate::log::ensure();
            // SAFETY: dlerror returns null or a valid C string owned by libc.
            let why = unsafe { dlerror_text() };
            tracing::error!("cannot load {}: {why}", self.soname().to_string_lossy());
            return None;
        }
        slot.store(opened, Ordering::Release);
        Some(opened)
    }
}

fn open_library(soname: &CStr) -> *mut c_void {
    // SAFETY: soname is a NUL-terminated string; dlopen has no other preconditions.
    unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) }
}

/// # Safety
/// Must not race with another dlerror caller on this thread (it returns a thread-local buffer).
unsafe fn dlerror_text() -> String {
    // SAFETY: per the function's contract; the pointer is null or a C string valid until the next
    // dl* call on this thread, copied out at once.
    unsafe {
        let text = libc::dlerror();
        if text.is_null() {
            String::from("unknown error")
        } else {
            CStr::from_ptr(text).to_string_lossy().into_owned()
        }
    }
}

/// Marks a slot whose function the real library does not have.
const MISSING: usize = 1;

/// One exported entry point: its name, our wrapper, and the real function once resolved.
pub struct Export {
    pub name: &'static CStr,
    pub library: Library,
    pub wrapper: *const c_void,
    slot: AtomicPtr<c_void>,
    reported: AtomicBool,
}

// SAFETY: `wrapper` is the address of a function, immutable and valid for the whole program; the
// slot is atomic.
unsafe impl Sync for Export {}

impl Export {
    pub const fn new(name: &'static CStr, library: Library, wrapper: *const c_void) -> Export {
        Export {
            name,
            library,
            wrapper,
            slot: AtomicPtr::new(std::ptr::null_mut()),
            reported: AtomicBool::new(false),
        }
    }

    /// The real function's address, resolved on first use; `None` when the real library lacks it.
    #[inline(always)]
    pub fn real_address(&self) -> Option<*mut c_void> {
        self.resolved().or_else(|| self.resolve())
    }

    /// The real function's address if already resolved (the per-call fast path).
    #[inline(always)]
    pub fn resolved(&self) -> Option<*mut c_void> {
        let address = self.slot.load(Ordering::Relaxed);
        (address as usize > MISSING).then_some(address)
    }

    #[cold]
    #[inline(never)]
    fn resolve(&self) -> Option<*mut c_void> {
        let found = self.lookup_real();
        // A missing function is reported when something calls it, once (per function, so the
        // line is not rate-limited: a driver older than the headers lacks dozens).
        if found.is_none() && !self.reported.swap(true, Ordering::Relaxed) {
            crate::log::ensure();
            tracing::error!(
                target: crate::log::ONCE_PER_SUBJECT,
                "{} is missing from {}; calls to it return not-found",
                self.name.to_string_lossy(),
                self.library.soname().to_string_lossy()
            );
        }
        found
    }

    /// Resolves the slot without reporting a missing function: for building lookup tables, where
    /// a function the driver lacks is not an error.
    pub fn probe(&self) -> Option<*mut c_void> {
        self.resolved().or_else(|| self.lookup_real())
    }

    fn lookup_real(&self) -> Option<*mut c_void> {
        if self.slot.load(Ordering::Relaxed) as usize == MISSING {
            return None;
        }
        let found = self
            .library
            .handle()
            .map(|handle| real_dlsym(handle, self.name))
            .unwrap_or(std::ptr::null_mut());
        if found.is_null() {
            self.slot.store(MISSING as *mut c_void, Ordering::Relaxed);
            return None;
        }
        self.slot.store(found, Ordering::Relaxed);
        Some(found)
    }
}

/// Why a passthrough function could not be resolved.
pub enum Unresolved {
    /// The real library lacks it (or could not be loaded).
    Missing,
    /// Our code panicked while resolving it.
    Panicked,
}

/// Resolves a passthrough function's slot on its first call, under the panic guard.
#[cold]
#[inline(never)]
pub fn resolve_guarded(export: &Export) -> Result<*mut c_void, Unresolved> {
    match catch_unwind(AssertUnwindSafe(|| {
        #[cfg(fault_injection)]
        fault_injection::maybe_panic(export.name.to_str().unwrap_or_default());
        export.real_address()
    })) {
        Ok(Some(address)) => Ok(address),
        Ok(None) => Err(Unresolved::Missing),
        Err(payload) => {
            log_panic(export.name.to_str().unwrap_or_default(), payload.as_ref());
            Err(Unresolved::Panicked)
        }
    }
}

fn log_panic(name: &str, payload: &(dyn std::any::Any + Send)) {
    crate::log::ensure();
    let what = payload
        .downcast_ref::<&str>()
        .map(|text| text.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!("internal error in {name} ({what}); returning an error code to the caller");
}

/// Runs a wrapper's body so that no panic crosses the C boundary: a panic becomes `on_panic`
/// (the library's "unknown error") and one error line.
#[inline(always)]
pub fn guard<R>(name: &'static str, on_panic: R, body: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(|| {
        #[cfg(fault_injection)]
        fault_injection::maybe_panic(name);
        body()
    })) {
        Ok(result) => result,
        Err(payload) => {
            log_panic(name, payload.as_ref());
            on_panic
        }
    }
}

#[cfg(fault_injection)]
mod fault_injection {
    use std::sync::OnceLock;

    /// Panics inside the guard of the function named by `VGPU_FAULT_PANIC`.
    pub fn maybe_panic(name: &str) {
        static TARGET: OnceLock<Option<String>> = OnceLock::new();
        if TARGET.get_or_init(|| std::env::var("VGPU_FAULT_PANIC").ok()).as_deref() == Some(name) {
            panic!("fault injected into {name}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_dlsym_finds_libc() {
        let found = real_dlsym(libc::RTLD_DEFAULT, c"getpid");
        assert!(!found.is_null());
    }
}
