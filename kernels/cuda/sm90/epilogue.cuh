/* epilogue.cuh - what a tile's accumulators become: bf16 or fp32 stores,
 * the SwiGLU of gate/up (and the saved g and u), d_h's SwiGLU gradients,
 * fp32 accumulation in a fixed order, riding tails' rows. Either from
 * registers, exchanged in pairs so a warp writes whole sectors, or through
 * shared memory (stmatrix into the copy engine's swizzled boxes) and TMA
 * stores, which let the tensor cores go on to the next tile while the
 * copy engine writes. The values, and so the bits, are the same either way. */
#ifndef MOKK_CUDA_SM90_EPILOGUE_CUH
#define MOKK_CUDA_SM90_EPILOGUE_CUH

#include "../gemm.cuh"
#include "config.cuh"
#include "pipeline.cuh"
#include "ptx.cuh"
#include "scheduler.cuh"
#include "swiglu.h"

namespace sm90 {

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

constexpr int BAR_EPI = 3; /* named barrier: both consumer warpgroups are done with a tile's MMAs */

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

} /* namespace sm90 */

#endif
