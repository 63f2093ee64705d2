/* mokctl_opts.c - see mokctl_opts.h. */
#include "mokctl_opts.h"

#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include "layer.h"

enum { OPT_T = 256, OPT_H, OPT_I, OPT_E, OPT_K, OPT_SHARED, OPT_ITERS, OPT_TIMEOUT, OPT_JOB,
       OPT_SESSION, OPT_EP, OPT_TUNING };

static const struct option global_opts[] = {
  {"socket", required_argument, NULL, 's'},
  {"help", no_argument, NULL, 'h'},
  {NULL, 0, NULL, 0},
};

static const struct option bench_opts[] = {
  {"socket", required_argument, NULL, 's'},
  {"help", no_argument, NULL, 'h'},
  {"T", required_argument, NULL, OPT_T},
  {"H", required_argument, NULL, OPT_H},
  {"I", required_argument, NULL, OPT_I},
  {"E", required_argument, NULL, OPT_E},
  {"K", required_argument, NULL, OPT_K},
  {"shared", required_argument, NULL, OPT_SHARED},
  {"iters", required_argument, NULL, OPT_ITERS},
  {"ep", required_argument, NULL, OPT_EP},
  {"tuning", required_argument, NULL, OPT_TUNING},
  {NULL, 0, NULL, 0},
};

static const struct option health_opts[] = {
  {"socket", required_argument, NULL, 's'},
  {"help", no_argument, NULL, 'h'},
  {"timeout", required_argument, NULL, OPT_TIMEOUT},
  {NULL, 0, NULL, 0},
};

static const struct option evict_opts[] = {
  {"socket", required_argument, NULL, 's'},
  {"help", no_argument, NULL, 'h'},
  {"job", required_argument, NULL, OPT_JOB},
  {"session", required_argument, NULL, OPT_SESSION},
  {"timeout", required_argument, NULL, OPT_TIMEOUT},
  {NULL, 0, NULL, 0},
};

static const struct {
  const char *name;
  mokctl_cmd cmd;
} commands[] = {
  {"ping", MOKCTL_PING}, {"status", MOKCTL_STATUS}, {"stats", MOKCTL_STATS},
  {"bench", MOKCTL_BENCH}, {"health", MOKCTL_HEALTH}, {"sessions", MOKCTL_SESSIONS},
  {"evict", MOKCTL_EVICT},
};
#define COMMAND_LIST "ping, status, stats, bench, health, sessions, evict"

static int fail(char *err, size_t errlen, const char *fmt, ...)
{
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
  return MOK_EINVAL;
}

static const char *flag_name(const struct option *opts, int val)
{
  for (const struct option *o = opts; o->name != NULL; o++)
    if (o->val == val)
      return o->name;
  return "?";
}

/* a whole decimal number in [lo, hi], nothing else around it */
static int parse_int(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out,
                     char *err, size_t errlen)
{
  char *end;
  long long v;

  errno = 0;
  v = strtoll(s, &end, 10);
  if (end == s || *end != 0 || !(s[0] == '-' || (s[0] >= '0' && s[0] <= '9')))
    return fail(err, errlen, "--%s: \"%s\" is not a whole number", flag, s);
  if (errno == ERANGE || v < lo || v > hi)
    return fail(err, errlen, "--%s: %s is out of range; it must be in [%lld, %lld]", flag, s,
                (long long)lo, (long long)hi);
  *out = v;
  return 0;
}

static int parse_socket(const char *s, mokctl_opts *o, char *err, size_t errlen)
{
  struct sockaddr_un sa;

  if (s[0] == 0)
    return fail(err, errlen, "--socket: the path is empty");
  if (strlen(s) >= sizeof sa.sun_path)
    return fail(err, errlen, "--socket: the path has %zu bytes; a Unix socket path has at "
                "most %zu", strlen(s), sizeof sa.sun_path - 1);
  o->socket = s;
  return 0;
}

/* what getopt_long refused: an unknown option or one without its value */
static int bad_option(int c, const struct option *opts, char **argv, const char *where,
                      char *err, size_t errlen)
{
  const char *arg = argv[optind - 1];
  if (c == ':')
    return fail(err, errlen, "%s--%s needs a value", where, flag_name(opts, optopt));
  if (optopt != 0) /* a short option; optind may still point at its word */
    return fail(err, errlen, "%sunknown option \"-%c\"", where, optopt);
  return fail(err, errlen, "%sunknown option \"%.*s\"", where, (int)strcspn(arg, "="), arg);
}

static int parse_bench(int argc, char **argv, mokctl_opts *o, char *err, size_t errlen)
{
  int64_t v;
  int c;

  optind = 0; /* GNU: start over on this argv */
  while ((c = getopt_long(argc, argv, "+:h", bench_opts, NULL)) != -1) {
    const char *name = flag_name(bench_opts, c);
    switch (c) {
    case 'h':
      o->help = 1;
      return 0;
    case 's':
      if (parse_socket(optarg, o, err, errlen))
        return MOK_EINVAL;
      break;
    case OPT_T:
    case OPT_H:
    case OPT_I:
    case OPT_E:
    case OPT_K:
      if (parse_int(name, optarg, 1, MOKK_DIM_MAX, &v, err, errlen))
        return MOK_EINVAL;
      *(c == OPT_T ? &o->T : c == OPT_H ? &o->layer.hidden : c == OPT_I ? &o->layer.intermediate
        : c == OPT_E ? &o->layer.experts : &o->layer.top_k) = v;
      break;
    case OPT_SHARED:
      if (parse_int(name, optarg, 0, MOKK_DIM_MAX, &o->layer.shared_intermediate, err, errlen))
        return MOK_EINVAL;
      break;
    case OPT_ITERS:
      if (parse_int(name, optarg, 1, MOKCTL_ITERS_MAX, &v, err, errlen))
        return MOK_EINVAL;
      o->iters = (int)v;
      break;
    case OPT_EP:
      if (parse_int(name, optarg, 1, MOKCTL_EP_MAX, &v, err, errlen))
        return MOK_EINVAL;
      o->ep = (int)v;
      break;
    case OPT_TUNING: {
      char why[MOK_ERRLEN];
      if (mok_layer_tuning_parse(&o->tune, optarg, why))
        return fail(err, errlen, "--tuning: %s", why);
      break;
    }
    default:
      return bad_option(c, bench_opts, argv, "bench: ", err, errlen);
    }
  }
  if (optind < argc)
    return fail(err, errlen, "bench: unexpected argument \"%s\"", argv[optind]);
  if (o->layer.top_k > o->layer.experts)
    return fail(err, errlen, "bench: --K %lld is larger than --E %lld; each token picks K "
                "distinct experts", (long long)o->layer.top_k, (long long)o->layer.experts);
  if (o->layer.experts % o->ep != 0)
    return fail(err, errlen, "bench: --E %lld does not divide by --ep %d; each of the %d ranks "
                "holds E / %d experts", (long long)o->layer.experts, o->ep, o->ep, o->ep);
  return 0;
}

/* health [--timeout S]; evict --job ID | --session N [--timeout S] */
static int parse_admin(int argc, char **argv, const struct option *opts, mokctl_opts *o,
                       char *err, size_t errlen)
{
  char where[32];
  int64_t v;
  int c;

  snprintf(where, sizeof where, "%s: ", argv[0]);
  optind = 0;
  while ((c = getopt_long(argc, argv, "+:h", opts, NULL)) != -1) {
    switch (c) {
    case 'h':
      o->help = 1;
      return 0;
    case 's':
      if (parse_socket(optarg, o, err, errlen))
        return MOK_EINVAL;
      break;
    case OPT_TIMEOUT:
      if (parse_int("timeout", optarg, 1, MOKCTL_TIMEOUT_MAX, &v, err, errlen))
        return MOK_EINVAL;
      o->timeout_s = (int)v;
      break;
    case OPT_JOB:
      if (optarg[0] == 0)
        return fail(err, errlen, "%s--job: the job id is empty", where);
      o->job = optarg;
      break;
    case OPT_SESSION:
      if (parse_int("session", optarg, 1, INT64_MAX, &v, err, errlen))
        return MOK_EINVAL;
      o->session = (uint64_t)v;
      break;
    default:
      return bad_option(c, opts, argv, where, err, errlen);
    }
  }
  if (optind < argc)
    return fail(err, errlen, "%sunexpected argument \"%s\"", where, argv[optind]);
  if (o->cmd == MOKCTL_EVICT && (o->job == NULL) == (o->session == 0))
    return fail(err, errlen, "evict: name exactly one of --job ID and --session N");
  return 0;
}

/* ping, status, stats and sessions take only --socket and --help */
static int parse_plain(int argc, char **argv, mokctl_opts *o, char *err, size_t errlen)
{
  char where[32];
  int c;

  snprintf(where, sizeof where, "%s: ", argv[0]);
  optind = 0;
  while ((c = getopt_long(argc, argv, "+:h", global_opts, NULL)) != -1) {
    if (c == 'h') {
      o->help = 1;
      return 0;
    }
    if (c != 's')
      return bad_option(c, global_opts, argv, where, err, errlen);
    if (parse_socket(optarg, o, err, errlen))
      return MOK_EINVAL;
  }
  if (optind < argc)
    return fail(err, errlen, "%sunexpected argument \"%s\"", where, argv[optind]);
  return 0;
}

int mokctl_parse(int argc, char **argv, mokctl_opts *o, char *err, size_t errlen)
{
  int c;

  memset(o, 0, sizeof *o);
  o->layer = (mok_layer_desc){.hidden = 1024, .intermediate = 512, .experts = 16, .top_k = 2};
  o->T = 1024;
  o->iters = 20;
  o->ep = 1;
  o->timeout_s = 10;
  opterr = 0;
  optind = 0;
  while ((c = getopt_long(argc, argv, "+:h", global_opts, NULL)) != -1) {
    if (c == 'h') {
      o->help = 1;
      return 0;
    }
    if (c != 's')
      return bad_option(c, global_opts, argv, "", err, errlen);
    if (parse_socket(optarg, o, err, errlen))
      return MOK_EINVAL;
  }
  if (optind >= argc)
    return fail(err, errlen, "no command given; one of " COMMAND_LIST);
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (strcmp(argv[optind], commands[i].name) == 0)
      o->cmd = commands[i].cmd;
  if (o->cmd == MOKCTL_NONE)
    return fail(err, errlen, "unknown command \"%s\"; one of " COMMAND_LIST, argv[optind]);
  /* the command's own options: argv from the command on */
  argc -= optind, argv += optind;
  if (o->cmd == MOKCTL_BENCH)
    return parse_bench(argc, argv, o, err, errlen);
  if (o->cmd == MOKCTL_HEALTH || o->cmd == MOKCTL_EVICT)
    return parse_admin(argc, argv, o->cmd == MOKCTL_HEALTH ? health_opts : evict_opts, o, err,
                       errlen);
  return parse_plain(argc, argv, o, err, errlen);
}

static const char bench_help[] =
  "mokctl bench [options]: runs a random layer through the daemon, forward then\n"
  "backward, and prints request round-trip percentiles and GFLOP/s.\n"
  "\n"
  "  --T n        tokens                              default 1024, in [1, 16777216]\n"
  "  --H n        hidden size                         default 1024, in [1, 16777216]\n"
  "  --I n        expert intermediate size            default  512, in [1, 16777216]\n"
  "  --E n        experts                             default   16, in [1, 16777216]\n"
  "  --K n        experts per token, at most E        default    2, in [1, 16777216]\n"
  "  --shared n   shared expert intermediate size     default    0 (none)\n"
  "  --iters n    forward+backward steps to time      default   20, in [1, 1000000]\n"
  "  --ep P       an EP group of P ranks, one client  default    1, in [1, 256];\n"
  "               process each, T tokens and E/P experts a rank: the times are\n"
  "               of the group's steps (the slowest rank's round trip)\n"
  "  --tuning S   the layer's kernel options, as key=value,... (speed and\n"
  "               memory, never results): tiles=auto|wide|tall|pingpong,\n"
  "               wgrad_tiles=auto|wide|pingpong, clusters=auto|none|dgrad|all,\n"
  "               order=auto|dynamic|static, tails=auto|own|ride|split|whole,\n"
  "               dx=auto|halves|whole, dispatch=auto|before|gather|N\n"
  "\n"
  "The daemon holds one arena with the weights (bf16), the inputs and fp32\n"
  "gradient buffers: about (3 E H I + 3 H I_s) x 6 + T H x 4 + T K x 8 bytes;\n"
  "it refuses one over its max_arena_bytes or the session quota (mokctl status\n"
  "shows both) before anything is written. The cuda backend needs H, I and\n"
  "I_s to be multiples of 64.\n"
  "Example: mokctl bench --T 4096 --H 2048 --I 768 --E 128 --K 8 --iters 50\n";

void mokctl_usage(FILE *out, mokctl_cmd cmd)
{
  if (cmd == MOKCTL_BENCH) {
    fputs(bench_help, out);
    return;
  }
  fputs("usage: mokctl [--socket PATH] COMMAND [options]\n"
        "\n"
        "Talks to a running mokd.\n"
        "\n"
        "  ping      round trip to the daemon\n"
        "  status    daemon version, backend, limits (frame, arena, quotas), uptime\n"
        "  stats     what the daemon holds and has served, over all sessions\n"
        "  bench     run a layer through the daemon (mokctl bench --help)\n"
        "  health [--timeout S]\n"
        "            ready when a round trip through every executor and backend works\n"
        "            and none is stuck; exit 0 ready, 1 not (or no answer in S s, 10)\n"
        "  sessions  who is connected: pid, uid, client, job, memory, contexts\n"
        "            (root and the daemon's uid see all; others their own)\n"
        "  evict --job ID | --session N [--timeout S]\n"
        "            close a job's sessions and free what they hold, waiting up to S s\n"
        "            (10) until they are gone; root or the daemon's uid only\n"
        "\n"
        "  --socket PATH  the daemon's socket (before or after the command); default\n"
        "                 $MOKD_SOCKET, else /run/mokd/mokd.sock as root, else\n"
        "                 $XDG_RUNTIME_DIR/mokd.sock, else /tmp/mokd-UID.sock\n"
        "  -h, --help     this help; COMMAND --help for a command's\n"
        "\n"
        "Exit status: 0 done, 1 the daemon or the connection failed, 2 bad usage.\n",
        out);
  if (cmd == MOKCTL_NONE) {
    fputs("\n", out);
    fputs(bench_help, out);
  }
}
