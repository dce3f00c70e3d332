//! `vgpu-codegen`: prints the coverage listing (or the macro input) for a header folder, so a
//! maintainer can look at what a new CUDA release changes before building.
//!
//! Usage: `vgpu-codegen [--macro-input] [INCLUDE_DIR]`

use std::path::PathBuf;
use std::process::ExitCode;

use vgpu_codegen::headers;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let macro_input = args.iter().any(|a| a == "--macro-input");
    args.retain(|a| a != "--macro-input");
    let root = headers::workspace_root(&PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    let include_dir = match args.first() {
        Some(dir) => PathBuf::from(dir),
        None => match headers::locate(&root) {
            Ok(dir) => dir,
            Err(e) => {
                eprintln!("vgpu-codegen: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    match vgpu_codegen::generate(
        &include_dir,
        &root.join("cuda-api.toml"),
        &root.join("hook").join("src"),
    ) {
        Ok(generated) => {
            print!(
                "{}",
                if macro_input {
                    &generated.hooks_input
                } else {
                    &generated.coverage
                }
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vgpu-codegen: {e}");
            ExitCode::FAILURE
        }
    }
}
