//! The Vulkan layer through the real Vulkan loader: `tests/programs/vk_mem.c` runs against the
//! fake Vulkan driver (`tests/fake-icd`, the fake CUDA driver's devices with simulated heaps) and
//! the fake CUDA driver, with the shipped manifest (its library path pointed at the built
//! `libvgpu.so`) in an implicit layer folder, and `HAMI_VULKAN_ENABLE=1`. Both fakes charge one
//! ground-truth file, the oracle for "CUDA and Vulkan together never exceeded the limit".
//!
//! The loader and its headers are Debian's `libvulkan1` and `libvulkan-dev`, unpacked into
//! `.cuda-headers/vulkan` by `scripts/fetch-headers.sh` (no package manager, no root); the test
//! program runs that loader through its run path.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use vgpu_integration::{Run, ScratchDir, Session, c_program_linked, fake_icd_library, hook_library, workspace_root};
use vgpu_region::{MemoryUsage, SLOT_LIVE, Snapshot, read_snapshot};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// What a CUDA context takes on the fake driver (not its default, as in the memory tests).
const CONTEXT: u64 = 48 * MIB;
/// The fake's physical memory per device (its default).
const PHYSICAL: u64 = 16 * GIB;
/// The fake's host heap.
const HOST_HEAP: u64 = 64 * GIB;

const VK_SUCCESS: i32 = 0;
const VK_ERROR_OUT_OF_DEVICE_MEMORY: i32 = -2;
const VK_ERROR_INITIALIZATION_FAILED: i32 = -3;
const CUDA_SUCCESS: i32 = 0;
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

fn program() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    static COMPILING: Mutex<()> = Mutex::new(());
    let _serial = COMPILING.lock().unwrap_or_else(PoisonError::into_inner);
    BUILT
        .get_or_init(|| {
            let arguments = vgpu_integration::vulkan_link_args();
            c_program_linked("vk_mem", &arguments.iter().map(String::as_str).collect::<Vec<_>>())
        })
        .clone()
}

/// The shipped manifest, parsed.
fn shipped_manifest() -> serde_json::Value {
    let path = workspace_root().join("vulkan-layer").join("hami.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// One test's folder: the region, the truth, the driver manifest and the implicit layer folder
/// (with the shipped manifest naming the built library).
struct TestDir(ScratchDir);

/// The region, the truth and the rest of the folder, as every test's.
impl std::ops::Deref for TestDir {
    type Target = ScratchDir;

    fn deref(&self) -> &ScratchDir {
        &self.0
    }
}

impl TestDir {
    fn new(name: &str) -> TestDir {
        let dir = TestDir(ScratchDir::new(&format!("vulkan-{name}")));
        let icd = serde_json::json!({
            "file_format_version": "1.0.0",
            "ICD": {"library_path": fake_icd_library(), "api_version": "1.3.239"}
        });
        std::fs::write(dir.icd(), icd.to_string()).expect("write the driver manifest");
        let layers = dir.config().join("vulkan").join("implicit_layer.d");
        std::fs::create_dir_all(&layers).expect("create the implicit layer folder");
        let mut manifest = shipped_manifest();
        manifest["layer"]["library_path"] = serde_json::json!(hook_library());
        std::fs::write(layers.join("hami.json"), manifest.to_string()).expect("write the layer manifest");
        std::fs::create_dir_all(dir.none()).expect("create an empty folder");
        dir
    }

    fn icd(&self) -> PathBuf {
        self.0.join("fake-icd.json")
    }

    fn config(&self) -> PathBuf {
        self.0.join("config")
    }

    fn none(&self) -> PathBuf {
        self.0.join("none")
    }

    /// The program with the fake drivers, this folder's files, the layer enabled and nothing
    /// inherited that could change devices, limits or layers. Without the hook preloaded: the
    /// loader loads `libvgpu.so` as a layer by itself.
    fn run(&self) -> Run {
        let mut run = Run::new(&program());
        for variable in [
            "CUDA_VISIBLE_DEVICES",
            "HAMI_VULKAN_DISABLE",
            "VK_INSTANCE_LAYERS",
            "VK_LOADER_LAYERS_ENABLE",
            "VK_LOADER_LAYERS_DISABLE",
            "VK_LAYER_PATH",
            "VK_ADD_LAYER_PATH",
            "VK_LOADER_DEBUG",
            "FAKE_VULKAN_VENDOR",
        ] {
            run = run.env_remove(variable);
        }
        run.env("VK_ICD_FILENAMES", self.icd())
            .env("VK_DRIVER_FILES", self.icd())
            .env("XDG_CONFIG_HOME", self.config())
            .env("XDG_CONFIG_DIRS", self.none())
            .env("XDG_DATA_HOME", self.none())
            .env("XDG_DATA_DIRS", self.none())
            .env("HAMI_VULKAN_ENABLE", "1")
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", self.region())
            .env("FAKE_CUDA_TRUTH", self.truth_path())
            .env("FAKE_CUDA_CONTEXT_BYTES", CONTEXT.to_string())
    }

    /// With a 1 GiB limit on every device.
    fn limited(&self) -> Run {
        self.run().env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
    }

    fn snapshot(&self) -> Snapshot {
        let path = self.region();
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read the region {}: {e}", path.display()));
        read_snapshot(&bytes).unwrap_or_else(|e| panic!("decode the region {}: {e}", path.display()))
    }

    /// What the live slots of `pid` hold on a physical device, and how many slots it has.
    fn usage(&self, pid: u32, physical: usize) -> (MemoryUsage, usize) {
        let snapshot = self.snapshot();
        let Some(device) = region_device(&snapshot, physical) else {
            return (MemoryUsage::default(), 0);
        };
        let slots: Vec<MemoryUsage> = snapshot
            .processes
            .iter()
            .filter(|p| p.pid == pid as i32 && p.status == SLOT_LIVE)
            .map(|p| p.memory[device])
            .collect();
        (slots.first().copied().unwrap_or_default(), slots.len())
    }

    /// Every process's charges on a physical device, by the region.
    fn device_used(&self, physical: usize) -> u64 {
        let snapshot = self.snapshot();
        region_device(&snapshot, physical).map_or(0, |device| snapshot.device_used(device))
    }
}

fn region_device(snapshot: &Snapshot, physical: usize) -> Option<usize> {
    let uuid = format!("GPU-00000000-0000-0000-0000-{physical:012x}");
    snapshot.uuids.iter().position(|u| *u == uuid)
}

fn fields(answer: &str) -> Vec<String> {
    answer.split_whitespace().map(str::to_string).collect()
}

/// The status (first number) of an answer.
fn status(answer: &str) -> i32 {
    fields(answer)
        .get(1)
        .and_then(|field| field.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"))
}

/// The `index`-th field of an answer (0 is the command) as a number.
fn number(answer: &str, index: usize) -> u64 {
    fields(answer)
        .get(index)
        .and_then(|field| field.parse().ok())
        .unwrap_or_else(|| panic!("no number {index} in {answer:?}"))
}

fn start(run: Run) -> Session {
    run.spawn(std::time::Duration::from_secs(60))
}

/// Asks, requires a success status, and returns the answer.
fn ok(session: &mut Session, command: &str) -> String {
    let answer = session.ask(command);
    assert_eq!(status(&answer), 0, "{command} -> {answer}");
    answer
}

/// Creates a Vulkan 1.1 instance and a device on physical device `phys`; returns the device's
/// index.
fn open_device(session: &mut Session, phys: usize) -> u64 {
    ok(session, "instance 1");
    number(&ok(session, &format!("device {phys}")), 2)
}

fn stderr_of(session: &mut Session) -> String {
    String::from_utf8_lossy(&session.finish().stderr).into_owned()
}

#[test]
fn the_shipped_manifest_is_hamis_layer_behind_hamis_switch() {
    let manifest = shipped_manifest();
    let layer = &manifest["layer"];
    assert_eq!(layer["name"], "VK_LAYER_HAMI_vgpu");
    assert_eq!(layer["enable_environment"]["HAMI_VULKAN_ENABLE"], "1");
    assert_eq!(layer["disable_environment"]["HAMI_VULKAN_DISABLE"], "1");
    // The library HAMi mounts into every container: the layer is libvgpu.so itself.
    assert_eq!(layer["library_path"], "/usr/local/vgpu/libvgpu.so");
    assert_eq!(layer["type"], "GLOBAL");
}

#[test]
fn device_local_allocations_are_charged_refused_over_the_limit_and_released() {
    let dir = TestDir::new("limit");
    let mut session = start(dir.limited());
    let pid = session.pid();
    ok(&mut session, "instance 1");
    // The device-local heap shows the limit; the host heap is untouched.
    assert_eq!(session.ask("heaps 0"), format!("heaps 2 {GIB} {HOST_HEAP}"));
    let device = number(&ok(&mut session, "device 0"), 2);
    let first = number(&ok(&mut session, &format!("vkalloc {device} device {}", 512 * MIB)), 2);
    assert_eq!(
        dir.usage(pid, 0).0.data,
        512 * MIB,
        "charged as data in this process's slot"
    );
    // One byte over what is left: refused before the driver is asked.
    let refused = session.ask(&format!("vkalloc {device} device {}", 512 * MIB + 1));
    assert_eq!(status(&refused), VK_ERROR_OUT_OF_DEVICE_MEMORY, "{refused}");
    assert_eq!(
        dir.truth().device(0).refusals(),
        0,
        "the driver never saw the refused allocation"
    );
    // Host memory is not device memory.
    ok(&mut session, &format!("vkalloc {device} host {}", 2 * GIB));
    // A device-local, host-visible type (a BAR) is device memory: exactly the rest fits.
    let bar = number(&ok(&mut session, &format!("vkalloc {device} bar {}", 512 * MIB)), 2);
    assert_eq!(dir.device_used(0), GIB);
    assert_eq!(dir.truth().device(0).used(), GIB);
    ok(&mut session, &format!("vkfree {device} {first}"));
    assert_eq!(dir.device_used(0), 512 * MIB);
    ok(&mut session, &format!("vkfree {device} {bar}"));
    assert_eq!(dir.usage(pid, 0).0, MemoryUsage::default());
    assert_eq!(dir.truth().device(0).used(), 0);
    assert!(dir.truth().device(0).peak() <= GIB);
    // Without CUDA in the process, the layer started the accounting itself: one slot.
    assert_eq!(dir.usage(pid, 0).1, 1);
}

#[test]
fn destroying_a_device_releases_what_it_still_holds() {
    let dir = TestDir::new("destroy");
    let mut session = start(dir.limited());
    let pid = session.pid();
    let device = open_device(&mut session, 0);
    for _ in 0..2 {
        ok(&mut session, &format!("vkalloc {device} device {}", 400 * MIB));
    }
    assert_eq!(dir.usage(pid, 0).0.data, 800 * MIB);
    ok(&mut session, &format!("destroy {device}"));
    assert_eq!(dir.usage(pid, 0).0.data, 0);
    assert_eq!(dir.truth().device(0).used(), 0);
    // The room is back.
    let again = number(&ok(&mut session, "device 0"), 2);
    ok(&mut session, &format!("vkalloc {again} device {GIB}"));
}

#[test]
fn two_processes_share_one_limit_across_vulkan_and_cuda() {
    let dir = TestDir::new("two");
    let mut vulkan = start(dir.limited());
    let device = open_device(&mut vulkan, 0);
    ok(&mut vulkan, &format!("vkalloc {device} device {}", 600 * MIB));
    // A second Vulkan process sees what is left in its budget and gets no more.
    let mut other = start(dir.limited());
    let other_device = open_device(&mut other, 0);
    let budget = other.ask("budget 0");
    assert_eq!(budget, format!("budget 0 {GIB} {} 0", 424 * MIB));
    let refused = other.ask(&format!("vkalloc {other_device} device {}", 425 * MIB));
    assert_eq!(status(&refused), VK_ERROR_OUT_OF_DEVICE_MEMORY);
    ok(&mut other, &format!("vkalloc {other_device} device {}", 200 * MIB));
    // A CUDA process under the hook is held to the same limit: its context (48 MiB) fits, 200
    // MiB more does not.
    let mut cuda = start(dir.limited().env("LD_PRELOAD", hook_library()));
    ok(&mut cuda, "init");
    ok(&mut cuda, "ctx 0");
    let refused = cuda.ask(&format!("alloc {}", 200 * MIB));
    assert_eq!(status(&refused), CUDA_ERROR_OUT_OF_MEMORY, "{refused}");
    ok(&mut cuda, &format!("alloc {}", 100 * MIB));
    assert_eq!(dir.device_used(0), 600 * MIB + 200 * MIB + CONTEXT + 100 * MIB);
    assert_eq!(dir.truth().device(0).used(), dir.device_used(0));
    // A process that ends releases its Vulkan memory like its CUDA memory.
    vulkan.send("quit");
    vulkan.finish();
    assert_eq!(dir.device_used(0), 200 * MIB + CONTEXT + 100 * MIB);
}

#[test]
fn the_memory_budget_extension_reports_what_the_container_has_left() {
    let dir = TestDir::new("budget");
    let mut session = start(dir.limited());
    let device = open_device(&mut session, 0);
    assert_eq!(session.ask("budget 0"), format!("budget 0 {GIB} {GIB} 0"));
    ok(&mut session, &format!("vkalloc {device} device {}", 256 * MIB));
    // Usage is the process's own; the budget leaves the limit's rest on top of it.
    assert_eq!(session.ask("budget 0"), format!("budget 0 {GIB} {GIB} {}", 256 * MIB));
    // Another process's charge shrinks the budget, not the usage.
    let mut other = start(dir.limited());
    let other_device = open_device(&mut other, 0);
    ok(&mut other, &format!("vkalloc {other_device} device {}", 512 * MIB));
    assert_eq!(
        session.ask("budget 0"),
        format!("budget 0 {GIB} {} {}", GIB - 512 * MIB, 256 * MIB)
    );
    // Without a limit the driver's own figures stand.
    let unlimited = TestDir::new("budget-unlimited");
    let mut session = start(unlimited.run());
    open_device(&mut session, 0);
    assert_eq!(session.ask("budget 0"), format!("budget 0 {PHYSICAL} {PHYSICAL} 0"));
}

#[test]
fn interop_memory_is_charged_once_and_its_mapped_buffer_freed_by_the_driver() {
    let dir = TestDir::new("interop");
    let mut session = start(dir.limited().env("LD_PRELOAD", hook_library()));
    let pid = session.pid();
    ok(&mut session, "init");
    ok(&mut session, "ctx 0");
    let device = open_device(&mut session, 0);
    let memory = number(&ok(&mut session, &format!("vkalloc {device} export {}", 256 * MIB)), 2);
    let imported = ok(&mut session, &format!("cuimport {device} {memory} {}", 256 * MIB));
    let (external, pointer) = (number(&imported, 2), number(&imported, 3));
    // Importing into CUDA and mapping a buffer add nothing: the Vulkan allocation is the charge.
    let (usage, slots) = dir.usage(pid, 0);
    assert_eq!(
        (usage.data, usage.context, slots),
        (256 * MIB, CONTEXT, 1),
        "one slot for CUDA and Vulkan"
    );
    // Imported back into Vulkan: nothing either.
    let again = number(
        &ok(&mut session, &format!("vkimport {device} {memory} {}", 256 * MIB)),
        2,
    );
    assert_eq!(dir.usage(pid, 0).0.data, 256 * MIB);
    assert_eq!(dir.truth().device(0).used(), 256 * MIB + CONTEXT);
    // cuMemFree of the mapped buffer reaches the driver (which frees it) and releases nothing.
    assert_eq!(status(&session.ask(&format!("free {pointer}"))), CUDA_SUCCESS);
    assert_eq!(status(&session.ask(&format!("cudestroy {external}"))), CUDA_SUCCESS);
    ok(&mut session, &format!("vkfree {device} {again}"));
    assert_eq!(dir.usage(pid, 0).0.data, 256 * MIB);
    ok(&mut session, &format!("vkfree {device} {memory}"));
    assert_eq!(dir.usage(pid, 0).0.data, 0);
    // cuMemGetInfo sees the Vulkan memory on the virtual device too.
    let memory = number(&ok(&mut session, &format!("vkalloc {device} device {}", 512 * MIB)), 2);
    let info = ok(&mut session, "cuinfo");
    assert_eq!((number(&info, 2), number(&info, 3)), (GIB - 512 * MIB - CONTEXT, GIB));
    ok(&mut session, &format!("vkfree {device} {memory}"));
}

#[test]
fn vulkan_and_cuda_in_one_process_never_exceed_the_limit_together() {
    let dir = TestDir::new("together");
    let mut session = start(dir.limited().env("LD_PRELOAD", hook_library()));
    let pid = session.pid();
    // Vulkan first: the layer starts the accounting, cuInit later joins it.
    let device = open_device(&mut session, 0);
    ok(&mut session, &format!("vkalloc {device} device {}", 600 * MIB));
    ok(&mut session, "init");
    ok(&mut session, "ctx 0");
    let refused = session.ask(&format!("alloc {}", 400 * MIB));
    assert_eq!(status(&refused), CUDA_ERROR_OUT_OF_MEMORY, "{refused}");
    let cuda = number(&ok(&mut session, &format!("alloc {}", 300 * MIB)), 2);
    let refused = session.ask(&format!("vkalloc {device} device {}", 100 * MIB));
    assert_eq!(status(&refused), VK_ERROR_OUT_OF_DEVICE_MEMORY, "{refused}");
    ok(&mut session, &format!("free {cuda}"));
    ok(&mut session, &format!("vkalloc {device} device {}", 100 * MIB));
    let (usage, slots) = dir.usage(pid, 0);
    assert_eq!((usage.data, usage.context, slots), (700 * MIB, CONTEXT, 1));
    assert!(
        dir.truth().device(0).peak() <= GIB,
        "the driver never held more than the limit"
    );
}

#[test]
fn devices_are_matched_by_uuid_whatever_cuda_visible_devices_says() {
    let dir = TestDir::new("uuid");
    // CUDA ordinal 0 is physical device 1 and ordinal 1 is physical 0; Vulkan ignores the
    // variable and lists them in physical order.
    let run = dir
        .run()
        .env("FAKE_CUDA_DEVICES", "2")
        .env("CUDA_VISIBLE_DEVICES", "1,0")
        .env("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")
        .env("CUDA_DEVICE_MEMORY_LIMIT_1", "2g");
    let mut session = start(run);
    let pid = session.pid();
    assert_eq!(status(&session.ask("instance 1")), VK_SUCCESS);
    assert_eq!(session.ask("uuid 1"), format!("uuid {}01", "0".repeat(30)));
    assert_eq!(session.ask("heaps 0"), format!("heaps 2 {} {HOST_HEAP}", 2 * GIB));
    assert_eq!(session.ask("heaps 1"), format!("heaps 2 {GIB} {HOST_HEAP}"));
    let device = number(&ok(&mut session, "device 1"), 2);
    ok(&mut session, &format!("vkalloc {device} device {}", 300 * MIB));
    assert_eq!(dir.usage(pid, 1).0.data, 300 * MIB);
    assert_eq!(dir.usage(pid, 0).0.data, 0);
}

#[test]
fn a_malformed_limit_fails_instance_creation_with_one_line() {
    let dir = TestDir::new("malformed");
    let mut session = start(dir.run().env("CUDA_DEVICE_MEMORY_LIMIT", "1q"));
    assert_eq!(status(&session.ask("instance 1")), VK_ERROR_INITIALIZATION_FAILED);
    session.send("quit");
    let stderr = stderr_of(&mut session);
    let lines: Vec<&str> = stderr.lines().filter(|line| line.contains("ERROR")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("CUDA_DEVICE_MEMORY_LIMIT") && lines[0].contains("Vulkan instance"),
        "{stderr}"
    );
}

#[test]
fn an_unusable_region_fails_closed() {
    let dir = TestDir::new("closed");
    let run = dir
        .limited()
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.0.join("missing").join("region"));
    let mut session = start(run);
    let device = open_device(&mut session, 0);
    let refused = session.ask(&format!("vkalloc {device} device {MIB}"));
    assert_eq!(status(&refused), VK_ERROR_OUT_OF_DEVICE_MEMORY, "{refused}");
    // Host memory is never refused.
    ok(&mut session, &format!("vkalloc {device} host {MIB}"));
    assert_eq!(dir.truth().device(0).used(), 0);
    session.send("quit");
    assert!(stderr_of(&mut session).contains("every Vulkan allocation on a device-local heap is refused"));
}

#[test]
fn the_layer_stays_out_unless_enabled() {
    for (variable, value) in [("HAMI_VULKAN_ENABLE", None), ("HAMI_VULKAN_DISABLE", Some("1"))] {
        let dir = TestDir::new("disabled");
        let run = match value {
            None => dir.limited().env_remove(variable),
            Some(value) => dir.limited().env(variable, value),
        };
        let mut session = start(run);
        let device = open_device(&mut session, 0);
        assert_eq!(
            session.ask("heaps 0"),
            format!("heaps 2 {PHYSICAL} {HOST_HEAP}"),
            "{variable}"
        );
        ok(&mut session, &format!("vkalloc {device} device {}", 2 * GIB));
        session.send("quit");
        session.finish();
        assert!(!Path::new(&dir.region()).exists(), "{variable}: no region was opened");
    }
}

#[test]
fn another_vendors_device_is_neither_charged_nor_shown_limited() {
    let dir = TestDir::new("vendor");
    let mut session = start(dir.limited().env("FAKE_VULKAN_VENDOR", "0x1002"));
    let device = open_device(&mut session, 0);
    assert_eq!(session.ask("heaps 0"), format!("heaps 2 {PHYSICAL} {HOST_HEAP}"));
    ok(&mut session, &format!("vkalloc {device} device {}", 2 * GIB));
    session.send("quit");
    let stderr = stderr_of(&mut session);
    assert!(
        !dir.region().exists(),
        "CUDA was not initialised for it, no region opened"
    );
    assert!(stderr.is_empty(), "{stderr}");
}
