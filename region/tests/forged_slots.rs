//! Slots that are not live, written by a hostile writer (docs/threat-model.md): the bytes of a free
//! slot are nobody's, so a writer may put anything there, `status = 1` included. Such a slot may
//! make the running totals larger (a denial of service to the file's processes), never smaller:
//! memory past the limit would follow. `tests/integration/tests/region_attacks.rs` writes random
//! bytes everywhere but the accounting (the live slots, `proc_num`, the totals and the limits); these
//! are the writes among those that lowered the totals when their slot was freed, one at a time.

mod common;

use std::process::{Child, Command};
use std::sync::atomic::Ordering;

use common::{ScratchDir, one_device, own_pid};
use vgpu_region::{ChargeError, MemoryKind, Region};

const MIB: u64 = 1 << 20;
const LIMIT: u64 = 1024 * MIB;
/// What this process really holds: over half the limit, so that any charge of [`ASKED`] is over it.
const HELD: u64 = 900 * MIB;
const ASKED: u64 = 200 * MIB;

/// A region with this process's slot holding [`HELD`] of the limit.
fn region_holding(dir: &ScratchDir) -> (Region, vgpu_region::Slot) {
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    region
        .try_charge(&slot, 0, MemoryKind::Data, HELD, Some(LIMIT))
        .unwrap();
    (region, slot)
}

/// A process that lives until killed, to hold a slot of its own.
struct Sleeper(Child);

impl Sleeper {
    fn spawn() -> Sleeper {
        Sleeper(vgpu_test_spawn::spawn_started(Command::new("sleep").arg("60")).expect("start sleep"))
    }

    fn pid(&self) -> i32 {
        self.0.id() as i32
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The limit still holds: a charge of [`ASKED`] is refused and the running total is what this
/// process holds.
fn assert_limit_holds(region: &Region, slot: &vgpu_region::Slot, what: &str) {
    let result = region.try_charge(slot, 0, MemoryKind::Data, ASKED, Some(LIMIT));
    assert!(
        matches!(result, Err(ChargeError::Refused(_))),
        "{what}: {} MiB more were charged over the {} MiB this process holds, under a {} MiB limit ({result:?}); \
         the running total is now {} MiB",
        ASKED / MIB,
        HELD / MIB,
        LIMIT / MIB,
        region.device_used(0) / MIB,
    );
    assert!(
        region.device_used(0) >= HELD,
        "{what}: the running total is {} MiB, under the {} MiB held",
        region.device_used(0) / MIB,
        HELD / MIB
    );
}

#[test]
fn a_forged_slot_in_a_hole_below_proc_num_never_lowers_the_total_when_reaped() {
    let dir = ScratchDir::new("forged-hole");
    let (region, slot) = region_holding(&dir);
    // Two other processes; the first one leaves, as processes do in any order: slot 1 is a free
    // hole below proc_num, which every reap looks at.
    let (first, second) = (Sleeper::spawn(), Sleeper::spawn());
    let first_slot = region.attach(first.pid()).unwrap();
    let _second_slot = region.attach(second.pid()).unwrap();
    assert_eq!(first_slot.index(), 1);
    region.detach(&first_slot).unwrap();
    assert_eq!(region.hami().proc_num.load(Ordering::Relaxed), 3);

    // A writer's bytes in the free slot: status 1 (its pid stays 0, a dead process) and a total of
    // 800 MiB that was never charged.
    let forged = &region.hami().procs[1];
    forged.used[0].total.store(800 * MIB, Ordering::Relaxed);
    forged.status.store(1, Ordering::Relaxed);
    // The next charge reaps (as one does every 100 ms).
    region.extension().last_reap_ns.store(0, Ordering::Relaxed);
    assert_limit_holds(&region, &slot, "after a forged slot in a hole was reaped");
}

#[test]
fn a_forged_slot_whose_kinds_saturate_the_recount_never_lowers_the_total_when_reaped() {
    let dir = ScratchDir::new("forged-saturated");
    let (region, slot) = region_holding(&dir);
    // A writer's bytes in a free slot far past proc_num: status 1 and two top bytes of its kinds,
    // whose sum is past 64 bits.
    let forged = &region.hami().procs[700];
    forged.used[0].context_size.store(0x80 << 56, Ordering::Relaxed);
    forged.used[0].data_size.store(0x80 << 56, Ordering::Relaxed);
    forged.status.store(1, Ordering::Relaxed);
    // And one byte into the lock's holder word: the next holder takes its predecessor for dead
    // in the middle of an update and recounts the totals from the slots, then reaps.
    region.extension().lock.holder.store(0x42, Ordering::Relaxed);
    assert_limit_holds(
        &region,
        &slot,
        "after a forged slot with saturating kinds was recounted and reaped",
    );
}

#[test]
fn attaching_over_a_forged_slot_of_the_same_pid_never_lowers_the_total() {
    let dir = ScratchDir::new("forged-same-pid");
    let (region, slot) = region_holding(&dir);
    // A writer's bytes in a free slot: status 1, the pid of a process about to start, and a total
    // never charged. Attach takes the slot for that process's earlier image (an exec) and releases
    // it.
    let starting = Sleeper::spawn();
    let forged = &region.hami().procs[5];
    forged.used[0].total.store(800 * MIB, Ordering::Relaxed);
    forged.pid.store(starting.pid(), Ordering::Relaxed);
    forged.status.store(1, Ordering::Relaxed);
    let attached = region.attach(starting.pid()).unwrap();
    assert_eq!(attached.index(), 5);
    assert_limit_holds(&region, &slot, "after attaching over a forged slot of the same pid");
}
