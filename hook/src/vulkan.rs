//! The Vulkan layer's accounting: `vgpu-vulkan` does the Vulkan side, and charges here, to this
//! process's CUDA accounting (its one slot in the region, its devices matched by UUID, their
//! limits). `vkNegotiateLoaderLayerInterfaceVersion` is the only Vulkan symbol the library
//! exports; nothing here runs unless the Vulkan loader loads the library as a layer.

use std::ffi::c_char;

use vgpu_region::MemoryKind;
use vgpu_vulkan::{Budget, Gpu, NegotiateLayerInterface};

use crate::hooks::real;
use crate::memory::{Accounting, Charge, accounting, charge_or_refuse, limit_configured};
use crate::session::format_uuid;
use crate::sys::cuda::{CUDA_SUCCESS, CUdevice, CUuuid};

/// PCI vendor id of NVIDIA: a device of this vendor that cannot be matched to a CUDA device while
/// a limit is configured is refused device memory (fail closed).
const NVIDIA: u32 = 0x10de;

struct HookBudget;

/// The accounting, started as `cuInit` starts it when the application has not called it yet
/// (a Vulkan-only process, or Vulkan first).
fn started() -> Option<Accounting> {
    if let Some(accounting) = accounting() {
        return Some(accounting);
    }
    let Some(init) = real::cuInit() else {
        tracing::error!("the CUDA driver has no cuInit: Vulkan allocations cannot be accounted");
        return None;
    };
    // SAFETY: the real cuInit with the only flags value it accepts.
    let status = crate::init::cu_init(|| unsafe { init(0) });
    if status != CUDA_SUCCESS {
        tracing::error!("cuInit failed ({status}): Vulkan allocations cannot be accounted");
    }
    accounting()
}

impl Budget for HookBudget {
    fn check_config(&self) -> Result<(), String> {
        crate::session::config().map(|_| ()).map_err(ToString::to_string)
    }

    fn gpu(&self, uuid: Option<&[u8; 16]>, vendor_id: u32) -> Gpu {
        // Another vendor's device (a software renderer, an integrated GPU) is never a CUDA device:
        // no reason to initialise CUDA for it.
        if vendor_id != NVIDIA {
            return Gpu::Other;
        }
        let accounting = started();
        let device = accounting.zip(uuid).and_then(|(accounting, uuid)| {
            let uuid = CUuuid {
                bytes: uuid.map(|byte| byte as c_char),
            };
            accounting.device_by_uuid(&format_uuid(&uuid))
        });
        match device {
            Some(device) => Gpu::Accounted {
                id: device.ordinal as u32,
                // The region's limit now (allocations are checked against it live, at each charge).
                limit: accounting.and_then(|accounting| accounting.limit(device)),
            },
            // A UUID the accounting does not have is another GPU than CUDA's; one that could not
            // be read (or no accounting at all) may be one of CUDA's.
            None if (accounting.is_none() || uuid.is_none()) && limit_configured() => Gpu::Unaccounted,
            None => Gpu::Other,
        }
    }

    fn allocate(&self, id: u32, bytes: u64, call: &mut dyn FnMut() -> bool) -> bool {
        let Some(accounting) = accounting() else { return false };
        let ordinal = id as CUdevice;
        let _in_flight = accounting
            .device(ordinal)
            .map(|device| accounting.in_flight(device.region_index));
        let Ok(charge) = charge_or_refuse(accounting, ordinal, MemoryKind::Data, bytes) else {
            return false;
        };
        if !call()
            && let Some(charge) = charge
        {
            accounting.release(charge);
        }
        true
    }

    fn free(&self, id: u32, bytes: u64, call: &mut dyn FnMut()) {
        let Some((accounting, device)) =
            accounting().and_then(|accounting| Some((accounting, accounting.device(id as CUdevice)?)))
        else {
            return call();
        };
        let _in_flight = accounting.in_flight(device.region_index);
        call();
        accounting.release(Charge {
            region_index: device.region_index,
            kind: MemoryKind::Data,
            bytes,
        });
    }

    fn used(&self, id: u32) -> u64 {
        accounting()
            .and_then(|accounting| Some(accounting.used(accounting.device(id as CUdevice)?)))
            .unwrap_or(0)
    }
}

/// The loader's first call into the layer.
///
/// # Safety
/// `interface` is null or the loader's `VkNegotiateLayerInterface`.
#[unsafe(no_mangle)]
pub unsafe extern "system" fn vkNegotiateLoaderLayerInterfaceVersion(interface: *mut NegotiateLayerInterface) -> i32 {
    crate::log::ensure();
    // SAFETY: the loader's structure, passed on.
    unsafe { vgpu_vulkan::negotiate(interface, &HookBudget) }
}
