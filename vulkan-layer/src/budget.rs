//! What the layer asks of the library's memory accounting. `libvgpu.so` answers from its CUDA
//! accounting (one slot per process, the configured limits, the region); tests answer from a
//! table.

/// How a Vulkan physical device is accounted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gpu {
    /// A GPU of the accounting, with its id there (the CUDA ordinal) and its limit in bytes.
    Accounted { id: u32, limit: Option<u64> },
    /// Not a GPU the accounting knows (another vendor's device, a software renderer): its
    /// allocations pass uncharged and its heaps are shown as they are.
    Other,
    /// A GPU that must be accounted but cannot be (the accounting could not start while a memory
    /// limit is configured): its device-local allocations are refused (fail closed).
    Unaccounted,
}

/// The accounting behind the layer. Every method must be safe to call from any thread.
pub trait Budget: Sync {
    /// Whether the configuration can be used; the error is one line for the log. Checked at
    /// `vkCreateInstance`, which fails on a malformed configuration (as `cuInit` does).
    fn check_config(&self) -> Result<(), String>;

    /// The GPU with this UUID (`VkPhysicalDeviceIDProperties::deviceUUID`, which is the CUDA
    /// UUID on NVIDIA); starts the accounting on first use. `None`: the device's UUID could not
    /// be read; `vendor_id` then decides.
    fn gpu(&self, uuid: Option<&[u8; 16]>, vendor_id: u32) -> Gpu;

    /// Reserves `bytes` on GPU `id` under its limit, then runs `call` (the driver's allocation)
    /// and keeps the charge when it returns true, rolls it back otherwise. False when refused:
    /// over the limit, or the region could not be updated (fail closed); `call` is not run then.
    fn allocate(&self, id: u32, bytes: u64, call: &mut dyn FnMut() -> bool) -> bool;

    /// Runs `call` (the driver's free), then releases `bytes` charged on GPU `id`.
    fn free(&self, id: u32, bytes: u64, call: &mut dyn FnMut());

    /// Bytes charged on GPU `id` by every process of the region (CUDA and Vulkan).
    fn used(&self, id: u32) -> u64;
}
