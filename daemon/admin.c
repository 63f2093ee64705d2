/* admin.c - the operators' requests: ListSessions (who is connected, their
 * job, their memory), Evict (close a job's sessions and free what they
 * hold; root or the daemon's uid only) and Health (a round trip through
 * every executor and its backend, unless one is already stuck). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "mokd.h"

/* root and the daemon's own uid run the daemon; anyone else is a tenant */
static int privileged(const mokd_session *s)
{
  return s->uid == 0 || s->uid == geteuid();
}

int mokd_h_list_sessions(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err)
{
  mokd_server *srv = s->srv;
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__SessionList list = MOKD__SESSION_LIST__INIT;
  Mokd__SessionInfo *info, **ptrs;
  uint64_t now = mokd_now_ns();
  size_t n = 0;

  (void)fds, (void)nfds;
  info = calloc((size_t)srv->nsessions + 1, sizeof *info);
  ptrs = calloc((size_t)srv->nsessions + 1, sizeof *ptrs);
  if (info == NULL || ptrs == NULL) {
    free(info);
    free(ptrs);
    return mokk_fail(err, MOK_ENOMEM, "out of memory listing %d sessions", srv->nsessions);
  }
  /* a tenant sees its own uid's sessions only */
  for (mokd_session *o = srv->sessions; o != NULL; o = o->next) {
    Mokd__SessionInfo *i = &info[n];
    if (!privileged(s) && o->uid != s->uid)
      continue;
    mokd__session_info__init(i);
    i->id = o->id, i->pid = o->pid, i->uid = o->uid, i->gid = o->gid;
    i->client_name = o->name;
    i->job_id = o->job;
    i->device = o->device + 1;
    i->arena_bytes = o->usage.arena_bytes;
    i->context_bytes = o->usage.context_bytes;
    i->gpu_bytes = o->usage.gpu_bytes;
    i->contexts = o->usage.contexts;
    i->layers = o->usage.layers;
    i->requests = o->usage.requests;
    i->age_ns = now - o->born_ns;
    ptrs[n++] = i;
  }
  list.n_sessions = n;
  list.sessions = ptrs;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_SESSION_LIST;
  r.session_list = &list;
  mokd_send(s, &r, NULL, 0);
  free(info);
  free(ptrs);
  return 0;
}

int mokd_h_evict(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                 char *err)
{
  const Mokd__Evict *e = q->evict;
  const char *job = e->job_id != NULL ? e->job_id : "";
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Evicted ev = MOKD__EVICTED__INIT;
  char msg[160];

  (void)fds, (void)nfds;
  if (!privileged(s))
    return mokk_fail(err, MOK_EPERM, "evict: only root or the daemon's uid (%u) may evict; "
                     "this peer is uid %u", (unsigned)geteuid(), (unsigned)s->uid);
  if (e->session == 0 && job[0] == 0)
    return mokk_fail(err, MOK_EINVAL, "evict: name a job id or a session");
  if (e->session != 0)
    snprintf(msg, sizeof msg, "evicted by uid %u (session %llu)", (unsigned)s->uid,
             (unsigned long long)e->session);
  else
    snprintf(msg, sizeof msg, "evicted by uid %u (job %.64s)", (unsigned)s->uid, job);
  for (mokd_session *o = s->srv->sessions; o != NULL; o = o->next) {
    if (o == s || o->closing || !o->hello_done ||
        (e->session != 0 ? o->id != e->session : strcmp(o->job, job) != 0))
      continue;
    LOG_INFO(SESS, SESS_FMT "%s", SESS_ARGS(o), msg);
    /* told why on request id 0, then closed; its memory goes with it, once
     * a step in flight has come back */
    mokd_session_fail(o, 0, MOK_ESHUTDOWN, msg);
    ev.count++;
    s->srv->metrics.evictions++;
  }
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_EVICTED;
  r.evicted = &ev;
  mokd_send(s, &r, NULL, 0);
  return 0;
}

/* ---- health ---------------------------------------------------------------- */

typedef struct probe_set probe_set;

typedef struct probe {
  mokd_work work;
  probe_set *set;
  mokk_backend *backend;
  int rc;
  char err[MOK_ERRLEN];
} probe;

struct probe_set {
  mokd_session *s;
  uint64_t req_id;
  uint64_t t0;
  int left;
  int n;
  probe p[MOKD_MAX_GPUS];
};

static void probe_work(mokd_work *w)
{
  probe *p = (probe *)w;
  p->rc = mokk_backend_check(p->backend, p->err);
}

static void health_reply(mokd_session *s, uint64_t id, int ready, const char *reason,
                         uint64_t rtt)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__HealthReply h = MOKD__HEALTH_REPLY__INIT;
  h.ready = ready;
  h.reason = (char *)reason;
  h.round_trip_ns = rtt;
  r.id = id;
  r.body_case = MOKD__RESPONSE__BODY_HEALTH;
  r.health = &h;
  mokd_send(s, &r, NULL, 0);
}

static void probe_done(mokd_work *w)
{
  probe *p = (probe *)w;
  probe_set *set = p->set;
  mokd_session *s = set->s;
  mokd_server *srv = s->srv;

  if (--set->left > 0)
    return;
  s->probes = 0;
  if (!s->closing) {
    const char *why = "";
    for (int i = 0; i < set->n && why[0] == 0; i++)
      if (set->p[i].rc != 0)
        why = set->p[i].err;
    if (why[0] != 0)
      LOG_WARN(EXEC, "health: %s", why);
    health_reply(s, set->req_id, why[0] == 0, why, mokd_now_ns() - set->t0);
  }
  free(set);
  if (s->closing)
    mokd_session_maybe_destroy(s);
  else
    mokd_session_pump(s);
  mokd_server_maybe_stop(srv);
}

int mokd_h_health(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                  char *err)
{
  mokd_server *srv = s->srv;
  char why[MOK_ERRLEN];
  probe_set *set;

  (void)fds, (void)nfds;
  if (mokd_server_stuck(srv, why, sizeof why) != 0) {
    health_reply(s, q->id, 0, why, 0);
    return 0;
  }
  if (srv->draining) {
    health_reply(s, q->id, 0, "mokd is shutting down", 0);
    return 0;
  }
  if ((set = calloc(1, sizeof *set)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory for a health probe");
  set->s = s;
  set->req_id = q->id;
  set->t0 = mokd_now_ns();
  set->n = srv->ngpus > 0 ? srv->ngpus : 1;
  set->left = set->n;
  s->probes = set->n; /* the session's queue waits, so replies stay in order */
  for (int i = 0; i < set->n; i++) {
    probe *p = &set->p[i];
    p->set = set;
    p->backend = srv->ngpus > 0 ? srv->gpus[i].backend : srv->backend;
    mokd_executor_queue(srv->ngpus > 0 ? srv->gpus[i].exec : srv->exec, &p->work, probe_work,
                        probe_done);
  }
  return 0;
}
