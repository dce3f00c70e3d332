//! The loader-layer interface of `vk_layer.h` (interface version 2). These structures are the
//! loader's, not the API's, so the registry (and `ash`) does not have them.

use std::ffi::{c_char, c_void};

use ash::vk;

/// `VkNegotiateLayerStructType::LAYER_NEGOTIATE_INTERFACE_STRUCT`.
pub const LAYER_NEGOTIATE_INTERFACE_STRUCT: u32 = 1;
/// `VkLayerFunction::VK_LAYER_LINK_INFO`: the create info carries the next layer's entry points.
pub const LAYER_LINK_INFO: u32 = 0;
/// The loader-layer interface this layer implements.
pub const INTERFACE_VERSION: u32 = 2;

/// `PFN_GetPhysicalDeviceProcAddr`.
pub type GetPhysicalDeviceProcAddr =
    Option<unsafe extern "system" fn(instance: vk::Instance, name: *const c_char) -> vk::PFN_vkVoidFunction>;

/// `VkNegotiateLayerInterface`.
#[repr(C)]
pub struct NegotiateLayerInterface {
    pub s_type: u32,
    pub p_next: *mut c_void,
    pub loader_layer_interface_version: u32,
    pub get_instance_proc_addr: Option<vk::PFN_vkGetInstanceProcAddr>,
    pub get_device_proc_addr: Option<vk::PFN_vkGetDeviceProcAddr>,
    pub get_physical_device_proc_addr: GetPhysicalDeviceProcAddr,
}

/// `VkLayerInstanceLink`.
#[repr(C)]
pub struct LayerInstanceLink {
    pub next: *mut LayerInstanceLink,
    pub next_get_instance_proc_addr: Option<vk::PFN_vkGetInstanceProcAddr>,
    pub next_get_physical_device_proc_addr: GetPhysicalDeviceProcAddr,
}

/// `VkLayerDeviceLink`.
#[repr(C)]
pub struct LayerDeviceLink {
    pub next: *mut LayerDeviceLink,
    pub next_get_instance_proc_addr: Option<vk::PFN_vkGetInstanceProcAddr>,
    pub next_get_device_proc_addr: Option<vk::PFN_vkGetDeviceProcAddr>,
}

/// `VkLayerInstanceCreateInfo` and `VkLayerDeviceCreateInfo`, up to the first member of their
/// union (the link, for `LAYER_LINK_INFO`), which is all a layer reads or writes. Only ever
/// reached through a pointer into the loader's structure, never copied.
#[repr(C)]
pub struct LayerCreateInfo<Link> {
    pub s_type: vk::StructureType,
    pub p_next: *const c_void,
    pub function: u32,
    pub layer_info: *mut Link,
}
