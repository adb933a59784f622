// orthogonalize.cpp — standard and Gram Newton–Schulz (algorithm.md §2) over backend primitives.
//
// Buffers live in one workspace allocated at planning time, in the iteration dtype: wide p x q
// matrices (X and a ping-pong partner) followed by p x p squares. Gram NS needs two wides and
// four squares (R, W, Q and one scratch: at most four are live at any product). Standard NS needs
// two wides and two squares, or, when p == q, one wide and two squares: X's next value goes
// into the square A, dead once B is formed, and the buffers rotate.
#include "dion3/orthogonalize.hpp"

#include <algorithm>
#include <utility>

#include "dion3/error.hpp"

namespace dion3 {

namespace {
// p x p scratch matrices each method needs: A, B (standard); R, W, Q, S (Gram).
int squares_of(OrthMethod m) { return m == OrthMethod::Gram ? 4 : 2; }
// p x q matrices: X and its partner, except square standard runs (the partner is A's square).
int wides_of(OrthMethod m, int64_t p, int64_t q) { return m == OrthMethod::Standard && p == q ? 1 : 2; }

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// Whether Gram NS's step t forms R for the next step: not the last step, nor one before a restart
// (which rebuilds R from X = Q X, so Q goes to that gemm instead).
bool r_update(const OrthConfig& cfg, int t) {
  return t + 1 < static_cast<int>(cfg.coefficients.size()) && !contains(cfg.restarts, t + 1);
}

// Whether that update forms W·R whole (a gemm): where R was just rebuilt at a restart.
// Rounded, R and W = q(R) do not commute exactly, so R·W is not symmetric: its mirrored lower
// triangle is off by their commutator, of order u·|R|·|W|, and |R| is largest there (the steps
// before a restart may push X past norm 1). That error, carried on, leaves the polynomial's band.
bool whole_update(const OrthConfig& cfg, int t) { return t > 0 && contains(cfg.restarts, t) && r_update(cfg, t); }

// What Gram NS runs per matrix: restarts that take effect, R updates (as many Q·W products), and
// the updates formed whole.
struct GramCounts {
  int restarts, updates, whole;
};
GramCounts gram_counts(const OrthConfig& cfg) {
  const int steps = static_cast<int>(cfg.coefficients.size());
  GramCounts n{0, 0, 0};
  for (int t = 0; t < steps; ++t) {
    n.restarts += t > 0 && contains(cfg.restarts, t);
    n.updates += r_update(cfg, t);
    n.whole += whole_update(cfg, t);
  }
  return n;
}
double gram_flops(int64_t batch, int64_t p, int64_t q, int steps, GramCounts n, double sym) {
  const double P = static_cast<double>(p), Q = static_cast<double>(q);
  const double sq = 2 * P * P * P * sym;
  double f = 2 * P * P * Q * sym + 2 * P * P * Q;          // first Gram, final Q X
  f += n.restarts * (2 * P * P * Q + 2 * P * P * Q * sym);  // X = Q X, R = X X^T
  f += steps * sq;                                         // W
  f += n.updates * sq;                                     // Q = Q W
  f += (n.updates - n.whole) * 2 * sq + n.whole * (2 * P * P * P + sq);  // R updates
  return static_cast<double>(batch) * f;
}

// What a (rows, cols) problem resolves to with this config on this backend: the method, the
// iteration dtype, and p x q, the shape it iterates on (p <= q, except below).
struct Plan {
  OrthMethod method;
  DType dtype;
  int64_t p, q;
  std::size_t wide_bytes(int64_t batch) const { return static_cast<std::size_t>(batch * p * q) * dtype_size(dtype); }
  std::size_t workspace_bytes(int64_t batch) const {
    return static_cast<std::size_t>(batch * (wides_of(method, p, q) * p * q + squares_of(method) * p * p)) *
           dtype_size(dtype);
  }
};
// A tall input whose rows past real_rows are zero padding and whose real rows number at most
// cols iterates as it stands (p = rows > q = cols): one device would not transpose those rows,
// and the padding's zero rows stay exactly zero in that orientation.
bool keeps_rows(int64_t rows, int64_t cols, int64_t real_rows) {
  return real_rows > 0 && rows > cols && real_rows <= cols;
}
Plan plan_of(const Backend& backend, const OrthConfig& cfg, int64_t rows, int64_t cols, int64_t real_rows) {
  const OrthMethod method = choose_orth_method(backend, cfg, rows, cols);
  const DType dtype = choose_iteration_dtype(backend, cfg, method);
  if (method == OrthMethod::Gram)  // asked for, in the backend's dtype (validate() checks a given one)
    if (const std::string e = cfg.gram_divergence_error(dtype); !e.empty()) fail(e);
  if (keeps_rows(rows, cols, real_rows)) return {method, dtype, rows, cols};
  return {method, dtype, std::min(rows, cols), std::max(rows, cols)};
}
}  // namespace

double effective_ns_flops(int64_t batch, int64_t rows, int64_t cols, int steps) {
  const double p = static_cast<double>(std::min(rows, cols)), q = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(batch) * steps * (4.0 * p * p * q + 2.0 * p * p * p);
}

double standard_ns_flops(int64_t batch, int64_t p, int64_t q, int steps, double sym) {
  const double P = static_cast<double>(p), Q = static_cast<double>(q);
  const double per_step = 2 * P * P * Q * sym + 2 * P * P * P * sym + 2 * P * P * Q;
  return static_cast<double>(batch) * steps * per_step;
}

double gram_ns_flops(int64_t batch, int64_t p, int64_t q, int steps, int n_restarts, double sym) {
  const int updates = std::max(0, steps - 1 - n_restarts);
  return gram_flops(batch, p, q, steps, {n_restarts, updates, std::min(n_restarts, updates)}, sym);
}

DType choose_iteration_dtype(const Backend& backend, const OrthConfig& cfg, OrthMethod method) {
  if (cfg.iteration_dtype) return *cfg.iteration_dtype;
  return backend.default_iteration_dtype(method == OrthMethod::Gram);
}

OrthMethod choose_orth_method(const Backend& backend, const OrthConfig& cfg, int64_t rows, int64_t cols) {
  if (cfg.method != OrthMethod::Auto) return cfg.method;
  const int64_t p = std::min(rows, cols), q = std::max(rows, cols);
  if (p == q) return OrthMethod::Standard;
  // bf16's 8-bit mantissa lets Gram's p x p iterations drift out of the polynomial's band: not
  // where Gram would iterate in it; nor where its coefficients and restarts would let it diverge.
  const DType gram_dtype = choose_iteration_dtype(backend, cfg, OrthMethod::Gram);
  if (gram_dtype == DType::BF16 || cfg.gram_diverges(gram_dtype)) return OrthMethod::Standard;
  const int steps = static_cast<int>(cfg.coefficients.size());
  const double sym = backend.symmetric_cost_factor();
  return gram_flops(1, p, q, steps, gram_counts(cfg), sym) < standard_ns_flops(1, p, q, steps, sym)
             ? OrthMethod::Gram
             : OrthMethod::Standard;
}

std::size_t Orthogonalizer::required_workspace(const Backend& backend, const OrthConfig& cfg, int64_t batch,
                                               int64_t rows, int64_t cols, int64_t real_rows) {
  return plan_of(backend, cfg, rows, cols, real_rows).workspace_bytes(batch);
}

std::size_t Orthogonalizer::input_offset(const Backend& backend, const OrthConfig& cfg, int64_t batch,
                                         int64_t rows, int64_t cols, std::size_t in_bytes, int64_t real_rows) {
  const Plan plan = plan_of(backend, cfg, rows, cols, real_rows);
  // run() first normalises the input into X = wide(0) (transposed if tall); everything behind it
  // is written only afterwards.
  const std::size_t offset = (plan.wide_bytes(batch) + 255) / 256 * 256;
  return offset + in_bytes <= plan.workspace_bytes(batch) ? offset : kNoInputRoom;
}

Orthogonalizer::Orthogonalizer(Backend& backend, const OrthConfig& cfg, int64_t batch, int64_t rows,
                               int64_t cols, void* workspace, int64_t real_rows)
    : backend_(backend), cfg_(cfg), batch_(batch) {
  cfg_.validate();
  if (batch < 1 || rows < 1 || cols < 1)
    fail("orthogonalize needs a non-empty batch of matrices, got batch " + std::to_string(batch) + " of " +
         std::to_string(rows) + "x" + std::to_string(cols));
  const Plan plan = plan_of(backend, cfg_, rows, cols, real_rows);
  transposed_ = plan.p != rows;  // iterates on the input's transpose
  p_ = plan.p;
  q_ = plan.q;
  method_ = plan.method;
  dtype_ = plan.dtype;
  bytes_ = plan.workspace_bytes(batch);
  if (!workspace) {
    owned_ = DeviceBuffer(backend.allocator(), bytes_);
    workspace = owned_.get();
  }
  workspace_ = static_cast<char*>(workspace);
}

MatrixView Orthogonalizer::wide(int slot) const {
  char* base = workspace_ + static_cast<std::size_t>(slot * batch_ * p_ * q_) * dtype_size(dtype_);
  return MatrixView::contiguous(base, dtype_, batch_, p_, q_);
}

MatrixView Orthogonalizer::square(int slot) const {
  const int64_t wides = wides_of(method_, p_, q_);
  char* base = workspace_ +
               static_cast<std::size_t>(wides * batch_ * p_ * q_ + slot * batch_ * p_ * p_) * dtype_size(dtype_);
  return MatrixView::contiguous(base, dtype_, batch_, p_, p_);
}

void Orthogonalizer::run(MatrixView in, MatrixView out) {
  const int64_t rows = transposed_ ? q_ : p_, cols = transposed_ ? p_ : q_;
  if (!(out.batch == batch_ && out.rows == rows && out.cols == cols))
    fail("orthogonalize was planned for batch " + std::to_string(batch_) + " of " + std::to_string(rows) + "x" +
         std::to_string(cols) + " but got output " + std::to_string(out.batch) + "x" + std::to_string(out.rows) +
         "x" + std::to_string(out.cols));
  const MatrixView result = run(in);
  backend_.convert(result, out, false);
}

MatrixView Orthogonalizer::run(MatrixView in, const float* in_row_sumsq) {
  const int64_t rows = transposed_ ? q_ : p_, cols = transposed_ ? p_ : q_;
  auto same_shape = [&](const MatrixView& v) { return v.batch == batch_ && v.rows == rows && v.cols == cols; };
  if (!same_shape(in))
    fail("orthogonalize was planned for batch " + std::to_string(batch_) + " of " + std::to_string(rows) + "x" +
         std::to_string(cols) + " but got input " + std::to_string(in.batch) + "x" + std::to_string(in.rows) +
         "x" + std::to_string(in.cols));
  // A tall input is normalised and turned wide in one pass; its result comes out tall from the
  // last product (see last_product).
  const MatrixView X = wide(0);
  backend_.normalize(in, X, cfg_.norm, in_row_sumsq, transposed_);
  return method_ == OrthMethod::Gram ? gram(X) : standard(X);
}

MatrixView Orthogonalizer::last_product(MatrixView S, MatrixView X, MatrixView out) {
  if (!transposed_) {
    backend_.gemm(false, false, 1.0f, S, X, 0.0f, out);
    return out;
  }
  // S is symmetric, so (S X)^T = X^T S: the tall result is one gemm with no transposing pass.
  out.rows = q_;
  out.cols = p_;
  out.ld = p_;
  backend_.gemm(true, false, 1.0f, X, S, 0.0f, out);
  return out;
}

MatrixView Orthogonalizer::normalized_input() const {
  if (transposed_) fail("orthogonalize: a transposed run (rows > cols) normalises its input itself");
  return wide(0);
}

MatrixView Orthogonalizer::run_normalized() {
  const MatrixView X = normalized_input();
  return method_ == OrthMethod::Gram ? gram(X) : standard(X);
}

MatrixView Orthogonalizer::standard(MatrixView X) {
  const bool square_x = p_ == q_;  // X's partner is A's square (no wide(1))
  MatrixView X2 = square_x ? X : wide(1), A = square(0), B = square(1);
  // Asked at every run: the backend's symmetric path may change between runs (its options).
  const bool banded = backend_.symmetric_banded(dtype_, p_);
  const std::size_t steps = cfg_.coefficients.size();  // at least one (OrthConfig::validate)
  for (std::size_t t = 0;; ++t) {
    const Coefficients& k = cfg_.coefficients[t];
    const float a = static_cast<float>(k[0]), b = static_cast<float>(k[1]), c = static_cast<float>(k[2]);
    backend_.gram(X, A, banded);                                // A = X X^T
    backend_.sym_product(c, A, A, b, &A, a, B, banded, false);  // B = b A + c A^2 + a I (full: gemm reads it)
    if (square_x) X2.data = A.data;                             // A is dead from here on
    if (t + 1 == steps) return last_product(B, X, X2);         // B X = a X + (b A + c A^2) X
    backend_.gemm(false, false, 1.0f, B, X, 0.0f, X2);         // X2 = B X
    if (square_x) A.data = X.data;                              // the old X becomes the next A
    std::swap(X.data, X2.data);
  }
}

MatrixView Orthogonalizer::gram(MatrixView X) {
  // Every product after Z = b R + c R^2 takes Z through W = Z + a I (Q Z + a Q = Q W,
  // R Z + a R = R W, Z RZ + a RZ = W RZ), so W is formed directly, in the product's epilogue.
  MatrixView X2 = wide(1);
  // S holds Q W before it becomes Q, and R W: the old Q is dead once Q W is formed.
  MatrixView R = square(0), W = square(1), Q = square(2), S = square(3);
  const int steps = static_cast<int>(cfg_.coefficients.size());
  const bool banded = backend_.symmetric_banded(dtype_, p_);  // asked at every run, as in standard()
  // Only a Q that the next gemm reads (X = Q X at a restart or at the end) must be full; the rest
  // are read by symmetric products alone, so they may be banded.
  backend_.gram(X, R, banded);
  for (int t = 0; t < steps; ++t) {
    const float a = static_cast<float>(cfg_.coefficients[t][0]);
    const float b = static_cast<float>(cfg_.coefficients[t][1]);
    const float c = static_cast<float>(cfg_.coefficients[t][2]);
    const bool restart = contains(cfg_.restarts, t);
    const bool update = r_update(cfg_, t);     // else Q goes to a gemm next (X = Q X)
    const bool whole = whole_update(cfg_, t);  // that update's R and W read by a gemm
    if (restart && t > 0) {  // X = Q X; R = X X^T; Q = I
      backend_.gemm(false, false, 1.0f, Q, X, 0.0f, X2);
      std::swap(X.data, X2.data);
      backend_.gram(X, R, banded && !whole);
    }
    const bool w_is_q = t == 0 || restart;
    // W = b R + c R^2 + a I. A whole symmetric matrix also reads as banded (its lower band is there).
    backend_.sym_product(c, R, R, b, &R, a, W, banded, banded && !whole && !(w_is_q && !update));
    if (w_is_q) {
      std::swap(Q.data, W.data);  // Q = W (no copy: W's buffer becomes Q's)
    } else {
      backend_.sym_product(1.0f, Q, W, 0.0f, nullptr, 0.0f, S, banded, banded && update);  // Q = Q W
      std::swap(Q.data, S.data);
    }
    if (!update) continue;
    const MatrixView& w = w_is_q ? Q : W;
    if (whole) {
      backend_.gemm(false, false, 1.0f, w, R, 0.0f, S);                           // S = W R
      backend_.sym_product(1.0f, w, S, 0.0f, nullptr, 0.0f, R, false, banded);  // R = W S^T = W R W
    } else {
      backend_.sym_product(1.0f, R, w, 0.0f, nullptr, 0.0f, S, banded, banded);  // S = R W
      backend_.sym_product(1.0f, w, S, 0.0f, nullptr, 0.0f, R, banded, banded);  // R = W S
    }
  }
  return last_product(Q, X, X2);  // X = Q X
}

}  // namespace dion3
