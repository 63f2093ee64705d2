/* check_daemon.c - mokd end to end: the daemon runs on a temporary socket and
 * is driven through libmok and through raw frames. Results through the socket
 * must equal the in-process engine bit for bit; bad input must get an error
 * reply and leave the daemon serving; a killed client must leave nothing. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "frame.h"
#include "mok.h"
#include "proto/mokd.pb-c.h"
#include "ref.h"
#include "testbed.h"

static char dir[64], sock[96], logpath[96];
static pid_t daemon_pid;

static const char *mokd_bin(void)
{
  const char *b = getenv("MOKD_BIN");
  return b != NULL ? b : "build/mokd";
}

static pid_t spawn_daemon(const char *path, const char *extra, const char *log)
{
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(mokd_bin(), "mokd", "--socket", path, "--config", "/dev/null", "--cpu-threads",
          "2", "--log-level", "debug", extra, (char *)NULL);
    _exit(127);
  }
  return pid;
}

static void wait_for_socket(const char *path, pid_t pid)
{
  for (int i = 0; i < 400; i++) {
    mok_client *c;
    int st;
    if (mok_connect(path, "probe", &c) == 0) {
      mok_close(c);
      return;
    }
    mok_close(c);
    ck_assert_msg(waitpid(pid, &st, WNOHANG) == 0, "mokd exited early");
    usleep(10000);
  }
  ck_abort_msg("mokd did not come up on %s", path);
}

static int stop_daemon(pid_t pid)
{
  int st;
  kill(pid, SIGTERM);
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  return st;
}

static void setup(void)
{
  strcpy(dir, "/tmp/mokd-it-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(sock, sizeof sock, "%s/mokd.sock", dir);
  snprintf(logpath, sizeof logpath, "%s/mokd.log", dir);
  daemon_pid = spawn_daemon(sock, "--executor-threads=2", logpath);
  wait_for_socket(sock, daemon_pid);
}

static void teardown(void)
{
  int st = stop_daemon(daemon_pid);
  /* exit 0 means uv_loop_close() returned 0: every handle was closed */
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "mokd exited with status %d", st);
  unlink(sock);
  unlink(logpath);
  rmdir(dir);
}

static mok_client *connect_ok(void)
{
  mok_client *c;
  int rc = mok_connect(sock, "check_daemon", &c);
  ck_assert_msg(rc == 0, "connect: %s", mok_last_error(c));
  return c;
}

/* ---- results through the socket equal the engine ------------------------- */

typedef struct engine_out {
  uint16_t *out, *d_x, *g16[MOK_NWEIGHTS];
  float *d_tw, *g32[MOK_NWEIGHTS];
} engine_out;

static void engine_run(mok_client *c, const mok_testbed *tb, int bwd, mokk_grad_mode mode,
                       engine_out *o)
{
  mokk_backend *b;
  char err[MOK_ERRLEN];
  mokk_shape s = {.H = tb->d.hidden, .I = tb->d.intermediate, .E = tb->d.experts,
                  .K = tb->d.top_k, .I_s = tb->d.shared_intermediate, .P = 1,
                  .swiglu_limit = tb->d.swiglu_limit};
  size_t TH = (size_t)(tb->T * s.H);
  mokk_fwd_rank fr = {0};
  mokk_bwd_rank br = {0};
  mokk_ctx *ctx = NULL;

  memset(o, 0, sizeof *o);
  o->out = malloc(TH * 2), o->d_x = malloc(TH * 2);
  o->d_tw = malloc((size_t)(tb->T * s.K) * 4);
  fr.x = mok_tensor_ptr(c, &tb->x), fr.topk_ids = mok_tensor_ptr(c, &tb->ids);
  fr.topk_weights = mok_tensor_ptr(c, &tb->tw), fr.out = o->out;
  br.d_out = mok_tensor_ptr(c, &tb->d_out), br.d_x = o->d_x, br.d_topk_weights = o->d_tw;
  for (int w = 0; w < tb->nweights; w++) {
    size_t n = mok_tensor_bytes(&tb->w[w]) / 2;
    fr.w[w] = mok_tensor_ptr(c, &tb->w[w]);
    br.g_bf16[w] = o->g16[w] = malloc(n * 2);
    br.g_f32[w] = o->g32[w] = calloc(n, 4);
  }
  ck_assert_int_eq(mokk_cpu_create(1, &b, err), 0);
  ck_assert_int_eq(mokk_forward(b, &s, tb->T, &fr, bwd ? &ctx : NULL, err), 0);
  if (bwd)
    ck_assert_int_eq(mokk_backward(b, ctx, mode, &br, err), 0);
  mokk_ctx_free(b, ctx);
  mokk_backend_destroy(b);
}

static void engine_free(engine_out *o)
{
  free(o->out), free(o->d_x), free(o->d_tw);
  for (int w = 0; w < MOK_NWEIGHTS; w++)
    free(o->g16[w]), free(o->g32[w]);
}

START_TEST(forward_backward_equal_engine)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 96, .intermediate = 64, .experts = 8, .top_k = 2,
                      .shared_intermediate = 48, .swiglu_limit = 0.75f};
  mok_testbed tb;
  mok_forward_result f;
  mok_backward_result b;
  engine_out e;

  ck_assert_int_eq(mok_testbed_setup(c, &d, 100, 3, &tb), 0);
  engine_run(c, &tb, 1, MOKK_GRAD_BF16, &e);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), 0);
  ck_assert_int_eq(mok_backward(c, f.context, &tb.d_out, NULL, 0, &b), 0);
  ck_assert(memcmp(f.out_ptr, e.out, (size_t)(100 * 96) * 2) == 0);
  ck_assert(memcmp(b.d_x_ptr, e.d_x, (size_t)(100 * 96) * 2) == 0);
  ck_assert(memcmp(b.d_topk_weights_ptr, e.d_tw, (size_t)(100 * 2) * 4) == 0);
  ck_assert_int_eq(b.ngrads, 6);
  for (int w = 0; w < 6; w++)
    ck_assert_msg(memcmp(b.grad_ptrs[w], e.g16[w], mok_tensor_bytes(&tb.w[w])) == 0,
                  "gradient %d", w);
  engine_free(&e);

  /* fp32 accumulation into client buffers: twice from zero gives 2 * once */
  mok_testbed t2;
  d.grad_mode = MOK_GRAD_FP32_ACCUM;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 37, 4, &t2), 0);
  engine_run(c, &t2, 1, MOKK_GRAD_FP32_ACCUM, &e);
  ck_assert_int_eq(mok_forward(c, t2.layer, &t2.x, &t2.ids, &t2.tw, 0, &f), 0);
  ck_assert_int_eq(mok_backward(c, f.context, &t2.d_out, t2.g32, 6, &b), 0);
  ck_assert_int_eq(b.ngrads, 0);
  for (int w = 0; w < 6; w++)
    ck_assert(memcmp(mok_tensor_ptr(c, &t2.g32[w]), e.g32[w], mok_tensor_bytes(&t2.g32[w])) ==
              0);
  ck_assert_int_eq(mok_backward(c, f.context, &t2.d_out, t2.g32, 6, &b), 0);
  const float *g = mok_tensor_ptr(c, &t2.g32[MOK_W_DOWN]);
  for (size_t i = 0; i < mok_tensor_bytes(&t2.g32[MOK_W_DOWN]) / 4; i++)
    ck_assert(g[i] == e.g32[MOK_W_DOWN][i] + e.g32[MOK_W_DOWN][i]);
  engine_free(&e);
  mok_close(c);
}
END_TEST

typedef struct worker_arg {
  int index, failures, done;
} worker_arg;

static void *client_worker(void *p)
{
  worker_arg *a = p;
  mok_client *c;
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 8, .top_k = 2,
                      .shared_intermediate = a->index % 2 ? 16 : 0};
  mok_testbed tb;
  engine_out e;

  if (mok_connect(sock, "worker", &c) != 0 ||
      mok_testbed_setup(c, &d, 40 + a->index, (uint64_t)a->index, &tb) != 0) {
    a->failures = 50;
    return NULL;
  }
  engine_run(c, &tb, 0, MOKK_GRAD_BF16, &e);
  for (int i = 0; i < 50; i++) {
    mok_forward_result f;
    if (mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f) != 0 ||
        memcmp(f.out_ptr, e.out, (size_t)(tb.T * 64) * 2) != 0 ||
        mok_release(c, &f.context, 1) != 0)
      a->failures++;
    else
      a->done++;
  }
  engine_free(&e);
  mok_close(c);
  return NULL;
}

START_TEST(eight_concurrent_clients)
{
  pthread_t th[8];
  worker_arg args[8] = {0};
  for (int i = 0; i < 8; i++) {
    args[i].index = i;
    pthread_create(&th[i], NULL, client_worker, &args[i]);
  }
  for (int i = 0; i < 8; i++) {
    pthread_join(th[i], NULL);
    ck_assert_msg(args[i].failures == 0 && args[i].done == 50,
                  "client %d: %d of 50 right, %d failed", i, args[i].done, args[i].failures);
  }
  mok_client *c = connect_ok();
  mok_stats st;
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_ge(st.daemon.forwards, 400);
  mok_close(c);
}
END_TEST

static void wait_idle(mok_client *c, mok_stats *st)
{
  for (int i = 0; i < 500; i++) {
    ck_assert_int_eq(mok_stats_get(c, st), 0);
    if (st->daemon.sessions == 1 && st->daemon.arenas == 0)
      return;
    usleep(10000);
  }
}

START_TEST(killed_client_leaks_nothing)
{
  int pfd[2];
  ck_assert_int_eq(pipe(pfd), 0);
  pid_t child = fork();
  if (child == 0) {
    /* a big forward, so the kill lands while the daemon computes it */
    mok_client *c;
    mok_layer_desc d = {.hidden = 512, .intermediate = 512, .experts = 8, .top_k = 4,
                        .shared_intermediate = 256};
    mok_testbed tb;
    mok_forward_result f;
    if (mok_connect(sock, "victim", &c) != 0 || mok_testbed_setup(c, &d, 4096, 9, &tb) != 0)
      _exit(1);
    if (write(pfd[1], "x", 1) != 1)
      _exit(1);
    mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f);
    _exit(0);
  }
  char ch;
  ck_assert_int_eq(read(pfd[0], &ch, 1), 1);
  usleep(50000);
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);

  mok_client *c = connect_ok();
  mok_stats st;
  wait_idle(c, &st);
  ck_assert_uint_eq(st.daemon.sessions, 1);
  ck_assert_uint_eq(st.daemon.arenas, 0);
  ck_assert_uint_eq(st.daemon.arena_bytes, 0);
  ck_assert_uint_eq(st.daemon.contexts, 0);
  ck_assert_uint_eq(st.daemon.context_bytes, 0);
  ck_assert_uint_eq(st.daemon.layers, 0);
  /* and the next client is served */
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2};
  mok_testbed tb;
  mok_forward_result f;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 16, 1, &tb), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f), 0);
  mok_close(c);
}
END_TEST

/* ---- raw frames ------------------------------------------------------------ */

static int raw_connect(void)
{
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  strcpy(sa.sun_path, sock);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  return fd;
}

static void raw_send(int fd, const void *buf, size_t len, int pass_fd)
{
  struct iovec iov = {(void *)buf, len};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(sizeof(int))];
  } cm;
  if (pass_fd >= 0) {
    memset(&cm, 0, sizeof cm);
    mh.msg_control = cm.b;
    mh.msg_controllen = sizeof cm.b;
    struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
    h->cmsg_level = SOL_SOCKET, h->cmsg_type = SCM_RIGHTS, h->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(h), &pass_fd, sizeof(int));
  }
  ck_assert_int_eq(sendmsg(fd, &mh, MSG_NOSIGNAL), (ssize_t)len);
}

static void raw_request(int fd, Mokd__Request *req, int pass_fd)
{
  uint8_t *buf;
  size_t len;
  ck_assert_int_eq(mokw_pack(&req->base, &buf, &len), 0);
  raw_send(fd, buf, len, pass_fd);
  free(buf);
}

/* Reads one reply; NULL when the daemon closed the connection instead. */
static Mokd__Response *raw_reply(int fd)
{
  mokw_framer f;
  mokw_framer_init(&f, 1 << 20);
  for (;;) {
    const uint8_t *p;
    size_t len, avail;
    if (mokw_framer_next(&f, &p, &len, NULL) == 1) {
      Mokd__Response *r = mokd__response__unpack(NULL, len, p);
      mokw_framer_free(&f);
      return r;
    }
    struct pollfd pf = {fd, POLLIN, 0};
    ck_assert_msg(poll(&pf, 1, 10000) == 1, "no reply within 10 s");
    uint8_t *dst = mokw_framer_space(&f, 4096, &avail);
    ssize_t n = recv(fd, dst, avail, 0);
    if (n <= 0) {
      mokw_framer_free(&f);
      return NULL;
    }
    mokw_framer_commit(&f, (size_t)n);
  }
}

static void hello(int fd)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  h.protocol_version = MOK_PROTOCOL_VERSION;
  req.id = 1, req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
  raw_request(fd, &req, -1);
  Mokd__Response *r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0 && r->body_case == MOKD__RESPONSE__BODY_WELCOME);
  mokd__response__free_unpacked(r, NULL);
}

static void expect_status(int fd, int code, const char *needle)
{
  Mokd__Response *r = raw_reply(fd);
  ck_assert_msg(r != NULL, "connection closed instead of an error reply");
  ck_assert_msg(r->status == code, "status %d (%s), want %d; message: %s", r->status,
                mok_err_name(r->status), code, r->message);
  ck_assert_msg(strstr(r->message, needle) != NULL, "message \"%s\" lacks \"%s\"", r->message,
                needle);
  mokd__response__free_unpacked(r, NULL);
}

static void still_serving(void)
{
  mok_client *c = connect_ok();
  uint64_t rtt;
  ck_assert_int_eq(mok_ping(c, &rtt), 0);
  mok_close(c);
}

START_TEST(garbage_bytes)
{
  int fd = raw_connect();
  static const uint8_t junk[] = {8, 0, 0, 0, 0xff, 0xfe, 0xfd, 0xfc, 0xfb, 0xfa, 0xf9, 0xf8};
  raw_send(fd, junk, sizeof junk, -1);
  expect_status(fd, MOK_EPROTO, "not a packed Request");
  hello(fd); /* the connection still frames correctly */
  uint8_t noise[4096];
  uint64_t s = 5;
  for (size_t i = 0; i < sizeof noise; i++)
    noise[i] = (uint8_t)rng_next(&s);
  raw_send(fd, noise, sizeof noise, -1);
  close(fd);
  still_serving();
}
END_TEST

START_TEST(oversize_length_prefix)
{
  int fd = raw_connect();
  static const uint8_t big[] = {0x00, 0x00, 0x00, 0x40}; /* 1 GiB */
  raw_send(fd, big, sizeof big, -1);
  expect_status(fd, MOK_EMSGSIZE, "over max_frame_bytes");
  ck_assert_ptr_null(raw_reply(fd)); /* then the daemon hangs up */
  close(fd);
  still_serving();
}
END_TEST

START_TEST(unknown_body_and_no_body)
{
  int fd = raw_connect();
  hello(fd);
  /* Request{id=7, field 60 (no such body) = empty message} */
  static const uint8_t unknown[] = {5, 0, 0, 0, 0x08, 0x07, 0xe2, 0x03, 0x00};
  raw_send(fd, unknown, 4, -1); /* in two writes: the prefix, then the payload */
  raw_send(fd, unknown + 4, 5, -1);
  expect_status(fd, MOK_EPROTO, "unknown field 60");
  Mokd__Request req = MOKD__REQUEST__INIT;
  req.id = 8;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EPROTO, "no body");
  static const uint8_t zero[] = {0, 0, 0, 0};
  raw_send(fd, zero, 4, -1);
  expect_status(fd, MOK_EPROTO, "not a packed Request");
  close(fd);
  still_serving();
}
END_TEST

START_TEST(unknown_field_zero_is_refused)
{
  int fd = raw_connect();
  hello(fd);
  /* Request{id=9, ping{nonce=2, field 0 = 1}}: protobuf-c keeps the two-byte
   * key 0x80 0x00 as an unknown field numbered 0 */
  static const uint8_t ping0[] = {10, 0, 0, 0, 0x08, 0x09, 0xaa, 0x01, 0x05,
                                  0x08, 0x02, 0x80, 0x00, 0x01};
  raw_send(fd, ping0, sizeof ping0, -1);
  expect_status(fd, MOK_EPROTO, "unknown field");
  close(fd);
  still_serving();
}
END_TEST

START_TEST(hello_comes_first)
{
  int fd = raw_connect();
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Ping p = MOKD__PING__INIT;
  req.id = 3, req.body_case = MOKD__REQUEST__BODY_PING, req.ping = &p;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EPROTO, "send Hello first");
  Mokd__Hello h = MOKD__HELLO__INIT;
  h.protocol_version = 99;
  req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EPROTO, "client speaks protocol 99");
  close(fd);
  /* one Hello per session: a second could move it off the GPU its arenas are on */
  fd = raw_connect();
  hello(fd);
  h.protocol_version = MOK_PROTOCOL_VERSION;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EPROTO, "said Hello already");
  close(fd);
}
END_TEST

/* A forward on a real layer with one tensor broken by `mutate`. */
static void bad_forward(void (*mutate)(Mokd__Forward *, uint64_t), int code,
                        const char *needle)
{
  mok_client *owner = connect_ok();
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2};
  mok_testbed tb;
  ck_assert_int_eq(mok_testbed_setup(owner, &d, 8, 2, &tb), 0);

  int fd = raw_connect();
  hello(fd);
  /* the raw session needs its own arena and layer */
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__CreateArena ca = MOKD__CREATE_ARENA__INIT;
  ca.bytes = 1 << 16;
  req.id = 2, req.body_case = MOKD__REQUEST__BODY_CREATE_ARENA, req.create_arena = &ca;
  raw_request(fd, &req, -1);
  Mokd__Response *r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0);
  uint64_t arena = r->arena_created->arena;
  mokd__response__free_unpacked(r, NULL);

  Mokd__CreateLayer cl = MOKD__CREATE_LAYER__INIT;
  cl.hidden = 64, cl.intermediate = 32, cl.experts = 4, cl.top_k = 2;
  req.id = 3, req.body_case = MOKD__REQUEST__BODY_CREATE_LAYER, req.create_layer = &cl;
  raw_request(fd, &req, -1);
  r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0);
  uint64_t layer = r->layer_created->layer;
  mokd__response__free_unpacked(r, NULL);

  Mokd__TensorRef w[3];
  int64_t sh[3][3] = {{4, 32, 64}, {4, 32, 64}, {4, 64, 32}};
  Mokd__SetWeights sw = MOKD__SET_WEIGHTS__INIT;
  for (int i = 0; i < 3; i++) {
    mokd__tensor_ref__init(&w[i]);
    w[i].arena = arena, w[i].offset = 0, w[i].dtype = MOKD__DTYPE__DTYPE_BF16;
    w[i].n_shape = 3, w[i].shape = sh[i];
  }
  w[2].offset = 4 * 32 * 64 * 2;
  sw.layer = layer, sw.w_gate = &w[0], sw.w_up = &w[0], sw.w_down = &w[2];
  req.id = 4, req.body_case = MOKD__REQUEST__BODY_SET_WEIGHTS, req.set_weights = &sw;
  raw_request(fd, &req, -1);
  r = raw_reply(fd);
  ck_assert_msg(r != NULL && r->status == 0, "set weights: %s", r ? r->message : "closed");
  mokd__response__free_unpacked(r, NULL);

  Mokd__TensorRef x, ids, tw;
  int64_t sx[2] = {8, 64}, sk[2] = {8, 2};
  mokd__tensor_ref__init(&x), mokd__tensor_ref__init(&ids), mokd__tensor_ref__init(&tw);
  x.arena = ids.arena = tw.arena = arena;
  x.offset = 40000, x.dtype = MOKD__DTYPE__DTYPE_BF16, x.n_shape = 2, x.shape = sx;
  ids.offset = 42000, ids.dtype = MOKD__DTYPE__DTYPE_I32, ids.n_shape = 2, ids.shape = sk;
  tw.offset = 43000, tw.dtype = MOKD__DTYPE__DTYPE_F32, tw.n_shape = 2, tw.shape = sk;
  Mokd__Forward f = MOKD__FORWARD__INIT;
  f.layer = layer, f.x = &x, f.topk_ids = &ids, f.topk_weights = &tw, f.inference = 1;
  mutate(&f, tb.arena.id);
  req.id = 5, req.body_case = MOKD__REQUEST__BODY_FORWARD, req.forward = &f;
  raw_request(fd, &req, -1);
  expect_status(fd, code, needle);
  close(fd);
  mok_close(owner);
  still_serving();
}

static void keep(Mokd__Forward *f, uint64_t other)
{
  (void)f, (void)other;
}
static void wrong_dtype(Mokd__Forward *f, uint64_t other)
{
  (void)other;
  f->x->dtype = MOKD__DTYPE__DTYPE_F32;
}
static void offset_out_of_range(Mokd__Forward *f, uint64_t other)
{
  (void)other;
  f->x->offset = 65536 - 512;
}
static void other_sessions_arena(Mokd__Forward *f, uint64_t other)
{
  f->topk_weights->arena = other; /* a live arena of the other client */
}

START_TEST(valid_raw_forward_runs)
{
  /* the baseline of the bad-tensor cases: unmutated, the same request succeeds
   * (all-zero ids route every token to expert 0) */
  bad_forward(keep, 0, "");
}
END_TEST

START_TEST(wrong_dtype_is_refused)
{
  bad_forward(wrong_dtype, MOK_EDTYPE, "x: dtype is f32; it must be bf16");
}
END_TEST

START_TEST(offset_out_of_range_is_refused)
{
  bad_forward(offset_out_of_range, MOK_ERANGE, "lie outside arena");
}
END_TEST

START_TEST(another_sessions_arena_is_refused)
{
  bad_forward(other_sessions_arena, MOK_ENOENT, "is not an arena of this session");
}
END_TEST

START_TEST(fd_where_none_is_expected)
{
  int fd = raw_connect();
  hello(fd);
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Ping p = MOKD__PING__INIT;
  req.id = 9, req.body_case = MOKD__REQUEST__BODY_PING, req.ping = &p;
  int extra = memfd_create("stray", MFD_CLOEXEC);
  raw_request(fd, &req, extra);
  close(extra);
  expect_status(fd, MOK_EINVAL, "file descriptor came with a request that takes none");
  /* and an ImportBuffer without its fd */
  Mokd__ImportBuffer ib = MOKD__IMPORT_BUFFER__INIT;
  ib.bytes = 4096;
  req.id = 10, req.body_case = MOKD__REQUEST__BODY_IMPORT_BUFFER, req.import_buffer = &ib;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EINVAL, "needs exactly one fd");
  close(fd);
  still_serving();
}
END_TEST

START_TEST(import_and_errors_through_libmok)
{
  mok_client *c = connect_ok();
  mok_arena_info a;
  int mfd = memfd_create("weights", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(mfd, 8192), 0);
  ck_assert_int_eq(mok_arena_import(c, mfd, 8192, &a), MOK_EINVAL); /* not sealed */
  ck_assert_ptr_nonnull(strstr(mok_last_error(c), "F_SEAL_SHRINK"));
  ck_assert_int_eq(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  ck_assert_int_eq(mok_arena_import(c, mfd, 16384, &a), MOK_ERANGE); /* larger than the fd */
  ck_assert_int_eq(mok_arena_import(c, mfd, 8192, &a), 0);
  ((char *)a.ptr)[0] = 42;
  char *mine = mmap(NULL, 8192, PROT_READ, MAP_SHARED, mfd, 0);
  ck_assert_int_eq(mine[0], 42); /* the same memory on both sides */
  munmap(mine, 8192);
  close(mfd);

  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 6, .top_k = 2, .ep_size = 4};
  uint64_t layer;
  ck_assert_int_eq(mok_layer_create(c, &d, &layer), MOK_ENOTSUP);
  d.ep_size = 1, d.experts = 0;
  ck_assert_int_eq(mok_layer_create(c, &d, &layer), MOK_EZEROSIZE);
  ck_assert_ptr_nonnull(strstr(mok_last_error(c), "E is 0"));
  d.experts = 4, d.top_k = 5;
  ck_assert_int_eq(mok_layer_create(c, &d, &layer), MOK_ESHAPE);
  d.top_k = 2;
  ck_assert_int_eq(mok_layer_create(c, &d, &layer), 0);
  mok_tensor x = mok_tensor_make(a.id, 0, MOK_DTYPE_BF16, 2, (int64_t[]){1, 64});
  mok_forward_result f;
  ck_assert_int_eq(mok_forward(c, layer, &x, &x, &x, 1, &f), MOK_EINVAL);
  ck_assert_ptr_nonnull(strstr(mok_last_error(c), "has no weights"));
  uint64_t bogus = 999999;
  ck_assert_int_eq(mok_release(c, &bogus, 1), MOK_ECONTEXT);
  ck_assert_int_eq(mok_arena_destroy(c, a.id), 0);
  ck_assert_int_eq(mok_arena_destroy(c, a.id), MOK_ENOENT);
  mok_close(c);
}
END_TEST

/* Outputs of each step go back into the room the last one of their size
 * left: a small forward output must not split the block the weight
 * gradients come back to (else each backward needs a new arena). */
START_TEST(outputs_reuse_their_room)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 1024, .intermediate = 1024, .experts = 16, .top_k = 2};
  mok_testbed tb;
  mok_forward_result f1, f2;
  mok_backward_result b1, b2;
  mok_stats st0, st;

  ck_assert_int_eq(mok_testbed_setup(c, &d, 4, 3, &tb), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f1), 0);
  ck_assert_int_eq(mok_backward(c, f1.context, &tb.d_out, NULL, 0, &b1), 0);
  ck_assert(b1.grads[0].arena != f1.out.arena); /* 96 MB of gradients: an arena of its own */
  ck_assert_int_eq(mok_stats_get(c, &st0), 0);
  ck_assert_int_eq(mok_release(c, &b1.result, 1), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f2), 0);
  ck_assert_uint_eq(f2.out.arena, f1.out.arena);
  ck_assert_int_eq(mok_backward(c, f2.context, &tb.d_out, NULL, 0, &b2), 0);
  ck_assert_uint_eq(b2.grads[0].arena, b1.grads[0].arena);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.arenas, st0.session.arenas);
  mok_close(c);
}
END_TEST

/* a GPU asked for from a daemon on the cpu backend is a clear error */
START_TEST(device_on_cpu_backend_is_refused)
{
  mok_client *c = NULL;
  ck_assert_int_eq(mok_connect_device(sock, "check_daemon", 0, &c), MOK_EDEVICE);
  ck_assert_msg(strstr(mok_last_error(c), "has no CUDA device 0") != NULL, "%s",
                mok_last_error(c));
  mok_close(c);
  c = connect_ok();
  ck_assert_int_eq(mok_server_info(c)->device, -1);
  mok_close(c);
}
END_TEST

START_TEST(expert_id_out_of_range_through_daemon)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2};
  mok_testbed tb;
  mok_forward_result f;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 8, 2, &tb), 0);
  ((int32_t *)mok_tensor_ptr(c, &tb.ids))[5] = 4;
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), MOK_EEXPERT);
  ck_assert_ptr_nonnull(strstr(mok_last_error(c), "token 2 k 1: expert id 4"));
  mok_stats st;
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.contexts, 0); /* the failed step left nothing */
  ((int32_t *)mok_tensor_ptr(c, &tb.ids))[5] = 3;
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f), 0);
  mok_close(c);
}
END_TEST

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
    {"--socket %s", "mokctl: no command given; one of ping, status, stats, bench\n"},
    {"--socket %s pong", "mokctl: unknown command \"pong\"; one of ping, status, stats, "
                        "bench\n"},
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
  /* 18 PB: the daemon refuses the arena; the message says at which step */
  rc = run_mokctl("--socket %s bench --H 1000000 --I 1000000 --E 1000", out, sizeof out);
  ck_assert_msg(rc == 1, "exit %d: %s", rc, out);
  ck_assert_msg(strstr(out, "mokctl: bench: creating its arena: arena of 18000004096016384 "
                       "bytes is larger than max_arena_bytes") == out, "%s", out);
}
END_TEST

START_TEST(other_uid_is_refused)
{
  /* only root can become another uid; CI runs as root */
  pid_t child = fork();
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0)
      _exit(3);
    mok_client *c;
    int rc = mok_connect(sock, "intruder", &c);
    int ok = rc == MOK_EPERM || rc == MOK_ENOENT || rc == MOK_EIO;
    mok_close(c);
    _exit(ok ? 0 : 4);
  }
  int st;
  waitpid(child, &st, 0);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
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

static void plain_setup(void)
{
  strcpy(dir, "/tmp/mokd-it-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(sock, sizeof sock, "%s/mokd.sock", dir);
  snprintf(logpath, sizeof logpath, "%s/mokd.log", dir);
}

static void plain_teardown(void)
{
  rmdir(dir);
}

START_TEST(session_quota_is_enforced)
{
  char q[128], log2[128];
  snprintf(q, sizeof q, "%s/quota.sock", dir);
  snprintf(log2, sizeof log2, "%s/quota.log", dir);
  pid_t p = spawn_daemon(q, "--session-quota-bytes=96M", log2);
  wait_for_socket(q, p);
  mok_client *c;
  mok_arena_info a, b;
  ck_assert_int_eq(mok_connect(q, "quota", &c), 0);
  ck_assert_int_eq(mok_arena_create(c, 32u << 20, &a), 0);
  ck_assert_int_eq(mok_arena_create(c, 80u << 20, &b), MOK_EDQUOT);
  ck_assert_ptr_nonnull(strstr(mok_last_error(c), "quota is 100663296"));
  /* outputs count too: a forward needs a 64 MiB output arena, which no longer fits */
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2};
  mok_testbed tb;
  mok_forward_result f;
  ck_assert_int_eq(mok_testbed_setup(c, &d, 8, 1, &tb), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f), MOK_EDQUOT);
  ck_assert_int_eq(mok_arena_destroy(c, a.id), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 1, &f), 0);
  mok_close(c);
  int st = stop_daemon(p);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  unlink(log2);
}
END_TEST

static Suite *daemon_suite(void)
{
  Suite *s = suite_create("daemon");
  TCase *tc = tcase_create("end_to_end");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, forward_backward_equal_engine);
  tcase_add_test(tc, eight_concurrent_clients);
  tcase_add_test(tc, killed_client_leaks_nothing);
  tcase_add_test(tc, expert_id_out_of_range_through_daemon);
  tcase_add_test(tc, outputs_reuse_their_room);
  tcase_add_test(tc, device_on_cpu_backend_is_refused);
  tcase_add_test(tc, import_and_errors_through_libmok);
  tcase_add_test(tc, sigterm_finishes_in_flight_work);
  tcase_add_test(tc, second_daemon_and_stale_socket);
  tcase_add_test(tc, config_error_stops_startup);
  tcase_add_test(tc, session_quota_is_enforced);
  tcase_add_test(tc, mokctl_bench_runs_and_says_what_failed);
  suite_add_tcase(s, tc);
  tc = tcase_create("bad_input");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, garbage_bytes);
  tcase_add_test(tc, oversize_length_prefix);
  tcase_add_test(tc, unknown_body_and_no_body);
  tcase_add_test(tc, unknown_field_zero_is_refused);
  tcase_add_test(tc, hello_comes_first);
  tcase_add_test(tc, valid_raw_forward_runs);
  tcase_add_test(tc, wrong_dtype_is_refused);
  tcase_add_test(tc, offset_out_of_range_is_refused);
  tcase_add_test(tc, another_sessions_arena_is_refused);
  tcase_add_test(tc, fd_where_none_is_expected);
  tcase_add_test(tc, mokctl_flag_errors);
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
    suite_add_tcase(s, tc);
  } else {
    fprintf(stderr, "check_daemon: not root: the allow-list test (another uid) is not run\n");
  }
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(daemon_suite());
  int failed;
  signal(SIGPIPE, SIG_IGN);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
