/* paths.c - the default socket path, shared by mokd and its clients. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "mok.h"

void mok_default_socket(char *buf, size_t n)
{
  const char *env = getenv("MOKD_SOCKET"), *xdg = getenv("XDG_RUNTIME_DIR");

  if (env != NULL && env[0] != 0)
    snprintf(buf, n, "%s", env);
  else if (geteuid() == 0)
    snprintf(buf, n, "/run/mokd/mokd.sock");
  else if (xdg != NULL && xdg[0] != 0)
    snprintf(buf, n, "%s/mokd.sock", xdg);
  else
    snprintf(buf, n, "/tmp/mokd-%u.sock", (unsigned)geteuid());
}
