/* check_ops.c - the pure parts of the operators' side: the metrics
 * listener's request parser and the executors' progress rule that feeds the
 * systemd watchdog. */
#include <string.h>

#include "httpreq.h"
#include "progress.h"
#include "ref.h"

static mokd_http_req parse(const char *s, int *complete)
{
  mokd_http_req r;
  *complete = mokd_http_parse(s, strlen(s), &r);
  return r;
}

START_TEST(http_requests_get_the_right_status)
{
  static const struct {
    const char *req;
    int status, head;
  } cases[] = {
      {"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 200, 0},
      {"GET /metrics?name[]=x HTTP/1.0\r\n\r\n", 200, 0},
      {"HEAD /metrics HTTP/1.1\r\n\r\n", 200, 1},
      {"GET /metrics HTTP/1.1\n\n", 200, 0},
      {"GET / HTTP/1.1\r\n\r\n", 404, 0},
      {"GET /metricsX HTTP/1.1\r\n\r\n", 404, 0},
      {"POST /metrics HTTP/1.1\r\n\r\n", 405, 0},
      {"DELETE /metrics HTTP/1.1\r\n\r\n", 405, 0},
      {"GET /metrics HTTP/2.0\r\n\r\n", 505, 0},
      {"GET /metrics HTTP/1.1 x\r\n\r\n", 400, 0},
      {"GET  /metrics HTTP/1.1\r\n\r\n", 400, 0},
      {"GET /metrics\r\n\r\n", 400, 0},
      {"\r\n\r\n", 400, 0},
      {"hello world\n\n", 400, 0},
      {"GET /metrics FTP/1.1\r\n\r\n", 400, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int complete;
    mokd_http_req r = parse(cases[i].req, &complete);
    ck_assert_msg(complete == 1, "case %zu incomplete", i);
    ck_assert_msg(r.status == cases[i].status, "case %zu: %d, want %d", i, r.status,
                  cases[i].status);
    ck_assert_int_eq(r.head, cases[i].head);
  }
}
END_TEST

START_TEST(http_partial_and_oversized_requests)
{
  static char big[MOKD_HTTP_MAX_REQUEST];
  mokd_http_req r;
  int complete;

  parse("GET /metrics HTTP/1.1\r\nHost: x\r\n", &complete);
  ck_assert_int_eq(complete, 0); /* no blank line yet: wait for more */
  parse("", &complete);
  ck_assert_int_eq(complete, 0);
  memset(big, 'a', sizeof big);
  ck_assert_int_eq(mokd_http_parse(big, sizeof big - 1, &r), 0);
  ck_assert_int_eq(mokd_http_parse(big, sizeof big, &r), 1);
  ck_assert_int_eq(r.status, 431);
  /* a NUL inside the head */
  ck_assert_int_eq(mokd_http_parse("GET /metr\0cs HTTP/1.1\r\n\r\n", 25, &r), 1);
  ck_assert_int_eq(r.status, 400);
  ck_assert_str_eq(mokd_http_reason(405), "Method Not Allowed");
}
END_TEST

#define S 1000000000ull

START_TEST(progress_idle_executor_is_never_stuck)
{
  mokd_progress p = {0};
  ck_assert_uint_eq(mokd_progress_stuck(&p, 1000 * S, 60 * S), 0);
  mokd_progress_queued(&p, 10 * S);
  mokd_progress_done(&p, 11 * S);
  /* nothing queued for an hour: idle, not stuck */
  ck_assert_uint_eq(mokd_progress_stuck(&p, 3600 * S, 60 * S), 0);
}
END_TEST

START_TEST(progress_work_without_completion_is_stuck)
{
  mokd_progress p = {0};
  mokd_progress_queued(&p, 100 * S); /* arrives at an idle executor at t = 100 s */
  ck_assert_uint_eq(mokd_progress_stuck(&p, 159 * S, 60 * S), 0);
  ck_assert_uint_eq(mokd_progress_stuck(&p, 160 * S, 60 * S), 60 * S);
  /* more work queued behind it does not restart the clock */
  mokd_progress_queued(&p, 150 * S);
  ck_assert_uint_eq(mokd_progress_stuck(&p, 165 * S, 60 * S), 65 * S);
  /* one completes: progress; the other has 60 s from now */
  mokd_progress_done(&p, 170 * S);
  ck_assert_uint_eq(mokd_progress_stuck(&p, 229 * S, 60 * S), 0);
  ck_assert_uint_eq(mokd_progress_stuck(&p, 231 * S, 60 * S), 61 * S);
  mokd_progress_done(&p, 232 * S);
  ck_assert_uint_eq(mokd_progress_stuck(&p, 1000 * S, 60 * S), 0);
  ck_assert_uint_eq(p.completed, 2);
}
END_TEST

START_TEST(progress_busy_executor_that_keeps_completing_is_not_stuck)
{
  mokd_progress p = {0};
  uint64_t t = 0;
  /* always two steps outstanding, one completing every 30 s, for an hour */
  mokd_progress_queued(&p, t);
  mokd_progress_queued(&p, t);
  for (t = 30 * S; t < 3600 * S; t += 30 * S) {
    ck_assert_uint_eq(mokd_progress_stuck(&p, t, 60 * S), 0);
    mokd_progress_done(&p, t);
    mokd_progress_queued(&p, t);
  }
  ck_assert_uint_eq(p.outstanding, 2);
}
END_TEST

Suite *ops_suite(void)
{
  Suite *s = suite_create("ops");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, http_requests_get_the_right_status);
  tcase_add_test(tc, http_partial_and_oversized_requests);
  tcase_add_test(tc, progress_idle_executor_is_never_stuck);
  tcase_add_test(tc, progress_work_without_completion_is_stuck);
  tcase_add_test(tc, progress_busy_executor_that_keeps_completing_is_not_stuck);
  suite_add_tcase(s, tc);
  return s;
}
