// tests/mpi/test_mpi_layouts.cpp — the distributed layouts of algorithm.md §3 through the C++ engine and
// the C API over real MPI collectives (Open MPI), CPU backend. Launched by CTest under mpirun
// with 2 and 4 ranks. The layouts' checks (tests/cpp/layout_cases.hpp) are shared with the thread-rank
// suites; the fault tests here build the same full matrices on every rank from one seed and
// check each rank's part.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dion3/comm.hpp"
#include "dion3/dion3.h"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "layout_cases.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using dion3::Algorithm;
using dion3::DType;
using dion3::GroupConfig;
using dion3::Layout;
using t3::Rng;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

using t3::part_of;
using t3::rows_of;
using t3::Shard;
using t3::shard_of;

class Layouts : public ::testing::TestWithParam<t3::LayoutCase> {};

TEST_P(Layouts, EqualTheSingleProcessRule) {
  t3::check_layout_case(GetParam(), t3::host_backend(), dion3::make_mpi_communicator(nullptr, 60.0));
}

INSTANTIATE_TEST_SUITE_P(Mpi, Layouts, ::testing::ValuesIn(t3::layout_cases()),
                         [](const ::testing::TestParamInfo<t3::LayoutCase>& info) { return info.param.name; });

// Row and column blocks (FSDP2 over tensor parallel's row-wise split): rows cut over one
// communicator, columns over another; the row-sharded rule over the row ranks, whole rows.
TEST(Block, RowAndColumnBlocksEqualTheRowShardedRule) {
  const int P = world_size(), rank = world_rank();
  std::vector<std::pair<int, int>> grids = {{P, 1}, {1, P}};
  if (P == 4) grids.push_back({2, 2});
  for (auto [dp, tp] : grids) {
    const int d = rank / tp, t = rank % tp;
    MPI_Comm rows_comm, cols_comm;
    MPI_Comm_split(MPI_COMM_WORLD, t, d, &rows_comm);  // the ranks holding the same columns
    MPI_Comm_split(MPI_COMM_WORLD, d, t, &cols_comm);  // the ranks holding the same rows
    t3::check_block_case(t3::host_backend(), dion3::make_mpi_communicator(&rows_comm, 60.0),
                         dion3::make_mpi_communicator(&cols_comm, 60.0));
    MPI_Comm_free(&rows_comm);
    MPI_Comm_free(&cols_comm);
  }
}

// A non-finite gradient in one rank's shard: every rank drops the step (skip) or raises
// (raise), and no rank's weights or state move.
TEST(Faults, NonFiniteOnOneRankIsDecidedByAll) {
  const int P = world_size(), rank = world_rank();
  for (auto policy : {dion3::NonFinitePolicy::Skip, dion3::NonFinitePolicy::Raise}) {
    auto comm = dion3::make_mpi_communicator(nullptr, 60.0);
    dion3::OptimizerOptions o;
    o.on_nonfinite = policy;
    t3::Harness h(o);
    const int gi = h.opt.add_group(GroupConfig{});
    Rng rng(7);
    const Shard s = shard_of(16, P, rank);
    auto p = std::make_unique<t3::HostParam>("w", DType::F32, std::vector<int64_t>{s.count, 24});
    p->w.assign(rows_of(t3::gaussian(16, 24, rng), 24, s));
    dion3::ParamSpec spec = p->spec();
    spec.layout.kind = Layout::RowShard;
    spec.layout.comm = comm;
    spec.layout.global_rows = 16;
    p->index = h.opt.add_param(gi, spec);
    p->g.assign(rows_of(t3::gaussian(16, 24, rng), 24, s));
    if (rank == P - 1 && s.count > 0) p->g.set(0, std::nan(""));
    else if (rank == 0) p->g.set(3, std::nan(""));
    const auto before = t3::snapshot(h.opt, {p.get()});
    if (policy == dion3::NonFinitePolicy::Skip) {
      EXPECT_FALSE(h.opt.step()) << "rank " << rank;
    } else {
      dion3::Status st = dion3::Status::Ok;
      const std::string what = t3::error_of([&] { h.opt.step(); }, &st);
      EXPECT_EQ(st, dion3::Status::NonFinite) << "rank " << rank << ": " << what;
    }
    EXPECT_EQ(t3::snapshot(h.opt, {p.get()}), before) << "rank " << rank << " changed its shard";
  }
}

// The non-finite check's momentum bound in every distributed layout (each rank bounds its own
// part: Dion3 by the scores it selects from, Muon and NorMuon by what its accumulate stored): the
// same verdicts and results as a check told to read everything before every step
// (state_changed()), with the CPU suite's gradient scales on one element in a middle row and
// column of the matrix.
TEST(Faults, TheMomentumBoundNeverChangesAVerdict) {
  const int P = world_size(), rank = world_rank();
  const double big = 3.4028234663852886e38;
  struct L {
    const char* name;
    Layout layout;
    dion3::SelectionScope scope;
  };
  for (Algorithm alg : {Algorithm::Dion3, Algorithm::Muon, Algorithm::NorMuon})
  for (const L& l : {L{"row-sharded", Layout::RowShard, dion3::SelectionScope::Local},
                     L{"row-sharded, global selection", Layout::RowShard, dion3::SelectionScope::Global},
                     L{"column-sharded", Layout::ColShard, dion3::SelectionScope::Local},
                     L{"replicated", Layout::Replicated, dion3::SelectionScope::Local}}) {
    if (alg != Algorithm::Dion3 && l.scope == dion3::SelectionScope::Global) continue;  // no selection
    const std::string name = std::string(dion3::algorithm_name(alg)) + " " + l.name;
    auto comm = dion3::make_mpi_communicator(nullptr, 60.0);
    dion3::OptimizerOptions o;
    o.on_nonfinite = dion3::NonFinitePolicy::Skip;
    GroupConfig g;
    g.algorithm = alg;
    g.fraction = 0.5;
    g.selection_scope = l.scope;
    const int m = 16, n = 24, hot = 9 * n + 13;
    const Shard rows = l.layout == Layout::RowShard ? shard_of(m, P, rank) : Shard{0, m};
    const Shard cols = l.layout == Layout::ColShard ? shard_of(n, P, rank) : Shard{0, n};
    Rng wrng(11);
    const std::vector<double> w0 = part_of(t3::gaussian(m, n, wrng, 0.05), n, rows, cols);
    auto make = [&](t3::Harness& h) {
      auto p = std::make_unique<t3::HostParam>("w", DType::F32, std::vector<int64_t>{rows.count, cols.count});
      p->w.assign(w0);
      dion3::ParamSpec spec = p->spec();
      spec.layout.kind = l.layout;
      spec.layout.comm = comm;
      spec.layout.global_rows = m;
      spec.layout.global_cols = n;
      p->index = h.opt.add_param(h.opt.add_group(g), spec);
      return p;
    };
    t3::Harness fast(o), exact(o);
    auto pf = make(fast), pe = make(exact);
    const std::vector<double> scales = {0.2, 0.2, 0.2, 0.2, 0.2, 0.19, 0.19, 0.19, 0.1, 0.05, 0.19, 0.19,
                                        std::numeric_limits<double>::infinity(), 1e-30, 1e-30};
    int applied = 0;
    for (std::size_t s = 0; s < scales.size(); ++s) {
      for (t3::HostParam* p : {pf.get(), pe.get()})
        for (int r = 0; r < rows.count; ++r)
          for (int c = 0; c < cols.count; ++c) {
            const int e = (rows.first + r) * n + cols.first + c;  // element of the whole matrix
            p->g.set(static_cast<int64_t>(r) * cols.count + c,
                     (e % 3 == 0 ? -1.0 : 1.0) * (e == hot ? scales[s] * big : 1e-3));
          }
      exact.opt.state_changed();
      const bool a = fast.opt.step(), b = exact.opt.step();
      EXPECT_EQ(a, b) << name << " rank " << rank << " step " << s;
      applied += a;
      EXPECT_EQ(t3::snapshot(fast.opt, {pf.get()}), t3::snapshot(exact.opt, {pe.get()}))
          << name << " rank " << rank << " step " << s;
    }
    EXPECT_GT(applied, 3) << name;
    EXPECT_LT(applied, static_cast<int>(scales.size())) << name;

    // The bound is in use on every rank: momentum written through state_views() without
    // state_changed() is not read, and a gradient the written momentum cannot take goes through
    // (what state_changed() is for); after state_changed() every rank drops the step.
    for (bool notice : {false, true}) {
      t3::Harness h(o);
      auto p = make(h);
      for (int s = 0; s < 2; ++s) {
        for (int64_t i = 0; i < p->g.numel(); ++i) p->g.set(i, 1e-3);
        ASSERT_TRUE(h.opt.step()) << name;
      }
      const dion3::TensorView m = h.opt.state_views(p->index)[0].second;
      ASSERT_EQ(m.dtype, DType::F32);
      std::fill_n(static_cast<float*>(m.data), m.numel(), static_cast<float>(0.9 * big));
      if (notice) h.opt.state_changed();
      for (int64_t i = 0; i < p->g.numel(); ++i) p->g.set(i, 0.2 * big);
      EXPECT_EQ(h.opt.step(), !notice) << name << " rank " << rank << (notice ? " after state_changed()" : "");
    }
  }
}

// A collective another rank joins too late surfaces as an error naming it, not as a hang.
TEST(Faults, CollectiveTimeoutNamesTheCollective) {
  const int rank = world_rank();
  auto comm = dion3::make_mpi_communicator(nullptr, 0.5);
  int32_t value = rank;  // stays alive until the late ranks have joined (the barrier below)
  if (rank == 0) {
    dion3::Status st = dion3::Status::Ok;
    const std::string what = t3::error_of(
        [&] { comm->all_reduce_max(&value, 1, nullptr, "the forward all-to-all of megabatch 7")->wait(); }, &st);
    EXPECT_EQ(st, dion3::Status::Internal);
    EXPECT_NE(what.find("the forward all-to-all of megabatch 7"), std::string::npos) << what;
    EXPECT_NE(what.find("timed out"), std::string::npos) << what;
    // Its later collectives would pair with the abandoned one on the late ranks: refused.
    int32_t again = 0;
    const std::string next = t3::error_of([&] { comm->all_reduce_max(&again, 1, nullptr, "the next step")->wait(); });
    EXPECT_NE(next.find("cannot be cancelled"), std::string::npos) << next;
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    comm->all_reduce_max(&value, 1, nullptr, "late")->wait();
    EXPECT_EQ(value, world_size() - 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);  // rank 0's abandoned request completes here
}

// A communicator MPI cannot duplicate is an error returned, not the end of the job (MPI's
// default handler aborts); the timeout's message keeps its fractions of a second.
TEST(Faults, ACommunicatorMpiRefusesIsAnError) {
  MPI_Comm null = MPI_COMM_NULL;
  dion3::Status st = dion3::Status::Ok;
  std::string what = t3::error_of([&] { dion3::make_mpi_communicator(&null, 1.0); }, &st);
  EXPECT_EQ(st, dion3::Status::InvalidArgument);
  EXPECT_NE(what.find("MPI_COMM_NULL"), std::string::npos) << what;
  dion3_comm* c = nullptr;
  EXPECT_EQ(dion3_comm_create_mpi(&c, &null, 1.0), DION3_INVALID_ARGUMENT);
  EXPECT_EQ(c, nullptr);
  auto comm = dion3::make_mpi_communicator(nullptr, 0.25);
  int32_t value = 0;
  if (world_rank() == 0) {
    what = t3::error_of([&] { comm->all_reduce_max(&value, 1, nullptr, "a lone collective")->wait(); });
    EXPECT_NE(what.find("timed out after 0.25 s"), std::string::npos) << what;
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    comm->all_reduce_max(&value, 1, nullptr, "late")->wait();
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Ranks that registered different parameters get the same clear error at the step, not a hang.
TEST(Faults, MismatchedPlansFailOnEveryRank) {
  const int rank = world_rank();
  auto comm = dion3::make_mpi_communicator(nullptr, 60.0);
  t3::Harness h;
  const int gi = h.opt.add_group(GroupConfig{});
  std::vector<std::unique_ptr<t3::HostParam>> ps;
  const int count = rank == 0 ? 2 : 1;  // rank 0 has one parameter more
  for (int i = 0; i < count; ++i) {
    ps.push_back(std::make_unique<t3::HostParam>("w" + std::to_string(i), DType::F32, std::vector<int64_t>{8, 8}));
    dion3::ParamSpec spec = ps.back()->spec();
    spec.layout.kind = Layout::Replicated;
    spec.layout.comm = comm;
    h.opt.add_param(gi, spec);
  }
  // Refused again on a second try: the refusal is not kept as a valid plan.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const std::string what = t3::error_of([&] { h.opt.step(); });
    EXPECT_NE(what.find("planned different steps"), std::string::npos)
        << "rank " << rank << ", attempt " << attempt << ": " << what;
  }
}

// `count` 8 x 6 float32 parameters of group `gi`, replicated over `comm`, Gaussian weights.
std::vector<std::unique_ptr<t3::HostParam>> replicated_params(t3::Harness& h, int gi,
                                                              const std::shared_ptr<dion3::Communicator>& comm,
                                                              Rng& rng, int count) {
  std::vector<std::unique_ptr<t3::HostParam>> ps;
  for (int i = 0; i < count; ++i) {
    ps.push_back(std::make_unique<t3::HostParam>("w" + std::to_string(i), DType::F32, std::vector<int64_t>{8, 6}));
    ps.back()->w.assign(t3::gaussian(8, 6, rng));
    dion3::ParamSpec spec = ps.back()->spec();
    spec.layout.kind = Layout::Replicated;
    spec.layout.comm = comm;
    ps.back()->index = h.opt.add_param(gi, spec);
  }
  return ps;
}

// A rank without gradients this step runs the step's collectives through refuse_step(): every
// rank refuses, nothing moves (counters included, under either policy), and afterwards the
// ranks step together again, also when the others only enqueued their step (step_async) or the
// refusing rank's last gradients were not finite. When every rank refuses, nothing happens.
TEST(Faults, ARankWithoutGradientsRefusesTheStepOnEveryRank) {
  const int P = world_size(), rank = world_rank();
  for (auto policy : {dion3::NonFinitePolicy::Raise, dion3::NonFinitePolicy::Skip}) {
    auto comm = dion3::make_mpi_communicator(nullptr, 60.0);
    dion3::OptimizerOptions o;
    o.on_nonfinite = policy;
    t3::Harness h(o);
    const int gi = h.opt.add_group(GroupConfig{});
    Rng rng(11);
    std::vector<std::unique_ptr<t3::HostParam>> ps = replicated_params(h, gi, comm, rng, 3);
    auto fill = [&](double v) {
      for (auto& p : ps) p->g.assign(std::vector<double>(48, v));
    };
    std::vector<t3::HostParam*> all;
    for (auto& p : ps) all.push_back(p.get());
    const std::string where = std::string("rank ") + std::to_string(rank) +
                              (policy == dion3::NonFinitePolicy::Skip ? ", skip" : ", raise");
    fill(1.0);
    ASSERT_TRUE(h.opt.step()) << where;
    const auto before = t3::snapshot(h.opt, all);
    const int64_t taken = h.opt.steps_taken(), skipped = h.opt.steps_skipped();
    // The refusing rank's last gradients hold a NaN: the refusal must not read them.
    fill(2.0);
    if (rank == P - 1) ps[0]->g.set(0, std::nan(""));
    dion3::Status st = dion3::Status::Ok;
    const std::string what = t3::error_of([&] { rank == P - 1 ? h.opt.refuse_step() : h.opt.step(); }, &st);
    EXPECT_EQ(st, dion3::Status::InvalidArgument) << where << ": " << what;
    EXPECT_NE(what.find(rank == P - 1 ? "no parameter of this rank has a gradient" : "another rank took no part"),
              std::string::npos) << where << ": " << what;
    EXPECT_EQ(t3::snapshot(h.opt, all), before) << where << ": a refused step moved something";
    // The others only enqueue theirs: they learn nothing now, and the next step still pairs.
    fill(2.0);
    if (rank == P - 1) EXPECT_NE(t3::error_of([&] { h.opt.refuse_step(); }), "") << where;
    else h.opt.step_async();
    EXPECT_EQ(t3::snapshot(h.opt, all), before) << where << ": a refused, enqueued step moved something";
    EXPECT_FALSE(h.opt.refuse_step()) << where << ": every rank refused, yet it raised or stepped";
    EXPECT_EQ(t3::snapshot(h.opt, all), before) << where;
    EXPECT_EQ(h.opt.steps_taken(), taken) << where;
    EXPECT_EQ(h.opt.steps_skipped(), skipped) << where << ": a refused step was counted as dropped";
    fill(3.0);
    ASSERT_TRUE(h.opt.step()) << where;
    for (auto& p : ps) {
      std::vector<double> w = p->w.values(), first = w;
      MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
      EXPECT_EQ(w, first) << where << ": the ranks drifted apart";
    }
  }
}

// Hyper-parameters that differ on one rank, and a step invalid on one rank alone: refused by
// every rank (layout_cases.hpp).
TEST(Faults, StepsTheRanksDisagreeOnAreRefusedByEveryRank) {
  t3::check_agreement_case(t3::host_backend(), dion3::make_mpi_communicator(nullptr, 60.0));
}

// A rank that plans anew while the others do not (a setting changed there alone): its first
// collective is the same agreement the others make, so a plan that did not change steps on every
// rank, and one that did is refused by every rank at once, nothing moved, instead of a hang.
TEST(Faults, ARankThatPlansAnewAgreesWithTheOthers) {
  const int P = world_size(), rank = world_rank();
  auto comm = dion3::make_mpi_communicator(nullptr, 60.0);
  t3::Harness h, fresh;
  const int gi = h.opt.add_group(GroupConfig{});
  Rng rng(13);
  std::vector<std::unique_ptr<t3::HostParam>> ps = replicated_params(h, gi, comm, rng, 3);
  std::vector<t3::HostParam*> all;
  for (auto& p : ps) all.push_back(p.get());
  auto fill = [&](int step) {
    Rng g(100 + step);  // the same gradients on every rank
    for (auto& p : ps) p->g.assign(t3::gaussian(8, 6, g));
  };
  auto same_on_every_rank = [&](const char* when) {
    for (auto& p : ps) {
      std::vector<double> w = p->w.values(), first = w;
      MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
      EXPECT_EQ(w, first) << "rank " << rank << " " << when << ": the ranks drifted apart";
    }
  };
  const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(P);
  fill(0);
  ASSERT_TRUE(h.opt.step()) << where;
  // 1. Planned anew on rank 0 only, to the same plan: there a new optimizer over the same
  //    parameters, given the old one's state, steps on. Every rank steps, as one.
  dion3::Optimizer* opt = &h.opt;
  if (rank == 0) {
    const int fg = fresh.opt.add_group(h.opt.group(gi));
    for (auto& p : ps) {
      dion3::ParamSpec spec = p->spec();
      spec.layout.kind = Layout::Replicated;
      spec.layout.comm = comm;
      EXPECT_EQ(fresh.opt.add_param(fg, spec), p->index);
    }
    fresh.opt.import_state(h.opt.export_state());
    opt = &fresh.opt;
  }
  fill(1);
  EXPECT_TRUE(opt->step()) << where;
  same_on_every_rank("after a plan made anew on rank 0");
  // 2. Planned anew on rank 0 only, to another plan: every rank raises, nothing moves.
  if (rank == 0) {
    GroupConfig c = opt->group(0);
    c.fraction = 0.5;
    opt->set_group(0, c);
  }
  const auto before = t3::snapshot(*opt, all);
  const int64_t taken = opt->steps_taken(), skipped = opt->steps_skipped();
  fill(2);
  dion3::Status st = dion3::Status::Ok;
  const std::string what = t3::error_of([&] { opt->step(); }, &st);
  EXPECT_NE(what.find("planned different steps"), std::string::npos) << where << ": " << what;
  EXPECT_EQ(t3::snapshot(*opt, all), before) << where << ": a refused step moved something";
  EXPECT_EQ(opt->steps_taken(), taken) << where;
  EXPECT_EQ(opt->steps_skipped(), skipped) << where << ": a refused step was counted as dropped";
  // 3. The setting made alike again: the ranks step together.
  if (rank == 0) {
    GroupConfig c = opt->group(0);
    c.fraction = 0.25;
    opt->set_group(0, c);
  }
  fill(3);
  EXPECT_TRUE(opt->step()) << where;
  same_on_every_rank("after the plans were made alike");
}

// Two communicators (a rows x columns grid): a plan that differs over the row communicator on one
// rank is refused by every rank, those of other row groups included (they learn it through the
// column communicator), and nothing moves. The 2 x 2 grid of 4 ranks is the telling case; on 2
// ranks the column communicator holds one rank.
TEST(Faults, APlanThatDiffersOverOneCommunicatorIsRefusedByEveryRank) {
  const int P = world_size(), rank = world_rank();
  const int dp = P == 4 ? 2 : P, tp = P / dp, d = rank / tp, t = rank % tp;
  MPI_Comm rows_comm, cols_comm;
  MPI_Comm_split(MPI_COMM_WORLD, t, d, &rows_comm);  // the ranks holding the same columns
  MPI_Comm_split(MPI_COMM_WORLD, d, t, &cols_comm);  // the ranks holding the same rows
  auto row_comm = dion3::make_mpi_communicator(&rows_comm, 60.0);
  auto col_comm = dion3::make_mpi_communicator(&cols_comm, 60.0);
  {
    t3::Harness h;
    GroupConfig cfg;
    const int ga = h.opt.add_group(cfg), gb = h.opt.add_group(cfg);
    Rng rng(17);
    const Shard rows = shard_of(8, dp, d), cols = shard_of(6, tp, t);
    t3::HostParam a("row_sharded", DType::F32, {rows.count, 6});
    a.w.assign(rows_of(t3::gaussian(8, 6, rng), 6, rows));
    dion3::ParamSpec sa = a.spec();
    sa.layout.kind = Layout::RowShard;
    sa.layout.comm = row_comm;
    sa.layout.global_rows = 8;
    a.index = h.opt.add_param(gb, sa);
    t3::HostParam b("block", DType::F32, {rows.count, cols.count});
    b.w.assign(std::vector<double>(static_cast<std::size_t>(rows.count) * cols.count, 0.5));
    dion3::ParamSpec sb = b.spec();
    sb.layout.kind = Layout::Block;
    sb.layout.comm = row_comm;
    sb.layout.col_comm = col_comm;
    sb.layout.global_rows = 8;
    sb.layout.global_cols = 6;
    b.index = h.opt.add_param(ga, sb);
    auto fill = [&](int step) {
      Rng g(200 + step);
      a.g.assign(rows_of(t3::gaussian(8, 6, g), 6, rows));
      b.g.assign(std::vector<double>(static_cast<std::size_t>(rows.count) * cols.count, 0.1 * (step + 1)));
    };
    const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(dp) + "x" + std::to_string(tp);
    fill(0);
    ASSERT_TRUE(h.opt.step()) << where;
    if (rank == 0) {  // the row-sharded parameter's plan, over the row communicator only
      GroupConfig c = h.opt.group(gb);
      c.fraction = 0.5;
      h.opt.set_group(gb, c);
    }
    const auto before = t3::snapshot(h.opt, {&a, &b});
    fill(1);
    const std::string what = t3::error_of([&] { h.opt.step(); });
    EXPECT_NE(what.find("planned different steps"), std::string::npos) << where << ": " << what;
    EXPECT_EQ(t3::snapshot(h.opt, {&a, &b}), before) << where << ": a refused step moved something";
    if (rank == 0) {
      GroupConfig c = h.opt.group(gb);
      c.fraction = cfg.fraction;
      h.opt.set_group(gb, c);
    }
    fill(2);
    EXPECT_TRUE(h.opt.step()) << where;
  }
  MPI_Comm_free(&rows_comm);
  MPI_Comm_free(&cols_comm);
}

// Ranks whose parameters span different numbers of communicators: the agreement has one length
// on every rank (its regions are padded), so its digests tell instead of a truncated all-reduce
// (MPI_ERR_TRUNCATE, which ends the job). Ranks 0 .. P-2 hold `second` over a communicator of
// their own; the last rank holds it locally and spans one communicator.
TEST(Faults, RanksSpanningDifferentCommunicatorsAreRefusedByEveryRank) {
  const int P = world_size(), rank = world_rank();
  const bool last = rank == P - 1;
  MPI_Comm some;
  MPI_Comm_split(MPI_COMM_WORLD, last ? MPI_UNDEFINED : 0, rank, &some);
  auto world = dion3::make_mpi_communicator(nullptr, 60.0);
  {
    t3::Harness h;
    const int gi = h.opt.add_group(GroupConfig{});
    Rng rng(19);
    std::vector<std::unique_ptr<t3::HostParam>> ps = replicated_params(h, gi, world, rng, 1);
    t3::HostParam second("second", DType::F32, {8, 6});
    second.w.assign(t3::gaussian(8, 6, rng));
    dion3::ParamSpec spec = second.spec();
    if (!last) {
      spec.layout.kind = Layout::Replicated;
      spec.layout.comm = dion3::make_mpi_communicator(&some, 60.0);
    }
    second.index = h.opt.add_param(gi, spec);
    ps[0]->g.assign(t3::gaussian(8, 6, rng));
    second.g.assign(t3::gaussian(8, 6, rng));
    const auto before = t3::snapshot(h.opt, {ps[0].get(), &second});
    const std::string what = t3::error_of([&] { h.opt.step(); });
    EXPECT_NE(what.find("span different numbers of communicators (" + std::string(last ? "1" : "2") + " on this rank)"),
              std::string::npos) << "rank " << rank << ": " << what;
    EXPECT_EQ(t3::snapshot(h.opt, {ps[0].get(), &second}), before) << "rank " << rank << ": a refused step moved something";
  }
  if (!last) MPI_Comm_free(&some);
}

TEST(Faults, WrongShardIsRefusedWithTheRowsItShouldHold) {
  const int P = world_size(), rank = world_rank();
  auto comm = dion3::make_mpi_communicator(nullptr, 60.0);
  t3::Harness h;
  const int gi = h.opt.add_group(GroupConfig{});
  t3::HostParam p("attn.weight", DType::F32, {5, 8});  // never a shard of 20 + P rows: ceil((20 + P) / P) != 5
  dion3::ParamSpec spec = p.spec();
  spec.layout.kind = Layout::RowShard;
  spec.layout.comm = comm;
  spec.layout.global_rows = 20 + P;
  const std::string what = t3::error_of([&] { h.opt.add_param(gi, spec); });
  EXPECT_NE(what.find("must hold rows"), std::string::npos) << "rank " << rank << ": " << what;
}

// The C API's distributed path: a row-sharded Dion3 parameter through dion3_add_param_layout
// equals the same engine driven from C++ (same rule, same bits).
TEST(CApi, RowShardedParameterThroughTheCApi) {
  const int P = world_size(), rank = world_rank();
  dion3_comm* comm = nullptr;
  ASSERT_EQ(dion3_comm_create_mpi(&comm, nullptr, 60.0), DION3_OK) << dion3_last_error();
  int r = -1, n = -1;
  ASSERT_EQ(dion3_comm_rank(comm, &r, &n), DION3_OK);
  EXPECT_EQ(r, rank);
  EXPECT_EQ(n, P);
  dion3_optimizer* opt = nullptr;
  ASSERT_EQ(dion3_create(&opt, DION3_DEVICE_CPU, 0, nullptr, DION3_NONFINITE_RAISE), DION3_OK);
  dion3_group_config cfg;
  dion3_group_config_default(&cfg);
  cfg.selection_scope = DION3_SCOPE_GLOBAL;
  int g = -1;
  ASSERT_EQ(dion3_add_group(opt, &cfg, &g), DION3_OK);
  const int m = 30, cols = 20;
  const Shard s = shard_of(m, P, rank);
  Rng rng(99);
  const ref::Mat W0 = t3::gaussian(m, cols, rng, 0.05), G = t3::gaussian(m, cols, rng);
  std::vector<float> w(static_cast<std::size_t>(s.count) * cols), gr(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    w[i] = static_cast<float>(W0[s.first * cols + i]);
    gr[i] = static_cast<float>(G[s.first * cols + i]);
  }
  dion3_tensor wt = {w.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {s.count, cols}};
  dion3_tensor gt = {gr.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {s.count, cols}};
  dion3_layout layout = {DION3_LAYOUT_ROW_SHARD, m, comm, 0, nullptr, 0, 0};
  ASSERT_EQ(dion3_add_param_layout(opt, g, "w", &wt, &gt, &layout, nullptr), DION3_OK) << dion3_last_error();
  int applied = 0;
  ASSERT_EQ(dion3_step(opt, &applied), DION3_OK) << dion3_last_error();
  EXPECT_EQ(applied, 1);
  ref::Mat W = W0, M(W0.size(), 0.0);
  ref::Vec v(m, 0.0);
  GroupConfig gc;
  gc.selection_scope = dion3::SelectionScope::Global;
  ref::dion3_step_sharded(W, M, v, G, m, cols, t3::matrix_hyper(gc, DType::F32), P, ref::Scope::Global);
  std::vector<double> got(w.begin(), w.end());
  EXPECT_LE(t3::max_abs_diff(got, rows_of(W, cols, s)), 1e-5) << "rank " << rank;
  size_t count = 0;
  dion3_megabatch_info info;
  ASSERT_EQ(dion3_plan(opt, &info, 1, &count), DION3_OK);
  // The last rank has no gradient this step: it refuses, and every rank's step fails alike.
  const std::vector<float> kept = w;
  const dion3_status refused = rank == P - 1 ? dion3_refuse_step(opt) : dion3_step(opt, &applied);
  EXPECT_EQ(refused, DION3_INVALID_ARGUMENT) << "rank " << rank << ": " << dion3_last_error();
  EXPECT_EQ(w, kept) << "rank " << rank << ": a refused step moved the weights";
  // Rank 0 found something invalid of its own: its refusal makes every other rank's step fail.
  if (rank == 0) {
    EXPECT_EQ(dion3_refuse_invalid(opt), DION3_OK) << dion3_last_error();
  } else {
    EXPECT_EQ(dion3_step(opt, &applied), DION3_INVALID_ARGUMENT) << "rank " << rank;
    EXPECT_NE(std::string(dion3_last_error()).find("another rank refused this step"), std::string::npos)
        << "rank " << rank << ": " << dion3_last_error();
  }
  EXPECT_EQ(w, kept) << "rank " << rank << ": a refused step moved the weights";
  ASSERT_EQ(dion3_step(opt, &applied), DION3_OK) << "rank " << rank << ": " << dion3_last_error();
  EXPECT_EQ(applied, 1);
  dion3_destroy(opt);
  dion3_comm_destroy(comm);
}

// A row cut of its own through the C API (row_offset / row_chunk: the ranks' chunks rotated, so
// rank r holds chunk r + 1) steps as the C++ engine given the same ParamLayout, bit for bit. Row
// blocks of 10 and 20 rows straddle the shards, so where each rank's rows lie decides the result.
TEST(CApi, RowShardedParameterWithItsOwnCut) {
  const int P = world_size(), rank = world_rank();
  const int m = 30, cols = 20, c = (m + P - 1) / P;
  const int first = std::min(m, ((rank + 1) % P) * c), count = std::min(c, m - first);
  Rng rng(7);
  const ref::Mat W0 = t3::gaussian(m, cols, rng, 0.05), G = t3::gaussian(m, cols, rng);
  auto rows = [&](const ref::Mat& A) {
    return std::vector<float>(A.begin() + first * cols, A.begin() + (first + count) * cols);
  };
  std::vector<float> wc = rows(W0), gc = rows(G), wx = wc, gx = gc;

  dion3_comm* comm = nullptr;
  ASSERT_EQ(dion3_comm_create_mpi(&comm, nullptr, 60.0), DION3_OK) << dion3_last_error();
  dion3_optimizer* opt = nullptr;
  ASSERT_EQ(dion3_create(&opt, DION3_DEVICE_CPU, 0, nullptr, DION3_NONFINITE_RAISE), DION3_OK);
  dion3_group_config cfg;
  dion3_group_config_default(&cfg);
  cfg.num_split_sizes = 2;
  cfg.split_sizes[0] = 10;
  cfg.split_sizes[1] = 20;
  int g = -1;
  ASSERT_EQ(dion3_add_group(opt, &cfg, &g), DION3_OK);
  dion3_tensor wt = {wc.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {count, cols}};
  dion3_tensor gt = {gc.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {count, cols}};
  dion3_layout layout = {DION3_LAYOUT_ROW_SHARD, m, comm, 0, nullptr, first, c};
  ASSERT_EQ(dion3_add_param_layout(opt, g, "w", &wt, &gt, &layout, nullptr), DION3_OK) << dion3_last_error();
  ASSERT_EQ(dion3_step(opt, nullptr), DION3_OK) << dion3_last_error();

  dion3::Optimizer cpp(dion3::make_cpu_backend());
  GroupConfig blocks;
  blocks.split_sizes = {10, 20};
  const int gi = cpp.add_group(blocks);
  dion3::ParamSpec spec;
  spec.name = "w";
  spec.weight = {wx.data(), DType::F32, dion3::Device::CPU, 0, {count, cols}};
  spec.grad = {gx.data(), DType::F32, dion3::Device::CPU, 0, {count, cols}};
  spec.layout.kind = Layout::RowShard;
  spec.layout.comm = dion3::make_mpi_communicator(nullptr, 60.0);
  spec.layout.global_rows = m;
  spec.layout.row_offset = first;
  spec.layout.row_chunk = c;
  cpp.add_param(gi, spec);
  ASSERT_TRUE(cpp.step());
  EXPECT_EQ(wc, wx) << "rank " << rank;
  EXPECT_NE(wc, rows(W0)) << "the step moved nothing";

  // A negative row_chunk is refused, naming the parameter.
  dion3_layout bad = layout;
  bad.row_chunk = -1;
  EXPECT_EQ(dion3_add_param_layout(opt, g, "w2", &wt, &gt, &bad, nullptr), DION3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion3_last_error()).find("'w2': layout row_chunk is -1"), std::string::npos)
      << dion3_last_error();
  bad = layout;
  bad.row_offset = -1;
  EXPECT_EQ(dion3_add_param_layout(opt, g, "w2", &wt, &gt, &bad, nullptr), DION3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion3_last_error()).find("row_offset is -1"), std::string::npos) << dion3_last_error();
  bad = layout;  // an offset without its chunk: refused, as by the C++ ParamLayout
  bad.row_offset = 3;
  bad.row_chunk = 0;
  EXPECT_EQ(dion3_add_param_layout(opt, g, "w2", &wt, &gt, &bad, nullptr), DION3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion3_last_error()).find("row_offset is 3 but row_chunk is 0"), std::string::npos)
      << dion3_last_error();
  // A chunk larger than the matrix, or one whose P copies wrap past int64, is no cut of it (own
  // buffers, so that no memory overlap is what refuses them).
  std::vector<float> w2 = wc, g2 = gc;
  dion3_tensor w2t = {w2.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {count, cols}};
  dion3_tensor g2t = {g2.data(), DION3_F32, DION3_DEVICE_CPU, 0, 2, {count, cols}};
  for (const int64_t chunk : {int64_t{m} + 1, int64_t{1} << 62}) {
    bad = layout;
    bad.row_chunk = chunk;
    EXPECT_EQ(dion3_add_param_layout(opt, g, "w2", &w2t, &g2t, &bad, nullptr), DION3_INVALID_ARGUMENT) << chunk;
    EXPECT_NE(std::string(dion3_last_error()).find("not a cut of the matrix"), std::string::npos) << dion3_last_error();
  }
  bad = layout;
  bad.kind = DION3_LAYOUT_REPLICATED;
  EXPECT_EQ(dion3_add_param_layout(opt, g, "w2", &wt, &gt, &bad, nullptr), DION3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dion3_last_error()).find("describe a ROW_SHARD cut"), std::string::npos) << dion3_last_error();
  dion3_destroy(opt);
  dion3_comm_destroy(comm);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  // One full report from rank 0; the other ranks print their failures only.
  if (world_rank() != 0) GTEST_FLAG_SET(brief, true);
  int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (worst != 0 && world_rank() == 0 && rc == 0) std::printf("a test failed on another rank (see its output)\n");
  MPI_Finalize();
  return worst;
}
