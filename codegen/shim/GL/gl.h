/* Empty: interop.h defines the GL types cudaGL.h needs. */
