/* results.c - forward contexts and backward results of a session: made,
 * charged to the quota (a context before its step runs), given a block of an
 * output arena, pinning the weight arenas a context reads, and released, one
 * by one or many ids in one request (O(n log n): a mark per id, one sort of
 * the freed blocks per arena). */
#include <stdlib.h>

#include "mokd.h"

mokd_result *mokd_result_find(mokd_session *s, uint64_t id)
{
  return mokd_idmap_get(&s->result_ids, id);
}

mokd_result *mokd_result_new(mokd_session *s, int is_context)
{
  mokd_result *r = calloc(1, sizeof *r);
  if (r == NULL)
    return NULL;
  r->id = ++s->srv->next_id;
  if (mokd_idmap_put(&s->result_ids, r->id, r) != 0) {
    free(r);
    return NULL;
  }
  r->is_context = is_context;
  r->next = s->results;
  if (s->results != NULL)
    s->results->prev = r;
  s->results = r;
  if (is_context)
    s->usage.contexts++, s->srv->usage.contexts++;
  else
    s->usage.results++, s->srv->usage.results++;
  return r;
}

/* Sets what the context r is charged (quota, and the usage Stats shows) to
 * bytes; more than before may be refused by the quota. */
int mokd_result_charge(mokd_session *s, mokd_result *r, uint64_t bytes, char *err)
{
  int which = s->device >= 0 ? MOKD_DEVICE : MOKD_HOST, rc;

  if (bytes > r->ctx_bytes &&
      (rc = mokd_quota_take(&s->reg, bytes - r->ctx_bytes, which, err)) != 0)
    return rc;
  if (bytes < r->ctx_bytes)
    mokd_quota_give(&s->reg, r->ctx_bytes - bytes, which);
  s->usage.context_bytes += bytes - r->ctx_bytes;
  s->srv->usage.context_bytes += bytes - r->ctx_bytes;
  r->ctx_bytes = bytes;
  return 0;
}

void mokd_result_free(mokd_session *s, mokd_result *r)
{
  if (r->prev != NULL)
    r->prev->next = r->next;
  else
    s->results = r->next;
  if (r->next != NULL)
    r->next->prev = r->prev;
  mokd_idmap_del(&s->result_ids, r->id);
  if (r->ctx != NULL)
    mokk_ctx_free(s->backend, r->ctx);
  if (r->gctx != NULL)
    mokd_gctx_drop(s, r);
  for (int i = 0; i < r->npinned; i++)
    r->pinned[i]->users--;
  mokd_result_charge(s, r, 0, NULL);
  if (r->is_context)
    s->usage.contexts--, s->srv->usage.contexts--;
  else
    s->usage.results--, s->srv->usage.results--;
  mokd_out_release(r->out_arena, r->out);
  free(r);
}

/* The context reads the weights (or x) in a until the backward: a stays. Each
 * arena counts a context once, however many of its tensors lie there. */
void mokd_result_pin(mokd_result *r, mokd_arena *a)
{
  for (int i = 0; i < r->npinned; i++)
    if (r->pinned[i] == a)
      return;
  r->pinned[r->npinned++] = a;
  a->users++;
}

/* Output tensors of one request, laid out in one block: sizes in, offsets out. */
int mokd_result_outputs(mokd_session *s, mokd_result *r, int n, const size_t *bytes,
                        size_t *offs, char *err)
{
  size_t total = 0;
  int rc;
  for (int i = 0; i < n; i++) {
    offs[i] = total;
    total += (bytes[i] + 255) / 256 * 256;
  }
  if ((rc = mokd_out_alloc(&s->reg, total, &r->out_arena, &r->out, err)))
    return rc;
  for (int i = 0; i < n; i++)
    offs[i] += r->out.off;
  return 0;
}

typedef struct out_block {
  mokd_arena *arena;
  mokd_span span;
} out_block;

static int block_cmp(const void *a, const void *b)
{
  const out_block *x = a, *y = b;
  return x->arena->id < y->arena->id ? -1 : x->arena->id > y->arena->id;
}

/* Frees the results named (all live, none twice); their output blocks go
 * back to each arena in one merge. */
static void release_all(mokd_session *s, const uint64_t *ids, size_t n)
{
  out_block *blk = malloc(n * sizeof *blk);
  mokd_span *spans = malloc(n * sizeof *spans);
  size_t nb = 0;

  for (size_t i = 0; i < n; i++) {
    mokd_result *r = mokd_result_find(s, ids[i]);
    if (blk != NULL && spans != NULL && r->out_arena != NULL) {
      blk[nb++] = (out_block){r->out_arena, r->out};
      r->out_arena = NULL;
    }
    mokd_result_free(s, r);
  }
  if (nb > 0) /* blk may be NULL when memory ran short: each block went back alone */
    qsort(blk, nb, sizeof *blk, block_cmp);
  for (size_t i = 0, j; i < nb; i = j) {
    for (j = i; j < nb && blk[j].arena == blk[i].arena; j++)
      spans[j - i] = blk[j].span;
    mokd_out_release_many(blk[i].arena, spans, j - i);
  }
  free(blk);
  free(spans);
}

int mokd_h_release(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                   char *err)
{
  const Mokd__Release *rl = q->release;
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Released done = MOKD__RELEASED__INIT;

  (void)fds, (void)nfds;
  /* all or nothing, in O(n): each id is looked up once and marked */
  uint64_t mark = ++s->release_marks;
  for (size_t i = 0; i < rl->n_ids; i++) {
    mokd_result *res = mokd_result_find(s, rl->ids[i]);
    if (res == NULL)
      return mokk_fail(err, MOK_ECONTEXT, "id %llu is not a live context or result of this "
                       "session; nothing was released", (unsigned long long)rl->ids[i]);
    if (res->mark == mark)
      return mokk_fail(err, MOK_EINVAL, "id %llu is named twice; nothing was released",
                       (unsigned long long)rl->ids[i]);
    res->mark = mark;
  }
  release_all(s, rl->ids, rl->n_ids);
  done.count = (uint32_t)rl->n_ids;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_RELEASED;
  r.released = &done;
  mokd_send(s, &r, NULL, 0);
  return 0;
}
