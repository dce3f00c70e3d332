//! Suspending a process's GPU work from outside: `vgpu-smi suspend` sets the `suspend` field of
//! the process's slot extension in the shared region, `vgpu-smi resume` clears it. The wrappers of
//! launches, copies and sets (`suspendable` in `cuda-api.toml`) call [`wait_while_suspended`]
//! first, a prologue the generator writes, and hold there while it is set. This replaces
//! HAMi-core's SIGUSR1/SIGUSR2 handlers: the library never installs a signal handler.
//!
//! Cost when not suspended: two loads (the flag's address, set when the process attaches to the
//! region, and the flag). While suspended the thread sleeps in [`POLL_INTERVAL`] steps: no
//! spinning, and it resumes within one step of the flag being cleared.

use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
use std::time::Duration;

/// How often a suspended thread looks at the flag again.
pub const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// This process's suspend flag in the region mapping (null before CUDA initialises).
static FLAG: AtomicPtr<AtomicU32> = AtomicPtr::new(std::ptr::null_mut());

/// Points the check at this process's slot (at attach, and again in a forked child).
pub fn watch(flag: &'static AtomicU32) {
    FLAG.store((flag as *const AtomicU32).cast_mut(), Ordering::Release);
}

/// Whether this process is suspended now.
#[inline(always)]
pub fn suspended() -> bool {
    let flag = FLAG.load(Ordering::Acquire);
    // SAFETY: a non-null pointer was made from a `&'static AtomicU32` in the region mapping, which
    // lives as long as the process (the session holding it is never dropped).
    !flag.is_null() && unsafe { &*flag }.load(Ordering::Acquire) != 0
}

/// Returns at once unless this process's slot is suspended; otherwise sleeps until it is resumed.
/// A process that has not initialised CUDA (no region, no slot) is never suspended. It runs in
/// the wrapper before its panic guard, so the wait has a guard of its own.
#[inline(always)]
pub fn wait_while_suspended() {
    if suspended() {
        wait_for_resume();
    }
}

#[cold]
#[inline(never)]
fn wait_for_resume() {
    let waited = std::panic::catch_unwind(|| {
        super::self_release::wanted();
        tracing::info!("suspended by vgpu-smi: GPU work waits until `vgpu-smi resume`");
        while suspended() {
            std::thread::sleep(POLL_INTERVAL);
        }
        tracing::info!("resumed");
    });
    // A panic (in logging) must not cross into C: the call goes on once resumed.
    if waited.is_err() {
        while suspended() {
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}
