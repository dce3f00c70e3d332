//! `cuda-api.toml`: the single source of truth for which entry points are special.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use serde::Deserialize;

use crate::{Error, Result};

/// What the hook does with a function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// Forwarded to the real function unchanged (the default for anything not in the table).
    Passthrough,
    /// Charges or releases device memory.
    MemoryAccounted,
    /// Gated by the compute limiter.
    LaunchThrottled,
    /// Hand-written behaviour (proc-address lookups, initialisation, memory queries).
    Overridden,
}

impl Class {
    pub fn key(self) -> &'static str {
        match self {
            Class::Passthrough => "passthrough",
            Class::MemoryAccounted => "memory-accounted",
            Class::LaunchThrottled => "launch-throttled",
            Class::Overridden => "overridden",
        }
    }
}

/// One `[[entry]]` of the table.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub class: Class,
    /// Path below the hook crate's root, e.g. `memory::alloc`. Required unless passthrough. Its
    /// parameters bind by name ([`crate::handlers`]).
    #[serde(default)]
    pub handler: Option<String>,
    /// A `fn() -> bool` below the hook crate's root: while it returns true the wrapper calls the
    /// real function directly, skipping the handler (e.g. launches while nothing is limited).
    #[serde(default)]
    pub fast_path: Option<String>,
    /// The wrapper first waits while `vgpu-smi suspend` holds the process (copies, sets,
    /// launches): a prologue the generator writes, before the fast path and the handler.
    #[serde(default)]
    pub suspendable: bool,
    /// Header parameters that some of the functions name differently, by the name the handler
    /// knows them by: `{ hGraph = "hGraphExec" }`.
    #[serde(default)]
    pub aliases: BTreeMap<String, String>,
    /// The functions, by their exact names. Naming one variant of a family (a base name and its
    /// `_vN`, `_ptsz`, `_ptds`) claims the family: every variant the headers declare must then be
    /// in some entry, or the build fails naming it.
    pub functions: Vec<String>,
    /// First CUDA version (as in `CUDA_VERSION`, e.g. 12030) whose headers have these functions.
    #[serde(default)]
    pub since: Option<u32>,
    /// First CUDA version whose headers no longer have them.
    #[serde(default)]
    pub until: Option<u32>,
    /// Why the entry is here, for the reader.
    #[serde(default)]
    pub why: Option<String>,
}

impl Entry {
    /// A short name for error messages.
    pub fn label(&self, index: usize) -> String {
        format!(
            "cuda-api.toml entry #{} ({} {})",
            index + 1,
            self.class.key(),
            self.functions.first().map(String::as_str).unwrap_or("<no functions>")
        )
    }

    /// Whether the header of `version` must declare this entry's functions.
    pub fn applies_to(&self, version: u32) -> bool {
        self.since.is_none_or(|since| version >= since) && self.until.is_none_or(|until| version < until)
    }
}

/// One `[[undeclared]]` group: the driver's or NVML's private entry points, which no header
/// declares, so the hook has no wrapper for them. An application handed one (by `dlsym` or
/// `cuGetProcAddress`) calls the driver directly, as it would without the hook; naming them here
/// says that is known and harmless, so the hook notes it at debug level instead of warning that
/// the library is older than the driver.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Undeclared {
    pub functions: Vec<String>,
    /// Why calling them unhooked is harmless, for the reader.
    pub why: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Table {
    #[serde(rename = "entry")]
    pub entries: Vec<Entry>,
    #[serde(rename = "undeclared", default)]
    pub undeclared: Vec<Undeclared>,
}

impl Table {
    pub fn load(path: &Path) -> Result<Table> {
        let text = std::fs::read_to_string(path).map_err(|e| Error(format!("cannot read {}: {e}", path.display())))?;
        Table::parse(&text).map_err(|Error(message)| Error(format!("{}: {message}", path.display())))
    }

    pub fn parse(text: &str) -> Result<Table> {
        let table: Table = toml::from_str(text).map_err(|e| Error(e.to_string()))?;
        let mut seen = HashSet::new();
        for (index, entry) in table.entries.iter().enumerate() {
            let label = entry.label(index);
            if entry.functions.is_empty() {
                return Err(Error(format!("{label} lists no functions")));
            }
            if let Some(fast_path) = &entry.fast_path
                && (entry.handler.is_none() || !is_handler_path(fast_path))
            {
                return Err(Error(format!(
                    "{label}: fast_path `{fast_path}` needs a handler and a path like module::function"
                )));
            }
            match (entry.class, &entry.handler) {
                (Class::Passthrough, Some(_)) => {
                    return Err(Error(format!("{label}: a passthrough entry takes no handler")));
                }
                (Class::Passthrough, None) if !entry.suspendable && entry.why.is_none() => {
                    return Err(Error(format!(
                        "{label}: a passthrough entry is listed for the reader: say `why`"
                    )));
                }
                (Class::Passthrough, None) => {}
                (_, None) => return Err(Error(format!("{label}: class {} needs a handler", entry.class.key()))),
                (_, Some(handler)) if !is_handler_path(handler) => {
                    return Err(Error(format!(
                        "{label}: handler `{handler}` is not a path like module::function"
                    )));
                }
                _ => {}
            }
            for name in &entry.functions {
                if !seen.insert(name.clone()) {
                    return Err(Error(format!("{label}: {name} is listed in more than one entry")));
                }
            }
        }
        for (index, group) in table.undeclared.iter().enumerate() {
            let label = format!("cuda-api.toml undeclared #{}", index + 1);
            if group.functions.is_empty() || group.why.trim().is_empty() {
                return Err(Error(format!("{label}: list functions and say `why`")));
            }
            for name in &group.functions {
                if !(name.starts_with("cu") || name.starts_with("nvml")) {
                    return Err(Error(format!(
                        "{label}: {name} is not a driver or NVML name (cu*, nvml*)"
                    )));
                }
                if !seen.insert(name.clone()) {
                    return Err(Error(format!("{label}: {name} is listed more than once")));
                }
            }
        }
        Ok(table)
    }

    /// The undeclared names, sorted.
    pub fn undeclared_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .undeclared
            .iter()
            .flat_map(|group| group.functions.iter().map(String::as_str))
            .collect();
        names.sort_unstable();
        names
    }

    /// Every function the table names must be among the functions the headers declare, unless
    /// the entry says the header version lies outside the versions it applies to.
    pub fn check_all_declared(&self, found: &HashSet<&str>, version: u32) -> Result<()> {
        if let Some(name) = self.undeclared_names().into_iter().find(|name| found.contains(name)) {
            return Err(Error(format!(
                "cuda-api.toml: {name} is listed as undeclared, but the CUDA {} headers declare it: classify it in an [[entry]] (or leave it to passthrough)",
                format_version(version)
            )));
        }
        for (index, entry) in self.entries.iter().enumerate() {
            for name in &entry.functions {
                if !found.contains(name.as_str()) && entry.applies_to(version) {
                    return Err(Error(format!(
                        "{}: {name} is not declared in the CUDA {} headers (add `since`/`until` if it belongs to other versions)",
                        entry.label(index),
                        format_version(version)
                    )));
                }
            }
        }
        Ok(())
    }

    /// The entry that names `function`, with its index.
    pub fn entry_for(&self, function: &str) -> Option<(usize, &Entry)> {
        self.entries
            .iter()
            .enumerate()
            .find(|(_, entry)| entry.functions.iter().any(|name| name == function))
    }
}

fn is_handler_path(handler: &str) -> bool {
    let parts: Vec<&str> = handler.split("::").collect();
    parts.len() >= 2
        && parts.iter().all(|part| {
            part.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

/// `13000` as `13.0`.
pub fn format_version(version: u32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_missing_handler() {
        let err = Table::parse("[[entry]]\nclass = \"memory-accounted\"\nfunctions = [\"cuMemAlloc_v2\"]\n")
            .err()
            .map(|e| e.0);
        assert_eq!(
            err.as_deref(),
            Some("cuda-api.toml entry #1 (memory-accounted cuMemAlloc_v2): class memory-accounted needs a handler")
        );
    }

    #[test]
    fn undeclared_names_must_be_driver_names_that_no_header_declares() {
        let entry = "[[entry]]\nclass = \"passthrough\"\nfunctions = [\"cuInit\"]\nwhy = \"w\"\n";
        let group = |names: &str| format!("{entry}[[undeclared]]\nfunctions = [{names}]\nwhy = \"private\"\n");
        let table = Table::parse(&group("\"nvmlZ\", \"nvmlA\"")).expect("valid");
        assert_eq!(table.undeclared_names(), ["nvmlA", "nvmlZ"]);
        let err = |text: &str| Table::parse(text).err().map(|e| e.0).unwrap_or_default();
        assert!(err(&group("\"ncclCommInitRank\"")).contains("not a driver or NVML name"));
        assert!(err(&group("\"cuInit\"")).contains("listed more than once"));
        assert!(
            err(&format!(
                "{entry}[[undeclared]]\nfunctions = [\"nvmlA\"]\nwhy = \" \"\n"
            ))
            .contains("say `why`")
        );
        let declared: HashSet<&str> = ["cuInit", "nvmlA"].into_iter().collect();
        let message = table
            .check_all_declared(&declared, 13050)
            .err()
            .map(|e| e.0)
            .unwrap_or_default();
        assert!(
            message.contains("nvmlA is listed as undeclared, but the CUDA 13.5 headers declare it"),
            "{message}"
        );
    }

    #[test]
    fn rejects_duplicate_function() {
        let text = "[[entry]]\nclass = \"overridden\"\nhandler = \"a::b\"\nfunctions = [\"cuInit\"]\n\
                    [[entry]]\nclass = \"overridden\"\nhandler = \"a::c\"\nfunctions = [\"cuInit\"]\n";
        let err = Table::parse(text).err().map(|e| e.0).unwrap_or_default();
        assert!(
            err.contains("entry #2") && err.contains("cuInit is listed in more than one entry"),
            "{err}"
        );
    }

    #[test]
    fn rejects_bad_handler_path_and_unknown_keys() {
        let bad_path = "[[entry]]\nclass = \"overridden\"\nhandler = \"no_module\"\nfunctions = [\"cuInit\"]\n";
        assert!(Table::parse(bad_path).is_err());
        let unknown = "[[entry]]\nclass = \"overridden\"\nhandler = \"a::b\"\nfunctions = [\"cuInit\"]\nextra = 1\n";
        assert!(Table::parse(unknown).is_err());
    }

    #[test]
    fn fast_path_needs_a_handler() {
        let without_handler =
            "[[entry]]\nclass = \"passthrough\"\nfast_path = \"a::b\"\nwhy = \"x\"\nfunctions = [\"cuInit\"]\n";
        assert!(Table::parse(without_handler).is_err());
        let with_handler =
            "[[entry]]\nclass = \"overridden\"\nhandler = \"a::b\"\nfast_path = \"a::c\"\nfunctions = [\"cuInit\"]\n";
        assert_eq!(
            Table::parse(with_handler)
                .map(|t| t.entries[0].fast_path.clone())
                .ok()
                .flatten()
                .as_deref(),
            Some("a::c")
        );
    }

    #[test]
    fn a_listed_passthrough_says_why_or_is_suspendable() {
        let bare = "[[entry]]\nclass = \"passthrough\"\nfunctions = [\"cuMemcpy\"]\n";
        let error = Table::parse(bare).err().map(|e| e.0).unwrap_or_default();
        assert!(error.contains("listed for the reader: say `why`"), "{error}");
        let suspendable = "[[entry]]\nclass = \"passthrough\"\nsuspendable = true\nfunctions = [\"cuMemcpy\"]\n";
        assert!(Table::parse(suspendable).is_ok_and(|t| t.entries[0].suspendable));
    }

    #[test]
    fn version_ranges() {
        let entry = Entry {
            class: Class::Passthrough,
            handler: None,
            fast_path: None,
            suspendable: false,
            aliases: BTreeMap::new(),
            functions: vec!["x".into()],
            since: Some(12030),
            until: Some(13000),
            why: None,
        };
        assert!(!entry.applies_to(12020));
        assert!(entry.applies_to(12030));
        assert!(entry.applies_to(12090));
        assert!(!entry.applies_to(13000));
        assert_eq!(format_version(12090), "12.9");
    }
}
