/* wfq.h - a weighted fair queue across tenants, pure data (no locks, no
 * clock): the executor keeps one under its mutex and pops the next item from
 * it. Self-clocked fair queueing: an item's virtual finish tag is its
 * tenant's last tag (or the queue's virtual time V when the tenant has
 * nothing queued) plus cost/weight; the cost is 1 per item (a step), not its
 * FLOPs. Pop takes the smallest tag, ties going to the earlier arrival, and
 * sets V to it; within a tenant items leave in arrival order. Items without
 * a tenant (the daemon's own work) go before every tenant's, in order. */
#ifndef MOKD_WFQ_H
#define MOKD_WFQ_H

#include <stdint.h>

#define MOKD_TENANT_MAX 68 /* "job:" + a job id (63 bytes) + NUL, rounded */
#define MOKD_WFQ_UNIT (720720ull << 8) /* one item's cost; divisible by 1..16 */

typedef struct mokd_wfq_item {
  uint64_t tag, seq;
  struct mokd_wfq_item *next;
} mokd_wfq_item;

typedef struct mokd_wfq_tenant {
  char key[MOKD_TENANT_MAX];
  unsigned weight;
  mokd_wfq_item *head, *tail;
  struct mokd_wfq_tenant *next;
} mokd_wfq_tenant;

typedef struct mokd_wfq {
  uint64_t vtime, seq;
  mokd_wfq_item *own_head, *own_tail; /* the daemon's: no tenant */
  mokd_wfq_tenant *tenants;           /* those with items queued */
  int len;
} mokd_wfq;

void mokd_wfq_init(mokd_wfq *q);
/* key NULL: the daemon's own item. weight >= 1. MOK_ENOMEM when a new
 * tenant's record cannot be allocated (the item is not queued). */
int mokd_wfq_push(mokd_wfq *q, mokd_wfq_item *it, const char *key, unsigned weight);
/* NULL when empty. A tenant's record goes when its last item leaves. */
mokd_wfq_item *mokd_wfq_pop(mokd_wfq *q);
/* frees the tenants' records; the items are the caller's */
void mokd_wfq_clear(mokd_wfq *q);

#endif
