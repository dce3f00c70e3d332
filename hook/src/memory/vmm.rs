//! VMM memory's life beyond its handle. The driver frees a `cuMemCreate` allocation once its
//! handle's last reference is released (`cuMemRelease`: one reference for the create and one for
//! each `cuMemRetainAllocationHandle`) and its last mapping is gone (`cuMemUnmap`; freeing the
//! address range with `cuMemAddressFree`, which the library takes as unmapping what is left there),
//! in either order: the CUDA samples release the handle right after mapping it, and NCCL retains a
//! handle from a pointer and releases it while the memory is in use. The charge follows the memory:
//!
//! - a release of a handle that was retained only drops a reference;
//! - a release of a handle's last reference while it is mapped moves its charge from the handle
//!   (whose value the driver may give to a new allocation) to the allocation's id
//!   ([`Family::ReleasedMapped`]), released with the last of its mappings; a retain from one of
//!   those mappings gives it a handle again, and the charge goes back to the handle.
//!
//! Only handles charged here are followed (the ledger's [`Family::PhysicalHandle`] and
//! [`Family::SpillHandle`]); a split allocation's handle ([`Family::SplitHandle`]) is followed by
//! [`split`], which `cuMemMap` (when the driver refuses it), `cuMemUnmap` and
//! `cuMemRetainAllocationHandle` call on from here. A handle imported from another process
//! (`cuMemImportFromShareableHandle`) is not charged here, and the exporter's charge goes when the
//! exporter has released and unmapped it, even while the importer still maps the memory. Mappings
//! into sparse arrays (`cuMemMapArrayAsync`) are not followed: a handle released while mapped
//! there is uncharged at its release.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::accounting::{Accounting, accounting};
use super::ledger::{Charges, Family};
use super::mappings::{Mapping, Mappings};
use super::{spill, split};
use crate::sys::cuda::*;

/// The ledger families of the handles charged here.
const HANDLE_FAMILIES: [Family; 2] = [Family::PhysicalHandle, Family::SpillHandle];

/// A followed allocation: what holds it besides its handle's first reference.
struct Allocation {
    /// The ledger family its charge was made under.
    family: Family,
    /// Its handle while it has one; `None` once released while mapped (its charge is then under
    /// [`Family::ReleasedMapped`] and this allocation's id).
    handle: Option<u64>,
    /// References taken by `cuMemRetainAllocationHandle` and not yet released.
    retained: u32,
    /// Mappings of it.
    mappings: u32,
}

#[derive(Default)]
struct State {
    allocations: HashMap<u64, Allocation>,
    /// Followed allocations by their live handle (family, value).
    by_handle: HashMap<(Family, u64), u64>,
    /// Mappings of followed allocations, of their ids.
    mappings: Mappings,
    next_id: u64,
}

impl State {
    /// The id of the allocation behind a handle charged here, following it from now on.
    fn follow(&mut self, accounting: Accounting, handle: u64) -> Option<u64> {
        let family = HANDLE_FAMILIES
            .into_iter()
            .find(|&family| accounting.ledger().contains(family, handle))?;
        if let Some(&id) = self.by_handle.get(&(family, handle)) {
            return Some(id);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.allocations.insert(
            id,
            Allocation {
                family,
                handle: Some(handle),
                retained: 0,
                mappings: 0,
            },
        );
        self.by_handle.insert((family, handle), id);
        Some(id)
    }

    /// Stops following an allocation nothing holds beyond its handle.
    fn forget_if_unheld(&mut self, id: u64) {
        if let Some(allocation) = self.allocations.get(&id)
            && allocation.retained == 0
            && allocation.mappings == 0
        {
            if let Some(handle) = allocation.handle {
                self.by_handle.remove(&(allocation.family, handle));
            }
            self.allocations.remove(&id);
        }
    }
}

/// This process's VMM allocations that are retained or mapped.
#[derive(Default)]
pub struct Lifetimes {
    state: Mutex<State>,
    /// Whether anything was ever followed here or a split allocation mapped (one load for a
    /// release or unmap in a process that never mapped a handle charged here).
    any: AtomicBool,
}

impl Lifetimes {
    /// Unmaps are looked at from now on (a split allocation was mapped).
    pub(super) fn watch_unmaps(&self) {
        self.any.store(true, Ordering::Release);
    }
}

/// `cuMemMap`: a mapping of a handle charged here keeps its memory charged until it is unmapped;
/// a split handle's range that the driver refuses is mapped part by part ([`split`]).
pub fn map(
    call: impl FnOnce() -> CUresult,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    let result = call();
    let Some(accounting) = accounting() else { return result };
    if result != CUDA_SUCCESS {
        return split::map_refused(accounting, result, ptr, size, offset, handle, flags);
    }
    let lifetimes = accounting.vmm();
    let mut state = lifetimes.state.lock();
    match state.follow(accounting, handle) {
        Some(id) => {
            lifetimes.any.store(true, Ordering::Release);
            state.mappings.insert(ptr, size as u64, id);
            if let Some(allocation) = state.allocations.get_mut(&id) {
                allocation.mappings = allocation.mappings.saturating_add(1);
            }
        }
        None => {
            drop(state);
            split::mapped(accounting, ptr, size, handle);
        }
    }
    result
}

/// `cuMemUnmap`, and `cuMemAddressFree` for whatever is still mapped in its range: the mappings in
/// the range go; an allocation whose handle was released goes with its last mapping, and its
/// charge with it.
pub fn unmap(call: impl FnOnce() -> CUresult, ptr: CUdeviceptr, size: usize) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    let lifetimes = accounting.vmm();
    if !lifetimes.any.load(Ordering::Acquire) {
        return call();
    }
    let end = ptr.saturating_add(size as u64);
    // The mappings the driver is asked to unmap, and the devices whose memory this unmap frees,
    // marked while the driver frees it, as a free's are (a context measured meanwhile must not
    // count it).
    let (unmapping, freeing): (Vec<(u64, Mapping)>, Vec<usize>) = {
        let state = lifetimes.state.lock();
        let unmapping = state.mappings.within(ptr, end);
        let mut in_range: HashMap<u64, u32> = HashMap::new();
        for (_, mapping) in &unmapping {
            *in_range.entry(mapping.of).or_default() += 1;
        }
        let freeing = in_range
            .into_iter()
            .filter(|&(id, count)| {
                state
                    .allocations
                    .get(&id)
                    .is_some_and(|allocation| allocation.handle.is_none() && allocation.mappings <= count)
            })
            .filter_map(|(id, _)| accounting.ledger().first_region_index(Family::ReleasedMapped, id))
            .collect();
        (unmapping, freeing)
    };
    let split_unmapping = split::mappings_in(accounting, ptr, end);
    let _in_flight: Vec<_> = freeing.into_iter().map(|index| accounting.in_flight(index)).collect();
    let result = call();
    if result != CUDA_SUCCESS {
        return result;
    }
    let freed: Vec<(Family, Charges)> = {
        let mut state = lifetimes.state.lock();
        let mut freed = Vec::new();
        for (start, mapping) in unmapping {
            state.mappings.forget(start, &mapping);
            let id = mapping.of;
            let Some(allocation) = state.allocations.get_mut(&id) else {
                continue;
            };
            allocation.mappings = allocation.mappings.saturating_sub(1);
            if allocation.mappings > 0 {
                continue;
            }
            if allocation.handle.is_none() {
                let family = allocation.family;
                state.allocations.remove(&id);
                if let Some((charges, _)) = accounting.ledger().take_charges(Family::ReleasedMapped, id) {
                    freed.push((family, charges));
                }
            } else {
                state.forget_if_unheld(id);
            }
        }
        freed
    };
    for (family, charges) in freed {
        release_charges(accounting, family, &charges);
    }
    split::unmapped(accounting, split_unmapping);
    result
}

/// `cuMemRetainAllocationHandle`: one more reference to the handle of the memory mapped at
/// `addr`, which its release only drops; for memory whose handle was released while mapped, the
/// handle again, and its charge with it.
pub fn retain(
    call: impl FnOnce() -> CUresult,
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut std::ffi::c_void,
) -> CUresult {
    let result = call();
    if result != CUDA_SUCCESS || handle.is_null() {
        return result;
    }
    // SAFETY: the driver wrote the handle on success; the out-pointer is the application's,
    // checked non-null.
    let value = unsafe { handle.read() };
    let Some(accounting) = accounting() else { return result };
    let mut state = accounting.vmm().state.lock();
    let Some(id) = state.mappings.at(addr as u64) else {
        drop(state);
        split::retained(accounting, handle, value, addr as u64);
        return result;
    };
    let Some(allocation) = state.allocations.get_mut(&id) else {
        return result;
    };
    if allocation.handle.is_some() {
        allocation.retained = allocation.retained.saturating_add(1);
        return result;
    }
    let family = allocation.family;
    allocation.handle = Some(value);
    state.by_handle.insert((family, value), id);
    if let Some((charges, owner)) = accounting.ledger().take_charges(Family::ReleasedMapped, id) {
        accounting.ledger().put_back(family, value, charges, owner);
    }
    result
}

/// `cuMemRelease` of a handle that a retain or a mapping still holds: `Ok` with the driver's
/// answer when that was so (the charge stays, or moves to the allocation's mappings), `Err` with
/// the call back for a release that frees the memory, which the caller handles as any release.
pub(super) fn release_held<C: FnOnce() -> CUresult>(
    accounting: Accounting,
    handle: u64,
    call: C,
) -> Result<CUresult, C> {
    let lifetimes = accounting.vmm();
    if !lifetimes.any.load(Ordering::Acquire) {
        return Err(call);
    }
    let (id, family) = {
        let mut state = lifetimes.state.lock();
        let found = HANDLE_FAMILIES
            .into_iter()
            .find_map(|family| state.by_handle.get(&(family, handle)).map(|&id| (id, family)));
        let Some((id, family)) = found else { return Err(call) };
        let Some(allocation) = state.allocations.get(&id) else {
            return Err(call);
        };
        if allocation.retained == 0 && allocation.mappings == 0 {
            state.forget_if_unheld(id);
            return Err(call);
        }
        (id, family)
    };
    // The driver is called outside the lock: nothing it calls back (a profiler's callback) can
    // then wait on it.
    let result = call();
    if result != CUDA_SUCCESS {
        return Ok(result);
    }
    // What holds the allocation now decides, not what held it before the call: another thread
    // may have unmapped it or released a reference meanwhile.
    let mut freed = None;
    {
        let mut state = lifetimes.state.lock();
        match state.allocations.get_mut(&id) {
            Some(allocation) if allocation.retained > 0 => allocation.retained -= 1,
            Some(allocation) if allocation.mappings > 0 => {
                allocation.handle = None;
                state.by_handle.remove(&(family, handle));
                if let Some((charges, owner)) = accounting.ledger().take_charges(family, handle) {
                    accounting.ledger().put_back(Family::ReleasedMapped, id, charges, owner);
                }
            }
            _ => {
                // Unmapped, or its other references released, while the driver released this
                // one: the memory went with this release.
                state.forget_if_unheld(id);
                freed = accounting.ledger().take_charges(family, handle);
            }
        }
    }
    if let Some((charges, _)) = freed {
        release_charges(accounting, family, &charges);
    }
    Ok(result)
}

/// Releases what a freed allocation was charged, and for one made in host memory its host-backed
/// bytes.
fn release_charges(accounting: Accounting, family: Family, charges: &Charges) {
    if family == Family::SpillHandle {
        spill::forget_host_backed(accounting, charges);
    }
    for charge in charges.iter() {
        accounting.release(*charge);
    }
}
