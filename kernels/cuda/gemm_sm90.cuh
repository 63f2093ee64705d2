/* gemm_sm90.cuh - the grouped bf16 GEMM core on Hopper: TMA loads into a
 * ring of shared-memory stages, wgmma on two consumer warpgroups, one
 * persistent block per SM. It computes the same three layouts as the
 * portable kernel (gemm.cuh: NT forward, NN data gradients, TN weight
 * gradients) with the same epilogues, from the same gemm_args.
 *
 * Its parts live by role in sm90/: ptx.cuh, the Hopper primitives;
 * config.cuh, the stage and tile shapes and the kernel's parameters;
 * scheduler.cuh, the tile order; loads.cuh, the producer's copies;
 * pipeline.cuh, the ring of stages; mma.cuh, the consumers' wgmma runs;
 * epilogue.cuh, the stores. This file puts them together: the consumers'
 * loops (cooperative and ping-pong tiles), the kernel and its launch.
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
#include "sm90/config.cuh"
#include "sm90/epilogue.cuh"
#include "sm90/loads.cuh"
#include "sm90/mma.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/ptx.cuh"
#include "sm90/scheduler.cuh"
#include "sm90/tma.h"

namespace sm90 {

/* A kernel's shared memory: its stages, and its staging area if any. */
template <int LAYOUT, int EPI, int BN, int BM, bool PP, int CL, bool RIDE, int KS>
using cfg_of = cfg<BN, BM, PP, staged<LAYOUT, EPI, BN, BM, PP, CL, KS>(), RIDE,
                   KS == 1 && kept_out<LAYOUT, EPI, BN, BM, CL, KS>()>;

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
