/* check_placement.c - which sessions may hold the ranks of one EP group
 * (daemon/placement.c): one backend always; two GPUs only once the daemon
 * has linked them; never a GPU with the CPU. */
#include "placement.h"
#include "ref.h"

/* stand-ins: the rule compares backends by identity only */
static mokk_backend *gpu0 = (mokk_backend *)&gpu0, *gpu1 = (mokk_backend *)&gpu1;
static mokk_backend *cpu = (mokk_backend *)&cpu;

START_TEST(one_backend_always)
{
  ck_assert_int_eq(mokd_place_ranks(gpu0, 0, gpu0, 0, 0), MOKD_PLACE_OK);
  ck_assert_int_eq(mokd_place_ranks(cpu, -1, cpu, -1, 0), MOKD_PLACE_OK);
}
END_TEST

START_TEST(two_gpus_need_the_link)
{
  ck_assert_int_eq(mokd_place_ranks(gpu0, 0, gpu1, 1, 0), MOKD_PLACE_NOT_LINKED);
  ck_assert_int_eq(mokd_place_ranks(gpu0, 0, gpu1, 1, 1), MOKD_PLACE_OK);
  ck_assert_int_eq(mokd_place_ranks(gpu1, 1, gpu0, 0, 1), MOKD_PLACE_OK);
}
END_TEST

START_TEST(gpu_and_cpu_never)
{
  ck_assert_int_eq(mokd_place_ranks(gpu0, 0, cpu, -1, 1), MOKD_PLACE_OTHER);
  ck_assert_int_eq(mokd_place_ranks(cpu, -1, gpu0, 0, 1), MOKD_PLACE_OTHER);
}
END_TEST

Suite *placement_suite(void)
{
  Suite *s = suite_create("placement");
  TCase *tc = tcase_create("ranks");

  tcase_add_test(tc, one_backend_always);
  tcase_add_test(tc, two_gpus_need_the_link);
  tcase_add_test(tc, gpu_and_cpu_never);
  suite_add_tcase(s, tc);
  return s;
}
