/* config.c - the option table and its four sources. A bad value anywhere
 * stops start-up with a message naming where it came from. */
#include "config.h"

#include <errno.h>
#include <ini.h>
#include <limits.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "devices.h"
#include "log.h"
#include "mok.h"

/* T_RAM: a size, or N% of this machine's physical memory. T_GPU: a size, or
 * N% of the smallest device's memory, kept in session_gpu_quota_pct until the
 * devices are open (mokd_config_gpu_quota). */
typedef enum { T_STR, T_INT, T_SIZE, T_RAM, T_GPU, T_LEVEL, T_SUBSYS } opt_type;

typedef struct opt {
  const char *name; /* in the file; the flag is --name with '-' for '_' */
  opt_type type;
  size_t off, size; /* size of the char array for T_STR */
  const char *def;
  int64_t min, max;
  const char *env;
  const char *help;
  /* T_STR: checks the value wherever it comes from, so that a file's error
   * names its line; 0, or -1 with why */
  int (*check)(const char *val, char *why, size_t n);
} opt;

#define STR(f) T_STR, offsetof(mokd_config, f), sizeof(((mokd_config *)0)->f)
#define NUM(t, f) t, offsetof(mokd_config, f), 0

static int check_backend(const char *val, char *why, size_t n)
{
  const char *gpu = mokk_gpu_backend();
  if (strcmp(val, "cpu") == 0 || strcmp(val, "auto") == 0 ||
      (gpu != NULL && strcmp(val, gpu) == 0))
    return 0;
  if (gpu != NULL)
    snprintf(why, n, "\"%s\" is unknown; use %s, cpu or auto", val, gpu);
  else
    snprintf(why, n, "\"%s\" is not available in this build; use cpu or auto", val);
  return -1;
}

static int check_devices(const char *val, char *why, size_t n)
{
  unsigned ord[MOKD_MAX_GPUS];
  int count;
  char what[160];
  if (mokd_config_ids(val, ord, MOKD_MAX_GPUS, &count, what, sizeof what) != 0) {
    snprintf(why, n, "%s; devices are CUDA ordinals, such as 0 or 0,1", what);
    return -1;
  }
  for (int i = 0; i < count; i++)
    for (int j = 0; j < i; j++)
      if (ord[i] == ord[j]) {
        snprintf(why, n, "device %u is named twice", ord[i]);
        return -1;
      }
  return 0;
}

static int check_ids(const char *val, char *why, size_t n)
{
  unsigned ids[MOKD_MAX_IDS];
  int count;
  return mokd_config_ids(val, ids, MOKD_MAX_IDS, &count, why, n);
}

/* the metrics listener: off, an absolute socket path, or a loopback port */
static int check_metrics(const char *val, char *why, size_t n)
{
  const char *colon = strrchr(val, ':');
  char *end;
  long port;

  if (val[0] == 0 || val[0] == '/')
    return 0;
  if (colon != NULL && colon - val == 9 &&
      (strncmp(val, "127.0.0.1", 9) == 0 || strncmp(val, "localhost", 9) == 0)) {
    port = strtol(colon + 1, &end, 10);
    if (*end == 0 && end != colon + 1 && port > 0 && port < 65536)
      return 0;
  }
  snprintf(why, n, "\"%s\" is neither an absolute Unix socket path nor 127.0.0.1:PORT or "
           "localhost:PORT (the metrics are unauthenticated: loopback only)", val);
  return -1;
}

static int check_tenant_quotas(const char *val, char *why, size_t n)
{
  uint64_t q;
  return mokd_config_tenant_quota(val, NULL, &q, why, n);
}

static int check_weights(const char *val, char *why, size_t n)
{
  unsigned w;
  return mokd_config_weight(val, NULL, &w, why, n);
}

static const opt options[] = {
    {"socket", STR(socket), "", 0, 0, "MOKD_SOCKET",
     "Unix socket path (default /run/mokd/mokd.sock as root, else "
     "$XDG_RUNTIME_DIR/mokd.sock)", NULL},
    {"metrics", STR(metrics), "", 0, 0, "MOKD_METRICS",
     "Prometheus metrics listener (GET /metrics): an absolute Unix socket path, or "
     "127.0.0.1:PORT / localhost:PORT; empty = off", check_metrics},
    {"backend", STR(backend), "auto", 0, 0, "MOKD_BACKEND",
     "compute backend: cuda, cpu, or auto (cuda when this build has it and a GPU is "
     "visible, else cpu)", check_backend},
    {"devices", STR(devices), "", 0, 0, "MOKD_DEVICES",
     "CUDA devices to run on, a comma-separated list of ordinals (one executor thread "
     "and stream each; a session runs on one of them); empty = every visible device",
     check_devices},
    {"cpu_threads", NUM(T_INT, cpu_threads), "0", 0, 1024, "MOKD_CPU_THREADS",
     "CPU backend worker threads; 0 = one per online CPU", NULL},
    {"executor_threads", NUM(T_INT, executor_threads), "2", 1, 64, "MOKD_EXECUTOR_THREADS",
     "requests computed at once (sessions served in parallel)", NULL},
    {"max_frame_bytes", NUM(T_SIZE, max_frame_bytes), "1M", 4096, 64 << 20,
     "MOKD_MAX_FRAME_BYTES", "largest accepted wire frame", NULL},
    {"max_arena_bytes", NUM(T_SIZE, max_arena_bytes), "64G", 4096, INT64_MAX / 2,
     "MOKD_MAX_ARENA_BYTES", "largest single arena a client may create or import", NULL},
    {"session_quota_bytes", NUM(T_RAM, session_quota_bytes), "50%", 0, INT64_MAX / 2,
     "MOKD_SESSION_QUOTA_BYTES",
     "host memory a session may hold in arenas (imported memfds included), outputs and "
     "contexts: a size, or N% of this machine's RAM; 0 = unlimited", NULL},
    {"session_gpu_quota_bytes", NUM(T_GPU, session_gpu_quota_bytes), "90%", 0, INT64_MAX / 2,
     "MOKD_SESSION_GPU_QUOTA_BYTES",
     "GPU memory a session may hold in daemon-made arenas, outputs and contexts (the "
     "memory a client imports is its own and not counted): a size, or N% of the "
     "smallest device's memory; 0 = unlimited", NULL},
    {"max_sessions", NUM(T_INT, max_sessions), "256", 1, 65536, "MOKD_MAX_SESSIONS",
     "clients connected at once", NULL},
    {"hello_timeout_ms", NUM(T_INT, hello_timeout_ms), "10000", 0, 3600000,
     "MOKD_HELLO_TIMEOUT_MS",
     "a connection that has not said Hello after this long is told so and closed, "
     "freeing its session slot; 0 = wait forever", NULL},
    {"group_timeout_ms", NUM(T_INT, group_timeout_ms), "60000", 1, 86400000,
     "MOKD_GROUP_TIMEOUT_MS",
     "how long the ranks of an EP group wait for the last one: to form the group, and "
     "from the first request of a step to the last; then the waiting ranks get "
     "MOK_ETIMEDOUT and the group is torn down", NULL},
    {"stall_timeout_ms", NUM(T_INT, stall_timeout_ms), "60000", 1000, 86400000,
     "MOKD_STALL_TIMEOUT_MS",
     "an executor with work queued that completes none of it for this long is stuck: "
     "the systemd watchdog is no longer fed and mokctl health says not ready", NULL},
    {"max_layers", NUM(T_INT, max_layers), "1024", 1, 1 << 20, "MOKD_MAX_LAYERS",
     "layers per session", NULL},
    {"max_arenas", NUM(T_INT, max_arenas), "4096", 1, 1 << 20, "MOKD_MAX_ARENAS",
     "arenas per session, created, imported and of outputs together (each is a mapping "
     "in the daemon, and each chunk of an import made of several allocations one more: "
     "a 7.5 GB weight of PyTorch's expandable_segments is 375; all sessions together stay "
     "under half of vm.max_map_count)", NULL},
    {"allow_uids", STR(allow_uids), "", 0, 0, "MOKD_ALLOW_UIDS",
     "comma list of uids allowed to connect, besides root and the daemon's own uid",
     check_ids},
    {"allow_gids", STR(allow_gids), "", 0, 0, "MOKD_ALLOW_GIDS",
     "comma list of gids allowed to connect; empty = the socket's group", check_ids},
    {"tenant_weights", STR(tenant_weights), "", 0, 0, "MOKD_TENANT_WEIGHTS",
     "shares of the executors' time when tenants compete: comma list of job:ID=W (the "
     "job id a client sends, MOKD_JOB_ID or SLURM_JOB_ID) and uid:N=W (a client without "
     "one), W from 1 to 1000; a tenant not named weighs 1. Each step costs the same, "
     "whatever its size: weight 3 against 1 gets 3 steps for 1",
     check_weights},
    {"tenant_quota_bytes", STR(tenant_quota_bytes), "", 0, 0, "MOKD_TENANT_QUOTA_BYTES",
     "memory all sessions of a tenant hold together: comma list of job:ID=SIZE and "
     "uid:N=SIZE (tenants as in tenant_weights). A session's host and GPU bytes, as "
     "session_quota_bytes and session_gpu_quota_bytes charge them, count together; a "
     "tenant not named is not bounded by it (the session quotas still apply)",
     check_tenant_quotas},
    {"log_level", NUM(T_LEVEL, log_level), "info", 0, 4, "MOKD_DEBUG",
     "error, warn, info, debug or trace", NULL},
    {"log_subsys", NUM(T_SUBSYS, log_subsys), "all", 0, MOKD_SUB_ALL, "MOKD_DEBUG_SUBSYS",
     "comma list of init,net,sess,exec,conf,all; ^list turns them off", NULL},
};
#define NOPTS (sizeof options / sizeof options[0])
_Static_assert(NOPTS <= 32, "mokd_config.from_flags has a bit per option");

/* o's bit in a set of options (mokd_config.from_flags, what a reload reads) */
static uint32_t bit(const opt *o)
{
  return 1u << (o - options);
}

static const opt *find(const char *name)
{
  for (size_t i = 0; i < NOPTS; i++)
    if (strcmp(options[i].name, name) == 0)
      return &options[i];
  return NULL;
}

static int parse_size(const char *s, int64_t *out)
{
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  int64_t mul = 1;
  if (end == s || errno != 0 || v < 0)
    return -1;
  switch (*end) {
  case 0: break;
  case 'k': case 'K': mul = 1 << 10, end++; break;
  case 'm': case 'M': mul = 1 << 20, end++; break;
  case 'g': case 'G': mul = 1 << 30, end++; break;
  case 't': case 'T': mul = (int64_t)1 << 40, end++; break;
  default: return -1;
  }
  if ((*end == 'b' || *end == 'B') && mul > 1)
    end++;
  if (*end != 0 || __builtin_mul_overflow((int64_t)v, mul, out))
    return -1;
  return 0;
}

/* pct% of the physical memory, or -1 */
static int64_t ram_share(int64_t pct)
{
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0)
    return -1;
  return (int64_t)((__int128)pages * page * pct / 100);
}

/* "N%" with N in [1, 100] -> N; anything else -> -1. */
static int share_pct(const char *val)
{
  size_t len = strlen(val);
  char *end;
  errno = 0;
  long long pct = strtoll(val, &end, 10);
  if (end == val || end != val + len - 1 || *end != '%' || errno != 0 || pct < 1 || pct > 100)
    return -1;
  return (int)pct;
}

void mokd_config_gpu_quota(mokd_config *cfg, uint64_t device_bytes)
{
  if (cfg->session_gpu_quota_pct > 0)
    cfg->session_gpu_quota_bytes =
        (int64_t)((unsigned __int128)device_bytes * (unsigned)cfg->session_gpu_quota_pct / 100);
}

/* Sets one option from text; on error writes why into why. */
static int set_opt(mokd_config *cfg, const opt *o, const char *val, char *why, size_t n)
{
  char *base = (char *)cfg + o->off;
  int64_t v;

  switch (o->type) {
  case T_STR: {
    char what[200];
    if (strlen(val) >= o->size) {
      snprintf(why, n, "%s: value is %zu characters; at most %zu", o->name, strlen(val),
               o->size - 1);
      return -1;
    }
    if (o->check != NULL && o->check(val, what, sizeof what) != 0) {
      snprintf(why, n, "%s: %s", o->name, what);
      return -1;
    }
    strcpy(base, val);
    return 0;
  }
  case T_INT: {
    char *end;
    errno = 0;
    long long x = strtoll(val, &end, 10);
    if (end == val || *end != 0 || errno != 0) {
      snprintf(why, n, "%s: \"%s\" is not an integer", o->name, val);
      return -1;
    }
    v = x;
    break;
  }
  case T_GPU:
    cfg->session_gpu_quota_pct = 0;
    if (strchr(val, '%') != NULL) {
      int pct = share_pct(val);
      if (pct < 0) {
        snprintf(why, n, "%s: \"%s\" is not a share of the device from 1%% to 100%%",
                 o->name, val);
        return -1;
      }
      cfg->session_gpu_quota_pct = pct;
      v = 0; /* bytes once the devices are open */
      break;
    }
    if (parse_size(val, &v) != 0) {
      snprintf(why, n, "%s: \"%s\" is not a size (a number, optionally K, M, G or T) or "
               "a share N%%", o->name, val);
      return -1;
    }
    break;
  case T_RAM:
  case T_SIZE:
    if (o->type == T_RAM && strchr(val, '%') != NULL) {
      int pct = share_pct(val);
      if (pct < 0) {
        snprintf(why, n, "%s: \"%s\" is not a share of RAM from 1%% to 100%%", o->name, val);
        return -1;
      }
      if ((v = ram_share(pct)) < 0) {
        snprintf(why, n, "%s: \"%s\": the size of this machine's RAM is unknown; give "
                 "bytes", o->name, val);
        return -1;
      }
      break;
    }
    if (parse_size(val, &v) != 0) {
      snprintf(why, n, "%s: \"%s\" is not a size (a number, optionally K, M, G or T)",
               o->name, val);
      return -1;
    }
    break;
  case T_LEVEL:
    if ((v = mokd_log_parse_level(val)) < 0) {
      snprintf(why, n, "%s: \"%s\" is not one of error, warn, info, debug, trace", o->name,
               val);
      return -1;
    }
    break;
  case T_SUBSYS:
    if ((v = mokd_log_parse_subsys(val)) < 0) {
      snprintf(why, n, "%s: \"%s\" is not a list of init,net,sess,exec,conf,all", o->name,
               val);
      return -1;
    }
    break;
  default:
    return -1;
  }
  if (v < o->min || v > o->max) {
    snprintf(why, n, "%s: %lld is outside [%lld, %lld]", o->name, (long long)v,
             (long long)o->min, (long long)o->max);
    return -1;
  }
  memcpy(base, &v, sizeof v);
  return 0;
}

typedef struct file_ctx {
  mokd_config *cfg;
  uint32_t only; /* the options to set (bits); 0 = all */
  char why[256];
} file_ctx;

static int on_ini(void *user, const char *section, const char *name, const char *value)
{
  file_ctx *fc = user;
  const opt *o;

  if (fc->why[0] != 0)
    return 1; /* report the first error only */
  if (section[0] == 0) {
    snprintf(fc->why, sizeof fc->why, "\"%s\" comes before the [mokd] section header; "
             "options go in [mokd]", name);
    return 0;
  }
  if (strcmp(section, "mokd") != 0) {
    snprintf(fc->why, sizeof fc->why, "unknown section [%s]; options go in [mokd]",
             section);
    return 0;
  }
  if ((o = find(name)) == NULL) {
    snprintf(fc->why, sizeof fc->why, "unknown option \"%s\" (mokd --help lists them)",
             name);
    return 0;
  }
  if (fc->only != 0 && (fc->only & bit(o)) == 0)
    return 1;
  return set_opt(fc->cfg, o, value, fc->why, sizeof fc->why) == 0;
}

static int load_file(mokd_config *cfg, const char *path, int required, uint32_t only,
                     char *err, size_t errlen)
{
  file_ctx fc = {cfg, only, {0}};
  int rc;

  if (!required && access(path, F_OK) != 0)
    return 0;
  cfg->config_read = 1;
  rc = ini_parse(path, on_ini, &fc);
  if (rc == -1) {
    snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    return MOK_ENOENT;
  }
  if (rc == -2) {
    snprintf(err, errlen, "%s: out of memory while reading", path);
    return MOK_ENOMEM;
  }
  if (rc > 0) {
    snprintf(err, errlen, "%s:%d: %s", path, rc, fc.why[0] ? fc.why : "syntax error");
    return MOK_EINVAL;
  }
  return 0;
}

static int load_env(mokd_config *cfg, uint32_t only, char *err, size_t errlen)
{
  for (size_t i = 0; i < NOPTS; i++) {
    const opt *o = &options[i];
    const char *v = getenv(o->env);
    char why[256];
    if (v == NULL || (only != 0 && (only & bit(o)) == 0))
      continue;
    if (set_opt(cfg, o, v, why, sizeof why) != 0) {
      snprintf(err, errlen, "environment %s: %s", o->env, why);
      return MOK_EINVAL;
    }
  }
  return 0;
}

static void defaults(mokd_config *cfg)
{
  char why[256];
  memset(cfg, 0, sizeof *cfg);
  for (size_t i = 0; i < NOPTS; i++)
    if (set_opt(cfg, &options[i], options[i].def, why, sizeof why) != 0)
      abort(); /* the table itself is wrong: a build defect */
}

void mokd_config_usage(FILE *out)
{
  fprintf(out,
          "usage: mokd [options]\n"
          "\n"
          "mokd executes Mixture-of-Experts layers for training processes that connect\n"
          "over a Unix socket (libmok, mokctl, the Python client).\n"
          "\n"
          "  --config FILE      config file (default " MOKD_DEFAULT_CONFIG ", if present)\n"
          "  --print-config     print the effective configuration and exit\n"
          "  --help             this text\n"
          "  --version          print the version and exit\n"
          "\n"
          "Options (flag, environment variable, default). Later sources win:\n"
          "defaults < config file ([mokd] section, name = value) < environment < flags.\n");
  for (size_t i = 0; i < NOPTS; i++) {
    char flag[64];
    size_t j;
    for (j = 0; options[i].name[j] && j < sizeof flag - 1; j++)
      flag[j] = options[i].name[j] == '_' ? '-' : options[i].name[j];
    flag[j] = 0;
    fprintf(out, "  --%-24s %-29s [%s]\n      %s\n", flag, options[i].env,
            options[i].def[0] ? options[i].def : "\"\"", options[i].help);
  }
  fprintf(out, "\nSignals: SIGTERM/SIGINT drain in-flight work and exit 0. SIGHUP re-reads\n"
               "log_level and log_subsys, then tenant_weights and tenant_quota_bytes, from\n"
               "the config file and the environment (an option given as a flag keeps its\n"
               "value); the new weights and quotas apply to connected tenants at once (a\n"
               "lowered quota frees nothing: it refuses new memory). A bad value keeps the\n"
               "old settings of its group and is logged with file and line. Run with\n"
               "MOKD_DEBUG=debug for details.\n");
}

static const opt *flag_opt(const char *arg, const char **inline_val)
{
  char name[64];
  size_t n = 0;
  *inline_val = NULL;
  for (; arg[n] && arg[n] != '=' && n < sizeof name - 1; n++)
    name[n] = arg[n] == '-' ? '_' : arg[n];
  name[n] = 0;
  if (arg[n] == '=')
    *inline_val = arg + n + 1;
  return find(name);
}

static void default_socket(mokd_config *cfg)
{
  if (cfg->socket[0] == 0)
    mok_default_socket(cfg->socket, sizeof cfg->socket);
}

int mokd_config_load(mokd_config *cfg, int argc, char **argv, char *err, size_t errlen)
{
  const char *file = NULL;
  int print = 0, rc;

  defaults(cfg);
  /* first pass: the flags that decide what to read or whether to run */
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      mokd_config_usage(stdout);
      return MOKD_CONFIG_EXIT;
    }
    if (strcmp(argv[i], "--version") == 0) {
      printf("mokd " MOKD_VERSION " (protocol %d to %d)\n", MOK_PROTOCOL_MIN,
             MOK_PROTOCOL_VERSION);
      return MOKD_CONFIG_EXIT;
    }
    if (strcmp(argv[i], "--print-config") == 0)
      print = 1;
    else if (strncmp(argv[i], "--config=", 9) == 0)
      file = argv[i] + 9;
    else if (strcmp(argv[i], "--config") == 0) {
      if (i + 1 >= argc) {
        snprintf(err, errlen, "--config needs a file name");
        return MOK_EINVAL;
      }
      file = argv[++i];
    }
  }
  if (file != NULL && strlen(file) >= sizeof cfg->config_file) {
    snprintf(err, errlen, "--config: path is too long");
    return MOK_EINVAL;
  }
  strcpy(cfg->config_file, file != NULL ? file : MOKD_DEFAULT_CONFIG);
  if ((rc = load_file(cfg, cfg->config_file, file != NULL, 0, err, errlen)) ||
      (rc = load_env(cfg, 0, err, errlen)))
    return rc;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *val;
    const opt *o;
    char why[256];
    if (strcmp(a, "--print-config") == 0)
      continue;
    if (strcmp(a, "--config") == 0) {
      i++;
      continue;
    }
    if (strncmp(a, "--config=", 9) == 0)
      continue;
    if (strncmp(a, "--", 2) != 0 || (o = flag_opt(a + 2, &val)) == NULL) {
      snprintf(err, errlen, "unknown argument \"%s\" (mokd --help lists the options)", a);
      return MOK_EINVAL;
    }
    if (val == NULL) {
      if (i + 1 >= argc) {
        snprintf(err, errlen, "%s needs a value", a);
        return MOK_EINVAL;
      }
      val = argv[++i];
    }
    if (set_opt(cfg, o, val, why, sizeof why) != 0) {
      snprintf(err, errlen, "flag %s", why);
      return MOK_EINVAL;
    }
    cfg->from_flags |= bit(o);
  }
  default_socket(cfg);
  if (print) {
    mokd_config_print(cfg, stdout);
    return MOKD_CONFIG_EXIT;
  }
  return MOKD_CONFIG_RUN;
}

int mokd_config_ids(const char *list, unsigned *out, int max, int *n, char *why, size_t len)
{
  const char *p = list;

  *n = 0;
  for (;;) {
    char *end;
    unsigned long v;
    p += strspn(p, ", ");
    if (*p == 0)
      return 0;
    if (*p < '0' || *p > '9') {
      snprintf(why, len, "\"%.*s\" is not a number", (int)strcspn(p, ", "), p);
      return -1;
    }
    errno = 0;
    v = strtoul(p, &end, 10);
    if (*end != 0 && *end != ',' && *end != ' ') {
      snprintf(why, len, "\"%.*s\" is not a number", (int)strcspn(p, ", "), p);
      return -1;
    }
    if (errno != 0 || v >= UINT32_MAX) {
      snprintf(why, len, "%.*s is too large", (int)(end - p), p);
      return -1;
    }
    if (*n == max) {
      snprintf(why, len, "at most %d entries", max);
      return -1;
    }
    out[(*n)++] = (unsigned)v;
    p = end;
  }
}

/* The tenant key of one entry "KEY=VALUE" of len bytes at e (form names the
 * list's entries in messages, value what follows =): its length in *keylen, or -1 with why. */
static int tenant_key(const char *e, size_t len, const char *form, const char *value,
                      size_t *keylen, char *why, size_t n)
{
  const char *eq = memchr(e, '=', len);
  size_t k;

  if (eq == NULL) {
    snprintf(why, n, "\"%.*s\" has no =%s; write %s", (int)len, e, value, form);
    return -1;
  }
  k = (size_t)(eq - e);
  if (k > 4 && strncmp(e, "uid:", 4) == 0) {
    for (size_t i = 4; i < k; i++)
      if (e[i] < '0' || e[i] > '9') {
        snprintf(why, n, "\"%.*s\": a uid is a number", (int)len, e);
        return -1;
      }
  } else if (k > 4 && k - 4 <= 63 && strncmp(e, "job:", 4) == 0) {
    for (size_t i = 4; i < k; i++) {
      char c = e[i];
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            strchr("._:@+-", c) != NULL)) {
        snprintf(why, n, "\"%.*s\": a job id is at most 63 letters, digits and ._:@+-",
                 (int)len, e);
        return -1;
      }
    }
  } else {
    snprintf(why, n, "\"%.*s\" names no tenant; write %s", (int)len, e, form);
    return -1;
  }
  *keylen = k;
  return 0;
}

/* One entry of tenant_weights, "job:ID=W" or "uid:N=W", of len bytes at e. */
static int weight_entry(const char *e, size_t len, size_t *keylen, uint64_t *w, char *why,
                        size_t n)
{
  const char *v;
  char *end;
  unsigned long x;

  if (tenant_key(e, len, "job:ID=W or uid:N=W", "WEIGHT", keylen, why, n) != 0)
    return -1;
  v = e + *keylen + 1;
  errno = 0;
  x = strtoul(v, &end, 10);
  if (v == e + len || *v < '0' || *v > '9' || end != e + len || errno != 0 || x < 1 ||
      x > 1000) {
    snprintf(why, n, "\"%.*s\": the weight is a whole number from 1 to 1000", (int)len, e);
    return -1;
  }
  *w = x;
  return 0;
}

/* One entry of tenant_quota_bytes, "job:ID=SIZE" or "uid:N=SIZE". */
static int quota_entry(const char *e, size_t len, size_t *keylen, uint64_t *bytes, char *why,
                       size_t n)
{
  char v[32];
  int64_t x;

  if (tenant_key(e, len, "job:ID=SIZE or uid:N=SIZE", "SIZE", keylen, why, n) != 0)
    return -1;
  snprintf(v, sizeof v, "%.*s", (int)(len - *keylen - 1), e + *keylen + 1);
  if (len - *keylen - 1 >= sizeof v || v[0] < '0' || v[0] > '9' || parse_size(v, &x) != 0 ||
      x < 1 || x > INT64_MAX / 2) {
    snprintf(why, n, "\"%.*s\": the quota is a size above 0 (bytes, or with K, M, G, T)",
             (int)len, e);
    return -1;
  }
  *bytes = (uint64_t)x;
  return 0;
}

typedef int (*entry_fn)(const char *e, size_t len, size_t *keylen, uint64_t *v, char *why,
                        size_t n);

/* The value of key in a list of tenant entries; dflt when it is not named.
 * key NULL only checks the list. */
static int tenant_value(const char *list, entry_fn entry, const char *key, uint64_t dflt,
                        uint64_t *out, char *why, size_t len)
{
  const char *p = list;

  *out = dflt;
  for (;;) {
    size_t elen, klen;
    uint64_t v;
    p += strspn(p, ", ");
    if (*p == 0)
      return 0;
    elen = strcspn(p, ", ");
    if (entry(p, elen, &klen, &v, why, len) != 0)
      return -1;
    for (const char *q = list; q < p; q += strspn(q, ", ")) {
      size_t ql = strcspn(q, ", ");
      if (strncmp(q, p, klen + 1) == 0) {
        snprintf(why, len, "\"%.*s\" is named twice", (int)klen, p);
        return -1;
      }
      q += ql;
    }
    if (key != NULL && strlen(key) == klen && strncmp(key, p, klen) == 0)
      *out = v;
    p += elen;
  }
}

int mokd_config_weight(const char *list, const char *key, unsigned *weight, char *why,
                       size_t len)
{
  uint64_t w;
  int rc = tenant_value(list, weight_entry, key, 1, &w, why, len);

  *weight = (unsigned)w;
  return rc;
}

int mokd_config_tenant_quota(const char *list, const char *key, uint64_t *bytes, char *why,
                             size_t len)
{
  return tenant_value(list, quota_entry, key, 0, bytes, why, len);
}

/* Reads the options of only again, from their defaults through the file and
 * the environment; one given as a flag keeps its value (flags win). All or
 * nothing: on an error cfg is left as it was. */
static int reload(mokd_config *cfg, uint32_t only, char *err, size_t errlen)
{
  mokd_config tmp = *cfg;
  char why[256];
  int rc;

  for (size_t i = 0; i < NOPTS; i++)
    if (only & bit(&options[i]))
      set_opt(&tmp, &options[i], options[i].def, why, sizeof why);
  if ((rc = load_file(&tmp, tmp.config_file, 0, only, err, errlen)) ||
      (rc = load_env(&tmp, only, err, errlen)))
    return rc;
  for (size_t i = 0; i < NOPTS; i++) {
    const opt *o = &options[i];
    if ((only & bit(o)) != 0 && (cfg->from_flags & bit(o)) == 0)
      memcpy((char *)cfg + o->off, (char *)&tmp + o->off,
             o->type == T_STR ? o->size : sizeof(int64_t));
  }
  return 0;
}

int mokd_config_reload_log(mokd_config *cfg, char *err, size_t errlen)
{
  return reload(cfg, bit(find("log_level")) | bit(find("log_subsys")), err, errlen);
}

int mokd_config_reload_tenants(mokd_config *cfg, char *err, size_t errlen)
{
  return reload(cfg, bit(find("tenant_weights")) | bit(find("tenant_quota_bytes")), err,
                errlen);
}

void mokd_config_print(const mokd_config *cfg, FILE *out)
{
  if (cfg->config_read)
    fprintf(out, "# mokd %s effective configuration (config file: %s)\n[mokd]\n",
            MOKD_VERSION, cfg->config_file);
  else
    fprintf(out, "# mokd %s effective configuration (no config file: %s does not exist)\n"
            "[mokd]\n", MOKD_VERSION, cfg->config_file);
  for (size_t i = 0; i < NOPTS; i++) {
    const opt *o = &options[i];
    const char *base = (const char *)cfg + o->off;
    int64_t v;
    if (o->type == T_STR) {
      fprintf(out, "%s = %s\n", o->name, base);
      continue;
    }
    memcpy(&v, base, sizeof v);
    if (o->type == T_LEVEL)
      fprintf(out, "%s = %s\n", o->name, mokd_log_level_name((int)v));
    else if (o->type == T_SUBSYS) {
      char names[64];
      mokd_log_subsys_names((unsigned)v, names, sizeof names);
      fprintf(out, "%s = %s\n", o->name, names);
    }
    else if (o->type == T_GPU && cfg->session_gpu_quota_pct > 0 && v == 0)
      fprintf(out, "%s = %d%%\n", o->name, cfg->session_gpu_quota_pct);
    else
      fprintf(out, "%s = %lld\n", o->name, (long long)v);
  }
}
