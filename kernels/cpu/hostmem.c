/* hostmem.c - host memory that a client maps too: memfds the daemon makes
 * (sealed, so that neither side can shrink them under the other) and memfds a
 * client hands over, which must carry F_SEAL_SHRINK for the same reason. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend_impl.h"

static int wrap(void *base, size_t bytes, mokk_buffer **out, char *err)
{
  mokk_buffer *buf = calloc(1, sizeof *buf);
  if (buf == NULL) {
    munmap(base, bytes);
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  *buf = (mokk_buffer){base, bytes, -1};
  *out = buf;
  return 0;
}

int mokk_host_alloc(size_t bytes, mokk_buffer **out, int *fd, char *err)
{
  void *base;
  int f, rc;

  *out = NULL;
  *fd = -1;
  f = memfd_create("mokd-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (f < 0 || ftruncate(f, (off_t)bytes) != 0 ||
      fcntl(f, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    rc = mokk_fail(err, MOK_ENOMEM, "cannot create a %zu-byte arena: %s", bytes,
                   strerror(errno));
    goto fail;
  }
  base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  if (base == MAP_FAILED) {
    rc = mokk_fail(err, MOK_ENOMEM, "cannot map a %zu-byte arena: %s", bytes,
                   strerror(errno));
    goto fail;
  }
  if ((rc = wrap(base, bytes, out, err)) != 0)
    goto fail;
  *fd = f;
  return 0;

fail:
  if (f >= 0)
    close(f);
  return rc;
}

int mokk_host_import(int fd, size_t bytes, mokk_buffer **out, char *err)
{
  struct stat st;
  int seals;
  void *base;

  *out = NULL;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    return mokk_fail(err, MOK_EINVAL, "the fd sent with ImportBuffer is not a memfd or "
                     "regular file");
  /* a client that could shrink the file under us would fault the daemon; and
   * its size is worth reading only once it can no longer shrink: checked
   * before the seal, a client could shrink it, then seal it */
  seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK))
    return mokk_fail(err, MOK_EINVAL, "imported buffers must be memfds sealed with "
                     "F_SEAL_SHRINK (memfd_create with MFD_ALLOW_SEALING, then F_ADD_SEALS)");
  if (fstat(fd, &st) != 0)
    return mokk_fail(err, MOK_EINVAL, "cannot read the size of the imported fd: %s",
                     strerror(errno));
  if ((uint64_t)st.st_size < bytes)
    return mokk_fail(err, MOK_ERANGE, "the fd holds %lld bytes, fewer than the %zu named",
                     (long long)st.st_size, bytes);
  base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    return mokk_fail(err, MOK_EINVAL, "cannot map the imported fd: %s", strerror(errno));
  return wrap(base, bytes, out, err);
}

void mokk_host_free(mokk_buffer *buf)
{
  munmap(buf->base, buf->bytes);
  free(buf);
}
