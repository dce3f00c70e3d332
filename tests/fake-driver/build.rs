//! Generates the fake driver's boilerplate from the CUDA headers (through `vgpu-codegen`):
//!
//! - `cuda_types.rs`, `nvml_types.rs`: every type and constant of `cuda.h` and `nvml.h`;
//! - `exports.rs`: a stub with the exact prototype for every header function that `src/` does not
//!   implement by hand (CUDA stubs return `CUDA_ERROR_NOT_SUPPORTED`, NVML stubs
//!   `NVML_ERROR_NOT_SUPPORTED`), a compile-time check that every hand-written export has the
//!   header's prototype, the name → function-pointer table of every export, and the table of
//!   variants `cuGetProcAddress` chooses from.
//!
//! Hand-written exports are found by parsing `src/**/*.rs` with syn and collecting the functions
//! marked `#[unsafe(no_mangle)]`. A function of a newer release is written under
//! `#[cfg(cuda_api = "13050")]` (the `CUDA_VERSION` that introduced it): this script sets
//! `cuda_api` to every supported release up to the headers' own, so it exists exactly where the
//! headers declare it.

use std::collections::BTreeMap;
use std::error::Error;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use vgpu_codegen::prototypes::Prototype;
use vgpu_codegen::{Library, headers, prototypes, variants};

/// Header functions the library deliberately does not export at all (neither a stub nor an
/// implementation), so that tests can exercise the missing-symbol path: `dlsym` returns NULL and
/// `cuGetProcAddress` answers `CUDA_ERROR_NOT_FOUND` / `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`.
pub const NOT_EXPORTED: &[&str] = &["cuDeviceGetNvSciSyncAttributes", "nvmlDeviceGetNvLinkRemotePciInfo_v2"];

/// Hand-written exports that no header declares: each stands for a function of a driver newer
/// than the headers, which `dlsym` and `cuGetProcAddress` find and the hook does not export.
pub const NEWER_THAN_HEADERS: &[&str] = &["cuFakeNewerDriverFunction"];

/// Hand-written exports that no header declares, standing for the real libraries' private entry
/// points that cuda-api.toml names as undeclared (the hook notes them at debug level only).
pub const PRIVATE: &[&str] = &["nvmlInternalGetExportTable"];

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn main() -> Result<()> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    // Like the real libcuda: references to its own functions bind inside the library, so a
    // preloaded interposer cannot redirect them (cuGetProcAddress answers with the fake's own).
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    println!("cargo:rerun-if-env-changed=CUDA_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed={}", vgpu_codegen::libclang::VARIABLE);

    let root = headers::workspace_root(&manifest_dir);
    let include_dir = headers::locate(&root)?;
    for header in ["cuda.h", "nvml.h", "cudaTypedefs.h"] {
        println!("cargo:rerun-if-changed={}", include_dir.join(header).display());
    }

    let cuda = prototypes::read_header(Library::Cuda, &include_dir)?;
    let nvml = prototypes::read_header(Library::Nvml, &include_dir)?;
    let variant_sets = variants::read(&include_dir, &cuda.functions)?;

    let releases = cuda_api_releases(cuda.version);
    let values: Vec<String> = headers::versions()
        .iter()
        .map(|v| format!("\"{}\"", release_number(v)))
        .collect();
    println!("cargo::rustc-check-cfg=cfg(cuda_api, values({}))", values.join(", "));
    for release in &releases {
        println!("cargo::rustc-cfg=cuda_api=\"{release}\"");
    }

    let src = manifest_dir.join("src");
    println!("cargo:rerun-if-changed={}", src.display());
    let mut hand_written = BTreeMap::new();
    collect_hand_written(&src, &src, &releases, &mut hand_written)?;

    let exports = exports_source(&cuda.functions, &nvml.functions, &hand_written, &variant_sets)?;
    std::fs::write(out_dir.join("cuda_types.rs"), &cuda.types)?;
    std::fs::write(out_dir.join("nvml_types.rs"), &nvml.types)?;
    std::fs::write(out_dir.join("exports.rs"), exports)?;
    Ok(())
}

/// `13.5` as `13050`, as in `CUDA_VERSION`.
fn release_number(version: &str) -> u32 {
    let (major, minor) = version.split_once('.').unwrap_or((version, "0"));
    major.parse::<u32>().unwrap_or(0) * 1000 + minor.parse::<u32>().unwrap_or(0) * 10
}

/// The supported releases up to the headers' `CUDA_VERSION`: the values `cuda_api` is set to.
fn cuda_api_releases(version: u32) -> Vec<u32> {
    let mut releases: Vec<u32> = headers::versions()
        .iter()
        .map(|v| release_number(v))
        .filter(|&release| release <= version)
        .collect();
    releases.sort_unstable();
    releases
}

/// Walks `dir` and records, for every `#[unsafe(no_mangle)]` function, the Rust path of the module
/// that defines it (`crate::memory`).
fn collect_hand_written(src: &Path, dir: &Path, releases: &[u32], found: &mut BTreeMap<String, String>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            collect_hand_written(src, &path, releases, found)?;
            continue;
        }
        if path.extension().is_none_or(|ext| ext != "rs") {
            continue;
        }
        println!("cargo:rerun-if-changed={}", path.display());
        let text = std::fs::read_to_string(&path)?;
        let file = syn::parse_file(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let module = module_path(src, &path)?;
        collect_items(&file.items, &module, releases, found)?;
    }
    Ok(())
}

fn module_path(src: &Path, file: &Path) -> Result<String> {
    let relative = file.strip_prefix(src)?;
    let mut parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if stem != "lib" && stem != "mod" {
            parts.push(stem.to_string());
        }
    }
    let mut path = String::from("crate");
    for part in parts {
        path.push_str("::");
        path.push_str(&part);
    }
    Ok(path)
}

fn collect_items(
    items: &[syn::Item],
    module: &str,
    releases: &[u32],
    found: &mut BTreeMap<String, String>,
) -> Result<()> {
    for item in items {
        match item {
            syn::Item::Fn(function)
                if function.attrs.iter().any(is_no_mangle) && compiled(&function.attrs, releases) =>
            {
                let name = function.sig.ident.to_string();
                if let Some(previous) = found.insert(name.clone(), module.to_string()) {
                    return Err(format!("{name} is exported twice ({previous} and {module})").into());
                }
            }
            syn::Item::Mod(inner) => {
                if let Some((_, items)) = &inner.content {
                    collect_items(items, &format!("{module}::{}", inner.ident), releases, found)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Whether an item's `#[cfg(cuda_api = "N")]` (if any) holds for these headers.
fn compiled(attrs: &[syn::Attribute], releases: &[u32]) -> bool {
    attrs.iter().filter(|attr| attr.path().is_ident("cfg")).all(|attr| {
        let Ok(syn::Meta::NameValue(value)) = attr.parse_args::<syn::Meta>() else {
            return true;
        };
        if !value.path.is_ident("cuda_api") {
            return true;
        }
        match &value.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(text),
                ..
            }) => text
                .value()
                .parse::<u32>()
                .is_ok_and(|release| releases.contains(&release)),
            _ => true,
        }
    })
}

fn is_no_mangle(attr: &syn::Attribute) -> bool {
    if attr.path().is_ident("no_mangle") {
        return true;
    }
    match &attr.meta {
        syn::Meta::List(list) if list.path.is_ident("unsafe") => list.tokens.to_string().trim() == "no_mangle",
        _ => false,
    }
}

fn params_of(prototype: &Prototype) -> Vec<&str> {
    prototype.params.iter().map(|p| p.ty.as_str()).collect()
}

fn exports_source(
    cuda: &[Prototype],
    nvml: &[Prototype],
    hand_written: &BTreeMap<String, String>,
    variant_sets: &[variants::VariantSet],
) -> Result<String> {
    let mut header_names = BTreeMap::new();
    for (library, functions) in [(Library::Cuda, cuda), (Library::Nvml, nvml)] {
        for function in functions {
            header_names.insert(function.name.clone(), library);
        }
    }
    for name in NOT_EXPORTED {
        if !header_names.contains_key(*name) {
            return Err(format!("NOT_EXPORTED names {name}, which the headers do not declare").into());
        }
    }
    for (name, module) in hand_written {
        if !header_names.contains_key(name)
            && !NEWER_THAN_HEADERS.contains(&name.as_str())
            && !PRIVATE.contains(&name.as_str())
        {
            return Err(format!("{module}::{name} is exported but is not a function of cuda.h or nvml.h").into());
        }
        if NOT_EXPORTED.contains(&name.as_str()) {
            return Err(format!("{module}::{name} is implemented although it is listed in NOT_EXPORTED").into());
        }
    }

    let mut out = String::from("// Generated by tests/fake-driver/build.rs. Do not edit.\n\n");
    // Paths of every exported function, by name.
    let mut exported: BTreeMap<String, String> = BTreeMap::new();
    for (library, functions) in [(Library::Cuda, cuda), (Library::Nvml, nvml)] {
        let (module, types, ok, stub_result) = match library {
            Library::Cuda => ("cuda_stubs", "cuda", "CUresult", "CUDA_ERROR_NOT_SUPPORTED"),
            Library::Nvml => ("nvml_stubs", "nvml", "nvmlReturn_t", "NVML_ERROR_NOT_SUPPORTED"),
        };
        let _ = writeln!(
            out,
            "/// Stubs of the {} functions without a hand-written implementation.",
            library.header()
        );
        let _ = writeln!(out, "pub mod {module} {{\n    use crate::{types}::*;");
        let mut checks = String::new();
        for function in functions {
            let name = &function.name;
            if NOT_EXPORTED.contains(&name.as_str()) {
                continue;
            }
            let params = params_of(function);
            if let Some(path) = hand_written.get(name) {
                let _ = writeln!(
                    checks,
                    "    const _: unsafe extern \"C\" fn({}) -> {} = {path}::{name};",
                    params.join(", "),
                    function.ret
                );
                exported.insert(name.clone(), path.clone());
                continue;
            }
            if function.ret != ok {
                return Err(format!(
                    "{name} returns {}, so it needs a hand-written implementation",
                    function.ret
                )
                .into());
            }
            let args: Vec<String> = params.iter().map(|ty| format!("_: {ty}")).collect();
            let _ = writeln!(
                out,
                "    #[unsafe(no_mangle)]\n    pub unsafe extern \"C\" fn {name}({}) -> {ok} {{\n        {stub_result}\n    }}",
                args.join(", ")
            );
            exported.insert(name.clone(), format!("crate::exports::{module}"));
        }
        out.push_str("}\n\n");
        let _ = writeln!(
            out,
            "/// Each hand-written {} export coerces to the header's prototype.\n#[allow(unused_imports)]\nmod {types}_checks {{\n    use crate::{types}::*;\n{checks}}}\n",
            library.header()
        );
    }

    let _ = writeln!(out, "/// Header functions deliberately not exported (see build.rs).");
    let _ = writeln!(out, "pub const NOT_EXPORTED: &[&str] = &{:?};\n", NOT_EXPORTED);
    let _ = writeln!(out, "/// Exports of a driver newer than the headers (see build.rs).");
    let _ = writeln!(
        out,
        "pub const NEWER_THAN_HEADERS: &[&str] = &{:?};\n",
        NEWER_THAN_HEADERS
    );
    for name in NEWER_THAN_HEADERS {
        if let Some(path) = hand_written.get(*name) {
            exported.insert((*name).to_string(), path.clone());
        }
    }
    let names: Vec<&String> = exported.keys().collect();
    let _ = writeln!(out, "/// Every exported CUDA and NVML function, sorted.");
    let _ = writeln!(out, "pub const EXPORTED: &[&str] = &{names:?};\n");
    out.push_str("/// The address of an exported function, by name.\n");
    out.push_str("pub fn lookup(name: &str) -> Option<*mut ::std::ffi::c_void> {\n    let address = match name {\n");
    for (name, path) in &exported {
        let _ = writeln!(out, "        {name:?} => {path}::{name} as *mut ::std::ffi::c_void,");
    }
    out.push_str("        _ => return None,\n    };\n    Some(address)\n}\n\n");

    out.push_str("/// The variants of each CUDA base name with the version that introduced them, by base name.\n");
    out.push_str("pub static VARIANTS: &[crate::proc_address::VariantSet] = &[\n");
    let mut sets: Vec<&variants::VariantSet> = variant_sets.iter().collect();
    sets.sort_by(|a, b| a.base.cmp(&b.base));
    for set in sets {
        let _ = writeln!(
            out,
            "    crate::proc_address::VariantSet {{ base: {:?}, legacy_stream: &{:?}, per_thread: &{:?} }},",
            set.base, set.legacy_stream, set.per_thread
        );
    }
    out.push_str("];\n");
    syn::parse_file(&out).map_err(|e| format!("generated exports do not parse: {e}"))?;
    Ok(out)
}
