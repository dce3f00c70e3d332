//! Hostile writers of the shared region against applications on the fake driver (issue 16): what
//! the pthread mutex of extension version 1 died of (a thread id that does not exist and
//! robust-list pointers into nowhere in its 64 bytes), and random writes into the file while four
//! processes allocate, free and launch.
//!
//! The random writer skips the live slots' `suspend` flags: a nonzero flag is `vgpu-smi
//! suspend`'s hold, which keeps a process's launches waiting by design (docs/threat-model.md). A
//! writer that lowers the running totals or the live slots' charges lifts the limit for the
//! file's processes (the threat model's "lift the limits"); so the first attack writes anywhere
//! else and asserts no crash and no call over 1.01 s, and the second also spares the accounting
//! and asserts, in addition, that the ground truth never went over the limit.

use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::{Duration, Instant};

use vgpu_integration::answer_status as status;
use vgpu_integration::{Fields, Run, ScratchDir, Session, one_at_a_time};
use vgpu_region::{
    DeviceMemory, EXTENSION_OFFSET, Extension, ProcSlot, REGION_FILE_SIZE, SLOT_EXTENSIONS_OFFSET, SLOT_LIVE,
    SharedRegion, SlotExtension, read_snapshot,
};

const MIB: u64 = 1 << 20;
/// The workers' limit: four of them want up to 4 x (256 MiB + a context), so they contend for it.
const LIMIT: u64 = 512 * MIB;
const CONTEXT: u64 = 2 * MIB;
/// Where extension version 1 kept its pthread mutex (64 bytes), now the lock's hints.
const LOCK_AREA: usize = EXTENSION_OFFSET + std::mem::offset_of!(Extension, lock);

use vgpu_integration::compiled_program as program;

/// A program under the hook with this test's files, a 512 MiB limit on a 4 GiB device.
fn attack_run(dir: &ScratchDir, name: &str) -> Run {
    Run::new(&program(name))
        .hooked()
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.region())
        .env("FAKE_CUDA_TRUTH", dir.truth_path())
        .env("FAKE_CUDA_MEMORY", "4g")
        .env("FAKE_CUDA_CONTEXT_BYTES", CONTEXT.to_string())
        .env("CUDA_DEVICE_MEMORY_LIMIT", LIMIT.to_string())
}

/// A small xorshift generator.
struct Rng(u64);

impl Rng {
    fn from_clock() -> Rng {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |since| since.as_nanos() as u64);
        Rng(nanos | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

/// A thread id no process has (above the kernel's largest pid_max).
const NO_SUCH_THREAD: u32 = 0x3fff_fffe;

/// Writes `bytes` into the region file at `offset`, as any process that can open it may.
fn write_region(path: &Path, offset: usize, bytes: &[u8]) {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open the region to write it");
    file.write_all_at(bytes, offset as u64).expect("write the region");
}

#[test]
fn garbage_where_the_old_mutex_lay_never_crashes_an_application_or_a_start() {
    let dir = ScratchDir::new("attacks-old-mutex");
    let mut running = attack_run(&dir, "mem_ops").spawn(Duration::from_secs(60));
    assert_eq!(running.ask("init"), "init 0");
    assert_eq!(running.ask("ctx 0"), "ctx 0");
    let first = running.ask(&format!("alloc {MIB}"));
    assert_eq!(status(&first), 0, "{first}");

    // One 4-byte write, a thread id into the old mutex's lock word: version 1's next
    // pthread_mutex_timedlock aborted (glibc's assertion on ESRCH), in the running application
    // at its next allocation.
    write_region(&dir.region(), LOCK_AREA, &NO_SUCH_THREAD.to_le_bytes());
    let started = Instant::now();
    let second = running.ask(&format!("alloc {MIB}"));
    assert_eq!(status(&second), 0, "{second}");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    let pointer = second.split_whitespace().nth(2).unwrap_or_default().to_string();
    assert_eq!(running.ask(&format!("free {pointer}")), "free 0");

    // Random bytes there before each of 20 starts (version 1 crashed 679 of 680 starts when its
    // robust-list pointers were written).
    let mut rng = Rng::from_clock();
    for start in 0..20 {
        let garbage: Vec<u8> = (0..64).map(|_| rng.next() as u8).collect();
        write_region(&dir.region(), LOCK_AREA, &garbage);
        let mut joining = attack_run(&dir, "mem_ops").spawn(Duration::from_secs(60));
        assert_eq!(joining.ask("init"), "init 0", "start {start}");
        assert_eq!(joining.ask("ctx 0"), "ctx 0", "start {start}");
        assert_eq!(status(&joining.ask(&format!("alloc {MIB}"))), 0, "start {start}");
        joining.send("quit");
        let output = joining.finish();
        assert!(
            output.status.success(),
            "start {start}: {} {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    running.send("quit");
    let output = running.finish();
    assert!(output.status.success(), "{output:?}");
}

/// What the random writer may not touch.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Spare {
    /// Only the live slots' suspend flags (a hold by design).
    SuspendFlags,
    /// Those, and what the limit is computed from: the live slots (theirs in HAMi-core's part and
    /// in the extension), `proc_num`, the running totals, and the limits themselves (`limit`,
    /// `sm_limit`: read live, so a writer may change them by design, docs/threat-model.md).
    Accounting,
}

/// The live slots and their pids.
fn live_slots(region: &Path) -> Vec<(usize, i32)> {
    let image = std::fs::read(region).expect("read the region");
    let snapshot = read_snapshot(&image).expect("a valid region before the attack");
    snapshot
        .processes
        .iter()
        .filter(|process| process.status == SLOT_LIVE)
        .map(|process| (process.slot, process.pid))
        .collect()
}

/// The byte ranges of `spare`, for the `live` slots (slot, pid) when the attack starts.
fn spared_ranges(live: &[(usize, i32)], spare: Spare) -> Vec<std::ops::Range<usize>> {
    let slot_extension = |slot: usize| EXTENSION_OFFSET + SLOT_EXTENSIONS_OFFSET + slot * size_of::<SlotExtension>();
    let mut ranges = Vec::new();
    for &(slot, _) in live {
        let suspend = slot_extension(slot) + std::mem::offset_of!(SlotExtension, suspend);
        ranges.push(suspend..suspend + 4);
        if spare == Spare::Accounting {
            let start = std::mem::offset_of!(SharedRegion, procs) + slot * size_of::<ProcSlot>();
            ranges.push(start..start + size_of::<ProcSlot>());
            ranges.push(slot_extension(slot)..slot_extension(slot) + size_of::<SlotExtension>());
        }
    }
    if spare == Spare::Accounting {
        let proc_num = std::mem::offset_of!(SharedRegion, proc_num);
        ranges.push(proc_num..proc_num + 4);
        let totals = EXTENSION_OFFSET + std::mem::offset_of!(Extension, device_used);
        ranges.push(totals..totals + 16 * 8);
        for limits in [
            std::mem::offset_of!(SharedRegion, limit),
            std::mem::offset_of!(SharedRegion, sm_limit),
        ] {
            ranges.push(limits..limits + 16 * 8);
        }
    }
    ranges
}

/// What one attack gave.
struct Outcome {
    reports: Vec<Fields>,
    writes: u64,
    truth_peak: u64,
    /// The workers' distinct stderr lines with their counts (at most 20), for a failure's message.
    stderr: String,
}

/// Four workers allocate, free and launch under the hook while this thread writes random bytes
/// into the region for `seconds` (one write in eight into the old mutex's 64 bytes, the others
/// anywhere in the file but `spare`). Asserts that every worker exits normally with no call over
/// 1.01 s and no failure but the limit's; returns their reports.
fn attack(label: &str, spare: Spare, seconds: u64) -> Outcome {
    let dir = ScratchDir::new(&format!("attacks-{label}"));
    let mut workers: Vec<Session> = (1..=4)
        .map(|seed| {
            attack_run(&dir, "mem_race")
                .args([seed.to_string().as_str(), "0", "barrier", "hold", "launch"])
                .spawn(Duration::from_secs(seconds + 60))
        })
        .collect();
    for worker in &mut workers {
        let ready = worker.read_line().unwrap_or_default();
        if !ready.starts_with("ready ") {
            let output = worker.finish();
            panic!(
                "a worker did not start: {ready:?}; its stderr: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
    let live_slots = live_slots(&dir.region());
    let spared = spared_ranges(&live_slots, spare);
    assert_eq!(
        live_slots.len(),
        workers.len(),
        "one live slot per worker: {live_slots:?}"
    );
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.region())
        .expect("open the region");
    let mut rng = Rng::from_clock();
    for worker in &mut workers {
        worker.send("go");
    }
    let started = Instant::now();
    let mut writes = 0u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        for _ in 0..32 {
            let offset = if rng.below(8) == 0 {
                LOCK_AREA + rng.below(64) as usize
            } else {
                rng.below(REGION_FILE_SIZE as u64) as usize
            };
            if spared.iter().any(|range| range.contains(&offset)) {
                continue;
            }
            file.write_all_at(&[rng.next() as u8], offset as u64)
                .expect("write the region");
            writes += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // A worker whose slot was reaped would have its allocations refused for want of a slot, which
    // it counts as refusals, not errors: each must still hold its live slot. Read from the slots'
    // own bytes, which the writer spares, while the workers run.
    let image = std::fs::read(dir.region()).expect("read the region");
    let slot_field = |slot: usize, field: usize| {
        let at = std::mem::offset_of!(SharedRegion, procs) + slot * size_of::<ProcSlot>() + field;
        i32::from_ne_bytes(image[at..at + 4].try_into().expect("4 bytes"))
    };
    let lost: Vec<(usize, i32)> = live_slots
        .iter()
        .copied()
        .filter(|&(slot, pid)| {
            slot_field(slot, std::mem::offset_of!(ProcSlot, status)) != SLOT_LIVE
                || slot_field(slot, std::mem::offset_of!(ProcSlot, pid)) != pid
        })
        .collect();
    assert!(
        spare != Spare::Accounting || lost.is_empty(),
        "{label}: the live slots (slot, pid) {lost:?} were freed or taken while their workers ran"
    );
    let mut dones = Vec::new();
    for worker in &mut workers {
        worker.send("stop");
        dones.push(worker.read_line().unwrap_or_default());
    }
    // The workers now hold what they allocated, and make no more calls.
    let truth_left = at_rest(&dir, &live_slots);
    let mut reports = Vec::new();
    let mut stderr_lines: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for (mut worker, done) in workers.into_iter().zip(dones) {
        let output = worker.finish();
        assert!(
            output.status.success(),
            "{label}: a worker ended with {} ({:?}): {}",
            output.status,
            output.status.signal(),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(done.starts_with("done "), "{label}: no report: {done:?}");
        reports.push(Fields::parse(&done));
        for line in String::from_utf8_lossy(&output.stderr).lines() {
            // Without the pid, the same line of two workers counts as one.
            let line = line.split_once("] ").map_or(line, |(_, rest)| rest);
            *stderr_lines.entry(line.to_string()).or_default() += 1;
        }
    }
    let truth_peak = dir.truth().device(0).peak();
    if spare == Spare::Accounting {
        assert!(
            truth_left.iter().all(|rest| rest.device <= rest.charged),
            "{label}: at rest, a worker held more on the device than its slot is charged (the charge was lost, \
             not late): {truth_left:?}"
        );
    }
    for report in &reports {
        assert_eq!(report.get("errors"), 0.0, "{label}: calls failed: {report:?}");
        assert!(
            report.get("max_wait_ns") < 1.01e9,
            "{label}: a call took {} ms: {report:?}",
            report.get("max_wait_ns") / 1e6
        );
        assert!(report.get("ops") > 50.0, "{label}: too little traffic: {report:?}");
        assert!(report.get("launches") > 50.0, "{label}: too few launches: {report:?}");
    }
    let longest = reports
        .iter()
        .map(|report| report.get("max_wait_ns"))
        .fold(0.0, f64::max);
    eprintln!(
        "{label}: {writes} random writes in {seconds} s; 4 workers: {} allocations, {} refused, {} frees, {} launches, \
         longest call {:.1} ms; ground-truth peak {} MiB (limit {} MiB)",
        reports.iter().map(|r| r.get("allocs")).sum::<f64>(),
        reports.iter().map(|r| r.get("refused")).sum::<f64>(),
        reports.iter().map(|r| r.get("frees")).sum::<f64>(),
        reports.iter().map(|r| r.get("launches")).sum::<f64>(),
        longest / 1e6,
        truth_peak / MIB,
        LIMIT / MIB,
    );
    let stderr = stderr_lines
        .iter()
        .take(20)
        .map(|(line, count)| format!("{count} x {line}"))
        .chain(std::iter::once(format!("at rest: {truth_left:?}")))
        .collect::<Vec<_>>()
        .join("\n");
    Outcome {
        reports,
        writes,
        truth_peak,
        stderr,
    }
}

/// One worker at rest: what the device holds for it and what its slot is charged (device 0).
#[derive(Debug)]
struct AtRest {
    #[expect(dead_code, reason = "shown by Debug in failure messages")]
    pid: i32,
    device: u64,
    charged: u64,
}

/// What the ground truth holds for each worker and what its slot (read from the slot's own bytes,
/// which the accounting attack spares) is charged, while the workers hold their memory and make no
/// calls: a charge lost during the attack shows here, where a late one has caught up.
fn at_rest(dir: &ScratchDir, live: &[(usize, i32)]) -> Vec<AtRest> {
    let image = std::fs::read(dir.region()).expect("read the region");
    let processes = dir.truth().processes();
    live.iter()
        .map(|&(slot, pid)| {
            let at = std::mem::offset_of!(SharedRegion, procs)
                + slot * size_of::<ProcSlot>()
                + std::mem::offset_of!(ProcSlot, used)
                + std::mem::offset_of!(DeviceMemory, total);
            let charged = u64::from_ne_bytes(image[at..at + 8].try_into().expect("8 bytes"));
            let device = processes
                .iter()
                .find(|process| i64::from(process.pid) == i64::from(pid))
                .map_or(0, |process| process.used[0]);
            AtRest { pid, device, charged }
        })
        .collect()
}

/// CI's length of each attack (the 20 s: `random_writes_for_20_seconds`, ignored).
const CI_SECONDS: u64 = 6;

#[test]
fn random_writes_anywhere_never_crash_or_stall_four_working_processes() {
    let _heavy = one_at_a_time();
    let outcome = attack("anywhere", Spare::SuspendFlags, CI_SECONDS);
    assert!(outcome.writes > 10_000, "only {} writes", outcome.writes);
    assert_eq!(outcome.reports.len(), 4);
}

#[test]
fn random_writes_outside_the_accounting_never_let_memory_past_the_limit() {
    let _heavy = one_at_a_time();
    let outcome = attack("outside-accounting", Spare::Accounting, CI_SECONDS);
    assert!(outcome.writes > 10_000, "only {} writes", outcome.writes);
    assert!(
        outcome.truth_peak <= LIMIT,
        "the device really held {} MiB under a {} MiB limit; the workers said:\n{}",
        outcome.truth_peak / MIB,
        LIMIT / MIB,
        outcome.stderr
    );
    assert!(
        outcome.reports.iter().map(|r| r.get("refused")).sum::<f64>() > 0.0,
        "the limit was never reached, so it was not tested"
    );
}

#[test]
#[ignore = "the issue's 20 s attacks (about 45 s): cargo test -p vgpu-integration --test region_attacks -- --ignored --nocapture"]
fn random_writes_for_20_seconds() {
    let _heavy = one_at_a_time();
    attack("anywhere-20s", Spare::SuspendFlags, 20);
    let outcome = attack("outside-accounting-20s", Spare::Accounting, 20);
    assert!(
        outcome.truth_peak <= LIMIT,
        "peak {} MiB; the workers said:\n{}",
        outcome.truth_peak / MIB,
        outcome.stderr
    );
}
