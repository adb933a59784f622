// tests/cpp/test_async.cpp — Optimizer::step_async (the capture-safe step: no host
// synchronisation) and the device-side step counters it relies on: a non-finite gradient drops
// the step on the device under either policy, AdamW's bias-correction step t follows the
// applied-step counter (also for a parameter registered late and across export/import).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_util.hpp"

namespace {

using dion3::Algorithm;
using dion3::DType;
using dion3::GroupConfig;
using t3::Harness;
using t3::Rng;

GroupConfig adamw() {
  GroupConfig g;
  g.algorithm = Algorithm::AdamW;
  g.lr = 0.01;
  g.weight_decay = 0.1;
  return g;
}

TEST(StepAsync, EqualsStepOnFiniteGradients) {
  Rng a(3), b(3);
  Harness sync, async;
  GroupConfig dion;
  dion.fraction = 0.5;
  const int sd = sync.opt.add_group(dion), sa = sync.opt.add_group(adamw());
  const int ad = async.opt.add_group(dion), aa = async.opt.add_group(adamw());
  sync.add(sd, "w", DType::F32, {12, 20}, a);
  sync.add(sa, "b", DType::F32, {20}, a);
  async.add(ad, "w", DType::F32, {12, 20}, b);
  async.add(aa, "b", DType::F32, {20}, b);
  for (int t = 0; t < 4; ++t) {
    sync.randomize_grads(a);
    async.randomize_grads(b);
    ASSERT_TRUE(sync.opt.step());
    async.opt.step_async();
  }
  EXPECT_EQ(t3::snapshot(sync.opt, sync.all()), t3::snapshot(async.opt, async.all()));
  EXPECT_EQ(async.opt.steps_taken(), 4);
  EXPECT_EQ(async.opt.steps_skipped(), 0);
}

TEST(StepAsync, NonFiniteGradientDropsTheStepWithoutRaising) {
  Rng rng(4);
  Harness h;  // policy Raise: step_async still must not throw (it never synchronises)
  const int g = h.opt.add_group(GroupConfig{});
  const int e = h.opt.add_group(adamw());
  h.add(g, "w", DType::F32, {16, 8}, rng);
  h.add(e, "b", DType::F32, {8}, rng);
  h.randomize_grads(rng);
  ASSERT_TRUE(h.opt.step());
  const auto before = t3::snapshot(h.opt, h.all());
  h.randomize_grads(rng);
  h.params[0]->g.set(5, std::numeric_limits<double>::quiet_NaN());
  int64_t posted[2];
  ASSERT_TRUE(h.opt.posted_counters(posted));  // step() posts too
  EXPECT_EQ(posted[0], 1);
  EXPECT_EQ(posted[1], 0);
  EXPECT_NO_THROW(h.opt.step_async());
  EXPECT_EQ(t3::snapshot(h.opt, h.all()), before);
  EXPECT_EQ(h.opt.steps_taken(), 1);
  EXPECT_EQ(h.opt.steps_skipped(), 1);
  ASSERT_TRUE(h.opt.posted_counters(posted));  // the CPU's copy has arrived when the step returns
  EXPECT_EQ(posted[0], 1);
  EXPECT_EQ(posted[1], 1);
}

// AdamW's t counts only applied steps: a dropped step in between does not advance it, so the
// run equals one that never saw the bad gradient.
TEST(StepAsync, DroppedStepDoesNotAdvanceAdamWBiasCorrection) {
  Rng a(5), b(5);
  dion3::OptimizerOptions skip;
  skip.on_nonfinite = dion3::NonFinitePolicy::Skip;
  Harness with_bad(skip), clean;
  with_bad.add(with_bad.opt.add_group(adamw()), "b", DType::F32, {32}, a);
  clean.add(clean.opt.add_group(adamw()), "b", DType::F32, {32}, b);
  for (int t = 0; t < 3; ++t) {
    with_bad.randomize_grads(a);
    clean.randomize_grads(b);
    if (t == 1) {
      const auto good = with_bad.params[0]->g.bytes;
      with_bad.params[0]->g.set(0, std::numeric_limits<double>::infinity());
      EXPECT_FALSE(with_bad.opt.step());
      with_bad.params[0]->g.bytes = good;
    }
    ASSERT_TRUE(with_bad.opt.step());
    ASSERT_TRUE(clean.opt.step());
  }
  EXPECT_EQ(t3::snapshot(with_bad.opt, with_bad.all()), t3::snapshot(clean.opt, clean.all()));
  EXPECT_EQ(with_bad.opt.export_state().params[0].step, 3);
}

// A parameter registered after some steps starts AdamW at t = 1, like a fresh optimizer.
TEST(StepAsync, LateParameterStartsAdamWAtStepOne) {
  Rng a(6), b(6), warm(7);
  Harness late, fresh;
  const int lg = late.opt.add_group(adamw());
  late.add(lg, "early", DType::F32, {4}, warm);
  for (int t = 0; t < 3; ++t) {
    late.randomize_grads(warm);
    ASSERT_TRUE(late.opt.step());
  }
  t3::HostParam& p = late.add(lg, "late", DType::F32, {16}, a);
  t3::HostParam& q = fresh.add(fresh.opt.add_group(adamw()), "late", DType::F32, {16}, b);
  EXPECT_EQ(p.w.bytes, q.w.bytes);
  for (int t = 0; t < 2; ++t) {
    late.randomize_grads(a);
    fresh.randomize_grads(b);
    p.g.bytes = q.g.bytes;
    ASSERT_TRUE(late.opt.step());
    ASSERT_TRUE(fresh.opt.step());
  }
  EXPECT_EQ(p.w.bytes, q.w.bytes);
  EXPECT_EQ(late.opt.export_state().params[1].step, 2);
  EXPECT_EQ(late.opt.export_state().params[0].step, 5);
}

TEST(StepAsync, ImportRejectsAParameterStepBeyondTheOptimizerSteps) {
  Rng rng(8);
  Harness h;
  h.add(h.opt.add_group(adamw()), "b", DType::F32, {8}, rng);
  h.randomize_grads(rng);
  ASSERT_TRUE(h.opt.step());
  dion3::OptimizerState st = h.opt.export_state();
  st.params[0].step = st.steps + 1;
  const auto before = t3::snapshot(h.opt, h.all());
  try {
    h.opt.import_state(st);
    FAIL() << "import_state accepted a step count beyond the optimizer's steps";
  } catch (const dion3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 0 'b' has step count 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(t3::snapshot(h.opt, h.all()), before);
}

}  // namespace
