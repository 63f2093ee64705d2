/* progress.h - whether an executor is making progress, for the systemd
 * watchdog and `mokctl health`. An executor is stuck when it has work queued
 * or running and has completed none of it for limit_ns: since its last
 * completion, or since work arrived while it was idle. An idle executor is
 * never stuck, and a busy one that keeps completing work never is either. The
 * loop thread owns it: work is counted when queued and when its completion
 * comes back to the loop, so a worker that finished but whose completion
 * never reached the loop counts as stuck too. */
#ifndef MOKD_PROGRESS_H
#define MOKD_PROGRESS_H

#include <stdint.h>

typedef struct mokd_progress {
  uint64_t outstanding; /* queued or running */
  uint64_t completed;
  uint64_t since_ns;    /* last completion, or when idle work arrived */
} mokd_progress;

void mokd_progress_queued(mokd_progress *p, uint64_t now_ns);
void mokd_progress_done(mokd_progress *p, uint64_t now_ns);
/* 0, or how long (ns) the executor has gone without completing its work
 * when that is at least limit_ns. */
uint64_t mokd_progress_stuck(const mokd_progress *p, uint64_t now_ns, uint64_t limit_ns);

#endif
