//! Finding region files and reading them without ever blocking or slowing their writers.
//!
//! A region file of the full size is mapped read-only and copied word by word with atomic loads
//! (the writers' fields are all atomics), only as far as the slots in use reach. Each slot is
//! copied under its seqlock: a slot that changed during the copy is copied again (a bounded number
//! of times; a writer killed mid-update leaves it odd for good, and it is then reported as torn).
//! The copy is decoded by [`vgpu_region::read_snapshot`]. No lock of the region is ever taken,
//! nothing is written, and the reader's only cost to the writers is reading their cache lines.
//!
//! A shorter file (HAMi-core's own layout, or a truncated one) is read with plain `read`; a file
//! cut short while it is mapped reads zeros past its new end instead of faulting (`shrink`), and
//! the read is reported as such. Every problem is one line naming the path.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use vgpu_region::{
    EXTENSION_OFFSET, HAMI_REGION_SIZE, LayoutError, REGION_FILE_SIZE, RegionFile, SLOT_EXTENSIONS_OFFSET,
    SLOT_RELEASED, SlotExtension, Snapshot, read_snapshot,
};

/// Where `libvgpu.so` puts the region when `CUDA_DEVICE_MEMORY_SHARED_CACHE` is unset.
pub const DEFAULT_REGION_PATH: &str = "/tmp/cudevshr.cache";
/// The variable naming the region file (HAMi-core's name).
pub const REGION_PATH_VARIABLE: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";

/// Bytes of the region file covered by one slot extension.
const SLOT_EXTENSION_BYTES: usize = std::mem::size_of::<SlotExtension>();
const SUSPEND_OFFSET_IN_SLOT_EXTENSION: usize = std::mem::offset_of!(SlotExtension, suspend);
const FLAGS_OFFSET_IN_SLOT_EXTENSION: usize = std::mem::offset_of!(SlotExtension, flags);

pub use vgpu_region::image::consistent_copy;

/// A region decoded from one read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionState {
    /// What `read_snapshot` decoded.
    pub snapshot: Snapshot,
    /// The `suspend` flag of each slot of `snapshot.processes` (same order); all false without
    /// the vgpu extension.
    pub suspended: Vec<bool>,
    /// Per process of the snapshot: its slot's [`vgpu_region::SLOT_RELEASED`] flag (its GPU memory
    /// checkpointed off the device by `vgpu-smi suspend --release`).
    pub released: Vec<bool>,
}

/// One region file and what reading it gave: the state, or a one-line reason (without the path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionRead {
    pub path: PathBuf,
    pub result: Result<RegionState, String>,
}

/// The regions named by `path`: the file itself, or, for a directory, every region file in it and
/// in its subdirectories one level down (HAMi's monitor keeps one directory per container, each
/// holding one `*.cache` region), sorted by path. In a directory a file counts as a region when
/// its name ends in `.cache` or it is at least as large as HAMi-core's region; shared objects
/// (`*.so*`, HAMi puts `libvgpu.so` beside the region) never do.
/// The error is one line without the path.
pub fn discover(path: &Path) -> Result<Vec<PathBuf>, String> {
    let metadata = std::fs::metadata(path).map_err(|error| error.to_string())?;
    if !metadata.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut found = Vec::new();
    for entry in read_dir_sorted(path)? {
        match std::fs::metadata(&entry) {
            Ok(metadata) if metadata.is_dir() => {
                // A subdirectory that cannot be listed is skipped: it is not ours to report.
                for inner in read_dir_sorted(&entry).unwrap_or_default() {
                    if looks_like_region(&inner) {
                        found.push(inner);
                    }
                }
            }
            Ok(_) if looks_like_region(&entry) => found.push(entry),
            _ => {}
        }
    }
    Ok(found)
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|error| format!("cannot list it: {error}"))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .collect();
    paths.sort();
    Ok(paths)
}

fn looks_like_region(path: &Path) -> bool {
    let Some(name) = path.file_name().map(|name| name.to_string_lossy().into_owned()) else {
        return false;
    };
    // An anchor (or a restore's temporary link) is a second name of a region listed under its own.
    if name.contains(".so") || vgpu_region::anchor::is_anchor_name(std::ffi::OsStr::new(&name)) {
        return false;
    }
    let Ok(metadata) = std::fs::metadata(path) else {
        return false;
    };
    metadata.is_file() && (name.ends_with(".cache") || metadata.len() >= HAMI_REGION_SIZE as u64)
}

/// Reads one region file. Never panics and never blocks on the region's writers. The error is
/// one line, without the path (the caller has it).
pub fn read_region(path: &Path) -> RegionRead {
    RegionRead {
        path: path.to_path_buf(),
        result: read_state(path),
    }
}

/// Opens a region file without ever blocking: `O_NONBLOCK`, so that a FIFO put where a region
/// was expected (a container can write its region's folder) fails the regular-file check instead
/// of waiting for a writer forever; for writing, `O_NOFOLLOW` too, and a file with several hard
/// links is refused, so that a link put there never makes the operator's `vgpu-smi` write into
/// the file it points at. Returns the file and its metadata, or one line saying why not.
pub(crate) fn open_regular(path: &Path, write: bool) -> Result<(File, std::fs::Metadata), String> {
    let mut flags = libc::O_NONBLOCK;
    if write {
        flags |= libc::O_NOFOLLOW;
    }
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(flags)
        .open(path)
        .map_err(|error| {
            if write && error.raw_os_error() == Some(libc::ELOOP) {
                "it is a symbolic link, which is never written through".to_string()
            } else if write {
                format!("cannot open it for writing: {error}")
            } else {
                format!("cannot open it: {error}")
            }
        })?;
    let metadata = file.metadata().map_err(|error| format!("cannot stat it: {error}"))?;
    let file_type = metadata.file_type();
    if !metadata.is_file() {
        let what = if file_type.is_dir() {
            "a directory"
        } else if file_type.is_fifo() || file_type.is_socket() {
            "a pipe or socket"
        } else {
            "not a regular file"
        };
        return Err(format!("it is {what}, not a region file"));
    }
    if write
        && std::os::unix::fs::MetadataExt::nlink(&metadata) > 1
        && !vgpu_region::anchor::is_anchored(path, &metadata)
    {
        // As the region crate: another of its names may be someone else's file (the region's
        // own anchor is the one second name allowed).
        return Err("it has more than one hard link, and is never written through one".to_string());
    }
    Ok((file, metadata))
}

fn read_state(path: &Path) -> Result<RegionState, String> {
    let (file, metadata) = open_regular(path, false)?;
    let image = if metadata.len() >= REGION_FILE_SIZE as u64 {
        let mapping = Mapping::new(&file, false).map_err(|error| format!("cannot map it: {error}"))?;
        let image = consistent_copy(mapping.region());
        if mapping.shrank() {
            return Err(SHRANK.to_string());
        }
        image
    } else {
        let mut bytes = Vec::with_capacity(metadata.len() as usize);
        file.take(REGION_FILE_SIZE as u64)
            .read_to_end(&mut bytes)
            .map_err(|error| format!("cannot read it: {error}"))?;
        bytes
    };
    decode(&image)
}

/// Decodes an image copied from a region file.
pub fn decode(image: &[u8]) -> Result<RegionState, String> {
    let snapshot = read_snapshot(image).map_err(|problem| explain(&problem))?;
    let suspended = snapshot
        .processes
        .iter()
        .map(|process| snapshot.extension.is_some() && suspend_flag(image, process.slot) != 0)
        .collect();
    let released = snapshot
        .processes
        .iter()
        .map(|process| {
            snapshot.extension.is_some()
                && slot_extension_word(image, process.slot, FLAGS_OFFSET_IN_SLOT_EXTENSION) & SLOT_RELEASED != 0
        })
        .collect();
    Ok(RegionState {
        snapshot,
        suspended,
        released,
    })
}

/// The `suspend` field of a slot's extension in an image (0 when the image is too short).
fn suspend_flag(image: &[u8], slot: usize) -> u32 {
    slot_extension_word(image, slot, SUSPEND_OFFSET_IN_SLOT_EXTENSION)
}

/// A 4-byte field of a slot's extension in an image (0 when the image is too short).
fn slot_extension_word(image: &[u8], slot: usize, field: usize) -> u32 {
    let offset = EXTENSION_OFFSET + SLOT_EXTENSIONS_OFFSET + slot * SLOT_EXTENSION_BYTES + field;
    image
        .get(offset..offset + 4)
        .and_then(|bytes| <[u8; 4]>::try_from(bytes).ok())
        .map_or(0, u32::from_le_bytes)
}

/// The layout problem with a hint at its usual cause.
fn explain(problem: &LayoutError) -> String {
    let hint = match problem {
        LayoutError::TooShort { .. } => "truncated, or not a region",
        LayoutError::NotInitialised { flag: 0 } => "being created, or not a region",
        LayoutError::NotInitialised { .. } => "not a region, or corrupt",
        LayoutError::WrongVersion { .. } => "written by another HAMi-core version",
        _ => "corrupt",
    };
    format!("{problem} ({hint})")
}

/// A path for messages: as it is, or quoted when it holds control characters (one line always).
pub fn shown(path: &Path) -> String {
    let text = path.to_string_lossy();
    if text.chars().any(char::is_control) {
        format!("{text:?}")
    } else {
        text.into_owned()
    }
}

/// Why a region read while it was truncated is not reported.
pub(crate) const SHRANK: &str = "it was cut short while it was read (truncated by a writer)";

/// A shared mapping of the first [`REGION_FILE_SIZE`] bytes of a file, unmapped on drop.
pub(crate) struct Mapping {
    address: NonNull<RegionFile>,
    /// Watched for a file cut short under the reader (`shrink`); unwatched before the unmap.
    watch: Option<crate::shrink::Watch>,
}

impl Mapping {
    /// Maps the file (which must be at least [`REGION_FILE_SIZE`] bytes) read-only, or
    /// read-write for the `suspend` flag.
    pub(crate) fn new(file: &File, writable: bool) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        let protection = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of an open file descriptor; the kernel picks the address.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                REGION_FILE_SIZE,
                protection,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        NonNull::new(address.cast())
            .map(|address| Mapping {
                address,
                watch: Some(crate::shrink::watch(address.as_ptr() as usize, REGION_FILE_SIZE)),
            })
            .ok_or_else(|| std::io::Error::other("mmap returned null"))
    }

    /// Whether the file was cut short under the mapping: what was read past its new end is zeros
    /// and what was stored there is lost.
    pub(crate) fn shrank(&self) -> bool {
        self.watch.as_ref().is_some_and(crate::shrink::Watch::shrank)
    }

    /// The mapped region. Loads are always valid; stores only through a writable mapping.
    pub(crate) fn region(&self) -> &RegionFile {
        // SAFETY: the mapping is REGION_FILE_SIZE bytes, page-aligned, alive until drop, and every
        // bit pattern is a valid RegionFile (atomics and opaque bytes only). Atomic loads from a
        // read-only mapping are valid for these lock-free sizes.
        unsafe { self.address.as_ref() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        drop(self.watch.take());
        // SAFETY: the address and length are those of our own mmap, and no reference into it
        // outlives `self` (they all borrow it).
        unsafe { libc::munmap(self.address.as_ptr().cast(), REGION_FILE_SIZE) };
    }
}
