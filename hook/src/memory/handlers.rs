//! The memory entry points `cuda-api.toml` routes here. Allocations reserve in the shared region
//! first, then call the driver, and roll back if it fails; frees call the driver first and
//! release on success; a handle we never charged goes to the driver untouched. Without accounting
//! (no successful `cuInit`) an allocation under a memory limit is refused
//! ([`unaccounted`]); frees and queries go to the driver.

use std::ffi::c_uint;
use std::time::{Duration, Instant};

use vgpu_region::MemoryKind;

use super::accounting::{Accounting, accounting, unaccounted};
use super::devices::current_ordinal;
use super::ledger::{Charge, Family};
use super::sizes::{ArrayDescriptor, mipmapped_bytes};
use super::units::{DriverInt, read, write};
use crate::hooks::real;
use crate::sys::cuda::*;

/// Reserves `bytes` on `ordinal` (or the current device), calls the driver, and records the charge
/// under the key `key_of` reads back, or rolls it back.
fn charged(
    ordinal: Option<CUdevice>,
    kind: MemoryKind,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    family: Family,
    key_of: impl FnOnce() -> Option<u64>,
) -> CUresult {
    let Some(accounting) = accounting() else {
        return unaccounted(call);
    };
    let Some(ordinal) = ordinal.or_else(current_ordinal) else {
        return call();
    };
    let _in_flight = accounting
        .device(ordinal)
        .map(|device| accounting.in_flight(device.region_index));
    let charge = match charge_or_refuse(accounting, ordinal, kind, bytes) {
        Ok(charge) => charge,
        Err(status) => return status,
    };
    let result = call();
    match (charge, result == CUDA_SUCCESS, key_of()) {
        (Some(charge), true, Some(key)) => accounting.ledger().insert_owned(family, key, charge, owner_of(family)),
        (Some(charge), _, _) => accounting.release(charge),
        (None, _, _) => {}
    }
    result
}

/// Charges against the limit; before refusing, brings pool charges up to date (pools give memory
/// back at synchronisations we do not see) and tries once more.
pub fn charge_or_refuse(
    accounting: &Accounting,
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

/// The context whose destruction frees a handle of this family (0: none does).
fn owner_of(family: Family) -> u64 {
    match family {
        Family::Pointer | Family::Array | Family::MipmappedArray | Family::Module | Family::Library => {
            current_context()
        }
        Family::PhysicalHandle | Family::Context | Family::Graph | Family::Pool => 0,
    }
}

/// The current context, as a key (0: none).
fn current_context() -> u64 {
    let Some(get_current) = real::cuCtxGetCurrent() else {
        return 0;
    };
    let mut context: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    if unsafe { get_current(&mut context) } == CUDA_SUCCESS {
        context as u64
    } else {
        0
    }
}

/// Releases everything the driver freed with a context.
fn release_owned_by(accounting: &Accounting, context: u64) {
    for charge in accounting.ledger().take_owned_by(context) {
        accounting.release(charge);
    }
}

/// Calls the driver to free `key`, then releases what was charged under it if the free worked.
fn released(family: Family, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    let Some((charges, owner)) = accounting.ledger().take_charges(family, key) else {
        return call();
    };
    let _in_flight = charges
        .iter()
        .next()
        .map(|charge| accounting.in_flight(charge.region_index));
    let result = call();
    if result == CUDA_SUCCESS {
        charges.iter().for_each(|charge| accounting.release(*charge));
    } else {
        accounting.ledger().put_back(family, key, charges, owner);
    }
    result
}

/// What NVML says is used on a GPU: in all, and by this process where NVML lists processes (it
/// does not on some VMs, and in a container it lists host pids, which are not ours).
#[derive(Clone, Copy)]
struct NvmlUsage {
    device: u64,
    own: Option<u64>,
}

fn nvml_usage(uuid: &str) -> Option<NvmlUsage> {
    use crate::sys::nvml::{NVML_ERROR_INSUFFICIENT_SIZE, NVML_SUCCESS, nvmlProcessInfo_t};
    let device = crate::nvml::device_handle(uuid)?;
    let device_used = nvml_used(device)?;
    let processes = real::nvmlDeviceGetComputeRunningProcesses_v3()?;
    let mut count: std::ffi::c_uint = 0;
    // SAFETY: a zero count with a null array asks for the count.
    let status = unsafe { processes(device, &mut count, std::ptr::null_mut()) };
    let mut own = None;
    if status == NVML_ERROR_INSUFFICIENT_SIZE || status == NVML_SUCCESS {
        let mut infos = vec![nvmlProcessInfo_t::default(); count as usize + 8];
        let mut capacity = infos.len() as std::ffi::c_uint;
        // SAFETY: the array holds `capacity` entries.
        if unsafe { processes(device, &mut capacity, infos.as_mut_ptr()) } == NVML_SUCCESS {
            let pid = std::process::id();
            own = infos
                .iter()
                .take(capacity as usize)
                .find(|info| info.pid == pid)
                .map(|info| info.usedGpuMemory);
        }
    }
    Some(NvmlUsage {
        device: device_used,
        own,
    })
}

/// Device memory used on a device according to NVML (what the driver really took, whoever asked).
fn nvml_used(device: crate::sys::nvml::nvmlDevice_t) -> Option<u64> {
    use crate::sys::nvml::{NVML_SUCCESS, nvmlMemory_t};
    let memory_info = real::nvmlDeviceGetMemoryInfo()?;
    let mut memory = nvmlMemory_t::default();
    // SAFETY: a handle NVML gave and a local out-pointer.
    (unsafe { memory_info(device, &mut memory) } == NVML_SUCCESS).then_some(memory.used)
}

/// Upper bound for one measured context or module, so a concurrent allocation by another process
/// during the measurement cannot inflate the charge without bound.
const MEASURED_CEILING: u64 = 4 << 30;

/// How long a measurement waits for a moment when no data call of the region is under way. Short:
/// a process killed in the middle of a data call leaves its mark behind, and every later
/// measurement on that device then waits this long before it reads anyway (as without the marks).
const QUIET_WAIT: Duration = Duration::from_millis(50);

/// Runs a call that makes the driver take memory we cannot size beforehand (a context, a
/// module), measuring it with NVML, and records the measured amount (never refused: the driver
/// has already taken it).
fn measured(ordinal: CUdevice, kind: MemoryKind, call: impl FnOnce() -> CUresult) -> (CUresult, Option<Charge>) {
    let Some(accounting) = accounting() else {
        return (unaccounted(call), None);
    };
    let Some(device) = accounting.device(ordinal) else {
        return (call(), None);
    };
    // NVML and the region's total are read as a pair while no data call of the region is under
    // way (its charge and the driver's memory may disagree then): the region's net change over
    // the window, charges less releases, is then exactly what the others made the driver take.
    let pair = || (nvml_usage(&device.uuid), accounting.used(device));
    let quiet = |limit| {
        accounting
            .region()
            .quiet_read(device.region_index, Instant::now() + limit, pair)
    };
    let before = quiet(QUIET_WAIT).unwrap_or_else(pair);
    let result = call();
    if result != CUDA_SUCCESS {
        return (result, None);
    }
    let after = quiet(QUIET_WAIT).unwrap_or_else(pair);
    let taken = match (before, after) {
        // NVML's count for this very process: exact, whatever others do meanwhile.
        (
            (Some(before), _),
            (
                Some(NvmlUsage {
                    own: Some(own_after), ..
                }),
                _,
            ),
        ) => own_after.saturating_sub(before.own.unwrap_or(0)),
        // The GPU's total less the net change of the region's total (other containers and
        // concurrent context creations can still skew it; the cap and the floor bound that).
        ((Some(before), used_before), (Some(after), used_after)) => {
            let gpu = i128::from(after.device) - i128::from(before.device);
            let region = i128::from(used_after) - i128::from(used_before);
            u64::try_from((gpu - region).max(0)).unwrap_or(u64::MAX)
        }
        _ => 0,
    };
    let charge = accounting.record(ordinal, kind, taken.min(MEASURED_CEILING));
    (result, charge)
}

/// Measures what a call that creates a handle (context, module, library) makes the driver take,
/// and records it under the handle the driver wrote.
fn measured_and_recorded<H>(
    ordinal: Option<CUdevice>,
    kind: MemoryKind,
    family: Family,
    call: impl FnOnce() -> CUresult,
    handle: *mut *mut H,
) -> CUresult {
    let Some(ordinal) = ordinal.or_else(current_ordinal) else {
        return call();
    };
    let (result, charge) = measured(ordinal, kind, call);
    // SAFETY: the driver wrote the handle on success (null is checked).
    if let (Some(charge), Some(handle), Some(accounting)) = (charge, unsafe { read(handle) }, accounting()) {
        accounting.ledger().insert(family, handle as u64, charge);
    }
    result
}

// ------------------------------------------------------------------ memory queries

/// The virtual device's (total, free), from the physical ones: total = min(limit, physical),
/// free = min(total - used, physical free).
fn virtual_view(accounting: &Accounting, ordinal: CUdevice, free: u64, total: u64) -> Option<(u64, u64)> {
    let device = accounting.device(ordinal)?;
    let (total, _, free) = crate::nvml::virtual_memory(total, free, accounting.limit(device)?, accounting.used(device));
    Some((total, free))
}

/// `cuMemGetInfo` and `_v2`. The driver accepts one NULL output and fills the other (OptiX asks
/// for the total alone), so either one is virtualised on its own; with both NULL there is nothing
/// to show and the driver's answer stands.
pub fn get_info<S: DriverInt>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    free: *mut S,
    total: *mut S,
) -> CUresult {
    let result = call();
    if result != CUDA_SUCCESS || (free.is_null() && total.is_null()) {
        return result;
    }
    let (Some(accounting), Some(ordinal)) = (accounting(), current_ordinal()) else {
        return result;
    };
    // SAFETY: the driver accepted the pointers and wrote the non-null ones.
    let (physical_free, physical_total) = unsafe { (read(free), read(total)) };
    let physical_total = match physical_total {
        Some(bytes) => bytes.to_u64(),
        // Free alone: the virtual free is capped by the virtual total, which needs the physical
        // one; if even that cannot be had, the limit stands in for it (free never exceeds
        // limit - used).
        None => physical_total_memory(ordinal).unwrap_or(u64::MAX),
    };
    // Total alone: the virtual total does not depend on free.
    let physical_free = physical_free.map_or(physical_total, S::to_u64);
    if let Some((virtual_total, virtual_free)) = virtual_view(accounting, ordinal, physical_free, physical_total) {
        // SAFETY: as above; a null pointer is skipped.
        unsafe {
            write(total, S::saturating_from(virtual_total));
            write(free, S::saturating_from(virtual_free));
        }
    }
    result
}

/// The device's physical memory, from the real driver.
fn physical_total_memory(ordinal: CUdevice) -> Option<u64> {
    let total_mem = real::cuDeviceTotalMem_v2()?;
    let mut bytes: usize = 0;
    // SAFETY: a valid out-pointer to a local.
    (unsafe { total_mem(&mut bytes, ordinal) } == CUDA_SUCCESS).then_some(bytes as u64)
}

/// `cuDeviceTotalMem` and `_v2`: the limit, when it is below the physical total.
pub fn device_total_mem<S: DriverInt>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    bytes: *mut S,
    device: CUdevice,
) -> CUresult {
    let result = call();
    if result != CUDA_SUCCESS {
        return result;
    }
    let limit = accounting().and_then(|a| a.limit(a.device(device)?)).or_else(|| {
        // Before cuInit's accounting starts (or without a region), the configuration still says.
        crate::init::config()
            .ok()
            .and_then(|config| config.memory_limit_of(usize::try_from(device).ok()?))
    });
    // SAFETY: the driver accepted and wrote the pointer.
    if let (Some(limit), Some(physical)) = (limit, unsafe { read(bytes) }) {
        // SAFETY: as above.
        unsafe { write(bytes, S::saturating_from(limit.min(physical.to_u64()))) };
    }
    result
}

// ------------------------------------------------------------------ data

/// `cuMemAlloc` and `_v2`.
pub fn alloc<P: DriverInt, S: DriverInt>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    dptr: *mut P,
    size: S,
) -> CUresult {
    if dptr.is_null() || size.to_u64() == 0 {
        return call();
    }
    // SAFETY: the driver wrote the pointer on success.
    charged(None, MemoryKind::Data, size.to_u64(), call, Family::Pointer, || {
        unsafe { read(dptr) }.map(P::to_u64)
    })
}

/// `cuMemAllocPitch` and `_v2`: reserves the width rounded to the pitch alignment times the
/// height, then corrects to the returned pitch times the height.
pub fn alloc_pitch<P: DriverInt, S: DriverInt>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    dptr: *mut P,
    pitch: *mut S,
    width: S,
    height: S,
    _element_size: c_uint,
) -> CUresult {
    const PITCH_ALIGNMENT: u64 = 512;
    let (width, height) = (width.to_u64(), height.to_u64());
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
pub fn alloc_managed(
    name: &'static str,
    call: impl FnOnce() -> CUresult,
    dptr: *mut CUdeviceptr,
    size: usize,
    _flags: c_uint,
) -> CUresult {
    alloc(name, call, dptr, size)
}

// Stream-ordered pools are charged what they hold physically (their reserved memory), not what
// the application asked for: a pool keeps freed blocks (PyTorch's cudaMallocAsync backend keeps
// them all), and that memory is as taken as any allocation. After every pool operation the pool's
// charge is set to its reserved memory; before an allocation, what the pool may have to add is
// reserved against the limit.

/// Pools grow by at least this much.
const POOL_GROWTH_GRANULARITY: u64 = 2 << 20;

fn pool_attribute(pool: CUmemoryPool, attribute: CUmemPool_attribute) -> Option<u64> {
    let get_attribute = real::cuMemPoolGetAttribute()?;
    let mut value: u64 = 0;
    // SAFETY: both attributes asked for here are 64-bit values written into a local.
    let status = unsafe { get_attribute(pool, attribute, (&mut value as *mut u64).cast()) };
    (status == CUDA_SUCCESS).then_some(value)
}

fn device_pool(ordinal: CUdevice) -> Option<CUmemoryPool> {
    let get_pool = real::cuDeviceGetMemPool()?;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    (unsafe { get_pool(&mut pool, ordinal) } == CUDA_SUCCESS && !pool.is_null()).then_some(pool)
}

/// Sets a pool's charge to what it has reserved now.
fn sync_pool(accounting: &Accounting, pool: u64, ordinal: CUdevice) {
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
fn sync_pools(accounting: &Accounting) {
    for (pool, ordinal) in accounting.ledger().pools() {
        sync_pool(accounting, pool, ordinal);
    }
}

fn pooled_alloc(
    name: &'static str,
    call: impl FnOnce() -> CUresult,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<CUmemoryPool>,
) -> CUresult {
    let Some(accounting) = accounting() else {
        return unaccounted(call);
    };
    let Some(ordinal) = current_ordinal() else {
        return call();
    };
    let Some(pool) = pool.filter(|pool| !pool.is_null()).or_else(|| device_pool(ordinal)) else {
        return alloc(name, call, dptr, size);
    };
    if dptr.is_null() || size == 0 {
        return call();
    }
    let reserved = pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).unwrap_or(0);
    let in_use = pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT).unwrap_or(0);
    let growth = (size as u64).saturating_sub(reserved.saturating_sub(in_use));
    let provisional = if growth == 0 {
        None
    } else {
        let growth = growth
            .div_ceil(POOL_GROWTH_GRANULARITY)
            .saturating_mul(POOL_GROWTH_GRANULARITY);
        match charge_or_refuse(accounting, ordinal, MemoryKind::Data, growth) {
            Ok(charge) => charge,
            Err(status) => return status,
        }
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
    }
    result
}

/// `cuStreamSynchronize`, `cuCtxSynchronize`, `cuEventSynchronize`: pools return freed memory
/// here, so their charges are brought up to date (processes without pools take the table's fast
/// path, `no_pools`, and never get here; the check stays for a pool made meanwhile).
pub fn synchronized(_name: &'static str, call: impl FnOnce() -> CUresult) -> CUresult {
    let result = call();
    if let Some(accounting) = accounting()
        && accounting.ledger().has_pools()
    {
        sync_pools(accounting);
    }
    result
}

/// `cuMemAllocAsync` and `_ptsz`: from the current device's pool.
pub fn alloc_async(
    name: &'static str,
    call: impl FnOnce() -> CUresult,
    dptr: *mut CUdeviceptr,
    size: usize,
    _stream: CUstream,
) -> CUresult {
    pooled_alloc(name, call, dptr, size, None)
}

/// `cuMemAllocFromPoolAsync` and `_ptsz`.
pub fn alloc_from_pool_async(
    name: &'static str,
    call: impl FnOnce() -> CUresult,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    _stream: CUstream,
) -> CUresult {
    pooled_alloc(name, call, dptr, size, Some(pool))
}

/// Frees a pointer: from a pool (the pool's charge follows its reserved memory) or charged itself.
fn free_pointer(call: impl FnOnce() -> CUresult, pointer: u64) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    let Some(pool) = accounting.ledger().take_pool_of(pointer) else {
        return released(Family::Pointer, pointer, call);
    };
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
pub fn free<P: DriverInt>(_name: &'static str, call: impl FnOnce() -> CUresult, dptr: P) -> CUresult {
    free_pointer(call, dptr.to_u64())
}

/// `cuMemFreeAsync` and `_ptsz`.
pub fn free_async(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    dptr: CUdeviceptr,
    _stream: CUstream,
) -> CUresult {
    free_pointer(call, dptr)
}

/// `cuMemPoolTrimTo`: the pool's charge follows what it still holds.
pub fn pool_trim(_name: &'static str, call: impl FnOnce() -> CUresult, pool: CUmemoryPool, _keep: usize) -> CUresult {
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
pub fn pool_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, pool: CUmemoryPool) -> CUresult {
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

// ------------------------------------------------------------------ virtual memory management

/// `cuMemCreate`: charged to the device in the allocation's location; host locations are not
/// device memory.
pub fn create(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    _flags: u64,
) -> CUresult {
    // SAFETY: the driver requires a valid prop; null is checked.
    let Some(prop) = (unsafe { read(prop) }) else {
        return call();
    };
    if prop.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE || handle.is_null() || size == 0 {
        return call();
    }
    // SAFETY: the driver wrote the handle on success.
    let key = || unsafe { read(handle) };
    charged(
        Some(prop.location.id),
        MemoryKind::Data,
        size as u64,
        call,
        Family::PhysicalHandle,
        key,
    )
}

/// `cuMemRelease`.
pub fn release(_name: &'static str, call: impl FnOnce() -> CUresult, handle: CUmemGenericAllocationHandle) -> CUresult {
    released(Family::PhysicalHandle, handle, call)
}

// ------------------------------------------------------------------ arrays

/// `cuArrayCreate` and `_v2`.
pub fn array_create<D: ArrayDescriptor>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    handle: *mut CUarray,
    descriptor: *const D,
) -> CUresult {
    // SAFETY: null is checked; otherwise the driver requires a valid descriptor.
    let Some(bytes) = unsafe { descriptor.as_ref() }.and_then(ArrayDescriptor::bytes) else {
        return call();
    };
    // SAFETY: the driver wrote the handle on success.
    let key = || unsafe { read(handle) }.map(|array| array as u64);
    charged(None, MemoryKind::Data, bytes, call, Family::Array, key)
}

/// `cuArray3DCreate` and `_v2`.
pub fn array3d_create<D: ArrayDescriptor>(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    handle: *mut CUarray,
    descriptor: *const D,
) -> CUresult {
    array_create(_name, call, handle, descriptor)
}

/// `cuArrayDestroy`.
pub fn array_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, handle: CUarray) -> CUresult {
    released(Family::Array, handle as u64, call)
}

/// `cuMipmappedArrayCreate`.
pub fn mipmapped_array_create(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    handle: *mut CUmipmappedArray,
    descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: c_uint,
) -> CUresult {
    // SAFETY: null is checked; otherwise the driver requires a valid descriptor.
    let Some(bytes) = unsafe { descriptor.as_ref() }.and_then(|d| mipmapped_bytes(d, levels)) else {
        return call();
    };
    // SAFETY: the driver wrote the handle on success.
    let key = || unsafe { read(handle) }.map(|h| h as u64);
    charged(None, MemoryKind::Data, bytes, call, Family::MipmappedArray, key)
}

/// `cuMipmappedArrayDestroy`.
pub fn mipmapped_array_destroy(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    handle: CUmipmappedArray,
) -> CUresult {
    released(Family::MipmappedArray, handle as u64, call)
}

// ------------------------------------------------------------------ graph memory

/// Charges an allocation node of `bytes` in the pool at `location` to `graph`.
fn graph_alloc_node(
    call: impl FnOnce() -> CUresult,
    graph: CUgraph,
    bytes: usize,
    location: CUmemLocation,
) -> CUresult {
    let bytes = bytes as u64;
    if bytes == 0 {
        return call();
    }
    let ordinal = (location.type_ == CU_MEM_LOCATION_TYPE_DEVICE).then_some(location.id);
    charged(ordinal, MemoryKind::Data, bytes, call, Family::Graph, || {
        Some(graph as u64)
    })
}

/// `cuGraphAddMemAllocNode`: the node's bytes are charged while the graph exists.
pub fn graph_add_mem_alloc_node(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _node: *mut CUgraphNode,
    graph: CUgraph,
    params: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    // SAFETY: null is checked; otherwise the driver requires valid parameters.
    let Some(params) = (unsafe { read(params) }) else {
        return call();
    };
    graph_alloc_node(call, graph, params.bytesize, params.poolProps.location)
}

/// `cuGraphAddNode` and `_v2`: charged like `cuGraphAddMemAllocNode` for memory allocation nodes.
pub fn graph_add_node(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _node: *mut CUgraphNode,
    graph: CUgraph,
    params: *mut CUgraphNodeParams,
) -> CUresult {
    // SAFETY: null is checked; otherwise the driver requires valid parameters.
    let Some(params) = (unsafe { params.as_ref() }) else {
        return call();
    };
    if params.type_ != CU_GRAPH_NODE_TYPE_MEM_ALLOC {
        return call();
    }
    // SAFETY: the type says the union holds allocation parameters.
    let alloc = unsafe { params.__bindgen_anon_1.alloc };
    graph_alloc_node(call, graph, alloc.bytesize, alloc.poolProps.location)
}

/// The `cuGraphInstantiate` family: the memory was charged when its nodes were added.
pub fn graph_instantiate(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _exec: *mut CUgraphExec,
    _graph: CUgraph,
) -> CUresult {
    call()
}

/// `cuGraphExecDestroy`.
pub fn graph_exec_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, _exec: CUgraphExec) -> CUresult {
    call()
}

/// `cuGraphDestroy`: releases its memory nodes' charges.
pub fn graph_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, graph: CUgraph) -> CUresult {
    released(Family::Graph, graph as u64, call)
}

/// `cuDeviceGraphMemTrim`.
pub fn graph_mem_trim(_name: &'static str, call: impl FnOnce() -> CUresult, _device: CUdevice) -> CUresult {
    call()
}

// ------------------------------------------------------------------ contexts and modules

/// The `cuCtxCreate` family: a context is charged what the driver took for it.
pub fn ctx_create(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    context: *mut CUcontext,
    device: CUdevice,
) -> CUresult {
    measured_and_recorded(Some(device), MemoryKind::Context, Family::Context, call, context)
}

/// `cuCtxDestroy` and `_v2`.
pub fn ctx_destroy(_name: &'static str, call: impl FnOnce() -> CUresult, context: CUcontext) -> CUresult {
    let result = released(Family::Context, context as u64, call);
    if result == CUDA_SUCCESS
        && let Some(accounting) = accounting()
    {
        release_owned_by(accounting, context as u64);
    }
    result
}

/// `cuDevicePrimaryCtxRetain`: the first retain creates the primary context and is charged.
pub fn primary_ctx_retain(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    context: *mut CUcontext,
    device: CUdevice,
) -> CUresult {
    let Some(accounting) = accounting() else {
        return unaccounted(call);
    };
    accounting.ledger().with_primary(device, |primary| {
        if primary.references > 0 {
            let result = call();
            if result == CUDA_SUCCESS {
                primary.references += 1;
            }
            return result;
        }
        let (result, measured_charge) = measured(device, MemoryKind::Context, call);
        if result == CUDA_SUCCESS {
            primary.references = 1;
            primary.charge = measured_charge;
            // SAFETY: the driver wrote the context on success.
            primary.context = unsafe { read(context) }.map_or(0, |context| context as u64);
        }
        result
    })
}

/// `cuDevicePrimaryCtxRelease`, `Reset` and their `_v2`: the charge goes with the last reference
/// (a reset destroys the context whatever the count).
pub fn primary_ctx_release(name: &'static str, call: impl FnOnce() -> CUresult, device: CUdevice) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    let reset = name.starts_with("cuDevicePrimaryCtxReset");
    accounting.ledger().with_primary(device, |primary| {
        let result = call();
        if result == CUDA_SUCCESS {
            primary.references = if reset { 0 } else { primary.references.saturating_sub(1) };
            if primary.references == 0 {
                // The driver destroyed the context, and with it every allocation it owned.
                if let Some(charge) = primary.charge.take() {
                    accounting.release(charge);
                }
                release_owned_by(accounting, std::mem::take(&mut primary.context));
            }
        }
        result
    })
}

/// The `cuModuleLoad` family: charged what the driver took for the module's code and data.
pub fn module_load(_name: &'static str, call: impl FnOnce() -> CUresult, module: *mut CUmodule) -> CUresult {
    measured_and_recorded(None, MemoryKind::Module, Family::Module, call, module)
}

/// `cuModuleUnload`.
pub fn module_unload(_name: &'static str, call: impl FnOnce() -> CUresult, module: CUmodule) -> CUresult {
    released(Family::Module, module as u64, call)
}

/// The `cuLibraryLoad` family.
pub fn library_load(_name: &'static str, call: impl FnOnce() -> CUresult, library: *mut CUlibrary) -> CUresult {
    measured_and_recorded(None, MemoryKind::Module, Family::Library, call, library)
}

/// `cuLibraryUnload`.
pub fn library_unload(_name: &'static str, call: impl FnOnce() -> CUresult, library: CUlibrary) -> CUresult {
    released(Family::Library, library as u64, call)
}
