/* groups.c - EP groups: P sessions, one per rank, each make a layer of the
 * same shape for group {id, P, rank}. The group forms when all P have joined
 * (every CreateLayer is answered then); a step runs once every rank has sent
 * its request, as one step over the P ranks (steps.c). A rank that leaves,
 * or one that is group_timeout_ms late, tears the group down: whoever waits
 * gets the error at once, and every member's layer says why from then on.
 * A step that cannot run (the ranks disagree, a rank's request is refused,
 * a rank releases its context of the forward a Backward is for) fails for
 * every rank at once, and the group stands for the next one.
 * Group ids are per uid: sessions of different users never meet. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "mokd.h"
#include "placement.h"

struct mokd_group {
  mokd_server *srv;
  uint64_t id;           /* the clients' */
  uint64_t serial;       /* the daemon's: which group a context is from */
  uid_t uid;
  int P;
  mokk_shape shape;
  mokk_grad_mode mode;
  int joined;
  int formed;            /* all P joined */
  mokd_layer **member;   /* [P] */
  uint64_t *join_id;     /* [P] CreateLayer requests waiting for the group to form */
  mokd_step **parked;    /* [P] requests of the step being gathered */
  int nparked;
  uv_timer_t timer;      /* from the first arrival to the last */
  struct mokd_group *next;
};

static mokd_group *group_find(mokd_server *srv, uid_t uid, uint64_t id)
{
  for (mokd_group *g = srv->groups; g != NULL; g = g->next)
    if (g->uid == uid && g->id == id)
      return g;
  return NULL;
}

static void group_freed(uv_handle_t *h)
{
  mokd_group *g = h->data;
  free(g->member);
  free(g->join_id);
  free(g->parked);
  free(g);
}

static void on_timeout(uv_timer_t *t);

static mokd_group *group_new(mokd_session *s, const mokd_layer *l, const Mokd__EpGroup *ep)
{
  mokd_group *g = calloc(1, sizeof *g);
  int P = (int)l->shape.P;

  if (g == NULL)
    return NULL;
  g->member = calloc((size_t)P, sizeof *g->member);
  g->join_id = calloc((size_t)P, sizeof *g->join_id);
  g->parked = calloc((size_t)P, sizeof *g->parked);
  if (g->member == NULL || g->join_id == NULL || g->parked == NULL ||
      uv_timer_init(s->srv->loop, &g->timer) != 0) {
    free(g->member);
    free(g->join_id);
    free(g->parked);
    free(g);
    return NULL;
  }
  g->timer.data = g;
  g->srv = s->srv;
  g->id = ep->id;
  g->serial = ++s->srv->next_id;
  g->uid = s->uid;
  g->P = P;
  g->shape = l->shape;
  g->mode = l->mode;
  g->next = s->srv->groups;
  s->srv->groups = g;
  return g;
}

static void timer_start(mokd_group *g)
{
  uv_timer_start(&g->timer, on_timeout, (uint64_t)g->srv->cfg.group_timeout_ms, 0);
}

/* A joiner's layer options against the group's: 0, or ESHAPE and the
 * difference. */
static int same_layer(const mokd_group *g, const mokd_layer *l, char *err)
{
  const mokk_shape *a = &g->shape, *b = &l->shape;

  if (a->H == b->H && a->I == b->I && a->E == b->E && a->K == b->K && a->I_s == b->I_s &&
      a->swiglu_limit == b->swiglu_limit &&
      g->mode == l->mode) {
    if (memcmp(&a->tune, &b->tune, sizeof a->tune) == 0)
      return 0;
    return mokk_fail(err, MOK_ESHAPE, "EP group %llu's layers chose kernel options other "
                     "than this rank's (mok_layer_tuning: tiles %d/%d, wgrad_tiles %d/%d, "
                     "clusters %d/%d, order %d/%d, tails %d/%d, dx %d/%d, dispatch_blocks "
                     "%d/%d); it was not joined (the others wait on)",
                     (unsigned long long)g->id, a->tune.tiles, b->tune.tiles,
                     a->tune.wgrad_tiles, b->tune.wgrad_tiles, a->tune.clusters,
                     b->tune.clusters, a->tune.order, b->tune.order, a->tune.tails,
                     b->tune.tails, a->tune.dx, b->tune.dx, a->tune.dispatch_blocks,
                     b->tune.dispatch_blocks);
  }
  return mokk_fail(err, MOK_ESHAPE, "EP group %llu has H=%lld I=%lld E=%lld K=%lld I_s=%lld "
                   "swiglu_limit=%g grad_mode=%d; this rank asks H=%lld I=%lld E=%lld K=%lld "
                   "I_s=%lld swiglu_limit=%g grad_mode=%d; it was not joined (the others "
                   "wait on)", (unsigned long long)g->id, (long long)a->H, (long long)a->I,
                   (long long)a->E, (long long)a->K, (long long)a->I_s,
                   (double)a->swiglu_limit, (int)g->mode, (long long)b->H, (long long)b->I,
                   (long long)b->E, (long long)b->K, (long long)b->I_s,
                   (double)b->swiglu_limit, (int)l->mode);
}

/* A group's step runs on one backend: its ranks' sessions use the same GPU
 * (virtual ranks of one device), or GPUs the daemon linked at start-up
 * (each rank on its own). */
static int same_device(const mokd_group *g, const mokd_session *s, char *err)
{
  for (int i = 0; i < g->P; i++) {
    const mokd_session *m = g->member[i] != NULL ? g->member[i]->owner : NULL;
    if (m == NULL)
      continue;
    switch (mokd_place_ranks(m->backend, m->device, s->backend, s->device,
                             s->srv->gpus_linked)) {
    case MOKD_PLACE_OK:
      break;
    case MOKD_PLACE_NOT_LINKED:
      return mokk_fail(err, MOK_ENOTSUP, "EP group %llu has rank %d on CUDA device %d; this "
                       "rank's session is on device %d, and this daemon could not link its "
                       "GPUs (peer access; see its start-up log): a group's ranks must share "
                       "one GPU; it was not joined (the others wait on)",
                       (unsigned long long)g->id, i, m->device, s->device);
    default:
      return mokk_fail(err, MOK_ENOTSUP, "EP group %llu runs on %s %d (rank %d's session); "
                       "this rank's session is on %s %d: a group's ranks must all be on "
                       "GPUs or all on the CPU; it was not joined (the others wait on)",
                       (unsigned long long)g->id, mokk_backend_name(m->backend), m->device, i,
                       mokk_backend_name(s->backend), s->device);
    }
  }
  return 0;
}

int mokd_group_spans(const mokd_layer *l)
{
  const mokd_group *g = l->group;
  for (int i = 0; g != NULL && i < g->P; i++)
    if (g->member[i] != NULL && g->member[i]->owner->backend != l->owner->backend)
      return 1;
  return 0;
}

int mokd_group_join(mokd_session *s, mokd_layer *l, const Mokd__EpGroup *ep, uint64_t req_id,
                    char *err)
{
  mokd_group *g = group_find(s->srv, s->uid, ep->id);
  int r = (int)ep->rank, rc;

  if (g != NULL) {
    if (g->formed)
      return mokk_fail(err, MOK_EEXIST, "EP group %llu is formed already (all %d ranks "
                       "joined); a new layer needs a new group id", (unsigned long long)ep->id,
                       g->P);
    if (g->P != l->shape.P)
      return mokk_fail(err, MOK_EGROUP, "EP group %llu has size %d; this rank says %lld; it "
                       "was not joined (the others wait on)", (unsigned long long)ep->id, g->P,
                       (long long)l->shape.P);
    if ((rc = same_layer(g, l, err)))
      return rc;
    if ((rc = same_device(g, s, err)))
      return rc;
    if (g->member[r] != NULL)
      return mokk_fail(err, MOK_EEXIST, "rank %d of EP group %llu is taken already (session "
                       "%llu, pid %d); it was not joined (the others wait on)", r,
                       (unsigned long long)ep->id, (unsigned long long)g->member[r]->owner->id,
                       (int)g->member[r]->owner->pid);
    for (int i = 0; i < g->P; i++)
      if (g->member[i] != NULL && g->member[i]->owner == s)
        return mokk_fail(err, MOK_EGROUP, "this session holds rank %d of EP group %llu "
                         "already; every rank needs a session of its own (a session runs "
                         "one request at a time)", i, (unsigned long long)ep->id);
  } else if ((g = group_new(s, l, ep)) == NULL) {
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  g->member[r] = l;
  g->join_id[r] = req_id;
  g->joined++;
  l->group = g;
  l->rank = r;
  l->owner = s;
  if (g->joined < g->P) {
    s->parked = 1;
    if (g->joined == 1)
      timer_start(g);
    return 0;
  }
  g->formed = 1;
  uv_timer_stop(&g->timer);
  LOG_INFO(SESS, "EP group %llu of uid %u formed: %d ranks", (unsigned long long)g->id,
           (unsigned)g->uid, g->P);
  mokd_send_layer_created(s, req_id, l);
  for (int i = 0; i < g->P; i++) {
    mokd_session *m = g->member[i]->owner;
    if (m == s)
      continue;
    m->parked = 0;
    mokd_send_layer_created(m, g->join_id[i], g->member[i]);
    mokd_session_pump(m);
  }
  return 0;
}

int mokd_group_usable(const mokd_layer *l, char *err)
{
  if (l->lost != NULL)
    return mokk_fail(err, MOK_EGROUP, "%s; destroy this layer and create it again (a new "
                     "group)", l->lost);
  if (l->shape.P > 1 && l->group == NULL)
    return mokk_fail(err, MOK_EGROUP, "the EP group of this layer was torn down; destroy "
                     "this layer and create it again (a new group)");
  if (l->group != NULL && !l->group->formed)
    return mokk_fail(err, MOK_EGROUP, "EP group %llu has not formed yet (%d of %d ranks "
                     "joined)", (unsigned long long)l->group->id, l->group->joined,
                     l->group->P);
  return 0;
}

uint64_t mokd_group_serial(const mokd_layer *l)
{
  return l->group != NULL ? l->group->serial : 0;
}

mokd_step *mokd_group_first(const mokd_layer *l)
{
  const mokd_group *g = l->group;
  if (g == NULL || g->nparked == 0)
    return NULL;
  for (int r = 0; r < g->P; r++)
    if (g->parked[r] != NULL)
      return g->parked[r];
  return NULL;
}

/* Takes the parked steps out of g into out (rank order; NULL where none). */
static void take_parked(mokd_group *g, mokd_step **out)
{
  memcpy(out, g->parked, (size_t)g->P * sizeof *out);
  memset(g->parked, 0, (size_t)g->P * sizeof *g->parked);
  g->nparked = 0;
  uv_timer_stop(&g->timer);
}

void mokd_group_park(mokd_layer *l, mokd_step *j)
{
  mokd_group *g = l->group;
  mokd_step **steps;

  g->parked[l->rank] = j;
  l->owner->parked = 1;
  if (++g->nparked == 1)
    timer_start(g);
  if (g->nparked < g->P)
    return;
  if ((steps = malloc((size_t)g->P * sizeof *steps)) == NULL) {
    mokd_group_fail_step(l, MOK_ENOMEM, "out of memory for a step of an EP group");
    return;
  }
  take_parked(g, steps);
  for (int r = 0; r < g->P; r++)
    g->member[r]->owner->parked = 0; /* busy from here: the step is in flight */
  mokd_steps_run_group(steps, g->P);
}

/* Fails the steps parked in g, in rank order. Failing one runs its session's
 * next requests, which may park a new step of that rank, in a slot already
 * passed, or tear g down, which takes the rest; g itself stays allocated
 * until the loop's next turn. */
static void fail_parked(mokd_group *g, int code, const char *msg)
{
  g->nparked = 0;
  uv_timer_stop(&g->timer);
  for (int r = 0; r < g->P; r++) {
    mokd_step *j = g->parked[r];
    if (j == NULL)
      continue;
    g->parked[r] = NULL;
    mokd_step_fail(j, code, msg);
  }
}

void mokd_group_fail_step(mokd_layer *l, int code, const char *msg)
{
  fail_parked(l->group, code, msg);
}

/* Unlinks g and answers everyone who waits for it with code and msg: parked
 * steps fail; joins that wait for the group to form fail and their layers
 * go (except in closing sessions, whose layers go with them); each member
 * layer of a formed group keeps msg as the reason its group is gone. No
 * request reaches g once it is unlinked and its layers let go of it. */
static void teardown(mokd_group *g, int code, const char *msg)
{
  mokd_server *srv = g->srv;

  for (mokd_group **pp = &srv->groups; *pp != NULL; pp = &(*pp)->next)
    if (*pp == g) {
      *pp = g->next;
      break;
    }
  LOG_INFO(SESS, "EP group %llu of uid %u torn down: %s", (unsigned long long)g->id,
           (unsigned)g->uid, msg);
  for (int r = 0; r < g->P; r++)
    if (g->member[r] != NULL) {
      g->member[r]->group = NULL;
      if (g->formed)
        g->member[r]->lost = strdup(msg); /* NULL: mokd_group_usable says it shorter */
    }
  uv_close((uv_handle_t *)&g->timer, group_freed); /* frees g on the loop's next turn */
  fail_parked(g, code, msg);
  for (int r = 0; !g->formed && r < g->P; r++) {
    mokd_layer *l = g->member[r];
    mokd_session *s;
    if (l == NULL)
      continue;
    s = l->owner;
    s->parked = 0;
    if (s->closing)
      continue;
    mokd_reply_error(s, g->join_id[r], code, msg);
    mokd_layer_free(s, l);
    mokd_session_pump(s);
  }
}

void mokd_group_leave(mokd_layer *l, const char *why)
{
  mokd_group *g = l->group;
  char msg[MOK_ERRLEN];

  l->group = NULL;
  l->owner->parked = 0;
  g->member[l->rank] = NULL;
  snprintf(msg, sizeof msg, "EP group %llu was torn down: rank %d %s",
           (unsigned long long)g->id, l->rank, why);
  if (g->parked[l->rank] != NULL) { /* its own parked step: failed unanswered (closing) */
    mokd_step *j = g->parked[l->rank];
    g->parked[l->rank] = NULL;
    g->nparked--;
    mokd_step_fail(j, MOK_EGROUP, msg);
  }
  teardown(g, MOK_EGROUP, msg);
}

void mokd_groups_session_closing(mokd_session *s)
{
  for (mokd_layer *l = s->layers; l != NULL; l = l->next)
    if (l->group != NULL)
      mokd_group_leave(l, "left: its session closed");
}

void mokd_groups_drain(mokd_server *srv)
{
  while (srv->groups != NULL) {
    char msg[MOK_ERRLEN];
    snprintf(msg, sizeof msg, "mokd is shutting down; EP group %llu was torn down",
             (unsigned long long)srv->groups->id);
    teardown(srv->groups, MOK_ESHUTDOWN, msg);
  }
}

/* The ranks missing from g (those without a join, or without a parked step):
 * "ranks 2, 3" or "rank 2". */
static void missing_ranks(const mokd_group *g, char *out, size_t n)
{
  int count = 0;
  size_t at = 0;

  for (int r = 0; r < g->P; r++)
    count += g->formed ? g->parked[r] == NULL : g->member[r] == NULL;
  at = (size_t)snprintf(out, n, "%s", count > 1 ? "ranks" : "rank");
  for (int r = 0, k = 0; r < g->P && at < n; r++) {
    if (g->formed ? g->parked[r] != NULL : g->member[r] != NULL)
      continue;
    if (k == 8) {
      snprintf(out + at, n - at, " and %d more", count - k);
      break;
    }
    at += (size_t)snprintf(out + at, n - at, "%s %d", k++ ? "," : "", r);
  }
}

static void on_timeout(uv_timer_t *t)
{
  mokd_group *g = t->data;
  char who[128], msg[MOK_ERRLEN];

  missing_ranks(g, who, sizeof who);
  if (g->formed) {
    snprintf(msg, sizeof msg, "EP group %llu was torn down: %s of %d did not send the step "
             "within %lld ms of the first (group_timeout_ms)", (unsigned long long)g->id,
             who, g->P, (long long)g->srv->cfg.group_timeout_ms);
  } else {
    snprintf(msg, sizeof msg, "EP group %llu did not form: %s of %d did not join within %lld "
             "ms of the first (group_timeout_ms)", (unsigned long long)g->id, who, g->P,
             (long long)g->srv->cfg.group_timeout_ms);
  }
  teardown(g, MOK_ETIMEDOUT, msg);
}
