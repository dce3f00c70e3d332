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
    EXTENSION_OFFSET, HAMI_REGION_SIZE, InitError, InitParams, LayoutError, MemoryKind, OpenKind, Owners,
    REGION_FILE_SIZE, Region, RegionError, UnsafeFile, read_snapshot,
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
    assert_eq!(region.snapshot().priority, 1, "the container's priority is kept");
}

/// A region reused by the container's next process keeps what HAMi wrote and the limits set while
/// it lived (`vgpu-smi set`, HAMi), not the new process's variables; with another device list it
/// takes the new variables' limits, and keeps HAMi's fields.
#[test]
fn a_reused_region_keeps_its_limits_and_hamis_fields() {
    let dir = ScratchDir::new("reuse-keeps");
    let path = dir.region_path();
    {
        let first = open(&path).unwrap();
        let hami = first.hami();
        hami.limit[0].store(3 << 30, Ordering::Relaxed);
        hami.sm_limit[0].store(30, Ordering::Relaxed);
        hami.utilization_switch.store(0, Ordering::Relaxed);
        hami.recent_kernel.store(-1, Ordering::Relaxed);
        hami.priority.store(0, Ordering::Relaxed);
    }
    let variables = InitParams {
        priority: 5,
        limits: [1 << 30; vgpu_region::MAX_DEVICES],
        sm_limits: [50; vgpu_region::MAX_DEVICES],
        ..one_device()
    };
    let reused = Region::open(&path, &variables).unwrap();
    assert_eq!(reused.open_kind(), &OpenKind::Reinitialised);
    let snapshot = reused.snapshot();
    assert_eq!(
        (
            snapshot.limits[0],
            snapshot.sm_limits[0],
            snapshot.limits[1],
            snapshot.sm_limits[1]
        ),
        (3 << 30, 30, 0, 0),
        "the container's limits are kept, every index"
    );
    assert_eq!(
        (snapshot.utilization_switch, snapshot.recent_kernel, snapshot.priority),
        (0, -1, 0)
    );
    drop(reused);
    let other_devices = InitParams {
        device_uuids: vec!["GPU-11111111-2222-3333-4444-555555555555".to_string()],
        ..variables
    };
    let moved = Region::open(&path, &other_devices).unwrap();
    let snapshot = moved.snapshot();
    assert_eq!(
        (snapshot.limits[0], snapshot.sm_limits[0]),
        (1 << 30, 50),
        "another device list: the variables' limits"
    );
    assert_eq!(
        (snapshot.utilization_switch, snapshot.recent_kernel, snapshot.priority),
        (0, -1, 0)
    );
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
        // Version 1 kept a pthread mutex where version 2 has the lock's hints.
        (
            EXTENSION_OFFSET + 8,
            &1u32.to_le_bytes(),
            LayoutError::WrongExtensionVersion { version: 1 },
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

// ------------------------------------------------------------------------------------------------
// Files that are not this process's to rewrite (issue 16): nothing is followed, truncated or
// rewritten, and each refusal is one line naming the path and why.

const VICTIM: &[u8] = b"precious bytes that are not a region\n";

fn c_path(path: &Path) -> std::ffi::CString {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap()
}

fn assert_refused_because(result: Result<Region, RegionError>, path: &Path, why: &str) -> UnsafeFile {
    let error = match result {
        Ok(region) => panic!("{path:?} was opened ({:?}) instead of refused", region.open_kind()),
        Err(error) => error,
    };
    assert_one_line_naming(&error, path);
    assert!(
        error.to_string().contains(why),
        "{path:?}: {error} does not say {why:?}"
    );
    match error {
        RegionError::UnsafeFile { problem, .. } => problem,
        other => panic!("{path:?}: {other:?} is not UnsafeFile"),
    }
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn a_symlink_at_the_path_is_refused_and_its_target_left_untouched() {
    let dir = ScratchDir::new("symlink");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, VICTIM).unwrap();
    let link = dir.region_path();
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    assert_eq!(
        assert_refused_because(open(&link), &link, "symbolic link"),
        UnsafeFile::Symlink
    );
    assert_eq!(std::fs::read(&victim).unwrap(), VICTIM, "the link's target was changed");

    // A link to a valid region nobody uses: still not followed (it would be reinitialised).
    let region_file = used_region_file(&ScratchDir::new("symlink-target"));
    let image = std::fs::read(&region_file);
    let dir2 = ScratchDir::new("symlink-region");
    std::os::unix::fs::symlink(&region_file, dir2.region_path()).unwrap();
    assert_refused_because(open(&dir2.region_path()), &dir2.region_path(), "symbolic link");
    assert_eq!(std::fs::read(&region_file).ok(), image.ok());

    // A dangling link: its target is not created.
    let dangling = dir.path().join("dangling.cache");
    let target = dir.path().join("created-through-the-link");
    std::os::unix::fs::symlink(&target, &dangling).unwrap();
    assert_refused_because(open(&dangling), &dangling, "symbolic link");
    assert!(!target.exists(), "a file was created through a dangling link");
}

#[test]
fn a_fifo_at_the_path_is_refused_at_once() {
    let dir = ScratchDir::new("fifo");
    let path = dir.region_path();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path(&path).as_ptr(), 0o666) }, 0);
    let start = Instant::now();
    assert_eq!(
        assert_refused_because(open(&path), &path, "FIFO"),
        UnsafeFile::NotRegular { kind: "FIFO" }
    );
    assert!(start.elapsed() < Duration::from_secs(1), "opening a FIFO waited");
}

#[test]
fn devices_and_directories_are_refused() {
    let null = Path::new("/dev/null");
    assert_refused_because(open(null), null, "character device");
    let dir = ScratchDir::new("directory");
    assert_refused_because(open(dir.path()), dir.path(), "directory");
}

#[test]
fn a_hard_link_to_another_file_is_refused_and_the_file_left_untouched() {
    let dir = ScratchDir::new("hardlink");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, VICTIM).unwrap();
    std::fs::hard_link(&victim, dir.region_path()).unwrap();
    assert_eq!(
        assert_refused_because(open(&dir.region_path()), &dir.region_path(), "hard links"),
        UnsafeFile::HardLinks { links: 2 }
    );
    assert_eq!(std::fs::read(&victim).unwrap(), VICTIM, "the linked file was changed");
}

/// Files owned by another (non-root) user: refused, never rewritten. Needs root to `chown`; CI
/// runs as root, elsewhere the test says it is skipped.
#[test]
fn a_file_owned_by_another_user_is_refused_and_left_untouched() {
    if !running_as_root() {
        eprintln!("skipped: chown needs root");
        return;
    }
    const NOBODY: u32 = 65534;
    let dir = ScratchDir::new("owner");
    let path = dir.region_path();
    let valid = used_region_file(&dir);
    assert_eq!(valid, path);
    let cases: [(&str, Vec<u8>); 3] = [
        ("not a region", VICTIM.to_vec()),
        ("a valid region nobody uses", std::fs::read(&path).unwrap()),
        ("empty", Vec::new()),
    ];
    for (what, bytes) in cases {
        std::fs::write(&path, &bytes).unwrap();
        std::os::unix::fs::chown(&path, Some(NOBODY), None).unwrap();
        let problem = assert_refused_because(open(&path), &path, "owned by uid 65534");
        assert_eq!(problem, UnsafeFile::ForeignOwner { owner: NOBODY, uid: 0 }, "{what}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "{what}: the file was changed");
    }
}

/// With [`Owners::Any`] another user's file is used when it is a valid region, and still never
/// rewritten when it is not one.
#[test]
fn trusting_any_owner_uses_their_regions_and_never_rewrites_their_other_files() {
    if !running_as_root() {
        eprintln!("skipped: chown needs root");
        return;
    }
    const NOBODY: u32 = 65534;
    let dir = ScratchDir::new("any-owner");
    let path = used_region_file(&dir);
    std::os::unix::fs::chown(&path, Some(NOBODY), None).unwrap();
    let region = Region::open_with(&path, &one_device(), Owners::Any).unwrap();
    assert_eq!(region.open_kind(), &OpenKind::Reinitialised);
    let joined = Region::open_with(&path, &one_device(), Owners::Any).unwrap();
    assert_eq!(joined.open_kind(), &OpenKind::Joined);
    drop((region, joined));

    let mut patched = std::fs::read(&path).unwrap();
    patched[EXTENSION_OFFSET..EXTENSION_OFFSET + 8].copy_from_slice(b"HAMICORE");
    let cases: [(&str, Vec<u8>); 3] = [
        ("not a region", VICTIM.to_vec()),
        ("a region with a bad extension", patched),
        ("empty", Vec::new()),
    ];
    for (what, bytes) in cases {
        std::fs::write(&path, &bytes).unwrap();
        std::os::unix::fs::chown(&path, Some(NOBODY), None).unwrap();
        let problem = assert_refused_because(
            Region::open_with(&path, &one_device(), Owners::Any),
            &path,
            "never rewritten",
        );
        assert!(
            matches!(problem, UnsafeFile::ForeignInvalid { owner: NOBODY, .. }),
            "{what}: {problem:?}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "{what}: the file was changed");
    }
}
