// tests/cpp/test_thread_ranks.cpp — the distributed layouts (algorithm.md §3) on the CPU backend with
// ranks as threads of this process (thread_comm.hpp): 2, 3 and 4 ranks, every case the MPI suite
// runs (layout_cases.hpp). The CUDA suite runs the same checks with the ranks on one GPU.
#include <gtest/gtest.h>

#include <memory>

#include "layout_cases.hpp"
#include "reference.hpp"
#include "test_util.hpp"
#include "thread_comm.hpp"

namespace {

class ThreadRanks : public ::testing::TestWithParam<int> {};

TEST_P(ThreadRanks, LayoutsEqualTheSingleProcessRule) { t3::check_layouts_on_threads(GetParam(), t3::host_backend()); }

INSTANTIATE_TEST_SUITE_P(Cpu, ThreadRanks, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param) + "ranks"; });

}  // namespace

// A matrix with fewer columns than selected rows, its columns cut over ranks that do not divide
// them (n < k <= P * ceil(n/P)): one device orthogonalizes it transposed, on its n x n Gram. The
// owner of a column-sharded (or block) matrix packs the ranks' columns n wide, so it takes the
// same orientation; zero-padded columns instead left a k x k Gram of rank n, whose null
// directions a 16-bit iteration amplified (updates off by more than their own size). Each rank's
// part must equal one process's to the iteration's rounding.
TEST(ThreadRanksNarrow, ColumnShardsOrthogonalizeAsOneDevice) {
  struct Case {
    dion3::Algorithm algo;
    dion3::OrthMethod method;
    int ranks, m, n;
  };
  for (const Case& c : {Case{dion3::Algorithm::Muon, dion3::OrthMethod::Gram, 3, 3, 1},
                        Case{dion3::Algorithm::Muon, dion3::OrthMethod::Standard, 3, 3, 1},
                        Case{dion3::Algorithm::NorMuon, dion3::OrthMethod::Gram, 4, 20, 18}}) {
    for (dion3::Layout layout : {dion3::Layout::ColShard, dion3::Layout::Block}) {
      dion3::GroupConfig g;
      g.algorithm = c.algo;
      g.lr = 0.02;
      g.orth.method = c.method;
      g.orth.iteration_dtype = dion3::DType::BF16;
      t3::Rng rng(3);
      const ref::Mat W = t3::gaussian(c.m, c.n, rng, 0.05), G = t3::gaussian(c.m, c.n, rng);
      // One process.
      t3::Harness one;
      auto& p = one.add(one.opt.add_group(g), "w", dion3::DType::F32, {c.m, c.n}, rng);
      p.w.assign(W);
      p.g.assign(G);
      ASSERT_TRUE(one.opt.step());
      const std::vector<double> want = p.w.values();
      // Thread ranks: columns cut over all of them (Block: a 1 x P grid).
      const auto comms = t3::thread_communicators(c.ranks, dion3::Device::CPU);
      std::vector<std::vector<double>> got(c.ranks);
      t3::on_threads(c.ranks, "narrow", [&](int r) {
        const t3::Shard cols = t3::shard_of(c.n, c.ranks, r);
        t3::Harness h;
        const int gi = h.opt.add_group(g);
        auto q = std::make_unique<t3::HostParam>("w", dion3::DType::F32, std::vector<int64_t>{c.m, cols.count});
        q->w.assign(t3::part_of(W, c.n, {0, c.m}, cols));
        q->g.assign(t3::part_of(G, c.n, {0, c.m}, cols));
        dion3::ParamSpec spec = q->spec();
        spec.layout.kind = layout;
        spec.layout.global_rows = c.m;
        spec.layout.global_cols = c.n;
        if (layout == dion3::Layout::Block) {
          spec.layout.comm = t3::thread_communicators(1, dion3::Device::CPU)[0];  // one row rank
          spec.layout.col_comm = comms[r];
        } else {
          spec.layout.comm = comms[r];
        }
        h.opt.add_param(gi, spec);
        EXPECT_TRUE(h.opt.step());
        got[r] = q->w.values();
      });
      for (int r = 0; r < c.ranks; ++r) {
        const t3::Shard cols = t3::shard_of(c.n, c.ranks, r);
        // bf16 rounding of the update (lr 0.02 times entries of order one), not its size.
        EXPECT_LE(t3::max_abs_diff(got[r], t3::part_of(want, c.n, {0, c.m}, cols)), 2e-3 * g.lr)
            << dion3::algorithm_name(c.algo) << " " << c.m << "x" << c.n << " on " << c.ranks << " ranks, "
            << dion3::layout_name(layout) << ", rank " << r;
      }
    }
  }
}
