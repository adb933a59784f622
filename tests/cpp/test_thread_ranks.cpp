// tests/cpp/test_thread_ranks.cpp — the distributed layouts (algorithm.md §3) on the CPU backend with
// ranks as threads of this process (thread_comm.hpp): 2, 3 and 4 ranks, every case the MPI suite
// runs (layout_cases.hpp), and steps the ranks disagree on. The CUDA suite runs the same checks with the ranks on one GPU.
#include <gtest/gtest.h>

#include <memory>

#include "layout_cases.hpp"
#include "reference.hpp"
#include "test_util.hpp"
#include "thread_comm.hpp"

namespace {

class ThreadRanks : public ::testing::TestWithParam<int> {};

TEST_P(ThreadRanks, LayoutsEqualTheSingleProcessRule) { t3::check_layouts_on_threads(GetParam(), t3::host_backend()); }

TEST_P(ThreadRanks, StepsTheRanksDisagreeOnAreRefusedByEveryRank) {
  t3::check_agreement_on_threads(GetParam(), t3::host_backend());
}

INSTANTIATE_TEST_SUITE_P(Cpu, ThreadRanks, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param) + "ranks"; });

}  // namespace

// Shards whose padding would turn a matrix's orientation. Columns: fewer columns than selected
// rows, cut over ranks that do not divide them (n < k <= P * ceil(n/P)); the owner packs the
// columns n wide. Rows: at most n real rows in a zero-padded stack of more than n; the owner
// iterates on the rows as they stand. One device orients both by the real shape; iterating on
// a Gram of rank below its size instead let a 16-bit iteration amplify its null directions
// (updates off by more than their own size). Each rank's part must equal one process's to the
// iteration's rounding (Muon and NorMuon select every row, so the rules coincide; NorMuon's
// rescale under row sharding is per rank, algorithm.md §3, so rows are cut for Muon only).
TEST(ThreadRanksNarrow, PaddedShardsOrthogonalizeAsOneDevice) {
  using dion3::Layout;
  struct Case {
    dion3::Algorithm algo;
    dion3::OrthMethod method;
    Layout layout;
    bool cut_rows;  // Block: a P x 1 grid (rows cut) or 1 x P (columns cut)
    int ranks, m, n;
  };
  const auto Muon = dion3::Algorithm::Muon, NorMuon = dion3::Algorithm::NorMuon;
  const auto Gram = dion3::OrthMethod::Gram, Standard = dion3::OrthMethod::Standard;
  for (const Case& c : {Case{Muon, Gram, Layout::ColShard, false, 3, 3, 1}, Case{Muon, Standard, Layout::ColShard, false, 3, 3, 1},
                        Case{NorMuon, Gram, Layout::ColShard, false, 4, 20, 18}, Case{Muon, Gram, Layout::Block, false, 3, 3, 1},
                        Case{NorMuon, Gram, Layout::Block, false, 4, 20, 18}, Case{Muon, Gram, Layout::RowShard, true, 4, 6, 7},
                        Case{Muon, Standard, Layout::RowShard, true, 4, 6, 7}, Case{Muon, Gram, Layout::RowShard, true, 3, 1, 2},
                        Case{Muon, Gram, Layout::Block, true, 4, 6, 7}}) {
    dion3::GroupConfig g;
    g.algorithm = c.algo;
    g.lr = 0.02;
    g.orth.method = c.method;
    g.orth.iteration_dtype = dion3::DType::F16;  // 16 bits: the null directions' noise shows
    t3::Rng rng(3);
    const ref::Mat W = t3::gaussian(c.m, c.n, rng, 0.05), G = t3::gaussian(c.m, c.n, rng);
    t3::Harness one;
    auto& p = one.add(one.opt.add_group(g), "w", dion3::DType::F32, {c.m, c.n}, rng);
    p.w.assign(W);
    p.g.assign(G);
    ASSERT_TRUE(one.opt.step());
    const std::vector<double> want = p.w.values();
    const auto comms = t3::thread_communicators(c.ranks, dion3::Device::CPU);
    const std::string what = std::string(dion3::algorithm_name(c.algo)) + " " + std::to_string(c.m) + "x" +
                             std::to_string(c.n) + " on " + std::to_string(c.ranks) + " ranks, " +
                             dion3::layout_name(c.layout) + (c.cut_rows ? " (rows cut)" : " (columns cut)");
    std::vector<std::vector<double>> got(c.ranks);
    t3::on_threads(c.ranks, what, [&](int r) {
      const t3::Shard rows = c.cut_rows ? t3::shard_of(c.m, c.ranks, r) : t3::Shard{0, c.m};
      const t3::Shard cols = c.cut_rows ? t3::Shard{0, c.n} : t3::shard_of(c.n, c.ranks, r);
      t3::Harness h;
      const int gi = h.opt.add_group(g);
      auto q = std::make_unique<t3::HostParam>("w", dion3::DType::F32, std::vector<int64_t>{rows.count, cols.count});
      q->w.assign(t3::part_of(W, c.n, rows, cols));
      q->g.assign(t3::part_of(G, c.n, rows, cols));
      dion3::ParamSpec spec = q->spec();
      spec.layout.kind = c.layout;
      spec.layout.global_rows = c.m;
      spec.layout.global_cols = c.n;
      const auto alone = t3::thread_communicators(1, dion3::Device::CPU)[0];  // the grid's other side
      if (c.layout == Layout::Block) {
        spec.layout.comm = c.cut_rows ? comms[r] : alone;
        spec.layout.col_comm = c.cut_rows ? alone : comms[r];
      } else {
        spec.layout.comm = comms[r];
      }
      h.opt.add_param(gi, spec);
      EXPECT_TRUE(h.opt.step());
      got[r] = q->w.values();
    });
    for (int r = 0; r < c.ranks; ++r) {
      const t3::Shard rows = c.cut_rows ? t3::shard_of(c.m, c.ranks, r) : t3::Shard{0, c.m};
      const t3::Shard cols = c.cut_rows ? t3::Shard{0, c.n} : t3::shard_of(c.n, c.ranks, r);
      // bf16 rounding of the update (lr 0.02 times entries of order one), not its size.
      EXPECT_LE(t3::max_abs_diff(got[r], t3::part_of(want, c.n, rows, cols)), 2e-3 * g.lr) << what << ", rank " << r;
    }
  }
}

// Layouts that name no cut of the matrix are refused when the parameter is registered: a row
// chunk without this rank's first row (the standard cut takes neither), and a block layout whose
// rows and columns are cut over one communicator (each rank would hold its diagonal block only).
TEST(ThreadRanksNarrow, LayoutsThatAreNoCutAreRefusedAtRegistration) {
  const auto comms = t3::thread_communicators(2, dion3::Device::CPU);
  t3::Harness h;
  const int gi = h.opt.add_group(dion3::GroupConfig{});
  auto q = std::make_unique<t3::HostParam>("w", dion3::DType::F32, std::vector<int64_t>{3, 4});
  dion3::ParamSpec row = q->spec();
  row.layout.kind = dion3::Layout::RowShard;
  row.layout.comm = comms[0];
  row.layout.global_rows = 5;
  row.layout.row_chunk = 3;
  EXPECT_NE(t3::error_of([&] { h.opt.add_param(gi, row); }).find("gives row_chunk 3 without row_offset"),
            std::string::npos);
  // A block of a 6 x 8 matrix whose rows and columns are both cut over `comm`.
  auto block_over = [](t3::HostParam& p, const std::shared_ptr<dion3::Communicator>& comm) {
    dion3::ParamSpec spec = p.spec();
    spec.layout.kind = dion3::Layout::Block;
    spec.layout.comm = comm;
    spec.layout.col_comm = comm;
    spec.layout.global_rows = 6;
    spec.layout.global_cols = 8;
    return spec;
  };
  EXPECT_NE(t3::error_of([&] { h.opt.add_param(gi, block_over(*q, comms[0])); })
                .find("cuts rows and columns over two communicators"),
            std::string::npos);
  EXPECT_EQ(h.opt.num_params(), 0);
  // One rank: the same communicator serves both dimensions of a 1 x 1 grid.
  t3::HostParam whole("whole", dion3::DType::F32, {6, 8});
  EXPECT_EQ(t3::error_of([&] { h.opt.add_param(gi, block_over(whole, t3::thread_communicators(1, dion3::Device::CPU)[0])); }),
            "");
}

// One optimizer agrees on its steps over at most kAgreementRegions communicators: the next one a
// parameter would bring is refused when it is registered.
TEST(ThreadRanksNarrow, ParametersOverTooManyCommunicatorsAreRefused) {
  t3::Harness h;
  const int gi = h.opt.add_group(dion3::GroupConfig{});
  std::vector<std::unique_ptr<t3::HostParam>> ps;
  for (int i = 0; i <= dion3::kAgreementRegions; ++i) {
    ps.push_back(std::make_unique<t3::HostParam>("w" + std::to_string(i), dion3::DType::F32, std::vector<int64_t>{2, 3}));
    dion3::ParamSpec spec = ps.back()->spec();
    spec.layout.kind = dion3::Layout::Replicated;
    spec.layout.comm = t3::thread_communicators(1, dion3::Device::CPU)[0];
    const std::string what = t3::error_of([&] { h.opt.add_param(gi, spec); });
    if (i < dion3::kAgreementRegions) EXPECT_EQ(what, "") << i;
    else EXPECT_NE(what.find("would span 9 communicator objects; one optimizer agrees on its steps over at most 8"),
                   std::string::npos) << what;
  }
  EXPECT_EQ(h.opt.num_params(), dion3::kAgreementRegions);
}
