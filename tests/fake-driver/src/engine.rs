//! The simulated engine: one per physical device per process. Kernels of different created streams
//! run side by side, as on a GPU (each takes its own duration, whatever runs beside it); the default
//! streams (legacy and per-thread alike) serialise with all work, and created streams wait for
//! work queued on the default streams before them. A launch returns at once; its kernel starts at
//! max(now, end of the work queued before it on its stream, the stream's event waits) and ends
//! `duration` later. The time it adds to the device's busy stretches (kernels that overlap are
//! counted once) is added to the truth's busy time at launch. Synchronisation sleeps until the relevant end:
//! a stream's last work, the device's engine for the default streams (legacy and per-thread
//! alike) and contexts. Events complete when the work queued before them on their stream ends;
//! with `FAKE_CUDA_EVENT_NS`, that much later, and the work after them waits as long (idle GPU
//! time: on the H200 a pair of events around a kernel reads 1-2.9 us more than the kernel's time
//! back to back, `tests/gpu/bracket_probe.cu`). With `FAKE_CUDA_LAUNCH_GAP_NS`, a kernel queued
//! behind other work starts that long after it ends (idle GPU time, which a bracket around the
//! kernel reads: on the H200 a training step's brackets read 3-4% more than NVML saw busy).
//!
//! Lazy loading: the first launch of each function (any launch path, a launch into a capturing
//! stream included, as CUDA loads a kernel when it is captured) sleeps `FAKE_CUDA_MODULE_LOAD_US`
//! inside the launch call before its kernel is queued; a launch of the same function meanwhile, on
//! another thread, waits for the same load. The first launch of each executable graph does the
//! same (its upload, [`crate::graph`]). The state's lock is not held while sleeping.

use std::ffi::{c_int, c_uint, c_void};

use crate::cuda::*;
use crate::ffi::{CuResult, cu, get, put};
use crate::state::{self, Event, STREAM_LEGACY, STREAM_PER_THREAD, State, Stream, config, initialised, now_ns};

/// When the first launch's load (of a function, or a graph's upload) ends: on the first launch,
/// `FAKE_CUDA_MODULE_LOAD_US` from now; after that, when that load ended (in the past, or still
/// ahead for a launch racing with the first).
pub fn first_launch_ends(loaded_at: &mut Option<u64>) -> u64 {
    *loaded_at.get_or_insert_with(|| now_ns().saturating_add(config().module_load_us.saturating_mul(1_000)))
}

/// Adds the stretch `start..end` to a device's busy stretches (those ended by `now` are dropped: no
/// kernel queued from now on starts before it); returns how much of it no other kernel occupies.
fn occupy(stretches: &mut Vec<(u64, u64)>, now: u64, start: u64, end: u64) -> u64 {
    stretches.retain(|&(_, stretch_end)| stretch_end > now);
    let shared: u64 = stretches
        .iter()
        .map(|&(from, to)| to.min(end).saturating_sub(from.max(start)))
        .sum();
    let position = stretches.partition_point(|&(from, _)| from < start);
    stretches.insert(position, (start, end));
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(stretches.len());
    for &(from, to) in stretches.iter() {
        match merged.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(to),
            _ => merged.push((from, to)),
        }
    }
    *stretches = merged;
    (end - start).saturating_sub(shared)
}

/// Where work on a stream goes.
pub struct Target {
    /// The explicit stream, `None` for the default streams.
    pub stream: Option<usize>,
    pub ordinal: i32,
    pub phys: usize,
    /// The stream's handle when it is capturing.
    pub capturing: Option<usize>,
}

impl State {
    pub fn stream_target(&self, stream: CUstream) -> CuResult<Target> {
        let handle = stream as usize;
        if matches!(handle, 0 | STREAM_LEGACY | STREAM_PER_THREAD) {
            let current = self.current()?;
            return Ok(Target {
                stream: None,
                ordinal: current.ordinal,
                phys: current.phys,
                capturing: None,
            });
        }
        let s = self.streams.get(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let capturing = s.capture.as_ref().map(|_| handle);
        Ok(Target {
            stream: Some(handle),
            ordinal: s.ordinal,
            phys: s.phys,
            capturing,
        })
    }

    /// End (ns) of the work queued so far where `target` points: a created stream's own work and
    /// the default streams' before it; for the default streams, all the device's work.
    pub fn stream_end(&self, target: &Target) -> u64 {
        match target.stream.and_then(|h| self.streams.get(&h)) {
            Some(stream) => stream.last_end.max(self.default_end[target.phys]),
            None => self.engine_end[target.phys],
        }
    }

    /// Queues `ns` of kernel work; returns when it will end.
    pub fn enqueue(&mut self, target: &Target, ns: u64) -> u64 {
        let now = now_ns();
        let wait = target
            .stream
            .and_then(|h| self.streams.get(&h))
            .map_or(0, |s| s.wait_until);
        // Behind other work, the kernel starts the launch gap after it (idle time).
        let after_queued = self.stream_end(target).saturating_add(config().launch_gap_ns);
        let start = now.max(after_queued).max(wait);
        let end = start.saturating_add(ns);
        let phys = target.phys;
        self.engine_end[phys] = self.engine_end[phys].max(end);
        match target.stream.and_then(|h| self.streams.get_mut(&h)) {
            Some(stream) => stream.last_end = end,
            None => self.default_end[phys] = end,
        }
        let added = occupy(&mut self.occupied[phys], now, start, end);
        self.add_busy(phys, added, now);
        end
    }

    /// Work queued where `target` points from now on starts at `at` at the earliest (after an
    /// event's own time).
    fn queue_waits_until(&mut self, target: &Target, at: u64) {
        let phys = target.phys;
        self.engine_end[phys] = self.engine_end[phys].max(at);
        match target.stream.and_then(|h| self.streams.get_mut(&h)) {
            Some(stream) => stream.last_end = stream.last_end.max(at),
            None => self.default_end[phys] = self.default_end[phys].max(at),
        }
    }

    /// Loads `f` on its first launch: returns when its load ends (sleep until then, unlocked).
    fn load_function(&mut self, f: CUfunction, stream: CUstream) -> CuResult<u64> {
        self.current()?;
        self.stream_target(stream)?;
        let function = self.functions.get_mut(&(f as usize)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok(first_launch_ends(&mut function.loaded_at))
    }

    pub fn launch(&mut self, f: CUfunction, stream: CUstream) -> CuResult {
        self.current()?;
        let duration = self
            .functions
            .get_mut(&(f as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?
            .next_duration();
        let target = self.stream_target(stream)?;
        match target.capturing {
            Some(stream) => self.capture_kernel(stream, duration),
            None => {
                self.enqueue(&target, duration);
                Ok(())
            }
        }
    }

    /// Deadline of a synchronisation on `stream`, after trimming the device's pools.
    fn sync_deadline(&mut self, stream: CUstream) -> CuResult<u64> {
        let target = self.stream_target(stream)?;
        if target.capturing.is_some() {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        self.trim_pools_on_sync(target.phys);
        Ok(self.stream_end(&target))
    }
}

fn launch(f: CUfunction, dims: [c_uint; 6], stream: CUstream) -> CuResult {
    if dims.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let loaded = initialised()?.load_function(f, stream)?;
    state::sleep_until(loaded);
    initialised()?.launch(f, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: CUfunction,
    gridDimX: c_uint,
    gridDimY: c_uint,
    gridDimZ: c_uint,
    blockDimX: c_uint,
    blockDimY: c_uint,
    blockDimZ: c_uint,
    _sharedMemBytes: c_uint,
    hStream: CUstream,
    _kernelParams: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    cu(|| {
        launch(
            f,
            [gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ],
            hStream,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
    f: CUfunction,
    gridDimX: c_uint,
    gridDimY: c_uint,
    gridDimZ: c_uint,
    blockDimX: c_uint,
    blockDimY: c_uint,
    blockDimZ: c_uint,
    _sharedMemBytes: c_uint,
    hStream: CUstream,
    _kernelParams: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    cu(|| {
        launch(
            f,
            [gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ],
            hStream,
        )
    })
}

fn launch_ex(config: *const CUlaunchConfig, f: CUfunction) -> CuResult {
    // SAFETY: the caller passes a valid launch configuration (null is rejected).
    let c = unsafe { get(config) }?;
    launch(
        f,
        [
            c.gridDimX,
            c.gridDimY,
            c.gridDimZ,
            c.blockDimX,
            c.blockDimY,
            c.blockDimZ,
        ],
        c.hStream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
    f: CUfunction,
    _kernelParams: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    cu(|| launch_ex(config, f))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const CUlaunchConfig,
    f: CUfunction,
    _kernelParams: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    cu(|| launch_ex(config, f))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
    f: CUfunction,
    gridDimX: c_uint,
    gridDimY: c_uint,
    gridDimZ: c_uint,
    blockDimX: c_uint,
    blockDimY: c_uint,
    blockDimZ: c_uint,
    _sharedMemBytes: c_uint,
    hStream: CUstream,
    _kernelParams: *mut *mut c_void,
) -> CUresult {
    cu(|| {
        launch(
            f,
            [gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ],
            hStream,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel_ptsz(
    f: CUfunction,
    gridDimX: c_uint,
    gridDimY: c_uint,
    gridDimZ: c_uint,
    blockDimX: c_uint,
    blockDimY: c_uint,
    blockDimZ: c_uint,
    _sharedMemBytes: c_uint,
    hStream: CUstream,
    _kernelParams: *mut *mut c_void,
) -> CUresult {
    cu(|| {
        launch(
            f,
            [gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ],
            hStream,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernelMultiDevice(
    launchParamsList: *mut CUDA_LAUNCH_PARAMS,
    numDevices: c_uint,
    _flags: c_uint,
) -> CUresult {
    cu(|| {
        if launchParamsList.is_null() || numDevices == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for i in 0..numDevices as usize {
            // SAFETY: the caller passes an array of `numDevices` launch parameters.
            let p = unsafe { get(launchParamsList.add(i)) }?;
            launch(
                p.function,
                [
                    p.gridDimX,
                    p.gridDimY,
                    p.gridDimZ,
                    p.blockDimX,
                    p.blockDimY,
                    p.blockDimZ,
                ],
                p.hStream,
            )?;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunch(f: CUfunction) -> CUresult {
    cu(|| launch(f, [1; 6], std::ptr::null_mut()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchGrid(f: CUfunction, grid_width: c_int, grid_height: c_int) -> CUresult {
    cu(|| {
        let (w, h) = (grid_width.max(0) as c_uint, grid_height.max(0) as c_uint);
        launch(f, [w, h, 1, 1, 1, 1], std::ptr::null_mut())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchGridAsync(
    f: CUfunction,
    grid_width: c_int,
    grid_height: c_int,
    hStream: CUstream,
) -> CUresult {
    cu(|| {
        let (w, h) = (grid_width.max(0) as c_uint, grid_height.max(0) as c_uint);
        launch(f, [w, h, 1, 1, 1, 1], hStream)
    })
}

fn stream_create(phStream: *mut CUstream) -> CuResult {
    if phStream.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut state = initialised()?;
    let current = state.current()?;
    let handle = state.new_handle();
    let stream = Stream {
        ordinal: current.ordinal,
        phys: current.phys,
        last_end: 0,
        wait_until: 0,
        capture: None,
    };
    state.streams.insert(handle, stream);
    // SAFETY: out-pointer from the caller, checked non-null.
    unsafe { put(phStream, handle as CUstream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(phStream: *mut CUstream, _Flags: c_uint) -> CUresult {
    cu(|| stream_create(phStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    phStream: *mut CUstream,
    _flags: c_uint,
    _priority: c_int,
) -> CUresult {
    cu(|| stream_create(phStream))
}

fn stream_destroy(stream: CUstream) -> CuResult {
    initialised()?
        .streams
        .remove(&(stream as usize))
        .map(|_| ())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy(hStream: CUstream) -> CUresult {
    cu(|| stream_destroy(hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(hStream: CUstream) -> CUresult {
    cu(|| stream_destroy(hStream))
}

fn stream_synchronize(stream: CUstream) -> CuResult {
    let deadline = initialised()?.sync_deadline(stream)?;
    state::sleep_until(deadline);
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    cu(|| stream_synchronize(hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize_ptsz(hStream: CUstream) -> CUresult {
    cu(|| stream_synchronize(hStream))
}

fn stream_query(stream: CUstream) -> CuResult {
    let mut state = initialised()?;
    let target = state.stream_target(stream)?;
    if let Some(handle) = target.capturing {
        // Not allowed during a capture: the real driver invalidates it.
        if let Some(capture) = state.streams.get_mut(&handle).and_then(|s| s.capture.as_mut()) {
            capture.invalidated = true;
        }
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    state.refuse_unsafe_call()?;
    if now_ns() < state.stream_end(&target) {
        Err(CUDA_ERROR_NOT_READY)
    } else {
        Ok(())
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery(hStream: CUstream) -> CUresult {
    cu(|| stream_query(hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery_ptsz(hStream: CUstream) -> CUresult {
    cu(|| stream_query(hStream))
}

fn stream_wait_event(stream: CUstream, event: CUevent) -> CuResult {
    let mut state = initialised()?;
    let target = state.stream_target(stream)?;
    let done_at = state
        .events
        .get(&(event as usize))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?
        .done_at
        .unwrap_or(0);
    match target.stream.and_then(|h| state.streams.get_mut(&h)) {
        Some(s) => s.wait_until = s.wait_until.max(done_at),
        None => {
            state.engine_end[target.phys] = state.engine_end[target.phys].max(done_at);
            state.default_end[target.phys] = state.default_end[target.phys].max(done_at);
        }
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(hStream: CUstream, hEvent: CUevent, _Flags: c_uint) -> CUresult {
    cu(|| stream_wait_event(hStream, hEvent))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent_ptsz(hStream: CUstream, hEvent: CUevent, _Flags: c_uint) -> CUresult {
    cu(|| stream_wait_event(hStream, hEvent))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let current = state.current()?;
        state.trim_pools_on_sync(current.phys);
        let deadline = state.engine_end[current.phys];
        drop(state);
        state::sleep_until(deadline);
        Ok(())
    })
}

/// CUDA 13's form: synchronises the given context (null: the current one).
#[cfg(cuda_api = "13000")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize_v2(ctx: CUcontext) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let target = if ctx.is_null() {
            state.current()?
        } else {
            state.context(ctx as usize)?
        };
        state.trim_pools_on_sync(target.phys);
        let deadline = state.engine_end[target.phys];
        drop(state);
        state::sleep_until(deadline);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint) -> CUresult {
    cu(|| {
        if phEvent.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut state = initialised()?;
        state.current()?;
        let handle = state.new_handle();
        state.events.insert(
            handle,
            Event {
                flags: Flags,
                done_at: None,
            },
        );
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(phEvent, handle as CUevent) }
    })
}

fn event_destroy(event: CUevent) -> CuResult {
    initialised()?
        .events
        .remove(&(event as usize))
        .map(|_| ())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy(hEvent: CUevent) -> CUresult {
    cu(|| event_destroy(hEvent))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(hEvent: CUevent) -> CUresult {
    cu(|| event_destroy(hEvent))
}

fn event_record(event: CUevent, stream: CUstream) -> CuResult {
    let mut state = initialised()?;
    let target = state.stream_target(stream)?;
    if !state.events.contains_key(&(event as usize)) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if target.capturing.is_some() {
        // An event record node; the graph runs its kernels back to back anyway.
        return Ok(());
    }
    let done_at = state
        .stream_end(&target)
        .max(now_ns())
        .saturating_add(config().event_ns);
    if config().event_ns > 0 {
        state.queue_waits_until(&target, done_at);
    }
    if let Some(e) = state.events.get_mut(&(event as usize)) {
        e.done_at = Some(done_at);
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(hEvent: CUevent, hStream: CUstream) -> CUresult {
    cu(|| event_record(hEvent, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord_ptsz(hEvent: CUevent, hStream: CUstream) -> CUresult {
    cu(|| event_record(hEvent, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecordWithFlags(hEvent: CUevent, hStream: CUstream, _flags: c_uint) -> CUresult {
    cu(|| event_record(hEvent, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecordWithFlags_ptsz(hEvent: CUevent, hStream: CUstream, _flags: c_uint) -> CUresult {
    cu(|| event_record(hEvent, hStream))
}

fn event_done_at(event: CUevent) -> CuResult<Option<u64>> {
    Ok(initialised()?
        .events
        .get(&(event as usize))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?
        .done_at)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(hEvent: CUevent) -> CUresult {
    cu(|| {
        initialised()?.refuse_unsafe_call()?;
        match event_done_at(hEvent)? {
            Some(done) if now_ns() < done => Err(CUDA_ERROR_NOT_READY),
            _ => Ok(()),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(hEvent: CUevent) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let done = state
            .events
            .get(&(hEvent as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?
            .done_at;
        if let Ok(current) = state.current() {
            state.trim_pools_on_sync(current.phys);
        }
        drop(state);
        state::sleep_until(done.unwrap_or(0));
        Ok(())
    })
}

fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> CuResult {
    if ms.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let state = initialised()?;
    let time = |event: CUevent| -> CuResult<u64> {
        let e = state.events.get(&(event as usize)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if e.flags & CU_EVENT_DISABLE_TIMING != 0 {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        e.done_at.ok_or(CUDA_ERROR_INVALID_HANDLE)
    };
    let (t0, t1) = (time(start)?, time(end)?);
    if now_ns() < t0.max(t1) {
        return Err(CUDA_ERROR_NOT_READY);
    }
    let value = (t1 as f64 - t0 as f64) / 1e6;
    // SAFETY: out-pointer from the caller, checked non-null.
    unsafe { put(ms, value as f32) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(pMilliseconds: *mut f32, hStart: CUevent, hEnd: CUevent) -> CUresult {
    cu(|| elapsed(pMilliseconds, hStart, hEnd))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(pMilliseconds: *mut f32, hStart: CUevent, hEnd: CUevent) -> CUresult {
    cu(|| elapsed(pMilliseconds, hStart, hEnd))
}
