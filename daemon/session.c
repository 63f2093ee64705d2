/* session.c - what a session is to the daemon: Hello places it on a GPU (the
 * one it asks for, else the least used) or on the CPU backend, and says what
 * the daemon offers; Stats and Ping answer from the counters. Device numbers
 * are CUDA ordinals inside (-1 = host) and ordinal + 1 on the wire, where
 * clients name GPUs by UUID: their ordinals follow their own
 * CUDA_VISIBLE_DEVICES, not ours. */
#include <stdio.h>
#include <string.h>

#include "log.h"
#include "mokd.h"

/* The GPU a client names by UUID: its ordinals are its own, not ours. */
static mokd_gpu *gpu_by_uuid(mokd_server *srv, const uint8_t *uuid)
{
  uint8_t have[MOKD_MAX_GPUS][MOKW_UUID_BYTES];
  int i;
  for (i = 0; i < srv->ngpus; i++)
    memcpy(have[i], srv->gpus[i].uuid, MOKW_UUID_BYTES);
  i = mokw_uuid_find((const uint8_t(*)[MOKW_UUID_BYTES])have, srv->ngpus, uuid);
  return i >= 0 ? &srv->gpus[i] : NULL;
}

/* One GPU in list_gpus: ", GPU-... (device 15)". */
#define GPU_ITEM_LEN (MOKW_UUID_STRLEN + 20)
/* The list in an error message: two GPUs and "and N more" (the message,
 * UUID asked for included, holds MOK_ERRLEN bytes). */
#define GPU_LIST_LEN (2 * GPU_ITEM_LEN + 16)

/* "GPU-... (device 0), ..." for messages; what does not fit in n bytes is
 * counted: "and N more". */
static void list_gpus(const mokd_server *srv, char *list, size_t n)
{
  char u[MOKW_UUID_STRLEN];
  size_t at = 0;
  list[0] = 0;
  for (int i = 0; i < srv->ngpus && at < n; i++) {
    if (i > 0 && n - at < GPU_ITEM_LEN + 16) {
      snprintf(list + at, n - at, " and %d more", srv->ngpus - i);
      return;
    }
    mokw_uuid_format(srv->gpus[i].uuid, u);
    at += (size_t)snprintf(list + at, n - at, "%s%s (device %d)", i ? ", " : "", u,
                           srv->gpus[i].ordinal);
  }
}

/* device: our ordinal, -1 = any; uuid: NULL, or the GPU the client names. */
static int place(mokd_session *s, int device, const uint8_t *uuid, char *err)
{
  mokd_server *srv = s->srv;
  mokd_gpu *g = NULL;
  char u[MOKW_UUID_STRLEN], list[GPU_LIST_LEN];

  if (uuid != NULL)
    mokw_uuid_format(uuid, u);
  if (srv->ngpus == 0) {
    if (uuid != NULL)
      return mokk_fail(err, MOK_EDEVICE, "this daemon runs the %s backend; it has no GPU %s",
                       mokk_backend_name(srv->backend), u);
    if (device >= 0)
      return mokk_fail(err, MOK_EDEVICE, "this daemon runs the %s backend; it has no CUDA "
                       "device %d", mokk_backend_name(srv->backend), device);
    return 0;
  }
  if (uuid != NULL) {
    if ((g = gpu_by_uuid(srv, uuid)) == NULL) {
      list_gpus(srv, list, sizeof list);
      return mokk_fail(err, MOK_EDEVICE, "GPU %s is not one this daemon runs (it runs %s); "
                       "connect to the daemon of that GPU", u, list);
    }
  } else {
    for (int i = 0; i < srv->ngpus; i++)
      if (device >= 0 ? srv->gpus[i].ordinal == device
                      : g == NULL || srv->gpus[i].sessions < g->sessions)
        g = &srv->gpus[i];
  }
  if (g == NULL) {
    char ords[128] = "";
    for (int i = 0; i < srv->ngpus; i++)
      snprintf(ords + strlen(ords), sizeof ords - strlen(ords), "%s%d", i ? "," : "",
               srv->gpus[i].ordinal);
    return mokk_fail(err, MOK_EDEVICE, "CUDA device %d is not one of this daemon's (%s)",
                     device, ords);
  }
  s->gpu = g;
  g->sessions++;
  s->backend = g->backend;
  s->exec = g->exec;
  s->device = g->ordinal;
  mokd_registry_place(&s->reg, g->backend);
  return 0;
}

/* The newest version both speak: the client's range (protocol_version alone
 * from a client of protocol 1) against the daemon's. */
static int choose_protocol(const Mokd__Hello *h, uint32_t *out, char *err)
{
  uint32_t lo = h->min_protocol ? h->min_protocol : h->protocol_version;
  uint32_t hi = h->max_protocol ? h->max_protocol : h->protocol_version;

  if (lo == 0 || lo > hi)
    return mokk_fail(err, MOK_EPROTO, "Hello offers no protocol version (min %u, max %u, "
                     "protocol_version %u)", h->min_protocol, h->max_protocol,
                     h->protocol_version);
  if (hi < MOK_PROTOCOL_MIN || lo > MOK_PROTOCOL_VERSION)
    return mokk_fail(err, MOK_EPROTO, "client speaks protocol %u to %u; this daemon (mokd %s) "
                     "speaks %d to %d: upgrade the %s", lo, hi, MOKD_VERSION, MOK_PROTOCOL_MIN,
                     MOK_PROTOCOL_VERSION, hi < MOK_PROTOCOL_MIN ? "client" : "daemon");
  *out = hi < MOK_PROTOCOL_VERSION ? hi : MOK_PROTOCOL_VERSION;
  return 0;
}

/* A job id goes into logs, metrics labels and mokctl's table as it is:
 * what a scheduler uses (SLURM_JOB_ID 1234, 1234_7, k8s names) and no more. */
static int check_job(const char *job, char *err)
{
  size_t n = strlen(job);
  if (n > MOKD_JOB_MAX)
    return mokk_fail(err, MOK_EINVAL, "job_id is %zu bytes; at most %d (MOKD_JOB_ID, "
                     "SLURM_JOB_ID)", n, MOKD_JOB_MAX);
  for (size_t i = 0; i < n; i++) {
    char c = job[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          strchr("._:@+-", c) != NULL))
      return mokk_fail(err, MOK_EINVAL, "job_id has byte 0x%02x at %zu; a job id is letters, "
                       "digits and ._:@+- (MOKD_JOB_ID, SLURM_JOB_ID)", (unsigned char)c, i);
  }
  return 0;
}

/* A tenant's weight and tenant_quota_bytes in cfg. The lists were checked
 * when they were read (start-up, SIGHUP), so a key always finds its values. */
static void tenant_settings(const mokd_config *cfg, const char *key, unsigned *weight,
                            uint64_t *quota)
{
  char why[160];

  if (mokd_config_weight(cfg->tenant_weights, key, weight, why, sizeof why) != 0)
    *weight = 1;
  if (mokd_config_tenant_quota(cfg->tenant_quota_bytes, key, quota, why, sizeof why) != 0)
    *quota = 0;
}

/* The tenant: the job when the client names one (its sessions share a share
 * of the executors and one tenant_quota_bytes, whoever runs them), else the
 * uid. */
static int set_tenant(mokd_session *s, char *err)
{
  unsigned weight;
  uint64_t quota;

  if (s->job[0] != 0)
    snprintf(s->tenant, sizeof s->tenant, "job:%s", s->job);
  else
    snprintf(s->tenant, sizeof s->tenant, "uid:%u", (unsigned)s->uid);
  tenant_settings(&s->srv->cfg, s->tenant, &weight, &quota);
  if ((s->t = mokd_tenant_get(&s->srv->tenants, s->tenant, weight, quota)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  s->reg.tenant = s->t;
  return 0;
}

void mokd_tenants_reconfigure(mokd_server *srv)
{
  for (mokd_tenant *t = srv->tenants; t != NULL; t = t->next) {
    unsigned weight;
    uint64_t quota;

    tenant_settings(&srv->cfg, t->key, &weight, &quota);
    if (weight == t->weight && quota == t->quota)
      continue;
    LOG_INFO(CONF, "SIGHUP: tenant %s: weight %u, quota %llu bytes (0: none); it holds %llu",
             t->key, weight, (unsigned long long)quota, (unsigned long long)t->held);
    t->weight = weight;
    t->quota = quota;
  }
}

int mokd_h_hello(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds, char *err)
{
  const Mokd__Hello *h = q->hello;
  mokd_server *srv = s->srv;
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Welcome w = MOKD__WELCOME__INIT;
  Mokd__Limits lim = MOKD__LIMITS__INIT;
  Mokd__Device dev[MOKD_MAX_GPUS], *devp[MOKD_MAX_GPUS];
  const uint8_t *uuid = NULL;
  int rc;

  (void)fds, (void)nfds;
  if (s->hello_done)
    return mokk_fail(err, MOK_EPROTO, "this session has said Hello already");
  if ((rc = choose_protocol(h, &s->proto, err)) != 0 ||
      (h->job_id != NULL && (rc = check_job(h->job_id, err)) != 0))
    return rc;
  if (h->device_uuid.len != 0) {
    if (h->device_uuid.len != MOKW_UUID_BYTES)
      return mokk_fail(err, MOK_EINVAL, "Hello's device_uuid holds %zu bytes; a GPU UUID has "
                       "%d", h->device_uuid.len, MOKW_UUID_BYTES);
    if (h->device != 0)
      return mokk_fail(err, MOK_EINVAL, "Hello names its GPU twice (device %d and "
                       "device_uuid); send one", h->device - 1);
    uuid = h->device_uuid.data;
  }
  if ((rc = place(s, h->device - 1, uuid, err))) /* the wire: ordinal + 1, 0 = any */
    return rc;
  mokd_log_escape(h->client_name != NULL ? h->client_name : "", 63, s->name);
  snprintf(s->job, sizeof s->job, "%s", h->job_id != NULL ? h->job_id : "");
  if ((rc = set_tenant(s, err)) != 0)
    return rc;
  s->hello_done = 1;
  LOG_INFO(SESS, SESS_FMT "hello from \"%s\" (pid %d uid %u gid %u, protocol %u, tenant %s "
           "weight %u)", SESS_ARGS(s), s->name, (int)s->pid, (unsigned)s->uid, (unsigned)s->gid,
           s->proto, s->tenant, s->t->weight);
  lim.max_frame_bytes = (uint32_t)srv->cfg.max_frame_bytes;
  lim.max_arena_bytes = (uint64_t)srv->cfg.max_arena_bytes;
  lim.session_quota_bytes = (uint64_t)srv->cfg.session_quota_bytes;
  lim.session_gpu_quota_bytes = (uint64_t)srv->cfg.session_gpu_quota_bytes;
  lim.max_layers = (uint32_t)srv->cfg.max_layers;
  w.protocol_version = s->proto;
  w.daemon_version = (char *)MOKD_VERSION;
  w.backend = (char *)mokk_backend_name(srv->backend);
  w.limits = &lim;
  w.session_id = s->id;
  for (int i = 0; i < srv->ngpus; i++) {
    mokd__device__init(&dev[i]);
    dev[i].index = (uint32_t)srv->gpus[i].ordinal;
    dev[i].name = (char *)mokk_backend_name(srv->gpus[i].backend);
    dev[i].uuid.data = srv->gpus[i].uuid;
    dev[i].uuid.len = MOKW_UUID_BYTES;
    devp[i] = &dev[i];
  }
  w.n_devices = (size_t)srv->ngpus;
  w.devices = devp;
  w.session_device = s->device + 1;
  if (s->gpu != NULL) {
    w.session_device_uuid.data = s->gpu->uuid;
    w.session_device_uuid.len = MOKW_UUID_BYTES;
  }
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_WELCOME;
  r.welcome = &w;
  mokd_send(s, &r, NULL, 0);
  return 0;
}

static void fill_usage(Mokd__Usage *u, const mok_usage *m)
{
  u->sessions = m->sessions, u->arenas = m->arenas, u->arena_bytes = m->arena_bytes;
  u->layers = m->layers, u->contexts = m->contexts, u->context_bytes = m->context_bytes;
  u->results = m->results, u->requests = m->requests, u->forwards = m->forwards;
  u->backwards = m->backwards, u->errors = m->errors, u->gpu_bytes = m->gpu_bytes;
}

int mokd_h_stats(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds, char *err)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__StatsReply st = MOKD__STATS_REPLY__INIT;
  Mokd__Usage d = MOKD__USAGE__INIT, m = MOKD__USAGE__INIT;

  (void)fds, (void)nfds, (void)err;
  fill_usage(&d, &s->srv->usage);
  fill_usage(&m, &s->usage);
  st.daemon = &d;
  st.session = &m;
  st.uptime_ns = mokd_now_ns() - s->srv->start_ns;
  st.backend = (char *)mokk_backend_name(s->backend);
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_STATS;
  r.stats = &st;
  mokd_send(s, &r, NULL, 0);
  return 0;
}

int mokd_h_ping(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds, char *err)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Pong p = MOKD__PONG__INIT;

  (void)fds, (void)nfds, (void)err;
  p.nonce = q->ping->nonce;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_PONG;
  r.pong = &p;
  mokd_send(s, &r, NULL, 0);
  return 0;
}
