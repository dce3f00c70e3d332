//! The region's lock against what can happen to it: any bytes written where extension version 1
//! kept a pthread mutex (a thread id that does not exist, pointers into nowhere), a holder killed
//! with a forked child still alive, and holders in another pid namespace.
//!
//! Worker processes are this test binary re-run with only the ignored `worker` test and a role
//! in the environment (see `common::Worker`).

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{PATH_VAR, ROLE_VAR, Rng, ScratchDir, Worker, one_device, own_pid};
use vgpu_region::{ChargeError, FAVOUR_LOCK_OFFSET, FILE_LOCK_OFFSET, LOCK_TIMEOUT, MemoryKind, Region, RegionError};

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Worker side.

#[test]
#[ignore = "worker process entry point, run by the other tests of this file"]
fn worker() {
    let Ok(role) = std::env::var(ROLE_VAR) else { return };
    let path = std::path::PathBuf::from(std::env::var(PATH_VAR).unwrap());
    let region = Region::open(&path, &one_device()).unwrap();
    match role.as_str() {
        "fork_then_hold" => fork_then_hold_worker(&region),
        "hold_for" => hold_for_worker(&region),
        "churn" => churn_worker(&region),
        other => panic!("unknown worker role {other}"),
    }
}

/// Forks a child that only sleeps (as a data-loader worker of a training job does), then takes
/// the region's lock through the library's own path and waits to be killed holding it.
fn fork_then_hold_worker(region: &Region) {
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, MIB, None).unwrap();
    // SAFETY: the child only sleeps and leaves with _exit.
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        // SAFETY: plain sleep and _exit in the child.
        unsafe {
            libc::sleep(60);
            libc::_exit(0)
        };
    }
    let _held = region.hold_lock().unwrap();
    println!("CHILD {child}");
    println!("READY");
    std::thread::sleep(Duration::from_secs(60));
}

/// Holds the region's lock for HOLD_MS, then releases it and reports; then waits for stdin to
/// close. Run in another pid namespace by the namespace test, where it reports its host pid.
fn hold_for_worker(region: &Region) {
    let hold = Duration::from_millis(std::env::var("HOLD_MS").unwrap().parse().unwrap());
    let host_pid = std::fs::read_link("/proc/self").unwrap();
    println!("PIDS own={} host={}", own_pid(), host_pid.display());
    {
        let _held = region.hold_lock().unwrap();
        println!("HELD");
        std::thread::sleep(hold);
    }
    println!("RELEASED");
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {}
}

/// Charges and uncharges 1 MiB until a line comes on stdin; reports its longest call and errors.
fn churn_worker(region: &Region) {
    let slot = region.attach(own_pid()).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopper = std::sync::Arc::clone(&stop);
    std::thread::spawn(move || {
        // Any line, or the end of input.
        let _ = std::io::stdin().read_line(&mut String::new());
        stopper.store(true, Ordering::Release);
    });
    let (mut longest, mut errors, mut operations) = (Duration::ZERO, 0u64, 0u64);
    while !stop.load(Ordering::Acquire) {
        let started = Instant::now();
        let charged = region.try_charge(&slot, 0, MemoryKind::Data, MIB, None).is_ok();
        let released = region.uncharge(&slot, 0, MemoryKind::Data, MIB).is_ok();
        errors += u64::from(!charged) + u64::from(!released);
        longest = longest.max(started.elapsed());
        operations += 1;
    }
    println!(
        "REPORT longest_us={} errors={errors} operations={operations}",
        longest.as_micros()
    );
}

// ---------------------------------------------------------------------------------------------
// Test side.

/// The 64 bytes where version 1 kept its mutex, as a slice of the mapping's words.
fn lock_bytes(region: &Region) -> *mut u8 {
    std::ptr::from_ref(&region.extension().lock).cast_mut().cast()
}

/// Writes `bytes` over the lock area, as a writer of the file would.
fn scribble(region: &Region, bytes: &[u8; 64]) {
    let area = lock_bytes(region);
    for (index, byte) in bytes.iter().enumerate() {
        // SAFETY: the area is 64 bytes of the live mapping; a volatile byte store is exactly
        // what another process's write does (the library reads these words only atomically).
        unsafe { area.add(index).write_volatile(*byte) };
    }
}

/// What glibc's robust PI mutex of version 1 aborted on: a thread id that does not exist in the
/// owner word, a count, a robust-list pointer into unmapped memory.
fn old_mutex_attack() -> [u8; 64] {
    let mut bytes = [0u8; 64];
    bytes[0..4].copy_from_slice(&0x3fff_fffeu32.to_le_bytes()); // __lock: a tid no process has
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes()); // __count
    bytes[8..12].copy_from_slice(&0x3fff_fffeu32.to_le_bytes()); // __owner
    bytes[16..20].copy_from_slice(&0x20u32.to_le_bytes()); // __kind: robust | PI
    bytes[24..32].copy_from_slice(&0xdead_beef_0000u64.to_le_bytes()); // __list.__prev
    bytes[32..40].copy_from_slice(&0xdead_beef_0000u64.to_le_bytes()); // __list.__next
    bytes
}

/// Times one charge and its release.
fn timed_pair(region: &Region, slot: &vgpu_region::Slot) -> Duration {
    let started = Instant::now();
    region.try_charge(slot, 0, MemoryKind::Data, MIB, None).unwrap();
    region.uncharge(slot, 0, MemoryKind::Data, MIB).unwrap();
    started.elapsed()
}

#[test]
fn the_old_mutex_attack_and_random_lock_bytes_never_crash_or_block() {
    let dir = ScratchDir::new("lock-bytes");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    let mut churner = Worker::spawn("churn", &dir.region_path(), &[]);

    scribble(&region, &old_mutex_attack());
    // A nonzero holder word: the next holder repairs (recomputes), nothing else.
    let waited = timed_pair(&region, &slot);
    assert!(waited < Duration::from_millis(500), "waited {waited:?}");

    let mut rng = Rng::from_time_and_pid();
    let mut longest = Duration::ZERO;
    for _ in 0..200 {
        let mut bytes = [0u8; 64];
        bytes.iter_mut().for_each(|byte| *byte = rng.next() as u8);
        scribble(&region, &bytes);
        longest = longest.max(timed_pair(&region, &slot));
    }
    churner.send("stop");
    let report = churner.line_with("REPORT").expect("the churner died");
    assert!(churner.finish());
    // A random `favoured` token costs a locker one F_OFD_GETLK; a random `wake` or `sleepers`
    // a useless wake-up or a sleep of at most 5 ms. Nothing comes near the second.
    assert!(longest < Duration::from_millis(500), "longest pair {longest:?}");
    assert_eq!(common::report_value(&report, "errors"), 0, "{report}");
    assert!(
        common::report_value(&report, "longest_us") < 500_000,
        "the other process waited: {report}"
    );
    assert_eq!(region.device_used(0), 0);
    assert_eq!(region.snapshot().slots_sum(0), 0);
}

#[test]
fn a_favoured_token_nobody_holds_back_for_is_cleared_at_once() {
    let dir = ScratchDir::new("favoured");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    region.extension().lock.favoured.store(0x1234_5678, Ordering::Release);
    let waited = timed_pair(&region, &slot);
    assert!(waited < Duration::from_millis(100), "waited {waited:?}");
    assert_eq!(region.extension().lock.favoured.load(Ordering::Acquire), 0);
}

#[test]
fn a_process_holding_the_favour_goes_first_and_others_wait_for_it() {
    use std::os::fd::AsRawFd;
    let dir = ScratchDir::new("favour-held");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    // Another process's favour: the file lock on its byte, and its token in the word.
    let favoured = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.region_path())
        .unwrap();
    // SAFETY: all zeroes is a valid flock.
    let mut range: libc::flock = unsafe { std::mem::zeroed() };
    range.l_type = libc::F_WRLCK as libc::c_short;
    range.l_whence = libc::SEEK_SET as libc::c_short;
    range.l_start = FAVOUR_LOCK_OFFSET as libc::off_t;
    range.l_len = 1;
    // SAFETY: F_OFD_SETLK with a valid flock on an open fd.
    assert_eq!(
        unsafe { libc::fcntl(favoured.as_raw_fd(), libc::F_OFD_SETLK, &range) },
        0
    );
    region.extension().lock.favoured.store(77, Ordering::Release);
    let started = Instant::now();
    let error = region.try_charge(&slot, 0, MemoryKind::Data, 1, None).unwrap_err();
    assert!(
        matches!(error, ChargeError::Region(RegionError::LockTimeout { .. })),
        "{error:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(900));
    // Its process gone (the description closed), the word is a stale hint: cleared, not obeyed.
    drop(favoured);
    let waited = timed_pair(&region, &slot);
    assert!(waited < Duration::from_millis(100), "waited {waited:?}");
}

#[test]
fn a_holder_word_left_set_makes_the_next_holder_recompute_the_totals() {
    let dir = ScratchDir::new("holder-word");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, 3 * MIB, None).unwrap();
    // A holder that died between these two writes.
    region.extension().lock.holder.store(42, Ordering::Release);
    region.extension().device_used[0].store(7, Ordering::Release);
    region.try_charge(&slot, 0, MemoryKind::Data, MIB, None).unwrap();
    assert_eq!(region.device_used(0), 4 * MIB);
    assert_eq!(region.extension().lock.holder.load(Ordering::Acquire), 0);
}

#[test]
fn the_file_lock_is_a_kernel_lock_on_one_byte_that_others_see() {
    use std::os::fd::AsRawFd;
    let dir = ScratchDir::new("ofd");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let probe = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.region_path())
        .unwrap();
    let conflicting = || {
        // SAFETY: all zeroes is a valid flock.
        let mut range: libc::flock = unsafe { std::mem::zeroed() };
        range.l_type = libc::F_WRLCK as libc::c_short;
        range.l_whence = libc::SEEK_SET as libc::c_short;
        range.l_start = FILE_LOCK_OFFSET as libc::off_t;
        range.l_len = 1;
        // SAFETY: F_OFD_GETLK with a valid flock on an open fd.
        assert_eq!(
            unsafe { libc::fcntl(probe.as_raw_fd(), libc::F_OFD_GETLK, &mut range) },
            0
        );
        range.l_type != libc::F_UNLCK as libc::c_short
    };
    assert!(!conflicting());
    let held = region.hold_lock().unwrap();
    assert!(
        conflicting(),
        "nobody else can take the byte while the region is locked"
    );
    drop(held);
    assert!(!conflicting());
}

#[test]
fn a_holder_killed_with_a_forked_child_alive_leaves_the_lock_free() {
    let dir = ScratchDir::new("fork-holder");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    let mut holder = Worker::spawn("fork_then_hold", &dir.region_path(), &[]);
    let child: i32 = holder.line_with("CHILD").unwrap().parse().unwrap();
    holder.line_with("READY").unwrap();
    holder.kill();

    // The child inherited the holder's descriptors; the lock's description was closed in it.
    let started = Instant::now();
    let result = region.try_charge(&slot, 0, MemoryKind::Data, 1, None);
    let waited = started.elapsed();
    // SAFETY: ends our worker's child, which only sleeps.
    unsafe { libc::kill(child, libc::SIGKILL) };
    result.unwrap();
    assert!(waited < Duration::from_millis(500), "waited {waited:?}");
    // The holder's slot (1 MiB) was reaped or is still charged; ours holds 1 byte.
    region.reap_dead().unwrap();
    assert_eq!(region.device_used(0), 1);
}

/// Whether this machine lets us make a pid namespace (root, or a user namespace allowed).
fn pid_namespaces_work() -> bool {
    vgpu_test_spawn::output_started(std::process::Command::new("unshare").args(["--pid", "--fork", "true"]))
        .is_ok_and(|output| output.status.success())
}

/// Runs a worker of this binary inside a new pid namespace.
fn spawn_in_pid_namespace(role: &str, region: &std::path::Path, hold_ms: u64) -> std::process::Child {
    vgpu_test_spawn::spawn_started(
        std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child"])
            .args(common::worker_words())
            .env(ROLE_VAR, role)
            .env(PATH_VAR, region)
            .env("HOLD_MS", hold_ms.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped()),
    )
    .expect("start unshare")
}

#[test]
fn holders_in_another_pid_namespace_are_waited_for_and_their_death_frees_the_lock() {
    if !pid_namespaces_work() {
        eprintln!("not run: this machine does not let the test make a pid namespace (`unshare --pid`)");
        return;
    }
    use std::io::BufRead;
    let dir = ScratchDir::new("pid-namespace");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();

    // A holder that releases after 300 ms: waited for, not an abort (version 1's PI mutex made
    // the kernel look the owner's thread id up in our namespace: ESRCH, and glibc aborted).
    let mut holder = spawn_in_pid_namespace("hold_for", &dir.region_path(), 300);
    let mut lines = std::io::BufReader::new(holder.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| loop {
        let line = lines.next().expect("the holder ended").unwrap();
        if let Some(rest) = line.strip_prefix(prefix) {
            break rest.trim().to_owned();
        }
    };
    let pids = next("PIDS");
    assert!(pids.starts_with("own=1 "), "not in a namespace of its own: {pids}");
    next("HELD");
    let started = Instant::now();
    region.try_charge(&slot, 0, MemoryKind::Data, 1, None).unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited < LOCK_TIMEOUT,
        "waited {waited:?} for a 300 ms holder in another namespace"
    );
    next("RELEASED");
    drop(holder.stdin.take());
    holder.wait().unwrap();

    // A holder that never releases: killed (with its namespace), the lock is free at once.
    let mut holder = spawn_in_pid_namespace("hold_for", &dir.region_path(), 60_000);
    let mut lines = std::io::BufReader::new(holder.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| loop {
        let line = lines.next().expect("the holder ended").unwrap();
        if let Some(rest) = line.strip_prefix(prefix) {
            break rest.trim().to_owned();
        }
    };
    next("PIDS");
    next("HELD");
    let error = region.try_charge(&slot, 0, MemoryKind::Data, 1, None).unwrap_err();
    assert!(
        matches!(error, ChargeError::Region(RegionError::LockTimeout { .. })),
        "{error:?}"
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    let started = Instant::now();
    region.try_charge(&slot, 0, MemoryKind::Data, 1, None).unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "waited {:?}",
        started.elapsed()
    );
    assert_eq!(region.device_used(0), 2);
}
