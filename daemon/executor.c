/* executor.c - see executor.h. */
#include "executor.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

struct mokd_executor {
  uv_async_t async;
  pthread_t *threads;
  int nthreads;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  mokd_job *todo_head, *todo_tail;
  mokd_job *done_head, *done_tail;
  int stopping;
  void (*done)(mokd_job *);
};

/* A CUDA step is only queued here: it waits on the GPU for the client's ready
 * event, and a done event recorded after it goes back with the reply, so the
 * reply leaves while the GPU still works. Nothing here waits for the GPU;
 * errors only the GPU can see travel in the step's status word. */
static int run_cuda(mokd_job *job)
{
#ifdef MOKD_HAVE_CUDA
  int rc;
  if (*job->events == NULL && (rc = mokk_cuda_events_create(job->backend, job->events,
                                                             job->err)) != 0)
    return rc;
  if (job->has_ready && (rc = mokk_cuda_wait(job->backend, *job->events, job->ready,
                                             job->err)) != 0)
    return rc;
  if (job->backward)
    rc = mokk_backward(job->backend, job->ctx, job->mode, &job->br, job->err);
  else
    rc = mokk_forward(job->backend, &job->shape, job->T, &job->fr,
                      job->want_ctx ? &job->ctx : NULL, job->err);
  if (rc == 0)
    rc = mokk_cuda_finish(job->backend, *job->events, job->status, job->done, job->err);
  if (rc == 0)
    job->has_done = 1;
  else if (!job->backward && job->ctx != NULL) {
    mokk_ctx_free(job->backend, job->ctx);
    job->ctx = NULL;
  }
  return rc;
#else
  return mokk_fail(job->err, MOK_ENOTSUP, "this mokd was built without CUDA");
#endif
}

static void run_job(mokd_job *job)
{
  job->t_start = mokd_now_ns();
  if (job->events != NULL)
    job->rc = run_cuda(job);
  else if (job->backward)
    job->rc = mokk_backward(job->backend, job->ctx, job->mode, &job->br, job->err);
  else
    job->rc = mokk_forward(job->backend, &job->shape, job->T, &job->fr,
                           job->want_ctx ? &job->ctx : NULL, job->err);
  job->t_end = mokd_now_ns();
}

static void *worker(void *arg)
{
  mokd_executor *ex = arg;

  pthread_mutex_lock(&ex->mu);
  for (;;) {
    mokd_job *job;
    while (ex->todo_head == NULL && !ex->stopping)
      pthread_cond_wait(&ex->cv, &ex->mu);
    if (ex->todo_head == NULL)
      break;
    job = ex->todo_head;
    ex->todo_head = job->next;
    if (ex->todo_head == NULL)
      ex->todo_tail = NULL;
    pthread_mutex_unlock(&ex->mu);

    run_job(job);

    pthread_mutex_lock(&ex->mu);
    job->next = NULL;
    if (ex->done_tail != NULL)
      ex->done_tail->next = job;
    else
      ex->done_head = job;
    ex->done_tail = job;
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
  mokd_job *list;

  pthread_mutex_lock(&ex->mu);
  list = ex->done_head;
  ex->done_head = ex->done_tail = NULL;
  pthread_mutex_unlock(&ex->mu);
  while (list != NULL) {
    mokd_job *next = list->next;
    ex->done(list);
    list = next;
  }
}

int mokd_executor_create(uv_loop_t *loop, int threads, void (*done)(mokd_job *),
                         mokd_executor **out)
{
  mokd_executor *ex = calloc(1, sizeof *ex);
  int rc;

  *out = NULL;
  if (ex == NULL)
    return MOK_ENOMEM;
  ex->done = done;
  ex->threads = calloc((size_t)threads, sizeof *ex->threads);
  if (ex->threads == NULL) {
    free(ex);
    return MOK_ENOMEM;
  }
  pthread_mutex_init(&ex->mu, NULL);
  pthread_cond_init(&ex->cv, NULL);
  if ((rc = uv_async_init(loop, &ex->async, on_async)) != 0) {
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

void mokd_executor_submit(mokd_executor *ex, mokd_job *job)
{
  job->next = NULL;
  job->t_submit = mokd_now_ns();
  pthread_mutex_lock(&ex->mu);
  if (ex->todo_tail != NULL)
    ex->todo_tail->next = job;
  else
    ex->todo_head = job;
  ex->todo_tail = job;
  pthread_cond_signal(&ex->cv);
  pthread_mutex_unlock(&ex->mu);
}

static void on_closed(uv_handle_t *h)
{
  mokd_executor *ex = h->data;
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
