/* frame.c - see frame.h. */
#include "frame.h"

#include <stdlib.h>
#include <string.h>

#include "mok_errno.h"

void mokw_framer_init(mokw_framer *f, size_t max_frame)
{
  memset(f, 0, sizeof *f);
  f->max_frame = max_frame;
}

void mokw_framer_free(mokw_framer *f)
{
  free(f->buf);
  memset(f, 0, sizeof *f);
}

uint8_t *mokw_framer_space(mokw_framer *f, size_t want, size_t *avail)
{
  if (f->start > 0 && f->start + f->len + want > f->cap) {
    memmove(f->buf, f->buf + f->start, f->len);
    f->start = 0;
  }
  if (f->start + f->len + want > f->cap) {
    size_t cap = f->cap ? f->cap : 4096;
    while (cap < f->len + want)
      cap *= 2;
    uint8_t *b = realloc(f->buf, cap);
    if (b == NULL)
      return NULL;
    f->buf = b;
    f->cap = cap;
  }
  *avail = f->cap - f->start - f->len;
  return f->buf + f->start + f->len;
}

void mokw_framer_commit(mokw_framer *f, size_t n)
{
  f->len += n;
}

int mokw_framer_push(mokw_framer *f, const void *data, size_t n)
{
  size_t avail;
  uint8_t *p = mokw_framer_space(f, n, &avail);
  if (p == NULL)
    return MOK_ENOMEM;
  memcpy(p, data, n);
  mokw_framer_commit(f, n);
  return 0;
}

int mokw_framer_next(mokw_framer *f, const uint8_t **payload, size_t *len, uint64_t *at)
{
  const uint8_t *p = f->buf + f->start;
  uint32_t n;

  if (f->len < MOKW_PREFIX)
    return 0;
  n = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
  if (at != NULL)
    *at = f->offset;
  if (n > f->max_frame)
    return MOK_EMSGSIZE;
  if (n == 0) {
    f->start += MOKW_PREFIX, f->len -= MOKW_PREFIX, f->offset += MOKW_PREFIX;
    return MOK_EPROTO;
  }
  if (f->len < MOKW_PREFIX + (size_t)n)
    return 0;
  *payload = p + MOKW_PREFIX;
  *len = n;
  f->start += MOKW_PREFIX + n, f->len -= MOKW_PREFIX + n;
  f->offset += MOKW_PREFIX + n;
  if (f->len == 0)
    f->start = 0; /* the payload stays readable: nothing is written before the next call */
  return 1;
}

uint64_t mokw_framer_end(const mokw_framer *f)
{
  return f->offset + f->len;
}

int mokw_pack(const ProtobufCMessage *msg, uint8_t **out, size_t *len)
{
  size_t n = protobuf_c_message_get_packed_size(msg);
  uint8_t *b;

  if (n > UINT32_MAX)
    return MOK_EMSGSIZE;
  b = malloc(MOKW_PREFIX + n);
  if (b == NULL)
    return MOK_ENOMEM;
  b[0] = (uint8_t)n, b[1] = (uint8_t)(n >> 8), b[2] = (uint8_t)(n >> 16);
  b[3] = (uint8_t)(n >> 24);
  protobuf_c_message_pack(msg, b + MOKW_PREFIX);
  *out = b;
  *len = MOKW_PREFIX + n;
  return 0;
}

int mokw_find_unknown_field(const ProtobufCMessage *msg, uint32_t *number)
{
  const ProtobufCMessageDescriptor *d;

  if (msg == NULL)
    return 0;
  if (msg->n_unknown_fields > 0) {
    *number = msg->unknown_fields[0].tag;
    return 1;
  }
  d = msg->descriptor;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *fd = &d->fields[i];
    const char *base = (const char *)msg;
    if (fd->type != PROTOBUF_C_TYPE_MESSAGE)
      continue;
    if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(const size_t *)(base + fd->quantifier_offset);
      ProtobufCMessage *const *v = *(ProtobufCMessage *const *const *)(base + fd->offset);
      for (size_t j = 0; j < n; j++)
        if (mokw_find_unknown_field(v[j], number))
          return 1;
    } else {
      if (fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
        uint32_t which = *(const uint32_t *)(base + fd->quantifier_offset);
        if (which != fd->id)
          continue;
      }
      if (mokw_find_unknown_field(*(ProtobufCMessage *const *)(base + fd->offset), number))
        return 1;
    }
  }
  return 0;
}
