/* fdpass.c - see fdpass.h. */
#include "fdpass.h"

#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

typedef union {
  struct cmsghdr h;
  char buf[CMSG_SPACE(sizeof(int) * MOKW_MAX_FDS)];
} fd_control;

ssize_t mokw_send(int sock, const void *buf, size_t len, const int *fds, int nfds, int flags)
{
  struct iovec iov = {(void *)buf, len};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  fd_control cm;

  if (nfds > MOKW_MAX_FDS)
    nfds = MOKW_MAX_FDS;
  if (nfds > 0) {
    memset(&cm, 0, sizeof cm);
    mh.msg_control = cm.buf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
  }
  return sendmsg(sock, &mh, flags);
}

ssize_t mokw_recv(int sock, void *buf, size_t len, int flags, int *fds, int *nfds, int *ctrunc)
{
  struct iovec iov = {buf, len};
  fd_control cm;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf,
                      .msg_controllen = sizeof cm.buf};
  int room = *nfds;
  ssize_t n = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC);

  *nfds = 0;
  if (ctrunc != NULL)
    *ctrunc = 0;
  if (n < 0)
    return n;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
      continue;
    int nf = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    const unsigned char *data = CMSG_DATA(c);
    for (int i = 0; i < nf; i++) {
      int fd;
      memcpy(&fd, data + (size_t)i * sizeof fd, sizeof fd);
      if (*nfds < room)
        fds[(*nfds)++] = fd;
      else
        close(fd);
    }
  }
  if (ctrunc != NULL && (mh.msg_flags & MSG_CTRUNC))
    *ctrunc = 1;
  return n;
}
