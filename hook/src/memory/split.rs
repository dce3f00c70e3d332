//! Elastic memory's VMM allocations split where the device ends. A `cuMemCreate` that the limit
//! allows and the device cannot back whole (XLA's pool of three quarters of the device is the
//! common one) is made of two allocations: its head on the device, as much as the device has room
//! for beyond the headroom in whole granules, and its tail in host memory the GPU reads in place.
//! The application holds one handle, the head's:
//!
//! - **Mapped side by side.** A `cuMemMap` of the handle over a range that reaches the tail is one
//!   the driver refuses (the range is past the head's end); the refusal is where this module maps
//!   the head's part and the tail's part next to each other, so a map of any other handle runs as
//!   before. `cuMemSetAccess`, `cuMemUnmap` and `cuMemAddressFree` of the whole range reach both
//!   mappings, as they do for any adjacent mappings.
//! - **Held by the library.** The library holds one reference to each part while the application
//!   holds the handle (its create and its retains, counted here) or maps it, and releases both
//!   after the last of those, when the driver frees them. A retain from a mapping of either part
//!   answers the head's handle.
//! - **One allocation to the rest of the library.** Charged once, whole, under
//!   [`Family::SplitHandle`]; the tail's bytes recorded as host-backed. The tail stays in host
//!   memory for as long as the allocation lives (its mappings are the application's).
//! - **Not exported.** A shareable handle stands for one allocation: exporting a split handle is
//!   refused with a warning (the allocation works in its own process). Mappings into sparse arrays
//!   and multicast bindings reach the head only; the driver refuses the tail's offsets there.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::accounting::Accounting;
use super::ledger::Family;
use super::mappings::{Mapping, Mappings};
use super::spill;
use crate::capture::in_relaxed_capture_mode;
use crate::hooks::real;
use crate::sys::cuda::*;

/// A split allocation, by its head's handle.
#[derive(Clone, Copy, Debug)]
struct Split {
    /// The tail's handle (host memory).
    tail: u64,
    head_bytes: u64,
    bytes: u64,
    region_index: usize,
    /// The application's references: its create and its retains, less its releases.
    references: u32,
    /// The application's mappings of it.
    mappings: u32,
}

impl Split {
    fn tail_bytes(&self) -> u64 {
        self.bytes - self.head_bytes
    }
}

#[derive(Default)]
struct State {
    by_head: HashMap<u64, Split>,
    /// The application's mappings of split allocations, of their heads.
    mapped: Mappings,
}

/// This process's split VMM allocations.
#[derive(Default)]
pub struct Splits {
    state: Mutex<State>,
    /// Whether any was ever made (one load on the paths that look for them).
    any: AtomicBool,
}

/// The head's bytes of a split of `bytes` with `room` on the device, in whole device granules,
/// leaving a tail of at least one. Only where the host's granule divides the device's: the
/// application maps at addresses and offsets aligned to the device's granule, and the tail's
/// mapping then starts aligned to the host's.
fn parts(bytes: u64, room: u64, device_granule: u64, host_granule: u64) -> Option<u64> {
    if device_granule == 0 || host_granule == 0 || !device_granule.is_multiple_of(host_granule) {
        return None;
    }
    let tail = bytes.saturating_sub(room).max(device_granule);
    let head = bytes.checked_sub(tail)? / device_granule * device_granule;
    (head > 0).then_some(head)
}

/// The driver's minimum granularity for allocations of `prop` (0 when it does not say).
fn granularity(prop: &CUmemAllocationProp) -> u64 {
    let Some(get) = real::cuMemGetAllocationGranularity() else {
        return 0;
    };
    let mut granule = 0usize;
    // SAFETY: a valid out-pointer to a local and properties of the library's own.
    let status = unsafe { get(&mut granule, prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) };
    if status == CUDA_SUCCESS { granule as u64 } else { 0 }
}

/// The host's granule for a tail made with any of the properties [`spill::create_in_host_memory`]
/// may fall back to: the largest the driver answers (0 when it answers none).
fn host_granularity(prop: &CUmemAllocationProp, device: CUdevice) -> u64 {
    spill::host_properties(prop, spill::host_numa_node(device))
        .iter()
        .map(|(on_host, _)| granularity(on_host))
        .max()
        .unwrap_or(0)
}

/// `cuMemCreate` of `bytes` on `device`, the current context's, that the limit allowed and the
/// device refused: its head on the device as far as there is room and its tail in host memory,
/// the head's handle written to `handle`. The tail's bytes, or `None` where the device has no room
/// for a granule (the caller then makes it in host memory whole).
pub(super) fn create(
    accounting: Accounting,
    handle: *mut CUmemGenericAllocationHandle,
    bytes: u64,
    prop: &CUmemAllocationProp,
    device: CUdevice,
    region_index: usize,
) -> Option<u64> {
    if crate::session::current_ordinal() != Some(device) {
        return None;
    }
    let create = real::cuMemCreate()?;
    let head_bytes = parts(
        bytes,
        spill::device_room()?,
        granularity(prop),
        host_granularity(prop, device),
    )?;
    let mut head: CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-pointer to a local and the application's properties.
    let status = in_relaxed_capture_mode(|| unsafe { create(&mut head, head_bytes as usize, prop, 0) });
    if status != CUDA_SUCCESS {
        return None;
    }
    let mut tail: CUmemGenericAllocationHandle = 0;
    if spill::create_in_host_memory(&mut tail, bytes - head_bytes, prop, device) != CUDA_SUCCESS {
        release_part(head);
        return None;
    }
    let split = Split {
        tail,
        head_bytes,
        bytes,
        region_index,
        references: 1,
        mappings: 0,
    };
    let splits = accounting.splits();
    splits.state.lock().by_head.insert(head, split);
    splits.any.store(true, Ordering::Release);
    // SAFETY: the application's out-pointer, checked non-null by the caller.
    unsafe { handle.write(head) };
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "device {device} has room for {head_bytes} of a VMM allocation of {bytes} bytes within the container's \
             limit: the other {} bytes are made in host memory the GPU reads in place (CUDA_OVERSUBSCRIBE), slower, \
             for as long as it lives; `vgpu-smi` shows the host-backed bytes",
            split.tail_bytes()
        );
    }
    Some(split.tail_bytes())
}

/// A `cuMemMap` the driver refused with `status`: for a split handle whose range reaches its
/// tail, the head's and the tail's parts mapped side by side; any other refusal stands.
#[cold]
#[inline(never)]
pub(super) fn map_refused(
    accounting: Accounting,
    status: CUresult,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    let splits = accounting.splits();
    if !splits.any.load(Ordering::Acquire) {
        return status;
    }
    let (start, size) = (offset as u64, size as u64);
    let split = {
        let mut state = splits.state.lock();
        let Some(split) = state.by_head.get_mut(&handle) else {
            return status;
        };
        let reaches_tail = start
            .checked_add(size)
            .is_some_and(|end| end <= split.bytes && end > split.head_bytes);
        if split.references == 0 || !reaches_tail {
            return status;
        }
        // Counted as mapped while the driver maps it: a release meanwhile leaves the parts alone.
        split.mappings = split.mappings.saturating_add(1);
        *split
    };
    let result = map_parts(ptr, start, size, handle, &split, flags);
    if result == CUDA_SUCCESS {
        note_mapping(accounting, ptr, size, handle, false);
    } else {
        forget_mapping(accounting, handle);
    }
    result
}

/// Maps `start..start + size` of a split allocation at `ptr`: its head's part, then its tail's
/// (the head's undone when the tail's fails).
fn map_parts(ptr: u64, start: u64, size: u64, head: u64, split: &Split, flags: u64) -> CUresult {
    let (Some(map), Some(unmap)) = (real::cuMemMap(), real::cuMemUnmap()) else {
        return CUDA_ERROR_NOT_SUPPORTED;
    };
    let end = start + size;
    let head_mapped = start < split.head_bytes;
    if head_mapped {
        // SAFETY: the application's range, within the head's part of the allocation.
        let mapped = unsafe { map(ptr, (split.head_bytes - start) as usize, start as usize, head, flags) };
        if mapped != CUDA_SUCCESS {
            return mapped;
        }
    }
    let tail_at = ptr + split.head_bytes.saturating_sub(start);
    let tail_from = start.saturating_sub(split.head_bytes);
    let tail_size = end - start.max(split.head_bytes);
    // SAFETY: the rest of the application's range, within the tail's part of the allocation.
    let mapped = unsafe { map(tail_at, tail_size as usize, tail_from as usize, split.tail, flags) };
    if mapped != CUDA_SUCCESS && head_mapped {
        // SAFETY: the head's mapping made just above.
        unsafe { unmap(ptr, (split.head_bytes - start) as usize) };
    }
    mapped
}

/// A mapping the driver made of `handle` that is not followed as a charged handle: counted when
/// the handle is a split one (a range within its head, which the driver maps itself).
pub(super) fn mapped(accounting: Accounting, ptr: CUdeviceptr, size: usize, handle: CUmemGenericAllocationHandle) {
    if accounting.splits().any.load(Ordering::Acquire) {
        note_mapping(accounting, ptr, size as u64, handle, true);
    }
}

/// Records a mapping of a split allocation (`count`: and counts it, unless counted already).
fn note_mapping(accounting: Accounting, ptr: u64, size: u64, head: u64, count: bool) {
    let mut state = accounting.splits().state.lock();
    if let Some(split) = state.by_head.get_mut(&head) {
        if count {
            split.mappings = split.mappings.saturating_add(1);
        }
        state.mapped.insert(ptr, size, head);
        accounting.vmm().watch_unmaps();
    }
}

/// A mapping counted before the driver refused it: uncounted, and the allocation freed when
/// nothing else holds it.
fn forget_mapping(accounting: Accounting, head: u64) {
    let freed = {
        let mut state = accounting.splits().state.lock();
        let Some(split) = state.by_head.get_mut(&head) else {
            return;
        };
        split.mappings = split.mappings.saturating_sub(1);
        if split.mappings > 0 || split.references > 0 {
            return;
        }
        state.by_head.remove(&head)
    };
    if let Some(split) = freed {
        free(accounting, head, split);
    }
}

/// Before a `cuMemUnmap` (or `cuMemAddressFree`) of `ptr..end`: the split allocations' mappings
/// the driver is asked to unmap.
#[inline]
pub(super) fn mappings_in(accounting: Accounting, ptr: u64, end: u64) -> Vec<(u64, Mapping)> {
    let splits = accounting.splits();
    if !splits.any.load(Ordering::Acquire) {
        return Vec::new();
    }
    splits.state.lock().mapped.within(ptr, end)
}

/// After that unmap worked: those mappings go, and an allocation the application no longer holds
/// is freed with its last mapping.
pub(super) fn unmapped(accounting: Accounting, unmapped: Vec<(u64, Mapping)>) {
    if unmapped.is_empty() {
        return;
    }
    let freed: Vec<(u64, Split)> = {
        let mut state = accounting.splits().state.lock();
        let mut freed = Vec::new();
        for (start, mapping) in unmapped {
            state.mapped.forget(start, &mapping);
            let head = mapping.of;
            let Some(split) = state.by_head.get_mut(&head) else {
                continue;
            };
            split.mappings = split.mappings.saturating_sub(1);
            if split.mappings == 0
                && split.references == 0
                && let Some(split) = state.by_head.remove(&head)
            {
                freed.push((head, split));
            }
        }
        freed
    };
    for (head, split) in freed {
        free(accounting, head, split);
    }
}

/// `cuMemRelease` of a split handle: one of the application's references dropped, and the
/// allocation freed with the last when nothing maps it. `None` for any other handle.
pub(super) fn release(accounting: Accounting, handle: u64) -> Option<CUresult> {
    let splits = accounting.splits();
    if !splits.any.load(Ordering::Acquire) {
        return None;
    }
    let freed = {
        let mut state = splits.state.lock();
        let split = state.by_head.get_mut(&handle)?;
        if split.references == 0 {
            // Released already; only a retain gives it a handle again.
            return Some(CUDA_ERROR_INVALID_VALUE);
        }
        split.references -= 1;
        if split.references > 0 || split.mappings > 0 {
            return Some(CUDA_SUCCESS);
        }
        state.by_head.remove(&handle)?
    };
    free(accounting, handle, freed);
    Some(CUDA_SUCCESS)
}

/// After a `cuMemRetainAllocationHandle` at `addr` that worked and answered `value`: at a
/// mapping of a split allocation, the application holds one more reference to it and gets its
/// head's handle (the driver's reference to the part is dropped: the library holds its own).
pub(super) fn retained(accounting: Accounting, handle: *mut CUmemGenericAllocationHandle, value: u64, addr: u64) {
    let splits = accounting.splits();
    if !splits.any.load(Ordering::Acquire) {
        return;
    }
    let head = {
        let mut state = splits.state.lock();
        let Some(head) = state.mapped.at(addr) else { return };
        let Some(split) = state.by_head.get_mut(&head) else {
            return;
        };
        split.references = split.references.saturating_add(1);
        head
    };
    release_part(value);
    // SAFETY: the application's out-pointer, which the driver wrote (checked non-null by the
    // caller).
    unsafe { handle.write(head) };
}

/// `cuMemExportToShareableHandle`: refused for a split handle, whose memory is two allocations.
pub fn export(call: impl FnOnce() -> CUresult, handle: CUmemGenericAllocationHandle) -> CUresult {
    let split = super::accounting::accounting().is_some_and(|accounting| {
        let splits = accounting.splits();
        splits.any.load(Ordering::Acquire) && splits.state.lock().by_head.contains_key(&handle)
    });
    if !split {
        return call();
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "cuMemExportToShareableHandle of a VMM allocation split between the device and host memory \
             (CUDA_OVERSUBSCRIBE): refused, a shareable handle stands for one allocation"
        );
    }
    CUDA_ERROR_NOT_SUPPORTED
}

/// Releases the library's references to a split allocation's parts (the driver frees them, as
/// nothing maps them any longer), its charge and its host-backed bytes.
fn free(accounting: Accounting, head: u64, split: Split) {
    // The charge is taken before the parts go: the driver may give the head's handle value to a
    // new allocation as soon as it is released, charged under the same key.
    let charges = accounting.ledger().take_charges(Family::SplitHandle, head);
    {
        let _in_flight = accounting.in_flight(split.region_index);
        release_part(head);
        release_part(split.tail);
    }
    for charge in charges.iter().flat_map(|(charges, _)| charges.iter()) {
        accounting.release(*charge);
    }
    spill::record_host_backed(accounting, split.region_index, split.tail_bytes(), false);
}

fn release_part(handle: u64) {
    if let Some(release) = real::cuMemRelease() {
        // SAFETY: a handle the library holds a reference to.
        let status = unsafe { release(handle) };
        if status != CUDA_SUCCESS {
            tracing::warn!("cuMemRelease of a part of a split VMM allocation failed (status {status})");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parts;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_head_is_the_room_in_whole_granules_and_leaves_a_tail() {
        // (bytes, room, device granule, host granule) -> head
        let cases = [
            ((100 * MIB, 41 * MIB, 2 * MIB, 2 * MIB), Some(40 * MIB)),
            ((100 * MIB, 500 * MIB, 2 * MIB, 2 * MIB), Some(98 * MIB)),
            ((100 * MIB, 100 * MIB, 2 * MIB, 2 * MIB), Some(98 * MIB)),
            ((100 * MIB, MIB, 2 * MIB, 2 * MIB), None),
            ((2 * MIB, 100 * MIB, 2 * MIB, 2 * MIB), None),
            ((100 * MIB, 41 * MIB, 4 * MIB, 2 * MIB), Some(40 * MIB)),
            ((100 * MIB, 41 * MIB, 2 * MIB, 4 * MIB), None),
            ((100 * MIB, 41 * MIB, 0, 0), None),
            ((100 * MIB, 41 * MIB, 2 * MIB, 0), None),
            (
                (u64::MAX, u64::MAX, 2 * MIB, 2 * MIB),
                Some((u64::MAX - 2 * MIB) / (2 * MIB) * (2 * MIB)),
            ),
        ];
        for ((bytes, room, device, host), head) in cases {
            assert_eq!(parts(bytes, room, device, host), head, "{bytes} {room} {device} {host}");
        }
    }
}
