// tests/cpp/test_reference.cpp — checks of the test machinery itself: the float64 reference
// (Gram NS == standard NS in exact-ish arithmetic, the scalar polynomial on singular values,
// selection ties, Dion3(f=1) == NorMuon) and the helpers (16-bit conversions, Jacobi solver).
// If these fail, no comparison against the reference can be trusted.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/cpu_numeric.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using t3::Rng;

TEST(Reference, GramEqualsStandardInFloat64) {
  Rng rng(1);
  const int shapes[][2] = {{8, 24}, {24, 8}, {16, 16}, {5, 40}};
  for (auto [r, c] : shapes) {
    const ref::Mat X = t3::gaussian(r, c, rng);
    const ref::Mat S = ref::orth_standard(X, r, c, ref::polar_express());
    for (const std::vector<int>& restarts : {std::vector<int>{2}, std::vector<int>{}, std::vector<int>{1, 3}}) {
      const ref::Mat G = ref::orth_gram(X, r, c, ref::polar_express(), restarts);
      EXPECT_LT(t3::max_abs_diff(G, S), 1e-10) << r << "x" << c << " restarts " << restarts.size();
    }
  }
}

TEST(Reference, OutputSingularValuesFollowThePolynomial) {
  Rng rng(2);
  const int r = 12, c = 20;
  const ref::Mat X = t3::conditioned(r, c, 100.0, rng);
  const double fro = ref::frobenius(X) + 1e-7;
  const std::vector<double> sin = t3::singular_values(X, r, c);
  for (const auto& coef : {ref::polar_express(), ref::you()}) {
    const std::vector<double> sout = t3::singular_values(ref::orth_standard(X, r, c, coef), r, c);
    // The map is not monotone near 1 (it oscillates inside the band), so compare sorted sets.
    std::vector<double> want(r);
    for (int i = 0; i < r; ++i) want[i] = ref::polynomial_map(sin[i] / fro, coef);
    std::sort(want.rbegin(), want.rend());
    for (int i = 0; i < r; ++i) EXPECT_NEAR(sout[i], want[i], 1e-10);
  }
}

TEST(Reference, TallInputIsTheTransposeOfWide) {
  Rng rng(3);
  const ref::Mat X = t3::gaussian(10, 30, rng);
  const ref::Mat a = ref::orth_standard(ref::transpose(X, 10, 30), 30, 10, ref::you());
  const ref::Mat b = ref::transpose(ref::orth_standard(X, 10, 30, ref::you()), 10, 30);
  EXPECT_LT(t3::max_abs_diff(a, b), 1e-14);
}

TEST(Reference, JacobiEigenvaluesOfARotatedDiagonal) {
  Rng rng(4);
  const int n = 9;
  const ref::Mat Q = t3::random_orthogonal(n, rng);
  ref::Mat D(n * n, 0.0);
  for (int i = 0; i < n; ++i) D[i * n + i] = std::pow(10.0, -i);  // 1 .. 1e-8
  const ref::Mat A = ref::matmul(ref::matmul(ref::transpose(Q, n, n), D, n, n, n), Q, n, n, n);
  const std::vector<double> ev = t3::sym_eigenvalues(A, n);
  for (int i = 0; i < n; ++i) EXPECT_NEAR(ev[i], std::pow(10.0, -(n - 1 - i)), 1e-14);
}

TEST(Reference, SixteenBitConversionsRoundToNearestEven) {
  EXPECT_EQ(t3::to_bf16_bits(1.0), 0x3F80);
  EXPECT_EQ(t3::to_f16_bits(1.0), 0x3C00);
  EXPECT_EQ(t3::to_f16_bits(-2.0), 0xC000);
  EXPECT_EQ(t3::to_f16_bits(0x1.0p-24), 0x0001);  // smallest subnormal
  EXPECT_EQ(t3::to_f16_bits(65504.0), 0x7BFF);
  EXPECT_EQ(t3::to_f16_bits(65520.0), 0x7C00);  // halfway to 2^16 rounds to infinity
  // Halfway cases go to the even neighbour.
  EXPECT_EQ(t3::bf16_bits_to_float(t3::to_bf16_bits(1.0 + 0x1.0p-8)), 1.0f);
  EXPECT_EQ(t3::bf16_bits_to_float(t3::to_bf16_bits(1.0 + 3 * 0x1.0p-8)), 1.0f + 0x1.0p-6f);
  EXPECT_EQ(t3::f16_bits_to_float(t3::to_f16_bits(1.0 + 0x1.0p-11)), 1.0f);
  EXPECT_EQ(t3::f16_bits_to_float(t3::to_f16_bits(1.0 + 3 * 0x1.0p-11)), 1.0f + 0x1.0p-9f);
  // Every finite 16-bit pattern survives a round trip through float.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    if (((h >> 10) & 0x1F) != 0x1F) {
      ASSERT_EQ(t3::to_f16_bits(t3::f16_bits_to_float(h)), h) << std::hex << b;
    }
    if (((h >> 7) & 0xFF) != 0xFF) {
      ASSERT_EQ(t3::to_bf16_bits(t3::bf16_bits_to_float(h)), h) << std::hex << b;
    }
  }
}

TEST(Reference, BackendHalfConversionsMatchTheHelpers) {
  // The CPU backend's fp16 conversions (hardware _Float16, or integer code where the compiler
  // lacks it, as clang 14 on x86-64 in the sanitizer build) round exactly as the helpers do.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float want = t3::f16_bits_to_float(h), got = dion3::cpu::f16_to_float(h);
    ASSERT_TRUE(std::isnan(want) ? std::isnan(got) : got == want && std::signbit(got) == std::signbit(want))
        << std::hex << b;
  }
  auto check = [](float f) {
    const uint16_t want = t3::to_f16_bits(f), got = dion3::cpu::float_to_f16(f);
    const bool nan = std::isnan(f);
    ASSERT_TRUE(nan ? (got & 0x7C00) == 0x7C00 && (got & 0x3FF) != 0 : got == want) << std::hexfloat << f;
  };
  // Every float on either side of, and exactly at, each rounding boundary (the midpoint between
  // neighbouring halves, subnormals and the overflow threshold included), then a sweep.
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    const float lo = t3::f16_bits_to_float(static_cast<uint16_t>(h));
    const float hi = h == 0x7BFF ? 65536.0f : t3::f16_bits_to_float(static_cast<uint16_t>(h + 1));
    const float mid = lo + (hi - lo) / 2;  // exact: halves have 11 significant bits
    for (float f : {lo, std::nextafter(mid, 0.0f), mid, std::nextafter(mid, INFINITY)}) {
      check(f);
      check(-f);
    }
  }
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4099) {
    float f;
    const uint32_t u = static_cast<uint32_t>(b);
    std::memcpy(&f, &u, 4);
    check(f);
  }
}

TEST(Reference, SelectionBreaksTiesTowardTheLowerIndex) {
  // Rows 1, 2, 4 and 5 share the largest score; k = 3 keeps 1, 2 and 4.
  const ref::Mat M = {0, 1,  1, 1,  -1, 1,  0, 0.5,  1, -1,  -1, -1};
  const ref::SelectionReport s = ref::select_rows(M, 6, 2, 3);
  EXPECT_EQ(s.selected, (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(s.gap, 0.0);
  EXPECT_EQ(ref::selected_count(0.25, 6), 2);
  EXPECT_EQ(ref::selected_count(0.01, 6), 1);
  EXPECT_EQ(ref::selected_count(1.0, 6), 6);
}

TEST(Reference, Dion3WithFullFractionIsNorMuon) {
  Rng rng(5);
  const int m = 12, n = 20;
  ref::MatrixHyper h;
  h.fraction = 1.0;
  ref::Mat W1 = t3::gaussian(m, n, rng, 0.1), W2 = W1, M1(m * n, 0.0), M2(m * n, 0.0);
  ref::Vec v1(m, 0.0), v2(m, 0.0);
  for (int s = 0; s < 4; ++s) {
    const ref::Mat G = t3::gaussian(m, n, rng);
    ref::dion3_step(W1, M1, v1, G, m, n, h);
    ref::normuon_step(W2, M2, v2, G, m, n, h);
  }
  EXPECT_LT(t3::max_abs_diff(W1, W2), 1e-12);
  // The stored momenta differ by the factor mu: Dion3 keeps mu*(M + G), NorMuon mu*M + G.
  for (size_t i = 0; i < M1.size(); ++i) EXPECT_NEAR(M1[i], h.mu * M2[i], 1e-12);
}

}  // namespace
