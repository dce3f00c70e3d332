//! The handlers' signatures, read from the hook's sources, so that a function's arguments bind to
//! a handler's parameters by name.
//!
//! A handler is a `pub fn` of the hook crate that `cuda-api.toml` names by its path below the
//! crate root (`memory::alloc`, found where it is defined or through a `pub use` of its module).
//! Its parameters say what it receives, in any order:
//!
//! - `call`: a closure that calls the real function with the application's arguments;
//! - `entry_point`: the entry point's name (`&'static str`);
//! - `per_thread`: `true` for the per-thread-default-stream variants (`_ptsz`, `_ptds`), for
//!   which a null stream means the calling thread's stream, `false` for the others;
//! - any other name: the header parameter of that name, in snake case (`hStream` binds to
//!   `h_stream`, `WidthInBytes` to `width_in_bytes`).
//!
//! A handler parameter no header parameter matches fails the build, naming both, so a renamed or
//! reordered parameter cannot pass the wrong argument.

use std::collections::BTreeMap;
use std::path::Path;

use crate::{Error, Result};

pub use vgpu_handler_args::{CALL, ENTRY_POINT, PER_THREAD};

/// Every public function of the sources, by module, with `pub use` re-exports.
#[derive(Default, Debug)]
pub struct Handlers {
    /// module path (`memory`, `memory::handlers`; `` for the crate root) -> function -> parameters.
    functions: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    /// module path -> re-exports: (`Some(name)` for `pub use m::name`, `None` for `pub use m::*`,
    /// with the module path they come from).
    reexports: BTreeMap<String, Vec<(String, Option<String>)>>,
}

impl Handlers {
    /// Reads every `.rs` file below `src` (a crate's `src` folder).
    pub fn load(src: &Path) -> Result<Handlers> {
        let mut handlers = Handlers::default();
        handlers.load_dir(src, src)?;
        Ok(handlers)
    }

    /// From `(module path, source)` pairs, for tests.
    pub fn from_sources(sources: &[(&str, &str)]) -> Result<Handlers> {
        let mut handlers = Handlers::default();
        for (module, source) in sources {
            let file = syn::parse_file(source).map_err(|e| Error(format!("{module}: {e}")))?;
            handlers.collect(module, &file.items);
        }
        Ok(handlers)
    }

    fn load_dir(&mut self, src: &Path, dir: &Path) -> Result<()> {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| Error(format!("cannot read {}: {e}", dir.display())))?
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                self.load_dir(src, &path)?;
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| Error(format!("cannot read {}: {e}", path.display())))?;
                let file = syn::parse_file(&text).map_err(|e| Error(format!("{}: {e}", path.display())))?;
                self.collect(&module_of(src, &path), &file.items);
            }
        }
        Ok(())
    }

    fn collect(&mut self, module: &str, items: &[syn::Item]) {
        for item in items {
            match item {
                syn::Item::Fn(function) if is_public(&function.vis) => {
                    let params = function
                        .sig
                        .inputs
                        .iter()
                        .filter_map(|input| match input {
                            syn::FnArg::Typed(typed) => match typed.pat.as_ref() {
                                syn::Pat::Ident(ident) => Some(ident.ident.to_string()),
                                _ => Some(String::from("_")),
                            },
                            syn::FnArg::Receiver(_) => None,
                        })
                        .collect();
                    self.functions
                        .entry(module.to_string())
                        .or_default()
                        .insert(function.sig.ident.to_string(), params);
                }
                syn::Item::Use(used) if is_public(&used.vis) => {
                    let mut found = Vec::new();
                    flatten_use(&used.tree, &mut Vec::new(), &mut found);
                    for (path, name) in found {
                        let from = join(module, &path.join("::"));
                        self.reexports.entry(module.to_string()).or_default().push((from, name));
                    }
                }
                syn::Item::Mod(inner) => {
                    if let Some((_, items)) = &inner.content {
                        self.collect(&join(module, &inner.ident.to_string()), items);
                    }
                }
                _ => {}
            }
        }
    }

    /// The parameters of the handler at `path` (`memory::alloc`), or `None` if no public function
    /// of that path exists.
    pub fn params(&self, path: &str) -> Option<&[String]> {
        let (module, name) = path.rsplit_once("::").unwrap_or(("", path));
        self.find(module, name, 0)
    }

    fn find(&self, module: &str, name: &str, depth: usize) -> Option<&[String]> {
        if let Some(params) = self.functions.get(module).and_then(|functions| functions.get(name)) {
            return Some(params);
        }
        if depth > 8 {
            return None;
        }
        self.reexports
            .get(module)?
            .iter()
            .find_map(|(from, reexported)| match reexported {
                Some(reexported) if reexported == name => self.find(from, name, depth + 1),
                Some(_) => None,
                None => self.find(from, name, depth + 1),
            })
    }
}

/// `crate::a::b` style path of a source file below `src`: `memory/handlers.rs` is
/// `memory::handlers`, `memory/mod.rs` is `memory`, `lib.rs` the root (``).
fn module_of(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).unwrap_or(file);
    let mut parts: Vec<String> = relative
        .iter()
        .map(|part| part.to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if stem != "lib" && stem != "mod" && stem != "main" {
            parts.push(stem.to_string());
        }
    }
    parts.join("::")
}

fn join(module: &str, name: &str) -> String {
    match (module.is_empty(), name.strip_prefix("self::")) {
        (_, Some(rest)) => join(module, rest),
        (true, None) => name.to_string(),
        (false, None) => format!("{module}::{name}"),
    }
}

fn is_public(vis: &syn::Visibility) -> bool {
    !matches!(vis, syn::Visibility::Inherited)
}

/// `pub use a::{b, c::*}` as (`[a]`, `Some(b)`), (`[a, c]`, `None`).
fn flatten_use(tree: &syn::UseTree, prefix: &mut Vec<String>, found: &mut Vec<(Vec<String>, Option<String>)>) {
    match tree {
        syn::UseTree::Path(path) => {
            prefix.push(path.ident.to_string());
            flatten_use(&path.tree, prefix, found);
            prefix.pop();
        }
        syn::UseTree::Name(name) => found.push((prefix.clone(), Some(name.ident.to_string()))),
        // A renamed re-export does not name handlers here.
        syn::UseTree::Rename(_) => {}
        syn::UseTree::Glob(_) => found.push((prefix.clone(), None)),
        syn::UseTree::Group(group) => {
            for tree in &group.items {
                flatten_use(tree, prefix, found);
            }
        }
    }
}

/// A header parameter's name as a handler parameter: `WidthInBytes` -> `width_in_bytes`,
/// `hStream` -> `h_stream`, `gridDimX` -> `grid_dim_x`.
pub fn snake_case(name: &str) -> String {
    let chars: Vec<char> = name.chars().collect();
    let mut out = String::with_capacity(name.len() + 4);
    for (index, &c) in chars.iter().enumerate() {
        if c.is_ascii_uppercase() {
            let previous = index.checked_sub(1).map(|i| chars[i]);
            let next = chars.get(index + 1);
            let boundary = previous.is_some_and(|p| p.is_ascii_lowercase() || p.is_ascii_digit())
                || (previous.is_some_and(|p| p.is_ascii_uppercase()) && next.is_some_and(char::is_ascii_lowercase));
            if boundary {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snake_cases_header_names() {
        for (header, handler) in [
            ("WidthInBytes", "width_in_bytes"),
            ("hStream", "h_stream"),
            ("gridDimX", "grid_dim_x"),
            ("pPitch", "p_pitch"),
            ("dptr", "dptr"),
            ("Flags", "flags"),
            ("phGraphNode", "ph_graph_node"),
            ("lastSeenTimeStamp", "last_seen_time_stamp"),
            ("cudaVersion", "cuda_version"),
        ] {
            assert_eq!(snake_case(header), handler);
        }
    }

    #[test]
    fn finds_functions_where_defined_and_through_reexports() {
        let handlers = Handlers::from_sources(&[
            ("memory", "mod handlers; pub use handlers::*; pub use other::{free};"),
            (
                "memory::handlers",
                "pub fn alloc(call: F, dptr: *mut u64, bytesize: usize) -> u32 { 0 } fn private(call: F) {}",
            ),
            ("memory::other", "pub fn free(call: F, dptr: u64) -> u32 { 0 }"),
            ("throttle", "pub mod inner { pub fn launch(h_stream: S) {} }"),
        ])
        .map_err(|e| e.0)
        .expect("sources parse");
        assert_eq!(
            handlers.params("memory::alloc"),
            Some(&["call".to_string(), "dptr".into(), "bytesize".into()][..])
        );
        assert_eq!(handlers.params("memory::handlers::alloc").map(<[String]>::len), Some(3));
        assert_eq!(handlers.params("memory::free").map(<[String]>::len), Some(2));
        assert_eq!(handlers.params("throttle::inner::launch").map(<[String]>::len), Some(1));
        assert!(handlers.params("memory::private").is_none());
        assert!(handlers.params("memory::missing").is_none());
    }
}
