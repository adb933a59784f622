// tests/cpp/test_dion3.cpp — the Dion3 step through dion3::Optimizer on the CPU backend
// (algorithm.md §1): several steps against the float64 reference over shapes, fractions, adjust_lr
// modes, weight decay and parameter dtypes; the properties of the rule (top-k with ties to the
// lower index, k = ceil(f*m) >= 1, error feedback on selected rows only, unselected rows move
// only by weight decay, f = 1 is NorMuon, opt-in lr scaling); megabatches; 3-D parameters
// with and without flatten; determinism.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>

#include <cmath>
#include <cstdio>
#include <algorithm>
#include <optional>
#include <tuple>

#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using dion3::AdjustLR;
using dion3::DType;
using dion3::GroupConfig;
using dion3::OrthMethod;
using t3::Harness;
using t3::Rng;

using t3::weight_tol;

double state_rel_tol(DType dt) { return dt == DType::F32 ? 1e-5 : dt == DType::F16 ? 2e-3 : 1.6e-2; }

struct Dion3Case {
  std::string name;
  int m, n;
  double fraction;
  AdjustLR adjust = AdjustLR::SpectralNorm;
  double wd = 0.01;
  DType dtype = DType::F32;
  std::optional<DType> momentum_dtype = std::nullopt;
  bool scale_lr = false;
  OrthMethod orth = OrthMethod::Auto;
  bool you = false;
  std::vector<int> restarts = {2};
};
void PrintTo(const Dion3Case& c, std::ostream* os) { *os << c.name; }

class Dion3VsReference : public ::testing::TestWithParam<Dion3Case> {};

TEST_P(Dion3VsReference, SeveralSteps) {
  const Dion3Case c = GetParam();
  Rng rng(1000 + c.m * 131 + c.n * 7 + static_cast<int>(c.fraction * 64));
  GroupConfig g;
  g.lr = 0.02;
  g.fraction = c.fraction;
  g.adjust_lr = c.adjust;
  g.weight_decay = c.wd;
  g.momentum_dtype = c.momentum_dtype;
  g.scale_lr_by_fraction = c.scale_lr;
  g.orth.method = c.orth;
  if (c.you) g.orth.coefficients = dion3::you_coefficients();
  g.orth.restarts = c.restarts;
  Harness h;
  const int gi = h.opt.add_group(g);
  t3::HostParam& p = h.add(gi, "layer.weight", c.dtype, {c.m, c.n}, rng);
  const ref::MatrixHyper hyper = t3::matrix_hyper(g, c.dtype);
  const DType mdt = c.momentum_dtype.value_or(c.dtype);

  const std::vector<double> W0 = p.w.values();
  ref::Mat W = W0, M(static_cast<size_t>(c.m) * c.n, 0.0);
  ref::Vec v(c.m, 0.0);
  double worst = 0;  // largest weight error as a fraction of the tolerance, reported below
  for (int step = 0; step < 4; ++step) {
    h.randomize_grads(rng);
    const ref::SelectionReport rep = ref::dion3_step(W, M, v, p.g.values(), c.m, c.n, hyper);
    // A near-tie in the reference makes the comparison ill-posed, not the library wrong.
    ASSERT_GT(rep.gap, 1e-5) << "near tie in the reference's selection at step " << step << "; change the seed";
    ASSERT_TRUE(h.opt.step());
    const double tol = weight_tol(c.dtype, t3::max_abs(W), t3::max_change(W, W0));
    EXPECT_LE(t3::max_abs_diff(p.w.values(), W), tol) << "weights after step " << step + 1;
    worst = std::max(worst, t3::max_abs_diff(p.w.values(), W) / tol);
    EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "momentum"), M), state_rel_tol(mdt))
        << "momentum after step " << step + 1;
    EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "variance"), v), c.dtype == DType::F32 ? 1e-3 : 5e-2)
        << "variance after step " << step + 1;
  }
  EXPECT_EQ(h.opt.steps_taken(), 4);
  std::printf("[ dion3 %s ] weight error / tolerance: %.3f\n", c.name.c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Dion3VsReference,
    ::testing::Values(
        Dion3Case{.name = "wide_f1_4", .m = 32, .n = 64, .fraction = 0.25},
        Dion3Case{.name = "tall_f1_2_rms", .m = 64, .n = 32, .fraction = 0.5, .adjust = AdjustLR::RmsNorm},
        Dion3Case{.name = "square_f1_8_none_nowd", .m = 48, .n = 48, .fraction = 0.125, .adjust = AdjustLR::None, .wd = 0.0},
        Dion3Case{.name = "wide_f1", .m = 24, .n = 80, .fraction = 1.0},
        Dion3Case{.name = "tall_f1_4_wd_scaled", .m = 80, .n = 24, .fraction = 0.25, .wd = 0.1, .scale_lr = true},
        Dion3Case{.name = "odd_k", .m = 9, .n = 40, .fraction = 0.125},
        Dion3Case{.name = "tall_f1_8_gram", .m = 96, .n = 16, .fraction = 0.125, .orth = OrthMethod::Gram},
        Dion3Case{.name = "wide_half_standard_you", .m = 16, .n = 96, .fraction = 0.5, .orth = OrthMethod::Standard, .you = true},
        Dion3Case{.name = "wide_half_gram_norestart", .m = 16, .n = 96, .fraction = 0.5, .orth = OrthMethod::Gram, .restarts = {}},
        Dion3Case{.name = "bf16_wide_f1_4", .m = 32, .n = 64, .fraction = 0.25, .dtype = DType::BF16},
        Dion3Case{.name = "bf16_tall_f1_2", .m = 64, .n = 32, .fraction = 0.5, .dtype = DType::BF16},
        Dion3Case{.name = "f16_tall_f1_2", .m = 64, .n = 32, .fraction = 0.5, .dtype = DType::F16},
        Dion3Case{.name = "bf16_fp32_momentum", .m = 32, .n = 48, .fraction = 0.25, .dtype = DType::BF16,
                  .momentum_dtype = DType::F32}),
    [](const ::testing::TestParamInfo<Dion3Case>& i) { return i.param.name; });

// ---------------------------------------------------------------------------------------------
// Properties of the row selection and the error feedback.

GroupConfig plain(double fraction, double wd = 0.0) {
  GroupConfig g;
  g.fraction = fraction;
  g.weight_decay = wd;
  g.lr = 0.02;
  return g;
}

// Which rows of W changed beyond what weight decay alone would do.
std::vector<int> moved_rows(const std::vector<double>& before, const std::vector<double>& after, int m, int n,
                            double decay) {
  std::vector<int> rows;
  for (int i = 0; i < m; ++i) {
    bool moved = false;
    for (int j = 0; j < n; ++j) {
      const double want = static_cast<float>(before[i * n + j] * decay);
      if (std::fabs(after[i * n + j] - want) > 4e-7 * std::fabs(want) + 1e-30) moved = true;
    }
    if (moved) rows.push_back(i);
  }
  return rows;
}

TEST(Dion3, TiedScoresSelectTheLowerRowIndices) {
  const int m = 8, n = 4;
  Rng rng(1);
  Harness h;
  const int gi = h.opt.add_group(plain(0.5));
  t3::HostParam& p = h.add(gi, "w", DType::F32, {m, n}, rng);
  // Every row has the same l1 score (same magnitudes, different signs and order).
  const double base[4] = {1.0, 0.5, 0.25, 2.0};
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) p.g.set(i * n + j, ((i + j) % 2 ? -1 : 1) * base[(i + j) % 4]);
  const auto W0 = p.w.values();
  ASSERT_TRUE(h.opt.step());
  EXPECT_EQ(moved_rows(W0, p.w.values(), m, n, 1.0), (std::vector<int>{0, 1, 2, 3}));
  const auto M = t3::state_values(h.opt, p.index, "momentum");
  const auto G = p.g.values();
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j)
      EXPECT_FLOAT_EQ(M[i * n + j], (i < 4 ? 0.95 : 1.0) * G[i * n + j]) << "row " << i;
}

TEST(Dion3, TieAtTheBoundaryGoesToTheLowerIndex) {
  const int m = 6, n = 3;
  Rng rng(2);
  Harness h;
  const int gi = h.opt.add_group(plain(1.0 / 3.0));  // k = 2
  t3::HostParam& p = h.add(gi, "w", DType::F32, {m, n}, rng);
  // Scores: row 5 largest (9); rows 1, 3, 4 tie at 3; rows 0, 2 smaller.
  const double G[m][n] = {{1, 0, 0}, {1, 1, -1}, {0.5, 0, 0}, {-1, -1, 1}, {0, 3, 0}, {3, 3, -3}};
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) p.g.set(i * n + j, G[i][j]);
  const auto W0 = p.w.values();
  ASSERT_TRUE(h.opt.step());
  EXPECT_EQ(moved_rows(W0, p.w.values(), m, n, 1.0), (std::vector<int>{1, 5}));
}

TEST(Dion3, SelectedCountIsCeilFractionTimesRowsAtLeastOne) {
  struct K {
    int m;
    double f;
    int k;
  };
  for (K c : {K{10, 0.25, 3}, K{10, 0.01, 1}, K{8, 0.125, 1}, K{64, 0.125, 8}, K{7, 1.0, 7}, K{33, 0.5, 17}}) {
    Rng rng(3);
    Harness h;
    const int gi = h.opt.add_group(plain(c.f));
    t3::HostParam& p = h.add(gi, "w", DType::F32, {c.m, 16}, rng);
    const auto plan = h.opt.plan();
    ASSERT_EQ(plan.size(), 1u);
    EXPECT_EQ(plan[0].selected_rows, c.k) << c.m << " rows, f = " << c.f;
    EXPECT_EQ(plan[0].rows, c.m);
    EXPECT_EQ(plan[0].cols, 16);
    // ...and the step really updates k rows (distinct row scales: no ties).
    for (int i = 0; i < c.m; ++i)
      for (int j = 0; j < 16; ++j) p.g.set(i * 16 + j, (1.0 + i) * rng.normal());
    const auto W0 = p.w.values();
    ASSERT_TRUE(h.opt.step());
    EXPECT_EQ(static_cast<int>(moved_rows(W0, p.w.values(), c.m, 16, 1.0).size()), c.k);
  }
}

TEST(Dion3, PlanReportsTheNextStepsSettings) {
  // plan() after a step and a changed group: the plan the next step runs, not the last one.
  Rng rng(4);
  Harness h;
  const int gi = h.opt.add_group(plain(0.25));
  h.add(gi, "w", DType::F32, {64, 16}, rng);
  ASSERT_TRUE(h.opt.step());
  ASSERT_EQ(h.opt.plan().at(0).selected_rows, 16);
  dion3::GroupConfig g = h.opt.group(gi);
  g.fraction = 0.5;
  g.orth.iteration_dtype = DType::BF16;
  h.opt.set_group(gi, g);
  const auto before = h.opt.plan();
  ASSERT_TRUE(h.opt.step());
  const auto after = h.opt.plan();
  EXPECT_EQ(before.at(0).selected_rows, 32);
  EXPECT_EQ(before.at(0).iteration_dtype, DType::BF16);
  EXPECT_EQ(before.at(0).selected_rows, after.at(0).selected_rows);
  EXPECT_EQ(before.at(0).method, after.at(0).method);
  EXPECT_EQ(before.at(0).iteration_dtype, after.at(0).iteration_dtype);
}

TEST(Dion3, ErrorFeedbackScalesOnlyTheSelectedRows) {
  const int m = 12, n = 8;
  Rng rng(4);
  Harness h;
  GroupConfig g = plain(0.25);  // k = 3
  g.mu = 0.5;                   // exact in binary: momentum values stay exactly representable
  const int gi = h.opt.add_group(g);
  t3::HostParam& p = h.add(gi, "w", DType::F32, {m, n}, rng);
  ref::Mat M(m * n, 0.0);
  for (int step = 0; step < 3; ++step) {
    // Integer-valued gradients: sums and halvings are exact in fp32, so the state is exact.
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) p.g.set(i * n + j, std::round(4 * rng.normal()) + (i == step ? 64 : 0));
    for (int i = 0; i < m * n; ++i) M[i] += p.g.get(i);
    const auto sel = ref::select_rows(M, m, n, 3);
    ASSERT_GT(sel.gap, 0.0);
    for (int r : sel.selected)
      for (int j = 0; j < n; ++j) M[r * n + j] *= 0.5;
    ASSERT_TRUE(h.opt.step());
    EXPECT_EQ(t3::state_values(h.opt, p.index, "momentum"), M) << "step " << step + 1;
  }
}

TEST(Dion3, UnselectedRowsMoveOnlyByWeightDecay) {
  const int m = 16, n = 24;
  for (double wd : {0.0, 0.1}) {
    Rng rng(5);
    Harness h;
    const int gi = h.opt.add_group(plain(0.25, wd));
    t3::HostParam& p = h.add(gi, "w", DType::F32, {m, n}, rng);
    for (int step = 0; step < 3; ++step) {
      h.randomize_grads(rng);
      const auto W0 = p.w.values();
      ASSERT_TRUE(h.opt.step());
      const auto W1 = p.w.values();
      const auto moved = moved_rows(W0, W1, m, n, 1.0 - 0.02 * wd);
      EXPECT_EQ(moved.size(), 4u) << "wd " << wd << " step " << step;
      if (wd == 0.0) {  // untouched rows are bit-for-bit unchanged
        for (int i = 0; i < m; ++i) {
          if (std::find(moved.begin(), moved.end(), i) != moved.end()) continue;
          for (int j = 0; j < n; ++j) EXPECT_EQ(W1[i * n + j], W0[i * n + j]);
        }
      }
    }
  }
}

TEST(Dion3, FullFractionEqualsNorMuon) {
  GroupConfig ga = plain(1.0, 0.01), gb = plain(1.0, 0.01);
  gb.algorithm = dion3::Algorithm::NorMuon;
  const auto t = t3::twin_run(ga, gb, 24, 40, 6, 4);
  ASSERT_TRUE(t->all_applied);
  const Harness &a = t->a, &b = t->b;
  const t3::HostParam &pa = *t->pa, &pb = *t->pb;
  const auto Wa = pa.w.values(), Wb = pb.w.values();
  EXPECT_LE(t3::max_abs_diff(Wa, Wb), 1e-5 * t3::max_change(Wb, t->w0) + 1e-7);
  // Dion3 stores mu*(M + G) where NorMuon stores mu*M + G: the same sequence scaled by mu.
  const auto Ma = t3::state_values(a.opt, pa.index, "momentum"), Mb = t3::state_values(b.opt, pb.index, "momentum");
  std::vector<double> Mb_mu(Mb);
  for (double& x : Mb_mu) x *= 0.95;
  EXPECT_LE(t3::rel_max_diff(Ma, Mb_mu), 1e-5);
  EXPECT_LE(t3::rel_max_diff(t3::state_values(a.opt, pa.index, "variance"),
                             t3::state_values(b.opt, pb.index, "variance")), 1e-4);
}

TEST(Dion3, ScaleLrByFractionEqualsAScaledLr) {
  // lr / sqrt(1/4) = 2 lr exactly in binary, so both runs must agree bit for bit, including
  // the weight decay, which uses the base lr (algorithm.md §1 step 7).
  GroupConfig ga = plain(0.25, 0.1), gb = plain(0.25, 0.1);
  ga.lr = 0.01;
  ga.scale_lr_by_fraction = true;
  gb.lr = 0.02;
  const auto t = t3::twin_run(ga, gb, 16, 32, 7, 3);
  EXPECT_EQ(t->pa->w.bytes, t->pb->w.bytes);
}

TEST(Dion3, ScaleLrByFractionIsOffByDefault) {
  GroupConfig ga = plain(0.25, 0.1), gb = plain(0.25, 0.1);
  gb.scale_lr_by_fraction = false;
  const auto t = t3::twin_run(ga, gb, 16, 32, 8, 1);
  EXPECT_EQ(t->pa->w.bytes, t->pb->w.bytes);
}

TEST(Dion3, LearningRateEditsTakeEffectAtTheNextStep) {
  const int m = 16, n = 32;
  Rng rng(9);
  Harness h;
  GroupConfig g = plain(0.5, 0.05);
  const int gi = h.opt.add_group(g);
  t3::HostParam& p = h.add(gi, "w", DType::F32, {m, n}, rng);
  ref::Mat W = p.w.values(), M(m * n, 0.0);
  ref::Vec v(m, 0.0);
  for (int step = 0; step < 3; ++step) {
    const double lr = 0.02 * (3 - step);  // a decaying schedule
    h.opt.group(gi).lr = lr;
    g.lr = lr;
    h.randomize_grads(rng);
    ref::dion3_step(W, M, v, p.g.values(), m, n, t3::matrix_hyper(g, DType::F32));
    ASSERT_TRUE(h.opt.step());
  }
  EXPECT_LT(t3::rel_max_diff(p.w.values(), W), 1e-5);
}

// ---------------------------------------------------------------------------------------------
// Megabatches and multi-dimensional parameters.

TEST(Dion3, MegabatchEqualsSeparateOptimizers) {
  const int N = 3, m = 24, n = 40;
  Rng rng(10);
  Harness batched;
  const int gi = batched.opt.add_group(plain(0.25, 0.01));
  std::vector<std::unique_ptr<Harness>> singles;
  for (int i = 0; i < N; ++i) {
    std::string name = "w";  // (built with += : GCC 12 gives a false -Wrestrict on "w" + to_string)
    name += std::to_string(i);
    batched.add(gi, name, DType::F32, {m, n}, rng);
    singles.push_back(std::make_unique<Harness>());
    Harness& s = *singles.back();
    const int sg = s.opt.add_group(plain(0.25, 0.01));
    Rng dummy(0);
    t3::HostParam& sp = s.add(sg, "w", DType::F32, {m, n}, dummy);
    sp.w.bytes = batched.params[i]->w.bytes;
  }
  const auto plan = batched.opt.plan();
  ASSERT_EQ(plan.size(), 1u);  // one megabatch of N same-shape matrices
  EXPECT_EQ(plan[0].count, N);
  for (int step = 0; step < 3; ++step) {
    batched.randomize_grads(rng);
    for (int i = 0; i < N; ++i) singles[i]->params[0]->g.bytes = batched.params[i]->g.bytes;
    ASSERT_TRUE(batched.opt.step());
    for (auto& s : singles) ASSERT_TRUE(s->opt.step());
  }
  for (int i = 0; i < N; ++i) {
    const auto& bp = *batched.params[i];
    const auto& sp = *singles[i]->params[0];
    // Same math per matrix; allow for a batched GEMM summing in a different order.
    EXPECT_LE(t3::rel_max_diff(bp.w.values(), sp.w.values()), 1e-6) << "matrix " << i;
    EXPECT_LE(t3::rel_max_diff(t3::state_values(batched.opt, bp.index, "momentum"),
                               t3::state_values(singles[i]->opt, sp.index, "momentum")), 1e-6);
  }
}

// Row blocks (split_sizes, num_heads) step exactly like the same rows given as separate
// parameters: the same megabatches, the same arithmetic.
TEST(Dion3, RowBlocksStepLikeSeparateParameters) {
  const int64_t n = 32;
  const std::vector<int64_t> split = {24, 8, 8};
  for (bool heads : {false, true}) {
    const std::vector<int64_t> heights = heads ? std::vector<int64_t>(5, 8) : split;
    Harness fused, parts;
    dion3::GroupConfig g = plain(0.25, 0.01);
    if (heads) g.num_heads = 5;
    else g.split_sizes = split;
    const int fg = fused.opt.add_group(g);
    const int pg = parts.opt.add_group(plain(0.25, 0.01));
    Rng rng(12);
    t3::HostParam& f = fused.add(fg, "qkv", DType::F32, {40, n}, rng);
    int64_t row = 0;
    for (int64_t h : heights) {
      std::string name = "block";
      name += std::to_string(row);
      Rng dummy(0);
      t3::HostParam& p = parts.add(pg, name, DType::F32, {h, n}, dummy);
      std::memcpy(p.w.bytes.data(), f.w.bytes.data() + row * n * 4, static_cast<std::size_t>(h * n * 4));
      row += h;
    }
    EXPECT_EQ(fused.opt.plan().size(), parts.opt.plan().size());
    for (int step = 0; step < 3; ++step) {
      fused.randomize_grads(rng);
      row = 0;
      for (auto& p : parts.params) {
        std::memcpy(p->g.bytes.data(), f.g.bytes.data() + row * n * 4, p->g.bytes.size());
        row += p->g.shape[0];
      }
      ASSERT_TRUE(fused.opt.step());
      ASSERT_TRUE(parts.opt.step());
    }
    std::vector<unsigned char> joined;
    for (auto& p : parts.params) joined.insert(joined.end(), p->w.bytes.begin(), p->w.bytes.end());
    EXPECT_EQ(f.w.bytes, joined) << (heads ? "num_heads" : "split_sizes");
  }
}

TEST(Dion3, RowBlocksThatDoNotFitAreRefusedNamingTheParameter) {
  Harness h;
  dion3::GroupConfig g = plain(0.25, 0.01);
  g.split_sizes = {24, 8};
  const int gi = h.opt.add_group(g);
  Rng rng(1);
  try {
    h.add(gi, "qkv", DType::F32, {40, 32}, rng);
    FAIL() << "accepted";
  } catch (const dion3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'qkv'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sum to 32 rows but the matrix has 40"), std::string::npos) << e.what();
  }
  // Heights whose sum wraps past int64 back to the row count are refused too (they would make a
  // block of 2^62 rows).
  dion3::GroupConfig wrap = plain(0.25, 0.01);
  const int64_t big = int64_t{1} << 62;
  wrap.split_sizes = {big, big, big, big + 40};
  const int wi = h.opt.add_group(wrap);
  try {
    h.add(wi, "wrapped", DType::F32, {40, 32}, rng);
    FAIL() << "accepted";
  } catch (const dion3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sum to more rows than the matrix's 40"), std::string::npos) << e.what();
  }
  // The C API carries the blocks both ways.
  dion3_group_config c;
  dion3_group_config_default(&c);
  EXPECT_EQ(c.num_heads, 0);
  EXPECT_EQ(c.num_split_sizes, 0);
  c.num_split_sizes = 3;
  c.split_sizes[0] = 24;
  c.split_sizes[1] = c.split_sizes[2] = 8;
  dion3_optimizer* opt = nullptr;
  ASSERT_EQ(dion3_create(&opt, DION3_DEVICE_CPU, 0, nullptr, DION3_NONFINITE_RAISE), DION3_OK);
  int group = -1;
  ASSERT_EQ(dion3_add_group(opt, &c, &group), DION3_OK) << dion3_last_error();
  dion3_group_config back;
  ASSERT_EQ(dion3_get_group_config(opt, group, &back), DION3_OK) << dion3_last_error();
  EXPECT_EQ(back.num_split_sizes, 3);
  EXPECT_EQ(back.split_sizes[0], 24);
  c.num_heads = 5;  // both: refused
  EXPECT_NE(dion3_add_group(opt, &c, &group), DION3_OK);
  EXPECT_NE(std::string(dion3_last_error()).find("give one of them"), std::string::npos) << dion3_last_error();
  dion3_destroy(opt);
}

// A workspace limit below one megabatch's need splits it into chunks that share one arena;
// each matrix's math is unchanged, so the bytes equal the unchunked run's.
TEST(Dion3, WorkspaceLimitChunksAMegabatchWithoutChangingResults) {
  const int N = 5, m = 24, n = 40;
  for (auto alg : {dion3::Algorithm::Dion3, dion3::Algorithm::Muon}) {
    dion3::OptimizerOptions tight;
    tight.workspace_limit = 1;  // forces one matrix per chunk
    Harness whole, chunked(tight);
    dion3::GroupConfig cfg = plain(0.5, 0.01);
    cfg.algorithm = alg;
    const int gw = whole.opt.add_group(cfg), gc = chunked.opt.add_group(cfg);
    Rng rng(21), same(21);
    for (int i = 0; i < N; ++i) {
      std::string name = "w";
      name += std::to_string(i);
      whole.add(gw, name, DType::F32, {m, n}, rng);
      chunked.add(gc, name, DType::F32, {m, n}, same);
    }
    ASSERT_EQ(whole.opt.plan().at(0).chunk, N);
    ASSERT_EQ(chunked.opt.plan().at(0).chunk, 1);
    EXPECT_LT(chunked.opt.plan().at(0).workspace_bytes, whole.opt.plan().at(0).workspace_bytes);
    for (int step = 0; step < 3; ++step) {
      whole.randomize_grads(rng);
      chunked.randomize_grads(same);
      ASSERT_TRUE(whole.opt.step());
      ASSERT_TRUE(chunked.opt.step());
    }
    EXPECT_EQ(t3::snapshot(whole.opt, whole.all()), t3::snapshot(chunked.opt, chunked.all()))
        << dion3::algorithm_name(alg);
  }
}

TEST(Dion3, PlanGroupsByShapeAndDtype) {
  Rng rng(11);
  Harness h;
  const int gi = h.opt.add_group(plain(0.25));
  h.add(gi, "a", DType::F32, {16, 32}, rng);
  h.add(gi, "b", DType::F32, {32, 16}, rng);
  h.add(gi, "c", DType::F32, {16, 32}, rng);
  h.add(gi, "d", DType::BF16, {16, 32}, rng);
  const auto plan = h.opt.plan();
  ASSERT_EQ(plan.size(), 3u);
  int64_t total = 0;
  for (const auto& mb : plan) {
    total += mb.count;
    EXPECT_EQ(mb.algorithm, dion3::Algorithm::Dion3);
    EXPECT_EQ(mb.group, gi);
    if (mb.rows == 16 && mb.dtype == DType::F32) {
      EXPECT_EQ(mb.count, 2);
    }
    EXPECT_EQ(mb.selected_rows, (mb.rows + 3) / 4);
  }
  EXPECT_EQ(total, 4);
}

TEST(Dion3, ThreeDimensionalParameterIsABatchOfMatrices) {
  const int B = 3, m = 16, n = 24;
  Rng rng(12);
  Harness h;
  GroupConfig g = plain(0.25, 0.01);
  const int gi = h.opt.add_group(g);
  t3::HostParam& p = h.add(gi, "experts", DType::F32, {B, m, n}, rng);
  const auto hyper = t3::matrix_hyper(g, DType::F32);
  std::vector<ref::Mat> W(B), M(B, ref::Mat(m * n, 0.0));
  std::vector<ref::Vec> v(B, ref::Vec(m, 0.0));
  for (int b = 0; b < B; ++b) W[b] = t3::slice(p.w.values(), b * m * n, m * n);
  for (int step = 0; step < 3; ++step) {
    h.randomize_grads(rng);
    for (int b = 0; b < B; ++b)  // each matrix has its own selection, variance and lr' (m, n)
      ASSERT_GT(ref::dion3_step(W[b], M[b], v[b], t3::slice(p.g.values(), b * m * n, m * n), m, n, hyper).gap, 1e-5);
    ASSERT_TRUE(h.opt.step());
  }
  const auto w = p.w.values();
  const auto var = t3::state_values(h.opt, p.index, "variance");
  ASSERT_EQ(var.size(), static_cast<size_t>(B * m));  // one entry per matrix row
  for (int b = 0; b < B; ++b) {
    EXPECT_LE(t3::rel_max_diff(t3::slice(w, b * m * n, m * n), W[b]), 1e-5) << "matrix " << b;
    EXPECT_LE(t3::rel_max_diff(t3::slice(var, b * m, m), v[b]), 1e-3) << "matrix " << b;
  }
}

TEST(Dion3, ThreeDimensionalParameterFlattened) {
  const int d0 = 8, d1 = 4, d2 = 6;  // treated as 8 x 24
  Rng rng(13);
  Harness h;
  GroupConfig g = plain(0.25, 0.01);
  g.flatten = true;
  const int gi = h.opt.add_group(g);
  t3::HostParam& p = h.add(gi, "conv", DType::F32, {d0, d1, d2}, rng);
  const auto plan = h.opt.plan();
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].rows, d0);
  EXPECT_EQ(plan[0].cols, d1 * d2);
  EXPECT_EQ(plan[0].count, 1);
  ref::Mat W = p.w.values(), M(d0 * d1 * d2, 0.0);
  ref::Vec v(d0, 0.0);
  for (int step = 0; step < 3; ++step) {
    h.randomize_grads(rng);
    ASSERT_GT(ref::dion3_step(W, M, v, p.g.values(), d0, d1 * d2, t3::matrix_hyper(g, DType::F32)).gap, 1e-5);
    ASSERT_TRUE(h.opt.step());
  }
  EXPECT_LE(t3::rel_max_diff(p.w.values(), W), 1e-5);
  EXPECT_EQ(t3::state_values(h.opt, p.index, "variance").size(), static_cast<size_t>(d0));
}

TEST(Dion3, FourDimensionalParameterWithoutFlattenBatchesTheLeadingDims) {
  Rng rng(14);
  Harness h;
  const int gi = h.opt.add_group(plain(0.5));
  h.add(gi, "w4", DType::F32, {2, 3, 8, 12}, rng);
  const auto plan = h.opt.plan();
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].rows, 8);
  EXPECT_EQ(plan[0].cols, 12);
  EXPECT_EQ(plan[0].count, 6);
}

// A stack without matrices (a rank's share of experts cut between ranks, when it holds none)
// steps nothing and plans nothing; an empty matrix is still refused.
TEST(Dion3, AnEmptyStackStepsNothing) {
  Rng rng(15);
  Harness h;
  GroupConfig g = plain(0.5);
  g.flatten = false;
  const int gi = h.opt.add_group(g);
  h.add(gi, "none", DType::F32, {0, 8, 12}, rng);
  t3::HostParam& w = h.add(gi, "w", DType::F32, {8, 12}, rng);
  h.randomize_grads(rng);
  const std::vector<double> before = w.w.values();
  ASSERT_TRUE(h.opt.step());
  EXPECT_NE(w.w.values(), before);
  const auto plan = h.opt.plan();
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].count, 1);
  EXPECT_EQ(t3::state_values(h.opt, 0, "momentum").size(), 0u);
  Harness e;
  const std::string what = t3::error_of([&] { e.add(e.opt.add_group(g), "empty", DType::F32, {2, 0, 12}, rng); });
  EXPECT_NE(what.find("with an empty dimension; a matrix needs rows and columns"), std::string::npos) << what;
}

TEST(Dion3, IdenticalRunsGiveIdenticalBytes) {
  auto run = [] {
    Rng rng(15);
    Harness h;
    GroupConfig adam;
    adam.algorithm = dion3::Algorithm::AdamW;
    const int gd = h.opt.add_group(plain(0.25, 0.01));
    const int ga = h.opt.add_group(adam);
    h.add(gd, "a", DType::F32, {24, 40}, rng);
    h.add(gd, "b", DType::BF16, {40, 24}, rng);
    h.add(gd, "c", DType::F32, {24, 40}, rng);
    h.add(ga, "bias", DType::F32, {40}, rng);
    for (int s = 0; s < 3; ++s) {
      h.randomize_grads(rng);
      h.opt.step();
    }
    return t3::snapshot(h.opt, h.all());
  };
  const auto a = run(), b = run();
  EXPECT_EQ(a, b);
}

// The engine keeps the tables it builds from the parameters' memory between steps: a gradient
// re-bound to other memory, and state imported into an optimizer that has stepped, must be seen
// as if everything were bound afresh.
TEST(Dion3, ReboundGradientsAndImportedStateTakeEffectAtTheNextStep) {
  auto build = [](Harness& h, Rng& rng) {
    GroupConfig adam;
    adam.algorithm = dion3::Algorithm::AdamW;
    const int gd = h.opt.add_group(plain(0.25, 0.01));
    const int ga = h.opt.add_group(adam);
    h.add(gd, "a", DType::F32, {24, 40}, rng);
    h.add(gd, "b", DType::F32, {24, 40}, rng);
    h.add(ga, "bias", DType::F32, {40}, rng);
  };
  Rng ra(17), rb(17), grads(18);
  Harness a, b;
  build(a, ra);
  build(b, rb);
  auto step_both = [&] {
    a.randomize_grads(grads);
    for (std::size_t i = 0; i < a.params.size(); ++i) b.params[i]->g.bytes = a.params[i]->g.bytes;
    ASSERT_TRUE(a.opt.step());
    ASSERT_TRUE(b.opt.step());
  };
  step_both();
  step_both();
  // a's gradients of "a" and "bias" move to new buffers; b keeps its own.
  t3::Buffer moved_a(DType::F32, {24, 40}), moved_bias(DType::F32, {40});
  a.opt.set_grad(0, moved_a.view());
  a.opt.set_grad(2, moved_bias.view());
  for (int s = 0; s < 2; ++s) {
    a.randomize_grads(grads);
    for (std::size_t i = 0; i < a.params.size(); ++i) b.params[i]->g.bytes = a.params[i]->g.bytes;
    moved_a.bytes = a.params[0]->g.bytes;
    moved_bias.bytes = a.params[2]->g.bytes;
    a.params[0]->g.assign(std::vector<double>(24 * 40, 1e3));  // no longer read
    a.params[2]->g.assign(std::vector<double>(40, 1e3));
    ASSERT_TRUE(a.opt.step());
    ASSERT_TRUE(b.opt.step());
  }
  EXPECT_EQ(t3::snapshot(a.opt, a.all()), t3::snapshot(b.opt, b.all()));

  // A checkpoint imported into b, which has stepped since (AdamW included), steps as it does in
  // a fresh optimizer. Its AdamW parameter joined a step late (its own step counter is behind).
  dion3::OptimizerState saved = b.opt.export_state();
  saved.params[2].step -= 1;
  std::vector<std::vector<unsigned char>> weights;
  for (auto& p : b.params) weights.push_back(p->w.bytes);
  step_both();
  step_both();
  Rng rd(17);
  Harness d;
  build(d, rd);
  for (Harness* h : {&b, &d}) {
    for (std::size_t i = 0; i < h->params.size(); ++i) h->params[i]->w.bytes = weights[i];
    h->opt.import_state(saved);
  }
  for (int s = 0; s < 2; ++s) {
    b.randomize_grads(grads);
    for (std::size_t i = 0; i < b.params.size(); ++i) d.params[i]->g.bytes = b.params[i]->g.bytes;
    ASSERT_TRUE(b.opt.step());
    ASSERT_TRUE(d.opt.step());
  }
  EXPECT_EQ(t3::snapshot(b.opt, b.all()), t3::snapshot(d.opt, d.all()));
}

TEST(Dion3, FractionScheduleRePlansBetweenSteps) {
  // fraction may change between steps (re-planned, k follows); state carries over.
  const int m = 24, n = 40;
  Rng rng(16);
  Harness h;
  GroupConfig g = plain(0.25, 0.01);
  const int gi = h.opt.add_group(g);
  t3::HostParam& p = h.add(gi, "w", DType::F32, {m, n}, rng);
  ref::Mat W = p.w.values(), M(m * n, 0.0);
  ref::Vec v(m, 0.0);
  const double fractions[] = {0.25, 0.5, 0.125, 1.0};
  for (double f : fractions) {
    h.opt.group(gi).fraction = f;
    g.fraction = f;
    h.randomize_grads(rng);
    ASSERT_GT(ref::dion3_step(W, M, v, p.g.values(), m, n, t3::matrix_hyper(g, DType::F32)).gap, 1e-5);
    ASSERT_TRUE(h.opt.step());
    EXPECT_EQ(h.opt.plan()[0].selected_rows, ref::selected_count(f, m));
  }
  EXPECT_LT(t3::rel_max_diff(p.w.values(), W), 1e-5);
  EXPECT_LT(t3::rel_max_diff(t3::state_values(h.opt, p.index, "momentum"), M), 1e-5);
}

TEST(Dion3, GradientInAnotherDtypeIsCastToTheMomentumDtype) {
  // algorithm.md §1 step 1: the gradient is cast to the momentum's dtype. bf16 weights and momentum, fp32 gradients; then the
  // same optimizer re-bound to bf16 gradients with set_grad (a re-plan).
  const int m = 32, n = 48;
  Rng rng(17);
  Harness h;
  GroupConfig g = plain(0.25, 0.01);
  const int gi = h.opt.add_group(g);
  t3::HostParam p("w", DType::BF16, {m, n});
  for (int64_t i = 0; i < p.w.numel(); ++i) p.w.set(i, 0.05 * rng.normal());
  t3::Buffer g32(DType::F32, {m, n}), g16(DType::BF16, {m, n});
  dion3::ParamSpec spec = p.spec();
  spec.grad = g32.view();
  p.index = h.opt.add_param(gi, spec);
  const auto hyper = t3::matrix_hyper(g, DType::BF16);
  const auto W0 = p.w.values();
  ref::Mat W = W0, M(m * n, 0.0);
  ref::Vec v(m, 0.0);
  for (int step = 0; step < 4; ++step) {
    t3::Buffer& gb = step < 2 ? g32 : g16;
    if (step == 2) h.opt.set_grad(p.index, g16.view());
    for (int64_t i = 0; i < gb.numel(); ++i) gb.set(i, rng.normal());
    ASSERT_GT(ref::dion3_step(W, M, v, gb.values(), m, n, hyper).gap, 1e-5);
    ASSERT_TRUE(h.opt.step());
  }
  EXPECT_LE(t3::max_abs_diff(p.w.values(), W), weight_tol(DType::BF16, t3::max_abs(W), t3::max_change(W, W0)));
  EXPECT_LE(t3::rel_max_diff(t3::state_values(h.opt, p.index, "momentum"), M), state_rel_tol(DType::BF16));
}

TEST(Dion3, HalfPrecisionIterationDtypeInTheOptimizer) {
  // orth in emulated fp16 (Gram) and bf16 (standard): the weights follow the float64 reference
  // up to the iteration dtype's rounding of O (relative ~1e-2, see GramVsStandard), which
  // enters the update scaled by lr'.
  for (auto [dt, method, tol] : {std::tuple{DType::F16, OrthMethod::Gram, 2e-2}, std::tuple{DType::BF16, OrthMethod::Standard, 5e-2}}) {
    const int m = 32, n = 64;
    Rng rng(18);
    Harness h;
    GroupConfig g = plain(0.5, 0.01);
    g.orth.method = method;
    g.orth.iteration_dtype = dt;
    const int gi = h.opt.add_group(g);
    t3::HostParam& p = h.add(gi, "w", DType::F32, {m, n}, rng);
    const auto plan = h.opt.plan();
    ASSERT_EQ(plan.size(), 1u);
    EXPECT_EQ(plan[0].iteration_dtype, dt);
    EXPECT_EQ(plan[0].method, method);
    const auto W0 = p.w.values();
    ref::Mat W = W0, M(m * n, 0.0);
    ref::Vec v(m, 0.0);
    for (int step = 0; step < 3; ++step) {
      h.randomize_grads(rng);
      ASSERT_GT(ref::dion3_step(W, M, v, p.g.values(), m, n, t3::matrix_hyper(g, DType::F32)).gap, 1e-3);
      ASSERT_TRUE(h.opt.step());
    }
    std::vector<double> dlib(W.size()), dref(W.size());
    const auto Wl = p.w.values();
    for (size_t i = 0; i < W.size(); ++i) {
      dlib[i] = Wl[i] - W0[i];
      dref[i] = W[i] - W0[i];
    }
    EXPECT_LT(t3::rel_fro_diff(dlib, dref), tol) << dion3::dtype_name(dt);
    std::printf("[ dion3 %s iteration ] relative update error %.3g\n", dion3::dtype_name(dt), t3::rel_fro_diff(dlib, dref));
  }
}

}  // namespace
