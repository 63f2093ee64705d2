/* log.h - level x subsystem logging to stderr (journald adds the timestamps
 * and keeps the priority prefix; on a terminal, lines carry a local ISO 8601
 * timestamp with milliseconds instead). The macros test the level and subsystem before
 * anything is formatted. MOKD_DEBUG / MOKD_DEBUG_SUBSYS set them. */
#ifndef MOKD_LOG_H
#define MOKD_LOG_H

#include <stddef.h>

typedef enum {
  MOKD_LOG_ERROR = 0,
  MOKD_LOG_WARN,
  MOKD_LOG_INFO,
  MOKD_LOG_DEBUG,
  MOKD_LOG_TRACE
} mokd_log_level;

enum {
  MOKD_SUB_INIT = 1 << 0,
  MOKD_SUB_NET = 1 << 1,
  MOKD_SUB_SESS = 1 << 2,
  MOKD_SUB_EXEC = 1 << 3,
  MOKD_SUB_CONF = 1 << 4,
  MOKD_SUB_ALL = (1 << 5) - 1
};

extern int mokd_log_level_now;
extern unsigned mokd_log_subsys_now;

/* "error", "warn", ... or a number; returns the level or -1 */
int mokd_log_parse_level(const char *s);
/* comma list of init,net,sess,exec,conf,all (a leading ^ negates); -1 if bad */
long mokd_log_parse_subsys(const char *s);
const char *mokd_log_level_name(int level);
/* the mask as a list that mokd_log_parse_subsys reads back */
void mokd_log_subsys_names(unsigned mask, char *buf, size_t n);
/* Also looks again whether stderr is a terminal. */
void mokd_log_set(int level, unsigned subsys);
/* Text a peer chose, made safe to log: the first `max` bytes of in with
 * backslash, quote and every byte outside printable ASCII written as \\, \"
 * and \n, \t, \r or \xNN, so that it can neither end a line nor drive a
 * terminal. out holds at least 4 * max + 1 bytes. */
void mokd_log_escape(const char *in, size_t max, char *out);
void mokd_log_write(int level, unsigned sub, const char *file, int line, const char *fmt,
                    ...) __attribute__((format(printf, 5, 6)));

#define MOKD_LOG(level, sub, ...)                                                    \
  do {                                                                               \
    if ((level) <= mokd_log_level_now && ((sub) & mokd_log_subsys_now))              \
      mokd_log_write((level), (sub), __FILE__, __LINE__, __VA_ARGS__);               \
  } while (0)

#define LOG_ERROR(sub, ...) MOKD_LOG(MOKD_LOG_ERROR, MOKD_SUB_##sub, __VA_ARGS__)
#define LOG_WARN(sub, ...) MOKD_LOG(MOKD_LOG_WARN, MOKD_SUB_##sub, __VA_ARGS__)
#define LOG_INFO(sub, ...) MOKD_LOG(MOKD_LOG_INFO, MOKD_SUB_##sub, __VA_ARGS__)
#define LOG_DEBUG(sub, ...) MOKD_LOG(MOKD_LOG_DEBUG, MOKD_SUB_##sub, __VA_ARGS__)
#define LOG_TRACE(sub, ...) MOKD_LOG(MOKD_LOG_TRACE, MOKD_SUB_##sub, __VA_ARGS__)

#endif
