/* scheduler.cuh - which tile a persistent block runs next. Tiles are
 * numbered once (tile_at: an expert's tiles together, m-tiles fastest, so
 * that the blocks running at one time read the same weight tiles), and a
 * block walks that order either statically (block b takes b, b + grid, ...)
 * or from a device counter passed through a ring in shared memory (the
 * forward's grouped GEMMs and d_h, whose blocks would otherwise drift apart
 * over the weights: dynamic_order).
 * Clusters of two take the order in pairs. No tile's bits depend on which
 * block runs it or when (DESIGN §2). */
#ifndef MOKK_CUDA_SM90_SCHEDULER_CUH
#define MOKK_CUDA_SM90_SCHEDULER_CUH

#include <string.h>

#include "config.cuh"
#include "ptx.cuh"

namespace sm90 {

template <int LAYOUT, int BN, int BM>
__device__ __forceinline__ int64_t tile_count(const gemm_args &a)
{
  int64_t ntn = (a.N + BN - 1) / BN, mtn = (a.M + BM - 1) / BM;
  if (LAYOUT == L_TN)
    return a.groups * mtn * ntn;
  if (a.count != NULL)
    return (int64_t)(a.tile_off[a.groups] - a.tile_off[0]) * ntn;
  return mtn * ntn;
}

template <int LAYOUT, int BN, int BM>
__device__ __forceinline__ tile tile_at(const gemm_args &a, int64_t t)
{
  tile x;
  int ntn = (a.N + BN - 1) / BN, mtn = (a.M + BM - 1) / BM;
  x.tail = x.ride0 = 0; /* NT, NN grouped: set below */

  if (LAYOUT == L_TN) {
    int64_t per = (int64_t)mtn * ntn;
    x.g = (int)(t / per);
    int local = (int)(t % per);
    x.mt = local / ntn;
    x.nt = local % ntn;
    x.rows = a.count != NULL ? a.count[x.g] : a.K;
    x.rb = a.row_start != NULL ? a.row_start[x.g] : 0;
  } else if (a.count != NULL) {
    int key = (int)(t / ntn), lo = 0, hi = a.groups - 1, t0 = a.tile_off[0];
    while (lo < hi) { /* the last group whose first m-tile is <= key */
      int mid = (lo + hi + 1) >> 1;
      if (a.tile_off[mid] - t0 <= key)
        lo = mid;
      else
        hi = mid - 1;
    }
    int first = a.tile_off[lo] - t0, mtg = a.tile_off[lo + 1] - a.tile_off[lo];
    int local = (int)(t - (int64_t)first * ntn);
    x.g = lo;
    x.nt = local / mtg;
    x.mt = local % mtg;
    x.rows = a.count[lo];
    x.rb = a.row_start[lo];
    /* the rows past the group's last m-tile: none unless the m-tiles were
     * counted with riding tails. They ride on the last m-tile of a group of
     * one, or where a.ride_whole says so; else half (rounded up) on the
     * second-to-last and the rest on the last (riding tails, below). */
    int tail = x.rows - mtg * BM, half = (tail + 1) / 2;
    if (tail > 0 && (mtg == 1 || a.ride_whole)) {
      if (x.mt == mtg - 1)
        x.tail = tail, x.ride0 = mtg * BM;
    } else if (tail > 0 && x.mt == mtg - 2)
      x.tail = half, x.ride0 = mtg * BM;
    else if (tail > 0 && x.mt == mtg - 1)
      x.tail = tail - half, x.ride0 = mtg * BM + half;
  } else {
    int64_t band = t / ((int64_t)RASTER_M * ntn);
    int m0 = (int)band * RASTER_M, mb = min(RASTER_M, mtn - m0);
    int local = (int)(t - band * RASTER_M * ntn);
    x.g = 0;
    x.nt = local / mb;
    x.mt = m0 + local % mb;
    x.rows = a.M;
    x.rb = 0;
  }
  x.share = SHARE_NONE;
  return x;
}

/* Clusters of two blocks (CL = 2) take the tiles in pairs, 2u and 2u + 1 of
 * the same order, block r of the cluster tile 2u + r. In NN the two share an
 * operand (NT: pairs, below). Next to each other in that order, the two
 * tiles mostly belong to one expert and share its weight tile (B: the same
 * n-tile, m-tiles apart: every expert of more than one m-tile) or its rows
 * (A: the same m-tile, n-tiles apart: experts of one m-tile). Each block then loads half of the shared operand and the copy
 * engine writes it into both blocks' shared memory (multicast), so an
 * expert's weights cross from memory once for two m-tiles, where two blocks
 * reading the same slab at different times had made the L2 fetch it twice
 * (Nsight Compute, dsv3 gate/up: 26.9 GB read for 15.0 GB of weights). The
 * pair's blocks walk their k loops in lockstep: a stage is refilled only when
 * both have finished with it. A pair past the last tile gets an empty tile
 * (no rows: nothing loaded, multiplied or stored). */
template <int LAYOUT, int CL>
__host__ __device__ constexpr bool paired();

template <int LAYOUT, int BN, int BM, int CL>
__device__ __forceinline__ tile unit_at(const gemm_args &a, int64_t u, int64_t tiles, int rank)
{
  if (CL == 1)
    return tile_at<LAYOUT, BN, BM>(a, u);
  int64_t t = 2 * u + rank, o = 2 * u + 1 - rank;
  tile x;
  if (t < tiles) {
    x = tile_at<LAYOUT, BN, BM>(a, t);
  } else {
    memset(&x, 0, sizeof x);
    return x;
  }
  if (!paired<LAYOUT, CL>() && o < tiles) {
    tile y = tile_at<LAYOUT, BN, BM>(a, o);
    if (y.g == x.g)
      x.share = y.nt == x.nt ? SHARE_B : y.mt == x.mt ? SHARE_A : SHARE_NONE;
  }
  return x;
}

/* ---- pairs ------------------------------------------------------------------
 * In NT GEMMs a cluster's two blocks only run neighbouring tiles of the order
 * at the same time, each with its own loads and stages, no operand shared
 * (paired): tiles 2u and 2u + 1, mostly the two m-tiles of one expert's
 * n-tile, which read the same weight tile. Both blocks of a cluster sit in
 * one GPC and so at one of the L2's two partitions: the weight tile then
 * crosses the fabric between the partitions once at most, where two blocks
 * anywhere on the GPU have it cross for either half of the chip. That was
 * the fabric dsv3's gate/up kept 98 % busy (PERF.md v17); on pairs it is
 * 89 % busy, 84 % in down, the L2 serves 21 % fewer sectors, and neither
 * runs faster (H100, Nsight Compute: gate/up 6.79 against 6.90 ms, down
 * 3.41 against 3.36; PERF.md v18): the fabric was not what held them. The
 * forward stays on single blocks; MOKD_GEMM_CLUSTERS=all puts it on pairs.
 * NN's clusters share operands instead (multicast, above) and refill a stage
 * only once both blocks are done with it (lockstep). */
template <int LAYOUT, int CL>
__host__ __device__ constexpr bool paired()
{
  return CL == 2 && LAYOUT == L_NT;
}

/* Blocks that release each stage: two where a pair shares operands. */
template <int LAYOUT, int CL>
__host__ __device__ constexpr int lockstep()
{
  return paired<LAYOUT, CL>() ? 1 : CL;
}

/* A pair in counter order: when block 1's producer needs its next unit it
 * asks block 0's (an arrival on block 0's barrier) and waits; block 0's,
 * once it needs its own next unit and block 1 has asked, takes one from the
 * counter and sends it (st.async: the value and its 4 bytes on block 1's
 * barrier at once). So the two start each unit together. With a mailbox
 * of SLOTS units that block 0 filled as it went, block 1, whose tiles
 * carried the whole riding tail in down, fell four units behind, the two
 * no longer read the same weight tile at one time, and down read its
 * weights from memory twice (dsv3, Nsight Compute: 15.13 GB against 7.83,
 * 5.27 ms against 3.34). */
struct mail {
  uint64_t *full, *asked; /* full: block 1's, the unit's bytes; asked: block 0's, block 1's ask */
  int *val;
  uint32_t ph;
};

/* Block 1: its next unit. */
__device__ __forceinline__ int mail_recv(mail &m)
{
  bar_arrive_remote(m.asked, 0);
  bar_expect(m.full, 4);
  bar_wait(m.full, m.ph);
  m.ph ^= 1;
  return ld_shared(m.val);
}

/* Block 0: waits for block 1 to ask. */
__device__ __forceinline__ void mail_wait(mail &m)
{
  bar_wait(m.asked, m.ph);
  m.ph ^= 1;
}

/* Block 0: unit v to block 1. */
__device__ __forceinline__ void mail_send(mail &m, int v)
{
  st_async_remote(m.val, v, m.full, 1);
}

/* ---- tile order -------------------------------------------------------------
 * Static (a.sched == NULL): block (or cluster) b takes units b, b + grid, ...
 * Dynamic: the block's producer takes the next tile from a device counter
 * (an integer atomic: scheduling only, no value depends on it) and passes
 * it to the consumers through a ring of SLOTS slots. Tiles then run in
 * their order, neighbours at the same time: with static tiles, blocks drift
 * apart, and the tiles running at one time are scattered over the weights.
 * The tile a block gets never changes a tile's bits. */
struct ring {
  uint64_t *full, *empty; /* full: the producer's arrival; empty: every consumer thread's */
  int *unit;
  int j;
  uint32_t ph;
};

__device__ __forceinline__ void ring_next(ring &q)
{
  if (++q.j == SLOTS) {
    q.j = 0;
    q.ph ^= 1;
  }
}

/* The producer publishes tile u (or `tiles`: none left), once every
 * consumer thread has taken the slot's previous one. */
__device__ __forceinline__ void ring_put(ring &q, int u)
{
  bar_wait(&q.empty[q.j], q.ph ^ 1);
  st_shared(&q.unit[q.j], u);
  bar_arrive(&q.full[q.j]);
  ring_next(q);
}

/* Every consumer thread takes the next tile, and each arrives once it has
 * read it; the tile goes through a warp reduction, whose result the
 * compiler knows to be the same in every lane. Read by each lane from
 * shared memory (and arrived on by lane 0 after __syncwarp), it could
 * differ between lanes for all the compiler knew, and every shuffle of the
 * epilogue after it ran behind a convergence guard (cuobjdump of the
 * single-block NT kernel: 160 WARPSYNC.COLLECTIVE paths, now none). */
__device__ __forceinline__ int ring_take(ring &q)
{
  bar_wait(&q.full[q.j], q.ph);
  int u = ld_shared(&q.unit[q.j]);
  bar_arrive(&q.empty[q.j]);
  ring_next(q);
  return (int)__reduce_min_sync(0xffffffffu, (unsigned)u);
}

/* Which kernels compile the dynamic order: the grouped NT GEMMs on single
 * blocks (the forward's), and d_h on cooperative tiles. mok's forward:
 * 13.09-13.20 ms static, 12.60-12.66 dynamic (bench_gpu, three rounds in
 * each of three calls). d_h, dsv3, Nsight Compute: 5.273 ms static (21.1 GB
 * read), 3.824 dynamic (10.6 GB); bench_gpu, the backward in one call, two
 * rounds: 29.671, 29.454 ms static, 28.840, 28.725 dynamic. On clusters
 * (dsv3's gate/up; block 0 took the tile and handed it to block 1 with
 * st.async) it read 16.5 GB where static tiles read 21.5-23.7, yet no
 * layer ran faster: compiled into a kernel on clusters, the ring took the
 * tile arithmetic off the uniform datapath (cuobjdump, gate/up: 254 -> 140
 * uniform instructions, even through the warp reduction) and dsv3's
 * forward ran 2.6-3.5 % slower with the order static, 1.5-2.6 % dynamic.
 * In v9 the data-gradient GEMMs in counter order made the backward 1.5 ms
 * slower (PERF.md); d_h gained once its epilogue took the special-function
 * unit (v11, above). */
template <int LAYOUT, int EPI, bool PP, int CL>
__host__ __device__ constexpr bool dynamic_order()
{
  return (LAYOUT == L_NT || EPI == E_DH) && !PP && (CL == 1 || paired<LAYOUT, CL>());
}

template <int LAYOUT>
__device__ __forceinline__ int k_blocks(const gemm_args &a, const tile &x)
{
  return LAYOUT == L_TN ? (x.rows + BK - 1) / BK : a.K / BK;
}

} /* namespace sm90 */

#endif
