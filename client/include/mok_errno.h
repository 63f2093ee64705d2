/* mok_errno.h - the one error table of mokd: daemon, engines and libmok all
 * return these negative codes. Where an errno value says it, the code is that
 * errno negated; codes specific to MoE layers live above 4000. */
#ifndef MOK_ERRNO_H
#define MOK_ERRNO_H

#include <errno.h>

#define MOK_ERRNO_MAP(XX)                                                      \
  XX(EINVAL, -EINVAL, "invalid argument")                                      \
  XX(ENOMEM, -ENOMEM, "out of memory")                                         \
  XX(EOVERFLOW, -EOVERFLOW, "size overflows the supported range")              \
  XX(ERANGE, -ERANGE, "offset or length outside the buffer")                   \
  XX(EPROTO, -EPROTO, "protocol error")                                        \
  XX(EMSGSIZE, -EMSGSIZE, "frame larger than the configured maximum")          \
  XX(ENOENT, -ENOENT, "no such object")                                        \
  XX(EPERM, -EPERM, "operation not permitted")                                 \
  XX(EBUSY, -EBUSY, "resource busy")                                           \
  XX(ENOTSUP, -ENOTSUP, "not supported by this backend")                       \
  XX(ESHUTDOWN, -ESHUTDOWN, "daemon is shutting down")                         \
  XX(ECONNRESET, -ECONNRESET, "connection closed by the daemon")               \
  XX(EIO, -EIO, "I/O error")                                                   \
  XX(EDQUOT, -EDQUOT, "session quota exceeded")                                \
  XX(EEXIST, -EEXIST, "already exists")                                        \
  XX(ETIMEDOUT, -ETIMEDOUT, "timed out")                                       \
  XX(ENULL, -4001, "required pointer is NULL")                                 \
  XX(EZEROSIZE, -4002, "size must be at least 1")                              \
  XX(EEXPERT, -4003, "expert id out of range")                                 \
  XX(EEPSIZE, -4004, "experts do not divide evenly over EP ranks")             \
  XX(ESHAPE, -4005, "mismatched or unsupported shape")                         \
  XX(EDTYPE, -4006, "wrong dtype")                                             \
  XX(EDEVICE, -4007, "GPU error")                                              \
  XX(ECONTEXT, -4008, "unknown, released or used-up forward context")         \
  XX(EGROUP, -4009, "EP group torn down or its ranks disagree")

typedef enum {
#define MOK_ERRNO_ENUM_(name, val, msg) MOK_##name = (val),
  MOK_ERRNO_MAP(MOK_ERRNO_ENUM_)
#undef MOK_ERRNO_ENUM_
  MOK_OK = 0
} mok_errno_t;

/* Length of the error buffers that low-level calls fill in (redis style). */
#define MOK_ERRLEN 256

const char *mok_strerror(int err);
const char *mok_err_name(int err);

#endif
