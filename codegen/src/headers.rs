//! Where the CUDA and NVML headers come from, and which versions the project supports.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// `cuda-versions.txt` at the workspace root: the one list of supported header versions (the
/// first is the default build), also read by `scripts/fetch-headers.sh` and CI.
const VERSIONS_FILE: &str = include_str!("../../cuda-versions.txt");

/// Every supported header version, the default first: snapshot-tested and built in CI.
pub fn versions() -> Vec<&'static str> {
    VERSIONS_FILE
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_whitespace().next())
        .collect()
}

/// The header version the project builds against by default: the first of [`versions`].
pub fn default_version() -> &'static str {
    versions().first().copied().unwrap_or("unknown")
}

/// The folder that `scripts/fetch-headers.sh` fills, relative to the workspace root.
pub fn fetched_include_dir(workspace_root: &Path, version: &str) -> PathBuf {
    workspace_root.join(".cuda-headers").join(version).join("include")
}

/// The include folder to build against: `CUDA_INCLUDE_DIR`, then `$CUDA_HOME/include`, then the
/// copy of the default version the setup step fetched. Each must hold both `cuda.h` and `nvml.h`.
pub fn locate(workspace_root: &Path) -> Result<PathBuf> {
    let mut tried = Vec::new();
    let candidates = [
        std::env::var_os("CUDA_INCLUDE_DIR").map(PathBuf::from),
        std::env::var_os("CUDA_HOME").map(|home| PathBuf::from(home).join("include")),
        Some(fetched_include_dir(workspace_root, default_version())),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_come_from_the_list_default_first() {
        let versions = versions();
        assert!(versions.len() >= 2, "{versions:?}");
        assert_eq!(default_version(), versions[0]);
        for version in versions {
            let (major, minor) = version.split_once('.').unwrap_or_default();
            assert!(
                major.parse::<u32>().is_ok() && minor.parse::<u32>().is_ok(),
                "{version} is not MAJOR.MINOR"
            );
        }
    }
}
