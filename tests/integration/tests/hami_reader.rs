//! HAMi's monitor reading the regions libvgpu.so writes, against the fake driver: a reader written
//! from HAMi's own definitions, not from this project's region crate (which it must not trust to
//! check itself), reads a container's region while its processes run and after they exit, and
//! checks every field HAMi reads.
//!
//! The reader follows HAMi at commit 4707fb02 (github.com/Project-HAMi/HAMi):
//! `pkg/monitor/nvidia/cudevshr.go` (`loadCache`: which layout a file is read with) and
//! `pkg/monitor/nvidia/v1/spec.go` (the Go struct `sharedRegionT`, its accessors, and the C
//! offsets its `spec_test.go` pins on linux/amd64); `cmd/vGPUmonitor/metrics.go` says which
//! accessors the exported metrics use, `cmd/vGPUmonitor/feedback.go` which fields it writes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vgpu_integration::{Run, ScratchDir, Session, compiled_program, truth};

/// HAMi's view of a region file, byte offsets from its Go struct (linux/amd64).
mod hami {
    /// `SharedRegionMagicFlag`.
    pub const MAGIC: i32 = 19_920_718;
    /// `v1.MinSize()`: `unsafe.Sizeof(sharedRegionT{})`.
    pub const V1_SIZE: usize = 2_008_952;
    /// `v0.MinSize()`: the older struct (no version fields, 1168-byte slots without `unused`):
    /// 4 + 4 + 4 + 32 (+4 padding) + 8 + 16 x 96 + 2 x 16 x 8 + 1024 x 1168 + 4 x 4.
    pub const V0_SIZE: usize = 1_197_896;
    /// `headerT`: initializedFlag, majorVersion, minorVersion.
    const HEADER_SIZE: usize = 12;
    const MAJOR_VERSION: usize = 4;
    const NUM: usize = 56;
    const UUIDS: usize = 64;
    const UUID_BYTES: usize = 96;
    const LIMIT: usize = 1600;
    const SM_LIMIT: usize = 1728;
    const PROCS: usize = 1856;
    const SLOT_SIZE: usize = 1960;
    const SLOTS: usize = 1024;
    const PROCNUM: usize = 2_008_896;
    /// Written by HAMi's monitor (`cmd/vGPUmonitor/feedback.go`).
    pub const UTILIZATION_SWITCH: usize = 2_008_900;
    pub const RECENT_KERNEL: usize = 2_008_904;
    const PRIORITY: usize = 2_008_908;
    const LAST_KERNEL_TIME: usize = 2_008_912;
    /// In a slot: `used [16]deviceMemory` (five u64 and `unused [3]uint64`: 64 bytes each),
    /// `deviceUtil [16]deviceUtilization` (dec, enc, sm, `unused [3]uint64`: 48 bytes each), then
    /// `status int32`.
    const SLOT_USED: usize = 8;
    const DEVICE_MEMORY_SIZE: usize = 64;
    const SLOT_DEVICE_UTIL: usize = 1160;
    const DEVICE_UTIL_SIZE: usize = 48;
    const SM_UTIL: usize = 16;
    const SLOT_STATUS: usize = 1928;
    pub const MAX_DEVICES: usize = 16;

    /// The fields of `deviceMemory`, by offset.
    #[derive(Clone, Copy, Debug)]
    pub enum Memory {
        Context = 0,
        Module = 8,
        Buffer = 16,
        Offset = 24,
        Total = 32,
    }

    /// Which struct `loadCache` casts the file to.
    #[derive(Debug, PartialEq, Eq)]
    pub enum Layout {
        V0,
        V1,
    }

    /// A region as HAMi's `v1.Spec` reads it.
    pub struct Spec {
        bytes: Vec<u8>,
    }

    /// `loadCache`'s checks, in its order: at least a header, the magic, then v0 for a size in
    /// [v0, v1), v1 for major version 1 and a size of at least v1, anything else an error.
    pub fn load(bytes: Vec<u8>) -> Result<(Layout, Spec), String> {
        if bytes.len() < HEADER_SIZE {
            return Err(format!("cache file size {} too small", bytes.len()));
        }
        let spec = Spec { bytes };
        if spec.i32_at(0) != MAGIC {
            return Err("cache file magic flag not matched".into());
        }
        let size = spec.bytes.len();
        if (V0_SIZE..V1_SIZE).contains(&size) {
            Ok((Layout::V0, spec))
        } else if spec.i32_at(MAJOR_VERSION) == 1 && size >= V1_SIZE {
            Ok((Layout::V1, spec))
        } else {
            Err(format!(
                "unknown cache file size {size} version {}",
                spec.i32_at(MAJOR_VERSION)
            ))
        }
    }

    impl Spec {
        fn i32_at(&self, at: usize) -> i32 {
            i32::from_le_bytes(self.bytes[at..at + 4].try_into().expect("4 bytes"))
        }

        fn u64_at(&self, at: usize) -> u64 {
            u64::from_le_bytes(self.bytes[at..at + 8].try_into().expect("8 bytes"))
        }

        /// `DeviceNum`: `min(num, 16)`.
        pub fn device_num(&self) -> usize {
            self.u64_at(NUM).min(MAX_DEVICES as u64) as usize
        }

        /// `IsValidUUID`: the entry's first byte is not 0.
        pub fn is_valid_uuid(&self, index: usize) -> bool {
            self.bytes[UUIDS + index * UUID_BYTES] != 0
        }

        /// `DeviceUUID(i)[0:40]`, as the metrics label it.
        pub fn device_uuid(&self, index: usize) -> String {
            let at = UUIDS + index * UUID_BYTES;
            String::from_utf8_lossy(&self.bytes[at..at + 40]).into_owned()
        }

        /// `activeProcs`: `procs[0..procnum]`, procnum clamped to [0, 1024].
        fn active_procs(&self) -> impl Iterator<Item = usize> + '_ {
            let procnum = self.i32_at(PROCNUM).clamp(0, SLOTS as i32) as usize;
            (0..procnum).map(|slot| PROCS + slot * SLOT_SIZE)
        }

        /// The sums every `DeviceMemory*` accessor makes: over active slots whose status is not 0.
        pub fn device_memory(&self, index: usize, field: Memory) -> u64 {
            self.active_procs()
                .filter(|&slot| self.i32_at(slot + SLOT_STATUS) != 0)
                .map(|slot| self.u64_at(slot + SLOT_USED + index * DEVICE_MEMORY_SIZE + field as usize))
                .fold(0u64, u64::wrapping_add)
        }

        /// `DeviceSmUtil`: the same sum of `deviceUtil[i].smUtil`.
        pub fn device_sm_util(&self, index: usize) -> u64 {
            self.active_procs()
                .filter(|&slot| self.i32_at(slot + SLOT_STATUS) != 0)
                .map(|slot| self.u64_at(slot + SLOT_DEVICE_UTIL + index * DEVICE_UTIL_SIZE + SM_UTIL))
                .fold(0u64, u64::wrapping_add)
        }

        /// Slots HAMi counts: active, status not 0.
        pub fn counted_slots(&self) -> usize {
            self.active_procs()
                .filter(|&slot| self.i32_at(slot + SLOT_STATUS) != 0)
                .count()
        }

        /// `DeviceMemoryLimit`.
        pub fn device_memory_limit(&self, index: usize) -> u64 {
            self.u64_at(LIMIT + 8 * index)
        }

        /// `smLimit[i]`, which `SetDeviceSmLimit` writes.
        pub fn device_sm_limit(&self, index: usize) -> u64 {
            self.u64_at(SM_LIMIT + 8 * index)
        }

        /// `LastKernelTime`.
        pub fn last_kernel_time(&self) -> i64 {
            i64::from_le_bytes(
                self.bytes[LAST_KERNEL_TIME..LAST_KERNEL_TIME + 8]
                    .try_into()
                    .expect("8 bytes"),
            )
        }

        /// `GetPriority`.
        pub fn priority(&self) -> i32 {
            self.i32_at(PRIORITY)
        }

        /// `GetRecentKernel`.
        pub fn recent_kernel(&self) -> i32 {
            self.i32_at(RECENT_KERNEL)
        }

        /// `GetUtilizationSwitch`.
        pub fn utilization_switch(&self) -> i32 {
            self.i32_at(UTILIZATION_SWITCH)
        }
    }
}

use hami::Memory;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// What each context takes on the fake (`FAKE_CUDA_CONTEXT_BYTES`).
const CONTEXT: u64 = 48 * MIB;

fn program() -> PathBuf {
    compiled_program("monitor_launch")
}

/// Reads the region file the way HAMi's monitor does (the whole file), and decodes it with its
/// rule; it must be read as v1.
fn read(path: &Path) -> hami::Spec {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    match hami::load(bytes) {
        Ok((hami::Layout::V1, spec)) => spec,
        Ok((layout, _)) => panic!("HAMi reads {} as {layout:?}", path.display()),
        Err(error) => panic!("HAMi refuses {}: {error}", path.display()),
    }
}

/// A container process: the hook against the fake (two 16 GiB devices), the test's region,
/// limits of 2 GiB and 40% on every device, priority 3.
fn start(dir: &ScratchDir) -> Session {
    Run::new(&program())
        .hooked()
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.join("vgpu.cache"))
        .env("FAKE_CUDA_TRUTH", dir.truth_path())
        .env("FAKE_CUDA_DEVICES", "2")
        .env("FAKE_CUDA_MEMORY", "16g")
        .env("FAKE_CUDA_CONTEXT_BYTES", CONTEXT.to_string())
        .env("CUDA_DEVICE_MEMORY_LIMIT", "2g")
        .env("CUDA_DEVICE_SM_LIMIT", "40")
        .env("CUDA_TASK_PRIORITY", "3")
        .spawn(Duration::from_secs(60))
}

fn ok(session: &mut Session, line: &str) {
    let answer = session.ask(line);
    assert_eq!(answer.split_whitespace().nth(1), Some("0"), "{line}: {answer}");
}

/// A process holding `on_0` bytes (and a context) on device 0 and `on_1` on device 1.
fn holding(dir: &ScratchDir, on_0: u64, on_1: u64) -> Session {
    let mut session = start(dir);
    ok(&mut session, "init");
    if on_1 > 0 {
        ok(&mut session, "ctx 1");
        ok(&mut session, &format!("alloc {on_1}"));
    }
    ok(&mut session, "ctx 0");
    ok(&mut session, &format!("alloc {on_0}"));
    session
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_secs() as i64
}

/// What HAMi exports for one device, checked against what the test knows was allocated and
/// against the fake's ground truth of physical use.
fn check_device(spec: &hami::Spec, index: usize, contexts: u64, buffers: u64, truth: &truth::Truth, when: &str) {
    let (context, module, buffer, offset, total) = (
        spec.device_memory(index, Memory::Context),
        spec.device_memory(index, Memory::Module),
        spec.device_memory(index, Memory::Buffer),
        spec.device_memory(index, Memory::Offset),
        spec.device_memory(index, Memory::Total),
    );
    assert_eq!(
        (context, module, buffer, offset),
        (contexts * CONTEXT, 0, buffers, 0),
        "{when}: device {index} context, module, buffer, offset"
    );
    // HAMi's metrics label the rest of the total as the offset: total - context - module - buffer.
    assert_eq!(total, context + module + buffer, "{when}: device {index} total");
    assert_eq!(
        total,
        truth.device(index).used(),
        "{when}: device {index} against the driver"
    );
    assert_eq!(spec.device_memory_limit(index), 2 * GIB, "{when}: device {index} limit");
    assert_eq!(spec.device_sm_limit(index), 40, "{when}: device {index} sm limit");
}

#[test]
fn hamis_reader_sees_the_container_while_it_runs_and_nothing_after_it_exits() {
    let dir = ScratchDir::new("hami-reader");
    let region = dir.join("vgpu.cache");
    let truth_path = dir.truth_path();
    let started = unix_now();
    let mut first = holding(&dir, 256 * MIB, 64 * MIB);
    let mut second = holding(&dir, 100 * MIB, 0);
    let truth = truth::Truth::open(&truth_path).expect("open the ground truth");

    // While they run. A limited launch loop publishes the first process's utilisation.
    ok(&mut first, "load");
    let deadline = Instant::now() + Duration::from_secs(10);
    let running = loop {
        ok(&mut first, "launch 20");
        let spec = read(&region);
        if spec.device_sm_util(0) > 0 {
            break spec;
        }
        assert!(Instant::now() < deadline, "no utilisation reached HAMi's reader");
    };
    assert_eq!(running.device_num(), 2);
    for index in 0..2 {
        assert!(running.is_valid_uuid(index));
        assert_eq!(
            running.device_uuid(index),
            format!("GPU-00000000-0000-0000-0000-{index:012x}")
        );
    }
    assert!(!running.is_valid_uuid(2), "an unused device entry looks valid");
    check_device(&running, 0, 2, 356 * MIB, &truth, "running");
    check_device(&running, 1, 1, 64 * MIB, &truth, "running");
    assert!(running.device_sm_util(0) <= 100, "{}", running.device_sm_util(0));
    assert_eq!(running.device_sm_util(1), 0);
    assert_eq!(running.counted_slots(), 2);
    assert!(
        (started - 1..=unix_now()).contains(&running.last_kernel_time()),
        "last_kernel_time {} (started at {started})",
        running.last_kernel_time()
    );
    assert_eq!(running.priority(), 3);
    assert_eq!(running.recent_kernel(), 2, "limited launches mark the container active");
    assert_eq!(running.utilization_switch(), 1);

    // The second returns from main: its slot and memory are gone from HAMi's sums at once.
    second.send("quit");
    assert!(second.finish().status.success());
    // The fake driver's record of a process's memory goes when the test sees it is dead.
    truth.reclaim_dead();
    let one_left = read(&region);
    check_device(&one_left, 0, 1, 256 * MIB, &truth, "after the second's exit");
    check_device(&one_left, 1, 1, 64 * MIB, &truth, "after the second's exit");
    assert_eq!(one_left.counted_slots(), 1);

    // The first calls exit(): nothing is left to count, utilisation included.
    first.send("exit 0");
    assert!(first.finish().status.success());
    truth.reclaim_dead();
    let empty = read(&region);
    for index in 0..hami::MAX_DEVICES {
        for field in [
            Memory::Context,
            Memory::Module,
            Memory::Buffer,
            Memory::Offset,
            Memory::Total,
        ] {
            assert_eq!(
                empty.device_memory(index, field),
                0,
                "device {index} {field:?} after every exit"
            );
        }
        assert_eq!(
            empty.device_sm_util(index),
            0,
            "device {index} utilisation after every exit"
        );
    }
    assert_eq!(empty.counted_slots(), 0);
    // The file stays readable, with the container's devices and limits, for HAMi's next read.
    assert_eq!(empty.device_num(), 2);
    assert_eq!(empty.device_memory_limit(0), 2 * GIB);

    // A killed process is counted until the next process attaches, which reaps it.
    let killed = holding(&dir, 32 * MIB, 0);
    let keeper = holding(&dir, 16 * MIB, 0);
    killed.kill();
    let with_dead = read(&region);
    assert_eq!(with_dead.device_memory(0, Memory::Total), 2 * CONTEXT + 48 * MIB);
    let next = holding(&dir, 8 * MIB, 0);
    truth.reclaim_dead();
    let reaped = read(&region);
    check_device(&reaped, 0, 2, 24 * MIB, &truth, "after the reap");
    assert_eq!(reaped.counted_slots(), 2);
    drop(next);
    drop(keeper);
}

/// What HAMi's monitor writes into a region, at its Go struct's offsets.
fn hami_writes(region: &Path, offset: usize, value: i32) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(region)
        .expect("open the region as HAMi's monitor does");
    file.write_all_at(&value.to_ne_bytes(), offset as u64)
        .expect("write into the region");
}

fn vgpu_smi_json(region: &Path) -> serde_json::Value {
    let path = vgpu_integration::vgpu_smi();
    let output = vgpu_test_spawn::output_started(vgpu_integration::command(&path).args([
        "--region",
        &region.display().to_string(),
        "--json",
    ]))
    .expect("run vgpu-smi");
    assert!(output.status.success(), "{output:?}");
    serde_json::from_slice(&output.stdout).expect("vgpu-smi --json is JSON")
}

/// HAMi's reader and `vgpu-smi --json` (read just after it) agree on what HAMi reads. The
/// published share and the last launch's time may move between the two reads (every 250 ms, at
/// most once a second): they agree within that.
fn agree(spec: &hami::Spec, json: &serde_json::Value, when: &str) {
    let region = &json["regions"][0];
    let hami = &region["hami"];
    assert_eq!(hami["utilization_switch"], spec.utilization_switch(), "{when}");
    assert_eq!(hami["recent_kernel"], spec.recent_kernel(), "{when}");
    assert_eq!(hami["priority"], spec.priority(), "{when}");
    let shown_time = hami["last_kernel_time_unix_secs"].as_i64().expect("a time");
    assert!(
        (shown_time - spec.last_kernel_time()).abs() <= 2,
        "{when}: {shown_time} against {}",
        spec.last_kernel_time()
    );
    for index in 0..spec.device_num() {
        let device = &region["devices"][index];
        let sm = spec.device_sm_limit(index);
        let expected_sm = if sm == 0 { serde_json::Value::Null } else { sm.into() };
        assert_eq!(device["sm_limit_percent"], expected_sm, "{when}");
        assert_eq!(device["memory_limit_bytes"], spec.device_memory_limit(index), "{when}");
        let shown_util = device["sm_util_percent"].as_u64().expect("a share");
        assert!(
            shown_util.abs_diff(spec.device_sm_util(index)) <= 15,
            "{when}: device {index} sm_util {shown_util} against {}",
            spec.device_sm_util(index)
        );
    }
}

/// Through a container's life, HAMi's reader sees what HAMi expects, and agrees with
/// `vgpu-smi --json` at every step: the share published while HAMi has lifted the limit, HAMi's
/// writes and a limit changed while no process runs kept when the next process starts.
#[test]
fn hamis_view_holds_through_a_containers_life() {
    let dir = ScratchDir::new("hami-life");
    let region = dir.join("vgpu.cache");
    let mut first = holding(&dir, 16 * MIB, 0);
    ok(&mut first, "load");
    agree(&read(&region), &vgpu_smi_json(&region), "started");

    // HAMi's monitor lifts the limit (the container is alone on its GPU): the container runs
    // unheld and its share is still published.
    hami_writes(&region, hami::UTILIZATION_SWITCH, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let lifted = loop {
        ok(&mut first, "launch 50");
        let spec = read(&region);
        if spec.device_sm_util(0) > 40 {
            break spec;
        }
        assert!(
            Instant::now() < deadline,
            "no share published with the switch off (sm_util {})",
            spec.device_sm_util(0)
        );
    };
    assert_eq!(lifted.utilization_switch(), 0);
    agree(&lifted, &vgpu_smi_json(&region), "limit lifted");

    // A higher-priority container runs: HAMi holds this one. Then its last process exits.
    hami_writes(&region, hami::RECENT_KERNEL, -1);
    first.send("quit");
    assert!(first.finish().status.success());
    let idle = read(&region);
    assert_eq!(
        (idle.counted_slots(), idle.recent_kernel(), idle.utilization_switch()),
        (0, -1, 0)
    );
    agree(&idle, &vgpu_smi_json(&region), "idle");

    // An operator changes the limit while no process runs; the next process keeps it, and
    // HAMi's writes.
    let path = vgpu_integration::vgpu_smi();
    let set = vgpu_test_spawn::output_started(vgpu_integration::command(&path).args([
        "set",
        "--region",
        &region.display().to_string(),
        "--sm",
        "25",
    ]))
    .expect("run vgpu-smi set");
    assert!(set.status.success(), "{set:?}");
    let next = holding(&dir, 8 * MIB, 0);
    let restarted = read(&region);
    assert_eq!(
        (
            restarted.device_sm_limit(0),
            restarted.device_memory_limit(0),
            restarted.utilization_switch(),
            restarted.recent_kernel(),
            restarted.priority(),
            restarted.counted_slots()
        ),
        (25, 2 * GIB, 0, -1, 3, 1)
    );
    agree(&restarted, &vgpu_smi_json(&region), "next process");
    drop(next);
}
