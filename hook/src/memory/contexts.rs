//! Contexts, modules and libraries: charged what the driver took for them, measured
//! ([`super::measure`]); a context's destruction releases what it owned.

use vgpu_region::MemoryKind;

use super::accounting::{Accounting, accounting, unaccounted};
use super::charge::{release_owned_by, released};
use super::ledger::Family;
use super::measure::{measured, measured_and_recorded};
use super::spill::between_moves;
use super::units::read;
use crate::sys::cuda::*;

/// The `cuCtxCreate` family: a context is charged what the driver took for it.
pub fn ctx_create(call: impl FnOnce() -> CUresult, pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    measured_and_recorded(Some(dev), MemoryKind::Context, Family::Context, call, pctx)
}

/// `cuCtxDestroy` and `_v2`.
pub fn ctx_destroy(call: impl FnOnce() -> CUresult, ctx: CUcontext) -> CUresult {
    between_moves(|| {
        let result = released(Family::Context, ctx as u64, call);
        if result == CUDA_SUCCESS
            && let Some(accounting) = accounting()
        {
            release_owned_by(accounting, ctx as u64);
        }
        result
    })
}

/// `cuDevicePrimaryCtxRetain`: the first retain creates the primary context and is charged.
pub fn primary_ctx_retain(call: impl FnOnce() -> CUresult, pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let (context, device) = (pctx, dev);
    let Some(accounting) = accounting() else {
        return unaccounted(call);
    };
    accounting.ledger().with_primary(device, |primary| {
        if primary.references > 0 {
            let result = call();
            if result == CUDA_SUCCESS {
                primary.references += 1;
            }
            return result;
        }
        let (result, measured_charge) = measured(device, MemoryKind::Context, call);
        if result == CUDA_SUCCESS {
            primary.references = 1;
            primary.charge = measured_charge;
            // SAFETY: the driver wrote the context on success.
            primary.context = unsafe { read(context) }.map_or(0, |context| context as u64);
        }
        result
    })
}

/// `cuDevicePrimaryCtxRelease` and `_v2`: the charge goes with the last reference.
pub fn primary_ctx_release(call: impl FnOnce() -> CUresult, dev: CUdevice) -> CUresult {
    primary_ctx_drop(call, dev, false)
}

/// `cuDevicePrimaryCtxReset` and `_v2`: a reset destroys the context whatever the count.
pub fn primary_ctx_reset(call: impl FnOnce() -> CUresult, dev: CUdevice) -> CUresult {
    primary_ctx_drop(call, dev, true)
}

fn primary_ctx_drop(call: impl FnOnce() -> CUresult, device: CUdevice, reset: bool) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    between_moves(|| primary_ctx_dropped(accounting, call, device, reset))
}

fn primary_ctx_dropped(
    accounting: Accounting,
    call: impl FnOnce() -> CUresult,
    device: CUdevice,
    reset: bool,
) -> CUresult {
    accounting.ledger().with_primary(device, |primary| {
        let result = call();
        if result == CUDA_SUCCESS {
            primary.references = if reset { 0 } else { primary.references.saturating_sub(1) };
            if primary.references == 0 {
                // The driver destroyed the context, and with it every allocation it owned.
                if let Some(charge) = primary.charge.take() {
                    accounting.release(charge);
                }
                release_owned_by(accounting, std::mem::take(&mut primary.context));
                // The memory it kept for graphs went with it.
                if let Some((charges, _)) = accounting.ledger().take_charges(Family::GraphPool, device as u64) {
                    charges.iter().for_each(|charge| accounting.release(*charge));
                }
            }
        }
        result
    })
}

/// The `cuModuleLoad` family: charged what the driver took for the module's code and data.
pub fn module_load(call: impl FnOnce() -> CUresult, module: *mut CUmodule) -> CUresult {
    measured_and_recorded(None, MemoryKind::Module, Family::Module, call, module)
}

/// `cuModuleUnload`.
pub fn module_unload(call: impl FnOnce() -> CUresult, hmod: CUmodule) -> CUresult {
    released(Family::Module, hmod as u64, call)
}

/// The `cuLibraryLoad` family.
pub fn library_load(call: impl FnOnce() -> CUresult, library: *mut CUlibrary) -> CUresult {
    measured_and_recorded(None, MemoryKind::Module, Family::Library, call, library)
}

/// `cuLibraryUnload`.
pub fn library_unload(call: impl FnOnce() -> CUresult, library: CUlibrary) -> CUresult {
    released(Family::Library, library as u64, call)
}
