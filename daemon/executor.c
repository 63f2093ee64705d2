/* executor.c - see executor.h. */
#include "executor.h"

#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <time.h>

#include "log.h"
#include "mok_errno.h"

struct mokd_executor {
  uv_async_t async;
  pthread_t *threads;
  int nthreads;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  mokd_wfq todo;
  mokd_work *done_head, *done_tail;
  int stopping;
  mokd_progress progress;  /* the loop thread's */
  void (*observe)(void *arg, const mokd_work *w);
  void *observe_arg;
};

uint64_t mokd_now_ns(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *worker(void *arg)
{
  mokd_executor *ex = arg;

  pthread_mutex_lock(&ex->mu);
  for (;;) {
    mokd_wfq_item *it;
    mokd_work *w;
    while (ex->todo.len == 0 && !ex->stopping)
      pthread_cond_wait(&ex->cv, &ex->mu);
    if ((it = mokd_wfq_pop(&ex->todo)) == NULL)
      break;
    w = (mokd_work *)((char *)it - offsetof(mokd_work, item));
    pthread_mutex_unlock(&ex->mu);

    w->t_start = mokd_now_ns();
    w->work(w);
    w->t_end = mokd_now_ns();

    pthread_mutex_lock(&ex->mu);
    w->next = NULL;
    if (ex->done_tail != NULL)
      ex->done_tail->next = w;
    else
      ex->done_head = w;
    ex->done_tail = w;
    pthread_mutex_unlock(&ex->mu);
    uv_async_send(&ex->async);
    pthread_mutex_lock(&ex->mu);
  }
  pthread_mutex_unlock(&ex->mu);
  return NULL;
}

static void on_async(uv_async_t *h)
{
  mokd_executor *ex = h->data;
  mokd_work *list;

  pthread_mutex_lock(&ex->mu);
  list = ex->done_head;
  ex->done_head = ex->done_tail = NULL;
  pthread_mutex_unlock(&ex->mu);
  while (list != NULL) {
    mokd_work *next = list->next;
    mokd_progress_done(&ex->progress, mokd_now_ns());
    if (ex->observe != NULL)
      ex->observe(ex->observe_arg, list);
    list->after_work(list);
    list = next;
  }
}

int mokd_executor_create(uv_loop_t *loop, int threads, mokd_executor **out)
{
  mokd_executor *ex = calloc(1, sizeof *ex);

  *out = NULL;
  if (ex == NULL)
    return MOK_ENOMEM;
  ex->threads = calloc((size_t)threads, sizeof *ex->threads);
  if (ex->threads == NULL) {
    free(ex);
    return MOK_ENOMEM;
  }
  mokd_wfq_init(&ex->todo);
  pthread_mutex_init(&ex->mu, NULL);
  pthread_cond_init(&ex->cv, NULL);
  if (uv_async_init(loop, &ex->async, on_async) != 0) {
    free(ex->threads);
    free(ex);
    return MOK_EIO;
  }
  ex->async.data = ex;
  for (int i = 0; i < threads; i++) {
    if (pthread_create(&ex->threads[i], NULL, worker, ex) != 0) {
      LOG_ERROR(EXEC, "could not start executor thread %d of %d", i + 1, threads);
      ex->nthreads = i;
      mokd_executor_close(ex);
      return MOK_ENOMEM;
    }
    ex->nthreads = i + 1;
  }
  *out = ex;
  return 0;
}

void mokd_executor_queue_for(mokd_executor *ex, mokd_work *w, const char *tenant,
                             unsigned weight, mokd_work_cb work, mokd_after_work_cb after_work)
{
  w->work = work;
  w->after_work = after_work;
  w->next = NULL;
  w->t_queued = mokd_now_ns();
  mokd_progress_queued(&ex->progress, w->t_queued);
  pthread_mutex_lock(&ex->mu);
  if (mokd_wfq_push(&ex->todo, &w->item, tenant, weight) != 0) {
    /* no memory for a tenant's record: the step still runs, unweighted */
    LOG_WARN(EXEC, "out of memory queueing a step of tenant %s; it goes ahead of the fair "
             "queue", tenant);
    mokd_wfq_push(&ex->todo, &w->item, NULL, 1);
  }
  pthread_mutex_unlock(&ex->mu);
  /* after the unlock: a worker woken while the loop still held the mutex
   * would sleep on it once more before it could take the step */
  pthread_cond_signal(&ex->cv);
}

void mokd_executor_queue(mokd_executor *ex, mokd_work *w, mokd_work_cb work,
                         mokd_after_work_cb after_work)
{
  mokd_executor_queue_for(ex, w, NULL, 1, work, after_work);
}

void mokd_executor_observe(mokd_executor *ex, void (*cb)(void *arg, const mokd_work *w),
                           void *arg)
{
  ex->observe = cb;
  ex->observe_arg = arg;
}

const mokd_progress *mokd_executor_progress(const mokd_executor *ex)
{
  return &ex->progress;
}

static void on_closed(uv_handle_t *h)
{
  mokd_executor *ex = h->data;
  mokd_wfq_clear(&ex->todo);
  pthread_mutex_destroy(&ex->mu);
  pthread_cond_destroy(&ex->cv);
  free(ex->threads);
  free(ex);
}

void mokd_executor_close(mokd_executor *ex)
{
  pthread_mutex_lock(&ex->mu);
  ex->stopping = 1;
  pthread_cond_broadcast(&ex->cv);
  pthread_mutex_unlock(&ex->mu);
  for (int i = 0; i < ex->nthreads; i++)
    pthread_join(ex->threads[i], NULL);
  on_async(&ex->async); /* completions that raced the join */
  uv_close((uv_handle_t *)&ex->async, on_closed);
}
