/* devices.h - the device backends this build has: the daemon counts and opens
 * GPUs through here and meets them only as mokk_backend afterwards. Builds
 * with CUDA define MOKK_HAVE_CUDA (the Makefile does when nvcc is there) and
 * link devices.c with the CUDA backend. */
#ifndef MOKK_DEVICES_H
#define MOKK_DEVICES_H

#include "backend.h"

/* The device backend's name ("cuda"), or NULL when this build has none. */
static inline const char *mokk_gpu_backend(void)
{
#ifdef MOKK_HAVE_CUDA
  return "cuda";
#else
  return NULL;
#endif
}

/* Devices visible (>= 0; 0 with the reason in err when there is none or the
 * build has no device backend), or a negative code. */
int mokk_gpu_count(char *err);
/* A backend on the device with this ordinal. */
int mokk_gpu_open(int ordinal, mokk_backend **out, char *err);
/* Links the n backends' devices so that the ranks of one EP step can run on
 * several of them (mokk_cuda_link): MOK_ENOTSUP, naming the pair, when two
 * cannot reach each other. */
int mokk_gpu_link(mokk_backend **b, int n, char *err);
/* The 16-byte UUID of the device with this ordinal (see proto/gpuid.h). */
int mokk_gpu_uuid(int ordinal, uint8_t uuid[16], char *err);

#endif
