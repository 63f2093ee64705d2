/* mok.c - libmok: a blocking client of mokd. One request in flight per
 * client; every reply is matched to its request id. Arenas the daemon shares
 * (created ones, and output arenas announced in replies) are mapped here as
 * they arrive and stay mapped until mok_close. */
#include "mok.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "cudamap.h"
#include "fdpass.h"
#include "frame.h"
#include "impcache.h"
#include "paths.h"
#include "proto/mokd.pb-c.h"

/* public enums travel on the wire by value */
_Static_assert(MOK_DTYPE_BF16 == (int)MOKD__DTYPE__DTYPE_BF16 &&
                   MOK_DTYPE_F32 == (int)MOKD__DTYPE__DTYPE_F32 &&
                   MOK_DTYPE_I32 == (int)MOKD__DTYPE__DTYPE_I32,
               "mok_dtype and the wire's DType differ");
_Static_assert(MOK_UUID_STRLEN == MOKW_UUID_STRLEN, "GPU UUID texts differ in size");
_Static_assert(MOK_GRAD_BF16 == (int)MOKD__GRAD_MODE__GRAD_BF16 &&
                   MOK_GRAD_FP32_ACCUM == (int)MOKD__GRAD_MODE__GRAD_FP32_ACCUM,
               "mok_grad_mode and the wire's GradMode differ");

typedef struct mapped {
  uint64_t id;
  void *ptr;
  size_t bytes;
  int device;                /* CUDA ordinal of a GPU arena; -1 = host */
  unsigned long long handle; /* GPU arenas: the imported allocation */
  int own;                   /* our own GPU memory, imported into the daemon: not ours to unmap */
} mapped;

/* An arena the daemon reads through a reference it does not count, so it
 * would let the arena go under it: a layer's weights (until the layer goes
 * or takes others) and a forward context's inputs (until it is released).
 * The import cache destroys none of these. */
typedef struct held {
  uint64_t owner; /* a layer or a context */
  uint64_t arena;
  int layer;
} held;

struct mok_client {
  int fd;
  uint64_t next_id;
  mokw_framer rx;
  char err[MOK_ERRLEN];
  mok_welcome info;
  mapped *maps;
  int nmaps, capmaps;
  int fds[16];
  int nfds;
  /* The session's GPU: the daemon's ordinal for it (-1: the cpu backend),
   * and this process's, which CUDA calls here take (-1: not visible here,
   * gpu_why says why); they differ wherever CUDA_VISIBLE_DEVICES does. */
  int daemon_gpu;
  int gpu;
  char gpu_why[200];
  void *stream;         /* mok_set_stream; NULL = wait on the host */
  void *ready;          /* our interprocess event, recorded before each step */
  uint8_t ready_handle[MOKW_IPC_BYTES];
  void *done;           /* the daemon's done event, opened once */
  uint8_t done_handle[MOKW_IPC_BYTES];
  mok_imp *imps;
  int nimps, capimps;
  /* requests sent that may carry tensors (all but imports, destroys and
   * pings): an arena handed out before the last of them is not about to be
   * sent, so the cache may let it go */
  uint64_t epoch;
  held *held;
  int nheld, capheld;
};

static int fail(mok_client *c, int code, const char *fmt, ...)
{
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err, sizeof c->err, fmt, ap);
  va_end(ap);
  return code;
}

const char *mok_last_error(const mok_client *c)
{
  return c != NULL ? c->err : "no client";
}

const mok_welcome *mok_server_info(const mok_client *c)
{
  return &c->info;
}

static uint64_t now_ns(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Room for one more element in a growing array. */
static int grow(mok_client *c, void **arr, int n, int *cap, size_t size)
{
  if (n < *cap)
    return 0;
  int nc = *cap ? 2 * *cap : 8;
  void *p = realloc(*arr, (size_t)nc * size);
  if (p == NULL)
    return fail(c, MOK_ENOMEM, "out of memory");
  *arr = p, *cap = nc;
  return 0;
}

/* Room for k more held arenas, made before the request that holds them so
 * that a step the daemon took is never reported failed for want of it. */
static int hold_room(mok_client *c, int k)
{
  while (c->capheld - c->nheld < k)
    if (grow(c, (void **)&c->held, c->capheld, &c->capheld, sizeof *c->held) != 0)
      return MOK_ENOMEM;
  return 0;
}

static void hold(mok_client *c, int layer, uint64_t owner, uint64_t arena)
{
  c->held[c->nheld++] = (held){owner, arena, layer};
}

static void unhold(mok_client *c, int layer, uint64_t owner)
{
  for (int i = c->nheld - 1; i >= 0; i--)
    if (c->held[i].layer == layer && c->held[i].owner == owner)
      c->held[i] = c->held[--c->nheld];
}

static int cmp_u64(const void *a, const void *b)
{
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* unhold for the contexts ids, in one pass over the list with the ids
 * sorted: releasing n contexts of n holds costs n log n, not n^2 (60000 of
 * them took 7 s). One at a time where memory is short. */
static void unhold_contexts(mok_client *c, const uint64_t *ids, int n)
{
  uint64_t *sorted = n > 1 ? malloc((size_t)n * sizeof *sorted) : NULL;

  if (sorted == NULL) {
    for (int i = 0; i < n; i++)
      unhold(c, 0, ids[i]);
    return;
  }
  memcpy(sorted, ids, (size_t)n * sizeof *sorted);
  qsort(sorted, (size_t)n, sizeof *sorted, cmp_u64);
  for (int i = c->nheld - 1; i >= 0; i--)
    if (!c->held[i].layer &&
        bsearch(&c->held[i].owner, sorted, (size_t)n, sizeof *sorted, cmp_u64) != NULL)
      c->held[i] = c->held[--c->nheld];
  free(sorted);
}

static int is_held(const mok_client *c, uint64_t arena)
{
  for (int i = 0; i < c->nheld; i++)
    if (c->held[i].arena == arena)
      return 1;
  return 0;
}

/* The session's GPU as this process numbers it, for a CUDA call here. */
static int local_gpu(mok_client *c, int *device)
{
  if (c->gpu < 0)
    return fail(c, MOK_EDEVICE, "this session's GPU cannot be used in this process: %s",
                c->gpu_why);
  *device = c->gpu;
  return 0;
}

/* daemon_device: where the daemon says the arena is, in its own numbering. */
static int add_map(mok_client *c, uint64_t id, int fd, size_t bytes, int daemon_device)
{
  unsigned long long handle = 0;
  char why[200];
  int device = -1, rc;
  void *p;
  if (grow(c, (void **)&c->maps, c->nmaps, &c->capmaps, sizeof *c->maps) != 0)
    return MOK_ENOMEM;
  if (daemon_device >= 0 && daemon_device != c->daemon_gpu)
    return fail(c, MOK_EPROTO, "mokd shared arena %llu on its CUDA device %d, but this "
                "session runs on its device %d", (unsigned long long)id, daemon_device,
                c->daemon_gpu);
  if (daemon_device >= 0 && (rc = local_gpu(c, &device)) != 0)
    return rc;
  if (device >= 0) {
    if (mok_cuda_map(fd, bytes, device, &p, &handle, why, sizeof why) != 0)
      return fail(c, MOK_EDEVICE, "cannot map GPU arena %llu (%zu bytes): %s",
                  (unsigned long long)id, bytes, why);
  } else {
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      return fail(c, MOK_ENOMEM, "cannot map arena %llu (%zu bytes): %s",
                  (unsigned long long)id, bytes, strerror(errno));
  }
  c->maps[c->nmaps++] = (mapped){id, p, bytes, device, handle, 0};
  return 0;
}

static void unmap(const mapped *m)
{
  if (m->own)
    return;
  if (m->device >= 0)
    mok_cuda_unmap(m->ptr, m->bytes, m->handle);
  else
    munmap(m->ptr, m->bytes);
}

static mapped *find_map(const mok_client *c, uint64_t id)
{
  for (int i = 0; i < c->nmaps; i++)
    if (c->maps[i].id == id)
      return &c->maps[i];
  return NULL;
}

static void drop_fds(mok_client *c)
{
  for (int i = 0; i < c->nfds; i++)
    close(c->fds[i]);
  c->nfds = 0;
}

static int send_frame(mok_client *c, const Mokd__Request *req, const int *fds, int nfds)
{
  uint8_t *buf;
  size_t len, off = 0;
  int rc = mokw_pack(&req->base, &buf, &len);

  if (rc != 0)
    return fail(c, rc, "cannot pack the request");
  while (off < len) {
    /* the fds ride on the frame's first byte */
    ssize_t n = mokw_send(c->fd, buf + off, len - off, fds, off == 0 ? nfds : 0, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      free(buf);
      return fail(c, MOK_ECONNRESET, "sending to mokd failed: %s", strerror(errno));
    }
    off += (size_t)n;
  }
  free(buf);
  return 0;
}

static int recv_frame(mok_client *c, Mokd__Response **out)
{
  for (;;) {
    const uint8_t *payload;
    size_t len, avail;
    int rc = mokw_framer_next(&c->rx, &payload, &len, NULL);
    if (rc == 1) {
      *out = mokd__response__unpack(NULL, len, payload);
      return *out != NULL ? 0 : fail(c, MOK_EPROTO, "mokd sent a reply that does not parse");
    }
    if (rc < 0)
      return fail(c, MOK_EPROTO, "mokd sent a bad frame (%s)", mok_strerror(rc));
    uint8_t *dst = mokw_framer_space(&c->rx, 65536, &avail);
    if (dst == NULL)
      return fail(c, MOK_ENOMEM, "out of memory");
    int got = (int)(sizeof c->fds / sizeof c->fds[0]) - c->nfds;
    ssize_t n = mokw_recv(c->fd, dst, avail, 0, c->fds + c->nfds, &got, NULL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return fail(c, MOK_ECONNRESET, "reading from mokd failed: %s", strerror(errno));
    c->nfds += got;
    if (n == 0)
      return fail(c, MOK_ECONNRESET, "mokd closed the connection");
    mokw_framer_commit(&c->rx, (size_t)n);
  }
}

/* Sends req and waits for its reply; maps the arenas the reply announces. */
/* The daemon closed the connection (an evict, a framing error): it said why
 * in a last frame, which is still there to read. */
static int closed_why(mok_client *c, int rc)
{
  char sent[sizeof c->err];
  Mokd__Response *r;

  memcpy(sent, c->err, sizeof sent);
  if (recv_frame(c, &r) != 0) {
    memcpy(c->err, sent, sizeof sent);
    return rc;
  }
  if (r->status != 0)
    rc = fail(c, r->status, "mokd closed the connection: %s", r->message != NULL ? r->message
                                                                                 : "");
  else
    memcpy(c->err, sent, sizeof sent);
  mokd__response__free_unpacked(r, NULL);
  drop_fds(c);
  return rc;
}

static int call(mok_client *c, Mokd__Request *req, const int *fds, int nfds,
                Mokd__Response **out)
{
  Mokd__Response *r;
  int rc, next = 0;

  *out = NULL;
  c->err[0] = 0;
  req->id = ++c->next_id;
  if ((rc = send_frame(c, req, fds, nfds)) != 0)
    return rc == MOK_ECONNRESET ? closed_why(c, rc) : rc;
  if ((rc = recv_frame(c, &r)) != 0)
    return rc;
  if (r->id != req->id && r->status == 0) {
    mokd__response__free_unpacked(r, NULL);
    drop_fds(c);
    return fail(c, MOK_EPROTO, "reply for request %llu while waiting for %llu",
                (unsigned long long)r->id, (unsigned long long)req->id);
  }
  if (r->status != 0) {
    rc = fail(c, r->status, "%s", r->message != NULL && r->message[0] ? r->message
                                                                       : mok_strerror(r->status));
    mokd__response__free_unpacked(r, NULL);
    drop_fds(c);
    return rc;
  }
  if (r->body_case == MOKD__RESPONSE__BODY_ARENA_CREATED)
    next = 1; /* fds[0] is the new arena itself */
  for (size_t i = 0; i < r->n_new_arenas; i++) {
    if (next >= c->nfds) {
      rc = fail(c, MOK_EPROTO, "mokd announced arena %llu without its fd",
                (unsigned long long)r->new_arenas[i]->arena);
      break;
    }
    /* the wire's device is the CUDA ordinal + 1, 0 = host */
    if ((rc = add_map(c, r->new_arenas[i]->arena, c->fds[next++],
                      (size_t)r->new_arenas[i]->bytes, r->new_arenas[i]->device - 1)) != 0)
      break;
  }
  if (rc == 0 && r->body_case == MOKD__RESPONSE__BODY_ARENA_CREATED) {
    if (c->nfds < 1)
      rc = fail(c, MOK_EPROTO, "ArenaCreated came without its fd");
    else
      rc = add_map(c, r->arena_created->arena, c->fds[0], (size_t)r->arena_created->bytes,
                   r->arena_created->device - 1);
  }
  drop_fds(c);
  if (rc != 0) {
    mokd__response__free_unpacked(r, NULL);
    return rc;
  }
  *out = r;
  return 0;
}

int mok_connect(const char *path, const char *client_name, mok_client **out)
{
  return mok_connect_device(path, client_name, -1, out);
}

/* After Welcome: which of our CUDA devices is the session's GPU. asked: our
 * ordinal when we named the GPU, else -1. Not finding it is no error yet:
 * stats and pings need no GPU here, and what does says why it cannot run. */
static int find_local_gpu(mok_client *c, const Mokd__Welcome *w, int asked)
{
  uint8_t mine[MOKW_UUID_BYTES];
  char why[200];
  if (w->session_device_uuid.len != MOKW_UUID_BYTES)
    return fail(c, MOK_EPROTO, "mokd placed the session on its CUDA device %d without "
                "saying the GPU's UUID", c->daemon_gpu);
  mokw_uuid_format(w->session_device_uuid.data, c->info.device_uuid);
  c->info.daemon_device = c->daemon_gpu;
  if (asked >= 0) {
    if (mok_cuda_uuid(asked, mine, why, sizeof why) != 0 ||
        memcmp(mine, w->session_device_uuid.data, MOKW_UUID_BYTES) != 0)
      return fail(c, MOK_EPROTO, "mokd placed the session on %s, not on CUDA device %d of "
                  "this process", c->info.device_uuid, asked);
    c->gpu = asked;
  } else if (mok_cuda_find_uuid(w->session_device_uuid.data, &c->gpu, why, sizeof why) != 0) {
    c->gpu = -1;
    snprintf(c->gpu_why, sizeof c->gpu_why, "%s", why);
  }
  c->info.device = c->gpu;
  return 0;
}

/* Hello, naming the GPU by device (our ordinal, -1 = any) or by uuid_text. */
static int connect_on(const char *path, const char *client_name, int device,
                      const char *uuid_text, mok_client **out)
{
  char def[108], why[MOK_ERRLEN];
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  Mokd__Response *r;
  uint8_t uuid[MOKW_UUID_BYTES];
  mok_client *c;
  int rc;

  if (out == NULL)
    return MOK_ENULL;
  *out = NULL;
  if (path == NULL) {
    mok_default_socket(def, sizeof def);
    path = def;
  }
  if (strlen(path) >= sizeof sa.sun_path)
    return MOK_EINVAL;
  c = calloc(1, sizeof *c);
  if (c == NULL)
    return MOK_ENOMEM;
  mokw_framer_init(&c->rx, 64u << 20);
  c->fd = -1;
  c->daemon_gpu = c->gpu = c->info.device = c->info.daemon_device = -1;
  snprintf(c->gpu_why, sizeof c->gpu_why, "mokd runs no GPU for it");
  *out = c; /* from here on, so that mok_last_error can say why; mok_close frees it */
  /* the GPU is named by UUID: the daemon's ordinals are not ours */
  if (uuid_text != NULL && mokw_uuid_parse(uuid_text, uuid) != 0)
    return fail(c, MOK_EINVAL, "\"%s\" is not a GPU UUID; nvidia-smi -L prints them as "
                "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", uuid_text);
  if (uuid_text == NULL && device >= 0 && mok_cuda_uuid(device, uuid, why, sizeof why) != 0)
    return fail(c, MOK_EDEVICE, "cannot name CUDA device %d to mokd: %s", device, why);
  strcpy(sa.sun_path, path);
  c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    rc = errno == ENOENT || errno == ECONNREFUSED ? MOK_ENOENT : MOK_EIO;
    return fail(c, rc, "cannot connect to mokd at %s: %s (is the daemon running? --socket or "
                "MOKD_SOCKET pick another path)", path, strerror(errno));
  }
  /* anyone may bind the /tmp fallback first: talk only to our own daemon */
  if (mok_socket_is_tmp_fallback(path) &&
      (rc = mok_socket_peer_check(c->fd, geteuid(), path, why, sizeof why)) != 0)
    return fail(c, rc, "%s", why);
  h.protocol_version = MOK_PROTOCOL_VERSION;
  h.min_protocol = MOK_PROTOCOL_MIN;
  h.max_protocol = MOK_PROTOCOL_VERSION;
  h.job_id = getenv("MOKD_JOB_ID");
  if (h.job_id == NULL || h.job_id[0] == 0)
    h.job_id = getenv("SLURM_JOB_ID");
  if (h.job_id == NULL)
    h.job_id = (char *)"";
  h.client_name = (char *)(client_name != NULL ? client_name : "libmok");
  if (uuid_text != NULL || device >= 0) {
    h.device_uuid.data = uuid;
    h.device_uuid.len = sizeof uuid;
  }
  req.body_case = MOKD__REQUEST__BODY_HELLO;
  req.hello = &h;
  if ((rc = call(c, &req, NULL, 0, &r)) != 0)
    return rc;
  if (r->body_case != MOKD__RESPONSE__BODY_WELCOME) {
    mokd__response__free_unpacked(r, NULL);
    return fail(c, MOK_EPROTO, "mokd did not answer Hello with Welcome");
  }
  c->info.protocol_version = r->welcome->protocol_version;
  snprintf(c->info.daemon_version, sizeof c->info.daemon_version, "%s",
           r->welcome->daemon_version);
  snprintf(c->info.backend, sizeof c->info.backend, "%s", r->welcome->backend);
  c->info.session_id = r->welcome->session_id;
  c->info.ndevices = (int)r->welcome->n_devices;
  if (r->welcome->limits != NULL) {
    c->info.max_frame_bytes = r->welcome->limits->max_frame_bytes;
    c->info.max_arena_bytes = r->welcome->limits->max_arena_bytes;
    c->info.session_quota_bytes = r->welcome->limits->session_quota_bytes;
    c->info.session_gpu_quota_bytes = r->welcome->limits->session_gpu_quota_bytes;
  }
  rc = 0;
  if (strcmp(c->info.backend, "cuda") == 0 && r->welcome->session_device > 0) {
    c->daemon_gpu = r->welcome->session_device - 1;
    rc = find_local_gpu(c, r->welcome, uuid_text != NULL ? -1 : device);
  }
  mokd__response__free_unpacked(r, NULL);
  return rc;
}

int mok_connect_device(const char *path, const char *client_name, int device,
                       mok_client **out)
{
  return connect_on(path, client_name, device, NULL, out);
}

int mok_connect_uuid(const char *path, const char *client_name, const char *gpu_uuid,
                     mok_client **out)
{
  return connect_on(path, client_name, -1, gpu_uuid, out);
}

void mok_close(mok_client *c)
{
  if (c == NULL)
    return;
  if (c->fd >= 0)
    close(c->fd);
  for (int i = 0; i < c->nmaps; i++)
    unmap(&c->maps[i]);
  drop_fds(c);
  free(c->maps);
  for (int i = 0; i < c->nimps; i++)
    free(c->imps[i].chunks);
  free(c->imps);
  free(c->held);
  mok_cuda_event_free(c->ready);
  mok_cuda_event_free(c->done);
  mokw_framer_free(&c->rx);
  free(c);
}

/* A call that expects `body` back; frees the reply when out is NULL. */
static int expect(mok_client *c, Mokd__Request *req, const int *fds, int nfds,
                  Mokd__Response__BodyCase body, Mokd__Response **out)
{
  Mokd__Response *r;
  int rc;

  if (req->body_case != MOKD__REQUEST__BODY_IMPORT_BUFFER &&
      req->body_case != MOKD__REQUEST__BODY_DESTROY_ARENA &&
      req->body_case != MOKD__REQUEST__BODY_PING)
    c->epoch++;
  if ((rc = call(c, req, fds, nfds, &r)) != 0)
    return rc;
  if (r->body_case != body) {
    mokd__response__free_unpacked(r, NULL);
    return fail(c, MOK_EPROTO, "mokd answered with body %d, expected %d", (int)r->body_case,
                (int)body);
  }
  if (out != NULL)
    *out = r;
  else
    mokd__response__free_unpacked(r, NULL);
  return 0;
}

int mok_ping(mok_client *c, uint64_t *rtt_ns)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Ping p = MOKD__PING__INIT;
  Mokd__Response *r;
  uint64_t t0 = now_ns();
  int rc;

  p.nonce = t0;
  req.body_case = MOKD__REQUEST__BODY_PING;
  req.ping = &p;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_PONG, &r)) != 0)
    return rc;
  rc = r->pong->nonce == t0 ? 0 : fail(c, MOK_EPROTO, "pong carries the wrong nonce");
  mokd__response__free_unpacked(r, NULL);
  if (rtt_ns != NULL)
    *rtt_ns = now_ns() - t0;
  return rc;
}

static void usage_from(mok_usage *u, const Mokd__Usage *m)
{
  memset(u, 0, sizeof *u);
  if (m == NULL)
    return;
  u->sessions = m->sessions, u->arenas = m->arenas, u->arena_bytes = m->arena_bytes;
  u->layers = m->layers, u->contexts = m->contexts, u->context_bytes = m->context_bytes;
  u->results = m->results, u->requests = m->requests, u->forwards = m->forwards;
  u->backwards = m->backwards, u->errors = m->errors, u->gpu_bytes = m->gpu_bytes;
}

int mok_stats_get(mok_client *c, mok_stats *out)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Stats st = MOKD__STATS__INIT;
  Mokd__Response *r;
  int rc;

  req.body_case = MOKD__REQUEST__BODY_STATS;
  req.stats = &st;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_STATS, &r)) != 0)
    return rc;
  usage_from(&out->daemon, r->stats->daemon);
  usage_from(&out->session, r->stats->session);
  out->uptime_ns = r->stats->uptime_ns;
  snprintf(out->backend, sizeof out->backend, "%s", r->stats->backend);
  mokd__response__free_unpacked(r, NULL);
  return 0;
}

#define MOK_STR_(x) #x
#define MOK_STR(x) MOK_STR_(x)

const char *mok_version(int *major, int *minor, int *patch)
{
  if (major != NULL)
    *major = MOK_VERSION_MAJOR;
  if (minor != NULL)
    *minor = MOK_VERSION_MINOR;
  if (patch != NULL)
    *patch = MOK_VERSION_PATCH;
  return MOK_STR(MOK_VERSION_MAJOR) "." MOK_STR(MOK_VERSION_MINOR) "." MOK_STR(
      MOK_VERSION_PATCH);
}

/* Operator requests came with protocol 2: say so before asking an older daemon. */
static int needs_protocol(mok_client *c, uint32_t v, const char *what)
{
  if (c->info.protocol_version >= v)
    return 0;
  return fail(c, MOK_ENOTSUP, "%s needs protocol %u; mokd %s speaks %u (upgrade the daemon)",
              what, v, c->info.daemon_version, c->info.protocol_version);
}

int mok_sessions(mok_client *c, mok_session_info **out, size_t *n)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__ListSessions ls = MOKD__LIST_SESSIONS__INIT;
  Mokd__Response *r;
  mok_session_info *v;
  int rc;

  if (c == NULL || out == NULL || n == NULL)
    return MOK_ENULL;
  *out = NULL, *n = 0;
  if ((rc = needs_protocol(c, 2, "listing sessions")) != 0)
    return rc;
  req.body_case = MOKD__REQUEST__BODY_LIST_SESSIONS;
  req.list_sessions = &ls;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_SESSION_LIST, &r)) != 0)
    return rc;
  v = calloc(r->session_list->n_sessions + 1, sizeof *v);
  if (v == NULL) {
    mokd__response__free_unpacked(r, NULL);
    return fail(c, MOK_ENOMEM, "out of memory for %zu sessions", r->session_list->n_sessions);
  }
  for (size_t i = 0; i < r->session_list->n_sessions; i++) {
    const Mokd__SessionInfo *in = r->session_list->sessions[i];
    v[i].id = in->id, v[i].pid = in->pid, v[i].uid = in->uid, v[i].gid = in->gid;
    snprintf(v[i].client_name, sizeof v[i].client_name, "%s", in->client_name);
    snprintf(v[i].job_id, sizeof v[i].job_id, "%s", in->job_id);
    v[i].device = in->device - 1;
    v[i].arena_bytes = in->arena_bytes, v[i].context_bytes = in->context_bytes;
    v[i].gpu_bytes = in->gpu_bytes, v[i].contexts = in->contexts, v[i].layers = in->layers;
    v[i].requests = in->requests, v[i].age_ns = in->age_ns;
  }
  *n = r->session_list->n_sessions;
  *out = v;
  mokd__response__free_unpacked(r, NULL);
  return 0;
}

int mok_evict(mok_client *c, const char *job_id, uint64_t session, uint32_t *count)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Evict e = MOKD__EVICT__INIT;
  Mokd__Response *r;
  int rc;

  if (c == NULL)
    return MOK_ENULL;
  if ((rc = needs_protocol(c, 2, "evict")) != 0)
    return rc;
  e.job_id = (char *)(job_id != NULL ? job_id : "");
  e.session = session;
  req.body_case = MOKD__REQUEST__BODY_EVICT;
  req.evict = &e;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_EVICTED, &r)) != 0)
    return rc;
  if (count != NULL)
    *count = r->evicted->count;
  mokd__response__free_unpacked(r, NULL);
  return 0;
}

int mok_health(mok_client *c, int *ready, char *reason, size_t reason_len,
               uint64_t *round_trip_ns)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Health h = MOKD__HEALTH__INIT;
  Mokd__Response *r;
  int rc;

  if (c == NULL || ready == NULL)
    return MOK_ENULL;
  if ((rc = needs_protocol(c, 2, "health")) != 0)
    return rc;
  req.body_case = MOKD__REQUEST__BODY_HEALTH;
  req.health = &h;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_HEALTH, &r)) != 0)
    return rc;
  *ready = r->health->ready;
  if (reason != NULL && reason_len > 0)
    snprintf(reason, reason_len, "%s", r->health->reason);
  if (round_trip_ns != NULL)
    *round_trip_ns = r->health->round_trip_ns;
  mokd__response__free_unpacked(r, NULL);
  return 0;
}

int mok_arena_create(mok_client *c, size_t bytes, mok_arena_info *out)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__CreateArena ca = MOKD__CREATE_ARENA__INIT;
  Mokd__Response *r;
  int rc;

  ca.bytes = bytes;
  req.body_case = MOKD__REQUEST__BODY_CREATE_ARENA;
  req.create_arena = &ca;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_ARENA_CREATED, &r)) != 0)
    return rc;
  mapped *m = find_map(c, r->arena_created->arena);
  out->id = m->id, out->ptr = m->ptr, out->bytes = m->bytes, out->device = m->device;
  mokd__response__free_unpacked(r, NULL);
  return 0;
}

int mok_arena_import(mok_client *c, int fd, size_t bytes, mok_arena_info *out)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__ImportBuffer ib = MOKD__IMPORT_BUFFER__INIT;
  Mokd__Response *r;
  int rc, dupfd;

  ib.bytes = bytes;
  req.body_case = MOKD__REQUEST__BODY_IMPORT_BUFFER;
  req.import_buffer = &ib;
  if ((rc = expect(c, &req, &fd, 1, MOKD__RESPONSE__BODY_BUFFER_IMPORTED, &r)) != 0)
    return rc;
  dupfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  rc = dupfd < 0 ? fail(c, MOK_EIO, "dup: %s", strerror(errno))
                 : add_map(c, r->buffer_imported->arena, dupfd, bytes, -1);
  if (dupfd >= 0)
    close(dupfd);
  if (rc == 0) {
    mapped *m = find_map(c, r->buffer_imported->arena);
    out->id = m->id, out->ptr = m->ptr, out->bytes = m->bytes, out->device = -1;
  }
  mokd__response__free_unpacked(r, NULL);
  return rc;
}

/* Imports one whole allocation of ours; the daemon maps it once. */
static int import_alloc(mok_client *c, const mok_cuda_alloc *al, uint64_t *arena)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__ImportBuffer ib = MOKD__IMPORT_BUFFER__INIT;
  Mokd__Response *r;
  uint8_t handle[MOKW_IPC_BYTES];
  char why[200];
  int fd = -1, rc;

  ib.bytes = al->bytes;
  if (al->legacy_ipc) {
    if (mok_cuda_ipc_handle(al->base, handle, why, sizeof why) != 0)
      return fail(c, MOK_EDEVICE, "%s", why);
    ib.kind = MOKD__IMPORT_KIND__IMPORT_CUDA_IPC;
    ib.cuda_ipc_handle.data = handle;
    ib.cuda_ipc_handle.len = sizeof handle;
  } else {
    if (mok_cuda_export_fd(al->base, &fd, why, sizeof why) != 0)
      return fail(c, MOK_EINVAL, "%s", why);
    ib.kind = MOKD__IMPORT_KIND__IMPORT_CUMEM_FD;
  }
  req.body_case = MOKD__REQUEST__BODY_IMPORT_BUFFER;
  req.import_buffer = &ib;
  rc = expect(c, &req, fd >= 0 ? &fd : NULL, fd >= 0, MOKD__RESPONSE__BODY_BUFFER_IMPORTED, &r);
  if (fd >= 0)
    close(fd);
  if (rc != 0)
    return rc;
  *arena = r->buffer_imported->arena;
  mokd__response__free_unpacked(r, NULL);
  if (grow(c, (void **)&c->maps, c->nmaps, &c->capmaps, sizeof *c->maps) != 0) {
    mok_arena_destroy(c, *arena); /* nothing here would name it again */
    return MOK_ENOMEM;
  }
  c->maps[c->nmaps++] = (mapped){*arena, (void *)al->base, al->bytes, al->device, 0, 1};
  return 0;
}

/* Where chunk i's fd comes from: a dup of the caller's memfd, or the export
 * of one of our cuMem allocations. */
typedef int (*chunk_fd_fn)(mok_client *c, const void *arg, int i, int *fd);

static int memfd_of(mok_client *c, const void *arg, int i, int *fd)
{
  if ((*fd = fcntl(((const int *)arg)[i], F_DUPFD_CLOEXEC, 0)) < 0)
    return fail(c, MOK_EIO, "dup: %s", strerror(errno));
  return 0;
}

static int cumem_of(mok_client *c, const void *arg, int i, int *fd)
{
  char why[200];
  if (mok_cuda_export_fd(((const mok_cuda_alloc *)arg)[i].base, fd, why, sizeof why) != 0)
    return fail(c, MOK_EINVAL, "%s", why);
  return 0;
}

/* Imports n chunks of bytes in all as one arena: MOKW_MAX_FDS chunks a
 * frame, the first frame beginning the import, the next ones continuing it.
 * The fds are made a frame at a time, so a tensor of hundreds of chunks
 * holds no more than a frame's open. On an error the daemon has dropped the
 * import whole. */
static int import_chunks(mok_client *c, Mokd__ImportKind kind, const size_t *sizes, int n,
                         chunk_fd_fn fd_of, const void *arg, uint64_t *arena)
{
  size_t bytes = 0;
  uint64_t id = 0;
  int rc;

  if ((rc = needs_protocol(c, 3, "importing memory made of several allocations")) != 0)
    return rc;
  for (int i = 0; i < n; i++)
    bytes += sizes[i];
  for (int at = 0; at < n;) {
    Mokd__Request req = MOKD__REQUEST__INIT;
    Mokd__ImportBuffer ib = MOKD__IMPORT_BUFFER__INIT;
    Mokd__Response *r;
    uint64_t cb[MOKW_MAX_FDS];
    int fds[MOKW_MAX_FDS], k = n - at < MOKW_MAX_FDS ? n - at : MOKW_MAX_FDS, nfd = 0;

    for (rc = 0; rc == 0 && nfd < k; nfd++) {
      cb[nfd] = sizes[at + nfd];
      if ((rc = fd_of(c, arg, at + nfd, &fds[nfd])) != 0)
        break;
    }
    if (rc == 0) {
      ib.bytes = bytes;
      ib.kind = kind;
      ib.continues = id;
      ib.n_chunk_bytes = (size_t)k;
      ib.chunk_bytes = cb;
      req.body_case = MOKD__REQUEST__BODY_IMPORT_BUFFER;
      req.import_buffer = &ib;
      rc = expect(c, &req, fds, k, MOKD__RESPONSE__BODY_BUFFER_IMPORTED, &r);
    }
    for (int j = 0; j < nfd; j++)
      close(fds[j]);
    if (rc != 0 && nfd < k && id != 0)
      mok_ping(c, NULL); /* any request but its next chunks drops an import under way */
    if (rc != 0)
      return rc; /* a refused frame dropped the import */
    if ((id != 0 && r->buffer_imported->arena != id) ||
        r->buffer_imported->incomplete != (at + k < n)) {
      uint64_t got = r->buffer_imported->arena;
      int done = !r->buffer_imported->incomplete;
      mokd__response__free_unpacked(r, NULL);
      if (done)
        mok_arena_destroy(c, got);
      else
        mok_ping(c, NULL);
      return fail(c, MOK_EPROTO, "mokd answered chunks %d to %d of import %llu of %d chunks "
                  "with arena %llu, %s", at, at + k - 1, (unsigned long long)id, n,
                  (unsigned long long)got, done ? "complete" : "incomplete");
    }
    id = r->buffer_imported->arena;
    mokd__response__free_unpacked(r, NULL);
    at += k;
  }
  *arena = id;
  return 0;
}

int mok_arena_import_chunks(mok_client *c, const int *fds, const size_t *sizes, int n,
                            mok_arena_info *out)
{
  size_t bytes = 0;
  uint64_t id = 0;
  char *p;
  int rc;

  if (c == NULL || fds == NULL || sizes == NULL || out == NULL)
    return MOK_ENULL;
  if (n <= 0)
    return fail(c, MOK_EINVAL, "an import of %d chunks", n);
  for (int i = 0; i < n; i++) {
    if (sizes[i] > SIZE_MAX / 2 - bytes)
      return fail(c, MOK_EOVERFLOW, "the chunks' sizes overflow");
    bytes += sizes[i];
  }
  if (grow(c, (void **)&c->maps, c->nmaps, &c->capmaps, sizeof *c->maps) != 0)
    return MOK_ENOMEM;
  if ((rc = import_chunks(c, MOKD__IMPORT_KIND__IMPORT_MEMFD, sizes, n, memfd_of, fds, &id)))
    return rc;
  /* mapped here as the daemon maps it: the chunks back to back in one range */
  p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  for (size_t i = 0, off = 0; p != MAP_FAILED && i < (size_t)n; off += sizes[i++])
    if (mmap(p + off, sizes[i], PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fds[i], 0) ==
        MAP_FAILED) {
      munmap(p, bytes);
      p = MAP_FAILED;
    }
  if (p == MAP_FAILED) {
    rc = fail(c, MOK_ENOMEM, "cannot map the %d chunks of arena %llu here (%zu bytes): %s", n,
              (unsigned long long)id, bytes, strerror(errno));
    mok_arena_destroy(c, id);
    return rc;
  }
  c->maps[c->nmaps++] = (mapped){id, p, bytes, -1, 0, 0};
  *out = (mok_arena_info){.id = id, .ptr = p, .bytes = bytes, .device = -1};
  return 0;
}

/* The allocations that hold [ptr, end): the one at ptr, then those mapped
 * right after it, which must be cuMem allocations of the same device. */
static int walk_chunks(mok_client *c, const void *ptr, uintptr_t end, const mok_cuda_alloc *first,
                       mok_cuda_alloc **out, int *n)
{
  mok_cuda_alloc *v = NULL, next;
  int cap = 0, k = 0;
  char why[200];

  *out = NULL, *n = 0;
  for (uintptr_t at = first->base; at < end; at += v[k - 1].bytes) {
    if (k > 0 && (mok_cuda_alloc_info((const void *)at, &next, why, sizeof why) != 0 ||
                  next.base != at || next.device != first->device || next.legacy_ipc ||
                  first->legacy_ipc)) {
      free(v);
      return fail(c, MOK_ERANGE, "%zu bytes at %p run past the end of their allocation "
                  "(%zu bytes at %#lx)%s", (size_t)(end - (uintptr_t)ptr), ptr,
                  (size_t)(at - first->base), (unsigned long)first->base,
                  k > 1 ? " and the allocations mapped after it" : "");
    }
    if (k == cap) {
      void *w = realloc(v, (size_t)(cap = cap ? 2 * cap : 8) * sizeof *v);
      if (w == NULL) {
        free(v);
        return fail(c, MOK_ENOMEM, "out of memory");
      }
      v = w;
    }
    v[k] = k == 0 ? *first : next;
    k++;
  }
  *out = v, *n = k;
  return 0;
}

/* The cached entry that holds [ptr, end), found by the chunk at ptr (al,
 * which the caller has just asked the driver about), or -1.
 *
 * A hit must not cost the walk a miss makes: a weight of hundreds of chunks
 * is passed again every step. Why one query per further chunk is enough:
 * while the daemon maps a chunk, its physical memory stays, so no other
 * allocation can take it over; but our process may unmap the chunk's
 * addresses and map a new allocation there (a caching allocator that frees
 * and grows a segment again), and then the arena would show the old memory
 * where the tensor has the new one. The chunk at ptr being the one cached
 * says nothing of the others, so each further chunk that [ptr, end) touches
 * is checked to be the same allocation still: one buffer id query each (ids
 * are unique for the process's life), or the full look where the driver
 * gave no id. The entry's chunks that [ptr, end) does not touch do not
 * matter to this call; a later miss over them finds them if they went. */
static int find_hit(const mok_client *c, const mok_cuda_alloc *al, uintptr_t ptr, uintptr_t end)
{
  int from = 0, to = -1, i = mok_imp_lookup(c->imps, c->nimps, al, ptr, end, &from, &to);

  for (int j = from + 1; i >= 0 && j <= to; j++) {
    const mok_cuda_alloc *k = &c->imps[i].chunks[j];
    unsigned long long id;
    mok_cuda_alloc now;
    char why[200];
    if (k->buffer_id != 0 ? mok_cuda_buffer_id(k->base, &id) != 0 || id != k->buffer_id
                          : mok_cuda_alloc_info((const void *)k->base, &now, why, sizeof why) != 0 ||
                                !mok_imp_same(&now, k))
      return -1;
  }
  return i;
}

/* Drops the entries that overlap chunks w[0, n) but map allocations of ours
 * since freed: the daemon's mapping would keep that memory from going back.
 * One still named (handed out since the last request, held, or MOK_EBUSY) is
 * retired instead, and goes at a later miss once nothing names it. */
static int drop_stale(mok_client *c, const mok_cuda_alloc *w, int n)
{
  for (int i = c->nimps - 1; i >= 0; i--) {
    mok_imp *m = i < c->nimps ? &c->imps[i] : NULL;
    int rc = 0;
    if (m == NULL || !mok_imp_stale(m, w, n))
      continue;
    if (!mok_imp_idle(m, c->epoch) || is_held(c, m->arena) ||
        (rc = mok_arena_destroy(c, m->arena)) == MOK_EBUSY)
      m->retired = 1;
    else if (rc != 0)
      return rc;
  }
  return 0;
}

/* Destroys the entries that neither a tensor about to be sent (idle) nor a
 * layer or context of the daemon's (held) names: retired ones only, or all
 * (under the quota). One the daemon keeps (MOK_EBUSY) a later call tries
 * again; any error here costs the call nothing, as it has its arena. */
static int drop_idle(mok_client *c, int retired_only)
{
  char err[MOK_ERRLEN];
  int dropped = 0;

  memcpy(err, c->err, sizeof err);
  for (int i = c->nimps - 1; i >= 0; i--) {
    const mok_imp *m = i < c->nimps ? &c->imps[i] : NULL;
    if (m != NULL && (m->retired || !retired_only) && mok_imp_idle(m, c->epoch) &&
        !is_held(c, m->arena) && mok_arena_destroy(c, m->arena) == 0)
      dropped++;
  }
  memcpy(c->err, err, sizeof err);
  return dropped;
}

/* The chunks of [lo, hi), the union of a call's chunks and the live entries
 * that overlap them, if every one is mapped, on the device, and each entry
 * still maps its own; else NULL, and the call imports only its own chunks. */
static mok_cuda_alloc *walk_union(mok_client *c, uintptr_t lo, uintptr_t hi, int device, int *n)
{
  mok_cuda_alloc first, *u = NULL;
  char why[200], err[MOK_ERRLEN];

  memcpy(err, c->err, sizeof err); /* a union that fails is no error of the call's */
  if (mok_cuda_alloc_info((const void *)lo, &first, why, sizeof why) == 0 && first.base == lo &&
      first.device == device && walk_chunks(c, (const void *)lo, hi, &first, &u, n) == 0)
    for (int i = 0; u != NULL && i < c->nimps; i++)
      if (!c->imps[i].retired && mok_imp_stale(&c->imps[i], u, *n)) {
        free(u);
        u = NULL;
      }
  memcpy(c->err, err, sizeof err);
  return u;
}

/* Imports chunks w[0, n) as one arena. */
static int import_walked(mok_client *c, const mok_cuda_alloc *w, int n, uint64_t *id)
{
  size_t total = 0, *sizes;
  int rc;

  if (n == 1)
    return import_alloc(c, &w[0], id);
  if ((sizes = malloc((size_t)n * sizeof *sizes)) == NULL)
    return fail(c, MOK_ENOMEM, "out of memory");
  for (int i = 0; i < n; i++)
    total += sizes[i] = w[i].bytes;
  rc = import_chunks(c, MOKD__IMPORT_KIND__IMPORT_CUMEM_FD, sizes, n, cumem_of, w, id);
  free(sizes);
  if (rc == 0 && (rc = grow(c, (void **)&c->maps, c->nmaps, &c->capmaps, sizeof *c->maps)) != 0)
    mok_arena_destroy(c, *id);
  else if (rc == 0)
    c->maps[c->nmaps++] = (mapped){*id, (void *)w[0].base, total, w[0].device, 0, 1};
  return rc;
}

/* import_walked, once more after letting idle entries go if the session's
 * quota refused it. */
static int import_quota(mok_client *c, const mok_cuda_alloc *w, int n, uint64_t *id)
{
  int rc = import_walked(c, w, n, id);
  if (rc == MOK_EDQUOT && drop_idle(c, 0) > 0)
    rc = import_walked(c, w, n, id);
  return rc;
}

/* A miss: imports [ptr, end) and returns its new entry's index. Where the
 * range overlaps entries still good, it imports their union instead and
 * retires them (no longer handed out): tensors at shifting offsets of one
 * expandable segment, the activations of each step, then keep one arena
 * there rather than adding one a step until the session runs out of arenas,
 * the old ones holding on to memory the allocator gave back. A retired arena
 * is destroyed at a later miss, once no tensor about to be sent, layer or
 * context names it. A union the daemon refuses (the quota, mostly: the
 * entries it joins still count until they go, and a layer's weights next to
 * the range are held) leaves the call importing its own chunks. */
static int import_miss(mok_client *c, const mok_cuda_alloc *al, const void *ptr, uintptr_t end,
                       int *at)
{
  mok_cuda_alloc *w = NULL, *u = NULL;
  uintptr_t lo, hi;
  uint64_t id = 0;
  int n = 0, nu = 0, rc;

  if ((rc = walk_chunks(c, ptr, end, al, &w, &n)) != 0)
    return rc;
  if (n == 0) {
    free(w);
    return fail(c, MOK_ERANGE, "no allocation holds the %zu bytes at %p",
                (size_t)(end - (uintptr_t)ptr), ptr);
  }
  if ((rc = drop_stale(c, w, n)) != 0 ||
      (rc = grow(c, (void **)&c->imps, c->nimps, &c->capimps, sizeof *c->imps)) != 0) {
    free(w);
    return rc;
  }
  lo = w[0].base, hi = w[n - 1].base + w[n - 1].bytes;
  if (mok_imp_union(c->imps, c->nimps, w, n, &lo, &hi))
    u = walk_union(c, lo, hi, al->device, &nu);
  if (u != NULL && import_quota(c, u, nu, &id) == 0) {
    free(w);
    w = u, n = nu, rc = 0;
  } else {
    free(u);
    rc = import_quota(c, w, n, &id);
  }
  if (rc != 0) {
    free(w);
    return rc;
  }
  for (int i = 0; i < c->nimps; i++)
    if (mok_imp_covered(&c->imps[i], w, n))
      c->imps[i].retired = 1;
  lo = w[0].base, hi = w[n - 1].base + w[n - 1].bytes;
  c->imps[c->nimps++] = (mok_imp){lo, hi - lo, w, n, id, c->epoch, 0};
  drop_idle(c, 1);
  for (*at = 0; c->imps[*at].arena != id; ++*at) /* destroys move entries */
    ;
  return 0;
}

int mok_arena_import_cuda(mok_client *c, const void *ptr, size_t bytes, uint64_t *arena,
                          uint64_t *offset)
{
  mok_cuda_alloc al;
  uintptr_t end;
  char why[200];
  int rc, dev = -1, i;

  if (c == NULL || ptr == NULL || arena == NULL || offset == NULL)
    return MOK_ENULL;
  /* the arguments before the backend: a size that cannot be right is told
   * as such on every backend */
  if (bytes == 0)
    return fail(c, MOK_EZEROSIZE, "importing 0 bytes at %p: pass the tensor's size, at "
                "least 1", ptr);
  if (bytes > UINTPTR_MAX - (uintptr_t)ptr)
    return fail(c, MOK_EOVERFLOW, "%zu bytes at %p run past the end of the address space; "
                "pass the tensor's size in bytes", bytes, ptr);
  end = (uintptr_t)ptr + bytes;
  if (c->daemon_gpu < 0)
    return fail(c, MOK_ENOTSUP, "mokd runs the %s backend; it imports GPU memory only on "
                "the cuda backend", c->info.backend);
  if ((rc = local_gpu(c, &dev)) != 0)
    return rc;
  if (mok_cuda_alloc_info(ptr, &al, why, sizeof why) != 0)
    return fail(c, MOK_EINVAL, "%s", why);
  if (al.device != dev) {
    char there[MOKW_UUID_STRLEN] = "?";
    uint8_t u[MOKW_UUID_BYTES];
    if (mok_cuda_uuid(al.device, u, why, sizeof why) == 0)
      mokw_uuid_format(u, there);
    return fail(c, MOK_EDEVICE, "the memory is on CUDA device %d of this process (%s); this "
                "session runs on %s (device %d here): allocate it there, or connect on its GPU",
                al.device, there, c->info.device_uuid, dev);
  }
  if ((i = find_hit(c, &al, (uintptr_t)ptr, end)) < 0 &&
      (rc = import_miss(c, &al, ptr, end, &i)) != 0)
    return rc;
  c->imps[i].used = c->epoch;
  *arena = c->imps[i].arena;
  *offset = (uint64_t)((uintptr_t)ptr - c->imps[i].base);
  return 0;
}

int mok_arena_destroy(mok_client *c, uint64_t arena)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__DestroyArena da = MOKD__DESTROY_ARENA__INIT;
  int rc;

  da.arena = arena;
  req.body_case = MOKD__REQUEST__BODY_DESTROY_ARENA;
  req.destroy_arena = &da;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_DONE, NULL)) != 0)
    return rc;
  for (int i = 0; i < c->nmaps; i++)
    if (c->maps[i].id == arena) {
      unmap(&c->maps[i]);
      c->maps[i] = c->maps[--c->nmaps];
      break;
    }
  for (int i = 0; i < c->nimps; i++)
    if (c->imps[i].arena == arena) {
      free(c->imps[i].chunks);
      c->imps[i] = c->imps[--c->nimps];
      break;
    }
  return 0;
}

void *mok_tensor_ptr(const mok_client *c, const mok_tensor *t)
{
  const mapped *m = c != NULL && t != NULL ? find_map(c, t->arena) : NULL;
  size_t n = t != NULL ? mok_tensor_bytes(t) : 0;
  if (m == NULL || t->offset > m->bytes || n > m->bytes - t->offset)
    return NULL;
  return (char *)m->ptr + t->offset;
}

mok_tensor mok_tensor_make(uint64_t arena, uint64_t offset, mok_dtype dtype, int ndim,
                           const int64_t *shape)
{
  mok_tensor t = {arena, offset, dtype, ndim, {0}};
  for (int i = 0; i < ndim && i < MOK_MAX_DIMS; i++)
    t.shape[i] = shape[i];
  return t;
}

size_t mok_tensor_bytes(const mok_tensor *t)
{
  size_t n = t->dtype == MOK_DTYPE_BF16 ? 2 : 4;
  for (int i = 0; i < t->ndim && i < MOK_MAX_DIMS; i++)
    n *= (size_t)(t->shape[i] > 0 ? t->shape[i] : 0);
  return n;
}

/* wire <-> C tensors; to_wire fills storage owned by the caller */
static void to_wire(const mok_tensor *t, Mokd__TensorRef *r, int64_t *shape)
{
  mokd__tensor_ref__init(r);
  r->arena = t->arena;
  r->offset = t->offset;
  r->dtype = (Mokd__DType)t->dtype;
  r->n_shape = (size_t)(t->ndim > 0 && t->ndim <= MOK_MAX_DIMS ? t->ndim : 0);
  memcpy(shape, t->shape, r->n_shape * sizeof *shape);
  r->shape = shape;
}

static void from_wire(const Mokd__TensorRef *r, mok_tensor *t)
{
  memset(t, 0, sizeof *t);
  if (r == NULL)
    return;
  t->arena = r->arena;
  t->offset = r->offset;
  t->dtype = (mok_dtype)r->dtype;
  t->ndim = (int)(r->n_shape <= MOK_MAX_DIMS ? r->n_shape : MOK_MAX_DIMS);
  memcpy(t->shape, r->shape, (size_t)t->ndim * sizeof *t->shape);
}

int mok_layer_create(mok_client *c, const mok_layer_desc *d, uint64_t *layer)
{
  return mok_layer_create_tuned(c, d, NULL, layer);
}

int mok_layer_create_tuned(mok_client *c, const mok_layer_desc *d, const mok_layer_tuning *t,
                           uint64_t *layer)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__CreateLayer cl = MOKD__CREATE_LAYER__INIT;
  Mokd__EpGroup ep = MOKD__EP_GROUP__INIT;
  Mokd__Tuning tw = MOKD__TUNING__INIT;
  static const mok_layer_tuning none;
  Mokd__Response *r;
  int rc;

  if (c == NULL || d == NULL || layer == NULL)
    return MOK_ENULL;
  if (d->hidden < 0 || d->intermediate < 0 || d->experts < 0 || d->top_k < 0 ||
      d->shared_intermediate < 0)
    return fail(c, MOK_EINVAL, "layer sizes must not be negative");
  cl.hidden = (uint64_t)d->hidden, cl.intermediate = (uint64_t)d->intermediate;
  cl.experts = (uint64_t)d->experts, cl.top_k = (uint64_t)d->top_k;
  cl.shared_intermediate = (uint64_t)d->shared_intermediate;
  cl.swiglu_limit = d->swiglu_limit;
  cl.grad_mode = (Mokd__GradMode)d->grad_mode;
  if (d->ep_size > 1) {
    ep.id = d->ep_group, ep.size = d->ep_size, ep.rank = d->ep_rank;
    cl.ep = &ep;
  }
  /* the daemon checks the values (mokk_tuning_check) and says what is wrong */
  if (t != NULL && memcmp(t, &none, sizeof none) != 0) {
    tw.tiles = (int32_t)t->tiles, tw.wgrad_tiles = (int32_t)t->wgrad_tiles;
    tw.clusters = (int32_t)t->clusters, tw.order = (int32_t)t->order;
    tw.tails = (int32_t)t->tails, tw.dx = (int32_t)t->dx;
    tw.dispatch_blocks = t->dispatch_blocks;
    cl.tuning = &tw;
  }
  req.body_case = MOKD__REQUEST__BODY_CREATE_LAYER;
  req.create_layer = &cl;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_LAYER_CREATED, &r)) != 0)
    return rc;
  *layer = r->layer_created->layer;
  mokd__response__free_unpacked(r, NULL);
  return 0;
}

int mok_layer_desc_ep(mok_layer_desc *d, uint64_t group, uint32_t size, uint32_t rank)
{
  if (d == NULL)
    return MOK_ENULL;
  if (size == 0 || rank >= size)
    return MOK_EINVAL;
  if (d->experts > 0 && d->experts % size != 0)
    return MOK_EEPSIZE;
  d->ep_group = group, d->ep_size = size, d->ep_rank = rank;
  return 0;
}

int mok_layer_destroy(mok_client *c, uint64_t layer)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__DestroyLayer dl = MOKD__DESTROY_LAYER__INIT;
  dl.layer = layer;
  int rc;

  req.body_case = MOKD__REQUEST__BODY_DESTROY_LAYER;
  req.destroy_layer = &dl;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_DONE, NULL)) == 0)
    unhold(c, 1, layer);
  return rc;
}

int mok_layer_set_weights(mok_client *c, uint64_t layer, const mok_tensor *w)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__SetWeights sw = MOKD__SET_WEIGHTS__INIT;
  Mokd__TensorRef r[MOK_NWEIGHTS];
  int64_t shapes[MOK_NWEIGHTS][MOK_MAX_DIMS];
  Mokd__TensorRef **slots[MOK_NWEIGHTS] = {&sw.w_gate, &sw.w_up, &sw.w_down,
                                           &sw.s_gate, &sw.s_up, &sw.s_down};
  int rc;

  if (c == NULL || w == NULL)
    return MOK_ENULL;
  if (hold_room(c, MOK_NWEIGHTS) != 0)
    return MOK_ENOMEM;
  sw.layer = layer;
  for (int i = 0; i < MOK_NWEIGHTS; i++) {
    if (w[i].ndim == 0)
      continue; /* absent: no shared expert */
    to_wire(&w[i], &r[i], shapes[i]);
    *slots[i] = &r[i];
  }
  req.body_case = MOKD__REQUEST__BODY_SET_WEIGHTS;
  req.set_weights = &sw;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_DONE, NULL)) != 0)
    return rc;
  unhold(c, 1, layer);
  for (int i = 0; i < MOK_NWEIGHTS; i++)
    if (w[i].ndim != 0)
      hold(c, 1, layer, w[i].arena);
  return 0;
}

static void timing_from(mok_timing *t, const Mokd__Timing *m)
{
  t->queued_ns = m != NULL ? m->queued_ns : 0;
  t->compute_ns = m != NULL ? m->compute_ns : 0;
}

/* A step that failed after the daemon made its result: release it, keep the
 * error and its message. */
static int drop_result(mok_client *c, uint64_t id, int rc)
{
  char keep[MOK_ERRLEN];
  memcpy(keep, c->err, sizeof keep);
  mok_release(c, &id, 1);
  memcpy(c->err, keep, sizeof keep);
  return rc;
}

int mok_set_stream(mok_client *c, void *stream)
{
  if (c == NULL)
    return MOK_ENULL;
  if (stream != NULL && c->daemon_gpu < 0)
    return fail(c, MOK_ENOTSUP, "mokd runs the %s backend; stream ordering needs the cuda "
                "backend", c->info.backend);
  c->stream = stream;
  return 0;
}

/* Before a step on the CUDA backend: record our ready event where the inputs
 * were written. */
static int step_ready(mok_client *c, ProtobufCBinaryData *ev)
{
  char why[200];
  int dev = -1, rc;
  if (c->daemon_gpu < 0)
    return 0;
  if ((rc = local_gpu(c, &dev)) != 0)
    return rc;
  if (c->ready == NULL && mok_cuda_event_new(dev, &c->ready, c->ready_handle, why, sizeof why) != 0)
    return fail(c, MOK_EDEVICE, "%s", why);
  if (mok_cuda_event_record(c->ready, c->stream, why, sizeof why) != 0)
    return fail(c, MOK_EDEVICE, "%s", why);
  ev->data = c->ready_handle;
  ev->len = MOKW_IPC_BYTES;
  return 0;
}

/* Opens the daemon's done event named by a reply (once: it is the same each
 * step of a session). */
static int done_event(mok_client *c, const ProtobufCBinaryData *ev)
{
  char why[200];
  int dev = -1, rc;
  if (ev->len != MOKW_IPC_BYTES)
    return fail(c, MOK_EPROTO, "the reply carries a %zu-byte done event", ev->len);
  if (c->done != NULL && memcmp(c->done_handle, ev->data, MOKW_IPC_BYTES) == 0)
    return 0;
  mok_cuda_event_free(c->done);
  c->done = NULL;
  if ((rc = local_gpu(c, &dev)) != 0)
    return rc;
  if (mok_cuda_event_open(dev, ev->data, &c->done, why, sizeof why) != 0)
    return fail(c, MOK_EDEVICE, "%s", why);
  memcpy(c->done_handle, ev->data, MOKW_IPC_BYTES);
  return 0;
}

static int read_status(mok_client *c, const mok_tensor *status)
{
  int32_t v = 0;
  int rc;
  if ((rc = mok_tensor_read(c, status, &v)) != 0)
    return rc;
  if (v == MOK_EEXPERT)
    return fail(c, MOK_EEXPERT, "topk_ids held an expert id outside [0, E) other than -1 "
                "(no route); the GPU dropped those pairs");
  if (v != 0)
    return fail(c, v < 0 ? v : MOK_EPROTO, "the step reported status %d", (int)v);
  return 0;
}

/* After a step's reply: order the caller's stream after it, or wait for it. */
static int step_done(mok_client *c, const ProtobufCBinaryData *ev, const mok_tensor *status)
{
  char why[200];
  int rc;
  if (ev->len == 0)
    return 0; /* CPU backend: the reply came after the step */
  if ((rc = done_event(c, ev)) != 0)
    return rc;
  if (c->stream != NULL)
    return mok_cuda_stream_wait(c->stream, c->done, why, sizeof why) != 0
               ? fail(c, MOK_EDEVICE, "%s", why)
               : 0;
  if (mok_cuda_event_sync(c->done, why, sizeof why) != 0)
    return fail(c, MOK_EDEVICE, "%s", why);
  return status->ndim > 0 ? read_status(c, status) : 0;
}

int mok_step_status(mok_client *c, const mok_tensor *status)
{
  char why[200];
  if (c == NULL || status == NULL)
    return MOK_ENULL;
  if (status->ndim == 0)
    return 0;
  /* the session's steps run in order, so its done event, recorded after the
   * latest one, also covers this one */
  if (c->done != NULL && mok_cuda_event_sync(c->done, why, sizeof why) != 0)
    return fail(c, MOK_EDEVICE, "%s", why);
  return read_status(c, status);
}

int mok_forward(mok_client *c, uint64_t layer, const mok_tensor *x,
                const mok_tensor *topk_ids, const mok_tensor *topk_weights, int inference,
                mok_forward_result *res)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Forward f = MOKD__FORWARD__INIT;
  Mokd__TensorRef rx, ri, rw;
  int64_t sx[MOK_MAX_DIMS], si[MOK_MAX_DIMS], sw[MOK_MAX_DIMS];
  Mokd__Response *r;
  int rc;

  if (c == NULL || x == NULL || topk_ids == NULL || topk_weights == NULL || res == NULL)
    return MOK_ENULL;
  to_wire(x, &rx, sx);
  to_wire(topk_ids, &ri, si);
  to_wire(topk_weights, &rw, sw);
  f.layer = layer, f.x = &rx, f.topk_ids = &ri, f.topk_weights = &rw;
  f.inference = inference != 0;
  req.body_case = MOKD__REQUEST__BODY_FORWARD;
  req.forward = &f;
  if (hold_room(c, 3) != 0)
    return MOK_ENOMEM;
  if ((rc = step_ready(c, &f.ready_event)) != 0)
    return rc;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_FORWARD_DONE, &r)) != 0)
    return rc;
  if (!inference) { /* the context reads them again at the backward */
    hold(c, 0, r->forward_done->context, x->arena);
    hold(c, 0, r->forward_done->context, topk_ids->arena);
    hold(c, 0, r->forward_done->context, topk_weights->arena);
  }
  memset(res, 0, sizeof *res);
  res->context = r->forward_done->context;
  from_wire(r->forward_done->out, &res->out);
  if (r->forward_done->status != NULL)
    from_wire(r->forward_done->status, &res->status);
  res->out_ptr = mok_tensor_ptr(c, &res->out);
  timing_from(&res->timing, r->forward_done->timing);
  rc = res->out_ptr != NULL ? 0 : fail(c, MOK_EPROTO, "output lies outside mapped arenas");
  if (rc == 0)
    rc = step_done(c, &r->forward_done->done_event, &res->status);
  mokd__response__free_unpacked(r, NULL);
  return rc != 0 ? drop_result(c, res->context, rc) : 0;
}

int mok_backward(mok_client *c, uint64_t context, const mok_tensor *d_out,
                 const mok_tensor *grads, int ngrads, mok_backward_result *res)
{
  return mok_backward_weights(c, context, d_out, grads, ngrads, NULL, res);
}

int mok_backward_weights(mok_client *c, uint64_t context, const mok_tensor *d_out,
                         const mok_tensor *grads, int ngrads, const mok_tensor *weights,
                         mok_backward_result *res)
{
  return mok_backward_flags(c, context, d_out, grads, ngrads, weights, 0, res);
}

int mok_backward_flags(mok_client *c, uint64_t context, const mok_tensor *d_out,
                       const mok_tensor *grads, int ngrads, const mok_tensor *weights,
                       unsigned flags, mok_backward_result *res)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Backward b = MOKD__BACKWARD__INIT;
  Mokd__TensorRef rd, rg[MOK_NWEIGHTS], *pg[MOK_NWEIGHTS], rw[MOK_NWEIGHTS],
      *pw[MOK_NWEIGHTS];
  int64_t sd[MOK_MAX_DIMS], sg[MOK_NWEIGHTS][MOK_MAX_DIMS], sw[MOK_NWEIGHTS][MOK_MAX_DIMS];
  Mokd__Response *r;
  int rc, nw = 0;

  if (c == NULL || d_out == NULL || res == NULL || (ngrads > 0 && grads == NULL))
    return MOK_ENULL;
  if (ngrads < 0 || ngrads > MOK_NWEIGHTS)
    return fail(c, MOK_EINVAL, "ngrads is %d; it must be 0, 3 or 6", ngrads);
  if (flags & ~MOK_BACKWARD_LAST)
    return fail(c, MOK_EINVAL, "unknown backward flags 0x%x (MOK_BACKWARD_LAST is 0x%x)",
                flags, MOK_BACKWARD_LAST);
  to_wire(d_out, &rd, sd);
  for (int i = 0; i < ngrads; i++) {
    to_wire(&grads[i], &rg[i], sg[i]);
    pg[i] = &rg[i];
  }
  if (weights != NULL) {
    /* the order of mok_layer_set_weights; no shared expert: its three are absent */
    nw = weights[MOK_S_GATE].ndim == 0 ? MOK_S_GATE : MOK_NWEIGHTS;
    for (int i = 0; i < nw; i++) {
      if (weights[i].ndim == 0)
        return fail(c, MOK_EINVAL, "weights[%d] is absent (ndim 0); name all of the "
                    "layer's weights, or pass NULL", i);
      to_wire(&weights[i], &rw[i], sw[i]);
      pw[i] = &rw[i];
    }
    for (int i = nw; i < MOK_NWEIGHTS; i++)
      if (weights[i].ndim != 0)
        return fail(c, MOK_EINVAL, "weights[%d] is given but weights[%d] (s_gate) is "
                    "absent", i, MOK_S_GATE);
  }
  b.context = context, b.d_out = &rd, b.n_grads = (size_t)ngrads, b.grads = pg;
  b.n_weights = (size_t)nw, b.weights = pw;
  b.last = (flags & MOK_BACKWARD_LAST) != 0;
  req.body_case = MOKD__REQUEST__BODY_BACKWARD;
  req.backward = &b;
  if ((rc = step_ready(c, &b.ready_event)) != 0)
    return rc;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_BACKWARD_DONE, &r)) != 0)
    return rc;
  memset(res, 0, sizeof *res);
  res->result = r->backward_done->result;
  from_wire(r->backward_done->d_x, &res->d_x);
  from_wire(r->backward_done->d_topk_weights, &res->d_topk_weights);
  res->d_x_ptr = mok_tensor_ptr(c, &res->d_x);
  res->d_topk_weights_ptr = mok_tensor_ptr(c, &res->d_topk_weights);
  res->ngrads = (int)(r->backward_done->n_grads <= MOK_NWEIGHTS ? r->backward_done->n_grads : 0);
  for (int i = 0; i < res->ngrads; i++) {
    from_wire(r->backward_done->grads[i], &res->grads[i]);
    res->grad_ptrs[i] = mok_tensor_ptr(c, &res->grads[i]);
  }
  if (r->backward_done->status != NULL)
    from_wire(r->backward_done->status, &res->status);
  timing_from(&res->timing, r->backward_done->timing);
  rc = 0;
  if (res->d_x_ptr == NULL || res->d_topk_weights_ptr == NULL)
    rc = fail(c, MOK_EPROTO, "outputs lie outside mapped arenas");
  if (rc == 0)
    rc = step_done(c, &r->backward_done->done_event, &res->status);
  mokd__response__free_unpacked(r, NULL);
  return rc != 0 ? drop_result(c, res->result, rc) : 0;
}

int mok_release(mok_client *c, const uint64_t *ids, int n)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Release rl = MOKD__RELEASE__INIT;

  if (c == NULL || (n > 0 && ids == NULL))
    return MOK_ENULL;
  rl.ids = (uint64_t *)ids;
  rl.n_ids = (size_t)(n > 0 ? n : 0);
  int rc;

  req.body_case = MOKD__REQUEST__BODY_RELEASE;
  req.release = &rl;
  if ((rc = expect(c, &req, NULL, 0, MOKD__RESPONSE__BODY_RELEASED, NULL)) == 0)
    unhold_contexts(c, ids, n);
  return rc;
}

static int tensor_copy(mok_client *c, const mok_tensor *t, void *host, int to_arena)
{
  const mapped *m = c != NULL && t != NULL ? find_map(c, t->arena) : NULL;
  void *p = mok_tensor_ptr(c, t);
  size_t n = p != NULL ? mok_tensor_bytes(t) : 0;
  char why[200];

  if (c == NULL || host == NULL)
    return MOK_ENULL;
  if (p == NULL)
    return fail(c, MOK_ERANGE, "the tensor lies outside the arenas this client has mapped");
  if (m->device < 0) {
    if (to_arena)
      memcpy(p, host, n);
    else
      memcpy(host, p, n);
    return 0;
  }
  if (mok_cuda_copy(to_arena ? p : host, to_arena ? host : p, n, to_arena, m->device, why,
                    sizeof why) != 0)
    return fail(c, MOK_EDEVICE, "%s", why);
  return 0;
}

int mok_tensor_write(mok_client *c, const mok_tensor *t, const void *src)
{
  return tensor_copy(c, t, (void *)src, 1);
}

int mok_tensor_read(mok_client *c, const mok_tensor *t, void *dst)
{
  return tensor_copy(c, t, dst, 0);
}
