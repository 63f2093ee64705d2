/* ref.h - test helpers: a naive double-precision MoE reference (DESIGN §1),
 * deterministic random test cases, and the split of a case over EP ranks. */
#ifndef MOKT_REF_H
#define MOKT_REF_H

#include <stdint.h>

#include <check.h>

#include "backend.h"

/* The reference, in double, on P = 1 (all tokens, all experts); a pair whose
 * id is MOKK_NO_ROUTE is absent (d_topk_weights 0). With round = 1
 * it rounds h, y and the shared expert's h and ys to bf16 where the engine does;
 * with round = 0 it is the smooth function that finite differences need.
 * out and d_x come back before their final bf16 rounding. */
typedef struct ref_moe {
  int64_t T, H, I, E, K, I_s;
  double L;
  int round;
  const double *x, *tw, *w[MOKK_NWEIGHTS];
  const int32_t *ids;
} ref_moe;

void ref_forward(const ref_moe *m, double *out);
void ref_backward(const ref_moe *m, const double *d_out, double *d_x, double *d_tw,
                  double *const g[MOKK_NWEIGHTS]);

typedef enum {
  ROUTE_RANDOM,   /* K distinct random experts per token */
  ROUTE_HALF,     /* random, but only the even experts: odd ones stay empty */
  ROUTE_SAME,     /* every token picks experts 0..K-1 */
  ROUTE_DROPS,    /* random, with some pairs and some whole tokens routed nowhere
                   * (MOKK_NO_ROUTE); see case_drops */
} route_kind;

/* A whole global problem in bf16, plus everything derived from it. */
typedef struct moe_case {
  mokk_shape s;            /* s.P = 1 */
  int64_t T;               /* global tokens */
  uint16_t *x;             /* [T, H] */
  int32_t *ids;            /* [T, K] */
  float *tw;               /* [T, K] */
  uint16_t *w[MOKK_NWEIGHTS]; /* global: [E, I, H], [E, I, H], [E, H, I], shared */
  uint16_t *d_out;         /* [T, H] */
} moe_case;

void case_make(moe_case *c, const mokk_shape *s, int64_t T, uint64_t seed,
               route_kind route);
void case_free(moe_case *c);
/* Whether pair (t, k) of a ROUTE_DROPS case of K experts per token is dropped:
 * one pair of every fifth token, and every pair of every eleventh. */
int case_drops(int64_t t, int64_t k, int64_t K);
int64_t case_weight_elems(const moe_case *c, int which); /* global */

/* Outputs of one step over P ranks, stored globally ([T, H] etc.). */
typedef struct moe_out {
  uint16_t *out, *d_x;
  float *d_tw;
  uint16_t *g_bf16[MOKK_NWEIGHTS]; /* global layout; shared: rank 0's copy */
  float *g_f32[MOKK_NWEIGHTS];
  uint16_t *g_shared_copy[MOKK_NWEIGHTS]; /* the other ranks' shared grads, bf16 */
  float *g_shared_copy32[MOKK_NWEIGHTS];
} moe_out;

/* Runs forward (and backward when bwd) over P ranks; returns the engine's code.
 * In fp32 mode the gradient buffers start from `seed_grad` (a constant). */
int case_run(mokk_backend *b, const moe_case *c, int64_t P, int bwd, mokk_grad_mode mode,
             float seed_grad, moe_out *o, char *err);
/* The same, with move != 0: the backward reads the weights from a copy made
 * after the forward, whose own weights are then NaN (FSDP's reshard and
 * gather). */
int case_run_moved(mokk_backend *b, const moe_case *c, int64_t P, int bwd,
                   mokk_grad_mode mode, float seed_grad, int move, moe_out *o, char *err);
void out_free(moe_out *o);

/* Convert a case to the reference's double inputs (caller frees with ref_free). */
void case_ref(const moe_case *c, int round, ref_moe *m);
void ref_free(ref_moe *m);

double *dvec(int64_t n);
uint64_t rng_next(uint64_t *s);
double rng_uniform(uint64_t *s); /* [-1, 1) */

#endif

/* max over i of |got[i] - ref[i]| / (rel * |ref[i]| + abs_rms * rms(ref)):
 * at most 1 when every element is within tolerance. */
double close_ratio(const double *ref, const double *got, int64_t n, double rel,
                   double abs_rms);
double *bf16_to_dvec(const uint16_t *p, int64_t n);
double *f32_to_dvec(const float *p, int64_t n);

Suite *bf16_suite(void);
Suite *schedule_suite(void);
Suite *forward_suite(void);
Suite *backward_suite(void);
Suite *determinism_suite(void);
Suite *ep_suite(void);
Suite *errors_suite(void);
Suite *pool_suite(void);
Suite *frame_suite(void);
Suite *config_suite(void);
Suite *registry_suite(void);
Suite *idmap_suite(void);
Suite *ops_suite(void);
Suite *paths_suite(void);
Suite *mokctl_suite(void);
Suite *gpuid_suite(void);
Suite *wfq_suite(void);
Suite *placement_suite(void);
Suite *impcache_suite(void);
