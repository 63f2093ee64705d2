/* check_idmap.c - the id map against a plain array, through random puts,
 * gets and deletes (deletion moves keys back: every key must stay found). */
#include <stdlib.h>

#include "idmap.h"
#include "ref.h"

START_TEST(random_operations_match_an_array)
{
  enum { IDS = 3000, OPS = 200000 };
  static void *want[IDS + 1];
  mokd_idmap m;
  uint64_t s = 7;
  size_t n = 0;

  mokd_idmap_init(&m);
  ck_assert_ptr_null(mokd_idmap_get(&m, 5));
  mokd_idmap_del(&m, 5); /* deleting from an empty map is nothing */
  ck_assert_int_eq(mokd_idmap_put(&m, 0, &s), MOK_EINVAL);
  for (int op = 0; op < OPS; op++) {
    /* ids in clusters, as the daemon's counter hands them out */
    uint64_t id = 1 + rng_next(&s) % IDS;
    switch (rng_next(&s) % 3) {
    case 0:
      n += want[id] == NULL;
      want[id] = &want[id];
      ck_assert_int_eq(mokd_idmap_put(&m, id, &want[id]), 0);
      break;
    case 1:
      n -= want[id] != NULL;
      want[id] = NULL;
      mokd_idmap_del(&m, id);
      break;
    default:
      ck_assert_ptr_eq(mokd_idmap_get(&m, id), want[id]);
    }
    ck_assert_uint_eq(m.n, n);
    if (op % 20000 == 0)
      for (uint64_t k = 1; k <= IDS; k++)
        ck_assert_ptr_eq(mokd_idmap_get(&m, k), want[k]);
  }
  mokd_idmap_free(&m);
}
END_TEST

START_TEST(large_ids_and_emptying)
{
  mokd_idmap m;
  static int v[100000];
  mokd_idmap_init(&m);
  for (int i = 0; i < 100000; i++)
    ck_assert_int_eq(mokd_idmap_put(&m, (uint64_t)i * 1000003u + (1ull << 40), &v[i]), 0);
  for (int i = 0; i < 100000; i++)
    ck_assert_ptr_eq(mokd_idmap_get(&m, (uint64_t)i * 1000003u + (1ull << 40)), &v[i]);
  for (int i = 99999; i >= 0; i--)
    mokd_idmap_del(&m, (uint64_t)i * 1000003u + (1ull << 40));
  ck_assert_uint_eq(m.n, 0);
  for (size_t i = 0; i < m.cap; i++)
    ck_assert_uint_eq(m.keys[i], 0);
  mokd_idmap_free(&m);
}
END_TEST

Suite *idmap_suite(void)
{
  Suite *s = suite_create("idmap");
  TCase *tc = tcase_create("map");
  tcase_add_test(tc, random_operations_match_an_array);
  tcase_add_test(tc, large_ids_and_emptying);
  suite_add_tcase(s, tc);
  return s;
}
