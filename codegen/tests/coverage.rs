//! The coverage listing of every supported header version is a reviewed snapshot: a CUDA upgrade
//! shows up as a diff of `snapshots/coverage_<version>.snap`.

use std::path::PathBuf;

use vgpu_codegen::headers;

fn root() -> PathBuf {
    headers::workspace_root(&PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

#[test]
fn coverage_listing_per_header_version() {
    let root = root();
    for version in headers::versions() {
        let include_dir = headers::fetched_include_dir(&root, version);
        assert!(
            include_dir.join("cuda.h").is_file(),
            "CUDA {version} headers missing in {}: run scripts/fetch-headers.sh",
            include_dir.display()
        );
        let generated = vgpu_codegen::generate(&include_dir, &root.join("cuda-api.toml"))
            .unwrap_or_else(|e| panic!("CUDA {version}: {e}"));
        insta::with_settings!({snapshot_path => root.join("snapshots"), prepend_module_to_snapshot => false}, {
            insta::assert_snapshot!(format!("coverage_{}", version.replace('.', "_")), generated.coverage);
        });
    }
}

#[test]
fn every_special_entry_has_its_class_in_every_version() {
    let root = root();
    for version in headers::versions() {
        let generated = vgpu_codegen::generate(
            &headers::fetched_include_dir(&root, version),
            &root.join("cuda-api.toml"),
        )
        .unwrap_or_else(|e| panic!("CUDA {version}: {e}"));
        let class_of = |name: &str| {
            generated
                .routed
                .iter()
                .find(|f| f.prototype.name == name)
                .map(|f| f.class.key())
                .unwrap_or("absent")
        };
        assert_eq!(class_of("cuMemAlloc_v2"), "memory-accounted");
        assert_eq!(class_of("cuLaunchKernel_ptsz"), "launch-throttled");
        assert_eq!(class_of("cuGetProcAddress_v2"), "overridden");
        assert_eq!(class_of("cuDeviceGetCount"), "passthrough");
        assert_eq!(class_of("nvmlDeviceGetMemoryInfo_v2"), "overridden");
    }
}

#[test]
fn table_errors_name_the_entry_and_the_header() {
    let root = root();
    let include_dir = headers::fetched_include_dir(&root, headers::default_version());
    let scratch = std::env::temp_dir().join(format!("vgpu-codegen-test-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch folder");
    let cases = [
        (
            "[[entry]]\nclass = \"memory-accounted\"\nhandler = \"memory::alloc\"\nargs = [\"dptr\", \"nbytes\"]\nfunctions = [\"cuMemAlloc_v2\"]\n",
            "cuda-api.toml entry #1 (memory-accounted cuMemAlloc_v2): cuMemAlloc_v2 in cuda.h has no parameter `nbytes` (it has: dptr, bytesize)",
        ),
        (
            "[[entry]]\nclass = \"overridden\"\nhandler = \"x::y\"\nfunctions = [\"cuMemAllocTheFuture\"]\n",
            "cuda-api.toml entry #1 (overridden cuMemAllocTheFuture): cuMemAllocTheFuture is not declared in the CUDA {default} headers",
        ),
    ];
    let default = headers::default_version();
    for (table, expected) in cases {
        let path = scratch.join("cuda-api.toml");
        std::fs::write(&path, table).expect("write table");
        let error = vgpu_codegen::generate(&include_dir, &path)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        let expected = expected.replace("{default}", default);
        assert!(error.contains(&expected), "got: {error}");
    }
    // A version range that excludes the header makes an absent name acceptable.
    let path = scratch.join("cuda-api.toml");
    std::fs::write(
        &path,
        "[[entry]]\nclass = \"overridden\"\nhandler = \"x::y\"\nfunctions = [\"cuMemAllocTheFuture\"]\nsince = 14000\n",
    )
    .expect("write table");
    assert!(vgpu_codegen::generate(&include_dir, &path).is_ok());
    let _ = std::fs::remove_dir_all(&scratch);
}
