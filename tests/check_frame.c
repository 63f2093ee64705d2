/* check_frame.c - framing as a pure function of bytes, and protocol round
 * trips through protobuf-c, unknown fields included. */
#include <stdlib.h>

#include "frame.h"
#include "proto/mokd.pb-c.h"
#include "ref.h"

static size_t make_frame(uint8_t *buf, const char *payload, uint32_t n)
{
  buf[0] = (uint8_t)n, buf[1] = (uint8_t)(n >> 8), buf[2] = (uint8_t)(n >> 16);
  buf[3] = (uint8_t)(n >> 24);
  memcpy(buf + 4, payload, n);
  return 4 + n;
}

START_TEST(partial_reads)
{
  mokw_framer f;
  uint8_t buf[64];
  const uint8_t *p;
  size_t len, n = make_frame(buf, "hello, mokd", 11);
  uint64_t at;

  mokw_framer_init(&f, 1024);
  for (size_t i = 0; i + 1 < n; i++) {
    ck_assert_int_eq(mokw_framer_push(&f, buf + i, 1), 0);
    ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), 0);
  }
  ck_assert_int_eq(mokw_framer_push(&f, buf + n - 1, 1), 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), 1);
  ck_assert_uint_eq(len, 11);
  ck_assert_uint_eq(at, 0);
  ck_assert(memcmp(p, "hello, mokd", 11) == 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), 0);
  ck_assert_uint_eq(mokw_framer_end(&f), n);
  mokw_framer_free(&f);
}
END_TEST

START_TEST(two_frames_in_one_read)
{
  mokw_framer f;
  uint8_t buf[64];
  const uint8_t *p;
  size_t len, n = make_frame(buf, "abc", 3);
  uint64_t at;

  n += make_frame(buf + n, "defgh", 5);
  n += make_frame(buf + n, "ij", 2) - 1; /* and the start of a third */
  mokw_framer_init(&f, 1024);
  ck_assert_int_eq(mokw_framer_push(&f, buf, n), 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), 1);
  ck_assert(len == 3 && memcmp(p, "abc", 3) == 0 && at == 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), 1);
  ck_assert(len == 5 && memcmp(p, "defgh", 5) == 0 && at == 7);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), 0);
  ck_assert_int_eq(mokw_framer_push(&f, "j", 1), 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), 1);
  ck_assert(len == 2 && memcmp(p, "ij", 2) == 0 && at == 16);
  mokw_framer_free(&f);
}
END_TEST

START_TEST(oversize_prefix)
{
  mokw_framer f;
  const uint8_t *p;
  size_t len;
  uint8_t big[4] = {0x01, 0x04, 0x00, 0x00}; /* 1025 > 1024 */
  uint8_t huge[4] = {0xff, 0xff, 0xff, 0xff};

  mokw_framer_init(&f, 1024);
  ck_assert_int_eq(mokw_framer_push(&f, big, 4), 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, NULL), MOK_EMSGSIZE);
  mokw_framer_free(&f);
  mokw_framer_init(&f, 1024);
  ck_assert_int_eq(mokw_framer_push(&f, huge, 4), 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, NULL), MOK_EMSGSIZE);
  mokw_framer_free(&f);
}
END_TEST

START_TEST(zero_length_frame)
{
  mokw_framer f;
  uint8_t buf[32] = {0, 0, 0, 0};
  const uint8_t *p;
  size_t len;
  uint64_t at;
  size_t n = 4 + make_frame(buf + 4, "ok", 2);

  mokw_framer_init(&f, 1024);
  ck_assert_int_eq(mokw_framer_push(&f, buf, n), 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), MOK_EPROTO);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &len, &at), 1); /* framing stays in step */
  ck_assert(len == 2 && memcmp(p, "ok", 2) == 0 && at == 4);
  mokw_framer_free(&f);
}
END_TEST

static Mokd__Request *round_trip(const Mokd__Request *in)
{
  uint8_t *buf;
  size_t len;
  mokw_framer f;
  const uint8_t *p;
  size_t plen;
  Mokd__Request *out;

  ck_assert_int_eq(mokw_pack(&in->base, &buf, &len), 0);
  mokw_framer_init(&f, 1 << 20);
  ck_assert_int_eq(mokw_framer_push(&f, buf, len), 0);
  ck_assert_int_eq(mokw_framer_next(&f, &p, &plen, NULL), 1);
  out = mokd__request__unpack(NULL, plen, p);
  ck_assert_ptr_nonnull(out);
  mokw_framer_free(&f);
  free(buf);
  return out;
}

START_TEST(forward_and_backward_round_trip)
{
  Mokd__Request req = MOKD__REQUEST__INIT, *out;
  Mokd__Forward fw = MOKD__FORWARD__INIT;
  Mokd__TensorRef x = MOKD__TENSOR_REF__INIT, ids = MOKD__TENSOR_REF__INIT;
  int64_t sx[2] = {2048, 7168}, si[2] = {2048, 8};

  x.arena = 5, x.offset = 4096, x.dtype = MOKD__DTYPE__DTYPE_BF16, x.n_shape = 2, x.shape = sx;
  ids.arena = 6, ids.dtype = MOKD__DTYPE__DTYPE_I32, ids.n_shape = 2, ids.shape = si;
  fw.layer = 77, fw.x = &x, fw.topk_ids = &ids, fw.topk_weights = &ids, fw.inference = 1;
  req.id = 123456789012ull;
  req.body_case = MOKD__REQUEST__BODY_FORWARD;
  req.forward = &fw;
  out = round_trip(&req);
  ck_assert_uint_eq(out->id, 123456789012ull);
  ck_assert_int_eq(out->body_case, MOKD__REQUEST__BODY_FORWARD);
  ck_assert_uint_eq(out->forward->layer, 77);
  ck_assert(out->forward->inference);
  ck_assert_uint_eq(out->forward->x->arena, 5);
  ck_assert_uint_eq(out->forward->x->offset, 4096);
  ck_assert_int_eq(out->forward->x->dtype, MOKD__DTYPE__DTYPE_BF16);
  ck_assert_uint_eq(out->forward->x->n_shape, 2);
  ck_assert_int_eq(out->forward->x->shape[1], 7168);
  ck_assert_int_eq(out->forward->topk_ids->shape[1], 8);
  uint32_t number;
  ck_assert_int_eq(mokw_find_unknown_field(&out->base, &number), 0);
  mokd__request__free_unpacked(out, NULL);

  Mokd__Backward bw = MOKD__BACKWARD__INIT;
  Mokd__TensorRef *g[2] = {&x, &ids};
  bw.context = 9, bw.d_out = &x, bw.n_grads = 2, bw.grads = g;
  req.body_case = MOKD__REQUEST__BODY_BACKWARD;
  req.backward = &bw;
  out = round_trip(&req);
  ck_assert_uint_eq(out->backward->context, 9);
  ck_assert_uint_eq(out->backward->n_grads, 2);
  ck_assert_uint_eq(out->backward->grads[1]->arena, 6);
  mokd__request__free_unpacked(out, NULL);
}
END_TEST

START_TEST(layer_and_response_round_trip)
{
  Mokd__Request req = MOKD__REQUEST__INIT, *out;
  Mokd__CreateLayer cl = MOKD__CREATE_LAYER__INIT;
  Mokd__EpGroup ep = MOKD__EP_GROUP__INIT;

  cl.hidden = 7168, cl.intermediate = 2048, cl.experts = 256, cl.top_k = 8;
  cl.shared_intermediate = 2048, cl.swiglu_limit = 7.0f;
  cl.grad_mode = MOKD__GRAD_MODE__GRAD_FP32_ACCUM;
  ep.id = 3, ep.size = 8, ep.rank = 5;
  cl.ep = &ep;
  req.body_case = MOKD__REQUEST__BODY_CREATE_LAYER;
  req.create_layer = &cl;
  out = round_trip(&req);
  ck_assert_uint_eq(out->create_layer->experts, 256);
  ck_assert(out->create_layer->swiglu_limit == 7.0f);
  ck_assert_int_eq(out->create_layer->grad_mode, MOKD__GRAD_MODE__GRAD_FP32_ACCUM);
  ck_assert_uint_eq(out->create_layer->ep->rank, 5);
  mokd__request__free_unpacked(out, NULL);

  Mokd__Response r = MOKD__RESPONSE__INIT, *ro;
  Mokd__NewArena na = MOKD__NEW_ARENA__INIT, *nap = &na;
  Mokd__ForwardDone fd = MOKD__FORWARD_DONE__INIT;
  uint8_t *buf;
  size_t len;
  na.arena = 11, na.bytes = 1 << 26;
  r.id = 4, r.status = MOK_EEXPERT, r.message = "expert id 9 out of range";
  r.n_new_arenas = 1, r.new_arenas = &nap;
  fd.context = 12;
  r.body_case = MOKD__RESPONSE__BODY_FORWARD_DONE, r.forward_done = &fd;
  ck_assert_int_eq(mokw_pack(&r.base, &buf, &len), 0);
  ro = mokd__response__unpack(NULL, len - 4, buf + 4);
  ck_assert_ptr_nonnull(ro);
  ck_assert_int_eq(ro->status, MOK_EEXPERT); /* sint32 keeps negative codes small */
  ck_assert_str_eq(ro->message, "expert id 9 out of range");
  ck_assert_uint_eq(ro->new_arenas[0]->bytes, 1 << 26);
  ck_assert_uint_eq(ro->forward_done->context, 12);
  mokd__response__free_unpacked(ro, NULL);
  free(buf);
}
END_TEST

START_TEST(unknown_fields_are_found)
{
  /* Request{id=1, ping{nonce=2}} with an unknown field 99 at the top, then
   * one inside the ping */
  static const uint8_t top[] = {0x08, 0x01, 0xaa, 0x01, 0x02, 0x08, 0x02, 0x98, 0x06, 0x07};
  static const uint8_t nested[] = {0x08, 0x01, 0xaa, 0x01, 0x05, 0x08, 0x02, 0xb8, 0x02, 0x01};
  Mokd__Request *r = mokd__request__unpack(NULL, sizeof top, top);
  uint32_t number = 0;
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(r->body_case, MOKD__REQUEST__BODY_PING);
  ck_assert_int_eq(mokw_find_unknown_field(&r->base, &number), 1);
  ck_assert_uint_eq(number, 99);
  mokd__request__free_unpacked(r, NULL);
  r = mokd__request__unpack(NULL, sizeof nested, nested);
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(mokw_find_unknown_field(&r->base, &number), 1);
  ck_assert_uint_eq(number, 39);
  mokd__request__free_unpacked(r, NULL);
}
END_TEST

START_TEST(unknown_field_zero_is_found)
{
  /* protobuf-c refuses a one-byte key of field 0 but keeps the two-byte key
   * 0x80 0x00 as an unknown field numbered 0: at the top it must not read as
   * "none", nor hide the unknown field 99 behind it; inside the ping it must
   * not be skipped */
  static const uint8_t top[] = {0x80, 0x00, 0x05, 0x08, 0x01, 0xaa, 0x01, 0x02, 0x08, 0x02};
  static const uint8_t before_99[] = {0x80, 0x00, 0x05, 0x98, 0x06, 0x07, 0x08, 0x01};
  static const uint8_t nested[] = {0x08, 0x01, 0xaa, 0x01, 0x05, 0x08, 0x02, 0x80, 0x00, 0x01};
  const uint8_t *cases[] = {top, before_99, nested};
  size_t lens[] = {sizeof top, sizeof before_99, sizeof nested};
  uint32_t number;

  for (int i = 0; i < 3; i++) {
    Mokd__Request *r = mokd__request__unpack(NULL, lens[i], cases[i]);
    ck_assert_msg(r != NULL, "case %d does not parse", i);
    number = 12345;
    ck_assert_int_eq(mokw_find_unknown_field(&r->base, &number), 1);
    ck_assert_uint_eq(number, 0);
    mokd__request__free_unpacked(r, NULL);
  }
}
END_TEST

START_TEST(no_unknown_field_is_none)
{
  static const uint8_t ping[] = {0x08, 0x01, 0xaa, 0x01, 0x02, 0x08, 0x02};
  Mokd__Request *r = mokd__request__unpack(NULL, sizeof ping, ping);
  uint32_t number = 12345;

  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(mokw_find_unknown_field(&r->base, &number), 0);
  ck_assert_uint_eq(number, 12345);
  mokd__request__free_unpacked(r, NULL);
}
END_TEST

START_TEST(garbage_does_not_parse)
{
  static const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x33};
  ck_assert_ptr_null(mokd__request__unpack(NULL, sizeof junk, junk));
}
END_TEST

Suite *frame_suite(void)
{
  Suite *s = suite_create("frame");
  TCase *tc = tcase_create("framing");
  tcase_add_test(tc, partial_reads);
  tcase_add_test(tc, two_frames_in_one_read);
  tcase_add_test(tc, oversize_prefix);
  tcase_add_test(tc, zero_length_frame);
  suite_add_tcase(s, tc);
  tc = tcase_create("protocol");
  tcase_add_test(tc, forward_and_backward_round_trip);
  tcase_add_test(tc, layer_and_response_round_trip);
  tcase_add_test(tc, unknown_fields_are_found);
  tcase_add_test(tc, unknown_field_zero_is_found);
  tcase_add_test(tc, no_unknown_field_is_none);
  tcase_add_test(tc, garbage_does_not_parse);
  suite_add_tcase(s, tc);
  return s;
}
