/* fdpass.h - bytes on a Unix stream socket with file descriptors riding on
 * them as SCM_RIGHTS ancillary data: the one sendmsg/recvmsg pair that libmok
 * and the daemon both use. */
#ifndef MOKW_FDPASS_H
#define MOKW_FDPASS_H

#include <stddef.h>
#include <sys/types.h>

/* Most fds one send carries, and one receive takes. */
#define MOKW_MAX_FDS 8

/* sendmsg of buf[0, len) with nfds (<= MOKW_MAX_FDS) fds on its first byte;
 * the fds stay the caller's. Returns what sendmsg returns (errno set). */
ssize_t mokw_send(int sock, const void *buf, size_t len, const int *fds, int nfds, int flags);

/* recvmsg into buf[0, len). The fds that came with it go to fds[0, *nfds)
 * (close-on-exec); *nfds holds the room on entry, and fds beyond it are
 * closed. *ctrunc (may be NULL) is set when the peer sent more than
 * MOKW_MAX_FDS on one message and the kernel dropped some. Returns what
 * recvmsg returns (errno set). */
ssize_t mokw_recv(int sock, void *buf, size_t len, int flags, int *fds, int *nfds, int *ctrunc);

#endif
