/* notify.c - see notify.h; a thin layer over libsystemd. */
#include "notify.h"

#include <systemd/sd-daemon.h>

#include "log.h"

void mokd_notify(const char *state)
{
  int rc = sd_notify(0, state);
  if (rc < 0)
    LOG_DEBUG(INIT, "sd_notify(\"%s\") failed: %d", state, rc);
}

uint64_t mokd_notify_watchdog_usec(void)
{
  uint64_t usec = 0;
  return sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
}
