/* mokctl - talk to a running mokd: ping, status, stats, and a layer bench. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mok.h"
#include "mokctl_opts.h"
#include "testbed.h"

static int die(mok_client *c, const char *what, int rc)
{
  fprintf(stderr, "mokctl: %s: %s (%s)\n", what, c != NULL ? mok_last_error(c) : "",
          mok_strerror(rc));
  mok_close(c);
  return 1;
}

static uint64_t mono_ns(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double pct(const uint64_t *v, int n, double p)
{
  int i = (int)(p * (n - 1) + 0.5);
  return (double)v[i] * 1e-6;
}

static int bench(mok_client *c, const mok_layer_desc *d, int64_t T, int iters)
{
  int rc;
  mok_testbed tb;

  if ((rc = mok_testbed_setup(c, d, T, 1, &tb)) != 0) {
    fprintf(stderr, "mokctl: bench: %s (%s)\n", tb.err, mok_strerror(rc));
    mok_close(c);
    return 1;
  }
  uint64_t *fw = calloc((size_t)iters, sizeof *fw), *bw = calloc((size_t)iters, sizeof *bw);
  if (fw == NULL || bw == NULL) {
    fprintf(stderr, "mokctl: bench: no memory for %d timings\n", iters);
    free(fw), free(bw);
    mok_close(c);
    return 1;
  }
  /* request round trips: without a stream, libmok returns once the step is
   * complete (the CUDA backend replies before its GPU work ends) */
  for (int it = 0; it < iters; it++) {
    mok_forward_result f;
    mok_backward_result b;
    uint64_t t0 = mono_ns(), t1;
    if ((rc = mok_forward(c, tb.layer, &tb.x, &tb.ids, &tb.tw, 0, &f)) != 0)
      return die(c, "forward", rc);
    t1 = mono_ns();
    if ((rc = mok_backward(c, f.context, &tb.d_out, NULL, 0, &b)) != 0)
      return die(c, "backward", rc);
    fw[it] = t1 - t0;
    bw[it] = mono_ns() - t1;
    uint64_t ids[2] = {f.context, b.result};
    if ((rc = mok_release(c, ids, 2)) != 0)
      return die(c, "release", rc);
  }
  qsort(fw, (size_t)iters, sizeof *fw, cmp_u64);
  qsort(bw, (size_t)iters, sizeof *bw, cmp_u64);
  double fl = mok_testbed_flops(&tb);
  printf("layer T=%lld H=%lld I=%lld E=%lld K=%lld I_s=%lld on %s, %d iterations\n",
         (long long)T, (long long)d->hidden, (long long)d->intermediate, (long long)d->experts,
         (long long)d->top_k, (long long)d->shared_intermediate, mok_server_info(c)->backend,
         iters);
  printf("request round trips:\n");
  printf("forward  ms p50 %.2f p90 %.2f p99 %.2f   %.1f GFLOP/s at p50\n", pct(fw, iters, .5),
         pct(fw, iters, .9), pct(fw, iters, .99), fl / (pct(fw, iters, .5) * 1e6));
  printf("backward ms p50 %.2f p90 %.2f p99 %.2f   %.1f GFLOP/s at p50\n", pct(bw, iters, .5),
         pct(bw, iters, .9), pct(bw, iters, .99), 2 * fl / (pct(bw, iters, .5) * 1e6));
  free(fw), free(bw);
  mok_close(c);
  return 0;
}

int main(int argc, char **argv)
{
  mokctl_opts o;
  char err[MOK_ERRLEN];
  mok_client *c;
  int rc;

  if (mokctl_parse(argc, argv, &o, err, sizeof err) != 0) {
    fprintf(stderr, "mokctl: %s\n(mokctl --help lists the commands and their options)\n", err);
    return 2;
  }
  if (o.help) {
    mokctl_usage(stdout, o.cmd);
    return 0;
  }
  if (o.cmd == MOKCTL_BENCH) {
    size_t bytes; /* before connecting: nothing to ask the daemon about a bad shape */
    if (mok_testbed_check(&o.layer, o.T, &bytes, err, sizeof err) != 0) {
      fprintf(stderr, "mokctl: bench: %s\n", err);
      return 2;
    }
  }
  if ((rc = mok_connect(o.socket, "mokctl", &c)) != 0)
    return die(c, "connect", rc);
  if (o.cmd == MOKCTL_PING) {
    uint64_t rtt;
    if ((rc = mok_ping(c, &rtt)) != 0)
      return die(c, "ping", rc);
    printf("pong from mokd %s in %.1f us\n", mok_server_info(c)->daemon_version,
           (double)rtt * 1e-3);
  } else if (o.cmd == MOKCTL_STATUS) {
    const mok_welcome *w = mok_server_info(c);
    mok_stats st;
    if ((rc = mok_stats_get(c, &st)) != 0)
      return die(c, "status", rc);
    printf("mokd %s, protocol %u, backend %s, up %.1f s\n", w->daemon_version,
           w->protocol_version, w->backend, (double)st.uptime_ns * 1e-9);
    printf("limits: frame %u bytes, arena %llu bytes, session quota %llu bytes%s\n",
           w->max_frame_bytes, (unsigned long long)w->max_arena_bytes,
           (unsigned long long)w->session_quota_bytes,
           w->session_quota_bytes == 0 ? " (unlimited)" : "");
    if (strcmp(w->backend, "cuda") == 0)
      printf("GPU: session quota %llu bytes%s, %llu bytes held by all sessions\n",
             (unsigned long long)w->session_gpu_quota_bytes,
             w->session_gpu_quota_bytes == 0 ? " (unlimited)" : "",
             (unsigned long long)st.daemon.gpu_bytes);
    printf("sessions %llu (this one is %llu)\n", (unsigned long long)st.daemon.sessions,
           (unsigned long long)w->session_id);
  } else if (o.cmd == MOKCTL_STATS) {
    mok_stats st;
    if ((rc = mok_stats_get(c, &st)) != 0)
      return die(c, "stats", rc);
    const mok_usage *u = &st.daemon;
    printf("sessions %llu\narenas %llu\narena_bytes %llu\nlayers %llu\ncontexts %llu\n"
           "context_bytes %llu\nresults %llu\nrequests %llu\nforwards %llu\nbackwards %llu\n"
           "errors %llu\n",
           (unsigned long long)u->sessions, (unsigned long long)u->arenas,
           (unsigned long long)u->arena_bytes, (unsigned long long)u->layers,
           (unsigned long long)u->contexts, (unsigned long long)u->context_bytes,
           (unsigned long long)u->results, (unsigned long long)u->requests,
           (unsigned long long)u->forwards, (unsigned long long)u->backwards,
           (unsigned long long)u->errors);
  } else {
    return bench(c, &o.layer, o.T, o.iters);
  }
  mok_close(c);
  return 0;
}
