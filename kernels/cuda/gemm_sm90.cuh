/* gemm_sm90.cuh - the grouped bf16 GEMM core on Hopper: TMA loads into a
 * ring of shared-memory stages, wgmma on two consumer warpgroups, one
 * persistent block per SM. It computes the same three layouts as the
 * portable kernel (gemm.cuh: NT forward, NN data gradients, TN weight
 * gradients) with the same epilogues, from the same gemm_args.
 *
 * Why it is shaped this way:
 * - Warp specialisation: one thread of the producer warpgroup issues every
 *   copy; 256 consumer threads only wait, multiply and store. The producer
 *   gives its registers to the consumers (setmaxnreg).
 * - A stage is a BM x 64 A tile and a BN x 64 B tile, filled by the copy
 *   engine with the 128-byte swizzle that wgmma reads directly (sm90/ptx.cuh).
 *   full[s] completes when its bytes have landed, empty[s] when every
 *   consumer warp that reads it is done: the producer runs up to STAGES
 *   k-blocks ahead, across tile boundaries, so the next tile's loads hide
 *   this tile's epilogue.
 * - Tiles: 128 x 256; for the grouped d_x GEMMs, on clusters of two blocks
 *   that load a shared weight tile once for both (unit_at: two blocks
 *   reading an expert's slab for different m-tiles read it apart in time,
 *   and the L2 did not keep it in between); the forward's and d_h take
 *   their tiles in order from a counter on single blocks instead; 256 x 128
 *   tiles, which read the slab once for 256 rows, to measure against;
 *   128 x 128 ping-pong tiles, each warpgroup owning every other tile, for
 *   weight gradients whose tiles are one k-block or very long.
 * - Stores: weight gradients, pure stores, leave through shared memory and
 *   the copy engine (out_*): through the stage of the tile's last k-block
 *   and half a staging area or, where an expert's rows make long k loops,
 *   through the stages of its last two k-blocks (kept_out), as the
 *   forward's do (async_out: y, h and the saved g and u); ping-pong tiles
 *   from a staging area of their own; the other epilogues store from
 *   registers.
 * - Operands stay where they are: K-major operands (x, h, the forward's
 *   weights) and MN-major ones (the backward's weights, the weight gradients'
 *   rows) are both read by the copy engine as they lie in memory; wgmma's
 *   transpose bits take care of the rest. Gate and up weights fill the two
 *   halves of one B tile, so the SwiGLU runs on registers in the epilogue.
 * - Tile order: an expert's tiles run together, m-tiles fastest; dense GEMMs
 *   walk bands of 16 m-tiles.
 * - The forward's gate/up may start while the dispatch that gathers its
 *   rows still runs on a few SMs (gemm_args.ready, route_gather_ahead): it
 *   is launched as that kernel's dependent and does not wait for it; the
 *   producer waits for an expert's rows to be counted before its first
 *   tile of that expert.
 * - Ragged experts: a tail of a few rows past an expert's last full m-tile
 *   rides on that tile (riding tails, below) rather than streaming the
 *   expert's weight tiles again for an m-tile of its own.
 * - Determinism: a tile is owned by one block that sums k in order, and the
 *   tile a block gets never changes any tile's bits, so results are the same
 *   for any grid (DESIGN §2). Weight gradients sum an expert's rows in blocks
 *   of 64 from the start of its segment; the rows of the last block past the
 *   segment reach the tensor cores as zeros, filled in by the copy engine:
 *   each group is read through tensor maps that end at its last row
 *   (k_tn_maps). Zeroing them in shared memory had both warpgroups stop at
 *   a named barrier once a tile, and a dsv3 weight-gradient tile is only 4
 *   or 5 k-blocks long. */
#ifndef MOKK_CUDA_GEMM_SM90_CUH
#define MOKK_CUDA_GEMM_SM90_CUH

#include <cuda_runtime.h>
#include <string.h>

#include "gemm.cuh"
#include "layer.h"
#include "pdl.cuh"
#include "sm90/ptx.cuh"
#include "sm90/tma.h"
#include "swiglu.h"

namespace sm90 {

constexpr int BK = 64;      /* k per stage: one 128-byte swizzle row of bf16 */
constexpr int THREADS = 384;
constexpr int CHUNK = 64 * BK * 2; /* one MN-major 64-wide chunk of a stage */
constexpr int RASTER_M = 16;       /* dense GEMMs: m-tiles per band */

constexpr int SMEM_MAX = 232448;  /* dynamic shared memory a block may opt into */
constexpr int SLOTS = 4;          /* the tile-order ring (ring_put) */
constexpr int RING_BYTES = 2 * SLOTS * 8 + SLOTS * 4 + 2 * 8 + 8; /* and the pair's mail */

/* BM: rows of a tile, 128 (64 per consumer warpgroup) or, for the grouped
 * GEMMs whose weight slabs must be read once per expert, 256 (128 each).
 * TS: the bf16 tiles leave through shared memory and the copy engine
 * (out_*), whose staging area, a tile per warpgroup in ping-pong, takes the
 * place of one or two stages. */
template <int BN, int BM, bool PP = false, bool TS = false, bool RIDE = false,
          bool HALF = false>
struct cfg {
  /* RIDE: a riding tail's rows follow the tile's own in its A stage */
  static constexpr int A_BYTES = (BM + (RIDE ? MOKK_RIDE_ROWS : 0)) * BK * 2;
  static constexpr int B_BYTES = BN * BK * 2;
  /* HALF: one warpgroup's block only (the other's leaves through a stage) */
  static constexpr int OUT_BYTES = TS ? (PP ? 2 : 1) * BM * BN * 2 / (HALF ? 2 : 1) : 0;
  static constexpr int FIT = (SMEM_MAX - 1024 - OUT_BYTES - 96 - RING_BYTES) / (A_BYTES + B_BYTES);
  static constexpr int STAGES = TS ? (FIT < 6 ? FIT : 6) : BN + BM == 256 ? 6 : 4;
  /* + 1024 to align the ring by hand */
  static constexpr int SMEM =
      STAGES * (A_BYTES + B_BYTES) + OUT_BYTES + 2 * STAGES * 8 + RING_BYTES + 1024;
  static_assert(SMEM <= SMEM_MAX, "shared memory");
};

/* Whether an epilogue stores its tiles through shared memory (out_*): the
 * weight gradients, stores and nothing else, unless they add into fp32. */
template <int EPI>
__host__ __device__ constexpr bool stores_tiles()
{
  return EPI == E_WGRAD;
}

typedef struct params { /* 64-byte aligned, as CUtensorMap is */
  CUtensorMap a, b, b2; /* b2: the up weights (gate/up), or B's rows k >= split (NN) */
  CUtensorMap c, c2;    /* TS stores: C, and C2 for rows m >= split; async_out: C */
  CUtensorMap at;       /* RIDE: A in boxes of MOKK_RIDE_ROWS rows, for riding tails */
  CUtensorMap sg, su;   /* async_out, E_GATEUP: the saved gate and up (fp32); C's is c */
  gemm_args g;
} params;

enum { SHARE_NONE, SHARE_A, SHARE_B };

typedef struct tile {
  int g, mt, nt;
  int rows;   /* NT, NN: valid rows of the group; TN: the group's reduction length */
  int tail;   /* NT, NN: rows riding on the tile (gemm_args.tile_off_ride), else 0 */
  int ride0;  /* their first row, from the group's first */
  int64_t rb; /* first row of the group */
  int share;  /* clusters: the operand this tile has in common with the other block's */
} tile;

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

/* 64-row boxes of A a stage of tile x loads. NT, NN: only those holding rows
 * of the group (a small expert's tile reads its own rows, not the next
 * experts'); the consumers skip the same 64-row blocks (act0, act1). */
template <int LAYOUT, int BM>
__device__ __forceinline__ int a_boxes(const tile &x)
{
  if (LAYOUT == L_TN)
    return BM / 64;
  return min(BM / 64, (x.rows - x.mt * BM + 63) / 64);
}

/* Where column c (a multiple of 64) of d_g | d_u lies in the layout of
 * gemm_args.gu_chunks: d_g's block at 2 c, d_u's (c >= split) 64 past the
 * same block of d_g's. */
__device__ __forceinline__ int gu_col(int c, int64_t split)
{
  return c < split ? 2 * c : 2 * (c - (int)split) + 64;
}

/* The copy engine's part of k-block kb of tile x into stage (sa, sb); in a
 * cluster, block `rank` loads its half of the operand it shares (x.share).
 * TN reads A and B through ma and mb, the maps of x's group. GA: the
 * gathered operand (NT, NN: A; TN: B) comes from the lanes (gather_*). */
template <int LAYOUT, int EPI, int BN, int BM, int CL, bool RIDE, bool GA>
__device__ __forceinline__ void load_stage(const params &p, const tile &x, int kb,
                                           unsigned char *sa, unsigned char *sb, uint64_t *bar,
                                           int rank, const CUtensorMap *ma,
                                           const CUtensorMap *mb)
{
  const gemm_args &a = p.g;
  int k = kb * BK;

  if constexpr (LAYOUT == L_TN) { /* A [rows, M] and B [rows, N], both MN-major */
    int r = (int)x.rb + k;
#pragma unroll
    for (int c = 0; c < BM / 64; c++) {
      int m = x.mt * BM + c * 64;
      tma_load(sa + c * CHUNK, ma, a.gu_chunks ? gu_col(m, a.split) : m, r, 0, bar);
    }
#pragma unroll
    for (int c = 0; c < BN / 64 && !GA; c++)
      tma_load(sb + c * CHUNK, mb, x.nt * BN + c * 64, r, 0, bar);
  } else {
    const bool mc_a = CL == 2 && x.share == SHARE_A, mc_b = CL == 2 && x.share == SHARE_B;
    /* d_x reads d_g | d_u in the pairs d_h (E_DH, whose A is dy) writes */
    const int ka = LAYOUT == L_NN && EPI != E_DH && a.gu_chunks ? gu_col(k, a.split) : k;
    /* A [rows, K], K-major, in 64-row boxes: none past the group's rows */
    for (int c = 0; c < (GA ? 0 : a_boxes<LAYOUT, BM>(x)); c++) {
      int r = (int)x.rb + x.mt * BM + c * 64;
      if (!mc_a)
        tma_load(sa + c * CHUNK, &p.a, ka, r, 0, bar);
      else if ((c & 1) == rank)
        tma_load_mc(sa + c * CHUNK, &p.a, ka, r, 0, bar, 3);
    }
    if (RIDE && !GA && x.tail > 0) /* each block its own: a pair's other tile may have none */
      tma_load(sa + BM * 128, &p.at, ka, (int)x.rb + x.ride0, 0, bar);
    if (LAYOUT == L_NT) { /* B [groups, N, K], K-major */
      if (EPI == E_GATEUP || CL == 2) { /* two boxes of BN / 2 rows */
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const CUtensorMap *m = EPI == E_GATEUP && h == 1 ? &p.b2 : &p.b;
          int n = EPI == E_GATEUP ? x.nt * (BN / 2) : x.nt * BN + h * (BN / 2);
          if (!mc_b)
            tma_load(sb + h * (BN / 2) * 128, m, k, n, x.g, bar);
          else if (h == rank)
            tma_load_mc(sb + h * (BN / 2) * 128, m, k, n, x.g, bar, 3);
        }
      } else {
        tma_load(sb, &p.b, k, x.nt * BN, x.g, bar);
      }
    } else {              /* B [groups, K, N], MN-major, rows >= split from b2 */
      const CUtensorMap *m = &p.b;
      if (a.B2 != NULL && k >= a.split) {
        m = &p.b2;
        k -= (int)a.split;
      }
#pragma unroll
      for (int c = 0; c < BN / 64; c++) {
        if (!mc_b)
          tma_load(sb + c * CHUNK, m, x.nt * BN + c * 64, k, x.g, bar);
        else if ((c & 1) == rank)
          tma_load_mc(sb + c * CHUNK, m, x.nt * BN + c * 64, k, x.g, bar, 3);
      }
    }
  }
}

/* ---- gathered rows ------------------------------------------------------------
 * The forward's gate/up GEMM reads each pair's row of x, and the gate/up
 * weight gradient reads it again; with gemm_args.gather both pick the rows
 * out of x themselves instead of reading a gathered copy, which a pass of
 * its own writes (dsv3: 0.94 GB, 0.46 ms of the forward, and again in the
 * backward). A tensor map copies
 * strided boxes, not rows at scattered addresses, so the producer warp's 32
 * lanes copy them, 16 bytes at a time (cp16), into the layout the copy
 * engine writes (the 128-byte swizzle: 16-byte unit c of a 128-byte row j
 * sits at unit c ^ (j & 7)). Each lane then arrives on the stage's full
 * barrier once its copies have landed (cp16_arrive), which counts the
 * lanes' arrivals next to the copy engine's bytes; the producer
 * warpgroup's four warps gather (NT: A's rows; TN: B's). The rows past a
 * group's end are not copied (NT: their products are dropped) or are zeros
 * (TN: they are k and must add nothing, as the copy engine's clipped maps
 * give).
 * At first slower than a gather pass everywhere (MOKD_GEMM_GATHER=1): bench_gpu,
 * dsv3 forward / backward ms, gather pass 12.36 / 29.06; a lane a row
 * 14.76 / 37.62; whole rows a copy (below) 29.71 / 43.86, with the
 * producer's unrolled copies spilling its 56 registers (ptxas -v: 172-336
 * bytes of spill stores in these kernels, none in the others). PERF.md
 * v12. Boxes of one row from the copy engine instead (a 128-byte box per
 * row and k-block, issued by the 32 lanes; correct, since the engine
 * swizzles by shared-memory address) ran slower still: H100, dsv3 36.04 /
 * 84.40 against 13.65 / 29.38, mid's gate/up weight gradient 50.4 ms
 * against 6.9, about 50 cycles an SM per box (PERF.md v13). The gate/up
 * GEMM's A on four warps, each lane's tokens read once a tile, came level
 * with the dispatch beside the GEMM on dsv3, stays behind it on mid, and
 * beats it on experts of small H x I (qwen3: 6-8 % of the forward), where
 * the forward now gathers by default (step_knobs; PERF.md v34, v36). */

/* NT: gathered rows on the producer warpgroup's four warps: warp w
 * copies rows 32 w .. 32 w + 31 of the tile and the riding tail's rows 8 w
 * .. 8 w + 7, eight lanes a row (16-byte unit c = lane % 8), four rows a
 * copy: rows 32 w + 4 m + lane / 8 (m < 8) and the tail's 8 w + 4 m + lane
 * / 8 (m < 2). Their tokens are read once a tile (-1: past the group's
 * rows, not copied), so that a stage's copies wait on nothing but the
 * empty barrier: with one warp shuffling each row's token to its lanes,
 * the copies of a stage were a chain of shuffles (PERF.md v13). */
constexpr int GA_WARPS = 4;

template <int BM, bool RIDE>
__device__ __forceinline__ void gather_rows(const gemm_args &a, const tile &x, int t,
                                            int (&tok)[8 + 2 * RIDE])
{
  static_assert(BM == 128, "four warps of 32 rows");
  const int w = t >> 5, rr = (t & 31) >> 3;
#pragma unroll
  for (int m = 0; m < 8; m++) {
    const int r = x.mt * BM + 32 * w + 4 * m + rr;
    tok[m] = r < x.rows ? a.gather[x.rb + r] / a.gather_div : -1;
  }
#pragma unroll
  for (int m = 0; m < 2 * RIDE; m++) {
    const int r = 8 * w + 4 * m + rr;
    tok[8 + m] = r < x.tail ? a.gather[x.rb + x.ride0 + r] / a.gather_div : -1;
  }
}

/* k-block kb of those rows into the A stage at sa (the tail's rows after
 * the tile's BM). */
template <int BM, bool RIDE>
__device__ __forceinline__ void gather_a(const gemm_args &a, uint32_t sa,
                                         const int (&tok)[8 + 2 * RIDE], int kb, int t)
{
  const int w = t >> 5, rr = (t & 31) >> 3, c = t & 7;
  const char *base = (const char *)a.A + kb * 128 + c * 16;
  const int64_t ld = (int64_t)a.lda * 2;
  /* row j's unit c lies at j 128 + ((c ^ (j % 8)) << 4); j % 8 = 4 (m % 2) + rr */
  const uint32_t d0 = sa + (32 * w + rr) * 128 + ((c ^ rr) << 4);
  const uint32_t d1 = sa + (32 * w + rr) * 128 + ((c ^ (4 + rr)) << 4);
#pragma unroll
  for (int m = 0; m < 8; m++)
    if (tok[m] >= 0)
      cp16((m & 1 ? d1 : d0) + m * 512, base + tok[m] * ld, 16);
  const uint32_t e0 = sa + (BM + 8 * w + rr) * 128 + ((c ^ rr) << 4);
  const uint32_t e1 = sa + (BM + 8 * w + rr) * 128 + ((c ^ (4 + rr)) << 4);
#pragma unroll
  for (int m = 0; m < 2 * RIDE; m++)
    if (tok[8 + m] >= 0)
      cp16((m & 1 ? e1 : e0) + m * 512, base + tok[8 + m] * ld, 16);
}

/* TN: the rows of x's group that k-block kb reduces over, on the same four
 * warps: warp w copies k rows 16 w .. 16 w + 15, whose tokens its lanes l
 * and l + 16 hold (row 16 w + l % 16 of the k-block), -1 past the group's
 * end. */
__device__ __forceinline__ int gather_key(const gemm_args &a, const tile &x, int kb, int t)
{
  const int k = kb * BK + 16 * (t >> 5) + (t & 15);
  return k < x.rows ? a.gather[x.rb + k] / a.gather_div : -1;
}

/* TN: those rows' BN columns of tile x into the MN-major B stage at sb:
 * chunk c holds columns 64 c.. as 64 k rows of 128 bytes. A copy of the
 * warp covers whole rows (BN / 8 lanes a row). Rows past the group's end
 * are zeros (cp16 of 0 bytes). */
template <int BN>
__device__ __forceinline__ void gather_b(const gemm_args &a, const tile &x, uint32_t sb, int key,
                                         int t)
{
  constexpr int LPR = BN / 8, RPI = 32 / LPR; /* lanes a row, rows a copy */
  const int lane = t & 31, part = lane % LPR, c = part >> 3, q = part & 7;
  const char *base = (const char *)(a.B + (int64_t)x.nt * BN) + part * 16;
#pragma unroll
  for (int m = 0; m < 16 / RPI; m++) {
    const int i = RPI * m + lane / LPR, j = 16 * (t >> 5) + i;
    const int tok = __shfl_sync(0xffffffffu, key, i);
    cp16(sb + c * CHUNK + j * 128 + ((q ^ (j & 7)) << 4),
         base + (tok >= 0 ? (int64_t)tok * a.ldb * 2 : 0), tok >= 0 ? 16 : 0);
  }
}

/* KS of a stage's four k16 steps into acc, for the 64-row block cw of A. */
template <int TA, int TB, int BN, int KS = BK / 16>
__device__ __forceinline__ void mma_stage(float (&acc)[BN / 2], uint32_t sa, uint32_t sb, int cw)
{
#pragma unroll
  for (int kk = 0; kk < KS; kk++) {
    uint64_t da = TA ? wgmma_desc(sa + cw * CHUNK + kk * 2048, CHUNK, 1024)
                     : wgmma_desc(sa + cw * 64 * 128 + kk * 32, 16, 1024);
    uint64_t db = TB ? wgmma_desc(sb + kk * 2048, CHUNK, 1024)
                     : wgmma_desc(sb + kk * 32, 16, 1024);
    if constexpr (BN == 128)
      wgmma_128<TA, TB>(acc, da, db, 1);
    else
      wgmma_256<TA, TB>(acc, da, db, 1);
  }
}

/* One stage's MMAs as one straight run: fence, KS k16 steps into acc0 (and,
 * TWO, the next 64-row block's into acc1), commit, and wait until only this
 * batch is in flight. Each run is whole: an MMA under a condition of its
 * own makes ptxas serialise every one. */
template <int TA, int TB, int BN, int KS, bool TWO, int N1>
__device__ __forceinline__ void mma_run(float (&acc0)[BN / 2], float (&acc1)[N1], uint32_t sa,
                                        uint32_t sb, int blk)
{
  acc_fence(acc0);
  if constexpr (TWO)
    acc_fence(acc1);
  wgmma_fence();
  mma_stage<TA, TB, BN, KS>(acc0, sa, sb, blk);
  if constexpr (TWO)
    mma_stage<TA, TB, BN, KS>(acc1, sa, sb, blk + 1);
  wgmma_commit();
  wgmma_wait<1>();
  acc_fence(acc0);
  if constexpr (TWO)
    acc_fence(acc1);
}

/* TN's stages: the last k-block of an expert holds x.rows % 64 rows, zeros
 * after them (k_tn_maps), and only the k16 steps that reach a row run; the
 * others' products are all zero. Which steps run is a function of the
 * expert's rows alone, so the bits stay independent of the grid. */
template <int TA, int TB, int BN, bool TWO, int N1>
__device__ __forceinline__ void mma_run_tn(float (&acc0)[BN / 2], float (&acc1)[N1], uint32_t sa,
                                           uint32_t sb, int blk, int rows, bool last)
{
  const int ks = last ? (rows % BK + 15) / 16 : 0;
  if (ks == 1)
    mma_run<TA, TB, BN, 1, TWO>(acc0, acc1, sa, sb, blk);
  else if (ks == 2)
    mma_run<TA, TB, BN, 2, TWO>(acc0, acc1, sa, sb, blk);
  else if (ks == 3)
    mma_run<TA, TB, BN, 3, TWO>(acc0, acc1, sa, sb, blk);
  else
    mma_run<TA, TB, BN, BK / 16, TWO>(acc0, acc1, sa, sb, blk);
}

/* ---- riding tails ------------------------------------------------------------
 * An expert's rows rarely fill its last 128-row m-tile: on dsv3 an expert
 * has 256 +- 14 rows, and half of them end a few rows past a multiple of
 * 128. Such a tail on an m-tile of its own costs most of a full tile: the
 * tile streams the same weight tiles for 8 rows as for 128 (bench_gemm,
 * gate/up shape, wide2: 256 rows an expert 6.758 ms, 264 rows 9.143). So a
 * tail of up to MOKK_RIDE_ROWS rows rides on full m-tiles of the expert
 * instead (the m-tiles of gemm_args.tile_off_ride): its rows come with each
 * A stage, and each warpgroup multiplies them by the stage's B tile, which
 * is already in shared memory, with the operands swapped: the B tile's 64-row
 * blocks cw and cw + 2 (the gate and the up block of the same columns, for
 * E_GATEUP) as wgmma's A, the tail as its B (N = 16 or 32). A riding row's
 * dot products are the same products summed over the same k steps as in a
 * tile of its own; the ride_invariance test holds their bits to that.
 * Unless gemm_args.ride_whole, an expert of two m-tiles or more splits its
 * tail between the last two, each taking at most 16 rows (tile_at). With
 * the whole tail on one tile, that tile ran up to a quarter longer than the
 * other, which reads the same weight tiles: on single blocks the two
 * drifted apart by more than the L2 keeps of the weights streaming through
 * it, and the slower one read its last k-blocks from memory again (dsv3's
 * gate/up, H100, Nsight Compute: 21.6 GB read and 7.87 ms whole, 16.8 GB
 * and 6.85 ms split). Where the k loop is short (down) or a cluster's pair
 * walks in lockstep anyway (d_x), two small products cost more than one
 * (3.47 against 3.62 ms, 7.09 against 7.18): those stay whole (cuda_moe.cu). */

/* One stage of a tile with a riding tail of at most NR rows: the tile's MMAs
 * into acc, then the tail's into t0 (B block cw) and t1 (B block cw + 2),
 * one straight run. The tail's rows sit after the tile's 128 in the A stage.
 * TB: B is MN-major (NN), and so the tail's A operand is. */
template <int TB, int BN, int NR>
__device__ __forceinline__ void mma_run_ride(float (&acc)[BN / 2], float (&t0)[NR / 2],
                                             float (&t1)[NR / 2], uint32_t sa, uint32_t sb,
                                             int cw)
{
  acc_fence(acc);
  acc_fence(t0);
  acc_fence(t1);
  wgmma_fence();
  mma_stage<0, TB, BN, BK / 16>(acc, sa, sb, cw);
  const uint32_t st = sa + 128 * 128;
#pragma unroll
  for (int kk = 0; kk < BK / 16; kk++) {
    uint64_t dt = wgmma_desc(st + kk * 32, 16, 1024);
    uint64_t d0 = TB ? wgmma_desc(sb + cw * CHUNK + kk * 2048, CHUNK, 1024)
                     : wgmma_desc(sb + cw * CHUNK + kk * 32, 16, 1024);
    uint64_t d1 = TB ? wgmma_desc(sb + (cw + 2) * CHUNK + kk * 2048, CHUNK, 1024)
                     : wgmma_desc(sb + (cw + 2) * CHUNK + kk * 32, 16, 1024);
    wgmma_ride<NR, TB, 0>(t0, d0, dt, 1);
    wgmma_ride<NR, TB, 0>(t1, d1, dt, 1);
  }
  wgmma_commit();
  wgmma_wait<1>();
  acc_fence(acc);
  acc_fence(t0);
  acc_fence(t1);
}

/* Stores pair accumulator blocks j and j + 1 (16 columns) between the two
 * threads of a quad that share a row half: after one exchange the even
 * thread holds four consecutive columns of block j, the odd one four of
 * block j + 1, so a warp's store covers 32 (bf16) or 64 (fp32) contiguous
 * bytes per row, whole sectors, instead of scattered 4-byte pieces. lo/hi:
 * this thread's values of blocks j and j + 1 (two columns each); the
 * returned pair is what it stores at column pair_col(). Every lane of the
 * warp must call it. */
__device__ __forceinline__ uint2 pair_u32(uint32_t lo, uint32_t hi, int lane)
{
  int odd = lane & 1;
  uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? lo : hi, 1);
  return odd ? make_uint2(got, hi) : make_uint2(lo, got);
}

__device__ __forceinline__ float4 pair_f32(float2 lo, float2 hi, int lane)
{
  int odd = lane & 1;
  float2 send = odd ? lo : hi, got;
  got.x = __shfl_xor_sync(0xffffffffu, send.x, 1);
  got.y = __shfl_xor_sync(0xffffffffu, send.y, 1);
  return odd ? make_float4(got.x, got.y, hi.x, hi.y) : make_float4(lo.x, lo.y, got.x, got.y);
}

/* Column (within the 16 of blocks j, j + 1) where this thread's pair goes. */
__device__ __forceinline__ int pair_col(int lane)
{
  int q = lane & 3;
  return (q & 1) ? 8 + 2 * (q - 1) : 2 * q;
}

__device__ __forceinline__ uint32_t bf16x2(float a, float b)
{
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *(uint32_t *)&v;
}

/* Epilogues that read global memory first (d_h's saved g and u, the fp32
 * gradients they add into) issue the loads of LOAD_BATCH column pairs before
 * any of their stores: a load after a store to another pointer cannot be
 * moved above it, and one at a time, each column pair waited out the
 * memory's latency while no MMA ran (d_h, dsv3, Nsight Compute: 5.53 ms for
 * the FLOPs of the 3.6 ms down projection; 5.04 in batches of 4; prefetching
 * g and u into the L2 four k-blocks ahead on top of that: 5.12). */
constexpr int LOAD_BATCH = 4;

/* Accumulators of column block j (8 columns), row half r: two columns. */
template <int N>
__device__ __forceinline__ float2 acc_pair(const float (&acc)[N], int j, int r)
{
  return make_float2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]);
}

/* The SwiGLU (h) and its derivative (d_g, d_u) as swiglu.h has them, on the
 * special-function unit: exp(-g') by ex2.approx and 1 / (1 + e) by
 * rcp.approx, each within a few ulp of fp32, far under the bf16 rounding of
 * h, d_g and d_u (the CPU engine keeps expf and IEEE divisions, and the GPU
 * is held to it within tolerance, not bit for bit). Those took about three
 * times the instructions, in epilogues during which no MMA runs. Nsight
 * Compute, d_h in ms: qwen3_32k 3.433 -> 2.026, mid 4.444 -> 3.443,
 * qwen3_4k 0.509 -> 0.323; bench_gpu, forward ms, two rounds each: dsv3
 * 12.933, 12.964 -> 12.361, 12.401; mid 9.371, 9.399 -> 8.953, 8.974;
 * qwen3_4k 0.887, 0.881 -> 0.801, 0.807; qwen3_32k 6.080, 5.918 -> 5.665,
 * 5.709. The same inputs give the same bits, on any grid. */
__device__ __forceinline__ float swiglu_sfu(float g, float u, float L)
{
  const float gv = mokk_clamp_gate(g, L);
  return gv * __fdividef(1.0f, 1.0f + __expf(-gv)) * mokk_clamp_up(u, L);
}

__device__ __forceinline__ void swiglu_grads_sfu(float g, float u, float dh, float L, float *dg,
                                                 float *du)
{
  const float gv = mokk_clamp_gate(g, L), uv = mokk_clamp_up(u, L);
  const float sg = __fdividef(1.0f, 1.0f + __expf(-gv)); /* 0 once 1 + e overflows */
  *dg = (L > 0.0f && g > L) ? 0.0f : dh * uv * (sg * (1.0f + gv * (1.0f - sg)));
  *du = (L > 0.0f && (u > L || u < -L)) ? 0.0f : dh * (gv * sg); /* silu(g') */
}

/* E_DH, row half r of one 64-row block: d_h (times the row's router weight)
 * -> d_g | d_u (bf16, [rows, 2 lds]), from the saved fp32 g and u. A batch
 * is one 64-column block of the row, which the row's four lanes load whole
 * before any stores: in the layout of gemm_args.gu_chunks its d_g and d_u
 * take the bytes of its g, which C may be (d_h in place; __syncwarp orders
 * the other lanes' loads before this lane's stores). */
template <int BN>
__device__ __forceinline__ void epilogue_dh(const gemm_args &a, const tile &x,
                                            const float (&acc)[BN / 2], int r, bool ok,
                                            int64_t row, int lane)
{
  static_assert(2 * LOAD_BATCH * 8 == 64, "a batch of the d_h epilogue is 64 columns");
  const int c0 = x.nt * BN + pair_col(lane);
  const float sc = ok && a.scale != NULL ? a.scale[row] : 1.0f;
  const float *sg = a.sg + row * a.lds + c0, *su = a.su + row * a.lds + c0;
  bf16 *d = (bf16 *)a.C + row * a.ldc + c0;
#pragma unroll
  for (int j0 = 0; j0 < BN / 8; j0 += 2 * LOAD_BATCH) {
    /* in pairs (gu_chunks) this block's d_g starts at column 2 blk of the
     * row and its d_u 64 further; as they lie, d_g at column blk, d_u lds
     * further */
    const int blk = x.nt * BN + 8 * j0;
    bf16 *dg_at = a.gu_chunks ? d + blk : d, *du_at = a.gu_chunks ? d + blk + 64 : d + a.lds;
    float4 v[LOAD_BATCH], g[LOAD_BATCH], u[LOAD_BATCH];
#pragma unroll
    for (int b = 0; b < LOAD_BATCH; b++) {
      int j = j0 + 2 * b;
      v[b] = pair_f32(acc_pair(acc, j, r), acc_pair(acc, j + 1, r), lane);
      if (ok && x.nt * BN + 8 * j < a.N) {
        g[b] = *(const float4 *)(sg + 8 * j);
        u[b] = *(const float4 *)(su + 8 * j);
      }
    }
    if (a.gu_chunks)
      __syncwarp();
#pragma unroll
    for (int b = 0; b < LOAD_BATCH; b++) {
      int j = j0 + 2 * b;
      if (!ok || x.nt * BN + 8 * j >= a.N)
        continue;
      float dh[4] = {v[b].x, v[b].y, v[b].z, v[b].w}, dg[4], du[4];
      float g4[4] = {g[b].x, g[b].y, g[b].z, g[b].w}, u4[4] = {u[b].x, u[b].y, u[b].z, u[b].w};
#pragma unroll
      for (int e = 0; e < 4; e++) {
        float dd = a.scale != NULL ? sc * dh[e] : dh[e];
        swiglu_grads_sfu(g4[e], u4[e], dd, a.limit, &dg[e], &du[e]);
      }
      *(uint2 *)(dg_at + 8 * j) = make_uint2(bf16x2(dg[0], dg[1]), bf16x2(dg[2], dg[3]));
      *(uint2 *)(du_at + 8 * j) = make_uint2(bf16x2(du[0], du[1]), bf16x2(du[2], du[3]));
    }
  }
}

/* Registers to global memory, for the 64 rows of block blk of the tile. Thread
 * (warp w of its warpgroup, lane l) holds tile rows 64 blk + 16 w + l / 4 +
 * {0, 8} and columns 8 j + 2 (l % 4) + {0, 1}: acc[4 j + 2 r + c]. Columns come in groups of 16 that are valid
 * or not as a whole (N is a multiple of 64), rows one by one; the exchanges
 * run on every lane before a row is skipped. */
template <int LAYOUT, int EPI, int BN, int BM>
__device__ __forceinline__ void epilogue(const gemm_args &a, const tile &x, float (&acc)[BN / 2],
                                         int blk, int warp, int lane)
{
  const int r0 = blk * 64 + warp * 16 + lane / 4, pc = pair_col(lane);

#pragma unroll
  for (int r = 0; r < 2; r++) {
    if constexpr (LAYOUT == L_TN) {
      int m = x.mt * BM + r0 + 8 * r;
      bool ok = m < a.M;
      void *base = a.C;
      int64_t mm = m;
      if (a.C2 != NULL && mm >= a.split) {
        base = a.C2;
        mm -= a.split;
      }
      int64_t off = (int64_t)x.g * a.c_stride + mm * a.ldc;
      if (a.accum) {
        float4 *q = (float4 *)((float *)base + off + x.nt * BN + pc);
#pragma unroll
        for (int j0 = 0; j0 < BN / 8; j0 += 2 * LOAD_BATCH) {
          float4 v[LOAD_BATCH], o[LOAD_BATCH];
#pragma unroll
          for (int b = 0; b < LOAD_BATCH; b++) {
            int j = j0 + 2 * b;
            v[b] = pair_f32(acc_pair(acc, j, r), acc_pair(acc, j + 1, r), lane);
            if (ok && x.nt * BN + 8 * j < a.N)
              o[b] = q[2 * j];
          }
#pragma unroll
          for (int b = 0; b < LOAD_BATCH; b++) {
            int j = j0 + 2 * b;
            if (!ok || x.nt * BN + 8 * j >= a.N)
              continue;
            o[b].x = __fadd_rn(o[b].x, v[b].x), o[b].y = __fadd_rn(o[b].y, v[b].y);
            o[b].z = __fadd_rn(o[b].z, v[b].z), o[b].w = __fadd_rn(o[b].w, v[b].w);
            q[2 * j] = o[b];
          }
        }
        continue;
      }
#pragma unroll
      for (int j = 0; j < BN / 8; j += 2) {
        int n0 = x.nt * BN + 8 * j;
        if (n0 >= a.N)
          break;
        float2 lo = acc_pair(acc, j, r), hi = acc_pair(acc, j + 1, r);
        uint2 v = pair_u32(bf16x2(lo.x, lo.y), bf16x2(hi.x, hi.y), lane);
        if (ok)
          *(uint2 *)((bf16 *)base + off + n0 + pc) = v;
      }
    } else {
      int ml = x.mt * BM + r0 + 8 * r;
      bool ok = ml < x.rows;
      int64_t row = x.rb + ml;
      if constexpr (EPI == E_DH) {
        epilogue_dh<BN>(a, x, acc, r, ok, row, lane);
      } else if constexpr (EPI == E_GATEUP) {
        const int ie = a.N / 2;
#pragma unroll
        for (int j = 0; j < BN / 16; j += 2) {
          int i0 = x.nt * (BN / 2) + 8 * j;
          if (i0 >= ie)
            break;
          const int u = BN / 16; /* the up columns sit BN / 2 further on */
          float2 g_lo = make_float2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]);
          float2 g_hi = make_float2(acc[4 * j + 4 + 2 * r], acc[4 * j + 4 + 2 * r + 1]);
          float2 u_lo = make_float2(acc[4 * (j + u) + 2 * r], acc[4 * (j + u) + 2 * r + 1]);
          float2 u_hi = make_float2(acc[4 * (j + u) + 4 + 2 * r], acc[4 * (j + u) + 4 + 2 * r + 1]);
          uint2 h = pair_u32(bf16x2(swiglu_sfu(g_lo.x, u_lo.x, a.limit),
                                    swiglu_sfu(g_lo.y, u_lo.y, a.limit)),
                             bf16x2(swiglu_sfu(g_hi.x, u_hi.x, a.limit),
                                    swiglu_sfu(g_hi.y, u_hi.y, a.limit)),
                             lane);
          if (a.sg != NULL) {
            float4 g = pair_f32(g_lo, g_hi, lane), uu = pair_f32(u_lo, u_hi, lane);
            if (ok) {
              *(float4 *)(a.sg + row * a.lds + i0 + pc) = g;
              *(float4 *)(a.su + row * a.lds + i0 + pc) = uu;
            }
          }
          if (ok)
            *(uint2 *)((bf16 *)a.C + row * a.ldc + i0 + pc) = h;
        }
      } else {
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2) {
          int n0 = x.nt * BN + 8 * j;
          if (n0 >= a.N)
            break;
          float2 lo = make_float2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]);
          float2 hi = make_float2(acc[4 * j + 4 + 2 * r], acc[4 * j + 4 + 2 * r + 1]);
          if constexpr (EPI == E_BF16) {
            uint2 v = pair_u32(bf16x2(lo.x, lo.y), bf16x2(hi.x, hi.y), lane);
            if (ok)
              *(uint2 *)((bf16 *)a.C + row * a.ldc + n0 + pc) = v;
          } else {
            static_assert(EPI == E_F32, "the epilogues of NT and NN");
            float4 v = pair_f32(lo, hi, lane);
            if (ok)
              *(float4 *)((float *)a.C + row * a.ldc + n0 + pc) = v;
          }
        }
      }
    }
  }
}

/* A riding tail's results: thread (warp w, lane l) of warpgroup cw holds, in
 * t0 and t1, columns 64 cw + 16 w + l / 4 + {0, 8} of the tile's B blocks cw
 * and cw + 2, for tail rows 8 j + 2 (l % 4) + {0, 1}: t[4 j + 2 r + c]. Each
 * value goes out as the epilogue of a tile of its own would write it. */
template <int EPI, int BN, int NR>
__device__ __forceinline__ void epilogue_ride(const gemm_args &a, const tile &x,
                                              const float (&t0)[NR / 2],
                                              const float (&t1)[NR / 2], int cw, int warp,
                                              int lane)
{
  static_assert(EPI != E_DH, "d_h does not ride (cuda_moe.cu, gemm)");
  const int64_t row0 = x.rb + x.ride0;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int col = 16 * warp + lane / 4 + 8 * r;
#pragma unroll
    for (int j = 0; j < NR / 8; j++)
#pragma unroll
      for (int c = 0; c < 2; c++) {
        const int tr = 8 * j + 2 * (lane & 3) + c;
        if (tr >= x.tail)
          continue;
        const int64_t row = row0 + tr;
        const float v0 = t0[4 * j + 2 * r + c], v1 = t1[4 * j + 2 * r + c];
        if constexpr (EPI == E_GATEUP) {
          const int i = x.nt * (BN / 2) + 64 * cw + col;
          if (i >= a.N / 2)
            continue;
          ((bf16 *)a.C)[row * a.ldc + i] = __float2bfloat16_rn(swiglu_sfu(v0, v1, a.limit));
          if (a.sg != NULL) {
            a.sg[row * a.lds + i] = v0;
            a.su[row * a.lds + i] = v1;
          }
        } else {
#pragma unroll
          for (int b = 0; b < 2; b++) {
            const int n = x.nt * BN + 64 * (cw + 2 * b) + col;
            const float v = b ? v1 : v0;
            if (n >= a.N)
              continue;
            if constexpr (EPI == E_BF16) {
              ((bf16 *)a.C)[row * a.ldc + n] = __float2bfloat16_rn(v);
            } else {
              static_assert(EPI == E_F32, "the epilogues of NT and NN");
              ((float *)a.C)[row * a.ldc + n] = v;
            }
          }
        }
      }
  }
}

/* ---- bf16 tiles out through shared memory ---------------------------------
 * Each consumer warpgroup writes its 64-row blocks into shared memory (a
 * staging area of its own, or the stages its tile's last k-blocks filled:
 * staged, async_out, kept_out) with stmatrix, in the 128-byte swizzle of
 * {64, 64} boxes (8 KiB each, 16-byte row pieces of 8 consecutive rows in
 * distinct banks), and one of its threads hands the boxes to the copy
 * engine, which writes whole lines while the warpgroup goes on to the next
 * tile's MMAs. From registers, a warp's store wrote 32-byte pieces of 8 rows
 * and the warpgroup waited for all of them: on GEMMs of few rows per expert
 * (the weight gradients of a small batch) the tensor cores idled while they
 * drained. Rows and columns outside C are clipped by the copy engine. */

/* Before a warpgroup overwrites its staging: the copy engine has read what
 * the warpgroup's last tile left there. wt: thread of the warpgroup. */
__device__ __forceinline__ void out_wait(int cw, int wt)
{
  if (wt == 0)
    tma_store_wait<0, true>();
  named_sync(6 + cw, 128);
}

/* One 64-row block of accumulators (rows 16 warp + {0..15}) into staging. */
template <int BN>
__device__ __forceinline__ void out_block(const float (&acc)[BN / 2], unsigned char *out,
                                          int warp, int lane)
{
  const int i = lane >> 3, row = warp * 16 + (i & 1) * 8 + (lane & 7);
  unsigned char *rp = out + row * 128;
#pragma unroll
  for (int j = 0; j < BN / 8; j += 2) {
    int c = j + (i >> 1); /* the 8-column piece this lane addresses */
    uint32_t at = smem_addr(rp + (c >> 3) * 8192 + (((c & 7) ^ (row & 7)) << 4));
    stmatrix_x4(at, bf16x2(acc[4 * j], acc[4 * j + 1]), bf16x2(acc[4 * j + 2], acc[4 * j + 3]),
                bf16x2(acc[4 * j + 4], acc[4 * j + 5]), bf16x2(acc[4 * j + 6], acc[4 * j + 7]));
  }
}

/* Stores blocks blk0 .. blk0 + n - 1 of tile x, staged one after the other. */
template <int BN, int BM>
__device__ __forceinline__ void out_issue(const params &p, const tile &x, const unsigned char *out,
                                          int blk0, int n, int cw, int wt)
{
  fence_async_shared();
  named_sync(6 + cw, 128);
  if (wt != 0)
    return;
  for (int b = 0; b < n; b++) {
    int m = x.mt * BM + (blk0 + b) * 64;
    if (m >= p.g.M)
      break;
    const CUtensorMap *map = &p.c;
    if (p.g.C2 != NULL && m >= p.g.split) { /* split is a multiple of 64 */
      map = &p.c2;
      m -= (int)p.g.split;
    }
    for (int c = 0; c < BN / 64 && x.nt * BN + c * 64 < p.g.N; c++)
      tma_store(map, x.nt * BN + c * 64, m, x.g, out + b * 64 * BN * 2 + c * 8192);
  }
  tma_store_commit();
}

/* Hands stage prev (none when < 0) back to the producers: this block's, and
 * in a cluster of two the other block's, which refills both. */
template <int CL>
__device__ __forceinline__ void stage_release(uint64_t *empty, int prev, int lane, int rank)
{
  if (prev >= 0 && lane == 0) {
    bar_arrive(&empty[prev]);
    if (CL == 2)
      bar_arrive_remote(&empty[prev], rank ^ 1);
  }
}

/* A consumer waits for stage s to be full. Rows the lanes gathered (GA)
 * landed through ordinary shared-memory writes, which the tensor cores,
 * another proxy, see only after a proxy fence. */
template <bool GA>
__device__ __forceinline__ void stage_wait(uint64_t *full, int s, uint32_t ph)
{
  bar_wait(&full[s], ph);
  if constexpr (GA)
    fence_async_shared();
}

/* The next stage of the ring, the phase flipping where it wraps. */
template <int STAGES>
__device__ __forceinline__ void stage_next(int &s, uint32_t &ph)
{
  if (++s == STAGES) {
    s = 0;
    ph ^= 1;
  }
}

/* A consumer is done issuing stage s: stage prev, whose MMAs have now
 * finished, goes back, and s becomes the one to hand back next. */
template <int CL, int STAGES>
__device__ __forceinline__ void stage_done(uint64_t *empty, int &prev, int &s, uint32_t &ph,
                                           int lane, int rank)
{
  stage_release<CL>(empty, prev, lane, rank);
  prev = s;
  stage_next<STAGES>(s, ph);
}

/* ---- epilogues through shared memory, asynchronously -----------------------
 * The forward's epilogues (NT: y; gate/up: h and the saved g and u) stored
 * from registers, and while they did, the tile's MMAs had ended and the next
 * tile's could not start. Each warpgroup now writes its 64-row block into
 * shared memory in the copy engine's layout (128-byte swizzle, boxes of 64
 * rows of 128 bytes) and one of its threads hands the boxes over; the
 * warpgroup goes on to its next tile while the engine writes them out.
 * Room: a tile keeps the stages of its last two k-blocks (one a warpgroup:
 * its B part takes y, or g and then u; its A part h) instead of handing them
 * back after their MMAs. They go back once the copy engine has read them,
 * after the warpgroup's first MMAs of its next tile; meanwhile the producer
 * fills the other stages with that tile's first k-blocks. A block holding
 * rows past its group's end (a group's last m-tile) stores from registers,
 * since a box writes every row; so do tiles of one k-block, and every tile
 * with gemm_args.store_regs. The values, and so the bits, are those of the
 * register epilogue (gemm_core checks them against each other). Tiles
 * whose rows the producer's lanes gather (GA) too: their copies into a
 * kept stage are generic writes after the copy engine's reads, which the
 * stage's hand-back orders (it waits for the reads, tma_store_wait).
 * H100, bench_gpu --iters 20, forward ms, registers / async, two rounds
 * each: dsv3 12.934, 12.913 / 12.767, 12.711; mid 8.907, 8.735 / 8.573,
 * 8.587; qwen3_4k 0.927, 0.926 / 0.919, 0.903; qwen3_32k 5.852, 5.934 /
 * 5.660, 5.762. Less than a build without the stores had promised (dsv3's
 * gate/up 6588 against 7676 µs, qwen3_32k's down 839 against 1534), but
 * that build had lost more than its stores: 839 µs is 983 TFLOP/s, above
 * what the tensor cores do, so MMAs whose results went nowhere were gone
 * too, and what it timed was close to the loads alone (PERF.md v18). */
template <int LAYOUT, int EPI, int BN, int BM, int CL, bool GA>
__host__ __device__ constexpr bool async_out()
{
  return LAYOUT == L_NT && (EPI == E_BF16 || EPI == E_GATEUP) && BM == 128 &&
         (CL == 1 || paired<LAYOUT, CL>()) && (BN == 128 || BN == 256);
}

/* KS: a weight gradient's 128 x 256 tiles store through the stages of
 * their last k-blocks, as the forward's do (async_out), rather than
 * through a staging area of their own (out_*), which takes 64 KiB: four
 * stages of 48 KiB instead of three. KS = 2: both warpgroups' blocks go
 * out through the last two stages, which pays where an expert's rows make
 * long k loops (H100, bench_gpu, backward ms, ping-pong tiles against
 * these: mid 21.406, 21.035 / 19.570, 19.391; qwen3_32k 12.262, 12.312 /
 * 11.473, 11.569) but leaves the next tile's first k-blocks two stages to
 * load into, which loses on dsv3's tiles of four or five k-blocks (30.094,
 * 30.229 with the staging area against 31.398, 31.200). KS = 1: warpgroup
 * 0's block through the last stage, warpgroup 1's through a staging area
 * of half the size (32 KiB; four stages still fit), so that the next tile
 * starts with three free stages as with the whole staging area, and the
 * main loop has four: dsv3 29.957, 29.805, 29.948 against 30.247, 30.223,
 * 30.091 with the staging area. PERF.md v37, v38. */
template <int LAYOUT, int EPI, int BN, int BM, int CL, int KS>
__host__ __device__ constexpr bool kept_out()
{
  return KS != 0 && LAYOUT == L_TN && EPI == E_WGRAD && BM == 128 && BN == 256 && CL == 1;
}

/* Whether the tiles' stores wait in a staging area of their own (out_*). */
template <int LAYOUT, int EPI, int BN, int BM, bool PP, int CL, int KS>
__host__ __device__ constexpr bool staged()
{
  return stores_tiles<EPI>() && (PP || KS == 1 || !kept_out<LAYOUT, EPI, BN, BM, CL, KS>());
}

/* A kernel's shared memory: its stages, and its staging area if any. */
template <int LAYOUT, int EPI, int BN, int BM, bool PP, int CL, bool RIDE, int KS>
using cfg_of = cfg<BN, BM, PP, staged<LAYOUT, EPI, BN, BM, PP, CL, KS>(), RIDE,
                   KS == 1 && kept_out<LAYOUT, EPI, BN, BM, CL, KS>()>;

constexpr int BAR_EPI = 3; /* named barrier: both consumer warpgroups are done with a tile's MMAs */

/* The two stages a tile's epilogue keeps (-1: none; s0 alone is -1 where
 * it keeps its last stage only, KS = 1). */
struct kept {
  int s0, s1;
};

/* Hands back the stages the last tile's epilogue kept (s1, and s0 unless
 * it kept one), once the copy engine has read what this warpgroup's thread
 * wt == 0 stored: its four warps' arrivals on each. */
__device__ __forceinline__ void kept_release(uint64_t *empty, kept &k, int wt)
{
  if (k.s1 < 0)
    return;
  if (wt == 0) {
    tma_store_wait<0, true>();
    if (k.s0 >= 0)
      bar_arrive_n(&empty[k.s0], 4);
    bar_arrive_n(&empty[k.s1], 4);
  }
  k.s0 = k.s1 = -1;
}

/* A consumer is done issuing k-block kb of nk from stage s. keep: the tile
 * keeps its last two stages (kept), so the one before the last is not handed
 * back (a tile that keeps its last stage only passes keep = false here); at
 * kb = 0 the last tile's kept stages go back. */
template <int CL, int STAGES, bool AO>
__device__ __forceinline__ void stage_step(uint64_t *empty, int &prev, int &s, uint32_t &ph,
                                           int lane, int rank, int kb, int nk, bool keep,
                                           kept &k, int wt)
{
  if (AO && keep && kb == nk - 1) {
    k.s0 = prev;
    prev = s;
    stage_next<STAGES>(s, ph);
  } else {
    stage_done<CL, STAGES>(empty, prev, s, ph, lane, rank);
  }
  if (AO && kb == 0)
    kept_release(empty, k, wt);
}

/* After a tile's last MMAs: its last stage goes back, or stays with the
 * one before it for the epilogue (keep). */
template <int CL, bool AO>
__device__ __forceinline__ void stage_last(uint64_t *empty, int prev, bool keep, kept &k,
                                           int lane, int rank)
{
  if (AO && keep)
    k.s1 = prev;
  else
    stage_release<CL>(empty, prev, lane, rank);
}

/* The h of a 64-row block (BN / 2 columns, bf16) into {64, 64} boxes at out,
 * the layout out_block writes: the SwiGLU of gate piece j and up piece j +
 * BN / 16 (8 columns each), as epilogue computes it. */
template <int BN>
__device__ __forceinline__ void out_block_h(const float (&acc)[BN / 2], unsigned char *out,
                                            float L, int warp, int lane)
{
  constexpr int U = BN / 16;
  const int i = lane >> 3, row = warp * 16 + (i & 1) * 8 + (lane & 7);
  unsigned char *rp = out + row * 128;
#pragma unroll
  for (int j = 0; j < BN / 16; j += 2) {
    uint32_t v[4];
#pragma unroll
    for (int m = 0; m < 4; m++) { /* piece j + m / 2, row half m % 2 */
      const int e = 4 * (j + m / 2) + 2 * (m % 2);
      v[m] = bf16x2(swiglu_sfu(acc[e], acc[e + 4 * U], L),
                    swiglu_sfu(acc[e + 1], acc[e + 1 + 4 * U], L));
    }
    const int c = j + (i >> 1);
    stmatrix_x4(smem_addr(rp + (c >> 3) * 8192 + (((c & 7) ^ (row & 7)) << 4)), v[0], v[1], v[2],
                v[3]);
  }
}

/* Accumulator pieces j0 .. j0 + BN / 16 - 1 (BN / 2 columns, fp32) of a
 * 64-row block into {32, 64} boxes at out: column 8 j + 2 (l % 4) of row
 * r lies in box (8 j) / 32, 16-byte unit ((8 j) % 32) / 4 + (l % 4) / 2,
 * swizzled by the row. A warp's store covers 8 rows of 32 bytes, every
 * 16-byte unit at its own place: two passes of the banks, as for 256
 * bytes at least. */
template <int BN>
__device__ __forceinline__ void out_block_f32(const float (&acc)[BN / 2], int j0,
                                              unsigned char *out, int warp, int lane)
{
  const int q = lane & 3;
  const uint32_t base = smem_addr(out);
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = warp * 16 + 8 * r + (lane >> 2);
#pragma unroll
    for (int j = 0; j < BN / 16; j++) {
      const int unit = 2 * (j & 3) + (q >> 1);
      const uint32_t at =
          base + (j >> 2) * 8192 + row * 128 + ((unit ^ (row & 7)) << 4) + (q & 1) * 8;
      st_shared_f2(at, acc[4 * (j0 + j) + 2 * r], acc[4 * (j0 + j) + 2 * r + 1]);
    }
  }
}

/* The boxes of one 64-row block staged at out (8 KiB apart), as one bulk
 * group: columns col0, col0 + cols, ... of a tensor of n columns, rows
 * row .. row + 63. Thread wt == 0 only. */
__device__ __forceinline__ void out_boxes(const CUtensorMap *map, const unsigned char *out,
                                          int nbox, int col0, int cols, int n, int row)
{
  for (int c = 0; c < nbox && col0 + c * cols < n; c++)
    tma_store(map, col0 + c * cols, row, 0, out + c * 8192);
  tma_store_commit();
}

/* Block b0 of tile x, this warpgroup's, out through the kept stage whose A
 * part is sa and B part sb. */
template <int EPI, int BN, int BM>
__device__ __forceinline__ void epilogue_async(const params &p, const tile &x,
                                               const float (&acc)[BN / 2], int b0,
                                               unsigned char *sa, unsigned char *sb, int cw,
                                               int wt, int warp, int lane)
{
  const gemm_args &a = p.g;
  const int row = (int)(x.rb + x.mt * BM + b0 * 64);
  if constexpr (EPI == E_BF16) {
    out_block<BN>(acc, sb, warp, lane);
    fence_async_shared();
    named_sync(6 + cw, 128);
    if (wt == 0)
      out_boxes(&p.c, sb, BN / 64, x.nt * BN, 64, a.N, row);
  } else {
    static_assert(EPI == E_GATEUP, "async epilogues: NT bf16 and gate/up");
    const int ie = a.N / 2, i0 = x.nt * (BN / 2);
    const bool save = a.sg != NULL;
    if (save) /* g first: its boxes are read while h is computed */
      out_block_f32<BN>(acc, 0, sb, warp, lane);
    out_block_h<BN>(acc, sa, a.limit, warp, lane);
    fence_async_shared();
    named_sync(6 + cw, 128);
    if (wt == 0) {
      if (save)
        out_boxes(&p.sg, sb, BN / 64, i0, 32, ie, row);
      out_boxes(&p.c, sa, BN / 128, i0, 64, ie, row);
      if (save)
        tma_store_wait<1, true>(); /* g's boxes read: u takes their place */
    }
    if (save) {
      named_sync(6 + cw, 128);
      out_block_f32<BN>(acc, BN / 16, sb, warp, lane);
      fence_async_shared();
      named_sync(6 + cw, 128);
      if (wt == 0)
        out_boxes(&p.su, sb, BN / 64, i0, 32, ie, row);
    }
  }
}

/* A tile's epilogue for block b0 (this warpgroup's): through the stages it
 * kept where its rows are all the group's, else from registers. */
template <int LAYOUT, int EPI, int BN, int BM, bool AO>
__device__ __forceinline__ void tile_out(const params &p, const tile &x, float (&acc)[BN / 2],
                                         int b0, bool keep, const kept &k, unsigned char *sa,
                                         unsigned char *sb, int a_bytes, int b_bytes, int cw,
                                         int wt, int warp, int lane)
{
  if constexpr (AO && LAYOUT != L_TN) {
    if (keep) {
      named_sync(BAR_EPI, 256); /* both warpgroups' MMAs are done with the kept stages */
      if (x.mt * BM + (b0 + 1) * 64 <= x.rows) {
        const int st = cw == 0 ? k.s0 : k.s1;
        epilogue_async<EPI, BN, BM>(p, x, acc, b0, sa + st * a_bytes, sb + st * b_bytes, cw, wt,
                                    warp, lane);
        return;
      }
    }
  }
  epilogue<LAYOUT, EPI, BN, BM>(p.g, x, acc, b0, warp, lane);
}

/* The k loop and epilogue of a tile with a riding tail of at most NR rows: a
 * loop of its own, so that the tail's accumulators live only here and the
 * other tiles' loop stays what it is without rides. */
template <int LAYOUT, int EPI, int BN, int BM, int CL, int STAGES, int A_BYTES, int B_BYTES,
          int NR, bool GA, bool AO>
__device__ __forceinline__ void ride_tile(const params &p, const tile &x, int nk,
                                          float (&acc0)[BN / 2], unsigned char *sa,
                                          unsigned char *sb, uint32_t sa0, uint32_t sb0,
                                          uint64_t *full, uint64_t *empty, int &s, uint32_t &ph,
                                          int &prev, bool keep, kept &k, int b0, int cw, int wt,
                                          int warp, int lane, int rank)
{
  constexpr int TB = LAYOUT != L_NT;
  float t0[NR / 2], t1[NR / 2];
#pragma unroll
  for (int i = 0; i < NR / 2; i++)
    t0[i] = t1[i] = 0.0f;
  for (int kb = 0; kb < nk; kb++) {
    stage_wait<GA>(full, s, ph);
    mma_run_ride<TB, BN, NR>(acc0, t0, t1, sa0 + s * A_BYTES, sb0 + s * B_BYTES, cw);
    stage_step<lockstep<LAYOUT, CL>(), STAGES, AO>(empty, prev, s, ph, lane, rank, kb, nk, keep,
                                                   k, wt);
  }
  wgmma_wait<0>();
  acc_fence(acc0);
  acc_fence(t0);
  acc_fence(t1);
  stage_last<lockstep<LAYOUT, CL>(), AO>(empty, prev, keep, k, lane, rank);
  tile_out<LAYOUT, EPI, BN, BM, AO>(p, x, acc0, b0, keep, k, sa, sb, A_BYTES, B_BYTES, cw, wt,
                                    warp, lane);
  epilogue_ride<EPI, BN, NR>(p.g, x, t0, t1, cw, warp, lane);
}

/* The cooperative consumer: both warpgroups on one BM x BN tile, BM / 2 rows
 * each, as one (BM = 128) or two (BM = 256) 64-row blocks. */
template <int LAYOUT, int EPI, int BN, int BM, int CL, bool RIDE, bool GA, int KS>
__device__ __forceinline__ void cooperative(const params &p, int64_t tiles, unsigned char *sa,
                                            unsigned char *sb, unsigned char *out, uint32_t sa0,
                                            uint32_t sb0, uint64_t *full, uint64_t *empty, ring q,
                                            int cw, int ct, int warp, int lane)
{
  const gemm_args &a = p.g;
  constexpr int TA = LAYOUT == L_TN, TB = LAYOUT != L_NT;
  constexpr bool TS = stores_tiles<EPI>();
  constexpr bool AO = async_out<LAYOUT, EPI, BN, BM, CL, GA>() ||
                      kept_out<LAYOUT, EPI, BN, BM, CL, KS>();
  typedef cfg_of<LAYOUT, EPI, BN, BM, false, CL, RIDE, KS> C;
  constexpr int STAGES = C::STAGES, A_BYTES = C::A_BYTES, B_BYTES = C::B_BYTES;
  /* the tile keeps its last stage only: warpgroup 1 stores through staging */
  constexpr bool KEEP1 = KS == 1 && kept_out<LAYOUT, EPI, BN, BM, CL, KS>();
  constexpr bool TALL = BM == 256;
  static_assert(!RIDE || (BM == 128 && BN == 256 && LAYOUT != L_TN && !TS),
                "riding tails: 128 x 256 NT and NN tiles");
  static_assert(!TALL || (BN == 128 && LAYOUT != L_TN),
                "tall tiles: 2 x 64 accumulators a thread, K-major A");
  const int b0 = TALL ? 2 * cw : cw; /* this warpgroup's first 64-row block */
  const int rank = CL == 2 ? (int)cluster_rank() : 0;
  constexpr bool DYN = dynamic_order<LAYOUT, EPI, false, CL>();
  const int64_t units = (tiles + CL - 1) / CL;
  const int wt = ct & 127;
  int s = 0;
  uint32_t ph = 0;
  kept k = {-1, -1};
  for (int64_t u = blockIdx.x / CL;; u += gridDim.x / CL) {
    if (DYN && a.sched != NULL)
      u = ring_take(q);
    if (u >= units)
      break;
    tile x = unit_at<LAYOUT, BN, BM, CL>(a, u, tiles, rank);
    int nk = k_blocks<LAYOUT>(a, x);
    /* the epilogue goes out through this tile's last two stages (async_out,
     * kept_out) or its last one (KEEP1) */
    const bool keep = AO && !a.store_regs && nk >= (KEEP1 ? 1 : 2) && !(TS && a.accum);
    /* a group's last m-tile often has no rows for some 64-row blocks: their
     * warpgroup then only keeps the pipeline going and leaves the tensor
     * cores to the others */
    const bool act0 = LAYOUT == L_TN || x.mt * BM + b0 * 64 < x.rows;
    const bool act1 = TALL && x.mt * BM + (b0 + 1) * 64 < x.rows;
    float acc0[BN / 2], acc1[TALL ? BN / 2 : 1];
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
      acc0[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < (TALL ? BN / 2 : 1); i++)
      acc1[i] = 0.0f;
    /* one batch of MMAs stays in flight: k-block kb's are issued before
     * kb - 1's are waited for and its stage handed back */
    int prev = -1;
    if constexpr (RIDE) {
      if (x.tail > 16) {
        ride_tile<LAYOUT, EPI, BN, BM, CL, STAGES, A_BYTES, B_BYTES, 32, GA, AO>(
            p, x, nk, acc0, sa, sb, sa0, sb0, full, empty, s, ph, prev, keep, k, b0, cw, wt, warp,
            lane, rank);
        continue;
      }
      if (x.tail > 0) {
        ride_tile<LAYOUT, EPI, BN, BM, CL, STAGES, A_BYTES, B_BYTES, 16, GA, AO>(
            p, x, nk, acc0, sa, sb, sa0, sb0, full, empty, s, ph, prev, keep, k, b0, cw, wt, warp,
            lane, rank);
        continue;
      }
    }
    for (int kb = 0; kb < nk; kb++) {
      stage_wait<GA>(full, s, ph);
      const uint32_t at = sa0 + s * A_BYTES, bt = sb0 + s * B_BYTES;
      if constexpr (LAYOUT == L_TN)
        mma_run_tn<TA, TB, BN, false>(acc0, acc1, at, bt, b0, x.rows, kb == nk - 1);
      else if (TALL && act1)
        mma_run<TA, TB, BN, BK / 16, TALL>(acc0, acc1, at, bt, b0);
      else if (act0)
        mma_run<TA, TB, BN, BK / 16, false>(acc0, acc1, at, bt, b0);
      stage_step<lockstep<LAYOUT, CL>(), STAGES, AO>(empty, prev, s, ph, lane, rank, kb, nk,
                                                     keep && !KEEP1, k, wt);
    }
    wgmma_wait<0>();
    acc_fence(acc0);
    acc_fence(acc1);
    stage_last<lockstep<LAYOUT, CL>(), AO>(empty, prev, keep, k, lane, rank);
    if (TS && AO && keep) { /* into the B part of the stage this warpgroup kept */
      named_sync(BAR_EPI, 256); /* both warpgroups' MMAs are done with the kept stages */
      /* KEEP1: warpgroup 0 through the kept stage, warpgroup 1 the staging area */
      const bool staging = KEEP1 && cw == 1;
      unsigned char *mine = staging ? out : sb + (cw == 0 && !KEEP1 ? k.s0 : k.s1) * B_BYTES;
      if (staging)
        out_wait(cw, wt);
      out_block<BN>(acc0, mine, warp, lane);
      out_issue<BN, BM>(p, x, mine, b0, 1, cw, wt);
      continue;
    }
    if (TS && !AO && !a.accum && !a.store_regs) {
      static_assert(!TS || !TALL, "one 64-row block a warpgroup");
      unsigned char *mine = out + cw * (C::OUT_BYTES / 2);
      out_wait(cw, ct & 127);
      out_block<BN>(acc0, mine, warp, lane);
      out_issue<BN, BM>(p, x, mine, b0, 1, cw, ct & 127);
      continue;
    }
    tile_out<LAYOUT, EPI, BN, BM, AO>(p, x, acc0, b0, keep, k, sa, sb, A_BYTES, B_BYTES, cw, wt,
                                      warp, lane);
    if constexpr (TALL)
      epilogue<LAYOUT, EPI, BN, BM>(a, x, acc1, b0 + 1, warp, lane);
  }
  if ((TS || AO) && wt == 0)
    tma_store_wait<0, false>(); /* the staging lives as long as the block */
}

/* The ping-pong consumer: warpgroup cw owns every other tile of its block's
 * sequence, 128 x 128, whole (two m64 halves), and skips the stages of the
 * other's tiles. While one multiplies, the other stores its last tile: on
 * GEMMs with short k loops (the weight gradients, k = an expert's rows) the
 * stores no longer leave the tensor cores idle.
 * The main loops take turns (named barriers 4 and 5: "warpgroup 0 / 1 may
 * start"): a warpgroup starts tile i only once the other has waited for
 * every stage of tile i - 1. That is what makes its stage and phase count
 * true: a full barrier's phase it skipped has completed before it waits for
 * the next, so the parity it waits on names its own phase, never the other
 * warpgroup's. */
template <int LAYOUT, int EPI, bool GA>
__device__ __forceinline__ void pingpong(const params &p, int64_t tiles, unsigned char *sa,
                                         unsigned char *sb, unsigned char *out, uint32_t sa0,
                                         uint32_t sb0, uint64_t *full, uint64_t *empty, int cw,
                                         int ct, int warp, int lane)
{
  const gemm_args &a = p.g;
  constexpr int BN = 128, BM = 128, TA = LAYOUT == L_TN, TB = LAYOUT != L_NT;
  constexpr bool TS = stores_tiles<EPI>();
  typedef cfg<BN, BM, true, TS> C;
  constexpr int STAGES = C::STAGES, A_BYTES = C::A_BYTES, B_BYTES = C::B_BYTES;
  int s = 0;
  uint32_t ph = 0;
  int64_t i = 0;

  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x, i++) {
    tile x = tile_at<LAYOUT, BN, BM>(a, t);
    int nk = k_blocks<LAYOUT>(a, x);
    if ((i & 1) != cw) { /* the other warpgroup's tile: pass over its stages */
      s += nk;
      ph ^= (uint32_t)((s / STAGES) & 1);
      s %= STAGES;
      continue;
    }
    if (i > 0)
      named_sync(4 + cw, 256); /* the other warpgroup is done with tile i - 1 */
    const bool lower = LAYOUT == L_TN || x.mt * BM + 64 < x.rows; /* rows 64..127 exist */
    float acc0[BN / 2], acc1[BN / 2];
#pragma unroll
    for (int j = 0; j < BN / 2; j++)
      acc0[j] = acc1[j] = 0.0f;
    int prev = -1;
    for (int kb = 0; kb < nk; kb++) {
      stage_wait<GA>(full, s, ph);
      const uint32_t at = sa0 + s * A_BYTES, bt = sb0 + s * B_BYTES;
      if constexpr (LAYOUT == L_TN)
        mma_run_tn<TA, TB, BN, true>(acc0, acc1, at, bt, 0, x.rows, kb == nk - 1);
      else if (lower)
        mma_run<TA, TB, BN, BK / 16, true>(acc0, acc1, at, bt, 0);
      else
        mma_run<TA, TB, BN, BK / 16, false>(acc0, acc1, at, bt, 0);
      if (prev >= 0 && lane == 0)
        bar_arrive(&empty[prev]);
      prev = s;
      stage_next<STAGES>(s, ph);
    }
    wgmma_wait<0>();
    acc_fence(acc0);
    acc_fence(acc1);
    if (prev >= 0 && lane == 0)
      bar_arrive(&empty[prev]);
    if (t + gridDim.x < tiles)
      named_arrive(4 + (1 - cw), 256); /* tile i + 1 is the other's */
    if (TS && !a.accum && !a.store_regs) {
      unsigned char *mine = out + cw * (C::OUT_BYTES / 2);
      out_wait(cw, ct);
      out_block<BN>(acc0, mine, warp, lane);
      out_block<BN>(acc1, mine + 64 * BN * 2, warp, lane);
      out_issue<BN, BM>(p, x, mine, 0, 2, cw, ct);
      continue;
    }
    epilogue<LAYOUT, EPI, BN, BM>(a, x, acc0, 0, warp, lane);
    epilogue<LAYOUT, EPI, BN, BM>(a, x, acc1, 1, warp, lane);
  }
  if (TS && ct == 0)
    tma_store_wait<0, false>(); /* the staging lives as long as the block */
}

template <int LAYOUT, int EPI, int BN, bool PP, int BM, int CL, bool RIDE, bool GA, int KS>
__global__ void __launch_bounds__(THREADS, 1) k_gemm90(const __grid_constant__ params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  typedef cfg_of<LAYOUT, EPI, BN, BM, PP, CL, RIDE, KS> C;
  constexpr int STAGES = C::STAGES, A_BYTES = C::A_BYTES, B_BYTES = C::B_BYTES;
  extern __shared__ unsigned char smem_raw[];
  unsigned char *sa = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  unsigned char *sb = sa + STAGES * A_BYTES, *out = sb + STAGES * B_BYTES;
  uint64_t *full = (uint64_t *)(out + C::OUT_BYTES), *empty = full + STAGES;
  uint64_t *rb = empty + STAGES; /* the ring's and the mail's barriers, then their words */
  ring q = {rb, rb + SLOTS, (int *)(rb + 2 * SLOTS + 2), 0, 0};
  mail m = {rb + 2 * SLOTS, rb + 2 * SLOTS + 1, (int *)(rb + 2 * SLOTS + 2) + SLOTS, 0};
  const gemm_args &a = p.g;
  const int wg = threadIdx.x / 128;
  /* GA: warps of the producer warpgroup that gather rows */
  constexpr int GW = GA ? GA_WARPS : 0;
  static_assert(!GA || (LAYOUT == L_TN && CL == 1) || (LAYOUT == L_NT && BM == 128 && CL == 1),
                "gathered rows: NT's A on single blocks of 128-row tiles, or TN's B");

  if (threadIdx.x == 0) {
    tma_prefetch_map(&p.a); /* parameters: before the kernel ahead has finished */
    tma_prefetch_map(&p.b);
    for (int s = 0; s < STAGES; s++) {
      bar_init(&full[s], GA ? 1 + 32 * GW : 1); /* GA: and each gathering lane's */
      /* one arrival per warp that reads the stage, in both blocks of a cluster
       * in lockstep */
      bar_init(&empty[s], (PP ? 4 : 8) * lockstep<LAYOUT, CL>());
    }
    for (int j = 0; j < SLOTS; j++) {
      bar_init(&q.full[j], 1);
      bar_init(&q.empty[j], 256);
    }
    bar_init(m.full, 1);
    bar_init(m.asked, 1);
    bar_init_fence();
  }
  if (CL == 2)
    cluster_sync();
  else
    __syncthreads();
  if (a.ready != NULL) /* the kernel ahead is the dispatch, which counts rows as it goes */
    pdl_release();
  else
    pdl_enter(); /* the set-up above overlaps the kernel ahead; memory from here */
  const int64_t tiles = tile_count<LAYOUT, BN, BM>(a);

  if (wg == 0) {
    regs_release<56>();
    /* one thread issues the copy engine's loads; GA: the warpgroup's four
     * warps gather rows */
    const int lane = threadIdx.x;
    if (lane >= (GA ? 32 * GW : 1))
      return;
    const int rank = CL == 2 ? (int)cluster_rank() : 0;
    const CUtensorMap *ma = &p.a, *mb = &p.b; /* TN: the current group's */
    int mg = -1, rg = -1; /* rg: the last group whose rows were seen ready */
    int s = 0;
    uint32_t ph = 0;
    constexpr bool DYN = dynamic_order<LAYOUT, EPI, PP, CL>();
    const int64_t units = (tiles + CL - 1) / CL;
    const bool dyn = DYN && a.sched != NULL;
    const uint32_t sa0 = smem_addr(sa), sb0 = smem_addr(sb);
    for (int64_t u = blockIdx.x / CL;;) {
      if (dyn && lane == 0)
        ring_put(q, (int)(u < units ? u : units));
      if (u >= units)
        break;
      tile x = unit_at<LAYOUT, BN, BM, CL>(a, u, tiles, rank);
      int nk = k_blocks<LAYOUT>(a, x), bytes;
      if (GA) /* the copy engine's part only */
        bytes = LAYOUT == L_TN ? A_BYTES : B_BYTES;
      else
        bytes = a_boxes<LAYOUT, BM>(x) * CHUNK + B_BYTES +
                (RIDE && x.tail > 0 ? MOKK_RIDE_ROWS * 128 : 0);
      if (LAYOUT != L_TN && x.rows == 0) /* a cluster's empty tile */
        bytes = 0;
      if (LAYOUT == L_TN && a.count != NULL && x.g != mg && nk > 0) {
        mg = x.g;
        ma = (const CUtensorMap *)a.maps + 2 * x.g;
        mb = ma + 1;
        if (lane == 0) {
          tma_map_acquire(ma);
          tma_map_acquire(mb);
        }
      }
      if (LAYOUT == L_NT && !GA && a.ready != NULL && x.g != rg && x.rows > 0) {
        wait_count_async(a.ready + x.g, x.rows); /* single blocks: lane 0 alone */
        rg = x.g;
      }
      int rows[LAYOUT == L_TN ? 1 : 8 + 2 * RIDE], key = -1;
      if constexpr (GA && LAYOUT != L_TN)
        gather_rows<BM, RIDE>(a, x, lane, rows);
      if constexpr (GA && LAYOUT == L_TN)
        key = gather_key(a, x, 0, lane);
      for (int kb = 0; kb < nk; kb++) {
        const int cur = key;
        if (GA && LAYOUT == L_TN && kb + 1 < nk) /* one k-block ahead: the loads' latency */
          key = gather_key(a, x, kb + 1, lane);
        bar_wait(&empty[s], ph ^ 1);
        if (lane == 0) {
          bar_expect(&full[s], bytes);
          if (bytes != 0)
            load_stage<LAYOUT, EPI, BN, BM, CL, RIDE, GA>(p, x, kb, sa + s * A_BYTES,
                                                          sb + s * B_BYTES, &full[s], rank, ma,
                                                          mb);
        }
        if constexpr (GA) {
          if constexpr (LAYOUT == L_TN)
            gather_b<BN>(a, x, sb0 + s * B_BYTES, cur, lane);
          else
            gather_a<BM, RIDE>(a, sa0 + s * A_BYTES, rows, kb, lane);
          cp16_arrive(&full[s]);
        }
        stage_next<STAGES>(s, ph);
      }
      if (dyn) {
        int next = 0;
        if (paired<LAYOUT, CL>() && rank == 1) {
          next = mail_recv(m);
        } else if (lane == 0) {
          if (paired<LAYOUT, CL>())
            mail_wait(m);
          next = atomicAdd(a.sched, 1);
          if (next == units - 1) /* the last claim: zero for the next GEMM */
            atomicExch(a.sched, 0);
          if (paired<LAYOUT, CL>())
            mail_send(m, next);
        }
        if constexpr (GA) { /* thread 0's claim to the other gathering warps, through
                             * the pairs' mail word (GA runs on single blocks) */
          if (lane == 0)
            st_shared(m.val, next);
          named_sync(1, 32 * GW);
          next = ld_shared(m.val);
          named_sync(1, 32 * GW);
        }
        u = next;
      }
      u += gridDim.x / CL;
    }
    /* a cluster in lockstep: stay until both blocks' consumers have released
     * every stage, so none of the other block's arrivals lands after this
     * block is gone */
    for (int i = 0; lockstep<LAYOUT, CL>() == 2 && i < STAGES; i++) {
      bar_wait(&empty[s], ph ^ 1);
      stage_next<STAGES>(s, ph);
    }
    return;
  }

  regs_claim<224>();
  const int cw = wg - 1, ct = threadIdx.x - 128, warp = (threadIdx.x / 32) % 4,
            lane = threadIdx.x % 32;
  const uint32_t sa0 = smem_addr(sa), sb0 = smem_addr(sb);
  if constexpr (PP)
    pingpong<LAYOUT, EPI, GA>(p, tiles, sa, sb, out, sa0, sb0, full, empty, cw, ct & 127,
                              warp, lane);
  else
    cooperative<LAYOUT, EPI, BN, BM, CL, RIDE, GA, KS>(p, tiles, sa, sb, out, sa0, sb0, full,
                                                   empty, q, cw, ct, warp, lane);
#else
  __trap(); /* launched only on sm_90 devices */
#endif
}

/* Tensor maps for the layout, from the same gemm_args as the portable
 * kernel; a_rows: the rows of A (and of B in TN) in memory. GA: the
 * gathered operand (NT, NN: A; TN: B) has none: the lanes read it. */
template <int LAYOUT, int EPI, int BN, int BM, int CL, bool RIDE, bool GA>
static int make_params(params *p, const gemm_args *a, int64_t a_rows, char *err)
{
  int rc;
  memset(p, 0, sizeof *p);
  p->g = *a;
  if (GA != (a->gather != NULL) || (GA && (a->count == NULL || a->gather_div < 1)))
    return mokk_fail(err, MOK_EINVAL, "GEMM: gathered rows (gemm_args.gather) need a "
                     "grouped GEMM, a divisor and a kernel that gathers");
  if (BM == 256) /* the grouped tiles count m-tiles of 256 rows */
    p->g.tile_off = a->tile_off_tall;
  if (RIDE) { /* or of 128 rows with riding tails */
    if (a->tile_off_ride == NULL)
      return mokk_fail(err, MOK_EINVAL, "riding tails without their m-tile offsets");
    p->g.tile_off = a->tile_off_ride;
    if (!GA && (rc = mokk_tmap_bf16(&p->at, a->A, a->K, a_rows, 1, a->lda, 0, MOKK_RIDE_ROWS,
                                    err)))
      return rc;
  }
  if (LAYOUT == L_TN) {
    /* dense: the tensor ends at row K, so a partial last block reads zeros;
     * grouped: k_tn_maps cuts these at each group's end */
    int64_t rows = a->count != NULL ? a_rows : a->K;
    if (a->count == NULL && rows > a_rows)
      return mokk_fail(err, MOK_EINVAL, "weight-gradient GEMM: K = %d rows, %lld in memory",
                       a->K, (long long)a_rows);
    if (a->count != NULL && a->maps == NULL)
      return mokk_fail(err, MOK_EINVAL, "grouped weight-gradient GEMM without room for its "
                       "tensor maps (gemm_args.maps)");
    if ((rc = mokk_tmap_bf16(&p->a, a->A, a->M, rows, 1, a->lda, 0, BK, err)) ||
        (!GA && (rc = mokk_tmap_bf16(&p->b, a->B, a->N, rows, 1, a->ldb, 0, BK, err))))
      return rc;
    if (!stores_tiles<EPI>() || a->accum)
      return 0;
    int64_t m1 = a->C2 != NULL ? a->split : a->M; /* rows of C; C2 has the rest */
    if ((rc = mokk_tmap_bf16(&p->c, a->C, a->N, m1, a->groups, a->ldc, a->c_stride, 64, err)))
      return rc;
    if (a->C2 != NULL)
      return mokk_tmap_bf16(&p->c2, a->C2, a->N, a->M - m1, a->groups, a->ldc, a->c_stride, 64,
                            err);
    return 0;
  }
  if (!GA && (rc = mokk_tmap_bf16(&p->a, a->A, a->K, a_rows, 1, a->lda, 0, 64, err)))
    return rc;
  if (async_out<LAYOUT, EPI, BN, BM, CL, GA>()) { /* C's rows are A's */
    int64_t rows = a->count != NULL ? a_rows : a->M;
    int64_t n = EPI == E_GATEUP ? a->N / 2 : a->N;
    if ((rc = mokk_tmap_bf16(&p->c, a->C, n, rows, 1, a->ldc, 0, 64, err)))
      return rc;
    if (EPI == E_GATEUP && a->sg != NULL &&
        ((rc = mokk_tmap_f32(&p->sg, a->sg, n, rows, a->lds, 64, err)) ||
         (rc = mokk_tmap_f32(&p->su, a->su, n, rows, a->lds, 64, err))))
      return rc;
  }
  if (LAYOUT == L_NT) {
    if (EPI == E_GATEUP) {
      if ((rc = mokk_tmap_bf16(&p->b, a->B, a->K, a->N / 2, a->groups, a->ldb, a->b_stride,
                               BN / 2, err)))
        return rc;
      return mokk_tmap_bf16(&p->b2, a->B2, a->K, a->N / 2, a->groups, a->ldb, a->b_stride,
                            BN / 2, err);
    }
    /* clusters load B in two halves, one from each block */
    return mokk_tmap_bf16(&p->b, a->B, a->K, a->N, a->groups, a->ldb, a->b_stride,
                          CL == 2 ? BN / 2 : BN, err);
  }
  int64_t kb = a->B2 != NULL ? a->split : a->K;
  if ((rc = mokk_tmap_bf16(&p->b, a->B, a->N, kb, a->groups, a->ldb, a->b_stride, BK, err)))
    return rc;
  if (a->B2 != NULL)
    return mokk_tmap_bf16(&p->b2, a->B2, a->N, a->K - kb, a->groups, a->ldb, a->b_stride, BK,
                          err);
  return 0;
}

/* Grouped TN: group g's maps of A and B (maps[2 g], maps[2 g + 1]) are p's,
 * ending at the group's last row (and at the `rows` of A and B in memory). The GEMM that follows on the stream reads
 * them (its producer acquires each before its first load). */
static __global__ void k_tn_maps(const __grid_constant__ params p, int64_t rows)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_enter(); /* the maps may still be in use by the GEMM ahead */
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 2 * p.g.groups)
    return;
  int g = i >> 1;
  int64_t end = (p.g.row_start != NULL ? p.g.row_start[g] : 0) + (int64_t)p.g.count[g];
  end = end < rows ? end : rows; /* never past the template's tensor */
  tma_map_clip_rows((CUtensorMap *)p.g.maps + i, (i & 1) ? &p.b : &p.a,
                    end > 0 ? (int)end : 1);
#else
  __trap();
#endif
}

/* Queues one GEMM on stream with `grid` persistent blocks: BM x BN tiles
 * shared by both consumer warpgroups, or (PP) 128 x 128 tiles that the two
 * take in turns. BM = 256 is for the grouped NT and NN GEMMs (gemm_args'
 * tile_off_tall). CL = 2: clusters of two blocks that share operands (NT and
 * NN; unit_at), as many as fit, at most grid / 2. */
template <int LAYOUT, int EPI, int BN, bool PP = false, int BM = 128, int CL = 1,
          bool RIDE = false, bool GA = false, int KS = 0>
static int gemm(const gemm_args *a, int64_t a_rows, int grid, cudaStream_t stream, char *err)
{
  static_assert(!GA || (CL == 1 && BM == 128), "gathered rows: single blocks, 128-row tiles");
  static_assert(!PP || (BN == 128 && BM == 128), "ping-pong tiles are 128 x 128");
  static_assert(CL == 1 || (CL == 2 && !PP && LAYOUT != L_TN), "clusters: NT and NN, cooperative");
  static_assert(!RIDE || (!PP && BM == 128 && BN == 256 && LAYOUT != L_TN),
                "riding tails: 128 x 256 cooperative NT and NN tiles");
  static_assert(KS == 0 || ((KS == 1 || KS == 2) && !PP && kept_out<LAYOUT, EPI, BN, BM, CL, KS>()),
                "stores through kept stages: 128 x 256 cooperative weight-gradient tiles");
  if (a->ready != NULL && (LAYOUT != L_NT || GA || a->count == NULL))
    return mokk_fail(err, MOK_EINVAL, "rows counted by a dispatch beside the GEMM: grouped NT "
                     "GEMMs reading rows as they lie");
  params p;
  int rc = make_params<LAYOUT, EPI, BN, BM, CL, RIDE, GA>(&p, a, a_rows, err);
  if (rc)
    return rc;
  cudaError_t e = cudaSuccess;
  /* dense GEMMs: static order. The counter is zero between GEMMs: the block
   * that makes the last claim puts it back (k_gemm90), so no memset stands
   * between this launch and the kernel ahead (pdl.cuh) */
  if (!dynamic_order<LAYOUT, EPI, PP, CL>() || a->count == NULL)
    p.g.sched = NULL;
  const int smem = cfg_of<LAYOUT, EPI, BN, BM, PP, CL, RIDE, KS>::SMEM;
  void (*kernel)(params) = k_gemm90<LAYOUT, EPI, BN, PP, BM, CL, RIDE, GA, KS>;
  if (LAYOUT == L_TN && a->count != NULL && a->groups > 0) {
    e = pdl_launch(k_tn_maps, (2 * a->groups + 127) / 128, 128, 0, stream, p, a_rows);
    if (e != cudaSuccess)
      return mokk_fail(err, MOK_EDEVICE, "weight-gradient tensor maps: %s (%s)",
                       cudaGetErrorString(e), cudaGetErrorName(e));
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if constexpr (CL == 1) {
    /* a.ready: a dependent of the dispatch whatever pdl_on says, so that it
     * starts while that runs */
    if (e == cudaSuccess)
      e = pdl_launch_if(pdl_on() || a->ready != NULL, kernel, grid, THREADS, smem, stream, p);
  } else if (e == cudaSuccess) {
    cudaLaunchConfig_t lc = {};
    cudaLaunchAttribute at[2] = {{}, pdl_attr()};
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = CL;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    lc.blockDim = dim3(THREADS);
    lc.dynamicSmemBytes = smem;
    lc.stream = stream;
    lc.attrs = at;
    lc.numAttrs = pdl_on() || a->ready != NULL ? 2 : 1; /* a.ready: as for single blocks */
    lc.gridDim = dim3(CL * 64);
    int fit = 0;
    if (cudaOccupancyMaxActiveClusters(&fit, kernel, &lc) != cudaSuccess || fit < 1) {
      /* no cluster of two fits (a GPU partition of few SMs): single blocks */
      cudaGetLastError();
      return gemm<LAYOUT, EPI, BN, PP, BM, 1, RIDE>(a, a_rows, grid, stream, err);
    }
    int n = grid / CL < fit ? grid / CL : fit;
    lc.gridDim = dim3(CL * (n < 1 ? 1 : n));
    e = cudaLaunchKernelEx(&lc, kernel, p);
  }
  if (e != cudaSuccess)
    return mokk_fail(err, MOK_EDEVICE, "GEMM (sm90) launch: %s (%s)", cudaGetErrorString(e),
                     cudaGetErrorName(e));
  return 0;
}

} /* namespace sm90 */

#endif
