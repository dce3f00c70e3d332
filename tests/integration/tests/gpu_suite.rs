//! The GPU suite's own logic, which CI cannot run on a GPU: the parser of the limiter's debug log
//! (`tests/gpu/limiter_log.py`) reads what the hook really writes, and the jobs benchmark
//! (`tests/gpu/compute_jobs_bench.py`) scores a matrix, with `compute_jobs_fake.py` standing in
//! for PyTorch. A drift of the log's format, or a bench that crashes in its summary, would
//! otherwise first show on the GPU machine, after its time was spent.

use std::path::{Path, PathBuf};
use std::process::Command;

use vgpu_integration::{Run, ScratchDir, compiled_program, hook_library, one_at_a_time, workspace_root};

/// `python3` as the test's own PATH finds it: a command whose PATH is changed would look there.
fn python3() -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("python3"))
                .find(|candidate| candidate.is_file())
        })
        .expect("python3 on PATH (the GPU suite's scripts need it)")
}

fn python(script: &str) -> Command {
    let mut command = Command::new(python3());
    command.arg(workspace_root().join("tests").join("gpu").join(script));
    command
}

/// Runs a command to completion and returns its stdout; fails the test with its output otherwise.
fn stdout_of(command: &mut Command) -> String {
    let output = vgpu_test_spawn::output_started(command).expect("run python3");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{command:?} failed ({}): {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// A limited job's debug log, as the hook writes it, summarised by limiter_log.py: the keys and
/// their measurements, and the per-period share the bucket charged (the limit).
#[test]
fn the_log_summary_reads_the_hooks_debug_lines() {
    let _alone = one_at_a_time();
    let dir = ScratchDir::new("gpu-suite-log");
    let output = Run::new(&compiled_program("compute_jobs"))
        .hooked()
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("CUDA_DEVICE_SM_LIMIT", "50")
        .env("LIBCUDA_LOG_LEVEL", "4")
        .args("loop seconds=4 kernels=2 us=50 per_iteration=8 sync=1 window_ms=1000".split_whitespace())
        .output();
    assert!(
        output.status.success(),
        "the job failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let log = dir.join("job.err");
    std::fs::write(&log, &output.stderr).expect("write the log");
    let summary = stdout_of(python("limiter_log.py").arg(&log));
    eprintln!("{summary}");

    let first = summary.lines().next().unwrap_or_default();
    let measurements: u64 = first
        .split_once(" keys, ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("no count of measurements in the summary's first line: {summary}"));
    assert!(measurements >= 20, "too few measurements read: {summary}");
    let charged = summary
        .lines()
        .find(|line| line.starts_with("device 0 charged % per period:"))
        .unwrap_or_else(|| panic!("no per-period line: {summary}"));
    let mean: f64 = charged
        .split("mean from the 2nd ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .and_then(|mean| mean.trim().parse().ok())
        .unwrap_or_else(|| panic!("no mean in {charged}"));
    assert!(
        (mean - 50.0).abs() <= 5.0,
        "charged {mean}% a period at limit 50: {summary}"
    );
    assert!(
        summary
            .lines()
            .any(|line| line.starts_with("device 0 trim per period:")),
        "no trim line: {summary}"
    );
}

/// limiter_record.py reads what `vgpu-smi --watch --record` writes of a real hooked job: a loop
/// of short kernels held to 20% is held most of each second; the same loop without a limit is
/// never held.
#[test]
fn the_held_record_reads_vgpu_smi() {
    let _alone = one_at_a_time();
    for (limit, held_from_the_2nd) in [(Some("20"), 40.0..=100.0), (None, 0.0..=0.5)] {
        let dir = ScratchDir::new("gpu-suite-held");
        let record = dir.join("record.jsonl");
        let mut recorder = vgpu_test_spawn::spawn_started(
            Command::new(vgpu_integration::vgpu_smi())
                .arg("--region")
                .arg(dir.region())
                .args(["--watch", "0.1", "--record"])
                .arg(&record)
                .stdout(std::process::Stdio::null()),
        )
        .expect("start vgpu-smi");
        // The job's first second must come after the recorder's first sample.
        let waiting = std::time::Instant::now();
        while std::fs::read_to_string(&record).map_or(true, |text| !text.contains('\n')) {
            assert!(
                waiting.elapsed() < std::time::Duration::from_secs(20),
                "vgpu-smi recorded nothing in 20 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let mut job = Run::new(&compiled_program("compute_jobs"))
            .hooked()
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
            .args("loop seconds=3 kernels=2 us=50 per_iteration=8 sync=1 window_ms=1000".split_whitespace());
        if let Some(limit) = limit {
            job = job.env("CUDA_DEVICE_SM_LIMIT", limit);
        }
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("a clock after 1970")
            .as_secs_f64();
        let output = job.output();
        // The recorder's last samples cover the job's end.
        std::thread::sleep(std::time::Duration::from_millis(300));
        recorder.kill().expect("stop vgpu-smi");
        recorder.wait().expect("reap vgpu-smi");
        assert!(
            output.status.success(),
            "the job failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        // The job's set-up before its first launch is short on the fake: the seconds from the
        // start are close enough to the job's own.
        let line = stdout_of(
            python("limiter_record.py")
                .arg(&record)
                .arg(format!("{started:.3}"))
                .arg("3"),
        );
        let shares: Vec<f64> = line
            .strip_prefix("held by the limiter, % of each second: ")
            .and_then(|rest| rest.split(" | ").next())
            .map(|shares| {
                shares
                    .split_whitespace()
                    .filter_map(|share| share.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(shares.len(), 3, "limit {limit:?}: {line}");
        for share in &shares[1..] {
            assert!(held_from_the_2nd.contains(share), "limit {limit:?}: {line}");
        }
    }
}

/// A matrix on the stand-in worker: the points a perfect limiter holds pass, the job the stand-in
/// makes overshoot by 3 points misses on its mean, each job's native runs are scored against
/// each other in the summary, and the worker's per-second record of its thread is printed.
#[test]
fn the_jobs_benchmark_scores_a_matrix() {
    let _alone = one_at_a_time();
    let dir = ScratchDir::new("gpu-suite-bench");
    let gpu = workspace_root().join("tests").join("gpu");
    let worker = gpu.join("compute_jobs_fake.py");
    let mut command = python("compute_jobs_bench.py");
    command
        .arg(hook_library())
        .arg(dir.path())
        .current_dir(&gpu)
        .env_remove("COMPUTE_PART")
        .env_remove("LIBCUDA_LOG_LEVEL")
        .env("COMPUTE_WORKER", &worker)
        .env("COMPUTE_JOBS", "smallops paused")
        .env("COMPUTE_LIMITS", "10 50")
        .env("COMPUTE_SECONDS", "5")
        .env("COMPUTE_MULTI", "0")
        .env("COMPUTE_GPUS", "1")
        .env("COMPUTE_NATURAL", "smallops=40 paused=20")
        // No nvidia-smi sampling: the natural shares are given.
        .env("PATH", Path::new("/usr/bin:/bin"));
    let report = stdout_of(&mut command);
    eprintln!("{report}");

    let result = |job: &str, limit: &str| -> String {
        let prefix = format!("| {job} | {limit} |");
        let row = report
            .lines()
            .find(|line| line.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no summary row for {job} at {limit}: {report}"));
        row.trim_end_matches('|')
            .rsplit('|')
            .next()
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    assert_eq!(result("smallops", "10"), "PASS");
    assert_eq!(result("smallops", "50"), "PASS");
    assert_eq!(result("paused", "10"), "MISS", "the stand-in overshoots 3 points at 10");
    assert!(
        report.contains("missed targets: paused 10 (mean +"),
        "the miss is not named with its mean: {report}"
    );
    let spread = report
        .lines()
        .find(|line| line.starts_with("each job's native runs against each other"))
        .unwrap_or_else(|| panic!("no line on the jobs' own spread: {report}"));
    assert!(spread.contains("smallops ") && spread.contains("paused "), "{spread}");
    assert!(
        report.contains("its thread's CPU per second: 0 1 0 1 0 | preempted: ? 1 2 3 4 | % on a CPU: ? 100 99 98 97"),
        "no line on the job's thread per second: {report}"
    );
}

/// The boost constants' check (`boost_fit.py`) reads a real report of the jobs benchmark: the H200
/// GEMM's matrix of 2026-12-03 afternoon, busy all the time at 1478-1494 MHz, under the floor
/// heaviest_work 1.2 set (1549 MHz) and over the one 1.3 sets (1468 MHz), with the constants of the
/// profile the report's GPU has in boards.toml.
#[test]
fn the_boost_check_reads_a_jobs_report() {
    let report = workspace_root().join("tests/fixtures/2026-12-03-trimmed-share-compute-jobs-part1.txt");
    let check = |heaviest: &str| stdout_of(python("boost_fit.py").args(["--heaviest", heaviest]).arg(&report));
    let now = check("1.3");
    assert!(
        now.starts_with("profile: NVIDIA H200 (idle_share 0.17, alpha 1.5, beta 0.66, heaviest_work 1.3)\n"),
        "{now}"
    );
    assert!(
        now.contains("gemm busy all the time at 1484 MHz (1480 1494 1478)"),
        "{now}"
    );
    let row = now
        .lines()
        .find(|line| line.trim_start().starts_with("90 "))
        .unwrap_or_else(|| panic!("no row for the limit of 90: {now}"));
    let fields: Vec<&str> = row.split_whitespace().collect();
    // 92.0 of GPU share in 87% of NVML's busy time; the power's model 1.051, the clock's bound
    // (1630 / 1468)^0.66.
    assert_eq!(
        fields,
        [
            "90", "87", "1630", "685", "1.057", "0.60", "1.120", "1.21", "1.051", "1.071"
        ],
        "{row}"
    );
    assert!(
        now.contains("left out (busy under 20%)"),
        "the limit of 10 (NVML 9%) is left out: {now}"
    );
    assert!(
        now.contains("floor: 1468 MHz with heaviest_work 1.3; the lowest full-load clock 1478 MHz is at or above it"),
        "{now}"
    );
    // The training step busy all the time runs at its highest clock already (1976-1979 MHz): no
    // boost, so no exponents to fit (the log of a clock ratio near 1 would give any number).
    let train = stdout_of(
        python("boost_fit.py")
            .args(["--job", "train"])
            .arg(workspace_root().join("tests/fixtures/2026-12-03-compute-jobs-part2.txt")),
    );
    assert_eq!(
        train
            .matches("left out (no boost: the clock within 2% of full load's)")
            .count(),
        4,
        "the limits of 25 to 90 at 1980 MHz: {train}"
    );
    assert!(!train.contains("beta: median"), "{train}");
    let before = check("1.2");
    assert!(
        before.contains("floor: 1549 MHz with heaviest_work 1.2; the lowest full-load clock 1478 MHz is BELOW it")
            && before.contains("heaviest_work of at least 1.29"),
        "{before}"
    );
}
