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
    let dir = ScratchDir::new("mid-call");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let mut caller = Worker::spawn("mid_call", &dir.region_path(), &[]);
    let index: usize = caller.line_with("READY").unwrap().parse().unwrap();
    // While it lives, its call is under way: no quiet moment.
    let deadline = || Instant::now() + Duration::from_millis(50);
    assert_eq!(region.quiet_read(0, deadline(), || ()), None);
    caller.kill();

    // Killed, its mark no longer counts, before any reaping ...
    let started = Instant::now();
    assert_eq!(region.quiet_read(0, deadline(), || ()), Some(()));
    assert!(started.elapsed() < Duration::from_millis(20), "{:?}", started.elapsed());
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
