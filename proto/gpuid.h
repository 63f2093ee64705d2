/* gpuid.h - GPU UUIDs, the names of GPUs that mean the same in every process.
 * CUDA ordinals depend on each process's CUDA_VISIBLE_DEVICES (a Slurm or
 * Kubernetes job sees its GPUs as 0..n-1), so the wire names a session's GPU
 * by the 16 bytes cuDeviceGetUuid gives; people read and type them the way
 * nvidia-smi -L prints them, "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
 * Shared by the daemon, the backends and libmok. */
#ifndef MOKW_GPUID_H
#define MOKW_GPUID_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOKW_UUID_BYTES 16
/* "GPU-" + 32 hex digits + 4 dashes + NUL */
#define MOKW_UUID_STRLEN 41

/* out gets the nvidia-smi form of uuid. */
void mokw_uuid_format(const uint8_t uuid[MOKW_UUID_BYTES], char out[MOKW_UUID_STRLEN]);
/* Reads "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (the prefix may be "MIG-"
 * or absent; hex digits in either case). 0, or MOK_EINVAL for anything else. */
int mokw_uuid_parse(const char *s, uint8_t uuid[MOKW_UUID_BYTES]);
/* The index of uuid among the n of uuids, or -1. */
int mokw_uuid_find(const uint8_t (*uuids)[MOKW_UUID_BYTES], int n,
                   const uint8_t uuid[MOKW_UUID_BYTES]);

#ifdef __cplusplus
}
#endif

#endif
