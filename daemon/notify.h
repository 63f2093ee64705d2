/* notify.h - systemd's sd_notify protocol (READY, STATUS, STOPPING, WATCHDOG);
 * all calls are no-ops when the daemon is not run by systemd. */
#ifndef MOKD_NOTIFY_H
#define MOKD_NOTIFY_H

#include <stdint.h>

void mokd_notify(const char *state);
/* WATCHDOG_USEC for this process, or 0 when the watchdog is off. */
uint64_t mokd_notify_watchdog_usec(void);

#endif
