/* mokctl_opts.h - mokctl's command line: every flag is checked here, before
 * anything connects or allocates, so that a bad value gets a message naming
 * the flag (and the parser is testable without a daemon). */
#ifndef MOKCTL_OPTS_H
#define MOKCTL_OPTS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "mok.h"

typedef enum {
  MOKCTL_NONE, MOKCTL_PING, MOKCTL_STATUS, MOKCTL_STATS, MOKCTL_BENCH,
  MOKCTL_HEALTH, MOKCTL_SESSIONS, MOKCTL_EVICT
} mokctl_cmd;

#define MOKCTL_TIMEOUT_MAX 3600

#define MOKCTL_ITERS_MAX 1000000
#define MOKCTL_EP_MAX 256

typedef struct mokctl_opts {
  const char *socket;  /* NULL: mok_default_socket() */
  mokctl_cmd cmd;
  int help;            /* --help: print mokctl_usage(cmd) and stop */
  mok_layer_desc layer; /* bench */
  int64_t T;
  int iters;
  int ep;              /* bench --ep: ranks of the EP group, 1 = none */
  mok_layer_tuning tune; /* bench --tuning */
  int timeout_s;       /* health: no answer in this long is not ready; evict: wait this
                        * long for the sessions to be gone */
  const char *job;     /* evict --job */
  uint64_t session;    /* evict --session */
} mokctl_opts;

/* 0 and *o filled (defaults for what argv leaves out), or MOK_EINVAL and a
 * message in err naming the flag or argument at fault. */
int mokctl_parse(int argc, char **argv, mokctl_opts *o, char *err, size_t errlen);
/* The help of one command, or of all with MOKCTL_NONE. */
void mokctl_usage(FILE *out, mokctl_cmd cmd);

#endif
