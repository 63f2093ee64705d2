/* check_daemon_fair.c - the fair queue through the daemon: one executor
 * thread, tenants told apart by the job id their clients send. Assertions
 * count steps served (client side), never wall-clock time. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon_fixture.h"
#include "testbed.h"

enum { NHEAVY = 8, T = 256 };

typedef struct tenant_client {
  mok_client *c;
  mok_testbed tb;
  void *first;             /* the first output: every later one must equal it */
  atomic_int *served;      /* the tenant's steps answered */
  atomic_int *stop;
  int wrong;
  pthread_t th;
} tenant_client;

static void client_open(tenant_client *tc, const char *job, uint64_t seed, atomic_int *served,
                        atomic_int *stop)
{
  mok_layer_desc d = {.hidden = 128, .intermediate = 64, .experts = 8, .top_k = 2};

  memset(tc, 0, sizeof *tc);
  setenv("MOKD_JOB_ID", job, 1); /* read at connect, before any thread runs */
  ck_assert_int_eq(mok_connect(sock, "fair", &tc->c), 0);
  ck_assert_int_eq(mok_testbed_setup(tc->c, &d, T, seed, &tc->tb), 0);
  tc->served = served;
  tc->stop = stop;
}

/* one step; its output never depends on what ran around it */
static int client_step(tenant_client *tc)
{
  mok_forward_result f;
  size_t bytes = (size_t)T * 128 * 2;

  if (mok_forward(tc->c, tc->tb.layer, &tc->tb.x, &tc->tb.ids, &tc->tb.tw, 1, &f) != 0)
    return -1;
  if (tc->first == NULL) {
    tc->first = malloc(bytes);
    memcpy(tc->first, f.out_ptr, bytes);
  } else if (memcmp(tc->first, f.out_ptr, bytes) != 0) {
    tc->wrong++;
  }
  return mok_release(tc->c, &f.context, 1);
}

static void *saturate(void *p)
{
  tenant_client *tc = p;
  while (!atomic_load(tc->stop)) {
    if (client_step(tc) != 0) {
      tc->wrong++;
      break;
    }
    atomic_fetch_add(tc->served, 1);
  }
  return NULL;
}

static void client_close(tenant_client *tc)
{
  ck_assert_int_eq(tc->wrong, 0);
  free(tc->first);
  mok_close(tc->c);
}

static void wait_served(atomic_int *a, atomic_int *b, int n)
{
  while (atomic_load(a) + (b != NULL ? atomic_load(b) : 0) < n)
    usleep(1000);
}

/* Eight heavy sessions keep the executor's queue full; a light one's step
 * is served within a few heavy steps, not behind all of them as in FIFO
 * (where about NHEAVY - 1 would go first each time). Counted over ten light
 * steps: a heavy client counts its reply a moment after the daemon sent it. */
START_TEST(light_tenant_served_within_few_heavy_steps)
{
  own_daemon od;
  tenant_client heavy[NHEAVY], light;
  atomic_int served = 0, light_served = 0, stop = 0;
  int total = 0;

  own_daemon_start(&od, "fair", "--executor-threads=1 --cpu-threads=1");
  for (int i = 0; i < NHEAVY; i++)
    client_open(&heavy[i], "heavy", (uint64_t)i, &served, &stop);
  client_open(&light, "light", 99, &light_served, &stop);
  for (int i = 0; i < NHEAVY; i++)
    pthread_create(&heavy[i].th, NULL, saturate, &heavy[i]);
  wait_served(&served, NULL, 4 * NHEAVY);
  for (int k = 0; k < 10; k++) {
    int before = atomic_load(&served);
    ck_assert_int_eq(client_step(&light), 0);
    total += atomic_load(&served) - before;
  }
  atomic_store(&stop, 1);
  for (int i = 0; i < NHEAVY; i++) {
    pthread_join(heavy[i].th, NULL);
    client_close(&heavy[i]);
  }
  client_close(&light);
  unsetenv("MOKD_JOB_ID");
  own_daemon_stop(&od);
  /* per light step: the heavy one running, the one tied with it, and now
   * and then one counted late by its client; FIFO makes it about 7 */
  ck_assert_msg(total <= 30, "%d heavy steps were served while 10 light ones waited", total);
}
END_TEST

/* Two tenants of four sessions each, both saturating, weights 3 and 1: in a
 * window of 200 steps the first gets about three times the second's. */
START_TEST(weights_three_to_one_share_steps)
{
  own_daemon od;
  tenant_client a[4], b[4];
  atomic_int na = 0, nb = 0, stop = 0;
  int a0, b0, da, db;

  own_daemon_start(&od, "weights",
                   "--executor-threads=1 --cpu-threads=1 --tenant-weights=job:a=3,job:b=1");
  for (int i = 0; i < 4; i++) {
    client_open(&a[i], "a", (uint64_t)i, &na, &stop);
    client_open(&b[i], "b", (uint64_t)(10 + i), &nb, &stop);
  }
  for (int i = 0; i < 4; i++) {
    pthread_create(&a[i].th, NULL, saturate, &a[i]);
    pthread_create(&b[i].th, NULL, saturate, &b[i]);
  }
  wait_served(&na, &nb, 40);
  a0 = atomic_load(&na), b0 = atomic_load(&nb);
  wait_served(&na, &nb, a0 + b0 + 200);
  da = atomic_load(&na) - a0, db = atomic_load(&nb) - b0;
  atomic_store(&stop, 1);
  for (int i = 0; i < 4; i++) {
    pthread_join(a[i].th, NULL);
    pthread_join(b[i].th, NULL);
    client_close(&a[i]);
    client_close(&b[i]);
  }
  unsetenv("MOKD_JOB_ID");
  own_daemon_stop(&od);
  ck_assert_msg(db > 0 && da >= 5 * db / 2 && 2 * da <= 7 * db,
                "weights 3:1 served %d:%d steps", da, db);
}
END_TEST

Suite *daemon_fair_suite(void)
{
  Suite *s = suite_create("daemon_fair");
  TCase *tc = tcase_create("fair");

  tcase_add_checked_fixture(tc, plain_setup, plain_teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, light_tenant_served_within_few_heavy_steps);
  tcase_add_test(tc, weights_three_to_one_share_steps);
  suite_add_tcase(s, tc);
  return s;
}
