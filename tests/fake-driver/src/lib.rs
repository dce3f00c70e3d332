//! A fake CUDA driver and NVML for machines without a GPU (see README.md).
//!
//! One cdylib exports every function of `cuda.h` and `nvml.h` (except [`NOT_EXPORTED`]): the
//! subset the tests need is implemented by hand in the modules below, the rest are stubs that
//! `build.rs` generates with the header's exact prototype and that return
//! `CUDA_ERROR_NOT_SUPPORTED` / `NVML_ERROR_NOT_SUPPORTED`. Device memory is simulated (never
//! backed by host memory), kernels occupy a simulated engine for a duration taken from their
//! name, and every physical charge is recorded in a ground-truth file shared by all processes of
//! a test ([`truth`]).

#![allow(non_snake_case)]
#![allow(clippy::too_many_arguments)]

/// Types and constants of `cuda.h` (bindgen, enums as plain constants).
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unnecessary_transmutes,
    clippy::all,
    clippy::pedantic
)]
pub mod cuda {
    include!(concat!(env!("OUT_DIR"), "/cuda_types.rs"));
}

/// Types and constants of `nvml.h`.
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unnecessary_transmutes,
    clippy::all,
    clippy::pedantic
)]
pub mod nvml {
    include!(concat!(env!("OUT_DIR"), "/nvml_types.rs"));
}

/// Generated stubs, prototype checks, the export table and the variant table.
#[allow(dead_code, clippy::all, clippy::pedantic)]
mod exports {
    include!(concat!(env!("OUT_DIR"), "/exports.rs"));
}

pub use exports::{EXPORTED, NOT_EXPORTED};

mod array;
mod checkpoint;
mod config;
mod context;
mod device;
mod engine;
mod external;
mod ffi;
mod graph;
mod managed;
mod memory;
mod module;
mod nvml_api;
mod pool;
mod proc_address;
mod state;
mod truth;
mod vmm;
