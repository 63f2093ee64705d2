/* cudamap.c - libmok's view of GPU arenas: the daemon's cuMem allocations,
 * imported from their POSIX fds and mapped into this process. The driver is
 * loaded with dlopen on first use, so libmok has no link-time CUDA dependency
 * and programs that never see a GPU arena never load it. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "cudamap.h"

/* The few driver types used, as the driver ABI defines them. */
typedef int cu_result;
typedef unsigned long long cu_ptr;
typedef unsigned long long cu_handle;
typedef struct { int type, id; } cu_location;
typedef struct { cu_location location; int flags; } cu_access;
enum { CU_LOCATION_DEVICE = 1, CU_ACCESS_RW = 3, CU_HANDLE_POSIX_FD = 1 };

static struct {
  int state; /* 0 not tried, 1 ready, -1 unavailable */
  char why[200];
  cu_result (*init)(unsigned);
  cu_result (*device_get)(int *, int);
  cu_result (*ctx_get)(void **);
  cu_result (*primary_retain)(void **, int);
  cu_result (*ctx_set)(void *);
  cu_result (*import)(cu_handle *, void *, int);
  cu_result (*reserve)(cu_ptr *, size_t, size_t, cu_ptr, unsigned long long);
  cu_result (*map)(cu_ptr, size_t, size_t, cu_handle, unsigned long long);
  cu_result (*access)(cu_ptr, size_t, const cu_access *, size_t);
  cu_result (*unmap)(cu_ptr, size_t);
  cu_result (*afree)(cu_ptr, size_t);
  cu_result (*release)(cu_handle);
  cu_result (*htod)(cu_ptr, const void *, size_t);
  cu_result (*dtoh)(void *, cu_ptr, size_t);
} cu;

static pthread_mutex_t cu_mu = PTHREAD_MUTEX_INITIALIZER;

static int load(void)
{
  static const char *const names[] = {
      "cuInit", "cuDeviceGet", "cuCtxGetCurrent", "cuDevicePrimaryCtxRetain",
      "cuCtxSetCurrent", "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
      "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease", "cuMemcpyHtoD_v2",
      "cuMemcpyDtoH_v2"};
  void **slots[] = {(void **)&cu.init, (void **)&cu.device_get, (void **)&cu.ctx_get,
                    (void **)&cu.primary_retain, (void **)&cu.ctx_set, (void **)&cu.import,
                    (void **)&cu.reserve, (void **)&cu.map, (void **)&cu.access,
                    (void **)&cu.unmap, (void **)&cu.afree, (void **)&cu.release,
                    (void **)&cu.htod, (void **)&cu.dtoh};
  void *lib;

  pthread_mutex_lock(&cu_mu);
  if (cu.state == 0) {
    cu.state = -1;
    if ((lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) == NULL) {
      snprintf(cu.why, sizeof cu.why, "cannot load the CUDA driver: %s", dlerror());
    } else {
      size_t i;
      for (i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*slots[i] = dlsym(lib, names[i])) == NULL)
          break;
      if (i < sizeof names / sizeof names[0])
        snprintf(cu.why, sizeof cu.why, "the CUDA driver lacks %s", names[i]);
      else if (cu.init(0) != 0)
        snprintf(cu.why, sizeof cu.why, "cuInit failed: no usable GPU");
      else
        cu.state = 1;
    }
  }
  pthread_mutex_unlock(&cu_mu);
  return cu.state;
}

/* A current context on this thread: the caller's, else the device's primary. */
static int use_device(int device, char *why, size_t n)
{
  void *ctx = NULL;
  int dev;
  if (load() != 1) {
    snprintf(why, n, "%s", cu.why);
    return -1;
  }
  if (cu.ctx_get(&ctx) == 0 && ctx != NULL)
    return 0;
  if (cu.device_get(&dev, device) != 0 || cu.primary_retain(&ctx, dev) != 0 ||
      cu.ctx_set(ctx) != 0) {
    snprintf(why, n, "cannot open CUDA device %d", device);
    return -1;
  }
  return 0;
}

int mok_cuda_map(int fd, size_t bytes, int device, void **ptr, unsigned long long *handle,
                 char *why, size_t n)
{
  cu_handle h = 0;
  cu_ptr va = 0;
  cu_access acc = {{CU_LOCATION_DEVICE, device}, CU_ACCESS_RW};
  cu_result r;

  if (use_device(device, why, n) != 0)
    return -1;
  if ((r = cu.import(&h, (void *)(intptr_t)fd, CU_HANDLE_POSIX_FD)) != 0) {
    snprintf(why, n, "cuMemImportFromShareableHandle failed (CUresult %d)", r);
    return -1;
  }
  if ((r = cu.reserve(&va, bytes, 0, 0, 0)) != 0) {
    cu.release(h);
    snprintf(why, n, "cuMemAddressReserve of %zu bytes failed (CUresult %d)", bytes, r);
    return -1;
  }
  if ((r = cu.map(va, bytes, 0, h, 0)) != 0 || (r = cu.access(va, bytes, &acc, 1)) != 0) {
    cu.unmap(va, bytes);
    cu.afree(va, bytes);
    cu.release(h);
    snprintf(why, n, "mapping a GPU arena failed (CUresult %d)", r);
    return -1;
  }
  *ptr = (void *)(uintptr_t)va;
  *handle = h;
  return 0;
}

void mok_cuda_unmap(void *ptr, size_t bytes, unsigned long long handle)
{
  if (cu.state != 1 || ptr == NULL)
    return;
  cu.unmap((cu_ptr)(uintptr_t)ptr, bytes);
  cu.afree((cu_ptr)(uintptr_t)ptr, bytes);
  cu.release(handle);
}

int mok_cuda_copy(void *dst, const void *src, size_t bytes, int to_device, int device,
                  char *why, size_t n)
{
  cu_result r;
  if (use_device(device, why, n) != 0)
    return -1;
  r = to_device ? cu.htod((cu_ptr)(uintptr_t)dst, src, bytes)
                : cu.dtoh(dst, (cu_ptr)(uintptr_t)src, bytes);
  if (r != 0) {
    snprintf(why, n, "copying %zu bytes %s the GPU failed (CUresult %d)", bytes,
             to_device ? "to" : "from", r);
    return -1;
  }
  return 0;
}
