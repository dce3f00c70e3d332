//! Charging, uncharging, limits, devices and slots within one process.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::{ScratchDir, one_device, own_pid};
use vgpu_region::{
    ChargeError, InitParams, MAX_DEVICES, MemoryKind, OpenKind, Refused, Region, RegionError, read_snapshot,
};

const GIB: u64 = 1 << 30;

fn open(dir: &ScratchDir) -> Region {
    Region::open(&dir.region_path(), &one_device()).unwrap()
}

fn refused(result: Result<(), ChargeError>) -> Refused {
    match result {
        Err(ChargeError::Refused(refused)) => refused,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn region_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Region>();
}

#[test]
fn limit_holds_exactly_at_the_boundary() {
    let dir = ScratchDir::new("boundary");
    let region = open(&dir);
    assert_eq!(region.open_kind(), &OpenKind::Created);
    let slot = region.attach(own_pid()).unwrap();
    let limit = Some(GIB);
    region.try_charge(&slot, 0, MemoryKind::Data, GIB - 1, limit).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, 1, limit).unwrap();
    assert_eq!(region.device_used(0), GIB, "exactly at the limit is allowed");
    assert_eq!(
        refused(region.try_charge(&slot, 0, MemoryKind::Data, 1, limit)),
        Refused {
            used: GIB,
            limit: GIB,
            requested: 1
        },
        "one byte over is refused"
    );
    assert_eq!(region.device_used(0), GIB, "a refusal charges nothing");
    assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, 1).unwrap(), 1);
    refused(region.try_charge(&slot, 0, MemoryKind::Data, 2, limit));
    region.try_charge(&slot, 0, MemoryKind::Data, 1, limit).unwrap();
    assert_eq!(region.device_used(0), GIB);
}

#[test]
fn hostile_sizes_never_wrap() {
    let dir = ScratchDir::new("hostile");
    let region = open(&dir);
    let slot = region.attach(own_pid()).unwrap();
    refused(region.try_charge(&slot, 0, MemoryKind::Data, u64::MAX, Some(GIB)));
    refused(region.try_charge(&slot, 0, MemoryKind::Data, GIB + 1, Some(GIB)));
    region.try_charge(&slot, 0, MemoryKind::Data, 0, Some(0)).unwrap();
    assert_eq!(region.device_used(0), 0, "a zero-byte charge changes nothing");

    // Without a limit the total must still fit 64 bits.
    region.try_charge(&slot, 0, MemoryKind::Data, 1, None).unwrap();
    assert_eq!(
        refused(region.try_charge(&slot, 0, MemoryKind::Data, u64::MAX, None)),
        Refused {
            used: 1,
            limit: u64::MAX,
            requested: u64::MAX
        }
    );
    region
        .try_charge(&slot, 0, MemoryKind::Data, u64::MAX - 1, None)
        .unwrap();
    assert_eq!(region.device_used(0), u64::MAX);
    refused(region.try_charge(&slot, 0, MemoryKind::Module, 1, None));

    // Uncharging more than was charged releases what there is, never underflows.
    assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, u64::MAX).unwrap(), u64::MAX);
    assert_eq!(region.device_used(0), 0);
    assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, 5).unwrap(), 0);
    assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, 0).unwrap(), 0);
    assert_eq!(region.device_used(0), 0);
    let snapshot = region.snapshot();
    assert_eq!(snapshot.processes[0].memory[0].total, 0);
}

#[test]
fn kinds_are_recorded_separately_and_uncharged_per_kind() {
    let dir = ScratchDir::new("kinds");
    let region = open(&dir);
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Context, 500, None).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Module, 30, None).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, 7, None).unwrap();
    let memory = region.snapshot().processes[0].memory[0];
    assert_eq!(
        (memory.context, memory.module, memory.data, memory.total),
        (500, 30, 7, 537)
    );
    // A free of one kind cannot take another kind's bytes.
    assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, 100).unwrap(), 7);
    assert_eq!(region.uncharge(&slot, 0, MemoryKind::Module, 10).unwrap(), 10);
    let memory = region.snapshot().processes[0].memory[0];
    assert_eq!(
        (memory.context, memory.module, memory.data, memory.total),
        (500, 20, 0, 520)
    );
    assert_eq!(region.device_used(0), 520);
}

#[test]
fn devices_are_independent_and_indexed_by_uuid() {
    let dir = ScratchDir::new("devices");
    let init = InitParams {
        device_uuids: vec!["GPU-a".into(), "GPU-b".into()],
        limits: [GIB; MAX_DEVICES],
        sm_limits: [50; MAX_DEVICES],
        priority: 7,
    };
    let region = Region::open(&dir.region_path(), &init).unwrap();
    assert_eq!(region.device_index("GPU-b").unwrap(), 1);
    assert_eq!(region.device_index("GPU-a").unwrap(), 0);
    assert_eq!(region.device_index("GPU-c").unwrap(), 2, "a new UUID is registered");
    assert_eq!(region.device_index("GPU-c").unwrap(), 2);
    let snapshot = region.snapshot();
    assert_eq!(snapshot.uuids, ["GPU-a", "GPU-b", "GPU-c"]);
    assert_eq!(
        (snapshot.priority, snapshot.limits[3], snapshot.sm_limits[0]),
        (7, GIB, 50)
    );
    assert_eq!(
        (snapshot.utilization_switch, snapshot.recent_kernel, snapshot.owner_pid),
        (1, 2, 0)
    );
    for index in 3..MAX_DEVICES {
        assert_eq!(region.device_index(&format!("GPU-{index}")).unwrap(), index);
    }
    assert!(matches!(
        region.device_index("GPU-17th"),
        Err(RegionError::TooManyDevices { .. })
    ));
    for bad in ["", "GPU-\0", &"x".repeat(96)] {
        assert!(
            matches!(region.device_index(bad), Err(RegionError::InvalidUuid { .. })),
            "{bad:?}"
        );
    }
    assert_eq!(
        region
            .device_index(&"x".repeat(95))
            .unwrap_err()
            .to_string()
            .lines()
            .count(),
        1
    );

    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 1, MemoryKind::Data, GIB, Some(GIB)).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, GIB, Some(GIB)).unwrap();
    assert_eq!(
        (region.device_used(0), region.device_used(1), region.device_used(2)),
        (GIB, GIB, 0)
    );
    assert!(matches!(
        region.try_charge(&slot, MAX_DEVICES, MemoryKind::Data, 1, None),
        Err(ChargeError::Region(RegionError::NoSuchDevice { device: 16, .. }))
    ));
    assert!(matches!(
        region.uncharge(&slot, usize::MAX, MemoryKind::Data, 1),
        Err(RegionError::NoSuchDevice { .. })
    ));
    assert_eq!(region.device_used(MAX_DEVICES), 0);
}

#[test]
fn detach_releases_and_invalidates_the_slot() {
    let dir = ScratchDir::new("detach");
    let region = open(&dir);
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, 1000, None).unwrap();
    let index = slot.index();
    region.detach(&slot).unwrap();
    assert!(matches!(
        region.try_charge(&slot, 0, MemoryKind::Data, 1, None),
        Err(ChargeError::Region(RegionError::SlotLost { .. }))
    ));
    assert_eq!(region.device_used(0), 0);
    let snapshot = region.snapshot();
    assert_eq!((snapshot.proc_num, snapshot.processes.len()), (0, 0));
    assert_eq!(
        region.hami().procs[index]
            .pid
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[test]
fn attaching_the_same_pid_again_resets_its_slot_like_after_exec() {
    let dir = ScratchDir::new("reattach");
    let region = open(&dir);
    let old = region.attach(own_pid()).unwrap();
    region.try_charge(&old, 0, MemoryKind::Context, 4096, None).unwrap();
    let new = region.attach(own_pid()).unwrap();
    assert_eq!(new.index(), old.index(), "the process keeps its slot");
    assert_eq!(region.device_used(0), 0, "the old image's charges are gone");
    assert!(matches!(
        region.try_charge(&old, 0, MemoryKind::Data, 1, None),
        Err(ChargeError::Region(RegionError::SlotLost { .. }))
    ));
    assert!(matches!(
        region.uncharge(&old, 0, MemoryKind::Data, 1),
        Err(RegionError::SlotLost { .. })
    ));
    region.try_charge(&new, 0, MemoryKind::Data, 1, None).unwrap();
    assert!(matches!(region.attach(0), Err(RegionError::InvalidPid { pid: 0, .. })));
}

#[test]
fn holes_are_reused_and_proc_num_tracks_the_highest_live_slot() {
    let dir = ScratchDir::new("holes");
    let region = open(&dir);
    let mut sleepers: Vec<_> = (0..3)
        .map(|_| vgpu_test_spawn::spawn_started(std::process::Command::new("sleep").arg("30")).expect("start sleep"))
        .collect();
    let slots: Vec<_> = sleepers
        .iter()
        .map(|child| region.attach(child.id() as i32).unwrap())
        .collect();
    assert_eq!(slots.iter().map(|slot| slot.index()).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(region.snapshot().proc_num, 3);

    // The middle process dies: its slot is a hole that the next attach reuses.
    sleepers[1].kill().unwrap();
    sleepers[1].wait().unwrap();
    let reused = region.attach(own_pid()).unwrap();
    assert_eq!(reused.index(), 1);
    assert_eq!(region.snapshot().proc_num, 3);

    // The last one dies: proc_num shrinks.
    sleepers[2].kill().unwrap();
    sleepers[2].wait().unwrap();
    assert_eq!(region.reap_dead().unwrap(), 1);
    assert_eq!(region.snapshot().proc_num, 2);
    sleepers[0].kill().unwrap();
    sleepers[0].wait().unwrap();
}

#[test]
fn threads_of_one_process_share_a_slot_safely() {
    let dir = ScratchDir::new("threads");
    let region = Arc::new(open(&dir));
    let slot = Arc::new(region.attach(own_pid()).unwrap());
    let limit = Some(1_000_000);
    let threads: Vec<_> = (0..4)
        .map(|thread| {
            let (region, slot) = (Arc::clone(&region), Arc::clone(&slot));
            std::thread::spawn(move || {
                let mut rng = common::Rng::new(thread);
                let mut held = 0u64;
                for _ in 0..5000 {
                    let size = rng.range(1, 10_000);
                    if region.try_charge(&slot, 0, MemoryKind::Data, size, limit).is_ok() {
                        held += size;
                    }
                    assert!(region.device_used(0) <= 1_000_000);
                    if held > 0 && rng.one_in(2) {
                        let size = rng.range(1, held);
                        assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, size).unwrap(), size);
                        held -= size;
                    }
                }
                held
            })
        })
        .collect();
    let held: u64 = threads.into_iter().map(|thread| thread.join().unwrap()).sum();
    assert_eq!(region.device_used(0), held);
    assert_eq!(region.snapshot().processes[0].memory[0].data, held);
}

#[test]
fn the_file_decodes_like_the_live_region() {
    let dir = ScratchDir::new("decode");
    let region = open(&dir);
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, 123, None).unwrap();
    let from_file = read_snapshot(&std::fs::read(dir.region_path()).unwrap()).unwrap();
    assert_eq!(from_file, region.snapshot());
    assert_eq!(from_file.device_used(0), 123);
    assert_eq!(from_file.slots_sum(0), 123);
    let extension = from_file.extension.as_ref().unwrap();
    assert_eq!(extension.creator_pid, own_pid());
    assert_eq!(
        from_file.processes[0].start_time,
        vgpu_region::process_start_time(own_pid())
    );
}

#[test]
fn a_dead_measurer_does_not_slow_data_calls() {
    let dir = ScratchDir::new("dead-measurer");
    let region = open(&dir);
    let slot = region.attach(own_pid()).unwrap();
    // The mark a context measurement leaves when its process is killed in the middle of it.
    let mut child = vgpu_test_spawn::spawn_started(&mut std::process::Command::new("true")).expect("start true");
    let dead = child.id();
    child.wait().expect("reap it");
    region
        .extension()
        .memory_quiesce
        .store(u64::from(dead), Ordering::Release);
    region.memory_call_begins(&slot, 0);
    region.memory_call_done(&slot, 0);
    assert_eq!(
        region.extension().memory_quiesce.load(Ordering::Acquire),
        0,
        "the dead process's mark is cleared by the next data call"
    );
    // A live measurer's mark stands (the call waits at most 2 ms for it).
    region
        .extension()
        .memory_quiesce
        .store(u64::from(std::process::id()), Ordering::Release);
    region.memory_call_begins(&slot, 0);
    region.memory_call_done(&slot, 0);
    assert_eq!(
        region.extension().memory_quiesce.load(Ordering::Acquire),
        u64::from(std::process::id())
    );
}

/// What this process holds: `data` bytes of data on device 0.
fn holding(data: u64) -> vgpu_region::ChargeTable {
    let mut held = [[0; 3]; MAX_DEVICES];
    held[0][MemoryKind::Data.index()] = data;
    held
}

#[test]
fn a_charge_a_writer_lowered_is_raised_back_to_what_the_process_holds() {
    let dir = ScratchDir::new("keep-raised");
    let region = open(&dir);
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, GIB, None).unwrap();
    assert_eq!(
        region.keep_slot(&slot, 0, &holding(GIB)).unwrap(),
        vgpu_region::SlotKept::Intact
    );
    // A writer lowers the slot's data charge (and the running total with it).
    let usage = &region.hami().procs[slot.index()].used[0];
    usage.data_size.store(GIB / 4, Ordering::Relaxed);
    usage.total.store(GIB / 4, Ordering::Relaxed);
    assert_eq!(
        region.slot_differs(&slot, &holding(GIB)),
        vgpu_region::SlotKept::Raised(GIB - GIB / 4),
        "the look without the lock sees what is missing"
    );
    assert_eq!(
        region.slot_differs(&slot, &holding(GIB / 4)),
        vgpu_region::SlotKept::Intact
    );
    assert_eq!(
        region.keep_slot(&slot, 0, &holding(GIB)).unwrap(),
        vgpu_region::SlotKept::Raised(GIB - GIB / 4)
    );
    assert_eq!(region.device_used(0), GIB, "the running total is recounted");
    // A charge above what the process says it holds (one under way) is left as it is.
    region.try_charge(&slot, 0, MemoryKind::Data, 7, None).unwrap();
    assert_eq!(
        region.keep_slot(&slot, 0, &holding(GIB)).unwrap(),
        vgpu_region::SlotKept::Intact
    );
    assert_eq!(region.device_used(0), GIB + 7);
}

#[test]
fn a_slot_that_an_older_image_copied_over_the_file_erased_is_taken_back_with_its_charges() {
    let dir = ScratchDir::new("keep-restored");
    let region = open(&dir);
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, GIB, None).unwrap();
    // `cp` of a fresh image over the live file: the same inode, every byte replaced.
    let image = vgpu_region::initial_image(&one_device()).unwrap();
    std::fs::write(dir.region_path(), &image).unwrap();
    assert_eq!(region.device_used(0), 0, "the copy erased the charge");
    assert_eq!(
        region.slot_differs(&slot, &holding(GIB)),
        vgpu_region::SlotKept::Restored(GIB)
    );
    let refused = region.try_charge(&slot, 0, MemoryKind::Data, 1, None);
    assert!(
        matches!(refused, Err(ChargeError::Region(RegionError::SlotLost { .. }))),
        "{refused:?}"
    );
    assert_eq!(
        region.keep_slot(&slot, 0, &holding(GIB)).unwrap(),
        vgpu_region::SlotKept::Restored(GIB)
    );
    assert_eq!(region.device_used(0), GIB);
    let snapshot = read_snapshot(&std::fs::read(dir.region_path()).unwrap()).unwrap();
    let process = snapshot
        .processes
        .iter()
        .find(|process| process.slot == slot.index())
        .expect("the slot is listed");
    assert_eq!((process.pid, process.memory[0].data), (own_pid(), GIB));
    // The slot is the process's again: its calls work.
    region.try_charge(&slot, 0, MemoryKind::Data, 1, None).unwrap();
    assert_eq!(region.uncharge(&slot, 0, MemoryKind::Data, GIB + 1).unwrap(), GIB + 1);
}

#[test]
fn a_slot_another_live_process_holds_now_is_left_to_it() {
    let dir = ScratchDir::new("keep-taken");
    let region = open(&dir);
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, GIB, None).unwrap();
    // The copied image has another process (pid 1, alive, start time unknown) in this slot.
    let shared = &region.hami().procs[slot.index()];
    shared.pid.store(1, Ordering::Relaxed);
    region.extension().slots[slot.index()]
        .start_time
        .store(0, Ordering::Relaxed);
    assert_eq!(
        region.keep_slot(&slot, 0, &holding(GIB)).unwrap(),
        vgpu_region::SlotKept::TakenBy(1)
    );
    assert_eq!(shared.pid.load(Ordering::Relaxed), 1, "nothing was changed");
}
