/* trace.h - the GPU's timeline over a stretch of a benchmark (trace.c). */
#ifndef MOKD_BENCH_TRACE_H
#define MOKD_BENCH_TRACE_H

#include <stddef.h>
#include <stdio.h>

/* Opens CUPTI and registers its buffers: 0, or -1 with why filled. */
int trace_open(char *why, size_t n);
/* Starts recording kernels, memsets and copies: 0, or -1 with why. */
int trace_begin(char *why, size_t n);
/* Prints the records since trace_begin or the last cut (start, duration,
 * idle time before each) and the totals, every line prefixed "trace
 * LABEL:", and forgets them; label NULL: forgets them only. Call once the
 * stretch's work has finished (a device synchronize). */
void trace_cut(FILE *out, const char *label);
/* Stops recording. */
void trace_stop(void);

#endif
