/* executor.h - compute off the loop thread. A fixed set of worker threads
 * takes jobs in submission order; finished jobs go back to the loop through
 * one uv_async_t, whose callback runs each job's completion on the loop. */
#ifndef MOKD_EXECUTOR_H
#define MOKD_EXECUTOR_H

#include <uv.h>

#include "mokd.h"

typedef struct mokd_executor mokd_executor;

int mokd_executor_create(uv_loop_t *loop, int threads, void (*done)(mokd_job *),
                         mokd_executor **out);
void mokd_executor_submit(mokd_executor *ex, mokd_job *job);
/* Joins the workers (they finish what is queued) and closes the async handle;
 * the executor is freed in the handle's close callback. */
void mokd_executor_close(mokd_executor *ex);

#endif
