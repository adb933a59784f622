// tests/cpp/test_util.cpp — implementation of the shared test helpers (see test_util.hpp).
#include "test_util.hpp"

#include <stdexcept>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

namespace t3 {

// --- Rng ---------------------------------------------------------------------------------
uint64_t Rng::next() {  // splitmix64
  uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
double Rng::normal() {
  double u1 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

ref::Mat gaussian(int rows, int cols, Rng& rng, double scale) {
  ref::Mat X(static_cast<size_t>(rows) * cols);
  for (double& x : X) x = scale * rng.normal();
  return X;
}

ref::Mat random_orthogonal(int n, Rng& rng) {
  ref::Mat A = gaussian(n, n, rng);
  // Modified Gram–Schmidt on the rows, twice for accuracy.
  for (int pass = 0; pass < 2; ++pass)
    for (int i = 0; i < n; ++i) {
      double* ri = &A[static_cast<size_t>(i) * n];
      for (int j = 0; j < i; ++j) {
        const double* rj = &A[static_cast<size_t>(j) * n];
        double d = 0;
        for (int l = 0; l < n; ++l) d += ri[l] * rj[l];
        for (int l = 0; l < n; ++l) ri[l] -= d * rj[l];
      }
      double nr = 0;
      for (int l = 0; l < n; ++l) nr += ri[l] * ri[l];
      nr = std::sqrt(nr);
      for (int l = 0; l < n; ++l) ri[l] /= nr;
    }
  return A;
}

ref::Mat conditioned(int rows, int cols, double kappa, Rng& rng) {
  const int p = std::min(rows, cols);
  std::vector<double> sigmas(p);
  for (int s = 0; s < p; ++s) sigmas[s] = p == 1 ? 1.0 : std::pow(kappa, -static_cast<double>(s) / (p - 1));
  return with_spectrum(rows, cols, sigmas, rng);
}

ref::Mat with_spectrum(int rows, int cols, const std::vector<double>& sigmas, Rng& rng) {
  const ref::Mat U = random_orthogonal(rows, rng), V = random_orthogonal(cols, rng);
  ref::Mat X(static_cast<size_t>(rows) * cols, 0.0);
  for (size_t s = 0; s < sigmas.size(); ++s)
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j)
        X[static_cast<size_t>(i) * cols + j] +=
            sigmas[s] * U[static_cast<size_t>(i) * rows + s] * V[s * static_cast<size_t>(cols) + j];
  return X;
}

ref::Mat low_rank(int rows, int cols, int rank, Rng& rng) {
  const ref::Mat A = gaussian(rows, rank, rng), B = gaussian(rank, cols, rng);
  ref::Mat X(static_cast<size_t>(rows) * cols, 0.0);
  for (int i = 0; i < rows; ++i)
    for (int k = 0; k < rank; ++k)
      for (int j = 0; j < cols; ++j)
        X[static_cast<size_t>(i) * cols + j] += A[static_cast<size_t>(i) * rank + k] * B[static_cast<size_t>(k) * cols + j];
  return X;
}

// --- 16-bit floats ------------------------------------------------------------------------
uint16_t to_bf16_bits(double x) {
  if (std::isnan(x)) return 0x7FC0;
  const float r = static_cast<float>(ref::round_to(x, ref::Storage::BF16));  // exact in float
  uint32_t u;
  std::memcpy(&u, &r, 4);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t to_f16_bits(double x) {
  if (std::isnan(x)) return 0x7E00;
  const double r = ref::round_to(x, ref::Storage::F16);
  const uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const double a = std::fabs(r);
  if (std::isinf(a)) return sign | 0x7C00;
  if (a == 0.0) return sign;
  if (a < 0x1.0p-14) return sign | static_cast<uint16_t>(a / 0x1.0p-24);  // subnormal
  const int e = std::ilogb(a);
  const uint16_t mant = static_cast<uint16_t>(a / std::ldexp(1.0, e - 10) - 1024.0);
  return sign | static_cast<uint16_t>((e + 15) << 10) | mant;
}

float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float f16_bits_to_float(uint16_t b) {
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  const int e = (b >> 10) & 0x1F;
  const int mant = b & 0x3FF;
  if (e == 0x1F) return static_cast<float>(mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY);
  if (e == 0) return static_cast<float>(sign * mant * 0x1.0p-24);
  return static_cast<float>(sign * std::ldexp(1.0 + mant / 1024.0, e - 15));
}

ref::Storage storage_of(DType t) {
  switch (t) {
    case DType::F32:
      return ref::Storage::F32;
    case DType::BF16:
      return ref::Storage::BF16;
    case DType::F16:
      return ref::Storage::F16;
    default:
      return ref::Storage::F64;
  }
}

// --- Buffer ---------------------------------------------------------------------------------
namespace {
size_t elem_size(DType t) {
  switch (t) {
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::F32:
    case DType::I32:
      return 4;
    default:
      return 8;
  }
}
int64_t count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}
double load(const unsigned char* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DType::F64: {
      double d;
      std::memcpy(&d, p + 8 * i, 8);
      return d;
    }
    case DType::BF16:
    case DType::F16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return t == DType::BF16 ? bf16_bits_to_float(b) : f16_bits_to_float(b);
    }
    case DType::I32: {
      int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case DType::I64: {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      return static_cast<double>(v);
    }
  }
  return 0;
}
}  // namespace

Buffer::Buffer(DType dt, std::vector<int64_t> shp) : dtype(dt), shape(std::move(shp)) {
  bytes.assign(static_cast<size_t>(count(shape)) * elem_size(dt), 0);
}
Buffer::Buffer(DType dt, std::vector<int64_t> shp, const std::vector<double>& values) : Buffer(dt, std::move(shp)) {
  assign(values);
}
int64_t Buffer::numel() const { return count(shape); }
double Buffer::get(int64_t i) const { return load(bytes.data(), dtype, i); }
void Buffer::set(int64_t i, double x) {
  unsigned char* p = bytes.data();
  switch (dtype) {
    case DType::F32: {
      const float f = static_cast<float>(x);
      std::memcpy(p + 4 * i, &f, 4);
      break;
    }
    case DType::F64:
      std::memcpy(p + 8 * i, &x, 8);
      break;
    case DType::BF16:
    case DType::F16: {
      const uint16_t b = dtype == DType::BF16 ? to_bf16_bits(x) : to_f16_bits(x);
      std::memcpy(p + 2 * i, &b, 2);
      break;
    }
    case DType::I32: {
      const int32_t v = static_cast<int32_t>(x);
      std::memcpy(p + 4 * i, &v, 4);
      break;
    }
    case DType::I64: {
      const int64_t v = static_cast<int64_t>(x);
      std::memcpy(p + 8 * i, &v, 8);
      break;
    }
  }
}
std::vector<double> Buffer::values() const {
  std::vector<double> v(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) v[i] = get(i);
  return v;
}
void Buffer::assign(const std::vector<double>& v) {
  EXPECT_EQ(static_cast<int64_t>(v.size()), numel());
  for (int64_t i = 0; i < numel() && i < static_cast<int64_t>(v.size()); ++i) set(i, v[i]);
}
dion3::TensorView Buffer::view() {
  dion3::TensorView t;
  t.data = bytes.data();
  t.dtype = dtype;
  t.device = dion3::Device::CPU;
  t.shape = shape;
  return t;
}
dion3::MatrixView Buffer::matrix(int64_t batch, int64_t rows, int64_t cols) {
  return dion3::MatrixView::contiguous(bytes.data(), dtype, batch, rows, cols);
}

std::vector<double> read_view(const dion3::TensorView& v) {
  const int64_t n = count(v.shape);
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = load(static_cast<const unsigned char*>(v.data), v.dtype, i);
  return out;
}

std::vector<unsigned char> view_bytes(const dion3::TensorView& v) {
  const auto* p = static_cast<const unsigned char*>(v.data);
  return std::vector<unsigned char>(p, p + static_cast<size_t>(count(v.shape)) * elem_size(v.dtype));
}

// --- linear algebra -------------------------------------------------------------------------
std::vector<double> sym_eigenvalues(ref::Mat A, int n) {
  auto at = [&](int i, int j) -> double& { return A[static_cast<size_t>(i) * n + j]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, diag = 0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) (i == j ? diag : off) += at(i, j) * at(i, j);
    if (off <= 1e-30 * std::max(diag, 1e-300)) break;
    for (int p = 0; p < n - 1; ++p)
      for (int q = p + 1; q < n; ++q) {
        const double apq = at(p, q);
        if (apq == 0.0) continue;
        const double theta = (at(q, q) - at(p, p)) / (2.0 * apq);
        const double t = std::copysign(1.0, theta) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
        for (int k = 0; k < n; ++k) {  // rotate columns p, q
          const double akp = at(k, p), akq = at(k, q);
          at(k, p) = c * akp - s * akq;
          at(k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // rotate rows p, q
          const double apk = at(p, k), aqk = at(q, k);
          at(p, k) = c * apk - s * aqk;
          at(q, k) = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> ev(n);
  for (int i = 0; i < n; ++i) ev[i] = at(i, i);
  std::sort(ev.begin(), ev.end());
  return ev;
}

std::vector<double> singular_values(const ref::Mat& X, int rows, int cols) {
  const bool wide = rows <= cols;
  const int p = wide ? rows : cols;
  const ref::Mat Xt = ref::transpose(X, rows, cols);
  const ref::Mat G = wide ? ref::matmul(X, Xt, rows, cols, rows) : ref::matmul(Xt, X, cols, rows, cols);
  std::vector<double> ev = sym_eigenvalues(G, p);
  std::vector<double> sv(p);
  for (int i = 0; i < p; ++i) sv[i] = std::sqrt(std::max(ev[p - 1 - i], 0.0));
  return sv;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}
double rel_max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  return max_abs_diff(a, b) / std::max(max_abs(b), 1e-300);
}
double rel_fro_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}
std::vector<double> slice(const std::vector<double>& a, size_t begin, size_t n) {
  return std::vector<double>(a.begin() + static_cast<long>(begin), a.begin() + static_cast<long>(begin + n));
}

// --- optimizer harness ----------------------------------------------------------------------
dion3::ParamSpec HostParam::spec() {
  dion3::ParamSpec s;
  s.name = name;
  s.weight = w.view();
  s.grad = g.view();
  return s;
}

CApiOptimizer::CApiOptimizer(int on_nonfinite) {
  if (dion3_create(&opt, DION3_DEVICE_CPU, 0, nullptr, on_nonfinite) != DION3_OK)
    throw std::runtime_error(std::string("dion3_create: ") + dion3_last_error());
  dion3_group_config_default(&cfg);
  if (dion3_add_group(opt, &cfg, &group) != DION3_OK)
    throw std::runtime_error(std::string("dion3_add_group: ") + dion3_last_error());
}

Harness::Harness(dion3::OptimizerOptions o) : opt(dion3::make_cpu_backend(), o) {}

HostParam& Harness::add(int group, const std::string& name, DType dt, std::vector<int64_t> shape, Rng& rng,
                        double wscale) {
  auto p = std::make_unique<HostParam>(name, dt, shape);
  for (int64_t i = 0; i < p->w.numel(); ++i) p->w.set(i, wscale * rng.normal());
  p->index = opt.add_param(group, p->spec());
  params.push_back(std::move(p));
  return *params.back();
}

std::vector<HostParam*> Harness::all() {
  std::vector<HostParam*> v;
  for (auto& p : params) v.push_back(p.get());
  return v;
}

void Harness::randomize_grads(Rng& rng, double gscale) {
  for (auto& p : params)
    for (int64_t i = 0; i < p->g.numel(); ++i) p->g.set(i, gscale * rng.normal());
}

std::unique_ptr<TwinRun> twin_run(const dion3::GroupConfig& ga, const dion3::GroupConfig& gb, int m, int n,
                                  uint64_t seed, int steps) {
  auto t = std::make_unique<TwinRun>();
  Rng ra(seed), rb(seed);
  t->pa = &t->a.add(t->a.opt.add_group(ga), "w", DType::F32, {m, n}, ra);
  t->pb = &t->b.add(t->b.opt.add_group(gb), "w", DType::F32, {m, n}, rb);
  t->w0 = t->pa->w.values();
  for (int s = 0; s < steps; ++s) {
    t->a.randomize_grads(ra);
    t->pb->g.bytes = t->pa->g.bytes;
    t->all_applied = t->a.opt.step() && t->all_applied;
    t->all_applied = t->b.opt.step() && t->all_applied;
  }
  return t;
}

std::vector<unsigned char> snapshot(const dion3::Optimizer& opt, std::vector<HostParam*> params) {
  std::vector<unsigned char> out;
  for (HostParam* p : params) out.insert(out.end(), p->w.bytes.begin(), p->w.bytes.end());
  for (HostParam* p : params) {
    if (p->index < 0) continue;
    for (const auto& [name, view] : opt.state_views(p->index)) {
      const auto b = view_bytes(view);
      out.insert(out.end(), name.begin(), name.end());
      out.insert(out.end(), b.begin(), b.end());
    }
  }
  return out;
}

bool has_state(const dion3::Optimizer& opt, int param, const std::string& name) {
  for (const auto& [n, v] : opt.state_views(param))
    if (n == name) return true;
  return false;
}

std::vector<double> state_values(const dion3::Optimizer& opt, int param, const std::string& name) {
  for (const auto& [n, v] : opt.state_views(param))
    if (n == name) return read_view(v);
  ADD_FAILURE() << "parameter " << param << " has no state tensor '" << name << "'";
  return {};
}

std::vector<ref::Coef> to_ref(const std::vector<dion3::Coefficients>& c) {
  std::vector<ref::Coef> r;
  for (const auto& k : c) r.push_back({k[0], k[1], k[2]});
  return r;
}

ref::Adjust to_ref(dion3::AdjustLR a) {
  switch (a) {
    case dion3::AdjustLR::SpectralNorm:
      return ref::Adjust::SpectralNorm;
    case dion3::AdjustLR::RmsNorm:
      return ref::Adjust::RmsNorm;
    case dion3::AdjustLR::None:
      return ref::Adjust::None;
    case dion3::AdjustLR::SpectralNormClamped:
      return ref::Adjust::SpectralNormClamped;
  }
  return ref::Adjust::None;
}

ref::MatrixHyper matrix_hyper(const dion3::GroupConfig& g, DType param_dtype) {
  ref::MatrixHyper h;
  h.lr = g.lr;
  h.fraction = g.fraction;
  h.mu = g.mu;
  h.beta2 = g.muon_beta2;
  h.weight_decay = g.weight_decay;
  h.epsilon = g.epsilon;
  h.adjust = to_ref(g.adjust_lr);
  h.scale_lr_by_fraction = g.scale_lr_by_fraction;
  h.nesterov = g.nesterov;
  h.ema_momentum = g.ema_momentum;
  h.orth = g.orth.method == dion3::OrthMethod::Gram ? ref::OrthKind::Gram : ref::OrthKind::Standard;
  h.coef = to_ref(g.orth.coefficients);
  h.restarts = g.orth.restarts;
  h.w_store = storage_of(param_dtype);
  h.m_store = storage_of(g.momentum_dtype.value_or(param_dtype));
  return h;
}

ref::ElemHyper elem_hyper(const dion3::GroupConfig& g, DType param_dtype) {
  ref::ElemHyper h;
  h.lr = g.lr;
  h.beta1 = g.betas[0];
  h.beta2 = g.betas[1];
  h.weight_decay = g.weight_decay;
  h.epsilon = g.epsilon;
  h.w_store = storage_of(param_dtype);
  h.s_store = storage_of(g.momentum_dtype.value_or(param_dtype));
  return h;
}

double max_change(const std::vector<double>& W, const std::vector<double>& W0) {
  double d = 0;
  for (size_t i = 0; i < W.size(); ++i) d = std::max(d, std::fabs(W[i] - W0[i]));
  return d;
}

double weight_tol(DType dt, double max_w, double max_delta) {
  switch (dt) {
    case DType::BF16:
      return 3.0 * 0x1.0p-8 * max_w + 1e-2 * max_delta;
    case DType::F16:
      return 3.0 * 0x1.0p-11 * max_w + 1e-2 * max_delta;
    default:
      return 4.0 * 0x1.0p-24 * max_w + 1e-4 * max_delta;
  }
}

}  // namespace t3
