//! A forked child inherits the mapping and the file lock but not the parent's slot: it attaches
//! its own. Its own test binary, so that `fork` happens with no other test thread running.

mod common;

use common::{ScratchDir, one_device, own_pid};
use vgpu_region::{MemoryKind, Region};

#[test]
fn a_forked_child_attaches_its_own_slot_and_is_reaped_after_it_exits() {
    let dir = ScratchDir::new("fork");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let parent_slot = region.attach(own_pid()).unwrap();
    region
        .try_charge(&parent_slot, 0, MemoryKind::Data, 1000, None)
        .unwrap();

    // SAFETY: the child only uses the region (its mutex lives in shared memory, so no lock can be
    // stranded by the fork) and leaves with _exit, running no destructors or atexit handlers.
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        let code = match region.attach(own_pid()) {
            Ok(slot) if slot.index() != parent_slot.index() && slot.pid() != parent_slot.pid() => {
                let charged = region.try_charge(&slot, 0, MemoryKind::Data, 24, None).is_ok();
                if charged && region.device_used(0) == 1024 { 0 } else { 2 }
            }
            _ => 1,
        };
        // SAFETY: ends the child immediately; see above.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child status {status:#x}"
    );

    assert_eq!(
        region.device_used(0),
        1024,
        "the child's charge stays until it is reaped"
    );
    assert_eq!(region.reap_dead().unwrap(), 1);
    assert_eq!(region.device_used(0), 1000, "only the parent's own charge is left");
    let snapshot = region.snapshot();
    assert_eq!(snapshot.processes.len(), 1);
    assert_eq!(snapshot.processes[0].pid, own_pid());
}

#[test]
fn a_forked_child_never_shares_its_parents_hold_on_the_lock() {
    let dir = ScratchDir::new("fork-exclusion");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let held = region.hold_lock().unwrap();

    // SAFETY: the child only uses the region and leaves with _exit (see above).
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        // The parent holds the lock: the child's first attempt must wait for it and give up
        // (sharing the parent's lock description, it would get it at once).
        let started = std::time::Instant::now();
        let first = region.attach(own_pid());
        let waited = started.elapsed();
        let code = match first {
            Err(vgpu_region::RegionError::LockTimeout { .. }) if waited >= std::time::Duration::from_millis(900) => {
                // The parent lets go within the second attempt's second.
                match region.attach(own_pid()) {
                    Ok(slot) if region.try_charge(&slot, 0, MemoryKind::Data, 5, None).is_ok() => 0,
                    _ => 3,
                }
            }
            Err(_) => 2,
            Ok(_) => 1,
        };
        // SAFETY: ends the child immediately.
        unsafe { libc::_exit(code) };
    }
    std::thread::sleep(std::time::Duration::from_millis(1500));
    drop(held);
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child status {status:#x} (1: it took the lock its parent held)"
    );
    assert_eq!(region.device_used(0), 5);
}
