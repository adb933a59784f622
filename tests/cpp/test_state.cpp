// tests/cpp/test_state.cpp — optimizer state: names, dtypes, shapes and zero initialisation
// per algorithm, externally owned state tensors, export/import round trips, a resumed run that
// continues bit for bit, step counters.
#include <cmath>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dion3/optimizer.hpp"
#include "dion3/state_format.hpp"
#include "test_util.hpp"

namespace {

using dion3::Algorithm;
using dion3::DType;
using dion3::GroupConfig;
using t3::Harness;
using t3::Rng;

GroupConfig algo(Algorithm a) {
  GroupConfig g;
  g.algorithm = a;
  return g;
}

TEST(State, NamesDtypesAndShapesPerAlgorithm) {
  Rng rng(1);
  Harness h;
  GroupConfig fp32_mom = algo(Algorithm::Dion3);
  fp32_mom.momentum_dtype = DType::F32;
  const int d = h.opt.add_group(algo(Algorithm::Dion3)), dm = h.opt.add_group(fp32_mom),
            nm = h.opt.add_group(algo(Algorithm::NorMuon)), mu = h.opt.add_group(algo(Algorithm::Muon)),
            ad = h.opt.add_group(algo(Algorithm::AdamW)), li = h.opt.add_group(algo(Algorithm::Lion));
  auto& p1 = h.add(d, "d", DType::BF16, {8, 16}, rng);
  auto& p2 = h.add(dm, "dm", DType::BF16, {3, 8, 16}, rng);
  auto& p3 = h.add(nm, "nm", DType::F32, {16, 8}, rng);
  auto& p4 = h.add(mu, "mu", DType::F16, {8, 8}, rng);
  auto& p5 = h.add(ad, "ad", DType::F32, {7}, rng);
  auto& p6 = h.add(li, "li", DType::BF16, {5}, rng);
  auto names = [&](int i) {
    std::vector<std::string> n;
    for (const auto& [name, v] : h.opt.state_views(i)) n.push_back(name);
    return n;
  };
  using S = std::vector<std::string>;
  EXPECT_EQ(names(p1.index), (S{"momentum", "variance"}));
  EXPECT_EQ(names(p2.index), (S{"momentum", "variance"}));
  EXPECT_EQ(names(p3.index), (S{"momentum", "variance"}));
  EXPECT_EQ(names(p4.index), (S{"momentum"}));
  EXPECT_EQ(names(p5.index), (S{"exp_avg", "exp_avg_sq"}));
  EXPECT_EQ(names(p6.index), (S{"exp_avg"}));
  const auto v1 = h.opt.state_views(p1.index), v2 = h.opt.state_views(p2.index);
  EXPECT_EQ(v1[0].second.dtype, DType::BF16);  // momentum in the parameter's dtype by default
  EXPECT_EQ(v1[0].second.shape, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(v1[1].second.dtype, DType::F32);  // variance always fp32, one entry per row
  EXPECT_EQ(v1[1].second.numel(), 8);
  EXPECT_EQ(v2[0].second.dtype, DType::F32);  // momentum_dtype on request
  EXPECT_EQ(v2[1].second.numel(), 3 * 8);
  for (auto* p : h.all())
    for (const auto& [name, v] : h.opt.state_views(p->index))
      EXPECT_EQ(t3::max_abs(t3::read_view(v)), 0.0) << p->name << "." << name << " starts at zero";
  EXPECT_EQ(h.opt.num_params(), 6);
  EXPECT_EQ(h.opt.num_groups(), 6);
  EXPECT_EQ(h.opt.param_name(p3.index), "nm");
}

TEST(State, ExternallyOwnedMomentumIsUsedInPlace) {
  const int m = 12, n = 20;
  Rng rng(2);
  Harness h;
  const int gi = h.opt.add_group(algo(Algorithm::Dion3));
  t3::HostParam p("w", DType::F32, {m, n});
  for (int64_t i = 0; i < p.w.numel(); ++i) p.w.set(i, 0.05 * rng.normal());
  t3::Buffer mom(DType::F32, {m, n});
  dion3::ParamSpec spec = p.spec();
  spec.state.emplace_back("momentum", mom.view());
  p.index = h.opt.add_param(gi, spec);
  const auto views = h.opt.state_views(p.index);
  ASSERT_EQ(views[0].first, "momentum");
  EXPECT_EQ(views[0].second.data, mom.bytes.data());
  for (int64_t i = 0; i < p.g.numel(); ++i) p.g.set(i, rng.normal());
  ASSERT_TRUE(h.opt.step());
  EXPECT_GT(t3::max_abs(mom.values()), 0.0);
  EXPECT_EQ(mom.values(), t3::state_values(h.opt, p.index, "momentum"));
}

// A second moment written outside a step (state_views, then state_changed) with a value no run
// can produce is refused at the next step, before anything is written, as import_state refuses
// it; a valid write steps. (No kernel's check reads NorMuon's variance.)
TEST(State, SecondMomentsWrittenOutsideAStepAreChecked) {
  for (Algorithm a : {Algorithm::Dion3, Algorithm::NorMuon, Algorithm::AdamW}) {
    for (float bad : {std::nanf(""), -1.0f, 0.5f}) {
      const std::string what = std::string(dion3::algorithm_name(a)) + " " + std::to_string(bad);
      Rng rng(3);
      Harness h;
      const int gi = h.opt.add_group(algo(a));
      const bool matrix = a != Algorithm::AdamW;
      t3::HostParam p("w", DType::F32, matrix ? std::vector<int64_t>{4, 6} : std::vector<int64_t>{24});
      for (int64_t i = 0; i < p.w.numel(); ++i) p.w.set(i, 0.05 * rng.normal());
      p.index = h.opt.add_param(gi, p.spec());
      for (int64_t i = 0; i < p.g.numel(); ++i) p.g.set(i, rng.normal());
      ASSERT_TRUE(h.opt.step()) << what;
      const auto views = h.opt.state_views(p.index);
      ASSERT_EQ(views[1].first, matrix ? "variance" : "exp_avg_sq") << what;
      static_cast<float*>(views[1].second.data)[2] = bad;
      h.opt.state_changed();
      const std::vector<double> w = p.w.values();
      dion3::Status st = dion3::Status::Ok;
      const std::string error = t3::error_of([&] { h.opt.step(); }, &st);
      if (bad == 0.5f) {
        EXPECT_EQ(error, "") << what;
        continue;
      }
      EXPECT_EQ(st, dion3::Status::InvalidArgument) << what;
      EXPECT_THAT(error, ::testing::HasSubstr("written since the last step (state_changed), holds")) << what;
      EXPECT_THAT(error, ::testing::HasSubstr("at element 2")) << what;
      EXPECT_EQ(p.w.values(), w) << what << ": a refused step moved the weights";
    }
  }
}

// Many second moments written at once are read back together (one batch, odd sizes at aligned
// offsets) and a tensor larger than a batch alone, in parameter order: the first bad value in
// that order is the one named, at its own element.
TEST(State, WrittenSecondMomentsAreCheckedInParameterOrder) {
  const int64_t big = (int64_t{16} << 20) / 4 + 5;  // an AdamW variance just over one batch
  Rng rng(5);
  Harness h;
  const int d = h.opt.add_group(algo(Algorithm::Dion3)), ad = h.opt.add_group(algo(Algorithm::AdamW));
  std::vector<std::unique_ptr<t3::HostParam>> ps;
  ps.push_back(std::make_unique<t3::HostParam>("a", DType::F32, std::vector<int64_t>{3, 4}));
  ps.push_back(std::make_unique<t3::HostParam>("b", DType::F32, std::vector<int64_t>{5, 4}));
  ps.push_back(std::make_unique<t3::HostParam>("big", DType::F32, std::vector<int64_t>{big}));
  ps.push_back(std::make_unique<t3::HostParam>("c", DType::F32, std::vector<int64_t>{7, 4}));
  for (auto& p : ps) {
    for (int64_t i = 0; i < p->w.numel(); ++i) p->w.set(i, 0.05 * rng.normal());
    for (int64_t i = 0; i < p->g.numel(); ++i) p->g.set(i, rng.normal());
    p->index = h.opt.add_param(p->w.numel() == big ? ad : d, p->spec());
  }
  ASSERT_TRUE(h.opt.step());
  auto variance = [&](int b) -> float& {
    return static_cast<float*>(h.opt.state_views(ps[b]->index)[1].second.data)[b == 2 ? big - 1 : 2];
  };
  for (const std::vector<int>& bad_in : std::vector<std::vector<int>>{{1, 2}, {3}, {2, 3}}) {
    std::string what = "bad in";
    for (int b : bad_in) what += " " + std::to_string(b);
    std::vector<float> kept;
    for (int b : bad_in) kept.push_back(std::exchange(variance(b), -1.0f));
    h.opt.state_changed();
    const int first = bad_in[0];
    const std::string error = t3::error_of([&] { h.opt.step(); });
    EXPECT_THAT(error, ::testing::HasSubstr("parameter " + std::to_string(first) + " '" + ps[first]->name + "'"))
        << what;
    EXPECT_THAT(error, ::testing::HasSubstr("at element " + std::to_string(first == 2 ? big - 1 : 2))) << what;
    for (std::size_t j = 0; j < bad_in.size(); ++j) variance(bad_in[j]) = kept[j];
  }
  h.opt.state_changed();
  EXPECT_TRUE(h.opt.step());
}

TEST(State, ExternalStateOfTheWrongShapeOrNameIsRejected) {
  Harness h;
  const int gi = h.opt.add_group(algo(Algorithm::Dion3));
  t3::HostParam p("w", DType::F32, {8, 16});
  t3::Buffer bad(DType::F32, {16, 8});
  dion3::ParamSpec spec = p.spec();
  spec.state.emplace_back("momentum", bad.view());
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec); }), ::testing::HasSubstr("'momentum'"));
  spec.state = {{"exp_avg", bad.view()}};
  EXPECT_THAT(t3::error_of([&] { h.opt.add_param(gi, spec); }), ::testing::HasSubstr("'exp_avg'"));
  EXPECT_EQ(h.opt.num_params(), 0);  // nothing half-registered
}

// A model-like set of parameters over every algorithm.
void build(Harness& h, Rng& rng) {
  GroupConfig d = algo(Algorithm::Dion3);
  d.fraction = 0.5;
  const int gd = h.opt.add_group(d), gn = h.opt.add_group(algo(Algorithm::NorMuon)),
            gm = h.opt.add_group(algo(Algorithm::Muon)), ga = h.opt.add_group(algo(Algorithm::AdamW)),
            gl = h.opt.add_group(algo(Algorithm::Lion));
  h.add(gd, "attn.q", DType::F32, {32, 24}, rng);
  h.add(gd, "attn.k", DType::BF16, {32, 24}, rng);
  h.add(gd, "experts", DType::F32, {2, 16, 24}, rng);
  h.add(gn, "mlp.up", DType::F32, {24, 40}, rng);
  h.add(gm, "mlp.down", DType::F32, {40, 24}, rng);
  h.add(ga, "ln.weight", DType::F32, {24}, rng);
  h.add(gl, "head.bias", DType::F32, {40}, rng);
}

// Deterministic per-step gradients so that two harnesses can be fed the same sequence.
void grads_for_step(Harness& h, int step) {
  Rng rng(100 + step);
  h.randomize_grads(rng);
}

TEST(State, ExportImportRoundTrip) {
  Rng rng(3);
  Harness a;
  build(a, rng);
  for (int s = 0; s < 2; ++s) {
    grads_for_step(a, s);
    ASSERT_TRUE(a.opt.step());
  }
  const dion3::OptimizerState st = a.opt.export_state();
  EXPECT_EQ(st.steps, 2);
  EXPECT_EQ(st.skipped, 0);
  ASSERT_EQ(st.params.size(), a.params.size());
  for (size_t i = 0; i < st.params.size(); ++i) {
    EXPECT_EQ(st.params[i].name, a.params[i]->name);
    EXPECT_EQ(st.params[i].step, 2);
    const auto views = a.opt.state_views(a.params[i]->index);
    ASSERT_EQ(st.params[i].tensors.size(), views.size());
    for (size_t j = 0; j < views.size(); ++j) {
      EXPECT_EQ(st.params[i].tensors[j].first, views[j].first);
      EXPECT_EQ(st.params[i].tensors[j].second.dtype, views[j].second.dtype);
      EXPECT_EQ(st.params[i].tensors[j].second.shape, views[j].second.shape);
      EXPECT_EQ(st.params[i].tensors[j].second.data, t3::view_bytes(views[j].second));
    }
  }
  Rng rng2(3);
  Harness b;
  build(b, rng2);
  b.opt.import_state(st);
  EXPECT_EQ(b.opt.steps_taken(), 2);
  const dion3::OptimizerState st2 = b.opt.export_state();
  EXPECT_EQ(st2.steps, st.steps);
  ASSERT_EQ(st2.params.size(), st.params.size());
  for (size_t i = 0; i < st.params.size(); ++i) {
    EXPECT_EQ(st2.params[i].step, st.params[i].step);
    for (size_t j = 0; j < st.params[i].tensors.size(); ++j)
      EXPECT_EQ(st2.params[i].tensors[j].second.data, st.params[i].tensors[j].second.data);
  }
}

TEST(State, ResumedRunContinuesBitForBit) {
  // Run A: 6 steps. Run B: 3 steps, export; run C: fresh optimizer with B's weights, import, 3
  // more steps. A and C must hold identical bytes (weights and state); AdamW's bias correction
  // depends on the imported per-parameter step count.
  Rng ra(4), rb(4), rc(4);
  Harness A, B, C;
  build(A, ra);
  build(B, rb);
  build(C, rc);
  for (int s = 0; s < 6; ++s) {
    grads_for_step(A, s);
    ASSERT_TRUE(A.opt.step());
  }
  for (int s = 0; s < 3; ++s) {
    grads_for_step(B, s);
    ASSERT_TRUE(B.opt.step());
  }
  const dion3::OptimizerState st = B.opt.export_state();
  for (size_t i = 0; i < C.params.size(); ++i) C.params[i]->w.bytes = B.params[i]->w.bytes;
  C.opt.import_state(st);
  for (int s = 3; s < 6; ++s) {
    grads_for_step(C, s);
    ASSERT_TRUE(C.opt.step());
  }
  EXPECT_EQ(t3::snapshot(A.opt, A.all()), t3::snapshot(C.opt, C.all()));
  EXPECT_EQ(C.opt.steps_taken(), 6);
  for (size_t i = 0; i < A.params.size(); ++i) EXPECT_EQ(A.params[i]->w.bytes, C.params[i]->w.bytes) << A.params[i]->name;
}

TEST(State, WithoutImportTheResumedRunDiffers) {
  // The control for the test above: dropping the state changes the result.
  Rng ra(5), rc(5);
  Harness A, C;
  build(A, ra);
  build(C, rc);
  for (int s = 0; s < 4; ++s) {
    grads_for_step(A, s);
    A.opt.step();
  }
  for (size_t i = 0; i < C.params.size(); ++i) C.params[i]->w.bytes = A.params[i]->w.bytes;
  grads_for_step(A, 4);
  grads_for_step(C, 4);
  A.opt.step();
  C.opt.step();
  EXPECT_NE(t3::snapshot(A.opt, A.all()), t3::snapshot(C.opt, C.all()));
}

TEST(State, StepCountersAndSetGrad) {
  Rng rng(6);
  Harness h;
  const int gi = h.opt.add_group(algo(Algorithm::AdamW));
  t3::HostParam& p = h.add(gi, "b", DType::F32, {16}, rng);
  // Re-bind the gradient to another buffer: the next step reads the new one.
  t3::Buffer g2(DType::F32, {16});
  for (int64_t i = 0; i < 16; ++i) g2.set(i, 1.0);
  h.opt.set_grad(p.index, g2.view());
  const auto W0 = p.w.values();
  ASSERT_TRUE(h.opt.step());
  const auto W1 = p.w.values();
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(W1[i], W0[i] * (1 - 0.01 * 0.01) - 0.01, 1e-6);
  EXPECT_EQ(h.opt.steps_taken(), 1);
  EXPECT_EQ(h.opt.steps_skipped(), 0);
  EXPECT_EQ(h.opt.export_state().params[0].step, 1);
}

}  // namespace

// The byte form of dion3/state_format.hpp: a round trip gives the same state, and a flipped
// byte or a truncated buffer is refused with a message before anything is imported.
TEST(StateFormat, RoundTripAndCorruption) {
  t3::Rng rng(31);
  t3::Harness h;
  dion3::GroupConfig mat;
  mat.fraction = 0.5;
  dion3::GroupConfig vec;
  vec.algorithm = dion3::Algorithm::AdamW;
  h.add(h.opt.add_group(mat), "w", dion3::DType::BF16, {12, 20}, rng);
  h.add(h.opt.add_group(vec), "b", dion3::DType::F32, {20}, rng);
  for (int t = 0; t < 2; ++t) {
    h.randomize_grads(rng);
    ASSERT_TRUE(h.opt.step());
  }
  const dion3::OptimizerState st = h.opt.export_state();
  std::vector<unsigned char> buf(dion3::serialize_state(st, nullptr));
  ASSERT_EQ(dion3::serialize_state(st, buf.data()), buf.size());
  const dion3::OptimizerState back = dion3::parse_state(buf.data(), buf.size());
  EXPECT_EQ(back.steps, st.steps);
  ASSERT_EQ(back.params.size(), st.params.size());
  for (std::size_t i = 0; i < st.params.size(); ++i) {
    EXPECT_EQ(back.params[i].name, st.params[i].name);
    EXPECT_EQ(back.params[i].step, st.params[i].step);
    ASSERT_EQ(back.params[i].tensors.size(), st.params[i].tensors.size());
    for (std::size_t j = 0; j < st.params[i].tensors.size(); ++j) {
      EXPECT_EQ(back.params[i].tensors[j].first, st.params[i].tensors[j].first);
      EXPECT_EQ(back.params[i].tensors[j].second.data, st.params[i].tensors[j].second.data);
    }
  }
  std::vector<unsigned char> bad = buf;
  bad[bad.size() / 2] ^= 0x40;
  EXPECT_THROW(
      {
        try {
          dion3::parse_state(bad.data(), bad.size());
        } catch (const dion3::Error& e) {
          EXPECT_NE(std::string(e.what()).find("hash mismatch"), std::string::npos) << e.what();
          throw;
        }
      },
      dion3::Error);
  EXPECT_THROW(dion3::parse_state(buf.data(), buf.size() - 9), dion3::Error);
}

// A buffer whose reserved field is set is refused, even with a valid hash: it was written by a
// format this build does not know. The counters are checked field by field.
TEST(StateFormat, ReservedFieldAndNegativeCountersAreRefused) {
  t3::Rng rng(32);
  t3::Harness h;
  h.add(h.opt.add_group(dion3::GroupConfig{}), "w", dion3::DType::F32, {8, 12}, rng);
  h.randomize_grads(rng);
  ASSERT_TRUE(h.opt.step());
  std::vector<unsigned char> buf(dion3::serialize_state(h.opt.export_state(), nullptr));
  dion3::serialize_state(h.opt.export_state(), buf.data());
  // Re-seals a buffer edited in place (the FNV-1a hash of everything before its last 8 bytes).
  auto reseal = [](std::vector<unsigned char> b) {
    uint64_t x = 14695981039346656037ull;
    for (std::size_t i = 0; i + 8 < b.size(); ++i) x = (x ^ b[i]) * 1099511628211ull;
    for (int i = 0; i < 8; ++i) b[b.size() - 8 + i] = static_cast<unsigned char>(x >> (8 * i));
    return b;
  };
  ASSERT_NO_THROW(dion3::parse_state(reseal(buf).data(), buf.size()));  // reseal itself is right
  auto error = [&](std::vector<unsigned char> b) {
    return t3::error_of([&] { dion3::parse_state(b.data(), b.size()); });
  };
  std::vector<unsigned char> bad = buf;
  bad[14] = 1;  // reserved: bytes 12..15
  EXPECT_THAT(error(reseal(bad)), ::testing::HasSubstr("reserved field (bytes 12..15) is 65536"));
  bad = buf;
  bad[16 + 7] = 0x80;  // steps: bytes 16..23, sign bit
  EXPECT_THAT(error(reseal(bad)), ::testing::HasSubstr("'steps' is negative"));
  bad = buf;
  bad[24 + 7] = 0xff;  // skipped: bytes 24..31
  EXPECT_THAT(error(reseal(bad)), ::testing::HasSubstr("'skipped' is negative"));
}
