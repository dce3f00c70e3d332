//! The exported `dlsym`.
//!
//! It must stay transparent: `dlsym(RTLD_NEXT, ...)` is resolved relative to its caller's return
//! address, and other interposers rely on that. A Rust function cannot forward its caller's return
//! address, so `dlsym` is a naked trampoline: it asks [`lookup`] whether the name is one of our
//! exports (then returns our wrapper, whatever the handle) and otherwise jumps to the real `dlsym`
//! with the stack exactly as the caller left it. Nothing on this path allocates: glibc's own dlsym
//! may call calloc, and an allocator that interposes itself may call dlsym.

use crate::hooks::EXPORTS;
use crate::real::resolve_real_dlsym;
use std::ffi::{CStr, c_char, c_void};

/// Compares a C string with an export name without computing its length first.
///
/// # Safety
/// `symbol` must point to a NUL-terminated string.
unsafe fn compare(symbol: *const c_char, name: &CStr) -> std::cmp::Ordering {
    let name = name.to_bytes_with_nul();
    let mut index = 0;
    loop {
        // SAFETY: index never passes the NUL of `symbol`: we stop at the first difference, and
        // `name` ends in NUL, so equal bytes stop there at the latest.
        let byte = unsafe { *symbol.add(index) } as u8;
        let expected = name[index];
        if byte != expected || byte == 0 {
            return byte.cmp(&expected);
        }
        index += 1;
    }
}

/// Our wrapper for `symbol`, or null when the name is not one of our exports.
///
/// # Safety
/// `symbol` must be null or point to a NUL-terminated string.
pub unsafe fn find_export(symbol: *const c_char) -> Option<&'static crate::real::Export> {
    if symbol.is_null() {
        return None;
    }
    // SAFETY: symbol is non-null and NUL-terminated per the contract, so its first byte exists.
    let first = unsafe { *symbol } as u8;
    if first != b'c' && first != b'n' {
        return None;
    }
    let mut low = 0;
    let mut high = EXPORTS.len();
    while low < high {
        let middle = (low + high) / 2;
        // SAFETY: per the contract.
        match unsafe { compare(symbol, EXPORTS[middle].name) } {
            std::cmp::Ordering::Equal => return Some(&EXPORTS[middle]),
            // `symbol` sorts after the middle name.
            std::cmp::Ordering::Greater => low = middle + 1,
            std::cmp::Ordering::Less => high = middle,
        }
    }
    None
}

/// Called by the trampoline with dlsym's arguments: our wrapper, or null after making sure the
/// real `dlsym` is known so the trampoline can jump to it. A driver name we do not export (a
/// driver newer than our headers) is reported once ([`super::unmapped`]).
#[cfg_attr(test, allow(dead_code))]
extern "C" fn lookup(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // SAFETY: dlsym's contract makes `symbol` a NUL-terminated string (or null, handled).
    if let Some(export) = unsafe { find_export(symbol) } {
        return export.wrapper as *mut c_void;
    }
    resolve_real_dlsym();
    if !symbol.is_null() {
        // A panic must not unwind into the trampoline: the report is skipped then.
        // SAFETY: symbol is non-null and NUL-terminated (dlsym's contract).
        let _ = std::panic::catch_unwind(|| unsafe { super::unmapped::check_dlsym(handle, symbol) });
    }
    std::ptr::null_mut()
}

#[cfg(all(target_arch = "x86_64", not(test)))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
/// # Safety
/// As glibc's `dlsym`.
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Save the arguments, align the stack for the call (entry rsp is 8 mod 16; two pushes and
    // 8 more make it 0), ask `lookup` with the same two arguments, restore, and either return its
    // answer or tail-jump to the real dlsym with the caller's return address still on top of the
    // stack.
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {lookup}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "ret",
        "2:",
        "jmp qword ptr [rip + {real}]",
        lookup = sym lookup,
        real = sym crate::real::REAL_DLSYM,
    )
}

#[cfg(all(target_arch = "aarch64", not(test)))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
/// # Safety
/// As glibc's `dlsym`.
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Same as on x86_64: the link register is restored before the tail branch, so the real dlsym
    // sees the caller's return address.
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "stp x0, x1, [sp, #16]",
        "mov x29, sp",
        "bl {lookup}",
        "mov x2, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "cbz x2, 2f",
        "mov x0, x2",
        "ret",
        "2:",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "br x16",
        lookup = sym lookup,
        real = sym crate::real::REAL_DLSYM,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_are_sorted_and_found() {
        for pair in EXPORTS.windows(2) {
            assert!(
                pair[0].name < pair[1].name,
                "{:?} before {:?}",
                pair[0].name,
                pair[1].name
            );
        }
        for export in EXPORTS.iter() {
            // SAFETY: export names are NUL-terminated.
            let found = unsafe { find_export(export.name.as_ptr()) };
            assert!(found.is_some_and(|f| std::ptr::eq(f, export)), "{:?}", export.name);
        }
    }

    #[test]
    fn foreign_names_are_not_ours() {
        for name in [c"malloc", c"cuInitX", c"cu", c"", c"nvmlInit_v3", c"cuinit"] {
            // SAFETY: NUL-terminated literals.
            assert!(unsafe { find_export(name.as_ptr()) }.is_none(), "{name:?}");
        }
        // SAFETY: null is allowed.
        assert!(unsafe { find_export(std::ptr::null()) }.is_none());
    }
}
