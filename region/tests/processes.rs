//! Many processes on one region: racing for the last bytes, being killed at random moments,
//! dying while holding the lock, stopping while holding it, running out of slots.
//!
//! Worker processes are this test binary re-run with only the ignored `worker` test and a role in
//! the environment (see `common::Worker`); they talk to the test over stdin/stdout.

mod common;

use std::io::BufRead;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{
    PATH_VAR, ROLE_VAR, Rng, ScratchDir, Worker, fake_holder, hold_region_lock, one_device, own_pid, report_value,
};
use vgpu_region::{ChargeError, MAX_SLOTS, MemoryKind, Region, RegionError, SLOT_LIVE, process_start_time};

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Worker side.

#[test]
#[ignore = "worker process entry point, run by the other tests of this file"]
fn worker() {
    let Ok(role) = std::env::var(ROLE_VAR) else { return };
    let path = std::path::PathBuf::from(std::env::var(PATH_VAR).unwrap());
    let env_u64 = |name: &str| std::env::var(name).unwrap().parse::<u64>().unwrap();
    if role == "start_and_hold" {
        return start_and_hold_worker(&path);
    }
    let region = Region::open(&path, &one_device()).unwrap();
    match role.as_str() {
        "race" => race_worker(&region, env_u64("LIMIT"), Duration::from_millis(env_u64("DURATION_MS"))),
        "watch" => watch_worker(&region, env_u64("LIMIT"), Duration::from_millis(env_u64("DURATION_MS"))),
        "storm" => storm_worker(&region, env_u64("LIMIT")),
        "hold_lock" => hold_lock_worker(&region, false),
        "hold_lock_and_stop" => hold_lock_worker(&region, true),
        "mid_call" => mid_call_worker(&region),
        other => panic!("unknown worker role {other}"),
    }
}

/// Charges and uncharges random sizes against the limit for a while, keeping its own ledger;
/// checks its slot against the ledger; exits without detaching (reaping must clean up).
fn race_worker(region: &Region, limit: u64, duration: Duration) {
    let slot = region.attach(own_pid()).unwrap();
    let mut rng = Rng::from_time_and_pid();
    let mut ledger: Vec<u64> = Vec::new();
    let (mut operations, mut refusals) = (0u64, 0u64);
    let start = Instant::now();
    while start.elapsed() < duration {
        operations += 1;
        if ledger.is_empty() || rng.next() % 5 < 3 {
            let size = rng.range(1, limit / 8);
            match region.try_charge(&slot, 0, MemoryKind::Data, size, Some(limit)) {
                Ok(()) => ledger.push(size),
                Err(ChargeError::Refused(refused)) => {
                    assert!(refused.used + size > limit, "{refused:?}");
                    refusals += 1;
                }
                Err(error) => panic!("{error}"),
            }
        } else {
            let size = ledger.swap_remove(rng.next() as usize % ledger.len());
            assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, size).unwrap(), size);
        }
    }
    let charged: u64 = ledger.iter().sum();
    let snapshot = region.snapshot();
    let mine = snapshot
        .processes
        .iter()
        .find(|process| process.slot == slot.index())
        .unwrap();
    assert_eq!(mine.memory[0].data, charged, "the slot matches the ledger");
    println!("REPORT charged={charged} operations={operations} refusals={refusals}");
}

/// Samples the running total as fast as it can; reports the largest value seen.
fn watch_worker(region: &Region, limit: u64, duration: Duration) {
    let start = Instant::now();
    let (mut largest, mut samples, mut over) = (0, 0u64, 0u64);
    while start.elapsed() < duration {
        let used = region.device_used(0);
        largest = largest.max(used);
        over += u64::from(used > limit);
        samples += 1;
    }
    println!("REPORT largest={largest} samples={samples} over={over}");
}

/// Charges and uncharges in a tight loop until told to stop on stdin, timing every call; then
/// reports its ledger and longest wait and stays alive until stdin closes.
fn storm_worker(region: &Region, limit: u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let (stop_reader, stdin_closed) = (Arc::clone(&stop), Arc::new(AtomicBool::new(false)));
    let closed = Arc::clone(&stdin_closed);
    std::thread::spawn(move || {
        let mut lines = std::io::stdin().lock().lines();
        while let Some(Ok(line)) = lines.next() {
            if line == "stop" {
                stop_reader.store(true, Ordering::Release);
            }
        }
        stop_reader.store(true, Ordering::Release);
        closed.store(true, Ordering::Release);
    });
    let slot = region.attach(own_pid()).unwrap();
    let mut rng = Rng::from_time_and_pid();
    let mut ledger: Vec<u64> = Vec::new();
    let (mut longest, mut operations) = (Duration::ZERO, 0u64);
    while !stop.load(Ordering::Acquire) {
        operations += 1;
        let started = Instant::now();
        if ledger.is_empty() || rng.one_in(2) {
            let size = rng.range(1, limit / 16);
            match region.try_charge(&slot, 0, MemoryKind::Data, size, Some(limit)) {
                Ok(()) => ledger.push(size),
                Err(ChargeError::Refused(_)) => {}
                Err(error) => panic!("{error}"),
            }
        } else {
            let size = ledger.swap_remove(rng.next() as usize % ledger.len());
            assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, size).unwrap(), size);
        }
        longest = longest.max(started.elapsed());
    }
    let charged: u64 = ledger.iter().sum();
    println!(
        "REPORT charged={charged} longest_us={} operations={operations}",
        longest.as_micros()
    );
    while !stdin_closed.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Opens the region and attaches, and writes how it went into `started-<pid>` beside the region
/// ("ok" or the error's line), then holds its slot until a file `go` appears there.
fn start_and_hold_worker(path: &std::path::Path) {
    let dir = path.parent().unwrap();
    let region = Region::open(path, &one_device());
    let attached = region
        .as_ref()
        .map_err(|error| error.to_string())
        .and_then(|region| region.attach(own_pid()).map_err(|error| error.to_string()));
    let line = match &attached {
        Ok(slot) => format!("ok {}", slot.index()),
        Err(error) => format!("err {error}"),
    };
    let report = dir.join(format!("started-{}", own_pid()));
    std::fs::write(dir.join(format!(".started-{}", own_pid())), line).unwrap();
    std::fs::rename(dir.join(format!(".started-{}", own_pid())), report).unwrap();
    while !dir.join("go").exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Attaches, charges 1 MiB, then takes the region's lock behind the API's back and leaves the
/// running total half-updated, as a process killed mid-update would; then hangs (or stops).
fn hold_lock_worker(region: &Region, stop_self: bool) {
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, MIB, None).unwrap();
    let _held = hold_region_lock(region);
    region.extension().device_used[0].fetch_add(12_345, Ordering::Relaxed);
    println!("READY");
    if stop_self {
        // SAFETY: stops this process; the test continues it with SIGKILL.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
    std::thread::sleep(Duration::from_secs(60));
}

/// Attaches and marks a data call under way on device 0, as the library does around a driver
/// allocation; then waits to be killed in the middle of it.
fn mid_call_worker(region: &Region) {
    let slot = region.attach(own_pid()).unwrap();
    region.memory_call_begins(&slot, 0);
    println!("READY {}", slot.index());
    std::thread::sleep(Duration::from_secs(60));
}

// ---------------------------------------------------------------------------------------------
// Test side.

#[test]
fn racing_processes_never_exceed_the_limit_and_reaping_returns_everything() {
    const WORKERS: usize = 16;
    let limit = 256 * MIB;
    let dir = ScratchDir::new("race");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let env = [("LIMIT", limit.to_string()), ("DURATION_MS", "2000".to_string())];
    let watch_env = [("LIMIT", limit.to_string()), ("DURATION_MS", "2300".to_string())];
    let mut watcher = Worker::spawn("watch", &dir.region_path(), &watch_env);
    let mut workers: Vec<_> = (0..WORKERS)
        .map(|_| Worker::spawn("race", &dir.region_path(), &env))
        .collect();

    let mut total_operations = 0;
    let mut total_refusals = 0;
    for worker in &mut workers {
        let report = worker.line_with("REPORT").expect("a race worker failed");
        total_operations += report_value(&report, "operations");
        total_refusals += report_value(&report, "refusals");
    }
    let watch = watcher.line_with("REPORT").expect("the watcher failed");
    for worker in workers {
        assert!(worker.finish());
    }
    assert!(watcher.finish());
    assert_eq!(
        report_value(&watch, "over"),
        0,
        "the watcher saw the limit exceeded: {watch}"
    );
    assert!(report_value(&watch, "largest") <= limit);
    assert!(report_value(&watch, "samples") > 1000, "{watch}");
    assert!(
        total_operations > 1000 && total_refusals > 0,
        "{total_operations} operations, {total_refusals} refusals"
    );

    // Every worker exited holding charges; reaping gives everything back.
    region.reap_dead().unwrap();
    assert_eq!(region.device_used(0), 0);
    let snapshot = region.snapshot();
    assert_eq!(
        (snapshot.proc_num, snapshot.processes.len(), snapshot.slots_sum(0)),
        (0, 0, 0)
    );
    eprintln!("race: {total_operations} operations, {total_refusals} refusals, watcher {watch}");
}

#[test]
fn a_kill_storm_never_blocks_survivors_and_leaves_exact_totals() {
    let _turn = vgpu_test_spawn::turn::one_at_a_time();
    const WORKERS: usize = 6;
    const KILLS: usize = 200;
    let limit = 64 * MIB;
    let dir = ScratchDir::new("storm");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let env = [("LIMIT", limit.to_string())];
    let spawn = || Worker::spawn("storm", &dir.region_path(), &env);
    let mut workers: Vec<Worker> = (0..WORKERS).map(|_| spawn()).collect();
    let mut rng = Rng::from_time_and_pid();
    let start = Instant::now();
    // Kills count when they hit a worker that was charging (had a slot); the others (still
    // starting) are extra.
    let (mut kills, mut charging_kills) = (0, 0);
    while charging_kills < KILLS {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "only {charging_kills} useful kills in 30 s"
        );
        std::thread::sleep(Duration::from_micros(rng.range(0, 8000)));
        let victim = workers.swap_remove(rng.next() as usize % workers.len());
        let was_charging = region
            .snapshot()
            .processes
            .iter()
            .any(|process| process.pid == victim.pid());
        victim.kill();
        kills += 1;
        charging_kills += usize::from(was_charging);
        workers.push(spawn());
        assert!(region.device_used(0) <= limit);
    }
    let storm = start.elapsed();
    // Let the last replacements get going, then stop everyone and collect the ledgers.
    std::thread::sleep(Duration::from_millis(200));
    for worker in &mut workers {
        worker.send("stop");
    }
    let mut ledgers = 0;
    let mut longest_us = 0;
    let mut operations = 0;
    for worker in &mut workers {
        let report = worker.line_with("REPORT").expect("a surviving worker failed");
        ledgers += report_value(&report, "charged");
        longest_us = longest_us.max(report_value(&report, "longest_us"));
        operations += report_value(&report, "operations");
    }
    assert!(
        longest_us < 1_000_000,
        "a survivor waited {longest_us} us inside the region"
    );
    region.reap_dead().unwrap();
    assert_eq!(
        region.device_used(0),
        ledgers,
        "after reaping, the total is the survivors' ledgers"
    );
    assert_eq!(region.snapshot().slots_sum(0), ledgers);
    assert_eq!(region.snapshot().processes.len(), WORKERS);

    for worker in workers {
        assert!(worker.finish());
    }
    region.reap_dead().unwrap();
    assert_eq!(region.device_used(0), 0);
    eprintln!(
        "storm: {kills} kills ({charging_kills} while charging) in {storm:?}; survivors' longest wait {longest_us} us, \
         {operations} operations"
    );
}

#[test]
fn a_lock_holder_killed_mid_update_blocks_nobody_and_its_damage_is_undone() {
    let _turn = vgpu_test_spawn::turn::one_at_a_time();
    let dir = ScratchDir::new("owner-dead");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    let mut holder = Worker::spawn("hold_lock", &dir.region_path(), &[]);
    holder.line_with("READY").unwrap();
    assert_eq!(region.device_used(0), MIB + 12_345, "the half-done update is visible");
    holder.kill();

    let start = Instant::now();
    region
        .try_charge(&slot, 0, MemoryKind::Data, 1, Some(10 * MIB))
        .unwrap();
    assert!(start.elapsed() < Duration::from_secs(1), "waited {:?}", start.elapsed());
    // Totals were recomputed from the slots and the dead holder's slot reaped.
    assert_eq!(region.device_used(0), 1);
    assert_eq!(region.snapshot().processes.len(), 1);
}

#[test]
fn a_stopped_lock_holder_makes_calls_fail_after_a_second_not_hang() {
    let _turn = vgpu_test_spawn::turn::one_at_a_time();
    let dir = ScratchDir::new("owner-stopped");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    let mut holder = Worker::spawn("hold_lock_and_stop", &dir.region_path(), &[]);
    holder.line_with("READY").unwrap();

    let start = Instant::now();
    let error = region.try_charge(&slot, 0, MemoryKind::Data, 1, None).unwrap_err();
    let waited = start.elapsed();
    assert!(
        matches!(error, ChargeError::Region(RegionError::LockTimeout { .. })),
        "{error:?}"
    );
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(3),
        "waited {waited:?}"
    );
    assert_eq!(error.to_string().lines().count(), 1);
    assert!(region.device_used(0) > 0, "nothing readable was blocked");

    // SIGKILL ends a stopped process too; then everything works again.
    holder.kill();
    region.try_charge(&slot, 0, MemoryKind::Data, 1, None).unwrap();
    assert_eq!(region.device_used(0), 1);
}

/// A thousand processes started at once all attach (the lock is never held long enough for a
/// waiter to give up), the slots are the only bound, and processes past them are told so.
#[test]
fn a_thousand_processes_started_at_once_all_attach() {
    let _turn = vgpu_test_spawn::turn::one_at_a_time();
    // Under an emulator (scripts/cross-test.sh) each process costs tens of megabytes.
    let started_at_once = if std::env::var_os("VGPU_TEST_RUNNER").is_some() {
        100
    } else {
        1000
    };
    let dir = ScratchDir::new("start-storm");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let words = common::worker_words();
    let spawn = || {
        std::process::Command::new(&words[0])
            .args(&words[1..])
            .env(ROLE_VAR, "start_and_hold")
            .env(PATH_VAR, dir.region_path())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start a worker")
    };
    let reports = |expected: usize| {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let lines: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .filter_map(|entry| {
                    let entry = entry.ok()?;
                    let name = entry.file_name().into_string().ok()?;
                    name.starts_with("started-")
                        .then(|| std::fs::read_to_string(entry.path()).ok())?
                })
                .collect();
            if lines.len() >= expected || Instant::now() > deadline {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let mut children: Vec<_> = (0..started_at_once).map(|_| spawn()).collect();
    let first = reports(started_at_once);
    let failed: Vec<&String> = first.iter().filter(|line| !line.starts_with("ok ")).collect();
    // The other slots held by this (live) test process, as if by more processes: three more
    // workers find none free.
    let own_start = process_start_time(own_pid()).unwrap_or(0);
    for index in 0..MAX_SLOTS {
        if region.hami().procs[index].status.load(Ordering::Relaxed) != SLOT_LIVE {
            fake_holder(&region, index, own_pid(), own_start);
        }
    }
    let beyond = 3;
    children.extend((0..beyond).map(|_| spawn()));
    let all = reports(started_at_once + beyond);
    std::fs::write(dir.path().join("go"), "").unwrap();
    for mut child in children {
        let _ = child.wait();
    }
    assert_eq!(first.len(), started_at_once, "reports of the first {started_at_once}");
    assert!(
        failed.is_empty(),
        "{} of {started_at_once} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    let refused: Vec<&String> = all.iter().filter(|line| !line.starts_with("ok ")).collect();
    assert_eq!(all.len(), started_at_once + beyond);
    assert_eq!(refused.len(), 3, "past the slots: {refused:?}");
    for line in refused {
        assert!(
            line.contains("all 1024 process slots belong to live processes"),
            "{line}"
        );
    }
    drop(region);
}

/// A quick reap (at every attach and every [`vgpu_region::REAP_INTERVAL`] of charges) reads
/// `/proc` for a bounded number of live processes, however many there are: attach's cost does
/// not grow with them. A process that has exited is still found by every reap.
#[test]
fn attach_reads_proc_for_a_bounded_number_of_live_processes() {
    let dir = ScratchDir::new("quick-reap");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let mut holder =
        vgpu_test_spawn::spawn_started(std::process::Command::new("sleep").arg("60")).expect("start sleep");
    let holder_pid = holder.id() as i32;
    let holder_start = process_start_time(holder_pid).unwrap();
    for index in 0..1000 {
        fake_holder(&region, index, holder_pid, holder_start);
    }
    let mut gone = vgpu_test_spawn::spawn_started(&mut std::process::Command::new("true")).expect("start true");
    let gone_pid = gone.id() as i32;
    gone.wait().unwrap();
    fake_holder(&region, 1000, gone_pid, 1);
    let before = vgpu_region::process::stat_reads();
    let slot = region.attach(own_pid()).unwrap();
    let reads = vgpu_region::process::stat_reads() - before;
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_eq!(slot.index(), 1000, "the exited process's slot is reaped and reused");
    assert!(
        reads <= vgpu_region::PROC_CHECKS_PER_QUICK_REAP as u64 + 1,
        "attach read /proc {reads} times with 1000 live processes"
    );
}

#[test]
fn when_every_slot_is_live_attach_fails_cleanly() {
    let dir = ScratchDir::new("full");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let mut holder =
        vgpu_test_spawn::spawn_started(std::process::Command::new("sleep").arg("60")).expect("start sleep");
    let holder_pid = holder.id() as i32;
    let holder_start = process_start_time(holder_pid).unwrap();
    for index in 0..MAX_SLOTS {
        fake_holder(&region, index, holder_pid, holder_start);
    }
    let error = region.attach(own_pid()).unwrap_err();
    assert!(matches!(error, RegionError::NoFreeSlot { .. }), "{error:?}");
    assert_eq!(error.to_string().lines().count(), 1);
    assert_eq!(region.snapshot().proc_num, MAX_SLOTS);

    // A pid whose start time differs is a reused pid: that slot is dead, and reused.
    fake_holder(&region, 500, holder_pid, holder_start + 1);
    assert_eq!(region.attach(own_pid()).unwrap().index(), 500);

    // A zombie holds no GPU memory: dead too.
    let mut zombie = vgpu_test_spawn::spawn_started(&mut std::process::Command::new("true")).expect("start true");
    let zombie_pid = zombie.id() as i32;
    let zombie_start = process_start_time(zombie_pid).unwrap_or(0);
    while vgpu_region::process::read_proc_stat(zombie_pid).is_some_and(|stat| stat.state != b'Z') {
        std::thread::sleep(Duration::from_millis(1));
    }
    fake_holder(&region, 700, zombie_pid, zombie_start);
    assert_eq!(region.reap_dead().unwrap(), 1);
    assert_eq!(region.hami().procs[700].status.load(Ordering::Relaxed), 0);
    zombie.wait().unwrap();

    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_eq!(region.reap_dead().unwrap(), MAX_SLOTS - 2);
    let snapshot = region.snapshot();
    assert_eq!((snapshot.proc_num, snapshot.processes.len()), (501, 1));
    assert_eq!(snapshot.processes[0].status, SLOT_LIVE);
}

#[test]
fn a_process_killed_inside_a_data_call_takes_its_mark_with_it() {
    let _turn = vgpu_test_spawn::turn::one_at_a_time();
    let dir = ScratchDir::new("mid-call");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let mut caller = Worker::spawn("mid_call", &dir.region_path(), &[]);
    let index: usize = caller.line_with("READY").unwrap().parse().unwrap();
    // While it lives, its call is under way: no quiet moment.
    let deadline = || Instant::now() + Duration::from_millis(50);
    assert_eq!(region.quiet_read(0, deadline(), || ()), None);
    caller.kill();

    // Killed, its mark no longer counts, before any reaping: the read does not wait for a
    // deadline far longer than any scheduling delay.
    let started = Instant::now();
    assert_eq!(
        region.quiet_read(0, Instant::now() + Duration::from_secs(5), || ()),
        Some(())
    );
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        region.extension().slots[index].memory_in_flight[0].load(Ordering::Relaxed),
        1
    );
    // ... and reaping its slot clears it.
    assert_eq!(region.reap_dead().unwrap(), 1);
    assert_eq!(
        region.extension().slots[index].memory_in_flight[0].load(Ordering::Relaxed),
        0
    );
}

/// A writer that pins `memory_quiesce` to a live pid (its own, or 1) delays data calls for
/// [`vgpu_region::QUIESCE_AT_MOST`] at most, not each call by the wait a real measurement gets.
#[test]
fn a_pinned_quiesce_slows_data_calls_for_a_bounded_time() {
    let dir = ScratchDir::new("pinned-quiesce");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    region
        .extension()
        .memory_quiesce
        .store(u64::from(std::process::id()), Ordering::Release);
    let started = Instant::now();
    for _ in 0..1000 {
        region.memory_call_begins(&slot, 0);
        region.memory_call_done(&slot, 0);
    }
    let took = started.elapsed();
    // Each call waited 2 ms before: 2 s for the thousand.
    assert!(
        took < vgpu_region::QUIESCE_AT_MOST + Duration::from_millis(500),
        "1000 data calls took {took:?} behind a pinned quiesce"
    );
}
