/* daemon_fixture.h - what the end-to-end suites share: a mokd on a
 * temporary socket per test (setup/teardown), libmok and raw-frame helpers. */
#ifndef MOKD_DAEMON_FIXTURE_H
#define MOKD_DAEMON_FIXTURE_H

#include <check.h>
#include <stdint.h>
#include <sys/types.h>

#include "mok.h"
#include "proto/mokd.pb-c.h"

extern char dir[64], sock[96], logpath[96];
extern pid_t daemon_pid;

/* $MOKD_BIN, else build/mokd */
const char *mokd_bin(void);
/* mokd on path, logging to log; extra: flags separated by spaces */
pid_t spawn_daemon(const char *path, const char *extra, const char *log);
void wait_for_socket(const char *path, pid_t pid);
/* SIGTERM, then the exit status */
int stop_daemon(pid_t pid);

/* A daemon of a test's own on DIR/NAME.sock with extra flags; until
 * own_daemon_stop the raw and libmok helpers (sock) talk to it. */
typedef struct own_daemon {
  pid_t pid;
  char path[96], log[128], saved[96]; /* path: as long as sock */
} own_daemon;
void own_daemon_start(own_daemon *d, const char *name, const char *extra);
/* sock back to the fixture's daemon; asserts this one exits 0 on SIGTERM */
void own_daemon_stop(own_daemon *d);
/* a daemon on sock (executor_threads 2); teardown asserts it exits 0 */
void setup(void);
void teardown(void);
/* only the temporary folder: for tests that start their own daemon */
void plain_setup(void);
void plain_teardown(void);
mok_client *connect_ok(void);

/* raw frames */
int raw_connect(void);
void raw_send(int fd, const void *buf, size_t len, int pass_fd);
/* nfds (up to 32) fds on the message's first byte */
void raw_send_fds(int fd, const void *buf, size_t len, const int *fds, int nfds);
void raw_request(int fd, Mokd__Request *req, int pass_fd);
/* Reads one reply; NULL when the daemon closed the connection instead. */
Mokd__Response *raw_reply(int fd);
void hello(int fd);
void expect_status(int fd, int code, const char *needle);
void still_serving(void);

Suite *daemon_steps_suite(void);
Suite *daemon_wire_suite(void);
Suite *daemon_service_suite(void);
Suite *daemon_limits_suite(void);
Suite *daemon_ep_suite(void);
Suite *daemon_fair_suite(void);
Suite *daemon_tenants_suite(void);

#endif
