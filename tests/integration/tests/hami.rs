//! What HAMi's monitor relies on, against the fake driver: a process's slot and charges are given
//! back when it exits normally (return from `main`, `exit()`, `dlclose` of the library), a killed
//! process is reaped by the next attach, and nothing reports the memory or utilisation of a
//! process that is not alive; every launch moves `last_kernel_time`; the region's `limit[]` and
//! `sm_limit[]` are the limits running processes enforce, changed live, and checked.
//!
//! Every test uses its own folder for the region (`CUDA_DEVICE_MEMORY_SHARED_CACHE`) and the
//! fake's ground truth (`FAKE_CUDA_TRUTH`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vgpu_integration::answer_status as status;
use vgpu_integration::{Run, ScratchDir, Session, truth};
use vgpu_region::{SLOT_LIVE, Snapshot, read_snapshot};

const MIB: u64 = 1 << 20;
/// What each context takes on the fake (`FAKE_CUDA_CONTEXT_BYTES`).
const CONTEXT: u64 = 48 * MIB;

use vgpu_integration::compiled_program as program;

/// A fresh folder for one test's region and truth files.
struct TestDir(ScratchDir);

impl TestDir {
    fn new(name: &str) -> TestDir {
        TestDir(ScratchDir::new(&format!("hami-{name}")))
    }

    fn region(&self) -> PathBuf {
        self.0.join("region.cache")
    }

    fn snapshot(&self) -> Snapshot {
        snapshot(&self.region())
    }
}

fn snapshot(path: &Path) -> Snapshot {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read the region {}: {e}", path.display()));
    read_snapshot(&bytes).unwrap_or_else(|e| panic!("decode the region {}: {e}", path.display()))
}

/// `program` with the hook against the fake (one 16 GiB device), on the test's region, with
/// nothing inherited that could change the devices or limits, and these variables.
fn run(dir: &TestDir, program_name: &str, variables: &[(&str, &str)]) -> Run {
    let mut run = Run::new(&program(program_name))
        .hooked()
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.0.truth_path())
        .env("FAKE_CUDA_MEMORY", "16g")
        .env("FAKE_CUDA_CONTEXT_BYTES", CONTEXT.to_string());
    for (key, value) in variables {
        run = run.env(key, value);
    }
    run
}

fn start(dir: &TestDir, program_name: &str, variables: &[(&str, &str)]) -> Session {
    run(dir, program_name, variables).spawn(Duration::from_secs(60))
}

/// Sends a command that must succeed (first field after the name 0); returns the other fields.
fn ok(session: &mut Session, line: &str) -> Vec<String> {
    let answer = session.ask(line);
    let fields: Vec<String> = answer.split_whitespace().skip(1).map(str::to_string).collect();
    assert_eq!(fields.first().map(String::as_str), Some("0"), "{line}: {answer}");
    fields[1..].to_vec()
}

/// A process with a context on device 0 and `data` bytes allocated (kept).
fn holding(dir: &TestDir, program_name: &str, data: u64, variables: &[(&str, &str)]) -> Session {
    let mut session = start(dir, program_name, variables);
    ok(&mut session, "init");
    ok(&mut session, "ctx 0");
    if data > 0 {
        ok(&mut session, &format!("alloc {data}"));
    }
    session
}

/// The slot of `pid`, if the region has one in use.
fn slot_of(snapshot: &Snapshot, pid: u32) -> Option<&vgpu_region::ProcessSnapshot> {
    snapshot
        .processes
        .iter()
        .find(|process| process.pid == pid as i32 && process.status == SLOT_LIVE)
}

/// What HAMi's monitor sums for device 0: `used[0].total` over slots with a non-zero status
/// among `procs[0..proc_num]`.
fn hami_total(snapshot: &Snapshot) -> u64 {
    snapshot
        .processes
        .iter()
        .filter(|process| process.status != 0 && process.slot < snapshot.proc_num)
        .map(|process| process.memory[0].total)
        .sum()
}

/// Checks that `session` ended successfully and left no trace in the region.
fn assert_left_no_trace(dir: &TestDir, mut session: Session, how: &str) {
    let pid = session.pid();
    let output = session.finish();
    assert!(output.status.success(), "{how}: {output:?}");
    let after = dir.snapshot();
    assert!(
        slot_of(&after, pid).is_none(),
        "{how}: the slot survived: {:?}",
        after.processes
    );
    assert_eq!(
        (after.device_used(0), hami_total(&after), after.proc_num),
        (0, 0, 0),
        "{how}: memory or slots left in the region"
    );
}

#[test]
fn a_process_that_returns_from_main_or_calls_exit_gives_its_slot_back() {
    for (how, last) in [("return from main", "quit"), ("exit()", "exit 0")] {
        let dir = TestDir::new("normal-exit");
        let mut session = holding(&dir, "mem_ops", 100 * MIB, &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
        let pid = session.pid();
        let during = dir.snapshot();
        assert_eq!(
            slot_of(&during, pid).map(|slot| slot.memory[0].total),
            Some(CONTEXT + 100 * MIB),
            "{how}: the charge while running"
        );
        session.send(last);
        assert_left_no_trace(&dir, session, how);
    }
}

#[test]
fn a_limited_process_with_published_utilisation_gives_its_slot_back() {
    // The limiter's background thread writes the slot's sm_util every 250 ms: it must be stopped
    // before the slot is given back, and nothing of it may remain.
    let dir = TestDir::new("limited-exit");
    let mut session = holding(
        &dir,
        "monitor_launch",
        10 * MIB,
        &[("CUDA_DEVICE_SM_LIMIT", "50"), ("CUDA_DEVICE_MEMORY_LIMIT", "1g")],
    );
    ok(&mut session, "load");
    let pid = session.pid();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        ok(&mut session, "launch 20");
        let published = slot_of(&dir.snapshot(), pid).map_or(0, |slot| slot.sm_util[0]);
        if published > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no utilisation was published");
    }
    session.send("exit 0");
    assert_left_no_trace(&dir, session, "exit() while limited");
    let after = dir.snapshot();
    assert!(
        after.processes.iter().all(|process| process.sm_util[0] == 0),
        "utilisation left behind: {:?}",
        after.processes
    );
}

#[test]
fn a_forked_child_that_exits_gives_back_its_own_slot_and_not_its_parents() {
    let dir = TestDir::new("fork-exit");
    let mut parent = holding(&dir, "mem_ops", 64 * MIB, &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
    let answer = parent.ask(&format!("forkexit {}", 32 * MIB));
    let fields: Vec<&str> = answer.split_whitespace().collect();
    assert_eq!(fields.get(1), Some(&"0"), "the child failed: {answer}");
    let child: u32 = fields.get(2).and_then(|pid| pid.parse().ok()).expect("the child's pid");
    let after = dir.snapshot();
    assert!(slot_of(&after, child).is_none(), "the child's slot survived its exit()");
    assert_eq!(
        slot_of(&after, parent.pid()).map(|slot| slot.memory[0].total),
        Some(CONTEXT + 64 * MIB),
        "the parent's slot after its child's exit()"
    );
    assert_eq!(after.device_used(0), CONTEXT + 64 * MIB);
    parent.send("quit");
    assert_left_no_trace(&dir, parent, "the parent's return from main");
}

#[test]
fn a_killed_process_is_reaped_at_the_next_attach_and_never_shown_meanwhile() {
    let dir = TestDir::new("killed");
    let limit = [("CUDA_DEVICE_MEMORY_LIMIT", "1g")];
    // A process that keeps the region in use (a region nobody uses is rebuilt by its next user).
    let mut keeper = holding(&dir, "mem_ops", 0, &limit);
    let victim = holding(&dir, "mem_ops", 100 * MIB, &limit);
    let pid = victim.pid();
    victim.kill();
    // No destructor runs for SIGKILL: the slot stays until someone reaps it...
    let dead = dir.snapshot();
    assert_eq!(
        slot_of(&dead, pid).map(|slot| slot.memory[0].total),
        Some(CONTEXT + 100 * MIB)
    );
    // ...but NVML inside the container does not count it: neither in the keeper, nor in a
    // process that never initialises CUDA (as nvidia-smi), which reaps nothing.
    let expected = [
        (1u64 << 30).to_string(),
        CONTEXT.to_string(),
        ((1u64 << 30) - CONTEXT).to_string(),
    ];
    assert_eq!(
        ok(&mut keeper, "nvml 0"),
        expected,
        "the keeper's NVML total, used and free"
    );
    let mut viewer = start(&dir, "mem_ops", &limit);
    assert_eq!(ok(&mut viewer, "nvml 0"), expected, "nvidia-smi's total, used and free");
    viewer.send("quit");
    assert!(viewer.finish().status.success());
    assert!(slot_of(&dir.snapshot(), pid).is_some(), "a process without CUDA reaped");
    // The next process to attach reaps it.
    let mut next = holding(&dir, "mem_ops", 0, &limit);
    let after = dir.snapshot();
    assert!(
        slot_of(&after, pid).is_none(),
        "the killed process's slot survived an attach"
    );
    assert_eq!((after.device_used(0), hami_total(&after)), (2 * CONTEXT, 2 * CONTEXT));
    next.send("quit");
    assert!(next.finish().status.success());
    keeper.send("quit");
    assert_left_no_trace(&dir, keeper, "the last process's exit");
}

#[test]
fn unloading_the_library_gives_the_slot_back() {
    let dir = TestDir::new("unload");
    let hook = vgpu_integration::hook_library();
    let mut session = run(&dir, "unload", &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")])
        .env_remove("LD_PRELOAD")
        .args([hook.as_os_str(), (100 * MIB).to_string().as_ref()])
        .spawn(Duration::from_secs(60));
    let pid = session.pid();
    assert_eq!(session.read_line().as_deref(), Some("loaded 0"));
    assert_eq!(
        slot_of(&dir.snapshot(), pid).map(|slot| slot.memory[0].total),
        Some(CONTEXT + 100 * MIB),
        "the charge while loaded"
    );
    assert_eq!(
        session.ask("unload"),
        "unloaded 0",
        "dlclose did not unload the library"
    );
    // The process goes on: only the unload gave the slot back.
    let after = dir.snapshot();
    assert!(slot_of(&after, pid).is_none(), "the slot survived the unload");
    assert_eq!((after.device_used(0), hami_total(&after), after.proc_num), (0, 0, 0));
    assert_eq!(session.read_line().as_deref(), Some("alive"));
    let output = session.finish();
    assert!(output.status.success(), "{output:?}");
}

#[test]
fn a_library_whose_threads_run_is_kept_loaded_and_gives_the_slot_back_at_exit() {
    // A launch starts the library's tick thread: a dlclose must not unmap the code it runs.
    let dir = TestDir::new("unload-launched");
    let hook = vgpu_integration::hook_library();
    let mut session = run(&dir, "unload", &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")])
        .env_remove("LD_PRELOAD")
        .args([hook.as_os_str(), (100 * MIB).to_string().as_ref(), "launch".as_ref()])
        .spawn(Duration::from_secs(60));
    let pid = session.pid();
    assert_eq!(session.read_line().as_deref(), Some("loaded 0"));
    assert_eq!(
        session.ask("unload"),
        "unloaded 1",
        "the library was unmapped under its thread"
    );
    assert_eq!(session.read_line().as_deref(), Some("alive"));
    assert!(
        slot_of(&dir.snapshot(), pid).is_some(),
        "kept loaded, it keeps its slot until exit"
    );
    let output = session.finish();
    assert!(output.status.success(), "{output:?}");
    let after = dir.snapshot();
    assert!(slot_of(&after, pid).is_none(), "the slot survived the exit");
    assert_eq!((after.device_used(0), hami_total(&after)), (0, 0));
}

// ------------------------------------------------------------------------------------------------
// last_kernel_time: every launch, limited or not, and every attach.

/// Joins the test's region (as a monitor would: no slot).
fn join(dir: &TestDir) -> vgpu_region::Region {
    vgpu_region::Region::open(&dir.region(), &vgpu_region::InitParams::default()).expect("join the region")
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_secs() as i64
}

/// A time long past, written into `last_kernel_time` to see who writes it next.
const LONG_AGO: i64 = 1_000_000_000;

fn last_kernel_time(region: &vgpu_region::Region) -> i64 {
    region
        .hami()
        .last_kernel_time
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// Waits up to `limit` for `last_kernel_time` to be now (within 2 s); returns how long it took.
fn wait_for_kernel_time(region: &vgpu_region::Region, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if last_kernel_time(region) >= unix_now() - 2 {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// `CUDA_DISABLE_CONTROL=true` (HAMi's device plugin sets it for a container it does not limit):
/// the preloaded library passes everything through: no region file, no memory limit (even a
/// malformed one), launches not limited, the driver's own memory figures.
#[test]
fn disable_control_passes_everything_through() {
    let dir = TestDir::new("disable-control");
    let variables = [
        ("CUDA_DISABLE_CONTROL", "true"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
        ("CUDA_DEVICE_SM_LIMIT", "10"),
    ];
    let mut process = holding(&dir, "monitor_launch", 0, &variables);
    ok(&mut process, &format!("alloc {}", 2048 * MIB));
    ok(&mut process, "load");
    // 100 launches of 1 ms: at limit 10 they would take a second.
    let took: f64 = ok(&mut process, "launch 100")[0].parse().expect("milliseconds");
    assert!(took < 500.0, "launches took {took} ms: limited");
    process.send("quit");
    let output = process.finish();
    assert!(output.status.success(), "{output:?}");
    assert!(!dir.region().exists(), "a region file was made");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("ERROR") && !stderr.contains("WARN"), "{stderr}");
    // Malformed limits are not read either; a CUDA_DISABLE_CONTROL that is neither true nor false
    // is read as false, as HAMi's device plugin reads it (it mounts the library), with a warning.
    let mut malformed = start(
        &dir,
        "monitor_launch",
        &[("CUDA_DISABLE_CONTROL", "true"), ("CUDA_DEVICE_MEMORY_LIMIT", "lots")],
    );
    ok(&mut malformed, "init");
    malformed.send("quit");
    assert!(malformed.finish().status.success());
    let mut unread = holding(
        &dir,
        "mem_ops",
        0,
        &[("CUDA_DISABLE_CONTROL", "yes"), ("CUDA_DEVICE_MEMORY_LIMIT", "1g")],
    );
    assert_eq!(
        status(&unread.ask(&format!("alloc {}", 2048 * MIB))),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    unread.send("quit");
    let output = unread.finish();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr
            .matches("CUDA_DISABLE_CONTROL=\"yes\" is neither true nor false")
            .count(),
        1,
        "{stderr}"
    );
}

/// A process that launches and exits within the tick's period leaves its last launches in
/// `last_kernel_time`, limited or not (before, it left the time it attached).
#[test]
fn the_last_launches_before_exit_are_in_last_kernel_time() {
    for (name, variables) in [
        ("unlimited", &[][..]),
        ("limited", &[("CUDA_DEVICE_SM_LIMIT", "50")][..]),
    ] {
        let dir = TestDir::new("kernel-time-exit");
        let mut process = holding(&dir, "monitor_launch", 0, variables);
        ok(&mut process, "load");
        let region = join(&dir);
        region
            .hami()
            .last_kernel_time
            .store(LONG_AGO, std::sync::atomic::Ordering::Relaxed);
        ok(&mut process, "launch 5");
        process.send("quit");
        let output = process.finish();
        assert!(output.status.success(), "{name}: {output:?}");
        assert!(
            last_kernel_time(&region) >= unix_now() - 2,
            "{name}: the launches before exit are not in last_kernel_time ({})",
            last_kernel_time(&region)
        );
    }
}

#[test]
fn every_launch_moves_last_kernel_time_limited_or_not_and_every_attach_sets_it() {
    /// A name, the processes' variables, and what `utilization_switch` is set to.
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], Option<i32>);
    let cases: [Case; 3] = [
        ("unlimited", &[], None),
        ("limited", &[("CUDA_DEVICE_SM_LIMIT", "50")], None),
        (
            "limited, utilization_switch 0",
            &[("CUDA_DEVICE_SM_LIMIT", "50")],
            Some(0),
        ),
    ];
    for (name, variables, switch) in cases {
        let dir = TestDir::new("kernel-time");
        let mut first = holding(&dir, "monitor_launch", 0, variables);
        ok(&mut first, "load");
        let region = join(&dir);
        if let Some(switch) = switch {
            region
                .hami()
                .utilization_switch
                .store(switch, std::sync::atomic::Ordering::Relaxed);
        }
        // Attach: a second process's cuInit writes it.
        region
            .hami()
            .last_kernel_time
            .store(LONG_AGO, std::sync::atomic::Ordering::Relaxed);
        let mut second = holding(&dir, "monitor_launch", 0, variables);
        assert!(
            last_kernel_time(&region) >= unix_now() - 2,
            "{name}: attach did not write last_kernel_time"
        );
        // No launch, no write.
        region
            .hami()
            .last_kernel_time
            .store(LONG_AGO, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(1200));
        assert_eq!(last_kernel_time(&region), LONG_AGO, "{name}: written without a launch");
        // A launch: written within about a second (the tick).
        ok(&mut first, "launch 2");
        let took = wait_for_kernel_time(&region, Duration::from_secs(3));
        assert!(took.is_some(), "{name}: a launch did not move last_kernel_time");
        // Idle again: not rewritten; launching again moves it again.
        std::thread::sleep(Duration::from_millis(1100));
        region
            .hami()
            .last_kernel_time
            .store(LONG_AGO, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(1200));
        assert_eq!(last_kernel_time(&region), LONG_AGO, "{name}: rewritten while idle");
        ok(&mut first, "launch 2");
        assert!(
            wait_for_kernel_time(&region, Duration::from_secs(3)).is_some(),
            "{name}: a later launch did not move last_kernel_time"
        );
        second.send("quit");
        first.send("quit");
        assert!(second.finish().status.success());
        assert!(first.finish().status.success());
    }
}

// ------------------------------------------------------------------------------------------------
// Live limits: the region's limit[] and sm_limit[] are what running processes enforce.

fn set_memory_limit(region: &vgpu_region::Region, bytes: u64) {
    region.hami().limit[0].store(bytes, std::sync::atomic::Ordering::Relaxed);
}

fn set_sm_limit(region: &vgpu_region::Region, percent: u64) {
    region.hami().sm_limit[0].store(percent, std::sync::atomic::Ordering::Relaxed);
}

/// The answer's status field (after the command name).
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

/// Lines of a finished program's stderr that contain `text`.
fn stderr_lines_with(output: &std::process::Output, text: &str) -> usize {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|line| line.contains(text))
        .count()
}

#[test]
fn a_memory_limit_changed_in_the_region_takes_effect_at_once_and_frees_nothing() {
    let dir = TestDir::new("live-memory");
    let mut session = holding(&dir, "mem_ops", 300 * MIB, &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
    let region = join(&dir);
    let used = CONTEXT + 300 * MIB;
    assert_eq!(dir.snapshot().device_used(0), used);
    // Lowered below the usage: new allocations are refused, nothing is freed, and the virtual
    // device shows the new total with nothing free.
    set_memory_limit(&region, 200 * MIB);
    assert_eq!(status(&session.ask("alloc 1")), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(dir.snapshot().device_used(0), used, "lowering the limit freed memory");
    let limit = (200 * MIB).to_string();
    assert_eq!(
        ok(&mut session, "info"),
        ["0", limit.as_str()],
        "cuMemGetInfo: free, total"
    );
    assert_eq!(ok(&mut session, "nvml 0"), [limit.as_str(), limit.as_str(), "0"]);
    // Raised: more than the first limit fits.
    set_memory_limit(&region, 2 << 30);
    ok(&mut session, &format!("alloc {}", 1200 * MIB));
    assert_eq!(dir.snapshot().device_used(0), used + 1200 * MIB);
    // Lifted (0 = none): the physical device.
    set_memory_limit(&region, 0);
    ok(&mut session, &format!("alloc {}", 4u64 << 30));
    // A new process of the container follows the region, not its variables, and says so once.
    set_memory_limit(&region, 6 << 30);
    let mut joiner = holding(&dir, "mem_ops", 0, &[("CUDA_DEVICE_MEMORY_LIMIT", "16g")]);
    let room = (6u64 << 30) - dir.snapshot().device_used(0);
    assert_eq!(
        status(&joiner.ask(&format!("alloc {}", room + 1))),
        CUDA_ERROR_OUT_OF_MEMORY,
        "the joiner used its own variable's limit"
    );
    ok(&mut joiner, &format!("alloc {room}"));
    joiner.send("quit");
    let joined = joiner.finish();
    assert_eq!(
        stderr_lines_with(&joined, "the region's applies"),
        1,
        "{}",
        String::from_utf8_lossy(&joined.stderr)
    );
    session.send("quit");
    let output = session.finish();
    // Every change the process saw is one warning line, old and new: nothing is lifted silently.
    let stderr = String::from_utf8_lossy(&output.stderr);
    for change in [
        "from 1073741824 bytes (1024 MiB) to 209715200 bytes (200 MiB)",
        "from 209715200 bytes (200 MiB) to 2147483648 bytes (2048 MiB)",
        "from 2147483648 bytes (2048 MiB) to none",
    ] {
        assert_eq!(stderr_lines_with(&output, change), 1, "{change}: {stderr}");
    }
}

/// The busy share (percent) of physical device 0 over `window`, from the fake's ground truth.
fn busy_share(truth: &truth::Truth, window: Duration) -> f64 {
    let (busy, at) = (truth.device(0).busy_ns(), Instant::now());
    std::thread::sleep(window);
    let (after, elapsed) = (truth.device(0).busy_ns(), at.elapsed());
    (after - busy) as f64 * 100.0 / elapsed.as_nanos() as f64
}

/// The compute_loop program: 2 ms kernels on a stream for `seconds`, four deep.
fn compute_loop(dir: &TestDir, seconds: &str, variables: &[(&str, &str)]) -> Session {
    let mut session = run(dir, "compute_loop", variables)
        .args(["kernel", "busy_2000us", seconds, "stream"])
        .spawn(Duration::from_secs(60));
    assert_eq!(session.read_line().as_deref(), Some("ready"));
    session
}

#[test]
fn a_compute_limit_raised_live_limits_an_unlimited_process_within_a_second() {
    let dir = TestDir::new("live-compute");
    let session = compute_loop(&dir, "6.5", &[]);
    let truth = dir.0.truth();
    let region = join(&dir);
    std::thread::sleep(Duration::from_millis(500));
    // The whole device, far from 20% (the bar is low: this host-paced loop runs under the load
    // of other tests too).
    let unlimited = busy_share(&truth, Duration::from_millis(800));
    assert!(unlimited > 60.0, "before any limit: busy share {unlimited:.1}%");
    // Raised from none to 20%: held within a second.
    set_sm_limit(&region, 20);
    std::thread::sleep(Duration::from_millis(1000));
    let limited = busy_share(&truth, Duration::from_millis(1500));
    // Lifted again: back to the whole device within a second.
    set_sm_limit(&region, 0);
    std::thread::sleep(Duration::from_millis(1000));
    let lifted = busy_share(&truth, Duration::from_millis(1000));
    let mut session = session;
    let output = session.finish();
    eprintln!("busy share: unlimited {unlimited:.1}%, limited {limited:.1}%, lifted {lifted:.1}%");
    assert!(output.status.success(), "{output:?}");
    assert!(
        (limited - 20.0).abs() <= 5.0,
        "a second after the limit was set to 20: busy share {limited:.1}%"
    );
    assert!(
        lifted > 60.0,
        "a second after the limit was lifted: busy share {lifted:.1}%"
    );
    assert_eq!(stderr_lines_with(&output, "changed from none to 20%"), 1, "{output:?}");
    assert_eq!(stderr_lines_with(&output, "changed from 20% to none"), 1, "{output:?}");
}

#[test]
fn garbage_limits_in_the_region_never_crash_nor_lift_a_limit_silently() {
    // A compute limit that is no percentage is ignored: the limit in force stays, said once.
    let dir = TestDir::new("garbage-compute");
    let session = compute_loop(&dir, "4", &[("CUDA_DEVICE_SM_LIMIT", "30")]);
    let truth = dir.0.truth();
    let region = join(&dir);
    std::thread::sleep(Duration::from_millis(300));
    set_sm_limit(&region, 250);
    std::thread::sleep(Duration::from_millis(700));
    let share = busy_share(&truth, Duration::from_millis(2000));
    set_sm_limit(&region, u64::MAX);
    let mut session = session;
    let output = session.finish();
    eprintln!("busy share with sm_limit 250 over a limit of 30: {share:.1}%");
    assert!(output.status.success(), "{output:?}");
    assert!((share - 30.0).abs() <= 5.0, "with sm_limit 250: busy share {share:.1}%");
    assert_eq!(
        stderr_lines_with(&output, "holds sm_limit 250, which is not a percentage"),
        1,
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    // A memory limit is any size; a huge one is in force, and said (not lifted silently).
    let dir = TestDir::new("garbage-memory");
    let mut session = holding(&dir, "mem_ops", 0, &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
    let region = join(&dir);
    set_memory_limit(&region, u64::MAX);
    ok(&mut session, &format!("alloc {}", 2u64 << 30));
    session.send("quit");
    let output = session.finish();
    assert!(output.status.success());
    assert_eq!(
        stderr_lines_with(&output, "to 18446744073709551615 bytes"),
        1,
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs `vgpu-smi` (built with the workspace) with these arguments (through the test runner, an
/// emulator for another architecture).
fn vgpu_smi(arguments: &[&str]) -> std::process::Output {
    let path = vgpu_integration::vgpu_smi();
    vgpu_test_spawn::output_started(
        vgpu_integration::command(&path)
            .args(arguments)
            .env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE"),
    )
    .expect("run vgpu-smi")
}

#[test]
fn vgpu_smi_set_changes_a_running_containers_limits() {
    let dir = TestDir::new("smi-set");
    let mut session = holding(&dir, "mem_ops", 300 * MIB, &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
    let region = dir.region().display().to_string();
    let output = vgpu_smi(&["set", "--region", &region, "--memory", "200m", "--sm", "30"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        stdout,
        format!(
            "{region}:\n  GPU 0 (GPU-00000000-0000-0000-0000-000000000000): memory 1.00 GiB -> 200 MiB, compute none -> 30%\n"
        )
    );
    let after = dir.snapshot();
    assert_eq!((after.limits[0], after.sm_limits[0]), (200 * MIB, 30));
    // In force at once: over the new limit, and nothing freed.
    assert_eq!(status(&session.ask("alloc 1")), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(dir.snapshot().device_used(0), CONTEXT + 300 * MIB);
    // One of the two, on one device; 100% is no limit.
    let output = vgpu_smi(&["set", "--region", &region, "--device", "0", "--sm", "100"]);
    assert!(output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("memory 200 MiB (unchanged), compute 30% -> none"),
        "{output:?}"
    );
    assert_eq!(dir.snapshot().sm_limits[0], 0);

    // Refused, each with one line and nothing written: values the variables refuse (usage, 2),
    // a device the region does not have, a directory (1).
    let before = std::fs::read(dir.region()).expect("read the region");
    for (arguments, code, message) in [
        (vec!["--memory", "4q"], 2, "invalid value '4q' for '--memory <SIZE>'"),
        (vec!["--sm", "101"], 2, "invalid value '101' for '--sm <PERCENT>'"),
        (vec![], 2, "the following required arguments were not provided"),
        (
            vec!["--device", "3", "--sm", "20"],
            1,
            "it has no device 3 (1 device registered",
        ),
    ] {
        let mut full = vec!["set", "--region", region.as_str()];
        full.extend(arguments);
        let output = vgpu_smi(&full);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(code), "{full:?}: {stderr}");
        assert!(
            stderr.lines().next().is_some_and(|line| line.contains(message)),
            "{full:?}: {stderr}"
        );
    }
    let directory = dir.0.path().display().to_string();
    let output = vgpu_smi(&["set", "--region", &directory, "--sm", "20"]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stderr).lines().count(), 1, "{output:?}");
    // The lock's hint words move with every acquisition (a refused set takes the lock to read).
    let without_lock_words = |mut bytes: Vec<u8>| {
        let start = vgpu_region::FILE_LOCK_OFFSET as usize;
        let words = start..start + std::mem::size_of::<vgpu_region::LockWords>();
        bytes[words].fill(0);
        bytes
    };
    assert!(
        without_lock_words(std::fs::read(dir.region()).expect("read the region")) == without_lock_words(before.clone()),
        "a refused set wrote"
    );

    // Once no process uses the region, a change still lasts: the container's next process, with
    // other variables, keeps the region's limits (and says so once).
    session.send("quit");
    assert!(session.finish().status.success());
    let output = vgpu_smi(&["set", "--region", &region, "--sm", "20"]);
    assert!(output.status.success(), "{output:?}");
    assert_eq!((dir.snapshot().limits[0], dir.snapshot().sm_limits[0]), (200 * MIB, 20));
    let mut next = holding(
        &dir,
        "mem_ops",
        0,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "1g"), ("CUDA_DEVICE_SM_LIMIT", "60")],
    );
    assert_eq!((dir.snapshot().limits[0], dir.snapshot().sm_limits[0]), (200 * MIB, 20));
    next.send("quit");
    let output = next.finish();
    assert!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("holds a memory limit of") && stderr.contains("holds a compute limit of"),
        "{stderr}"
    );
    // A file that is not a region is refused with one line and left as it is.
    let not_a_region = dir.0.path().join("not-a-region");
    std::fs::write(&not_a_region, b"hello").expect("write");
    let output = vgpu_smi(&["set", "--region", &not_a_region.display().to_string(), "--sm", "20"]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stderr).lines().count(), 1, "{output:?}");
    assert_eq!(std::fs::read(&not_a_region).expect("read"), b"hello");
}
