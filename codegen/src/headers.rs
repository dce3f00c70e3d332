//! Where the CUDA and NVML headers come from.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The header version the project builds against by default.
pub const DEFAULT_VERSION: &str = "13.0";

/// Every header version the snapshots cover.
pub const SNAPSHOT_VERSIONS: [&str; 2] = ["12.9", "13.0"];

/// The folder that `scripts/fetch-headers.sh` fills, relative to the workspace root.
pub fn fetched_include_dir(workspace_root: &Path, version: &str) -> PathBuf {
    workspace_root.join(".cuda-headers").join(version).join("include")
}

/// The include folder to build against: `CUDA_INCLUDE_DIR`, then `$CUDA_HOME/include`, then the
/// copy the setup step fetched. Each must hold both `cuda.h` and `nvml.h`.
pub fn locate(workspace_root: &Path) -> Result<PathBuf> {
    let mut tried = Vec::new();
    let candidates = [
        std::env::var_os("CUDA_INCLUDE_DIR").map(PathBuf::from),
        std::env::var_os("CUDA_HOME").map(|home| PathBuf::from(home).join("include")),
        Some(fetched_include_dir(workspace_root, DEFAULT_VERSION)),
    ];
    for dir in candidates.into_iter().flatten() {
        if dir.join("cuda.h").is_file() && dir.join("nvml.h").is_file() {
            return Ok(dir);
        }
        tried.push(dir.display().to_string());
    }
    Err(Error(format!(
        "no CUDA headers found (looked in {}); run scripts/fetch-headers.sh or set CUDA_INCLUDE_DIR",
        tried.join(", ")
    )))
}

/// The workspace root, found from a crate's manifest folder.
pub fn workspace_root(manifest_dir: &Path) -> PathBuf {
    manifest_dir
        .ancestors()
        .find(|dir| dir.join("cuda-api.toml").is_file())
        .unwrap_or(manifest_dir)
        .to_path_buf()
}
