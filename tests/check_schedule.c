/* check_schedule.c - the routing plan: counts, segments and row order. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

static char err[MOK_ERRLEN];

static mokk_shape shape(int64_t E, int64_t K, int64_t P)
{
  return (mokk_shape){.H = 8, .I = 8, .E = E, .K = K, .I_s = 0, .P = P};
}

/* Invariants every plan must satisfy, checked from first principles. */
static void check_plan(const mokk_plan *pl, const int32_t *const *ids)
{
  int64_t P = pl->P, T = pl->T, K = pl->K, E = pl->E, pairs = P * T * K, total = 0;
  int64_t routed = 0;
  char *seen = calloc((size_t)pairs, 1);

  /* a pair with no route has no row */
  for (int64_t gp = 0; gp < pairs; gp++) {
    int none = ids[gp / (T * K)][gp % (T * K)] == MOKK_NO_ROUTE;
    routed += !none;
    if (none)
      ck_assert_int_eq(pl->slot[gp], -1);
  }

  for (int64_t e = 0; e < E; e++) {
    int64_t n = 0;
    for (int64_t r = 0; r < P; r++)
      n += pl->count[r * E + e];
    ck_assert_int_eq(pl->seg_rows[e], n);
    total += n;
  }
  ck_assert_int_eq(total, routed);
  ck_assert_int_eq(pl->recv_base[P], routed);
  for (int64_t p = 0; p < P; p++) {
    int64_t at = 0;
    for (int64_t e = p * pl->E_local; e < (p + 1) * pl->E_local; e++) {
      ck_assert_int_eq(pl->seg_start[e], at);
      /* rows of a segment: all of expert e, strictly increasing global pair index */
      for (int64_t q = 0; q < pl->seg_rows[e]; q++) {
        int64_t gp = pl->src[pl->recv_base[p] + at + q];
        int64_t r = gp / (T * K), i = gp % (T * K);
        ck_assert_int_eq(ids[r][i], e);
        ck_assert_int_eq(pl->slot[gp], at + q);
        if (q > 0)
          ck_assert_int_lt(pl->src[pl->recv_base[p] + at + q - 1], gp);
        ck_assert(!seen[gp]);
        seen[gp] = 1;
      }
      at += pl->seg_rows[e];
    }
    ck_assert_int_eq(pl->recv_rows[p], at);
    ck_assert_int_eq(pl->recv_base[p + 1] - pl->recv_base[p], at);
  }
  free(seen);
}

START_TEST(small_example_by_hand)
{
  /* T = 3, K = 2, E = 4: token 0 -> {2, 0}, 1 -> {0, 3}, 2 -> {2, 3} */
  static const int32_t ids0[] = {2, 0, 0, 3, 2, 3};
  const int32_t *ids[] = {ids0};
  mokk_shape s = shape(4, 2, 1);
  mokk_plan pl;

  ck_assert_int_eq(mokk_plan_build(&pl, &s, 3, ids, err), 0);
  static const int64_t rows[] = {2, 0, 2, 2}, start[] = {0, 2, 2, 4};
  static const int64_t src[] = {1, 2, 0, 4, 3, 5}; /* pair = t * K + k */
  for (int e = 0; e < 4; e++) {
    ck_assert_int_eq(pl.seg_rows[e], rows[e]);
    ck_assert_int_eq(pl.seg_start[e], start[e]);
  }
  for (int q = 0; q < 6; q++)
    ck_assert_int_eq(pl.src[q], src[q]);
  check_plan(&pl, ids);
  mokk_plan_free(&pl);
}
END_TEST

START_TEST(pairs_with_no_route)
{
  /* T = 3, K = 2, E = 4: token 0 -> {2, none}, 1 -> {none, none}, 2 -> {0, 2} */
  static const int32_t ids0[] = {2, -1, -1, -1, 0, 2};
  const int32_t *ids[] = {ids0};
  mokk_shape s = shape(4, 2, 1);
  mokk_plan pl;

  ck_assert_int_eq(mokk_plan_build(&pl, &s, 3, ids, err), 0);
  static const int64_t rows[] = {1, 0, 2, 0}, start[] = {0, 1, 1, 3};
  static const int64_t src[] = {4, 0, 5}, slot[] = {1, -1, -1, -1, 0, 2};
  for (int e = 0; e < 4; e++) {
    ck_assert_int_eq(pl.seg_rows[e], rows[e]);
    ck_assert_int_eq(pl.seg_start[e], start[e]);
  }
  for (int q = 0; q < 3; q++)
    ck_assert_int_eq(pl.src[q], src[q]);
  for (int p = 0; p < 6; p++)
    ck_assert_int_eq(pl.slot[p], slot[p]);
  ck_assert_int_eq(pl.recv_base[1], 3);
  check_plan(&pl, ids);
  mokk_plan_free(&pl);

  /* over 2 ranks, with rows of expert 2 from both */
  static const int32_t a[] = {3, -1, -1, -1}, b[] = {-1, 2, 1, 3};
  const int32_t *two[] = {a, b};
  s = shape(4, 2, 2);
  ck_assert_int_eq(mokk_plan_build(&pl, &s, 2, two, err), 0);
  ck_assert_int_eq(pl.recv_rows[0], 1);
  ck_assert_int_eq(pl.recv_rows[1], 3);
  check_plan(&pl, two);
  mokk_plan_free(&pl);
}
END_TEST

START_TEST(empty_experts)
{
  moe_case c;
  mokk_shape s = shape(8, 2, 2);
  mokk_plan pl;
  case_make(&c, &s, 40, 3, ROUTE_HALF);
  const int32_t *ids[] = {c.ids, c.ids + 20 * 2};
  ck_assert_int_eq(mokk_plan_build(&pl, &s, 20, ids, err), 0);
  for (int64_t e = 1; e < 8; e += 2)
    ck_assert_int_eq(pl.seg_rows[e], 0);
  check_plan(&pl, ids);
  mokk_plan_free(&pl);
  case_free(&c);
}
END_TEST

START_TEST(all_tokens_on_one_expert)
{
  int32_t ids0[50];
  for (int i = 0; i < 50; i++)
    ids0[i] = 5;
  const int32_t *ids[] = {ids0};
  mokk_shape s = shape(8, 1, 1);
  mokk_plan pl;
  ck_assert_int_eq(mokk_plan_build(&pl, &s, 50, ids, err), 0);
  ck_assert_int_eq(pl.seg_rows[5], 50);
  for (int q = 0; q < 50; q++)
    ck_assert_int_eq(pl.src[q], q);
  check_plan(&pl, ids);
  mokk_plan_free(&pl);
}
END_TEST

START_TEST(k_equals_e)
{
  moe_case c;
  mokk_shape s = shape(4, 4, 4);
  mokk_plan pl;
  case_make(&c, &s, 12, 11, ROUTE_RANDOM);
  const int32_t *ids[] = {c.ids, c.ids + 12, c.ids + 24, c.ids + 36};
  ck_assert_int_eq(mokk_plan_build(&pl, &s, 3, ids, err), 0);
  for (int e = 0; e < 4; e++) {
    ck_assert_int_eq(pl.seg_rows[e], 12); /* every token visits every expert */
    ck_assert_int_eq(pl.recv_rows[e], 12); /* one expert per rank */
  }
  check_plan(&pl, ids);
  mokk_plan_free(&pl);
  case_free(&c);
}
END_TEST

START_TEST(one_token)
{
  static const int32_t ids0[] = {3, 1};
  mokk_shape s = shape(4, 2, 2);
  mokk_plan pl;
  /* P = 2 needs two ranks of one token each */
  static const int32_t ids1[] = {0, 3};
  const int32_t *ids2[] = {ids0, ids1};
  ck_assert_int_eq(mokk_plan_build(&pl, &s, 1, ids2, err), 0);
  ck_assert_int_eq(pl.recv_rows[0], 2); /* experts 0, 1 on rank 0: pairs (0,1), (1,0) */
  ck_assert_int_eq(pl.src[0], 2);       /* expert 0: rank 1 token 0 k 0 */
  ck_assert_int_eq(pl.src[1], 1);       /* expert 1: rank 0 token 0 k 1 */
  ck_assert_int_eq(pl.src[2], 0);       /* expert 3 (rank 1): rank 0 first ... */
  ck_assert_int_eq(pl.src[3], 3);       /* ... then rank 1 */
  check_plan(&pl, ids2);
  mokk_plan_free(&pl);
}
END_TEST

START_TEST(global_order_across_ranks)
{
  /* the same ids split over P ranks give every expert the same global row list */
  moe_case c;
  mokk_shape s1 = shape(8, 3, 1);
  case_make(&c, &s1, 64, 5, ROUTE_RANDOM);
  mokk_plan base;
  const int32_t *all[] = {c.ids};
  ck_assert_int_eq(mokk_plan_build(&base, &s1, 64, all, err), 0);
  for (int64_t P = 2; P <= 8; P *= 2) {
    mokk_shape s = shape(8, 3, P);
    const int32_t *ids[8];
    mokk_plan pl;
    for (int64_t r = 0; r < P; r++)
      ids[r] = c.ids + r * (64 / P) * 3;
    ck_assert_int_eq(mokk_plan_build(&pl, &s, 64 / P, ids, err), 0);
    check_plan(&pl, ids);
    for (int64_t e = 0; e < 8; e++) {
      int64_t p = e / pl.E_local;
      ck_assert_int_eq(pl.seg_rows[e], base.seg_rows[e]);
      for (int64_t q = 0; q < pl.seg_rows[e]; q++)
        ck_assert_int_eq(pl.src[pl.recv_base[p] + pl.seg_start[e] + q],
                         base.src[base.seg_start[e] + q]);
    }
    mokk_plan_free(&pl);
  }
  mokk_plan_free(&base);
  case_free(&c);
}
END_TEST

/* ids live in memory a client shares with the daemon: another thread may
 * change them while the plan is built. Each id must be read once: a plan
 * that checks one value and places another writes outside its arrays. */
typedef struct flipper {
  volatile int32_t *id;
  atomic_int stop;
} flipper;

static void *flip_id(void *p)
{
  flipper *f = p;
  for (uint32_t n = 0; !atomic_load(&f->stop); n++)
    *f->id = n % 3 == 0 ? 1 : n % 3 == 1 ? 0x40000000 : -0x40000000;
  return NULL;
}

START_TEST(ids_changing_under_the_plan)
{
  enum { T = 256, K = 2 };
  mokk_shape s = shape(4, K, 1);
  int32_t *ids = malloc(T * K * sizeof *ids), *valid = malloc(T * K * sizeof *valid);
  const int32_t *live[] = {ids}, *seen[] = {valid};
  flipper f = {.id = &ids[5]};
  pthread_t th;
  int built = 0, refused = 0;

  for (int i = 0; i < T * K; i++)
    ids[i] = valid[i] = i % 4;
  valid[5] = 1; /* the one value of ids[5] a plan may be built from */
  ck_assert_int_eq(pthread_create(&th, NULL, flip_id, &f), 0);
  for (int n = 0; n < 3000; n++) {
    mokk_plan pl;
    int rc = mokk_plan_build(&pl, &s, T, live, err);
    if (rc == 0) {
      if (built++ % 64 == 0)
        check_plan(&pl, seen);
      ck_assert_int_eq(pl.seg_rows[1], T * K / 4); /* ids[5] counted as 1 */
      mokk_plan_free(&pl);
    } else {
      ck_assert_int_eq(rc, MOK_EEXPERT);
      ck_assert_msg(strstr(err, "token 2 k 1: expert id ") != NULL, "%s", err);
      refused++;
    }
  }
  atomic_store(&f.stop, 1);
  pthread_join(th, NULL);
  ck_assert_int_eq(built + refused, 3000);
  free(ids);
  free(valid);
}
END_TEST

Suite *schedule_suite(void)
{
  Suite *s = suite_create("schedule");
  TCase *tc = tcase_create("plan");
  tcase_add_test(tc, small_example_by_hand);
  tcase_add_test(tc, pairs_with_no_route);
  tcase_add_test(tc, empty_experts);
  tcase_add_test(tc, all_tokens_on_one_expert);
  tcase_add_test(tc, k_equals_e);
  tcase_add_test(tc, one_token);
  tcase_add_test(tc, global_order_across_ranks);
  tcase_add_test(tc, ids_changing_under_the_plan);
  suite_add_tcase(s, tc);
  return s;
}
