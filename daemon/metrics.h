/* metrics.h - the daemon's counters for operators, rendered in the
 * Prometheus text exposition format (0.0.4) for the --metrics listener
 * (http.c). Counted on the loop thread only. */
#ifndef MOKD_METRICS_H
#define MOKD_METRICS_H

#include <stddef.h>
#include <stdint.h>

#define MOKD_METRIC_OPS 64    /* request body numbers, one counter each */
#define MOKD_HIST_BUCKETS 16  /* finite buckets; +Inf is count */

/* Fixed buckets, in seconds, from 100 us to 10 s. */
typedef struct mokd_histogram {
  uint64_t bucket[MOKD_HIST_BUCKETS]; /* not cumulative: observations in each */
  uint64_t count;
  uint64_t sum_ns;
} mokd_histogram;

typedef struct mokd_metrics {
  uint64_t requests[MOKD_METRIC_OPS]; /* by body number; 0 = not a request */
  uint64_t errors[MOKD_METRIC_OPS];
  mokd_histogram queue;    /* queued until an executor took the step */
  mokd_histogram compute;  /* the step on the executor */
  uint64_t quota_rejections;
  uint64_t evictions;      /* sessions closed by Evict */
  uint64_t watchdog_stalls; /* watchdog periods skipped: an executor stuck */
  uint64_t scrapes;
} mokd_metrics;

void mokd_histogram_observe(mokd_histogram *h, uint64_t ns);

struct mokd_server;
/* The exposition of everything the server counts, malloc'ed, into *out;
 * MOK_ENOMEM or 0. */
int mokd_metrics_render(struct mokd_server *srv, char **out, size_t *len);

#endif
