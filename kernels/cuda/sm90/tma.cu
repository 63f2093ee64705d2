/* tma.cu - tensor maps for the Hopper GEMM core (see tma.h). */
#include <cuda_runtime.h>
#include <pthread.h>
#include <string.h>

#include "layer.h"
#include "tma.h"

typedef CUresult (*fn_encode)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                              const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                              const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static fn_encode encode;
static pthread_once_t encode_once = PTHREAD_ONCE_INIT;

static void encode_load(void)
{
  cudaDriverEntryPointQueryResult q;
  void *fn = NULL;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                       &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess)
    encode = (fn_encode)fn;
}

/* One element type's tensor map: boxes of 128 bytes (box_inner elements)
 * by box_outer rows, the 128-byte swizzle. */
static int tmap(CUtensorMap *map, CUtensorMapDataType type, uint32_t esize, const void *base,
                uint64_t inner, uint64_t outer, uint64_t depth, uint64_t ld, uint64_t depth_ld,
                uint32_t box_outer, char *err)
{
  pthread_once(&encode_once, encode_load);
  if (encode == NULL)
    return mokk_fail(err, MOK_EDEVICE, "the CUDA driver has no cuTensorMapEncodeTiled");
  if (depth == 1)
    depth_ld = ld * outer;
  cuuint64_t dims[3] = {inner, outer, depth};
  cuuint64_t strides[2] = {ld * esize, depth_ld * esize};
  cuuint32_t box[3] = {128 / esize, box_outer, 1};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = encode(map, type, 3, (void *)base, dims, strides, box, estr,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return mokk_fail(err, MOK_EDEVICE, "cuTensorMapEncodeTiled failed (CUresult %d) for a "
                     "%llu x %llu x %llu tensor at %p, rows of %llu elements", (int)r,
                     (unsigned long long)depth, (unsigned long long)outer,
                     (unsigned long long)inner, base, (unsigned long long)ld);
  return 0;
}

int mokk_tmap_bf16(CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                   uint64_t depth, uint64_t ld, uint64_t depth_ld, uint32_t box_outer, char *err)
{
  return tmap(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, inner, outer, depth, ld, depth_ld,
              box_outer, err);
}

int mokk_tmap_f32(CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                  uint64_t ld, uint32_t box_outer, char *err)
{
  return tmap(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, inner, outer, 1, ld, 0, box_outer,
              err);
}
