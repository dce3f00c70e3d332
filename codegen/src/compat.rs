//! What the hook and the fake driver read the same way under every supported header version.
//!
//! - Struct fields a release moved into an anonymous union or struct: CUDA 13.5 put
//!   `CUmemLocation`'s `id` into an anonymous union (beside the new `localized` pair), which
//!   bindgen reaches as `location.__bindgen_anon_1.id`, where 13.0 has `location.id`. The
//!   generator writes an accessor, `location.id()`, for whichever layout the headers have.
//! - Constants a newer release added that the hook must understand whatever headers it was built
//!   from (the driver's ABI fixes their values): written where the headers lack them, and checked
//!   against the headers that have them.
//!
//! A struct or constant difference between releases is absorbed here, by regeneration, never in
//! hand-written code.

use quote::{format_ident, quote};

use crate::{Error, Result};

/// `(struct, field)`: the fields read through an accessor. A field named here must exist in every
/// supported header, directly or inside anonymous members.
pub const FIELDS: &[(&str, &str)] = &[("CUmemLocation_st", "id")];

/// `(name, type, value)`: constants of newer headers, defined for older ones.
pub const CONSTANTS: &[(&str, &str, i64)] = &[
    // CUDA 13.5: memory in a locality domain, a part of one device's memory.
    ("CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN", "CUmemLocationType", 6),
];

/// The accessor items for [`FIELDS`] and the missing [`CONSTANTS`], from bindgen's type items of
/// `cuda.h`.
pub fn generate(items: &[syn::Item]) -> Result<Vec<syn::Item>> {
    let mut generated = constants(items)?;
    for (owner, field) in FIELDS {
        let Some(found) = find(items, owner, field, 0) else {
            return Err(Error(format!(
                "cuda.h: struct {owner} has no field `{field}`, directly or in an anonymous member (codegen/src/accessors.rs)"
            )));
        };
        let owner_ident = format_ident!("{owner}");
        let field_ident = format_ident!("{field}");
        let path: Vec<syn::Ident> = found.path.iter().map(|part| format_ident!("{part}")).collect();
        let ty = &found.ty;
        let body = if found.through_union {
            if !is_plain_number(ty) {
                return Err(Error(format!(
                    "cuda.h: {owner}.{field} lies in an anonymous union and is not a plain number; an accessor cannot read it safely"
                )));
            }
            quote! { unsafe { self.#(#path).* } }
        } else {
            quote! { self.#(#path).* }
        };
        // The safety argument of the union read goes in the doc: a generated file has no comments.
        let doc = if found.through_union {
            format!(
                "`{field}`, wherever these headers put it (see vgpu-codegen's accessors). SAFETY of the read: `{field}` is a plain number in an anonymous union of plain C data, so every bit pattern is a value."
            )
        } else {
            format!("`{field}`, wherever these headers put it (see vgpu-codegen's accessors).")
        };
        let item: syn::Item = syn::parse2(quote! {
            impl #owner_ident {
                #[doc = #doc]
                #[inline]
                #[allow(dead_code)]
                pub fn #field_ident(&self) -> #ty {
                    #body
                }
            }
        })
        .map_err(|e| Error(format!("accessor for {owner}.{field}: {e}")))?;
        generated.push(item);
    }
    Ok(generated)
}

fn constants(items: &[syn::Item]) -> Result<Vec<syn::Item>> {
    let mut generated = Vec::new();
    for (name, ty, value) in CONSTANTS {
        let declared = items.iter().find_map(|item| match item {
            syn::Item::Const(constant) if constant.ident == name => Some(constant),
            _ => None,
        });
        match declared {
            Some(constant) => {
                let found = match constant.expr.as_ref() {
                    syn::Expr::Lit(syn::ExprLit {
                        lit: syn::Lit::Int(int),
                        ..
                    }) => int.base10_parse::<i64>().ok(),
                    _ => None,
                };
                if found != Some(*value) {
                    let expr = &constant.expr;
                    return Err(Error(format!(
                        "cuda.h: {name} is {} where codegen/src/compat.rs has {value}",
                        quote!(#expr)
                    )));
                }
            }
            None => {
                let name = format_ident!("{name}");
                let ty = format_ident!("{ty}");
                let value = proc_macro2::Literal::i64_unsuffixed(*value);
                let item: syn::Item = syn::parse2(quote! {
                    #[doc = "Not in these headers: a newer release's value (see vgpu-codegen's compat)."]
                    #[allow(dead_code)]
                    pub const #name: #ty = #value;
                })
                .map_err(|e| Error(format!("constant {name}: {e}")))?;
                generated.push(item);
            }
        }
    }
    Ok(generated)
}

struct Found {
    /// Field names from the struct to the field.
    path: Vec<String>,
    ty: syn::Type,
    /// Whether the path crosses a union (the read is then unsafe).
    through_union: bool,
}

/// Looks for `field` in the struct or union `owner`, then in its anonymous members.
fn find(items: &[syn::Item], owner: &str, field: &str, depth: usize) -> Option<Found> {
    const MAX_DEPTH: usize = 4;
    let (named, is_union): (Vec<&syn::Field>, bool) = items.iter().find_map(|item| match item {
        syn::Item::Struct(s) if s.ident == owner => match &s.fields {
            syn::Fields::Named(named) => Some((named.named.iter().collect(), false)),
            _ => None,
        },
        syn::Item::Union(u) if u.ident == owner => Some((u.fields.named.iter().collect(), true)),
        _ => None,
    })?;
    if let Some(direct) = named.iter().find(|f| f.ident.as_ref().is_some_and(|i| i == field)) {
        return Some(Found {
            path: vec![field.to_string()],
            ty: direct.ty.clone(),
            through_union: is_union,
        });
    }
    if depth >= MAX_DEPTH {
        return None;
    }
    for member in named {
        let Some(name) = member.ident.as_ref().map(ToString::to_string) else {
            continue;
        };
        if !name.starts_with("__bindgen_anon_") {
            continue;
        }
        let syn::Type::Path(ty) = &member.ty else { continue };
        let Some(inner) = ty.path.segments.last().map(|s| s.ident.to_string()) else {
            continue;
        };
        if let Some(mut found) = find(items, &inner, field, depth + 1) {
            found.path.insert(0, name);
            found.through_union |= is_union;
            return Some(found);
        }
    }
    None
}

/// Integer and floating-point types (as bindgen writes them), for which any bits are a value.
fn is_plain_number(ty: &syn::Type) -> bool {
    const NUMBERS: &[&str] = &[
        "c_char",
        "c_schar",
        "c_uchar",
        "c_short",
        "c_ushort",
        "c_int",
        "c_uint",
        "c_long",
        "c_ulong",
        "c_longlong",
        "c_ulonglong",
        "c_float",
        "c_double",
        "i8",
        "u8",
        "i16",
        "u16",
        "i32",
        "u32",
        "i64",
        "u64",
        "isize",
        "usize",
        "f32",
        "f64",
    ];
    matches!(ty, syn::Type::Path(path) if path.path.segments.last().is_some_and(|s| NUMBERS.contains(&s.ident.to_string().as_str())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(source: &str) -> Vec<syn::Item> {
        syn::parse_file(source).map(|f| f.items).unwrap_or_default()
    }

    #[test]
    fn reaches_a_direct_field_and_one_in_an_anonymous_union() {
        let direct = items("pub struct CUmemLocation_st { pub type_: u32, pub id: ::std::os::raw::c_int }");
        let found = find(&direct, "CUmemLocation_st", "id", 0).map(|f| (f.path, f.through_union));
        assert_eq!(found, Some((vec!["id".to_string()], false)));
        let nested = items(
            "pub struct CUmemLocation_st { pub type_: u32, pub __bindgen_anon_1: CUmemLocation_st__bindgen_ty_1 }
             pub union CUmemLocation_st__bindgen_ty_1 { pub id: ::std::os::raw::c_int, pub localized: Pair }",
        );
        let found = find(&nested, "CUmemLocation_st", "id", 0).map(|f| (f.path, f.through_union));
        assert_eq!(
            found,
            Some((vec!["__bindgen_anon_1".to_string(), "id".to_string()], true))
        );
        let generated = generate(&nested).map(|items| quote!(#(#items)*).to_string());
        assert!(
            generated
                .as_deref()
                .is_ok_and(|text| text.contains("unsafe { self . __bindgen_anon_1 . id }")),
            "{generated:?}"
        );
    }

    #[test]
    fn constants_are_defined_where_missing_and_checked_where_declared() {
        let missing = constants(&items("pub type CUmemLocationType = u32;")).map(|items| items.len());
        assert_eq!(missing.ok(), Some(1));
        let right = items("pub const CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN: CUmemLocationType_enum = 6;");
        assert_eq!(constants(&right).map(|items| items.len()).ok(), Some(0));
        let wrong = items("pub const CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN: CUmemLocationType_enum = 7;");
        let error = constants(&wrong).err().map(|e| e.0).unwrap_or_default();
        assert!(error.contains("where codegen/src/compat.rs has 6"), "{error}");
    }

    #[test]
    fn a_missing_field_names_the_struct() {
        let error = generate(&items("pub struct CUmemLocation_st { pub type_: u32 }"))
            .err()
            .map(|e| e.0)
            .unwrap_or_default();
        assert!(error.contains("struct CUmemLocation_st has no field `id`"), "{error}");
    }
}
