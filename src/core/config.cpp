// config.cpp — hyper-parameter parsing, validation and the learning-rate rules of algorithm.md §1.
#include "dion3/config.hpp"

#include <cfloat>
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/format.hpp"
#include "dion3/error.hpp"

namespace dion3 {

namespace {

void require_nonnegative(const char* field, double v) {
  if (!(v >= 0.0) || !std::isfinite(v))
    fail(std::string("'") + field + "' must be a finite number >= 0, got " + format_number(v));
}

// Every backend applies hyper-parameters as float32: a value that is fine as a double but
// overflows, or rounds to 0 or 1, in float32 would poison the weights, so the checks below are
// made on the float32 value the step uses.
float as_float(double v) { return static_cast<float>(v); }

void require_float(const char* field, double v) {
  if (!std::isfinite(as_float(v)))
    fail(std::string("'") + field + "' = " + format_number(v) + " is not finite in float32, the precision the step uses");
}

void require_unit_interval(const char* field, double v) {
  if (!(v >= 0.0 && v < 1.0)) fail(std::string("'") + field + "' must lie in [0, 1), got " + format_number(v));
  if (!(as_float(v) < 1.0f))
    fail(std::string("'") + field + "' = " + format_number(v) + " rounds to 1 in float32, the precision the step uses; "
         "it must lie in [0, 1) there");
}

// Largest |sigma| the quintic steps reach from any singular value in [0, 1] (the input of the
// iteration is scaled so that its singular values lie there), sampled densely.
double sample_singular_values(const std::vector<Coefficients>& steps) {
  constexpr int kSamples = 4096;
  double worst = 0.0;
  for (int i = 0; i <= kSamples; ++i) {
    double x = static_cast<double>(i) / kSamples;
    for (const Coefficients& c : steps) {
      const double x2 = x * x;
      x = x * (c[0] + x2 * (c[1] + x2 * c[2]));
      if (!std::isfinite(x)) return x;
      worst = std::max(worst, std::fabs(x));
    }
  }
  return worst;
}

// Groups are validated at every step (they may be edited between steps) while their
// coefficients rarely change: the last answer is kept, per thread.
double largest_singular_value_reached(const std::vector<Coefficients>& steps) {
  thread_local std::vector<Coefficients> last_steps;
  thread_local double last_reach = 0.0;
  if (last_steps.empty() || steps != last_steps) {
    last_reach = sample_singular_values(steps);
    last_steps = steps;
  }
  return last_reach;
}

}  // namespace

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::Dion3: return "dion3";
    case Algorithm::NorMuon: return "normuon";
    case Algorithm::Muon: return "muon";
    case Algorithm::AdamW: return "adamw";
    case Algorithm::Lion: return "lion";
    case Algorithm::Dion2: return "dion2";
  }
  return "unknown";
}

Algorithm parse_algorithm(const std::string& name) {
  if (name == "dion3" || name == "nordion2") return Algorithm::Dion3;
  if (name == "dion2") return Algorithm::Dion2;
  if (name == "normuon") return Algorithm::NorMuon;
  if (name == "muon") return Algorithm::Muon;
  if (name == "adamw") return Algorithm::AdamW;
  if (name == "lion") return Algorithm::Lion;
  fail("'algorithm' must be one of dion3, nordion2, dion2, normuon, muon, adamw, lion; got '" + name + "'");
}

AdjustLR parse_adjust_lr(const std::string& name) {
  if (name == "spectral_norm") return AdjustLR::SpectralNorm;
  if (name == "rms_norm") return AdjustLR::RmsNorm;
  if (name == "none" || name == "None" || name.empty()) return AdjustLR::None;
  if (name == "spectral_norm_clamped") return AdjustLR::SpectralNormClamped;
  fail("'adjust_lr' must be 'spectral_norm', 'rms_norm', 'spectral_norm_clamped' or None; got '" + name + "'");
}

OrthMethod parse_orth_method(const std::string& name) {
  if (name == "auto") return OrthMethod::Auto;
  if (name == "standard") return OrthMethod::Standard;
  if (name == "gram") return OrthMethod::Gram;
  fail("'orthogonalizer' must be 'auto', 'standard' or 'gram'; got '" + name + "'");
}

SelectionScope parse_selection_scope(const std::string& name) {
  if (name == "local") return SelectionScope::Local;
  if (name == "global") return SelectionScope::Global;
  fail("'selection_scope' must be 'local' or 'global'; got '" + name + "'");
}

NonFinitePolicy parse_nonfinite(const std::string& name) {
  if (name == "raise") return NonFinitePolicy::Raise;
  if (name == "skip") return NonFinitePolicy::Skip;
  fail("'on_nonfinite' must be 'raise' or 'skip'; got '" + name + "'");
}

bool is_matrix_algorithm(Algorithm a) {
  return a == Algorithm::Dion3 || a == Algorithm::Dion2 || a == Algorithm::NorMuon || a == Algorithm::Muon;
}
bool selects_rows(Algorithm a) { return a == Algorithm::Dion3 || a == Algorithm::Dion2; }
bool normalizes_rows(Algorithm a) { return a == Algorithm::Dion3 || a == Algorithm::NorMuon; }

const std::vector<Coefficients>& polar_express_coefficients() {
  static const std::vector<Coefficients> c = {
      {7.892582874424408, -20.383013945879568, 13.555306149406924},
      {3.911484868135431, -2.546463592906088, 0.426898831967307},
      {3.760657955697423, -2.512819018216563, 0.432364734907007},
      {3.160399673686287, -2.149649518898498, 0.399636690766439},
      {2.191097161861730, -1.441662010214663, 0.328146487623155},
  };
  return c;
}

const std::vector<Coefficients>& you_coefficients() {
  static const std::vector<Coefficients> c = {
      {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
      {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012},
  };
  return c;
}

const std::vector<Coefficients>& reference_coefficients() {
  static const std::vector<Coefficients> c = [] {
    std::vector<Coefficients> v = {
        {8.156554524902461, -22.48329292557795, 15.878769915207462},
        {4.042929935166739, -2.808917465908714, 0.5000178451051316},
        {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
        {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
        {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
    };
    // Step 1 on X / (1.02 |X|) is a X/1.02 + b (XXᵀ)X/1.02³ + c (XXᵀ)²X/1.02⁵ on X / |X|.
    const double s = 1.02;
    v[0] = {v[0][0] / s, v[0][1] / (s * s * s), v[0][2] / (s * s * s * s * s)};
    return v;
  }();
  return c;
}

void OrthConfig::check_norm_eps(double eps) {
  // The norm is summed from squares kept in float32: a norm below this floor may lose its
  // precision there (to nothing, whereupon 1 / eps would blow the input up past the band).
  if (!(eps >= kMinNormEps) || !(eps <= std::numeric_limits<float>::max()))
    fail("'norm_eps' (the guard on the Newton-Schulz input's norm) must be a finite float32 of at least " +
         format_number(kMinNormEps) + " (the norm comes from sums of squares kept in float32), got " +
         format_number(eps));
}

void OrthConfig::validate() const {
  if (coefficients.empty()) fail("'coefficients' must hold at least one (a, b, c) step, got none");
  for (std::size_t i = 0; i < coefficients.size(); ++i)
    for (double v : coefficients[i])
      if (!std::isfinite(as_float(v)))
        fail("'coefficients' step " + std::to_string(i) + " holds " + format_number(v) +
             ", which is not finite in float32, the precision the step uses");
  // Steps that blow singular values up overflow the low-precision iteration into Inf/NaN.
  if (const double reach = largest_singular_value_reached(coefficients); !(reach <= kMaxSingularValue))
    fail("'coefficients' take singular values in [0, 1] to " + format_number(reach) + " (more than " + format_number(kMaxSingularValue) +
         "); Newton-Schulz steps must keep them near 1, or the iteration overflows");
  for (int r : restarts)
    if (r < 0 || r >= static_cast<int>(coefficients.size()))
      fail("'restarts' positions must lie in [0, " + std::to_string(coefficients.size()) + "), got " +
           std::to_string(r) + (restarts == OrthConfig{}.restarts ? " (the default; with fewer steps give 'restarts', "
                                "e.g. none)" : ""));
  check_norm_eps(norm.eps);
  if (iteration_dtype && !is_float_param_dtype(*iteration_dtype))
    fail(std::string("'iteration_dtype' must be float32, float16 or bfloat16, got ") +
         dtype_name(*iteration_dtype));
  if (method == OrthMethod::Gram && iteration_dtype)
    if (const std::string e = gram_divergence_error(*iteration_dtype); !e.empty()) fail(e);
}

double OrthConfig::gram_growth() const {
  double worst = 0.0, product = 1.0;
  for (std::size_t t = 0; t < coefficients.size(); ++t) {
    if (t > 0 && std::find(restarts.begin(), restarts.end(), static_cast<int>(t)) != restarts.end()) product = 1.0;
    product *= std::fabs(coefficients[t][0]);
    worst = std::max(worst, product);
  }
  return worst;
}

double OrthConfig::max_gram_growth(DType iteration) {
  // growth^2 * u <= 1: well inside the edge where the sweeps over rank-deficient inputs saw the
  // result's largest singular value leave the band (bench/results/, gram-divergence).
  const double u = iteration == DType::F32 ? 0x1p-24 : iteration == DType::F16 ? 0x1p-11 : 0x1p-8;
  return std::sqrt(1.0 / u);
}

std::string OrthConfig::gram_divergence_error(DType iteration) const {
  if (!gram_diverges(iteration)) return "";
  return std::string("Gram Newton-Schulz in ") + dtype_name(iteration) + " with these coefficients and restarts grows Q by " +
         format_number(gram_growth()) + " between restarts (the product of their a), more than " +
         format_number(max_gram_growth(iteration)) + ": rounding noise along directions the input does not span (a " +
         "rank-deficient gradient) would then diverge; add 'restarts' or fewer steps, " +
         (iteration == DType::F32 ? "or use the standard method" : "use the standard method, or iterate in float32");
}

void GroupConfig::validate() const {
  // Enums set from integers out of range (C++ casts; the C API's reader refuses them itself).
  auto known = [](const char* what, auto value, auto last) {
    const int v = static_cast<int>(value);
    if (v < 0 || v > static_cast<int>(last))
      fail(std::string("'") + what + "' = " + std::to_string(v) + " names no value (0 to " +
           std::to_string(static_cast<int>(last)) + ")");
  };
  known("algorithm", algorithm, Algorithm::Dion2);
  known("adjust_lr", adjust_lr, AdjustLR::SpectralNormClamped);
  known("orth.method", orth.method, OrthMethod::Gram);
  known("selection_scope", selection_scope, SelectionScope::Global);
  require_nonnegative("lr", lr);
  require_float("lr", lr);
  require_nonnegative("weight_decay", weight_decay);
  require_float("weight_decay", weight_decay);
  if (!(epsilon > 0.0)) fail("'epsilon' must be > 0, got " + format_number(epsilon));
  // A subnormal epsilon is flushed to zero by GPU arithmetic: 0/0 where a moment is zero.
  if (!(as_float(epsilon) >= FLT_MIN) || !std::isfinite(as_float(epsilon)))
    fail("'epsilon' = " + format_number(epsilon) + " is not a normal float32 number (it must lie in [" + format_number(FLT_MIN) + ", " +
         format_number(FLT_MAX) + "], the precision the step uses)");
  if (is_matrix_algorithm(algorithm)) {
    if (!(fraction > 0.0 && fraction <= 1.0))
      fail("'fraction' must lie in (0, 1], got " + format_number(fraction));
    require_unit_interval("mu", mu);
    require_unit_interval("muon_beta2", muon_beta2);
    if (momentum_dtype && !is_float_param_dtype(*momentum_dtype))
      fail(std::string("'momentum_dtype' must be float32, float16 or bfloat16, got ") +
           dtype_name(*momentum_dtype));
    orth.validate();
  } else {
    require_unit_interval("betas[0]", betas[0]);
    require_unit_interval("betas[1]", betas[1]);
  }
  if (ema_momentum && algorithm != Algorithm::Muon && algorithm != Algorithm::NorMuon)
    fail(std::string("'ema_momentum' is a setting of muon and normuon (the form of their momentum); ") +
         algorithm_name(algorithm) + " does not take it");
  for (int64_t s : split_sizes)
    if (s < 1) fail("'split_sizes' must hold block sizes >= 1, got " + std::to_string(s));
  if (num_heads < 0) fail("'num_heads' must be >= 1 (or 0: none), got " + std::to_string(num_heads));
  if (!split_sizes.empty() && num_heads > 1)
    fail("'split_sizes' and 'num_heads' both cut the matrices into blocks; give one of them");
  if ((!split_sizes.empty() || num_heads > 1) && !is_matrix_algorithm(algorithm))
    fail(std::string("'split_sizes' and 'num_heads' cut matrices into blocks; ") + algorithm_name(algorithm) +
         " steps element-wise and takes neither");
  // A transposed group's blocks are of output features, its stored columns: the cut Dion3 and
  // NorMuon step by columns; Muon steps the stored matrix as it is.
  if (transposed && (!split_sizes.empty() || num_heads > 1) && algorithm == Algorithm::Muon)
    fail("'split_sizes' and 'num_heads' in a 'transposed' group cut the output features, its stored columns, "
         "which muon does not step apart: use dion3 or normuon, or give the blocks as separate parameters");
  if ((!split_sizes.empty() || num_heads > 1) && algorithm == Algorithm::Dion2)
    fail("'split_sizes' and 'num_heads' are not available for dion2 (it may select columns, which cross the row "
         "blocks; the reference's Dion2 takes whole matrices): use dion3, or give the blocks as separate parameters");
  if (!std::isfinite(as_float(base_lr())))
    fail("'lr' = " + format_number(lr) + " scaled by scale_lr_by_fraction (lr / sqrt(fraction = " + format_number(fraction) +
         ")) is " + format_number(base_lr()) + ", which is not finite in float32, the precision the step uses");
  if (!std::isfinite(as_float(base_lr()) * as_float(weight_decay)))
    fail("the decay factor lr * weight_decay = " + format_number(base_lr()) + " * " + format_number(weight_decay) +
         " is not finite in float32, the precision the step uses");
}

double GroupConfig::base_lr() const {
  if (selects_rows(algorithm) && scale_lr_by_fraction) return lr / std::sqrt(fraction);
  return lr;
}

std::vector<int64_t> GroupConfig::row_blocks(int64_t rows) const {
  // What the blocks cut: a transposed group's are of stored columns (output features).
  const std::string what = transposed ? " stored columns" : " rows";
  if (num_heads > 1) {
    if (rows % num_heads != 0)
      fail("'num_heads' = " + std::to_string(num_heads) + " does not divide the matrix's " + std::to_string(rows) +
           what + " into heads of equal size");
    return std::vector<int64_t>(static_cast<std::size_t>(num_heads), rows / num_heads);
  }
  if (split_sizes.empty()) return {rows};
  int64_t sum = 0;
  bool past = false;  // a height past the rows, or a sum past int64: heights that wrap could sum to rows
  for (int64_t s : split_sizes) past = past || s > rows || __builtin_add_overflow(sum, s, &sum);
  if (past || sum != rows) {
    std::string list;
    for (int64_t s : split_sizes) list += (list.empty() ? "" : ", ") + std::to_string(s);
    fail("'split_sizes' [" + list + "] sum to " +
         (past ? "more" + what + " than the matrix's " + std::to_string(rows) :
                 std::to_string(sum) + what + " but the matrix has " + std::to_string(rows)));
  }
  return split_sizes;
}

double GroupConfig::adjusted_lr(int64_t m, int64_t n) const {
  const double eta = base_lr();
  switch (adjust_lr) {
    case AdjustLR::SpectralNorm: return eta * std::sqrt(static_cast<double>(m) / static_cast<double>(n));
    case AdjustLR::RmsNorm: return eta * 0.2 * std::sqrt(static_cast<double>(std::max(m, n)));
    case AdjustLR::None: return eta;
    case AdjustLR::SpectralNormClamped:
      return eta * std::sqrt(std::max(1.0, static_cast<double>(m) / static_cast<double>(n)));
  }
  return eta;
}

}  // namespace dion3
