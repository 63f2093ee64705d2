/* dispatch.c - one row per request body: its handler, how many fds it takes,
 * whether it may come before Hello, whether a draining daemon refuses it.
 * Requests of a session run strictly in order: while a step is in flight, or
 * a request waits for the other ranks of its EP group, the queue waits, so a
 * reply never overtakes an earlier one; while the peer leaves too many
 * replies unread, it waits too. Each row also names the oldest protocol that
 * has the body: a session that chose an older one at Hello is told to
 * upgrade instead. */
#include <stdio.h>

#include "mokd.h"

typedef struct route {
  const char *name;
  mokd_handler handler;
  int (*fds)(const Mokd__Request *q); /* NULL: takes none */
  int before_hello;
  int refused_draining; /* new work: a draining daemon only finishes what it has */
  uint32_t since;       /* protocol version that brought it; 0 = 1 */
} route;

#define ROUTE(body) [MOKD__REQUEST__BODY_##body]

static const route routes[] = {
    ROUTE(HELLO) = {"Hello", mokd_h_hello, NULL, 1, 0},
    ROUTE(CREATE_ARENA) = {"CreateArena", mokd_h_create_arena, NULL, 0, 1},
    ROUTE(IMPORT_BUFFER) = {"ImportBuffer", mokd_h_import_buffer, mokd_import_fds, 0, 0},
    ROUTE(DESTROY_ARENA) = {"DestroyArena", mokd_h_destroy_arena, NULL, 0, 0},
    ROUTE(CREATE_LAYER) = {"CreateLayer", mokd_h_create_layer, NULL, 0, 1},
    ROUTE(SET_WEIGHTS) = {"SetWeights", mokd_h_set_weights, NULL, 0, 0},
    ROUTE(FORWARD) = {"Forward", mokd_h_forward, NULL, 0, 1},
    ROUTE(BACKWARD) = {"Backward", mokd_h_backward, NULL, 0, 1},
    ROUTE(RELEASE) = {"Release", mokd_h_release, NULL, 0, 0},
    ROUTE(DESTROY_LAYER) = {"DestroyLayer", mokd_h_destroy_layer, NULL, 0, 0},
    ROUTE(STATS) = {"Stats", mokd_h_stats, NULL, 0, 0},
    ROUTE(PING) = {"Ping", mokd_h_ping, NULL, 0, 0},
    ROUTE(LIST_SESSIONS) = {"ListSessions", mokd_h_list_sessions, NULL, 0, 0, 2},
    ROUTE(EVICT) = {"Evict", mokd_h_evict, NULL, 0, 0, 2},
    ROUTE(HEALTH) = {"Health", mokd_h_health, NULL, 0, 0, 2},
};
_Static_assert(sizeof routes / sizeof routes[0] <= MOKD_METRIC_OPS,
               "a request body has no metrics counter");

static const route *route_of(const Mokd__Request *q)
{
  size_t b = (size_t)q->body_case;
  return b < sizeof routes / sizeof routes[0] && routes[b].handler != NULL ? &routes[b] : NULL;
}

const char *mokd_dispatch_op_name(int body_case)
{
  size_t b = (size_t)body_case;
  return b < sizeof routes / sizeof routes[0] ? routes[b].name : NULL;
}

int mokd_dispatch_fds(const Mokd__Request *q)
{
  const route *r = route_of(q);
  return r != NULL && r->fds != NULL ? r->fds(q) : 0;
}

/* What was wrong with the fds of a frame (p->bad == MOK_EINVAL). */
static const char *fd_count(int want, char *buf, size_t len)
{
  if (want == 1)
    return "one fd";
  snprintf(buf, len, "%d fds", want);
  return buf;
}

static int bad_fds(const mokd_pending *p, char *err)
{
  char n[16];
  const route *r = p->req != NULL ? route_of(p->req) : NULL;
  int want = r != NULL && r->fds != NULL ? r->fds(p->req) : 0;

  if (p->lost_fds)
    return mokk_fail(err, MOK_EINVAL, "more than %d file descriptors came on one message; "
                     "the daemon takes at most %d at once and the kernel dropped the rest; "
                     "the request was not run", MOKW_MAX_FDS, MOKW_MAX_FDS);
  if (want == 0)
    return mokk_fail(err, MOK_EINVAL, "a file descriptor came with a request that takes "
                     "none; it was closed and the request not run");
  return mokk_fail(err, MOK_EINVAL, "%s takes exactly %s (SCM_RIGHTS) on its frame; %d "
                   "came; they were closed and the request not run", r->name,
                   fd_count(want, n, sizeof n), p->nfds + p->extra_fds);
}

/* What refuses a request before its handler runs: 0 and its route, or a
 * MOK_* code and why. */
static int admit(mokd_session *s, const mokd_pending *p, const route **out, char *err)
{
  const Mokd__Request *q = p->req;
  const route *r;
  uint32_t unknown;
  char n[16];

  if (p->bad == MOK_EPROTO)
    return mokk_fail(err, MOK_EPROTO, q == NULL ? "frame is not a packed Request "
                     "(garbage or a zero-length frame)" : "malformed request");
  if (p->bad == MOK_EINVAL)
    return bad_fds(p, err);
  /* Hello is read leniently: a newer client learns which versions we speak */
  if (q->body_case != MOKD__REQUEST__BODY_HELLO && mokw_find_unknown_field(&q->base, &unknown))
    return mokk_fail(err, MOK_EPROTO, "request carries unknown field %u; this daemon "
                     "speaks protocol %d to %d", unknown, MOK_PROTOCOL_MIN, MOK_PROTOCOL_VERSION);
  if ((r = route_of(q)) == NULL)
    return mokk_fail(err, MOK_EPROTO, "request has no body, or a body this daemon does "
                     "not know");
  if (s->hello_done && r->since > s->proto)
    return mokk_fail(err, MOK_EPROTO, "%s needs protocol %u; this session chose %u at Hello "
                     "(upgrade the client)", r->name, r->since, s->proto);
  if (!s->hello_done && !r->before_hello)
    return mokk_fail(err, MOK_EPROTO, "send Hello first");
  if (s->srv->draining && r->refused_draining)
    return mokk_fail(err, MOK_ESHUTDOWN, "mokd is shutting down; no new work is taken");
  if (p->nfds < mokd_dispatch_fds(q))
    return mokk_fail(err, MOK_EINVAL, "%s needs exactly %s (SCM_RIGHTS) on its own frame",
                     r->name, fd_count(mokd_dispatch_fds(q), n, sizeof n));
  *out = r;
  return 0;
}

static int handle(mokd_session *s, const mokd_pending *p, char *err)
{
  const route *r = NULL;
  int rc;

  if (s->reg.pending != NULL && !mokd_import_continues(s, p->req)) {
    mokd_import_drop(&s->reg); /* a chunked import's frames come back to back */
    mokd_server_reap(s->srv);
  }
  rc = admit(s, p, &r, err);

  if (rc != 0)
    mokd_steps_refused(s, p->req, err); /* a step the rank's EP group waits for */
  else
    rc = r->handler(s, p->req, p->fds, p->nfds, err);
  if (rc != 0 && s->reg.pending != NULL) { /* any error drops a chunked import */
    mokd_import_drop(&s->reg);
    mokd_server_reap(s->srv);
  }
  return rc;
}

void mokd_session_pump(mokd_session *s)
{
  while (!s->closing && s->busy == NULL && !s->parked && s->probes == 0 &&
         s->pend_head != NULL && !mokd_session_out_full(s)) {
    mokd_pending *p = s->pend_head;
    char err[MOK_ERRLEN] = "";
    int rc;

    s->pend_head = p->next;
    if (s->pend_head == NULL)
      s->pend_tail = NULL;
    s->npending--;
    s->pending_fds -= p->nfds;
    s->usage.requests++;
    s->srv->usage.requests++;
    s->op = p->req != NULL && route_of(p->req) != NULL ? (int)p->req->body_case : 0;
    s->srv->metrics.requests[s->op]++;
    rc = handle(s, p, err);
    if (rc != 0)
      mokd_reply_error(s, p->req != NULL ? p->req->id : p->bad_id, rc, err);
    mokd_pending_free(p);
  }
  if (s->busy == NULL && !s->parked && s->probes == 0)
    s->op = 0; /* errors outside any request (framing) count as invalid */
  mokd_session_arm(s);
}
