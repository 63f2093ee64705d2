/* check_daemon_service.c - mokd as a service: drain on SIGTERM, one daemon
 * per socket, a bad config stops start-up, the allow-list, sd_notify and the
 * watchdog, and mokctl next to it. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
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

START_TEST(sigterm_finishes_in_flight_work)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 512, .intermediate = 512, .experts = 8, .top_k = 4};
  mok_testbed tb;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 2048, 5, &tb), 0);
  pid_t killer = fork();
  if (killer == 0) {
    usleep(100000);
    kill(daemon_pid, SIGTERM);
    _exit(0);
  }
  mok_forward_result f;
  int rc = mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f);
  waitpid(killer, NULL, 0);
  ck_assert_msg(rc == 0, "in-flight forward: %s", mok_last_error(c));
  uint64_t rtt;
  ck_assert_int_ne(mok_ping(c, &rtt), 0); /* and then the daemon is gone */
  mok_close(c);
  int st;
  ck_assert_int_eq(waitpid(daemon_pid, &st, 0), daemon_pid);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  /* the fixture's teardown must not wait for it again */
  daemon_pid = spawn_daemon(sock, "--executor-threads=1", logpath);
  wait_for_socket(sock, daemon_pid);
}
END_TEST

START_TEST(second_daemon_and_stale_socket)
{
  char log2[128], path2[128];
  snprintf(log2, sizeof log2, "%s/second.log", dir);
  pid_t p = spawn_daemon(sock, "--executor-threads=1", log2);
  int st;
  ck_assert_int_eq(waitpid(p, &st, 0), p);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0);
  FILE *f = fopen(log2, "r");
  char buf[2048] = "";
  ck_assert_uint_gt(fread(buf, 1, sizeof buf - 1, f), 0);
  fclose(f);
  ck_assert_msg(strstr(buf, "another mokd is serving") != NULL, "log: %s", buf);

  /* a socket file nobody listens on is removed and the daemon starts */
  snprintf(path2, sizeof path2, "%s/stale.sock", dir);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  strcpy(sa.sun_path, path2);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  close(fd);
  p = spawn_daemon(path2, "--executor-threads=1", log2);
  wait_for_socket(path2, p);
  struct stat sst;
  ck_assert_int_eq(stat(path2, &sst), 0);
  ck_assert_int_eq(sst.st_mode & 0777, 0660);
  st = stop_daemon(p);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  ck_assert_int_ne(access(path2, F_OK), 0); /* removed on the way out */
  unlink(log2);
}
END_TEST

START_TEST(config_error_stops_startup)
{
  char conf[128], cmd[512];
  snprintf(conf, sizeof conf, "%s/bad.conf", dir);
  FILE *f = fopen(conf, "w");
  fputs("[mokd]\nexecutor_threads = 2\nmax_frame_bytes = -5\n", f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "%s --config %s --socket %s/x.sock 2>&1", mokd_bin(), conf, dir);
  FILE *pp = popen(cmd, "r");
  char out[1024] = "";
  size_t n = fread(out, 1, sizeof out - 1, pp);
  int st = pclose(pp);
  out[n] = 0;
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2);
  char want[192];
  snprintf(want, sizeof want, "%s:3: max_frame_bytes", conf);
  ck_assert_msg(strstr(out, want) != NULL, "output: %s", out);
  unlink(conf);
}
END_TEST

/* On a machine without the NVIDIA driver, the CUDA runtime says the driver
 * is "insufficient": mokd says there is none. */
START_TEST(no_driver_is_named)
{
  char cmd[512], out[4096] = "";
  snprintf(cmd, sizeof cmd, "%s --config /dev/null --backend cuda --socket %s/x.sock 2>&1",
           mokd_bin(), dir);
#ifdef MOKK_HAVE_CUDA
  void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver != NULL) { /* a driver is here: nothing to show */
    dlclose(driver);
    return;
  }
  FILE *pp = popen(cmd, "r");
  size_t n = fread(out, 1, sizeof out - 1, pp);
  int st = pclose(pp);
  out[n] = 0;
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d: %s", st, out);
  ck_assert_msg(strstr(out, "no usable CUDA device: no NVIDIA driver is installed "
                            "(libcuda.so.1 cannot be loaded)") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "insufficient") == NULL, "%s", out);
  /* and backend auto, as the fixture's daemon runs, says it on its way to cpu */
  FILE *f = fopen(logpath, "r");
  n = fread(out, 1, sizeof out - 1, f);
  fclose(f);
  out[n] = 0;
  ck_assert_msg(strstr(out, "backend auto: no usable CUDA device (no NVIDIA driver is "
                            "installed") != NULL, "%s", out);
#else
  FILE *pp = popen(cmd, "r");
  size_t n = fread(out, 1, sizeof out - 1, pp);
  int st = pclose(pp);
  out[n] = 0;
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d: %s", st, out);
  ck_assert_msg(strstr(out, "not available in this build") != NULL, "%s", out);
#endif
}
END_TEST

/* libuv reports a missing socket directory as "permission denied" */
START_TEST(missing_socket_directory_is_named)
{
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s --config /dev/null --socket %s/missing/mokd.sock 2>&1",
           mokd_bin(), dir);
  FILE *pp = popen(cmd, "r");
  char out[2048] = "";
  size_t n = fread(out, 1, sizeof out - 1, pp);
  int st = pclose(pp);
  out[n] = 0;
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "mokd started: %s", out);
  char want[192];
  snprintf(want, sizeof want, "socket directory %s/missing does not exist", dir);
  ck_assert_msg(strstr(out, want) != NULL, "output: %s", out);
  ck_assert_msg(strstr(out, "ermission denied") == NULL, "output: %s", out);
}
END_TEST

START_TEST(other_uid_is_refused)
{
  /* only root can become another uid; CI runs as root. The file modes let
   * the peer reach the socket: it is the daemon that must refuse it */
  ck_assert_int_eq(chmod(dir, 0755), 0);
  ck_assert_int_eq(chmod(sock, 0666), 0);
  pid_t child = fork();
  if (child == 0) {
    if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0)
      _exit(3);
    mok_client *c;
    int rc = mok_connect(sock, "intruder", &c);
    /* the reason, not a closed socket */
    int ok = rc == MOK_EPERM && strstr(mok_last_error(c), "may not use mokd") != NULL;
    mok_close(c);
    _exit(ok ? 0 : 4);
  }
  int st;
  waitpid(child, &st, 0);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
}
END_TEST

/* The supplementary groups that count are the ones the peer connected with
 * (SO_PEERGROUPS), not what /proc shows when the daemon looks: here the
 * daemon is stopped while the peer, uid 65534 in group 4242, connects and
 * then leaves the group; the daemon must still let it in. */
START_TEST(supplementary_group_at_connect_counts)
{
  char path[128], log2[128];
  snprintf(path, sizeof path, "%s/groups.sock", dir);
  snprintf(log2, sizeof log2, "%s/groups.log", dir);
  ck_assert_int_eq(chmod(dir, 0755), 0);
  pid_t d = spawn_daemon(path, "--allow-gids=4242", log2);
  wait_for_socket(path, d);
  ck_assert_int_eq(chown(path, 0, 4242), 0);
  int go[2], ready[2];
  ck_assert_int_eq(pipe(go), 0);
  ck_assert_int_eq(pipe(ready), 0);
  usleep(100000); /* the probe of wait_for_socket is gone */
  ck_assert_int_eq(kill(d, SIGSTOP), 0);
  pid_t child = fork();
  if (child == 0) {
    gid_t g = 4242;
    char c;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (setgroups(1, &g) != 0 || setegid(65534) != 0 || seteuid(65534) != 0)
      _exit(3);
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
      _exit(4);
    /* out of the group, as /proc will show it, before the daemon looks */
    if (seteuid(0) != 0 || setgroups(0, NULL) != 0 || seteuid(65534) != 0)
      _exit(5);
    if (write(ready[1], "r", 1) != 1 || read(go[0], &c, 1) != 1)
      _exit(6);
    Mokd__Request req = MOKD__REQUEST__INIT;
    Mokd__Hello h = MOKD__HELLO__INIT;
    uint8_t *buf;
    size_t len;
    h.protocol_version = MOK_PROTOCOL_VERSION;
    req.id = 1, req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
    if (mokw_pack(&req.base, &buf, &len) != 0 || send(fd, buf, len, MSG_NOSIGNAL) != (ssize_t)len)
      _exit(7);
    Mokd__Response *r = raw_reply(fd);
    _exit(r != NULL && r->status == 0 && r->body_case == MOKD__RESPONSE__BODY_WELCOME ? 0 : 8);
  }
  char c;
  ck_assert_int_eq(read(ready[0], &c, 1), 1);
  ck_assert_int_eq(kill(d, SIGCONT), 0);
  ck_assert_int_eq(write(go[1], "g", 1), 1);
  int st;
  ck_assert_int_eq(waitpid(child, &st, 0), child);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "peer in group 4242 at connect: status "
                "%d (8: not welcomed)", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  st = stop_daemon(d);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  unlink(log2);
}
END_TEST

/* Reads datagrams from the notify socket until one contains `what`. */
static void expect_notify(int fd, const char *what)
{
  char buf[512];
  for (;;) {
    struct pollfd pf = {fd, POLLIN, 0};
    ck_assert_msg(poll(&pf, 1, 5000) == 1, "no \"%s\" from mokd within 5 s", what);
    ssize_t n = recv(fd, buf, sizeof buf - 1, 0);
    ck_assert_int_gt(n, 0);
    buf[n] = 0;
    if (strstr(buf, what) != NULL)
      return;
  }
}

START_TEST(systemd_notify_and_watchdog)
{
  char npath[128], conf[128];
  snprintf(npath, sizeof npath, "%s/notify", dir);
  snprintf(conf, sizeof conf, "%s/hup.conf", dir);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  strcpy(sa.sun_path, npath);
  int nfd = socket(AF_UNIX, SOCK_DGRAM, 0);
  ck_assert_int_eq(bind(nfd, (struct sockaddr *)&sa, sizeof sa), 0);
  FILE *f = fopen(conf, "w");
  fputs("[mokd]\nlog_level = info\n", f);
  fclose(f);

  pid_t pid = fork();
  if (pid == 0) {
    int lfd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(lfd, 2);
    setenv("NOTIFY_SOCKET", npath, 1);
    setenv("WATCHDOG_USEC", "200000", 1);
    unsetenv("WATCHDOG_PID");
    execl(mokd_bin(), "mokd", "--socket", sock, "--config", conf, (char *)NULL);
    _exit(127);
  }
  expect_notify(nfd, "READY=1");
  ck_assert_int_eq(access(sock, F_OK), 0); /* READY comes after the socket is bound */
  expect_notify(nfd, "WATCHDOG=1");
  expect_notify(nfd, "WATCHDOG=1");

  /* SIGHUP re-reads the log level from the file */
  f = fopen(conf, "w");
  fputs("[mokd]\nlog_level = debug\n", f);
  fclose(f);
  kill(pid, SIGHUP);
  int seen = 0;
  for (int i = 0; i < 200 && !seen; i++) {
    char buf[8192] = "";
    FILE *lf = fopen(logpath, "r");
    size_t n = fread(buf, 1, sizeof buf - 1, lf);
    fclose(lf);
    buf[n] = 0;
    seen = strstr(buf, "SIGHUP: log level now debug") != NULL;
    usleep(10000);
  }
  ck_assert_msg(seen, "no SIGHUP reload in the log");

  kill(pid, SIGTERM);
  expect_notify(nfd, "STOPPING=1");
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  close(nfd);
  unlink(npath), unlink(conf), unlink(logpath);
}
END_TEST

/* ---- mokctl, the binary next to mokd ------------------------------------- */

/* runs `mokctl ARGS` (ARGS may name the socket as %s), with stdout and stderr
 * in out; returns the exit status */
static int run_mokctl(const char *args, char *out, size_t n)
{
  char bin[256], cmd[1024], a[512];
  const char *slash = strrchr(mokd_bin(), '/');
  snprintf(bin, sizeof bin, "%.*smokctl", slash ? (int)(slash - mokd_bin() + 1) : 0,
           mokd_bin());
  snprintf(a, sizeof a, args, sock);
  snprintf(cmd, sizeof cmd, "%s %s 2>&1", bin, a);
  FILE *pp = popen(cmd, "r");
  ck_assert_ptr_nonnull(pp);
  size_t got = fread(out, 1, n - 1, pp);
  out[got] = 0;
  int st = pclose(pp);
  ck_assert_msg(WIFEXITED(st), "mokctl %s: status %d", a, st);
  return WEXITSTATUS(st);
}

START_TEST(mokctl_flag_errors)
{
  /* each used to be mis-run: a message about x, once, SIGFPE, a hang */
  static const struct {
    const char *args, *first_line;
  } cases[] = {
    {"--socket %s bench --T abc", "mokctl: --T: \"abc\" is not a whole number\n"},
    {"--socket %s bench --iters 0", "mokctl: --iters: 0 is out of range; it must be in "
                                   "[1, 1000000]\n"},
    {"--socket %s bench --E 0", "mokctl: --E: 0 is out of range; it must be in "
                               "[1, 16777216]\n"},
    {"--socket %s bench --K 20 --E 4", "mokctl: bench: --K 20 is larger than --E 4; each "
                                      "token picks K distinct experts\n"},
    {"--socket %s bench --H 16777216 --I 16777216 --E 16777216",
     "mokctl: bench: layer T=1024 H=16777216 I=16777216 E=16777216 K=2 I_s=0: its tensors "
     "need more than 2^64 bytes\n"},
    {"--socket %s", "mokctl: no command given; one of ping, status, stats, bench, health, "
                    "sessions, evict\n"},
    {"--socket %s pong", "mokctl: unknown command \"pong\"; one of ping, status, stats, "
                        "bench, health, sessions, evict\n"},
  };
  char out[4096];
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int rc = run_mokctl(cases[i].args, out, sizeof out);
    ck_assert_msg(rc == 2, "mokctl %s: exit %d, output: %s", cases[i].args, rc, out);
    ck_assert_msg(strncmp(out, cases[i].first_line, strlen(cases[i].first_line)) == 0,
                  "mokctl %s said: %s", cases[i].args, out);
  }
  /* nothing reached the daemon: no session ever made a layer */
  mok_client *c = connect_ok();
  mok_stats st;
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.daemon.layers, 0);
  ck_assert_uint_eq(st.daemon.forwards, 0);
  mok_close(c);
  ck_assert_int_eq(run_mokctl("--help", out, sizeof out), 0);
  ck_assert_msg(strstr(out, "usage: mokctl") && strstr(out, "--iters n"), "help: %s", out);
}
END_TEST

START_TEST(mokctl_bench_runs_and_says_what_failed)
{
  char out[4096];
  int rc = run_mokctl("--socket %s bench --T 4 --H 64 --I 32 --E 4 --K 4 --iters 3", out,
                      sizeof out);
  ck_assert_msg(rc == 0, "exit %d: %s", rc, out);
  ck_assert_msg(strstr(out, "layer T=4 H=64 I=32 E=4 K=4 I_s=0 on cpu, 3 iterations"), "%s",
                out);
  /* an EP group of two client processes, two experts each */
  rc = run_mokctl("--socket %s bench --T 4 --H 64 --I 32 --E 4 --K 2 --shared 32 --iters 3 "
                  "--ep 2", out, sizeof out);
  ck_assert_msg(rc == 0, "exit %d: %s", rc, out);
  ck_assert_msg(strstr(out, "layer T=4 a rank H=64 I=32 E=4 K=2 I_s=32, EP group of 2 ranks "
                       "(2 experts each), 3 iterations\ngroup step round trips") != NULL, "%s",
                out);
  ck_assert_msg(strstr(out, "\nforward  ms p50 ") && strstr(out, "\nbackward ms p50 "), "%s",
                out);
  /* 18 PB: the daemon refuses the arena; the message says at which step */
  rc = run_mokctl("--socket %s bench --H 1000000 --I 1000000 --E 1000", out, sizeof out);
  ck_assert_msg(rc == 1, "exit %d: %s", rc, out);
  ck_assert_msg(strstr(out, "mokctl: bench: creating its arena: arena of 18000004096016384 "
                       "bytes is larger than max_arena_bytes") == out, "%s", out);
}
END_TEST

Suite *daemon_service_suite(void)
{
  Suite *s = suite_create("daemon_service");
  TCase *tc = tcase_create("lifecycle");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, sigterm_finishes_in_flight_work);
  tcase_add_test(tc, second_daemon_and_stale_socket);
  tcase_add_test(tc, config_error_stops_startup);
  tcase_add_test(tc, missing_socket_directory_is_named);
  tcase_add_test(tc, no_driver_is_named);
  suite_add_tcase(s, tc);
  tc = tcase_create("mokctl");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, mokctl_flag_errors);
  tcase_add_test(tc, mokctl_bench_runs_and_says_what_failed);
  suite_add_tcase(s, tc);
  tc = tcase_create("systemd");
  tcase_add_checked_fixture(tc, plain_setup, plain_teardown);
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, systemd_notify_and_watchdog);
  suite_add_tcase(s, tc);
  if (geteuid() == 0) {
    tc = tcase_create("access");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, other_uid_is_refused);
    tcase_add_test(tc, supplementary_group_at_connect_counts);
    suite_add_tcase(s, tc);
  } else {
    fprintf(stderr, "check_daemon: not root: the allow-list test (another uid) is not run\n");
  }
  return s;
}
