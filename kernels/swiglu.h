/* swiglu.h - the SwiGLU of DESIGN §1 and its derivative, one element at a
 * time, for C11 and CUDA alike. The CPU engine's bits are defined by these
 * expressions (built with -ffp-contract=off): change them and every bitwise
 * test moves. The Hopper core's epilogues compute the same on the
 * special-function unit (cuda/sm90/epilogue.cuh, swiglu_sfu), within a few ulp. */
#ifndef MOKK_SWIGLU_H
#define MOKK_SWIGLU_H

#include <math.h>

#ifdef __CUDACC__
#define MOKK_HD static inline __host__ __device__
#else
#define MOKK_HD static inline
#endif

MOKK_HD float mokk_silu(float g)
{
  return g / (1.0f + expf(-g));
}

/* The clamp of swiglu_limit L (0 = off): g = min(g, L), u = clamp(u, -L, L). */
MOKK_HD float mokk_clamp_gate(float g, float L)
{
  return L > 0.0f ? fminf(g, L) : g;
}

MOKK_HD float mokk_clamp_up(float u, float L)
{
  return L > 0.0f ? fminf(fmaxf(u, -L), L) : u;
}

/* h = silu(g') * u' of the clamped g', u' (fp32; the caller rounds). */
MOKK_HD float mokk_swiglu(float g, float u, float L)
{
  return mokk_silu(mokk_clamp_gate(g, L)) * mokk_clamp_up(u, L);
}

/* d_g and d_u from d_h and the saved (unclamped) g, u: d_g = d_h u' silu'(g'),
 * d_u = d_h silu(g'), each zero where its clamp was active. exp(-g') once
 * for both: the same values as two calls, one exp fewer an element. */
MOKK_HD void mokk_swiglu_grads(float g, float u, float dh, float L, float *dg, float *du)
{
  float gv = mokk_clamp_gate(g, L), uv = mokk_clamp_up(u, L), e = expf(-gv);
  float sg = 1.0f / (1.0f + e);
  *dg = (L > 0.0f && g > L) ? 0.0f : dh * uv * (sg * (1.0f + gv * (1.0f - sg)));
  *du = (L > 0.0f && (u > L || u < -L)) ? 0.0f : dh * (gv / (1.0f + e)); /* silu(g') */
}

#undef MOKK_HD

#endif
