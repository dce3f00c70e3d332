//! The Prometheus exposition of a [`Report`], built with `prometheus-client` (OpenMetrics text).
//! Names and labels are documented in `docs/monitoring.md`, with their HAMi counterparts.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::report::Report;

/// The content type of [`encode_report`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;
type GaugeFamily = Family<Labels, Gauge>;
type SecondsCounterFamily = Family<Labels, Counter<f64, AtomicU64>>;
type CounterFamily = Family<Labels, Counter>;
type SecondsGaugeFamily = Family<Labels, Gauge<f64, AtomicU64>>;

fn labels(pairs: &[(&str, String)]) -> Labels {
    pairs
        .iter()
        .map(|(name, value)| ((*name).to_string(), value.clone()))
        .collect()
}

fn gauge_value(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// Every metric family, registered in a fresh registry (one per scrape: regions come and go).
struct Families {
    region_up: GaugeFamily,
    region_processes: GaugeFamily,
    utilization_switch: GaugeFamily,
    recent_kernel: GaugeFamily,
    priority: GaugeFamily,
    last_kernel_time: GaugeFamily,
    memory_limit: GaugeFamily,
    memory_used: GaugeFamily,
    memory_by_kind: GaugeFamily,
    memory_host_backed: GaugeFamily,
    memory_released: GaugeFamily,
    sm_limit: GaugeFamily,
    sm_utilization: GaugeFamily,
    device_processes: GaugeFamily,
    process_memory: GaugeFamily,
    process_host_backed: GaugeFamily,
    process_sm_utilization: GaugeFamily,
    process_suspended: GaugeFamily,
    process_released: GaugeFamily,
    process_alive: GaugeFamily,
    limiter_charged: SecondsGaugeFamily,
    limiter_held: SecondsCounterFamily,
    limiter_launches: CounterFamily,
}

impl Families {
    fn register(registry: &mut Registry) -> Families {
        // A gauge: measurements correct the estimates charged at launch, down as well as up.
        let limiter_charged = SecondsGaugeFamily::default();
        registry.register(
            "vgpu_device_compute_charged_seconds",
            "GPU time charged by the compute limiter to the container's limited launches since the region was created, in seconds",
            limiter_charged.clone(),
        );
        let limiter_held = SecondsCounterFamily::default();
        registry.register(
            "vgpu_device_compute_held_seconds",
            "Wall time the container's launches were held by the compute limiter, in seconds summed over threads",
            limiter_held.clone(),
        );
        let limiter_launches = CounterFamily::default();
        registry.register(
            "vgpu_device_compute_limited_launches",
            "Launches of the container that went through the compute limiter",
            limiter_launches.clone(),
        );
        let mut family = |name: &str, help: &str| {
            let family = GaugeFamily::default();
            registry.register(name, help, family.clone());
            family
        };
        Families {
            limiter_charged,
            limiter_held,
            limiter_launches,
            region_up: family(
                "vgpu_region_up",
                "1 when the region file could be read and decoded, 0 otherwise",
            ),
            region_processes: family(
                "vgpu_region_processes",
                "Process slots in use in the region (one container's processes)",
            ),
            utilization_switch: family(
                "vgpu_region_utilization_switch",
                "HAMi's utilization_switch: 1 while the compute limit applies, 0 while HAMi lifts it",
            ),
            recent_kernel: family(
                "vgpu_region_recent_kernel",
                "HAMi's recent_kernel: 2 after a launch, counted down by HAMi's monitor; -1 while HAMi holds the launches for a higher-priority container",
            ),
            priority: family(
                "vgpu_region_priority",
                "The container's CUDA_TASK_PRIORITY as HAMi reads it from the region",
            ),
            last_kernel_time: family(
                "vgpu_region_last_kernel_time_seconds",
                "Unix time of the container's last launch (or process attach), in seconds",
            ),
            memory_limit: family(
                "vgpu_device_memory_limit_bytes",
                "Device memory limit of the container in bytes (0 = unlimited)",
            ),
            memory_used: family(
                "vgpu_device_memory_used_bytes",
                "Device memory charged by the container's processes in bytes",
            ),
            memory_by_kind: family(
                "vgpu_device_memory_kind_bytes",
                "Device memory charged by the container's processes, by kind (context, module, data)",
            ),
            memory_host_backed: family(
                "vgpu_device_memory_host_backed_bytes",
                "Of the container's data on the device, bytes in host memory because the device had no room (CUDA_OVERSUBSCRIBE)",
            ),
            memory_released: family(
                "vgpu_device_memory_released_bytes",
                "Of the container's memory on the device, bytes of released processes, off the GPU until resume (vgpu-smi suspend --release)",
            ),
            sm_limit: family(
                "vgpu_device_sm_limit_percent",
                "Compute limit of the container in percent of the device (0 = unlimited)",
            ),
            sm_utilization: family(
                "vgpu_device_sm_utilization_percent",
                "Measured SM utilisation of the container's processes in percent (sum over processes)",
            ),
            device_processes: family(
                "vgpu_device_processes",
                "Processes of the container (slots in use) holding memory or utilisation on the device",
            ),
            process_memory: family(
                "vgpu_process_memory_bytes",
                "Device memory charged by one process in bytes, by kind (context, module, data)",
            ),
            process_host_backed: family(
                "vgpu_process_memory_host_backed_bytes",
                "Of one process's data on one device, bytes in host memory because the device had no room (CUDA_OVERSUBSCRIBE)",
            ),
            process_sm_utilization: family(
                "vgpu_process_sm_utilization_percent",
                "Measured SM utilisation of one process on one device in percent",
            ),
            process_released: family(
                "vgpu_process_released",
                "1 while the process's GPU memory is checkpointed to host memory (vgpu-smi suspend --release)",
            ),
            process_suspended: family(
                "vgpu_process_suspended",
                "1 while the process's launches and copies are suspended (vgpu-smi suspend)",
            ),
            process_alive: family(
                "vgpu_process_alive",
                "1 when the slot's process is alive as seen by the monitor, 0 when it exited unreaped",
            ),
        }
    }
}

/// The report as OpenMetrics text.
pub fn encode_report(report: &Report) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    let families = Families::register(&mut registry);
    // A region named twice (`--region f --region f`) is reported twice: its counters are added
    // once (a gauge is set, a counter adds up).
    let mut counted: HashSet<Labels> = HashSet::new();
    for region in &report.regions {
        let region_label = region.path.clone();
        let region_labels = labels(&[("region", region_label.clone())]);
        families
            .region_up
            .get_or_create(&region_labels)
            .set(i64::from(region.error.is_none()));
        if region.error.is_some() {
            continue;
        }
        families
            .region_processes
            .get_or_create(&region_labels)
            .set(gauge_value(region.processes.len() as u64));
        if let Some(hami) = &region.hami {
            for (family, value) in [
                (&families.utilization_switch, i64::from(hami.utilization_switch)),
                (&families.recent_kernel, i64::from(hami.recent_kernel)),
                (&families.priority, i64::from(hami.priority)),
                (&families.last_kernel_time, hami.last_kernel_time_unix_secs),
            ] {
                family.get_or_create(&region_labels).set(value);
            }
        }
        for device in &region.devices {
            let device_pairs = [
                ("region", region_label.clone()),
                ("device_index", device.index.to_string()),
                ("device_uuid", device.uuid.clone()),
            ];
            let device_labels = labels(&device_pairs);
            families
                .memory_limit
                .get_or_create(&device_labels)
                .set(gauge_value(device.memory_limit_bytes.unwrap_or(0)));
            families
                .memory_used
                .get_or_create(&device_labels)
                .set(gauge_value(device.memory_used_bytes));
            for (kind, bytes) in [
                ("context", device.memory_context_bytes),
                ("module", device.memory_module_bytes),
                ("data", device.memory_data_bytes),
            ] {
                let mut kind_labels = device_labels.clone();
                kind_labels.push(("kind".to_string(), kind.to_string()));
                families
                    .memory_by_kind
                    .get_or_create(&kind_labels)
                    .set(gauge_value(bytes));
            }
            families
                .memory_host_backed
                .get_or_create(&device_labels)
                .set(gauge_value(device.memory_host_backed_bytes));
            families
                .memory_released
                .get_or_create(&device_labels)
                .set(gauge_value(device.memory_released_bytes));
            families
                .sm_limit
                .get_or_create(&device_labels)
                .set(gauge_value(device.sm_limit_percent.unwrap_or(0)));
            families
                .sm_utilization
                .get_or_create(&device_labels)
                .set(gauge_value(device.sm_util_percent));
            families
                .device_processes
                .get_or_create(&device_labels)
                .set(gauge_value(device.process_count as u64));
            if let Some(limiter) = &device.limiter
                && counted.insert(device_labels.clone())
            {
                families
                    .limiter_charged
                    .get_or_create(&device_labels)
                    .set(seconds(limiter.charged_ns));
                families
                    .limiter_held
                    .get_or_create(&device_labels)
                    .inc_by(seconds(limiter.held_ns));
                families
                    .limiter_launches
                    .get_or_create(&device_labels)
                    .inc_by(limiter.launches);
            }
        }
        for process in &region.processes {
            let process_labels = labels(&[
                ("region", region_label.clone()),
                ("pid", process.pid.to_string()),
                (
                    "host_pid",
                    process.host_pid.map_or_else(String::new, |pid| pid.to_string()),
                ),
            ]);
            families
                .process_suspended
                .get_or_create(&process_labels)
                .set(i64::from(process.suspended));
            families
                .process_released
                .get_or_create(&process_labels)
                .set(i64::from(process.released));
            families
                .process_alive
                .get_or_create(&process_labels)
                .set(i64::from(process.status == "live"));
            for device in &process.devices {
                let mut device_labels = process_labels.clone();
                device_labels.push(("device_index".to_string(), device.index.to_string()));
                device_labels.push(("device_uuid".to_string(), device.uuid.clone()));
                for (kind, bytes) in [
                    ("context", device.context_bytes),
                    ("module", device.module_bytes),
                    ("data", device.data_bytes),
                ] {
                    let mut kind_labels = device_labels.clone();
                    kind_labels.push(("kind".to_string(), kind.to_string()));
                    families
                        .process_memory
                        .get_or_create(&kind_labels)
                        .set(gauge_value(bytes));
                }
                families
                    .process_host_backed
                    .get_or_create(&device_labels)
                    .set(gauge_value(device.host_backed_bytes));
                families
                    .process_sm_utilization
                    .get_or_create(&device_labels)
                    .set(gauge_value(device.sm_util_percent));
            }
        }
    }
    let mut text = String::new();
    encode(&mut text, &registry)?;
    Ok(text)
}
