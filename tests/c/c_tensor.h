/* c_tensor.h — the C test programs' one way to describe a matrix they own. */
#ifndef DION3_TESTS_C_TENSOR_H
#define DION3_TESTS_C_TENSOR_H

#include <stdint.h>
#include <string.h>

#include "dion3/dion3.h"

/* A rows x cols fp32 matrix in host memory, contiguous. */
static inline dion3_tensor f32_matrix(float* data, int64_t rows, int64_t cols) {
  dion3_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = DION3_F32;
  t.device = DION3_DEVICE_CPU;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  return t;
}

#endif
