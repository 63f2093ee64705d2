/* paths.h - checks around the socket path, shared by mokd and libmok (the
 * default path itself is public: mok_default_socket in mok.h). Each returns
 * 0 or a negative mok code with a message in err for the caller to report. */
#ifndef MOK_PATHS_H
#define MOK_PATHS_H

#include <stddef.h>
#include <sys/types.h>

/* Whether the directory that is to hold the socket `path` exists. Before a
 * bind: libuv reports a missing directory as "permission denied". MOK_ENOENT
 * when it does not exist (for /run/mokd, with what creates it), MOK_EINVAL
 * when it is not a directory, MOK_EPERM when it cannot be looked up. */
int mok_socket_dir_check(const char *path, char *err, size_t errlen);

/* Whether path is libmok's last-resort default, /tmp/mokd-EUID.sock: a name
 * in a world-writable directory that anyone may have bound first. */
int mok_socket_is_tmp_fallback(const char *path);

/* After connecting to such a path: 0 when the process that listens on the
 * connected socket fd runs as `uid` or as root, else MOK_EPERM (MOK_EIO when
 * SO_PEERCRED fails). `path` is only named in the message. */
int mok_socket_peer_check(int fd, uid_t uid, const char *path, char *err, size_t errlen);

#endif
