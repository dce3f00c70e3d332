//! Code generation for the vgpu hook.
//!
//! The pipeline: locate the headers ([`headers`]), read every prototype with bindgen and syn
//! ([`prototypes`]), join them with `cuda-api.toml` ([`table`], [`route`]) and the handlers'
//! signatures ([`handlers`]), and emit the input of
//! the hook macros plus a human-readable coverage listing ([`emit`]). [`variants`] reads
//! `cudaTypedefs.h` to learn which CUDA version introduced each versioned entry point;
//! [`compat`] absorbs struct and constant differences between releases.

pub mod compat;
pub mod emit;
pub mod handlers;
pub mod headers;
pub mod libclang;
pub mod prototypes;
pub mod route;
pub mod table;
pub mod variants;

use std::fmt;
use std::path::Path;

/// The two libraries whose entry points the hook exports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Library {
    /// The CUDA driver API, `cuda.h`, `libcuda.so.1`.
    Cuda,
    /// NVML, `nvml.h`, `libnvidia-ml.so.1`.
    Nvml,
}

impl Library {
    pub const ALL: [Library; 2] = [Library::Cuda, Library::Nvml];

    pub fn header(self) -> &'static str {
        match self {
            Library::Cuda => "cuda.h",
            Library::Nvml => "nvml.h",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            Library::Cuda => "cuda",
            Library::Nvml => "nvml",
        }
    }
}

/// Any failure of the generator, with a message that names the table entry or header at fault.
#[derive(Debug)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Everything generated from one header set and one table.
pub struct Generated {
    pub cuda_version: u32,
    /// Rust type definitions of cuda.h (no function declarations).
    pub cuda_types: String,
    /// Rust type definitions of nvml.h (no function declarations).
    pub nvml_types: String,
    /// The `hook_macros::hooks!` invocation listing every function with its class.
    pub hooks_input: String,
    /// Sorted listing: name, class, handler.
    pub coverage: String,
    /// `pub const UNDECLARED: &[&str]`: the private entry points `cuda-api.toml` names
    /// (`[[undeclared]]`), sorted.
    pub undeclared: String,
    /// Every routed function, CUDA first, then NVML.
    pub routed: Vec<route::Routed>,
    /// Which variant of each base name each CUDA version gets from `cuGetProcAddress`.
    pub variants: Vec<variants::VariantSet>,
    /// The libclang bindgen ran.
    pub libclang: libclang::Loaded,
}

/// What bindgen reads from one header folder: the slow half of the pipeline, shared by the hook,
/// the fake driver and the tests.
pub struct Headers {
    pub cuda: prototypes::Header,
    pub nvml: prototypes::Header,
    /// Which variant of each base name each CUDA version gets from `cuGetProcAddress`.
    pub variants: Vec<variants::VariantSet>,
}

/// Reads `cuda.h` (with the interop headers), `nvml.h` and `cudaTypedefs.h` in `include_dir`.
pub fn read_headers(include_dir: &Path) -> Result<Headers> {
    let cuda = prototypes::read_header(Library::Cuda, include_dir)?;
    let nvml = prototypes::read_header(Library::Nvml, include_dir)?;
    let variants = variants::read(include_dir, &cuda.functions)?;
    Ok(Headers { cuda, nvml, variants })
}

/// Runs the whole pipeline over the headers in `include_dir`, the table at `table_path` and the
/// handlers defined below `handlers_src` (the hook's `src` folder).
pub fn generate(include_dir: &Path, table_path: &Path, handlers_src: &Path) -> Result<Generated> {
    generate_from(&read_headers(include_dir)?, table_path, handlers_src)
}

/// The pipeline's second half: joins headers already read with the table and the handlers.
pub fn generate_from(headers: &Headers, table_path: &Path, handlers_src: &Path) -> Result<Generated> {
    let (cuda, nvml) = (&headers.cuda, &headers.nvml);
    let table = table::Table::load(table_path)?;
    let handlers = handlers::Handlers::load(handlers_src)?;
    let mut routed = route::join(cuda, &table, &handlers, Library::Cuda, cuda.version)?;
    routed.extend(route::join(nvml, &table, &handlers, Library::Nvml, cuda.version)?);
    let declared: std::collections::HashSet<&str> = routed.iter().map(|r| r.prototype.name.as_str()).collect();
    table.check_all_declared(&declared, cuda.version)?;
    Ok(Generated {
        cuda_version: cuda.version,
        hooks_input: emit::hooks_input(&routed),
        coverage: emit::coverage(&routed, cuda.version),
        undeclared: emit::undeclared(&table.undeclared_names()),
        cuda_types: cuda.types.clone(),
        nvml_types: nvml.types.clone(),
        routed,
        variants: headers.variants.clone(),
        libclang: libclang::loaded(),
    })
}
