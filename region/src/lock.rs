//! The region's lock: one that no byte of the (world-writable) file can turn into a crash, a read
//! through a pointer, or a wait over [`LOCK_TIMEOUT`] behind a holder that does not let go (or
//! over [`MAX_LOCK_WAIT`] behind a lock that keeps changing hands: a thousand processes starting
//! at once, thousands of threads).
//!
//! It has two stages:
//!
//! 1. **Threads of one process** queue at a [`ThreadGate`]: a word taken with one compare-exchange
//!    when free; waiters queue in arrival order and sleep, a release wakes the head of the queue,
//!    and one whose head has waited [`GATE_FAIR_AFTER`] hands the gate straight to it, so threads
//!    looping on the lock cannot starve the others, even thousands of them. Open-file-description
//!    locks do not exclude threads that share the description, hence this stage. (Not
//!    `parking_lot`: its global table of waiters could be left locked in a forked child by a
//!    thread the child does not have.)
//! 2. **Processes** take a write lock on the byte at [`FILE_LOCK_OFFSET`] with `F_OFD_SETLK`, each
//!    on an open file description of its own. The kernel holds that lock outside the file and
//!    releases it when the description's last descriptor closes, so a holder killed with SIGKILL
//!    never blocks anyone, in any pid namespace, and nothing written into the file can confuse it.
//!
//! `F_OFD_SETLKW` waits without a deadline (only a signal interrupts it, and a library must not
//! install signal handlers), so a waiter retries `F_OFD_SETLK`, sleeping between tries on a futex
//! word of the file, at most [`SLEEP_AT_MOST`] at a time (longer while another process holds the
//! favour and many wait, up to [`DEFERRED_SLEEP_AT_MOST`]):
//!
//! - Waiters sleep on [`LockWords::wake`] and count themselves in [`LockWords::sleepers`]; a
//!   release that sees sleepers bumps `wake` and wakes one, the one that has slept longest (the
//!   kernel queues futex sleepers in order); the others stay asleep.
//! - A waiter woken from that sleep that still finds the lock taken takes the *favour*: a second
//!   file lock, on the byte at [`FAVOUR_LOCK_OFFSET`], which one process holds at a time; it
//!   writes its token into [`LockWords::favoured`] and sleeps on [`LockWords::favoured_wake`].
//!   While a favour is held, no other process tries the lock, and a release wakes the favoured
//!   process; when that one gets the lock it drops the favour and wakes the next sleeper, which
//!   takes the favour while the lock is held. So the lock passes from process to process in the
//!   order they came to sleep, however often one would take it again, much as a mutex that hands
//!   itself over. The favour is checked with `F_OFD_GETLK`, not trusted from the word, so a
//!   token a writer made up holds nobody back, nor does a favoured process that dies (the kernel
//!   drops its file locks) for longer than the waiters' sleeps: up to [`DEFERRED_SLEEP_AT_MOST`]
//!   among many, unless a release wakes one of them first.
//!
//! The words of [`LockWords`] are only hints. A writer can make a sleeper sleep [`SLEEP_AT_MOST`],
//! or [`DEFERRED_SLEEP_AT_MOST`] while a favour is held (a lower `sleepers`: no wake-up), cost
//! releases a useless wake-up and deferring sleepers longer sleeps, up to
//! [`DEFERRED_SLEEP_AT_MOST`] (a higher one: each useless wake-up takes one off), make waiters spin
//! until the deadline (changing `wake` without end), cost one `F_OFD_GETLK` (a `favoured` token
//! nobody holds), make the next holder recompute the totals (a nonzero `holder`), or make a waiter
//! behind a stuck holder wait [`MAX_LOCK_WAIT`] instead of [`LOCK_TIMEOUT`] (bumping
//! `acquisitions` without end); every wait stays bounded by [`MAX_LOCK_WAIT`]. Holding the file
//! locks themselves takes opening the file, which any process that can write it can do: that
//! makes everyone wait for the deadline, as holding any lock would.
//!
//! **Fork.** A child shares the parent's descriptions, and with them the parent's lock: it must
//! never lock through them, and must not keep them open either (a parent killed while holding
//! the lock would leave it held as long as the child lives). A `pthread_atfork` child handler
//! closes every description this crate opened for locking (up to [`DESCRIPTION_SLOTS`] at once;
//! others stay open in the child, unused) and bumps a counter; the child's first lock then opens
//! a description and a gate of its own (the parent's gate may be held by a thread the child does
//! not have). Descriptions are opened `O_CLOEXEC`, so `exec` closes them too.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::fd::{IntoRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::layout::{FAVOUR_LOCK_OFFSET, FILE_LOCK_OFFSET, LockWords};
use crate::sys;
use crate::{LOCK_TIMEOUT, MAX_LOCK_WAIT};

/// The longest sleep between two tries of the file lock (a release wakes a sleeper at once; a
/// holder's death, or a wake-up a writer's values made go astray, does not).
const SLEEP_AT_MOST: Duration = Duration::from_millis(5);
/// While another process holds the favour, the others only wait for a release to wake them in
/// turn or for the favoured process to die (which wakes nobody), so they sleep longer the more of
/// them wait: together they wake at most this often. Otherwise a thousand processes starting at
/// once spend the CPUs on their wake-ups and starve the holder.
const DEFERRED_WAKES_PER_SECOND: u32 = 20_000;
/// The longest sleep of a process deferring to the favoured one: how late the favoured process's
/// death is noticed at worst when nothing is released after it (a release that finds the favoured
/// process not asleep wakes a deferring one too). The favoured process itself sleeps
/// [`SLEEP_AT_MOST`], so another holder's death is noticed as soon as without a favour.
const DEFERRED_SLEEP_AT_MOST: Duration = Duration::from_millis(50);

/// The sleep of a process that defers to the favoured one, `sleepers` waiting in all.
fn deferred_sleep(sleepers: u32) -> Duration {
    (Duration::from_secs(1).saturating_mul(sleepers) / DEFERRED_WAKES_PER_SECOND)
        .clamp(SLEEP_AT_MOST, DEFERRED_SLEEP_AT_MOST)
}
static TAKE_LOCK: sys::ByteLock = sys::ByteLock::write(FILE_LOCK_OFFSET);
static RELEASE_LOCK: sys::ByteLock = sys::ByteLock::release(FILE_LOCK_OFFSET);
static TAKE_FAVOUR: sys::ByteLock = sys::ByteLock::write(FAVOUR_LOCK_OFFSET);
static RELEASE_FAVOUR: sys::ByteLock = sys::ByteLock::release(FAVOUR_LOCK_OFFSET);

/// Lock descriptions the fork handler can find and close in a child.
pub(crate) const DESCRIPTION_SLOTS: usize = 64;

/// Why the lock was not taken.
#[derive(Debug)]
pub(crate) enum LockError {
    /// Nobody took the lock for [`LOCK_TIMEOUT`]: its holder is stuck.
    Timeout,
    /// The lock kept changing hands for [`MAX_LOCK_WAIT`] without reaching this thread.
    Busy,
    /// `fcntl` failed (a filesystem without OFD locks, for example), or a forked child could not
    /// open a description of its own.
    Io(io::Error),
}

/// Forks seen by this process's line of ancestors: bumped in every child. A [`ProcessSide`] made
/// under another value belongs to an ancestor.
static FORKS: AtomicU64 = AtomicU64::new(0);
/// Lock descriptions of this process, which the child handler closes. -1: free.
static DESCRIPTIONS: [AtomicI32; DESCRIPTION_SLOTS] = [const { AtomicI32::new(-1) }; DESCRIPTION_SLOTS];

/// `pthread_atfork` child handler: only atomics and `close` (async-signal-safe).
extern "C" fn forked_child() {
    for slot in &DESCRIPTIONS {
        let fd = slot.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the parent registered this descriptor as its own lock description; the
            // child's copy is closed here and never used again (its side is stale: FORKS moves).
            unsafe { sys::close(fd) };
        }
    }
    FORKS.fetch_add(1, Ordering::AcqRel);
}

/// The region's lock, as one [`crate::Region`] uses it.
pub(crate) struct RegionLock {
    /// This process's side; replaced (and the old one leaked) in a forked child.
    side: AtomicPtr<ProcessSide>,
    /// The region's descriptor (owned by the `Region`, open as long as this lock), from which a
    /// child opens its own description through `/proc/self/fd`.
    region_fd: RawFd,
    /// Device and inode of the region file, so a description is only ever opened on it.
    identity: (u64, u64),
    path: PathBuf,
}

impl RegionLock {
    /// The lock of the region file `file` (opened at `path`), with a description of its own.
    pub(crate) fn new(file: &File, region_fd: RawFd, path: &Path) -> io::Result<RegionLock> {
        static HANDLER: AtomicBool = AtomicBool::new(false);
        if !HANDLER.swap(true, Ordering::AcqRel) {
            sys::at_fork_in_child(forked_child);
        }
        let metadata = file.metadata()?;
        let identity = (metadata.dev(), metadata.ino());
        let side = ProcessSide::open(region_fd, identity, path)?;
        Ok(RegionLock {
            side: AtomicPtr::new(Box::into_raw(Box::new(side))),
            region_fd,
            identity,
            path: path.to_owned(),
        })
    }

    /// Takes the lock, waiting at most [`LOCK_TIMEOUT`] in all.
    #[inline]
    pub(crate) fn acquire<'a>(&'a self, words: &'a LockWords) -> Result<Held<'a>, LockError> {
        let side = self.side()?;
        let mut clock = Clock::watching(&words.acquisitions);
        if !side.gate.enter(&mut clock) {
            return Err(clock.timeout());
        }
        let locked = if words.favoured.load(Ordering::Relaxed) == 0 {
            sys::ofd_lock(side.fd, &TAKE_LOCK).map_err(LockError::Io)
        } else {
            Ok(false)
        };
        let locked = match locked {
            Ok(false) => wait_for_file(side, words, &mut clock),
            other => other.map(|_| ()),
        };
        if let Err(error) = locked {
            side.gate.leave();
            return Err(error);
        }
        let previous = words.holder.swap(side.token, Ordering::AcqRel);
        words.acquisitions.fetch_add(1, Ordering::Relaxed);
        Ok(Held {
            side,
            words,
            interrupted: previous != 0,
        })
    }

    /// This process's side, made anew on the first use in a forked child.
    #[inline]
    fn side(&self) -> Result<&ProcessSide, LockError> {
        // SAFETY: never null; a side is freed only when self drops (replaced ones are leaked).
        let side = unsafe { &*self.side.load(Ordering::Acquire) };
        if side.generation == FORKS.load(Ordering::Acquire) {
            Ok(side)
        } else {
            self.renew(side)
        }
    }

    #[cold]
    #[inline(never)]
    fn renew(&self, stale: &ProcessSide) -> Result<&ProcessSide, LockError> {
        let fresh = ProcessSide::open(self.region_fd, self.identity, &self.path).map_err(LockError::Io)?;
        let fresh = Box::into_raw(Box::new(fresh));
        let stale = std::ptr::from_ref(stale).cast_mut();
        match self
            .side
            .compare_exchange(stale, fresh, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: the stale side stays allocated (leaked: a thread may still be reading
                // its generation); only its descriptor is closed, once, by the thread that
                // replaced it, and never used again (its generation is stale for good).
                unsafe { &*stale }.close_inherited();
                // SAFETY: from Box::into_raw just above; freed only when self drops.
                Ok(unsafe { &*fresh })
            }
            Err(current) => {
                // Another thread of the child was first: ours goes.
                // SAFETY: from Box::into_raw above, never shared.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: never null; freed only when self drops.
                Ok(unsafe { &*current })
            }
        }
    }
}

impl Drop for RegionLock {
    fn drop(&mut self) {
        // SAFETY: the current side came from Box::into_raw and nothing borrows it any more
        // (guards borrow the Region that owns self).
        drop(unsafe { Box::from_raw(self.side.load(Ordering::Acquire)) });
    }
}

/// Proof that this thread holds the region's lock; releases it on drop.
pub(crate) struct Held<'a> {
    side: &'a ProcessSide,
    words: &'a LockWords,
    /// The previous holder left [`LockWords::holder`] set: it died in the middle of an update
    /// (or a writer set the word), so the totals may be half updated.
    pub(crate) interrupted: bool,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.words.holder.store(0, Ordering::Release);
        // Unlocking a lock this description holds cannot fail; if it somehow did, the description
        // closes with the process and the kernel releases it then.
        let _ = sys::ofd_lock(self.side.fd, &RELEASE_LOCK);
        if self.words.favoured.load(Ordering::Acquire) != 0 || self.words.sleepers.load(Ordering::Acquire) != 0 {
            wake_next(self.words);
        }
        self.side.gate.leave();
    }
}

/// Wakes the next process: the favoured one if there is one, else the one that has slept longest.
#[cold]
#[inline(never)]
fn wake_next(words: &LockWords) {
    if words.favoured.load(Ordering::Acquire) != 0 {
        words.favoured_wake.fetch_add(1, Ordering::AcqRel);
        if sys::futex_wake(&words.favoured_wake, 1) == 0 {
            // The favoured process is not asleep: it is on its way to try, or it died holding the
            // favour, which the processes deferring to it would otherwise notice only when their
            // longer sleeps end. One of them comes to look.
            wake_sleeper(words);
        }
    } else {
        wake_sleeper(words);
    }
}

/// Wakes the process that has slept longest on `wake`.
fn wake_sleeper(words: &LockWords) {
    words.wake.fetch_add(1, Ordering::AcqRel);
    if sys::futex_wake(&words.wake, 1) == 0 {
        // Nobody slept: a sleeper died counted (or a writer raised the count). Take one off, so
        // that a stale count costs a few useless wake-ups, not one per release for ever.
        decrement(&words.sleepers);
    }
}

/// Takes one off a count, never below 0.
fn decrement(count: &std::sync::atomic::AtomicU32) {
    let _ = count.fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| value.checked_sub(1));
}

/// The slow path of the file stage: retries until the lock is free and no other process holds
/// the favour, or the deadline passes.
#[cold]
#[inline(never)]
fn wait_for_file(side: &ProcessSide, words: &LockWords, clock: &mut Clock) -> Result<(), LockError> {
    let mut favour_held = false;
    // Only a process that has slept in the queue takes the favour: they take it in the order
    // the kernel woke them, the order they came.
    let mut slept = false;
    let result = loop {
        let defer = if favour_held {
            false
        } else {
            match favour_taken(side, words) {
                Ok(taken) => taken,
                Err(error) => break Err(LockError::Io(error)),
            }
        };
        // Read before the try: a release after a failed try moves the word on, and the sleep
        // below then returns at once.
        let (word, counted) = if favour_held {
            (&words.favoured_wake, false)
        } else {
            words.sleepers.fetch_add(1, Ordering::AcqRel);
            (&words.wake, true)
        };
        let seen = word.load(Ordering::Acquire);
        let uncount = || {
            if counted {
                decrement(&words.sleepers);
            }
        };
        if !defer {
            match sys::ofd_lock(side.fd, &TAKE_LOCK) {
                Ok(true) => {
                    uncount();
                    break Ok(());
                }
                Ok(false) => {}
                Err(error) => {
                    uncount();
                    break Err(LockError::Io(error));
                }
            }
        }
        let Some(left) = clock.left() else {
            uncount();
            break Err(clock.timeout());
        };
        if !favour_held && !defer && slept {
            match sys::ofd_lock(side.fd, &TAKE_FAVOUR) {
                Ok(true) => {
                    favour_held = true;
                    words.favoured.store(side.token, Ordering::Release);
                    // Try again at once, now as the favoured process (sleeping on its own word).
                    uncount();
                    continue;
                }
                Ok(false) => {}
                Err(error) => {
                    uncount();
                    break Err(LockError::Io(error));
                }
            }
        }
        let sleep = if defer {
            deferred_sleep(words.sleepers.load(Ordering::Relaxed))
        } else {
            SLEEP_AT_MOST
        };
        sys::futex_wait(word, seen, sleep.min(left));
        slept = true;
        uncount();
    };
    if favour_held {
        let _ = words
            .favoured
            .compare_exchange(side.token, 0, Ordering::AcqRel, Ordering::Relaxed);
        let _ = sys::ofd_lock(side.fd, &RELEASE_FAVOUR);
        // Pass the favour on: the process that has slept longest wakes now, fails against our
        // hold, and takes the favour, so that our release hands the lock straight to it.
        if words.sleepers.load(Ordering::Acquire) != 0 {
            wake_sleeper(words);
        }
    }
    result
}

/// Whether another process holds the favour. Only asks the kernel when `favoured` says someone
/// may; a token nobody holds the favour for (its process died, or a writer made it up) is cleared.
fn favour_taken(side: &ProcessSide, words: &LockWords) -> io::Result<bool> {
    let favoured = words.favoured.load(Ordering::Acquire);
    if favoured == 0 {
        return Ok(false);
    }
    let taken = sys::ofd_lock_held_elsewhere(side.fd, FAVOUR_LOCK_OFFSET)?;
    if !taken {
        let _ = words
            .favoured
            .compare_exchange(favoured, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
    Ok(taken)
}

/// How long an acquisition may still wait, read from the clock only once it has to wait. It gives
/// up when the lock has not changed hands for [`LOCK_TIMEOUT`] (its holder is stuck), or after
/// [`MAX_LOCK_WAIT`] in all while it kept changing hands to others.
#[derive(Default)]
struct Clock<'a> {
    /// [`LockWords::acquisitions`]: moves whenever some process takes the lock. None: the
    /// deadline is [`LOCK_TIMEOUT`] from the start.
    acquisitions: Option<&'a AtomicU32>,
    started: Option<Instant>,
    /// The count last seen, and when it was first seen.
    progress: Option<(u32, Instant)>,
    /// The deadline that passed was [`MAX_LOCK_WAIT`]'s.
    busy: bool,
}

impl<'a> Clock<'a> {
    fn watching(acquisitions: &'a AtomicU32) -> Clock<'a> {
        Clock {
            acquisitions: Some(acquisitions),
            ..Clock::default()
        }
    }

    /// Time left before the deadline; `None` once it has passed.
    fn left(&mut self) -> Option<Duration> {
        let now = Instant::now();
        let started = *self.started.get_or_insert(now);
        let seen = self.acquisitions.map_or(0, |count| count.load(Ordering::Relaxed));
        let moved = match self.progress {
            Some((count, at)) if count == seen => at,
            _ if self.acquisitions.is_none() => started,
            _ => {
                self.progress = Some((seen, now));
                now
            }
        };
        let stuck_left = LOCK_TIMEOUT.saturating_sub(now.duration_since(moved));
        let busy_left = MAX_LOCK_WAIT.saturating_sub(now.duration_since(started));
        self.busy = busy_left < stuck_left;
        Some(stuck_left.min(busy_left)).filter(|left| !left.is_zero())
    }

    /// Why the deadline passed.
    fn timeout(&self) -> LockError {
        if self.busy { LockError::Busy } else { LockError::Timeout }
    }
}

/// What one process needs to take the lock: its own description of the region file, its thread
/// gate and its token.
struct ProcessSide {
    /// [`FORKS`] when it was made: stale in a forked child.
    generation: u64,
    /// An open file description of the region file, this process's own.
    fd: RawFd,
    /// Where `fd` is registered in [`DESCRIPTIONS`] (`None`: all slots were taken).
    registered: Option<usize>,
    /// Random and nonzero: this process in [`LockWords`], whatever its pid namespace.
    token: u64,
    gate: ThreadGate,
}

impl ProcessSide {
    fn open(region_fd: RawFd, identity: (u64, u64), path: &Path) -> io::Result<ProcessSide> {
        // Read first: a fork from here on leaves the child a side it sees as stale.
        let generation = FORKS.load(Ordering::Acquire);
        let fd = open_description(region_fd, identity, path)?.into_raw_fd();
        let registered = DESCRIPTIONS.iter().position(|slot| {
            slot.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        Ok(ProcessSide {
            generation,
            fd,
            registered,
            token: random_token(),
            gate: ThreadGate::default(),
        })
    }

    /// In a child, closes the parent's description if the fork handler could not (it was not
    /// registered).
    fn close_inherited(&self) {
        if self.registered.is_none() {
            // SAFETY: the child's copy of a descriptor the handler did not close; this side is
            // stale and never uses it again, and this is called once (by the thread that
            // replaced the side).
            unsafe { sys::close(self.fd) };
        }
    }
}

impl Drop for ProcessSide {
    fn drop(&mut self) {
        let ours = self.generation == FORKS.load(Ordering::Acquire);
        let close = match self.registered {
            Some(index) => {
                ours && DESCRIPTIONS[index]
                    .compare_exchange(self.fd, -1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            }
            // Ours, or a copy inherited through fork that the handler did not close.
            None => true,
        };
        if close {
            // SAFETY: the descriptor was opened by this side (or inherited by this process) and
            // is closed once, here; in a child, a registered one was closed by the handler.
            unsafe { sys::close(self.fd) };
        }
    }
}

/// Opens a new description of the region file: through `/proc/self/fd` (the very file, even if
/// the path now names another), else through the path; either must be the same inode.
fn open_description(region_fd: RawFd, identity: (u64, u64), path: &Path) -> io::Result<File> {
    let same = |file: &File| {
        file.metadata()
            .is_ok_and(|metadata| (metadata.dev(), metadata.ino()) == identity)
    };
    let proc_path = format!("/proc/self/fd/{region_fd}");
    if let Ok(file) = OpenOptions::new().read(true).write(true).open(proc_path)
        && same(&file)
    {
        return Ok(file);
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if same(&file) {
        Ok(file)
    } else {
        Err(io::Error::other("another file is at the region's path now"))
    }
}

/// A random nonzero token (std's per-process random hash keys, mixed with the time).
fn random_token() -> u64 {
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos()),
    );
    hasher.write_u32(std::process::id());
    hasher.finish() | 1
}

/// A waiter of the [`ThreadGate`] that has waited this long is handed the gate at the next way
/// out, ahead of any thread that comes running.
const GATE_FAIR_AFTER: Duration = Duration::from_millis(1);

/// The threads of one process, one at a time. Uncontended, one compare-exchange in and one out.
/// Contended, the waiters queue and sleep, each on a futex word of its own. A thread leaving wakes
/// the waiter at the head of the queue, which takes the gate if no running thread took it first
/// (handing over at every way out would cost a context switch each time). Once the head has waited
/// [`GATE_FAIR_AFTER`], the thread leaving hands the gate to it directly, so a thread that leaves
/// and comes straight back (running, where the waiters sleep) can no longer take it: under a storm
/// of threads the gate goes round in arrival order.
#[derive(Default)]
struct ThreadGate {
    /// [`GATE_FREE`], [`GATE_HELD`] or [`GATE_CONTENDED`] (held, and the way out goes through
    /// `waiters`).
    state: AtomicU32,
    waiters: Mutex<Waiters>,
}

const GATE_FREE: u32 = 0;
const GATE_HELD: u32 = 1;
const GATE_CONTENDED: u32 = 2;

#[derive(Default)]
struct Waiters {
    /// Threads waiting in [`ThreadGate::enter`], in arrival order.
    queue: VecDeque<Waiter>,
    /// The ticket of the next thread to queue.
    next_ticket: u64,
    /// The ticket the last thread out handed the gate to, until that thread takes it.
    handed_to: Option<u64>,
}

struct Waiter {
    ticket: u64,
    /// Set to 1 (and woken) when the waiter should look again; its own futex word, not a
    /// `Thread` handle, as a thread in its last thread-local destructors may still free memory.
    wake: Arc<AtomicU32>,
    since: Instant,
}

impl Waiters {
    /// Takes a waiter out of the queue (usually its head: the one woken).
    fn leave_queue(&mut self, ticket: u64) {
        if let Some(index) = self.queue.iter().position(|waiter| waiter.ticket == ticket) {
            self.queue.remove(index);
        }
    }
}

impl ThreadGate {
    /// Enters the gate; false if that did not happen within the deadline.
    #[inline]
    fn enter(&self, clock: &mut Clock) -> bool {
        self.state
            .compare_exchange(GATE_FREE, GATE_HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            || self.wait(clock)
    }

    #[cold]
    #[inline(never)]
    fn wait(&self, clock: &mut Clock) -> bool {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        let ticket = waiters.next_ticket;
        waiters.next_ticket += 1;
        let wake = Arc::new(AtomicU32::new(0));
        waiters.queue.push_back(Waiter {
            ticket,
            wake: Arc::clone(&wake),
            since: Instant::now(),
        });
        loop {
            // Cleared under the queue's lock: a wake-up from now on is seen by the wait below.
            wake.store(0, Ordering::Relaxed);
            // A handover is taken even by a waiter whose deadline just passed: someone must.
            if waiters.handed_to == Some(ticket) {
                waiters.handed_to = None;
                return true;
            }
            match self.state.load(Ordering::Acquire) {
                // Taken contended: the way out must look at the queue this thread leaves behind.
                GATE_FREE => {
                    if self
                        .state
                        .compare_exchange(GATE_FREE, GATE_CONTENDED, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                    {
                        waiters.leave_queue(ticket);
                        return true;
                    }
                    continue;
                }
                // Make the holder's way out come here; if it left meanwhile, look again.
                GATE_HELD
                    if self
                        .state
                        .compare_exchange(GATE_HELD, GATE_CONTENDED, Ordering::Relaxed, Ordering::Relaxed)
                        .is_err() =>
                {
                    continue;
                }
                _ => {}
            }
            // Only now, with the gate seen held: whoever holds it leaves through the queue and
            // wakes the next waiter, so giving up here strands nobody.
            let Some(left) = clock.left() else {
                waiters.leave_queue(ticket);
                return false;
            };
            drop(waiters);
            sys::futex_wait(&wake, 0, left);
            waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Leaves the gate, waking or handing it to a waiter if there is one.
    #[inline]
    fn leave(&self) {
        if self
            .state
            .compare_exchange(GATE_HELD, GATE_FREE, Ordering::Release, Ordering::Relaxed)
            .is_err()
        {
            self.hand_over();
        }
    }

    #[cold]
    #[inline(never)]
    fn hand_over(&self) {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(head) = waiters.queue.front() else {
            self.state.store(GATE_FREE, Ordering::Release);
            return;
        };
        let wake = Arc::clone(&head.wake);
        if head.since.elapsed() >= GATE_FAIR_AFTER {
            // The gate stays held (contended) for the head, which no longer queues.
            let ticket = head.ticket;
            waiters.queue.pop_front();
            waiters.handed_to = Some(ticket);
        } else {
            self.state.store(GATE_FREE, Ordering::Release);
        }
        wake.store(1, Ordering::Relaxed);
        drop(waiters);
        sys::futex_wake(&wake, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::UnsafeCell;
    use std::sync::Arc;

    /// A counter only the gate's holder touches.
    struct Guarded(UnsafeCell<u64>);

    // SAFETY: only accessed by the thread inside the gate (what the test checks).
    unsafe impl Sync for Guarded {}

    #[test]
    fn deferring_waiters_sleep_longer_only_among_many_and_never_past_the_bound() {
        assert_eq!(deferred_sleep(0), SLEEP_AT_MOST);
        assert_eq!(deferred_sleep(6), SLEEP_AT_MOST);
        assert_eq!(deferred_sleep(500), Duration::from_millis(25));
        assert_eq!(deferred_sleep(u32::MAX), DEFERRED_SLEEP_AT_MOST);
    }

    #[test]
    fn the_gate_lets_one_thread_in_at_a_time() {
        let gate = Arc::new(ThreadGate::default());
        let counter = Arc::new(Guarded(UnsafeCell::new(0)));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (gate, counter) = (Arc::clone(&gate), Arc::clone(&counter));
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        assert!(gate.enter(&mut Clock::default()));
                        // SAFETY: inside the gate, no other thread touches it.
                        unsafe { *counter.0.get() += 1 };
                        gate.leave();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|thread| thread.join().unwrap());
        // SAFETY: every thread has ended.
        assert_eq!(unsafe { *counter.0.get() }, 160_000);
        assert_eq!(gate.state.load(Ordering::Acquire), GATE_FREE);
    }

    #[test]
    fn a_waiter_that_has_waited_is_handed_the_gate_before_the_thread_leaving_can_come_back() {
        let gate = Arc::new(ThreadGate::default());
        let order = Arc::new(Mutex::new(Vec::new()));
        assert!(gate.enter(&mut Clock::default()));
        let waiter = {
            let (gate, order) = (Arc::clone(&gate), Arc::clone(&order));
            std::thread::spawn(move || {
                assert!(gate.enter(&mut Clock::default()));
                order.lock().unwrap().push("waiter");
                std::thread::sleep(Duration::from_millis(1));
                gate.leave();
            })
        };
        while gate.waiters.lock().unwrap().queue.is_empty() {
            std::thread::yield_now();
        }
        std::thread::sleep(GATE_FAIR_AFTER * 5);
        // Leaving and coming straight back: the waiter, asleep, must still go first.
        gate.leave();
        assert!(gate.enter(&mut Clock::default()));
        order.lock().unwrap().push("the thread that left");
        gate.leave();
        waiter.join().unwrap();
        assert_eq!(*order.lock().unwrap(), ["waiter", "the thread that left"]);
        assert_eq!(gate.state.load(Ordering::Acquire), GATE_FREE);
        assert!(gate.waiters.lock().unwrap().queue.is_empty());
    }

    /// The gate and what the exiting thread's wait returned, for the key's destructor.
    static EXITING: Mutex<Option<(Arc<ThreadGate>, Option<bool>)>> = Mutex::new(None);
    static EXITING_KEY: std::sync::OnceLock<libc::pthread_key_t> = std::sync::OnceLock::new();

    /// A key destructor that runs twice: the second time, after the first round of destructors
    /// (Rust's own thread data among them) has run, it waits for the gate.
    extern "C" fn enter_while_exiting(value: *mut libc::c_void) {
        if value.addr() == 1 {
            if let Some(key) = EXITING_KEY.get() {
                // SAFETY: a non-null value makes the destructor run again in the next round.
                unsafe { libc::pthread_setspecific(*key, std::ptr::without_provenance::<u8>(2).cast()) };
            }
            return;
        }
        let gate = EXITING.lock().unwrap().as_ref().map(|(gate, _)| Arc::clone(gate));
        let entered = gate.map(|gate| {
            let entered = gate.enter(&mut Clock::default());
            if entered {
                gate.leave();
            }
            entered
        });
        if let Some((_, result)) = EXITING.lock().unwrap().as_mut() {
            *result = entered;
        }
    }

    #[test]
    fn a_thread_in_its_last_destructors_waits_for_the_gate_like_any_other() {
        let gate = Arc::new(ThreadGate::default());
        *EXITING.lock().unwrap() = Some((Arc::clone(&gate), None));
        let key = *EXITING_KEY.get_or_init(|| {
            let mut key: libc::pthread_key_t = 0;
            // SAFETY: creates a key whose destructor is a plain function of this test.
            let created = unsafe { libc::pthread_key_create(&mut key, Some(enter_while_exiting)) };
            assert_eq!(created, 0);
            key
        });
        assert!(gate.enter(&mut Clock::default()));
        let exiting = std::thread::spawn(move || {
            // The thread has Rust thread data of its own to tear down before the key's second round.
            let _ = std::thread::current();
            // SAFETY: a non-null value makes the destructor run when the thread exits.
            unsafe { libc::pthread_setspecific(key, std::ptr::without_provenance::<u8>(1).cast()) };
        });
        while gate.waiters.lock().unwrap().queue.is_empty() {
            std::thread::yield_now();
        }
        gate.leave();
        exiting.join().unwrap();
        let result = EXITING.lock().unwrap().take().and_then(|(_, result)| result);
        assert_eq!(result, Some(true));
    }

    #[test]
    fn a_thread_waiting_behind_a_stuck_one_gives_up_after_the_timeout() {
        let gate = Arc::new(ThreadGate::default());
        assert!(gate.enter(&mut Clock::default()));
        let waiter = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || {
                let started = Instant::now();
                let entered = gate.enter(&mut Clock::default());
                (entered, started.elapsed())
            })
        };
        let (entered, waited) = waiter.join().unwrap();
        assert!(!entered);
        assert!(waited >= LOCK_TIMEOUT && waited < 2 * LOCK_TIMEOUT, "{waited:?}");
        gate.leave();
        assert!(gate.enter(&mut Clock::default()), "free again once the holder left");
        gate.leave();
    }
}
