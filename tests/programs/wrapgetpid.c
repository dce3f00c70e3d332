// A second interposer, as profilers and allocators are: it wraps getpid and finds the original
// with dlsym(RTLD_NEXT, ...), which only works if every dlsym in front of it keeps the lookup
// relative to its caller.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <unistd.h>

int wrapgetpid_calls = 0;

pid_t getpid(void) {
    static pid_t (*real_getpid)(void);
    if (!real_getpid) real_getpid = (pid_t(*)(void))dlsym(RTLD_NEXT, "getpid");
    wrapgetpid_calls++;
    return real_getpid ? real_getpid() : -1;
}
