// tests/cuda/cuda_test_util.hpp — helpers of the CUDA suites: a fixture that skips without a
// GPU and holds a CPU and a CUDA backend, "twin" buffers (the same bytes on the host for the
// CPU backend and on the device for the CUDA one), random fills and comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "dion3/backend.hpp"
#include "dion3/view.hpp"

namespace ct {

using dion3::DType;
using dion3::MatrixView;

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override;
  std::unique_ptr<dion3::Backend> cpu, gpu;
};

// A contiguous batch x rows x cols tensor kept on the host and on the device.
struct Twin {
  DType dtype = DType::F32;
  int64_t batch = 1, rows = 0, cols = 0;
  std::vector<unsigned char> host;
  dion3::DeviceBuffer dev;
  dion3::Backend* gpu = nullptr;

  Twin(dion3::Backend& g, DType dt, int64_t b, int64_t r, int64_t c);
  int64_t numel() const { return batch * rows * cols; }
  std::size_t bytes() const { return host.size(); }
  MatrixView hview() { return MatrixView::contiguous(host.data(), dtype, batch, rows, cols); }
  MatrixView dview() { return MatrixView::contiguous(dev.get(), dtype, batch, rows, cols); }
  void set_host(const std::vector<float>& v);  // rounds to dtype
  void fill_normal(std::mt19937_64& rng, float scale = 1.0f);  // host, then upload
  void fill_value(float x);
  void upload();
  std::vector<float> host_values() const;
  std::vector<float> device_values() const;
};

std::vector<float> normal_values(std::mt19937_64& rng, int64_t n, float scale = 1.0f);
// max|a - b| / max(max|b|, tiny)
double rel_max_diff(const std::vector<float>& a, const std::vector<float>& b);
// ||a - b|| / ||b||
double rel_fro_diff(const std::vector<float>& a, const std::vector<float>& b);
// Unit roundoff of a dtype.
double ulp_of(DType t);

}  // namespace ct
