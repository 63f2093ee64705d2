/* cuda_backend.cu - the CUDA backend's table and lifecycle: one device, one
 * non-blocking stream that every step runs on, the device word where steps
 * flag errors only the GPU can see, and the backend's buffers, freed behind
 * fences so that no host thread waits for the GPU. The steps themselves are in
 * cuda_moe.cu, GPU memory in gpumem.cu, events and fences in ipc.cu. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_priv.h"

static void cuda_ctx_free(mokk_backend *b, mokk_ctx *ctx)
{
  ctx_release((cuda_backend *)b, (cuda_ctx *)ctx);
}

static size_t cuda_ctx_bytes(const mokk_ctx *ctx)
{
  return ((const cuda_ctx *)ctx)->bytes;
}

/* A step over ranks on several GPUs, or spread on this one, takes a buffer
 * set a rank (cuda_moe.cu): the spread bound; else the shared one. */
static uint64_t cuda_ctx_bound(const mokk_backend *b, const mokk_shape *s, int64_t T, int spans)
{
  if (spans || (((const cuda_backend *)b)->spread && s->P > 1))
    return mokk_ctx_bytes_bound_spread(s, T);
  return mokk_ctx_bytes_bound(s, T);
}

/* ---- memory ------------------------------------------------------------- */

static int cuda_buffer_alloc(mokk_backend *b, size_t bytes, mokk_buffer **out, int *fd,
                             char *err)
{
  cuda_buffer *buf = (cuda_buffer *)calloc(1, sizeof *buf);
  int rc;

  if (buf == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  if ((rc = mokk_gpu_mem_create(b->device, bytes, &buf->mem, fd, err)) != 0) {
    free(buf);
    return rc;
  }
  buf->base = (mokk_buffer){buf->mem.ptr, buf->mem.bytes, b->device};
  *out = &buf->base;
  return 0;
}

static int cuda_buffer_import(mokk_backend *b, const mokk_import *src, mokk_buffer **out,
                              char *err)
{
  cuda_buffer *buf = (cuda_buffer *)calloc(1, sizeof *buf);
  int rc;

  if (buf == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  rc = src->kind == MOKK_IMPORT_CUDA_IPC
           ? mokk_gpu_import_ipc(b->device, src->ipc_handle, src->bytes, &buf->imp, err)
           : mokk_gpu_import_fd(b->device, src->fd, src->bytes, &buf->imp, err);
  if (rc != 0) {
    free(buf);
    return rc;
  }
  buf->imported = 1;
  buf->base = (mokk_buffer){buf->imp.ptr, src->bytes, b->device};
  *out = &buf->base;
  return 0;
}

static int cuda_import_begin(mokk_backend *b, size_t bytes, mokk_buffer **out, char *err)
{
  cuda_buffer *buf = (cuda_buffer *)calloc(1, sizeof *buf);
  int rc;

  if (buf == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  if ((rc = mokk_gpu_import_reserve(b->device, bytes, &buf->imp, err)) != 0) {
    free(buf);
    return rc;
  }
  buf->imported = 1;
  buf->base = (mokk_buffer){buf->imp.ptr, bytes, b->device};
  *out = &buf->base;
  return 0;
}

static int cuda_import_chunk(mokk_backend *b, mokk_buffer *buf, int fd, size_t offset,
                             size_t bytes, char *err)
{
  (void)b;
  return mokk_gpu_import_chunk(&((cuda_buffer *)buf)->imp, fd, offset, bytes, err);
}

static int cuda_import_commit(mokk_backend *b, mokk_buffer *buf, char *err)
{
  (void)b;
  return mokk_gpu_import_commit(&((cuda_buffer *)buf)->imp, err);
}

static void buffer_free_now(cuda_buffer *buf)
{
  if (buf->imported)
    mokk_gpu_import_free_now(&buf->imp);
  else
    mokk_gpu_mem_free_now(&buf->mem);
  if (buf->fence != NULL)
    cudaEventDestroy(buf->fence);
  free(buf);
}

/* The loop never waits for the GPU: the buffer goes once a fence behind the
 * work queued so far has passed (cuda_reap). */
static int cuda_buffer_release(mokk_backend *b, mokk_buffer *mb, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;
  cuda_buffer *buf = (cuda_buffer *)mb;
  int rc = mokk_cuda_fence(b, &buf->fence, err);

  if (rc != 0) {
    cudaSetDevice(cb->device);
    cudaStreamSynchronize(cb->stream);
    buffer_free_now(buf);
    return rc;
  }
  buf->next = cb->retired;
  cb->retired = buf;
  return 0;
}

static int cuda_reap(mokk_backend *b, int wait)
{
  cuda_backend *cb = (cuda_backend *)b;
  cuda_buffer **pp = &cb->retired;
  int left = 0;

  if (wait && cb->retired != NULL) {
    cudaSetDevice(cb->device);
    cudaStreamSynchronize(cb->stream);
  }
  while (*pp != NULL) {
    cuda_buffer *buf = *pp;
    if (wait || mokk_cuda_fence_passed(buf->fence)) {
      *pp = buf->next;
      buffer_free_now(buf);
    } else {
      pp = &buf->next;
      left++;
    }
  }
  return left;
}

/* ---- steps and their ordering with the client --------------------------- */

static int cuda_events_new(mokk_backend *b, mokk_events **out, char *err)
{
  return mokk_cuda_events_create(b, out, err);
}

static void cuda_events_free(mokk_backend *b, mokk_events *ev)
{
  (void)b;
  mokk_cuda_events_free(ev);
}

/* A member of a step on another GPU (an EP rank there): the step comes
 * after what its own GPU's stream holds, ready event or not. Its last
 * single-GPU step may still be writing an output block that the client
 * released without waiting for its done event, and that this step reuses. */
static int cuda_step_begin(mokk_backend *b, mokk_events *ev, const void *ready, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;
  int d = mokk_cuda_events_device(ev), rc;
  cudaError_t e;

  if (d != cb->device) {
    if ((rc = cuda_peer_ready(cb, d, err)))
      return rc;
    if ((e = cudaSetDevice(d)) == cudaSuccess)
      e = cudaEventRecord(cb->peer[d].tail_ev, mokk_cuda_events_home(ev));
    cudaSetDevice(cb->device);
    if (e == cudaSuccess)
      e = cudaStreamWaitEvent(cb->stream, cb->peer[d].tail_ev, 0);
    if (e != cudaSuccess)
      return mokk_fail(err, MOK_EDEVICE, "ordering a step after GPU %d's stream: %s (%s)", d,
                       cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return ready != NULL ? mokk_cuda_wait(b, ev, ready, err) : 0;
}

/* The step's status as the client reads it; after the step's last rank, a
 * clean flag for the next step. */
__global__ void k_status(int *flag, int32_t *out, int last)
{
  if (out != NULL)
    *out = *flag ? MOK_EEXPERT : 0;
  if (last)
    *flag = 0;
}

/* A client of another GPU (an EP rank there) sees only that GPU's events:
 * its status and done event go on the tail stream of its GPU, after the
 * backend's stream, and the backend's stream then waits for them, so that
 * the last rank's clearing of the flag comes after every rank has read it.
 * The stream of the backend that made its events (its session's) waits
 * too: the fences of that backend, behind which its buffers are freed,
 * then come after the step that wrote them. */
static int step_end_peer(cuda_backend *cb, mokk_events *ev, int32_t *status, int last,
                         void *done, char *err)
{
  int d = mokk_cuda_events_device(ev), rc;

  if ((rc = cuda_peer_ready(cb, d, err)))
    return rc;
  cuda_peer *pr = &cb->peer[d];
  CUDA_CHECK(cudaSetDevice(cb->device));
  CUDA_CHECK(cudaEventRecord(cb->hop_ev, cb->stream));
  CUDA_CHECK(cudaSetDevice(d));
  CUDA_CHECK(cudaStreamWaitEvent(pr->tail, cb->hop_ev, 0));
  if (status != NULL || last) {
    k_status<<<1, 1, 0, pr->tail>>>(cb->status, status, last);
    CUDA_CHECK(cudaGetLastError());
  }
  if ((rc = mokk_cuda_events_record(ev, pr->tail, done, err)))
    return rc;
  CUDA_CHECK(cudaEventRecord(pr->tail_ev, pr->tail));
  CUDA_CHECK(cudaStreamWaitEvent(mokk_cuda_events_home(ev), pr->tail_ev, 0));
  CUDA_CHECK(cudaSetDevice(cb->device));
  CUDA_CHECK(cudaStreamWaitEvent(cb->stream, pr->tail_ev, 0));
  return 0;
}

static int cuda_step_end(mokk_backend *b, mokk_events *ev, int32_t *status, int last,
                         void *done, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;

  if (mokk_cuda_events_device(ev) != cb->device)
    return step_end_peer(cb, ev, status, last, done, err);
  CUDA_CHECK(cudaSetDevice(cb->device));
  if (status != NULL || last) {
    k_status<<<1, 1, 0, cb->stream>>>(cb->status, status, last);
    CUDA_CHECK(cudaGetLastError());
  }
  return mokk_cuda_events_record(ev, cb->stream, done, err);
}

/* ---- other GPUs ----------------------------------------------------------- */

int cuda_peer_ready(cuda_backend *cb, int device, char *err)
{
  int rc = 0;

  if (device == cb->device)
    return 0;
  if (device < 0 || device >= MOKK_CUDA_MAX_DEVICES || !cb->peer[device].linked)
    return mokk_fail(err, MOK_ENOTSUP, "CUDA device %d is not linked with device %d, where "
                     "the step runs (mokk_cuda_link)", device, cb->device);
  if (cb->hop_ev == NULL) {
    CUDA_CHECK(cudaSetDevice(cb->device));
    CUDA_CHECK(cudaEventCreateWithFlags(&cb->hop_ev, cudaEventDisableTiming));
  }
  cuda_peer *pr = &cb->peer[device];
  if (pr->tail != NULL)
    return 0;
  CUDA_CHECK(cudaSetDevice(device));
  int major = 0, minor = 0;
  CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                  rc, out);
  CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                  rc, out);
  pr->arch = 10 * major + minor;
  CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&pr->sms, cudaDevAttrMultiProcessorCount, device), rc,
                  out);
  if (pr->tile_ctr == NULL) { /* zeroed once: each GEMM leaves it at zero */
    CUDA_CHECK_GOTO(cudaMalloc((void **)&pr->tile_ctr, MOKK_DEVICE_MAX_RANKS * sizeof(int)),
                    rc, out);
    CUDA_CHECK_GOTO(cudaMemset(pr->tile_ctr, 0, MOKK_DEVICE_MAX_RANKS * sizeof(int)), rc, out);
  }
  if (pr->tail_ev == NULL)
    CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&pr->tail_ev, cudaEventDisableTiming), rc, out);
  /* last: its presence says the rest is made */
  CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&pr->tail, cudaStreamNonBlocking), rc, out);
out:
  cudaSetDevice(cb->device);
  return rc;
}

void cuda_free_after(cuda_backend *cb, int device, void *p)
{
  if (device == cb->device) {
    cudaFreeAsync(p, cb->stream);
    return;
  }
  cuda_peer *pr = &cb->peer[device];
  /* a part on another GPU exists only once its tail was made */
  if (cudaSetDevice(cb->device) != cudaSuccess ||
      cudaEventRecord(cb->hop_ev, cb->stream) != cudaSuccess ||
      cudaSetDevice(device) != cudaSuccess ||
      cudaStreamWaitEvent(pr->tail, cb->hop_ev, 0) != cudaSuccess) {
    cudaSetDevice(cb->device); /* no order to free it in: wait for the step */
    cudaStreamSynchronize(cb->stream);
    cudaSetDevice(device);
    cudaFree(p);
  } else {
    cudaFreeAsync(p, pr->tail);
  }
  cudaSetDevice(cb->device);
}

/* ---- lifecycle ----------------------------------------------------------- */

static void cuda_destroy(mokk_backend *b)
{
  cuda_backend *cb = (cuda_backend *)b;
  cudaSetDevice(cb->device);
  if (cb->stream != NULL) {
    cudaStreamSynchronize(cb->stream);
    cuda_reap(b, 1);
    cudaStreamDestroy(cb->stream);
  }
  for (int r = 0; r < MOKK_DEVICE_MAX_RANKS; r++) { /* joined into stream: idle */
    if (cb->part_st[r] != NULL)
      cudaStreamDestroy(cb->part_st[r]);
    if (cb->part_ev[r] != NULL)
      cudaEventDestroy(cb->part_ev[r]);
  }
  if (cb->fork_ev != NULL)
    cudaEventDestroy(cb->fork_ev);
  if (cb->hop_ev != NULL)
    cudaEventDestroy(cb->hop_ev);
  for (int d = 0; d < MOKK_CUDA_MAX_DEVICES; d++) {
    cuda_peer *pr = &cb->peer[d];
    if (d == cb->device || (pr->tail == NULL && pr->tile_ctr == NULL && pr->tail_ev == NULL))
      continue;
    cudaSetDevice(d);
    if (pr->tail != NULL) {
      cudaStreamSynchronize(pr->tail);
      cudaStreamDestroy(pr->tail);
    }
    for (int r = 0; r < MOKK_DEVICE_MAX_RANKS; r++) { /* joined into stream: idle */
      if (pr->part_st[r] != NULL)
        cudaStreamDestroy(pr->part_st[r]);
      if (pr->part_ev[r] != NULL)
        cudaEventDestroy(pr->part_ev[r]);
    }
    if (pr->tail_ev != NULL)
      cudaEventDestroy(pr->tail_ev);
    if (pr->tile_ctr != NULL)
      cudaFree(pr->tile_ctr);
  }
  cudaSetDevice(cb->device);
  if (cb->status != NULL)
    cudaFree(cb->status);
  if (cb->tile_ctr != NULL)
    cudaFree(cb->tile_ctr);
  free(cb);
}

/* A sticky error (an illegal address, a kernel that trapped) poisons the
 * context: every later call returns it. cudaStreamQuery says so without
 * waiting for the stream. */
static int cuda_check(mokk_backend *b, char *err)
{
  cudaError_t e = cudaStreamQuery(((cuda_backend *)b)->stream);
  if (e == cudaSuccess || e == cudaErrorNotReady)
    return 0;
  return mokk_fail(err, MOK_EDEVICE, "CUDA device %d: %s (%s); restart mokd", b->device,
                   cudaGetErrorString(e), cudaGetErrorName(e));
}

static uint64_t cuda_mem_total(const mokk_backend *b)
{
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, b->device) != cudaSuccess)
    return 0;
  return (uint64_t)p.totalGlobalMem;
}

/* forward and backward are cuda_moe.cu's. Designated, in the order of
 * kernels/backend_impl.h (C++ refuses any other), so an entry added there
 * cannot shift the others into the wrong slots. */
static const mokk_backend_iface cuda_iface = {
    .name = "cuda",
    .forward = cuda_forward_entry,
    .backward = cuda_backward_entry,
    .ctx_free = cuda_ctx_free,
    .ctx_bytes = cuda_ctx_bytes,
    .destroy = cuda_destroy,
    .buffer_alloc = cuda_buffer_alloc,
    .buffer_import = cuda_buffer_import,
    .import_begin = cuda_import_begin,
    .import_chunk = cuda_import_chunk,
    .import_commit = cuda_import_commit,
    .buffer_release = cuda_buffer_release,
    .reap = cuda_reap,
    .mem_total = cuda_mem_total,
    .events_new = cuda_events_new,
    .events_free = cuda_events_free,
    .step_begin = cuda_step_begin,
    .step_end = cuda_step_end,
    .check = cuda_check,
    .ctx_bound = cuda_ctx_bound,
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

/* The index in words (n of them, NULL ones skipped) of environment
 * variable name's value, dflt when it is unset; MOK_EINVAL listing the
 * words when it is none of them. */
static int env_word(const char *name, const char *const *words, int n, int dflt, int *out,
                    char *err)
{
  const char *v = getenv(name);
  char list[128];
  size_t len = 0;
  int last = -1;

  *out = dflt;
  if (v == NULL)
    return 0;
  for (int i = 0; i < n; i++)
    if (words[i] != NULL) {
      if (strcmp(v, words[i]) == 0) {
        *out = i;
        return 0;
      }
      last = i;
    }
  list[0] = '\0';
  for (int i = 0; i < n && len < sizeof list; i++)
    if (words[i] != NULL)
      len += (size_t)snprintf(list + len, sizeof list - len, "%s%s",
                              len == 0 ? "" : i == last ? " or " : ", ", words[i]);
  return mokk_fail(err, MOK_EINVAL, "%s: \"%s\" is not %s", name, v, list);
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
  /* The backend's defaults of the kernel choices a layer may make
   * (mokk_tuning), for measuring them against each other; the layer's own
   * choices win. Each value is the index of its word. First the tile
   * shapes (MOKK_TILES_*). */
  static const char *const tile_words[] = {"auto", "wide", "tall", "pingpong"};
  static const char *const wgrad_words[] = {"auto", "wide", NULL, "pingpong"};
  /* clusters of two blocks (1: the data gradients) against single blocks,
   * or for the forward's GEMMs too */
  static const char *const cluster_words[] = {"0", "1", "all"};
  /* the tile order of grouped GEMMs: dynamic (the default) or static */
  static const char *const order_words[] = {"dynamic", "static"};
  /* riding tails (on by default, split where that pays) against tails
   * split or whole everywhere, or on m-tiles of their own (MOKK_RIDE_*) */
  static const char *const ride_words[] = {"0", "1", "split", "whole"};
  static_assert(MOKK_RIDE_OFF == 0 && MOKK_RIDE_AUTO == 1 && MOKK_RIDE_SPLIT == 2 &&
                    MOKK_RIDE_WHOLE == 3, "ride_words follows MOKK_RIDE_*");
  /* the forward's and the weight gradients' epilogues through shared
   * memory and the copy engine (the default) against stores from registers */
  static const char *const store_words[] = {"async", "regs"};
  static const char *const off_on[] = {"0", "1"};
  /* rows picked out of x by gate/up GEMMs: by the step's shape, none, the
   * forward's and the weight gradient's, the forward's alone */
  static const char *const gather_words[] = {"auto", "0", "1", "fwd"};
  /* the stages a weight gradient's 128 x 256 tiles keep for their stores:
   * by the rows an expert, none, the last, the last two */
  static const char *const keep_words[] = {"auto", "0", "1", "2"};
  /* the gather passes by the rows they write, or by x's tokens */
  static const char *const gorder_words[] = {"rows", "tokens"};
  int tiles, wgrad, clusters, order, ride, gather, stores, halves, spread, wkeep, gorder;
  if ((rc = env_word("MOKD_GEMM_TILES", tile_words, 4, MOKK_TILES_AUTO, &tiles, err)) ||
      (rc = env_word("MOKD_GEMM_WGRAD_TILES", wgrad_words, 4, MOKK_TILES_AUTO, &wgrad, err)) ||
      (rc = env_word("MOKD_GEMM_CLUSTERS", cluster_words, 3, 1, &clusters, err)) ||
      (rc = env_word("MOKD_GEMM_ORDER", order_words, 2, 0, &order, err)) ||
      (rc = env_word("MOKD_GEMM_RIDE", ride_words, 4, MOKK_RIDE_AUTO, &ride, err)) ||
      /* rows picked out of x by the gate/up GEMMs against a gather pass
       * (auto, the default: by the step's shape, PERF.md v36) */
      (rc = env_word("MOKD_GEMM_GATHER", gather_words, 4, 0, &gather, err)))
    return rc;
  /* and the forward's dispatch on a few SMs beside gate/up against one pass
   * on all of them before it (0) */
  const char *ahead = getenv("MOKD_GATHER_AHEAD");
  long ahead_blocks = MOKK_GATHER_AHEAD_DEFAULT;
  if (ahead != NULL) {
    char *end;
    ahead_blocks = strtol(ahead, &end, 10);
    if (*ahead == '\0' || *end != '\0' || ahead_blocks < 0 || ahead_blocks > 1024)
      return mokk_fail(err, MOK_EINVAL, "MOKD_GATHER_AHEAD: \"%s\" is not a number of blocks "
                       "from 0 to 1024", ahead);
  }
  if ((rc = env_word("MOKD_GEMM_STORES", store_words, 2, 0, &stores, err)) ||
      /* the backward's d_x in column halves (the default: less memory)
       * against whole rows */
      (rc = env_word("MOKD_DX_HALVES", off_on, 2, 1, &halves, err)) ||
      /* EP steps over a buffer set per rank, the multi-GPU layout, on one GPU */
      (rc = env_word("MOKD_EP_SPREAD", off_on, 2, 0, &spread, err)) ||
      (rc = env_word("MOKD_GEMM_WGRAD_KEEP", keep_words, 4, 0, &wkeep, err)) ||
      (rc = env_word("MOKD_GATHER_ORDER", gorder_words, 2, MOKK_GATHER_TOKENS_DEFAULT, &gorder,
                     err)))
    return rc;
  if ((cb = (cuda_backend *)calloc(1, sizeof *cb)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  cuda_knobs *d = &cb->dflt;
  d->tiles = tiles, d->wgrad_tiles = wgrad, d->clusters = clusters;
  d->dynamic = order == 0, d->ride = ride, d->gather = gather - 1; /* auto: -1 */
  d->gather_ahead = (int)ahead_blocks, d->store_regs = stores, d->dx_halves = halves;
  d->wgrad_keep = wkeep - 1; /* auto: -1 */
  d->gather_tokens = gorder;
  cb->spread = spread;
  cb->k = *d;
  cb->base.iface = &cuda_iface;
  cb->base.device = device;
  cb->device = device;
  CUDA_CHECK_GOTO(cudaSetDevice(device), rc, fail);
  CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&cb->sms, cudaDevAttrMultiProcessorCount, device), rc,
                  fail);
  CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking), rc, fail);
  CUDA_CHECK_GOTO(cudaMalloc((void **)&cb->status, sizeof(int)), rc, fail);
  CUDA_CHECK_GOTO(cudaMemset(cb->status, 0, sizeof(int)), rc, fail);
  CUDA_CHECK_GOTO(cudaMalloc((void **)&cb->tile_ctr, (1 + MOKK_DEVICE_MAX_RANKS) * sizeof(int)),
                  rc, fail);
  CUDA_CHECK_GOTO(cudaMemset(cb->tile_ctr, 0, (1 + MOKK_DEVICE_MAX_RANKS) * sizeof(int)), rc,
                  fail); /* zeroed once: each GEMM leaves it at zero */
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

extern "C" void mokk_cuda_set_spread(mokk_backend *b, int on)
{
  ((cuda_backend *)b)->spread = on != 0;
}

extern "C" void mokk_cuda_set_dynamic_tiles(mokk_backend *b, int on)
{
  ((cuda_backend *)b)->dflt.dynamic = on != 0;
}

extern "C" void mokk_cuda_set_ride(mokk_backend *b, int mode)
{
  ((cuda_backend *)b)->dflt.ride = mode == MOKK_RIDE_SPLIT || mode == MOKK_RIDE_WHOLE ? mode
                              : mode != 0                                        ? MOKK_RIDE_AUTO
                                                                                 : MOKK_RIDE_OFF;
}

extern "C" void mokk_cuda_last_backward(const mokk_backend *b, mokk_cuda_bwd_info *info)
{
  *info = ((const cuda_backend *)b)->last_bwd;
}

extern "C" void mokk_cuda_step_tuning(const mokk_backend *b, mokk_tuning *t)
{
  const cuda_knobs *k = &((const cuda_backend *)b)->k;
  t->tiles = k->tiles;
  t->wgrad_tiles = k->wgrad_tiles;
  t->clusters = k->clusters + 1; /* cuda_priv.h */
  t->order = k->dynamic ? MOKK_ORDER_DYNAMIC : MOKK_ORDER_STATIC;
  t->tails = k->ride + 1;
  t->dx = k->dx_halves ? MOKK_DX_HALVES : MOKK_DX_WHOLE;
  t->dispatch_blocks = k->gather != 0   ? MOKK_DISPATCH_GATHER
                       : k->gather_ahead > 0 ? k->gather_ahead
                                             : MOKK_DISPATCH_BEFORE;
}

extern "C" void mokk_cuda_set_gather_ahead(mokk_backend *b, int blocks)
{
  ((cuda_backend *)b)->dflt.gather_ahead = blocks > 0 ? blocks : 0;
}

extern "C" void mokk_cuda_set_gather_tokens(mokk_backend *b, int on)
{
  ((cuda_backend *)b)->dflt.gather_tokens = on != 0;
}

extern "C" void mokk_cuda_set_gather(mokk_backend *b, int on)
{
  ((cuda_backend *)b)->dflt.gather = on < 0 ? MOKK_GATHER_AUTO : on == 2 ? 2 : on != 0;
}

extern "C" void mokk_cuda_set_store_regs(mokk_backend *b, int on)
{
  ((cuda_backend *)b)->dflt.store_regs = on != 0;
}

extern "C" void mokk_cuda_set_dx_halves(mokk_backend *b, int on)
{
  ((cuda_backend *)b)->dflt.dx_halves = on != 0;
}

extern "C" void mokk_cuda_set_wgrad_keep(mokk_backend *b, int keep)
{
  ((cuda_backend *)b)->dflt.wgrad_keep = keep < 0 ? -1 : keep > 2 ? 2 : keep;
}

extern "C" void mokk_cuda_set_clusters(mokk_backend *b, int mode)
{
  ((cuda_backend *)b)->dflt.clusters = mode >= 2 ? 2 : mode > 0;
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
    return mokk_fail(err, MOK_EEXPERT, "topk_ids held an expert id outside [0, E) other "
                     "than -1 (no route); those pairs were dropped");
  }
  return 0;
}


/* Peer access from device a to device b, and b's pool readable by a (the
 * pair was checked). */
static int link_pair(int a, int b, char *err)
{
  cudaMemPool_t pool;
  cudaMemAccessDesc acc;
  cudaError_t e;

  CUDA_CHECK(cudaSetDevice(a));
  e = cudaDeviceEnablePeerAccess(b, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled)
    cudaGetLastError(); /* enabled by an earlier link: not an error to keep */
  else if (e != cudaSuccess)
    return cuda_fail(err, e, "cudaDeviceEnablePeerAccess");
  /* steps allocate with cudaMallocAsync from b's default pool */
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, b));
  memset(&acc, 0, sizeof acc);
  acc.location.type = cudaMemLocationTypeDevice;
  acc.location.id = a;
  acc.flags = cudaMemAccessFlagsProtReadWrite;
  CUDA_CHECK(cudaMemPoolSetAccess(pool, &acc, 1));
  return 0;
}

extern "C" int mokk_cuda_link(mokk_backend **b, int n, char *err)
{
  int cur = 0, rc = 0;

  for (int i = 0; i < n; i++) {
    if (b[i] == NULL || b[i]->iface != &cuda_iface)
      return mokk_fail(err, MOK_EINVAL, "backend %d of the link is %s, not a CUDA backend", i,
                       mokk_backend_name(b[i]));
    if (b[i]->device >= MOKK_CUDA_MAX_DEVICES)
      return mokk_fail(err, MOK_ENOTSUP, "CUDA device %d: links cover devices 0 to %d",
                       b[i]->device, MOKK_CUDA_MAX_DEVICES - 1);
  }
  CUDA_CHECK(cudaGetDevice(&cur));
  /* every pair is checked before anything is changed */
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) {
      int a = b[i]->device, d = b[j]->device, can = 0;
      cudaError_t e;
      if (a == d)
        continue;
      if ((e = cudaDeviceCanAccessPeer(&can, a, d)) != cudaSuccess)
        return cuda_fail(err, e, "cudaDeviceCanAccessPeer");
      if (!can)
        return mokk_fail(err, MOK_ENOTSUP, "CUDA device %d cannot access the memory of "
                         "device %d (no peer access between them); the GPUs cannot be "
                         "linked, and an EP group cannot span them", a, d);
    }
  for (int i = 0; i < n && rc == 0; i++)
    for (int j = 0; j < n && rc == 0; j++)
      if (b[i]->device != b[j]->device && (rc = link_pair(b[i]->device, b[j]->device, err)) == 0)
        mokk_gpu_mem_share(b[j]->device, b[i]->device);
  for (int i = 0; i < n && rc == 0; i++)
    for (int j = 0; j < n; j++)
      if (b[i]->device != b[j]->device)
        ((cuda_backend *)b[i])->peer[b[j]->device].linked = 1;
  cudaSetDevice(cur);
  return rc;
}

extern "C" int mokk_cuda_linked(const mokk_backend *b, int device)
{
  const cuda_backend *cb = (const cuda_backend *)b;
  if (device == cb->device)
    return 1;
  return device >= 0 && device < MOKK_CUDA_MAX_DEVICES && cb->peer[device].linked;
}
