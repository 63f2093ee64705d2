/* cuda_backend.cu - the CUDA backend's lifecycle and its table: one device,
 * one non-blocking stream that every step runs on, and the device word where
 * steps flag errors only the GPU can see. The steps themselves are in
 * cuda_moe.cu, GPU memory in gpumem.cu, events and fences in ipc.cu. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "cuda_priv.h"

static void cuda_ctx_free(mokk_backend *b, mokk_ctx *ctx)
{
  ctx_release((cuda_backend *)b, (cuda_ctx *)ctx);
}

static size_t cuda_ctx_bytes(const mokk_ctx *ctx)
{
  return ((const cuda_ctx *)ctx)->bytes;
}

static void cuda_destroy(mokk_backend *b)
{
  cuda_backend *cb = (cuda_backend *)b;
  cudaSetDevice(cb->device);
  if (cb->stream != NULL) {
    cudaStreamSynchronize(cb->stream);
    cudaStreamDestroy(cb->stream);
  }
  if (cb->status != NULL)
    cudaFree(cb->status);
  free(cb);
}

static const mokk_backend_iface cuda_iface = {
    "cuda", cuda_forward_entry, cuda_backward_entry, cuda_ctx_free, cuda_ctx_bytes,
    cuda_destroy,
};

extern "C" int mokk_cuda_devices(char *err)
{
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaErrorNoDevice)
    return 0;
  if (e != cudaSuccess) /* no driver, or too old: a fact of the machine, said plainly */
    return mokk_fail(err, MOK_EDEVICE, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e),
                     cudaGetErrorName(e));
  return n;
}

extern "C" int mokk_cuda_create(int device, mokk_backend **out, char *err)
{
  cuda_backend *cb;
  cudaMemPool_t pool;
  uint64_t keep = UINT64_MAX;
  int n = mokk_cuda_devices(err), rc = 0;

  *out = NULL;
  if (n < 0)
    return n;
  if (device < 0 || device >= n)
    return mokk_fail(err, MOK_EDEVICE, "CUDA device %d does not exist (%d visible)", device, n);
  if ((cb = (cuda_backend *)calloc(1, sizeof *cb)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  cb->base.iface = &cuda_iface;
  cb->device = device;
  CUDA_CHECK_GOTO(cudaSetDevice(device), rc, fail);
  CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&cb->sms, cudaDevAttrMultiProcessorCount, device), rc,
                  fail);
  CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking), rc, fail);
  CUDA_CHECK_GOTO(cudaMalloc((void **)&cb->status, sizeof(int)), rc, fail);
  CUDA_CHECK_GOTO(cudaMemset(cb->status, 0, sizeof(int)), rc, fail);
  /* keep freed step memory in the pool instead of returning it each time */
  CUDA_CHECK_GOTO(cudaDeviceGetDefaultMemPool(&pool, device), rc, fail);
  CUDA_CHECK_GOTO(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), rc,
                  fail);
  *out = &cb->base;
  return 0;
fail:
  cuda_destroy(&cb->base);
  return rc;
}

extern "C" void mokk_cuda_set_max_blocks(mokk_backend *b, int blocks)
{
  ((cuda_backend *)b)->max_blocks = blocks > 0 ? blocks : 0;
}

extern "C" int mokk_cuda_device(const mokk_backend *b)
{
  return ((const cuda_backend *)b)->device;
}

extern "C" void *mokk_cuda_stream(mokk_backend *b)
{
  return ((cuda_backend *)b)->stream;
}

extern "C" int mokk_cuda_sync(mokk_backend *b, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;
  int status = 0;

  CUDA_CHECK(cudaSetDevice(cb->device));
  CUDA_CHECK(cudaStreamSynchronize(cb->stream));
  CUDA_CHECK(cudaMemcpy(&status, cb->status, sizeof status, cudaMemcpyDeviceToHost));
  if (status) {
    CUDA_CHECK(cudaMemset(cb->status, 0, sizeof(int)));
    return mokk_fail(err, MOK_EEXPERT, "topk_ids held an expert id outside [0, E); those "
                     "pairs were dropped");
  }
  return 0;
}

/* The step's status as the client reads it, then a clean flag for the next. */
__global__ void k_status(int *flag, int32_t *out)
{
  *out = *flag ? MOK_EEXPERT : 0;
  *flag = 0;
}

extern "C" int mokk_cuda_finish(mokk_backend *b, mokk_cuda_events *ev, int32_t *status,
                                void *handle, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;

  CUDA_CHECK(cudaSetDevice(cb->device));
  if (status != NULL) {
    k_status<<<1, 1, 0, cb->stream>>>(cb->status, status);
    CUDA_CHECK(cudaGetLastError());
  }
  return mokk_cuda_events_record(ev, cb->stream, handle, err);
}
