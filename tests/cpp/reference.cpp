// tests/cpp/reference.cpp — float64 reference of algorithm.md §1, §2 and §4 (see reference.hpp).
//
// Written from docs/algorithm.md only; deliberately naive (triple loops, no blocking) so that it is
// easy to audit against the page.
#include "reference.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <numeric>

namespace ref {

std::vector<Coef> polar_express() {
  return {
      {7.892582874424408, -20.383013945879568, 13.555306149406924},
      {3.911484868135431, -2.546463592906088, 0.426898831967307},
      {3.760657955697423, -2.512819018216563, 0.432364734907007},
      {3.160399673686287, -2.149649518898498, 0.399636690766439},
      {2.191097161861730, -1.441662010214663, 0.328146487623155},
  };
}

std::vector<Coef> you() {
  return {
      {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
      {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012},
  };
}

namespace {

// Round x to a binary format with `mant` explicit mantissa bits, minimum normal exponent
// `emin` and largest finite value `maxv`, round to nearest even (std::nearbyint's default mode).
double round_binary(double x, int mant, int emin, double maxv) {
  if (!std::isfinite(x) || x == 0.0) return x;
  int e = std::ilogb(x);
  if (e < emin) e = emin;  // subnormal range: fixed quantum
  const double quantum = std::ldexp(1.0, e - mant);
  double r = std::nearbyint(x / quantum) * quantum;
  if (std::fabs(r) > maxv) r = std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

}  // namespace

double round_to(double x, Storage s) {
  switch (s) {
    case Storage::F64:
      return x;
    case Storage::F32:
      return static_cast<double>(static_cast<float>(x));
    case Storage::BF16:
      return round_binary(x, 7, -126, 3.3895313892515355e38);
    case Storage::F16:
      return round_binary(x, 10, -14, 65504.0);
  }
  return x;
}

Mat transpose(const Mat& A, int rows, int cols) {
  Mat T(static_cast<size_t>(rows) * cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) T[static_cast<size_t>(j) * rows + i] = A[static_cast<size_t>(i) * cols + j];
  return T;
}

Mat matmul(const Mat& A, const Mat& B, int m, int k, int n) {
  Mat C(static_cast<size_t>(m) * n, 0.0);
  for (int i = 0; i < m; ++i)
    for (int l = 0; l < k; ++l) {
      const double a = A[static_cast<size_t>(i) * k + l];
      for (int j = 0; j < n; ++j) C[static_cast<size_t>(i) * n + j] += a * B[static_cast<size_t>(l) * n + j];
    }
  return C;
}

Mat identity(int n) {
  Mat I(static_cast<size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) I[static_cast<size_t>(i) * n + i] = 1.0;
  return I;
}

double frobenius(const Mat& A) {
  double s = 0.0;
  for (double x : A) s += x * x;
  return std::sqrt(s);
}

namespace {

// alpha*A + beta*B (+ gamma*I when square of side n).
Mat axpby(double alpha, const Mat& A, double beta, const Mat& B) {
  Mat C(A.size());
  for (size_t i = 0; i < A.size(); ++i) C[i] = alpha * A[i] + beta * B[i];
  return C;
}
Mat plus_identity(Mat A, int n, double gamma) {
  for (int i = 0; i < n; ++i) A[static_cast<size_t>(i) * n + i] += gamma;
  return A;
}

// algorithm.md §2 preamble: transpose if needed and normalise by the Frobenius norm + 1e-7.
Mat prepare(const Mat& X, int rows, int cols, int& p, int& q, bool& transposed) {
  transposed = rows > cols;
  Mat Y = transposed ? transpose(X, rows, cols) : X;
  p = transposed ? cols : rows;
  q = transposed ? rows : cols;
  const double norm = frobenius(Y) + 1e-7;
  for (double& y : Y) y /= norm;
  return Y;
}

Mat finish(const Mat& Y, int p, int q, bool transposed) {
  return transposed ? transpose(Y, p, q) : Y;
}

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

}  // namespace

Mat orth_standard(const Mat& X, int rows, int cols, const std::vector<Coef>& coef) {
  int p, q;
  bool tr;
  Mat Y = prepare(X, rows, cols, p, q, tr);
  for (const Coef& k : coef) {
    const Mat A = matmul(Y, transpose(Y, p, q), p, q, p);  // A = X X^T
    const Mat A2 = matmul(A, A, p, p, p);
    const Mat B = axpby(k.b, A, k.c, A2);                   // B = b A + c A^2
    const Mat BY = matmul(B, Y, p, p, q);
    Y = axpby(k.a, Y, 1.0, BY);                              // X = a X + B X
  }
  return finish(Y, p, q, tr);
}

Mat orth_gram(const Mat& X, int rows, int cols, const std::vector<Coef>& coef,
              const std::vector<int>& restarts) {
  int p, q;
  bool tr;
  Mat Y = prepare(X, rows, cols, p, q, tr);
  const int T = static_cast<int>(coef.size());
  Mat R = matmul(Y, transpose(Y, p, q), p, q, p);
  Mat Q = identity(p);
  for (int t = 0; t < T; ++t) {
    const double a = coef[t].a, b = coef[t].b, c = coef[t].c;
    const bool restart = contains(restarts, t);
    if (restart && t > 0) {
      Y = matmul(Q, Y, p, p, q);
      R = matmul(Y, transpose(Y, p, q), p, q, p);
      Q = identity(p);
    }
    const Mat Z = axpby(b, R, c, matmul(R, R, p, p, p));
    if (t == 0 || restart) {
      Q = plus_identity(Z, p, a);
    } else {
      Q = axpby(1.0, matmul(Q, Z, p, p, p), a, Q);
    }
    if (t < T - 1 && !contains(restarts, t + 1)) {
      const Mat RZ = axpby(1.0, matmul(R, Z, p, p, p), a, R);
      R = axpby(1.0, matmul(Z, RZ, p, p, p), a, RZ);
    }
  }
  Y = matmul(Q, Y, p, p, q);
  return finish(Y, p, q, tr);
}

double polynomial_map(double sigma, const std::vector<Coef>& coef) {
  for (const Coef& k : coef) {
    const double s2 = sigma * sigma;
    sigma = k.a * sigma + k.b * s2 * sigma + k.c * s2 * s2 * sigma;
  }
  return sigma;
}

double adjusted_lr(double lr, Adjust adjust, int64_t m, int64_t n) {
  switch (adjust) {
    case Adjust::SpectralNorm:
      return lr * std::sqrt(static_cast<double>(m) / static_cast<double>(n));
    case Adjust::RmsNorm:
      return lr * 0.2 * std::sqrt(static_cast<double>(std::max(m, n)));
    case Adjust::None:
      return lr;
    case Adjust::SpectralNormClamped:
      return lr * std::sqrt(std::max(1.0, static_cast<double>(m) / static_cast<double>(n)));
  }
  return lr;
}

double base_lr(double lr, double fraction, bool scale) { return scale ? lr / std::sqrt(fraction) : lr; }

int64_t selected_count(double fraction, int64_t m) {
  const int64_t k = static_cast<int64_t>(std::ceil(fraction * static_cast<double>(m)));
  return std::clamp<int64_t>(k, 1, m);
}

SelectionReport select_rows(const Mat& M, int m, int n, int k) {
  Vec score(m, 0.0);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) score[i] += std::fabs(M[static_cast<size_t>(i) * n + j]);
  std::vector<int> order(m);
  std::iota(order.begin(), order.end(), 0);
  // Larger score first; equal scores: lower index first.
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return score[a] > score[b]; });
  SelectionReport rep;
  rep.selected.assign(order.begin(), order.begin() + k);
  std::sort(rep.selected.begin(), rep.selected.end());
  if (k >= m) {
    rep.gap = std::numeric_limits<double>::infinity();
  } else {
    const double sk = score[order[k - 1]], sk1 = score[order[k]];
    rep.gap = sk > 0 ? (sk - sk1) / sk : 0.0;
  }
  return rep;
}

namespace {

Mat orth(const Mat& U, int rows, int cols, const MatrixHyper& h) {
  return h.orth == OrthKind::Gram ? orth_gram(U, rows, cols, h.coef, h.restarts)
                                  : orth_standard(U, rows, cols, h.coef);
}

// algorithm.md §1 step 6 on the k x n matrix O whose rows map to variance entries v[rows[i]].
Mat normuon(const Mat& O, int k, int n, Vec& v, const std::vector<int>& rows, const MatrixHyper& h) {
  Mat Ot(O.size());
  for (int i = 0; i < k; ++i) {
    double r = 0.0;
    for (int j = 0; j < n; ++j) r += O[static_cast<size_t>(i) * n + j] * O[static_cast<size_t>(i) * n + j];
    r /= n;
    double& vi = v[rows[i]];
    vi = round_to(h.beta2 * vi + (1.0 - h.beta2) * r, Storage::F32);  // v is fp32 state
    const double denom = std::sqrt(vi) + h.epsilon;
    for (int j = 0; j < n; ++j) Ot[static_cast<size_t>(i) * n + j] = O[static_cast<size_t>(i) * n + j] / denom;
  }
  const double scale = frobenius(O) / std::max(frobenius(Ot), 1e-8);
  for (double& x : Ot) x *= scale;
  return Ot;
}

// Steps 7–8: decay every row with the base lr, then subtract lr' * update on `rows`.
void apply(Mat& W, int m, int n, const Mat& upd, const std::vector<int>& rows, double lr, double lr_adj,
           double wd, Storage ws) {
  std::vector<int> pos(m, -1);
  for (size_t i = 0; i < rows.size(); ++i) pos[rows[i]] = static_cast<int>(i);
  const double decay = 1.0 - lr * wd;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double& w = W[static_cast<size_t>(i) * n + j];
      double x = w * decay;
      if (pos[i] >= 0) x -= lr_adj * upd[static_cast<size_t>(pos[i]) * n + j];
      w = round_to(x, ws);
    }
}

}  // namespace

namespace {
// Steps 1-5 on an m x n momentum: M += G, the k rows of largest l1 score, U = M[S,:] taken before
// the error feedback on those rows, O = orth(U) (k x n).
SelectionReport select_and_orthogonalize(Mat& M, const Mat& G, int m, int n, const MatrixHyper& h, Mat& O) {
  for (size_t i = 0; i < M.size(); ++i) M[i] = round_to(M[i] + G[i], h.m_store);
  const int k = static_cast<int>(selected_count(h.fraction, m));
  SelectionReport rep = select_rows(M, m, n, k);
  Mat U(static_cast<size_t>(k) * n);
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < n; ++j) U[static_cast<size_t>(i) * n + j] = M[static_cast<size_t>(rep.selected[i]) * n + j];
  for (int r : rep.selected)
    for (int j = 0; j < n; ++j) {
      double& x = M[static_cast<size_t>(r) * n + j];
      x = round_to(h.mu * x, h.m_store);
    }
  O = orth(U, k, n, h);
  return rep;
}
}  // namespace

SelectionReport dion3_step(Mat& W, Mat& M, Vec& v, const Mat& G, int m, int n, const MatrixHyper& h) {
  Mat O;
  SelectionReport rep = select_and_orthogonalize(M, G, m, n, h, O);  // steps 1-5
  // 6. NorMuon on the selected rows
  const Mat Ot = normuon(O, static_cast<int>(rep.selected.size()), n, v, rep.selected, h);
  // 7–8. decay and update with the full-shape lr'
  const double lr = base_lr(h.lr, h.fraction, h.scale_lr_by_fraction);
  apply(W, m, n, Ot, rep.selected, lr, adjusted_lr(lr, h.adjust, m, n), h.weight_decay, h.w_store);
  return rep;
}

SelectionReport dion2_step(Mat& W, Mat& M, const Mat& G, int m, int n, const MatrixHyper& h) {
  const bool by_columns = m > n;
  // On the transposes, a tall matrix's columns are rows: p x q with p <= q.
  const int p = by_columns ? n : m, q = by_columns ? m : n;
  Mat Wp = by_columns ? transpose(W, m, n) : W, Mp = by_columns ? transpose(M, m, n) : M;
  Mat O;
  SelectionReport rep = select_and_orthogonalize(Mp, by_columns ? transpose(G, m, n) : G, p, q, h, O);
  const double lr = base_lr(h.lr, h.fraction, h.scale_lr_by_fraction);
  apply(Wp, p, q, O, rep.selected, lr, adjusted_lr(lr, h.adjust, m, n), h.weight_decay, h.w_store);
  W = by_columns ? transpose(Wp, p, q) : Wp;
  M = by_columns ? transpose(Mp, p, q) : Mp;
  return rep;
}

namespace {
Mat muon_direction(Mat& M, const Mat& G, int m, int n, const MatrixHyper& h) {
  const double c = h.ema_momentum ? 1.0 - h.mu : 1.0;  // the gradient's share
  for (size_t i = 0; i < M.size(); ++i) M[i] = round_to(h.mu * M[i] + c * G[i], h.m_store);
  Mat U = M;
  if (h.nesterov)
    for (size_t i = 0; i < U.size(); ++i) U[i] = h.mu * M[i] + c * G[i];
  return orth(U, m, n, h);
}
std::vector<int> all_rows(int m) {
  std::vector<int> r(m);
  std::iota(r.begin(), r.end(), 0);
  return r;
}
}  // namespace

namespace {
// NorMuon on the rows of O (k x n, rows[i] ascending) shard by shard: each shard's rows get their
// own Frobenius rescale (algorithm.md §3).
Mat normuon_per_shard(const Mat& O, int n, Vec& v, const std::vector<int>& rows, int c, const MatrixHyper& h) {
  Mat Ot(O.size());
  std::size_t i = 0;
  while (i < rows.size()) {
    std::size_t e = i;
    while (e < rows.size() && rows[e] / c == rows[i] / c) ++e;
    const int k = static_cast<int>(e - i);
    const Mat part(O.begin() + static_cast<long>(i * n), O.begin() + static_cast<long>(e * n));
    const std::vector<int> part_rows(rows.begin() + static_cast<long>(i), rows.begin() + static_cast<long>(e));
    const Mat normed = normuon(part, k, n, v, part_rows, h);
    std::copy(normed.begin(), normed.end(), Ot.begin() + static_cast<long>(i * n));
    i = e;
  }
  return Ot;
}
}  // namespace

std::vector<int> dion3_step_sharded(Mat& W, Mat& M, Vec& v, const Mat& G, int m, int n, const MatrixHyper& h,
                                    int ranks, Scope scope) {
  for (size_t i = 0; i < M.size(); ++i) M[i] = round_to(M[i] + G[i], h.m_store);
  const int c = (m + ranks - 1) / ranks;
  std::vector<int> selected;
  if (scope == Scope::Global) {
    selected = select_rows(M, m, n, static_cast<int>(selected_count(h.fraction, m))).selected;
  } else {
    const int k_loc = static_cast<int>(std::ceil(h.fraction * c));
    for (int r = 0; r < ranks; ++r) {
      const int a = std::min(m, r * c), b = std::min(m, a + c);
      if (b == a) continue;
      const Mat shard(M.begin() + static_cast<long>(a) * n, M.begin() + static_cast<long>(b) * n);
      for (int i : select_rows(shard, b - a, n, std::min(k_loc, b - a)).selected) selected.push_back(a + i);
    }
  }
  const int k = static_cast<int>(selected.size());
  Mat U(static_cast<size_t>(k) * n);
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < n; ++j) U[static_cast<size_t>(i) * n + j] = M[static_cast<size_t>(selected[i]) * n + j];
  for (int r : selected)
    for (int j = 0; j < n; ++j) {
      double& x = M[static_cast<size_t>(r) * n + j];
      x = round_to(h.mu * x, h.m_store);
    }
  const Mat O = orth(U, k, n, h);
  const Mat Ot = normuon_per_shard(O, n, v, selected, c, h);
  const double lr = base_lr(h.lr, h.fraction, h.scale_lr_by_fraction);
  apply(W, m, n, Ot, selected, lr, adjusted_lr(lr, h.adjust, m, n), h.weight_decay, h.w_store);
  return selected;
}

void normuon_step_sharded(Mat& W, Mat& M, Vec& v, const Mat& G, int m, int n, const MatrixHyper& h, int ranks) {
  const Mat O = muon_direction(M, G, m, n, h);
  const std::vector<int> rows = all_rows(m);
  const Mat Ot = normuon_per_shard(O, n, v, rows, (m + ranks - 1) / ranks, h);
  apply(W, m, n, Ot, rows, h.lr, adjusted_lr(h.lr, h.adjust, m, n), h.weight_decay, h.w_store);
}

void normuon_step(Mat& W, Mat& M, Vec& v, const Mat& G, int m, int n, const MatrixHyper& h) {
  const Mat O = muon_direction(M, G, m, n, h);
  const std::vector<int> rows = all_rows(m);
  const Mat Ot = normuon(O, m, n, v, rows, h);
  apply(W, m, n, Ot, rows, h.lr, adjusted_lr(h.lr, h.adjust, m, n), h.weight_decay, h.w_store);
}

void muon_step(Mat& W, Mat& M, const Mat& G, int m, int n, const MatrixHyper& h) {
  const Mat O = muon_direction(M, G, m, n, h);
  apply(W, m, n, O, all_rows(m), h.lr, adjusted_lr(h.lr, h.adjust, m, n), h.weight_decay, h.w_store);
}

void adamw_step(Vec& W, Vec& m, Vec& v, const Vec& G, int64_t& t, const ElemHyper& h) {
  t += 1;
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(t));
  for (size_t i = 0; i < W.size(); ++i) {
    const double g = G[i];
    m[i] = round_to(m[i] + (1.0 - h.beta1) * (g - m[i]), h.s_store);  // lerp(m, g, 1 - b1)
    v[i] = round_to(v[i] + (1.0 - h.beta2) * (g * g - v[i]), h.s_store);
    const double mhat = m[i] / bc1, vhat = v[i] / bc2;
    W[i] = round_to(W[i] * (1.0 - h.lr * h.weight_decay) - h.lr * mhat / (std::sqrt(vhat) + h.epsilon), h.w_store);
  }
}

void lion_step(Vec& W, Vec& m, const Vec& G, const ElemHyper& h) {
  for (size_t i = 0; i < W.size(); ++i) {
    const double g = G[i];
    const double c = m[i] + (1.0 - h.beta1) * (g - m[i]);
    const double u = (c > 0) - (c < 0);
    m[i] = round_to(m[i] + (1.0 - h.beta2) * (g - m[i]), h.s_store);
    W[i] = round_to(W[i] * (1.0 - h.lr * h.weight_decay) - h.lr * u, h.w_store);
  }
}

}  // namespace ref
