/* progress.c - see progress.h. */
#include "progress.h"

void mokd_progress_queued(mokd_progress *p, uint64_t now_ns)
{
  if (p->outstanding++ == 0)
    p->since_ns = now_ns;
}

void mokd_progress_done(mokd_progress *p, uint64_t now_ns)
{
  if (p->outstanding > 0)
    p->outstanding--;
  p->completed++;
  p->since_ns = now_ns;
}

uint64_t mokd_progress_stuck(const mokd_progress *p, uint64_t now_ns, uint64_t limit_ns)
{
  uint64_t idle;
  if (p->outstanding == 0 || now_ns < p->since_ns)
    return 0;
  idle = now_ns - p->since_ns;
  return idle >= limit_ns && idle > 0 ? idle : 0;
}
