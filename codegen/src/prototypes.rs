//! Reads every function prototype of `cuda.h` or `nvml.h`: bindgen turns the header into Rust, syn
//! reads the declarations back, and the type definitions are kept apart for the hook to include.

use std::path::Path;

use quote::ToTokens;

use crate::{Error, Library, Result};

/// One parameter of a prototype, with its Rust type written out as tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    pub ty: String,
}

/// One C function of a header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prototype {
    pub name: String,
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

fn bindgen_for(library: Library, include_dir: &Path) -> bindgen::Builder {
    let header = include_dir.join(library.header());
    let builder = bindgen::Builder::default()
        .header(header.display().to_string())
        .clang_arg(format!("-I{}", include_dir.display()))
        .layout_tests(false)
        .derive_default(true)
        .derive_debug(false)
        .generate_comments(false)
        .prepend_enum_name(false)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .size_t_is_usize(true);
    match library {
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
    }
}

/// Runs bindgen over the library's header and splits the result into prototypes and types.
pub fn read_header(library: Library, include_dir: &Path) -> Result<Header> {
    let header = include_dir.join(library.header());
    if !header.is_file() {
        return Err(Error(format!(
            "{} not found in {}",
            library.header(),
            include_dir.display()
        )));
    }
    let bindings = bindgen_for(library, include_dir)
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
                        functions.push(prototype_of(&function.sig, &header)?);
                    }
                }
            }
            syn::Item::Const(constant) if constant.ident == "CUDA_VERSION" => {
                version = Some(const_value(&constant, &header)?);
                kept.push(syn::Item::Const(constant));
            }
            other => kept.push(other),
        }
    }
    let version = match library {
        Library::Cuda => version.ok_or_else(|| Error(format!("{} defines no CUDA_VERSION", header.display())))?,
        Library::Nvml => 0,
    };
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

fn prototype_of(sig: &syn::Signature, header: &Path) -> Result<Prototype> {
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
    Ok(Prototype { name, params, ret })
}
