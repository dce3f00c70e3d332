//! Generates the hook from the CUDA and NVML headers, `cuda-api.toml` and the handlers'
//! signatures in `src/`.

use std::path::PathBuf;

fn main() {
    // Test-only fault injection (VGPU_FAULT_PANIC, VGPU_FAULT_LOCK_TIMEOUT_FILE) is compiled into
    // builds with debug assertions, which the tests use, and never into a release build: one
    // build serves the tests that inject faults and those that do not.
    println!("cargo:rustc-check-cfg=cfg(fault_injection)");
    if std::env::var_os("CARGO_CFG_DEBUG_ASSERTIONS").is_some() {
        println!("cargo:rustc-cfg=fault_injection");
    }
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let root = vgpu_codegen::headers::workspace_root(&manifest_dir);
    let table = root.join("cuda-api.toml");
    println!("cargo:rerun-if-changed={}", table.display());
    println!("cargo:rerun-if-env-changed=CUDA_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed={}", vgpu_codegen::libclang::VARIABLE);
    let include_dir = match vgpu_codegen::headers::locate(&root) {
        Ok(dir) => dir,
        Err(e) => fail(&e.to_string()),
    };
    for header in ["cuda.h", "nvml.h", "cudaTypedefs.h"] {
        println!("cargo:rerun-if-changed={}", include_dir.join(header).display());
    }
    // The handlers' signatures bind the functions' arguments by name.
    let handlers_src = manifest_dir.join("src");
    println!("cargo:rerun-if-changed={}", handlers_src.display());
    let generated = match vgpu_codegen::generate(&include_dir, &table, &handlers_src) {
        Ok(generated) => generated,
        Err(e) => fail(&e.to_string()),
    };
    // Says which libclang generated the code (cargo shows build-script warnings of workspace crates).
    println!("cargo:warning=generated with libclang {}", generated.libclang);
    if let Some(library) = &generated.libclang.path {
        println!("cargo:rerun-if-changed={}", library.display());
    }
    let files = [
        ("cuda_types.rs", generated.cuda_types.as_str()),
        ("nvml_types.rs", generated.nvml_types.as_str()),
        ("hooks.rs", generated.hooks_input.as_str()),
        ("undeclared.rs", generated.undeclared.as_str()),
    ];
    for (name, text) in files {
        if let Err(e) = std::fs::write(out_dir.join(name), text) {
            fail(&format!("cannot write {name}: {e}"));
        }
    }
    println!("cargo:rustc-env=VGPU_CUDA_HEADER_VERSION={}", generated.cuda_version);
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1);
}
