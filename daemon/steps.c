/* steps.c - Forward and Backward, from request to reply: the tensors are
 * checked and resolved, the outputs get a block of an output arena, the step
 * is queued on the session's executor (step_work runs it on the backend,
 * between mokk_step_begin and mokk_step_end), and step_done sends the reply
 * that names the outputs. A step of an EP group's layer is parked
 * (groups.c) until every rank has sent its own; then rank 0's step carries
 * all of them to the executor as one step over P ranks, and each rank gets
 * its own reply. On a device
 * backend the reply leaves while the device still works: it carries the done
 * event, and a status word for the errors only the device can see. The
 * results themselves (charges, outputs, release) live in results.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mokd.h"

struct mokd_step {
  mokd_work work;           /* first: the executor's part */
  mokd_session *sess;
  uint64_t req_id;
  int backward;
  mokk_backend *backend;
  mokk_shape shape;
  int64_t T;
  mokk_fwd_rank fr;
  mokk_bwd_rank br;
  mokk_grad_mode mode;
  unsigned bwd_flags;       /* MOKK_BWD_LAST: Backward.last */
  mokk_ctx *ctx;
  int want_ctx;
  mokk_events **events;     /* the session's, made by the first step that needs them */
  int has_ready;
  uint8_t ready[MOKK_IPC_BYTES]; /* the client's ready event */
  uint8_t done[MOKK_IPC_BYTES];  /* the done event, filled by step_work */
  int has_done;
  int32_t *status;               /* device word the step's status goes to */
  Mokd__TensorRef *status_ref;
  mokd_result *res;
  mokd_step **ranks;        /* rank 0's step of a group run: every rank's, [P] */
  int P;
  int rank;                 /* in the EP group */
  uint64_t group;           /* serial of the group (mokd_group_serial); 0 alone */
  uint64_t t_parked;        /* mokd_now_ns() when it parked to wait for the other ranks */
  mokd_gctx *gctx;          /* a group backward: the forward's state (held while it runs) */
  Mokd__TensorRef *refs[2 + MOKK_NWEIGHTS]; /* output refs to send back */
  int nrefs;
  int rc;
  char err[MOK_ERRLEN];
};

/* ---- a step --------------------------------------------------------------- */

static mokd_step *step_new(mokd_session *s, uint64_t id)
{
  mokd_step *j = calloc(1, sizeof *j);
  if (j != NULL) {
    j->sess = s;
    j->req_id = id;
    j->backend = s->backend;
    j->events = &s->events;
  }
  return j;
}

static void step_free(mokd_step *j)
{
  for (int i = 0; i < j->nrefs; i++)
    mokd_ref_free(j->refs[i]);
  mokd_ref_free(j->status_ref);
  free(j->ranks);
  free(j);
}

static void gctx_unref(mokd_gctx *g)
{
  if (--g->refs > 0)
    return;
  mokk_ctx_free(g->backend, g->ctx);
  free(g);
}

void mokd_gctx_drop(mokd_session *s, const mokd_result *c)
{
  mokd_gctx *g = c->gctx;
  mokd_layer *l = mokd_layer_find(s, c->layer);
  const mokd_step *f = l != NULL ? mokd_group_first(l) : NULL;

  g->dropped = 1;
  if (f != NULL && f->backward && f->gctx == g) { /* the others wait for this rank in vain */
    char msg[MOK_ERRLEN];
    snprintf(msg, sizeof msg, "EP rank %d released its context %llu of the forward this "
             "Backward names; a group's Backward needs every rank's", l->rank,
             (unsigned long long)c->id);
    mokd_group_fail_step(l, MOK_ECONTEXT, msg);
  }
  gctx_unref(g);
}

static int check_ready(mokd_session *s, const ProtobufCBinaryData *ev, char *err)
{
  if (ev->len == 0)
    return 0;
  if (s->device < 0)
    return mokk_fail(err, MOK_EINVAL, "ready_event is a CUDA event; this daemon runs the %s "
                     "backend", mokk_backend_name(s->backend));
  if (ev->len != MOKK_IPC_BYTES)
    return mokk_fail(err, MOK_EINVAL, "ready_event holds %zu bytes; a cudaIpcEventHandle_t "
                     "has %d", ev->len, MOKK_IPC_BYTES);
  return 0;
}

static void set_ready(mokd_step *j, const ProtobufCBinaryData *ev)
{
  if (ev->len == MOKK_IPC_BYTES) {
    memcpy(j->ready, ev->data, MOKK_IPC_BYTES);
    j->has_ready = 1;
  }
}

/* On a device backend each step also returns a status word (i32 [1]), last
 * in its block of outputs. */
static int status_slot(mokd_session *s, mokd_step *j, mokd_result *r, size_t off, char *err)
{
  static const int64_t one[1] = {1};
  if (s->device < 0)
    return 0;
  j->status = (int32_t *)((char *)r->out_arena->base + off);
  if ((j->status_ref = mokd_ref_new(r->out_arena->id, off, MOKD__DTYPE__DTYPE_I32, 1, one)) ==
      NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  return 0;
}

/* On an executor thread. A device step is only queued here: it waits on the
 * device for the client's ready event, and the done event recorded after it
 * goes back with the reply. Nothing here waits for the device. */
static void step_work(mokd_work *w)
{
  mokd_step *j = (mokd_step *)w;
  int rc = mokk_step_begin(j->backend, j->events, j->has_ready ? j->ready : NULL, j->err);

  if (rc == 0 && j->backward)
    rc = mokk_backward_flags(j->backend, j->ctx, j->mode, j->bwd_flags, &j->br, j->err);
  else if (rc == 0)
    rc = mokk_forward(j->backend, &j->shape, j->T, &j->fr, j->want_ctx ? &j->ctx : NULL,
                      j->err);
  if (rc == 0 && *j->events != NULL &&
      (rc = mokk_step_end(j->backend, *j->events, j->status, 1, j->done, j->err)) == 0)
    j->has_done = 1;
  if (rc != 0 && !j->backward && j->ctx != NULL) {
    mokk_ctx_free(j->backend, j->ctx);
    j->ctx = NULL;
  }
  j->rc = rc;
}

static void send_step_reply(mokd_session *s, mokd_step *j)
{
  mokd_result *r = j->res;
  Mokd__Response resp = MOKD__RESPONSE__INIT;
  Mokd__NewArena na = MOKD__NEW_ARENA__INIT, *nap = &na;
  Mokd__Timing tm = MOKD__TIMING__INIT;
  Mokd__ForwardDone fd = MOKD__FORWARD_DONE__INIT;
  Mokd__BackwardDone bd = MOKD__BACKWARD_DONE__INIT;
  ProtobufCBinaryData done = {j->has_done ? MOKK_IPC_BYTES : 0, j->done};

  tm.queued_ns = j->work.t_start - j->work.t_queued;
  tm.compute_ns = j->work.t_end - j->work.t_start;
  resp.id = j->req_id;
  if (r->out_arena->fd >= 0) { /* first reply naming this output arena */
    na.arena = r->out_arena->id;
    na.bytes = r->out_arena->bytes;
    na.device = r->out_arena->device + 1; /* the wire: ordinal + 1, 0 = host */
    resp.n_new_arenas = 1;
    resp.new_arenas = &nap;
  }
  if (j->backward) {
    bd.result = r->id;
    bd.d_x = j->refs[0];
    bd.d_topk_weights = j->refs[1];
    bd.n_grads = (size_t)(j->nrefs - 2);
    bd.grads = j->refs + 2;
    bd.timing = &tm;
    bd.status = j->status_ref;
    bd.done_event = done;
    resp.body_case = MOKD__RESPONSE__BODY_BACKWARD_DONE;
    resp.backward_done = &bd;
  } else {
    fd.context = r->id;
    fd.out = j->refs[0];
    fd.timing = &tm;
    fd.status = j->status_ref;
    fd.done_event = done;
    resp.body_case = MOKD__RESPONSE__BODY_FORWARD_DONE;
    resp.forward_done = &fd;
  }
  if (resp.n_new_arenas > 0) {
    mokd_send(s, &resp, &r->out_arena->fd, 1);
    close(r->out_arena->fd);
    r->out_arena->fd = -1;
  } else {
    mokd_send(s, &resp, NULL, 0);
  }
}

/* On the loop thread, once step_work has run. */
static void step_done(mokd_work *w)
{
  mokd_step *j = (mokd_step *)w;
  mokd_session *s = j->sess;
  mokd_result *r = j->res;
  int rc = j->rc;

  s->busy = NULL;
  if (rc == 0 && !j->backward && j->ctx != NULL) {
    r->ctx = j->ctx; /* from the bound charged before the step to what it holds */
    rc = mokd_result_charge(s, r, mokk_ctx_bytes(s->backend, j->ctx), j->err);
  }
  if (j->backward)
    s->usage.backwards++, s->srv->usage.backwards++;
  else
    s->usage.forwards++, s->srv->usage.forwards++;
  s->t->queued--, s->t->steps++;
  if (s->closing) {
    mokd_server *srv = s->srv;
    mokd_result_free(s, r);
    step_free(j);
    mokd_session_maybe_destroy(s);
    mokd_server_maybe_stop(srv);
    return;
  }
  if (rc != 0) {
    mokd_reply_error(s, j->req_id, rc, j->err);
    mokd_result_free(s, r);
  } else {
    send_step_reply(s, j);
  }
  step_free(j);
  mokd_session_pump(s);
  mokd_server_maybe_stop(s->srv);
}

/* ---- a step of an EP group ------------------------------------------------ */

/* A group step on a device backend: the step waits for every rank's ready
 * event, and each rank gets its status word and its done event, as a step
 * of one rank does. The step runs on rank 0's backend; a rank whose session
 * is on another (linked) GPU keeps its events on its own GPU (made by its
 * session's backend), which the step's backend waits on and records on that
 * GPU, so that its client only ever meets events of its device. */
static int group_begin(mokd_step *j0)
{
  for (int r = 0; r < j0->P; r++) {
    mokd_step *j = j0->ranks[r];
    int rc = mokk_events_make(j->backend, j->events, j0->err);
    if (rc == 0)
      rc = mokk_step_begin(j0->backend, j->events, j->has_ready ? j->ready : NULL, j0->err);
    if (rc != 0)
      return rc;
  }
  return 0;
}

static int group_end(mokd_step *j0)
{
  for (int r = 0; r < j0->P; r++) {
    mokd_step *j = j0->ranks[r];
    int rc;
    if (*j->events == NULL)
      continue;
    rc = mokk_step_end(j0->backend, *j->events, j->status, r == j0->P - 1, j->done, j0->err);
    if (rc != 0)
      return rc;
    j->has_done = 1;
  }
  return 0;
}

/* On an executor thread: one step over the P ranks (the CPU engine moves the
 * rows between them as a dispatch and combine would; the CUDA backend runs
 * them as virtual ranks of its one device, or each on its session's GPU). */
static void group_work(mokd_work *w)
{
  mokd_step *j = (mokd_step *)w;
  mokk_fwd_rank *fr = NULL;
  mokk_bwd_rank *br = NULL;
  int rc = group_begin(j);

  if (rc != 0) {
    j->rc = rc;
    return;
  }
  if (j->backward && (br = malloc((size_t)j->P * sizeof *br)) != NULL) {
    for (int r = 0; r < j->P; r++) {
      br[r] = j->ranks[r]->br;
      br[r].dev = j->ranks[r]->backend;
    }
    rc = mokk_backward_flags(j->backend, j->gctx->ctx, j->mode, j->bwd_flags, br, j->err);
  } else if (!j->backward && (fr = malloc((size_t)j->P * sizeof *fr)) != NULL) {
    for (int r = 0; r < j->P; r++) {
      fr[r] = j->ranks[r]->fr;
      fr[r].dev = j->ranks[r]->backend;
    }
    /* group_match made every rank ask what rank 0 asks */
    rc = mokk_forward(j->backend, &j->shape, j->T, fr, j->want_ctx ? &j->ctx : NULL, j->err);
  } else {
    rc = mokk_fail(j->err, MOK_ENOMEM, "out of memory for a step of %d EP ranks", j->P);
  }
  free(fr);
  free(br);
  if (rc == 0)
    rc = group_end(j);
  if (rc != 0 && !j->backward && j->ctx != NULL) {
    mokk_ctx_free(j->backend, j->ctx);
    j->ctx = NULL;
  }
  j->rc = rc;
}

/* The state of a group forward, shared by the contexts of the ranks that
 * asked for one; each is charged its 1/P share. group_done holds the first
 * reference while it hands the state out. */
static mokd_gctx *gctx_new(mokd_step *j)
{
  mokd_gctx *g = calloc(1, sizeof *g);
  if (g == NULL)
    return NULL;
  g->ctx = j->ctx;
  g->backend = j->backend;
  g->P = j->P;
  g->group = j->group;
  g->refs = 1;
  j->ctx = NULL;
  return g;
}

/* Rank j's part of a group step's end, before any reply leaves: its
 * context takes its reference to g and is charged its share. The outcome
 * goes to j->rc and j->err. */
static void group_attach(mokd_step *j, const mokd_step *j0, mokd_gctx *g, int rc,
                         const char *err)
{
  mokd_session *s = j->sess;

  s->busy = NULL;
  j->rc = rc;
  snprintf(j->err, sizeof j->err, "%s", err);
  j->work.t_queued = j->t_parked; /* its queued time counts its wait for the other ranks */
  j->work.t_start = j0->work.t_start;
  j->work.t_end = j0->work.t_end;
  if (rc != 0 || g == NULL || !j->want_ctx || s->closing)
    return;
  j->rc = mokd_result_charge(s, j->res, (mokk_ctx_bytes(g->backend, g->ctx) +
                                         (uint64_t)g->P - 1) / (uint64_t)g->P, j->err);
  if (j->rc == 0) {
    j->res->gctx = g;
    g->refs++;
  }
}

/* On the loop thread: every rank's reply, from rank 0's step. Every rank's
 * context holds the shared state before the first reply leaves: a reply
 * runs that session's next requests, which may release its context or name
 * it in a Backward. */
static void group_done(mokd_work *w)
{
  mokd_step *j0 = (mokd_step *)w;
  mokd_server *srv = j0->sess->srv;
  mokd_gctx *g = NULL;
  int rc = j0->rc;
  char err[MOK_ERRLEN];

  snprintf(err, sizeof err, "%s", j0->err);
  if (rc == 0 && j0->ctx != NULL && (g = gctx_new(j0)) == NULL) {
    mokk_ctx_free(j0->backend, j0->ctx);
    rc = mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  if (j0->gctx != NULL)
    gctx_unref(j0->gctx);
  for (int r = 0; r < j0->P; r++)
    group_attach(j0->ranks[r], j0, g, rc, err);
  if (g != NULL && g->refs - 1 < g->P)
    g->dropped = 1; /* a rank holds no context of it: no group backward can run */
  for (int r = j0->P - 1; r >= 0; r--) { /* rank 0's step, which holds the rest, last */
    mokd_step *j = j0->ranks[r];
    mokd_session *s = j->sess;

    if (j->backward)
      s->usage.backwards++, srv->usage.backwards++;
    else
      s->usage.forwards++, srv->usage.forwards++;
    s->t->queued--, s->t->steps++;
    if (s->closing) {
      mokd_result_free(s, j->res);
      step_free(j);
      mokd_session_maybe_destroy(s);
      continue;
    }
    if (j->rc != 0) {
      mokd_reply_error(s, j->req_id, j->rc, j->err);
      mokd_result_free(s, j->res);
    } else {
      send_step_reply(s, j);
    }
    step_free(j);
    mokd_session_pump(s);
  }
  if (g != NULL)
    gctx_unref(g); /* group_done's own: the last one if no rank kept a context */
  mokd_server_maybe_stop(srv);
}

void mokd_steps_run_group(mokd_step **steps, int P)
{
  mokd_step *j0 = steps[0];

  j0->ranks = steps;
  j0->P = P;
  for (int r = 0; r < P; r++) {
    steps[r]->sess->busy = steps[r];
    steps[r]->sess->t->queued++;
  }
  if (j0->gctx != NULL)
    j0->gctx->refs++; /* a rank that leaves mid-step must not free it under the step */
  mokd_executor_queue_for(j0->sess->exec, &j0->work, j0->sess->tenant, j0->sess->t->weight,
                          group_work, group_done);
}

void mokd_step_fail(mokd_step *j, int code, const char *msg)
{
  mokd_session *s = j->sess;

  s->parked = 0;
  if (!s->closing)
    mokd_reply_error(s, j->req_id, code, msg);
  mokd_result_free(s, j->res);
  step_free(j);
  if (s->closing)
    mokd_session_maybe_destroy(s);
  else
    mokd_session_pump(s);
}

/* A group step must match the ones parked before it: the same kind, the
 * same T, for a forward the same answer to inference (a context is kept
 * for every rank or for none: each rank pays its share), and for a
 * backward the same forward. On a mismatch every rank's step fails. */
static int group_match(mokd_layer *l, const mokd_step *j, char *err)
{
  const mokd_step *f = mokd_group_first(l);
  int rc;

  if (f == NULL)
    return 0;
  if (f->backward != j->backward)
    rc = mokk_fail(err, MOK_EGROUP, "EP rank %d sent a %s while rank %d waits in a %s; the "
                   "ranks of a group must run the same steps in the same order",
                   l->rank, j->backward ? "Backward" : "Forward", f->rank,
                   f->backward ? "Backward" : "Forward");
  else if (f->T != j->T)
    rc = mokk_fail(err, MOK_ESHAPE, "EP rank %d sent T = %lld tokens, rank %d sent %lld; "
                   "every rank of a group step needs the same T", l->rank, (long long)j->T,
                   f->rank, (long long)f->T);
  else if (!j->backward && f->want_ctx != j->want_ctx)
    rc = mokk_fail(err, MOK_EGROUP, "EP rank %d sent %s Forward, rank %d %s one; the ranks "
                   "of a group Forward must all ask for inference, or none", l->rank,
                   j->want_ctx ? "a training" : "an inference", f->rank,
                   f->want_ctx ? "a training" : "an inference");
  else if (f->gctx != j->gctx)
    rc = mokk_fail(err, MOK_ECONTEXT, "EP rank %d named the context of another forward than "
                   "rank %d; every rank's Backward must name its context of the same group "
                   "forward", l->rank, f->rank);
  else if (j->backward && f->bwd_flags != j->bwd_flags)
    rc = mokk_fail(err, MOK_EGROUP, "EP rank %d sent a Backward %s last set, rank %d one %s; "
                   "the ranks of a group Backward must agree on it", l->rank,
                   j->bwd_flags ? "with" : "without", f->rank, f->bwd_flags ? "with" : "without");
  else
    return 0;
  mokd_group_fail_step(l, rc, err);
  return rc;
}

static void step_park(mokd_layer *l, mokd_step *j)
{
  j->t_parked = mokd_now_ns();
  mokd_group_park(l, j);
}

static void step_queue(mokd_session *s, mokd_step *j)
{
  s->busy = j;
  s->t->queued++;
  mokd_executor_queue_for(s->exec, &j->work, s->tenant, s->t->weight, step_work, step_done);
}

/* A built step goes on. With l, the layer of an EP rank, it waits for the
 * group's other ranks (group: the serial of the group it belongs to); a
 * step that does not match theirs fails every rank's step (*told: they have
 * been told), and the caller frees it. Without l it joins the session's
 * queue. */
static int step_submit(mokd_session *s, mokd_layer *l, mokd_step *j, uint64_t group, int *told,
                       char *err)
{
  int rc;

  if (l == NULL) {
    step_queue(s, j);
    return 0;
  }
  j->rank = l->rank;
  j->group = group;
  if ((rc = group_match(l, j, err))) {
    *told = 1;
    return rc;
  }
  step_park(l, j);
  return 0;
}

/* ---- requests ------------------------------------------------------------- */

/* A rank of a group whose request is refused fails the group's step: the
 * others would wait for it in vain. */
static void refuse_group_step(mokd_layer *l, const char *what, const char *why)
{
  char msg[MOK_ERRLEN];

  if (l == NULL || l->group == NULL || mokd_group_first(l) == NULL)
    return;
  snprintf(msg, sizeof msg, "EP rank %d's %s was refused: %s", l->rank, what, why);
  mokd_group_fail_step(l, MOK_EGROUP, msg);
}

void mokd_steps_refused(mokd_session *s, const Mokd__Request *q, const char *why)
{
  const char *what;
  mokd_layer *l = NULL;

  if (q == NULL)
    return;
  if (q->body_case == MOKD__REQUEST__BODY_FORWARD && q->forward != NULL) {
    what = "Forward";
    l = mokd_layer_find(s, q->forward->layer);
  } else if (q->body_case == MOKD__REQUEST__BODY_BACKWARD && q->backward != NULL) {
    mokd_result *c = mokd_result_find(s, q->backward->context);
    what = "Backward";
    if (c != NULL && (c->gctx == NULL || (l = mokd_layer_find(s, c->layer)) == NULL))
      return; /* not of a group, or of one torn down with the layer */
  } else {
    return;
  }
  if (l != NULL) {
    refuse_group_step(l, what, why);
    return;
  }
  /* it names nothing of this session: whichever group waits for this rank */
  for (l = s->layers; l != NULL; l = l->next)
    refuse_group_step(l, what, why);
}

static int forward_step(mokd_session *s, const Mokd__Request *q, mokd_layer *l, int *told,
                        char *err)
{
  const Mokd__Forward *f = q->forward;
  mokd_arena *warenas[MOKK_NWEIGHTS], *xa;
  int64_t dx[2], di[2];
  void *px, *pi, *pw;
  mokd_step *j;
  mokd_result *r;
  size_t bytes[2], off[2];
  int rc;

  if (l == NULL)
    return mokk_fail(err, MOK_ENOENT, "layer %llu does not exist in this session",
                     (unsigned long long)f->layer);
  if ((rc = mokd_group_usable(l, err)))
    return rc;
  if (!l->has_weights)
    return mokk_fail(err, MOK_EINVAL, "layer %llu has no weights; send SetWeights first",
                     (unsigned long long)l->id);
  dx[0] = -1, dx[1] = l->shape.H;
  if ((rc = mokd_ref_resolve(&s->reg, "x", f->x, MOKD__DTYPE__DTYPE_BF16, 2, dx, &px, &xa,
                             err)))
    return rc;
  di[0] = dx[0], di[1] = l->shape.K;
  if ((rc = mokd_ref_resolve(&s->reg, "topk_ids", f->topk_ids, MOKD__DTYPE__DTYPE_I32, 2, di,
                             &pi, NULL, err)))
    return rc;
  if ((rc = mokd_ref_resolve(&s->reg, "topk_weights", f->topk_weights, MOKD__DTYPE__DTYPE_F32,
                             2, di, &pw, NULL, err)))
    return rc;
  if ((rc = check_ready(s, &f->ready_event, err)))
    return rc;
  if ((j = step_new(s, q->id)) == NULL || (r = mokd_result_new(s, 1)) == NULL) {
    free(j);
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  j->res = r;
  j->shape = l->shape;
  j->T = dx[0];
  j->want_ctx = !f->inference;
  j->fr.x = px, j->fr.topk_ids = pi, j->fr.topk_weights = pw;
  r->layer = l->id;
  r->mode = l->mode;
  r->T = dx[0];
  if ((rc = mokd_weights_resolve(s, l, j->fr.w, warenas, err)))
    goto fail;
  bytes[0] = (size_t)(j->T * l->shape.H) * 2;
  bytes[1] = sizeof(int32_t);
  if ((rc = mokd_result_outputs(s, r, s->device >= 0 ? 2 : 1, bytes, off, err)))
    goto fail;
  j->fr.out = (uint16_t *)((char *)r->out_arena->base + off[0]);
  j->refs[j->nrefs++] = mokd_ref_new(r->out_arena->id, off[0], MOKD__DTYPE__DTYPE_BF16, 2, dx);
  if (j->refs[0] == NULL) {
    rc = mokk_fail(err, MOK_ENOMEM, "out of memory");
    goto fail;
  }
  if ((rc = status_slot(s, j, r, off[1], err)))
    goto fail;
  /* the context is charged before the step allocates it; a group's ranks
   * share one, each its 1/P */
  uint64_t bound = mokk_backend_ctx_bound(s->backend, &l->shape, j->T, mokd_group_spans(l));
  bound = bound / (uint64_t)l->shape.P + (bound % (uint64_t)l->shape.P != 0);
  if (j->want_ctx && (rc = mokd_result_charge(s, r, bound, err))) {
    char why[MOK_ERRLEN];
    snprintf(why, sizeof why, "%s", err);
    rc = mokk_fail(err, rc, "the forward context of this step (up to %llu bytes) does not "
                   "fit: %s", (unsigned long long)bound, why);
    goto fail;
  }
  set_ready(j, &f->ready_event);
  if (j->want_ctx) {
    for (int i = 0; i < mokd_weight_count(&l->shape); i++)
      mokd_result_pin(r, warenas[i]);
    mokd_result_pin(r, xa);
  }
  mokd_layer *gl = l->shape.P > 1 ? l : NULL;
  if ((rc = step_submit(s, gl, j, gl != NULL ? mokd_group_serial(gl) : 0, told, err)))
    goto fail;
  return 0;

fail:
  mokd_result_free(s, r);
  step_free(j);
  return rc;
}

int mokd_h_forward(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                   char *err)
{
  mokd_layer *l = mokd_layer_find(s, q->forward->layer);
  int told = 0;
  int rc = forward_step(s, q, l, &told, err);

  (void)fds, (void)nfds;
  if (rc != 0 && !told)
    mokd_steps_refused(s, q, err);
  return rc;
}

/* A context of a group forward: its group must still stand, and every
 * rank's part of the forward must still be there. */
static int group_context(mokd_session *s, const mokd_result *c, char *err)
{
  mokd_layer *l = mokd_layer_find(s, c->layer);
  int rc;

  if (l == NULL)
    return mokk_fail(err, MOK_EGROUP, "the layer of context %llu was destroyed, which tore "
                     "its EP group down", (unsigned long long)c->id);
  if ((rc = mokd_group_usable(l, err)))
    return rc;
  if (mokd_group_serial(l) != c->gctx->group)
    return mokk_fail(err, MOK_EGROUP, "context %llu is from an EP group that was torn down",
                     (unsigned long long)c->id);
  if (c->gctx->dropped)
    return mokk_fail(err, MOK_ECONTEXT, "another EP rank holds no context of the forward of "
                     "context %llu (released, or it ran as inference); a group's Backward "
                     "needs every rank's", (unsigned long long)c->id);
  return 0;
}

/* The weights a backward names where they are now, checked as SetWeights
 * checks them; none named leaves w NULL: the forward's. */
static int backward_weights(mokd_session *s, const mokk_shape *sh, const Mokd__Backward *b,
                            const uint16_t **w, char *err)
{
  for (int i = 0; i < (int)b->n_weights; i++) {
    char what[48];
    int64_t d[3];
    int nd = mokd_weight_dims(sh, i, d), rc;
    void *p;
    snprintf(what, sizeof what, "weights[%d] (%s)", i, mokd_weight_name(i));
    if ((rc = mokd_ref_resolve(&s->reg, what, b->weights[i], MOKD__DTYPE__DTYPE_BF16, nd, d,
                               &p, NULL, err)))
      return rc;
    w[i] = p;
  }
  return 0;
}

/* *told: as forward_step's. */
static int backward_step(mokd_session *s, const Mokd__Request *q, mokd_result *c, int *told,
                         char *err)
{
  const Mokd__Backward *b = q->backward;
  mokd_result *r;
  int64_t dx[2], dtw[2], gs[MOKK_NWEIGHTS][3];
  int gnd[MOKK_NWEIGHTS];
  void *pd;
  size_t bytes[3 + MOKK_NWEIGHTS], offs[3 + MOKK_NWEIGHTS];
  mokd_step *j;
  const mokk_shape *sh;
  int nw, nout, rc;

  if (c == NULL || !c->is_context || (c->ctx == NULL && c->gctx == NULL))
    return mokk_fail(err, MOK_ECONTEXT, "context %llu is unknown, released, or from an "
                     "inference forward", (unsigned long long)b->context);
  if (c->used)
    return mokk_fail(err, MOK_ECONTEXT, "context %llu was used up by an earlier Backward with "
                     "last set; run the Forward again", (unsigned long long)b->context);
  if (c->gctx != NULL && (rc = group_context(s, c, err)))
    return rc;
  sh = c->gctx != NULL ? &c->gctx->ctx->shape : &c->ctx->shape;
  nw = mokd_weight_count(sh);
  dx[0] = c->T, dx[1] = sh->H;
  if ((rc = mokd_ref_resolve(&s->reg, "d_out", b->d_out, MOKD__DTYPE__DTYPE_BF16, 2, dx, &pd,
                             NULL, err)))
    return rc;
  if ((rc = check_ready(s, &b->ready_event, err)))
    return rc;
  mokk_grad_mode mode = c->mode;
  if (mode == MOKK_GRAD_FP32_ACCUM && (int)b->n_grads != nw)
    return mokk_fail(err, MOK_EINVAL, "the layer accumulates fp32 gradients: Backward "
                     "needs %d gradient buffers, got %zu", nw, b->n_grads);
  if (mode == MOKK_GRAD_BF16 && b->n_grads != 0 && (int)b->n_grads != nw)
    return mokk_fail(err, MOK_EINVAL, "Backward names %zu gradient buffers; the layer has "
                     "%d weights (or send none to get them back)", b->n_grads, nw);
  if (b->n_weights != 0 && (int)b->n_weights != nw)
    return mokk_fail(err, MOK_EINVAL, "Backward names %zu weights; the layer has %d (or "
                     "send none to read them where the forward did)", b->n_weights, nw);
  if ((j = step_new(s, q->id)) == NULL || (r = mokd_result_new(s, 0)) == NULL) {
    free(j);
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  j->res = r;
  j->backward = 1;
  j->ctx = c->ctx;
  j->mode = mode;
  j->bwd_flags = b->last ? MOKK_BWD_LAST : 0;
  j->br.d_out = pd;
  r->layer = c->layer;
  r->T = c->T;
  if ((rc = backward_weights(s, sh, b, j->br.w, err)))
    goto fail;
  for (int i = 0; i < (int)b->n_grads; i++) {
    void *pg;
    gnd[i] = mokd_weight_dims(sh, i, gs[i]);
    rc = mokd_ref_resolve(&s->reg, mokd_weight_name(i), b->grads[i],
                          mode == MOKK_GRAD_FP32_ACCUM ? MOKD__DTYPE__DTYPE_F32
                                                       : MOKD__DTYPE__DTYPE_BF16,
                          gnd[i], gs[i], &pg, NULL, err);
    if (rc)
      goto fail;
    if (mode == MOKK_GRAD_FP32_ACCUM)
      j->br.g_f32[i] = pg;
    else
      j->br.g_bf16[i] = pg;
  }
  nout = 2;
  bytes[0] = (size_t)(c->T * sh->H) * 2;
  bytes[1] = (size_t)(c->T * sh->K) * 4;
  if (b->n_grads == 0)
    for (int i = 0; i < nw; i++) {
      gnd[i] = mokd_weight_dims(sh, i, gs[i]);
      bytes[nout++] = (size_t)mokk_weight_elems(sh, i) * 2;
    }
  bytes[nout] = sizeof(int32_t);
  if ((rc = mokd_result_outputs(s, r, nout + (s->device >= 0), bytes, offs, err)))
    goto fail;
  if ((rc = status_slot(s, j, r, offs[nout], err)))
    goto fail;
  set_ready(j, &b->ready_event);
  dtw[0] = c->T, dtw[1] = sh->K;
  j->br.d_x = (uint16_t *)((char *)r->out_arena->base + offs[0]);
  j->br.d_topk_weights = (float *)((char *)r->out_arena->base + offs[1]);
  j->refs[j->nrefs++] = mokd_ref_new(r->out_arena->id, offs[0], MOKD__DTYPE__DTYPE_BF16, 2, dx);
  j->refs[j->nrefs++] = mokd_ref_new(r->out_arena->id, offs[1], MOKD__DTYPE__DTYPE_F32, 2, dtw);
  for (int i = 0; i < nout - 2; i++) {
    j->br.g_bf16[i] = (uint16_t *)((char *)r->out_arena->base + offs[2 + i]);
    j->refs[j->nrefs++] = mokd_ref_new(r->out_arena->id, offs[2 + i], MOKD__DTYPE__DTYPE_BF16,
                                       gnd[i], gs[i]);
  }
  for (int i = 0; i < j->nrefs; i++)
    if (j->refs[i] == NULL) {
      rc = mokk_fail(err, MOK_ENOMEM, "out of memory");
      goto fail;
    }
  mokd_layer *gl = NULL;
  if (c->gctx != NULL) {
    gl = mokd_layer_find(s, c->layer); /* group_context found it */
    j->gctx = c->gctx;
  }
  if ((rc = step_submit(s, gl, j, gl != NULL ? c->gctx->group : 0, told, err)))
    goto fail;
  /* accepted: the step may write over the saved state. A group's runs
   * only once every rank's has come, and the engine's context says so
   * then (its ranks share it) */
  if (b->last && c->gctx == NULL)
    c->used = 1;
  return 0;

fail:
  mokd_result_free(s, r);
  step_free(j);
  return rc;
}

int mokd_h_backward(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                    char *err)
{
  mokd_result *c = mokd_result_find(s, q->backward->context);
  int told = 0;
  int rc = backward_step(s, q, c, &told, err);

  (void)fds, (void)nfds;
  if (rc != 0 && !told)
    mokd_steps_refused(s, q, err);
  return rc;
}
