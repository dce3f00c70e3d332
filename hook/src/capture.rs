//! Stream capture as it bears on the library's own driver calls. While any thread captures a
//! graph in global mode (PyTorch's default), the driver refuses a potentially unsafe call from
//! any thread in global mode, and invalidates the capture; on the H200 that includes
//! `cuStreamQuery`, `cuEventQuery` and `cuMemPoolGetAttribute` (`tests/gpu/capture_probe.py`).
//! The library makes such calls on the application's threads, so it makes them in relaxed mode.
//! Work on a capturing stream is recorded into the capture's graph, not run: what it allocates is
//! the graph's.

use std::cell::Cell;

use crate::hooks::real;
use crate::sys::cuda::{
    CU_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_CAPTURE_STATUS_ACTIVE, CU_STREAM_CAPTURE_STATUS_NONE, CUDA_SUCCESS,
    CUgraph, CUstream, CUstreamCaptureMode, CUstreamCaptureStatus,
};

/// `CU_STREAM_PER_THREAD`, a macro in cuda.h: the calling thread's default stream.
pub const STREAM_PER_THREAD: usize = 0x2;

/// Sets the calling thread's capture interaction mode; returns the one it had (`None` without
/// the entry point, or when the driver refused).
fn exchange_capture_mode(mode: CUstreamCaptureMode) -> Option<CUstreamCaptureMode> {
    let exchange = real::quiet::cuThreadExchangeStreamCaptureMode()?;
    let mut mode = mode;
    // SAFETY: a valid in/out pointer to a local.
    (unsafe { exchange(&mut mode) } == CUDA_SUCCESS).then_some(mode)
}

/// Puts the calling thread, one of the library's own (the poller), in relaxed mode for good: it
/// makes its calls while another thread captures a graph in global mode.
pub fn relax_capture_mode() {
    exchange_capture_mode(CU_STREAM_CAPTURE_MODE_RELAXED);
}

/// Runs `call`, a potentially unsafe call the library makes on an application's thread, in
/// relaxed capture mode, then gives the thread its mode back: in the default mode (global) the
/// call would be refused, and would invalidate the capture, while any thread of the process
/// captures a graph in global mode, or while this thread captures one on another stream. Nested
/// calls run in the outermost one's mode: one exchange (and one restore) covers a block of queries.
pub fn in_relaxed_capture_mode<T>(call: impl FnOnce() -> T) -> T {
    let _relaxed = RelaxedCaptureMode::enter();
    call()
}

thread_local! {
    /// How many [`RelaxedCaptureMode`] guards the thread holds.
    static RELAXED_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// The calling thread in relaxed capture mode until dropped, which gives it its mode back (the
/// outermost guard only).
struct RelaxedCaptureMode {
    previous: Option<CUstreamCaptureMode>,
}

impl RelaxedCaptureMode {
    fn enter() -> Self {
        // Without the thread's storage (a hook called while the thread exits), as the outermost.
        let depth = RELAXED_DEPTH
            .try_with(|depth| depth.replace(depth.get().saturating_add(1)))
            .unwrap_or(0);
        Self {
            previous: if depth == 0 {
                exchange_capture_mode(CU_STREAM_CAPTURE_MODE_RELAXED)
            } else {
                None
            },
        }
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        let _ = RELAXED_DEPTH.try_with(|depth| depth.set(depth.get().saturating_sub(1)));
        if let Some(previous) = self.previous {
            exchange_capture_mode(previous);
        }
    }
}

/// Whether `stream` is being captured (or cannot be asked): launches there do not run now, and
/// no other call than this one may be made on it (`cuStreamQuery` would invalidate the capture).
pub fn capturing(stream: CUstream) -> bool {
    let Some(is_capturing) = real::cuStreamIsCapturing() else {
        return false;
    };
    let mut status: CUstreamCaptureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the application's stream and a valid out-pointer.
    let result = unsafe { is_capturing(stream, &mut status) };
    // An error means the launch itself will fail (an invalid stream, or the legacy stream during
    // a capture): nothing to gate.
    result != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE
}

/// The graph that `stream`'s capture records into, or `None` when the stream is not capturing
/// (or cannot be asked, or its capture is invalidated: the call on it will then fail by itself;
/// the driver names the graph only for an active capture). `per_thread`: the caller's entry
/// point was a `_ptsz` variant, whose null stream is the calling thread's stream (which may
/// capture), not the legacy one (which may not).
pub fn capture_graph(stream: CUstream, per_thread: bool) -> Option<CUgraph> {
    let info = if per_thread {
        real::cuStreamGetCaptureInfo_v2_ptsz()?
    } else {
        real::cuStreamGetCaptureInfo_v2()?
    };
    let mut status: CUstreamCaptureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
    let mut graph: CUgraph = std::ptr::null_mut();
    // SAFETY: the application's stream; the status and graph outputs are locals, the others are
    // optional and passed null.
    let result = unsafe {
        info(
            stream,
            &mut status,
            std::ptr::null_mut(),
            &mut graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    (result == CUDA_SUCCESS && status == CU_STREAM_CAPTURE_STATUS_ACTIVE && !graph.is_null()).then_some(graph)
}

/// A stream as its capture is remembered: its handle and, for a per-thread default stream (the
/// null stream of a `_ptsz` entry point, or `CU_STREAM_PER_THREAD`), the calling thread, whose
/// own stream it is.
pub fn capture_key(stream: CUstream, per_thread: bool) -> (u64, u64) {
    let handle = stream as u64;
    let thread_specific = (per_thread && stream.is_null()) || handle == STREAM_PER_THREAD as u64;
    // SAFETY: pthread_self has no preconditions.
    let thread = if thread_specific {
        (unsafe { libc::pthread_self() }) as u64
    } else {
        0
    };
    (handle, thread)
}
