// cuda_backend.cu — the CUDA implementation of dion3::Backend: stream, cuBLAS handle and
// workspace, default stream-ordered allocator, per-megabatch device pointer tables, and the
// dispatch of every backend op to the kernels in step_kernels.cu, elementwise_kernels.cu and
// symmetric.cu (gram/sym_product: the fused sm_90a kernel of sym_wgmma.cu where it pays, else
// the cuBLAS tile schedule). Nothing here synchronises with the host except read_flag and host copies.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <nvtx3/nvToolsExt.h>

#include "cuda/cuda_backend.hpp"
#include "cuda/kernels.cuh"

namespace dion3 {
namespace cuda {

void throw_cuda(cudaError_t e, const char* what, const char* file, int line) {
  fail(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") in " +
           what + " at " + file + ":" + std::to_string(line),
       Status::Internal);
}

void throw_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  fail(std::string("cuBLAS error ") + cublasGetStatusName(s) + " in " + what + " at " + file + ":" +
           std::to_string(line),
       Status::Internal);
}

namespace {

// Stream-ordered allocations on the backend's stream (capture-safe with cudaMallocAsync).
class StreamAllocator final : public Allocator {
 public:
  explicit StreamAllocator(cudaStream_t s) : stream_(s) {}
  void* allocate(std::size_t bytes) override {
    void* p = nullptr;
    if (bytes == 0) return nullptr;
    DION3_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream_));
    return p;
  }
  void deallocate(void* ptr, std::size_t) override {
    if (ptr) cudaFreeAsync(ptr, stream_);  // no throw from destructors' paths
  }
  void set_stream(cudaStream_t s) { stream_ = s; }

 private:
  cudaStream_t stream_;
};

// Device memory that only grows; reuse is safe because every user is ordered on one stream.
// Growing moves it: `epoch` counts that, for the recordings that hold its address.
class Scratch {
 public:
  void* get(Allocator& a, std::size_t bytes, uint64_t& epoch, bool recording) {
    if (bytes > buf_.bytes()) {
      // Memory allocated inside a capture belongs to the graph: a recording cannot grow it.
      if (recording) fail("internal: a recording needs more scratch memory than its eager run did", Status::Internal);
      buf_ = DeviceBuffer(a, round_up(bytes));
      ++epoch;
    }
    return buf_.get();
  }
  void reset() { buf_ = DeviceBuffer(); }

 private:
  static std::size_t round_up(std::size_t b) { return (b + 4095) & ~std::size_t(4095); }
  DeviceBuffer buf_;
};

// Makes `device` current for its lifetime: events and pinned memory belong to the device current
// when they are made.
struct OnDevice {
  int previous = 0;
  explicit OnDevice(int device) {
    DION3_CUDA_CHECK(cudaGetDevice(&previous));
    if (previous != device) DION3_CUDA_CHECK(cudaSetDevice(device));
  }
  ~OnDevice() { cudaSetDevice(previous); }
};

struct CudaMatrixSet final : MatrixSet {
  DeviceBuffer table;           // DeviceMat[mats.size()]
  DeviceMat* host = nullptr;    // pinned staging of the table
  std::size_t host_cap = 0;
  cudaEvent_t uploaded = nullptr;
  bool pending = false;
  DType wdt = DType::F32, gdt = DType::F32, mdt = DType::F32;
  std::size_t uploaded_count = 0;
  std::vector<DeviceMat> uploaded_table;  // what the device table holds (a step that changes nothing skips the copy)
  bool vec = false;  // all stored rows of W, G, M start 4-element aligned and their width % 4 == 0
  ~CudaMatrixSet() override {
    if (uploaded) { cudaEventSynchronize(uploaded); cudaEventDestroy(uploaded); }
    if (host) cudaFreeHost(host);
  }
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, cudaStream_t stream, Allocator* alloc) : device_(device), stream_(stream) {
    DION3_CUDA_CHECK(cudaSetDevice(device_));
    if (alloc == nullptr) {
      own_alloc_ = std::make_unique<StreamAllocator>(stream_);
      alloc_ = own_alloc_.get();
    } else {
      alloc_ = alloc;
    }
    DION3_CUBLAS_CHECK(cublasCreate(&handle_));
    cublas_ws_ = DeviceBuffer(*alloc_, kCublasWorkspace);
    bind_cublas(stream_);
    if (const char* t = std::getenv("DION3_SYM_TILE")) sym_.tile = std::atoll(t);
    if (const char* e = std::getenv("DION3_SYM_DISABLE")) sym_.enabled = std::atoi(e) == 0;
    if (const char* e = std::getenv("DION3_SYM_KERNEL")) kernel_env_ = std::atoi(e) != 0;
    if (const char* e = std::getenv("DION3_SYM_PAIRS")) pairs_env_ = std::atoi(e) != 0;
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    for (Staging& st : staging_) {
      if (st.done) {
        cudaEventSynchronize(st.done);  // a copy from another stream may still read st.host
        cudaEventDestroy(st.done);
      }
      if (st.host) cudaFreeHost(st.host);
    }
    if (capture_stream_) cudaStreamDestroy(capture_stream_);
    scratch_.reset();
    scratch_sym_.reset();
    cublas_ws_ = DeviceBuffer();
    if (handle_) cublasDestroy(handle_);
    cudaStreamSynchronize(stream_);
  }

  Device device() const override { return Device::CUDA; }
  Allocator& allocator() override { return *alloc_; }
  void set_stream(void* stream) override {
    if (stream == stream_) return;  // front ends set it before every call
    stream_ = static_cast<cudaStream_t>(stream);
    bind_cublas(stream_);
    if (own_alloc_) own_alloc_->set_stream(stream_);
  }
  void* stream() const override { return stream_; }
  bool capturing() const override {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    DION3_CUDA_CHECK(cudaStreamIsCapturing(stream_, &cap));
    return cap != cudaStreamCaptureStatusNone;
  }
  std::unique_ptr<Recording> record(const std::function<void()>& work) override;
  // Recordings made before the epoch last changed replay no more (Recording::replay answers
  // false): they hold scratch memory that moved, or kernel choices that changed.
  uint64_t recording_epoch() const { return recording_epoch_; }
  int device_index() const override { return device_; }
  void invalidate_recordings() { ++recording_epoch_; }

  // NVTX costs a call into a stub when no tool (Nsight Systems) is attached.
  void range_push(const char* name) override { nvtxRangePushA(name); }
  void range_pop() override { nvtxRangePop(); }

  // --- memory ----------------------------------------------------------------------------
  void fill_zero(void* ptr, std::size_t bytes) override {
    if (bytes) DION3_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream_));
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    if (!bytes) return;
    DION3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    DION3_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override {
    if (!bytes) return;
    DION3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    DION3_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host buffer may go away
  }
  void upload(void* dst, const void* src, std::size_t bytes) override {
    if (!bytes) return;
    // A captured copy would read the staging memory at replay, after later uploads reused it.
    if (capturing()) fail("CUDA backend: upload() while the stream is being captured");
    const OnDevice on(device_);
    Staging& st = staging_[next_staging_];
    next_staging_ = (next_staging_ + 1) % staging_.size();
    // Waits for the slot's previous copy only: several uploads back, so a host that runs steps
    // ahead of the GPU waits here only when it is that many uploads ahead.
    if (st.done) DION3_CUDA_CHECK(cudaEventSynchronize(st.done));
    else DION3_CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
    if (st.bytes < bytes) {
      if (st.host) DION3_CUDA_CHECK(cudaFreeHost(st.host));
      st.host = nullptr;
      st.bytes = 0;
      DION3_CUDA_CHECK(cudaHostAlloc(&st.host, bytes, cudaHostAllocDefault));
      st.bytes = bytes;
    }
    std::memcpy(st.host, src, bytes);
    DION3_CUDA_CHECK(cudaMemcpyAsync(dst, st.host, bytes, cudaMemcpyHostToDevice, stream_));
    DION3_CUDA_CHECK(cudaEventRecord(st.done, stream_));
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes) DION3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void copy_2d(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
               std::size_t height) override {
    if (!width || !height) return;
    DION3_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice,
                                       stream_));
  }
  int read_flag(const int* flag) override {
    int v = 0;
    copy_to_host(&v, flag, sizeof(int));
    return v;
  }

  std::unique_ptr<HostCopy> new_host_copy(std::size_t bytes) override;

  void finish_step(const int* flag, int64_t* counters, bool count_dropped) override {
    launch_finish_step(flag, counters, count_dropped, stream_);
  }
  void settle_agreement(int* words, int regions) override { launch_settle_agreement(words, regions, stream_); }

  std::unique_ptr<MatrixSet> new_matrix_set() override { return std::make_unique<CudaMatrixSet>(); }

  void refresh(MatrixSet& base) override {
    auto* set = dynamic_cast<CudaMatrixSet*>(&base);
    if (set == nullptr) fail("CUDA backend: refresh() needs a MatrixSet made by this backend's new_matrix_set()");
    const std::size_t n = set->mats.size();
    if (n == 0) return;
    const auto& f = set->mats.front();
    set->wdt = f.weight.dtype;
    set->gdt = f.grad.data ? f.grad.dtype : f.weight.dtype;
    set->mdt = f.momentum.data ? f.momentum.dtype : f.weight.dtype;
    for (std::size_t i = 0; i < n; ++i) {
      const auto& pm = set->mats[i];
      if (pm.weight.dtype != set->wdt || (pm.grad.data && pm.grad.dtype != set->gdt) ||
          (pm.momentum.data && pm.momentum.dtype != set->mdt))
        fail("CUDA backend: matrices of one megabatch must share dtypes (matrix " + std::to_string(i) + ")");
    }
    std::vector<DeviceMat> next(n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto& pm = set->mats[i];
      next[i] = DeviceMat{pm.weight.data, pm.grad.data, pm.momentum.data, pm.variance,
                          pm.weight.ld ? pm.weight.ld : pm.weight.cols, pm.grad.ld ? pm.grad.ld : pm.grad.cols,
                          pm.momentum.ld ? pm.momentum.ld : pm.momentum.cols};
    }
    set->vec = vec_of(*set);
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    DION3_CUDA_CHECK(cudaStreamIsCapturing(stream_, &cap));
    // The table on the device already holds these entries (the usual case from one step to the
    // next): no copy. Under capture the copy is always recorded, so that the graph carries it.
    if (cap == cudaStreamCaptureStatusNone && set->uploaded_count == n && set->uploaded_table.size() == n &&
        std::memcmp(set->uploaded_table.data(), next.data(), n * sizeof(DeviceMat)) == 0)
      return;
    // The staging buffer may still be read by the previous upload: wait for it (it is
    // normally long done), except under capture where events cannot be waited on.
    if (set->pending && cap == cudaStreamCaptureStatusNone) {
      DION3_CUDA_CHECK(cudaEventSynchronize(set->uploaded));
      set->pending = false;
    }
    if (set->host_cap < n) {
      if (set->host) DION3_CUDA_CHECK(cudaFreeHost(set->host));
      DION3_CUDA_CHECK(cudaMallocHost(&set->host, n * sizeof(DeviceMat)));
      set->host_cap = n;
    }
    if (set->table.bytes() < n * sizeof(DeviceMat)) set->table = DeviceBuffer(*alloc_, n * sizeof(DeviceMat));
    std::memcpy(set->host, next.data(), n * sizeof(DeviceMat));
    // A captured copy runs only when the graph is replayed: the device table is known only after
    // an eager one.
    if (cap == cudaStreamCaptureStatusNone) set->uploaded_table = std::move(next);
    else set->uploaded_table.clear();
    DION3_CUDA_CHECK(cudaMemcpyAsync(set->table.get(), set->host, n * sizeof(DeviceMat),
                                     cudaMemcpyHostToDevice, stream_));
    if (cap == cudaStreamCaptureStatusNone) {
      if (!set->uploaded) DION3_CUDA_CHECK(cudaEventCreateWithFlags(&set->uploaded, cudaEventDisableTiming));
      DION3_CUDA_CHECK(cudaEventRecord(set->uploaded, stream_));
      set->pending = true;
    }
    set->uploaded_count = n;
  }

  // --- step, parameter side ----------------------------------------------------------------
  void check_finite(std::span<const MatrixView> xs, int* flag) override {
    launch_check_finite(xs, flag, stream_);
  }
  void check_step(std::span<const StepCheck> xs, int* flag) override { launch_check_step(xs, flag, stream_); }

  void accumulate(const MatrixSet& base, Hyper decay, Hyper grad_scale, float* scores, float* row_sumsq,
                  float* largest, const int* skip) override {
    const auto& set = ready(base);
    if (set.columns) {  // stored rows x cols is the set's cols x rows
      float* scr = static_cast<float*>(scratch(
          scratch_, accumulate_columns_scratch_floats(n_of(set), set.cols(), set.rows()) * sizeof(float)));
      launch_accumulate_columns(table(set), n_of(set), set.cols(), set.rows(), set.mdt, set.gdt, decay, grad_scale,
                                scores, row_sumsq, largest, scr, skip, stream_, set.vec);
      return;
    }
    launch_accumulate(table(set), n_of(set), set.rows(), set.cols(), set.mdt, set.gdt, decay, grad_scale, scores,
                      row_sumsq, largest, skip, stream_, set.vec);
  }

  void select_rows(const float* scores, int64_t count, int64_t m, int64_t k, int32_t* idx,
                   const int* skip, float* largest, const float* row_sumsq, float* selected_sumsq) override {
    launch_select_rows(scores, count, m, k, idx, largest, row_sumsq, selected_sumsq, skip, stream_);
  }

  void copy_rows(void* dst, std::size_t dst_pitch, const int32_t* dst_idx, const void* src, std::size_t src_pitch,
                 const int32_t* src_idx, std::size_t width, int64_t rows) override {
    launch_copy_rows(dst, dst_pitch, dst_idx, src, src_pitch, src_idx, width, rows, stream_);
  }
  void selection_slots(const int32_t* idx, int64_t count, int64_t k, int64_t c, int64_t piece, int64_t block,
                       int64_t first_slot, int32_t* out, const int* skip) override {
    launch_selection_slots(idx, count, k, c, piece, block, first_slot, out, skip, stream_);
  }
  void remap_rows(const int32_t* in, int64_t count, int64_t k_in, int64_t lo, int64_t hi, int64_t k_out,
                  int32_t* out, const int* skip) override {
    launch_remap_rows(in, count, k_in, lo, hi, k_out, out, skip, stream_);
  }

  void gather_rows(const MatrixSet& base, const int32_t* idx, int64_t k, Hyper scale_m, Hyper scale_g,
                   Hyper decay, MatrixView out, float* row_sumsq, const int* skip) override {
    const auto& set = ready(base);
    check_gather_shape(set, idx, k, out, "gather_rows");
    if (set.columns) {
      float* scr = static_cast<float*>(
          scratch(scratch_, gather_columns_scratch_floats(n_of(set), set.cols(), k) * sizeof(float)));
      launch_gather_columns(table(set), n_of(set), set.cols(), set.rows(), set.mdt, set.gdt, idx, k, scale_m,
                            scale_g, decay, nullptr, NormGuard{}, out, row_sumsq, scr, skip, stream_);
      return;
    }
    launch_gather_rows(table(set), n_of(set), set.rows(), set.cols(), set.mdt, set.gdt, idx, k, scale_m,
                       scale_g, decay, nullptr, NormGuard{}, out, row_sumsq, skip, stream_, set.vec);
  }

  void gather_normalized(const MatrixSet& base, const int32_t* idx, int64_t k, Hyper decay,
                         const float* selected_sumsq, NormGuard norm, MatrixView out, const int* skip) override {
    const auto& set = ready(base);
    check_gather_shape(set, idx, k, out, "gather_normalized");
    if (set.columns) {
      launch_gather_columns(table(set), n_of(set), set.cols(), set.rows(), set.mdt, set.mdt, idx, k, 1.0f, 0.0f,
                            decay, selected_sumsq, norm, out, nullptr, nullptr, skip, stream_);
      return;
    }
    launch_gather_rows(table(set), n_of(set), set.rows(), set.cols(), set.mdt, set.mdt, idx, k, 1.0f, 0.0f, decay,
                       selected_sumsq, norm, out, nullptr, skip, stream_, set.vec);
  }

  void apply_update(const MatrixSet& base, const int32_t* idx, int64_t k, MatrixView O,
                    const UpdateParams& p, const int* skip) override {
    const auto& set = ready(base);
    if (idx == nullptr && k != set.rows()) fail("apply_update: idx == null needs k == rows");
    if (O.rows != k || O.cols < p.o_col_offset + set.cols() || O.batch != n_of(set))
      fail("apply_update: O must be " + std::to_string(n_of(set)) + " x " + std::to_string(k) + " x " +
           std::to_string(set.cols()));
    float* scr = static_cast<float*>(
        scratch(scratch_, apply_update_scratch_floats(n_of(set), k) * sizeof(float)));
    if (set.columns) {
      launch_update_columns(table(set), n_of(set), set.cols(), set.rows(), set.wdt, idx, k, O, p, scr, skip, stream_);
      return;
    }
    launch_apply_update(table(set), n_of(set), set.rows(), set.cols(), set.wdt, idx, k, O, p, scr, skip,
                        stream_);
  }

  // --- orthogonalization primitives ----------------------------------------------------------
  void normalize(MatrixView in, MatrixView out, NormGuard norm, const float* row_sumsq, bool transpose) override {
    float* scr = static_cast<float*>(scratch(scratch_, normalize_scratch_floats(in.batch) * sizeof(float)));
    launch_normalize(in, out, norm, row_sumsq, scr, transpose, stream_);
  }
  void convert(MatrixView in, MatrixView out, bool transpose) override {
    if (transpose) launch_transpose(in, out, stream_);
    else launch_convert(in, out, stream_);
  }
  void add_identity(MatrixView X, float gamma, MatrixView C) override {
    if (X.rows != X.cols || C.rows != X.rows || C.cols != X.cols || C.batch != X.batch)
      fail("add_identity: X and C must be square and of one shape");
    launch_sym_prepare(X, 1.0f, gamma, C, C.rows, stream_);
  }

  void gemm(bool trans_a, bool trans_b, float alpha, MatrixView A, MatrixView B, float beta,
            MatrixView C) override {
    cublas_gemm(handle_, trans_a, trans_b, alpha, A, B, beta, C);
  }

  // Banded results where the fused kernel makes and reads them: the whole chain of products of
  // one orthogonalizer then runs on it (the cuBLAS tile schedule below needs full operands).
  bool symmetric_banded(DType dtype, int64_t p) const override {
    return sym_.enabled && sym_.kernel && kernel_env_ && sym_wgmma_available() &&
           (dtype == DType::F16 || dtype == DType::BF16) && p > kSymBand && p % 8 == 0;
  }

  void gram(MatrixView X, MatrixView C, bool banded_out) override {
    if (C.rows != X.rows || C.cols != X.rows || C.batch != X.batch)
      fail("gram: C must be batch x rows x rows of X");
    const int64_t p = X.rows;
    if (use_kernel(X, X, nullptr, C)) {
      launch_sym_wgmma(X, X, 1.0f, 0.0f, nullptr, 0.0f, C, stream_, false, banded_out, false, sm_limit_,
                       sym_.pairs && pairs_env_);
      return;
    }
    const int64_t tile = tile_for(p);
    if (tile >= p) {
      // One full GEMM; the mirror makes C exactly symmetric (the products that read C next
      // take its rows for its columns).
      cublas_gemm(handle_, false, true, 1.0f, X, X, 0.0f, C);
      launch_mirror_lower(C, 0.0f, true, stream_);
      return;
    }
    void* ptrs = scratch(scratch_sym_, sym_ptr_scratch_bytes(C.batch, p, tile));
    sym_lower_gemm(handle_, stream_, X, X, 1.0f, 0.0f, C, tile, ptrs);
    launch_mirror_lower(C, 0.0f, true, stream_);
  }

  void sym_product(float alpha, MatrixView A, MatrixView B, float beta, const MatrixView* D,
                   float gamma, MatrixView C, bool banded_in, bool banded_out) override {
    const int64_t p = C.rows;
    if (A.rows != p || A.cols != p || B.rows != p || B.cols != p || C.cols != p)
      fail("sym_product: A, B and C must be square and of one size");
    if (C.data == A.data || C.data == B.data) fail("sym_product: C must not alias A or B");
    const bool has_d = D != nullptr && D->data != nullptr && beta != 0.0f;
    if (use_kernel(A, B, has_d ? D : nullptr, C)) {
      // Fused: C = alpha·A·B + beta·D + gamma·I from the lower triangle, mirrored (or banded).
      launch_sym_wgmma(A, B, alpha, beta, has_d ? D : nullptr, gamma, C, stream_, banded_in, banded_out, false,
                       sm_limit_, sym_.pairs && pairs_env_);
      return;
    }
    if (banded_in) fail("sym_product: banded operands need the fused kernel, which does not run on these");
    const int64_t tile = tile_for(p);
    if (has_d) launch_sym_prepare(*D, beta, gamma, C, tile, stream_);
    const float gemm_beta = has_d ? 1.0f : 0.0f;
    // Row-major C = A·Bᵀ (the backend's contract): the "T,N" form of the tile schedule.
    if (tile >= p) {
      cublas_gemm(handle_, false, true, alpha, A, B, gemm_beta, C);
      launch_mirror_lower(C, has_d ? 0.0f : gamma, true, stream_);
      return;
    }
    void* ptrs = scratch(scratch_sym_, sym_ptr_scratch_bytes(C.batch, p, tile));
    sym_lower_gemm(handle_, stream_, A, B, alpha, gemm_beta, C, tile, ptrs);
    launch_mirror_lower(C, has_d ? 0.0f : gamma, true, stream_);
  }

  double symmetric_cost_factor() const override {
    if (!sym_.enabled) return 1.0;
    return kMeasuredSymFactor;
  }
  DType default_iteration_dtype(bool gram) const override { return gram ? DType::F16 : DType::BF16; }

  // --- element-wise optimizers ---------------------------------------------------------------
  void adamw(std::span<const ElementwiseParam> ps, std::span<const AdamWParams> hs, const int* skip) override {
    launch_adamw(ps, hs, skip, stream_);
  }
  void lion(std::span<const ElementwiseParam> ps, std::span<const LionParams> hs, const int* skip) override {
    launch_lion(ps, hs, skip, stream_);
  }

  // --- knobs -------------------------------------------------------------------------------
  SymmetricOptions sym_{};
  bool kernel_env_ = true;
  bool pairs_env_ = true;  // DION3_SYM_PAIRS=0: never pairs, whatever set_symmetric_options says
  int sm_limit_ = 0;  // set_product_sm_limit; 0: every multiprocessor
  void set_sm_limit(int sms) {
    DION3_CUBLAS_CHECK(cublasSetSmCountTarget(handle_, sms));
    sm_limit_ = sms;
    invalidate_recordings();  // recordings hold the old grids
  }
  // The fused kernel wherever it applies: on the H200 it is at least as fast as the cuBLAS tile
  // schedule it replaces on every shape the benchmarks cover (the symmetric-kernel runs in
  // bench/results/).
  bool use_kernel(const MatrixView& A, const MatrixView& B, const MatrixView* D,
                  const MatrixView& C) const {
    return sym_.enabled && sym_.kernel && kernel_env_ && C.batch > 0 && C.rows > 0 &&
           sym_wgmma_supported(A, B, D, C);
  }
  // See dion3::cuda::symmetric_flop_fraction.
  double flop_fraction(int64_t p) const {
    if (!sym_.enabled || p <= 0) return 1.0;
    if (sym_.kernel && kernel_env_ && sym_wgmma_available()) return sym_wgmma_flop_fraction(p);
    const int64_t t = tile_for(p);
    double lower = 0.0;  // the lower-triangle tiles (i, j <= i) of the tile schedule
    for (int64_t i = 0; i * t < p; ++i) lower += static_cast<double>(std::min(t, p - i * t)) * std::min((i + 1) * t, p);
    return lower / (static_cast<double>(p) * p);
  }
  int64_t tile_for(int64_t p) const {
    if (!sym_.enabled) return p;
    int64_t t = sym_.tile;
    if (t <= 0) {
      // Automatic, from an H200 tile-size sweep (bench/results/): small matrices gain nothing from
      // tiles, mid-sized ones do best with 256-tiles, large ones with 512-tiles.
      if (p < 1536) return p;
      t = p < 3584 ? 256 : 512;
    }
    if (t >= p) return p;
    return t;
  }

 private:
  static constexpr std::size_t kCublasWorkspace = 32u << 20;

  // cublasSetStream resets the handle's workspace to cuBLAS's own pool, which a graph capture
  // cannot use: the fixed workspace is set again with every stream.
  void bind_cublas(cudaStream_t s) {
    DION3_CUBLAS_CHECK(cublasSetStream(handle_, s));
    DION3_CUBLAS_CHECK(cublasSetWorkspace(handle_, cublas_ws_.get(), kCublasWorkspace));
  }
  void* scratch(Scratch& s, std::size_t bytes) { return s.get(*alloc_, bytes, recording_epoch_, recording_); }
  // Tiled time over full-GEMM time at large p, from the same H200 sweep: the cost model's
  // discount for a symmetric product (one constant, not calibrated per device).
  static constexpr double kMeasuredSymFactor = 0.65;

  // Every stored row of W, G and M starts 4-element aligned and the stored columns are a multiple
  // of 4 (the 4-wide kernels; a column-stepped set's stored columns are its rows).
  static bool vec_of(const CudaMatrixSet& set) {
    bool vec = (set.columns ? set.rows() : set.cols()) % 4 == 0;
    for (const auto& pm : set.mats) {
      auto ok = [](const MatrixView& v) {
        return v.data == nullptr || (aligned4(v.data, dtype_size(v.dtype)) && (v.ld == 0 || v.ld % 4 == 0));
      };
      vec = vec && ok(pm.weight) && ok(pm.grad) && ok(pm.momentum);
    }
    return vec;
  }

  const CudaMatrixSet& ready(const MatrixSet& base) const {
    const auto* set = dynamic_cast<const CudaMatrixSet*>(&base);
    if (set == nullptr) fail("CUDA backend: MatrixSet was not made by this backend's new_matrix_set()");
    if (set->uploaded_count != set->mats.size())
      fail("CUDA backend: MatrixSet changed without refresh()");
    return *set;
  }
  static int64_t n_of(const CudaMatrixSet& s) { return static_cast<int64_t>(s.mats.size()); }
  static void check_gather_shape(const CudaMatrixSet& set, const int32_t* idx, int64_t k, const MatrixView& out,
                                 const char* op) {
    if (idx == nullptr && k != set.rows()) fail(std::string(op) + ": idx == null needs k == rows");
    if (out.data && (out.rows != k || out.cols != set.cols() || out.batch != n_of(set)))
      fail(std::string(op) + ": out must be " + std::to_string(n_of(set)) + " x " + std::to_string(k) + " x " +
           std::to_string(set.cols()));
  }
  static const DeviceMat* table(const CudaMatrixSet& s) { return s.table.as<const DeviceMat>(); }

  int device_;
  cudaStream_t stream_;
  std::unique_ptr<StreamAllocator> own_alloc_;
  Allocator* alloc_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  DeviceBuffer cublas_ws_;
  Scratch scratch_, scratch_sym_;
  uint64_t recording_epoch_ = 0;
  bool recording_ = false;
  cudaStream_t capture_stream_ = nullptr;  // where record() captures (never the legacy stream)
  // upload()'s pinned staging slots, used in turn; each slot's event marks its last copy done.
  struct Staging {
    void* host = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t done = nullptr;
  };
  std::array<Staging, 8> staging_{};
  std::size_t next_staging_ = 0;
};

// A captured graph, launched on the backend's stream at each replay.
class CudaRecording final : public Recording {
 public:
  CudaRecording(CudaBackend& be, cudaGraphExec_t exec, uint64_t epoch) : be_(be), exec_(exec), epoch_(epoch) {}
  ~CudaRecording() override { cudaGraphExecDestroy(exec_); }  // an in-flight launch completes first
  bool replay() override {
    if (be_.recording_epoch() != epoch_) return false;
    DION3_CUDA_CHECK(cudaGraphLaunch(exec_, static_cast<cudaStream_t>(be_.stream())));
    return true;
  }

 private:
  CudaBackend& be_;
  cudaGraphExec_t exec_;
  uint64_t epoch_;
};

// Pinned host memory the copy lands in and an event that says when it has. The event belongs to
// the backend's device, whichever device the caller has current.
class CudaHostCopy final : public HostCopy {
 public:
  CudaHostCopy(CudaBackend& be, std::size_t bytes) : be_(be), bytes_(bytes) {
    const OnDevice on(be_.device_index());
    DION3_CUDA_CHECK(cudaHostAlloc(&host_, bytes ? bytes : 1, cudaHostAllocDefault));
    const cudaError_t e = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      cudaFreeHost(host_);
      DION3_CUDA_CHECK(e);
    }
  }
  ~CudaHostCopy() override {
    cudaEventSynchronize(done_);  // a copy in flight still writes into host_
    cudaEventDestroy(done_);
    cudaFreeHost(host_);
  }
  void start(const void* src) override {
    const OnDevice on(be_.device_index());
    const auto stream = static_cast<cudaStream_t>(be_.stream());
    DION3_CUDA_CHECK(cudaMemcpyAsync(host_, src, bytes_, cudaMemcpyDeviceToHost, stream));
    DION3_CUDA_CHECK(cudaEventRecord(done_, stream));
    started_ = true;
  }
  const void* ready() override {
    if (!started_) return nullptr;
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return nullptr;
    DION3_CUDA_CHECK(e);
    return host_;
  }
  const void* wait() override {
    if (!started_) return nullptr;
    DION3_CUDA_CHECK(cudaEventSynchronize(done_));
    return host_;
  }

 private:
  CudaBackend& be_;
  std::size_t bytes_;
  void* host_ = nullptr;
  cudaEvent_t done_ = nullptr;
  bool started_ = false;
};

std::unique_ptr<HostCopy> CudaBackend::new_host_copy(std::size_t bytes) {
  return std::make_unique<CudaHostCopy>(*this, bytes);
}

std::unique_ptr<Recording> CudaBackend::record(const std::function<void()>& work) {
  if (capturing()) return nullptr;  // inside the caller's capture the ops join the caller's graph
  if (!capture_stream_) DION3_CUDA_CHECK(cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking));
  const uint64_t epoch = recording_epoch_;  // Scratch refuses to grow (move) under a recording
  // The ops are enqueued on the capture stream: they run nowhere until a replay launches them.
  // Whatever happens, the user's stream and cuBLAS binding come back and no capture stays open.
  struct Restore {
    CudaBackend& be;
    cudaStream_t user;
    bool open = false;
    ~Restore() {
      if (open) {
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(be.capture_stream_, &g);
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();
      }
      be.recording_ = false;
      be.stream_ = user;
      // A destructor does not throw: a failure here shows at the next cuBLAS call.
      cublasSetStream(be.handle_, user);
      cublasSetWorkspace(be.handle_, be.cublas_ws_.get(), kCublasWorkspace);
    }
  } restore{*this, stream_};
  recording_ = true;
  stream_ = capture_stream_;
  bind_cublas(stream_);
  DION3_CUDA_CHECK(cudaStreamBeginCapture(capture_stream_, cudaStreamCaptureModeThreadLocal));
  restore.open = true;
  work();
  restore.open = false;
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(capture_stream_, &graph);
  if (ended != cudaSuccess || graph == nullptr) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    fail(std::string("CUDA backend: recording failed: ") + cudaGetErrorString(ended), Status::Internal);
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) {
    cudaGetLastError();
    fail(std::string("CUDA backend: instantiating a recording failed: ") + cudaGetErrorString(made), Status::Internal);
  }
  return std::make_unique<CudaRecording>(*this, exec, epoch);
}

CudaBackend& as_cuda(Backend& b) {
  auto* c = dynamic_cast<CudaBackend*>(&b);
  if (c == nullptr) fail("expected a CUDA backend, got a " + std::string(device_name(b.device())) + " one");
  return *c;
}

}  // namespace

void set_symmetric_options(Backend& backend, const SymmetricOptions& options) {
  CudaBackend& be = as_cuda(backend);
  be.sym_ = options;
  be.invalidate_recordings();  // recordings chose their kernels under the old options
}
SymmetricOptions symmetric_options(Backend& backend) { return as_cuda(backend).sym_; }
void set_product_sm_limit(Backend& backend, int sms) {
  CudaBackend& be = as_cuda(backend);
  if (sms < 0) fail("set_product_sm_limit: the multiprocessor count must be >= 0, got " + std::to_string(sms));
  be.set_sm_limit(sms);
}
int product_sm_limit(Backend& backend) { return as_cuda(backend).sm_limit_; }
void* backend_stream(Backend& backend) { return as_cuda(backend).stream(); }
int64_t symmetric_tile_for(Backend& backend, int64_t p) { return as_cuda(backend).tile_for(p); }
double symmetric_flop_fraction(Backend& backend, int64_t p) { return as_cuda(backend).flop_fraction(p); }

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(int device_index, void* stream, Allocator* allocator) {
  if (!cuda_available())
    fail("no CUDA device is available (cudaGetDeviceCount found none)", Status::Unsupported);
  int n = 0;
  cudaGetDeviceCount(&n);
  if (device_index < 0 || device_index >= n)
    fail("CUDA device index " + std::to_string(device_index) + " is out of range (devices: " + std::to_string(n) + ")");
  return std::make_unique<cuda::CudaBackend>(device_index, static_cast<cudaStream_t>(stream), allocator);
}

bool cuda_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return false;
  }
  return n > 0;
}

}  // namespace dion3
