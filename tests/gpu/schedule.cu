/* schedule.cu - the CUDA backend's schedule (route.cu, route_schedule)
 * against a stable counting sort on the host, entry for entry: counts,
 * segment starts, the three m-tile offsets, each pair's row, each row's pair
 * and router weight, and the status word. Every GEMM and combine reads its
 * rows in this order, so a schedule that sorts the same pairs into another
 * order would change bits without failing a tolerance. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cu_check.h"
#include "gemm.cuh"
#include "layer.h"
#include "route.h"

/* ids for case c: mostly uniform over E; some cases put every pair on one
 * expert, or mark pairs with no route (-1) and ids outside [0, E) */
static void make_ids(int32_t *ids, float *tw, int64_t TK, int E, int mode, uint32_t seed)
{
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t p = 0; p < TK; p++) {
    x = x * 1664525u + 1013904223u;
    uint32_t r = x >> 8;
    int id = (int)(r % (uint32_t)E);
    if (mode == 1)
      id = E / 2;
    else if (mode == 2 && r % 7 == 0)
      id = MOKK_NO_ROUTE;
    else if (mode == 3 && r % 11 == 0)
      id = r % 2 ? E + (int)(r % 5) : -2;
    else if (mode == 4)
      id = (int)(r % 3); /* a few experts with thousands of rows, the rest empty */
    ids[p] = id;
    tw[p] = (float)(r & 0xffff) / 65536.0f;
  }
}

typedef struct sched {
  int *count, *row_start, *tile_off, *slot, *src, status;
  float *row_w;
} sched;

static int sched_alloc(sched *s, int64_t TK, int E)
{
  s->count = (int *)calloc(E, sizeof(int));
  s->row_start = (int *)calloc(E + 1, sizeof(int));
  s->tile_off = (int *)calloc(route_tile_off_len(E), sizeof(int));
  s->slot = (int *)calloc(TK, sizeof(int));
  s->src = (int *)calloc(TK, sizeof(int));
  s->row_w = (float *)calloc(TK, sizeof(float));
  s->status = 0;
  return s->count && s->row_start && s->tile_off && s->slot && s->src && s->row_w ? 0 : -1;
}

static void sched_free(sched *s)
{
  free(s->count), free(s->row_start), free(s->tile_off);
  free(s->slot), free(s->src), free(s->row_w);
}

static void host_schedule(const int32_t *ids, const float *tw, int64_t TK, int E, sched *s)
{
  int *at = (int *)calloc(E, sizeof(int));
  for (int64_t p = 0; p < TK; p++) {
    int id = ids[p];
    if (id >= 0 && id < E)
      s->count[id]++;
    else if (id != MOKK_NO_ROUTE)
      s->status |= 1;
  }
  int rows = 0, tiles = 0, tall = 0, ride = 0;
  for (int e = 0; e < E; e++) {
    int c = s->count[e];
    s->row_start[e] = rows, s->tile_off[e] = tiles;
    s->tile_off[route_tile_off_at(E, ROUTE_TILES_TALL) + e] = tall;
    s->tile_off[route_tile_off_at(E, ROUTE_TILES_RIDE) + e] = ride;
    rows += c;
    tiles += (c + 127) / 128;
    tall += (c + 255) / 256;
    ride += mokk_ride_mtiles(c);
  }
  s->row_start[E] = rows, s->tile_off[E] = tiles;
  s->tile_off[route_tile_off_at(E, ROUTE_TILES_TALL) + E] = tall;
  s->tile_off[route_tile_off_at(E, ROUTE_TILES_RIDE) + E] = ride;
  for (int64_t p = 0; p < TK; p++) {
    int id = ids[p];
    if (id < 0 || id >= E) {
      s->slot[p] = -1;
      continue;
    }
    int r = s->row_start[id] + at[id]++;
    s->slot[p] = r;
    s->src[r] = (int)p;
    s->row_w[r] = tw[p];
  }
  free(at);
}

static int first_diff(const void *a, const void *b, int64_t n)
{
  const int *x = (const int *)a, *y = (const int *)b; /* float bits compare as ints */
  for (int64_t i = 0; i < n; i++)
    if (x[i] != y[i])
      return (int)i;
  return -1;
}

/* One case: 0 when the device's schedule is the host's, entry for entry. */
static int one_case(int64_t TK, int E, int mode, size_t scratch_bytes, char *msg, size_t len)
{
  int32_t *ids = (int32_t *)malloc(TK * 4);
  float *tw = (float *)malloc(TK * 4);
  sched want, got;
  int rc = -1, d;
  char *dev = NULL;
  size_t o_ids = 0, o_tw = o_ids + TK * 4, o_own = o_tw + TK * 4, o_cnt = o_own + TK * 4,
         o_rs = o_cnt + E * 4, o_to = o_rs + (E + 1) * 4, o_slot = o_to + route_tile_off_len(E) * 4,
         o_src = o_slot + TK * 4, o_rw = o_src + TK * 4, o_st = o_rw + TK * 4,
         o_scr = (o_st + 4 + 255) / 256 * 256, bytes = o_scr + scratch_bytes;

  memset(&want, 0, sizeof want), memset(&got, 0, sizeof got);
  if (ids == NULL || tw == NULL || sched_alloc(&want, TK, E) || sched_alloc(&got, TK, E)) {
    snprintf(msg, len, "out of host memory");
    goto out;
  }
  make_ids(ids, tw, TK, E, mode, (uint32_t)(TK * 31 + E));
  host_schedule(ids, tw, TK, E, &want);
  CU(cudaMalloc(&dev, bytes));
  /* poison: an entry the schedule fails to write shows */
  CU(cudaMemset(dev, 0x5a, bytes));
  CU(cudaMemset(dev + o_st, 0, 4));
  CU(cudaMemcpy(dev + o_ids, ids, TK * 4, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(dev + o_tw, tw, TK * 4, cudaMemcpyHostToDevice));
  route_schedule(0, (const int32_t *)(dev + o_ids), (const float *)(dev + o_tw), TK, E,
                 (int32_t *)(dev + o_own), (int *)(dev + o_cnt), (int *)(dev + o_rs),
                 (int *)(dev + o_to), (int *)(dev + o_slot), (int *)(dev + o_src),
                 (float *)(dev + o_rw), (int *)(dev + o_st), dev + o_scr, scratch_bytes);
  CU(cudaGetLastError());
  CU(cudaDeviceSynchronize());
  CU(cudaMemcpy(got.count, dev + o_cnt, E * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(got.row_start, dev + o_rs, (E + 1) * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(got.tile_off, dev + o_to, route_tile_off_len(E) * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(got.slot, dev + o_slot, TK * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(got.src, dev + o_src, TK * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(got.row_w, dev + o_rw, TK * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(&got.status, dev + o_st, 4, cudaMemcpyDeviceToHost));
  {
    int rows = want.row_start[E];
    const char *what = NULL;
    if ((d = first_diff(got.count, want.count, E)) >= 0)
      what = "count";
    else if ((d = first_diff(got.row_start, want.row_start, E + 1)) >= 0)
      what = "row_start";
    else if ((d = first_diff(got.tile_off, want.tile_off, (int)route_tile_off_len(E))) >= 0)
      what = "tile_off";
    else if ((d = first_diff(got.slot, want.slot, TK)) >= 0)
      what = "slot";
    else if ((d = first_diff(got.src, want.src, rows)) >= 0)
      what = "src";
    else if ((d = first_diff(got.row_w, want.row_w, rows)) >= 0)
      what = "row_w";
    else if (got.status != want.status)
      what = "status", d = 0;
    if (what != NULL) {
      snprintf(msg, len, "TK %lld, E %d, ids mode %d, scratch %zu: %s[%d] differs",
               (long long)TK, E, mode, scratch_bytes, what, d);
      goto out;
    }
  }
  rc = 0;
out:
  cudaFree(dev);
  free(ids), free(tw);
  sched_free(&want), sched_free(&got);
  return rc;
}

/* Cases: pairs fewer than a chunk, not a multiple of 32, and more than the
 * most chunks hold at 256 pairs; more experts than threads in the offsets'
 * block; scratch for one chunk only; every pair on one expert; pairs with no
 * route and ids out of range; experts on either side of SCHED_SMEM_E (the
 * counts in shared memory, or in hist). Returns the failures; msg says the first. */
extern "C" int schedule_check(char *msg, size_t len)
{
  static const struct {
    int64_t TK;
    int E, mode;
    size_t scratch; /* 0: as much as the chunks want */
  } cases[] = {
      {1, 1, 0, 0},           {5, 3, 0, 0},        {250, 64, 2, 0},    {4097, 128, 0, 0},
      {65536, 256, 0, 0},     {65536, 256, 1, 0},  {77777, 384, 3, 0}, {300001, 64, 2, 0},
      {20000, 3000, 0, 0},    {20000, 3000, 0, 4}, {9999, 1, 0, 0},    {40000, 96, 4, 0},
      {131072, 64, 0, 64 * 4 * 7}, {30000, 5000, 2, 0}, {4097, 4096, 1, 0},
      {5000, 4097, 3, 4},
  };
  int fails = 0;
  msg[0] = '\0';
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    size_t scratch = cases[i].scratch;
    if (scratch == 0)
      scratch = (size_t)256 * cases[i].E * 4;
    else if (scratch < (size_t)cases[i].E * 4)
      scratch = (size_t)cases[i].E * 4; /* the least route_schedule takes */
    char one[256];
    if (one_case(cases[i].TK, cases[i].E, cases[i].mode, scratch, one, sizeof one) != 0) {
      if (fails++ == 0)
        snprintf(msg, len, "%s", one);
    }
  }
  return fails;
}
