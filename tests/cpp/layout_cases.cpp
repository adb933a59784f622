// tests/cpp/layout_cases.cpp — the distributed layouts' checks shared by the MPI and thread-rank
// suites (see layout_cases.hpp).
#include "layout_cases.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "dion3/error.hpp"
#include "reference.hpp"
#include "test_util.hpp"
#include "thread_comm.hpp"

namespace t3 {

using dion3::Algorithm;
using dion3::DType;
using dion3::GroupConfig;
using dion3::Layout;

Shard shard_of(int m, int ranks, int r) {
  const int c = (m + ranks - 1) / ranks;
  const int first = std::min(m, r * c);
  return {first, std::min(c, m - first)};
}

std::vector<double> rows_of(const std::vector<double>& full, int n, Shard s) {
  return {full.begin() + static_cast<long>(s.first) * n, full.begin() + static_cast<long>(s.first + s.count) * n};
}

std::vector<double> part_of(const std::vector<double>& full, int n, Shard r, Shard c) {
  std::vector<double> out;
  for (int i = r.first; i < r.first + r.count; ++i)
    for (int j = c.first; j < c.first + c.count; ++j) out.push_back(full[static_cast<std::size_t>(i) * n + j]);
  return out;
}

RankBackend host_backend() {
  RankBackend m;
  m.make_backend = [] { return dion3::make_cpu_backend(); };
  m.alloc = [](std::size_t bytes) { return std::calloc(std::max<std::size_t>(bytes, 1), 1); };
  m.release = [](void* p) { std::free(p); };
  m.upload = [](void* dst, const void* src, std::size_t bytes) { if (bytes) std::memcpy(dst, src, bytes); };
  m.download = m.upload;
  return m;
}

namespace {

// One fp32 rows x cols tensor in a rank's parameter memory.
class RankTensor {
 public:
  RankTensor(const RankBackend& be, int rows, int cols)
      : be_(&be), rows_(rows), cols_(cols), data_(be.alloc(bytes())) {}
  ~RankTensor() { be_->release(data_); }
  RankTensor(const RankTensor&) = delete;
  RankTensor& operator=(const RankTensor&) = delete;
  std::size_t bytes() const { return static_cast<std::size_t>(rows_) * cols_ * sizeof(float); }
  void assign(const std::vector<double>& v) {
    const std::vector<float> f(v.begin(), v.end());
    be_->upload(data_, f.data(), bytes());
  }
  std::vector<double> values() const {
    std::vector<float> f(static_cast<std::size_t>(rows_) * cols_);
    be_->download(f.data(), data_, bytes());
    return {f.begin(), f.end()};
  }
  dion3::TensorView view() const {
    return {data_, DType::F32, be_->device, be_->device_index, {rows_, cols_}};
  }

 private:
  const RankBackend* be_;
  int rows_, cols_;
  void* data_;
};

// One distributed matrix parameter: the whole matrix's reference state and this rank's part.
struct DistParam {
  int m = 0, n = 0;
  Shard rows{0, 0}, cols{0, 0};  // held here
  bool transposed = false;       // held (and registered) as the part's transpose
  ref::Mat W, M;
  ref::Vec v;
  std::unique_ptr<RankTensor> w, g;
  int index = -1;

  DistParam(const RankBackend& be, int m_, int n_, Shard r, Shard c, Rng& rng, bool t = false)
      : m(m_), n(n_), rows(r), cols(c), transposed(t) {
    W = gaussian(m, n, rng, 0.05);
    M.assign(static_cast<std::size_t>(m) * n, 0.0);
    v.assign(m, 0.0);
    w = std::make_unique<RankTensor>(be, t ? cols.count : rows.count, t ? rows.count : cols.count);
    g = std::make_unique<RankTensor>(be, t ? cols.count : rows.count, t ? rows.count : cols.count);
    w->assign(held(W));
  }
  // This rank's part of a whole m x n matrix, as it is held.
  std::vector<double> held(const ref::Mat& full) const {
    const std::vector<double> part = part_of(full, n, rows, cols);
    return transposed ? ref::transpose(part, rows.count, cols.count) : part;
  }
  dion3::ParamSpec spec(const std::string& name) const {
    dion3::ParamSpec s;
    s.name = name;
    s.weight = w->view();
    s.grad = g->view();
    s.layout.global_rows = transposed ? n : m;
    s.layout.global_cols = transposed ? m : n;
    return s;
  }
  std::vector<double> variance_rows() const {
    return {v.begin() + rows.first, v.begin() + rows.first + rows.count};
  }
};

// A state tensor of a parameter as doubles, through the host copy every backend exports.
std::vector<double> exported(const dion3::OptimizerState& st, int param, const std::string& name) {
  for (const auto& [n, t] : st.params.at(static_cast<std::size_t>(param)).tensors) {
    if (n != name) continue;
    Buffer b(t.dtype, t.shape);
    b.bytes = t.data;
    return b.values();
  }
  ADD_FAILURE() << "parameter " << param << " has no state tensor '" << name << "'";
  return {};
}

// The parameter's weights, momentum (where it holds columns) and its rows' variance (with
// columns or without) against the reference after `step` steps.
void expect_matches(const dion3::OptimizerState& st, const DistParam& d, const RankBackend& be, const std::string& where,
                    int step) {
  const std::vector<double> want = d.held(d.W);
  // A 16-bit iteration moves each weight by lr times an orthogonalized entry off by its rounding,
  // most on the smallest blocks (a 1 x 1 or 3 x 3 head): their few entries average nothing out,
  // and Polar Express's first step cancels terms much larger than its result.
  const bool f32 = be.iteration == DType::F32;
  const double off = f32 ? 0.0 : 0.1;
  const double tol = weight_tol(DType::F32, max_abs(d.W), 0.02 * step) + off * 0.02 * step;
  const double variance_tol = f32 ? 1e-3 : 2 * off;
  EXPECT_LE(max_abs_diff(d.w->values(), want), tol) << where << " (" << d.m << "x" << d.n << "), step " << step;
  if (d.rows.count > 0 && d.cols.count > 0) {
    EXPECT_LE(rel_max_diff(exported(st, d.index, "momentum"), d.held(d.M)), 1e-5)
        << "momentum: " << where << ", step " << step;
  }
  if (d.rows.count > 0) {
    EXPECT_LE(rel_max_diff(exported(st, d.index, "variance"), d.variance_rows()), variance_tol)
        << "variance: " << where << " (" << d.cols.count << " columns here), step " << step;
  }
}

// Whether every rank of comm holds the same values, bit for bit: each rank's 64-bit digest of
// them in 16-bit words and their complements, all-reduced (max); a word and its complement sum
// to 0xFFFF after the maximum exactly when every rank had that word.
bool same_on_every_rank(const std::vector<double>& values, const RankBackend& be, dion3::Communicator& comm) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (double v : values) {
    const float f = static_cast<float>(v);
    unsigned char b[sizeof f];
    std::memcpy(b, &f, sizeof f);
    for (unsigned char c : b) h = (h ^ c) * 1099511628211ull;
  }
  std::vector<int32_t> words(8);
  for (int k = 0; k < 4; ++k) {
    words[k] = static_cast<int32_t>((h >> (16 * k)) & 0xFFFF);
    words[4 + k] = 0xFFFF - words[k];
  }
  void* buf = be.alloc(words.size() * sizeof(int32_t));
  be.upload(buf, words.data(), words.size() * sizeof(int32_t));
  comm.all_reduce_max(static_cast<int32_t*>(buf), words.size(), nullptr, "replica digest")->wait();
  be.download(words.data(), buf, words.size() * sizeof(int32_t));
  be.release(buf);
  for (int k = 0; k < 4; ++k)
    if (words[k] + words[4 + k] != 0xFFFF) return false;
  return true;
}

}  // namespace

const std::vector<LayoutCase>& layout_cases() {
  // Several matrices per megabatch (not a multiple of the ranks), a wide and a tall one, uneven
  // shards (10 rows) and shards that leave a rank empty (3 rows on 4 ranks).
  static const std::vector<std::pair<int, int>> rows = {{24, 40}, {24, 40}, {24, 40}, {48, 20}, {10, 16}, {3, 12}};
  // Column shards: uneven (18 columns) and ones that leave ranks without columns (3 on 4 ranks,
  // 1 on any number).
  static const std::vector<std::pair<int, int>> cols = {{24, 40}, {24, 40}, {24, 40}, {40, 18}, {12, 3}, {12, 1}};
  static const std::vector<std::pair<int, int>> five(5, {12, 20});
  using S = dion3::SelectionScope;
  static const std::vector<LayoutCase> cases = {
      {"ddp_dion3", Layout::Replicated, Algorithm::Dion3, S::Local, rows},
      {"ddp_normuon", Layout::Replicated, Algorithm::NorMuon, S::Local, rows},
      {"rows_dion3_local", Layout::RowShard, Algorithm::Dion3, S::Local, rows},
      {"rows_dion3_global", Layout::RowShard, Algorithm::Dion3, S::Global, rows},
      {"rows_dion3_half", Layout::RowShard, Algorithm::Dion3, S::Local, rows, 0.5},
      {"rows_normuon", Layout::RowShard, Algorithm::NorMuon, S::Local, rows},
      {"rows_dion3_per_matrix", Layout::RowShard, Algorithm::Dion3, S::Local, rows, 0.25, 3, false},
      {"ddp_dion3_per_matrix", Layout::Replicated, Algorithm::Dion3, S::Local, rows, 0.25, 3, false},
      {"cols_dion3", Layout::ColShard, Algorithm::Dion3, S::Local, cols},
      {"cols_normuon", Layout::ColShard, Algorithm::NorMuon, S::Local, cols},
      // Megabatches orthogonalized a matrix at a time, their exchanges in as many rounds.
      {"ddp_dion3_chunks", Layout::Replicated, Algorithm::Dion3, S::Local, rows, 0.25, 3, true, 1},
      {"rows_dion3_global_chunks", Layout::RowShard, Algorithm::Dion3, S::Global, rows, 0.25, 3, true, 1},
      {"cols_normuon_chunks", Layout::ColShard, Algorithm::NorMuon, S::Local, cols, 0.25, 3, true, 1},
      // Five matrices of a shape: on four ranks (blocks of two) the last rank owns none.
      {"ddp_dion3_five", Layout::Replicated, Algorithm::Dion3, S::Local, five},
      {"cols_dion3_five", Layout::ColShard, Algorithm::Dion3, S::Local, five},
      // Parameters without a gradient at some steps, some megabatches' members together.
      {"ddp_dion3_absent", Layout::Replicated, Algorithm::Dion3, S::Local, rows, 0.25, 5, true, 0, true},
      {"ddp_normuon_chunks_absent", Layout::Replicated, Algorithm::NorMuon, S::Local, rows, 0.25, 5, true, 1, true},
      {"rows_dion3_local_absent", Layout::RowShard, Algorithm::Dion3, S::Local, rows, 0.25, 5, true, 0, true},
      {"rows_dion3_global_absent", Layout::RowShard, Algorithm::Dion3, S::Global, rows, 0.25, 5, true, 0, true},
      {"rows_normuon_absent", Layout::RowShard, Algorithm::NorMuon, S::Local, rows, 0.25, 5, true, 0, true},
      {"cols_dion3_absent", Layout::ColShard, Algorithm::Dion3, S::Local, cols, 0.25, 5, true, 0, true},
      // Transposed groups (weights stored (in, out)): replicated, and cut along the stored rows
      // (FSDP2's Shard(0)), which the rule steps column-sharded.
      {"ddp_dion3_transposed", Layout::Replicated, Algorithm::Dion3, S::Local, rows, 0.25, 3, true, 0, false, true},
      {"fsdp_dion3_transposed", Layout::RowShard, Algorithm::Dion3, S::Local, cols, 0.25, 3, true, 0, false, true},
      {"fsdp_normuon_transposed_chunks", Layout::RowShard, Algorithm::NorMuon, S::Local, cols, 0.25, 3, true, 1, false,
       true},
      {"fsdp_dion3_transposed_absent", Layout::RowShard, Algorithm::Dion3, S::Local, cols, 0.5, 5, true, 0, true, true},
      // Blocks of output features (GPT-2's fused c_attn): each its own matrix, sharded or not.
      {"fsdp_dion3_transposed_heads", Layout::RowShard, Algorithm::Dion3, S::Local, cols, 0.25, 3, true, 0, false, true,
       4},
      {"ddp_normuon_transposed_heads", Layout::Replicated, Algorithm::NorMuon, S::Local, cols, 0.25, 3, true, 0, false,
       true, 4},
  };
  return cases;
}

bool absent_at(std::size_t param, int step) { return step > 1 && (param + static_cast<std::size_t>(step)) % 3 == 0; }

void check_layout_case(const LayoutCase& c, const RankBackend& be, const std::shared_ptr<dion3::Communicator>& comm) {
  const int P = comm->size(), rank = comm->rank();
  GroupConfig g;
  g.algorithm = c.algorithm;
  g.lr = 0.02;
  g.fraction = c.fraction;
  g.weight_decay = 0.01;
  g.selection_scope = c.scope;
  g.transposed = c.transposed;
  g.num_heads = c.heads;
  g.orth.iteration_dtype = be.iteration;
  const ref::MatrixHyper hyper = matrix_hyper(g, DType::F32);

  dion3::OptimizerOptions options;
  options.megabatch = c.megabatch;
  options.workspace_limit = c.workspace_limit;
  dion3::Optimizer opt(be.make_backend(), options);
  const int gi = opt.add_group(g);
  // The single-process engine the replicated layout must equal bit for bit.
  dion3::Optimizer single(be.make_backend());
  single.add_group(g);
  std::vector<std::unique_ptr<RankTensor>> single_w, single_g;

  Rng rng(4242);  // the same stream on every rank
  std::vector<std::unique_ptr<DistParam>> ps;
  for (std::size_t i = 0; i < c.shapes.size(); ++i) {
    const auto [m, n] = c.shapes[i];
    // A transposed group's stored rows are the rule's columns.
    const bool cut_rows = c.layout == (c.transposed ? Layout::ColShard : Layout::RowShard);
    const bool cut_cols = c.layout == (c.transposed ? Layout::RowShard : Layout::ColShard);
    const Shard rows = cut_rows ? shard_of(m, P, rank) : Shard{0, m};
    const Shard cols = cut_cols ? shard_of(n, P, rank) : Shard{0, n};
    auto d = std::make_unique<DistParam>(be, m, n, rows, cols, rng, c.transposed);
    const std::string name = "layer" + std::to_string(i) + ".weight";
    dion3::ParamSpec spec = d->spec(name);
    spec.layout.kind = c.layout;
    spec.layout.comm = comm;
    d->index = opt.add_param(gi, spec);
    if (c.layout == Layout::Replicated) {
      single_w.push_back(std::make_unique<RankTensor>(be, c.transposed ? n : m, c.transposed ? m : n));
      single_g.push_back(std::make_unique<RankTensor>(be, c.transposed ? n : m, c.transposed ? m : n));
      single_w.back()->assign(d->held(d->W));
      dion3::ParamSpec s;
      s.name = name;
      s.weight = single_w.back()->view();
      s.grad = single_g.back()->view();
      single.add_param(0, s);
    }
    ps.push_back(std::move(d));
  }

  // Megabatches: one per shape, or one per matrix.
  std::vector<std::pair<int, int>> distinct = c.shapes;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  EXPECT_EQ(opt.plan().size(), c.megabatch ? distinct.size() : c.shapes.size()) << c.name;
  if (c.workspace_limit == 1) {
    for (const dion3::MegabatchInfo& mb : opt.plan()) EXPECT_LE(mb.chunk, 1) << c.name << ": chunks of one matrix";
  }
  for (int step = 1; step <= c.steps; ++step) {
    for (std::size_t i = 0; i < ps.size(); ++i) {
      DistParam& d = *ps[i];
      const ref::Mat G = gaussian(d.m, d.n, rng);
      const int index = static_cast<int>(i);
      if (c.absent && absent_at(i, step)) {
        opt.clear_grad(d.index);
        if (c.layout == Layout::Replicated) single.clear_grad(index);
        continue;
      }
      if (c.absent) {
        opt.set_grad(d.index, d.g->view());
        if (c.layout == Layout::Replicated) single.set_grad(index, single_g[i]->view());
      }
      d.g->assign(d.held(G));
      if (c.layout == Layout::Replicated) single_g[i]->assign(d.held(G));
      const bool rows_cut = c.layout == Layout::RowShard && !c.transposed;
      const ref::Scope scope = c.scope == dion3::SelectionScope::Global ? ref::Scope::Global : ref::Scope::Local;
      if (rows_cut && c.algorithm == Algorithm::Dion3) ref::dion3_step_sharded(d.W, d.M, d.v, G, d.m, d.n, hyper, P, scope);
      else if (rows_cut) ref::normuon_step_sharded(d.W, d.M, d.v, G, d.m, d.n, hyper, P);
      else
        for (int h = 0, b = d.m / std::max(c.heads, 1); h < std::max(c.heads, 1); ++h) {  // each block its own matrix
          const std::size_t at = static_cast<std::size_t>(h) * b * d.n, len = static_cast<std::size_t>(b) * d.n;
          ref::Mat W = slice(d.W, at, len), M = slice(d.M, at, len);
          ref::Vec v = slice(d.v, static_cast<std::size_t>(h) * b, b);
          if (c.algorithm == Algorithm::Dion3) ref::dion3_step(W, M, v, slice(G, at, len), b, d.n, hyper);
          else ref::normuon_step(W, M, v, slice(G, at, len), b, d.n, hyper);
          std::copy(W.begin(), W.end(), d.W.begin() + at);
          std::copy(M.begin(), M.end(), d.M.begin() + at);
          std::copy(v.begin(), v.end(), d.v.begin() + static_cast<std::ptrdiff_t>(h) * b);
        }
    }
    const dion3::OptimizerState before = opt.export_state();
    std::vector<std::vector<double>> weights_before;
    for (const auto& d : ps) weights_before.push_back(d->w->values());
    ASSERT_TRUE(opt.step()) << c.name << ", rank " << rank;
    if (c.layout == Layout::Replicated) {
      ASSERT_TRUE(single.step());
    }
    const dion3::OptimizerState st = opt.export_state();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const std::string where = c.name + ", rank " + std::to_string(rank) + " of " + std::to_string(P) +
                                ", parameter " + std::to_string(i);
      if (c.absent && absent_at(i, step)) {
        EXPECT_EQ(ps[i]->w->values(), weights_before[i])
            << where << ": moved at step " << step << " without a gradient";
        for (const char* state : {"momentum", "variance"})
          EXPECT_EQ(exported(st, ps[i]->index, state), exported(before, ps[i]->index, state))
              << where << ": its " << state << " moved at step " << step << " without a gradient";
      }
      expect_matches(st, *ps[i], be, where, step);
      if (c.layout == Layout::Replicated) {
        const std::vector<double> w = ps[i]->w->values();
        EXPECT_TRUE(same_on_every_rank(w, be, *comm)) << "replicas differ: " << where << ", step " << step;
        if (be.batch_invariant) {
          EXPECT_EQ(w, single_w[i]->values())
              << "replicated run differs from the single-process engine: " << where << ", step " << step;
        }
      }
    }
  }
}

void check_block_case(const RankBackend& be, const std::shared_ptr<dion3::Communicator>& row_comm,
                      const std::shared_ptr<dion3::Communicator>& col_comm) {
  const int dp = row_comm->size(), d = row_comm->rank(), tp = col_comm->size(), t = col_comm->rank();
  for (Algorithm algo : {Algorithm::Dion3, Algorithm::NorMuon}) {
    GroupConfig g;
    g.algorithm = algo;
    g.lr = 0.02;
    g.orth.iteration_dtype = be.iteration;
    const ref::MatrixHyper hyper = matrix_hyper(g, DType::F32);
    dion3::Optimizer opt(be.make_backend());
    const int gi = opt.add_group(g);
    Rng rng(808);
    std::vector<std::unique_ptr<DistParam>> ps;
    for (auto [m, n] : std::vector<std::pair<int, int>>{{24, 40}, {24, 40}, {30, 18}, {3, 7}, {6, 1}}) {
      auto q = std::make_unique<DistParam>(be, m, n, shard_of(m, dp, d), shard_of(n, tp, t), rng);
      dion3::ParamSpec spec = q->spec("block" + std::to_string(ps.size()) + ".weight");
      spec.layout.kind = Layout::Block;
      spec.layout.comm = row_comm;
      spec.layout.col_comm = col_comm;
      q->index = opt.add_param(gi, spec);
      ps.push_back(std::move(q));
    }
    for (int step = 1; step <= 3; ++step) {
      for (auto& q : ps) {
        const ref::Mat G = gaussian(q->m, q->n, rng);
        q->g->assign(part_of(G, q->n, q->rows, q->cols));
        if (algo == Algorithm::Dion3) ref::dion3_step_sharded(q->W, q->M, q->v, G, q->m, q->n, hyper, dp, ref::Scope::Local);
        else ref::normuon_step_sharded(q->W, q->M, q->v, G, q->m, q->n, hyper, dp);
      }
      ASSERT_TRUE(opt.step());
      const dion3::OptimizerState st = opt.export_state();
      for (std::size_t i = 0; i < ps.size(); ++i)
        expect_matches(st, *ps[i], be,
                       "grid " + std::to_string(dp) + "x" + std::to_string(tp) + ", " + dion3::algorithm_name(algo) +
                           ", row rank " + std::to_string(d) + ", column rank " + std::to_string(t) + ", parameter " +
                           std::to_string(i),
                       step);
    }
  }
}

void check_agreement_case(const RankBackend& be, const std::shared_ptr<dion3::Communicator>& comm) {
  const int P = comm->size(), rank = comm->rank();
  dion3::Optimizer opt(be.make_backend());
  GroupConfig matrices;
  matrices.lr = 0.02;
  matrices.orth.iteration_dtype = be.iteration;
  GroupConfig adamw;
  adamw.algorithm = Algorithm::AdamW;
  const int gm = opt.add_group(matrices), ge = opt.add_group(adamw);
  Rng rng(77);  // the same stream on every rank
  std::vector<std::unique_ptr<DistParam>> ps;
  auto add = [&](int group, Layout layout, int m, int n) {
    const Shard rows = layout == Layout::RowShard ? shard_of(m, P, rank) : Shard{0, m};
    ps.push_back(std::make_unique<DistParam>(be, m, n, rows, Shard{0, n}, rng));
    dion3::ParamSpec spec = ps.back()->spec("p" + std::to_string(ps.size()));
    spec.layout.kind = layout;
    spec.layout.comm = comm;
    ps.back()->index = opt.add_param(group, spec);
  };
  add(gm, Layout::Replicated, 8, 6);
  add(gm, Layout::Replicated, 8, 6);
  add(gm, Layout::RowShard, 10, 6);
  add(ge, Layout::Replicated, 8, 6);
  auto grads = [&] {
    for (auto& d : ps) d->g->assign(rows_of(gaussian(d->m, d->n, rng), d->n, d->rows));
  };
  // Weights, state and counters, as this rank holds them (reading the counters waits for the step).
  auto snapshot = [&] {
    std::vector<double> s = {static_cast<double>(opt.steps_taken()), static_cast<double>(opt.steps_skipped())};
    for (auto& d : ps) {
      const std::vector<double> w = d->w->values();
      s.insert(s.end(), w.begin(), w.end());
    }
    for (const dion3::ParamState& p : opt.export_state().params)
      for (const auto& [name, t] : p.tensors) {
        Buffer b(t.dtype, t.shape);
        b.bytes = t.data;
        const std::vector<double> v = b.values();
        s.insert(s.end(), v.begin(), v.end());
      }
    return s;
  };
  auto step_together = [&](const std::string& where) {
    grads();
    ASSERT_TRUE(opt.step()) << where;
    for (auto& d : ps) {
      if (d->rows.count == d->m) {
        EXPECT_TRUE(same_on_every_rank(d->w->values(), be, *comm)) << where << ": the replicas parted";
      }
    }
  };
  step_together("rank " + std::to_string(rank) + ", first step");

  const std::vector<std::pair<const char*, std::function<void(GroupConfig&)>>> changes = {
      {"lr", [](GroupConfig& c) { c.lr *= 1.5; }},
      {"weight_decay", [](GroupConfig& c) { c.weight_decay += 0.01; }},
      {"mu", [](GroupConfig& c) { c.mu = 0.9; }},
      {"betas", [](GroupConfig& c) { c.betas[1] = 0.99; }},
  };
  for (int gi : {gm, ge}) {
    for (const auto& [name, change] : changes) {
      for (bool async : {false, true}) {
        const std::string where = "rank " + std::to_string(rank) + ", group " + std::to_string(gi) + ", " + name +
                                  (async ? ", enqueued" : "");
        const std::vector<double> before = snapshot();
        const GroupConfig kept = opt.group(gi);
        GroupConfig c = kept;
        change(c);
        if (rank == P - 1) opt.set_group(gi, c);
        grads();
        if (async) {  // nothing raised now: the step is dropped on every rank, counted nowhere
          EXPECT_EQ(error_of([&] { opt.step_async(); }), "") << where;
        } else {
          dion3::Status st = dion3::Status::Ok;
          const std::string what = error_of([&] { opt.step(); }, &st);
          EXPECT_EQ(st, dion3::Status::InvalidArgument) << where << ": " << what;
          EXPECT_NE(what.find("stepped with different hyper-parameters"), std::string::npos) << where << ": " << what;
        }
        EXPECT_EQ(snapshot(), before) << where << ": a refused step moved something";
        opt.set_group(gi, kept);
        if (async) {  // the next call tells every rank, before it steps
          grads();
          if (rank == 0 && gi == gm && std::string(name) == "lr") {
            // A rank that would refuse this call as invalid runs no collective either.
            EXPECT_EQ(error_of([&] { opt.refuse_invalid(); }), "") << where;
          } else {
            const std::string what = error_of([&] { opt.step(); });
            EXPECT_NE(what.find("the last step, only enqueued (step_async), was not applied: the ranks"),
                      std::string::npos) << where << ": " << what;
            EXPECT_NE(what.find("stepped with different hyper-parameters"), std::string::npos) << where << ": " << what;
          }
          EXPECT_EQ(snapshot(), before) << where << ": the call that reported it stepped";
        }
        step_together(where + ", then alike");
      }
    }
  }
  // Rank 0's lr is finite but overflows float32 after adjust_lr (8 x 6: times sqrt(8 / 6)).
  const GroupConfig kept = opt.group(gm);
  for (int mode = 0; mode < 3; ++mode) {  // 1: the others only enqueue; 2: rank 0 has no gradients
    const std::string where = "rank " + std::to_string(rank) + (mode == 1 ? ", enqueued" : mode == 2 ? ", refusing" : "");
    const std::vector<double> before = snapshot();
    GroupConfig c = kept;
    c.lr = 3.3e38;
    if (rank == 0) opt.set_group(gm, c);
    grads();
    dion3::Status st = dion3::Status::Ok;
    const std::string what = error_of(
        [&] {
          if (rank == 0 && mode == 2) opt.refuse_step();
          else if (rank != 0 && mode == 1) opt.step_async();
          else opt.step();
        },
        &st);
    if (rank == 0 || mode != 1) {
      EXPECT_EQ(st, dion3::Status::InvalidArgument) << where << ": " << what;
    }
    if (rank == 0) {
      EXPECT_NE(what.find("not finite in float32"), std::string::npos) << where << ": " << what;
    } else if (mode != 1) {
      EXPECT_NE(what.find("another rank refused this step"), std::string::npos) << where << ": " << what;
    } else {
      EXPECT_EQ(what, "") << where;
    }
    EXPECT_EQ(snapshot(), before) << where << ": a refused step moved something";
    opt.set_group(gm, kept);
    step_together(where + ", then valid");
  }
  // A matrix without a gradient on one rank only is refused on every rank, nothing modified (its
  // replicas would part); without one on every rank it is left alone and the others step.
  for (bool everywhere : {false, true}) {
    const std::string where = "rank " + std::to_string(rank) + (everywhere ? ", p2 without a gradient on every rank"
                                                                           : ", p2 without a gradient on one rank");
    const std::vector<double> before = snapshot();
    const std::vector<double> p2 = ps[1]->w->values();
    grads();
    if (everywhere || rank == P - 1) opt.clear_grad(ps[1]->index);
    const std::string what = error_of([&] { opt.step(); });
    if (everywhere) {
      EXPECT_EQ(what, "") << where;
      EXPECT_EQ(ps[1]->w->values(), p2) << where << ": moved without a gradient";
      EXPECT_NE(snapshot(), before) << where << ": the others did not step";
    } else {
      EXPECT_NE(what.find("or which of them have a gradient this step"), std::string::npos) << where << ": " << what;
      EXPECT_EQ(snapshot(), before) << where << ": a refused step moved something";
    }
    opt.set_grad(ps[1]->index, ps[1]->g->view());
    step_together(where + ", then alike");
  }
  // A rank whose parameters were registered without gradients refuses the first step
  // (refuse_step reads none): every rank raises at once, nothing moved, and later steps pair.
  {
    const std::string where = "rank " + std::to_string(rank) + ", first step refused by a rank without gradients";
    const bool odd = rank == P - 1;
    dion3::Optimizer fresh(be.make_backend());
    const int g = fresh.add_group(matrices);
    Rng same(80);
    DistParam d(be, 8, 6, Shard{0, 8}, Shard{0, 6}, same);
    dion3::ParamSpec spec = d.spec("u");
    spec.layout.kind = Layout::Replicated;
    spec.layout.comm = comm;
    if (odd) spec.grad = dion3::TensorView{};
    d.index = fresh.add_param(g, spec);
    d.g->assign(gaussian(8, 6, same));
    const std::vector<double> w = d.w->values();
    const std::string what = error_of([&] { odd ? fresh.refuse_step() : fresh.step(); });
    EXPECT_NE(what.find(odd ? "no parameter of this rank has a gradient" : "another rank took no part"), std::string::npos)
        << where << ": " << what;
    EXPECT_EQ(d.w->values(), w) << where << ": a refused step moved something";
    if (odd) fresh.set_grad(d.index, d.g->view());
    EXPECT_TRUE(fresh.step()) << where << ": then with gradients everywhere";
  }
  // A group edited on one rank into what cannot be planned there (global selection of blocks that
  // straddle shards) is refused with the plan in place: every rank raises at once, nothing moved.
  {
    const std::string where = "rank " + std::to_string(rank) + ", global scope over straddling blocks";
    dion3::Optimizer straddle(be.make_backend());
    GroupConfig sc = matrices;
    const int m = 4 * P + 2;
    sc.split_sizes = {m - 2, 2};  // the first block spans every rank's shard
    const int g = straddle.add_group(sc);
    Rng same(81);
    DistParam d(be, m, 6, shard_of(m, P, rank), Shard{0, 6}, same);
    dion3::ParamSpec spec = d.spec("s");
    spec.layout.kind = Layout::RowShard;
    spec.layout.comm = comm;
    spec.layout.global_rows = m;
    d.index = straddle.add_param(g, spec);
    d.g->assign(rows_of(gaussian(m, 6, same), 6, d.rows));
    ASSERT_TRUE(straddle.step()) << where << ": the first step, alike";
    if (rank == P - 1) {
      GroupConfig edited = straddle.group(g);
      edited.selection_scope = dion3::SelectionScope::Global;
      straddle.set_group(g, edited);
    }
    const std::vector<double> w = d.w->values();
    const std::string what = error_of([&] { straddle.step(); });
    EXPECT_NE(what.find(rank == P - 1 ? "selection_scope 'global' needs the standard row cut" : "another rank refused"),
              std::string::npos) << where << ": " << what;
    EXPECT_EQ(d.w->values(), w) << where << ": a refused step moved something";
  }
  // A row-sharded matrix cut into heads that each lie within one shard steps in local megabatches,
  // yet its settings, its shape and whether it has a gradient are still part of the plan: a
  // difference on one rank is refused on every rank, nothing moved.
  for (const std::string mode : {"fraction", "num_heads", "columns", "absent", "adjust_lr", "scale_lr_by_fraction"}) {
    const std::string where = "rank " + std::to_string(rank) + ", heads within shards, " + mode + " differs";
    const bool odd = rank == P - 1;
    dion3::Optimizer heads(be.make_backend());
    GroupConfig hc = matrices;
    hc.fraction = mode == "fraction" && odd ? 0.25 : 0.5;
    hc.num_heads = mode == "num_heads" && odd ? 2 * P : P;
    if (mode == "adjust_lr" && odd) hc.adjust_lr = dion3::AdjustLR::None;
    hc.scale_lr_by_fraction = mode == "scale_lr_by_fraction" && odd;
    const int g = heads.add_group(hc);
    Rng same(79);
    const int m = 4 * P, n = mode == "columns" && odd ? 7 : 6;
    DistParam d(be, m, n, shard_of(m, P, rank), Shard{0, n}, same);
    dion3::ParamSpec spec = d.spec("h");
    spec.layout.kind = Layout::RowShard;
    spec.layout.comm = comm;
    spec.layout.global_rows = m;
    d.index = heads.add_param(g, spec);
    d.g->assign(rows_of(gaussian(m, n, same), n, d.rows));
    if (mode == "absent") {
      ASSERT_TRUE(heads.step()) << where << ": the first step, alike";
      if (odd) heads.clear_grad(d.index);
    }
    const std::vector<double> w = d.w->values();
    const std::string what = error_of([&] { heads.step(); });
    const bool lr = mode == "adjust_lr" || mode == "scale_lr_by_fraction";  // each matrix's lr, not the plan
    EXPECT_NE(what.find(lr ? "stepped with different hyper-parameters" : "planned different steps"), std::string::npos)
        << where << ": " << what;
    EXPECT_EQ(d.w->values(), w) << where << ": a refused step moved something";
  }
  // Same-shape matrices registered in another order on one rank: with agree_on_names every rank
  // refuses the first step; without it the names are labels only, and nothing can tell.
  for (bool agree : {true, false}) {
    const std::string where = "rank " + std::to_string(rank) + (agree ? ", names agreed" : ", names not agreed");
    dion3::OptimizerOptions options;
    options.agree_on_names = agree;
    dion3::Optimizer named(be.make_backend(), options);
    const int g = named.add_group(matrices);
    Rng same(78);
    std::vector<std::unique_ptr<DistParam>> qs;
    for (const char* name : {"a", "b"}) {
      qs.push_back(std::make_unique<DistParam>(be, 8, 6, Shard{0, 8}, Shard{0, 6}, same));
      const bool swapped = rank == P - 1;
      dion3::ParamSpec spec = qs.back()->spec(swapped ? (name[0] == 'a' ? "b" : "a") : name);
      spec.layout.kind = Layout::Replicated;
      spec.layout.comm = comm;
      named.add_param(g, spec);
    }
    for (auto& d : qs) d->g->assign(gaussian(8, 6, same));
    const std::string what = error_of([&] { named.step(); });
    if (agree) EXPECT_NE(what.find("or the parameters' names, in order"), std::string::npos) << where << ": " << what;
    else EXPECT_EQ(what, "") << where;
  }
}

void check_agreement_on_threads(int ranks, const RankBackend& be) {
  const auto comms = thread_communicators(ranks, be.device);
  on_threads(ranks, "agreement", [&](int r) { check_agreement_case(be, comms[r]); });
}

void check_layouts_on_threads(int ranks, const RankBackend& be) {
  for (const LayoutCase& c : layout_cases()) {
    const auto comms = thread_communicators(ranks, be.device);
    on_threads(ranks, c.name, [&](int r) { check_layout_case(c, be, comms[r]); });
  }
  std::vector<std::pair<int, int>> grids = {{ranks, 1}, {1, ranks}};
  if (ranks == 4) grids.push_back({2, 2});
  for (const auto& grid : grids) {
    const int dp = grid.first, tp = grid.second;  // plain locals: lambdas capture them (clang 14)
    // Rank d * tp + t holds row block d and column block t: its rows are cut over the ranks of
    // its column t, its columns over the ranks of its row block d.
    std::vector<std::vector<std::shared_ptr<dion3::Communicator>>> by_col, by_row;
    for (int t = 0; t < tp; ++t) by_col.push_back(thread_communicators(dp, be.device));
    for (int d = 0; d < dp; ++d) by_row.push_back(thread_communicators(tp, be.device));
    on_threads(ranks, "block grid " + std::to_string(dp) + "x" + std::to_string(tp),
               [&](int r) { check_block_case(be, by_col[r % tp][r / tp], by_row[r / tp][r % tp]); });
  }
}

}  // namespace t3
