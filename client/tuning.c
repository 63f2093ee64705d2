/* tuning.c - a layer's kernel options as text: "tiles=tall,order=static",
 * the form mokctl's --tuning, bench_gpu's and the Python client take, read
 * and written by one table so that the three cannot drift apart. */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mok.h"

/* The names of one enum field's values, index = value; NULL: not accepted. */
typedef struct choice_field {
  const char *key;
  size_t offset;
  const char *names[MOK_TAILS_COUNT + 1];
} choice_field;

#define FIELD(f) offsetof(mok_layer_tuning, f)
static const choice_field fields[] = {
    {"tiles", FIELD(tiles), {"auto", "wide", "tall", "pingpong"}},
    {"wgrad_tiles", FIELD(wgrad_tiles), {"auto", "wide", NULL, "pingpong"}},
    {"clusters", FIELD(clusters), {"auto", "none", "dgrad", "all"}},
    {"order", FIELD(order), {"auto", "dynamic", "static"}},
    {"tails", FIELD(tails), {"auto", "own", "ride", "split", "whole"}},
    {"dx", FIELD(dx), {"auto", "halves", "whole"}},
};
#undef FIELD
#define NFIELDS (sizeof fields / sizeof fields[0])
#define MAX_NAMES (sizeof fields[0].names / sizeof fields[0].names[0])

static int bad(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(char *err, const char *fmt, ...)
{
  if (err != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, MOK_ERRLEN, fmt, ap);
    va_end(ap);
  }
  return MOK_EINVAL;
}

/* "a|b|c" of a field's names, for messages */
static void names_of(const choice_field *f, char *out, size_t n)
{
  size_t len = 0;
  out[0] = '\0';
  for (size_t i = 0; i < MAX_NAMES; i++)
    if (f->names[i] != NULL)
      len += (size_t)snprintf(out + (len < n ? len : n), len < n ? n - len : 0, "%s%s",
                              len ? "|" : "", f->names[i]);
}

static int item(mok_layer_tuning *t, const char *key, size_t klen, const char *val, char *err)
{
  if (klen == 8 && strncmp(key, "dispatch", 8) == 0) {
    char *end;
    long v;
    if (strcmp(val, "auto") == 0) {
      t->dispatch_blocks = 0;
      return 0;
    }
    if (strcmp(val, "before") == 0) {
      t->dispatch_blocks = MOK_DISPATCH_BEFORE;
      return 0;
    }
    if (strcmp(val, "gather") == 0) {
      t->dispatch_blocks = MOK_DISPATCH_GATHER;
      return 0;
    }
    errno = 0;
    v = strtol(val, &end, 10);
    if (*val == '\0' || *end != '\0' || errno != 0 || v < 1 || v > MOK_DISPATCH_BLOCKS_MAX)
      return bad(err, "tuning: dispatch=%s is not auto, before, gather or a number of blocks "
                 "from 1 to %d", val, MOK_DISPATCH_BLOCKS_MAX);
    t->dispatch_blocks = (int32_t)v;
    return 0;
  }
  for (size_t i = 0; i < NFIELDS; i++) {
    const choice_field *f = &fields[i];
    if (strlen(f->key) != klen || strncmp(key, f->key, klen) != 0)
      continue;
    for (size_t v = 0; v < MAX_NAMES; v++)
      if (f->names[v] != NULL && strcmp(val, f->names[v]) == 0) {
        *(int *)((char *)t + f->offset) = (int)v;
        return 0;
      }
    char all[96];
    names_of(f, all, sizeof all);
    return bad(err, "tuning: %s=%s is not one of %s", f->key, val, all);
  }
  return bad(err, "tuning: \"%.*s\" is not an option (tiles, wgrad_tiles, clusters, order, "
             "tails, dx, dispatch)", (int)klen, key);
}

int mok_layer_tuning_parse(mok_layer_tuning *t, const char *text, char *err)
{
  char val[32];
  if (t == NULL)
    return MOK_ENULL;
  memset(t, 0, sizeof *t);
  if (text == NULL)
    return 0;
  for (const char *p = text; *p != '\0';) {
    size_t n = strcspn(p, ", \t\n");
    if (n == 0) {
      p++;
      continue;
    }
    const char *eq = memchr(p, '=', n);
    if (eq == NULL || eq == p)
      return bad(err, "tuning: \"%.*s\" is not key=value", (int)n, p);
    size_t vlen = (size_t)(p + n - eq - 1);
    if (vlen == 0 || vlen >= sizeof val)
      return bad(err, "tuning: \"%.*s\" has %s value", (int)n, p, vlen ? "too long a" : "no");
    memcpy(val, eq + 1, vlen);
    val[vlen] = '\0';
    int rc = item(t, p, (size_t)(eq - p), val, err);
    if (rc) {
      memset(t, 0, sizeof *t);
      return rc;
    }
    p += n;
  }
  return 0;
}

int mok_layer_tuning_format(const mok_layer_tuning *t, char *buf, size_t n)
{
  size_t len = 0;
  char none;
  if (t == NULL || (buf == NULL && n > 0))
    return MOK_ENULL;
  if (n == 0) /* measuring: snprintf writes nothing, and buf may be NULL */
    buf = &none;
  else
    buf[0] = '\0';
  for (size_t i = 0; i < NFIELDS; i++) {
    const choice_field *f = &fields[i];
    int v = *(const int *)((const char *)t + f->offset);
    if (v < 0 || (size_t)v >= MAX_NAMES || f->names[v] == NULL)
      return MOK_EINVAL;
    if (v == 0)
      continue;
    len += (size_t)snprintf(buf + (len < n ? len : n), len < n ? n - len : 0, "%s%s=%s",
                            len ? "," : "", f->key, f->names[v]);
  }
  if (t->dispatch_blocks < MOK_DISPATCH_GATHER || t->dispatch_blocks > MOK_DISPATCH_BLOCKS_MAX)
    return MOK_EINVAL;
  if (t->dispatch_blocks < 0)
    len += (size_t)snprintf(buf + (len < n ? len : n), len < n ? n - len : 0, "%sdispatch=%s",
                            len ? "," : "",
                            t->dispatch_blocks == MOK_DISPATCH_BEFORE ? "before" : "gather");
  else if (t->dispatch_blocks > 0)
    len += (size_t)snprintf(buf + (len < n ? len : n), len < n ? n - len : 0, "%sdispatch=%d",
                            len ? "," : "", (int)t->dispatch_blocks);
  return (int)len;
}
