/* gpuid.c - see gpuid.h. */
#include "gpuid.h"

#include <stdio.h>
#include <string.h>

#include "mok_errno.h"

/* Where the dashes go in the text after the prefix: 8-4-4-4-12 digits. */
static int dash_before(int byte)
{
  return byte == 4 || byte == 6 || byte == 8 || byte == 10;
}

void mokw_uuid_format(const uint8_t uuid[MOKW_UUID_BYTES], char out[MOKW_UUID_STRLEN])
{
  char *p = out + 4;
  memcpy(out, "GPU-", 4);
  for (int i = 0; i < MOKW_UUID_BYTES; i++) {
    if (dash_before(i))
      *p++ = '-';
    p += sprintf(p, "%02x", uuid[i]);
  }
}

static int hex(char c)
{
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

int mokw_uuid_parse(const char *s, uint8_t uuid[MOKW_UUID_BYTES])
{
  uint8_t v[MOKW_UUID_BYTES];
  if (s == NULL)
    return MOK_EINVAL;
  if (strncmp(s, "GPU-", 4) == 0 || strncmp(s, "MIG-", 4) == 0)
    s += 4;
  for (int i = 0; i < MOKW_UUID_BYTES; i++) {
    int hi, lo;
    if (dash_before(i) && *s++ != '-')
      return MOK_EINVAL;
    if ((hi = hex(s[0])) < 0 || (lo = hex(s[1])) < 0)
      return MOK_EINVAL;
    v[i] = (uint8_t)(hi << 4 | lo);
    s += 2;
  }
  if (*s != 0)
    return MOK_EINVAL;
  memcpy(uuid, v, sizeof v);
  return 0;
}

int mokw_uuid_find(const uint8_t (*uuids)[MOKW_UUID_BYTES], int n,
                   const uint8_t uuid[MOKW_UUID_BYTES])
{
  for (int i = 0; i < n; i++)
    if (memcmp(uuids[i], uuid, MOKW_UUID_BYTES) == 0)
      return i;
  return -1;
}
