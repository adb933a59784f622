// tests/cpp/test_baselines.cpp — the baseline modes through dion3::Optimizer (algorithm.md §1
// "Baselines", §4): Muon (with and without Nesterov, its textbook first step, cautious weight
// decay), NorMuon, AdamW (bias-corrected) and Lion, each against the float64 reference, with
// f32 and 16-bit parameters.
#include <gtest/gtest.h>

#include <ostream>

#include <cmath>

#include "dion3/optimizer.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using dion3::Algorithm;
using dion3::AdjustLR;
using dion3::DType;
using dion3::GroupConfig;
using t3::Harness;
using t3::Rng;

using t3::max_change;
using t3::weight_tol;

// ---------------------------------------------------------------------------------------------
struct MatrixCase {
  std::string name;
  Algorithm algorithm;
  int m, n;
  bool nesterov = false;
  bool ema = false;  // ema_momentum
  AdjustLR adjust = AdjustLR::SpectralNorm;
  double wd = 0.01;
  DType dtype = DType::F32;
};
void PrintTo(const MatrixCase& c, std::ostream* os) { *os << c.name; }

class MuonFamilyVsReference : public ::testing::TestWithParam<MatrixCase> {};

TEST_P(MuonFamilyVsReference, SeveralSteps) {
  const MatrixCase c = GetParam();
  Rng rng(2000 + c.m * 17 + c.n);
  GroupConfig g;
  g.algorithm = c.algorithm;
  g.lr = 0.02;
  g.nesterov = c.nesterov;
  g.ema_momentum = c.ema;
  g.adjust_lr = c.adjust;
  g.weight_decay = c.wd;
  Harness h;
  t3::HostParam& p = h.add(h.opt.add_group(g), "w", c.dtype, {c.m, c.n}, rng);
  const auto hyper = t3::matrix_hyper(g, c.dtype);
  const auto W0 = p.w.values();
  ref::Mat W = W0, M(static_cast<size_t>(c.m) * c.n, 0.0);
  ref::Vec v(c.m, 0.0);
  for (int step = 0; step < 4; ++step) {
    h.randomize_grads(rng);
    if (c.algorithm == Algorithm::Muon) ref::muon_step(W, M, p.g.values(), c.m, c.n, hyper);
    else ref::normuon_step(W, M, v, p.g.values(), c.m, c.n, hyper);
    ASSERT_TRUE(h.opt.step());
    EXPECT_LE(t3::max_abs_diff(p.w.values(), W), weight_tol(c.dtype, t3::max_abs(W), max_change(W, W0)))
        << "step " << step + 1;
  }
  const double mtol = c.dtype == DType::F32 ? 1e-5 : c.dtype == DType::F16 ? 2e-3 : 1.6e-2;
  EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "momentum"), M), mtol);
  if (c.algorithm == Algorithm::NorMuon)
    EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "variance"), v), c.dtype == DType::F32 ? 1e-3 : 5e-2);
  else
    EXPECT_FALSE(t3::has_state(h.opt, p.index, "variance"));  // Muon keeps no second moment
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MuonFamilyVsReference,
    ::testing::Values(MatrixCase{.name = "muon_wide", .algorithm = Algorithm::Muon, .m = 24, .n = 64},
                      MatrixCase{.name = "muon_tall_nesterov", .algorithm = Algorithm::Muon, .m = 64, .n = 24, .nesterov = true},
                      MatrixCase{.name = "muon_square_rms", .algorithm = Algorithm::Muon, .m = 32, .n = 32,
                                 .adjust = AdjustLR::RmsNorm},
                      MatrixCase{.name = "muon_bf16", .algorithm = Algorithm::Muon, .m = 32, .n = 48, .dtype = DType::BF16},
                      // torch.optim.Muon's form: averaged momentum, Nesterov, sqrt(max(1, m/n))
                      MatrixCase{.name = "muon_ema_tall_nesterov_clamped", .algorithm = Algorithm::Muon, .m = 64, .n = 24,
                                 .nesterov = true, .ema = true, .adjust = AdjustLR::SpectralNormClamped, .wd = 0.1},
                      MatrixCase{.name = "muon_ema_wide_clamped_bf16", .algorithm = Algorithm::Muon, .m = 24, .n = 64,
                                 .ema = true, .adjust = AdjustLR::SpectralNormClamped, .dtype = DType::BF16},
                      MatrixCase{.name = "normuon_ema_nesterov", .algorithm = Algorithm::NorMuon, .m = 40, .n = 24,
                                 .nesterov = true, .ema = true},
                      MatrixCase{.name = "normuon_wide", .algorithm = Algorithm::NorMuon, .m = 16, .n = 80},
                      MatrixCase{.name = "normuon_tall_nesterov_none", .algorithm = Algorithm::NorMuon, .m = 80, .n = 16,
                                 .nesterov = true, .adjust = AdjustLR::None, .wd = 0.1},
                      MatrixCase{.name = "normuon_f16", .algorithm = Algorithm::NorMuon, .m = 48, .n = 32, .dtype = DType::F16}),
    [](const ::testing::TestParamInfo<MatrixCase>& i) { return i.param.name; });

TEST(Muon, FirstStepIsTheTextbookUpdate) {
  // From zero momentum: M = G, W <- W (1 - lr wd) - lr sqrt(m/n) orth(G), written out by hand.
  const int m = 20, n = 36;
  Rng rng(3);
  GroupConfig g;
  g.algorithm = Algorithm::Muon;
  g.lr = 0.05;
  g.weight_decay = 0.1;
  Harness h;
  t3::HostParam& p = h.add(h.opt.add_group(g), "w", DType::F32, {m, n}, rng);
  h.randomize_grads(rng);
  const auto W0 = p.w.values(), G = p.g.values();
  ASSERT_TRUE(h.opt.step());
  const ref::Mat O = ref::orth_standard(G, m, n, ref::polar_express());
  std::vector<double> want(W0.size());
  for (size_t i = 0; i < W0.size(); ++i) want[i] = W0[i] * (1 - 0.05 * 0.1) - 0.05 * std::sqrt(double(m) / n) * O[i];
  EXPECT_LE(t3::max_abs_diff(p.w.values(), want), 1e-4 * max_change(want, W0) + 1e-7);
  EXPECT_EQ(t3::state_values(h.opt, p.index, "momentum"), G);  // 0.95 * 0 + G, exact
}

TEST(Muon, NesterovChangesOnlyTheOrthogonalizedInput) {
  GroupConfig g;
  g.algorithm = Algorithm::Muon;
  GroupConfig gn = g;
  gn.nesterov = true;
  const auto t = t3::twin_run(g, gn, 16, 32, 4, 2);
  // Same momentum (Nesterov does not change the stored state), different weights.
  EXPECT_EQ(t3::state_values(t->a.opt, t->pa->index, "momentum"), t3::state_values(t->b.opt, t->pb->index, "momentum"));
  EXPECT_NE(t->pa->w.bytes, t->pb->w.bytes);
}

TEST(Muon, AveragedMomentumIsTheSumScaledAndStepsAlike) {
  // At a fixed mu, M = mu M + (1 - mu) G is (1 - mu) times M = mu M + G, and the orthogonalized
  // update does not see the scale: the same weights (to rounding), the momentum scaled.
  for (bool nesterov : {false, true}) {
    GroupConfig g;
    g.algorithm = Algorithm::Muon;
    g.nesterov = nesterov;
    GroupConfig ge = g;
    ge.ema_momentum = true;
    const auto t = t3::twin_run(g, ge, 24, 40, 9, 5);
    ASSERT_TRUE(t->all_applied);
    EXPECT_LE(t3::max_abs_diff(t->pb->w.values(), t->pa->w.values()), 1e-5 * max_change(t->pa->w.values(), t->w0))
        << "nesterov " << nesterov;
    auto summed = t3::state_values(t->a.opt, t->pa->index, "momentum");
    for (double& x : summed) x *= 1.0 - g.mu;
    EXPECT_LE(t3::rel_max_diff(t3::state_values(t->b.opt, t->pb->index, "momentum"), summed), 1e-5);
  }
}

TEST(Muon, AveragedMomentumFollowsAMomentumSchedule) {
  // A warm-up of mu (as Muon recipes do) set between steps: the engine reads the new mu for the
  // decay and for the gradient's share 1 - mu, as the float64 reference does.
  const int m = 48, n = 32;
  Rng rng(21);
  GroupConfig g;
  g.algorithm = Algorithm::Muon;
  g.ema_momentum = true;
  g.nesterov = true;
  g.adjust_lr = AdjustLR::SpectralNormClamped;
  g.lr = 0.02;
  Harness h;
  const int gi = h.opt.add_group(g);
  t3::HostParam& p = h.add(gi, "w", DType::F32, {m, n}, rng);
  ref::Mat W = p.w.values(), M(static_cast<size_t>(m) * n, 0.0);
  const auto W0 = W;
  for (double mu : {0.85, 0.88, 0.91, 0.95}) {
    g.mu = mu;
    h.opt.set_group(gi, g);
    h.randomize_grads(rng);
    ref::muon_step(W, M, p.g.values(), m, n, t3::matrix_hyper(g, DType::F32));
    ASSERT_TRUE(h.opt.step());
    EXPECT_LE(t3::max_abs_diff(p.w.values(), W), weight_tol(DType::F32, t3::max_abs(W), max_change(W, W0)))
        << "mu " << mu;
  }
  EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "momentum"), M), 1e-5);
}

TEST(Muon, CautiousWeightDecayOnlyWhereUpdateAndWeightAgree) {
  // algorithm.md §4: decay only where the update and the weight have the same sign. One step from zero
  // momentum: the update direction is +lr' * orth(G) (it is subtracted).
  const int m = 16, n = 40;
  Rng rng(5);
  GroupConfig g;
  g.algorithm = Algorithm::Muon;
  g.lr = 0.05;
  g.weight_decay = 0.5;  // large, so that the mask is visible
  g.cautious_wd = true;
  Harness h;
  t3::HostParam& p = h.add(h.opt.add_group(g), "w", DType::F32, {m, n}, rng);
  h.randomize_grads(rng);
  const auto W0 = p.w.values(), G = p.g.values();
  ASSERT_TRUE(h.opt.step());
  const ref::Mat O = ref::orth_standard(G, m, n, ref::polar_express());
  const double lr_adj = 0.05 * std::sqrt(double(m) / n);
  std::vector<double> want(W0.size());
  for (size_t i = 0; i < W0.size(); ++i) {
    const bool agree = (O[i] > 0) == (W0[i] > 0);
    want[i] = W0[i] * (agree ? 1 - 0.05 * 0.5 : 1.0) - lr_adj * O[i];
  }
  EXPECT_LE(t3::max_abs_diff(p.w.values(), want), 1e-4 * max_change(want, W0) + 1e-7);
}

// ---------------------------------------------------------------------------------------------
struct ElemCase {
  std::string name;
  Algorithm algorithm;
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
  double wd = 0.01;
};
void PrintTo(const ElemCase& c, std::ostream* os) { *os << c.name; }

class ElementwiseVsReference : public ::testing::TestWithParam<ElemCase> {};

TEST_P(ElementwiseVsReference, SeveralSteps) {
  const ElemCase c = GetParam();
  Rng rng(3000 + static_cast<int>(c.shape.size()) * 11 + static_cast<int>(c.dtype));
  GroupConfig g;
  g.algorithm = c.algorithm;
  g.lr = 1e-3;
  g.weight_decay = c.wd;
  Harness h;
  t3::HostParam& p = h.add(h.opt.add_group(g), "bias", c.dtype, c.shape, rng, 0.5);
  const auto hyper = t3::elem_hyper(g, c.dtype);
  const auto W0 = p.w.values();
  std::vector<double> W = W0, m(W.size(), 0.0), v(W.size(), 0.0);
  int64_t t = 0;
  for (int step = 0; step < 5; ++step) {
    h.randomize_grads(rng);
    if (c.algorithm == Algorithm::AdamW) ref::adamw_step(W, m, v, p.g.values(), t, hyper);
    else ref::lion_step(W, m, p.g.values(), hyper);
    ASSERT_TRUE(h.opt.step());
    // Each element moves by ~lr per step; fp32 arithmetic of the bias correction and sqrt:
    // 1e-4 relative of the change, or a couple of ulps of the stored dtype.
    EXPECT_LE(t3::max_abs_diff(p.w.values(), W), weight_tol(c.dtype, t3::max_abs(W), max_change(W, W0)))
        << "step " << step + 1;
  }
  const double stol = c.dtype == DType::F32 ? 1e-5 : c.dtype == DType::F16 ? 2e-3 : 1.6e-2;
  EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "exp_avg"), m), stol);
  if (c.algorithm == Algorithm::AdamW) {
    EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "exp_avg_sq"), v), stol);
  } else {
    EXPECT_FALSE(t3::has_state(h.opt, p.index, "exp_avg_sq"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ElementwiseVsReference,
    ::testing::Values(ElemCase{.name = "adamw_1d", .algorithm = Algorithm::AdamW, .shape = {96}},
                      ElemCase{.name = "adamw_2d_nowd", .algorithm = Algorithm::AdamW, .shape = {8, 24}, .wd = 0.0},
                      ElemCase{.name = "adamw_3d", .algorithm = Algorithm::AdamW, .shape = {2, 3, 5}},
                      ElemCase{.name = "adamw_bf16", .algorithm = Algorithm::AdamW, .shape = {64}, .dtype = DType::BF16},
                      ElemCase{.name = "lion_1d", .algorithm = Algorithm::Lion, .shape = {96}},
                      ElemCase{.name = "lion_2d_wd", .algorithm = Algorithm::Lion, .shape = {12, 10}, .wd = 0.1},
                      ElemCase{.name = "lion_f16", .algorithm = Algorithm::Lion, .shape = {64}, .dtype = DType::F16}),
    [](const ::testing::TestParamInfo<ElemCase>& i) { return i.param.name; });

TEST(AdamW, FirstStepIsSignLikeThanksToBiasCorrection) {
  // With bias correction, m_hat = g and v_hat = g^2 after one step, so each element moves by
  // lr * g / (|g| + eps) ~= lr * sign(g) (plus weight decay).
  Rng rng(6);
  GroupConfig g;
  g.algorithm = Algorithm::AdamW;
  g.lr = 1e-2;
  g.weight_decay = 0.0;
  Harness h;
  t3::HostParam& p = h.add(h.opt.add_group(g), "b", DType::F32, {50}, rng);
  h.randomize_grads(rng);
  const auto W0 = p.w.values(), G = p.g.values();
  ASSERT_TRUE(h.opt.step());
  const auto W1 = p.w.values();
  for (size_t i = 0; i < W0.size(); ++i) EXPECT_NEAR(W1[i] - W0[i], -1e-2 * (G[i] > 0 ? 1 : -1), 1e-6) << i;
}

TEST(AdamW, MixedWithMatrixGroupsInOneOptimizer) {
  // A model-like set: Dion3 matrices plus AdamW biases, each matching its own reference.
  const int m = 24, n = 40;
  Rng rng(7);
  GroupConfig gd, ga;
  gd.lr = 0.02;
  ga.algorithm = Algorithm::AdamW;
  ga.lr = 1e-3;
  Harness h;
  const int di = h.opt.add_group(gd), ai = h.opt.add_group(ga);
  t3::HostParam& w = h.add(di, "w", DType::F32, {m, n}, rng);
  t3::HostParam& b = h.add(ai, "b", DType::F32, {m}, rng);
  ref::Mat W = w.w.values(), M(m * n, 0.0);
  ref::Vec v(m, 0.0), B = b.w.values(), bm(m, 0.0), bv(m, 0.0);
  int64_t t = 0;
  for (int step = 0; step < 3; ++step) {
    h.randomize_grads(rng);
    ref::dion3_step(W, M, v, w.g.values(), m, n, t3::matrix_hyper(gd, DType::F32));
    ref::adamw_step(B, bm, bv, b.g.values(), t, t3::elem_hyper(ga, DType::F32));
    ASSERT_TRUE(h.opt.step());
  }
  EXPECT_LE(t3::rel_max_diff(w.w.values(), W), 1e-5);
  EXPECT_LE(t3::rel_max_diff(b.w.values(), B), 1e-5);
}

TEST(Lion, ZeroGradientAndMomentumGiveOnlyWeightDecay) {
  // sign(0) = 0: with m = 0 and g = 0 the update vanishes and only the decay remains.
  Rng rng(8);
  GroupConfig g;
  g.algorithm = Algorithm::Lion;
  g.lr = 0.01;
  g.weight_decay = 0.1;
  Harness h;
  t3::HostParam& p = h.add(h.opt.add_group(g), "b", DType::F32, {32}, rng);
  const auto W0 = p.w.values();
  ASSERT_TRUE(h.opt.step());  // gradients are zero
  const auto W1 = p.w.values();
  for (size_t i = 0; i < W0.size(); ++i) EXPECT_FLOAT_EQ(W1[i], W0[i] * (1 - 0.01 * 0.1));
}

TEST(NorMuon, ScaleLrByFractionOnlyAffectsDion3Groups) {
  // The opt-in scaling is Dion3's (lr / sqrt(f)); a NorMuon group ignores it.
  GroupConfig ga, gb;
  ga.algorithm = gb.algorithm = Algorithm::NorMuon;
  ga.scale_lr_by_fraction = true;
  ga.fraction = 0.25;
  const auto t = t3::twin_run(ga, gb, 16, 32, 9, 1);
  EXPECT_EQ(t->pa->w.bytes, t->pb->w.bytes);
}

}  // namespace
