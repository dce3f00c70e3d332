//! The Vulkan implicit layer `VK_LAYER_HAMI_vgpu`: `vkAllocateMemory` on a GPU's device-local
//! heaps is charged to the same shared region, device and limit as CUDA, and the device-local
//! heaps (and `VK_EXT_memory_budget`) show the virtual device.
//!
//! This crate is the Vulkan side only. It is linked into `libvgpu.so`, which exports
//! [`negotiate`] as `vkNegotiateLoaderLayerInterfaceVersion` (the one Vulkan symbol it exports:
//! an application never calls it, so a preloaded `libvgpu.so` interposes on nothing of Vulkan's)
//! and answers the [`Budget`] questions from its CUDA accounting. One library, so a process using
//! CUDA and Vulkan has one slot in the region and one view of its limit: a second library
//! attaching its own slot for the same pid would reset the first one's.
//!
//! The loader loads the layer when the manifest (`hami.json`, HAMi's name and place) is in an
//! implicit layer folder and `HAMI_VULKAN_ENABLE=1`; nothing of it runs otherwise.

mod budget;
mod chain;
mod heaps;
mod layer;
mod loader;

pub use budget::{Budget, Gpu};
pub use layer::negotiate;
pub use loader::NegotiateLayerInterface;

/// The layer's name, as the manifest gives it (HAMi's proposal's).
pub const LAYER_NAME: &str = "VK_LAYER_HAMI_vgpu";
