/* pdl.cuh - a step's kernels as one chain of dependent launches.
 *
 * A step is a row of kernels on one stream, each reading what the one before
 * wrote. Launched plainly, each starts only after the one before has drained
 * and the launch has gone through: about 2 us of idle GPU between any two
 * (bench_gpu --trace), plus each kernel's set-up (barriers, tensor-map
 * prefetches) before its first load. Launched as a programmatic dependent
 * (cudaLaunchAttributeProgrammaticStreamSerialization), a kernel may start
 * once every block of the kernel before it has called pdl_release or
 * exited: its blocks take the SMs that the other's tail frees, run their
 * set-up, and wait in pdl_wait until that kernel has finished and its
 * writes are visible.
 *
 * The rule that keeps every result's bits: a kernel touches no global
 * memory (reads or writes) before its pdl_wait, but its own parameters and
 * the tensor maps among them. Every access is then ordered as the stream
 * orders it. pdl_release comes right after the wait: a dependent only takes
 * room that this kernel's blocks have left, since all of them are running
 * by the time every one has released.
 *
 * One kernel keeps the rule another way: gate/up after the forward's
 * dispatch (gemm_args.ready) never calls pdl_wait; it reads the rows only
 * after the dispatch has counted them (acquire against release), and
 * everything else it reads was written before the dispatch started.
 *
 * Off by default: measured on an H100 (PERF.md v14) it did not pay.
 * bench_gpu, two rounds, forward ms plain / dependent: dsv3 13.761, 13.758
 * / 13.960, 13.902; qwen3_4k 0.920, 0.920 / 0.930, 0.937; qwen3_32k 6.065,
 * 6.208 / 5.992, 6.005. MOKD_PDL=1 turns it on. On a device without the
 * feature the attribute is ignored and the instructions are not compiled
 * (before sm_90). */
#ifndef MOKK_CUDA_PDL_CUH
#define MOKK_CUDA_PDL_CUH

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>
#include <utility>

/* Waits until the kernel before this one on the stream has finished and its
 * writes are visible; at once when it was not launched as a dependent. */
__device__ __forceinline__ void pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Lets the kernel after this one start (once every block has said so). */
__device__ __forceinline__ void pdl_release()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Both, at the top of a kernel that moves no data before the wait. */
__device__ __forceinline__ void pdl_enter()
{
  pdl_wait();
  pdl_release();
}

static inline bool pdl_env()
{
  const char *v = getenv("MOKD_PDL");
  return v != NULL && strcmp(v, "1") == 0;
}

/* Whether kernels are launched as dependents, read once per process. */
static inline bool pdl_on()
{
  static const bool on = pdl_env();
  return on;
}

/* The launch attribute that makes a kernel a dependent of the one before. */
static inline cudaLaunchAttribute pdl_attr()
{
  cudaLaunchAttribute at = {};
  at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at.val.programmaticStreamSerializationAllowed = 1;
  return at;
}

/* kernel<<<grid, block, smem, st>>>(args...), as a dependent launch if dep. */
template <typename... P, typename... A>
static cudaError_t pdl_launch_if(bool dep, void (*kernel)(P...), dim3 grid, dim3 block,
                                 size_t smem, cudaStream_t st, A &&...args)
{
  cudaLaunchConfig_t lc = {};
  cudaLaunchAttribute at = pdl_attr();
  lc.gridDim = grid;
  lc.blockDim = block;
  lc.dynamicSmemBytes = smem;
  lc.stream = st;
  lc.attrs = &at;
  lc.numAttrs = dep ? 1 : 0;
  return cudaLaunchKernelEx(&lc, kernel, std::forward<A>(args)...);
}

/* The same, dependent when pdl_on. */
template <typename... P, typename... A>
static cudaError_t pdl_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t st, A &&...args)
{
  return pdl_launch_if(pdl_on(), kernel, grid, block, smem, st, std::forward<A>(args)...);
}

#endif
