// In-process A/B of the launch overhead (issue 4: at limit 100 or unset, preloaded / native
// <= 1.02). One process, one context, one kernel; blocks of launches alternate between
//   A  cuLaunchKernel as the program links it (with LD_PRELOAD=libvgpu.so: the hook's wrapper)
//   B  libcuda's own cuLaunchKernel, found in the loaded libcuda's ELF symbol table, so that no
//      interposition can redirect it
// and the ratio A/B of each adjacent pair of blocks is collected; the median is printed. Both
// halves share the process, the CPU and the GPU state, so the VM's run-to-run noise cancels.
// Without the preload A and B are the same function: the control run gives the method's floor.
//     launch_ab <cubin with an extern "C" __global__ empty()> <pairs> <launches per block> <grid>
// Prints: a_ns <median A ns> b_ns <median B ns> ratio <median of pair ratios> p25 <..> p75 <..> same <0|1>
#define _GNU_SOURCE
#include <cuda.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);

struct lookup {
    const char *symbol;
    void *address;
};

// Reads the symbol from the file of the loaded libcuda (its .dynsym), relocated by the load base.
static int find_in_libcuda(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct lookup *lookup = data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libcuda.so")) return 0;
    int fd = open(info->dlpi_name, O_RDONLY);
    if (fd < 0) return 0;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return 0;
    }
    unsigned char *file = mmap(NULL, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (file == MAP_FAILED) return 0;
    Elf64_Ehdr *header = (Elf64_Ehdr *)file;
    Elf64_Shdr *sections = (Elf64_Shdr *)(file + header->e_shoff);
    for (int i = 0; i < header->e_shnum; i++) {
        if (sections[i].sh_type != SHT_DYNSYM) continue;
        Elf64_Sym *symbols = (Elf64_Sym *)(file + sections[i].sh_offset);
        const char *names = (const char *)(file + sections[sections[i].sh_link].sh_offset);
        size_t count = sections[i].sh_size / sizeof(Elf64_Sym);
        for (size_t s = 0; s < count; s++) {
            if (symbols[s].st_value && strcmp(names + symbols[s].st_name, lookup->symbol) == 0) {
                lookup->address = (void *)(info->dlpi_addr + symbols[s].st_value);
                break;
            }
        }
    }
    munmap(file, st.st_size);
    return lookup->address != NULL;
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define CHECK(call)                                                  \
    do {                                                             \
        CUresult r_ = (call);                                        \
        if (r_ != CUDA_SUCCESS) {                                    \
            fprintf(stderr, "%s failed: %d\n", #call, (int)r_);      \
            return 1;                                                \
        }                                                            \
    } while (0)

static int block(launch_fn launch, CUfunction function, int launches, unsigned grid, double *ns) {
    double start = now_ns();
    for (int i = 0; i < launches; i++) {
        CHECK(launch(function, grid, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
        if ((i & 1023) == 1023) CHECK(cuCtxSynchronize());
    }
    CHECK(cuCtxSynchronize());
    *ns = (now_ns() - start) / launches;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: launch_ab <cubin> <pairs> <launches per block> <grid>\n");
        return 2;
    }
    int pairs = atoi(argv[2]), launches = atoi(argv[3]);
    unsigned grid = (unsigned)atoi(argv[4]);
    CUdevice device;
    CUcontext context;
    CUmodule module;
    CUfunction function;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&device, 0));
    CHECK(cuDevicePrimaryCtxRetain(&context, device));
    CHECK(cuCtxSetCurrent(context));
    CHECK(cuModuleLoad(&module, argv[1]));
    CHECK(cuModuleGetFunction(&function, module, "empty"));
    struct lookup lookup = {"cuLaunchKernel", NULL};
    dl_iterate_phdr(find_in_libcuda, &lookup);
    if (!lookup.address) {
        fprintf(stderr, "libcuda's cuLaunchKernel not found\n");
        return 1;
    }
    launch_fn hooked = cuLaunchKernel, real = (launch_fn)lookup.address;
    double warm;
    if (block(hooked, function, 4096, grid, &warm) || block(real, function, 4096, grid, &warm)) return 1;
    double *a = calloc(pairs, sizeof(double)), *b = calloc(pairs, sizeof(double)), *ratio = calloc(pairs, sizeof(double));
    for (int p = 0; p < pairs; p++) {
        // Alternate which half goes first, so a drift over time favours neither.
        int first_real = p & 1;
        if (block(first_real ? real : hooked, function, launches, grid, first_real ? &b[p] : &a[p])) return 1;
        if (block(first_real ? hooked : real, function, launches, grid, first_real ? &a[p] : &b[p])) return 1;
        ratio[p] = a[p] / b[p];
    }
    qsort(a, pairs, sizeof(double), compare);
    qsort(b, pairs, sizeof(double), compare);
    qsort(ratio, pairs, sizeof(double), compare);
    printf("a_ns %.1f b_ns %.1f ratio %.4f p25 %.4f p75 %.4f same %d\n", a[pairs / 2], b[pairs / 2], ratio[pairs / 2],
           ratio[pairs / 4], ratio[pairs * 3 / 4], (void *)hooked == (void *)real);
    return 0;
}
