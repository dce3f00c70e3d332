//! VMM memory's life beyond its handle. The driver frees a `cuMemCreate` allocation once its
//! handle's last reference is released (`cuMemRelease`: one reference for the create and one for
//! each `cuMemRetainAllocationHandle`) and its last mapping is gone (`cuMemUnmap`,
//! `cuMemAddressFree`), in either order: the CUDA samples release the handle right after mapping
//! it, and NCCL retains a handle from a pointer and releases it while the memory is in use. The
//! charge follows the memory:
//!
//! - a release of a handle that was retained only drops a reference;
//! - a release of a handle's last reference while it is mapped moves its charge from the handle
//!   (whose value the driver may give to a new allocation) to an id of its own
//!   ([`Family::ReleasedMapped`]), released with the last of its mappings.
//!
//! Only charged handles are followed (the ledger's [`Family::PhysicalHandle`] and
//! [`Family::SpillHandle`]); a handle imported from another process is charged there.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::accounting::{Accounting, accounting};
use super::ledger::{Charges, Family};
use super::spill;
use crate::sys::cuda::*;

/// What keeps a charged allocation alive besides its handle's first reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// The handle, by its ledger family and value.
    Handle(Family, u64),
    /// The allocation whose handle was released while mapped, by its [`Family::ReleasedMapped`]
    /// id.
    Released(u64),
}

#[derive(Default)]
struct State {
    /// References taken by `cuMemRetainAllocationHandle` and not yet released, per handle.
    retained: HashMap<(Family, u64), u32>,
    /// Mappings of charged allocations: start address -> (bytes, the allocation).
    mappings: BTreeMap<u64, (u64, Holder)>,
    /// Per released allocation, the family its handle was charged under.
    released: HashMap<u64, Family>,
    next_id: u64,
}

impl State {
    fn mapped(&self, holder: Holder) -> bool {
        self.mappings.values().any(|&(_, mapped)| mapped == holder)
    }
}

/// This process's VMM allocations that are retained or mapped.
#[derive(Default)]
pub struct Lifetimes {
    state: Mutex<State>,
    /// Whether `state` may hold anything (a release's one load when VMM is not used).
    any: AtomicBool,
}

/// The ledger family a handle is charged under, if it is.
fn charged_family(accounting: Accounting, handle: u64) -> Option<Family> {
    [Family::PhysicalHandle, Family::SpillHandle]
        .into_iter()
        .find(|&family| accounting.ledger().contains(family, handle))
}

/// `cuMemMap`: a mapping of a charged handle keeps its memory charged until it is unmapped.
pub fn map(
    call: impl FnOnce() -> CUresult,
    ptr: CUdeviceptr,
    size: usize,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    let result = call();
    if result != CUDA_SUCCESS {
        return result;
    }
    if let Some(accounting) = accounting()
        && let Some(family) = charged_family(accounting, handle)
    {
        let lifetimes = accounting.vmm();
        lifetimes.any.store(true, Ordering::Release);
        lifetimes
            .state
            .lock()
            .mappings
            .insert(ptr, (size as u64, Holder::Handle(family, handle)));
    }
    result
}

/// `cuMemUnmap`: the mappings in the range go; an allocation whose handle was released goes with
/// its last mapping, and its charge with it.
pub fn unmap(call: impl FnOnce() -> CUresult, ptr: CUdeviceptr, size: usize) -> CUresult {
    unmapped(call, ptr, size)
}

/// `cuMemAddressFree`: as [`unmap`] for whatever is still mapped in the range.
pub fn address_free(call: impl FnOnce() -> CUresult, ptr: CUdeviceptr, size: usize) -> CUresult {
    unmapped(call, ptr, size)
}

fn unmapped(call: impl FnOnce() -> CUresult, ptr: CUdeviceptr, size: usize) -> CUresult {
    let result = call();
    if result != CUDA_SUCCESS {
        return result;
    }
    let Some(accounting) = accounting() else { return result };
    let lifetimes = accounting.vmm();
    if !lifetimes.any.load(Ordering::Acquire) {
        return result;
    }
    let freed: Vec<(Family, Charges)> = {
        let mut state = lifetimes.state.lock();
        let end = ptr.saturating_add(size as u64);
        let inside: Vec<u64> = state.mappings.range(ptr..end).map(|(start, _)| *start).collect();
        let mut freed = Vec::new();
        for start in inside {
            let Some((_, holder)) = state.mappings.remove(&start) else {
                continue;
            };
            if let Holder::Released(id) = holder
                && !state.mapped(holder)
                && let Some(family) = state.released.remove(&id)
                && let Some((charges, _)) = accounting.ledger().take_charges(Family::ReleasedMapped, id)
            {
                freed.push((family, charges));
            }
        }
        freed
    };
    for (family, charges) in freed {
        release_charges(accounting, family, &charges);
    }
    result
}

/// `cuMemRetainAllocationHandle`: one more reference to a charged handle, which its release only
/// drops.
pub fn retain(call: impl FnOnce() -> CUresult, handle: *mut CUmemGenericAllocationHandle) -> CUresult {
    let result = call();
    if result != CUDA_SUCCESS || handle.is_null() {
        return result;
    }
    // SAFETY: the driver wrote the handle on success; the out-pointer is the application's,
    // checked non-null.
    let value = unsafe { handle.read() };
    if let Some(accounting) = accounting()
        && let Some(family) = charged_family(accounting, value)
    {
        let lifetimes = accounting.vmm();
        lifetimes.any.store(true, Ordering::Release);
        *lifetimes.state.lock().retained.entry((family, value)).or_default() += 1;
    }
    result
}

/// `cuMemRelease` of a handle that a retain or a mapping still holds: `Some` with the driver's
/// answer when that was so (the charge stays, or moves to the mappings), `None` for a release
/// that frees the memory, which the caller handles as before.
pub(super) fn release_held<C: FnOnce() -> CUresult>(
    accounting: Accounting,
    handle: u64,
    call: C,
) -> Result<CUresult, C> {
    let lifetimes = accounting.vmm();
    if !lifetimes.any.load(Ordering::Acquire) {
        return Err(call);
    }
    let mut state = lifetimes.state.lock();
    let Some(family) = charged_family(accounting, handle) else {
        return Err(call);
    };
    let key = (family, handle);
    if let Some(references) = state.retained.get_mut(&key) {
        let result = call();
        if result == CUDA_SUCCESS {
            *references -= 1;
            if *references == 0 {
                state.retained.remove(&key);
            }
        }
        return Ok(result);
    }
    let holder = Holder::Handle(family, handle);
    if !state.mapped(holder) {
        return Err(call);
    }
    let result = call();
    if result == CUDA_SUCCESS
        && let Some((charges, owner)) = accounting.ledger().take_charges(family, handle)
    {
        let id = state.next_id;
        state.next_id += 1;
        accounting.ledger().put_back(Family::ReleasedMapped, id, charges, owner);
        state.released.insert(id, family);
        for (_, mapped) in state.mappings.values_mut() {
            if *mapped == holder {
                *mapped = Holder::Released(id);
            }
        }
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
