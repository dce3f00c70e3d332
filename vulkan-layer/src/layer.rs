//! The layer's entry points: the loader negotiates, then calls `vkGetInstanceProcAddr` and
//! `vkGetDeviceProcAddr` for every function; the ones below are intercepted, every other one is
//! the next layer's (or the driver's) own pointer, so they cost nothing.
//!
//! Intercepted: instance and device creation and destruction (to keep the next layer's
//! pointers), `vkAllocateMemory` / `vkFreeMemory` (charged and released), and
//! `vkGetPhysicalDeviceMemoryProperties` / `2` / `2KHR` (the virtual heap sizes and budget).

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, PoisonError, RwLock};

use ash::vk::{self, Handle};

use crate::budget::{Budget, Gpu};
use crate::chain;
use crate::heaps;
use crate::loader::{
    INTERFACE_VERSION, LAYER_LINK_INFO, LAYER_NEGOTIATE_INTERFACE_STRUCT, LayerCreateInfo, LayerDeviceLink,
    LayerInstanceLink, NegotiateLayerInterface,
};

/// The accounting, set by the first negotiation.
static BUDGET: OnceLock<&'static dyn Budget> = OnceLock::new();

/// What the layer keeps of an instance, keyed by its dispatch key.
struct Instance {
    handle: vk::Instance,
    next_get_instance_proc_addr: vk::PFN_vkGetInstanceProcAddr,
    destroy: Option<vk::PFN_vkDestroyInstance>,
    properties: Option<vk::PFN_vkGetPhysicalDeviceProperties>,
    properties2: Option<vk::PFN_vkGetPhysicalDeviceProperties2>,
    memory_properties: Option<vk::PFN_vkGetPhysicalDeviceMemoryProperties>,
    memory_properties2: Option<vk::PFN_vkGetPhysicalDeviceMemoryProperties2>,
    memory_properties2_khr: Option<vk::PFN_vkGetPhysicalDeviceMemoryProperties2>,
    /// How each physical device is accounted, by raw handle, found on first use.
    gpus: Mutex<HashMap<u64, Gpu>>,
}

/// What the layer keeps of a device, keyed by its dispatch key.
struct Device {
    next_get_device_proc_addr: vk::PFN_vkGetDeviceProcAddr,
    destroy: vk::PFN_vkDestroyDevice,
    allocate: vk::PFN_vkAllocateMemory,
    free: vk::PFN_vkFreeMemory,
    gpu: Gpu,
    /// Memory types on device-local heaps (bit i: type i).
    device_local_types: u32,
    /// Charged allocations still alive: memory handle -> bytes.
    allocations: Mutex<HashMap<u64, u64>>,
}

static INSTANCES: LazyLock<RwLock<HashMap<usize, Arc<Instance>>>> = LazyLock::new(Default::default);
static DEVICES: LazyLock<RwLock<HashMap<usize, Arc<Device>>>> = LazyLock::new(Default::default);

/// `vkNegotiateLoaderLayerInterfaceVersion`, with the accounting the layer charges to; returns a
/// `VkResult`. The library that links this crate exports it under that name.
///
/// # Safety
/// `interface` is null or points to the loader's `VkNegotiateLayerInterface`.
pub unsafe fn negotiate(interface: *mut NegotiateLayerInterface, budget: &'static dyn Budget) -> i32 {
    let result = guard(vk::Result::ERROR_INITIALIZATION_FAILED, || {
        // SAFETY: null or the loader's structure (the caller's promise).
        let Some(interface) = (unsafe { interface.as_mut() }) else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        if interface.s_type != LAYER_NEGOTIATE_INTERFACE_STRUCT
            || interface.loader_layer_interface_version < INTERFACE_VERSION
        {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        }
        interface.loader_layer_interface_version = INTERFACE_VERSION;
        interface.get_instance_proc_addr = Some(get_instance_proc_addr);
        interface.get_device_proc_addr = Some(get_device_proc_addr);
        interface.get_physical_device_proc_addr = None;
        BUDGET.get_or_init(|| budget);
        pin_library();
        vk::Result::SUCCESS
    });
    result.as_raw()
}

/// Keeps the library loaded for the life of the process. The loader unloads a layer's library
/// when the instance is destroyed; this one may also be the CUDA hook, with fork handlers, a
/// region mapping and threads of its own that must outlive any instance.
fn pin_library() {
    static PINNED: AtomicBool = AtomicBool::new(false);
    if PINNED.swap(true, Ordering::AcqRel) {
        return;
    }
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let address = pin_library as *const c_void;
    // SAFETY: dladdr writes a Dl_info for an address inside a loaded object.
    if unsafe { libc::dladdr(address, info.as_mut_ptr()) } == 0 {
        return;
    }
    // SAFETY: dladdr succeeded, so the structure is filled.
    let path = unsafe { info.assume_init() }.dli_fname;
    if path.is_null() {
        return;
    }
    // SAFETY: the path of an object that is loaded: RTLD_NOLOAD only takes one more reference to
    // it, and RTLD_NODELETE keeps it mapped. The handle is deliberately never closed.
    unsafe { libc::dlopen(path, libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE) };
}

/// Runs an entry point's body so that no panic crosses into the loader.
fn guard<R>(on_panic: R, body: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        tracing::error!("internal error in the Vulkan layer; returning an error to the caller");
        on_panic
    })
}

/// The loader's dispatch pointer at the start of a dispatchable handle: the same for an instance
/// and its physical devices, and for a device and its queues.
///
/// # Safety
/// `raw` is a live dispatchable handle.
unsafe fn dispatch_key(raw: u64) -> usize {
    // SAFETY: a dispatchable handle points to an object whose first word is the dispatch table.
    unsafe { *(raw as usize as *const usize) }
}

fn instance_of(key: usize) -> Option<Arc<Instance>> {
    INSTANCES
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&key)
        .cloned()
}

fn device_of(key: usize) -> Option<Arc<Device>> {
    DEVICES
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&key)
        .cloned()
}

/// Looks `name` up with a `vkGetInstanceProcAddr` and casts it to its type.
///
/// # Safety
/// `F` is the function pointer type of `name`.
unsafe fn lookup<F: Copy>(gipa: vk::PFN_vkGetInstanceProcAddr, instance: vk::Instance, name: &CStr) -> Option<F> {
    // SAFETY: a loader-given vkGetInstanceProcAddr and a NUL-terminated name.
    let function = unsafe { gipa(instance, name.as_ptr()) }?;
    // SAFETY: F is the type of `name` (the caller's promise), a function pointer like `function`.
    Some(unsafe { std::mem::transmute_copy::<unsafe extern "system" fn(), F>(&function) })
}

/// As [`lookup`], with a `vkGetDeviceProcAddr`.
///
/// # Safety
/// As [`lookup`].
unsafe fn lookup_device<F: Copy>(gdpa: vk::PFN_vkGetDeviceProcAddr, device: vk::Device, name: &CStr) -> Option<F> {
    // SAFETY: a loader-given vkGetDeviceProcAddr and a NUL-terminated name.
    let function = unsafe { gdpa(device, name.as_ptr()) }?;
    // SAFETY: as in `lookup`.
    Some(unsafe { std::mem::transmute_copy::<unsafe extern "system" fn(), F>(&function) })
}

/// The loader's link structure in a create info's chain, to be advanced for the next layer.
///
/// # Safety
/// `next` is a valid `pNext` chain.
unsafe fn link_info<Link>(mut next: *const c_void, s_type: vk::StructureType) -> Option<*mut LayerCreateInfo<Link>> {
    loop {
        // SAFETY: a valid chain (the caller's promise).
        let found = unsafe { chain::find(next, s_type) };
        if found.is_null() {
            return None;
        }
        let info = found.cast::<LayerCreateInfo<Link>>().cast_mut();
        // SAFETY: a structure of this type is the loader's VkLayer*CreateInfo.
        if unsafe { (*info).function } == LAYER_LINK_INFO {
            return Some(info);
        }
        // SAFETY: as above.
        next = unsafe { (*found).p_next }.cast();
    }
}

/// How a physical device is accounted, asked once per instance.
fn gpu_of(instance: &Instance, physical: vk::PhysicalDevice) -> Gpu {
    let raw = physical.as_raw();
    if let Some(gpu) = instance.gpus.lock().unwrap_or_else(PoisonError::into_inner).get(&raw) {
        return *gpu;
    }
    let Some(budget) = BUDGET.get() else { return Gpu::Other };
    let (uuid, vendor) = identify(instance, physical);
    let gpu = budget.gpu(uuid.as_ref(), vendor);
    instance
        .gpus
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(raw, gpu);
    gpu
}

/// The device's UUID (when the driver gives one) and vendor.
fn identify(instance: &Instance, physical: vk::PhysicalDevice) -> (Option<[u8; 16]>, u32) {
    if let Some(properties2) = instance.properties2 {
        // Prefilled with a pattern no driver reports, so an unfilled UUID is told apart (the
        // fake driver's device 0 is all zeros).
        let mut id = vk::PhysicalDeviceIDProperties {
            device_uuid: [0xff; vk::UUID_SIZE],
            ..Default::default()
        };
        let mut properties = vk::PhysicalDeviceProperties2 {
            p_next: std::ptr::from_mut(&mut id).cast(),
            ..Default::default()
        };
        // SAFETY: the next layer's function with a valid physical device and output chain.
        unsafe { properties2(physical, &mut properties) };
        let uuid = (id.device_uuid != [0xff; vk::UUID_SIZE]).then_some(id.device_uuid);
        return (uuid, properties.properties.vendor_id);
    }
    let mut properties = vk::PhysicalDeviceProperties::default();
    if let Some(get) = instance.properties {
        // SAFETY: the next layer's function with a valid physical device and output.
        unsafe { get(physical, &mut properties) };
    }
    (None, properties.vendor_id)
}

unsafe extern "system" fn get_instance_proc_addr(
    instance: vk::Instance,
    name: *const c_char,
) -> vk::PFN_vkVoidFunction {
    guard(None, || {
        if name.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated name from the caller.
        let wanted = unsafe { CStr::from_ptr(name) }.to_bytes();
        match wanted {
            b"vkGetInstanceProcAddr" => return as_void(get_instance_proc_addr as vk::PFN_vkGetInstanceProcAddr),
            b"vkCreateInstance" => return as_void(create_instance as vk::PFN_vkCreateInstance),
            _ => {}
        }
        if instance == vk::Instance::null() {
            return None;
        }
        // SAFETY: a live instance handle from the caller.
        let data = instance_of(unsafe { dispatch_key(instance.as_raw()) })?;
        // SAFETY: the next layer's vkGetInstanceProcAddr with the caller's arguments.
        let next = unsafe { (data.next_get_instance_proc_addr)(instance, name) };
        // What the next layer lacks, this one does not offer either.
        next?;
        intercepted_instance(wanted)
            .or_else(|| intercepted_device(wanted))
            .or(next)
    })
}

unsafe extern "system" fn get_device_proc_addr(device: vk::Device, name: *const c_char) -> vk::PFN_vkVoidFunction {
    guard(None, || {
        if name.is_null() || device == vk::Device::null() {
            return None;
        }
        // SAFETY: a live device handle from the caller.
        let data = device_of(unsafe { dispatch_key(device.as_raw()) })?;
        // SAFETY: the next layer's vkGetDeviceProcAddr with the caller's arguments.
        let next = unsafe { (data.next_get_device_proc_addr)(device, name) };
        next?;
        // SAFETY: a NUL-terminated name from the caller.
        let wanted = unsafe { CStr::from_ptr(name) }.to_bytes();
        intercepted_device(wanted).or(next)
    })
}

fn as_void<F: Copy>(function: F) -> vk::PFN_vkVoidFunction {
    // SAFETY: F is always one of the `unsafe extern "system" fn` types below, the size of any
    // function pointer; the loader casts it back to its type before calling it.
    Some(unsafe { std::mem::transmute_copy::<F, unsafe extern "system" fn()>(&function) })
}

fn intercepted_instance(name: &[u8]) -> vk::PFN_vkVoidFunction {
    match name {
        b"vkDestroyInstance" => as_void(destroy_instance as vk::PFN_vkDestroyInstance),
        b"vkCreateDevice" => as_void(create_device as vk::PFN_vkCreateDevice),
        b"vkGetPhysicalDeviceMemoryProperties" => {
            as_void(get_memory_properties as vk::PFN_vkGetPhysicalDeviceMemoryProperties)
        }
        b"vkGetPhysicalDeviceMemoryProperties2" => {
            as_void(get_memory_properties2 as vk::PFN_vkGetPhysicalDeviceMemoryProperties2)
        }
        b"vkGetPhysicalDeviceMemoryProperties2KHR" => {
            as_void(get_memory_properties2_khr as vk::PFN_vkGetPhysicalDeviceMemoryProperties2)
        }
        _ => None,
    }
}

fn intercepted_device(name: &[u8]) -> vk::PFN_vkVoidFunction {
    match name {
        b"vkGetDeviceProcAddr" => as_void(get_device_proc_addr as vk::PFN_vkGetDeviceProcAddr),
        b"vkDestroyDevice" => as_void(destroy_device as vk::PFN_vkDestroyDevice),
        b"vkAllocateMemory" => as_void(allocate_memory as vk::PFN_vkAllocateMemory),
        b"vkFreeMemory" => as_void(free_memory as vk::PFN_vkFreeMemory),
        _ => None,
    }
}

unsafe extern "system" fn create_instance(
    info: *const vk::InstanceCreateInfo<'_>,
    allocator: *const vk::AllocationCallbacks<'_>,
    out: *mut vk::Instance,
) -> vk::Result {
    guard(vk::Result::ERROR_INITIALIZATION_FAILED, || {
        let Some(budget) = BUDGET.get() else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        if info.is_null() || out.is_null() {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        }
        // SAFETY: the application's create info, valid per the API.
        let Some(link_info) =
            (unsafe { link_info::<LayerInstanceLink>((*info).p_next, vk::StructureType::LOADER_INSTANCE_CREATE_INFO) })
        else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        // SAFETY: the loader's link structure; advancing it hands the next layer its own link.
        let Some(next_gipa) = (unsafe {
            let link = (*link_info).layer_info;
            if link.is_null() {
                return vk::Result::ERROR_INITIALIZATION_FAILED;
            }
            (*link_info).layer_info = (*link).next;
            (*link).next_get_instance_proc_addr
        }) else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        if let Err(line) = budget.check_config() {
            tracing::error!("{line}; Vulkan instance creation refused");
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        }
        // SAFETY: the next layer's entry point, of this type.
        let Some(create) =
            (unsafe { lookup::<vk::PFN_vkCreateInstance>(next_gipa, vk::Instance::null(), c"vkCreateInstance") })
        else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        // SAFETY: the application's arguments, passed on.
        let result = unsafe { create(info, allocator, out) };
        if result == vk::Result::SUCCESS {
            // SAFETY: the instance was just created.
            let handle = unsafe { *out };
            register_instance(handle, next_gipa);
        }
        result
    })
}

fn register_instance(handle: vk::Instance, gipa: vk::PFN_vkGetInstanceProcAddr) {
    // SAFETY: each name is looked up as its own type.
    let data = unsafe {
        Instance {
            handle,
            next_get_instance_proc_addr: gipa,
            destroy: lookup(gipa, handle, c"vkDestroyInstance"),
            properties: lookup(gipa, handle, c"vkGetPhysicalDeviceProperties"),
            properties2: lookup(gipa, handle, c"vkGetPhysicalDeviceProperties2")
                .or_else(|| lookup(gipa, handle, c"vkGetPhysicalDeviceProperties2KHR")),
            memory_properties: lookup(gipa, handle, c"vkGetPhysicalDeviceMemoryProperties"),
            memory_properties2: lookup(gipa, handle, c"vkGetPhysicalDeviceMemoryProperties2"),
            memory_properties2_khr: lookup(gipa, handle, c"vkGetPhysicalDeviceMemoryProperties2KHR"),
            gpus: Mutex::default(),
        }
    };
    // SAFETY: the instance was just created.
    let key = unsafe { dispatch_key(handle.as_raw()) };
    INSTANCES
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key, Arc::new(data));
}

unsafe extern "system" fn destroy_instance(instance: vk::Instance, allocator: *const vk::AllocationCallbacks<'_>) {
    guard((), || {
        if instance == vk::Instance::null() {
            return;
        }
        // SAFETY: a live instance handle from the caller.
        let key = unsafe { dispatch_key(instance.as_raw()) };
        let data = INSTANCES.write().unwrap_or_else(PoisonError::into_inner).remove(&key);
        if let Some(destroy) = data.and_then(|data| data.destroy) {
            // SAFETY: the next layer's function with the caller's arguments.
            unsafe { destroy(instance, allocator) };
        }
    })
}

unsafe extern "system" fn create_device(
    physical: vk::PhysicalDevice,
    info: *const vk::DeviceCreateInfo<'_>,
    allocator: *const vk::AllocationCallbacks<'_>,
    out: *mut vk::Device,
) -> vk::Result {
    guard(vk::Result::ERROR_INITIALIZATION_FAILED, || {
        if info.is_null() || out.is_null() {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        }
        // SAFETY: a live physical device handle from the caller.
        let Some(instance) = instance_of(unsafe { dispatch_key(physical.as_raw()) }) else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        // SAFETY: the application's create info, valid per the API.
        let Some(link_info) =
            (unsafe { link_info::<LayerDeviceLink>((*info).p_next, vk::StructureType::LOADER_DEVICE_CREATE_INFO) })
        else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        // SAFETY: the loader's link structure; advancing it hands the next layer its own link.
        let (Some(next_gipa), Some(next_gdpa)) = (unsafe {
            let link = (*link_info).layer_info;
            if link.is_null() {
                return vk::Result::ERROR_INITIALIZATION_FAILED;
            }
            (*link_info).layer_info = (*link).next;
            ((*link).next_get_instance_proc_addr, (*link).next_get_device_proc_addr)
        }) else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        // SAFETY: the next layer's entry point, of this type.
        let Some(create) = (unsafe { lookup::<vk::PFN_vkCreateDevice>(next_gipa, instance.handle, c"vkCreateDevice") })
        else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        // Asked before the device exists, so a failure to start the accounting is logged once,
        // here, rather than at the first allocation.
        let gpu = gpu_of(&instance, physical);
        // SAFETY: the application's arguments, passed on.
        let result = unsafe { create(physical, info, allocator, out) };
        if result != vk::Result::SUCCESS {
            return result;
        }
        // SAFETY: the device was just created.
        let handle = unsafe { *out };
        let mut properties = vk::PhysicalDeviceMemoryProperties::default();
        if let Some(get) = instance.memory_properties {
            // SAFETY: the next layer's function with a valid physical device and output.
            unsafe { get(physical, &mut properties) };
        }
        // SAFETY: each name is looked up as its own type.
        let functions = unsafe {
            (
                lookup_device::<vk::PFN_vkDestroyDevice>(next_gdpa, handle, c"vkDestroyDevice"),
                lookup_device::<vk::PFN_vkAllocateMemory>(next_gdpa, handle, c"vkAllocateMemory"),
                lookup_device::<vk::PFN_vkFreeMemory>(next_gdpa, handle, c"vkFreeMemory"),
            )
        };
        let (Some(destroy), Some(allocate), Some(free)) = functions else {
            tracing::error!("the Vulkan driver lacks vkDestroyDevice, vkAllocateMemory or vkFreeMemory");
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        let data = Device {
            next_get_device_proc_addr: next_gdpa,
            destroy,
            allocate,
            free,
            gpu,
            device_local_types: heaps::device_local_types(&properties),
            allocations: Mutex::default(),
        };
        // SAFETY: the device was just created.
        let key = unsafe { dispatch_key(handle.as_raw()) };
        DEVICES
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, Arc::new(data));
        result
    })
}

unsafe extern "system" fn destroy_device(device: vk::Device, allocator: *const vk::AllocationCallbacks<'_>) {
    guard((), || {
        if device == vk::Device::null() {
            return;
        }
        // SAFETY: a live device handle from the caller.
        let key = unsafe { dispatch_key(device.as_raw()) };
        let Some(data) = DEVICES.write().unwrap_or_else(PoisonError::into_inner).remove(&key) else {
            return;
        };
        // Destroying a device frees every allocation the application did not.
        let held: u64 = data
            .allocations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, bytes)| bytes)
            .fold(0, u64::saturating_add);
        // SAFETY: the next layer's function with the caller's arguments.
        let mut destroy = || unsafe { (data.destroy)(device, allocator) };
        match (data.gpu, BUDGET.get()) {
            (Gpu::Accounted { id, .. }, Some(budget)) if held > 0 => budget.free(id, held, &mut destroy),
            _ => destroy(),
        }
    })
}

unsafe extern "system" fn allocate_memory(
    device: vk::Device,
    info: *const vk::MemoryAllocateInfo<'_>,
    allocator: *const vk::AllocationCallbacks<'_>,
    memory: *mut vk::DeviceMemory,
) -> vk::Result {
    guard(vk::Result::ERROR_OUT_OF_DEVICE_MEMORY, || {
        // SAFETY: a live device handle from the caller.
        let Some(data) = device_of(unsafe { dispatch_key(device.as_raw()) }) else {
            return vk::Result::ERROR_INITIALIZATION_FAILED;
        };
        // SAFETY: the next layer's function with the caller's arguments.
        let call = || unsafe { (data.allocate)(device, info, allocator, memory) };
        // SAFETY: the application's allocate info, or null (invalid; the driver answers).
        let Some(request) = (unsafe { info.as_ref() }) else {
            return call();
        };
        let on_device_heap = 1u32
            .checked_shl(request.memory_type_index)
            .is_some_and(|bit| data.device_local_types & bit != 0);
        // SAFETY: the application's chain, valid per the API.
        if !on_device_heap || memory.is_null() || unsafe { chain::imports_memory(request.p_next) } {
            return call();
        }
        match data.gpu {
            Gpu::Other => call(),
            Gpu::Unaccounted => {
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        "device memory is limited but the shared region is not in use: every Vulkan allocation on a \
                         device-local heap is refused"
                    );
                }
                vk::Result::ERROR_OUT_OF_DEVICE_MEMORY
            }
            Gpu::Accounted { id, .. } => {
                let Some(budget) = BUDGET.get() else {
                    return call();
                };
                let mut result = vk::Result::ERROR_OUT_OF_DEVICE_MEMORY;
                let granted = budget.allocate(id, request.allocation_size, &mut || {
                    result = call();
                    result == vk::Result::SUCCESS
                });
                if !granted {
                    return vk::Result::ERROR_OUT_OF_DEVICE_MEMORY;
                }
                if result == vk::Result::SUCCESS {
                    // SAFETY: the driver wrote the new handle through the caller's pointer.
                    let handle = unsafe { *memory }.as_raw();
                    data.allocations
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(handle, request.allocation_size);
                }
                result
            }
        }
    })
}

unsafe extern "system" fn free_memory(
    device: vk::Device,
    memory: vk::DeviceMemory,
    allocator: *const vk::AllocationCallbacks<'_>,
) {
    guard((), || {
        // SAFETY: a live device handle from the caller.
        let Some(data) = device_of(unsafe { dispatch_key(device.as_raw()) }) else {
            return;
        };
        // Taken out before the driver frees it: the driver may hand the same handle to another
        // thread's allocation as soon as it has.
        let charged = data
            .allocations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&memory.as_raw());
        // SAFETY: the next layer's function with the caller's arguments.
        let mut free = || unsafe { (data.free)(device, memory, allocator) };
        match (charged, data.gpu, BUDGET.get()) {
            (Some(bytes), Gpu::Accounted { id, .. }, Some(budget)) => budget.free(id, bytes, &mut free),
            _ => free(),
        }
    })
}

/// The limit to show for a physical device, if it has one.
fn limit_of(instance: &Instance, physical: vk::PhysicalDevice) -> Option<(u32, u64)> {
    match gpu_of(instance, physical) {
        Gpu::Accounted { id, limit: Some(limit) } => Some((id, limit)),
        _ => None,
    }
}

unsafe extern "system" fn get_memory_properties(
    physical: vk::PhysicalDevice,
    properties: *mut vk::PhysicalDeviceMemoryProperties,
) {
    guard((), || {
        // SAFETY: a live physical device handle from the caller.
        let Some(instance) = instance_of(unsafe { dispatch_key(physical.as_raw()) }) else {
            return;
        };
        let Some(next) = instance.memory_properties else { return };
        // SAFETY: the next layer's function with the caller's arguments.
        unsafe { next(physical, properties) };
        // SAFETY: the caller's output, filled by the driver (or null: invalid, left alone).
        if let (Some(properties), Some((_, limit))) = (unsafe { properties.as_mut() }, limit_of(&instance, physical)) {
            heaps::limit_heaps(properties, limit);
        }
    })
}

unsafe extern "system" fn get_memory_properties2(
    physical: vk::PhysicalDevice,
    properties: *mut vk::PhysicalDeviceMemoryProperties2<'_>,
) {
    // SAFETY: the caller's arguments, passed on.
    unsafe { memory_properties2(physical, properties, |instance| instance.memory_properties2) }
}

unsafe extern "system" fn get_memory_properties2_khr(
    physical: vk::PhysicalDevice,
    properties: *mut vk::PhysicalDeviceMemoryProperties2<'_>,
) {
    // SAFETY: the caller's arguments, passed on.
    unsafe { memory_properties2(physical, properties, |instance| instance.memory_properties2_khr) }
}

/// `vkGetPhysicalDeviceMemoryProperties2` and its KHR alias: the heaps and, when the chain asks
/// for it, `VK_EXT_memory_budget`.
///
/// # Safety
/// The caller's arguments, valid per the API.
unsafe fn memory_properties2(
    physical: vk::PhysicalDevice,
    properties: *mut vk::PhysicalDeviceMemoryProperties2<'_>,
    next_of: impl FnOnce(&Instance) -> Option<vk::PFN_vkGetPhysicalDeviceMemoryProperties2>,
) {
    guard((), || {
        // SAFETY: a live physical device handle from the caller.
        let Some(instance) = instance_of(unsafe { dispatch_key(physical.as_raw()) }) else {
            return;
        };
        let Some(next) = next_of(&instance) else { return };
        // SAFETY: the next layer's function with the caller's arguments.
        unsafe { next(physical, properties) };
        // SAFETY: the caller's output, filled by the driver (or null: invalid, left alone).
        let (Some(properties), Some((id, limit))) = (unsafe { properties.as_mut() }, limit_of(&instance, physical))
        else {
            return;
        };
        heaps::limit_heaps(&mut properties.memory_properties, limit);
        // SAFETY: the caller's output chain, valid per the API.
        let budget = unsafe {
            chain::find(
                properties.p_next.cast_const(),
                vk::StructureType::PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT,
            )
        };
        if budget.is_null() {
            return;
        }
        // SAFETY: an output structure of this type in the caller's chain.
        let budget_out = unsafe {
            &mut *budget
                .cast::<vk::PhysicalDeviceMemoryBudgetPropertiesEXT<'_>>()
                .cast_mut()
        };
        let used = BUDGET.get().map_or(0, |accounting| accounting.used(id));
        heaps::limit_budget(&properties.memory_properties, budget_out, limit, used);
    })
}
