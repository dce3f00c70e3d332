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

/// Charges against the limit; before refusing, brings pool charges up to date (pools give memory
/// back at synchronisations we do not see) and tries once more.
pub fn charge_or_refuse(
    accounting: Accounting,
    ordinal: CUdevice,
    kind: MemoryKind,
    bytes: u64,
) -> Result<Option<Charge>, CUresult> {
    accounting.charge(ordinal, kind, bytes).or_else(|status| {
        if !accounting.ledger().has_pools() {
            return Err(status);
        }
        sync_pools(accounting);
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

/// Brings every pool's charge up to date (pools return memory at synchronisation, which is not
/// hooked): before a refusal, so stale pool charges never cause one.
pub(super) fn sync_pools(accounting: Accounting) {
    for (pool, ordinal) in accounting.ledger().pools() {
        sync_pool(accounting, pool, ordinal);
    }
}
