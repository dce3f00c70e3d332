//! The sensor: how long the GPU really spent on a launch, measured by the library itself.
//!
//! A sampled launch is bracketed by two timing events recorded on its own stream (events from a
//! per-context pool, created with the real `cuEventCreate` and the default flags: timing
//! enabled). The background thread polls them with `cuEventQuery`, which never blocks, and reads
//! `cuEventElapsedTime` once the end event has completed. Streams execute in order, so the start
//! event completes when the work before the launch is done and the end event when the launch is.
//!
//! That distance is the launch's GPU time only if the GPU reaches the launch right after the start
//! event. When the GPU is faster than the host (small kernels, or a stream the limiter let drain),
//! it would reach the start event while the host is still submitting the launch, and the kernel
//! would be charged for the host's submission time. So the stream is held for the few
//! microseconds of the submission: a `cuStreamWaitValue32` on a word of pinned host memory goes
//! first, and the host releases it (writes the word) right after the end event is recorded. The
//! background thread releases every hold older than [`HOLD_RELEASE_NS`] too, so a launching thread
//! that is descheduled, or blocked in the driver, never holds the stream for long. Where stream
//! memory operations are not available, the host time of the launch call is taken off instead
//! when the stream was idle at the start.
//!
//! A measurement is kept only when the GPU cannot have waited on the host in the middle of it:
//! with a hold, only when the launching thread released the hold itself (a launch call that
//! outlasts the hold, as one that loads a module does, lets the GPU pass the start event early);
//! without one, only when the launch call was short ([`LONG_CALL_NS`]). Otherwise the launch is
//! charged like an unmeasured one and its key is measured again.
//!
//! A bracket reads a little more than the launch's own time: the GPU's launch latency and the
//! completion the end event waits for ([`BRACKET_OVERHEAD_NS`] is taken off). What it reads of the
//! front end's gaps between kernels no bracket can separate; NVML's trim takes that out where
//! NVML sees the GPU ([`super::correction`]).
//!
//! Pools are keyed by the context's unique id (`cuCtxGetId`, CUDA 12.0+), never by its handle
//! alone: a destroyed context's handle can come back for a new context, and its stale events must
//! then never be recorded again. Events of destroyed contexts are forgotten, never destroyed (their
//! handles may already name someone else's events), and so is their pinned word.

use parking_lot::Mutex;
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::overlap::{self, RecentStreams, WindowChoice};
use super::{FACTOR_UNIT, now_ns};
use crate::capture::in_relaxed_capture_mode;
use crate::hooks::real;
use crate::sys::cuda::{
    CU_EVENT_DEFAULT, CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE, CU_STREAM_WAIT_VALUE_GEQ,
    CUDA_ERROR_NOT_READY, CUDA_SUCCESS, CUcontext, CUdeviceptr, CUevent, CUresult, CUstream,
};

/// Samples in flight at most; beyond, launches go unmeasured (their charges are corrected by the
/// next measurement of their key).
pub const MAX_PENDING: usize = 64;
/// A window's leader waits this long at most for its probes and members to complete; then those
/// not complete count as covering the rest of its bracket.
pub const WINDOW_TIMEOUT_NS: u64 = 200_000_000;
/// Contexts with pools; the least recently used pool is forgotten beyond.
const MAX_POOLS: usize = 16;
/// A hold on a stream is released by the background thread after this long at the latest.
pub const HOLD_RELEASE_NS: u64 = 2_000_000;
/// Without a hold, a sample whose launch call took longer than this on the host is not kept: far
/// above a launch call (microseconds), far below a module load (milliseconds), which lets the GPU
/// pass the start event early (docs/compute-limit.md, "How it is measured").
pub const LONG_CALL_NS: u64 = 500_000;
/// What an event pair adds to a launch it brackets: the GPU's launch latency and the completion
/// the end event waits for, time in which no kernel executes (NVML counts it idle). Taken off every
/// measurement, never more than a third of it (docs/compute-limit.md, "The bracket's own time").
pub const BRACKET_OVERHEAD_NS: u64 = 1_000;

/// What a bracket's reading says of its launch: the reading less [`BRACKET_OVERHEAD_NS`], never
/// less than two thirds of it.
pub fn without_bracket_overhead(reading_ns: u64) -> u64 {
    reading_ns - BRACKET_OVERHEAD_NS.min(reading_ns / 3)
}

/// Cleared when the driver refuses a stream wait: holds are not tried again.
static HOLDS_WORK: AtomicBool = AtomicBool::new(true);

/// What a sample is about, handed back with its measurement.
#[derive(Clone, Copy, Debug)]
pub struct SampleInfo {
    pub key: u64,
    /// What the launch was charged.
    pub charged: u64,
    /// Region index of the device.
    pub region_index: usize,
}

/// A completed sample: its launch and its GPU time.
pub struct Measured {
    pub info: SampleInfo,
    pub gpu_ns: u64,
}

/// A word of pinned host memory the GPU can wait on. Never freed (see the module comment).
#[derive(Clone, Copy)]
struct Gate {
    host: usize,
    device: CUdeviceptr,
}

impl Gate {
    /// Whether the GPU has been let past the wait for `sequence` already.
    fn released(&self, sequence: u32) -> bool {
        (self.word().load(Ordering::Acquire).wrapping_sub(sequence) as i32) >= 0
    }

    fn word(&self) -> &'static AtomicU32 {
        // SAFETY: `host` is a 4-byte aligned word of pinned memory this library allocated and
        // never frees; the GPU only reads it.
        unsafe { AtomicU32::from_ptr(self.host as *mut u32) }
    }

    /// Lets the GPU past every wait up to `sequence` (wrapping comparison, as the GPU's).
    fn release(&self, sequence: u32) {
        let word = self.word();
        let _ = word.fetch_update(Ordering::Release, Ordering::Relaxed, |current| {
            ((sequence.wrapping_sub(current) as i32) > 0).then_some(sequence)
        });
    }
}

/// A sampled launch between its two event records.
pub struct InFlight {
    info: SampleInfo,
    stream: CUstream,
    pool: (usize, u64),
    start: usize,
    end: usize,
    /// The stream is held until this gate reaches this sequence number.
    hold: Option<(Gate, u32)>,
    /// The stream had nothing queued when the start event was recorded.
    idle: bool,
    submitted_ns: u64,
    /// How the sample tells the streams' overlap ([`overlap`]).
    overlap: Overlap,
}

impl InFlight {
    fn release(&mut self) {
        if let Some((gate, sequence)) = self.hold.take() {
            gate.release(sequence);
        }
    }
}

impl Drop for InFlight {
    /// A hold is never left behind, whatever path the launch took.
    fn drop(&mut self) {
        self.release();
    }
}

struct Pending {
    info: SampleInfo,
    pool: (usize, u64),
    start: usize,
    end: usize,
    /// Host time of the launch call, taken off when the stream was idle and not held.
    host_gap_ns: u64,
    overlap: Overlap,
}

/// A sample's part in measuring the overlap of the device's streams ([`overlap`]).
#[derive(Clone, Debug, Default)]
enum Overlap {
    /// No other stream was active: it counts in full.
    #[default]
    Alone,
    /// Others were active but another window was open: it says nothing.
    Unseen,
    /// It leads a window: the probes recorded on the other active streams `(stream, event)`.
    Leads { window: u64, probes: Vec<(usize, usize)> },
}

impl Overlap {
    fn probe_events(&self) -> impl Iterator<Item = usize> + '_ {
        let probes = match self {
            Overlap::Leads { probes, .. } => probes.as_slice(),
            _ => &[],
        };
        probes.iter().map(|&(_, event)| event)
    }
}

/// A window: the launches of the other streams while a sample that leads it runs are bracketed
/// (members), so that the time they had work beside it is known ([`overlap`]).
struct Window {
    id: u64,
    pool: (usize, u64),
    leader: usize,
    opened_ns: u64,
    until_ns: u64,
    /// Members begun and not yet ended.
    running: usize,
    /// Members ended: `(stream, start event, end event)`.
    members: Vec<MemberEvents>,
}

/// An ended member of a window: its stream, its start and end events.
type MemberEvents = (usize, usize, usize);

/// A launch bracketed as a member of a window, between its two records.
pub struct Member {
    window: u64,
    stream: CUstream,
    pool: (usize, u64),
    start: usize,
    end: usize,
}

struct Pool {
    context: usize,
    id: u64,
    free: Vec<usize>,
    created: usize,
    last_use: u64,
    /// None when pinned memory could not be had.
    gate: Option<Gate>,
    /// Last sequence number handed out, and when.
    issued: u32,
    issued_ns: u64,
}

impl Pool {
    /// One event of the pool, created while the pool has room.
    fn take_event(&mut self) -> Option<usize> {
        match self.free.pop() {
            Some(event) => Some(event),
            // Two events per sample in flight.
            None if self.created < 2 * MAX_PENDING => {
                let event = create_event()?;
                self.created += 1;
                Some(event)
            }
            None => None,
        }
    }
}

#[derive(Default)]
struct State {
    pools: Vec<Pool>,
    pending: Vec<Pending>,
    uses: u64,
    windows: Vec<Window>,
    next_window: u64,
}

#[derive(Default)]
pub struct Sensor {
    state: Mutex<State>,
    /// Samples taken and not yet measured or dropped.
    outstanding: AtomicUsize,
    /// The device's streams that launched recently.
    recent: RecentStreams,
    /// How much the container's brackets overlap on the GPU, and its factor in thousandths (0
    /// before the first sample: 1).
    overlap: Mutex<overlap::Window>,
    overlap_permille: AtomicU64,
    /// Until when (ns) the open window takes members; when the last one opened, and its leader's
    /// stream (whose launches are never its members: a process of one stream takes no lock).
    window_until: AtomicU64,
    window_opened: AtomicU64,
    window_leader: AtomicUsize,
}

/// The unique id of `context` (0 when the driver predates `cuCtxGetId`).
fn context_id(context: CUcontext) -> u64 {
    let Some(get_id) = real::quiet::cuCtxGetId() else {
        return 0;
    };
    let mut id = 0u64;
    // SAFETY: a live context (current on this thread) and a valid out-pointer.
    let status = unsafe { get_id(context, &mut id) };
    if status == CUDA_SUCCESS { id } else { 0 }
}

fn current_context() -> Option<CUcontext> {
    let get = real::cuCtxGetCurrent()?;
    let mut context: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    let status = unsafe { get(&mut context) };
    (status == CUDA_SUCCESS && !context.is_null()).then_some(context)
}

/// A timing event of the current context, created in relaxed capture mode (on the launching
/// thread, as the pinned word is).
fn create_event() -> Option<usize> {
    let create = real::cuEventCreate()?;
    let mut event: CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; default flags keep timing enabled.
    let status = in_relaxed_capture_mode(|| unsafe { create(&mut event, CU_EVENT_DEFAULT as c_uint) });
    (status == CUDA_SUCCESS && !event.is_null()).then_some(event as usize)
}

/// A pinned, device-mapped word for the current context (portable: any context may wait on it).
fn create_gate() -> Option<Gate> {
    let (alloc, device_pointer) = (real::cuMemHostAlloc()?, real::cuMemHostGetDevicePointer_v2()?);
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; 64 bytes, pinned, mapped into the device's address space.
    let status = unsafe {
        alloc(
            &mut host,
            64,
            (CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP) as c_uint,
        )
    };
    if status != CUDA_SUCCESS || host.is_null() || !(host as usize).is_multiple_of(4) {
        return None;
    }
    // SAFETY: fresh, exclusively owned memory of at least 4 bytes.
    unsafe { (host as *mut u32).write_volatile(0) };
    let mut device: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer and the mapped allocation just made.
    let status = unsafe { device_pointer(&mut device, host, 0) };
    (status == CUDA_SUCCESS && device != 0).then_some(Gate {
        host: host as usize,
        device,
    })
}

/// Makes `stream` wait until the gate's word reaches `sequence`.
fn hold(stream: CUstream, gate: Gate, sequence: u32) -> bool {
    if !HOLDS_WORK.load(Ordering::Relaxed) {
        return false;
    }
    let Some(wait) = real::quiet::cuStreamWaitValue32_v2() else {
        HOLDS_WORK.store(false, Ordering::Relaxed);
        return false;
    };
    // SAFETY: the application's stream and a mapped word that lives for the process.
    let status = unsafe { wait(stream, gate.device, sequence, CU_STREAM_WAIT_VALUE_GEQ as c_uint) };
    if status != CUDA_SUCCESS {
        HOLDS_WORK.store(false, Ordering::Relaxed);
        return false;
    }
    true
}

fn record(event: usize, stream: CUstream) -> bool {
    let Some(record) = real::cuEventRecord() else {
        return false;
    };
    // SAFETY: an event of this context's pool and the application's stream handle.
    unsafe { record(event as CUevent, stream) == CUDA_SUCCESS }
}

/// Whether `stream` has nothing queued.
fn stream_idle(stream: CUstream) -> bool {
    query_stream(stream) == Some(CUDA_SUCCESS)
}

/// `cuStreamQuery` of `stream` (`None` without the entry point), in relaxed capture mode.
fn query_stream(stream: CUstream) -> Option<CUresult> {
    let query = real::cuStreamQuery()?;
    // SAFETY: the application's stream handle; the query does not block.
    Some(in_relaxed_capture_mode(|| unsafe { query(stream) }))
}

/// Outcome of polling one sample.
enum Poll {
    Done(u64),
    NotReady,
    Lost,
}

fn poll(start: usize, end: usize) -> Poll {
    let (Some(query), Some(elapsed)) = (real::cuEventQuery(), real::cuEventElapsedTime()) else {
        return Poll::Lost;
    };
    // SAFETY: events this library created and recorded.
    match unsafe { query(end as CUevent) } {
        CUDA_SUCCESS => {}
        CUDA_ERROR_NOT_READY => return Poll::NotReady,
        _ => return Poll::Lost,
    }
    let mut milliseconds = 0f32;
    // SAFETY: a valid out-pointer and two events recorded with timing enabled.
    match unsafe { elapsed(&mut milliseconds, start as CUevent, end as CUevent) } {
        CUDA_SUCCESS if milliseconds.is_finite() && milliseconds >= 0.0 => {
            Poll::Done((f64::from(milliseconds) * 1e6) as u64)
        }
        CUDA_ERROR_NOT_READY => Poll::NotReady,
        _ => Poll::Lost,
    }
}

/// The signed time (ns) from `start` to `event`, both complete; `None` while `event` is not
/// complete or when the driver cannot tell.
fn offset(start: usize, event: usize) -> Option<i64> {
    let elapsed = real::cuEventElapsedTime()?;
    let mut milliseconds = 0f32;
    // SAFETY: a valid out-pointer and two events of one context recorded with timing enabled.
    let status = unsafe { elapsed(&mut milliseconds, start as CUevent, event as CUevent) };
    (status == CUDA_SUCCESS && milliseconds.is_finite() && milliseconds.abs() < 1e6)
        .then(|| (f64::from(milliseconds) * 1e6) as i64)
}

/// Whether `event` has completed.
fn complete(event: usize) -> bool {
    real::cuEventQuery().is_some_and(|query| {
        // SAFETY: an event this library created and recorded.
        let status = unsafe { query(event as CUevent) };
        status == CUDA_SUCCESS
    })
}

/// What [`Sensor::take`] hands out for one sample.
struct Taken {
    start: usize,
    end: usize,
    hold: Option<(Gate, u32)>,
}

impl Sensor {
    /// Samples in flight.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Two events of the context's pool, and a hold's number.
    fn take(&self, context: usize, id: u64) -> Option<Taken> {
        let mut state = self.state.lock();
        state.uses += 1;
        let uses = state.uses;
        let position = match state.pools.iter().position(|p| p.context == context && p.id == id) {
            Some(position) => position,
            None => {
                if state.pools.len() >= MAX_POOLS
                    && let Some(oldest) = (0..state.pools.len()).min_by_key(|&i| state.pools[i].last_use)
                {
                    // Its events are forgotten, not destroyed: the context may be gone.
                    state.pools.swap_remove(oldest);
                }
                state.pools.push(Pool {
                    context,
                    id,
                    free: Vec::new(),
                    created: 0,
                    last_use: uses,
                    // Pinned memory is allocated on the launching thread: in relaxed mode, as a
                    // capture under way elsewhere would refuse it.
                    gate: if HOLDS_WORK.load(Ordering::Relaxed) {
                        in_relaxed_capture_mode(create_gate)
                    } else {
                        None
                    },
                    issued: 0,
                    issued_ns: 0,
                });
                state.pools.len() - 1
            }
        };
        let pool = &mut state.pools[position];
        pool.last_use = uses;
        let start = pool.take_event()?;
        let Some(end) = pool.take_event() else {
            pool.free.push(start);
            return None;
        };
        let hold = pool.gate.map(|gate| {
            pool.issued = pool.issued.wrapping_add(1);
            pool.issued_ns = now_ns();
            (gate, pool.issued)
        });
        Some(Taken { start, end, hold })
    }

    fn give_back(state: &mut State, pool: (usize, u64), events: impl IntoIterator<Item = usize>) {
        if let Some(pool) = state.pools.iter_mut().find(|p| (p.context, p.id) == pool) {
            pool.free.extend(events);
        }
    }

    /// Holds `stream` and records the start event of a sampled launch on it, before the launch is
    /// submitted. `None` when no sample can be taken (too many in flight, no events, no context).
    pub fn begin(&self, stream: CUstream, info: SampleInfo) -> Option<InFlight> {
        if self.outstanding.load(Ordering::Relaxed) >= MAX_PENDING {
            return None;
        }
        let context = current_context()?;
        let pool = (context as usize, context_id(context));
        let idle = stream_idle(stream);
        let taken = self.take(pool.0, pool.1)?;
        let mut launch = InFlight {
            info,
            stream,
            pool,
            start: taken.start,
            end: taken.end,
            hold: taken.hold.filter(|&(gate, sequence)| hold(stream, gate, sequence)),
            idle,
            submitted_ns: 0,
            overlap: Overlap::Alone,
        };
        if !record(launch.start, stream) {
            launch.release();
            let mut state = self.state.lock();
            Self::give_back(&mut state, pool, [launch.start, launch.end]);
            return None;
        }
        launch.submitted_ns = now_ns();
        // Counted from here, so that the background thread polls often while a hold is out.
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        Some(launch)
    }

    /// Queues an ended sample for the background thread, or gives its events back when it did not
    /// end. Returns whether it is in flight.
    fn finish(&self, launch: &InFlight, ended: bool, host_gap_ns: u64) -> bool {
        let mut state = self.state.lock();
        if !ended {
            Self::give_back(&mut state, launch.pool, [launch.start, launch.end]);
            Self::give_back(&mut state, launch.pool, launch.overlap.probe_events());
            self.outstanding.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        state.pending.push(Pending {
            info: launch.info,
            pool: launch.pool,
            start: launch.start,
            end: launch.end,
            host_gap_ns,
            overlap: launch.overlap.clone(),
        });
        true
    }

    /// Notes a limited launch on `stream` (the streams active recently are probed by samples).
    pub fn note_launch(&self, stream: CUstream, now: u64) {
        self.recent.note(stream, now);
    }

    /// The overlap factor charges are scaled by, in thousandths ([`overlap`]).
    pub fn overlap_permille(&self) -> u64 {
        match self.overlap_permille.load(Ordering::Relaxed) {
            0 => u64::from(FACTOR_UNIT),
            permille => permille,
        }
    }

    /// Forgets `stream` (being destroyed): it is never probed again.
    pub fn forget_stream(&self, stream: CUstream) {
        self.recent.forget(stream);
    }

    /// Takes one event of `pool` ([`Pool::take_event`]).
    fn pool_event(state: &mut State, pool: (usize, u64)) -> Option<usize> {
        state.pools.iter_mut().find(|p| (p.context, p.id) == pool)?.take_event()
    }

    /// After a sample's start was recorded: opens a window ([`overlap`]) when
    /// [`overlap::window_choice`] says so, with an event on each other stream of the device that
    /// launched recently (a probe, which completes when the work queued there now has run); with
    /// no such stream the window has no probes, and the streams that start launching during its
    /// bracket are its members. Streams being captured are left alone (an event recorded there
    /// would join the capture), and so are the default streams (the legacy one waits for every
    /// stream; the per-thread one is the calling thread's own).
    pub fn open_window(&self, launch: &mut InFlight, now: u64) {
        let Some(_shared) = super::runtime::probing() else {
            launch.overlap = Overlap::Unseen; // a stream is being destroyed
            return;
        };
        let others: Vec<CUstream> = self
            .recent
            .others(launch.stream, now)
            .filter(|&other| !overlap::is_default_stream(other))
            .collect();
        let choice = overlap::window_choice(
            !others.is_empty(),
            now,
            self.window_opened.load(Ordering::Relaxed),
            self.window_until.load(Ordering::Relaxed),
        );
        if choice == WindowChoice::Alone {
            return;
        }
        launch.overlap = Overlap::Unseen;
        if choice == WindowChoice::Unseen {
            return;
        }
        let mut probes = Vec::new();
        for other in others {
            if crate::capture::capturing(other) {
                continue;
            }
            let Some(event) = Self::pool_event(&mut self.state.lock(), launch.pool) else {
                break;
            };
            if record(event, other) {
                probes.push((other as usize, event));
            } else {
                Self::give_back(&mut self.state.lock(), launch.pool, [event]);
            }
        }
        let mut state = self.state.lock();
        state.next_window += 1;
        let window = state.next_window;
        state.windows.push(Window {
            id: window,
            pool: launch.pool,
            leader: launch.stream as usize,
            opened_ns: now,
            until_ns: now.saturating_add(overlap::WINDOW_NS),
            running: 0,
            members: Vec::new(),
        });
        self.window_opened.store(now, Ordering::Relaxed);
        self.window_leader.store(launch.stream as usize, Ordering::Relaxed);
        self.window_until
            .store(now.saturating_add(overlap::WINDOW_NS), Ordering::Relaxed);
        launch.overlap = Overlap::Leads { window, probes };
    }

    /// Before a launch on `stream` that is not sampled: brackets it as a member of the open
    /// window when it is another stream's and the window has room (its start recorded now; end it
    /// with [`Self::end_member`]). Never on a stream being captured.
    pub fn begin_member(&self, stream: CUstream, now: u64) -> Option<Member> {
        if now >= self.window_until.load(Ordering::Relaxed)
            || overlap::is_default_stream(stream)
            || self.window_leader.load(Ordering::Relaxed) == stream as usize
        {
            return None;
        }
        // The window's own checks first (no driver call): the leader's stream and a full window
        // are turned away at the cost of the lock alone.
        let (window, pool) = {
            let mut state = self.state.lock();
            let open = state.windows.iter_mut().rev().find(|w| now < w.until_ns)?;
            if open.leader == stream as usize || open.running + open.members.len() >= overlap::MAX_MEMBERS {
                return None;
            }
            open.running += 1;
            (open.id, open.pool)
        };
        let same_context = current_context().is_some_and(|context| (context as usize, context_id(context)) == pool);
        if !same_context || crate::capture::capturing(stream) {
            Self::member_gone(&mut self.state.lock(), window);
            return None;
        }
        let (start, end) = {
            let mut state = self.state.lock();
            let start = Self::pool_event(&mut state, pool);
            let end = Self::pool_event(&mut state, pool);
            match (start, end) {
                (Some(start), Some(end)) => (start, end),
                (start, end) => {
                    Self::give_back(&mut state, pool, start.into_iter().chain(end));
                    Self::member_gone(&mut state, window);
                    return None;
                }
            }
        };
        if record(start, stream) {
            return Some(Member {
                window,
                stream,
                pool,
                start,
                end,
            });
        }
        let mut state = self.state.lock();
        Self::give_back(&mut state, pool, [start, end]);
        Self::member_gone(&mut state, window);
        None
    }

    /// After a member's launch returned `status`: records its end and gives it to its window.
    pub fn end_member(&self, member: Member, status: CUresult) {
        let ended = status == CUDA_SUCCESS && record(member.end, member.stream);
        let mut state = self.state.lock();
        Self::member_gone(&mut state, member.window);
        match state.windows.iter_mut().find(|w| w.id == member.window) {
            Some(window) if ended => window.members.push((member.stream as usize, member.start, member.end)),
            _ => Self::give_back(&mut state, member.pool, [member.start, member.end]),
        }
    }

    fn member_gone(state: &mut State, window: u64) {
        if let Some(window) = state.windows.iter_mut().find(|w| w.id == window) {
            window.running = window.running.saturating_sub(1);
        }
    }

    /// How many of the container's streams had work on the GPU during a bracket of `reading` ns
    /// that began at `start`: 1 for its own, plus for each other stream the part of the bracket
    /// its work covered: from the start until its probe completed (the work queued there when the
    /// bracket's sample began), and its members' brackets (work launched there while it ran).
    /// `None` while a probe or member is not complete (and `wait` allows waiting).
    fn streams_busy(
        start: usize,
        reading: u64,
        probes: &[(usize, usize)],
        members: &[MemberEvents],
        wait: bool,
    ) -> Option<f64> {
        let mut spans: Vec<(usize, (i64, i64))> = Vec::new();
        for &(stream, probe) in probes {
            if complete(probe) {
                if let Some(end) = offset(start, probe) {
                    spans.push((stream, (0, end)));
                }
            } else if wait {
                return None;
            } else {
                spans.push((stream, (0, reading as i64)));
            }
        }
        for &(stream, from, to) in members {
            if !complete(to) {
                if wait {
                    return None;
                }
                continue;
            }
            if let (Some(from), Some(to)) = (offset(start, from), offset(start, to)) {
                spans.push((stream, (from, to)));
            }
        }
        let streams = overlap::streams_busy(reading, &mut spans);
        // A window that saw no other stream (a process of one stream opens one every spacing)
        // says nothing worth a line.
        if !spans.is_empty() {
            tracing::debug!(
                "compute limiter: {} probes and {} members: {streams:.2} streams busy during a bracket of {reading} ns",
                probes.len(),
                members.len()
            );
        }
        Some(streams)
    }

    /// Records the end event after the launch (whose status is `status`), releases the stream,
    /// and queues the sample for the background thread. Returns whether a sample is in flight:
    /// false when the launch failed or its measurement could not be trusted (see the module description).
    pub fn end(&self, mut launch: InFlight, status: CUresult) -> bool {
        let host_ns = now_ns().saturating_sub(launch.submitted_ns);
        let held = launch.hold.is_some();
        let trusted = match launch.hold {
            Some((gate, sequence)) => !gate.released(sequence),
            None => host_ns <= LONG_CALL_NS,
        };
        if !trusted {
            tracing::debug!(
                "compute limiter: a launch call took {} us on the host; its measurement is not kept",
                host_ns / 1000
            );
        }
        let ended = trusted && status == CUDA_SUCCESS && record(launch.end, launch.stream);
        launch.release();
        let host_gap_ns = if launch.idle && !held { host_ns } else { 0 };
        self.finish(&launch, ended, host_gap_ns)
    }

    /// Releases every hold issued more than [`HOLD_RELEASE_NS`] ago. Normally the launching
    /// thread has released it long before; this bounds how long a descheduled or blocked thread
    /// can hold its stream.
    pub fn release_stale_holds(&self, now: u64) {
        let state = self.state.lock();
        for pool in &state.pools {
            if let Some(gate) = pool.gate
                && now.saturating_sub(pool.issued_ns) >= HOLD_RELEASE_NS
            {
                gate.release(pool.issued);
            }
        }
    }

    /// Releases every hold at once (process exit). Never waits for the lock.
    pub fn release_all_holds(&self) {
        if let Some(state) = self.state.try_lock() {
            for pool in &state.pools {
                if let Some(gate) = pool.gate {
                    gate.release(pool.issued);
                }
            }
        }
    }

    /// Polls the samples in flight without blocking; returns the completed ones. The driver is
    /// called outside the lock, so launching threads never wait for it.
    pub fn completed(&self) -> Vec<Measured> {
        let batch = {
            let mut state = self.state.lock();
            std::mem::take(&mut state.pending)
        };
        if batch.is_empty() {
            return Vec::new();
        }
        let total = batch.len();
        let mut done = Vec::new();
        let mut waiting = Vec::new();
        let mut finished = Vec::new();
        let mut probe_events: Vec<((usize, u64), Vec<usize>)> = Vec::new();
        // (reading, streams busy during it) of each sample measured, and the windows they closed.
        let mut overlaps: Vec<(u64, f64)> = Vec::new();
        let mut closed: Vec<u64> = Vec::new();
        let now = now_ns();
        let windows: Vec<(u64, bool, bool, Vec<MemberEvents>)> = {
            let state = self.state.lock();
            state
                .windows
                .iter()
                .map(|w| {
                    let ready = now >= w.until_ns && w.running == 0;
                    let expired = now.saturating_sub(w.opened_ns) >= WINDOW_TIMEOUT_NS;
                    (w.id, ready, expired, w.members.clone())
                })
                .collect()
        };
        for sample in batch {
            let polled = poll(sample.start, sample.end);
            if let (Poll::Done(reading), Overlap::Leads { window, probes }) = (&polled, &sample.overlap) {
                let found = windows.iter().find(|w| w.0 == *window);
                let busy = match found {
                    Some((_, ready, expired, members)) if *ready || *expired => {
                        Self::streams_busy(sample.start, *reading, probes, members, !*expired)
                    }
                    Some(_) => None,
                    None => Self::streams_busy(sample.start, *reading, probes, &[], false),
                };
                let Some(busy) = busy else {
                    waiting.push(sample);
                    continue;
                };
                overlaps.push((*reading, busy));
                closed.push(*window);
            } else if let (Poll::Done(reading), Overlap::Alone) = (&polled, &sample.overlap) {
                overlaps.push((*reading, 1.0));
            }
            match polled {
                Poll::Done(elapsed) => {
                    let elapsed = without_bracket_overhead(elapsed);
                    let gpu = if sample.host_gap_ns > 0 {
                        // Never below a quarter of what the events saw: a host thread descheduled
                        // right after its launch must not make the kernel look free.
                        elapsed.saturating_sub(sample.host_gap_ns).max(elapsed / 4)
                    } else {
                        elapsed
                    };
                    done.push(Measured {
                        info: sample.info,
                        gpu_ns: gpu,
                    });
                    finished.push((sample.pool, [sample.start, sample.end]));
                    let probes: Vec<usize> = sample.overlap.probe_events().collect();
                    probe_events.push((sample.pool, probes));
                }
                Poll::NotReady => waiting.push(sample),
                // A destroyed context or a driver error: forget the sample and its events.
                Poll::Lost => {}
            }
        }
        self.outstanding.fetch_sub(total - waiting.len(), Ordering::Relaxed);
        let mut state = self.state.lock();
        state.pending.extend(waiting);
        for (pool, events) in finished {
            Self::give_back(&mut state, pool, events);
        }
        for (pool, events) in probe_events {
            Self::give_back(&mut state, pool, events);
        }
        // Windows whose leader is measured, and windows whose leader was lost, are closed: their
        // members' events go back.
        let leading: Vec<u64> = state
            .pending
            .iter()
            .filter_map(|p| match p.overlap {
                Overlap::Leads { window, .. } => Some(window),
                _ => None,
            })
            .collect();
        let mut ended = Vec::new();
        state.windows.retain_mut(|w| {
            let done = closed.contains(&w.id) || (w.running == 0 && now >= w.until_ns && !leading.contains(&w.id));
            if done {
                ended.push((w.pool, std::mem::take(&mut w.members)));
            }
            !done
        });
        for (pool, members) in ended {
            Self::give_back(
                &mut state,
                pool,
                members.into_iter().flat_map(|(_, start, end)| [start, end]),
            );
        }
        drop(state);
        if !overlaps.is_empty() {
            let mut window = self.overlap.lock();
            for (reading, streams) in overlaps {
                window.add((reading as f64 / streams) as u64, reading);
            }
            let permille = (window.factor() * f64::from(FACTOR_UNIT)).round() as u64;
            self.overlap_permille.store(permille.max(1), Ordering::Relaxed);
        }
        done
    }
}
