/* server.c - the listening socket, peer admission, signals, the systemd
 * watchdog, the reaper of the GPUs' released memory and the drain at
 * shutdown. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "executor.h"
#include "fdpass.h"
#include "http.h"
#include "log.h"
#include "mokd.h"
#include "notify.h"
#include "paths.h"

static int gid_allowed(const mokd_server *srv, gid_t gid)
{
  for (int i = 0; i < srv->nallow_gids; i++)
    if (srv->allow_gids[i] == gid)
      return 1;
  return 0;
}

/* SO_PEERCRED carries the primary gid only; SO_PEERGROUPS the supplementary
 * groups, as they were when the peer connected (not as /proc shows them
 * now, which the peer may have changed, or another process may own). */
static int supplementary_allowed(const mokd_server *srv, int fd)
{
  gid_t some[64], *g = some;
  socklen_t len = sizeof some;
  int ok = 0;

  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, g, &len) != 0) {
    if (errno != ERANGE || (g = malloc(len)) == NULL ||
        getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, g, &len) != 0) {
      LOG_WARN(NET, "cannot read the groups of a peer (SO_PEERGROUPS): %s", strerror(errno));
      if (g != some)
        free(g);
      return 0;
    }
  }
  for (size_t i = 0; i < len / sizeof *g && !ok; i++)
    ok = gid_allowed(srv, g[i]);
  if (g != some)
    free(g);
  return ok;
}

static int peer_allowed(const mokd_server *srv, int fd, uid_t uid, gid_t gid)
{
  if (uid == 0 || uid == geteuid() || gid_allowed(srv, gid))
    return 1;
  for (int i = 0; i < srv->nallow_uids; i++)
    if (srv->allow_uids[i] == uid)
      return 1;
  return supplementary_allowed(srv, fd);
}

/* ---- refused peers --------------------------------------------------------- */

/* A refused peer is told why at once; its socket then stays open until the
 * peer has sent something (its Hello) or hung up, or a second has passed.
 * Closed at once, the peer's Hello would meet a closed socket, and it would
 * see "Broken pipe" instead of the reason. A few at a time: the rest are
 * closed at once. */
#define REFUSED_MAX 64
#define REFUSED_LINGER_NS 1000000000ull

struct mokd_refused {
  uv_poll_t poll;
  mokd_server *srv;
  int fd;
  uint64_t since;
  mokd_refused *next, *prev;
};

static void on_refused_closed(uv_handle_t *h)
{
  mokd_refused *r = h->data;
  close(r->fd);
  free(r);
}

static void refused_end(mokd_refused *r)
{
  mokd_server *srv = r->srv;
  if (r->prev != NULL)
    r->prev->next = r->next;
  else
    srv->refused = r->next;
  if (r->next != NULL)
    r->next->prev = r->prev;
  if (--srv->nrefused == 0)
    uv_timer_stop(&srv->refused_timer);
  uv_close((uv_handle_t *)&r->poll, on_refused_closed);
}

/* It spoke or hung up: take what it sent (closing any fds), so that the
 * close does not reset the connection before it reads the reason. */
static void on_refused_poll(uv_poll_t *h, int status, int events)
{
  mokd_refused *r = h->data;
  uint8_t sink[4096];
  (void)status, (void)events;
  for (int i = 0; i < 16; i++) {
    int fds[MOKW_MAX_FDS], nfds = MOKW_MAX_FDS;
    ssize_t n = mokw_recv(r->fd, sink, sizeof sink, MSG_DONTWAIT, fds, &nfds, NULL);
    for (int k = 0; k < nfds; k++)
      close(fds[k]);
    if (n <= 0)
      break;
  }
  refused_end(r);
}

static void on_refused_timer(uv_timer_t *t)
{
  mokd_server *srv = t->data;
  uint64_t now = mokd_now_ns();
  for (mokd_refused *r = srv->refused, *next; r != NULL; r = next) {
    next = r->next;
    if (now - r->since >= REFUSED_LINGER_NS)
      refused_end(r);
  }
}

static void refuse(mokd_server *srv, int fd, const char *msg)
{
  Mokd__Response resp = MOKD__RESPONSE__INIT;
  mokd_refused *r;
  uint8_t *buf;
  size_t len;

  resp.status = MOK_EPERM;
  resp.message = (char *)msg;
  if (mokw_pack(&resp.base, &buf, &len) == 0) {
    if (send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
      LOG_DEBUG(NET, "could not tell a refused peer why: %s", strerror(errno));
    free(buf);
  }
  if (srv->nrefused >= REFUSED_MAX || srv->stopped || (r = calloc(1, sizeof *r)) == NULL) {
    close(fd);
    return;
  }
  if (uv_poll_init(srv->loop, &r->poll, fd) != 0) {
    free(r);
    close(fd);
    return;
  }
  r->poll.data = r;
  r->srv = srv;
  r->fd = fd;
  r->since = mokd_now_ns();
  uv_poll_start(&r->poll, UV_READABLE | UV_DISCONNECT, on_refused_poll);
  r->next = srv->refused;
  if (srv->refused != NULL)
    srv->refused->prev = r;
  srv->refused = r;
  if (srv->nrefused++ == 0)
    uv_timer_start(&srv->refused_timer, on_refused_timer, 100, 100);
}

static void on_conn_pipe_closed(uv_handle_t *h)
{
  free(h);
}

/* A connection that could not be taken: the client sees its socket closed,
 * so the operator must see why. Once a second at most, with a count of the
 * ones not logged, so that a flood of them does not flood the log too. */
static void accept_failed(mokd_server *srv, const char *what, const char *why)
{
  uint64_t now = mokd_now_ns();

  srv->accept_failures++;
  if (srv->accept_logged_ns != 0 && now - srv->accept_logged_ns < 1000000000ull)
    return;
  LOG_WARN(NET, "cannot accept a connection: %s: %s (%llu failed since the last report; "
           "%d sessions open; raise LimitNOFILE or lower max_sessions if it is the fd "
           "limit)", what, why, (unsigned long long)srv->accept_failures, srv->nsessions);
  srv->accept_logged_ns = now;
  srv->accept_failures = 0;
}

static void on_connection(uv_stream_t *server, int status)
{
  mokd_server *srv = server->data;
  uv_pipe_t *tmp;
  uv_os_fd_t ufd;
  int fd, rc;
  struct ucred cr = {0};
  socklen_t len = sizeof cr;

  if (status < 0) {
    accept_failed(srv, "accept", uv_strerror(status));
    return;
  }
  tmp = malloc(sizeof *tmp);
  if (tmp == NULL || (rc = uv_pipe_init(srv->loop, tmp, 0)) != 0) {
    free(tmp);
    accept_failed(srv, "uv_pipe_init", tmp == NULL ? "out of memory" : uv_strerror(rc));
    return;
  }
  /* libuv accepts; the session then owns a dup of the fd and drives it with
   * recvmsg/sendmsg under a uv_poll_t, since fds ride on the frames */
  if ((rc = uv_accept(server, (uv_stream_t *)tmp)) != 0 ||
      (rc = uv_fileno((uv_handle_t *)tmp, &ufd)) != 0) {
    uv_close((uv_handle_t *)tmp, on_conn_pipe_closed);
    accept_failed(srv, "accept", uv_strerror(rc));
    return;
  }
  fd = fcntl(ufd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0)
    accept_failed(srv, "dup of the accepted socket", strerror(errno));
  uv_close((uv_handle_t *)tmp, on_conn_pipe_closed);
  if (fd < 0)
    return;
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len);
  if (!peer_allowed(srv, fd, cr.uid, cr.gid)) {
    LOG_WARN(NET, "refused pid %d uid %u gid %u: not in the allow-list", (int)cr.pid,
             (unsigned)cr.uid, (unsigned)cr.gid);
    refuse(srv, fd, "this uid/gid may not use mokd (allow_uids, allow_gids)");
    return;
  }
  if (srv->draining || srv->nsessions >= srv->cfg.max_sessions) {
    refuse(srv, fd, srv->draining ? "mokd is shutting down"
                                  : "too many sessions (max_sessions)");
    return;
  }
  if (mokd_session_new(srv, fd) == NULL) {
    accept_failed(srv, "new session", "out of memory");
    close(fd);
    return;
  }
  LOG_INFO(NET, "connection from pid %d uid %u gid %u", (int)cr.pid, (unsigned)cr.uid,
           (unsigned)cr.gid);
}

/* Another daemon answering on the path is an error; a dead socket file is
 * removed; anything else at the path is left alone and refused. */
static int clear_stale(const char *path, char *err, size_t errlen)
{
  struct stat st;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int fd, rc;

  if (lstat(path, &st) != 0)
    return errno == ENOENT ? 0 : (snprintf(err, errlen, "%s: %s", path, strerror(errno)), MOK_EIO);
  if (!S_ISSOCK(st.st_mode)) {
    snprintf(err, errlen, "%s exists and is not a socket; remove it or pick --socket", path);
    return MOK_EBUSY;
  }
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return MOK_EIO;
  rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
  close(fd);
  if (rc == 0) {
    snprintf(err, errlen, "another mokd is serving %s; stop it or pick --socket", path);
    return MOK_EBUSY;
  }
  LOG_INFO(INIT, "removing stale socket %s", path);
  unlink(path);
  return 0;
}

static void mokd_server_drain(mokd_server *srv);

static void on_signal(uv_signal_t *h, int signum)
{
  mokd_server *srv = h->data;
  if (signum == SIGHUP) {
    char err[256];
    if (mokd_config_reload_log(&srv->cfg, err, sizeof err) != 0) {
      LOG_WARN(CONF, "SIGHUP: log settings kept: %s", err);
    } else {
      mokd_log_set((int)srv->cfg.log_level, (unsigned)srv->cfg.log_subsys);
      LOG_INFO(CONF, "SIGHUP: log level now %s",
               mokd_log_level_name((int)srv->cfg.log_level));
    }
    if (mokd_config_reload_tenants(&srv->cfg, err, sizeof err) != 0) {
      LOG_WARN(CONF, "SIGHUP: tenant_weights and tenant_quota_bytes kept: %s", err);
      return;
    }
    mokd_tenants_reconfigure(srv);
    LOG_INFO(CONF, "SIGHUP: tenant_weights \"%s\", tenant_quota_bytes \"%s\"",
             srv->cfg.tenant_weights, srv->cfg.tenant_quota_bytes);
    return;
  }
  LOG_INFO(INIT, "signal %d: draining", signum);
  mokd_server_drain(srv);
}

static uint64_t exec_stuck(const mokd_executor *ex, uint64_t now, uint64_t limit)
{
  return ex != NULL ? mokd_progress_stuck(mokd_executor_progress(ex), now, limit) : 0;
}

uint64_t mokd_server_stuck(mokd_server *srv, char *why, size_t n)
{
  uint64_t now = mokd_now_ns(), limit = (uint64_t)srv->cfg.stall_timeout_ms * 1000000ull;
  uint64_t worst = exec_stuck(srv->exec, now, limit);
  int gpu = -1;

  for (int i = 0; i < srv->ngpus; i++) {
    uint64_t t = exec_stuck(srv->gpus[i].exec, now, limit);
    if (t > worst)
      worst = t, gpu = srv->gpus[i].ordinal;
  }
  if (worst != 0) {
    char which[48] = "the CPU executor";
    if (gpu >= 0)
      snprintf(which, sizeof which, "the executor of GPU %d", gpu);
    snprintf(why, n, "%s has had work for %.1f s without completing any (stall_timeout_ms "
             "%lld)", which, (double)worst * 1e-9, (long long)srv->cfg.stall_timeout_ms);
  }
  return worst;
}

/* Fed only while the executors make progress (progress.h): a daemon whose
 * loop spins while its GPU hangs is restarted by systemd. */
static void on_watchdog(uv_timer_t *t)
{
  mokd_server *srv = t->data;
  char why[MOK_ERRLEN], msg[MOK_ERRLEN + 16];
  uint64_t now = mokd_now_ns();

  if (mokd_server_stuck(srv, why, sizeof why) == 0) {
    mokd_notify("WATCHDOG=1");
    return;
  }
  srv->metrics.watchdog_stalls++;
  if (srv->stall_logged_ns == 0 || now - srv->stall_logged_ns >= 10000000000ull) {
    LOG_ERROR(EXEC, "watchdog not fed: %s", why);
    snprintf(msg, sizeof msg, "STATUS=stuck: %s", why);
    mokd_notify(msg);
    srv->stall_logged_ns = now;
  }
}

static int render_metrics(void *arg, char **out, size_t *len)
{
  return mokd_metrics_render(arg, out, len);
}

static void observe_step(void *arg, const mokd_work *w)
{
  mokd_server *srv = arg;
  mokd_histogram_observe(&srv->metrics.queue, w->t_start - w->t_queued);
  mokd_histogram_observe(&srv->metrics.compute, w->t_end - w->t_start);
}

static int start_metrics(mokd_server *srv, char *err, size_t errlen)
{
  const char *addr = srv->cfg.metrics;
  int rc;

  if (srv->exec != NULL)
    mokd_executor_observe(srv->exec, observe_step, srv);
  for (int i = 0; i < srv->ngpus; i++)
    mokd_executor_observe(srv->gpus[i].exec, observe_step, srv);
  if (addr[0] == 0)
    return 0;
  if (addr[0] == '/' && (rc = clear_stale(addr, err, errlen)) != 0)
    return rc;
  if ((rc = mokd_http_start(srv->loop, addr, render_metrics, srv, &srv->http, err, errlen)))
    return rc;
  if (addr[0] == '/')
    chmod(addr, 0660);
  LOG_INFO(NET, "metrics on %s (GET /metrics)", addr);
  return 0;
}

/* Connections that never say Hello would hold their session slots forever:
 * max_sessions of them lock everyone out. */
static void on_hello_timer(uv_timer_t *t)
{
  mokd_server *srv = t->data;
  uint64_t now = mokd_now_ns(), limit = (uint64_t)srv->cfg.hello_timeout_ms * 1000000ull;
  mokd_session *s, *next;

  for (s = srv->sessions; s != NULL; s = next) {
    next = s->next;
    if (!s->hello_done && !s->closing && now - s->born_ns >= limit) {
      char msg[128];
      LOG_INFO(SESS, SESS_FMT "no Hello within %lld ms (pid %d uid %u); closing", SESS_ARGS(s),
               (long long)srv->cfg.hello_timeout_ms, (int)s->pid, (unsigned)s->uid);
      snprintf(msg, sizeof msg, "no Hello within %lld ms (hello_timeout_ms); closing the "
               "connection", (long long)srv->cfg.hello_timeout_ms);
      mokd_session_fail(s, 0, MOK_EPROTO, msg);
    }
  }
}

static void start_hello_timer(mokd_server *srv)
{
  uint64_t period = (uint64_t)srv->cfg.hello_timeout_ms / 4;

  if (srv->cfg.hello_timeout_ms == 0)
    return;
  /* checked every quarter of the timeout, between 10 ms and 1 s */
  period = period < 10 ? 10 : period > 1000 ? 1000 : period;
  uv_timer_init(srv->loop, &srv->hello_timer);
  srv->hello_timer.data = srv;
  uv_timer_start(&srv->hello_timer, on_hello_timer, period, period);
  srv->hello_timer_on = 1;
}

/* Each arena is a mapping of the daemon's: past vm.max_map_count mmap fails
 * for everyone. Half of it goes to arenas, the rest to the daemon itself. */
static uint64_t max_maps(void)
{
  FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
  unsigned long long n = 65530; /* the kernel's default */
  if (f != NULL) {
    if (fscanf(f, "%llu", &n) != 1)
      n = 65530;
    fclose(f);
  }
  return n / 2;
}

int mokd_server_start(mokd_server *srv, char *err, size_t errlen)
{
  const char *path = srv->cfg.socket;
  mode_t old;
  struct stat st;
  int rc;

  /* the lists were checked with the rest of the configuration */
  if (mokd_config_ids(srv->cfg.allow_uids, (unsigned *)srv->allow_uids, MOKD_MAX_IDS,
                      &srv->nallow_uids, err, errlen) ||
      mokd_config_ids(srv->cfg.allow_gids, (unsigned *)srv->allow_gids, MOKD_MAX_IDS,
                      &srv->nallow_gids, err, errlen))
    return MOK_EINVAL;
  if ((rc = mok_socket_dir_check(path, err, errlen)) != 0)
    return rc;
  srv->max_maps = max_maps();
  if ((rc = clear_stale(path, err, errlen)))
    return rc;
  if ((rc = uv_pipe_init(srv->loop, &srv->listener, 0)) != 0) {
    snprintf(err, errlen, "uv_pipe_init: %s", uv_strerror(rc));
    return MOK_EIO;
  }
  srv->listener.data = srv;
  old = umask(0117); /* the socket is born 0660: no window where others may connect */
  rc = uv_pipe_bind(&srv->listener, path);
  umask(old);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&srv->listener, 128, on_connection);
  if (rc != 0) {
    snprintf(err, errlen, "cannot listen on %s: %s", path, uv_strerror(rc));
    uv_close((uv_handle_t *)&srv->listener, NULL);
    return MOK_EIO;
  }
  chmod(path, 0660);
  srv->listening = 1;
  if (srv->nallow_gids == 0 && stat(path, &st) == 0) {
    srv->allow_gids[0] = st.st_gid; /* default: the socket's group */
    srv->nallow_gids = 1;
  }
  uv_signal_init(srv->loop, &srv->sig_term);
  uv_signal_init(srv->loop, &srv->sig_int);
  uv_signal_init(srv->loop, &srv->sig_hup);
  srv->sig_term.data = srv->sig_int.data = srv->sig_hup.data = srv;
  uv_signal_start(&srv->sig_term, on_signal, SIGTERM);
  uv_signal_start(&srv->sig_int, on_signal, SIGINT);
  uv_signal_start(&srv->sig_hup, on_signal, SIGHUP);
  if ((rc = start_metrics(srv, err, errlen)) != 0) {
    uv_close((uv_handle_t *)&srv->listener, NULL);
    unlink(path);
    uv_close((uv_handle_t *)&srv->sig_term, NULL);
    uv_close((uv_handle_t *)&srv->sig_int, NULL);
    uv_close((uv_handle_t *)&srv->sig_hup, NULL);
    srv->listening = 0;
    return rc;
  }
  start_hello_timer(srv);
  uv_timer_init(srv->loop, &srv->refused_timer);
  srv->refused_timer.data = srv;
  srv->refused_timer_on = 1;
  uint64_t wd = mokd_notify_watchdog_usec();
  if (wd > 0) {
    uv_timer_init(srv->loop, &srv->watchdog);
    srv->watchdog.data = srv;
    uv_timer_start(&srv->watchdog, on_watchdog, wd / 2000, wd / 2000);
    srv->watchdog_on = 1;
  }
  LOG_INFO(NET, "listening on %s (mode 0660, group %u)", path,
           srv->nallow_gids ? (unsigned)srv->allow_gids[0] : 0u);
  return 0;
}

/* ---- released GPU memory ------------------------------------------------ */

static int reap_all(mokd_server *srv, int wait)
{
  int left = 0;
  for (int i = 0; i < srv->ngpus; i++)
    left += mokk_backend_reap(srv->gpus[i].backend, wait);
  return left;
}

static void on_reap(uv_timer_t *t)
{
  if (reap_all(t->data, 0) == 0)
    uv_timer_stop(t);
}

void mokd_server_reap(mokd_server *srv)
{
  if (reap_all(srv, 0) == 0 || srv->stopped)
    return; /* after the stop, mokd_server_reap_all frees the rest */
  if (!srv->reaper_on) {
    uv_timer_init(srv->loop, &srv->reaper);
    srv->reaper.data = srv;
    srv->reaper_on = 1;
  }
  uv_timer_start(&srv->reaper, on_reap, 1, 1);
}

void mokd_server_reap_all(mokd_server *srv)
{
  reap_all(srv, 1);
}

/* ---- shutdown ------------------------------------------------------------- */

static void mokd_server_drain(mokd_server *srv)
{
  if (srv->draining)
    return;
  srv->draining = 1;
  mokd_notify("STOPPING=1\nSTATUS=draining in-flight work");
  mokd_groups_drain(srv); /* what waits for a group's other ranks is not in flight */
  if (srv->listening) {
    uv_close((uv_handle_t *)&srv->listener, NULL);
    unlink(srv->cfg.socket);
    srv->listening = 0;
  }
  mokd_server_maybe_stop(srv);
}

static int any_busy(const mokd_server *srv)
{
  for (const mokd_session *s = srv->sessions; s != NULL; s = s->next)
    if (s->busy != NULL || s->probes > 0)
      return 1;
  return 0;
}

/* Once draining and nothing is in flight: close every session and handle. */
void mokd_server_maybe_stop(mokd_server *srv)
{
  if (!srv->draining || srv->stopped || any_busy(srv))
    return;
  srv->stopped = 1;
  for (mokd_session *s = srv->sessions; s != NULL; s = s->next)
    mokd_session_close(s, "daemon shutting down");
  uv_close((uv_handle_t *)&srv->sig_term, NULL);
  uv_close((uv_handle_t *)&srv->sig_int, NULL);
  uv_close((uv_handle_t *)&srv->sig_hup, NULL);
  if (srv->watchdog_on)
    uv_close((uv_handle_t *)&srv->watchdog, NULL);
  if (srv->hello_timer_on)
    uv_close((uv_handle_t *)&srv->hello_timer, NULL);
  while (srv->refused != NULL)
    refused_end(srv->refused);
  if (srv->refused_timer_on)
    uv_close((uv_handle_t *)&srv->refused_timer, NULL);
  if (srv->reaper_on)
    uv_close((uv_handle_t *)&srv->reaper, NULL);
  if (srv->http != NULL) {
    mokd_http_stop(srv->http);
    if (srv->cfg.metrics[0] == '/')
      unlink(srv->cfg.metrics);
    srv->http = NULL;
  }
  srv->reaper_on = 0;
  if (srv->exec != NULL)
    mokd_executor_close(srv->exec);
  for (int i = 0; i < srv->ngpus; i++)
    mokd_executor_close(srv->gpus[i].exec);
}
