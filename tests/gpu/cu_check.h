/* cu_check.h - CU(call) for the GPU checks that report into a caller's
 * buffer (schedule.cu, dispatch.cu): a failed CUDA call writes its name and
 * the error to msg (len bytes) and jumps to the function's `out` label,
 * where the check frees what it holds. */
#ifndef MOK_TESTS_GPU_CU_CHECK_H
#define MOK_TESTS_GPU_CU_CHECK_H

#include <stdio.h>

#define CU(call)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      snprintf(msg, len, "%s: %s", #call, cudaGetErrorString(e_));                                \
      goto out;                                                                                   \
    }                                                                                             \
  } while (0)

#endif
