//! Linear memory, VMM handles, arrays and graph memory nodes: charged at allocation, released at
//! the matching free.

use std::ffi::c_uint;

use vgpu_region::MemoryKind;

use super::accounting::{accounting, unaccounted};
use super::charge::{charged, charged_or, current_context, released, released_or};
use super::ledger::{Charge, Family};
use super::location::device_of;
use super::pool_sync::{charge_or_refuse, sync_pool};
use super::sizes::{ArrayDescriptor, mipmapped_bytes};
use super::spill;
use super::units::{DriverInt, read, write};
use crate::hooks::real;
use crate::session::current_ordinal;
use crate::sys::cuda::*;

/// `cuMemAlloc` and `_v2`.
pub fn alloc<P: DriverInt, S: DriverInt>(call: impl FnOnce() -> CUresult, dptr: *mut P, bytesize: S) -> CUresult {
    if dptr.is_null() || bytesize.to_u64() == 0 {
        return call();
    }
    let bytes = bytesize.to_u64();
    let refused = |status, charged| spilled_into(status, dptr, charged);
    // SAFETY: the driver (or the spill) wrote the pointer on success.
    charged_or(None, MemoryKind::Data, bytes, call, refused, Family::Pointer, || {
        unsafe { read(dptr) }.map(P::to_u64)
    })
}

/// An allocation the limit allowed and the driver refused: when it was out of memory and elastic
/// memory is on, a pointer to host-backed memory written through `dptr` ([`spill`]), charged as
/// a spill; otherwise the driver's answer.
#[cold]
#[inline(never)]
fn spilled_into<P: DriverInt>(status: CUresult, dptr: *mut P, bytes: u64) -> (CUresult, Family) {
    if status != CUDA_ERROR_OUT_OF_MEMORY || !P::WIDE {
        return (status, Family::Pointer);
    }
    let (Some(accounting), Some(ordinal)) = (accounting(), current_ordinal()) else {
        return (status, Family::Pointer);
    };
    match spill::serve(accounting, status, ordinal, bytes) {
        Some(pointer) => {
            // SAFETY: the application's out-pointer, checked non-null by the caller; P is 64-bit.
            unsafe { write(dptr, P::saturating_from(pointer)) };
            (CUDA_SUCCESS, Family::Spill)
        }
        None => (status, Family::Pointer),
    }
}

/// `cuMemAllocPitch` and `_v2`: reserves the width rounded to the pitch alignment times the
/// height, then corrects to the returned pitch times the height.
pub fn alloc_pitch<P: DriverInt, S: DriverInt>(
    call: impl FnOnce() -> CUresult,
    dptr: *mut P,
    p_pitch: *mut S,
    width_in_bytes: S,
    height: S,
) -> CUresult {
    const PITCH_ALIGNMENT: u64 = 512;
    let pitch = p_pitch;
    let (width, height) = (width_in_bytes.to_u64(), height.to_u64());
    let estimate = width
        .checked_next_multiple_of(PITCH_ALIGNMENT)
        .and_then(|w| w.checked_mul(height));
    let (Some(estimate), false) = (estimate, dptr.is_null() || pitch.is_null() || estimate == Some(0)) else {
        return call();
    };
    let Some(accounting) = accounting() else {
        return unaccounted(call);
    };
    let Some(ordinal) = current_ordinal() else {
        return call();
    };
    let charge = match charge_or_refuse(accounting, ordinal, MemoryKind::Data, estimate) {
        Ok(Some(charge)) => charge,
        Ok(None) => return call(),
        Err(status) => return status,
    };
    let result = call();
    if result == CUDA_ERROR_OUT_OF_MEMORY
        && let Some(pointer) = spill::serve(accounting, result, ordinal, estimate)
    {
        // The spill's pitch: the width rounded up to the alignment, as the estimate has it.
        // SAFETY: the application's out-pointers, checked non-null above.
        unsafe {
            write(dptr, P::saturating_from(pointer));
            write(pitch, S::saturating_from(estimate / height));
        }
        accounting
            .ledger()
            .insert_all(Family::Spill, pointer, vec![charge], current_context());
        return CUDA_SUCCESS;
    }
    if result != CUDA_SUCCESS {
        accounting.release(charge);
        return result;
    }
    // SAFETY: the driver wrote both on success.
    let (Some(pointer), Some(actual_pitch)) = (unsafe { read(dptr) }, unsafe { read(pitch) }) else {
        accounting.release(charge);
        return result;
    };
    let actual = actual_pitch.to_u64().saturating_mul(height);
    let mut charges = vec![charge];
    if actual > estimate {
        // Rare: a pitch above our alignment guess. Charge the rest or undo the allocation.
        match accounting.charge(ordinal, MemoryKind::Data, actual - estimate) {
            Ok(extra) => charges.extend(extra),
            Err(status) => {
                accounting.release(charge);
                if let Some(free) = real::cuMemFree_v2() {
                    // SAFETY: frees the allocation the driver just made.
                    unsafe { free(pointer.to_u64()) };
                }
                return status;
            }
        }
    } else if actual < estimate {
        let excess = Charge {
            bytes: estimate - actual,
            ..charge
        };
        accounting.release(excess);
        charges[0].bytes = actual;
    }
    accounting
        .ledger()
        .insert_all(Family::Pointer, pointer.to_u64(), charges, current_context());
    result
}

/// `cuMemAllocManaged`: charged in full; it may all migrate to the device.
pub fn alloc_managed(call: impl FnOnce() -> CUresult, dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    alloc(call, dptr, bytesize)
}

// Stream-ordered pools are charged what they hold physically (their reserved memory), not what
// the application asked for: a pool keeps freed blocks (PyTorch's cudaMallocAsync backend keeps
// them all), and that memory is as taken as any allocation. After every pool operation the pool's
// charge is set to its reserved memory; before an allocation, what the pool may have to add is
// reserved against the limit.

/// Frees a pointer: from a pool (the pool's charge follows its reserved memory) or charged itself.
fn free_pointer(call: impl FnOnce() -> CUresult, pointer: u64) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    match accounting.ledger().take_pool_of(pointer) {
        Some(pool) => free_pooled(accounting, call, pointer, pool),
        // A spilled pointer is charged as a spill of its own, never a pool's.
        None => released_or(Family::Pointer, pointer, call, spill::free),
    }
}

/// Frees a pointer of `pool`'s, taken out of the ledger's pool map: the pool's charge follows its
/// reserved memory, or the pointer goes back to the map when the free failed.
pub(super) fn free_pooled(
    accounting: super::accounting::Accounting,
    call: impl FnOnce() -> CUresult,
    pointer: u64,
    pool: u64,
) -> CUresult {
    let result = call();
    let ordinal = accounting.ledger().pool_device(pool).unwrap_or(0);
    if result == CUDA_SUCCESS {
        sync_pool(accounting, pool, ordinal);
    } else {
        accounting.ledger().set_pool_of(pointer, pool, ordinal);
    }
    result
}

/// `cuMemFree` and `_v2`.
pub fn free<P: DriverInt>(call: impl FnOnce() -> CUresult, dptr: P) -> CUresult {
    free_pointer(call, dptr.to_u64())
}

/// `cuMemCreate`: charged to the device in the allocation's location (a locality domain is
/// part of its device); host locations are not device memory.
pub fn create(
    call: impl FnOnce() -> CUresult,
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
) -> CUresult {
    // SAFETY: the driver requires a valid prop; null is checked.
    let Some(prop) = (unsafe { read(prop) }) else {
        return call();
    };
    let Some(device) = device_of(&prop.location) else {
        return call();
    };
    if handle.is_null() || size == 0 {
        return call();
    }
    // SAFETY: the driver wrote the handle (or the spill did) on success.
    let key = || unsafe { read(handle) };
    let refused = |status, charged| spill::create_on_host(status, handle, charged, &prop, device);
    charged_or(
        Some(device),
        MemoryKind::Data,
        size as u64,
        call,
        refused,
        Family::PhysicalHandle,
        key,
    )
}

/// `cuMemRelease`.
pub fn release(call: impl FnOnce() -> CUresult, handle: CUmemGenericAllocationHandle) -> CUresult {
    let call = match super::accounting::accounting() {
        Some(accounting) => match super::vmm::release_held(accounting, handle, call) {
            Ok(result) => return result,
            Err(call) => call,
        },
        None => call,
    };
    released_or(Family::PhysicalHandle, handle, call, spill::release_handle)
}

/// `cuArrayCreate` and `_v2`.
pub fn array_create<D: ArrayDescriptor>(
    call: impl FnOnce() -> CUresult,
    p_handle: *mut CUarray,
    p_allocate_array: *const D,
) -> CUresult {
    // SAFETY: null is checked; otherwise the driver requires a valid descriptor.
    let Some(bytes) = unsafe { p_allocate_array.as_ref() }.and_then(ArrayDescriptor::bytes) else {
        return call();
    };
    // SAFETY: the driver wrote the handle on success.
    let key = || unsafe { read(p_handle) }.map(|array| array as u64);
    charged(None, MemoryKind::Data, bytes, call, Family::Array, key)
}

/// `cuArray3DCreate` and `_v2`.
pub fn array3d_create<D: ArrayDescriptor>(
    call: impl FnOnce() -> CUresult,
    p_handle: *mut CUarray,
    p_allocate_array: *const D,
) -> CUresult {
    array_create(call, p_handle, p_allocate_array)
}

/// `cuArrayDestroy`.
pub fn array_destroy(call: impl FnOnce() -> CUresult, h_array: CUarray) -> CUresult {
    released(Family::Array, h_array as u64, call)
}

/// `cuMipmappedArrayCreate`.
pub fn mipmapped_array_create(
    call: impl FnOnce() -> CUresult,
    p_handle: *mut CUmipmappedArray,
    p_mipmapped_array_desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    num_mipmap_levels: c_uint,
) -> CUresult {
    // SAFETY: null is checked; otherwise the driver requires a valid descriptor.
    let Some(bytes) = unsafe { p_mipmapped_array_desc.as_ref() }.and_then(|d| mipmapped_bytes(d, num_mipmap_levels))
    else {
        return call();
    };
    // SAFETY: the driver wrote the handle on success.
    let key = || unsafe { read(p_handle) }.map(|h| h as u64);
    charged(None, MemoryKind::Data, bytes, call, Family::MipmappedArray, key)
}

/// `cuMipmappedArrayDestroy`.
pub fn mipmapped_array_destroy(call: impl FnOnce() -> CUresult, h_mipmapped_array: CUmipmappedArray) -> CUresult {
    released(Family::MipmappedArray, h_mipmapped_array as u64, call)
}
