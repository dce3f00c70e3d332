//! The compute limiter's driver-facing parts from a job's first launch, with CUDA's lazy loading:
//! the fake driver's `FAKE_CUDA_MODULE_LOAD_US` makes the first launch of each function (and of
//! each executable graph) spend 20 ms of host time inside the launch call, as the real driver's
//! lazy loading does. The limiter's accuracy over every job shape is the simulation's
//! (`hook/src/throttle/sim.rs`, on a virtual clock); these few wall-clock cases check what it
//! does not run, the sensor's events and the poller's NVML readings on a driver:
//!
//! - two devices of one process each hold their own limit (per-device buckets and sensors);
//! - events that take GPU time of their own (`FAKE_CUDA_EVENT_NS`): NVML's trim takes out what a
//!   bracket adds beyond the fixed overhead;
//! - captures are never invalidated by the limiter's calls;
//! - four streams side by side are charged for their overlap (probes and windows of events).
//!
//! Jobs are `tests/programs/compute_jobs.c`; its counts are checked against the fake's ground truth
//! (each launched kernel adds its duration there).

use std::path::PathBuf;
use std::time::Duration;

use vgpu_integration::{Fields, Run, ScratchDir, Session, compiled_program, one_at_a_time};

/// Host time of each first launch (a function's lazy load, a graph's upload), in microseconds.
const LAZY_LOAD_US: &str = "20000";

fn program() -> PathBuf {
    compiled_program("compute_jobs")
}

/// The job with the hook and lazy loading, this job's files, and `env` on top of an environment
/// cleared of every limit, policy and fake-device variable.
fn job(dir: &ScratchDir, env: &[(&str, &str)], args: &str) -> Run {
    let mut run = Run::new(&program())
        .hooked()
        .env_remove("FAKE_CUDA_DEVICES")
        .env("FAKE_CUDA_MODULE_LOAD_US", LAZY_LOAD_US)
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.truth_path());
    for (key, value) in env {
        run = run.env(key, value);
    }
    run.args(args.split_whitespace())
}

/// What a job printed: its windows (`loop`, `graph`), its summary, its devices (`devices`).
struct Report {
    windows: Vec<Fields>,
    done: Option<Fields>,
    devices: Vec<Fields>,
}

impl Report {
    /// Iterations in each whole second from the first launch (the job prints 250 ms windows).
    fn per_second(&self, key: &str) -> Vec<f64> {
        self.windows
            .chunks_exact(4)
            .map(|second| second.iter().map(|w| w.get(key)).sum())
            .collect()
    }

    /// The busy share (percent) of each whole second, for launches of `us` microseconds each.
    fn busy_shares(&self, us: f64) -> Vec<f64> {
        self.per_second("launches")
            .iter()
            .map(|launches| launches * us / 1e4)
            .collect()
    }

    fn done(&self) -> &Fields {
        self.done.as_ref().expect("a summary line")
    }
}

fn finish(mut session: Session) -> Report {
    let output = session.finish();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "job failed ({}): {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let lines = |prefix: &str| -> Vec<Fields> {
        stdout
            .lines()
            .filter(|line| line.starts_with(prefix))
            .map(Fields::parse)
            .collect()
    };
    let report = Report {
        windows: lines("window "),
        done: lines("done ").pop(),
        devices: lines("device "),
    };
    for fields in report.done.iter().chain(&report.devices) {
        assert_eq!(fields.get("errors"), 0.0, "launches failed: {stdout}");
    }
    report
}

/// Runs a job that measures nothing against the wall clock, without waiting for its turn.
fn run_apart(run: Run) -> Report {
    finish(run.spawn(Duration::from_secs(60)))
}

/// Runs jobs side by side (so that they share the machine's load) and waits for all of them.
/// One measurement at a time in this file: these jobs are host-paced, and on a 2-core machine the
/// other tests' jobs, running in parallel, would take turns with them unevenly (a 250 ms window of
/// one job 20% short of the other's).
fn run_together<const N: usize>(runs: [Run; N]) -> [Report; N] {
    let _turn = one_at_a_time();
    let sessions = runs.map(|run| run.spawn(Duration::from_secs(60)));
    sessions.map(finish)
}

/// The ground truth saw exactly the kernels the job counted: `launches` of `us` each.
fn assert_truth_counts(dir: &ScratchDir, device: usize, launches: f64, us: f64) {
    let busy = dir.truth().device(device).busy_ns() as f64;
    assert_eq!(
        busy,
        launches * us * 1000.0,
        "device {device}: the ground truth's busy time is not the {launches} launches of {us} us the job counted"
    );
}

/// The fake driver alone (no hook): with `FAKE_CUDA_MODULE_LOAD_US` the first launch of each of
/// the 8 functions, and the first replay of a graph (its kernels were loaded when captured), take
/// the load's time inside the launch call, and no other launch does; without it none does.
#[test]
fn the_fake_driver_loads_each_function_and_graph_on_its_first_launch() {
    let unhooked = |dir: &ScratchDir, lazy: bool, args: &str| {
        let run = Run::new(&program())
            .env_remove("FAKE_CUDA_DEVICES")
            .env("FAKE_CUDA_TRUTH", dir.truth_path())
            .args(args.split_whitespace());
        if lazy {
            run.env("FAKE_CUDA_MODULE_LOAD_US", LAZY_LOAD_US)
        } else {
            run.env_remove("FAKE_CUDA_MODULE_LOAD_US")
        }
    };
    let dirs = ["lazy-loop", "lazy-graph", "eager-loop", "lazy-devices"]
        .map(|name| ScratchDir::new(&format!("compute-jobs-{name}")));
    let loop_args = "loop seconds=0.5 kernels=8 us=20 per_iteration=8 sync=1 window_ms=250";
    let [lazy_loop, lazy_graph, eager_loop, lazy_devices] = run_together([
        unhooked(&dirs[0], true, loop_args),
        unhooked(
            &dirs[1],
            true,
            "graph seconds=0.5 kernels=8 us=20 sync=10 window_ms=250",
        ),
        unhooked(&dirs[2], false, loop_args),
        unhooked(&dirs[3], true, "devices launches=40 us=100 sync=4").env("FAKE_CUDA_DEVICES", "2"),
    ]);
    let load_ns: f64 = LAZY_LOAD_US.parse::<f64>().expect("a number") * 1000.0;
    for (what, done, slow) in [
        ("8 functions", lazy_loop.done(), 8.0),
        ("a graph", lazy_graph.done(), 1.0),
        ("8 functions without lazy loading", eager_loop.done(), 0.0),
    ] {
        assert_eq!(done.get("slow_launches"), slow, "{what}: {:?}", done.0);
        assert!(done.get("launches") > 100.0, "{what}: {:?}", done.0);
    }
    for done in [lazy_loop.done(), lazy_graph.done()] {
        assert!(done.get("max_launch_ns") >= load_ns, "{:?}", done.0);
    }
    assert!(eager_loop.done().get("max_launch_ns") < load_ns / 2.0);
    // Each device's thread loads its own module's function once.
    for device in &lazy_devices.devices {
        assert_eq!(device.get("slow_launches"), 1.0, "{:?}", device.0);
    }
    // What the 8 first launches took is host time: the engine was busy only with the kernels.
    assert_truth_counts(&dirs[0], 0, lazy_loop.done().get("launches"), 20.0);
    assert_truth_counts(&dirs[1], 0, lazy_graph.done().get("launches"), 20.0);
}

/// Kernel duration of the two-device jobs, in microseconds.
const DEVICE_US: f64 = 1000.0;

/// One process, two devices, a thread on each launching `launches[d]` 1 ms kernels (synchronised
/// every 4); returns each device's (busy share in percent from its thread's first launch, the
/// thread's completion time in seconds).
fn two_devices(name: &str, env: &[(&str, &str)], launches: [u32; 2]) -> [(f64, f64); 2] {
    let dir = ScratchDir::new(&format!("compute-jobs-{name}"));
    let mut env = env.to_vec();
    env.extend([("FAKE_CUDA_DEVICES", "2"), ("GPU_CORE_UTILIZATION_POLICY", "FORCE")]);
    let args = format!("devices launches={},{} us={DEVICE_US} sync=4", launches[0], launches[1]);
    let [report] = run_together([job(&dir, &env, &args)]);
    assert_eq!(report.devices.len(), 2, "two device threads");
    let result = [0, 1].map(|device| {
        let fields = &report.devices[device];
        assert_eq!(fields.get("index"), device as f64);
        assert_eq!(fields.get("launches"), f64::from(launches[device]));
        // Each physical device's truth holds its own thread's kernels and nothing else.
        assert_truth_counts(&dir, device, f64::from(launches[device]), DEVICE_US);
        let seconds = fields.get("seconds");
        let busy = dir.truth().device(device).busy_ns() as f64;
        (busy / (seconds * 1e9) * 100.0, seconds)
    });
    eprintln!(
        "{name}: device 0 {:.1}% in {:.3} s, device 1 {:.1}% in {:.3} s",
        result[0].0, result[0].1, result[1].0, result[1].1
    );
    result
}

#[test]
fn two_devices_in_one_process_each_hold_their_own_limit() {
    // About 2 s on each device: 500 ms of kernels at 25%, 1500 ms at 75%.
    let env = [("CUDA_DEVICE_SM_LIMIT_0", "25"), ("CUDA_DEVICE_SM_LIMIT_1", "75")];
    let shares = two_devices("two-devices-25-75", &env, [500, 1500]);
    for (device, limit) in [(0, 25.0), (1, 75.0)] {
        let (share, seconds) = shares[device];
        assert!(
            (share - limit).abs() <= 3.0,
            "device {device}: busy share {share:.1}% from the first launch ({seconds:.3} s) at limit {limit}"
        );
    }
}

/// 16 us kernels at limit 50 for 4 s, 32 to a synchronisation, with the fake's events taking
/// 2.5 us of GPU time each (idle time, as on a real GPU; what a bracket read over a kernel of a
/// PyTorch training step on the H200): a bracket reads that much more than the kernel, 1 us of it
/// is taken off, and NVML's trim takes off the rest once it compares readings (from the 2nd
/// second): from the 3rd second the busy share is the limit on average (untrimmed, it would be
/// 16/17.5 of it) and no second runs over it.
#[test]
fn a_bracket_that_adds_2500_ns_is_trimmed_to_nvml() {
    const US: f64 = 16.0;
    let dir = ScratchDir::new("compute-jobs-events");
    let args = "loop seconds=4 kernels=1 us=16 per_iteration=32 sync=1 window_ms=250";
    let env = [("CUDA_DEVICE_SM_LIMIT", "50"), ("FAKE_CUDA_EVENT_NS", "2500")];
    let [report] = run_together([job(&dir, &env, args)]);
    let launches = report.done().get("launches");
    assert_truth_counts(&dir, 0, launches, US);
    let shares = report.busy_shares(US);
    eprintln!("events of 2500 ns at limit 50: busy share per second {shares:.1?}");
    assert_eq!(shares.len(), 4, "four whole seconds");
    let trimmed = &shares[2..];
    let mean = trimmed.iter().sum::<f64>() / trimmed.len() as f64;
    assert!(
        (mean - 50.0).abs() <= 2.5 && trimmed.iter().all(|share| *share <= 52.5),
        "from the 3rd second: busy {mean:.1}% on average at limit 50 (per second {shares:.1?})"
    );
}

/// A stream with 20 us kernels queued, then captured into a graph, over and over at limit 50 (a
/// framework warming up, then capturing on the same stream): the limiter never makes a call that a
/// capture forbids on the captured stream (the fake, as the real driver, invalidates a capture
/// whose stream is queried). A pair left open by the last launch before the capture used to query
/// the stream at the first captured launch.
#[test]
fn a_capture_after_queued_launches_is_never_invalidated() {
    let dir = ScratchDir::new("compute-jobs-capture");
    let env = [("CUDA_DEVICE_SM_LIMIT", "50")];
    let report = run_apart(job(&dir, &env, "capture seconds=2 us=20 per_iteration=2"));
    let done = report.done();
    eprintln!("capture after queued launches: {done:?}");
    assert!(
        done.get("iterations") >= 100.0,
        "too few iterations to say anything: {done:?}"
    );
    assert_eq!(
        done.get("captures_failed"),
        0.0,
        "captures failed (first status {}): {done:?}",
        done.get("first_error")
    );
}

/// A graph captured in global mode (PyTorch's default) on one thread while another thread of the
/// process launches limited kernels on a stream of its own: the library's calls on the launching
/// thread (the stream queries of its samples) are potentially unsafe calls, which a
/// global capture forbids to every thread in global mode. They must not invalidate it, and the
/// thread keeps its own mode.
#[test]
fn a_global_capture_survives_limited_launches_on_another_thread() {
    let dir = ScratchDir::new("compute-jobs-capture-other-thread");
    let env = [("CUDA_DEVICE_SM_LIMIT", "50")];
    let args = "capture seconds=2 us=20 per_iteration=2 hold_us=2000 other_thread=1";
    let report = run_apart(job(&dir, &env, args));
    let done = report.done();
    eprintln!("global capture beside another thread's launches: {done:?}");
    assert!(
        done.get("iterations") >= 100.0 && done.get("other_launches") >= 10_000.0,
        "too little of either thread to say anything: {done:?}"
    );
    assert_eq!(
        done.get("other_errors"),
        0.0,
        "the other thread's launches failed: {done:?}"
    );
    assert_eq!(
        done.get("other_mode_after"),
        0.0,
        "the launching thread's capture mode was not given back (0: global): {done:?}"
    );
    assert_eq!(
        done.get("captures_failed") + done.get("errors"),
        0.0,
        "captures failed (first status {}): {done:?}",
        done.get("first_error")
    );
}

/// Four threads, each with a stream of its own, launch 200 us kernels back to back for 3 s, with
/// no limit and at limit 50 side by side: the fake runs the streams' kernels side by side, as a
/// GPU does. Returns, for each, the share of the run the device was busy with them (the truth
/// counts overlapping kernels once) and how much of the run all their kernels would have taken
/// one after another.
fn four_streams() -> [(f64, f64); 2] {
    const US: f64 = 200.0;
    let args = "streams seconds=3 threads=4 us=200 sync=8 window_ms=250";
    let dirs = ["unset", "50"].map(|limit| ScratchDir::new(&format!("compute-jobs-streams-{limit}")));
    let reports = run_together([
        job(&dirs[0], &[], args),
        job(&dirs[1], &[("CUDA_DEVICE_SM_LIMIT", "50")], args),
    ]);
    [0, 1].map(|i| {
        let report = &reports[i];
        let run_ns = report.done().get("seconds") * 1e9;
        let occupied = dirs[i].truth().device(0).busy_ns() as f64 * 100.0 / run_ns;
        let summed = report.done().get("launches") * US * 1e3 * 100.0 / run_ns;
        eprintln!(
            "four streams, {}: device busy {occupied:.1}% of the run, kernels summed {summed:.1}% (per second {:.1?})",
            ["no limit", "limit 50"][i],
            report.busy_shares(US)
        );
        (occupied, summed)
    })
}

/// Kernels of several streams that overlap on the GPU are charged for the streams that had work
/// beside them (a window of brackets on the other streams says how many), and run side by side
/// under the limit (bursts): four streams at limit 50 keep the device busy half the time and do
/// close to half the work they do unlimited. Charged the sum of their brackets and admitted one
/// by one, they ran one after another and did an eighth of it. The windows read a little more
/// than the time the streams occupy the GPU together, which NVML's trim takes out only once it
/// compares readings (from the 2nd second, over seconds): in a 3 s run the streams stay a few
/// points under the limit, more on a loaded machine, so the bound below the limit is wider than
/// above it.
#[test]
fn kernels_of_four_streams_side_by_side_are_charged_for_their_overlap() {
    let [(unlimited, unlimited_summed), (occupied, summed)] = four_streams();
    assert!(
        unlimited_summed > 1.5 * unlimited,
        "the fake did not run the streams side by side: busy {unlimited:.1}%, summed {unlimited_summed:.1}%"
    );
    let work = summed / unlimited_summed;
    assert!(
        (42.0..=55.0).contains(&occupied) && work >= 0.4,
        "four streams at limit 50: the device was busy {occupied:.1}% of the run, doing {:.1}% of the unlimited work",
        work * 100.0
    );
}
