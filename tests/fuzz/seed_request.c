/* seed_request.c - writes the seed corpus of fuzz_request.c (its input
 * format is described there) into the folder named on the command line:
 * sessions that reach every request body, a whole forward and backward, the
 * fds that go wrong and a client that hangs up mid-step. `make fuzz-seeds`
 * runs it; the seeds are committed in tests/fuzz/corpus/request. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "mok.h"
#include "proto/mokd.pb-c.h"

enum { SEALED_4K = 0, SEALED_16K = 1, UNSEALED = 4, PIPE = 5, DEVNULL = 6 };

typedef struct seed {
  uint8_t buf[1 << 16];
  size_t len;
  uint64_t id;
} seed;

static void bytes(seed *s, const void *p, size_t n)
{
  if (s->len + n > sizeof s->buf)
    abort();
  memcpy(s->buf + s->len, p, n);
  s->len += n;
}

/* One chunk: ctl, the fd kinds, then the payload. */
static void chunk(seed *s, uint8_t ctl, const uint8_t *kinds, const void *p, size_t n)
{
  uint8_t len[2] = {(uint8_t)n, (uint8_t)(n >> 8)};
  bytes(s, &ctl, 1);
  bytes(s, kinds, ctl & 15);
  bytes(s, len, 2);
  bytes(s, p, n);
}

/* A request with the next id, as one chunk. */
static void request(seed *s, Mokd__Request *q, uint8_t ctl, const uint8_t *kinds)
{
  uint8_t *frame;
  size_t n;
  q->id = ++s->id;
  if (mokw_pack(&q->base, &frame, &n) != 0)
    abort();
  chunk(s, ctl, kinds, frame, n);
  free(frame);
}

static void hello(seed *s)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  h.protocol_version = MOK_PROTOCOL_VERSION;
  h.client_name = "seed";
  q.body_case = MOKD__REQUEST__BODY_HELLO, q.hello = &h;
  request(s, &q, 0, NULL);
}

static void ping(seed *s, uint8_t ctl, const uint8_t *kinds)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Ping p = MOKD__PING__INIT;
  p.nonce = 7;
  q.body_case = MOKD__REQUEST__BODY_PING, q.ping = &p;
  request(s, &q, ctl, kinds);
}

static void create_arena(seed *s, uint64_t bytes)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__CreateArena c = MOKD__CREATE_ARENA__INIT;
  c.bytes = bytes;
  q.body_case = MOKD__REQUEST__BODY_CREATE_ARENA, q.create_arena = &c;
  request(s, &q, 0, NULL);
}

static void import(seed *s, uint64_t bytes, int nfds, const uint8_t *kinds)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__ImportBuffer ib = MOKD__IMPORT_BUFFER__INIT;
  ib.kind = MOKD__IMPORT_KIND__IMPORT_MEMFD, ib.bytes = bytes;
  q.body_case = MOKD__REQUEST__BODY_IMPORT_BUFFER, q.import_buffer = &ib;
  request(s, &q, (uint8_t)nfds, kinds);
}

/* One frame of an import made of several allocations, its fds one a chunk. */
static void import_chunks(seed *s, uint64_t bytes, uint64_t continues, uint64_t *sizes, int n,
                          const uint8_t *kinds)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__ImportBuffer ib = MOKD__IMPORT_BUFFER__INIT;
  ib.kind = MOKD__IMPORT_KIND__IMPORT_MEMFD, ib.bytes = bytes, ib.continues = continues;
  ib.chunk_bytes = sizes, ib.n_chunk_bytes = (size_t)n;
  q.body_case = MOKD__REQUEST__BODY_IMPORT_BUFFER, q.import_buffer = &ib;
  request(s, &q, (uint8_t)n, kinds);
}

static void destroy_arena(seed *s, uint64_t arena)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__DestroyArena d = MOKD__DESTROY_ARENA__INIT;
  d.arena = arena;
  q.body_case = MOKD__REQUEST__BODY_DESTROY_ARENA, q.destroy_arena = &d;
  request(s, &q, 0, NULL);
}

static Mokd__TensorRef ref(uint64_t arena, uint64_t off, Mokd__DType dt, int nd, int64_t *sh)
{
  Mokd__TensorRef t = MOKD__TENSOR_REF__INIT;
  t.arena = arena, t.offset = off, t.dtype = dt, t.n_shape = (size_t)nd, t.shape = sh;
  return t;
}

/* Arena 2 of 16 KiB, layer 3 (H = I = 8, E = 2, K = 1, shared I_s = 8) with
 * its weights in arena 2. The arena is zeroes: every token goes to expert 0. */
static void layer_with_weights(seed *s, Mokd__GradMode mode)
{
  static int64_t we[3] = {2, 8, 8}, ws[2] = {8, 8};
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__CreateLayer cl = MOKD__CREATE_LAYER__INIT;
  Mokd__SetWeights sw = MOKD__SET_WEIGHTS__INIT;
  Mokd__TensorRef w[6];

  create_arena(s, 16384);
  cl.hidden = 8, cl.intermediate = 8, cl.experts = 2, cl.top_k = 1;
  cl.shared_intermediate = 8, cl.grad_mode = mode;
  q.body_case = MOKD__REQUEST__BODY_CREATE_LAYER, q.create_layer = &cl;
  request(s, &q, 0, NULL);
  for (int i = 0; i < 3; i++)
    w[i] = ref(2, (uint64_t)i * 256, MOKD__DTYPE__DTYPE_BF16, 3, we);
  for (int i = 3; i < 6; i++)
    w[i] = ref(2, 768 + (uint64_t)(i - 3) * 128, MOKD__DTYPE__DTYPE_BF16, 2, ws);
  sw.layer = 3, sw.w_gate = &w[0], sw.w_up = &w[1], sw.w_down = &w[2];
  sw.s_gate = &w[3], sw.s_up = &w[4], sw.s_down = &w[5];
  q = (Mokd__Request)MOKD__REQUEST__INIT;
  q.body_case = MOKD__REQUEST__BODY_SET_WEIGHTS, q.set_weights = &sw;
  request(s, &q, 0, NULL);
}

/* Forward of 4 tokens: context 4, its outputs in arena 5. */
static void forward(seed *s, int inference, uint8_t ctl)
{
  static int64_t sx[2] = {4, 8}, sk[2] = {4, 1};
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Forward f = MOKD__FORWARD__INIT;
  Mokd__TensorRef x = ref(2, 2048, MOKD__DTYPE__DTYPE_BF16, 2, sx);
  Mokd__TensorRef ids = ref(2, 2304, MOKD__DTYPE__DTYPE_I32, 2, sk);
  Mokd__TensorRef tw = ref(2, 2368, MOKD__DTYPE__DTYPE_F32, 2, sk);
  f.layer = 3, f.x = &x, f.topk_ids = &ids, f.topk_weights = &tw, f.inference = inference;
  q.body_case = MOKD__REQUEST__BODY_FORWARD, q.forward = &f;
  request(s, &q, ctl, NULL);
}

/* Backward of context 4; fp32 gradients go to arena 2 when fp32 is set. */
static void backward(seed *s, int fp32)
{
  static int64_t sx[2] = {4, 8}, we[3] = {2, 8, 8}, ws[2] = {8, 8};
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Backward b = MOKD__BACKWARD__INIT;
  Mokd__TensorRef d = ref(2, 2048, MOKD__DTYPE__DTYPE_BF16, 2, sx), g[6], *gp[6];
  for (int i = 0; i < 6; i++) {
    g[i] = i < 3 ? ref(2, 4096 + (uint64_t)i * 512, MOKD__DTYPE__DTYPE_F32, 3, we)
                 : ref(2, 6144 + (uint64_t)(i - 3) * 256, MOKD__DTYPE__DTYPE_F32, 2, ws);
    gp[i] = &g[i];
  }
  b.context = 4, b.d_out = &d;
  if (fp32)
    b.n_grads = 6, b.grads = gp;
  q.body_case = MOKD__REQUEST__BODY_BACKWARD, q.backward = &b;
  request(s, &q, 0, NULL);
}

static void release(seed *s, uint64_t *ids, size_t n)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Release r = MOKD__RELEASE__INIT;
  r.n_ids = n, r.ids = ids;
  q.body_case = MOKD__REQUEST__BODY_RELEASE, q.release = &r;
  request(s, &q, 0, NULL);
}

static void small_request(seed *s, Mokd__Request__BodyCase body)
{
  Mokd__Request q = MOKD__REQUEST__INIT;
  Mokd__Stats e = MOKD__STATS__INIT;
  Mokd__DestroyLayer dl = MOKD__DESTROY_LAYER__INIT;
  q.body_case = body;
  if (body == MOKD__REQUEST__BODY_STATS)
    q.stats = &e;
  else
    dl.layer = 3, q.destroy_layer = &dl;
  request(s, &q, 0, NULL);
}

static void save(const char *dir, const char *name, const seed *s)
{
  char path[512];
  FILE *f;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  if ((f = fopen(path, "wb")) == NULL || fwrite(s->buf, 1, s->len, f) != s->len ||
      fclose(f) != 0) {
    perror(path);
    exit(1);
  }
}

int main(int argc, char **argv)
{
  static const uint8_t sealed[1] = {SEALED_4K}, two[2] = {SEALED_4K, SEALED_16K},
                       ten[10] = {DEVNULL, DEVNULL, PIPE, PIPE, UNSEALED, SEALED_4K, DEVNULL,
                                  DEVNULL, PIPE, SEALED_16K},
                       pipe1[1] = {PIPE}, unsealed[1] = {UNSEALED};
  uint64_t both[2] = {4, 6}, twice[2] = {4, 4}, unknown[1] = {99};
  seed s;

  if (argc != 2) {
    fprintf(stderr, "usage: seed_request DIR\n");
    return 2;
  }
  memset(&s, 0, sizeof s), hello(&s);
  save(argv[1], "hello", &s);

  memset(&s, 0, sizeof s), hello(&s), ping(&s, 0, NULL);
  small_request(&s, MOKD__REQUEST__BODY_STATS);
  save(argv[1], "ping_stats", &s);

  memset(&s, 0, sizeof s), hello(&s), create_arena(&s, 8192), import(&s, 4096, 1, sealed);
  import(&s, 4096, 1, unsealed), destroy_arena(&s, 3), destroy_arena(&s, 2);
  save(argv[1], "arenas_and_imports", &s);

  memset(&s, 0, sizeof s), hello(&s), layer_with_weights(&s, MOKD__GRAD_MODE__GRAD_BF16);
  forward(&s, 0, 0), backward(&s, 0), release(&s, both, 2);
  small_request(&s, MOKD__REQUEST__BODY_DESTROY_LAYER);
  save(argv[1], "forward_backward_release", &s);

  memset(&s, 0, sizeof s), hello(&s), layer_with_weights(&s, MOKD__GRAD_MODE__GRAD_FP32_ACCUM);
  forward(&s, 0, 0), small_request(&s, MOKD__REQUEST__BODY_DESTROY_LAYER), backward(&s, 1);
  release(&s, twice, 2), release(&s, unknown, 1), destroy_arena(&s, 2);
  save(argv[1], "fp32_accumulate_after_destroy", &s);

  memset(&s, 0, sizeof s), hello(&s), layer_with_weights(&s, MOKD__GRAD_MODE__GRAD_BF16);
  forward(&s, 1, 0), forward(&s, 0, 0x80);
  save(argv[1], "hang_up_during_a_forward", &s);

  memset(&s, 0, sizeof s), hello(&s), import(&s, 4096, 2, two), ping(&s, 10, ten);
  ping(&s, 1, pipe1), import(&s, 4096, 0, NULL);
  save(argv[1], "fds_that_go_wrong", &s);

  {
    /* arena 2 in two frames of two chunks; import 3 interrupted by a ping;
     * chunks that do not add up; fds of the wrong kinds */
    static const uint8_t four[4] = {SEALED_4K, SEALED_4K, SEALED_16K, SEALED_4K},
                         bad[2] = {PIPE, UNSEALED};
    uint64_t pages[4] = {4096, 4096, 4096, 4096}, over[2] = {4096, 16384};
    memset(&s, 0, sizeof s), hello(&s);
    import_chunks(&s, 16384, 0, pages, 2, four), import_chunks(&s, 16384, 2, pages, 2, four);
    import_chunks(&s, 32768, 0, pages, 4, four), ping(&s, 0, NULL);
    import_chunks(&s, 32768, 3, pages, 4, four), import_chunks(&s, 8192, 0, over, 2, four);
    import_chunks(&s, 8192, 0, pages, 2, bad), destroy_arena(&s, 2);
    save(argv[1], "chunked_imports", &s);
  }

  memset(&s, 0, sizeof s);
  ping(&s, 0, NULL); /* before Hello */
  hello(&s);
  for (int i = 0; i < 50; i++)
    ping(&s, 0, NULL);
  save(argv[1], "many_pings", &s);

  {
    /* a frame of garbage, one with field 0, then a length prefix over the cap */
    static const uint8_t junk[] = {8, 0, 0, 0, 0xff, 0xfe, 0xfd, 0xfc, 0xfb, 0xfa, 0xf9, 0xf8};
    static const uint8_t field0[] = {10, 0, 0, 0, 0x08, 0x09, 0xaa, 0x01, 0x05,
                                     0x08, 0x02, 0x80, 0x00, 0x01};
    static const uint8_t big[] = {0x00, 0x00, 0x00, 0x40};
    memset(&s, 0, sizeof s), hello(&s);
    chunk(&s, 0, NULL, junk, sizeof junk);
    chunk(&s, 0, NULL, field0, sizeof field0);
    chunk(&s, 0, NULL, big, sizeof big);
    save(argv[1], "garbage_field0_oversize", &s);
  }
  return 0;
}
