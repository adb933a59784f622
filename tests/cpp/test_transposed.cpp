// tests/cpp/test_transposed.cpp — groups whose matrices are stored (in, out) (GroupConfig::transposed)
// on the CPU backend: several steps of every matrix algorithm against the float64 reference run on
// the (out, in) matrix; the same steps as a plain group given the transposed copy, with the
// settings that take other paths (cautious decay, Nesterov, 16-bit momentum, a step without a
// gradient); the variance per output feature; what is refused.
#include <gtest/gtest.h>

#include <cmath>
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
using dion3::Layout;
using t3::Harness;
using t3::Rng;

struct TransposedCase {
  std::string name;
  Algorithm algorithm;
  int in, out;  // stored (in, out): the matrix the rule steps is out x in
  double fraction = 0.25;
  AdjustLR adjust = AdjustLR::SpectralNorm;
  DType dtype = DType::F32;
  int count = 1;  // > 1: a stack [count, in, out]
};
void PrintTo(const TransposedCase& c, std::ostream* os) { *os << c.name; }

class TransposedVsReference : public ::testing::TestWithParam<TransposedCase> {};

TEST_P(TransposedVsReference, SeveralSteps) {
  const TransposedCase c = GetParam();
  Rng rng(3100 + c.in * 17 + c.out * 5 + static_cast<int>(c.algorithm));
  GroupConfig g;
  g.algorithm = c.algorithm;
  g.lr = 0.02;
  g.fraction = c.fraction;
  g.adjust_lr = c.adjust;
  g.transposed = true;
  Harness h;
  std::vector<int64_t> shape = {c.in, c.out};
  if (c.count > 1) shape.insert(shape.begin(), c.count);
  t3::HostParam& p = h.add(h.opt.add_group(g), "c_fc.weight", c.dtype, shape, rng);
  const ref::MatrixHyper hyper = t3::matrix_hyper(g, c.dtype);
  const int m = c.out, n = c.in;  // the rule's matrix
  const auto logical = [&](const std::vector<double>& stored, int j) {
    return ref::transpose(t3::slice(stored, static_cast<size_t>(j) * m * n, static_cast<size_t>(m) * n), n, m);
  };
  std::vector<ref::Mat> W, M;
  std::vector<ref::Vec> V;
  for (int j = 0; j < c.count; ++j) {
    W.push_back(logical(p.w.values(), j));
    M.emplace_back(static_cast<size_t>(m) * n, 0.0);
    V.emplace_back(static_cast<size_t>(m), 0.0);
  }
  const std::vector<ref::Mat> W0 = W;
  for (int step = 0; step < 4; ++step) {
    h.randomize_grads(rng);
    for (int j = 0; j < c.count; ++j) {
      const ref::Mat G = logical(p.g.values(), j);
      switch (c.algorithm) {
        case Algorithm::Dion3:
          ASSERT_GT(ref::dion3_step(W[j], M[j], V[j], G, m, n, hyper).gap, 1e-5) << "near tie; change the seed";
          break;
        case Algorithm::Dion2:
          ASSERT_GT(ref::dion2_step(W[j], M[j], G, m, n, hyper).gap, 1e-5) << "near tie; change the seed";
          break;
        case Algorithm::NorMuon: ref::normuon_step(W[j], M[j], V[j], G, m, n, hyper); break;
        default: ref::muon_step(W[j], M[j], G, m, n, hyper); break;
      }
    }
    ASSERT_TRUE(h.opt.step());
    for (int j = 0; j < c.count; ++j) {
      const double tol = t3::weight_tol(c.dtype, t3::max_abs(W[j]), t3::max_change(W[j], W0[j]));
      EXPECT_LE(t3::max_abs_diff(logical(p.w.values(), j), W[j]), tol) << "matrix " << j << " after step " << step + 1;
    }
  }
  if (dion3::normalizes_rows(c.algorithm)) {
    const std::vector<double> v = t3::state_values(h.opt, p.index, "variance");
    ASSERT_EQ(v.size(), static_cast<size_t>(c.count) * m) << "one variance entry per output feature";
    for (int j = 0; j < c.count; ++j)
      EXPECT_LE(t3::rel_max_diff(t3::slice(v, static_cast<size_t>(j) * m, m), V[j]), c.dtype == DType::F32 ? 1e-4 : 5e-2)
          << "variance of matrix " << j;
  }
  const auto plan = h.opt.plan();
  ASSERT_EQ(plan.size(), 1u);
  // Dion2 selects the rule's rows unless its (out, in) matrix is tall: stored columns unless in < out.
  EXPECT_EQ(plan[0].columns, dion3::normalizes_rows(c.algorithm) || (c.algorithm == Algorithm::Dion2 && c.in >= c.out));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TransposedVsReference,
    ::testing::Values(
        TransposedCase{.name = "dion3_gpt2_c_fc", .algorithm = Algorithm::Dion3, .in = 32, .out = 128},
        TransposedCase{.name = "dion3_c_proj_f1_2", .algorithm = Algorithm::Dion3, .in = 96, .out = 24, .fraction = 0.5},
        TransposedCase{.name = "dion3_f1_rms", .algorithm = Algorithm::Dion3, .in = 40, .out = 56, .fraction = 1.0,
                       .adjust = AdjustLR::RmsNorm},
        TransposedCase{.name = "dion3_bf16", .algorithm = Algorithm::Dion3, .in = 48, .out = 64, .dtype = DType::BF16},
        TransposedCase{.name = "dion3_expert_stack", .algorithm = Algorithm::Dion3, .in = 24, .out = 40, .count = 3},
        TransposedCase{.name = "normuon_wide", .algorithm = Algorithm::NorMuon, .in = 64, .out = 24},
        TransposedCase{.name = "normuon_tall_clamped", .algorithm = Algorithm::NorMuon, .in = 24, .out = 72,
                       .adjust = AdjustLR::SpectralNormClamped},
        TransposedCase{.name = "muon_tall", .algorithm = Algorithm::Muon, .in = 24, .out = 64},
        TransposedCase{.name = "muon_stack", .algorithm = Algorithm::Muon, .in = 48, .out = 16, .count = 2},
        TransposedCase{.name = "dion2_logical_tall", .algorithm = Algorithm::Dion2, .in = 24, .out = 64},
        TransposedCase{.name = "dion2_logical_wide", .algorithm = Algorithm::Dion2, .in = 80, .out = 32},
        TransposedCase{.name = "dion2_square", .algorithm = Algorithm::Dion2, .in = 32, .out = 32},
        TransposedCase{.name = "dion3_square", .algorithm = Algorithm::Dion3, .in = 32, .out = 32}),
    [](const ::testing::TestParamInfo<TransposedCase>& i) { return i.param.name; });

// A transposed group on W steps as a plain group on W's transposed copy, on the paths the
// reference runs do not take: cautious decay, Nesterov with the averaged momentum, bf16 momentum,
// a step on which the matrix has no gradient; and split_sizes / num_heads, which in a transposed
// group cut the output features (GPT-2's fused c_attn, stored (in, 3 * d)): as the plain group's
// row blocks of the copy, each with its own selection, variance and learning-rate adjustment.
TEST(Transposed, StepsAsAPlainGroupOnTheTransposedCopy) {
  struct Setting {
    std::string name;
    Algorithm algorithm;
    bool cautious = false, nesterov = false;
    DType momentum = DType::F32;
    double fraction = 0.25;
    std::vector<int64_t> split = {};
    int64_t heads = 0;
    int count = 1;  // > 1: a stack [count, in, out]
  };
  const std::vector<Setting> settings = {
      {"dion3 cautious_wd", Algorithm::Dion3, true},
      {"dion3 bf16 momentum", Algorithm::Dion3, false, false, DType::BF16},
      {"normuon nesterov ema", Algorithm::NorMuon, false, true},
      {"normuon cautious_wd", Algorithm::NorMuon, true},
      {"muon nesterov", Algorithm::Muon, false, true},
      {"dion3 q, k, v", Algorithm::Dion3, false, false, DType::F32, 0.25, {16, 4, 4}},
      {"dion3 heads, a stack, cautious", Algorithm::Dion3, true, false, DType::F32, 0.5, {}, 3, 2},
      {"normuon heads", Algorithm::NorMuon, false, false, DType::F32, 1.0, {}, 4},
  };
  const int in = 40, out = 24;
  for (const Setting& s : settings) {
    GroupConfig g;
    g.algorithm = s.algorithm;
    g.lr = 0.03;
    g.weight_decay = 0.1;
    g.cautious_wd = s.cautious;
    g.nesterov = s.nesterov;
    g.ema_momentum = s.nesterov && s.algorithm != Algorithm::Dion3;
    g.momentum_dtype = s.momentum;
    g.fraction = s.fraction;
    g.split_sizes = s.split;
    g.num_heads = s.heads;
    const bool blocks = s.heads > 1 || !s.split.empty();
    if (blocks) g.adjust_lr = AdjustLR::RmsNorm;  // reads the block's shape
    GroupConfig gt = g;
    gt.transposed = true;
    Harness plain, transposed;
    Rng rng(77), rng_t(77);
    std::vector<int64_t> ps = {out, in}, qs = {in, out};
    if (s.count > 1) ps.insert(ps.begin(), s.count), qs.insert(qs.begin(), s.count);
    // Each matrix of a stack transposed.
    const auto transpose_each = [&](const std::vector<double>& v, int rows, int cols) {
      std::vector<double> t;
      for (int j = 0; j < s.count; ++j) {
        const size_t size = static_cast<size_t>(rows) * cols;
        const auto one = ref::transpose(t3::slice(v, j * size, size), rows, cols);
        t.insert(t.end(), one.begin(), one.end());
      }
      return t;
    };
    t3::HostParam& p = plain.add(plain.opt.add_group(g), "w", DType::F32, ps, rng);
    t3::HostParam& q = transposed.add(transposed.opt.add_group(gt), "w", DType::F32, qs, rng_t);
    q.w.assign(transpose_each(p.w.values(), out, in));
    Rng grads(5);
    for (int step = 0; step < 5; ++step) {
      std::vector<double> G(static_cast<size_t>(s.count) * out * in);
      for (double& x : G) x = grads.normal();
      p.g.assign(G);
      q.g.assign(transpose_each(G, out, in));
      if (step == 2) {  // no gradient: both leave the matrix and its state alone
        plain.opt.clear_grad(p.index);
        transposed.opt.clear_grad(q.index);
      } else if (step == 3) {
        plain.opt.set_grad(p.index, p.g.view());
        transposed.opt.set_grad(q.index, q.g.view());
      }
      ASSERT_TRUE(plain.opt.step()) << s.name;
      ASSERT_TRUE(transposed.opt.step()) << s.name;
      const std::vector<double> want = transpose_each(p.w.values(), out, in);
      EXPECT_LE(t3::max_abs_diff(q.w.values(), want), 1e-6 * t3::max_abs(want)) << s.name << ", step " << step + 1;
    }
    if (dion3::normalizes_rows(s.algorithm)) {
      EXPECT_LE(t3::rel_max_diff(t3::state_values(transposed.opt, q.index, "variance"),
                                 t3::state_values(plain.opt, p.index, "variance")),
                1e-5)
          << s.name;
    }
    if (blocks) {  // every block a member of a column-stepped megabatch
      int64_t members = 0;
      for (const auto& mb : transposed.opt.plan()) {
        EXPECT_TRUE(mb.columns) << s.name;
        members += mb.count;
      }
      EXPECT_EQ(members, (s.heads > 1 ? s.heads : static_cast<int64_t>(s.split.size())) * s.count) << s.name;
    }
  }
}

// What a transposed group refuses, with the reason (and what it takes).
TEST(Transposed, WhatIsRefused) {
  Harness h;
  GroupConfig adamw;  // element-wise algorithms ignore it, as they do flatten
  adamw.algorithm = Algorithm::AdamW;
  adamw.transposed = true;
  EXPECT_NO_THROW(h.opt.add_group(adamw));
  GroupConfig blocks;  // blocks of output features: Muon steps the stored matrix as it is
  blocks.algorithm = Algorithm::Muon;
  blocks.transposed = true;
  blocks.num_heads = 4;
  EXPECT_NE(t3::error_of([&] { h.opt.add_group(blocks); }).find("separate parameters"), std::string::npos);
  GroupConfig heads = blocks;
  heads.algorithm = Algorithm::Dion3;
  t3::HostParam c_attn("c_attn.weight", DType::F32, {8, 18});  // 18 output features: not 4 heads
  const std::string e = t3::error_of([&] { h.opt.add_param(h.opt.add_group(heads), c_attn.spec()); });
  EXPECT_NE(e.find("18 stored columns"), std::string::npos) << e;

  GroupConfig g;
  g.transposed = true;
  GroupConfig flat = g;
  flat.flatten = true;
  const int fi = h.opt.add_group(flat);
  t3::HostParam stack("experts", DType::F32, {2, 8, 16});
  EXPECT_NE(t3::error_of([&] { h.opt.add_param(fi, stack.spec()); }).find("flatten=False"), std::string::npos);

  // Dion3 and NorMuon step such a matrix by its columns: whole, or cut along its stored rows in
  // the standard chunks (column-sharded as the rule sees it); other cuts are refused.
  const auto comm = dion3::make_loopback_communicator();
  for (Algorithm a : {Algorithm::Dion3, Algorithm::NorMuon}) {
    GroupConfig ga = g;
    ga.algorithm = a;
    for (int cut = 0; cut < 3; ++cut) {
      Harness hc;
      const int gai = hc.opt.add_group(ga);
      t3::HostParam w("h.0.mlp.c_fc.weight", DType::F32, {8, 16});
      dion3::ParamSpec spec = w.spec();
      spec.layout.kind = cut == 0 ? Layout::ColShard : Layout::RowShard;
      spec.layout.comm = comm;
      spec.layout.global_rows = 8;
      spec.layout.global_cols = 16;
      if (cut == 1) spec.layout.row_offset = 0;  // a cut of its own (FSDP2 over tensor parallel)
      if (cut == 2) {
        EXPECT_NO_THROW(hc.opt.add_param(gai, spec)) << dion3::algorithm_name(a);
        continue;
      }
      spec.layout.row_chunk = cut == 1 ? 8 : 0;
      const std::string e = t3::error_of([&] { hc.opt.add_param(gai, spec); });
      EXPECT_NE(e.find("'transposed' group"), std::string::npos) << e;
      EXPECT_NE(e.find("ceil(m/P) chunks in rank order"), std::string::npos) << e;
    }
  }
  // Muon is the same rule either way round: a transposed matrix sharded anyhow is stepped (only
  // the learning-rate adjustment reads the orientation).
  GroupConfig muon = g;
  muon.algorithm = Algorithm::Muon;
  Harness hm;
  t3::HostParam w("w", DType::F32, {8, 16});
  dion3::ParamSpec spec = w.spec();
  spec.layout.kind = Layout::ColShard;
  spec.layout.comm = comm;
  spec.layout.global_rows = 8;
  spec.layout.global_cols = 16;
  EXPECT_NO_THROW(hm.opt.add_param(hm.opt.add_group(muon), spec));
}

// The setting is structural (the variance's length, the plan): a group with parameters keeps it.
TEST(Transposed, IsAStructuralSetting) {
  Harness h;
  GroupConfig g;
  const int gi = h.opt.add_group(g);
  Rng rng(3);
  h.add(gi, "w", DType::F32, {8, 16}, rng);
  GroupConfig t = g;
  t.transposed = true;
  EXPECT_NE(t3::error_of([&] { h.opt.set_group(gi, t); }).find("cannot change 'transposed'"), std::string::npos);
  EXPECT_FALSE(h.opt.group(gi).transposed);
}

}  // namespace
