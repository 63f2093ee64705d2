/* check.cuh - CUDA errors are turned into mokk codes at the boundary, the way
 * NCCL's checks do it: the failed call, its file and line go into err (the
 * MOK_ERRLEN buffer every entry point takes, which the daemon logs and sends
 * back), and the function returns, or jumps to its cleanup. Nothing here
 * aborts. The macros expect `err` in scope. */
#ifndef MOKK_CUDA_CHECK_CUH
#define MOKK_CUDA_CHECK_CUH

#include <cuda.h>
#include <cuda_runtime.h>

#include "layer.h"

static inline int mokk_cuda_fail_at(char *err, cudaError_t e, const char *call,
                                    const char *file, int line)
{
  return mokk_fail(err, MOK_EDEVICE, "%s: %s (%s) at %s:%d", call, cudaGetErrorString(e),
                   cudaGetErrorName(e), file, line);
}

/* The driver's entry points (reached through the runtime) return CUresult. */
static inline int mokk_cu_fail_at(char *err, CUresult r, const char *call, const char *file,
                                  int line)
{
  return mokk_fail(err, r == CUDA_ERROR_OUT_OF_MEMORY ? MOK_ENOMEM : MOK_EDEVICE,
                   "%s failed (CUresult %d) at %s:%d", call, (int)r, file, line);
}

#define CUDA_FAIL(e, what) mokk_cuda_fail_at(err, (e), (what), __FILE__, __LINE__)
#define CU_FAIL(r, what) mokk_cu_fail_at(err, (r), (what), __FILE__, __LINE__)

#define CUDA_CHECK(call)                                                  \
  do {                                                                    \
    cudaError_t e_ = (call);                                              \
    if (e_ != cudaSuccess)                                                \
      return CUDA_FAIL(e_, #call);                                        \
  } while (0)

/* On failure: rc gets the code and control goes to label (the cleanup). */
#define CUDA_CHECK_GOTO(call, rc, label)                                  \
  do {                                                                    \
    cudaError_t e_ = (call);                                              \
    if (e_ != cudaSuccess) {                                              \
      (rc) = CUDA_FAIL(e_, #call);                                        \
      goto label;                                                         \
    }                                                                     \
  } while (0)

#endif
