//! Charging and releasing around a driver call, for every handler: an allocation reserves in the
//! shared region first, calls the driver and rolls back if it fails; a free calls the driver first
//! and releases on success; a handle we never charged goes to the driver untouched. Without
//! accounting (no successful `cuInit`) an allocation under a memory limit is refused
//! ([`unaccounted`](super::accounting::unaccounted)); frees go to the driver.

use vgpu_region::MemoryKind;

use super::accounting::{Accounting, accounting, unaccounted};
use super::ledger::{Charge, Charges, Family};
use super::pool_sync::charge_or_refuse;
use crate::hooks::real;
use crate::session::current_ordinal;
use crate::sys::cuda::*;

/// Reserves `bytes` on `ordinal` (or the current device), calls the driver, and records the charge
/// under the key `key_of` reads back, or rolls it back.
pub(super) fn charged(
    ordinal: Option<CUdevice>,
    kind: MemoryKind,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    family: Family,
    key_of: impl FnOnce() -> Option<u64>,
) -> CUresult {
    charged_or(ordinal, kind, bytes, call, |status, _| (status, family), family, key_of)
}

/// As [`charged`]; a charged allocation the driver refused is handed to `refused` with the
/// driver's answer and the bytes charged (elastic memory serves it from host memory there), and a
/// success of `refused` is charged under the family it answers. The failure is handled out of
/// line and the size comes from the charge, so that an allocation that works runs exactly as in
/// [`charged`], with nothing more kept across the driver call.
pub(super) fn charged_or(
    ordinal: Option<CUdevice>,
    kind: MemoryKind,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    refused: impl FnOnce(CUresult, u64) -> (CUresult, Family),
    family: Family,
    key_of: impl FnOnce() -> Option<u64>,
) -> CUresult {
    let Some(accounting) = accounting() else {
        return unaccounted(call);
    };
    let Some(ordinal) = ordinal.or_else(current_ordinal) else {
        return call();
    };
    let _in_flight = accounting
        .device(ordinal)
        .map(|device| accounting.in_flight(device.region_index));
    let charge = match charge_or_refuse(accounting, ordinal, kind, bytes) {
        Ok(charge) => charge,
        Err(status) => return status,
    };
    let result = call();
    if result != CUDA_SUCCESS {
        return refused_by_driver(accounting, charge, result, refused, key_of);
    }
    recorded(accounting, charge, family, key_of);
    result
}

/// An allocation the driver refused with `status`: what `refused` makes of it, recorded as
/// [`recorded`] does on a success, or the charge rolled back.
#[cold]
#[inline(never)]
fn refused_by_driver(
    accounting: Accounting,
    charge: Option<Charge>,
    status: CUresult,
    refused: impl FnOnce(CUresult, u64) -> (CUresult, Family),
    key_of: impl FnOnce() -> Option<u64>,
) -> CUresult {
    let Some(charge) = charge else { return status };
    match refused(status, charge.bytes) {
        (CUDA_SUCCESS, family) => {
            recorded(accounting, Some(charge), family, key_of);
            CUDA_SUCCESS
        }
        (result, _) => {
            accounting.release(charge);
            result
        }
    }
}

/// Records the charge of an allocation that worked under the key `key_of` reads back (rolled
/// back when there is none).
fn recorded(accounting: Accounting, charge: Option<Charge>, family: Family, key_of: impl FnOnce() -> Option<u64>) {
    match (charge, key_of()) {
        (Some(charge), Some(key)) => accounting.ledger().insert_owned(family, key, charge, owner_of(family)),
        (Some(charge), None) => accounting.release(charge),
        (None, _) => {}
    }
}

/// The context whose destruction frees a handle of this family (0: none does).
fn owner_of(family: Family) -> u64 {
    match family {
        Family::Pointer | Family::Spill | Family::Array | Family::MipmappedArray | Family::Module | Family::Library => {
            current_context()
        }
        Family::PhysicalHandle
        | Family::SpillHandle
        | Family::SplitHandle
        | Family::Context
        | Family::Graph
        | Family::Pool
        | Family::ReleasedMapped
        | Family::GraphPool => 0,
    }
}

/// The current context, as a key (0: none).
pub(super) fn current_context() -> u64 {
    let Some(get_current) = real::cuCtxGetCurrent() else {
        return 0;
    };
    let mut context: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    if unsafe { get_current(&mut context) } == CUDA_SUCCESS {
        context as u64
    } else {
        0
    }
}

/// Releases everything the driver freed with a context.
pub(super) fn release_owned_by(accounting: Accounting, context: u64) {
    for charge in accounting.ledger().take_owned_by(context) {
        accounting.release(charge);
    }
    super::spill::forget_context(accounting, context);
}

/// Calls the driver to free `key`, then releases what was charged under it if the free worked.
pub(super) fn released(family: Family, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    released_with(family, key, call, |_, _| {}, |_, _, call| call())
}

/// As [`released`], running `before_release` after a free that worked, with the charges out of
/// the ledger but not yet released (what takes them over is recorded first).
pub(super) fn released_after(
    family: Family,
    key: u64,
    call: impl FnOnce() -> CUresult,
    before_release: impl FnOnce(Accounting, &Charges),
) -> CUresult {
    released_with(family, key, call, before_release, |_, _, call| call())
}

/// As [`released`]; a `key` not charged under `family` goes to `missing` with the call instead of
/// straight to the driver (elastic memory's pointers are looked for there, so that a free of any
/// other pointer does not look).
pub(super) fn released_or<C: FnOnce() -> CUresult>(
    family: Family,
    key: u64,
    call: C,
    missing: impl FnOnce(Accounting, u64, C) -> CUresult,
) -> CUresult {
    released_with(family, key, call, |_, _| {}, missing)
}

/// [`released_after`] and [`released_or`] in one: `before_release` after a free of a charged
/// `key` that worked, `missing` with the call for a `key` not charged under `family`.
pub(super) fn released_with<C: FnOnce() -> CUresult>(
    family: Family,
    key: u64,
    call: C,
    before_release: impl FnOnce(Accounting, &Charges),
    missing: impl FnOnce(Accounting, u64, C) -> CUresult,
) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    let Some((charges, owner)) = accounting.ledger().take_charges(family, key) else {
        return missing(accounting, key, call);
    };
    let _in_flight = charges
        .iter()
        .next()
        .map(|charge| accounting.in_flight(charge.region_index));
    let result = call();
    if result == CUDA_SUCCESS {
        before_release(accounting, &charges);
        charges.iter().for_each(|charge| accounting.release(*charge));
    } else {
        accounting.ledger().put_back(family, key, charges, owner);
    }
    result
}
