/* mokctl - talk to a running mokd: ping, status, stats, a layer bench, and
 * the operators' health, sessions and evict. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

/* iters steps of forward, backward and release, their request round trips
 * in fw and bw: without a stream, libmok returns once the step is complete
 * (the CUDA backend replies before its GPU work ends). 0, or the code of the
 * call that failed and its name in *what. */
static int time_steps(mok_client *c, const mok_testbed *tb, int iters, uint64_t *fw,
                      uint64_t *bw, const char **what)
{
  int rc;
  for (int it = 0; it < iters; it++) {
    mok_forward_result f;
    mok_backward_result b;
    uint64_t t0 = mono_ns(), t1;
    if ((rc = mok_forward(c, tb->layer, &tb->x, &tb->ids, &tb->tw, 0, &f)) != 0) {
      *what = "forward";
      return rc;
    }
    t1 = mono_ns();
    if ((rc = mok_backward(c, f.context, &tb->d_out, NULL, 0, &b)) != 0) {
      *what = "backward";
      return rc;
    }
    fw[it] = t1 - t0;
    bw[it] = mono_ns() - t1;
    uint64_t ids[2] = {f.context, b.result};
    if ((rc = mok_release(c, ids, 2)) != 0) {
      *what = "release";
      return rc;
    }
  }
  return 0;
}

/* The percentiles of fw and bw (sorted here), and the GFLOP/s of fl FLOPs a
 * forward at their medians. */
static void print_times(uint64_t *fw, uint64_t *bw, int iters, double fl)
{
  qsort(fw, (size_t)iters, sizeof *fw, cmp_u64);
  qsort(bw, (size_t)iters, sizeof *bw, cmp_u64);
  printf("forward  ms p50 %.2f p90 %.2f p99 %.2f   %.1f GFLOP/s at p50\n", pct(fw, iters, .5),
         pct(fw, iters, .9), pct(fw, iters, .99), fl / (pct(fw, iters, .5) * 1e6));
  printf("backward ms p50 %.2f p90 %.2f p99 %.2f   %.1f GFLOP/s at p50\n", pct(bw, iters, .5),
         pct(bw, iters, .9), pct(bw, iters, .99), 2 * fl / (pct(bw, iters, .5) * 1e6));
}

static int bench(mok_client *c, const mok_layer_desc *d, const mok_layer_tuning *tune, int64_t T,
                 int iters)
{
  const char *what = "";
  int rc;
  mok_testbed tb;

  if ((rc = mok_testbed_setup_tuned(c, d, tune, T, 1, &tb)) != 0) {
    fprintf(stderr, "mokctl: bench: %s (%s)\n", tb.err, mok_strerror(rc));
    mok_close(c);
    return 1;
  }
  uint64_t *fw = calloc((size_t)iters, sizeof *fw), *bw = calloc((size_t)iters, sizeof *bw);
  if (fw == NULL || bw == NULL) {
    fprintf(stderr, "mokctl: bench: no memory for %d timings\n", iters);
    free(fw);
    free(bw);
    mok_close(c);
    return 1;
  }
  if ((rc = time_steps(c, &tb, iters, fw, bw, &what)) != 0)
    return die(c, what, rc);
  printf("layer T=%lld H=%lld I=%lld E=%lld K=%lld I_s=%lld on %s, %d iterations\n",
         (long long)T, (long long)d->hidden, (long long)d->intermediate, (long long)d->experts,
         (long long)d->top_k, (long long)d->shared_intermediate, mok_server_info(c)->backend,
         iters);
  printf("request round trips:\n");
  print_times(fw, bw, iters, mok_testbed_flops(&tb));
  free(fw);
  free(bw);
  mok_close(c);
  return 0;
}

/* ---- bench --ep P ----------------------------------------------------------
 * P client processes, each rank r of one EP group with T tokens of its own
 * and experts [r E/P, (r + 1) E/P), time their round trips; a step of the
 * group lasts as long as its slowest rank's. Each sends the parent what it
 * saw through a pipe of its own: a status, then its timings. */

typedef struct rank_report {
  int rc;
  char err[MOK_ERRLEN];
} rank_report;

static int write_all(int fd, const void *p, size_t n)
{
  for (const char *q = p; n > 0;) {
    ssize_t w = write(fd, q, n);
    if (w <= 0)
      return -1;
    q += w, n -= (size_t)w;
  }
  return 0;
}

static int read_all(int fd, void *p, size_t n)
{
  for (char *q = p; n > 0;) {
    ssize_t r = read(fd, q, n);
    if (r <= 0)
      return -1;
    q += r, n -= (size_t)r;
  }
  return 0;
}

/* One rank, in a child process: 0 when its report and timings went out. */
static int run_rank(const mokctl_opts *o, uint64_t group, int rank, int out)
{
  rank_report rep = {0, ""};
  uint64_t *t = calloc(2 * (size_t)o->iters, sizeof *t);
  mok_layer_desc d = o->layer;
  mok_client *c = NULL;
  mok_testbed tb;

  if (t == NULL) {
    rep.rc = MOK_ENOMEM;
    snprintf(rep.err, sizeof rep.err, "no memory for %d timings", o->iters);
  } else if ((rep.rc = mok_connect(o->socket, "mokctl bench", &c)) != 0 ||
             (rep.rc = mok_layer_desc_ep(&d, group, (uint32_t)o->ep, (uint32_t)rank)) != 0) {
    snprintf(rep.err, sizeof rep.err, "%s", c != NULL ? mok_last_error(c) : "connect");
  } else if ((rep.rc = mok_testbed_setup_tuned(c, &d, &o->tune, o->T, 1 + (uint64_t)rank,
                                               &tb)) != 0) {
    snprintf(rep.err, sizeof rep.err, "%s", tb.err);
  }
  const char *what = "";
  if (rep.rc == 0 && (rep.rc = time_steps(c, &tb, o->iters, t, t + o->iters, &what)) != 0)
    snprintf(rep.err, sizeof rep.err, "%s", mok_last_error(c));
  int bad = write_all(out, &rep, sizeof rep) != 0 ||
            (rep.rc == 0 && write_all(out, t, 2 * (size_t)o->iters * sizeof *t) != 0);
  free(t);
  mok_close(c);
  return bad || rep.rc != 0;
}

static int bench_ep(const mokctl_opts *o)
{
  int P = o->ep, iters = o->iters, failed = 0;
  uint64_t group = (mono_ns() << 16 ^ (uint64_t)getpid()) | 1; /* per user; 0 = none */
  int *in = calloc((size_t)P, sizeof *in);
  pid_t *kids = calloc((size_t)P, sizeof *kids);
  uint64_t *fw = calloc((size_t)iters, sizeof *fw), *bw = calloc((size_t)iters, sizeof *bw);
  uint64_t *t = calloc(2 * (size_t)iters, sizeof *t);

  if (in == NULL || kids == NULL || fw == NULL || bw == NULL || t == NULL) {
    fprintf(stderr, "mokctl: bench: no memory for %d ranks' timings\n", P);
    return 1;
  }
  fflush(stdout);
  for (int r = 0; r < P; r++) {
    int p[2];
    if (pipe(p) != 0 || (kids[r] = fork()) < 0) {
      perror("mokctl: bench: starting a rank");
      failed = 1;
      P = r;
      break;
    }
    if (kids[r] == 0) {
      close(p[0]);
      for (int q = 0; q < r; q++)
        close(in[q]);
      _exit(run_rank(o, group, r, p[1]));
    }
    close(p[1]);
    in[r] = p[0];
  }
  for (int r = 0; r < P; r++) {
    rank_report rep;
    if (read_all(in[r], &rep, sizeof rep) != 0) {
      fprintf(stderr, "mokctl: bench: rank %d ended without a report\n", r);
      failed = 1;
    } else if (rep.rc != 0) {
      fprintf(stderr, "mokctl: bench: rank %d: %s (%s)\n", r, rep.err, mok_strerror(rep.rc));
      failed = 1;
    } else if (read_all(in[r], t, 2 * (size_t)iters * sizeof *t) != 0) {
      fprintf(stderr, "mokctl: bench: rank %d's timings were cut short\n", r);
      failed = 1;
    } else {
      for (int it = 0; it < iters; it++) { /* the group's step: its slowest rank */
        fw[it] = t[it] > fw[it] ? t[it] : fw[it];
        bw[it] = t[iters + it] > bw[it] ? t[iters + it] : bw[it];
      }
    }
    close(in[r]);
  }
  for (int r = 0; r < P; r++)
    waitpid(kids[r], NULL, 0);
  if (!failed) {
    mok_layer_desc d = o->layer;
    mok_testbed one = {.d = d, .T = o->T};
    double fl = mok_testbed_flops(&one) * o->ep;
    printf("layer T=%lld a rank H=%lld I=%lld E=%lld K=%lld I_s=%lld, EP group of %d ranks "
           "(%lld experts each), %d iterations\n", (long long)o->T, (long long)d.hidden,
           (long long)d.intermediate, (long long)d.experts, (long long)d.top_k,
           (long long)d.shared_intermediate, o->ep, (long long)(d.experts / o->ep), iters);
    printf("group step round trips (the slowest rank's), GFLOP/s of all ranks:\n");
    print_times(fw, bw, iters, fl);
  }
  free(in);
  free(kids);
  free(fw);
  free(bw);
  free(t);
  return failed;
}

/* health must answer even when the daemon does not: a stuck daemon is not ready */
static int health_timeout_s;

static void on_health_alarm(int sig)
{
  char msg[96];
  int n = snprintf(msg, sizeof msg, "not ready: mokd did not answer within %d s\n",
                   health_timeout_s);
  (void)sig;
  if (write(STDOUT_FILENO, msg, (size_t)n) < 0)
    _exit(1);
  _exit(1);
}

static void start_health_alarm(int seconds)
{
  struct sigaction sa = {.sa_handler = on_health_alarm};
  health_timeout_s = seconds;
  sigaction(SIGALRM, &sa, NULL);
  alarm((unsigned)seconds);
}

static int health(mok_client *c)
{
  char reason[MOK_ERRLEN];
  uint64_t rtt;
  int ready, rc;

  if ((rc = mok_health(c, &ready, reason, sizeof reason, &rtt)) != 0) {
    printf("not ready: %s (%s)\n", mok_last_error(c), mok_strerror(rc));
    mok_close(c);
    return 1;
  }
  if (ready)
    printf("ready: mokd %s, backend %s, executor round trip %.1f us\n",
           mok_server_info(c)->daemon_version, mok_server_info(c)->backend, (double)rtt * 1e-3);
  else
    printf("not ready: %s\n", reason);
  mok_close(c);
  return ready ? 0 : 1;
}

static int sessions(mok_client *c)
{
  mok_session_info *v;
  size_t n;
  int rc;

  if ((rc = mok_sessions(c, &v, &n)) != 0)
    return die(c, "sessions", rc);
  printf("%-8s %-8s %-6s %-12s %-8s %-5s %14s %14s %14s %8s %6s %9s\n", "SESSION", "PID",
         "UID", "JOB", "CLIENT", "GPU", "ARENA_BYTES", "CONTEXT_BYTES", "GPU_BYTES",
         "CONTEXTS", "LAYERS", "AGE_S");
  for (size_t i = 0; i < n; i++) {
    char gpu[16] = "-";
    if (v[i].device >= 0)
      snprintf(gpu, sizeof gpu, "%d", v[i].device);
    printf("%-8llu %-8d %-6u %-12s %-8s %-5s %14llu %14llu %14llu %8llu %6llu %9.1f%s\n",
           (unsigned long long)v[i].id, (int)v[i].pid, (unsigned)v[i].uid,
           v[i].job_id[0] ? v[i].job_id : "-", v[i].client_name, gpu,
           (unsigned long long)v[i].arena_bytes, (unsigned long long)v[i].context_bytes,
           (unsigned long long)v[i].gpu_bytes, (unsigned long long)v[i].contexts,
           (unsigned long long)v[i].layers, (double)v[i].age_ns * 1e-9,
           v[i].id == mok_server_info(c)->session_id ? " (this mokctl)" : "");
  }
  free(v);
  mok_close(c);
  return 0;
}

/* How many sessions of the job (or the session) are still there. */
static int left_of(mok_client *c, const mokctl_opts *o, size_t *left)
{
  mok_session_info *v;
  size_t n;
  int rc = mok_sessions(c, &v, &n);
  if (rc != 0)
    return rc;
  *left = 0;
  for (size_t i = 0; i < n; i++)
    if (v[i].id != mok_server_info(c)->session_id &&
        (o->session != 0 ? v[i].id == o->session : strcmp(v[i].job_id, o->job) == 0))
      (*left)++;
  free(v);
  return 0;
}

/* Evicts, then waits until the daemon has let the sessions go (a step in
 * flight finishes first), so that their memory is back when this returns. */
static int evict(mok_client *c, const mokctl_opts *o)
{
  uint64_t deadline = mono_ns() + (uint64_t)o->timeout_s * 1000000000ull;
  uint32_t count;
  size_t left = 0;
  int rc;

  if ((rc = mok_evict(c, o->job, o->session, &count)) != 0)
    return die(c, "evict", rc);
  while ((rc = left_of(c, o, &left)) == 0 && left > 0 && mono_ns() < deadline) {
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  if (rc != 0)
    return die(c, "evict", rc);
  if (o->session != 0)
    printf("evicted session %llu (%u closed)", (unsigned long long)o->session, count);
  else
    printf("evicted job %s: %u session%s closed", o->job, count, count == 1 ? "" : "s");
  if (left > 0) {
    printf("; %zu still there after %d s\n", left, o->timeout_s);
    mok_close(c);
    return 1;
  }
  printf(", their memory freed\n");
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
    mok_layer_desc d = o.layer;
    d.ep_size = (uint32_t)o.ep;
    if (mok_testbed_check(&d, o.T, &bytes, err, sizeof err) != 0) {
      fprintf(stderr, "mokctl: bench: %s\n", err);
      return 2;
    }
    if (o.ep > 1)
      return bench_ep(&o);
  }
  if (o.cmd == MOKCTL_HEALTH) {
    start_health_alarm(o.timeout_s);
    if ((rc = mok_connect(o.socket, "mokctl", &c)) != 0) {
      printf("not ready: %s (%s)\n", c != NULL ? mok_last_error(c) : "", mok_strerror(rc));
      mok_close(c);
      return 1;
    }
    return health(c);
  }
  if ((rc = mok_connect(o.socket, "mokctl", &c)) != 0)
    return die(c, "connect", rc);
  if (o.cmd == MOKCTL_SESSIONS)
    return sessions(c);
  if (o.cmd == MOKCTL_EVICT)
    return evict(c, &o);
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
    return bench(c, &o.layer, &o.tune, o.T, o.iters);
  }
  mok_close(c);
  return 0;
}
