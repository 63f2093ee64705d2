/* trace.c - what the GPU ran during a stretch of a benchmark, kernel by
 * kernel, with the idle time between them (bench_gpu --trace). Nsight
 * Compute times kernels one at a time, replayed, on a quiet GPU; this shows
 * them as the step runs them: back to back, at the clocks a long run holds,
 * and the gaps that launches, memsets and waits leave. CUPTI's activity API,
 * opened at run time so that the benchmark needs it only when asked. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cupti_activity.h>

#include "trace.h"

typedef CUptiResult (*fn_register)(CUpti_BuffersCallbackRequestFunc,
                                   CUpti_BuffersCallbackCompleteFunc);
typedef CUptiResult (*fn_kind)(CUpti_ActivityKind);
typedef CUptiResult (*fn_flush)(uint32_t);
typedef CUptiResult (*fn_next)(uint8_t *, size_t, CUpti_Activity **);
typedef CUptiResult (*fn_cbname)(CUpti_CallbackDomain, uint32_t, const char **);

static struct {
  void *lib;
  fn_register reg;
  fn_kind enable, disable;
  fn_flush flush;
  fn_next next;
  fn_cbname cbname; /* optional: names of runtime calls */
} cupti;

#define TRACE_MAX 4096
#define TRACE_BUF (4u << 20)

typedef struct span {
  uint64_t start, end;
  int api; /* a runtime call on the host, not work on the GPU */
  char what[72];
} span;

static span spans[TRACE_MAX];
static int nspans, lost;

static void CUPTIAPI buffer_request(uint8_t **buf, size_t *size, size_t *max_records)
{
  /* CUPTI wants 8-byte aligned buffers */
  *buf = (uint8_t *)aligned_alloc(8, TRACE_BUF);
  *size = *buf != NULL ? TRACE_BUF : 0;
  *max_records = 0;
}

static void add_span(uint64_t start, uint64_t end, const char *what, int api)
{
  if (nspans == TRACE_MAX) {
    lost++;
    return;
  }
  span *s = &spans[nspans++];
  s->start = start;
  s->end = end;
  s->api = api;
  snprintf(s->what, sizeof s->what, "%s", what != NULL ? what : "?");
}

static void add(uint64_t start, uint64_t end, const char *what)
{
  add_span(start, end, what, 0);
}

static void add_bytes(uint64_t start, uint64_t end, const char *op, uint64_t bytes)
{
  char what[48];
  snprintf(what, sizeof what, "%s %llu B", op, (unsigned long long)bytes);
  add(start, end, what);
}

static uint64_t host_ns = 20000; /* MOKD_TRACE_HOST_US */

static void CUPTIAPI buffer_done(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                 size_t valid)
{
  CUpti_Activity *r = NULL;
  (void)ctx, (void)stream, (void)size;
  while (cupti.next(buf, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
      add(k->start, k->end, k->name);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
      add_bytes(m->start, m->end, "memset", m->bytes);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
      add_bytes(m->start, m->end, "memcpy", m->bytes);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_RUNTIME || r->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      /* host calls of host_ns or more: what keeps the host from launching */
      const CUpti_ActivityAPI *a = (const CUpti_ActivityAPI *)r;
      const int rt = r->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
      const char *name = NULL;
      char what[72];
      if (a->end - a->start < host_ns)
        continue;
      if (cupti.cbname == NULL ||
          cupti.cbname(rt ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid,
                       &name) != CUPTI_SUCCESS)
        name = NULL;
      if (name != NULL)
        snprintf(what, sizeof what, "host %s", name);
      else
        snprintf(what, sizeof what, "host runtime call %u", (unsigned)a->cbid);
      add_span(a->start, a->end, what, 1);
    }
  }
  free(buf);
}

static const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                           CUPTI_ACTIVITY_KIND_MEMSET,
                                           CUPTI_ACTIVITY_KIND_MEMCPY,
                                           CUPTI_ACTIVITY_KIND_RUNTIME,
                                           CUPTI_ACTIVITY_KIND_DRIVER};

int trace_open(char *why, size_t n)
{
  static const char *names[] = {"libcupti.so.13", "libcupti.so",
                                "/usr/local/cuda/lib64/libcupti.so",
                                "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so"};
  for (size_t i = 0; i < sizeof names / sizeof names[0] && cupti.lib == NULL; i++)
    cupti.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (cupti.lib == NULL) {
    snprintf(why, n, "CUPTI (libcupti.so) not found: %s", dlerror());
    return -1;
  }
  cupti.reg = (fn_register)dlsym(cupti.lib, "cuptiActivityRegisterCallbacks");
  cupti.enable = (fn_kind)dlsym(cupti.lib, "cuptiActivityEnable");
  cupti.disable = (fn_kind)dlsym(cupti.lib, "cuptiActivityDisable");
  cupti.flush = (fn_flush)dlsym(cupti.lib, "cuptiActivityFlushAll");
  cupti.next = (fn_next)dlsym(cupti.lib, "cuptiActivityGetNextRecord");
  cupti.cbname = (fn_cbname)dlsym(cupti.lib, "cuptiGetCallbackName");
  const char *hu = getenv("MOKD_TRACE_HOST_US");
  if (hu != NULL)
    host_ns = (uint64_t)(atof(hu) * 1000);
  if (!cupti.reg || !cupti.enable || !cupti.disable || !cupti.flush || !cupti.next) {
    snprintf(why, n, "CUPTI lacks the activity API");
    return -1;
  }
  CUptiResult r = cupti.reg(buffer_request, buffer_done);
  if (r != CUPTI_SUCCESS) {
    snprintf(why, n, "cuptiActivityRegisterCallbacks: error %d", (int)r);
    return -1;
  }
  return 0;
}

int trace_begin(char *why, size_t n)
{
  nspans = lost = 0;
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    CUptiResult r = cupti.enable(kinds[i]);
    if (r != CUPTI_SUCCESS) {
      snprintf(why, n, "cuptiActivityEnable(%d): error %d", (int)kinds[i], (int)r);
      return -1;
    }
  }
  return 0;
}

static int by_start(const void *a, const void *b)
{
  const span *x = (const span *)a, *y = (const span *)b;
  return x->start < y->start ? -1 : x->start > y->start;
}

/* Kernels go by their mangled names, which tell a template's instances
 * apart, cut to 60 characters. */
void trace_cut(FILE *out, const char *label)
{
  cupti.flush(1); /* forced: the records so far, complete */
  if (label == NULL) {
    nspans = lost = 0;
    return;
  }
  qsort(spans, (size_t)nspans, sizeof *spans, by_start);
  uint64_t busy = 0, idle = 0, t0 = 0, last;
  for (int i = 0; i < nspans; i++) /* the GPU's first record */
    if (!spans[i].api) {
      t0 = spans[i].start;
      break;
    }
  last = t0;
  fprintf(out, "trace %s: %d records%s\n", label, nspans, lost ? " (some lost)" : "");
  fprintf(out, "trace %s: %10s %10s %10s  %s\n", label, "start_us", "us", "gap_us", "what");
  for (int i = 0; i < nspans; i++) {
    const span *s = &spans[i];
    if (s->api) { /* the host's: shown, not counted */
      fprintf(out, "trace %s: %10.1f %10.1f %10s  %.60s\n", label,
              ((double)s->start - (double)t0) / 1e3, (double)(s->end - s->start) / 1e3, "-",
              s->what);
      continue;
    }
    double gap = s->start > last ? (double)(s->start - last) / 1e3 : 0;
    fprintf(out, "trace %s: %10.1f %10.1f %10.1f  %.60s\n", label,
            (double)(s->start - t0) / 1e3, (double)(s->end - s->start) / 1e3, gap, s->what);
    busy += s->end - s->start;
    if (s->start > last)
      idle += s->start - last;
    if (s->end > last)
      last = s->end;
  }
  fprintf(out, "trace %s: span %.1f us, busy %.1f us (summed), idle between %.1f us\n", label,
          (double)(last - t0) / 1e3, (double)busy / 1e3, (double)idle / 1e3);
  nspans = lost = 0;
}

void trace_stop(void)
{
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
    cupti.disable(kinds[i]);
  cupti.flush(1);
  nspans = lost = 0;
}
