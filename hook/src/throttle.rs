//! The compute limiter's entry points. Every launch path is routed here by `cuda-api.toml`; the
//! limiter itself is not built yet, so each handler forwards the launch unchanged.

use std::ffi::c_uint;

use crate::sys::cuda::{CUDA_LAUNCH_PARAMS, CUfunction, CUgraphExec, CUlaunchConfig, CUresult, CUstream};

/// `cuLaunchKernel`, `cuLaunchCooperativeKernel` and their `_ptsz` variants.
#[allow(clippy::too_many_arguments)]
pub fn launch_kernel(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _function: CUfunction,
    _grid_x: c_uint,
    _grid_y: c_uint,
    _grid_z: c_uint,
    _block_x: c_uint,
    _block_y: c_uint,
    _block_z: c_uint,
    _stream: CUstream,
) -> CUresult {
    call()
}

/// `cuLaunchKernelEx` and `_ptsz`: grid, block and stream are in the config.
pub fn launch_kernel_ex(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _config: *const CUlaunchConfig,
    _function: CUfunction,
) -> CUresult {
    call()
}

/// `cuLaunchCooperativeKernelMultiDevice`.
pub fn launch_cooperative_multi_device(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _launches: *mut CUDA_LAUNCH_PARAMS,
    _device_count: c_uint,
) -> CUresult {
    call()
}

/// `cuGraphLaunch` and `_ptsz`: a graph is not a way around the limit.
pub fn graph_launch(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _graph_exec: CUgraphExec,
    _stream: CUstream,
) -> CUresult {
    call()
}

/// `cuLaunch` and `cuLaunchGrid` (pre-4.0 API, legacy stream).
pub fn launch_legacy(_name: &'static str, call: impl FnOnce() -> CUresult, _function: CUfunction) -> CUresult {
    call()
}

/// `cuLaunchGridAsync`.
pub fn launch_legacy_async(
    _name: &'static str,
    call: impl FnOnce() -> CUresult,
    _function: CUfunction,
    _stream: CUstream,
) -> CUresult {
    call()
}
