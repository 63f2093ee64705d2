/* config.cuh - the GEMM core's fixed shapes and what a kernel instance is
 * built from: the k depth of a stage, the block's threads, the shared memory
 * a block of a given tile shape gives its stages, the kernel's parameters
 * (tensor maps and gemm_args) and the tile a block works on. The shapes are
 * compile-time functions of the template arguments, so that the ring of
 * stages is as deep as the 227 KiB of shared memory allow for each tile
 * shape, with no run-time branch on it. */
#ifndef MOKK_CUDA_SM90_CONFIG_CUH
#define MOKK_CUDA_SM90_CONFIG_CUH

#include <cuda_runtime.h>

#include "../gemm.cuh"
#include "layer.h"
#include "tma.h"

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

} /* namespace sm90 */

#endif
