/* check_bf16.c - float <-> bf16: round to nearest even, NaN kept a NaN. */
#include <math.h>

#include "bf16.h"
#include "ref.h"

static uint16_t from_bits(uint32_t u)
{
  float f;
  memcpy(&f, &u, sizeof f);
  return mokk_f32_to_bf16(f);
}

START_TEST(ties_round_to_even)
{
  ck_assert_uint_eq(from_bits(0x3f808000u), 0x3f80); /* tie, even below */
  ck_assert_uint_eq(from_bits(0x3f818000u), 0x3f82); /* tie, even above */
  ck_assert_uint_eq(from_bits(0xbf808000u), 0xbf80); /* negative tie */
  ck_assert_uint_eq(from_bits(0xbf818000u), 0xbf82);
  ck_assert_uint_eq(from_bits(0x3f808001u), 0x3f81); /* just above the tie */
  ck_assert_uint_eq(from_bits(0x3f807fffu), 0x3f80); /* just below */
  ck_assert_uint_eq(from_bits(0x3f80ffffu), 0x3f81);
}
END_TEST

START_TEST(subnormals)
{
  ck_assert_uint_eq(from_bits(0x00000001u), 0x0000); /* smallest fp32 subnormal */
  ck_assert_uint_eq(from_bits(0x00008000u), 0x0000); /* tie to even zero */
  ck_assert_uint_eq(from_bits(0x00018000u), 0x0002); /* tie to even two */
  ck_assert_uint_eq(from_bits(0x00010000u), 0x0001); /* exact bf16 subnormal */
  ck_assert_uint_eq(from_bits(0x807f8000u), 0x8080); /* rounds up into the normals */
  ck_assert_uint_eq(from_bits(0x80000000u), 0x8000); /* -0 */
  ck_assert(mokk_bf16_to_f32(0x0001) == 0x1p-133f);
}
END_TEST

START_TEST(infinities_and_overflow)
{
  ck_assert_uint_eq(from_bits(0x7f800000u), 0x7f80);
  ck_assert_uint_eq(from_bits(0xff800000u), 0xff80);
  ck_assert_uint_eq(from_bits(0x7f7fffffu), 0x7f80); /* FLT_MAX rounds to +inf */
  ck_assert_uint_eq(from_bits(0x7f7f7fffu), 0x7f7f); /* largest that stays finite */
  ck_assert(isinf(mokk_bf16_to_f32(0xff80)) && mokk_bf16_to_f32(0xff80) < 0);
}
END_TEST

START_TEST(nan_stays_nan)
{
  /* payloads only in the low 16 bits would round to inf without the NaN path */
  ck_assert_uint_eq(from_bits(0x7f800001u), 0x7fc0);
  ck_assert_uint_eq(from_bits(0xff800001u), 0xffc0);
  ck_assert_uint_eq(from_bits(0x7fc00000u), 0x7fc0);
  ck_assert_uint_eq(from_bits(0x7fffffffu), 0x7fff);
  ck_assert(isnan(mokk_bf16_to_f32(from_bits(0x7f80ffffu))));
}
END_TEST

START_TEST(every_bf16_round_trips)
{
  for (uint32_t b = 0; b <= 0xffffu; b++) {
    float f = mokk_bf16_to_f32((uint16_t)b);
    uint16_t back = mokk_f32_to_bf16(f);
    if (isnan(f))
      ck_assert_uint_eq(back, (uint16_t)(b | 0x0040u));
    else
      ck_assert_uint_eq(back, b);
  }
}
END_TEST

START_TEST(matches_nearest_on_random_floats)
{
  uint64_t rng = 7;
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)rng_next(&rng);
    float f, lo, hi;
    memcpy(&f, &u, sizeof f);
    if (!isfinite(f) || fabsf(f) > 0x1.fep127f)
      continue;
    uint16_t b = mokk_f32_to_bf16(f);
    uint16_t t = (uint16_t)(u >> 16);
    lo = mokk_bf16_to_f32(t);
    hi = mokk_bf16_to_f32((uint16_t)(t + 1));
    /* b is one of the two neighbours, and the nearer one */
    ck_assert(b == t || b == (uint16_t)(t + 1));
    double dl = fabs((double)f - lo), dh = fabs((double)hi - f);
    if (dl != dh)
      ck_assert_uint_eq(b, dl < dh ? t : (uint16_t)(t + 1));
    else
      ck_assert_uint_eq(b & 1u, 0);
  }
}
END_TEST

Suite *bf16_suite(void)
{
  Suite *s = suite_create("bf16");
  TCase *tc = tcase_create("convert");
  tcase_add_test(tc, ties_round_to_even);
  tcase_add_test(tc, subnormals);
  tcase_add_test(tc, infinities_and_overflow);
  tcase_add_test(tc, nan_stays_nan);
  tcase_add_test(tc, every_bf16_round_trips);
  tcase_add_test(tc, matches_nearest_on_random_floats);
  suite_add_tcase(s, tc);
  return s;
}
