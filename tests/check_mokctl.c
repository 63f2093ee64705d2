/* check_mokctl.c - mokctl's command line: what it accepts, and the message a
 * user gets for each bad flag (mokctl prints it as "mokctl: MESSAGE" and
 * exits with 2; check_daemon runs the binary for a few of them). */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "mokctl_opts.h"
#include "ref.h"

#define MAXARGS 32

/* parses a NULL-terminated list of words after "mokctl" */
static int parse(mokctl_opts *o, char *err, ...)
{
  char *argv[MAXARGS] = {"mokctl"};
  int argc = 1;
  va_list ap;
  va_start(ap, err);
  for (char *w; (w = va_arg(ap, char *)) != NULL;) {
    ck_assert_int_lt(argc, MAXARGS);
    argv[argc++] = w;
  }
  va_end(ap);
  err[0] = 0;
  return mokctl_parse(argc, argv, o, err, MOK_ERRLEN);
}

#define REFUSED(msg, ...)                                                      \
  do {                                                                         \
    mokctl_opts o_;                                                            \
    char e_[MOK_ERRLEN];                                                       \
    ck_assert_int_eq(parse(&o_, e_, __VA_ARGS__, (char *)NULL), MOK_EINVAL);   \
    ck_assert_str_eq(e_, msg);                                                 \
  } while (0)

START_TEST(defaults_and_every_flag)
{
  mokctl_opts o;
  char err[MOK_ERRLEN];

  ck_assert_int_eq(parse(&o, err, "bench", (char *)NULL), 0);
  ck_assert_int_eq(o.cmd, MOKCTL_BENCH);
  ck_assert_ptr_null(o.socket);
  ck_assert(o.T == 1024 && o.layer.hidden == 1024 && o.layer.intermediate == 512 &&
            o.layer.experts == 16 && o.layer.top_k == 2 && o.layer.shared_intermediate == 0 &&
            o.iters == 20 && o.ep == 1 && !o.help);
  ck_assert_int_eq(parse(&o, err, "--socket", "/tmp/a.sock", "bench", "--T", "7", "--H=64",
                         "--I", "128", "--E", "8", "--K", "8", "--shared", "32", "--iters", "3",
                         "--ep", "4", (char *)NULL), 0);
  ck_assert_str_eq(o.socket, "/tmp/a.sock");
  ck_assert(o.T == 7 && o.layer.hidden == 64 && o.layer.intermediate == 128 &&
            o.layer.experts == 8 && o.layer.top_k == 8 && o.layer.shared_intermediate == 32 &&
            o.iters == 3 && o.ep == 4);
  /* --socket after the command too, and the plain commands */
  ck_assert_int_eq(parse(&o, err, "ping", "--socket=/tmp/b.sock", (char *)NULL), 0);
  ck_assert_int_eq(o.cmd, MOKCTL_PING);
  ck_assert_str_eq(o.socket, "/tmp/b.sock");
  ck_assert_int_eq(parse(&o, err, "status", (char *)NULL), 0);
  ck_assert_int_eq(o.cmd, MOKCTL_STATUS);
  ck_assert_int_eq(parse(&o, err, "stats", (char *)NULL), 0);
  ck_assert_int_eq(o.cmd, MOKCTL_STATS);
  ck_assert_int_eq(parse(&o, err, "sessions", (char *)NULL), 0);
  ck_assert_int_eq(o.cmd, MOKCTL_SESSIONS);
  ck_assert_int_eq(parse(&o, err, "health", (char *)NULL), 0);
  ck_assert(o.cmd == MOKCTL_HEALTH && o.timeout_s == 10);
  ck_assert_int_eq(parse(&o, err, "health", "--timeout", "3", (char *)NULL), 0);
  ck_assert_int_eq(o.timeout_s, 3);
  ck_assert_int_eq(parse(&o, err, "evict", "--job", "1234_7", (char *)NULL), 0);
  ck_assert(o.cmd == MOKCTL_EVICT && strcmp(o.job, "1234_7") == 0 && o.session == 0);
  ck_assert_int_eq(parse(&o, err, "evict", "--session=42", "--timeout", "1", (char *)NULL), 0);
  ck_assert(o.job == NULL && o.session == 42 && o.timeout_s == 1);
}
END_TEST

START_TEST(help_is_asked_for)
{
  mokctl_opts o;
  char err[MOK_ERRLEN];

  ck_assert_int_eq(parse(&o, err, "--help", (char *)NULL), 0);
  ck_assert(o.help && o.cmd == MOKCTL_NONE);
  ck_assert_int_eq(parse(&o, err, "-h", (char *)NULL), 0);
  ck_assert(o.help);
  ck_assert_int_eq(parse(&o, err, "bench", "--T", "5", "--help", (char *)NULL), 0);
  ck_assert(o.help && o.cmd == MOKCTL_BENCH);
  ck_assert_int_eq(parse(&o, err, "stats", "-h", (char *)NULL), 0);
  ck_assert(o.help && o.cmd == MOKCTL_STATS);
}
END_TEST

START_TEST(help_names_every_bench_flag)
{
  char *text;
  size_t len;
  FILE *f = open_memstream(&text, &len);
  mokctl_usage(f, MOKCTL_NONE);
  fclose(f);
  const char *want[] = {"ping", "status", "stats", "bench", "--socket", "--help", "--T n",
                        "--H n", "--I n", "--E n", "--K n", "--shared n", "--iters n", "--ep P",
                        "--tuning S",
                        "at most E", "max_arena_bytes", "Exit status"};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(text, want[i]) != NULL, "help lacks \"%s\"", want[i]);
  free(text);
}
END_TEST

START_TEST(commands_and_arguments)
{
  REFUSED("no command given; one of ping, status, stats, bench, health, sessions, evict",
          "--socket", "/tmp/a.sock");
  REFUSED("unknown command \"pong\"; one of ping, status, stats, bench, health, sessions, "
          "evict", "pong");
  REFUSED("ping: unexpected argument \"now\"", "ping", "now");
  REFUSED("bench: unexpected argument \"fast\"", "bench", "--T", "4", "fast");
  REFUSED("unknown option \"--T\"", "--T", "4", "bench");
  REFUSED("unknown option \"-x\"", "-x", "ping");
  REFUSED("bench: unknown option \"--tokens\"", "bench", "--tokens=4");
  REFUSED("bench: --E 16 does not divide by --ep 3; each of the 3 ranks holds E / 3 experts",
          "bench", "--ep", "3");
  REFUSED("--ep: 0 is out of range; it must be in [1, 256]", "bench", "--ep", "0");
  REFUSED("stats: unknown option \"--T\"", "stats", "--T", "4");
  REFUSED("evict: name exactly one of --job ID and --session N", "evict");
  REFUSED("evict: name exactly one of --job ID and --session N", "evict", "--job", "7",
          "--session", "3");
  REFUSED("evict: --job: the job id is empty", "evict", "--job", "");
  REFUSED("--session: \"x\" is not a whole number", "evict", "--session", "x");
  REFUSED("--timeout: 0 is out of range; it must be in [1, 3600]", "health", "--timeout", "0");
  REFUSED("health: unknown option \"--job\"", "health", "--job", "7");
  REFUSED("sessions: unexpected argument \"all\"", "sessions", "all");
}
END_TEST

START_TEST(socket_flag)
{
  char longp[200];
  memset(longp, 'a', sizeof longp - 1);
  longp[0] = '/';
  longp[sizeof longp - 1] = 0;
  REFUSED("--socket needs a value", "--socket");
  REFUSED("--socket: the path is empty", "--socket", "", "ping");
  REFUSED("--socket: the path has 199 bytes; a Unix socket path has at most 107", "--socket",
          longp, "ping");
  REFUSED("bench: --socket needs a value", "bench", "--socket");
}
END_TEST

START_TEST(bench_numbers)
{
  /* --T abc used to become T = 0 and a daemon message about x */
  REFUSED("--T: \"abc\" is not a whole number", "bench", "--T", "abc");
  REFUSED("--H: \"12k\" is not a whole number", "bench", "--H", "12k");
  REFUSED("--I: \" 5\" is not a whole number", "bench", "--I", " 5");
  REFUSED("--K: \"\" is not a whole number", "bench", "--K=");
  REFUSED("--T: 0 is out of range; it must be in [1, 16777216]", "bench", "--T", "0");
  REFUSED("--T: -3 is out of range; it must be in [1, 16777216]", "bench", "--T", "-3");
  REFUSED("--H: 16777217 is out of range; it must be in [1, 16777216]", "bench", "--H",
          "16777217");
  REFUSED("--I: 99999999999999999999 is out of range; it must be in [1, 16777216]", "bench",
          "--I", "99999999999999999999");
  /* E = 0 used to die of SIGFPE */
  REFUSED("--E: 0 is out of range; it must be in [1, 16777216]", "bench", "--E", "0");
  REFUSED("--K: 0 is out of range; it must be in [1, 16777216]", "bench", "--K", "0");
  REFUSED("--shared: -1 is out of range; it must be in [0, 16777216]", "bench", "--shared",
          "-1");
  /* --iters 0 used to run once */
  REFUSED("--iters: 0 is out of range; it must be in [1, 1000000]", "bench", "--iters", "0");
  REFUSED("--iters: 1000001 is out of range; it must be in [1, 1000000]", "bench", "--iters",
          "1000001");
  REFUSED("bench: --iters needs a value", "bench", "--iters");
  /* K > E used to hang, looking for K distinct experts among E */
  REFUSED("bench: --K 20 is larger than --E 4; each token picks K distinct experts", "bench",
          "--K", "20", "--E", "4");
  REFUSED("bench: --K 17 is larger than --E 16; each token picks K distinct experts", "bench",
          "--K", "17");
}
END_TEST

/* --tuning: the layer's kernel options through mok_layer_tuning_parse */
START_TEST(tuning_flag)
{
  mokctl_opts o;
  char err[MOK_ERRLEN];

  ck_assert_int_eq(parse(&o, err, "bench", (char *)NULL), 0);
  mok_layer_tuning none;
  memset(&none, 0, sizeof none);
  ck_assert_mem_eq(&o.tune, &none, sizeof none);
  ck_assert_int_eq(parse(&o, err, "bench", "--tuning", "tiles=tall,dispatch=before",
                         (char *)NULL), 0);
  ck_assert_int_eq(o.tune.tiles, MOK_TILES_TALL);
  ck_assert_int_eq(o.tune.dispatch_blocks, MOK_DISPATCH_BEFORE);
  ck_assert_int_eq(o.tune.order, MOK_ORDER_AUTO);
  ck_assert_int_eq(parse(&o, err, "bench", "--tuning", "dispatch=gather", (char *)NULL), 0);
  ck_assert_int_eq(o.tune.dispatch_blocks, MOK_DISPATCH_GATHER);
  REFUSED("--tuning: tuning: tiles=huge is not one of auto|wide|tall|pingpong", "bench",
          "--tuning", "tiles=huge");
  REFUSED("bench: --tuning needs a value", "bench", "--tuning");
}
END_TEST

/* Every option, every name, both ways; and the messages of each kind of
 * bad item. */
START_TEST(tuning_text)
{
  mok_layer_tuning t, back;
  char err[MOK_ERRLEN], buf[256];

  ck_assert_int_eq(mok_layer_tuning_parse(&t, NULL, err), 0);
  ck_assert_int_eq(mok_layer_tuning_format(&t, buf, sizeof buf), 0);
  ck_assert_str_eq(buf, "");
  ck_assert_int_eq(mok_layer_tuning_parse(&t, " ,, ", err), 0);
  ck_assert_int_eq(t.tiles + t.wgrad_tiles + t.clusters + t.order + t.tails + t.dx +
                       t.dispatch_blocks, 0);

  const char *all = "tiles=pingpong,wgrad_tiles=wide,clusters=all,order=static,"
                    "tails=split,dx=whole,dispatch=24";
  ck_assert_int_eq(mok_layer_tuning_parse(&t, all, err), 0);
  ck_assert(t.tiles == MOK_TILES_PINGPONG && t.wgrad_tiles == MOK_TILES_WIDE &&
            t.clusters == MOK_CLUSTERS_ALL && t.order == MOK_ORDER_STATIC &&
            t.tails == MOK_TAILS_SPLIT && t.dx == MOK_DX_WHOLE && t.dispatch_blocks == 24);
  ck_assert_int_eq(mok_layer_tuning_format(&t, buf, sizeof buf), (int)strlen(all));
  ck_assert_str_eq(buf, all);
  /* measuring first, and a short buffer stays terminated */
  ck_assert_int_eq(mok_layer_tuning_format(&t, NULL, 0), (int)strlen(all));
  ck_assert_int_eq(mok_layer_tuning_format(&t, buf, 6), (int)strlen(all));
  ck_assert_str_eq(buf, "tiles");

  /* every value of every field survives format then parse */
  static const char *words[] = {
      "tiles=auto", "tiles=wide", "tiles=tall", "tiles=pingpong", "wgrad_tiles=auto",
      "wgrad_tiles=wide", "wgrad_tiles=pingpong", "clusters=auto", "clusters=none",
      "clusters=dgrad", "clusters=all", "order=auto", "order=dynamic", "order=static",
      "tails=auto", "tails=own", "tails=ride", "tails=split", "tails=whole", "dx=auto",
      "dx=halves", "dx=whole", "dispatch=auto", "dispatch=before", "dispatch=gather",
      "dispatch=1", "dispatch=1024"};
  for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
    ck_assert_msg(mok_layer_tuning_parse(&t, words[i], err) == 0, "%s: %s", words[i], err);
    ck_assert_int_ge(mok_layer_tuning_format(&t, buf, sizeof buf), 0);
    ck_assert_int_eq(mok_layer_tuning_parse(&back, buf, err), 0);
    ck_assert_mem_eq(&t, &back, sizeof t);
    if (strstr(words[i], "=auto") == NULL) /* a choice is written out; a default is not */
      ck_assert_str_eq(buf, words[i]);
    else
      ck_assert_str_eq(buf, "");
  }
  /* the last word wins, separated by spaces too */
  ck_assert_int_eq(mok_layer_tuning_parse(&t, "order=static order=dynamic\ttiles=wide", err), 0);
  ck_assert(t.order == MOK_ORDER_DYNAMIC && t.tiles == MOK_TILES_WIDE);

  static const struct {
    const char *text, *msg;
  } bad[] = {
      {"tiles=huge", "tuning: tiles=huge is not one of auto|wide|tall|pingpong"},
      {"wgrad_tiles=tall", "tuning: wgrad_tiles=tall is not one of auto|wide|pingpong"},
      {"order=static,colour=red", "tuning: \"colour\" is not an option (tiles, wgrad_tiles, "
                                  "clusters, order, tails, dx, dispatch)"},
      {"tiles", "tuning: \"tiles\" is not key=value"},
      {"=wide", "tuning: \"=wide\" is not key=value"},
      {"tiles=", "tuning: \"tiles=\" has no value"},
      {"dispatch=0", "tuning: dispatch=0 is not auto, before, gather or a number of blocks "
                     "from 1 to 1024"},
      {"dispatch=1025", "tuning: dispatch=1025 is not auto, before, gather or a number of "
                        "blocks from 1 to 1024"},
      {"dispatch=-1", "tuning: dispatch=-1 is not auto, before, gather or a number of blocks "
                      "from 1 to 1024"},
      {"dispatch=8x", "tuning: dispatch=8x is not auto, before, gather or a number of blocks "
                      "from 1 to 1024"},
      {"dx=wholeandsomemorewordsthanfitinthere", "tuning: \"dx=wholeandsomemorewordsthanfitin"
                                                 "there\" has too long a value"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    memset(&t, 0x55, sizeof t);
    ck_assert_int_eq(mok_layer_tuning_parse(&t, bad[i].text, err), MOK_EINVAL);
    ck_assert_str_eq(err, bad[i].msg);
    ck_assert_int_eq(t.tiles + t.order + t.dispatch_blocks, 0); /* nothing half-read */
  }
  ck_assert_int_eq(mok_layer_tuning_parse(&t, "tiles=what", NULL), MOK_EINVAL);
  ck_assert_int_eq(mok_layer_tuning_parse(NULL, "", err), MOK_ENULL);

  /* values no parse gives are refused in writing */
  memset(&t, 0, sizeof t);
  t.wgrad_tiles = MOK_TILES_TALL;
  ck_assert_int_eq(mok_layer_tuning_format(&t, buf, sizeof buf), MOK_EINVAL);
  t.wgrad_tiles = 0, t.tails = MOK_TAILS_COUNT;
  ck_assert_int_eq(mok_layer_tuning_format(&t, buf, sizeof buf), MOK_EINVAL);
  t.tails = 0, t.dispatch_blocks = -3;
  ck_assert_int_eq(mok_layer_tuning_format(&t, buf, sizeof buf), MOK_EINVAL);
  t.dispatch_blocks = MOK_DISPATCH_BLOCKS_MAX + 1;
  ck_assert_int_eq(mok_layer_tuning_format(&t, buf, sizeof buf), MOK_EINVAL);
  ck_assert_int_eq(mok_layer_tuning_format(NULL, buf, sizeof buf), MOK_ENULL);
}
END_TEST

Suite *mokctl_suite(void)
{
  Suite *s = suite_create("mokctl");
  TCase *tc = tcase_create("flags");
  tcase_add_test(tc, defaults_and_every_flag);
  tcase_add_test(tc, help_is_asked_for);
  tcase_add_test(tc, help_names_every_bench_flag);
  tcase_add_test(tc, commands_and_arguments);
  tcase_add_test(tc, socket_flag);
  tcase_add_test(tc, bench_numbers);
  tcase_add_test(tc, tuning_flag);
  tcase_add_test(tc, tuning_text);
  suite_add_tcase(s, tc);
  return s;
}
