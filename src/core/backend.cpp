// src/core/backend.cpp — what every backend checks the same way: the element-wise parameters of
// an AdamW or Lion call, every one before any is written, so a bad one leaves the call unapplied.
#include <string>

#include "dion3/backend.hpp"
#include "dion3/error.hpp"

namespace dion3 {

void check_elementwise_params(std::span<const ElementwiseParam> ps, bool second_moment, const char* what) {
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const ElementwiseParam& p = ps[i];
    const std::string at = std::string(what) + ": parameter " + std::to_string(i) + ": ";
    const int64_t n = p.weight.cols;
    auto flat = [&](const MatrixView& v, const char* name) {
      if (v.batch != 1 || v.rows != 1 || v.cols != n)
        fail(at + name + " is " + std::to_string(v.batch) + " x " + std::to_string(v.rows) + " x " +
             std::to_string(v.cols) + ", not 1 x 1 x " + std::to_string(n) + " (a flat view like the weight's)");
      if (!is_float_param_dtype(v.dtype))
        fail(at + name + " is " + dtype_name(v.dtype) + "; float32, float16 or bfloat16 expected");
      if (n > 0 && v.data == nullptr) fail(at + name + " has no data");
    };
    flat(p.weight, "weight");
    flat(p.grad, "grad");
    flat(p.exp_avg, "exp_avg");
    if (second_moment) flat(p.exp_avg_sq, "exp_avg_sq");
  }
}

}  // namespace dion3
