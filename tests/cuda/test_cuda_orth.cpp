// tests/cuda/test_cuda_orth.cpp — the orthogonalizer on the CUDA backend: standard and Gram
// Newton–Schulz against the CPU backend (fp32 iteration: tight; fp16/bf16: loose plus the
// singular-value band of algorithm.md §2), symmetric tiles on and off, wide and tall inputs, and a
// run captured in a CUDA graph that replays to the eager result.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "cuda_test_util.hpp"
#include "dion3/error.hpp"
#include "dion3/orthogonalize.hpp"
#include "test_util.hpp"

namespace {

using ct::Twin;
using dion3::DType;
using dion3::OrthMethod;

struct OrthCase { OrthMethod method; DType dt; int64_t batch, rows, cols, tile; };
class Orth : public ct::CudaTest, public ::testing::WithParamInterface<OrthCase> {};

// The largest singular value of a rows x cols matrix (power iteration on Yᵀ·Y).
double largest_singular_value(const float* y, int64_t rows, int64_t cols) {
  std::vector<double> x(cols, 1.0), t(rows);
  double top = 0;
  for (int it = 0; it < 100; ++it) {
    for (int64_t i = 0; i < rows; ++i) {
      t[i] = 0;
      for (int64_t j = 0; j < cols; ++j) t[i] += y[i * cols + j] * x[j];
    }
    double n = 0;
    for (int64_t j = 0; j < cols; ++j) {
      x[j] = 0;
      for (int64_t i = 0; i < rows; ++i) x[j] += y[i * cols + j] * t[i];
      n += x[j] * x[j];
    }
    n = std::sqrt(n);
    top = std::sqrt(n);  // |YᵀY x| for the unit x of the last round
    for (double& e : x) e /= n;
  }
  return top;
}

// Largest |eigenvalue of O Oᵀ - 1| bound via Frobenius: a cheap proxy of the singular-value band.
double max_row_gram_dev(const std::vector<float>& o, int64_t b, int64_t rows, int64_t cols) {
  const int64_t p = std::min(rows, cols);
  double worst = 0;
  for (int64_t m = 0; m < b; ++m) {
    const float* x = o.data() + m * rows * cols;
    // Diagonal of O Oᵀ (rows <= cols) or Oᵀ O: squared singular values average to those.
    double tr = 0;
    for (int64_t i = 0; i < rows * cols; ++i) tr += static_cast<double>(x[i]) * x[i];
    worst = std::max(worst, std::fabs(tr / static_cast<double>(p) - 0.9));
  }
  return worst;
}

TEST_P(Orth, MatchesCpu) {
  const OrthCase c = GetParam();
  dion3::cuda::set_symmetric_options(*gpu, {c.tile > 0, c.tile});
  std::mt19937_64 rng(61 + c.rows);
  dion3::OrthConfig cfg;
  cfg.method = c.method;
  cfg.iteration_dtype = c.dt;
  Twin in(*gpu, DType::F32, c.batch, c.rows, c.cols);
  in.fill_normal(rng);
  Twin out(*gpu, DType::F32, c.batch, c.rows, c.cols);
  dion3::Orthogonalizer ocpu(*cpu, cfg, c.batch, c.rows, c.cols), ogpu(*gpu, cfg, c.batch, c.rows, c.cols);
  ocpu.run(in.hview(), out.hview());
  ogpu.run(in.dview(), out.dview());
  const auto od = out.device_values(), oh = out.host_values();
  const double diff = ct::rel_fro_diff(od, oh);
  RecordProperty("rel_fro_diff", std::to_string(diff));
  const double tol = c.dt == DType::F32 ? 2e-4 : c.dt == DType::F16 ? 3e-2 : 8e-2;
  EXPECT_LE(diff, tol) << "GPU vs CPU orthogonalization";
  // Mean squared singular value in the designed band (about [0.7, 1.2]).
  EXPECT_LE(max_row_gram_dev(od, c.batch, c.rows, c.cols), 0.35);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Orth,
    ::testing::Values(OrthCase{OrthMethod::Standard, DType::F32, 3, 64, 160, 0},
                      OrthCase{OrthMethod::Gram, DType::F32, 3, 64, 160, 0},
                      OrthCase{OrthMethod::Gram, DType::F32, 2, 200, 96, 0},
                      OrthCase{OrthMethod::Gram, DType::F32, 3, 192, 400, 64},
                      OrthCase{OrthMethod::Standard, DType::F32, 3, 192, 400, 48},
                      OrthCase{OrthMethod::Gram, DType::F16, 4, 256, 1024, 64},
                      OrthCase{OrthMethod::Gram, DType::F16, 4, 256, 1024, 0},
                      OrthCase{OrthMethod::Standard, DType::BF16, 4, 256, 1024, 0},
                      OrthCase{OrthMethod::Standard, DType::BF16, 4, 256, 1024, 128},
                      // p > 256: the fused kernel's banded intermediates (where it runs)
                      OrthCase{OrthMethod::Gram, DType::F16, 2, 520, 1040, 64},
                      OrthCase{OrthMethod::Standard, DType::BF16, 2, 520, 520, 64},
                      // Tall: normalised into the transpose (16-byte packs where rows % 8 == 0,
                      // element by element otherwise), the result written tall by the last product.
                      OrthCase{OrthMethod::Gram, DType::F16, 2, 1040, 520, 64},
                      OrthCase{OrthMethod::Standard, DType::BF16, 2, 1024, 256, 0},
                      OrthCase{OrthMethod::Standard, DType::BF16, 2, 400, 192, 48},
                      OrthCase{OrthMethod::Gram, DType::F16, 2, 205, 96, 0}),
    [](const auto& i) {
      return std::string(i.param.method == OrthMethod::Gram ? "gram" : "standard") + "_" +
             dion3::dtype_name(i.param.dt) + "_" + std::to_string(i.param.rows) + "x" +
             std::to_string(i.param.cols) + "_t" + std::to_string(i.param.tile);
    });

// Eleven Polar Express steps without a restart grow Gram's Q, and R's rounding noise, along the
// directions the input does not span (here zero rows, as a padded stack has) past what the
// backend's float16 holds (OrthConfig::gram_diverges): Gram asked for is refused, and 'auto'
// iterates standard, its result finite, its real rows in the band and its zero rows zero.
class OrthLongSegments : public ct::CudaTest {};

TEST_F(OrthLongSegments, LongSegmentsIterateStandardAndStayFiniteOnZeroRows) {
  dion3::OrthConfig cfg;
  cfg.method = OrthMethod::Gram;
  cfg.restarts.clear();
  while (cfg.coefficients.size() < 11) cfg.coefficients.push_back(cfg.coefficients.back());
  ASSERT_EQ(dion3::choose_iteration_dtype(*gpu, cfg, OrthMethod::Gram), DType::F16);
  const int64_t rows = 96, cols = 384, real = 64;
  try {
    dion3::Orthogonalizer(*gpu, cfg, 2, rows, cols, nullptr, real);
    ADD_FAILURE() << "Gram with a diverging float16 segment was not refused";
  } catch (const dion3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Gram Newton-Schulz in float16"), std::string::npos) << e.what();
  }
  cfg.method = OrthMethod::Auto;
  std::mt19937_64 rng(23);
  Twin in(*gpu, DType::F32, 2, rows, cols), out(*gpu, DType::F32, 2, rows, cols);
  in.fill_normal(rng);
  std::vector<float> v = in.host_values();
  for (int64_t m = 0; m < 2; ++m)
    for (int64_t i = real; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) v[(m * rows + i) * cols + j] = 0.0f;
  in.set_host(v);
  in.upload();
  dion3::Orthogonalizer o(*gpu, cfg, 2, rows, cols, nullptr, real);
  EXPECT_EQ(o.method(), OrthMethod::Standard);
  o.run(in.dview(), out.dview());
  const std::vector<float> od = out.device_values();
  std::vector<float> kept;
  for (int64_t m = 0; m < 2; ++m)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float x = od[(m * rows + i) * cols + j];
        ASSERT_TRUE(std::isfinite(x)) << "matrix " << m << ", row " << i;
        if (i >= real) ASSERT_EQ(x, 0.0f) << "matrix " << m << ", zero row " << i;
        else kept.push_back(x);
      }
  EXPECT_LE(max_row_gram_dev(kept, 2, real, cols), 0.35);
}

// The other side of the bound, on the GPU's float16 Gram path (full GEMMs, cuBLAS tiles, the fused kernel;
// fp32 accumulation): three classic steps without a restart grow Q by 3.4445^3, just under the
// float16 bound, and rank-one inputs (R's noise in every other direction) give results whose
// singular values stay in the polynomial's band: the input's direction, and every other (its noise
// lifted as standard NS lifts it, not past the band).
TEST_F(OrthLongSegments, GramJustUnderTheFloat16BoundStaysInBandOnRankOneInputs) {
  dion3::OrthConfig cfg;
  cfg.method = OrthMethod::Gram;
  cfg.iteration_dtype = DType::F16;
  cfg.coefficients.assign(3, dion3::Coefficients{3.4445, -4.775, 2.0315});
  cfg.restarts.clear();
  ASSERT_FALSE(cfg.gram_diverges(DType::F16));
  cfg.coefficients.push_back(cfg.coefficients.back());
  ASSERT_TRUE(cfg.gram_diverges(DType::F16));
  cfg.coefficients.pop_back();
  // Full GEMMs, cuBLAS tiles, the default (the fused kernel where it runs).
  const std::vector<dion3::cuda::SymmetricOptions> paths{{false, 0}, {true, 64, false}, {}};
  for (std::size_t path = 0; path < paths.size(); ++path) {
    dion3::cuda::set_symmetric_options(*gpu, paths[path]);
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{96, 384}, {320, 1024}}) {
      const int64_t batch = 4;
      std::mt19937_64 rng(rows + path);
      std::normal_distribution<double> nd;
      std::vector<float> v(static_cast<std::size_t>(batch * rows * cols));
      std::vector<std::vector<double>> us(batch, std::vector<double>(rows)), ws(batch, std::vector<double>(cols));
      for (int64_t m = 0; m < batch; ++m) {
        for (double& x : us[m]) x = nd(rng);
        for (double& x : ws[m]) x = nd(rng);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j) v[(m * rows + i) * cols + j] = static_cast<float>(us[m][i] * ws[m][j]);
      }
      Twin in(*gpu, DType::F32, batch, rows, cols), out(*gpu, DType::F32, batch, rows, cols);
      in.set_host(v);
      in.upload();
      dion3::Orthogonalizer o(*gpu, cfg, batch, rows, cols);
      ASSERT_EQ(o.method(), OrthMethod::Gram);
      o.run(in.dview(), out.dview());
      const std::vector<float> od = out.device_values();
      for (int64_t m = 0; m < batch; ++m) {
        const float* y = od.data() + m * rows * cols;
        for (int64_t i = 0; i < rows * cols; ++i)
          ASSERT_TRUE(std::isfinite(y[i])) << rows << "x" << cols << " path " << path << ", matrix " << m;
        // The singular value along the input's direction, uᵀ·Y·w / (|u| |w|), and the largest
        // (power iteration on Yᵀ·Y).
        double s = 0, nu = 0, nw = 0;
        for (double x : us[m]) nu += x * x;
        for (double x : ws[m]) nw += x * x;
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j) s += us[m][i] * y[i * cols + j] * ws[m][j];
        s /= std::sqrt(nu * nw);
        const double top = largest_singular_value(y, rows, cols);
        const std::string at = std::to_string(rows) + "x" + std::to_string(cols) + " path " + std::to_string(path) +
                               ", matrix " + std::to_string(m);
        EXPECT_GT(s, 0.6) << at;
        EXPECT_LT(s, 1.3) << at;
        EXPECT_LT(top, 1.3) << at;
      }
    }
  }
  dion3::cuda::set_symmetric_options(*gpu, {});
}

// The default Gram iteration (float16, Polar Express, the restart at 2) on spectra where its
// products' rounding weighs most: two clusters (half the singular values 1e-2 of the rest) and
// rank-deficient inputs, on every symmetric path. Its largest singular value stays in the band,
// as the standard iteration's does (the whole R update after the restart, orthogonalize.cpp).
TEST_F(OrthLongSegments, DefaultGramStaysInBandOnClusteredAndRankDeficientSpectra) {
  dion3::OrthConfig cfg;
  cfg.method = OrthMethod::Gram;
  ASSERT_EQ(dion3::choose_iteration_dtype(*gpu, cfg, OrthMethod::Gram), DType::F16);
  const std::vector<dion3::cuda::SymmetricOptions> paths{{false, 0}, {true, 64, false}, {}};
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{96, 384}, {320, 1024}}) {
    t3::Rng rng(static_cast<uint64_t>(rows));
    std::vector<double> clusters(rows, 1.0);
    std::fill(clusters.begin() + rows / 2, clusters.end(), 1e-2);
    const std::pair<const char*, std::vector<double>> inputs[] = {
        {"two clusters", t3::with_spectrum(rows, cols, clusters, rng)},
        {"rank p/2", t3::low_rank(rows, cols, rows / 2, rng)},
        {"rank p/4", t3::low_rank(rows, cols, rows / 4, rng)}};
    for (std::size_t path = 0; path < paths.size(); ++path) {
      dion3::cuda::set_symmetric_options(*gpu, paths[path]);
      for (const auto& [name, X] : inputs) {
        Twin in(*gpu, DType::F32, 1, rows, cols), out(*gpu, DType::F32, 1, rows, cols);
        in.set_host(std::vector<float>(X.begin(), X.end()));
        in.upload();
        dion3::Orthogonalizer o(*gpu, cfg, 1, rows, cols);
        o.run(in.dview(), out.dview());
        const double top = largest_singular_value(out.device_values().data(), rows, cols);
        std::printf("[ default gram, %s %ldx%ld, path %zu ] largest singular value %.4f\n", name,
                    static_cast<long>(rows), static_cast<long>(cols), path, top);
        EXPECT_LE(top, 1.2) << name << " " << rows << "x" << cols << " path " << path;
      }
    }
  }
  dion3::cuda::set_symmetric_options(*gpu, {});
}

// Whether intermediates are banded is decided at every run, so the backend's symmetric path may
// change between two runs of one orthogonalizer (benchmarks do that): fused kernel, cuBLAS tiles,
// fused kernel again.
class OrthPathChange : public ct::CudaTest {};

TEST_F(OrthPathChange, SymmetricPathMayChangeBetweenRuns) {
  std::mt19937_64 rng(5);
  dion3::OrthConfig cfg;
  cfg.method = OrthMethod::Gram;
  cfg.iteration_dtype = DType::F16;
  Twin in(*gpu, DType::F32, 2, 520, 1040), out(*gpu, DType::F32, 2, 520, 1040);
  in.fill_normal(rng);
  dion3::Orthogonalizer o(*gpu, cfg, 2, 520, 1040);
  std::vector<std::vector<float>> results;
  for (bool kernel : {true, false, true}) {
    dion3::cuda::set_symmetric_options(*gpu, {true, 64, kernel});
    o.run(in.dview(), out.dview());
    results.push_back(out.device_values());
  }
  dion3::cuda::set_symmetric_options(*gpu, {});
  EXPECT_EQ(results[0], results[2]);
  EXPECT_LE(ct::rel_fro_diff(results[1], results[0]), 3e-2);
}

// The whole orthogonalization (normalize, symmetric tile schedule, cuBLAS) captured in a CUDA
// graph on a user stream must replay to the eager result, bit for bit.
TEST(CudaGraph, OrthogonalizeCapturesAndReplays) {
  if (!dion3::cuda_available()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    auto gpu = dion3::make_cuda_backend(0, s);
    dion3::cuda::set_symmetric_options(*gpu, {true, 64});
    std::mt19937_64 rng(71);
    Twin in(*gpu, DType::F32, 2, 200, 520), eager(*gpu, DType::F32, 2, 200, 520), graph(*gpu, DType::F32, 2, 200, 520);
    in.fill_normal(rng);
    dion3::OrthConfig cfg;
    cfg.method = OrthMethod::Gram;
    dion3::Orthogonalizer o(*gpu, cfg, 2, 200, 520);
    o.run(in.dview(), eager.dview());  // warm-up: scratch buffers grow outside the capture
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    cudaGraph_t g;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    o.run(in.dview(), graph.dview());
    ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
    cudaGraphExec_t ge;
    ASSERT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_EQ(graph.device_values(), eager.device_values());
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
  }
  cudaStreamDestroy(s);
}

// Backend::record: the ops replay to what they compute op by op, bit for bit; once the
// backend's scratch memory they use has moved, the recording refuses to replay.
TEST(CudaGraph, RecordingReplaysAndRefusesAfterScratchMoves) {
  if (!dion3::cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto gpu = dion3::make_cuda_backend(0);
  std::mt19937_64 rng(73);
  Twin in(*gpu, DType::F32, 2, 96, 160), eager(*gpu, DType::F32, 2, 96, 160), replayed(*gpu, DType::F32, 2, 96, 160);
  in.fill_normal(rng);
  dion3::OrthConfig cfg;
  cfg.method = OrthMethod::Gram;
  dion3::Orthogonalizer o(*gpu, cfg, 2, 96, 160);
  o.run(in.dview(), eager.dview());  // scratch sized outside the recording
  bool ran = false;
  std::unique_ptr<dion3::Recording> r = gpu->record([&] {
    ran = true;
    o.run(in.dview(), replayed.dview());
  });
  ASSERT_TRUE(r);
  ASSERT_TRUE(ran);
  EXPECT_EQ(replayed.device_values(), std::vector<float>(replayed.numel(), 0.0f));  // recorded, not run
  ASSERT_TRUE(r->replay());
  EXPECT_EQ(replayed.device_values(), eager.device_values());
  // A larger normalisation grows (moves) the scratch the recording holds.
  Twin big(*gpu, DType::F32, 64, 8, 8), big_out(*gpu, DType::F32, 64, 8, 8);
  big.fill_normal(rng);
  gpu->normalize(big.dview(), big_out.dview(), dion3::NormGuard{}, nullptr, false);
  EXPECT_FALSE(r->replay());
  // Work that needs more scratch than exists cannot be recorded: it raises, and nothing is left
  // capturing (the next op runs).
  Twin huge(*gpu, DType::F32, 4096, 2, 2), huge_out(*gpu, DType::F32, 4096, 2, 2);
  EXPECT_THROW(gpu->record([&] { gpu->normalize(huge.dview(), huge_out.dview(), dion3::NormGuard{}, nullptr, false); }), dion3::Error);
  EXPECT_FALSE(gpu->capturing());
  gpu->normalize(huge.dview(), huge_out.dview(), dion3::NormGuard{}, nullptr, false);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
