//! Device memory accounting against the fake driver: every memory-accounted entry point charges
//! and releases the right kind in the shared region (checked against the fake's ground truth),
//! limits refuse exactly one byte over the boundary on the right physical device, racing and
//! SIGKILLed processes never overcommit nor block each other, bad region files and paths are
//! handled, and `cuMemGetInfo`, `cuDeviceTotalMem` and NVML show the virtual device.
//!
//! Every test uses its own folder for the region (`CUDA_DEVICE_MEMORY_SHARED_CACHE`) and the
//! ground truth (`FAKE_CUDA_TRUTH`). The region is read from its file with
//! `vgpu_region::read_snapshot` (no lock taken) or, where reaping is needed, joined with
//! `Region::open`.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vgpu_codegen::table::{Class, Table};
use vgpu_integration::answer_number as number;
use vgpu_integration::answer_status as status;
use vgpu_integration::{Run, ScratchDir, Session, cuda_version, hook_library, one_at_a_time, truth, workspace_root};
use vgpu_region::{
    EXTENSION_OFFSET, InitParams, MemoryUsage, OpenKind, REGION_FILE_SIZE, Region, SLOT_LIVE, Snapshot, read_snapshot,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// What each context takes on the fake (`FAKE_CUDA_CONTEXT_BYTES`): not the fake's default, so a
/// hook that assumes a size instead of measuring it is caught.
const CONTEXT: u64 = 48 * MIB;

const CUDA_SUCCESS: i32 = 0;
const CUDA_ERROR_INVALID_VALUE: i32 = 1;
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
const CUDA_ERROR_NOT_INITIALIZED: i32 = 3;
const CUDA_ERROR_INVALID_HANDLE: i32 = 400;
const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;
const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: i32 = 900;
const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: i32 = 901;

use vgpu_integration::compiled_program as program;

/// The environment every run of a test shares: its region and truth files, the context size, and
/// nothing inherited that could change the devices or limits.
fn setup(run: Run, dir: &ScratchDir) -> Run {
    run.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.truth_path())
        .env("FAKE_CUDA_CONTEXT_BYTES", CONTEXT.to_string())
}

/// The fake's UUID of a physical device.
fn uuid(physical: usize) -> String {
    format!("GPU-00000000-0000-0000-0000-{physical:012x}")
}

fn snapshot(path: &Path) -> Snapshot {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read the region {}: {e}", path.display()));
    read_snapshot(&bytes).unwrap_or_else(|e| panic!("decode the region {}: {e}", path.display()))
}

/// The region's index of a physical device (devices are recorded by UUID).
fn region_device(snapshot: &Snapshot, physical: usize) -> Option<usize> {
    let uuid = uuid(physical);
    snapshot.uuids.iter().position(|u| *u == uuid)
}

/// What the live slot of `pid` holds on a physical device (zero if there is no slot or the device
/// is not registered).
fn usage(snapshot: &Snapshot, pid: u32, physical: usize) -> MemoryUsage {
    let Some(device) = region_device(snapshot, physical) else {
        return MemoryUsage::default();
    };
    snapshot
        .processes
        .iter()
        .find(|p| p.pid == pid as i32 && p.status == SLOT_LIVE)
        .map(|p| p.memory[device])
        .unwrap_or_default()
}

/// All processes' bytes on a physical device, by the region.
fn device_used(snapshot: &Snapshot, physical: usize) -> u64 {
    region_device(snapshot, physical).map_or(0, |d| snapshot.device_used(d))
}

fn fields(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_string).collect()
}

fn stderr_lines(output: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .map(str::to_string)
        .collect()
}

// ------------------------------------------------------------------------------------------------
// 1. Every memory-accounted entry point of cuda-api.toml.

/// The limit and physical size of the table-driven runs: far apart, so `cuMemGetInfo` shows the
/// limit's view.
const TABLE_LIMIT: u64 = GIB;
const TABLE_PHYSICAL: u64 = 8 * GIB;

/// What must hold after one step of `mem_paths`: the call's status, what this process's slot
/// holds on device 0 by kind (modules take nothing on the fake, so `module_size` must stay 0, the
/// truth's delta), and the truth's total for device 0.
#[derive(Clone, Copy, Debug)]
struct Expect {
    entry: &'static str,
    status: i32,
    context: u64,
    data: u64,
    truth: u64,
}

fn at(entry: &'static str, status: i32, context: u64, data: u64, truth: u64) -> Expect {
    Expect {
        entry,
        status,
        context,
        data,
        truth,
    }
}

/// One run of `mem_paths <name>` and the state after each of its steps.
struct Case {
    name: &'static str,
    steps: Vec<Expect>,
}

/// Entry points that allocate nothing themselves (frees, destroys, trims, context and module
/// teardown), and the case whose run calls them: the test checks each is
/// called there and that the step's state is right.
const COVERED_BY: &[(&str, &str)] = &[
    ("cuMemFree_v2", "cuMemAlloc_v2"),
    ("cuMemFreeAsync", "cuMemAllocAsync"),
    ("cuMemFreeAsync_ptsz", "cuMemAllocAsync_ptsz"),
    ("cuMemPoolTrimTo", "cuMemAllocFromPoolAsync"),
    ("cuMemPoolDestroy", "cuMemAllocFromPoolAsync"),
    ("cuMemRelease", "cuMemCreate"),
    ("cuMemMap", "cuMemCreate"),
    ("cuMemUnmap", "cuMemCreate"),
    ("cuMemAddressFree", "cuMemCreate"),
    ("cuMemRetainAllocationHandle", "cuMemCreate"),
    ("cuArrayDestroy", "cuArrayCreate_v2"),
    ("cuMipmappedArrayDestroy", "cuMipmappedArrayCreate"),
    ("cuGraphDestroy", "cuGraphAddMemAllocNode"),
    ("cuDeviceGraphMemTrim", "cuGraphAddMemAllocNode"),
    ("cuCtxDestroy", "cuCtxCreate"),
    ("cuCtxDestroy_v2", "cuCtxCreate_v2"),
    ("cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRetain"),
    ("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRetain"),
    ("cuDevicePrimaryCtxReset", "cuDevicePrimaryCtxRetain"),
    ("cuDevicePrimaryCtxReset_v2", "cuDevicePrimaryCtxRetain"),
    ("cuModuleUnload", "cuModuleLoad"),
    ("cuLibraryUnload", "cuLibraryLoadData"),
];

/// The legacy 32-bit entry points: the fake does not implement them (`CUDA_ERROR_NOT_SUPPORTED`);
/// the hook must pass that through and charge nothing.
const LEGACY: &[&str] = &[
    "cuMemAlloc",
    "cuMemAllocPitch",
    "cuMemFree",
    "cuArrayCreate",
    "cuArray3DCreate",
];

fn cases() -> Vec<Case> {
    const C: u64 = CONTEXT;
    let ready = at("ready", CUDA_SUCCESS, C, 0, C);
    let mut cases = Vec::new();
    let mut add = |name: &'static str, steps: Vec<Expect>| cases.push(Case { name, steps });

    // Linear memory: the requested size (mem_paths.c's ALLOC_BYTES, MANAGED_BYTES); pitch × height
    // for the pitched one (width 1000 → pitch 1024 on the fake, 7 rows). A second free of the
    // same pointer is the driver's answer and changes nothing.
    for (name, bytes) in [
        ("cuMemAlloc_v2", 100 * MIB + 3),
        ("cuMemAllocPitch_v2", 1024 * 7),
        ("cuMemAllocManaged", 32 * MIB + 1),
    ] {
        add(
            name,
            vec![
                ready,
                at(name, CUDA_SUCCESS, C, bytes, C + bytes),
                at("cuMemFree_v2", CUDA_SUCCESS, C, 0, C),
                at("cuMemFree_v2", CUDA_ERROR_INVALID_VALUE, C, 0, C),
            ],
        );
    }
    // Stream-ordered: a pool is charged what it holds (its reservation, as the truth counts it),
    // so a freed block stays charged until a synchronisation (release threshold 0), a trim or the
    // pool's destruction gives it back.
    for (name, free) in [
        ("cuMemAllocAsync", "cuMemFreeAsync"),
        ("cuMemAllocAsync_ptsz", "cuMemFreeAsync_ptsz"),
    ] {
        let b = 6 * MIB;
        add(
            name,
            vec![
                ready,
                at(name, CUDA_SUCCESS, C, b, C + b),
                at(free, CUDA_SUCCESS, C, b, C + b),
                at("cuStreamSynchronize", CUDA_SUCCESS, C, 0, C),
            ],
        );
    }
    for (name, free) in [
        ("cuMemAllocFromPoolAsync", "cuMemFreeAsync"),
        ("cuMemAllocFromPoolAsync_ptsz", "cuMemFreeAsync_ptsz"),
    ] {
        let b = 4 * MIB;
        add(
            name,
            vec![
                ready,
                at(name, CUDA_SUCCESS, C, b, C + b),
                at(free, CUDA_SUCCESS, C, b, C + b),
                at("cuMemPoolTrimTo", CUDA_SUCCESS, C, 0, C),
                at(name, CUDA_SUCCESS, C, b, C + b),
                at(free, CUDA_SUCCESS, C, b, C + b),
                at("cuMemPoolDestroy", CUDA_SUCCESS, C, 0, C),
            ],
        );
    }
    // Synchronisations give a pool's freed blocks back to the device; the pool's charge follows.
    let mut synchronizations = vec![
        "cuStreamSynchronize",
        "cuStreamSynchronize_ptsz",
        "cuCtxSynchronize",
        "cuEventSynchronize",
    ];
    if cuda_version() >= 13000 {
        synchronizations.push("cuCtxSynchronize_v2");
    }
    for name in synchronizations {
        let b = 6 * MIB;
        add(
            name,
            vec![
                ready,
                at("cuMemAllocAsync", CUDA_SUCCESS, C, b, C + b),
                at("cuMemFreeAsync", CUDA_SUCCESS, C, b, C + b),
                at(name, CUDA_SUCCESS, C, 0, C),
            ],
        );
    }
    // VMM: device-located handles charge their size until released and unmapped, whichever is
    // last (a 13.5 locality domain is its device's memory); host-located ones nothing; releasing
    // a handle nobody created is the driver's answer.
    let mut vmm = vec![
        ready,
        at("cuMemCreate", CUDA_SUCCESS, C, 6 * MIB, C + 6 * MIB),
        at("cuMemRelease", CUDA_SUCCESS, C, 0, C),
    ];
    if cuda_version() >= 13050 {
        vmm.extend([
            at("cuMemCreate", CUDA_SUCCESS, C, 6 * MIB, C + 6 * MIB),
            at("cuMemRelease", CUDA_SUCCESS, C, 0, C),
        ]);
    }
    let held = 6 * MIB;
    vmm.extend([
        at("cuMemCreate", CUDA_SUCCESS, C, held, C + held),
        at("cuMemMap", CUDA_SUCCESS, C, held, C + held),
        at("cuMemRetainAllocationHandle", CUDA_SUCCESS, C, held, C + held),
        at("cuMemRelease", CUDA_SUCCESS, C, held, C + held),
        at("cuMemRelease", CUDA_SUCCESS, C, held, C + held),
        at("cuMemUnmap", CUDA_SUCCESS, C, 0, C),
        at("cuMemCreate", CUDA_SUCCESS, C, held, C + held),
        at("cuMemMap", CUDA_SUCCESS, C, held, C + held),
        at("cuMemRelease", CUDA_SUCCESS, C, held, C + held),
        at("cuMemAddressFree", CUDA_SUCCESS, C, 0, C),
        at("cuMemCreate", CUDA_SUCCESS, C, 0, C),
        at("cuMemRelease", CUDA_SUCCESS, C, 0, C),
        at("cuMemRelease", CUDA_ERROR_INVALID_VALUE, C, 0, C),
    ]);
    add("cuMemCreate", vmm);
    // Arrays: the fake's rule (see tests/fake-driver/src/array.rs), which the region must match.
    // 1000 × 300 × 4 channels × 4 bytes = 4.8 MB → 6 MiB; 200 × 200 × 100 × 2 × 2 = 16 MB → 16 MiB;
    // mipmapped 1024² × 16 bytes over 3 levels = 21 MiB → 22 MiB.
    for (name, destroy, bytes) in [
        ("cuArrayCreate_v2", "cuArrayDestroy", 6 * MIB),
        ("cuArray3DCreate_v2", "cuArrayDestroy", 16 * MIB),
        ("cuMipmappedArrayCreate", "cuMipmappedArrayDestroy", 22 * MIB),
    ] {
        add(
            name,
            vec![
                ready,
                at(name, CUDA_SUCCESS, C, bytes, C + bytes),
                at(destroy, CUDA_SUCCESS, C, 0, C),
                at(destroy, CUDA_ERROR_INVALID_HANDLE, C, 0, C),
            ],
        );
    }
    // Graph memory: the node's size is charged when the node is added and while the graph lives;
    // the fake takes the memory at the first launch of an executable graph and, as the H200 does,
    // keeps it after the instance is destroyed until cuDeviceGraphMemTrim, which the charge then
    // follows (the larger of what live graphs' nodes promise and what the device holds).
    let g = 8 * MIB;
    add(
        "cuGraphAddMemAllocNode",
        vec![
            ready,
            at("cuGraphAddMemAllocNode", CUDA_SUCCESS, C, g, C),
            at("cuGraphInstantiate", CUDA_SUCCESS, C, g, C),
            at("cuGraphInstantiate_v2", CUDA_SUCCESS, C, g, C),
            at("cuGraphInstantiateWithFlags", CUDA_SUCCESS, C, g, C),
            at("cuGraphInstantiateWithParams", CUDA_SUCCESS, C, g, C),
            at("cuGraphInstantiateWithParams_ptsz", CUDA_SUCCESS, C, g, C),
            at("cuGraphLaunch", CUDA_SUCCESS, C, g, C + g),
            at("cuDeviceGraphMemTrim", CUDA_SUCCESS, C, g, C),
            at("cuGraphLaunch", CUDA_SUCCESS, C, g, C + g),
            at("cuGraphExecDestroy", CUDA_SUCCESS, C, g, C + g),
            at("cuGraphDestroy", CUDA_SUCCESS, C, g, C + g),
            at("cuDeviceGraphMemTrim", CUDA_SUCCESS, C, 0, C),
        ],
    );
    // Captured allocations (mem_paths.c's CAPTURED_BYTES): charged to the capture's graph, as a
    // node is, and, once an instance has run, as what the device holds for graphs (seen at the
    // next synchronisation) until a trim; a capture invalidated by a query of its stream loses its
    // graph at the end, and the charge with it.
    let k = 5 * MIB;
    for name in ["cuStreamEndCapture", "cuStreamEndCapture_ptsz"] {
        add(
            name,
            vec![
                ready,
                at("cuStreamBeginCapture_v2", CUDA_SUCCESS, C, 0, C),
                at("cuMemAllocAsync", CUDA_SUCCESS, C, k, C),
                at("cuMemFreeAsync", CUDA_SUCCESS, C, k, C),
                at(name, CUDA_SUCCESS, C, k, C),
                at("cuGraphInstantiateWithFlags", CUDA_SUCCESS, C, k, C),
                at("cuGraphDestroy", CUDA_SUCCESS, C, 0, C),
                at("cuGraphLaunch", CUDA_SUCCESS, C, 0, C + k),
                at("cuStreamSynchronize", CUDA_SUCCESS, C, k, C + k),
                at("cuGraphExecDestroy", CUDA_SUCCESS, C, k, C + k),
                at("cuDeviceGraphMemTrim", CUDA_SUCCESS, C, 0, C),
                at("cuStreamBeginCapture_v2", CUDA_SUCCESS, C, 0, C),
                at("cuMemAllocAsync", CUDA_SUCCESS, C, k, C),
                at("cuStreamQuery", CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, C, k, C),
                at(name, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, C, 0, C),
            ],
        );
    }
    // A capture into the application's own graph: a failed capture leaves the graph, and its
    // allocation's charge, in place until the graph is destroyed.
    for name in ["cuStreamBeginCaptureToGraph", "cuStreamBeginCaptureToGraph_ptsz"] {
        add(
            name,
            vec![
                ready,
                at(name, CUDA_SUCCESS, C, 0, C),
                at("cuMemAllocAsync", CUDA_SUCCESS, C, k, C),
                at("cuStreamQuery", CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, C, k, C),
                at("cuStreamEndCapture", CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, C, k, C),
                at("cuGraphDestroy", CUDA_SUCCESS, C, 0, C),
            ],
        );
    }
    // A recapture (CUDA 13.5) records the graph's allocation node again: charged once. One of
    // another size fails the recapture, which leaves the graph and its charge until destroyed.
    if cuda_version() >= 13050 {
        for name in ["cuStreamBeginRecaptureToGraph", "cuStreamBeginRecaptureToGraph_ptsz"] {
            add(
                name,
                vec![
                    ready,
                    at("cuStreamBeginCapture_v2", CUDA_SUCCESS, C, 0, C),
                    at("cuMemAllocAsync", CUDA_SUCCESS, C, k, C),
                    at("cuMemFreeAsync", CUDA_SUCCESS, C, k, C),
                    at("cuStreamEndCapture", CUDA_SUCCESS, C, k, C),
                    at(name, CUDA_SUCCESS, C, k, C),
                    at("cuMemAllocAsync", CUDA_SUCCESS, C, k, C),
                    at("cuMemFreeAsync", CUDA_SUCCESS, C, k, C),
                    at("cuStreamEndCapture", CUDA_SUCCESS, C, k, C),
                    at(name, CUDA_SUCCESS, C, k, C),
                    at("cuMemAllocAsync", CUDA_ERROR_INVALID_VALUE, C, k, C),
                    at("cuStreamEndCapture", CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, C, k, C),
                    at("cuGraphDestroy", CUDA_SUCCESS, C, 0, C),
                ],
            );
        }
    }
    let mut add_node = vec!["cuGraphAddNode", "cuGraphAddNode_v2"];
    if cuda_version() >= 13050 {
        add_node.push("cuGraphAddNode_v3");
    }
    for name in add_node {
        add(
            name,
            vec![
                ready,
                at(name, CUDA_SUCCESS, C, g, C),
                at("cuGraphInstantiateWithFlags", CUDA_SUCCESS, C, g, C),
                at("cuGraphLaunch", CUDA_SUCCESS, C, g, C + g),
                at("cuGraphExecDestroy", CUDA_SUCCESS, C, g, C + g),
                at("cuGraphDestroy", CUDA_SUCCESS, C, g, C + g),
                at("cuDeviceGraphMemTrim", CUDA_SUCCESS, C, 0, C),
            ],
        );
    }
    // Contexts: each one is charged what it takes on the device (two at once: twice).
    for (name, destroy) in [
        ("cuCtxCreate", "cuCtxDestroy"),
        ("cuCtxCreate_v2", "cuCtxDestroy_v2"),
        ("cuCtxCreate_v3", "cuCtxDestroy_v2"),
        ("cuCtxCreate_v4", "cuCtxDestroy_v2"),
    ] {
        add(
            name,
            vec![
                at("cuInit", CUDA_SUCCESS, 0, 0, 0),
                at(name, CUDA_SUCCESS, C, 0, C),
                at(name, CUDA_SUCCESS, 2 * C, 0, 2 * C),
                at(destroy, CUDA_SUCCESS, C, 0, C),
                at(destroy, CUDA_SUCCESS, 0, 0, 0),
            ],
        );
    }
    // The primary context is charged once however often it is retained, and released with the
    // last release or a reset.
    add(
        "cuDevicePrimaryCtxRetain",
        vec![
            at("cuInit", CUDA_SUCCESS, 0, 0, 0),
            at("cuDevicePrimaryCtxRetain", CUDA_SUCCESS, C, 0, C),
            at("cuDevicePrimaryCtxRetain", CUDA_SUCCESS, C, 0, C),
            at("cuDevicePrimaryCtxRelease", CUDA_SUCCESS, C, 0, C),
            at("cuDevicePrimaryCtxRelease_v2", CUDA_SUCCESS, 0, 0, 0),
            at("cuDevicePrimaryCtxRetain", CUDA_SUCCESS, C, 0, C),
            at("cuDevicePrimaryCtxReset", CUDA_SUCCESS, 0, 0, 0),
            at("cuDevicePrimaryCtxRetain", CUDA_SUCCESS, C, 0, C),
            at("cuDevicePrimaryCtxReset_v2", CUDA_SUCCESS, 0, 0, 0),
        ],
    );
    // Modules and libraries take no device memory on the fake: module_size must follow the truth.
    for (name, unload) in [
        ("cuModuleLoad", "cuModuleUnload"),
        ("cuModuleLoadData", "cuModuleUnload"),
        ("cuModuleLoadDataEx", "cuModuleUnload"),
        ("cuModuleLoadFatBinary", "cuModuleUnload"),
        ("cuLibraryLoadData", "cuLibraryUnload"),
        ("cuLibraryLoadFromFile", "cuLibraryUnload"),
    ] {
        add(
            name,
            vec![
                ready,
                at(name, CUDA_SUCCESS, C, 0, C),
                at(unload, CUDA_SUCCESS, C, 0, C),
            ],
        );
    }
    for &name in LEGACY {
        add(name, vec![ready, at(name, CUDA_ERROR_NOT_SUPPORTED, C, 0, C)]);
    }
    cases
}

/// Every function cuda-api.toml classes as memory-accounted in the headers of this build.
fn memory_accounted() -> BTreeSet<String> {
    let table = Table::load(&workspace_root().join("cuda-api.toml")).expect("read cuda-api.toml");
    let version = cuda_version();
    table
        .entries
        .iter()
        .filter(|entry| entry.class == Class::MemoryAccounted && entry.applies_to(version))
        .flat_map(|entry| entry.functions.iter().cloned())
        .collect()
}

#[test]
fn every_memory_accounted_entry_point_has_a_case() {
    let accounted = memory_accounted();
    for known in [
        "cuMemAlloc_v2",
        "cuMemCreate",
        "cuCtxCreate_v4",
        "cuGraphAddMemAllocNode",
    ] {
        assert!(
            accounted.contains(known),
            "{known} is not memory-accounted in cuda-api.toml"
        );
    }
    let cases = cases();
    let case_names: BTreeSet<&str> = cases.iter().map(|c| c.name).collect();
    let covered: BTreeMap<&str, &str> = COVERED_BY.iter().copied().collect();
    let missing: Vec<&String> = accounted
        .iter()
        .filter(|f| !case_names.contains(f.as_str()) && !covered.contains_key(f.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "memory-accounted in cuda-api.toml but with no case in tests/integration/tests/memory.rs \
         (add one to cases(), or name the case that calls it in COVERED_BY): {missing:?}"
    );
    let stale: Vec<&str> = case_names
        .iter()
        .copied()
        .chain(covered.keys().copied())
        .filter(|f| !accounted.contains(*f))
        .collect();
    assert!(
        stale.is_empty(),
        "cases for functions that are not memory-accounted: {stale:?}"
    );
    for (function, case) in COVERED_BY {
        let case = cases
            .iter()
            .find(|c| c.name == *case)
            .unwrap_or_else(|| panic!("COVERED_BY names {case} for {function}, which is no case"));
        assert!(
            case.steps.iter().any(|step| step.entry == *function),
            "COVERED_BY says case {} calls {function}, but none of its steps does",
            case.name
        );
    }
}

/// One line of `mem_paths`: `step <entry> <status> <info status> <free> <total>`.
struct StepLine {
    entry: String,
    status: i32,
    info: i32,
    free: u64,
    total: u64,
}

fn parse_step(line: &str) -> Option<StepLine> {
    let f = fields(line);
    if f.len() != 6 || f[0] != "step" {
        return None;
    }
    Some(StepLine {
        entry: f[1].clone(),
        status: f[2].parse().ok()?,
        info: f[3].parse().ok()?,
        free: f[4].parse().ok()?,
        total: f[5].parse().ok()?,
    })
}

fn paths_env(run: Run, dir: &ScratchDir) -> Run {
    setup(run, dir).env("FAKE_CUDA_MEMORY", TABLE_PHYSICAL.to_string())
}

/// Runs one case hooked, checking the region, the truth and cuMemGetInfo after every step, and
/// the statuses against a run of the same case without the hook.
fn run_case(case: &Case) -> Result<(), String> {
    let program = program("mem_paths");
    let native_dir = ScratchDir::new("memory-paths-native");
    let native = paths_env(Run::new(&program), &native_dir).args([case.name]).output();
    let native: Vec<StepLine> = String::from_utf8_lossy(&native.stdout)
        .lines()
        .filter_map(parse_step)
        .collect();
    if native.len() != case.steps.len() {
        return Err(format!(
            "without the hook the program made {} steps, the case expects {}",
            native.len(),
            case.steps.len()
        ));
    }
    let dir = ScratchDir::new("memory-paths");
    let mut session = paths_env(Run::new(&program).hooked(), &dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", TABLE_LIMIT.to_string())
        .args([case.name])
        .spawn(Duration::from_secs(60));
    let pid = session.pid();
    let truth = dir.truth();
    for (index, (expect, native)) in case.steps.iter().zip(&native).enumerate() {
        let Some(line) = session.read_line() else {
            let output = session.finish();
            return Err(format!(
                "step {index} ({}): the program ended ({}): {}",
                expect.entry,
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        };
        let Some(step) = parse_step(&line) else {
            return Err(format!("step {index} ({}): unexpected line {line:?}", expect.entry));
        };
        let snapshot = snapshot(&dir.region());
        let mine = usage(&snapshot, pid, 0);
        let used = device_used(&snapshot, 0);
        let truth_used = truth.device(0).used();
        let sum = expect.context + expect.data;
        let mut problems = Vec::new();
        if step.entry != expect.entry {
            problems.push(format!("called {} where the case expects {}", step.entry, expect.entry));
        }
        if step.status != expect.status || step.status != native.status {
            problems.push(format!(
                "status {} (expected {}, the driver alone gives {})",
                step.status, expect.status, native.status
            ));
        }
        if step.info != native.info {
            problems.push(format!(
                "cuMemGetInfo status {} where the driver alone gives {}",
                step.info, native.info
            ));
        }
        if (mine.context, mine.module, mine.data) != (expect.context, 0, expect.data) {
            problems.push(format!(
                "region slot holds context {} module {} data {}, expected context {} module 0 data {}",
                mine.context, mine.module, mine.data, expect.context, expect.data
            ));
        }
        if mine.total != mine.context + mine.module + mine.data {
            problems.push(format!("region slot total {} is not the sum of its kinds", mine.total));
        }
        if used != sum {
            problems.push(format!("region device total {used}, expected {sum}"));
        }
        if truth_used != expect.truth {
            problems.push(format!("truth holds {truth_used}, expected {}", expect.truth));
        }
        if step.info == CUDA_SUCCESS && (step.total, step.free) != (TABLE_LIMIT, TABLE_LIMIT - sum) {
            problems.push(format!(
                "cuMemGetInfo says free {} total {}, expected free {} total {TABLE_LIMIT}",
                step.free,
                step.total,
                TABLE_LIMIT - sum
            ));
        }
        if !problems.is_empty() {
            return Err(format!("step {index} {:?}: {}", expect.entry, problems.join("; ")));
        }
        session.send("next");
    }
    let output = session.finish();
    let rest = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() || rest.trim() != "end" {
        return Err(format!(
            "the program ended with {} after its steps: {rest:?} {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

#[test]
fn memory_accounted_entry_points_charge_and_release() {
    let cases = cases();
    // Two workers: the cases are independent (each has its own region and truth).
    let failures: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..2)
            .map(|worker| {
                let cases = &cases;
                scope.spawn(move || {
                    cases
                        .iter()
                        .skip(worker)
                        .step_by(2)
                        .filter_map(|case| run_case(case).err().map(|e| format!("{}: {e}", case.name)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a case worker panicked"))
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

// ------------------------------------------------------------------------------------------------
// 2. The limit's boundary, per device, with CUDA_VISIBLE_DEVICES remapped.

/// Reservations and refusals the fake has seen on a device: unchanged means the driver was not
/// asked.
fn driver_calls(truth: &truth::Truth, physical: usize) -> u64 {
    let device = truth.device(physical);
    device.reservations() + device.refusals()
}

#[test]
fn limit_refuses_one_byte_over_per_device_with_remapped_devices() {
    let dir = ScratchDir::new("memory-boundary");
    let program = program("mem_ops");
    // CUDA ordinal 0 is physical GPU 2, ordinal 1 is physical GPU 0; GPU 1 is not visible.
    let limits = [(0, 2, 512 * MIB), (1, 0, 768 * MIB)];
    let start = || {
        setup(Run::new(&program).hooked(), &dir)
            .env("FAKE_CUDA_DEVICES", "3")
            .env("FAKE_CUDA_MEMORY", "4g")
            .env("CUDA_VISIBLE_DEVICES", "2,0")
            .env("CUDA_DEVICE_MEMORY_LIMIT_0", "512m")
            .env("CUDA_DEVICE_MEMORY_LIMIT_1", "768m")
            .spawn(Duration::from_secs(60))
    };
    let mut a = start();
    let truth = dir.truth();
    assert_eq!(a.ask("init"), "init 0");
    for (ordinal, physical, limit) in limits {
        assert_eq!(a.ask(&format!("ctx {ordinal}")), "ctx 0");
        let before = snapshot(&dir.region());
        assert!(
            region_device(&before, physical).is_some(),
            "ordinal {ordinal}: the region does not record {} (uuids {:?})",
            uuid(physical),
            before.uuids
        );
        let used = device_used(&before, physical);
        assert_eq!(
            usage(&before, a.pid(), physical).context,
            CONTEXT,
            "ordinal {ordinal}: the context is not charged to {}",
            uuid(physical)
        );
        assert_eq!(used, CONTEXT, "ordinal {ordinal}: region total before allocating");
        let room = limit - used;
        let truth_before = truth.device(physical).used();
        let calls_before = driver_calls(&truth, physical);

        let over = a.ask(&format!("alloc {}", room + 1));
        assert_eq!(
            status(&over),
            CUDA_ERROR_OUT_OF_MEMORY,
            "ordinal {ordinal}: one byte over: {over}"
        );
        assert_eq!(
            device_used(&snapshot(&dir.region()), physical),
            used,
            "a refusal charged"
        );
        assert_eq!(
            truth.device(physical).used(),
            truth_before,
            "a refusal reached the driver"
        );
        assert_eq!(
            driver_calls(&truth, physical),
            calls_before,
            "a refusal reached the driver"
        );

        let exact = a.ask(&format!("alloc {room}"));
        assert_eq!(
            status(&exact),
            CUDA_SUCCESS,
            "ordinal {ordinal}: exactly at the limit: {exact}"
        );
        assert_eq!(device_used(&snapshot(&dir.region()), physical), limit);
        assert_eq!(
            truth.device(physical).used(),
            limit,
            "the truth disagrees with the region"
        );
        assert_eq!(
            a.ask("info"),
            format!("info 0 0 {limit}"),
            "ordinal {ordinal}: cuMemGetInfo at the limit"
        );
        let one = a.ask("alloc 1");
        assert_eq!(
            status(&one),
            CUDA_ERROR_OUT_OF_MEMORY,
            "ordinal {ordinal}: one byte at the limit: {one}"
        );
        assert_eq!(a.ask(&format!("free {}", number(&exact, 2))), "free 0");
        assert_eq!(device_used(&snapshot(&dir.region()), physical), CONTEXT);
    }
    let after = snapshot(&dir.region());
    assert_eq!(
        region_device(&after, 1),
        None,
        "the invisible GPU 1 is in the region: {:?}",
        after.uuids
    );
    assert_eq!(truth.device(1).used(), 0);
    // NVML indexes physical devices: GPU 2 shows ordinal 0's limit, GPU 0 ordinal 1's.
    for (_, physical, limit) in limits {
        let answer = a.ask(&format!("nvml {physical}"));
        assert_eq!(
            (status(&answer), number(&answer, 2)),
            (0, limit),
            "nvml device {physical}: {answer}"
        );
    }

    // The limit is the container's: a second process's usage counts, and each sees the other's.
    assert_eq!(a.ask("ctx 0"), "ctx 0");
    let mut b = start();
    assert_eq!(b.ask("init"), "init 0");
    assert_eq!(b.ask("ctx 0"), "ctx 0");
    let a_held = a.ask(&format!("alloc {}", 100 * MIB));
    assert_eq!(status(&a_held), CUDA_SUCCESS, "{a_held}");
    let used = device_used(&snapshot(&dir.region()), 2);
    assert_eq!(
        used,
        2 * CONTEXT + 100 * MIB,
        "a primary context retained twice is charged once, plus b's context and a's 100 MiB"
    );
    let room = 512 * MIB - used;
    assert_eq!(status(&b.ask(&format!("alloc {}", room + 1))), CUDA_ERROR_OUT_OF_MEMORY);
    let b_held = b.ask(&format!("alloc {room}"));
    assert_eq!(status(&b_held), CUDA_SUCCESS, "{b_held}");
    assert_eq!(
        status(&a.ask("alloc 1")),
        CUDA_ERROR_OUT_OF_MEMORY,
        "a allocated past the container's limit"
    );
    assert_eq!(b.ask(&format!("free {}", number(&b_held, 2))), "free 0");
    assert_eq!(status(&a.ask("alloc 1")), CUDA_SUCCESS);
    assert_eq!(
        device_used(&snapshot(&dir.region()), 2),
        truth.device(2).used(),
        "region and truth disagree on GPU 2"
    );
    drop(b);
    drop(a);
}

// ------------------------------------------------------------------------------------------------
// 3 and 4. Many processes: the race and the kill storm.

const RACE_LIMIT: u64 = 512 * MIB;
const RACE_CONTEXT: u64 = 2 * MIB;

fn race_env(run: Run, dir: &ScratchDir) -> Run {
    setup(run, dir)
        .env("FAKE_CUDA_MEMORY", "64g")
        .env("FAKE_CUDA_CONTEXT_BYTES", RACE_CONTEXT.to_string())
        .env("CUDA_DEVICE_MEMORY_LIMIT", RACE_LIMIT.to_string())
}

/// The counters of a `done` line of mem_race.
fn race_report(line: &str) -> BTreeMap<String, u64> {
    assert!(line.starts_with("done "), "not a report: {line:?}");
    line.split_whitespace()
        .skip(1)
        .filter_map(|field| field.split_once('='))
        .map(|(key, value)| (key.to_string(), value.parse().unwrap_or(u64::MAX)))
        .collect()
}

/// Joins the region the children created and returns it with device 0's index.
fn join_region(dir: &ScratchDir) -> (Region, usize) {
    let region = Region::open(&dir.region(), &InitParams::default()).expect("join the region");
    assert!(
        matches!(region.open_kind(), OpenKind::Joined),
        "the test should have joined a live region, not {:?}",
        region.open_kind()
    );
    let device = region_device(&region.snapshot(), 0).expect("device 0 in the region");
    (region, device)
}

/// Thousands of threads of one process allocating and freeing at once, far below the limit: no
/// refusal, no failure (each used to give up behind the region's lock after 1 s while it was
/// changing hands). The longest call is printed; its target is a benchmark's, not this test's.
#[test]
fn thousands_of_threads_get_no_refusal_the_limit_does_not_explain() {
    let _heavy = one_at_a_time();
    let dir = ScratchDir::new("memory-thread-storm");
    let threads = if std::env::var_os("VGPU_TEST_RUNNER").is_some() {
        500
    } else {
        3000
    };
    let output = setup(Run::new(&program("thread_storm")).hooked(), &dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .args([threads.to_string().as_str(), "2000", "307200"])
        .output();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    assert!(
        output.status.success(),
        "{line}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report = race_report(line);
    eprintln!("{threads} threads: {report:?}");
    assert_eq!((report["refused"], report["errors"]), (0, 0), "{report:?}");
    assert!(report["allocs"] >= threads, "too little traffic: {report:?}");
}

#[test]
fn racing_processes_never_exceed_the_limit_together() {
    let _heavy = one_at_a_time();
    let dir = ScratchDir::new("memory-race");
    let program = program("mem_race");
    let mut children: Vec<Session> = (0..16)
        .map(|seed| {
            race_env(Run::new(&program).hooked(), &dir)
                .args([seed.to_string().as_str(), "3000", "barrier", "hold"])
                .spawn(Duration::from_secs(60))
        })
        .collect();
    for child in &mut children {
        let ready = child.read_line().unwrap_or_default();
        assert!(ready.starts_with("ready "), "a child did not start: {ready:?}");
    }
    let (region, device) = join_region(&dir);
    let truth = dir.truth();
    for child in &mut children {
        child.send("go");
    }
    let reports: Vec<_> = children
        .iter_mut()
        .map(|child| race_report(&child.read_line().unwrap_or_default()))
        .collect();
    let total = |key: &str| reports.iter().map(|r| r[key]).sum::<u64>();
    assert_eq!(total("errors"), 0, "calls failed other than by the limit: {reports:?}");
    assert!(total("allocs") > 100, "too little traffic: {reports:?}");
    assert!(
        total("refused") > 0,
        "the limit was never reached, so nothing was contended: {reports:?}"
    );
    assert!(
        truth.device(0).peak() <= RACE_LIMIT,
        "the device really held {} bytes at its peak, over the {RACE_LIMIT}-byte limit",
        truth.device(0).peak()
    );
    // Everyone holds still now: the region and the truth must agree exactly, context by context.
    // (Read now, asserted last, so that a failure here still has the reaping checked.)
    let contexts: Vec<(i32, u64)> = region
        .snapshot()
        .processes
        .iter()
        .filter(|p| p.status == SLOT_LIVE)
        .map(|p| (p.pid, p.memory[device].context))
        .collect();
    truth.reclaim_dead();
    let held: u64 = reports.iter().map(|r| r["held"]).sum();
    let quiescent = (region.device_used(device), truth.device(0).used());
    assert_eq!(
        quiescent.1,
        held + 16 * RACE_CONTEXT,
        "the truth is not what the processes hold"
    );
    for child in &mut children {
        let output = child.finish();
        assert!(output.status.success(), "{output:?}");
    }
    region.reap_dead().expect("reap the region");
    assert_eq!(region.device_used(device), 0, "charges left after every process exited");
    assert!(
        region.snapshot().processes.iter().all(|p| p.status != SLOT_LIVE),
        "live slots left: {:?}",
        region.snapshot().processes
    );
    truth.reclaim_dead();
    assert_eq!(truth.device(0).used(), 0);
    assert!(
        contexts.len() == 16 && contexts.iter().all(|(_, context)| *context == RACE_CONTEXT),
        "16 processes that started together: each context takes {RACE_CONTEXT} bytes, the region \
         charged (pid, context) {contexts:?}"
    );
    assert_eq!(
        quiescent.0, quiescent.1,
        "region and truth disagree with 16 processes holding {held} bytes of data"
    );
    assert_eq!(truth.device(0).used(), 0);
}

/// A small xorshift generator, seeded from the clock (the seed is in the failure messages).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

/// Contexts created together, each taking its memory 100 ms before its creation returns, never
/// take the device past the limit: each is reserved at the region's last context size before the
/// driver is called (the first is measured by one process while the others wait for its figure),
/// those that do not fit are refused, and every context is charged exactly what it took.
#[test]
fn contexts_created_together_never_pass_the_limit() {
    let _heavy = one_at_a_time();
    let dir = ScratchDir::new("memory-context-storm");
    let program = program("mem_ops");
    let mut sessions: Vec<Session> = (0..16)
        .map(|_| {
            setup(Run::new(&program).hooked(), &dir)
                .env("CUDA_DEVICE_MEMORY_LIMIT", "512m")
                .env("FAKE_CUDA_CONTEXT_US", "100000")
                .spawn(Duration::from_secs(60))
        })
        .collect();
    for session in &mut sessions {
        assert_eq!(session.ask("init"), "init 0");
    }
    let truth = dir.truth();
    for session in &mut sessions {
        session.send("ctx 0");
    }
    let answers: Vec<String> = sessions
        .iter_mut()
        .map(|session| session.read_line().unwrap_or_default())
        .collect();
    let created = answers.iter().filter(|answer| *answer == "ctx 0").count();
    let refused = answers
        .iter()
        .filter(|answer| **answer == format!("ctx {CUDA_ERROR_OUT_OF_MEMORY}"))
        .count();
    let peak = truth.device(0).peak();
    let (used, charged) = (truth.device(0).used(), device_used(&snapshot(&dir.region()), 0));
    drop(sessions);
    assert_eq!(created + refused, 16, "{answers:?}");
    assert_eq!(created as u64, 512 * MIB / CONTEXT, "contexts that fit: {answers:?}");
    assert!(
        peak <= 512 * MIB,
        "the device held {} MiB under a 512 MiB limit",
        peak / MIB
    );
    assert_eq!(
        charged, used,
        "the region charged {charged} bytes for {used} the contexts took"
    );
}

#[test]
fn kill_storm_never_blocks_survivors_and_leaves_no_charge() {
    let _heavy = one_at_a_time();
    let dir = ScratchDir::new("memory-storm");
    let program = program("mem_race");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    let mut rng = Rng(seed);
    let spawn = |seed: u64, args: &[&str]| {
        let seed = seed.to_string();
        race_env(Run::new(&program).hooked(), &dir)
            .args(std::iter::once(seed.as_str()).chain(args.iter().copied()))
            .spawn(Duration::from_secs(60))
    };
    // Observers run through the whole storm and are never killed. They start one after the other
    // and wait until all are ready, so each context is measured with nothing else happening on
    // the device (concurrent starts are the race test's business).
    let mut observers = Vec::new();
    for i in 0..3 {
        let mut observer = spawn(1000 + i, &["0", "barrier", "hold"]);
        let ready = observer.read_line().unwrap_or_default();
        assert!(
            ready.starts_with("ready "),
            "an observer did not start (seed {seed}): {ready:?}"
        );
        observers.push(observer);
    }
    for observer in &mut observers {
        observer.send("go");
    }
    let (region, device) = join_region(&dir);
    let truth = dir.truth();

    let mut next_seed = 0;
    let mut storm: Vec<Session> = (0..12)
        .map(|_| {
            next_seed += 1;
            spawn(next_seed, &["1000"])
        })
        .collect();
    let mut kills = 0;
    let mut reports = Vec::new();
    let started = Instant::now();
    while kills < 200 {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "only {kills} kills in 15 s (seed {seed})"
        );
        std::thread::sleep(Duration::from_millis(2 + rng.below(20)));
        let victim = storm.swap_remove(rng.below(storm.len() as u64) as usize);
        let output = victim.kill();
        if output.status.signal() == Some(libc::SIGKILL) {
            kills += 1;
        } else {
            // It finished before the kill: a survivor.
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            if let Some(done) = stdout.lines().find(|l| l.starts_with("done ")) {
                reports.push(race_report(done));
            }
        }
        next_seed += 1;
        storm.push(spawn(next_seed, &["1000"]));
    }
    for mut child in storm {
        let output = child.finish();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        // A child whose context did not fit the limit the others held is refused at its start.
        if stdout.trim() == format!("setup-failed {CUDA_ERROR_OUT_OF_MEMORY}") {
            continue;
        }
        assert!(
            output.status.success(),
            "a storm child failed (seed {seed}): {output:?}"
        );
        let done = stdout.lines().find(|l| l.starts_with("done ")).unwrap_or_default();
        reports.push(race_report(done));
    }
    let mut observed = Vec::new();
    for observer in &mut observers {
        observer.send("stop");
        observed.push(race_report(&observer.read_line().unwrap_or_default()));
    }
    let longest = observed
        .iter()
        .chain(&reports)
        .map(|r| r["max_wait_ns"])
        .max()
        .unwrap_or(0);
    eprintln!(
        "kill storm (seed {seed}): {kills} kills, {} survivors reported, longest call {} us, in {:?}",
        observed.len() + reports.len(),
        longest / 1000,
        started.elapsed()
    );
    for report in observed.iter().chain(&reports) {
        assert_eq!(
            report["errors"], 0,
            "calls failed other than by the limit (seed {seed}): {report:?}"
        );
        assert!(
            report["max_wait_ns"] < 1_000_000_000,
            "a survivor waited {} ms in one call (seed {seed}): {report:?}",
            report["max_wait_ns"] / 1_000_000
        );
    }
    for report in &observed {
        assert!(
            report["ops"] > 100,
            "an observer made no progress during the storm: {report:?}"
        );
    }
    // Only the observers are alive: once the dead are reaped, the region is the truth.
    region.reap_dead().expect("reap the region");
    truth.reclaim_dead();
    let held: u64 = observed.iter().map(|r| r["held"]).sum();
    assert_eq!(
        (region.device_used(device), truth.device(0).used()),
        (held + 3 * RACE_CONTEXT, held + 3 * RACE_CONTEXT),
        "(region, truth) after {kills} kills, with the observers holding {held} bytes (seed {seed})"
    );
    for mut observer in observers {
        assert!(observer.finish().status.success());
    }
    region.reap_dead().expect("reap the region");
    truth.reclaim_dead();
    assert_eq!((region.device_used(device), truth.device(0).used()), (0, 0));
}

#[test]
fn a_killed_processes_memory_is_reclaimed_by_the_next_start_or_allocation() {
    let dir = ScratchDir::new("memory-reclaim");
    let program = program("mem_ops");
    let start = || {
        let mut session = setup(Run::new(&program).hooked(), &dir)
            .env("FAKE_CUDA_MEMORY", "4g")
            .env("CUDA_DEVICE_MEMORY_LIMIT", "512m")
            .spawn(Duration::from_secs(30));
        assert_eq!(session.ask("init"), "init 0");
        assert_eq!(session.ask("ctx 0"), "ctx 0");
        session
    };
    let truth = dir.truth();
    let live = |pid: u32| {
        snapshot(&dir.region())
            .processes
            .iter()
            .any(|p| p.pid == pid as i32 && p.status == SLOT_LIVE)
    };
    let mut b = start();
    // Reclaimed when another process starts.
    let mut a = start();
    assert_eq!(status(&a.ask(&format!("alloc {}", 100 * MIB))), CUDA_SUCCESS);
    let a_pid = a.pid();
    a.kill();
    let c = start();
    assert!(!live(a_pid), "a killed process's slot survived another process's start");
    assert_eq!(device_used(&snapshot(&dir.region()), 0), 2 * CONTEXT);
    // Reclaimed when another process needs the memory.
    let mut a = start();
    assert_eq!(status(&a.ask(&format!("alloc {}", 300 * MIB))), CUDA_SUCCESS);
    assert_eq!(
        status(&b.ask(&format!("alloc {}", 300 * MIB))),
        CUDA_ERROR_OUT_OF_MEMORY,
        "two processes held 600 MiB (and three contexts) under a 512 MiB limit"
    );
    let a_pid = a.pid();
    a.kill();
    assert_eq!(
        status(&b.ask(&format!("alloc {}", 300 * MIB))),
        CUDA_SUCCESS,
        "the memory of a killed process was not given back before refusing"
    );
    assert!(!live(a_pid));
    truth.reclaim_dead();
    assert_eq!(device_used(&snapshot(&dir.region()), 0), truth.device(0).used());
    drop(c);
}

#[test]
fn blocks_a_pool_keeps_after_a_free_count_against_the_limit() {
    let dir = ScratchDir::new("memory-pool-keeps");
    let mut session = setup(Run::new(&program("mem_ops")).hooked(), &dir)
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "512m")
        .spawn(Duration::from_secs(30));
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    let answer = session.ask(&format!("asyncalloc {}", 400 * MIB));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    assert_eq!(session.ask(&format!("asyncfree {}", number(&answer, 2))), "asyncfree 0");
    // The pool still holds the 400 MiB until a synchronisation gives them back.
    assert_eq!(
        status(&session.ask(&format!("alloc {}", 400 * MIB))),
        CUDA_ERROR_OUT_OF_MEMORY,
        "a pool's freed blocks were not counted"
    );
    assert_eq!(session.ask("sync"), "sync 0");
    assert_eq!(status(&session.ask(&format!("alloc {}", 400 * MIB))), CUDA_SUCCESS);
    let truth = dir.truth();
    assert!(
        truth.device(0).peak() <= 512 * MIB,
        "the device held {} bytes",
        truth.device(0).peak()
    );
    assert_eq!(device_used(&snapshot(&dir.region()), 0), truth.device(0).used());
}

/// A mem_ops session with a context on device 0, 4 GiB on the fake and a 1 GiB limit.
fn capture_session(dir: &ScratchDir) -> Session {
    let mut session = setup(Run::new(&program("mem_ops")).hooked(), dir)
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .spawn(Duration::from_secs(30));
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    session
}

/// PyTorch's cudaMallocAsync backend allocates inside `torch.cuda.graph`, a global capture: the
/// library's own pool queries must not invalidate it (on the H200 they did: every capture failed).
#[test]
fn allocations_inside_a_global_capture_keep_it_and_are_charged_to_its_graph() {
    let dir = ScratchDir::new("memory-capture-alloc");
    let mut session = capture_session(&dir);
    assert_eq!(session.ask("capture 0"), "capture 0");
    let answer = session.ask(&format!("capalloc {}", 100 * MIB));
    assert_eq!(
        status(&answer),
        CUDA_SUCCESS,
        "the allocation inside the capture failed: {answer}"
    );
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT + 100 * MIB,
        "the captured allocation is not charged"
    );
    let over = session.ask(&format!("capalloc {}", GIB));
    assert_eq!(status(&over), CUDA_ERROR_OUT_OF_MEMORY, "{over}");
    assert_eq!(session.ask(&format!("capfree {}", number(&answer, 2))), "capfree 0");
    assert_eq!(
        session.ask("mode"),
        "mode 0 0",
        "the library's queries left the thread out of its global capture mode"
    );
    let ended = session.ask("endcapture");
    assert_eq!(status(&ended), CUDA_SUCCESS, "the capture was lost: {ended}");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT + 100 * MIB,
        "the graph's allocation is charged while the graph exists"
    );
    assert_eq!(
        session.ask(&format!("graphdestroy {}", number(&ended, 2))),
        "graphdestroy 0"
    );
    assert_eq!(device_used(&snapshot(&dir.region()), 0), CONTEXT);
    assert_eq!(device_used(&snapshot(&dir.region()), 0), dir.truth().device(0).used());
}

#[test]
fn a_failed_capture_gives_back_what_its_allocations_were_charged() {
    let dir = ScratchDir::new("memory-capture-failed");
    let mut session = capture_session(&dir);
    assert_eq!(session.ask("capture 0"), "capture 0");
    assert_eq!(status(&session.ask(&format!("capalloc {}", 100 * MIB))), CUDA_SUCCESS);
    // Querying the capturing stream is refused and invalidates the capture; the driver then
    // destroys its graph at the end.
    assert_ne!(status(&session.ask("capquery")), CUDA_SUCCESS);
    let ended = session.ask("endcapture");
    assert_eq!(status(&ended), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "{ended}");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT,
        "the failed capture's allocation is still charged"
    );
    assert_eq!(device_used(&snapshot(&dir.region()), 0), dir.truth().device(0).used());
}

/// The graph memory a launched instance holds counts against the limit at the next allocation,
/// after its graph is destroyed and without a synchronisation in between.
#[test]
fn graph_memory_held_by_a_launched_instance_counts_against_the_limit() {
    let dir = ScratchDir::new("memory-capture-graph-limit");
    let mut session = capture_session(&dir);
    let answer = session.ask(&format!("capgraph {}", 600 * MIB));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    let over = session.ask(&format!("alloc {}", 600 * MIB));
    assert_eq!(
        status(&over),
        CUDA_ERROR_OUT_OF_MEMORY,
        "an allocation beyond the limit with the graph's memory held: {over}"
    );
    let truth = dir.truth();
    assert!(
        truth.device(0).peak() <= GIB,
        "the device held {} bytes",
        truth.device(0).peak()
    );
    assert_eq!(device_used(&snapshot(&dir.region()), 0), truth.device(0).used());
}

#[test]
fn another_threads_pooled_allocations_keep_a_global_capture() {
    let dir = ScratchDir::new("memory-capture-other-thread");
    let mut session = capture_session(&dir);
    // The queries around a pooled allocation run in relaxed mode, under one guard: the thread's
    // own mode (global) is given back afterwards.
    let first = session.ask(&format!("asyncalloc {}", 10 * MIB));
    assert_eq!(status(&first), CUDA_SUCCESS, "{first}");
    assert_eq!(
        session.ask("mode"),
        "mode 0 0",
        "a pooled allocation left the thread out of its global capture mode"
    );
    assert_eq!(session.ask(&format!("asyncfree {}", number(&first, 2))), "asyncfree 0");
    assert_eq!(session.ask("capture 0"), "capture 0");
    assert_eq!(session.ask(&format!("otherasync {}", 10 * MIB)), "otherasync 0 0");
    let ended = session.ask("endcapture");
    assert_eq!(
        status(&ended),
        CUDA_SUCCESS,
        "another thread's pooled allocation invalidated the capture: {ended}"
    );
    assert_eq!(
        session.ask(&format!("graphdestroy {}", number(&ended, 2))),
        "graphdestroy 0"
    );
    assert_eq!(session.ask("sync"), "sync 0");
    assert_eq!(device_used(&snapshot(&dir.region()), 0), dir.truth().device(0).used());
}

#[test]
fn a_context_reset_releases_the_allocations_it_freed() {
    let dir = ScratchDir::new("memory-ctx-reset");
    let mut session = setup(Run::new(&program("mem_ops")).hooked(), &dir)
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .spawn(Duration::from_secs(30));
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    let answer = session.ask(&format!("alloc {}", 100 * MIB));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    assert_eq!(device_used(&snapshot(&dir.region()), 0), CONTEXT + 100 * MIB);
    assert_eq!(session.ask("reset 0"), "reset 0");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        0,
        "the reset context's memory is still charged"
    );
    // Its pointer is gone with it: freeing it is the driver's error and changes nothing.
    let freed = session.ask(&format!("free {}", number(&answer, 2)));
    assert_ne!(status(&freed), CUDA_SUCCESS, "{freed}");
    assert_eq!(device_used(&snapshot(&dir.region()), 0), 0);
    assert_eq!(device_used(&snapshot(&dir.region()), 0), dir.truth().device(0).used());
}

#[test]
fn no_umask_change_no_signal_handlers_and_a_shared_region_file() {
    let dir = ScratchDir::new("memory-manners");
    let mut session = setup(Run::new(&program("mem_ops")).hooked(), &dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .spawn(Duration::from_secs(30));
    let umask = session.ask("umask");
    let signals = session.ask("signals");
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    assert_eq!(status(&session.ask(&format!("alloc {MIB}"))), CUDA_SUCCESS);
    assert_eq!(status(&session.ask("nvml 0")), 0);
    assert_eq!(session.ask("umask"), umask, "the umask changed");
    assert_eq!(session.ask("signals"), signals, "signal handlers were installed");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.region())
        .expect("the region file")
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o777,
        0o666,
        "every user of the container must be able to open the region ({umask})"
    );
}

// ------------------------------------------------------------------------------------------------
// 5. Bad region files and paths.

fn garbage(len: usize) -> Vec<u8> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    (0..len).map(|_| rng.next() as u8).collect()
}

#[test]
fn bad_region_files_nobody_uses_are_rebuilt_with_a_warning() {
    let valid = vgpu_region::initial_image(&InitParams::default()).expect("a valid image");
    let mut wrong_version = valid.clone();
    wrong_version[4..8].copy_from_slice(&2u32.to_ne_bytes());
    let mut hami_core = valid.clone();
    hami_core[EXTENSION_OFFSET..].fill(0);
    let mut oversized = valid.clone();
    oversized.extend_from_slice(&[0; 4096]);
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", garbage(REGION_FILE_SIZE)),
        ("truncated", valid[..valid.len() / 2].to_vec()),
        ("wrong-version", wrong_version),
        ("hami-core-without-extension", hami_core),
        ("oversized", oversized),
        ("foreign", b"#!/bin/sh\necho this is not a region\n".to_vec()),
    ];
    let program = program("mem_ops");
    for (what, bytes) in files {
        let dir = ScratchDir::new("memory-rebuild");
        std::fs::write(dir.region(), &bytes).expect("write the bad file");
        let mut session = setup(Run::new(&program).hooked(), &dir)
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .spawn(Duration::from_secs(30));
        assert_eq!(session.ask("init"), "init 0", "{what}");
        assert_eq!(session.ask("ctx 0"), "ctx 0", "{what}");
        assert_eq!(status(&session.ask(&format!("alloc {MIB}"))), CUDA_SUCCESS, "{what}");
        let len = std::fs::metadata(dir.region()).map(|m| m.len()).unwrap_or(0);
        assert_eq!(len, REGION_FILE_SIZE as u64, "{what}: the region was not rebuilt");
        let rebuilt = snapshot(&dir.region());
        assert!(
            rebuilt.extension.is_some(),
            "{what}: no vgpu extension after the rebuild"
        );
        assert_eq!(
            device_used(&rebuilt, 0),
            CONTEXT + MIB,
            "{what}: the rebuilt region does not account"
        );
        let output = session.finish();
        let path = dir.region().display().to_string();
        let errors = stderr_lines(&output);
        assert!(
            errors.iter().any(|l| l.contains(&path) && l.contains("WARN")),
            "{what}: no warning naming {path}: {errors:?}"
        );
    }
}

#[test]
fn bad_region_file_in_use_is_refused_and_left_alone() {
    use std::os::fd::AsRawFd;
    let dir = ScratchDir::new("memory-in-use");
    let bytes = garbage(REGION_FILE_SIZE);
    std::fs::write(dir.region(), &bytes).expect("write the bad file");
    // A live user of the file, as every process with the region open is: a shared flock.
    let user = std::fs::File::open(dir.region()).expect("open the bad file");
    // SAFETY: flock on an open descriptor we own.
    assert_eq!(unsafe { libc::flock(user.as_raw_fd(), libc::LOCK_SH) }, 0);
    let output = setup(Run::new(&program("mem_ops")).hooked(), &dir)
        .stdin("init\nquit\n")
        .output();
    let answer = String::from_utf8_lossy(&output.stdout).trim().to_string();
    assert!(
        answer.starts_with("init ") && answer != "init 0",
        "cuInit succeeded on a corrupt region in use: {answer:?}"
    );
    let path = dir.region().display().to_string();
    let errors = stderr_lines(&output);
    assert!(
        errors.iter().any(|l| l.contains(&path) && l.contains("ERROR")),
        "no error naming {path}: {errors:?}"
    );
    assert_eq!(
        std::fs::read(dir.region()).expect("read the file"),
        bytes,
        "a region file in use was changed"
    );
    drop(user);
}

#[test]
fn region_path_in_a_bad_directory_fails_cuinit_with_one_error_line() {
    let dir = ScratchDir::new("memory-bad-dir");
    let mut paths = vec![
        PathBuf::from("/dev/null/vgpu-region"),
        dir.join("missing").join("region"),
    ];
    // Not writable: a read-only folder, or for root (who may write anywhere) sysfs.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        if Path::new("/sys/kernel").is_dir() {
            paths.push(PathBuf::from("/sys/vgpu-region-test"));
        }
    } else {
        use std::os::unix::fs::PermissionsExt;
        let read_only = dir.join("read-only");
        std::fs::create_dir(&read_only).expect("create a folder");
        std::fs::set_permissions(&read_only, std::fs::Permissions::from_mode(0o555)).expect("chmod");
        paths.push(read_only.join("region"));
    }
    for path in paths {
        let output = setup(Run::new(&program("mem_ops")).hooked(), &dir)
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &path)
            .stdin("init\nquit\n")
            .output();
        let answer = String::from_utf8_lossy(&output.stdout).trim().to_string();
        assert!(
            answer.starts_with("init ") && answer != "init 0",
            "{}: cuInit answered {answer:?}",
            path.display()
        );
        let shown = path.display().to_string();
        let errors = stderr_lines(&output);
        let naming: Vec<&String> = errors.iter().filter(|l| l.contains(&shown)).collect();
        assert_eq!(
            naming.len(),
            1,
            "{shown}: one line naming the path expected: {errors:?}"
        );
        assert!(naming[0].contains("ERROR"), "{shown}: not an error line: {errors:?}");
        assert!(!path.exists(), "{shown} was created");
    }
}

/// Region paths that cannot be used (issue 16): one in a missing folder, a FIFO, a device, and as
/// root a file of another user. cuInit fails; a program that ignores it and goes on must get no
/// device memory at all: every allocation path (the context included) answers
/// CUDA_ERROR_NOT_INITIALIZED, and the fake's ground truth never holds a byte.
#[test]
fn an_unusable_region_fails_closed_when_the_program_ignores_cuinit() {
    let dir = ScratchDir::new("memory-fail-closed");
    let fifo = dir.join("fifo");
    let c_fifo = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("a path");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_fifo.as_ptr(), 0o666) }, 0, "mkfifo");
    let mut paths = vec![dir.join("missing").join("region"), fifo, PathBuf::from("/dev/null")];
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let foreign = dir.join("foreign");
        std::fs::write(&foreign, b"another user's file").expect("write");
        std::os::unix::fs::chown(&foreign, Some(65534), None).expect("chown");
        paths.push(foreign);
    }
    let program = program("mem_ops");
    for path in paths {
        let shown = path.display().to_string();
        let output = setup(Run::new(&program).hooked(), &dir)
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &path)
            .stdin(format!(
                "init\nctx 0\nalloc {}\nalloc {MIB}\nasyncalloc {MIB}\nquit\n",
                8 * GIB
            ))
            .output();
        let answers: Vec<String> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        assert_eq!(answers.len(), 5, "{shown}: {answers:?}");
        assert_ne!(answers[0], "init 0", "{shown}: cuInit succeeded");
        assert_eq!(
            answers[1],
            format!("ctx {CUDA_ERROR_NOT_INITIALIZED}"),
            "{shown}: the context was created"
        );
        for answer in &answers[2..] {
            assert_eq!(status(answer), CUDA_ERROR_NOT_INITIALIZED, "{shown}: {answer}");
        }
        let truth = dir.truth();
        assert_eq!(
            (truth.device(0).used(), truth.device(0).peak()),
            (0, 0),
            "{shown}: the driver allocated device memory ({answers:?})"
        );
        let errors = stderr_lines(&output);
        assert!(
            errors.iter().any(|l| l.contains(&shown) && l.contains("ERROR")),
            "{shown}: no error naming the path: {errors:?}"
        );
    }
}

#[test]
fn malformed_per_device_limit_fails_cuinit() {
    let dir = ScratchDir::new("memory-bad-limit");
    let output = setup(Run::new(&program("mem_ops")).hooked(), &dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT_1", "12q")
        .stdin("init\nquit\n")
        .output();
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("init {CUDA_ERROR_INVALID_VALUE}")
    );
    let errors = stderr_lines(&output);
    assert!(
        errors
            .iter()
            .any(|l| l.contains("CUDA_DEVICE_MEMORY_LIMIT_1") && l.contains("12q")),
        "{errors:?}"
    );
}

// ------------------------------------------------------------------------------------------------
// 6. What cuMemGetInfo, cuDeviceTotalMem and NVML report.

#[test]
fn nvml_and_total_mem_show_the_virtual_device() {
    let dir = ScratchDir::new("memory-nvml");
    let program = program("mem_ops");
    let physical = 8 * GIB;
    let start = |limit_0: &str| {
        setup(Run::new(&program).hooked(), &dir)
            .env("FAKE_CUDA_DEVICES", "2")
            .env("FAKE_CUDA_MEMORY", physical.to_string())
            .env("CUDA_DEVICE_MEMORY_LIMIT_0", limit_0)
            .spawn(Duration::from_secs(30))
    };
    let truth = dir.truth();
    let mut a = start("1g");
    assert_eq!(a.ask("init"), "init 0");
    assert_eq!(a.ask("ctx 0"), "ctx 0");
    assert_eq!(status(&a.ask(&format!("alloc {}", 100 * MIB))), CUDA_SUCCESS);
    let used = device_used(&snapshot(&dir.region()), 0);
    assert_eq!(used, CONTEXT + 100 * MIB);
    let view = format!("{GIB} {used} {}", GIB - used);
    assert_eq!(a.ask("nvml 0"), format!("nvml 0 {view}"), "nvmlDeviceGetMemoryInfo");
    assert_eq!(
        a.ask("nvml2 0"),
        format!("nvml2 0 {view}"),
        "nvmlDeviceGetMemoryInfo_v2"
    );
    assert_eq!(a.ask("info"), format!("info 0 {} {GIB}", GIB - used), "cuMemGetInfo_v2");
    assert_eq!(
        a.ask("totalmem 0"),
        format!("totalmem 0 {GIB}"),
        "cuDeviceTotalMem_v2, limited"
    );
    assert_eq!(
        a.ask("totalmem 1"),
        format!("totalmem 0 {physical}"),
        "cuDeviceTotalMem_v2 without a limit"
    );
    // A wrong struct version is the driver's answer.
    let native = Run::new(&program)
        .env("FAKE_CUDA_DEVICES", "2")
        .stdin("nvml2bad 0\n")
        .output();
    assert_eq!(a.ask("nvml2bad 0"), String::from_utf8_lossy(&native.stdout).trim());

    // Device 1 has no limit: the physical view.
    assert_eq!(a.ask("ctx 1"), "ctx 0");
    assert_eq!(status(&a.ask(&format!("alloc {}", 10 * MIB))), CUDA_SUCCESS);
    let used_1 = truth.device(1).used();
    assert_eq!(used_1, CONTEXT + 10 * MIB);
    assert_eq!(
        a.ask("nvml 1"),
        format!("nvml 0 {physical} {used_1} {}", physical - used_1)
    );
    assert_eq!(a.ask("info"), format!("info 0 {} {physical}", physical - used_1));

    // The container's limit is lowered below its usage while it runs (the region's limit is the
    // container's: vgpu-smi set, or HAMi's monitor): a sees used > total and must show free 0,
    // not an underflow.
    let (region, device) = join_region(&dir);
    let lowered = 100 * MIB;
    region.hami().limit[device].store(lowered, std::sync::atomic::Ordering::Relaxed);
    let used = device_used(&snapshot(&dir.region()), 0);
    assert!(used > lowered);
    // used is capped at the total (hook/src/nvml.rs, virtual_memory): nvidia-smi never shows more
    // used than total, and free is 0.
    assert_eq!(
        a.ask("nvml 0"),
        format!("nvml 0 {lowered} {lowered} 0"),
        "NVML with usage over the limit"
    );
    assert_eq!(a.ask("nvml2 0"), format!("nvml2 0 {lowered} {lowered} 0"));
    assert_eq!(a.ask("ctx 0"), "ctx 0");
    assert_eq!(
        a.ask("info"),
        format!("info 0 0 {lowered}"),
        "cuMemGetInfo with usage over the limit"
    );
    assert_eq!(status(&a.ask("alloc 1")), CUDA_ERROR_OUT_OF_MEMORY);
    // Nothing was freed: the usage stands.
    assert_eq!(device_used(&snapshot(&dir.region()), 0), used);
    drop(a);
}

#[test]
fn reported_total_is_the_smaller_of_limit_and_physical_and_free_follows_the_device() {
    let dir = ScratchDir::new("memory-physical");
    let program = program("mem_ops");
    let physical = 2 * GIB;
    let start = |hooked: bool| {
        let run = Run::new(&program);
        let run = if hooked { run.hooked() } else { run };
        setup(run, &dir)
            .env("FAKE_CUDA_MEMORY", physical.to_string())
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .spawn(Duration::from_secs(30))
    };
    // Something outside the container (no hook) takes most of the device.
    let mut outsider = start(false);
    assert_eq!(outsider.ask("init"), "init 0");
    assert_eq!(outsider.ask("ctx 0"), "ctx 0");
    assert_eq!(status(&outsider.ask(&format!("alloc {}", 1800 * MIB))), CUDA_SUCCESS);
    let mut a = start(true);
    assert_eq!(a.ask("init"), "init 0");
    assert_eq!(a.ask("ctx 0"), "ctx 0");
    let truth = dir.truth();
    let physical_free = physical - truth.device(0).used();
    assert!(physical_free < GIB - CONTEXT);
    assert_eq!(
        a.ask("info"),
        format!("info 0 {physical_free} {GIB}"),
        "free must be the device's when that is smaller"
    );
    drop(outsider);
    drop(a);

    // A limit above the physical size: the physical size.
    let dir = ScratchDir::new("memory-physical-small");
    let mut b = setup(Run::new(&program).hooked(), &dir)
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "32g")
        .spawn(Duration::from_secs(30));
    assert_eq!(b.ask("init"), "init 0");
    assert_eq!(b.ask("totalmem 0"), format!("totalmem 0 {}", 4 * GIB));
    assert_eq!(b.ask("ctx 0"), "ctx 0");
    assert_eq!(b.ask("info"), format!("info 0 {} {}", 4 * GIB - CONTEXT, 4 * GIB));
}

#[test]
fn mem_get_info_with_one_null_output_still_shows_the_virtual_device() {
    // The driver fills whichever output is given (OptiX passes NULL for free); the hook must not
    // fall back to the physical view then.
    let program = program("mem_ops");
    let dir = ScratchDir::new("memory-info-null");
    let physical = 8 * GIB;
    let native_dir = ScratchDir::new("memory-info-null-native");
    let native = setup(Run::new(&program), &native_dir)
        .env("FAKE_CUDA_MEMORY", physical.to_string())
        .stdin("init\nctx 0\ninfop 0\ninfo1p 0\nquit\n")
        .output();
    let native: Vec<String> = String::from_utf8_lossy(&native.stdout)
        .lines()
        .skip(2)
        .map(str::to_string)
        .collect();
    assert_eq!(native.len(), 2, "{native:?}");
    let mut a = setup(Run::new(&program).hooked(), &dir)
        .env("FAKE_CUDA_MEMORY", physical.to_string())
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .spawn(Duration::from_secs(30));
    assert_eq!(a.ask("init"), "init 0");
    assert_eq!(a.ask("ctx 0"), "ctx 0");
    let free = GIB - CONTEXT;
    for form in ["infop", "info1p"] {
        assert_eq!(
            a.ask(&format!("{form} 3")),
            format!("{form} 0 {free} {GIB}"),
            "both outputs"
        );
        assert_eq!(a.ask(&format!("{form} 2")), format!("{form} 0 0 {GIB}"), "total alone");
        assert_eq!(a.ask(&format!("{form} 1")), format!("{form} 0 {free} 0"), "free alone");
    }
    // Both NULL: the driver's answer.
    assert_eq!(a.ask("infop 0"), native[0]);
    assert_eq!(a.ask("info1p 0"), native[1]);
    drop(a);

    // A limit above the physical size: free alone is still the device's free memory.
    let dir = ScratchDir::new("memory-info-null-small");
    let mut b = setup(Run::new(&program).hooked(), &dir)
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "32g")
        .spawn(Duration::from_secs(30));
    assert_eq!(b.ask("init"), "init 0");
    assert_eq!(b.ask("ctx 0"), "ctx 0");
    assert_eq!(b.ask("infop 1"), format!("infop 0 {} 0", 4 * GIB - CONTEXT));
    assert_eq!(b.ask("infop 2"), format!("infop 0 0 {}", 4 * GIB));
}

// ------------------------------------------------------------------------------------------------
// 7. Hostile sizes.

#[test]
fn hostile_mipmap_level_counts_are_answered_at_once_and_charge_nothing() {
    // 1024 x 1024 has 11 levels (1 + floor(log2 1024)); the driver refuses more. The hook used to
    // walk every requested level before asking, 2^32 - 1 of them.
    let program = program("mem_ops");
    let dir = ScratchDir::new("memory-mipmap-levels");
    let mut session = setup(Run::new(&program).hooked(), &dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .spawn(Duration::from_secs(60));
    let truth = dir.truth();
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    let pid = session.pid();
    let unchanged = |what: &str| {
        let now = snapshot(&dir.region());
        let mine = usage(&now, pid, 0);
        assert_eq!((mine.data, device_used(&now, 0)), (0, CONTEXT), "after {what}");
        assert_eq!(truth.device(0).used(), CONTEXT, "after {what}");
    };
    for levels in [u32::MAX, 1 << 31, 65, 64, 12] {
        let started = Instant::now();
        let answer = session.ask(&format!("mipmap {levels}"));
        // Only a hang guard: the answer takes microseconds.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{levels} levels took {:?}",
            started.elapsed()
        );
        assert_eq!(status(&answer), CUDA_ERROR_INVALID_VALUE, "{levels} levels: {answer}");
        unchanged(&format!("{levels} levels"));
    }
    // The largest valid count is charged and released as usual.
    let held = session.ask("mipmap 11");
    assert_eq!(status(&held), CUDA_SUCCESS, "{held}");
    let mine = usage(&snapshot(&dir.region()), pid, 0);
    assert!(
        mine.data >= truth.device(0).used() - CONTEXT,
        "charged {} bytes",
        mine.data
    );
    assert_eq!(session.ask(&format!("mipmapfree {}", number(&held, 2))), "mipmapfree 0");
    unchanged("the free");
}

#[test]
fn hostile_sizes_get_the_drivers_answer_and_change_nothing() {
    let program = program("mem_ops");
    let max = u64::MAX;
    let commands = [
        "alloc 0".to_string(),
        format!("alloc {max}"),
        // Just fits 64 bits with the context already charged; and overflows it.
        format!("alloc {}", max - CONTEXT),
        format!("alloc {}", max - 4095),
        format!("allocnull {MIB}"),
        "allocnull 0".to_string(),
        "free 0".to_string(),
        "free 12345".to_string(),
    ];
    let native_dir = ScratchDir::new("memory-hostile-native");
    let native = setup(Run::new(&program), &native_dir)
        .stdin(format!("init\nctx 0\n{}\nquit\n", commands.join("\n")))
        .output();
    let native: Vec<String> = String::from_utf8_lossy(&native.stdout)
        .lines()
        .skip(2)
        .map(str::to_string)
        .collect();
    assert_eq!(native.len(), commands.len(), "{native:?}");
    for limit in [Some("1g"), None] {
        let dir = ScratchDir::new("memory-hostile");
        let run = setup(Run::new(&program).hooked(), &dir);
        let run = match limit {
            Some(limit) => run.env("CUDA_DEVICE_MEMORY_LIMIT", limit),
            None => run,
        };
        let mut session = run.spawn(Duration::from_secs(30));
        let truth = dir.truth();
        assert_eq!(session.ask("init"), "init 0");
        assert_eq!(session.ask("ctx 0"), "ctx 0");
        let pid = session.pid();
        let check = |what: &str| {
            let now = snapshot(&dir.region());
            let mine = usage(&now, pid, 0);
            assert_eq!(
                (mine.context, mine.module, mine.data, device_used(&now, 0)),
                (CONTEXT, 0, 0, CONTEXT),
                "limit {limit:?}, after {what}: the region changed"
            );
            assert_eq!(truth.device(0).used(), CONTEXT, "limit {limit:?}, after {what}");
        };
        check("the context");
        for (command, native) in commands.iter().zip(&native) {
            let answer = session.ask(command);
            assert_eq!(
                status(&answer),
                status(native),
                "limit {limit:?}, {command}: hooked {answer:?}, driver alone {native:?}"
            );
            check(command);
        }
        // Double free: the second one is the driver's answer and releases nothing more.
        let held = session.ask(&format!("alloc {MIB}"));
        assert_eq!(status(&held), CUDA_SUCCESS);
        let free = format!("free {}", number(&held, 2));
        assert_eq!(session.ask(&free), "free 0");
        assert_eq!(session.ask(&free), format!("free {CUDA_ERROR_INVALID_VALUE}"));
        check("a double free");
    }
}

/// A release, or a context's after-the-fact charge, made while the region's lock times out is
/// queued and written once the lock works again, never dropped (issue 16). The debug build's fault
/// injection fails every region update as a lock timeout while the fault file exists.
#[test]
fn updates_made_while_the_lock_times_out_are_applied_once_it_works() {
    let dir = ScratchDir::new("memory-lock-timeout");
    let fault = dir.join("lock-timeout");
    let hook = hook_library();
    let mut session = setup(Run::new(&program("mem_ops")).preload(&[hook.as_path()]), &dir)
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .env("VGPU_FAULT_LOCK_TIMEOUT_FILE", &fault)
        .spawn(Duration::from_secs(30));
    let truth = dir.truth();
    let used = || device_used(&snapshot(&dir.region()), 0);
    assert_eq!(session.ask("init"), "init 0");
    // The context's charge comes after the driver made it: queued, then written.
    std::fs::write(&fault, "").unwrap();
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    assert_eq!(used(), 0);
    std::fs::remove_file(&fault).unwrap();
    let answer = session.ask(&format!("alloc {}", 177 * MIB));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    assert_eq!(used(), CONTEXT + 177 * MIB, "the queued context charge was not written");
    // The free's release is queued, then written.
    std::fs::write(&fault, "").unwrap();
    assert_eq!(session.ask(&format!("free {}", number(&answer, 2))), "free 0");
    assert_eq!(truth.device(0).used(), CONTEXT);
    assert_eq!(used(), CONTEXT + 177 * MIB, "the fault did not hold the release back");
    std::fs::remove_file(&fault).unwrap();
    assert_eq!(status(&session.ask("info")), CUDA_SUCCESS);
    assert_eq!(
        used(),
        truth.device(0).used(),
        "{} MiB stayed charged after the free",
        (used() - truth.device(0).used()) / MIB
    );
    assert_eq!(session.ask("reset 0"), "reset 0");
    assert_eq!((used(), truth.device(0).used()), (0, 0));
}

/// `program` started under a 1 GiB limit with this test's files, its context made current.
fn started_under_1g(dir: &ScratchDir, program_name: &str) -> Session {
    let mut session = setup(Run::new(&program(program_name)).hooked(), dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .spawn(Duration::from_secs(60));
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    session
}

/// A second process, beside one holding 800 MiB under 1 GiB, is refused 800 MiB, and the device
/// never held more than the limit.
fn refused_800_mib_under_the_limit(second: &mut Session, truth: &truth::Truth, label: &str) {
    let refused = second.ask(&format!("alloc {}", 800 * MIB));
    assert_eq!(status(&refused), CUDA_ERROR_OUT_OF_MEMORY, "{label}: {refused}");
    assert!(
        truth.device(0).peak() <= GIB,
        "{label}: the device held {} MiB",
        truth.device(0).peak() / MIB
    );
}

/// The region file deleted (`rm`, as advice for changing limits says) or replaced by an older copy
/// (`mv copy path`) while a process holds 800 MiB under a 1 GiB limit: a process started at once
/// joins the container's region (put back at the path from its anchor) and is refused what the
/// limit does not allow, the device never holds more than the limit, and the region at the path
/// shows both processes. Left alone, the running process puts its region back at its next memory
/// call (or tick).
/// Before, the new process started a second region and got 800 MiB too.
#[test]
fn a_region_deleted_or_replaced_under_running_processes_stays_one_region() {
    for how in ["rm", "mv"] {
        let dir = ScratchDir::new("memory-region-deleted");
        let start = || started_under_1g(&dir, "mem_ops");
        let mut first = start();
        let truth = dir.truth();
        let copy = dir.join("copy.cache");
        std::fs::copy(dir.region(), &copy).expect("copy the region");
        let held = first.ask(&format!("alloc {}", 800 * MIB));
        assert_eq!(status(&held), CUDA_SUCCESS, "{held}");
        match how {
            "rm" => std::fs::remove_file(dir.region()).expect("delete the region"),
            _ => std::fs::rename(&copy, dir.region()).expect("move the copy over the region"),
        }
        let mut second = start();
        refused_800_mib_under_the_limit(&mut second, &truth, how);
        let shown = snapshot(&dir.region());
        assert_eq!(
            shown.processes.len(),
            2,
            "{how}: the region at the path lists both processes"
        );
        assert_eq!(device_used(&shown, 0), truth.device(0).used(), "{how}");
        // It ends normally: its slot goes with it.
        assert!(second.finish().status.success(), "{how}");

        // Alone, the running process puts its region back at its next memory call (or tick)
        // half a second or more after the last look.
        std::fs::remove_file(dir.region()).expect("delete the region again");
        std::thread::sleep(Duration::from_millis(600));
        let more = first.ask(&format!("alloc {MIB}"));
        assert_eq!(status(&more), CUDA_SUCCESS, "{how}: {more}");
        assert!(dir.region().exists(), "{how}: the path was not put back");
        assert_eq!(device_used(&snapshot(&dir.region()), 0), CONTEXT + 801 * MIB, "{how}");
        drop(first);
    }
}

/// An older image of the region written over the live file in place (as `cp copy path` does: the
/// same inode, so the anchor does not see it) while a process that launches holds 800 MiB under a
/// 1 GiB limit: one image from before the process allocated (its slot there holds its context
/// only), one from before it started (no slot of its own). At the library's next tick (0.5 s; a
/// lowered charge 0.1 s later, once confirmed; asserted with room for a loaded machine, the times
/// printed) the region charges the process all it holds again, so a process started then is
/// refused what the limit does not allow and the device never holds more than the limit.
/// Before, the copy erased the charge for good and the second process got 800 MiB too.
#[test]
fn an_older_image_copied_over_the_region_is_repaired_at_the_next_tick() {
    for image in ["allocated later", "started later"] {
        let dir = ScratchDir::new("memory-region-copied-over");
        let start = |name: &str| started_under_1g(&dir, name);
        let read = || std::fs::read(dir.region()).expect("read the region");
        let early = (image == "started later").then(|| {
            // A process that came and went leaves the region with no live slot.
            let mut before = start("mem_ops");
            before.send("quit");
            assert!(before.finish().status.success());
            read()
        });
        let mut first = start("monitor_launch");
        let truth = dir.truth();
        let copy = early.unwrap_or_else(read);
        let held = first.ask(&format!("alloc {}", 800 * MIB));
        assert_eq!(status(&held), CUDA_SUCCESS, "{held}");
        // A launch starts the library's tick.
        assert_eq!(first.ask("load"), "load 0", "{image}");
        let launched = first.ask("launch 1");
        assert!(launched.starts_with("launch 0 "), "{image}: {launched}");
        let before = device_used(&snapshot(&dir.region()), 0);
        assert_eq!(before, CONTEXT + 800 * MIB, "{image}");
        {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.region())
                .expect("open the region");
            file.write_all_at(&copy, 0).expect("write the copy over the region");
        }
        let written = Instant::now();
        assert!(
            device_used(&snapshot(&dir.region()), 0) < before,
            "{image}: the copy did not lower the charge"
        );
        while device_used(&snapshot(&dir.region()), 0) < before && written.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let repaired = written.elapsed();
        eprintln!("{image}: the region charged the process all it holds again after {repaired:?}");
        assert!(
            repaired <= Duration::from_millis(1000),
            "{image}: the charge came back after {repaired:?} ({} MiB)",
            device_used(&snapshot(&dir.region()), 0) / MIB
        );
        let shown = snapshot(&dir.region());
        assert_eq!(
            (usage(&shown, first.pid(), 0).total, device_used(&shown, 0)),
            (CONTEXT + 800 * MIB, CONTEXT + 800 * MIB),
            "{image}"
        );
        let mut second = start("mem_ops");
        refused_800_mib_under_the_limit(&mut second, &truth, image);
        assert!(second.finish().status.success(), "{image}");
        first.send("quit");
        let output = first.finish();
        assert!(output.status.success(), "{image}: {output:?}");
        let said = String::from_utf8_lossy(&output.stderr);
        let expected = if image == "started later" {
            "no longer had this process's slot"
        } else {
            "bytes less than it holds"
        };
        assert_eq!(said.matches(expected).count(), 1, "{image}: {said}");
    }
}

/// Takes the region's lock as another process's library does (a write lock on the byte at
/// `FILE_LOCK_OFFSET`, through a description of its own), until the file is closed.
fn hold_region_lock(path: &std::path::Path) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open the region");
    // SAFETY: all zeroes is a valid flock.
    let mut range: libc::flock = unsafe { std::mem::zeroed() };
    range.l_type = libc::F_WRLCK as libc::c_short;
    range.l_whence = libc::SEEK_SET as libc::c_short;
    range.l_start = vgpu_region::FILE_LOCK_OFFSET as libc::off_t;
    range.l_len = 1;
    // SAFETY: F_OFD_SETLKW with a valid flock on an open descriptor.
    assert_eq!(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLKW, &range) }, 0);
    file
}

/// With a release queued because the region's lock was stuck, the next allocation waits for the
/// lock once (its answer is the queue's), not once for the queue and again for itself.
#[test]
fn a_call_behind_a_queued_update_waits_for_the_lock_once() {
    let dir = ScratchDir::new("memory-queued-once");
    let mut session = setup(Run::new(&program("mem_ops")).hooked(), &dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .spawn(Duration::from_secs(60));
    let truth = dir.truth();
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    let held = session.ask(&format!("alloc {MIB}"));
    assert_eq!(status(&held), CUDA_SUCCESS, "{held}");
    let lock = hold_region_lock(&dir.region());
    // The free's release cannot be written: queued after the lock's timeout.
    assert_eq!(session.ask(&format!("free {}", number(&held, 2))), "free 0");
    let started = Instant::now();
    let refused = session.ask(&format!("alloc {MIB}"));
    let waited = started.elapsed();
    drop(lock);
    assert_eq!(status(&refused), CUDA_ERROR_OUT_OF_MEMORY, "{refused}");
    assert!(
        waited < Duration::from_millis(1600),
        "an allocation behind a queued release waited {waited:?} for a stuck lock"
    );
    let answer = session.ask(&format!("alloc {MIB}"));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        truth.device(0).used(),
        "the queued release was written once the lock worked"
    );
}

/// Issue 16: a release queued while the lock timed out, by a process that then never makes
/// another accounting call (an idle server, a job waiting for input), is applied in the background
/// once the lock works: before, its bytes stayed charged for the rest of the process's life.
#[test]
fn a_release_queued_by_a_process_that_calls_no_more_is_applied_in_the_background() {
    let dir = ScratchDir::new("memory-queued-idle");
    let fault = dir.join("lock-timeout");
    let hook = hook_library();
    let mut session = setup(Run::new(&program("mem_ops")).preload(&[hook.as_path()]), &dir)
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .env("VGPU_FAULT_LOCK_TIMEOUT_FILE", &fault)
        .spawn(Duration::from_secs(30));
    let truth = dir.truth();
    let used = || device_used(&snapshot(&dir.region()), 0);
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    let answer = session.ask(&format!("alloc {}", 177 * MIB));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    std::fs::write(&fault, "").unwrap();
    assert_eq!(session.ask(&format!("free {}", number(&answer, 2))), "free 0");
    // While the lock "times out", the release waits in the queue (and its retries fail).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(used(), CONTEXT + 177 * MIB, "the fault did not hold the release back");
    // The lock works again; the process makes no call at all.
    std::fs::remove_file(&fault).unwrap();
    let started = Instant::now();
    while used() != CONTEXT && started.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        (used(), truth.device(0).used()),
        (CONTEXT, CONTEXT),
        "{} MiB stayed charged with no call to write the queued release",
        (used() - CONTEXT) / MIB
    );
    eprintln!(
        "the queued release was written {:?} after the lock worked again",
        started.elapsed()
    );
    session.send("quit");
    assert!(session.finish().status.success());
}

/// Issue 16: a threaded process that forks while its other threads allocate. Each child must get
/// through its first CUDA calls (none of the library's locks inherited held), with a slot of its
/// own, and neither the child's charges nor the parent's may end up in the wrong slot.
#[test]
fn forking_a_threaded_process_never_blocks_the_child() {
    const FORKS: u32 = 40;
    let _heavy = one_at_a_time();
    let dir = ScratchDir::new("memory-fork-threads");
    let mut session = setup(Run::new(&program("fork_threads")).hooked(), &dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "4g")
        .args(["16", FORKS.to_string().as_str(), "5000"])
        .spawn(Duration::from_secs(300));
    let report = session.read_line().unwrap_or_default();
    let counts: BTreeMap<String, u64> = report
        .split_whitespace()
        .collect::<Vec<_>>()
        .chunks(2)
        .filter_map(|pair| Some((pair.first()?.to_string(), pair.get(1)?.parse().ok()?)))
        .collect();
    assert_eq!(
        (counts.get("completed"), counts.get("hung"), counts.get("failed")),
        (Some(&u64::from(FORKS)), Some(&0), Some(&0)),
        "{report}"
    );
    assert_eq!(counts.get("thread_errors"), Some(&0), "{report}");
    // The children are gone (each left 2 MiB for the region and the driver to reclaim); the
    // parent holds its context and 8 MiB, in its own slot.
    let (region, device) = join_region(&dir);
    region.reap_dead().expect("reap the region");
    let truth = dir.truth();
    truth.reclaim_dead();
    let now = region.snapshot();
    let parent = usage(&now, session.pid(), 0);
    assert_eq!(
        (parent.context, parent.data),
        (CONTEXT, 8 * MIB),
        "the parent's slot after {FORKS} forks"
    );
    assert_eq!(
        (region.device_used(device), truth.device(0).used()),
        (CONTEXT + 8 * MIB, CONTEXT + 8 * MIB),
        "region and truth after the children exited"
    );
    let output = session.finish();
    assert!(output.status.success(), "{output:?}");
    region.reap_dead().expect("reap the region");
    truth.reclaim_dead();
    assert_eq!((region.device_used(device), truth.device(0).used()), (0, 0));
}

/// Issue 16, item 9: where NVML lists no processes, a context is measured on the GPU's total;
/// other processes of the region allocating and freeing meanwhile must not skew its charge.
#[test]
fn context_charges_are_exact_while_other_processes_churn() {
    const CHURN_CONTEXT: u64 = 64 * MIB;
    let _heavy = one_at_a_time();
    let dir = ScratchDir::new("memory-context-churn");
    let env = |run: Run| {
        setup(run, &dir)
            .env("FAKE_CUDA_MEMORY", "64g")
            .env("FAKE_CUDA_CONTEXT_BYTES", CHURN_CONTEXT.to_string())
            .env("FAKE_NVML_NO_PROCESSES", "1")
            .env("CUDA_DEVICE_MEMORY_LIMIT", (16 * GIB).to_string())
    };
    let mut churners: Vec<Session> = (1..=3)
        .map(|seed| {
            env(Run::new(&program("mem_race")).hooked())
                .args([seed.to_string().as_str(), "0"])
                .spawn(Duration::from_secs(120))
        })
        .collect();
    for churner in &mut churners {
        let ready = churner.read_line().unwrap_or_default();
        assert!(ready.starts_with("ready "), "a churner did not start: {ready:?}");
    }
    let mut measurer = env(Run::new(&program("mem_ops")).hooked()).spawn(Duration::from_secs(120));
    assert_eq!(status(&measurer.ask("init")), CUDA_SUCCESS);
    let pid = measurer.pid();
    let mut charged = Vec::new();
    for _ in 0..20 {
        assert_eq!(status(&measurer.ask("ctx 0")), CUDA_SUCCESS);
        charged.push(usage(&snapshot(&dir.region()), pid, 0).context);
        assert_eq!(status(&measurer.ask("reset 0")), CUDA_SUCCESS);
    }
    measurer.send("quit");
    let _ = measurer.finish();
    let mut allocs = 0;
    for churner in &mut churners {
        churner.send("stop");
        let report = race_report(&churner.read_line().unwrap_or_default());
        allocs += report["allocs"];
        assert_eq!(report["errors"], 0, "a churner's call failed: {report:?}");
        let _ = churner.finish();
    }
    assert!(allocs > 100, "too little churn to test anything: {allocs} allocations");
    let exact = charged.iter().filter(|&&bytes| bytes == CHURN_CONTEXT).count();
    assert_eq!(
        exact,
        20,
        "{exact} of 20 contexts charged exactly {CHURN_CONTEXT} bytes while 3 processes churned; charged (MiB): {:?}",
        charged.iter().map(|bytes| bytes / MIB).collect::<Vec<_>>()
    );
}

/// Issue 16: a process killed in the middle of a data call (inside a slow cuMemAlloc here) must
/// not leave its in-flight mark behind. It used to stay in a region-wide count, and every later
/// context measurement on the device waited twice its 50 ms for a quiet moment that never came.
#[test]
fn a_process_killed_inside_an_allocation_does_not_slow_later_context_measurements() {
    let _heavy = one_at_a_time();
    let dir = ScratchDir::new("memory-killed-mid-alloc");
    let env = |run: Run| {
        setup(run, &dir)
            .env("FAKE_CUDA_MEMORY", "8g")
            .env("FAKE_NVML_NO_PROCESSES", "1")
            .env("CUDA_DEVICE_MEMORY_LIMIT", "4g")
    };
    // Keeps the region in use (a region nobody uses is rebuilt at the next start, marks and all).
    let mut bystander = env(Run::new(&program("mem_ops")).hooked()).spawn(Duration::from_secs(60));
    assert_eq!(bystander.ask("init"), "init 0");
    let mut victim = env(Run::new(&program("mem_ops")).hooked())
        .env("FAKE_CUDA_ALLOC_US", "10000000")
        .spawn(Duration::from_secs(60));
    assert_eq!(victim.ask("init"), "init 0");
    assert_eq!(victim.ask("ctx 0"), "ctx 0");
    victim.send(&format!("alloc {MIB}"));
    // The allocation takes 10 s in the driver: the victim is inside it.
    std::thread::sleep(Duration::from_millis(500));
    victim.kill();

    let mut measurer = env(Run::new(&program("mem_ops")).hooked()).spawn(Duration::from_secs(60));
    assert_eq!(measurer.ask("init"), "init 0");
    let pid = measurer.pid();
    let mut took = Vec::new();
    for _ in 0..10 {
        let started = Instant::now();
        assert_eq!(measurer.ask("ctx 0"), "ctx 0");
        took.push(started.elapsed());
        assert_eq!(usage(&snapshot(&dir.region()), pid, 0).context, CONTEXT);
        assert_eq!(measurer.ask("reset 0"), "reset 0");
    }
    measurer.send("quit");
    let _ = measurer.finish();
    bystander.send("quit");
    let _ = bystander.finish();
    took.sort();
    eprintln!("context creations after the kill: {took:?}");
    assert!(
        took[5] < Duration::from_millis(50),
        "context creations took {took:?}: each waited for the dead process's in-flight mark"
    );
}

/// VMM memory lives until its handle's last reference is released and its last mapping is
/// unmapped, in either order (the CUDA samples release the handle right after mapping it; NCCL
/// retains a handle from a pointer and releases it while the memory is in use): it stays charged
/// as long as the device holds it, so neither order lets memory past the limit.
#[test]
fn vmm_memory_released_while_mapped_stays_charged_until_unmapped() {
    let dir = ScratchDir::new("memory-vmm-mapped");
    let mut session = capture_session(&dir);
    let created = session.ask(&format!("vmm {}", 600 * MIB));
    assert_eq!(status(&created), CUDA_SUCCESS, "{created}");
    let mapped = session.ask(&format!("vmmmap {}", number(&created, 2)));
    assert_eq!(status(&mapped), CUDA_SUCCESS, "{mapped}");
    assert_eq!(
        session.ask(&format!("vmmrelease {}", number(&created, 2))),
        "vmmrelease 0"
    );
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT + 600 * MIB,
        "the memory is still mapped, so still on the device"
    );
    let over = session.ask(&format!("vmm {}", 600 * MIB));
    assert_eq!(status(&over), CUDA_ERROR_OUT_OF_MEMORY, "past the 1 GiB limit: {over}");
    assert_eq!(session.ask(&format!("vmmunmap {}", number(&mapped, 2))), "vmmunmap 0");
    assert_eq!(device_used(&snapshot(&dir.region()), 0), CONTEXT, "unmapped: freed");
    assert_eq!(device_used(&snapshot(&dir.region()), 0), dir.truth().device(0).used());
    let again = session.ask(&format!("vmm {}", 600 * MIB));
    assert_eq!(status(&again), CUDA_SUCCESS, "{again}");
}

#[test]
fn a_retained_vmm_handle_released_keeps_the_memorys_charge_until_its_last_reference_goes() {
    let dir = ScratchDir::new("memory-vmm-retain");
    let mut session = capture_session(&dir);
    let created = session.ask(&format!("vmm {}", 600 * MIB));
    assert_eq!(status(&created), CUDA_SUCCESS, "{created}");
    let handle = number(&created, 2);
    let mapped = session.ask(&format!("vmmmap {handle}"));
    assert_eq!(status(&mapped), CUDA_SUCCESS, "{mapped}");
    let retained = session.ask(&format!("vmmretain {}", number(&mapped, 2) + MIB));
    assert_eq!(retained, format!("vmmretain 0 {handle}"));
    assert_eq!(session.ask(&format!("vmmrelease {handle}")), "vmmrelease 0");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT + 600 * MIB,
        "the create's reference is still held"
    );
    let over = session.ask(&format!("vmm {}", 600 * MIB));
    assert_eq!(status(&over), CUDA_ERROR_OUT_OF_MEMORY, "past the 1 GiB limit: {over}");
    assert_eq!(session.ask(&format!("vmmunmap {}", number(&mapped, 2))), "vmmunmap 0");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT + 600 * MIB,
        "unmapped, but a reference is still held"
    );
    assert_eq!(session.ask(&format!("vmmrelease {handle}")), "vmmrelease 0");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT,
        "the last reference went"
    );
    assert_eq!(device_used(&snapshot(&dir.region()), 0), dir.truth().device(0).used());
    assert_eq!(
        status(&session.ask(&format!("vmmrelease {handle}"))),
        CUDA_ERROR_INVALID_VALUE,
        "a handle released once too often is the driver's error"
    );
}

/// Memory whose handle was released while mapped can be given a handle again (a retain from one
/// of its mappings) and mapped a second time, as a growing VMM pool moves its memory to a larger
/// range: it stays charged until its last mapping goes.
#[test]
fn vmm_memory_retained_again_after_its_release_and_mapped_twice_stays_charged_until_the_last_unmap() {
    let dir = ScratchDir::new("memory-vmm-remap");
    let mut session = capture_session(&dir);
    let created = session.ask(&format!("vmm {}", 600 * MIB));
    assert_eq!(status(&created), CUDA_SUCCESS, "{created}");
    let handle = number(&created, 2);
    let first = session.ask(&format!("vmmmap {handle}"));
    assert_eq!(status(&first), CUDA_SUCCESS, "{first}");
    assert_eq!(session.ask(&format!("vmmrelease {handle}")), "vmmrelease 0");
    let retained = session.ask(&format!("vmmretain {}", number(&first, 2)));
    assert_eq!(status(&retained), CUDA_SUCCESS, "{retained}");
    let handle = number(&retained, 2);
    let second = session.ask(&format!("vmmmap {handle}"));
    assert_eq!(status(&second), CUDA_SUCCESS, "{second}");
    assert_eq!(session.ask(&format!("vmmrelease {handle}")), "vmmrelease 0");
    assert_eq!(session.ask(&format!("vmmunmap {}", number(&first, 2))), "vmmunmap 0");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT + 600 * MIB,
        "still mapped at its second range"
    );
    let over = session.ask(&format!("vmm {}", 600 * MIB));
    assert_eq!(status(&over), CUDA_ERROR_OUT_OF_MEMORY, "past the 1 GiB limit: {over}");
    assert_eq!(session.ask(&format!("vmmunmap {}", number(&second, 2))), "vmmunmap 0");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT,
        "the last mapping went"
    );
    assert_eq!(device_used(&snapshot(&dir.region()), 0), dir.truth().device(0).used());
}

/// Two threads free each VMM allocation at once (a release racing the unmap, or a retained
/// reference's release racing the create's, or an unmap racing a map of another allocation at the
/// address it frees, which the fake's unmap lets in before it returns): whichever call comes last,
/// the charge goes with the memory, so after three thousand rounds the region holds the context
/// alone, as the device does.
#[test]
fn vmm_memory_freed_by_two_threads_at_once_leaves_no_charge_behind() {
    let dir = ScratchDir::new("memory-vmm-race");
    let mut session = setup(Run::new(&program("vmm_race")).hooked(), &dir)
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("FAKE_CUDA_UNMAP_RETURN_US", "200")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .args(["3000"])
        .spawn(Duration::from_secs(120));
    assert_eq!(session.read_line().unwrap_or_default(), "done rounds=3000 errors=0");
    assert_eq!(
        device_used(&snapshot(&dir.region()), 0),
        CONTEXT,
        "the region after the rounds"
    );
    assert_eq!(dir.truth().device(0).used(), CONTEXT, "the device after the rounds");
    session.send("quit");
}
