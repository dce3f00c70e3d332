//! Which libclang bindgen runs, and the builtin headers it needs.
//!
//! clang-sys loads libclang from the folder in `LIBCLANG_PATH` and from nowhere else when that is
//! set. The workspace's `.cargo/config.toml` sets it to `.cuda-headers/libclang`, which
//! `scripts/fetch-headers.sh` fills from the pinned PyPI wheels, so every machine generates the
//! same code with the same clang whether or not it has a libclang of its own. The wheel's library
//! does not find clang's builtin headers (`stddef.h`, `stdint.h`) by itself, so the resource
//! folder beside it (`clang/<major>`, LLVM's own layout) is passed to clang explicitly.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The variable clang-sys reads.
pub const VARIABLE: &str = "LIBCLANG_PATH";

/// The libclang the generator is configured to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Libclang {
    /// The folder holding `libclang.so`.
    pub folder: PathBuf,
    /// clang's resource folder (`<folder>/clang/<major>`, holding `include/stddef.h`), when there is
    /// one beside the library.
    pub resource_dir: Option<PathBuf>,
}

/// The libclang `LIBCLANG_PATH` names; an error when it is unset or holds no libclang, which
/// clang-sys would otherwise answer with a panic or with a system library.
pub fn configured() -> Result<Libclang> {
    let Some(value) = std::env::var_os(VARIABLE).filter(|value| !value.is_empty()) else {
        return Err(Error(format!(
            "{VARIABLE} is not set: cargo sets it from the workspace's .cargo/config.toml to \
             .cuda-headers/libclang (run cargo inside the workspace), or set it to a folder holding libclang.so"
        )));
    };
    let path = PathBuf::from(value);
    // clang-sys accepts the library file itself as well as its folder.
    let folder = if path.is_file() {
        path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    } else {
        path.clone()
    };
    if !holds_libclang(&folder) {
        return Err(Error(format!(
            "no libclang.so in {} ({VARIABLE}): run scripts/fetch-headers.sh (make headers), which fetches it there",
            path.display()
        )));
    }
    let resource_dir = resource_dir_in(&folder);
    Ok(Libclang { folder, resource_dir })
}

fn holds_libclang(folder: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return false;
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        (name.starts_with("libclang.so") || name.starts_with("libclang-")) && name.contains(".so")
    })
}

/// The newest `clang/<major>` under `folder` that holds clang's `stddef.h`.
fn resource_dir_in(folder: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(folder.join("clang")).ok()?;
    entries
        .flatten()
        .filter(|entry| entry.path().join("include").join("stddef.h").is_file())
        .filter_map(|entry| {
            let major = entry
                .file_name()
                .to_string_lossy()
                .split('.')
                .next()?
                .parse::<u32>()
                .ok()?;
            Some((major, entry.path()))
        })
        .max()
        .map(|(_, path)| path)
}

/// The libclang bindgen loaded.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The library file, when clang-sys says.
    pub path: Option<PathBuf>,
    /// `clang version 18.1.1`.
    pub version: String,
}

impl std::fmt::Display for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.path {
            Some(path) => write!(f, "{} ({})", path.display(), self.version),
            None => f.write_str(&self.version),
        }
    }
}

/// The library bindgen loaded on this thread. Call it after generating, so it names what was used.
pub fn loaded() -> Loaded {
    Loaded {
        version: bindgen::clang_version().full,
        path: clang_sys::get_library().map(|library| library.path().to_path_buf()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_newest_resource_folder_with_builtin_headers() {
        let root = std::env::temp_dir().join(format!("vgpu-codegen-libclang-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (major, with_header) in [("17", true), ("18", true), ("19", false)] {
            let include = root.join("clang").join(major).join("include");
            std::fs::create_dir_all(&include).unwrap();
            if with_header {
                std::fs::write(include.join("stddef.h"), "").unwrap();
            }
        }
        std::fs::write(root.join("libclang.so"), "").unwrap();
        assert!(holds_libclang(&root));
        assert_eq!(resource_dir_in(&root), Some(root.join("clang").join("18")));
        assert!(!holds_libclang(&root.join("clang")));
        assert_eq!(resource_dir_in(&root.join("clang")), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
