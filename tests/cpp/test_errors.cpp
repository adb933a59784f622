// tests/cpp/test_errors.cpp — every rejected input of the engine, with its message and status,
// and the guarantee that a rejected call leaves weights and state byte-for-byte unchanged
// ("validate first, then mutate"); non-finite gradients under the Raise and Skip
// policies, and a normal step afterwards.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "dion3/dion3.h"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "test_util.hpp"

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using dion3::Algorithm;
using dion3::DType;
using dion3::GroupConfig;
using dion3::Status;
using t3::Harness;
using t3::Rng;

// An optimizer with a Dion3 matrix and an AdamW bias that has taken two steps, so that its
// state is not zero; `d` and `a` are the group indices.
struct Trained {
  Harness h;
  int d = -1, a = -1;
  explicit Trained(dion3::OptimizerOptions o = {}) : h(o) {
    Rng rng(42);
    d = h.opt.add_group(GroupConfig{});
    GroupConfig ga;
    ga.algorithm = Algorithm::AdamW;
    a = h.opt.add_group(ga);
    h.add(d, "mlp.up.weight", DType::F32, {16, 24}, rng);
    h.add(a, "mlp.up.bias", DType::F32, {16}, rng);
    for (int s = 0; s < 2; ++s) {
      h.randomize_grads(rng);
      EXPECT_TRUE(h.opt.step());
    }
  }
  std::vector<unsigned char> snap() { return t3::snapshot(h.opt, h.all()); }
};

TEST(Errors, OneDimensionalTensorInAMatrixGroup) {
  for (Algorithm alg : {Algorithm::Dion3, Algorithm::NorMuon, Algorithm::Muon}) {
    Trained t;
    GroupConfig g;
    g.algorithm = alg;
    const int gi = t.h.opt.add_group(g);
    const auto before = t.snap();
    t3::HostParam bias("mlp.down.bias", DType::F32, {16});
    Status st = Status::Ok;
    const std::string msg = t3::error_of([&] { t.h.opt.add_param(gi, bias.spec()); }, &st);
    EXPECT_EQ(st, Status::InvalidArgument);
    EXPECT_THAT(msg, HasSubstr("'mlp.down.bias'"));
    EXPECT_THAT(msg, HasSubstr("[16]"));
    EXPECT_THAT(msg, HasSubstr("needs a matrix"));
    EXPECT_THAT(msg, HasSubstr("'adamw' or 'lion'"));
    EXPECT_EQ(t.h.opt.num_params(), 2);
    EXPECT_EQ(t.snap(), before);
  }
}

TEST(Errors, InvalidGroupIsRejectedAtAddGroup) {
  Trained t;
  GroupConfig g;
  g.fraction = 1.5;
  Status st = Status::Ok;
  const std::string msg = t3::error_of([&] { t.h.opt.add_group(g); }, &st);
  EXPECT_EQ(st, Status::InvalidArgument);
  EXPECT_THAT(msg, HasSubstr("'fraction'"));
  EXPECT_THAT(msg, HasSubstr("(0, 1]"));
  EXPECT_THAT(msg, HasSubstr("1.5"));
  EXPECT_EQ(t.h.opt.num_groups(), 2);
}

struct BadEdit {
  std::string name;
  std::string field;
  void (*apply)(GroupConfig&);
};
void PrintTo(const BadEdit& c, std::ostream* os) { *os << c.name; }

class InvalidGroupEdit : public ::testing::TestWithParam<BadEdit> {};

TEST_P(InvalidGroupEdit, StepRejectsItAndChangesNothing) {
  Trained t;
  Rng rng(7);
  t.h.randomize_grads(rng);
  const auto before = t.snap();
  const GroupConfig saved = t.h.opt.group(t.d);
  GetParam().apply(t.h.opt.group(t.d));
  Status st = Status::Ok;
  const std::string msg = t3::error_of([&] { t.h.opt.step(); }, &st);
  EXPECT_EQ(st, Status::InvalidArgument);
  EXPECT_THAT(msg, HasSubstr("'" + GetParam().field + "'"));
  EXPECT_THAT(msg, HasSubstr("group " + std::to_string(t.d)));
  EXPECT_EQ(t.snap(), before);
  EXPECT_EQ(t.h.opt.steps_taken(), 2);
  // Restoring the group lets training continue.
  t.h.opt.group(t.d) = saved;
  EXPECT_TRUE(t.h.opt.step());
  EXPECT_NE(t.snap(), before);
}

INSTANTIATE_TEST_SUITE_P(
    Fields, InvalidGroupEdit,
    ::testing::Values(BadEdit{"fraction_zero", "fraction", [](GroupConfig& g) { g.fraction = 0.0; }},
                      BadEdit{"fraction_above_one", "fraction", [](GroupConfig& g) { g.fraction = 1.25; }},
                      BadEdit{"negative_lr", "lr", [](GroupConfig& g) { g.lr = -0.01; }},
                      BadEdit{"negative_mu", "mu", [](GroupConfig& g) { g.mu = -0.9; }},
                      BadEdit{"negative_muon_beta2", "muon_beta2", [](GroupConfig& g) { g.muon_beta2 = -0.95; }},
                      BadEdit{"negative_weight_decay", "weight_decay", [](GroupConfig& g) { g.weight_decay = -1e-4; }},
                      BadEdit{"nan_lr", "lr", [](GroupConfig& g) { g.lr = std::numeric_limits<double>::quiet_NaN(); }}),
    [](const ::testing::TestParamInfo<BadEdit>& i) { return i.param.name; });

TEST(Errors, GradientShapeDiffersFromWeight) {
  Trained t;
  const auto before = t.snap();
  t3::HostParam p("attn.out", DType::F32, {16, 24});
  t3::Buffer g(DType::F32, {24, 16});
  dion3::ParamSpec spec = p.spec();
  spec.grad = g.view();
  const std::string msg = t3::error_of([&] { t.h.opt.add_param(t.d, spec); });
  EXPECT_THAT(msg, HasSubstr("'attn.out'"));
  EXPECT_THAT(msg, HasSubstr("[16, 24]"));
  EXPECT_THAT(msg, HasSubstr("[24, 16]"));
  EXPECT_EQ(t.h.opt.num_params(), 2);
  // set_grad with the wrong shape: rejected, the old gradient stays bound.
  const std::string msg2 = t3::error_of([&] { t.h.opt.set_grad(0, g.view()); });
  EXPECT_THAT(msg2, HasSubstr("'mlp.up.weight'"));
  EXPECT_THAT(msg2, HasSubstr("[24, 16]"));
  EXPECT_EQ(t.snap(), before);
  EXPECT_TRUE(t.h.opt.step());
}

TEST(Errors, UnsupportedDtype) {
  Trained t;
  t3::HostParam p("embed.ids", DType::I32, {16, 24});
  Status st = Status::Ok;
  const std::string msg = t3::error_of([&] { t.h.opt.add_param(t.a, p.spec()); }, &st);
  EXPECT_EQ(st, Status::InvalidArgument);
  EXPECT_THAT(msg, HasSubstr("'embed.ids'"));
  EXPECT_THAT(msg, HasSubstr("int32"));
  // A float64 weight is not a parameter dtype either.
  t3::HostParam q("w64", DType::F64, {4, 4});
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_param(t.d, q.spec()); }), HasSubstr("float64"));
  // Nor an integer gradient for a float weight.
  t3::HostParam r("w", DType::F32, {4, 4});
  t3::Buffer gi(DType::I64, {4, 4});
  dion3::ParamSpec spec = r.spec();
  spec.grad = gi.view();
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_param(t.d, spec); }), HasSubstr("int64"));
  EXPECT_EQ(t.h.opt.num_params(), 2);
}

TEST(Errors, NonexistentGroupAndParameterIndices) {
  Trained t;
  t3::HostParam p("w", DType::F32, {8, 8});
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_param(5, p.spec()); }), HasSubstr("group 5"));
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_param(-1, p.spec()); }), HasSubstr("group -1"));
  EXPECT_THAT(t3::error_of([&] { t.h.opt.set_grad(9, p.g.view()); }), HasSubstr("9"));
  EXPECT_FALSE(t3::error_of([&] { t.h.opt.state_views(9); }).empty());
  EXPECT_FALSE(t3::error_of([&] { t.h.opt.group(9); }).empty());
  EXPECT_FALSE(t3::error_of([&] { t.h.opt.param_name(-1); }).empty());
  EXPECT_EQ(t.h.opt.num_params(), 2);
}

TEST(Errors, EmptyGroupIsRejectedAtStep) {
  // The engine's decision: a group without parameters is a configuration mistake, reported at
  // the next step (not silently ignored), with nothing modified.
  Trained t;
  Rng rng(8);
  t.h.randomize_grads(rng);
  const int empty = t.h.opt.add_group(GroupConfig{});
  const auto before = t.snap();
  Status st = Status::Ok;
  const std::string msg = t3::error_of([&] { t.h.opt.step(); }, &st);
  EXPECT_EQ(st, Status::InvalidArgument);
  EXPECT_THAT(msg, HasSubstr("group " + std::to_string(empty)));
  EXPECT_THAT(msg, HasSubstr("empty"));
  EXPECT_EQ(t.snap(), before);
}

TEST(Errors, StepWithoutGroupsOrGradients) {
  Harness h;
  EXPECT_THAT(t3::error_of([&] { h.opt.step(); }), HasSubstr("no parameter groups"));
  const int gi = h.opt.add_group(GroupConfig{});
  t3::HostParam p("w", DType::F32, {8, 8});
  dion3::ParamSpec spec = p.spec();
  spec.grad = dion3::TensorView{};  // gradient bound later with set_grad
  p.index = h.opt.add_param(gi, spec);
  EXPECT_THAT(t3::error_of([&] { h.opt.step(); }), HasSubstr("set_grad"));
  h.opt.set_grad(p.index, p.g.view());
  EXPECT_TRUE(h.opt.step());
}

TEST(Errors, EmptyParameterStepsWithoutAGradient) {
  // An empty weight has nothing to update, so step() asks no gradient of it; it used to read
  // the unbound gradient as one element at address 0 (found by tests/fuzz).
  for (const auto policy : {dion3::NonFinitePolicy::Raise, dion3::NonFinitePolicy::Skip}) {
    Trained t(dion3::OptimizerOptions{policy});
    dion3::ParamSpec spec;
    spec.name = "empty.bias";
    spec.weight = dion3::TensorView{nullptr, DType::F16, dion3::Device::CPU, 0, {0, 3}};
    const int index = t.h.opt.add_param(t.a, spec);
    Rng rng(9);
    t.h.randomize_grads(rng);
    EXPECT_TRUE(t.h.opt.step());
    // The non-finite path looks at every parameter's gradient too.
    t.h.params[0]->g.set(0, std::nan(""));
    if (policy == dion3::NonFinitePolicy::Raise)
      // The remedy is named in words every front end shares, not Python's keyword.
      EXPECT_THAT(t3::error_of([&] { t.h.opt.step(); }),
                  AllOf(HasSubstr("mlp.up.weight"), HasSubstr("the skip policy drops such steps"),
                        Not(HasSubstr("on_nonfinite"))));
    else
      EXPECT_FALSE(t.h.opt.step());
    EXPECT_EQ(t.h.opt.state_views(index).size(), 2u);
  }
}

TEST(Errors, StructuralGroupEditsAfterStateExistsAreRejected) {
  for (int which = 0; which < 3; ++which) {
    Trained t;
    Rng rng(15);
    t.h.randomize_grads(rng);
    const auto before = t.snap();
    GroupConfig& g = t.h.opt.group(t.d);
    std::string field;
    if (which == 0) {
      g.algorithm = Algorithm::Muon;
      field = "algorithm";
    } else if (which == 1) {
      g.flatten = true;
      field = "flatten";
    } else {
      g.momentum_dtype = DType::BF16;
      field = "momentum_dtype";
    }
    const std::string msg = t3::error_of([&] { t.h.opt.step(); });
    EXPECT_THAT(msg, HasSubstr("'" + field + "'")) << field;
    EXPECT_EQ(t.snap(), before) << field;
  }
}

// The state of a group's parameters is sized when they are added: a structural edit before the
// first step (or a parameter added after one) must be refused, not step on buffers of the old
// size (a heap-buffer overflow in the CPU backend's accumulate before this was checked).
TEST(Errors, StructuralGroupEditsBeforeTheFirstStepAreRejected) {
  struct Edit {
    Algorithm from;
    std::function<void(GroupConfig&)> apply;
    std::string field;
  };
  const std::vector<Edit> edits = {
      {Algorithm::Dion3, [](GroupConfig& g) { g.momentum_dtype = DType::F32; }, "momentum_dtype"},
      {Algorithm::Dion3, [](GroupConfig& g) { g.algorithm = Algorithm::AdamW; }, "algorithm"},
      {Algorithm::Muon, [](GroupConfig& g) { g.algorithm = Algorithm::Dion3; }, "algorithm"},
      {Algorithm::Lion, [](GroupConfig& g) { g.algorithm = Algorithm::AdamW; }, "algorithm"},
      {Algorithm::Dion3, [](GroupConfig& g) { g.flatten = true; }, "flatten"},
  };
  for (const Edit& e : edits) {
    Harness h;
    Rng rng(3);
    GroupConfig g;
    g.algorithm = e.from;
    const int gi = h.opt.add_group(g);
    t3::HostParam& p = h.add(gi, "w", DType::BF16, {2, 64, 32}, rng);
    h.randomize_grads(rng);
    const auto before = t3::snapshot(h.opt, {&p});
    e.apply(h.opt.group(gi));
    Status st = Status::Ok;
    const std::string msg = t3::error_of([&] { h.opt.step(); }, &st);
    EXPECT_EQ(st, Status::InvalidArgument) << e.field;
    EXPECT_THAT(msg, HasSubstr("cannot change '" + e.field + "'")) << msg;
    EXPECT_EQ(t3::snapshot(h.opt, {&p}), before) << e.field;
    // A parameter added to the edited group is refused too (its state would differ).
    const std::string added = t3::error_of([&] { h.add(gi, "w2", DType::BF16, {8, 8}, rng); });
    EXPECT_THAT(added, HasSubstr("cannot change '" + e.field + "'")) << added;
    // Restoring the settings makes the group usable again.
    h.opt.group(gi) = g;
    EXPECT_NO_THROW(h.opt.step()) << e.field;
  }
}

// The same through the C API, the reported case: bf16 256 x 256, momentum_dtype set to fp32.
TEST(Errors, CApiMomentumDtypeEditBeforeTheFirstStepIsRefused) {
  t3::CApiOptimizer c;
  dion3_optimizer* opt = c.opt;
  dion3_group_config cfg = c.cfg;
  const int g = c.group;
  std::vector<uint16_t> w(256 * 256, 0x3f80), gr(256 * 256, 0x3c00);  // bf16 1.0 and 0.0078125
  const std::vector<uint16_t> w0 = w;
  dion3_tensor wt = {w.data(), DION3_BF16, DION3_DEVICE_CPU, 0, 2, {256, 256}};
  dion3_tensor gt = {gr.data(), DION3_BF16, DION3_DEVICE_CPU, 0, 2, {256, 256}};
  ASSERT_EQ(dion3_add_param(opt, g, "w", &wt, &gt, nullptr), DION3_OK);
  cfg.momentum_dtype = DION3_F32;
  EXPECT_EQ(dion3_set_group_config(opt, g, &cfg), DION3_INVALID_ARGUMENT);  // refused when made
  EXPECT_THAT(std::string(dion3_last_error()), HasSubstr("cannot change 'momentum_dtype'"));
  EXPECT_EQ(w, w0);
  // The group is as it was: its steps run on the bf16 state it has.
  int applied = 0;
  EXPECT_EQ(dion3_step(opt, &applied), DION3_OK);
  EXPECT_EQ(applied, 1);
}

// Blocks that do not fit a parameter's rows are refused when the group is set, naming the
// parameter, and the group stays as it was.
TEST(Errors, BlocksThatDoNotFitAreRefusedWhenTheGroupIsSet) {
  t3::CApiOptimizer c;
  std::vector<float> w(4 * 6, 0.5f), gr(4 * 6, 0.25f);
  dion3_tensor wt = {w.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {4, 6}};
  dion3_tensor gt = {gr.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {4, 6}};
  ASSERT_EQ(dion3_add_param(c.opt, c.group, "w", &wt, &gt, nullptr), DION3_OK);
  dion3_group_config cfg = c.cfg;
  cfg.num_heads = 3;
  EXPECT_EQ(dion3_set_group_config(c.opt, c.group, &cfg), DION3_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(dion3_last_error()), HasSubstr("'w'"));
  dion3_group_config now;
  ASSERT_EQ(dion3_get_group_config(c.opt, c.group, &now), DION3_OK);
  EXPECT_EQ(now.num_heads, c.cfg.num_heads);
  cfg.num_heads = 2;
  EXPECT_EQ(dion3_set_group_config(c.opt, c.group, &cfg), DION3_OK);
  int applied = 0;
  EXPECT_EQ(dion3_step(c.opt, &applied), DION3_OK);
  EXPECT_EQ(applied, 1);
}

TEST(Errors, TensorOnTheWrongDeviceOrWithoutData) {
  Trained t;
  t3::HostParam p("gpu.w", DType::F32, {8, 8});
  dion3::ParamSpec spec = p.spec();
  spec.weight.device = dion3::Device::CUDA;
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_param(t.d, spec); }), HasSubstr("cuda"));
  spec = p.spec();
  spec.weight.data = nullptr;
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_param(t.d, spec); }), HasSubstr("null"));
  EXPECT_EQ(t.h.opt.num_params(), 2);
}

TEST(Errors, ElementwiseGroupFields) {
  Trained t;
  GroupConfig g;
  g.algorithm = Algorithm::AdamW;
  g.betas = {1.0, 0.95};
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_group(g); }), HasSubstr("'betas[0]'"));
  g.betas = {0.9, -0.1};
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_group(g); }), HasSubstr("'betas[1]'"));
  g.betas = {0.9, 0.95};
  g.epsilon = 0.0;
  EXPECT_THAT(t3::error_of([&] { t.h.opt.add_group(g); }), HasSubstr("'epsilon'"));
  EXPECT_EQ(t.h.opt.num_groups(), 2);
}

// ---------------------------------------------------------------------------------------------
// import_state of a state that does not fit.
void set_f32(dion3::HostTensor& t, std::size_t i, float v) {
  ASSERT_EQ(t.dtype, DType::F32);
  ASSERT_LE((i + 1) * 4, t.data.size());
  std::memcpy(t.data.data() + 4 * i, &v, 4);
}

class BadImport : public ::testing::TestWithParam<int> {};

TEST_P(BadImport, IsRejectedBeforeAnythingIsCopied) {
  Trained src;
  Rng rng(9);
  src.h.randomize_grads(rng);
  src.h.opt.step();  // a different state than `t` holds
  dion3::OptimizerState st = src.h.opt.export_state();
  std::string expect;
  switch (GetParam()) {
    case 0:  // momentum of the wrong shape
      st.params[0].tensors[0].second.shape = {24, 16};
      expect = "'momentum'";
      break;
    case 1:  // wrong dtype
      st.params[1].tensors[1].second.dtype = DType::BF16;
      expect = "'exp_avg_sq'";
      break;
    case 2:  // saved for another parameter
      st.params[1].name = "other.bias";
      expect = "'other.bias'";
      break;
    case 3:  // a missing parameter
      st.params.pop_back();
      expect = "1 parameters";
      break;
    case 4:  // truncated data, the last tensor: everything before it would fit
      st.params[1].tensors[1].second.data.resize(8);
      expect = "bytes";
      break;
    case 5:  // wrong tensor name
      st.params[0].tensors[1].first = "second_moment";
      expect = "'second_moment'";
      break;
    case 6:  // a NaN in the momentum
      set_f32(st.params[0].tensors[0].second, 7, std::numeric_limits<float>::quiet_NaN());
      expect = "'momentum' (float32) holds NaN at element 7";
      break;
    case 7:  // an Inf in AdamW's first moment
      set_f32(st.params[1].tensors[0].second, 2, -std::numeric_limits<float>::infinity());
      expect = "'exp_avg' (float32) holds -Inf at element 2";
      break;
    case 8:  // a negative second moment (AdamW)
      set_f32(st.params[1].tensors[1].second, 5, -0.25f);
      expect = "'exp_avg_sq' (float32) holds -0.25 at element 5; a second moment cannot be negative";
      break;
    case 9:  // a negative row variance (NorMuon normalisation)
      set_f32(st.params[0].tensors[1].second, 3, -1e-3f);
      expect = "'variance' (float32) holds -0.001 at element 3";
      break;
    case 10:  // counters that later steps could overflow
      st.steps = (int64_t{1} << 62) + 1;
      expect = "'steps' is 4611686018427387905; step counters above 2^62 are refused";
      break;
    case 11:
      st.skipped = std::numeric_limits<int64_t>::max() - 1;
      expect = "'skipped' is 9223372036854775806; step counters above 2^62";
      break;
    case 12:
      st.skipped = -1;
      expect = "'skipped' is -1";
      break;
    case 13:  // the last element of the last tensor: everything before it would be copied
      set_f32(st.params[1].tensors[1].second, 15, std::numeric_limits<float>::infinity());
      expect = "'exp_avg_sq' (float32) holds +Inf at element 15";
      break;
  }
  Trained t;
  const auto before = t.snap();
  const int64_t steps = t.h.opt.steps_taken();
  Status status = Status::Ok;
  const std::string msg = t3::error_of([&] { t.h.opt.import_state(st); }, &status);
  EXPECT_EQ(status, Status::InvalidArgument);
  EXPECT_THAT(msg, HasSubstr(expect));
  EXPECT_EQ(t.snap(), before);
  EXPECT_EQ(t.h.opt.steps_taken(), steps);
  EXPECT_EQ(t.h.opt.export_state().params[1].step, 2);
}

INSTANTIATE_TEST_SUITE_P(Cases, BadImport, ::testing::Range(0, 14));

TEST(Config, GramThatWouldDivergeInTheBackendsDtypeIsRefusedByTheGroupBeforeAnything) {
  Harness h;
  GroupConfig g;
  g.orth.method = dion3::OrthMethod::Gram;
  g.orth.coefficients.assign(12, dion3::Coefficients{3.4445, -4.775, 2.0315});  // the CPU's float32
  const int gi = h.opt.add_group(g);
  Rng rng(3);
  t3::HostParam& p = h.add(gi, "w", DType::F32, {8, 32}, rng);
  h.randomize_grads(rng);
  const auto w = p.w.values();
  EXPECT_THAT(t3::error_of([&] { h.opt.step(); }),
              HasSubstr("group 0: Gram Newton-Schulz in float32 with these coefficients"));
  EXPECT_EQ(p.w.values(), w);
  g.orth.restarts = {2, 4, 6, 8, 10};
  h.opt.set_group(gi, g);
  EXPECT_TRUE(h.opt.step());
}

TEST(Import, CountersOfTwoToThe62AreTakenAndGoOn) {
  Trained t;
  dion3::OptimizerState st = t.h.opt.export_state();
  const int64_t cap = int64_t{1} << 62;
  st.steps = st.skipped = cap;
  for (auto& p : st.params) p.step = cap;
  t.h.opt.import_state(st);
  Rng rng(5);
  t.h.randomize_grads(rng);
  ASSERT_TRUE(t.h.opt.step());
  const dion3::OptimizerState after = t.h.opt.export_state();
  EXPECT_EQ(after.steps, cap + 1);
  EXPECT_EQ(after.skipped, cap);
  EXPECT_EQ(after.params[1].step, cap + 1);
}

// Values are checked in the stored dtype: half-precision NaN, Inf and negative second moments
// (bit patterns that have no fp32 counterpart in the buffer) are refused too.
TEST(BadImport16, HalfPrecisionValuesAreCheckedAsStored) {
  for (DType dt : {DType::BF16, DType::F16}) {
    Rng rng(15);
    Harness h;
    GroupConfig ga;
    ga.algorithm = Algorithm::AdamW;
    const int d = h.opt.add_group(GroupConfig{}), a = h.opt.add_group(ga);
    h.add(d, "w", dt, {8, 12}, rng);
    h.add(a, "b", dt, {8}, rng);
    h.randomize_grads(rng);
    ASSERT_TRUE(h.opt.step());
    const dion3::OptimizerState good = h.opt.export_state();
    const uint16_t nan = dt == DType::BF16 ? 0x7FC0 : 0x7E00, inf = dt == DType::BF16 ? 0x7F80 : 0x7C00,
                   minus_one = dt == DType::BF16 ? 0xBF80 : 0xBC00, minus_zero = 0x8000;
    struct Case {
      int param, tensor;
      uint16_t bits;
      std::string expect;
    };
    const std::string type = std::string("(") + dion3::dtype_name(dt) + ")";
    for (const Case& c : {Case{0, 0, nan, "'momentum' " + type + " holds NaN at element 4"},
                          Case{1, 0, inf, "'exp_avg' " + type + " holds +Inf at element 4"},
                          Case{1, 1, minus_one, "'exp_avg_sq' " + type + " holds -1 at element 4"}}) {
      dion3::OptimizerState st = good;
      std::memcpy(st.params[c.param].tensors[c.tensor].second.data.data() + 8, &c.bits, 2);
      const auto before = t3::snapshot(h.opt, h.all());
      Status status = Status::Ok;
      EXPECT_THAT(t3::error_of([&] { h.opt.import_state(st); }, &status), HasSubstr(c.expect));
      EXPECT_EQ(status, Status::InvalidArgument);
      EXPECT_EQ(t3::snapshot(h.opt, h.all()), before);
    }
    // -0 is not negative: a second moment of a zero gradient may be stored so.
    dion3::OptimizerState st = good;
    std::memcpy(st.params[1].tensors[1].second.data.data() + 8, &minus_zero, 2);
    EXPECT_NO_THROW(h.opt.import_state(st));
  }
}

// ---------------------------------------------------------------------------------------------
// Non-finite gradients.

struct NonFiniteCase {
  std::string name;
  int param;    // 0 = the Dion3 matrix, 1 = the AdamW bias
  double value;
};
void PrintTo(const NonFiniteCase& c, std::ostream* os) { *os << c.name; }

class NonFinite : public ::testing::TestWithParam<NonFiniteCase> {};

TEST_P(NonFinite, RaiseThrowsAndChangesNothing) {
  const NonFiniteCase c = GetParam();
  Trained t;
  Rng rng(10);
  t.h.randomize_grads(rng);
  t.h.params[c.param]->g.set(3, c.value);
  const auto before = t.snap();
  Status st = Status::Ok;
  const std::string msg = t3::error_of([&] { t.h.opt.step(); }, &st);
  EXPECT_EQ(st, Status::NonFinite);
  EXPECT_THAT(msg, HasSubstr("'" + t.h.params[c.param]->name + "'"));
  EXPECT_EQ(t.snap(), before);
  EXPECT_EQ(t.h.opt.steps_taken(), 2);
  // A raised step is not a skipped one: the counters, and so the exported state, are unchanged.
  EXPECT_EQ(t.h.opt.steps_skipped(), 0);
  EXPECT_EQ(t.h.opt.export_state().skipped, 0);
}

TEST_P(NonFinite, SkipReturnsFalseAndChangesNothing) {
  const NonFiniteCase c = GetParam();
  Trained t(dion3::OptimizerOptions{dion3::NonFinitePolicy::Skip});
  Rng rng(11);
  t.h.randomize_grads(rng);
  t.h.params[c.param]->g.set(5, c.value);
  const auto before = t.snap();
  EXPECT_FALSE(t.h.opt.step());
  EXPECT_EQ(t.snap(), before);
  EXPECT_EQ(t.h.opt.steps_skipped(), 1);
  EXPECT_EQ(t.h.opt.steps_taken(), 2);
  EXPECT_FALSE(t.h.opt.step());  // still bad: skipped again
  EXPECT_EQ(t.h.opt.steps_skipped(), 2);
  EXPECT_EQ(t.h.opt.export_state().skipped, 2);
}

TEST_P(NonFinite, ALaterFiniteStepIsNormal) {
  // After a dropped step, the next finite step gives exactly what an optimizer that never saw
  // the bad gradient gives (including AdamW's step count for the bias correction).
  const NonFiniteCase c = GetParam();
  for (auto policy : {dion3::NonFinitePolicy::Raise, dion3::NonFinitePolicy::Skip}) {
    Trained t(dion3::OptimizerOptions{policy}), control;
    Rng rng(12);
    t.h.randomize_grads(rng);
    t.h.params[c.param]->g.set(0, c.value);
    if (policy == dion3::NonFinitePolicy::Raise) EXPECT_THROW(t.h.opt.step(), dion3::Error);
    else EXPECT_FALSE(t.h.opt.step());
    Rng r1(13), r2(13);
    t.h.randomize_grads(r1);
    control.h.randomize_grads(r2);
    EXPECT_TRUE(t.h.opt.step());
    EXPECT_TRUE(control.h.opt.step());
    EXPECT_EQ(t.snap(), control.snap());
    EXPECT_EQ(t.h.opt.steps_taken(), control.h.opt.steps_taken());
    EXPECT_EQ(t.h.opt.steps_skipped(), policy == dion3::NonFinitePolicy::Skip ? 1 : 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Values, NonFinite,
    ::testing::Values(NonFiniteCase{"nan_in_matrix", 0, std::numeric_limits<double>::quiet_NaN()},
                      NonFiniteCase{"inf_in_matrix", 0, std::numeric_limits<double>::infinity()},
                      NonFiniteCase{"neg_inf_in_bias", 1, -std::numeric_limits<double>::infinity()},
                      NonFiniteCase{"nan_in_bias", 1, std::numeric_limits<double>::quiet_NaN()}),
    [](const ::testing::TestParamInfo<NonFiniteCase>& i) { return i.param.name; });

TEST(NonFiniteBf16, NaNInA16BitGradientIsCaught) {
  Rng rng(14);
  Harness h;
  const int gi = h.opt.add_group(GroupConfig{});
  t3::HostParam& p = h.add(gi, "w", DType::BF16, {16, 32}, rng);
  h.randomize_grads(rng);
  ASSERT_TRUE(h.opt.step());
  h.randomize_grads(rng);
  p.g.set(100, std::numeric_limits<double>::quiet_NaN());
  const auto before = t3::snapshot(h.opt, h.all());
  Status st = Status::Ok;
  t3::error_of([&] { h.opt.step(); }, &st);
  EXPECT_EQ(st, Status::NonFinite);
  EXPECT_EQ(t3::snapshot(h.opt, h.all()), before);
}

}  // namespace
