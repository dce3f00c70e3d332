//! The ground truth: what the simulated GPUs really hold, shared by every process of a test.
//!
//! One file (`FAKE_CUDA_TRUTH`), memory-mapped by every process that loads the fake driver and by
//! the test itself, with a fixed layout of little-endian `u64` words, every one of them accessed
//! only through atomics. This module depends on std and libc only and exports no CUDA symbol, so
//! the integration tests include it directly:
//!
//! ```ignore
//! #[path = "../fake-driver/src/truth.rs"]
//! mod truth;
//! let truth = truth::Truth::open(path)?;
//! truth.reclaim_dead();
//! assert!(truth.device(0).peak() <= limit);
//! ```
//!
//! Layout (word offsets; a word is 8 bytes; see the constants below):
//!
//! | words | what |
//! | --- | --- |
//! | header, 16 words | magic, version, max devices, max processes, file size, initialiser pid, lock owner pid, journal (valid, device, slot, device used, slot used), 4 reserved |
//! | 16 device records of 24 words | capacity, used, peak, busy ns, reservations, refusals, 2 reserved, 16 utilisation buckets |
//! | 256 process slots of 40 words | pid (0 = free), start time, host-resident bytes (managed memory in host memory, VMM allocations on the host), checkpoint state, used bytes per device (16), busy ns per device (16), 4 reserved |
//!
//! Rules:
//! - **Initialisation**: the first opener creates the file (`O_CREAT`), grows it to [`FILE_SIZE`]
//!   and wins a compare-exchange of the magic word from 0 to [`INITIALISING`]; it fills the header
//!   and then publishes [`MAGIC`]. Others wait for the magic (and take over the initialisation if
//!   the initialiser died).
//! - **Charges**: `used`, `peak` and the per-process `used` words change only under the file's
//!   lock, a word holding the owner's pid. Each change is written to a journal first and then
//!   applied as absolute stores, so it is idempotent. A process killed while holding the lock is
//!   detected by the next waiter (its pid is dead or a zombie), which takes the lock over and
//!   replays the journal: no SIGKILL can leave the record half-updated or the lock held.
//!   Reservation checks `used + bytes <= capacity` under the lock, so used never exceeds capacity
//!   across processes, and `peak` is the maximum of `used` ever stored.
//! - **Dead processes**: the real driver frees a process's memory when it dies. Here every charge
//!   is also recorded in the process's slot; each reservation and each registration first
//!   reclaims the slots whose process is dead (no `/proc/<pid>` entry, a zombie, or a different
//!   start time: pid reuse), subtracting their charges from `used`. Readers call
//!   [`Truth::reclaim_dead`] to do the same before reading `used` (NVML memory queries do).
//! - **Busy time**: each launch adds its duration to the device's `busy ns` and to the process's
//!   slot at launch time, and to a ring of 100 ms buckets (keyed by `CLOCK_MONOTONIC`) that
//!   [`DeviceView::utilisation_percent`] reads; these are lock-free `fetch_add`s.

#![allow(dead_code)]

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `b"VGPUTRTH"` as a little-endian word.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUTRTH");
/// Magic value while the first opener fills the header.
pub const INITIALISING: u64 = 1;
pub const VERSION: u64 = 1;
pub const MAX_DEVICES: usize = 16;
pub const MAX_PROCESSES: usize = 256;
/// Utilisation buckets per device, and the span of one.
pub const BUCKETS: usize = 16;
pub const BUCKET_NS: u64 = 100_000_000;

// Header words.
pub const H_MAGIC: usize = 0;
pub const H_VERSION: usize = 1;
pub const H_MAX_DEVICES: usize = 2;
pub const H_MAX_PROCESSES: usize = 3;
pub const H_FILE_SIZE: usize = 4;
pub const H_INIT_PID: usize = 5;
pub const H_LOCK: usize = 6;
pub const H_JOURNAL_VALID: usize = 7;
pub const H_JOURNAL_DEVICE: usize = 8;
pub const H_JOURNAL_SLOT: usize = 9;
pub const H_JOURNAL_DEVICE_USED: usize = 10;
pub const H_JOURNAL_SLOT_USED: usize = 11;
pub const HEADER_WORDS: usize = 16;

// Device record words.
pub const D_CAPACITY: usize = 0;
pub const D_USED: usize = 1;
pub const D_PEAK: usize = 2;
pub const D_BUSY_NS: usize = 3;
pub const D_RESERVATIONS: usize = 4;
pub const D_REFUSALS: usize = 5;
pub const D_BUCKETS: usize = 8;
pub const DEVICE_WORDS: usize = D_BUCKETS + BUCKETS;

// Process slot words.
pub const P_PID: usize = 0;
pub const P_START: usize = 1;
/// Bytes of the process's memory that live in host memory (managed memory there, VMM allocations
/// located on the host; not in any device's `used`).
pub const P_HOST: usize = 2;
/// The process's checkpoint state ([`CheckpointState`]); a checkpointed process's `used` words
/// keep what it held, which the devices' `used` no longer counts.
pub const P_CHECKPOINT: usize = 3;
pub const P_USED: usize = 4;
pub const P_BUSY_NS: usize = P_USED + MAX_DEVICES;
pub const PROCESS_WORDS: usize = 40;

pub const DEVICES_OFFSET: usize = HEADER_WORDS;
pub const PROCESSES_OFFSET: usize = DEVICES_OFFSET + MAX_DEVICES * DEVICE_WORDS;
pub const TOTAL_WORDS: usize = PROCESSES_OFFSET + MAX_PROCESSES * PROCESS_WORDS;
const _: () = assert!(P_BUSY_NS + MAX_DEVICES <= PROCESS_WORDS);

/// The file's size: the words rounded up to a 4 KiB page.
pub const FILE_SIZE: usize = (TOTAL_WORDS * 8).div_ceil(4096) * 4096;

const BUCKET_ID_SHIFT: u32 = 40;
const BUCKET_BUSY_MASK: u64 = (1 << BUCKET_ID_SHIFT) - 1;
const BUCKET_ID_MASK: u64 = (1 << (64 - BUCKET_ID_SHIFT)) - 1;
const SEQ: Ordering = Ordering::SeqCst;

/// A process's state for the driver's checkpoint API (`CUprocessState`'s values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointState {
    Running = 0,
    Locked = 1,
    Checkpointed = 2,
}

impl CheckpointState {
    fn from_word(word: u64) -> CheckpointState {
        match word {
            1 => CheckpointState::Locked,
            2 => CheckpointState::Checkpointed,
            _ => CheckpointState::Running,
        }
    }
}

/// A mapping of the ground-truth file (or of anonymous memory when no file is configured).
pub struct Truth {
    base: *mut AtomicU64,
}

// SAFETY: the mapping is only ever accessed through atomics, from any thread.
unsafe impl Send for Truth {}
// SAFETY: as above; `&Truth` hands out `&AtomicU64` only.
unsafe impl Sync for Truth {}

impl Drop for Truth {
    fn drop(&mut self) {
        // SAFETY: `base` came from a successful mmap of FILE_SIZE bytes and is unmapped once.
        unsafe { libc::munmap(self.base.cast(), FILE_SIZE) };
    }
}

/// One live process's record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessRecord {
    pub slot: usize,
    pub pid: u32,
    pub used: [u64; MAX_DEVICES],
    pub busy_ns: [u64; MAX_DEVICES],
    /// Managed memory of the process that lives in host memory.
    pub host: u64,
    pub checkpoint: CheckpointState,
}

impl Truth {
    /// Opens (creating and initialising if needed) the file at `path`.
    pub fn open(path: &Path) -> io::Result<Truth> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .open(path)?;
        if file.metadata()?.len() < FILE_SIZE as u64 {
            // Racing openers all grow it to the same size; content is never lost.
            file.set_len(FILE_SIZE as u64)?;
        }
        // SAFETY: a shared read-write mapping of FILE_SIZE bytes of a file at least that long.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        Self::from_mapping(base)
    }

    /// A process-private record (shared with children after fork), for when no file is set.
    pub fn in_memory() -> io::Result<Truth> {
        // SAFETY: an anonymous shared mapping; the kernel zero-fills it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        Self::from_mapping(base)
    }

    fn from_mapping(base: *mut libc::c_void) -> io::Result<Truth> {
        if base == libc::MAP_FAILED || base.is_null() {
            return Err(io::Error::last_os_error());
        }
        let truth = Truth { base: base.cast() };
        truth.initialise()?;
        Ok(truth)
    }

    fn word(&self, index: usize) -> &AtomicU64 {
        assert!(index < TOTAL_WORDS, "truth word {index} out of range");
        // SAFETY: the mapping holds TOTAL_WORDS page-aligned u64 words for the life of `self`;
        // AtomicU64 has the layout of u64 and every access to the mapping is atomic.
        unsafe { &*self.base.add(index) }
    }

    fn device_word(&self, device: usize, field: usize) -> &AtomicU64 {
        self.word(DEVICES_OFFSET + device * DEVICE_WORDS + field)
    }

    fn slot_word(&self, slot: usize, field: usize) -> &AtomicU64 {
        self.word(PROCESSES_OFFSET + slot * PROCESS_WORDS + field)
    }

    fn initialise(&self) -> io::Result<()> {
        let me = own_pid();
        let magic = self.word(H_MAGIC);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match magic.compare_exchange(0, INITIALISING, SEQ, SEQ) {
                Ok(_) => {
                    self.word(H_INIT_PID).store(me, SEQ);
                    self.fill_header();
                    return Ok(());
                }
                Err(MAGIC) => return self.check_header(),
                Err(INITIALISING) => {
                    let owner = self.word(H_INIT_PID).load(SEQ);
                    if owner != 0
                        && !process_alive(owner, 0)
                        && self.word(H_INIT_PID).compare_exchange(owner, me, SEQ, SEQ).is_ok()
                    {
                        self.fill_header();
                        return Ok(());
                    }
                    if Instant::now() > deadline {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "truth file stuck in initialisation",
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(other) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("not a fake-driver truth file (magic {other:#x})"),
                    ));
                }
            }
        }
    }

    fn fill_header(&self) {
        self.word(H_VERSION).store(VERSION, SEQ);
        self.word(H_MAX_DEVICES).store(MAX_DEVICES as u64, SEQ);
        self.word(H_MAX_PROCESSES).store(MAX_PROCESSES as u64, SEQ);
        self.word(H_FILE_SIZE).store(FILE_SIZE as u64, SEQ);
        self.word(H_MAGIC).store(MAGIC, SEQ);
    }

    fn check_header(&self) -> io::Result<()> {
        let found = (
            self.word(H_VERSION).load(SEQ),
            self.word(H_MAX_DEVICES).load(SEQ),
            self.word(H_MAX_PROCESSES).load(SEQ),
        );
        if found != (VERSION, MAX_DEVICES as u64, MAX_PROCESSES as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "truth file has version/devices/processes {found:?}, expected {VERSION}/{MAX_DEVICES}/{MAX_PROCESSES}"
                ),
            ));
        }
        Ok(())
    }

    /// A view of one physical device's record. Panics if `index >= MAX_DEVICES`.
    pub fn device(&self, index: usize) -> DeviceView<'_> {
        assert!(index < MAX_DEVICES, "device {index} out of range");
        DeviceView { truth: self, index }
    }

    /// Sets a device's capacity unless some process already did; returns the capacity in force.
    pub fn set_capacity_if_unset(&self, device: usize, bytes: u64) -> u64 {
        if device >= MAX_DEVICES {
            return 0;
        }
        match self
            .device_word(device, D_CAPACITY)
            .compare_exchange(0, bytes, SEQ, SEQ)
        {
            Ok(_) => bytes,
            Err(current) => current,
        }
    }

    /// Sets the peak of a device back to its current use (for tests with several phases).
    pub fn reset_peak(&self, device: usize) {
        if device < MAX_DEVICES {
            let _guard = self.lock();
            let used = self.device_word(device, D_USED).load(SEQ);
            self.device_word(device, D_PEAK).store(used, SEQ);
        }
    }

    /// Every live process with a slot.
    pub fn processes(&self) -> Vec<ProcessRecord> {
        let mut out = Vec::new();
        for slot in 0..MAX_PROCESSES {
            let pid = self.slot_word(slot, P_PID).load(SEQ);
            if pid == 0 || !process_alive(pid, self.slot_word(slot, P_START).load(SEQ)) {
                continue;
            }
            let mut record = ProcessRecord {
                slot,
                pid: pid as u32,
                used: [0; MAX_DEVICES],
                busy_ns: [0; MAX_DEVICES],
                host: self.slot_word(slot, P_HOST).load(SEQ),
                checkpoint: CheckpointState::from_word(self.slot_word(slot, P_CHECKPOINT).load(SEQ)),
            };
            for device in 0..MAX_DEVICES {
                record.used[device] = self.slot_word(slot, P_USED + device).load(SEQ);
                record.busy_ns[device] = self.slot_word(slot, P_BUSY_NS + device).load(SEQ);
            }
            out.push(record);
        }
        out
    }

    /// Takes a free (or dead) slot for the calling process; `None` when all are in use.
    pub fn register(&self) -> Option<usize> {
        let me = own_pid();
        let start = process_start_time(me);
        let dead = self.dead_slots();
        let _guard = self.lock();
        self.reclaim_locked(&dead);
        for slot in 0..MAX_PROCESSES {
            if self.slot_word(slot, P_PID).load(SEQ) == 0 {
                for field in 1..PROCESS_WORDS {
                    self.slot_word(slot, field).store(0, SEQ);
                }
                self.slot_word(slot, P_START).store(start, SEQ);
                self.slot_word(slot, P_PID).store(me, SEQ);
                return Some(slot);
            }
        }
        None
    }

    /// Adds (`more`) or takes away `bytes` of `slot`'s host-resident memory; a lock-free
    /// counter of the slot's own (the host has no capacity to check).
    pub fn record_host(&self, slot: usize, bytes: u64, more: bool) {
        if slot >= MAX_PROCESSES {
            return;
        }
        let _ = self.slot_word(slot, P_HOST).fetch_update(SEQ, SEQ, |held| {
            Some(if more {
                held.saturating_add(bytes)
            } else {
                held.saturating_sub(bytes)
            })
        });
    }

    /// The live slot of `pid`.
    pub fn slot_of(&self, pid: u32) -> Option<usize> {
        (0..MAX_PROCESSES).find(|&slot| {
            let word = self.slot_word(slot, P_PID).load(SEQ);
            word == u64::from(pid) && process_alive(word, self.slot_word(slot, P_START).load(SEQ))
        })
    }

    /// The checkpoint state of a slot.
    pub fn checkpoint_state(&self, slot: usize) -> CheckpointState {
        if slot >= MAX_PROCESSES {
            return CheckpointState::Running;
        }
        CheckpointState::from_word(self.slot_word(slot, P_CHECKPOINT).load(SEQ))
    }

    /// Moves a slot from `from` to `to`; false when it was not in `from`.
    pub fn change_checkpoint_state(&self, slot: usize, from: CheckpointState, to: CheckpointState) -> bool {
        slot < MAX_PROCESSES
            && self
                .slot_word(slot, P_CHECKPOINT)
                .compare_exchange(from as u64, to as u64, SEQ, SEQ)
                .is_ok()
    }

    /// Checkpoints a locked slot: its memory leaves its devices (their `used` drops by what it
    /// holds), and it is `Checkpointed`. False when it was not locked.
    pub fn checkpoint(&self, slot: usize) -> bool {
        let _guard = self.lock();
        if self.checkpoint_state(slot) != CheckpointState::Locked {
            return false;
        }
        for device in 0..MAX_DEVICES {
            let held = self.slot_word(slot, P_USED + device).load(SEQ);
            if held > 0 {
                let used = self.device_word(device, D_USED).load(SEQ).saturating_sub(held);
                self.commit(device, slot, used, held);
            }
        }
        self.slot_word(slot, P_CHECKPOINT)
            .store(CheckpointState::Checkpointed as u64, SEQ);
        true
    }

    /// Restores a checkpointed slot onto its devices when every device has room for what it held
    /// (then it is `Locked`); otherwise nothing changes and `Err` gives the device and the bytes
    /// it lacks.
    pub fn restore(&self, slot: usize) -> Result<(), (usize, u64)> {
        let dead = self.dead_slots();
        let _guard = self.lock();
        self.reclaim_locked(&dead);
        if self.checkpoint_state(slot) != CheckpointState::Checkpointed {
            return Err((0, 0));
        }
        for device in 0..MAX_DEVICES {
            let held = self.slot_word(slot, P_USED + device).load(SEQ);
            let capacity = self.device_word(device, D_CAPACITY).load(SEQ);
            let used = self.device_word(device, D_USED).load(SEQ);
            if held > capacity.saturating_sub(used) {
                return Err((device, held - capacity.saturating_sub(used)));
            }
        }
        for device in 0..MAX_DEVICES {
            let held = self.slot_word(slot, P_USED + device).load(SEQ);
            if held > 0 {
                let used = self.device_word(device, D_USED).load(SEQ) + held;
                self.commit(device, slot, used, held);
            }
        }
        self.slot_word(slot, P_CHECKPOINT)
            .store(CheckpointState::Locked as u64, SEQ);
        Ok(())
    }

    /// Host-resident memory of every live process.
    pub fn host_resident(&self) -> u64 {
        self.processes().iter().map(|process| process.host).sum()
    }

    /// Charges `bytes` of `device` to `slot` if they fit; false (and nothing charged) otherwise.
    pub fn reserve(&self, slot: usize, device: usize, bytes: u64) -> bool {
        if device >= MAX_DEVICES || slot >= MAX_PROCESSES {
            return false;
        }
        if bytes == 0 {
            return true;
        }
        let dead = self.dead_slots();
        let _guard = self.lock();
        self.reclaim_locked(&dead);
        let capacity = self.device_word(device, D_CAPACITY).load(SEQ);
        let used = self.device_word(device, D_USED).load(SEQ);
        match used.checked_add(bytes) {
            Some(total) if total <= capacity => {
                let slot_used = self.slot_word(slot, P_USED + device).load(SEQ).saturating_add(bytes);
                self.commit(device, slot, total, slot_used);
                self.device_word(device, D_RESERVATIONS).fetch_add(1, SEQ);
                true
            }
            _ => {
                self.device_word(device, D_REFUSALS).fetch_add(1, SEQ);
                false
            }
        }
    }

    /// Returns `bytes` of `device` charged to `slot` (at most what the slot holds).
    pub fn release(&self, slot: usize, device: usize, bytes: u64) {
        if device >= MAX_DEVICES || slot >= MAX_PROCESSES || bytes == 0 {
            return;
        }
        let _guard = self.lock();
        let slot_used = self.slot_word(slot, P_USED + device).load(SEQ);
        let taken = bytes.min(slot_used);
        let used = self.device_word(device, D_USED).load(SEQ).saturating_sub(taken);
        self.commit(device, slot, used, slot_used - taken);
    }

    /// Adds a launch's duration to the device, the slot and the utilisation ring.
    pub fn add_busy(&self, slot: usize, device: usize, ns: u64, now_ns: u64) {
        if device >= MAX_DEVICES {
            return;
        }
        self.device_word(device, D_BUSY_NS).fetch_add(ns, SEQ);
        if slot < MAX_PROCESSES {
            self.slot_word(slot, P_BUSY_NS + device).fetch_add(ns, SEQ);
        }
        let id = (now_ns / BUCKET_NS) & BUCKET_ID_MASK;
        let bucket = self.device_word(device, D_BUCKETS + (id as usize % BUCKETS));
        let mut current = bucket.load(SEQ);
        loop {
            let busy = if current >> BUCKET_ID_SHIFT == id {
                current & BUCKET_BUSY_MASK
            } else {
                0
            };
            let new = (id << BUCKET_ID_SHIFT) | busy.saturating_add(ns).min(BUCKET_BUSY_MASK);
            match bucket.compare_exchange_weak(current, new, SEQ, SEQ) {
                Ok(_) => break,
                Err(seen) => current = seen,
            }
        }
    }

    /// Frees the charges of every dead process; returns how many slots were reclaimed.
    pub fn reclaim_dead(&self) -> usize {
        let dead = self.dead_slots();
        if dead.is_empty() {
            return 0;
        }
        let _guard = self.lock();
        self.reclaim_locked(&dead)
    }

    /// Occupied slots whose process is gone: (slot, pid, start time).
    fn dead_slots(&self) -> Vec<(usize, u64, u64)> {
        let me = own_pid();
        let mut dead = Vec::new();
        for slot in 0..MAX_PROCESSES {
            let pid = self.slot_word(slot, P_PID).load(SEQ);
            if pid == 0 || pid == me {
                continue;
            }
            let start = self.slot_word(slot, P_START).load(SEQ);
            if !process_alive(pid, start) {
                dead.push((slot, pid, start));
            }
        }
        dead
    }

    fn reclaim_locked(&self, dead: &[(usize, u64, u64)]) -> usize {
        let mut reclaimed = 0;
        for &(slot, pid, start) in dead {
            if self.slot_word(slot, P_PID).load(SEQ) != pid || self.slot_word(slot, P_START).load(SEQ) != start {
                continue;
            }
            // A checkpointed process's memory is no longer on its devices.
            let on_devices = self.slot_word(slot, P_CHECKPOINT).load(SEQ) != CheckpointState::Checkpointed as u64;
            for device in 0..MAX_DEVICES {
                let held = self.slot_word(slot, P_USED + device).load(SEQ);
                if held > 0 {
                    let device_used = self.device_word(device, D_USED).load(SEQ);
                    let used = if on_devices {
                        device_used.saturating_sub(held)
                    } else {
                        device_used
                    };
                    self.commit(device, slot, used, 0);
                }
            }
            self.slot_word(slot, P_PID).store(0, SEQ);
            reclaimed += 1;
        }
        reclaimed
    }

    /// Journals, then applies, new absolute values of a device's use and a slot's charge on it.
    /// Called with the lock held.
    fn commit(&self, device: usize, slot: usize, device_used: u64, slot_used: u64) {
        self.word(H_JOURNAL_DEVICE).store(device as u64, SEQ);
        self.word(H_JOURNAL_SLOT).store(slot as u64, SEQ);
        self.word(H_JOURNAL_DEVICE_USED).store(device_used, SEQ);
        self.word(H_JOURNAL_SLOT_USED).store(slot_used, SEQ);
        self.word(H_JOURNAL_VALID).store(1, SEQ);
        self.apply(device, slot, device_used, slot_used);
        self.word(H_JOURNAL_VALID).store(0, SEQ);
    }

    fn apply(&self, device: usize, slot: usize, device_used: u64, slot_used: u64) {
        self.device_word(device, D_USED).store(device_used, SEQ);
        self.device_word(device, D_PEAK).fetch_max(device_used, SEQ);
        self.slot_word(slot, P_USED + device).store(slot_used, SEQ);
    }

    /// Takes the file's lock, taking it over from a dead holder and finishing its journal.
    fn lock(&self) -> LockGuard<'_> {
        let me = own_pid();
        let lock = self.word(H_LOCK);
        let mut attempt: u32 = 0;
        loop {
            match lock.compare_exchange(0, me, SEQ, SEQ) {
                Ok(_) => break,
                Err(owner) => {
                    attempt = attempt.wrapping_add(1);
                    if attempt.is_multiple_of(128)
                        && owner != me
                        && !process_alive(owner, 0)
                        && lock.compare_exchange(owner, me, SEQ, SEQ).is_ok()
                    {
                        break;
                    }
                    if attempt < 64 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::sleep(Duration::from_micros(20));
                    }
                }
            }
        }
        if self.word(H_JOURNAL_VALID).load(SEQ) == 1 {
            let device = self.word(H_JOURNAL_DEVICE).load(SEQ) as usize;
            let slot = self.word(H_JOURNAL_SLOT).load(SEQ) as usize;
            if device < MAX_DEVICES && slot < MAX_PROCESSES {
                let device_used = self.word(H_JOURNAL_DEVICE_USED).load(SEQ);
                let slot_used = self.word(H_JOURNAL_SLOT_USED).load(SEQ);
                self.apply(device, slot, device_used, slot_used);
            }
            self.word(H_JOURNAL_VALID).store(0, SEQ);
        }
        LockGuard { truth: self }
    }
}

struct LockGuard<'a> {
    truth: &'a Truth,
}

impl Drop for LockGuard<'_> {
    fn drop(&mut self) {
        self.truth.word(H_LOCK).store(0, SEQ);
    }
}

/// Read access to one physical device's record.
pub struct DeviceView<'a> {
    truth: &'a Truth,
    index: usize,
}

impl DeviceView<'_> {
    fn load(&self, field: usize) -> u64 {
        self.truth.device_word(self.index, field).load(SEQ)
    }
    /// Physical bytes of the device (0 until a driver process configured it).
    pub fn capacity(&self) -> u64 {
        self.load(D_CAPACITY)
    }
    /// Bytes charged now (dead processes included until reclaimed: see [`Truth::reclaim_dead`]).
    pub fn used(&self) -> u64 {
        self.load(D_USED)
    }
    /// The highest `used` ever stored.
    pub fn peak(&self) -> u64 {
        self.load(D_PEAK)
    }
    /// Total simulated kernel time launched on the device, in nanoseconds.
    pub fn busy_ns(&self) -> u64 {
        self.load(D_BUSY_NS)
    }
    /// Successful reservations so far.
    pub fn reservations(&self) -> u64 {
        self.load(D_RESERVATIONS)
    }
    /// Reservations refused for lack of memory so far.
    pub fn refusals(&self) -> u64 {
        self.load(D_REFUSALS)
    }
    /// Busy share of the last second (the current 100 ms bucket and the nine before), 0..=100.
    pub fn utilisation_percent(&self) -> u32 {
        self.utilisation_percent_at(monotonic_ns())
    }

    fn utilisation_percent_at(&self, now_ns: u64) -> u32 {
        let now_id = (now_ns / BUCKET_NS) & BUCKET_ID_MASK;
        let mut busy: u64 = 0;
        for bucket in 0..BUCKETS {
            let word = self.load(D_BUCKETS + bucket);
            let age = now_id.wrapping_sub(word >> BUCKET_ID_SHIFT) & BUCKET_ID_MASK;
            if word != 0 && age < 10 {
                busy = busy.saturating_add(word & BUCKET_BUSY_MASK);
            }
        }
        let window = 9 * BUCKET_NS + now_ns % BUCKET_NS;
        (busy.saturating_mul(100) / window.max(1)).min(100) as u32
    }
}

impl DeviceView<'_> {
    /// The busy share of each whole 100 ms bucket that ended after `since_us` and within the
    /// ring, oldest first: (its end in monotonic microseconds, percent 0..=100). NVML's
    /// utilisation samples.
    pub fn utilisation_samples(&self, since_us: u64) -> Vec<(u64, u32)> {
        self.utilisation_samples_at(since_us, monotonic_ns())
    }

    fn utilisation_samples_at(&self, since_us: u64, now_ns: u64) -> Vec<(u64, u32)> {
        let now_bucket = now_ns / BUCKET_NS;
        let mut samples = Vec::new();
        for age in (1..BUCKETS as u64).rev() {
            let Some(bucket) = now_bucket.checked_sub(age) else {
                continue;
            };
            let end_us = (bucket + 1) * (BUCKET_NS / 1_000);
            if end_us <= since_us {
                continue;
            }
            let id = bucket & BUCKET_ID_MASK;
            let word = self.load(D_BUCKETS + (id as usize % BUCKETS));
            let busy = if word >> BUCKET_ID_SHIFT == id {
                word & BUCKET_BUSY_MASK
            } else {
                0
            };
            samples.push((end_us, (busy.saturating_mul(100) / BUCKET_NS).min(100) as u32));
        }
        samples
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: one time base for every process of the machine.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

fn own_pid() -> u64 {
    // SAFETY: getpid has no preconditions.
    u64::from(unsafe { libc::getpid() }.unsigned_abs())
}

/// State and start time (field 22, clock ticks since boot) from `/proc/<pid>/stat`.
fn proc_stat(pid: u64) -> io::Result<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = text.rfind(')').map(|i| &text[i + 1..]).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let state = fields.first().and_then(|s| s.chars().next()).unwrap_or('?');
    // Fields after the command name start at field 3 (state); starttime is field 22.
    let start = fields.get(19).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok((state, start))
}

fn process_start_time(pid: u64) -> u64 {
    proc_stat(pid).map(|(_, start)| start).unwrap_or(0)
}

/// Whether `pid` is a live (not zombie) process; `start` (when non-zero) must match its start
/// time, so a reused pid counts as dead.
pub fn process_alive(pid: u64, start: u64) -> bool {
    let Ok(pid_i32) = i32::try_from(pid) else { return false };
    if pid_i32 <= 0 {
        return false;
    }
    match proc_stat(pid) {
        Ok((state, started)) => !matches!(state, 'Z' | 'X' | 'x') && (start == 0 || started == 0 || started == start),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(_) => {
            // SAFETY: kill with signal 0 only checks for existence.
            let rc = unsafe { libc::kill(pid_i32, 0) };
            rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_fixed() {
        assert_eq!(HEADER_WORDS, 16);
        assert_eq!(DEVICE_WORDS, 24);
        assert_eq!(PROCESSES_OFFSET, 16 + 16 * 24);
        assert_eq!(TOTAL_WORDS, 400 + 256 * 40);
        assert_eq!(FILE_SIZE, 86016);
        assert_eq!(&MAGIC.to_le_bytes(), b"VGPUTRTH");
    }

    #[test]
    fn reserve_release_and_peak() {
        let truth = Truth::in_memory().unwrap();
        assert_eq!(truth.set_capacity_if_unset(0, 1000), 1000);
        assert_eq!(truth.set_capacity_if_unset(0, 5), 1000);
        let slot = truth.register().unwrap();
        assert!(truth.reserve(slot, 0, 600));
        assert!(!truth.reserve(slot, 0, 401));
        assert!(truth.reserve(slot, 0, 400));
        assert!(!truth.reserve(slot, 0, u64::MAX));
        truth.release(slot, 0, 700);
        assert_eq!(truth.device(0).used(), 300);
        assert_eq!(truth.device(0).peak(), 1000);
        assert_eq!(truth.device(0).refusals(), 2);
        assert_eq!(truth.processes().len(), 1);
        assert_eq!(truth.processes()[0].used[0], 300);
        truth.reset_peak(0);
        assert_eq!(truth.device(0).peak(), 300);
    }

    #[test]
    fn dead_slots_are_reclaimed() {
        let truth = Truth::in_memory().unwrap();
        truth.set_capacity_if_unset(1, 100);
        // A slot owned by a pid that cannot exist.
        let slot = MAX_PROCESSES - 1;
        truth.slot_word(slot, P_PID).store(i32::MAX as u64, SEQ);
        truth.slot_word(slot, P_USED + 1).store(80, SEQ);
        truth.device_word(1, D_USED).store(80, SEQ);
        assert!(process_alive(own_pid(), process_start_time(own_pid())));
        assert!(!process_alive(i32::MAX as u64, 0));
        let mine = truth.register().unwrap();
        assert_eq!(truth.device(1).used(), 0);
        assert!(truth.reserve(mine, 1, 100));
        assert_eq!(truth.reclaim_dead(), 0);
    }

    #[test]
    fn stale_lock_and_journal_are_recovered() {
        let truth = Truth::in_memory().unwrap();
        truth.set_capacity_if_unset(0, 100);
        let slot = truth.register().unwrap();
        // A dead holder that journaled a change and died before applying it.
        truth.word(H_LOCK).store(i32::MAX as u64, SEQ);
        truth.word(H_JOURNAL_DEVICE).store(0, SEQ);
        truth.word(H_JOURNAL_SLOT).store(slot as u64, SEQ);
        truth.word(H_JOURNAL_DEVICE_USED).store(40, SEQ);
        truth.word(H_JOURNAL_SLOT_USED).store(40, SEQ);
        truth.word(H_JOURNAL_VALID).store(1, SEQ);
        assert!(truth.reserve(slot, 0, 60));
        assert!(!truth.reserve(slot, 0, 1));
        assert_eq!(truth.device(0).used(), 100);
        assert_eq!(truth.word(H_LOCK).load(SEQ), 0);
    }

    #[test]
    fn utilisation_window() {
        let truth = Truth::in_memory().unwrap();
        let now = 50 * BUCKET_NS;
        truth.add_busy(0, 2, BUCKET_NS / 2, now - 3 * BUCKET_NS);
        truth.add_busy(0, 2, BUCKET_NS / 2, now - 20 * BUCKET_NS);
        let view = truth.device(2);
        assert_eq!(view.busy_ns(), BUCKET_NS);
        // 50 ms busy in a 900 ms window.
        assert_eq!(view.utilisation_percent_at(now), 5);
    }

    #[test]
    fn utilisation_samples_are_the_whole_buckets_after_the_last_seen() {
        let truth = Truth::in_memory().unwrap();
        let now = 50 * BUCKET_NS + BUCKET_NS / 3;
        truth.add_busy(0, 1, BUCKET_NS / 2, 47 * BUCKET_NS + 1);
        truth.add_busy(0, 1, BUCKET_NS / 4, now); // the current bucket: not whole yet
        let view = truth.device(1);
        let all = view.utilisation_samples_at(0, now);
        // The ring's whole buckets before the current one, oldest first, ending at bucket ends.
        assert_eq!(all.len(), BUCKETS - 1);
        assert!(all.windows(2).all(|pair| pair[0].0 < pair[1].0));
        assert_eq!(all.last(), Some(&(50 * BUCKET_NS / 1_000, 0)));
        assert_eq!(
            all.iter().find(|(_, percent)| *percent > 0),
            Some(&(48 * BUCKET_NS / 1_000, 50))
        );
        // After the busy bucket's end: the two after it.
        let later = view.utilisation_samples_at(48 * BUCKET_NS / 1_000, now);
        assert_eq!(later, vec![(49 * BUCKET_NS / 1_000, 0), (50 * BUCKET_NS / 1_000, 0)]);
        assert!(view.utilisation_samples_at(50 * BUCKET_NS / 1_000, now).is_empty());
    }
}
