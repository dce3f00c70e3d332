//! Initialisation, versions, devices, error strings and the export table.

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::config::uuid_bytes;
use crate::cuda::*;
use crate::ffi::{CuResult, cu, put, write_c_string};
use crate::state::{self, initialised};

pub const DRIVER_VERSION: c_int = 13000;
pub const DEVICE_NAME: &str = "NVIDIA H200 (vgpu fake)";

/// The PCI bus id of a physical device, as CUDA and NVML report it.
pub fn pci_bus_id(phys: usize) -> String {
    format!("00000000:{:02X}:00.0", 0x18 + phys)
}

/// The value of a device attribute; unknown attributes are 0.
pub fn attribute(attrib: CUdevice_attribute, phys: usize) -> c_int {
    match attrib {
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X | CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y => 1024,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z => 64,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X => i32::MAX,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y | CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z => 65535,
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK => 49152,
        CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY => 65536,
        CU_DEVICE_ATTRIBUTE_WARP_SIZE => 32,
        CU_DEVICE_ATTRIBUTE_MAX_PITCH => i32::MAX,
        CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK | CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR => 65536,
        CU_DEVICE_ATTRIBUTE_CLOCK_RATE => 1_980_000,
        CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT => 512,
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => 132,
        CU_DEVICE_ATTRIBUTE_COMPUTE_MODE => 0,
        CU_DEVICE_ATTRIBUTE_PCI_BUS_ID => 0x18 + phys as c_int,
        CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID | CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID => 0,
        CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE => 2_619_000,
        CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH => 6144,
        CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE => 50 << 20,
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR => 2048,
        CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT => 3,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 9,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => 0,
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR => 233_472,
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => 232_448,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO => 2,
        CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES => 1,
        CU_DEVICE_ATTRIBUTE_GPU_OVERLAP
        | CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY
        | CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS
        | CU_DEVICE_ATTRIBUTE_ECC_ENABLED
        | CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
        | CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY
        | CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS
        | CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
        | CU_DEVICE_ATTRIBUTE_COOPERATIVE_MULTI_DEVICE_LAUNCH
        | CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH => 1,
        _ => 0,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(Flags: c_uint) -> CUresult {
    cu(|| {
        if Flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        state::lock().initialise()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(driverVersion: *mut c_int) -> CUresult {
    // SAFETY: out-pointer from the caller.
    cu(|| unsafe { put(driverVersion, DRIVER_VERSION) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    cu(|| {
        let state = initialised()?;
        state.device(ordinal)?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(device, ordinal) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    cu(|| {
        state::ensure_initialised()?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(count, state::config().visible.len() as c_int) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    cu(|| {
        initialised()?.device(dev)?;
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's buffer holds `len` bytes.
        unsafe { write_c_string(name, len, DEVICE_NAME) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(pi: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice) -> CUresult {
    cu(|| {
        let phys = initialised()?.device(dev)?;
        if attrib >= CU_DEVICE_ATTRIBUTE_MAX {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: out-pointer from the caller.
        unsafe { put(pi, attribute(attrib, phys)) }
    })
}

fn get_uuid(uuid: *mut CUuuid, dev: CUdevice) -> CuResult {
    let phys = initialised()?.device(dev)?;
    let bytes = uuid_bytes(phys).map(|b| b as c_char);
    // SAFETY: out-pointer from the caller.
    unsafe { put(uuid, CUuuid { bytes }) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    cu(|| get_uuid(uuid, dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    cu(|| get_uuid(uuid, dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    cu(|| {
        let state = initialised()?;
        let total = state.capacity(state.device(dev)?);
        // SAFETY: out-pointer from the caller.
        unsafe { put(bytes, usize::try_from(total).unwrap_or(usize::MAX)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) -> CUresult {
    cu(|| {
        let state = initialised()?;
        let total = state.capacity(state.device(dev)?);
        // SAFETY: out-pointer from the caller.
        unsafe { put(bytes, c_uint::try_from(total).unwrap_or(c_uint::MAX)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(pciBusId: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    cu(|| {
        let phys = initialised()?.device(dev)?;
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if pciBusId.is_null() || len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's buffer holds `len` bytes.
        unsafe { write_c_string(pciBusId, len, &pci_bus_id(phys)) };
        Ok(())
    })
}

/// Name and description of the error codes the fake returns.
fn error_text(error: CUresult) -> Option<(&'static std::ffi::CStr, &'static std::ffi::CStr)> {
    Some(match error {
        CUDA_SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        CUDA_ERROR_INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        CUDA_ERROR_OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        CUDA_ERROR_NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        CUDA_ERROR_DEINITIALIZED => (c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
        CUDA_ERROR_NO_DEVICE => (c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
        CUDA_ERROR_INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        CUDA_ERROR_INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        CUDA_ERROR_INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        CUDA_ERROR_ILLEGAL_STATE => (
            c"CUDA_ERROR_ILLEGAL_STATE",
            c"the operation cannot be performed in the present state",
        ),
        CUDA_ERROR_NOT_FOUND => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        CUDA_ERROR_NOT_READY => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        CUDA_ERROR_NOT_SUPPORTED => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => (
            c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            c"operation not permitted when stream is capturing",
        ),
        CUDA_ERROR_UNKNOWN => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
        _ => return None,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    cu(|| {
        let text = error_text(error).map(|(_, text)| text.as_ptr());
        // SAFETY: out-pointer from the caller.
        unsafe { put(pStr, text.unwrap_or(std::ptr::null())) }?;
        text.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    cu(|| {
        let name = error_text(error).map(|(name, _)| name.as_ptr());
        // SAFETY: out-pointer from the caller.
        unsafe { put(pStr, name.unwrap_or(std::ptr::null())) }?;
        name.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

/// What `cuGetExportTable` hands out: the address of this static, whatever the id.
pub static EXPORT_TABLE: [usize; 8] = [0; 8];

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetExportTable(
    ppExportTable: *mut *const c_void,
    pExportTableId: *const CUuuid,
) -> CUresult {
    cu(|| {
        if pExportTableId.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: out-pointer from the caller.
        unsafe { put(ppExportTable, EXPORT_TABLE.as_ptr().cast::<c_void>()) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes() {
        assert_eq!(attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0), 9);
        assert_eq!(attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0), 132);
        assert_eq!(attribute(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 2), 0x1a);
        assert_eq!(attribute(CU_DEVICE_ATTRIBUTE_NUMA_ID, 0), 0);
        assert_eq!(pci_bus_id(1), "00000000:19:00.0");
    }
}
