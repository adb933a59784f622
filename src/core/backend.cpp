// src/core/backend.cpp — what every backend checks the same way: the element-wise parameters of
// an AdamW or Lion call, every one before any is written, so a bad one leaves the call unapplied.
#include <string>

#include "dion3/backend.hpp"
#include "dion3/error.hpp"

namespace dion3 {

namespace {
enum class Flaw { None, Shape, DType, NoData };

// Why a view cannot be a parameter's part of length n. Nothing is allocated unless one fails: the
// check runs inside a step that must not allocate once it has begun writing.
Flaw flaw(const MatrixView& v, int64_t n) {
  if (v.batch != 1 || v.rows != 1 || v.cols != n) return Flaw::Shape;
  if (!is_float_param_dtype(v.dtype)) return Flaw::DType;
  if (n > 0 && v.data == nullptr) return Flaw::NoData;
  return Flaw::None;
}
}  // namespace

void check_elementwise_params(std::span<const ElementwiseParam> ps, bool second_moment, const char* what) {
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const ElementwiseParam& p = ps[i];
    const int64_t n = p.weight.cols;
    const std::pair<const MatrixView*, const char*> views[] = {
        {&p.weight, "weight"}, {&p.grad, "grad"}, {&p.exp_avg, "exp_avg"}, {&p.exp_avg_sq, "exp_avg_sq"}};
    for (const auto& [v, name] : std::span(views).first(second_moment ? 4 : 3)) {
      const Flaw f = flaw(*v, n);
      if (f == Flaw::None) continue;
      const std::string at = std::string(what) + ": parameter " + std::to_string(i) + ": " + name;
      if (f == Flaw::Shape)
        fail(at + " is " + std::to_string(v->batch) + " x " + std::to_string(v->rows) + " x " +
             std::to_string(v->cols) + ", not 1 x 1 x " + std::to_string(n) + " (a flat view like the weight's)");
      if (f == Flaw::DType) fail(at + " is " + dtype_name(v->dtype) + "; float32, float16 or bfloat16 expected");
      fail(at + " has no data");
    }
  }
}

}  // namespace dion3
