//! A consistent copy of a live region: the one seqlock reader of the project. `Region::snapshot`
//! and `vgpu-smi` both decode such a copy ([`crate::read_snapshot`]), so a torn slot is judged
//! the same way everywhere.

use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use crate::layout::{
    COMPUTE_OFFSET, ComputeDevice, EXTENSION_OFFSET, HOST_BACKED_OFFSET, MAX_DEVICES, MAX_SLOTS, ProcSlot,
    REGION_FILE_SIZE, RegionFile, SLOT_EXTENSIONS_OFFSET, SharedRegion, SlotExtension,
};

/// How often a slot that a writer changed during the copy is copied again before it is reported
/// as torn (a writer holds a slot for well under a microsecond).
pub const SEQLOCK_READ_ATTEMPTS: u32 = 64;

/// Bytes of the region file covered by one slot and by one slot extension.
const SLOT_BYTES: usize = size_of::<ProcSlot>();
const SLOT_EXTENSION_BYTES: usize = size_of::<SlotExtension>();
/// Where `procs` starts and where the fields after it start.
const PROCS_OFFSET: usize = std::mem::offset_of!(SharedRegion, procs);
const AFTER_PROCS_OFFSET: usize = std::mem::offset_of!(SharedRegion, proc_num);
const PROC_NUM_OFFSET: usize = std::mem::offset_of!(SharedRegion, proc_num);
const SEQLOCK_OFFSET_IN_SLOT: usize = std::mem::offset_of!(ProcSlot, seqlock);

const _: () =
    assert!(PROCS_OFFSET.is_multiple_of(8) && SLOT_BYTES.is_multiple_of(8) && AFTER_PROCS_OFFSET.is_multiple_of(8));
const _: () = assert!(
    EXTENSION_OFFSET.is_multiple_of(8)
        && SLOT_EXTENSIONS_OFFSET.is_multiple_of(8)
        && SLOT_EXTENSION_BYTES.is_multiple_of(8)
);
const _: () = assert!(REGION_FILE_SIZE.is_multiple_of(8));

/// A copy of the region's bytes in which every slot is seqlock-consistent or marked torn (its
/// seqlock left odd). Covers the header, the slots below `proc_num`, the fields after them and
/// the extension's header, its slot entries below `proc_num`, the compute limiter's counters and
/// the host-backed rows below `proc_num`; the rest stays zero (decoding never reads it).
pub fn consistent_copy(region: &RegionFile) -> Vec<u8> {
    let words = region_words(region);
    let mut image = vec![0u8; REGION_FILE_SIZE];
    let raw_proc_num = region.hami.proc_num.load(Ordering::Acquire);
    // An out-of-range count copies no slot and stays in the image for the decoder to report.
    let proc_num = usize::try_from(raw_proc_num)
        .ok()
        .filter(|&count| count <= MAX_SLOTS)
        .unwrap_or(0);
    let seqlocks_before: Vec<u64> = region.hami.procs[..proc_num]
        .iter()
        .map(|slot| slot.seqlock.load(Ordering::Acquire))
        .collect();
    copy_words(words, &mut image, 0, PROCS_OFFSET + proc_num * SLOT_BYTES);
    copy_words(
        words,
        &mut image,
        AFTER_PROCS_OFFSET,
        EXTENSION_OFFSET + SLOT_EXTENSIONS_OFFSET + proc_num * SLOT_EXTENSION_BYTES,
    );
    copy_words(
        words,
        &mut image,
        EXTENSION_OFFSET + COMPUTE_OFFSET,
        EXTENSION_OFFSET + COMPUTE_OFFSET + MAX_DEVICES * size_of::<ComputeDevice>(),
    );
    copy_words(
        words,
        &mut image,
        EXTENSION_OFFSET + HOST_BACKED_OFFSET,
        EXTENSION_OFFSET + HOST_BACKED_OFFSET + proc_num * MAX_DEVICES * size_of::<u64>(),
    );
    fence(Ordering::Acquire);
    for (index, (slot, before)) in region.hami.procs[..proc_num].iter().zip(seqlocks_before).enumerate() {
        let after = slot.seqlock.load(Ordering::Relaxed);
        if before.is_multiple_of(2) && before == after {
            continue;
        }
        copy_slot_again(region, words, &mut image, index);
    }
    // The decoder reads proc_num from the image: it must be the value the copy was made for.
    image[PROC_NUM_OFFSET..PROC_NUM_OFFSET + 4].copy_from_slice(&raw_proc_num.to_le_bytes());
    image
}

/// Copies one slot under its seqlock until a copy is consistent; after the last attempt the
/// image's seqlock is left odd so the decoder reports the slot as torn.
fn copy_slot_again(region: &RegionFile, words: &[AtomicU64], image: &mut [u8], index: usize) {
    let slot = &region.hami.procs[index];
    let start = PROCS_OFFSET + index * SLOT_BYTES;
    for attempt in 0..SEQLOCK_READ_ATTEMPTS {
        if attempt > 0 {
            if attempt < 8 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let before = slot.seqlock.load(Ordering::Acquire);
        copy_words(words, image, start, start + SLOT_BYTES);
        fence(Ordering::Acquire);
        let after = slot.seqlock.load(Ordering::Relaxed);
        if before.is_multiple_of(2) && before == after {
            return;
        }
    }
    let seqlock = start + SEQLOCK_OFFSET_IN_SLOT;
    let odd = slot.seqlock.load(Ordering::Relaxed) | 1;
    image[seqlock..seqlock + 8].copy_from_slice(&odd.to_le_bytes());
}

/// The whole region as 8-byte words.
fn region_words(region: &RegionFile) -> &[AtomicU64] {
    let start: *const AtomicU64 = std::ptr::from_ref(region).cast();
    // SAFETY: RegionFile is REGION_FILE_SIZE bytes (a multiple of 8, asserted above), aligned to 8
    // (it holds AtomicU64 fields), and made only of integers and opaque bytes, so viewing it as
    // atomic words for loads is valid; the borrow keeps the memory alive.
    unsafe { std::slice::from_raw_parts(start, REGION_FILE_SIZE / 8) }
}

/// Copies the words of `[start, end)` (8-aligned byte offsets) into the image with relaxed loads.
fn copy_words(words: &[AtomicU64], image: &mut [u8], start: usize, end: usize) {
    let end = end.min(REGION_FILE_SIZE);
    if start >= end {
        return;
    }
    let (Some(source), Some(destination)) = (words.get(start / 8..end / 8), image.get_mut(start..end)) else {
        return;
    };
    for (word, bytes) in source.iter().zip(destination.chunks_exact_mut(8)) {
        bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
    }
}
