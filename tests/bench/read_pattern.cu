/* read_pattern.cu - what the memory gives the grouped GEMMs' weight reads
 * alone. dsv3's forward GEMMs move 2.6 TB/s (PERF.md v39), where a combine
 * reading whole rows moves 3.0: this runs the GEMMs' producer side with
 * nothing computed (the copy engine's 128-byte-wide boxes of a weight tile,
 * k-block after k-block, through a ring of stages that one warp hands back
 * as they land) against the same bytes in contiguous bulk copies, at
 * several ring depths, to tell the read pattern's limit from the
 * pipeline's. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "../gpu/gemm_core.h"
#include "read_pattern.h"
#include "sm90/ptx.cuh"
#include "sm90/tma.h"

using namespace sm90;

#define READ_SMEM (200 * 1024) /* one block an SM whatever the ring takes */

__global__ void __launch_bounds__(64, 1)
k_reads(const __grid_constant__ CUtensorMap map, const unsigned char *base, int mode, int units,
        int nt_per, int nk, int rows, int stages)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ unsigned char raw[];
  unsigned char *buf = (unsigned char *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
  const uint32_t bytes = (uint32_t)rows * 128;
  uint64_t *full = (uint64_t *)(buf + (size_t)stages * bytes), *empty = full + stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; s++) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], 1);
    }
    bar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x != 0 && threadIdx.x != 32)
    return;
  const bool producer = threadIdx.x == 0;
  int s = 0;
  uint32_t ph = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x)
    for (int kb = 0; kb < nk; kb++) {
      if (producer) {
        bar_wait(&empty[s], ph ^ 1);
        bar_expect(&full[s], bytes);
        unsigned char *dst = buf + (size_t)s * bytes;
        if (mode == READS_BOXES)
          tma_load(dst, &map, kb * 64, (u % nt_per) * rows, u / nt_per, &full[s]);
        else
          cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, dst,
                                   base + ((size_t)u * nk + kb) * bytes, bytes, &full[s]);
      } else {
        bar_wait(&full[s], ph);
        bar_arrive(&empty[s]);
      }
      if (++s == stages)
        s = 0, ph ^= 1;
    }
#endif
}

extern "C" double read_pattern_time(int mode, int E, int N, int K, int rows, int stages,
                                    int iters, char *err, int errlen)
{
  size_t total = (size_t)E * N * K * 2;
  void *w = NULL;
  CUtensorMap map;
  cudaEvent_t e0, e1;
  double ms = 0;
  int sms = 0;
  double *t = NULL;

  if (N % rows || K % 64 || rows > 256 || (size_t)stages * rows * 128 + 2048 > READ_SMEM) {
    snprintf(err, errlen, "rows %d, stages %d: not a ring that fits", rows, stages);
    return 0;
  }
  if (cudaMalloc(&w, total) != cudaSuccess) {
    snprintf(err, errlen, "cannot allocate %.1f GB", total / 1e9);
    return 0;
  }
  cudaMemset(w, 0x3c, total);
  if (mokk_tmap_bf16(&map, w, K, N, E, K, (uint64_t)N * K, rows, err) != 0)
    goto out;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(k_reads, cudaFuncAttributeMaxDynamicSharedMemorySize, READ_SMEM);
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  t = (double *)calloc(iters, sizeof *t);
  for (int i = -2; i < iters; i++) {
    cudaEventRecord(e0);
    k_reads<<<sms, 64, READ_SMEM>>>(map, (const unsigned char *)w, mode, E * (N / rows),
                                     N / rows, K / 64, rows, stages);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float f = 0;
    if (i >= 0 && cudaEventElapsedTime(&f, e0, e1) == cudaSuccess)
      t[i] = f;
  }
  if (cudaGetLastError() != cudaSuccess) {
    snprintf(err, errlen, "the kernel failed");
  } else {
    ms = gemm_core_median(t, iters);
  }
  free(t);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
out:
  cudaFree(w);
  return ms;
}
