//! The compute limiter: `CUDA_DEVICE_SM_LIMIT` percent of each device's time for the container's
//! kernels, by time-sharing. Every launch path is routed here by `cuda-api.toml`.
//!
//! - Unlimited (no limit on any device, or `GPU_CORE_UTILIZATION_POLICY=disable`): each handler
//!   loads one static, branches, and calls the driver. No thread, no state.
//! - Limited: a launch is charged its estimated GPU time against a token bucket per device that
//!   every process of the region shares ([`bucket`]), and waits (sleeping) while the bucket is in
//!   debt. Estimates come from the library's own measurements of sampled launches, timed with
//!   events on the launch's stream ([`sensor`], [`estimates`]); a background thread collects
//!   them and corrects the charges ([`runtime`]).
//! - Limited without a region (`cuInit` failed here, e.g. the region file could not be used, or
//!   was never called): a launch on a limited device is refused with `CUDA_ERROR_NOT_INITIALIZED`
//!   (fail closed: no launch runs unlimited under the limit's name).
//!
//! `docs/compute-limit.md` describes the design and its constants.

mod activity;
mod boards;
mod boost;
mod bucket;
mod correction;
mod estimates;
mod nvml_reading;
mod overlap;
mod runtime;
mod sensor;
#[cfg(test)]
mod sim;

use std::ffi::c_uint;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::capture::STREAM_PER_THREAD;
use crate::sys::cuda::{CUDA_LAUNCH_PARAMS, CUfunction, CUgraphExec, CUlaunchConfig, CUresult, CUstream};

/// What the launch handlers do: the limiter's mode for the whole process.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Mode {
    /// Not decided yet: the first launch reads the configuration.
    Undecided = 0,
    /// No device is limited: launches go straight to the driver.
    Off = 1,
    /// Some device is limited.
    On = 2,
    /// No device is limited, and no launch happened since the tick last wrote `last_kernel_time`:
    /// the next launch takes the handler's path once and sets `Off` again ([`activity`]).
    Idle = 3,
}

/// The process's [`Mode`], one byte that every launch loads.
struct ModeCell(AtomicU8);

impl ModeCell {
    #[inline(always)]
    fn is(&self, mode: Mode) -> bool {
        self.0.load(Ordering::Relaxed) == mode as u8
    }

    fn load(&self) -> Mode {
        match self.0.load(Ordering::Relaxed) {
            1 => Mode::Off,
            2 => Mode::On,
            3 => Mode::Idle,
            _ => Mode::Undecided,
        }
    }

    fn store(&self, mode: Mode) {
        self.0.store(mode as u8, Ordering::Relaxed);
    }

    /// Sets `new` where the mode is `current`; whether it was.
    fn turn(&self, current: Mode, new: Mode) -> bool {
        self.0
            .compare_exchange(current as u8, new as u8, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

static MODE: ModeCell = ModeCell(AtomicU8::new(Mode::Undecided as u8));

pub use activity::write_at_exit as write_kernel_time_at_exit;

/// The whole cost of the limiter when nothing is limited: one load and one branch. The table's
/// fast path of every launch entry point: while it holds, the generated wrapper calls the driver
/// directly (after its suspend prologue).
#[inline(always)]
pub fn unlimited() -> bool {
    MODE.is(Mode::Off)
}

/// `CLOCK_MONOTONIC` in ns: the clock the region's bucket runs on, shared by all processes (the
/// region's own, so that its fields and the bucket's agree).
pub(crate) use vgpu_region::monotonic_ns as now_ns;

/// The unit of the factors charges are scaled by (the correction, the streams' overlap):
/// thousandths.
pub(in crate::throttle) const FACTOR_UNIT: u32 = 1000;

/// A launch's stream as the driver reads it: for the per-thread-default-stream variants (which
/// the generator marks with `per_thread`), a null stream is the calling thread's stream.
#[derive(Clone, Copy)]
pub struct Stream(CUstream);

impl Stream {
    #[inline(always)]
    fn new(stream: CUstream, per_thread: bool) -> Stream {
        if per_thread && stream.is_null() {
            Stream(STREAM_PER_THREAD as CUstream)
        } else {
            Stream(stream)
        }
    }

    pub fn handle(self) -> CUstream {
        self.0
    }
}

/// A kernel's key: its function with its launch shape (one function launched at several sizes
/// costs differently at each).
fn kernel_key(function: CUfunction, dims: [c_uint; 6]) -> u64 {
    let mut key = (function as u64) ^ 0xcbf2_9ce4_8422_2325;
    for dim in dims {
        key = (key ^ u64::from(dim)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    key.max(1)
}

/// A graph's key: the executable graph.
fn graph_key(graph: CUgraphExec) -> u64 {
    ((graph as u64) ^ 0x6772_6170_6800_0000).max(1)
}

/// The limited path. Admission and the sample's bookkeeping are out of line, and the closure
/// that makes the real call is called here, in the handler, so the unlimited path stays a load
/// and a branch (the closure is never moved to memory for a call).
#[inline(always)]
fn limited(stream: Stream, key: u64, measurable: bool, call: impl FnOnce() -> CUresult) -> CUresult {
    let ticket = match runtime::before(stream, key, measurable) {
        Ok(ticket) => ticket,
        Err(status) => return status,
    };
    let status = call();
    runtime::after(ticket, status);
    status
}

/// `cuLaunchKernel`, `cuLaunchCooperativeKernel` and their `_ptsz` variants.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn launch_kernel(
    call: impl FnOnce() -> CUresult,
    f: CUfunction,
    grid_dim_x: c_uint,
    grid_dim_y: c_uint,
    grid_dim_z: c_uint,
    block_dim_x: c_uint,
    block_dim_y: c_uint,
    block_dim_z: c_uint,
    h_stream: CUstream,
    per_thread: bool,
) -> CUresult {
    if unlimited() {
        return call();
    }
    let key = kernel_key(
        f,
        [
            grid_dim_x,
            grid_dim_y,
            grid_dim_z,
            block_dim_x,
            block_dim_y,
            block_dim_z,
        ],
    );
    limited(Stream::new(h_stream, per_thread), key, true, call)
}

/// `cuLaunchKernelEx` and `_ptsz`: grid, block and stream are in the config.
#[inline(always)]
pub fn launch_kernel_ex(
    call: impl FnOnce() -> CUresult,
    config: *const CUlaunchConfig,
    f: CUfunction,
    per_thread: bool,
) -> CUresult {
    if unlimited() {
        return call();
    }
    if config.is_null() {
        return call(); // the driver rejects it
    }
    // SAFETY: the application passes a valid launch configuration (checked non-null); it is only
    // read, before the driver is called with it.
    let c = unsafe { &*config };
    let key = kernel_key(
        f,
        [
            c.gridDimX,
            c.gridDimY,
            c.gridDimZ,
            c.blockDimX,
            c.blockDimY,
            c.blockDimZ,
        ],
    );
    limited(Stream::new(c.hStream, per_thread), key, true, call)
}

/// `cuLaunchCooperativeKernelMultiDevice` (deprecated): charged on the current device at the
/// estimate of its first kernel, not measured (its launches span several contexts).
#[inline(always)]
pub fn launch_cooperative_multi_device(
    call: impl FnOnce() -> CUresult,
    launch_params_list: *mut CUDA_LAUNCH_PARAMS,
    num_devices: c_uint,
) -> CUresult {
    if unlimited() {
        return call();
    }
    if launch_params_list.is_null() || num_devices == 0 {
        return call();
    }
    // SAFETY: the application passes `num_devices` (> 0) launch parameters; the first is read.
    let first = unsafe { &*launch_params_list };
    let key = kernel_key(
        first.function,
        [
            first.gridDimX,
            first.gridDimY,
            first.gridDimZ,
            first.blockDimX,
            first.blockDimY,
            first.blockDimZ,
        ],
    );
    limited(Stream::new(first.hStream, false), key, false, call)
}

/// `cuGraphLaunch` and `_ptsz`: a graph is not a way around the limit.
#[inline(always)]
pub fn graph_launch(
    call: impl FnOnce() -> CUresult,
    h_graph_exec: CUgraphExec,
    h_stream: CUstream,
    per_thread: bool,
) -> CUresult {
    if unlimited() {
        return call();
    }
    limited(Stream::new(h_stream, per_thread), graph_key(h_graph_exec), true, call)
}

/// `cuStreamDestroy` and `_v2`: the stream is forgotten by the limiter (its samples record probe
/// events on other threads' active streams) before the driver destroys it.
pub fn stream_destroy(call: impl FnOnce() -> CUresult, h_stream: CUstream) -> CUresult {
    if unlimited() {
        return call();
    }
    runtime::forget_stream(h_stream, call)
}

/// `cuLaunch` and `cuLaunchGrid` (pre-4.0 API, legacy stream).
#[inline(always)]
pub fn launch_legacy(call: impl FnOnce() -> CUresult, f: CUfunction) -> CUresult {
    if unlimited() {
        return call();
    }
    limited(
        Stream::new(std::ptr::null_mut(), false),
        kernel_key(f, [0; 6]),
        true,
        call,
    )
}

/// `cuLaunchGridAsync`.
#[inline(always)]
pub fn launch_legacy_async(call: impl FnOnce() -> CUresult, f: CUfunction, h_stream: CUstream) -> CUresult {
    if unlimited() {
        return call();
    }
    limited(Stream::new(h_stream, false), kernel_key(f, [0; 6]), true, call)
}
