//! The shared region: one memory-mapped file that every process of a container maps, holding each
//! process's device memory by kind and the limits, in HAMi-core's version 1.2 layout so that HAMi's
//! monitor reads it unchanged, followed by vgpu's extension (the lock's hint words, running totals
//! per device, per-slot process identity). `docs/region-layout.md` documents the bytes.
//!
//! # Use
//!
//! ```no_run
//! use vgpu_region::{InitParams, MemoryKind, Region};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let init = InitParams { device_uuids: vec!["GPU-0f2d...".into()], ..InitParams::default() };
//! let region = Region::open("/tmp/cudevshr.cache".as_ref(), &init)?; // log region.open_kind() if notable
//! let slot = region.attach(std::process::id() as i32)?;
//! let device = region.device_index("GPU-0f2d...")?;
//! region.try_charge(&slot, device, MemoryKind::Data, 1 << 20, Some(4 << 30))?; // before calling the driver
//! region.uncharge(&slot, device, MemoryKind::Data, 1 << 20)?; // after the free
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! - **Atomic limits across processes.** [`Region::try_charge`] checks and charges under one
//!   lock shared by every process of the file, with checked arithmetic: two processes racing for
//!   the last bytes cannot both win, and sizes near `u64::MAX` are refused rather than wrapped.
//! - **No byte of the file can crash, misdirect or hang a locker.** The lock is a kernel-held
//!   open-file-description lock on one byte of the file ([`FILE_LOCK_OFFSET`]), in front of which
//!   the threads of a process queue; the file only holds hints about it ([`LockWords`]). A holder
//!   killed even by SIGKILL mid-update releases it with its death, in any pid namespace; the next
//!   holder sees the update was interrupted, recomputes every running total from the slots and
//!   reaps dead slots. Every lock attempt gives up when nobody has taken the lock for
//!   [`LOCK_TIMEOUT`], with [`RegionError::LockTimeout`] instead of hanging (a stopped holder), and
//!   after [`MAX_LOCK_WAIT`] in all ([`RegionError::LockBusy`]). Waiters that have waited
//!   long go first, so a process charging in a tight loop cannot starve the others.
//! - **Dead processes' memory comes back.** Slots of dead processes (see [`process`] for how death
//!   is detected, and its pid-namespace caveat) are reaped at every attach, at most every
//!   [`REAP_INTERVAL`] during charges, and always before a charge or an attach is refused. The
//!   reaps of attach and of the interval are quick ([`Reap::Quick`]): their cost under the lock
//!   hardly grows with the number of live processes, so a thousand processes can start at once.
//! - **Readers never spin without bound** ([`image::SEQLOCK_READ_ATTEMPTS`]).
//! - **Nothing but a region file of an accepted owner is used.** A symbolic link at the path is
//!   never followed; a directory, FIFO, device, socket or a file with several hard links is
//!   refused; so is a file owned by another user than this process's and root (unless
//!   [`Owners::Any`]), and another user's file is never truncated or rewritten
//!   ([`RegionError::UnsafeFile`]).
//! - **Bad files are detected.** A file of the wrong size, magic, version or with inconsistent
//!   counts is rebuilt when no live process uses it ([`OpenKind::Rebuilt`]) and refused with
//!   [`RegionError::InUseWithBadLayout`] otherwise. Nothing here panics, exits, logs, changes the
//!   umask or installs signal handlers.
//!
//! # Fork and exec
//!
//! A [`Slot`] belongs to the process that attached it. After `fork` the child must call
//! [`Region::attach`] with its own pid (the mapping, the fd and its shared `flock` are inherited
//! and stay valid; the lock's description is replaced by one of the child's own at its first
//! lock) and never use the parent's `Slot`: its charges would land in the parent's slot.
//! Compare `Slot::pid()` with `getpid()`, or use `pthread_atfork`, to notice. After `exec` the new
//! image opens the region again; attaching with the same pid resets the old image's slot (its
//! device memory died with the old address space).

pub mod anchor;
mod error;
pub mod image;
mod layout;
mod lock;
pub mod process;
pub mod snapshot;
mod sys;

use std::fs::{File, Metadata, OpenOptions, Permissions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
use std::time::{Duration, Instant, SystemTime};

pub use anchor::PathState;
pub use error::{ChargeError, InitError, LayoutError, Refused, RegionError, UnsafeFile};
pub use layout::{
    COMPUTE_OFFSET, ComputeDevice, DEVICE_BURST_OPEN, DeviceMemory, DeviceUtil, EXTENSION_MAGIC, EXTENSION_OFFSET,
    EXTENSION_SIZE, EXTENSION_VERSION, Extension, FAVOUR_LOCK_OFFSET, FILE_LOCK_OFFSET, HAMI_INITIALIZED_FLAG,
    HAMI_MAJOR_VERSION, HAMI_MINOR_VERSION, HAMI_REGION_SIZE, HOST_BACKED_OFFSET, LockWords, MAX_DEVICES, MAX_SLOTS,
    OpaqueStorage, ProcSlot, RECENT_KERNEL_ACTIVE, REGION_FILE_SIZE, RegionFile, SLOT_EXTENSIONS_OFFSET, SLOT_FREE,
    SLOT_IDLE_RELEASE, SLOT_LIVE, SLOT_PRIORITY_RELEASE, SLOT_RELEASED, SharedRegion, SlotExtension, UUID_BYTES,
    layout_listing,
};
pub use process::process_start_time;
pub use snapshot::{ComputeCounters, ExtensionSnapshot, MemoryUsage, ProcessSnapshot, Snapshot, read_snapshot};
pub use sys::monotonic_ns;

/// How long any lock on the region is waited for while nobody takes it (its holder is stuck)
/// before giving up.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the region's lock is waited for in all while it keeps changing hands: the back of a
/// queue of a thousand processes starting at once (each takes the lock a few times) on two busy
/// CPUs, with room to spare, and a bound on a writer that forges the lock's progress.
pub const MAX_LOCK_WAIT: Duration = Duration::from_secs(30);
/// Dead slots are reaped during charges at most this often (and always before a refusal).
pub const REAP_INTERVAL: Duration = Duration::from_millis(100);
/// Live slots whose process a quick reap also looks up in `/proc` (start time, zombie), in turn.
pub const PROC_CHECKS_PER_QUICK_REAP: usize = 32;

/// How a reap tells the dead from the living.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reap {
    /// `kill(pid, 0)` for every live slot (a process that has exited and been waited for), and
    /// the whole check of [`process::is_alive`] for [`PROC_CHECKS_PER_QUICK_REAP`] of them, in
    /// turn: a zombie or a reused pid is found within a few quick reaps.
    Quick,
    /// [`process::is_alive`] for every live slot: before anything is refused.
    Full,
}

/// Where the next quick reap starts its `/proc` checks (a hint shared by the process's regions).
static QUICK_REAP_CURSOR: AtomicUsize = AtomicUsize::new(0);

/// HAMi-core's creator default for the switch its monitor owns (`recent_kernel` starts at
/// [`RECENT_KERNEL_ACTIVE`]).
const INITIAL_UTILIZATION_SWITCH: i32 = 1;

/// The longest a process defers its data calls to one value of `memory_quiesce`: a measurement
/// takes milliseconds, so a value that stays longer was left or pinned by a writer (a live pid
/// there would otherwise slow every allocation of the container by the wait below).
pub const QUIESCE_AT_MOST: Duration = Duration::from_millis(200);

/// The `memory_quiesce` value this process last deferred to, and since when (monotonic ns).
static QUIESCE_SEEN: AtomicU64 = AtomicU64::new(0);
static QUIESCE_SINCE_NS: AtomicU64 = AtomicU64::new(0);

/// Whether a data call should still defer to `measurer` in `memory_quiesce`: yes until the same
/// value has been seen for [`QUIESCE_AT_MOST`].
fn quiesce_is_fresh(measurer: u64) -> bool {
    let now = sys::monotonic_ns();
    if QUIESCE_SEEN.swap(measurer, Ordering::Relaxed) != measurer {
        QUIESCE_SINCE_NS.store(now, Ordering::Relaxed);
        return true;
    }
    now.saturating_sub(QUIESCE_SINCE_NS.load(Ordering::Relaxed)) < QUIESCE_AT_MOST.as_nanos() as u64
}

/// What [`Region::context_estimate`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContextEstimate {
    /// The last context measured on the device took this many bytes.
    Known(u64),
    /// None was measured yet, and this process measures the first: it must call
    /// [`Region::context_measured`] once the context was created (or its creation failed).
    Measure,
    /// None was measured, and another process's first measurement did not come in time.
    Unknown,
}

/// The kind of device memory a charge is recorded as (HAMi's per-slot split).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// CUDA contexts (`context_size`).
    Context,
    /// Loaded modules (`module_size`).
    Module,
    /// Everything allocated by the application (`data_size`).
    Data,
}

impl MemoryKind {
    /// Every kind, in the order of [`MemoryKind::index`].
    pub const ALL: [MemoryKind; 3] = [MemoryKind::Context, MemoryKind::Module, MemoryKind::Data];

    /// The kind's position in [`MemoryKind::ALL`].
    pub fn index(self) -> usize {
        match self {
            MemoryKind::Context => 0,
            MemoryKind::Module => 1,
            MemoryKind::Data => 2,
        }
    }
}

/// Bytes per region device index and kind ([`MemoryKind::index`]).
pub type ChargeTable = [[u64; 3]; MAX_DEVICES];

/// What [`Region::keep_slot`] found and did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKept {
    /// The slot is the process's and holds at least what it said.
    Intact,
    /// The slot is the process's but held less than the process holds: raised by this many bytes.
    Raised(u64),
    /// The slot was no longer the process's (its status, pid or generation had changed): taken
    /// back, with this many bytes charged.
    Restored(u64),
    /// Another live process holds the slot now; nothing was changed.
    TakenBy(i32),
}

/// What the creator of a region writes into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitParams {
    /// The creator's devices in CUDA ordinal order; they get region indices 0, 1, ...
    pub device_uuids: Vec<String>,
    /// Memory limit in bytes per region device index (0 = none), for HAMi's monitor. Entries past
    /// `device_uuids` apply to devices other processes register later.
    pub limits: [u64; MAX_DEVICES],
    /// Compute limit in percent per region device index (0 = none).
    pub sm_limits: [u64; MAX_DEVICES],
    /// `CUDA_TASK_PRIORITY`.
    pub priority: i32,
}

impl Default for InitParams {
    /// No devices, no limits, HAMi-core's default priority 1.
    fn default() -> Self {
        Self {
            device_uuids: Vec::new(),
            limits: [0; MAX_DEVICES],
            sm_limits: [0; MAX_DEVICES],
            priority: 1,
        }
    }
}

impl InitParams {
    fn validate(&self) -> Result<(), InitError> {
        if self.device_uuids.len() > MAX_DEVICES {
            return Err(InitError::TooManyDevices {
                count: self.device_uuids.len(),
            });
        }
        for (index, uuid) in self.device_uuids.iter().enumerate() {
            if !uuid_is_valid(uuid) {
                return Err(InitError::BadUuid { uuid: uuid.clone() });
            }
            if self.device_uuids[..index].contains(uuid) {
                return Err(InitError::DuplicateUuid { uuid: uuid.clone() });
            }
        }
        Ok(())
    }
}

/// A UUID this crate writes: non-empty, printable ASCII without spaces, short enough for its NUL.
/// What it writes always reads back as [`UuidEntry::Valid`].
fn uuid_is_valid(uuid: &str) -> bool {
    !uuid.is_empty() && uuid.len() < UUID_BYTES && uuid.bytes().all(|byte| byte.is_ascii_graphic())
}

/// What [`Region::open`] found at the path. The caller decides what to log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpenKind {
    /// The file was new or empty, and was initialised.
    Created,
    /// A valid region nobody was using: stale slots dropped, header rewritten from the
    /// [`InitParams`] but for what the container's life keeps: its limits (while its devices are
    /// the same) and the fields HAMi's monitor owns ([`Kept`]).
    Reinitialised,
    /// An invalid file nobody was using, rebuilt; the problem found.
    Rebuilt(LayoutError),
    /// A valid region in use by other processes, joined as it is.
    Joined,
    /// A region in use by other processes whose running totals disagreed with its slots (the
    /// problem found); the totals were recomputed from the slots.
    Repaired(LayoutError),
}

/// Whose files [`Region::open_with`] accepts at the region's path. Whatever the choice, a file
/// owned by another user is never truncated or rewritten: it is used only when it is a valid
/// region ([`UnsafeFile::ForeignInvalid`] otherwise).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Owners {
    /// Files owned by this process's effective uid or by root (which no unprivileged user can
    /// plant); any other owner is [`UnsafeFile::ForeignOwner`]. The default, and
    /// [`Region::open`]'s.
    #[default]
    SelfOrRoot,
    /// Files of any owner: for containers whose processes run as several non-root uids, where
    /// the operator vouches for every user who can write the region's directory.
    Any,
}

/// A process's claim on one slot, from [`Region::attach`]. Only valid in the process that attached
/// it, until it is detached or reaped.
#[derive(Debug, PartialEq, Eq)]
pub struct Slot {
    index: usize,
    pid: i32,
    generation: u64,
}

impl Slot {
    /// Index in `procs`.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The pid the slot was attached for.
    pub fn pid(&self) -> i32 {
        self.pid
    }
}

/// An open, mapped region. Dropping it unmaps the file and closes it (releasing this process's
/// file lock) but does not detach slots.
pub struct Region {
    mapping: NonNull<RegionFile>,
    /// The region's lock (declared before `locked_file`, whose descriptor it refers to, so that
    /// it drops first).
    lock: lock::RegionLock,
    /// The open file, holding the `LOCK_SH` that marks this process as a user of it.
    locked_file: File,
    path: PathBuf,
    open_kind: OpenKind,
    /// What the path held before this process opened it ([`anchor`]).
    path_at_open: PathState,
}

// SAFETY: the mapping is shared memory made of atomics and of C objects (semaphores) built for
// concurrent use; every compound update happens under the region's lock. Nothing in Region is
// tied to the thread that created it.
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` only gives out atomic access and lock-protected updates.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by map_shared with REGION_FILE_SIZE bytes, and no reference
        // into it outlives `self` (they all borrow it).
        unsafe { sys::unmap(self.mapping.cast(), REGION_FILE_SIZE) };
    }
}

/// Proof that the caller holds the region's lock; unlocks on drop.
struct LockGuard<'a> {
    _held: lock::Held<'a>,
}

impl Region {
    /// Opens the region file at `path`, creating it (mode 0666, whatever the umask) if missing;
    /// [`Region::open_with`] with [`Owners::SelfOrRoot`].
    pub fn open(path: &Path, init: &InitParams) -> Result<Region, RegionError> {
        Self::open_with(path, init, Owners::SelfOrRoot)
    }

    /// Opens the region file at `path`, creating it (mode 0666, whatever the umask) if missing.
    ///
    /// Only a regular file with one link, owned by a user `owners` accepts, is used: a symbolic
    /// link at the path is never followed, and FIFOs, devices, directories, hard links and files
    /// of other users are refused with [`RegionError::UnsafeFile`] before anything is written
    /// (devices and FIFOs are not even opened, unless one is swapped in at the last moment; it is
    /// then opened non-blocking and refused).
    ///
    /// Every process that opens the region holds a shared `flock` on it for as long as the
    /// `Region` lives, so a process that gets the lock exclusively knows nobody is using the file.
    /// That process (re)initialises it from `init` ([`OpenKind::Created`], [`OpenKind::Reinitialised`]
    /// or [`OpenKind::Rebuilt`] when it was invalid; a file of another user is never rebuilt);
    /// any other joins it after validating it, and an invalid file in use is
    /// [`RegionError::InUseWithBadLayout`]. `init` is ignored when joining: compare
    /// [`Region::snapshot`] if it matters.
    pub fn open_with(path: &Path, init: &InitParams, owners: Owners) -> Result<Region, RegionError> {
        init.validate().map_err(|problem| RegionError::InvalidInit {
            path: path.to_owned(),
            problem,
        })?;
        let path_at_open = anchor::restore_before_open(path, |anchored| check_opened(path, anchored, owners).is_ok());
        let (file, foreign_owner) = open_or_create(path, owners)?;
        let io_error = |operation, source| RegionError::Io {
            path: path.to_owned(),
            operation,
            source,
        };
        let mut region =
            if sys::flock(&file, libc::LOCK_EX | libc::LOCK_NB).map_err(|source| io_error("flock", source))? {
                let region = Self::initialise_exclusively(path, file, init, foreign_owner)?;
                // Downgrade; it is not atomic, but the file is fully initialised before anyone else
                // can take any lock on it.
                wait_for_shared_lock(&region.locked_file, path)?;
                region
            } else {
                wait_for_shared_lock(&file, path)?;
                Self::join(path, file)?
            };
        anchor::ensure_anchor(path, &region.locked_file);
        region.path_at_open = path_at_open;
        Ok(region)
    }

    /// What this process found at the region's path when it opened it: [`PathState::Restored`]
    /// when the container's region, still in use, had been deleted or replaced there and was put
    /// back ([`anchor`]).
    pub fn path_at_open(&self) -> PathState {
        self.path_at_open
    }

    /// Makes the region's path name this region again if it was deleted, or replaced by a file
    /// nobody uses, and keeps its anchor (see [`anchor`]). For a running process to call every
    /// tick: a `stat` when nothing changed.
    pub fn keep_path(&self) -> PathState {
        anchor::keep_path(&self.path, &self.locked_file)
    }

    /// Joins a region that processes are using, for a tool that changes it (`vgpu-smi set`): never
    /// creates, initialises or rebuilds the file. A file nobody uses (no process holds its shared
    /// `flock`) is [`RegionError::NotInUse`], and so is a missing one: the next process to start
    /// re-creates it from its own variables, so a change made there would not last. The file is
    /// checked as [`Region::open_with`] checks it, and held (shared) while the `Region` lives.
    pub fn open_in_use(path: &Path, owners: Owners) -> Result<Region, RegionError> {
        let (file, _) = match open_existing(path, owners) {
            Ok(Some(opened)) => opened,
            Ok(None) => return Err(RegionError::NotInUse { path: path.to_owned() }),
            Err(error) => return Err(error),
        };
        let io_error = |source| RegionError::Io {
            path: path.to_owned(),
            operation: "flock",
            source,
        };
        if sys::flock(&file, libc::LOCK_EX | libc::LOCK_NB).map_err(io_error)? {
            // Nobody holds it; dropping the file releases the lock.
            return Err(RegionError::NotInUse { path: path.to_owned() });
        }
        wait_for_shared_lock(&file, path)?;
        Self::join(path, file)
    }

    /// The one constructor: the region file `file` (opened at `path`, of the region's size),
    /// mapped, with a lock description of this process's own.
    fn map(path: &Path, file: File, open_kind: OpenKind) -> Result<Region, RegionError> {
        let io_error = |operation, source| RegionError::Io {
            path: path.to_owned(),
            operation,
            source,
        };
        let lock = lock::RegionLock::new(&file, file.as_raw_fd(), path)
            .map_err(|source| io_error("open (a lock description)", source))?;
        let mapping = sys::map_shared(&file, REGION_FILE_SIZE).map_err(|source| io_error("mmap", source))?;
        Ok(Region {
            mapping: mapping.cast(),
            lock,
            locked_file: file,
            path: path.to_owned(),
            open_kind,
            path_at_open: PathState::Intact,
        })
    }

    /// With the file held exclusively: validate what is there, then write a fresh region. A file
    /// of another user (`foreign_owner`) is only reinitialised when it is a valid region;
    /// otherwise it is refused before anything is written.
    fn initialise_exclusively(
        path: &Path,
        file: File,
        init: &InitParams,
        foreign_owner: Option<u32>,
    ) -> Result<Region, RegionError> {
        let io_error = |operation, source| RegionError::Io {
            path: path.to_owned(),
            operation,
            source,
        };
        let foreign_invalid = |owner, problem| RegionError::UnsafeFile {
            path: path.to_owned(),
            problem: UnsafeFile::ForeignInvalid { owner, problem },
        };
        let len = file.metadata().map_err(|source| io_error("fstat", source))?.len();
        if let Some(owner) = foreign_owner
            && len != REGION_FILE_SIZE as u64
        {
            let problem = LayoutError::WrongFileSize {
                len,
                expected: REGION_FILE_SIZE as u64,
            };
            return Err(foreign_invalid(owner, problem));
        }
        if len != REGION_FILE_SIZE as u64 {
            file.set_len(REGION_FILE_SIZE as u64)
                .map_err(|source| io_error("ftruncate", source))?;
        }
        sys::preallocate(&file, REGION_FILE_SIZE).map_err(|source| io_error("fallocate", source))?;
        let mut region = Self::map(path, file, OpenKind::Created)?;
        let mapping = region.mapping.cast::<u8>();
        region.open_kind = if len == 0 {
            OpenKind::Created
        } else if len != REGION_FILE_SIZE as u64 {
            OpenKind::Rebuilt(LayoutError::WrongFileSize {
                len,
                expected: REGION_FILE_SIZE as u64,
            })
        } else {
            let file = region.file();
            let checked = snapshot::check_hami_header(file)
                .and_then(|()| snapshot::check_extension_header(file))
                .and_then(|()| snapshot::check_totals(file));
            match checked {
                Ok(()) => OpenKind::Reinitialised,
                Err(problem) => OpenKind::Rebuilt(problem),
            }
        };
        if let (Some(owner), OpenKind::Rebuilt(problem)) = (foreign_owner, &region.open_kind) {
            // Only read so far; dropping the region unmaps it.
            return Err(foreign_invalid(owner, problem.clone()));
        }
        let kept = matches!(region.open_kind, OpenKind::Reinitialised).then(|| Kept::read(region.file()));
        // SAFETY: the mapping is REGION_FILE_SIZE bytes, no reference into it is alive (the
        // validation above is over), and no other process uses it (we hold the file exclusively).
        unsafe { sys::zero(mapping, REGION_FILE_SIZE) };
        write_initial_state(region.file(), init);
        if let Some(kept) = kept {
            kept.restore(region.file(), init);
        }
        Ok(region)
    }

    /// With the file held shared: validate it, and repair the running totals if they disagree.
    fn join(path: &Path, file: File) -> Result<Region, RegionError> {
        let io_error = |operation, source| RegionError::Io {
            path: path.to_owned(),
            operation,
            source,
        };
        let bad_layout = |problem| RegionError::InUseWithBadLayout {
            path: path.to_owned(),
            problem,
        };
        let len = file.metadata().map_err(|source| io_error("fstat", source))?.len();
        if len != REGION_FILE_SIZE as u64 {
            return Err(bad_layout(LayoutError::WrongFileSize {
                len,
                expected: REGION_FILE_SIZE as u64,
            }));
        }
        let mut region = Self::map(path, file, OpenKind::Joined)?;
        snapshot::check_hami_header(region.file()).map_err(bad_layout)?;
        snapshot::check_extension_header(region.file()).map_err(bad_layout)?;
        let repaired = {
            let guard = region.lock()?;
            let problem = snapshot::check_totals(region.file()).err();
            if problem.is_some() {
                region.recompute_locked(&guard);
            }
            problem
        };
        if let Some(problem) = repaired {
            region.open_kind = OpenKind::Repaired(problem);
        }
        Ok(region)
    }

    /// What `open` found at the path.
    pub fn open_kind(&self) -> &OpenKind {
        &self.open_kind
    }

    /// The path the region was opened at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The address and length of the file's mapping, for a reader that guards its accesses
    /// against a file cut short under it (`vgpu-smi`).
    pub fn mapped_range(&self) -> (usize, usize) {
        (self.mapping.as_ptr() as usize, REGION_FILE_SIZE)
    }

    /// HAMi-core's part of the mapping, for the fields this crate does not manage
    /// (`utilization_switch`, `recent_kernel`, `last_kernel_time`, `device_util`, `monitorused`,
    /// `hostpid`, `limit`, `sm_limit`). Memory fields, slot ownership and devices must only change
    /// through `Region`'s methods.
    pub fn hami(&self) -> &SharedRegion {
        &self.file().hami
    }

    /// vgpu's extension, read-only in spirit like [`Region::hami`].
    pub fn extension(&self) -> &Extension {
        &self.file().ext
    }

    fn file(&self) -> &RegionFile {
        // SAFETY: the mapping is REGION_FILE_SIZE bytes, page-aligned, valid until drop, and every
        // bit pattern is a valid RegionFile (atomics and opaque bytes only).
        unsafe { self.mapping.as_ref() }
    }

    /// Claims a slot for process `pid` (normally `getpid()`): reaps dead slots first, then reuses
    /// the live slot already recorded for `pid` (a process that called `exec`: its old charges
    /// are dropped) or else the lowest free slot. [`RegionError::NoFreeSlot`] when all 1024 belong
    /// to live processes.
    pub fn attach(&self, pid: i32) -> Result<Slot, RegionError> {
        if pid <= 0 {
            return Err(RegionError::InvalidPid {
                path: self.path.clone(),
                pid,
            });
        }
        let start_time = process::process_start_time(pid).unwrap_or(0);
        let guard = self.lock()?;
        self.reap_locked(&guard, Reap::Quick);
        let hami = &self.file().hami;
        let same_process = hami.procs.iter().position(|slot| {
            slot.status.load(Ordering::Relaxed) == SLOT_LIVE && slot.pid.load(Ordering::Relaxed) == pid
        });
        let free = || {
            hami.procs
                .iter()
                .position(|slot| slot.status.load(Ordering::Relaxed) != SLOT_LIVE)
        };
        let index = match same_process {
            Some(index) => {
                self.release_slot_locked(&guard, index);
                self.recompute_locked(&guard);
                index
            }
            None => free()
                .or_else(|| {
                    // Every slot looks live: a zombie or a reused pid may hold one.
                    self.reap_locked(&guard, Reap::Full);
                    free()
                })
                .ok_or_else(|| RegionError::NoFreeSlot {
                    path: self.path.clone(),
                })?,
        };
        Ok(self.claim_slot_locked(&guard, index, pid, start_time))
    }

    /// Gives a slot back (clean exit), releasing everything still charged to it. A slot that was
    /// already reaped is fine. The handle is taken by reference (a process keeps its slot in a
    /// static), but is invalid afterwards: every later use of it is [`RegionError::SlotLost`].
    pub fn detach(&self, slot: &Slot) -> Result<(), RegionError> {
        let guard = self.lock()?;
        if self.owned_slot(slot).is_ok() {
            self.release_slot_locked(&guard, slot.index);
            self.recompute_locked(&guard);
        }
        Ok(())
    }

    /// The region index of the device with this UUID, registering it in `uuids` if it is new.
    /// Processes with different `CUDA_VISIBLE_DEVICES` share one region, so devices are indexed
    /// by UUID, never by CUDA ordinal.
    pub fn device_index(&self, uuid: &str) -> Result<usize, RegionError> {
        if !uuid_is_valid(uuid) {
            return Err(RegionError::InvalidUuid {
                path: self.path.clone(),
                uuid: uuid.to_owned(),
            });
        }
        if let Ok(Some(index)) = self.find_device(uuid) {
            return Ok(index);
        }
        let guard = self.lock()?;
        self.repair_uuids_locked(&guard)?;
        if let Ok(Some(index)) = self.find_device(uuid) {
            return Ok(index);
        }
        let hami = &self.file().hami;
        let index = usize::try_from(hami.device_num.load(Ordering::Relaxed)).unwrap_or(MAX_DEVICES);
        let entry = hami.uuids.get(index).ok_or_else(|| RegionError::TooManyDevices {
            path: self.path.clone(),
            uuid: uuid.to_owned(),
        })?;
        write_uuid(entry, uuid);
        // Publishes the UUID bytes to lock-free readers of device_num.
        hami.device_num.store(index as u64 + 1, Ordering::Release);
        Ok(index)
    }

    /// The index of the entry holding `uuid` among `uuids[0..device_num]`, or `Err` with the
    /// index of the first entry that is not a well-formed UUID (nothing can be said then: that
    /// entry may be this very device's).
    fn find_device(&self, uuid: &str) -> Result<Option<usize>, usize> {
        let hami = &self.file().hami;
        let device_num = usize::try_from(hami.device_num.load(Ordering::Acquire))
            .unwrap_or(0)
            .min(MAX_DEVICES);
        let mut found = None;
        for (index, entry) in hami.uuids.iter().take(device_num).enumerate() {
            match uuid_entry(entry) {
                UuidEntry::Valid(bytes) => {
                    if found.is_none() && bytes == uuid.as_bytes() {
                        found = Some(index);
                    }
                }
                UuidEntry::Overlong(_) | UuidEntry::Corrupt => return Err(index),
            }
        }
        Ok(found)
    }

    /// Makes every `uuids[0..device_num]` entry a well-formed NUL-terminated UUID, or fails. An
    /// entry that starts with a whole NVML-formatted UUID (`GPU-`/`MIG-` and 8-4-4-4-12 hex
    /// digits) followed by anything but a NUL names that device: the rest is zeroed (the entry
    /// keeps its identity, so processes that already use its index are unaffected). Any other
    /// malformed entry (no NUL in its 96 bytes, empty, or bytes that are not printable ASCII) names
    /// no device anyone can tell: it may be the one a caller is looking up, and registering that
    /// device again would split one GPU into two region devices with a limit each, so
    /// [`RegionError::CorruptDeviceUuid`] (fail closed).
    fn repair_uuids_locked(&self, _guard: &LockGuard<'_>) -> Result<(), RegionError> {
        let hami = &self.file().hami;
        let device_num = usize::try_from(hami.device_num.load(Ordering::Relaxed))
            .unwrap_or(0)
            .min(MAX_DEVICES);
        for (index, entry) in hami.uuids.iter().take(device_num).enumerate() {
            match uuid_entry(entry) {
                UuidEntry::Valid(_) => {}
                UuidEntry::Overlong(prefix) => {
                    for byte in entry.iter().skip(prefix) {
                        byte.store(0, Ordering::Relaxed);
                    }
                }
                UuidEntry::Corrupt => {
                    return Err(RegionError::CorruptDeviceUuid {
                        path: self.path.clone(),
                        index,
                    });
                }
            }
        }
        // Publishes the repaired bytes to lock-free readers.
        fence(Ordering::Release);
        Ok(())
    }

    /// Charges `bytes` of `kind` on region device `device` to `slot`, unless that would take the
    /// device's total over `limit` (`None`: no limit, but the total must still fit 64 bits).
    /// Check and charge are one step under the region's mutex, so concurrent processes cannot
    /// overcommit. Before refusing, dead slots are reaped and the check repeated; otherwise they
    /// are reaped at most every [`REAP_INTERVAL`]. A zero-byte charge succeeds without locking;
    /// `Some(0)` refuses every other charge (the "0 = no limit" of the variables is the caller's
    /// business: pass `None`).
    pub fn try_charge(
        &self,
        slot: &Slot,
        device: usize,
        kind: MemoryKind,
        bytes: u64,
        limit: Option<u64>,
    ) -> Result<(), ChargeError> {
        self.check_device(device)?;
        if bytes == 0 {
            return Ok(());
        }
        let guard = self.lock()?;
        self.reap_if_due_locked(&guard);
        let proc_slot = self.owned_slot(slot)?;
        let ceiling = limit.unwrap_or(u64::MAX);
        let total = &self.file().ext.device_used[device];
        let total_after = |used: u64| used.checked_add(bytes).filter(|after| *after <= ceiling);
        let mut used = total.load(Ordering::Relaxed);
        if total_after(used).is_none() && self.reap_locked(&guard, Reap::Full) > 0 {
            // A dead process's charge must never cause a refusal.
            used = total.load(Ordering::Relaxed);
        }
        let Some(after) = total_after(used) else {
            return Err(ChargeError::Refused(Refused {
                used,
                limit: ceiling,
                requested: bytes,
            }));
        };
        let usage = &proc_slot.used[device];
        write_slot(proc_slot, || {
            let field = kind_field(usage, kind);
            field.store(field.load(Ordering::Relaxed).saturating_add(bytes), Ordering::Relaxed);
            usage.total.store(
                usage.total.load(Ordering::Relaxed).saturating_add(bytes),
                Ordering::Relaxed,
            );
        });
        total.store(after, Ordering::Release);
        Ok(())
    }

    /// How the slot differs from what its process knows it holds, read without the lock:
    /// [`SlotKept::Intact`] when it is the process's and holds at least `held`, else what
    /// [`Region::keep_slot`] would do (`Raised` and `Restored` with the bytes missing).
    pub fn slot_differs(&self, slot: &Slot, held: &ChargeTable) -> SlotKept {
        let Some(proc_slot) = self.file().hami.procs.get(slot.index) else {
            return SlotKept::Intact;
        };
        let missing = |usage: &DeviceMemory, wanted: &[u64; 3]| -> u64 {
            MemoryKind::ALL
                .iter()
                .map(|kind| wanted[kind.index()].saturating_sub(kind_field(usage, *kind).load(Ordering::Relaxed)))
                .sum()
        };
        if self.owned_slot(slot).is_err() {
            return SlotKept::Restored(held.iter().flatten().sum());
        }
        let short: u64 = proc_slot
            .used
            .iter()
            .zip(held)
            .map(|(usage, wanted)| missing(usage, wanted))
            .sum();
        if short == 0 {
            SlotKept::Intact
        } else {
            SlotKept::Raised(short)
        }
    }

    /// Makes the region hold what this process knows it holds (`held`, per device and kind),
    /// after a writer replaced or changed the file's contents under it (a copy of an older image
    /// over the live file keeps its inode, so the region's anchor cannot see it): a slot that is
    /// no longer the process's (status, pid or generation changed) is taken back unless another
    /// live process holds it, and a charge below `held` is raised to it. Charges above `held` are
    /// left alone: the caller's `held` can lag behind its charges (an allocation is charged before
    /// the driver is called), never run ahead of them. The running totals are recounted after any
    /// change.
    pub fn keep_slot(&self, slot: &Slot, start_time: u64, held: &ChargeTable) -> Result<SlotKept, RegionError> {
        let guard = self.lock()?;
        let file = self.file();
        let (proc_slot, extension) = self.slot_parts(slot)?;
        let kept = if self.owned_slot(slot).is_ok() {
            let mut raised = 0u64;
            write_slot(proc_slot, || {
                for (usage, wanted) in proc_slot.used.iter().zip(held) {
                    for kind in MemoryKind::ALL {
                        let field = kind_field(usage, kind);
                        let have = field.load(Ordering::Relaxed);
                        if have < wanted[kind.index()] {
                            raised = raised.saturating_add(wanted[kind.index()] - have);
                            field.store(wanted[kind.index()], Ordering::Relaxed);
                        }
                    }
                }
            });
            if raised == 0 {
                return Ok(SlotKept::Intact);
            }
            SlotKept::Raised(raised)
        } else {
            let occupant = proc_slot.pid.load(Ordering::Relaxed);
            if proc_slot.status.load(Ordering::Relaxed) == SLOT_LIVE
                && occupant != slot.pid
                && process::is_alive(occupant, extension.start_time.load(Ordering::Relaxed))
            {
                return Ok(SlotKept::TakenBy(occupant));
            }
            let mut restored = 0u64;
            self.occupy_slot_locked(
                &guard,
                slot.index,
                slot.pid,
                slot.generation,
                start_time,
                |usage, device| {
                    for kind in MemoryKind::ALL {
                        kind_field(usage, kind).store(held[device][kind.index()], Ordering::Relaxed);
                        restored = restored.saturating_add(held[device][kind.index()]);
                    }
                },
            );
            // A later attach must not hand out this slot's generation again.
            file.ext
                .next_generation
                .fetch_max(slot.generation.saturating_add(1), Ordering::Relaxed);
            SlotKept::Restored(restored)
        };
        // Recounts each slot's total from its kinds, the running totals and proc_num.
        self.recompute_locked(&guard);
        Ok(kept)
    }

    /// Releases up to `bytes` of `kind` on `device` from `slot`, never more than the slot holds of
    /// that kind (no underflow, whatever the caller passes). Returns the bytes released.
    pub fn uncharge(&self, slot: &Slot, device: usize, kind: MemoryKind, bytes: u64) -> Result<u64, RegionError> {
        self.check_device(device)?;
        if bytes == 0 {
            return Ok(0);
        }
        let _guard = self.lock()?;
        let proc_slot = self.owned_slot(slot)?;
        let usage = &proc_slot.used[device];
        let field = kind_field(usage, kind);
        let released = bytes.min(field.load(Ordering::Relaxed));
        if released == 0 {
            return Ok(0);
        }
        write_slot(proc_slot, || {
            field.store(
                field.load(Ordering::Relaxed).saturating_sub(released),
                Ordering::Relaxed,
            );
            usage.total.store(
                usage.total.load(Ordering::Relaxed).saturating_sub(released),
                Ordering::Relaxed,
            );
        });
        let total = &self.file().ext.device_used[device];
        total.store(
            total.load(Ordering::Relaxed).saturating_sub(released),
            Ordering::Release,
        );
        Ok(released)
    }

    /// Bytes charged on a region device by all processes (the running total; no lock, no scan).
    /// 0 for an index of 16 or more.
    pub fn device_used(&self, device: usize) -> u64 {
        self.file()
            .ext
            .device_used
            .get(device)
            .map_or(0, |total| total.load(Ordering::Acquire))
    }

    /// What a context creation on region device `device` should reserve before the driver is
    /// called: the last context size measured there ([`ContextEstimate::Known`]); else, when no
    /// other process is measuring the region's first context, this process measures it
    /// ([`ContextEstimate::Measure`], ended by [`Region::context_measured`]); else it waits up to
    /// `wait` for that process's figure, and is [`ContextEstimate::Unknown`] after.
    pub fn context_estimate(&self, device: usize, wait: Duration) -> ContextEstimate {
        let ext = &self.file().ext;
        let Some(known) = ext.context_bytes.get(device) else {
            return ContextEstimate::Unknown;
        };
        let pid = u64::from(std::process::id());
        let deadline = std::time::Instant::now() + wait;
        loop {
            let bytes = known.load(Ordering::Acquire);
            if bytes != 0 {
                return ContextEstimate::Known(bytes);
            }
            let measurer = ext.context_measurer.load(Ordering::Acquire);
            // A measurer that died (or a value no process holds) hands the measurement on.
            let free = measurer == 0 || !process::is_alive(i32::try_from(measurer).unwrap_or(0), 0);
            if (free || measurer == pid)
                && ext
                    .context_measurer
                    .compare_exchange(measurer, pid, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return ContextEstimate::Measure;
            }
            if std::time::Instant::now() >= deadline {
                return ContextEstimate::Unknown;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Records what a context on region device `device` took (0: nothing measured), and ends
    /// this process's measurement of the first one if it had that role.
    pub fn context_measured(&self, device: usize, bytes: u64) {
        let ext = &self.file().ext;
        if let (Some(known), true) = (ext.context_bytes.get(device), bytes != 0) {
            known.store(bytes, Ordering::Release);
        }
        let pid = u64::from(std::process::id());
        let _ = ext
            .context_measurer
            .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Records that `bytes` more of `slot`'s charged data on `device` are backed by host memory
    /// ([`Extension::host_backed`]); `more` false records that many fewer (never below 0). The
    /// slot's owner is its only writer, so no lock is taken.
    pub fn record_host_backed(&self, slot: &Slot, device: usize, bytes: u64, more: bool) -> Result<(), RegionError> {
        self.check_device(device)?;
        self.owned_slot(slot)?;
        let Some(field) = self
            .file()
            .ext
            .host_backed
            .get(slot.index)
            .and_then(|row| row.get(device))
        else {
            return Ok(());
        };
        let _ = field.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            Some(if more {
                held.saturating_add(bytes)
            } else {
                held.saturating_sub(bytes)
            })
        });
        Ok(())
    }

    /// Marks a data allocation or free of `slot`'s process under way on a region device (see
    /// [`SlotExtension::memory_in_flight`]); waits up to 2 ms while another process reads a
    /// consistent pair. Pair with [`Region::memory_call_done`].
    pub fn memory_call_begins(&self, slot: &Slot, device: usize) {
        let ext = &self.file().ext;
        let (Some(begun), Some(mark)) = (
            ext.memory_calls_begun.get(device),
            ext.slots
                .get(slot.index)
                .and_then(|slot| slot.memory_in_flight.get(device)),
        ) else {
            return;
        };
        let measurer = ext.memory_quiesce.load(Ordering::Acquire);
        if measurer != 0 && quiesce_is_fresh(measurer) {
            // A measurer that died (or a value no process holds) must not slow every later call.
            let pid = i32::try_from(measurer).unwrap_or(0);
            if !process::is_alive(pid, 0) {
                let _ = ext
                    .memory_quiesce
                    .compare_exchange(measurer, 0, Ordering::AcqRel, Ordering::Acquire);
            }
            let start = std::time::Instant::now();
            while ext.memory_quiesce.load(Ordering::Acquire) != 0
                && start.elapsed() < std::time::Duration::from_millis(2)
            {
                std::thread::yield_now();
            }
        }
        // The mark before the count: a measurement that misses the mark sees the count move.
        let _ = mark.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |marks| marks.checked_add(1));
        begun.fetch_add(1, Ordering::SeqCst);
    }

    /// Ends what [`Region::memory_call_begins`] marked.
    pub fn memory_call_done(&self, slot: &Slot, device: usize) {
        let ext = &self.file().ext;
        if let Some(mark) = ext
            .slots
            .get(slot.index)
            .and_then(|slot| slot.memory_in_flight.get(device))
        {
            // Never below 0 (a foreign writer could have zeroed it).
            let _ = mark.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |marks| marks.checked_sub(1));
        }
    }

    /// Runs `read` when no live process of the region has a data call under way on the device
    /// and none began while it ran, retrying until `deadline`; `None` if that never happened.
    /// The marks of a slot whose process is dead (killed in the middle of a call) are ignored.
    pub fn quiet_read<T>(&self, device: usize, deadline: std::time::Instant, mut read: impl FnMut() -> T) -> Option<T> {
        let ext = &self.file().ext;
        let begun = ext.memory_calls_begun.get(device)?;
        let pid = u64::from(std::process::id());
        let _ = ext
            .memory_quiesce
            .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire);
        let result = loop {
            let before = begun.load(Ordering::SeqCst);
            if !self.calls_under_way(device) {
                let value = read();
                if begun.load(Ordering::SeqCst) == before {
                    break Some(value);
                }
            }
            if std::time::Instant::now() >= deadline {
                break None;
            }
            std::thread::yield_now();
        };
        let _ = ext
            .memory_quiesce
            .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Acquire);
        result
    }

    /// Whether a live slot whose process is alive marks a data call under way on the device.
    fn calls_under_way(&self, device: usize) -> bool {
        let file = self.file();
        let proc_num = usize::try_from(file.hami.proc_num.load(Ordering::Acquire))
            .unwrap_or(0)
            .min(MAX_SLOTS);
        file.hami
            .procs
            .iter()
            .zip(&file.ext.slots)
            .take(proc_num)
            .any(|(slot, extension)| {
                extension
                    .memory_in_flight
                    .get(device)
                    .is_some_and(|mark| mark.load(Ordering::SeqCst) != 0)
                    && slot.status.load(Ordering::Acquire) == SLOT_LIVE
                    && process::is_alive(
                        slot.pid.load(Ordering::Relaxed),
                        extension.start_time.load(Ordering::Relaxed),
                    )
            })
    }

    /// Holds the region's lock until the returned guard drops: every update of the region, in
    /// any process, waits meanwhile (at most [`LOCK_TIMEOUT`]). For tests and tools that need a
    /// holder; the library never holds the lock across a call.
    #[doc(hidden)]
    #[must_use = "the lock is released when the guard drops"]
    pub fn hold_lock(&self) -> Result<impl Sized + '_, RegionError> {
        self.lock()
    }

    /// Writes the container's limits of region device `device`, under the lock: `memory` bytes
    /// (`limit`, 0 = none) and `sm` percent (`sm_limit`, 0 = none); `None` leaves one as it is.
    /// Returns the previous (`limit`, `sm_limit`). Every process of the region enforces them from
    /// then on. Values are the caller's to validate (as the variables are).
    pub fn set_limits(&self, device: usize, memory: Option<u64>, sm: Option<u64>) -> Result<(u64, u64), RegionError> {
        self.check_device(device)?;
        let _guard = self.lock()?;
        let hami = &self.file().hami;
        let swap = |field: &AtomicU64, value: Option<u64>| match value {
            Some(value) => field.swap(value, Ordering::AcqRel),
            None => field.load(Ordering::Acquire),
        };
        Ok((swap(&hami.limit[device], memory), swap(&hami.sm_limit[device], sm)))
    }

    /// Frees the slots of dead processes and returns how many.
    pub fn reap_dead(&self) -> Result<usize, RegionError> {
        let guard = self.lock()?;
        Ok(self.reap_locked(&guard, Reap::Full))
    }

    /// Decodes the live region without locking it (seqlock-consistent per slot, bounded retries).
    pub fn snapshot(&self) -> Snapshot {
        snapshot::decode_image(&image::consistent_copy(self.file()))
    }

    fn check_device(&self, device: usize) -> Result<(), RegionError> {
        if device < MAX_DEVICES {
            Ok(())
        } else {
            Err(RegionError::NoSuchDevice {
                path: self.path.clone(),
                device,
            })
        }
    }

    fn slot_lost(&self, slot: &Slot) -> RegionError {
        RegionError::SlotLost {
            path: self.path.clone(),
            slot: slot.index,
        }
    }

    /// The slot's two parts (HAMi-core's and the extension's), whoever holds it now.
    fn slot_parts(&self, slot: &Slot) -> Result<(&ProcSlot, &SlotExtension), RegionError> {
        let file = self.file();
        let shared = file.hami.procs.get(slot.index).ok_or_else(|| self.slot_lost(slot))?;
        let extension = file.ext.slots.get(slot.index).ok_or_else(|| self.slot_lost(slot))?;
        Ok((shared, extension))
    }

    /// The slot, if it still belongs to the holder of `slot`.
    fn owned_slot(&self, slot: &Slot) -> Result<&ProcSlot, RegionError> {
        let (shared, extension) = self.slot_parts(slot)?;
        let owned = shared.status.load(Ordering::Relaxed) == SLOT_LIVE
            && shared.pid.load(Ordering::Relaxed) == slot.pid
            && extension.generation.load(Ordering::Relaxed) == slot.generation;
        if owned { Ok(shared) } else { Err(self.slot_lost(slot)) }
    }

    /// Takes the region's lock, waiting at most [`LOCK_TIMEOUT`] (see `lock.rs`). When the
    /// previous holder died holding it, its update may be half done: the running totals are
    /// recomputed from the slots and dead slots reaped before the lock is handed out.
    fn lock(&self) -> Result<LockGuard<'_>, RegionError> {
        let held = self.lock.acquire(&self.file().ext.lock).map_err(|error| match error {
            lock::LockError::Timeout => RegionError::LockTimeout {
                path: self.path.clone(),
            },
            lock::LockError::Busy => RegionError::LockBusy {
                path: self.path.clone(),
            },
            lock::LockError::Io(source) => RegionError::LockFailed {
                path: self.path.clone(),
                source,
            },
        })?;
        let interrupted = held.interrupted;
        let guard = LockGuard { _held: held };
        if interrupted {
            self.recompute_locked(&guard);
            self.reap_locked(&guard, Reap::Quick);
        }
        Ok(guard)
    }

    /// Makes every slot consistent (closes seqlocks left odd, `total` = sum of kinds) and rebuilds
    /// the running totals and `proc_num` from the live slots.
    fn recompute_locked(&self, _guard: &LockGuard<'_>) {
        let file = self.file();
        let mut sums = [0u64; MAX_DEVICES];
        let mut proc_num = 0;
        for (index, slot) in file.hami.procs.iter().enumerate() {
            let sequence = slot.seqlock.load(Ordering::Relaxed);
            if sequence % 2 == 1 {
                slot.seqlock.store(sequence.wrapping_add(1), Ordering::Release);
            }
            if slot.status.load(Ordering::Relaxed) != SLOT_LIVE {
                continue;
            }
            proc_num = index + 1;
            write_slot(slot, || {
                for (usage, sum) in slot.used.iter().zip(sums.iter_mut()) {
                    let total = usage
                        .context_size
                        .load(Ordering::Relaxed)
                        .saturating_add(usage.module_size.load(Ordering::Relaxed))
                        .saturating_add(usage.data_size.load(Ordering::Relaxed));
                    usage.total.store(total, Ordering::Relaxed);
                    *sum = sum.saturating_add(total);
                }
            });
        }
        for (total, sum) in file.ext.device_used.iter().zip(sums) {
            total.store(sum, Ordering::Release);
        }
        file.hami.proc_num.store(proc_num as i32, Ordering::Release);
    }

    fn reap_if_due_locked(&self, guard: &LockGuard<'_>) {
        let now = sys::monotonic_ns();
        let last = self.file().ext.last_reap_ns.load(Ordering::Relaxed);
        // A last time in the future comes from before a reboot (a region file on disk).
        if now.saturating_sub(last) >= REAP_INTERVAL.as_nanos() as u64 || last > now {
            self.reap_locked(guard, Reap::Quick);
        }
    }

    /// Frees the slots of dead processes; returns how many.
    fn reap_locked(&self, guard: &LockGuard<'_>, how: Reap) -> usize {
        let file = self.file();
        let proc_num = usize::try_from(file.hami.proc_num.load(Ordering::Relaxed))
            .unwrap_or(0)
            .min(MAX_SLOTS);
        // The slots a quick reap looks up in /proc: PROC_CHECKS_PER_QUICK_REAP from the cursor on.
        let first = QUICK_REAP_CURSOR.load(Ordering::Relaxed) % proc_num.max(1);
        let looked_up = |index: usize| {
            how == Reap::Full || (index + proc_num - first) % proc_num.max(1) < PROC_CHECKS_PER_QUICK_REAP
        };
        QUICK_REAP_CURSOR.store(first + PROC_CHECKS_PER_QUICK_REAP, Ordering::Relaxed);
        let mut reaped = 0;
        for (index, (slot, extension)) in file
            .hami
            .procs
            .iter()
            .zip(file.ext.slots.iter())
            .enumerate()
            .take(proc_num)
        {
            if slot.status.load(Ordering::Relaxed) != SLOT_LIVE {
                continue;
            }
            let pid = slot.pid.load(Ordering::Relaxed);
            let alive = if looked_up(index) {
                process::is_alive(pid, extension.start_time.load(Ordering::Relaxed))
            } else {
                process::exists(pid)
            };
            if !alive {
                self.release_slot_locked(guard, index);
                reaped += 1;
            }
        }
        if reaped > 0 {
            self.recompute_locked(guard);
        } else {
            self.shrink_proc_num_locked(guard);
        }
        file.ext.last_reap_ns.store(sys::monotonic_ns(), Ordering::Relaxed);
        reaped
    }

    /// Zeroes a slot and marks it free. The running totals are left as they are: the caller
    /// recounts them from the slots still live ([`Region::recompute_locked`]). Taking off what the
    /// slot says it held would trust bytes anyone may have written: a free slot that a writer
    /// marked live with a made-up `total` (never added, or counted saturated) would lower the
    /// totals below what the live processes hold, and let them allocate past the limit.
    fn release_slot_locked(&self, _guard: &LockGuard<'_>, index: usize) {
        let file = self.file();
        let (Some(slot), Some(extension)) = (file.hami.procs.get(index), file.ext.slots.get(index)) else {
            return;
        };
        write_slot(slot, || {
            slot.used.iter().for_each(clear_device_memory);
            clear_monitor_fields(slot);
            slot.status.store(SLOT_FREE, Ordering::Release);
            slot.pid.store(0, Ordering::Relaxed);
        });
        extension.start_time.store(0, Ordering::Relaxed);
        extension.suspend.store(0, Ordering::Relaxed);
        extension.flags.store(0, Ordering::Relaxed);
        clear_in_flight_marks(extension);
        clear_host_backed(file, index);
    }

    /// Makes a free slot this process's.
    fn claim_slot_locked(&self, guard: &LockGuard<'_>, index: usize, pid: i32, start_time: u64) -> Slot {
        let file = self.file();
        let generation = file.ext.next_generation.fetch_add(1, Ordering::Relaxed).max(1);
        self.occupy_slot_locked(guard, index, pid, generation, start_time, |_, _| {});
        let proc_num = &file.hami.proc_num;
        if proc_num.load(Ordering::Relaxed) < index as i32 + 1 {
            proc_num.store(index as i32 + 1, Ordering::Release);
        }
        self.shrink_proc_num_locked(guard);
        Slot { index, pid, generation }
    }

    /// Writes slot `index` as live for `pid` under `generation`, with nothing of any former
    /// holder left (free slots are zero already, except in a file another implementation wrote or
    /// one copied over), then `charge` fills each device's memory.
    fn occupy_slot_locked(
        &self,
        _guard: &LockGuard<'_>,
        index: usize,
        pid: i32,
        generation: u64,
        start_time: u64,
        mut charge: impl FnMut(&DeviceMemory, usize),
    ) {
        let file = self.file();
        let (Some(slot), Some(extension)) = (file.hami.procs.get(index), file.ext.slots.get(index)) else {
            return;
        };
        write_slot(slot, || {
            for (device, usage) in slot.used.iter().enumerate() {
                clear_device_memory(usage);
                charge(usage, device);
            }
            clear_monitor_fields(slot);
            extension.start_time.store(start_time, Ordering::Relaxed);
            extension.generation.store(generation, Ordering::Relaxed);
            extension.suspend.store(0, Ordering::Relaxed);
            extension.flags.store(0, Ordering::Relaxed);
            clear_in_flight_marks(extension);
            clear_host_backed(file, index);
            slot.pid.store(pid, Ordering::Relaxed);
            // HAMi's monitor reads pid once it sees the status.
            slot.status.store(SLOT_LIVE, Ordering::Release);
        });
    }

    /// `proc_num` = one more than the highest live slot (HAMi's monitor reads `0..proc_num`).
    fn shrink_proc_num_locked(&self, _guard: &LockGuard<'_>) {
        let hami = &self.file().hami;
        let proc_num = usize::try_from(hami.proc_num.load(Ordering::Relaxed))
            .unwrap_or(0)
            .min(MAX_SLOTS);
        let live_end = hami.procs[..proc_num]
            .iter()
            .rposition(|slot| slot.status.load(Ordering::Relaxed) == SLOT_LIVE)
            .map_or(0, |index| index + 1);
        if live_end != proc_num {
            hami.proc_num.store(live_end as i32, Ordering::Release);
        }
    }
}

/// Builds the bytes `Region::open` writes into a new region file (with this process as creator).
/// For tests, fuzzing and tools that need a valid image without a file.
pub fn initial_image(init: &InitParams) -> Result<Vec<u8>, InitError> {
    init.validate()?;
    let file = snapshot::zeroed_region_file();
    write_initial_state(&file, init);
    let bytes: *const u8 = std::ptr::from_ref::<RegionFile>(&file).cast();
    // SAFETY: `file` is a live RegionFile of REGION_FILE_SIZE bytes with no padding (layout.rs
    // asserts the sizes add up), every byte initialised (zeroed, then written), and nobody else
    // refers to it while it is copied.
    Ok(unsafe { std::slice::from_raw_parts(bytes, REGION_FILE_SIZE) }.to_vec())
}

/// Fills an all-zero region: semaphores, header, devices, limits, the extension (its lock words
/// stay zero: nobody holds or waits for the lock), and `initialized_flag` last.
/// What a valid region nobody uses keeps when a process reinitialises it (HAMi-core initialises only
/// a file without its magic): the container's limits, set by its first process's variables,
/// `vgpu-smi set` or HAMi, while its devices are the same ones in the same order (another device
/// list is another container's configuration: the new variables' limits apply); and the fields
/// HAMi's monitor writes or reads as the container's (`utilization_switch`, `recent_kernel`,
/// `priority`). Everything else (slots, totals, the limiter's bucket) belonged to processes that
/// are gone and starts afresh.
struct Kept {
    uuids: Vec<String>,
    limits: [u64; MAX_DEVICES],
    sm_limits: [u64; MAX_DEVICES],
    utilization_switch: i32,
    recent_kernel: i32,
    priority: i32,
}

impl Kept {
    fn read(file: &RegionFile) -> Kept {
        let hami = &file.hami;
        let devices =
            usize::try_from(hami.device_num.load(Ordering::Relaxed)).map_or(MAX_DEVICES, |n| n.min(MAX_DEVICES));
        Kept {
            uuids: hami.uuids[..devices].iter().map(snapshot::read_uuid).collect(),
            limits: std::array::from_fn(|index| hami.limit[index].load(Ordering::Relaxed)),
            sm_limits: std::array::from_fn(|index| hami.sm_limit[index].load(Ordering::Relaxed)),
            utilization_switch: hami.utilization_switch.load(Ordering::Relaxed),
            recent_kernel: hami.recent_kernel.load(Ordering::Relaxed),
            priority: hami.priority.load(Ordering::Relaxed),
        }
    }

    fn restore(&self, file: &RegionFile, init: &InitParams) {
        let hami = &file.hami;
        let same_devices = self.uuids.len() == init.device_uuids.len().min(MAX_DEVICES)
            && self.uuids.iter().zip(&init.device_uuids).all(|(kept, new)| kept == new);
        if same_devices {
            for (limit, value) in hami.limit.iter().zip(self.limits) {
                limit.store(value, Ordering::Relaxed);
            }
            for (limit, value) in hami.sm_limit.iter().zip(self.sm_limits) {
                limit.store(value, Ordering::Relaxed);
            }
        }
        hami.utilization_switch
            .store(self.utilization_switch, Ordering::Relaxed);
        hami.recent_kernel.store(self.recent_kernel, Ordering::Relaxed);
        hami.priority.store(self.priority, Ordering::Relaxed);
    }
}

fn write_initial_state(file: &RegionFile, init: &InitParams) {
    let hami = &file.hami;
    let ext = &file.ext;
    sys::init_semaphore(&hami.sem);
    sys::init_semaphore(&hami.sem_postinit);
    hami.major_version.store(HAMI_MAJOR_VERSION, Ordering::Relaxed);
    hami.minor_version.store(HAMI_MINOR_VERSION, Ordering::Relaxed);
    for (entry, uuid) in hami.uuids.iter().zip(&init.device_uuids) {
        write_uuid(entry, uuid);
    }
    hami.device_num
        .store(init.device_uuids.len().min(MAX_DEVICES) as u64, Ordering::Relaxed);
    for (limit, value) in hami.limit.iter().zip(init.limits) {
        limit.store(value, Ordering::Relaxed);
    }
    for (limit, value) in hami.sm_limit.iter().zip(init.sm_limits) {
        limit.store(value, Ordering::Relaxed);
    }
    hami.utilization_switch
        .store(INITIAL_UTILIZATION_SWITCH, Ordering::Relaxed);
    hami.recent_kernel.store(RECENT_KERNEL_ACTIVE, Ordering::Relaxed);
    hami.priority.store(init.priority, Ordering::Relaxed);
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    hami.last_kernel_time
        .store(i64::try_from(now).unwrap_or(0), Ordering::Relaxed);

    ext.magic.store(EXTENSION_MAGIC, Ordering::Relaxed);
    ext.version.store(EXTENSION_VERSION, Ordering::Relaxed);
    ext.extension_size.store(EXTENSION_SIZE as u32, Ordering::Relaxed);
    ext.hami_region_size.store(EXTENSION_OFFSET as u64, Ordering::Relaxed);
    ext.creator_pid.store(std::process::id() as i32, Ordering::Relaxed);
    ext.next_generation.store(1, Ordering::Relaxed);
    ext.created_unix_secs.store(now, Ordering::Relaxed);

    fence(Ordering::Release);
    hami.initialized_flag.store(HAMI_INITIALIZED_FLAG, Ordering::Release);
}

/// Opens the file read-write, creating it with mode 0666 if it does not exist, and checks that it
/// is a file this process may use as its region (see [`Region::open_with`]). Returns the file and,
/// when another user owns it, that user's uid.
///
/// The mode is set with fchmod after creation, because the umask may have masked it (HAMi-core
/// calls `umask(0)` instead, which changes the application's umask). 0666 because the processes
/// of one container may run as different uids and all of them must charge the same region;
/// docs/threat-model.md says what that allows on a host shared by several users.
///
/// No step follows a symbolic link at the last component: `O_CREAT|O_EXCL` fails on any link,
/// the existing file is opened with `O_NOFOLLOW`, and every check is made on the open descriptor
/// (`fstat`), so a file swapped in between the checks is what gets checked. The directories above
/// are the operator's choice and are followed.
fn open_or_create(path: &Path, owners: Owners) -> Result<(File, Option<u32>), RegionError> {
    let open_error = |source| RegionError::Open {
        path: path.to_owned(),
        source,
    };
    // Two rounds cover a file deleted between the two opens.
    for _ in 0..2 {
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o666)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
        {
            Ok(file) => {
                // Best effort: a file we just created is ours, so this only fails on exotic
                // filesystems, where the umask's mode is still usable by this user.
                let _ = file.set_permissions(Permissions::from_mode(0o666));
                let foreign_owner = check_opened(path, &file, owners)?;
                return Ok((file, foreign_owner));
            }
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {}
            Err(error) => return Err(open_error(error)),
        }
        if let Some(opened) = open_existing(path, owners)? {
            return Ok(opened);
        }
    }
    Err(open_error(io::Error::from(io::ErrorKind::NotFound)))
}

/// Opens the existing file at `path` read-write with [`open_or_create`]'s checks; `None` when
/// there is none.
fn open_existing(path: &Path, owners: Owners) -> Result<Option<(File, Option<u32>)>, RegionError> {
    let open_error = |source| RegionError::Open {
        path: path.to_owned(),
        source,
    };
    let unsafe_file = |problem| RegionError::UnsafeFile {
        path: path.to_owned(),
        problem,
    };
    // Refuse what is plainly not a region file before opening it: opening a device can have
    // effects of its own (a watchdog, a tape), and opening a FIFO can block.
    match std::fs::symlink_metadata(path) {
        Ok(metadata) => {
            if let Some(problem) = not_a_plain_file(&metadata, path) {
                return Err(unsafe_file(problem));
            }
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(open_error(error)),
    }
    match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => {
            let foreign_owner = check_opened(path, &file, owners)?;
            sys::clear_nonblocking(&file).map_err(|source| RegionError::Io {
                path: path.to_owned(),
                operation: "fcntl",
                source,
            })?;
            Ok(Some((file, foreign_owner)))
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        // A link swapped in after the check above.
        Err(error) if error.raw_os_error() == Some(libc::ELOOP) => Err(unsafe_file(UnsafeFile::Symlink)),
        Err(error) => Err(open_error(error)),
    }
}

/// What makes a file's metadata (from `lstat` or `fstat`), found at the region's `path`, unusable
/// as a region file, ownership aside: a link, something other than a regular file, or a second
/// name other than its anchor ([`anchor`]).
fn not_a_plain_file(metadata: &Metadata, path: &Path) -> Option<UnsafeFile> {
    let file_type = metadata.file_type();
    let kind = if file_type.is_symlink() {
        return Some(UnsafeFile::Symlink);
    } else if file_type.is_file() {
        // A second hard link may be another file's name (a link to a victim made where the
        // region belongs): its owner would pass the owner check, and it would be overwritten.
        // The region's own anchor is the one second name allowed: with exactly two names, the
        // path and the anchor, no other name (a victim's own) exists.
        let anchored = anchor::is_anchored(path, metadata);
        return (metadata.nlink() != 1 && !anchored).then(|| UnsafeFile::HardLinks {
            links: metadata.nlink(),
        });
    } else if file_type.is_dir() {
        "directory"
    } else if file_type.is_fifo() {
        "FIFO"
    } else if file_type.is_char_device() {
        "character device"
    } else if file_type.is_block_device() {
        "block device"
    } else if file_type.is_socket() {
        "socket"
    } else {
        "special file"
    };
    Some(UnsafeFile::NotRegular { kind })
}

/// Checks the open file itself: a plain file, owned by a user `owners` accepts. Returns the
/// owner's uid when it is not this process's effective uid.
fn check_opened(path: &Path, file: &File, owners: Owners) -> Result<Option<u32>, RegionError> {
    let metadata = file.metadata().map_err(|source| RegionError::Io {
        path: path.to_owned(),
        operation: "fstat",
        source,
    })?;
    let unsafe_file = |problem| RegionError::UnsafeFile {
        path: path.to_owned(),
        problem,
    };
    if let Some(problem) = not_a_plain_file(&metadata, path) {
        return Err(unsafe_file(problem));
    }
    let (owner, uid) = (metadata.uid(), sys::effective_uid());
    if owner == uid {
        return Ok(None);
    }
    if owner == 0 || owners == Owners::Any {
        return Ok(Some(owner));
    }
    Err(unsafe_file(UnsafeFile::ForeignOwner { owner, uid }))
}

/// Takes (or downgrades to) the shared file lock, retrying for at most [`LOCK_TIMEOUT`] while
/// another process holds it exclusively to initialise the file.
fn wait_for_shared_lock(file: &File, path: &Path) -> Result<(), RegionError> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(200);
    loop {
        let locked = sys::flock(file, libc::LOCK_SH | libc::LOCK_NB).map_err(|source| RegionError::Io {
            path: path.to_owned(),
            operation: "flock",
            source,
        })?;
        if locked {
            return Ok(());
        }
        if start.elapsed() >= LOCK_TIMEOUT {
            return Err(RegionError::FileLockTimeout { path: path.to_owned() });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

/// Runs a slot update with the slot's seqlock odd, so lock-free readers retry instead of seeing a
/// torn update. A seqlock left odd by a dead writer is first made even.
fn write_slot<R>(slot: &ProcSlot, update: impl FnOnce() -> R) -> R {
    let current = slot.seqlock.load(Ordering::Relaxed);
    let even = current.wrapping_add(current % 2);
    slot.seqlock.store(even.wrapping_add(1), Ordering::Relaxed);
    fence(Ordering::Release);
    let result = update();
    slot.seqlock.store(even.wrapping_add(2), Ordering::Release);
    result
}

fn kind_field(usage: &DeviceMemory, kind: MemoryKind) -> &AtomicU64 {
    match kind {
        MemoryKind::Context => &usage.context_size,
        MemoryKind::Module => &usage.module_size,
        MemoryKind::Data => &usage.data_size,
    }
}

fn clear_device_memory(usage: &DeviceMemory) {
    for field in [
        &usage.context_size,
        &usage.module_size,
        &usage.data_size,
        &usage.offset,
        &usage.total,
    ]
    .into_iter()
    .chain(&usage.unused)
    {
        field.store(0, Ordering::Relaxed);
    }
}

/// A slot's host-backed bytes go with its charges.
fn clear_host_backed(file: &RegionFile, index: usize) {
    for bytes in file.ext.host_backed.get(index).into_iter().flatten() {
        bytes.store(0, Ordering::Relaxed);
    }
}

/// A dead or departed process's data calls are over.
fn clear_in_flight_marks(extension: &SlotExtension) {
    for mark in &extension.memory_in_flight {
        mark.store(0, Ordering::SeqCst);
    }
}

fn clear_monitor_fields(slot: &ProcSlot) {
    slot.hostpid.store(0, Ordering::Relaxed);
    for (monitor_used, util) in slot.monitorused.iter().zip(&slot.device_util) {
        monitor_used.store(0, Ordering::Relaxed);
        for field in [&util.dec_util, &util.enc_util, &util.sm_util]
            .into_iter()
            .chain(&util.unused)
        {
            field.store(0, Ordering::Relaxed);
        }
    }
}

fn write_uuid(entry: &[std::sync::atomic::AtomicU8; UUID_BYTES], uuid: &str) {
    let bytes = uuid.as_bytes();
    for (index, byte) in entry.iter().enumerate() {
        byte.store(bytes.get(index).copied().unwrap_or(0), Ordering::Relaxed);
    }
}

/// What one `uuids` entry holds, read within its 96 bytes.
#[derive(Debug, PartialEq, Eq)]
enum UuidEntry {
    /// A non-empty string of printable ASCII without spaces, then a NUL: the string's bytes.
    Valid(Vec<u8>),
    /// The entry starts with a whole NVML-formatted UUID followed by something else than a NUL
    /// (with or without a NUL further on): the length of that UUID.
    Overlong(usize),
    /// Anything else (no NUL at all, empty, control or non-ASCII bytes).
    Corrupt,
}

/// Length of an NVML-formatted UUID: `GPU-` (or `MIG-`) and 8-4-4-4-12 hex digits.
const NVML_UUID_LEN: usize = 40;

fn uuid_entry(entry: &[std::sync::atomic::AtomicU8; UUID_BYTES]) -> UuidEntry {
    let bytes: Vec<u8> = entry.iter().map(|byte| byte.load(Ordering::Relaxed)).collect();
    let text_len = bytes.iter().position(|&byte| byte == 0);
    let nvml_prefix = bytes.get(..NVML_UUID_LEN).is_some_and(is_nvml_uuid);
    if let Some(len) = text_len
        && len > 0
        && bytes[..len].iter().all(u8::is_ascii_graphic)
        // A whole NVML UUID with more after it is that UUID, overwritten: never another device.
        && !(nvml_prefix && len > NVML_UUID_LEN)
    {
        return UuidEntry::Valid(bytes[..len].to_vec());
    }
    if nvml_prefix {
        return UuidEntry::Overlong(NVML_UUID_LEN);
    }
    UuidEntry::Corrupt
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (or `MIG-`), hex digits in either case.
fn is_nvml_uuid(bytes: &[u8]) -> bool {
    let Some(rest) = bytes.strip_prefix(b"GPU-").or_else(|| bytes.strip_prefix(b"MIG-")) else {
        return false;
    };
    let mut groups = rest.split(|&byte| byte == b'-');
    [8, 4, 4, 4, 12].iter().all(|&len| {
        groups
            .next()
            .is_some_and(|group| group.len() == len && group.iter().all(u8::is_ascii_hexdigit))
    }) && groups.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(bytes: &[u8]) -> [std::sync::atomic::AtomicU8; UUID_BYTES] {
        std::array::from_fn(|index| std::sync::atomic::AtomicU8::new(bytes.get(index).copied().unwrap_or(0)))
    }

    const UUID: &[u8] = b"GPU-00112233-4455-6677-8899-aabbccddeeff";

    #[test]
    fn uuid_entries_are_read_within_their_bytes() {
        assert_eq!(uuid_entry(&entry(UUID)), UuidEntry::Valid(UUID.to_vec()));
        assert_eq!(uuid_entry(&entry(b"GPU-a\0junk")), UuidEntry::Valid(b"GPU-a".to_vec()));
        let mut overlong = UUID.to_vec();
        overlong.resize(UUID_BYTES, b'x');
        assert_eq!(uuid_entry(&entry(&overlong)), UuidEntry::Overlong(NVML_UUID_LEN));
        overlong.truncate(50);
        assert_eq!(uuid_entry(&entry(&overlong)), UuidEntry::Overlong(NVML_UUID_LEN));
        assert_eq!(uuid_entry(&entry(&[b'A'; UUID_BYTES])), UuidEntry::Corrupt);
        assert_eq!(uuid_entry(&entry(b"")), UuidEntry::Corrupt);
        assert_eq!(uuid_entry(&entry(b"GPU a")), UuidEntry::Corrupt);
        assert_eq!(uuid_entry(&entry(b"GPU-\xff")), UuidEntry::Corrupt);
        assert!(is_nvml_uuid(b"MIG-00112233-4455-6677-8899-AABBCCDDEEFF"));
        assert!(!is_nvml_uuid(b"GPU-00112233-4455-6677-8899-aabbccddeefg"));
        assert!(!is_nvml_uuid(b"GPU-0011223-34455-6677-8899-aabbccddeeff"));
    }
}
