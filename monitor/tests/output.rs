//! The monitor on synthetic region images (no driver, no hook): the table, JSON and Prometheus
//! outputs (snapshots), torn and dead slots, a HAMi-core file without the vgpu extension, bad
//! files, and the suspend flag.

use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};

use vgpu_monitor::control::{self, Target};
use vgpu_monitor::read::{decode, read_region};
use vgpu_monitor::report::build_report;
use vgpu_monitor::{metrics, table};
use vgpu_region::{
    COMPUTE_OFFSET, ComputeDevice, DeviceMemory, DeviceUtil, EXTENSION_OFFSET, Extension, HAMI_REGION_SIZE, InitParams,
    MAX_DEVICES, ProcSlot, SLOT_EXTENSIONS_OFFSET, SharedRegion, SlotExtension, initial_image,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIME_MS: u64 = 1_767_225_600_000;

/// A region image to poke slots into, as a writer would leave them.
struct Image(Vec<u8>);

impl Image {
    fn new(uuids: &[&str], limits: &[u64], sm_limits: &[u64]) -> Image {
        let mut init = InitParams {
            device_uuids: uuids.iter().map(|uuid| uuid.to_string()).collect(),
            ..InitParams::default()
        };
        init.limits[..limits.len()].copy_from_slice(limits);
        init.sm_limits[..sm_limits.len()].copy_from_slice(sm_limits);
        Image(initial_image(&init).expect("a valid image"))
    }

    fn put_u64(&mut self, offset: usize, value: u64) {
        self.0[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
    }

    fn put_i32(&mut self, offset: usize, value: i32) {
        self.0[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
    }

    fn slot(index: usize) -> usize {
        offset_of!(SharedRegion, procs) + index * size_of::<ProcSlot>()
    }

    fn slot_extension(index: usize) -> usize {
        EXTENSION_OFFSET + SLOT_EXTENSIONS_OFFSET + index * size_of::<SlotExtension>()
    }

    /// A live slot holding (context, module, data) bytes per device, with its SM utilisation.
    fn process(&mut self, index: usize, pid: i32, memory: &[(usize, [u64; 3], u64)]) {
        let slot = Image::slot(index);
        self.put_i32(slot + offset_of!(ProcSlot, pid), pid);
        self.put_i32(slot + offset_of!(ProcSlot, status), 1);
        for &(device, [context, module, data], sm_util) in memory {
            let usage = slot + offset_of!(ProcSlot, used) + device * size_of::<DeviceMemory>();
            self.put_u64(usage + offset_of!(DeviceMemory, context_size), context);
            self.put_u64(usage + offset_of!(DeviceMemory, module_size), module);
            self.put_u64(usage + offset_of!(DeviceMemory, data_size), data);
            self.put_u64(usage + offset_of!(DeviceMemory, total), context + module + data);
            let util = slot + offset_of!(ProcSlot, device_util) + device * size_of::<DeviceUtil>();
            self.put_u64(util + offset_of!(DeviceUtil, sm_util), sm_util);
            let total = EXTENSION_OFFSET + offset_of!(Extension, device_used) + device * 8;
            let before = u64::from_le_bytes(self.0[total..total + 8].try_into().expect("8 bytes"));
            self.put_u64(total, before + context + module + data);
        }
        self.put_u64(
            Image::slot_extension(index) + offset_of!(SlotExtension, generation),
            index as u64 + 1,
        );
        let proc_num = offset_of!(SharedRegion, proc_num);
        let current = i32::from_le_bytes(self.0[proc_num..proc_num + 4].try_into().expect("4 bytes"));
        self.put_i32(proc_num, current.max(index as i32 + 1));
    }

    /// The compute limiter's counters of a device: GPU time charged, time held, launches.
    fn limiter(&mut self, device: usize, charged_ns: u64, held_ns: u64, launches: u64) {
        let base = EXTENSION_OFFSET + COMPUTE_OFFSET + device * size_of::<ComputeDevice>();
        self.put_u64(base + offset_of!(ComputeDevice, charged_ns), charged_ns);
        self.put_u64(base + offset_of!(ComputeDevice, held_ns), held_ns);
        self.put_u64(base + offset_of!(ComputeDevice, launches), launches);
    }

    fn host_pid(&mut self, index: usize, host_pid: i32) {
        self.put_i32(Image::slot(index) + offset_of!(ProcSlot, hostpid), host_pid);
    }

    fn suspend(&mut self, index: usize) {
        let offset = Image::slot_extension(index) + offset_of!(SlotExtension, suspend);
        self.0[offset..offset + 4].copy_from_slice(&1u32.to_le_bytes());
    }

    /// A writer was killed in the middle of updating the slot.
    fn tear(&mut self, index: usize) {
        self.put_u64(Image::slot(index) + offset_of!(ProcSlot, seqlock), 7);
    }

    fn write(&self, path: &Path) {
        std::fs::write(path, &self.0).expect("write the image");
    }
}

fn uuid(index: usize) -> String {
    format!("GPU-00000000-0000-0000-0000-{index:012x}")
}

/// Pids 100.. are alive, others dead: the status does not depend on the machine.
fn fake_liveness(pid: i32, _start_time: Option<u64>) -> bool {
    (100..200).contains(&pid)
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vgpu-monitor-unit-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the folder");
    dir
}

/// Two devices (one limited in memory and compute, one not), a live process on both, a
/// suspended one, a dead one and a torn one, plus host pids.
fn busy_image() -> Image {
    let (first, second) = (uuid(0), uuid(1));
    let mut image = Image::new(&[&first, &second], &[4 * GIB], &[60]);
    image.process(
        0,
        101,
        &[(0, [64 * MIB, 2 * MIB, GIB], 35), (1, [64 * MIB, 0, 300 * MIB], 0)],
    );
    image.host_pid(0, 40101);
    image.process(1, 102, &[(0, [64 * MIB, 0, 512 * MIB], 20)]);
    image.suspend(1);
    image.process(3, 7, &[(1, [64 * MIB, 0, 5 * MIB], 0)]);
    image.process(4, 104, &[(0, [64 * MIB, 0, MIB], 1)]);
    image.tear(4);
    image.limiter(0, 4_250_000_000, 1_500_000_000, 123_456);
    image
}

/// The exposition with each family's samples sorted (a family keeps them in a hash map).
fn samples_sorted(exposition: &str) -> String {
    let mut text = String::new();
    let mut samples: Vec<&str> = Vec::new();
    for line in exposition.lines() {
        if line.starts_with('#') {
            samples.sort_unstable();
            samples
                .drain(..)
                .for_each(|sample| text.push_str(&format!("{sample}\n")));
            text.push_str(&format!("{line}\n"));
        } else {
            samples.push(line);
        }
    }
    samples.sort_unstable();
    samples
        .drain(..)
        .for_each(|sample| text.push_str(&format!("{sample}\n")));
    text
}

#[test]
fn table_json_and_metrics_of_a_busy_region() {
    let dir = temp_dir("busy");
    let path = dir.join("busy.cache");
    busy_image().write(&path);
    let mut report = build_report(&[read_region(&path)], TIME_MS, fake_liveness);
    // Written with the time the image was made: fixed here, as the creation time below.
    if let Some(hami) = report.regions[0].hami.as_mut() {
        hami.last_kernel_time_unix_secs = 1_765_000_000;
    }
    let shown_dir = dir.display().to_string();
    let table = table::render(&report).replace(&shown_dir, "<dir>");
    for line in table.lines().filter(|line| !line.starts_with("Region ")) {
        assert!(line.chars().count() <= 80, "{line:?}");
    }
    insta::assert_snapshot!("busy_table", table);
    let mut report_for_json = report.clone();
    report_for_json.regions[0].created_unix_secs = Some(0);
    let json = serde_json::to_string_pretty(&report_for_json)
        .expect("JSON")
        .replace(&shown_dir, "<dir>");
    insta::assert_snapshot!("busy_json", json);
    let exposition = metrics::encode_report(&report)
        .expect("encode")
        .replace(&shown_dir, "<dir>");
    insta::assert_snapshot!("busy_metrics", samples_sorted(&exposition));
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// A region named twice is reported twice; its limiter counters are still exported once, at
/// their value (a counter added to twice would read double).
#[test]
fn a_region_named_twice_counts_its_limiter_once() {
    let dir = temp_dir("twice");
    let path = dir.join("busy.cache");
    busy_image().write(&path);
    let report = build_report(&[read_region(&path), read_region(&path)], TIME_MS, fake_liveness);
    let exposition = metrics::encode_report(&report).expect("encode");
    let held: Vec<&str> = exposition
        .lines()
        .filter(|line| {
            line.starts_with("vgpu_device_compute_held_seconds_total{") && line.contains("device_index=\"0\"")
        })
        .collect();
    assert_eq!(held.len(), 1, "{exposition}");
    assert!(held[0].ends_with(" 1.5"), "{}", held[0]);
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn a_hami_core_file_reads_without_the_extension() {
    let mut image = Image::new(&[&uuid(0)], &[GIB], &[]);
    image.process(0, 101, &[(0, [10 * MIB, 0, 20 * MIB], 5)]);
    let hami_only = &image.0[..HAMI_REGION_SIZE];
    let state = decode(hami_only).expect("HAMi-core's struct alone decodes");
    assert!(state.snapshot.extension.is_none());
    assert_eq!(state.snapshot.device_used(0), 30 * MIB, "summed from the slots");
    assert_eq!(state.suspended, [false]);
    let dir = temp_dir("hami");
    let path = dir.join("hami.cache");
    std::fs::write(&path, hami_only).expect("write");
    let report = build_report(&[read_region(&path)], TIME_MS, fake_liveness);
    let region = &report.regions[0];
    assert_eq!(region.extension_version, None);
    assert_eq!(
        region.devices[0].limiter, None,
        "HAMi-core's layout has no limiter counters"
    );
    assert_eq!(region.devices[0].memory_used_bytes, 30 * MIB);
    assert!(table::render(&report).contains("(layout 1.2, no vgpu extension)"));
    let refused = control::set_suspended(&path, Target::All, true).expect_err("no suspend flag in HAMi's layout");
    assert!(refused.contains("too short for the vgpu extension"), "{refused}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn bad_files_are_one_line_each() {
    let dir = temp_dir("bad");
    let image = busy_image();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "it is 0 bytes, shorter than"),
        ("truncated", image.0[..HAMI_REGION_SIZE - 1].to_vec(), "truncated"),
        ("zeros", vec![0; image.0.len()], "being created"),
        ("garbage", vec![0xA5; image.0.len()], "not a region, or corrupt"),
        (
            "proc-num",
            {
                let mut bad = Image(image.0.clone());
                bad.put_i32(offset_of!(SharedRegion, proc_num), 5000);
                bad.0
            },
            "its proc_num is 5000",
        ),
        (
            "device-num",
            {
                let mut bad = Image(image.0.clone());
                bad.put_u64(offset_of!(SharedRegion, device_num), MAX_DEVICES as u64 + 1);
                bad.0
            },
            "its device_num is 17",
        ),
    ];
    for (name, bytes, expected) in cases {
        let path = dir.join(format!("{name}.cache"));
        std::fs::write(&path, bytes).expect("write");
        let read = read_region(&path);
        let problem = read.result.expect_err(name);
        assert!(problem.contains(expected), "{name}: {problem}");
        assert!(!problem.contains('\n'), "{name}: one line");
    }
    let not_a_file = read_region(&dir);
    assert_eq!(
        not_a_file.result.expect_err("a directory"),
        "it is a directory, not a region file"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn torn_and_dead_slots_are_reported() {
    let state = decode(&busy_image().0).expect("decode");
    let torn: Vec<_> = state
        .snapshot
        .processes
        .iter()
        .filter(|process| !process.consistent)
        .map(|process| process.pid)
        .collect();
    assert_eq!(torn, [104]);
    let report = build_report(
        &[vgpu_monitor::RegionRead {
            path: "x".into(),
            result: Ok(state),
        }],
        TIME_MS,
        fake_liveness,
    );
    let statuses: Vec<_> = report.regions[0]
        .processes
        .iter()
        .map(|process| (process.pid, process.status.as_str(), process.suspended))
        .collect();
    assert_eq!(
        statuses,
        [
            (101, "live", false),
            (102, "live", true),
            (7, "dead", false),
            (104, "live", false)
        ]
    );
}

#[test]
fn suspend_and_resume_flip_only_the_targeted_flags() {
    let dir = temp_dir("suspend");
    let path = dir.join("region.cache");
    // One image, compared with at the end: two would differ in their creation times when a second
    // passes between them.
    let mut expected = busy_image();
    expected.write(&path);
    let suspended = |path: &Path| -> Vec<i32> {
        let state = read_region(path).result.expect("read");
        state
            .snapshot
            .processes
            .iter()
            .zip(&state.suspended)
            .filter(|(_, suspended)| **suspended)
            .map(|(process, _)| process.pid)
            .collect()
    };
    assert_eq!(suspended(&path), [102]);
    let changed = control::set_suspended(&path, Target::Pid(101), true).expect("suspend");
    assert_eq!(changed, [control::Changed { slot: 0, pid: 101 }]);
    assert_eq!(suspended(&path), [101, 102]);
    // By host pid when no container pid matches.
    control::set_suspended(&path, Target::Pid(40101), false).expect("resume");
    assert_eq!(suspended(&path), [102]);
    let everyone = control::set_suspended(&path, Target::All, true).expect("suspend all");
    assert_eq!(everyone.len(), 4);
    control::set_suspended(&path, Target::All, false).expect("resume all");
    assert!(suspended(&path).is_empty());
    assert!(
        control::set_suspended(&path, Target::Pid(555), true)
            .expect("no match")
            .is_empty()
    );
    // Nothing but the flags changed.
    expected.0[Image::slot_extension(1) + offset_of!(SlotExtension, suspend)] = 0;
    assert!(
        std::fs::read(&path).expect("read") == expected.0,
        "only suspend flags are written"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// A record in which the limiter held the container's launches draws the held share beside the
/// measured utilisation; one in which it never held them does not.
#[test]
fn a_plot_shows_when_the_limiter_held_launches() {
    let dir = temp_dir("plot-held");
    let path = dir.join("busy.cache");
    let mut lines = Vec::new();
    for (second, held_ns) in [(0, 1_500_000_000), (1, 1_500_000_000), (2, 2_000_000_000)] {
        let mut image = busy_image();
        image.limiter(0, 4_250_000_000, held_ns, 123_456);
        image.write(&path);
        let report = build_report(&[read_region(&path)], TIME_MS + second * 1000, fake_liveness);
        lines.push(serde_json::to_string(&report).expect("JSON"));
    }
    let svg_path = dir.join("plot.svg");
    vgpu_monitor::plot::plot_record(&lines.join("\n"), &svg_path).expect("an SVG");
    let svg = std::fs::read_to_string(&svg_path).expect("read the SVG");
    assert!(svg.contains("held by the limiter"), "no held series in the chart");
    vgpu_monitor::plot::plot_record(&lines[..2].join("\n"), &svg_path).expect("an SVG");
    let svg = std::fs::read_to_string(&svg_path).expect("read the SVG");
    assert!(
        !svg.contains("held by the limiter"),
        "a held series where nothing was held"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn a_plot_needs_samples_and_a_known_format() {
    let dir = temp_dir("plot");
    let report = build_report(&[read_region(&dir.join("missing"))], TIME_MS, fake_liveness);
    let line = serde_json::to_string(&report).expect("JSON");
    let error = vgpu_monitor::plot::plot_record(&format!("{line}\nnot json\n"), &dir.join("plot.png"))
        .expect_err("no device samples");
    assert!(error.contains("no device samples"), "{error}");
    let path = dir.join("busy.cache");
    busy_image().write(&path);
    let report = build_report(&[read_region(&path)], TIME_MS, fake_liveness);
    let line = serde_json::to_string(&report).expect("JSON");
    let summary =
        vgpu_monitor::plot::plot_record(&format!("{line}\ntruncated {{\n"), &dir.join("plot.svg")).expect("an SVG");
    assert_eq!((summary.samples, summary.devices, summary.skipped_lines), (1, 2, 1));
    let error = vgpu_monitor::plot::plot_record(&line, &dir.join("plot.gif")).expect_err("format");
    assert!(error.contains(".png or .svg"), "{error}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}
