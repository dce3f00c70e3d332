//! The exported wrappers, one per function of cuda.h and nvml.h, expanded by `hook_macros::hooks!`
//! from the list `vgpu-codegen` writes at build time.

#![allow(unused_imports)]

use crate::sys::cuda::*;
use crate::sys::nvml::*;

include!(concat!(env!("OUT_DIR"), "/hooks.rs"));
