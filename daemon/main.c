/* main.c - mokd: configuration, backend, loop, and a clean exit. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "executor.h"
#include "log.h"
#include "mokd.h"
#include "notify.h"

static mokd_server srv;

static int open_backend(mokd_server *s, char *err)
{
#ifdef MOKD_HAVE_CUDA
  int want = strcmp(s->cfg.backend, "cuda") == 0;
  if (want || strcmp(s->cfg.backend, "auto") == 0) {
    char why[MOK_ERRLEN] = "none is visible";
    int n = mokk_cuda_devices(why), dev = atoi(s->cfg.devices), rc;
    if (n > 0) {
      if ((rc = mokk_cuda_create(dev, &s->backend, err)) == 0)
        s->cuda_device = dev + 1;
      return rc;
    }
    if (want)
      return mokk_fail(err, MOK_EDEVICE, "no usable CUDA device: %s", why);
    LOG_INFO(INIT, "backend auto: no usable CUDA device (%s); using cpu", why);
  }
#endif
  /* the CPU backend always exists */
  return mokk_cpu_create((int)s->cfg.cpu_threads, &s->backend, err);
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

  if ((rc = open_backend(&srv, err)) != 0) {
    LOG_ERROR(INIT, "backend %s: %s", srv.cfg.backend, err);
    return 1;
  }
  if (uv_loop_init(&loop) != 0) {
    LOG_ERROR(INIT, "cannot create the event loop");
    mokk_backend_destroy(srv.backend);
    return 1;
  }
  srv.loop = &loop;
  srv.start_ns = mokd_now_ns();
  /* one executor thread per GPU: it owns the device's stream */
  if (srv.cuda_device > 0)
    srv.cfg.executor_threads = 1;
  if ((rc = mokd_executor_create(&loop, (int)srv.cfg.executor_threads, mokd_session_job_done,
                                 &srv.exec)) != 0) {
    LOG_ERROR(INIT, "executor: %s", mok_strerror(rc));
    uv_loop_close(&loop);
    mokk_backend_destroy(srv.backend);
    return 1;
  }
  if ((rc = mokd_server_start(&srv, err, sizeof err)) != 0) {
    LOG_ERROR(INIT, "%s", err);
    mokd_executor_close(srv.exec);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    mokk_backend_destroy(srv.backend);
    return 1;
  }
  if (srv.cuda_device > 0)
    snprintf(status, sizeof status, "READY=1\nSTATUS=serving on %s, backend cuda (device %d)",
             srv.cfg.socket, srv.cuda_device - 1);
  else
    snprintf(status, sizeof status, "READY=1\nSTATUS=serving on %s, backend %s (%d threads)",
             srv.cfg.socket, mokk_backend_name(srv.backend), mokk_cpu_threads(srv.backend));
  mokd_notify(status);
  LOG_INFO(INIT, "mokd %s ready: %s, %lld executor threads", MOKD_VERSION, status + 15,
           (long long)srv.cfg.executor_threads);

  uv_run(&loop, UV_RUN_DEFAULT);

  mokd_retired_drain(&srv);
  rc = uv_loop_close(&loop);
  mokk_backend_destroy(srv.backend);
  if (rc != 0) {
    LOG_ERROR(INIT, "event loop closed with handles still open (%s)", uv_err_name(rc));
    return 1;
  }
  LOG_INFO(INIT, "stopped cleanly: %llu requests served",
           (unsigned long long)srv.usage.requests);
  return 0;
}
