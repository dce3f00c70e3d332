//! The coverage listing of every supported header version is a reviewed snapshot: a CUDA upgrade
//! shows up as a diff of `snapshots/coverage_<version>.snap`. And the build refuses what a release
//! could slip past the table: an unclassified variant of a claimed family, a handler parameter
//! that binds to nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use vgpu_codegen::{Generated, Headers, headers};

fn root() -> PathBuf {
    headers::workspace_root(&PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn hook_src() -> PathBuf {
    root().join("hook").join("src")
}

/// Each supported version's headers, read once per test process (bindgen is the slow part), and
/// their generation with the project's table and handlers.
fn read(version: &str) -> &'static (Headers, Generated) {
    static ALL: OnceLock<BTreeMap<&'static str, (Headers, Generated)>> = OnceLock::new();
    let all = ALL.get_or_init(|| {
        let root = root();
        let handles: Vec<_> = headers::versions()
            .into_iter()
            .map(|version| {
                let include_dir = headers::fetched_include_dir(&root, version);
                let (table, src) = (root.join("cuda-api.toml"), hook_src());
                std::thread::spawn(move || {
                    assert!(
                        include_dir.join("cuda.h").is_file(),
                        "CUDA {version} headers missing in {}: run scripts/fetch-headers.sh",
                        include_dir.display()
                    );
                    let read =
                        vgpu_codegen::read_headers(&include_dir).unwrap_or_else(|e| panic!("CUDA {version}: {e}"));
                    let generated = vgpu_codegen::generate_from(&read, &table, &src)
                        .unwrap_or_else(|e| panic!("CUDA {version}: {e}"));
                    (version, (read, generated))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap_or_else(|_| panic!("generation failed")))
            .collect()
    });
    &all[version]
}

fn generated(version: &str) -> &'static Generated {
    &read(version).1
}

#[test]
fn coverage_listing_per_header_version() {
    let root = root();
    for version in headers::versions() {
        insta::with_settings!({snapshot_path => root.join("snapshots"), prepend_module_to_snapshot => false}, {
            insta::assert_snapshot!(format!("coverage_{}", version.replace('.', "_")), generated(version).coverage);
        });
    }
}

#[test]
fn every_special_entry_has_its_class_in_every_version() {
    for version in headers::versions() {
        let generated = generated(version);
        let routed = |name: &str| generated.routed.iter().find(|f| f.prototype.name == name);
        let class_of = |name: &str| routed(name).map(|f| f.class.key()).unwrap_or("absent");
        assert_eq!(class_of("cuMemAlloc_v2"), "memory-accounted");
        assert_eq!(class_of("cuLaunchKernel_ptsz"), "launch-throttled");
        assert_eq!(class_of("cuGetProcAddress_v2"), "overridden");
        assert_eq!(class_of("cuDeviceGetCount"), "passthrough");
        assert_eq!(class_of("nvmlDeviceGetMemoryInfo_v2"), "overridden");
        // Copies are passthrough with the generated suspend prologue; launches have it too.
        assert_eq!(class_of("cuMemcpyHtoD_v2"), "passthrough");
        assert!(routed("cuMemcpyHtoD_v2").is_some_and(|f| f.suspendable));
        assert!(routed("cuLaunchKernel").is_some_and(|f| f.suspendable));
        assert!(routed("cuMemAlloc_v2").is_some_and(|f| !f.suspendable));
    }
}

/// A copy of the default headers, with `extra` appended to cuda.h.
fn headers_with(scratch: &Path, extra: &str) -> PathBuf {
    let from = headers::fetched_include_dir(&root(), headers::default_version());
    let include = scratch.join("include");
    std::fs::create_dir_all(&include).expect("scratch include folder");
    for entry in std::fs::read_dir(&from).expect("headers") {
        let path = entry.expect("header").path();
        if let Some(name) = path.file_name() {
            std::fs::copy(&path, include.join(name)).expect("copy a header");
        }
    }
    let mut cuda = std::fs::read_to_string(include.join("cuda.h")).expect("read cuda.h");
    cuda.push_str(extra);
    std::fs::write(include.join("cuda.h"), cuda).expect("write cuda.h");
    include
}

#[test]
fn a_new_variant_of_a_claimed_family_fails_the_build_naming_it() {
    let scratch = std::env::temp_dir().join(format!("vgpu-codegen-v9-{}", std::process::id()));
    let include = headers_with(
        &scratch,
        "\nCUresult CUDAAPI cuMemAlloc_v9(CUdeviceptr *dptr, size_t bytesize);\n",
    );
    // The generator binary, as the build script runs it: one line naming the function.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_vgpu-codegen"))
        .arg(&include)
        .output()
        .expect("run vgpu-codegen");
    let _ = std::fs::remove_dir_all(&scratch);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "an unclassified cuMemAlloc_v9 was accepted");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cuda.h declares cuMemAlloc_v9, a variant of the family cuMemAlloc")
            && stderr.contains("no cuda-api.toml entry classifies it"),
        "{stderr}"
    );
}

#[test]
fn table_errors_name_the_entry_and_the_header() {
    let read = &read(headers::default_version()).0;
    let scratch = std::env::temp_dir().join(format!("vgpu-codegen-test-{}", std::process::id()));
    let src = scratch.join("src");
    std::fs::create_dir_all(&src).expect("scratch folder");
    // A handler whose second parameter is not cuMemAlloc_v2's.
    std::fs::write(
        src.join("memory.rs"),
        "pub fn alloc(call: impl FnOnce() -> u32, dptr: *mut u64, nbytes: usize) -> u32 { call() }\n",
    )
    .expect("write handler");
    let default = headers::default_version();
    let cases = [
        (
            "[[entry]]\nclass = \"memory-accounted\"\nhandler = \"memory::alloc\"\nfunctions = [\"cuMemAlloc\", \"cuMemAlloc_v2\"]\n",
            "cuda-api.toml entry #1 (memory-accounted cuMemAlloc): memory::alloc's parameter `nbytes` is no parameter of cuMemAlloc in cuda.h (it has: dptr, bytesize"
                .to_string(),
        ),
        (
            "[[entry]]\nclass = \"overridden\"\nhandler = \"memory::alloc\"\nfunctions = [\"cuMemAllocTheFuture\"]\n",
            format!(
                "cuda-api.toml entry #1 (overridden cuMemAllocTheFuture): cuMemAllocTheFuture is not declared in the CUDA {default} headers"
            ),
        ),
        (
            "[[entry]]\nclass = \"overridden\"\nhandler = \"memory::free\"\nfunctions = [\"cuMemFree\", \"cuMemFree_v2\"]\n",
            "cuda-api.toml entry #1 (overridden cuMemFree): handler memory::free is no public function of the hook"
                .to_string(),
        ),
    ];
    for (table, expected) in cases {
        let path = scratch.join("cuda-api.toml");
        std::fs::write(&path, table).expect("write table");
        let error = vgpu_codegen::generate_from(read, &path, &src)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains(&expected), "got: {error}");
    }
    // A version range that excludes the header makes an absent name acceptable.
    let path = scratch.join("cuda-api.toml");
    std::fs::write(
        &path,
        "[[entry]]\nclass = \"overridden\"\nhandler = \"memory::alloc\"\nfunctions = [\"cuMemAllocTheFuture\"]\nsince = 14000\n",
    )
    .expect("write table");
    assert!(vgpu_codegen::generate_from(read, &path, &src).is_ok());
    let _ = std::fs::remove_dir_all(&scratch);
}
