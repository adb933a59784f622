// tests/cpp/test_capi.cpp — the C API's optimizer-wide options and its step that does not wait
// (dion3_create_with_options, dion3_step_async, dion3_posted_steps, dion3_plan_generation,
// dion3_refresh_hyperparameters), on the CPU backend.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dion3/dion3.h"

namespace {

struct Weights {
  std::vector<float> w, g;
  dion3_tensor wt{}, gt{};
  Weights(int rows, int cols, float seed) : w(static_cast<std::size_t>(rows) * cols), g(w.size()) {
    for (std::size_t i = 0; i < w.size(); ++i) {
      w[i] = std::sin(seed + 0.37f * static_cast<float>(i));
      g[i] = std::cos(seed * 1.3f + 0.11f * static_cast<float>(i));
    }
    wt = {w.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {rows, cols}};
    gt = {g.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {rows, cols}};
  }
};

// An optimizer with one default Dion3 group and two 16 x 24 matrices.
dion3_optimizer* make(const dion3_options* o, std::vector<Weights>& ws) {
  dion3_optimizer* opt = nullptr;
  EXPECT_EQ(dion3_create_with_options(&opt, DION3_DEVICE_CPU, 0, nullptr, o), DION3_OK) << dion3_last_error();
  dion3_group_config cfg;
  dion3_group_config_default(&cfg);
  int g = -1;
  EXPECT_EQ(dion3_add_group(opt, &cfg, &g), DION3_OK);
  ws.clear();
  ws.reserve(2);
  for (int i = 0; i < 2; ++i) {
    ws.emplace_back(16, 24, static_cast<float>(i + 1));
    const std::string name = "w" + std::to_string(i);
    EXPECT_EQ(dion3_add_param(opt, g, name.c_str(), &ws.back().wt, &ws.back().gt, nullptr), DION3_OK)
        << dion3_last_error();
  }
  return opt;
}

TEST(CApi, StatusNamesSayWhatTheStatusCovers) {
  // DION3_NON_FINITE also reports a finite gradient that would overflow the state.
  EXPECT_STREQ(dion3_status_name(DION3_NON_FINITE), "non-finite gradient or state");
  EXPECT_STREQ(dion3_status_name(DION3_OK), "ok");
  EXPECT_STREQ(dion3_status_name(99), "unknown status");
}

TEST(CApi, OptionsDefaultToTheEnginesAndAreChecked) {
  dion3_options o;
  dion3_options_default(&o);
  EXPECT_EQ(o.on_nonfinite, DION3_NONFINITE_RAISE);
  EXPECT_EQ(o.megabatch, 1);
  EXPECT_EQ(o.record, 1);
  EXPECT_EQ(o.agree_on_names, 0);
  EXPECT_EQ(o.workspace_limit, 0u);
  dion3_optimizer* opt = nullptr;
  o.megabatch = 2;
  EXPECT_EQ(dion3_create_with_options(&opt, DION3_DEVICE_CPU, 0, nullptr, &o), DION3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion3_last_error()).find("options.megabatch is 2"), std::string::npos) << dion3_last_error();
  EXPECT_EQ(opt, nullptr);
  dion3_options_default(&o);
  o.agree_on_names = 7;
  EXPECT_EQ(dion3_create_with_options(&opt, DION3_DEVICE_CPU, 0, nullptr, &o), DION3_INVALID_ARGUMENT);
  dion3_options_default(&o);
  o.on_nonfinite = 5;
  EXPECT_EQ(dion3_create_with_options(&opt, DION3_DEVICE_CPU, 0, nullptr, &o), DION3_INVALID_ARGUMENT);
  // NULL options: the defaults.
  ASSERT_EQ(dion3_create_with_options(&opt, DION3_DEVICE_CPU, 0, nullptr, nullptr), DION3_OK);
  dion3_destroy(opt);
}

TEST(CApi, MegabatchAndWorkspaceOptionsShapeThePlanNotTheResult) {
  std::vector<Weights> a, b, c;
  dion3_options o;
  dion3_options_default(&o);
  dion3_optimizer* together = make(&o, a);
  o.megabatch = 0;
  dion3_optimizer* apart = make(&o, b);
  dion3_options_default(&o);
  o.workspace_limit = 1;  // one matrix per chunk
  dion3_optimizer* chunked = make(&o, c);
  dion3_megabatch_info info[2];
  size_t n = 0;
  ASSERT_EQ(dion3_plan(together, info, 2, &n), DION3_OK);
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(info[0].count, 2);
  const uint64_t whole_bytes = info[0].workspace_bytes;
  ASSERT_EQ(dion3_plan(apart, info, 2, &n), DION3_OK);
  EXPECT_EQ(n, 2u);
  ASSERT_EQ(dion3_plan(chunked, info, 2, &n), DION3_OK);
  ASSERT_EQ(n, 1u);
  EXPECT_LT(info[0].workspace_bytes, whole_bytes);  // one matrix per chunk
  for (auto* opt : {together, apart, chunked}) ASSERT_EQ(dion3_step(opt, nullptr), DION3_OK) << dion3_last_error();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(a[i].w, b[i].w) << i;
    EXPECT_EQ(a[i].w, c[i].w) << i;
  }
  for (auto* opt : {together, apart, chunked}) dion3_destroy(opt);
}

TEST(CApi, StepAsyncIsTheStepAndPostsItsCounters) {
  std::vector<Weights> a, b;
  dion3_optimizer* sync = make(nullptr, a);
  dion3_optimizer* async = make(nullptr, b);
  int64_t taken = -1, skipped = -1;
  int ready = -1;
  ASSERT_EQ(dion3_posted_steps(async, &taken, &skipped, &ready), DION3_OK);
  EXPECT_EQ(ready, 0);  // no step yet
  EXPECT_EQ(taken, -1);
  EXPECT_EQ(dion3_posted_steps(async, &taken, &skipped, nullptr), DION3_INVALID_ARGUMENT);
  for (int step = 0; step < 2; ++step) {
    ASSERT_EQ(dion3_step(sync, nullptr), DION3_OK) << dion3_last_error();
    ASSERT_EQ(dion3_step_async(async), DION3_OK) << dion3_last_error();
  }
  for (int i = 0; i < 2; ++i) EXPECT_EQ(a[i].w, b[i].w) << i;
  ASSERT_EQ(dion3_posted_steps(async, &taken, &skipped, &ready), DION3_OK);
  EXPECT_EQ(ready, 1);  // the CPU backend's copy has arrived when the step returns
  EXPECT_EQ(taken, 2);
  EXPECT_EQ(skipped, 0);

  // Under RAISE the asynchronous step cannot raise: a non-finite gradient drops it, counted.
  const std::vector<float> before = b[0].w;
  b[1].g[5] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(dion3_step_async(async), DION3_OK) << dion3_last_error();
  EXPECT_EQ(b[0].w, before);
  ASSERT_EQ(dion3_posted_steps(async, &taken, &skipped, &ready), DION3_OK);
  EXPECT_EQ(ready, 1);
  EXPECT_EQ(taken, 2);
  EXPECT_EQ(skipped, 1);
  int64_t t2 = 0, s2 = 0;
  ASSERT_EQ(dion3_steps(async, &t2, &s2), DION3_OK);
  EXPECT_EQ(t2, 2);
  EXPECT_EQ(s2, 1);
  dion3_destroy(sync);
  dion3_destroy(async);
}

TEST(CApi, PlanIsTheNextStepsAfterAGradientOfAnotherDtype) {
  // Megabatches are keyed by the gradient's dtype: one given anew in bfloat16 splits them.
  std::vector<Weights> a;
  dion3_optimizer* opt = make(nullptr, a);
  ASSERT_EQ(dion3_step(opt, nullptr), DION3_OK);
  dion3_megabatch_info info[4];
  size_t n = 0;
  ASSERT_EQ(dion3_plan(opt, info, 4, &n), DION3_OK);
  ASSERT_EQ(n, 1u);
  std::vector<uint16_t> bf16(16 * 24, 0x3c00);  // 2^-7
  dion3_tensor g{bf16.data(), DION3_BF16, DION3_DEVICE_CPU, 0, 2, {16, 24}};
  ASSERT_EQ(dion3_set_grad(opt, 1, &g), DION3_OK) << dion3_last_error();
  ASSERT_EQ(dion3_plan(opt, info, 4, &n), DION3_OK);
  EXPECT_EQ(n, 2u);
  ASSERT_EQ(dion3_step(opt, nullptr), DION3_OK);
  ASSERT_EQ(dion3_plan(opt, info, 4, &n), DION3_OK);
  EXPECT_EQ(n, 2u);
  dion3_destroy(opt);
}

TEST(CApi, PlanGenerationAndHyperparameterRefresh) {
  std::vector<Weights> a;
  dion3_optimizer* opt = make(nullptr, a);
  EXPECT_EQ(dion3_refresh_hyperparameters(opt), DION3_INVALID_ARGUMENT);  // nothing planned yet
  EXPECT_NE(std::string(dion3_last_error()).find("take one step first"), std::string::npos) << dion3_last_error();
  ASSERT_EQ(dion3_step(opt, nullptr), DION3_OK);
  uint64_t gen = 0, again = 0;
  ASSERT_EQ(dion3_plan_generation(opt, &gen), DION3_OK);
  ASSERT_EQ(dion3_set_lr(opt, 0, 0.005), DION3_OK);
  EXPECT_EQ(dion3_refresh_hyperparameters(opt), DION3_OK) << dion3_last_error();
  ASSERT_EQ(dion3_step(opt, nullptr), DION3_OK);
  ASSERT_EQ(dion3_plan_generation(opt, &again), DION3_OK);
  EXPECT_EQ(again, gen);  // an lr change keeps the plan
  dion3_group_config cfg;
  ASSERT_EQ(dion3_get_group_config(opt, 0, &cfg), DION3_OK);
  cfg.fraction = 0.5;
  ASSERT_EQ(dion3_set_group_config(opt, 0, &cfg), DION3_OK);
  EXPECT_EQ(dion3_refresh_hyperparameters(opt), DION3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion3_last_error()).find("capture the step again"), std::string::npos) << dion3_last_error();
  ASSERT_EQ(dion3_step(opt, nullptr), DION3_OK);
  ASSERT_EQ(dion3_plan_generation(opt, &again), DION3_OK);
  EXPECT_NE(again, gen);  // replanned
  EXPECT_EQ(dion3_plan_generation(opt, nullptr), DION3_INVALID_ARGUMENT);
  // The refresh checks what the step checks: an lr that adjust_lr takes past float32 (x4 for a
  // 64 x 4 matrix) is refused.
  {
    dion3_optimizer* tall = nullptr;
    ASSERT_EQ(dion3_create_with_options(&tall, DION3_DEVICE_CPU, 0, nullptr, nullptr), DION3_OK);
    dion3_group_config_default(&cfg);
    int tg = -1;
    ASSERT_EQ(dion3_add_group(tall, &cfg, &tg), DION3_OK);
    Weights w(64, 4, 1.0f);
    ASSERT_EQ(dion3_add_param(tall, tg, "tall", &w.wt, &w.gt, nullptr), DION3_OK) << dion3_last_error();
    ASSERT_EQ(dion3_step(tall, nullptr), DION3_OK) << dion3_last_error();
    ASSERT_EQ(dion3_set_lr(tall, tg, 3e38), DION3_OK);
    EXPECT_EQ(dion3_refresh_hyperparameters(tall), DION3_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dion3_last_error()).find("not finite in float32"), std::string::npos) << dion3_last_error();
    dion3_destroy(tall);
  }
  // torch.optim.Muon's settings survive the C struct both ways.
  ASSERT_EQ(dion3_get_group_config(opt, 0, &cfg), DION3_OK);
  EXPECT_EQ(cfg.ema_momentum, 0);
  {
    dion3_group_config muon;
    dion3_group_config_default(&muon);
    muon.algorithm = DION3_ALGO_MUON;
    muon.ema_momentum = 1;
    muon.adjust_lr = DION3_ADJUST_LR_SPECTRAL_NORM_CLAMPED;
    dion3_optimizer* o = nullptr;
    ASSERT_EQ(dion3_create_with_options(&o, DION3_DEVICE_CPU, 0, nullptr, nullptr), DION3_OK);
    int mg = -1;
    ASSERT_EQ(dion3_add_group(o, &muon, &mg), DION3_OK) << dion3_last_error();
    dion3_group_config back;
    ASSERT_EQ(dion3_get_group_config(o, mg, &back), DION3_OK);
    EXPECT_EQ(back.ema_momentum, 1);
    EXPECT_EQ(back.adjust_lr, DION3_ADJUST_LR_SPECTRAL_NORM_CLAMPED);
    // The norm's guard: algorithm.md §2's by default, torch's floor with another eps both ways.
    EXPECT_EQ(back.orth_norm_eps, static_cast<double>(1e-7f));
    EXPECT_EQ(back.orth_norm_floor, 0);
    muon.orth_norm_eps = 1e-3;
    muon.orth_norm_floor = 1;
    ASSERT_EQ(dion3_add_group(o, &muon, &mg), DION3_OK) << dion3_last_error();
    ASSERT_EQ(dion3_get_group_config(o, mg, &back), DION3_OK);
    EXPECT_EQ(back.orth_norm_eps, static_cast<double>(1e-3f));
    EXPECT_EQ(back.orth_norm_floor, 1);
    muon.orth_norm_eps = 0.0;
    EXPECT_EQ(dion3_add_group(o, &muon, &mg), DION3_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dion3_last_error()).find("'norm_eps'"), std::string::npos) << dion3_last_error();
    for (auto [eps, shown] : {std::pair{1e-50, ", got 1e-50"}, std::pair{1e39, ", got 1e+39"}}) {
      muon.orth_norm_eps = eps;  // named as given, not as float32 makes them (0, inf)
      EXPECT_EQ(dion3_add_group(o, &muon, &mg), DION3_INVALID_ARGUMENT);
      EXPECT_NE(std::string(dion3_last_error()).find(shown), std::string::npos) << dion3_last_error();
    }
    dion3_group_config adamw;  // an element-wise group does not read it
    dion3_group_config_default(&adamw);
    adamw.algorithm = DION3_ALGO_ADAMW;
    adamw.orth_norm_eps = 0.0;
    int ag = -1;
    EXPECT_EQ(dion3_add_group(o, &adamw, &ag), DION3_OK) << dion3_last_error();
    muon.orth_norm_eps = 1e-7;
    muon.orth_norm_floor = 0;
    muon.mu = 1.0;  // the gradient's share 1 - mu would be nothing: refused, as for every mu of 1
    EXPECT_EQ(dion3_add_group(o, &muon, &mg), DION3_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dion3_last_error()).find("'mu' must lie in [0, 1)"), std::string::npos) << dion3_last_error();
    muon.mu = 0.95;
    muon.algorithm = DION3_ALGO_DION3;  // the averaged form is Muon's and NorMuon's
    EXPECT_EQ(dion3_add_group(o, &muon, &mg), DION3_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dion3_last_error()).find("ema_momentum"), std::string::npos) << dion3_last_error();
    // A switch is 0 or 1: anything else is refused naming the field, as the options' are.
    dion3_group_config seven;
    dion3_group_config_default(&seven);
    seven.flatten = 7;
    EXPECT_EQ(dion3_add_group(o, &seven, &mg), DION3_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dion3_last_error()).find("flatten is 7, expected 0 or 1"), std::string::npos)
        << dion3_last_error();
    // Weights stored (in, out): off by default, kept both ways.
    dion3_group_config stored;
    dion3_group_config_default(&stored);
    EXPECT_EQ(stored.transposed, 0);
    stored.transposed = 1;
    ASSERT_EQ(dion3_add_group(o, &stored, &mg), DION3_OK) << dion3_last_error();
    ASSERT_EQ(dion3_get_group_config(o, mg, &back), DION3_OK);
    EXPECT_EQ(back.transposed, 1);
    stored.transposed = 2;
    EXPECT_EQ(dion3_add_group(o, &stored, &mg), DION3_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dion3_last_error()).find("transposed is 2"), std::string::npos) << dion3_last_error();
    dion3_destroy(o);
  }
  // Settings that choose branches of the step on the host are part of the plan, and so is the
  // norm's guard (an argument of the recorded kernels).
  ASSERT_EQ(dion3_get_group_config(opt, 0, &cfg), DION3_OK);
  cfg.cautious_wd = 1;
  ASSERT_EQ(dion3_set_group_config(opt, 0, &cfg), DION3_OK) << dion3_last_error();
  EXPECT_EQ(dion3_refresh_hyperparameters(opt), DION3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion3_last_error()).find("cautious_wd"), std::string::npos) << dion3_last_error();
  cfg.cautious_wd = 0;
  cfg.orth_norm_eps = 1e-3;
  ASSERT_EQ(dion3_set_group_config(opt, 0, &cfg), DION3_OK) << dion3_last_error();
  EXPECT_EQ(dion3_refresh_hyperparameters(opt), DION3_INVALID_ARGUMENT);
  dion3_destroy(opt);
}

}  // namespace
