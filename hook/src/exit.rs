//! Normal process exit (return from `main`, `exit()`) and unloading of the library: the process's
//! slot in the shared region is given back, with everything still charged to it, as HAMi-core
//! does, so neither HAMi's monitor nor the container's other processes go on counting the memory
//! and utilisation of a process that has ended. A process killed by a signal (or leaving with
//! `_exit`) runs none of this: its slot is reaped by the region's next attach, charge refusal or
//! reap (`docs/region-layout.md`).
//!
//! The hook is an ELF destructor (`.fini_array`), not an `atexit` handler: the dynamic linker runs
//! destructors after every `atexit` handler and C++ static destructor, so the application's and
//! the CUDA runtime's own teardown (frees, module unloads) has been accounted by then, and it also
//! runs when the library is unloaded with `dlclose`. It never calls the driver (libcuda's own
//! destructors may have run already), takes the region's lock with its usual bounded wait, and
//! waits at most [`WRITERS_WAIT`] for the background threads to leave the slot.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Set once the process has begun to exit: background threads stop writing into the slot.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Background threads inside a write to this process's slot ([`SlotWrite`]).
static SLOT_WRITERS: AtomicUsize = AtomicUsize::new(0);
/// Longest wait for a background thread to finish writing into the slot. Past it the slot is left
/// as it is, to be reaped like a killed process's, rather than freed under a writer (which could
/// then write into the slot of the next process to claim it).
const WRITERS_WAIT: Duration = Duration::from_millis(100);

/// A background thread's write into this process's slot (the limiter's published utilisation);
/// the slot stays this process's until it is dropped.
pub struct SlotWrite(());

impl Drop for SlotWrite {
    fn drop(&mut self) {
        SLOT_WRITERS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Begins a write into this process's slot; `None` once the process is exiting (the slot may be
/// gone). Sequentially consistent with [`give_back`]'s flag and count: either the exit sees the
/// writer and waits for it, or the writer sees the exit and does not write.
pub fn slot_write() -> Option<SlotWrite> {
    register_fork_handler();
    SLOT_WRITERS.fetch_add(1, Ordering::SeqCst);
    if EXITING.load(Ordering::SeqCst) {
        SLOT_WRITERS.fetch_sub(1, Ordering::SeqCst);
        return None;
    }
    Some(SlotWrite(()))
}

/// Whether the process has begun to exit: background threads stop.
pub fn exiting() -> bool {
    EXITING.load(Ordering::Relaxed)
}

/// A forked child has none of its parent's threads, so none of their writes.
extern "C" fn forked_child() {
    SLOT_WRITERS.store(0, Ordering::SeqCst);
}

fn register_fork_handler() {
    // A flag rather than a `Once`, which a child forked in the middle would wait on forever.
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if !REGISTERED.load(Ordering::Relaxed) && !REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a plain function that only stores an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    }
}

/// The destructor: run by the dynamic linker at normal exit and at `dlclose`.
extern "C" fn at_unload() {
    // Nothing may unwind out of a destructor; a panic here only leaves the slot to be reaped.
    let _ = std::panic::catch_unwind(give_back);
}

#[used]
#[unsafe(link_section = ".fini_array")]
static AT_UNLOAD: extern "C" fn() = at_unload;

/// Stops the background writers (bounded wait), then gives the slot back.
fn give_back() {
    EXITING.store(true, Ordering::SeqCst);
    let start = Instant::now();
    while SLOT_WRITERS.load(Ordering::SeqCst) != 0 {
        if start.elapsed() >= WRITERS_WAIT {
            tracing::debug!("exit: a background thread is still writing into the slot; it is left to be reaped");
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    crate::throttle::write_kernel_time_at_exit();
    crate::session::detach_at_exit();
}
