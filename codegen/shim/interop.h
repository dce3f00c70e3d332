/* What bindgen reads for the CUDA driver: cuda.h plus the interop headers whose entry points
 * libcuda.so.1 also exports (GL, EGL, VDPAU, profiler), so that cuGetProcAddress answers for them
 * map to our wrappers too.
 *
 * The interop headers use window-system types without (always) including their headers. The
 * stand-ins below give bindgen the same ABI (integers and pointers, as the real headers define
 * them) so no GL, EGL or VDPAU development files are needed. This file is ours, not NVIDIA's. */
#include <stdint.h>

typedef unsigned int GLuint;
typedef unsigned int GLenum;

typedef void *EGLImageKHR;
typedef void *EGLStreamKHR;
typedef void *EGLSyncKHR;
typedef int32_t EGLint;

typedef uint32_t VdpDevice;
typedef uint32_t VdpVideoSurface;
typedef uint32_t VdpOutputSurface;
typedef uint32_t VdpFuncId;
typedef int VdpStatus;
typedef VdpStatus VdpGetProcAddress(VdpDevice device, VdpFuncId function_id, void **function_pointer);

#include <cuda.h>
#include <cudaGL.h>
#include <cudaEGL.h>
#include <cudaVDPAU.h>
#include <cudaProfiler.h>
