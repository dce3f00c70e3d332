//! Configuration, read once from the environment (see README.md for the variables).

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::truth::MAX_DEVICES;

pub const DEFAULT_MEMORY: u64 = 16 << 30;
pub const DEFAULT_CONTEXT_BYTES: u64 = 64 << 20;
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;
/// The longest simulated first-launch delay: 10 s.
pub const MAX_MODULE_LOAD_US: u64 = 10_000_000;
/// The longest `FAKE_CUDA_EVENT_NS` and `FAKE_CUDA_LAUNCH_GAP_NS`: 1 ms.
pub const MAX_EVENT_NS: u64 = 1_000_000;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Physical devices (`FAKE_CUDA_DEVICES`, 1..=16).
    pub devices: usize,
    /// Physical bytes of each physical device.
    pub memory: Vec<u64>,
    pub context_bytes: u64,
    pub granularity: u64,
    pub truth: Option<PathBuf>,
    /// CUDA ordinal -> physical index, from `CUDA_VISIBLE_DEVICES`.
    pub visible: Vec<usize>,
    /// Host time (µs) of the first launch of each function and of each executable graph
    /// (`FAKE_CUDA_MODULE_LOAD_US`): CUDA's lazy loading, and a graph's upload.
    pub module_load_us: u64,
    /// Host time (µs) a context's creation takes after its memory is taken (`FAKE_CUDA_CONTEXT_US`),
    /// as the driver's initialisation does: contexts created together then overlap.
    pub context_us: u64,
    /// Host time (µs) each `cuMemAlloc_v2` takes before it allocates (`FAKE_CUDA_ALLOC_US`), so a
    /// test can kill a process in the middle of one.
    pub alloc_us: u64,
    /// Host time (µs) each `cuMemUnmap` takes after it unmapped, before it returns
    /// (`FAKE_CUDA_UNMAP_RETURN_US`), so a test can land another thread's call between the driver's
    /// unmap and the library's bookkeeping of it.
    pub unmap_return_us: u64,
    /// GPU time (ns) of every recorded event (`FAKE_CUDA_EVENT_NS`): it completes that long after
    /// the work before it, and the work after it waits for it, as on a real GPU, where an event
    /// between two kernels is idle time. Not busy time. 0: events take no time.
    pub event_ns: u64,
    /// Idle GPU time (ns) between a kernel and the work queued before it on the engine
    /// (`FAKE_CUDA_LAUNCH_GAP_NS`): the front end starting the next kernel. Not busy time, and an
    /// event bracket around the kernel reads it. 0: kernels run back to back.
    pub launch_gap_ns: u64,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The configuration of this process.
pub fn get() -> &'static Config {
    CONFIG.get_or_init(|| Config::from_lookup(|name| std::env::var(name).ok()))
}

impl Config {
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Config {
        let devices = var("FAKE_CUDA_DEVICES")
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1)
            .clamp(1, MAX_DEVICES);
        let default_memory = var("FAKE_CUDA_MEMORY")
            .and_then(|v| parse_bytes(&v))
            .unwrap_or(DEFAULT_MEMORY);
        let memory = (0..devices)
            .map(|i| {
                var(&format!("FAKE_CUDA_MEMORY_{i}"))
                    .and_then(|v| parse_bytes(&v))
                    .unwrap_or(default_memory)
            })
            .collect();
        let context_bytes = var("FAKE_CUDA_CONTEXT_BYTES")
            .and_then(|v| parse_bytes(&v))
            .unwrap_or(DEFAULT_CONTEXT_BYTES);
        let granularity = var("FAKE_CUDA_GRANULARITY")
            .and_then(|v| parse_bytes(&v))
            .filter(|g| g.is_power_of_two())
            .unwrap_or(DEFAULT_GRANULARITY);
        let truth = var("FAKE_CUDA_TRUTH").filter(|p| !p.is_empty()).map(PathBuf::from);
        let visible = match var("CUDA_VISIBLE_DEVICES") {
            Some(list) => parse_visible(&list, devices),
            None => (0..devices).collect(),
        };
        let module_load_us = var("FAKE_CUDA_MODULE_LOAD_US")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(0, |us| us.min(MAX_MODULE_LOAD_US));
        let context_us = var("FAKE_CUDA_CONTEXT_US")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(0, |us| us.min(MAX_MODULE_LOAD_US));
        let alloc_us = var("FAKE_CUDA_ALLOC_US")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(0, |us| us.min(MAX_MODULE_LOAD_US));
        let unmap_return_us = var("FAKE_CUDA_UNMAP_RETURN_US")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(0, |us| us.min(MAX_MODULE_LOAD_US));
        let event_ns = var("FAKE_CUDA_EVENT_NS")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(0, |ns| ns.min(MAX_EVENT_NS));
        let launch_gap_ns = var("FAKE_CUDA_LAUNCH_GAP_NS")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(0, |ns| ns.min(MAX_EVENT_NS));
        Config {
            devices,
            memory,
            context_bytes,
            granularity,
            truth,
            visible,
            module_load_us,
            context_us,
            alloc_us,
            unmap_return_us,
            event_ns,
            launch_gap_ns,
        }
    }

    /// The physical index behind a CUDA ordinal.
    pub fn physical(&self, ordinal: i32) -> Option<usize> {
        usize::try_from(ordinal).ok().and_then(|o| self.visible.get(o).copied())
    }
}

/// Bytes, optionally with a binary suffix: `1024`, `512M`, `16G`, `16GiB`, `1T`.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let lower = text.to_ascii_lowercase();
    let stripped = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (digits, shift) = match stripped.chars().last()? {
        'k' => (&stripped[..stripped.len() - 1], 10),
        'm' => (&stripped[..stripped.len() - 1], 20),
        'g' => (&stripped[..stripped.len() - 1], 30),
        't' => (&stripped[..stripped.len() - 1], 40),
        _ => (stripped, 0),
    };
    let value: u64 = digits.trim().parse().ok()?;
    value.checked_mul(1u64 << shift)
}

/// The deterministic UUID of a physical device: `GPU-00000000-0000-0000-0000-00000000000N`.
pub fn uuid_bytes(physical: usize) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[8..].copy_from_slice(&(physical as u64).to_be_bytes());
    bytes
}

pub fn uuid_string(physical: usize) -> String {
    let b = uuid_bytes(physical);
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// `CUDA_VISIBLE_DEVICES` as the driver reads it: a comma list of indices or `GPU-` UUID
/// prefixes; the first invalid, unmatched, ambiguous or repeated entry ends the list.
pub fn parse_visible(list: &str, devices: usize) -> Vec<usize> {
    let mut visible = Vec::new();
    for entry in list.split(',') {
        let entry = entry.trim();
        let found = if let Ok(index) = entry.parse::<usize>() {
            (index < devices).then_some(index)
        } else if entry.len() > 4 && entry[..4].eq_ignore_ascii_case("GPU-") {
            let wanted = entry.to_ascii_lowercase();
            let matches: Vec<usize> = (0..devices)
                .filter(|&i| uuid_string(i).to_ascii_lowercase().starts_with(&wanted))
                .collect();
            if matches.len() == 1 { Some(matches[0]) } else { None }
        } else {
            None
        };
        match found {
            Some(index) if !visible.contains(&index) => visible.push(index),
            _ => break,
        }
    }
    visible
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes() {
        assert_eq!(parse_bytes("1024"), Some(1024));
        assert_eq!(parse_bytes("512M"), Some(512 << 20));
        assert_eq!(parse_bytes(" 16GiB "), Some(16 << 30));
        assert_eq!(parse_bytes("2gb"), Some(2 << 30));
        assert_eq!(parse_bytes("x"), None);
        assert_eq!(parse_bytes(""), None);
        assert_eq!(parse_bytes("99999999999T"), None);
    }

    #[test]
    fn uuids() {
        assert_eq!(uuid_string(0), "GPU-00000000-0000-0000-0000-000000000000");
        assert_eq!(uuid_string(11), "GPU-00000000-0000-0000-0000-00000000000b");
    }

    #[test]
    fn visible_devices() {
        assert_eq!(parse_visible("1,0", 2), vec![1, 0]);
        assert_eq!(parse_visible("0,5,1", 2), vec![0]);
        assert_eq!(parse_visible("", 2), Vec::<usize>::new());
        assert_eq!(
            parse_visible("GPU-00000000-0000-0000-0000-000000000001,0", 2),
            vec![1, 0]
        );
        // A prefix shared by every device is ambiguous.
        assert_eq!(parse_visible("GPU-0000", 2), Vec::<usize>::new());
        assert_eq!(parse_visible("1,1", 2), vec![1]);
        assert_eq!(parse_visible("-1", 2), Vec::<usize>::new());
    }

    #[test]
    fn from_environment() {
        let env = |name: &str| match name {
            "FAKE_CUDA_DEVICES" => Some("3".to_string()),
            "FAKE_CUDA_MEMORY" => Some("1G".to_string()),
            "FAKE_CUDA_MEMORY_2" => Some("4096".to_string()),
            "CUDA_VISIBLE_DEVICES" => Some("2,0".to_string()),
            _ => None,
        };
        let config = Config::from_lookup(env);
        assert_eq!(config.memory, vec![1 << 30, 1 << 30, 4096]);
        assert_eq!(config.visible, vec![2, 0]);
        assert_eq!(config.physical(0), Some(2));
        assert_eq!(config.physical(2), None);
        assert_eq!(config.context_bytes, DEFAULT_CONTEXT_BYTES);
        let many = Config::from_lookup(|n| (n == "FAKE_CUDA_DEVICES").then(|| "99".to_string()));
        assert_eq!(many.devices, MAX_DEVICES);
    }

    #[test]
    fn event_time_is_clamped_and_defaults_to_none() {
        let with = |value: &str| {
            let value = value.to_string();
            Config::from_lookup(move |n| (n == "FAKE_CUDA_EVENT_NS").then(|| value.clone())).event_ns
        };
        assert_eq!(with("2500"), 2500);
        assert_eq!(with(" 7 "), 7);
        assert_eq!(with("5000000"), MAX_EVENT_NS);
        assert_eq!(with("-1"), 0);
        assert_eq!(Config::from_lookup(|_| None).event_ns, 0);
    }

    #[test]
    fn module_load_delay() {
        let with = |value: &str| {
            let value = value.to_string();
            Config::from_lookup(move |n| (n == "FAKE_CUDA_MODULE_LOAD_US").then(|| value.clone())).module_load_us
        };
        assert_eq!(Config::from_lookup(|_| None).module_load_us, 0);
        assert_eq!(with("20000"), 20_000);
        assert_eq!(with(" 15 "), 15);
        assert_eq!(with("0"), 0);
        // Malformed values fall back to the default, as every FAKE_ variable does.
        assert_eq!(with(""), 0);
        assert_eq!(with("-5"), 0);
        assert_eq!(with("20ms"), 0);
        assert_eq!(with("1.5"), 0);
        assert_eq!(with("99999999999999999999999"), 0);
        // Longer than 10 s is held to 10 s.
        assert_eq!(with("3600000000"), MAX_MODULE_LOAD_US);
    }
}
