//! Elastic memory (`CUDA_OVERSUBSCRIBE=true`): an allocation that the container's limit allows but
//! the device cannot back (the driver answers out of memory: other containers hold the rest) is
//! served from unified memory, its part the device has no room for in host memory that the device
//! reaches in place, instead of failing the job.
//!
//! - **Device memory first.** Only an allocation the driver refused for lack of memory spills; the
//!   charge against the limit was made before the driver was asked, so a spilled allocation is
//!   charged like any other, and nothing spills past the limit.
//! - **Split where the device ends.** The spill's head, as much as the device still has room for
//!   (beyond the headroom, in whole large pages), is placed on the device (preferred location the
//!   device, prefetched); only its tail lives in host memory. One large allocation (JAX's and
//!   TensorFlow's arenas, a KV cache) is thus mostly device memory when it is a little too big.
//! - **Host-resident, device-mapped.** The tail prefers the host and the device is given access
//!   to all of it (`SET_PREFERRED_LOCATION` host, `SET_ACCESSED_BY` the device): kernels read it
//!   over the bus instead of migrating pages back and forth, which is what makes naive unified
//!   memory crawl once a pass touches more than the device has free.
//! - **Seen.** The tail's bytes are recorded as host-backed in the process's slot (the region's
//!   `host_backed` table), which the monitor shows.
//! - **Moves back.** When a device has room again, the tails move onto it (preferred location the
//!   device, prefetched on a stream of the library's own in the spill's context, made current for
//!   the move), as much of each as there is room for, and are device memory from then on; the
//!   oldest spill goes first (allocated first, it is likely the longest lived: weights and
//!   optimiser state rather than scratch). Looked for from the library's tick ([`tick`]), at
//!   synchronisations of a process with pools and before a refusal: never on the path of an
//!   allocation or free that works.
//! - **Stream-ordered frees.** `cuMemFreeAsync` of a spilled pointer is not the pool's to free:
//!   an event is recorded on the stream and the memory freed once the stream has passed it; on a
//!   stream being captured it is refused.
//!
//! VMM allocations (`cuMemCreate`: JAX's and XLA's allocator, PyTorch's expandable segments) that
//! the device cannot back are split where the device ends ([`super::split`]), or made in host
//! memory whole where it has no room ([`create_on_host`]): the application maps them and gives the
//! device access as it would device memory; their host memory stays for as long as they live. Where neither stands in, the driver's refusal stands: arrays, allocations
//! recorded into a stream capture, and the legacy 32-bit `cuMemAlloc`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use super::accounting::Accounting;
use super::charge::{current_context, released_after, released_with};
use super::ledger::{Charges, Family};
use super::location::located;
use crate::capture::in_relaxed_capture_mode;
use crate::hooks::real;
use crate::session;
use crate::sys::cuda::*;

/// Free device memory a spill's head or a move back leaves: the driver, the application's next
/// small allocations (library workspaces) and other processes need room too. At most a sixteenth
/// of a device (a small one).
const HEADROOM_BYTES: u64 = 1 << 30;

/// The unit a spill is split and moved in: the driver's large page of unified memory.
const LARGE_PAGE: u64 = 2 << 20;

/// How often the device's free memory is looked at for a move back, at most.
const MOVE_BACK_PERIOD_NS: u64 = 500_000_000;

/// One allocation served from host memory.
#[derive(Clone, Copy, Debug)]
struct Spill {
    bytes: u64,
    ordinal: CUdevice,
    region_index: usize,
    /// The bytes at the end of the allocation that are in host memory (the rest is on the device).
    host_bytes: u64,
    /// The context it was allocated in (current while its tail moves back).
    context: u64,
}

/// A stream-ordered free of a spilled pointer, waiting for its stream.
struct DeferredFree {
    event: usize,
    pointer: u64,
}

/// This process's spilled allocations (part of its accounting: a forked child starts without).
#[derive(Default)]
pub struct Spills {
    /// By device pointer, in allocation order (pointers of one device grow).
    live: Mutex<BTreeMap<u64, Spill>>,
    deferred: Mutex<Vec<DeferredFree>>,
    /// Whether `live` or `deferred` holds anything: the tick's and synchronisations' one load.
    any: AtomicBool,
    /// When the device's free memory was last looked at for a move back.
    move_back_checked_ns: AtomicU64,
    /// Held while the library works on spills with the driver (a move back, which outlasts the
    /// period when it moves gigabytes, and frees of spills) and while a context is destroyed: a
    /// spill is never freed while it moves, nor a context destroyed while the library uses it.
    moving: Mutex<()>,
    /// A context of a live spill (the latest's), made current on the tick's thread.
    context: AtomicU64,
    /// The library's own non-blocking streams for moves, by context (a stream belongs to one).
    streams: Mutex<Vec<(u64, u64)>>,
}

impl Spills {
    /// Sets [`Spills::any`] under both locks, so that a spill or a deferred free added meanwhile
    /// (which sets it under its own) is never overwritten by a stale `false`.
    fn note_any(&self) {
        let live = self.live.lock();
        let deferred = self.deferred.lock();
        self.any
            .store(!live.is_empty() || !deferred.is_empty(), Ordering::Release);
    }
}

/// Runs `call` (a context's destruction) with no move back or free of a spill under way, when
/// the process has spills: the driver forbids using a context while it is destroyed.
pub(super) fn between_moves<R>(call: impl FnOnce() -> R) -> R {
    match super::accounting::accounting() {
        Some(accounting) if accounting.spills().any.load(Ordering::Acquire) => {
            let _moving = accounting.spills().moving.lock();
            call()
        }
        _ => call(),
    }
}

/// Whether the container asked for elastic memory.
pub fn enabled() -> bool {
    session::config().is_ok_and(|config| config.oversubscribe)
}

/// After the driver answered `status` to an allocation of `bytes` on `ordinal` that the limit
/// allowed: when that is out of memory and elastic memory is on, unified memory, as much of it on
/// the device as has room and the rest in host memory mapped for the device, recorded as spilled.
/// `None` leaves the driver's answer.
pub(super) fn serve(accounting: Accounting, status: CUresult, ordinal: CUdevice, bytes: u64) -> Option<u64> {
    if status != CUDA_ERROR_OUT_OF_MEMORY || bytes == 0 || !enabled() {
        return None;
    }
    let device = accounting.device(ordinal)?;
    let spills = accounting.spills();
    // Potentially unsafe calls for another thread's global-mode capture: made in relaxed mode.
    let (pointer, head) = in_relaxed_capture_mode(|| place(spills, ordinal, bytes))?;
    let host_bytes = bytes - head;
    let context = current_context();
    // Recorded before the spill is live, so that a move back never subtracts its bytes first.
    record_host_backed(accounting, device.region_index, host_bytes, true);
    {
        let mut live = spills.live.lock();
        live.insert(
            pointer,
            Spill {
                bytes,
                ordinal,
                region_index: device.region_index,
                host_bytes,
                context,
            },
        );
        // The tick's context before the flag that lets the tick run.
        spills.context.store(context, Ordering::Relaxed);
        spills.any.store(true, Ordering::Release);
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "device {ordinal} has no room for {bytes} bytes within the container's limit: {host_bytes} of them served \
             from host memory the GPU reads in place (CUDA_OVERSUBSCRIBE), slower; `vgpu-smi` shows the host-backed \
             bytes"
        );
    } else {
        tracing::debug!("device {ordinal}: {host_bytes} of {bytes} bytes served from host memory");
    }
    Some(pointer)
}

/// Unified memory for a spill of `bytes` on `ordinal`, the current context's device (every
/// caller's): its head on the device as far as there is room, the rest preferring host memory,
/// all of it mapped for the device. The pointer and the head's bytes.
fn place(spills: &Spills, ordinal: CUdevice, bytes: u64) -> Option<(u64, u64)> {
    let alloc_managed = real::cuMemAllocManaged()?;
    let mut pointer: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer to a local; the size is the application's.
    let status = unsafe { alloc_managed(&mut pointer, usize::try_from(bytes).ok()?, CU_MEM_ATTACH_GLOBAL) };
    if status != CUDA_SUCCESS || pointer == 0 {
        tracing::warn!(
            "device {ordinal} could not back {bytes} bytes and unified memory could not either (status {status}): \
             the allocation fails"
        );
        return None;
    }
    advise(pointer, bytes, CU_MEM_ADVISE_SET_ACCESSED_BY, on_device(ordinal));
    let head = device_room().map_or(0, |room| onto_device(spills, pointer, bytes, room, ordinal));
    if head < bytes {
        advise(
            pointer + head,
            bytes - head,
            CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
            host(),
        );
    }
    Some((pointer, head))
}

/// `cuMemCreate` of `bytes` on `device` that the limit allowed and the driver refused
/// (`status`): when that is out of memory and elastic memory is on, its head on the device as far
/// as there is room and its tail in host memory ([`super::split`], under [`Family::SplitHandle`]),
/// or where the device has no room for a granule, the same physical allocation located in host
/// memory (the host NUMA node nearest the device), which the application maps and gives the
/// device access to as it would device memory, under [`Family::SpillHandle`]. Either never moves
/// back (its mappings are the application's).
#[cold]
#[inline(never)]
pub(super) fn create_on_host(
    status: CUresult,
    handle: *mut CUmemGenericAllocationHandle,
    bytes: u64,
    prop: &CUmemAllocationProp,
    device: CUdevice,
) -> (CUresult, Family) {
    let refused = (status, Family::PhysicalHandle);
    if status != CUDA_ERROR_OUT_OF_MEMORY || !enabled() {
        return refused;
    }
    let Some(accounting) = super::accounting::accounting() else {
        return refused;
    };
    let Some(region_index) = accounting.device(device).map(|entry| entry.region_index) else {
        return refused;
    };
    if let Some(tail_bytes) = super::split::create(accounting, handle, bytes, prop, device, region_index) {
        record_host_backed(accounting, region_index, tail_bytes, true);
        return (CUDA_SUCCESS, Family::SplitHandle);
    }
    let created = create_in_host_memory(handle, bytes, prop, device);
    if created != CUDA_SUCCESS {
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "cuMemCreate (VMM) found no room on device {device}, and host memory could not back it either \
                 (status {created}): it fails as the driver failed it"
            );
        }
        return refused;
    }
    record_host_backed(accounting, region_index, bytes, true);
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "device {device} has no room for a VMM allocation of {bytes} bytes within the container's limit: made in \
             host memory the GPU reads in place (CUDA_OVERSUBSCRIBE), slower, for as long as it lives; `vgpu-smi` \
             shows the host-backed bytes"
        );
    }
    (CUDA_SUCCESS, Family::SpillHandle)
}

/// `cuMemCreate` of `bytes` in host memory (the host NUMA node nearest `device`) with as much of
/// the application's `prop` as the driver takes there, the handle written to `handle`.
pub(super) fn create_in_host_memory(
    handle: *mut CUmemGenericAllocationHandle,
    bytes: u64,
    prop: &CUmemAllocationProp,
    device: CUdevice,
) -> CUresult {
    let Some(create) = real::cuMemCreate() else {
        return CUDA_ERROR_NOT_SUPPORTED;
    };
    let mut created = CUDA_ERROR_NOT_SUPPORTED;
    let mut dropped = None;
    for (on_host, without) in host_properties(prop, host_numa_node(device)) {
        // SAFETY: an out-pointer the caller checked non-null, and a copy of the application's
        // properties with another location.
        created = in_relaxed_capture_mode(|| unsafe { create(handle, bytes as usize, &on_host, 0) });
        dropped = without;
        if !matches!(
            created,
            CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_NOT_SUPPORTED | CUDA_ERROR_NOT_PERMITTED
        ) {
            break;
        }
    }
    if created == CUDA_SUCCESS
        && let Some(without) = dropped
    {
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "host memory for VMM allocations of device {device} is made {without}, which the driver refuses \
                 for host memory: exporting such an allocation fails"
            );
        }
    }
    created
}

/// The properties a VMM allocation is made with in host memory, tried in turn until the driver
/// takes one, each with what it leaves out of the application's: first the application's own on
/// the host NUMA node `node`; then without what only device memory has (GPUDirect RDMA,
/// compression, usage flags) or needs a fabric (fabric handles); then without shareable handles;
/// then on no particular node (where the system has no NUMA nodes for the driver), which admits
/// no shareable handles either.
pub(super) fn host_properties(
    prop: &CUmemAllocationProp,
    node: i32,
) -> [(CUmemAllocationProp, Option<&'static str>); 4] {
    let mut own = *prop;
    own.location = located(CU_MEM_LOCATION_TYPE_HOST_NUMA, node);
    let mut plain = own;
    plain.allocFlags = Default::default();
    plain.requestedHandleTypes &= !CU_MEM_HANDLE_TYPE_FABRIC;
    let mut private = plain;
    private.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    let mut anywhere = private;
    anywhere.location = located(CU_MEM_LOCATION_TYPE_HOST, 0);
    [
        (own, None),
        (plain, Some("without GPUDirect RDMA, compression and fabric handles")),
        (private, Some("without shareable handles")),
        (anywhere, Some("on no particular NUMA node, without shareable handles")),
    ]
}

/// The host NUMA node nearest `device` (0 where the driver does not say).
pub(super) fn host_numa_node(device: CUdevice) -> i32 {
    let Some(get_attribute) = real::cuDeviceGetAttribute() else {
        return 0;
    };
    let mut node: i32 = -1;
    // SAFETY: a valid out-pointer to a local.
    let status = unsafe { get_attribute(&mut node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device) };
    if status == CUDA_SUCCESS && node >= 0 { node } else { 0 }
}

/// `cuMemRelease` of a handle not charged as a plain one: a split one drops a reference
/// ([`super::split::release`]); a handle made in host memory by [`create_on_host`] is released,
/// its charge and host-backed bytes with it; any other handle goes to the driver as it is.
#[cold]
#[inline(never)]
pub(super) fn release_handle(accounting: Accounting, handle: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if let Some(result) = super::split::release(accounting, handle) {
        return result;
    }
    released_after(Family::SpillHandle, handle, call, forget_host_backed)
}

/// Forgets the host-backed bytes of a freed allocation made in host memory.
pub(super) fn forget_host_backed(accounting: Accounting, charges: &Charges) {
    for charge in charges.iter() {
        record_host_backed(accounting, charge.region_index, charge.bytes, false);
    }
}

/// `cuMemFree` of a pointer not charged as a plain one: a spill is freed, its charge released and
/// its host-backed bytes forgotten; any other pointer goes to the driver as it is. A free of a
/// plain pointer never comes here, so elastic memory costs it nothing.
#[cold]
#[inline(never)]
pub(super) fn free(_: Accounting, pointer: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    // The accounting is looked up again rather than taken from the caller, which then passes it
    // nothing: the plain free's code stays as it was without elastic memory.
    let spills = super::accounting::accounting().map(|accounting| accounting.spills());
    let _moving = spills
        .filter(|spills| spills.any.load(Ordering::Acquire) && spills.live.lock().contains_key(&pointer))
        .map(|spills| spills.moving.lock());
    released_after(Family::Spill, pointer, call, |accounting, _| {
        forget_spill(accounting, pointer)
    })
}

fn forget_spill(accounting: Accounting, pointer: u64) {
    let spills = accounting.spills();
    let Some(spill) = spills.live.lock().remove(&pointer) else {
        return;
    };
    if spill.host_bytes > 0 {
        record_host_backed(accounting, spill.region_index, spill.host_bytes, false);
    }
    spills.note_any();
}

/// A context destroyed: its spills went with it (the driver freed them; their charges were
/// released with the context's), so they are forgotten with their host-backed bytes, their
/// waiting frees (whose events went too) and the context's stream.
pub(super) fn forget_context(accounting: Accounting, context: u64) {
    let spills = accounting.spills();
    // A reset primary context often comes back with the same handle: its stream must not.
    spills.streams.lock().retain(|(of, _)| *of != context);
    if !spills.any.load(Ordering::Acquire) {
        let _ = spills
            .context
            .compare_exchange(context, 0, Ordering::AcqRel, Ordering::Relaxed);
        return;
    }
    let (gone, remaining): (Vec<(u64, Spill)>, Option<u64>) = {
        let mut live = spills.live.lock();
        let pointers: Vec<u64> = live
            .iter()
            .filter(|(_, spill)| spill.context == context)
            .map(|(pointer, _)| *pointer)
            .collect();
        let gone = pointers
            .into_iter()
            .filter_map(|pointer| live.remove(&pointer).map(|spill| (pointer, spill)))
            .collect();
        (gone, live.values().next_back().map(|spill| spill.context))
    };
    for (_, spill) in &gone {
        if spill.host_bytes > 0 {
            record_host_backed(accounting, spill.region_index, spill.host_bytes, false);
        }
    }
    spills
        .deferred
        .lock()
        .retain(|free| !gone.iter().any(|(pointer, _)| *pointer == free.pointer));
    // The tick's context: another live spill's.
    let _ = spills
        .context
        .compare_exchange(context, remaining.unwrap_or(0), Ordering::AcqRel, Ordering::Relaxed);
    spills.note_any();
}

/// `cuMemFreeAsync` of a pointer not charged as a pool's or a plain one: a spill is freed once
/// `stream` reaches this point (its event is recorded now; the free itself happens here when the
/// stream has already passed it, else at the tick, a synchronisation of a process with pools or a
/// refusal, or at once, after the stream is synchronised, when no event can be recorded); any
/// other pointer goes to the driver as it is. On a stream being captured it is refused
/// ([`refused_in_capture`]).
#[cold]
#[inline(never)]
pub(super) fn free_when_reached(
    accounting: Accounting,
    pointer: u64,
    stream: CUstream,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    if !accounting.spills().live.lock().contains_key(&pointer) {
        return call();
    }
    if let Some(status) = refused_in_capture(stream) {
        return status;
    }
    match record_event(stream) {
        Some(event) => {
            let spills = accounting.spills();
            {
                let mut deferred = spills.deferred.lock();
                deferred.push(DeferredFree { event, pointer });
                spills.any.store(true, Ordering::Release);
            }
            let _ = collect_unless_busy(accounting);
            CUDA_SUCCESS
        }
        None => {
            let _moving = accounting.spills().moving.lock();
            in_relaxed_capture_mode(|| {
                if let Some(synchronize) = real::cuStreamSynchronize() {
                    // SAFETY: the application's stream, as it passed it.
                    let _ = unsafe { synchronize(stream) };
                }
                free_now(accounting, pointer)
            })
        }
    }
}

/// A spill's stream-ordered free on a stream that is being captured: the point it would wait for
/// is a node of the graph, not of the stream, and the graph may run many times or never, so the
/// free is refused (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, the driver's answer to what a
/// capture cannot take) and the memory stays the application's; a stream the driver cannot ask
/// gets the driver's answer. `None`: not capturing.
fn refused_in_capture(stream: CUstream) -> Option<CUresult> {
    let is_capturing = real::cuStreamIsCapturing()?;
    let mut capture = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the application's stream and a valid out-pointer to a local.
    let status = unsafe { is_capturing(stream, &mut capture) };
    if status != CUDA_SUCCESS {
        return Some(status);
    }
    if capture == CU_STREAM_CAPTURE_STATUS_NONE {
        return None;
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "cuMemFreeAsync of memory served from host memory (CUDA_OVERSUBSCRIBE) on a stream being captured: \
             refused (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); free it outside the capture"
        );
    }
    Some(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
}

/// From the library's tick (every half second in a process that launches): [`collect`] with a
/// live spill's context current on the tick's thread, so that a job whose allocator no longer
/// calls the driver (PyTorch's cache, once warm) still gets its memory back on the device. A tick
/// that finds the library already working on spills leaves it to that.
pub fn tick() {
    let Some(accounting) = super::accounting::accounting() else {
        return;
    };
    let spills = accounting.spills();
    if !spills.any.load(Ordering::Acquire) {
        return;
    }
    let Some(set_current) = real::cuCtxSetCurrent() else {
        return;
    };
    let Some(_moving) = spills.moving.try_lock() else {
        return;
    };
    let context = spills.context.load(Ordering::Relaxed) as CUcontext;
    // SAFETY: a context of this process's (a live spill's: contexts are destroyed only while no
    // one works on spills), or null; the tick's thread has no other.
    if unsafe { set_current(context) } != CUDA_SUCCESS {
        return;
    }
    let _ = in_relaxed_capture_mode(|| collect_while_moving(accounting));
    // SAFETY: as above: the tick's thread goes back to having no current context.
    let _ = unsafe { set_current(std::ptr::null_mut()) };
}

/// Frees the deferred pointers whose streams have passed their free, and moves spilled memory
/// back to the device when it has room (at most every [`MOVE_BACK_PERIOD_NS`]); the driver calls
/// are made in relaxed capture mode, so that another thread's stream capture is never invalidated
/// by them. Before a refusal, which waits for a move under way (it may free what the refusal
/// needs). Whether a deferred free was done.
#[inline(always)]
pub(super) fn collect(accounting: Accounting) -> bool {
    accounting.spills().any.load(Ordering::Acquire) && collect_in_relaxed_mode(accounting, true)
}

/// [`collect`] at a synchronisation or a stream-ordered free, which leave a move under way (it
/// may take seconds) to finish what they came for.
#[inline(always)]
pub(super) fn collect_unless_busy(accounting: Accounting) -> bool {
    accounting.spills().any.load(Ordering::Acquire) && collect_in_relaxed_mode(accounting, false)
}

#[cold]
#[inline(never)]
fn collect_in_relaxed_mode(accounting: Accounting, wait: bool) -> bool {
    let moving = &accounting.spills().moving;
    let Some(_moving) = (if wait { Some(moving.lock()) } else { moving.try_lock() }) else {
        return false;
    };
    in_relaxed_capture_mode(|| collect_while_moving(accounting))
}

/// [`collect`], its caller holding [`Spills::moving`].
fn collect_while_moving(accounting: Accounting) -> bool {
    let spills = accounting.spills();
    let reached: Vec<DeferredFree> = {
        let mut deferred = spills.deferred.lock();
        let (reached, waiting) = std::mem::take(&mut *deferred)
            .into_iter()
            .partition(|free| event_reached(free.event));
        *deferred = waiting;
        reached
    };
    let mut freed = false;
    let mut failed = Vec::new();
    for free in reached {
        if free_now(accounting, free.pointer) == CUDA_SUCCESS {
            destroy_event(free.event);
            freed = true;
        } else {
            failed.push(free);
        }
    }
    if !failed.is_empty() {
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            tracing::warn!("the driver refused a stream-ordered free of host-backed memory: it is tried again");
        }
        spills.deferred.lock().extend(failed);
    }
    spills.note_any();
    let now = vgpu_region::monotonic_ns();
    let checked = spills.move_back_checked_ns.load(Ordering::Relaxed);
    if now.saturating_sub(checked) >= MOVE_BACK_PERIOD_NS
        && spills
            .move_back_checked_ns
            .compare_exchange(checked, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    {
        move_back(accounting);
    }
    freed
}

/// Frees a spilled pointer with the driver, in its own context (made current for the free), and
/// releases its charge; a pointer that is no longer a live spill (its context was destroyed) is
/// not the library's to free. The caller holds [`Spills::moving`].
fn free_now(accounting: Accounting, pointer: u64) -> CUresult {
    let Some(driver_free) = real::cuMemFree_v2() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let Some(context) = accounting.spills().live.lock().get(&pointer).map(|spill| spill.context) else {
        return CUDA_SUCCESS;
    };
    let thread_context = current_context();
    let context_gone = !make_current(context);
    let free = || {
        if context_gone {
            // Its context went without the library seeing it: the driver freed the memory then.
            return CUDA_SUCCESS;
        }
        // SAFETY: the pointer came from cuMemAllocManaged here and is still live.
        match unsafe { driver_free(pointer) } {
            CUDA_ERROR_INVALID_CONTEXT | CUDA_ERROR_CONTEXT_IS_DESTROYED => CUDA_SUCCESS,
            status => status,
        }
    };
    let forget = |accounting| forget_spill(accounting, pointer);
    let status = released_with(
        Family::Spill,
        pointer,
        free,
        |accounting, _| forget(accounting),
        |accounting, _, free| {
            let status = free();
            if status == CUDA_SUCCESS {
                forget(accounting);
            }
            status
        },
    );
    make_current(thread_context);
    status
}

/// Moves the tails of the spills back onto their devices, oldest first, as much of each as its
/// device has room for; the caller holds [`Spills::moving`]. The driver's free memory is the
/// current context's device's: each spill's own context is made current while it moves (and the
/// thread's own made current again after).
fn move_back(accounting: Accounting) {
    let spills = accounting.spills();
    let on_host: Vec<(u64, Spill)> = spills
        .live
        .lock()
        .iter()
        .filter(|(_, spill)| spill.host_bytes > 0)
        .map(|(pointer, spill)| (*pointer, *spill))
        .collect();
    if on_host.is_empty() {
        return;
    }
    let thread_context = current_context();
    let mut room_by_device: BTreeMap<CUdevice, u64> = BTreeMap::new();
    for (pointer, spill) in on_host {
        if !make_current(spill.context) {
            continue;
        }
        let room = match room_by_device.get(&spill.ordinal) {
            Some(room) => *room,
            None => match device_room() {
                Some(room) => room,
                None => continue,
            },
        };
        let moved = {
            let _in_flight = accounting.in_flight(spill.region_index);
            let tail = pointer + (spill.bytes - spill.host_bytes);
            onto_device(spills, tail, spill.host_bytes, room, spill.ordinal)
        };
        room_by_device.insert(spill.ordinal, room.saturating_sub(moved));
        if moved == 0 {
            continue;
        }
        // Freed meanwhile (and maybe its address reused by another spill): nothing to record.
        let recorded = match spills.live.lock().get_mut(&pointer) {
            Some(live) if live.bytes == spill.bytes && live.host_bytes == spill.host_bytes => {
                live.host_bytes -= moved;
                true
            }
            _ => false,
        };
        if recorded {
            record_host_backed(accounting, spill.region_index, moved, false);
            tracing::info!(
                "device {}: {moved} bytes moved back from host memory to the device",
                spill.ordinal
            );
        }
    }
    make_current(thread_context);
}

/// Makes `context` current on this thread, unless it is already.
fn make_current(context: u64) -> bool {
    if current_context() == context {
        return true;
    }
    let Some(set_current) = real::cuCtxSetCurrent() else {
        return false;
    };
    // SAFETY: a context of this process's as the driver handed it (or null: none current).
    (unsafe { set_current(context as CUcontext) }) == CUDA_SUCCESS
}

/// Places the start of the managed range `[pointer, pointer + bytes)` on device `ordinal`: all
/// of it when `room` holds it, else as many whole large pages as `room` holds. Returns the bytes
/// placed (0 when the driver would not prefetch them: they stay where they were).
fn onto_device(spills: &Spills, pointer: u64, bytes: u64, room: u64, ordinal: CUdevice) -> u64 {
    let placed = if bytes <= room {
        bytes
    } else {
        room / LARGE_PAGE * LARGE_PAGE
    };
    if placed == 0 {
        return 0;
    }
    let device = on_device(ordinal);
    advise(pointer, placed, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, device);
    if prefetch(spills, pointer, placed, device) {
        placed
    } else {
        advise(pointer, placed, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host());
        0
    }
}

/// Free device memory on the current device beyond the headroom, as the driver sees it.
pub(super) fn device_room() -> Option<u64> {
    let get_info = real::cuMemGetInfo_v2()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers to locals; the current context's device is the spills'.
    if unsafe { get_info(&mut free, &mut total) } != CUDA_SUCCESS {
        return None;
    }
    let headroom = HEADROOM_BYTES.min(total as u64 / 16);
    Some((free as u64).saturating_sub(headroom))
}

pub(super) fn record_host_backed(accounting: Accounting, region_index: usize, bytes: u64, more: bool) {
    if let Some(slot) = accounting.slot()
        && let Err(error) = accounting.region().record_host_backed(slot, region_index, bytes, more)
    {
        tracing::warn!("{error}; host-backed bytes not recorded");
    }
}

fn host() -> CUmemLocation {
    located(CU_MEM_LOCATION_TYPE_HOST, 0)
}

fn on_device(ordinal: CUdevice) -> CUmemLocation {
    located(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
}

/// Advice on a spilled range; a driver that refuses it leaves the memory working, only slower.
fn advise(pointer: u64, bytes: u64, advice: CUmem_advise, location: CUmemLocation) {
    let Some(advise) = real::cuMemAdvise_v2() else { return };
    // SAFETY: a managed range this library allocated; the location is plain data.
    let status = unsafe { advise(pointer, bytes as usize, advice, location) };
    if status != CUDA_SUCCESS {
        tracing::debug!("cuMemAdvise({advice}) on a spilled range: status {status}");
    }
}

/// Prefetches a spilled range to `location` on the library's own stream of the current context
/// and waits for it.
fn prefetch(spills: &Spills, pointer: u64, bytes: u64, location: CUmemLocation) -> bool {
    let (Some(prefetch), Some(synchronize)) = (real::cuMemPrefetchAsync_v2(), real::cuStreamSynchronize()) else {
        return false;
    };
    let context = current_context();
    let stream = own_stream(spills, context);
    // SAFETY: a managed range this library allocated, on a stream it made in the current context
    // (or the legacy one).
    let mut status = unsafe { prefetch(pointer, bytes as usize, location, 0, stream) };
    if status == CUDA_SUCCESS {
        // SAFETY: as above.
        status = unsafe { synchronize(stream) };
    }
    if matches!(status, CUDA_ERROR_INVALID_HANDLE | CUDA_ERROR_CONTEXT_IS_DESTROYED) {
        // A stale stream (its context gone, the handle reused): the next move makes one.
        spills.streams.lock().retain(|(of, _)| *of != context);
    }
    status == CUDA_SUCCESS
}

/// The library's stream of `context` (the current one), made on first use; null (the legacy
/// stream) when none can be made.
fn own_stream(spills: &Spills, context: u64) -> CUstream {
    let mut streams = spills.streams.lock();
    if let Some((_, stream)) = streams.iter().find(|(of, _)| *of == context) {
        return *stream as CUstream;
    }
    let Some(create) = real::cuStreamCreate() else {
        return std::ptr::null_mut();
    };
    let mut stream: CUstream = std::ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    if unsafe { create(&mut stream, CU_STREAM_NON_BLOCKING) } != CUDA_SUCCESS || stream.is_null() {
        return std::ptr::null_mut();
    }
    streams.push((context, stream as u64));
    stream
}

/// An event recorded on `stream` (as a number, so the list can be shared between threads).
fn record_event(stream: CUstream) -> Option<usize> {
    let (create, record) = (real::cuEventCreate()?, real::cuEventRecord()?);
    let mut event: CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    if unsafe { create(&mut event, CU_EVENT_DISABLE_TIMING) } != CUDA_SUCCESS || event.is_null() {
        return None;
    }
    // SAFETY: the event made above, on the application's stream as it passed it.
    if unsafe { record(event, stream) } != CUDA_SUCCESS {
        destroy_event(event as usize);
        return None;
    }
    Some(event as usize)
}

/// Whether the stream has passed the event (an error counts as passed: the work is over).
fn event_reached(event: usize) -> bool {
    let Some(query) = real::cuEventQuery() else { return true };
    // SAFETY: an event this library made and has not destroyed.
    let status = unsafe { query(event as CUevent) };
    status != CUDA_ERROR_NOT_READY
}

fn destroy_event(event: usize) {
    if let Some(destroy) = real::cuEventDestroy_v2() {
        // SAFETY: an event this library made, destroyed once.
        let _ = unsafe { destroy(event as CUevent) };
    }
}
