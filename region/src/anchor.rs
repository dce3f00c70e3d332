//! The region file's second name, its *anchor*: a hard link beside it, `.vgpu-anchor-<the file's
//! name, dots as underscores>` (hidden, and without `.cache` in it, so that no monitor takes it
//! for a second region). Deleting the file (`rm`, as advice for changing limits says) or putting
//! another file in its place (`mv copy path`) while processes use the region would otherwise split
//! the container in two: the running processes keep the old file, a new process starts a fresh
//! region at the path, and each side admits its own limit's worth.
//!
//! With the anchor the region outlives its name, and both sides put it back:
//!
//! - A process about to open the path first looks at the anchor ([`restore_before_open`]): when
//!   the anchored file is in use (its processes hold their shared `flock`) and the path is missing
//!   or names another file, the anchored file is linked back at the path (a link under a
//!   temporary name, then a rename over the path), so the new process joins the container's
//!   region. An anchor nobody uses is stale: it is removed, and the path is opened as ever.
//! - A running process checks the path every tick ([`keep_path`]) and puts its region back the
//!   same way when the path is missing or names a file nobody uses.
//!
//! A path that names another region in use is left alone ([`PathState::Contested`]): two regions
//! in use at once cannot be merged here, and replacing either would orphan its processes. A file
//! written over in place (`cp copy path`) keeps its name and inode: not this module's case.

use std::ffi::OsString;
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sys;

/// What [`keep_path`] or [`restore_before_open`] found at the region's path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathState {
    /// The path names the region (or there is no anchored region in use to put back).
    Intact,
    /// The path was missing (`replaced: false`) or named a file nobody used (`true`): the
    /// region was linked back at it.
    Restored { replaced: bool },
    /// The path names another region that processes use: left as it is.
    Contested,
    /// The region has no name left to link back from (its file and its anchor were deleted, or
    /// linking failed): processes starting now do not see it.
    Lost,
}

/// How an anchor's name starts.
const ANCHOR_PREFIX: &[u8] = b".vgpu-anchor-";
/// How the name of a restore's temporary link starts (it lives for a moment).
const RESTORE_PREFIX: &str = ".vgpu-restore-";

/// The anchor of the region file at `path`; `None` for a path without a file name.
pub fn anchor_path(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?;
    let mut anchor = ANCHOR_PREFIX.to_vec();
    anchor.extend(
        name.as_bytes()
            .iter()
            .map(|&byte| if byte == b'.' { b'_' } else { byte }),
    );
    Some(path.with_file_name(OsString::from_vec(anchor)))
}

/// Whether a file name is one this module gives (an anchor, or a restore's temporary link): a
/// second name of a region listed under its own, for tools that list a folder of regions.
pub fn is_anchor_name(name: &std::ffi::OsStr) -> bool {
    name.as_bytes().starts_with(ANCHOR_PREFIX) || name.as_bytes().starts_with(RESTORE_PREFIX.as_bytes())
}

fn same_file(a: &Metadata, b: &Metadata) -> bool {
    a.dev() == b.dev() && a.ino() == b.ino()
}

/// Whether `metadata`, of the file at `path`, has exactly two names, the other one its anchor.
pub fn is_anchored(path: &Path, metadata: &Metadata) -> bool {
    metadata.nlink() == 2
        && anchor_path(path)
            .and_then(|anchor| std::fs::symlink_metadata(anchor).ok())
            .is_some_and(|anchor| anchor.file_type().is_file() && same_file(&anchor, metadata))
}

/// Whether processes use the open region file: they hold its shared `flock` (this process too,
/// if it does: a new description conflicts with its own).
fn in_use(file: &File) -> bool {
    !matches!(sys::flock(file, libc::LOCK_EX | libc::LOCK_NB), Ok(true))
}

fn open_plain(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}

/// A fresh name beside `path` for a link that is renamed over it at once.
fn temporary_beside(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "{RESTORE_PREFIX}{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    path.with_file_name(name)
}

/// Makes `path` name the open file `file`, replacing whatever is there, atomically.
fn link_over(file: &File, path: &Path) -> io::Result<()> {
    let temporary = temporary_beside(path);
    sys::link_open_file(file, &temporary)?;
    std::fs::rename(&temporary, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&temporary);
    })
}

/// Before opening `path`: puts the anchored region back at the path when it is in use and the
/// path no longer names it; removes an anchor nobody uses. `accept` says whether the anchored
/// file may be used at all (its owner, as the path's own file is checked).
pub(crate) fn restore_before_open(path: &Path, accept: impl Fn(&File) -> bool) -> PathState {
    let Some(anchor) = anchor_path(path) else {
        return PathState::Intact;
    };
    let Ok(anchor_metadata) = std::fs::symlink_metadata(&anchor) else {
        return PathState::Intact;
    };
    let at_path = std::fs::symlink_metadata(path).ok();
    if !anchor_metadata.file_type().is_file()
        || at_path
            .as_ref()
            .is_some_and(|metadata| same_file(metadata, &anchor_metadata))
    {
        return PathState::Intact;
    }
    let Ok(anchored) = open_plain(&anchor) else {
        return PathState::Intact;
    };
    if !accept(&anchored) {
        return PathState::Intact;
    }
    if !in_use(&anchored) {
        // Stale: the region it kept is nobody's any more (the path's file, if any, is opened as
        // ever). Removed only while it still names the file checked.
        if std::fs::symlink_metadata(&anchor).is_ok_and(|now| same_file(&now, &anchor_metadata)) {
            let _ = std::fs::remove_file(&anchor);
        }
        return PathState::Intact;
    }
    replace_path(path, &anchored, at_path.is_some())
}

/// Puts `region` back at `path` unless the path names another region in use.
fn replace_path(path: &Path, region: &File, occupied: bool) -> PathState {
    if occupied && open_plain(path).is_ok_and(|other| in_use(&other)) {
        return PathState::Contested;
    }
    match link_over(region, path) {
        Ok(()) => PathState::Restored { replaced: occupied },
        Err(_) => PathState::Lost,
    }
}

/// A running process's check: makes `path` name its region `file` again when it no longer does
/// (and the path's file, if any, is nobody's), and keeps the anchor naming it.
pub(crate) fn keep_path(path: &Path, file: &File) -> PathState {
    let Ok(ours) = file.metadata() else {
        return PathState::Intact;
    };
    let at_path = std::fs::symlink_metadata(path).ok();
    if at_path.as_ref().is_some_and(|metadata| same_file(metadata, &ours)) {
        ensure_anchor(path, file);
        return PathState::Intact;
    }
    let state = if ours.nlink() == 0 {
        PathState::Lost
    } else {
        replace_path(path, file, at_path.is_some())
    };
    if matches!(state, PathState::Restored { .. }) {
        ensure_anchor(path, file);
    }
    state
}

/// Makes the anchor name the region `file` (opened at `path`): links it when missing, replaces an
/// anchor of a region nobody uses. Best effort: without an anchor the region only loses this
/// protection.
pub(crate) fn ensure_anchor(path: &Path, file: &File) {
    let (Some(anchor), Ok(ours)) = (anchor_path(path), file.metadata()) else {
        return;
    };
    match std::fs::symlink_metadata(&anchor) {
        Ok(metadata) if same_file(&metadata, &ours) => {}
        Ok(metadata) if metadata.file_type().is_file() => {
            if open_plain(&anchor).is_ok_and(|other| !in_use(&other)) {
                let _ = link_over(file, &anchor);
            }
        }
        // Something else under that name (a folder, a link): not ours to remove.
        Ok(_) => {}
        Err(_) => {
            let _ = sys::link_open_file(file, &anchor);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_anchor_is_hidden_beside_the_file_without_its_dots() {
        assert_eq!(
            anchor_path(Path::new("/tmp/cudevshr.cache")),
            Some(PathBuf::from("/tmp/.vgpu-anchor-cudevshr_cache"))
        );
        assert_eq!(
            anchor_path(Path::new("region")),
            Some(PathBuf::from(".vgpu-anchor-region"))
        );
        assert_eq!(anchor_path(Path::new("/")), None);
        let anchor = anchor_path(Path::new("/x/a.b.cache")).expect("a name");
        let name = anchor.file_name().expect("a name");
        assert!(is_anchor_name(name) && !name.to_string_lossy().contains(".cache"));
        let temporary = temporary_beside(Path::new("/x/a.cache"));
        assert!(is_anchor_name(temporary.file_name().expect("a name")));
        assert!(!is_anchor_name(std::ffi::OsStr::new("a.cache")));
    }
}
