/* ipc.cu - stream ordering with client processes through interprocess CUDA
 * events: the client's ready events are opened once and waited on by the
 * daemon's stream; one done event per session is recorded after each step and
 * its handle goes back with the reply. No host ever waits here. */
#include <cuda_runtime.h>
#include <string.h>

#include "cuda_backend.h"

#define READY_SLOTS 8

typedef struct ready_event {
  cudaIpcEventHandle_t handle;
  cudaEvent_t ev;
  unsigned long long used; /* for evicting the least recently used */
} ready_event;

struct mokk_cuda_events {
  int device;
  cudaEvent_t done;
  cudaIpcEventHandle_t done_handle;
  ready_event ready[READY_SLOTS];
  int nready;
  unsigned long long clock;
};

static int ipc_fail(char *err, cudaError_t e, const char *what)
{
  return mokk_fail(err, MOK_EDEVICE, "%s: %s (%s)", what, cudaGetErrorString(e),
                   cudaGetErrorName(e));
}

extern "C" int mokk_cuda_events_create(mokk_backend *b, mokk_cuda_events **out, char *err)
{
  mokk_cuda_events *ev = (mokk_cuda_events *)calloc(1, sizeof *ev);
  cudaError_t e;

  *out = NULL;
  if (ev == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  ev->device = mokk_cuda_device(b);
  if ((e = cudaSetDevice(ev->device)) != cudaSuccess ||
      (e = cudaEventCreateWithFlags(&ev->done, cudaEventDisableTiming |
                                                   cudaEventInterprocess)) != cudaSuccess) {
    free(ev);
    return ipc_fail(err, e, "creating the done event");
  }
  if ((e = cudaIpcGetEventHandle(&ev->done_handle, ev->done)) != cudaSuccess) {
    cudaEventDestroy(ev->done);
    free(ev);
    return ipc_fail(err, e, "cudaIpcGetEventHandle");
  }
  *out = ev;
  return 0;
}

extern "C" void mokk_cuda_events_free(mokk_cuda_events *ev)
{
  if (ev == NULL)
    return;
  cudaSetDevice(ev->device);
  /* destroying an event that queued work still waits on is allowed: its
   * resources go once the device is done with it */
  for (int i = 0; i < ev->nready; i++)
    cudaEventDestroy(ev->ready[i].ev);
  cudaEventDestroy(ev->done);
  free(ev);
}

extern "C" int mokk_cuda_wait(mokk_backend *b, mokk_cuda_events *ev, const void *handle,
                              char *err)
{
  ready_event *r = NULL;
  cudaError_t e;

  if ((e = cudaSetDevice(ev->device)) != cudaSuccess)
    return ipc_fail(err, e, "cudaSetDevice");
  for (int i = 0; i < ev->nready; i++)
    if (memcmp(&ev->ready[i].handle, handle, sizeof(cudaIpcEventHandle_t)) == 0)
      r = &ev->ready[i];
  if (r == NULL) {
    cudaIpcEventHandle_t h;
    cudaEvent_t opened;
    memcpy(&h, handle, sizeof h);
    if ((e = cudaIpcOpenEventHandle(&opened, h)) != cudaSuccess)
      return mokk_fail(err, MOK_EINVAL, "the ready event cannot be opened: %s (%s); it must "
                       "come from cudaIpcGetEventHandle on an event created with "
                       "cudaEventInterprocess | cudaEventDisableTiming on device %d",
                       cudaGetErrorString(e), cudaGetErrorName(e), ev->device);
    if (ev->nready < READY_SLOTS) {
      r = &ev->ready[ev->nready++];
    } else {
      r = &ev->ready[0];
      for (int i = 1; i < READY_SLOTS; i++)
        if (ev->ready[i].used < r->used)
          r = &ev->ready[i];
      cudaEventDestroy(r->ev);
    }
    r->handle = h;
    r->ev = opened;
  }
  r->used = ++ev->clock;
  if ((e = cudaStreamWaitEvent((cudaStream_t)mokk_cuda_stream(b), r->ev, 0)) != cudaSuccess)
    return ipc_fail(err, e, "cudaStreamWaitEvent on the ready event");
  return 0;
}

int mokk_cuda_events_record(mokk_cuda_events *ev, cudaStream_t stream, void *handle,
                            char *err)
{
  cudaError_t e = cudaEventRecord(ev->done, stream);
  if (e != cudaSuccess)
    return ipc_fail(err, e, "recording the done event");
  memcpy(handle, &ev->done_handle, sizeof ev->done_handle);
  return 0;
}

/* ---- fences --------------------------------------------------------------- */

extern "C" int mokk_cuda_fence(mokk_backend *b, void **fence, char *err)
{
  cudaEvent_t ev;
  cudaError_t e;

  *fence = NULL;
  if ((e = cudaSetDevice(mokk_cuda_device(b))) != cudaSuccess ||
      (e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) != cudaSuccess)
    return ipc_fail(err, e, "creating a fence");
  if ((e = cudaEventRecord(ev, (cudaStream_t)mokk_cuda_stream(b))) != cudaSuccess) {
    cudaEventDestroy(ev);
    return ipc_fail(err, e, "recording a fence");
  }
  *fence = ev;
  return 0;
}

extern "C" int mokk_cuda_fence_passed(void *fence)
{
  cudaError_t e = cudaEventQuery((cudaEvent_t)fence);
  if (e == cudaErrorNotReady)
    return 0;
  if (e != cudaSuccess)
    cudaGetLastError(); /* a broken device runs nothing more: the memory can go */
  return 1;
}

extern "C" void mokk_cuda_fence_free(void *fence)
{
  if (fence != NULL)
    cudaEventDestroy((cudaEvent_t)fence);
}
