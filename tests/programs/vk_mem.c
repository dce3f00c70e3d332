// Vulkan memory calls (and CUDA interop) driven by commands on stdin, one per line, each answered
// with one line on stdout. Used by the integration tests (fake ICD and fake CUDA driver) and by
// tests/gpu/vulkan.sh (the real ones). Devices are numbered in creation order.
//     instance <minor>             -> instance <VkResult> <physical devices>   Vulkan 1.<minor> instance
//     heaps <phys>                 -> heaps <count> <size0> <size1> ...        vkGetPhysicalDeviceMemoryProperties
//     budget <phys>                -> budget <heap> <size> <budget> <usage>    ...Properties2 with VK_EXT_memory_budget,
//                                                                              the first device-local heap
//     uuid <phys>                  -> uuid <32 hex digits>                     VkPhysicalDeviceIDProperties
//     device <phys>                -> device <VkResult> <index>                external memory fd and budget enabled
//     vkalloc <dev> <kind> <bytes> -> vkalloc <VkResult> <handle>              kind: device (device-local only),
//                                                                              host (host-visible only), bar (both),
//                                                                              export (device, exportable as an fd)
//     vkfree <dev> <handle>        -> vkfree 0
//     vkimport <dev> <handle> <bytes> -> vkimport <VkResult> <handle>          export <handle> as an fd, import it
//     destroy <dev>                -> destroy 0                                vkDestroyDevice
//     cuimport <dev> <handle> <bytes> -> cuimport <CUresult> <ext> <pointer>   export as an fd, cuImportExternalMemory,
//                                                                              cuExternalMemoryGetMappedBuffer
//     cudestroy <ext>              -> cudestroy <CUresult>                     cuDestroyExternalMemory
//     cuinfo                       -> cuinfo <CUresult> <free> <total>         cuMemGetInfo_v2
//     init, ctx <ordinal>, alloc <bytes>, free <pointer>: CUDA, as in commands.h
//     quit                         -> (exits)
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vulkan/vulkan.h>

#include "commands.h"

#define MAX_PHYSICAL 16
#define MAX_DEVICES 16

static VkInstance instance = VK_NULL_HANDLE;
static VkPhysicalDevice physical[MAX_PHYSICAL];
static uint32_t physical_count = 0;
static VkDevice devices[MAX_DEVICES];
static VkPhysicalDeviceMemoryProperties device_memory[MAX_DEVICES];
static int device_count = 0;
static PFN_vkGetMemoryFdKHR get_memory_fd[MAX_DEVICES];

static VkPhysicalDevice physical_at(unsigned long long index) {
    return index < physical_count ? physical[index] : VK_NULL_HANDLE;
}

static VkDevice device_at(unsigned long long index) {
    return index < (unsigned long long)device_count ? devices[index] : VK_NULL_HANDLE;
}

// The first memory type of `kind` on device `index`, or -1.
static int memory_type(int index, const char *kind) {
    const VkPhysicalDeviceMemoryProperties *p = &device_memory[index];
    VkMemoryPropertyFlags local = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, visible = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT;
    for (uint32_t i = 0; i < p->memoryTypeCount; i++) {
        VkMemoryPropertyFlags f = p->memoryTypes[i].propertyFlags;
        int is_local = (f & local) != 0, is_visible = (f & visible) != 0;
        if ((strcmp(kind, "device") == 0 || strcmp(kind, "export") == 0) && is_local && !is_visible) return (int)i;
        if (strcmp(kind, "host") == 0 && !is_local && is_visible) return (int)i;
        if (strcmp(kind, "bar") == 0 && is_local && is_visible) return (int)i;
    }
    return -1;
}

static VkResult allocate(int index, int type, VkDeviceSize bytes, const void *next, VkDeviceMemory *memory) {
    VkMemoryAllocateInfo info = {
        .sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
        .pNext = next,
        .allocationSize = bytes,
        .memoryTypeIndex = (uint32_t)type,
    };
    return vkAllocateMemory(devices[index], &info, NULL, memory);
}

static int export_fd(int index, VkDeviceMemory memory) {
    VkMemoryGetFdInfoKHR info = {
        .sType = VK_STRUCTURE_TYPE_MEMORY_GET_FD_INFO_KHR,
        .memory = memory,
        .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT,
    };
    int fd = -1;
    if (!get_memory_fd[index] || get_memory_fd[index](devices[index], &info, &fd) != VK_SUCCESS) return -1;
    return fd;
}

int main(void) {
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        char command[32] = "", a[64] = "0", b[64] = "0", c[64] = "0";
        if (sscanf(line, "%31s %63s %63s %63s", command, a, b, c) < 1) continue;
        unsigned long long x = strtoull(a, NULL, 10), y = strtoull(b, NULL, 10), z = strtoull(c, NULL, 10);
        if (strcmp(command, "quit") == 0) break;
        if (common_command(command, x)) {
            // answered
        } else if (strcmp(command, "instance") == 0) {
            VkApplicationInfo app = {
                .sType = VK_STRUCTURE_TYPE_APPLICATION_INFO,
                .pApplicationName = "vk_mem",
                .apiVersion = VK_MAKE_API_VERSION(0, 1, (uint32_t)x, 0),
            };
            VkInstanceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &app};
            VkResult result = vkCreateInstance(&info, NULL, &instance);
            physical_count = MAX_PHYSICAL;
            if (result == VK_SUCCESS) {
                vkEnumeratePhysicalDevices(instance, &physical_count, physical);
            } else {
                physical_count = 0;
            }
            printf("instance %d %u\n", (int)result, physical_count);
        } else if (strcmp(command, "heaps") == 0) {
            VkPhysicalDeviceMemoryProperties p;
            memset(&p, 0, sizeof p);
            if (physical_at(x)) vkGetPhysicalDeviceMemoryProperties(physical_at(x), &p);
            printf("heaps %u", p.memoryHeapCount);
            for (uint32_t i = 0; i < p.memoryHeapCount; i++) printf(" %llu", (unsigned long long)p.memoryHeaps[i].size);
            printf("\n");
        } else if (strcmp(command, "budget") == 0) {
            VkPhysicalDeviceMemoryBudgetPropertiesEXT budget = {
                .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT};
            VkPhysicalDeviceMemoryProperties2 p = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
                                                   .pNext = &budget};
            if (physical_at(x)) vkGetPhysicalDeviceMemoryProperties2(physical_at(x), &p);
            int heap = -1;
            for (uint32_t i = 0; i < p.memoryProperties.memoryHeapCount && heap < 0; i++)
                if (p.memoryProperties.memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) heap = (int)i;
            if (heap < 0) {
                printf("budget -1 0 0 0\n");
            } else {
                printf("budget %d %llu %llu %llu\n", heap,
                       (unsigned long long)p.memoryProperties.memoryHeaps[heap].size,
                       (unsigned long long)budget.heapBudget[heap], (unsigned long long)budget.heapUsage[heap]);
            }
        } else if (strcmp(command, "uuid") == 0) {
            VkPhysicalDeviceIDProperties id = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES};
            VkPhysicalDeviceProperties2 p = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &id};
            if (physical_at(x)) vkGetPhysicalDeviceProperties2(physical_at(x), &p);
            printf("uuid ");
            for (int i = 0; i < VK_UUID_SIZE; i++) printf("%02x", id.deviceUUID[i]);
            printf("\n");
        } else if (strcmp(command, "device") == 0) {
            float priority = 1.0f;
            VkDeviceQueueCreateInfo queue = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                             .queueFamilyIndex = 0,
                                             .queueCount = 1,
                                             .pQueuePriorities = &priority};
            const char *extensions[] = {"VK_KHR_external_memory_fd", "VK_EXT_memory_budget"};
            VkDeviceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
                                       .queueCreateInfoCount = 1,
                                       .pQueueCreateInfos = &queue,
                                       .enabledExtensionCount = 2,
                                       .ppEnabledExtensionNames = extensions};
            VkResult result = VK_ERROR_INITIALIZATION_FAILED;
            int index = device_count;
            if (physical_at(x) && index < MAX_DEVICES) {
                result = vkCreateDevice(physical_at(x), &info, NULL, &devices[index]);
            }
            if (result == VK_SUCCESS) {
                vkGetPhysicalDeviceMemoryProperties(physical_at(x), &device_memory[index]);
                get_memory_fd[index] = (PFN_vkGetMemoryFdKHR)vkGetDeviceProcAddr(devices[index], "vkGetMemoryFdKHR");
                device_count++;
            }
            printf("device %d %d\n", (int)result, result == VK_SUCCESS ? index : -1);
        } else if (strcmp(command, "vkalloc") == 0) {
            int type = device_at(x) ? memory_type((int)x, b) : -1;
            VkExportMemoryAllocateInfo export = {.sType = VK_STRUCTURE_TYPE_EXPORT_MEMORY_ALLOCATE_INFO,
                                                 .handleTypes = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT};
            VkDeviceMemory memory = VK_NULL_HANDLE;
            VkResult result = VK_ERROR_FEATURE_NOT_PRESENT;
            if (type >= 0) result = allocate((int)x, type, z, strcmp(b, "export") == 0 ? &export : NULL, &memory);
            printf("vkalloc %d %llu\n", (int)result, (unsigned long long)(uintptr_t)memory);
        } else if (strcmp(command, "vkfree") == 0) {
            if (device_at(x)) vkFreeMemory(devices[x], (VkDeviceMemory)(uintptr_t)y, NULL);
            printf("vkfree 0\n");
        } else if (strcmp(command, "vkimport") == 0) {
            int fd = device_at(x) ? export_fd((int)x, (VkDeviceMemory)(uintptr_t)y) : -1;
            VkImportMemoryFdInfoKHR import = {.sType = VK_STRUCTURE_TYPE_IMPORT_MEMORY_FD_INFO_KHR,
                                              .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT,
                                              .fd = fd};
            VkDeviceMemory memory = VK_NULL_HANDLE;
            VkResult result = VK_ERROR_INVALID_EXTERNAL_HANDLE;
            int type = device_at(x) ? memory_type((int)x, "device") : -1;
            if (fd >= 0 && type >= 0) result = allocate((int)x, type, z, &import, &memory);
            printf("vkimport %d %llu\n", (int)result, (unsigned long long)(uintptr_t)memory);
        } else if (strcmp(command, "destroy") == 0) {
            if (device_at(x)) {
                vkDestroyDevice(devices[x], NULL);
                devices[x] = VK_NULL_HANDLE;
            }
            printf("destroy 0\n");
        } else if (strcmp(command, "cuimport") == 0) {
            int fd = device_at(x) ? export_fd((int)x, (VkDeviceMemory)(uintptr_t)y) : -1;
            CUDA_EXTERNAL_MEMORY_HANDLE_DESC desc = {.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD, .size = z};
            desc.handle.fd = fd;
            CUexternalMemory external = NULL;
            CUdeviceptr pointer = 0;
            CUresult status = fd >= 0 ? cuImportExternalMemory(&external, &desc) : CUDA_ERROR_INVALID_VALUE;
            if (status == CUDA_SUCCESS) {
                CUDA_EXTERNAL_MEMORY_BUFFER_DESC buffer = {.offset = 0, .size = z};
                status = cuExternalMemoryGetMappedBuffer(&pointer, external, &buffer);
            }
            printf("cuimport %d %llu %llu\n", (int)status, (unsigned long long)(uintptr_t)external,
                   (unsigned long long)pointer);
        } else if (strcmp(command, "cudestroy") == 0) {
            printf("cudestroy %d\n", (int)cuDestroyExternalMemory((CUexternalMemory)(uintptr_t)x));
        } else if (strcmp(command, "cuinfo") == 0) {
            size_t free_bytes = 0, total = 0;
            CUresult status = cuMemGetInfo_v2(&free_bytes, &total);
            printf("cuinfo %d %zu %zu\n", (int)status, free_bytes, total);
        } else {
            printf("unknown %s\n", command);
        }
        fflush(stdout);
    }
    if (instance) {
        for (int i = 0; i < device_count; i++)
            if (devices[i]) vkDestroyDevice(devices[i], NULL);
        vkDestroyInstance(instance, NULL);
    }
    return 0;
}
