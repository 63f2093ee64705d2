/* check_daemon_wire.c - what a client can get wrong on the wire, through
 * raw frames and through libmok: each gets an error reply that says what,
 * and the daemon keeps serving. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
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
  expect_status(fd, MOK_EPROTO, "request carries unknown field 0;");
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

/* Hello of a client that speaks only `version` (as clients of protocol 1
 * do: no range), or the range [lo, hi]; the reply. */
static Mokd__Response *hello_range(int fd, uint32_t version, uint32_t lo, uint32_t hi)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  h.protocol_version = version, h.min_protocol = lo, h.max_protocol = hi;
  h.client_name = "old";
  req.id = 1, req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
  raw_request(fd, &req, -1);
  Mokd__Response *r = raw_reply(fd);
  ck_assert_ptr_nonnull(r);
  return r;
}

START_TEST(protocol_versions_are_negotiated)
{
  /* an older client: protocol 1 alone, no range, no job id */
  int fd = raw_connect();
  Mokd__Response *r = hello_range(fd, 1, 0, 0);
  ck_assert_int_eq(r->status, 0);
  ck_assert_int_eq(r->body_case, MOKD__RESPONSE__BODY_WELCOME);
  ck_assert_uint_eq(r->welcome->protocol_version, 1);
  mokd__response__free_unpacked(r, NULL);
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Ping p = MOKD__PING__INIT;
  req.id = 2, req.body_case = MOKD__REQUEST__BODY_PING, req.ping = &p;
  raw_request(fd, &req, -1); /* what protocol 1 had works */
  r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0 && r->body_case == MOKD__RESPONSE__BODY_PONG);
  mokd__response__free_unpacked(r, NULL);
  Mokd__Health hq = MOKD__HEALTH__INIT;
  req.id = 3, req.body_case = MOKD__REQUEST__BODY_HEALTH, req.health = &hq;
  raw_request(fd, &req, -1); /* what came later is refused, saying why */
  expect_status(fd, MOK_EPROTO, "Health needs protocol 2; this session chose 1 at Hello "
                "(upgrade the client)");
  close(fd);

  /* a range reaching past ours: the newest both speak */
  fd = raw_connect();
  r = hello_range(fd, 9, 1, 9);
  ck_assert_int_eq(r->status, 0);
  ck_assert_uint_eq(r->welcome->protocol_version, MOK_PROTOCOL_VERSION);
  mokd__response__free_unpacked(r, NULL);
  close(fd);

  /* ranges it cannot serve, either side */
  fd = raw_connect();
  r = hello_range(fd, 7, 5, 7);
  ck_assert_int_eq(r->status, MOK_EPROTO);
  ck_assert_str_eq(r->message, "client speaks protocol 5 to 7; this daemon (mokd 0.1.0) "
                   "speaks 1 to 3: upgrade the daemon");
  mokd__response__free_unpacked(r, NULL);
  close(fd);
  fd = raw_connect();
  r = hello_range(fd, 0, 3, 2);
  ck_assert_int_eq(r->status, MOK_EPROTO);
  ck_assert_str_eq(r->message, "Hello offers no protocol version (min 3, max 2, "
                   "protocol_version 0)");
  mokd__response__free_unpacked(r, NULL);
  close(fd);

  /* a newer client's Hello with a field this daemon does not know (field
   * 15 = 1) is still answered */
  fd = raw_connect();
  static const uint8_t newer[] = {10, 0, 0, 0, 0x08, 0x01, 0x52, 0x06, 0x08, 0x02,
                                  0x28, 0x02, 0x78, 0x01};
  raw_send(fd, newer, sizeof newer, -1);
  r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0 && r->body_case == MOKD__RESPONSE__BODY_WELCOME);
  ck_assert_uint_eq(r->welcome->protocol_version, 2);
  mokd__response__free_unpacked(r, NULL);
  close(fd);
  still_serving();
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

/* Too many fds: ImportBuffer is told how many it takes, and a message with
 * more fds than the daemon receives at once is answered, not hung up on. */
START_TEST(too_many_fds_are_answered)
{
  int fd = raw_connect(), fds[20];
  hello(fd);
  for (int i = 0; i < 20; i++) {
    fds[i] = memfd_create("many", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_eq(ftruncate(fds[i], 4096), 0);
    ck_assert_int_eq(fcntl(fds[i], F_ADD_SEALS, F_SEAL_SHRINK), 0);
  }
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__ImportBuffer ib = MOKD__IMPORT_BUFFER__INIT;
  uint8_t *buf;
  size_t len;
  ib.bytes = 4096, ib.kind = MOKD__IMPORT_KIND__IMPORT_MEMFD;
  req.id = 11, req.body_case = MOKD__REQUEST__BODY_IMPORT_BUFFER, req.import_buffer = &ib;
  ck_assert_int_eq(mokw_pack(&req.base, &buf, &len), 0);
  raw_send_fds(fd, buf, len, fds, 2);
  expect_status(fd, MOK_EINVAL, "ImportBuffer takes exactly one fd (SCM_RIGHTS) on its frame; "
                                "2 came");
  free(buf);
  Mokd__Ping p = MOKD__PING__INIT;
  req.id = 12, req.body_case = MOKD__REQUEST__BODY_PING, req.ping = &p;
  ck_assert_int_eq(mokw_pack(&req.base, &buf, &len), 0);
  raw_send_fds(fd, buf, len, fds, 20);
  expect_status(fd, MOK_EINVAL, "more than 8 file descriptors came on one message");
  /* the connection goes on */
  raw_send(fd, buf, len, -1);
  Mokd__Response *r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0 && r->body_case == MOKD__RESPONSE__BODY_PONG);
  mokd__response__free_unpacked(r, NULL);
  free(buf);
  for (int i = 0; i < 20; i++)
    close(fds[i]);
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
  ck_assert_int_eq(mok_layer_create(c, &d, &layer), MOK_EEPSIZE);
  ck_assert_ptr_nonnull(strstr(mok_last_error(c), "E = 6 experts do not divide over P = 4"));
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

/* An arena that holds the weights of live contexts cannot go; the message
 * counts the contexts, whatever the number of weights each keeps there. */
START_TEST(busy_arena_counts_contexts)
{
  mok_client *c = connect_ok();
  mok_layer_desc d = {.hidden = 64, .intermediate = 32, .experts = 4, .top_k = 2,
                      .shared_intermediate = 32};
  mok_testbed tb;
  mok_forward_result f[2];
  ck_assert_int_eq(mok_testbed_setup(c, &d, 8, 2, &tb), 0);
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f[0]), 0);
  ck_assert_int_eq(mok_arena_destroy(c, tb.arena.id), MOK_EBUSY);
  ck_assert_msg(strstr(mok_last_error(c), "holds weights of 1 live forward context;") != NULL,
                "%s", mok_last_error(c));
  ck_assert_int_eq(mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f[1]), 0);
  ck_assert_int_eq(mok_arena_destroy(c, tb.arena.id), MOK_EBUSY);
  ck_assert_msg(strstr(mok_last_error(c), "holds weights of 2 live forward contexts;") != NULL,
                "%s", mok_last_error(c));
  uint64_t ids[2] = {f[0].context, f[1].context};
  ck_assert_int_eq(mok_release(c, ids, 2), 0);
  ck_assert_int_eq(mok_arena_destroy(c, tb.arena.id), 0);
  mok_close(c);
}
END_TEST


/* A size that runs past the end of the address space, or none, is refused
 * for what it is before the backend is asked about GPU memory at all. */
START_TEST(import_cuda_bad_sizes_are_refused)
{
  mok_client *c = connect_ok();
  const void *p = (const void *)(uintptr_t)0x7f0000001000;
  uint64_t arena = 0, off = 0;
  ck_assert_int_eq(mok_arena_import_cuda(c, p, SIZE_MAX, &arena, &off), MOK_EOVERFLOW);
  ck_assert_msg(strstr(mok_last_error(c), "run past the end of the address space") != NULL,
                "%s", mok_last_error(c));
  ck_assert_int_eq(mok_arena_import_cuda(c, p, UINTPTR_MAX - (uintptr_t)p + 1, &arena, &off),
                   MOK_EOVERFLOW);
  ck_assert_int_eq(mok_arena_import_cuda(c, p, 0, &arena, &off), MOK_EZEROSIZE);
  ck_assert_msg(strstr(mok_last_error(c), "importing 0 bytes") != NULL, "%s",
                mok_last_error(c));
  ck_assert_int_eq(mok_arena_import_cuda(c, p, UINTPTR_MAX - (uintptr_t)p, &arena, &off),
                   MOK_ENOTSUP); /* the largest size that fits: the cpu backend answers */
  ck_assert_uint_eq(arena, 0);
  mok_close(c);
}
END_TEST

/* a client_name is the peer's text: logged escaped, it cannot forge a line */
START_TEST(client_name_is_logged_escaped)
{
  mok_client *c;
  ck_assert_int_eq(mok_connect(sock, "evil\n<3>mokd error [init] forged\x1b[2J\\", &c), 0);
  uint64_t rtt;
  ck_assert_int_eq(mok_ping(c, &rtt), 0);
  mok_close(c);
  char buf[65536];
  FILE *f = fopen(logpath, "r");
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  ck_assert_msg(strstr(buf, "hello from \"evil\\n<3>mokd error [init] forged\\x1b[2J\\\\\"") !=
                    NULL, "log: %s", buf);
  ck_assert_msg(strstr(buf, "\n<3>mokd error [init] forged") == NULL, "a forged line in: %s",
                buf);
  ck_assert_ptr_null(strchr(buf, 0x1b));
}
END_TEST

/* a GPU asked for from a daemon on the cpu backend is a clear error; by
 * ordinal, libmok first names it by UUID, which needs this process's driver */
START_TEST(device_on_cpu_backend_is_refused)
{
  mok_client *c = NULL;
  ck_assert_int_eq(mok_connect_device(sock, "check_daemon", 0, &c), MOK_EDEVICE);
  ck_assert_msg(strstr(mok_last_error(c), "cannot name CUDA device 0 to mokd") != NULL ||
                    strstr(mok_last_error(c), "runs the cpu backend; it has no GPU GPU-") != NULL,
                "%s", mok_last_error(c));
  mok_close(c);
  ck_assert_int_eq(mok_connect_uuid(sock, "check_daemon",
                                    "GPU-00000000-1111-2222-3333-444444444444", &c),
                   MOK_EDEVICE);
  ck_assert_str_eq(mok_last_error(c), "this daemon runs the cpu backend; it has no GPU "
                   "GPU-00000000-1111-2222-3333-444444444444");
  mok_close(c);
  c = connect_ok();
  ck_assert_int_eq(mok_server_info(c)->device, -1);
  ck_assert_int_eq(mok_server_info(c)->daemon_device, -1);
  ck_assert_str_eq(mok_server_info(c)->device_uuid, "");
  mok_close(c);
}
END_TEST

/* GPUs are named by UUID on the wire: a UUID that is not one, or a GPU named
 * twice, is refused before any placement */
START_TEST(bad_gpu_uuid_is_refused)
{
  mok_client *c = NULL;
  ck_assert_int_eq(mok_connect_uuid(sock, "check_daemon", "0", &c), MOK_EINVAL);
  ck_assert_msg(strstr(mok_last_error(c), "\"0\" is not a GPU UUID; nvidia-smi -L prints them "
                       "as GPU-") != NULL, "%s", mok_last_error(c));
  mok_close(c);
  ck_assert_int_eq(mok_connect_uuid(sock, "check_daemon", NULL, &c), 0); /* the daemon picks */
  mok_close(c);

  uint8_t five[5] = {1, 2, 3, 4, 5}, sixteen[16] = {0};
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  int fd = raw_connect();
  h.protocol_version = MOK_PROTOCOL_VERSION;
  h.device_uuid.data = five, h.device_uuid.len = sizeof five;
  req.id = 1, req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EINVAL, "Hello's device_uuid holds 5 bytes; a GPU UUID has 16");
  h.device_uuid.data = sixteen, h.device_uuid.len = sizeof sixteen;
  h.device = 1;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EINVAL, "Hello names its GPU twice (device 0 and device_uuid)");
  h.device = 0;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EDEVICE, "it has no GPU GPU-00000000-0000-0000-0000-000000000000");
  close(fd);
}
END_TEST

/* A Hello of protocol 2 carries both a version range with a job id and a GPU
 * UUID: the version is chosen first, and the UUID still places the session */
START_TEST(hello_range_job_and_uuid_together)
{
  uint8_t sixteen[16] = {0};
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  int fd = raw_connect();
  h.protocol_version = 7, h.min_protocol = 5, h.max_protocol = 7;
  h.job_id = "4242";
  h.device_uuid.data = sixteen, h.device_uuid.len = sizeof sixteen;
  req.id = 1, req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EPROTO, "client speaks protocol 5 to 7");
  h.protocol_version = MOK_PROTOCOL_VERSION, h.min_protocol = 1;
  h.max_protocol = MOK_PROTOCOL_VERSION;
  raw_request(fd, &req, -1);
  expect_status(fd, MOK_EDEVICE, "it has no GPU GPU-00000000-0000-0000-0000-000000000000");
  h.device_uuid.len = 0;
  raw_request(fd, &req, -1);
  Mokd__Response *r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0 && r->body_case == MOKD__RESPONSE__BODY_WELCOME);
  ck_assert_uint_eq(r->welcome->protocol_version, MOK_PROTOCOL_VERSION);
  ck_assert_uint_eq(r->welcome->session_device_uuid.len, 0);
  mokd__response__free_unpacked(r, NULL);
  close(fd);
}
END_TEST

/* ---- imports made of several allocations ----------------------------------- */

/* A sealed memfd of bytes holding `fill` bytes; or, unsealed, not. */
static int chunk_fd(size_t bytes, int seal, int fill)
{
  int fd = memfd_create("chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
  if (fill >= 0) {
    char *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(p, MAP_FAILED);
    memset(p, fill, bytes);
    munmap(p, bytes);
  }
  if (seal)
    ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  return fd;
}

/* One frame of a chunked import: n chunk sizes, nfds of fds riding along. */
static void chunk_frame(int fd, uint64_t id, Mokd__ImportKind kind, uint64_t bytes,
                        uint64_t continues, const uint64_t *sizes, size_t n, const int *fds,
                        int nfds)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__ImportBuffer ib = MOKD__IMPORT_BUFFER__INIT;
  uint8_t *buf;
  size_t len;
  ib.bytes = bytes, ib.kind = kind, ib.continues = continues;
  ib.chunk_bytes = (uint64_t *)sizes, ib.n_chunk_bytes = n;
  req.id = id, req.body_case = MOKD__REQUEST__BODY_IMPORT_BUFFER, req.import_buffer = &ib;
  ck_assert_int_eq(mokw_pack(&req.base, &buf, &len), 0);
  raw_send_fds(fd, buf, len, fds, nfds);
  free(buf);
}

/* The reply to a frame that was taken: the import's id; incomplete as said */
static uint64_t chunk_taken(int fd, int incomplete)
{
  Mokd__Response *r = raw_reply(fd);
  ck_assert_ptr_nonnull(r);
  ck_assert_msg(r->status == 0, "%s", r->message);
  ck_assert_int_eq(r->body_case, MOKD__RESPONSE__BODY_BUFFER_IMPORTED);
  ck_assert_int_eq(r->buffer_imported->incomplete, incomplete);
  uint64_t id = r->buffer_imported->arena;
  mokd__response__free_unpacked(r, NULL);
  return id;
}

/* The session's arenas (mappings) and arena bytes, asked with Stats. */
static void session_holds(int fd, uint64_t arenas, uint64_t bytes)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Stats st = MOKD__STATS__INIT;
  req.id = 77, req.body_case = MOKD__REQUEST__BODY_STATS, req.stats = &st;
  raw_request(fd, &req, -1);
  Mokd__Response *r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0 && r->body_case == MOKD__RESPONSE__BODY_STATS);
  ck_assert_uint_eq(r->stats->session->arenas, arenas);
  ck_assert_uint_eq(r->stats->session->arena_bytes, bytes);
  mokd__response__free_unpacked(r, NULL);
}

/* Through libmok: 20 memfds become one arena over three frames; both sides
 * see each chunk at its offset, and the arena counts one mapping a chunk. */
START_TEST(chunked_import_through_libmok)
{
  enum { N = 20, PAGE = 4096 };
  mok_client *c = connect_ok();
  mok_arena_info a;
  mok_stats st;
  int fds[N];
  size_t sizes[N];
  for (int i = 0; i < N; i++) {
    sizes[i] = (size_t)PAGE * (1 + i % 3);
    fds[i] = chunk_fd(sizes[i], 1, i + 1);
  }
  sizes[N - 1] = 100; /* the last may end anywhere */
  ck_assert_msg(mok_arena_import_chunks(c, fds, sizes, N, &a) == 0, "%s", mok_last_error(c));
  size_t off = 0;
  for (int i = 0; i < N; off += sizes[i++])
    ck_assert_int_eq(((unsigned char *)a.ptr)[off + sizes[i] - 1], i + 1);
  ck_assert_uint_eq(a.bytes, off);
  ((char *)a.ptr)[sizes[0]] = 99; /* the first byte of chunk 1 */
  char *mine = mmap(NULL, sizes[1], PROT_READ, MAP_SHARED, fds[1], 0);
  ck_assert_int_eq(mine[0], 99);
  munmap(mine, sizes[1]);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.arenas, N);
  ck_assert_uint_eq(st.session.arena_bytes, off);
  ck_assert_int_eq(mok_arena_destroy(c, a.id), 0);
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.arenas, 0);
  ck_assert_int_eq(mok_arena_import_chunks(c, fds, sizes, 0, &a), MOK_EINVAL);
  sizes[3] = 1000; /* chunk 4 would begin inside a page */
  ck_assert_int_eq(mok_arena_import_chunks(c, fds, sizes, N, &a), MOK_EINVAL);
  ck_assert_msg(strstr(mok_last_error(c), "not at a page boundary") != NULL, "%s",
                mok_last_error(c));
  ck_assert_int_eq(mok_stats_get(c, &st), 0);
  ck_assert_uint_eq(st.session.arenas, 0);
  for (int i = 0; i < N; i++)
    close(fds[i]);
  mok_close(c);
}
END_TEST

/* Malformed frames of a chunked import are refused with what was wrong, and
 * leave nothing behind. */
START_TEST(chunked_import_bad_frames)
{
  const Mokd__ImportKind MEMFD = MOKD__IMPORT_KIND__IMPORT_MEMFD;
  int fd = raw_connect(), f[9], pipefd[2];
  uint64_t four[9] = {4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096};
  for (int i = 0; i < 9; i++)
    f[i] = chunk_fd(4096, 1, -1);
  hello(fd);

  chunk_frame(fd, 2, MOKD__IMPORT_KIND__IMPORT_CUDA_IPC, 8192, 0, four, 2, f, 2);
  expect_status(fd, MOK_EINVAL, "takes kind IMPORT_MEMFD or IMPORT_CUMEM_FD, not 1");
  chunk_frame(fd, 3, MEMFD, 9 * 4096, 0, four, 9, f, 8);
  expect_status(fd, MOK_EINVAL, "9 chunks on one frame; a frame carries at most 8 fds");
  chunk_frame(fd, 4, MEMFD, 8192, 0, four, 2, f, 1);
  expect_status(fd, MOK_EINVAL, "ImportBuffer needs exactly 2 fds (SCM_RIGHTS)");
  chunk_frame(fd, 5, MEMFD, 8192, 0, four, 1, f, 2);
  expect_status(fd, MOK_EINVAL, "ImportBuffer takes exactly one fd (SCM_RIGHTS) on its frame; "
                "2 came");
  chunk_frame(fd, 6, MEMFD, 4096, 0, four, 2, f, 2); /* 8192 bytes of chunks for 4096 */
  expect_status(fd, MOK_ERANGE, "the chunks add up to more than the 4096 bytes of the import");
  uint64_t zero[2] = {4096, 0};
  chunk_frame(fd, 7, MEMFD, 8192, 0, zero, 2, f, 2);
  expect_status(fd, MOK_EZEROSIZE, "chunk 1 of the import has size 0");
  uint64_t odd[2] = {100, 4096};
  chunk_frame(fd, 8, MEMFD, 4196, 0, odd, 2, f, 2);
  expect_status(fd, MOK_EINVAL, "not at a page boundary");
  uint64_t big[2] = {4096, 8192}; /* more than the second fd holds */
  chunk_frame(fd, 9, MEMFD, 12288, 0, big, 2, f, 2);
  expect_status(fd, MOK_ERANGE, "the fd holds 4096 bytes, fewer than the 8192 named");
  ck_assert_int_eq(pipe(pipefd), 0);
  int wrong[2] = {f[0], pipefd[0]};
  chunk_frame(fd, 10, MEMFD, 8192, 0, four, 2, wrong, 2);
  expect_status(fd, MOK_EINVAL, "is not a memfd or regular file");
  int unsealed = chunk_fd(4096, 0, -1), loose[2] = {f[0], unsealed};
  chunk_frame(fd, 11, MEMFD, 8192, 0, four, 2, loose, 2);
  expect_status(fd, MOK_EINVAL, "F_SEAL_SHRINK");
  chunk_frame(fd, 12, MOKD__IMPORT_KIND__IMPORT_CUMEM_FD, 8192, 0, four, 2, f, 2);
  expect_status(fd, MOK_ENOTSUP, "it imports GPU memory only on the cuda backend");
  chunk_frame(fd, 13, MEMFD, 8192, 12345, four, 2, f, 2);
  expect_status(fd, MOK_ENOENT, "no import 12345 waits for chunks in this session");
  chunk_frame(fd, 14, MEMFD, 8192, 12345, four, 0, NULL, 0);
  expect_status(fd, MOK_EINVAL, "brings no chunks");
  session_holds(fd, 0, 0);

  /* begun, then interrupted: by another request, by a frame that lies about
   * the size, by a chunk that does not fit; each drops the import whole */
  chunk_frame(fd, 20, MEMFD, 16 * 4096, 0, four, 8, f, 8);
  uint64_t id = chunk_taken(fd, 1);
  session_holds(fd, 0, 0); /* the Stats request dropped it */
  chunk_frame(fd, 21, MEMFD, 16 * 4096, id, four, 8, f, 8);
  expect_status(fd, MOK_ENOENT, "an error, or another request in between, drops it");
  chunk_frame(fd, 22, MEMFD, 16 * 4096, 0, four, 8, f, 8);
  id = chunk_taken(fd, 1);
  chunk_frame(fd, 23, MEMFD, 15 * 4096, id, four, 8, f, 8);
  expect_status(fd, MOK_EINVAL, "the import continued names 61440 bytes; it began with 65536");
  chunk_frame(fd, 24, MEMFD, 12 * 4096, 0, four, 8, f, 8);
  id = chunk_taken(fd, 1);
  chunk_frame(fd, 25, MEMFD, 12 * 4096, id, four, 5, f, 5);
  expect_status(fd, MOK_ERANGE, "chunk 12 of 4096 bytes begins at 49152");
  chunk_frame(fd, 26, MEMFD, 12 * 4096, id, four, 4, f, 4);
  expect_status(fd, MOK_ENOENT, "no import");
  session_holds(fd, 0, 0);
  /* and a whole one after all that */
  chunk_frame(fd, 27, MEMFD, 10 * 4096, 0, four, 8, f, 8);
  id = chunk_taken(fd, 1);
  chunk_frame(fd, 28, MEMFD, 10 * 4096, id, four, 2, f, 2);
  ck_assert_uint_eq(chunk_taken(fd, 0), id);
  session_holds(fd, 10, 10 * 4096);

  for (int i = 0; i < 9; i++)
    close(f[i]);
  close(unsealed);
  close(pipefd[0]), close(pipefd[1]);
  close(fd);
  still_serving();
}
END_TEST

/* A session of protocol 2 never sent chunks; an older daemon would not know
 * the fields: libmok says so before sending. */
START_TEST(chunked_import_needs_protocol_3)
{
  int fd = raw_connect(), f[2] = {chunk_fd(4096, 1, -1), chunk_fd(4096, 1, -1)};
  uint64_t sizes[2] = {4096, 4096};
  Mokd__Response *r = hello_range(fd, 2, 1, 2);
  ck_assert_uint_eq(r->welcome->protocol_version, 2);
  mokd__response__free_unpacked(r, NULL);
  chunk_frame(fd, 2, MOKD__IMPORT_KIND__IMPORT_MEMFD, 8192, 0, sizes, 2, f, 2);
  expect_status(fd, MOK_EPROTO, "an ImportBuffer of several chunks needs protocol 3; this "
                "session chose 2 at Hello (upgrade the client)");
  close(fd);
  close(f[0]), close(f[1]);
}
END_TEST

Suite *daemon_wire_suite(void)
{
  Suite *s = suite_create("daemon_wire");
  TCase *tc = tcase_create("bad_input");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, garbage_bytes);
  tcase_add_test(tc, oversize_length_prefix);
  tcase_add_test(tc, unknown_body_and_no_body);
  tcase_add_test(tc, unknown_field_zero_is_refused);
  tcase_add_test(tc, hello_comes_first);
  tcase_add_test(tc, protocol_versions_are_negotiated);
  tcase_add_test(tc, valid_raw_forward_runs);
  tcase_add_test(tc, wrong_dtype_is_refused);
  tcase_add_test(tc, offset_out_of_range_is_refused);
  tcase_add_test(tc, another_sessions_arena_is_refused);
  tcase_add_test(tc, fd_where_none_is_expected);
  tcase_add_test(tc, too_many_fds_are_answered);
  tcase_add_test(tc, import_and_errors_through_libmok);
  tcase_add_test(tc, chunked_import_through_libmok);
  tcase_add_test(tc, chunked_import_bad_frames);
  tcase_add_test(tc, chunked_import_needs_protocol_3);
  tcase_add_test(tc, busy_arena_counts_contexts);
  tcase_add_test(tc, import_cuda_bad_sizes_are_refused);
  tcase_add_test(tc, device_on_cpu_backend_is_refused);
  tcase_add_test(tc, bad_gpu_uuid_is_refused);
  tcase_add_test(tc, hello_range_job_and_uuid_together);
  tcase_add_test(tc, client_name_is_logged_escaped);
  suite_add_tcase(s, tc);
  return s;
}
