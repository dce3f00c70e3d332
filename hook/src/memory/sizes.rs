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

/// Bytes of a mipmapped array: each level halves every extent (never below 1), except the layer
/// count of a layered or cubemap array, which every level keeps.
///
/// At most 1 + floor(log2(largest extent)) levels are counted, the most an array can have (the
/// driver refuses more; its documentation says it clamps to that): a hostile count such as
/// 2^32 - 1 must cost at most 64 steps here, not one per requested level, and if the driver does
/// clamp, the charge is what it allocates.
pub fn mipmapped_bytes(descriptor: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> Option<u64> {
    let layers_kept = descriptor.Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
    let (mut width, mut height, mut depth) = (
        descriptor.Width as u64,
        descriptor.Height as u64,
        descriptor.Depth as u64,
    );
    let largest = if layers_kept {
        width.max(height)
    } else {
        width.max(height).max(depth)
    };
    let most_levels = largest.max(1).ilog2() + 1;
    let halve = |extent: u64| if extent == 0 { 0 } else { (extent / 2).max(1) };
    let mut total: u64 = 0;
    for _ in 0..levels.clamp(1, most_levels) {
        let level = array_bytes(
            width,
            height,
            depth,
            descriptor.Format,
            u64::from(descriptor.NumChannels),
        )?;
        total = total.checked_add(level)?;
        width = halve(width).max(1);
        height = halve(height);
        if !layers_kept {
            depth = halve(depth);
        }
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

    /// A 4096 x 4096 RGBA8 2D array: 64 MiB at its first level.
    const RGBA8_4096: CUDA_ARRAY3D_DESCRIPTOR = CUDA_ARRAY3D_DESCRIPTOR {
        Width: 4096,
        Height: 4096,
        Depth: 0,
        Format: CU_AD_FORMAT_UNSIGNED_INT8,
        NumChannels: 4,
        Flags: 0,
    };

    #[test]
    fn mipmap_levels_shrink() {
        let descriptor = RGBA8_4096;
        // 64 MiB, 16 MiB, 4 MiB, then 1 MiB rounded up to 2 MiB.
        assert_eq!(mipmapped_bytes(&descriptor, 4), Some((64 + 16 + 4 + 2) << 20));
    }

    #[test]
    fn mipmap_levels_stop_at_the_most_an_array_can_have() {
        let descriptor = RGBA8_4096;
        // 4096 has 13 levels: 64 + 16 + 4 MiB, then ten levels of 2 MiB or less, 2 MiB each.
        let full = Some((64 + 16 + 4 + 10 * 2) << 20);
        assert_eq!(mipmapped_bytes(&descriptor, 13), full);
        for levels in [14, 64, 65, 1 << 31, u32::MAX] {
            assert_eq!(mipmapped_bytes(&descriptor, levels), full, "{levels} levels");
        }
        // No levels is one, as the driver's documented clamp has it.
        assert_eq!(mipmapped_bytes(&descriptor, 0), mipmapped_bytes(&descriptor, 1));
        // The widest extent possible: 64 levels at most.
        let widest = CUDA_ARRAY3D_DESCRIPTOR {
            Width: usize::MAX,
            Height: 0,
            Depth: 0,
            Format: CU_AD_FORMAT_UNSIGNED_INT8,
            NumChannels: 1,
            Flags: 0,
        };
        assert_eq!(
            mipmapped_bytes(&widest, u32::MAX),
            None,
            "overflows: the driver's answer"
        );
        let one = CUDA_ARRAY3D_DESCRIPTOR { Width: 1, ..widest };
        assert_eq!(mipmapped_bytes(&one, u32::MAX), Some(ARRAY_GRANULARITY));
    }

    #[test]
    fn mipmap_layers_are_kept_at_every_level() {
        let layered = CUDA_ARRAY3D_DESCRIPTOR {
            Width: 1024,
            Height: 1024,
            Depth: 64,
            Format: CU_AD_FORMAT_UNSIGNED_INT8,
            NumChannels: 1,
            Flags: CUDA_ARRAY3D_LAYERED,
        };
        // 64 MiB, then 16 and 4 MiB: the 64 layers stay.
        assert_eq!(mipmapped_bytes(&layered, 3), Some((64 + 16 + 4) << 20));
        // The layers do not add levels: 1024 has 11.
        assert_eq!(mipmapped_bytes(&layered, 12), mipmapped_bytes(&layered, 11));
        let volume = CUDA_ARRAY3D_DESCRIPTOR { Flags: 0, ..layered };
        // 64 MiB, then 1024 x 1024 x 64 / 8 = 8 MiB, then 1 MiB rounded up to 2 MiB.
        assert_eq!(mipmapped_bytes(&volume, 3), Some((64 + 8 + 2) << 20));
    }
}
