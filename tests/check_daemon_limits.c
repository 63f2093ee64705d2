/* check_daemon_limits.c - what one client can do to the daemon and everyone
 * else: never read its replies, hold connections, make imports by the
 * thousand, release by the ten thousand. Each is bounded, and the daemon
 * keeps serving the others. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon_fixture.h"
#include "fdpass.h"
#include "frame.h"

static long proc_rss_kb(pid_t pid)
{
  char path[64], line[256];
  long kb = -1;
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  while (fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
      break;
  fclose(f);
  return kb;
}

static int proc_fd_count(pid_t pid)
{
  char cmd[96], out[32] = "";
  snprintf(cmd, sizeof cmd, "ls /proc/%d/fd | wc -l", (int)pid);
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  ck_assert_ptr_nonnull(fgets(out, sizeof out, p));
  pclose(p);
  return atoi(out);
}

/* Packs n copies of req (ids first_id, first_id + 1, ...) back to back. */
static uint8_t *pack_many(Mokd__Request *req, uint64_t first_id, int n, size_t *len)
{
  uint8_t *all = NULL;
  size_t cap = 0;
  *len = 0;
  for (int i = 0; i < n; i++) {
    uint8_t *one;
    size_t l;
    req->id = first_id + (uint64_t)i;
    ck_assert_int_eq(mokw_pack(&req->base, &one, &l), 0);
    if (*len + l > cap) {
      cap = 2 * (*len + l);
      ck_assert_ptr_nonnull(all = realloc(all, cap));
    }
    memcpy(all + *len, one, l);
    *len += l;
    free(one);
  }
  return all;
}

/* Sends buf without blocking for longer than stall_ms at a time; returns the
 * bytes the daemon took. */
static size_t send_until_stalled(int fd, const uint8_t *buf, size_t len, int stall_ms)
{
  size_t off = 0;
  while (off < len) {
    ssize_t n = send(fd, buf + off, len - off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      off += (size_t)n;
      continue;
    }
    ck_assert_msg(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), "send: %s",
                  strerror(errno));
    struct pollfd pf = {fd, POLLOUT, 0};
    if (poll(&pf, 1, stall_ms) == 0)
      break;
  }
  return off;
}

/* Reads replies until n have come; each must be a reply to the next id. */
static void read_replies_in_order(int fd, uint64_t first_id, uint64_t n)
{
  mokw_framer f;
  mokw_framer_init(&f, 1 << 20);
  for (uint64_t got = 0; got < n;) {
    const uint8_t *p;
    size_t len, avail;
    int rc = mokw_framer_next(&f, &p, &len, NULL);
    if (rc == 1) {
      Mokd__Response *r = mokd__response__unpack(NULL, len, p);
      ck_assert_ptr_nonnull(r);
      ck_assert_msg(r->status == 0, "reply %llu: %s", (unsigned long long)got, r->message);
      ck_assert_uint_eq(r->id, first_id + got);
      mokd__response__free_unpacked(r, NULL);
      got++;
      continue;
    }
    struct pollfd pf = {fd, POLLIN, 0};
    ck_assert_msg(poll(&pf, 1, 10000) == 1, "reply %llu of %llu did not come",
                  (unsigned long long)got, (unsigned long long)n);
    int fds[MOKW_MAX_FDS], nfds = MOKW_MAX_FDS;
    uint8_t *dst = mokw_framer_space(&f, 65536, &avail);
    ssize_t k = mokw_recv(fd, dst, avail, 0, fds, &nfds, NULL);
    ck_assert_int_gt(k, 0);
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    mokw_framer_commit(&f, (size_t)k);
  }
  mokw_framer_free(&f);
}

START_TEST(never_reading_client_is_paused)
{
  int fd = raw_connect();
  hello(fd);
  still_serving();
  long rss0 = proc_rss_kb(daemon_pid);

  /* 400k pings (4.3 MB), never reading a reply: the daemon stops reading
   * once its queue of replies is full, and the sends stall. How much the
   * sockets' buffers hold besides varies with how the replies were batched
   * into writes: 0.4 to 1.1 MB was taken before the stall in runs of the
   * stress test, so 100k pings (1.08 MB) were sometimes all taken. */
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Ping ping = MOKD__PING__INIT;
  req.body_case = MOKD__REQUEST__BODY_PING, req.ping = &ping;
  size_t len;
  uint8_t *batch = pack_many(&req, 1000, 400000, &len);
  size_t sent = send_until_stalled(fd, batch, len, 300);
  ck_assert_msg(sent < len, "the daemon took all %zu bytes of pings unread", len);
  long grown = proc_rss_kb(daemon_pid) - rss0;
  ck_assert_msg(grown < 16 * 1024, "daemon RSS grew by %ld kB", grown);
  still_serving(); /* the others are served meanwhile */

  /* the client reads at last: every request the daemon took is answered,
   * in order, and the rest goes through */
  pid_t reader = fork();
  if (reader == 0) {
    read_replies_in_order(fd, 1000, 400000);
    _exit(0);
  }
  ck_assert_uint_eq(send_until_stalled(fd, batch + sent, len - sent, 10000), len - sent);
  int st;
  ck_assert_int_eq(waitpid(reader, &st, 0), reader);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "reader status %d", st);
  free(batch);
  close(fd);
  still_serving();
}
END_TEST

START_TEST(unread_fds_are_bounded)
{
  int fd = raw_connect();
  hello(fd);
  still_serving();
  int fds0 = proc_fd_count(daemon_pid);

  /* every ArenaCreated carries an fd: unread, they must not pile up here */
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__CreateArena ca = MOKD__CREATE_ARENA__INIT;
  ca.bytes = 4096;
  req.body_case = MOKD__REQUEST__BODY_CREATE_ARENA, req.create_arena = &ca;
  size_t len;
  uint8_t *batch = pack_many(&req, 100, 800, &len);
  size_t sent = send_until_stalled(fd, batch, len, 300);
  usleep(200000);
  int grown = proc_fd_count(daemon_pid) - fds0;
  ck_assert_msg(grown < 64, "the daemon holds %d more fds (%zu of %zu bytes sent)", grown,
                sent, len);
  still_serving();
  pid_t reader = fork();
  if (reader == 0) {
    read_replies_in_order(fd, 100, 800);
    _exit(0);
  }
  ck_assert_uint_eq(send_until_stalled(fd, batch + sent, len - sent, 10000), len - sent);
  int st;
  ck_assert_int_eq(waitpid(reader, &st, 0), reader);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "reader status %d", st);
  free(batch);
  close(fd);
  still_serving();
}
END_TEST

/* A daemon out of fds says so in its log, once a second at most, and serves
 * again once fds are free. */
START_TEST(failed_accept_is_logged)
{
  char path[128], log2[128];
  snprintf(path, sizeof path, "%s/fewfds.sock", dir);
  snprintf(log2, sizeof log2, "%s/fewfds.log", dir);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    struct rlimit rl = {48, 48};
    int lfd = open(log2, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(lfd, 2);
    close(lfd);
    setrlimit(RLIMIT_NOFILE, &rl);
    execl(mokd_bin(), "mokd", "--socket", path, "--config", "/dev/null", "--cpu-threads",
          "1", "--executor-threads", "1", (char *)NULL);
    _exit(127);
  }
  wait_for_socket(path, pid);
  int held[64], n = 0;
  char *save = strdup(sock);
  strcpy(sock, path);
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  uint8_t *hello_frame;
  size_t hello_len;
  h.protocol_version = MOK_PROTOCOL_VERSION;
  req.id = 1, req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
  ck_assert_int_eq(mokw_pack(&req.base, &hello_frame, &hello_len), 0);
  for (; n < 64; n++) {
    Mokd__Response *r = NULL;
    held[n] = raw_connect();
    if (send(held[n], hello_frame, hello_len, MSG_NOSIGNAL) == (ssize_t)hello_len)
      r = raw_reply(held[n]);
    if (r == NULL) { /* not taken: the daemon is out of fds */
      close(held[n]);
      break;
    }
    mokd__response__free_unpacked(r, NULL);
  }
  free(hello_frame);
  ck_assert_msg(n < 64, "64 sessions on 48 fds");
  char buf[16384] = "";
  FILE *f = fopen(log2, "r");
  size_t got = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[got] = 0;
  ck_assert_msg(strstr(buf, "cannot accept a connection") != NULL &&
                strstr(buf, "Too many open files") != NULL, "log ends: %s",
                got > 600 ? buf + got - 600 : buf);
  for (int i = 0; i < n; i++)
    close(held[i]);
  usleep(100000);
  still_serving();
  strcpy(sock, save);
  free(save);
  int st = stop_daemon(pid);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  unlink(log2);
}
END_TEST

static double now_s(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- connections that never say Hello ------------------------------------ */

START_TEST(silent_connections_are_closed)
{
  own_daemon d;
  own_daemon_start(&d, "hello", "--max-sessions=3 --hello-timeout-ms=300");

  usleep(100000); /* wait_for_socket's probe session is gone */
  /* three silent connections take every slot */
  int idle[3];
  for (int i = 0; i < 3; i++)
    idle[i] = raw_connect();
  usleep(50000);
  mok_client *c;
  ck_assert_int_eq(mok_connect(d.path, "locked out", &c), MOK_EPERM);
  mok_close(c);
  /* then each is told why and closed, and the slots are free again */
  double t0 = now_s();
  for (int i = 0; i < 3; i++) {
    expect_status(idle[i], MOK_EPROTO, "no Hello within 300 ms (hello_timeout_ms)");
    ck_assert_ptr_null(raw_reply(idle[i]));
    close(idle[i]);
  }
  ck_assert_msg(now_s() - t0 < 1.0, "closed after %.2f s", now_s() - t0);
  c = connect_ok();
  usleep(500000); /* a session that said Hello is not timed out */
  uint64_t rtt;
  ck_assert_int_eq(mok_ping(c, &rtt), 0);
  mok_close(c);
  own_daemon_stop(&d);
}
END_TEST

/* ---- refusals ---------------------------------------------------------------- */

/* A refused client reads why, even when it sends its Hello only after the
 * daemon has refused it (it used to meet a closed socket: "Broken pipe"). */
START_TEST(refused_client_reads_the_reason)
{
  own_daemon d;
  own_daemon_start(&d, "full", "--max-sessions=1");
  usleep(100000); /* wait_for_socket's probe session is gone */
  mok_client *in = connect_ok(), *out;
  int fd = raw_connect();
  usleep(200000); /* the daemon has refused it by now */
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  h.protocol_version = MOK_PROTOCOL_VERSION;
  req.id = 1, req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EPERM, "too many sessions (max_sessions)");
  ck_assert_ptr_null(raw_reply(fd)); /* then it is closed */
  close(fd);
  ck_assert_int_eq(mok_connect(d.path, "second", &out), MOK_EPERM);
  ck_assert_msg(strstr(mok_last_error(out), "too many sessions") != NULL, "%s",
                mok_last_error(out));
  mok_close(out);
  /* a refused peer that never speaks is closed after a second */
  fd = raw_connect();
  expect_status(fd, MOK_EPERM, "too many sessions (max_sessions)");
  double t0 = now_s();
  ck_assert_ptr_null(raw_reply(fd));
  ck_assert_msg(now_s() - t0 < 3.0, "closed after %.1f s", now_s() - t0);
  close(fd);
  mok_close(in);
  own_daemon_stop(&d);
}
END_TEST

/* ---- imports ---------------------------------------------------------------- */

/* 65k imports of one memfd used to reach vm.max_map_count: then every
 * session's next arena failed. */
START_TEST(imports_are_limited_per_session)
{
  own_daemon d;
  own_daemon_start(&d, "imports", "--max-arenas=8 --session-quota-bytes=1M");
  mok_client *c, *other;
  mok_arena_info a[9];
  int fd = memfd_create("weights", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(fd, 64 << 10), 0);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  ck_assert_int_eq(mok_connect(d.path, "importer", &c), 0);
  for (int i = 0; i < 8; i++)
    ck_assert_msg(mok_arena_import(c, fd, 64 << 10, &a[i]) == 0, "import %d: %s", i,
                  mok_last_error(c));
  ck_assert_int_eq(mok_arena_import(c, fd, 64 << 10, &a[8]), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(c), "already holds 8 arenas (max_arenas)") != NULL, "%s",
                mok_last_error(c));
  /* and another session is not hurt */
  ck_assert_int_eq(mok_connect(d.path, "other", &other), 0);
  ck_assert_int_eq(mok_arena_create(other, 4096, &a[8]), 0);
  mok_close(other);
  /* an imported memfd counts against the host quota: 8 x 64 KiB of 1 MiB held */
  ck_assert_int_eq(mok_arena_destroy(c, a[0].id), 0);
  ck_assert_int_eq(mok_arena_import(c, fd, 1 << 20, &a[0]), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(c), "quota is 1048576 (session_quota_bytes)") != NULL,
                "%s", mok_last_error(c));
  mok_close(c);
  close(fd);
  own_daemon_stop(&d);
}
END_TEST

/* Each chunk of an import made of several allocations is a mapping of the
 * daemon's: they count against max_arenas, and one that does not fit drops
 * the whole import. Imported memfds count against the host quota. */
START_TEST(chunked_imports_count_each_chunk)
{
  enum { N = 12 };
  own_daemon d;
  own_daemon_start(&d, "chunks", "--max-arenas=10 --session-quota-bytes=1M");
  mok_client *c;
  mok_arena_info a;
  mok_stats st;
  int fds[N];
  size_t sizes[N];
  for (int i = 0; i < N; i++) {
    fds[i] = memfd_create("chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_eq(ftruncate(fds[i], 64 << 10), 0);
    ck_assert_int_eq(fcntl(fds[i], F_ADD_SEALS, F_SEAL_SHRINK), 0);
    sizes[i] = 64 << 10;
  }
  ck_assert_int_eq(mok_connect(d.path, "chunks", &c), 0);
  ck_assert_int_eq(mok_arena_import_chunks(c, fds, sizes, N, &a), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(c), "already holds 8 arenas (max_arenas), imported, "
                       "created and of outputs together, each chunk of an import made of "
                       "several allocations counted; 4 more do not fit") != NULL, "%s",
                mok_last_error(c));
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.arenas, 0);
  ck_assert_int_eq(mok_arena_import_chunks(c, fds, sizes, 10, &a), 0);
  ck_assert_int_eq(mok_arena_create(c, 4096, &a), MOK_EDQUOT);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.arenas, 10);
  mok_close(c);
  ck_assert_int_eq(mok_connect(d.path, "quota", &c), 0);
  sizes[0] = 1 << 20;
  ck_assert_int_eq(mok_arena_import_chunks(c, fds, sizes, 2, &a), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(c), "quota is 1048576 (session_quota_bytes)") != NULL,
                "%s", mok_last_error(c));
  mok_close(c);
  for (int i = 0; i < N; i++)
    close(fds[i]);
  own_daemon_stop(&d);
}
END_TEST

static mok_client *connect_as_job(const char *path, const char *job)
{
  mok_client *c;
  setenv("MOKD_JOB_ID", job, 1); /* read at connect */
  ck_assert_int_eq(mok_connect(path, job, &c), 0);
  unsetenv("MOKD_JOB_ID");
  return c;
}

/* Two sessions of one job, each under its session quota, together over the
 * job's tenant_quota_bytes: the second is refused, naming the tenant; a job
 * not named is unbounded by it; what one session gives back the other may
 * take. Host arenas here; GPU bytes count the same. */
START_TEST(tenant_quota_bounds_a_jobs_sessions_together)
{
  own_daemon d;
  own_daemon_start(&d, "tquota", "--session-quota-bytes=4M "
                   "--tenant-quota-bytes=job:tq-1=6M,uid:4242=1M");
  mok_client *a = connect_as_job(d.path, "tq-1"), *b = connect_as_job(d.path, "tq-1");
  mok_client *other = connect_as_job(d.path, "tq-2");
  mok_arena_info x, y, z, w;

  ck_assert_msg(mok_arena_create(a, 4 << 20, &x) == 0, "%s", mok_last_error(a));
  ck_assert_int_eq(mok_arena_create(b, 4 << 20, &y), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(b), "tenant job:tq-1 would hold 8388608 bytes") != NULL &&
                strstr(mok_last_error(b), "its quota is 6291456 (tenant_quota_bytes)") != NULL,
                "%s", mok_last_error(b));
  ck_assert_msg(mok_arena_create(b, 2 << 20, &y) == 0, "%s", mok_last_error(b));
  ck_assert_msg(mok_arena_create(other, 4 << 20, &w) == 0, "%s", mok_last_error(other));
  ck_assert_int_eq(mok_arena_create(b, 1 << 20, &z), MOK_EDQUOT); /* b alone: 3 MiB of 4 */
  ck_assert_msg(strstr(mok_last_error(b), "tenant job:tq-1 would hold 7340032 bytes") != NULL,
                "%s", mok_last_error(b));
  ck_assert_int_eq(mok_arena_destroy(a, x.id), 0);
  ck_assert_msg(mok_arena_create(b, 2 << 20, &z) == 0, "%s", mok_last_error(b));
  mok_close(b);
  mok_close(a);
  mok_close(other);
  own_daemon_stop(&d);
}
END_TEST

/* One session made 1000 arenas of 1 GiB in 0.1 s: by default a session may
 * hold half of the RAM. */
START_TEST(default_quota_is_half_of_ram)
{
  uint64_t half = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) / 2;
  mok_client *c = connect_ok();
  mok_arena_info a;
  ck_assert_uint_eq(mok_server_info(c)->session_quota_bytes, half);
  ck_assert_int_eq(mok_arena_create(c, (size_t)half + 4096, &a), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(c), "(session_quota_bytes)") != NULL, "%s",
                mok_last_error(c));
  ck_assert_int_eq(mok_arena_create(c, 1 << 20, &a), 0);
  mok_close(c);
}
END_TEST

/* ---- releasing many results at once --------------------------------------- */

/* A raw session with a small layer whose weights and inputs lie in one arena:
 * forward requests can then be sent back to back. */
typedef struct raw_layer {
  int fd;
  uint64_t arena, layer;
  int64_t sx[2], sk[2];
  Mokd__TensorRef x, ids, tw;
  Mokd__Forward f;
} raw_layer;

static Mokd__Response *raw_call(int fd, Mokd__Request *req)
{
  raw_request(fd, req, -1);
  Mokd__Response *r = raw_reply(fd);
  ck_assert_msg(r != NULL && r->status == 0, "request %llu: %s",
                (unsigned long long)req->id, r != NULL ? r->message : "connection closed");
  return r;
}

static void raw_layer_setup(raw_layer *rl)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__CreateArena ca = MOKD__CREATE_ARENA__INIT;
  Mokd__CreateLayer cl = MOKD__CREATE_LAYER__INIT;
  Mokd__SetWeights sw = MOKD__SET_WEIGHTS__INIT;
  Mokd__TensorRef w[3];
  int64_t ws[3] = {2, 8, 8};
  Mokd__Response *r;

  memset(rl, 0, sizeof *rl);
  rl->fd = raw_connect();
  hello(rl->fd);
  ca.bytes = 4096;
  req.id = 2, req.body_case = MOKD__REQUEST__BODY_CREATE_ARENA, req.create_arena = &ca;
  r = raw_call(rl->fd, &req);
  rl->arena = r->arena_created->arena;
  mokd__response__free_unpacked(r, NULL);
  cl.hidden = 8, cl.intermediate = 8, cl.experts = 2, cl.top_k = 1;
  req.id = 3, req.body_case = MOKD__REQUEST__BODY_CREATE_LAYER, req.create_layer = &cl;
  r = raw_call(rl->fd, &req);
  rl->layer = r->layer_created->layer;
  mokd__response__free_unpacked(r, NULL);
  for (int i = 0; i < 3; i++) {
    mokd__tensor_ref__init(&w[i]);
    w[i].arena = rl->arena, w[i].dtype = MOKD__DTYPE__DTYPE_BF16;
    w[i].n_shape = 3, w[i].shape = ws;
  }
  sw.layer = rl->layer, sw.w_gate = &w[0], sw.w_up = &w[1], sw.w_down = &w[2];
  req.id = 4, req.body_case = MOKD__REQUEST__BODY_SET_WEIGHTS, req.set_weights = &sw;
  mokd__response__free_unpacked(raw_call(rl->fd, &req), NULL);
  /* the arena is zeroes: every token goes to expert 0 */
  rl->sx[0] = 1, rl->sx[1] = 8, rl->sk[0] = 1, rl->sk[1] = 1;
  mokd__tensor_ref__init(&rl->x), mokd__tensor_ref__init(&rl->ids);
  mokd__tensor_ref__init(&rl->tw);
  rl->x.arena = rl->ids.arena = rl->tw.arena = rl->arena;
  rl->x.offset = 1024, rl->x.dtype = MOKD__DTYPE__DTYPE_BF16;
  rl->x.n_shape = 2, rl->x.shape = rl->sx;
  rl->ids.offset = 2048, rl->ids.dtype = MOKD__DTYPE__DTYPE_I32;
  rl->ids.n_shape = 2, rl->ids.shape = rl->sk;
  rl->tw.offset = 3072, rl->tw.dtype = MOKD__DTYPE__DTYPE_F32;
  rl->tw.n_shape = 2, rl->tw.shape = rl->sk;
  mokd__forward__init(&rl->f);
  rl->f.layer = rl->layer, rl->f.x = &rl->x, rl->f.topk_ids = &rl->ids;
  rl->f.topk_weights = &rl->tw;
}

/* n forwards, in batches sent back to back; their contexts' ids go to ids. */
static void raw_forwards(raw_layer *rl, int n, uint64_t *ids)
{
  enum { BATCH = 256 };
  Mokd__Request req = MOKD__REQUEST__INIT;
  req.body_case = MOKD__REQUEST__BODY_FORWARD, req.forward = &rl->f;
  mokw_framer fr;
  mokw_framer_init(&fr, 1 << 20);
  for (int done = 0; done < n;) {
    int b = n - done < BATCH ? n - done : BATCH;
    size_t len;
    uint8_t *batch = pack_many(&req, 1000 + (uint64_t)done, b, &len);
    raw_send(rl->fd, batch, len, -1);
    free(batch);
    for (int got = 0; got < b;) {
      const uint8_t *p;
      size_t plen, avail;
      if (mokw_framer_next(&fr, &p, &plen, NULL) == 1) {
        Mokd__Response *r = mokd__response__unpack(NULL, plen, p);
        ck_assert_msg(r != NULL && r->status == 0 &&
                          r->body_case == MOKD__RESPONSE__BODY_FORWARD_DONE,
                      "forward %d: %s", done + got, r != NULL ? r->message : "bad reply");
        ids[done + got++] = r->forward_done->context;
        mokd__response__free_unpacked(r, NULL);
        continue;
      }
      int fds[MOKW_MAX_FDS], nfds = MOKW_MAX_FDS;
      uint8_t *dst = mokw_framer_space(&fr, 65536, &avail);
      ssize_t k = mokw_recv(rl->fd, dst, avail, 0, fds, &nfds, NULL);
      ck_assert_int_gt(k, 0);
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      mokw_framer_commit(&fr, (size_t)k);
    }
    done += b;
  }
  mokw_framer_free(&fr);
}


/* Release of n ids took O(n^2) on the loop: 60k stalled every session for
 * 20 s. make stress releases 60k; here 20k, a second's worth of forwards. */
START_TEST(large_release_is_quick)
{
  enum { N = 20000 };
  raw_layer rl;
  uint64_t *ids = malloc(N * sizeof *ids), seed = 1;
  double t0;

  raw_layer_setup(&rl);
  raw_forwards(&rl, N, ids);
  for (int i = N - 1; i > 0; i--) { /* in no particular order */
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    int j = (int)((seed >> 33) % (uint64_t)(i + 1));
    uint64_t t = ids[i];
    ids[i] = ids[j], ids[j] = t;
  }
  /* a duplicate refuses the whole list: nothing is released */
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Release rel = MOKD__RELEASE__INIT;
  uint64_t last = ids[N - 1];
  ids[N - 1] = ids[0];
  rel.n_ids = N, rel.ids = ids;
  req.id = 7, req.body_case = MOKD__REQUEST__BODY_RELEASE, req.release = &rel;
  t0 = now_s();
  raw_request(rl.fd, &req, -1);
  expect_status(rl.fd, MOK_EINVAL, "is named twice; nothing was released");
  double dup_s = now_s() - t0;
  ids[N - 1] = last;
  t0 = now_s();
  Mokd__Response *r = raw_call(rl.fd, &req);
  double rel_s = now_s() - t0;
  ck_assert_uint_eq(r->released->count, N);
  mokd__response__free_unpacked(r, NULL);
  ck_assert_msg(dup_s < 0.5 && rel_s < 0.5, "release of %d ids: %.2f s (refusal %.2f s)", N,
                rel_s, dup_s);
  mok_client *c = connect_ok();
  mok_stats st;
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.daemon.contexts, 0);
  ck_assert_uint_eq(st.daemon.context_bytes, 0);
  mok_close(c);
  close(rl.fd);
  free(ids);
}
END_TEST

Suite *daemon_limits_suite(void)
{
  Suite *s = suite_create("daemon_limits");
  TCase *tc = tcase_create("limits");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, never_reading_client_is_paused);
  tcase_add_test(tc, unread_fds_are_bounded);
  tcase_add_test(tc, failed_accept_is_logged);
  tcase_add_test(tc, silent_connections_are_closed);
  tcase_add_test(tc, refused_client_reads_the_reason);
  tcase_add_test(tc, imports_are_limited_per_session);
  tcase_add_test(tc, chunked_imports_count_each_chunk);
  tcase_add_test(tc, default_quota_is_half_of_ram);
  tcase_add_test(tc, tenant_quota_bounds_a_jobs_sessions_together);
  tcase_add_test(tc, large_release_is_quick);
  suite_add_tcase(s, tc);
  return s;
}
