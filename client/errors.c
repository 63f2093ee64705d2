/* errors.c - names and messages for the codes of mok_errno.h. */
#include "mok_errno.h"

const char *mok_strerror(int err)
{
  switch (err) {
  case 0:
    return "success";
#define MOK_STRERROR_(name, val, msg)                                          \
  case val:                                                                    \
    return msg;
    MOK_ERRNO_MAP(MOK_STRERROR_)
#undef MOK_STRERROR_
  }
  return "unknown error";
}

const char *mok_err_name(int err)
{
  switch (err) {
  case 0:
    return "OK";
#define MOK_ERR_NAME_(name, val, msg)                                          \
  case val:                                                                    \
    return "MOK_" #name;
    MOK_ERRNO_MAP(MOK_ERR_NAME_)
#undef MOK_ERR_NAME_
  }
  return "MOK_EUNKNOWN";
}
