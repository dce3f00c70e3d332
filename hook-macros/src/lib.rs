//! `hooks!`: expands the function list that `vgpu-codegen` writes into
//!
//! - one exported `extern "C"` wrapper per function, whose body runs under `catch_unwind`, resolves
//!   the real function lazily through its slot, and either forwards the call (passthrough) or hands
//!   a closure that makes the call to the handler the table names; a `suspendable` function first
//!   waits while `vgpu-smi suspend` holds the process (`crate::session::suspend::suspended` on the direct
//!   path, `crate::session::suspend::wait_while_suspended` on the slow one);
//! - `EXPORTS`: every function's name, wrapper address and real-function slot, sorted by name (the
//!   table that `dlsym` and `cuGetProcAddress` answer from);
//! - `real::<name>()`: typed access to each real function for the runtime's own calls.
//!
//! Input: `extern "C" { #[vgpu(library = cuda, class = memory_accounted,
//! handler = crate::memory::alloc, args(call, dptr, bytesize))] fn cuMemAlloc_v2(..) -> CUresult; .. }`.
//! `args` are in the handler's parameter order, which the generator bound by name: `call` is the
//! closure that calls the real function, `entry_point` the function's name, a constant the
//! generator states is `per_thread = true`, and any other name is the wrapper's parameter.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote};
use syn::parse::{Parse, ParseStream};
use syn::{ForeignItem, ForeignItemFn, Ident, ItemForeignMod, Path};

struct Function {
    item: ForeignItemFn,
    library: Ident,
    /// The handler and its arguments: parameter names, or constants the generator states
    /// (`per_thread = true`).
    handler: Option<(Path, Vec<Arg>)>,
    /// While this `fn() -> bool` holds, the wrapper calls the real function without the handler.
    fast_path: Option<Path>,
    /// Whether the wrapper first waits while the process is suspended.
    suspendable: bool,
}

use vgpu_handler_args::Arg;

struct Input {
    functions: Vec<Function>,
}

impl Parse for Input {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let block: ItemForeignMod = input.parse()?;
        let mut functions = Vec::new();
        for item in block.items {
            let ForeignItem::Fn(mut item) = item else {
                return Err(syn::Error::new(Span::call_site(), "hooks!: only functions are allowed"));
            };
            let mut library = None;
            let mut class = None;
            let mut handler_path = None;
            let mut handler_args = Vec::new();
            let mut fast_path = None;
            let mut suspendable = false;
            let attrs = std::mem::take(&mut item.attrs);
            for attr in attrs {
                if !attr.path().is_ident("vgpu") {
                    item.attrs.push(attr);
                    continue;
                }
                attr.parse_nested_meta(|meta| {
                    if meta.path.is_ident("library") {
                        library = Some(meta.value()?.parse::<Ident>()?);
                    } else if meta.path.is_ident("class") {
                        class = Some(meta.value()?.parse::<Ident>()?);
                    } else if meta.path.is_ident("handler") {
                        handler_path = Some(meta.value()?.parse::<Path>()?);
                    } else if meta.path.is_ident("fast_path") {
                        fast_path = Some(meta.value()?.parse::<Path>()?);
                    } else if meta.path.is_ident("suspendable") {
                        suspendable = true;
                    } else if meta.path.is_ident("args") {
                        meta.parse_nested_meta(|arg| {
                            let ident = arg.path.require_ident()?.clone();
                            let value = if arg.input.peek(syn::Token![=]) {
                                Some(arg.value()?.parse::<syn::LitBool>()?.value)
                            } else {
                                None
                            };
                            let parsed = Arg::from_attribute(&ident.to_string(), value)
                                .map_err(|problem| syn::Error::new_spanned(&ident, problem))?;
                            handler_args.push(parsed);
                            Ok(())
                        })?;
                    } else {
                        return Err(meta.error("unknown vgpu attribute"));
                    }
                    Ok(())
                })?;
            }
            let name = &item.sig.ident;
            let library = library.ok_or_else(|| syn::Error::new_spanned(name, "missing library"))?;
            if library != "cuda" && library != "nvml" {
                return Err(syn::Error::new_spanned(library, "library must be cuda or nvml"));
            }
            let class = class.ok_or_else(|| syn::Error::new_spanned(name, "missing class"))?;
            let handler = match (class.to_string().as_str(), handler_path) {
                ("passthrough", None) => None,
                ("passthrough", Some(path)) => {
                    return Err(syn::Error::new_spanned(path, "a passthrough function takes no handler"));
                }
                (_, Some(path)) => Some((path, handler_args)),
                (_, None) => return Err(syn::Error::new_spanned(class, "this class needs a handler")),
            };
            if let Some((_, args)) = &handler {
                for arg in args {
                    if let Arg::Param(name) = arg {
                        let known = item.sig.inputs.iter().any(|input| {
                            matches!(input, syn::FnArg::Typed(typed)
                                if matches!(typed.pat.as_ref(), syn::Pat::Ident(p) if p.ident == name))
                        });
                        if !known {
                            return Err(syn::Error::new_spanned(
                                &item.sig.ident,
                                format!("`{name}` is not a parameter of this function"),
                            ));
                        }
                    }
                }
            }
            functions.push(Function {
                item,
                library,
                handler,
                fast_path,
                suspendable,
            });
        }
        Ok(Input { functions })
    }
}

/// Expands the function list; see the crate documentation.
#[proc_macro]
pub fn hooks(input: TokenStream) -> TokenStream {
    let mut input = syn::parse_macro_input!(input as Input);
    input.functions.sort_by_key(|f| f.item.sig.ident.to_string());
    match expand(&input) {
        Ok(tokens) => tokens.into(),
        Err(error) => error.to_compile_error().into(),
    }
}

fn expand(input: &Input) -> syn::Result<TokenStream2> {
    let mut wrappers = Vec::new();
    let mut exports = Vec::new();
    let mut accessors = Vec::new();
    let mut quiet_accessors = Vec::new();
    for (index, function) in input.functions.iter().enumerate() {
        let sig = &function.item.sig;
        let name = &sig.ident;
        let name_text = name.to_string();
        let c_name = syn::LitCStr::new(
            &std::ffi::CString::new(name_text.clone())
                .map_err(|_| syn::Error::new_spanned(name, "function name contains a NUL byte"))?,
            Span::call_site(),
        );
        let ret = match &sig.output {
            syn::ReturnType::Type(_, ty) => ty.as_ref().clone(),
            syn::ReturnType::Default => return Err(syn::Error::new_spanned(sig, "every entry point returns a status")),
        };
        let mut param_names = Vec::new();
        let mut param_types = Vec::new();
        for input in &sig.inputs {
            let syn::FnArg::Typed(typed) = input else {
                return Err(syn::Error::new_spanned(input, "unexpected receiver"));
            };
            let syn::Pat::Ident(ident) = typed.pat.as_ref() else {
                return Err(syn::Error::new_spanned(&typed.pat, "parameters must be plain names"));
            };
            param_names.push(ident.ident.clone());
            param_types.push(typed.ty.as_ref().clone());
        }
        let library = &function.library;
        let library_variant = if library == "cuda" { quote!(Cuda) } else { quote!(Nvml) };
        let (not_found, panicked) = if matches!(ret, syn::Type::Ptr(_)) {
            // nvmlErrorString returns a string, not a status: failures are a null pointer.
            (quote!(::core::ptr::null()), quote!(::core::ptr::null()))
        } else if library == "cuda" {
            (
                quote!(crate::sys::cuda::CUDA_ERROR_NOT_FOUND),
                quote!(crate::sys::cuda::CUDA_ERROR_UNKNOWN),
            )
        } else {
            (
                quote!(crate::sys::nvml::NVML_ERROR_FUNCTION_NOT_FOUND),
                quote!(crate::sys::nvml::NVML_ERROR_UNKNOWN),
            )
        };
        let real_type = quote!(unsafe extern "C" fn(#(#param_types),*) -> #ret);
        // The passthrough fast path is a load, a compare and a tail call: the real function is C
        // and cannot unwind, and the only Rust code that could panic (resolution) runs guarded.
        // Handlers are our code, so their whole call runs under the guard.
        let passthrough = quote! {
            let address = match EXPORTS[#index].resolved() {
                Some(address) => address,
                None => match crate::real::resolve_guarded(&EXPORTS[#index]) {
                    Ok(address) => address,
                    Err(crate::real::Unresolved::Missing) => return #not_found,
                    Err(crate::real::Unresolved::Panicked) => return #panicked,
                },
            };
            // SAFETY: the slot holds the address the real library exports under this name,
            // whose prototype the header gives as this signature.
            let real = unsafe { ::core::mem::transmute::<*mut ::core::ffi::c_void, #real_type>(address) };
            // SAFETY: the application's arguments, passed on unchanged to the function it called.
            unsafe { real(#(#param_names),*) }
        };
        // The direct path: a check and a call, nothing that needs the arguments saved (an
        // unresolved slot takes the slow path, which resolves it). It holds while the process is
        // not suspended (for `suspendable` functions) and the table's fast path (e.g. launches
        // while nothing is limited) says so. It runs outside the panic guard, so a fast-path
        // function must not panic: loads and compares only.
        let not_suspended = function
            .suspendable
            .then(|| quote!(!crate::session::suspend::suspended()));
        let fast = function.fast_path.as_ref().map(|fast_path| quote!(#fast_path()));
        let direct_condition: Vec<TokenStream2> = not_suspended.into_iter().chain(fast).collect();
        let direct = if direct_condition.is_empty() {
            quote! {}
        } else {
            quote! {
                if #(#direct_condition)&&*
                    && let Some(address) = EXPORTS[#index].resolved()
                {
                    // SAFETY: as below: the real function of this name and prototype.
                    let real = unsafe { ::core::mem::transmute::<*mut ::core::ffi::c_void, #real_type>(address) };
                    // SAFETY: the application's arguments, passed on unchanged.
                    return unsafe { real(#(#param_names),*) };
                }
            }
        };
        // Copies, sets and launches hold while `vgpu-smi suspend` holds the process. The wait is
        // on the slow path only, in a function of its own: a call on the direct path would make
        // the wrapper save its arguments on every call. It runs under a panic guard of its own.
        let wait = if function.suspendable {
            quote!(crate::session::suspend::wait_while_suspended();)
        } else {
            quote!()
        };
        let slow = match &function.handler {
            None => passthrough,
            Some((path, args)) => {
                let args = args.iter().map(|arg| match arg {
                    Arg::Call => quote!(move || unsafe { real(#(#param_names),*) }),
                    Arg::EntryPoint => quote!(#name_text),
                    Arg::PerThread(value) => quote!(#value),
                    Arg::Param(name) => {
                        let ident = Ident::new(name, Span::call_site());
                        quote!(#ident)
                    }
                });
                quote! {
                    crate::real::guard(#name_text, #panicked, move || {
                        let Some(address) = EXPORTS[#index].real_address() else {
                            return #not_found;
                        };
                        // SAFETY: as for passthrough functions: the real function of this name.
                        let real = unsafe { ::core::mem::transmute::<*mut ::core::ffi::c_void, #real_type>(address) };
                        // SAFETY (the closure, `call`): the application's arguments, passed on
                        // unchanged.
                        #path(#(#args),*)
                    })
                }
            }
        };
        let body = if !direct_condition.is_empty() {
            // The slow path in a function of its own, so the direct path needs no frame.
            quote! {
                #direct
                #[inline(never)]
                #[allow(non_snake_case, clippy::too_many_arguments)]
                unsafe extern "C" fn slow(#(#param_names: #param_types),*) -> #ret {
                    #wait
                    #slow
                }
                // SAFETY: the wrapper's own arguments, passed on unchanged.
                unsafe { slow(#(#param_names),*) }
            }
        } else {
            slow
        };
        wrappers.push(quote! {
            #[allow(non_snake_case, clippy::too_many_arguments, clippy::missing_safety_doc)]
            #[cfg_attr(not(test), unsafe(no_mangle))]
            pub unsafe extern "C" fn #name(#(#param_names: #param_types),*) -> #ret {
                #body
            }
        });
        exports.push(quote! {
            crate::real::Export::new(#c_name, crate::real::Library::#library_variant, #name as *const ::core::ffi::c_void)
        });
        accessors.push(quote! {
            #[allow(non_snake_case, dead_code)]
            #[inline]
            pub fn #name() -> Option<unsafe extern "C" fn(#(#param_types),*) -> #ret> {
                let address = super::EXPORTS[#index].real_address()?;
                // SAFETY: as in the wrapper: the real library's function of this name and prototype.
                Some(unsafe {
                    ::core::mem::transmute::<*mut ::core::ffi::c_void, unsafe extern "C" fn(#(#param_types),*) -> #ret>(address)
                })
            }
        });
        quiet_accessors.push(quote! {
            #[allow(non_snake_case, dead_code)]
            #[inline]
            pub fn #name() -> Option<unsafe extern "C" fn(#(#param_types),*) -> #ret> {
                let address = super::super::EXPORTS[#index].probe()?;
                // SAFETY: as in the wrapper: the real library's function of this name and prototype.
                Some(unsafe {
                    ::core::mem::transmute::<*mut ::core::ffi::c_void, unsafe extern "C" fn(#(#param_types),*) -> #ret>(address)
                })
            }
        });
    }
    let count = input.functions.len();
    let real_module = format_ident!("real");
    Ok(quote! {
        /// Every exported entry point, sorted by name.
        pub static EXPORTS: [crate::real::Export; #count] = [#(#exports),*];

        #(#wrappers)*

        /// The real functions, resolved on first use, for the runtime's own calls.
        pub mod #real_module {
            #[allow(unused_imports)]
            use super::*;
            #(#accessors)*

            /// The same, without reporting a missing function: for functions only newer drivers
            /// have, which the library uses when they are there.
            pub mod quiet {
                #[allow(unused_imports)]
                use super::super::*;
                #(#quiet_accessors)*
            }
        }
    })
}
