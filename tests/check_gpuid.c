/* check_gpuid.c - GPU UUIDs (proto/gpuid.c): the nvidia-smi text form both
 * ways, what is not a UUID, and finding one among a daemon's GPUs. */
#include <check.h>
#include <string.h>

#include "gpuid.h"
#include "mok_errno.h"
#include "ref.h"

static const uint8_t a100[MOKW_UUID_BYTES] = {0x3f, 0x0e, 0x2b, 0x8c, 0x9a, 0x41, 0x5d, 0x07,
                                              0xb2, 0x6e, 0x10, 0xc4, 0xd5, 0xfa, 0x00, 0x91};
static const char a100_text[] = "GPU-3f0e2b8c-9a41-5d07-b26e-10c4d5fa0091";

START_TEST(format_is_nvidia_smi_form)
{
  char s[MOKW_UUID_STRLEN];
  mokw_uuid_format(a100, s);
  ck_assert_str_eq(s, a100_text);
  ck_assert_int_eq(strlen(s) + 1, MOKW_UUID_STRLEN);
}
END_TEST

START_TEST(parse_round_trips_and_takes_variants)
{
  uint8_t u[MOKW_UUID_BYTES];
  ck_assert_int_eq(mokw_uuid_parse(a100_text, u), 0);
  ck_assert(memcmp(u, a100, sizeof u) == 0);
  memset(u, 0, sizeof u);
  ck_assert_int_eq(mokw_uuid_parse("3F0E2B8C-9A41-5D07-B26E-10C4D5FA0091", u), 0);
  ck_assert(memcmp(u, a100, sizeof u) == 0);
  memset(u, 0, sizeof u);
  ck_assert_int_eq(mokw_uuid_parse("MIG-3f0e2b8c-9a41-5d07-b26e-10c4d5fa0091", u), 0);
  ck_assert(memcmp(u, a100, sizeof u) == 0);
}
END_TEST

START_TEST(parse_refuses_what_is_not_a_uuid)
{
  static const char *const bad[] = {
      "", "GPU-", "GPU-3f0e2b8c-9a41-5d07-b26e-10c4d5fa009",         /* one digit short */
      "GPU-3f0e2b8c-9a41-5d07-b26e-10c4d5fa00911",                  /* one too many */
      "GPU-3f0e2b8c9a41-5d07-b26e-10c4d5fa0091-",                   /* dash misplaced */
      "GPU-3f0e2b8c-9a41-5d07-b26e-10c4d5fa00g1",                   /* not hex */
      "gpu-3f0e2b8c-9a41-5d07-b26e-10c4d5fa0091",                   /* prefix case */
      "0", "1"};                                                    /* ordinals are not UUIDs */
  uint8_t u[MOKW_UUID_BYTES];
  memset(u, 0xab, sizeof u);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_msg(mokw_uuid_parse(bad[i], u) == MOK_EINVAL, "took \"%s\"", bad[i]);
  ck_assert_int_eq(mokw_uuid_parse(NULL, u), MOK_EINVAL);
  for (int i = 0; i < MOKW_UUID_BYTES; i++)
    ck_assert_int_eq(u[i], 0xab); /* a refused text leaves the output alone */
}
END_TEST

/* The daemon's ordinals are positions in its own list; a client's are in its
 * own: only the bytes match them up. */
START_TEST(find_matches_bytes_not_positions)
{
  uint8_t gpus[3][MOKW_UUID_BYTES];
  uint8_t other[MOKW_UUID_BYTES];
  for (int i = 0; i < 3; i++) {
    memcpy(gpus[i], a100, MOKW_UUID_BYTES);
    gpus[i][15] = (uint8_t)i;
  }
  memcpy(other, a100, sizeof other);
  for (int i = 0; i < 3; i++) {
    other[15] = (uint8_t)i;
    ck_assert_int_eq(mokw_uuid_find((const uint8_t(*)[MOKW_UUID_BYTES])gpus, 3, other), i);
  }
  other[15] = 3;
  ck_assert_int_eq(mokw_uuid_find((const uint8_t(*)[MOKW_UUID_BYTES])gpus, 3, other), -1);
  other[0] ^= 0x80; /* differs in the first byte only */
  other[15] = 1;
  ck_assert_int_eq(mokw_uuid_find((const uint8_t(*)[MOKW_UUID_BYTES])gpus, 3, other), -1);
  ck_assert_int_eq(mokw_uuid_find((const uint8_t(*)[MOKW_UUID_BYTES])gpus, 0, gpus[0]), -1);
}
END_TEST

Suite *gpuid_suite(void)
{
  Suite *s = suite_create("gpuid");
  TCase *tc = tcase_create("uuid");
  tcase_add_test(tc, format_is_nvidia_smi_form);
  tcase_add_test(tc, parse_round_trips_and_takes_variants);
  tcase_add_test(tc, parse_refuses_what_is_not_a_uuid);
  tcase_add_test(tc, find_matches_bytes_not_positions);
  suite_add_tcase(s, tc);
  return s;
}
