/* pool.h - a fixed pthread pool that runs n independent tasks of one job. The
 * caller's thread works too. Which thread runs a task never changes a result:
 * every task owns its outputs. */
#ifndef MOKC_POOL_H
#define MOKC_POOL_H

#include <stdint.h>

typedef struct mokc_pool mokc_pool;
typedef void (*mokc_task_fn)(void *arg, int64_t task);

int mokc_pool_create(int threads, mokc_pool **out);
void mokc_pool_destroy(mokc_pool *pool);
int mokc_pool_threads(const mokc_pool *pool);
/* Runs fn(arg, i) for i in [0, ntasks) and returns when all have finished.
 * Jobs from different caller threads are serialised. */
void mokc_pool_run(mokc_pool *pool, int64_t ntasks, mokc_task_fn fn, void *arg);

#endif
