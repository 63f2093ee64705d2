/* check_daemon.c - mokd end to end: each test runs a daemon on a temporary
 * socket (daemon_fixture.c) and drives it through libmok and through raw
 * frames. The suites: steps (check_daemon_steps.c), the wire
 * (check_daemon_wire.c), the service (check_daemon_service.c), the limits
 * one client meets (check_daemon_limits.c), EP groups of several client
 * processes (check_daemon_ep.c), the fair queue (check_daemon_fair.c),
 * tenants' records and their reload (check_daemon_tenants.c). */
#include <signal.h>
#include <stdlib.h>

#include "daemon_fixture.h"

int main(void)
{
  SRunner *sr = srunner_create(daemon_steps_suite());
  int failed;
  signal(SIGPIPE, SIG_IGN);
  srunner_add_suite(sr, daemon_wire_suite());
  srunner_add_suite(sr, daemon_service_suite());
  srunner_add_suite(sr, daemon_limits_suite());
  srunner_add_suite(sr, daemon_ep_suite());
  srunner_add_suite(sr, daemon_fair_suite());
  srunner_add_suite(sr, daemon_tenants_suite());
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
