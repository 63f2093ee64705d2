/* route.cu - moving rows between tokens and experts: the schedule (a stable
 * counting sort of the (token, k) pairs by expert, rows of an expert by
 * token then k), the dispatch gather, the combines that sum a token's pairs
 * in k order, and d_topk_weights. No floating-point atomics: the only atomic
 * is an integer OR on the error flag. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gemm.cuh"
#include "layer.h"
#include "route.h"

#define SCHED_THREADS 256


/* ---- schedule ------------------------------------------------------------ */

/* The ids are the client's memory, which it may still be writing: copy them
 * once, checked, and let every later kernel read the copy, so the counts and
 * the slots are taken from the same values. -1 (no route, as DeepEP and
 * Megatron mark a pair) drops its pair, as the CPU engine does; any other id
 * outside [0, E) becomes -1 too, and the status word says so. */
__global__ void k_ids(const int32_t *ids, int64_t TK, int E, int32_t *own, int *slot,
                      int *status)
{
  for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < TK;
       p += (int64_t)gridDim.x * blockDim.x) {
    int id = ids[p];
    if (id < 0 || id >= E) {
      if (id != MOKK_NO_ROUTE)
        atomicOr(status, 1); /* an integer flag: the order does not matter */
      id = -1;
      slot[p] = -1;
    }
    own[p] = id;
  }
}

/* Block e counts the pairs routed to expert e. */
__global__ void k_count(const int32_t *ids, int64_t TK, int *count)
{
  __shared__ int part[SCHED_THREADS / 32];
  int e = blockIdx.x, n = 0;

  for (int64_t p = threadIdx.x; p < TK; p += blockDim.x)
    n += ids[p] == e;
  for (int o = 16; o > 0; o >>= 1)
    n += __shfl_xor_sync(0xffffffffu, n, o);
  if ((threadIdx.x & 31) == 0)
    part[threadIdx.x >> 5] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (int w = 0; w < SCHED_THREADS / 32; w++)
      s += part[w];
    count[e] = s;
  }
}

/* One thread: segment starts and m-tile offsets (of 128 and of 256 rows, and
 * of 128 rows with riding tails), in expert order. */
__global__ void k_scan(const int *count, int E, int *row_start, int *tile_off)
{
  int rows = 0, tiles = 0, tall = 0, ride = 0;
  for (int e = 0; e < E; e++) {
    int c = count[e], tail = c % G_BM;
    row_start[e] = rows;
    tile_off[e] = tiles;
    tile_off[E + 1 + e] = tall;
    tile_off[2 * (E + 1) + e] = ride;
    rows += c;
    tiles += (c + G_BM - 1) / G_BM;
    tall += (c + 2 * G_BM - 1) / (2 * G_BM);
    /* a tail of up to MOKK_RIDE_ROWS rows rides on the last full m-tile */
    ride += c / G_BM + (tail > 0 && (c < G_BM || tail > MOKK_RIDE_ROWS));
  }
  tile_off[E] = tiles;
  tile_off[2 * E + 1] = tall;
  tile_off[3 * E + 2] = ride;
  row_start[E] = rows; /* total rows */
}

/* Block e gives its pairs consecutive rows in pair order (token, then k). */
__global__ void k_slots(const int32_t *ids, const float *tw, int64_t TK, const int *row_start,
                        int *slot, int *src, float *row_w)
{
  __shared__ int warp_n[SCHED_THREADS / 32];
  __shared__ int base;
  int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  if (threadIdx.x == 0)
    base = row_start[e];
  __syncthreads();
  for (int64_t p0 = 0; p0 < TK; p0 += SCHED_THREADS) {
    int64_t p = p0 + threadIdx.x;
    int hit = p < TK && ids[p] == e;
    unsigned b = __ballot_sync(0xffffffffu, hit);
    if (lane == 0)
      warp_n[warp] = __popc(b);
    __syncthreads();
    int before = base;
    for (int w = 0; w < warp; w++)
      before += warp_n[w];
    if (hit) {
      int row = before + __popc(b & ((1u << lane) - 1));
      slot[p] = row;
      src[row] = (int)p;
      row_w[row] = tw[p];
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 0; w < SCHED_THREADS / 32; w++)
        base += warp_n[w];
    __syncthreads();
  }
}

/* ---- dispatch and combine -------------------------------------------------- */

/* Rows [*lo, *hi): xr[row] = x[token of row]; with scale, also dy[row] = w *
 * x[token] (bf16). */
__global__ void k_gather(route_rows x, const int *src, const int *lo, const int *hi, int K,
                         int64_t H, bf16 *xr, const float *row_w, bf16 *dy)
{
  int first = lo != NULL ? *lo : 0, rows = *hi;
  for (int row = first + blockIdx.x; row < rows; row += gridDim.x) {
    int64_t t = src[row] / K;
    const bf16 *s = x.p[t / x.T] + (t % x.T) * H;
    for (int64_t c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
      uint4 v = *(const uint4 *)(s + c);
      *(uint4 *)(xr + (int64_t)row * H + c) = v;
      if (dy != NULL) {
        union { uint4 v; bf16 h[8]; } in, o;
        in.v = v;
        for (int j = 0; j < 8; j++)
          o.h[j] = __float2bfloat16_rn(__fmul_rn(row_w[row], __bfloat162float(in.h[j])));
        *(uint4 *)(dy + (int64_t)row * H + c) = o.v;
      }
    }
  }
}

/* Where row r of a spread schedule lives (route_owners). */
template <typename V>
__device__ __forceinline__ const V *owned_row(const route_owners &o, int r, int64_t H)
{
  int q = 0;
  for (int i = 1; i < o.n; i++)
    if (r >= o.row_start[i * o.El])
      q = i;
  return (const V *)o.p[q] + (int64_t)r * H;
}

/* Eight consecutive elements of a row as fp32: one 16-byte load of bf16, two
 * of fp32. */
__device__ __forceinline__ void load8(const bf16 *p, float (&o)[8])
{
  union { uint4 v; bf16 h[8]; } u;
  u.v = *(const uint4 *)p;
#pragma unroll
  for (int j = 0; j < 8; j++)
    o[j] = __bfloat162float(u.h[j]);
}

__device__ __forceinline__ void load8(const float *p, float (&o)[8])
{
  float4 a = *(const float4 *)p, b = *(const float4 *)(p + 4);
  o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w;
  o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
}

/* out[t] = bf16( sum_k [tw[t,k] *] v[t,k]  (k ascending)  + extra[t] ): the
 * forward's combine (bf16 y, router weights, shared ys) and the backward's
 * d_x (fp32 rows, no weights, shared part). tw and extra may be NULL. Each
 * thread owns eight columns; every element is summed in the same order. */
template <typename V, typename X>
__global__ void k_combine(route_owners v, const int *slot, const float *tw, const X *extra,
                          int64_t T, int K, int64_t H, bf16 *out)
{
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
    for (int64_t c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, x[8];
      for (int k = 0; k < K; k++) {
        int r = slot[t * K + k];
        if (r < 0)
          continue;
        load8(owned_row<V>(v, r, H) + c, x);
#pragma unroll
        for (int j = 0; j < 8; j++)
          acc[j] = __fadd_rn(acc[j], tw != NULL ? __fmul_rn(tw[t * K + k], x[j]) : x[j]);
      }
      if (extra != NULL) {
        load8(extra + t * H + c, x);
#pragma unroll
        for (int j = 0; j < 8; j++)
          acc[j] = __fadd_rn(acc[j], x[j]);
      }
      union { uint4 v; bf16 h[8]; } o;
#pragma unroll
      for (int j = 0; j < 8; j++)
        o.h[j] = __float2bfloat16_rn(acc[j]);
      *(uint4 *)(out + t * H + c) = o.v;
    }
}

/* d_topk_weights[t,k] = sum_h d_out[t,h] y[t,k,h]: a warp per pair, each lane
 * sums its eight-column groups in order, then a fixed butterfly. */
__global__ void k_dtw(const bf16 *d_out, route_owners y, const int *slot, int64_t TK, int K,
                      int64_t H, float *dtw)
{
  int lane = threadIdx.x & 31;
  int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t p = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5); p < TK;
       p += warps) {
    int r = slot[p];
    float acc = 0.0f;
    if (r >= 0) {
      const bf16 *d = d_out + (p / K) * H, *v = owned_row<bf16>(y, r, H);
      for (int64_t c = lane * 8; c < H; c += 32 * 8) {
        float a[8], b[8];
        load8(d + c, a);
        load8(v + c, b);
#pragma unroll
        for (int j = 0; j < 8; j++)
          acc = __fadd_rn(acc, __fmul_rn(a[j], b[j]));
      }
    }
    for (int o = 16; o > 0; o >>= 1)
      acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (lane == 0)
      dtw[p] = acc;
  }
}

/* ---- launches ------------------------------------------------------------- */

void route_schedule(cudaStream_t st, const int32_t *ids, const float *tw, int64_t TK, int E,
                    int32_t *own_ids, int *count, int *row_start, int *tile_off, int *slot,
                    int *src, float *row_w, int *status)
{
  int64_t blocks = (TK + SCHED_THREADS - 1) / SCHED_THREADS;
  k_ids<<<(int)(blocks < 1024 ? (blocks > 0 ? blocks : 1) : 1024), SCHED_THREADS, 0, st>>>(
      ids, TK, E, own_ids, slot, status);
  k_count<<<E, SCHED_THREADS, 0, st>>>(own_ids, TK, count);
  k_scan<<<1, 1, 0, st>>>(count, E, row_start, tile_off);
  k_slots<<<E, SCHED_THREADS, 0, st>>>(own_ids, tw, TK, row_start, slot, src, row_w);
}

void route_gather(cudaStream_t st, int grid, route_rows x, const int *src, const int *lo,
                  const int *hi, int K, int64_t H, bf16 *xr, const float *row_w, bf16 *dy)
{
  k_gather<<<grid, 128, 0, st>>>(x, src, lo, hi, K, H, xr, row_w, dy);
}

void route_combine_out(cudaStream_t st, int grid, route_owners y, const int *slot,
                       const float *tw, const bf16 *ys, int64_t T, int K, int64_t H, bf16 *out)
{
  k_combine<bf16><<<grid, 256, 0, st>>>(y, slot, tw, ys, T, K, H, out);
}

void route_combine_dx(cudaStream_t st, int grid, route_owners dxr, const int *slot,
                      const float *dxs, int64_t T, int K, int64_t H, bf16 *dx)
{
  k_combine<float><<<grid, 256, 0, st>>>(dxr, slot, (const float *)NULL, dxs, T, K, H, dx);
}

void route_dtw(cudaStream_t st, int grid, const bf16 *d_out, route_owners y, const int *slot,
               int64_t TK, int K, int64_t H, float *dtw)
{
  k_dtw<<<grid, 256, 0, st>>>(d_out, y, slot, TK, K, H, dtw);
}
