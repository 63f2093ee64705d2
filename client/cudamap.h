/* cudamap.h - GPU arenas inside libmok (see cudamap.c). Each call returns 0, or
 * -1 with the reason in why. */
#ifndef MOK_CUDAMAP_H
#define MOK_CUDAMAP_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "frame.h"
#include "gpuid.h"

/* GPUs looked at when a UUID is searched for among this process's devices */
#define MOKW_MAX_VISIBLE 64

/* The allocation that holds a pointer of this process. */
typedef struct mok_cuda_alloc {
  uintptr_t base;
  size_t bytes;
  unsigned long long buffer_id; /* unique per allocation for the process's life */
  int device;
  int legacy_ipc;               /* cudaMalloc memory: cudaIpcGetMemHandle works */
} mok_cuda_alloc;

int mok_cuda_map(int fd, size_t bytes, int device, void **ptr, unsigned long long *handle,
                 char *why, size_t n);
void mok_cuda_unmap(void *ptr, size_t bytes, unsigned long long handle);
int mok_cuda_copy(void *dst, const void *src, size_t bytes, int to_device, int device,
                  char *why, size_t n);


/* Interprocess events (disable-timing); handle is MOKW_IPC_BYTES. */
int mok_cuda_event_new(int device, void **ev, void *handle, char *why, size_t n);
int mok_cuda_event_open(int device, const void *handle, void **ev, char *why, size_t n);
/* stream NULL = the legacy default stream */
int mok_cuda_event_record(void *ev, void *stream, char *why, size_t n);
int mok_cuda_stream_wait(void *stream, void *ev, char *why, size_t n);
int mok_cuda_event_sync(void *ev, char *why, size_t n);
void mok_cuda_event_free(void *ev);

/* The UUID of this process's CUDA device `device`, and the other way round:
 * the ordinal here of a GPU named by UUID. */
int mok_cuda_uuid(int device, uint8_t uuid[MOKW_UUID_BYTES], char *why, size_t n);
int mok_cuda_find_uuid(const uint8_t uuid[MOKW_UUID_BYTES], int *device, char *why, size_t n);

int mok_cuda_alloc_info(const void *ptr, mok_cuda_alloc *a, char *why, size_t n);
/* the buffer id of the allocation at `at`: 0, or -1 if none can be read */
int mok_cuda_buffer_id(uintptr_t at, unsigned long long *id);
int mok_cuda_ipc_handle(uintptr_t base, void *handle, char *why, size_t n);
int mok_cuda_export_fd(uintptr_t base, int *fd, char *why, size_t n);

#endif
