// c_config.cpp — dion3_group_config <-> GroupConfig (see c_config.hpp), and the C API's defaults.
#include "core/c_config.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>


namespace dion3::capi {

// ema_momentum took the padding before split_sizes: programs built against the older header keep
// the same layout.
static_assert(offsetof(dion3_group_config, ema_momentum) + sizeof(int32_t) ==
              offsetof(dion3_group_config, split_sizes));
// transposed took the padding at the end: the struct's size is unchanged.
static_assert(offsetof(dion3_group_config, transposed) + sizeof(int32_t) == sizeof(dion3_group_config));
namespace {

const std::vector<Coefficients>& preset(int32_t which) {
  return which == DION3_COEFF_YOU         ? you_coefficients()
         : which == DION3_COEFF_REFERENCE ? reference_coefficients()
                                          : polar_express_coefficients();
}

}  // namespace

DType dtype_from_c(int32_t v, const std::string& what) {
  require(v >= DION3_F32 && v <= DION3_I64,
          what + ": dtype " + std::to_string(v) + " is not a dion3_dtype (0..5)");
  return static_cast<DType>(v);
}

GroupConfig config_from_c(const dion3_group_config& c) {
  GroupConfig g;
  g.algorithm = to_enum<Algorithm>(c.algorithm, 0, 5, "group config: algorithm");
  g.lr = c.lr;
  g.fraction = c.fraction;
  g.mu = c.mu;
  g.muon_beta2 = c.muon_beta2;
  g.betas = {c.betas[0], c.betas[1]};
  g.weight_decay = c.weight_decay;
  g.epsilon = c.epsilon;
  g.adjust_lr = to_enum<AdjustLR>(c.adjust_lr, 0, 3, "group config: adjust_lr");
  // Switches are 0 or 1: another value is more likely a field filled by mistake than a "yes".
  auto flag = [](int32_t v, const char* name) {
    require(v == 0 || v == 1, std::string("group config: ") + name + " is " + std::to_string(v) + ", expected 0 or 1");
    return v != 0;
  };
  g.flatten = flag(c.flatten, "flatten");
  g.nesterov = flag(c.nesterov, "nesterov");
  g.ema_momentum = flag(c.ema_momentum, "ema_momentum");
  g.cautious_wd = flag(c.cautious_wd, "cautious_wd");
  g.scale_lr_by_fraction = flag(c.scale_lr_by_fraction, "scale_lr_by_fraction");
  if (c.momentum_dtype >= 0) g.momentum_dtype = dtype_from_c(c.momentum_dtype, "group config: momentum_dtype");
  require(c.momentum_dtype >= -1, "group config: momentum_dtype is " +
                                       std::to_string(c.momentum_dtype) + ", expected -1 or a dtype");
  g.orth.method = to_enum<OrthMethod>(c.orth_method, 0, 2, "group config: orth_method");
  int32_t which = to_enum<int32_t>(c.orth_coefficients, 0, 3, "group config: orth_coefficients");
  if (which == DION3_COEFF_CUSTOM) {
    require(c.orth_num_custom >= 1 && c.orth_num_custom <= DION3_MAX_ORTH_STEPS,
            "group config: orth_num_custom is " + std::to_string(c.orth_num_custom) +
                ", expected 1..16");
    g.orth.coefficients.clear();
    for (int i = 0; i < c.orth_num_custom; ++i)
      g.orth.coefficients.push_back({c.orth_custom[i][0], c.orth_custom[i][1], c.orth_custom[i][2]});
  } else {
    g.orth.coefficients = preset(which);
  }
  require(c.orth_num_restarts >= 0 && c.orth_num_restarts <= DION3_MAX_ORTH_RESTARTS,
          "group config: orth_num_restarts is " + std::to_string(c.orth_num_restarts) +
              ", expected 0..16");
  g.orth.restarts.assign(c.orth_restarts, c.orth_restarts + c.orth_num_restarts);
  require(c.orth_iteration_dtype >= -1, "group config: orth_iteration_dtype is " +
                                             std::to_string(c.orth_iteration_dtype) +
                                             ", expected -1 or a dtype");
  if (c.orth_iteration_dtype >= 0)
    g.orth.iteration_dtype = dtype_from_c(c.orth_iteration_dtype, "group config: orth_iteration_dtype");
  // Checked before narrowing to float32 (which turns a tiny value into 0), where the algorithm uses it.
  if (is_matrix_algorithm(g.algorithm)) {
    try {
      OrthConfig::check_norm_eps(c.orth_norm_eps);
    } catch (const Error& e) {
      fail("group config: " + std::string(e.what()).substr(7));
    }
  }
  g.orth.norm = {static_cast<float>(c.orth_norm_eps), flag(c.orth_norm_floor, "orth_norm_floor")};
  g.transposed = flag(c.transposed, "transposed");
  g.selection_scope = to_enum<SelectionScope>(c.selection_scope, 0, 1, "group config: selection_scope");
  g.num_heads = c.num_heads;
  require(c.num_split_sizes >= 0 && c.num_split_sizes <= DION3_MAX_SPLITS,
          "group config: num_split_sizes is " + std::to_string(c.num_split_sizes) + ", expected 0.." +
              std::to_string(DION3_MAX_SPLITS));
  g.split_sizes.assign(c.split_sizes, c.split_sizes + c.num_split_sizes);
  return g;
}

void config_to_c(const GroupConfig& g, dion3_group_config* c) {
  std::memset(c, 0, sizeof *c);
  c->algorithm = static_cast<int32_t>(g.algorithm);
  c->lr = g.lr;
  c->fraction = g.fraction;
  c->mu = g.mu;
  c->muon_beta2 = g.muon_beta2;
  c->betas[0] = g.betas[0];
  c->betas[1] = g.betas[1];
  c->weight_decay = g.weight_decay;
  c->epsilon = g.epsilon;
  c->adjust_lr = static_cast<int32_t>(g.adjust_lr);
  c->flatten = g.flatten;
  c->nesterov = g.nesterov;
  c->ema_momentum = g.ema_momentum;
  c->cautious_wd = g.cautious_wd;
  c->scale_lr_by_fraction = g.scale_lr_by_fraction;
  c->momentum_dtype = g.momentum_dtype ? static_cast<int32_t>(*g.momentum_dtype) : -1;
  c->orth_method = static_cast<int32_t>(g.orth.method);
  c->selection_scope = static_cast<int32_t>(g.selection_scope);
  require(g.num_heads <= INT32_MAX && g.split_sizes.size() <= DION3_MAX_SPLITS,
          "group has " + std::to_string(g.split_sizes.size()) + " split_sizes or num_heads " +
              std::to_string(g.num_heads) + "; the C API holds at most " + std::to_string(DION3_MAX_SPLITS) +
              " blocks and a 32-bit head count");
  c->num_heads = static_cast<int32_t>(g.num_heads);
  c->num_split_sizes = static_cast<int32_t>(g.split_sizes.size());
  std::copy(g.split_sizes.begin(), g.split_sizes.end(), c->split_sizes);
  if (g.orth.coefficients == polar_express_coefficients()) {
    c->orth_coefficients = DION3_COEFF_POLAR_EXPRESS;
  } else if (g.orth.coefficients == you_coefficients()) {
    c->orth_coefficients = DION3_COEFF_YOU;
  } else if (g.orth.coefficients == reference_coefficients()) {
    c->orth_coefficients = DION3_COEFF_REFERENCE;
  } else {
    require(g.orth.coefficients.size() <= DION3_MAX_ORTH_STEPS,
            "group has " + std::to_string(g.orth.coefficients.size()) +
                " orthogonalization steps; the C API holds at most 16");
    c->orth_coefficients = DION3_COEFF_CUSTOM;
    c->orth_num_custom = static_cast<int32_t>(g.orth.coefficients.size());
    for (size_t i = 0; i < g.orth.coefficients.size(); ++i)
      for (int j = 0; j < 3; ++j) c->orth_custom[i][j] = g.orth.coefficients[i][j];
  }
  require(g.orth.restarts.size() <= DION3_MAX_ORTH_RESTARTS,
          "group has " + std::to_string(g.orth.restarts.size()) +
              " restart positions; the C API holds at most 16");
  c->orth_num_restarts = static_cast<int32_t>(g.orth.restarts.size());
  for (size_t i = 0; i < g.orth.restarts.size(); ++i) c->orth_restarts[i] = g.orth.restarts[i];
  c->orth_iteration_dtype = g.orth.iteration_dtype ? static_cast<int32_t>(*g.orth.iteration_dtype) : -1;
  c->orth_norm_eps = g.orth.norm.eps;
  c->orth_norm_floor = g.orth.norm.floor;
  c->transposed = g.transposed;
}

}  // namespace dion3::capi

namespace {
// The C++ defaults are the single source of truth (Polar Express, one restart: they fit). Made
// when the library loads: dion3_group_config_default() cannot report a failed allocation.
const dion3_group_config kDefaultConfig = [] {
  dion3_group_config c{};
  dion3::capi::config_to_c(dion3::GroupConfig{}, &c);
  return c;
}();
}  // namespace

extern "C" void dion3_group_config_default(dion3_group_config* c) {
  if (c) *c = kDefaultConfig;
}
