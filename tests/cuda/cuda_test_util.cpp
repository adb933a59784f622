// tests/cuda/cuda_test_util.cpp — the helpers declared in cuda_test_util.hpp.
#include "cuda_test_util.hpp"

#include <algorithm>
#include <cmath>

#include "cpu/cpu_numeric.hpp"

namespace ct {

void CudaTest::SetUp() {
  if (!dion3::cuda_available()) GTEST_SKIP() << "no CUDA device";
  cpu = dion3::make_cpu_backend();
  gpu = dion3::make_cuda_backend(0);
}

Twin::Twin(dion3::Backend& g, DType dt, int64_t b, int64_t r, int64_t c)
    : dtype(dt), batch(b), rows(r), cols(c), gpu(&g) {
  host.assign(static_cast<std::size_t>(b * r * c) * dion3::dtype_size(dt), 0);
  dev = dion3::DeviceBuffer(g.allocator(), std::max<std::size_t>(host.size(), 16));
  g.fill_zero(dev.get(), host.size());
}

void Twin::set_host(const std::vector<float>& v) {
  MatrixView h = MatrixView::contiguous(host.data(), dtype, 1, batch * rows, cols);
  for (int64_t r = 0; r < batch * rows; ++r) dion3::cpu::store_row(h, 0, r, v.data() + r * cols);
}

void Twin::fill_normal(std::mt19937_64& rng, float scale) {
  set_host(normal_values(rng, numel(), scale));
  upload();
}

void Twin::fill_value(float x) {
  set_host(std::vector<float>(static_cast<std::size_t>(numel()), x));
  upload();
}

void Twin::upload() { gpu->copy_from_host(dev.get(), host.data(), host.size()); }

static std::vector<float> decode(const std::vector<unsigned char>& bytes, DType dt, int64_t rows, int64_t cols) {
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  MatrixView h = MatrixView::contiguous(const_cast<unsigned char*>(bytes.data()), dt, 1, rows, cols);
  for (int64_t r = 0; r < rows; ++r) dion3::cpu::load_row(h, 0, r, out.data() + r * cols);
  return out;
}

std::vector<float> Twin::host_values() const { return decode(host, dtype, batch * rows, cols); }

std::vector<float> Twin::device_values() const {
  std::vector<unsigned char> b(host.size());
  gpu->copy_to_host(b.data(), dev.get(), b.size());
  return decode(b, dtype, batch * rows, cols);
}

std::vector<float> normal_values(std::mt19937_64& rng, int64_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

double rel_max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0, s = 1e-30;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
    s = std::max(s, std::fabs(static_cast<double>(b[i])));
  }
  return a.size() == b.size() ? m / s : INFINITY;
}

double rel_fro_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, s = 1e-300;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double e = static_cast<double>(a[i]) - b[i];
    d += e * e;
    s += static_cast<double>(b[i]) * b[i];
  }
  return a.size() == b.size() ? std::sqrt(d / s) : INFINITY;
}

double ulp_of(DType t) {
  switch (t) {
    case DType::F16: return 0x1.0p-11;
    case DType::BF16: return 0x1.0p-8;
    default: return 0x1.0p-24;
  }
}

}  // namespace ct
