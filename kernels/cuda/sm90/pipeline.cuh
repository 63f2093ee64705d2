/* pipeline.cuh - the consumers' walk around the ring of stages: waiting
 * for a stage's bytes (full), handing it back to the producer (empty, in
 * both blocks of a cluster in lockstep), and keeping a tile's last stages
 * for its epilogue until the copy engine has read them. One MMA batch stays
 * in flight, so a stage goes back one k-block after it was issued. */
#ifndef MOKK_CUDA_SM90_PIPELINE_CUH
#define MOKK_CUDA_SM90_PIPELINE_CUH

#include "ptx.cuh"

namespace sm90 {

/* Hands stage prev (none when < 0) back to the producers: this block's, and
 * in a cluster of two the other block's, which refills both. */
template <int CL>
__device__ __forceinline__ void stage_release(uint64_t *empty, int prev, int lane, int rank)
{
  if (prev >= 0 && lane == 0) {
    bar_arrive(&empty[prev]);
    if (CL == 2)
      bar_arrive_remote(&empty[prev], rank ^ 1);
  }
}

/* A consumer waits for stage s to be full. Rows the lanes gathered (GA)
 * landed through ordinary shared-memory writes, which the tensor cores,
 * another proxy, see only after a proxy fence. */
template <bool GA>
__device__ __forceinline__ void stage_wait(uint64_t *full, int s, uint32_t ph)
{
  bar_wait(&full[s], ph);
  if constexpr (GA)
    fence_async_shared();
}

/* The next stage of the ring, the phase flipping where it wraps. */
template <int STAGES>
__device__ __forceinline__ void stage_next(int &s, uint32_t &ph)
{
  if (++s == STAGES) {
    s = 0;
    ph ^= 1;
  }
}

/* A consumer is done issuing stage s: stage prev, whose MMAs have now
 * finished, goes back, and s becomes the one to hand back next. */
template <int CL, int STAGES>
__device__ __forceinline__ void stage_done(uint64_t *empty, int &prev, int &s, uint32_t &ph,
                                           int lane, int rank)
{
  stage_release<CL>(empty, prev, lane, rank);
  prev = s;
  stage_next<STAGES>(s, ph);
}

/* The two stages a tile's epilogue keeps (-1: none; s0 alone is -1 where
 * it keeps its last stage only, KS = 1). */
struct kept {
  int s0, s1;
};

/* Hands back the stages the last tile's epilogue kept (s1, and s0 unless
 * it kept one), once the copy engine has read what this warpgroup's thread
 * wt == 0 stored: its four warps' arrivals on each. */
__device__ __forceinline__ void kept_release(uint64_t *empty, kept &k, int wt)
{
  if (k.s1 < 0)
    return;
  if (wt == 0) {
    tma_store_wait<0, true>();
    if (k.s0 >= 0)
      bar_arrive_n(&empty[k.s0], 4);
    bar_arrive_n(&empty[k.s1], 4);
  }
  k.s0 = k.s1 = -1;
}

/* A consumer is done issuing k-block kb of nk from stage s. keep: the tile
 * keeps its last two stages (kept), so the one before the last is not handed
 * back (a tile that keeps its last stage only passes keep = false here); at
 * kb = 0 the last tile's kept stages go back. */
template <int CL, int STAGES, bool AO>
__device__ __forceinline__ void stage_step(uint64_t *empty, int &prev, int &s, uint32_t &ph,
                                           int lane, int rank, int kb, int nk, bool keep,
                                           kept &k, int wt)
{
  if (AO && keep && kb == nk - 1) {
    k.s0 = prev;
    prev = s;
    stage_next<STAGES>(s, ph);
  } else {
    stage_done<CL, STAGES>(empty, prev, s, ph, lane, rank);
  }
  if (AO && kb == 0)
    kept_release(empty, k, wt);
}

/* After a tile's last MMAs: its last stage goes back, or stays with the
 * one before it for the epilogue (keep). */
template <int CL, bool AO>
__device__ __forceinline__ void stage_last(uint64_t *empty, int prev, bool keep, kept &k,
                                           int lane, int rank)
{
  if (AO && keep)
    k.s1 = prev;
  else
    stage_release<CL>(empty, prev, lane, rank);
}

} /* namespace sm90 */

#endif
