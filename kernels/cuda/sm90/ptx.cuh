/* ptx.cuh - the Hopper (sm_90a) primitives the GEMM core is built from:
 * mbarriers and bulk tensor copies through CCCL's cuda::ptx, and what CCCL
 * does not wrap as inline PTX: wgmma, its shared-memory descriptors and
 * fences, setmaxnreg and named barriers.
 *
 * Every operand tile in shared memory uses the 128-byte swizzle, in one of
 * two shapes (PTX ISA, "Shared Memory Matrix Layout"):
 *   K-major:  rows of 64 bf16 (128 B) along K, one row per M (or N) index;
 *             8-row groups 1024 B apart (SBO); a k16 step is +32 B.
 *   MN-major: chunks of 64 M (or N) indices (128 B) by the tile's 64 k rows;
 *             8-k groups 1024 B apart (SBO), chunks 8 KiB apart (LBO); a
 *             k16 step is +2048 B.
 * Both are what one TMA box of {64, rows} with CU_TENSOR_MAP_SWIZZLE_128B
 * writes, so the copy engine and the tensor cores agree on the layout without
 * any code in between. Tile bases are 1024-byte aligned. */
#ifndef MOKK_CUDA_SM90_PTX_CUH
#define MOKK_CUDA_SM90_PTX_CUH

#include <cuda.h>
#include <cuda/ptx>
#include <stdint.h>

namespace sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* ---- mbarriers ------------------------------------------------------------ */

__device__ __forceinline__ void bar_init(uint64_t *bar, uint32_t count)
{
  cuda::ptx::mbarrier_init(bar, count);
}

/* Makes the initialised barriers visible to the copy engine. */
__device__ __forceinline__ void bar_init_fence()
{
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
}

/* Waits until the phase of the given parity has completed. */
__device__ __forceinline__ void bar_wait(uint64_t *bar, uint32_t parity)
{
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity))
    ;
}

__device__ __forceinline__ void bar_arrive(uint64_t *bar)
{
  (void)cuda::ptx::mbarrier_arrive(bar);
}

/* n arrivals at once: one thread answering for n warps. */
__device__ __forceinline__ void bar_arrive_n(uint64_t *bar, uint32_t n)
{
  (void)cuda::ptx::mbarrier_arrive(bar, n);
}

/* One arrival that also announces `bytes` of copies completing on bar. */
__device__ __forceinline__ void bar_expect(uint64_t *bar, uint32_t bytes)
{
  (void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                             cuda::ptx::space_shared, bar, bytes);
}

/* Arrives on the barrier at the same place in the shared memory of block
 * `rank` of the cluster. */
__device__ __forceinline__ void bar_arrive_remote(uint64_t *bar, uint32_t rank)
{
  uint32_t local = smem_addr(bar), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  /* default semantics (release, CTA scope), as for a local arrival: a
   * cluster-scope release would also wait for this thread's global stores */
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

/* v into the word at p's place in the shared memory of block `rank` of the
 * cluster, completing its 4 bytes on the barrier at bar's place there. */
__device__ __forceinline__ void st_async_remote(int *p, int v, uint64_t *bar, uint32_t rank)
{
  uint32_t rp, rbar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rp) : "r"(smem_addr(p)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(rbar)
               : "r"(smem_addr(bar)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];" ::"r"(rp),
               "r"(v), "r"(rbar)
               : "memory");
}

/* Shared-memory words other threads write between barrier phases. */
__device__ __forceinline__ int ld_shared(const int *p)
{
  int v;
  asm volatile("ld.volatile.shared.b32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)) : "memory");
  return v;
}

__device__ __forceinline__ void st_shared(int *p, int v)
{
  asm volatile("st.volatile.shared.b32 [%0], %1;" ::"r"(smem_addr(p)), "r"(v) : "memory");
}

/* ---- clusters ------------------------------------------------------------- */

__device__ __forceinline__ uint32_t cluster_rank()
{
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

/* Every thread of every block of the cluster: what each did before (its
 * barriers' initialisation) is seen by the others after. */
__device__ __forceinline__ void cluster_sync()
{
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* ---- bulk tensor copies --------------------------------------------------- */

/* A box of a 3-D tensor map into shared memory, completing on bar. */
__device__ __forceinline__ void tma_load(void *dst, const CUtensorMap *map, int c0, int c1, int c2,
                                         uint64_t *bar)
{
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst, map,
                                  coords, bar);
}

/* The same box into the shared memory of every block of the cluster in
 * `mask`, at dst's offset, completing on each one's barrier at bar's. */
__device__ __forceinline__ void tma_load_mc(void *dst, const CUtensorMap *map, int c0, int c1,
                                            int c2, uint64_t *bar, uint16_t mask)
{
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst, map,
                                  coords, bar, mask);
}

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map)
{
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

/* A copy of a tensor map in global memory whose tensor ends at row `rows`
 * (dimension 1), so that boxes reaching past it read zeros; written with
 * generic stores, then released to the copy engine's view of tensor maps.
 * The thread that loads through it first calls tma_map_acquire. */
__device__ __forceinline__ void tma_map_clip_rows(CUtensorMap *dst, const CUtensorMap *src,
                                                  int rows)
{
  *dst = *src;
  cuda::ptx::tensormap_replace_global_dim(cuda::ptx::space_global, dst, cuda::ptx::n32_t<1>(),
                                          rows);
  cuda::ptx::fence_proxy_tensormap_generic(cuda::ptx::sem_release, cuda::ptx::scope_gpu);
}

/* Before the copy engine reads a tensor map that a kernel wrote: drops any
 * stale copy of that address from the tensor-map cache. */
__device__ __forceinline__ void tma_map_acquire(const CUtensorMap *map)
{
  cuda::ptx::fence_proxy_tensormap_generic(cuda::ptx::sem_acquire, cuda::ptx::scope_gpu, map,
                                           cuda::ptx::n32_t<128>());
}

/* A box of shared memory out to a 3-D tensor map (the parts of the box
 * outside the tensor are not written). The copy belongs to the thread's
 * current bulk group. */
__device__ __forceinline__ void tma_store(const CUtensorMap *map, int c0, int c1, int c2,
                                          const void *src)
{
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, map, coords,
                                  src);
}

/* Closes the thread's bulk group of stores. */
__device__ __forceinline__ void tma_store_commit()
{
  cuda::ptx::cp_async_bulk_commit_group();
}

/* Waits until at most N of the thread's bulk groups still read their shared
 * memory (READ) or are still writing at all (!READ). */
template <int N, bool READ>
__device__ __forceinline__ void tma_store_wait()
{
  if constexpr (READ)
    cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<N>());
  else
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<N>());
}

/* Four 8 x 8 bf16 matrices from registers to shared memory: register i of
 * thread t is row t / 4, columns 2 (t % 4) + {0, 1} of matrix i, and lanes
 * 8 i .. 8 i + 7 give the addresses of matrix i's eight 16-byte rows. */
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3)
{
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

/* Two floats to shared memory (8-byte aligned). */
__device__ __forceinline__ void st_shared_f2(uint32_t addr, float a, float b)
{
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

/* ---- row gathers ------------------------------------------------------------
 * Rows picked one by one (a gathered operand: gemm_args.gather) come from the
 * producer warp's lanes as 16-byte copies, which the copy engine cannot do
 * for rows at scattered addresses (a tensor map is a strided box). n = 0:
 * zeros, nothing read. */
__device__ __forceinline__ void cp16(uint32_t dst, const void *src, int n)
{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}

/* One arrival on bar once every copy this thread has issued so far has
 * landed; the barrier's count includes it (.noinc). */
__device__ __forceinline__ void cp16_arrive(uint64_t *bar)
{
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar))
               : "memory");
}

/* Ordinary shared-memory stores become visible to the tensor cores and the
 * copy engine. */
__device__ __forceinline__ void fence_async_shared()
{
  cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
}

/* Waits until *count (written by other blocks, released at gpu scope) is
 * at least want, then orders what those blocks wrote before it ahead of
 * this thread's copy-engine loads (a generic-to-async proxy fence). */
__device__ __forceinline__ void wait_count_async(const int *count, int want)
{
  for (;;) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
    if (v >= want)
      break;
    __nanosleep(64);
  }
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
}

/* ---- warpgroups ----------------------------------------------------------- */

template <uint32_t REGS>
__device__ __forceinline__ void regs_release()
{
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

template <uint32_t REGS>
__device__ __forceinline__ void regs_claim()
{
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

/* bar.sync on a named barrier (0 is __syncthreads) for `threads` threads. */
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads)
{
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Counts towards a named barrier without waiting for it. */
__device__ __forceinline__ void named_arrive(uint32_t id, uint32_t threads)
{
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* ---- wgmma ---------------------------------------------------------------- */

/* A shared-memory matrix descriptor with the 128-byte swizzle. */
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
  return (uint64_t)((addr & 0x3ffff) >> 4) | (uint64_t)((lbo >> 4) & 0x3fff) << 16 |
         (uint64_t)((sbo >> 4) & 0x3fff) << 32 | 1ull << 62;
}

__device__ __forceinline__ void wgmma_fence()
{
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit()
{
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait()
{
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accumulator reads or writes across the
 * asynchronous MMAs. */
template <int N>
__device__ __forceinline__ void acc_fence(float (&d)[N])
{
#pragma unroll
  for (int i = 0; i < N; i++)
    asm volatile("" : "+f"(d[i])::"memory");
}

#define MOKK_W8(b) "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), \
                   "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])

/* D[64 x N] += A[64 x 16] B[16 x N], bf16 in, fp32 accumulate. TA / TB: the
 * operand is MN-major (1) or K-major (0). Thread t of the warpgroup holds
 * rows 16 (t / 32) + (t % 32) / 4 + {0, 8}, columns 8 j + 2 (t % 4) + {0, 1}:
 * d[4 j + 2 r + c] is (row + 8 r, column + c). acc = 0 ignores what D held. */
template <int TA, int TB>
__device__ __forceinline__ void wgmma_128(float (&d)[64], uint64_t a, uint64_t b, int acc)
{
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %68, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, %66, %67;\n"
      "}\n"
      : MOKK_W8(0), MOKK_W8(8), MOKK_W8(16), MOKK_W8(24), MOKK_W8(32), MOKK_W8(40),
        MOKK_W8(48), MOKK_W8(56)
      : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(acc));
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_256(float (&d)[128], uint64_t a, uint64_t b, int acc)
{
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %132, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "
      "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "
      "%124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, %130, %131;\n"
      "}\n"
      : MOKK_W8(0), MOKK_W8(8), MOKK_W8(16), MOKK_W8(24), MOKK_W8(32), MOKK_W8(40),
        MOKK_W8(48), MOKK_W8(56), MOKK_W8(64), MOKK_W8(72), MOKK_W8(80), MOKK_W8(88),
        MOKK_W8(96), MOKK_W8(104), MOKK_W8(112), MOKK_W8(120)
      : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(acc));
}

/* D[64 x 32] += A[64 x 16] B[16 x 32], and D[64 x 16] += A[64 x 16] B[16 x 16]:
 * a riding tail's product (mma.cuh). */
template <int TA, int TB>
__device__ __forceinline__ void wgmma_32(float (&d)[16], uint64_t a, uint64_t b, int acc)
{
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %20, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, %18, %19;\n"
      "}\n"
      : MOKK_W8(0), MOKK_W8(8)
      : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(acc));
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_16(float (&d)[8], uint64_t a, uint64_t b, int acc)
{
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %12, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "
      "%8, %9, p, 1, 1, %10, %11;\n"
      "}\n"
      : MOKK_W8(0)
      : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(acc));
}

/* A riding tail's product of NR = 16 or 32 rows. */
template <int NR, int TA, int TB>
__device__ __forceinline__ void wgmma_ride(float (&d)[NR / 2], uint64_t a, uint64_t b, int acc)
{
  if constexpr (NR == 32)
    wgmma_32<TA, TB>(d, a, b, acc);
  else
    wgmma_16<TA, TB>(d, a, b, acc);
}

#undef MOKK_W8

} /* namespace sm90 */

#endif
