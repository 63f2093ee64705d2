/* fuzz_frame.c - libFuzzer harness for the wire decoder: the framer, the
 * protobuf-c unpack of both envelopes and the unknown-field scan, exactly the
 * path every byte from a peer takes. `make fuzz` builds and runs it.
 *
 * Input: byte 0 picks the read size (1..64 bytes per push), byte 1 the frame
 * cap (64 << (b % 12) bytes); the rest is the stream. Checked besides memory
 * safety: frame offsets add up, an oversize prefix stops the stream, and a
 * message without unknown fields (the only kind the daemon acts on) packs
 * back to bytes that unpack and pack to themselves. Messages with unknown
 * fields are not repacked: protobuf-c writes field 0 with the one-byte key
 * that its own unpack refuses. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "mok_errno.h"
#include "proto/mokd.pb-c.h"

#define REQUIRE(cond)                                                          \
  do {                                                                         \
    if (!(cond))                                                               \
      abort();                                                                 \
  } while (0)

static int has_unknown_field(const ProtobufCMessage *m)
{
  uint32_t number;
  return mokw_find_unknown_field(m, &number);
}

/* pack(m) must unpack again, and that message must pack to the same bytes */
static void repack_is_stable(const ProtobufCMessage *m, const ProtobufCMessageDescriptor *d)
{
  uint8_t *a, *b;
  size_t alen, blen;
  ProtobufCMessage *again;

  REQUIRE(mokw_pack(m, &a, &alen) == 0);
  again = protobuf_c_message_unpack(d, NULL, alen - MOKW_PREFIX, a + MOKW_PREFIX);
  REQUIRE(again != NULL);
  REQUIRE(!has_unknown_field(again));
  REQUIRE(mokw_pack(again, &b, &blen) == 0);
  REQUIRE(alen == blen && memcmp(a, b, alen) == 0);
  protobuf_c_message_free_unpacked(again, NULL);
  free(a);
  free(b);
}

static void decode(const uint8_t *p, size_t n)
{
  const ProtobufCMessageDescriptor *ds[2] = {&mokd__request__descriptor,
                                             &mokd__response__descriptor};
  for (int i = 0; i < 2; i++) {
    ProtobufCMessage *m = protobuf_c_message_unpack(ds[i], NULL, n, p);
    if (m == NULL)
      continue;
    if (!has_unknown_field(m))
      repack_is_stable(m, ds[i]);
    protobuf_c_message_free_unpacked(m, NULL);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  mokw_framer f;
  size_t step, at = 2, consumed = 0;
  int stop = 0;

  if (size < 2)
    return 0;
  step = 1 + data[0] % 64;
  mokw_framer_init(&f, (size_t)64 << (data[1] % 12));
  while (at < size && !stop) {
    size_t n = size - at < step ? size - at : step, avail;
    /* alternate both ways of filling the framer */
    if ((at / step) % 2 == 0) {
      REQUIRE(mokw_framer_push(&f, data + at, n) == 0);
    } else {
      uint8_t *dst = mokw_framer_space(&f, n, &avail);
      REQUIRE(dst != NULL && avail >= n);
      memcpy(dst, data + at, n);
      mokw_framer_commit(&f, n);
    }
    at += n;
    REQUIRE(mokw_framer_end(&f) == at - 2);
    for (;;) {
      const uint8_t *payload;
      size_t len;
      uint64_t off;
      int rc = mokw_framer_next(&f, &payload, &len, &off);
      if (rc == 0)
        break;
      REQUIRE(off == consumed);
      if (rc == MOK_EMSGSIZE) { /* the daemon hangs up here */
        stop = 1;
        break;
      }
      if (rc == MOK_EPROTO) { /* a zero-length frame, consumed */
        consumed += MOKW_PREFIX;
        continue;
      }
      REQUIRE(rc == 1 && len > 0 && len <= f.max_frame);
      consumed += MOKW_PREFIX + len;
      decode(payload, len);
    }
  }
  mokw_framer_free(&f);
  return 0;
}
