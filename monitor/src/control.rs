//! `vgpu-smi suspend` and `resume`: the `suspend` flag of a slot's vgpu extension, set or cleared
//! with one atomic store. `libvgpu.so` checks it before launches and copies and waits (sleeping)
//! while it is set. The region's lock is never taken; the flag is the only byte written.

use std::path::Path;
use std::sync::atomic::Ordering;

use vgpu_region::{ProcessSnapshot, REGION_FILE_SIZE, SLOT_LIVE, SlotExtension, Snapshot};

use crate::read::{Mapping, SHRANK, consistent_copy, decode, open_regular, shown};

/// Which slots to change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The live slot of this pid (the container's pid; failing that, a slot whose `hostpid` it is).
    Pid(i32),
    /// Every live slot.
    All,
}

/// A slot whose flag was changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Changed {
    pub slot: usize,
    pub pid: i32,
}

/// Sets (`suspend = true`) or clears the flag of the targeted live slots of one region file.
/// Returns the slots changed (possibly none for [`Target::All`]); a pid with no live slot here is
/// an empty list too, so a caller can look through several regions.
pub fn set_suspended(path: &Path, target: Target, suspend: bool) -> Result<Vec<Changed>, String> {
    visit(path, target, Order::Slots, |_, _, extension| {
        extension.suspend.store(u32::from(suspend), Ordering::Release);
        true
    })
}

/// The order [`visit`] takes the targeted slots in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Slots,
    Reversed,
}

/// Calls `act` on each targeted live slot of one region file (the region's snapshot, the slot's, its extension, which
/// `act` may change with atomic stores) in `order`; returns the slots `act` said it changed that
/// still belong to the same process after it. A slot that another process took in between gets
/// its `suspend` flag and `flags` cleared again, as its attach left them, so a newcomer never
/// inherits our stores.
pub fn visit(
    path: &Path,
    target: Target,
    order: Order,
    mut act: impl FnMut(&Snapshot, &ProcessSnapshot, &SlotExtension) -> bool,
) -> Result<Vec<Changed>, String> {
    let fail = |problem: String| format!("{}: {problem}", shown(path));
    let (file, metadata) = open_regular(path, true).map_err(fail)?;
    let len = metadata.len();
    if len < REGION_FILE_SIZE as u64 {
        return Err(fail(format!(
            "it is {len} bytes, too short for the vgpu extension that holds the suspend flag \
             (a HAMi-core region, or truncated)"
        )));
    }
    let mapping = Mapping::new(&file, true).map_err(|error| fail(format!("cannot map it: {error}")))?;
    let region = mapping.region();
    let image = consistent_copy(region);
    if mapping.shrank() {
        return Err(fail(SHRANK.into()));
    }
    let state = decode(&image).map_err(fail)?;
    if state.snapshot.extension.is_none() {
        return Err(fail(
            "it has no valid vgpu extension (a HAMi-core region?): nothing honours a suspend flag there".into(),
        ));
    }
    let live: Vec<_> = state
        .snapshot
        .processes
        .iter()
        .filter(|process| process.status == SLOT_LIVE)
        .collect();
    let mut chosen: Vec<_> = match target {
        Target::All => live,
        Target::Pid(pid) => {
            let by_pid: Vec<_> = live.iter().copied().filter(|process| process.pid == pid).collect();
            if by_pid.is_empty() {
                live.into_iter().filter(|process| process.hostpid == pid).collect()
            } else {
                by_pid
            }
        }
    };
    if order == Order::Reversed {
        chosen.reverse();
    }
    let mut changed = Vec::new();
    for process in chosen {
        let (Some(slot), Some(extension)) = (region.hami.procs.get(process.slot), region.ext.slots.get(process.slot))
        else {
            continue;
        };
        let generation = extension.generation.load(Ordering::Acquire);
        if Some(generation) != process.generation {
            // The slot changed hands since it was read: leave the new owner alone.
            continue;
        }
        if !act(&state.snapshot, process, extension) {
            continue;
        }
        let still_same = extension.generation.load(Ordering::Acquire) == generation
            && slot.pid.load(Ordering::Acquire) == process.pid
            && slot.status.load(Ordering::Acquire) == SLOT_LIVE;
        if still_same {
            changed.push(Changed {
                slot: process.slot,
                pid: process.pid,
            });
        } else {
            // What the newcomer's attach left there.
            extension.suspend.store(0, Ordering::Release);
            extension.flags.store(0, Ordering::Release);
        }
    }
    if mapping.shrank() {
        // The stores past the new end went to zero pages, not to the file.
        return Err(fail(SHRANK.into()));
    }
    Ok(changed)
}
