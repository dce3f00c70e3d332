//! `vgpu-smi suspend --release` and `resume` against the fake driver's checkpoint API
//! (`tests/fake-driver/src/checkpoint.rs`): a released process's memory leaves the device (the
//! truth's `used` drops) while its charges stay in the region; another process may use the memory
//! meanwhile; a restore that does not fit fails cleanly, says what is missing and is retried by
//! the next `resume`; a process killed while released leaves nothing behind; a process that cannot
//! be locked is reported and left running.

use std::process::Output;
use std::time::Duration;

use std::sync::atomic::Ordering;
use std::time::Instant;
use vgpu_integration::{Run, ScratchDir, Session, compiled_program};

use vgpu_region::{InitParams, Region, SLOT_LIVE, read_snapshot};

const MIB: u64 = 1 << 20;
const CONTEXT: u64 = 48 * MIB;
const DEVICE: u64 = 1024 * MIB;
const HELD: u64 = 600 * MIB;

fn setup(run: Run, dir: &ScratchDir) -> Run {
    run.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.truth_path())
        .env("FAKE_CUDA_CONTEXT_BYTES", CONTEXT.to_string())
        .env("FAKE_CUDA_MEMORY", DEVICE.to_string())
}

/// A process of the container holding [`HELD`] (and its context) under a 2 GiB limit.
fn job(dir: &ScratchDir, extra: &[(&str, &str)]) -> Session {
    let mut run = setup(Run::new(&compiled_program("mem_ops")).hooked(), dir).env("CUDA_DEVICE_MEMORY_LIMIT", "2g");
    for (key, value) in extra {
        run = run.env(key, value);
    }
    let mut session = run.spawn(Duration::from_secs(60));
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    assert!(session.ask(&format!("alloc {HELD}")).starts_with("alloc 0 "));
    session
}

/// A process with no library (another container) asking for `bytes`; its answer's status.
fn other(dir: &ScratchDir, bytes: u64) -> (Session, String) {
    let mut session = setup(Run::new(&compiled_program("mem_ops")), dir).spawn(Duration::from_secs(60));
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    let answer = session.ask(&format!("alloc {bytes}"));
    (session, answer)
}

fn vgpu_smi(dir: &ScratchDir, arguments: &[&str]) -> Output {
    let path = vgpu_integration::vgpu_smi();
    let region = dir.region().to_string_lossy().into_owned();
    let mut all: Vec<&str> = arguments.to_vec();
    all.extend(["--region", &region]);
    setup(Run::new(&path), dir).args(all).output()
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// (charged total on region device 0, released flag as the JSON shows it) of `pid`.
fn region_view(dir: &ScratchDir, pid: u32) -> (u64, bool) {
    let json: serde_json::Value =
        serde_json::from_slice(&vgpu_smi(dir, &["--json"]).stdout).expect("vgpu-smi --json is JSON");
    let process = json["regions"][0]["processes"]
        .as_array()
        .and_then(|processes| processes.iter().find(|p| p["pid"] == pid))
        .cloned()
        .unwrap_or_default();
    (
        process["devices"][0]["total_bytes"].as_u64().unwrap_or(0),
        process["released"].as_bool().unwrap_or(false),
    )
}

#[test]
fn a_released_process_frees_the_device_and_resumes_where_it_was() {
    let dir = ScratchDir::new("release-cycle");
    let truth = dir.truth();
    let mut process = job(&dir, &[]);
    let pid = process.pid();
    assert_eq!(truth.device(0).used(), CONTEXT + HELD);

    let released = vgpu_smi(&dir, &["suspend", "--release"]);
    assert!(released.status.success(), "{}", text(&released));
    assert!(
        text(&released).contains(&format!("released pid {pid}")),
        "{}",
        text(&released)
    );
    assert_eq!(
        truth.device(0).used(),
        0,
        "the device still holds the released process's memory"
    );
    assert_eq!(
        region_view(&dir, pid),
        (CONTEXT + HELD, true),
        "charges stay, marked released"
    );

    // Someone else takes the memory meanwhile: the restore cannot fit, says so, and is retried.
    let (mut neighbour, answer) = other(&dir, 800 * MIB);
    assert!(
        answer.starts_with("alloc 0 "),
        "the freed memory was not usable: {answer}"
    );
    let refused = vgpu_smi(&dir, &["resume"]);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    let message = text(&refused);
    assert!(
        message.contains("not restored (CUDA_ERROR_OUT_OF_MEMORY") && message.contains("missing"),
        "{message}"
    );
    assert_eq!(
        region_view(&dir, pid),
        (CONTEXT + HELD, true),
        "a failed restore lost the state"
    );
    neighbour.send("exit 0");
    let _ = neighbour.finish();

    let resumed = vgpu_smi(&dir, &["resume"]);
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(
        text(&resumed).contains(&format!("restored pid {pid}")),
        "{}",
        text(&resumed)
    );
    truth.reclaim_dead();
    assert_eq!(truth.device(0).used(), CONTEXT + HELD);
    assert_eq!(region_view(&dir, pid), (CONTEXT + HELD, false));
    // The process carries on.
    assert!(process.ask("alloc 1").starts_with("alloc 0 "));
}

#[test]
fn a_process_killed_while_released_leaves_nothing_behind() {
    let dir = ScratchDir::new("release-killed");
    let truth = dir.truth();
    let process = job(&dir, &[]);
    let pid = process.pid();
    let released = vgpu_smi(&dir, &["suspend", "--release"]);
    assert!(released.status.success(), "{}", text(&released));
    process.kill();
    truth.reclaim_dead();
    assert_eq!(truth.device(0).used(), 0, "the device's count went wrong");
    // The device's memory is all there for another container; the next process's start reaps
    // the dead slot.
    let (mut neighbour, answer) = other(&dir, DEVICE - CONTEXT);
    assert!(answer.starts_with("alloc 0 "), "{answer}");
    neighbour.send("exit 0");
    let _ = neighbour.finish();
    let _next = job(&dir, &[]);
    let bytes = std::fs::read(dir.region()).expect("read the region");
    let snapshot = read_snapshot(&bytes).expect("decode the region");
    assert!(
        snapshot
            .processes
            .iter()
            .all(|p| p.pid != pid as i32 || p.status != SLOT_LIVE),
        "the killed process's slot survived"
    );
}

#[test]
fn a_process_that_cannot_be_locked_is_reported_and_left_running() {
    let dir = ScratchDir::new("release-unlockable");
    let truth = dir.truth();
    let mut process = job(&dir, &[("FAKE_CUDA_LOCK_REFUSED", "1")]);
    let refused = vgpu_smi(&dir, &["suspend", "--release", "--lock-timeout", "200ms"]);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(
        text(&refused).contains("not locked (its CUDA calls did not drain"),
        "{}",
        text(&refused)
    );
    assert_eq!(truth.device(0).used(), CONTEXT + HELD);
    assert_eq!(region_view(&dir, process.pid()), (CONTEXT + HELD, false));
    assert!(process.ask("alloc 1").starts_with("alloc 0 "), "it was left suspended");
}

#[test]
fn a_bad_lock_timeout_is_one_line_and_status_2() {
    let dir = ScratchDir::new("release-args");
    for bad in ["0", "-1", "forever", "7200"] {
        let output = vgpu_smi(&dir, &["suspend", "--release", "--lock-timeout", bad]);
        assert_eq!(output.status.code(), Some(2), "{bad}: {}", text(&output));
    }
    let output = vgpu_smi(&dir, &["suspend", "--lock-timeout", "1"]);
    assert_eq!(output.status.code(), Some(2), "--lock-timeout without --release");
}

/// A process of the container that has launched once (its tick runs), holding [`HELD`].
fn launched_job(dir: &ScratchDir, variable: (&str, &str)) -> Session {
    let mut session = setup(Run::new(&compiled_program("monitor_launch")).hooked(), dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "2g")
        .env(variable.0, variable.1)
        .spawn(Duration::from_secs(60));
    assert_eq!(session.ask("init"), "init 0");
    assert_eq!(session.ask("ctx 0"), "ctx 0");
    assert!(session.ask(&format!("alloc {HELD}")).starts_with("alloc 0 "));
    assert!(session.ask("load").starts_with("load 0"));
    assert!(session.ask("launch 1").starts_with("launch 0 "));
    session
}

/// Waits up to `seconds` for the truth's device 0 to hold `bytes`.
fn device_reaches(dir: &ScratchDir, bytes: u64, seconds: u64) -> bool {
    let truth = dir.truth();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    loop {
        truth.reclaim_dead();
        if truth.device(0).used() == bytes {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_idle_process_releases_its_memory_and_its_next_launch_restores_it() {
    let dir = ScratchDir::new("release-idle");
    let mut process = launched_job(&dir, ("CUDA_IDLE_RELEASE", "1"));
    let pid = process.pid();
    assert!(
        device_reaches(&dir, 0, 10),
        "still on the device 10 s after 1 s idle: {}",
        dir.truth().device(0).used()
    );
    assert_eq!(region_view(&dir, pid), (CONTEXT + HELD, true));
    // The next launch waits for the restore, then runs.
    let started = Instant::now();
    let answer = process.ask("launch 1");
    assert!(answer.starts_with("launch 0 "), "{answer}");
    eprintln!("the launch after an idle release waited {:?}", started.elapsed());
    assert_eq!(dir.truth().device(0).used(), CONTEXT + HELD);
    assert_eq!(region_view(&dir, pid), (CONTEXT + HELD, false));
}

#[test]
fn a_process_blocked_by_priority_releases_its_memory_until_unblocked() {
    let dir = ScratchDir::new("release-priority");
    let mut process = launched_job(&dir, ("CUDA_PRIORITY_RELEASE", "true"));
    let pid = process.pid();
    let init = InitParams {
        device_uuids: vec!["GPU-00000000-0000-0000-0000-000000000000".to_string()],
        ..InitParams::default()
    };
    let region = Region::open(&dir.region(), &init).expect("open the region from the test");
    region.hami().recent_kernel.store(-1, Ordering::Relaxed);
    assert!(device_reaches(&dir, 0, 10), "not released 10 s after the block");
    assert_eq!(region_view(&dir, pid), (CONTEXT + HELD, true));
    region.hami().recent_kernel.store(2, Ordering::Relaxed);
    assert!(
        device_reaches(&dir, CONTEXT + HELD, 10),
        "not restored 10 s after the block ended"
    );
    assert!(process.ask("launch 1").starts_with("launch 0 "));
    assert_eq!(region_view(&dir, pid), (CONTEXT + HELD, false));
}
