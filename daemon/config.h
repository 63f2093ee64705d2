/* config.h - every mokd option, in one table (config.c). Precedence: built-in
 * defaults, then the config file (/etc/mokd/mokd.conf or --config), then
 * MOKD_* environment variables, then command-line flags. */
#ifndef MOKD_CONFIG_H
#define MOKD_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#define MOKD_VERSION "0.1.0"
#define MOKD_DEFAULT_CONFIG "/etc/mokd/mokd.conf"
#define MOKD_MAX_GPUS 16 /* devices one daemon runs on */
#define MOKD_MAX_IDS 32  /* entries of allow_uids, of allow_gids */

typedef struct mokd_config {
  char socket[108];
  char metrics[108];     /* the Prometheus listener: a socket path or 127.0.0.1:PORT */
  char backend[16];
  char devices[64];
  int64_t cpu_threads;
  int64_t executor_threads;
  int64_t max_frame_bytes;
  int64_t max_arena_bytes;
  int64_t session_quota_bytes;
  int64_t session_gpu_quota_bytes;
  int session_gpu_quota_pct; /* given as N% of a device: bytes come at start */
  int64_t max_sessions;
  int64_t hello_timeout_ms;
  int64_t group_timeout_ms;
  int64_t stall_timeout_ms;
  int64_t max_layers;
  int64_t max_arenas;
  char allow_uids[256];
  char allow_gids[256];
  char tenant_weights[1024]; /* "job:ID=W,uid:N=W": the fair queue's shares */
  char tenant_quota_bytes[1024]; /* "job:ID=SIZE,uid:N=SIZE": memory of all a tenant's sessions */
  int64_t log_level;
  int64_t log_subsys;
  char config_file[256];
  int config_read;       /* config_file existed and was read */
  uint32_t from_flags;   /* options given as flags (a bit each, in table order) */
} mokd_config;

enum {
  MOKD_CONFIG_RUN = 0,   /* start the daemon */
  MOKD_CONFIG_EXIT = 1   /* --help, --version or --print-config: done, exit 0 */
};

/* Fills cfg from all sources. Returns MOKD_CONFIG_RUN, MOKD_CONFIG_EXIT, or a
 * negative code with a message in err ("file:line: ..." for the file). */
int mokd_config_load(mokd_config *cfg, int argc, char **argv, char *err, size_t errlen);
/* The GPU quota given as a share becomes bytes of device_bytes (the smallest
 * device's memory; 0 when there is no device, which leaves it unlimited). */
void mokd_config_gpu_quota(mokd_config *cfg, uint64_t device_bytes);
/* For SIGHUP: re-read the log level and subsystems, or tenant_weights and
 * tenant_quota_bytes, from defaults, file, then env; an option given as a flag
 * keeps its value. 0, or a negative code with err ("file:line: ...") and cfg
 * as it was. */
int mokd_config_reload_log(mokd_config *cfg, char *err, size_t errlen);
int mokd_config_reload_tenants(mokd_config *cfg, char *err, size_t errlen);
void mokd_config_print(const mokd_config *cfg, FILE *out);
/* The numbers of a list (allow_uids, allow_gids, devices), separated by
 * commas or spaces: 0 and *n of them in out, or -1 with why. */
int mokd_config_ids(const char *list, unsigned *out, int max, int *n, char *why, size_t len);
/* The weight of a tenant key ("job:ID" or "uid:N") in a tenant_weights
 * list; 1 when the list does not name it. key NULL only checks the list.
 * 0, or -1 with why naming the bad entry. */
int mokd_config_weight(const char *list, const char *key, unsigned *weight, char *why,
                       size_t len);
/* The tenant_quota_bytes of a tenant key in such a list; 0 (no limit) when
 * the list does not name it. key NULL only checks the list. 0, or -1 with
 * why naming the bad entry. */
int mokd_config_tenant_quota(const char *list, const char *key, uint64_t *bytes, char *why,
                             size_t len);
void mokd_config_usage(FILE *out);

#endif
