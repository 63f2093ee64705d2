/* check_daemon_tenants.c - a tenant's record through the daemon: it goes
 * with its last session, and SIGHUP gives live tenants new weights and
 * quotas. Seen from outside, through the metrics (a Unix socket listener)
 * and the replies and log lines a client and an operator get. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon_fixture.h"
#include "testbed.h"

/* GET /metrics on the Unix socket path into buf (the body and headers). */
static void scrape(const char *path, char *buf, size_t n)
{
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  const char req[] = "GET /metrics HTTP/1.0\r\n\r\n";
  size_t len = 0;
  ssize_t k;
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);

  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(write(fd, req, sizeof req - 1), (ssize_t)(sizeof req - 1));
  while (len < n - 1 && (k = read(fd, buf + len, n - 1 - len)) > 0)
    len += (size_t)k;
  buf[len] = 0;
  close(fd);
  ck_assert_msg(strstr(buf, "200 OK") != NULL, "%.200s", buf);
}

/* lines of text that start with prefix */
static int count_lines(const char *text, const char *prefix)
{
  int n = 0;
  for (const char *p = text; p != NULL; p = strchr(p, '\n')) {
    p += *p == '\n';
    n += strncmp(p, prefix, strlen(prefix)) == 0;
  }
  return n;
}

/* the metrics hold line (a whole "name{labels} value") within 5 s */
static void expect_metric(const char *path, const char *line)
{
  static char buf[1 << 16];
  char needle[256];

  snprintf(needle, sizeof needle, "\n%s\n", line);
  for (int i = 0; i < 500; i++) {
    scrape(path, buf, sizeof buf);
    if (strstr(buf, needle) != NULL)
      return;
    usleep(10000);
  }
  ck_abort_msg("no \"%s\" in the metrics:\n%s", line, strstr(buf, "# HELP mokd_tenant"));
}

static void expect_log(const char *log, const char *needle)
{
  static char buf[1 << 16];
  for (int i = 0; i < 500; i++) {
    FILE *f = fopen(log, "r");
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    if (strstr(buf, needle) != NULL)
      return;
    usleep(10000);
  }
  ck_abort_msg("no \"%s\" in the log", needle);
}

static mok_client *connect_as_job(const char *job)
{
  mok_client *c;
  setenv("MOKD_JOB_ID", job, 1); /* read at connect */
  ck_assert_int_eq(mok_connect(sock, job, &c), 0);
  unsetenv("MOKD_JOB_ID");
  return c;
}

static void write_conf(const char *path, const char *text)
{
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

/* Forty jobs come and go, each with memory and some with steps: once they
 * are gone only the tenant still connected is left, and a job that comes
 * back starts its counters again. */
START_TEST(finished_jobs_leave_no_tenant_records)
{
  own_daemon od;
  char flags[160], msock[96], job[32];
  static char buf[1 << 16];
  mok_layer_desc d = {.hidden = 128, .intermediate = 64, .experts = 8, .top_k = 2};

  snprintf(msock, sizeof msock, "%s/prune.m.sock", dir);
  snprintf(flags, sizeof flags, "--metrics=%s", msock);
  own_daemon_start(&od, "prune", flags);
  mok_client *keep = connect_as_job("keep");
  for (int i = 0; i < 40; i++) {
    mok_client *c;
    mok_arena_info a;
    snprintf(job, sizeof job, "gone-%d", i);
    c = connect_as_job(job);
    ck_assert_msg(mok_arena_create(c, 64 << 10, &a) == 0, "%s", mok_last_error(c));
    if (i % 4 == 0) {
      mok_testbed tb;
      mok_forward_result f;
      ck_assert_int_eq(mok_testbed_setup(c, &d, 64, (uint64_t)i, &tb), 0);
      ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f), 0);
    }
    mok_close(c); /* the forward's context and the arenas go with the session */
  }
  expect_metric(msock, "mokd_sessions 1");
  expect_metric(msock, "mokd_tenant_steps_total{tenant=\"job:keep\"} 0");
  scrape(msock, buf, sizeof buf);
  ck_assert_msg(count_lines(buf, "mokd_tenant_steps_total{") == 1 &&
                    count_lines(buf, "mokd_tenant_memory_bytes{") == 1 &&
                    count_lines(buf, "mokd_tenant_weight{") == 1,
                "tenants of closed sessions are left:\n%s", strstr(buf, "# HELP mokd_tenant"));

  mok_client *back = connect_as_job("gone-0");
  expect_metric(msock, "mokd_tenant_steps_total{tenant=\"job:gone-0\"} 0");
  mok_close(back);
  mok_close(keep);
  expect_metric(msock, "mokd_sessions 0");
  scrape(msock, buf, sizeof buf);
  ck_assert_int_eq(count_lines(buf, "mokd_tenant_steps_total{"), 0);
  own_daemon_stop(&od);
  unlink(msock);
}
END_TEST

/* SIGHUP re-reads tenant_weights and tenant_quota_bytes and applies them to
 * a connected tenant: a lowered quota leaves the memory it holds alone and
 * refuses more; a bad value keeps both lists as they were, and says where. */
START_TEST(sighup_rereads_tenant_weights_and_quotas)
{
  own_daemon od;
  char flags[300], msock[96], conf[96];
  mok_arena_info big, small;

  snprintf(msock, sizeof msock, "%s/hup.m.sock", dir);
  snprintf(conf, sizeof conf, "%s/hup.conf", dir);
  write_conf(conf, "[mokd]\ntenant_weights = job:hup=2\ntenant_quota_bytes = job:hup=8M\n");
  snprintf(flags, sizeof flags, "--config=%s --metrics=%s", conf, msock);
  own_daemon_start(&od, "hup", flags);
  mok_client *c = connect_as_job("hup");
  expect_metric(msock, "mokd_tenant_weight{tenant=\"job:hup\"} 2");
  expect_metric(msock, "mokd_tenant_quota_bytes{tenant=\"job:hup\"} 8388608");
  ck_assert_msg(mok_arena_create(c, 4 << 20, &big) == 0, "%s", mok_last_error(c));

  write_conf(conf, "[mokd]\ntenant_weights = job:hup=5,job:new=3\n"
                   "tenant_quota_bytes = job:hup=2M\n");
  ck_assert_int_eq(kill(od.pid, SIGHUP), 0);
  expect_metric(msock, "mokd_tenant_quota_bytes{tenant=\"job:hup\"} 2097152");
  expect_metric(msock, "mokd_tenant_weight{tenant=\"job:hup\"} 5");
  expect_metric(msock, "mokd_tenant_memory_bytes{tenant=\"job:hup\"} 4194304");
  memset(big.ptr, 1, big.bytes); /* still the session's */
  ck_assert_int_eq(mok_arena_create(c, 64 << 10, &small), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(c), "tenant job:hup would hold 4259840 bytes") != NULL &&
                    strstr(mok_last_error(c), "its quota is 2097152 (tenant_quota_bytes)") !=
                        NULL,
                "%s", mok_last_error(c));
  mok_client *fresh = connect_as_job("new"); /* a tenant after the reload gets it too */
  expect_metric(msock, "mokd_tenant_weight{tenant=\"job:new\"} 3");
  mok_close(fresh);

  write_conf(conf, "[mokd]\ntenant_weights = job:hup=9\ntenant_quota_bytes = job:hup=lots\n");
  ck_assert_int_eq(kill(od.pid, SIGHUP), 0);
  char needle[300];
  snprintf(needle, sizeof needle, "SIGHUP: tenant_weights and tenant_quota_bytes kept: %s:3: "
           "tenant_quota_bytes: \"job:hup=lots\": the quota is a size", conf);
  expect_log(od.log, needle);
  expect_metric(msock, "mokd_tenant_weight{tenant=\"job:hup\"} 5");
  expect_metric(msock, "mokd_tenant_quota_bytes{tenant=\"job:hup\"} 2097152");

  ck_assert_int_eq(mok_arena_destroy(c, big.id), 0);
  ck_assert_msg(mok_arena_create(c, 1 << 20, &small) == 0, "%s", mok_last_error(c));
  ck_assert_int_eq(mok_arena_create(c, 2 << 20, &big), MOK_EDQUOT);
  mok_close(c);
  own_daemon_stop(&od);
  unlink(msock);
  unlink(conf);
}
END_TEST

Suite *daemon_tenants_suite(void)
{
  Suite *s = suite_create("daemon_tenants");
  TCase *tc = tcase_create("tenants");

  tcase_add_checked_fixture(tc, plain_setup, plain_teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, finished_jobs_leave_no_tenant_records);
  tcase_add_test(tc, sighup_rereads_tenant_weights_and_quotas);
  suite_add_tcase(s, tc);
  return s;
}
