/* epilogue.cuh - the element-wise math fused into the GEMM epilogues, shared
 * by every GEMM of the CUDA backend so they round alike: the SwiGLU of the
 * forward (with the optional clamp) and its derivative. The operations are
 * spelled out with _rn intrinsics so that no multiply-add is contracted and
 * the order is the CPU engine's (kernels/cpu/cpu_moe.c). */
#ifndef MOKK_CUDA_EPILOGUE_CUH
#define MOKK_CUDA_EPILOGUE_CUH

__device__ __forceinline__ float epi_silu(float g)
{
  return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
}

/* h = silu(g') * u' with g' = min(g, L), u' = clamp(u, -L, L) when L > 0 */
__device__ __forceinline__ float epi_swiglu(float g, float u, float L)
{
  if (L > 0.0f) {
    g = fminf(g, L);
    u = fminf(fmaxf(u, -L), L);
  }
  return __fmul_rn(epi_silu(g), u);
}

/* d_g and d_u from d_h and the forward's g, u before the clamp; zero where
 * the clamp was active */
__device__ __forceinline__ void epi_dswiglu(float dh, float gr, float ur, float L, float *dg,
                                            float *du)
{
  float gv = gr, uv = ur;
  if (L > 0.0f) {
    gv = fminf(gr, L);
    uv = fminf(fmaxf(ur, -L), L);
  }
  float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gv)));
  float dsilu = __fmul_rn(sg, __fadd_rn(1.0f, __fmul_rn(gv, __fsub_rn(1.0f, sg))));
  *dg = (L > 0.0f && gr > L) ? 0.0f : __fmul_rn(__fmul_rn(dh, uv), dsilu);
  *du = (L > 0.0f && (ur > L || ur < -L)) ? 0.0f : __fmul_rn(dh, epi_silu(gv));
}

#endif
