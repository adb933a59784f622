// tests/cuda/test_cuda_dist.cpp — the distributed layouts (algorithm.md §3) on GPUs. On one GPU: world size
// 1 through the distributed code path (CUDA loopback communicator, and NCCL when built) equals the
// single-device path — bit for bit where the arithmetic is the same (replicated), within the
// iteration dtype's rounding where the exchange re-orders it (row-sharded); and 2 to 4 ranks as
// threads sharing the GPU (tests/cpp/thread_comm.hpp) run every multi-rank layout the MPI suite
// checks on the CPU (tests/cpp/layout_cases.hpp), in fp32 against the float64 rule and in the
// backend's 16-bit iterations within their rounding. With two or more GPUs
// (one thread per GPU, ncclCommInitAll): row-sharded and replicated runs equal the float64
// transcription of algorithm.md §3; skipped cleanly with fewer GPUs.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "dion3/comm.hpp"
#include "dion3/optimizer.hpp"
#include "layout_cases.hpp"
#include "reference.hpp"

#ifdef DION3_HAVE_NCCL
#include <nccl.h>
#endif

namespace {

using dion3::DType;
using dion3::Layout;

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

std::vector<double> normal(int64_t n, uint64_t seed, double scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// fp32 device copies of one matrix parameter's shard.
struct DevParam {
  int64_t m, n, first, rows;
  float* w = nullptr;
  float* g = nullptr;
  ~DevParam() {
    cudaFree(w);
    cudaFree(g);
  }
  void upload(float* dst, const std::vector<double>& full) const {
    std::vector<float> part(static_cast<std::size_t>(rows * n));
    for (int64_t e = 0; e < rows * n; ++e) part[e] = static_cast<float>(full[first * n + e]);
    if (!part.empty()) cudaMemcpy(dst, part.data(), part.size() * 4, cudaMemcpyHostToDevice);
  }
  std::vector<double> download() const {
    std::vector<float> part(static_cast<std::size_t>(rows * n));
    if (!part.empty()) cudaMemcpy(part.data(), w, part.size() * 4, cudaMemcpyDeviceToHost);
    return {part.begin(), part.end()};
  }
};

using Shapes = std::vector<std::pair<int64_t, int64_t>>;
const Shapes kShapes = {{96, 160}, {96, 160}, {96, 160}, {192, 80}, {10, 64}, {3, 48}};

struct RunOptions {
  dion3::Algorithm algorithm = dion3::Algorithm::Dion3;
  std::optional<DType> iteration = DType::F32;  // nullopt: the backend's default
  std::size_t workspace_limit = 0;              // OptimizerOptions::workspace_limit
  const Shapes* shapes = &kShapes;
};

// Runs `steps` steps (f32 weights; Dion3 with f32 iteration unless `o` says otherwise) on rank
// `rank` of `ranks` with the given layout and communicator; returns this rank's rows of every
// parameter after each step.
std::vector<std::vector<std::vector<double>>> run_rank(int device, Layout layout, dion3::SelectionScope scope,
                                                       std::shared_ptr<dion3::Communicator> comm, int rank,
                                                       int ranks, int steps, const RunOptions& o = {}) {
  cudaSetDevice(device);
  dion3::OptimizerOptions oo;
  oo.workspace_limit = o.workspace_limit;
  dion3::Optimizer opt(dion3::make_cuda_backend(device), oo);
  dion3::GroupConfig g;
  g.algorithm = o.algorithm;
  g.lr = 0.02;
  g.selection_scope = scope;
  g.orth.iteration_dtype = o.iteration;
  const int gi = opt.add_group(g);
  std::vector<std::unique_ptr<DevParam>> ps;
  for (std::size_t i = 0; i < o.shapes->size(); ++i) {
    auto p = std::make_unique<DevParam>();
    p->m = (*o.shapes)[i].first;
    p->n = (*o.shapes)[i].second;
    const int64_t c = (p->m + ranks - 1) / ranks;
    p->first = layout == Layout::RowShard ? std::min(p->m, rank * c) : 0;
    p->rows = layout == Layout::RowShard ? std::min(c, p->m - p->first) : p->m;
    cudaMalloc(&p->w, std::max<int64_t>(p->rows * p->n, 1) * 4);
    cudaMalloc(&p->g, std::max<int64_t>(p->rows * p->n, 1) * 4);
    p->upload(p->w, normal(p->m * p->n, 10 + i, 0.05));
    dion3::ParamSpec spec;
    spec.name = "w" + std::to_string(i);
    spec.weight = {p->w, DType::F32, dion3::Device::CUDA, device, {p->rows, p->n}};
    spec.grad = {p->g, DType::F32, dion3::Device::CUDA, device, {p->rows, p->n}};
    if (layout != Layout::Local) {
      spec.layout.kind = layout;
      spec.layout.comm = comm;
      spec.layout.global_rows = p->m;
      spec.layout.global_cols = p->n;
      if (layout == Layout::Block) spec.layout.col_comm = comm;  // one rank cuts neither rows nor columns
    }
    opt.add_param(gi, spec);
    ps.push_back(std::move(p));
  }
  std::vector<std::vector<std::vector<double>>> out;
  for (int s = 0; s < steps; ++s) {
    for (std::size_t i = 0; i < ps.size(); ++i) ps[i]->upload(ps[i]->g, normal(ps[i]->m * ps[i]->n, 1000 * s + i, 1.0));
    EXPECT_TRUE(opt.step());
    std::vector<std::vector<double>> now;
    for (auto& p : ps) now.push_back(p->download());
    out.push_back(std::move(now));
  }
  return out;
}

double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0, m = 1e-30;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(a[i] - b[i]));
    m = std::max(m, std::fabs(b[i]));
  }
  return d / m;
}

class CudaLayouts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// World size 1 through the distributed path equals the single-device path (every layout).
TEST_F(CudaLayouts, WorldSizeOneEqualsSingleDevice) {
  std::vector<std::pair<std::string, std::shared_ptr<dion3::Communicator>>> comms = {
      {"loopback", dion3::make_loopback_communicator(dion3::Device::CUDA)}};
#ifdef DION3_HAVE_NCCL
  ncclComm_t nc;
  int dev0 = 0;
  ASSERT_EQ(ncclCommInitAll(&nc, 1, &dev0), ncclSuccess);
  comms.emplace_back("nccl", dion3::make_nccl_communicator(nc, 0));
#endif
  const auto local = run_rank(0, Layout::Local, dion3::SelectionScope::Local, nullptr, 0, 1, 3);
  for (auto& [name, comm] : comms) {
    const auto ddp = run_rank(0, Layout::Replicated, dion3::SelectionScope::Local, comm, 0, 1, 3);
    EXPECT_EQ(ddp, local) << name << ": replicated at world size 1 must equal the single-device path bit for bit";
    for (Layout cut : {Layout::ColShard, Layout::Block}) {
      const auto got = run_rank(0, cut, dion3::SelectionScope::Local, comm, 0, 1, 3);
      for (std::size_t s = 0; s < got.size(); ++s)
        for (std::size_t i = 0; i < got[s].size(); ++i)
          EXPECT_LE(rel_diff(got[s][i], local[s][i]), 1e-5) << name << " " << dion3::layout_name(cut) << ", step " << s
                                                           << ", param " << i;
    }
    for (auto scope : {dion3::SelectionScope::Local, dion3::SelectionScope::Global}) {
      const auto rows = run_rank(0, Layout::RowShard, scope, comm, 0, 1, 3);
      for (std::size_t s = 0; s < rows.size(); ++s)
        for (std::size_t i = 0; i < rows[s].size(); ++i)
          EXPECT_LE(rel_diff(rows[s][i], local[s][i]), 1e-5) << name << " row-sharded, step " << s << ", param " << i;
    }
  }
#ifdef DION3_HAVE_NCCL
  comms.clear();
  ncclCommDestroy(nc);
#endif
}

// The same in the backend's own iteration dtypes (bf16, fp16) on fp32 momentum, for Dion3, NorMuon
// and Muon, whole megabatches and chunks of one matrix: every layout's buffers (update rows wider
// than the iteration's, their row sums) must be where the plan put them. Within the iteration
// dtype's rounding (the layouts take the input's norm from different sums). Run under
// compute-sanitizer's memcheck too (tools/gpu-check with DION3_GPU_CHECK_MEMCHECK).
TEST_F(CudaLayouts, WorldSizeOneEqualsSingleDeviceInHalfIterationsAndChunks) {
  const auto comm = dion3::make_loopback_communicator(dion3::Device::CUDA);
  // Wide, tall, and Dion3 selections wider than the matrix (80 x 12: k = 20 > 12).
  const Shapes shapes = {{96, 160}, {96, 160}, {192, 80}, {10, 64}, {80, 12}, {80, 12}};
  for (auto algo : {dion3::Algorithm::Dion3, dion3::Algorithm::NorMuon, dion3::Algorithm::Muon})
    for (std::size_t limit : {std::size_t{0}, std::size_t{1}}) {
      const RunOptions o{algo, std::nullopt, limit, &shapes};
      const auto local = run_rank(0, Layout::Local, dion3::SelectionScope::Local, nullptr, 0, 1, 2, o);
      for (Layout cut : {Layout::Replicated, Layout::RowShard, Layout::ColShard, Layout::Block}) {
        const auto got = run_rank(0, cut, dion3::SelectionScope::Local, comm, 0, 1, 2, o);
        for (std::size_t s = 0; s < got.size(); ++s)
          for (std::size_t i = 0; i < got[s].size(); ++i)
            EXPECT_LE(rel_diff(got[s][i], local[s][i]), 5e-3)
                << dion3::algorithm_name(algo) << ", " << dion3::layout_name(cut) << ", workspace limit " << limit
                << ", step " << s << ", param " << i;
      }
    }
}

// Several GPUs: each rank's rows equal algorithm.md §3's rule computed in one process (float64).
// A distributed step reads the ranks' agreement on the host after planning anew, and refuse_step
// always does: neither can run inside a capture. Both are refused before anything is planned or
// enqueued, the capture stays usable, and after one eager step the step captures.
TEST_F(CudaLayouts, CapturesRefusedUntilThePlansWereCompared) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    dion3::Optimizer opt(dion3::make_cuda_backend(0, stream));
    DevParam p;
    p.m = 48;
    p.n = 64;
    p.first = 0;
    p.rows = 48;
    cudaMalloc(&p.w, 48 * 64 * 4);
    cudaMalloc(&p.g, 48 * 64 * 4);
    p.upload(p.w, normal(48 * 64, 5, 0.05));
    p.upload(p.g, normal(48 * 64, 6, 1.0));
    dion3::ParamSpec spec;
    spec.name = "w";
    spec.weight = {p.w, DType::F32, dion3::Device::CUDA, 0, {48, 64}};
    spec.grad = {p.g, DType::F32, dion3::Device::CUDA, 0, {48, 64}};
    spec.layout.kind = Layout::Replicated;
    spec.layout.comm = dion3::make_loopback_communicator(dion3::Device::CUDA);
    opt.add_param(opt.add_group(dion3::GroupConfig{}), spec);
    auto captured = [&](const std::function<void()>& call) {
      std::string what;
      EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      try {
        call();
      } catch (const dion3::Error& e) {
        what = e.what();
      }
      cudaGraph_t graph = nullptr;
      EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess) << "the capture was broken: " << what;
      if (graph) cudaGraphDestroy(graph);
      return what;
    };
    EXPECT_NE(captured([&] { opt.step_async(); }).find("cannot be captured before the ranks' plans were compared"),
              std::string::npos);
    EXPECT_NE(captured([&] { opt.refuse_step(); }).find("cannot be captured"), std::string::npos);
    EXPECT_TRUE(opt.step());
    EXPECT_TRUE(opt.step());  // the second step records the orthogonalization, as before a real capture
    EXPECT_EQ(captured([&] { opt.step_async(); }), "");
  }
  cudaStreamDestroy(stream);
}

// One GPU's memory and a CUDA backend per rank thread.
t3::RankBackend gpu_backend(std::optional<DType> iteration) {
  t3::RankBackend be;
  be.device = dion3::Device::CUDA;
  be.iteration = iteration;
  be.batch_invariant = false;
  be.make_backend = [] {
    cudaSetDevice(0);
    return dion3::make_cuda_backend(0);
  };
  be.alloc = [](std::size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), cudaSuccess);
    return p;
  };
  be.release = [](void* p) { cudaFree(p); };
  be.upload = [](void* dst, const void* src, std::size_t bytes) {
    EXPECT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  };
  be.download = [](void* dst, const void* src, std::size_t bytes) {
    EXPECT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  };
  return be;
}

class ThreadRanksOnOneGpu : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
    cudaSetDevice(0);
  }
};

TEST_P(ThreadRanksOnOneGpu, LayoutsEqualTheSingleProcessRule) { t3::check_layouts_on_threads(GetParam(), gpu_backend(DType::F32)); }

TEST_P(ThreadRanksOnOneGpu, LayoutsInHalfIterations) { t3::check_layouts_on_threads(GetParam(), gpu_backend(std::nullopt)); }

// The agreement on the device: hyper-parameters uploaded through staging memory, the verdict
// settled by a kernel, and enqueued steps (which do not read it on the host) dropped there.
TEST_P(ThreadRanksOnOneGpu, StepsTheRanksDisagreeOnAreRefusedByEveryRank) {
  t3::check_agreement_on_threads(GetParam(), gpu_backend(std::nullopt));
}

INSTANTIATE_TEST_SUITE_P(Cuda, ThreadRanksOnOneGpu, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param) + "ranks"; });

TEST_F(CudaLayouts, MultiGpuLayoutsEqualTheReference) {
#ifndef DION3_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL";
#else
  const int P = gpu_count();
  if (P < 2) GTEST_SKIP() << "needs 2 or more GPUs (found " << P << ")";
  for (auto [layout, scope] : {std::pair{Layout::RowShard, dion3::SelectionScope::Local},
                               std::pair{Layout::RowShard, dion3::SelectionScope::Global},
                               std::pair{Layout::Replicated, dion3::SelectionScope::Local}}) {
    std::vector<ncclComm_t> ncs(P);
    std::vector<int> devs(P);
    for (int d = 0; d < P; ++d) devs[d] = d;
    ASSERT_EQ(ncclCommInitAll(ncs.data(), P, devs.data()), ncclSuccess);
    std::vector<std::vector<std::vector<std::vector<double>>>> got(P);
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r)
      threads.emplace_back([&, r] {
        got[r] = run_rank(r, layout, scope, dion3::make_nccl_communicator(ncs[r], r), r, P, 3);
      });
    for (auto& t : threads) t.join();
    for (auto nc : ncs) ncclCommDestroy(nc);
    // The reference, step by step.
    ref::MatrixHyper h;
    h.lr = 0.02;
    for (std::size_t i = 0; i < kShapes.size(); ++i) {
      const int m = static_cast<int>(kShapes[i].first), n = static_cast<int>(kShapes[i].second);
      ref::Mat W = normal(m * n, 10 + i, 0.05), M(W.size(), 0.0);
      ref::Vec v(m, 0.0);
      for (int s = 0; s < 3; ++s) {
        const ref::Mat G = normal(m * n, 1000 * s + i, 1.0);
        if (layout == Layout::Replicated) ref::dion3_step(W, M, v, G, m, n, h);
        else ref::dion3_step_sharded(W, M, v, G, m, n, h, P,
                                     scope == dion3::SelectionScope::Global ? ref::Scope::Global : ref::Scope::Local);
        const int64_t c = (m + P - 1) / P;
        for (int r = 0; r < P; ++r) {
          const int64_t first = layout == Layout::RowShard ? std::min<int64_t>(m, r * c) : 0;
          const auto& part = got[r][s][i];
          const std::vector<double> want(W.begin() + first * n, W.begin() + first * n + static_cast<long>(part.size()));
          EXPECT_LE(rel_diff(part, want), 1e-4) << dion3::layout_name(layout) << " rank " << r << " step " << s
                                                << " param " << i;
        }
      }
    }
  }
#endif
}

}  // namespace
