//! The virtual device as Vulkan shows it: device-local heaps no larger than the limit, and a
//! `VK_EXT_memory_budget` budget that leaves no more room than the region does.

use ash::vk;

/// The memory types (as a bit mask, bit `i` for type `i`) whose heap is device-local: an
/// allocation of one of them is device memory, charged to the limit.
pub fn device_local_types(properties: &vk::PhysicalDeviceMemoryProperties) -> u32 {
    let count = (properties.memory_type_count as usize).min(vk::MAX_MEMORY_TYPES);
    properties.memory_types[..count]
        .iter()
        .enumerate()
        .filter(|(_, memory_type)| is_device_local(properties, memory_type.heap_index))
        .fold(0, |mask, (index, _)| mask | (1 << index))
}

fn is_device_local(properties: &vk::PhysicalDeviceMemoryProperties, heap: u32) -> bool {
    let count = (properties.memory_heap_count as usize).min(vk::MAX_MEMORY_HEAPS);
    properties.memory_heaps[..count]
        .get(heap as usize)
        .is_some_and(|heap| heap.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
}

/// Device-local heaps shown at most `limit` bytes (each of them: they all draw on the one limit).
pub fn limit_heaps(properties: &mut vk::PhysicalDeviceMemoryProperties, limit: u64) {
    let count = (properties.memory_heap_count as usize).min(vk::MAX_MEMORY_HEAPS);
    for heap in &mut properties.memory_heaps[..count] {
        if heap.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL) {
            heap.size = heap.size.min(limit);
        }
    }
}

/// `VK_EXT_memory_budget` for the virtual device, after [`limit_heaps`]: on each device-local
/// heap the usage (the process's own, as the driver counts it) is kept within the heap, and the
/// budget leaves at most what the limit leaves to the whole container (`limit - used`, `used`
/// being every process's charges in the region, CUDA's included) on top of it. The driver's budget
/// stays the ceiling when it is lower.
pub fn limit_budget(
    properties: &vk::PhysicalDeviceMemoryProperties,
    budget: &mut vk::PhysicalDeviceMemoryBudgetPropertiesEXT<'_>,
    limit: u64,
    used: u64,
) {
    let left = limit.saturating_sub(used);
    let count = (properties.memory_heap_count as usize).min(vk::MAX_MEMORY_HEAPS);
    for (index, heap) in properties.memory_heaps[..count].iter().enumerate() {
        if !heap.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL) {
            continue;
        }
        let usage = budget.heap_usage[index].min(heap.size);
        budget.heap_usage[index] = usage;
        budget.heap_budget[index] = budget.heap_budget[index].min(usage.saturating_add(left)).min(heap.size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// An NVIDIA-like layout: VRAM, host memory, and the 256 MiB BAR window (device-local and
    /// host-visible).
    fn nvidia_like() -> vk::PhysicalDeviceMemoryProperties {
        let mut properties = vk::PhysicalDeviceMemoryProperties {
            memory_heap_count: 3,
            memory_type_count: 4,
            ..Default::default()
        };
        properties.memory_heaps[0] = vk::MemoryHeap {
            size: 80 * GIB,
            flags: vk::MemoryHeapFlags::DEVICE_LOCAL,
        };
        properties.memory_heaps[1] = vk::MemoryHeap {
            size: 64 * GIB,
            flags: vk::MemoryHeapFlags::empty(),
        };
        properties.memory_heaps[2] = vk::MemoryHeap {
            size: GIB / 4,
            flags: vk::MemoryHeapFlags::DEVICE_LOCAL,
        };
        let types = [
            (0, vk::MemoryPropertyFlags::DEVICE_LOCAL),
            (
                1,
                vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT,
            ),
            (
                2,
                vk::MemoryPropertyFlags::DEVICE_LOCAL | vk::MemoryPropertyFlags::HOST_VISIBLE,
            ),
            (
                1,
                vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_CACHED,
            ),
        ];
        for (index, (heap_index, property_flags)) in types.into_iter().enumerate() {
            properties.memory_types[index] = vk::MemoryType {
                property_flags,
                heap_index,
            };
        }
        properties
    }

    #[test]
    fn types_on_device_local_heaps_are_charged_host_ones_are_not() {
        assert_eq!(device_local_types(&nvidia_like()), 0b0101);
        // A type naming a heap past the count is not device-local.
        let mut broken = nvidia_like();
        broken.memory_types[3].heap_index = 7;
        broken.memory_heap_count = 2;
        assert_eq!(device_local_types(&broken), 0b0001);
    }

    #[test]
    fn device_local_heaps_show_at_most_the_limit() {
        let mut properties = nvidia_like();
        limit_heaps(&mut properties, 4 * GIB);
        let sizes: Vec<u64> = properties.memory_heaps[..3].iter().map(|heap| heap.size).collect();
        assert_eq!(sizes, [4 * GIB, 64 * GIB, GIB / 4]);
    }

    #[test]
    fn budget_leaves_what_the_container_has_left() {
        let mut properties = nvidia_like();
        limit_heaps(&mut properties, 4 * GIB);
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        budget.heap_budget[..3].copy_from_slice(&[70 * GIB, 60 * GIB, GIB / 4]);
        budget.heap_usage[..3].copy_from_slice(&[GIB, 2 * GIB, 0]);
        // 3 GiB charged in the container, 1 GiB of it by this process on heap 0.
        limit_budget(&properties, &mut budget, 4 * GIB, 3 * GIB);
        assert_eq!(budget.heap_usage[..3], [GIB, 2 * GIB, 0]);
        assert_eq!(budget.heap_budget[..3], [2 * GIB, 60 * GIB, GIB / 4]);
        // Over the limit (another process's charge came in meanwhile): no room, never below use.
        limit_budget(&properties, &mut budget, 4 * GIB, 5 * GIB);
        assert_eq!(budget.heap_budget[0], GIB);
        // A lower budget of the driver's stays.
        budget.heap_budget[0] = GIB + 1;
        limit_budget(&properties, &mut budget, 4 * GIB, 0);
        assert_eq!(budget.heap_budget[0], GIB + 1);
    }
}
