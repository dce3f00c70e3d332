//! Reads every function prototype of `cuda.h` or `nvml.h`: bindgen turns the header into Rust, syn
//! reads the declarations back, and the type definitions are kept apart for the hook to include.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use quote::ToTokens;

use crate::{Error, Library, Result};

/// One parameter of a prototype, with its Rust type written out as tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    pub ty: String,
}

/// Where the CUDA interop entry points come from (see `codegen/shim/interop.h`).
pub const INTEROP_HEADERS: &str = "cudaGL.h, cudaEGL.h, cudaVDPAU.h, cudaProfiler.h";

/// One C function of a header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prototype {
    pub name: String,
    /// The header that declares it: `cuda.h`, `nvml.h`, or [`INTEROP_HEADERS`].
    pub header: &'static str,
    pub params: Vec<Param>,
    pub ret: String,
}

/// What one header yields.
pub struct Header {
    pub library: Library,
    /// `CUDA_VERSION` of cuda.h (also recorded for nvml.h, which has none of its own).
    pub version: u32,
    pub functions: Vec<Prototype>,
    pub types: String,
}

/// Our stand-ins for the window-system headers the interop headers include.
fn shim_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("shim")
}

fn bindgen_for(library: Library, header: &Path, include_dir: &Path) -> Result<bindgen::Builder> {
    let libclang = crate::libclang::configured()?;
    let mut builder = bindgen::Builder::default()
        .header(header.display().to_string())
        .clang_arg(format!("-I{}", include_dir.display()))
        .clang_arg(format!("-I{}", shim_dir().display()))
        .layout_tests(false)
        .derive_default(true)
        .derive_debug(false)
        .generate_comments(false)
        .prepend_enum_name(false)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .size_t_is_usize(true)
        // Never ask a system clang executable for its include folders: clang would then read that
        // clang's builtin headers instead of those beside the pinned libclang.
        .detect_include_paths(false);
    if let Some(resource_dir) = &libclang.resource_dir {
        builder = builder.clang_arg(format!("-resource-dir={}", resource_dir.display()));
    }
    Ok(match library {
        // Exposes the legacy, _vN, _ptds and _ptsz prototypes, which the public macros hide.
        Library::Cuda => builder
            .clang_arg("-D__CUDA_API_VERSION_INTERNAL")
            .allowlist_function("cu.*")
            .allowlist_type("CU.*|cu.*")
            .allowlist_var("CU.*|CUDA_.*"),
        // Declares both nvmlInit and nvmlInit_v2 (and every other versioned pair).
        Library::Nvml => builder
            .clang_arg("-DNVML_NO_UNVERSIONED_FUNC_DEFS")
            .allowlist_function("nvml.*")
            .allowlist_type("nvml.*")
            .allowlist_var("NVML_.*|nvml.*"),
    })
}

/// Reads the library's header. For CUDA, also the interop headers (GL, EGL, VDPAU, profiler) when
/// the include folder has them: libcuda.so.1 exports their entry points as well.
pub fn read_header(library: Library, include_dir: &Path) -> Result<Header> {
    let header = include_dir.join(library.header());
    if !header.is_file() {
        return Err(Error(format!(
            "{} not found in {}",
            library.header(),
            include_dir.display()
        )));
    }
    let mut main = read_one(library, &header, include_dir, library.header())?;
    if library == Library::Cuda && include_dir.join("cudaGL.h").is_file() {
        let with_interop = read_one(library, &shim_dir().join("interop.h"), include_dir, INTEROP_HEADERS)?;
        let known: HashSet<String> = main.functions.iter().map(|f| f.name.clone()).collect();
        main.functions
            .extend(with_interop.functions.into_iter().filter(|f| !known.contains(&f.name)));
        main.functions.sort_by(|a, b| a.name.cmp(&b.name));
        // The interop pass saw cuda.h too, so its types are a superset.
        main.types = with_interop.types;
    }
    Ok(main)
}

/// Runs bindgen over one header and splits the result into prototypes and types.
fn read_one(library: Library, header: &Path, include_dir: &Path, origin: &'static str) -> Result<Header> {
    let bindings = bindgen_for(library, header, include_dir)?
        .generate()
        .map_err(|e| Error(format!("bindgen failed on {}: {e}", header.display())))?;
    let file = syn::parse_file(&bindings.to_string())
        .map_err(|e| Error(format!("bindgen output for {} does not parse: {e}", header.display())))?;
    let mut functions = Vec::new();
    let mut kept = Vec::new();
    let mut version = None;
    for item in file.items {
        match item {
            syn::Item::ForeignMod(foreign) => {
                for foreign_item in foreign.items {
                    if let syn::ForeignItem::Fn(function) = foreign_item {
                        functions.push(prototype_of(&function.sig, header, origin)?);
                    }
                }
            }
            syn::Item::Const(constant) if constant.ident == "CUDA_VERSION" => {
                version = Some(const_value(&constant, header)?);
                kept.push(syn::Item::Const(constant));
            }
            other => kept.push(other),
        }
    }
    let version = match library {
        Library::Cuda => version.ok_or_else(|| Error(format!("{} defines no CUDA_VERSION", header.display())))?,
        Library::Nvml => 0,
    };
    if library == Library::Cuda {
        kept.extend(crate::compat::generate(&kept)?);
    }
    functions.sort_by(|a, b| a.name.cmp(&b.name));
    functions.dedup_by(|a, b| a.name == b.name);
    let types = syn::File {
        shebang: None,
        attrs: Vec::new(),
        items: kept,
    };
    Ok(Header {
        library,
        version,
        functions,
        types: types.into_token_stream().to_string(),
    })
}

fn const_value(constant: &syn::ItemConst, header: &Path) -> Result<u32> {
    if let syn::Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Int(value),
        ..
    }) = constant.expr.as_ref()
    {
        return value
            .base10_parse()
            .map_err(|e| Error(format!("CUDA_VERSION in {}: {e}", header.display())));
    }
    Err(Error(format!("CUDA_VERSION in {} is not an integer", header.display())))
}

fn prototype_of(sig: &syn::Signature, header: &Path, origin: &'static str) -> Result<Prototype> {
    let name = sig.ident.to_string();
    if sig.variadic.is_some() {
        return Err(Error(format!(
            "{name} in {} is variadic, which the hook cannot forward",
            header.display()
        )));
    }
    let mut params = Vec::new();
    for (index, input) in sig.inputs.iter().enumerate() {
        let syn::FnArg::Typed(typed) = input else {
            return Err(Error(format!("{name} in {} has a receiver", header.display())));
        };
        let param_name = match typed.pat.as_ref() {
            syn::Pat::Ident(ident) => ident.ident.to_string(),
            _ => format!("arg{index}"),
        };
        params.push(Param {
            name: param_name,
            ty: typed.ty.to_token_stream().to_string(),
        });
    }
    let ret = match &sig.output {
        syn::ReturnType::Default => {
            return Err(Error(format!(
                "{name} in {} returns nothing; every entry point must return a status",
                header.display()
            )));
        }
        syn::ReturnType::Type(_, ty) => ty.to_token_stream().to_string(),
    };
    Ok(Prototype {
        name,
        header: origin,
        params,
        ret,
    })
}
