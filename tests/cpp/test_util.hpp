// tests/cpp/test_util.hpp — helpers shared by the C++ test suites: a deterministic RNG,
// fp16/bf16 conversion (round to nearest even), typed host buffers that expose dion3 views,
// test matrices (Gaussian, prescribed condition number), a Jacobi eigen solver for singular
// values, comparison helpers and byte snapshots of an optimizer's weights and state.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dion3/dion3.h"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "dion3/view.hpp"
#include "reference.hpp"

namespace t3 {

using dion3::DType;

// --- random numbers (own generator so that streams do not depend on the standard library) ---
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  uint64_t next();
  double uniform();  // [0, 1)
  double normal();   // N(0, 1), Box–Muller
 private:
  uint64_t s_;
};

ref::Mat gaussian(int rows, int cols, Rng& rng, double scale = 1.0);
// rows x cols with singular values log-spaced from 1 down to 1/kappa, random singular vectors.
ref::Mat conditioned(int rows, int cols, double kappa, Rng& rng);
// rows x cols with the given singular values (at most min(rows, cols)), random singular vectors.
ref::Mat with_spectrum(int rows, int cols, const std::vector<double>& sigmas, Rng& rng);
// A Gaussian rows x rank times a Gaussian rank x cols: rank-deficient where rank < min(rows, cols).
ref::Mat low_rank(int rows, int cols, int rank, Rng& rng);
// n x n orthogonal (Gram–Schmidt of a Gaussian matrix).
ref::Mat random_orthogonal(int n, Rng& rng);

// --- 16-bit floats -----------------------------------------------------------------------
uint16_t to_bf16_bits(double x);
uint16_t to_f16_bits(double x);
float bf16_bits_to_float(uint16_t b);
float f16_bits_to_float(uint16_t b);
ref::Storage storage_of(DType t);

// --- host buffers ------------------------------------------------------------------------
// A contiguous host tensor of any parameter dtype; values are read and written as doubles
// (writes round to nearest even into the dtype).
struct Buffer {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;

  Buffer() = default;
  Buffer(DType dt, std::vector<int64_t> shp);
  Buffer(DType dt, std::vector<int64_t> shp, const std::vector<double>& values);
  int64_t numel() const;
  double get(int64_t i) const;
  void set(int64_t i, double x);
  std::vector<double> values() const;
  void assign(const std::vector<double>& v);
  dion3::TensorView view();
  dion3::MatrixView matrix(int64_t batch, int64_t rows, int64_t cols);
};

// Reads any float TensorView living in host memory.
std::vector<double> read_view(const dion3::TensorView& v);
std::vector<unsigned char> view_bytes(const dion3::TensorView& v);

// --- linear algebra for checks ------------------------------------------------------------
// Eigenvalues of a symmetric n x n matrix (cyclic Jacobi), ascending.
std::vector<double> sym_eigenvalues(ref::Mat A, int n);
// Singular values of a rows x cols matrix via eig(X X^T) or eig(X^T X), descending.
std::vector<double> singular_values(const ref::Mat& X, int rows, int cols);

double max_abs(const std::vector<double>& a);
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b);
// Largest |W - W0|: how far a run moved the weights.
double max_change(const std::vector<double>& W, const std::vector<double>& W0);
// Tolerance on weights after several steps, relative to the largest weight and to the largest
// total change. fp32: the library's orthogonalization runs in fp32 (~1e-5 relative on O, see
// test_orthogonalize), storage rounding is mirrored by the reference. 16-bit weights: the
// library and the reference may round a weight to neighbouring values now and then (the fp32
// vs float64 update lands near a rounding boundary), so allow a few ulps of the largest weight.
double weight_tol(DType dt, double max_w, double max_delta);
// max|a-b| / max|b|
double rel_max_diff(const std::vector<double>& a, const std::vector<double>& b);
// ||a-b||_F / ||b||_F
double rel_fro_diff(const std::vector<double>& a, const std::vector<double>& b);
std::vector<double> slice(const std::vector<double>& a, size_t begin, size_t count);

// --- C API -------------------------------------------------------------------------------
// A C API optimizer on the CPU with one group of default settings; destroyed with the struct.
struct CApiOptimizer {
  dion3_optimizer* opt = nullptr;
  dion3_group_config cfg{};
  int group = -1;
  explicit CApiOptimizer(int on_nonfinite = DION3_NONFINITE_RAISE);
  ~CApiOptimizer() { dion3_destroy(opt); }
  CApiOptimizer(const CApiOptimizer&) = delete;
  CApiOptimizer& operator=(const CApiOptimizer&) = delete;
};

// --- optimizer harness --------------------------------------------------------------------
// A parameter with its weight and gradient buffers, registered into an Optimizer.
struct HostParam {
  std::string name;
  Buffer w, g;
  int index = -1;
  HostParam(std::string n, DType dt, std::vector<int64_t> shape) : name(std::move(n)), w(dt, shape), g(dt, shape) {}
  dion3::ParamSpec spec();
};

// An optimizer on the CPU backend owning its parameters' host buffers.
struct Harness {
  dion3::Optimizer opt;
  std::vector<std::unique_ptr<HostParam>> params;
  explicit Harness(dion3::OptimizerOptions o = {});
  // Registers a parameter with Gaussian weights (std `wscale`, rounded to dt) and zero grads.
  HostParam& add(int group, const std::string& name, DType dt, std::vector<int64_t> shape, Rng& rng,
                 double wscale = 0.05);
  std::vector<HostParam*> all();
  // Fills every gradient with fresh N(0, gscale^2) values.
  void randomize_grads(Rng& rng, double gscale = 1.0);
};

// Two single-parameter optimizers (groups ga and gb, one m x n fp32 weight each, the same
// initial weights from `seed`) stepped `steps` times on the same fresh gradients: for tests that
// two configurations agree (or differ) exactly where they should.
struct TwinRun {
  Harness a, b;
  HostParam* pa = nullptr;
  HostParam* pb = nullptr;
  std::vector<double> w0;  // the initial weights
  bool all_applied = true;  // every step() of both returned true
};
std::unique_ptr<TwinRun> twin_run(const dion3::GroupConfig& ga, const dion3::GroupConfig& gb, int m, int n,
                                  uint64_t seed, int steps);

// All weight bytes followed by all state bytes (state_views order), for "unchanged" checks.
std::vector<unsigned char> snapshot(const dion3::Optimizer& opt, std::vector<HostParam*> params);
// The named state tensor of a parameter as doubles (fails the test if missing).
std::vector<double> state_values(const dion3::Optimizer& opt, int param, const std::string& name);
bool has_state(const dion3::Optimizer& opt, int param, const std::string& name);

// The reference's hyper-parameters for a group config.
ref::MatrixHyper matrix_hyper(const dion3::GroupConfig& g, DType param_dtype);
ref::ElemHyper elem_hyper(const dion3::GroupConfig& g, DType param_dtype);
std::vector<ref::Coef> to_ref(const std::vector<dion3::Coefficients>& c);
ref::Adjust to_ref(dion3::AdjustLR a);

// "what" of the exception thrown by f (empty when nothing thrown); status filled in.
template <class F>
std::string error_of(F&& f, dion3::Status* status = nullptr) {
  try {
    f();
  } catch (const dion3::Error& e) {
    if (status) *status = e.status();
    return e.what();
  }
  return {};
}

}  // namespace t3
