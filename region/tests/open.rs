//! Opening the region: creation, rebuilding invalid files nobody uses, refusing invalid files in
//! use, and clear errors for unusable paths.

mod common;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{Rng, ScratchDir, one_device, own_pid};
use vgpu_region::{
    EXTENSION_OFFSET, HAMI_REGION_SIZE, InitError, InitParams, LayoutError, MemoryKind, OpenKind, REGION_FILE_SIZE,
    Region, RegionError, read_snapshot,
};

fn open(path: &Path) -> Result<Region, RegionError> {
    Region::open(path, &one_device())
}

/// A region file whose process attached and charged, then went away (region dropped).
fn used_region_file(dir: &ScratchDir) -> std::path::PathBuf {
    let path = dir.region_path();
    let region = open(&path).unwrap();
    let slot = region.attach(own_pid()).unwrap();
    region.try_charge(&slot, 0, MemoryKind::Data, 4096, None).unwrap();
    path
}

fn patch(path: &Path, offset: usize, bytes: &[u8]) {
    OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(bytes, offset as u64)
        .unwrap();
}

/// Holds the file the way a live user does (a shared flock on its own open file description).
fn hold_shared(path: &Path) -> File {
    let file = File::open(path).unwrap();
    // SAFETY: plain flock on an open fd.
    assert_eq!(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH) }, 0);
    file
}

fn assert_valid_and_fresh(region: &Region) {
    let snapshot = read_snapshot(&std::fs::read(region.path()).unwrap()).unwrap();
    assert!(snapshot.extension.is_some());
    assert_eq!(
        (snapshot.proc_num, snapshot.processes.len(), snapshot.device_used(0)),
        (0, 0, 0)
    );
    assert_eq!(std::fs::metadata(region.path()).unwrap().len(), REGION_FILE_SIZE as u64);
}

fn assert_one_line_naming(error: &RegionError, path: &Path) {
    let message = error.to_string();
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(message.contains(&*path.to_string_lossy()), "{message}");
}

fn rebuilt_problem(region: &Region) -> LayoutError {
    match region.open_kind() {
        OpenKind::Rebuilt(problem) => problem.clone(),
        other => panic!("expected a rebuild, got {other:?}"),
    }
}

#[test]
fn creates_the_file_with_mode_0666_whatever_the_umask() {
    let dir = ScratchDir::new("mode");
    let region = open(&dir.region_path()).unwrap();
    assert_eq!(region.open_kind(), &OpenKind::Created);
    let mode = std::fs::metadata(dir.region_path()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o666);
    assert_valid_and_fresh(&region);
}

#[test]
fn an_empty_existing_file_is_created_into() {
    let dir = ScratchDir::new("empty");
    File::create(dir.region_path()).unwrap();
    assert_eq!(open(&dir.region_path()).unwrap().open_kind(), &OpenKind::Created);
}

#[test]
fn a_valid_file_nobody_uses_is_reinitialised_without_stale_slots() {
    let dir = ScratchDir::new("stale");
    let path = used_region_file(&dir);
    let init = InitParams {
        priority: 9,
        ..one_device()
    };
    let region = Region::open(&path, &init).unwrap();
    assert_eq!(region.open_kind(), &OpenKind::Reinitialised);
    assert_valid_and_fresh(&region);
    assert_eq!(region.snapshot().priority, 9, "the header comes from the new creator");
}

#[test]
fn a_valid_file_in_use_is_joined_as_it_is() {
    let dir = ScratchDir::new("join");
    let first = open(&dir.region_path()).unwrap();
    let slot = first.attach(own_pid()).unwrap();
    first.try_charge(&slot, 0, MemoryKind::Data, 777, None).unwrap();
    let init = InitParams {
        priority: 9,
        ..one_device()
    };
    let second = Region::open(&dir.region_path(), &init).unwrap();
    assert_eq!(second.open_kind(), &OpenKind::Joined);
    assert_eq!((second.device_used(0), second.snapshot().priority), (777, 1));
}

#[test]
fn inconsistent_totals_in_a_file_in_use_are_repaired() {
    let dir = ScratchDir::new("repair");
    let first = open(&dir.region_path()).unwrap();
    let slot = first.attach(own_pid()).unwrap();
    first.try_charge(&slot, 0, MemoryKind::Data, 100, None).unwrap();
    first.extension().device_used[0].store(5000, Ordering::Relaxed);
    let second = open(&dir.region_path()).unwrap();
    assert_eq!(
        second.open_kind(),
        &OpenKind::Repaired(LayoutError::TotalMismatch {
            device: 0,
            recorded: 5000,
            slots_sum: Some(100)
        })
    );
    assert_eq!(first.device_used(0), 100);
}

#[test]
fn a_truncated_file_is_rebuilt() {
    let dir = ScratchDir::new("truncated");
    let path = used_region_file(&dir);
    for len in [
        1000,
        HAMI_REGION_SIZE as u64,
        REGION_FILE_SIZE as u64 - 1,
        REGION_FILE_SIZE as u64 + 1,
    ] {
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len)
            .unwrap();
        let region = open(&path).unwrap();
        assert_eq!(
            rebuilt_problem(&region),
            LayoutError::WrongFileSize {
                len,
                expected: REGION_FILE_SIZE as u64
            }
        );
        assert_valid_and_fresh(&region);
    }
}

#[test]
fn a_file_of_random_bytes_is_rebuilt() {
    let dir = ScratchDir::new("random");
    let mut rng = Rng::new(42);
    let bytes: Vec<u8> = (0..REGION_FILE_SIZE).map(|_| rng.next() as u8).collect();
    std::fs::write(dir.region_path(), bytes).unwrap();
    let region = open(&dir.region_path()).unwrap();
    assert!(matches!(rebuilt_problem(&region), LayoutError::NotInitialised { .. }));
    assert_valid_and_fresh(&region);
}

#[test]
fn a_foreign_text_file_is_rebuilt() {
    let dir = ScratchDir::new("foreign");
    std::fs::write(dir.region_path(), "this is not a region\n").unwrap();
    let region = open(&dir.region_path()).unwrap();
    assert!(matches!(
        rebuilt_problem(&region),
        LayoutError::WrongFileSize { len: 21, .. }
    ));
    assert_valid_and_fresh(&region);
}

#[test]
fn wrong_versions_and_magics_are_rebuilt() {
    let dir = ScratchDir::new("versions");
    let path = used_region_file(&dir);
    let cases: [(usize, &[u8], LayoutError); 5] = [
        (8, &1u32.to_le_bytes(), LayoutError::WrongVersion { major: 1, minor: 1 }),
        (4, &2u32.to_le_bytes(), LayoutError::WrongVersion { major: 2, minor: 2 }),
        (0, &7i32.to_le_bytes(), LayoutError::NotInitialised { flag: 7 }),
        (
            EXTENSION_OFFSET,
            b"HAMICORE",
            LayoutError::BadExtensionMagic {
                magic: u64::from_le_bytes(*b"HAMICORE"),
            },
        ),
        (
            EXTENSION_OFFSET + 8,
            &2u32.to_le_bytes(),
            LayoutError::WrongExtensionVersion { version: 2 },
        ),
    ];
    for (offset, bytes, problem) in cases {
        used_region_file(&dir);
        patch(&path, offset, bytes);
        let region = open(&path).unwrap();
        assert_eq!(rebuilt_problem(&region), problem);
        assert_valid_and_fresh(&region);
    }
}

#[test]
fn out_of_range_counts_and_inconsistent_totals_are_rebuilt() {
    let dir = ScratchDir::new("counts");
    let path = dir.region_path();
    let cases: [(usize, Vec<u8>, LayoutError); 4] = [
        (
            56,
            17u64.to_le_bytes().to_vec(),
            LayoutError::TooManyDevices { device_num: 17 },
        ),
        (
            2_008_896,
            1025i32.to_le_bytes().to_vec(),
            LayoutError::BadProcNum { proc_num: 1025 },
        ),
        (
            2_008_896,
            (-1i32).to_le_bytes().to_vec(),
            LayoutError::BadProcNum { proc_num: -1 },
        ),
        (
            EXTENSION_OFFSET + 96,
            5u64.to_le_bytes().to_vec(),
            LayoutError::TotalMismatch {
                device: 0,
                recorded: 5,
                slots_sum: Some(4096),
            },
        ),
    ];
    for (offset, bytes, problem) in cases {
        used_region_file(&dir);
        patch(&path, offset, &bytes);
        assert_eq!(rebuilt_problem(&open(&path).unwrap()), problem);
    }
}

#[test]
fn a_bad_file_in_use_is_refused_not_rebuilt() {
    let dir = ScratchDir::new("inuse");
    let path = used_region_file(&dir);
    patch(&path, EXTENSION_OFFSET, b"HAMICORE");
    let before = std::fs::read(&path).unwrap();
    let _holder = hold_shared(&path);
    let error = open(&path).err().unwrap();
    assert!(
        matches!(
            &error,
            RegionError::InUseWithBadLayout {
                problem: LayoutError::BadExtensionMagic { .. },
                ..
            }
        ),
        "{error:?}"
    );
    assert_one_line_naming(&error, &path);
    assert_eq!(std::fs::read(&path).unwrap(), before, "a file in use is never touched");

    std::fs::write(dir.path().join("text"), "hello").unwrap();
    let _text_holder = hold_shared(&dir.path().join("text"));
    let error = open(&dir.path().join("text")).err().unwrap();
    assert!(matches!(
        &error,
        RegionError::InUseWithBadLayout {
            problem: LayoutError::WrongFileSize { .. },
            ..
        }
    ));
}

#[test]
fn an_exclusive_holder_makes_open_give_up_after_a_second() {
    let dir = ScratchDir::new("exclusive");
    let path = used_region_file(&dir);
    let holder = File::open(&path).unwrap();
    // SAFETY: plain flock on an open fd.
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
    let start = Instant::now();
    let error = open(&path).err().unwrap();
    assert!(matches!(error, RegionError::FileLockTimeout { .. }), "{error:?}");
    assert!(start.elapsed() >= Duration::from_millis(900) && start.elapsed() < Duration::from_secs(3));
    assert_one_line_naming(&error, &path);
}

#[test]
fn unusable_paths_give_clear_errors() {
    let dir = ScratchDir::new("paths");
    let missing = dir.path().join("no-such-directory").join("region.cache");
    let error = open(&missing).err().unwrap();
    assert!(matches!(&error, RegionError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound));
    assert_one_line_naming(&error, &missing);

    // Tests run as root in CI, so permissions cannot make a directory unwritable; a path through a
    // non-directory and a path in /proc fail for everyone.
    for path in [
        Path::new("/dev/null/region.cache"),
        Path::new("/proc/vgpu-region-test.cache"),
    ] {
        let error = open(path).err().unwrap();
        assert!(matches!(&error, RegionError::Open { .. }), "{path:?}: {error:?}");
        assert_one_line_naming(&error, path);
    }

    let error = open(dir.path()).err().unwrap();
    assert_one_line_naming(&error, dir.path());

    let odd = dir.path().join("line\nbreak");
    std::fs::create_dir(&odd).unwrap();
    let error = open(&odd).err().unwrap();
    assert_eq!(error.to_string().lines().count(), 1, "{error}");
}

#[test]
fn invalid_init_params_are_refused_before_touching_the_file() {
    let dir = ScratchDir::new("init");
    let path = dir.region_path();
    let many = InitParams {
        device_uuids: (0..17).map(|index| format!("GPU-{index}")).collect(),
        ..Default::default()
    };
    let twice = InitParams {
        device_uuids: vec!["GPU-a".into(), "GPU-a".into()],
        ..Default::default()
    };
    let empty = InitParams {
        device_uuids: vec![String::new()],
        ..Default::default()
    };
    let expected = [
        InitError::TooManyDevices { count: 17 },
        InitError::DuplicateUuid { uuid: "GPU-a".into() },
        InitError::BadUuid { uuid: String::new() },
    ];
    for (init, expected) in [many, twice, empty].iter().zip(expected) {
        match Region::open(&path, init) {
            Err(RegionError::InvalidInit { problem, .. }) => assert_eq!(problem, expected),
            other => panic!("{:?}", other.map(|region| region.open_kind().clone())),
        }
    }
    assert!(!path.exists());
}
