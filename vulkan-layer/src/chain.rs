//! Walking `pNext` chains.

use std::ffi::c_void;

use ash::vk;

/// The first structure of type `s_type` in the chain starting at `next`, or null.
///
/// # Safety
/// `next` is null or points to a valid chain of Vulkan structures, as the API requires.
pub unsafe fn find(mut next: *const c_void, s_type: vk::StructureType) -> *const vk::BaseInStructure<'static> {
    while !next.is_null() {
        let base = next.cast::<vk::BaseInStructure<'static>>();
        // SAFETY: every structure of a chain begins with sType and pNext (the caller's promise).
        let (found, following) = unsafe { ((*base).s_type, (*base).p_next) };
        if found == s_type {
            return base;
        }
        next = following.cast();
    }
    std::ptr::null()
}

/// Whether an allocation's chain imports memory that exists already (another API's or another
/// process's allocation, or host memory): it is charged where it was made, never here.
///
/// # Safety
/// As [`find`].
pub unsafe fn imports_memory(next: *const c_void) -> bool {
    const IMPORTS: [vk::StructureType; 9] = [
        vk::StructureType::IMPORT_MEMORY_FD_INFO_KHR,
        vk::StructureType::IMPORT_MEMORY_HOST_POINTER_INFO_EXT,
        vk::StructureType::IMPORT_MEMORY_WIN32_HANDLE_INFO_KHR,
        vk::StructureType::IMPORT_MEMORY_WIN32_HANDLE_INFO_NV,
        vk::StructureType::IMPORT_ANDROID_HARDWARE_BUFFER_INFO_ANDROID,
        vk::StructureType::IMPORT_MEMORY_ZIRCON_HANDLE_INFO_FUCHSIA,
        vk::StructureType::IMPORT_MEMORY_BUFFER_COLLECTION_FUCHSIA,
        vk::StructureType::IMPORT_SCREEN_BUFFER_INFO_QNX,
        vk::StructureType::IMPORT_METAL_BUFFER_INFO_EXT,
    ];
    let mut next = next;
    while !next.is_null() {
        let base = next.cast::<vk::BaseInStructure<'static>>();
        // SAFETY: as in `find`.
        let (s_type, following) = unsafe { ((*base).s_type, (*base).p_next) };
        if s_type == vk::StructureType::IMPORT_MEMORY_FD_INFO_KHR {
            // SAFETY: a structure of this type is a VkImportMemoryFdInfoKHR.
            let handle_type = unsafe { (*base.cast::<vk::ImportMemoryFdInfoKHR<'static>>()).handle_type };
            // A zero handle type imports nothing (the spec's own rule).
            if !handle_type.is_empty() {
                return true;
            }
        } else if s_type == vk::StructureType::IMPORT_MEMORY_WIN32_HANDLE_INFO_KHR {
            // SAFETY: a structure of this type is a VkImportMemoryWin32HandleInfoKHR.
            let handle_type = unsafe { (*base.cast::<vk::ImportMemoryWin32HandleInfoKHR<'static>>()).handle_type };
            if !handle_type.is_empty() {
                return true;
            }
        } else if IMPORTS.contains(&s_type) {
            return true;
        }
        next = following.cast();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imports_are_found_anywhere_in_the_chain_and_a_zero_handle_type_imports_nothing() {
        // export -> dedicated -> fd, with handle type 0 and then OPAQUE_FD.
        for (handle_type, imports) in [
            (vk::ExternalMemoryHandleTypeFlags::empty(), false),
            (vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD, true),
        ] {
            let fd = vk::ImportMemoryFdInfoKHR::default().fd(3).handle_type(handle_type);
            let dedicated = vk::MemoryDedicatedAllocateInfo {
                p_next: std::ptr::from_ref(&fd).cast(),
                ..Default::default()
            };
            let head = vk::ExportMemoryAllocateInfo {
                p_next: std::ptr::from_ref(&dedicated).cast(),
                ..Default::default()
            };
            let chain = std::ptr::from_ref(&head).cast::<c_void>();
            // SAFETY: a valid chain of locals.
            assert_eq!(unsafe { imports_memory(chain) }, imports);
            // SAFETY: as above.
            let found = unsafe { find(chain, vk::StructureType::MEMORY_DEDICATED_ALLOCATE_INFO) };
            assert_eq!(found.cast::<c_void>(), std::ptr::from_ref(&dedicated).cast());
        }
        // SAFETY: a null chain.
        assert!(unsafe { find(std::ptr::null(), vk::StructureType::MEMORY_DEDICATED_ALLOCATE_INFO) }.is_null());
        let host = vk::ImportMemoryHostPointerInfoEXT::default();
        // SAFETY: a chain of one local.
        assert!(unsafe { imports_memory(std::ptr::from_ref(&host).cast()) });
    }
}
