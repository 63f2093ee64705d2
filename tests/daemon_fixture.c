/* daemon_fixture.c - see daemon_fixture.h. */
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_fixture.h"
#include "frame.h"

char dir[64], sock[96], logpath[96];
pid_t daemon_pid;

const char *mokd_bin(void)
{
  const char *b = getenv("MOKD_BIN");
  return b != NULL ? b : "build/mokd";
}

pid_t spawn_daemon(const char *path, const char *extra, const char *log)
{
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    char *argv[32] = {"mokd", "--socket", (char *)path, "--config", "/dev/null",
                      "--cpu-threads", "2", "--log-level", "debug"};
    char *flags = strdup(extra), *save;
    int argc = 9;
    for (char *f = strtok_r(flags, " ", &save); f != NULL && argc < 31;
         f = strtok_r(NULL, " ", &save))
      argv[argc++] = f;
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execv(mokd_bin(), argv);
    _exit(127);
  }
  return pid;
}

void own_daemon_start(own_daemon *d, const char *name, const char *extra)
{
  snprintf(d->path, sizeof d->path, "%s/%s.sock", dir, name);
  snprintf(d->log, sizeof d->log, "%s/%s.log", dir, name);
  d->pid = spawn_daemon(d->path, extra, d->log);
  wait_for_socket(d->path, d->pid);
  snprintf(d->saved, sizeof d->saved, "%s", sock);
  snprintf(sock, sizeof sock, "%s", d->path);
}

void own_daemon_stop(own_daemon *d)
{
  snprintf(sock, sizeof sock, "%s", d->saved);
  int st = stop_daemon(d->pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "mokd on %s exited with status %d",
                d->path, st);
  unlink(d->log);
}

void wait_for_socket(const char *path, pid_t pid)
{
  for (int i = 0; i < 400; i++) {
    mok_client *c;
    int st;
    if (mok_connect(path, "probe", &c) == 0) {
      mok_close(c);
      return;
    }
    mok_close(c);
    ck_assert_msg(waitpid(pid, &st, WNOHANG) == 0, "mokd exited early");
    usleep(10000);
  }
  ck_abort_msg("mokd did not come up on %s", path);
}

int stop_daemon(pid_t pid)
{
  int st;
  kill(pid, SIGTERM);
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  return st;
}

void setup(void)
{
  strcpy(dir, "/tmp/mokd-it-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(sock, sizeof sock, "%s/mokd.sock", dir);
  snprintf(logpath, sizeof logpath, "%s/mokd.log", dir);
  daemon_pid = spawn_daemon(sock, "--executor-threads=2", logpath);
  wait_for_socket(sock, daemon_pid);
}

void teardown(void)
{
  int st = stop_daemon(daemon_pid);
  /* exit 0 means uv_loop_close() returned 0: every handle was closed */
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "mokd exited with status %d", st);
  unlink(sock);
  unlink(logpath);
  rmdir(dir);
}

mok_client *connect_ok(void)
{
  mok_client *c;
  int rc = mok_connect(sock, "check_daemon", &c);
  ck_assert_msg(rc == 0, "connect: %s", mok_last_error(c));
  return c;
}

void plain_setup(void)
{
  strcpy(dir, "/tmp/mokd-it-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(sock, sizeof sock, "%s/mokd.sock", dir);
  snprintf(logpath, sizeof logpath, "%s/mokd.log", dir);
}

void plain_teardown(void)
{
  rmdir(dir);
}

/* ---- raw frames ------------------------------------------------------------ */

int raw_connect(void)
{
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  strcpy(sa.sun_path, sock);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  return fd;
}

void raw_send_fds(int fd, const void *buf, size_t len, const int *fds, int nfds)
{
  struct iovec iov = {(void *)buf, len};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(32 * sizeof(int))];
  } cm;
  ck_assert_int_le(nfds, 32);
  if (nfds > 0) {
    memset(&cm, 0, sizeof cm);
    mh.msg_control = cm.b;
    mh.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
    struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
    h->cmsg_level = SOL_SOCKET, h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
    memcpy(CMSG_DATA(h), fds, (size_t)nfds * sizeof(int));
  }
  ck_assert_int_eq(sendmsg(fd, &mh, MSG_NOSIGNAL), (ssize_t)len);
}

void raw_send(int fd, const void *buf, size_t len, int pass_fd)
{
  raw_send_fds(fd, buf, len, &pass_fd, pass_fd >= 0);
}

void raw_request(int fd, Mokd__Request *req, int pass_fd)
{
  uint8_t *buf;
  size_t len;
  ck_assert_int_eq(mokw_pack(&req->base, &buf, &len), 0);
  raw_send(fd, buf, len, pass_fd);
  free(buf);
}

/* Reads one reply; NULL when the daemon closed the connection instead. */
Mokd__Response *raw_reply(int fd)
{
  mokw_framer f;
  mokw_framer_init(&f, 1 << 20);
  for (;;) {
    const uint8_t *p;
    size_t len, avail;
    if (mokw_framer_next(&f, &p, &len, NULL) == 1) {
      Mokd__Response *r = mokd__response__unpack(NULL, len, p);
      mokw_framer_free(&f);
      return r;
    }
    struct pollfd pf = {fd, POLLIN, 0};
    ck_assert_msg(poll(&pf, 1, 10000) == 1, "no reply within 10 s");
    uint8_t *dst = mokw_framer_space(&f, 4096, &avail);
    ssize_t n = recv(fd, dst, avail, 0);
    if (n <= 0) {
      mokw_framer_free(&f);
      return NULL;
    }
    mokw_framer_commit(&f, (size_t)n);
  }
}

void hello(int fd)
{
  Mokd__Request req = MOKD__REQUEST__INIT;
  Mokd__Hello h = MOKD__HELLO__INIT;
  h.protocol_version = MOK_PROTOCOL_VERSION;
  req.id = 1, req.body_case = MOKD__REQUEST__BODY_HELLO, req.hello = &h;
  raw_request(fd, &req, -1);
  Mokd__Response *r = raw_reply(fd);
  ck_assert(r != NULL && r->status == 0 && r->body_case == MOKD__RESPONSE__BODY_WELCOME);
  mokd__response__free_unpacked(r, NULL);
}

void expect_status(int fd, int code, const char *needle)
{
  Mokd__Response *r = raw_reply(fd);
  ck_assert_msg(r != NULL, "connection closed instead of an error reply");
  ck_assert_msg(r->status == code, "status %d (%s), want %d; message: %s", r->status,
                mok_err_name(r->status), code, r->message);
  ck_assert_msg(strstr(r->message, needle) != NULL, "message \"%s\" lacks \"%s\"", r->message,
                needle);
  mokd__response__free_unpacked(r, NULL);
}

void still_serving(void)
{
  mok_client *c = connect_ok();
  uint64_t rtt;
  ck_assert_int_eq(mok_ping(c, &rtt), 0);
  mok_close(c);
}
