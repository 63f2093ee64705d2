/* check_daemon_steps.c - steps through the socket: results equal the
 * in-process engine bit for bit, clients run concurrently, a killed client
 * leaves nothing, outputs reuse their room, quotas hold. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon_fixture.h"
#include "frame.h"
#include "ref.h"
#include "testbed.h"

/* ---- results through the socket equal the engine ------------------------- */

typedef struct engine_out {
  uint16_t *out, *d_x, *g16[MOK_NWEIGHTS];
  float *d_tw, *g32[MOK_NWEIGHTS];
} engine_out;

static void engine_run(mok_client *c, const mok_testbed *tb, int bwd, mokk_grad_mode mode,
                       engine_out *o)
{
  mokk_backend *b;
  char err[MOK_ERRLEN];
  mokk_shape s = {.H = tb->d.hidden, .I = tb->d.intermediate, .E = tb->d.experts,
                  .K = tb->d.top_k, .I_s = tb->d.shared_intermediate, .P = 1,
                  .swiglu_limit = tb->d.swiglu_limit};
  size_t TH = (size_t)(tb->T * s.H);
  mokk_fwd_rank fr = {0};
  mokk_bwd_rank br = {0};
  mokk_ctx *ctx = NULL;

  memset(o, 0, sizeof *o);
  o->out = malloc(TH * 2), o->d_x = malloc(TH * 2);
  o->d_tw = malloc((size_t)(tb->T * s.K) * 4);
  fr.x = mok_tensor_ptr(c, &tb->x), fr.topk_ids = mok_tensor_ptr(c, &tb->ids);
  fr.topk_weights = mok_tensor_ptr(c, &tb->tw), fr.out = o->out;
  br.d_out = mok_tensor_ptr(c, &tb->d_out), br.d_x = o->d_x, br.d_topk_weights = o->d_tw;
  for (int w = 0; w < tb->nweights; w++) {
    size_t n = mok_tensor_bytes(&tb->w[w]) / 2;
    fr.w[w] = mok_tensor_ptr(c, &tb->w[w]);
    br.g_bf16[w] = o->g16[w] = malloc(n * 2);
    br.g_f32[w] = o->g32[w] = calloc(n, 4);
  }
  ck_assert_int_eq(mokk_cpu_create(1, &b, err), 0);
  ck_assert_int_eq(mokk_forward(b, &s, tb->T, &fr, bwd ? &ctx : NULL, err), 0);
  if (bwd)
    ck_assert_int_eq(mokk_backward(b, ctx, mode, &br, err), 0);
  mokk_ctx_free(b, ctx);
  mokk_backend_destroy(b);
}

static void engine_free(engine_out *o)
{
  free(o->out), free(o->d_x), free(o->d_tw);
  for (int w = 0; w < MOK_NWEIGHTS; w++)
    free(o->g16[w]), free(o->g32[w]);
}

/* A bf16 step through the daemon has the engine's bits, every output. */
static void expect_engine_bits(const mok_testbed *tb, const mok_forward_result *f,
                               const mok_backward_result *b, const engine_out *e)
{
  size_t TH = (size_t)(tb->T * tb->d.hidden) * 2, TK = (size_t)(tb->T * tb->d.top_k) * 4;
  ck_assert(memcmp(f->out_ptr, e->out, TH) == 0);
  ck_assert(memcmp(b->d_x_ptr, e->d_x, TH) == 0);
  ck_assert(memcmp(b->d_topk_weights_ptr, e->d_tw, TK) == 0);
  ck_assert_int_eq(b->ngrads, tb->nweights);
  for (int w = 0; w < tb->nweights; w++)
    ck_assert_msg(memcmp(b->grad_ptrs[w], e->g16[w], mok_tensor_bytes(&tb->w[w])) == 0,
                  "gradient %d", w);
}

/* A testbed of T tokens, the engine's bf16 step on it, and a training
 * forward of it through the daemon. */
static void engine_and_forward(mok_client *c, const mok_layer_desc *d, int64_t T, uint64_t seed,
                               mok_testbed *tb, engine_out *e, mok_forward_result *f)
{
  ck_assert_int_eq(mok_testbed_setup(c, d, T, seed, tb), 0);
  engine_run(c, tb, 1, MOKK_GRAD_BF16, e);
  ck_assert_int_eq(mok_forward(c, tb->layer, &tb->x, &tb->ids, &tb->tw, 0, f), 0);
}

START_TEST(forward_backward_equal_engine)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 96, .intermediate = 64, .experts = 8, .top_k = 2,
                      .shared_intermediate = 48, .swiglu_limit = 0.75f};
  mok_testbed tb;
  mok_forward_result f;
  mok_backward_result b;
  engine_out e;

  engine_and_forward(c, &d, 100, 3, &tb, &e, &f);
  ck_assert_int_eq(mok_backward(c, f.context, &tb.d_out, NULL, 0, &b), 0);
  expect_engine_bits(&tb, &f, &b, &e);
  engine_free(&e);

  /* fp32 accumulation into client buffers: twice from zero gives 2 * once */
  mok_testbed t2;
  d.grad_mode = MOK_GRAD_FP32_ACCUM;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 37, 4, &t2), 0);
  engine_run(c, &t2, 1, MOKK_GRAD_FP32_ACCUM, &e);
  ck_assert_int_eq(mok_forward(c, t2.layer, &t2.x, &t2.ids, &t2.tw, 0, &f), 0);
  ck_assert_int_eq(mok_backward(c, f.context, &t2.d_out, t2.g32, 6, &b), 0);
  ck_assert_int_eq(b.ngrads, 0);
  for (int w = 0; w < 6; w++)
    ck_assert(memcmp(mok_tensor_ptr(c, &t2.g32[w]), e.g32[w], mok_tensor_bytes(&t2.g32[w])) ==
              0);
  ck_assert_int_eq(mok_backward(c, f.context, &t2.d_out, t2.g32, 6, &b), 0);
  const float *g = mok_tensor_ptr(c, &t2.g32[MOK_W_DOWN]);
  for (size_t i = 0; i < mok_tensor_bytes(&t2.g32[MOK_W_DOWN]) / 4; i++)
    ck_assert(g[i] == e.g32[MOK_W_DOWN][i] + e.g32[MOK_W_DOWN][i]);
  engine_free(&e);
  mok_close(c);
}
END_TEST

/* A layer's kernel options travel to the daemon and change no bit: a layer
 * choosing every option gives the engine's results; values out of range
 * are refused with the daemon's message naming the field, and a refused
 * layer is not created. */
START_TEST(tuned_layer_equals_engine)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 64, .intermediate = 64, .experts = 8, .top_k = 2,
                      .shared_intermediate = 64};
  mok_layer_tuning t;
  mok_testbed tb;
  mok_forward_result f;
  mok_backward_result b;
  mok_stats st;
  engine_out e;
  uint64_t layer;
  char err[MOK_ERRLEN];

  ck_assert_int_eq(mok_layer_tuning_parse(&t, "tiles=tall,wgrad_tiles=pingpong,clusters=none,"
                                          "order=static,tails=own,dx=whole,dispatch=before",
                                          err),
                   0);
  ck_assert_int_eq(mok_testbed_setup_tuned(c, &d, &t, 40, 11, &tb), 0);
  engine_run(c, &tb, 1, MOKK_GRAD_BF16, &e);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), 0);
  ck_assert_int_eq(mok_backward(c, f.context, &tb.d_out, NULL, 0, &b), 0);
  expect_engine_bits(&tb, &f, &b, &e);
  engine_free(&e);

  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  uint64_t layers = st.session.layers;
  static const struct {
    mok_layer_tuning t;
    const char *msg;
  } bad[] = {
      {{.tiles = (mok_tiles)7}, "tuning: tiles is 7; it must be 0 (the default) to 3"},
      {{.wgrad_tiles = MOK_TILES_TALL}, "tuning: wgrad_tiles cannot be tall"},
      {{.tails = (mok_tails)-3}, "tuning: tails is -3"},
      {{.dispatch_blocks = 5000}, "tuning: dispatch_blocks is 5000"},
      {{.dispatch_blocks = -3}, "tuning: dispatch_blocks is -3"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_int_eq(mok_layer_create_tuned(c, &d, &bad[i].t, &layer), MOK_EINVAL);
    ck_assert_msg(strstr(mok_last_error(c), bad[i].msg) != NULL, "%s", mok_last_error(c));
  }
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.layers, layers);
  /* NULL and all-default options are a plain layer */
  memset(&t, 0, sizeof t);
  ck_assert_int_eq(mok_layer_create_tuned(c, &d, &t, &layer), 0);
  ck_assert_int_eq(mok_layer_create_tuned(c, &d, NULL, &layer), 0);
  ck_assert_int_eq(mok_layer_create_tuned(c, &d, &t, NULL), MOK_ENULL);
  mok_close(c);
}
END_TEST

/* A context's last Backward (MOK_BACKWARD_LAST) gives the engine's bits;
 * the daemon then refuses any other Backward of the context, at once and
 * naming why; the context still owns out until released; unknown flags
 * never leave the client. */
START_TEST(last_backward_uses_up_the_context)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 64, .intermediate = 64, .experts = 4, .top_k = 2,
                      .shared_intermediate = 64};
  mok_testbed tb;
  engine_out e;
  mok_forward_result f;
  mok_backward_result b;
  mok_stats st;

  engine_and_forward(c, &d, 50, 7, &tb, &e, &f);
  ck_assert_int_eq(mok_backward_flags(c, f.context, &tb.d_out, NULL, 0, NULL, 4, &b),
                   MOK_EINVAL);
  ck_assert_msg(strstr(mok_last_error(c), "unknown backward flags 0x4") != NULL, "%s",
                mok_last_error(c));
  ck_assert_msg(mok_backward_flags(c, f.context, &tb.d_out, NULL, 0, NULL, MOK_BACKWARD_LAST,
                                   &b) == 0,
                "%s", mok_last_error(c));
  expect_engine_bits(&tb, &f, &b, &e);
  ck_assert_int_eq(mok_backward(c, f.context, &tb.d_out, NULL, 0, &b), MOK_ECONTEXT);
  ck_assert_msg(strstr(mok_last_error(c), "used up by an earlier Backward with last set") !=
                    NULL,
                "%s", mok_last_error(c));
  ck_assert_int_eq(mok_backward_flags(c, f.context, &tb.d_out, NULL, 0, NULL,
                                      MOK_BACKWARD_LAST, &b),
                   MOK_ECONTEXT);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.contexts, 1); /* still held: it owns out */
  ck_assert_int_eq(mok_release(c, &f.context, 1), 0);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.contexts, 0);
  engine_free(&e);
  mok_close(c);
}
END_TEST

/* A context keeps its layer's gradient mode: destroying the layer must not
 * turn an fp32-accumulating backward into a bf16 one. */
START_TEST(context_keeps_its_gradient_mode)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2,
                      .grad_mode = MOK_GRAD_FP32_ACCUM};
  mok_testbed tb;
  mok_forward_result f;
  mok_backward_result b;
  engine_out e;

  ck_assert_int_eq(mok_testbed_setup(c, &d, 16, 6, &tb), 0);
  engine_run(c, &tb, 1, MOKK_GRAD_FP32_ACCUM, &e);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), 0);
  ck_assert_int_eq(mok_layer_destroy(c, tb.layer), 0);
  ck_assert_msg(mok_backward(c, f.context, &tb.d_out, tb.g32, 3, &b) == 0, "%s",
                mok_last_error(c));
  ck_assert_int_eq(b.ngrads, 0);
  for (int w = 0; w < 3; w++)
    ck_assert(memcmp(mok_tensor_ptr(c, &tb.g32[w]), e.g32[w], mok_tensor_bytes(&tb.g32[w])) ==
              0);
  /* and still no bf16 gradients come back without buffers */
  ck_assert_int_eq(mok_backward(c, f.context, &tb.d_out, NULL, 0, &b), MOK_EINVAL);
  ck_assert_msg(strstr(mok_last_error(c), "accumulates fp32 gradients") != NULL, "%s",
                mok_last_error(c));
  engine_free(&e);
  mok_close(c);
}
END_TEST

/* FSDP's reshard and gather between a forward and its backward: the weights
 * are copied into a new arena (moved[]), and their old memory holds NaN. */
static void move_weights(mok_client *c, const mok_testbed *tb, mok_tensor *moved)
{
  mok_arena_info a;
  size_t at = 0, total = 0;

  for (int w = 0; w < tb->nweights; w++)
    total += (mok_tensor_bytes(&tb->w[w]) + 255) / 256 * 256;
  ck_assert_int_eq(mok_arena_create(c, total, &a), 0);
  memset(moved, 0, MOK_NWEIGHTS * sizeof *moved);
  for (int w = 0; w < tb->nweights; w++) {
    size_t n = mok_tensor_bytes(&tb->w[w]);
    uint16_t *old = mok_tensor_ptr(c, &tb->w[w]);
    moved[w] = mok_tensor_make(a.id, at, MOK_DTYPE_BF16, tb->w[w].ndim, tb->w[w].shape);
    memcpy(mok_tensor_ptr(c, &moved[w]), old, n);
    for (size_t i = 0; i < n / 2; i++)
      old[i] = 0x7fc0;
    at += (n + 255) / 256 * 256;
  }
}

/* A backward that names where the weights are now reads them there: the
 * bits of the engine's backward over the weights where they were, though the
 * forward's weight memory now holds NaN. */
START_TEST(backward_reads_weights_where_they_are_now)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 96, .intermediate = 64, .experts = 8, .top_k = 2,
                      .shared_intermediate = 48, .swiglu_limit = 0.75f};
  mok_testbed tb;
  mok_tensor moved[MOK_NWEIGHTS];
  mok_forward_result f;
  mok_backward_result b;
  engine_out e;

  ck_assert_int_eq(mok_testbed_setup(c, &d, 100, 7, &tb), 0);
  engine_run(c, &tb, 1, MOKK_GRAD_BF16, &e);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), 0);
  move_weights(c, &tb, moved);
  ck_assert_msg(mok_backward_weights(c, f.context, &tb.d_out, NULL, 0, moved, &b) == 0, "%s",
                mok_last_error(c));
  ck_assert(memcmp(b.d_x_ptr, e.d_x, (size_t)(100 * 96) * 2) == 0);
  ck_assert(memcmp(b.d_topk_weights_ptr, e.d_tw, (size_t)(100 * 2) * 4) == 0);
  ck_assert_int_eq(b.ngrads, 6);
  for (int w = 0; w < 6; w++)
    ck_assert_msg(memcmp(b.grad_ptrs[w], e.g16[w], mok_tensor_bytes(&tb.w[w])) == 0,
                  "gradient %d", w);
  /* without them it reads the forward's memory, NaN now */
  ck_assert_int_eq(mok_backward(c, f.context, &tb.d_out, NULL, 0, &b), 0);
  ck_assert(memcmp(b.d_x_ptr, e.d_x, (size_t)(100 * 96) * 2) != 0);
  engine_free(&e);

  /* fp32 accumulation, no shared expert: the same */
  mok_testbed t2;
  d.grad_mode = MOK_GRAD_FP32_ACCUM;
  d.shared_intermediate = 0;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 37, 8, &t2), 0);
  engine_run(c, &t2, 1, MOKK_GRAD_FP32_ACCUM, &e);
  ck_assert_int_eq(mok_forward(c, t2.layer, &t2.x, &t2.ids, &t2.tw, 0, &f), 0);
  move_weights(c, &t2, moved);
  ck_assert_msg(mok_backward_weights(c, f.context, &t2.d_out, t2.g32, 3, moved, &b) == 0, "%s",
                mok_last_error(c));
  ck_assert(memcmp(b.d_x_ptr, e.d_x, (size_t)(37 * 96) * 2) == 0);
  for (int w = 0; w < 3; w++)
    ck_assert(memcmp(mok_tensor_ptr(c, &t2.g32[w]), e.g32[w], mok_tensor_bytes(&t2.g32[w])) ==
              0);
  engine_free(&e);
  mok_close(c);
}
END_TEST

static void expect_bwd_error(mok_client *c, uint64_t ctx, const mok_testbed *tb,
                             const mok_tensor *w, int code, const char *needle)
{
  mok_backward_result b;
  int rc = mok_backward_weights(c, ctx, &tb->d_out, NULL, 0, w, &b);
  ck_assert_msg(rc == code, "got %d (%s), want %d (%s): %s", rc, mok_err_name(rc), code,
                mok_err_name(code), mok_last_error(c));
  ck_assert_msg(strstr(mok_last_error(c), needle) != NULL, "\"%s\" lacks \"%s\"",
                mok_last_error(c), needle);
}

/* Weights a backward names are checked as SetWeights checks them, each
 * failure naming the weight; nothing is computed and the context stays. */
START_TEST(backward_weights_are_checked)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 96, .intermediate = 64, .experts = 8, .top_k = 2,
                      .shared_intermediate = 32};
  mok_testbed tb;
  mok_tensor w[MOK_NWEIGHTS];
  mok_forward_result f;
  mok_backward_result b;
  mok_stats st;

  ck_assert_int_eq(mok_testbed_setup(c, &d, 20, 9, &tb), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), 0);
  memcpy(w, tb.w, sizeof w);
  w[MOK_S_GATE].ndim = w[MOK_S_UP].ndim = w[MOK_S_DOWN].ndim = 0;
  expect_bwd_error(c, f.context, &tb, w, MOK_EINVAL, "Backward names 3 weights; the layer "
                   "has 6");
  memcpy(w, tb.w, sizeof w);
  w[MOK_S_GATE].ndim = 0;
  expect_bwd_error(c, f.context, &tb, w, MOK_EINVAL, "weights[4] is given but weights[3] "
                   "(s_gate) is absent");
  memcpy(w, tb.w, sizeof w);
  w[MOK_W_UP].ndim = 0;
  expect_bwd_error(c, f.context, &tb, w, MOK_EINVAL, "weights[1] is absent");
  memcpy(w, tb.w, sizeof w);
  w[MOK_W_GATE] = tb.w[MOK_W_DOWN];
  expect_bwd_error(c, f.context, &tb, w, MOK_ESHAPE, "weights[0] (w_gate): dimension 1 is 96; "
                   "it must be 64");
  memcpy(w, tb.w, sizeof w);
  w[MOK_S_DOWN].dtype = MOK_DTYPE_F32;
  expect_bwd_error(c, f.context, &tb, w, MOK_EDTYPE, "weights[5] (s_down): dtype is f32");
  memcpy(w, tb.w, sizeof w);
  w[MOK_W_DOWN].arena = 987654321;
  expect_bwd_error(c, f.context, &tb, w, MOK_ENOENT, "weights[2] (w_down): arena 987654321 is "
                   "not an arena of this session");
  memcpy(w, tb.w, sizeof w);
  w[MOK_S_UP].offset = tb.arena.bytes - 2;
  expect_bwd_error(c, f.context, &tb, w, MOK_ERANGE, "weights[4] (s_up): bytes [");
  memcpy(w, tb.w, sizeof w);
  w[MOK_W_UP].offset += 1;
  expect_bwd_error(c, f.context, &tb, w, MOK_EINVAL, "weights[1] (w_up): offset");
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.backwards, 0); /* nothing was computed */
  /* the context is still there for a good backward */
  ck_assert_msg(mok_backward_weights(c, f.context, &tb.d_out, NULL, 0, tb.w, &b) == 0, "%s",
                mok_last_error(c));
  mok_close(c);
}
END_TEST

typedef struct worker_arg {
  int index, failures, done;
} worker_arg;

static void *client_worker(void *p)
{
  worker_arg *a = p;
  mok_client *c;
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 8, .top_k = 2,
                      .shared_intermediate = a->index % 2 ? 16 : 0};
  mok_testbed tb;
  engine_out e;

  if (mok_connect(sock, "worker", &c) != 0 ||
      mok_testbed_setup(c, &d, 40 + a->index, (uint64_t)a->index, &tb) != 0) {
    a->failures = 50;
    return NULL;
  }
  engine_run(c, &tb, 0, MOKK_GRAD_BF16, &e);
  for (int i = 0; i < 50; i++) {
    mok_forward_result f;
    if (mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f) != 0 ||
        memcmp(f.out_ptr, e.out, (size_t)(tb.T * 64) * 2) != 0 ||
        mok_release(c, &f.context, 1) != 0)
      a->failures++;
    else
      a->done++;
  }
  engine_free(&e);
  mok_close(c);
  return NULL;
}

START_TEST(eight_concurrent_clients)
{
  pthread_t th[8];
  worker_arg args[8] = {0};
  for (int i = 0; i < 8; i++) {
    args[i].index = i;
    pthread_create(&th[i], NULL, client_worker, &args[i]);
  }
  for (int i = 0; i < 8; i++) {
    pthread_join(th[i], NULL);
    ck_assert_msg(args[i].failures == 0 && args[i].done == 50,
                  "client %d: %d of 50 right, %d failed", i, args[i].done, args[i].failures);
  }
  mok_client *c = connect_ok();
  mok_stats st;
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_ge(st.daemon.forwards, 400);
  mok_close(c);
}
END_TEST

/* Until the daemon holds one session and no arenas, 20 s at most: a killed
 * client's session goes once its step is done, which the ASan build on a
 * loaded machine took more than 5 s to finish. */
static void wait_idle(mok_client *c, mok_stats *st)
{
  for (int i = 0; i < 2000; i++) {
    ck_assert_int_eq(mok_stats_get(c, st), 0);
    if (st->daemon.sessions == 1 && st->daemon.arenas == 0)
      return;
    usleep(10000);
  }
}

START_TEST(killed_client_leaks_nothing)
{
  int pfd[2];
  ck_assert_int_eq(pipe(pfd), 0);
  pid_t child = fork();
  if (child == 0) {
    /* a big forward, so the kill lands while the daemon computes it */
    mok_client *c;
    mok_layer_desc d = {.hidden = 512, .intermediate = 512, .experts = 8, .top_k = 4,
                        .shared_intermediate = 256};
    mok_testbed tb;
    mok_forward_result f;
    if (mok_connect(sock, "victim", &c) != 0 || mok_testbed_setup(c, &d, 4096, 9, &tb) != 0)
      _exit(1);
    if (write(pfd[1], "x", 1) != 1)
      _exit(1);
    mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f);
    _exit(0);
  }
  char ch;
  ck_assert_int_eq(read(pfd[0], &ch, 1), 1);
  usleep(50000);
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);

  mok_client *c = connect_ok();
  mok_stats st;
  wait_idle(c, &st);
  ck_assert_uint_eq(st.daemon.sessions, 1);
  ck_assert_uint_eq(st.daemon.arenas, 0);
  ck_assert_uint_eq(st.daemon.arena_bytes, 0);
  ck_assert_uint_eq(st.daemon.contexts, 0);
  ck_assert_uint_eq(st.daemon.context_bytes, 0);
  ck_assert_uint_eq(st.daemon.layers, 0);
  /* and the next client is served */
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2};
  mok_testbed tb;
  mok_forward_result f;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 16, 1, &tb), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f), 0);
  mok_close(c);
}
END_TEST


/* Outputs of each step go back into the room the last one of their size
 * left: a small forward output must not split the block the weight
 * gradients come back to (else each backward needs a new arena). */
START_TEST(outputs_reuse_their_room)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 1024, .intermediate = 1024, .experts = 16, .top_k = 2};
  mok_testbed tb;
  mok_forward_result f1, f2;
  mok_backward_result b1, b2;
  mok_stats st0, st;

  ck_assert_int_eq(mok_testbed_setup(c, &d, 4, 3, &tb), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f1), 0);
  ck_assert_int_eq(mok_backward(c, f1.context, &tb.d_out, NULL, 0, &b1), 0);
  ck_assert(b1.grads[0].arena != f1.out.arena); /* 96 MB of gradients: an arena of its own */
  ck_assert_int_eq(mok_stats_get(c, &st0), 0);
  ck_assert_int_eq(mok_release(c, &b1.result, 1), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f2), 0);
  ck_assert_uint_eq(f2.out.arena, f1.out.arena);
  ck_assert_int_eq(mok_backward(c, f2.context, &tb.d_out, NULL, 0, &b2), 0);
  ck_assert_uint_eq(b2.grads[0].arena, b1.grads[0].arena);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.arenas, st0.session.arenas);
  mok_close(c);
}
END_TEST

START_TEST(expert_id_out_of_range_through_daemon)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2};
  mok_testbed tb;
  mok_forward_result f;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 8, 2, &tb), 0);
  ((int32_t *)mok_tensor_ptr(c, &tb.ids))[5] = 4;
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), MOK_EEXPERT);
  ck_assert_ptr_nonnull(strstr(mok_last_error(c), "token 2 k 1: expert id 4"));
  mok_stats st;
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.contexts, 0); /* the failed step left nothing */
  ((int32_t *)mok_tensor_ptr(c, &tb.ids))[5] = 3;
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), 0);
  mok_close(c);
}
END_TEST

/* The ids live in the client's arena: a client thread flips one between a
 * valid expert and ids far outside [0, E) while forwards run. Each forward is
 * either refused for that id or computes with the valid one, bit for bit. */
typedef struct id_flipper {
  volatile int32_t *id;
  atomic_int stop;
} id_flipper;

static void *flip_ids(void *p)
{
  id_flipper *f = p;
  for (uint32_t n = 0; !atomic_load(&f->stop); n++)
    *f->id = n % 3 == 0 ? 1 : n % 3 == 1 ? 0x40000000 : -0x40000000;
  return NULL;
}

START_TEST(ids_flipped_during_forwards_are_contained)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 8, .top_k = 2};
  mok_testbed tb;
  engine_out e;
  id_flipper f;
  pthread_t th;
  int ok = 0, refused = 0;

  ck_assert_int_eq(mok_testbed_setup(c, &d, 512, 4, &tb), 0);
  f.id = (int32_t *)mok_tensor_ptr(c, &tb.ids) + 5;
  *f.id = 1;
  atomic_init(&f.stop, 0);
  engine_run(c, &tb, 0, MOKK_GRAD_BF16, &e);
  ck_assert_int_eq(pthread_create(&th, NULL, flip_ids, &f), 0);
  for (int i = 0; i < 300; i++) {
    mok_forward_result r;
    int rc = mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, i % 2, &r);
    if (rc == 0) {
      ck_assert_msg(memcmp(r.out_ptr, e.out, (size_t)(512 * 64) * 2) == 0, "forward %d", i);
      ck_assert_int_eq(mok_release(c, &r.context, 1), 0);
      ok++;
    } else {
      ck_assert_msg(rc == MOK_EEXPERT, "forward %d: %s", i, mok_last_error(c));
      ck_assert_ptr_nonnull(strstr(mok_last_error(c), "token 2 k 1: expert id "));
      refused++;
    }
  }
  atomic_store(&f.stop, 1);
  pthread_join(th, NULL);
  ck_assert_int_eq(ok + refused, 300);
  mok_stats st;
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.contexts, 0);
  engine_free(&e);
  mok_close(c);
  still_serving();
}
END_TEST

START_TEST(session_quota_is_enforced)
{
  char q[128], log2[128];
  snprintf(q, sizeof q, "%s/quota.sock", dir);
  snprintf(log2, sizeof log2, "%s/quota.log", dir);
  pid_t p = spawn_daemon(q, "--session-quota-bytes=96M", log2);
  wait_for_socket(q, p);
  mok_client *c;
  mok_arena_info a, b;
  ck_assert_int_eq(mok_connect(q, "quota", &c), 0);
  ck_assert_int_eq(mok_arena_create(c, 32u << 20, &a), 0);
  ck_assert_int_eq(mok_arena_create(c, 80u << 20, &b), MOK_EDQUOT);
  ck_assert_ptr_nonnull(strstr(mok_last_error(c), "quota is 100663296"));
  /* outputs count too: a forward needs a 64 MiB output arena, which no longer fits */
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2};
  mok_testbed tb;
  mok_forward_result f;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 8, 1, &tb), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f), MOK_EDQUOT);
  ck_assert_int_eq(mok_arena_destroy(c, a.id), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f), 0);
  mok_close(c);
  int st = stop_daemon(p);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  unlink(log2);
}
END_TEST

/* A forward's context is charged before the step: one that cannot fit is
 * refused without being computed (it used to be computed, then refused). */
START_TEST(context_is_charged_before_the_step)
{
  char q[128], log2[128];
  snprintf(q, sizeof q, "%s/ctxquota.sock", dir);
  snprintf(log2, sizeof log2, "%s/ctxquota.log", dir);
  pid_t p = spawn_daemon(q, "--session-quota-bytes=128M", log2);
  wait_for_socket(q, p);
  mok_client *c;
  mok_layer_desc d = {.hidden = 512, .intermediate = 512, .experts = 8, .top_k = 4};
  mok_testbed tb;
  mok_forward_result f;
  mok_stats st;
  ck_assert_int_eq(mok_connect(q, "ctxquota", &c), 0);
  ck_assert_int_eq(mok_testbed_setup(c, &d, 2048, 1, &tb), 0);
  /* 8192 routed rows keep about 59 MB; the arena and the outputs hold 106 MB */
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(c), "the forward context of this step (up to ") != NULL,
                "%s", mok_last_error(c));
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.forwards, 0); /* nothing was computed */
  ck_assert_uint_eq(st.session.contexts, 0);
  ck_assert_uint_eq(st.session.context_bytes, 0);
  /* without a context the same step fits */
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f), 0);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.forwards, 1);
  mok_close(c);
  int s = stop_daemon(p);
  ck_assert(WIFEXITED(s) && WEXITSTATUS(s) == 0);
  unlink(log2);
}
END_TEST

Suite *daemon_steps_suite(void)
{
  Suite *s = suite_create("daemon_steps");
  TCase *tc = tcase_create("steps");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, forward_backward_equal_engine);
  tcase_add_test(tc, tuned_layer_equals_engine);
  tcase_add_test(tc, last_backward_uses_up_the_context);
  tcase_add_test(tc, context_keeps_its_gradient_mode);
  tcase_add_test(tc, backward_reads_weights_where_they_are_now);
  tcase_add_test(tc, backward_weights_are_checked);
  tcase_add_test(tc, eight_concurrent_clients);
  tcase_add_test(tc, killed_client_leaks_nothing);
  tcase_add_test(tc, expert_id_out_of_range_through_daemon);
  tcase_add_test(tc, ids_flipped_during_forwards_are_contained);
  tcase_add_test(tc, outputs_reuse_their_room);
  tcase_add_test(tc, session_quota_is_enforced);
  tcase_add_test(tc, context_is_charged_before_the_step);
  suite_add_tcase(s, tc);
  return s;
}
