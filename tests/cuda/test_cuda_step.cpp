// tests/cuda/test_cuda_step.cpp — whole-step parity, CPU backend vs CUDA backend, through
// dion3::Optimizer: Dion3 (several fractions), NorMuon, Muon (plain and Nesterov, cautious
// decay), AdamW and Lion groups, over several steps with fresh gradients; weights and every
// state tensor compared. fp32 iteration dtype for tight bounds; the GPU defaults (fp16 Gram,
// bf16 standard) with loose ones.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>

#include "cpu/cpu_numeric.hpp"
#include "cuda_test_util.hpp"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"

namespace {

using ct::Twin;
using dion3::Algorithm;
using dion3::DType;

struct StepCase {
  std::string name;
  Algorithm algo;
  double fraction = 0.25;
  DType wdt = DType::F32;
  std::optional<DType> iter = DType::F32;  // nullopt: the backend's default
  bool nesterov = false, cautious = false;
  dion3::OrthMethod method = dion3::OrthMethod::Auto;
  bool ema = false;  // ema_momentum (torch.optim.Muon's averaged momentum)
  bool transposed = false;  // matrices stored (in, out): Dion3 and NorMuon step them by columns
  int64_t heads = 0;        // num_heads: blocks of rows (transposed: of stored columns)
  double weight_decay = 0.05;  // 0: unselected weights keep their values (not rewritten)
};

class StepParity : public ct::CudaTest, public ::testing::WithParamInterface<StepCase> {};

std::vector<float> decode(const dion3::HostTensor& t) {
  int64_t n = 1;
  for (auto s : t.shape) n *= s;
  std::vector<float> v(static_cast<std::size_t>(n));
  dion3::MatrixView h = dion3::MatrixView::contiguous(const_cast<unsigned char*>(t.data.data()), t.dtype, 1, 1, n);
  dion3::cpu::load_row(h, 0, 0, v.data());
  return v;
}

TEST_P(StepParity, SeveralSteps) {
  const StepCase c = GetParam();
  std::mt19937_64 rng(81);
  dion3::GroupConfig g;
  g.algorithm = c.algo;
  g.lr = 0.02;
  g.fraction = c.fraction;
  g.weight_decay = c.weight_decay;
  g.nesterov = c.nesterov;
  g.cautious_wd = c.cautious;
  g.ema_momentum = c.ema;
  g.transposed = c.transposed;
  g.num_heads = c.heads;
  g.orth.iteration_dtype = c.iter;
  g.orth.method = c.method;
  dion3::GroupConfig ga;
  ga.algorithm = Algorithm::AdamW;
  ga.lr = 0.01;
  dion3::GroupConfig gl;
  gl.algorithm = Algorithm::Lion;
  gl.lr = 0.001;

  // 200x70, the 130x40 stack and 2100x20 are tall: Dion2 steps them by columns over several row
  // chunks and tiles. 20x2100 stepped by columns (transposed) spans several column chunks and
  // partial row bands of the update, with rows that are not 16-byte aligned in 16-bit weights.
  const std::vector<std::vector<int64_t>> shapes = {{64, 96}, {64, 96},  {96, 64},   {50, 130},
                                                    {3, 40, 72}, {200, 70}, {2, 130, 40}, {20, 2100}, {2100, 20}};
  dion3::Optimizer ocpu(dion3::make_cpu_backend()), ogpu(dion3::make_cuda_backend(0));
  std::vector<std::unique_ptr<Twin>> W, G;
  auto add = [&](int gi_c, int gi_g, const std::vector<int64_t>& shape, const std::string& name) {
    int64_t rows = 1, cols = shape.back();
    for (std::size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
    W.push_back(std::make_unique<Twin>(*gpu, c.wdt, 1, rows, cols));
    G.push_back(std::make_unique<Twin>(*gpu, c.wdt, 1, rows, cols));
    W.back()->fill_normal(rng, 0.5f);
    dion3::ParamSpec hs, ds;
    hs.name = ds.name = name;
    hs.weight = {W.back()->host.data(), c.wdt, dion3::Device::CPU, 0, shape};
    hs.grad = {G.back()->host.data(), c.wdt, dion3::Device::CPU, 0, shape};
    ds.weight = {W.back()->dev.get(), c.wdt, dion3::Device::CUDA, 0, shape};
    ds.grad = {G.back()->dev.get(), c.wdt, dion3::Device::CUDA, 0, shape};
    EXPECT_EQ(ocpu.add_param(gi_c, hs), ogpu.add_param(gi_g, ds));
  };
  const int gc = ocpu.add_group(g), gg = ogpu.add_group(g);
  for (std::size_t i = 0; i < shapes.size(); ++i) add(gc, gg, shapes[i], "m" + std::to_string(i));
  const int ac = ocpu.add_group(ga), ag = ogpu.add_group(ga);
  add(ac, ag, {130}, "bias");
  const int lc = ocpu.add_group(gl), lg = ogpu.add_group(gl);
  add(lc, lg, {7, 33}, "embed");
  std::vector<std::vector<float>> w0;
  for (auto& w : W) w0.push_back(w->host_values());

  for (int step = 0; step < 4; ++step) {
    for (auto& gr : G) gr->fill_normal(rng, 1.0f);
    ASSERT_TRUE(ocpu.step());
    ASSERT_TRUE(ogpu.step());
  }
  const bool loose = !c.iter || *c.iter != DType::F32;
  const double delta_tol = loose ? 6e-2 : 2e-3;
  for (std::size_t i = 0; i < W.size(); ++i) {
    const auto wc = W[i]->host_values(), wg = W[i]->device_values();
    double max_w = 0, max_d = 0, worst = 0;
    std::vector<float> dc(wc.size()), dg(wc.size());
    for (std::size_t e = 0; e < wc.size(); ++e) {
      max_w = std::max(max_w, std::fabs(static_cast<double>(wc[e])));
      max_d = std::max(max_d, std::fabs(static_cast<double>(wc[e]) - w0[i][e]));
      dc[e] = wc[e] - w0[i][e];
      dg[e] = wg[e] - w0[i][e];
    }
    double tol = 2.0 * (c.wdt == DType::F32 ? 0x1.0p-24 : ct::ulp_of(c.wdt)) * 2 * max_w + delta_tol * max_d;
    // Cautious decay is discontinuous where an update element crosses zero: one decay step
    // (lr * wd * |w|) per step may differ there.
    if (c.cautious) tol += 4 * g.lr * g.weight_decay * max_w;
    if (loose) {
      // Half-precision iterations on two devices round differently; compare the whole change.
      // 16-bit weights also quantize each change to the weight's ulp (~2^-9 |w| for bf16).
      const double fro_tol = c.wdt == DType::F32 ? 0.05 : 0.15;
      EXPECT_LE(ct::rel_fro_diff(dg, dc), fro_tol) << "param " << i << " weight changes differ";
      continue;
    }
    for (std::size_t e = 0; e < wc.size(); ++e) worst = std::max(worst, std::fabs(static_cast<double>(wg[e]) - wc[e]));
    EXPECT_LE(worst, tol) << "param " << i << " weights differ (max change " << max_d << ")";
  }
  const auto sc = ocpu.export_state(), sg = ogpu.export_state();
  ASSERT_EQ(sc.params.size(), sg.params.size());
  EXPECT_EQ(sc.steps, sg.steps);
  for (std::size_t i = 0; i < sc.params.size(); ++i) {
    ASSERT_EQ(sc.params[i].tensors.size(), sg.params[i].tensors.size());
    for (std::size_t t = 0; t < sc.params[i].tensors.size(); ++t) {
      const auto& [name, hc] = sc.params[i].tensors[t];
      const auto vc = decode(hc), vg = decode(sg.params[i].tensors[t].second);
      if (loose && name == "variance") {
        EXPECT_LE(ct::rel_fro_diff(vg, vc), 0.1) << sc.params[i].name << "." << name;
        continue;
      }
      const double tol = hc.dtype == DType::F32 ? 5e-3 : 4 * ct::ulp_of(hc.dtype);
      EXPECT_LE(ct::rel_max_diff(vg, vc), tol) << sc.params[i].name << "." << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Algorithms, StepParity,
    ::testing::Values(StepCase{"dion3_f025", Algorithm::Dion3, 0.25},
                      StepCase{"dion3_f05_gram", Algorithm::Dion3, 0.5, DType::F32, DType::F32, false, false, dion3::OrthMethod::Gram},
                      StepCase{"dion3_f1", Algorithm::Dion3, 1.0},
                      StepCase{"dion3_f0125_bf16", Algorithm::Dion3, 0.125, DType::BF16},
                      StepCase{"dion3_f025_default_iter", Algorithm::Dion3, 0.25, DType::F32, std::nullopt},
                      StepCase{"dion2_f025", Algorithm::Dion2, 0.25},
                      StepCase{"dion2_f05_cautious", Algorithm::Dion2, 0.5, DType::F32, DType::F32, false, true},
                      StepCase{"dion2_f025_bf16", Algorithm::Dion2, 0.25, DType::BF16},
                      StepCase{"normuon", Algorithm::NorMuon, 1.0},
                      StepCase{"normuon_bf16_default_iter", Algorithm::NorMuon, 1.0, DType::BF16, std::nullopt},
                      StepCase{"muon", Algorithm::Muon, 1.0},
                      StepCase{"muon_nesterov_cautious", Algorithm::Muon, 1.0, DType::F32, DType::F32, true, true},
                      StepCase{"muon_default_iter", Algorithm::Muon, 1.0, DType::F32, std::nullopt},
                      StepCase{"muon_ema_nesterov_bf16", Algorithm::Muon, 1.0, DType::BF16, DType::F32, true, false,
                               dion3::OrthMethod::Auto, true},
                      StepCase{"normuon_ema", Algorithm::NorMuon, 1.0, DType::F32, DType::F32, false, false,
                               dion3::OrthMethod::Auto, true},
                      StepCase{"dion3_f025_transposed", Algorithm::Dion3, 0.25, DType::F32, DType::F32, false, false,
                               dion3::OrthMethod::Auto, false, true},
                      StepCase{"dion3_f05_cautious_bf16_transposed", Algorithm::Dion3, 0.5, DType::BF16, DType::F32,
                               false, true, dion3::OrthMethod::Auto, false, true},
                      StepCase{"normuon_nesterov_transposed", Algorithm::NorMuon, 1.0, DType::F32, DType::F32, true,
                               false, dion3::OrthMethod::Auto, false, true},
                      StepCase{"normuon_default_iter_transposed", Algorithm::NorMuon, 1.0, DType::F32, std::nullopt,
                               false, false, dion3::OrthMethod::Auto, false, true},
                      StepCase{"muon_transposed", Algorithm::Muon, 1.0, DType::F32, DType::F32, false, false,
                               dion3::OrthMethod::Auto, false, true},
                      StepCase{"dion3_f025_transposed_heads", Algorithm::Dion3, 0.25, DType::F32, DType::F32, false,
                               false, dion3::OrthMethod::Auto, false, true, 2},
                      StepCase{"dion3_f025_bf16_transposed_no_decay", Algorithm::Dion3, 0.25, DType::BF16, DType::F32,
                               false, false, dion3::OrthMethod::Auto, false, true, 0, 0.0}),
    [](const auto& i) { return i.param.name; });

// A non-finite gradient: step() under Raise throws and counts nothing (the exported state is
// unchanged); under Skip it counts the dropped step; step_async() counts it whatever the policy.
using CudaStep = ct::CudaTest;
TEST_F(CudaStep, RaisedStepChangesNoCounter) {
  for (auto policy : {dion3::NonFinitePolicy::Raise, dion3::NonFinitePolicy::Skip}) {
    std::mt19937_64 rng(83);
    dion3::OptimizerOptions o;
    o.on_nonfinite = policy;
    dion3::Optimizer opt(dion3::make_cuda_backend(0), o);
    Twin w(*gpu, DType::F32, 1, 16, 24), gr(*gpu, DType::F32, 1, 16, 24);
    w.fill_normal(rng, 0.5f);
    gr.fill_normal(rng, 1.0f);
    dion3::ParamSpec spec;
    spec.name = "w";
    spec.weight = {w.dev.get(), DType::F32, dion3::Device::CUDA, 0, {16, 24}};
    spec.grad = {gr.dev.get(), DType::F32, dion3::Device::CUDA, 0, {16, 24}};
    opt.add_param(opt.add_group(dion3::GroupConfig{}), spec);
    ASSERT_TRUE(opt.step());
    std::vector<float> gv = gr.host_values();
    gv[3] = NAN;
    gr.set_host(gv);
    gr.upload();
    const int64_t dropped = policy == dion3::NonFinitePolicy::Skip ? 1 : 0;
    if (dropped) EXPECT_FALSE(opt.step());
    else EXPECT_THROW(opt.step(), dion3::Error);
    EXPECT_EQ(opt.steps_taken(), 1);
    EXPECT_EQ(opt.steps_skipped(), dropped);
    EXPECT_EQ(opt.export_state().skipped, dropped);
    opt.step_async();
    // The posted copy arrives without being waited for: poll it (it never blocks) until it has.
    int64_t posted[2] = {-1, -1};
    while (!opt.posted_counters(posted)) {
    }
    EXPECT_EQ(posted[0], 1);
    EXPECT_EQ(posted[1], dropped + 1);
    EXPECT_EQ(opt.steps_taken(), 1);
    EXPECT_EQ(opt.steps_skipped(), dropped + 1);
  }
}

// step_async on the GPU: a parameter without a gradient counts neither the step the device drops
// nor the one it applies (the CPU suite's Absent.StepsEnqueuedWithoutTheirVerdictCountOnlyWhenApplied).
TEST_F(CudaStep, AbsentParametersCountOnlyTheStepsTheDeviceApplies) {
  std::mt19937_64 rng(85);
  dion3::Optimizer opt(dion3::make_cuda_backend(0));
  const int g = opt.add_group(dion3::GroupConfig{});
  std::vector<std::unique_ptr<Twin>> ws, gs;
  for (int i = 0; i < 2; ++i) {
    ws.push_back(std::make_unique<Twin>(*gpu, DType::F32, 1, 16, 24));
    gs.push_back(std::make_unique<Twin>(*gpu, DType::F32, 1, 16, 24));
    ws[i]->fill_normal(rng, 0.5f);
    gs[i]->fill_normal(rng, 1.0f);
    dion3::ParamSpec spec;
    spec.name = "w" + std::to_string(i);
    spec.weight = {ws[i]->dev.get(), DType::F32, dion3::Device::CUDA, 0, {16, 24}};
    spec.grad = {gs[i]->dev.get(), DType::F32, dion3::Device::CUDA, 0, {16, 24}};
    opt.add_param(g, spec);
  }
  ASSERT_TRUE(opt.step());  // plans while both are present
  opt.clear_grad(1);
  std::vector<float> gv = gs[0]->host_values();
  gv[3] = NAN;
  gs[0]->set_host(gv);
  gs[0]->upload();
  opt.step_async();  // dropped
  gs[0]->fill_normal(rng, 1.0f);
  opt.step_async();  // applied
  const dion3::OptimizerState st = opt.export_state();
  EXPECT_EQ(st.steps, 2);
  EXPECT_EQ(st.skipped, 1);
  EXPECT_EQ(st.params[0].step, 2);
  EXPECT_EQ(st.params[1].step, 1);
  opt.import_state(st);
  EXPECT_EQ(opt.export_state().params[1].step, 1);
}

// AdamW's first step moves every element by lr * sign(g), large finite gradients included (the
// CPU suite's Hardening.AdamWMovesElementsOfLargeFiniteGradientsByTheLearningRate): 128 elements
// on the 4-element path, 7 on the scalar one.
TEST_F(CudaStep, AdamWMovesElementsOfLargeFiniteGradientsByTheLearningRate) {
  const std::vector<float> g = {1.0f, -1e10f, 1e19f, -2e19f, 1e20f, -5e20f};
  for (int64_t n : {128, 7}) {
    dion3::Optimizer opt(dion3::make_cuda_backend(0));
    Twin w(*gpu, DType::F32, 1, 1, n), gr(*gpu, DType::F32, 1, 1, n);
    std::vector<float> w0(static_cast<std::size_t>(n)), gv(w0.size());
    for (std::size_t i = 0; i < w0.size(); ++i) {
      w0[i] = 0.5f + 0.01f * static_cast<float>(i % 7);
      gv[i] = g[i % g.size()];
    }
    w.set_host(w0);
    w.upload();
    gr.set_host(gv);
    gr.upload();
    dion3::GroupConfig ga;
    ga.algorithm = Algorithm::AdamW;
    ga.betas = {0.9, 0.999};  // torch.optim.AdamW's: (1 - beta2) g^2 stays finite up to |g| ~ 5.8e20
    ga.weight_decay = 0.0;
    dion3::ParamSpec spec;
    spec.name = "b";
    spec.weight = {w.dev.get(), DType::F32, dion3::Device::CUDA, 0, {n}};
    spec.grad = {gr.dev.get(), DType::F32, dion3::Device::CUDA, 0, {n}};
    opt.add_param(opt.add_group(ga), spec);
    ASSERT_TRUE(opt.step());
    const auto w1 = w.device_values();
    for (std::size_t i = 0; i < w0.size(); ++i)
      EXPECT_NEAR(w1[i], w0[i] - ga.lr * (gv[i] > 0 ? 1.0 : -1.0), 1e-6) << "n " << n << " element " << i;
  }
}

// The non-finite check's momentum bound on the GPU (the CPU suite's Hardening tests say more), for
// Dion3 (from the selection's scores) and Muon and NorMuon (raised by accumulate): the same verdicts
// and results as a check told to read everything before every step (state_changed()), with the CPU
// suite's gradient scales on two elements of a 64 x 96 matrix (the 16-byte path; a second one in its
// megabatch gets small gradients) and of a 13 x 7 one (the element-wise path); and the bound in use:
// momentum written through state_views() without state_changed() is not read again.
TEST_F(CudaStep, TheMomentumBoundNeverChangesAVerdict) {
  const std::vector<double> scales = {0.2, 0.2, 0.2, 0.2, 0.2, 0.19, 0.19, 0.19, 0.1, 0.05, 0.19, 0.19,
                                      std::numeric_limits<double>::infinity(), 1e-30, 1e-30};
  for (Algorithm alg : {Algorithm::Dion3, Algorithm::Muon, Algorithm::NorMuon})
  for (DType dt : {DType::F32, DType::BF16}) {
    const std::string what = std::string(dion3::algorithm_name(alg)) + " " + dion3::dtype_name(dt);
    const double big = dt == DType::F32 ? 3.4028234663852886e38 : 3.3895313892515355e38;
    struct Run {
      dion3::Optimizer opt;
      std::vector<std::unique_ptr<Twin>> w, g;
      explicit Run(dion3::OptimizerOptions o) : opt(dion3::make_cuda_backend(0), o) {}
    };
    dion3::OptimizerOptions o;
    o.on_nonfinite = dion3::NonFinitePolicy::Skip;
    const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 96}, {64, 96}, {13, 7}};
    auto make = [&] {
      auto r = std::make_unique<Run>(o);
      dion3::GroupConfig g;
      g.algorithm = alg;
      g.fraction = 0.5;
      const int gi = r->opt.add_group(g);
      std::mt19937_64 wrng(88);
      for (auto [rows, cols] : shapes) {
        r->w.push_back(std::make_unique<Twin>(*gpu, dt, 1, rows, cols));
        r->g.push_back(std::make_unique<Twin>(*gpu, dt, 1, rows, cols));
        r->w.back()->fill_normal(wrng, 0.5f);
        dion3::ParamSpec spec;
        spec.name = "w" + std::to_string(r->w.size());
        spec.weight = {r->w.back()->dev.get(), dt, dion3::Device::CUDA, 0, {rows, cols}};
        spec.grad = {r->g.back()->dev.get(), dt, dion3::Device::CUDA, 0, {rows, cols}};
        r->opt.add_param(gi, spec);
      }
      return r;
    };
    auto fast = make(), exact = make();
    int applied = 0;
    for (std::size_t s = 0; s < scales.size(); ++s) {
      for (std::size_t i = 0; i < shapes.size(); ++i) {  // the same signs every step
        std::vector<float> v(static_cast<std::size_t>(fast->g[i]->numel()));
        for (std::size_t e = 0; e < v.size(); ++e)
          v[e] = static_cast<float>((e % 3 == 0 ? -1.0 : 1.0) *
                                    (i != 1 && (e == 0 || e + 1 == v.size()) ? scales[s] * big : 1e-3));
        for (Run* r : {fast.get(), exact.get()}) {
          r->g[i]->set_host(v);
          r->g[i]->upload();
        }
      }
      exact->opt.state_changed();
      const bool a = fast->opt.step(), b = exact->opt.step();
      EXPECT_EQ(a, b) << what << " step " << s;
      applied += a;
      for (std::size_t i = 0; i < fast->w.size(); ++i)
        EXPECT_EQ(fast->w[i]->device_values(), exact->w[i]->device_values()) << what << " step " << s;
    }
    EXPECT_GT(applied, 3) << what;
    EXPECT_LT(applied, static_cast<int>(scales.size())) << what;

    for (bool notice : {false, true}) {
      auto r = make();
      for (int s = 0; s < 2; ++s) {
        for (auto& g : r->g) g->fill_value(0.5f);
        ASSERT_TRUE(r->opt.step());
      }
      const dion3::TensorView m = r->opt.state_views(0)[0].second;
      Twin huge(*gpu, dt, 1, 1, m.numel());
      huge.fill_value(static_cast<float>(0.9 * big));
      ASSERT_EQ(cudaMemcpy(m.data, huge.dev.get(), huge.bytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
      if (notice) r->opt.state_changed();
      for (auto& g : r->g) g->fill_value(static_cast<float>(0.2 * big));
      EXPECT_EQ(r->opt.step(), !notice) << what << (notice ? " after state_changed()" : "");
    }
  }
}

// Orthogonalizations recorded and replayed (OptimizerOptions::record_orthogonalizer) step
// exactly as op by op, bit for bit: chunked megabatches, the backend's 16-bit iterations, a plan
// change (fraction) and a gradient re-bound to other memory on the way.
TEST_F(CudaStep, RecordedOrthogonalizerEqualsOpByOp) {
  std::mt19937_64 rng(85);
  struct Run {
    std::unique_ptr<dion3::Optimizer> opt;
    std::vector<std::unique_ptr<Twin>> W, G, G2;
  };
  const std::vector<std::vector<int64_t>> shapes = {{256, 384}, {256, 384}, {256, 384}, {256, 384},
                                                   {256, 384}, {192, 256}, {2, 64, 200}, {40}};
  std::vector<std::vector<float>> w0;
  for (const auto& sh : shapes) {
    int64_t n = 1;
    for (auto d : sh) n *= d;
    w0.push_back(ct::normal_values(rng, n, 0.5f));
  }
  Run runs[2];
  for (int r = 0; r < 2; ++r) {
    dion3::OptimizerOptions o;
    o.record_orthogonalizer = r == 0;
    o.workspace_limit = 1;  // one matrix per chunk: several recordings per megabatch
    runs[r].opt = std::make_unique<dion3::Optimizer>(dion3::make_cuda_backend(0), o);
    dion3::GroupConfig gd, gn, ga;
    gd.algorithm = Algorithm::Dion3;
    gd.fraction = 0.25;
    gd.weight_decay = 0.1;
    gn.algorithm = Algorithm::NorMuon;
    ga.algorithm = Algorithm::AdamW;
    const int groups[3] = {runs[r].opt->add_group(gd), runs[r].opt->add_group(gn), runs[r].opt->add_group(ga)};
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const auto& sh = shapes[i];
      const int64_t cols = sh.back(), rows = static_cast<int64_t>(w0[i].size()) / cols;
      for (auto* v : {&runs[r].W, &runs[r].G, &runs[r].G2})
        v->push_back(std::make_unique<Twin>(*gpu, DType::BF16, 1, rows, cols));
      runs[r].W.back()->set_host(w0[i]);
      runs[r].W.back()->upload();
      dion3::ParamSpec spec;
      spec.name = "p" + std::to_string(i);
      spec.weight = {runs[r].W.back()->dev.get(), DType::BF16, dion3::Device::CUDA, 0, sh};
      spec.grad = {runs[r].G.back()->dev.get(), DType::BF16, dion3::Device::CUDA, 0, sh};
      runs[r].opt->add_param(groups[sh.size() == 1 ? 2 : i == 5 ? 1 : 0], spec);
    }
  }
  for (int step = 0; step < 7; ++step) {
    std::vector<std::vector<float>> grads;
    for (const auto& w : w0) grads.push_back(ct::normal_values(rng, static_cast<int64_t>(w.size()), 1.0f));
    for (Run& run : runs) {
      if (step == 3) run.opt->group(0).fraction = 0.5;  // a new plan: new chunks, recorded afresh
      for (std::size_t i = 0; i < grads.size(); ++i) {
        Twin& g = step >= 5 && i == 0 ? *run.G2[i] : *run.G[i];  // re-bound to other memory
        g.set_host(grads[i]);
        g.upload();
        if (step == 5 && i == 0)
          run.opt->set_grad(0, {g.dev.get(), DType::BF16, dion3::Device::CUDA, 0, shapes[0]});
      }
      ASSERT_TRUE(run.opt->step());
    }
  }
  for (std::size_t i = 0; i < shapes.size(); ++i)
    EXPECT_EQ(runs[0].W[i]->device_values(), runs[1].W[i]->device_values()) << "weight " << i;
  const auto a = runs[0].opt->export_state(), b = runs[1].opt->export_state();
  for (std::size_t i = 0; i < a.params.size(); ++i)
    for (std::size_t t = 0; t < a.params[i].tensors.size(); ++t)
      EXPECT_EQ(a.params[i].tensors[t].second.data, b.params[i].tensors[t].second.data)
          << a.params[i].name << "." << a.params[i].tensors[t].first;
}

// A step captured by the caller, with a gradient re-bound just before, and then never replayed:
// the next eager step must read the new gradient's table, as an engine that never captured does.
TEST_F(CudaStep, AnEagerStepAfterACaptureThatWasNotReplayedBindsAfresh) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    std::mt19937_64 rng(87);
    const std::vector<int64_t> shape = {48, 64};
    std::vector<float> w0 = ct::normal_values(rng, 48 * 64, 0.5f), g1 = ct::normal_values(rng, 48 * 64, 1.0f),
                       g2 = ct::normal_values(rng, 48 * 64, 1.0f);
    struct Run {
      std::unique_ptr<dion3::Optimizer> opt;
      std::unique_ptr<Twin> w, ga, gb;
    } runs[2];
    for (Run& r : runs) {
      r.opt = std::make_unique<dion3::Optimizer>(dion3::make_cuda_backend(0, stream));
      for (auto* t : {&r.w, &r.ga, &r.gb}) *t = std::make_unique<Twin>(*gpu, DType::F32, 1, 48, 64);
      r.w->set_host(w0);
      r.w->upload();
      r.ga->set_host(g1);
      r.ga->upload();
      r.gb->set_host(g2);
      r.gb->upload();
      dion3::GroupConfig g;
      g.fraction = 0.5;
      dion3::ParamSpec spec;
      spec.name = "w";
      spec.weight = {r.w->dev.get(), DType::F32, dion3::Device::CUDA, 0, shape};
      spec.grad = {r.ga->dev.get(), DType::F32, dion3::Device::CUDA, 0, shape};
      r.opt->add_param(r.opt->add_group(g), spec);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the uploads ran on the fixture's stream
      ASSERT_TRUE(r.opt->step());
      ASSERT_TRUE(r.opt->step());  // the second step records the orthogonalization
      r.opt->set_grad(0, {r.gb->dev.get(), DType::F32, dion3::Device::CUDA, 0, shape});
    }
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    runs[0].opt->step_async();
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphDestroy(graph);  // never replayed
    for (Run& r : runs) ASSERT_TRUE(r.opt->step());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(runs[0].w->device_values(), runs[1].w->device_values());
  }
  cudaStreamDestroy(stream);
}

// state_changed() while the caller captures (PyTorch's step() calls it there when it notices an
// in-place state write): the bounds are forgotten for the next step outside the capture too, not
// only in the graph, where they would wait for its first replay. Momentum written at 0.9 x the
// largest value, state_changed() and a step captured, then an eager step with a gradient of
// 0.2 x it: the sum overflows, and that step is dropped; a replay after refresh_hyperparameters()
// too. And the graph forgets them at every replay (a write captured with the step): after a
// replay that raised them, momentum written anew without notice is read by the next replay.
TEST_F(CudaStep, StateChangedUnderACaptureForgetsTheBoundsForTheNextEagerStep) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (bool replay : {false, true}) {
    const double big = 3.4028234663852886e38;
    const std::vector<int64_t> shape = {48, 64};
    dion3::OptimizerOptions o;
    o.on_nonfinite = dion3::NonFinitePolicy::Skip;
    dion3::Optimizer opt(dion3::make_cuda_backend(0, stream), o);
    Twin w(*gpu, DType::F32, 1, 48, 64), g(*gpu, DType::F32, 1, 48, 64);
    std::mt19937_64 rng(89);
    w.fill_normal(rng, 0.5f);
    g.fill_value(0.5f);
    dion3::GroupConfig gc;
    gc.fraction = 0.5;
    dion3::ParamSpec spec;
    spec.name = "w";
    spec.weight = {w.dev.get(), DType::F32, dion3::Device::CUDA, 0, shape};
    spec.grad = {g.dev.get(), DType::F32, dion3::Device::CUDA, 0, shape};
    opt.add_param(opt.add_group(gc), spec);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int s = 0; s < 2; ++s) ASSERT_TRUE(opt.step());  // the bound is known and small
    const dion3::TensorView m = opt.state_views(0)[0].second;
    Twin huge(*gpu, DType::F32, 1, 1, m.numel());
    huge.fill_value(static_cast<float>(0.9 * big));
    ASSERT_EQ(cudaMemcpy(m.data, huge.dev.get(), huge.bytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
    g.fill_value(static_cast<float>(0.2 * big));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    opt.state_changed();
    opt.step_async();
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    if (replay) {
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      opt.refresh_hyperparameters();
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(opt.steps_skipped(), 1) << "the replay went through";
      huge.fill_value(0.0f);
      ASSERT_EQ(cudaMemcpy(m.data, huge.dev.get(), huge.bytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
      g.fill_value(0.5f);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      opt.refresh_hyperparameters();
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);  // applied: the bound is small again
      // The stream does not wait for the legacy default stream's copies below, nor they for it.
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      huge.fill_value(static_cast<float>(0.9 * big));
      ASSERT_EQ(cudaMemcpy(m.data, huge.dev.get(), huge.bytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
      g.fill_value(static_cast<float>(0.2 * big));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      opt.refresh_hyperparameters();
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      cudaGraphExecDestroy(exec);
      EXPECT_EQ(opt.steps_taken(), 3) << "the second replay was dropped";
      EXPECT_EQ(opt.steps_skipped(), 2) << "a replay trusted a bound from before the write";
    } else {
      EXPECT_FALSE(opt.step()) << "an overflowing momentum went through";
    }
    cudaGraphDestroy(graph);
    for (float x : w.device_values()) ASSERT_TRUE(std::isfinite(x)) << (replay ? "replay" : "eager");
  }
  cudaStreamDestroy(stream);
}

// A step that must be planned (the first, or one after a change of a setting the plan depends on)
// cannot be captured: step_async() refuses it, naming why, with nothing enqueued, and the capture
// ends valid; an eager step then plans and steps as if the capture had not been tried.
TEST_F(CudaStep, AStepThatMustBePlannedIsRefusedUnderCapture) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    std::mt19937_64 rng(89);
    const std::vector<int64_t> shape = {48, 64};
    const std::vector<float> w0 = ct::normal_values(rng, 48 * 64, 0.5f), g0 = ct::normal_values(rng, 48 * 64, 1.0f);
    struct Run {
      std::unique_ptr<dion3::Optimizer> opt;
      std::unique_ptr<Twin> w, g;
    } runs[2];
    for (Run& r : runs) {
      r.opt = std::make_unique<dion3::Optimizer>(dion3::make_cuda_backend(0, stream));
      r.w = std::make_unique<Twin>(*gpu, DType::F32, 1, 48, 64);
      r.g = std::make_unique<Twin>(*gpu, DType::F32, 1, 48, 64);
      r.w->set_host(w0);
      r.w->upload();
      r.g->set_host(g0);
      r.g->upload();
      dion3::ParamSpec spec;
      spec.name = "w";
      spec.weight = {r.w->dev.get(), DType::F32, dion3::Device::CUDA, 0, shape};
      spec.grad = {r.g->dev.get(), DType::F32, dion3::Device::CUDA, 0, shape};
      r.opt->add_param(r.opt->add_group(dion3::GroupConfig{}), spec);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dion3::Optimizer& opt = *runs[0].opt;
    for (int change = 0; change < 2; ++change) {
      if (change == 1) {
        for (Run& r : runs) ASSERT_TRUE(r.opt->step());
        opt.group(0).fraction = 0.5;
        runs[1].opt->group(0).fraction = 0.5;
      }
      EXPECT_TRUE(opt.needs_new_plan());
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      try {
        opt.step_async();
        ADD_FAILURE() << "a step that must be planned was captured (change " << change << ")";
      } catch (const dion3::Error& e) {
        EXPECT_NE(std::string(e.what()).find("cannot be captured in a CUDA graph"), std::string::npos) << e.what();
      }
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);  // not invalidated
      size_t nodes = 1;
      ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
      EXPECT_EQ(nodes, 0u) << "change " << change;
      cudaGraphDestroy(graph);
    }
    for (Run& r : runs) ASSERT_TRUE(r.opt->step());
    EXPECT_FALSE(opt.needs_new_plan());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(runs[0].w->device_values(), runs[1].w->device_values());
  }
  cudaStreamDestroy(stream);
}

// A captured step reads the memory bound when it was captured: once a gradient is bound anew, a
// refresh (the call before each replay) refuses; so does a tensor on another GPU than the
// optimizer's, which the kernels would dereference on the wrong device.
TEST_F(CudaStep, RefreshRefusesMemoryBoundAnewSinceTheCaptureAndOtherGpusAreRefused) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    std::mt19937_64 rng(88);
    const std::vector<int64_t> shape = {48, 64};
    dion3::Optimizer opt(dion3::make_cuda_backend(0, stream));
    Twin w(*gpu, DType::F32, 1, 48, 64), ga(*gpu, DType::F32, 1, 48, 64), gb(*gpu, DType::F32, 1, 48, 64);
    w.fill_normal(rng, 0.5f);
    ga.fill_normal(rng);
    gb.fill_normal(rng);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dion3::ParamSpec spec;
    spec.name = "w";
    spec.weight = {w.dev.get(), DType::F32, dion3::Device::CUDA, 0, shape};
    spec.grad = {ga.dev.get(), DType::F32, dion3::Device::CUDA, 0, shape};
    const int g = opt.add_group(dion3::GroupConfig{});
    opt.add_param(g, spec);
    ASSERT_TRUE(opt.step());
    ASSERT_TRUE(opt.step());  // the second step records the orthogonalization, as before a real capture
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    opt.step_async();
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphDestroy(graph);
    EXPECT_NO_THROW(opt.refresh_hyperparameters());
    opt.set_grad(0, {ga.dev.get(), DType::F32, dion3::Device::CUDA, 0, shape});  // the same memory
    EXPECT_NO_THROW(opt.refresh_hyperparameters());
    opt.set_grad(0, {gb.dev.get(), DType::F32, dion3::Device::CUDA, 0, shape});
    try {
      opt.refresh_hyperparameters();
      ADD_FAILURE() << "refreshed a capture whose gradient moved";
    } catch (const dion3::Error& e) {
      EXPECT_NE(std::string(e.what()).find("capture the step again"), std::string::npos) << e.what();
    }
    ASSERT_TRUE(opt.step());  // eager steps follow the new binding

    dion3::ParamSpec other = spec;
    other.name = "elsewhere";
    other.weight.device_index = other.grad.device_index = 1;
    Twin w2(*gpu, DType::F32, 1, 48, 64), g2(*gpu, DType::F32, 1, 48, 64);
    other.weight.data = w2.dev.get();
    other.grad.data = g2.dev.get();
    try {
      opt.add_param(g, other);
      ADD_FAILURE() << "accepted a tensor of CUDA device 1";
    } catch (const dion3::Error& e) {
      EXPECT_NE(std::string(e.what()).find("is on CUDA device 1 but this optimizer runs on CUDA device 0"),
                std::string::npos) << e.what();
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
