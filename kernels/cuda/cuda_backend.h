/* cuda_backend.h - the CUDA backend: the MoE layer on one GPU, behind the
 * interface of backend.h. Every pointer handed to forward and backward is
 * device memory (16-byte aligned). Steps are queued on the backend's stream
 * and the calls return without waiting. Errors the GPU finds later (an expert
 * id outside [0, E): those pairs are dropped) travel in each step's status
 * word, which mokk_step_end queues for the client to read; a caller that uses
 * the backend directly gets them from mokk_cuda_sync(). Requires H, I and I_s
 * to be multiples of 64 and at most MOKK_DEVICE_MAX_RANKS EP ranks per step:
 * virtual ranks of its one GPU, or ranks on the GPUs of backends linked with
 * it (mokk_cuda_link), each named by its rank's `dev`. */
#ifndef MOKK_CUDA_BACKEND_H
#define MOKK_CUDA_BACKEND_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices visible (>= 0), or a negative code with a message
 * when the runtime or the driver cannot be used. */
int mokk_cuda_devices(char *err);
int mokk_cuda_create(int device, mokk_backend **out, char *err);
/* Highest CUDA ordinal + 1 that a link covers. */
#define MOKK_CUDA_MAX_DEVICES 16
/* Links the backends of n GPUs, so that the ranks of one EP step can run on
 * several of them: peer access between every pair of devices, both ways, and
 * the devices' stream-ordered pools (where steps allocate) and the arenas
 * made afterwards readable by each peer. MOK_ENOTSUP, naming the pair, when
 * two devices cannot reach each other. Backends on one device, or one
 * backend listed twice, need nothing: that is a no-op. Call it before the
 * backends run steps. */
int mokk_cuda_link(mokk_backend **b, int n, char *err);
/* Whether b's steps may place ranks on `device` (its own, or linked). */
int mokk_cuda_linked(const mokk_backend *b, int device);
/* Caps the blocks of every launch (0 = as many as the GPU holds at once); the
 * results do not depend on it. */
void mokk_cuda_set_max_blocks(mokk_backend *b, int blocks);
/* EP steps over a buffer set and a stream per rank (on != 0), the layout of
 * ranks on several GPUs, or over one shared set (0, the default). */
void mokk_cuda_set_spread(mokk_backend *b, int on);
/* Grouped GEMMs take their tiles in order from a device counter (on != 0,
 * the default) or every grid-th tile each (0); the results do not depend
 * on it. */
void mokk_cuda_set_dynamic_tiles(mokk_backend *b, int on);
/* Tails of experts' rows ride on full m-tiles (MOKD_GEMM_RIDE): split over
 * an expert's last two m-tiles in the forward's gate/up GEMM and whole on
 * the last one elsewhere (MOKK_RIDE_AUTO, the default), split everywhere
 * (MOKK_RIDE_SPLIT), whole everywhere (MOKK_RIDE_WHOLE), or off (0: each
 * tail takes an m-tile of its own). Same bits. */
enum { MOKK_RIDE_OFF = 0, MOKK_RIDE_AUTO = 1, MOKK_RIDE_SPLIT = 2, MOKK_RIDE_WHOLE = 3 };
void mokk_cuda_set_ride(mokk_backend *b, int mode);
/* The gate/up GEMMs (forward and weight gradient) pick each pair's row out
 * of x (on = 1, MOKD_GEMM_GATHER=1; Hopper), the forward's alone (2,
 * MOKD_GEMM_GATHER=fwd), or a gather pass copies the rows first (0): the
 * forward's into y's place, the backward's again before the gate/up weight
 * gradient. Same bits, and contexts of the same size. The default
 * (MOKK_GATHER_AUTO, on < 0) is 2 for a step of at least
 * MOKK_GATHER_AUTO_ROWS rows over experts of H x I <= MOKK_GATHER_AUTO_HI,
 * 0 otherwise (PERF.md v36). */
#define MOKK_GATHER_AUTO (-1)
#define MOKK_GATHER_AUTO_HI (2048 * 1536)
#define MOKK_GATHER_AUTO_ROWS 16384
void mokk_cuda_set_gather(mokk_backend *b, int on);
/* The forward's dispatch (the gathered rows of x) runs on `blocks` blocks
 * beside the gate/up GEMM, which starts on the other SMs and waits for an
 * expert's rows only as it reaches its tiles (MOKD_GATHER_AHEAD; Hopper,
 * one EP rank a step; 16 by default: PERF.md v16), or on the whole GPU
 * before it (0). Same bits. */
#define MOKK_GATHER_AHEAD_DEFAULT 16
void mokk_cuda_set_gather_ahead(mokk_backend *b, int blocks);
/* The gather passes (the forward's dispatch before gate/up, a spread
 * step's per-rank dispatch, the backward's rows of x again) read x token by
 * token, each row once, and store it to its K rows (on != 0,
 * MOKD_GATHER_ORDER=tokens, the default), or walk the rows they write (0,
 * MOKD_GATHER_ORDER=rows). The dispatch beside gate/up (MOKD_GATHER_AHEAD >
 * 0) keeps the experts' order. Same bits. */
#define MOKK_GATHER_TOKENS_DEFAULT 1
void mokk_cuda_set_gather_tokens(mokk_backend *b, int on);
/* What the last backward on the shared layout did, for tests and tuning:
 * whether d_h wrote d_g | d_u over the context's g (a last backward, Hopper,
 * H <= 3 I); the bytes it allocated. */
typedef struct mokk_cuda_bwd_info {
  int dgu_in_place;
  size_t bytes;
} mokk_cuda_bwd_info;
void mokk_cuda_last_backward(const mokk_backend *b, mokk_cuda_bwd_info *info);
/* The kernel choices the last step ran with, for tests: its layer's tuning
 * over the backend's defaults, each field an explicit choice (tiles and
 * wgrad_tiles stay MOKK_TILES_AUTO where they pick per GEMM). */
void mokk_cuda_step_tuning(const mokk_backend *b, mokk_tuning *t);
/* The forward's and the weight gradients' epilogues store from registers
 * (on != 0, MOKD_GEMM_STORES=regs) rather than through shared memory and
 * the copy engine (0, the default; Hopper). Same bits. */
void mokk_cuda_set_store_regs(mokk_backend *b, int on);
/* Clusters of two blocks (MOKD_GEMM_CLUSTERS): for the data gradients of
 * experts of more than 128 rows (1, the default), none (0), or for the
 * forward's GEMMs too, as pairs (2, "all"; Hopper). Same bits. */
void mokk_cuda_set_clusters(mokk_backend *b, int mode);
/* The backward's d_x in two column halves (on != 0, the default): its fp32
 * rows take half the memory; or whole rows (0, MOKD_DX_HALVES=0). Same bits. */
void mokk_cuda_set_dx_halves(mokk_backend *b, int on);
/* The stages a weight gradient's 128 x 256 tiles keep for their stores
 * (MOKD_GEMM_WGRAD_KEEP): none, both warpgroups through a staging area (0);
 * the last, warpgroup 1 through half a staging area (1); the last two (2);
 * or by the rows an expert (-1, the default; Hopper). Same bits. */
void mokk_cuda_set_wgrad_keep(mokk_backend *b, int keep);
int mokk_cuda_device(const mokk_backend *b);
/* The stream every step runs on (a cudaStream_t). */
void *mokk_cuda_stream(mokk_backend *b);
/* Waits for the queued work; returns the first error it met, if any. */
int mokk_cuda_sync(mokk_backend *b, char *err);

/* The UUID of CUDA device `device` (16 bytes, cuDeviceGetUuid_v2's), which
 * names the GPU the same way in every process. */
int mokk_cuda_uuid(int device, uint8_t uuid[16], char *err);

/* A GPU arena: a cuMem allocation of `bytes` (rounded up to the device's
 * granularity) mapped at ptr and exportable as a POSIX fd. */
typedef struct mokk_gpu_mem {
  void *ptr;
  size_t bytes;
  unsigned long long handle;
  int device;
} mokk_gpu_mem;

/* *fd is the exported handle (the caller closes it when sent). */
int mokk_gpu_mem_create(int device, size_t bytes, mokk_gpu_mem *m, int *fd, char *err);
/* Waits for the device, then unmaps and releases. */
void mokk_gpu_mem_free(mokk_gpu_mem *m);

#ifdef __cplusplus
}
#endif

#endif
