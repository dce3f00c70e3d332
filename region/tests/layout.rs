//! The region file format is a reviewed snapshot: every field's offset and size, for HAMi-core's
//! struct (which HAMi's monitor maps) and for vgpu's extension. A change shows up as a diff of
//! `snapshots/region_layout.snap`. The key offsets are also compile-time assertions in the crate.

use std::mem::{offset_of, size_of};
use std::path::PathBuf;

use vgpu_region::{
    EXTENSION_OFFSET, EXTENSION_SIZE, Extension, HAMI_REGION_SIZE, ProcSlot, REGION_FILE_SIZE, RegionFile,
    SharedRegion, layout_listing,
};

#[test]
fn region_layout_snapshot() {
    let snapshots = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("snapshots");
    insta::with_settings!({snapshot_path => snapshots, prepend_module_to_snapshot => false}, {
        insta::assert_snapshot!("region_layout", layout_listing());
    });
}

#[test]
fn listing_has_no_gaps_and_matches_hamis_sizes() {
    let listing = layout_listing();
    assert!(
        !listing.contains('!'),
        "the listing reports a gap or overlap:\n{listing}"
    );
    assert_eq!(size_of::<SharedRegion>(), 2_008_952);
    assert_eq!(size_of::<ProcSlot>(), 1960);
    assert_eq!(HAMI_REGION_SIZE, 2_008_952);
    assert_eq!(offset_of!(RegionFile, ext), EXTENSION_OFFSET);
    assert_eq!(size_of::<Extension>(), EXTENSION_SIZE);
    assert_eq!(REGION_FILE_SIZE, HAMI_REGION_SIZE + EXTENSION_SIZE);
    // The monitor iterates procs at 1856 + 1960 * i; the last slot ends where proc_num starts.
    assert_eq!(
        offset_of!(SharedRegion, procs) + 1024 * 1960,
        offset_of!(SharedRegion, proc_num)
    );
}
