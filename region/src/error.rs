//! Errors. Every `Display` is one line; the ones about a file name its path, so the hook can log
//! them as they are.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// A path for messages: as it is, or quoted and escaped when it holds control characters, so a
/// message always stays on one line.
struct ShownPath<'a>(&'a Path);

impl fmt::Display for ShownPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0.to_string_lossy();
        if text.chars().any(char::is_control) {
            write!(f, "{text:?}")
        } else {
            f.write_str(&text)
        }
    }
}

/// Something wrong with a region's contents, found by [`crate::read_snapshot`] or when opening.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// The image is too short to hold HAMi-core's struct.
    TooShort { len: u64, needed: u64 },
    /// The file is not exactly one region long.
    WrongFileSize { len: u64, expected: u64 },
    /// `initialized_flag` is not HAMi-core's magic.
    NotInitialised { flag: i32 },
    /// HAMi-core layout version other than 1.2.
    WrongVersion { major: u32, minor: u32 },
    /// `device_num` above 16.
    TooManyDevices { device_num: u64 },
    /// `proc_num` outside 0..=1024.
    BadProcNum { proc_num: i32 },
    /// The extension does not start with vgpu's magic (a HAMi-core file, or corruption).
    BadExtensionMagic { magic: u64 },
    /// An extension version this crate does not know.
    WrongExtensionVersion { version: u32 },
    /// The extension's recorded geometry is not this crate's.
    WrongExtensionGeometry { extension_size: u32, hami_region_size: u64 },
    /// A slot's `total` differs from the sum of its kinds.
    SlotTotalMismatch { slot: usize, device: usize },
    /// A device's running total differs from the sum over live slots (`None`: the sum overflows).
    TotalMismatch {
        device: usize,
        recorded: u64,
        slots_sum: Option<u64>,
    },
    /// A live slot lies at or beyond `proc_num`, where HAMi's monitor would not see it.
    LiveSlotBeyondProcNum { slot: usize, proc_num: i32 },
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooShort { len, needed } => {
                write!(f, "it is {len} bytes, shorter than the {needed} of HAMi's region")
            }
            Self::WrongFileSize { len, expected } => write!(f, "it is {len} bytes instead of {expected}"),
            Self::NotInitialised { flag } => {
                write!(
                    f,
                    "its initialized_flag is {flag} instead of {}",
                    crate::HAMI_INITIALIZED_FLAG
                )
            }
            Self::WrongVersion { major, minor } => write!(
                f,
                "its layout version is {major}.{minor} instead of {}.{}",
                crate::HAMI_MAJOR_VERSION,
                crate::HAMI_MINOR_VERSION
            ),
            Self::TooManyDevices { device_num } => {
                write!(f, "its device_num is {device_num}, above {}", crate::MAX_DEVICES)
            }
            Self::BadProcNum { proc_num } => {
                write!(f, "its proc_num is {proc_num}, outside 0..={}", crate::MAX_SLOTS)
            }
            Self::BadExtensionMagic { magic } => {
                write!(
                    f,
                    "its vgpu extension magic is {magic:#018x} (not VGPUEXT1: a HAMi-core file?)"
                )
            }
            Self::WrongExtensionVersion { version } => write!(
                f,
                "its vgpu extension version is {version} instead of {}",
                crate::EXTENSION_VERSION
            ),
            Self::WrongExtensionGeometry {
                extension_size,
                hami_region_size,
            } => write!(
                f,
                "its vgpu extension records size {extension_size} at offset {hami_region_size} instead of {} at {}",
                crate::EXTENSION_SIZE,
                crate::EXTENSION_OFFSET
            ),
            Self::SlotTotalMismatch { slot, device } => {
                write!(f, "slot {slot} device {device}: total is not context + module + data")
            }
            Self::TotalMismatch {
                device,
                recorded,
                slots_sum: Some(sum),
            } => {
                write!(f, "device {device}: running total {recorded} but live slots hold {sum}")
            }
            Self::TotalMismatch {
                device,
                recorded,
                slots_sum: None,
            } => {
                write!(
                    f,
                    "device {device}: running total {recorded} but live slots overflow 64 bits"
                )
            }
            Self::LiveSlotBeyondProcNum { slot, proc_num } => {
                write!(f, "live slot {slot} lies beyond proc_num {proc_num}")
            }
        }
    }
}

impl std::error::Error for LayoutError {}

/// [`crate::InitParams`] that cannot be written into a region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InitError {
    /// More than 16 device UUIDs.
    TooManyDevices { count: usize },
    /// A UUID that is empty, holds a byte that is not printable ASCII (or a space), or does not
    /// fit 95 bytes.
    BadUuid { uuid: String },
    /// The same UUID twice.
    DuplicateUuid { uuid: String },
}

impl fmt::Display for InitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooManyDevices { count } => write!(f, "{count} devices given, at most {}", crate::MAX_DEVICES),
            Self::BadUuid { uuid } => {
                write!(
                    f,
                    "device UUID {uuid:?} is empty, holds a byte that is not printable ASCII or is longer than {}",
                    crate::UUID_BYTES - 1
                )
            }
            Self::DuplicateUuid { uuid } => write!(f, "device UUID {uuid:?} given twice"),
        }
    }
}

impl std::error::Error for InitError {}

/// Why a file at the region's path is not used. Nothing was written to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UnsafeFile {
    /// The path is a symbolic link; links are never followed.
    Symlink,
    /// Not a regular file (a directory, FIFO, device or socket): what it is.
    NotRegular { kind: &'static str },
    /// A regular file with more than one name: one of them may be another file's.
    HardLinks { links: u64 },
    /// Owned by a user other than this process's effective user and root.
    ForeignOwner { owner: u32, uid: u32 },
    /// Owned by another user (accepted owner) but not a valid region: never rewritten.
    ForeignInvalid { owner: u32, problem: LayoutError },
}

impl fmt::Display for UnsafeFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Symlink => f.write_str("it is a symbolic link, which is never followed (name the file itself)"),
            Self::NotRegular { kind } => write!(f, "it is a {kind}, not a regular file"),
            Self::HardLinks { links } => write!(
                f,
                "it has {links} hard links where a region file has one (another name may be a file it would overwrite)"
            ),
            Self::ForeignOwner { owner, uid } => write!(
                f,
                "it is owned by uid {owner}, neither this process's uid {uid} nor root (planted by another user?)"
            ),
            Self::ForeignInvalid { owner, problem } => write!(
                f,
                "it is owned by uid {owner} and is not a valid region ({problem}); another user's file is never rewritten"
            ),
        }
    }
}

impl std::error::Error for UnsafeFile {}

/// A failure of a region operation. `Display` is one line naming the region's path.
#[derive(Debug)]
pub enum RegionError {
    /// The file could not be opened or created (a missing or unwritable directory, a path through
    /// a non-directory, permissions).
    Open { path: PathBuf, source: io::Error },
    /// A system call on the open file failed.
    Io {
        path: PathBuf,
        operation: &'static str,
        source: io::Error,
    },
    /// The file at the path is not one this process may use or rewrite as its region.
    UnsafeFile { path: PathBuf, problem: UnsafeFile },
    /// Another process held the file exclusively (while initialising it) for more than 1 s.
    FileLockTimeout { path: PathBuf },
    /// The file is not a valid region, and live processes use it, so it cannot be rebuilt.
    InUseWithBadLayout { path: PathBuf, problem: LayoutError },
    /// The [`crate::InitParams`] are invalid.
    InvalidInit { path: PathBuf, problem: InitError },
    /// Nobody took the region's lock for 1 s while this process waited: the process holding it is
    /// stuck (stopped, or looping with the lock held).
    LockTimeout { path: PathBuf },
    /// The region's lock kept changing hands for [`crate::MAX_LOCK_WAIT`] without reaching this process (very many
    /// processes or threads waiting, or a writer that forges the lock's counter).
    LockBusy { path: PathBuf },
    /// Locking failed: `fcntl` refused the file lock (a filesystem without open-file-description
    /// locks), or a forked child could not open a description of the file of its own.
    LockFailed { path: PathBuf, source: io::Error },
    /// All 1024 slots belong to live processes.
    NoFreeSlot { path: PathBuf },
    /// A pid of 0 or below was given to attach.
    InvalidPid { path: PathBuf, pid: i32 },
    /// The slot no longer belongs to the caller: it was reaped, detached, or the [`crate::Slot`]
    /// was inherited through `fork` and the child has not attached its own.
    SlotLost { path: PathBuf, slot: usize },
    /// All 16 device entries are taken by other UUIDs.
    TooManyDevices { path: PathBuf, uuid: String },
    /// A UUID that is empty, holds a byte that is not printable ASCII (or a space), or does not
    /// fit 95 bytes.
    InvalidUuid { path: PathBuf, uuid: String },
    /// A `uuids` entry in use that is no well-formed NUL-terminated UUID (no NUL in its 96 bytes,
    /// empty, or bytes that are not printable ASCII) and names no device that can be told: it
    /// may be the caller's own device, so the region is not used rather than split one GPU in two.
    CorruptDeviceUuid { path: PathBuf, index: usize },
    /// A device index of 16 or more.
    NoSuchDevice { path: PathBuf, device: usize },
    /// [`crate::Region::open_in_use`]: no process uses the region (or the file is missing), so
    /// the next process to start re-creates it from its own variables.
    NotInUse { path: PathBuf },
}

impl fmt::Display for RegionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Open { path, source } => {
                write!(
                    f,
                    "cannot open or create the shared region {}: {source}",
                    ShownPath(path)
                )
            }
            Self::Io {
                path,
                operation,
                source,
            } => {
                write!(f, "shared region {}: {operation} failed: {source}", ShownPath(path))
            }
            Self::UnsafeFile { path, problem } => {
                write!(f, "shared region {} refused: {problem}", ShownPath(path))
            }
            Self::FileLockTimeout { path } => write!(
                f,
                "shared region {}: another process kept it locked for initialisation for more than 1 s",
                ShownPath(path)
            ),
            Self::InUseWithBadLayout { path, problem } => write!(
                f,
                "shared region {} is used by live processes but is not a valid vgpu region ({problem}); stop \
                 them or point CUDA_DEVICE_MEMORY_SHARED_CACHE elsewhere",
                ShownPath(path)
            ),
            Self::InvalidInit { path, problem } => {
                write!(f, "shared region {}: cannot initialise it: {problem}", ShownPath(path))
            }
            Self::LockTimeout { path } => write!(
                f,
                "shared region {}: its lock was not released for 1 s (the process holding it is stuck)",
                ShownPath(path)
            ),
            Self::LockBusy { path } => write!(
                f,
                "shared region {}: its lock was not reached within {} s (it kept going to other processes or \
                 threads: too many wait for it)",
                ShownPath(path),
                crate::MAX_LOCK_WAIT.as_secs()
            ),
            Self::LockFailed { path, source } => {
                write!(f, "shared region {}: locking failed: {source}", ShownPath(path))
            }
            Self::NoFreeSlot { path } => write!(
                f,
                "shared region {}: all {} process slots belong to live processes",
                ShownPath(path),
                crate::MAX_SLOTS
            ),
            Self::InvalidPid { path, pid } => {
                write!(f, "shared region {}: cannot attach invalid pid {pid}", ShownPath(path))
            }
            Self::SlotLost { path, slot } => write!(
                f,
                "shared region {}: slot {slot} no longer belongs to this process (reaped, detached, or inherited \
                 through fork)",
                ShownPath(path)
            ),
            Self::TooManyDevices { path, uuid } => write!(
                f,
                "shared region {}: no room for device {uuid:?}: all {} device entries are taken",
                ShownPath(path),
                crate::MAX_DEVICES
            ),
            Self::NotInUse { path } => write!(
                f,
                "shared region {}: no process uses it (the next one to start re-creates it from its variables)",
                ShownPath(path)
            ),
            Self::CorruptDeviceUuid { path, index } => write!(
                f,
                "shared region {}: device entry {index} is not a NUL-terminated device UUID (the file was \
                 overwritten); refusing to use the region, since that entry may be this process's GPU: remove \
                 the file once no process uses it",
                ShownPath(path)
            ),
            Self::InvalidUuid { path, uuid } => write!(
                f,
                "shared region {}: device UUID {uuid:?} is empty, holds a byte that is not printable ASCII or is \
                 longer than {} bytes",
                ShownPath(path),
                crate::UUID_BYTES - 1
            ),
            Self::NoSuchDevice { path, device } => write!(
                f,
                "shared region {}: device index {device} is not below {}",
                ShownPath(path),
                crate::MAX_DEVICES
            ),
        }
    }
}

impl std::error::Error for RegionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Open { source, .. } | Self::Io { source, .. } | Self::LockFailed { source, .. } => Some(source),
            Self::InUseWithBadLayout { problem, .. } => Some(problem),
            Self::InvalidInit { problem, .. } => Some(problem),
            Self::UnsafeFile { problem, .. } => Some(problem),
            _ => None,
        }
    }
}

/// A charge that would take a device over its limit. Nothing was charged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    /// Bytes charged to the device (all processes) when the charge was refused.
    pub used: u64,
    /// The limit checked against; `u64::MAX` when none was given (the charge would overflow).
    pub limit: u64,
    /// Bytes asked for.
    pub requested: u64,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes refused: {} of the limit of {} bytes are in use",
            self.requested, self.used, self.limit
        )
    }
}

impl std::error::Error for Refused {}

/// Why [`crate::Region::try_charge`] charged nothing.
#[derive(Debug)]
pub enum ChargeError {
    /// Over the limit.
    Refused(Refused),
    /// The region could not be updated (lock timeout, lost slot, bad device index).
    Region(RegionError),
}

impl fmt::Display for ChargeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(refused) => refused.fmt(f),
            Self::Region(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for ChargeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Refused(refused) => Some(refused),
            Self::Region(error) => Some(error),
        }
    }
}

impl From<RegionError> for ChargeError {
    fn from(error: RegionError) -> Self {
        Self::Region(error)
    }
}
