/* mma.cuh - the consumers' tensor-core work on one stage: wgmma k16 steps
 * from shared-memory descriptors, issued as one straight run a stage (an
 * MMA under a condition of its own makes ptxas serialise every one), with
 * one batch left in flight while the next stage is waited for; and the
 * riding tails' swapped products on the same stage. */
#ifndef MOKK_CUDA_SM90_MMA_CUH
#define MOKK_CUDA_SM90_MMA_CUH

#include "config.cuh"
#include "ptx.cuh"

namespace sm90 {

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

} /* namespace sm90 */

#endif
