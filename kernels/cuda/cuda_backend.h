/* cuda_backend.h - the CUDA backend: the MoE layer on one GPU, behind the same
 * interface as the CPU engine. Every pointer handed to forward and backward is
 * device memory (16-byte aligned). Work is queued on the backend's stream and
 * the calls return without waiting for it; errors the GPU finds later (an
 * expert id outside [0, E), a failed kernel) come back from mokk_cuda_sync().
 * Requires H, I and I_s to be multiples of 64 and one EP rank per step. */
#ifndef MOKK_CUDA_BACKEND_H
#define MOKK_CUDA_BACKEND_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices visible (>= 0), or a negative code with a message
 * when the runtime or the driver cannot be used. */
int mokk_cuda_devices(char *err);
int mokk_cuda_create(int device, mokk_backend **out, char *err);
/* Caps the blocks of every launch (0 = as many as the GPU holds at once); the
 * results do not depend on it. */
void mokk_cuda_set_max_blocks(mokk_backend *b, int blocks);
int mokk_cuda_device(const mokk_backend *b);
/* The stream every step runs on (a cudaStream_t). */
void *mokk_cuda_stream(mokk_backend *b);
/* Waits for the queued work; returns the first error it met, if any. */
int mokk_cuda_sync(mokk_backend *b, char *err);

/* ---- ordering with other processes, without host waits ----------------- */

/* A cudaIpcEventHandle_t or cudaIpcMemHandle_t on the wire. */
#define MOKK_CUDA_IPC_BYTES 64

/* What one client session needs for stream ordering: the done event the
 * daemon records after each step (interprocess, exported once) and the
 * client's ready events, opened once each. Use it from one thread at a time. */
typedef struct mokk_cuda_events mokk_cuda_events;

int mokk_cuda_events_create(mokk_backend *b, mokk_cuda_events **out, char *err);
void mokk_cuda_events_free(mokk_cuda_events *ev);
/* The next step on b's stream waits for the client's event (its IPC handle). */
int mokk_cuda_wait(mokk_backend *b, mokk_cuda_events *ev, const void *handle, char *err);
/* Ends a step: queues the write of its status to status (a device int32: 0,
 * or MOK_EEXPERT when an expert id was out of range), clears the flag for the
 * next step and records the done event; handle gets its IPC handle. Reports
 * launch errors only; nothing waits for the GPU. */
int mokk_cuda_finish(mokk_backend *b, mokk_cuda_events *ev, int32_t *status, void *handle,
                     char *err);

/* Client GPU memory opened in this process: a legacy IPC handle of a
 * cudaMalloc allocation, or a cuMem allocation's POSIX fd. */
typedef struct mokk_gpu_import {
  void *ptr;
  size_t bytes;
  unsigned long long handle; /* cuMem imports */
  int device;
  int legacy;                /* opened with cudaIpcOpenMemHandle */
} mokk_gpu_import;

int mokk_gpu_import_ipc(int device, const void *ipc_handle, size_t bytes, mokk_gpu_import *m,
                        char *err);
int mokk_gpu_import_fd(int device, int fd, size_t bytes, mokk_gpu_import *m, char *err);

/* A GPU arena: a cuMem allocation of `bytes` (rounded up to the device's
 * granularity) mapped at ptr and exportable as a POSIX fd. */
typedef struct mokk_gpu_mem {
  void *ptr;
  size_t bytes;
  unsigned long long handle;
  int device;
} mokk_gpu_mem;

/* *fd is the exported handle (the caller closes it when sent). */
int mokk_gpu_mem_create(int device, size_t bytes, mokk_gpu_mem *m, int *fd, char *err);
/* Waits for the device, then unmaps and releases. */
void mokk_gpu_mem_free(mokk_gpu_mem *m);

/* Freeing without a wait: a fence marks all work queued so far on b's
 * stream; once it has passed, memory that work used can go at once. */
int mokk_cuda_fence(mokk_backend *b, void **fence, char *err);
/* 1 once passed (or broken: nothing will wait on it any more), 0 not yet. */
int mokk_cuda_fence_passed(void *fence);
void mokk_cuda_fence_free(void *fence);
void mokk_gpu_mem_free_now(mokk_gpu_mem *m);
/* Closes or unmaps an import; the caller has made sure no queued work reads it. */
void mokk_gpu_import_free_now(mokk_gpu_import *m);

#ifdef __cplusplus
}
#endif

#endif
