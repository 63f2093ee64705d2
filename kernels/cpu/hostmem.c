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

/* fd is a memfd that cannot shrink and holds at least bytes. */
static int check_memfd(int fd, size_t bytes, char *err)
{
  struct stat st;
  int seals;

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
  return 0;
}

int mokk_host_import(int fd, size_t bytes, mokk_buffer **out, char *err)
{
  void *base;
  int rc;

  *out = NULL;
  if ((rc = check_memfd(fd, bytes, err)) != 0)
    return rc;
  base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    return mokk_fail(err, MOK_EINVAL, "cannot map the imported fd: %s", strerror(errno));
  return wrap(base, bytes, out, err);
}

int mokk_host_reserve(size_t bytes, mokk_buffer **out, char *err)
{
  void *base = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

  *out = NULL;
  if (base == MAP_FAILED)
    return mokk_fail(err, MOK_ENOMEM, "cannot reserve %zu bytes of address space: %s", bytes,
                     strerror(errno));
  return wrap(base, bytes, out, err);
}

int mokk_host_import_chunk(mokk_buffer *buf, int fd, size_t offset, size_t bytes, char *err)
{
  long page = sysconf(_SC_PAGESIZE);
  int rc;

  if (offset % (size_t)page != 0)
    return mokk_fail(err, MOK_EINVAL, "a chunk begins %zu bytes into the import, not at a "
                     "page boundary (%ld bytes): every chunk but the last must be a multiple "
                     "of it", offset, page);
  if (offset > buf->bytes || bytes > buf->bytes - offset)
    return mokk_fail(err, MOK_ERANGE, "a chunk of %zu bytes at %zu runs past the %zu-byte "
                     "import", bytes, offset, buf->bytes);
  if ((rc = check_memfd(fd, bytes, err)) != 0)
    return rc;
  if (mmap((char *)buf->base + offset, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
           fd, 0) == MAP_FAILED)
    return mokk_fail(err, MOK_EINVAL, "cannot map a chunk of the import: %s", strerror(errno));
  return 0;
}

void mokk_host_free(mokk_buffer *buf)
{
  munmap(buf->base, buf->bytes);
  free(buf);
}
