//! `vgpu-smi set`: changes a running container's limits in its region (`limit[d]`, `sm_limit[d]`),
//! under the region's lock. Every process of the container enforces the region's limits, read
//! live (`docs/memory-accounting.md`, `docs/compute-limit.md`), so the change takes effect in all
//! of them; the values are checked as `libvgpu.so` checks its variables.
//!
//! A region no process uses is changed too: a valid region keeps its limits when the container's
//! next process reuses it (`vgpu_region::OpenKind::Reinitialised`), so the change lasts. A
//! missing file is not created.

use std::path::Path;

use vgpu_region::{Owners, Region};

use crate::read::shown;
use crate::units::human_bytes;

/// A memory limit as `CUDA_DEVICE_MEMORY_LIMIT` takes it (`4g`, `4096m`, `1.5GiB`, bytes; 0 =
/// none), in bytes.
pub fn parse_memory(text: &str) -> Result<u64, String> {
    vgpu_config::parse_size(text)
}

/// A compute limit as `CUDA_DEVICE_SM_LIMIT` takes it (0..100; 0 and 100 = none), as the region
/// holds it (0 = none).
pub fn parse_sm(text: &str) -> Result<u64, String> {
    vgpu_config::parse_percent(text).map(|percent| percent.map_or(0, u64::from))
}

/// One device's limits before and after.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub device: usize,
    pub uuid: String,
    pub memory: (u64, u64),
    pub sm: (u64, u64),
}

impl Change {
    /// `GPU 0 (GPU-...): memory 1.00 GiB -> 4.00 GiB, compute 50% -> 30%`; a limit that did not
    /// move says so.
    pub fn describe(&self) -> String {
        let memory = |bytes: u64| {
            if bytes == 0 {
                "none".to_owned()
            } else {
                human_bytes(bytes)
            }
        };
        let sm = |percent: u64| {
            if percent == 0 {
                "none".to_owned()
            } else {
                format!("{percent}%")
            }
        };
        let part = |name: &str, (old, new): (u64, u64), show: &dyn Fn(u64) -> String| {
            if old == new {
                format!("{name} {} (unchanged)", show(new))
            } else {
                format!("{name} {} -> {}", show(old), show(new))
            }
        };
        format!(
            "GPU {} ({}): {}, {}",
            self.device,
            self.uuid,
            part("memory", self.memory, &memory),
            part("compute", self.sm, &sm)
        )
    }
}

/// Writes `memory` and `sm` (each `None`: left as it is) for one region device (`Some(index)`) or
/// for every device the region has, under the region's lock. The error is one line naming the
/// file.
pub fn set_limits(
    path: &Path,
    device: Option<usize>,
    memory: Option<u64>,
    sm: Option<u64>,
) -> Result<Vec<Change>, String> {
    let fail = |problem: String| format!("{}: {problem}", shown(path));
    // An operator's tool: the file may belong to whichever user started the container's first
    // process. Only the two limit fields are written.
    let region = match Region::open_in_use(path, Owners::Any) {
        Ok(region) => region,
        Err(vgpu_region::RegionError::NotInUse { .. }) => open_idle(path).map_err(&fail)?,
        Err(other) => return Err(other.to_string()),
    };
    // Dropped before the region (declared after it): unwatched before the unmap. The open itself
    // is not watched (the region crate reads the file before it returns).
    let (start, len) = region.mapped_range();
    let watch = crate::shrink::watch(start, len);
    let changes = change_limits(&region, device, memory, sm, &fail);
    if watch.shrank() {
        return Err(fail(crate::read::SHRANK.into()));
    }
    changes
}

/// A region no process uses, opened to change its limits: reinitialised with its own devices, so
/// that it keeps its limits and HAMi's fields (and drops its dead processes' slots). Refused when
/// the file is not a valid region (it would be rebuilt empty).
fn open_idle(path: &Path) -> Result<Region, String> {
    let bytes = std::fs::read(path).map_err(|error| format!("cannot read it: {error}"))?;
    let snapshot = vgpu_region::read_snapshot(&bytes)
        .map_err(|problem| format!("no process uses it and it is not a valid region ({problem})"))?;
    let init = vgpu_region::InitParams {
        device_uuids: snapshot.uuids,
        ..vgpu_region::InitParams::default()
    };
    Region::open_with(path, &init, Owners::Any).map_err(|error| error.to_string())
}

fn change_limits(
    region: &Region,
    device: Option<usize>,
    memory: Option<u64>,
    sm: Option<u64>,
    fail: &dyn Fn(String) -> String,
) -> Result<Vec<Change>, String> {
    let uuids = region.snapshot().uuids;
    let devices = match device {
        Some(index) if index < uuids.len() => vec![index],
        Some(index) => {
            return Err(fail(format!(
                "it has no device {index} ({} device{} registered: see the GPU column of vgpu-smi)",
                uuids.len(),
                if uuids.len() == 1 { "" } else { "s" }
            )));
        }
        None if uuids.is_empty() => return Err(fail("no device is registered in it yet".into())),
        None => (0..uuids.len()).collect(),
    };
    devices
        .into_iter()
        .map(|index| {
            let (old_memory, old_sm) = region
                .set_limits(index, memory, sm)
                .map_err(|error| error.to_string())?;
            Ok(Change {
                device: index,
                uuid: uuids[index].clone(),
                memory: (old_memory, memory.unwrap_or(old_memory)),
                sm: (old_sm, sm.unwrap_or(old_sm)),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_read_as_the_variables_are() {
        assert_eq!(parse_memory("4g"), Ok(4 << 30));
        assert_eq!(parse_memory("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_memory("0"), Ok(0));
        for bad in ["", "4 g", "-1g", "0x10", "1gbx", "4q"] {
            assert!(parse_memory(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_sm("30"), Ok(30));
        assert_eq!(parse_sm("0"), Ok(0));
        assert_eq!(parse_sm("100"), Ok(0), "100 is no limit, written as 0");
        for bad in ["101", "-5", "30%", "", "1.5"] {
            assert!(parse_sm(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_change_says_what_moved() {
        let change = Change {
            device: 0,
            uuid: "GPU-x".into(),
            memory: (1 << 30, 4 << 30),
            sm: (50, 50),
        };
        assert_eq!(
            change.describe(),
            "GPU 0 (GPU-x): memory 1.00 GiB -> 4.00 GiB, compute 50% (unchanged)"
        );
        let lifted = Change {
            memory: (1 << 30, 0),
            sm: (0, 30),
            ..change
        };
        assert_eq!(
            lifted.describe(),
            "GPU 0 (GPU-x): memory 1.00 GiB -> none, compute none -> 30%"
        );
    }
}
