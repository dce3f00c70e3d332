// Calls getpid through the wrapping library and checks the answer and that the wrapper ran, then
// uses the driver: prints "getpid ok <calls>" and "cuda <status>".
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(void) {
    pid_t pid = getpid();
    int *calls = (int *)dlsym(RTLD_DEFAULT, "wrapgetpid_calls");
    if (pid != (pid_t)syscall(SYS_getpid) || !calls || *calls < 1) {
        printf("getpid wrong %d %d\n", (int)pid, calls ? *calls : -1);
        return 1;
    }
    printf("getpid ok %d\n", *calls);
    int count = 0;
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) status = cuDeviceGetCount(&count);
    printf("cuda %d %d\n", (int)status, count);
    return 0;
}
