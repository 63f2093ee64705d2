/* stress.c - `make stress`: a mokd under clients that die, crowd it, never
 * read, or change their inputs under it. Each phase asserts and prints what
 * it saw; the program exits 1 at the first phase that fails, and 0 when the
 * daemon, stopped at the end, exits 0 too.
 *
 *   kill9    clients killed (SIGKILL) at random points of random work: the
 *            daemon stays up, its usage returns to zero, its RSS and fd count
 *            to near what they were
 *   load     clients x requests, every reply checked (pings by nonce,
 *            forwards bit for bit against the engine): none lost or wrong
 *   unread   a client that never reads its replies, with fds and without:
 *            the daemon's memory and fds stay bounded, others are served
 *   flip     a client thread flips an expert id while forwards run: each is
 *            refused or correct, the daemon unharmed
 *   release  one Release of many contexts: quick (0.5 s for 60k), and the
 *            loop not held longer
 *
 * --short runs a smaller version of each (the one make check runs). The
 * daemon is $MOKD_BIN (build/mokd) on a temporary socket; run it on the
 * ASan build with `make stress BUILD=build/asan SAN=1`. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "frame.h"
#include "mok.h"
#include "proto/mokd.pb-c.h"
#include "testbed.h"

typedef struct sizes {
  int kills, clients, requests, unread_pings, flips, release_ids;
} sizes;

/* Whether the daemon's RSS is checked: an ASan build (this program is built
 * like the daemon) keeps freed memory in its quarantine and allocator caches
 * (hundreds of MB), so there the RSS is only reported. */
#if defined(__SANITIZE_ADDRESS__)
#define CHECK_RSS 0
#define RELEASE_MAX_S 2.0 /* and everything runs slower */
#else
#define CHECK_RSS 1
#define RELEASE_MAX_S 0.5
#endif

static const sizes full = {100, 32, 1000, 400000, 3000, 60000};
static const sizes brief = {10, 8, 100, 100000, 300, 5000};

static char dir[64], sock[128], logpath[128];
static pid_t daemon_pid;

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void fail(const char *fmt, ...)
{
  va_list ap;
  fprintf(stderr, "stress: FAILED: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n       daemon log: %s\n", logpath);
  if (daemon_pid > 0)
    kill(daemon_pid, SIGKILL);
  exit(1);
}

static double now_s(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng(uint64_t *s)
{
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

/* ---- the daemon ------------------------------------------------------------ */

static long rss_kb(void)
{
  char path[64], line[256];
  long kb = -1;
  snprintf(path, sizeof path, "/proc/%d/status", (int)daemon_pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    fail("mokd (pid %d) is gone", (int)daemon_pid);
  while (fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
      break;
  fclose(f);
  return kb;
}

static int fd_count(void)
{
  char path[64];
  int n = 0;
  snprintf(path, sizeof path, "/proc/%d/fd", (int)daemon_pid);
  DIR *d = opendir(path);
  if (d == NULL)
    fail("mokd (pid %d) is gone", (int)daemon_pid);
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

static mok_client *connect_or_fail(const char *name)
{
  mok_client *c;
  if (mok_connect(sock, name, &c) != 0)
    fail("%s: connect: %s", name, mok_last_error(c));
  return c;
}

static void start_daemon(void)
{
  const char *bin = getenv("MOKD_BIN") != NULL ? getenv("MOKD_BIN") : "build/mokd";
  strcpy(dir, "/tmp/mokd-stress-XXXXXX");
  if (mkdtemp(dir) == NULL)
    fail("mkdtemp: %s", strerror(errno));
  snprintf(sock, sizeof sock, "%s/mokd.sock", dir);
  snprintf(logpath, sizeof logpath, "%s/mokd.log", dir);
  daemon_pid = fork();
  if (daemon_pid == 0) {
    int fd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(bin, "mokd", "--socket", sock, "--config", "/dev/null", "--cpu-threads", "2",
          "--executor-threads", "2", "--log-level", "warn", (char *)NULL);
    _exit(127);
  }
  for (int i = 0; i < 500; i++) {
    mok_client *c;
    int st;
    if (mok_connect(sock, "probe", &c) == 0) {
      mok_close(c);
      return;
    }
    mok_close(c);
    if (waitpid(daemon_pid, &st, WNOHANG) != 0)
      fail("%s exited at start (status %d)", bin, st);
    usleep(10000);
  }
  fail("%s did not come up on %s", bin, sock);
}

/* Waits until the daemon holds nothing but the session of c. */
static void wait_empty(mok_client *c, const char *phase)
{
  mok_stats st;
  for (int i = 0; i < 1000; i++) {
    if (mok_stats_get(c, &st) != 0)
      fail("%s: stats: %s", phase, mok_last_error(c));
    if (st.daemon.sessions == 1 && st.daemon.arenas == 0 && st.daemon.arena_bytes == 0 &&
        st.daemon.layers == 0 && st.daemon.contexts == 0 && st.daemon.results == 0 &&
        st.daemon.context_bytes == 0 && st.daemon.gpu_bytes == 0)
      return;
    usleep(10000);
  }
  fail("%s: the daemon still holds %llu sessions, %llu arenas (%llu bytes), %llu layers, "
       "%llu contexts (%llu bytes), %llu results", phase,
       (unsigned long long)st.daemon.sessions, (unsigned long long)st.daemon.arenas,
       (unsigned long long)st.daemon.arena_bytes, (unsigned long long)st.daemon.layers,
       (unsigned long long)st.daemon.contexts, (unsigned long long)st.daemon.context_bytes,
       (unsigned long long)st.daemon.results);
}

/* ---- the engine, for checking outputs -------------------------------------- */

static uint16_t *engine_out(mok_client *c, const mok_testbed *tb)
{
  mokk_backend *b;
  char err[MOK_ERRLEN];
  mokk_shape s = {.H = tb->d.hidden, .I = tb->d.intermediate, .E = tb->d.experts,
                  .K = tb->d.top_k, .I_s = tb->d.shared_intermediate, .P = 1};
  mokk_fwd_rank fr = {0};
  uint16_t *out = malloc((size_t)(tb->T * s.H) * 2);

  fr.x = mok_tensor_ptr(c, &tb->x), fr.topk_ids = mok_tensor_ptr(c, &tb->ids);
  fr.topk_weights = mok_tensor_ptr(c, &tb->tw), fr.out = out;
  for (int w = 0; w < tb->nweights; w++)
    fr.w[w] = mok_tensor_ptr(c, &tb->w[w]);
  if (mokk_cpu_create(1, &b, err) != 0 || mokk_forward(b, &s, tb->T, &fr, NULL, err) != 0)
    fail("engine: %s", err);
  mokk_backend_destroy(b);
  return out;
}

/* ---- kill9 ------------------------------------------------------------------ */

/* Random work until killed: layers, steps, releases, imports, arenas. */
static void victim(uint64_t seed)
{
  mok_client *c;
  mok_layer_desc d = {.hidden = 64 << rng(&seed) % 3, .intermediate = 64, .experts = 8,
                      .top_k = 2, .shared_intermediate = rng(&seed) % 2 ? 32 : 0};
  mok_testbed tb;

  if (mok_connect(sock, "victim", &c) != 0 ||
      mok_testbed_setup(c, &d, 16 << rng(&seed) % 6, seed, &tb) != 0)
    _exit(1);
  for (;;) {
    mok_forward_result f;
    mok_backward_result b;
    mok_arena_info a;
    switch (rng(&seed) % 4) {
    case 0:
    case 1:
      if (mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f) == 0 &&
          mok_backward(c, f.context, &tb.d_out, NULL, 0, &b) == 0 && rng(&seed) % 2) {
        uint64_t ids[2] = {f.context, b.result};
        mok_release(c, ids, 2);
      }
      break;
    case 2: {
      int fd = memfd_create("victim", MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (ftruncate(fd, 1 << 16) == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0)
        mok_arena_import(c, fd, 1 << 16, &a);
      close(fd);
      break;
    }
    default:
      if (mok_arena_create(c, 1 << 20, &a) == 0 && rng(&seed) % 2)
        mok_arena_destroy(c, a.id);
    }
  }
}

static void phase_kill9(const sizes *z)
{
  mok_client *watch = connect_or_fail("watch");
  uint64_t seed = 42;
  long rss0, rss1;
  int fds0, fds1;
  double t0 = now_s();

  /* one client's worth of work first: what the daemon keeps once warm */
  pid_t warm = fork();
  if (warm == 0) {
    alarm(5);
    victim(7);
  }
  usleep(300000);
  kill(warm, SIGKILL);
  waitpid(warm, NULL, 0);
  wait_empty(watch, "kill9 (warm-up)");
  rss0 = rss_kb(), fds0 = fd_count();
  for (int i = 0; i < z->kills; i++) {
    pid_t p = fork();
    if (p == 0)
      victim(seed + (uint64_t)i);
    usleep((useconds_t)(rng(&seed) % 60000)); /* anywhere: connecting, setting up, mid-step */
    kill(p, SIGKILL);
    waitpid(p, NULL, 0);
  }
  wait_empty(watch, "kill9");
  if (mok_ping(watch, NULL) != 0)
    fail("kill9: ping after the kills: %s", mok_last_error(watch));
  rss1 = rss_kb(), fds1 = fd_count();
  printf("stress: kill9: %d clients killed at random points in %.1f s; daemon alive, usage "
         "back to 0; RSS %.1f -> %.1f MB, fds %d -> %d\n", z->kills, now_s() - t0,
         (double)rss0 / 1024, (double)rss1 / 1024, fds0, fds1);
  if (fds1 > fds0)
    fail("kill9: the daemon holds %d fds more than before", fds1 - fds0);
  if (CHECK_RSS && rss1 > rss0 + 32 * 1024)
    fail("kill9: the daemon's RSS grew by %.1f MB", (double)(rss1 - rss0) / 1024);
  mok_close(watch);
}

/* ---- load ------------------------------------------------------------------- */

typedef struct loader {
  const sizes *z;
  int index;
  int ok, lost, wrong;
  char why[MOK_ERRLEN];
} loader;

static void *load_client(void *p)
{
  loader *a = p;
  mok_client *c;
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 8, .top_k = 2,
                      .shared_intermediate = a->index % 2 ? 16 : 0};
  mok_testbed tb;
  uint16_t *want;

  if (mok_connect(sock, "load", &c) != 0 ||
      mok_testbed_setup(c, &d, 24 + a->index, (uint64_t)a->index, &tb) != 0) {
    snprintf(a->why, sizeof a->why, "setup: %s", mok_last_error(c));
    a->lost = a->z->requests;
    return NULL;
  }
  want = engine_out(c, &tb);
  for (int i = 0; i < a->z->requests; i++) {
    mok_forward_result f;
    if (i % 4 == 3) { /* the pong must carry its nonce: mok_ping checks */
      if (mok_ping(c, NULL) != 0)
        a->lost++, snprintf(a->why, sizeof a->why, "ping: %s", mok_last_error(c));
      else
        a->ok++;
      continue;
    }
    if (mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f) != 0) {
      a->lost++, snprintf(a->why, sizeof a->why, "forward: %s", mok_last_error(c));
      continue;
    }
    if (memcmp(f.out_ptr, want, (size_t)(tb.T * 64) * 2) != 0)
      a->wrong++;
    else
      a->ok++;
    if (mok_release(c, &f.context, 1) != 0)
      a->lost++, snprintf(a->why, sizeof a->why, "release: %s", mok_last_error(c));
  }
  free(want);
  mok_close(c);
  return NULL;
}

static void phase_load(const sizes *z)
{
  pthread_t th[64];
  loader a[64];
  int ok = 0, lost = 0, wrong = 0;
  double t0 = now_s(), dt;

  for (int i = 0; i < z->clients; i++) {
    a[i] = (loader){.z = z, .index = i};
    pthread_create(&th[i], NULL, load_client, &a[i]);
  }
  for (int i = 0; i < z->clients; i++) {
    pthread_join(th[i], NULL);
    ok += a[i].ok, lost += a[i].lost, wrong += a[i].wrong;
    if (a[i].lost > 0)
      fprintf(stderr, "stress: load: client %d: %s\n", i, a[i].why);
  }
  dt = now_s() - t0;
  printf("stress: load: %d clients x %d verified requests in %.1f s (%.0f/s): %d right, %d "
         "lost, %d mismatched\n", z->clients, z->requests, dt, (ok + lost + wrong) / dt, ok,
         lost, wrong);
  if (lost > 0 || wrong > 0 || ok != z->clients * z->requests)
    fail("load: %d lost, %d mismatched", lost, wrong);
}

/* ---- unread ------------------------------------------------------------------ */

static int raw_connect(void)
{
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  strcpy(sa.sun_path, sock);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
    fail("connect: %s", strerror(errno));
  return fd;
}

static uint8_t *pack_many(Mokd__Request *q, int n, size_t *len)
{
  uint8_t *all = NULL;
  size_t cap = 0;
  *len = 0;
  for (int i = 0; i < n; i++) {
    uint8_t *one;
    size_t l;
    q->id = (uint64_t)i + 1;
    if (mokw_pack(&q->base, &one, &l) != 0)
      fail("pack");
    if (*len + l > cap && (all = realloc(all, cap = 2 * (*len + l))) == NULL)
      fail("out of memory");
    memcpy(all + *len, one, l);
    *len += l;
    free(one);
  }
  return all;
}

/* Sends until the daemon takes no more for 300 ms; the bytes it took. */
static size_t send_until_stalled(int fd, const uint8_t *buf, size_t len)
{
  size_t off = 0;
  while (off < len) {
    ssize_t n = send(fd, buf + off, len - off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      off += (size_t)n;
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      fail("unread: send: %s", strerror(errno));
    struct pollfd pf = {fd, POLLOUT, 0};
    if (poll(&pf, 1, 300) == 0)
      break;
  }
  return off;
}

/* p99 of n forward round trips of another client, in ms */
static double others_p99(int n)
{
  mok_client *c = connect_or_fail("bystander");
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 8, .top_k = 2};
  mok_testbed tb;
  double *t = malloc((size_t)n * sizeof *t), p99;

  if (mok_testbed_setup(c, &d, 32, 3, &tb) != 0)
    fail("unread: bystander setup: %s", tb.err);
  for (int i = 0; i < n; i++) {
    mok_forward_result f;
    double t0 = now_s();
    if (mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f) != 0 ||
        mok_release(c, &f.context, 1) != 0)
      fail("unread: the bystander was not served: %s", mok_last_error(c));
    t[i] = (now_s() - t0) * 1e3;
  }
  for (int i = 1; i < n; i++) /* insertion sort: n is small */
    for (int j = i; j > 0 && t[j - 1] > t[j]; j--) {
      double x = t[j];
      t[j] = t[j - 1], t[j - 1] = x;
    }
  p99 = t[n * 99 / 100];
  free(t);
  mok_close(c);
  return p99;
}

static void phase_unread(const sizes *z)
{
  mok_client *watch = connect_or_fail("watch");
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  Mokd__Ping ping = MOKD__PING__INIT;
  Mokd__CreateArena ca = MOKD__CREATE_ARENA__INIT;
  size_t len, sent;
  uint8_t *buf;
  long rss0 = rss_kb(), rss1;
  int fds0 = fd_count(), fds1, fds2;
  double p99;

  /* pings: memory */
  int fd = raw_connect();
  h.protocol_version = MOK_PROTOCOL_VERSION;
  q.body_case = MOKD__REQUEST__BODY_HELLO, q.hello = &h;
  buf = pack_many(&q, 1, &len);
  send_until_stalled(fd, buf, len);
  free(buf);
  q.body_case = MOKD__REQUEST__BODY_PING, q.ping = &ping;
  buf = pack_many(&q, z->unread_pings, &len);
  sent = send_until_stalled(fd, buf, len);
  free(buf);
  rss1 = rss_kb();
  p99 = others_p99(200);
  /* arenas: fds */
  int fd2 = raw_connect();
  q.body_case = MOKD__REQUEST__BODY_HELLO, q.hello = &h;
  buf = pack_many(&q, 1, &len);
  send_until_stalled(fd2, buf, len);
  free(buf);
  ca.bytes = 4096;
  q.body_case = MOKD__REQUEST__BODY_CREATE_ARENA, q.create_arena = &ca;
  buf = pack_many(&q, 800, &len);
  size_t sent2 = send_until_stalled(fd2, buf, len);
  free(buf);
  usleep(100000);
  fds1 = fd_count();
  close(fd);
  close(fd2);
  wait_empty(watch, "unread");
  fds2 = fd_count();
  printf("stress: unread: a client that never reads got %zu bytes of pings taken, then was "
         "paused: daemon RSS %.1f -> %.1f MB; another client's p99 forward meanwhile %.2f ms; "
         "800 unread CreateArena: daemon fds %d -> %d (%zu bytes taken); after both hung up: "
         "fds %d, usage 0\n", sent, (double)rss0 / 1024, (double)rss1 / 1024, p99, fds0,
         fds1, sent2, fds2);
  if (CHECK_RSS && rss1 > rss0 + 16 * 1024)
    fail("unread: the daemon's RSS grew by %.1f MB", (double)(rss1 - rss0) / 1024);
  if (fds1 > fds0 + 64)
    fail("unread: the daemon holds %d more fds", fds1 - fds0);
  if (fds2 > fds0)
    fail("unread: %d fds left after the clients hung up", fds2 - fds0);
  mok_close(watch);
}

/* ---- flip -------------------------------------------------------------------- */

typedef struct flipper {
  volatile int32_t *id;
  atomic_int stop;
} flipper;

static void *flip(void *p)
{
  flipper *f = p;
  /* mostly the valid id, so that both outcomes come often */
  for (uint32_t n = 0; !atomic_load(&f->stop); n++)
    *f->id = n % 4 == 1 ? 0x40000000 : n % 4 == 3 ? -0x40000000 : 1;
  return NULL;
}

static void phase_flip(const sizes *z)
{
  mok_client *c = connect_or_fail("flip");
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 8, .top_k = 2};
  mok_testbed tb;
  flipper f;
  pthread_t th;
  uint16_t *want;
  int ok = 0, refused = 0;
  double t0 = now_s();

  if (mok_testbed_setup(c, &d, 512, 4, &tb) != 0)
    fail("flip: setup: %s", tb.err);
  f.id = (int32_t *)mok_tensor_ptr(c, &tb.ids) + 5;
  *f.id = 1;
  atomic_init(&f.stop, 0);
  want = engine_out(c, &tb);
  pthread_create(&th, NULL, flip, &f);
  for (int i = 0; i < z->flips; i++) {
    mok_forward_result r;
    int rc = mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, i % 2, &r);
    if (rc == 0) {
      if (memcmp(r.out_ptr, want, (size_t)(512 * 64) * 2) != 0)
        fail("flip: forward %d computed with an id it did not check", i);
      mok_release(c, &r.context, 1);
      ok++;
    } else if (rc == MOK_EEXPERT) {
      refused++;
    } else {
      fail("flip: forward %d: %s", i, mok_last_error(c));
    }
  }
  atomic_store(&f.stop, 1);
  pthread_join(th, NULL);
  free(want);
  mok_close(c);
  printf("stress: flip: %d forwards while a thread flipped an id in [0, E) and out of it, "
         "%.1f s: %d right, %d refused (EEXPERT), 0 otherwise\n", z->flips, now_s() - t0, ok,
         refused);
}

/* ---- release ------------------------------------------------------------------ */

typedef struct pinger {
  atomic_int stop;
  double worst_ms;
  int n;
} pinger;

static void *ping_loop(void *p)
{
  pinger *g = p;
  mok_client *c = connect_or_fail("pinger");
  while (!atomic_load(&g->stop)) {
    uint64_t rtt;
    if (mok_ping(c, &rtt) != 0)
      fail("release: ping: %s", mok_last_error(c));
    if ((double)rtt / 1e6 > g->worst_ms)
      g->worst_ms = (double)rtt / 1e6;
    g->n++;
    usleep(1000);
  }
  mok_close(c);
  return NULL;
}

static void phase_release(const sizes *z)
{
  mok_client *c = connect_or_fail("release");
  mok_layer_desc d = {.hidden = 8, .intermediate = 8, .experts = 2, .top_k = 1};
  mok_testbed tb;
  uint64_t *ids = malloc((size_t)z->release_ids * sizeof *ids), seed = 5;
  pinger g = {0};
  pthread_t th;
  double t0 = now_s(), made, dt;

  if (mok_testbed_setup(c, &d, 1, 1, &tb) != 0)
    fail("release: setup: %s", tb.err);
  for (int i = 0; i < z->release_ids; i++) {
    mok_forward_result f;
    if (mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f) != 0)
      fail("release: forward %d: %s", i, mok_last_error(c));
    ids[i] = f.context;
  }
  made = now_s() - t0;
  for (int i = z->release_ids - 1; i > 0; i--) { /* in no particular order */
    int j = (int)(rng(&seed) % (uint64_t)(i + 1));
    uint64_t x = ids[i];
    ids[i] = ids[j], ids[j] = x;
  }
  atomic_init(&g.stop, 0);
  pthread_create(&th, NULL, ping_loop, &g);
  usleep(20000);
  t0 = now_s();
  if (mok_release(c, ids, z->release_ids) != 0)
    fail("release: %s", mok_last_error(c));
  dt = now_s() - t0;
  usleep(20000);
  atomic_store(&g.stop, 1);
  pthread_join(th, NULL);
  printf("stress: release: %d contexts made in %.1f s, released in one request in %.3f s; "
         "worst ping of another client meanwhile %.1f ms\n", z->release_ids, made, dt,
         g.worst_ms);
  if (dt > RELEASE_MAX_S)
    fail("release: %d ids took %.2f s", z->release_ids, dt);
  free(ids);
  mok_close(c);
  c = connect_or_fail("watch");
  wait_empty(c, "release");
  mok_close(c);
}

int main(int argc, char **argv)
{
  const sizes *z = argc > 1 && strcmp(argv[1], "--short") == 0 ? &brief : &full;
  int st;
  double t0 = now_s();

  if (argc > 1 && z == &full) {
    fprintf(stderr, "usage: stress [--short]\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  setvbuf(stdout, NULL, _IOLBF, 0);
  start_daemon();
  if (!CHECK_RSS)
    printf("stress: an ASan build: the daemon's RSS is reported, not checked\n");
  phase_kill9(z); /* first: it forks, and no thread of this process runs yet */
  phase_load(z);
  phase_unread(z);
  phase_flip(z);
  phase_release(z);
  kill(daemon_pid, SIGTERM);
  if (waitpid(daemon_pid, &st, 0) != daemon_pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    daemon_pid = 0;
    fail("mokd exited with status %d", st);
  }
  printf("stress: all phases passed in %.1f s; mokd exited 0\n", now_s() - t0);
  unlink(logpath);
  unlink(sock);
  rmdir(dir);
  return 0;
}
