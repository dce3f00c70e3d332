//! Reads the headers once, on the build host, and writes what the foundation tests compare the
//! built library against (`$OUT_DIR/declared.txt`, tab-separated): every entry point the hook
//! must export, and every base name with versioned variants. bindgen runs here rather than in the
//! tests because a test emulated for another architecture (scripts/cross-test.sh) cannot load the
//! host's libclang.

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let root = vgpu_codegen::headers::workspace_root(&manifest_dir);
    let table = root.join("cuda-api.toml");
    println!("cargo:rerun-if-changed={}", table.display());
    for variable in ["CUDA_INCLUDE_DIR", "CUDA_HOME", vgpu_codegen::libclang::VARIABLE] {
        println!("cargo:rerun-if-env-changed={variable}");
    }
    let include_dir = vgpu_codegen::headers::locate(&root).unwrap_or_else(|e| fail(&e.to_string()));
    for header in ["cuda.h", "nvml.h", "cudaTypedefs.h", "cudaGL.h"] {
        println!("cargo:rerun-if-changed={}", include_dir.join(header).display());
    }
    // The handlers' signatures bind the functions' arguments by name.
    let handlers_src = root.join("hook").join("src");
    println!("cargo:rerun-if-changed={}", handlers_src.display());
    let generated =
        vgpu_codegen::generate(&include_dir, &table, &handlers_src).unwrap_or_else(|e| fail(&e.to_string()));
    let mut text = format!("cuda_version\t{}\n", generated.cuda_version);
    for routed in &generated.routed {
        let _ = writeln!(
            text,
            "function\t{}\t{}\t{}",
            routed.library.key(),
            routed.prototype.header,
            routed.prototype.name
        );
    }
    for set in &generated.variants {
        let _ = writeln!(text, "variant\t{}", set.base);
    }
    if let Err(e) = std::fs::write(out_dir.join("declared.txt"), text) {
        fail(&format!("cannot write declared.txt: {e}"));
    }
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1);
}
