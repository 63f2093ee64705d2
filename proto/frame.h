/* frame.h - the wire's framing: a 4-byte little-endian length, then the packed
 * envelope. The framer is a pure function from bytes to frames, so partial
 * reads, several frames in one read and bad prefixes are testable without a
 * socket. Shared by the daemon and libmok. */
#ifndef MOKW_FRAME_H
#define MOKW_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#define MOKW_PREFIX 4
/* A cudaIpcEventHandle_t or cudaIpcMemHandle_t on the wire. */
#define MOKW_IPC_BYTES 64

typedef struct mokw_framer {
  uint8_t *buf;
  size_t start, len, cap; /* unread bytes are buf[start .. start + len) */
  size_t max_frame;
  uint64_t offset; /* stream offset of buf[start] */
} mokw_framer;

void mokw_framer_init(mokw_framer *f, size_t max_frame);
void mokw_framer_free(mokw_framer *f);
/* Room for at least `want` more bytes; returns where to write, or NULL (ENOMEM). */
uint8_t *mokw_framer_space(mokw_framer *f, size_t want, size_t *avail);
void mokw_framer_commit(mokw_framer *f, size_t n);
int mokw_framer_push(mokw_framer *f, const void *data, size_t n);
/* 1 and the payload when a whole frame is buffered (valid until the next
 * call), 0 when more bytes are needed, MOK_EMSGSIZE for a prefix over the
 * maximum, MOK_EPROTO for a zero-length frame (which is consumed). *at is the
 * stream offset of the frame's first prefix byte. */
int mokw_framer_next(mokw_framer *f, const uint8_t **payload, size_t *len, uint64_t *at);
/* Stream offset just past the buffered bytes. */
uint64_t mokw_framer_end(const mokw_framer *f);

/* Packs msg behind a length prefix into a new buffer (free with free()). */
int mokw_pack(const ProtobufCMessage *msg, uint8_t **out, size_t *len);
/* 1 and the number of the first unknown field in msg or any message below it,
 * or 0 when there is none. protobuf-c keeps a field numbered 0 (sent as the
 * two-byte key 0x80 0x00) as an unknown field, so 0 is a number like any other. */
int mokw_find_unknown_field(const ProtobufCMessage *msg, uint32_t *number);

#endif
