/* main.c - mokd: configuration, backend, loop, and a clean exit. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "devices.h"
#include "executor.h"
#include "log.h"
#include "mokd.h"
#include "notify.h"

static mokd_server srv;

static void destroy_backends(mokd_server *s)
{
  for (int i = 0; i < s->ngpus; i++)
    mokk_backend_destroy(s->gpus[i].backend);
  if (s->ngpus == 0)
    mokk_backend_destroy(s->backend);
  s->ngpus = 0;
  s->backend = NULL;
}

/* The GPUs an EP group's ranks may be spread over: all of them, or, where
 * two cannot reach each other, none (each group then stays on one GPU). */
static void link_gpus(mokd_server *s)
{
  mokk_backend *b[MOKD_MAX_GPUS];
  char err[MOK_ERRLEN];

  s->gpus_linked = 0;
  if (s->ngpus < 2)
    return;
  for (int i = 0; i < s->ngpus; i++)
    b[i] = s->gpus[i].backend;
  if (mokk_gpu_link(b, s->ngpus, err) != 0) {
    LOG_WARN(INIT, "EP groups stay on one GPU each: %s", err);
    return;
  }
  s->gpus_linked = 1;
  LOG_INFO(INIT, "%d GPUs linked: an EP group's ranks may be on different GPUs", s->ngpus);
}

/* One backend per GPU named in --devices (every visible one when empty). */
static int open_gpus(mokd_server *s, int visible, char *err)
{
  unsigned ords[MOKD_MAX_GPUS];
  int n = 0, rc;
  if (s->cfg.devices[0] == 0) {
    for (int i = 0; i < visible && i < MOKD_MAX_GPUS; i++)
      ords[n++] = (unsigned)i;
  } else {
    /* the list was checked with the rest of the configuration */
    if (mokd_config_ids(s->cfg.devices, ords, MOKD_MAX_GPUS, &n, err, MOK_ERRLEN) != 0)
      return MOK_EINVAL;
    for (int i = 0; i < n; i++)
      if (ords[i] >= (unsigned)visible)
        return mokk_fail(err, MOK_EDEVICE, "devices: CUDA device %u does not exist (%d "
                         "visible)", ords[i], visible);
  }
  for (int i = 0; i < n; i++) {
    if ((rc = mokk_gpu_open((int)ords[i], &s->gpus[i].backend, err)) != 0) {
      destroy_backends(s);
      return rc;
    }
    s->gpus[i].ordinal = (int)ords[i];
    s->ngpus = i + 1;
    if ((rc = mokk_gpu_uuid((int)ords[i], s->gpus[i].uuid, err)) != 0) {
      destroy_backends(s);
      return rc;
    }
    char uuid[MOKW_UUID_STRLEN];
    mokw_uuid_format(s->gpus[i].uuid, uuid);
    LOG_INFO(INIT, "CUDA device %u is %s", ords[i], uuid);
  }
  s->backend = s->gpus[0].backend;
  link_gpus(s);
  /* a GPU quota given as a share is of the smallest device */
  uint64_t least = 0;
  for (int i = 0; i < s->ngpus; i++) {
    uint64_t m = mokk_backend_mem_total(s->gpus[i].backend);
    if (i == 0 || m < least)
      least = m;
  }
  mokd_config_gpu_quota(&s->cfg, least);
  if (s->cfg.session_gpu_quota_pct > 0)
    LOG_INFO(INIT, "session_gpu_quota_bytes: %d%% of %llu = %lld bytes per session",
             s->cfg.session_gpu_quota_pct, (unsigned long long)least,
             (long long)s->cfg.session_gpu_quota_bytes);
  return 0;
}

static int open_backend(mokd_server *s, char *err)
{
  const char *gpu = mokk_gpu_backend();

  if (gpu != NULL) {
    int want = strcmp(s->cfg.backend, gpu) == 0;
    if (want || strcmp(s->cfg.backend, "auto") == 0) {
      char why[MOK_ERRLEN] = "none is visible";
      int n = mokk_gpu_count(why);
      if (n > 0)
        return open_gpus(s, n, err);
      if (want)
        return mokk_fail(err, MOK_EDEVICE, "no usable CUDA device: %s", why);
      LOG_INFO(INIT, "backend auto: no usable CUDA device (%s); using cpu", why);
    }
  }
  /* the CPU backend always exists */
  return mokk_cpu_create((int)s->cfg.cpu_threads, &s->backend, err);
}

/* Every session holds fds (its socket, the fds of its frames and imports,
 * the exports it is sent): the soft limit goes up to the hard one, which
 * the administrator set (systemd's default soft limit is 1024). */
static void raise_fd_limit(void)
{
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max)
    return;
  rlim_t was = rl.rlim_cur;
  rl.rlim_cur = rl.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
    LOG_DEBUG(INIT, "open files: soft limit %llu -> %llu", (unsigned long long)was,
              (unsigned long long)rl.rlim_max);
}

int main(int argc, char **argv)
{
  char err[MOK_ERRLEN] = "", status[320];
  uv_loop_t loop;
  int rc;

  rc = mokd_config_load(&srv.cfg, argc, argv, err, sizeof err);
  if (rc == MOKD_CONFIG_EXIT)
    return 0;
  if (rc < 0) {
    fprintf(stderr, "mokd: %s\n", err);
    return 2;
  }
  mokd_log_set((int)srv.cfg.log_level, (unsigned)srv.cfg.log_subsys);
  signal(SIGPIPE, SIG_IGN);
  raise_fd_limit();

  if ((rc = open_backend(&srv, err)) != 0) {
    LOG_ERROR(INIT, "backend %s: %s", srv.cfg.backend, err);
    return 1;
  }
  if (uv_loop_init(&loop) != 0) {
    LOG_ERROR(INIT, "cannot create the event loop");
    destroy_backends(&srv);
    return 1;
  }
  srv.loop = &loop;
  srv.start_ns = mokd_now_ns();
  /* one executor thread per GPU: it owns the device's stream */
  if (srv.ngpus > 0)
    srv.cfg.executor_threads = 1;
  for (int i = 0; i < (srv.ngpus > 0 ? srv.ngpus : 1) && rc == 0; i++)
    rc = mokd_executor_create(&loop, (int)srv.cfg.executor_threads,
                              srv.ngpus > 0 ? &srv.gpus[i].exec : &srv.exec);
  if (rc != 0) {
    LOG_ERROR(INIT, "executor: %s", mok_strerror(rc));
    if (srv.exec != NULL)
      mokd_executor_close(srv.exec);
    for (int i = 0; i < srv.ngpus; i++)
      if (srv.gpus[i].exec != NULL)
        mokd_executor_close(srv.gpus[i].exec);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    destroy_backends(&srv);
    return 1;
  }
  if ((rc = mokd_server_start(&srv, err, sizeof err)) != 0) {
    LOG_ERROR(INIT, "%s", err);
    if (srv.exec != NULL)
      mokd_executor_close(srv.exec);
    for (int i = 0; i < srv.ngpus; i++)
      mokd_executor_close(srv.gpus[i].exec);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    destroy_backends(&srv);
    return 1;
  }
  if (srv.ngpus > 0) {
    char list[96] = "";
    for (int i = 0; i < srv.ngpus; i++)
      snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? "," : "",
               srv.gpus[i].ordinal);
    snprintf(status, sizeof status, "READY=1\nSTATUS=serving on %s, backend %s (device%s %s)",
             srv.cfg.socket, mokk_backend_name(srv.backend), srv.ngpus > 1 ? "s" : "", list);
  }
  else
    snprintf(status, sizeof status, "READY=1\nSTATUS=serving on %s, backend %s (%d threads)",
             srv.cfg.socket, mokk_backend_name(srv.backend), mokk_cpu_threads(srv.backend));
  mokd_notify(status);
  LOG_INFO(INIT, "mokd %s ready: %s, %lld executor threads", MOKD_VERSION, status + 15,
           (long long)srv.cfg.executor_threads);

  uv_run(&loop, UV_RUN_DEFAULT);

  mokd_server_reap_all(&srv);
  rc = uv_loop_close(&loop);
  destroy_backends(&srv);
  mokd_tenants_free(&srv.tenants);
  if (rc != 0) {
    LOG_ERROR(INIT, "event loop closed with handles still open (%s)", uv_err_name(rc));
    return 1;
  }
  LOG_INFO(INIT, "stopped cleanly: %llu requests served",
           (unsigned long long)srv.usage.requests);
  return 0;
}
