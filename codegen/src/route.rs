//! Joins a header's prototypes with the table: every function gets a class, special ones a handler
//! whose parameters bind to the function's by name, and every variant of a family the table
//! claims must be classified.

use std::collections::BTreeMap;

use crate::handlers::{self, Handlers};
use crate::prototypes::{Header, Prototype};
use crate::table::{Class, Entry, Table, format_version};
use crate::variants::split_name;
use crate::{Error, Library, Result};

pub use vgpu_handler_args::Arg;

/// One function of a header with what the hook does with it.
#[derive(Clone, Debug)]
pub struct Routed {
    pub library: Library,
    pub prototype: Prototype,
    pub class: Class,
    pub handler: Option<String>,
    /// The handler's arguments, in the order of its parameters.
    pub args: Vec<Arg>,
    pub fast_path: Option<String>,
    pub suspendable: bool,
}

impl Routed {
    /// The arguments as the coverage listing shows them: header parameters and stated constants.
    pub fn shown_args(&self) -> Vec<String> {
        self.args
            .iter()
            .filter_map(|arg| match arg {
                Arg::Param(name) => Some(name.clone()),
                Arg::PerThread(_) => Some(arg.to_string()),
                Arg::Call | Arg::EntryPoint => None,
            })
            .collect()
    }
}

/// Routes every function of `header`; functions the table does not name are passthrough.
pub fn join(
    header: &Header,
    table: &Table,
    handlers: &Handlers,
    library: Library,
    version: u32,
) -> Result<Vec<Routed>> {
    check_families(header, table, library)?;
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
                suspendable: false,
            });
            continue;
        };
        let label = entry.label(index);
        if !entry.applies_to(version) {
            return Err(Error(format!(
                "{label}: {} is declared in {} although the entry excludes CUDA {}",
                prototype.name,
                library.header(),
                format_version(version)
            )));
        }
        let args = match &entry.handler {
            Some(handler) => bind(&label, entry, handler, handlers, prototype, library)?,
            None => vec![],
        };
        routed.push(Routed {
            library,
            prototype: prototype.clone(),
            class: entry.class,
            handler: entry.handler.clone(),
            args,
            fast_path: entry.fast_path.clone(),
            suspendable: entry.suspendable,
        });
    }
    Ok(routed)
}

/// The handler's arguments for `prototype`, one per handler parameter, bound by name.
fn bind(
    label: &str,
    entry: &Entry,
    handler: &str,
    handlers: &Handlers,
    prototype: &Prototype,
    library: Library,
) -> Result<Vec<Arg>> {
    let Some(params) = handlers.params(handler) else {
        return Err(Error(format!(
            "{label}: handler {handler} is no public function of the hook (hook/src)"
        )));
    };
    // Header parameter by the name a handler binds it to.
    let mut by_handler_name: BTreeMap<String, &str> = BTreeMap::new();
    for param in &prototype.params {
        let known_as = entry.aliases.get(&param.name).unwrap_or(&param.name);
        by_handler_name.insert(handlers::snake_case(known_as), &param.name);
    }
    let mut args = Vec::with_capacity(params.len());
    for param in params {
        let wanted = param.trim_start_matches('_');
        let special = match wanted {
            handlers::CALL => Some(Arg::Call),
            handlers::ENTRY_POINT => Some(Arg::EntryPoint),
            handlers::PER_THREAD => Some(Arg::PerThread(split_name(&prototype.name).2)),
            _ => None,
        };
        if let Some(special) = special {
            if by_handler_name.contains_key(wanted) {
                return Err(Error(format!(
                    "{label}: {} in {} has a parameter named like {handler}'s `{wanted}`, which the generator provides",
                    prototype.name,
                    library.header()
                )));
            }
            args.push(special);
            continue;
        }
        let Some(header_name) = by_handler_name.get(wanted) else {
            let names: Vec<&str> = prototype.params.iter().map(|p| p.name.as_str()).collect();
            return Err(Error(format!(
                "{label}: {handler}'s parameter `{param}` is no parameter of {} in {} (it has: {}; a handler parameter is a header parameter in snake case, or call, entry_point, per_thread)",
                prototype.name,
                library.header(),
                names.join(", ")
            )));
        };
        args.push(Arg::Param((*header_name).to_string()));
    }
    Ok(args)
}

/// A family (a base name and its `_vN`, `_ptsz`, `_ptds` variants) that the table names is the
/// table's: every variant the header declares must be named by some entry. A release that adds a
/// variant (a `_v3`, a `_ptsz`) then fails the build until someone classifies it, instead of
/// passing it through unaccounted.
fn check_families(header: &Header, table: &Table, library: Library) -> Result<()> {
    let mut claimed: BTreeMap<&str, usize> = BTreeMap::new();
    for (index, entry) in table.entries.iter().enumerate() {
        for name in &entry.functions {
            claimed.entry(split_name(name).0).or_insert(index);
        }
    }
    for prototype in &header.functions {
        let base = split_name(&prototype.name).0;
        if let Some(index) = claimed.get(base)
            && table.entry_for(&prototype.name).is_none()
        {
            return Err(Error(format!(
                "{} declares {}, a variant of the family {base} that {} claims, but no cuda-api.toml entry classifies it",
                library.header(),
                prototype.name,
                table.entries[*index].label(*index)
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prototypes::Param;

    fn header(functions: &[(&str, &[&str])]) -> Header {
        Header {
            library: Library::Cuda,
            version: 13000,
            functions: functions
                .iter()
                .map(|(name, params)| Prototype {
                    name: (*name).to_string(),
                    header: "cuda.h",
                    params: params
                        .iter()
                        .map(|param| Param {
                            name: (*param).to_string(),
                            ty: "u32".into(),
                        })
                        .collect(),
                    ret: "CUresult".into(),
                })
                .collect(),
            types: String::new(),
        }
    }

    fn handlers(source: &str) -> Handlers {
        Handlers::from_sources(&[("a", source)])
            .map_err(|e| e.0)
            .expect("handler source")
    }

    fn table(text: &str) -> Table {
        Table::parse(text).map_err(|e| e.0).expect("table")
    }

    /// The error `join` gives for CUDA 13.0 headers (empty when it succeeds).
    fn join_error(header: &Header, table: &Table, handlers: &Handlers) -> String {
        join(header, table, handlers, Library::Cuda, 13000)
            .err()
            .map(|e| e.0)
            .unwrap_or_default()
    }

    #[test]
    fn arguments_bind_by_name_in_the_handlers_order() {
        let table = table(
            "[[entry]]\nclass = \"launch-throttled\"\nhandler = \"a::b\"\n\
             functions = [\"cuLaunchKernel\", \"cuLaunchKernel_ptsz\"]\n",
        );
        let handlers =
            handlers("pub fn b(h_stream: S, call: C, per_thread: bool, grid_dim_y: u32, grid_dim_x: u32) {}");
        let params: &[&str] = &["f", "gridDimX", "gridDimY", "hStream"];
        let routed = join(
            &header(&[("cuLaunchKernel", params), ("cuLaunchKernel_ptsz", params)]),
            &table,
            &handlers,
            Library::Cuda,
            13000,
        )
        .map_err(|e| e.0)
        .expect("routed");
        let param = |name: &str| Arg::Param(name.to_string());
        assert_eq!(
            routed[0].args,
            [
                param("hStream"),
                Arg::Call,
                Arg::PerThread(false),
                param("gridDimY"),
                param("gridDimX")
            ]
        );
        assert_eq!(routed[1].args[2], Arg::PerThread(true));
    }

    #[test]
    fn a_renamed_or_unknown_parameter_fails() {
        let table = table("[[entry]]\nclass = \"overridden\"\nhandler = \"a::b\"\nfunctions = [\"cuMemAlloc_v2\"]\n");
        let handlers = handlers("pub fn b(call: C, dptr: *mut u64, size: usize) {}");
        let error = join_error(&header(&[("cuMemAlloc_v2", &["dptr", "bytesize"])]), &table, &handlers);
        assert!(
            error
                .contains("a::b's parameter `size` is no parameter of cuMemAlloc_v2 in cuda.h (it has: dptr, bytesize"),
            "{error}"
        );
        let missing = join_error(
            &header(&[("cuMemAlloc_v2", &["dptr", "bytesize"])]),
            &table,
            &Handlers::default(),
        );
        assert!(
            missing.contains("handler a::b is no public function of the hook"),
            "{missing}"
        );
    }

    #[test]
    fn aliases_bind_a_differently_named_parameter() {
        let table = table(
            "[[entry]]\nclass = \"launch-throttled\"\nhandler = \"a::b\"\naliases = { hGraph = \"hGraphExec\" }\n\
             functions = [\"cuGraphLaunch\", \"cuGraphLaunch_ptsz\"]\n",
        );
        let handlers = handlers("pub fn b(call: C, h_graph_exec: G) {}");
        let routed = join(
            &header(&[("cuGraphLaunch", &["hGraph"]), ("cuGraphLaunch_ptsz", &["hGraphExec"])]),
            &table,
            &handlers,
            Library::Cuda,
            13000,
        )
        .map_err(|e| e.0)
        .expect("routed");
        assert_eq!(routed[0].shown_args(), ["hGraph"]);
        assert_eq!(routed[1].shown_args(), ["hGraphExec"]);
    }

    #[test]
    fn an_unclassified_variant_of_a_claimed_family_fails_naming_it() {
        let table =
            table("[[entry]]\nclass = \"passthrough\"\nwhy = \"x\"\nfunctions = [\"cuMemAlloc\", \"cuMemAlloc_v2\"]\n");
        let error = join_error(
            &header(&[
                ("cuMemAlloc", &[]),
                ("cuMemAlloc_v2", &[]),
                ("cuMemAlloc_v9", &[]),
                ("cuMemFree", &[]),
            ]),
            &table,
            &Handlers::default(),
        );
        assert_eq!(
            error,
            "cuda.h declares cuMemAlloc_v9, a variant of the family cuMemAlloc that cuda-api.toml entry #1 (passthrough cuMemAlloc) claims, but no cuda-api.toml entry classifies it"
        );
    }
}
