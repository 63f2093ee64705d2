/* ops.c - see ops.h for the summation orders. The code is written with GCC
 * vector extensions, lane-wise only (no reassociation, no contraction), so the
 * AVX2 clone and the baseline clone give the same bits. */
#include "ops.h"

#include <string.h>

/* The helpers below are static and inlined; their vector ABI never shows. */
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) &&             \
    !defined(__SANITIZE_ADDRESS__)
#define MOKC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOKC_CLONES
#endif

static inline v8f widen(v8h h)
{
  v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline v8f load_bf16(const uint16_t *p)
{
  v8h h;
  memcpy(&h, p, sizeof h);
  return widen(h);
}

/* the last n < 8 elements, zero padded: adds +0 to the higher lanes, which
 * leaves every lane's value as the unpadded order would */
static inline v8f load_bf16_tail(const uint16_t *p, int64_t n)
{
  v8h h = {0};
  memcpy(&h, p, (size_t)n * sizeof(uint16_t));
  return widen(h);
}

static inline v8f load_f32(const float *p)
{
  v8f f;
  memcpy(&f, p, sizeof f);
  return f;
}

static inline void store_f32(float *p, v8f f)
{
  memcpy(p, &f, sizeof f);
}

static inline float hsum(v8f a)
{
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

static float dot1(const uint16_t *a, const uint16_t *b, int64_t Kd)
{
  v8f acc = {0};
  int64_t j = 0;
  for (; j + 8 <= Kd; j += 8)
    acc += load_bf16(a + j) * load_bf16(b + j);
  if (j < Kd)
    acc += load_bf16_tail(a + j, Kd - j) * load_bf16_tail(b + j, Kd - j);
  return hsum(acc);
}

/* 2 x 4 block of dots; each element follows dot1's order exactly */
static void dot2x4(const uint16_t *a0, const uint16_t *a1, const uint16_t *B,
                   int64_t ldb, int64_t Kd, float *c0, float *c1)
{
  v8f s00 = {0}, s01 = {0}, s02 = {0}, s03 = {0};
  v8f s10 = {0}, s11 = {0}, s12 = {0}, s13 = {0};
  const uint16_t *b0 = B, *b1 = B + ldb, *b2 = B + 2 * ldb, *b3 = B + 3 * ldb;
  int64_t j = 0;

  for (; j + 8 <= Kd; j += 8) {
    v8f x0 = load_bf16(a0 + j), x1 = load_bf16(a1 + j);
    v8f w0 = load_bf16(b0 + j), w1 = load_bf16(b1 + j);
    v8f w2 = load_bf16(b2 + j), w3 = load_bf16(b3 + j);
    s00 += x0 * w0, s01 += x0 * w1, s02 += x0 * w2, s03 += x0 * w3;
    s10 += x1 * w0, s11 += x1 * w1, s12 += x1 * w2, s13 += x1 * w3;
  }
  if (j < Kd) {
    int64_t n = Kd - j;
    v8f x0 = load_bf16_tail(a0 + j, n), x1 = load_bf16_tail(a1 + j, n);
    v8f w0 = load_bf16_tail(b0 + j, n), w1 = load_bf16_tail(b1 + j, n);
    v8f w2 = load_bf16_tail(b2 + j, n), w3 = load_bf16_tail(b3 + j, n);
    s00 += x0 * w0, s01 += x0 * w1, s02 += x0 * w2, s03 += x0 * w3;
    s10 += x1 * w0, s11 += x1 * w1, s12 += x1 * w2, s13 += x1 * w3;
  }
  c0[0] = hsum(s00), c0[1] = hsum(s01), c0[2] = hsum(s02), c0[3] = hsum(s03);
  c1[0] = hsum(s10), c1[1] = hsum(s11), c1[2] = hsum(s12), c1[3] = hsum(s13);
}

MOKC_CLONES
void mokc_gemm_nt(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                  int64_t M, int64_t N, int64_t Kd, float *C, int64_t ldc)
{
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4)
      dot2x4(A + m * lda, A + (m + 1) * lda, B + n * ldb, ldb, Kd, C + m * ldc + n,
             C + (m + 1) * ldc + n);
    for (; n < N; n++) {
      C[m * ldc + n] = dot1(A + m * lda, B + n * ldb, Kd);
      C[(m + 1) * ldc + n] = dot1(A + (m + 1) * lda, B + n * ldb, Kd);
    }
  }
  for (; m < M; m++)
    for (int64_t n = 0; n < N; n++)
      C[m * ldc + n] = dot1(A + m * lda, B + n * ldb, Kd);
}

MOKC_CLONES
void mokc_gemm_axpy(const float *a, int64_t lda, const uint16_t *B, int64_t ldb,
                    int64_t M, int64_t J, int64_t n0, int64_t n1, float *C,
                    int64_t ldc)
{
  int64_t m = 0;

  for (; m + 4 <= M; m += 4) {
    const float *a0 = a + m * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) {
      v8f c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0};
      v8f c20 = {0}, c21 = {0}, c30 = {0}, c31 = {0};
      for (int64_t j = 0; j < J; j++) {
        v8f b0 = load_bf16(B + j * ldb + n), b1 = load_bf16(B + j * ldb + n + 8);
        v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        s0 += a0[j], s1 += a1[j], s2 += a2[j], s3 += a3[j];
        c00 += s0 * b0, c01 += s0 * b1, c10 += s1 * b0, c11 += s1 * b1;
        c20 += s2 * b0, c21 += s2 * b1, c30 += s3 * b0, c31 += s3 * b1;
      }
      store_f32(C + (m + 0) * ldc + n - n0, c00), store_f32(C + (m + 0) * ldc + n - n0 + 8, c01);
      store_f32(C + (m + 1) * ldc + n - n0, c10), store_f32(C + (m + 1) * ldc + n - n0 + 8, c11);
      store_f32(C + (m + 2) * ldc + n - n0, c20), store_f32(C + (m + 2) * ldc + n - n0 + 8, c21);
      store_f32(C + (m + 3) * ldc + n - n0, c30), store_f32(C + (m + 3) * ldc + n - n0 + 8, c31);
    }
    for (; n < n1; n++) {
      float c0 = 0, c1 = 0, c2 = 0, c3 = 0;
      for (int64_t j = 0; j < J; j++) {
        float b;
        uint32_t u = (uint32_t)B[j * ldb + n] << 16;
        memcpy(&b, &u, sizeof b);
        c0 += a0[j] * b, c1 += a1[j] * b, c2 += a2[j] * b, c3 += a3[j] * b;
      }
      C[(m + 0) * ldc + n - n0] = c0, C[(m + 1) * ldc + n - n0] = c1;
      C[(m + 2) * ldc + n - n0] = c2, C[(m + 3) * ldc + n - n0] = c3;
    }
  }
  for (; m < M; m++) {
    const float *a0 = a + m * lda;
    for (int64_t n = n0; n < n1; n++) {
      float c0 = 0;
      for (int64_t j = 0; j < J; j++) {
        float b;
        uint32_t u = (uint32_t)B[j * ldb + n] << 16;
        memcpy(&b, &u, sizeof b);
        c0 += a0[j] * b;
      }
      C[m * ldc + n - n0] = c0;
    }
  }
}

MOKC_CLONES
void mokc_wgrad(const float *a, int64_t lda, const uint16_t *b, int64_t ldb,
                int64_t R, int64_t o0, int64_t o1, int64_t Cn, float *G,
                int64_t ldg)
{
  int64_t o = o0;

  for (; o < o1; o++)
    memset(G + (o - o0) * ldg, 0, (size_t)Cn * sizeof(float));
  for (int64_t r0 = 0; r0 < R; r0 += MOKC_CHUNK) {
    int64_t r1 = r0 + MOKC_CHUNK < R ? r0 + MOKC_CHUNK : R;
    for (o = o0; o + 2 <= o1; o += 2) {
      float *g0 = G + (o - o0) * ldg, *g1 = g0 + ldg;
      int64_t c = 0;
      for (; c + 16 <= Cn; c += 16) {
        v8f p00 = {0}, p01 = {0}, p10 = {0}, p11 = {0};
        for (int64_t r = r0; r < r1; r++) {
          v8f x0 = load_bf16(b + r * ldb + c), x1 = load_bf16(b + r * ldb + c + 8);
          v8f s0 = {0}, s1 = {0};
          s0 += a[r * lda + o], s1 += a[r * lda + o + 1];
          p00 += s0 * x0, p01 += s0 * x1, p10 += s1 * x0, p11 += s1 * x1;
        }
        store_f32(g0 + c, load_f32(g0 + c) + p00);
        store_f32(g0 + c + 8, load_f32(g0 + c + 8) + p01);
        store_f32(g1 + c, load_f32(g1 + c) + p10);
        store_f32(g1 + c + 8, load_f32(g1 + c + 8) + p11);
      }
      for (; c < Cn; c++) {
        float p0 = 0, p1 = 0;
        for (int64_t r = r0; r < r1; r++) {
          float x;
          uint32_t u = (uint32_t)b[r * ldb + c] << 16;
          memcpy(&x, &u, sizeof x);
          p0 += a[r * lda + o] * x, p1 += a[r * lda + o + 1] * x;
        }
        g0[c] += p0, g1[c] += p1;
      }
    }
    for (; o < o1; o++) {
      float *g0 = G + (o - o0) * ldg;
      for (int64_t c = 0; c < Cn; c++) {
        float p0 = 0;
        for (int64_t r = r0; r < r1; r++) {
          float x;
          uint32_t u = (uint32_t)b[r * ldb + c] << 16;
          memcpy(&x, &u, sizeof x);
          p0 += a[r * lda + o] * x;
        }
        g0[c] += p0;
      }
    }
  }
}
