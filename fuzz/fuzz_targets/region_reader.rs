//! Fuzzes `vgpu_region::read_snapshot`, the decoder monitors use on region files: whatever a
//! corrupt or hostile file holds, it must return an error or a snapshot within bounds, never panic
//! and never run unboundedly.
//!
//! Each input is used twice: as an image on its own (mostly too short, exercising the size and
//! header checks), and as patches over a valid image so that the slot and device decoding runs
//! over arbitrary values. Patch records are `offset: u32 LE, len: u8, bytes[len % 9]`; a first
//! byte with its top bit set also truncates the image at a length taken from the next 4 bytes.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vgpu_region::{InitParams, MAX_DEVICES, MAX_SLOTS, REGION_FILE_SIZE, Snapshot, initial_image, read_snapshot};

fn base_image() -> &'static [u8] {
    static BASE: OnceLock<Vec<u8>> = OnceLock::new();
    BASE.get_or_init(|| {
        let init = InitParams { device_uuids: vec!["GPU-a".into(), "GPU-b".into()], ..InitParams::default() };
        initial_image(&init).expect("valid init params")
    })
}

fn check(snapshot: &Snapshot) {
    assert!(snapshot.uuids.len() <= MAX_DEVICES);
    assert!(snapshot.proc_num <= MAX_SLOTS);
    assert!(snapshot.processes.len() <= snapshot.proc_num);
    for process in &snapshot.processes {
        assert!(process.slot < snapshot.proc_num);
        assert_ne!(process.status, 0);
    }
    for device in 0..=MAX_DEVICES {
        let _ = snapshot.device_used(device);
        let _ = snapshot.slots_sum(device);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(snapshot) = read_snapshot(data) {
        check(&snapshot);
    }

    let mut image = base_image().to_vec();
    let mut rest = data;
    let mut truncate_to = None;
    if let [first, a, b, c, d, tail @ ..] = rest {
        if first & 0x80 != 0 {
            truncate_to = Some(u32::from_le_bytes([*a, *b, *c, *d]) as usize % (REGION_FILE_SIZE + 1));
            rest = tail;
        }
    }
    while let [a, b, c, d, len, tail @ ..] = rest {
        let offset = u32::from_le_bytes([*a, *b, *c, *d]) as usize % REGION_FILE_SIZE;
        let len = (*len as usize % 9).min(tail.len()).min(REGION_FILE_SIZE - offset);
        image[offset..offset + len].copy_from_slice(&tail[..len]);
        rest = &tail[len..];
    }
    if let Some(len) = truncate_to {
        image.truncate(len);
    }
    if let Ok(snapshot) = read_snapshot(&image) {
        check(&snapshot);
    }
});
