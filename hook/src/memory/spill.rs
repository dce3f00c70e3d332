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
//!   optimiser state rather than scratch). Looked for at synchronisations, before a refusal and
//!   from the library's tick ([`tick`]): never on the path of an allocation or free that works.
//! - **Stream-ordered frees.** `cuMemFreeAsync` of a spilled pointer is not the pool's to free:
//!   an event is recorded on the stream and the memory freed once the stream has passed it.
//!
//! Where unified memory cannot stand in, the driver's refusal stands: VMM (`cuMemCreate`), arrays,
//! allocations recorded into a stream capture, and the legacy 32-bit `cuMemAlloc`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use super::accounting::Accounting;
use super::charge::current_context;
use super::ledger::Family;
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
    /// The context of the latest spill, made current on the tick's thread.
    context: AtomicU64,
}

impl Spills {
    fn note_any(&self) {
        let any = !self.live.lock().is_empty() || !self.deferred.lock().is_empty();
        self.any.store(any, Ordering::Release);
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
    // The driver's free memory is the current context's device's (a pool's allocation may be
    // another device's: then all of it stays in host memory).
    let room = (session::current_ordinal() == Some(ordinal))
        .then(device_room)
        .flatten();
    let head = room.map_or(0, |room| onto_device(pointer, bytes, room, ordinal));
    let host_bytes = bytes - head;
    if host_bytes > 0 {
        advise(pointer + head, host_bytes, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host());
    }
    let spills = accounting.spills();
    let context = current_context();
    spills.live.lock().insert(
        pointer,
        Spill {
            bytes,
            ordinal,
            region_index: device.region_index,
            host_bytes,
            context,
        },
    );
    spills.any.store(true, Ordering::Release);
    spills.context.store(context, Ordering::Relaxed);
    record_host_backed(accounting, device.region_index, host_bytes, true);
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

/// After an allocation unified memory cannot stand in for (`what`: VMM's `cuMemCreate`, an
/// array) answered `status`: out of memory under elastic memory is said once, so the user knows
/// why this one failed when others spill.
pub(super) fn cannot_spill(what: &str, status: CUresult) {
    if status != CUDA_ERROR_OUT_OF_MEMORY || !enabled() {
        return;
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "{what} found no room on the device and cannot be served from host memory (CUDA_OVERSUBSCRIBE covers \
             cuMemAlloc, pitched and stream-ordered allocations): it fails as the driver failed it; for PyTorch, \
             leave expandable_segments off"
        );
    }
}

/// `cuMemFree` of a pointer not charged as a plain one: a spill is freed, its charge released and
/// its host-backed bytes forgotten; any other pointer goes to the driver as it is. A free of a
/// plain pointer never comes here, so elastic memory costs it nothing.
#[cold]
#[inline(never)]
pub(super) fn free(accounting: Accounting, pointer: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some((charges, owner)) = accounting.ledger().take_charges(Family::Spill, pointer) else {
        return call();
    };
    let result = call();
    if result == CUDA_SUCCESS {
        forget_spill(accounting, pointer);
        charges.iter().for_each(|charge| accounting.release(*charge));
    } else {
        accounting.ledger().put_back(Family::Spill, pointer, charges, owner);
    }
    result
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

/// `cuMemFreeAsync` of a pointer not charged as a pool's or a plain one: a spill is freed once
/// `stream` reaches this point (its event is recorded now; the free itself happens at a later
/// synchronisation, refusal or tick, or at once, after the stream is synchronised, when no event
/// can be recorded); any other pointer goes to the driver as it is.
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
    match record_event(stream) {
        Some(event) => {
            let spills = accounting.spills();
            spills.deferred.lock().push(DeferredFree { event, pointer });
            spills.any.store(true, Ordering::Release);
            let _ = collect(accounting);
            CUDA_SUCCESS
        }
        None => {
            if let Some(synchronize) = real::cuStreamSynchronize() {
                // SAFETY: the application's stream, as it passed it.
                let _ = unsafe { synchronize(stream) };
            }
            free_now(accounting, pointer)
        }
    }
}

/// From the library's tick (every half second in a process that launches): [`collect`] with the
/// spills' context current on the tick's thread, so that a job whose allocator no longer calls
/// the driver (PyTorch's cache, once warm) still gets its memory back on the device.
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
    let context = spills.context.load(Ordering::Relaxed) as CUcontext;
    // SAFETY: a context of this process's (the latest spill's), or null; the tick's thread has
    // no other.
    if unsafe { set_current(context) } != CUDA_SUCCESS {
        return;
    }
    let _ = collect(accounting);
    // SAFETY: as above: the tick's thread goes back to having no current context.
    let _ = unsafe { set_current(std::ptr::null_mut()) };
}

/// Frees the deferred pointers whose streams have passed their free, and moves spilled memory
/// back to the device when it has room (at most every [`MOVE_BACK_PERIOD_NS`]). Called from
/// synchronisations, before a refusal and from the tick; the driver calls are made in relaxed
/// capture mode, so that another thread's stream capture is never invalidated by them. Whether a
/// deferred free was done.
#[inline(always)]
pub(super) fn collect(accounting: Accounting) -> bool {
    accounting.spills().any.load(Ordering::Acquire) && collect_in_relaxed_mode(accounting)
}

#[cold]
#[inline(never)]
fn collect_in_relaxed_mode(accounting: Accounting) -> bool {
    in_relaxed_capture_mode(|| collect_now(accounting))
}

fn collect_now(accounting: Accounting) -> bool {
    let spills = accounting.spills();
    let reached: Vec<DeferredFree> = {
        let mut deferred = spills.deferred.lock();
        let (reached, waiting) = std::mem::take(&mut *deferred)
            .into_iter()
            .partition(|free| event_reached(free.event));
        *deferred = waiting;
        reached
    };
    let freed = !reached.is_empty();
    for free in reached {
        destroy_event(free.event);
        let _ = free_now(accounting, free.pointer);
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

/// Frees a spilled pointer with the driver and releases its charge.
fn free_now(accounting: Accounting, pointer: u64) -> CUresult {
    let Some(free) = real::cuMemFree_v2() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let Some((charges, owner)) = accounting.ledger().take_charges(Family::Spill, pointer) else {
        // SAFETY: the pointer came from cuMemAllocManaged here.
        let status = unsafe { free(pointer) };
        if status == CUDA_SUCCESS {
            forget_spill(accounting, pointer);
        }
        return status;
    };
    // SAFETY: as above.
    let status = unsafe { free(pointer) };
    if status == CUDA_SUCCESS {
        forget_spill(accounting, pointer);
        charges.iter().for_each(|charge| accounting.release(*charge));
    } else {
        accounting.ledger().put_back(Family::Spill, pointer, charges, owner);
    }
    status
}

/// Moves the tails of the spills back onto their devices, oldest first, as much of each as its
/// device has room for. The driver's free memory is the current context's device's: each spill's
/// own context is made current while it moves (and the thread's own made current again after).
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
        let tail = pointer + (spill.bytes - spill.host_bytes);
        let moved = onto_device(tail, spill.host_bytes, room, spill.ordinal);
        room_by_device.insert(spill.ordinal, room - moved);
        if moved == 0 {
            continue;
        }
        if let Some(live) = spills.live.lock().get_mut(&pointer) {
            live.host_bytes -= moved;
        }
        record_host_backed(accounting, spill.region_index, moved, false);
        tracing::info!(
            "device {}: {moved} bytes moved back from host memory to the device",
            spill.ordinal
        );
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
fn onto_device(pointer: u64, bytes: u64, room: u64, ordinal: CUdevice) -> u64 {
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
    if prefetch(pointer, placed, device) {
        placed
    } else {
        advise(pointer, placed, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host());
        0
    }
}

/// Free device memory on the current device beyond the headroom, as the driver sees it.
fn device_room() -> Option<u64> {
    let get_info = real::cuMemGetInfo_v2()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers to locals; the current context's device is the spills'.
    if unsafe { get_info(&mut free, &mut total) } != CUDA_SUCCESS {
        return None;
    }
    let headroom = HEADROOM_BYTES.min(total as u64 / 16);
    Some((free as u64).saturating_sub(headroom))
}

fn record_host_backed(accounting: Accounting, region_index: usize, bytes: u64, more: bool) {
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
fn prefetch(pointer: u64, bytes: u64, location: CUmemLocation) -> bool {
    let (Some(prefetch), Some(synchronize)) = (real::cuMemPrefetchAsync_v2(), real::cuStreamSynchronize()) else {
        return false;
    };
    let context = current_context();
    let stream = own_stream(context);
    // SAFETY: a managed range this library allocated, on a stream it made in the current context
    // (or the legacy one).
    let status = unsafe { prefetch(pointer, bytes as usize, location, 0, stream) };
    // SAFETY: as above.
    let done = status == CUDA_SUCCESS && (unsafe { synchronize(stream) }) == CUDA_SUCCESS;
    if !done {
        // A context destroyed and its handle reused leaves a stale stream: the next move makes one.
        OWN_STREAMS.lock().retain(|(of, _)| *of != context);
    }
    done
}

/// The library's own non-blocking streams for moves, by context (a stream belongs to one).
static OWN_STREAMS: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

/// The library's stream of `context` (the current one), made on first use; null (the legacy
/// stream) when none can be made.
fn own_stream(context: u64) -> CUstream {
    let mut streams = OWN_STREAMS.lock();
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
