/* bf16.h - bfloat16 <-> float conversion shared by every backend and test.
 * Rounding is to nearest, ties to even; NaN stays NaN (quiet, sign kept). */
#ifndef MOKK_BF16_H
#define MOKK_BF16_H

#include <stdint.h>
#include <string.h>

static inline float mokk_bf16_to_f32(uint16_t b)
{
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t mokk_f32_to_bf16(float f)
{
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x0040u); /* keep NaN a NaN, make it quiet */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#endif
