/* devices.c - see devices.h. */
#include "devices.h"

#ifdef MOKK_HAVE_CUDA
#include "cuda/cuda_backend.h"

int mokk_gpu_count(char *err)
{
  return mokk_cuda_devices(err);
}

int mokk_gpu_open(int ordinal, mokk_backend **out, char *err)
{
  return mokk_cuda_create(ordinal, out, err);
}
#else
int mokk_gpu_count(char *err)
{
  mokk_fail(err, MOK_ENOTSUP, "this build has no device backend");
  return 0;
}

int mokk_gpu_open(int ordinal, mokk_backend **out, char *err)
{
  *out = NULL;
  return mokk_fail(err, MOK_ENOTSUP, "this build has no device backend (device %d)", ordinal);
}
#endif
