// tests/cuda/test_cuda_ops.cpp — every CUDA backend op against the CPU backend on the same
// inputs: accumulate + scores, select_rows (ties), gather_rows, gather_normalized, apply_update (NorMuon, cautious
// decay), check_finite, skip flags, normalize, convert, add_identity, gemm, gram and
// sym_product (full and lower-triangle tile schedules, ragged tiles), AdamW and Lion.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>

#include "cuda/cuda_backend.hpp"
#include "dion3/error.hpp"
#include "dion3/orthogonalize.hpp"
#include "cuda_test_util.hpp"

namespace {

using ct::Twin;
using CudaOps = ct::CudaTest;
using dion3::DType;
using dion3::MatrixView;

const char* dn(DType t) { return dion3::dtype_name(t); }

// nmats matrices (rows x cols) of weight, grad, momentum and variance, on both sides; with
// `columns`, a column-stepped set (its rows are the stored columns, one variance entry each).
struct SetTwin {
  int64_t n, rows, cols;
  Twin w, g, m, v;
  std::unique_ptr<dion3::MatrixSet> hs, ds;
  SetTwin(dion3::Backend& cpu, dion3::Backend& gpu, int64_t n_, int64_t r, int64_t c, DType wdt, DType gdt,
          DType mdt, std::mt19937_64& rng, bool columns = false)
      : n(n_), rows(r), cols(c), w(gpu, wdt, n_, r, c), g(gpu, gdt, n_, r, c), m(gpu, mdt, n_, r, c),
        v(gpu, DType::F32, n_, 1, columns ? c : r) {
    w.fill_normal(rng);
    g.fill_normal(rng, 0.5f);
    m.fill_normal(rng, 0.3f);
    const int64_t vr = columns ? c : r;
    std::vector<float> vv = ct::normal_values(rng, n * vr, 0.1f);
    for (auto& x : vv) x = x * x;
    v.set_host(vv);
    v.upload();
    hs = cpu.new_matrix_set();
    ds = gpu.new_matrix_set();
    for (int64_t i = 0; i < n; ++i) {
      dion3::ParamMatrix hp, dp;
      hp.weight = w.hview().at(i); hp.grad = g.hview().at(i); hp.momentum = m.hview().at(i);
      hp.variance = reinterpret_cast<float*>(v.host.data()) + i * vr;
      dp.weight = w.dview().at(i); dp.grad = g.dview().at(i); dp.momentum = m.dview().at(i);
      dp.variance = v.dev.as<float>() + i * vr;
      hs->mats.push_back(hp);
      ds->mats.push_back(dp);
    }
    hs->columns = ds->columns = columns;
    cpu.refresh(*hs);
    gpu.refresh(*ds);
  }
};

double storage_tol(DType t) { return t == DType::F32 ? 1e-5 : 2.0 * ct::ulp_of(t); }

// Sums of squares (or, with l1, of magnitudes) of each row of a (rows x cols)-row-major array of
// values, in double.
std::vector<float> row_sums_of_squares(const std::vector<float>& v, int64_t cols, bool l1 = false) {
  std::vector<float> s;
  for (std::size_t r = 0; r * cols < v.size(); ++r) {
    double a = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const double x = v[r * cols + c];
      a += l1 ? std::fabs(x) : x * x;
    }
    s.push_back(static_cast<float>(a));
  }
  return s;
}

// Per matrix, the sum of rs[i*rows + r] over its listed rows idx[i*k ...] (all rows when idx is
// null; padding entries count nothing): what select_rows hands gather_normalized.
std::vector<float> selected_sums(const std::vector<float>& rs, const int32_t* idx, int64_t n, int64_t rows,
                                 int64_t k) {
  std::vector<float> out;
  for (int64_t i = 0; i < n; ++i) {
    double a = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = idx ? idx[i * k + j] : j;
      if (r < rows) a += rs[i * rows + r];
    }
    out.push_back(static_cast<float>(a));
  }
  return out;
}

// ---- accumulate -----------------------------------------------------------------------------
struct AccCase { DType m, g; int64_t cols = 300; };  // cols % 4 == 0: vectorised path
class Accumulate : public ct::CudaTest, public ::testing::WithParamInterface<AccCase> {};

TEST_P(Accumulate, MatchesCpu) {
  const AccCase c = GetParam();
  std::mt19937_64 rng(11);
  SetTwin s(*cpu, *gpu, 3, 37, c.cols, DType::F32, c.g, c.m, rng);
  std::vector<float> hsc(3 * 37), dsc_h(3 * 37);
  dion3::DeviceBuffer dsc(gpu->allocator(), hsc.size() * 4);
  Twin ss(*gpu, DType::F32, 3, 37, 1);
  ss.fill_value(-1.0f);
  cpu->accumulate(*s.hs, 0.9f, 0.05f, hsc.data(), static_cast<float*>(ss.hview().data), nullptr, nullptr);
  gpu->accumulate(*s.ds, 0.9f, 0.05f, dsc.as<float>(), static_cast<float*>(ss.dview().data), nullptr, nullptr);
  gpu->copy_to_host(dsc_h.data(), dsc.get(), hsc.size() * 4);
  EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(c.m));
  // Scores are the l1 norms of the rows as each backend stored them (fp32 tree sum vs the CPU's
  // double sum); the two may store 16-bit values an ulp apart (FMA or not), within storage_tol.
  EXPECT_LE(ct::rel_max_diff(hsc, row_sums_of_squares(s.m.host_values(), c.cols, true)), 1e-6);
  EXPECT_LE(ct::rel_max_diff(dsc_h, row_sums_of_squares(s.m.device_values(), c.cols, true)), 1e-5);
  EXPECT_LE(ct::rel_max_diff(dsc_h, hsc), std::max(1e-4, storage_tol(c.m)));
  // Row sums of squares of M as stored, on both backends.
  EXPECT_LE(ct::rel_max_diff(ss.host_values(), row_sums_of_squares(s.m.host_values(), c.cols)), 1e-6);
  EXPECT_LE(ct::rel_max_diff(ss.device_values(), row_sums_of_squares(s.m.device_values(), c.cols)), 1e-5);
}

// accumulate's `largest` (Muon's and NorMuon's momentum bound): raised to each matrix's largest
// |M| as stored, never lowered, on the row path and the column-stepped one, with warps and
// threads past the last row or column (37 rows; 300 columns).
TEST_P(Accumulate, RaisesTheMomentumBounds) {
  const AccCase c = GetParam();
  for (bool columns : {false, true}) {
    std::mt19937_64 rng(12);
    SetTwin s(*cpu, *gpu, 3, 37, c.cols, DType::F32, c.g, c.m, rng, columns);
    std::vector<float> hb = {0.0f, 1e6f, 0.0f}, db_h(3);  // the second bound lies above its M
    dion3::DeviceBuffer db(gpu->allocator(), 3 * sizeof(float));
    gpu->copy_from_host(db.get(), hb.data(), 3 * sizeof(float));
    cpu->accumulate(*s.hs, 0.9f, 0.05f, nullptr, nullptr, hb.data(), nullptr);
    gpu->accumulate(*s.ds, 0.9f, 0.05f, nullptr, nullptr, db.as<float>(), nullptr);
    gpu->copy_to_host(db_h.data(), db.get(), 3 * sizeof(float));
    const std::vector<float> hm = s.m.host_values(), dm = s.m.device_values();
    const auto per = static_cast<std::ptrdiff_t>(37 * c.cols);
    for (int i = 0; i < 3; ++i) {
      float hmax = 0.0f, dmax = 0.0f;
      for (std::ptrdiff_t e = i * per; e < (i + 1) * per; ++e)
        hmax = std::max(hmax, std::fabs(hm[e])), dmax = std::max(dmax, std::fabs(dm[e]));
      const std::string what = std::string(columns ? "columns" : "rows") + ", matrix " + std::to_string(i);
      EXPECT_EQ(hb[i], i == 1 ? 1e6f : hmax) << what;
      EXPECT_EQ(db_h[i], i == 1 ? 1e6f : dmax) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Accumulate,
                         ::testing::Values(AccCase{DType::F32, DType::F32, 301}, AccCase{DType::BF16, DType::BF16},
                                           AccCase{DType::F32, DType::BF16}, AccCase{DType::F16, DType::F32},
                                           AccCase{DType::BF16, DType::F16, 301}),
                         [](const auto& i) { return std::string(dn(i.param.m)) + "_" + dn(i.param.g) + "_" + std::to_string(i.param.cols); });

// ---- select_rows ----------------------------------------------------------------------------
struct SelCase { int64_t count, m, k, levels; };
class SelectRows : public ct::CudaTest, public ::testing::WithParamInterface<SelCase> {};

TEST_P(SelectRows, ExactlyCpu) {
  const SelCase c = GetParam();
  std::mt19937_64 rng(c.m * 7 + c.k);
  std::vector<float> sc(c.count * c.m);
  std::uniform_int_distribution<int> lev(0, static_cast<int>(c.levels) - 1);
  std::uniform_real_distribution<float> uni(0.0f, 100.0f);
  for (auto& x : sc) x = c.levels > 0 ? static_cast<float>(lev(rng)) * 0.25f : uni(rng);
  std::vector<float> rs(c.count * c.m);  // row sums of squares, to be summed over the selection
  std::uniform_real_distribution<float> pos(0.5f, 2.0f);
  for (auto& x : rs) x = pos(rng);
  std::vector<int32_t> hidx(c.count * c.k), didx_h(c.count * c.k, -1);
  std::vector<float> hlargest(c.count, -1.0f), dlargest_h(c.count, -2.0f), hsel(c.count, -1.0f),
      dsel_h(c.count, -2.0f);
  dion3::DeviceBuffer dsc(gpu->allocator(), sc.size() * 4), didx(gpu->allocator(), hidx.size() * 4),
      dlargest(gpu->allocator(), c.count * 4), drs(gpu->allocator(), rs.size() * 4), dsel(gpu->allocator(), c.count * 4);
  gpu->copy_from_host(dsc.get(), sc.data(), sc.size() * 4);
  gpu->copy_from_host(drs.get(), rs.data(), rs.size() * 4);
  cpu->select_rows(sc.data(), c.count, c.m, c.k, hidx.data(), nullptr, hlargest.data(), rs.data(), hsel.data());
  gpu->select_rows(dsc.as<float>(), c.count, c.m, c.k, didx.as<int32_t>(), nullptr, dlargest.as<float>(),
                   drs.as<float>(), dsel.as<float>());
  gpu->copy_to_host(didx_h.data(), didx.get(), hidx.size() * 4);
  gpu->copy_to_host(dlargest_h.data(), dlargest.get(), c.count * 4);
  gpu->copy_to_host(dsel_h.data(), dsel.get(), c.count * 4);
  EXPECT_EQ(didx_h, hidx);
  EXPECT_EQ(dlargest_h, hlargest);  // the largest score plus one (StepCheck::state_bound)
  // The selected rows' sums of squares: the CPU's in double, the device's in fp32 (another order).
  const std::vector<float> want = selected_sums(rs, hidx.data(), c.count, c.m, c.k);
  EXPECT_LE(ct::rel_max_diff(hsel, want), 1e-7);
  EXPECT_LE(ct::rel_max_diff(dsel_h, want), 1e-5);
  for (int64_t i = 0; i < c.count; ++i)
    EXPECT_EQ(hlargest[i], *std::max_element(sc.begin() + i * c.m, sc.begin() + (i + 1) * c.m) + 1.0f);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SelectRows,
                         ::testing::Values(SelCase{4, 1000, 1, 0}, SelCase{4, 1000, 250, 0},
                                           SelCase{4, 1000, 1000, 0}, SelCase{3, 1000, 333, 5},
                                           SelCase{2, 777, 100, 2}, SelCase{2, 513, 1, 1},
                                           SelCase{5, 11008, 2752, 0}, SelCase{3, 11008, 2752, 40},
                                           SelCase{2, 4096, 512, 3}, SelCase{3, 8192, 2048, 0},
                                           SelCase{2, 5000, 1000, 7}, SelCase{2, 2049, 700, 0}));

// n sets of k distinct rows of `rows`, each ascending (what select_rows hands on), concatenated.
std::vector<int32_t> random_row_sets(int64_t n, int64_t rows, int64_t k, std::mt19937_64& rng) {
  std::vector<int32_t> idx;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> all(rows);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + k);
    idx.insert(idx.end(), all.begin(), all.begin() + k);
  }
  return idx;
}

// ---- gather_rows ------------------------------------------------------------------------------
struct GatherCase { DType m, out; bool with_idx; float sm, sg, decay; };
class GatherRows : public ct::CudaTest, public ::testing::WithParamInterface<GatherCase> {};

TEST_P(GatherRows, MatchesCpu) {
  const GatherCase c = GetParam();
  std::mt19937_64 rng(5);
  const int64_t n = 3, rows = 40, cols = 130, k = c.with_idx ? 11 : rows;
  SetTwin s(*cpu, *gpu, n, rows, cols, DType::F32, DType::F32, c.m, rng);
  const std::vector<int32_t> idx = random_row_sets(n, rows, k, rng);
  dion3::DeviceBuffer didx(gpu->allocator(), idx.size() * 4);
  gpu->copy_from_host(didx.get(), idx.data(), idx.size() * 4);
  Twin out(*gpu, c.out, n, k, cols), ss(*gpu, DType::F32, n, k, 1);
  ss.fill_value(-1.0f);
  cpu->gather_rows(*s.hs, c.with_idx ? idx.data() : nullptr, k, c.sm, c.sg, c.decay, out.hview(),
                   static_cast<float*>(ss.hview().data), nullptr);
  gpu->gather_rows(*s.ds, c.with_idx ? didx.as<int32_t>() : nullptr, k, c.sm, c.sg, c.decay, out.dview(),
                   static_cast<float*>(ss.dview().data), nullptr);
  EXPECT_LE(ct::rel_max_diff(out.device_values(), out.host_values()), storage_tol(c.out));
  EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(c.m));
  // The row sums are of the rows as stored, on both backends.
  EXPECT_LE(ct::rel_max_diff(ss.host_values(), row_sums_of_squares(out.host_values(), cols)), 1e-6);
  EXPECT_LE(ct::rel_max_diff(ss.device_values(), row_sums_of_squares(out.device_values(), cols)), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Cases, GatherRows,
                         ::testing::Values(GatherCase{DType::F32, DType::F32, true, 1.0f, 0.0f, 0.95f},
                                           GatherCase{DType::BF16, DType::F32, true, 1.0f, 0.0f, 0.95f},
                                           GatherCase{DType::BF16, DType::F16, false, 0.95f, 1.0f, 1.0f},
                                           GatherCase{DType::F32, DType::BF16, false, 1.0f, 0.0f, 1.0f}));

// ---- gather_normalized ------------------------------------------------------------------------
// Against the CPU backend, and against gather_rows + normalize on the device itself, with the
// selected rows' sums of squares (as select_rows leaves them; computed on the host here).
// columns: a column-stepped set, its rows x cols stored cols x rows.
struct GatherNormCase {
  DType m, out;
  bool with_idx;
  int64_t rows, cols, k;
  float decay;
  dion3::NormGuard norm = {};
  bool columns = false;
};
class GatherNormalized : public ct::CudaTest, public ::testing::WithParamInterface<GatherNormCase> {};

TEST_P(GatherNormalized, MatchesCpuAndGatherThenNormalize) {
  const GatherNormCase c = GetParam();
  std::mt19937_64 rng(31);
  const int64_t n = 3, k = c.with_idx ? c.k : c.rows;
  const int64_t sr = c.columns ? c.cols : c.rows, sc = c.columns ? c.rows : c.cols;  // stored
  SetTwin s(*cpu, *gpu, n, sr, sc, DType::F32, DType::F32, c.m, rng);
  SetTwin t(*cpu, *gpu, n, sr, sc, DType::F32, DType::F32, c.m, rng);  // the two-pass path's
  for (SetTwin* x : {&s, &t}) {
    x->hs->columns = x->ds->columns = c.columns;
    cpu->refresh(*x->hs);
    gpu->refresh(*x->ds);
  }
  t.m.set_host(s.m.host_values());
  t.m.upload();
  // M's values in the set's row-major order.
  std::vector<float> mv = s.m.host_values();
  if (c.columns) {
    std::vector<float> tr(mv.size());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < sr; ++r)
        for (int64_t q = 0; q < sc; ++q) tr[(i * sc + q) * sr + r] = mv[(i * sr + r) * sc + q];
    mv = tr;
  }
  const std::vector<int32_t> idx = random_row_sets(n, c.rows, k, rng);
  dion3::DeviceBuffer didx(gpu->allocator(), idx.size() * 4);
  gpu->copy_from_host(didx.get(), idx.data(), idx.size() * 4);
  const int32_t* hidx = c.with_idx ? idx.data() : nullptr;
  const int32_t* di = c.with_idx ? didx.as<int32_t>() : nullptr;
  Twin ss(*gpu, DType::F32, n, 1, 1);
  ss.set_host(selected_sums(row_sums_of_squares(mv, c.cols), hidx, n, c.rows, k));
  ss.upload();
  const dion3::NormGuard eps = c.norm;
  Twin out(*gpu, c.out, n, k, c.cols);
  out.fill_value(7.0f);
  cpu->gather_normalized(*s.hs, hidx, k, c.decay, static_cast<const float*>(ss.hview().data), eps, out.hview(),
                         nullptr);
  gpu->gather_normalized(*s.ds, di, k, c.decay, static_cast<const float*>(ss.dview().data), eps, out.dview(),
                         nullptr);
  EXPECT_LE(ct::rel_max_diff(out.device_values(), out.host_values()), storage_tol(c.out));
  EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(c.m));
  // Two passes on the device: U = M[S] in fp32 (exact), then normalize.
  Twin u(*gpu, DType::F32, n, k, c.cols), two(*gpu, c.out, n, k, c.cols);
  gpu->gather_rows(*t.ds, di, k, 1.0f, 0.0f, c.decay, u.dview(), nullptr, nullptr);
  gpu->normalize(u.dview(), two.dview(), eps, nullptr, false);
  EXPECT_LE(ct::rel_max_diff(out.device_values(), two.device_values()), storage_tol(c.out));
  EXPECT_EQ(s.m.device_values(), t.m.device_values());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GatherNormalized,
    ::testing::Values(GatherNormCase{DType::BF16, DType::F16, true, 40, 128, 11, 0.95f},
                      GatherNormCase{DType::BF16, DType::BF16, true, 300, 2048, 75, 0.9f},
                      GatherNormCase{DType::F32, DType::F32, false, 40, 130, 40, 0.95f},
                      GatherNormCase{DType::F16, DType::F16, true, 64, 97, 64, 1.0f},
                      // Scales other than 1 / (norm + 1e-7): a floor above the norm, a large eps added.
                      GatherNormCase{DType::BF16, DType::BF16, true, 300, 2048, 75, 0.9f, {1e5f, true}},
                      GatherNormCase{DType::F32, DType::F32, false, 40, 130, 40, 0.95f, {50.0f, false}},
                      // Column-stepped: 16-bit rows of odd length, several gather tiles each way.
                      GatherNormCase{DType::BF16, DType::F16, true, 300, 77, 75, 0.9f, {}, true},
                      GatherNormCase{DType::F32, DType::BF16, false, 40, 130, 40, 1.0f, {}, true}));

// ---- apply_update -----------------------------------------------------------------------------
struct UpdCase { DType w; bool with_idx, normuon, cautious; };
class ApplyUpdate : public ct::CudaTest, public ::testing::WithParamInterface<UpdCase> {};

TEST_P(ApplyUpdate, MatchesCpu) {
  const UpdCase c = GetParam();
  std::mt19937_64 rng(9);
  const int64_t n = 4, rows = 50, cols = 96, k = c.with_idx ? 13 : rows;
  SetTwin s(*cpu, *gpu, n, rows, cols, c.w, c.w, DType::F32, rng);
  std::vector<int32_t> idx;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) idx.push_back(static_cast<int32_t>(c.with_idx ? j * 3 + (i % 3) : j));
  dion3::DeviceBuffer didx(gpu->allocator(), idx.size() * 4);
  gpu->copy_from_host(didx.get(), idx.data(), idx.size() * 4);
  Twin O(*gpu, DType::F32, n, k, cols);
  O.fill_normal(rng, 0.05f);
  dion3::UpdateParams p;
  p.decay = 1.0f - 0.02f * 0.1f; p.adjusted_lr = 0.03f; p.normuon = c.normuon; p.beta2 = 0.95f;
  p.cautious_wd = c.cautious;
  cpu->apply_update(*s.hs, c.with_idx ? idx.data() : nullptr, k, O.hview(), p, nullptr);
  gpu->apply_update(*s.ds, c.with_idx ? didx.as<int32_t>() : nullptr, k, O.dview(), p, nullptr);
  EXPECT_LE(ct::rel_max_diff(s.w.device_values(), s.w.host_values()), storage_tol(c.w));
  EXPECT_LE(ct::rel_max_diff(s.v.device_values(), s.v.host_values()), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Cases, ApplyUpdate,
                         ::testing::Values(UpdCase{DType::F32, true, true, false}, UpdCase{DType::F32, false, true, false},
                                           UpdCase{DType::BF16, true, true, false}, UpdCase{DType::F32, false, false, false},
                                           UpdCase{DType::F32, false, false, true}, UpdCase{DType::BF16, false, true, true},
                                           UpdCase{DType::F16, true, false, false}));

// ---- skip flag --------------------------------------------------------------------------------
TEST_F(CudaOps, SkipFlagLeavesEverythingUntouched) {
  std::mt19937_64 rng(3);
  SetTwin s(*cpu, *gpu, 2, 20, 64, DType::BF16, DType::BF16, DType::F32, rng);
  dion3::DeviceBuffer flag(gpu->allocator(), 4), scores(gpu->allocator(), 2 * 20 * 4), idx(gpu->allocator(), 2 * 5 * 4);
  const int one = 1;
  gpu->copy_from_host(flag.get(), &one, 4);
  const auto w0 = s.w.device_values(), m0 = s.m.device_values(), v0 = s.v.device_values();
  Twin out(*gpu, DType::F32, 2, 5, 64);
  out.fill_value(7.0f);
  gpu->accumulate(*s.ds, 0.5f, 1.0f, scores.as<float>(), nullptr, nullptr, flag.as<int>());
  gpu->gather_normalized(*s.ds, nullptr, 20, 0.5f, scores.as<float>(), dion3::NormGuard{}, Twin(*gpu, DType::F32, 2, 20, 64).dview(),
                         flag.as<int>());
  const std::vector<float> sums0 = {-3.0f, -3.0f};
  dion3::DeviceBuffer sums(gpu->allocator(), 2 * 4);
  gpu->copy_from_host(sums.get(), sums0.data(), 2 * 4);
  gpu->select_rows(scores.as<float>(), 2, 20, 5, idx.as<int32_t>(), flag.as<int>(), nullptr, scores.as<float>(),
                   sums.as<float>());
  gpu->gather_rows(*s.ds, nullptr, 20, 1.0f, 0.0f, 0.5f, Twin(*gpu, DType::F32, 2, 20, 64).dview(), nullptr,
                   flag.as<int>());
  dion3::UpdateParams p{1.0f - 0.1f * 0.1f, 0.1f, true, 0.9f, false};
  gpu->apply_update(*s.ds, idx.as<int32_t>(), 5, out.dview(), p, flag.as<int>());
  Twin e(*gpu, DType::BF16, 1, 1, 100), eg(*gpu, DType::BF16, 1, 1, 100), ea(*gpu, DType::F32, 1, 1, 100),
      eb(*gpu, DType::F32, 1, 1, 100);
  e.fill_value(1.0f); eg.fill_value(1.0f); ea.fill_value(0.5f); eb.fill_value(0.5f);
  dion3::ElementwiseParam ep{e.dview(), eg.dview(), ea.dview(), eb.dview()};
  dion3::DeviceBuffer steps(gpu->allocator(), sizeof(int64_t));
  gpu->fill_zero(steps.get(), sizeof(int64_t));
  const dion3::AdamWParams ah{0.1f, 0.9f, 0.95f, 0.1f, 1e-8f, steps.as<int64_t>(), 0};
  const dion3::LionParams lh{0.1f, 0.9f, 0.95f, 0.1f};
  gpu->adamw({&ep, 1}, {&ah, 1}, flag.as<int>());
  gpu->lion({&ep, 1}, {&lh, 1}, flag.as<int>());
  EXPECT_EQ(s.w.device_values(), w0);
  EXPECT_EQ(s.m.device_values(), m0);
  EXPECT_EQ(s.v.device_values(), v0);
  EXPECT_EQ(e.device_values(), e.host_values());
  EXPECT_EQ(ea.device_values(), ea.host_values());
  std::vector<float> sums1(2);
  gpu->copy_to_host(sums1.data(), sums.get(), 2 * 4);
  EXPECT_EQ(sums1, sums0);  // select_rows' sums of squares not written
}

// ---- check_finite -----------------------------------------------------------------------------
TEST_F(CudaOps, CheckFinite) {
  std::mt19937_64 rng(4);
  Twin a(*gpu, DType::F32, 2, 33, 70), b(*gpu, DType::F16, 1, 1, 100000), c(*gpu, DType::BF16, 3, 5, 9);
  a.fill_normal(rng); b.fill_normal(rng); c.fill_normal(rng);
  dion3::DeviceBuffer flag(gpu->allocator(), 4);
  auto run = [&](std::vector<MatrixView> xs) {
    gpu->fill_zero(flag.get(), 4);
    gpu->check_finite(xs, flag.as<int>());
    return gpu->read_flag(flag.as<int>());
  };
  EXPECT_EQ(run({a.dview(), b.dview(), c.dview()}), 0);
  // A NaN outside the view (past cols in a strided view) must not count.
  MatrixView strided = a.dview();
  strided.cols = 60;  // ld stays 70
  std::vector<float> av = a.host_values();
  av[1 * 33 * 70 + 5 * 70 + 65] = NAN;
  a.set_host(av); a.upload();
  EXPECT_EQ(run({strided}), 0);
  EXPECT_EQ(run({a.dview()}), 1);
  std::vector<float> bv = b.host_values();
  bv[99999] = INFINITY;
  b.set_host(bv); b.upload();
  EXPECT_EQ(run({c.dview(), b.dview()}), 1);
  // More views than one launch carries.
  std::vector<MatrixView> many(150, c.dview());
  many.push_back(b.dview());
  EXPECT_EQ(run(many), 1);
  // Contiguous views are read as 16-byte words: a NaN in a middle chunk of a long view, and in
  // the elements after a view's last whole word (135 bf16 = 16 words + 7), still count.
  bv[99999] = 0.5f;
  bv[50001] = NAN;
  b.set_host(bv); b.upload();
  EXPECT_EQ(run({c.dview(), b.dview()}), 1);
  EXPECT_EQ(run(std::vector<MatrixView>(70, c.dview())), 0);
  for (int at : {127, 128, 134}) {
    std::vector<float> cv(135, 1.0f);
    cv[at] = INFINITY;
    c.set_host(cv); c.upload();
    EXPECT_EQ(run({a.dview().at(0), c.dview()}), 1) << at;
  }
}

// ---- check_step ---------------------------------------------------------------------------------
// The flag agrees with the CPU backend's for every rule and dtype pair, with one element set
// just below and just above the overflow edge, anywhere in a view (vectorised and not).
TEST_F(CudaOps, CheckStepAgreesWithCpuAtTheOverflowEdge) {
  std::mt19937_64 rng(9);
  dion3::DeviceBuffer flag(gpu->allocator(), 4);
  dion3::DeviceBuffer hflag(cpu->allocator(), 4);
  using dion3::StepCheck;
  struct Edge {
    StepCheck::Rule rule;
    float a, b;
    float g, m, v;  // the planted element; m and v as stored
    DType state;
    float c = 1.0f;  // the gradient's coefficient (Momentum rule)
  };
  const float big = 3.0e38f;
  const std::vector<Edge> edges = {
      {StepCheck::Momentum, 1.0f, 0.0f, 2e38f, 1.3e38f, 0, DType::F32},   // 3.3e38: fits
      {StepCheck::Momentum, 1.0f, 0.0f, 2e38f, 1.5e38f, 0, DType::F32},   // 3.5e38: overflows
      {StepCheck::Momentum, 0.95f, 0.95f, 1.7e38f, 1.7e38f, 0, DType::F32},  // Nesterov mix overflows
      {StepCheck::Momentum, 1.0f, 0.0f, 3e4f, 3e4f, 0, DType::F16},      // 6e4: fits in fp16
      {StepCheck::Momentum, 1.0f, 0.0f, 3e4f, 3.6e4f, 0, DType::F16},    // 6.6e4: does not
      {StepCheck::Momentum, 1.0f, 0.0f, 2e38f, 1.4e38f, 0, DType::BF16},
      {StepCheck::AdamW, 0.9f, 0.999f, 2e19f, 0, 0, DType::F32},         // g*g would overflow; this not
      {StepCheck::AdamW, 0.9f, 0.999f, 7e20f, 0, 0, DType::F32},
      {StepCheck::AdamW, 0.9f, 0.999f, 2000.0f, 0, 6.5e4f, DType::F16},  // v rounds to Inf
      {StepCheck::Lion, 0.9f, 0.95f, -big, big, 0, DType::F32},
      {StepCheck::Lion, 0.9f, 0.95f, 1.0f, big, 0, DType::F32},
      {StepCheck::Momentum, 1.0f, 0.0f, NAN, 0, 0, DType::F32},
      {StepCheck::Momentum, 1.0f, 0.0f, 2e38f, 1.5e38f, 0, DType::F32, 0.05f},     // fits only by c
      {StepCheck::Momentum, 0.95f, 0.95f, 1.7e38f, 1.7e38f, 0, DType::F32, 0.05f},  // averaged Nesterov: fits
  };
  for (int64_t n : {int64_t{10000}, int64_t{10003}})
    for (DType gdt : {DType::F32, DType::BF16})
      for (const Edge& e : edges)
        for (int64_t at : {int64_t{0}, n / 2 + 1, n - 1}) {
          if (gdt == DType::BF16 && e.state == DType::F16) continue;
          Twin g(*gpu, gdt, 1, 1, n), m(*gpu, e.state, 1, 1, n), v(*gpu, e.state, 1, 1, n);
          std::vector<float> gv = ct::normal_values(rng, n), mv = ct::normal_values(rng, n), vv(n, 0.5f);
          gv[at] = e.g;
          mv[at] = e.m;
          vv[at] = e.v;
          g.set_host(gv), m.set_host(mv), v.set_host(vv);
          g.upload(), m.upload(), v.upload();
          StepCheck dc{e.rule, g.dview(), m.dview(), v.dview(), e.a, e.b, e.c};
          StepCheck hc{e.rule, g.hview(), m.hview(), v.hview(), e.a, e.b, e.c};
          gpu->fill_zero(flag.get(), 4);
          gpu->check_step({&dc, 1}, flag.as<int>());
          cpu->fill_zero(hflag.get(), 4);
          cpu->check_step({&hc, 1}, hflag.as<int>());
          EXPECT_EQ(gpu->read_flag(flag.as<int>()), cpu->read_flag(hflag.as<int>()))
              << "rule " << e.rule << " g " << e.g << " m " << e.m << " n " << n << " at " << at;
        }
  // Many parameters in one call: more than a launch's table, one bad among them.
  std::vector<Twin> gs, ms;
  for (int i = 0; i < 70; ++i) {
    gs.emplace_back(*gpu, DType::BF16, 1, 1, 64 + i);
    ms.emplace_back(*gpu, DType::F32, 1, 1, 64 + i);
  }
  std::vector<StepCheck> cs;
  for (int i = 0; i < 70; ++i) {
    gs[i].fill_normal(rng), ms[i].fill_normal(rng);
    cs.push_back(StepCheck{StepCheck::Momentum, gs[i].dview(), ms[i].dview(), {}, 0.95f, 0.0f});
  }
  gpu->fill_zero(flag.get(), 4);
  gpu->check_step(cs, flag.as<int>());
  EXPECT_EQ(gpu->read_flag(flag.as<int>()), 0);
  std::vector<float> last = ms[66].host_values();
  last[3] = 3.4e38f;
  ms[66].set_host(last), ms[66].upload();
  gs[66].set_host(std::vector<float>(gs[66].numel(), 3e37f)), gs[66].upload();  // 0.95 * 3.4e38 + 3e37 > max
  gpu->fill_zero(flag.get(), 4);
  gpu->check_step(cs, flag.as<int>());
  EXPECT_EQ(gpu->read_flag(flag.as<int>()), 1);
}

// Bounded segments over two launch tables (70 > kStepSegments), known and unknown bounds, 16-byte
// and element-wise segments mixed: each segment is checked by exactly one of the two launches. A
// known bound that wrongly claims a small momentum lets a small gradient pass (so the Unknown
// launch does not read that segment too); an unknown one reads the momentum whole; a gradient past
// a known bound's limit reads it.
TEST_F(CudaOps, BoundedCheckTablesSplitKnownAndUnknownSegments) {
  using dion3::StepCheck;
  std::mt19937_64 rng(23);
  constexpr int kCount = 70;
  std::vector<Twin> gs, ms;
  std::vector<float> bv(kCount);
  for (int i = 0; i < kCount; ++i) {
    const int64_t n = 1000 + 4 * i;  // i even: n % 8 == 0, 16-byte loads
    gs.emplace_back(*gpu, DType::BF16, 1, 1, n);
    ms.emplace_back(*gpu, DType::F32, 1, 1, n);
    gs.back().fill_normal(rng, 1e-3f);
    ms.back().fill_value(0.0f);
    bv[i] = i % 4 < 2 ? 1.0f : 0.0f;  // known (> 0) or unknown
  }
  Twin bounds(*gpu, DType::F32, 1, 1, kCount);
  bounds.set_host(bv);
  bounds.upload();
  std::vector<StepCheck> cs;
  for (int i = 0; i < kCount; ++i) {
    cs.push_back(StepCheck{StepCheck::Momentum, gs[i].dview(), ms[i].dview(), {}, 0.95f, 0.0f});
    cs.back().state_bound = static_cast<const float*>(bounds.dev.get()) + i;
  }
  dion3::DeviceBuffer flag(gpu->allocator(), 4);
  auto refused = [&] {
    gpu->fill_zero(flag.get(), 4);
    gpu->check_step(cs, flag.as<int>());
    return gpu->read_flag(flag.as<int>()) != 0;
  };
  EXPECT_FALSE(refused());
  auto plant = [&](int i, float g) {
    std::vector<float> mv(ms[i].numel(), 0.0f), gv = gs[i].host_values();
    const int64_t at = ms[i].numel() - 3;
    mv[at] = std::numeric_limits<float>::infinity();
    gv[at] = g;
    ms[i].set_host(mv), ms[i].upload();
    gs[i].set_host(gv), gs[i].upload();
  };
  auto clear = [&](int i) { ms[i].fill_value(0.0f); };
  // Both tables, both load widths, both warps' limits, each table's last segment.
  for (int i : {4, 5, 36, 37, 64, 65, 68, 69}) {  // known bounds
    plant(i, 1e-3f);
    EXPECT_FALSE(refused()) << "known segment " << i << ", small gradient";
    plant(i, 1e38f);
    EXPECT_TRUE(refused()) << "known segment " << i << ", gradient past the limit";
    plant(i, 1e-3f);
    clear(i);
  }
  for (int i : {6, 7, 38, 39, 66, 67}) {  // unknown bounds
    plant(i, 1e-3f);
    EXPECT_TRUE(refused()) << "unknown segment " << i;
    clear(i);
  }
  EXPECT_FALSE(refused());
  // Every bound known, then every bound unknown: one of the two launches has no segment.
  plant(38, 1e-3f);
  for (float b : {1.0f, 0.0f}) {
    bounds.set_host(std::vector<float>(kCount, b));
    bounds.upload();
    EXPECT_EQ(refused(), b == 0.0f) << "every bound " << b;
  }
}

// ---- finish_step ------------------------------------------------------------------------------
// The verdict into the counters, as on the CPU: applied steps always count, dropped ones only
// when asked (a step that Optimizer::step() raises counts nowhere).
TEST_F(CudaOps, FinishStepCountsLikeCpu) {
  dion3::DeviceBuffer flag(gpu->allocator(), sizeof(int)), counters(gpu->allocator(), 2 * sizeof(int64_t));
  gpu->fill_zero(counters.get(), 2 * sizeof(int64_t));
  int hflag = 0;
  int64_t hcounters[2] = {0, 0};
  for (int f : {0, 1}) {
    for (bool count_dropped : {true, false}) {
      gpu->copy_from_host(flag.get(), &f, sizeof(int));
      gpu->finish_step(flag.as<int>(), counters.as<int64_t>(), count_dropped);
      hflag = f;
      cpu->finish_step(&hflag, hcounters, count_dropped);
      int64_t got[2] = {-1, -1};
      gpu->copy_to_host(got, counters.get(), sizeof(got));
      EXPECT_EQ(got[0], hcounters[0]) << "flag " << f << " count_dropped " << count_dropped;
      EXPECT_EQ(got[1], hcounters[1]) << "flag " << f << " count_dropped " << count_dropped;
    }
  }
  EXPECT_EQ(hcounters[0], 2);  // two applied
  EXPECT_EQ(hcounters[1], 1);  // one of the two dropped ones counted
  // A step whose ranks planned differently is not a dropped one either.
  const int differ = dion3::kPlansDiffer;
  gpu->copy_from_host(flag.get(), &differ, sizeof(int));
  gpu->finish_step(flag.as<int>(), counters.as<int64_t>(), true);
  int64_t got[2] = {-1, -1};
  gpu->copy_to_host(got, counters.get(), sizeof(got));
  EXPECT_EQ(got[0], 2);
  EXPECT_EQ(got[1], 1);
}

// ---- upload ------------------------------------------------------------------------------------
// Uploads land in stream order without a host synchronisation, each with the values its source
// held when it was called (the source is reused at once), through more uploads than staging
// slots, of growing sizes, and in order with device copies.
TEST_F(CudaOps, UploadsArriveInStreamOrderWithTheirValues) {
  constexpr int kUploads = 11;
  const std::size_t most = 4096;
  dion3::DeviceBuffer dev(gpu->allocator(), kUploads * most * sizeof(int));
  dion3::DeviceBuffer last(gpu->allocator(), most * sizeof(int));
  std::vector<int> src(most);
  std::vector<std::size_t> sizes;
  for (int u = 0; u < kUploads; ++u) {
    const std::size_t n = std::size_t(1) << (u % 13);  // 1 .. 4096 ints: slots grow
    sizes.push_back(std::min(n, most));
    for (std::size_t i = 0; i < sizes.back(); ++i) src[i] = static_cast<int>(u * 100000 + i);
    gpu->upload(dev.as<int>() + u * most, src.data(), sizes.back() * sizeof(int));
    // A device copy after the upload reads what it wrote.
    gpu->copy(last.get(), dev.as<int>() + u * most, sizes.back() * sizeof(int));
    std::fill(src.begin(), src.end(), -1);  // the upload's source may be reused at once
  }
  std::vector<int> got(kUploads * most);
  gpu->copy_to_host(got.data(), dev.get(), got.size() * sizeof(int));
  for (int u = 0; u < kUploads; ++u)
    for (std::size_t i = 0; i < sizes[u]; ++i)
      ASSERT_EQ(got[u * most + i], static_cast<int>(u * 100000 + i)) << "upload " << u << ", int " << i;
  std::vector<int> tail(sizes.back());
  gpu->copy_to_host(tail.data(), last.get(), tail.size() * sizeof(int));
  for (std::size_t i = 0; i < tail.size(); ++i) ASSERT_EQ(tail[i], static_cast<int>((kUploads - 1) * 100000 + i));
}

// ---- settle_agreement ---------------------------------------------------------------------------
// The agreement's regions into the flag, as on the CPU: kPlansDiffer (a plan word) or kHyperDiffer
// (a hyper-parameter word) ORed into the verdict (the first region's) where a digest word and its
// complement do not sum to 0xFFFF in some region.
TEST_F(CudaOps, SettleAgreementLikeCpu) {
  constexpr int W = dion3::kAgreementWords;
  for (int regions : {1, 2}) {
    for (int bad = -1; bad < regions * dion3::kDigestWords; ++bad) {  // -1: every region agrees
      std::vector<int> words(static_cast<std::size_t>(regions * W));
      for (int r = 0; r < regions; ++r) {
        words[r * W] = r == 0 ? 1 : 0;
        words[r * W + 1] = r == 0 ? 1 : 0;
        for (int i = 0; i < dion3::kDigestWords; ++i) {
          const int d = (977 * (r + 1) * (i + 3)) & 0xFFFF;
          words[r * W + 2 + i] = d;
          // Two ranks' maxima: one word and the other's complement larger than its own.
          words[r * W + 2 + dion3::kDigestWords + i] = 0xFFFF - d + (r * dion3::kDigestWords + i == bad ? 5 : 0);
        }
      }
      std::vector<int> want = words;
      cpu->settle_agreement(want.data(), regions);
      dion3::DeviceBuffer dev(gpu->allocator(), words.size() * sizeof(int));
      gpu->copy_from_host(dev.get(), words.data(), words.size() * sizeof(int));
      gpu->settle_agreement(dev.as<int>(), regions);
      std::vector<int> got(words.size());
      gpu->copy_to_host(got.data(), dev.get(), got.size() * sizeof(int));
      EXPECT_EQ(got, want) << regions << " regions, word " << bad << " differs";
      const int differ = bad % dion3::kDigestWords < dion3::kPlanDigestWords ? dion3::kPlansDiffer : dion3::kHyperDiffer;
      EXPECT_EQ(want[0], bad < 0 ? 1 : 1 | differ) << regions << " regions, word " << bad;
      EXPECT_EQ(want[1], 1);
    }
  }
}

// ---- normalize / convert / add_identity -------------------------------------------------------
struct ConvCase { DType in, out; };
class Conversions : public ct::CudaTest, public ::testing::WithParamInterface<ConvCase> {};

TEST_P(Conversions, NormalizeConvertTranspose) {
  const ConvCase c = GetParam();
  std::mt19937_64 rng(21);
  // Widths that are not whole 16-byte packs (element-wise transposes), whole packs that are not
  // whole 64 x 64 tiles (the 16-byte path and its edge tiles), several tiles either way with
  // ragged edges, and rows of in in whole packs while those of its transpose are not
  // (element-wise again). Each shape with another norm guard: the reference's, a floor above the norm, a large
  // eps added.
  for (auto [nb, rows, cols, norm] : {std::tuple{3, 45, 77, dion3::NormGuard{}},
                                      std::tuple{2, 72, 136, dion3::NormGuard{1000.0f, true}},
                                      std::tuple{2, 200, 264, dion3::NormGuard{}},
                                      std::tuple{2, 45, 136, dion3::NormGuard{100.0f, false}}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols));
    Twin x(*gpu, c.in, nb, rows, cols);
    x.fill_normal(rng, 3.0f);
    Twin y(*gpu, c.out, nb, rows, cols), t(*gpu, c.out, nb, cols, rows), z(*gpu, c.out, nb, rows, cols);
    cpu->normalize(x.hview(), y.hview(), norm, nullptr, false);
    gpu->normalize(x.dview(), y.dview(), norm, nullptr, false);
    EXPECT_LE(ct::rel_max_diff(y.device_values(), y.host_values()), storage_tol(c.out));
    // From the rows' sums of squares (gather_rows'): the same result, on both backends.
    Twin ss(*gpu, DType::F32, nb, rows, 1), y2(*gpu, c.out, nb, rows, cols);
    ss.set_host(row_sums_of_squares(x.host_values(), cols));
    ss.upload();
    const float* hss = static_cast<const float*>(ss.hview().data);
    const float* dss = static_cast<const float*>(ss.dview().data);
    cpu->normalize(x.hview(), y2.hview(), norm, hss, false);
    gpu->normalize(x.dview(), y2.dview(), norm, dss, false);
    EXPECT_LE(ct::rel_max_diff(y2.host_values(), y.host_values()), storage_tol(c.out));
    EXPECT_LE(ct::rel_max_diff(y2.device_values(), y.host_values()), storage_tol(c.out));
    // Normalised and transposed in one pass: the transpose of the normalised matrix, exactly on
    // the GPU (the same fp32 product, rounded once).
    Twin yt(*gpu, c.out, nb, cols, rows), yt2(*gpu, c.out, nb, cols, rows);
    cpu->normalize(x.hview(), yt.hview(), norm, nullptr, true);
    gpu->normalize(x.dview(), yt.dview(), norm, nullptr, true);
    gpu->normalize(x.dview(), yt2.dview(), norm, dss, true);
    gpu->convert(y.dview(), t.dview(), true);
    EXPECT_EQ(yt.device_values(), t.device_values());
    EXPECT_LE(ct::rel_max_diff(yt.host_values(), yt.device_values()), storage_tol(c.out));
    EXPECT_LE(ct::rel_max_diff(yt2.device_values(), yt.device_values()), storage_tol(c.out));
    cpu->convert(x.hview(), t.hview(), true);
    gpu->convert(x.dview(), t.dview(), true);
    EXPECT_EQ(t.device_values(), t.host_values());
    cpu->convert(x.hview(), z.hview(), false);
    gpu->convert(x.dview(), z.dview(), false);
    EXPECT_EQ(z.device_values(), z.host_values());
  }
  // A transposed output of the wrong shape is refused.
  Twin x(*gpu, c.in, 1, 8, 16), wrong(*gpu, c.out, 1, 8, 16);
  EXPECT_THROW(gpu->normalize(x.dview(), wrong.dview(), dion3::NormGuard{}, nullptr, true), dion3::Error);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Conversions,
                         ::testing::Values(ConvCase{DType::F32, DType::F32}, ConvCase{DType::F32, DType::F16},
                                           ConvCase{DType::F32, DType::BF16}, ConvCase{DType::BF16, DType::F32},
                                           ConvCase{DType::F16, DType::BF16}),
                         [](const auto& i) { return std::string(dn(i.param.in)) + "_" + dn(i.param.out); });

TEST_F(CudaOps, AddIdentityInPlaceAndOutOfPlace) {
  std::mt19937_64 rng(22);
  Twin x(*gpu, DType::F16, 2, 33, 33), y(*gpu, DType::F16, 2, 33, 33);
  x.fill_normal(rng);
  cpu->add_identity(x.hview(), 2.5f, y.hview());
  gpu->add_identity(x.dview(), 2.5f, y.dview());
  EXPECT_EQ(y.device_values(), y.host_values());
  cpu->add_identity(x.hview(), -1.0f, x.hview());
  gpu->add_identity(x.dview(), -1.0f, x.dview());
  EXPECT_EQ(x.device_values(), x.host_values());
}

// ---- gemm ---------------------------------------------------------------------------------------
struct GemmCase { DType ab, c; bool ta, tb; };
class Gemm : public ct::CudaTest, public ::testing::WithParamInterface<GemmCase> {};

TEST_P(Gemm, MatchesCpu) {
  const GemmCase g = GetParam();
  std::mt19937_64 rng(31);
  const int64_t b = 3, M = 70, N = 90, K = 130;
  Twin A(*gpu, g.ab, b, g.ta ? K : M, g.ta ? M : K), B(*gpu, g.ab, b, g.tb ? N : K, g.tb ? K : N);
  Twin C(*gpu, g.c, b, M, N);
  A.fill_normal(rng); B.fill_normal(rng); C.fill_normal(rng);
  cpu->gemm(g.ta, g.tb, 0.7f, A.hview(), B.hview(), -0.3f, C.hview());
  gpu->gemm(g.ta, g.tb, 0.7f, A.dview(), B.dview(), -0.3f, C.dview());
  const double tol = g.c == DType::F32 ? 1e-5 : 2.0 * ct::ulp_of(g.c);
  EXPECT_LE(ct::rel_max_diff(C.device_values(), C.host_values()), tol);
}

INSTANTIATE_TEST_SUITE_P(Cases, Gemm,
                         ::testing::Values(GemmCase{DType::F32, DType::F32, false, false},
                                           GemmCase{DType::F32, DType::F32, true, false},
                                           GemmCase{DType::F32, DType::F32, false, true},
                                           GemmCase{DType::F32, DType::F32, true, true},
                                           GemmCase{DType::F16, DType::F16, false, false},
                                           GemmCase{DType::BF16, DType::BF16, false, true},
                                           GemmCase{DType::F16, DType::F32, true, false}));

// ---- gram / sym_product: full GEMM and lower-triangle tile schedules ---------------------------
// tile 0: full GEMM; kernel: the fused sm_90a kernel where it supports the operands (else the
// automatic path), otherwise the tile schedule on cuBLAS; pairs: the kernel's CTA pairs (one CTA
// per tile when false).
struct SymCase { DType dt; int64_t p, q, tile; bool kernel = false; bool pairs = true; };
class Symmetric : public ct::CudaTest, public ::testing::WithParamInterface<SymCase> {};

bool exactly_symmetric(const std::vector<float>& v, int64_t batch, int64_t p) {
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < p; ++r)
      for (int64_t c = 0; c < r; ++c)
        if (v[b * p * p + r * p + c] != v[b * p * p + c * p + r]) return false;
  return true;
}

TEST_P(Symmetric, GramAndSymProductMatchCpu) {
  const SymCase c = GetParam();
  dion3::cuda::set_symmetric_options(*gpu, {c.tile > 0 || c.kernel, c.tile, c.kernel, c.pairs});
  std::mt19937_64 rng(41 + c.p);
  const int64_t b = 3;
  Twin X(*gpu, c.dt, b, c.p, c.q), R(*gpu, c.dt, b, c.p, c.p);
  X.fill_normal(rng, 1.0f / std::sqrt(static_cast<float>(c.q)));
  cpu->gram(X.hview(), R.hview(), false);
  gpu->gram(X.dview(), R.dview(), false);
  const double tol = c.dt == DType::F32 ? 1e-5 : 2.0 * ct::ulp_of(c.dt);
  const auto Rd = R.device_values();
  EXPECT_LE(ct::rel_max_diff(Rd, R.host_values()), tol);
  EXPECT_TRUE(exactly_symmetric(Rd, b, c.p));
  // From here both sides start from the same (CPU) R.
  R.upload();
  // Z = b R + c R^2 (D aliases neither), then Q = Q Z + a Q with gamma, then D == C aliasing.
  Twin Z(*gpu, c.dt, b, c.p, c.p), Q(*gpu, c.dt, b, c.p, c.p);
  MatrixView Rh = R.hview(), Rdv = R.dview();
  cpu->sym_product(2.0f, R.hview(), R.hview(), -1.5f, &Rh, 0.0f, Z.hview(), false, false);
  gpu->sym_product(2.0f, R.dview(), R.dview(), -1.5f, &Rdv, 0.0f, Z.dview(), false, false);
  auto Zd = Z.device_values();
  EXPECT_LE(ct::rel_max_diff(Zd, Z.host_values()), 2 * tol);
  EXPECT_TRUE(exactly_symmetric(Zd, b, c.p));
  Z.upload();
  cpu->sym_product(1.0f, R.hview(), Z.hview(), 0.0f, nullptr, 3.0f, Q.hview(), false, false);
  gpu->sym_product(1.0f, R.dview(), Z.dview(), 0.0f, nullptr, 3.0f, Q.dview(), false, false);
  auto Qd = Q.device_values();
  EXPECT_LE(ct::rel_max_diff(Qd, Q.host_values()), 2 * tol);
  EXPECT_TRUE(exactly_symmetric(Qd, b, c.p));
  Q.upload();
  MatrixView Qh = Q.hview(), Qdv = Q.dview();
  cpu->sym_product(0.5f, R.hview(), Z.hview(), 0.25f, &Qh, 1.0f, Q.hview(), false, false);
  gpu->sym_product(0.5f, R.dview(), Z.dview(), 0.25f, &Qdv, 1.0f, Q.dview(), false, false);
  EXPECT_LE(ct::rel_max_diff(Q.device_values(), Q.host_values()), 2 * tol);
  // A general B: the product is A·Bᵀ on both backends (Gram's update after a restart passes
  // B = W·R for W·R·W), its lower triangle mirrored.
  Twin G(*gpu, c.dt, b, c.p, c.p), S(*gpu, c.dt, b, c.p, c.p);
  G.fill_normal(rng, 1.0f / std::sqrt(static_cast<float>(c.p)));
  cpu->sym_product(1.0f, Z.hview(), G.hview(), 0.0f, nullptr, 0.0f, S.hview(), false, false);
  gpu->sym_product(1.0f, Z.dview(), G.dview(), 0.0f, nullptr, 0.0f, S.dview(), false, false);
  const auto Sd = S.device_values();
  EXPECT_LE(ct::rel_max_diff(Sd, S.host_values()), 2 * tol);
  EXPECT_TRUE(exactly_symmetric(Sd, b, c.p));
}

INSTANTIATE_TEST_SUITE_P(Cases, Symmetric,
                         ::testing::Values(SymCase{DType::F32, 96, 200, 0}, SymCase{DType::F32, 200, 300, 64},
                                           SymCase{DType::F32, 256, 300, 64}, SymCase{DType::F16, 256, 512, 64},
                                           SymCase{DType::BF16, 200, 512, 48}, SymCase{DType::F16, 130, 260, 128},
                                           SymCase{DType::F16, 512, 1024, 128},
                                           // fused kernel: ragged p and q, k below one k-block, several
                                           // tile rows; q = 300 (rows not 16-byte aligned) falls back
                                           SymCase{DType::F16, 200, 520, 0, true}, SymCase{DType::BF16, 200, 520, 0, true},
                                           SymCase{DType::F16, 520, 1000, 0, true}, SymCase{DType::BF16, 384, 40, 0, true},
                                           SymCase{DType::BF16, 1000, 64, 0, true}, SymCase{DType::F16, 96, 300, 0, true},
                                           // one CTA per tile; an odd count of 128-row blocks (a pair's
                                           // second CTA without rows)
                                           SymCase{DType::F16, 520, 1000, 0, true, false},
                                           SymCase{DType::BF16, 384, 40, 0, true, false},
                                           SymCase{DType::F16, 640, 200, 0, true}),
                         [](const auto& i) {
                           return std::string(dn(i.param.dt)) + "_p" + std::to_string(i.param.p) + "_t" +
                                  std::to_string(i.param.tile) + (i.param.kernel ? "_kernel" : "") +
                                  (i.param.kernel && !i.param.pairs ? "_single" : "");
                         });

// ---- banded symmetric products (the fused kernel) ---------------------------------------------
// The chain gram -> W = 2R² - 1.5R + 0.5I -> S = R W -> Q = W S + 3I run twice on the GPU: with
// full intermediates, and with banded ones (lower triangle + diagonal 256 x 256 blocks; the upper
// blocks read transposed) and a full Q. The stored parts must agree with the full run exactly
// (same products, same order), and Q everywhere.
struct BandCase { DType dt; int64_t p, q; };
class Banded : public ct::CudaTest, public ::testing::WithParamInterface<BandCase> {};

TEST_P(Banded, ChainMatchesFull) {
  const BandCase c = GetParam();
  if (!gpu->symmetric_banded(c.dt, c.p)) GTEST_SKIP() << "no fused sm_90a kernel here";
  std::mt19937_64 rng(77 + c.p);
  const int64_t b = 2, p = c.p;
  Twin X(*gpu, c.dt, b, p, c.q);
  X.fill_normal(rng, 1.0f / std::sqrt(static_cast<float>(c.q)));
  std::vector<float> full[4], band[4];
  for (int banded = 0; banded < 2; ++banded) {
    Twin R(*gpu, c.dt, b, p, p), W(*gpu, c.dt, b, p, p), S(*gpu, c.dt, b, p, p), Q(*gpu, c.dt, b, p, p);
    for (Twin* t : {&R, &W, &S, &Q}) {  // poison: a banded run must not read what it did not store
      t->fill_value(std::numeric_limits<float>::quiet_NaN());
      t->upload();
    }
    const bool bd = banded == 1;
    MatrixView Rd = R.dview();
    gpu->gram(X.dview(), R.dview(), bd);
    gpu->sym_product(2.0f, R.dview(), R.dview(), -1.5f, &Rd, 0.5f, W.dview(), bd, bd);
    gpu->sym_product(1.0f, R.dview(), W.dview(), 0.0f, nullptr, 0.0f, S.dview(), bd, bd);
    gpu->sym_product(1.0f, W.dview(), S.dview(), 0.0f, nullptr, 3.0f, Q.dview(), bd, false);
    std::vector<float>* out = bd ? band : full;
    out[0] = R.device_values();
    out[1] = W.device_values();
    out[2] = S.device_values();
    out[3] = Q.device_values();
  }
  const int64_t band_w = 256;  // kSymBand (src/cuda/kernels.cuh)
  for (int m = 0; m < 4; ++m) {
    int64_t bad = 0;
    for (int64_t i = 0; i < b; ++i)
      for (int64_t r = 0; r < p; ++r)
        for (int64_t col = 0; col < p; ++col) {
          const bool stored = m == 3 || col <= r || col / band_w == r / band_w;
          const std::size_t e = static_cast<std::size_t>((i * p + r) * p + col);
          if (stored && full[m][e] != band[m][e]) ++bad;
        }
    EXPECT_EQ(bad, 0) << "matrix " << m << " (R, W, S, Q)";
  }
  EXPECT_TRUE(exactly_symmetric(band[3], b, p));
}

INSTANTIATE_TEST_SUITE_P(Cases, Banded,
                         ::testing::Values(BandCase{DType::F16, 520, 1000}, BandCase{DType::BF16, 1000, 64},
                                           BandCase{DType::F16, 1376, 512}, BandCase{DType::BF16, 2048, 2048},
                                           BandCase{DType::F16, 264, 300}),
                         [](const auto& i) { return std::string(dn(i.param.dt)) + "_p" + std::to_string(i.param.p); });

// ---- the FLOPs a roofline floor counts ---------------------------------------------------------
// Each consumer warpgroup's 64-row block multiplies only the 64-column blocks on or below its
// diagonal: all of p = 64, 1 + 2 of 4 blocks at p = 128, (1 + ... + 8) of 64 at p = 512; at a
// ragged p the last block's rows past p are computed too (p = 200: 1 + 2 + 3 + 4 blocks).
TEST_F(CudaOps, FusedKernelFlopFractionCountsEachWarpgroupsBlocks) {
  if (!gpu->symmetric_banded(DType::F16, 512)) GTEST_SKIP() << "no fused sm_90a kernel here";
  dion3::cuda::set_symmetric_options(*gpu, {});
  for (auto [p, f] : {std::pair{int64_t{64}, 1.0}, std::pair{int64_t{128}, 0.75}, std::pair{int64_t{512}, 36.0 / 64},
                      std::pair{int64_t{200}, 10.0 * 4096 / (200.0 * 200)}, std::pair{int64_t{4096}, 2080.0 / 4096}})
    EXPECT_NEAR(dion3::cuda::symmetric_flop_fraction(*gpu, p), f, 1e-12) << "p = " << p;
}

// ---- the fused kernel's CTA pairs ----------------------------------------------------------------
// Clusters of two CTAs sharing B's loads compute every tile as one CTA does alone, k-block by
// k-block: the same bits, full and banded, on ragged sizes and an odd count of 128-row blocks.
TEST_F(CudaOps, CtaPairsGiveTheSameBitsAsOneCtaPerTile) {
  for (auto [dt, p, q] : {std::tuple{DType::F16, int64_t{520}, int64_t{1000}}, std::tuple{DType::BF16, int64_t{640}, int64_t{72}},
                          std::tuple{DType::F16, int64_t{1376}, int64_t{512}}}) {
    if (!gpu->symmetric_banded(dt, p)) GTEST_SKIP() << "no fused sm_90a kernel here";
    std::mt19937_64 rng(5 + p);
    const int64_t b = 3;
    Twin X(*gpu, dt, b, p, q);
    X.fill_normal(rng, 1.0f / std::sqrt(static_cast<float>(q)));
    for (int banded = 0; banded < 2; ++banded) {
      const bool bd = banded == 1;
      std::vector<float> out[2][3];
      for (int pairs = 0; pairs < 2; ++pairs) {
        dion3::cuda::set_symmetric_options(*gpu, {true, 0, true, pairs == 1});
        Twin R(*gpu, dt, b, p, p), W(*gpu, dt, b, p, p), Q(*gpu, dt, b, p, p);
        for (Twin* t : {&R, &W, &Q}) {
          t->fill_value(0.0f);
          t->upload();
        }
        MatrixView Rd = R.dview();
        gpu->gram(X.dview(), R.dview(), bd);
        gpu->sym_product(2.0f, R.dview(), R.dview(), -1.5f, &Rd, 0.5f, W.dview(), bd, bd);
        gpu->sym_product(1.0f, W.dview(), R.dview(), 0.0f, nullptr, 3.0f, Q.dview(), bd, false);
        out[pairs][0] = R.device_values();
        out[pairs][1] = W.device_values();
        out[pairs][2] = Q.device_values();
      }
      for (int m = 0; m < 3; ++m)
        EXPECT_EQ(out[1][m], out[0][m]) << dn(dt) << " p " << p << (bd ? " banded" : "") << ", product " << m;
    }
  }
  dion3::cuda::set_symmetric_options(*gpu, {});
}

// ---- the products on fewer multiprocessors ----------------------------------------------------
// set_product_sm_limit caps the fused kernel's persistent grid and cuBLAS's SM target so that
// other streams keep the rest. The fused kernel computes the same tiles in the same order (the
// same bits); cuBLAS may pick another kernel for its target (close results).
TEST_F(CudaOps, ProductsOnFewerMultiprocessorsGiveTheSameBits) {
  std::mt19937_64 rng(31);
  const int64_t b = 3, p = 520, q = 700;
  Twin X(*gpu, DType::F16, b, p, q), R(*gpu, DType::F16, b, p, p), W(*gpu, DType::F16, b, p, p),
      O(*gpu, DType::F16, b, p, q);
  X.fill_normal(rng, 1.0f / std::sqrt(static_cast<float>(q)));
  std::vector<float> out[2][3];
  for (int limited = 0; limited < 2; ++limited) {
    dion3::cuda::set_product_sm_limit(*gpu, limited ? 7 : 0);
    EXPECT_EQ(dion3::cuda::product_sm_limit(*gpu), limited ? 7 : 0);
    MatrixView Rd = R.dview();
    gpu->gram(X.dview(), R.dview(), false);
    gpu->sym_product(2.0f, R.dview(), R.dview(), -1.5f, &Rd, 0.5f, W.dview(), false, false);
    gpu->gemm(false, false, 1.0f, W.dview(), X.dview(), 0.0f, O.dview());
    out[limited][0] = R.device_values();
    out[limited][1] = W.device_values();
    out[limited][2] = O.device_values();
  }
  const bool fused = gpu->symmetric_banded(DType::F16, p);
  for (int m = 0; m < 2; ++m) {
    if (fused) EXPECT_TRUE(out[0][m] == out[1][m]) << "product " << m << " (R, W)";
    else EXPECT_LT(ct::rel_fro_diff(out[0][m], out[1][m]), 1e-3) << "product " << m << " (R, W)";
  }
  EXPECT_LT(ct::rel_fro_diff(out[0][2], out[1][2]), 1e-3);
  EXPECT_THROW(dion3::cuda::set_product_sm_limit(*gpu, -1), dion3::Error);
  dion3::cuda::set_product_sm_limit(*gpu, 0);
}

// ---- AdamW / Lion -------------------------------------------------------------------------------
struct EwCase { DType w, s; int64_t n = 10008; };  // n % 4 == 0: vectorised AdamW and Lion
class Elementwise : public ct::CudaTest, public ::testing::WithParamInterface<EwCase> {};

TEST_P(Elementwise, AdamWAndLionMatchCpu) {
  const EwCase c = GetParam();
  std::mt19937_64 rng(51);
  const int64_t n = c.n;
  Twin w(*gpu, c.w, 1, 1, n), g(*gpu, c.w, 1, 1, n), m(*gpu, c.s, 1, 1, n), v(*gpu, c.s, 1, 1, n);
  w.fill_normal(rng); g.fill_normal(rng); m.fill_normal(rng, 0.1f);
  std::vector<float> vv = ct::normal_values(rng, n, 0.1f);
  for (auto& x : vv) x *= x;
  v.set_host(vv); v.upload();
  // AdamW's state bounds: the largest |exp_avg| and exp_avg_sq each backend stored.
  float hbounds[2] = {0.0f, 0.0f};
  Twin dbounds(*gpu, DType::F32, 1, 1, 2);
  dbounds.set_host({0.0f, 0.0f});
  dbounds.upload();
  dion3::ElementwiseParam hp{w.hview(), g.hview(), m.hview(), v.hview(), hbounds};
  dion3::ElementwiseParam dp{w.dview(), g.dview(), m.dview(), v.dview(), static_cast<float*>(dbounds.dview().data)};
  // Bias correction reads the applied-step counter where the backend runs: t = 2 - 0 + 1 = 3.
  const int64_t host_steps = 2;
  dion3::DeviceBuffer dev_steps(gpu->allocator(), sizeof(int64_t));
  gpu->copy_from_host(dev_steps.get(), &host_steps, sizeof(int64_t));
  const dion3::AdamWParams ah{0.01f, 0.9f, 0.95f, 0.1f, 1e-8f, &host_steps, 0};
  dion3::AdamWParams ad = ah;
  ad.applied_steps = dev_steps.as<int64_t>();
  cpu->adamw({&hp, 1}, {&ah, 1}, nullptr);
  gpu->adamw({&dp, 1}, {&ad, 1}, nullptr);
  const double tw = storage_tol(c.w), ts = storage_tol(c.s);
  EXPECT_LE(ct::rel_max_diff(w.device_values(), w.host_values()), tw);
  EXPECT_LE(ct::rel_max_diff(m.device_values(), m.host_values()), ts);
  EXPECT_LE(ct::rel_max_diff(v.device_values(), v.host_values()), ts);
  {
    const std::vector<float> dm = m.device_values(), dv = v.device_values(), db = dbounds.device_values();
    float bm = 0.0f, bv = 0.0f;
    for (std::size_t i = 0; i < dm.size(); ++i) bm = std::max(bm, std::fabs(dm[i])), bv = std::max(bv, dv[i]);
    EXPECT_EQ(db[0], bm);
    EXPECT_EQ(db[1], bv);
    EXPECT_NEAR(db[0], hbounds[0], ts * hbounds[0]);
    EXPECT_NEAR(db[1], hbounds[1], ts * hbounds[1]);
  }
  w.upload(); m.upload();
  // Lion's state bound (one float): the largest |exp_avg| each backend stored.
  hbounds[0] = 0.0f;
  dbounds.set_host({0.0f, 0.0f});
  dbounds.upload();
  const dion3::LionParams lh{0.01f, 0.9f, 0.99f, 0.1f};
  cpu->lion({&hp, 1}, {&lh, 1}, nullptr);
  gpu->lion({&dp, 1}, {&lh, 1}, nullptr);
  EXPECT_LE(ct::rel_max_diff(w.device_values(), w.host_values()), tw);
  EXPECT_LE(ct::rel_max_diff(m.device_values(), m.host_values()), ts);
  const std::vector<float> dm = m.device_values(), db = dbounds.device_values();
  float bm = 0.0f;
  for (float x : dm) bm = std::max(bm, std::fabs(x));
  EXPECT_EQ(db[0], bm);
  EXPECT_EQ(db[1], 0.0f);
  EXPECT_NEAR(db[0], hbounds[0], ts * hbounds[0]);
}

// The CUDA check, like the CPU's, leaves AdamW's and Lion's moments unread where the gradient is
// below the bounds' limit: bounds that wrongly claim a small state (it holds an Inf) let small
// gradients pass; a gradient past the limit, or no bounds, reads the state and refuses. Packed
// (n % 8 == 0) and element-wise segments.
TEST_F(CudaOps, ElementwiseBoundsLetTheCheckSkipTheMoments) {
  for (auto rule : {dion3::StepCheck::AdamW, dion3::StepCheck::Lion})
  for (int64_t n : {4000, 4003}) {
    const std::string what = std::string(rule == dion3::StepCheck::AdamW ? "AdamW " : "Lion ") + std::to_string(n);
    Twin g(*gpu, DType::BF16, 1, 1, n), m(*gpu, DType::BF16, 1, 1, n), v(*gpu, DType::BF16, 1, 1, n),
        bounds(*gpu, DType::F32, 1, 1, 2), unknown(*gpu, DType::F32, 1, 1, 2);
    std::vector<float> gv(n, 1e-3f), mv(n, 0.0f);
    mv[1717] = std::numeric_limits<float>::infinity();
    g.set_host(gv); g.upload();
    m.set_host(mv); m.upload();
    v.fill_value(1.0f);
    bounds.set_host({1.0f, 1.0f}); bounds.upload();
    unknown.set_host({0.0f, 1.0f}); unknown.upload();
    dion3::StepCheck c;
    c.rule = rule;
    c.grad = g.dview();
    c.state = m.dview();
    if (rule == dion3::StepCheck::AdamW) c.state2 = v.dview();
    c.a = 0.9f;
    c.b = rule == dion3::StepCheck::AdamW ? 0.95f : 0.99f;
    dion3::DeviceBuffer flag(gpu->allocator(), sizeof(int));
    auto refused = [&](const void* b) {
      c.state_bound = static_cast<const float*>(b);
      gpu->fill_zero(flag.get(), sizeof(int));
      gpu->check_step({&c, 1}, flag.as<int>());
      int f = 0;
      gpu->copy_to_host(&f, flag.get(), sizeof(int));
      return f != 0;
    };
    EXPECT_FALSE(refused(bounds.dev.get())) << what;
    EXPECT_TRUE(refused(nullptr)) << what;
    EXPECT_TRUE(refused(unknown.dev.get())) << what;
    // Past the limit, the new moments of a finite state still finite: only the state read refuses it.
    gv[1717] = rule == dion3::StepCheck::AdamW ? 6e19f : 1e38f;
    g.set_host(gv); g.upload();
    EXPECT_TRUE(refused(bounds.dev.get())) << what;
  }
}

// Many parameters in one call: two dtype combinations, sizes from 1 element to past the large
// tables' threshold (2^20 - 1 just under it; 2^20 up to 2^21 - 1 one size class, 2^21 the next;
// one size element-wise), more small parameters of one dtype than one launch's table holds (32),
// each with its own hyperparameters, step offset and state bounds; CPU and CUDA must agree on
// every one. Weights are small (0.01) so that a bf16 weight shows a step of lr: one parameter's
// learning rate applied to another, or a weight left unwritten, cannot hide in the rounding.
TEST_F(CudaOps, MultiTensorAdamWAndLionMatchCpu) {
  std::mt19937_64 rng(77);
  const int64_t sizes[] = {1,    3,    4,    5,    64,   130,  4096, 10007, (int64_t{1} << 20) + 4, (int64_t{1} << 20) + 3,
                           (int64_t{1} << 21) - 4, (int64_t{1} << 20) - 1, int64_t{1} << 20, int64_t{1} << 21};
  constexpr int kSizes = sizeof(sizes) / sizeof(sizes[0]);
  constexpr int kParams = 100;  // about 45 small bf16 parameters: more than one table of them
  struct Param { std::unique_ptr<Twin> w, g, m, v; };
  std::vector<Param> params;
  std::vector<dion3::ElementwiseParam> hp, dp;
  std::vector<dion3::AdamWParams> ah, ad;
  std::vector<dion3::LionParams> lh;
  // Two state bounds a parameter (AdamW's two; Lion raises the first only), on each side.
  std::vector<float> hbounds(2 * kParams, 0.0f);
  Twin dbounds(*gpu, DType::F32, 1, 1, 2 * kParams);
  dbounds.fill_value(0.0f);
  const int64_t host_steps = 4;
  dion3::DeviceBuffer dev_steps(gpu->allocator(), sizeof(int64_t));
  gpu->copy_from_host(dev_steps.get(), &host_steps, sizeof(int64_t));
  for (int i = 0; i < kParams; ++i) {
    const int64_t n = sizes[i % kSizes];
    const DType wd = i % 3 ? DType::BF16 : DType::F32, sd = wd;
    Param p{std::make_unique<Twin>(*gpu, wd, 1, 1, n), std::make_unique<Twin>(*gpu, wd, 1, 1, n),
            std::make_unique<Twin>(*gpu, sd, 1, 1, n), std::make_unique<Twin>(*gpu, sd, 1, 1, n)};
    p.w->fill_normal(rng, 0.01f);
    p.g->fill_normal(rng);
    p.m->fill_normal(rng, 0.1f);
    // Second moments away from zero: no element's step dwarfs the rest and, through the
    // tolerance (relative to the largest weight), hides a wrong learning rate on them.
    std::vector<float> vv = ct::normal_values(rng, n, 0.1f);
    for (auto& x : vv) x = 0.01f + x * x;
    p.v->set_host(vv);
    p.v->upload();
    float* db = static_cast<float*>(dbounds.dview().data) + 2 * i;
    hp.push_back({p.w->hview(), p.g->hview(), p.m->hview(), p.v->hview(), hbounds.data() + 2 * i});
    dp.push_back({p.w->dview(), p.g->dview(), p.m->dview(), p.v->dview(), db});
    // Every hyperparameter varies within a launch's table, apart from the dtype (i % 3), so that one
    // parameter's values applied to another show; weight decay large enough to move a bf16 weight.
    const float lr = 0.001f * (1 + i % 7), wdk = 1.0f * (i % 5), b1 = 0.9f - 0.05f * (i % 2);
    ah.push_back({lr, b1, 0.95f - 0.01f * (i % 4), wdk, 1e-8f, &host_steps, (i / 3) % 3});
    ad.push_back(ah.back());
    ad.back().applied_steps = dev_steps.as<int64_t>();
    lh.push_back({lr, b1, 0.99f - 0.01f * ((i / 2) % 2), wdk});
    params.push_back(std::move(p));
  }
  // Each parameter's bounds: exactly the largest |exp_avg| and exp_avg_sq the device stored, and
  // near the CPU's (lion: the second left alone).
  auto check_bounds = [&](bool lion) {
    const std::vector<float> db = dbounds.device_values();
    for (int i = 0; i < kParams; ++i) {
      const Param& p = params[i];
      const std::vector<float> dm = p.m->device_values(), dv = lion ? std::vector<float>{} : p.v->device_values();
      float bm = 0.0f, bv = 0.0f;
      for (float x : dm) bm = std::max(bm, std::fabs(x));
      for (float x : dv) bv = std::max(bv, x);
      const double ts = storage_tol(p.m->dtype);
      EXPECT_EQ(db[2 * i], bm) << "parameter " << i << " of " << p.w->cols;
      EXPECT_NEAR(db[2 * i], hbounds[2 * i], ts * hbounds[2 * i]) << "parameter " << i;
      if (lion) {
        EXPECT_EQ(db[2 * i + 1], 0.0f) << "parameter " << i;
      } else {
        EXPECT_EQ(db[2 * i + 1], bv) << "parameter " << i << " of " << p.w->cols;
        EXPECT_NEAR(db[2 * i + 1], hbounds[2 * i + 1], ts * hbounds[2 * i + 1]) << "parameter " << i;
      }
    }
  };
  cpu->adamw(hp, ah, nullptr);
  gpu->adamw(dp, ad, nullptr);
  for (const Param& p : params) {
    ASSERT_LE(ct::rel_max_diff(p.w->device_values(), p.w->host_values()), storage_tol(p.w->dtype)) << p.w->cols;
    ASSERT_LE(ct::rel_max_diff(p.m->device_values(), p.m->host_values()), storage_tol(p.m->dtype)) << p.w->cols;
    ASSERT_LE(ct::rel_max_diff(p.v->device_values(), p.v->host_values()), storage_tol(p.v->dtype)) << p.w->cols;
  }
  check_bounds(false);
  for (const Param& p : params) {
    p.w->upload();  // both backends go on from the CPU's values
    p.m->upload();
  }
  std::fill(hbounds.begin(), hbounds.end(), 0.0f);
  dbounds.fill_value(0.0f);
  cpu->lion(hp, lh, nullptr);
  gpu->lion(dp, lh, nullptr);
  for (int i = 0; i < kParams; ++i) {
    const Param& p = params[i];
    ASSERT_LE(ct::rel_max_diff(p.m->device_values(), p.m->host_values()), storage_tol(p.m->dtype)) << p.w->cols;
    // Lion moves a weight by lr times a sign: where the direction is within rounding of zero the
    // two backends may take opposite signs (a step of 2·lr apart). One such element in 100000 is
    // rounding (none in a small parameter); a wrong learning rate or an unwritten weight moves
    // most of them.
    const std::vector<float> dw = p.w->device_values(), hw = p.w->host_values();
    float most = 0.0f;
    for (float x : hw) most = std::max(most, std::fabs(x));
    const double tol = storage_tol(p.w->dtype) * most, flip = 2.0 * lh[i].lr + tol;
    int64_t off = 0;
    for (std::size_t e = 0; e < dw.size(); ++e) {
      const double d = std::fabs(static_cast<double>(dw[e]) - hw[e]);
      ASSERT_LE(d, flip) << "parameter " << i << " element " << e;
      off += d > tol;
    }
    EXPECT_LE(off, static_cast<int64_t>(dw.size() / 100000)) << "parameter " << i << " of " << p.w->cols;
  }
  check_bounds(true);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Elementwise,
                         ::testing::Values(EwCase{DType::F32, DType::F32, 10007}, EwCase{DType::BF16, DType::F32},
                                           EwCase{DType::BF16, DType::BF16}, EwCase{DType::F16, DType::F16, 10007},
                                           EwCase{DType::F16, DType::F16}),
                         [](const auto& i) { return std::string(dn(i.param.w)) + "_" + dn(i.param.s) + "_" + std::to_string(i.param.n); });

}  // namespace

// ---- large shapes: 16-byte vector paths, unaligned rows, ragged tails, multi-step row search ----
namespace {
struct BigUpd { DType w, o; int64_t rows, cols, k; bool normuon, cautious; };
class ApplyUpdateBig : public ct::CudaTest, public ::testing::WithParamInterface<BigUpd> {};
TEST_P(ApplyUpdateBig, MatchesCpu) {
  const BigUpd c = GetParam();
  std::mt19937_64 rng(19);
  const int64_t n = 3;
  SetTwin s(*cpu, *gpu, n, c.rows, c.cols, c.w, c.w, DType::F32, rng);
  const std::vector<int32_t> idx = random_row_sets(n, c.rows, c.k, rng);
  dion3::DeviceBuffer didx(gpu->allocator(), idx.size() * 4);
  gpu->copy_from_host(didx.get(), idx.data(), idx.size() * 4);
  Twin O(*gpu, c.o, n, c.k, c.cols);
  O.fill_normal(rng, 0.05f);
  dion3::UpdateParams p;
  p.decay = 1.0f - 0.02f * 0.1f; p.adjusted_lr = 0.03f; p.normuon = c.normuon; p.beta2 = 0.95f;
  p.cautious_wd = c.cautious;
  cpu->apply_update(*s.hs, idx.data(), c.k, O.hview(), p, nullptr);
  gpu->apply_update(*s.ds, didx.as<int32_t>(), c.k, O.dview(), p, nullptr);
  EXPECT_LE(ct::rel_max_diff(s.w.device_values(), s.w.host_values()), storage_tol(c.w));
  EXPECT_LE(ct::rel_max_diff(s.v.device_values(), s.v.host_values()), 1e-5);
}
INSTANTIATE_TEST_SUITE_P(Cases, ApplyUpdateBig,
                         ::testing::Values(BigUpd{DType::BF16, DType::F32, 300, 4100, 100, true, false},
                                           BigUpd{DType::BF16, DType::F16, 1500, 37, 1100, true, false},
                                           BigUpd{DType::F32, DType::F16, 700, 4097, 33, false, true},
                                           BigUpd{DType::F16, DType::BF16, 2000, 1032, 1999, true, true},
                                           BigUpd{DType::BF16, DType::F16, 4096, 264, 1024, true, false}));

struct BigGather { DType m, out; int64_t rows, cols, k; float sm, sg, decay; };
class GatherBig : public ct::CudaTest, public ::testing::WithParamInterface<BigGather> {};
TEST_P(GatherBig, MatchesCpu) {
  const BigGather c = GetParam();
  std::mt19937_64 rng(23);
  const int64_t n = 3;
  SetTwin s(*cpu, *gpu, n, c.rows, c.cols, DType::F32, DType::BF16, c.m, rng);
  const std::vector<int32_t> idx = random_row_sets(n, c.rows, c.k, rng);
  dion3::DeviceBuffer didx(gpu->allocator(), idx.size() * 4);
  gpu->copy_from_host(didx.get(), idx.data(), idx.size() * 4);
  Twin out(*gpu, c.out, n, c.k, c.cols), ss(*gpu, DType::F32, n, c.k, 1);
  ss.fill_value(-1.0f);
  cpu->gather_rows(*s.hs, idx.data(), c.k, c.sm, c.sg, c.decay, out.hview(), nullptr, nullptr);
  gpu->gather_rows(*s.ds, didx.as<int32_t>(), c.k, c.sm, c.sg, c.decay, out.dview(),
                   static_cast<float*>(ss.dview().data), nullptr);
  EXPECT_LE(ct::rel_max_diff(out.device_values(), out.host_values()), storage_tol(c.out));
  EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(c.m));
  EXPECT_LE(ct::rel_max_diff(ss.device_values(), row_sums_of_squares(out.device_values(), c.cols)), 1e-5);
}
INSTANTIATE_TEST_SUITE_P(Cases, GatherBig,
                         ::testing::Values(BigGather{DType::BF16, DType::F32, 200, 4100, 77, 1.0f, 0.0f, 0.95f},
                                           BigGather{DType::BF16, DType::F16, 200, 4097, 50, 0.9f, 1.0f, 1.0f},
                                           BigGather{DType::F32, DType::BF16, 100, 1030, 40, 0.9f, 1.0f, 0.9f},
                                           BigGather{DType::F16, DType::F32, 100, 2048, 99, 1.0f, 0.0f, 0.5f}));

struct BigIdent { DType x, c; int64_t b, p; };
class AddIdentityBig : public ct::CudaTest, public ::testing::WithParamInterface<BigIdent> {};
TEST_P(AddIdentityBig, ExactlyCpu) {
  const BigIdent c = GetParam();
  std::mt19937_64 rng(29);
  Twin x(*gpu, c.x, c.b, c.p, c.p), y(*gpu, c.c, c.b, c.p, c.p);
  x.fill_normal(rng);
  y.fill_value(3.0f);
  cpu->add_identity(x.hview(), 2.5f, y.hview());
  gpu->add_identity(x.dview(), 2.5f, y.dview());
  EXPECT_EQ(y.device_values(), y.host_values());
  if (c.x == c.c) {
    cpu->add_identity(x.hview(), -1.0f, x.hview());
    gpu->add_identity(x.dview(), -1.0f, x.dview());
    EXPECT_EQ(x.device_values(), x.host_values());
  }
}
INSTANTIATE_TEST_SUITE_P(Cases, AddIdentityBig,
                         ::testing::Values(BigIdent{DType::F16, DType::F16, 3, 64}, BigIdent{DType::F32, DType::F32, 2, 68},
                                           BigIdent{DType::F16, DType::F16, 2, 36}, BigIdent{DType::BF16, DType::BF16, 2, 1000},
                                           BigIdent{DType::F32, DType::F16, 2, 200}, BigIdent{DType::F16, DType::F16, 1, 2752}));
}  // namespace

// ---- the distributed layouts' ops: padding rows, remap_rows, selection_slots, copy_rows, copy_2d,
// the decay-only gather ---------------------------------------------------------------------------
namespace {

// Ascending selections of k_real rows per matrix, then padding up to k.
std::vector<int32_t> padded_rows(int64_t n, int64_t rows, int64_t k_real, int64_t k, std::mt19937_64& rng) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> all(rows);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> sel(all.begin(), all.begin() + k_real);
    std::sort(sel.begin(), sel.end());
    for (int64_t j = 0; j < k; ++j) out.push_back(j < k_real ? sel[j] : dion3::kPadRow);
  }
  return out;
}

dion3::DeviceBuffer upload_ints(dion3::Backend& gpu, const std::vector<int32_t>& v) {
  dion3::DeviceBuffer b(gpu.allocator(), std::max<std::size_t>(v.size() * 4, 4));
  if (!v.empty()) gpu.copy_from_host(b.get(), v.data(), v.size() * 4);
  return b;
}
std::vector<int32_t> download_ints(dion3::Backend& gpu, const dion3::DeviceBuffer& b, std::size_t n) {
  std::vector<int32_t> v(n);
  if (n) gpu.copy_to_host(v.data(), b.get(), n * 4);
  return v;
}

}  // namespace

TEST_F(CudaOps, PaddedGatherUpdateAndDecayOnlyGatherMatchCpu) {
  std::mt19937_64 rng(77);
  const int64_t n = 3, rows = 37, cols = 132, k_real = 9, k = 12;
  for (DType mdt : {DType::F32, DType::BF16}) {
    SetTwin s(*cpu, *gpu, n, rows, cols, DType::BF16, DType::F32, mdt, rng);
    const auto idx = padded_rows(n, rows, k_real, k, rng);
    auto didx = upload_ints(*gpu, idx);
    Twin out(*gpu, DType::F32, n, k, cols), ss(*gpu, DType::F32, n, k, 1);
    out.fill_value(5.0f);
    ss.fill_value(-1.0f);
    cpu->gather_rows(*s.hs, idx.data(), k, 1.0f, 0.0f, 0.9f, out.hview(), static_cast<float*>(ss.hview().data), nullptr);
    gpu->gather_rows(*s.ds, didx.as<int32_t>(), k, 1.0f, 0.0f, 0.9f, out.dview(), static_cast<float*>(ss.dview().data),
                     nullptr);
    const auto got = out.device_values();
    EXPECT_LE(ct::rel_max_diff(got, out.host_values()), storage_tol(DType::F32)) << dn(mdt);
    EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(mdt)) << dn(mdt);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = k_real; j < k; ++j) {
        EXPECT_EQ(ss.device_values()[i * k + j], 0.0f);
        for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(got[(i * k + j) * cols + c], 0.0f) << "padding row not zero";
      }
    // The decay-only gather (no output) scales the same rows.
    cpu->gather_rows(*s.hs, idx.data(), k, 1.0f, 0.0f, 0.5f, MatrixView{}, nullptr, nullptr);
    gpu->gather_rows(*s.ds, didx.as<int32_t>(), k, 1.0f, 0.0f, 0.5f, MatrixView{}, nullptr, nullptr);
    EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(mdt)) << dn(mdt);
    // gather_normalized with padding.
    Twin rs(*gpu, DType::F32, n, 1, 1);
    rs.set_host(selected_sums(row_sums_of_squares(s.m.host_values(), cols), idx.data(), n, rows, k));
    rs.upload();
    Twin xn(*gpu, DType::F16, n, k, cols);
    cpu->gather_normalized(*s.hs, idx.data(), k, 1.0f, static_cast<const float*>(rs.hview().data), dion3::NormGuard{}, xn.hview(),
                           nullptr);
    gpu->gather_normalized(*s.ds, didx.as<int32_t>(), k, 1.0f, static_cast<const float*>(rs.dview().data), dion3::NormGuard{},
                           xn.dview(), nullptr);
    EXPECT_LE(ct::rel_max_diff(xn.device_values(), xn.host_values()), storage_tol(DType::F16)) << dn(mdt);
    // apply_update ignores the padding rows of O (filled with garbage here).
    Twin O(*gpu, DType::BF16, n, k, cols);
    O.fill_normal(rng, 0.05f);
    dion3::UpdateParams p;
    p.decay = 1.0f - 0.02f * 0.1f; p.adjusted_lr = 0.03f; p.normuon = true; p.beta2 = 0.95f;
    cpu->apply_update(*s.hs, idx.data(), k, O.hview(), p, nullptr);
    gpu->apply_update(*s.ds, didx.as<int32_t>(), k, O.dview(), p, nullptr);
    EXPECT_LE(ct::rel_max_diff(s.w.device_values(), s.w.host_values()), storage_tol(DType::BF16)) << dn(mdt);
    EXPECT_LE(ct::rel_max_diff(s.v.device_values(), s.v.host_values()), 1e-5) << dn(mdt);
  }
}

// Column-stepped sets (weights stored (in, out)) against the CPU: the gather with padding entries,
// G's term and decay, the decay-only gather, gather_normalized, and apply_update (NorMuon, then
// cautious decay). The shapes take the gather's column chunks (more of them with G staged beside M)
// and the update's bands through their paths: 16-byte packs with a partial chunk, row tile and
// band (1040 x 72, 2104 x 37), rows of odd length (301 x 77); more than 1024 entries (the search's
// second step) and more than 256 in one chunk (2104 x 37), entries in the first columns only (chunks
// without any), a list of padding alone, 16-bit G, fp32 O.
TEST_F(CudaOps, ColumnSetsGatherAndUpdateMatchCpu) {
  std::mt19937_64 rng(91);
  struct Case {
    int64_t rows, cols, k_real, k;  // the set's rows: the stored columns
    DType m, g, o;                  // M (and W), G, the update's O
    int64_t first = 0;              // > 0: the entries lie in the first `first` columns
  };
  const Case cases[] = {{1040, 72, 300, 320, DType::F32, DType::F32, DType::BF16},
                        {1040, 72, 300, 320, DType::BF16, DType::F32, DType::F32},
                        {301, 77, 60, 64, DType::F32, DType::F32, DType::BF16},
                        {301, 77, 60, 64, DType::BF16, DType::F32, DType::BF16},
                        {2104, 37, 1500, 1536, DType::BF16, DType::BF16, DType::BF16},
                        {2104, 37, 1500, 1536, DType::F32, DType::BF16, DType::F32},
                        {2104, 40, 200, 256, DType::BF16, DType::BF16, DType::BF16, 600},
                        {1040, 72, 0, 32, DType::BF16, DType::F32, DType::BF16}};
  for (const Case& cs : cases) {
    const int64_t n = 3, k = cs.k;
    const std::string at = std::string(dn(cs.m)) + "/" + dn(cs.g) + "/" + dn(cs.o) + " " + std::to_string(cs.rows) +
                           "x" + std::to_string(cs.cols) + " k " + std::to_string(k);
    SetTwin s(*cpu, *gpu, n, cs.cols, cs.rows, cs.m, cs.g, cs.m, rng, true);
    const auto idx = padded_rows(n, cs.first > 0 ? cs.first : cs.rows, cs.k_real, k, rng);
    auto didx = upload_ints(*gpu, idx);
    Twin out(*gpu, DType::F32, n, k, cs.cols), ss(*gpu, DType::F32, n, k, 1);
    out.fill_value(5.0f);
    ss.fill_value(-1.0f);
    cpu->gather_rows(*s.hs, idx.data(), k, 0.9f, 1.0f, 0.95f, out.hview(), static_cast<float*>(ss.hview().data),
                     nullptr);
    gpu->gather_rows(*s.ds, didx.as<int32_t>(), k, 0.9f, 1.0f, 0.95f, out.dview(), static_cast<float*>(ss.dview().data),
                     nullptr);
    const auto got = out.device_values();
    EXPECT_LE(ct::rel_max_diff(got, out.host_values()), storage_tol(DType::F32)) << at;
    EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(cs.m)) << at;
    EXPECT_LE(ct::rel_max_diff(ss.device_values(), row_sums_of_squares(got, cs.cols)), 1e-5) << at;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = cs.k_real; j < k; ++j)
        for (int64_t c = 0; c < cs.cols; ++c) ASSERT_EQ(got[(i * k + j) * cs.cols + c], 0.0f) << at << ": padding";
    cpu->gather_rows(*s.hs, idx.data(), k, 1.0f, 0.0f, 0.5f, MatrixView{}, nullptr, nullptr);
    gpu->gather_rows(*s.ds, didx.as<int32_t>(), k, 1.0f, 0.0f, 0.5f, MatrixView{}, nullptr, nullptr);
    EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(cs.m)) << at << ": decay only";
    // The CPU's M as the device's, so that the normalised gather starts from equal values.
    s.m.set_host(s.m.device_values());
    Twin rs(*gpu, DType::F32, n, 1, 1);
    std::vector<float> mt(n * cs.rows * cs.cols);  // M in the set's row-major order
    const std::vector<float> mv = s.m.host_values();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < cs.cols; ++r)
        for (int64_t q = 0; q < cs.rows; ++q) mt[(i * cs.rows + q) * cs.cols + r] = mv[(i * cs.cols + r) * cs.rows + q];
    rs.set_host(selected_sums(row_sums_of_squares(mt, cs.cols), idx.data(), n, cs.rows, k));
    rs.upload();
    Twin xn(*gpu, DType::F16, n, k, cs.cols);
    cpu->gather_normalized(*s.hs, idx.data(), k, 0.9f, static_cast<const float*>(rs.hview().data), dion3::NormGuard{},
                           xn.hview(), nullptr);
    gpu->gather_normalized(*s.ds, didx.as<int32_t>(), k, 0.9f, static_cast<const float*>(rs.dview().data),
                           dion3::NormGuard{}, xn.dview(), nullptr);
    EXPECT_LE(ct::rel_max_diff(xn.device_values(), xn.host_values()), storage_tol(DType::F16)) << at;
    EXPECT_LE(ct::rel_max_diff(s.m.device_values(), s.m.host_values()), storage_tol(cs.m)) << at << ": normalized";
    for (bool normuon : {true, false}) {
      Twin O(*gpu, cs.o, n, k, cs.cols);
      O.fill_normal(rng, 0.05f);
      dion3::UpdateParams p;
      p.decay = 1.0f - 0.02f * 0.1f; p.adjusted_lr = 0.03f; p.normuon = normuon; p.beta2 = 0.95f;
      p.cautious_wd = !normuon;
      cpu->apply_update(*s.hs, idx.data(), k, O.hview(), p, nullptr);
      gpu->apply_update(*s.ds, didx.as<int32_t>(), k, O.dview(), p, nullptr);
      EXPECT_LE(ct::rel_max_diff(s.w.device_values(), s.w.host_values()), storage_tol(cs.m)) << at << normuon;
      EXPECT_LE(ct::rel_max_diff(s.v.device_values(), s.v.host_values()), 1e-5) << at << normuon;
    }
  }
}

TEST_F(CudaOps, RemapRowsAndSelectionSlotsExactlyCpu) {
  std::mt19937_64 rng(8);
  const int64_t n = 5, m = 103, k = 26, P = 4, c = (m + P - 1) / P, piece = std::min(k, c), block = 2;
  const auto sel = padded_rows(n, m, k, k, rng);
  auto dsel = upload_ints(*gpu, sel);
  for (int64_t r = 0; r < P; ++r) {
    const int64_t lo = r * c, hi = std::min(m, lo + c);
    std::vector<int32_t> want(n * piece);
    cpu->remap_rows(sel.data(), n, k, lo, hi, piece, want.data(), nullptr);
    dion3::DeviceBuffer out(gpu->allocator(), want.size() * 4);
    gpu->remap_rows(dsel.as<int32_t>(), n, k, lo, hi, piece, out.as<int32_t>(), nullptr);
    EXPECT_EQ(download_ints(*gpu, out, want.size()), want) << "shard " << r;
  }
  std::vector<int32_t> want(n * k);
  cpu->selection_slots(sel.data(), n, k, c, piece, block, 1, want.data(), nullptr);
  dion3::DeviceBuffer out(gpu->allocator(), want.size() * 4);
  gpu->selection_slots(dsel.as<int32_t>(), n, k, c, piece, block, 1, out.as<int32_t>(), nullptr);
  EXPECT_EQ(download_ints(*gpu, out, want.size()), want);
}

TEST_F(CudaOps, CopyRowsAndCopy2dExactlyCpu) {
  std::mt19937_64 rng(4);
  for (std::size_t width : {std::size_t{256}, std::size_t{90}}) {  // 16-byte words, and bytes
    const int64_t rows = 19;
    const std::size_t pitch = width + 32;
    std::vector<unsigned char> src(rows * pitch), dst_h(rows * pitch, 0), dst_d(rows * pitch, 0);
    for (auto& b : src) b = static_cast<unsigned char>(rng());
    std::vector<int32_t> perm(rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    dion3::DeviceBuffer dsrc(gpu->allocator(), src.size()), ddst(gpu->allocator(), src.size());
    gpu->copy_from_host(dsrc.get(), src.data(), src.size());
    gpu->fill_zero(ddst.get(), src.size());
    auto dperm = upload_ints(*gpu, perm);
    cpu->copy_rows(dst_h.data(), pitch, perm.data(), src.data(), pitch, nullptr, width, rows);
    gpu->copy_rows(ddst.get(), pitch, dperm.as<int32_t>(), dsrc.get(), pitch, nullptr, width, rows);
    gpu->copy_to_host(dst_d.data(), ddst.get(), dst_d.size());
    EXPECT_EQ(dst_d, dst_h) << "copy_rows, width " << width;
    cpu->copy_2d(dst_h.data(), pitch, src.data() + 16, pitch, width - 16, rows);
    gpu->copy_2d(ddst.get(), pitch, dsrc.as<char>() + 16, pitch, width - 16, rows);
    gpu->copy_to_host(dst_d.data(), ddst.get(), dst_d.size());
    EXPECT_EQ(dst_d, dst_h) << "copy_2d, width " << width;
  }
}

// apply_update with whole rows of O and a column window (column-sharded weights), also an empty
// one (a rank without columns): NorMuon's variance moves all the same.
TEST_F(CudaOps, ApplyUpdateColumnWindowMatchesCpu) {
  std::mt19937_64 rng(21);
  const int64_t n = 3, rows = 40, k = 9, wide = 100;
  struct Window { int64_t cols, offset; bool normuon; };
  for (auto [cols, offset, normuon] : {Window{36, 44, true}, Window{36, 44, false}, Window{0, wide, true}}) {
    SetTwin s(*cpu, *gpu, n, rows, cols, DType::BF16, DType::BF16, DType::F32, rng);
    const std::vector<float> v0 = s.v.device_values();
    const auto idx = padded_rows(n, rows, 7, k, rng);
    auto didx = upload_ints(*gpu, idx);
    Twin O(*gpu, DType::BF16, n, k, wide);
    O.fill_normal(rng, 0.05f);
    dion3::UpdateParams p;
    p.decay = 1.0f - 0.02f * 0.1f; p.adjusted_lr = 0.03f; p.normuon = normuon; p.beta2 = 0.95f;
    p.o_col_offset = offset;
    cpu->apply_update(*s.hs, idx.data(), k, O.hview(), p, nullptr);
    gpu->apply_update(*s.ds, didx.as<int32_t>(), k, O.dview(), p, nullptr);
    EXPECT_LE(ct::rel_max_diff(s.w.device_values(), s.w.host_values()), storage_tol(DType::BF16)) << normuon;
    EXPECT_LE(ct::rel_max_diff(s.v.device_values(), s.v.host_values()), 1e-5) << normuon;
    if (normuon) EXPECT_NE(s.v.device_values(), v0) << "cols " << cols << ": the variance did not move";
  }
}
