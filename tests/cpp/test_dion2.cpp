// tests/cpp/test_dion2.cpp — Dion2 (Dion3 without the NorMuon normalisation) through
// dion3::Optimizer on the CPU backend: several steps against the float64 reference, wide
// matrices by rows and tall ones by columns (the shorter dimension, as the reference selects);
// unselected columns move only by weight decay; expert stacks; no variance state; what is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>

#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using dion3::Algorithm;
using dion3::AdjustLR;
using dion3::DType;
using dion3::GroupConfig;
using dion3::OrthMethod;
using t3::Harness;
using t3::Rng;

GroupConfig dion2(double fraction, double wd = 0.01) {
  GroupConfig g;
  g.algorithm = Algorithm::Dion2;
  g.lr = 0.02;
  g.fraction = fraction;
  g.weight_decay = wd;
  return g;
}

struct Dion2Case {
  std::string name;
  int m, n;
  double fraction;
  AdjustLR adjust = AdjustLR::SpectralNorm;
  DType dtype = DType::F32;
  OrthMethod orth = OrthMethod::Auto;
};
void PrintTo(const Dion2Case& c, std::ostream* os) { *os << c.name; }

class Dion2VsReference : public ::testing::TestWithParam<Dion2Case> {};

TEST_P(Dion2VsReference, SeveralSteps) {
  const Dion2Case c = GetParam();
  Rng rng(2000 + c.m * 131 + c.n * 7 + static_cast<int>(c.fraction * 64));
  GroupConfig g = dion2(c.fraction);
  g.adjust_lr = c.adjust;
  g.orth.method = c.orth;
  Harness h;
  t3::HostParam& p = h.add(h.opt.add_group(g), "layer.weight", c.dtype, {c.m, c.n}, rng);
  const ref::MatrixHyper hyper = t3::matrix_hyper(g, c.dtype);
  const std::vector<double> W0 = p.w.values();
  ref::Mat W = W0, M(static_cast<size_t>(c.m) * c.n, 0.0);
  for (int step = 0; step < 4; ++step) {
    h.randomize_grads(rng);
    ASSERT_GT(ref::dion2_step(W, M, p.g.values(), c.m, c.n, hyper).gap, 1e-5) << "near tie; change the seed";
    ASSERT_TRUE(h.opt.step());
    const double tol = t3::weight_tol(c.dtype, t3::max_abs(W), t3::max_change(W, W0));
    EXPECT_LE(t3::max_abs_diff(p.w.values(), W), tol) << "weights after step " << step + 1;
    EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "momentum"), M), c.dtype == DType::F32 ? 1e-5 : 1.6e-2)
        << "momentum after step " << step + 1;
  }
  EXPECT_FALSE(t3::has_state(h.opt, p.index, "variance"));
  const auto plan = h.opt.plan();
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].columns, c.m > c.n);
  EXPECT_EQ(plan[0].selected_rows, ref::selected_count(c.fraction, std::min(c.m, c.n)));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Dion2VsReference,
    ::testing::Values(Dion2Case{.name = "wide_f1_4", .m = 32, .n = 64, .fraction = 0.25},
                      Dion2Case{.name = "tall_f1_4_by_columns", .m = 64, .n = 32, .fraction = 0.25},
                      Dion2Case{.name = "tall_f1_2_rms", .m = 80, .n = 24, .fraction = 0.5, .adjust = AdjustLR::RmsNorm},
                      Dion2Case{.name = "square_f1_8", .m = 48, .n = 48, .fraction = 0.125},
                      Dion2Case{.name = "tall_f1_8_gram", .m = 96, .n = 40, .fraction = 0.125, .orth = OrthMethod::Gram},
                      Dion2Case{.name = "tall_f1", .m = 40, .n = 16, .fraction = 1.0},
                      Dion2Case{.name = "bf16_tall_f1_4", .m = 64, .n = 32, .fraction = 0.25, .dtype = DType::BF16}),
    [](const ::testing::TestParamInfo<Dion2Case>& i) { return i.param.name; });

// A tall matrix's unselected columns change only by weight decay; k = ceil(f*n) columns move.
TEST(Dion2, TallMatrixMovesOnlyItsSelectedColumns) {
  const int m = 48, n = 16;
  Rng rng(21);
  Harness h;
  const double wd = 0.1;
  GroupConfig g = dion2(0.25, wd);
  t3::HostParam& p = h.add(h.opt.add_group(g), "up_proj", DType::F32, {m, n}, rng);
  h.randomize_grads(rng);
  const auto before = p.w.values();
  ASSERT_TRUE(h.opt.step());
  const auto after = p.w.values();
  const double decay = 1.0 - g.lr * wd;
  int moved = 0;
  for (int c = 0; c < n; ++c) {
    bool col_moved = false;
    for (int r = 0; r < m; ++r) {
      const double want = static_cast<float>(before[r * n + c] * decay);
      if (std::fabs(after[r * n + c] - want) > 4e-7 * std::fabs(want) + 1e-30) col_moved = true;
    }
    moved += col_moved;
  }
  EXPECT_EQ(moved, 4);  // ceil(0.25 * 16)
}

// An [E, m, n] stack of tall matrices: each expert selects its own columns.
TEST(Dion2, ExpertStackStepsEachMatrixByItsColumns) {
  const int E = 3, m = 40, n = 16;
  Rng rng(22);
  Harness h;
  GroupConfig g = dion2(0.25);
  t3::HostParam& p = h.add(h.opt.add_group(g), "experts", DType::F32, {E, m, n}, rng);
  const auto hyper = t3::matrix_hyper(g, DType::F32);
  std::vector<ref::Mat> W(E), M(E, ref::Mat(m * n, 0.0));
  for (int e = 0; e < E; ++e) W[e] = t3::slice(p.w.values(), e * m * n, m * n);
  for (int step = 0; step < 3; ++step) {
    h.randomize_grads(rng);
    for (int e = 0; e < E; ++e)
      ASSERT_GT(ref::dion2_step(W[e], M[e], t3::slice(p.g.values(), e * m * n, m * n), m, n, hyper).gap, 1e-5);
    ASSERT_TRUE(h.opt.step());
  }
  for (int e = 0; e < E; ++e)
    EXPECT_LE(t3::rel_max_diff(t3::slice(p.w.values(), e * m * n, m * n), W[e]), 1e-5) << "expert " << e;
}

// Tall and wide Dion2 matrices of one group, with a Dion3 group beside them: each follows its
// own reference step (nothing leaks between the by-columns, by-rows and Dion3 megabatches).
TEST(Dion2, TallWideAndDion3InOneOptimizerEachFollowTheirReference) {
  Rng rng(23);
  Harness h;
  GroupConfig g2 = dion2(0.25), g3 = dion2(0.25);
  g3.algorithm = Algorithm::Dion3;
  const int d2 = h.opt.add_group(g2), d3 = h.opt.add_group(g3);
  t3::HostParam& tall = h.add(d2, "tall", DType::F32, {48, 16}, rng);
  t3::HostParam& wide = h.add(d2, "wide", DType::F32, {16, 48}, rng);
  t3::HostParam& tall3 = h.add(d3, "tall3", DType::F32, {48, 16}, rng);
  const auto h2 = t3::matrix_hyper(g2, DType::F32), h3 = t3::matrix_hyper(g3, DType::F32);
  ref::Mat Wt = tall.w.values(), Ww = wide.w.values(), W3 = tall3.w.values();
  ref::Mat Mt(48 * 16, 0.0), Mw(16 * 48, 0.0), M3(48 * 16, 0.0);
  ref::Vec v3(48, 0.0);
  for (int step = 0; step < 3; ++step) {
    h.randomize_grads(rng);
    ASSERT_GT(ref::dion2_step(Wt, Mt, tall.g.values(), 48, 16, h2).gap, 1e-5);
    ASSERT_GT(ref::dion2_step(Ww, Mw, wide.g.values(), 16, 48, h2).gap, 1e-5);
    ASSERT_GT(ref::dion3_step(W3, M3, v3, tall3.g.values(), 48, 16, h3).gap, 1e-5);
    ASSERT_TRUE(h.opt.step());
  }
  EXPECT_LE(t3::rel_max_diff(tall.w.values(), Wt), 1e-5);
  EXPECT_LE(t3::rel_max_diff(wide.w.values(), Ww), 1e-5);
  EXPECT_LE(t3::rel_max_diff(tall3.w.values(), W3), 1e-5);
  int by_columns = 0;
  for (const auto& mb : h.opt.plan()) by_columns += mb.columns;
  EXPECT_EQ(h.opt.plan().size(), 3u);
  EXPECT_EQ(by_columns, 1);
}

TEST(Dion2, RowBlocksAreRefusedAndTheNameParses) {
  GroupConfig g = dion2(0.25);
  g.split_sizes = {8, 8};
  try {
    g.validate();
    FAIL() << "split_sizes with dion2 was accepted";
  } catch (const dion3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not available for dion2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dion3::parse_algorithm("dion2"), Algorithm::Dion2);
  EXPECT_STREQ(dion3::algorithm_name(Algorithm::Dion2), "dion2");
  EXPECT_TRUE(dion3::selects_rows(Algorithm::Dion2));
  EXPECT_FALSE(dion3::normalizes_rows(Algorithm::Dion2));
}

}  // namespace
