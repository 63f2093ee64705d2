/* route.cu - moving rows between tokens and experts: the schedule (a stable
 * counting sort of the (token, k) pairs by expert, rows of an expert by
 * token then k), the dispatch gather, the combines that sum a token's pairs
 * in k order, and d_topk_weights. No floating-point atomics: the only atomics
 * are an integer OR on the error flag and the integer row counts of the
 * dispatch that runs beside gate/up. */
#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gemm.cuh"
#include "layer.h"
#include "pdl.cuh"
#include "route.h"

/* ---- schedule ------------------------------------------------------------ */

/* The pairs are cut into chunks of ch pairs (a multiple of 32), one warp
 * each, and sorted by expert in four passes: each warp counts its chunk's
 * pairs per expert (a row of hist, [chunks][E] ints); the counts are scanned
 * down each expert's column (an entry becomes the expert's pairs in the
 * chunks before) and across the experts (segments and m-tile offsets); each
 * warp then places its chunk's pairs, in pair order, after those. A warp
 * takes 32 pairs at a time: the lanes with the same expert find each other
 * (match.any), and the lowest of them updates the expert's entry for all,
 * so no pass needs an atomic (but the error flag's OR), and each reads the
 * ids once. With one block per expert, each reading every id, the schedule
 * took 0.27 ms of dsv3's forward and 0.58 of mid's (Nsight Compute). */

/* Chunks of at least 256 pairs, at most SCHED_CHUNKS of them (a warp of
 * the column scan reads 32 entries of a column at most), and no more than
 * the scratch holds rows of hist (one at least). 1024 rather than 256: qwen3_32k's
 * four schedule kernels took 42 us instead of 68 (H100, bench_gpu --trace;
 * mid 41 against 37, dsv3 unchanged at 256 chunks). */
#define SCHED_CHUNKS 1024

static void sched_split(int64_t TK, int E, size_t scratch_bytes, int64_t *ch, int *chunks)
{
  int64_t n = (TK + 255) / 256, most = (int64_t)(scratch_bytes / ((size_t)E * sizeof(int)));
  if (most > SCHED_CHUNKS)
    most = SCHED_CHUNKS;
  if (n > most)
    n = most;
  if (n < 1)
    n = 1;
  int64_t c = ((TK + n - 1) / n + 31) / 32 * 32;
  *ch = c;
  *chunks = (int)((TK + c - 1) / c);
}

/* The lanes below this one. */
__device__ __forceinline__ unsigned lanes_below(int lane)
{
  return (1u << lane) - 1;
}

/* k_hist and k_place keep a warp's entries (one per expert) in shared
 * memory where E is at most SCHED_SMEM_E (16 KiB), in hist above; and a
 * lane loads SCHED_AHEAD of its pairs before it works through them. A
 * warp's 32 pairs at a time went through a dependent load of their entry
 * from memory, and a load of their ids before it: Nsight Compute found
 * both kernels stalled on those loads most of their time (qwen3_4k, H100:
 * k_hist 8.4 us, k_place 13.1, one warp an SM; PERF.md v30). */
#define SCHED_SMEM_E 4096
#define SCHED_AHEAD 8

/* Warp w: chunk w's pairs per expert into hist row w. The ids are the
 * client's memory, which it may still be writing: they are copied once,
 * checked, and every later pass reads the copy, so the counts and the rows
 * come from the same values. -1 (no route, as DeepEP and Megatron mark a
 * pair) drops its pair, as the CPU engine does; any other id outside [0, E)
 * becomes -1 too, and the status word says so. SM: the row counted in
 * shared memory (E ints), then stored. */
template <bool SM>
__global__ void k_hist(const int32_t *ids, int64_t TK, int E, int64_t ch, int32_t *own,
                       int *slot, int *status, int *hist)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  extern __shared__ int sched_row[];
  const int lane = threadIdx.x;
  int *out = hist + (int64_t)blockIdx.x * E, *row = SM ? sched_row : out;
  const int64_t p0 = blockIdx.x * ch, p1 = min(TK, p0 + ch);

  for (int e = lane; e < E; e += 32)
    row[e] = 0;
  __syncwarp();
  for (int64_t b = p0; b < p1; b += 32 * SCHED_AHEAD) {
    int raw[SCHED_AHEAD];
#pragma unroll
    for (int j = 0; j < SCHED_AHEAD; j++) {
      const int64_t p = b + 32 * j + lane;
      raw[j] = p < p1 ? ids[p] : -1;
    }
#pragma unroll
    for (int j = 0; j < SCHED_AHEAD; j++) {
      const int64_t p = b + 32 * j + lane;
      int id = -1;
      if (p < p1) {
        id = raw[j];
        if (id < 0 || id >= E) {
          if (id != MOKK_NO_ROUTE && status != NULL)
            atomicOr(status, 1); /* an integer flag: the order does not matter */
          id = -1;
          slot[p] = -1;
        }
        own[p] = id;
      }
      const unsigned same = __match_any_sync(0xffffffffu, id);
      if (id >= 0 && lane == __ffs(same) - 1)
        row[id] += __popc(same);
      __syncwarp();
    }
  }
  if (SM)
    for (int e = lane; e < E; e += 32)
      out[e] = sched_row[e];
}

/* Block b, experts 32 b ..: each column of hist becomes the pairs of the
 * expert in the chunks before (a warp scans a slice of up to
 * SCHED_CHUNKS / 32 chunks), and count[e] the column's total. */
__global__ void __launch_bounds__(1024) k_colscan(int *hist, int chunks, int E, int *count)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  __shared__ int part[32][33];
  const int lane = threadIdx.x & 31, j = threadIdx.x >> 5, e = blockIdx.x * 32 + lane;
  const int per = (chunks + 31) / 32, w0 = j * per;
  const int n = e < E ? max(0, min(per, chunks - w0)) : 0; /* this thread's entries */
  int *col = hist + (int64_t)w0 * E + e;
  int sum = 0;

  /* the slice is read twice, to sum it and to scan it, rather than held:
   * 32 values a thread under the 64 registers of 1024 threads spilled */
#pragma unroll 8
  for (int i = 0; i < n; i++)
    sum += col[(int64_t)i * E];
  part[j][lane] = sum;
  __syncthreads();
  if (j == 0) {
    int run = 0;
    for (int q = 0; q < 32; q++) {
      const int t = part[q][lane];
      part[q][lane] = run;
      run += t;
    }
    if (e < E)
      count[e] = run;
  }
  __syncthreads();
  int run = part[j][lane];
  for (int i0 = 0; i0 < n; i0 += 8) {
    int v[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
      v[k] = i0 + k < n ? col[(int64_t)(i0 + k) * E] : 0;
#pragma unroll
    for (int k = 0; k < 8; k++)
      if (i0 + k < n) {
        col[(int64_t)(i0 + k) * E] = run;
        run += v[k];
      }
  }
}

/* The four prefix sums over experts of one schedule, as one int4: rows, and
 * m-tiles of 128 rows, of 256 rows, and of 128 rows with riding tails. */
__device__ __forceinline__ int4 expert_sizes(int c)
{
  return make_int4(c, (c + G_BM - 1) / G_BM, (c + 2 * G_BM - 1) / (2 * G_BM),
                   mokk_ride_mtiles(c));
}

__device__ __forceinline__ int4 add4(int4 a, int4 b)
{
  return make_int4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

/* One block: segment starts and m-tile offsets, in expert order. Thread i
 * sums a run of consecutive experts; the runs' totals are scanned across
 * the block (lanes, then warps); each thread then writes its run's. */
__global__ void __launch_bounds__(1024) k_offsets(const int *count, int E, int *row_start,
                                                  int *tile_off)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  __shared__ int4 warp_sum[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per = (E + blockDim.x - 1) / blockDim.x, e0 = threadIdx.x * per,
            e1 = min(E, e0 + per);
  int4 mine = make_int4(0, 0, 0, 0);

  for (int e = e0; e < e1; e++)
    mine = add4(mine, expert_sizes(count[e]));
  int4 incl = mine; /* inclusive scan over the warp */
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int4 t;
    t.x = __shfl_up_sync(0xffffffffu, incl.x, o);
    t.y = __shfl_up_sync(0xffffffffu, incl.y, o);
    t.z = __shfl_up_sync(0xffffffffu, incl.z, o);
    t.w = __shfl_up_sync(0xffffffffu, incl.w, o);
    if (lane >= o)
      incl = add4(incl, t);
  }
  if (lane == 31)
    warp_sum[warp] = incl;
  __syncthreads();
  int4 run = make_int4(0, 0, 0, 0);
  for (int w = 0; w < warp; w++)
    run = add4(run, warp_sum[w]);
  run = add4(run, make_int4(incl.x - mine.x, incl.y - mine.y, incl.z - mine.z, incl.w - mine.w));
  for (int e = e0; e < e1; e++) {
    row_start[e] = run.x;
    tile_off[route_tile_off_at(E, ROUTE_TILES_WIDE) + e] = run.y;
    tile_off[route_tile_off_at(E, ROUTE_TILES_TALL) + e] = run.z;
    tile_off[route_tile_off_at(E, ROUTE_TILES_RIDE) + e] = run.w;
    tile_off[route_tile_off_at(E, ROUTE_READY) + e] = 0;
    run = add4(run, expert_sizes(count[e]));
  }
  if (e0 < E && e1 == E) { /* the thread with the last expert: the totals */
    row_start[E] = run.x;
    tile_off[route_tile_off_at(E, ROUTE_TILES_WIDE) + E] = run.y;
    tile_off[route_tile_off_at(E, ROUTE_TILES_TALL) + E] = run.z;
    tile_off[route_tile_off_at(E, ROUTE_TILES_RIDE) + E] = run.w;
  }
}

/* Warp w: chunk w's pairs get consecutive rows of their experts, in pair
 * order (token, then k), from the rows the chunks before took. SM: each
 * expert's next row (its segment's start plus hist's entry) kept in
 * shared memory. */
template <bool SM>
__global__ void k_place(const int32_t *own, const float *tw, int64_t TK, int E, int64_t ch,
                        int *hist, const int *row_start, int *slot, int *src, float *row_w)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  extern __shared__ int sched_row[];
  const int lane = threadIdx.x;
  int *row = hist + (int64_t)blockIdx.x * E;
  const int64_t p0 = blockIdx.x * ch, p1 = min(TK, p0 + ch);

  if (SM) {
    for (int e = lane; e < E; e += 32)
      sched_row[e] = row_start[e] + row[e];
    __syncwarp();
  }
  for (int64_t b = p0; b < p1; b += 32 * SCHED_AHEAD) {
    int idv[SCHED_AHEAD];
    float wv[SCHED_AHEAD];
#pragma unroll
    for (int j = 0; j < SCHED_AHEAD; j++) {
      const int64_t p = b + 32 * j + lane;
      idv[j] = p < p1 ? own[p] : -1;
      wv[j] = p < p1 ? tw[p] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < SCHED_AHEAD; j++) {
      const int64_t p = b + 32 * j + lane;
      const int id = idv[j];
      const unsigned same = __match_any_sync(0xffffffffu, id);
      const int first = __ffs(same) - 1;
      int at = 0;
      if (id >= 0 && lane == first)
        at = SM ? sched_row[id] : row_start[id] + row[id];
      at = __shfl_sync(0xffffffffu, at, first);
      if (id >= 0) {
        const int r = at + __popc(same & lanes_below(lane));
        slot[p] = r;
        src[r] = (int)p;
        row_w[r] = wv[j];
        if (lane == first)
          (SM ? sched_row : row)[id] += __popc(same);
      }
      __syncwarp();
    }
  }
}

/* ---- dispatch and combine -------------------------------------------------- */

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

/* The gathers move a row as 16-byte chunks, thread i of a block of
 * GATHER_THREADS taking chunks i, i + GATHER_THREADS, ...; each thread
 * issues GATHER_BATCH chunks' loads before their first store. With one
 * load then its store, a thread kept 16 bytes in flight and the gathers
 * moved 2.1 TB/s (mid forward: 0.55 ms for 1.2 GB, Nsight Compute). */
#define GATHER_THREADS 128
#define GATHER_BATCH 4

/* d_topk_weights' order, shared by the backward's gather and k_dtw, so that
 * a pair's bits do not depend on which of them computed it: thread i sums
 * its chunks in ascending order, the eight elements of each in order; then
 * each warp's 32 sums by a fixed butterfly, and the four warps' in order. */
__device__ __forceinline__ float dot8(float acc, uint4 a, uint4 b)
{
  union { uint4 v; bf16 h[8]; } x, y;
  x.v = a, y.v = b;
#pragma unroll
  for (int j = 0; j < 8; j++)
    acc = __fadd_rn(acc, __fmul_rn(__bfloat162float(x.h[j]), __bfloat162float(y.h[j])));
  return acc;
}

/* The block's sum of each thread's acc (valid in thread 0). part: 2 x 4
 * floats of shared memory; a block summing row after row alternates halves
 * (odd: the row's count in this block), so that one barrier a row keeps a
 * warp from overwriting a half that thread 0 has not read. */
__device__ __forceinline__ float block_sum(float acc, float *part, int odd)
{
  static_assert(GATHER_THREADS == 128, "four warps");
  for (int o = 16; o > 0; o >>= 1)
    acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
  float *mine = part + 4 * odd;
  if ((threadIdx.x & 31) == 0)
    mine[threadIdx.x >> 5] = acc;
  __syncthreads();
  return __fadd_rn(__fadd_rn(__fadd_rn(mine[0], mine[1]), mine[2]), mine[3]);
}

/* A thread's batch of a row's n chunks from c on: loaded, then stored. */
__device__ __forceinline__ void batch_load(uint4 (&v)[GATHER_BATCH], const uint4 *s, int c,
                                           int n)
{
#pragma unroll
  for (int b = 0; b < GATHER_BATCH; b++)
    if (c + b * GATHER_THREADS < n)
      v[b] = __ldg(s + c + b * GATHER_THREADS);
}

__device__ __forceinline__ void batch_store(uint4 *d, const uint4 (&v)[GATHER_BATCH], int c,
                                            int n)
{
#pragma unroll
  for (int b = 0; b < GATHER_BATCH; b++)
    if (c + b * GATHER_THREADS < n)
      d[c + b * GATHER_THREADS] = v[b];
}

/* Rows [*lo, *hi): xr[row] = x[token of row]. */
__global__ void __launch_bounds__(GATHER_THREADS)
k_gather(route_rows x, const int *src, const int *lo, const int *hi, int K, int64_t H,
         bf16 *__restrict__ xr)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  const int first = lo != NULL ? *lo : 0, rows = *hi, n = (int)(H / 8);
  for (int row = first + blockIdx.x; row < rows; row += gridDim.x) {
    int64_t t = src[row] / K;
    const uint4 *s = (const uint4 *)(x.p[t / x.T] + (t % x.T) * H);
    uint4 *d = (uint4 *)(xr + (int64_t)row * H);
    for (int c = threadIdx.x; c < n; c += GATHER_THREADS * GATHER_BATCH) {
      uint4 v[GATHER_BATCH];
      batch_load(v, s, c, n);
      batch_store(d, v, c, n);
    }
  }
}

/* k_gather's rows token by token. k_gather walks the rows it writes, an
 * expert's tokens and then the next expert's, so it reads each row of x
 * K times, and x (dsv3: 117 MB) does not stay in the L2 between them;
 * here a block reads a token's row once and stores it to its K rows
 * (slot; -1, or outside [*lo, *hi): none). The same bytes land either
 * way. A token none of whose rows are in range is not read (a spread
 * step's rank: the rows of its own experts). */
__global__ void __launch_bounds__(GATHER_THREADS)
k_gather_tokens(route_rows x, const int *slot, int64_t tokens, const int *lo, const int *hi,
                int K, int64_t H, bf16 *__restrict__ xr)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  const int first = lo != NULL ? *lo : 0, rows = *hi, n = (int)(H / 8);
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int *to = slot + t * K;
    int mine = 0;
    for (int k = 0; k < K; k++) {
      const int row = __ldg(to + k);
      mine += row >= first && row < rows;
    }
    if (mine == 0)
      continue;
    const uint4 *s = (const uint4 *)(x.p[t / x.T] + (t % x.T) * H);
    for (int c = threadIdx.x; c < n; c += GATHER_THREADS * GATHER_BATCH) {
      uint4 v[GATHER_BATCH];
      batch_load(v, s, c, n);
      for (int k = 0; k < K; k++) {
        const int row = __ldg(to + k);
        if (row >= first && row < rows)
          batch_store((uint4 *)(xr + (int64_t)row * H), v, c, n);
      }
    }
  }
}

/* The forward's dispatch beside the gate/up GEMM (route_gather_ahead), on
 * a few SMs, which must move as many bytes as the whole GPU's blocks of
 * k_gather do. Registers hold too little for that: blocks of 1024 threads,
 * eight 16-byte chunks each in flight, moved 0.7 TB/s on 32 SMs (dsv3,
 * H100; PERF.md v16). So the copy engine moves the rows: each warp of a
 * block is a worker with a ring of slots of a row each in shared memory;
 * its lane 0 loads rows into the ring (cp.async.bulk, completing on the
 * slot's mbarrier) and stores each out as it lands (a bulk group per row),
 * refilling a slot once the store has read it. Worker w of W
 * takes rows w, w + W, ..., so that experts complete in schedule order.
 * Once a row's store has completed (AHEAD_LAG stores later), it is
 * counted: ready[e] grows, released at gpu scope, as the worker moves past
 * expert e. */
#define AHEAD_LAG 8
#define AHEAD_SMEM (200 * 1024)

/* The layout of the dynamic shared memory: row_start, then each worker's
 * mbarriers, then each worker's slots (128-byte aligned). */
static __host__ __device__ size_t ahead_rs_bytes(int E)
{
  return ((size_t)(E + 1) * 4 + 127) & ~(size_t)127;
}

static __host__ __device__ size_t ahead_head(int E, int workers, int slots)
{
  return ahead_rs_bytes(E) + (((size_t)workers * slots * 8 + 127) & ~(size_t)127);
}

__device__ __forceinline__ void ahead_release(int *ready, int e, int n)
{
  /* the rows' bulk stores have completed: order them (async proxy) before
   * the release that the GEMM's acquire and copy-engine loads follow */
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ready + e), "r"(n) : "memory");
}

/* A worker's count of completed rows: the expert of the rows counted last
 * (e), how many of them have not been released (n), and the walk over
 * row_start to the expert of the next (rows come in ascending order). */
typedef struct ahead_run {
  int e, n, walk;
} ahead_run;

__device__ __forceinline__ void ahead_count(ahead_run &r, const int *rs, int row, int *ready)
{
  while (row >= rs[r.walk + 1])
    r.walk++;
  if (r.walk != r.e) {
    if (r.n > 0)
      ahead_release(ready, r.e, r.n);
    r.e = r.walk, r.n = 0;
  }
  r.n++;
}

__global__ void __launch_bounds__(256, 1)
k_gather_ahead(route_rows x, const int *src, const int *row_start, int E, int K, int64_t H,
               bf16 *__restrict__ xr, int *ready, int slots)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char sm[];
  pdl_enter(); /* pdl.cuh: nothing global before it */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  const uint32_t rb = (uint32_t)(H * 2);
  int *rs = (int *)sm;
  uint64_t *full = (uint64_t *)(sm + ahead_rs_bytes(E)) + warp * slots;
  unsigned char *buf = sm + ahead_head(E, nw, slots) + (size_t)warp * slots * rb;
  for (int i = threadIdx.x; i <= E; i += blockDim.x)
    rs[i] = row_start[i];
  if (lane == 0) {
    for (int s = 0; s < slots; s++)
      cuda::ptx::mbarrier_init(&full[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  __syncthreads();
  const int rows = rs[E], w = blockIdx.x * nw + warp, W = gridDim.x * nw;
  const int n = rows > w ? (rows - w + W - 1) / W : 0; /* this worker's rows: w + j W */
  /* each lane holds the pair of one of 32 consecutive units, and loads the
   * next 32 ahead of their use */
  int tb = 0, tv = lane < n ? src[w + lane * W] : 0;
  int tn = 32 + lane < n ? src[w + (32 + lane) * W] : 0;
  ahead_run run = {-1, 0, 0};

  for (int q = 0; q < n + slots; q++) {
    /* store unit j = q - slots once it has landed, then, once that store
     * has read its slot, load unit q (q < n) into it: every slot holds a
     * load in flight while the worker waits */
    const int j = q - slots;
    if (j >= 0 && lane == 0) {
      while (!cuda::ptx::mbarrier_try_wait_parity(&full[j % slots], (uint32_t)(j / slots) & 1))
        ;
      cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared,
                               xr + (int64_t)(w + j * W) * H, buf + (size_t)(j % slots) * rb,
                               rb);
      cuda::ptx::cp_async_bulk_commit_group();
      if (j >= AHEAD_LAG) { /* unit j - AHEAD_LAG's store has completed */
        cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<AHEAD_LAG>());
        ahead_count(run, rs, w + (j - AHEAD_LAG) * W, ready);
      }
    }
    if (q < n) {
      if ((q >> 5) != tb) {
        tb = q >> 5, tv = tn;
        int u = 32 * (tb + 1) + lane;
        tn = u < n ? src[w + u * W] : 0;
      }
      int p = __shfl_sync(0xffffffffu, tv, q & 31);
      if (lane == 0) {
        if (j >= 0) /* unit j's store, the newest, has read the slot */
          cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<0>());
        int64_t t = p / K;
        const bf16 *sp = x.p[t / x.T] + (t % x.T) * H;
        uint64_t *bar = &full[q % slots];
        (void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                                   cuda::ptx::space_shared, bar, rb);
        cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global,
                                 buf + (size_t)(q % slots) * rb, sp, rb, bar);
      }
    }
  }
  if (lane == 0) {
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>());
    for (int j = n > AHEAD_LAG ? n - AHEAD_LAG : 0; j < n; j++)
      ahead_count(run, rs, w + j * W, ready);
    if (run.n > 0)
      ahead_release(ready, run.e, run.n);
  }
#endif
}

/* The backward's dispatch, rows [*lo, *hi): dy[row] = bf16(row_w[row]
 * d_out[token of row]); with dtw.p[0], also the row's pair's
 * d_topk_weights, dot(d_out[token], y[row]), read in the same pass as d_out
 * (a kernel of its own read y at 4.1 TB/s, and d_out again: mid 0.29 ms).
 * INPLACE: dy is y (a context's last backward): each thread reads its
 * 16 bytes of y's row before it writes the same 16 bytes of dy's, with
 * plain loads, as memory this kernel writes must be read. */
template <bool INPLACE>
__global__ void __launch_bounds__(GATHER_THREADS)
k_gather_dy(route_rows d_out, const int *src, const int *lo, const int *hi, int K, int64_t H,
            const float *row_w, bf16 *dy, route_owners y, route_pairs dtw)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  __shared__ float part[8];
  const int first = lo != NULL ? *lo : 0, rows = *hi, n = (int)(H / 8);
  const bool dot = dtw.p[0] != NULL;
  int odd = 0;
  for (int row = first + blockIdx.x; row < rows; row += gridDim.x, odd ^= 1) {
    const int64_t p = src[row], t = p / K;
    const float w = row_w[row];
    const uint4 *s = (const uint4 *)(d_out.p[t / d_out.T] + (t % d_out.T) * H);
    const uint4 *v = dot ? (const uint4 *)owned_row<bf16>(y, row, H) : NULL;
    uint4 *d = (uint4 *)(dy + (int64_t)row * H);
    float acc = 0.0f;
    for (int c = threadIdx.x; c < n; c += GATHER_THREADS * GATHER_BATCH) {
      uint4 a[GATHER_BATCH], b[GATHER_BATCH];
#pragma unroll
      for (int i = 0; i < GATHER_BATCH; i++)
        if (c + i * GATHER_THREADS < n) {
          a[i] = __ldg(s + c + i * GATHER_THREADS);
          if (dot)
            b[i] = INPLACE ? v[c + i * GATHER_THREADS] : __ldg(v + c + i * GATHER_THREADS);
        }
#pragma unroll
      for (int i = 0; i < GATHER_BATCH; i++)
        if (c + i * GATHER_THREADS < n) {
          union { uint4 v; bf16 h[8]; } in, o;
          in.v = a[i];
#pragma unroll
          for (int j = 0; j < 8; j++)
            o.h[j] = __float2bfloat16_rn(__fmul_rn(w, __bfloat162float(in.h[j])));
          d[c + i * GATHER_THREADS] = o.v;
          if (dot)
            acc = dot8(acc, a[i], b[i]);
        }
    }
    if (dot) {
      float sum = block_sum(acc, part, odd);
      if (threadIdx.x == 0)
        dtw.p[p / dtw.n][p % dtw.n] = sum;
    }
  }
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
 * d_x (fp32 rows, no weights, shared part). tw and extra may be NULL. W
 * columns of rows ldv (v) and ldo (extra, out) elements apart: d_x comes
 * in slices of its columns. Each thread owns eight columns; every element
 * is summed in the same order. The eight columns of up to COMBINE_KS of a
 * token's rows are loaded before the first is added, so that a thread waits
 * on memory twice for them (their slots, then their rows) rather than twice
 * a row. */
#define COMBINE_KS 8

/* Eight elements of a row as loaded (bf16: one 16-byte word; fp32: two),
 * converted only as they are added, so that COMBINE_KS of them in flight
 * take half the registers for bf16 rows. */
template <typename V> struct raw8;
template <> struct raw8<bf16> {
  uint4 v;
  __device__ __forceinline__ void load(const bf16 *p) { v = *(const uint4 *)p; }
  __device__ __forceinline__ float at(int j) const
  {
    const uint32_t w = j < 4 ? (j < 2 ? v.x : v.y) : (j < 6 ? v.z : v.w);
    return __uint_as_float(j & 1 ? w & 0xffff0000u : w << 16); /* bf16 -> fp32: exact */
  }
};
template <> struct raw8<float> {
  float4 a, b;
  __device__ __forceinline__ void load(const float *p)
  {
    a = *(const float4 *)p, b = *(const float4 *)(p + 4);
  }
  __device__ __forceinline__ float at(int j) const
  {
    return j < 4 ? (j < 2 ? (j ? a.y : a.x) : (j & 1 ? a.w : a.z))
                 : (j < 6 ? (j & 1 ? b.y : b.x) : (j & 1 ? b.w : b.z));
  }
};

template <typename V, typename X>
__global__ void k_combine(route_owners v, const int *slot, const float *tw, const X *extra,
                          int64_t T, int K, int64_t W, int64_t ldv, int64_t ldo, bf16 *out)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
    for (int64_t c = threadIdx.x * 8; c < W; c += blockDim.x * 8) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k0 = 0; k0 < K; k0 += COMBINE_KS) {
        int r[COMBINE_KS];
        float w[COMBINE_KS];
        raw8<V> x[COMBINE_KS];
#pragma unroll
        for (int i = 0; i < COMBINE_KS; i++) {
          const bool in = k0 + i < K;
          r[i] = in ? slot[t * K + k0 + i] : -1;
          w[i] = in && tw != NULL ? tw[t * K + k0 + i] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < COMBINE_KS; i++)
          if (r[i] >= 0)
            x[i].load(owned_row<V>(v, r[i], ldv) + c);
#pragma unroll
        for (int i = 0; i < COMBINE_KS; i++)
          if (r[i] >= 0) {
#pragma unroll
            for (int j = 0; j < 8; j++)
              acc[j] = __fadd_rn(acc[j], tw != NULL ? __fmul_rn(w[i], x[i].at(j)) : x[i].at(j));
          }
      }
      if (extra != NULL) {
        float e[8];
        load8(extra + t * ldo + c, e);
#pragma unroll
        for (int j = 0; j < 8; j++)
          acc[j] = __fadd_rn(acc[j], e[j]);
      }
      union { uint4 v; bf16 h[8]; } o;
#pragma unroll
      for (int j = 0; j < 8; j++)
        o.h[j] = __float2bfloat16_rn(acc[j]);
      *(uint4 *)(out + t * ldo + c) = o.v;
    }
}

/* d_topk_weights[t,k] = sum_h d_out[t,h] y[t,k,h], a block per pair, in
 * k_gather_dy's order (dot8, block_sum): for a spread step, whose ranks
 * gather their experts' rows and cannot write each other's pairs. */
__global__ void __launch_bounds__(GATHER_THREADS)
k_dtw(const bf16 *d_out, route_owners y, const int *slot, int64_t TK, int K, int64_t H,
      float *dtw)
{
  pdl_enter(); /* pdl.cuh: nothing global before it */
  __shared__ float part[8];
  const int n = (int)(H / 8);
  int odd = 0;
  for (int64_t p = blockIdx.x; p < TK; p += gridDim.x) {
    const int r = slot[p]; /* the same for the whole block */
    if (r < 0) {
      if (threadIdx.x == 0)
        dtw[p] = 0.0f;
      continue;
    }
    const uint4 *s = (const uint4 *)(d_out + (p / K) * H);
    const uint4 *v = (const uint4 *)owned_row<bf16>(y, r, H);
    float acc = 0.0f;
    for (int c = threadIdx.x; c < n; c += GATHER_THREADS)
      acc = dot8(acc, __ldg(s + c), __ldg(v + c));
    float sum = block_sum(acc, part, odd);
    odd ^= 1;
    if (threadIdx.x == 0)
      dtw[p] = sum;
  }
}

/* ---- launches ------------------------------------------------------------- */

void route_schedule(cudaStream_t st, const int32_t *ids, const float *tw, int64_t TK, int E,
                    int32_t *own_ids, int *count, int *row_start, int *tile_off, int *slot,
                    int *src, float *row_w, int *status, void *scratch, size_t scratch_bytes)
{
  int64_t ch;
  int chunks;
  sched_split(TK, E, scratch_bytes, &ch, &chunks);
  const bool sm = E <= SCHED_SMEM_E;
  const size_t row_bytes = sm ? (size_t)E * sizeof(int) : 0;
  pdl_launch(sm ? k_hist<true> : k_hist<false>, chunks, 32, row_bytes, st, ids, TK, E, ch,
             own_ids, slot, status, (int *)scratch);
  pdl_launch(k_colscan, (E + 31) / 32, 1024, 0, st, (int *)scratch, chunks, E, count);
  pdl_launch(k_offsets, 1, 1024, 0, st, (const int *)count, E, row_start, tile_off);
  pdl_launch(sm ? k_place<true> : k_place<false>, chunks, 32, row_bytes, st,
             (const int32_t *)own_ids, tw, TK, E, ch, (int *)scratch, (const int *)row_start,
             slot, src, row_w);
}

void route_gather(cudaStream_t st, int grid, route_rows x, const int *src, const int *lo,
                  const int *hi, int K, int64_t H, bf16 *xr)
{
  pdl_launch(k_gather, grid, GATHER_THREADS, 0, st, x, src, lo, hi, K, H, xr);
}

void route_gather_tokens(cudaStream_t st, int grid, route_rows x, const int *slot,
                         int64_t tokens, const int *lo, const int *hi, int K, int64_t H,
                         bf16 *xr)
{
  pdl_launch(k_gather_tokens, grid, GATHER_THREADS, 0, st, x, slot, tokens, lo, hi, K, H, xr);
}

/* Workers a block and slots a worker for rows of H bf16: 0 slots where
 * fewer than two rows a worker fit. */
static void ahead_shape(int E, int64_t H, int *workers, int *slots)
{
  size_t rb = (size_t)H * 2;
  *workers = rb <= 8192 ? 8 : 4;
  size_t room = AHEAD_SMEM - ahead_head(E, *workers, 16);
  size_t s = room / (*workers * rb);
  *slots = s < 2 ? 0 : s > 16 ? 16 : (int)s;
}

bool route_gather_ahead_fits(int E, int64_t H)
{
  int workers, slots;
  ahead_shape(E, H, &workers, &slots);
  return slots > 0;
}

cudaError_t route_gather_ahead(cudaStream_t st, int blocks, route_rows x, const int *src,
                               const int *row_start, int E, int K, int64_t H, bf16 *xr,
                               int *ready)
{
  int workers, slots;
  ahead_shape(E, H, &workers, &slots);
  if (slots == 0)
    return cudaErrorInvalidValue;
  size_t smem = ahead_head(E, workers, slots) + (size_t)workers * slots * H * 2;
  cudaError_t e = cudaFuncSetAttribute(k_gather_ahead, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem);
  if (e != cudaSuccess)
    return e;
  return pdl_launch(k_gather_ahead, blocks, 32 * workers, smem, st, x, src, row_start, E, K, H,
                    xr, ready, slots);
}

void route_gather_dy(cudaStream_t st, int grid, route_rows d_out, const int *src,
                     const int *lo, const int *hi, int K, int64_t H, const float *row_w,
                     bf16 *dy, route_owners y, route_pairs dtw)
{
  if (dy == (const bf16 *)y.p[0]) /* in place (dtw.p[0] is set: the dot reads y first) */
    pdl_launch(k_gather_dy<true>, grid, GATHER_THREADS, 0, st, d_out, src, lo, hi, K, H, row_w,
               dy, y, dtw);
  else
    pdl_launch(k_gather_dy<false>, grid, GATHER_THREADS, 0, st, d_out, src, lo, hi, K, H, row_w,
               dy, y, dtw);
}

void route_combine_out(cudaStream_t st, int grid, route_owners y, const int *slot,
                       const float *tw, const bf16 *ys, int64_t T, int K, int64_t H, bf16 *out)
{
  pdl_launch(k_combine<bf16, bf16>, grid, 256, 0, st, y, slot, tw, ys, T, K, H, H, H, out);
}

void route_combine_dx(cudaStream_t st, int grid, route_owners dxr, const int *slot,
                      const float *dxs, int64_t T, int K, int64_t W, int64_t ldr, int64_t H,
                      bf16 *dx)
{
  pdl_launch(k_combine<float, float>, grid, 256, 0, st, dxr, slot, (const float *)NULL, dxs, T,
             K, W, ldr, H, dx);
}

void route_dtw(cudaStream_t st, int grid, const bf16 *d_out, route_owners y, const int *slot,
               int64_t TK, int K, int64_t H, float *dtw)
{
  pdl_launch(k_dtw, grid, GATHER_THREADS, 0, st, d_out, y, slot, TK, K, H, dtw);
}
