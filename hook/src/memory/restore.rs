//! Puts this process's charges back into the region when a writer changed them under it: a copy
//! of an older image over the live file (`cp`, a restored backup) keeps the file's inode, so the
//! region's anchor (which puts back a deleted or replaced file) cannot see it, and the copy can
//! erase the process's slot or lower its charges: the container could then allocate past its limit
//! and the charges would be lost for good. The library's tick compares the slot with the ledger
//! (what this process knows it holds) and makes the region hold at least that
//! ([`vgpu_region::Region::keep_slot`]).
//!
//! The ledger lags behind the slot while a call is under way (charged first, recorded after the
//! driver; released from the ledger first), never runs ahead of it, so a slot below the ledger was
//! lowered by someone else. Even so a lowered charge is raised only when it is still lowered a
//! moment later ([`CONFIRM_AFTER`]) with the same ledger; a slot that is no longer the process's
//! is taken back at once (no call of its own can cause that).

use std::time::Duration;

use vgpu_region::SlotKept;

use super::accounting::accounting;
use crate::session;

/// How long a lowered charge must stay lowered, with the ledger unchanged, before it is raised: far
/// longer than any step of a call between its region update and its ledger's.
const CONFIRM_AFTER: Duration = Duration::from_millis(100);

/// From the library's tick: compares the slot with the ledger and repairs the slot when a writer
/// changed it (see the module's documentation).
pub fn tick() {
    let Some(accounting) = accounting() else { return };
    if session::detached() {
        return;
    }
    let Some(slot) = accounting.slot() else { return };
    let Some(held) = accounting.held() else { return };
    let region = accounting.region();
    match region.slot_differs(slot, &held) {
        SlotKept::Intact => return,
        SlotKept::Raised(_) => {
            std::thread::sleep(CONFIRM_AFTER);
            let still =
                accounting.held() == Some(held) && matches!(region.slot_differs(slot, &held), SlotKept::Raised(_));
            if !still {
                return;
            }
        }
        SlotKept::Restored(_) | SlotKept::TakenBy(_) => {}
    }
    // A process giving its slot back at exit must not take it again.
    if session::detached() || crate::exit::exiting() {
        return;
    }
    let start_time = vgpu_region::process_start_time(slot.pid()).unwrap_or(0);
    let path = region.path().display();
    match region.keep_slot(slot, start_time, &held) {
        Ok(SlotKept::Intact) => {}
        Ok(SlotKept::Raised(bytes)) => tracing::warn!(
            "the shared region {path} charged this process {bytes} bytes less than it holds (the file was written \
             under it: a copy over it, or a writer); charged again"
        ),
        Ok(SlotKept::Restored(bytes)) => tracing::warn!(
            "the shared region {path} no longer had this process's slot {} (the file was written under it: a copy \
             of another image over it, or a writer); taken back with the {bytes} bytes this process holds",
            slot.index()
        ),
        Ok(SlotKept::TakenBy(pid)) => tracing::error!(
            "the shared region {path} gives this process's slot {} to process {pid}, which is alive: this \
             process's memory is no longer charged there (restart it to attach again)",
            slot.index()
        ),
        Err(error) => tracing::warn!("{error}; this process's slot is checked again at the next tick"),
    }
}
