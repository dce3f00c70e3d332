// For every base name read from stdin (one per line), every CUDA version and every stream flag,
// asks cuGetProcAddress_v2 (fetched with dlsym, as cudart does) and prints one line:
//   <name> <version> <flags> <status> <query result> <library file> <symbol>
// Run once against the driver alone and once with the hook preloaded: the symbols must agree and
// the library must be the hook's.
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef CUresult (*proc_v2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

int main(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "procaddr: %s\n", dlerror()); return 2; }
    proc_v2_fn get = (proc_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
    if (!get) { fprintf(stderr, "procaddr: no cuGetProcAddress_v2\n"); return 2; }
    const int versions[] = {11040, 12000, 12090, 13000, 13050};
    const cuuint64_t flags[] = {CU_GET_PROC_ADDRESS_DEFAULT, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM};
    char name[256];
    while (fgets(name, sizeof name, stdin)) {
        name[strcspn(name, "\r\n")] = 0;
        if (!name[0]) continue;
        for (unsigned v = 0; v < sizeof versions / sizeof *versions; v++) {
            for (unsigned f = 0; f < sizeof flags / sizeof *flags; f++) {
                void *fn = NULL;
                CUdriverProcAddressQueryResult found = (CUdriverProcAddressQueryResult)-1;
                CUresult status = get(name, &fn, versions[v], flags[f], &found);
                Dl_info info;
                memset(&info, 0, sizeof info);
                const char *file = "-", *symbol = "-";
                if (fn && dladdr(fn, &info)) {
                    file = info.dli_fname ? (strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1 : info.dli_fname) : "?";
                    symbol = info.dli_sname ? info.dli_sname : "?";
                }
                printf("%s %d %llu %d %d %s %s\n", name, versions[v], (unsigned long long)flags[f], (int)status,
                       (int)found, file, symbol);
            }
        }
    }
    return 0;
}
