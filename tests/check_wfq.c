/* check_wfq.c - the fair queue's order (daemon/wfq.c) on its own: which item
 * leaves next, with no executor and no clock. */
#include <check.h>
#include <string.h>

#include "ref.h"
#include "wfq.h"

/* the order items leave in, as indexes into its */
static int drain(mokd_wfq *q, mokd_wfq_item *its, int *order, int max)
{
  mokd_wfq_item *it;
  int n = 0;

  while ((it = mokd_wfq_pop(q)) != NULL && n < max)
    order[n++] = (int)(it - its);
  return n;
}

START_TEST(one_tenant_is_fifo)
{
  mokd_wfq q;
  mokd_wfq_item its[5];
  int order[5];

  mokd_wfq_init(&q);
  for (int i = 0; i < 5; i++)
    ck_assert_int_eq(mokd_wfq_push(&q, &its[i], "job:1", 1 + i), 0); /* weight changes too */
  ck_assert_int_eq(drain(&q, its, order, 5), 5);
  for (int i = 0; i < 5; i++)
    ck_assert_int_eq(order[i], i);
  ck_assert_int_eq(q.len, 0);
  ck_assert_ptr_null(q.tenants);
}
END_TEST

/* A light tenant's item queued behind 8 of a heavy one leaves second: the
 * heavy one's first has the same tag and came earlier. */
START_TEST(light_tenant_not_behind_heavy_backlog)
{
  mokd_wfq q;
  mokd_wfq_item its[9];
  int order[9];

  mokd_wfq_init(&q);
  for (int i = 0; i < 8; i++)
    mokd_wfq_push(&q, &its[i], "job:heavy", 1);
  mokd_wfq_push(&q, &its[8], "uid:1000", 1);
  ck_assert_int_eq(drain(&q, its, order, 9), 9);
  ck_assert_int_eq(order[0], 0);
  ck_assert_int_eq(order[1], 8);
  for (int i = 2; i < 9; i++)
    ck_assert_int_eq(order[i], i - 1);
}
END_TEST

/* Two tenants that always have work, weights 3 and 1: of every 4 items
 * leaving, 3 are the first's, and the order is the same on every run. */
START_TEST(weights_share_three_to_one)
{
  enum { N = 400 };
  static mokd_wfq_item its[2 * N];
  static int order[2 * N];
  mokd_wfq q;
  int a = 0;

  mokd_wfq_init(&q);
  for (int i = 0; i < N; i++) {
    mokd_wfq_push(&q, &its[2 * i], "job:a", 3);
    mokd_wfq_push(&q, &its[2 * i + 1], "job:b", 1);
  }
  ck_assert_int_eq(drain(&q, its, order, 2 * N), 2 * N);
  for (int k = 0; k < N; k++) {
    a += order[k] % 2 == 0;
    if (k % 4 == 3)
      ck_assert_int_eq(a, 3 * (k + 1) / 4);
  }
  /* within each tenant, arrival order */
  for (int k = 1, la = -1, lb = -1; k < 2 * N; k++) {
    int *last = order[k] % 2 == 0 ? &la : &lb;
    ck_assert_int_gt(order[k], *last);
    *last = order[k];
  }
}
END_TEST

/* A tenant that was idle does not bank credit: coming back, it gets its
 * share from now on, not a burst for the time it was away. */
START_TEST(idle_tenant_banks_no_credit)
{
  mokd_wfq q;
  mokd_wfq_item its[20];
  int order[20];

  mokd_wfq_init(&q);
  for (int i = 0; i < 10; i++)
    mokd_wfq_push(&q, &its[i], "job:a", 1);
  for (int i = 0; i < 10; i++)
    ck_assert_ptr_eq(mokd_wfq_pop(&q), &its[i]);
  for (int i = 10; i < 20; i++)
    mokd_wfq_push(&q, &its[i], i % 2 ? "job:b" : "job:a", 1);
  ck_assert_int_eq(drain(&q, its, order, 20), 10);
  for (int i = 0; i < 10; i++)
    ck_assert_int_eq(order[i], 10 + i); /* alternating, as they came */
}
END_TEST

/* The daemon's own items go before every tenant's, in their order. */
START_TEST(own_items_first)
{
  mokd_wfq q;
  mokd_wfq_item its[4];

  mokd_wfq_init(&q);
  mokd_wfq_push(&q, &its[0], "job:a", 1);
  mokd_wfq_push(&q, &its[1], NULL, 1);
  mokd_wfq_push(&q, &its[2], "job:b", 8);
  mokd_wfq_push(&q, &its[3], NULL, 1);
  ck_assert_ptr_eq(mokd_wfq_pop(&q), &its[1]);
  ck_assert_ptr_eq(mokd_wfq_pop(&q), &its[3]);
  ck_assert_ptr_eq(mokd_wfq_pop(&q), &its[2]); /* weight 8: the smaller tag */
  ck_assert_ptr_eq(mokd_wfq_pop(&q), &its[0]);
  ck_assert_ptr_null(mokd_wfq_pop(&q));
  mokd_wfq_clear(&q);
}
END_TEST

Suite *wfq_suite(void)
{
  Suite *s = suite_create("wfq");
  TCase *tc = tcase_create("order");

  tcase_add_test(tc, one_tenant_is_fifo);
  tcase_add_test(tc, light_tenant_not_behind_heavy_backlog);
  tcase_add_test(tc, weights_share_three_to_one);
  tcase_add_test(tc, idle_tenant_banks_no_credit);
  tcase_add_test(tc, own_items_first);
  suite_add_tcase(s, tc);
  return s;
}
