//! Writes the hook macro input and the coverage listing.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::route::Routed;
use crate::table::{Class, format_version};

/// The `hook_macros::hooks!` input: one `extern "C"` block whose items carry their routing in a
/// `#[vgpu(...)]` attribute.
pub fn hooks_input(routed: &[Routed]) -> String {
    let mut out = String::from("hook_macros::hooks! {\nextern \"C\" {\n");
    for function in routed {
        let mut attr = format!(
            "library = {}, class = {}",
            function.library.key(),
            function.class.key().replace('-', "_")
        );
        if let Some(handler) = &function.handler {
            let args: Vec<String> = function.args.iter().map(ToString::to_string).collect();
            let _ = write!(attr, ", handler = crate::{handler}, args({})", args.join(", "));
            if let Some(fast_path) = &function.fast_path {
                let _ = write!(attr, ", fast_path = crate::{fast_path}");
            }
        }
        if function.suspendable {
            attr.push_str(", suspendable");
        }
        let params: Vec<String> = function
            .prototype
            .params
            .iter()
            .map(|p| format!("{}: {}", p.name, p.ty))
            .collect();
        let _ = writeln!(
            out,
            "#[vgpu({attr})]\nfn {}({}) -> {};",
            function.prototype.name,
            params.join(", "),
            function.prototype.ret
        );
    }
    out.push_str("}\n}\n");
    out
}

/// The hook's list of the private entry points `cuda-api.toml` names (`[[undeclared]]`).
pub fn undeclared(names: &[&str]) -> String {
    let mut out = String::from(
        "/// The driver's and NVML's private entry points named in cuda-api.toml (`[[undeclared]]`), sorted.\n\
         pub const UNDECLARED: &[&str] = &[\n",
    );
    for name in names {
        let _ = writeln!(out, "    {name:?},");
    }
    out.push_str("];\n");
    out
}

/// A sorted, human-readable listing of every function with its class and handler.
pub fn coverage(routed: &[Routed], cuda_version: u32) -> String {
    let mut out = format!("# vgpu API coverage, CUDA {} headers\n", format_version(cuda_version));
    // One summary line per header, in the order the functions come (cuda.h, interop, nvml.h).
    let mut headers: Vec<&str> = Vec::new();
    for function in routed {
        if !headers.contains(&function.prototype.header) {
            headers.push(function.prototype.header);
        }
    }
    for header in headers {
        let mut counts: BTreeMap<Class, usize> = BTreeMap::new();
        let mut total = 0;
        for function in routed.iter().filter(|f| f.prototype.header == header) {
            *counts.entry(function.class).or_default() += 1;
            total += 1;
        }
        let classes: Vec<String> = counts.iter().map(|(class, n)| format!("{} {n}", class.key())).collect();
        let _ = writeln!(out, "# {header}: {total} functions ({})", classes.join(", "));
    }
    let width = routed.iter().map(|f| f.prototype.name.len()).max().unwrap_or(0);
    let mut lines: Vec<String> = routed
        .iter()
        .map(|function| {
            let handler = match &function.handler {
                Some(handler) => format!("  {handler}({})", function.shown_args().join(", ")),
                None => String::new(),
            };
            // Shown so that losing a fast path (the handler back on every call) is a snapshot
            // change.
            let handler = match &function.fast_path {
                Some(fast_path) => format!("{handler}  fast: {fast_path}"),
                None => handler,
            };
            // The generated prologue that holds the call while `vgpu-smi suspend` holds the process.
            let handler = if function.suspendable {
                format!("{handler}  suspendable")
            } else {
                handler
            };
            format!(
                "{:width$}  {:16}{handler}",
                function.prototype.name,
                function.class.key()
            )
            .trim_end()
            .to_string()
        })
        .collect();
    lines.sort();
    for line in lines {
        out.push_str(&line);
        out.push('\n');
    }
    out
}
