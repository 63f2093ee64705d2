/* layers.c - requests about layers: CreateLayer checks the shape once (and
 * joins an EP group's layer to its group, groups.c),
 * SetWeights checks and keeps the weight tensors (read in place every step,
 * so a client's in-place updates are seen), DestroyLayer; and the layer's
 * weights as the steps resolve them. */
#include <stdlib.h>

#include "mokd.h"

static const char *const wnames[MOKK_NWEIGHTS] = {"w_gate", "w_up", "w_down",
                                                  "s_gate", "s_up", "s_down"};

const char *mokd_weight_name(int w)
{
  return wnames[w];
}

int mokd_weight_count(const mokk_shape *sh)
{
  return sh->I_s > 0 ? MOKK_NWEIGHTS : MOKK_S_GATE;
}

int mokd_weight_dims(const mokk_shape *sh, int w, int64_t *d)
{
  switch (w) {
  case MOKK_W_GATE: case MOKK_W_UP: d[0] = sh->E / sh->P, d[1] = sh->I, d[2] = sh->H; return 3;
  case MOKK_W_DOWN: d[0] = sh->E / sh->P, d[1] = sh->H, d[2] = sh->I; return 3;
  case MOKK_S_GATE: case MOKK_S_UP: d[0] = sh->I_s, d[1] = sh->H; return 2;
  default: d[0] = sh->H, d[1] = sh->I_s; return 2;
  }
}

mokd_layer *mokd_layer_find(mokd_session *s, uint64_t id)
{
  for (mokd_layer *l = s->layers; l != NULL; l = l->next)
    if (l->id == id)
      return l;
  return NULL;
}

void mokd_layer_free(mokd_session *s, mokd_layer *l)
{
  mokd_layer **pp = &s->layers;
  while (*pp != NULL && *pp != l)
    pp = &(*pp)->next;
  if (*pp == l)
    *pp = l->next;
  if (l->group != NULL)
    mokd_group_leave(l, "destroyed its layer");
  free(l->lost);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    mokd_ref_free(l->w[w]);
  s->nlayers--;
  s->usage.layers--, s->srv->usage.layers--;
  free(l);
}

int mokd_weights_resolve(mokd_session *s, const mokd_layer *l, const uint16_t **w,
                         mokd_arena **arenas, char *err)
{
  for (int i = 0; i < mokd_weight_count(&l->shape); i++) {
    int64_t d[3];
    int nd = mokd_weight_dims(&l->shape, i, d), rc;
    void *p;
    if ((rc = mokd_ref_resolve(&s->reg, wnames[i], l->w[i], MOKD__DTYPE__DTYPE_BF16, nd, d, &p,
                               &arenas[i], err)))
      return rc;
    w[i] = p;
  }
  return 0;
}

void mokd_send_layer_created(mokd_session *s, uint64_t req_id, const mokd_layer *l)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__LayerCreated lc = MOKD__LAYER_CREATED__INIT;

  lc.layer = l->id;
  r.id = req_id;
  r.body_case = MOKD__RESPONSE__BODY_LAYER_CREATED;
  r.layer_created = &lc;
  mokd_send(s, &r, NULL, 0);
}

/* The EP group a CreateLayer names: its size P (1 alone) and the checks that
 * need no other rank. */
static int ep_check(const mokd_session *s, const Mokd__EpGroup *ep, int64_t *P, char *err)
{
  *P = 1;
  if (ep == NULL)
    return 0;
  *P = ep->size > 0 ? ep->size : 1;
  if (ep->size > MOKD_MAX_EP)
    return mokk_fail(err, MOK_EINVAL, "EP group size %u is larger than %d", ep->size,
                     MOKD_MAX_EP);
  if (ep->rank >= *P)
    return mokk_fail(err, MOK_EINVAL, "EP rank %u is outside a group of size %lld (ranks "
                     "0..%lld)", ep->rank, (long long)*P, (long long)*P - 1);
  if (*P > MOKK_DEVICE_MAX_RANKS && s->device >= 0)
    return mokk_fail(err, MOK_ENOTSUP, "the %s backend runs an EP group of at most %d ranks "
                     "(virtual ranks on one GPU); this group has %lld; use a smaller group, "
                     "or run mokd --backend cpu", mokk_backend_name(s->backend),
                     MOKK_DEVICE_MAX_RANKS, (long long)*P);
  return 0;
}

int mokd_h_create_layer(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                        char *err)
{
  const Mokd__CreateLayer *c = q->create_layer;
  mokk_shape sh = {0};
  mokd_layer *l;
  int64_t P;
  int rc;

  (void)fds, (void)nfds;
  if ((rc = ep_check(s, c->ep, &P, err)))
    return rc;
  if (c->grad_mode != MOKD__GRAD_MODE__GRAD_BF16 &&
      c->grad_mode != MOKD__GRAD_MODE__GRAD_FP32_ACCUM)
    return mokk_fail(err, MOK_EINVAL, "gradient mode %d is unknown", (int)c->grad_mode);
  if (s->nlayers >= s->srv->cfg.max_layers)
    return mokk_fail(err, MOK_EDQUOT, "session already has %d layers (max_layers)",
                     s->nlayers);
  if (c->hidden > MOKK_DIM_MAX || c->intermediate > MOKK_DIM_MAX ||
      c->experts > MOKK_DIM_MAX || c->top_k > MOKK_DIM_MAX ||
      c->shared_intermediate > MOKK_DIM_MAX)
    return mokk_fail(err, MOK_EOVERFLOW, "a layer dimension is larger than %d",
                     MOKK_DIM_MAX);
  sh.H = (int64_t)c->hidden, sh.I = (int64_t)c->intermediate, sh.E = (int64_t)c->experts;
  sh.K = (int64_t)c->top_k, sh.I_s = (int64_t)c->shared_intermediate, sh.P = P;
  sh.swiglu_limit = c->swiglu_limit;
  if (c->tuning != NULL) {
    const Mokd__Tuning *t = c->tuning;
    sh.tune = (mokk_tuning){.tiles = t->tiles, .wgrad_tiles = t->wgrad_tiles,
                            .clusters = t->clusters, .order = t->order, .tails = t->tails,
                            .dx = t->dx, .dispatch_blocks = t->dispatch_blocks};
  }
  if ((rc = mokk_shape_check(&sh, err)))
    return rc;
  l = calloc(1, sizeof *l);
  if (l == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  l->id = ++s->srv->next_id;
  l->owner = s;
  l->shape = sh;
  l->mode = (mokk_grad_mode)c->grad_mode; /* the same numbers: see mokd.h */
  l->next = s->layers;
  s->layers = l;
  s->nlayers++;
  s->usage.layers++, s->srv->usage.layers++;
  if (P > 1) {
    if ((rc = mokd_group_join(s, l, c->ep, q->id, err)))
      mokd_layer_free(s, l);
    return rc;
  }
  mokd_send_layer_created(s, q->id, l);
  return 0;
}

int mokd_h_set_weights(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                       char *err)
{
  const Mokd__SetWeights *sw = q->set_weights;
  const Mokd__TensorRef *in[MOKK_NWEIGHTS] = {sw->w_gate, sw->w_up, sw->w_down,
                                              sw->s_gate, sw->s_up, sw->s_down};
  Mokd__TensorRef *copy[MOKK_NWEIGHTS] = {0};
  mokd_layer *l = mokd_layer_find(s, sw->layer);
  int n, rc;

  (void)fds, (void)nfds;
  if (l == NULL)
    return mokk_fail(err, MOK_ENOENT, "layer %llu does not exist in this session",
                     (unsigned long long)sw->layer);
  n = mokd_weight_count(&l->shape);
  for (int i = 0; i < n; i++) {
    int64_t d[3];
    int nd = mokd_weight_dims(&l->shape, i, d);
    void *p;
    if ((rc = mokd_ref_resolve(&s->reg, wnames[i], in[i], MOKD__DTYPE__DTYPE_BF16, nd, d, &p,
                               NULL, err)))
      return rc;
  }
  for (int i = n; i < MOKK_NWEIGHTS; i++)
    if (in[i] != NULL)
      return mokk_fail(err, MOK_EINVAL, "%s given, but the layer has no shared expert",
                       wnames[i]);
  for (int i = 0; i < n; i++)
    if ((copy[i] = mokd_ref_copy(in[i])) == NULL) {
      for (int j = 0; j < i; j++)
        mokd_ref_free(copy[j]);
      return mokk_fail(err, MOK_ENOMEM, "out of memory");
    }
  for (int i = 0; i < MOKK_NWEIGHTS; i++) {
    mokd_ref_free(l->w[i]);
    l->w[i] = copy[i];
  }
  l->has_weights = 1;
  mokd_send_done(s, q->id);
  return 0;
}

int mokd_h_destroy_layer(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err)
{
  mokd_layer *l = mokd_layer_find(s, q->destroy_layer->layer);

  (void)fds, (void)nfds;
  if (l == NULL)
    return mokk_fail(err, MOK_ENOENT, "layer %llu does not exist in this session",
                     (unsigned long long)q->destroy_layer->layer);
  mokd_layer_free(s, l); /* its contexts keep what they need */
  mokd_send_done(s, q->id);
  return 0;
}
