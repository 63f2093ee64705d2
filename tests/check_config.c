/* check_config.c - the option table and its precedence: defaults < file <
 * environment < flags; every bad value stops start-up with where it was. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "ref.h"

static mokd_config cfg;
static char err[512];
static char path[64];

static void write_conf(const char *text)
{
  strcpy(path, "/tmp/mokd-check-XXXXXX");
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
  close(fd);
}

static int load(int argc, char **argv)
{
  err[0] = 0;
  return mokd_config_load(&cfg, argc, argv, err, sizeof err);
}

START_TEST(defaults)
{
  char *argv[] = {"mokd", "--config", "/dev/null"};
  unsetenv("MOKD_SOCKET");
  ck_assert_int_eq(load(3, argv), MOKD_CONFIG_RUN);
  ck_assert_str_eq(cfg.backend, "auto");
  ck_assert_int_eq(cfg.max_frame_bytes, 1 << 20);
  ck_assert_int_eq(cfg.executor_threads, 2);
  ck_assert_int_eq(cfg.log_level, MOKD_LOG_INFO);
  /* a session may hold half the RAM by default, not all of it and more */
  int64_t ram = (int64_t)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
  ck_assert_int_eq(cfg.session_quota_bytes, ram / 2);
  /* and 90% of the smallest GPU, in bytes once the devices are open */
  ck_assert_int_eq(cfg.session_gpu_quota_bytes, 0);
  ck_assert_int_eq(cfg.session_gpu_quota_pct, 90);
  mokd_config_gpu_quota(&cfg, 1000ull << 20);
  ck_assert_int_eq(cfg.session_gpu_quota_bytes, 900ll << 20);
  ck_assert(cfg.socket[0] != 0); /* a default path is filled in */
}
END_TEST

START_TEST(quota_as_a_share_of_ram)
{
  int64_t ram = (int64_t)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
  char *argv[] = {"mokd", "--config", "/dev/null", "--session-quota-bytes", "10%"};
  ck_assert_int_eq(load(5, argv), MOKD_CONFIG_RUN);
  ck_assert_int_eq(cfg.session_quota_bytes, ram / 10);
  argv[4] = "0"; /* unlimited, as before */
  ck_assert_int_eq(load(5, argv), MOKD_CONFIG_RUN);
  ck_assert_int_eq(cfg.session_quota_bytes, 0);
  argv[4] = "3G";
  ck_assert_int_eq(load(5, argv), MOKD_CONFIG_RUN);
  ck_assert_int_eq(cfg.session_quota_bytes, 3ll << 30);
  const char *bad[] = {"101%", "0%", "%", "5.5%", "x%"};
  for (int i = 0; i < 5; i++) {
    argv[4] = (char *)bad[i];
    ck_assert_int_eq(load(5, argv), MOK_EINVAL);
    ck_assert_msg(strstr(err, "is not a share of RAM from 1% to 100%") != NULL, "%s: %s",
                  bad[i], err);
  }
  /* the GPU quota: a share of the smallest device, or bytes, which win */
  char *argv2[] = {"mokd", "--config", "/dev/null", "--session-gpu-quota-bytes", "10%"};
  ck_assert_int_eq(load(5, argv2), MOKD_CONFIG_RUN);
  ck_assert_int_eq(cfg.session_gpu_quota_pct, 10);
  mokd_config_gpu_quota(&cfg, 141ull << 30);
  ck_assert_int_eq(cfg.session_gpu_quota_bytes, (int64_t)((141ull << 30) / 10));
  mokd_config_gpu_quota(&cfg, 0); /* no device: nothing to hold, unlimited */
  ck_assert_int_eq(cfg.session_gpu_quota_bytes, 0);
  argv2[4] = "2G";
  ck_assert_int_eq(load(5, argv2), MOKD_CONFIG_RUN);
  ck_assert_int_eq(cfg.session_gpu_quota_pct, 0);
  mokd_config_gpu_quota(&cfg, 141ull << 30);
  ck_assert_int_eq(cfg.session_gpu_quota_bytes, 2ll << 30);
  for (int i = 0; i < 5; i++) {
    argv2[4] = (char *)bad[i];
    ck_assert_int_eq(load(5, argv2), MOK_EINVAL);
    ck_assert_msg(strstr(err, "is not a share of the device from 1% to 100%") != NULL,
                  "%s: %s", bad[i], err);
  }
  argv2[4] = "lots";
  ck_assert_int_eq(load(5, argv2), MOK_EINVAL);
  ck_assert_msg(strstr(err, "is not a size") != NULL, "%s", err);
}
END_TEST

START_TEST(precedence)
{
  write_conf("# example\n[mokd]\nsocket = /tmp/from-file.sock\nmax_frame_bytes = 2M\n"
             "cpu_threads = 3\nlog_level = debug\n");
  char *argv[] = {"mokd", "--config", path, "--cpu-threads=5"};
  setenv("MOKD_MAX_FRAME_BYTES", "65536", 1);
  setenv("MOKD_CPU_THREADS", "4", 1);
  ck_assert_int_eq(load(4, argv), MOKD_CONFIG_RUN);
  ck_assert_str_eq(cfg.socket, "/tmp/from-file.sock"); /* file over default */
  ck_assert_int_eq(cfg.max_frame_bytes, 65536);        /* env over file */
  ck_assert_int_eq(cfg.cpu_threads, 5);                /* flag over env */
  ck_assert_int_eq(cfg.log_level, MOKD_LOG_DEBUG);
  unlink(path);
}
END_TEST

START_TEST(bad_file_names_file_and_line)
{
  char want[128];
  char *argv[] = {"mokd", "--config", path};
  write_conf("[mokd]\nbackend = cpu\n\nmax_frame_bytes = lots\n");
  ck_assert_int_eq(load(3, argv), MOK_EINVAL);
  snprintf(want, sizeof want, "%s:4: max_frame_bytes: \"lots\" is not a size", path);
  ck_assert_msg(strstr(err, want) != NULL, "got: %s", err);
  unlink(path);

  write_conf("[mokd]\nfrobnicate = 1\n");
  ck_assert_int_eq(load(3, argv), MOK_EINVAL);
  snprintf(want, sizeof want, "%s:2: unknown option \"frobnicate\"", path);
  ck_assert_msg(strstr(err, want) != NULL, "got: %s", err);
  unlink(path);

  write_conf("[mokd]\nexecutor_threads = 0\n");
  ck_assert_int_eq(load(3, argv), MOK_EINVAL);
  ck_assert_msg(strstr(err, ":2: executor_threads: 0 is outside [1, 64]") != NULL, "got: %s",
                err);
  unlink(path);

  write_conf("[other]\nx = 1\n");
  ck_assert_int_eq(load(3, argv), MOK_EINVAL);
  ck_assert_msg(strstr(err, ":2: unknown section [other]") != NULL, "got: %s", err);
  unlink(path);
}
END_TEST

/* A tenant's weight is the list's entry for its key, else 1. */
START_TEST(tenant_weight_lookup)
{
  const char *list = "job:1234=4, uid:1000=2,job:12=7";
  char why[160];
  unsigned w;

  ck_assert_int_eq(mokd_config_weight(list, "job:1234", &w, why, sizeof why), 0);
  ck_assert_uint_eq(w, 4);
  ck_assert_int_eq(mokd_config_weight(list, "uid:1000", &w, why, sizeof why), 0);
  ck_assert_uint_eq(w, 2);
  ck_assert_int_eq(mokd_config_weight(list, "job:12", &w, why, sizeof why), 0);
  ck_assert_uint_eq(w, 7);
  ck_assert_int_eq(mokd_config_weight(list, "job:123", &w, why, sizeof why), 0);
  ck_assert_uint_eq(w, 1);
  ck_assert_int_eq(mokd_config_weight("", "uid:0", &w, why, sizeof why), 0);
  ck_assert_uint_eq(w, 1);
}
END_TEST

/* A tenant's quota is the list's entry for its key, else 0: no limit. */
START_TEST(tenant_quota_lookup)
{
  const char *list = "job:1234=64G, uid:1000=8G,job:12=4096";
  char why[160];
  uint64_t q;

  ck_assert_int_eq(mokd_config_tenant_quota(list, "job:1234", &q, why, sizeof why), 0);
  ck_assert_uint_eq(q, 64ull << 30);
  ck_assert_int_eq(mokd_config_tenant_quota(list, "uid:1000", &q, why, sizeof why), 0);
  ck_assert_uint_eq(q, 8ull << 30);
  ck_assert_int_eq(mokd_config_tenant_quota(list, "job:12", &q, why, sizeof why), 0);
  ck_assert_uint_eq(q, 4096);
  ck_assert_int_eq(mokd_config_tenant_quota(list, "job:123", &q, why, sizeof why), 0);
  ck_assert_uint_eq(q, 0);
}
END_TEST

/* Values checked only after every source was read lost their file:line. */
START_TEST(every_bad_value_names_its_line)
{
  static const struct {
    const char *text, *want;
  } cases[] = {
      {"[mokd]\nbackend = gpu\n", ":2: backend: \"gpu\" is "},
      {"[mokd]\n\nallow_uids = 0, bob\n", ":3: allow_uids: \"bob\" is not a number"},
      {"[mokd]\nallow_gids = -5\n", ":2: allow_gids: \"-5\" is not a number"},
      {"[mokd]\nallow_uids = 4294967295\n", ":2: allow_uids: 4294967295 is too large"},
      {"[mokd]\ndevices\n", ":2: syntax error"},
      {"[mokd]\ndevices = 0,x\n", ":2: devices: \"x\" is not a number; devices are CUDA "
                                   "ordinals"},
      {"[mokd]\ndevices = 1,0,1\n", ":2: devices: device 1 is named twice"},
      {"[mokd]\ntenant_weights = job:1=4,bob=2\n",
       ":2: tenant_weights: \"bob=2\" names no tenant; write job:ID=W or uid:N=W"},
      {"[mokd]\ntenant_weights = uid:1000\n", ":2: tenant_weights: \"uid:1000\" has no =WEIGHT"},
      {"[mokd]\ntenant_weights = uid:x=2\n", ":2: tenant_weights: \"uid:x=2\": a uid is a "
                                             "number"},
      {"[mokd]\ntenant_weights = job:a/b=2\n", ":2: tenant_weights: \"job:a/b=2\": a job id"},
      {"[mokd]\ntenant_weights = job:7=0\n", ":2: tenant_weights: \"job:7=0\": the weight is "
                                             "a whole number from 1 to 1000"},
      {"[mokd]\ntenant_weights = job:7=2x\n", ":2: tenant_weights: \"job:7=2x\": the weight"},
      {"[mokd]\ntenant_weights = job:7=2, uid:5=1, job:7=3\n",
       ":2: tenant_weights: \"job:7\" is named twice"},
      {"[mokd]\ntenant_quota_bytes = job:a=1G,job:b\n",
       ":2: tenant_quota_bytes: \"job:b\" has no =SIZE; write job:ID=SIZE or uid:N=SIZE"},
      {"[mokd]\ntenant_quota_bytes = gid:5=1G\n",
       ":2: tenant_quota_bytes: \"gid:5=1G\" names no tenant"},
      {"[mokd]\ntenant_quota_bytes = uid:x=1G\n",
       ":2: tenant_quota_bytes: \"uid:x=1G\": a uid is a number"},
      {"[mokd]\ntenant_quota_bytes = job:a=0\n",
       ":2: tenant_quota_bytes: \"job:a=0\": the quota is a size above 0"},
      {"[mokd]\ntenant_quota_bytes = job:a=12Q\n",
       ":2: tenant_quota_bytes: \"job:a=12Q\": the quota is a size above 0"},
      {"[mokd]\ntenant_quota_bytes = job:a=-1G\n",
       ":2: tenant_quota_bytes: \"job:a=-1G\": the quota is a size above 0"},
      {"[mokd]\ntenant_quota_bytes = job:a=1G, job:a=2G\n",
       ":2: tenant_quota_bytes: \"job:a\" is named twice"},
      {"# before the header\nlog_level = debug\n[mokd]\n",
       ":2: \"log_level\" comes before the [mokd] section header"},
  };
  char *argv[] = {"mokd", "--config", path};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char want[160];
    write_conf(cases[i].text);
    ck_assert_int_eq(load(3, argv), MOK_EINVAL);
    snprintf(want, sizeof want, "%s%s", path, cases[i].want);
    ck_assert_msg(strstr(err, want) != NULL, "case %zu: got: %s", i, err);
    unlink(path);
  }
  /* the same checks name the variable or the flag */
  char *argv2[] = {"mokd", "--config", "/dev/null", "--allow-gids", "staff"};
  ck_assert_int_eq(load(5, argv2), MOK_EINVAL);
  ck_assert_msg(strstr(err, "flag allow_gids: \"staff\" is not a number") != NULL, "got: %s",
                err);
  setenv("MOKD_BACKEND", "gpu", 1);
  ck_assert_int_eq(load(3, (char *[]){"mokd", "--config", "/dev/null"}), MOK_EINVAL);
  ck_assert_msg(strstr(err, "environment MOKD_BACKEND: backend: \"gpu\"") != NULL, "got: %s",
                err);
  unsetenv("MOKD_BACKEND");
  char *argv3[] = {"mokd", "--config", "/dev/null", "--allow-uids", "0, 1000,1001"};
  ck_assert_int_eq(load(5, argv3), MOKD_CONFIG_RUN);
}
END_TEST

START_TEST(bad_env_and_flags)
{
  char *argv[] = {"mokd", "--config", "/dev/null"};
  setenv("MOKD_DEBUG", "loud", 1);
  ck_assert_int_eq(load(3, argv), MOK_EINVAL);
  ck_assert_msg(strstr(err, "environment MOKD_DEBUG: log_level: \"loud\"") != NULL, "got: %s",
                err);
  unsetenv("MOKD_DEBUG");
  char *argv2[] = {"mokd", "--config", "/dev/null", "--no-such-thing"};
  ck_assert_int_eq(load(4, argv2), MOK_EINVAL);
  ck_assert_msg(strstr(err, "unknown argument \"--no-such-thing\"") != NULL, "got: %s", err);
  char *argv3[] = {"mokd", "--config", "/dev/null", "--backend", "tpu"};
  ck_assert_int_eq(load(5, argv3), MOK_EINVAL);
  ck_assert_msg(strstr(err, "flag backend: \"tpu\"") != NULL, "got: %s", err);
  char *argv4[] = {"mokd", "--config", "/nonexistent/mokd.conf"};
  ck_assert_int_eq(load(3, argv4), MOK_ENOENT);
  ck_assert_msg(strstr(err, "/nonexistent/mokd.conf: cannot open") != NULL, "got: %s", err);
  char *argv5[] = {"mokd", "--config", "/dev/null", "--socket"};
  ck_assert_int_eq(load(4, argv5), MOK_EINVAL);
  ck_assert_msg(strstr(err, "--socket needs a value") != NULL, "got: %s", err);
  char *argv6[] = {"mokd", "--config", "/dev/null", "--devices", "gpu0"};
  ck_assert_int_eq(load(5, argv6), MOK_EINVAL);
  ck_assert_msg(strstr(err, "flag devices: \"gpu0\" is not a number; devices are CUDA "
                            "ordinals") != NULL, "got: %s", err);
  char *argv7[] = {"mokd", "--config", "/dev/null", "--backend", "cuda", "--devices", "1,0"};
#ifdef MOKK_HAVE_CUDA
  ck_assert_int_eq(load(7, argv7), MOKD_CONFIG_RUN);
  ck_assert_str_eq(cfg.backend, "cuda");
  ck_assert_str_eq(cfg.devices, "1,0");
#else
  ck_assert_int_eq(load(7, argv7), MOK_EINVAL);
  ck_assert_msg(strstr(err, "not available in this build") != NULL, "got: %s", err);
#endif
}
END_TEST

START_TEST(sizes_levels_and_subsystems)
{
  char *argv[] = {"mokd", "--config", "/dev/null", "--max-arena-bytes", "3G",
                  "--log-subsys", "net,exec", "--log-level", "trace"};
  ck_assert_int_eq(load(9, argv), MOKD_CONFIG_RUN);
  ck_assert_int_eq(cfg.max_arena_bytes, 3ll << 30);
  ck_assert_int_eq(cfg.log_subsys, MOKD_SUB_NET | MOKD_SUB_EXEC);
  ck_assert_int_eq(cfg.log_level, MOKD_LOG_TRACE);
  ck_assert_int_eq(mokd_log_parse_subsys("^net"), MOKD_SUB_ALL & ~MOKD_SUB_NET);
  ck_assert_int_eq(mokd_log_parse_subsys("disk"), -1);
  char names[64];
  mokd_log_subsys_names(MOKD_SUB_NET | MOKD_SUB_EXEC, names, sizeof names);
  ck_assert_str_eq(names, "net,exec");
}
END_TEST

/* load() with what it prints on stdout kept in out, not in the test log */
static int load_quietly(int argc, char **argv, char *out, size_t n)
{
  FILE *f = tmpfile();
  int saved = dup(1), rc;
  size_t got;
  ck_assert_ptr_nonnull(f);
  fflush(stdout);
  dup2(fileno(f), 1);
  rc = load(argc, argv);
  fflush(stdout);
  dup2(saved, 1);
  close(saved);
  rewind(f);
  got = fread(out, 1, n - 1, f);
  out[got] = 0;
  fclose(f);
  return rc;
}

START_TEST(help_and_version_exit)
{
  char out[16384];
  char *argv[] = {"mokd", "--version"};
  ck_assert_int_eq(load_quietly(2, argv, out, sizeof out), MOKD_CONFIG_EXIT);
  ck_assert_str_eq(out, "mokd " MOKD_VERSION " (protocol 1 to 3)\n");
  char *argv2[] = {"mokd", "--help"};
  ck_assert_int_eq(load_quietly(2, argv2, out, sizeof out), MOKD_CONFIG_EXIT);
  ck_assert_msg(strncmp(out, "usage: mokd [options]\n", 22) == 0, "%.200s", out);
  ck_assert_ptr_nonnull(strstr(out, "--hello-timeout-ms"));
  ck_assert_ptr_nonnull(strstr(out, "MOKD_MAX_ARENAS"));
}
END_TEST

/* --print-config says which file it read, or that there was none */
START_TEST(print_config_names_its_file)
{
  char out[16384], want[192];
  char *argv[] = {"mokd", "--config", path, "--print-config"};
  write_conf("[mokd]\ncpu_threads = 3\n");
  ck_assert_int_eq(load_quietly(4, argv, out, sizeof out), MOKD_CONFIG_EXIT);
  snprintf(want, sizeof want, "effective configuration (config file: %s)\n[mokd]\n", path);
  ck_assert_msg(strstr(out, want) != NULL, "%.300s", out);
  ck_assert_ptr_nonnull(strstr(out, "\ncpu_threads = 3\n"));
  unlink(path);
  /* the default file, absent: said so, not named as if it had been read */
  if (access(MOKD_DEFAULT_CONFIG, F_OK) != 0) {
    char *argv2[] = {"mokd", "--print-config"};
    ck_assert_int_eq(load_quietly(2, argv2, out, sizeof out), MOKD_CONFIG_EXIT);
    ck_assert_msg(strstr(out, "(no config file: " MOKD_DEFAULT_CONFIG " does not exist)") !=
                      NULL, "%.300s", out);
  }
}
END_TEST

START_TEST(sighup_reload_reads_log_keys_only)
{
  char *argv[] = {"mokd", "--config", path};
  write_conf("[mokd]\nlog_level = warn\ncpu_threads = 2\n");
  ck_assert_int_eq(load(3, argv), MOKD_CONFIG_RUN);
  ck_assert_int_eq(cfg.log_level, MOKD_LOG_WARN);
  FILE *f = fopen(path, "w");
  fputs("[mokd]\nlog_level = debug\ncpu_threads = 9\n", f);
  fclose(f);
  ck_assert_int_eq(mokd_config_reload_log(&cfg, err, sizeof err), 0);
  ck_assert_int_eq(cfg.log_level, MOKD_LOG_DEBUG);
  ck_assert_int_eq(cfg.cpu_threads, 2);
  unlink(path);
}
END_TEST

/* Both tenant lists come back from the file, or neither does (a bad entry
 * names file and line); one given as a flag keeps the flag's value. */
START_TEST(sighup_reload_reads_tenant_keys)
{
  char *argv[] = {"mokd", "--config", path, "--log-level=debug"};
  write_conf("[mokd]\ntenant_weights = job:a=2\ntenant_quota_bytes = job:a=1G\n"
             "cpu_threads = 2\n");
  ck_assert_int_eq(load(4, argv), MOKD_CONFIG_RUN);
  FILE *f = fopen(path, "w");
  fputs("[mokd]\ntenant_weights = job:a=3,uid:7=5\ncpu_threads = 9\nlog_level = warn\n", f);
  fclose(f);
  ck_assert_int_eq(mokd_config_reload_tenants(&cfg, err, sizeof err), 0);
  ck_assert_str_eq(cfg.tenant_weights, "job:a=3,uid:7=5");
  ck_assert_str_eq(cfg.tenant_quota_bytes, ""); /* gone from the file: back to none */
  ck_assert_int_eq(cfg.cpu_threads, 2);
  ck_assert_int_eq(mokd_config_reload_log(&cfg, err, sizeof err), 0);
  ck_assert_int_eq(cfg.log_level, MOKD_LOG_DEBUG); /* the flag's */

  f = fopen(path, "w");
  fputs("[mokd]\ntenant_quota_bytes = job:b=1G\ntenant_weights = job:a=0\n", f);
  fclose(f);
  ck_assert_int_eq(mokd_config_reload_tenants(&cfg, err, sizeof err), MOK_EINVAL);
  ck_assert_msg(strstr(err, ":3: tenant_weights: \"job:a=0\": the weight is a whole number "
                       "from 1 to 1000") != NULL && strncmp(err, path, strlen(path)) == 0,
                "%s", err);
  ck_assert_str_eq(cfg.tenant_weights, "job:a=3,uid:7=5");
  ck_assert_str_eq(cfg.tenant_quota_bytes, "");
  unlink(path);

  char *argv2[] = {"mokd", "--config", path, "--tenant-weights=job:f=7"};
  write_conf("[mokd]\ntenant_weights = job:a=2\n");
  ck_assert_int_eq(load(4, argv2), MOKD_CONFIG_RUN);
  ck_assert_int_eq(mokd_config_reload_tenants(&cfg, err, sizeof err), 0);
  ck_assert_str_eq(cfg.tenant_weights, "job:f=7");
  unlink(path);
}
END_TEST

START_TEST(peer_text_is_escaped_for_the_log)
{
  char out[4 * 16 + 1];
  mokd_log_escape("a\"b\\c\nd\te\rf\x1b\x7f\xc3\xa9", 16, out);
  ck_assert_str_eq(out, "a\\\"b\\\\c\\nd\\te\\rf\\x1b\\x7f\\xc3\\xa9");
  mokd_log_escape("0123456789abcdefXYZ", 16, out); /* at most max bytes of input */
  ck_assert_str_eq(out, "0123456789abcdef");
  memset(out, 0x55, sizeof out);
  mokd_log_escape("\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01", 16, out);
  ck_assert_uint_eq(strlen(out), 4 * 16); /* the longest it gets, and terminated */
}
END_TEST

/* One log line written with stderr on fd, as mokd_log_set finds it. */
static void log_one_line_to(int fd)
{
  int saved = dup(2);
  dup2(fd, 2);
  mokd_log_set(MOKD_LOG_INFO, MOKD_SUB_ALL);
  LOG_INFO(INIT, "ready");
  dup2(saved, 2);
  close(saved);
  mokd_log_set(MOKD_LOG_INFO, MOKD_SUB_ALL);
}

START_TEST(terminal_lines_carry_a_timestamp)
{
  char line[256] = "";
  int y, mo, d, h, mi, sec, ms, off, n = 0;
  char sign;
  int master = posix_openpt(O_RDWR | O_NOCTTY), tty;
  ck_assert_int_ge(master, 0);
  ck_assert_int_eq(grantpt(master), 0);
  ck_assert_int_eq(unlockpt(master), 0);
  tty = open(ptsname(master), O_RDWR | O_NOCTTY);
  ck_assert_int_ge(tty, 0);
  log_one_line_to(tty);
  ck_assert_int_gt(read(master, line, sizeof line - 1), 0);
  ck_assert_msg(sscanf(line, "%4d-%2d-%2dT%2d:%2d:%2d.%3d%c%4d mokd info [init] ready%n", &y,
                       &mo, &d, &h, &mi, &sec, &ms, &sign, &off, &n) == 9 && n > 0 &&
                    (sign == '+' || sign == '-'),
                "terminal line: %s", line);
  close(tty);
  close(master);
  /* for journald: its priority prefix, and its own timestamps */
  int p[2];
  ck_assert_int_eq(pipe(p), 0);
  log_one_line_to(p[1]);
  memset(line, 0, sizeof line);
  ck_assert_int_gt(read(p[0], line, sizeof line - 1), 0);
  ck_assert_str_eq(line, "<6>mokd info [init] ready\n");
  close(p[0]);
  close(p[1]);
}
END_TEST

Suite *config_suite(void)
{
  Suite *s = suite_create("config");
  TCase *tc = tcase_create("sources");
  tcase_add_test(tc, defaults);
  tcase_add_test(tc, quota_as_a_share_of_ram);
  tcase_add_test(tc, precedence);
  tcase_add_test(tc, bad_file_names_file_and_line);
  tcase_add_test(tc, every_bad_value_names_its_line);
  tcase_add_test(tc, bad_env_and_flags);
  tcase_add_test(tc, sizes_levels_and_subsystems);
  tcase_add_test(tc, help_and_version_exit);
  tcase_add_test(tc, print_config_names_its_file);
  tcase_add_test(tc, tenant_weight_lookup);
  tcase_add_test(tc, tenant_quota_lookup);
  tcase_add_test(tc, sighup_reload_reads_log_keys_only);
  tcase_add_test(tc, sighup_reload_reads_tenant_keys);
  tcase_add_test(tc, peer_text_is_escaped_for_the_log);
  tcase_add_test(tc, terminal_lines_carry_a_timestamp);
  suite_add_tcase(s, tc);
  return s;
}
