/* Used only when the include folder has no cudaProfiler.h (the PyPI wheels ship only
 * cudaProfilerTypedefs.h). The three profiler entry points libcuda.so.1 exports, with the
 * prototypes that cudaProfilerTypedefs.h gives them (PFN_cuProfiler*_v4000). */
#ifndef VGPU_SHIM_CUDA_PROFILER_H
#define VGPU_SHIM_CUDA_PROFILER_H
#include <cuda.h>
typedef enum CUoutput_mode_enum {
    CU_OUT_KEY_VALUE_PAIR = 0x00,
    CU_OUT_CSV = 0x01
} CUoutput_mode;
CUresult CUDAAPI cuProfilerInitialize(const char *configFile, const char *outputFile, CUoutput_mode outputMode);
CUresult CUDAAPI cuProfilerStart(void);
CUresult CUDAAPI cuProfilerStop(void);
#endif
