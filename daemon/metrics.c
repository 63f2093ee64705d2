/* metrics.c - see metrics.h. Label values are the daemon's own (op names,
 * numbers, job ids checked at Hello, tenants made of them), so none needs
 * escaping. */
#include "metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mokd.h"

static const double bounds_s[MOKD_HIST_BUCKETS] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,     10};

void mokd_histogram_observe(mokd_histogram *h, uint64_t ns)
{
  double s = (double)ns * 1e-9;
  for (int i = 0; i < MOKD_HIST_BUCKETS; i++)
    if (s <= bounds_s[i]) {
      h->bucket[i]++;
      break;
    }
  h->count++;
  h->sum_ns += ns;
}

typedef struct buf {
  char *p;
  size_t len, cap;
  int oom;
} buf;

static void put(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(buf *b, const char *fmt, ...)
{
  va_list ap;
  int n;

  if (b->oom)
    return;
  for (;;) {
    va_start(ap, fmt);
    n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = 1;
      return;
    }
    if ((size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap * 2 + (size_t)n;
    char *p = realloc(b->p, cap);
    if (p == NULL) {
      b->oom = 1;
      return;
    }
    b->p = p, b->cap = cap;
  }
}

static void head(buf *b, const char *name, const char *type, const char *help)
{
  put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void histogram(buf *b, const char *name, const char *help, const mokd_histogram *h)
{
  uint64_t cum = 0;
  head(b, name, "histogram", help);
  for (int i = 0; i < MOKD_HIST_BUCKETS; i++) {
    cum += h->bucket[i];
    put(b, "%s_bucket{le=\"%g\"} %llu\n", name, bounds_s[i], (unsigned long long)cum);
  }
  put(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)h->count);
  put(b, "%s_sum %.9f\n", name, (double)h->sum_ns * 1e-9);
  put(b, "%s_count %llu\n", name, (unsigned long long)h->count);
}

/* "CreateArena" -> "create_arena" */
static void snake(const char *in, char *out, size_t n)
{
  size_t o = 0;
  for (size_t i = 0; in[i] != 0 && o + 2 < n; i++) {
    char c = in[i];
    if (c >= 'A' && c <= 'Z') {
      if (i > 0)
        out[o++] = '_';
      c = (char)(c - 'A' + 'a');
    }
    out[o++] = c;
  }
  out[o] = 0;
}

static void by_op(buf *b, const char *name, const char *help, const uint64_t *v)
{
  char op[48];
  head(b, name, "counter", help);
  for (int i = 0; i < MOKD_METRIC_OPS; i++) {
    const char *n = mokd_dispatch_op_name(i);
    if (n == NULL && (i != 0 || v[0] == 0))
      continue;
    snake(n != NULL ? n : "Invalid", op, sizeof op);
    put(b, "%s{op=\"%s\"} %llu\n", name, op, (unsigned long long)v[i]);
  }
}

static void session_memory(buf *b, const mokd_server *srv)
{
  static const char *const kinds[] = {"arena", "context", "gpu"};
  head(b, "mokd_session_memory_bytes", "gauge",
       "Memory a session holds, by kind: arena (host and GPU arenas it made or imported, "
       "and its outputs), context (saved forward state), gpu (GPU memory of both).");
  for (const mokd_session *s = srv->sessions; s != NULL; s = s->next) {
    const uint64_t v[] = {s->usage.arena_bytes, s->usage.context_bytes, s->usage.gpu_bytes};
    if (!s->hello_done)
      continue;
    for (int k = 0; k < 3; k++)
      put(b, "mokd_session_memory_bytes{session=\"%llu\",job=\"%s\",kind=\"%s\"} %llu\n",
          (unsigned long long)s->id, s->job, kinds[k], (unsigned long long)v[k]);
  }
}

/* Tenants with a session, work queued or memory held: a tenant's series go
 * with its last session (its counters start again from 0 if it comes back). */
static uint64_t tenant_value(const mokd_tenant *t, int which)
{
  switch (which) {
  case 0: return t->steps;
  case 1: return t->queued;
  case 2: return t->held;
  case 3: return t->weight;
  default: return t->quota;
  }
}

static void tenants(buf *b, const mokd_server *srv)
{
  static const struct {
    const char *name, *type, *help;
  } series[] = { /* in tenant_value's order */
      {"mokd_tenant_steps_total", "counter",
       "Steps served, by tenant (job:ID, else uid:N; each rank of a group step counts). "
       "A tenant's series goes once it has no session, no queued step and no memory."},
      {"mokd_tenant_queued", "gauge",
       "Steps of a tenant queued for an executor or running, not yet done."},
      {"mokd_tenant_memory_bytes", "gauge",
       "Host and GPU memory all sessions of a tenant hold together, as tenant_quota_bytes "
       "counts it."},
      {"mokd_tenant_weight", "gauge",
       "A tenant's share of the executors (tenant_weights; SIGHUP re-reads it)."},
      {"mokd_tenant_quota_bytes", "gauge",
       "A tenant's tenant_quota_bytes, 0 for none (SIGHUP re-reads it)."},
  };
  for (int i = 0; i < (int)(sizeof series / sizeof series[0]); i++) {
    head(b, series[i].name, series[i].type, series[i].help);
    for (const mokd_tenant *t = srv->tenants; t != NULL; t = t->next)
      put(b, "%s{tenant=\"%s\"} %llu\n", series[i].name, t->key,
          (unsigned long long)tenant_value(t, i));
  }
}

int mokd_metrics_render(mokd_server *srv, char **out, size_t *len)
{
  const mokd_metrics *m = &srv->metrics;
  buf b = {malloc(16384), 0, 16384, 0};

  *out = NULL;
  if (b.p == NULL)
    return MOK_ENOMEM;
  srv->metrics.scrapes++;
  head(&b, "mokd_build_info", "gauge", "The daemon's version, protocol range and backend.");
  put(&b, "mokd_build_info{version=\"%s\",protocol_min=\"%d\",protocol_max=\"%d\","
      "backend=\"%s\"} 1\n", MOKD_VERSION, MOK_PROTOCOL_MIN, MOK_PROTOCOL_VERSION,
      mokk_backend_name(srv->backend));
  head(&b, "mokd_uptime_seconds", "gauge", "Seconds since the daemon started.");
  put(&b, "mokd_uptime_seconds %.3f\n", (double)(mokd_now_ns() - srv->start_ns) * 1e-9);
  by_op(&b, "mokd_requests_total", "Requests handled, by op (invalid: frames that are "
        "no request).", m->requests);
  by_op(&b, "mokd_errors_total", "Requests answered with an error, by op.", m->errors);
  histogram(&b, "mokd_queue_seconds", "Time work (steps, health probes) waited for an "
            "executor.", &m->queue);
  histogram(&b, "mokd_compute_seconds", "Time work (steps, health probes) ran on an "
            "executor (cuda: queueing its GPU work).", &m->compute);
  head(&b, "mokd_sessions", "gauge", "Sessions connected.");
  put(&b, "mokd_sessions %d\n", srv->nsessions);
  head(&b, "mokd_memory_bytes", "gauge", "Memory all sessions hold, by kind (as "
       "mokd_session_memory_bytes).");
  put(&b, "mokd_memory_bytes{kind=\"arena\"} %llu\n",
      (unsigned long long)srv->usage.arena_bytes);
  put(&b, "mokd_memory_bytes{kind=\"context\"} %llu\n",
      (unsigned long long)srv->usage.context_bytes);
  put(&b, "mokd_memory_bytes{kind=\"gpu\"} %llu\n", (unsigned long long)srv->usage.gpu_bytes);
  session_memory(&b, srv);
  tenants(&b, srv);
  head(&b, "mokd_quota_rejections_total", "counter",
       "Requests refused because a session's or a tenant's quota would be exceeded.");
  put(&b, "mokd_quota_rejections_total %llu\n", (unsigned long long)m->quota_rejections);
  head(&b, "mokd_evictions_total", "counter", "Sessions closed by mokctl evict.");
  put(&b, "mokd_evictions_total %llu\n", (unsigned long long)m->evictions);
  head(&b, "mokd_watchdog_stalls_total", "counter",
       "Watchdog periods not fed because an executor made no progress.");
  put(&b, "mokd_watchdog_stalls_total %llu\n", (unsigned long long)m->watchdog_stalls);
  head(&b, "mokd_scrapes_total", "counter", "Scrapes of this endpoint, this one included.");
  put(&b, "mokd_scrapes_total %llu\n", (unsigned long long)m->scrapes);
  if (b.oom) {
    free(b.p);
    return MOK_ENOMEM;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}
