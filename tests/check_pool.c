/* check_pool.c - every task of a job runs exactly once, on any thread count. */
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"
#include "ref.h"

typedef struct {
  atomic_int *hits;
} job;

static void hit(void *arg, int64_t i)
{
  job *j = arg;
  atomic_fetch_add(&j->hits[i], 1);
}

START_TEST(each_task_once)
{
  static const int threads[] = {1, 2, 3, 7};
  for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
    mokc_pool *p;
    ck_assert_int_eq(mokc_pool_create(threads[t], &p), 0);
    ck_assert_int_eq(mokc_pool_threads(p), threads[t]);
    for (int64_t n = 0; n < 300; n += 37) {
      atomic_int *hits = calloc((size_t)n + 1, sizeof *hits);
      job j = {hits};
      for (int rep = 0; rep < 5; rep++)
        mokc_pool_run(p, n, hit, &j);
      for (int64_t i = 0; i < n; i++)
        ck_assert_int_eq(atomic_load(&hits[i]), 5);
      free(hits);
    }
    mokc_pool_destroy(p);
  }
}
END_TEST

/* Short jobs back to back, as a step's phases run them: a worker that wakes
 * after its job has ended must take no task of the next one (it once did,
 * and ran a task of that job a second time, or with the ended job's
 * argument). Every job has its own counters, kept until the end. */
START_TEST(back_to_back_jobs)
{
  enum { JOBS = 20000, N = 24 };
  atomic_int *hits = calloc((size_t)JOBS * N, sizeof *hits);
  mokc_pool *p;

  ck_assert_ptr_nonnull(hits);
  ck_assert_int_eq(mokc_pool_create(7, &p), 0);
  for (int k = 0; k < JOBS; k++) {
    job j = {hits + (size_t)k * N};
    mokc_pool_run(p, k % 2 ? N : 2, hit, &j);
  }
  mokc_pool_destroy(p);
  for (int k = 0; k < JOBS; k++)
    for (int i = 0; i < N; i++)
      ck_assert_msg(atomic_load(&hits[(size_t)k * N + i]) == (i < (k % 2 ? N : 2)),
                    "job %d task %d ran %d times", k, i, atomic_load(&hits[(size_t)k * N + i]));
  free(hits);
}
END_TEST

START_TEST(rejects_zero_threads)
{
  mokc_pool *p = (mokc_pool *)1;
  ck_assert_int_ne(mokc_pool_create(0, &p), 0);
  ck_assert_ptr_null(p);
}
END_TEST

Suite *pool_suite(void)
{
  Suite *s = suite_create("pool");
  TCase *tc = tcase_create("run");
  tcase_add_test(tc, each_task_once);
  tcase_add_test(tc, back_to_back_jobs);
  tcase_add_test(tc, rejects_zero_threads);
  suite_add_tcase(s, tc);
  return s;
}
