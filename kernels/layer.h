/* layer.h - what every backend computes: the MoE layer shape, one EP rank's
 * inputs and outputs, and the routing plan (DESIGN §1, §2). Backend-neutral:
 * the validation and the plan here are the contract the backends share. */
#ifndef MOKK_LAYER_H
#define MOKK_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "mok_errno.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest single dimension accepted; keeps every index product inside int64. */
#define MOKK_DIM_MAX (1 << 24)

/* The expert id of a pair with no route, as DeepEP and Megatron mark one: the
 * pair is absent. It adds nothing to out and its d_topk_weights is 0. */
#define MOKK_NO_ROUTE (-1)

/* How a layer's kernels run (mok_layer_tuning, by value): speed and memory,
 * never the bits. 0 in a field: the backend's default. */
enum { MOKK_TILES_AUTO, MOKK_TILES_WIDE, MOKK_TILES_TALL, MOKK_TILES_PINGPONG, MOKK_TILES_COUNT };
enum { MOKK_CLUSTERS_AUTO, MOKK_CLUSTERS_NONE, MOKK_CLUSTERS_DGRAD, MOKK_CLUSTERS_ALL,
       MOKK_CLUSTERS_COUNT };
enum { MOKK_ORDER_AUTO, MOKK_ORDER_DYNAMIC, MOKK_ORDER_STATIC, MOKK_ORDER_COUNT };
enum { MOKK_TAILS_AUTO, MOKK_TAILS_OWN, MOKK_TAILS_RIDE, MOKK_TAILS_SPLIT, MOKK_TAILS_WHOLE,
       MOKK_TAILS_COUNT };
enum { MOKK_DX_AUTO, MOKK_DX_HALVES, MOKK_DX_WHOLE, MOKK_DX_COUNT };
#define MOKK_DISPATCH_BEFORE (-1)
#define MOKK_DISPATCH_GATHER (-2) /* no dispatch: gate/up reads x's rows itself */
#define MOKK_DISPATCH_BLOCKS_MAX 1024

typedef struct mokk_tuning {
  int tiles;       /* MOKK_TILES_*: the forward's and data gradients' grouped GEMMs */
  int wgrad_tiles; /* MOKK_TILES_* but TALL: the weight gradients' */
  int clusters;    /* MOKK_CLUSTERS_* */
  int order;       /* MOKK_ORDER_* */
  int tails;       /* MOKK_TAILS_* */
  int dx;          /* MOKK_DX_* */
  int dispatch_blocks; /* 0, MOKK_DISPATCH_BEFORE, _GATHER or 1..MOKK_DISPATCH_BLOCKS_MAX */
} mokk_tuning;

typedef struct mokk_shape {
  int64_t H;          /* hidden size */
  int64_t I;          /* routed expert intermediate size */
  int64_t E;          /* experts in total */
  int64_t K;          /* routed experts per token */
  int64_t I_s;        /* shared expert intermediate size, 0 = none */
  int64_t P;          /* EP ranks; experts e live on rank e / (E / P) */
  float swiglu_limit; /* 0 = off; applies to routed and shared experts */
  mokk_tuning tune;   /* the layer's kernel options; all 0: the backend's defaults */
} mokk_shape;

/* Weight tensors of one rank, nn.Linear layout (out x in), bf16. */
enum {
  MOKK_W_GATE,   /* [E_local, I, H] */
  MOKK_W_UP,     /* [E_local, I, H] */
  MOKK_W_DOWN,   /* [E_local, H, I] */
  MOKK_S_GATE,   /* [I_s, H] */
  MOKK_S_UP,     /* [I_s, H] */
  MOKK_S_DOWN,   /* [H, I_s] */
  MOKK_NWEIGHTS
};

typedef enum {
  MOKK_GRAD_BF16 = 0,      /* weight gradients written as bf16 */
  MOKK_GRAD_FP32_ACCUM = 1 /* weight gradients added into caller fp32 buffers */
} mokk_grad_mode;

struct mokk_backend;

/* One EP rank's part of a forward step. dev: the backend of the GPU the
 * rank runs on, a CUDA backend linked with the step's (mokk_cuda_link);
 * NULL (or the step's backend itself) runs it where the step runs. */
typedef struct mokk_fwd_rank {
  const uint16_t *x;          /* [T, H] bf16 */
  const int32_t *topk_ids;    /* [T, K] global expert ids, or MOKK_NO_ROUTE */
  const float *topk_weights;  /* [T, K] */
  const uint16_t *w[MOKK_NWEIGHTS];
  uint16_t *out;              /* [T, H] bf16 */
  struct mokk_backend *dev;
} mokk_fwd_rank;

/* One EP rank's part of a backward step (dev: where its forward ran, as
 * mokk_fwd_rank names it). Weight gradients go to g_bf16 or to
 * g_f32 (added into) as the grad mode says; the shared expert's gradient is
 * the reduction over every rank's tokens and is written for every rank.
 * w: where the weights are now, when they moved since the forward (FSDP
 * frees its gathered weights after the forward and gathers them again,
 * elsewhere, before the backward); the values must be the forward's. All
 * NULL: the forward's pointers. */
typedef struct mokk_bwd_rank {
  const uint16_t *d_out;      /* [T, H] bf16 */
  uint16_t *d_x;              /* [T, H] bf16 */
  float *d_topk_weights;      /* [T, K] fp32 */
  uint16_t *g_bf16[MOKK_NWEIGHTS];
  float *g_f32[MOKK_NWEIGHTS];
  const uint16_t *w[MOKK_NWEIGHTS];
  struct mokk_backend *dev;
} mokk_bwd_rank;

/* Routing plan of one step over P ranks of T tokens each. Rows of expert e's
 * segment are ordered by global token id (r * T + t), then k. A pair is
 * (r, t, k); its global pair index is (r * T + t) * K + k. */
typedef struct mokk_plan {
  int64_t P, T, K, E, E_local;
  int64_t *count;      /* [P * E]   pairs of rank r routed to expert e */
  int64_t *seg_rows;   /* [E]       rows of expert e, all ranks together */
  int64_t *seg_start;  /* [E]       first row of e in its owner's receive buffer */
  int64_t *recv_rows;  /* [P]       rows each rank receives */
  int64_t *recv_base;  /* [P + 1]   where rank p's rows start in src[]; recv_base[P]:
                        *           the routed pairs (pairs with no route have no row) */
  int64_t *slot;       /* [P*T*K]   row in the owner's receive buffer, per global pair;
                        *           -1 for a pair with no route */
  int64_t *src;        /* [recv_base[P]] global pair index, per row, ranks concatenated */
} mokk_plan;

int mokk_shape_check(const mokk_shape *s, char *err);
/* Checks every field of t is in range (mokk_shape_check does it too). */
int mokk_tuning_check(const mokk_tuning *t, char *err);
int64_t mokk_weight_elems(const mokk_shape *s, int which);

/* At least the bytes any backend's forward context holds for a step of T
 * tokens per rank: per routed pair its x, g, u, h and y rows and its
 * routing, per token the shared expert's rows, and the plan's per-expert
 * arrays. Known before the step, so that a quota can refuse a context
 * before any of it is allocated. UINT64_MAX when it overflows. */
uint64_t mokk_ctx_bytes_bound(const mokk_shape *s, int64_t T);
/* The same for a step laid out as ranks on several GPUs run it (the CUDA
 * backend's spread layout), where each rank's buffers are sized for every
 * pair landing on its experts: P times the above, and each rank's
 * alignment slop. */
uint64_t mokk_ctx_bytes_bound_spread(const mokk_shape *s, int64_t T);

/* Checks shapes, pointers and expert ids of a forward step over s->P ranks. */
int mokk_fwd_check(const mokk_shape *s, int64_t T, const mokk_fwd_rank *ranks,
                   char *err);
int mokk_bwd_check(const mokk_shape *s, int64_t T, mokk_grad_mode mode,
                   const mokk_bwd_rank *ranks, char *err);

/* Builds the plan from the ranks' topk_ids (ranks[r] is rank r's [T, K]). */
int mokk_plan_build(mokk_plan *plan, const mokk_shape *s, int64_t T,
                    const int32_t *const *topk_ids, char *err);
void mokk_plan_free(mokk_plan *plan);

/* Formats an error message into err (MOK_ERRLEN bytes) and returns code. */
int mokk_fail(char *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#ifdef __cplusplus
}
#endif

#endif
