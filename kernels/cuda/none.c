/* none.c — kvl_backend_cuda() in a build without nvcc (meson -Dcuda=disabled, or no
 * toolkit): there is no CUDA backend, and the caller is told why. */
#include <stdio.h>

#include "../backend-impl.h"

kvl_backend_t *kvl_backend_cuda(char *why, size_t whylen) {
  if (why && whylen) snprintf(why, whylen, "built without CUDA (nvcc was not found, or -Dcuda=disabled)");
  return NULL;
}
