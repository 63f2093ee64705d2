/* route.h - the row movement of the CUDA backend (route.cu), queued on a
 * stream; each returns at once and leaves launch errors to cudaGetLastError. */
#ifndef MOKK_CUDA_ROUTE_H
#define MOKK_CUDA_ROUTE_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

/* The schedule of T K pairs over E experts: count[e], row_start[e] (and the
 * total at row_start[E]), tile_off (route_tile_off_at: m-tiles of 128 rows
 * before e, the total at [E]; the same for m-tiles of 256 rows, and for
 * m-tiles of 128 rows with riding tails (gemm_args.tile_off_ride); then E
 * zeros, route_gather_ahead's ready counts, so that no memset stands
 * between the schedule and the dispatch), each pair's row in
 * slot (-1 for a pair with no route, id -1; -1 and bit 0 of status for any
 * other id outside [0, E); status NULL: not flagged), each row's pair in
 * src and its router weight.
 * The ids are read once, into own_ids (TK ints), which the rest reads.
 * scratch: device memory free until the schedule has run (the gathered
 * rows' space serves), 4-byte aligned, at least E ints; more lets more
 * warps share the work (route.cu, sched_split). */
void route_schedule(cudaStream_t st, const int32_t *ids, const float *tw, int64_t TK, int E,
                    int32_t *own_ids, int *count, int *row_start, int *tile_off, int *slot,
                    int *src, float *row_w, int *status, void *scratch, size_t scratch_bytes);

/* tile_off's tables, in order: m-tiles of 128 rows, of 256, of 128 with
 * riding tails (each E + 1 entries), then the E ready counts. */
enum { ROUTE_TILES_WIDE, ROUTE_TILES_TALL, ROUTE_TILES_RIDE, ROUTE_READY };

/* Where table `which` of tile_off starts, and the ints tile_off holds. */
__host__ __device__ static inline int64_t route_tile_off_at(int E, int which)
{
  return (int64_t)which * (E + 1);
}

__host__ __device__ static inline int64_t route_tile_off_len(int E)
{
  return route_tile_off_at(E, ROUTE_READY) + E;
}
/* Most EP ranks one step runs on one device (virtual ranks). */
#define ROUTE_MAX_RANKS 8

/* Rows of P ranks' [T, H] tensors as one [P T, H]: global token t is row
 * t % T of rank t / T's. Passed by value: no copy of the rows. */
typedef struct route_rows {
  const bf16 *p[ROUTE_MAX_RANKS];
  int64_t T;
} route_rows;

/* Rows of one schedule spread over the ranks that own their experts (an EP
 * step with a buffer set per rank): row r, global, is in the buffer of the
 * rank q whose experts' segments hold it (row_start[q El] <= r <
 * row_start[(q + 1) El]), at the same index r. n = 1: every row in p[0]. */
typedef struct route_owners {
  const void *p[ROUTE_MAX_RANKS];
  const int *row_start;
  int El, n;
} route_owners;

/* Outputs of P ranks' [n] arrays as one [P n]: global pair p is entry p %
 * n of rank p / n's. */
typedef struct route_pairs {
  float *p[ROUTE_MAX_RANKS];
  int64_t n;
} route_pairs;

/* Rows [*lo, *hi) of the schedule (lo NULL: from 0): xr[row] = x[token of
 * row]. */
void route_gather(cudaStream_t st, int grid, route_rows x, const int *src, const int *lo,
                  const int *hi, int K, int64_t H, bf16 *xr);
/* The same rows token by token: each of the `tokens` rows of x read once
 * and stored to the rows slot gives its K pairs (those in [*lo, *hi)). */
void route_gather_tokens(cudaStream_t st, int grid, route_rows x, const int *slot,
                         int64_t tokens, const int *lo, const int *hi, int K, int64_t H,
                         bf16 *xr);
/* The same for every row of the schedule, on `blocks` blocks, meant to run
 * beside the gate/up GEMM (gemm_args.ready): row after row in schedule
 * order, ready[e] counting expert e's rows as they land (zero it first).
 * Hopper and later; rows of H whose shape route_gather_ahead_fits. */
bool route_gather_ahead_fits(int E, int64_t H);
cudaError_t route_gather_ahead(cudaStream_t st, int blocks, route_rows x, const int *src,
                               const int *row_start, int E, int K, int64_t H, bf16 *xr,
                               int *ready);
/* The backward's dispatch of rows [*lo, *hi): dy[row] = bf16(row_w[row]
 * d_out[token of row]); with dtw.p[0] != NULL, also each row's pair's
 * d_topk_weights, dot(d_out[token], y[row]) in route_dtw's order, into
 * dtw (pairs with no row are not written). dy may be y's rows themselves
 * (one owner, dtw.p[0] set): each row of y is read before it is written. */
void route_gather_dy(cudaStream_t st, int grid, route_rows d_out, const int *src,
                     const int *lo, const int *hi, int K, int64_t H, const float *row_w,
                     bf16 *dy, route_owners y, route_pairs dtw);
/* out[t] = bf16(sum_k tw[t,k] y[slot[t,k]] (k ascending) + ys[t]); ys may be NULL. */
void route_combine_out(cudaStream_t st, int grid, route_owners y, const int *slot,
                       const float *tw, const bf16 *ys, int64_t T, int K, int64_t H, bf16 *out);
/* dx[t] = bf16(sum_k dxr[slot[t,k]] (k ascending) + dxs[t]); dxs may be NULL.
 * W columns: dxr's rows ldr elements apart, dxs's and dx's H (a slice of
 * d_x's columns: pointers at its first column). */
void route_combine_dx(cudaStream_t st, int grid, route_owners dxr, const int *slot,
                      const float *dxs, int64_t T, int K, int64_t W, int64_t ldr, int64_t H,
                      bf16 *dx);
/* dtw[p] = sum_h d_out[token of p, h] y[slot[p], h], 0 for a pair with no
 * row: a block a pair (grid: up to TK blocks). */
void route_dtw(cudaStream_t st, int grid, const bf16 *d_out, route_owners y, const int *slot,
               int64_t TK, int K, int64_t H, float *dtw);

#endif
