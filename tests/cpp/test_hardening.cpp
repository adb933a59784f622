// tests/cpp/test_hardening.cpp — inputs that are valid as written but would corrupt memory or
// poison the weights: hyper-parameters that only fail in float32, shapes whose element count
// overflows, names and memory registered twice, and finite gradients whose momentum or second
// moment overflows. Each is refused (or the step dropped under the non-finite policy) with
// nothing written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cpu/cpu_numeric.hpp"
#include "dion3/comm.hpp"
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
  // No elements at all, but a batch of matrices whose rows x cols overflows.
  spec.weight.shape = {0, int64_t{1} << 40, int64_t{1} << 40};
  spec.grad = spec.weight;
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec); }), HasSubstr("multiply past 2^63 - 1"));
  EXPECT_EQ(h.opt.num_params(), 0);

  // The same through the C API.
  t3::CApiOptimizer c;
  dion3_optimizer* opt = c.opt;
  const int g = c.group;
  dion3_tensor t = {dummy, DION3_F32, DION3_DEVICE_CPU, 0, 3, {(int64_t{1} << 62) + 1, 2, 2}};
  EXPECT_EQ(dion3_add_param(opt, g, "huge", &t, &t, nullptr), DION3_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(dion3_last_error()), HasSubstr("2^63 - 1"));
  int n = -1;
  ASSERT_EQ(dion3_num_params(opt, &n), DION3_OK);
  EXPECT_EQ(n, 0);
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

// A parameter's spec without state or layout.
dion3::ParamSpec spec(const char* name, dion3::TensorView w, dion3::TensorView g) {
  dion3::ParamSpec s;
  s.name = name;
  s.weight = w;
  s.grad = g;
  return s;
}

TEST(Hardening, ARebindGradientMovesWhatAWeightMayNotOverlap) {
  // Registration keeps the gradients' ranges in an index: a gradient rebound by set_grad leaves
  // its old memory free for a weight and guards its new one.
  Rng rng(5);
  Harness h;
  const int gi = h.opt.add_group(GroupConfig{});
  t3::HostParam& a = h.add(gi, "a", DType::F32, {8, 8}, rng);
  t3::Buffer moved(DType::F32, {8, 8}), g1(DType::F32, {8, 8}), g2(DType::F32, {8, 8});
  h.opt.set_grad(a.index, moved.view());
  dion3::ParamSpec in_old = spec("in a's old gradient", a.g.view(), g1.view());
  EXPECT_NO_THROW(h.opt.add_param(gi, in_old));
  dion3::ParamSpec in_new = spec("in a's new gradient", moved.view(), g2.view());
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, in_new); }), HasSubstr("the gradient of parameter 0 'a'"));
  // A gradient inside a longer one's range, both registered: a weight over the short one is
  // found though the long one starts first.
  t3::Buffer long_grad(DType::F32, {64, 8}), long_w(DType::F32, {64, 8}), w3(DType::F32, {8, 8});
  dion3::ParamSpec long_one = spec("long", long_w.view(), long_grad.view());
  ASSERT_NO_THROW(h.opt.add_param(gi, long_one));
  dion3::TensorView tail = long_grad.view();
  tail.shape = {8, 8};
  tail.data = long_grad.bytes.data() + 4 * 56 * 8;  // its last 8 rows
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec("over the tail", tail, w3.view())); }),
              HasSubstr("the gradient of parameter 2 'long'"));
  EXPECT_EQ(h.opt.num_params(), 3);
}

TEST(Hardening, MisalignedUnnamedOrTwiceGivenTensorsAreRefused) {
  Rng rng(6);
  Harness h;
  const int gi = h.opt.add_group(GroupConfig{});
  t3::Buffer big(DType::F32, {9, 8}), g(DType::F32, {8, 8}), m(DType::F32, {8, 8}), m2(DType::F32, {8, 8});
  dion3::TensorView odd = g.view();
  odd.data = big.bytes.data() + 2;  // float32 elements two bytes off their alignment
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec("w", odd, g.view())); }),
              HasSubstr("weight is not aligned to its float32 elements (4 bytes)"));
  t3::Buffer w(DType::F32, {8, 8});
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec("w", w.view(), odd)); }),
              HasSubstr("gradient is not aligned"));
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec("", w.view(), g.view())); }),
              HasSubstr("a parameter needs a name"));
  dion3::ParamSpec twice = spec("w", w.view(), g.view());
  twice.state = {{"momentum", m.view()}, {"momentum", m2.view()}};
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, twice); }), HasSubstr("was given state 'momentum' twice"));
  EXPECT_EQ(h.opt.num_params(), 0);
  twice.state.pop_back();
  EXPECT_NO_THROW(h.opt.add_param(gi, twice));
}

TEST(Hardening, CApiStructuralEditsAreRefusedWhenMadeAndChangeNothing) {
  t3::CApiOptimizer c;
  dion3_optimizer* opt = c.opt;
  const dion3_group_config cfg = c.cfg;
  const int g = c.group;
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
}


// ---- finite gradients whose state would overflow ------------------------------------------

// One parameter of `alg` (a matrix, or a vector for AdamW/Lion) whose gradient is filled with
// `value` (alternating in sign with `alternate`, so that g - m can overflow for Lion).
struct Overflow {
  Harness h;
  t3::HostParam* p = nullptr;
  Overflow(Algorithm alg, DType dt, NonFinitePolicy policy, std::optional<DType> momentum = std::nullopt)
      : h(options(policy)) {
    Rng rng(5);
    GroupConfig g;
    g.algorithm = alg;
    g.momentum_dtype = momentum;
    g.fraction = 0.5;
    if (alg == Algorithm::AdamW) g.betas = {0.9, 0.999};  // torch.optim.AdamW's
    const int gi = h.opt.add_group(g);
    const bool matrix = dion3::is_matrix_algorithm(alg);
    p = &h.add(gi, "w", dt, matrix ? std::vector<int64_t>{8, 8} : std::vector<int64_t>{64}, rng);
  }
  static dion3::OptimizerOptions options(NonFinitePolicy policy) {
    dion3::OptimizerOptions o;
    o.on_nonfinite = policy;
    return o;
  }
  void fill(double value, bool alternate = false) {
    for (int64_t i = 0; i < p->g.numel(); ++i) p->g.set(i, alternate && i % 2 ? -value : value);
  }
  bool weights_finite() const {
    for (double w : p->w.values())
      if (!std::isfinite(w)) return false;
    return true;
  }
};

TEST(Hardening, AdamWSecondMomentOfALargeFiniteGradientStaysFinite) {
  // |g| = 2e19: g*g overflows float32, (1 - beta2)*g*g does not; torch.optim.AdamW keeps such
  // weights finite, and so must the step.
  for (DType dt : {DType::F32, DType::BF16}) {
    Overflow o(Algorithm::AdamW, dt, NonFinitePolicy::Raise);
    o.fill(2e19);
    EXPECT_TRUE(o.h.opt.step()) << dion3::dtype_name(dt);
    EXPECT_TRUE(o.weights_finite()) << dion3::dtype_name(dt);
  }
}

TEST(Hardening, AdamWMovesElementsOfLargeFiniteGradientsByTheLearningRate) {
  // Step 1 of AdamW moves each element by lr * sign(g) (bias correction: m_hat = g, v_hat = g^2),
  // as torch.optim.AdamW does up to the second moment's own overflow (|g| ~ 5.8e20 at
  // beta2 = 0.999): v_hat = v / (1 - beta2) overflows from |g| ~ 1.8e19 and must not stop them.
  for (DType dt : {DType::F32}) {  // the rule runs in float32 for every storage dtype
    Overflow o(Algorithm::AdamW, dt, NonFinitePolicy::Raise);
    const std::vector<double> g = {1.0, -1e10, 1e19, -2e19, 1e20, -5e20};
    for (int64_t i = 0; i < o.p->g.numel(); ++i) o.p->g.set(i, g[static_cast<std::size_t>(i) % g.size()]);
    const auto W0 = o.p->w.values();
    ASSERT_TRUE(o.h.opt.step()) << dion3::dtype_name(dt);
    const auto W1 = o.p->w.values();
    const double lr = GroupConfig{}.lr, wd = GroupConfig{}.weight_decay;
    for (std::size_t i = 0; i < W0.size(); ++i) {
      const double sign = g[i % g.size()] > 0 ? 1.0 : -1.0, want = W0[i] * (1 - lr * wd) - lr * sign;
      EXPECT_NEAR(W1[i], want, 1e-6 * std::max(1.0, std::fabs(want)))
          << dion3::dtype_name(dt) << " element " << i << " gradient " << g[i % g.size()];
    }
  }
}

TEST(Hardening, StepsThatWouldOverflowTheStateAreDroppedWithNothingWritten) {
  struct Case {
    Algorithm alg;
    DType dt;
    std::optional<DType> momentum;
    double g;
    bool alternate;
    int applied_before;  // steps that still fit before the one that overflows
  };
  const std::vector<Case> cases = {
      {Algorithm::Dion3, DType::F32, std::nullopt, 2e38, false, 1},   // M = 2e38, then 4e38
      {Algorithm::Dion3, DType::BF16, std::nullopt, 2e38, false, 1},
      {Algorithm::Dion3, DType::F32, DType::F16, 4e4, false, 1},      // fp16 momentum: 8e4 > 65504
      {Algorithm::NorMuon, DType::F32, std::nullopt, 2e38, false, 1},
      {Algorithm::Muon, DType::F32, std::nullopt, 2e38, false, 1},
      {Algorithm::AdamW, DType::F32, std::nullopt, 1e21, false, 0},   // (1 - beta2) g^2 = 1e39
      {Algorithm::Lion, DType::F32, std::nullopt, 3.3e38, true, 1},   // then g - m = -1.05 g
  };
  for (const Case& c : cases)
    for (NonFinitePolicy policy : {NonFinitePolicy::Raise, NonFinitePolicy::Skip}) {
      const std::string what = std::string(dion3::algorithm_name(c.alg)) + " " + dion3::dtype_name(c.dt) +
                               (policy == NonFinitePolicy::Raise ? " raise" : " skip");
      Overflow o(c.alg, c.dt, policy, c.momentum);
      o.fill(c.g, c.alternate);
      for (int s = 0; s < c.applied_before; ++s) {
        EXPECT_TRUE(o.h.opt.step()) << what;
        o.fill(c.alternate ? -c.g : c.g, c.alternate);  // Lion: the next gradient opposes the momentum
      }
      ASSERT_TRUE(o.weights_finite()) << what;
      const auto before = t3::snapshot(o.h.opt, o.h.all());
      if (policy == NonFinitePolicy::Raise) {
        Status st = Status::Ok;
        EXPECT_THAT(t3::error_of([&] { o.h.opt.step(); }, &st), HasSubstr("would become non-finite at this step")) << what;
        EXPECT_EQ(st, Status::NonFinite) << what;
      } else {
        EXPECT_FALSE(o.h.opt.step()) << what;
      }
      EXPECT_EQ(t3::snapshot(o.h.opt, o.h.all()), before) << what;
      EXPECT_TRUE(o.weights_finite()) << what;
      // A normal gradient afterwards steps as usual.
      o.fill(1e-3);
      EXPECT_TRUE(o.h.opt.step()) << what;
    }
}

// Between steps the non-finite check keeps, per matrix, a bound on its momentum from the step's
// own last write (Dion3: the largest row score; Muon, NorMuon: the largest element accumulate
// stored), and reads the momentum only where the gradient is too large for that bound to settle
// the verdict. Momentum written at 0.9 x the largest finite value, then a gradient of 0.2 x it:
// the sum (0.95 x it for Muon's and NorMuon's) overflows. Written through state_views() without
// notice, the check trusts its stale bound and the step is applied, overflowing the momentum and
// so the weights (what state_changed() is for; this pins that the bound is in use); after
// state_changed(), state_changed({0}) or import_state() the step is dropped. A list naming a
// parameter that does not exist is refused with nothing forgotten.
TEST(Hardening, TheCheckReadsTheMomentumAgainOnceTheStateWasWrittenOutsideAStep) {
  for (Algorithm alg : {Algorithm::Dion3, Algorithm::Muon, Algorithm::NorMuon})
  for (DType dt : {DType::F32, DType::BF16}) {
    const double big = dt == DType::F32 ? 3.4028234663852886e38 : 3.3895313892515355e38;
    // 0: state_views() without notice, 1: then state_changed(), 2: import_state(), 3: then a refused
    // state_changed({0, 7}), 4: then state_changed({0}).
    for (int how : {0, 1, 2, 3, 4}) {
      const bool trusted = how == 0 || how == 3;
      const std::string what = std::string(dion3::algorithm_name(alg)) + " " + dion3::dtype_name(dt) + " case " +
                               std::to_string(how);
      Overflow o(alg, dt, NonFinitePolicy::Skip);
      for (int s = 0; s < 2; ++s) {
        o.fill(0.5);
        ASSERT_TRUE(o.h.opt.step()) << what;
      }
      dion3::OptimizerState st = o.h.opt.export_state();
      dion3::HostTensor& mom = st.params[0].tensors[0].second;
      ASSERT_EQ(st.params[0].tensors[0].first, "momentum");
      const int64_t n = static_cast<int64_t>(mom.data.size() / dion3::dtype_size(dt));
      const dion3::MatrixView hv = dion3::MatrixView::contiguous(mom.data.data(), dt, 1, 1, n);
      const std::vector<float> huge(static_cast<std::size_t>(n), static_cast<float>(0.9 * big));
      dion3::cpu::store_row(hv, 0, 0, huge.data());
      if (how == 2) {
        o.h.opt.import_state(st);
      } else {
        const dion3::TensorView v = o.h.opt.state_views(0)[0].second;
        std::memcpy(v.data, mom.data.data(), mom.data.size());
        if (how == 1) o.h.opt.state_changed();
        const std::vector<int> listed = how == 3 ? std::vector<int>{0, 7} : std::vector<int>{0};
        if (how == 3) EXPECT_THROW(o.h.opt.state_changed(listed), dion3::Error) << what;
        if (how == 4) o.h.opt.state_changed(listed);
      }
      o.fill(0.2 * big);
      EXPECT_EQ(o.h.opt.step(), trusted) << what;
      EXPECT_EQ(o.h.opt.steps_skipped(), trusted ? 0 : 1) << what;
      if (!trusted) {
        EXPECT_TRUE(o.weights_finite()) << what;
      }
    }
  }
}

// The gradient scales (times the dtype's largest value) of the verdict tests, here and in the CUDA
// and MPI suites: on one element of a matrix (small gradients elsewhere) they pile its momentum up
// there until a sum overflows while the row norms stay finite, so a bound below the momentum (a
// fraction of it, some rows', another matrix's) would let that step through; then a non-finite
// gradient and small ones.
// The same verdicts with the bound as with a check that reads everything (state_changed() before
// every step), for Dion3, Muon and NorMuon, in set-ups of their own (a drop in one would hide the
// others'): two 8 x 8 matrices of one megabatch, the hot element in a middle row of the first, or
// in the last column of the second; a parameter split into two row blocks, and a 3-D one stepped
// as two matrices (no bound: read whole), the hot element in either block or matrix.
TEST(Hardening, TheMomentumBoundNeverChangesAVerdict) {
  const std::vector<double> scales = {0.2, 0.2, 0.2, 0.2, 0.2, 0.19, 0.19, 0.19, 0.1, 0.05, 0.19, 0.19,
                                      std::numeric_limits<double>::infinity(), 1e-30, 1e-30};
  struct P {
    std::vector<int64_t> shape;
    int64_t hot;  // the element with the large gradient, or -1
  };
  struct Setup {
    std::string name;
    std::vector<int64_t> split;
    std::vector<P> params;
  };
  const std::vector<Setup> setups = {{"two members", {}, {{{8, 8}, 42}, {{8, 8}, -1}}},
                                     {"two members, the second hot", {}, {{{8, 8}, -1}, {{8, 8}, 47}}},
                                     {"split rows, first block", {4, 4}, {{{8, 8}, 18}}},
                                     {"split rows, second block", {4, 4}, {{{8, 8}, 45}}},
                                     {"3-D, first matrix", {}, {{{2, 8, 8}, 20}}},
                                     {"3-D, second matrix", {}, {{{2, 8, 8}, 100}}}};
  for (Algorithm alg : {Algorithm::Dion3, Algorithm::Muon, Algorithm::NorMuon})
  for (const Setup& su : setups)
    for (DType dt : {DType::F32, DType::BF16}) {
      const std::string what = std::string(dion3::algorithm_name(alg)) + " " + su.name + " " + dion3::dtype_name(dt);
      const double big = dt == DType::F32 ? 3.4028234663852886e38 : 3.3895313892515355e38;
      dion3::OptimizerOptions o;
      o.on_nonfinite = NonFinitePolicy::Skip;
      Harness fast(o), exact(o);
      for (Harness* h : {&fast, &exact}) {
        Rng rng(5);
        GroupConfig g;
        g.algorithm = alg;
        g.fraction = 0.5;
        g.split_sizes = su.split;
        const int gi = h->opt.add_group(g);
        for (std::size_t k = 0; k < su.params.size(); ++k) h->add(gi, "w" + std::to_string(k), dt, su.params[k].shape, rng);
      }
      int applied = 0;
      for (std::size_t s = 0; s < scales.size(); ++s) {
        for (Harness* h : {&fast, &exact})
          for (std::size_t k = 0; k < su.params.size(); ++k)
            for (int64_t i = 0; i < h->params[k]->g.numel(); ++i)  // the same signs every step
              h->params[k]->g.set(i, (i % 3 == 0 ? -1.0 : 1.0) * (i == su.params[k].hot ? scales[s] * big : 1e-3));
        exact.opt.state_changed();
        const bool a = fast.opt.step(), b = exact.opt.step();
        EXPECT_EQ(a, b) << what << ": step " << s << " (gradient " << scales[s] << " x max)";
        applied += a;
        EXPECT_EQ(t3::snapshot(fast.opt, fast.all()), t3::snapshot(exact.opt, exact.all())) << what << ": step " << s;
      }
      EXPECT_GT(applied, 3) << what;
      EXPECT_LT(applied, static_cast<int>(scales.size())) << what;
    }
}

// AdamW's two bounds per parameter (raised by every applied step) give the same verdicts as
// reading the moments at every step, in float32, bfloat16 and float16: from small moments
// (bounds known), a gradient jumps to a multiple of g*, where (1 - beta2) g^2 reaches the
// dtype's largest value (beta2 = 0.9999): below the bounds' limit (about g* / 2), past it but
// still finite, past g*, Inf and NaN; then a second jump from the moments the first left, among
// them one below the limit of small moments that a second moment near the largest value cannot
// take (a bound set too low would let it through).
TEST(Hardening, TheAdamWBoundsNeverChangeAVerdict) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    int applied = 0, steps = 0;
    for (auto [jump, again] : {std::pair{0.45, 0.45}, std::pair{0.55, 0.55}, std::pair{0.9, 0.9}, std::pair{1.05, 1.05},
                               std::pair{3.0, 3.0}, std::pair{inf, inf}, std::pair{nan, nan}, std::pair{0.95, 0.49},
                               std::pair{0.95, 0.3}}) {
      const std::string what =
          std::string(dion3::dtype_name(dt)) + ", jumps " + std::to_string(jump) + ", " + std::to_string(again);
      const double gstar = std::sqrt(dion3::largest_finite(dt) / 1e-4);
      dion3::OptimizerOptions o;
      o.on_nonfinite = NonFinitePolicy::Skip;
      Harness fast(o), exact(o);
      const std::vector<std::vector<int64_t>> shapes = {{64}, {7, 9}};
      for (Harness* h : {&fast, &exact}) {
        Rng rng(6);
        GroupConfig g;
        g.algorithm = Algorithm::AdamW;
        g.betas = {0.9, 0.9999};
        const int gi = h->opt.add_group(g);
        for (std::size_t k = 0; k < shapes.size(); ++k) h->add(gi, "p" + std::to_string(k), dt, shapes[k], rng);
      }
      const std::vector<double> scales = {0.0, 0.0, jump, 0.0, again};  // 0: every gradient 1e-3
      for (std::size_t s = 0; s < scales.size(); ++s) {
        for (Harness* h : {&fast, &exact})
          for (std::size_t k = 0; k < shapes.size(); ++k)
            for (int64_t i = 0; i < h->params[k]->g.numel(); ++i)  // the same signs every step
              h->params[k]->g.set(i, (i % 3 == 0 ? -1.0 : 1.0) * (k == 0 && i == 5 && scales[s] != 0.0 ? scales[s] * gstar : 1e-3));
        exact.opt.state_changed();
        const bool a = fast.opt.step(), b = exact.opt.step();
        EXPECT_EQ(a, b) << what << ": step " << s;
        applied += a;
        ++steps;
        EXPECT_EQ(t3::snapshot(fast.opt, fast.all()), t3::snapshot(exact.opt, exact.all())) << what << ": step " << s;
      }
    }
    EXPECT_GT(applied, steps / 2) << dion3::dtype_name(dt);
    EXPECT_LT(applied, steps - 3) << dion3::dtype_name(dt);
  }
}

// The check leaves AdamW's moments unread where the gradient is below the bounds' limit: with
// bounds that wrongly claim a small state (it holds an Inf), small gradients pass; a gradient
// past the limit, or no bounds, reads the state and refuses. Lion's one bound likewise.
TEST(Hardening, ElementwiseBoundsLetTheCheckSkipTheMoments) {
  auto be = dion3::make_cpu_backend();
  const int64_t n = 40;
  std::vector<float> g(n, 1e-3f), m(n, 0.0f), v(n, 1.0f);
  m[17] = std::numeric_limits<float>::infinity();
  float bounds[2] = {1.0f, 1.0f};
  dion3::StepCheck c;
  c.rule = dion3::StepCheck::AdamW;
  c.grad = dion3::MatrixView::contiguous(g.data(), DType::F32, 1, 1, n);
  c.state = dion3::MatrixView::contiguous(m.data(), DType::F32, 1, 1, n);
  c.state2 = dion3::MatrixView::contiguous(v.data(), DType::F32, 1, 1, n);
  c.a = 0.9f;
  c.b = 0.95f;
  auto refused = [&](const float* b) {
    c.state_bound = b;
    int flag = 0;
    be->check_step({&c, 1}, &flag);
    return flag != 0;
  };
  EXPECT_FALSE(refused(bounds));
  EXPECT_TRUE(refused(nullptr));
  const float unknown[2] = {0.0f, 1.0f};
  EXPECT_TRUE(refused(unknown));
  const float limit = dion3::adamw_gradient_limit(bounds, 0.9f, 0.95f, dion3::largest_finite(DType::F32));
  ASSERT_GT(limit, 1e18f);
  // No gradient passes without a limit the rule's values keep: a NaN beta1 (exp_avg NaN), a beta2
  // outside [0, 1] (exp_avg_sq may turn negative).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (auto [b1, b2] : {std::pair{nan, 0.95f}, std::pair{0.9f, nan}, std::pair{0.9f, 1.5f}, std::pair{0.9f, -0.1f}})
    EXPECT_LT(dion3::adamw_gradient_limit(bounds, b1, b2, dion3::largest_finite(DType::F16)), 0.0f) << b1 << " " << b2;
  g[17] = 1.5f * limit;  // exp_avg_sq stays finite: only the state read (exp_avg Inf) refuses it
  EXPECT_TRUE(refused(bounds));
  // Lion: exp_avg' = m + (1 - beta2)(g - m), beta2 in b; the first bound only.
  c.rule = dion3::StepCheck::Lion;
  c.state2 = {};
  c.b = 0.99f;
  g[17] = 1e-3f;
  EXPECT_FALSE(refused(bounds));
  EXPECT_TRUE(refused(nullptr));
  EXPECT_TRUE(refused(unknown));
  const float lion_limit = dion3::state_gradient_limit(dion3::StepCheck::Lion, bounds, 0.9f, 0.99f,
                                                       dion3::largest_finite(DType::F32));
  EXPECT_EQ(lion_limit, 0.25f * dion3::largest_finite(DType::F32));
  g[17] = 1.5f * lion_limit;
  EXPECT_TRUE(refused(bounds));
  // No gradient passes for a NaN or infinite beta2, or a bound that leaves no room.
  for (float b2 : {nan, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()})
    EXPECT_FALSE(dion3::state_gradient_limit(dion3::StepCheck::Lion, bounds, 0.9f, b2, 1.0f) >= 0.0f) << b2;
  const float huge[1] = {0.2f};
  EXPECT_LT(dion3::state_gradient_limit(dion3::StepCheck::Lion, huge, 0.9f, 0.5f, 1.0f), 0.0f);
}

// An element-wise call (AdamW, Lion) with one bad parameter among good ones is refused before any
// is written: a view that is not flat like the weight, one of another length, a float64 view, a
// view without data. The parameters before the bad one keep their weights and moments.
TEST(Hardening, ElementwiseCallsCheckEveryParameterFirst) {
  using dion3::MatrixView;
  auto be = dion3::make_cpu_backend();
  const int64_t n = 64;
  std::vector<float> w(n, 1.0f), g(n, 0.5f), m(n, 0.25f), v(n, 0.125f), w2(n, 2.0f), g2(n, 0.5f), m2(n, 0.0f),
      v2(n, 0.0f);
  std::vector<double> g64(n, 0.5);
  int64_t steps = 0;
  const dion3::AdamWParams ah{0.01f, 0.9f, 0.95f, 0.1f, 1e-8f, &steps, 0};
  const dion3::LionParams lh{0.01f, 0.9f, 0.99f, 0.1f};
  auto flat = [&](void* p, DType t = DType::F32, int64_t rows = 1, int64_t cols = -1) {
    return MatrixView::contiguous(p, t, 1, rows, cols < 0 ? n / rows : cols);
  };
  const dion3::ElementwiseParam good{flat(w.data()), flat(g.data()), flat(m.data()), flat(v.data())};
  struct Bad { const char* what; dion3::ElementwiseParam p; const char* message; };
  const Bad bads[] = {
      {"2-D grad", {flat(w2.data()), flat(g2.data(), DType::F32, 2), flat(m2.data()), flat(v2.data())},
       "grad is 1 x 2 x 32"},
      {"short exp_avg", {flat(w2.data()), flat(g2.data()), flat(m2.data(), DType::F32, 1, n - 1), flat(v2.data())},
       "exp_avg is 1 x 1 x 63"},
      {"float64 grad", {flat(w2.data()), flat(g64.data(), DType::F64), flat(m2.data()), flat(v2.data())},
       "grad is float64"},
      {"no weight data", {flat(nullptr), flat(g2.data()), flat(m2.data()), flat(v2.data())}, "weight has no data"},
  };
  for (const Bad& b : bads)
    for (bool adamw : {true, false}) {
      const dion3::ElementwiseParam ps[2] = {good, b.p};
      const dion3::AdamWParams ahs[2] = {ah, ah};
      const dion3::LionParams lhs[2] = {lh, lh};
      dion3::Status st = dion3::Status::Ok;
      const std::string what = t3::error_of([&] {
        if (adamw) be->adamw(ps, ahs, nullptr);
        else be->lion(ps, lhs, nullptr);
      }, &st);
      EXPECT_EQ(st, dion3::Status::InvalidArgument) << b.what;
      EXPECT_THAT(what, HasSubstr(std::string(adamw ? "adamw" : "lion") + ": parameter 1: " + b.message)) << b.what;
      EXPECT_EQ(w, std::vector<float>(n, 1.0f)) << b.what;
      EXPECT_EQ(m, std::vector<float>(n, 0.25f)) << b.what;
      EXPECT_EQ(v, std::vector<float>(n, 0.125f)) << b.what;
    }
  // AdamW's second moment is checked too; Lion has none.
  const dion3::ElementwiseParam no_v{flat(w.data()), flat(g.data()), flat(m.data()), flat(v.data(), DType::F32, 1, 3)};
  EXPECT_THAT(t3::error_of([&] { be->adamw({&no_v, 1}, {&ah, 1}, nullptr); }),
              HasSubstr("adamw: parameter 0: exp_avg_sq is 1 x 1 x 3"));
  be->lion({&no_v, 1}, {&lh, 1}, nullptr);
  EXPECT_NE(w, std::vector<float>(n, 1.0f));
}

// AdamW raises each parameter's bounds to at least its stored moments' largest |exp_avg| and
// exp_avg_sq (rounded to the state's dtype), and never lowers them.
TEST(Hardening, AdamWRaisesItsStateBounds) {
  auto be = dion3::make_cpu_backend();
  Rng rng(10);
  // The moments' dtypes: both float32, both bfloat16, and exp_avg in bfloat16 beside a float32
  // exp_avg_sq (each bound rounded as its own moment is stored).
  for (auto [st, st2] : {std::pair{DType::F32, DType::F32}, std::pair{DType::BF16, DType::BF16},
                         std::pair{DType::BF16, DType::F32}}) {
    const int64_t n = 3000;  // more than one piece of the parallel loop
    std::vector<float> w(n), g(n);
    for (int64_t i = 0; i < n; ++i) w[i] = static_cast<float>(rng.normal()), g[i] = static_cast<float>(rng.normal());
    g[2500] = 40.0f;
    std::vector<unsigned char> m(n * dion3::dtype_size(st), 0), v(n * dion3::dtype_size(st2), 0);
    int64_t steps = 0;
    dion3::AdamWParams h{0.01f, 0.9f, 0.95f, 0.0f, 1e-8f, &steps, 0};
    float bounds[2] = {0.0f, 0.0f};
    dion3::ElementwiseParam e{dion3::MatrixView::contiguous(w.data(), DType::F32, 1, 1, n),
                              dion3::MatrixView::contiguous(g.data(), DType::F32, 1, 1, n),
                              dion3::MatrixView::contiguous(m.data(), st, 1, 1, n),
                              dion3::MatrixView::contiguous(v.data(), st2, 1, 1, n), bounds};
    be->adamw({&e, 1}, {&h, 1}, nullptr);
    std::vector<float> mf(n), vf(n);
    dion3::cpu::load_row(e.exp_avg, 0, 0, mf.data());
    dion3::cpu::load_row(e.exp_avg_sq, 0, 0, vf.data());
    float bm = 0.0f, bv = 0.0f;
    for (int64_t i = 0; i < n; ++i) bm = std::max(bm, std::fabs(mf[i])), bv = std::max(bv, vf[i]);
    EXPECT_EQ(bounds[0], bm) << dion3::dtype_name(st) << " / " << dion3::dtype_name(st2);
    EXPECT_EQ(bounds[1], bv) << dion3::dtype_name(st) << " / " << dion3::dtype_name(st2);
    std::fill(g.begin(), g.end(), 0.0f);  // the moments shrink; the bounds stay
    be->adamw({&e, 1}, {&h, 1}, nullptr);
    EXPECT_EQ(bounds[0], bm) << dion3::dtype_name(st) << " / " << dion3::dtype_name(st2);
    EXPECT_EQ(bounds[1], bv) << dion3::dtype_name(st) << " / " << dion3::dtype_name(st2);
  }
}

// Lion's bound (the largest |exp_avg| its steps stored) gives the same verdicts as reading the
// moment at every step, in float32, bfloat16 and float16. With beta2 = 0.5 the moment follows the
// gradient quickly: one element's gradient sits at +0.9 x the dtype's largest value until the
// moment is near it, then turns to -0.2 x it (below the limit a small bound gives, but g - m
// overflows: refused), twice; smaller swings, Inf and NaN. A bound below that element's moment
// would let the turns through.
TEST(Hardening, TheLionBoundNeverChangesAVerdict) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> scales = {0.9, 0.9, 0.9, 0.9, -0.2, 0.3, 0.9, 0.9, -0.2, 0.0, -0.2, inf, nan, 0.0, 0.0};
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const std::string what = dion3::dtype_name(dt);
    const double big = dion3::largest_finite(dt);
    dion3::OptimizerOptions o;
    o.on_nonfinite = NonFinitePolicy::Skip;
    Harness fast(o), exact(o);
    const std::vector<std::vector<int64_t>> shapes = {{64}, {7, 9}};
    for (Harness* h : {&fast, &exact}) {
      Rng rng(7);
      GroupConfig g;
      g.algorithm = Algorithm::Lion;
      g.lr = 1e-3;
      g.betas = {0.9, 0.5};
      const int gi = h->opt.add_group(g);
      for (std::size_t k = 0; k < shapes.size(); ++k) h->add(gi, "p" + std::to_string(k), dt, shapes[k], rng);
    }
    int applied = 0;
    for (std::size_t s = 0; s < scales.size(); ++s) {
      for (Harness* h : {&fast, &exact})
        for (std::size_t k = 0; k < shapes.size(); ++k)
          for (int64_t i = 0; i < h->params[k]->g.numel(); ++i)  // 0: every gradient 1e-3
            h->params[k]->g.set(i, k == 1 && i == 40 && scales[s] != 0.0 ? scales[s] * big : (i % 3 == 0 ? -1e-3 : 1e-3));
      exact.opt.state_changed();
      const bool a = fast.opt.step(), b = exact.opt.step();
      EXPECT_EQ(a, b) << what << ": step " << s;
      applied += a;
      EXPECT_EQ(t3::snapshot(fast.opt, fast.all()), t3::snapshot(exact.opt, exact.all())) << what << ": step " << s;
    }
    // Inf and NaN are refused everywhere; float32 and bfloat16 refuse the turns too (float16's
    // moment, taken in float32, cannot leave its range from float16 gradients).
    EXPECT_GT(applied, 5) << what;
    EXPECT_LT(applied, static_cast<int>(scales.size()) - (dt == DType::F16 ? 1 : 3)) << what;
  }
}

// Lion raises its bound to at least the largest |exp_avg| stored (rounded to its dtype), and
// never lowers it.
TEST(Hardening, LionRaisesItsStateBound) {
  auto be = dion3::make_cpu_backend();
  Rng rng(11);
  for (DType st : {DType::F32, DType::BF16}) {
    const int64_t n = 3000;  // more than one piece of the parallel loop
    std::vector<float> w(n), g(n);
    for (int64_t i = 0; i < n; ++i) w[i] = static_cast<float>(rng.normal()), g[i] = static_cast<float>(rng.normal());
    g[2500] = 40.0f;
    std::vector<unsigned char> m(n * dion3::dtype_size(st), 0);
    const dion3::LionParams h{0.01f, 0.9f, 0.99f, 0.0f};
    float bound = 0.0f;
    dion3::ElementwiseParam e{dion3::MatrixView::contiguous(w.data(), DType::F32, 1, 1, n),
                              dion3::MatrixView::contiguous(g.data(), DType::F32, 1, 1, n),
                              dion3::MatrixView::contiguous(m.data(), st, 1, 1, n), {}, &bound};
    be->lion({&e, 1}, {&h, 1}, nullptr);
    std::vector<float> mf(n);
    dion3::cpu::load_row(e.exp_avg, 0, 0, mf.data());
    float bm = 0.0f;
    for (int64_t i = 0; i < n; ++i) bm = std::max(bm, std::fabs(mf[i]));
    EXPECT_GT(bm, 0.3f) << dion3::dtype_name(st);
    EXPECT_EQ(bound, bm) << dion3::dtype_name(st);
    std::fill(g.begin(), g.end(), 0.0f);  // the moment shrinks; the bound stays
    be->lion({&e, 1}, {&h, 1}, nullptr);
    EXPECT_EQ(bound, bm) << dion3::dtype_name(st);
  }
}

// The state bounds' gradient limits are sound, by brute force: wherever a bound lets the check
// leave the state unread (|g| <= the limit, every stored |state| within the bound, AdamW's second
// moment in [0, its bound]), a check that reads the state accepts. Every rule and dtype, bounds
// from tiny to the dtype's largest value, coefficients at and inside their ranges, states at and
// under the bounds, gradients at and under the limits.
TEST(Hardening, TheStateBoundsLimitsAreSound) {
  using dion3::StepCheck;
  auto be = dion3::make_cpu_backend();
  Rng rng(31);
  const std::vector<float> mus = {0.0f, 0.5f, 0.9f, 0.95f, 0.999f, 1.0f};
  const std::vector<float> betas = {0.0f, 0.5f, 0.9f, 0.99f, 0.9999f, 1.0f};
  const int64_t n = 64;
  int tested = 0;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (StepCheck::Rule rule : {StepCheck::Momentum, StepCheck::AdamW, StepCheck::Lion})
      for (int trial = 0; trial < 400; ++trial) {
        const float largest = dion3::largest_finite(dt);
        auto pick = [&](const std::vector<float>& xs) { return xs[rng.next() % xs.size()]; };
        // A bound as a stored value is one: log-uniform from 1e-6 of the largest value to all of it.
        auto bound_value = [&] {
          const float x = largest * static_cast<float>(std::pow(10.0, -6.0 * rng.uniform()));
          return dion3::cpu::round_to(dt, std::min(x, largest));
        };
        float a = 0.0f, b = 0.0f, c = 1.0f;
        if (rule == StepCheck::Momentum) {
          a = pick(mus);
          b = rng.next() % 2 ? a : 0.0f;  // Nesterov or not
          c = rng.next() % 2 ? 1.0f - a : 1.0f;  // averaged momentum or not
        } else {
          a = pick(betas);
          b = pick(betas);
        }
        const float bounds[2] = {bound_value(), bound_value()};
        const float limit = dion3::state_gradient_limit(rule, bounds, a, b, largest);
        if (!(limit >= 0.0f)) continue;  // the state is read
        std::vector<float> g(n), m(n), v(n);
        for (int64_t j = 0; j < n; ++j) {
          const double u = j < 4 ? 1.0 : rng.uniform();  // some at the bound and the limit exactly
          const double sign = rng.next() % 2 ? 1.0 : -1.0;
          m[j] = dion3::cpu::round_to(dt, static_cast<float>(sign * u * bounds[0]));
          v[j] = dion3::cpu::round_to(dt, static_cast<float>((j < 4 ? 1.0 : rng.uniform()) * bounds[1]));
          float x = dion3::cpu::round_to(dt, static_cast<float>((rng.next() % 2 ? 1.0 : -1.0) * (j < 8 ? 1.0 : rng.uniform()) * limit));
          if (std::fabs(x) > limit) x = 0.0f;  // rounded past the limit: such a gradient is read
          g[j] = x;
        }
        const std::size_t es = dion3::dtype_size(dt);
        std::vector<unsigned char> gb(n * es), mb(n * es), vb(n * es);
        StepCheck x;
        x.rule = rule;
        x.grad = dion3::MatrixView::contiguous(gb.data(), dt, 1, 1, n);
        x.state = dion3::MatrixView::contiguous(mb.data(), dt, 1, 1, n);
        if (rule == StepCheck::AdamW) x.state2 = dion3::MatrixView::contiguous(vb.data(), dt, 1, 1, n);
        dion3::cpu::store_row(x.grad, 0, 0, g.data());
        dion3::cpu::store_row(x.state, 0, 0, m.data());
        if (rule == StepCheck::AdamW) dion3::cpu::store_row(x.state2, 0, 0, v.data());
        x.a = a;
        x.b = b;
        x.c = c;
        int flag = 0;
        be->check_step({&x, 1}, &flag);  // no bound: everything read
        EXPECT_EQ(flag, 0) << dion3::dtype_name(dt) << " rule " << rule << " a " << a << " b " << b << " c " << c
                           << " bounds " << bounds[0] << ", " << bounds[1] << " limit " << limit;
        ++tested;
      }
  EXPECT_GT(tested, 2000);
}

// Every layout over one rank (loopback communicators) steps as one device does, with the
// orthogonalizer in bf16 on fp32 momentum, wide selections and selections wider than the matrix
// (k > n), whole megabatches and chunks of one matrix: each path's buffers (the update rows in
// the arena, their row sums) must be there and fit where the plan put them. (Under the sanitizer
// job a write past them fails here too.)
TEST(Hardening, EveryLayoutOverOneRankStepsAsOneDevice) {
  using dion3::Layout;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 512}, {64, 512}, {48, 40}, {40, 300}, {40, 8}, {40, 8}};
  for (Algorithm algo : {Algorithm::Dion3, Algorithm::NorMuon, Algorithm::Muon})
    for (std::size_t limit : {std::size_t{0}, std::size_t{1}}) {
      auto run = [&](Layout kind) {
        dion3::OptimizerOptions o;
        o.workspace_limit = limit;  // 1: every chunk one matrix
        Harness h(o);
        GroupConfig g;
        g.algorithm = algo;
        g.lr = 0.02;
        g.orth.iteration_dtype = DType::BF16;
        const int gi = h.opt.add_group(g);
        Rng rng(21);
        const auto comm = dion3::make_loopback_communicator(), col_comm = dion3::make_loopback_communicator();
        std::vector<std::unique_ptr<t3::HostParam>> ps;
        for (auto [m, n] : shapes) {
          auto p = std::make_unique<t3::HostParam>("w" + std::to_string(ps.size()), DType::F32,
                                                   std::vector<int64_t>{m, n});
          for (int64_t i = 0; i < p->w.numel(); ++i) p->w.set(i, 0.05 * rng.normal());
          dion3::ParamSpec spec = p->spec();
          spec.layout.kind = kind;
          if (kind != Layout::Local) spec.layout.comm = comm;
          if (kind == Layout::Block) spec.layout.col_comm = col_comm;
          spec.layout.global_rows = m;
          spec.layout.global_cols = n;
          p->index = h.opt.add_param(gi, spec);
          ps.push_back(std::move(p));
        }
        for (int step = 0; step < 2; ++step) {
          for (auto& p : ps)
            for (int64_t i = 0; i < p->g.numel(); ++i) p->g.set(i, rng.normal());
          EXPECT_TRUE(h.opt.step());
        }
        std::vector<std::vector<double>> w;
        for (auto& p : ps) w.push_back(p->w.values());
        return w;
      };
      const auto local = run(Layout::Local);
      for (Layout kind : {Layout::Replicated, Layout::RowShard, Layout::ColShard, Layout::Block}) {
        const auto got = run(kind);
        for (std::size_t i = 0; i < got.size(); ++i)
          EXPECT_LE(t3::max_abs_diff(got[i], local[i]), 1e-6)
              << dion3::algorithm_name(algo) << ", " << dion3::layout_name(kind) << ", workspace limit " << limit
              << ", parameter " << i;
      }
    }
}

// A workspace limit that splits a megabatch into chunks of unequal size: the smaller last chunk
// can need more arena than the full ones (its update rows no longer fit inside the
// orthogonalizer's workspace), and the arena must be sized for it. Every chunk's result equals
// the whole megabatch's. (Under the sanitizer job the undersized arena was a write past it.)
TEST(Hardening, UnevenChunksGetTheWorkspaceTheyNeed) {
  auto run = [](std::size_t limit) {
    dion3::OptimizerOptions o;
    o.workspace_limit = limit;
    Harness h(o);
    GroupConfig g;
    g.algorithm = Algorithm::NorMuon;
    g.lr = 0.02;
    g.orth.method = dion3::OrthMethod::Standard;
    const int gi = h.opt.add_group(g);
    Rng rng(5);
    for (int i = 0; i < 51; ++i) h.add(gi, "w" + std::to_string(i), DType::F32, {1, 9}, rng);
    h.randomize_grads(rng);
    EXPECT_TRUE(h.opt.step());
    std::vector<double> w;
    for (auto* p : h.all()) for (double x : p->w.values()) w.push_back(x);
    return std::make_pair(w, h.opt.plan());
  };
  const auto [whole, whole_plan] = run(std::size_t{1} << 30);
  const auto [chunked, plan] = run(4096);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_LT(plan[0].chunk, 51) << "the limit must split the megabatch";
  EXPECT_NE(51 % plan[0].chunk, 0) << "the chunks must be of unequal size";
  EXPECT_EQ(chunked, whole);
}

// select_rows' `largest`: each score vector's largest score plus one.
TEST(Hardening, SelectRowsWritesEachVectorsLargestScorePlusOne) {
  auto be = dion3::make_cpu_backend();
  Rng rng(9);
  const int64_t count = 3, m = 37;
  std::vector<float> scores(count * m);
  for (float& x : scores) x = static_cast<float>(std::fabs(rng.normal()) * 10.0);
  scores[1 * m + 17] = 1e30f;  // a middle row of the second vector
  std::vector<int32_t> idx(count * 5);
  std::vector<float> largest(count, -1.0f);
  be->select_rows(scores.data(), count, m, 5, idx.data(), nullptr, largest.data(), nullptr, nullptr);
  for (int64_t i = 0; i < count; ++i)
    EXPECT_EQ(largest[i], *std::max_element(scores.begin() + i * m, scores.begin() + (i + 1) * m) + 1.0f) << i;
}

TEST(Hardening, Float16AdamWUnderALargeGradientNeverWritesNonFiniteWeights) {
  // g = 2000 with float16 state: the second moment climbs towards g^2 = 4e6 > 65504; the step
  // that would round it to Inf is dropped, every other is applied.
  Overflow o(Algorithm::AdamW, DType::F16, NonFinitePolicy::Skip);
  int applied = 0, dropped = 0;
  for (int s = 0; s < 40; ++s) {
    o.fill(2000);
    (o.h.opt.step() ? applied : dropped) += 1;
    ASSERT_TRUE(o.weights_finite()) << "step " << s;
  }
  EXPECT_GT(applied, 0);
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(o.h.opt.steps_skipped(), dropped);
}

// ---- settings set through the C++ structs, outside what a step accepts ----------------------

// Enums cast from integers out of range are refused when the group is added, naming the field
// (an unknown algorithm would make no state, and the step read past it).
TEST(Hardening, EnumsOutOfRangeAreRefusedByName) {
  const std::vector<std::pair<const char*, std::function<void(GroupConfig&)>>> cases = {
      {"'algorithm' = 42", [](GroupConfig& g) { g.algorithm = static_cast<Algorithm>(42); }},
      {"'algorithm' = -1", [](GroupConfig& g) { g.algorithm = static_cast<Algorithm>(-1); }},
      {"'adjust_lr' = 4", [](GroupConfig& g) { g.adjust_lr = static_cast<dion3::AdjustLR>(4); }},
      {"'orth.method' = 3", [](GroupConfig& g) { g.orth.method = static_cast<dion3::OrthMethod>(3); }},
      {"'selection_scope' = 2", [](GroupConfig& g) { g.selection_scope = static_cast<dion3::SelectionScope>(2); }},
  };
  for (const auto& [what, edit] : cases) {
    Harness h;
    GroupConfig g;
    edit(g);
    EXPECT_THAT(t3::error_of([&] { h.opt.add_group(g); }), HasSubstr(what)) << what;
    // Set later through the group's reference: the step refuses it, nothing moves.
    Harness later;
    const int gi = later.opt.add_group(GroupConfig{});
    t3::HostParam p("w", DType::F32, {8, 12});
    Rng rng(4);
    for (int64_t i = 0; i < p.w.numel(); ++i) p.w.set(i, 0.05 * rng.normal());
    for (int64_t i = 0; i < p.g.numel(); ++i) p.g.set(i, rng.normal());
    p.index = later.opt.add_param(gi, p.spec());
    ASSERT_TRUE(later.opt.step()) << what;
    const std::vector<double> w = p.w.values();
    edit(later.opt.group(gi));
    EXPECT_THAT(t3::error_of([&] { later.opt.step(); }), HasSubstr(what)) << what;
    EXPECT_EQ(p.w.values(), w) << what;
  }
}

// plan() builds a plan only from settings a step accepts: an edit the step refuses is refused by
// plan() too, with the step's words, and the step that follows refuses it through the plan it
// still has (a plan of the edit would have that refusal read state the parameter lacks).
TEST(Hardening, PlanRefusesSettingsTheStepRefuses) {
  // The plan is stale from the changed algorithm alone, or also from an added group.
  for (auto [with_comm, add_group] : {std::pair{false, false}, {false, true}, {true, false}, {true, true}}) {
    Harness h;
    GroupConfig c;
    c.algorithm = Algorithm::Lion;
    const int g = h.opt.add_group(c);
    t3::HostParam p("w", DType::F32, {16});
    for (int64_t i = 0; i < 16; ++i) p.w.set(i, 0.5), p.g.set(i, 0.1);
    dion3::ParamSpec spec = p.spec();
    if (with_comm) {
      spec.layout.kind = dion3::Layout::Replicated;
      spec.layout.comm = dion3::make_loopback_communicator();
      spec.layout.global_rows = 16;
    }
    p.index = h.opt.add_param(g, spec);
    ASSERT_TRUE(h.opt.step());
    const std::vector<double> w = p.w.values();
    h.opt.group(g).algorithm = Algorithm::AdamW;
    if (add_group) h.opt.add_group(GroupConfig{});
    const std::string refused = t3::error_of([&] { h.opt.plan(); });
    EXPECT_THAT(refused, HasSubstr("cannot change 'algorithm' from lion to adamw")) << with_comm << add_group;
    EXPECT_THAT(t3::error_of([&] { h.opt.step(); }), HasSubstr("cannot change 'algorithm' from lion to adamw"))
        << with_comm << add_group;
    EXPECT_EQ(p.w.values(), w) << with_comm << add_group;
  }
}

}  // namespace
