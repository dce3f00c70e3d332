//! The compute limiter's board profiles against the fake driver, whose GPU ("NVIDIA H200 (vgpu
//! fake)") is listed with the H200 in `hook/src/throttle/boards.toml`. The fake draws 900 W busy
//! all the time against a 700 W limit, so at limit 50 the H200's power model charges each kernel
//! about 1.14 times its time and the kernels take about 44% of the device
//! (the simulation, `a_profiled_board_holds_a_share_of_the_work_and_any_other_a_share_of_time`); `VGPU_COMPUTE_PROFILE=off`
//! holds the plain time share, 50%. A GPU that NVML reports slowed to 1600 MHz, nearer the clock
//! the heaviest work settles at busy all the time, keeps less of the boost (about 47%): its clock
//! is read. Each process says once, at info level, which applies and why.

use std::time::{Duration, Instant};

use vgpu_integration::{Run, ScratchDir, Session, compiled_program};

/// Simulated duration of the test kernel.
const KERNEL: &str = "busy_2000us";
/// After the first readings (every 250 ms in the first 1.5 s, each taken whole) the factor has
/// settled; the window then measures the share.
const SETTLE: Duration = Duration::from_millis(3500);
const WINDOW: Duration = Duration::from_millis(2000);

/// The loop at limit 50 on the power-hungry fake GPU, logging at info level, with
/// `VGPU_COMPUTE_PROFILE` set to `profile` (or unset) and `env` on top.
fn start(dir: &ScratchDir, profile: Option<&str>, env: &[(&str, &str)]) -> Session {
    let mut run = Run::new(&compiled_program("compute_loop"))
        .hooked()
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.truth_path())
        .env("CUDA_DEVICE_SM_LIMIT", "50")
        .env("FAKE_NVML_BUSY_WATTS", "900")
        .env("LIBCUDA_LOG_LEVEL", "3");
    if let Some(profile) = profile {
        run = run.env("VGPU_COMPUTE_PROFILE", profile);
    }
    for (key, value) in env {
        run = run.env(key, value);
    }
    run.args(["kernel", KERNEL, "6.5"]).spawn_ready(Duration::from_secs(30))
}

/// The program's log, after checking that it ran without launch errors.
fn log_of(mut session: Session) -> String {
    let output = session.finish();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "the program failed: {output:?}");
    assert!(stdout.contains(" errors=0 "), "launches failed: {stdout}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn off_holds_the_time_share_and_each_process_says_which_applies() {
    let dirs = ["auto", "off", "1600"].map(|name| ScratchDir::new(&format!("board-profile-{name}")));
    let slowed = [("FAKE_NVML_SLOWDOWN", "1"), ("FAKE_NVML_SM_MHZ", "1600")];
    let sessions = [
        start(&dirs[0], None, &[]),
        start(&dirs[1], Some("off"), &[]),
        start(&dirs[2], None, &slowed),
    ];
    std::thread::sleep(SETTLE);
    let truths = dirs.each_ref().map(ScratchDir::truth);
    let at = Instant::now();
    let before = truths.each_ref().map(|truth| truth.device(0).busy_ns());
    std::thread::sleep(WINDOW);
    let after = truths.each_ref().map(|truth| truth.device(0).busy_ns());
    let elapsed = at.elapsed().as_nanos() as f64;
    let [profiled, off, at_1600] = [0, 1, 2].map(|i| (after[i] - before[i]) as f64 * 100.0 / elapsed);
    let [profiled_log, off_log, _] = sessions.map(log_of);
    eprintln!(
        "limit 50 on the 900 W fake: {profiled:.1}% with its profile, {off:.1}% with VGPU_COMPUTE_PROFILE=off, \
         {at_1600:.1}% slowed to 1600 MHz"
    );
    assert!(
        (46.5..=53.0).contains(&off),
        "VGPU_COMPUTE_PROFILE=off: {off:.1}%, expected the time share, 50%"
    );
    assert!(
        profiled < off - 3.0,
        "with the profile {profiled:.1}%, expected about 44% (off: {off:.1}%)"
    );
    assert!(
        at_1600 > profiled + 1.5 && at_1600 < off - 1.0,
        "slowed to 1600 MHz: {at_1600:.1}%, expected about 47% (profiled {profiled:.1}%, off {off:.1}%)"
    );
    let said = |log: &str, line: &str| log.lines().filter(|logged| logged.contains(line)).count();
    assert_eq!(
        said(
            &profiled_log,
            "compute limiter: device 0: \"NVIDIA H200 (vgpu fake)\" has a board profile: the limit is a share of \
             the work the GPU does unlimited"
        ),
        1,
        "{profiled_log}"
    );
    assert_eq!(
        said(
            &off_log,
            "compute limiter: device 0: VGPU_COMPUTE_PROFILE=off: the limit is a share of the GPU's time, without \
             boost compensation"
        ),
        1,
        "{off_log}"
    );
    for log in [&profiled_log, &off_log] {
        assert_eq!(said(log, "compute limiter: device 0: "), 1, "said once: {log}");
    }
}
