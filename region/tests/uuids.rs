//! Device UUID entries that a hostile or broken writer left without a NUL (issue 16): one GPU must
//! never become two region devices with a limit each.

mod common;

use std::process::{Child, Command};
use std::sync::atomic::Ordering;

use common::{ScratchDir, one_device, own_pid};
use vgpu_region::{ChargeError, MemoryKind, Region, RegionError, UUID_BYTES};

const MIB: u64 = 1 << 20;
const LIMIT: Option<u64> = Some(1024 * MIB);

/// The device of `one_device()`.
fn uuid() -> String {
    one_device().device_uuids[0].clone()
}

/// A live process of our own, for a second slot.
fn sleeper() -> Child {
    vgpu_test_spawn::spawn_started(Command::new("sleep").arg("30")).expect("start sleep")
}

fn overwrite_entry(region: &Region, index: usize, bytes: &[u8; UUID_BYTES]) {
    for (byte, value) in region.hami().uuids[index].iter().zip(bytes) {
        byte.store(*value, Ordering::Relaxed);
    }
}

/// Two processes at a 1 GiB limit, each asking for 900 MiB on the same GPU: the second must be
/// refused. Returns the second's device index and whether its charge went through.
fn second_process_charge(joined: &Region, pid: i32) -> (Result<usize, RegionError>, bool) {
    let index = joined.device_index(&uuid());
    let slot = joined.attach(pid).unwrap();
    let charged = match &index {
        Ok(index) => match joined.try_charge(&slot, *index, MemoryKind::Data, 900 * MIB, LIMIT) {
            Ok(()) => true,
            Err(ChargeError::Refused(_)) => false,
            Err(other) => panic!("{other}"),
        },
        Err(_) => false,
    };
    (index, charged)
}

fn total(region: &Region) -> u64 {
    (0..16).map(|device| region.device_used(device)).sum()
}

#[test]
fn a_uuid_without_nul_never_splits_one_gpu() {
    let dir = ScratchDir::new("uuid-no-nul");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let first = region.attach(own_pid()).unwrap();
    let device = region.device_index(&uuid()).unwrap();
    region
        .try_charge(&first, device, MemoryKind::Data, 900 * MIB, LIMIT)
        .unwrap();
    // The GPU's own UUID, then 56 more bytes and no NUL.
    let mut bytes = [b'x'; UUID_BYTES];
    bytes[..uuid().len()].copy_from_slice(uuid().as_bytes());
    overwrite_entry(&region, device, &bytes);

    let mut child = sleeper();
    let joined = Region::open(&dir.region_path(), &one_device()).unwrap();
    let (index, charged) = second_process_charge(&joined, child.id() as i32);
    let used = total(&region);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(index.ok(), Some(device), "the same GPU got another region device");
    assert!(
        !charged,
        "a second 900 MiB was charged: {} MiB under a 1 GiB limit",
        used / MIB
    );
    assert_eq!(used, 900 * MIB);
    // Repaired in place: the entry is the UUID again, and the device count did not grow.
    let snapshot = region.snapshot();
    assert_eq!(snapshot.uuids, vec![uuid()]);
}

#[test]
fn a_corrupt_uuid_entry_fails_closed_with_one_line() {
    let dir = ScratchDir::new("uuid-corrupt");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let first = region.attach(own_pid()).unwrap();
    let device = region.device_index(&uuid()).unwrap();
    region
        .try_charge(&first, device, MemoryKind::Data, 900 * MIB, LIMIT)
        .unwrap();
    overwrite_entry(&region, device, &[b'A'; UUID_BYTES]);

    let mut child = sleeper();
    let joined = Region::open(&dir.region_path(), &one_device()).unwrap();
    let (index, charged) = second_process_charge(&joined, child.id() as i32);
    let used = total(&region);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        !charged,
        "a second 900 MiB was charged: {} MiB under a 1 GiB limit",
        used / MIB
    );
    assert_eq!(used, 900 * MIB);
    let error = index.expect_err("a corrupt entry was taken for another device");
    let line = error.to_string();
    assert!(!line.contains('\n') && line.contains("device entry 0"), "{line}");
    // Nothing registered: the entry is left for whoever can tell which GPU it was.
    assert_eq!(region.hami().device_num.load(Ordering::Relaxed), 1);
}
