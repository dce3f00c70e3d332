//! The human table: per region a device table (memory and compute), the device UUIDs, and the
//! processes with their memory by kind per device. Every line fits 80 columns.

use std::borrow::Cow;
use std::fmt::Write as _;

use crate::report::{RegionReport, Report};
use crate::units::human_bytes;

/// The whole report as text, regions separated by a blank line.
pub fn render(report: &Report) -> String {
    let mut text = String::new();
    for (index, region) in report.regions.iter().enumerate() {
        if index > 0 {
            text.push('\n');
        }
        render_region(&mut text, region);
    }
    if report.regions.is_empty() {
        text.push_str("no region files found\n");
    }
    text
}

/// A limit in percent; `none` for no limit, `invalid` for a value no writer of ours puts there.
fn percent(value: Option<u64>) -> String {
    value.map_or_else(|| "none".to_string(), utilisation)
}

/// A measured share in percent, or `invalid` past 100 (a value written into the file by hand).
fn utilisation(value: u64) -> String {
    if value <= 100 {
        format!("{value}%")
    } else {
        "invalid".to_string()
    }
}

/// Text from the region file or the file system as it may reach a terminal: control characters
/// (an escape sequence that would clear the screen or forge a line) escaped as JSON escapes them.
fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for character in text.chars() {
        match character {
            '\n' => escaped.push_str("\\n"),
            '\r' => escaped.push_str("\\r"),
            '\t' => escaped.push_str("\\t"),
            control if control.is_control() => {
                let _ = write!(escaped, "\\u{:04x}", u32::from(control));
            }
            other => escaped.push(other),
        }
    }
    Cow::Owned(escaped)
}

fn render_region(text: &mut String, region: &RegionReport) {
    if let Some(error) = &region.error {
        let _ = writeln!(
            text,
            "Region {}: unreadable: {}",
            printable(&region.path),
            printable(error)
        );
        return;
    }
    let layout = region.layout_version.as_deref().unwrap_or("?");
    let extension = region.extension_version.map_or_else(
        || "no vgpu extension".to_string(),
        |version| format!("vgpu extension {version}"),
    );
    let processes = region.processes.len();
    let dead = region
        .processes
        .iter()
        .filter(|process| process.status != "live")
        .count();
    let _ = write!(
        text,
        "Region {} (layout {}, {extension}): {} device{}, {processes} process{}",
        printable(&region.path),
        printable(layout),
        region.devices.len(),
        if region.devices.len() == 1 { "" } else { "s" },
        if processes == 1 { "" } else { "es" },
    );
    if dead > 0 {
        let _ = write!(text, " ({dead} dead)");
    }
    text.push('\n');
    if region.devices.is_empty() {
        text.push_str("no devices registered yet\n");
    } else {
        let _ = writeln!(
            text,
            "\n{:>3}  {:>8}  {:>8}  {:>8}  {:>8}  {:>7}  {:>5}",
            "GPU", "LIMIT", "USED", "FREE", "SM LIMIT", "SM UTIL", "PROCS"
        );
        for device in &region.devices {
            let _ = writeln!(
                text,
                "{:>3}  {:>8}  {:>8}  {:>8}  {:>8}  {:>7}  {:>5}",
                device.index,
                device
                    .memory_limit_bytes
                    .map_or_else(|| "none".to_string(), human_bytes),
                human_bytes(device.memory_used_bytes),
                device.memory_free_bytes.map_or_else(|| "-".to_string(), human_bytes),
                percent(device.sm_limit_percent),
                utilisation(device.sm_util_percent),
                device.process_count,
            );
        }
        let _ = writeln!(text, "\n{:>3}  UUID", "GPU");
        for device in &region.devices {
            let _ = writeln!(text, "{:>3}  {}", device.index, printable(&device.uuid));
        }
        for device in region
            .devices
            .iter()
            .filter(|device| device.memory_host_backed_bytes > 0)
        {
            let _ = writeln!(
                text,
                "GPU {}: {} of the used memory is in host memory (CUDA_OVERSUBSCRIBE: the device had no room); \
                 kernels reading it run slower",
                device.index,
                human_bytes(device.memory_host_backed_bytes)
            );
        }
    }
    if region.processes.is_empty() {
        text.push_str("\nno processes\n");
        return;
    }
    let _ = writeln!(
        text,
        "\n{:>7}  {:>8}  {:<9}  {:>3}  {:>8}  {:>8}  {:>8}  {:>8}  {:>4}",
        "PID", "HOST PID", "STATUS", "GPU", "CONTEXT", "MODULE", "DATA", "TOTAL", "UTIL"
    );
    let mut torn = false;
    for process in &region.processes {
        let mut status = if process.released && process.status == "live" {
            "released".to_string()
        } else if process.suspended && process.status == "live" {
            "suspended".to_string()
        } else {
            printable(&process.status).into_owned()
        };
        if !process.consistent {
            status.push('*');
            torn = true;
        }
        let host_pid = process.host_pid.map_or_else(|| "-".to_string(), |pid| pid.to_string());
        let mut first = true;
        for device in &process.devices {
            let (pid, host_pid, status) = if first {
                (process.pid.to_string(), host_pid.clone(), status.clone())
            } else {
                (String::new(), String::new(), String::new())
            };
            first = false;
            let _ = writeln!(
                text,
                "{pid:>7}  {host_pid:>8}  {status:<9}  {:>3}  {:>8}  {:>8}  {:>8}  {:>8}  {:>4}",
                device.index,
                human_bytes(device.context_bytes),
                human_bytes(device.module_bytes),
                human_bytes(device.data_bytes),
                human_bytes(device.total_bytes),
                utilisation(device.sm_util_percent),
            );
        }
        if first {
            let _ = writeln!(
                text,
                "{:>7}  {host_pid:>8}  {status:<9}  {:>3}  {:>8}  {:>8}  {:>8}  {:>8}  {:>4}",
                process.pid, "-", "-", "-", "-", "-", "-"
            );
        }
    }
    for process in &region.processes {
        for device in process.devices.iter().filter(|device| device.host_backed_bytes > 0) {
            let _ = writeln!(
                text,
                "pid {} on GPU {}: {} of its data in host memory",
                process.pid,
                device.index,
                human_bytes(device.host_backed_bytes)
            );
        }
    }
    if torn {
        text.push_str("* torn figures: a writer was mid-update (or was killed mid-update)\n");
    }
}
