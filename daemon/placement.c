/* placement.c - see placement.h. */
#include "placement.h"

mokd_place mokd_place_ranks(const mokk_backend *a, int dev_a, const mokk_backend *b, int dev_b,
                            int gpus_linked)
{
  if (a == b)
    return MOKD_PLACE_OK;
  if (dev_a < 0 || dev_b < 0)
    return MOKD_PLACE_OTHER;
  return gpus_linked ? MOKD_PLACE_OK : MOKD_PLACE_NOT_LINKED;
}
