// dion3/config.hpp — every hyper-parameter of a parameter group and of orthogonalization.
//
// Names and defaults follow the public reference `dion.Dion3` (algorithm.md §1, §4) so that user
// code moves over unchanged. Validation lives in validate(); it throws dion3::Error naming the
// field, what was expected and what was given.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "dion3/export.h"
#include "dion3/view.hpp"

namespace dion3 {

// Dion2 is Dion3 without the NorMuon normalisation; on a matrix that is not sharded it selects
// along the shorter dimension (columns of a tall (out, in) matrix), as the reference's Dion2 does.
enum class Algorithm : int { Dion3 = 0, NorMuon = 1, Muon = 2, AdamW = 3, Lion = 4, Dion2 = 5 };
// SpectralNormClamped: eta * sqrt(max(1, m / n)), the original Muon's (torch.optim.Muon's default).
enum class AdjustLR : int { SpectralNorm = 0, RmsNorm = 1, None = 2, SpectralNormClamped = 3 };
// Auto picks, per shape, the cheaper of the two by the backend's cost model, and standard where Gram
// would iterate in bfloat16 (algorithm.md §2).
enum class OrthMethod : int { Auto = 0, Standard = 1, Gram = 2 };
enum class NonFinitePolicy : int { Raise = 0, Skip = 1 };
// Row selection of row-sharded Dion3 (algorithm.md §3): each shard picks its own top rows (Local), or
// the exact single-device top-k of the whole matrix (Global: one more collective, more rows sent).
enum class SelectionScope : int { Local = 0, Global = 1 };

DION3_API const char* algorithm_name(Algorithm a);
// "dion3"/"nordion2", "dion2", "normuon", "muon", "adamw", "lion"
DION3_API Algorithm parse_algorithm(const std::string& name);
// "spectral_norm", "rms_norm", "none", "spectral_norm_clamped"
DION3_API AdjustLR parse_adjust_lr(const std::string& name);
DION3_API OrthMethod parse_orth_method(const std::string& name);  // "auto", "standard", "gram"
DION3_API NonFinitePolicy parse_nonfinite(const std::string& name);  // "raise", "skip"
DION3_API SelectionScope parse_selection_scope(const std::string& name);  // "local", "global"
DION3_API bool is_matrix_algorithm(Algorithm a);
// Dion3 and Dion2: a fraction of the rows orthogonalized per step, with error feedback.
DION3_API bool selects_rows(Algorithm a);
// Dion3 and NorMuon: the per-row second-moment normalisation (and its variance state).
DION3_API bool normalizes_rows(Algorithm a);

using Coefficients = std::array<double, 3>;  // (a, b, c) of one quintic step

// Polar Express with safety 1.05 (the default) and five tuned quintic steps ("You"; torch's classic
// Muon repeats (3.4445, -4.775, 2.0315) five times: custom coefficients).
DION3_API const std::vector<Coefficients>& polar_express_coefficients();
DION3_API const std::vector<Coefficients>& you_coefficients();
// The reference package's default set: Polar Express with a 2% safety factor, whose input is
// scaled by 1.02 times its Frobenius norm; that margin is folded into the first step here, so it
// runs on the input as this library normalises it.
DION3_API const std::vector<Coefficients>& reference_coefficients();

// How the Newton-Schulz input is scaled by its Frobenius norm (algorithm.md §2): X / (||X||_F + eps),
// the reference's rule, or with `floor` X / max(||X||_F, eps), torch.optim.Muon's (above eps the
// update is then independent of the momentum's scale).
struct NormGuard {
  float eps = 1e-7f;
  bool floor = false;
  bool operator==(const NormGuard&) const = default;
};

struct DION3_API OrthConfig {
  // validate() refuses coefficients that take a singular value in [0, 1] beyond this.
  static constexpr double kMaxSingularValue = 8.0;
  OrthMethod method = OrthMethod::Auto;
  std::vector<Coefficients> coefficients = polar_express_coefficients();
  std::vector<int> restarts = {2};       // Gram NS restart positions (t > 0 take effect)
  // Iteration dtype. nullopt = the backend's choice (CPU: F32; CUDA: F16 for Gram, BF16 standard).
  std::optional<DType> iteration_dtype;
  NormGuard norm;
  // The largest product of |a| over the steps between two restarts: Gram NS's growth of Q along
  // directions the input does not span (zero rows, null singular values). R's eigenvalues there,
  // rounding noise of either sign about the iteration dtype's unit roundoff u, grow by its square,
  // and a negative one that nears order 1 diverges (garbage or NaN from a finite rank-deficient
  // input). max_gram_growth keeps growth^2 * u at most 1: about 45 in float16, 4096 in float32.
  double gram_growth() const;
  static double max_gram_growth(DType iteration);
  bool gram_diverges(DType iteration) const { return !(gram_growth() <= max_gram_growth(iteration)); }
  // Empty, or why Gram NS must not iterate in `iteration` with these coefficients and restarts.
  std::string gram_divergence_error(DType iteration) const;

  void validate() const;
  // Throws unless eps is a finite float32 of at least kMinNormEps; checked in double, so a value
  // a front end has yet to narrow is named as given rather than as its float32 rounding.
  static void check_norm_eps(double eps);
  // The smallest norm_eps: a norm of it squares to 1e-36, summed over up to a million rows
  // without falling into float32's subnormal range, where the sums would lose their precision.
  static constexpr double kMinNormEps = 1e-18;
};

struct DION3_API GroupConfig {
  Algorithm algorithm = Algorithm::Dion3;
  double lr = 0.01;
  double fraction = 0.25;
  double mu = 0.95;
  double muon_beta2 = 0.95;
  std::array<double, 2> betas = {0.9, 0.95};  // AdamW / Lion
  double weight_decay = 0.01;
  double epsilon = 1e-8;
  AdjustLR adjust_lr = AdjustLR::SpectralNorm;
  bool flatten = false;       // >= 3-D tensors: (dim0, rest) if true, else batches of matrices
  bool nesterov = false;      // Muon / NorMuon
  // Muon / NorMuon: the momentum as an average, M = mu*M + (1 - mu)*G (with nesterov, the update
  // reads mu*M + (1 - mu)*G), the buffer torch.optim.Muon keeps; false: M = mu*M + G.
  bool ema_momentum = false;
  // Matrix algorithms: decay only where update and weight agree in sign (Dion3 / Dion2: the rows
  // or columns not selected have no update, so no decay).
  bool cautious_wd = false;
  bool scale_lr_by_fraction = false;  // Dion3, Dion2: use lr / sqrt(fraction) (the paper's scaling law)
  // Matrix algorithms' momentum; nullopt = the parameter's dtype. AdamW's and Lion's moments
  // always take the parameter's dtype (as torch.optim's).
  std::optional<DType> momentum_dtype;
  SelectionScope selection_scope = SelectionScope::Local;  // row-sharded Dion3 only
  // Row blocks of one matrix, each orthogonalized as a matrix of its own (its own selection,
  // NorMuon rescale and shape-adjusted lr), e.g. the query, key and value blocks of a fused QKV
  // weight. split_sizes: the blocks' heights, summing to the rows of each matrix; num_heads = h:
  // h blocks of equal height (attention heads). At most one of the two; empty / 0 or 1: none.
  // In a transposed group (Dion3, NorMuon) the blocks are of output features: stored columns.
  std::vector<int64_t> split_sizes;
  int64_t num_heads = 0;
  // Matrix algorithms: the weights are stored (in, out), as x @ W reads them (Hugging Face's
  // Conv1D, some expert stacks), so their stored columns are the output features: Dion3 selects
  // and NorMuon normalises columns, and adjust_lr takes the (out, in) shape. Those two take whole
  // matrices, or ones cut along their stored rows in ceil(m/P) chunks. Element-wise algorithms
  // ignore it, as they do flatten.
  bool transposed = false;
  OrthConfig orth;

  void validate() const;  // throws dion3::Error naming the offending field
  // Learning rate actually applied to the matrix update of an m x n matrix (algorithm.md §1 step 8).
  double adjusted_lr(int64_t m, int64_t n) const;
  // Base lr after the opt-in fraction scaling.
  double base_lr() const;
  // Heights of the row blocks of a matrix with `rows` rows: {rows} when the group splits nothing;
  // throws dion3::Error naming split_sizes / num_heads when they do not cut `rows`.
  std::vector<int64_t> row_blocks(int64_t rows) const;
};

}  // namespace dion3
