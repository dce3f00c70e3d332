//! Which variant of an entry point each CUDA version gets.
//!
//! `cudaTypedefs.h` declares one `PFN_<base>_v<version>[_ptds|_ptsz]` typedef per variant, where
//! the version is the CUDA release that introduced it. Sorted by version, the typedefs of a base
//! name line up with its variants sorted by suffix (`cuCtxCreate`, `_v2`, `_v3`, `_v4`), which is
//! how the driver's own `cuGetProcAddress` table is organised. The fake driver uses this to answer
//! as the real one does; the hook never needs it (it maps the driver's answer by address).

use std::collections::BTreeMap;
use std::path::Path;

use crate::prototypes::Prototype;
use crate::{Error, Result};

/// The variants of one base name, each with the CUDA version that introduced it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VariantSet {
    pub base: String,
    /// Default-stream variants, ascending by version.
    pub legacy_stream: Vec<(u32, String)>,
    /// Per-thread-default-stream variants (`_ptds`, `_ptsz`), ascending by version.
    pub per_thread: Vec<(u32, String)>,
}

/// Splits `cuMemcpyHtoD_v2_ptds` into (`cuMemcpyHtoD`, 2, true).
pub fn split_name(name: &str) -> (&str, u32, bool) {
    let (rest, per_thread) = match name.strip_suffix("_ptds").or_else(|| name.strip_suffix("_ptsz")) {
        Some(rest) => (rest, true),
        None => (name, false),
    };
    if let Some(position) = rest.rfind("_v") {
        let digits = &rest[position + 2..];
        if !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && let Ok(number) = digits.parse()
        {
            return (&rest[..position], number, per_thread);
        }
    }
    (rest, 1, per_thread)
}

/// Reads `cudaTypedefs.h` next to `cuda.h` and pairs its versions with the header's functions.
pub fn read(include_dir: &Path, functions: &[Prototype]) -> Result<Vec<VariantSet>> {
    let path = include_dir.join("cudaTypedefs.h");
    let text = std::fs::read_to_string(&path).map_err(|e| Error(format!("cannot read {}: {e}", path.display())))?;
    // base -> (per_thread -> versions)
    let mut versions: BTreeMap<String, [Vec<u32>; 2]> = BTreeMap::new();
    for token in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        let Some(pfn) = token.strip_prefix("PFN_") else {
            continue;
        };
        let (rest, per_thread) = match pfn.strip_suffix("_ptds").or_else(|| pfn.strip_suffix("_ptsz")) {
            Some(rest) => (rest, 1),
            None => (pfn, 0),
        };
        let Some(position) = rest.rfind("_v") else { continue };
        let Ok(version) = rest[position + 2..].parse::<u32>() else {
            continue;
        };
        let list = &mut versions.entry(rest[..position].to_string()).or_default()[per_thread];
        if !list.contains(&version) {
            list.push(version);
        }
    }
    // base -> (per_thread -> (suffix number, name))
    let mut names: BTreeMap<String, [Vec<(u32, String)>; 2]> = BTreeMap::new();
    for function in functions {
        let (base, number, per_thread) = split_name(&function.name);
        names.entry(base.to_string()).or_default()[usize::from(per_thread)].push((number, function.name.clone()));
    }
    let mut sets = Vec::new();
    for (base, mut by_stream) in names {
        let known = versions.get(&base).cloned().unwrap_or_default();
        let mut pair = |index: usize| -> Vec<(u32, String)> {
            let list = &mut by_stream[index];
            list.sort();
            let mut introduced = known[index].clone();
            introduced.sort_unstable();
            // Pair from the newest down: a header may lack typedefs of the oldest variants, which
            // then count as always available.
            let (n, m) = (list.len(), introduced.len());
            list.iter()
                .enumerate()
                .map(|(i, (_, name))| {
                    let from_newest = n - 1 - i;
                    let version = if from_newest < m {
                        introduced[m - 1 - from_newest]
                    } else {
                        0
                    };
                    (version, name.clone())
                })
                .collect()
        };
        let legacy_stream = pair(0);
        let per_thread = pair(1);
        sets.push(VariantSet {
            base,
            legacy_stream,
            per_thread,
        });
    }
    Ok(sets)
}

impl VariantSet {
    /// The variant `cuGetProcAddress(base, version, flags)` returns, as the driver chooses it.
    pub fn select(&self, version: u32, per_thread: bool) -> Option<&str> {
        fn newest_at(list: &[(u32, String)], version: u32) -> Option<&str> {
            list.iter()
                .filter(|(introduced, _)| *introduced <= version)
                .map(|(_, name)| name.as_str())
                .next_back()
        }
        if per_thread && let Some(name) = newest_at(&self.per_thread, version) {
            return Some(name);
        }
        newest_at(&self.legacy_stream, version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_names() {
        assert_eq!(split_name("cuMemcpyHtoD_v2_ptds"), ("cuMemcpyHtoD", 2, true));
        assert_eq!(split_name("cuLaunchKernel_ptsz"), ("cuLaunchKernel", 1, true));
        assert_eq!(split_name("cuCtxCreate_v4"), ("cuCtxCreate", 4, false));
        assert_eq!(split_name("cuInit"), ("cuInit", 1, false));
        assert_eq!(split_name("cuMemAlloc_vX"), ("cuMemAlloc_vX", 1, false));
    }

    #[test]
    fn selects_newest_introduced_variant() {
        let set = VariantSet {
            base: "cuMemcpyHtoD".into(),
            legacy_stream: vec![(2000, "cuMemcpyHtoD".into()), (3020, "cuMemcpyHtoD_v2".into())],
            per_thread: vec![(7000, "cuMemcpyHtoD_v2_ptds".into())],
        };
        assert_eq!(set.select(2000, false), Some("cuMemcpyHtoD"));
        assert_eq!(set.select(12000, false), Some("cuMemcpyHtoD_v2"));
        assert_eq!(set.select(12000, true), Some("cuMemcpyHtoD_v2_ptds"));
        assert_eq!(set.select(6000, true), Some("cuMemcpyHtoD_v2"));
        assert_eq!(set.select(1000, false), None);
    }
}
