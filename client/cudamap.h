/* cudamap.h - GPU arenas inside libmok (see cudamap.c). Each call returns 0, or
 * -1 with the reason in why. */
#ifndef MOK_CUDAMAP_H
#define MOK_CUDAMAP_H

#include <stddef.h>
#include <stdio.h>

int mok_cuda_map(int fd, size_t bytes, int device, void **ptr, unsigned long long *handle,
                 char *why, size_t n);
void mok_cuda_unmap(void *ptr, size_t bytes, unsigned long long handle);
int mok_cuda_copy(void *dst, const void *src, size_t bytes, int to_device, int device,
                  char *why, size_t n);

#endif
