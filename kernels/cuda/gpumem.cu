/* gpumem.cu - GPU arenas: cuMem allocations that can be exported as POSIX file
 * descriptors and mapped by another process; client memory imported, which
 * must lie on the session's GPU; and GPU UUIDs. The driver's entry points are
 * reached through the runtime, so nothing links against libcuda. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <string.h>
#include <unistd.h>

#include "cuda_priv.h"
#include "gpuid.h"

typedef CUresult (*fn_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
typedef CUresult (*fn_gran)(size_t *, const CUmemAllocationProp *,
                            CUmemAllocationGranularity_flags);
typedef CUresult (*fn_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                           unsigned long long);
typedef CUresult (*fn_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*fn_export)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                              unsigned long long);
typedef CUresult (*fn_unmap)(CUdeviceptr, size_t);
typedef CUresult (*fn_afree)(CUdeviceptr, size_t);
typedef CUresult (*fn_release)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_import)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
typedef CUresult (*fn_range)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*fn_props)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
typedef CUresult (*fn_dev_get)(CUdevice *, int);
typedef CUresult (*fn_uuid)(CUuuid *, CUdevice);

static struct {
  int ready;
  fn_create create;
  fn_gran gran;
  fn_reserve reserve;
  fn_map map;
  fn_access access;
  fn_export exportfd;
  fn_unmap unmap;
  fn_afree afree;
  fn_release release;
  fn_import import;
  fn_range range;
  fn_props props;
  fn_dev_get dev_get;
  fn_uuid uuid;
} drv;

static int entry(const char *name, void **fn, char *err)
{
  cudaDriverEntryPointQueryResult q;
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || *fn == NULL)
    return mokk_fail(err, MOK_EDEVICE, "the CUDA driver has no %s: %s", name,
                     cudaGetErrorString(e));
  return 0;
}

static int load(char *err)
{
  int rc;
  if (drv.ready)
    return 0;
  if ((rc = entry("cuMemCreate", (void **)&drv.create, err)) ||
      (rc = entry("cuMemGetAllocationGranularity", (void **)&drv.gran, err)) ||
      (rc = entry("cuMemAddressReserve", (void **)&drv.reserve, err)) ||
      (rc = entry("cuMemMap", (void **)&drv.map, err)) ||
      (rc = entry("cuMemSetAccess", (void **)&drv.access, err)) ||
      (rc = entry("cuMemExportToShareableHandle", (void **)&drv.exportfd, err)) ||
      (rc = entry("cuMemUnmap", (void **)&drv.unmap, err)) ||
      (rc = entry("cuMemAddressFree", (void **)&drv.afree, err)) ||
      (rc = entry("cuMemRelease", (void **)&drv.release, err)) ||
      (rc = entry("cuMemImportFromShareableHandle", (void **)&drv.import, err)) ||
      (rc = entry("cuMemGetAddressRange", (void **)&drv.range, err)) ||
      (rc = entry("cuMemGetAllocationPropertiesFromHandle", (void **)&drv.props, err)) ||
      (rc = entry("cuDeviceGet", (void **)&drv.dev_get, err)) ||
      /* at 12000 this is cuDeviceGetUuid_v2, as libmok's, so MIG instances
       * have their own UUIDs on both sides */
      (rc = entry("cuDeviceGetUuid", (void **)&drv.uuid, err)))
    return rc;
  drv.ready = 1;
  return 0;
}

/* Makes device current (with a context) and the driver's entry points ready. */
static int use_device(int device, char *err)
{
  cudaError_t e;
  if ((e = cudaSetDevice(device)) != cudaSuccess || (e = cudaFree(0)) != cudaSuccess)
    return mokk_fail(err, MOK_EDEVICE, "cannot use CUDA device %d: %s (%s)", device,
                     cudaGetErrorString(e), cudaGetErrorName(e));
  return load(err);
}

/* Pinned memory on device, exportable as `handles`: a POSIX fd for an arena,
 * CU_MEM_HANDLE_TYPE_NONE where only the granularity is asked for. */
static CUmemAllocationProp device_prop(int device, CUmemAllocationHandleType handles)
{
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = handles;
  return prop;
}

/* Read-write access for device: what every mapping here gets. */
static CUmemAccessDesc device_rw(int device)
{
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = device;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return acc;
}

/* The devices linked with each device (bit d: device d), set once at
 * start-up, before any mapping that needs it, by mokk_cuda_link. */
static unsigned shared_with[MOKK_CUDA_MAX_DEVICES];

void mokk_gpu_mem_share(int owner, int peer)
{
  if (owner >= 0 && owner < MOKK_CUDA_MAX_DEVICES && peer >= 0 && peer < MOKK_CUDA_MAX_DEVICES)
    shared_with[owner] |= 1u << peer;
}

/* Read-write access for device and the devices linked with it (the ranks
 * of an EP step on other GPUs read and write its memory); returns how many. */
static size_t rw_list(int device, CUmemAccessDesc acc[MOKK_CUDA_MAX_DEVICES])
{
  size_t n = 0;
  acc[n++] = device_rw(device);
  for (int d = 0; device < MOKK_CUDA_MAX_DEVICES && d < MOKK_CUDA_MAX_DEVICES; d++)
    if (d != device && (shared_with[device] >> d & 1))
      acc[n++] = device_rw(d);
  return n;
}

/* Maps h at va read-write for device and its linked devices; nothing stays
 * mapped on failure. */
static CUresult map_rw(CUdeviceptr va, size_t bytes, CUmemGenericAllocationHandle h, int device)
{
  CUmemAccessDesc acc[MOKK_CUDA_MAX_DEVICES];
  size_t n = rw_list(device, acc);
  CUresult r;
  if ((r = drv.map(va, bytes, 0, h, 0)) != CUDA_SUCCESS)
    return r;
  if ((r = drv.access(va, bytes, acc, n)) != CUDA_SUCCESS)
    drv.unmap(va, bytes);
  return r;
}

/* Undoes a mapping of h at va and drops this process's reference to h. */
static void unmap_release(CUdeviceptr va, size_t bytes, CUmemGenericAllocationHandle h)
{
  drv.unmap(va, bytes);
  drv.afree(va, bytes);
  drv.release(h);
}

extern "C" int mokk_gpu_mem_create(int device, size_t bytes, mokk_gpu_mem *m, int *fd, char *err)
{
  CUmemAllocationProp prop;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  size_t g = 0;
  CUresult r;
  int rc, out = -1;

  memset(m, 0, sizeof *m);
  *fd = -1;
  if ((rc = use_device(device, err)))
    return rc;
  prop = device_prop(device, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if ((r = drv.gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)) != CUDA_SUCCESS)
    return CU_FAIL(r, "cuMemGetAllocationGranularity");
  bytes = (bytes + g - 1) / g * g;
  r = drv.create(&h, bytes, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    /* steps keep their freed memory in the stream-ordered pool; hand it
     * back to the device and try once more */
    cudaMemPool_t pool;
    cudaDeviceSynchronize();
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess)
      cudaMemPoolTrimTo(pool, 0);
    r = drv.create(&h, bytes, &prop, 0);
  }
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    size_t avail = 0, total = 0;
    cudaMemGetInfo(&avail, &total);
    return mokk_fail(err, MOK_ENOMEM, "out of GPU memory: cannot allocate a %zu-byte arena "
                     "on device %d (%zu of %zu bytes free)", bytes, device, avail, total);
  }
  if (r != CUDA_SUCCESS)
    return CU_FAIL(r, "cuMemCreate");
  if ((r = drv.reserve(&va, bytes, g, 0, 0)) != CUDA_SUCCESS) {
    drv.release(h);
    return CU_FAIL(r, "cuMemAddressReserve");
  }
  if ((r = map_rw(va, bytes, h, device)) != CUDA_SUCCESS) {
    drv.afree(va, bytes);
    drv.release(h);
    return CU_FAIL(r, "mapping a GPU arena");
  }
  if ((r = drv.exportfd(&out, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) != CUDA_SUCCESS) {
    unmap_release(va, bytes, h);
    return CU_FAIL(r, "exporting a GPU arena");
  }
  m->ptr = (void *)va;
  m->bytes = bytes;
  m->handle = h;
  m->device = device;
  *fd = out;
  return 0;
}

extern "C" void mokk_gpu_mem_free(mokk_gpu_mem *m)
{
  if (m->ptr == NULL || !drv.ready)
    return;
  cudaSetDevice(m->device);
  /* the memory may still be read by queued work: let it finish first */
  cudaDeviceSynchronize();
  mokk_gpu_mem_free_now(m);
}

void mokk_gpu_mem_free_now(mokk_gpu_mem *m)
{
  if (m->ptr == NULL || !drv.ready)
    return;
  unmap_release((CUdeviceptr)m->ptr, m->bytes, m->handle);
  memset(m, 0, sizeof *m);
}

/* ---- GPU identity ---------------------------------------------------------- */

/* The driver's UUID of device: no context is made on it (cuDeviceGet and
 * cuDeviceGetUuid need none). */
static int device_uuid(int device, uint8_t uuid[MOKW_UUID_BYTES], char *err)
{
  CUdevice d;
  CUuuid u;
  CUresult r;
  int rc;

  if ((rc = load(err)))
    return rc;
  if ((r = drv.dev_get(&d, device)) != CUDA_SUCCESS)
    return CU_FAIL(r, "cuDeviceGet");
  if ((r = drv.uuid(&u, d)) != CUDA_SUCCESS)
    return CU_FAIL(r, "cuDeviceGetUuid");
  memcpy(uuid, u.bytes, MOKW_UUID_BYTES);
  return 0;
}

extern "C" int mokk_cuda_uuid(int device, uint8_t uuid[MOKW_UUID_BYTES], char *err)
{
  int rc = use_device(device, err);
  return rc != 0 ? rc : device_uuid(device, uuid, err);
}

/* Client memory must lie on the session's GPU: its steps run there, and an
 * ordinal the client computed in its own numbering may name another GPU
 * here. The other GPU's UUID is read without making a context on it (a
 * primary context costs hundreds of MB there, and this runs on the loop
 * thread). Leaves device current. */
static int check_on_device(int where, int device, char *err)
{
  char got[MOKW_UUID_STRLEN] = "?", want[MOKW_UUID_STRLEN] = "?", ignore[MOK_ERRLEN];
  uint8_t u[MOKW_UUID_BYTES];

  if (where == device)
    return 0;
  if (device_uuid(where, u, ignore) == 0)
    mokw_uuid_format(u, got);
  if (device_uuid(device, u, ignore) == 0)
    mokw_uuid_format(u, want);
  return mokk_fail(err, MOK_EDEVICE, "the memory is on GPU %s (device %d here), not on the "
                   "session's GPU %s (device %d): allocate it there, or connect on its GPU",
                   got, where, want, device);
}

/* ---- client memory ------------------------------------------------------- */

int mokk_gpu_import_ipc(int device, const void *ipc_handle, size_t bytes,
                                   mokk_gpu_import *m, char *err)
{
  cudaIpcMemHandle_t h;
  cudaPointerAttributes at;
  CUdeviceptr base = 0;
  size_t size = 0;
  void *p = NULL;
  cudaError_t e;
  CUresult r;
  int rc;

  memset(m, 0, sizeof *m);
  if ((rc = use_device(device, err)))
    return rc;
  memcpy(&h, ipc_handle, sizeof h);
  if ((e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess)) != cudaSuccess) {
    cudaGetLastError();
    return mokk_fail(err, MOK_EINVAL, "the CUDA IPC handle cannot be opened: %s (%s); it "
                     "must come from cudaIpcGetMemHandle on a cudaMalloc allocation of a "
                     "live process on device %d", cudaGetErrorString(e), cudaGetErrorName(e),
                     device);
  }
  /* opened with peer access, memory of another GPU maps too: refuse it */
  if ((e = cudaPointerGetAttributes(&at, p)) != cudaSuccess) {
    cudaIpcCloseMemHandle(p);
    return CUDA_FAIL(e, "cudaPointerGetAttributes");
  }
  if (at.device != device) {
    cudaIpcCloseMemHandle(p);
    return check_on_device(at.device, device, err);
  }
  /* the handle names a whole allocation: it must hold what the client claims */
  if ((r = drv.range(&base, &size, (CUdeviceptr)p)) != CUDA_SUCCESS || size < bytes) {
    cudaIpcCloseMemHandle(p);
    if (r != CUDA_SUCCESS)
      return CU_FAIL(r, "cuMemGetAddressRange");
    return mokk_fail(err, MOK_ERANGE, "the CUDA allocation holds %zu bytes, fewer than the "
                     "%zu named", size, bytes);
  }
  m->ptr = p;
  m->bytes = bytes;
  m->device = device;
  m->legacy = 1;
  return 0;
}

/* The cuMem allocation behind fd, which must be memory of device. */
static int import_handle(int device, int fd, CUmemGenericAllocationHandle *out, char *err)
{
  CUmemGenericAllocationHandle h = 0;
  CUmemAllocationProp prop;
  CUresult r;

  if ((r = drv.import(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) !=
      CUDA_SUCCESS)
    return mokk_fail(err, MOK_EINVAL, "the fd is not an exported cuMem allocation "
                     "(cuMemImportFromShareableHandle: CUresult %d)", (int)r);
  /* before mapping: a map of another GPU's memory would fail as if it were
   * too small */
  memset(&prop, 0, sizeof prop);
  if ((r = drv.props(&prop, h)) != CUDA_SUCCESS) {
    drv.release(h);
    return CU_FAIL(r, "cuMemGetAllocationPropertiesFromHandle");
  }
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    drv.release(h);
    return mokk_fail(err, MOK_EINVAL, "the cuMem allocation is not device memory (location "
                     "type %d); import GPU memory of the session's GPU", (int)prop.location.type);
  }
  if (prop.location.id != device) {
    drv.release(h);
    return check_on_device(prop.location.id, device, err);
  }
  *out = h;
  return 0;
}

int mokk_gpu_import_fd(int device, int fd, size_t bytes, mokk_gpu_import *m,
                                  char *err)
{
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  CUresult r;
  int rc;

  memset(m, 0, sizeof *m);
  if ((rc = use_device(device, err)) || (rc = import_handle(device, fd, &h, err)))
    return rc;
  if ((r = drv.reserve(&va, bytes, 0, 0, 0)) != CUDA_SUCCESS) {
    drv.release(h);
    return CU_FAIL(r, "cuMemAddressReserve");
  }
  /* mapping more than the allocation holds fails here, not later on a fault */
  if ((r = map_rw(va, bytes, h, device)) != CUDA_SUCCESS) {
    drv.afree(va, bytes);
    drv.release(h);
    return mokk_fail(err, MOK_ERANGE, "cannot map %zu bytes of the imported cuMem allocation "
                     "(CUresult %d): is it smaller, or not a multiple of the granularity?",
                     bytes, (int)r);
  }
  m->ptr = (void *)va;
  m->bytes = bytes;
  m->handle = h;
  m->device = device;
  return 0;
}

int mokk_gpu_import_reserve(int device, size_t bytes, mokk_gpu_import *m, char *err)
{
  CUmemAllocationProp prop;
  CUdeviceptr va = 0;
  size_t g = 0;
  CUresult r;
  int rc;

  memset(m, 0, sizeof *m);
  if ((rc = use_device(device, err)))
    return rc;
  prop = device_prop(device, CU_MEM_HANDLE_TYPE_NONE);
  if ((r = drv.gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS)
    return CU_FAIL(r, "cuMemGetAllocationGranularity");
  if (bytes > SIZE_MAX - g)
    return mokk_fail(err, MOK_EOVERFLOW, "an import of %zu bytes overflows", bytes);
  m->reserved = (bytes + g - 1) / g * g;
  if ((r = drv.reserve(&va, m->reserved, g, 0, 0)) != CUDA_SUCCESS)
    return CU_FAIL(r, "cuMemAddressReserve");
  m->ptr = (void *)va;
  m->bytes = bytes;
  m->device = device;
  m->chunked = 1;
  return 0;
}

int mokk_gpu_import_chunk(mokk_gpu_import *m, int fd, size_t offset, size_t bytes, char *err)
{
  CUmemGenericAllocationHandle h = 0;
  CUresult r;
  int rc;

  if (offset > m->bytes || bytes > m->bytes - offset)
    return mokk_fail(err, MOK_ERANGE, "a chunk of %zu bytes at %zu runs past the %zu-byte "
                     "import", bytes, offset, m->bytes);
  if (m->nchunks == m->capchunks) {
    int cap = m->capchunks ? 2 * m->capchunks : 16;
    void *hs = realloc(m->handles, (size_t)cap * sizeof *m->handles);
    if (hs == NULL)
      return mokk_fail(err, MOK_ENOMEM, "out of memory");
    m->handles = (unsigned long long *)hs;
    void *ss = realloc(m->sizes, (size_t)cap * sizeof *m->sizes);
    if (ss == NULL)
      return mokk_fail(err, MOK_ENOMEM, "out of memory");
    m->sizes = (size_t *)ss;
    m->capchunks = cap;
  }
  cudaSetDevice(m->device);
  if ((rc = import_handle(m->device, fd, &h, err)))
    return rc;
  if ((r = drv.map((CUdeviceptr)m->ptr + offset, bytes, 0, h, 0)) != CUDA_SUCCESS) {
    drv.release(h);
    return mokk_fail(err, MOK_ERANGE, "cannot map chunk %d (%zu bytes at %zu) of the "
                     "imported cuMem allocations (CUresult %d): is it smaller, or not a "
                     "multiple of the granularity?", m->nchunks, bytes, offset, (int)r);
  }
  m->handles[m->nchunks] = h;
  m->sizes[m->nchunks++] = bytes;
  return 0;
}

int mokk_gpu_import_commit(mokk_gpu_import *m, char *err)
{
  CUmemAccessDesc acc[MOKK_CUDA_MAX_DEVICES];
  size_t n = rw_list(m->device, acc);
  CUresult r;

  cudaSetDevice(m->device);
  if ((r = drv.access((CUdeviceptr)m->ptr, m->bytes, acc, n)) != CUDA_SUCCESS)
    return CU_FAIL(r, "cuMemSetAccess over the imported chunks");
  return 0;
}

/* Unmaps and releases every chunk mapped so far, then the reservation. */
static void chunks_free(mokk_gpu_import *m)
{
  size_t off = 0;
  for (int i = 0; i < m->nchunks; i++) {
    drv.unmap((CUdeviceptr)m->ptr + off, m->sizes[i]);
    drv.release(m->handles[i]);
    off += m->sizes[i];
  }
  drv.afree((CUdeviceptr)m->ptr, m->reserved);
  free(m->handles);
  free(m->sizes);
}

void mokk_gpu_import_free_now(mokk_gpu_import *m)
{
  if (m->ptr == NULL)
    return;
  cudaSetDevice(m->device);
  if (m->chunked) {
    if (drv.ready)
      chunks_free(m);
  } else if (m->legacy) {
    cudaIpcCloseMemHandle(m->ptr);
  } else if (drv.ready) {
    unmap_release((CUdeviceptr)m->ptr, m->bytes, m->handle);
  }
  memset(m, 0, sizeof *m);
}
