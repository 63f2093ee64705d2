/* check_impcache.c - the decisions of libmok's cache of imported GPU memory,
 * driven with made-up chunk lists: chunks of 0x100 bytes from 0x1000, each
 * allocation named by its buffer id. */
#include <check.h>
#include <stdlib.h>

#include "impcache.h"
#include "ref.h"

#define CB 0x100u
#define AT(i) ((uintptr_t)0x1000 + (uintptr_t)(i) * CB)

/* The allocations mapped now: chunk i holds buffer id ids[i]. */
static mok_cuda_alloc chunk(int i, unsigned long long id)
{
  return (mok_cuda_alloc){.base = AT(i), .bytes = CB, .buffer_id = id, .device = 0};
}

/* Chunks [from, to) of the mapping ids, as a walk finds them. */
static mok_cuda_alloc *walk(const unsigned long long *ids, int from, int to)
{
  mok_cuda_alloc *w = calloc((size_t)(to - from), sizeof *w);
  for (int i = from; i < to; i++)
    w[i - from] = chunk(i, ids[i]);
  return w;
}

/* An entry imported over chunks [from, to) of ids. */
static mok_imp entry(const unsigned long long *ids, int from, int to, uint64_t arena)
{
  return (mok_imp){AT(from), (size_t)(to - from) * CB, walk(ids, from, to), to - from, arena, 0,
                   0};
}

static void entries_free(mok_imp *m, int n)
{
  for (int i = 0; i < n; i++)
    free(m[i].chunks);
}

START_TEST(chunk_at_finds_the_chunk_that_holds_an_address)
{
  unsigned long long ids[4] = {1, 2, 3, 4};
  mok_imp m = entry(ids, 1, 4, 7);
  ck_assert_int_eq(mok_imp_chunk_at(&m, AT(0) + CB - 1), -1);
  ck_assert_int_eq(mok_imp_chunk_at(&m, AT(1)), 0);
  ck_assert_int_eq(mok_imp_chunk_at(&m, AT(2) - 1), 0);
  ck_assert_int_eq(mok_imp_chunk_at(&m, AT(2)), 1);
  ck_assert_int_eq(mok_imp_chunk_at(&m, AT(4) - 1), 2);
  ck_assert_int_eq(mok_imp_chunk_at(&m, AT(4)), -1);
  entries_free(&m, 1);
}
END_TEST

/* A hit is found by the chunk at ptr alone; the chunks after it are named
 * for the caller to check, and a range past the entry is no hit. */
START_TEST(lookup_finds_by_the_first_chunk_and_names_the_rest)
{
  unsigned long long ids[4] = {1, 2, 3, 4};
  mok_imp m[2] = {entry(ids, 0, 1, 10), entry(ids, 1, 4, 11)};
  mok_cuda_alloc c1 = chunk(1, 2), c1_new = chunk(1, 99);
  int from = -1, to = -1;

  ck_assert_int_eq(mok_imp_lookup(m, 2, &c1, AT(1) + 16, AT(3) + 8, &from, &to), 1);
  ck_assert_int_eq(from, 0);
  ck_assert_int_eq(to, 2);
  ck_assert_int_eq(mok_imp_lookup(m, 2, &c1, AT(1), AT(2), &from, &to), 1);
  ck_assert_int_eq(to, 0); /* ends at a chunk's end: that chunk is the last touched */
  ck_assert_int_eq(mok_imp_lookup(m, 2, &c1, AT(1), AT(4) + 1, &from, &to), -1);
  ck_assert_int_eq(mok_imp_lookup(m, 2, &c1_new, AT(1), AT(2), &from, &to), -1);
  m[1].retired = 1;
  ck_assert_int_eq(mok_imp_lookup(m, 2, &c1, AT(1), AT(2), &from, &to), -1);
  entries_free(m, 2);
}
END_TEST

/* An entry whose allocations were freed and made again is stale where the
 * new ones overlap it, and only there. */
START_TEST(stale_is_an_overlap_with_other_allocations)
{
  unsigned long long ids[4] = {1, 2, 3, 4}, now[4] = {1, 20, 3, 4};
  mok_imp m = entry(ids, 0, 3, 5);
  mok_cuda_alloc *w01 = walk(now, 0, 1), *w13 = walk(now, 1, 3), *w34 = walk(now, 3, 4);
  ck_assert(!mok_imp_stale(&m, w01, 1));
  ck_assert(mok_imp_stale(&m, w13, 2));
  ck_assert(!mok_imp_stale(&m, w34, 1)); /* no overlap */
  ck_assert(mok_imp_matches(&m, w34, 1));
  free(w01), free(w13), free(w34);
  entries_free(&m, 1);
}
END_TEST

/* The union grows over every good entry the range reaches, through one
 * another, and leaves out stale and retired ones. */
START_TEST(union_reaches_good_entries_through_each_other)
{
  unsigned long long ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  mok_imp m[4] = {entry(ids, 0, 2, 1), entry(ids, 3, 5, 2), entry(ids, 4, 6, 3),
                  entry(ids, 7, 8, 4)};
  mok_cuda_alloc *w = walk(ids, 1, 4);
  uintptr_t lo = AT(1), hi = AT(4);

  ck_assert(mok_imp_union(m, 4, w, 3, &lo, &hi));
  ck_assert_uint_eq(lo, AT(0));
  ck_assert_uint_eq(hi, AT(6)); /* entry 2 through entry 1; entry 3 touches nothing */
  lo = AT(1), hi = AT(4);
  m[1].retired = 1;
  ck_assert(mok_imp_union(m, 4, w, 3, &lo, &hi));
  ck_assert_uint_eq(hi, AT(4));
  m[0].chunks[1].buffer_id = 77; /* chunk 1 was another allocation when m[0] was made */
  lo = AT(1), hi = AT(4);
  ck_assert(!mok_imp_union(m, 4, w, 3, &lo, &hi));
  ck_assert_uint_eq(lo, AT(1));
  ck_assert_uint_eq(hi, AT(4));
  free(w);
  entries_free(m, 4);
}
END_TEST

START_TEST(covered_entries_are_those_inside_with_the_same_chunks)
{
  unsigned long long ids[4] = {1, 2, 3, 4};
  mok_imp in = entry(ids, 1, 3, 1), out = entry(ids, 2, 4, 2);
  mok_cuda_alloc *w = walk(ids, 0, 3);
  ck_assert(mok_imp_covered(&in, w, 3));
  ck_assert(!mok_imp_covered(&out, w, 3));
  w[1].buffer_id = 9;
  ck_assert(!mok_imp_covered(&in, w, 3));
  free(w);
  entries_free(&in, 1), entries_free(&out, 1);
}
END_TEST

START_TEST(idle_means_not_handed_out_since_the_last_request)
{
  mok_imp m = {.used = 4};
  ck_assert(!mok_imp_idle(&m, 4));
  ck_assert(mok_imp_idle(&m, 5));
}
END_TEST

/* Activations at shifting offsets of one expandable segment: each step's
 * miss imports the union of its range and the entries it overlaps, which it
 * covers, so one entry stays live however many steps run. */
START_TEST(shifting_windows_leave_one_live_entry)
{
  enum { NC = 64, STEPS = 40 };
  unsigned long long ids[NC];
  mok_imp m[STEPS + 1];
  int n = 0, live = 0;

  for (int i = 0; i < NC; i++)
    ids[i] = 100 + (unsigned long long)i;
  for (int step = 0; step < STEPS; step++) {
    int from = step % 7, to = from + 3 + step % 5, a = 0, b = -1;
    mok_cuda_alloc first = chunk(from, ids[from]), *w;
    uintptr_t lo = AT(from), hi = AT(to);
    if (mok_imp_lookup(m, n, &first, AT(from) + 8, AT(to), &a, &b) >= 0)
      continue;
    w = walk(ids, from, to);
    if (mok_imp_union(m, n, w, to - from, &lo, &hi)) {
      free(w);
      w = walk(ids, (int)((lo - AT(0)) / CB), (int)((hi - AT(0)) / CB));
    }
    int nw = (int)((hi - lo) / CB);
    for (int i = 0; i < n; i++)
      if (mok_imp_covered(&m[i], w, nw))
        m[i].retired = 1;
    m[n++] = (mok_imp){lo, hi - lo, w, nw, (uint64_t)step, 0, 0};
  }
  for (int i = 0; i < n; i++)
    live += !m[i].retired;
  ck_assert_int_eq(live, 1);
  entries_free(m, n);
}
END_TEST

Suite *impcache_suite(void)
{
  Suite *s = suite_create("impcache");
  TCase *tc = tcase_create("decisions");
  tcase_add_test(tc, chunk_at_finds_the_chunk_that_holds_an_address);
  tcase_add_test(tc, lookup_finds_by_the_first_chunk_and_names_the_rest);
  tcase_add_test(tc, stale_is_an_overlap_with_other_allocations);
  tcase_add_test(tc, union_reaches_good_entries_through_each_other);
  tcase_add_test(tc, covered_entries_are_those_inside_with_the_same_chunks);
  tcase_add_test(tc, idle_means_not_handed_out_since_the_last_request);
  tcase_add_test(tc, shifting_windows_leave_one_live_entry);
  suite_add_tcase(s, tc);
  return s;
}
