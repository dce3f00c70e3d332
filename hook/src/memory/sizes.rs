//! Device memory an array takes, estimated from its descriptor before the driver is asked (the
//! charge must be reserved first). Where the driver can say the real size afterwards
//! (`cuArrayGetMemoryRequirements`) the charge is corrected.

use crate::sys::cuda::*;

/// Arrays are placed at this granularity.
pub const ARRAY_GRANULARITY: u64 = 2 << 20;

/// Bytes per element of one channel, by format; block-compressed and planar video formats are
/// given the bytes of their widest plane per pixel.
pub fn format_bytes(format: CUarray_format) -> u64 {
    match format {
        CU_AD_FORMAT_UNSIGNED_INT8
        | CU_AD_FORMAT_SIGNED_INT8
        | CU_AD_FORMAT_UNORM_INT8X1
        | CU_AD_FORMAT_SNORM_INT8X1 => 1,
        CU_AD_FORMAT_UNSIGNED_INT16 | CU_AD_FORMAT_SIGNED_INT16 | CU_AD_FORMAT_HALF => 2,
        CU_AD_FORMAT_UNSIGNED_INT32 | CU_AD_FORMAT_SIGNED_INT32 | CU_AD_FORMAT_FLOAT => 4,
        // Anything else (packed, video, block-compressed): the widest element we know, so the
        // estimate errs towards charging more.
        _ => 16,
    }
}

/// Bytes of a `width x height x depth` array of `channels` channels, rounded up to the
/// granularity; `None` when it overflows (the driver refuses such an array anyway).
pub fn array_bytes(width: u64, height: u64, depth: u64, format: CUarray_format, channels: u64) -> Option<u64> {
    let raw = width
        .checked_mul(height.max(1))?
        .checked_mul(depth.max(1))?
        .checked_mul(channels.max(1))?
        .checked_mul(format_bytes(format))?;
    raw.checked_next_multiple_of(ARRAY_GRANULARITY)
}

/// Bytes of a mipmapped array: each level halves every extent (never below 1).
pub fn mipmapped_bytes(descriptor: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> Option<u64> {
    let (mut width, mut height, mut depth) = (
        descriptor.Width as u64,
        descriptor.Height as u64,
        descriptor.Depth as u64,
    );
    let mut total: u64 = 0;
    for _ in 0..levels.max(1) {
        let level = array_bytes(
            width,
            height,
            depth,
            descriptor.Format,
            u64::from(descriptor.NumChannels),
        )?;
        total = total.checked_add(level)?;
        width = (width / 2).max(1);
        height = if height == 0 { 0 } else { (height / 2).max(1) };
        depth = if depth == 0 { 0 } else { (depth / 2).max(1) };
    }
    Some(total)
}

/// The descriptor types of the array entry points, 2D and 3D, current and legacy.
pub trait ArrayDescriptor {
    fn bytes(&self) -> Option<u64>;
}

impl ArrayDescriptor for CUDA_ARRAY_DESCRIPTOR {
    fn bytes(&self) -> Option<u64> {
        array_bytes(
            self.Width as u64,
            self.Height as u64,
            1,
            self.Format,
            u64::from(self.NumChannels),
        )
    }
}

impl ArrayDescriptor for CUDA_ARRAY_DESCRIPTOR_v1 {
    fn bytes(&self) -> Option<u64> {
        array_bytes(
            u64::from(self.Width),
            u64::from(self.Height),
            1,
            self.Format,
            u64::from(self.NumChannels),
        )
    }
}

impl ArrayDescriptor for CUDA_ARRAY3D_DESCRIPTOR {
    fn bytes(&self) -> Option<u64> {
        array_bytes(
            self.Width as u64,
            self.Height as u64,
            self.Depth as u64,
            self.Format,
            u64::from(self.NumChannels),
        )
    }
}

impl ArrayDescriptor for CUDA_ARRAY3D_DESCRIPTOR_v1 {
    fn bytes(&self) -> Option<u64> {
        array_bytes(
            u64::from(self.Width),
            u64::from(self.Height),
            u64::from(self.Depth),
            self.Format,
            u64::from(self.NumChannels),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_to_granularity() {
        assert_eq!(array_bytes(1024, 1024, 1, CU_AD_FORMAT_FLOAT, 4), Some(16 << 20));
        assert_eq!(
            array_bytes(1, 0, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1),
            Some(ARRAY_GRANULARITY)
        );
        assert_eq!(array_bytes(u64::MAX, 2, 1, CU_AD_FORMAT_FLOAT, 1), None);
    }

    #[test]
    fn mipmap_levels_shrink() {
        let descriptor = CUDA_ARRAY3D_DESCRIPTOR {
            Width: 4096,
            Height: 4096,
            Depth: 0,
            Format: CU_AD_FORMAT_UNSIGNED_INT8,
            NumChannels: 4,
            Flags: 0,
        };
        // 64 MiB, 16 MiB, 4 MiB, then 1 MiB rounded up to 2 MiB.
        assert_eq!(mipmapped_bytes(&descriptor, 4), Some((64 + 16 + 4 + 2) << 20));
    }
}
