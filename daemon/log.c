/* log.c - see log.h. One write(2) per line so concurrent threads never
 * interleave within a line. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

int mokd_log_level_now = MOKD_LOG_INFO;
unsigned mokd_log_subsys_now = MOKD_SUB_ALL;
/* stderr is a terminal: lines get a timestamp (journald adds its own) and
 * no priority prefix (only journald reads it) */
static int to_tty;

static const char *const level_names[] = {"error", "warn", "info", "debug", "trace"};
/* sd-daemon(3) priority prefixes, read by journald */
static const char *const level_prio[] = {"<3>", "<4>", "<6>", "<7>", "<7>"};
static const struct {
  const char *name;
  unsigned bit;
} subsys[] = {{"init", MOKD_SUB_INIT}, {"net", MOKD_SUB_NET},   {"sess", MOKD_SUB_SESS},
              {"exec", MOKD_SUB_EXEC}, {"conf", MOKD_SUB_CONF}, {"all", MOKD_SUB_ALL}};

int mokd_log_parse_level(const char *s)
{
  for (int i = 0; i <= MOKD_LOG_TRACE; i++)
    if (strcasecmp(s, level_names[i]) == 0)
      return i;
  if (s[0] >= '0' && s[0] <= '4' && s[1] == 0)
    return s[0] - '0';
  return -1;
}

const char *mokd_log_level_name(int level)
{
  return level >= 0 && level <= MOKD_LOG_TRACE ? level_names[level] : "?";
}

long mokd_log_parse_subsys(const char *s)
{
  unsigned mask = 0;
  int negate = 0;
  char buf[256], *tok, *save;

  if (s[0] == '^')
    negate = 1, s++;
  if (strlen(s) >= sizeof buf)
    return -1;
  strcpy(buf, s);
  for (tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
    size_t i;
    for (i = 0; i < sizeof subsys / sizeof subsys[0]; i++)
      if (strcasecmp(tok, subsys[i].name) == 0)
        break;
    if (i == sizeof subsys / sizeof subsys[0])
      return -1;
    mask |= subsys[i].bit;
  }
  return negate ? (long)(MOKD_SUB_ALL & ~mask) : (long)mask;
}

void mokd_log_subsys_names(unsigned mask, char *buf, size_t n)
{
  size_t at = 0;
  buf[0] = 0;
  if ((mask & MOKD_SUB_ALL) == MOKD_SUB_ALL) {
    snprintf(buf, n, "all");
    return;
  }
  if ((mask & MOKD_SUB_ALL) == 0) {
    snprintf(buf, n, "^all");
    return;
  }
  for (size_t i = 0; i + 1 < sizeof subsys / sizeof subsys[0]; i++)
    if ((mask & subsys[i].bit) && at < n)
      at += (size_t)snprintf(buf + at, n - at, "%s%s", at ? "," : "", subsys[i].name);
}

void mokd_log_set(int level, unsigned sub)
{
  mokd_log_level_now = level;
  mokd_log_subsys_now = sub;
  to_tty = isatty(STDERR_FILENO);
}

void mokd_log_escape(const char *in, size_t max, char *out)
{
  static const char hex[] = "0123456789abcdef";
  for (size_t i = 0; i < max && in[i] != 0; i++) {
    unsigned char c = (unsigned char)in[i];
    if (c == '\\' || c == '"') {
      *out++ = '\\', *out++ = (char)c;
    } else if (c == '\n' || c == '\t' || c == '\r') {
      *out++ = '\\', *out++ = c == '\n' ? 'n' : c == '\t' ? 't' : 'r';
    } else if (c < 0x20 || c > 0x7e) {
      *out++ = '\\', *out++ = 'x', *out++ = hex[c >> 4], *out++ = hex[c & 15];
    } else {
      *out++ = (char)c;
    }
  }
  *out = 0;
}

static const char *sub_name(unsigned sub)
{
  for (size_t i = 0; i < sizeof subsys / sizeof subsys[0]; i++)
    if (subsys[i].bit == sub)
      return subsys[i].name;
  return "?";
}

void mokd_log_write(int level, unsigned sub, const char *file, int line, const char *fmt,
                    ...)
{
  char msg[1024];
  int n;
  va_list ap;

  if (to_tty) {
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    localtime_r(&ts.tv_sec, &tm);
    /* ISO 8601, local time with its offset: 2026-01-31T09:15:02.118+0100 */
    n = (int)strftime(msg, sizeof msg, "%Y-%m-%dT%H:%M:%S", &tm);
    n += snprintf(msg + n, sizeof msg - (size_t)n, ".%03ld", ts.tv_nsec / 1000000);
    n += (int)strftime(msg + n, sizeof msg - (size_t)n, "%z", &tm);
    n += snprintf(msg + n, sizeof msg - (size_t)n, " mokd %s [%s] ", level_names[level],
                  sub_name(sub));
  } else {
    n = snprintf(msg, sizeof msg, "%smokd %s [%s] ", level_prio[level], level_names[level],
                 sub_name(sub));
  }
  if (level >= MOKD_LOG_DEBUG)
    n += snprintf(msg + n, sizeof msg - (size_t)n, "%s:%d: ", file, line);
  va_start(ap, fmt);
  n += vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof msg - 2)
    n = (int)sizeof msg - 2;
  msg[n++] = '\n';
  if (write(STDERR_FILENO, msg, (size_t)n) < 0)
    return; /* nowhere left to report it */
}
