/* gate.cu - a kernel that holds a stream until the host opens the gate, for
 * tests of cross-process ordering: work queued behind it cannot start early,
 * and a host that waits for it before opening deadlocks (hence the timeout). */
#include <cuda_runtime.h>
#include <stdint.h>

__global__ void k_gate(volatile int *open, volatile int *state, uint64_t timeout_ns)
{
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  *state = 1; /* running */
  __threadfence_system();
  for (;;) {
    if (*open)
      break;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > timeout_ns) {
      *state = 3; /* gave up */
      __threadfence_system();
      return;
    }
    __nanosleep(1000);
  }
  *state = 2; /* passed */
  __threadfence_system();
}

/* open and state are mapped host memory (cudaHostAllocMapped). */
extern "C" int gate_launch(void *stream, int *open, int *state, double timeout_s)
{
  int *d_open, *d_state;
  if (cudaHostGetDevicePointer((void **)&d_open, open, 0) != cudaSuccess ||
      cudaHostGetDevicePointer((void **)&d_state, state, 0) != cudaSuccess)
    return -1;
  k_gate<<<1, 1, 0, (cudaStream_t)stream>>>(d_open, d_state, (uint64_t)(timeout_s * 1e9));
  return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
