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
  /* auto picks the best backend in this build; the CPU one always exists */
  return mokk_cpu_create((int)s->cfg.cpu_threads, &s->backend, err);
}

int main(int argc, char **argv)
{
  char err[MOK_ERRLEN] = "", status[160];
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
  snprintf(status, sizeof status, "READY=1\nSTATUS=serving on %s, backend %s (%d threads)",
           srv.cfg.socket, mokk_backend_name(srv.backend), mokk_cpu_threads(srv.backend));
  mokd_notify(status);
  LOG_INFO(INIT, "mokd %s ready: backend %s, %d CPU threads, %lld executor threads",
           MOKD_VERSION, mokk_backend_name(srv.backend), mokk_cpu_threads(srv.backend),
           (long long)srv.cfg.executor_threads);

  uv_run(&loop, UV_RUN_DEFAULT);

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
