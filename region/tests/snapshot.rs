//! `read_snapshot` over valid, truncated, corrupted and random images: it returns errors, never
//! panics, and its results stay within bounds. `fuzz/fuzz_targets/region_reader.rs` does the same
//! with coverage guidance.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{Rng, ScratchDir, one_device, own_pid};
use vgpu_region::{
    EXTENSION_OFFSET, HAMI_REGION_SIZE, InitParams, LayoutError, MAX_DEVICES, MAX_SLOTS, MemoryKind, REGION_FILE_SIZE,
    Region, Snapshot, initial_image, read_snapshot,
};

/// Offsets worth corrupting: the header, counts, a few slots' pid/status/seqlock/used, the
/// extension header.
const HOT_OFFSETS: &[usize] = &[
    0,
    4,
    8,
    12,
    16,
    56,
    64,
    1600,
    1728,
    1856,
    1856 + 1928,
    1856 + 1936,
    1856 + 8,
    1856 + 1960,
    2_008_896,
    2_008_900,
    2_008_904,
    2_008_908,
    2_008_912,
    EXTENSION_OFFSET,
    EXTENSION_OFFSET + 8,
    EXTENSION_OFFSET + 12,
    EXTENSION_OFFSET + 16,
    EXTENSION_OFFSET + 96,
    EXTENSION_OFFSET + 1024,
];

fn check_bounds(snapshot: &Snapshot) {
    assert!(snapshot.uuids.len() <= MAX_DEVICES);
    assert!(snapshot.proc_num <= MAX_SLOTS);
    assert!(snapshot.processes.len() <= snapshot.proc_num);
    assert!(
        snapshot
            .processes
            .iter()
            .all(|process| process.slot < snapshot.proc_num && process.status != 0)
    );
    assert!(snapshot.processes.windows(2).all(|pair| pair[0].slot < pair[1].slot));
    for device in 0..=MAX_DEVICES {
        let _ = snapshot.device_used(device);
        let _ = snapshot.slots_sum(device);
    }
}

fn valid_image() -> Vec<u8> {
    initial_image(&InitParams {
        device_uuids: vec!["GPU-a".into(), "GPU-b".into()],
        ..InitParams::default()
    })
    .unwrap()
}

#[test]
fn a_fresh_image_decodes() {
    let snapshot = read_snapshot(&valid_image()).unwrap();
    assert_eq!((snapshot.major_version, snapshot.minor_version), (1, 2));
    assert_eq!(snapshot.uuids, ["GPU-a", "GPU-b"]);
    assert_eq!(
        (snapshot.proc_num, snapshot.priority, snapshot.utilization_switch),
        (0, 1, 1)
    );
    assert_eq!(snapshot.extension.unwrap().creator_pid, own_pid());
}

#[test]
fn a_hami_only_image_decodes_without_extension() {
    let image = valid_image();
    let snapshot = read_snapshot(&image[..HAMI_REGION_SIZE]).unwrap();
    assert_eq!(snapshot.extension, None);
    let mut foreign = image.clone();
    foreign[EXTENSION_OFFSET..EXTENSION_OFFSET + 8].copy_from_slice(b"HAMICORE");
    assert_eq!(read_snapshot(&foreign).unwrap().extension, None);
    let mut longer = image;
    longer.extend_from_slice(&[0xAB; 100]);
    assert!(read_snapshot(&longer).unwrap().extension.is_some());
}

#[test]
fn short_images_are_errors() {
    let image = valid_image();
    for len in [0, 1, 7, 64, 1856, HAMI_REGION_SIZE - 1] {
        assert_eq!(
            read_snapshot(&image[..len]),
            Err(LayoutError::TooShort {
                len: len as u64,
                needed: HAMI_REGION_SIZE as u64
            })
        );
    }
}

#[test]
fn a_slot_left_odd_by_a_dead_writer_is_reported_inconsistent_without_spinning() {
    let dir = ScratchDir::new("odd");
    let region = Region::open(&dir.region_path(), &one_device()).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, 10, None).unwrap();
    region.hami().procs[slot.index()]
        .seqlock
        .fetch_add(1, Ordering::Relaxed);

    // Bounded by SEQLOCK_READ_ATTEMPTS, not by a time: each of its yields can cost a timeslice on
    // a loaded machine (CI's exceeded 100 ms), where a spin on the odd count would never end.
    let start = Instant::now();
    let live = region.snapshot();
    assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    assert!(!live.processes[0].consistent);
    assert_eq!(live.processes[0].memory[0].data, 10, "the values are still reported");
    let from_file = read_snapshot(&std::fs::read(dir.region_path()).unwrap()).unwrap();
    assert!(!from_file.processes[0].consistent);

    // The next writer closes the seqlock.
    region.try_charge(&slot, 0, MemoryKind::Data, 10, None).unwrap();
    assert!(region.snapshot().processes[0].consistent);
}

#[test]
fn random_and_corrupted_images_never_panic() {
    let mut rng = Rng::new(0x5EED);
    let base = valid_image();
    let start = Instant::now();

    // Garbage of every length class, including ones long enough to pass the size check.
    for _ in 0..100 {
        let len = match rng.next() % 4 {
            0 => rng.range(0, 4096) as usize,
            1 => rng.range(0, HAMI_REGION_SIZE as u64 - 1) as usize,
            2 => rng.range(HAMI_REGION_SIZE as u64, REGION_FILE_SIZE as u64 + 64) as usize,
            _ => REGION_FILE_SIZE,
        };
        let bytes: Vec<u8> = (0..len.div_ceil(8))
            .flat_map(|_| rng.next().to_le_bytes())
            .take(len)
            .collect();
        if let Ok(snapshot) = read_snapshot(&bytes) {
            check_bounds(&snapshot);
        }
    }

    // A valid image with random patches: most decode, with arbitrary values in range.
    let mut decoded = 0;
    for _ in 0..200 {
        let mut image = base.clone();
        for _ in 0..rng.range(1, 8) {
            let offset = if rng.one_in(2) {
                HOT_OFFSETS[rng.next() as usize % HOT_OFFSETS.len()]
            } else {
                rng.range(0, REGION_FILE_SIZE as u64 - 8) as usize
            };
            let value = match rng.next() % 4 {
                0 => rng.next(),
                1 => rng.range(0, 2048),
                2 => u64::MAX,
                _ => 1,
            };
            image[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
        }
        // Sometimes plausible counts, so the slot decoding runs over garbage.
        if rng.one_in(2) {
            image[2_008_896..2_008_900].copy_from_slice(&(rng.range(0, 1024) as i32).to_le_bytes());
            image[56..64].copy_from_slice(&rng.range(0, 16).to_le_bytes());
            image[0..12].copy_from_slice(&base[0..12]);
        }
        let len = if rng.one_in(8) {
            rng.range(0, REGION_FILE_SIZE as u64) as usize
        } else {
            image.len()
        };
        if let Ok(snapshot) = read_snapshot(&image[..len]) {
            check_bounds(&snapshot);
            decoded += 1;
        }
    }
    assert!(decoded > 60, "only {decoded} patched images decoded");
    assert!(start.elapsed() < Duration::from_secs(20));
}
