// tests/cpp/reference.hpp — a float64 transcription of docs/algorithm.md, independent of the library.
//
// Everything here is plain loops over std::vector<double> holding row-major matrices. It knows
// nothing of dion3's headers on purpose: it is what the optimised paths are checked against.
// Storage rounding (the parameter / state dtype of the tensor the library writes to) can be
// emulated with `Storage`, so that bf16/f16 parameters can be compared step by step.
#pragma once

#include <cstdint>
#include <vector>

namespace ref {

using Mat = std::vector<double>;  // row-major
using Vec = std::vector<double>;

struct Coef {
  double a, b, c;
};

// Coefficient sets as printed in algorithm.md §2 (T = 5).
std::vector<Coef> polar_express();
std::vector<Coef> you();

// The dtype a value is stored in after each write (round to nearest even).
enum class Storage { F64, F32, BF16, F16 };
double round_to(double x, Storage s);

// --- small dense linear algebra --------------------------------------------------------------
Mat transpose(const Mat& A, int rows, int cols);
Mat matmul(const Mat& A, const Mat& B, int m, int k, int n);  // (m x k) * (k x n)
Mat identity(int n);
double frobenius(const Mat& A);

// --- algorithm.md §2 --------------------------------------------------------------------------------
// Standard quintic Newton–Schulz; transposes when rows > cols; normalises by ||X||_F + 1e-7.
Mat orth_standard(const Mat& X, int rows, int cols, const std::vector<Coef>& coef);
// Gram Newton–Schulz with restarts, the pseudo-code of algorithm.md §2 line by line.
Mat orth_gram(const Mat& X, int rows, int cols, const std::vector<Coef>& coef,
              const std::vector<int>& restarts);
// The scalar map the quintic iteration applies to each singular value of the normalised input.
double polynomial_map(double sigma, const std::vector<Coef>& coef);

// --- algorithm.md §1 / §4 ---------------------------------------------------------------------------
enum class Adjust { SpectralNorm, RmsNorm, None, SpectralNormClamped };
// lr' for an m x n matrix from the base lr (step 8).
double adjusted_lr(double base_lr, Adjust adjust, int64_t m, int64_t n);
// The base lr after the opt-in fraction scaling (lr / sqrt(f)).
double base_lr(double lr, double fraction, bool scale_lr_by_fraction);

enum class OrthKind { Standard, Gram };

struct MatrixHyper {
  double lr = 0.01;
  double fraction = 0.25;
  double mu = 0.95;
  double beta2 = 0.95;
  double weight_decay = 0.01;
  double epsilon = 1e-8;
  Adjust adjust = Adjust::SpectralNorm;
  bool scale_lr_by_fraction = false;  // Dion3 only
  bool nesterov = false;              // Muon / NorMuon
  bool ema_momentum = false;          // Muon / NorMuon: M = mu M + (1 - mu) G
  OrthKind orth = OrthKind::Standard;
  std::vector<Coef> coef = polar_express();
  std::vector<int> restarts = {2};
  Storage w_store = Storage::F64;  // weight dtype
  Storage m_store = Storage::F64;  // momentum dtype
};

struct SelectionReport {
  std::vector<int> selected;  // ascending row indices of S
  // (score_k - score_{k+1}) / score_k: how far the selection is from a tie (inf when k == m).
  double gap = 0.0;
};

// Top-k rows by l1 score, ties to the lower index; result in ascending order.
SelectionReport select_rows(const Mat& M, int m, int n, int k);
int64_t selected_count(double fraction, int64_t m);  // ceil(f*m), at least 1

// One Dion3 step on one m x n matrix (algorithm.md §1 steps 1–8). Mutates W, M and v (length m).
SelectionReport dion3_step(Mat& W, Mat& M, Vec& v, const Mat& G, int m, int n, const MatrixHyper& h);
// One Dion2 step: steps 1-5, 7 and 8 (no NorMuon, no variance). A tall matrix (m > n) selects
// columns instead of rows: k = ceil(f*n) columns by l1 score, the same steps on the transposes,
// lr' still from the stored shape (m, n). The report lists the selected rows or columns.
SelectionReport dion2_step(Mat& W, Mat& M, const Mat& G, int m, int n, const MatrixHyper& h);
// NorMuon: Muon's momentum, then step 6 on all rows.
void normuon_step(Mat& W, Mat& M, Vec& v, const Mat& G, int m, int n, const MatrixHyper& h);
// Muon: M <- mu*M + G; U = M (Nesterov: mu*M + G); W <- W(1 - lr*wd) - lr'*orth(U).
void muon_step(Mat& W, Mat& M, const Mat& G, int m, int n, const MatrixHyper& h);

// algorithm.md §3, row-sharded: the m rows are split over P ranks in contiguous chunks of c = ceil(m/P)
// (the last short or empty). Local scope: each shard selects its own ceil(f*c) top rows (all of
// them when it holds fewer); global scope: the whole matrix's top ceil(f*m) rows. The selected
// rows are orthogonalized together as one matrix (shard by shard, ascending), and NorMuon's
// Frobenius rescale runs on each shard's rows separately. Returns the selected rows.
enum class Scope { Local, Global };
std::vector<int> dion3_step_sharded(Mat& W, Mat& M, Vec& v, const Mat& G, int m, int n, const MatrixHyper& h,
                                    int ranks, Scope scope);
// NorMuon row-sharded: every row orthogonalized together, the rescale per shard.
void normuon_step_sharded(Mat& W, Mat& M, Vec& v, const Mat& G, int m, int n, const MatrixHyper& h, int ranks);

struct ElemHyper {
  double lr = 0.01;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double weight_decay = 0.01;
  double epsilon = 1e-8;
  Storage w_store = Storage::F64;
  Storage s_store = Storage::F64;
};

// Bias-corrected AdamW (algorithm.md §4); `t` is the step count before the call and is incremented.
void adamw_step(Vec& W, Vec& m, Vec& v, const Vec& G, int64_t& t, const ElemHyper& h);
// Lion (algorithm.md §4).
void lion_step(Vec& W, Vec& m, const Vec& G, const ElemHyper& h);

}  // namespace ref
