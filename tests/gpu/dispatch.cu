/* dispatch.cu - the CUDA backend's dispatch gathers (route.cu) against the
 * host, over P ranks' rows: the forward's xr is each row's token of x, bit
 * for bit, by the rows (route_gather) and token by token
 * (route_gather_tokens, here over the middle experts' rows, the rows
 * before and after them left alone); the backward's dy is bf16(router weight x d_out), bit for bit;
 * the d_topk_weights that the backward's gather computes in the same pass
 * are the bits route_dtw computes on its own (a spread step's ranks take
 * that one, so the two must agree for EP invariance), and near the host's
 * dot product; pairs with no route are written by route_dtw (zeros) and
 * left alone by the gather. The schedule itself is checked entry for entry
 * by schedule.cu; here it comes from route_schedule. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cu_check.h"
#include "gemm.cuh"
#include "layer.h"
#include "route.h"

#define POISON 0x5a5a5a5au

static uint32_t next(uint32_t *x)
{
  *x = *x * 1664525u + 1013904223u;
  return *x >> 8;
}

/* a bf16 in about [-2, 2) */
static uint16_t rnd_bf16(uint32_t *x)
{
  return mokk_f32_to_bf16(((float)(next(x) & 0xffff) - 32768.0f) / 16384.0f);
}

/* One case; 0 when every check holds, else msg says the first that failed. */
static int one_case(int64_t T, int K, int64_t H, int E, int P, int no_route, char *msg,
                    size_t len)
{
  const int64_t TK = P * T * K, TH = T * H;
  uint32_t seed = (uint32_t)(T * 7919 + K * 131 + H + E * 17 + P);
  uint16_t *dout = (uint16_t *)malloc(P * TH * 2), *y = (uint16_t *)malloc(TK * H * 2);
  uint16_t *xr = (uint16_t *)malloc(TK * H * 2), *dy = (uint16_t *)malloc(TK * H * 2);
  uint16_t *xt = (uint16_t *)malloc(TK * H * 2);
  int32_t *ids = (int32_t *)malloc(TK * 4);
  float *tw = (float *)malloc(TK * 4), *row_w = (float *)malloc(TK * 4);
  float *fused = (float *)malloc(TK * 4), *alone = (float *)malloc(TK * 4);
  int *slot = (int *)malloc(TK * 4), *src = (int *)malloc(TK * 4), rows = 0, rc = -1;
  int lo = 0, hi = 0; /* route_gather_tokens' rows: experts E / 4 .. E - E / 4 - 1 */
  char *dev = NULL;
  size_t o_dout = 0, o_y = o_dout + P * TH * 2, o_xr = o_y + TK * H * 2,
         o_xt = o_xr + TK * H * 2, o_dy = o_xt + TK * H * 2,
         o_ids = o_dy + TK * H * 2, o_tw = o_ids + TK * 4, o_own = o_tw + TK * 4,
         o_cnt = o_own + TK * 4, o_rs = o_cnt + E * 4, o_to = o_rs + (E + 1) * 4,
         o_slot = o_to + route_tile_off_len(E) * 4, o_src = o_slot + TK * 4, o_rw = o_src + TK * 4,
         o_st = o_rw + TK * 4, o_fused = o_st + 16, o_alone = o_fused + TK * 4,
         o_scr = (o_alone + TK * 4 + 255) / 256 * 256, scratch = (size_t)256 * E * 4,
         bytes = o_scr + scratch;

  if (!dout || !y || !xr || !xt || !dy || !ids || !tw || !row_w || !fused || !alone || !slot ||
      !src) {
    snprintf(msg, len, "out of host memory");
    goto out;
  }
  for (int64_t i = 0; i < P * TH; i++)
    dout[i] = rnd_bf16(&seed);
  for (int64_t i = 0; i < TK * H; i++)
    y[i] = rnd_bf16(&seed);
  for (int64_t p = 0; p < TK; p++) {
    uint32_t r = next(&seed);
    ids[p] = no_route && r % 5 == 0 ? MOKK_NO_ROUTE : (int32_t)(r % (uint32_t)E);
    tw[p] = (float)(next(&seed) & 0xffff) / 65536.0f;
  }
  CU(cudaMalloc(&dev, bytes));
  CU(cudaMemset(dev, 0x5a, bytes));
  CU(cudaMemset(dev + o_st, 0, 4));
  CU(cudaMemcpy(dev + o_dout, dout, P * TH * 2, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(dev + o_y, y, TK * H * 2, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(dev + o_ids, ids, TK * 4, cudaMemcpyHostToDevice));
  CU(cudaMemcpy(dev + o_tw, tw, TK * 4, cudaMemcpyHostToDevice));
  route_schedule(0, (const int32_t *)(dev + o_ids), (const float *)(dev + o_tw), TK, E,
                 (int32_t *)(dev + o_own), (int *)(dev + o_cnt), (int *)(dev + o_rs),
                 (int *)(dev + o_to), (int *)(dev + o_slot), (int *)(dev + o_src),
                 (float *)(dev + o_rw), (int *)(dev + o_st), dev + o_scr, scratch);
  {
    route_rows x;
    route_owners own;
    route_pairs pairs;
    memset(&x, 0, sizeof x), memset(&own, 0, sizeof own), memset(&pairs, 0, sizeof pairs);
    x.T = T;
    own.p[0] = dev + o_y, own.n = 1;
    pairs.n = T * K;
    for (int r = 0; r < P; r++) {
      x.p[r] = (const bf16 *)(dev + o_dout + r * TH * 2);
      pairs.p[r] = (float *)(dev + o_fused + r * T * K * 4);
    }
    const int *hi = (const int *)(dev + o_rs) + E, *sl = (const int *)(dev + o_slot),
              *sr = (const int *)(dev + o_src);
    /* few blocks: each sums many rows, in both halves of block_sum's space */
    route_gather(0, 7, x, sr, NULL, hi, K, H, (bf16 *)(dev + o_xr));
    const int *rs = (const int *)(dev + o_rs);
    route_gather_tokens(0, 6, x, sl, P * T, rs + E / 4, rs + E - E / 4, K, H,
                        (bf16 *)(dev + o_xt));
    route_gather_dy(0, 5, x, sr, NULL, hi, K, H, (const float *)(dev + o_rw),
                    (bf16 *)(dev + o_dy), own, pairs);
    for (int r = 0; r < P; r++)
      route_dtw(0, 3, (const bf16 *)(dev + o_dout + r * TH * 2), own, sl + r * T * K, T * K,
                K, H, (float *)(dev + o_alone + r * T * K * 4));
  }
  CU(cudaGetLastError());
  CU(cudaDeviceSynchronize());
  CU(cudaMemcpy(&rows, dev + o_rs + E * 4, 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(&lo, dev + o_rs + E / 4 * 4, 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(&hi, dev + o_rs + (E - E / 4) * 4, 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(slot, dev + o_slot, TK * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(src, dev + o_src, TK * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(row_w, dev + o_rw, TK * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(xr, dev + o_xr, TK * H * 2, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(xt, dev + o_xt, TK * H * 2, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(dy, dev + o_dy, TK * H * 2, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(fused, dev + o_fused, TK * 4, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(alone, dev + o_alone, TK * 4, cudaMemcpyDeviceToHost));
  snprintf(msg, len, "T %lld, K %d, H %lld, E %d, P %d: ", (long long)T, K, (long long)H, E, P);
  for (int row = 0; row < rows; row++) {
    const uint16_t *d = dout + (int64_t)(src[row] / K) * H;
    for (int64_t c = 0; c < H; c++) {
      if (xr[row * H + c] != d[c]) {
        snprintf(msg + strlen(msg), len - strlen(msg), "xr[%d][%lld] is not x's", row,
                 (long long)c);
        goto out;
      }
      const int in = row >= lo && row < hi;
      if (xt[row * H + c] != (in ? d[c] : (uint16_t)POISON)) {
        snprintf(msg + strlen(msg), len - strlen(msg), "token by token, row %d [%lld] is "
                 "0x%04x, want %s (rows %d .. %d)", row, (long long)c, xt[row * H + c],
                 in ? "x's" : "it untouched", lo, hi - 1);
        goto out;
      }
      uint16_t want = mokk_f32_to_bf16(row_w[row] * mokk_bf16_to_f32(d[c]));
      if (dy[row * H + c] != want) {
        snprintf(msg + strlen(msg), len - strlen(msg), "dy[%d][%lld] 0x%04x, want 0x%04x",
                 row, (long long)c, dy[row * H + c], want);
        goto out;
      }
    }
  }
  for (int64_t p = 0; p < TK; p++) {
    uint32_t fb, ab;
    memcpy(&fb, &fused[p], 4), memcpy(&ab, &alone[p], 4);
    if (slot[p] < 0) {
      if (ab != 0 || fb != POISON) {
        snprintf(msg + strlen(msg), len - strlen(msg), "pair %lld has no route: route_dtw "
                 "wrote 0x%08x (want 0), the gather 0x%08x (want it untouched)", (long long)p,
                 ab, fb);
        goto out;
      }
      continue;
    }
    if (fb != ab) {
      snprintf(msg + strlen(msg), len - strlen(msg), "pair %lld: d_topk_weights %.9g from the "
               "gather, %.9g from route_dtw", (long long)p, fused[p], alone[p]);
      goto out;
    }
    const uint16_t *d = dout + (p / K) * H, *v = y + (int64_t)slot[p] * H;
    double want = 0, mag = 0;
    for (int64_t c = 0; c < H; c++) {
      double t = (double)mokk_bf16_to_f32(d[c]) * mokk_bf16_to_f32(v[c]);
      want += t, mag += fabs(t);
    }
    if (fabs(fused[p] - want) > 1e-5 * mag + 1e-30) {
      snprintf(msg + strlen(msg), len - strlen(msg), "pair %lld: d_topk_weights %.9g, the "
               "host's %.9g", (long long)p, fused[p], want);
      goto out;
    }
  }
  msg[0] = '\0';
  rc = 0;
out:
  cudaFree(dev);
  free(dout), free(y), free(xr), free(xt), free(dy), free(ids), free(tw), free(row_w);
  free(fused), free(alone), free(slot), free(src);
  return rc;
}

/* Cases: one token; rows shorter than a block's chunks (H 64); rows of
 * seven chunks a thread (H 7168: a batch of four and one of three); pairs
 * with no route; two and three ranks; token by token, every row (E 1) or
 * rows both before and after the range. Returns the failures; msg says the
 * first. */
extern "C" int dispatch_check(char *msg, size_t len)
{
  static const struct {
    int64_t T;
    int K;
    int64_t H;
    int E, P, no_route;
  } cases[] = {
      {1, 1, 64, 1, 1, 0},      {37, 4, 64, 8, 1, 1},   {300, 8, 2048, 64, 2, 0},
      {129, 6, 7168, 32, 1, 1}, {200, 2, 1088, 5, 3, 1},
  };
  int fails = 0;
  msg[0] = '\0';
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char one[512];
    if (one_case(cases[i].T, cases[i].K, cases[i].H, cases[i].E, cases[i].P, cases[i].no_route,
                 one, sizeof one) != 0 &&
        fails++ == 0)
      snprintf(msg, len, "%s", one);
  }
  return fails;
}
