/* check_paths.c - the socket path helpers shared by mokd and libmok: the
 * socket's directory is checked before a bind (libuv reports a missing one as
 * "permission denied"), and the /tmp fallback's peer must be the user or root. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mok.h"
#include "paths.h"
#include "ref.h"

static char dir[64];

static void setup(void)
{
  strcpy(dir, "/tmp/mokd-paths-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
}

static void teardown(void)
{
  char cmd[192];
  snprintf(cmd, sizeof cmd, "chmod -R u+rwx %s; rm -rf %s", dir, dir);
  ck_assert_int_eq(system(cmd), 0);
}

START_TEST(existing_directory_passes)
{
  char path[128], err[MOK_ERRLEN] = "";
  snprintf(path, sizeof path, "%s/mokd.sock", dir);
  ck_assert_int_eq(mok_socket_dir_check(path, err, sizeof err), 0);
  ck_assert_str_eq(err, "");
  /* a bare name lives in the working directory, which exists */
  ck_assert_int_eq(mok_socket_dir_check("mokd.sock", err, sizeof err), 0);
  ck_assert_int_eq(mok_socket_dir_check("/mokd.sock", err, sizeof err), 0);
}
END_TEST

START_TEST(missing_directory_is_named)
{
  char path[128], want[192], err[MOK_ERRLEN];
  snprintf(path, sizeof path, "%s/no/such/mokd.sock", dir);
  ck_assert_int_eq(mok_socket_dir_check(path, err, sizeof err), MOK_ENOENT);
  snprintf(want, sizeof want, "socket directory %s/no/such does not exist; create it or pick "
           "another --socket", dir);
  ck_assert_str_eq(err, want);
}
END_TEST

START_TEST(missing_run_directory_says_what_makes_it)
{
  char err[MOK_ERRLEN];
  struct stat st;
  /* the default path as root; only meaningful where /run/mokd is absent */
  if (stat("/run/mokd", &st) == 0)
    return;
  ck_assert_int_eq(mok_socket_dir_check("/run/mokd/mokd.sock", err, sizeof err), MOK_ENOENT);
  ck_assert_str_eq(err, "socket directory /run/mokd does not exist; the mokd unit makes it "
                   "(RuntimeDirectory=mokd), else install deploy/mokd.tmpfiles.conf "
                   "(systemd-tmpfiles --create) or pick another --socket");
}
END_TEST

START_TEST(file_in_the_way_is_named)
{
  char file[128], path[160], want[256], err[MOK_ERRLEN];
  snprintf(file, sizeof file, "%s/plain", dir);
  FILE *f = fopen(file, "w");
  ck_assert_ptr_nonnull(f);
  fclose(f);
  snprintf(path, sizeof path, "%s/mokd.sock", file);
  ck_assert_int_eq(mok_socket_dir_check(path, err, sizeof err), MOK_EINVAL);
  snprintf(want, sizeof want, "socket directory %s is not a directory; pick another --socket",
           file);
  ck_assert_str_eq(err, want);
}
END_TEST

START_TEST(unreachable_directory_is_permission_denied)
{
  char locked[128], path[192], want[320], err[MOK_ERRLEN];
  snprintf(locked, sizeof locked, "%s/locked", dir);
  ck_assert_int_eq(mkdir(locked, 0700), 0);
  snprintf(path, sizeof path, "%s/sub/mokd.sock", locked);
  snprintf(want, sizeof want, "socket directory %s/sub: cannot look it up: Permission denied",
           locked);
  /* root searches any directory: look as nobody */
  ck_assert_int_eq(chmod(dir, 0755), 0);
  pid_t child = fork();
  ck_assert_int_ge(child, 0);
  if (child == 0) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0))
      _exit(3);
    if (geteuid() != 0)
      chmod(locked, 0);
    int rc = mok_socket_dir_check(path, err, sizeof err);
    _exit(rc == MOK_EPERM && strcmp(err, want) == 0 ? 0 : 4);
  }
  int st;
  ck_assert_int_eq(waitpid(child, &st, 0), child);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
}
END_TEST

START_TEST(tmp_fallback_is_recognised)
{
  char mine[64], other[64];
  snprintf(mine, sizeof mine, "/tmp/mokd-%u.sock", (unsigned)geteuid());
  snprintf(other, sizeof other, "/tmp/mokd-%u.sock", (unsigned)geteuid() + 1);
  ck_assert(mok_socket_is_tmp_fallback(mine));
  ck_assert(!mok_socket_is_tmp_fallback(other));
  ck_assert(!mok_socket_is_tmp_fallback("/run/mokd/mokd.sock"));
  ck_assert(!mok_socket_is_tmp_fallback("/tmp/mokd.sock"));
}
END_TEST

START_TEST(peer_of_same_user_is_accepted)
{
  int sv[2];
  char err[MOK_ERRLEN] = "";
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ck_assert_int_eq(mok_socket_peer_check(sv[0], geteuid(), "/tmp/x.sock", err, sizeof err), 0);
  ck_assert_str_eq(err, "");
  close(sv[0]);
  close(sv[1]);
}
END_TEST

START_TEST(peer_of_another_user_is_refused)
{
  /* the peer is this process (uid 0 when run as root, which is always
   * trusted); as someone else, expect a uid nobody has */
  int sv[2];
  char err[MOK_ERRLEN], want[MOK_ERRLEN];
  uid_t me = geteuid(), want_uid = 4242;
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  if (me == 0) {
    /* a peer running as nobody, checked by root expecting uid 4242 */
    pid_t child = fork();
    ck_assert_int_ge(child, 0);
    if (child == 0) {
      close(sv[0]);
      int fd[2];
      if (setgid(65534) != 0 || setuid(65534) != 0)
        _exit(3);
      /* SO_PEERCRED records who connected: make a fresh pair as nobody */
      if (socketpair(AF_UNIX, SOCK_STREAM, 0, fd) != 0)
        _exit(5);
      int rc = mok_socket_peer_check(fd[0], want_uid, "/tmp/mokd-4242.sock", err, sizeof err);
      snprintf(want, sizeof want, "/tmp/mokd-4242.sock is served by uid 65534, not by uid 4242 "
               "or root; refusing it (start mokd yourself, or pick --socket / MOKD_SOCKET)");
      _exit(rc == MOK_EPERM && strcmp(err, want) == 0 ? 0 : 4);
    }
    int st;
    ck_assert_int_eq(waitpid(child, &st, 0), child);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
  } else {
    ck_assert_int_eq(mok_socket_peer_check(sv[0], want_uid, "/tmp/mokd-4242.sock", err,
                                           sizeof err), MOK_EPERM);
    snprintf(want, sizeof want, "/tmp/mokd-4242.sock is served by uid %u, not by uid 4242 or "
             "root; refusing it (start mokd yourself, or pick --socket / MOKD_SOCKET)",
             (unsigned)me);
    ck_assert_str_eq(err, want);
  }
  close(sv[0]);
  close(sv[1]);
}
END_TEST

START_TEST(root_peer_is_accepted)
{
  /* a daemon started by root may serve anyone's fallback path */
  int sv[2];
  char err[MOK_ERRLEN] = "";
  if (geteuid() != 0)
    return;
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ck_assert_int_eq(mok_socket_peer_check(sv[0], 4242, "/tmp/mokd-4242.sock", err, sizeof err),
                   0);
  close(sv[0]);
  close(sv[1]);
}
END_TEST

Suite *paths_suite(void)
{
  Suite *s = suite_create("paths");
  TCase *tc = tcase_create("socket_dir");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, existing_directory_passes);
  tcase_add_test(tc, missing_directory_is_named);
  tcase_add_test(tc, missing_run_directory_says_what_makes_it);
  tcase_add_test(tc, file_in_the_way_is_named);
  tcase_add_test(tc, unreachable_directory_is_permission_denied);
  suite_add_tcase(s, tc);
  tc = tcase_create("tmp_fallback");
  tcase_add_test(tc, tmp_fallback_is_recognised);
  tcase_add_test(tc, peer_of_same_user_is_accepted);
  tcase_add_test(tc, peer_of_another_user_is_refused);
  tcase_add_test(tc, root_peer_is_accepted);
  suite_add_tcase(s, tc);
  return s;
}
