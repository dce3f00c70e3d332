//! libvgpu.so: preloaded in front of a CUDA application, it exports every CUDA driver and NVML
//! entry point (wrappers generated from the headers by `vgpu-codegen` and `hook-macros`) plus
//! `dlsym`, and routes the calls that matter to the runtime below.
//!
//! Nothing runs at load time: every piece initialises on first use.

mod capture;
mod exit;
mod hooks;
mod init;
mod interpose;
mod limits;
mod loaded;
mod log;
mod memory;
mod nvml;
mod real;
mod session;
mod sys;
mod throttle;
mod vulkan;
