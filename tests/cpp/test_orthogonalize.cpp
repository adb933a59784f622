// tests/cpp/test_orthogonalize.cpp — dion3::Orthogonalizer on the CPU backend (algorithm.md §2):
// standard and Gram Newton–Schulz against the float64 reference, both coefficient sets and a
// user-supplied list with restarts, the singular-value band on Gaussian and ill-conditioned
// inputs for fp32 and emulated fp16/bf16 iteration, Gram vs standard agreement, the effect of
// Gram NS restarts in fp16, batching, in-place runs and planning introspection.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "dion3/backend.hpp"
#include "dion3/error.hpp"
#include "dion3/orthogonalize.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using dion3::DType;
using dion3::OrthConfig;
using dion3::OrthMethod;
using t3::Rng;

// Runs the library's orthogonalizer on `batch` rows x cols matrices stored in `x` (doubles,
// converted to `in_dtype`) and returns the output (in `out_dtype`) as doubles.
std::vector<double> lib_orth(const OrthConfig& cfg, int batch, int rows, int cols, const std::vector<double>& x,
                             DType in_dtype = DType::F32, DType out_dtype = DType::F32,
                             OrthMethod* method = nullptr) {
  auto be = dion3::make_cpu_backend();
  dion3::Orthogonalizer o(*be, cfg, batch, rows, cols);
  if (method) *method = o.method();
  t3::Buffer in(in_dtype, {batch, rows, cols}, x), out(out_dtype, {batch, rows, cols});
  o.run(in.matrix(batch, rows, cols), out.matrix(batch, rows, cols));
  return out.values();
}

OrthConfig config(OrthMethod m, std::optional<DType> dt = DType::F32,
                  std::vector<dion3::Coefficients> coef = dion3::polar_express_coefficients(),
                  std::vector<int> restarts = {2}) {
  OrthConfig c;
  c.method = m;
  c.iteration_dtype = dt;
  c.coefficients = std::move(coef);
  c.restarts = std::move(restarts);
  return c;
}

const char* dtype_str(DType t) { return dion3::dtype_name(t); }

// ---------------------------------------------------------------------------------------------
// fp32 iteration against the float64 reference, several shapes, both methods, both sets.
struct OrthCase {
  int rows, cols;
  OrthMethod method;
  bool you;  // false = Polar Express
};
void PrintTo(const OrthCase& c, std::ostream* os) { *os << c.rows << "x" << c.cols << (c.method == OrthMethod::Gram ? " gram" : " standard") << (c.you ? " you" : " polar-express"); }

class OrthVsReference : public ::testing::TestWithParam<OrthCase> {};

TEST_P(OrthVsReference, Fp32MatchesFloat64) {
  const OrthCase c = GetParam();
  Rng rng(100 + c.rows * 7 + c.cols);
  const ref::Mat X = t3::gaussian(c.rows, c.cols, rng);
  const auto coef = c.you ? dion3::you_coefficients() : dion3::polar_express_coefficients();
  OrthMethod used;
  const std::vector<double> got = lib_orth(config(c.method, DType::F32, coef), 1, c.rows, c.cols, X,
                                           DType::F32, DType::F32, &used);
  EXPECT_EQ(used, c.method);
  const ref::Mat want = c.method == OrthMethod::Gram
                            ? ref::orth_gram(X, c.rows, c.cols, t3::to_ref(coef), {2})
                            : ref::orth_standard(X, c.rows, c.cols, t3::to_ref(coef));
  // fp32 products with fp32 accumulation: ~1e-6 per primitive, amplified by the polynomial's
  // slope (< 10 per step on these well-conditioned inputs); 1e-4 of the largest entry is ample.
  EXPECT_LT(t3::rel_max_diff(got, want), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, OrthVsReference,
    ::testing::Values(OrthCase{16, 48, OrthMethod::Standard, false}, OrthCase{16, 48, OrthMethod::Gram, false},
                      OrthCase{48, 16, OrthMethod::Standard, false}, OrthCase{48, 16, OrthMethod::Gram, false},
                      OrthCase{32, 32, OrthMethod::Standard, false}, OrthCase{32, 32, OrthMethod::Gram, false},
                      OrthCase{8, 96, OrthMethod::Gram, false}, OrthCase{96, 8, OrthMethod::Standard, false},
                      OrthCase{16, 48, OrthMethod::Standard, true}, OrthCase{16, 48, OrthMethod::Gram, true},
                      OrthCase{40, 24, OrthMethod::Gram, true}, OrthCase{1, 33, OrthMethod::Gram, false}),
    [](const ::testing::TestParamInfo<OrthCase>& i) {
      return std::to_string(i.param.rows) + "x" + std::to_string(i.param.cols) +
             (i.param.method == OrthMethod::Gram ? "_gram" : "_standard") + (i.param.you ? "_you" : "_pe");
    });

TEST(Orthogonalize, UserCoefficientsAndRestartsMatchTheReference) {
  Rng rng(7);
  const int r = 24, c = 64;
  const ref::Mat X = t3::gaussian(r, c, rng);
  // Seven steps: Polar Express followed by two more of its last step; restarts at 2 and 4.
  std::vector<dion3::Coefficients> coef = dion3::polar_express_coefficients();
  coef.push_back(coef.back());
  coef.push_back(coef.back());
  const std::vector<int> restarts = {2, 4};
  const auto gram = lib_orth(config(OrthMethod::Gram, DType::F32, coef, restarts), 1, r, c, X);
  EXPECT_LT(t3::rel_max_diff(gram, ref::orth_gram(X, r, c, t3::to_ref(coef), restarts)), 1e-4);
  const auto std_ = lib_orth(config(OrthMethod::Standard, DType::F32, coef, restarts), 1, r, c, X);
  EXPECT_LT(t3::rel_max_diff(std_, ref::orth_standard(X, r, c, t3::to_ref(coef))), 1e-4);
  // A three-step custom list with a restart at every step (each step then is plain NS).
  const std::vector<dion3::Coefficients> three = {{3.0, -3.2, 1.2}, {2.5, -2.0, 0.6}, {2.0, -1.5, 0.5}};
  const auto g3 = lib_orth(config(OrthMethod::Gram, DType::F32, three, {0, 1, 2}), 1, r, c, X);
  EXPECT_LT(t3::rel_max_diff(g3, ref::orth_standard(X, r, c, t3::to_ref(three))), 1e-4);
}

TEST(Orthogonalize, ZeroInputGivesZeroOutput) {
  // The 1e-7 floor of the normalisation keeps the zero matrix finite.
  const std::vector<double> zeros(12 * 20, 0.0);
  for (OrthMethod m : {OrthMethod::Standard, OrthMethod::Gram}) {
    const auto out = lib_orth(config(m), 1, 12, 20, zeros);
    EXPECT_EQ(t3::max_abs(out), 0.0);
  }
}

// algorithm.md §2 divides by ||X||_F + 1e-7: the result follows the input's scale only where its
// norm comes near 1e-7. NormGuard::floor divides by max(||X||_F, eps), torch.optim.Muon's rule,
// which does not follow it at all above eps.
TEST(Orthogonalize, NormalisationFollowsItsGuard) {
  Rng rng(8);
  const ref::Mat X = t3::gaussian(16, 40, rng);
  ref::Mat big = X, small = X, tiny = X;
  for (double& x : big) x *= 1e3;
  for (double& x : small) x *= 1e-3;
  for (double& x : tiny) x *= 1e-5;  // norm ~3e-4: the added 1e-7 shows here
  const OrthConfig add = config(OrthMethod::Gram);
  OrthConfig floor = add;
  floor.norm.floor = true;
  const auto base = lib_orth(add, 1, 16, 40, X);
  for (const OrthConfig& c : {add, floor}) {
    EXPECT_LT(t3::rel_max_diff(lib_orth(c, 1, 16, 40, big), base), 1e-4);
    EXPECT_LT(t3::rel_max_diff(lib_orth(c, 1, 16, 40, small), base), 1e-4);
  }
  EXPECT_LT(t3::rel_max_diff(lib_orth(floor, 1, 16, 40, tiny), base), 1e-4);
  const auto added = lib_orth(add, 1, 16, 40, tiny);
  EXPECT_GT(t3::rel_max_diff(added, base), 1e-3);
  const auto want = ref::orth_gram(tiny, 16, 40, t3::to_ref(dion3::polar_express_coefficients()), {2});
  EXPECT_LT(t3::rel_max_diff(added, want), 1e-4);
  // Another eps, either way. A floor of 1 above the norm feeds the polynomial X itself, so both
  // are that of the input scaled by hand: X / (||X||_F + eps), and X / eps where ||X||_F < eps.
  OrthConfig unit = floor;
  unit.norm.eps = 1.0f;
  const double n = ref::frobenius(tiny);
  ref::Mat by_sum = tiny, by_floor = tiny;
  for (double& x : by_sum) x /= n + 1e-3;
  for (double& x : by_floor) x /= 1e-3;
  OrthConfig wide = add;
  wide.norm.eps = 1e-3f;
  EXPECT_LT(t3::rel_max_diff(lib_orth(wide, 1, 16, 40, tiny), lib_orth(unit, 1, 16, 40, by_sum)), 1e-4);
  floor.norm.eps = 1e-3f;
  EXPECT_LT(t3::rel_max_diff(lib_orth(floor, 1, 16, 40, tiny), lib_orth(unit, 1, 16, 40, by_floor)), 1e-4);
  EXPECT_GT(t3::rel_max_diff(lib_orth(wide, 1, 16, 40, tiny), lib_orth(floor, 1, 16, 40, tiny)), 1e-2);
}

TEST(Orthogonalize, NormEpsMustBePositiveAndFinite) {
  // Below float32's smallest normal number 1 / eps overflows (a zero input would give NaN).
  for (float eps : {0.0f, -1e-7f, 1e-40f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    OrthConfig c;
    c.norm.eps = eps;
    EXPECT_THAT(t3::error_of([&] { c.validate(); }), ::testing::HasSubstr("'norm_eps'"));
  }
}

TEST(Orthogonalize, StepCheckWeighsTheGradientByItsCoefficient) {
  // M' = a*M + c*G: 1.5e38 + 2e38 overflows float32, 1.5e38 + 0.05 * 2e38 does not.
  auto be = dion3::make_cpu_backend();
  t3::Buffer g(DType::F32, {1, 4}, {2e38, 0, 0, 0}), m(DType::F32, {1, 4}, {1.5e38, 0, 0, 0});
  for (float c : {1.0f, 0.05f}) {
    dion3::StepCheck x;
    x.grad = g.matrix(1, 1, 4);
    x.state = m.matrix(1, 1, 4);
    x.a = 1.0f;
    x.c = c;
    int flag = 0;
    be->check_step({&x, 1}, &flag);
    EXPECT_EQ(flag, c == 1.0f ? 1 : 0) << "c " << c;
  }
}

TEST(Orthogonalize, BatchEqualsSeparateRuns) {
  Rng rng(9);
  const int B = 4, r = 20, c = 36;
  const ref::Mat X = t3::gaussian(B * r, c, rng);
  for (OrthMethod m : {OrthMethod::Standard, OrthMethod::Gram}) {
    const auto batched = lib_orth(config(m), B, r, c, X);
    for (int b = 0; b < B; ++b) {
      const auto one = lib_orth(config(m), 1, r, c, t3::slice(X, b * r * c, r * c));
      EXPECT_LT(t3::max_abs_diff(t3::slice(batched, b * r * c, r * c), one), 1e-6) << "matrix " << b;
    }
  }
}

TEST(Orthogonalize, TallBatchIsTransposedPerMatrix) {
  Rng rng(10);
  const int B = 3, r = 40, c = 12;
  const ref::Mat X = t3::gaussian(B * r, c, rng);
  const auto got = lib_orth(config(OrthMethod::Gram), B, r, c, X);
  for (int b = 0; b < B; ++b) {
    const ref::Mat want = ref::orth_gram(t3::slice(X, b * r * c, r * c), r, c, ref::polar_express(), {2});
    EXPECT_LT(t3::rel_max_diff(t3::slice(got, b * r * c, r * c), want), 1e-4) << "matrix " << b;
  }
}

TEST(Orthogonalize, InPlaceRunEqualsOutOfPlace) {
  Rng rng(11);
  const int r = 16, c = 28;
  const ref::Mat X = t3::gaussian(r, c, rng);
  for (auto [rr, cc] : {std::pair{r, c}, std::pair{c, r}}) {
    auto be = dion3::make_cpu_backend();
    dion3::Orthogonalizer o(*be, config(OrthMethod::Gram), 1, rr, cc);
    t3::Buffer a(DType::F32, {rr, cc}, X), b(DType::F32, {rr, cc});
    o.run(a.matrix(1, rr, cc), b.matrix(1, rr, cc));
    o.run(a.matrix(1, rr, cc), a.matrix(1, rr, cc));
    EXPECT_EQ(a.bytes, b.bytes) << rr << "x" << cc;
  }
}

// The engine keeps its fp32 update rows inside the orthogonalizer's workspace where
// input_offset() finds room: the result must equal a run from a separate input.
TEST(Orthogonalize, InputInsideTheWorkspaceEqualsASeparateInput) {
  Rng rng(13);
  auto be = dion3::make_cpu_backend();
  int placed = 0;
  for (OrthMethod m : {OrthMethod::Standard, OrthMethod::Gram})
    for (auto [r, c] : {std::pair{24, 24}, std::pair{16, 40}, std::pair{40, 16}, std::pair{8, 96}}) {
      const int B = 2;
      const OrthConfig cfg = config(m, DType::F16);
      const std::size_t in_bytes = static_cast<std::size_t>(B * r * c) * sizeof(float);
      const std::size_t off = dion3::Orthogonalizer::input_offset(*be, cfg, B, r, c, in_bytes);
      const std::size_t ws = dion3::Orthogonalizer::required_workspace(*be, cfg, B, r, c);
      if (off == dion3::Orthogonalizer::kNoInputRoom) {
        EXPECT_FALSE(m == OrthMethod::Standard && r == c) << "a square standard run always has room";
        continue;
      }
      ASSERT_LE(off + in_bytes, ws);
      EXPECT_EQ(off % 256, 0u);
      ++placed;
      const ref::Mat X = t3::gaussian(B * r, c, rng);
      const auto want = lib_orth(cfg, B, r, c, X);
      std::vector<unsigned char> arena(ws);
      dion3::Orthogonalizer o(*be, cfg, B, r, c, arena.data());
      t3::Buffer in(DType::F32, {B, r, c}, X), out(DType::F32, {B, r, c});
      std::memcpy(arena.data() + off, in.bytes.data(), in_bytes);
      dion3::MatrixView inside = dion3::MatrixView::contiguous(arena.data() + off, DType::F32, B, r, c);
      o.run(inside, out.matrix(B, r, c));
      EXPECT_EQ(out.values(), want) << (m == OrthMethod::Gram ? "gram " : "standard ") << r << "x" << c;
    }
  EXPECT_GE(placed, 3);
}

// The engine hands the orthogonalizer its input's row sums of squares (gathered with the rows),
// which spare the normalisation its own pass: the result is the one it gets summing them itself.
TEST(Orthogonalize, GivenRowSumsOfSquaresGiveTheSameResult) {
  Rng rng(14);
  auto be = dion3::make_cpu_backend();
  for (OrthMethod m : {OrthMethod::Standard, OrthMethod::Gram})
    for (auto [r, c] : {std::pair{16, 40}, std::pair{40, 16}, std::pair{24, 24}}) {
      const int B = 2;
      t3::Buffer in(DType::F32, {B, r, c}, t3::gaussian(B * r, c, rng));
      const std::vector<double> x = in.values();
      std::vector<float> ss(static_cast<std::size_t>(B * r));
      for (int i = 0; i < B * r; ++i) {
        double a = 0.0;
        for (int j = 0; j < c; ++j) a += x[i * c + j] * x[i * c + j];
        ss[i] = static_cast<float>(a);
      }
      dion3::Orthogonalizer own(*be, config(m), B, r, c), given(*be, config(m), B, r, c);
      const dion3::MatrixView a = own.run(in.matrix(B, r, c)), b = given.run(in.matrix(B, r, c), ss.data());
      ASSERT_EQ(a.dtype, DType::F32);
      const float* pa = static_cast<const float*>(a.data);
      const float* pb = static_cast<const float*>(b.data);
      double worst = 0.0, scale = 0.0;
      for (int i = 0; i < B * r * c; ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(pa[i]) - pb[i]));
        scale = std::max(scale, std::abs(static_cast<double>(pa[i])));
      }
      EXPECT_LT(worst, 1e-5 * scale) << (m == OrthMethod::Gram ? "gram " : "standard ") << r << "x" << c;
      EXPECT_GT(scale, 0.0);
    }
}

// Dion3's engine gathers the selected momentum rows already normalised, with the row sums of
// squares accumulate gave, summed over the selection by select_rows (Backend::gather_normalized):
// the same input as gathering them and normalising in a second pass, and the same error-feedback
// decay of the gathered rows; also for a column-stepped set (the set's rows stored as columns).
TEST(Orthogonalize, GatherNormalizedIsGatherThenNormalize) {
  Rng rng(15);
  auto be = dion3::make_cpu_backend();
  const int n = 2, rows = 12, cols = 20, k = 5;
  const float decay = 0.9f;
  const dion3::NormGuard eps;
  for (const bool columns : {false, true}) {
    for (DType mdt : {DType::F32, DType::BF16}) {
      const int sr = columns ? cols : rows, sc = columns ? rows : cols;  // stored shape
      t3::Buffer w(DType::F32, {n, sr, sc}), g(DType::F32, {n, sr, sc}, t3::gaussian(n * sr, sc, rng));
      t3::Buffer m1(mdt, {n, sr, sc}, t3::gaussian(n * sr, sc, rng)), m2 = m1;
      auto set_of = [&](t3::Buffer& m) {
        auto set = be->new_matrix_set();
        set->columns = columns;
        for (int i = 0; i < n; ++i) {
          dion3::ParamMatrix pm;
          pm.weight = w.matrix(n, sr, sc).at(i);
          pm.grad = g.matrix(n, sr, sc).at(i);
          pm.momentum = m.matrix(n, sr, sc).at(i);
          set->mats.push_back(pm);
        }
        be->refresh(*set);
        return set;
      };
      auto s1 = set_of(m1), s2 = set_of(m2);
      std::vector<float> scores(n * rows), ss(n * rows);
      be->accumulate(*s1, 1.0f, 1.0f, scores.data(), ss.data(), nullptr, nullptr);
      be->accumulate(*s2, 1.0f, 1.0f, nullptr, nullptr, nullptr, nullptr);
      std::vector<int32_t> idx(n * k);
      std::vector<float> selected(n);
      be->select_rows(scores.data(), n, rows, k, idx.data(), nullptr, nullptr, ss.data(), selected.data());
      for (int i = 0; i < n; ++i) {
        double want = 0.0;
        for (int j = 0; j < k; ++j) want += ss[i * rows + idx[i * k + j]];
        ASSERT_NEAR(selected[i], want, 1e-6 * want) << i;
      }
      t3::Buffer fused(DType::F32, {n, k, cols}), u(DType::F32, {n, k, cols}), two(DType::F32, {n, k, cols});
      be->gather_normalized(*s1, idx.data(), k, decay, selected.data(), eps, fused.matrix(n, k, cols), nullptr);
      be->gather_rows(*s2, idx.data(), k, 1.0f, 0.0f, decay, u.matrix(n, k, cols), nullptr, nullptr);
      be->normalize(u.matrix(n, k, cols), two.matrix(n, k, cols), eps, nullptr, false);
      const std::vector<double> a = fused.values(), b = two.values();
      for (std::size_t i = 0; i < a.size(); ++i)
        ASSERT_NEAR(a[i], b[i], 1e-6) << dion3::dtype_name(mdt) << (columns ? " by columns " : " ") << i;
      // Normalised into the transpose: the same values, transposed; an output of in's own shape is
      // refused.
      t3::Buffer tr(DType::F32, {n, cols, k});
      be->normalize(u.matrix(n, k, cols), tr.matrix(n, cols, k), eps, nullptr, true);
      const std::vector<double> t = tr.values();
      for (int64_t i = 0; i < n; ++i)
        for (int64_t r = 0; r < k; ++r)
          for (int64_t c = 0; c < cols; ++c)
            ASSERT_EQ(t[(i * cols + c) * k + r], b[(i * k + r) * cols + c]) << dion3::dtype_name(mdt);
      EXPECT_THROW(be->normalize(u.matrix(n, k, cols), two.matrix(n, k, cols), eps, nullptr, true), dion3::Error);
      EXPECT_EQ(m1.values(), m2.values()) << dion3::dtype_name(mdt);
      EXPECT_NE(m1.values(), t3::Buffer(mdt, {n, rows, cols}).values());
    }
  }
}

TEST(Orthogonalize, Bf16InputAndOutput) {
  Rng rng(12);
  const int r = 16, c = 48;
  t3::Buffer in(DType::BF16, {r, c}, t3::gaussian(r, c, rng));
  const std::vector<double> x = in.values();  // the bf16-rounded input
  const auto got = lib_orth(config(OrthMethod::Standard), 1, r, c, x, DType::BF16, DType::BF16);
  const ref::Mat want = ref::orth_standard(x, r, c, ref::polar_express());
  // Output rounded to bf16 (relative 2^-9) on entries of size ~1/sqrt(c): a couple of ulps.
  EXPECT_LT(t3::max_abs_diff(got, want), 2.0 * 0x1.0p-8 * t3::max_abs(want));
}

TEST(Orthogonalize, PlanningIntrospection) {
  auto be = dion3::make_cpu_backend();
  {
    dion3::Orthogonalizer o(*be, config(OrthMethod::Auto, std::nullopt), 2, 32, 32);
    EXPECT_EQ(o.method(), OrthMethod::Standard);  // p == q: always standard (algorithm.md §2)
    EXPECT_EQ(o.iteration_dtype(), DType::F32);   // the CPU backend's default
    EXPECT_FALSE(o.transposed());
    EXPECT_GT(o.workspace_bytes(), 0u);
  }
  {
    dion3::Orthogonalizer o(*be, config(OrthMethod::Gram, DType::F16), 1, 64, 16);
    EXPECT_EQ(o.method(), OrthMethod::Gram);
    EXPECT_EQ(o.iteration_dtype(), DType::F16);
    EXPECT_TRUE(o.transposed());
  }
  EXPECT_EQ(dion3::choose_orth_method(*be, config(OrthMethod::Auto), 48, 48), OrthMethod::Standard);
  EXPECT_EQ(dion3::choose_orth_method(*be, config(OrthMethod::Gram), 48, 48), OrthMethod::Gram);
  EXPECT_EQ(dion3::choose_orth_method(*be, config(OrthMethod::Standard), 8, 96), OrthMethod::Standard);
  // auto takes Gram for a wide matrix where it saves work, but not in bfloat16, whose rounding
  // lets Gram's iterations leave the polynomial's band (asked for, it is refused at planning:
  // OrthConfig::max_gram_growth).
  EXPECT_EQ(dion3::choose_orth_method(*be, config(OrthMethod::Auto), 8, 96), OrthMethod::Gram);
  EXPECT_EQ(dion3::choose_orth_method(*be, config(OrthMethod::Auto, DType::F16), 8, 96), OrthMethod::Gram);
  EXPECT_EQ(dion3::choose_orth_method(*be, config(OrthMethod::Auto, DType::BF16), 8, 96), OrthMethod::Standard);
  EXPECT_THAT(t3::error_of([&] { dion3::Orthogonalizer(*be, config(OrthMethod::Gram, DType::BF16), 1, 8, 96); }),
              ::testing::HasSubstr("Gram Newton-Schulz in bfloat16"));
}

// Workspace is only the buffers live at once (in elements of the iteration dtype): Gram NS two
// p x q and four p x p; standard NS two p x q and two p x p, or three p x p when p == q.
TEST(Orthogonalize, WorkspaceHoldsOnlyTheLiveBuffers) {
  auto be = dion3::make_cpu_backend();
  auto elems = [&](OrthMethod m, int r, int c) {
    return dion3::Orthogonalizer::required_workspace(*be, config(m, DType::F16), 3, r, c) / (3 * 2);
  };
  EXPECT_EQ(elems(OrthMethod::Gram, 16, 40), 2u * 16 * 40 + 4u * 16 * 16);
  EXPECT_EQ(elems(OrthMethod::Gram, 40, 16), 2u * 16 * 40 + 4u * 16 * 16);
  EXPECT_EQ(elems(OrthMethod::Standard, 16, 40), 2u * 16 * 40 + 2u * 16 * 16);
  EXPECT_EQ(elems(OrthMethod::Standard, 24, 24), 3u * 24 * 24);
  EXPECT_EQ(elems(OrthMethod::Gram, 24, 24), 6u * 24 * 24);
}

TEST(Orthogonalize, RejectsAMismatchedInput) {
  auto be = dion3::make_cpu_backend();
  dion3::Orthogonalizer o(*be, config(OrthMethod::Standard), 1, 8, 16);
  t3::Buffer a(DType::F32, {16, 8}), b(DType::F32, {16, 8});
  const std::string msg = t3::error_of([&] { o.run(a.matrix(1, 16, 8), b.matrix(1, 16, 8)); });
  EXPECT_THAT(msg, ::testing::HasSubstr("8x16"));
}

// The entry for callers that normalise as they gather: X written into normalized_input(), then
// run_normalized(), is run(in) to the bit; a transposed plan has no such entry.
TEST(Orthogonalize, RunNormalizedIsRunOnTheNormalisedInput) {
  Rng rng(16);
  auto be = dion3::make_cpu_backend();
  for (OrthMethod m : {OrthMethod::Standard, OrthMethod::Gram}) {
    const int B = 2, r = 16, c = 40;
    t3::Buffer in(DType::F32, {B, r, c}, t3::gaussian(B * r, c, rng));
    dion3::Orthogonalizer whole(*be, config(m), B, r, c), split(*be, config(m), B, r, c);
    const dion3::MatrixView a = whole.run(in.matrix(B, r, c));
    be->normalize(in.matrix(B, r, c), split.normalized_input(), dion3::NormGuard{}, nullptr, false);
    const dion3::MatrixView b = split.run_normalized();
    ASSERT_EQ(a.dtype, b.dtype);
    EXPECT_EQ(std::memcmp(a.data, b.data, static_cast<std::size_t>(B * r * c) * dion3::dtype_size(a.dtype)), 0);
  }
  dion3::Orthogonalizer tall(*be, config(OrthMethod::Gram), 1, 40, 16);
  EXPECT_THAT(t3::error_of([&] { (void)tall.normalized_input(); }), ::testing::HasSubstr("transposed"));
}

TEST(Orthogonalize, RejectsAnEmptyProblem) {
  auto be = dion3::make_cpu_backend();
  dion3::Status st = dion3::Status::Ok;
  const std::string msg = t3::error_of([&] { dion3::Orthogonalizer o(*be, config(OrthMethod::Standard), 1, 0, 16); }, &st);
  EXPECT_FALSE(msg.empty());
  EXPECT_EQ(st, dion3::Status::InvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// The singular-value band [0.7, 1.2] (algorithm.md §2 quality bar).
struct BandCase {
  DType dtype;
  OrthMethod method;
  bool you;
};
void PrintTo(const BandCase& c, std::ostream* os) { *os << dion3::dtype_name(c.dtype) << (c.method == OrthMethod::Gram ? " gram" : " standard") << (c.you ? " you" : " polar-express"); }

class SingularValueBand : public ::testing::TestWithParam<BandCase> {};

TEST_P(SingularValueBand, GaussianInputs) {
  const BandCase bc = GetParam();
  const auto coef = bc.you ? dion3::you_coefficients() : dion3::polar_express_coefficients();
  Rng rng(20);
  const int shapes[][2] = {{16, 64}, {64, 16}, {32, 48}, {8, 96}};
  for (auto [r, c] : shapes) {
    const ref::Mat X = t3::gaussian(r, c, rng);
    const auto out = lib_orth(config(bc.method, bc.dtype, coef), 1, r, c, X);
    const auto sv = t3::singular_values(out, r, c);
    EXPECT_GE(sv.back(), 0.7) << r << "x" << c;
    EXPECT_LE(sv.front(), 1.2) << r << "x" << c;
    std::printf("[ band %s %s ] %dx%d gaussian: [%.4f, %.4f]\n", dtype_str(bc.dtype),
                bc.method == OrthMethod::Gram ? "gram" : "standard", r, c, sv.back(), sv.front());
  }
}

// Condition numbers for which every singular value can reach the band (see the 1e4 test).
TEST_P(SingularValueBand, IllConditionedInputs) {
  const BandCase bc = GetParam();
  const auto coef = bc.you ? dion3::you_coefficients() : dion3::polar_express_coefficients();
  Rng rng(21);
  for (double kappa : {10.0, 100.0}) {
    for (auto [r, c] : {std::pair{24, 64}, std::pair{64, 24}}) {
      const ref::Mat X = t3::conditioned(r, c, kappa, rng);
      const auto sv = t3::singular_values(lib_orth(config(bc.method, bc.dtype, coef), 1, r, c, X), r, c);
      EXPECT_GE(sv.back(), 0.7) << "kappa " << kappa << " " << r << "x" << c;
      EXPECT_LE(sv.front(), 1.2) << "kappa " << kappa << " " << r << "x" << c;
      std::printf("[ band %s %s ] %dx%d kappa %g: [%.4f, %.4f]\n", dtype_str(bc.dtype),
                  bc.method == OrthMethod::Gram ? "gram" : "standard", r, c, kappa, sv.back(), sv.front());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, SingularValueBand,
    ::testing::Values(BandCase{DType::F32, OrthMethod::Standard, false}, BandCase{DType::F32, OrthMethod::Gram, false},
                      BandCase{DType::F16, OrthMethod::Standard, false}, BandCase{DType::F16, OrthMethod::Gram, false},
                      BandCase{DType::BF16, OrthMethod::Standard, false},
                      BandCase{DType::F32, OrthMethod::Gram, true}, BandCase{DType::F16, OrthMethod::Gram, true}),
    [](const ::testing::TestParamInfo<BandCase>& i) {
      return std::string(dtype_str(i.param.dtype)) + (i.param.method == OrthMethod::Gram ? "_gram" : "_standard") +
             (i.param.you ? "_you" : "_pe");
    });

// Condition number 1e4: a quintic iteration of T = 5 steps multiplies a tiny singular value by
// at most prod(a_t) (~805 for Polar Express), so a normalised sigma of ~1e-4 cannot reach 0.7:
// algorithm.md §2's band holds for the singular values the polynomial can lift, and the rest follow
// the scalar map exactly. We check the output spectrum against that map, sigma by sigma.
TEST(Orthogonalize, ConditionNumber1e4FollowsTheScalarPolynomial) {
  Rng rng(22);
  const int r = 24, c = 64;
  const ref::Mat X = t3::conditioned(r, c, 1e4, rng);
  const double fro = ref::frobenius(X) + 1e-7;
  const auto sin = t3::singular_values(X, r, c);
  for (OrthMethod m : {OrthMethod::Standard, OrthMethod::Gram}) {
    const auto sv = t3::singular_values(lib_orth(config(m), 1, r, c, X), r, c);
    std::vector<double> predicted(r);  // the map is not monotone near 1: compare sorted sets
    for (int i = 0; i < r; ++i) predicted[i] = ref::polynomial_map(sin[i] / fro, ref::polar_express());
    std::sort(predicted.rbegin(), predicted.rend());
    int in_band = 0;
    for (int i = 0; i < r; ++i) {
      const double want = predicted[i];
      EXPECT_NEAR(sv[i], want, 2e-3 + 1e-3 * want) << "sigma " << i;
      EXPECT_LE(sv[i], 1.2);
      if (want >= 0.7) {
        EXPECT_GE(sv[i], 0.7) << "sigma " << i;
        ++in_band;
      }
    }
    EXPECT_GT(in_band, r / 2);  // most of the spectrum is lifted into the band
    EXPECT_LT(sv.back(), 0.1);  // ...but not the 1e-4 end: unattainable with T = 5
  }
}

// ---------------------------------------------------------------------------------------------
// Gram NS vs standard NS on the same input, per iteration dtype (algorithm.md §2: they agree to
// within the iteration dtype's rounding); each case reports its max relative difference.
struct AgreeCase {
  DType dtype;
  double tol;  // max |gram - standard| / max |standard|
};
void PrintTo(const AgreeCase& c, std::ostream* os) { *os << dion3::dtype_name(c.dtype) << " tol " << c.tol; }

class GramVsStandard : public ::testing::TestWithParam<AgreeCase> {};

TEST_P(GramVsStandard, AgreeWithinTheIterationDtype) {
  const AgreeCase ac = GetParam();
  Rng rng(30);
  double worst = 0;
  for (auto [r, c] : {std::pair{16, 64}, std::pair{64, 16}, std::pair{8, 96}, std::pair{32, 48}}) {
    for (double kappa : {0.0, 100.0}) {  // 0 = Gaussian
      const ref::Mat X = kappa == 0 ? t3::gaussian(r, c, rng) : t3::conditioned(r, c, kappa, rng);
      const auto s = lib_orth(config(OrthMethod::Standard, ac.dtype), 1, r, c, X);
      const auto g = lib_orth(config(OrthMethod::Gram, ac.dtype), 1, r, c, X);
      const double d = t3::rel_max_diff(g, s);
      worst = std::max(worst, d);
      EXPECT_LT(d, ac.tol) << r << "x" << c << " kappa " << kappa;
    }
  }
  RecordProperty("max_rel_diff", std::to_string(worst));
  std::printf("[ gram vs standard, %s iteration ] max relative difference %.3g\n", dtype_str(ac.dtype), worst);
}

// Tolerances: unit roundoff u = 2^-24 (fp32), 2^-11 (fp16); the two methods round at different
// places, and the first Polar Express step has slope ~8, so differences of a few tens of u are
// expected on the largest entries. (Gram does not iterate in bf16: OrthConfig::max_gram_growth.)
INSTANTIATE_TEST_SUITE_P(Dtypes, GramVsStandard,
                         ::testing::Values(AgreeCase{DType::F32, 1e-4}, AgreeCase{DType::F16, 5e-2}),
                         [](const ::testing::TestParamInfo<AgreeCase>& i) { return std::string(dtype_str(i.param.dtype)); });

// fp16 Gram NS with and without the restart on an ill-conditioned input.
TEST(Orthogonalize, Fp16GramRestartKeepsIllConditionedInputsInBand) {
  Rng rng(31);
  const int r = 32, c = 96;
  const ref::Mat X = t3::conditioned(r, c, 100.0, rng);
  const ref::Mat exact = ref::orth_standard(X, r, c, ref::polar_express());
  const auto with = lib_orth(config(OrthMethod::Gram, DType::F16, dion3::polar_express_coefficients(), {2}), 1, r, c, X);
  const auto sv_with = t3::singular_values(with, r, c);
  const double dev_with = t3::rel_max_diff(with, exact);
  std::printf("[ fp16 gram, kappa 1e2 ] restarts {2}: sv [%.4f, %.4f], dev %.3g\n", sv_with.back(), sv_with.front(),
              dev_with);
  EXPECT_GE(sv_with.back(), 0.7);
  EXPECT_LE(sv_with.front(), 1.2);
  // Without the restart R = X X^T is carried through all five steps in fp16, where its rounding
  // noise may diverge (OrthConfig::gram_diverges): refused.
  EXPECT_THAT(t3::error_of([&] {
                lib_orth(config(OrthMethod::Gram, DType::F16, dion3::polar_express_coefficients(), {}), 1, r, c, X);
              }),
              ::testing::HasSubstr("Gram Newton-Schulz in float16"));
}

// The CPU backend's symmetric product with a general B (Gram's update after a restart passes
// B = W·R): alpha·A·Bᵀ + beta·D + gamma·I from the lower triangle, mirrored, against float64; one
// column tile and several, with D separate and D aliasing C.
TEST(Orthogonalize, CpuSymProductWithAGeneralBIsABTransposed) {
  auto be = dion3::make_cpu_backend();
  Rng rng(33);
  for (int p : {50, 300}) {
    const ref::Mat S = t3::gaussian(p, p, rng), B = t3::gaussian(p, p, rng), D0 = t3::gaussian(p, p, rng);
    ref::Mat A(static_cast<std::size_t>(p) * p), D(D0);
    for (int i = 0; i < p; ++i)
      for (int j = 0; j < p; ++j) {
        A[static_cast<std::size_t>(i) * p + j] = S[static_cast<std::size_t>(i) * p + j] + S[static_cast<std::size_t>(j) * p + i];
        D[static_cast<std::size_t>(i) * p + j] = D0[static_cast<std::size_t>(i) * p + j] + D0[static_cast<std::size_t>(j) * p + i];
      }
    const double alpha = 0.5, beta = -1.25, gamma = 2.0;
    ref::Mat want(static_cast<std::size_t>(p) * p);
    for (int i = 0; i < p; ++i)
      for (int j = 0; j <= i; ++j) {
        double v = beta * D[static_cast<std::size_t>(i) * p + j] + (i == j ? gamma : 0.0);
        for (int k = 0; k < p; ++k) v += alpha * A[static_cast<std::size_t>(i) * p + k] * B[static_cast<std::size_t>(j) * p + k];
        want[static_cast<std::size_t>(i) * p + j] = want[static_cast<std::size_t>(j) * p + i] = v;
      }
    for (bool aliased : {false, true}) {
      t3::Buffer a(DType::F32, {1, p, p}, A), bb(DType::F32, {1, p, p}, B), d(DType::F32, {1, p, p}, D),
          out(DType::F32, {1, p, p});
      t3::Buffer& c = aliased ? d : out;
      const dion3::MatrixView dv = d.matrix(1, p, p);
      be->sym_product(static_cast<float>(alpha), a.matrix(1, p, p), bb.matrix(1, p, p), static_cast<float>(beta), &dv,
                      static_cast<float>(gamma), c.matrix(1, p, p), false, false);
      EXPECT_LT(t3::rel_max_diff(c.values(), want), 1e-5) << "p " << p << (aliased ? ", C aliasing D" : "");
    }
  }
}

// fp16 Gram NS on spectra where its products' rounding weighs most: two clusters (half the singular
// values 1e-2 of the rest) and rank-deficient inputs. Its largest singular value stays in the band
// and near the standard iteration's (the whole R update after the restart, orthogonalize.cpp).
TEST(Orthogonalize, Fp16GramStaysInBandOnClusteredAndRankDeficientSpectra) {
  Rng rng(32);
  for (auto [r, c] : {std::pair{64, 512}, std::pair{96, 384}}) {
    std::vector<double> clusters(r, 1.0);
    std::fill(clusters.begin() + r / 2, clusters.end(), 1e-2);
    const std::pair<const char*, ref::Mat> inputs[] = {{"two clusters", t3::with_spectrum(r, c, clusters, rng)},
                                                       {"rank p/2", t3::low_rank(r, c, r / 2, rng)},
                                                       {"rank p/4", t3::low_rank(r, c, r / 4, rng)}};
    for (const auto& [name, X] : inputs) {
      const double gram =
          t3::singular_values(lib_orth(config(OrthMethod::Gram, DType::F16), 1, r, c, X), r, c).front();
      const double standard =
          t3::singular_values(lib_orth(config(OrthMethod::Standard, DType::F16), 1, r, c, X), r, c).front();
      std::printf("[ fp16 %s %dx%d ] largest singular value: gram %.4f, standard %.4f\n", name, r, c, gram,
                  standard);
      EXPECT_LE(gram, 1.2) << name << " " << r << "x" << c;
      EXPECT_NEAR(gram, standard, 0.04) << name << " " << r << "x" << c;
    }
  }
}

// A finite rank-deficient input (the gradient of a batch of one) with coefficients that grow Q
// past the bound between restarts: 'auto' iterates standard and stays finite, where Gram gave NaN.
TEST(Orthogonalize, AutoStaysFiniteOnRankDeficientInputsWithLongCoefficientLists) {
  Rng rng(5);
  const int r = 16, c = 128;
  ref::Mat X(static_cast<std::size_t>(r) * c);
  std::vector<double> u(r), v(c);
  for (double& x : u) x = rng.normal();
  for (double& x : v) x = rng.normal();
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) X[static_cast<std::size_t>(i) * c + j] = u[i] * v[j];
  const std::vector<dion3::Coefficients> classic(12, dion3::Coefficients{3.4445, -4.775, 2.0315});
  OrthMethod chosen = OrthMethod::Auto;
  const auto out = lib_orth(config(OrthMethod::Auto, DType::F32, classic, {2}), 1, r, c, X, DType::F32, DType::F32, &chosen);
  EXPECT_EQ(chosen, OrthMethod::Standard);
  for (double x : out) ASSERT_TRUE(std::isfinite(x));
  const auto sv = t3::singular_values(out, r, c);
  EXPECT_GT(sv.front(), 0.7);
  EXPECT_LT(sv.front(), 1.3);
}

}  // namespace
