//! Stream-ordered allocations (`cuMemAllocAsync`, pools) and the calls that change what a pool
//! holds: frees, trims, destruction and synchronisations (see [`super::pool_sync`]).

use vgpu_region::MemoryKind;

use super::accounting::{accounting, unaccounted};
use super::charge::{current_context, released_or};
use super::data::{alloc, free_pooled};
use super::graphs::captured_alloc;
use super::ledger::Family;
use super::pool_sync::{POOL_GROWTH_GRANULARITY, charge_or_refuse, device_pool, pool_attribute, sync_pool, sync_pools};
use super::spill;
use super::units::{read, write};
use crate::capture::{capture_graph, capture_key, in_relaxed_capture_mode};
use crate::session::current_ordinal;
use crate::sys::cuda::*;

fn pooled_alloc(
    call: impl FnOnce() -> CUresult,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
    per_thread: bool,
) -> CUresult {
    let Some(accounting) = accounting() else {
        return unaccounted(call);
    };
    if let Some(graph) = capture_graph(stream, per_thread) {
        // Recorded into the graph as an allocation node: the pool is not touched (the graph's
        // memory comes from the device's graph pool when it runs).
        let ordinal = pool.and_then(|pool| accounting.ledger().pool_device(pool as u64));
        return captured_alloc(
            call,
            accounting,
            capture_key(stream, per_thread),
            graph,
            dptr,
            size,
            ordinal,
        );
    }
    let Some(ordinal) = current_ordinal() else {
        return call();
    };
    let Some(pool) = pool.filter(|pool| !pool.is_null()).or_else(|| device_pool(ordinal)) else {
        return alloc(call, dptr, size);
    };
    if dptr.is_null() || size == 0 {
        return call();
    }
    // The queries before the call (the pool's two attributes, and graph memory or every pool
    // when the charge would be refused) under one relaxed-mode exchange; the application's own
    // call runs in its own mode.
    let provisional = in_relaxed_capture_mode(|| {
        let reserved = pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).unwrap_or(0);
        let in_use = pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT).unwrap_or(0);
        let growth = (size as u64).saturating_sub(reserved.saturating_sub(in_use));
        if growth == 0 {
            return Ok(None);
        }
        let growth = growth
            .div_ceil(POOL_GROWTH_GRANULARITY)
            .saturating_mul(POOL_GROWTH_GRANULARITY);
        charge_or_refuse(accounting, ordinal, MemoryKind::Data, growth)
    });
    let provisional = match provisional {
        Ok(charge) => charge,
        Err(status) => return status,
    };
    let result = call();
    if let Some(charge) = provisional {
        accounting.release(charge);
    }
    if result == CUDA_SUCCESS {
        // SAFETY: the driver wrote the pointer on success.
        if let Some(pointer) = unsafe { read(dptr) } {
            accounting.ledger().set_pool_of(pointer, pool as u64, ordinal);
        }
        sync_pool(accounting, pool as u64, ordinal);
    } else if result == CUDA_ERROR_OUT_OF_MEMORY && spill::enabled() {
        return spilled_from_pool(accounting, result, ordinal, dptr, size as u64);
    }
    result
}

/// A stream-ordered allocation the pool could not back: host-backed memory charged as a spill of
/// its own (not the pool's), freed when its stream reaches the free ([`spill`]).
#[cold]
fn spilled_from_pool(
    accounting: super::accounting::Accounting,
    status: CUresult,
    ordinal: CUdevice,
    dptr: *mut CUdeviceptr,
    bytes: u64,
) -> CUresult {
    let charge = match charge_or_refuse(accounting, ordinal, MemoryKind::Data, bytes) {
        Ok(charge) => charge,
        Err(refused) => return refused,
    };
    let Some(pointer) = spill::serve(accounting, status, ordinal, bytes) else {
        if let Some(charge) = charge {
            accounting.release(charge);
        }
        return status;
    };
    // SAFETY: the application's out-pointer, checked non-null by the caller.
    unsafe { write(dptr, pointer) };
    if let Some(charge) = charge {
        accounting
            .ledger()
            .insert_owned(Family::Spill, pointer, charge, current_context());
    }
    CUDA_SUCCESS
}

/// `cuStreamSynchronize`, `cuCtxSynchronize`, `cuEventSynchronize`: pools return freed memory
/// here, and launched graphs have taken theirs, so their charges are brought up to date
/// (processes without pools or graph memory take the table's fast path, `no_pools`, and never get
/// here; the check stays for a pool made meanwhile).
pub fn synchronized(call: impl FnOnce() -> CUresult) -> CUresult {
    let result = call();
    if let Some(accounting) = accounting() {
        let _ = spill::collect_unless_busy(accounting);
        if accounting.ledger().has_pools() {
            sync_pools(accounting);
        }
    }
    result
}

/// `cuMemAllocAsync` and `_ptsz`: from the current device's pool, or, on a capturing stream,
/// the capture's graph.
pub fn alloc_async(
    call: impl FnOnce() -> CUresult,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    h_stream: CUstream,
    per_thread: bool,
) -> CUresult {
    pooled_alloc(call, dptr, bytesize, None, h_stream, per_thread)
}

/// `cuMemAllocFromPoolAsync` and `_ptsz`.
pub fn alloc_from_pool_async(
    call: impl FnOnce() -> CUresult,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    h_stream: CUstream,
    per_thread: bool,
) -> CUresult {
    pooled_alloc(call, dptr, bytesize, Some(pool), h_stream, per_thread)
}

/// `cuMemFreeAsync` and `_ptsz`: a spilled pointer is freed once its stream reaches the free.
pub fn free_async(
    call: impl FnOnce() -> CUresult,
    dptr: CUdeviceptr,
    h_stream: CUstream,
    per_thread: bool,
) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    if let Some(pool) = accounting.ledger().take_pool_of(dptr) {
        return free_pooled(accounting, call, dptr, pool);
    }
    // Not a pool's: a pointer of cuMemAlloc's, or a spill, which the driver's stream-ordered free
    // does not take.
    released_or(Family::Pointer, dptr, call, |accounting, dptr, call| {
        let stream = if h_stream.is_null() && per_thread {
            crate::capture::STREAM_PER_THREAD as CUstream
        } else {
            h_stream
        };
        spill::free_when_reached(accounting, dptr, stream, call)
    })
}

/// `cuMemPoolTrimTo`: the pool's charge follows what it still holds.
pub fn pool_trim(call: impl FnOnce() -> CUresult, pool: CUmemoryPool) -> CUresult {
    let result = call();
    if result == CUDA_SUCCESS
        && let Some(accounting) = accounting()
        && let Some(ordinal) = accounting.ledger().pool_device(pool as u64)
    {
        sync_pool(accounting, pool as u64, ordinal);
    }
    result
}

/// `cuMemPoolDestroy`: the pool's charge goes with it.
pub fn pool_destroy(call: impl FnOnce() -> CUresult, pool: CUmemoryPool) -> CUresult {
    let result = call();
    if result == CUDA_SUCCESS
        && let Some(accounting) = accounting()
    {
        if let Some((charges, _)) = accounting.ledger().take_charges(Family::Pool, pool as u64) {
            charges.iter().for_each(|charge| accounting.release(*charge));
        }
        accounting.ledger().forget_pool(pool as u64);
    }
    result
}
