/* gemm.cuh - the grouped bf16 GEMM of the CUDA backend, on tensor cores
 * (WMMA 16x16x16, fp32 accumulators), with the layer's epilogues fused.
 *
 * One kernel, three layouts:
 *   NT  C[m,n] = sum_k A[m,k] B[n,k]   forward projections
 *   NN  C[m,n] = sum_k A[m,k] B[k,n]   backward data gradients
 *   TN  C[m,n] = sum_k A[k,m] B[k,n]   weight gradients (k runs over rows)
 * It runs where the Hopper core (gemm_sm90.cuh) does not: GPUs other than
 * sm_90. Both share gemm_args, the layouts and the epilogue math (swiglu.h).
 * A group is an expert: in NT and NN its rows (M) come from the schedule on
 * the device, in TN its reduction length (K) does. The launch is sized for the
 * worst case and every block walks tiles in a grid-stride loop; a tile's sum
 * runs k = 0, BK, 2BK, ... in one block, so its bits never depend on the grid
 * (DESIGN §2). */
#ifndef MOKK_CUDA_GEMM_CUH
#define MOKK_CUDA_GEMM_CUH

#include <cuda_bf16.h>
#include <mma.h>
#include <stdint.h>

#include "swiglu.h"

#define G_BM 128
#define G_BN 128
#define G_BK 32
#define G_THREADS 256
/* shared memory: the A and B tiles during the k loop, the fp32 tile after */
#define G_TILE_ELEMS (G_BM * (G_BK + 8) > G_BK * (G_BM + 8) ? G_BM * (G_BK + 8) : G_BK * (G_BM + 8))
#define G_SMEM_BYTES (G_BM * (G_BN + 4) * 4)

/* The most rows past an expert's last full 128-row m-tile that ride on that
 * tile (sm90/mma.cuh, "riding tails") instead of taking an m-tile of their
 * own: wgmma's N of the swapped product. */
#define MOKK_RIDE_ROWS 32

/* The 128-row m-tiles of a group of c rows when its tail rides: a tail of at
 * most MOKK_RIDE_ROWS rows past the last full m-tile takes no m-tile of its
 * own; a group of fewer than 128 rows keeps its one. */
__host__ __device__ __forceinline__ int mokk_ride_mtiles(int c)
{
  int tail = c % 128;
  return c / 128 + (tail > 0 && (c < 128 || tail > MOKK_RIDE_ROWS));
}

typedef __nv_bfloat16 bf16;

enum { L_NT, L_NN, L_TN };
enum {
  E_GATEUP, /* NT: tile columns [0,32) gate, [32,64) up -> h = swiglu, saves g, u */
  E_BF16,   /* store bf16 */
  E_F32,    /* store fp32 */
  E_DH,     /* NN: d_h (times a row scale) -> d_g | d_u, bf16, from the saved g, u */
  E_WGRAD   /* TN: weight gradient, bf16 store or fp32 add; rows >= split go to C2 */
};

typedef struct gemm_args {
  const bf16 *A;
  int64_t lda;
  const bf16 *B, *B2;   /* B2: up weights (E_GATEUP) or rows k >= split (NN) */
  int64_t ldb, b_stride; /* b_stride: elements between groups */
  int64_t split;
  int M, N, K;          /* fixed dimensions; the grouped one comes from count */
  int groups;
  const int *count;     /* [groups] rows per group; NULL: one dense group */
  const int *row_start; /* [groups] first row of each group */
  const int *tile_off;  /* [groups + 1] m-tile prefix (NT, NN grouped), counted from
                         * tile_off[0]: groups may be a slice of a longer schedule */
  const int *tile_off_tall; /* the same for m-tiles of 256 rows (the Hopper core) */
  const int *tile_off_ride; /* the same for m-tiles of 128 rows where a tail of at most
                             * MOKK_RIDE_ROWS rows past a group's last full m-tile rides on
                             * it (the Hopper core's cooperative tiles); NULL: no rides */
  int ride_whole;       /* riding tails: the whole tail on the group's last m-tile, rather
                         * than half on each of its last two (sm90/scheduler.cuh, tile_at) */
  int tiles_max;        /* worst-case m-tiles (NT, NN) */
  int groups_all;       /* groups of the whole schedule (every EP rank's experts) */
  void *C, *C2;
  int64_t ldc, c_stride;
  float *sg, *su;       /* gate and up before the clamp, [rows, lds] */
  int64_t lds;
  const float *scale;   /* E_DH: per-row factor (router weight), NULL = 1 */
  float limit;
  int accum;            /* E_WGRAD: add into fp32 */
  void *maps;           /* grouped TN on the Hopper core: GEMM_TN_MAP_BYTES a group of
                         * device memory, 128-byte aligned, for its tensor maps */
  int *sched;           /* grouped NT on the Hopper core, single blocks: a device counter that
                         * hands out tiles in order; zero when the GEMM starts, and again
                         * when it ends (the last claim resets it): allocate it zeroed;
                         * NULL: each block takes every grid-th tile */
  const int *gather;    /* the Hopper core only: the grouped operand's row r (A's in NT and
                         * NN, B's in TN) is row gather[r] / gather_div of the matrix in
                         * memory (the schedule's src: the pair's token), picked row by row
                         * instead of read from a gathered copy; NULL: rows as they lie */
  int gather_div;
  int store_regs;       /* the Hopper core's NT and TN epilogues store from registers
                         * rather than through shared memory and the copy engine
                         * (sm90/epilogue.cuh, async_out; pingpong): to measure and check
                         * one against the other */
  const int *ready;     /* grouped NT on the Hopper core: A's rows come from a dispatch that
                         * runs beside the GEMM (route_gather_ahead); group g's rows are in
                         * memory once ready[g] reaches count[g], and the kernel does not
                         * wait for the kernel ahead to finish; NULL: A is complete */
  int gu_chunks;        /* the Hopper core: d_g | d_u (2 split columns a row) in pairs of
                         * 64-column blocks, each block of d_g's columns followed by the
                         * same block of d_u's (a row is as long as in the plain layout).
                         * E_DH writes C that way (its A is dy, as it lies), so that a
                         * tile's d_g and d_u land in the bytes of the fp32 g it has just
                         * read (C may be g: d_h in place); the other NN epilogues read
                         * A's k, TN A's m, as laid out that way. Same values, same sums:
                         * only the addresses move */
} gemm_args;

/* The Hopper core's grouped weight gradients read each group through two
 * tensor maps that end at the group's last row (gemm_sm90.cuh, tn_maps). */
#define GEMM_TN_MAP_BYTES 256

/* One k step of operand tiles, global -> registers (zero outside the
 * matrix), so that the next step's loads overlap this step's MMAs. Every
 * dimension is a multiple of 64, so a 128-wide tile is full or half. */
typedef struct g_regs {
  uint4 a[2], b[2];
} g_regs;

template <int LAYOUT, int GATEUP>
__device__ __forceinline__ void g_fetch(const gemm_args &a, const bf16 *Ag, const bf16 *Bg,
                                        const bf16 *B2g, int m0, int n0, int nt, int k0,
                                        int Mg, int Kg, g_regs *r)
{
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int q = 0; q < 2; q++) {
    int c = threadIdx.x + q * G_THREADS;
    uint4 v = zero;
    if (LAYOUT == L_TN) { /* A is [k][m]: 32 x 128 */
      int kr = c >> 4, mc = (c & 15) * 8;
      if (k0 + kr < Kg && m0 + mc < Mg)
        v = *(const uint4 *)(Ag + (int64_t)(k0 + kr) * a.lda + m0 + mc);
    } else {              /* A is [m][k]: 128 x 32 */
      int rr = c >> 2, kc = (c & 3) * 8;
      if (m0 + rr < Mg)
        v = *(const uint4 *)(Ag + (int64_t)(m0 + rr) * a.lda + k0 + kc);
    }
    r->a[q] = v;
    v = zero;
    if (LAYOUT == L_NT) { /* B is [n][k]: 128 x 32 */
      int rr = c >> 2, kc = (c & 3) * 8;
      const bf16 *row = NULL;
      if (GATEUP)
        row = rr < G_BN / 2 ? Bg + (int64_t)(nt * (G_BN / 2) + rr) * a.ldb
                            : B2g + (int64_t)(nt * (G_BN / 2) + rr - G_BN / 2) * a.ldb;
      else if (n0 + rr < a.N)
        row = Bg + (int64_t)(n0 + rr) * a.ldb;
      if (row != NULL)
        v = *(const uint4 *)(row + k0 + kc);
    } else {              /* B is [k][n]: 32 x 128 */
      int kr = c >> 4, nc = (c & 15) * 8, k = k0 + kr;
      if (k < Kg && n0 + nc < a.N) {
        const bf16 *p = (B2g != NULL && k >= a.split) ? B2g + (int64_t)(k - a.split) * a.ldb
                                                      : Bg + (int64_t)k * a.ldb;
        v = *(const uint4 *)(p + n0 + nc);
      }
    }
    r->b[q] = v;
  }
}

template <int LAYOUT>
__device__ __forceinline__ void g_stash(const g_regs *r, bf16 *As, bf16 *Bs)
{
  for (int q = 0; q < 2; q++) {
    int c = threadIdx.x + q * G_THREADS;
    if (LAYOUT == L_TN)
      *(uint4 *)(As + (c >> 4) * (G_BM + 8) + (c & 15) * 8) = r->a[q];
    else
      *(uint4 *)(As + (c >> 2) * (G_BK + 8) + (c & 3) * 8) = r->a[q];
    if (LAYOUT == L_NT)
      *(uint4 *)(Bs + (c >> 2) * (G_BK + 8) + (c & 3) * 8) = r->b[q];
    else
      *(uint4 *)(Bs + (c >> 4) * (G_BN + 8) + (c & 15) * 8) = r->b[q];
  }
}

template <int LAYOUT, int EPI>
__global__ void __launch_bounds__(G_THREADS) k_gemm(gemm_args a)
{
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char g_smem[];
  bf16 *As = (bf16 *)g_smem, *Bs = As + G_TILE_ELEMS;
  float *Cs = (float *)g_smem; /* reuses the operand tiles after the k loop */
  const int warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
  const int ntn = (a.N + G_BN - 1) / G_BN, mtn = (a.M + G_BM - 1) / G_BM;
  int64_t tiles;

  if (LAYOUT == L_TN)
    tiles = (int64_t)a.groups * mtn * ntn;
  else if (a.count != NULL)
    tiles = (int64_t)a.tiles_max * ntn;
  else
    tiles = (int64_t)mtn * ntn;

  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    int g, m0, n0, nt, Mg, Kg;
    int64_t rb = 0; /* first row of the group */

    if (LAYOUT == L_TN) {
      int per = mtn * ntn;
      g = (int)(t / per);
      m0 = (int)(t % per) / ntn * G_BM;
      nt = (int)(t % per) % ntn;
      Mg = a.M;
      Kg = a.count != NULL ? a.count[g] : a.K;
      if (a.row_start != NULL)
        rb = a.row_start[g];
    } else {
      int mt = (int)(t / ntn);
      nt = (int)(t % ntn);
      Kg = a.K;
      if (a.count != NULL) {
        int t0 = a.tile_off[0];
        if (mt >= a.tile_off[a.groups] - t0)
          break; /* tiles only grow from here */
        int lo = 0, hi = a.groups - 1; /* last group whose first tile <= mt */
        while (lo < hi) {
          int mid = (lo + hi + 1) >> 1;
          if (a.tile_off[mid] - t0 <= mt)
            lo = mid;
          else
            hi = mid - 1;
        }
        g = lo;
        m0 = (mt - (a.tile_off[g] - t0)) * G_BM;
        Mg = a.count[g];
        rb = a.row_start[g];
      } else {
        g = 0;
        m0 = mt * G_BM;
        Mg = a.M;
      }
    }
    n0 = nt * G_BN;

    const bf16 *Ag = a.A + rb * a.lda;
    const bf16 *Bg = a.B + (LAYOUT == L_TN ? rb * a.ldb : (int64_t)g * a.b_stride);
    const bf16 *B2g = a.B2 != NULL ? a.B2 + (int64_t)g * a.b_stride : NULL;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 2; j++)
        wmma::fill_fragment(acc[i][j], 0.0f);

    g_regs rg;
    if (Kg > 0) {
      g_fetch<LAYOUT, EPI == E_GATEUP>(a, Ag, Bg, B2g, m0, n0, nt, 0, Mg, Kg, &rg);
      g_stash<LAYOUT>(&rg, As, Bs);
      __syncthreads();
    }
    for (int k0 = 0; k0 < Kg; k0 += G_BK) {
      int more = k0 + G_BK < Kg;
      if (more)
        g_fetch<LAYOUT, EPI == E_GATEUP>(a, Ag, Bg, B2g, m0, n0, nt, k0 + G_BK, Mg, Kg, &rg);
      for (int kk = 0; kk < G_BK; kk += 16) {
        for (int i = 0; i < 4; i++) {
          int mo = wm * 64 + i * 16;
          if (LAYOUT == L_TN) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> fa;
            wmma::load_matrix_sync(fa, As + kk * (G_BM + 8) + mo, G_BM + 8);
            for (int j = 0; j < 2; j++) {
              int no = wn * 32 + j * 16;
              wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
              wmma::load_matrix_sync(fb, Bs + kk * (G_BN + 8) + no, G_BN + 8);
              wmma::mma_sync(acc[i][j], fa, fb, acc[i][j]);
            }
          } else {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
            wmma::load_matrix_sync(fa, As + mo * (G_BK + 8) + kk, G_BK + 8);
            for (int j = 0; j < 2; j++) {
              int no = wn * 32 + j * 16;
              if (LAYOUT == L_NT) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
                wmma::load_matrix_sync(fb, Bs + no * (G_BK + 8) + kk, G_BK + 8);
                wmma::mma_sync(acc[i][j], fa, fb, acc[i][j]);
              } else {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
                wmma::load_matrix_sync(fb, Bs + kk * (G_BN + 8) + no, G_BN + 8);
                wmma::mma_sync(acc[i][j], fa, fb, acc[i][j]);
              }
            }
          }
        }
      }
      __syncthreads(); /* everyone is done reading this step's tiles */
      if (more) {
        g_stash<LAYOUT>(&rg, As, Bs);
        __syncthreads();
      }
    }
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 2; j++)
        wmma::store_matrix_sync(Cs + (wm * 64 + i * 16) * (G_BN + 4) + wn * 32 + j * 16,
                                acc[i][j], G_BN + 4, wmma::mem_row_major);
    __syncthreads();

    /* epilogue: Cs holds the fp32 tile */
    if (EPI == E_GATEUP) {
      const int half = G_BN / 2;
      bf16 *h = (bf16 *)a.C;
      for (int idx = threadIdx.x; idx < G_BM * half; idx += G_THREADS) {
        int m = idx / half, n = idx % half;
        if (m0 + m >= Mg)
          continue;
        int64_t row = rb + m0 + m;
        int i = nt * half + n;
        float gv = Cs[m * (G_BN + 4) + n], uv = Cs[m * (G_BN + 4) + n + half];
        if (a.sg != NULL) {
          a.sg[row * a.lds + i] = gv;
          a.su[row * a.lds + i] = uv;
        }
        h[row * a.ldc + i] = __float2bfloat16_rn(mokk_swiglu(gv, uv, a.limit));
      }
    } else if (EPI == E_WGRAD) {
      for (int idx = threadIdx.x; idx < G_BM * G_BN; idx += G_THREADS) {
        int m = idx / G_BN, n = idx % G_BN;
        int64_t mm = m0 + m;
        if (mm >= a.M || n0 + n >= a.N)
          continue;
        void *base = a.C;
        if (a.C2 != NULL && mm >= a.split) {
          base = a.C2;
          mm -= a.split;
        }
        int64_t off = (int64_t)g * a.c_stride + mm * a.ldc + n0 + n;
        float v = Cs[m * (G_BN + 4) + n];
        if (a.accum)
          ((float *)base)[off] = __fadd_rn(((float *)base)[off], v);
        else
          ((bf16 *)base)[off] = __float2bfloat16_rn(v);
      }
    } else {
      for (int idx = threadIdx.x; idx < G_BM * G_BN; idx += G_THREADS) {
        int m = idx / G_BN, n = idx % G_BN;
        if (m0 + m >= Mg || n0 + n >= a.N)
          continue;
        int64_t row = rb + m0 + m;
        float v = Cs[m * (G_BN + 4) + n];
        if (EPI == E_BF16) {
          ((bf16 *)a.C)[row * a.ldc + n0 + n] = __float2bfloat16_rn(v);
        } else if (EPI == E_F32) {
          ((float *)a.C)[row * a.ldc + n0 + n] = v;
        } else { /* E_DH */
          int i = n0 + n;
          float dh = a.scale != NULL ? __fmul_rn(a.scale[row], v) : v;
          float gr = a.sg[row * a.lds + i], ur = a.su[row * a.lds + i];
          float dg, du;
          mokk_swiglu_grads(gr, ur, dh, a.limit, &dg, &du);
          bf16 *d = (bf16 *)a.C + row * a.ldc;
          d[i] = __float2bfloat16_rn(dg);
          d[a.lds + i] = __float2bfloat16_rn(du);
        }
      }
    }
    __syncthreads(); /* the next tile overwrites shared memory */
  }
}

#endif
