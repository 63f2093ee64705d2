/* gpu_fill.cu - random bf16 tensors made on the device, for the GPU
 * benchmark: a hash of (seed, index), uniform in [-scale/2, scale/2). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

__global__ void k_fill(__nv_bfloat16 *p, int64_t n, uint64_t seed, float scale)
{
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    uint64_t z = seed + (uint64_t)i * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    p[i] = __float2bfloat16_rn(scale * ((float)(z >> 40) / 16777216.0f - 0.5f));
  }
}

extern "C" int bench_fill_bf16(void *p, int64_t n, uint64_t seed, float scale)
{
  k_fill<<<1024, 256>>>((__nv_bfloat16 *)p, n, seed, scale);
  return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
