/* conn.c - one client connection: reading bytes and the fds that ride on
 * them, cutting frames, the queue of requests and the queue of replies, and
 * the session's end. A session is destroyed by one rule: once its socket
 * handle is closed and no step is in flight (mokd_session_maybe_destroy). */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"
#include "mokd.h"

#define MAX_PENDING 64
/* fds held by pending frames: a frame of a chunked import carries up to 8,
 * and 64 of them must not take 512 of the daemon's fds */
#define MAX_PENDING_FDS 64
#define READ_CHUNK 65536
/* At most this much is read from a socket in one readable event. Frames
 * are parsed only once a read ends, so the bound on pending requests cannot
 * stop a read: a client that keeps its socket full could otherwise be read
 * without end (400k pings unread, all 4.3 MB taken and 68 MB of parsed
 * requests held, in runs of check_daemon_limits). The poll is
 * level-triggered: what is left is read on the next turn of the loop, if
 * the session is still read from then. */
#define READ_MAX_TURN (4 * READ_CHUNK)
/* Replies a peer has not read yet, beyond what its socket holds: past either
 * bound the session is not read from until they drain, so a client that
 * never reads can hold neither the daemon's memory nor its fds. */
#define OUT_MAX_BYTES (1u << 20)
#define OUT_MAX_FDS 32

static void on_poll(uv_poll_t *h, int status, int events);

/* ---- output ------------------------------------------------------------- */

/* Writes what the socket takes now; -1 when the socket is broken. */
static int write_out(mokd_session *s)
{
  while (s->out_head != NULL) {
    mokd_outbuf *b = s->out_head;
    ssize_t n = mokw_send(s->fd, b->data + b->off, b->len - b->off, b->fds, b->nfds,
                          MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0)
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
    for (int i = 0; i < b->nfds; i++)
      close(b->fds[i]); /* the peer has its own copies now */
    s->out_fds -= b->nfds;
    b->nfds = 0;
    b->off += (size_t)n;
    if (b->off == b->len) {
      s->out_head = b->next;
      if (s->out_head == NULL)
        s->out_tail = NULL;
      s->out_bytes -= sizeof *b + b->len;
      free(b->data);
      free(b);
    }
  }
  return 0;
}

static void flush(mokd_session *s)
{
  if (write_out(s) != 0)
    mokd_session_close(s, strerror(errno));
  else
    mokd_session_arm(s);
}

int mokd_send(mokd_session *s, Mokd__Response *resp, const int *fds, int nfds)
{
  mokd_outbuf *b;
  int rc;

  if (s->closing)
    return MOK_ECONNRESET;
  b = calloc(1, sizeof *b);
  if (b == NULL)
    return MOK_ENOMEM;
  if ((rc = mokw_pack(&resp->base, &b->data, &b->len)) != 0) {
    free(b);
    return rc;
  }
  for (int i = 0; i < nfds && i < MOKW_MAX_FDS; i++)
    if ((b->fds[b->nfds] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0)) >= 0)
      b->nfds++;
  if (s->out_tail != NULL)
    s->out_tail->next = b;
  else
    s->out_head = b;
  s->out_tail = b;
  s->out_bytes += sizeof *b + b->len;
  s->out_fds += b->nfds;
  flush(s);
  return 0;
}

int mokd_session_out_full(const mokd_session *s)
{
  return s->out_bytes >= OUT_MAX_BYTES || s->out_fds >= OUT_MAX_FDS;
}

void mokd_send_done(mokd_session *s, uint64_t id)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Empty e = MOKD__EMPTY__INIT;
  r.id = id;
  r.body_case = MOKD__RESPONSE__BODY_DONE;
  r.done = &e;
  mokd_send(s, &r, NULL, 0);
}

void mokd_reply_error(mokd_session *s, uint64_t id, int code, const char *msg)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  r.id = id;
  r.status = code;
  r.message = (char *)msg;
  s->usage.errors++;
  s->srv->usage.errors++;
  s->srv->metrics.errors[s->op]++;
  if (code == MOK_EDQUOT)
    s->srv->metrics.quota_rejections++;
  /* a device error is the daemon's news too: say it where an operator looks */
  if (code == MOK_EDEVICE)
    LOG_WARN(SESS, SESS_FMT "request %llu: %s", SESS_ARGS(s), (unsigned long long)id, msg);
  else
    LOG_DEBUG(SESS, SESS_FMT "request %llu: %s: %s", SESS_ARGS(s), (unsigned long long)id,
              mok_err_name(code), msg);
  mokd_send(s, &r, NULL, 0);
}

void mokd_session_fail(mokd_session *s, uint64_t id, int code, const char *msg)
{
  mokd_reply_error(s, id, code, msg);
  s->fatal = 1; /* read nothing more: flush the reply, then close (on_poll) */
  if (s->out_head == NULL)
    mokd_session_close(s, msg);
  else
    mokd_session_arm(s);
}

/* ---- lifetime ----------------------------------------------------------- */

static int pending_full(const mokd_session *s)
{
  return s->npending >= MAX_PENDING || s->pending_fds >= MAX_PENDING_FDS;
}

void mokd_session_arm(mokd_session *s)
{
  int ev = 0;
  if (s->closing || !s->handle_open)
    return;
  if (!pending_full(s) && !s->fatal && !mokd_session_out_full(s))
    ev |= UV_READABLE;
  if (s->out_head != NULL)
    ev |= UV_WRITABLE;
  if (ev != s->poll_events) {
    s->poll_events = ev;
    if (ev == 0)
      uv_poll_stop(&s->poll);
    else
      uv_poll_start(&s->poll, ev, on_poll);
  }
}

void mokd_pending_free(mokd_pending *p)
{
  for (int i = 0; i < p->nfds; i++)
    close(p->fds[i]);
  if (p->req != NULL)
    mokd__request__free_unpacked(p->req, NULL);
  free(p);
}

static void session_destroy(mokd_session *s)
{
  mokd_server *srv = s->srv;

  while (s->results != NULL)
    mokd_result_free(s, s->results);
  mokd_idmap_free(&s->result_ids);
  while (s->layers != NULL)
    mokd_layer_free(s, s->layers);
  mokd_registry_clear(&s->reg);
  mokd_server_reap(srv);
  while (s->pend_head != NULL) {
    mokd_pending *p = s->pend_head;
    s->pend_head = p->next;
    mokd_pending_free(p);
  }
  while (s->out_head != NULL) {
    mokd_outbuf *b = s->out_head;
    s->out_head = b->next;
    for (int i = 0; i < b->nfds; i++)
      close(b->fds[i]);
    free(b->data);
    free(b);
  }
  for (int i = 0; i < s->nrxfds; i++)
    if (s->rxfds[i].fd >= 0)
      close(s->rxfds[i].fd);
  mokw_framer_free(&s->rx);
  mokk_events_free(s->backend, s->events);
  if (s->gpu != NULL)
    s->gpu->sessions--;
  if (s->t != NULL)
    mokd_tenant_put(&srv->tenants, s->t); /* after its memory went: the record may go */
  if (s->prev != NULL)
    s->prev->next = s->next;
  else
    srv->sessions = s->next;
  if (s->next != NULL)
    s->next->prev = s->prev;
  srv->nsessions--;
  srv->usage.sessions--;
  LOG_INFO(SESS, SESS_FMT "closed (pid %d uid %u); daemon holds %llu arenas, %llu bytes",
           SESS_ARGS(s), (int)s->pid, (unsigned)s->uid, (unsigned long long)srv->usage.arenas,
           (unsigned long long)srv->usage.arena_bytes);
  free(s);
  mokd_server_maybe_stop(srv);
}

void mokd_session_maybe_destroy(mokd_session *s)
{
  if (!s->handle_open && s->busy == NULL && s->probes == 0)
    session_destroy(s);
}

static void on_handle_closed(uv_handle_t *h)
{
  mokd_session *s = h->data;
  close(s->fd);
  s->fd = -1;
  s->handle_open = 0;
  mokd_session_maybe_destroy(s);
}

void mokd_session_close(mokd_session *s, const char *why)
{
  if (s->closing)
    return;
  s->closing = 1;
  mokd_groups_session_closing(s); /* the other ranks' waits end now */
  write_out(s); /* last replies, as far as the socket takes them now */
  LOG_DEBUG(SESS, SESS_FMT "closing: %s", SESS_ARGS(s), why);
  uv_poll_stop(&s->poll);
  uv_close((uv_handle_t *)&s->poll, on_handle_closed);
}

mokd_session *mokd_session_new(mokd_server *srv, int fd)
{
  mokd_session *s = calloc(1, sizeof *s);
  struct ucred cr;
  socklen_t len = sizeof cr;

  if (s == NULL)
    return NULL;
  s->srv = srv;
  s->fd = fd;
  s->id = ++srv->next_id;
  s->born_ns = mokd_now_ns();
  /* the CPU backend, or placed on a GPU at Hello */
  s->backend = srv->backend;
  s->device = mokk_backend_device(srv->backend);
  s->exec = srv->exec;
  mokd_limits lim = {.max_arena_bytes = (uint64_t)srv->cfg.max_arena_bytes,
                     .quota = {(uint64_t)srv->cfg.session_quota_bytes,
                               (uint64_t)srv->cfg.session_gpu_quota_bytes},
                     .max_arenas = (uint64_t)srv->cfg.max_arenas,
                     .daemon_max_arenas = srv->max_maps};
  mokd_registry_init(&s->reg, s->backend, &srv->next_id, &lim, &s->usage, &srv->usage);
  s->reg.pending_all = &srv->pending_maps;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0)
    s->pid = cr.pid, s->uid = cr.uid, s->gid = cr.gid;
  mokw_framer_init(&s->rx, (size_t)srv->cfg.max_frame_bytes);
  if (uv_poll_init(srv->loop, &s->poll, fd) != 0) {
    mokw_framer_free(&s->rx);
    free(s);
    return NULL;
  }
  s->poll.data = s;
  s->handle_open = 1;
  s->next = srv->sessions;
  if (srv->sessions != NULL)
    srv->sessions->prev = s;
  srv->sessions = s;
  srv->nsessions++;
  srv->usage.sessions++;
  s->usage.sessions = 1;
  mokd_session_arm(s);
  return s;
}

/* ---- input -------------------------------------------------------------- */

static void push_pending(mokd_session *s, mokd_pending *p)
{
  if (s->pend_tail != NULL)
    s->pend_tail->next = p;
  else
    s->pend_head = p;
  s->pend_tail = p;
  s->npending++;
  s->pending_fds += p->nfds;
}


static void take_rxfd(mokd_session *s, int i)
{
  memmove(&s->rxfds[i], &s->rxfds[i + 1], (size_t)(s->nrxfds - i - 1) * sizeof *s->rxfds);
  s->nrxfds--;
}

static void mark_bad_fds(mokd_pending *p)
{
  if (p->bad == 0) {
    p->bad = MOK_EINVAL;
    p->bad_id = p->req != NULL ? p->req->id : 0;
  }
}

/* Gives the frame [at, end) the fds it takes: those that came with the read
 * holding its first byte. fds whose read ended inside this frame belong to no
 * later frame: they were sent where none is expected. A read whose fds the
 * kernel dropped spoils the first frame it overlaps. */
static void attach_fds(mokd_session *s, mokd_pending *p, uint64_t at, uint64_t end,
                       int expects)
{
  for (int i = 0; i < s->nrxfds;) {
    mokd_rxfd *r = &s->rxfds[i];
    if (r->fd < 0 && r->c0 < end) {
      mark_bad_fds(p);
      p->lost_fds = 1;
      take_rxfd(s, i);
    } else if (r->fd >= 0 && expects > 0 && r->c0 <= at && at < r->c1) {
      p->fds[p->nfds++] = r->fd;
      expects--;
      take_rxfd(s, i);
    } else if (r->fd >= 0 && r->c1 <= end) {
      close(r->fd);
      take_rxfd(s, i);
      mark_bad_fds(p);
      p->extra_fds++;
    } else {
      i++;
    }
  }
}

static void parse_frames(mokd_session *s)
{
  for (;;) {
    const uint8_t *payload;
    size_t len;
    uint64_t at;
    int rc = mokw_framer_next(&s->rx, &payload, &len, &at);
    mokd_pending *p;

    if (rc == 0)
      return;
    if (rc == MOK_EMSGSIZE) {
      char msg[160];
      snprintf(msg, sizeof msg, "frame length prefix is over max_frame_bytes (%lld); "
               "closing the connection", (long long)s->srv->cfg.max_frame_bytes);
      mokd_session_fail(s, 0, MOK_EMSGSIZE, msg);
      return;
    }
    p = calloc(1, sizeof *p);
    if (p == NULL) {
      mokd_session_close(s, "out of memory");
      return;
    }
    if (rc == MOK_EPROTO) {
      p->bad = MOK_EPROTO;
      push_pending(s, p);
      continue;
    }
    p->req = mokd__request__unpack(NULL, len, payload);
    if (p->req == NULL)
      p->bad = MOK_EPROTO;
    attach_fds(s, p, at, at + MOKW_PREFIX + len, p->req != NULL ? mokd_dispatch_fds(p->req) : 0);
    push_pending(s, p);
  }
}

static int read_some(mokd_session *s)
{
  for (size_t got = 0;;) {
    size_t avail;
    uint8_t *dst = mokw_framer_space(&s->rx, READ_CHUNK, &avail);
    int fds[MOKW_MAX_FDS], nfds = MOKW_MAX_FDS, ctrunc;
    ssize_t n;
    uint64_t c0 = mokw_framer_end(&s->rx);

    if (dst == NULL) {
      mokd_session_close(s, "out of memory for the read buffer");
      return -1;
    }
    n = mokw_recv(s->fd, dst, avail, MSG_DONTWAIT, fds, &nfds, &ctrunc);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return 0;
      if (errno == EINTR)
        continue;
      mokd_session_close(s, strerror(errno));
      return -1;
    }
    for (int i = 0; i < nfds + (ctrunc != 0); i++) {
      int fd = i < nfds ? fds[i] : -1; /* the last: the mark of dropped fds */
      if (s->nrxfds == (int)(sizeof s->rxfds / sizeof s->rxfds[0])) {
        if (fd >= 0)
          close(fd);
        continue;
      }
      s->rxfds[s->nrxfds++] = (mokd_rxfd){fd, c0, c0 + (uint64_t)(n > 0 ? n : 1)};
    }
    if (n == 0) {
      mokd_session_close(s, "peer closed the connection");
      return -1;
    }
    mokw_framer_commit(&s->rx, (size_t)n);
    got += (size_t)n;
    if (pending_full(s) || got >= READ_MAX_TURN)
      return 0;
    if ((size_t)n < avail)
      return 0;
  }
}

static void on_readable(mokd_session *s)
{
  if (read_some(s) != 0)
    return;
  parse_frames(s);
  mokd_session_pump(s);
  if (s->fatal && s->out_head == NULL && !s->closing)
    mokd_session_close(s, "framing error");
}

static void on_poll(uv_poll_t *h, int status, int events)
{
  mokd_session *s = h->data;

  if (status < 0) {
    mokd_session_close(s, uv_strerror(status));
    return;
  }
  if (events & UV_WRITABLE)
    flush(s);
  if (s->fatal) {
    if (s->out_head == NULL && !s->closing)
      mokd_session_close(s, "framing error");
    return;
  }
  if (s->closing)
    return;
  if (events & UV_READABLE)
    on_readable(s);
  else
    mokd_session_pump(s); /* requests held while the replies were over the bound */
}
