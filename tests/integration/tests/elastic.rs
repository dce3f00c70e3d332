//! Elastic memory (`CUDA_OVERSUBSCRIBE=true`) against the fake driver: the device's physical memory
//! runs out before the container's limit because another process (no library: another container)
//! holds most of it. Within the limit, an allocation the device cannot back is served from host
//! memory, charged like any other, shown as host-backed in the region and by `vgpu-smi`, released
//! by frees (plain and stream-ordered) and by the process's exit, and moved back to the device
//! when it has room again; without the variable the device's refusal stands, and over the limit
//! nothing spills.
//!
//! The fake keeps managed memory on the device when it fits and in host memory otherwise, moves it
//! in pages of 2 MiB, and counts each process's host-resident bytes in its truth
//! (`tests/fake-driver/src/managed.rs`).

use std::process::Output;
use std::time::Duration;

use vgpu_integration::answer_status as status;
use vgpu_integration::{Run, ScratchDir, Session, command, compiled_program};
use vgpu_region::{ProcessSnapshot, SLOT_LIVE, Snapshot, read_snapshot};
use vgpu_test_spawn::output_started;

const MIB: u64 = 1 << 20;
/// What each context takes on the fake.
const CONTEXT: u64 = 48 * MIB;
/// The fake device's memory.
const DEVICE: u64 = 1024 * MIB;
/// Left free by the other container: the container's context and [`ON_DEVICE`] fit, not more.
const LEFT_FREE: u64 = 252 * MIB;
/// What the container allocates first, on the device.
const ON_DEVICE: u64 = 150 * MIB;
/// What it allocates next: within its limit, beyond what the device has left.
const SPILLED: u64 = 200 * MIB;
const LIMIT: &str = "600m";

const CUDA_SUCCESS: i32 = 0;
const CUDA_ERROR_INVALID_VALUE: i32 = 1;
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;
const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: i32 = 900;

fn setup(run: Run, dir: &ScratchDir) -> Run {
    run.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.truth_path())
        .env("FAKE_CUDA_CONTEXT_BYTES", CONTEXT.to_string())
        .env("FAKE_CUDA_MEMORY", DEVICE.to_string())
}

/// A process without the library holding all of device 0 but [`LEFT_FREE`] (with its context).
fn other_container(dir: &ScratchDir) -> Session {
    other_container_holding(dir, &[]).0
}

/// [`other_container`], whose hold is `parts` allocations of these sizes and one of the rest:
/// the process and the parts' pointers.
fn other_container_holding(dir: &ScratchDir, parts: &[u64]) -> (Session, Vec<u64>) {
    let mut other = setup(Run::new(&compiled_program("mem_ops")), dir).spawn(Duration::from_secs(60));
    assert_eq!(other.ask("init"), "init 0");
    assert_eq!(other.ask("ctx 0"), "ctx 0");
    let held = DEVICE - LEFT_FREE - CONTEXT;
    let rest = held - parts.iter().sum::<u64>();
    assert_eq!(status(&other.ask(&format!("alloc {rest}"))), CUDA_SUCCESS);
    let pointers = parts
        .iter()
        .map(|part| {
            let answer = other.ask(&format!("alloc {part}"));
            assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
            pointer(&answer)
        })
        .collect();
    (other, pointers)
}

/// A process without the library, on a fake of `devices` GPUs, holding all of GPU `ordinal` but
/// [`LEFT_FREE`].
fn other_container_on(dir: &ScratchDir, devices: u32, ordinal: u32) -> Session {
    let mut other = setup(Run::new(&compiled_program("mem_ops")), dir)
        .env("FAKE_CUDA_DEVICES", devices.to_string())
        .spawn(Duration::from_secs(60));
    assert_eq!(other.ask("init"), "init 0");
    assert_eq!(other.ask(&format!("ctx {ordinal}")), "ctx 0");
    let held = DEVICE - LEFT_FREE - CONTEXT;
    assert_eq!(status(&other.ask(&format!("alloc {held}"))), CUDA_SUCCESS);
    other
}

/// A process of the container that launches (so that the library's tick runs, which moves spills
/// back), limited to [`LIMIT`], with `CUDA_OVERSUBSCRIBE=true` and `devices` fake GPUs; its
/// context is on `ordinal`.
fn launching_container(dir: &ScratchDir, devices: u32, ordinal: u32) -> Session {
    let mut process = setup(Run::new(&compiled_program("monitor_launch")).hooked(), dir)
        .env("FAKE_CUDA_DEVICES", devices.to_string())
        .env("CUDA_DEVICE_MEMORY_LIMIT", LIMIT)
        .env("CUDA_OVERSUBSCRIBE", "true")
        .spawn(Duration::from_secs(60));
    assert_eq!(process.ask("init"), "init 0");
    assert_eq!(process.ask(&format!("ctx {ordinal}")), "ctx 0");
    process
}

/// Starts the library's tick in `process` (its first launch).
fn launch(process: &mut Session) {
    assert_eq!(status(&process.ask("load")), CUDA_SUCCESS);
    assert_eq!(status(&process.ask("launch 1")), CUDA_SUCCESS);
}

/// Waits up to 5 s for `settled` (the tick moves spills back every half second; the fake's
/// memory moves first, the region's host-backed bytes after).
fn within_5_s(settled: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !settled() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A process of the container, limited to [`LIMIT`], with `CUDA_OVERSUBSCRIBE` as given.
fn container(dir: &ScratchDir, oversubscribe: Option<&str>) -> Session {
    let mut run = setup(Run::new(&compiled_program("mem_ops")).hooked(), dir).env("CUDA_DEVICE_MEMORY_LIMIT", LIMIT);
    run = match oversubscribe {
        Some(value) => run.env("CUDA_OVERSUBSCRIBE", value),
        None => run.env_remove("CUDA_OVERSUBSCRIBE"),
    };
    let mut session = run.spawn(Duration::from_secs(60));
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    session
}

fn pointer(answer: &str) -> u64 {
    vgpu_integration::answer_number(answer, 2)
}

fn snapshot(dir: &ScratchDir) -> Snapshot {
    let bytes = std::fs::read(dir.region()).expect("read the region");
    read_snapshot(&bytes).expect("decode the region")
}

/// `pid`'s live slot.
fn live_process(dir: &ScratchDir, pid: u32) -> Option<ProcessSnapshot> {
    snapshot(dir)
        .processes
        .into_iter()
        .find(|process| process.pid == pid as i32 && process.status == SLOT_LIVE)
}

/// (data bytes, host-backed bytes) of `pid`'s live slot on region device 0.
fn held(dir: &ScratchDir, pid: u32) -> (u64, u64) {
    live_process(dir, pid).map_or((0, 0), |process| (process.memory[0].data, process.host_backed[0]))
}

/// The container's first two allocations: one on the device, one beyond it.
fn fill_and_spill(session: &mut Session) -> (i32, u64) {
    assert_eq!(status(&session.ask(&format!("alloc {ON_DEVICE}"))), CUDA_SUCCESS);
    let answer = session.ask(&format!("alloc {SPILLED}"));
    (status(&answer), pointer(&answer))
}

#[test]
fn within_the_limit_the_device_cannot_back_an_allocation_host_memory_does() {
    let dir = ScratchDir::new("elastic-spill");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    let used_before = truth.device(0).used();
    let (spill_status, spilled) = fill_and_spill(&mut process);
    assert_eq!(spill_status, CUDA_SUCCESS, "an allocation within the limit failed");
    assert_ne!(spilled, 0);
    assert_eq!(
        held(&dir, process.pid()),
        (ON_DEVICE + SPILLED, SPILLED),
        "(data, host-backed) in the region"
    );
    assert_eq!(
        truth.host_resident(),
        SPILLED,
        "host memory the fake holds for the process"
    );
    assert_eq!(
        truth.device(0).used(),
        used_before + ON_DEVICE,
        "the spill took device memory"
    );
    // Over the limit (48 + 350 + 300 MiB > 600 MiB): refused, spilled or not.
    assert_eq!(
        status(&process.ask(&format!("alloc {}", 300 * MIB))),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    assert_eq!(truth.host_resident(), SPILLED, "an allocation over the limit spilled");
    assert_eq!(held(&dir, process.pid()), (ON_DEVICE + SPILLED, SPILLED));
    // Inside the container the device is still the virtual one.
    let info = process.ask("info");
    let free: u64 = info
        .split_whitespace()
        .nth(2)
        .and_then(|f| f.parse().ok())
        .expect("free");
    assert_eq!(free, 600 * MIB - CONTEXT - ON_DEVICE - SPILLED, "{info}");

    // vgpu-smi shows it, in the JSON and the table.
    let json: serde_json::Value =
        serde_json::from_slice(&vgpu_smi(&["--region", &dir.region().to_string_lossy(), "--json"]).stdout)
            .expect("vgpu-smi --json is JSON");
    let device = &json["regions"][0]["devices"][0];
    assert_eq!(device["memory_host_backed_bytes"], SPILLED, "{json}");
    let process_device = &json["regions"][0]["processes"][0]["devices"][0];
    assert_eq!(process_device["host_backed_bytes"], SPILLED, "{json}");
    let table = String::from_utf8_lossy(&vgpu_smi(&["--region", &dir.region().to_string_lossy()]).stdout).into_owned();
    assert!(
        table.contains("GPU 0: 200 MiB of the used memory is in host memory"),
        "{table}"
    );
}

/// A VMM allocation (`cuMemCreate`: JAX's allocator, PyTorch's expandable segments) the device
/// cannot back is made in host memory, charged and shown host-backed like a spill, and released
/// with its handle; without the variable the refusal stands.
/// `vmmxla` asks for what XLA's allocator asks for (GPUDirect RDMA, fabric and POSIX fd handles),
/// which the fake, like the H100, refuses for host memory: the host allocation is made without.
#[test]
fn a_vmm_allocation_the_device_cannot_back_is_made_in_host_memory() {
    for (oversubscribe, command) in [(Some("true"), "vmm"), (Some("true"), "vmmxla"), (None, "vmm")] {
        let dir = ScratchDir::new("elastic-vmm");
        let truth = dir.truth();
        let _other = other_container(&dir);
        let mut process = container(&dir, oversubscribe);
        assert_eq!(status(&process.ask(&format!("alloc {ON_DEVICE}"))), CUDA_SUCCESS);
        let answer = process.ask(&format!("{command} {SPILLED}"));
        if oversubscribe.is_none() {
            assert_eq!(
                status(&answer),
                CUDA_ERROR_OUT_OF_MEMORY,
                "without the variable: {answer}"
            );
            assert_eq!(held(&dir, process.pid()), (ON_DEVICE, 0));
            continue;
        }
        assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
        assert_eq!(
            held(&dir, process.pid()),
            (ON_DEVICE + SPILLED, SPILLED),
            "(data, host-backed)"
        );
        assert_eq!(truth.host_resident(), SPILLED, "host memory the fake holds");
        let release = process.ask(&format!("vmmrelease {}", pointer(&answer)));
        assert_eq!(status(&release), CUDA_SUCCESS, "{release}");
        assert_eq!(held(&dir, process.pid()), (ON_DEVICE, 0), "after cuMemRelease");
        assert_eq!(truth.host_resident(), 0, "after cuMemRelease");
    }
}

/// A VMM allocation made in host memory lives, as device memory does, until its handle is
/// released and its last mapping is gone: released while mapped, it stays charged and host-backed
/// until the unmap.
#[test]
fn a_vmm_allocation_in_host_memory_released_while_mapped_stays_until_unmapped() {
    let dir = ScratchDir::new("elastic-vmm-mapped");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    assert_eq!(status(&process.ask(&format!("alloc {ON_DEVICE}"))), CUDA_SUCCESS);
    let created = process.ask(&format!("vmm {SPILLED}"));
    assert_eq!(status(&created), CUDA_SUCCESS, "{created}");
    let mapped = process.ask(&format!("vmmmap {}", pointer(&created)));
    assert_eq!(status(&mapped), CUDA_SUCCESS, "{mapped}");
    assert_eq!(
        status(&process.ask(&format!("vmmrelease {}", pointer(&created)))),
        CUDA_SUCCESS
    );
    assert_eq!(
        held(&dir, process.pid()),
        (ON_DEVICE + SPILLED, SPILLED),
        "(data, host-backed) while mapped"
    );
    assert_eq!(
        truth.host_resident(),
        SPILLED,
        "host memory the fake holds while mapped"
    );
    assert_eq!(
        status(&process.ask(&format!("vmmunmap {}", pointer(&mapped)))),
        CUDA_SUCCESS
    );
    assert_eq!(held(&dir, process.pid()), (ON_DEVICE, 0), "after the unmap");
    assert_eq!(truth.host_resident(), 0, "after the unmap");
}

/// A VMM allocation larger than the device's room (XLA's pool): its head, as much as the device
/// holds beyond the headroom (a sixteenth of the fake's 1 GiB), on the device and only its tail in
/// host memory, under one handle that maps, retains (at either part) and releases as one
/// allocation, which lives until its last reference is released and its mapping is gone.
#[test]
fn a_vmm_allocation_larger_than_the_devices_room_is_split_where_the_device_ends() {
    const BIG: u64 = 300 * MIB;
    const HEAD: u64 = LEFT_FREE - CONTEXT - DEVICE / 16;
    let dir = ScratchDir::new("elastic-vmm-split");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    let used_before = truth.device(0).used();
    let created = process.ask(&format!("vmm {BIG}"));
    assert_eq!(status(&created), CUDA_SUCCESS, "{created}");
    let handle = pointer(&created);
    assert_eq!(held(&dir, process.pid()), (BIG, BIG - HEAD), "(data, host-backed)");
    assert_eq!(truth.host_resident(), BIG - HEAD, "the tail in host memory");
    assert_eq!(truth.device(0).used(), used_before + HEAD, "the head on the device");

    let mapped = process.ask(&format!("vmmmap {handle}"));
    assert_eq!(status(&mapped), CUDA_SUCCESS, "{mapped}");
    let at = pointer(&mapped);
    for address in [at, at + HEAD, at + BIG - 1] {
        let retained = process.ask(&format!("vmmretain {address}"));
        assert_eq!(retained, format!("vmmretain 0 {handle}"), "a retain at {address:#x}");
    }
    for _ in 0..4 {
        assert_eq!(status(&process.ask(&format!("vmmrelease {handle}"))), CUDA_SUCCESS);
    }
    assert_eq!(
        held(&dir, process.pid()),
        (BIG, BIG - HEAD),
        "released while mapped: (data, host-backed)"
    );
    assert_eq!(truth.host_resident(), BIG - HEAD, "released while mapped");
    assert_eq!(
        status(&process.ask(&format!("vmmrelease {handle}"))),
        CUDA_ERROR_INVALID_VALUE,
        "a release past the last reference"
    );
    assert_eq!(status(&process.ask(&format!("vmmunmap {at}"))), CUDA_SUCCESS);
    assert_eq!(held(&dir, process.pid()), (0, 0), "after the unmap");
    assert_eq!(truth.host_resident(), 0, "after the unmap");
    assert_eq!(truth.device(0).used(), used_before, "after the unmap");
}

/// A split VMM allocation maps from any offset (a range starting in its head and reaching its tail,
/// a range in its tail alone, both at once) and answers a retain in its tail with its handle;
/// freeing an address range without unmapping it first unmaps it; the allocation goes with its
/// last mapping. Released before any mapping, it goes at once; and a range past the end of a handle
/// the device backs whole is refused as the driver refuses it.
#[test]
fn a_split_vmm_allocation_maps_from_any_offset_and_goes_with_its_last_mapping() {
    const BIG: u64 = 300 * MIB;
    const HEAD: u64 = LEFT_FREE - CONTEXT - DEVICE / 16;
    let dir = ScratchDir::new("elastic-vmm-offsets");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    let used_before = truth.device(0).used();

    let whole = pointer(&process.ask(&format!("vmm {}", 20 * MIB)));
    assert_eq!(process.ask(&format!("vmmoffset {}", 20 * MIB)), "vmmoffset 0");
    assert_eq!(
        status(&process.ask(&format!("vmmmap {whole}"))),
        CUDA_ERROR_INVALID_VALUE,
        "a range past the end of a handle the device backs whole"
    );
    assert_eq!(status(&process.ask(&format!("vmmrelease {whole}"))), CUDA_SUCCESS);

    let released = pointer(&process.ask(&format!("vmm {BIG}")));
    assert_eq!(held(&dir, process.pid()), (BIG, BIG - HEAD), "(data, host-backed)");
    assert_eq!(status(&process.ask(&format!("vmmrelease {released}"))), CUDA_SUCCESS);
    assert_eq!(held(&dir, process.pid()), (0, 0), "released before any mapping");
    assert_eq!(truth.host_resident(), 0, "released before any mapping");
    assert_eq!(truth.device(0).used(), used_before, "released before any mapping");

    let handle = pointer(&process.ask(&format!("vmm {BIG}")));
    let mut mapped = Vec::new();
    for offset in [HEAD / 2, HEAD + 10 * MIB] {
        assert_eq!(process.ask(&format!("vmmoffset {offset}")), "vmmoffset 0");
        let answer = process.ask(&format!("vmmmap {handle}"));
        assert_eq!(status(&answer), CUDA_SUCCESS, "mapped from {offset}: {answer}");
        mapped.push(pointer(&answer));
    }
    assert_eq!(
        process.ask(&format!("vmmretain {}", mapped[1])),
        format!("vmmretain 0 {handle}"),
        "a retain in the tail"
    );
    for _ in 0..2 {
        assert_eq!(status(&process.ask(&format!("vmmrelease {handle}"))), CUDA_SUCCESS);
    }
    assert_eq!(status(&process.ask(&format!("vmmfree {}", mapped[0]))), CUDA_SUCCESS);
    assert_eq!(
        held(&dir, process.pid()),
        (BIG, BIG - HEAD),
        "released, one range freed, the other mapped"
    );
    assert_eq!(status(&process.ask(&format!("vmmunmap {}", mapped[1]))), CUDA_SUCCESS);
    assert_eq!(held(&dir, process.pid()), (0, 0), "after the last unmap");
    assert_eq!(truth.host_resident(), 0, "after the last unmap");
    assert_eq!(truth.device(0).used(), used_before, "after the last unmap");
}

/// A split VMM allocation is not exported (a shareable handle stands for one allocation), while
/// one the device backs whole is; a mapping of its head alone, which the driver makes itself,
/// holds it as any mapping does.
#[test]
fn a_split_vmm_allocation_is_not_exported_and_its_head_alone_maps() {
    const BIG: u64 = 300 * MIB;
    const HEAD: u64 = LEFT_FREE - CONTEXT - DEVICE / 16;
    let dir = ScratchDir::new("elastic-vmm-export");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    let whole = pointer(&process.ask(&format!("vmmxla {}", 20 * MIB)));
    assert_eq!(status(&process.ask(&format!("vmmexport {whole}"))), CUDA_SUCCESS);
    assert_eq!(status(&process.ask(&format!("vmmrelease {whole}"))), CUDA_SUCCESS);

    let created = process.ask(&format!("vmmxla {BIG}"));
    assert_eq!(status(&created), CUDA_SUCCESS, "{created}");
    let handle = pointer(&created);
    assert_eq!(held(&dir, process.pid()), (BIG, BIG - HEAD), "(data, host-backed)");
    assert_eq!(
        status(&process.ask(&format!("vmmexport {handle}"))),
        CUDA_ERROR_NOT_SUPPORTED
    );
    let mapped = process.ask(&format!("vmmmapfirst {handle}"));
    assert_eq!(status(&mapped), CUDA_SUCCESS, "{mapped}");
    assert_eq!(status(&process.ask(&format!("vmmrelease {handle}"))), CUDA_SUCCESS);
    assert_eq!(
        held(&dir, process.pid()),
        (BIG, BIG - HEAD),
        "released while its head is mapped"
    );
    assert_eq!(
        status(&process.ask(&format!("vmmunmap {}", pointer(&mapped)))),
        CUDA_SUCCESS
    );
    assert_eq!(held(&dir, process.pid()), (0, 0), "after the unmap");
    assert_eq!(truth.host_resident(), 0, "after the unmap");
}

#[test]
fn without_oversubscribe_the_devices_refusal_stands() {
    for value in [None, Some("false"), Some("0")] {
        let dir = ScratchDir::new("elastic-off");
        let truth = dir.truth();
        let _other = other_container(&dir);
        let mut process = container(&dir, value);
        let (spill_status, _) = fill_and_spill(&mut process);
        assert_eq!(spill_status, CUDA_ERROR_OUT_OF_MEMORY, "CUDA_OVERSUBSCRIBE={value:?}");
        assert_eq!(
            held(&dir, process.pid()),
            (ON_DEVICE, 0),
            "CUDA_OVERSUBSCRIBE={value:?}"
        );
        assert_eq!(truth.host_resident(), 0);
    }
}

#[test]
fn a_malformed_oversubscribe_fails_cuda_initialisation_with_one_line() {
    let dir = ScratchDir::new("elastic-malformed");
    let output = setup(Run::new(&compiled_program("mem_ops")).hooked(), &dir)
        .env("CUDA_OVERSUBSCRIBE", "yes")
        .stdin("init\n")
        .output();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.starts_with("init ") && !stdout.starts_with("init 0"), "{stdout}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("CUDA_OVERSUBSCRIBE"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("expected true or 1"), "{stderr}");
}

#[test]
fn frees_plain_and_stream_ordered_release_the_charge_and_the_host_memory() {
    let dir = ScratchDir::new("elastic-free");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("1"));
    let (spill_status, spilled) = fill_and_spill(&mut process);
    assert_eq!(spill_status, CUDA_SUCCESS);
    assert_eq!(status(&process.ask(&format!("free {spilled}"))), CUDA_SUCCESS);
    assert_eq!(held(&dir, process.pid()), (ON_DEVICE, 0), "after cuMemFree");
    assert_eq!(truth.host_resident(), 0, "after cuMemFree");

    // Stream-ordered: the pool cannot grow past the device's free memory either.
    let answer = process.ask(&format!("asyncalloc {SPILLED}"));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    let spilled = pointer(&answer);
    assert_eq!(held(&dir, process.pid()), (ON_DEVICE + SPILLED, SPILLED));
    assert_eq!(truth.host_resident(), SPILLED);
    assert_eq!(status(&process.ask(&format!("asyncfree {spilled}"))), CUDA_SUCCESS);
    assert_eq!(status(&process.ask("sync")), CUDA_SUCCESS);
    assert_eq!(held(&dir, process.pid()), (ON_DEVICE, 0), "after cuMemFreeAsync");
    assert_eq!(truth.host_resident(), 0, "after cuMemFreeAsync");
}

/// A spill freed stream-ordered gives its charge back before the limit refuses anything: the next
/// allocation that needs that room gets it once the stream has passed the free, with no
/// synchronisation in between. (The fake's events complete 1 ms after they are recorded, so the
/// free still waits for its stream when `cuMemFreeAsync` returns.)
#[test]
fn a_stream_ordered_free_of_a_spill_makes_room_under_the_limit() {
    let dir = ScratchDir::new("elastic-async-room");
    let _other = other_container(&dir);
    let mut process = setup(Run::new(&compiled_program("mem_ops")).hooked(), &dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", LIMIT)
        .env("CUDA_OVERSUBSCRIBE", "true")
        .env("FAKE_CUDA_EVENT_NS", "1000000")
        .spawn(Duration::from_secs(60));
    assert_eq!(process.ask("init"), "init 0");
    assert_eq!(process.ask("ctx 0"), "ctx 0");
    assert_eq!(status(&process.ask(&format!("alloc {ON_DEVICE}"))), CUDA_SUCCESS);
    let answer = process.ask(&format!("asyncalloc {SPILLED}"));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    let free = process.ask(&format!("asyncfree {}", pointer(&answer)));
    assert_eq!(status(&free), CUDA_SUCCESS, "{free}");
    std::thread::sleep(Duration::from_millis(20));
    // 48 + 150 + 300 MiB fits under 600 MiB only without the 200 MiB freed.
    let answer = process.ask(&format!("alloc {}", 300 * MIB));
    assert_eq!(
        status(&answer),
        CUDA_SUCCESS,
        "refused while the freed spill was still charged: {answer}"
    );
    assert_eq!(held(&dir, process.pid()).0, ON_DEVICE + 300 * MIB);
}

#[test]
fn spilled_memory_moves_back_when_the_device_has_room() {
    let dir = ScratchDir::new("elastic-back");
    let truth = dir.truth();
    let other = other_container(&dir);
    let mut process = launching_container(&dir, 1, 0);
    let (spill_status, _) = fill_and_spill(&mut process);
    assert_eq!(spill_status, CUDA_SUCCESS);
    assert_eq!(truth.host_resident(), SPILLED);
    launch(&mut process);
    let used_before = truth.device(0).used();
    other.kill();
    within_5_s(|| truth.host_resident() == 0 && held(&dir, process.pid()).1 == 0);
    assert_eq!(truth.host_resident(), 0, "host memory 5 s after the device had room");
    assert_eq!(
        held(&dir, process.pid()),
        (ON_DEVICE + SPILLED, 0),
        "host-backed after the move"
    );
    truth.reclaim_dead();
    assert_eq!(
        truth.device(0).used(),
        used_before - (DEVICE - LEFT_FREE) + SPILLED,
        "the other's memory gone, the spill on the device"
    );
}

/// One allocation larger than the device's room (JAX's arena, a KV cache): its head, as much as the
/// device holds beyond the headroom (a sixteenth of the fake's 1 GiB), stays on the device; only its
/// tail is host memory, and the tail moves back as the device frees, part by part.
#[test]
fn an_allocation_larger_than_the_devices_room_spills_only_its_tail() {
    const BIG: u64 = 300 * MIB;
    const HEADROOM: u64 = DEVICE / 16;
    const FREED_FIRST: u64 = 100 * MIB;
    let dir = ScratchDir::new("elastic-split");
    let truth = dir.truth();
    let (mut other, parts) = other_container_holding(&dir, &[FREED_FIRST]);
    let mut process = launching_container(&dir, 1, 0);
    let used_before = truth.device(0).used();
    let head = LEFT_FREE - CONTEXT - HEADROOM;
    let answer = process.ask(&format!("alloc {BIG}"));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    assert_eq!(
        held(&dir, process.pid()),
        (BIG, BIG - head),
        "(data, host-backed): the tail alone in host memory"
    );
    assert_eq!(truth.host_resident(), BIG - head, "host memory the fake holds");
    assert_eq!(truth.device(0).used(), used_before + head, "the head on the device");

    // The other container frees part of its hold: as much of the tail moves back.
    launch(&mut process);
    assert_eq!(status(&other.ask(&format!("free {}", parts[0]))), CUDA_SUCCESS);
    let expected = BIG - head - FREED_FIRST;
    within_5_s(|| truth.host_resident() == expected && held(&dir, process.pid()).1 == expected);
    assert_eq!(
        truth.host_resident(),
        expected,
        "host memory after part of the device freed"
    );
    assert_eq!(held(&dir, process.pid()), (BIG, expected));
    other.kill();
    within_5_s(|| truth.host_resident() == 0 && held(&dir, process.pid()).1 == 0);
    assert_eq!(truth.host_resident(), 0, "host memory after the device freed");
    assert_eq!(held(&dir, process.pid()), (BIG, 0));
}

/// A process on two GPUs (JAX's way) with spills on both, the second GPU's made last: when only
/// the first GPU gets room, its spill moves back (its own context made current to measure and move
/// it), and the second GPU's stays.
#[test]
fn a_spill_moves_back_when_its_gpu_has_room_whichever_gpu_is_current() {
    let dir = ScratchDir::new("elastic-two-gpus");
    let truth = dir.truth();
    let (holds_1, _holds_0) = (other_container_on(&dir, 2, 1), other_container_on(&dir, 2, 0));
    let mut process = launching_container(&dir, 2, 1);
    assert_eq!(fill_and_spill(&mut process).0, CUDA_SUCCESS, "GPU 1");
    assert_eq!(process.ask("ctx 0"), "ctx 0");
    assert_eq!(fill_and_spill(&mut process).0, CUDA_SUCCESS, "GPU 0");
    assert_eq!(truth.host_resident(), 2 * SPILLED);
    launch(&mut process);
    holds_1.kill();
    let host_backed = || live_process(&dir, process.pid()).map(|p| (p.host_backed[0], p.host_backed[1]));
    within_5_s(|| truth.host_resident() == SPILLED && host_backed() == Some((SPILLED, 0)));
    assert_eq!(truth.host_resident(), SPILLED, "host memory 5 s after GPU 1 had room");
    assert_eq!(
        host_backed(),
        Some((SPILLED, 0)),
        "host-backed bytes of GPU 0 and GPU 1"
    );
}

/// A context destroyed (here the primary context reset) frees its spills in the driver: their
/// charges and host-backed bytes go with it.
#[test]
fn a_destroyed_context_takes_its_spills_with_it() {
    let dir = ScratchDir::new("elastic-reset");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    assert_eq!(fill_and_spill(&mut process).0, CUDA_SUCCESS);
    assert_eq!(held(&dir, process.pid()), (ON_DEVICE + SPILLED, SPILLED));
    assert_eq!(status(&process.ask("reset 0")), CUDA_SUCCESS);
    assert_eq!(held(&dir, process.pid()), (0, 0), "(data, host-backed) after the reset");
    assert_eq!(truth.host_resident(), 0);
}

/// A stream-ordered free that the tick completes is made in its spill's own context, whichever
/// context the tick has current: here the latest spill's context was destroyed before it.
#[test]
fn a_stream_ordered_free_completed_by_the_tick_is_made_in_its_spills_context() {
    let dir = ScratchDir::new("elastic-async-own-context");
    let truth = dir.truth();
    let (_holds_1, _holds_0) = (other_container_on(&dir, 2, 1), other_container_on(&dir, 2, 0));
    let mut process = setup(Run::new(&compiled_program("monitor_launch")).hooked(), &dir)
        .env("FAKE_CUDA_DEVICES", "2")
        .env("CUDA_DEVICE_MEMORY_LIMIT", LIMIT)
        .env("CUDA_OVERSUBSCRIBE", "true")
        // The free still waits for its stream when cuMemFreeAsync returns: the tick does it.
        .env("FAKE_CUDA_EVENT_NS", "1000000")
        .spawn(Duration::from_secs(60));
    assert_eq!(process.ask("init"), "init 0");
    assert_eq!(process.ask("ctx 1"), "ctx 0");
    let (spill_status, on_gpu_1) = fill_and_spill(&mut process);
    assert_eq!(spill_status, CUDA_SUCCESS, "GPU 1");
    assert_eq!(process.ask("ctx 0"), "ctx 0");
    assert_eq!(fill_and_spill(&mut process).0, CUDA_SUCCESS, "GPU 0");
    launch(&mut process);
    assert_eq!(status(&process.ask("reset 0")), CUDA_SUCCESS);
    assert_eq!(
        truth.host_resident(),
        SPILLED,
        "GPU 1's spill after GPU 0's context went"
    );
    assert_eq!(process.ask("ctx 1"), "ctx 0");
    assert_eq!(status(&process.ask(&format!("asyncfree {on_gpu_1}"))), CUDA_SUCCESS);
    let host_backed =
        || live_process(&dir, process.pid()).map(|p| (p.host_backed[0], p.host_backed[1], p.memory[1].data));
    within_5_s(|| truth.host_resident() == 0 && host_backed() == Some((0, 0, ON_DEVICE)));
    assert_eq!(truth.host_resident(), 0, "host memory 5 s after the free");
    assert_eq!(
        host_backed(),
        Some((0, 0, ON_DEVICE)),
        "host-backed bytes of GPU 0 and GPU 1, data of GPU 1"
    );
}

/// A spill's stream-ordered free on a stream being captured is refused, as the driver refuses
/// what a capture cannot take (the point it would wait for is a graph's node, and freeing the
/// memory then would free it under the graph's kernels): the memory stays, charged, until a free
/// outside the capture.
#[test]
fn a_stream_ordered_free_of_a_spill_in_a_capture_is_refused_and_the_memory_kept() {
    let dir = ScratchDir::new("elastic-capture-free");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    let (spill_status, spilled) = fill_and_spill(&mut process);
    assert_eq!(spill_status, CUDA_SUCCESS);
    assert_eq!(process.ask("capture 0"), "capture 0");
    let answer = process.ask(&format!("capfree {spilled}"));
    assert_eq!(status(&answer), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "{answer}");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        held(&dir, process.pid()),
        (ON_DEVICE + SPILLED, SPILLED),
        "during the capture"
    );
    assert_eq!(truth.host_resident(), SPILLED, "during the capture");
    let end = process.ask("endcapture");
    assert_eq!(status(&end), CUDA_SUCCESS, "{end}");
    assert_eq!(status(&process.ask(&format!("free {spilled}"))), CUDA_SUCCESS);
    assert_eq!(held(&dir, process.pid()), (ON_DEVICE, 0), "after cuMemFree");
    assert_eq!(truth.host_resident(), 0, "after cuMemFree");
}

#[test]
fn the_exit_of_a_process_releases_its_spilled_memory() {
    let dir = ScratchDir::new("elastic-exit");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    let (spill_status, _) = fill_and_spill(&mut process);
    assert_eq!(spill_status, CUDA_SUCCESS);
    let pid = process.pid();
    process.send("exit 0");
    let output = process.finish();
    assert!(output.status.success(), "{output:?}");
    assert!(live_process(&dir, pid).is_none(), "the exited process still has a slot");
    assert!(snapshot(&dir).processes.iter().all(|p| p.host_backed == [0; 16]));
    assert_eq!(truth.host_resident(), 0);
}

/// A forked child that spills and exits takes its spill with it; the parent's stays.
#[test]
fn a_forked_child_that_spills_and_exits_leaves_only_the_parents() {
    let dir = ScratchDir::new("elastic-fork");
    let truth = dir.truth();
    let _other = other_container(&dir);
    let mut process = container(&dir, Some("true"));
    let (spill_status, _) = fill_and_spill(&mut process);
    assert_eq!(spill_status, CUDA_SUCCESS);
    let answer = process.ask(&format!("forkexit {}", 100 * MIB));
    let fields: Vec<&str> = answer.split_whitespace().collect();
    assert_eq!(fields.get(1), Some(&"0"), "the child's allocation failed: {answer}");
    let child: u32 = fields.get(2).and_then(|pid| pid.parse().ok()).expect("child pid");
    truth.reclaim_dead();
    assert_eq!(truth.host_resident(), SPILLED, "host memory after the child's exit");
    assert!(live_process(&dir, child).is_none(), "the child's slot outlived it");
    assert_eq!(
        held(&dir, process.pid()),
        (ON_DEVICE + SPILLED, SPILLED),
        "the parent's"
    );
}

#[test]
fn two_processes_share_the_limit_with_their_spills_counted() {
    let dir = ScratchDir::new("elastic-two");
    let _other = other_container(&dir);
    let mut first = container(&dir, Some("true"));
    let (spill_status, spilled) = fill_and_spill(&mut first);
    assert_eq!(spill_status, CUDA_SUCCESS);
    // 48 + 350 MiB held, 48 MiB for the second's context: 154 MiB left under 600 MiB.
    let mut second = container(&dir, Some("true"));
    assert_eq!(
        status(&second.ask(&format!("alloc {}", 160 * MIB))),
        CUDA_ERROR_OUT_OF_MEMORY,
        "the first process's spilled bytes were not counted against the shared limit"
    );
    assert_eq!(status(&first.ask(&format!("free {spilled}"))), CUDA_SUCCESS);
    let answer = second.ask(&format!("alloc {}", 160 * MIB));
    assert_eq!(status(&answer), CUDA_SUCCESS, "{answer}");
    assert_eq!(
        held(&dir, second.pid()),
        (160 * MIB, 160 * MIB),
        "spilled: the device has no room"
    );
}

fn vgpu_smi(arguments: &[&str]) -> Output {
    let path = vgpu_integration::vgpu_smi();
    let output = output_started(
        command(&path)
            .args(arguments)
            .env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE"),
    )
    .expect("run vgpu-smi");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    output
}
