// view.cpp — dtype/device names and sizes, shape helpers for TensorView and MatrixView.
#include "dion3/view.hpp"


#include "dion3/error.hpp"

namespace dion3 {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::F64: return 8;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  fail("unknown dtype code " + std::to_string(static_cast<int>(t)));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F64: return "float64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
  }
  return "unknown";
}

const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

bool is_float_param_dtype(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) fail("shape " + shape_string(shape) + " has a negative dimension");
    if (__builtin_mul_overflow(n, s, &n)) fail("shape " + shape_string(shape) + " has more than 2^63 - 1 elements");
  }
  return n;
}

std::size_t TensorView::bytes() const {
  const int64_t n = numel();
  int64_t b = 0;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(dtype_size(dtype)), &b))
    fail("shape " + shape_string(shape) + " of " + dtype_name(dtype) + " spans more than 2^63 - 1 bytes");
  return static_cast<std::size_t>(b);
}

std::string TensorView::shape_str() const { return shape_string(shape); }

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

MatrixView MatrixView::at(int64_t b) const {
  MatrixView v = *this;
  v.data = static_cast<char*>(data) + static_cast<std::size_t>(b * batch_stride) * elem_bytes();
  v.batch = 1;
  return v;
}

}  // namespace dion3
