//! Changing a region's limits from a tool (`vgpu-smi set`): only a region that processes use is
//! joined (a missing or unused file is never created or rewritten: the next process re-creates it
//! from its variables), and the limits are written under the lock.

mod common;

use common::{ScratchDir, one_device};
use vgpu_region::{MAX_DEVICES, Owners, Region, RegionError, UnsafeFile};

#[test]
fn only_a_region_in_use_is_joined_and_nothing_else_is_touched() {
    let dir = ScratchDir::new("in-use");
    let path = dir.region_path();
    assert!(matches!(
        Region::open_in_use(&path, Owners::SelfOrRoot),
        Err(RegionError::NotInUse { .. })
    ));
    assert!(!path.exists(), "a missing region was created");

    // A valid region that nobody uses any more: left byte for byte.
    drop(Region::open(&path, &one_device()).unwrap());
    let before = std::fs::read(&path).unwrap();
    let refused = Region::open_in_use(&path, Owners::SelfOrRoot).err().expect("refused");
    assert!(matches!(refused, RegionError::NotInUse { .. }), "{refused}");
    assert_eq!(refused.to_string().lines().count(), 1);
    assert_eq!(std::fs::read(&path).unwrap(), before, "an unused region was rewritten");

    // A link is refused as Region::open refuses it.
    let link = dir.path().join("link.cache");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    assert!(matches!(
        Region::open_in_use(&link, Owners::SelfOrRoot),
        Err(RegionError::UnsafeFile {
            problem: UnsafeFile::Symlink,
            ..
        })
    ));
}

#[test]
fn limits_are_written_under_the_lock_and_seen_by_every_user() {
    let dir = ScratchDir::new("set-limits");
    let path = dir.region_path();
    let mut init = one_device();
    init.limits[0] = 1 << 30;
    init.sm_limits[0] = 50;
    let user = Region::open(&path, &init).unwrap();
    let tool = Region::open_in_use(&path, Owners::SelfOrRoot).unwrap();
    assert_eq!(tool.set_limits(0, Some(4 << 30), Some(30)).unwrap(), (1 << 30, 50));
    assert_eq!(
        tool.set_limits(0, None, Some(0)).unwrap(),
        (4 << 30, 30),
        "memory left as it is"
    );
    assert_eq!(tool.set_limits(0, Some(0), None).unwrap(), (4 << 30, 0));
    let seen = user.snapshot();
    assert_eq!((seen.limits[0], seen.sm_limits[0]), (0, 0));
    assert!(matches!(
        tool.set_limits(MAX_DEVICES, Some(1), None),
        Err(RegionError::NoSuchDevice { device: 16, .. })
    ));
    // The tool's own hold keeps the region in use: a process starting now joins it, limits and all.
    drop(user);
    let joined = Region::open(&path, &one_device()).unwrap();
    assert_eq!(*joined.open_kind(), vgpu_region::OpenKind::Joined);
}
