//! Measuring what the driver takes for a context or a module, which cannot be sized beforehand:
//! NVML's view of the device before and after the call, read while no data call of the region is
//! under way, and the measured amount recorded (never refused: the driver has already taken it).
//!
//! A context is reserved before the driver is called, at the size the region's last context on
//! the device measured (`vgpu_region::ContextEstimate`), and refused when that does not fit the
//! limit; after the call the charge is corrected to what was measured. So contexts created
//! together (a start-up storm, a job restarted by its operator) cannot take the device past the
//! limit between their creation and their charge. The region's first context is measured by one
//! process while the others wait for its figure (bounded).

use std::time::{Duration, Instant};

use vgpu_region::{ContextEstimate, MemoryKind};

use super::accounting::{accounting, unaccounted};
use super::ledger::{Charge, Family};
use super::units::read;
use crate::hooks::real;
use crate::session::current_ordinal;
use crate::sys::cuda::*;

/// What NVML says is used on a GPU: in all, and by this process where NVML lists processes (it
/// does not on some VMs, and in a container it lists host pids, which are not ours).
#[derive(Clone, Copy)]
struct NvmlUsage {
    device: u64,
    own: Option<u64>,
}

fn nvml_usage(uuid: &str) -> Option<NvmlUsage> {
    use crate::sys::nvml::{NVML_ERROR_INSUFFICIENT_SIZE, NVML_SUCCESS, nvmlProcessInfo_t};
    let device = crate::nvml::device_handle(uuid)?;
    let device_used = nvml_used(device)?;
    let processes = real::nvmlDeviceGetComputeRunningProcesses_v3()?;
    let mut count: std::ffi::c_uint = 0;
    // SAFETY: a zero count with a null array asks for the count.
    let status = unsafe { processes(device, &mut count, std::ptr::null_mut()) };
    let mut own = None;
    if status == NVML_ERROR_INSUFFICIENT_SIZE || status == NVML_SUCCESS {
        let mut infos = vec![nvmlProcessInfo_t::default(); count as usize + 8];
        let mut capacity = infos.len() as std::ffi::c_uint;
        // SAFETY: the array holds `capacity` entries.
        if unsafe { processes(device, &mut capacity, infos.as_mut_ptr()) } == NVML_SUCCESS {
            let pid = std::process::id();
            own = infos
                .iter()
                .take(capacity as usize)
                .find(|info| info.pid == pid)
                .map(|info| info.usedGpuMemory);
        }
    }
    Some(NvmlUsage {
        device: device_used,
        own,
    })
}

/// Device memory used on a device according to NVML (what the driver really took, whoever asked).
fn nvml_used(device: crate::sys::nvml::nvmlDevice_t) -> Option<u64> {
    use crate::sys::nvml::{NVML_SUCCESS, nvmlMemory_t};
    let memory_info = real::nvmlDeviceGetMemoryInfo()?;
    let mut memory = nvmlMemory_t::default();
    // SAFETY: a handle NVML gave and a local out-pointer.
    (unsafe { memory_info(device, &mut memory) } == NVML_SUCCESS).then_some(memory.used)
}

/// Upper bound for one measured context or module, so a concurrent allocation by another process
/// during the measurement cannot inflate the charge without bound.
const MEASURED_CEILING: u64 = 4 << 30;

/// How long a measurement waits for a moment when no data call of the region is under way. Short:
/// a process killed in the middle of a data call leaves its mark behind, and every later
/// measurement on that device then waits this long before it reads anyway (as without the marks).
const QUIET_WAIT: Duration = Duration::from_millis(50);

/// How long a context creation waits for the region's first context on its device to be
/// measured by another process: a context's creation takes tens to hundreds of milliseconds.
const FIRST_CONTEXT_WAIT: Duration = Duration::from_secs(2);

/// A context's reservation, made before the driver is called.
enum Reservation {
    /// Not a context, or no size is known: charged once measured, as a module is.
    None,
    /// Charged at the last context's size.
    Charged(Option<Charge>),
    /// This process measures the region's first context on the device.
    Measuring,
}

/// Runs a call that makes the driver take memory we cannot size beforehand (a context, a
/// module), measuring it with NVML, and records the measured amount (never refused: the driver
/// has already taken it). A context is reserved first (see the module's description); `Err` of
/// the reservation is the status the application gets, the driver not called.
pub(super) fn measured(
    ordinal: CUdevice,
    kind: MemoryKind,
    call: impl FnOnce() -> CUresult,
) -> (CUresult, Option<Charge>) {
    let Some(accounting) = accounting() else {
        return (unaccounted(call), None);
    };
    let Some(device) = accounting.device(ordinal) else {
        return (call(), None);
    };
    // NVML and the region's total are read as a pair while no data call of the region is under
    // way (its charge and the driver's memory may disagree then): the region's net change over
    // the window, charges less releases, is then exactly what the others made the driver take.
    let pair = || (nvml_usage(&device.uuid), accounting.used(device));
    let quiet = |limit| {
        accounting
            .region()
            .quiet_read(device.region_index, Instant::now() + limit, pair)
    };
    let region = accounting.region();
    let reservation = if kind == MemoryKind::Context {
        match region.context_estimate(device.region_index, FIRST_CONTEXT_WAIT) {
            ContextEstimate::Known(bytes) => match accounting.charge(ordinal, kind, bytes.min(MEASURED_CEILING)) {
                Ok(charge) => Reservation::Charged(charge),
                Err(status) => {
                    tracing::info!(
                        "device {ordinal}: a new context, which takes about {} MiB here, does not fit the memory \
                         limit: refused",
                        bytes >> 20
                    );
                    return (status, None);
                }
            },
            ContextEstimate::Measure => Reservation::Measuring,
            ContextEstimate::Unknown => Reservation::None,
        }
    } else {
        Reservation::None
    };
    let before = quiet(QUIET_WAIT).unwrap_or_else(pair);
    let result = call();
    if result != CUDA_SUCCESS {
        match reservation {
            Reservation::Charged(Some(charge)) => accounting.release(charge),
            Reservation::Measuring => region.context_measured(device.region_index, 0),
            Reservation::Charged(None) | Reservation::None => {}
        }
        return (result, None);
    }
    let after = quiet(QUIET_WAIT).unwrap_or_else(pair);
    // None: NVML could not tell.
    let taken = match (before, after) {
        // NVML's count for this very process: exact, whatever others do meanwhile.
        (
            (Some(before), _),
            (
                Some(NvmlUsage {
                    own: Some(own_after), ..
                }),
                _,
            ),
        ) => Some(own_after.saturating_sub(before.own.unwrap_or(0))),
        // The GPU's total less the net change of the region's total (other containers and
        // concurrent context creations can still skew it; the cap and the floor bound that).
        ((Some(before), used_before), (Some(after), used_after)) => {
            let gpu = i128::from(after.device) - i128::from(before.device);
            let region = i128::from(used_after) - i128::from(used_before);
            Some(u64::try_from((gpu - region).max(0)).unwrap_or(u64::MAX))
        }
        _ => None,
    };
    let taken = taken.map(|taken| taken.min(MEASURED_CEILING));
    if kind == MemoryKind::Context {
        region.context_measured(device.region_index, taken.unwrap_or(0));
    }
    let charge = match reservation {
        Reservation::Charged(Some(reserved)) => corrected(&accounting, ordinal, reserved, taken),
        Reservation::Charged(None) => None,
        Reservation::Measuring | Reservation::None => accounting.record(ordinal, kind, taken.unwrap_or(0)),
    };
    (result, charge)
}

/// A context's reservation corrected to what it measured (`taken`; `None` when NVML could not
/// tell, and the reservation stands). `None` when nothing is left charged.
fn corrected(
    accounting: &super::accounting::Accounting,
    ordinal: CUdevice,
    reserved: Charge,
    taken: Option<u64>,
) -> Option<Charge> {
    let Some(taken) = taken else {
        return Some(reserved);
    };
    if taken > reserved.bytes {
        return Some(
            match accounting.record(ordinal, reserved.kind, taken - reserved.bytes) {
                Some(more) => Charge {
                    bytes: reserved.bytes + more.bytes,
                    ..reserved
                },
                None => reserved,
            },
        );
    }
    if taken < reserved.bytes {
        accounting.release(Charge {
            bytes: reserved.bytes - taken,
            ..reserved
        });
    }
    (taken > 0).then_some(Charge {
        bytes: taken,
        ..reserved
    })
}

/// Measures what a call that creates a handle (context, module, library) makes the driver take,
/// and records it under the handle the driver wrote.
pub(super) fn measured_and_recorded<H>(
    ordinal: Option<CUdevice>,
    kind: MemoryKind,
    family: Family,
    call: impl FnOnce() -> CUresult,
    handle: *mut *mut H,
) -> CUresult {
    let Some(ordinal) = ordinal.or_else(current_ordinal) else {
        return call();
    };
    let (result, charge) = measured(ordinal, kind, call);
    // SAFETY: the driver wrote the handle on success (null is checked).
    if let (Some(charge), Some(handle), Some(accounting)) = (charge, unsafe { read(handle) }, accounting()) {
        accounting.ledger().insert(family, handle as u64, charge);
    }
    result
}
