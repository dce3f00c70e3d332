//! Keeping the library mapped while its own threads run. The tick, the compute limiter and the
//! retry of queued region updates run this library's code until the process exits, so a
//! `dlclose` (a program or a loader that opened the library itself) must not unmap it: before the
//! first such thread starts, the library opens itself with `RTLD_NODELETE`. Its destructor
//! (`crate::exit`) then runs at exit instead of at `dlclose`.

use std::sync::atomic::{AtomicBool, Ordering};

/// Keeps the library mapped until the process exits; called before a background thread starts.
pub fn keep_loaded() {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.load(Ordering::Relaxed) || DONE.swap(true, Ordering::AcqRel) {
        return;
    }
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let this: fn() = keep_loaded;
    // SAFETY: dladdr only reads the loader's tables for an address of this library, and writes
    // `info` (zeroed, so its pointers are null unless set).
    let found = unsafe { libc::dladdr(this as *const libc::c_void, info.as_mut_ptr()) } != 0;
    // SAFETY: zeroed is a valid Dl_info, and dladdr filled it in when it found the object.
    let info = unsafe { info.assume_init() };
    if !found || info.dli_fname.is_null() {
        return;
    }
    // SAFETY: the name the loader gave for this very object; RTLD_NOLOAD only finds an object that
    // is loaded already and RTLD_NODELETE keeps it. The handle is never closed on purpose.
    let handle = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE) };
    if handle.is_null() {
        tracing::debug!("the library could not be kept loaded; a dlclose of it would stop its threads badly");
    }
}
