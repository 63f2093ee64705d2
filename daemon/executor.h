/* executor.h - compute off the loop thread, shaped like uv_queue_work: a
 * fixed set of worker threads runs each item's work callback in weighted
 * fair order across tenants (wfq.h; in submission order within one), then its after_work callback runs on the loop thread (all finished
 * items come back through one uv_async_t). What the work is, the executor does
 * not know. */
#ifndef MOKD_EXECUTOR_H
#define MOKD_EXECUTOR_H

#include <stdint.h>
#include <uv.h>

#include "progress.h"
#include "wfq.h"

typedef struct mokd_executor mokd_executor;
typedef struct mokd_work mokd_work;

typedef void (*mokd_work_cb)(mokd_work *w);       /* on a worker thread */
typedef void (*mokd_after_work_cb)(mokd_work *w); /* on the loop thread */

/* Embedded in the caller's request; owned by the executor while queued. */
struct mokd_work {
  mokd_work_cb work;
  mokd_after_work_cb after_work;
  uint64_t t_queued, t_start, t_end; /* mokd_now_ns() at each stage */
  mokd_wfq_item item;  /* in the todo queue */
  mokd_work *next;     /* in the done list */
};

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t mokd_now_ns(void);

int mokd_executor_create(uv_loop_t *loop, int threads, mokd_executor **out);
/* The daemon's own work (a health probe): ahead of every tenant's. */
void mokd_executor_queue(mokd_executor *ex, mokd_work *w, mokd_work_cb work,
                         mokd_after_work_cb after_work);
/* A tenant's work (a step): tenant is its key ("job:ID" or "uid:N"), copied;
 * weight >= 1 its share against the other tenants queued. */
void mokd_executor_queue_for(mokd_executor *ex, mokd_work *w, const char *tenant,
                             unsigned weight, mokd_work_cb work, mokd_after_work_cb after_work);
/* Called on the loop thread for each finished item, before its after_work
 * (the metrics take the item's timings there). */
void mokd_executor_observe(mokd_executor *ex, void (*cb)(void *arg, const mokd_work *w),
                           void *arg);
/* Work queued and completed, as the loop has seen it (progress.h). */
const mokd_progress *mokd_executor_progress(const mokd_executor *ex);
/* Joins the workers (they finish what is queued, and the after_work callbacks
 * run) and closes the async handle; the executor is freed in its close
 * callback. */
void mokd_executor_close(mokd_executor *ex);

#endif
