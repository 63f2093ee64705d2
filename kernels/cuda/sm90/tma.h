/* tma.h - tensor maps for the copy engine, made on the host. The driver's
 * encoder is reached through the runtime (nothing links against libcuda). */
#ifndef MOKK_CUDA_SM90_TMA_H
#define MOKK_CUDA_SM90_TMA_H

#include <cuda.h>
#include <stdint.h>

/* A bf16 tensor of depth x outer x inner elements (inner contiguous; rows
 * `ld` elements apart, depth slices `depth_ld` apart), read in boxes of
 * 64 x box_outer x 1 with the 128-byte swizzle; reads outside the tensor give
 * zeros. 0 or a negative code with a message in err. */
int mokk_tmap_bf16(CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                   uint64_t depth, uint64_t ld, uint64_t depth_ld, uint32_t box_outer, char *err);

/* An fp32 matrix of outer x inner elements, rows `ld` apart, in boxes of
 * 32 x box_outer with the 128-byte swizzle. */
int mokk_tmap_f32(CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                  uint64_t ld, uint32_t box_outer, char *err);

#endif
