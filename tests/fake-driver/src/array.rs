//! CUDA arrays and mipmapped arrays.
//!
//! Size rule: `Width × max(Height, 1) × max(Depth, 1) × NumChannels × bytes per channel`,
//! rounded up to 2 MiB. Bytes per channel: 1 for 8-bit formats (and the block-compressed and
//! 8-bit video formats), 2 for 16-bit and half formats (and 10/16-bit video formats), 4 for
//! 32-bit and float. NumChannels must be 1, 2 or 4; Width must be non-zero. A mipmapped array
//! charges the sum of its levels (level l: each non-zero extent shifted right by l, at least 1;
//! the layer count of a layered array is not shifted), rounded up to 2 MiB once; more levels
//! than 1 + floor(log2(largest extent)) are `CUDA_ERROR_INVALID_VALUE`, as from the real driver.

use std::ffi::c_uint;

use crate::cuda::*;
use crate::ffi::{CuResult, cu, get, put, round_up};
use crate::state::initialised;

pub const ARRAY_ROUNDING: u64 = 2 << 20;

pub struct Array {
    pub ctx: usize,
    pub phys: usize,
    pub charge: u64,
    pub desc: CUDA_ARRAY3D_DESCRIPTOR,
}

/// Bytes per channel of an array format.
#[allow(non_upper_case_globals)]
pub fn format_bytes(format: CUarray_format) -> Option<u64> {
    Some(match format {
        CU_AD_FORMAT_UNSIGNED_INT8 | CU_AD_FORMAT_SIGNED_INT8 => 1,
        CU_AD_FORMAT_UNSIGNED_INT16 | CU_AD_FORMAT_SIGNED_INT16 | CU_AD_FORMAT_HALF => 2,
        CU_AD_FORMAT_UNSIGNED_INT32 | CU_AD_FORMAT_SIGNED_INT32 | CU_AD_FORMAT_FLOAT => 4,
        CU_AD_FORMAT_UNORM_INT8X1
        | CU_AD_FORMAT_UNORM_INT8X2
        | CU_AD_FORMAT_UNORM_INT8X4
        | CU_AD_FORMAT_SNORM_INT8X1
        | CU_AD_FORMAT_SNORM_INT8X2
        | CU_AD_FORMAT_SNORM_INT8X4
        | CU_AD_FORMAT_UNORM_INT_101010_2 => 1,
        CU_AD_FORMAT_UNORM_INT16X1
        | CU_AD_FORMAT_UNORM_INT16X2
        | CU_AD_FORMAT_UNORM_INT16X4
        | CU_AD_FORMAT_SNORM_INT16X1
        | CU_AD_FORMAT_SNORM_INT16X2
        | CU_AD_FORMAT_SNORM_INT16X4 => 2,
        CU_AD_FORMAT_BC1_UNORM..=CU_AD_FORMAT_BC7_UNORM_SRGB => 1,
        CU_AD_FORMAT_NV12
        | CU_AD_FORMAT_NV16
        | CU_AD_FORMAT_YUY2
        | CU_AD_FORMAT_AYUV
        | CU_AD_FORMAT_Y444_PLANAR8
        | CU_AD_FORMAT_YUV444_8bit_SemiPlanar => 1,
        CU_AD_FORMAT_P010
        | CU_AD_FORMAT_P016
        | CU_AD_FORMAT_P210
        | CU_AD_FORMAT_P216
        | CU_AD_FORMAT_Y210
        | CU_AD_FORMAT_Y216
        | CU_AD_FORMAT_Y410
        | CU_AD_FORMAT_Y416
        | CU_AD_FORMAT_Y444_PLANAR10
        | CU_AD_FORMAT_YUV444_16bit_SemiPlanar => 2,
        _ => return None,
    })
}

/// Unrounded bytes of one array level.
fn raw_bytes(width: u64, height: u64, depth: u64, format: CUarray_format, channels: u32) -> CuResult<u64> {
    let per_channel = format_bytes(format).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if width == 0 || !matches!(channels, 1 | 2 | 4) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    [height.max(1), depth.max(1), u64::from(channels), per_channel]
        .into_iter()
        .try_fold(width, |acc, factor| acc.checked_mul(factor))
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Bytes an array charges.
pub fn array_bytes(desc: &CUDA_ARRAY3D_DESCRIPTOR) -> CuResult<u64> {
    let raw = raw_bytes(
        desc.Width as u64,
        desc.Height as u64,
        desc.Depth as u64,
        desc.Format,
        desc.NumChannels,
    )?;
    round_up(raw, ARRAY_ROUNDING).ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Bytes a mipmapped array of `levels` levels charges.
pub fn mipmap_bytes(desc: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> CuResult<u64> {
    let layered = desc.Flags & CUDA_ARRAY3D_LAYERED != 0;
    // As the real driver: no more levels than halving the largest extent down to 1 gives.
    let largest = if layered {
        desc.Width.max(desc.Height)
    } else {
        desc.Width.max(desc.Height).max(desc.Depth)
    };
    if levels == 0 || levels > largest.max(1).ilog2() + 1 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let shrink = |extent: usize, level: u32| -> u64 {
        if extent == 0 {
            0
        } else {
            ((extent as u64) >> level).max(1)
        }
    };
    let mut total: u64 = 0;
    for level in 0..levels {
        let depth = if layered {
            desc.Depth as u64
        } else {
            shrink(desc.Depth, level)
        };
        let raw = raw_bytes(
            shrink(desc.Width, level),
            shrink(desc.Height, level),
            depth,
            desc.Format,
            desc.NumChannels,
        )?;
        total = total.checked_add(raw).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    }
    round_up(total, ARRAY_ROUNDING).ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

fn create(desc: CUDA_ARRAY3D_DESCRIPTOR, levels: Option<u32>) -> CuResult<usize> {
    let bytes = match levels {
        Some(levels) => mipmap_bytes(&desc, levels)?,
        None => array_bytes(&desc)?,
    };
    let mut state = initialised()?;
    let current = state.current()?;
    state.charge(current.phys, bytes)?;
    let handle = state.new_handle();
    let array = Array {
        ctx: current.ctx,
        phys: current.phys,
        charge: bytes,
        desc,
    };
    match levels {
        Some(_) => state.mipmaps.insert(handle, array),
        None => state.arrays.insert(handle, array),
    };
    Ok(handle)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    pHandle: *mut CUarray,
    pAllocateArray: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    cu(|| {
        if pHandle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a valid descriptor (null is rejected).
        let d = unsafe { get(pAllocateArray) }?;
        let desc = CUDA_ARRAY3D_DESCRIPTOR {
            Width: d.Width,
            Height: d.Height,
            Depth: 0,
            Format: d.Format,
            NumChannels: d.NumChannels,
            Flags: 0,
        };
        let handle = create(desc, None)?;
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(pHandle, handle as CUarray) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    pHandle: *mut CUarray,
    pAllocateArray: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    cu(|| {
        if pHandle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a valid descriptor (null is rejected).
        let desc = unsafe { get(pAllocateArray) }?;
        let handle = create(desc, None)?;
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(pHandle, handle as CUarray) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayGetDescriptor_v2(
    pArrayDescriptor: *mut CUDA_ARRAY_DESCRIPTOR,
    hArray: CUarray,
) -> CUresult {
    cu(|| {
        let state = initialised()?;
        let d = state
            .arrays
            .get(&(hArray as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?
            .desc;
        let desc = CUDA_ARRAY_DESCRIPTOR {
            Width: d.Width,
            Height: d.Height,
            Format: d.Format,
            NumChannels: d.NumChannels,
        };
        // SAFETY: out-pointer from the caller.
        unsafe { put(pArrayDescriptor, desc) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DGetDescriptor_v2(
    pArrayDescriptor: *mut CUDA_ARRAY3D_DESCRIPTOR,
    hArray: CUarray,
) -> CUresult {
    cu(|| {
        let state = initialised()?;
        let desc = state
            .arrays
            .get(&(hArray as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?
            .desc;
        // SAFETY: out-pointer from the caller.
        unsafe { put(pArrayDescriptor, desc) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(hArray: CUarray) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let array = state
            .arrays
            .remove(&(hArray as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        state.uncharge(array.phys, array.charge);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    pHandle: *mut CUmipmappedArray,
    pMipmappedArrayDesc: *const CUDA_ARRAY3D_DESCRIPTOR,
    numMipmapLevels: c_uint,
) -> CUresult {
    cu(|| {
        if pHandle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a valid descriptor (null is rejected).
        let desc = unsafe { get(pMipmappedArrayDesc) }?;
        let handle = create(desc, Some(numMipmapLevels))?;
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(pHandle, handle as CUmipmappedArray) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(hMipmappedArray: CUmipmappedArray) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let array = state
            .mipmaps
            .remove(&(hMipmappedArray as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        state.uncharge(array.phys, array.charge);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(
        w: usize,
        h: usize,
        d: usize,
        format: CUarray_format,
        channels: u32,
        flags: u32,
    ) -> CUDA_ARRAY3D_DESCRIPTOR {
        CUDA_ARRAY3D_DESCRIPTOR {
            Width: w,
            Height: h,
            Depth: d,
            Format: format,
            NumChannels: channels,
            Flags: flags,
        }
    }

    #[test]
    fn array_sizes() {
        let mib = 1 << 20;
        assert_eq!(
            array_bytes(&desc(1, 0, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0)),
            Ok(2 * mib)
        );
        // 1024 x 1024 float4 = 16 MiB.
        assert_eq!(
            array_bytes(&desc(1024, 1024, 0, CU_AD_FORMAT_FLOAT, 4, 0)),
            Ok(16 * mib)
        );
        // 1000 x 1000 x 3 half2 = 12,000,000 bytes -> 12 MiB (12,582,912).
        assert_eq!(array_bytes(&desc(1000, 1000, 3, CU_AD_FORMAT_HALF, 2, 0)), Ok(12 * mib));
        assert_eq!(
            array_bytes(&desc(0, 1, 1, CU_AD_FORMAT_FLOAT, 1, 0)),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(
            array_bytes(&desc(1, 1, 1, CU_AD_FORMAT_FLOAT, 3, 0)),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(array_bytes(&desc(1, 1, 1, 12345, 1, 0)), Err(CUDA_ERROR_INVALID_VALUE));
        let huge = usize::MAX;
        assert_eq!(
            array_bytes(&desc(huge, huge, 0, CU_AD_FORMAT_FLOAT, 4, 0)),
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        );
    }

    #[test]
    fn mipmap_sizes() {
        let mib = 1 << 20;
        // 2048^2 float: 16 MiB + 4 MiB + 1 MiB = 21 MiB -> 22 MiB.
        assert_eq!(
            mipmap_bytes(&desc(2048, 2048, 0, CU_AD_FORMAT_FLOAT, 1, 0), 3),
            Ok(22 * mib)
        );
        // Layered: 6 layers stay 6 at every level.
        assert_eq!(
            mipmap_bytes(
                &desc(1024, 1024, 6, CU_AD_FORMAT_UNSIGNED_INT8, 1, CUDA_ARRAY3D_LAYERED),
                2
            ),
            Ok(8 * mib)
        );
        assert_eq!(
            mipmap_bytes(&desc(16, 16, 0, CU_AD_FORMAT_FLOAT, 1, 0), 0),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        // 16 x 16 has 5 levels; 16 x 16 x 32 has 6, unless the 32 are layers.
        assert_eq!(mipmap_bytes(&desc(16, 16, 0, CU_AD_FORMAT_FLOAT, 1, 0), 5), Ok(2 * mib));
        for levels in [6, 64, u32::MAX] {
            assert_eq!(
                mipmap_bytes(&desc(16, 16, 0, CU_AD_FORMAT_FLOAT, 1, 0), levels),
                Err(CUDA_ERROR_INVALID_VALUE)
            );
        }
        assert_eq!(
            mipmap_bytes(&desc(16, 16, 32, CU_AD_FORMAT_FLOAT, 1, 0), 6),
            Ok(2 * mib)
        );
        assert_eq!(
            mipmap_bytes(&desc(16, 16, 32, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_LAYERED), 6),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
    }
}
