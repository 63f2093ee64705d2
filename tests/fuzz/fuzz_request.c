/* fuzz_request.c - libFuzzer harness for request handling: one session of
 * the real daemon code (conn, dispatch, session, arenas, layers, steps,
 * registry, the executor and the CPU backend) on one end of a socketpair,
 * the fuzzer's bytes and fds on the other. `make fuzz` builds and runs it.
 *
 * Input: chunks of [ctl][kind x nfds][len: 2 bytes LE][len bytes]. The bytes
 * are sent in one message with nfds = ctl & 15 fds (at most 12) on its
 * first byte, more than the daemon takes at once (8) included; each kind
 * byte picks an fd: sealed memfds of several sizes, an unsealed one, a pipe,
 * /dev/null, an eventfd, a socket, a directory. ctl & 0x80 hangs up right
 * after the chunk, a step possibly in flight. Ids are deterministic (the
 * daemon's counter starts at 0 for every input: session 1, then 2, 3, ...),
 * so seeds can name their arenas, layers and contexts.
 *
 * Checked besides memory safety: every reply is a Response; the daemon
 * settles (no hang); once the peer is gone the session is destroyed and
 * everything it held is given back: no arena, byte, layer, context or
 * result is left in the daemon's usage, and no fd is left open. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "executor.h"
#include "fdpass.h"
#include "log.h"
#include "mokd.h"

#define REQUIRE(cond)                                                          \
  do {                                                                         \
    if (!(cond))                                                               \
      abort();                                                                 \
  } while (0)

#define MAX_CHUNK_FDS 12
#define FD_SCAN 1024

static uv_loop_t loop;
static mokd_server srv;

/* The fds open in this process, one bit each. */
typedef struct fdset {
  uint64_t bits[FD_SCAN / 64];
} fdset;

static void open_fds(fdset *set)
{
  memset(set, 0, sizeof *set);
  for (int fd = 0; fd < FD_SCAN; fd++)
    if (fcntl(fd, F_GETFD) >= 0)
      set->bits[fd / 64] |= 1ull << (fd % 64);
}

/* Every fd open now was open before the input; else says which, and fails. */
static void no_fd_left(const fdset *before)
{
  fdset now;
  int left = 0;
  open_fds(&now);
  for (int fd = 0; fd < FD_SCAN; fd++)
    if ((now.bits[fd / 64] >> (fd % 64) & 1) && !(before->bits[fd / 64] >> (fd % 64) & 1)) {
      char path[64], target[256] = "?";
      ssize_t n;
      snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
      if ((n = readlink(path, target, sizeof target - 1)) > 0)
        target[n] = 0;
      fprintf(stderr, "fuzz_request: fd %d (%s) is left open\n", fd, target);
      left++;
    }
  REQUIRE(left == 0);
}

static void init(void)
{
  char err[MOK_ERRLEN];
  char *argv[] = {"mokd", "--config", "/dev/null"};

  REQUIRE(mokd_config_load(&srv.cfg, 3, argv, err, sizeof err) == MOKD_CONFIG_RUN);
  /* small enough that any step the fuzzer can build computes in well under
   * a second: weights and inputs fit 16 KiB arenas */
  srv.cfg.max_frame_bytes = 64 << 10;
  srv.cfg.max_arena_bytes = 16 << 10;
  srv.cfg.session_quota_bytes = 1 << 20;
  srv.cfg.max_arenas = 16;
  srv.cfg.max_layers = 8;
  mokd_log_set(MOKD_LOG_ERROR, 0);
  REQUIRE(uv_loop_init(&loop) == 0);
  srv.loop = &loop;
  srv.start_ns = mokd_now_ns();
  srv.max_maps = 1024;
  REQUIRE(mokk_cpu_create(1, &srv.backend, err) == 0);
  REQUIRE(mokd_executor_create(&loop, 1, &srv.exec) == 0);
}

/* An fd of the kind the fuzzer picked; -1 when it could not be made. */
static int make_fd(uint8_t kind)
{
  static const size_t sizes[] = {4096, 16384, 65536, 0};
  int fd = -1, p[2];

  switch (kind % 9) {
  case 0: case 1: case 2: case 3: /* sealed memfds */
    fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd >= 0 && (ftruncate(fd, (off_t)sizes[kind % 4]) != 0 ||
                    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0)) {
      close(fd);
      fd = -1;
    }
    return fd;
  case 4: /* unsealed */
    fd = memfd_create("fuzz", MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, 4096) != 0) {
      close(fd);
      fd = -1;
    }
    return fd;
  case 5:
    if (pipe2(p, O_CLOEXEC) != 0)
      return -1;
    close(p[1]);
    return p[0];
  case 6:
    return open("/dev/null", O_RDWR | O_CLOEXEC);
  case 7:
    return kind & 0x80 ? eventfd(0, EFD_CLOEXEC) : socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  default:
    return open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }
}

/* Reads what the daemon sent; every frame must be a Response. */
static void drain(int fd, mokw_framer *rx)
{
  for (;;) {
    int fds[MOKW_MAX_FDS], nfds = MOKW_MAX_FDS;
    size_t avail, len;
    const uint8_t *payload;
    uint8_t *dst = mokw_framer_space(rx, 65536, &avail);
    ssize_t n;

    REQUIRE(dst != NULL);
    n = mokw_recv(fd, dst, avail, MSG_DONTWAIT, fds, &nfds, NULL);
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    if (n <= 0)
      return;
    mokw_framer_commit(rx, (size_t)n);
    while (mokw_framer_next(rx, &payload, &len, NULL) == 1) {
      Mokd__Response *r = mokd__response__unpack(NULL, len, payload);
      REQUIRE(r != NULL);
      mokd__response__free_unpacked(r, NULL);
    }
  }
}

static mokd_session *session(void)
{
  return srv.sessions;
}

/* Runs the loop until the session has taken everything sent and answered
 * it, or is gone. */
static void settle(int client, mokw_framer *rx)
{
  for (long i = 0;; i++) {
    mokd_session *s = session();
    int unread = 0;

    REQUIRE(i < 10000000); /* a hang */
    if (client >= 0)
      drain(client, rx);
    if (s == NULL)
      return;
    if (s->busy != NULL || s->probes > 0) {
      uv_run(&loop, UV_RUN_ONCE); /* the step's (or a health probe's) completion */
      continue;
    }
    if (s->parked)
      return; /* waits for EP ranks that never come: the close ends it */
    if (s->fd >= 0 && ioctl(s->fd, FIONREAD, &unread) != 0)
      unread = 0;
    if (unread == 0 && s->pend_head == NULL && s->out_head == NULL && !s->closing)
      return;
    uv_run(&loop, UV_RUN_NOWAIT);
  }
}

/* Sends one chunk; 0 once the daemon no longer takes anything. */
static int send_chunk(int client, mokw_framer *rx, const uint8_t *p, size_t len,
                      const int *fds, int nfds)
{
  struct iovec iov = {(void *)p, len};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(MAX_CHUNK_FDS * sizeof(int))];
  } cm;
  size_t off = 0;

  if (nfds > 0) {
    memset(&cm, 0, sizeof cm);
    mh.msg_control = cm.b;
    mh.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
    struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
    h->cmsg_level = SOL_SOCKET, h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
    memcpy(CMSG_DATA(h), fds, (size_t)nfds * sizeof(int));
  }
  while (off < len) { /* without bytes the fds cannot go: a stream carries them on bytes */
    ssize_t n;
    iov.iov_base = (void *)(p + off), iov.iov_len = len - off;
    n = sendmsg(client, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      off += (size_t)n;
      mh.msg_control = NULL, mh.msg_controllen = 0; /* the fds went with the first byte */
      continue;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return 0; /* the daemon hung up */
    if (session() == NULL)
      return 0;
    settle(client, rx);
    if (session() == NULL)
      return 0;
    uv_run(&loop, UV_RUN_NOWAIT);
  }
  return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  static int ready;
  int sv[2], client;
  size_t at = 0;
  mokw_framer rx;
  fdset before;

  if (!ready) {
    init();
    ready = 1;
  }
  open_fds(&before);
  srv.next_id = 0;
  memset(&srv.usage, 0, sizeof srv.usage);
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  REQUIRE(fcntl(sv[0], F_SETFL, O_NONBLOCK) == 0);
  REQUIRE(mokd_session_new(&srv, sv[0]) != NULL);
  client = sv[1];
  mokw_framer_init(&rx, 64u << 20);

  while (at < size && client >= 0) {
    uint8_t ctl = data[at++];
    int nfds = ctl & 15, fds[MAX_CHUNK_FDS], made = 0, alive;
    size_t len;

    if (nfds > MAX_CHUNK_FDS)
      nfds = MAX_CHUNK_FDS;
    for (int i = 0; i < nfds && at < size; i++) {
      int fd = make_fd(data[at++]);
      if (fd >= 0)
        fds[made++] = fd;
    }
    len = at + 2 <= size ? (size_t)data[at] | (size_t)data[at + 1] << 8 : 0;
    at += 2;
    if (at > size)
      at = size;
    if (len > size - at)
      len = size - at;
    alive = send_chunk(client, &rx, data + at, len, fds, made);
    for (int i = 0; i < made; i++)
      close(fds[i]); /* the daemon has its own copies */
    at += len;
    if (!alive || (ctl & 0x80)) {
      close(client); /* gone, a step possibly in flight */
      client = -1;
      break;
    }
    settle(client, &rx);
  }
  if (client >= 0)
    close(client);
  settle(-1, &rx);
  while (session() != NULL) {
    uv_run(&loop, UV_RUN_ONCE);
    settle(-1, &rx);
  }
  mokw_framer_free(&rx);

  /* the peer is gone: nothing of it stays */
  REQUIRE(srv.nsessions == 0);
  REQUIRE(srv.usage.arenas == 0 && srv.usage.arena_bytes == 0 && srv.usage.gpu_bytes == 0);
  REQUIRE(srv.usage.layers == 0 && srv.usage.contexts == 0 && srv.usage.results == 0);
  REQUIRE(srv.usage.context_bytes == 0);
  no_fd_left(&before);
  return 0;
}
