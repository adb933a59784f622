// bench/profiling_backend.cuh — bench::ProfilingBackend, for the CUDA benches' "where the time
// goes" tables: a Backend that forwards every op to the CUDA backend and brackets it with CUDA
// events on the backend's stream, attributing the time to (megabatch shape, op). Header-only.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cuda_bench_common.cuh"
#include "cuda/cuda_backend.hpp"
#include "dion3/backend.hpp"

namespace bench {

// Every op that takes a megabatch's set (accumulate, gather, update, refresh) names the shape; the
// ops between (selection after the accumulate, the orthogonalization after its chunk's gather)
// count under it. The engine refreshes a set only when its binding changes, so refresh alone cannot
// name it. Ops outside the engine (an Orthogonalizer alone) count under "all".
class ProfilingBackend final : public dion3::Backend {
 public:
  explicit ProfilingBackend(std::unique_ptr<dion3::Backend> inner) : in_(std::move(inner)) {
    stream_ = static_cast<cudaStream_t>(dion3::cuda::backend_stream(*in_));
  }
  ~ProfilingBackend() override {
    for (auto& e : pool_) cudaEventDestroy(e);
  }
  struct Rec {
    std::string shape, op;
    int a, b;
  };
  bool enabled = false;
  // (shape, op) -> ms, summed over the recorded ops since the last clear().
  std::map<std::pair<std::string, std::string>, double> totals;
  // The symmetric products recorded, as dion3-cuda-sym-bench --shapes names them -> how many.
  std::map<std::string, int> products;
  void collect() {
    CK(cudaStreamSynchronize(stream_));
    for (const Rec& r : recs_) {
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, pool_[r.a], pool_[r.b]));
      totals[{r.shape, r.op}] += ms;
    }
    recs_.clear();
    used_ = 0;
  }
  dion3::Device device() const override { return in_->device(); }
  dion3::Allocator& allocator() override { return in_->allocator(); }
  void set_stream(void* s) override { in_->set_stream(s); stream_ = static_cast<cudaStream_t>(s); }
  void fill_zero(void* p, std::size_t b) override { shape_ = "all"; wrap("other", [&] { in_->fill_zero(p, b); }); }
  void copy_to_host(void* d, const void* s, std::size_t b) override { in_->copy_to_host(d, s, b); }
  void copy_from_host(void* d, const void* s, std::size_t b) override { in_->copy_from_host(d, s, b); }
  void copy(void* d, const void* s, std::size_t b) override { wrap("orth.copy", [&] { in_->copy(d, s, b); }); }
  void copy_2d(void* d, std::size_t dp, const void* s, std::size_t sp, std::size_t w, std::size_t h) override {
    wrap("exchange.copy", [&] { in_->copy_2d(d, dp, s, sp, w, h); });
  }
  void* stream() const override { return in_->stream(); }
  bool capturing() const override { return in_->capturing(); }
  void copy_rows(void* d, std::size_t dp, const int32_t* di, const void* s, std::size_t sp, const int32_t* si,
                 std::size_t w, int64_t n) override {
    wrap("exchange.copy", [&] { in_->copy_rows(d, dp, di, s, sp, si, w, n); });
  }
  void selection_slots(const int32_t* i, int64_t n, int64_t k, int64_t c, int64_t p, int64_t b, int64_t f, int32_t* o,
                       const int* sk) override {
    wrap("select", [&] { in_->selection_slots(i, n, k, c, p, b, f, o, sk); });
  }
  int read_flag(const int* f) override { return in_->read_flag(f); }
  std::unique_ptr<dion3::HostCopy> new_host_copy(std::size_t bytes) override { return in_->new_host_copy(bytes); }
  void finish_step(const int* f, int64_t* c, bool count_dropped) override {
    shape_ = "all";
    wrap("other", [&] { in_->finish_step(f, c, count_dropped); });
  }
  void settle_agreement(int* words, int regions) override {
    wrap("other", [&] { in_->settle_agreement(words, regions); });
  }
  std::unique_ptr<dion3::MatrixSet> new_matrix_set() override { return in_->new_matrix_set(); }
  void refresh(dion3::MatrixSet& set) override {
    name(set);
    wrap("refresh", [&] { in_->refresh(set); });
  }
  void check_finite(std::span<const dion3::MatrixView> xs, int* flag) override {
    shape_ = "all";
    wrap("check_finite", [&] { in_->check_finite(xs, flag); });
  }
  void check_step(std::span<const dion3::StepCheck> xs, int* flag) override {
    shape_ = "all";
    wrap("check_step", [&] { in_->check_step(xs, flag); });
  }
  void accumulate(const dion3::MatrixSet& s, dion3::Hyper d, dion3::Hyper gs, float* sc, float* ss, float* lg,
                  const int* k) override {
    name(s);
    wrap("accumulate", [&] { in_->accumulate(s, d, gs, sc, ss, lg, k); });
  }
  void remap_rows(const int32_t* in, int64_t c, int64_t ki, int64_t lo, int64_t hi, int64_t ko, int32_t* out,
                  const int* sk) override {
    wrap("select", [&] { in_->remap_rows(in, c, ki, lo, hi, ko, out, sk); });
  }
  void select_rows(const float* s, int64_t c, int64_t m, int64_t k, int32_t* i, const int* sk, float* l,
                   const float* ss, float* sel) override {
    wrap("select", [&] { in_->select_rows(s, c, m, k, i, sk, l, ss, sel); });
  }
  void gather_rows(const dion3::MatrixSet& s, const int32_t* i, int64_t k, dion3::Hyper a, dion3::Hyper b,
                   dion3::Hyper d,
                   dion3::MatrixView o, float* ss, const int* sk) override {
    name(s);
    wrap("gather", [&] { in_->gather_rows(s, i, k, a, b, d, o, ss, sk); });
  }
  void gather_normalized(const dion3::MatrixSet& s, const int32_t* i, int64_t k, dion3::Hyper d, const float* ss,
                         dion3::NormGuard eps, dion3::MatrixView o, const int* sk) override {
    name(s);
    wrap("gather", [&] { in_->gather_normalized(s, i, k, d, ss, eps, o, sk); });
  }

  void apply_update(const dion3::MatrixSet& s, const int32_t* i, int64_t k, dion3::MatrixView o,
                    const dion3::UpdateParams& p, const int* sk) override {
    name(s);
    wrap("update", [&] { in_->apply_update(s, i, k, o, p, sk); });
  }
  void normalize(dion3::MatrixView i, dion3::MatrixView o, dion3::NormGuard e, const float* ss, bool t) override {
    wrap("orth.normalize", [&] { in_->normalize(i, o, e, ss, t); });  // transposed or not
  }
  void convert(dion3::MatrixView i, dion3::MatrixView o, bool t) override {
    wrap(t ? "orth.transpose" : "orth.convert", [&] { in_->convert(i, o, t); });
  }
  void gemm(bool ta, bool tb, float al, dion3::MatrixView A, dion3::MatrixView B, float be,
            dion3::MatrixView C) override {
    wrap("orth.gemm", [&] { in_->gemm(ta, tb, al, A, B, be, C); });
  }
  bool symmetric_banded(dion3::DType dt, int64_t p) const override { return in_->symmetric_banded(dt, p); }
  void gram(dion3::MatrixView X, dion3::MatrixView C, bool bo) override {
    if (enabled)
      ++products[fmt("gram:%s:%lldx%lldx%lld", dtype_short(X.dtype), (long long)X.batch, (long long)X.rows,
                     (long long)X.cols)];
    wrap("orth.gram", [&] { in_->gram(X, C, bo); });
  }
  void sym_product(float al, dion3::MatrixView A, dion3::MatrixView B, float be, const dion3::MatrixView* D,
                   float g, dion3::MatrixView C, bool bi, bool bo) override {
    if (enabled) ++products[fmt("sym:%s:%lldx%lld", dtype_short(A.dtype), (long long)A.batch, (long long)A.rows)];
    wrap("orth.sym_product", [&] { in_->sym_product(al, A, B, be, D, g, C, bi, bo); });
  }
  void add_identity(dion3::MatrixView X, float g, dion3::MatrixView C) override {
    wrap("orth.add_identity", [&] { in_->add_identity(X, g, C); });
  }
  double symmetric_cost_factor() const override { return in_->symmetric_cost_factor(); }
  dion3::DType default_iteration_dtype(bool g) const override { return in_->default_iteration_dtype(g); }
  void adamw(std::span<const dion3::ElementwiseParam> p, std::span<const dion3::AdamWParams> h,
             const int* s) override {
    wrap("adamw", [&] { in_->adamw(p, h, s); });
  }
  void lion(std::span<const dion3::ElementwiseParam> p, std::span<const dion3::LionParams> h,
            const int* s) override {
    wrap("lion", [&] { in_->lion(p, h, s); });
  }

 private:
  void name(const dion3::MatrixSet& set) { shape_ = fmt("%lldx%lld", (long long)set.rows(), (long long)set.cols()); }
  int event() {
    if (used_ == pool_.size()) {
      cudaEvent_t e;
      CK(cudaEventCreate(&e));
      pool_.push_back(e);
    }
    return static_cast<int>(used_++);
  }
  template <class F>
  void wrap(const char* op, F&& f) {
    if (!enabled) return f();
    const int a = event();
    CK(cudaEventRecord(pool_[a], stream_));
    f();
    const int b = event();
    CK(cudaEventRecord(pool_[b], stream_));
    recs_.push_back({shape_, op, a, b});
  }
  std::unique_ptr<dion3::Backend> in_;
  cudaStream_t stream_;
  std::string shape_ = "all";
  std::vector<cudaEvent_t> pool_;
  std::size_t used_ = 0;
  std::vector<Rec> recs_;
};

}  // namespace bench
