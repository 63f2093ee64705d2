/* check_main.c - runs every CPU suite; CK_FORK=yes isolates each test. */
#include <stdlib.h>

#include "ref.h"

int main(void)
{
  SRunner *sr = srunner_create(bf16_suite());
  int failed;

  srunner_add_suite(sr, pool_suite());
  srunner_add_suite(sr, frame_suite());
  srunner_add_suite(sr, config_suite());
  srunner_add_suite(sr, registry_suite());
  srunner_add_suite(sr, idmap_suite());
  srunner_add_suite(sr, ops_suite());
  srunner_add_suite(sr, paths_suite());
  srunner_add_suite(sr, mokctl_suite());
  srunner_add_suite(sr, gpuid_suite());
  srunner_add_suite(sr, wfq_suite());
  srunner_add_suite(sr, placement_suite());
  srunner_add_suite(sr, impcache_suite());
  srunner_add_suite(sr, schedule_suite());
  srunner_add_suite(sr, errors_suite());
  srunner_add_suite(sr, forward_suite());
  srunner_add_suite(sr, backward_suite());
  srunner_add_suite(sr, determinism_suite());
  srunner_add_suite(sr, ep_suite());
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
