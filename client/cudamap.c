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
typedef struct { char bytes[MOKW_IPC_BYTES]; } cu_ipc;
enum { CU_LOCATION_DEVICE = 1, CU_ACCESS_RW = 3, CU_HANDLE_POSIX_FD = 1 };
enum { CU_EVENT_DISABLE_TIMING = 2, CU_EVENT_INTERPROCESS = 4 };
enum { CU_ATTR_BUFFER_ID = 7, CU_ATTR_DEVICE_ORDINAL = 9, CU_ATTR_LEGACY_IPC = 10 };
#define CU_STREAM_LEGACY ((void *)0x1)

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
  cu_result (*ev_create)(void **, unsigned);
  cu_result (*ev_record)(void *, void *);
  cu_result (*ev_sync)(void *);
  cu_result (*ev_destroy)(void *);
  cu_result (*ev_handle)(cu_ipc *, void *);
  cu_result (*ev_open)(void **, cu_ipc);
  cu_result (*stream_wait)(void *, void *, unsigned);
  cu_result (*mem_handle)(cu_ipc *, cu_ptr);
  cu_result (*range)(cu_ptr *, size_t *, cu_ptr);
  cu_result (*attr)(void *, int, cu_ptr);
  cu_result (*retain)(cu_handle *, void *);
  cu_result (*exportfd)(void *, cu_handle, int, unsigned long long);
  cu_result (*device_count)(int *);
  cu_result (*uuid)(uint8_t *, int);
} cu;

static pthread_mutex_t cu_mu = PTHREAD_MUTEX_INITIALIZER;

static int load(void)
{
  static const char *const names[] = {
      "cuInit", "cuDeviceGet", "cuCtxGetCurrent", "cuDevicePrimaryCtxRetain",
      "cuCtxSetCurrent", "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
      "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease", "cuMemcpyHtoD_v2",
      "cuMemcpyDtoH_v2", "cuEventCreate", "cuEventRecord", "cuEventSynchronize",
      "cuEventDestroy_v2", "cuIpcGetEventHandle", "cuIpcOpenEventHandle", "cuStreamWaitEvent",
      "cuIpcGetMemHandle", "cuMemGetAddressRange_v2", "cuPointerGetAttribute",
      "cuMemRetainAllocationHandle", "cuMemExportToShareableHandle", "cuDeviceGetCount",
      /* _v2: MIG instances have UUIDs of their own, as in the daemon */
      "cuDeviceGetUuid_v2"};
  void **slots[] = {(void **)&cu.init, (void **)&cu.device_get, (void **)&cu.ctx_get,
                    (void **)&cu.primary_retain, (void **)&cu.ctx_set, (void **)&cu.import,
                    (void **)&cu.reserve, (void **)&cu.map, (void **)&cu.access,
                    (void **)&cu.unmap, (void **)&cu.afree, (void **)&cu.release,
                    (void **)&cu.htod, (void **)&cu.dtoh, (void **)&cu.ev_create,
                    (void **)&cu.ev_record, (void **)&cu.ev_sync, (void **)&cu.ev_destroy,
                    (void **)&cu.ev_handle, (void **)&cu.ev_open, (void **)&cu.stream_wait,
                    (void **)&cu.mem_handle, (void **)&cu.range, (void **)&cu.attr,
                    (void **)&cu.retain, (void **)&cu.exportfd, (void **)&cu.device_count,
                    (void **)&cu.uuid};
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

/* ---- GPU identity ---------------------------------------------------------- */

int mok_cuda_uuid(int device, uint8_t uuid[MOKW_UUID_BYTES], char *why, size_t n)
{
  int count = 0, dev;
  if (load() != 1) {
    snprintf(why, n, "%s", cu.why);
    return -1;
  }
  if (cu.device_count(&count) != 0 || device < 0 || device >= count) {
    snprintf(why, n, "this process has no CUDA device %d (%d visible; CUDA_VISIBLE_DEVICES "
             "decides)", device, count);
    return -1;
  }
  if (cu.device_get(&dev, device) != 0 || cu.uuid(uuid, dev) != 0) {
    snprintf(why, n, "cannot read the UUID of CUDA device %d", device);
    return -1;
  }
  return 0;
}

int mok_cuda_find_uuid(const uint8_t uuid[MOKW_UUID_BYTES], int *device, char *why, size_t n)
{
  uint8_t have[MOKW_MAX_VISIBLE][MOKW_UUID_BYTES];
  char text[MOKW_UUID_STRLEN];
  int count = 0;
  if (load() != 1) {
    snprintf(why, n, "%s", cu.why);
    return -1;
  }
  if (cu.device_count(&count) != 0)
    count = 0;
  if (count > MOKW_MAX_VISIBLE)
    count = MOKW_MAX_VISIBLE;
  for (int i = 0; i < count; i++)
    if (mok_cuda_uuid(i, have[i], why, n) != 0)
      return -1;
  if ((*device = mokw_uuid_find((const uint8_t(*)[MOKW_UUID_BYTES])have, count, uuid)) < 0) {
    mokw_uuid_format(uuid, text);
    snprintf(why, n, "GPU %s is not visible in this process (%d CUDA device%s visible; "
             "CUDA_VISIBLE_DEVICES decides)", text, count, count == 1 ? "" : "s");
    return -1;
  }
  return 0;
}

/* ---- events and imports -------------------------------------------------- */

#define CU_TRY(call, what)                                                        \
  do {                                                                            \
    cu_result r_ = (call);                                                        \
    if (r_ != 0) {                                                                \
      snprintf(why, n, "%s failed (CUresult %d)", what, r_);                      \
      return -1;                                                                  \
    }                                                                             \
  } while (0)

int mok_cuda_event_new(int device, void **ev, void *handle, char *why, size_t n)
{
  if (use_device(device, why, n) != 0)
    return -1;
  CU_TRY(cu.ev_create(ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS),
         "creating an interprocess event");
  if (cu.ev_handle((cu_ipc *)handle, *ev) != 0) {
    cu.ev_destroy(*ev);
    *ev = NULL;
    snprintf(why, n, "cuIpcGetEventHandle failed");
    return -1;
  }
  return 0;
}

int mok_cuda_event_open(int device, const void *handle, void **ev, char *why, size_t n)
{
  cu_ipc h;
  if (use_device(device, why, n) != 0)
    return -1;
  memcpy(&h, handle, sizeof h);
  CU_TRY(cu.ev_open(ev, h), "opening the daemon's done event (cuIpcOpenEventHandle)");
  return 0;
}

int mok_cuda_event_record(void *ev, void *stream, char *why, size_t n)
{
  CU_TRY(cu.ev_record(ev, stream != NULL ? stream : CU_STREAM_LEGACY),
         "recording the ready event (cuEventRecord)");
  return 0;
}

int mok_cuda_stream_wait(void *stream, void *ev, char *why, size_t n)
{
  CU_TRY(cu.stream_wait(stream, ev, 0), "cuStreamWaitEvent on the done event");
  return 0;
}

int mok_cuda_event_sync(void *ev, char *why, size_t n)
{
  CU_TRY(cu.ev_sync(ev), "waiting for the done event (cuEventSynchronize)");
  return 0;
}

void mok_cuda_event_free(void *ev)
{
  if (ev != NULL && cu.state == 1)
    cu.ev_destroy(ev);
}

int mok_cuda_alloc_info(const void *ptr, mok_cuda_alloc *a, char *why, size_t n)
{
  cu_ptr p = (cu_ptr)(uintptr_t)ptr, base = 0;
  int dev = -1, legacy = 0;
  if (load() != 1) {
    snprintf(why, n, "%s", cu.why);
    return -1;
  }
  if (cu.attr(&dev, CU_ATTR_DEVICE_ORDINAL, p) != 0) {
    snprintf(why, n, "%p is not GPU memory this process allocated", ptr);
    return -1;
  }
  if (use_device(dev, why, n) != 0)
    return -1;
  memset(a, 0, sizeof *a);
  CU_TRY(cu.range(&base, &a->bytes, p), "cuMemGetAddressRange");
  if (cu.attr(&a->buffer_id, CU_ATTR_BUFFER_ID, p) != 0)
    a->buffer_id = 0; /* then only a changed size tells a new allocation */
  if (cu.attr(&legacy, CU_ATTR_LEGACY_IPC, p) != 0)
    legacy = 0;
  a->base = (uintptr_t)base;
  a->device = dev;
  a->legacy_ipc = legacy;
  return 0;
}

/* One driver call, for a pointer already known to be ours: what a cache hit
 * checks of each chunk past the first. */
int mok_cuda_buffer_id(uintptr_t at, unsigned long long *id)
{
  return load() == 1 && cu.attr(id, CU_ATTR_BUFFER_ID, (cu_ptr)at) == 0 ? 0 : -1;
}

int mok_cuda_ipc_handle(uintptr_t base, void *handle, char *why, size_t n)
{
  CU_TRY(cu.mem_handle((cu_ipc *)handle, (cu_ptr)base), "cuIpcGetMemHandle");
  return 0;
}

int mok_cuda_export_fd(uintptr_t base, int *fd, char *why, size_t n)
{
  cu_handle h = 0;
  cu_result r;
  if ((r = cu.retain(&h, (void *)base)) != 0) {
    snprintf(why, n, "the memory is neither from cudaMalloc nor a cuMem allocation "
             "(cuMemRetainAllocationHandle: CUresult %d)", r);
    return -1;
  }
  r = cu.exportfd(fd, h, CU_HANDLE_POSIX_FD, 0);
  cu.release(h); /* drops only the reference retain took */
  if (r != 0) {
    snprintf(why, n, "the cuMem allocation cannot be exported as a POSIX fd (CUresult %d); "
             "create it with requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
             "(PyTorch's expandable_segments makes such allocations: where its build's are not "
             "exportable, run without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)", r);
    return -1;
  }
  return 0;
}
