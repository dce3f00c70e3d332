//! Kernel activity for HAMi's monitor: the region's `last_kernel_time` (unix seconds of the last
//! launch, HAMi's last-kernel metric and priority feedback), moved by every launch, limited or
//! not, and written at attach (`session::start`) and at normal exit ([`write_at_exit`]).
//!
//! The unlimited launch path pays nothing for it: a tick ([`TICK_PERIOD`]) that has written the
//! time (at most once a second) turns the mode from `Off` to `Idle`, and the fast path goes to the
//! driver directly only while it is `Off`, so the next launch takes the handler's path once, where
//! [`launched`] turns it back. Limited launches set a flag instead. So an unlimited launch makes
//! no system call and no extra load, and busy launches leave the fast path once a second.
//!
//! The tick also follows the region's live compute limits
//! ([`super::runtime::follow_live_limits`]), keeps the region's path naming the container's region
//! ([`crate::session::keep_region_path`]), repairs the process's slot (`memory::restore`), and
//! moves elastic memory back to the device when it has room ([`crate::memory::elastic_tick`]).
//!
//! The process's first launch, on the handler's path, starts the tick ([`ensure_tick`]); a process
//! that never launches has none (and can be unloaded: a running thread pins the library). A forked
//! child has no tick thread: the `pthread_atfork` handler clears the flags and makes the limiter
//! decide its mode again, so the child's first launch starts a tick of its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{MODE, Mode};

/// How often the tick runs.
pub const TICK_PERIOD: Duration = Duration::from_millis(500);
/// `last_kernel_time` is written at most this often.
const WRITE_PERIOD_NS: u64 = 1_000_000_000;

/// A launch on the handler's path happened since the tick last wrote `last_kernel_time`.
static LAUNCHED: AtomicBool = AtomicBool::new(false);
/// The tick thread is running (or being started) in this process.
static TICKING: AtomicBool = AtomicBool::new(false);
/// A launch the tick saw has not been written into `last_kernel_time` yet.
static UNWRITTEN: AtomicBool = AtomicBool::new(false);

/// A launch on the handler's path notes that it happened. True when it is an unlimited launch
/// that found the mode `Idle` (the first since the tick wrote): it goes to the driver directly.
#[inline]
pub fn launched() -> bool {
    if MODE.is(Mode::Idle) && MODE.turn(Mode::Idle, Mode::Off) {
        return true;
    }
    note_launch();
    false
}

/// Notes a launch for the next tick.
#[inline]
pub fn note_launch() {
    if !LAUNCHED.load(Ordering::Relaxed) {
        LAUNCHED.store(true, Ordering::Relaxed);
    }
}

/// Starts the tick unless it runs: called where a process's launches first take the handler's
/// path (the limiter's decision, once per process and again in a forked child). Nothing to do
/// without a region (cuInit has not succeeded here).
#[cold]
pub fn ensure_tick() {
    if TICKING.load(Ordering::Relaxed) || crate::session::get().is_none() {
        return;
    }
    if !TICKING.swap(true, Ordering::AcqRel) {
        start_tick();
    }
}

extern "C" fn forked_child() {
    TICKING.store(false, Ordering::Relaxed);
    crate::session::TICK_KEEPS_PATH.store(false, Ordering::Relaxed);
    LAUNCHED.store(false, Ordering::Relaxed);
    // The child's first launch decides again, on the handler's path, where its tick starts.
    MODE.store(Mode::Undecided);
}

fn start_tick() {
    // A flag rather than a `Once`, which a child forked in the middle would wait on forever.
    static AT_FORK: AtomicBool = AtomicBool::new(false);
    if !AT_FORK.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a plain function that only stores atomics.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    }
    crate::loaded::keep_loaded();
    let spawned = std::thread::Builder::new().name("vgpu-tick".into()).spawn(tick_loop);
    if let Err(error) = spawned {
        tracing::error!("cannot start the library's tick thread ({error}): last_kernel_time is not updated");
    }
}

fn tick_loop() {
    let mut written = 0u64;
    let mut said = false;
    crate::session::TICK_KEEPS_PATH.store(true, Ordering::Relaxed);
    loop {
        std::thread::sleep(TICK_PERIOD);
        if crate::exit::exiting() {
            crate::session::TICK_KEEPS_PATH.store(false, Ordering::Relaxed);
            return;
        }
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tick(&mut written)));
        if step.is_err() && !std::mem::replace(&mut said, true) {
            tracing::error!("the library's tick failed; skipping it");
        }
    }
}

/// One tick: `last_kernel_time` when a launch happened and a second has passed since the last
/// write; then the region's live compute limits.
fn tick(written: &mut u64) {
    let Some(session) = crate::session::get() else {
        return;
    };
    let now = super::now_ns();
    let due = now.saturating_sub(*written) >= WRITE_PERIOD_NS;
    // Launches are looked at once a write is due, or every tick while an idle release watches
    // them: each look sends the next unlimited launch through the handler once.
    let watching = crate::session::self_release::watches_launches();
    let launched = (due || watching) && take_launches();
    UNWRITTEN.fetch_or(launched, Ordering::Relaxed);
    if due && UNWRITTEN.swap(false, Ordering::Relaxed) {
        crate::session::write_kernel_time(session.region());
        *written = now;
    }
    crate::session::self_release::tick(session, launched);
    super::runtime::follow_live_limits(session);
    crate::session::keep_region_path(session);
    crate::memory::restore_tick();
    crate::memory::elastic_tick();
}

/// At normal exit: writes `last_kernel_time` when a launch happened since the tick last wrote it.
/// A process that launches and exits within a tick period would otherwise leave its last launches
/// out (HAMi would see the time it attached). Nothing is added to the launch path: the same flags
/// the tick reads say whether a launch happened.
pub fn write_at_exit() {
    let Some(session) = crate::session::get() else {
        return;
    };
    if take_launches() | UNWRITTEN.swap(false, Ordering::Relaxed) {
        crate::session::write_kernel_time(session.region());
    }
}

/// Whether a launch happened since the last call. `Off` means one did (the process's first launch
/// decided it, or a launch turned `Idle` back): it becomes `Idle`, so the next launch shows again.
fn take_launches() -> bool {
    let unlimited = MODE.turn(Mode::Off, Mode::Idle);
    let limited = LAUNCHED.swap(false, Ordering::Relaxed);
    unlimited || limited
}
