//! What HAMi's monitor relies on, against the fake driver: a process's slot and charges are given
//! back when it exits normally (return from `main`, `exit()`, `dlclose` of the library), a killed
//! process is reaped by the next attach, and nothing reports the memory or utilisation of a
//! process that is not alive.
//!
//! Every test uses its own folder for the region (`CUDA_DEVICE_MEMORY_SHARED_CACHE`) and the
//! fake's ground truth (`FAKE_CUDA_TRUTH`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use vgpu_integration::{Run, ScratchDir, Session, c_program};
use vgpu_region::{SLOT_LIVE, Snapshot, read_snapshot};

const MIB: u64 = 1 << 20;
/// What each context takes on the fake (`FAKE_CUDA_CONTEXT_BYTES`).
const CONTEXT: u64 = 48 * MIB;

/// A C program, compiled once per test binary.
fn program(name: &str) -> PathBuf {
    static BUILT: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
    built
        .entry(name.to_string())
        .or_insert_with(|| c_program(name, false))
        .clone()
}

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
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("GPU_CORE_UTILIZATION_POLICY");
    for n in 0..16 {
        run = run
            .env_remove(&format!("CUDA_DEVICE_MEMORY_LIMIT_{n}"))
            .env_remove(&format!("CUDA_DEVICE_SM_LIMIT_{n}"));
    }
    run = run
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.0.join("truth"))
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
    let output = session.finish();
    assert!(output.status.success(), "{output:?}");
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
