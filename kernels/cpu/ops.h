/* ops.h - the CPU engine's three matrix shapes. Each output element has one
 * fixed summation order that depends only on the shape, never on tiling or on
 * which thread computes it; that is what makes the engine's bits independent
 * of its thread count and of the other rows in a batch.
 *
 *  dot:   8 lanes, lane l sums elements j = l (mod 8) in ascending j, then
 *         ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). bf16*bf16 products are exact
 *         in fp32, so only the sums round.
 *  axpy:  sequential over the reduced index, ascending.
 *  wgrad: rows in chunks of MOKC_CHUNK from the segment start; each chunk is
 *         summed sequentially, chunk sums are added in ascending chunk order. */
#ifndef MOKC_OPS_H
#define MOKC_OPS_H

#include <stdint.h>

#define MOKC_CHUNK 64

/* C[m, n] = dot(A[m, :Kd], B[n, :Kd]) for m < M, n < N. */
void mokc_gemm_nt(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                  int64_t M, int64_t N, int64_t Kd, float *C, int64_t ldc);

/* C[m, n - n0] = sum_j a[m, j] * B[j, n], j ascending in [0, J), n in [n0, n1). */
void mokc_gemm_axpy(const float *a, int64_t lda, const uint16_t *B, int64_t ldb,
                    int64_t M, int64_t J, int64_t n0, int64_t n1, float *C,
                    int64_t ldc);

/* G[o - o0, c] = sum_r a[r, o] * b[r, c] over rows r in [0, R) (chunked), for
 * o in [o0, o1) and c in [0, Cn). R = 0 gives zeros. */
void mokc_wgrad(const float *a, int64_t lda, const uint16_t *b, int64_t ldb,
                int64_t R, int64_t o0, int64_t o1, int64_t Cn, float *G,
                int64_t ldg);

#endif
