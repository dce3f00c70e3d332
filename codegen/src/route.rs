//! Joins a header's prototypes with the table: every function gets a class, and special ones a
//! handler with the arguments it asked for.

use crate::prototypes::{Header, Prototype};
use crate::table::{Class, Table};
use crate::{Error, Library, Result};

/// The argument an entry may ask for that is not a parameter: whether the function is a
/// per-thread-default-stream variant (`_ptsz`, `_ptds`), for which a null stream means the
/// calling thread's stream. The generator knows it from the name and passes `true` or `false`.
pub const PER_THREAD_ARG: &str = "per_thread";

/// One function of a header with what the hook does with it.
#[derive(Clone, Debug)]
pub struct Routed {
    pub library: Library,
    pub prototype: Prototype,
    pub class: Class,
    pub handler: Option<String>,
    pub args: Vec<String>,
    pub fast_path: Option<String>,
}

/// Routes every function of `header`; functions the table does not name are passthrough.
pub fn join(header: &Header, table: &Table, library: Library, version: u32) -> Result<Vec<Routed>> {
    let mut routed = Vec::with_capacity(header.functions.len());
    for prototype in &header.functions {
        let Some((index, entry)) = table.entry_for(&prototype.name) else {
            routed.push(Routed {
                library,
                prototype: prototype.clone(),
                class: Class::Passthrough,
                handler: None,
                args: vec![],
                fast_path: None,
            });
            continue;
        };
        let label = entry.label(index);
        if !entry.applies_to(version) {
            return Err(Error(format!(
                "{label}: {} is declared in {} although the entry excludes CUDA {}",
                prototype.name,
                library.header(),
                crate::table::format_version(version)
            )));
        }
        for arg in &entry.args {
            if arg == PER_THREAD_ARG {
                continue;
            }
            if !prototype.params.iter().any(|param| &param.name == arg) {
                let names: Vec<&str> = prototype.params.iter().map(|p| p.name.as_str()).collect();
                return Err(Error(format!(
                    "{label}: {} in {} has no parameter `{arg}` (it has: {})",
                    prototype.name,
                    library.header(),
                    names.join(", ")
                )));
            }
        }
        routed.push(Routed {
            library,
            prototype: prototype.clone(),
            class: entry.class,
            handler: entry.handler.clone(),
            args: entry
                .args
                .iter()
                .map(|arg| {
                    if arg == PER_THREAD_ARG {
                        format!("{PER_THREAD_ARG} = {}", crate::variants::split_name(&prototype.name).2)
                    } else {
                        arg.clone()
                    }
                })
                .collect(),
            fast_path: entry.fast_path.clone(),
        });
    }
    Ok(routed)
}
