/* check_registry.c - a session's memory without a server: arenas on the CPU
 * backend, the best-fit output allocator, tensor validation and quotas. */
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <unistd.h>

#include "ref.h"
#include "registry.h"

static mokk_backend *cpu;
static uint64_t next_id;
static mok_usage sess, daemon_usage;
static char err[MOK_ERRLEN];

static void setup(void)
{
  ck_assert_int_eq(mokk_cpu_create(1, &cpu, err), 0);
  next_id = 0;
  memset(&sess, 0, sizeof sess);
  memset(&daemon_usage, 0, sizeof daemon_usage);
}

static void teardown(void)
{
  mokk_backend_destroy(cpu);
}

static void reg_init(mokd_registry *r, uint64_t quota)
{
  mokd_limits lim = {.max_arena_bytes = 1u << 30, .quota = {quota, 0}};
  mokd_registry_init(r, cpu, &next_id, &lim, &sess, &daemon_usage);
}

static Mokd__TensorRef ref(uint64_t arena, uint64_t offset, Mokd__DType dt, int ndim,
                           int64_t *shape)
{
  Mokd__TensorRef t = MOKD__TENSOR_REF__INIT;
  t.arena = arena, t.offset = offset, t.dtype = dt;
  t.n_shape = (size_t)ndim, t.shape = shape;
  return t;
}

START_TEST(best_fit_reuses_the_smallest_hole)
{
  mokd_registry r;
  mokd_arena *a[4];
  mokd_span s[4], t;
  size_t sizes[4] = {8192, 100, 4096, 256};

  reg_init(&r, 0);
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(mokd_out_alloc(&r, sizes[i], &a[i], &s[i], err), 0);
  ck_assert_ptr_eq(a[0], a[3]); /* one output arena holds them all */
  ck_assert_int_eq(s[1].len, 256); /* sizes round up to 256 */
  ck_assert_int_eq(s[2].off, 8192 + 256);
  mokd_out_release(a[0], s[0]);
  mokd_out_release(a[2], s[2]);
  /* first fit would take the 8 KiB hole at 0; best fit the 4 KiB one */
  ck_assert_int_eq(mokd_out_alloc(&r, 4000, &a[2], &t, err), 0);
  ck_assert_uint_eq(t.off, 8192 + 256);
  ck_assert_uint_eq(t.len, 4096);
  mokd_out_release(a[2], t);
  mokd_out_release(a[1], s[1]);
  mokd_out_release(a[3], s[3]);
  ck_assert_uint_eq(a[0]->used, 0);
  ck_assert_uint_eq(a[0]->nfree, 1); /* the holes merged back into one */
  ck_assert_uint_eq(sess.arenas, 1);
  ck_assert_uint_eq(daemon_usage.arenas, 1);
  mokd_registry_clear(&r);
  ck_assert_uint_eq(sess.arenas, 0);
  ck_assert_uint_eq(sess.arena_bytes, 0);
}
END_TEST

/* Output arenas are made 64 MiB at least, to serve many steps; a daemon
 * whose max_arena_bytes is smaller still serves outputs that fit it. */
START_TEST(output_arenas_follow_max_arena_bytes)
{
  mokd_registry r;
  mokd_arena *a;
  mokd_span sp;
  mokd_limits lim = {.max_arena_bytes = 1 << 20};
  mokd_registry_init(&r, cpu, &next_id, &lim, &sess, &daemon_usage);
  ck_assert_msg(mokd_out_alloc(&r, 1000, &a, &sp, err) == 0, "%s", err);
  ck_assert_uint_eq(a->bytes, 1 << 20);
  ck_assert_int_eq(mokd_out_alloc(&r, (1 << 20) + 1, &a, &sp, err), MOK_EINVAL);
  ck_assert_msg(strstr(err, "larger than max_arena_bytes") != NULL, "%s", err);
  mokd_registry_clear(&r);
}
END_TEST

/* Giving back many blocks at once leaves the free list one by one would. */
START_TEST(release_many_equals_one_by_one)
{
  enum { N = 2000 };
  mokd_registry r1, r2;
  mokd_arena *a1, *a2;
  static mokd_span s1[N], s2[N], batch[N];
  static char back[N];
  uint64_t seed = 3;
  size_t nb = 0;

  reg_init(&r1, 0);
  reg_init(&r2, 0);
  for (int i = 0; i < N; i++) {
    size_t len = 256 * (1 + rng_next(&seed) % 4);
    ck_assert_int_eq(mokd_out_alloc(&r1, len, &a1, &s1[i], err), 0);
    ck_assert_int_eq(mokd_out_alloc(&r2, len, &a2, &s2[i], err), 0);
  }
  /* some go back first, one by one in both; then a random half, together in
   * the second arena */
  for (int i = 0; i < N; i += 7) {
    mokd_out_release(a1, s1[i]), mokd_out_release(a2, s2[i]);
    back[i] = 1;
  }
  for (int i = 0; i < N; i++)
    if (!back[i] && rng_next(&seed) % 2) {
      mokd_out_release(a1, s1[i]);
      batch[nb++] = s2[i];
      back[i] = 1;
    }
  mokd_out_release_many(a2, batch, nb);
  ck_assert_uint_eq(a1->used, a2->used);
  ck_assert_uint_eq(a1->nfree, a2->nfree);
  for (size_t i = 0; i < a1->nfree; i++) {
    ck_assert_uint_eq(a1->free[i].off, a2->free[i].off);
    ck_assert_uint_eq(a1->free[i].len, a2->free[i].len);
  }
  /* the rest: everything merges back into one range */
  nb = 0;
  for (int i = 0; i < N; i++)
    if (!back[i])
      batch[nb++] = s2[i];
  mokd_out_release_many(a2, batch, nb);
  ck_assert_uint_eq(a2->used, 0);
  ck_assert_uint_eq(a2->nfree, 1);
  ck_assert_uint_eq(a2->free[0].len, a2->bytes);
  mokd_registry_clear(&r1);
  mokd_registry_clear(&r2);
}
END_TEST

START_TEST(overflowing_and_misplaced_refs_are_refused)
{
  mokd_registry r;
  mokd_arena *a;
  void *p;
  int64_t huge[3] = {1 << 24, 1 << 24, 1 << 24}, want[3] = {-1, -1, -1};
  int64_t one[2] = {4, 4}, w2[2] = {-1, -1};

  reg_init(&r, 0);
  ck_assert_int_eq(mokd_arena_new(&r, 4096, ARENA_DAEMON, &a, err), 0);
  ck_assert_int_ge(a->fd, 0);
  Mokd__TensorRef t = ref(a->id, 0, MOKD__DTYPE__DTYPE_F32, 3, huge);
  ck_assert_int_eq(mokd_ref_resolve(&r, "x", &t, MOKD__DTYPE__DTYPE_F32, 3, want, &p, NULL,
                                    err), MOK_EOVERFLOW);
  ck_assert_ptr_nonnull(strstr(err, "x: size overflows"));
  t = ref(a->id, UINT64_MAX - 15, MOKD__DTYPE__DTYPE_F32, 2, one);
  ck_assert_int_eq(mokd_ref_resolve(&r, "x", &t, MOKD__DTYPE__DTYPE_F32, 2, w2, &p, NULL, err),
                   MOK_ERANGE);
  ck_assert_ptr_nonnull(strstr(err, "lie outside arena"));
  t = ref(a->id, 4096 - 32, MOKD__DTYPE__DTYPE_F32, 2, one);
  ck_assert_int_eq(mokd_ref_resolve(&r, "x", &t, MOKD__DTYPE__DTYPE_F32, 2, w2, &p, NULL, err),
                   MOK_ERANGE);
  t = ref(a->id, 2, MOKD__DTYPE__DTYPE_F32, 2, one);
  ck_assert_int_eq(mokd_ref_resolve(&r, "x", &t, MOKD__DTYPE__DTYPE_F32, 2, w2, &p, NULL, err),
                   MOK_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "not a multiple of 4"));
  t = ref(a->id, 0, MOKD__DTYPE__DTYPE_BF16, 2, one);
  ck_assert_int_eq(mokd_ref_resolve(&r, "x", &t, MOKD__DTYPE__DTYPE_F32, 2, w2, &p, NULL, err),
                   MOK_EDTYPE);
  one[0] = 0;
  t = ref(a->id, 0, MOKD__DTYPE__DTYPE_F32, 2, one);
  ck_assert_int_eq(mokd_ref_resolve(&r, "x", &t, MOKD__DTYPE__DTYPE_F32, 2, w2, &p, NULL, err),
                   MOK_ESHAPE);
  one[0] = 4;
  t = ref(a->id, 4096 - 64, MOKD__DTYPE__DTYPE_F32, 2, one);
  ck_assert_int_eq(mokd_ref_resolve(&r, "x", &t, MOKD__DTYPE__DTYPE_F32, 2, w2, &p, NULL, err),
                   0);
  ck_assert_ptr_eq(p, (char *)a->base + 4096 - 64);
  ck_assert_int_eq(w2[0], 4); /* free dimensions are filled in */
  mokd_registry_clear(&r);
}
END_TEST

START_TEST(another_sessions_arena_is_not_found)
{
  mokd_registry mine, other;
  mokd_arena *a;
  void *p;
  int64_t shape[1] = {16}, want[1] = {-1};

  reg_init(&mine, 0);
  reg_init(&other, 0);
  ck_assert_int_eq(mokd_arena_new(&other, 4096, ARENA_DAEMON, &a, err), 0);
  ck_assert_ptr_null(mokd_arena_find(&mine, a->id));
  Mokd__TensorRef t = ref(a->id, 0, MOKD__DTYPE__DTYPE_F32, 1, shape);
  ck_assert_int_eq(mokd_ref_resolve(&mine, "w_gate", &t, MOKD__DTYPE__DTYPE_F32, 1, want, &p,
                                    NULL, err), MOK_ENOENT);
  ck_assert_ptr_nonnull(strstr(err, "is not an arena of this session"));
  ck_assert_int_eq(mokd_ref_resolve(&other, "w_gate", &t, MOKD__DTYPE__DTYPE_F32, 1, want, &p,
                                    NULL, err), 0);
  mokd_registry_clear(&other);
  mokd_registry_clear(&mine);
}
END_TEST

START_TEST(quota_edges)
{
  mokd_registry r;
  mokd_arena *a, *b;

  reg_init(&r, 8192);
  ck_assert_int_eq(mokd_arena_new(&r, 0, ARENA_DAEMON, &a, err), MOK_EZEROSIZE);
  ck_assert_int_eq(mokd_arena_new(&r, (2u << 30), ARENA_DAEMON, &a, err), MOK_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "max_arena_bytes"));
  ck_assert_int_eq(mokd_arena_new(&r, 8192, ARENA_DAEMON, &a, err), 0); /* exactly the quota */
  ck_assert_int_eq(mokd_arena_new(&r, 1, ARENA_DAEMON, &b, err), MOK_EDQUOT);
  ck_assert_ptr_nonnull(strstr(err, "session would hold 8193 bytes of host memory; its quota "
                                    "is 8192 (session_quota_bytes)"));
  ck_assert_uint_eq(r.held[MOKD_HOST], 8192);
  mokd_arena_free(&r, a);
  ck_assert_uint_eq(r.held[MOKD_HOST], 0);
  ck_assert_int_eq(mokd_arena_new(&r, 4096, ARENA_DAEMON, &b, err), 0);
  ck_assert_int_eq(mokd_quota_take(&r, UINT64_MAX - 100, MOKD_HOST, err), MOK_EDQUOT);
  ck_assert_uint_eq(r.held[MOKD_HOST], 4096);
  /* no quota: only the sum's own overflow is refused */
  r.lim.quota[MOKD_HOST] = 0;
  ck_assert_int_eq(mokd_quota_take(&r, 1u << 20, MOKD_HOST, err), 0);
  mokd_quota_give(&r, 1u << 20, MOKD_HOST);
  ck_assert_uint_eq(sess.gpu_bytes, 0);
  mokd_registry_clear(&r);
  ck_assert_uint_eq(r.held[MOKD_HOST], 0);
}
END_TEST

/* A record is shared by its sessions and goes with the last one, unless
 * memory is still charged to it; a lowered quota refuses more and frees
 * nothing. */
START_TEST(tenant_records_go_with_their_last_session)
{
  mokd_tenant *list = NULL, *t, *u;
  mokd_registry r;

  t = mokd_tenant_get(&list, "job:a", 2, 8192);
  ck_assert_ptr_eq(mokd_tenant_get(&list, "job:a", 2, 8192), t);
  ck_assert_int_eq(t->sessions, 2);
  u = mokd_tenant_get(&list, "uid:7", 1, 0);
  reg_init(&r, 0);
  r.tenant = t;
  ck_assert_int_eq(mokd_quota_take(&r, 4096, MOKD_HOST, err), 0);
  t->quota = 1024; /* a reload below what it holds */
  ck_assert_int_eq(mokd_quota_take(&r, 1, MOKD_HOST, err), MOK_EDQUOT);
  ck_assert_ptr_nonnull(strstr(err, "tenant job:a would hold 4097 bytes"));
  ck_assert_uint_eq(t->held, 4096);
  mokd_tenant_put(&list, t);
  mokd_tenant_put(&list, t); /* its last session, but 4096 bytes are charged */
  ck_assert_ptr_eq(list, u);
  ck_assert_ptr_eq(u->next, t);
  mokd_quota_give(&r, 4096, MOKD_HOST);
  mokd_tenant_put(&list, u); /* the sweep takes t too */
  ck_assert_ptr_null(list);
}
END_TEST

START_TEST(host_imports_must_be_sealed)
{
  mokd_registry r;
  mokd_arena *a;
  int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  mokk_import src = {MOKK_IMPORT_HOST_FD, fd, NULL, 4096};

  reg_init(&r, 0);
  ck_assert_int_eq(ftruncate(fd, 4096), 0);
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a, err), MOK_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "F_SEAL_SHRINK"));
  /* the seal comes first: the size of an unsealed file may change after any
   * look at it, so it is only read once the file can no longer shrink */
  src.bytes = 8192;
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a, err), MOK_EINVAL);
  ck_assert_msg(strstr(err, "F_SEAL_SHRINK") != NULL, "%s", err);
  src.bytes = 4096;
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  src.bytes = 8192;
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a, err), MOK_ERANGE);
  src.bytes = 4096;
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a, err), 0);
  ck_assert_int_eq(a->kind, ARENA_IMPORTED);
  ck_assert_int_eq(a->device, -1);
  /* the daemon's mapping keeps the client's pages alive: charged */
  ck_assert_uint_eq(r.held[MOKD_HOST], 4096);
  src.kind = MOKK_IMPORT_CUMEM_FD;
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a, err), MOK_ENOTSUP);
  ck_assert_ptr_nonnull(strstr(err, "runs the cpu backend"));
  mokd_registry_clear(&r);
  ck_assert_uint_eq(r.held[MOKD_HOST], 0);
  close(fd);
}
END_TEST

/* Imports are arenas like the others: counted per session and for the
 * daemon, and charged to the host quota. */
START_TEST(imports_are_counted_and_charged)
{
  mokd_registry r, other;
  mokd_arena *a[4], *b;
  mokd_limits lim = {.max_arena_bytes = 1u << 30, .quota = {3 * 4096, 0}, .max_arenas = 3,
                     .daemon_max_arenas = 4};
  int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  mokk_import src = {MOKK_IMPORT_HOST_FD, fd, NULL, 4096};

  ck_assert_int_eq(ftruncate(fd, 4096), 0);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  mokd_registry_init(&r, cpu, &next_id, &lim, &sess, &daemon_usage);
  mokd_registry_init(&other, cpu, &next_id, &lim, NULL, &daemon_usage);
  for (int i = 0; i < 2; i++)
    ck_assert_int_eq(mokd_arena_import(&r, &src, &a[i], err), 0);
  ck_assert_uint_eq(r.held[MOKD_HOST], 8192);
  /* the quota holds one more page: a 4 KiB arena fits, a second import not */
  ck_assert_int_eq(mokd_arena_new(&r, 4096, ARENA_DAEMON, &a[2], err), 0);
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a[3], err), MOK_EDQUOT);
  ck_assert_msg(strstr(err, "already holds 3 arenas (max_arenas)") != NULL, "%s", err);
  mokd_arena_free(&r, a[2]);
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a[2], err), 0);
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a[3], err), MOK_EDQUOT);
  r.lim.max_arenas = 0;
  ck_assert_int_eq(mokd_arena_import(&r, &src, &a[3], err), MOK_EDQUOT);
  ck_assert_msg(strstr(err, "quota is 12288 (session_quota_bytes)") != NULL, "%s", err);
  /* all sessions together: 3 + 1 = the daemon's 4 */
  ck_assert_int_eq(mokd_arena_import(&other, &src, &b, err), 0);
  ck_assert_int_eq(mokd_arena_new(&other, 4096, ARENA_DAEMON, &b, err), MOK_EDQUOT);
  ck_assert_msg(strstr(err, "mokd holds 4 arenas for all sessions") != NULL, "%s", err);
  mokd_registry_clear(&r);
  ck_assert_uint_eq(r.held[MOKD_HOST], 0);
  ck_assert_int_eq(mokd_arena_new(&other, 4096, ARENA_DAEMON, &b, err), 0);
  mokd_registry_clear(&other);
  ck_assert_uint_eq(daemon_usage.arenas, 0);
  close(fd);
}
END_TEST

/* A chunked import is in no list and charged nothing beyond its quota until
 * its chunks add up; whether it completes, fails or is dropped, what it held
 * goes back. */
START_TEST(chunked_imports_leave_nothing_behind)
{
  mokd_registry r;
  mokd_arena *a;
  mokd_limits lim = {.max_arena_bytes = 1u << 30, .quota = {8 * 4096, 0}, .max_arenas = 6};
  int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING), fds[4] = {fd, fd, fd, fd};
  size_t pages[4] = {4096, 4096, 4096, 4096};

  ck_assert_int_eq(ftruncate(fd, 4096), 0);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  mokd_registry_init(&r, cpu, &next_id, &lim, &sess, &daemon_usage);
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_HOST_FD, 0, 6 * 4096, fds, pages, 4,
                                      &a, err), 0);
  ck_assert_ptr_eq(a, r.pending);
  ck_assert_ptr_null(mokd_arena_find(&r, a->id)); /* not usable yet */
  ck_assert_uint_eq(r.held[MOKD_HOST], 6 * 4096);
  ck_assert_uint_eq(r.narenas, 0);
  /* 4 mapped and 4 more are over max_arenas: the whole import goes */
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_HOST_FD, a->id, 6 * 4096, fds, pages, 4,
                                      &a, err), MOK_EDQUOT);
  ck_assert_ptr_null(r.pending);
  ck_assert_uint_eq(r.held[MOKD_HOST], 0);
  /* over the quota at the start */
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_HOST_FD, 0, 9 * 4096, fds, pages, 4,
                                      &a, err), MOK_EDQUOT);
  ck_assert_ptr_null(r.pending);
  /* GPU memory on the cpu backend */
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_CUMEM_FD, 0, 8192, fds, pages, 2, &a,
                                      err), MOK_ENOTSUP);
  ck_assert_ptr_null(r.pending);
  /* a whole one, then dropped while another is under way */
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_HOST_FD, 0, 6 * 4096, fds, pages, 4,
                                      &a, err), 0);
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_HOST_FD, a->id, 6 * 4096, fds, pages, 2,
                                      &a, err), 0);
  ck_assert_ptr_null(r.pending);
  ck_assert_ptr_eq(mokd_arena_find(&r, a->id), a);
  ck_assert_int_eq(a->maps, 6);
  ck_assert_uint_eq(r.narenas, 6);
  ck_assert_uint_eq(sess.arena_bytes, 6 * 4096);
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_HOST_FD, 0, 2 * 4096, fds, pages, 1,
                                      &a, err), MOK_EDQUOT); /* quota: 6 + 2 pages fit, maps not */
  ck_assert_ptr_null(r.pending);
  mokd_registry_clear(&r);
  ck_assert_uint_eq(r.held[MOKD_HOST], 0);
  ck_assert_uint_eq(r.narenas, 0);
  ck_assert_uint_eq(daemon_usage.arenas, 0);
  close(fd);
}
END_TEST

/* The chunks an import under way has mapped are the daemon's mappings too:
 * another session meets them in the daemon's count, and they leave it when
 * the import completes (as arenas) or is dropped. */
START_TEST(pending_chunks_count_for_the_daemon)
{
  mokd_registry r, other;
  mokd_arena *a, *b;
  uint64_t all = 0;
  mokd_limits lim = {.max_arena_bytes = 1u << 30, .quota = {0, 0}, .daemon_max_arenas = 5};
  int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING), fds[4] = {fd, fd, fd, fd};
  size_t pages[4] = {4096, 4096, 4096, 4096};

  ck_assert_int_eq(ftruncate(fd, 4096), 0);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  mokd_registry_init(&r, cpu, &next_id, &lim, &sess, &daemon_usage);
  mokd_registry_init(&other, cpu, &next_id, &lim, NULL, &daemon_usage);
  r.pending_all = other.pending_all = &all;
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_HOST_FD, 0, 8 * 4096, fds, pages, 4,
                                      &a, err), 0);
  ck_assert_uint_eq(all, 4);
  ck_assert_int_eq(mokd_arena_new(&other, 4096, ARENA_DAEMON, &b, err), 0); /* 4 + 1 */
  ck_assert_int_eq(mokd_arena_new(&other, 4096, ARENA_DAEMON, &b, err), MOK_EDQUOT);
  ck_assert_msg(strstr(err, "mokd holds 5 arenas for all sessions") != NULL, "%s", err);
  /* a continuation of another kind drops the import and its count */
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_CUMEM_FD, a->id, 8 * 4096, fds, pages, 4,
                                      &a, err), MOK_EINVAL);
  ck_assert_msg(strstr(err, "another kind (cuMem fd) than it began with (memfd)") != NULL, "%s",
                err);
  ck_assert_ptr_null(r.pending);
  ck_assert_uint_eq(all, 0);
  ck_assert_int_eq(mokd_arena_new(&other, 4096, ARENA_DAEMON, &b, err), 0);
  /* completed, its chunks move to the arenas */
  ck_assert_int_eq(mokd_import_chunks(&r, MOKK_IMPORT_HOST_FD, 0, 3 * 4096, fds, pages, 3, &a,
                                      err), 0);
  ck_assert_ptr_null(r.pending);
  ck_assert_uint_eq(all, 0);
  ck_assert_uint_eq(daemon_usage.arenas, 5);
  mokd_registry_clear(&r);
  mokd_registry_clear(&other);
  ck_assert_uint_eq(daemon_usage.arenas, 0);
  close(fd);
}
END_TEST

Suite *registry_suite(void)
{
  Suite *s = suite_create("registry");
  TCase *tc = tcase_create("registry");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, best_fit_reuses_the_smallest_hole);
  tcase_add_test(tc, release_many_equals_one_by_one);
  tcase_add_test(tc, output_arenas_follow_max_arena_bytes);
  tcase_add_test(tc, overflowing_and_misplaced_refs_are_refused);
  tcase_add_test(tc, another_sessions_arena_is_not_found);
  tcase_add_test(tc, quota_edges);
  tcase_add_test(tc, tenant_records_go_with_their_last_session);
  tcase_add_test(tc, host_imports_must_be_sealed);
  tcase_add_test(tc, imports_are_counted_and_charged);
  tcase_add_test(tc, chunked_imports_leave_nothing_behind);
  tcase_add_test(tc, pending_chunks_count_for_the_daemon);
  suite_add_tcase(s, tc);
  return s;
}
