/* loads.cuh - the producer's side of a stage: the copy engine's boxes of A
 * and B for one k-block of a tile (TMA, 128-byte swizzle, multicast in
 * clusters), and the rows the producer warpgroup's lanes gather themselves
 * where an operand's rows are scattered over x (gemm_args.gather), in the
 * same swizzled layout, so the consumers read either alike. */
#ifndef MOKK_CUDA_SM90_LOADS_CUH
#define MOKK_CUDA_SM90_LOADS_CUH

#include "config.cuh"
#include "ptx.cuh"

namespace sm90 {

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

} /* namespace sm90 */

#endif
