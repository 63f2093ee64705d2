/* check_daemon_ep.c - EP groups through the daemon: P client processes, one
 * rank each, give per token the bits of one client running the whole batch
 * with all experts (DESIGN §2.3), and a group that goes wrong (a rank killed
 * mid-step, a rank that never comes, a joiner that disagrees) answers the
 * others with a clear error at once and leaves nothing behind. */
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_fixture.h"
#include "ref.h"

/* What a rank process reports: its last call's code and the daemon's word. */
typedef struct report {
  int rc;
  int step; /* how far it got: 1 created, 2 forward, 3 backward */
  char msg[MOK_ERRLEN];
} report;

/* The global outputs of one run, filled by the rank processes in place:
 * out, d_x, d_topk_weights by token; each weight gradient by expert; each
 * rank's copy of the shared expert's gradients. */
typedef struct ep_out {
  uint16_t *out, *d_x;
  float *d_tw;
  uint8_t *g[MOK_NWEIGHTS];
  uint8_t *shared_copy[MOK_NWEIGHTS]; /* [P][n] */
  report rep[8];          /* only its size: the reports lie after the tensors */
  void *base;
  size_t bytes;
} ep_out;

static size_t grad_es(mok_grad_mode mode)
{
  return mode == MOK_GRAD_BF16 ? 2 : 4;
}

static void ep_out_map(ep_out *o, const moe_case *c, int P, mok_grad_mode mode)
{
  size_t TH = (size_t)(c->T * c->s.H) * 2, TK = (size_t)(c->T * c->s.K) * 4, at, es;
  size_t off[2 * MOK_NWEIGHTS];

  es = grad_es(mode);
  at = 2 * TH + TK;
  for (int w = 0; w < MOK_NWEIGHTS; w++) {
    off[w] = at;
    at += (size_t)case_weight_elems(c, w) * es;
    off[MOK_NWEIGHTS + w] = at;
    at += (size_t)(P * case_weight_elems(c, w)) * es;
  }
  memset(o, 0, sizeof *o);
  o->bytes = at + sizeof o->rep;
  o->base = mmap(NULL, o->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(o->base, MAP_FAILED);
  o->out = o->base;
  o->d_x = (uint16_t *)((char *)o->base + TH);
  o->d_tw = (float *)((char *)o->base + 2 * TH);
  for (int w = 0; w < MOK_NWEIGHTS; w++) {
    o->g[w] = (uint8_t *)o->base + off[w];
    o->shared_copy[w] = (uint8_t *)o->base + off[MOK_NWEIGHTS + w];
  }
}

static report *rep_of(ep_out *o, int r)
{
  return (report *)((char *)o->base + o->bytes - sizeof o->rep) + r;
}

static void ep_out_unmap(ep_out *o)
{
  munmap(o->base, o->bytes);
}

/* Elements of weight w that one of P ranks holds, and where rank r's start
 * in the global tensor (routed: its experts; shared: a whole copy). */
static int64_t local_elems(const moe_case *c, int w, int P)
{
  return w < MOK_S_GATE ? case_weight_elems(c, w) / P : case_weight_elems(c, w);
}

/* One rank's process: its tokens and experts into an arena of its own, the
 * group layer, forward and backward; results into o. moved: between the
 * two the weights move (copied elsewhere, the old place overwritten) and
 * the backward names where they are now. Returns the exit code. */
static int rank_main(const moe_case *c, int P, int r, uint64_t group, mok_grad_mode mode,
                     int moved, ep_out *o)
{
  report *rep = rep_of(o, r);
  int64_t Tl = c->T / P, H = c->s.H, K = c->s.K, t0 = r * Tl;
  int nw = c->s.I_s > 0 ? 6 : 3;
  size_t es = grad_es(mode);
  mok_layer_desc d = {.hidden = H, .intermediate = c->s.I, .experts = c->s.E, .top_k = K,
                      .shared_intermediate = c->s.I_s, .swiglu_limit = c->s.swiglu_limit,
                      .grad_mode = mode};
  mok_client *cl;
  mok_arena_info a;
  mok_tensor x, ids, tw, dout, w[MOK_NWEIGHTS] = {{0}}, g[MOK_NWEIGHTS] = {{0}};
  mok_tensor w2[MOK_NWEIGHTS] = {{0}};
  mok_forward_result f;
  mok_backward_result b;
  uint64_t layer, at = 0;
  int rc;

#define PLACE(t, dt, nd, ...)                                                          \
  do {                                                                                 \
    t = mok_tensor_make(a.id, at, dt, nd, (int64_t[]){__VA_ARGS__});                   \
    at += (mok_tensor_bytes(&t) + 255) / 256 * 256;                                    \
  } while (0)
#define CHECK(call)                                                                    \
  do {                                                                                 \
    if ((rc = (call)) != 0) {                                                          \
      rep->rc = rc;                                                                    \
      snprintf(rep->msg, sizeof rep->msg, "%s", mok_last_error(cl));                   \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

  if (mok_connect(sock, "ep-rank", &cl) != 0)
    return 2;
  if (P > 1 && mok_layer_desc_ep(&d, group, (uint32_t)P, (uint32_t)r) != 0)
    return 3;
  CHECK(mok_arena_create(cl, 16u << 20, &a));
  PLACE(x, MOK_DTYPE_BF16, 2, Tl, H);
  PLACE(dout, MOK_DTYPE_BF16, 2, Tl, H);
  PLACE(ids, MOK_DTYPE_I32, 2, Tl, K);
  PLACE(tw, MOK_DTYPE_F32, 2, Tl, K);
  for (int i = 0; i < 3; i++) {
    mok_tensor *t = i == 0 ? w : i == 1 ? g : w2;
    mok_dtype dt = i == 1 ? MOK_DTYPE_F32 : MOK_DTYPE_BF16;
    int64_t El = c->s.E / P, I = c->s.I, Is = c->s.I_s;
    PLACE(t[MOK_W_GATE], dt, 3, El, I, H);
    PLACE(t[MOK_W_UP], dt, 3, El, I, H);
    PLACE(t[MOK_W_DOWN], dt, 3, El, H, I);
    if (Is > 0) {
      PLACE(t[MOK_S_GATE], dt, 2, Is, H);
      PLACE(t[MOK_S_UP], dt, 2, Is, H);
      PLACE(t[MOK_S_DOWN], dt, 2, H, Is);
    }
  }
  if (at > a.bytes)
    return 4;
  memcpy(mok_tensor_ptr(cl, &x), c->x + t0 * H, (size_t)(Tl * H) * 2);
  memcpy(mok_tensor_ptr(cl, &dout), c->d_out + t0 * H, (size_t)(Tl * H) * 2);
  memcpy(mok_tensor_ptr(cl, &ids), c->ids + t0 * K, (size_t)(Tl * K) * 4);
  memcpy(mok_tensor_ptr(cl, &tw), c->tw + t0 * K, (size_t)(Tl * K) * 4);
  for (int i = 0; i < nw; i++) {
    int64_t n = local_elems(c, i, P), from = i < MOK_S_GATE ? r * n : 0;
    float *gp = mok_tensor_ptr(cl, &g[i]);
    memcpy(mok_tensor_ptr(cl, &w[i]), c->w[i] + from, (size_t)n * 2);
    for (int64_t k = 0; k < n; k++)
      gp[k] = 0.25f; /* fp32 gradients are added into what is there */
  }
  CHECK(mok_layer_create(cl, &d, &layer));
  rep->step = 1;
  CHECK(mok_layer_set_weights(cl, layer, w));
  CHECK(mok_forward(cl, layer, &x, &ids, &tw, 0, &f));
  rep->step = 2;
  memcpy(o->out + t0 * H, f.out_ptr, (size_t)(Tl * H) * 2);
  for (int i = 0; moved && i < nw; i++) {
    size_t n = (size_t)local_elems(c, i, P) * 2;
    memcpy(mok_tensor_ptr(cl, &w2[i]), mok_tensor_ptr(cl, &w[i]), n);
    memset(mok_tensor_ptr(cl, &w[i]), 0x7f, n); /* the old place now holds something else */
  }
  CHECK(mok_backward_weights(cl, f.context, &dout, mode == MOK_GRAD_FP32_ACCUM ? g : NULL,
                             mode == MOK_GRAD_FP32_ACCUM ? nw : 0, moved ? w2 : NULL, &b));
  rep->step = 3;
  memcpy(o->d_x + t0 * H, b.d_x_ptr, (size_t)(Tl * H) * 2);
  memcpy(o->d_tw + t0 * K, b.d_topk_weights_ptr, (size_t)(Tl * K) * 4);
  for (int i = 0; i < nw; i++) {
    int64_t n = local_elems(c, i, P);
    const void *src = mode == MOK_GRAD_FP32_ACCUM ? mok_tensor_ptr(cl, &g[i]) : b.grad_ptrs[i];
    uint8_t *dst = i < MOK_S_GATE ? o->g[i] + (size_t)(r * n) * es
                                  : o->shared_copy[i] + (size_t)(r * n) * es;
    memcpy(dst, src, (size_t)n * es);
  }
  uint64_t ids2[2] = {f.context, b.result};
  CHECK(mok_release(cl, ids2, 2));
  CHECK(mok_layer_destroy(cl, layer));
  mok_close(cl);
  return 0;
#undef PLACE
#undef CHECK
}

/* P rank processes of one group; each must exit 0. */
static void run_group(const moe_case *c, int P, uint64_t group, mok_grad_mode mode, int moved,
                      ep_out *o)
{
  pid_t kids[8];

  ep_out_map(o, c, P, mode);
  for (int r = 0; r < P; r++) {
    kids[r] = fork();
    ck_assert_int_ge(kids[r], 0);
    if (kids[r] == 0)
      _exit(rank_main(c, P, r, group, mode, moved, o));
  }
  for (int r = 0; r < P; r++) {
    int st;
    ck_assert_int_eq(waitpid(kids[r], &st, 0), kids[r]);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "P=%d rank %d: exit %d, step %d, %s: %s", P, r, WEXITSTATUS(st),
                  rep_of(o, r)->step, mok_err_name(rep_of(o, r)->rc), rep_of(o, r)->msg);
  }
}

static void wait_baseline(mok_client *c, mok_stats *st)
{
  for (int i = 0; i < 500; i++) {
    ck_assert_int_eq(mok_stats_get(c, st), 0);
    if (st->daemon.sessions == 1 && st->daemon.arenas == 0 && st->daemon.layers == 0)
      break;
    usleep(10000);
  }
  ck_assert_uint_eq(st->daemon.sessions, 1);
  ck_assert_uint_eq(st->daemon.arenas, 0);
  ck_assert_uint_eq(st->daemon.arena_bytes, 0);
  ck_assert_uint_eq(st->daemon.layers, 0);
  ck_assert_uint_eq(st->daemon.contexts, 0);
  ck_assert_uint_eq(st->daemon.context_bytes, 0);
  ck_assert_uint_eq(st->daemon.results, 0);
}

/* P = 2, 4, 8 against P = 1, up to P = maxP; moved: the ranks' backwards
 * name their weights where they moved to (rank_main). */
static void ep_bitwise(mokk_shape s, int64_t T, route_kind route, mok_grad_mode mode,
                       uint64_t seed, int maxP, int moved)
{
  moe_case c;
  ep_out base, o;
  size_t es = grad_es(mode);
  mok_client *cl;
  mok_stats st;

  case_make(&c, &s, T, seed, route);
  run_group(&c, 1, 0, mode, 0, &base);
  for (int P = 2; P <= maxP; P *= 2) {
    run_group(&c, P, 100 + (uint64_t)P, mode, moved, &o);
    ck_assert_msg(memcmp(o.out, base.out, (size_t)(T * s.H) * 2) == 0, "P=%d: out", P);
    ck_assert_msg(memcmp(o.d_x, base.d_x, (size_t)(T * s.H) * 2) == 0, "P=%d: d_x", P);
    ck_assert_msg(memcmp(o.d_tw, base.d_tw, (size_t)(T * s.K) * 4) == 0,
                  "P=%d: d_topk_weights", P);
    for (int w = 0; w < (s.I_s > 0 ? 6 : 3); w++) {
      size_t n = (size_t)case_weight_elems(&c, w) * es;
      if (w < MOK_S_GATE) { /* rank r's experts: the slice r of the P = 1 gradient */
        ck_assert_msg(memcmp(o.g[w], base.g[w], n) == 0, "P=%d: gradient %d", P, w);
        continue;
      }
      for (int r = 0; r < P; r++) /* the shared expert's: the same on every rank */
        ck_assert_msg(memcmp(o.shared_copy[w] + r * n, base.shared_copy[w], n) == 0,
                      "P=%d: rank %d's shared gradient %d", P, r, w);
    }
    ep_out_unmap(&o);
  }
  ep_out_unmap(&base);
  case_free(&c);
  cl = connect_ok();
  wait_baseline(cl, &st);
  mok_close(cl);
}

START_TEST(ep_bitwise_bf16)
{
  ep_bitwise((mokk_shape){.H = 48, .I = 32, .E = 16, .K = 4, .I_s = 24, .P = 1,
                          .swiglu_limit = 0.7f},
             64, ROUTE_RANDOM, MOK_GRAD_BF16, 51, 8, 0);
}
END_TEST

START_TEST(ep_bitwise_fp32_odd_tokens)
{
  /* 13 tokens a rank at P = 8: gradient chunks straddle ranks */
  ep_bitwise((mokk_shape){.H = 40, .I = 24, .E = 8, .K = 2, .I_s = 16, .P = 1}, 8 * 13,
             ROUTE_RANDOM, MOK_GRAD_FP32_ACCUM, 52, 8, 0);
}
END_TEST

START_TEST(ep_bitwise_empty_and_hot_experts)
{
  ep_bitwise((mokk_shape){.H = 32, .I = 16, .E = 16, .K = 2, .P = 1}, 8 * 5, ROUTE_HALF,
             MOK_GRAD_BF16, 53, 8, 0);
  ep_bitwise((mokk_shape){.H = 32, .I = 16, .E = 8, .K = 1, .I_s = 8, .P = 1}, 8 * 3,
             ROUTE_SAME, MOK_GRAD_FP32_ACCUM, 54, 8, 0);
}
END_TEST

/* A group Backward whose ranks name weights that moved since the forward
 * (Backward.weights, as FSDP regathers them) reads them there: the bits of
 * P = 1 with weights that never moved. */
START_TEST(ep_bitwise_moved_weights)
{
  ep_bitwise((mokk_shape){.H = 48, .I = 32, .E = 16, .K = 4, .I_s = 24, .P = 1,
                          .swiglu_limit = 0.7f},
             64, ROUTE_RANDOM, MOK_GRAD_BF16, 55, 2, 1);
  ep_bitwise((mokk_shape){.H = 40, .I = 24, .E = 8, .K = 2, .I_s = 16, .P = 1}, 2 * 13,
             ROUTE_RANDOM, MOK_GRAD_FP32_ACCUM, 56, 2, 1);
}
END_TEST

/* ---- faults ---------------------------------------------------------------- */

static const mokk_shape small = {.H = 32, .I = 16, .E = 8, .K = 2, .I_s = 8, .P = 1};

/* Rank processes 0..P-1 of a group running forward and backward, except
 * the ranks in `idle`, which join and then wait to be killed. */
static pid_t spawn_rank(const moe_case *c, int P, int r, uint64_t group, int idle, ep_out *o)
{
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid != 0)
    return pid;
  if (idle) {
    mok_client *cl;
    mok_layer_desc d = {.hidden = small.H, .intermediate = small.I, .experts = small.E,
                        .top_k = small.K, .shared_intermediate = small.I_s};
    uint64_t layer;
    mok_layer_desc_ep(&d, group, (uint32_t)P, (uint32_t)r);
    if (mok_connect(sock, "ep-idle", &cl) != 0 || mok_layer_create(cl, &d, &layer) != 0)
      _exit(1);
    rep_of(o, r)->step = 1;
    pause();
    _exit(0);
  }
  _exit(rank_main(c, P, r, group, MOK_GRAD_BF16, 0, o));
}

static int wait_exit(pid_t pid)
{
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void expect_rep(ep_out *o, int r, int step, int rc, const char *needle)
{
  report *rep = rep_of(o, r);
  ck_assert_msg(rep->step == step && rep->rc == rc && strstr(rep->msg, needle) != NULL,
                "rank %d: step %d, %s: \"%s\"; want step %d, %s with \"%s\"", r, rep->step,
                mok_err_name(rep->rc), rep->msg, step, mok_err_name(rc), needle);
}

/* Polls until the daemon holds n contexts: the steps parked in the group. */
static void wait_contexts(mok_client *cl, uint64_t n)
{
  mok_stats st;
  for (int i = 0; i < 1000; i++) {
    ck_assert_int_eq(mok_stats_get(cl, &st), 0);
    if (st.daemon.contexts == n)
      return;
    usleep(5000);
  }
  ck_abort_msg("the daemon holds %llu contexts, not %llu", (unsigned long long)st.daemon.contexts,
               (unsigned long long)n);
}

START_TEST(ep_rank_killed_mid_step)
{
  moe_case c;
  ep_out o;
  pid_t kid[4];
  mok_client *cl = connect_ok();
  mok_stats st;

  case_make(&c, &small, 4 * 8, 61, ROUTE_RANDOM);
  ep_out_map(&o, &c, 4, MOK_GRAD_BF16);
  kid[3] = spawn_rank(&c, 4, 3, 7, 1, &o);
  for (int r = 0; r < 3; r++)
    kid[r] = spawn_rank(&c, 4, r, 7, 0, &o);
  wait_contexts(cl, 3); /* ranks 0, 1 and 2 wait in the forward for rank 3 */
  kill(kid[3], SIGKILL);
  wait_exit(kid[3]);
  /* the daemon's timeout is 60 s: an answer now is the kill's doing */
  for (int r = 0; r < 3; r++) {
    ck_assert_int_eq(wait_exit(kid[r]), 1);
    expect_rep(&o, r, 1, MOK_EGROUP, "EP group 7 was torn down: rank 3 left: its session "
                                     "closed");
  }
  wait_baseline(cl, &st);
  ck_assert_uint_eq(st.daemon.forwards, 0);
  /* and a new group of the same id forms and runs */
  ep_out_unmap(&o);
  run_group(&c, 2, 7, MOK_GRAD_BF16, 0, &o);
  ep_out_unmap(&o);
  case_free(&c);
  wait_baseline(cl, &st);
  mok_close(cl);
  still_serving();
}
END_TEST

/* A rank whose process dies while the group's step computes: the step
 * runs to its end, and group_done finds that rank's session closing. The
 * others get their forward (the step ran); their backward meets the reason
 * the group is gone, since the dead rank's share of the state went with it.
 * The steps are large enough to outlast the kill by far. */
START_TEST(ep_rank_killed_while_computing)
{
  const mokk_shape big = {.H = 256, .I = 512, .E = 4, .K = 2, .I_s = 0, .P = 1};
  moe_case c;
  ep_out o;
  pid_t kid[2];
  mok_client *cl = connect_ok();
  mok_stats st;

  case_make(&c, &big, 2 * 1024, 64, ROUTE_RANDOM);
  ep_out_map(&o, &c, 2, MOK_GRAD_BF16);
  for (int r = 0; r < 2; r++)
    kid[r] = spawn_rank(&c, 2, r, 11, 0, &o);
  wait_contexts(cl, 2); /* both forwards arrived: the step is on the executor */
  kill(kid[1], SIGKILL);
  wait_exit(kid[1]);
  ck_assert_msg(rep_of(&o, 0)->step == 1, "rank 0's forward was answered before the kill: "
                "the step is too short for this test");
  ck_assert_int_eq(wait_exit(kid[0]), 1);
  expect_rep(&o, 0, 2, MOK_EGROUP, "EP group 11 was torn down: rank 1 left: its session "
                                   "closed");
  wait_baseline(cl, &st);
  ck_assert_uint_eq(st.daemon.forwards, 2);
  ep_out_unmap(&o);
  case_free(&c);
  mok_close(cl);
  still_serving();
}
END_TEST

/* A member whose process dies while the group forms ends the others' wait. */
START_TEST(ep_rank_killed_while_forming)
{
  moe_case c;
  ep_out o;
  mok_client *cl = connect_ok();
  mok_stats st;
  mok_layer_desc d = {.hidden = small.H, .intermediate = small.I, .experts = small.E,
                      .top_k = small.K, .shared_intermediate = small.I_s};
  uint64_t layer;
  pid_t kid;

  case_make(&c, &small, 8, 62, ROUTE_RANDOM);
  ep_out_map(&o, &c, 4, MOK_GRAD_BF16);
  kid = spawn_rank(&c, 4, 1, 8, 0, &o); /* joins, and waits for ranks 0, 2 and 3 */
  for (int i = 0; i < 500; i++) {
    ck_assert_int_eq(mok_stats_get(cl, &st), 0);
    if (st.daemon.layers == 1)
      break;
    usleep(5000);
  }
  ck_assert_uint_eq(st.daemon.layers, 1);
  pid_t killer = fork();
  if (killer == 0) {
    usleep(100000);
    kill(kid, SIGKILL);
    _exit(0);
  }
  ck_assert_int_eq(mok_layer_desc_ep(&d, 8, 4, 0), 0);
  ck_assert_int_eq(mok_layer_create(cl, &d, &layer), MOK_EGROUP);
  ck_assert_msg(strstr(mok_last_error(cl), "EP group 8 was torn down: rank 1 left: its "
                                           "session closed") != NULL, "%s", mok_last_error(cl));
  wait_exit(killer);
  wait_exit(kid);
  wait_baseline(cl, &st);
  ep_out_unmap(&o);
  case_free(&c);
  mok_close(cl);
}
END_TEST

START_TEST(ep_rank_never_arrives)
{
  own_daemon od;
  moe_case c;
  ep_out o;
  pid_t kid[2];
  mok_client *cl;
  mok_stats st;
  mok_layer_desc d = {.hidden = small.H, .intermediate = small.I, .experts = small.E,
                      .top_k = small.K, .shared_intermediate = small.I_s};
  uint64_t layer;

  own_daemon_start(&od, "ep", "--group-timeout-ms=400");
  cl = connect_ok();
  /* the group never forms: rank 1 never joins */
  ck_assert_int_eq(mok_layer_desc_ep(&d, 9, 2, 0), 0);
  ck_assert_int_eq(mok_layer_create(cl, &d, &layer), MOK_ETIMEDOUT);
  ck_assert_msg(strstr(mok_last_error(cl), "EP group 9 did not form: rank 1 of 2 did not "
                                           "join within 400 ms") != NULL, "%s",
                mok_last_error(cl));
  wait_baseline(cl, &st);

  /* it forms, but rank 1 never sends its forward */
  case_make(&c, &small, 2 * 8, 63, ROUTE_RANDOM);
  ep_out_map(&o, &c, 2, MOK_GRAD_BF16);
  kid[1] = spawn_rank(&c, 2, 1, 10, 1, &o);
  kid[0] = spawn_rank(&c, 2, 0, 10, 0, &o);
  ck_assert_int_eq(wait_exit(kid[0]), 1);
  expect_rep(&o, 0, 1, MOK_ETIMEDOUT, "EP group 10 was torn down: rank 1 of 2 did not send "
                                      "the step within 400 ms");
  kill(kid[1], SIGKILL);
  wait_exit(kid[1]);
  wait_baseline(cl, &st);
  ep_out_unmap(&o);
  case_free(&c);
  mok_close(cl);
  own_daemon_stop(&od);
}
END_TEST

/* A late rank meets the reason its group is gone. */
START_TEST(ep_late_rank_told_why)
{
  own_daemon od;
  mok_client *a;
  mok_layer_desc d = {.hidden = small.H, .intermediate = small.I, .experts = small.E,
                      .top_k = small.K};
  uint64_t la, lb;
  mok_stats st;
  pid_t kid;

  own_daemon_start(&od, "late", "--group-timeout-ms=300");
  kid = fork();
  if (kid == 0) {
    mok_client *c;
    int rc = 1;
    mok_layer_desc_ep(&d, 11, 2, 1);
    if (mok_connect(sock, "late", &c) == 0)
      rc = mok_layer_create(c, &d, &lb) != 0;
    mok_close(c);
    _exit(rc);
  }
  a = connect_ok();
  ck_assert_int_eq(mok_layer_desc_ep(&d, 11, 2, 0), 0);
  ck_assert_int_eq(mok_layer_create(a, &d, &la), 0);
  ck_assert_int_eq(wait_exit(kid), 0);
  for (int i = 0; i < 500; i++) { /* until the daemon has seen rank 1 go */
    ck_assert_int_eq(mok_stats_get(a, &st), 0);
    if (st.daemon.sessions == 1 && st.daemon.layers == 1)
      break;
    usleep(5000);
  }
  /* rank 1 closed: rank 0's layer stands no more, and says so */
  mok_tensor x = mok_tensor_make(1, 0, MOK_DTYPE_BF16, 2, (int64_t[]){1, small.H});
  mok_forward_result f;
  ck_assert_int_eq(mok_forward(a, la, &x, &x, &x, 0, &f), MOK_EGROUP);
  ck_assert_msg(strstr(mok_last_error(a), "EP group 11 was torn down: rank 1 left: its "
                                          "session closed; destroy this layer") != NULL,
                "%s", mok_last_error(a));
  ck_assert_int_eq(mok_layer_destroy(a, la), 0);
  wait_baseline(a, &st);
  mok_close(a);
  own_daemon_stop(&od);
}
END_TEST

/* Joiners that disagree are refused alone; the member waits on and the group
 * forms with the right one. */
START_TEST(ep_join_mismatches)
{
  mok_layer_desc d = {.hidden = small.H, .intermediate = small.I, .experts = small.E,
                      .top_k = small.K, .shared_intermediate = small.I_s};
  mok_client *c = connect_ok();
  uint64_t layer;
  mok_stats st;
  int pfd[2];
  pid_t kid;

  ck_assert_int_eq(pipe(pfd), 0);
  kid = fork();
  if (kid == 0) {
    mok_client *m;
    mok_layer_desc dm = d;
    uint64_t l;
    char ok;
    mok_layer_desc_ep(&dm, 12, 2, 0);
    if (mok_connect(sock, "member", &m) != 0 || mok_layer_create(m, &dm, &l) != 0)
      _exit(1);
    if (read(pfd[0], &ok, 1) != 1) /* holds the layer until the parent has looked */
      _exit(2);
    _exit(mok_layer_destroy(m, l) != 0);
  }
  for (int i = 0; i < 500; i++) { /* rank 0 waits in the group */
    ck_assert_int_eq(mok_stats_get(c, &st), 0);
    if (st.daemon.layers == 1)
      break;
    usleep(5000);
  }
  ck_assert_uint_eq(st.daemon.layers, 1);

  mok_layer_desc bad = d;
  bad.hidden = 64;
  mok_layer_desc_ep(&bad, 12, 2, 1);
  ck_assert_int_eq(mok_layer_create(c, &bad, &layer), MOK_ESHAPE);
  ck_assert_msg(strstr(mok_last_error(c), "EP group 12 has H=32") != NULL &&
                    strstr(mok_last_error(c), "this rank asks H=64") != NULL &&
                    strstr(mok_last_error(c), "the others wait on") != NULL,
                "%s", mok_last_error(c));
  bad = d;
  bad.swiglu_limit = 0.5f;
  mok_layer_desc_ep(&bad, 12, 2, 1);
  ck_assert_int_eq(mok_layer_create(c, &bad, &layer), MOK_ESHAPE);
  /* kernel options too: the group's step runs with one set */
  mok_layer_tuning tall = {.tiles = MOK_TILES_TALL};
  bad = d;
  mok_layer_desc_ep(&bad, 12, 2, 1);
  ck_assert_int_eq(mok_layer_create_tuned(c, &bad, &tall, &layer), MOK_ESHAPE);
  ck_assert_msg(strstr(mok_last_error(c), "EP group 12's layers chose kernel options other "
                                          "than this rank's") != NULL &&
                    strstr(mok_last_error(c), "tiles 0/2") != NULL,
                "%s", mok_last_error(c));
  bad = d;
  mok_layer_desc_ep(&bad, 12, 2, 0);
  ck_assert_int_eq(mok_layer_create(c, &bad, &layer), MOK_EEXIST);
  ck_assert_msg(strstr(mok_last_error(c), "rank 0 of EP group 12 is taken already") != NULL,
                "%s", mok_last_error(c));
  mok_layer_desc_ep(&bad, 12, 4, 1);
  ck_assert_int_eq(mok_layer_create(c, &bad, &layer), MOK_EGROUP);
  ck_assert_msg(strstr(mok_last_error(c), "EP group 12 has size 2; this rank says 4") != NULL,
                "%s", mok_last_error(c));
  /* what no group could take, whoever else is there */
  bad.ep_group = 13, bad.ep_size = 2, bad.ep_rank = 2;
  ck_assert_int_eq(mok_layer_create(c, &bad, &layer), MOK_EINVAL);
  ck_assert_msg(strstr(mok_last_error(c), "EP rank 2 is outside a group of size 2") != NULL,
                "%s", mok_last_error(c));
  bad.ep_size = 3, bad.ep_rank = 0;
  ck_assert_int_eq(mok_layer_create(c, &bad, &layer), MOK_EEPSIZE);
  ck_assert_msg(strstr(mok_last_error(c), "do not divide over P = 3") != NULL, "%s",
                mok_last_error(c));
  ck_assert_int_eq(mok_layer_desc_ep(&bad, 13, 2, 2), MOK_EINVAL);
  ck_assert_int_eq(mok_layer_desc_ep(&bad, 13, 3, 0), MOK_EEPSIZE);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.daemon.layers, 1); /* only the member's */

  /* the right rank 1 completes the group: both creates return */
  mok_layer_desc_ep(&d, 12, 2, 1);
  ck_assert_msg(mok_layer_create(c, &d, &layer) == 0, "%s", mok_last_error(c));
  /* a formed group takes no one more, and one session holds one rank */
  ck_assert_int_eq(mok_layer_create(c, &d, &layer), MOK_EEXIST);
  ck_assert_msg(strstr(mok_last_error(c), "EP group 12 is formed already") != NULL, "%s",
                mok_last_error(c));
  ck_assert_int_eq(write(pfd[1], "x", 1), 1);
  ck_assert_int_eq(wait_exit(kid), 0);
  ck_assert_int_eq(mok_layer_destroy(c, layer), 0);
  wait_baseline(c, &st);
  mok_close(c);
}
END_TEST

/* A rank of a small group (no shared expert, P = 2) in group `group`: the
 * layer, with its 4 experts' weights, and the tensors of T tokens, all in
 * one 64 KiB arena (the values do not matter to the tests that use it). */
typedef struct small_rank {
  mok_arena_info arena;
  uint64_t layer;
  mok_tensor x, ids, tw;
} small_rank;

static int small_rank_join(mok_client *m, uint64_t group, uint32_t r, int64_t T,
                           small_rank *k)
{
  mok_layer_desc d = {.hidden = small.H, .intermediate = small.I, .experts = small.E,
                      .top_k = small.K};
  int64_t w3[3][3] = {{4, small.I, small.H}, {4, small.I, small.H}, {4, small.H, small.I}};
  int rc;

  mok_layer_desc_ep(&d, group, 2, r);
  if ((rc = mok_arena_create(m, 1 << 16, &k->arena)) != 0 ||
      (rc = mok_layer_create(m, &d, &k->layer)) != 0)
    return rc;
  mok_tensor w[MOK_NWEIGHTS] = {mok_tensor_make(k->arena.id, 0, MOK_DTYPE_BF16, 3, w3[0]),
                                mok_tensor_make(k->arena.id, 0, MOK_DTYPE_BF16, 3, w3[1]),
                                mok_tensor_make(k->arena.id, 0, MOK_DTYPE_BF16, 3, w3[2])};
  k->x = mok_tensor_make(k->arena.id, 8192, MOK_DTYPE_BF16, 2, (int64_t[]){T, small.H});
  k->ids = mok_tensor_make(k->arena.id, 16384, MOK_DTYPE_I32, 2, (int64_t[]){T, small.K});
  k->tw = mok_tensor_make(k->arena.id, 20480, MOK_DTYPE_F32, 2, (int64_t[]){T, small.K});
  return mok_layer_set_weights(m, k->layer, w);
}

/* The ranks of a step must agree: a rank with another T fails the step for
 * all, and the group stands for the next one. */
START_TEST(ep_step_mismatch_fails_all)
{
  mok_client *c[1];
  small_rank k0;
  mok_stats st;
  pid_t kid;
  int pfd[2];

  ck_assert_int_eq(pipe(pfd), 0);
  kid = fork();
  if (kid == 0) { /* rank 1: forward of 4 tokens; reports its result */
    mok_client *m;
    small_rank k;
    mok_forward_result f;
    if (mok_connect(sock, "r1", &m) != 0 || small_rank_join(m, 14, 1, 4, &k) != 0)
      _exit(1);
    int rc = mok_forward(m, k.layer, &k.x, &k.ids, &k.tw, 0, &f);
    char buf[MOK_ERRLEN + 8];
    int n = snprintf(buf, sizeof buf, "%d %s", rc, mok_last_error(m));
    if (write(pfd[1], buf, (size_t)n + 1) < 0)
      _exit(3);
    _exit(0);
  }
  c[0] = connect_ok();
  /* rank 0 sends 3 tokens after rank 1's 4 have parked */
  ck_assert_msg(small_rank_join(c[0], 14, 0, 3, &k0) == 0, "%s", mok_last_error(c[0]));
  wait_contexts(c[0], 1);
  mok_forward_result f;
  ck_assert_int_eq(mok_forward(c[0], k0.layer, &k0.x, &k0.ids, &k0.tw, 0, &f), MOK_ESHAPE);
  ck_assert_msg(strstr(mok_last_error(c[0]), "EP rank 0 sent T = 3 tokens, rank 1 sent 4") !=
                    NULL, "%s", mok_last_error(c[0]));
  char buf[MOK_ERRLEN + 8] = "";
  ck_assert_int_gt(read(pfd[0], buf, sizeof buf - 1), 0);
  ck_assert_msg(strncmp(buf, "-4005 EP rank 0 sent T = 3 tokens", 33) == 0, "rank 1 got: %s",
                buf);
  ck_assert_int_eq(wait_exit(kid), 0);
  ck_assert_int_eq(mok_layer_destroy(c[0], k0.layer), 0);
  mok_close(c[0]);
  c[0] = connect_ok(); /* its output arena went with the session */
  wait_baseline(c[0], &st);
  mok_close(c[0]);
}
END_TEST

/* A group backward needs every rank's context of the forward: one rank
 * that released its own makes the others' Backward fail at once. */
START_TEST(ep_backward_needs_every_context)
{
  mok_client *c;
  small_rank k0;
  mok_forward_result f;
  mok_backward_result b;
  mok_stats st;
  int up[2], down[2]; /* rank 1 to the test, and back */
  pid_t kid;
  char ch;

  ck_assert_int_eq(pipe(up), 0);
  ck_assert_int_eq(pipe(down), 0);
  kid = fork();
  if (kid == 0) { /* rank 1: a forward, then its context released */
    mok_client *m;
    small_rank k;
    mok_forward_result mf;
    if (mok_connect(sock, "r1", &m) != 0 || small_rank_join(m, 15, 1, 2, &k) != 0)
      _exit(1);
    if (mok_forward(m, k.layer, &k.x, &k.ids, &k.tw, 0, &mf) != 0 ||
        mok_release(m, &mf.context, 1) != 0 || write(up[1], "x", 1) != 1)
      _exit(2);
    if (read(down[0], &ch, 1) != 1) /* stays until rank 0 has tried */
      _exit(3);
    mok_close(m);
    _exit(0);
  }
  c = connect_ok();
  ck_assert_msg(small_rank_join(c, 15, 0, 2, &k0) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_forward(c, k0.layer, &k0.x, &k0.ids, &k0.tw, 0, &f) == 0, "%s",
                mok_last_error(c));
  ck_assert_int_eq(read(up[0], &ch, 1), 1);
  ck_assert_int_eq(mok_backward(c, f.context, &k0.x, NULL, 0, &b), MOK_ECONTEXT);
  ck_assert_msg(strstr(mok_last_error(c), "another EP rank holds no context of the forward") !=
                    NULL, "%s", mok_last_error(c));
  ck_assert_int_eq(write(down[1], "x", 1), 1);
  ck_assert_int_eq(wait_exit(kid), 0);
  ck_assert_int_eq(mok_release(c, &f.context, 1), 0);
  ck_assert_int_eq(mok_layer_destroy(c, k0.layer), 0);
  mok_close(c);
  c = connect_ok();
  wait_baseline(c, &st);
  mok_close(c);
}
END_TEST

/* ---- ranks over raw frames -------------------------------------------------- */

/* A rank of a group of small layers (no shared expert, P = 2) over raw
 * frames: to send requests back to back, or ones libmok would not send.
 * Its arena is all zeros: the weights at 0, x and d_out at 16384, ids at
 * 20480, topk_weights at 24576 (all ids 0: every token on expert 0). */
typedef struct raw_rank {
  int fd;
  uint64_t arena, layer, id; /* id: of the last request sent */
} raw_rank;

static void rank_send(raw_rank *k, Mokd__Request *q, int pass_fd)
{
  q->id = ++k->id;
  raw_request(k->fd, q, pass_fd);
}

static void read_exact(int fd, void *buf, size_t n)
{
  for (size_t at = 0; at < n;) {
    struct pollfd pf = {fd, POLLIN, 0};
    ck_assert_msg(poll(&pf, 1, 5000) == 1, "no reply within 5 s (the group timeout is 60 s)");
    ssize_t got = recv(fd, (char *)buf + at, n - at, 0);
    ck_assert_msg(got > 0, "the daemon closed the connection");
    at += (size_t)got;
  }
}

/* One reply, read exactly (length, then frame), so that replies that came
 * together are read one by one; an fd riding on it is dropped. */
static Mokd__Response *rank_reply(raw_rank *k)
{
  uint8_t hdr[4], *buf;
  uint32_t n;
  Mokd__Response *r;

  read_exact(k->fd, hdr, 4);
  n = (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 | (uint32_t)hdr[3] << 24;
  buf = malloc(n);
  ck_assert_ptr_nonnull(buf);
  read_exact(k->fd, buf, n);
  r = mokd__response__unpack(NULL, n, buf);
  free(buf);
  ck_assert_ptr_nonnull(r);
  return r;
}

static Mokd__Response *rank_ok(raw_rank *k, const char *what)
{
  Mokd__Response *r = rank_reply(k);
  ck_assert_msg(r->status == 0, "%s: %s: %s", what, mok_err_name(r->status), r->message);
  return r;
}

static void rank_expect(raw_rank *k, int code, const char *needle)
{
  Mokd__Response *r = rank_reply(k);
  ck_assert_msg(r->status == code && strstr(r->message, needle) != NULL,
                "%s: \"%s\"; want %s with \"%s\"", mok_err_name(r->status), r->message,
                mok_err_name(code), needle);
  mokd__response__free_unpacked(r, NULL);
}

/* Connects, makes the arena and sends CreateLayer for rank r of group;
 * rank_joined reads the reply once every rank has joined. */
static void rank_join(raw_rank *k, uint64_t group, int r)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__CreateArena ca = MOKD__CREATE_ARENA__INIT;
  Mokd__CreateLayer cl = MOKD__CREATE_LAYER__INIT;
  Mokd__EpGroup ep = MOKD__EP_GROUP__INIT;
  Mokd__Response *rep;

  k->fd = raw_connect();
  hello(k->fd);
  k->id = 1;
  ca.bytes = 1 << 16;
  q.body_case = MOKD__REQUEST__BODY_CREATE_ARENA, q.create_arena = &ca;
  rank_send(k, &q, -1);
  rep = rank_ok(k, "CreateArena");
  k->arena = rep->arena_created->arena;
  mokd__response__free_unpacked(rep, NULL);
  cl.hidden = 32, cl.intermediate = 16, cl.experts = 8, cl.top_k = 2;
  ep.id = group, ep.size = 2, ep.rank = (uint32_t)r;
  cl.ep = &ep;
  q.body_case = MOKD__REQUEST__BODY_CREATE_LAYER, q.create_layer = &cl;
  rank_send(k, &q, -1);
}

static Mokd__TensorRef rank_ref(const raw_rank *k, uint64_t off, Mokd__DType dt, int64_t *shape,
                                int nd)
{
  Mokd__TensorRef t = MOKD__TENSOR_REF__INIT;
  t.arena = k->arena, t.offset = off, t.dtype = dt, t.n_shape = (size_t)nd, t.shape = shape;
  return t;
}

static void rank_joined(raw_rank *k)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__SetWeights sw = MOKD__SET_WEIGHTS__INIT;
  Mokd__Response *rep = rank_ok(k, "CreateLayer");
  int64_t gu[3] = {4, 16, 32}, dn[3] = {4, 32, 16};
  Mokd__TensorRef wg = rank_ref(k, 0, MOKD__DTYPE__DTYPE_BF16, gu, 3);
  Mokd__TensorRef wd = rank_ref(k, 4096, MOKD__DTYPE__DTYPE_BF16, dn, 3);

  k->layer = rep->layer_created->layer;
  mokd__response__free_unpacked(rep, NULL);
  sw.layer = k->layer, sw.w_gate = &wg, sw.w_up = &wg, sw.w_down = &wd;
  q.body_case = MOKD__REQUEST__BODY_SET_WEIGHTS, q.set_weights = &sw;
  rank_send(k, &q, -1);
  mokd__response__free_unpacked(rank_ok(k, "SetWeights"), NULL);
}

/* Sends a Forward of T tokens of layer (0: the rank's) with pass_fd on it
 * (-1: none). */
static void rank_forward(raw_rank *k, int64_t T, int inference, uint64_t layer, int pass_fd)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Forward f = MOKD__FORWARD__INIT;
  int64_t sx[2] = {T, 32}, sk[2] = {T, 2};
  Mokd__TensorRef x = rank_ref(k, 16384, MOKD__DTYPE__DTYPE_BF16, sx, 2);
  Mokd__TensorRef ids = rank_ref(k, 20480, MOKD__DTYPE__DTYPE_I32, sk, 2);
  Mokd__TensorRef tw = rank_ref(k, 24576, MOKD__DTYPE__DTYPE_F32, sk, 2);

  f.layer = layer != 0 ? layer : k->layer;
  f.x = &x, f.topk_ids = &ids, f.topk_weights = &tw, f.inference = inference;
  q.body_case = MOKD__REQUEST__BODY_FORWARD, q.forward = &f;
  rank_send(k, &q, pass_fd);
}

/* The context of a forward that succeeded. */
static uint64_t rank_context(raw_rank *k)
{
  Mokd__Response *rep = rank_ok(k, "Forward");
  uint64_t c = rep->forward_done->context;
  mokd__response__free_unpacked(rep, NULL);
  return c;
}

static void rank_backward_last(raw_rank *k, uint64_t context, int64_t T, int last)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Backward b = MOKD__BACKWARD__INIT;
  int64_t sx[2] = {T, 32};
  Mokd__TensorRef d = rank_ref(k, 16384, MOKD__DTYPE__DTYPE_BF16, sx, 2);

  b.context = context, b.d_out = &d, b.last = last != 0;
  q.body_case = MOKD__REQUEST__BODY_BACKWARD, q.backward = &b;
  rank_send(k, &q, -1);
}

static void rank_backward(raw_rank *k, uint64_t context, int64_t T)
{
  rank_backward_last(k, context, T, 0);
}

static void rank_release(raw_rank *k, uint64_t id)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Release rl = MOKD__RELEASE__INIT;

  rl.n_ids = 1, rl.ids = &id;
  q.body_case = MOKD__REQUEST__BODY_RELEASE, q.release = &rl;
  rank_send(k, &q, -1);
}

static void ranks_join(raw_rank *k, uint64_t group)
{
  rank_join(&k[0], group, 0);
  rank_join(&k[1], group, 1);
  rank_joined(&k[0]);
  rank_joined(&k[1]);
}

/* Both ranks run a forward and a backward: the group stands. */
static void ranks_step(raw_rank *k)
{
  uint64_t c[2];
  for (int r = 0; r < 2; r++)
    rank_forward(&k[r], 4, 0, 0, -1);
  for (int r = 0; r < 2; r++)
    c[r] = rank_context(&k[r]);
  for (int r = 0; r < 2; r++)
    rank_backward(&k[r], c[r], 4);
  for (int r = 0; r < 2; r++)
    mokd__response__free_unpacked(rank_ok(&k[r], "Backward"), NULL);
}

static void ranks_close(raw_rank *k)
{
  mok_client *cl;
  mok_stats st;

  close(k[0].fd);
  close(k[1].fd);
  cl = connect_ok();
  wait_baseline(cl, &st);
  mok_close(cl);
}

static double now_ms(void)
{
  struct timeval tv;
  gettimeofday(&tv, NULL);
  return tv.tv_sec * 1e3 + tv.tv_usec / 1e3;
}

/* Polls until the daemon holds n backward results: the backwards parked in
 * a group. */
static void wait_results(uint64_t n)
{
  mok_client *cl = connect_ok();
  mok_stats st;
  for (int i = 0; i < 1000; i++) {
    ck_assert_int_eq(mok_stats_get(cl, &st), 0);
    if (st.daemon.results == n)
      break;
    usleep(5000);
  }
  mok_close(cl);
  ck_assert_uint_eq(st.daemon.results, n);
}

/* A group forward keeps a context for every rank or for none: an
 * inference rank would hold none of the state the others keep (and pay
 * nothing for it), so the ranks must agree; the group stands. */
START_TEST(ep_inference_ranks_must_agree)
{
  raw_rank k[2];

  ranks_join(k, 20);
  rank_forward(&k[0], 4, 1, 0, -1);
  rank_forward(&k[1], 4, 0, 0, -1);
  for (int r = 0; r < 2; r++)
    rank_expect(&k[r], MOK_EGROUP, "the ranks of a group Forward must all ask for inference, "
                                   "or none");
  ranks_step(k);
  ranks_close(k);
}
END_TEST

/* A group Backward's ranks agree on last; one with last on every rank runs
 * (the ranks share the forward's state), and a group Backward after it
 * fails on every rank; the group stands. */
START_TEST(ep_last_backward_ranks_must_agree)
{
  raw_rank k[2];
  uint64_t c[2];

  ranks_join(k, 23);
  for (int r = 0; r < 2; r++)
    rank_forward(&k[r], 4, 0, 0, -1);
  for (int r = 0; r < 2; r++)
    c[r] = rank_context(&k[r]);
  rank_backward_last(&k[0], c[0], 4, 1);
  rank_backward_last(&k[1], c[1], 4, 0);
  for (int r = 0; r < 2; r++)
    rank_expect(&k[r], MOK_EGROUP, "the ranks of a group Backward must agree on it");
  for (int r = 0; r < 2; r++)
    rank_backward_last(&k[r], c[r], 4, 1);
  for (int r = 0; r < 2; r++)
    mokd__response__free_unpacked(rank_ok(&k[r], "Backward"), NULL);
  for (int r = 0; r < 2; r++)
    rank_backward(&k[r], c[r], 4);
  for (int r = 0; r < 2; r++)
    rank_expect(&k[r], MOK_ECONTEXT, "used up by an earlier backward");
  ranks_step(k);
  ranks_close(k);
}
END_TEST

/* A step that does not match fails the parked ones, which runs those
 * ranks' next requests: a step they sent right behind parks, and waits for
 * the mismatching rank's next one, which it then runs with. */
START_TEST(ep_mismatch_spares_the_next_step)
{
  raw_rank k[2];
  mok_client *cl = connect_ok();

  ranks_join(k, 23);
  rank_forward(&k[1], 4, 0, 0, -1);
  rank_forward(&k[1], 4, 0, 0, -1); /* behind it, before any reply */
  wait_contexts(cl, 1);
  rank_forward(&k[0], 3, 0, 0, -1);
  rank_expect(&k[0], MOK_ESHAPE, "EP rank 0 sent T = 3 tokens, rank 1 sent 4");
  rank_expect(&k[1], MOK_ESHAPE, "EP rank 0 sent T = 3 tokens, rank 1 sent 4");
  wait_contexts(cl, 1); /* rank 1's second forward waits in the group */
  rank_forward(&k[0], 4, 0, 0, -1);
  rank_context(&k[0]);
  rank_context(&k[1]);
  mok_close(cl);
  ranks_close(k);
}
END_TEST

/* A rank whose Forward or Backward is refused, by its handler or before
 * it runs, fails the step the others wait in at once (group_timeout_ms is
 * 60 s here), with why; the group stands for the next step. */
START_TEST(ep_refused_rank_ends_the_wait)
{
  raw_rank k[2];
  mok_client *cl = connect_ok();
  uint64_t c[2];
  double t0;

  ranks_join(k, 21);
  /* a layer this session does not have */
  rank_forward(&k[0], 4, 0, 0, -1);
  wait_contexts(cl, 1);
  t0 = now_ms();
  rank_forward(&k[1], 4, 0, 424242, -1);
  rank_expect(&k[1], MOK_ENOENT, "layer 424242 does not exist in this session");
  rank_expect(&k[0], MOK_EGROUP, "EP rank 1's Forward was refused: layer 424242 does not "
                                 "exist in this session");
  ck_assert_double_lt(now_ms() - t0, 2000);
  /* an fd on a Forward: refused before the handler runs */
  rank_forward(&k[0], 4, 0, 0, -1);
  wait_contexts(cl, 1);
  rank_forward(&k[1], 4, 0, 0, k[1].fd);
  rank_expect(&k[1], MOK_EINVAL, "a file descriptor came with a request that takes none");
  rank_expect(&k[0], MOK_EGROUP, "EP rank 1's Forward was refused: a file descriptor came");
  /* a Backward that names a context this rank does not hold */
  for (int r = 0; r < 2; r++)
    rank_forward(&k[r], 4, 0, 0, -1);
  for (int r = 0; r < 2; r++)
    c[r] = rank_context(&k[r]);
  rank_backward(&k[0], c[0], 4);
  wait_results(1);
  t0 = now_ms();
  rank_backward(&k[1], 999999, 4);
  rank_expect(&k[1], MOK_ECONTEXT, "context 999999 is unknown");
  rank_expect(&k[0], MOK_EGROUP, "EP rank 1's Backward was refused: context 999999 is unknown");
  ck_assert_double_lt(now_ms() - t0, 2000);
  for (int r = 0; r < 2; r++)
    rank_backward(&k[r], c[r], 4);
  for (int r = 0; r < 2; r++)
    mokd__response__free_unpacked(rank_ok(&k[r], "Backward"), NULL);
  ranks_step(k);
  mok_close(cl);
  ranks_close(k);
}
END_TEST

/* A rank that releases its context of a forward whose group Backward the
 * others wait in ends their wait at once; the group stands. */
START_TEST(ep_release_ends_a_backward_wait)
{
  raw_rank k[2];
  uint64_t c[2];
  double t0;

  ranks_join(k, 22);
  for (int r = 0; r < 2; r++)
    rank_forward(&k[r], 4, 0, 0, -1);
  for (int r = 0; r < 2; r++)
    c[r] = rank_context(&k[r]);
  rank_backward(&k[0], c[0], 4);
  wait_results(1);
  t0 = now_ms();
  rank_release(&k[1], c[1]);
  mokd__response__free_unpacked(rank_ok(&k[1], "Release"), NULL);
  rank_expect(&k[0], MOK_ECONTEXT, "EP rank 1 released its context");
  ck_assert_double_lt(now_ms() - t0, 2000);
  ranks_step(k);
  ranks_close(k);
}
END_TEST

/* A rank that sends its step early waits for the late one, and its
 * reply's queued time says so. */
START_TEST(ep_early_rank_queued_time_has_its_wait)
{
  raw_rank k[2];
  mok_client *cl = connect_ok();
  Mokd__Response *rep;
  const uint64_t delay_ms = 300;

  ranks_join(k, 24);
  rank_forward(&k[0], 4, 0, 0, -1);
  wait_contexts(cl, 1); /* rank 0's forward is parked */
  usleep(delay_ms * 1000);
  rank_forward(&k[1], 4, 0, 0, -1);
  rep = rank_ok(&k[0], "Forward");
  ck_assert_ptr_nonnull(rep->forward_done->timing);
  ck_assert_uint_ge(rep->forward_done->timing->queued_ns, delay_ms * 1000000);
  mokd__response__free_unpacked(rep, NULL);
  mokd__response__free_unpacked(rank_ok(&k[1], "Forward"), NULL);
  mok_close(cl);
  ranks_close(k);
}
END_TEST

Suite *daemon_ep_suite(void)
{
  Suite *s = suite_create("daemon_ep");
  TCase *tc = tcase_create("bitwise");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, ep_bitwise_bf16);
  tcase_add_test(tc, ep_bitwise_fp32_odd_tokens);
  tcase_add_test(tc, ep_bitwise_empty_and_hot_experts);
  tcase_add_test(tc, ep_bitwise_moved_weights);
  suite_add_tcase(s, tc);
  tc = tcase_create("faults");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, ep_rank_killed_mid_step);
  tcase_add_test(tc, ep_rank_killed_while_forming);
  tcase_add_test(tc, ep_rank_killed_while_computing);
  tcase_add_test(tc, ep_rank_never_arrives);
  tcase_add_test(tc, ep_late_rank_told_why);
  tcase_add_test(tc, ep_join_mismatches);
  tcase_add_test(tc, ep_step_mismatch_fails_all);
  tcase_add_test(tc, ep_backward_needs_every_context);
  tcase_add_test(tc, ep_inference_ranks_must_agree);
  tcase_add_test(tc, ep_last_backward_ranks_must_agree);
  tcase_add_test(tc, ep_mismatch_spares_the_next_step);
  tcase_add_test(tc, ep_refused_rank_ends_the_wait);
  tcase_add_test(tc, ep_release_ends_a_backward_wait);
  tcase_add_test(tc, ep_early_rank_queued_time_has_its_wait);
  suite_add_tcase(s, tc);
  return s;
}
