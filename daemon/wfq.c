/* wfq.c - see wfq.h. Tenants are few (the jobs on one device): a list
 * scanned at each push and pop is cheaper than a heap. */
#include "wfq.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mok_errno.h"

void mokd_wfq_init(mokd_wfq *q)
{
  memset(q, 0, sizeof *q);
}

static mokd_wfq_tenant *tenant_get(mokd_wfq *q, const char *key, unsigned weight)
{
  mokd_wfq_tenant *t;

  for (t = q->tenants; t != NULL; t = t->next)
    if (strcmp(t->key, key) == 0)
      return t;
  if ((t = calloc(1, sizeof *t)) == NULL)
    return NULL;
  snprintf(t->key, sizeof t->key, "%s", key);
  t->weight = weight;
  t->next = q->tenants;
  q->tenants = t;
  return t;
}

/* it at the end of the list (*head, *tail) */
static void append(mokd_wfq_item **head, mokd_wfq_item **tail, mokd_wfq_item *it)
{
  if (*tail != NULL)
    (*tail)->next = it;
  else
    *head = it;
  *tail = it;
}

int mokd_wfq_push(mokd_wfq *q, mokd_wfq_item *it, const char *key, unsigned weight)
{
  mokd_wfq_tenant *t;

  it->next = NULL;
  if (key == NULL) {
    it->tag = 0;
    append(&q->own_head, &q->own_tail, it);
  } else {
    if ((t = tenant_get(q, key, weight)) == NULL)
      return MOK_ENOMEM;
    t->weight = weight < 1 ? 1 : weight; /* the latest session's word: a reload may change it */
    it->tag = (t->tail != NULL ? t->tail->tag : q->vtime) + MOKD_WFQ_UNIT / t->weight;
    append(&t->head, &t->tail, it);
  }
  it->seq = q->seq++;
  q->len++;
  return 0;
}

mokd_wfq_item *mokd_wfq_pop(mokd_wfq *q)
{
  mokd_wfq_tenant **best = NULL, **pp;
  mokd_wfq_tenant *t;
  mokd_wfq_item *it;

  if ((it = q->own_head) != NULL) {
    if ((q->own_head = it->next) == NULL)
      q->own_tail = NULL;
    q->len--;
    return it;
  }
  for (pp = &q->tenants; *pp != NULL; pp = &(*pp)->next) {
    const mokd_wfq_item *h = (*pp)->head, *b = best != NULL ? (*best)->head : NULL;
    if (b == NULL || h->tag < b->tag || (h->tag == b->tag && h->seq < b->seq))
      best = pp;
  }
  if (best == NULL)
    return NULL;
  t = *best;
  it = t->head;
  if ((t->head = it->next) == NULL) {
    *best = t->next; /* its last item: V reaches its tag, so nothing of it is left to remember */
    free(t);
  }
  q->vtime = it->tag;
  q->len--;
  return it;
}

void mokd_wfq_clear(mokd_wfq *q)
{
  while (q->tenants != NULL) {
    mokd_wfq_tenant *t = q->tenants;
    q->tenants = t->next;
    free(t);
  }
  mokd_wfq_init(q);
}
