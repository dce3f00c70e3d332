//! Stream-ordered pools are charged what they hold physically (their reserved memory), not what
//! the application asked for: a pool keeps freed blocks (PyTorch's cudaMallocAsync backend keeps
//! them all), and that memory is as taken as any allocation. After every pool operation the pool's
//! charge is set to its reserved memory; before a refusal, every pool's charge is brought up to
//! date (pools give memory back at synchronisations we do not see).

use vgpu_region::MemoryKind;

use super::accounting::Accounting;
use super::ledger::{Charge, Family};
use crate::capture::in_relaxed_capture_mode;
use crate::hooks::real;
use crate::sys::cuda::*;

/// Charges against the limit; before refusing, frees the spills whose stream-ordered frees their
/// streams have passed, brings pool charges up to date (pools give memory back at
/// synchronisations we do not see) and tries once more. Graph memory grows at graph launches,
/// which are not followed: on a device with graphs it is brought up to date first.
pub fn charge_or_refuse(
    accounting: Accounting,
    ordinal: CUdevice,
    kind: MemoryKind,
    bytes: u64,
) -> Result<Option<Charge>, CUresult> {
    if accounting.ledger().has_pools() && accounting.ledger().has_graph_memory(ordinal) {
        sync_graph_pool(accounting, ordinal);
    }
    accounting.charge(ordinal, kind, bytes).or_else(|status| {
        let spills_freed = super::spill::collect(accounting);
        let pools = accounting.ledger().has_pools();
        if !pools && !spills_freed {
            return Err(status);
        }
        if pools {
            sync_pools(accounting);
        }
        accounting.charge(ordinal, kind, bytes)
    })
}

/// Pools grow by at least this much.
pub(super) const POOL_GROWTH_GRANULARITY: u64 = 2 << 20;

/// A pool's attribute, asked in relaxed capture mode: the query is a potentially unsafe call,
/// refused (and fatal to the capture) while any thread captures in global mode.
pub(super) fn pool_attribute(pool: CUmemoryPool, attribute: CUmemPool_attribute) -> Option<u64> {
    let get_attribute = real::cuMemPoolGetAttribute()?;
    let mut value: u64 = 0;
    // SAFETY: both attributes asked for here are 64-bit values written into a local.
    let status = in_relaxed_capture_mode(|| unsafe { get_attribute(pool, attribute, (&mut value as *mut u64).cast()) });
    (status == CUDA_SUCCESS).then_some(value)
}

pub(super) fn device_pool(ordinal: CUdevice) -> Option<CUmemoryPool> {
    let get_pool = real::cuDeviceGetMemPool()?;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    (unsafe { get_pool(&mut pool, ordinal) } == CUDA_SUCCESS && !pool.is_null()).then_some(pool)
}

/// Sets a pool's charge to what it has reserved now.
pub(super) fn sync_pool(accounting: Accounting, pool: u64, ordinal: CUdevice) {
    let Some(reserved) = pool_attribute(pool as CUmemoryPool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) else {
        return;
    };
    if let Some((charges, _)) = accounting.ledger().take_charges(Family::Pool, pool) {
        charges.iter().for_each(|charge| accounting.release(*charge));
    }
    if reserved > 0
        && let Some(charge) = accounting.record(ordinal, MemoryKind::Data, reserved)
    {
        accounting.ledger().insert(Family::Pool, pool, charge);
    }
}

/// Brings every pool's charge, and every device's graph memory, up to date (pools return memory
/// at synchronisation, which is not hooked): before a refusal, so stale pool charges never cause
/// one.
pub(super) fn sync_pools(accounting: Accounting) {
    for (pool, ordinal) in accounting.ledger().pools() {
        sync_pool(accounting, pool, ordinal);
    }
    sync_graph_pools(accounting);
}

/// Brings every device's graph memory up to date.
pub(super) fn sync_graph_pools(accounting: Accounting) {
    for ordinal in accounting.ledger().graph_devices() {
        sync_graph_pool(accounting, ordinal);
    }
}

/// What the device holds for this process's graphs, asked in relaxed capture mode (as a pool's
/// attribute is).
fn graph_memory_reserved(ordinal: CUdevice) -> Option<u64> {
    let get_attribute = real::cuDeviceGetGraphMemAttribute()?;
    let mut value: u64 = 0;
    // SAFETY: the attribute is a 64-bit value written into a local.
    let status = in_relaxed_capture_mode(|| unsafe {
        get_attribute(
            ordinal,
            CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
            (&mut value as *mut u64).cast(),
        )
    });
    (status == CUDA_SUCCESS).then_some(value)
}

/// Sets a device's graph memory charge: what the device holds for graphs (from their first
/// launch until a trim, whether or not the graph or its executable still exists) beyond what
/// live graphs' allocation nodes are charged already, so that the two together are the larger
/// of what the graphs were promised and what the device holds. One thread at a time; a new
/// charge is recorded before the old one is released, so the device is never under-charged in
/// between.
pub(super) fn sync_graph_pool(accounting: Accounting, ordinal: CUdevice) {
    let ledger = accounting.ledger();
    let _one_at_a_time = ledger.graph_sync();
    let (Some(reserved), Some(device)) = (graph_memory_reserved(ordinal), accounting.device(ordinal)) else {
        return;
    };
    let beyond = reserved.saturating_sub(ledger.graph_bytes(device.region_index));
    let old = ledger.take_charges(Family::GraphPool, ordinal as u64);
    let old_bytes: u64 = old
        .iter()
        .flat_map(|(charges, _)| charges.iter())
        .map(|c| c.bytes)
        .sum();
    if beyond == old_bytes {
        if let Some((charges, owner)) = old {
            ledger.put_back(Family::GraphPool, ordinal as u64, charges, owner);
        }
        return;
    }
    if beyond > 0
        && let Some(charge) = accounting.record(ordinal, MemoryKind::Data, beyond)
    {
        ledger.insert(Family::GraphPool, ordinal as u64, charge);
    }
    for charge in old.iter().flat_map(|(charges, _)| charges.iter()) {
        accounting.release(*charge);
    }
}
