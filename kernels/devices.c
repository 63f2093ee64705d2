/* devices.c - see devices.h. */
#include "devices.h"

#ifdef MOKK_HAVE_CUDA
#include <dlfcn.h>

#include "cuda/cuda_backend.h"

int mokk_gpu_count(char *err)
{
  int n = mokk_cuda_devices(err);
  void *driver;

  if (n > 0)
    return n;
  /* without the driver the static runtime reports cudaErrorInsufficientDriver,
   * "CUDA driver version is insufficient", as if an old one were there */
  if ((driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) == NULL) {
    mokk_fail(err, MOK_EDEVICE, "no NVIDIA driver is installed (libcuda.so.1 "
              "cannot be loaded): this machine has no GPU that mokd can use");
    return n;
  }
  dlclose(driver);
  return n;
}

int mokk_gpu_open(int ordinal, mokk_backend **out, char *err)
{
  return mokk_cuda_create(ordinal, out, err);
}

int mokk_gpu_link(mokk_backend **b, int n, char *err)
{
  return mokk_cuda_link(b, n, err);
}

int mokk_gpu_uuid(int ordinal, uint8_t uuid[16], char *err)
{
  return mokk_cuda_uuid(ordinal, uuid, err);
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

int mokk_gpu_link(mokk_backend **b, int n, char *err)
{
  (void)b;
  return mokk_fail(err, MOK_ENOTSUP, "this build has no device backend (%d to link)", n);
}

int mokk_gpu_uuid(int ordinal, uint8_t uuid[16], char *err)
{
  (void)uuid;
  return mokk_fail(err, MOK_ENOTSUP, "this build has no device backend (device %d)", ordinal);
}
#endif
