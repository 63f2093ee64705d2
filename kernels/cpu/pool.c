/* pool.c - see pool.h. Tasks are claimed with an atomic counter; a job ends
 * when the count of finished tasks reaches ntasks. */
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

struct mokc_pool {
  int nthreads; /* workers + the caller */
  pthread_t *workers;
  pthread_mutex_t lock;
  pthread_cond_t wake, done;
  pthread_mutex_t job_lock; /* one job at a time */
  uint64_t generation;
  int stopping;
  int active; /* workers inside the current job */
  mokc_task_fn fn;
  void *arg;
  int64_t ntasks;
  atomic_int_fast64_t next;
};

static void drain(mokc_pool *p)
{
  int64_t i;
  while ((i = atomic_fetch_add(&p->next, 1)) < p->ntasks)
    p->fn(p->arg, i);
}

static void *worker_main(void *arg)
{
  mokc_pool *p = arg;
  uint64_t seen = 0;

  pthread_mutex_lock(&p->lock);
  for (;;) {
    while (!p->stopping && p->generation == seen)
      pthread_cond_wait(&p->wake, &p->lock);
    if (p->stopping)
      break;
    seen = p->generation;
    /* A late wake: every task of the job is claimed and its caller may
     * have returned and be setting up the next job. Drain would then race
     * that set-up (a claim from the old counter checked against the new
     * ntasks ran a task twice); the job needs nobody else anyway. While
     * the job has tasks left, its caller cannot return before this worker
     * leaves it (active). */
    if (atomic_load(&p->next) >= p->ntasks)
      continue;
    p->active++;
    pthread_mutex_unlock(&p->lock);
    drain(p);
    pthread_mutex_lock(&p->lock);
    if (--p->active == 0)
      pthread_cond_signal(&p->done);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

int mokc_pool_create(int threads, mokc_pool **out)
{
  mokc_pool *p;

  *out = NULL;
  if (threads < 1)
    return -1;
  p = calloc(1, sizeof *p);
  if (p == NULL)
    return -1;
  p->nthreads = threads;
  pthread_mutex_init(&p->lock, NULL);
  pthread_mutex_init(&p->job_lock, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->done, NULL);
  if (threads > 1) {
    p->workers = calloc((size_t)threads - 1, sizeof *p->workers);
    if (p->workers == NULL) {
      mokc_pool_destroy(p);
      return -1;
    }
    for (int i = 0; i < threads - 1; i++) {
      if (pthread_create(&p->workers[i], NULL, worker_main, p) != 0) {
        p->nthreads = i + 1; /* only the started ones are joined */
        mokc_pool_destroy(p);
        return -1;
      }
    }
  }
  *out = p;
  return 0;
}

void mokc_pool_destroy(mokc_pool *p)
{
  if (p == NULL)
    return;
  pthread_mutex_lock(&p->lock);
  p->stopping = 1;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->lock);
  if (p->workers != NULL)
    for (int i = 0; i < p->nthreads - 1; i++)
      pthread_join(p->workers[i], NULL);
  free(p->workers);
  pthread_cond_destroy(&p->wake);
  pthread_cond_destroy(&p->done);
  pthread_mutex_destroy(&p->lock);
  pthread_mutex_destroy(&p->job_lock);
  free(p);
}

int mokc_pool_threads(const mokc_pool *p)
{
  return p->nthreads;
}

void mokc_pool_run(mokc_pool *p, int64_t ntasks, mokc_task_fn fn, void *arg)
{
  if (ntasks <= 0)
    return;
  if (p->nthreads == 1 || ntasks == 1) {
    for (int64_t i = 0; i < ntasks; i++)
      fn(arg, i);
    return;
  }
  pthread_mutex_lock(&p->job_lock);
  pthread_mutex_lock(&p->lock);
  p->fn = fn;
  p->arg = arg;
  p->ntasks = ntasks;
  atomic_store(&p->next, 0);
  p->generation++;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->lock);

  drain(p);

  /* a worker that has not woken yet finds next >= ntasks and leaves at once */
  pthread_mutex_lock(&p->lock);
  while (p->active > 0 || atomic_load(&p->next) < ntasks)
    pthread_cond_wait(&p->done, &p->lock);
  pthread_mutex_unlock(&p->lock);
  pthread_mutex_unlock(&p->job_lock);
}
