// tests/cpp/test_hardening.cpp — inputs that are valid as written but would corrupt memory or
// poison the weights: hyper-parameters that only fail in float32, shapes whose element count
// overflows, names and memory registered twice, and finite gradients whose momentum or second
// moment overflows. Each is refused (or the step dropped under the non-finite policy) with
// nothing written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "dion3/dion3.h"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "test_util.hpp"

namespace {

using ::testing::HasSubstr;
using dion3::Algorithm;
using dion3::DType;
using dion3::GroupConfig;
using dion3::NonFinitePolicy;
using dion3::Status;
using t3::Harness;
using t3::Rng;

// ---- hyper-parameters validated in the precision the step uses ----------------------------

struct FloatCase {
  const char* field;
  std::function<void(GroupConfig&)> edit;
};

TEST(Hardening, HyperParametersThatOverflowOrVanishInFloat32AreRefused) {
  const std::vector<FloatCase> cases = {
      {"'lr'", [](GroupConfig& g) { g.lr = 1e39; }},
      {"'weight_decay'", [](GroupConfig& g) { g.weight_decay = 1e39; }},
      {"'epsilon'", [](GroupConfig& g) { g.epsilon = 1e-50; }},
      {"'epsilon'", [](GroupConfig& g) { g.epsilon = 1e-40; }},  // subnormal in float32
      {"scale_lr_by_fraction", [](GroupConfig& g) {
         g.scale_lr_by_fraction = true;
         g.fraction = 1e-300;
       }},
      {"lr * weight_decay", [](GroupConfig& g) {
         g.lr = 1e20;
         g.weight_decay = 1e20;
       }},
      {"'coefficients'", [](GroupConfig& g) { g.orth.coefficients = {{1e300, 0, 0}}; }},
      {"'coefficients'", [](GroupConfig& g) { g.orth.coefficients = {{1e30, 0, 0}}; }},
      {"'coefficients'", [](GroupConfig& g) { g.orth.coefficients = {{3, 0, 0}, {3, 0, 0}}; }},  // 9 at sigma 1
      {"'mu'", [](GroupConfig& g) { g.mu = 1.0 - 1e-12; }},  // 1.0f
      {"'betas[1]'", [](GroupConfig& g) {
         g.algorithm = Algorithm::AdamW;
         g.betas[1] = 1.0 - 1e-12;
       }},
  };
  for (const FloatCase& c : cases) {
    GroupConfig g;
    c.edit(g);
    EXPECT_THAT(t3::error_of([&] { g.validate(); }), HasSubstr(c.field)) << c.field;
    // The same through a step after an edit: refused before anything is written.
    Rng rng(1);
    Harness h;
    GroupConfig ok;
    ok.algorithm = g.algorithm;
    const int gi = h.opt.add_group(ok);
    h.add(gi, "w", DType::F32, g.algorithm == Algorithm::AdamW ? std::vector<int64_t>{8} : std::vector<int64_t>{8, 8},
          rng);
    h.randomize_grads(rng);
    const auto before = t3::snapshot(h.opt, h.all());
    h.opt.group(gi) = g;
    Status st = Status::Ok;
    EXPECT_THAT(t3::error_of([&] { h.opt.step(); }, &st), HasSubstr(c.field)) << c.field;
    EXPECT_EQ(st, Status::InvalidArgument);
    EXPECT_EQ(t3::snapshot(h.opt, h.all()), before) << c.field;
  }
  // The defaults and both coefficient presets pass.
  GroupConfig g;
  EXPECT_NO_THROW(g.validate());
  g.orth.coefficients = dion3::you_coefficients();
  EXPECT_NO_THROW(g.validate());
}

TEST(Hardening, LearningRateAdjustedForAShapeMustStayFinite) {
  // 1e36 is a float32, but spectral-norm scaling of a 4096 x 1 matrix multiplies it by 64.
  Rng rng(2);
  Harness h;
  GroupConfig g;
  g.lr = 1e37;
  g.weight_decay = 0;
  const int gi = h.opt.add_group(g);
  h.add(gi, "tall", DType::F32, {4096, 1}, rng);
  h.randomize_grads(rng);
  const auto before = t3::snapshot(h.opt, h.all());
  EXPECT_THAT(t3::error_of([&] { h.opt.step(); }), HasSubstr("after adjust_lr"));
  EXPECT_EQ(t3::snapshot(h.opt, h.all()), before);
}

// ---- shapes, names and memory -------------------------------------------------------------

TEST(Hardening, ElementCountsThatOverflowAreRefused) {
  Harness h;
  const int gi = h.opt.add_group(GroupConfig{});
  float dummy[4] = {};
  dion3::ParamSpec spec;
  spec.name = "huge";
  spec.weight = {dummy, DType::F32, dion3::Device::CPU, 0, {(int64_t{1} << 62) + 1, 2, 2}};
  spec.grad = spec.weight;
  Status st = Status::Ok;
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec); }, &st), HasSubstr("2^63 - 1"));
  EXPECT_EQ(st, Status::InvalidArgument);
  // Elements that fit but bytes that do not.
  spec.weight.shape = {int64_t{1} << 61, 2};
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec); }), HasSubstr("bytes"));
  EXPECT_EQ(h.opt.num_params(), 0);

  // The same through the C API.
  dion3_optimizer* opt = nullptr;
  ASSERT_EQ(dion3_create(&opt, DION3_DEVICE_CPU, 0, nullptr, DION3_NONFINITE_RAISE), DION3_OK);
  dion3_group_config cfg;
  dion3_group_config_default(&cfg);
  int g = -1;
  ASSERT_EQ(dion3_add_group(opt, &cfg, &g), DION3_OK);
  dion3_tensor t = {dummy, DION3_F32, DION3_DEVICE_CPU, 0, 3, {(int64_t{1} << 62) + 1, 2, 2}};
  EXPECT_EQ(dion3_add_param(opt, g, "huge", &t, &t, nullptr), DION3_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(dion3_last_error()), HasSubstr("2^63 - 1"));
  int n = -1;
  ASSERT_EQ(dion3_num_params(opt, &n), DION3_OK);
  EXPECT_EQ(n, 0);
  dion3_destroy(opt);
}

TEST(Hardening, DuplicateNamesAreRefused) {
  Rng rng(3);
  Harness h;
  const int gi = h.opt.add_group(GroupConfig{});
  h.add(gi, "layer.w", DType::F32, {8, 8}, rng);
  t3::HostParam other("layer.w", DType::F32, {8, 8});
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, other.spec()); }), HasSubstr("already has a parameter named"));
  EXPECT_EQ(h.opt.num_params(), 1);
}

TEST(Hardening, SharedOrAliasedMemoryIsRefused) {
  Rng rng(4);
  Harness h;
  const int gi = h.opt.add_group(GroupConfig{});
  t3::HostParam& a = h.add(gi, "a", DType::F32, {8, 8}, rng);
  auto spec_of = [&](const char* name, dion3::TensorView w, dion3::TensorView g) {
    dion3::ParamSpec s;
    s.name = name;
    s.weight = w;
    s.grad = g;
    return s;
  };
  t3::Buffer fresh(DType::F32, {8, 8}), fresh_grad(DType::F32, {8, 8}), big(DType::F32, {16, 8});
  // The same weight buffer twice (would be updated twice).
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec_of("a again", a.w.view(), fresh_grad.view())); }),
              HasSubstr("overlaps the memory of the weight of parameter 0 'a'"));
  // A weight overlapping another: the second half of a buffer that holds 'b' in its first half.
  t3::Buffer b_grad(DType::F32, {8, 8});
  dion3::TensorView first_half = big.view();
  first_half.shape = {8, 8};  // rows 0..7 of big
  ASSERT_NO_THROW(h.opt.add_param(gi, spec_of("b", first_half, b_grad.view())));
  dion3::TensorView half = big.view();
  half.shape = {8, 8};
  half.data = big.bytes.data() + 4 * 8 * 4;  // rows 4..11: overlaps 'b'
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec_of("c", half, fresh_grad.view())); }),
              HasSubstr("the weight of parameter 1 'b'"));
  // A weight that is its own gradient.
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec_of("d", fresh.view(), fresh.view())); }),
              HasSubstr("overlaps its own gradient"));
  // A weight that is another parameter's gradient (it would be read after it was written).
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec_of("e", a.g.view(), fresh_grad.view())); }),
              HasSubstr("the gradient of parameter 0 'a'"));
  // A gradient bound later onto a weight.
  EXPECT_THAT(t3::error_of([&] { h.opt.set_grad(0, fresh.view()); }), testing::Not(HasSubstr("overlap")));
  EXPECT_THAT(t3::error_of([&] { h.opt.set_grad(1, a.w.view()); }), HasSubstr("the weight of parameter 0 'a'"));
  EXPECT_EQ(h.opt.num_params(), 2);
  // Two parameters may share one gradient buffer: it is only read.
  t3::Buffer w2(DType::F32, {8, 8});
  EXPECT_NO_THROW(h.opt.add_param(gi, spec_of("shares a's gradient", w2.view(), a.g.view())));
}

TEST(Hardening, CApiStructuralEditsAreRefusedWhenMadeAndChangeNothing) {
  dion3_optimizer* opt = nullptr;
  ASSERT_EQ(dion3_create(&opt, DION3_DEVICE_CPU, 0, nullptr, DION3_NONFINITE_RAISE), DION3_OK);
  dion3_group_config cfg;
  dion3_group_config_default(&cfg);
  int g = -1;
  ASSERT_EQ(dion3_add_group(opt, &cfg, &g), DION3_OK);
  std::vector<float> w(2 * 4 * 4, 1.0f), gr(2 * 4 * 4, 0.5f);
  dion3_tensor wt = {w.data(), DION3_F32, DION3_DEVICE_CPU, 0, 3, {2, 4, 4}};
  dion3_tensor gt = {gr.data(), DION3_F32, DION3_DEVICE_CPU, 0, 3, {2, 4, 4}};
  ASSERT_EQ(dion3_add_param(opt, g, "w", &wt, &gt, nullptr), DION3_OK);
  for (int field = 0; field < 3; ++field) {
    dion3_group_config edit = cfg;
    if (field == 0) edit.flatten = 1;
    if (field == 1) edit.momentum_dtype = DION3_BF16;
    if (field == 2) edit.algorithm = DION3_ALGO_MUON;
    EXPECT_EQ(dion3_set_group_config(opt, g, &edit), DION3_INVALID_ARGUMENT) << field;
    EXPECT_THAT(std::string(dion3_last_error()), HasSubstr("cannot change")) << field;
    dion3_group_config now;
    ASSERT_EQ(dion3_get_group_config(opt, g, &now), DION3_OK);
    EXPECT_EQ(now.flatten, cfg.flatten);
    EXPECT_EQ(now.momentum_dtype, cfg.momentum_dtype);
    EXPECT_EQ(now.algorithm, cfg.algorithm);
  }
  // An invalid lr through the shortcut is refused and leaves the group as it was.
  EXPECT_EQ(dion3_set_lr(opt, g, 1e39), DION3_INVALID_ARGUMENT);
  dion3_group_config now;
  ASSERT_EQ(dion3_get_group_config(opt, g, &now), DION3_OK);
  EXPECT_EQ(now.lr, cfg.lr);
  int applied = -1;
  EXPECT_EQ(dion3_step(opt, &applied), DION3_OK);
  EXPECT_EQ(applied, 1);
  dion3_destroy(opt);
}

}  // namespace
