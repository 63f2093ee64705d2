/* paths.c - the default socket path and the checks around it, shared by mokd
 * and its clients. */
#include "paths.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mok.h"

#define RUN_DIR "/run/mokd"

static void tmp_fallback(char *buf, size_t n)
{
  snprintf(buf, n, "/tmp/mokd-%u.sock", (unsigned)geteuid());
}

void mok_default_socket(char *buf, size_t n)
{
  const char *env = getenv("MOKD_SOCKET"), *xdg = getenv("XDG_RUNTIME_DIR");

  if (env != NULL && env[0] != 0)
    snprintf(buf, n, "%s", env);
  else if (geteuid() == 0)
    snprintf(buf, n, RUN_DIR "/mokd.sock");
  else if (xdg != NULL && xdg[0] != 0)
    snprintf(buf, n, "%s/mokd.sock", xdg);
  else
    tmp_fallback(buf, n);
}

int mok_socket_dir_check(const char *path, char *err, size_t errlen)
{
  const char *slash = strrchr(path, '/');
  char dir[4096];
  struct stat st;

  if (slash == NULL)
    snprintf(dir, sizeof dir, ".");
  else if (slash == path)
    snprintf(dir, sizeof dir, "/");
  else
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
  if (stat(dir, &st) != 0) {
    if (errno == ENOENT && strcmp(dir, RUN_DIR) == 0) {
      snprintf(err, errlen, "socket directory %s does not exist; the mokd unit makes it "
               "(RuntimeDirectory=mokd), else install deploy/mokd.tmpfiles.conf "
               "(systemd-tmpfiles --create) or pick another --socket", dir);
      return MOK_ENOENT;
    }
    if (errno == ENOENT) {
      snprintf(err, errlen, "socket directory %s does not exist; create it or pick another "
               "--socket", dir);
      return MOK_ENOENT;
    }
    if (errno == ENOTDIR) {
      snprintf(err, errlen, "socket directory %s: a component of it is not a directory; "
               "pick another --socket", dir);
      return MOK_EINVAL;
    }
    snprintf(err, errlen, "socket directory %s: cannot look it up: %s", dir, strerror(errno));
    return errno == EACCES ? MOK_EPERM : MOK_EIO;
  }
  if (!S_ISDIR(st.st_mode)) {
    snprintf(err, errlen, "socket directory %s is not a directory; pick another --socket", dir);
    return MOK_EINVAL;
  }
  return 0;
}

int mok_socket_is_tmp_fallback(const char *path)
{
  char fallback[64];

  tmp_fallback(fallback, sizeof fallback);
  return strcmp(path, fallback) == 0;
}

int mok_socket_peer_check(int fd, uid_t uid, const char *path, char *err, size_t errlen)
{
  struct ucred cr;
  socklen_t len = sizeof cr;

  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) {
    snprintf(err, errlen, "%s: cannot tell who serves it: %s", path, strerror(errno));
    return MOK_EIO;
  }
  if (cr.uid == uid || cr.uid == 0)
    return 0;
  snprintf(err, errlen, "%s is served by uid %u, not by uid %u or root; refusing it (start "
           "mokd yourself, or pick --socket / MOKD_SOCKET)", path, (unsigned)cr.uid,
           (unsigned)uid);
  return MOK_EPERM;
}
