//! A fake Vulkan driver (an ICD the real Vulkan loader loads through `VK_ICD_FILENAMES` /
//! `VK_DRIVER_FILES`) for tests without a GPU: the fake CUDA driver's devices (same count, same
//! UUIDs, same capacities, NVIDIA's vendor id) with simulated heaps, and every device-local
//! allocation charged to the same ground-truth file as the fake CUDA driver's, so a test can check
//! that CUDA and Vulkan together never exceeded the limit. See README.md.
//!
//! Memory is never backed by host memory. Exported memory is an empty memfd, enough for the fake
//! CUDA driver's `cuImportExternalMemory`.

#![allow(non_snake_case)]

#[path = "../../fake-driver/src/truth.rs"]
mod truth;

#[path = "../../fake-driver/src/config.rs"]
#[allow(dead_code)]
mod config;

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, OnceLock, PoisonError};

use ash::vk::{self, Handle};

use crate::truth::{MAX_DEVICES, Truth};

/// What a dispatchable object starts with until the loader writes its dispatch pointer there.
const ICD_LOADER_MAGIC: usize = 0x01CD_C0DE;
/// The loader-ICD interface version this driver implements.
const ICD_INTERFACE_VERSION: u32 = 5;
const NVIDIA: u32 = 0x10de;
const API_VERSION: u32 = vk::make_api_version(0, 1, 3, 239);
/// The host heap's size.
const HOST_HEAP: u64 = 64 << 30;

/// Heaps: 0 the device's memory, 1 host memory. Types: 0 device-local, 1 host-visible and
/// coherent, 2 device-local and host-visible (a resizable BAR).
const DEVICE_HEAP: u32 = 0;
const TYPES: [(u32, vk::MemoryPropertyFlags); 3] = [
    (DEVICE_HEAP, vk::MemoryPropertyFlags::DEVICE_LOCAL),
    (
        1,
        vk::MemoryPropertyFlags::from_raw(
            vk::MemoryPropertyFlags::HOST_VISIBLE.as_raw() | vk::MemoryPropertyFlags::HOST_COHERENT.as_raw(),
        ),
    ),
    (
        DEVICE_HEAP,
        vk::MemoryPropertyFlags::from_raw(
            vk::MemoryPropertyFlags::DEVICE_LOCAL.as_raw()
                | vk::MemoryPropertyFlags::HOST_VISIBLE.as_raw()
                | vk::MemoryPropertyFlags::HOST_COHERENT.as_raw(),
        ),
    ),
];

const INSTANCE_EXTENSIONS: [&CStr; 2] = [
    c"VK_KHR_get_physical_device_properties2",
    c"VK_KHR_external_memory_capabilities",
];
const DEVICE_EXTENSIONS: [&CStr; 3] = [
    c"VK_KHR_external_memory",
    c"VK_KHR_external_memory_fd",
    c"VK_EXT_memory_budget",
];

/// A dispatchable object: the loader's word, then ours.
#[repr(C)]
struct Dispatchable<T> {
    loader_data: usize,
    body: T,
}

fn dispatchable<T>(body: T) -> *mut Dispatchable<T> {
    Box::into_raw(Box::new(Dispatchable {
        loader_data: ICD_LOADER_MAGIC,
        body,
    }))
}

struct InstanceBody {
    physical: Vec<*mut Dispatchable<usize>>,
}

struct DeviceBody {
    phys: usize,
}

/// One allocation.
struct Memory {
    device: u64,
    phys: usize,
    size: u64,
    /// Charged to the truth (device-local and not imported).
    charged: bool,
    heap: u32,
}

static MEMORY: LazyLock<Mutex<HashMap<u64, Memory>>> = LazyLock::new(Default::default);
static NEXT_MEMORY: AtomicU64 = AtomicU64::new(0x1000);
/// This process's Vulkan usage per physical device and heap (for `VK_EXT_memory_budget`).
static USAGE: [[AtomicU64; 2]; MAX_DEVICES] = [const { [const { AtomicU64::new(0) }; 2] }; MAX_DEVICES];

/// The truth file (`FAKE_CUDA_TRUTH`) and this process's slot in it.
fn truth() -> Option<&'static (Truth, usize)> {
    static TRUTH: OnceLock<Option<(Truth, usize)>> = OnceLock::new();
    TRUTH
        .get_or_init(|| {
            let config = config::get();
            let truth = match &config.truth {
                Some(path) => Truth::open(path),
                None => Truth::in_memory(),
            }
            .map_err(|error| eprintln!("vgpu-fake-icd: cannot open the truth file: {error}"))
            .ok()?;
            for (device, bytes) in config.memory.iter().enumerate() {
                truth.set_capacity_if_unset(device, *bytes);
            }
            let slot = truth.register()?;
            Some((truth, slot))
        })
        .as_ref()
}

fn capacity(phys: usize) -> u64 {
    match truth() {
        Some((truth, _)) if truth.device(phys).capacity() > 0 => truth.device(phys).capacity(),
        _ => config::get().memory.get(phys).copied().unwrap_or(0),
    }
}

/// The devices' vendor id: NVIDIA's, or `FAKE_VULKAN_VENDOR` (hex, `0x1002`), to stand for
/// another vendor's GPU.
fn vendor() -> u32 {
    std::env::var("FAKE_VULKAN_VENDOR")
        .ok()
        .and_then(|text| u32::from_str_radix(text.trim_start_matches("0x"), 16).ok())
        .unwrap_or(NVIDIA)
}

/// The fake CUDA driver's UUID of a physical device: zeros, then the index in the last byte.
fn uuid(phys: usize) -> [u8; vk::UUID_SIZE] {
    let mut uuid = [0; vk::UUID_SIZE];
    uuid[vk::UUID_SIZE - 1] = phys as u8;
    uuid
}

fn guard<R>(on_panic: R, body: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// # Safety
/// `handle` is a physical device this driver made.
unsafe fn phys_of(handle: vk::PhysicalDevice) -> usize {
    // SAFETY: the handle points to one of our Dispatchable<usize>.
    unsafe { (*(handle.as_raw() as usize as *const Dispatchable<usize>)).body }
}

/// # Safety
/// `handle` is a device this driver made.
unsafe fn device_phys(handle: vk::Device) -> usize {
    // SAFETY: the handle points to one of our Dispatchable<DeviceBody>.
    unsafe {
        (*(handle.as_raw() as usize as *const Dispatchable<DeviceBody>))
            .body
            .phys
    }
}

/// The two-call enumeration idiom: the count alone, or as many items as fit.
///
/// # Safety
/// `count` is valid; `out` is null or holds `*count` items.
unsafe fn enumerate<T: Copy>(items: &[T], count: *mut u32, out: *mut T) -> vk::Result {
    if count.is_null() {
        return vk::Result::ERROR_INITIALIZATION_FAILED;
    }
    if out.is_null() {
        // SAFETY: checked non-null.
        unsafe { *count = items.len() as u32 };
        return vk::Result::SUCCESS;
    }
    // SAFETY: checked non-null.
    let room = unsafe { *count } as usize;
    let written = room.min(items.len());
    for (index, item) in items.iter().take(written).enumerate() {
        // SAFETY: the caller's array has room for `room` items.
        unsafe { *out.add(index) = *item };
    }
    // SAFETY: checked non-null.
    unsafe { *count = written as u32 };
    if written < items.len() {
        vk::Result::INCOMPLETE
    } else {
        vk::Result::SUCCESS
    }
}

fn extension(name: &CStr) -> vk::ExtensionProperties {
    let mut properties = vk::ExtensionProperties {
        spec_version: 1,
        ..Default::default()
    };
    for (slot, byte) in properties.extension_name.iter_mut().zip(name.to_bytes()) {
        *slot = *byte as c_char;
    }
    properties
}

/// The loader's first call: the interface version both support.
///
/// # Safety
/// `supported` is null or the loader's version.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vk_icdNegotiateLoaderICDInterfaceVersion(supported: *mut u32) -> vk::Result {
    guard(vk::Result::ERROR_INCOMPATIBLE_DRIVER, || {
        if supported.is_null() {
            return vk::Result::ERROR_INCOMPATIBLE_DRIVER;
        }
        // SAFETY: checked non-null.
        unsafe { *supported = (*supported).min(ICD_INTERFACE_VERSION) };
        vk::Result::SUCCESS
    })
}

fn as_void<F: Copy>(function: F) -> vk::PFN_vkVoidFunction {
    // SAFETY: F is one of the `unsafe extern "system" fn` types below.
    Some(unsafe { std::mem::transmute_copy::<F, unsafe extern "system" fn()>(&function) })
}

/// Every entry point of the driver, by name.
///
/// # Safety
/// `name` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vk_icdGetInstanceProcAddr(
    _instance: vk::Instance,
    name: *const c_char,
) -> vk::PFN_vkVoidFunction {
    guard(None, || {
        if name.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated name from the loader.
        let name = unsafe { CStr::from_ptr(name) }.to_bytes();
        match name {
            b"vkEnumerateInstanceExtensionProperties" => {
                as_void(enumerate_instance_extensions as vk::PFN_vkEnumerateInstanceExtensionProperties)
            }
            b"vkEnumerateInstanceVersion" => as_void(enumerate_instance_version as vk::PFN_vkEnumerateInstanceVersion),
            b"vkCreateInstance" => as_void(create_instance as vk::PFN_vkCreateInstance),
            b"vkDestroyInstance" => as_void(destroy_instance as vk::PFN_vkDestroyInstance),
            b"vkEnumeratePhysicalDevices" => as_void(enumerate_physical_devices as vk::PFN_vkEnumeratePhysicalDevices),
            b"vkGetPhysicalDeviceProperties" => as_void(get_properties as vk::PFN_vkGetPhysicalDeviceProperties),
            b"vkGetPhysicalDeviceProperties2" | b"vkGetPhysicalDeviceProperties2KHR" => {
                as_void(get_properties2 as vk::PFN_vkGetPhysicalDeviceProperties2)
            }
            b"vkGetPhysicalDeviceMemoryProperties" => {
                as_void(get_memory_properties as vk::PFN_vkGetPhysicalDeviceMemoryProperties)
            }
            b"vkGetPhysicalDeviceMemoryProperties2" | b"vkGetPhysicalDeviceMemoryProperties2KHR" => {
                as_void(get_memory_properties2 as vk::PFN_vkGetPhysicalDeviceMemoryProperties2)
            }
            b"vkGetPhysicalDeviceQueueFamilyProperties" => {
                as_void(get_queue_families as vk::PFN_vkGetPhysicalDeviceQueueFamilyProperties)
            }
            b"vkGetPhysicalDeviceFeatures" => as_void(get_features as vk::PFN_vkGetPhysicalDeviceFeatures),
            // The loader requires these of every driver; no format is supported.
            b"vkGetPhysicalDeviceFormatProperties" => {
                as_void(get_format_properties as vk::PFN_vkGetPhysicalDeviceFormatProperties)
            }
            b"vkGetPhysicalDeviceImageFormatProperties" => {
                as_void(get_image_format_properties as vk::PFN_vkGetPhysicalDeviceImageFormatProperties)
            }
            b"vkGetPhysicalDeviceSparseImageFormatProperties" => {
                as_void(get_sparse_image_format_properties as vk::PFN_vkGetPhysicalDeviceSparseImageFormatProperties)
            }
            b"vkEnumerateDeviceExtensionProperties" => {
                as_void(enumerate_device_extensions as vk::PFN_vkEnumerateDeviceExtensionProperties)
            }
            b"vkCreateDevice" => as_void(create_device as vk::PFN_vkCreateDevice),
            _ => device_function(name),
        }
    })
}

fn device_function(name: &[u8]) -> vk::PFN_vkVoidFunction {
    match name {
        b"vkGetDeviceProcAddr" => as_void(get_device_proc_addr as vk::PFN_vkGetDeviceProcAddr),
        b"vkDestroyDevice" => as_void(destroy_device as vk::PFN_vkDestroyDevice),
        b"vkAllocateMemory" => as_void(allocate_memory as vk::PFN_vkAllocateMemory),
        b"vkFreeMemory" => as_void(free_memory as vk::PFN_vkFreeMemory),
        b"vkGetMemoryFdKHR" => as_void(get_memory_fd as vk::PFN_vkGetMemoryFdKHR),
        _ => None,
    }
}

unsafe extern "system" fn get_device_proc_addr(_device: vk::Device, name: *const c_char) -> vk::PFN_vkVoidFunction {
    guard(None, || {
        if name.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated name from the caller.
        device_function(unsafe { CStr::from_ptr(name) }.to_bytes())
    })
}

unsafe extern "system" fn enumerate_instance_extensions(
    _layer: *const c_char,
    count: *mut u32,
    out: *mut vk::ExtensionProperties,
) -> vk::Result {
    let items: Vec<vk::ExtensionProperties> = INSTANCE_EXTENSIONS.iter().map(|name| extension(name)).collect();
    // SAFETY: the caller's count and array.
    guard(vk::Result::ERROR_UNKNOWN, || unsafe { enumerate(&items, count, out) })
}

unsafe extern "system" fn enumerate_instance_version(version: *mut u32) -> vk::Result {
    if !version.is_null() {
        // SAFETY: checked non-null.
        unsafe { *version = API_VERSION };
    }
    vk::Result::SUCCESS
}

unsafe extern "system" fn create_instance(
    _info: *const vk::InstanceCreateInfo<'_>,
    _allocator: *const vk::AllocationCallbacks<'_>,
    out: *mut vk::Instance,
) -> vk::Result {
    guard(vk::Result::ERROR_INITIALIZATION_FAILED, || {
        if out.is_null() {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        }
        let physical = (0..config::get().devices).map(dispatchable).collect();
        let instance = dispatchable(InstanceBody { physical });
        // SAFETY: checked non-null.
        unsafe { *out = vk::Instance::from_raw(instance as u64) };
        vk::Result::SUCCESS
    })
}

unsafe extern "system" fn destroy_instance(instance: vk::Instance, _allocator: *const vk::AllocationCallbacks<'_>) {
    guard((), || {
        if instance == vk::Instance::null() {
            return;
        }
        // SAFETY: an instance this driver made, destroyed once.
        let instance = unsafe { Box::from_raw(instance.as_raw() as usize as *mut Dispatchable<InstanceBody>) };
        for physical in instance.body.physical {
            // SAFETY: made by `dispatchable`, owned by the instance.
            drop(unsafe { Box::from_raw(physical) });
        }
    })
}

unsafe extern "system" fn enumerate_physical_devices(
    instance: vk::Instance,
    count: *mut u32,
    out: *mut vk::PhysicalDevice,
) -> vk::Result {
    guard(vk::Result::ERROR_INITIALIZATION_FAILED, || {
        // SAFETY: an instance this driver made.
        let body = unsafe { &(*(instance.as_raw() as usize as *const Dispatchable<InstanceBody>)).body };
        let handles: Vec<vk::PhysicalDevice> = body
            .physical
            .iter()
            .map(|&physical| vk::PhysicalDevice::from_raw(physical as u64))
            .collect();
        // SAFETY: the caller's count and array.
        unsafe { enumerate(&handles, count, out) }
    })
}

fn properties_of(phys: usize) -> vk::PhysicalDeviceProperties {
    let mut properties = vk::PhysicalDeviceProperties {
        api_version: API_VERSION,
        driver_version: vk::make_api_version(0, 580, 65, 6),
        vendor_id: vendor(),
        device_id: 0x2335,
        device_type: vk::PhysicalDeviceType::DISCRETE_GPU,
        pipeline_cache_uuid: uuid(phys),
        ..Default::default()
    };
    for (slot, byte) in properties.device_name.iter_mut().zip(b"NVIDIA H200 (vgpu fake)") {
        *slot = *byte as c_char;
    }
    properties
}

unsafe extern "system" fn get_properties(physical: vk::PhysicalDevice, out: *mut vk::PhysicalDeviceProperties) {
    guard((), || {
        if !out.is_null() {
            // SAFETY: one of our physical devices; the caller's output.
            unsafe { *out = properties_of(phys_of(physical)) };
        }
    })
}

unsafe extern "system" fn get_properties2(physical: vk::PhysicalDevice, out: *mut vk::PhysicalDeviceProperties2<'_>) {
    guard((), || {
        // SAFETY: the caller's output, or null.
        let Some(out) = (unsafe { out.as_mut() }) else { return };
        // SAFETY: one of our physical devices.
        let phys = unsafe { phys_of(physical) };
        out.properties = properties_of(phys);
        let mut next = out.p_next.cast::<vk::BaseOutStructure<'_>>();
        while !next.is_null() {
            // SAFETY: the caller's output chain.
            let s_type = unsafe { (*next).s_type };
            if s_type == vk::StructureType::PHYSICAL_DEVICE_ID_PROPERTIES {
                // SAFETY: a structure of this type is a VkPhysicalDeviceIDProperties.
                let id = unsafe { &mut *next.cast::<vk::PhysicalDeviceIDProperties<'_>>() };
                id.device_uuid = uuid(phys);
                id.driver_uuid = [0x5a; vk::UUID_SIZE];
                id.device_luid_valid = vk::FALSE;
            }
            // SAFETY: as above.
            next = unsafe { (*next).p_next };
        }
    })
}

fn memory_properties_of(phys: usize) -> vk::PhysicalDeviceMemoryProperties {
    let mut properties = vk::PhysicalDeviceMemoryProperties {
        memory_type_count: TYPES.len() as u32,
        memory_heap_count: 2,
        ..Default::default()
    };
    properties.memory_heaps[0] = vk::MemoryHeap {
        size: capacity(phys),
        flags: vk::MemoryHeapFlags::DEVICE_LOCAL,
    };
    properties.memory_heaps[1] = vk::MemoryHeap {
        size: HOST_HEAP,
        flags: vk::MemoryHeapFlags::empty(),
    };
    for (index, (heap_index, property_flags)) in TYPES.iter().enumerate() {
        properties.memory_types[index] = vk::MemoryType {
            property_flags: *property_flags,
            heap_index: *heap_index,
        };
    }
    properties
}

unsafe extern "system" fn get_memory_properties(
    physical: vk::PhysicalDevice,
    out: *mut vk::PhysicalDeviceMemoryProperties,
) {
    guard((), || {
        if !out.is_null() {
            // SAFETY: one of our physical devices; the caller's output.
            unsafe { *out = memory_properties_of(phys_of(physical)) };
        }
    })
}

unsafe extern "system" fn get_memory_properties2(
    physical: vk::PhysicalDevice,
    out: *mut vk::PhysicalDeviceMemoryProperties2<'_>,
) {
    guard((), || {
        // SAFETY: the caller's output, or null.
        let Some(out) = (unsafe { out.as_mut() }) else { return };
        // SAFETY: one of our physical devices.
        let phys = unsafe { phys_of(physical) };
        out.memory_properties = memory_properties_of(phys);
        let mut next = out.p_next.cast::<vk::BaseOutStructure<'_>>();
        while !next.is_null() {
            // SAFETY: the caller's output chain.
            if unsafe { (*next).s_type } == vk::StructureType::PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT {
                // SAFETY: a structure of this type is a VkPhysicalDeviceMemoryBudgetPropertiesEXT.
                let budget = unsafe { &mut *next.cast::<vk::PhysicalDeviceMemoryBudgetPropertiesEXT<'_>>() };
                let own = USAGE[phys][0].load(Ordering::Acquire);
                let used = truth().map_or(own, |(truth, _)| truth.device(phys).used());
                budget.heap_usage[0] = own;
                budget.heap_budget[0] = own + capacity(phys).saturating_sub(used);
                budget.heap_usage[1] = USAGE[phys][1].load(Ordering::Acquire);
                budget.heap_budget[1] = HOST_HEAP;
            }
            // SAFETY: as above.
            next = unsafe { (*next).p_next };
        }
    })
}

unsafe extern "system" fn get_queue_families(
    _physical: vk::PhysicalDevice,
    count: *mut u32,
    out: *mut vk::QueueFamilyProperties,
) {
    let family = vk::QueueFamilyProperties {
        queue_flags: vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE | vk::QueueFlags::TRANSFER,
        queue_count: 1,
        timestamp_valid_bits: 64,
        min_image_transfer_granularity: vk::Extent3D {
            width: 1,
            height: 1,
            depth: 1,
        },
    };
    guard((), || {
        // SAFETY: the caller's count and array.
        let _ = unsafe { enumerate(&[family], count, out) };
    });
}

unsafe extern "system" fn get_features(_physical: vk::PhysicalDevice, out: *mut vk::PhysicalDeviceFeatures) {
    if !out.is_null() {
        // SAFETY: the caller's output.
        unsafe { *out = vk::PhysicalDeviceFeatures::default() };
    }
}

unsafe extern "system" fn get_format_properties(
    _physical: vk::PhysicalDevice,
    _format: vk::Format,
    out: *mut vk::FormatProperties,
) {
    if !out.is_null() {
        // SAFETY: the caller's output.
        unsafe { *out = vk::FormatProperties::default() };
    }
}

unsafe extern "system" fn get_image_format_properties(
    _physical: vk::PhysicalDevice,
    _format: vk::Format,
    _kind: vk::ImageType,
    _tiling: vk::ImageTiling,
    _usage: vk::ImageUsageFlags,
    _flags: vk::ImageCreateFlags,
    _out: *mut vk::ImageFormatProperties,
) -> vk::Result {
    vk::Result::ERROR_FORMAT_NOT_SUPPORTED
}

unsafe extern "system" fn get_sparse_image_format_properties(
    _physical: vk::PhysicalDevice,
    _format: vk::Format,
    _kind: vk::ImageType,
    _samples: vk::SampleCountFlags,
    _usage: vk::ImageUsageFlags,
    _tiling: vk::ImageTiling,
    count: *mut u32,
    _out: *mut vk::SparseImageFormatProperties,
) {
    if !count.is_null() {
        // SAFETY: the caller's count.
        unsafe { *count = 0 };
    }
}

unsafe extern "system" fn enumerate_device_extensions(
    _physical: vk::PhysicalDevice,
    _layer: *const c_char,
    count: *mut u32,
    out: *mut vk::ExtensionProperties,
) -> vk::Result {
    let items: Vec<vk::ExtensionProperties> = DEVICE_EXTENSIONS.iter().map(|name| extension(name)).collect();
    // SAFETY: the caller's count and array.
    guard(vk::Result::ERROR_UNKNOWN, || unsafe { enumerate(&items, count, out) })
}

unsafe extern "system" fn create_device(
    physical: vk::PhysicalDevice,
    _info: *const vk::DeviceCreateInfo<'_>,
    _allocator: *const vk::AllocationCallbacks<'_>,
    out: *mut vk::Device,
) -> vk::Result {
    guard(vk::Result::ERROR_INITIALIZATION_FAILED, || {
        if out.is_null() {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        }
        // SAFETY: one of our physical devices.
        let phys = unsafe { phys_of(physical) };
        let device = dispatchable(DeviceBody { phys });
        // SAFETY: checked non-null.
        unsafe { *out = vk::Device::from_raw(device as u64) };
        vk::Result::SUCCESS
    })
}

/// Gives an allocation's bytes back (to the truth when charged).
fn release(memory: &Memory) {
    if memory.charged
        && let Some((truth, slot)) = truth()
    {
        truth.release(*slot, memory.phys, memory.size);
    }
    USAGE[memory.phys][memory.heap as usize].fetch_sub(memory.size, Ordering::AcqRel);
}

unsafe extern "system" fn destroy_device(device: vk::Device, _allocator: *const vk::AllocationCallbacks<'_>) {
    guard((), || {
        if device == vk::Device::null() {
            return;
        }
        // The driver frees what the application left allocated.
        let mut memory = MEMORY.lock().unwrap_or_else(PoisonError::into_inner);
        memory.retain(|_, allocation| {
            let keep = allocation.device != device.as_raw();
            if !keep {
                release(allocation);
            }
            keep
        });
        drop(memory);
        // SAFETY: a device this driver made, destroyed once.
        drop(unsafe { Box::from_raw(device.as_raw() as usize as *mut Dispatchable<DeviceBody>) });
    })
}

/// The file descriptor an allocation imports (OPAQUE_FD), if it imports one.
///
/// # Safety
/// `next` is a valid `pNext` chain.
unsafe fn imported_fd(mut next: *const c_void) -> Option<i32> {
    while !next.is_null() {
        let base = next.cast::<vk::BaseInStructure<'_>>();
        // SAFETY: the caller's chain.
        if unsafe { (*base).s_type } == vk::StructureType::IMPORT_MEMORY_FD_INFO_KHR {
            // SAFETY: a structure of this type is a VkImportMemoryFdInfoKHR.
            let import = unsafe { &*base.cast::<vk::ImportMemoryFdInfoKHR<'_>>() };
            if !import.handle_type.is_empty() {
                return Some(import.fd);
            }
        }
        // SAFETY: as above.
        next = unsafe { (*base).p_next }.cast();
    }
    None
}

unsafe extern "system" fn allocate_memory(
    device: vk::Device,
    info: *const vk::MemoryAllocateInfo<'_>,
    _allocator: *const vk::AllocationCallbacks<'_>,
    out: *mut vk::DeviceMemory,
) -> vk::Result {
    guard(vk::Result::ERROR_UNKNOWN, || {
        // SAFETY: the caller's allocate info, or null.
        let Some(info) = (unsafe { info.as_ref() }) else {
            return vk::Result::ERROR_UNKNOWN;
        };
        let Some(&(heap, _)) = TYPES.get(info.memory_type_index as usize) else {
            return vk::Result::ERROR_UNKNOWN;
        };
        if out.is_null() || info.allocation_size == 0 {
            return vk::Result::ERROR_UNKNOWN;
        }
        // SAFETY: one of our devices.
        let phys = unsafe { device_phys(device) };
        // SAFETY: the caller's chain.
        let imported = match unsafe { imported_fd(info.p_next) } {
            // SAFETY: fcntl only asks whether the descriptor is open; the driver owns it once the
            // import succeeds.
            Some(fd) if fd >= 0 && unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 => {
                // SAFETY: as above.
                unsafe { libc::close(fd) };
                true
            }
            Some(_) => return vk::Result::ERROR_INVALID_EXTERNAL_HANDLE,
            None => false,
        };
        let charged = heap == DEVICE_HEAP && !imported;
        if charged {
            let Some((truth, slot)) = truth() else {
                return vk::Result::ERROR_INITIALIZATION_FAILED;
            };
            if !truth.reserve(*slot, phys, info.allocation_size) {
                return vk::Result::ERROR_OUT_OF_DEVICE_MEMORY;
            }
        }
        USAGE[phys][heap as usize].fetch_add(info.allocation_size, Ordering::AcqRel);
        let handle = NEXT_MEMORY.fetch_add(0x10, Ordering::Relaxed);
        MEMORY.lock().unwrap_or_else(PoisonError::into_inner).insert(
            handle,
            Memory {
                device: device.as_raw(),
                phys,
                size: info.allocation_size,
                charged,
                heap,
            },
        );
        // SAFETY: checked non-null.
        unsafe { *out = vk::DeviceMemory::from_raw(handle) };
        vk::Result::SUCCESS
    })
}

unsafe extern "system" fn free_memory(
    _device: vk::Device,
    memory: vk::DeviceMemory,
    _allocator: *const vk::AllocationCallbacks<'_>,
) {
    guard((), || {
        let removed = MEMORY
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&memory.as_raw());
        if let Some(removed) = removed {
            release(&removed);
        }
    })
}

unsafe extern "system" fn get_memory_fd(
    _device: vk::Device,
    info: *const vk::MemoryGetFdInfoKHR<'_>,
    fd: *mut i32,
) -> vk::Result {
    guard(vk::Result::ERROR_UNKNOWN, || {
        // SAFETY: the caller's info, or null.
        let Some(info) = (unsafe { info.as_ref() }) else {
            return vk::Result::ERROR_UNKNOWN;
        };
        let known = MEMORY
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&info.memory.as_raw());
        if fd.is_null() || !known || info.handle_type != vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD {
            return vk::Result::ERROR_INVALID_EXTERNAL_HANDLE;
        }
        // SAFETY: memfd_create with a NUL-terminated name and valid flags.
        let new = unsafe { libc::memfd_create(c"vgpu-fake-vulkan".as_ptr(), libc::MFD_CLOEXEC) };
        if new < 0 {
            return vk::Result::ERROR_TOO_MANY_OBJECTS;
        }
        // SAFETY: checked non-null.
        unsafe { *fd = new };
        vk::Result::SUCCESS
    })
}
