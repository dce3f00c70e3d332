//! The compute limiter against the fake driver's simulated engine: kernels of a fixed simulated
//! duration launched in a loop take the limit's share of the device's time (the fake's ground
//! truth counts every launched kernel's duration), through every launch path; two processes of one
//! region share one budget; HAMi's controls (`GPU_CORE_UTILIZATION_POLICY`, the region's
//! `utilization_switch` and `recent_kernel`) work; and with no limit the launch path never waits.
//! How closely each job shape holds its limit is the simulation's to check
//! (`hook/src/throttle/sim.rs`); these are the driver's paths, each in a second or two.
//!
//! Every test uses its own folder for the region and the ground truth. A share is measured over a
//! window in the middle of the run (after a warm-up, so the first measurements have arrived), as
//! the truth's busy time gained over the window divided by its wall time.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vgpu_integration::{Fields, Run, ScratchDir, Session, compiled_program, truth};
use vgpu_region::{COMPUTE_OFFSET, EXTENSION_OFFSET, InitParams, Region, SLOT_LIVE, read_snapshot};

/// Simulated duration of the test kernel.
const KERNEL: &str = "busy_2000us";
/// Tolerance of a share, in points of percent.
const TOLERANCE: f64 = 5.0;
/// Run-up before the measured window, and the window.
const WARM_UP: Duration = Duration::from_millis(500);
const WINDOW: Duration = Duration::from_millis(1000);
/// How long each program runs: the warm-up, the window and a margin.
const RUN_SECONDS: &str = "2.0";

fn program() -> PathBuf {
    compiled_program("compute_loop")
}

/// The compute_loop program with the hook, this test's files, and `env` on top of an environment
/// cleared of every limit and policy variable.
fn compute_loop(dir: &ScratchDir, env: &[(&str, &str)], args: &[&str]) -> Run {
    let mut run = Run::new(&program())
        .hooked()
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.truth_path());
    for (key, value) in env {
        run = run.env(key, value);
    }
    run.args(args)
}

/// The region now, and the share (percent) process `pid` publishes in its slot for HAMi's monitor
/// (its `sm_util` on device 0).
fn published_share(dir: &ScratchDir, pid: i32) -> (vgpu_region::Snapshot, u64) {
    let snapshot = read_snapshot(&std::fs::read(dir.region()).expect("read the region")).expect("decode the region");
    let published = snapshot
        .processes
        .iter()
        .find(|p| p.pid == pid && p.status == SLOT_LIVE)
        .map(|p| p.sm_util[0])
        .expect("the program's slot");
    (snapshot, published)
}

/// Starts a program and waits until it says it is set up.
fn start(run: Run) -> Session {
    run.spawn_ready(Duration::from_secs(30))
}

/// The program's final line, parsed into its `key=value` fields.
fn finish(mut session: Session) -> Fields {
    let output = session.finish();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "program failed ({}): {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let line = stdout
        .lines()
        .find(|line| line.starts_with("done "))
        .unwrap_or_else(|| panic!("no summary line in {stdout:?}"));
    let done = Fields::parse(line);
    assert_eq!(done.get("errors"), 0.0, "launches failed: {line}");
    done
}

/// Busy share of physical device 0 in percent over a window of `WINDOW` starting now.
fn busy_share(truth: &truth::Truth) -> f64 {
    busy_shares([truth])[0]
}

/// Busy shares of physical device 0 of several truths over one window of `WINDOW` starting now.
fn busy_shares<const N: usize>(truths: [&truth::Truth; N]) -> [f64; N] {
    let (busy, at) = (truths.each_ref().map(|truth| truth.device(0).busy_ns()), Instant::now());
    std::thread::sleep(WINDOW);
    let (after, elapsed) = (truths.each_ref().map(|truth| truth.device(0).busy_ns()), at.elapsed());
    std::array::from_fn(|i| (after[i] - busy[i]) as f64 * 100.0 / elapsed.as_nanos() as f64)
}

/// Runs programs side by side and measures the device's busy share in the middle of their runs.
fn measure(dir: &ScratchDir, runs: Vec<Run>) -> (f64, Vec<Fields>) {
    let sessions: Vec<Session> = runs.into_iter().map(start).collect();
    let truth = dir.truth();
    std::thread::sleep(WARM_UP);
    let share = busy_share(&truth);
    (share, sessions.into_iter().map(finish).collect())
}

fn assert_share(what: &str, share: f64, expected: f64) {
    eprintln!("{what}: busy share {share:.1}%");
    assert!(
        (share - expected).abs() <= TOLERANCE,
        "{what}: busy share {share:.1}%, expected {expected}% +/- {TOLERANCE}"
    );
}

/// One little-endian u64 of the region's compute state for region device 0.
fn compute_field(dir: &ScratchDir, word: usize) -> u64 {
    let bytes = std::fs::read(dir.region()).expect("read the region");
    let at = EXTENSION_OFFSET + COMPUTE_OFFSET + 8 * word;
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

const LAUNCHES_WORD: usize = 4;
const WAIT_NS_WORD: usize = 3;

/// The fake's UUID of physical device 0.
const UUID0: &str = "GPU-00000000-0000-0000-0000-000000000000";

/// Joins (or creates) the region from the test, holding it so that a program starting later joins
/// it as it is instead of reinitialising it.
/// Opens (or creates, with the compute limit the processes' variables give: the region's limits
/// are the container's) the test's region, keeping it in use.
fn hold_region(dir: &ScratchDir, sm_limit: u64) -> Region {
    let init = InitParams {
        device_uuids: vec![UUID0.to_string()],
        sm_limits: [sm_limit; vgpu_region::MAX_DEVICES],
        ..InitParams::default()
    };
    Region::open(&dir.region(), &init).expect("open the region from the test")
}

fn limited_run(limit: u32, path: &str) {
    let dir = ScratchDir::new(&format!("compute-limit-{limit}-{path}"));
    let limit_text = limit.to_string();
    let run = compute_loop(
        &dir,
        &[("CUDA_DEVICE_SM_LIMIT", &limit_text)],
        &[path, KERNEL, RUN_SECONDS, "stream"],
    );
    let (share, done) = measure(&dir, vec![run]);
    assert_share(&format!("{path} at limit {limit}"), share, f64::from(limit));
    assert!(done[0].get("slow_launches") > 0.0, "nothing waited at limit {limit}");
    assert!(
        compute_field(&dir, LAUNCHES_WORD) > 0,
        "the region's bucket was not used"
    );
}

#[test]
fn limit_50_holds_and_is_published() {
    let dir = ScratchDir::new("compute-limit-50-published");
    let run = compute_loop(
        &dir,
        &[("CUDA_DEVICE_SM_LIMIT", "50")],
        &["kernel", KERNEL, RUN_SECONDS],
    );
    let session = start(run);
    let pid = session.pid() as i32;
    let truth = dir.truth();
    std::thread::sleep(WARM_UP);
    let share = busy_share(&truth);
    // What the process publishes for HAMi's monitor: its share over the last second.
    let (snapshot, published) = published_share(&dir, pid);
    let last_kernel_time = snapshot.last_kernel_time;
    finish(session);
    assert_share("default stream at limit 50", share, 50.0);
    assert!(
        (40..=60).contains(&published),
        "published sm_util {published}, measured share {share:.1}"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    assert!(
        (now - 5..=now).contains(&last_kernel_time),
        "last_kernel_time {last_kernel_time}, now {now}"
    );
    assert_eq!(snapshot.recent_kernel, 2, "launches mark the container active");
}

/// A compute limit whose region cannot be used (issue 16): cuInit fails, and a program that
/// ignores it and launches anyway gets CUDA_ERROR_NOT_INITIALIZED for every launch: none runs
/// unlimited under the limit's name (the fake's engine records no busy time). Without a memory
/// limit the context and module are the driver's to give.
#[test]
fn launches_under_a_limit_fail_closed_when_the_region_is_unusable() {
    let dir = ScratchDir::new("compute-fail-closed");
    let program = compiled_program("monitor_launch");
    let output = Run::new(&program)
        .hooked()
        .env("CUDA_DEVICE_SM_LIMIT", "50")
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.join("missing").join("region"))
        .env("FAKE_CUDA_TRUTH", dir.truth_path())
        .stdin("init\nctx 0\nload\nlaunch 20\nquit\n")
        .output();
    let answers: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(
        answers.len(),
        4,
        "{answers:?} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_ne!(answers[0], "init 0", "cuInit succeeded");
    assert_eq!(answers[1..3], ["ctx 0", "load 0"], "{answers:?}");
    assert!(
        answers[3].starts_with("launch 3 "),
        "the launches were not refused: {answers:?}"
    );
    assert_eq!(dir.truth().device(0).busy_ns(), 0, "a kernel ran");
}

#[test]
fn unlimited_launches_never_wait() {
    let limits = [None, Some("100"), Some("0")];
    let dirs = limits.map(|_| ScratchDir::new("compute-unlimited"));
    let sessions: Vec<Session> = limits
        .iter()
        .zip(&dirs)
        .map(|(limit, dir)| {
            let env: Vec<(&str, &str)> = limit.map(|l| ("CUDA_DEVICE_SM_LIMIT", l)).into_iter().collect();
            start(compute_loop(dir, &env, &["kernel", KERNEL, "1.5", "stream"]))
        })
        .collect();
    for ((limit, dir), session) in limits.iter().zip(&dirs).zip(sessions) {
        let done = finish(session);
        // The launch path never went through the limiter: the bucket is untouched.
        assert_eq!(compute_field(dir, LAUNCHES_WORD), 0, "limit {limit:?}");
        assert_eq!(compute_field(dir, WAIT_NS_WORD), 0, "limit {limit:?}");
        let inside = done.get("launch_ns") / (done.get("seconds") * 1e9);
        assert!(
            inside < 0.02,
            "limit {limit:?}: {:.1}% of the run inside launch calls",
            inside * 100.0
        );
        assert!(
            done.get("max_launch_ns") < 50e6,
            "limit {limit:?}: a launch took {} ns",
            done.get("max_launch_ns")
        );
        // The engine was busy all along (the program synchronises every four 2 ms kernels).
        let busy = dir.truth().device(0).busy_ns() as f64 / (done.get("seconds") * 1e9) * 100.0;
        assert!(busy > 90.0, "limit {limit:?}: busy share {busy:.1}");
    }
}

#[test]
fn launch_kernel_ex_is_limited() {
    limited_run(30, "ex");
}

#[test]
fn cooperative_launches_are_limited() {
    limited_run(30, "coop");
}

#[test]
fn graph_launches_are_limited() {
    // Four captured 2 ms kernels per graph launch; the capture itself is not gated.
    limited_run(30, "graph");
}

#[test]
fn per_thread_stream_launches_are_limited() {
    let dir = ScratchDir::new("compute-ptsz");
    let run = compute_loop(&dir, &[("CUDA_DEVICE_SM_LIMIT", "40")], &["ptsz", KERNEL, RUN_SECONDS]);
    let (share, _) = measure(&dir, vec![run]);
    assert_share("cuLaunchKernel_ptsz at limit 40", share, 40.0);
}

#[test]
fn legacy_launches_are_limited() {
    let dir = ScratchDir::new("compute-legacy");
    let run = compute_loop(
        &dir,
        &[("CUDA_DEVICE_SM_LIMIT", "40")],
        &["legacy", KERNEL, RUN_SECONDS],
    );
    let (share, _) = measure(&dir, vec![run]);
    assert_share("cuLaunchGrid at limit 40", share, 40.0);
}

#[test]
fn two_processes_share_one_budget() {
    let dir = ScratchDir::new("compute-two");
    let runs = (0..2)
        .map(|_| {
            compute_loop(
                &dir,
                &[("CUDA_DEVICE_SM_LIMIT", "50")],
                &["kernel", KERNEL, RUN_SECONDS, "stream"],
            )
        })
        .collect();
    let (share, done) = measure(&dir, runs);
    assert_share("two processes at limit 50, together", share, 50.0);
    // Neither is starved.
    for (index, done) in done.iter().enumerate() {
        let own = done.get("launches") * 2.0 / (done.get("seconds") * 1000.0) * 100.0;
        assert!(own > 10.0, "process {index} got {own:.1}% of the device");
    }
}

#[test]
fn a_fork_in_the_middle_of_limited_launches_is_safe() {
    // The child (which cannot use the parent's contexts) exits normally; the parent's limiter,
    // its background thread included, goes on holding the share.
    let dir = ScratchDir::new("compute-fork");
    let run = compute_loop(
        &dir,
        &[("CUDA_DEVICE_SM_LIMIT", "40")],
        &["kernel", KERNEL, "2.6", "stream", "fork"],
    );
    let session = start(run);
    let truth = dir.truth();
    // The fork happens at 1.3 s; the window covers it.
    std::thread::sleep(Duration::from_millis(400));
    let share = busy_share(&truth);
    let done = finish(session);
    assert_eq!(done.get("child"), 7.0, "the forked child did not exit normally");
    assert_share("limit 40 across a fork", share, 40.0);
    // The child's exit flushes nothing of its copy of the parent's limiter: each launch is
    // counted once in the region.
    assert_eq!(
        compute_field(&dir, LAUNCHES_WORD) as f64,
        done.get("launches"),
        "the region's launch count"
    );
}

#[test]
fn recent_kernel_minus_one_blocks_launches_until_raised() {
    let dir = ScratchDir::new("compute-recent-kernel");
    let run = compute_loop(
        &dir,
        &[("CUDA_DEVICE_SM_LIMIT", "50")],
        &["kernel", KERNEL, "2.4", "stream"],
    );
    let session = start(run);
    let truth = dir.truth();
    std::thread::sleep(Duration::from_millis(400));
    let region = hold_region(&dir, 50);
    assert_eq!(region.hami().recent_kernel.load(Ordering::Relaxed), 2);
    region.hami().recent_kernel.store(-1, Ordering::Relaxed);
    // Launches already admitted finish; then nothing is launched while it stays -1.
    std::thread::sleep(Duration::from_millis(100));
    let before = truth.device(0).busy_ns();
    std::thread::sleep(Duration::from_millis(1000));
    let blocked = truth.device(0).busy_ns() - before;
    assert_eq!(
        region.hami().recent_kernel.load(Ordering::Relaxed),
        -1,
        "the library must not overwrite the monitor's -1"
    );
    region.hami().recent_kernel.store(1, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(100));
    let before = truth.device(0).busy_ns();
    std::thread::sleep(Duration::from_millis(500));
    let released = truth.device(0).busy_ns() - before;
    let recent_after = region.hami().recent_kernel.load(Ordering::Relaxed);
    let done = finish(session);
    assert_eq!(blocked, 0, "kernels ran while recent_kernel was -1");
    assert!(
        released as f64 > 0.3 * 500e6,
        "only {released} ns of kernels in 500 ms after recent_kernel was raised"
    );
    assert_eq!(recent_after, 2, "launches mark the container active again");
    assert!(done.get("max_launch_ns") > 900e6, "no launch was held for the second");
}

#[test]
fn policy_disable_never_limits() {
    let dir = ScratchDir::new("compute-disable");
    let run = compute_loop(
        &dir,
        &[
            ("CUDA_DEVICE_SM_LIMIT", "20"),
            ("GPU_CORE_UTILIZATION_POLICY", "disable"),
        ],
        &["kernel", KERNEL, RUN_SECONDS, "stream"],
    );
    let (share, _) = measure(&dir, vec![run]);
    assert!(share > 90.0, "disabled policy, limit 20: busy share {share:.1}");
    assert_eq!(compute_field(&dir, LAUNCHES_WORD), 0);
}

#[test]
fn switch_off_lifts_the_limit_unless_forced() {
    let cases = [(None, None), (Some("force"), Some(20.0))];
    let dirs = cases.map(|_| ScratchDir::new("compute-switch"));
    let regions = dirs.each_ref().map(|dir| hold_region(dir, 20));
    let sessions: Vec<Session> = cases
        .iter()
        .zip(dirs.iter().zip(&regions))
        .map(|((policy, _), (dir, region))| {
            region.hami().utilization_switch.store(0, Ordering::Relaxed);
            let mut env = vec![("CUDA_DEVICE_SM_LIMIT", "20")];
            if let Some(policy) = policy {
                env.push(("GPU_CORE_UTILIZATION_POLICY", policy));
            }
            start(compute_loop(dir, &env, &["kernel", KERNEL, RUN_SECONDS, "stream"]))
        })
        .collect();
    std::thread::sleep(WARM_UP);
    let truths = dirs.each_ref().map(ScratchDir::truth);
    let shares = busy_shares(truths.each_ref());
    sessions.into_iter().for_each(|session| {
        finish(session);
    });
    for (((_, expected), region), share) in cases.iter().zip(&regions).zip(shares) {
        assert_eq!(region.hami().utilization_switch.load(Ordering::Relaxed), 0);
        match expected {
            Some(limit) => assert_share("force with the switch off, limit 20", share, *limit),
            None => assert!(share > 90.0, "switch off, default policy: busy share {share:.1}"),
        }
    }
}

/// With the switch off (HAMi lifted the limit: the container alone on its GPU) the container runs
/// unheld, and its share is still published in its slot's `sm_util`, as HAMi-core does whenever a
/// limit is set: HAMi's utilisation metric does not show a busy pod as idle (it showed 0).
#[test]
fn the_share_is_published_while_the_switch_is_off() {
    // The limit from the process's variable, and from the region alone (set by `vgpu-smi set` or
    // HAMi before the process started, its variables naming none).
    let envs: [&[(&str, &str)]; 2] = [&[("CUDA_DEVICE_SM_LIMIT", "20")], &[]];
    let dirs = envs.map(|_| ScratchDir::new("compute-switch-published"));
    let regions = dirs.each_ref().map(|dir| hold_region(dir, 20));
    let sessions: Vec<Session> = envs
        .iter()
        .zip(dirs.iter().zip(&regions))
        .map(|(env, (dir, region))| {
            region.hami().utilization_switch.store(0, Ordering::Relaxed);
            start(compute_loop(dir, env, &["kernel", KERNEL, RUN_SECONDS, "stream"]))
        })
        .collect();
    std::thread::sleep(WARM_UP);
    let truths = dirs.each_ref().map(ScratchDir::truth);
    let shares = busy_shares(truths.each_ref());
    let published: Vec<u64> = sessions
        .iter()
        .zip(&dirs)
        .map(|(session, dir)| published_share(dir, session.pid() as i32).1)
        .collect();
    sessions.into_iter().for_each(|session| {
        finish(session);
    });
    for ((env, share), published) in envs.iter().zip(shares).zip(published) {
        assert!(share > 90.0, "switch off, {env:?}: busy share {share:.1}");
        assert!(
            published >= 85,
            "published sm_util {published} while the container ran at {share:.1}% with the switch \
             off, {env:?}"
        );
    }
}

#[test]
fn switching_the_limit_off_releases_a_waiting_launch() {
    // At 1% a 2 ms kernel admits one launch per 200 ms, so the program is waiting most of the
    // time; turning the switch off must let it run at full speed at once.
    let dir = ScratchDir::new("compute-release");
    let region = hold_region(&dir, 1);
    let run = compute_loop(
        &dir,
        &[("CUDA_DEVICE_SM_LIMIT", "1")],
        &["kernel", "busy_20000us", "2.0", "stream"],
    );
    let session = start(run);
    let truth = dir.truth();
    std::thread::sleep(Duration::from_millis(400));
    region.hami().utilization_switch.store(0, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(100));
    let share = busy_share(&truth);
    finish(session);
    assert!(share > 90.0, "after the switch went off: busy share {share:.1}");
}
