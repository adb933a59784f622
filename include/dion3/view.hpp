// dion3/view.hpp — framework-free descriptions of the memory the engine works on.
//
// The engine and the backends never see a framework tensor: a parameter is a TensorView
// (pointer, dtype, device, shape; contiguous, row-major) and the backends operate on
// MatrixViews (a batch of equally shaped row-major matrices with strides).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dion3/export.h"

namespace dion3 {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, F64 = 3, I32 = 4, I64 = 5 };
enum class Device : int { CPU = 0, CUDA = 1 };

DION3_API std::size_t dtype_size(DType t);
DION3_API const char* dtype_name(DType t);
DION3_API const char* device_name(Device d);
// The dtypes a parameter, gradient or optimizer state may have.
DION3_API bool is_float_param_dtype(DType t);

// A contiguous, row-major tensor owned by someone else.
struct DION3_API TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int device_index = 0;
  std::vector<int64_t> shape;

  int64_t numel() const;
  std::size_t bytes() const;  // numel() and bytes() throw when the count does not fit in int64
  std::string shape_str() const;
};

// `batch` row-major matrices of rows x cols. Element (b, r, c) lives at
// data + b*batch_stride + r*ld + c (in elements).
struct DION3_API MatrixView {
  void* data = nullptr;
  DType dtype = DType::F32;
  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;            // row stride in elements (>= cols)
  int64_t batch_stride = 0;  // matrix stride in elements (>= rows*ld when batch > 1)

  static MatrixView contiguous(void* data, DType dtype, int64_t batch, int64_t rows, int64_t cols) {
    return MatrixView{data, dtype, batch, rows, cols, cols, rows * cols};
  }
  // Matrix b of the batch, as a batch of one.
  MatrixView at(int64_t b) const;
  std::size_t elem_bytes() const { return dtype_size(dtype); }
};

DION3_API std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace dion3
