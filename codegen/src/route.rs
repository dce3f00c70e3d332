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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prototypes::Param;

    fn header(names: &[&str]) -> Header {
        Header {
            library: Library::Cuda,
            version: 13000,
            functions: names
                .iter()
                .map(|name| Prototype {
                    name: (*name).to_string(),
                    header: "cuda.h",
                    params: vec![Param {
                        name: "hStream".into(),
                        ty: "CUstream".into(),
                    }],
                    ret: "CUresult".into(),
                })
                .collect(),
            types: String::new(),
        }
    }

    #[test]
    fn per_thread_is_stated_by_the_generator_from_the_name() {
        let table = Table::parse(
            "[[entry]]\nclass = \"launch-throttled\"\nhandler = \"a::b\"\nargs = [\"hStream\", \"per_thread\"]\n\
             functions = [\"cuLaunchKernel\", \"cuLaunchKernel_ptsz\", \"cuMemcpyAsync_ptsz\", \"cuMemsetD8_v2_ptds\"]\n",
        )
        .map_err(|e| e.0)
        .expect("table");
        let routed = join(
            &header(&[
                "cuLaunchKernel",
                "cuLaunchKernel_ptsz",
                "cuMemcpyAsync_ptsz",
                "cuMemsetD8_v2_ptds",
            ]),
            &table,
            Library::Cuda,
            13000,
        )
        .map_err(|e| e.0)
        .expect("routed");
        let args: Vec<String> = routed.iter().map(|r| r.args.join(", ")).collect();
        assert_eq!(
            args,
            [
                "hStream, per_thread = false",
                "hStream, per_thread = true",
                "hStream, per_thread = true",
                "hStream, per_thread = true"
            ]
        );
    }

    #[test]
    fn an_unknown_argument_is_still_an_error() {
        let table = Table::parse(
            "[[entry]]\nclass = \"launch-throttled\"\nhandler = \"a::b\"\nargs = [\"perthread\"]\nfunctions = [\"cuLaunchKernel\"]\n",
        )
        .map_err(|e| e.0)
        .expect("table");
        let error = join(&header(&["cuLaunchKernel"]), &table, Library::Cuda, 13000)
            .err()
            .map(|e| e.0)
            .unwrap_or_default();
        assert!(error.contains("has no parameter `perthread`"), "{error}");
    }
}
