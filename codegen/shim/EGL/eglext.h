/* Empty: interop.h defines the EGL types cudaEGL.h needs. */
