/* ipc.cu - stream ordering with client processes through interprocess CUDA
 * events: the client's ready events are opened once and waited on by the
 * daemon's stream; one done event per session is recorded after each step and
 * its handle goes back with the reply. No host ever waits here. */
#include <cuda_runtime.h>
#include <string.h>

#include "cuda_priv.h"

#define READY_SLOTS 8

static_assert(sizeof(cudaIpcEventHandle_t) == MOKK_IPC_BYTES &&
                  sizeof(cudaIpcMemHandle_t) == MOKK_IPC_BYTES,
              "CUDA IPC handles are not MOKK_IPC_BYTES");

typedef struct ready_event {
  cudaIpcEventHandle_t handle;
  cudaEvent_t ev;
  unsigned long long used; /* for evicting the least recently used */
} ready_event;

struct mokk_events {
  int device;
  /* the stream of the backend that made them (the client's GPU's): a step
   * run by another backend is ordered before its later work and fences */
  cudaStream_t home;
  cudaEvent_t done;
  cudaIpcEventHandle_t done_handle;
  ready_event ready[READY_SLOTS];
  int nready;
  unsigned long long clock;
};

int mokk_cuda_events_create(mokk_backend *b, mokk_events **out, char *err)
{
  mokk_events *ev = (mokk_events *)calloc(1, sizeof *ev);
  int rc = 0;

  *out = NULL;
  if (ev == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  ev->device = mokk_cuda_device(b);
  ev->home = (cudaStream_t)mokk_cuda_stream(b);
  CUDA_CHECK_GOTO(cudaSetDevice(ev->device), rc, fail);
  CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&ev->done, cudaEventDisableTiming |
                                                          cudaEventInterprocess), rc, fail);
  CUDA_CHECK_GOTO(cudaIpcGetEventHandle(&ev->done_handle, ev->done), rc, fail);
  *out = ev;
  return 0;
fail:
  if (ev->done != NULL)
    cudaEventDestroy(ev->done);
  free(ev);
  return rc;
}

void mokk_cuda_events_free(mokk_events *ev)
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

int mokk_cuda_events_device(const mokk_events *ev)
{
  return ev->device;
}

cudaStream_t mokk_cuda_events_home(const mokk_events *ev)
{
  return ev->home;
}

int mokk_cuda_wait(mokk_backend *b, mokk_events *ev, const void *handle,
                              char *err)
{
  ready_event *r = NULL;
  cudaError_t e;

  CUDA_CHECK(cudaSetDevice(ev->device));
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
  /* the client may be on another GPU than b (an EP rank there): the wait
   * crosses devices, and b's device is current again for the step */
  CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)mokk_cuda_stream(b), r->ev, 0));
  if (ev->device != mokk_cuda_device(b))
    CUDA_CHECK(cudaSetDevice(mokk_cuda_device(b)));
  return 0;
}

int mokk_cuda_events_record(mokk_events *ev, cudaStream_t stream, void *handle,
                            char *err)
{
  CUDA_CHECK(cudaEventRecord(ev->done, stream));
  memcpy(handle, &ev->done_handle, sizeof ev->done_handle);
  return 0;
}

/* ---- fences --------------------------------------------------------------- */

int mokk_cuda_fence(mokk_backend *b, cudaEvent_t *fence, char *err)
{
  cudaEvent_t ev;
  int rc = 0;

  *fence = NULL;
  CUDA_CHECK(cudaSetDevice(mokk_cuda_device(b)));
  CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_CHECK_GOTO(cudaEventRecord(ev, (cudaStream_t)mokk_cuda_stream(b)), rc, fail);
  *fence = ev;
  return 0;
fail:
  cudaEventDestroy(ev);
  return rc;
}

int mokk_cuda_fence_passed(cudaEvent_t fence)
{
  cudaError_t e = cudaEventQuery(fence);
  if (e == cudaErrorNotReady)
    return 0;
  if (e != cudaSuccess)
    cudaGetLastError(); /* a broken device runs nothing more: the memory can go */
  return 1;
}
