//! What `vgpu-smi` shows, made from region reads. The JSON form of [`Report`] is the documented,
//! stable schema (`docs/monitoring.md`): fields are only ever added, never renamed or retyped, and
//! [`SCHEMA_VERSION`] increases if that rule ever has to be broken.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use vgpu_region::{MAX_DEVICES, SLOT_LIVE};

use crate::read::RegionRead;

/// Version of the JSON schema.
pub const SCHEMA_VERSION: u32 = 1;

/// Every region read at one moment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// [`SCHEMA_VERSION`].
    pub schema: u32,
    /// When the regions were read, milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    pub regions: Vec<RegionReport>,
}

/// One region file: a container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionReport {
    pub path: String,
    /// Why the region could not be read (one line); `null` when it was. When set, `devices` and
    /// `processes` are empty and the other fields `null`.
    pub error: Option<String>,
    /// HAMi-core layout version, `"1.2"`.
    pub layout_version: Option<String>,
    /// vgpu extension version; `null` for a HAMi-core file (no suspend, no running totals).
    pub extension_version: Option<u32>,
    /// When the region was created (seconds since the epoch), from the vgpu extension.
    pub created_unix_secs: Option<u64>,
    /// What HAMi's monitor reads and writes to hold or release the container; `null` when the
    /// region could not be read.
    pub hami: Option<HamiReport>,
    pub devices: Vec<DeviceReport>,
    pub processes: Vec<ProcessReport>,
}

/// The region's fields HAMi's monitor uses to schedule the container's launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HamiReport {
    /// 1: the compute limit applies; 0: HAMi lifted it (the container is alone on its GPU, under
    /// the default `GPU_CORE_UTILIZATION_POLICY`).
    pub utilization_switch: i32,
    /// HAMi's activity count (set to 2 by a launch, counted down by HAMi's monitor); -1: the
    /// container's launches are held while a higher-priority container runs.
    pub recent_kernel: i32,
    /// `CUDA_TASK_PRIORITY` of the container (lower is more urgent, as HAMi reads it).
    pub priority: i32,
    /// Unix seconds of the container's last launch (or of a process's attach).
    pub last_kernel_time_unix_secs: i64,
}

/// One device of a region, summed over the region's live processes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceReport {
    /// Region device index (the position of the UUID in the region, not a CUDA ordinal).
    pub index: usize,
    pub uuid: String,
    /// Memory limit in bytes; `null` when unlimited.
    pub memory_limit_bytes: Option<u64>,
    /// Bytes charged by the region's processes that are alive (the sum of their slots' totals; a
    /// dead process's slot, not reaped yet, is listed but not counted).
    pub memory_used_bytes: u64,
    /// `limit - used` (0 when over); `null` when unlimited.
    pub memory_free_bytes: Option<u64>,
    /// Of the used bytes: CUDA contexts, loaded modules, data allocations (sums over the slots of
    /// processes that are alive).
    pub memory_context_bytes: u64,
    pub memory_module_bytes: u64,
    pub memory_data_bytes: u64,
    /// Of the data bytes: those host memory backs because the device could not
    /// (`CUDA_OVERSUBSCRIBE`); the job runs, slower, while this is above 0.
    pub memory_host_backed_bytes: u64,
    /// Of the used bytes: those of released processes (`vgpu-smi suspend --release`), off the
    /// GPU while they are held.
    pub memory_released_bytes: u64,
    /// Compute limit in percent; `null` when unlimited.
    pub sm_limit_percent: Option<u64>,
    /// Measured SM utilisation: the sum of the processes' `device_util[d].sm_util`, those alive.
    pub sm_util_percent: u64,
    /// Processes alive holding memory or utilisation on the device.
    pub process_count: usize,
    /// The compute limiter's running totals since the region was created, over every process
    /// that has used it (also those gone); `null` for a HAMi-core region (no vgpu extension).
    pub limiter: Option<LimiterReport>,
}

/// The compute limiter's counters for one device of a region. `held_ns` and `launches` only
/// grow, so a monitor reads a rate from two reports (held seconds per second is the share of
/// time launches waited); `charged_ns` mostly grows, but a correction down lowers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimiterReport {
    /// GPU time (ns) charged to the limited launches: the estimates at launch plus the
    /// corrections that measurements brought.
    pub charged_ns: u64,
    /// Wall time (ns) limited launches spent held for budget (or by HAMi's `recent_kernel`),
    /// summed over threads.
    pub held_ns: u64,
    /// Launches that went through the limiter.
    pub launches: u64,
}

/// One process slot of a region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessReport {
    pub slot: usize,
    /// Pid in the container's pid namespace.
    pub pid: i32,
    /// Pid on the host when HAMi's monitor filled it in; `null` otherwise.
    pub host_pid: Option<i32>,
    /// `"live"` or `"dead"` (the slot is in use but its process has exited and the slot has not
    /// been reaped yet), as seen from the monitor's pid namespace.
    pub status: String,
    /// The vgpu `suspend` flag is set: its launches and copies wait.
    pub suspended: bool,
    /// `vgpu-smi suspend --release` checkpointed it: its GPU memory is in host memory, off the
    /// GPU (its charges stay against the limit) until `resume` restores it.
    pub released: bool,
    /// False when a writer was mid-update on every attempt: the figures may be torn.
    pub consistent: bool,
    /// Devices on which the process holds memory or utilisation.
    pub devices: Vec<ProcessDeviceReport>,
}

/// One process on one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessDeviceReport {
    pub index: usize,
    pub uuid: String,
    pub context_bytes: u64,
    pub module_bytes: u64,
    pub data_bytes: u64,
    /// Of the data bytes: those host memory backs (`CUDA_OVERSUBSCRIBE`).
    pub host_backed_bytes: u64,
    pub total_bytes: u64,
    pub sm_util_percent: u64,
}

pub use crate::liveness::process_is_alive;

/// Milliseconds since the Unix epoch now.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

/// Builds the report from region reads; `is_alive(pid, recorded start time)` decides each
/// slot's status.
pub fn build_report(reads: &[RegionRead], time_unix_ms: u64, is_alive: impl Fn(i32, Option<u64>) -> bool) -> Report {
    let regions = reads.iter().map(|read| region_report(read, &is_alive)).collect();
    Report {
        schema: SCHEMA_VERSION,
        time_unix_ms,
        regions,
    }
}

fn region_report(read: &RegionRead, is_alive: &impl Fn(i32, Option<u64>) -> bool) -> RegionReport {
    let path = read.path.to_string_lossy().into_owned();
    let state = match &read.result {
        Ok(state) => state,
        Err(message) => {
            return RegionReport {
                path,
                error: Some(message.clone()),
                layout_version: None,
                extension_version: None,
                created_unix_secs: None,
                hami: None,
                devices: Vec::new(),
                processes: Vec::new(),
            };
        }
    };
    let snapshot = &state.snapshot;
    let device_count = snapshot.uuids.len().min(MAX_DEVICES);
    // Judged once per slot: the device totals below count the processes that are alive only.
    let alive: Vec<bool> = snapshot
        .processes
        .iter()
        .map(|process| process.status == SLOT_LIVE && is_alive(process.pid, process.start_time))
        .collect();
    let processes: Vec<ProcessReport> = snapshot
        .processes
        .iter()
        .zip(&alive)
        .zip(state.suspended.iter().copied().chain(std::iter::repeat(false)))
        .zip(state.released.iter().copied().chain(std::iter::repeat(false)))
        .map(|(((process, &alive), suspended), released)| {
            let devices = (0..device_count)
                .filter(|&device| process.memory[device].total > 0 || process.sm_util[device] > 0)
                .map(|device| {
                    let memory = process.memory[device];
                    ProcessDeviceReport {
                        index: device,
                        uuid: snapshot.uuids[device].clone(),
                        context_bytes: memory.context,
                        module_bytes: memory.module,
                        data_bytes: memory.data,
                        host_backed_bytes: process.host_backed[device],
                        total_bytes: memory.total,
                        sm_util_percent: process.sm_util[device],
                    }
                })
                .collect();
            ProcessReport {
                slot: process.slot,
                pid: process.pid,
                host_pid: (process.hostpid != 0).then_some(process.hostpid),
                status: if alive { "live" } else { "dead" }.to_string(),
                suspended,
                released,
                consistent: process.consistent,
                devices,
            }
        })
        .collect();
    let live_slots: Vec<_> = snapshot
        .processes
        .iter()
        .zip(&alive)
        .filter_map(|(process, &alive)| alive.then_some(process))
        .collect();
    let devices = (0..device_count)
        .map(|device| {
            let sum = |field: fn(&vgpu_region::ProcessSnapshot, usize) -> u64| {
                live_slots
                    .iter()
                    .fold(0u64, |total, process| total.saturating_add(field(process, device)))
            };
            let limit = (snapshot.limits[device] != 0).then_some(snapshot.limits[device]);
            // Not the region's running total, which counts dead slots until they are reaped.
            let used = sum(|process, device| process.memory[device].total);
            DeviceReport {
                index: device,
                uuid: snapshot.uuids[device].clone(),
                memory_limit_bytes: limit,
                memory_used_bytes: used,
                memory_free_bytes: limit.map(|limit| limit.saturating_sub(used)),
                memory_context_bytes: sum(|process, device| process.memory[device].context),
                memory_module_bytes: sum(|process, device| process.memory[device].module),
                memory_data_bytes: sum(|process, device| process.memory[device].data),
                memory_host_backed_bytes: sum(|process, device| process.host_backed[device]),
                memory_released_bytes: snapshot
                    .processes
                    .iter()
                    .zip(&alive)
                    .zip(state.released.iter().copied().chain(std::iter::repeat(false)))
                    .filter(|((_, alive), released)| **alive && *released)
                    .fold(0u64, |total, ((process, _), _)| {
                        total.saturating_add(process.memory[device].total)
                    }),
                sm_limit_percent: (snapshot.sm_limits[device] != 0).then_some(snapshot.sm_limits[device]),
                sm_util_percent: sum(|process, device| process.sm_util[device]),
                process_count: live_slots
                    .iter()
                    .filter(|process| process.memory[device].total > 0 || process.sm_util[device] > 0)
                    .count(),
                limiter: snapshot.extension.as_ref().map(|extension| {
                    let counters = extension.compute[device];
                    LimiterReport {
                        charged_ns: counters.charged_ns,
                        held_ns: counters.held_ns,
                        launches: counters.launches,
                    }
                }),
            }
        })
        .collect();
    RegionReport {
        path,
        error: None,
        layout_version: Some(format!("{}.{}", snapshot.major_version, snapshot.minor_version)),
        extension_version: snapshot.extension.as_ref().map(|extension| extension.version),
        created_unix_secs: snapshot.extension.as_ref().map(|extension| extension.created_unix_secs),
        hami: Some(HamiReport {
            utilization_switch: snapshot.utilization_switch,
            recent_kernel: snapshot.recent_kernel,
            priority: snapshot.priority,
            last_kernel_time_unix_secs: snapshot.last_kernel_time,
        }),
        devices,
        processes,
    }
}
