// cpu_backend.cpp — the CPU implementation of dion3::Backend.
//
// GEMMs go through the system BLAS (cblas_sgemm / cblas_ssyrk, OpenBLAS in our builds);
// everything else is plain loops in fp32 over rows loaded and stored by cpu_numeric.hpp. The
// "device flag" of the interface is an ordinary int in host memory. Work is spread over the
// calling thread's OpenMP team as cpu_parallel.hpp describes.
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <vector>

#include "cpu/cpu_numeric.hpp"
#include "cpu/cpu_parallel.hpp"
#include "cpu/cpu_scratch.hpp"
#include "dion3/backend.hpp"
#include "dion3/error.hpp"

namespace dion3 {
namespace {

// |x| as bits that order as unsigned integers (NaN above every number): the state bounds
// (ElementwiseParam::state_bound, accumulate's `largest`) are raised by comparing these.
uint32_t bound_bits(float x) {
  x = std::fabs(x);
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
// The largest bound_bits of n floats as rounded to st.
uint32_t largest_bits(DType st, const float* x, int64_t n) {
  uint32_t a = 0;
  switch (st) {
    case DType::BF16:
      for (int64_t j = 0; j < n; ++j) a = std::max(a, bound_bits(cpu::bf16_to_float(cpu::float_to_bf16(x[j]))));
      break;
    case DType::F16:
      for (int64_t j = 0; j < n; ++j) a = std::max(a, bound_bits(cpu::f16_to_float(cpu::float_to_f16(x[j]))));
      break;
    default:
      for (int64_t j = 0; j < n; ++j) a = std::max(a, bound_bits(x[j]));
  }
  return a;
}
// Raises *bound to the float whose bits are u where that is larger; threads stepping other
// pieces of the parameter may raise it at the same time.
void raise_bound(float* bound, uint32_t u) {
  if (u == 0) return;
  float x;
  std::memcpy(&x, &u, sizeof x);
  std::atomic_ref<float> r(*bound);
  float cur = r.load(std::memory_order_relaxed);
  while (bound_bits(cur) < u && !r.compare_exchange_weak(cur, x, std::memory_order_relaxed)) {
  }
}

using cpu::load_matrix;
using cpu::load_row;
using cpu::store_matrix;
using cpu::store_row;
using Floats = cpu::Scratch<float>;
using Ints = cpu::Scratch<int32_t>;

class CpuAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) fail("out of host memory allocating " + std::to_string(bytes) + " bytes", Status::Internal);
    return p;
  }
  void deallocate(void* ptr, std::size_t) override { std::free(ptr); }
};

// Element-wise work goes through cache-sized column chunks.
constexpr int64_t kChunk = 4096;

// Columns [c0, c0 + kChunk) of a view (fewer at the end).
MatrixView cols_slice(const MatrixView& v, int64_t c0) {
  MatrixView s = v;
  s.data = static_cast<char*>(v.data) + static_cast<std::size_t>(c0) * v.elem_bytes();
  s.cols = std::min(kChunk, v.cols - c0);
  return s;
}

bool all_f32(std::initializer_list<MatrixView> views) {
  for (const MatrixView& v : views)
    if (v.dtype != DType::F32) return false;
  return true;
}
float* f32(const MatrixView& v) { return static_cast<float*>(v.data); }

bool skipped(const int* skip) { return skip && *skip != 0; }

void check(bool ok, const char* what) {
  if (!ok) fail(std::string("CPU backend: ") + what, Status::Internal);
}

// A view's matrix b as a dense fp32 pointer with its leading dimension: the memory itself
// when the view already is fp32, else a converted copy in `scratch`.
struct F32Operand {
  const float* ptr;
  int64_t ld;
};
F32Operand as_f32(const MatrixView& v, int64_t b, Floats& scratch) {
  if (v.dtype == DType::F32)
    return {reinterpret_cast<const float*>(cpu::elem_ptr(v, b, 0)), v.ld};
  load_matrix(v, b, scratch);
  return {scratch.data(), v.cols};
}
// Matrix b of an fp32 view, read or written in place.
F32Operand in_place(const MatrixView& v, int64_t b) {
  return {reinterpret_cast<const float*>(cpu::elem_ptr(v, b, 0)), v.ld};
}
float* rows_of(const MatrixView& v, int64_t b) {
  return reinterpret_cast<float*>(const_cast<char*>(cpu::elem_ptr(v, b, 0)));
}

// out has in's shape, or (transpose) in's shape transposed, and as many matrices.
void check_shapes(const MatrixView& in, const MatrixView& out, bool transpose, const char* what) {
  check(in.batch == out.batch && (transpose ? in.rows == out.cols && in.cols == out.rows
                                            : in.rows == out.rows && in.cols == out.cols),
        what);
}

// A dense rows x cols matrix in x and its transpose in t, for normalize and convert.
struct DenseBuffers {
  Floats x, t;
};
// x = x^T (x dense rows x cols), through t.
void transpose_into(DenseBuffers& buf, int64_t rows, int64_t cols) {
  buf.t.resize(buf.x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) buf.t[c * rows + r] = buf.x[r * cols + c];
  buf.x.swap(buf.t);
}

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::CPU; }
  Allocator& allocator() override { return alloc_; }
  void begin_step() override { pool_.begin_step(); }
  void end_step() noexcept override { pool_.end_step(); }

  void fill_zero(void* ptr, std::size_t bytes) override { std::memset(ptr, 0, bytes); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) override { std::memmove(dst, src, bytes); }
  void copy_2d(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
               std::size_t height) override {
    for (std::size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
  }
  int read_flag(const int* flag) override { return *flag; }
  // Steps finish inside the call on the CPU, so the copy has arrived when start() returns.
  std::unique_ptr<HostCopy> new_host_copy(std::size_t bytes) override {
    struct Copy final : HostCopy {
      std::vector<unsigned char> buf;
      bool started = false;
      void start(const void* src) override {
        std::memcpy(buf.data(), src, buf.size());
        started = true;
      }
      const void* ready() override { return started ? buf.data() : nullptr; }
      const void* wait() override { return ready(); }
    };
    auto c = std::make_unique<Copy>();
    c->buf.resize(bytes);
    return c;
  }
  void finish_step(const int* flag, int64_t* counters, bool count_dropped) override {
    if (!*flag) ++counters[0];
    else if (count_dropped && !(*flag & kNotAStep)) ++counters[1];
  }
  void settle_agreement(int* words, int regions) override { settle_agreement_words(words, regions); }

  void check_finite(std::span<const MatrixView> xs, int* flag) override {
    // fp32 rows are tested in place: exponent bits all ones means Inf or NaN (vectorizes).
    auto row_finite_f32 = [](const float* p, int64_t n) {
      uint32_t bad = 0;
      for (int64_t j = 0; j < n; ++j) {
        uint32_t b;
        std::memcpy(&b, p + j, 4);
        bad |= static_cast<uint32_t>((b & 0x7f800000u) == 0x7f800000u);
      }
      return bad == 0;
    };
    std::vector<std::pair<const MatrixView*, cpu::Piece>> items;
    for (const MatrixView& v : xs)
      for (const cpu::Piece& q : cpu::pieces(v.batch, v.rows, v.cols, kChunk)) items.emplace_back(&v, q);
    std::atomic<bool> bad{false};
    int64_t elems = 0;
    for (const MatrixView& v : xs) elems += elements_of(v);
    cpu::parallel_for(static_cast<int64_t>(items.size()), elems, [] { return std::vector<float>(kChunk); },
                      [&](std::vector<float>& buf, int64_t i) {
      const MatrixView& v = *items[i].first;
      const cpu::Piece& q = items[i].second;
      for (int64_t r = q.r0; r < q.r1 && !bad.load(std::memory_order_relaxed); ++r) {
        if (v.dtype == DType::F32) {
          if (!row_finite_f32(reinterpret_cast<const float*>(cpu::elem_ptr(v, q.b, r)) + q.c0, q.c1 - q.c0))
            bad = true;
          continue;
        }
        for (int64_t c0 = q.c0; c0 < q.c1; c0 += kChunk) {
          const MatrixView part = cols_slice(v, c0);
          load_row(part, q.b, r, buf.data());
          for (int64_t j = 0; j < part.cols; ++j)
            if (!std::isfinite(buf[j])) bad = true;
        }
      }
    });
    if (bad) *flag |= 1;
  }

  void check_step(std::span<const StepCheck> xs, int* flag) override {
    std::vector<std::pair<const StepCheck*, cpu::Piece>> items;
    for (const StepCheck& x : xs)
      for (const cpu::Piece& q : cpu::pieces(1, 1, x.grad.cols, kChunk)) items.emplace_back(&x, q);
    struct Buffers {
      std::vector<float> g = std::vector<float>(kChunk), m = std::vector<float>(kChunk), v = std::vector<float>(kChunk);
    };
    std::atomic<bool> bad{false};
    int64_t elems = 0;
    for (const StepCheck& x : xs) elems += elements_of(x.grad);
    cpu::parallel_for(static_cast<int64_t>(items.size()), elems, [] { return Buffers{}; }, [&](Buffers& buf, int64_t i) {
      const StepCheck& x = *items[i].first;
      std::vector<float>&g = buf.g, &m = buf.m, &v = buf.v;
      for (int64_t c0 = items[i].second.c0; c0 < items[i].second.c1 && !bad.load(std::memory_order_relaxed);
           c0 += kChunk) {
        const MatrixView G = cols_slice(x.grad, c0), S = cols_slice(x.state, c0);
        load_row(G, 0, 0, g.data());
        bool ok = true;
        const DType st = x.state.dtype;
        const float a = x.a.get(), b = x.b.get(), gc = x.c.get();
        if (x.state_bound) {  // the gradient alone may settle it
          const float limit = state_gradient_limit(x.rule, x.state_bound, a, b, largest_finite(st));
          bool small = true;
          for (int64_t j = 0; j < G.cols; ++j) small &= std::fabs(g[j]) <= limit;
          if (small) continue;
        }
        load_row(S, 0, 0, m.data());
        switch (x.rule) {
          case StepCheck::Momentum:
            for (int64_t j = 0; j < G.cols; ++j) {
              const float m1 = cpu::round_to(st, a * m[j] + gc * g[j]);
              ok &= std::isfinite(g[j]) && std::isfinite(m1) && (b == 0.0f || std::isfinite(b * m1 + gc * g[j]));
            }
            break;
          case StepCheck::AdamW:
            load_row(cols_slice(x.state2, c0), 0, 0, v.data());
            for (int64_t j = 0; j < G.cols; ++j) {
              // >= 0 before rounding: the update takes the square root of that value.
              const float v1 = AdamWRule::exp_avg_sq(v[j], g[j], b);
              ok &= std::isfinite(g[j]) && std::isfinite(cpu::round_to(st, AdamWRule::exp_avg(m[j], g[j], a))) &&
                    std::isfinite(cpu::round_to(st, v1)) && v1 >= 0.0f;
            }
            break;
          case StepCheck::Lion:
            for (int64_t j = 0; j < G.cols; ++j)
              ok &= std::isfinite(g[j]) && std::isfinite(cpu::round_to(st, LionRule::exp_avg(m[j], g[j], b)));
            break;
        }
        if (!ok) bad = true;
      }
    });
    if (bad) *flag |= 1;
  }

  void accumulate(const MatrixSet& set, Hyper decay_h, Hyper grad_scale, float* scores, float* row_sumsq,
                  float* largest, const int* skip) override {
    if (skipped(skip)) return;
    if (set.columns) return accumulate_columns(set, decay_h.get(), grad_scale.get(), scores, row_sumsq, largest);
    const float decay = decay_h.get(), gs = grad_scale.get();
    const int64_t rows = set.rows(), block = cpu::row_block(set.cols()), blocks = (rows + block - 1) / block;
    struct Buffers {
      Floats m, g;
    };
    cpu::parallel_for(static_cast<int64_t>(set.mats.size()) * blocks, elements_of(set),
                      [this] { return Buffers{floats(), floats()}; }, [&](Buffers& buf, int64_t item) {
      const int64_t i = item / blocks, r0 = item % blocks * block;
      const ParamMatrix& p = set.mats[i];
      Floats &m = buf.m, &g = buf.g;
      m.resize(p.momentum.cols);
      g.resize(p.grad.cols);
      uint32_t most = 0;  // bound_bits of the largest |M| element stored
      for (int64_t r = r0; r < std::min(rows, r0 + block); ++r) {
        load_row(p.momentum, 0, r, m.data());
        load_row(p.grad, 0, r, g.data());
        for (int64_t j = 0; j < p.momentum.cols; ++j) m[j] = decay * m[j] + gs * g[j];
        store_row(p.momentum, 0, r, m.data());
        if (largest) most = std::max(most, largest_bits(p.momentum.dtype, m.data(), p.momentum.cols));
        if (!scores && !row_sumsq) continue;  // Muon's and NorMuon's momentum: no sums
        // Score what is stored: the rounded momentum, as a device kernel reading M back would.
        double l1 = 0.0, sq = 0.0;
        for (int64_t j = 0; j < p.momentum.cols; ++j) {
          const double v = cpu::round_to(p.momentum.dtype, m[j]);
          l1 += std::fabs(v);
          sq += v * v;
        }
        if (scores) scores[i * rows + r] = static_cast<float>(l1);
        if (row_sumsq) row_sumsq[i * rows + r] = static_cast<float>(sq);
      }
      if (largest) raise_bound(largest + i, most);
    });
  }

  void select_rows(const float* scores, int64_t count, int64_t m, int64_t k, int32_t* idx,
                   const int* skip, float* largest, const float* row_sumsq, float* selected_sumsq) override {
    if (skipped(skip)) return;
    check(k >= 1 && k <= m, "select_rows needs 1 <= k <= m");
    check(!row_sumsq || selected_sumsq, "select_rows: row_sumsq without selected_sumsq");
    // Work: a selection and a sort cost some tens of operations per score.
    cpu::parallel_for(count, count * m * 32, [this, m] { return ints(m); }, [&](Ints& order, int64_t i) {
      const float* s = scores + i * m;
      if (largest) largest[i] = *std::max_element(s, s + m) + 1.0f;
      std::iota(order.begin(), order.end(), 0);
      // Larger score first; equal scores: lower row index first (algorithm.md §1 tie rule).
      auto better = [s](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
      std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), better);
      std::sort(order.begin(), order.begin() + k);
      std::copy(order.begin(), order.begin() + k, idx + i * k);
      if (row_sumsq) {
        double ss = 0.0;  // in ascending row order
        for (int64_t j = 0; j < k; ++j) ss += row_sumsq[i * m + order[j]];
        selected_sumsq[i] = static_cast<float>(ss);
      }
    });
  }

  void copy_rows(void* dst, std::size_t dst_pitch, const int32_t* dst_idx, const void* src, std::size_t src_pitch,
                 const int32_t* src_idx, std::size_t width, int64_t rows) override {
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(static_cast<char*>(dst) + (dst_idx ? dst_idx[i] : i) * dst_pitch,
                  static_cast<const char*>(src) + (src_idx ? src_idx[i] : i) * src_pitch, width);
  }

  void selection_slots(const int32_t* idx, int64_t count, int64_t k, int64_t c, int64_t piece, int64_t block,
                       int64_t first_slot, int32_t* out, const int* skip) override {
    if (skipped(skip)) return;
    for (int64_t i = 0; i < count; ++i) {
      const int32_t* g = idx + i * k;
      int64_t start = 0, shard = -1;
      for (int64_t t = 0; t < k; ++t) {
        const int64_t s = g[t] / c;
        if (s != shard) shard = s, start = t;
        out[i * k + t] = static_cast<int32_t>((s * block + first_slot + i) * piece + t - start);
      }
    }
  }

  void remap_rows(const int32_t* in, int64_t count, int64_t k_in, int64_t lo, int64_t hi, int64_t k_out,
                  int32_t* out, const int* skip) override {
    if (skipped(skip)) return;
    for (int64_t i = 0; i < count; ++i) {
      int64_t n = 0;
      for (int64_t j = 0; j < k_in; ++j) {
        const int64_t e = in[i * k_in + j];
        if (e >= lo && e < hi && n < k_out) out[i * k_out + n++] = static_cast<int32_t>(e - lo);
      }
      for (; n < k_out; ++n) out[i * k_out + n] = kPadRow;
    }
  }

  void gather_rows(const MatrixSet& set, const int32_t* idx, int64_t k, Hyper scale_m_h, Hyper scale_g_h,
                   Hyper decay_h, MatrixView out, float* row_sumsq, const int* skip) override {
    if (skipped(skip)) return;
    const float scale_m = scale_m_h.get(), scale_g = scale_g_h.get(), decay = decay_h.get();
    const int64_t rows = set.rows(), cols = set.cols();
    check(!out.data || (out.rows == k && out.cols == cols && out.batch == static_cast<int64_t>(set.mats.size())),
          "gather_rows output shape");
    if (set.columns) return gather_columns(set, idx, k, scale_m, scale_g, decay, nullptr, out, row_sumsq);
    const int64_t block = cpu::row_block(cols), blocks = (k + block - 1) / block;
    struct Buffers {
      Floats m, g, u;
    };
    const auto buffers = [this, cols] { return Buffers{floats(cols), floats(cols), floats(cols)}; };
    cpu::parallel_for(static_cast<int64_t>(set.mats.size()) * blocks, static_cast<int64_t>(set.mats.size()) * k * cols,
                      buffers, [&](Buffers& buf, int64_t item) {
      const int64_t i = item / blocks, j0 = item % blocks * block;
      const ParamMatrix& p = set.mats[i];
      Floats &m = buf.m, &g = buf.g, &u = buf.u;
      for (int64_t j = j0; j < std::min(k, j0 + block); ++j) {
        const int64_t r = idx ? idx[i * k + j] : j;
        if (r >= rows) {  // padding
          if (out.data) {
            std::fill(u.begin(), u.end(), 0.0f);
            store_row(out, i, j, u.data());
          }
          if (row_sumsq) row_sumsq[i * k + j] = 0.0f;
          continue;
        }
        load_row(p.momentum, 0, r, m.data());
        if (scale_g != 0.0f) load_row(p.grad, 0, r, g.data());
        for (int64_t c = 0; c < cols; ++c) u[c] = scale_m * m[c] + (scale_g != 0.0f ? scale_g * g[c] : 0.0f);
        if (out.data) store_row(out, i, j, u.data());
        if (row_sumsq && out.data) {  // of the values as stored
          double ss = 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            const double v = cpu::round_to(out.dtype, u[c]);
            ss += v * v;
          }
          row_sumsq[i * k + j] = static_cast<float>(ss);
        }
        if (decay != 1.0f) {
          for (int64_t c = 0; c < cols; ++c) m[c] *= decay;
          store_row(p.momentum, 0, r, m.data());
        }
      }
    });
  }

  void gather_normalized(const MatrixSet& set, const int32_t* idx, int64_t k, Hyper decay_h,
                         const float* selected_sumsq, NormGuard norm, MatrixView out, const int* skip) override {
    if (skipped(skip)) return;
    const float decay = decay_h.get();
    const int64_t rows = set.rows(), cols = set.cols();
    check(out.rows == k && out.cols == cols && out.batch == static_cast<int64_t>(set.mats.size()),
          "gather_normalized output shape");
    const int64_t count = static_cast<int64_t>(set.mats.size());
    Floats invs = floats(count);
    for (int64_t i = 0; i < count; ++i)  // multiplied, as normalize does
      invs[i] = static_cast<float>(inverse_norm_of(std::sqrt(static_cast<double>(selected_sumsq[i])), norm));
    if (set.columns) return gather_columns(set, idx, k, 1.0f, 0.0f, decay, invs.data(), out, nullptr);
    const int64_t block = cpu::row_block(cols), blocks = (k + block - 1) / block;
    struct Buffers {
      Floats m, x;
    };
    const auto buffers = [this, cols] { return Buffers{floats(cols), floats(cols)}; };
    cpu::parallel_for(count * blocks, count * k * cols, buffers, [&](Buffers& buf, int64_t item) {
      const int64_t i = item / blocks, j0 = item % blocks * block;
      const ParamMatrix& p = set.mats[i];
      const float inv = invs[i];
      Floats &m = buf.m, &x = buf.x;
      for (int64_t j = j0; j < std::min(k, j0 + block); ++j) {
        const int64_t r = idx ? idx[i * k + j] : j;
        if (r >= rows) {  // padding
          std::fill(x.begin(), x.end(), 0.0f);
          store_row(out, i, j, x.data());
          continue;
        }
        load_row(p.momentum, 0, r, m.data());
        for (int64_t c = 0; c < cols; ++c) x[c] = m[c] * inv;
        store_row(out, i, j, x.data());
        if (decay != 1.0f) {
          for (float& v : m) v *= decay;
          store_row(p.momentum, 0, r, m.data());
        }
      }
    });
  }

  void apply_update(const MatrixSet& set, const int32_t* idx, int64_t k, MatrixView O,
                    const UpdateParams& p, const int* skip) override {
    if (skipped(skip)) return;
    const int64_t rows = set.rows(), cols = set.cols();
    check(O.rows == k && O.cols >= p.o_col_offset + cols, "apply_update update shape");
    if (set.columns) return apply_columns(set, idx, k, O, p);
    const int64_t ocols = O.cols, count = static_cast<int64_t>(set.mats.size());
    const float decay = p.decay.get(), adjusted_lr = p.adjusted_lr.get(), beta2 = p.beta2.get();
    // Per matrix first: the row of O that updates each weight row (-1: none) and NorMuon's
    // factors on O's rows; then the weight rows, in blocks.
    Ints target = ints(static_cast<std::size_t>(count * rows), -1);
    Floats row_factor = floats(p.normuon ? count * k : 0), factor = floats(count, 1.0f);
    cpu::parallel_for(count, count * k * (p.normuon ? ocols : 1), [this] { return floats(); }, [&](Floats& o, int64_t i) {
      const int32_t* sel = idx ? idx + i * k : nullptr;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = sel ? sel[j] : j;
        if (r < rows) target[i * rows + r] = static_cast<int32_t>(j);
      }
      if (p.normuon) {
        load_matrix(O, i, o);
        factor[i] = normuon_factors(o.data(), k, rows, ocols, set.mats[i].variance, sel, beta2, &row_factor[i * k]);
      }
    });
    MatrixView U = O;  // the columns of O this set takes
    U.data = static_cast<char*>(O.data) + static_cast<std::size_t>(p.o_col_offset) * O.elem_bytes();
    U.cols = cols;
    const int64_t block = cpu::row_block(cols), blocks = (rows + block - 1) / block;
    struct Buffers {
      Floats u, w;
    };
    const auto buffers = [this, cols] { return Buffers{floats(cols), floats(cols)}; };
    cpu::parallel_for(count * blocks, count * rows * cols, buffers, [&](Buffers& buf, int64_t item) {
      const int64_t i = item / blocks, r0 = item % blocks * block;
      const ParamMatrix& pm = set.mats[i];
      Floats &u = buf.u, &w = buf.w;
      for (int64_t r = r0; r < std::min(rows, r0 + block); ++r) {
        const int64_t j = target[i * rows + r];
        if (j < 0 && decay == 1.0f) continue;
        if (j >= 0) {
          load_row(U, i, j, u.data());
          if (p.normuon)
            for (int64_t c = 0; c < cols; ++c) u[c] = u[c] * row_factor[i * k + j] * factor[i];
        }
        load_row(pm.weight, 0, r, w.data());
        for (int64_t c = 0; c < cols; ++c) {
          const float uc = j >= 0 ? u[c] : 0.0f;
          float d = decay;
          if (p.cautious_wd && !(uc * w[c] > 0.0f)) d = 1.0f;
          w[c] = w[c] * d - adjusted_lr * uc;
        }
        store_row(pm.weight, 0, r, w.data());
      }
    });
  }

  void normalize(MatrixView in, MatrixView out, NormGuard norm, const float* row_sumsq, bool transpose) override {
    check_shapes(in, out, transpose, "normalize shapes");
    cpu::parallel_for(in.batch, elements_of(in), [this] { return DenseBuffers{floats(), floats()}; }, [&](DenseBuffers& buf, int64_t b) {
      Floats& x = buf.x;
      load_matrix(in, b, x);
      double ss = 0.0;
      if (row_sumsq)
        for (int64_t r = 0; r < in.rows; ++r) ss += row_sumsq[b * in.rows + r];
      else
        for (float v : x) ss += static_cast<double>(v) * v;
      const float inv = static_cast<float>(inverse_norm_of(std::sqrt(ss), norm));
      for (float& v : x) v *= inv;
      if (transpose) transpose_into(buf, in.rows, in.cols);
      store_matrix(out, b, x.data());
    });
  }

  void convert(MatrixView in, MatrixView out, bool transpose) override {
    check_shapes(in, out, transpose, "convert shapes");
    cpu::parallel_for(in.batch, elements_of(in), [this] { return DenseBuffers{floats(), floats()}; }, [&](DenseBuffers& buf, int64_t b) {
      load_matrix(in, b, buf.x);
      if (transpose) transpose_into(buf, in.rows, in.cols);
      store_matrix(out, b, buf.x.data());
    });
  }

  void gemm(bool trans_a, bool trans_b, float alpha, MatrixView A, MatrixView B, float beta,
            MatrixView C) override {
    const int64_t M = C.rows, N = C.cols;
    const int64_t K = trans_a ? A.rows : A.cols;
    check((trans_a ? A.cols : A.rows) == M && (trans_b ? B.rows : B.cols) == N &&
              (trans_b ? B.cols : B.rows) == K && A.batch == C.batch && B.batch == C.batch,
          "gemm shapes");
    // Tiles of rows of C, one BLAS call each (cpu_parallel.hpp).
    const int64_t rows = cpu::tile_rows(M, N * K), tiles = (M + rows - 1) / rows;
    auto tile = [&](F32Operand a, F32Operand bb, float* c, int64_t ldc, int64_t t) {
      const int64_t r0 = t * rows;
      cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                  std::min(rows, M - r0), N, K, alpha, a.ptr + (trans_a ? r0 : r0 * a.ld), a.ld, bb.ptr, bb.ld, beta,
                  c + r0 * ldc, ldc);
    };
    cpu::BlasSerial serial;
    const int64_t work = C.batch * M * N * K;
    if (all_f32({A, B, C}) && A.data != C.data && B.data != C.data) {  // in place
      cpu::parallel_for(C.batch * tiles, work, cpu::no_state, [&](cpu::NoState&, int64_t i) {
        const int64_t b = i / tiles;
        tile(in_place(A, b), in_place(B, b), rows_of(C, b), C.ld, i % tiles);
      });
      return;
    }
    struct Buffers {
      Floats a, b, c;
    };
    cpu::parallel_for(C.batch, work, [this] { return Buffers{floats(), floats(), floats()}; }, [&](Buffers& buf, int64_t b) {
      const F32Operand a = as_f32(A, b, buf.a), bb = as_f32(B, b, buf.b);
      if (beta != 0.0f) load_matrix(C, b, buf.c);
      else buf.c.assign(static_cast<std::size_t>(M * N), 0.0f);
      for (int64_t t = 0; t < tiles; ++t) tile(a, bb, buf.c.data(), N, t);
      store_matrix(C, b, buf.c.data());
    });
  }

  void gram(MatrixView X, MatrixView C, bool /*banded_out: always full here*/) override {
    const int64_t p = X.rows, q = X.cols;
    check(C.rows == p && C.cols == p && C.batch == X.batch, "gram shapes");
    // Tiles of rows of the lower triangle: the block left of the diagonal a GEMM, the diagonal
    // block a SYRK; then the upper triangle mirrored, by the same tiles.
    const int64_t rows = cpu::tile_rows(p, (p + 1) / 2 * q), tiles = (p + rows - 1) / rows;
    auto tile = [&](F32Operand x, float* c, int64_t ldc, int64_t t) {
      const int64_t r0 = t * rows, m = std::min(rows, p - r0);
      if (r0 > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, r0, q, 1.0f, x.ptr + r0 * x.ld, x.ld, x.ptr, x.ld, 0.0f,
                    c + r0 * ldc, ldc);
      cblas_ssyrk(CblasRowMajor, CblasLower, CblasNoTrans, m, q, 1.0f, x.ptr + r0 * x.ld, x.ld, 0.0f,
                  c + r0 * ldc + r0, ldc);
    };
    cpu::BlasSerial serial;
    const int64_t work = X.batch * p * (p + 1) / 2 * q;
    if (all_f32({X, C}) && X.data != C.data) {  // in place
      cpu::parallel_for(X.batch * tiles, work, cpu::no_state, [&](cpu::NoState&, int64_t i) {
        tile(in_place(X, i / tiles), rows_of(C, i / tiles), C.ld, i % tiles);
      });
      cpu::parallel_for(X.batch * tiles, X.batch * p * p, cpu::no_state, [&](cpu::NoState&, int64_t i) {
        const int64_t r0 = i % tiles * rows;
        mirror_rows(rows_of(C, i / tiles), C.ld, p, r0, std::min(p, r0 + rows));
      });
      return;
    }
    struct Buffers {
      Floats x, c;
    };
    cpu::parallel_for(X.batch, work, [this] { return Buffers{floats(), floats()}; }, [&](Buffers& buf, int64_t b) {
      const F32Operand x = as_f32(X, b, buf.x);
      buf.c.resize(static_cast<std::size_t>(p * p));
      for (int64_t t = 0; t < tiles; ++t) tile(x, buf.c.data(), p, t);
      mirror_rows(buf.c.data(), p, p, 0, p);
      store_matrix(C, b, buf.c.data());
    });
  }

  void sym_product(float alpha, MatrixView A, MatrixView B, float beta, const MatrixView* D, float gamma,
                   MatrixView C, bool banded_in, bool /*banded_out: always full here*/) override {
    const int64_t p = C.rows;
    check(!banded_in, "sym_product: banded operands (this backend never makes them)");
    check(A.rows == p && A.cols == p && B.rows == p && B.cols == p && C.cols == p, "sym_product shapes");
    const bool with_d = D && beta != 0.0f;
    // Tiles of columns of A*B^T, one GEMM call each (B need not be symmetric), which also add
    // beta*D + gamma*I to their part of the lower triangle; then the upper triangle mirrored from
    // it (rounding in A*B^T can break exact symmetry: the lower triangle is kept, as the GPU's
    // symmetric kernels do).
    const int64_t cols = cpu::tile_rows(p, p * p), tiles = (p + cols - 1) / cols;
    auto tile = [&](F32Operand a, F32Operand bb, const F32Operand* d, float* t, int64_t ldt, int64_t i) {
      const int64_t c0 = i * cols, c1 = std::min(p, c0 + cols);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p, c1 - c0, p, alpha, a.ptr, a.ld, bb.ptr + c0 * bb.ld,
                  bb.ld, 0.0f, t + c0, ldt);
      for (int64_t r = c0; r < p; ++r) {
        float* row = t + r * ldt;
        if (d)
          for (int64_t s = c0; s < std::min(c1, r + 1); ++s) row[s] += beta * d->ptr[r * d->ld + s];
        if (r < c1) row[r] += gamma;
      }
    };
    cpu::BlasSerial serial;
    const int64_t work = C.batch * p * p * p;
    if (all_f32({A, B, C}) && (!with_d || (D->dtype == DType::F32 && D->data != C.data)) && A.data != C.data &&
        B.data != C.data) {  // in place
      cpu::parallel_for(C.batch * tiles, work, cpu::no_state, [&](cpu::NoState&, int64_t i) {
        const int64_t b = i / tiles;
        const F32Operand d = with_d ? in_place(*D, b) : F32Operand{};
        tile(in_place(A, b), in_place(B, b), with_d ? &d : nullptr, rows_of(C, b), C.ld, i % tiles);
      });
      cpu::parallel_for(C.batch * tiles, C.batch * p * p, cpu::no_state, [&](cpu::NoState&, int64_t i) {
        const int64_t r0 = i % tiles * cols;
        mirror_rows(rows_of(C, i / tiles), C.ld, p, r0, std::min(p, r0 + cols));
      });
      return;
    }
    struct Buffers {
      Floats a, b, d, t;
    };
    cpu::parallel_for(C.batch, work, [this] { return Buffers{floats(), floats(), floats(), floats()}; },
                      [&](Buffers& buf, int64_t b) {
      const F32Operand a = as_f32(A, b, buf.a), bb = as_f32(B, b, buf.b);
      const F32Operand d = with_d ? as_f32(*D, b, buf.d) : F32Operand{};
      buf.t.resize(static_cast<std::size_t>(p * p));
      for (int64_t i = 0; i < tiles; ++i) tile(a, bb, with_d ? &d : nullptr, buf.t.data(), p, i);
      mirror_rows(buf.t.data(), p, p, 0, p);
      store_matrix(C, b, buf.t.data());
    });
  }

  void add_identity(MatrixView X, float gamma, MatrixView C) override {
    check(X.rows == X.cols && C.rows == X.rows && C.cols == X.cols && C.batch == X.batch, "add_identity shapes");
    cpu::parallel_for(X.batch, elements_of(X), [this] { return floats(); }, [&](Floats& x, int64_t b) {
      load_matrix(X, b, x);
      for (int64_t r = 0; r < X.rows; ++r) x[r * X.cols + r] += gamma;
      store_matrix(C, b, x.data());
    });
  }

  DType default_iteration_dtype(bool) const override { return DType::F32; }

  void adamw(std::span<const ElementwiseParam> ps, std::span<const AdamWParams> hs, const int* skip) override {
    check(ps.size() == hs.size(), "adamw: one set of hyperparameters per parameter");
    check_elementwise_params(ps, true, "adamw");
    if (skipped(skip)) return;
    const auto items = elementwise_pieces(ps);
    cpu::parallel_for(static_cast<int64_t>(items.size()), elementwise_size(ps), [this] { return chunk_buffers(); },
                      [&](ChunkBuffers& buf, int64_t i) {
      adamw_one(ps[items[i].first], hs[items[i].first], items[i].second.c0, items[i].second.c1, buf);
    });
  }

  void lion(std::span<const ElementwiseParam> ps, std::span<const LionParams> hs, const int* skip) override {
    check(ps.size() == hs.size(), "lion: one set of hyperparameters per parameter");
    check_elementwise_params(ps, false, "lion");
    if (skipped(skip)) return;
    const auto items = elementwise_pieces(ps);
    cpu::parallel_for(static_cast<int64_t>(items.size()), elementwise_size(ps), [this] { return chunk_buffers(); },
                      [&](ChunkBuffers& buf, int64_t i) {
      lion_one(ps[items[i].first], hs[items[i].first], items[i].second.c0, items[i].second.c1, buf);
    });
  }

 private:
  // Column-stepped sets (MatrixSet::columns): the row of the set is the stored column. Each pass
  // streams a stored matrix a row at a time (read, worked on, written back), so that it moves
  // along memory once; what a stored row gives each selected column is kept in a selected x
  // stored-rows buffer, which the walk down the rows fills a column at a time.

  void accumulate_columns(const MatrixSet& set, float decay, float gs, float* scores, float* row_sumsq,
                          float* largest) {
    const int64_t n = set.rows();  // stored columns
    struct Buffers {
      Floats m, g;
      cpu::Scratch<double> l1, sq;
    };
    cpu::parallel_for(static_cast<int64_t>(set.mats.size()), elements_of(set),
                      [this] { return Buffers{floats(), floats(), doubles(), doubles()}; },
                      [&](Buffers& buf, int64_t i) {
      const ParamMatrix& p = set.mats[i];
      buf.m.resize(n);
      buf.g.resize(n);
      buf.l1.assign(n, 0.0);
      buf.sq.assign(n, 0.0);
      uint32_t most = 0;  // bound_bits of the largest |M| element stored
      for (int64_t r = 0; r < p.momentum.rows; ++r) {
        load_row(p.momentum, 0, r, buf.m.data());
        load_row(p.grad, 0, r, buf.g.data());
        for (int64_t c = 0; c < n; ++c) buf.m[c] = decay * buf.m[c] + gs * buf.g[c];
        store_row(p.momentum, 0, r, buf.m.data());
        if (largest) most = std::max(most, largest_bits(p.momentum.dtype, buf.m.data(), n));
        if (!scores && !row_sumsq) continue;  // NorMuon's momentum: no sums
        for (int64_t c = 0; c < n; ++c) {  // of the values as stored, summed in row order
          const double v = cpu::round_to(p.momentum.dtype, buf.m[c]);
          buf.l1[c] += std::fabs(v);
          buf.sq[c] += v * v;
        }
      }
      for (int64_t c = 0; c < n; ++c) {
        if (scores) scores[i * n + c] = static_cast<float>(buf.l1[c]);
        if (row_sumsq) row_sumsq[i * n + c] = static_cast<float>(buf.sq[c]);
      }
      if (largest) raise_bound(largest + i, most);
    });
  }

  // inv, if not null: each matrix's gathered columns times inv[i] (gather_normalized).
  void gather_columns(const MatrixSet& set, const int32_t* idx, int64_t k, float scale_m, float scale_g, float decay,
                      const float* inv, MatrixView out, float* row_sumsq) {
    const int64_t n = set.rows(), m = set.cols();
    struct Buffers {
      Floats m, g, u;
    };
    cpu::parallel_for(static_cast<int64_t>(set.mats.size()), elements_of(set),
                      [this] { return Buffers{floats(), floats(), floats()}; },
                      [&](Buffers& buf, int64_t i) {
      const ParamMatrix& p = set.mats[i];
      const int32_t* sel = idx ? idx + i * k : nullptr;
      buf.m.resize(n);
      buf.g.resize(n);
      buf.u.assign(static_cast<std::size_t>(k * m), 0.0f);  // padding entries stay zero rows
      for (int64_t r = 0; r < m; ++r) {
        load_row(p.momentum, 0, r, buf.m.data());
        if (scale_g != 0.0f) load_row(p.grad, 0, r, buf.g.data());
        for (int64_t s = 0; s < k; ++s) {  // a selection names each column once
          const int64_t c = sel ? sel[s] : s;
          if (c >= n) continue;
          float& u = buf.u[s * m + r];
          u = scale_m * buf.m[c] + (scale_g != 0.0f ? scale_g * buf.g[c] : 0.0f);
          if (inv) u *= inv[i];
          if (decay != 1.0f) buf.m[c] *= decay;
        }
        if (decay != 1.0f) store_row(p.momentum, 0, r, buf.m.data());
      }
      for (int64_t s = 0; s < k; ++s) {
        const float* u = buf.u.data() + s * m;
        if (out.data) store_row(out, i, s, u);
        if (row_sumsq && out.data) {
          double ss = 0.0;
          for (int64_t r = 0; r < m; ++r)
            ss += static_cast<double>(cpu::round_to(out.dtype, u[r])) * cpu::round_to(out.dtype, u[r]);
          row_sumsq[i * k + s] = static_cast<float>(ss);
        }
      }
    });
  }

  void apply_columns(const MatrixSet& set, const int32_t* idx, int64_t k, const MatrixView& O, const UpdateParams& p) {
    const int64_t n = set.rows(), m = set.cols();
    const float decay = p.decay.get(), adjusted_lr = p.adjusted_lr.get(), beta2 = p.beta2.get();
    struct Buffers {
      Floats w, o, row_factor;
      Ints target;
    };
    cpu::parallel_for(static_cast<int64_t>(set.mats.size()), elements_of(set),
                      [this] { return Buffers{floats(), floats(), floats(), ints()}; },
                      [&](Buffers& buf, int64_t i) {
      const ParamMatrix& pm = set.mats[i];
      buf.target.assign(n, -1);  // the row of O that updates each stored column
      for (int64_t s = 0; s < k; ++s) {
        const int64_t c = idx ? idx[i * k + s] : s;
        if (c < n) buf.target[c] = static_cast<int32_t>(s);
      }
      load_matrix(O, i, buf.o);  // k x O.cols, whole rows; columns [o_col_offset, + m) are this set's
      float f = 1.0f;  // NorMuon's factors on O's rows, the selected columns' updates
      if (p.normuon) {
        buf.row_factor.resize(k);
        f = normuon_factors(buf.o.data(), k, n, O.cols, pm.variance, idx ? idx + i * k : nullptr, beta2,
                            buf.row_factor.data());
      }
      buf.w.resize(n);
      for (int64_t r = 0; r < m; ++r) {
        load_row(pm.weight, 0, r, buf.w.data());
        for (int64_t c = 0; c < n; ++c) {
          const int32_t s = buf.target[c];
          float uc = s >= 0 ? buf.o[s * O.cols + p.o_col_offset + r] : 0.0f;
          if (s >= 0 && p.normuon) uc = uc * buf.row_factor[s] * f;
          float& w = buf.w[c];
          float d = decay;
          if (p.cautious_wd && !(uc * w > 0.0f)) d = 1.0f;
          w = w * d - adjusted_lr * uc;
        }
        store_row(pm.weight, 0, r, buf.w.data());
      }
    });
  }

  // The elements of a view, of all a set's matrices, and of element-wise parameters: the work of a pass.
  static int64_t elements_of(const MatrixView& v) { return v.batch * v.rows * v.cols; }
  static int64_t elements_of(const MatrixSet& set) {
    return static_cast<int64_t>(set.mats.size()) * set.rows() * set.cols();
  }
  static int64_t elementwise_size(std::span<const ElementwiseParam> ps) {
    int64_t n = 0;
    for (const ElementwiseParam& e : ps) n += e.weight.cols;
    return n;
  }

  // Pieces of element-wise parameters (one row each), as (parameter, piece).
  cpu::Scratch<std::pair<std::size_t, cpu::Piece>> elementwise_pieces(std::span<const ElementwiseParam> ps) {
    cpu::Scratch<std::pair<std::size_t, cpu::Piece>> items(pool_);
    for (std::size_t i = 0; i < ps.size(); ++i)
      cpu::for_each_piece(1, 1, ps[i].weight.cols, kChunk, [&](const cpu::Piece& q) { items.emplace_back(i, q); });
    return items;
  }

  // A thread's chunks of weight, gradient and the two moments, loaded where a parameter is not fp32.
  struct ChunkBuffers {
    Floats w, g, m, v;
  };
  ChunkBuffers chunk_buffers() { return {floats(kChunk), floats(kChunk), floats(kChunk), floats(kChunk)}; }

  // Elements [c0, c1) of one parameter.
  void adamw_one(const ElementwiseParam& e, const AdamWParams& given, int64_t c0, int64_t c1, ChunkBuffers& buf) {
    const AdamWParams h = given.resolved();
    const float decay = 1.0f - h.lr * h.weight_decay;
    const double t = adamw_step_number(h, *h.applied_steps);
    const float step_size = AdamWRule::step_size(h.lr, h.beta1, t);
    const float sqrt_bc2 = AdamWRule::sqrt_bias_correction2(h.beta2, t);
    const DType st = e.exp_avg.dtype, st2 = e.exp_avg_sq.dtype;
    // The largest |exp_avg| and exp_avg_sq stored (ElementwiseParam::state_bound), as rounded;
    // taken chunk by chunk after the update, in loops of their own that vectorise.
    uint32_t bm = 0, bv = 0;
    auto update = [&](float* w, const float* g, float* m, float* v, int64_t n) {
      for (int64_t j = 0; j < n; ++j) {
        m[j] = AdamWRule::exp_avg(m[j], g[j], h.beta1);
        v[j] = AdamWRule::exp_avg_sq(v[j], g[j], h.beta2);
        w[j] = AdamWRule::weight(w[j], m[j], v[j], step_size, decay, h.epsilon, sqrt_bc2);
      }
      if (e.state_bound) {
        bm = std::max(bm, largest_bits(st, m, n));
        bv = std::max(bv, largest_bits(st2, v, n));
      }
    };
    if (all_f32({e.weight, e.grad, e.exp_avg, e.exp_avg_sq})) {  // in place, no copies
      for (int64_t c = c0; c < c1; c += kChunk)
        update(f32(e.weight) + c, f32(e.grad) + c, f32(e.exp_avg) + c, f32(e.exp_avg_sq) + c, std::min(kChunk, c1 - c));
    } else {
      Floats &w = buf.w, &g = buf.g, &m = buf.m, &v = buf.v;
      for (int64_t c = c0; c < c1; c += kChunk) {  // c0 and c1: multiples of kChunk, or the end
        const MatrixView W = cols_slice(e.weight, c), G = cols_slice(e.grad, c);
        const MatrixView M = cols_slice(e.exp_avg, c), V = cols_slice(e.exp_avg_sq, c);
        load_row(W, 0, 0, w.data());
        load_row(G, 0, 0, g.data());
        load_row(M, 0, 0, m.data());
        load_row(V, 0, 0, v.data());
        update(w.data(), g.data(), m.data(), v.data(), W.cols);
        store_row(W, 0, 0, w.data());
        store_row(M, 0, 0, m.data());
        store_row(V, 0, 0, v.data());
      }
    }
    if (e.state_bound) {
      raise_bound(e.state_bound, bm);
      raise_bound(e.state_bound + 1, bv);
    }
  }

  void lion_one(const ElementwiseParam& e, const LionParams& given, int64_t c0, int64_t c1, ChunkBuffers& buf) {
    const LionParams h = given.resolved();
    const float decay = 1.0f - h.lr * h.weight_decay;
    uint32_t most = 0;  // the largest |exp_avg| stored (ElementwiseParam::state_bound), as rounded
    auto update = [&](float* w, const float* g, float* m, int64_t n) {
      for (int64_t j = 0; j < n; ++j) {
        const float u = LionRule::direction(m[j], g[j], h.beta1);
        m[j] = LionRule::exp_avg(m[j], g[j], h.beta2);
        w[j] = LionRule::weight(w[j], u, h.lr, decay);
      }
      if (e.state_bound) most = std::max(most, largest_bits(e.exp_avg.dtype, m, n));
    };
    if (all_f32({e.weight, e.grad, e.exp_avg})) {
      update(f32(e.weight) + c0, f32(e.grad) + c0, f32(e.exp_avg) + c0, c1 - c0);
    } else {
      Floats &w = buf.w, &g = buf.g, &m = buf.m;
      for (int64_t c = c0; c < c1; c += kChunk) {
        const MatrixView W = cols_slice(e.weight, c), G = cols_slice(e.grad, c), M = cols_slice(e.exp_avg, c);
        load_row(W, 0, 0, w.data());
        load_row(G, 0, 0, g.data());
        load_row(M, 0, 0, m.data());
        update(w.data(), g.data(), m.data(), W.cols);
        store_row(W, 0, 0, w.data());
        store_row(M, 0, 0, m.data());
      }
    }
    if (e.state_bound) raise_bound(e.state_bound, most);
  }

  // Rows [r0, r1) of a p x p matrix (leading dimension ld): the upper triangle from the lower.
  static void mirror_rows(float* c, int64_t ld, int64_t p, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t s = r + 1; s < p; ++s) c[r * ld + s] = c[s * ld + r];
  }

  // NorMuon (algorithm.md §1 step 6) on k rows of an update o, in fp32, updating variance[rows]: row j
  // of the result is o's row j times row_factor[j], then times the factor returned. Padding
  // rows (index >= m) take no part.
  static float normuon_factors(const float* o, int64_t k, int64_t m, int64_t cols, float* variance,
                               const int32_t* rows, float beta2, float* row_factor) {
    double norm_o = 0.0, norm_n = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      if (rows && rows[j] >= m) continue;
      for (int64_t c = 0; c < cols; ++c) norm_o += static_cast<double>(o[j * cols + c]) * o[j * cols + c];
    }
    for (int64_t j = 0; j < k; ++j) {
      row_factor[j] = 1.0f;
      if (rows && rows[j] >= m) continue;
      const float* row = o + j * cols;
      double ss = 0.0;
      for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(row[c]) * row[c];
      const float r = static_cast<float>(ss / static_cast<double>(cols));
      float& v = variance[rows ? rows[j] : j];
      v = beta2 * v + (1.0f - beta2) * r;
      const float inv = 1.0f / (std::sqrt(v) + 1e-8f);
      row_factor[j] = inv;
      for (int64_t c = 0; c < cols; ++c) {
        const float x = row[c] * inv;
        norm_n += static_cast<double>(x) * x;
      }
    }
    return static_cast<float>(std::sqrt(norm_o) / std::max(std::sqrt(norm_n), 1e-8));
  }

  // Scratch vectors from the pool (cpu_scratch.hpp): every op after the step's check takes its
  // buffers this way.
  Floats floats(std::size_t n = 0, float value = 0.0f) { return Floats(n, value, pool_); }
  Ints ints(std::size_t n = 0, int32_t value = 0) { return Ints(n, value, pool_); }
  cpu::Scratch<double> doubles() { return cpu::Scratch<double>(pool_); }

  CpuAllocator alloc_;
  cpu::Pool pool_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace dion3
