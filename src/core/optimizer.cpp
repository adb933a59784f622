// optimizer.cpp — the engine: registration and validation, megabatch planning, the step (algorithm.md §1).
#include "dion3/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/engine.hpp"
#include "core/format.hpp"
#include "dion3/error.hpp"

namespace dion3 {

namespace {

// Rows [first, first + rows) and columns [col, col + cols) of t seen as a stack of rows of `ld`
// elements.
MatrixView block_of(const TensorView& t, DType dtype, int64_t first, int64_t rows, int64_t col, int64_t cols,
                    int64_t ld) {
  // No data (a rank holding none of the stored rows): no pointer arithmetic on it.
  char* base = t.data ? static_cast<char*>(t.data) + static_cast<std::size_t>(first * ld + col) * dtype_size(dtype)
                      : nullptr;
  return MatrixView{base, dtype, 1, rows, cols, ld, rows * ld};
}

MatrixView flat_of(const TensorView& t) {
  return MatrixView::contiguous(t.data, t.dtype, 1, 1, t.numel());
}

// Structural settings that decide the plan and the state layout (element-wise algorithms ignore
// transposed).
bool same_structure(const GroupConfig& a, const GroupConfig& b) {
  return a.algorithm == b.algorithm && a.flatten == b.flatten && a.momentum_dtype == b.momentum_dtype &&
         (a.transposed == b.transposed || !is_matrix_algorithm(a.algorithm));
}

// Dion3 and NorMuon select and normalise output features: a transposed group's stored columns,
// so they step its matrices by columns.
bool steps_by_columns(const GroupConfig& g) { return g.transposed && normalizes_rows(g.algorithm); }
// Also the settings that pick host-side branches of the step (nesterov, cautious_wd): a captured step
// has taken its branch, so changing one needs a new plan and a new capture.
bool same_plan(const GroupConfig& a, const GroupConfig& b) {
  return same_structure(a, b) && a.fraction == b.fraction && a.split_sizes == b.split_sizes &&
         a.nesterov == b.nesterov && a.cautious_wd == b.cautious_wd &&
         a.num_heads == b.num_heads && a.orth.method == b.orth.method &&
         a.orth.coefficients == b.orth.coefficients && a.orth.restarts == b.orth.restarts &&
         a.orth.iteration_dtype == b.orth.iteration_dtype && a.selection_scope == b.selection_scope &&
         a.orth.norm == b.orth.norm;
}

std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// dtype of the gathered update rows U handed to the orthogonalizer: Dion3 gathers momentum
// rows unchanged, so the momentum dtype holds them exactly (half the bytes of fp32 for bf16
// momentum); Muon/NorMuon may mix in the gradient (Nesterov), so fp32.
DType update_rows_dtype(const GroupConfig& g, DType momentum_dtype) {
  return selects_rows(g.algorithm) ? momentum_dtype : DType::F32;
}

std::string group_error(int g, const std::string& what) { return "group " + std::to_string(g) + ": " + what; }

// How a refused distributed step ends its message: the ranks that compared their step (those of
// the optimizer's communicators; under HSDP not the other replicas) all dropped it.
constexpr const char* kNotApplied = "the step was not applied on this rank or on any rank it shares a collective with";

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }  // a >= 0, b > 0; no overflow

// Selected rows of an m-row matrix (algorithm.md §1 step 2).
int64_t selected_rows(double fraction, int64_t m) {
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(fraction * static_cast<double>(m))));
}

char* byte_offset(const DeviceBuffer& b, std::size_t offset) { return b.as<char>() + offset; }

void comm_wait(std::unique_ptr<CommRequest> request) {
  if (request) request->wait();
}

// Unless the megabatch gathers normalised: this rank gathers its members' update rows whole into U
// (unsharded, or column-sharded over one rank) and keeps U's row sums of squares for the
// orthogonalizer's norm.
bool gathers_whole_rows(const Megabatch& mb) {
  return mb.layout == Layout::Local || mb.layout == Layout::Replicated ||
         (mb.layout == Layout::ColShard && mb.ranks == 1);
}

// This rank has an update to apply to its rows: it holds some, and either columns of them or, for
// NorMuon, their variance (which every column rank holds alike, also one without columns).
bool applies_update(const Megabatch& mb, const UpdateParams& up) { return mb.rows > 0 && (mb.cols > 0 || up.normuon); }

}  // namespace

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Local: return "local";
    case Layout::Replicated: return "replicated";
    case Layout::RowShard: return "row-sharded";
    case Layout::ColShard: return "column-sharded";
    case Layout::Block: return "block-sharded";
  }
  return "unknown";
}

const TensorView* Param::find_state(const std::string& key) const {
  for (const auto& [name, view] : state)
    if (name == key) return &view;
  return nullptr;
}

std::string Optimizer::Impl::structure_error(int g) const { return structure_error(g, groups[g]); }

std::string Optimizer::Impl::structure_error(int g, const GroupConfig& now) const {
  if (g >= static_cast<int>(structure.size()) || !structure[g] || same_structure(now, *structure[g])) return {};
  const GroupConfig& was = *structure[g];
  std::string what;
  if (now.algorithm != was.algorithm)
    what = std::string("'algorithm' from ") + algorithm_name(was.algorithm) + " to " + algorithm_name(now.algorithm);
  else if (now.flatten != was.flatten)
    what = std::string("'flatten' from ") + (was.flatten ? "true" : "false") + " to " + (now.flatten ? "true" : "false");
  else if (now.transposed != was.transposed)
    what = std::string("'transposed' from ") + (was.transposed ? "true" : "false") + " to " +
           (now.transposed ? "true" : "false");
  else
    what = std::string("'momentum_dtype' from ") + (was.momentum_dtype ? dtype_name(*was.momentum_dtype) : "the parameter's") +
           " to " + (now.momentum_dtype ? dtype_name(*now.momentum_dtype) : "the parameter's");
  return group_error(g, "cannot change " + what + ": the group's parameters already have state sized by it "
                        "(algorithm, flatten, transposed and momentum_dtype are fixed once a group has parameters; put "
                        "parameters that need others in a new group)");
}

std::string Optimizer::Impl::describe(int param) const {
  return "parameter " + std::to_string(param) + " '" + params[param].name + "'";
}

std::vector<StateSpec> state_specs(const GroupConfig& g, DType weight_dtype, const std::vector<int64_t>& shape) {
  const DType momentum = g.momentum_dtype.value_or(weight_dtype);
  switch (g.algorithm) {
    case Algorithm::Dion3:
    case Algorithm::NorMuon: {
      // One variance entry per output feature: per matrix row (dim0 for a matrix or a flattened
      // tensor, else the rows of every matrix of the stack), per column of a transposed group's.
      int64_t rows = shape.empty() ? 0 : shape[0];
      if (g.transposed && shape.size() >= 2) {
        rows = shape.back();
        for (std::size_t d = 0; d + 2 < shape.size(); ++d) rows *= shape[d];
      } else if (!g.flatten) {
        for (std::size_t d = 1; d + 1 < shape.size(); ++d) rows *= shape[d];
      }
      return {{"momentum", momentum, shape}, {"variance", DType::F32, {rows}}};
    }
    case Algorithm::Dion2:
    case Algorithm::Muon: return {{"momentum", momentum, shape}};
    case Algorithm::AdamW: return {{"exp_avg", weight_dtype, shape}, {"exp_avg_sq", weight_dtype, shape}};
    case Algorithm::Lion: return {{"exp_avg", weight_dtype, shape}};
  }
  return {};
}

std::vector<StateSpec> Optimizer::Impl::state_specs(const Param& p) const {
  return dion3::state_specs(groups[p.group], p.weight.dtype, p.weight.shape);
}

Optimizer::Optimizer(std::unique_ptr<Backend> backend, OptimizerOptions options) : impl_(new Impl) {
  if (!backend) fail("Optimizer needs a backend, got null");
  impl_->backend = std::move(backend);
  impl_->options = options;
  impl_->flag = DeviceBuffer(impl_->backend->allocator(), 2 * sizeof(int));
  impl_->flag_starts = DeviceBuffer(impl_->backend->allocator(), Impl::kStarts * 2 * sizeof(int));
  impl_->write_starts({});
  impl_->counters = DeviceBuffer(impl_->backend->allocator(), 2 * sizeof(int64_t));
  impl_->backend->fill_zero(impl_->counters.get(), 2 * sizeof(int64_t));
}

Optimizer::~Optimizer() = default;

int Optimizer::add_group(const GroupConfig& config) {
  const Impl::Use use(*impl_);
  const int g = static_cast<int>(impl_->groups.size());
  try {
    config.validate();
  } catch (const Error& e) {
    fail(group_error(g, std::string(e.what()).substr(7)));  // strip the "dion3: " prefix
  }
  impl_->groups.push_back(config);
  impl_->plan_valid = false;
  ++impl_->binding;
  return g;
}

namespace {

void check_tensor(const std::string& who, const char* role, const TensorView& t, const Backend& be) {
  const std::string what = who + ": its " + role;
  if (!is_float_param_dtype(t.dtype))
    fail(what + " has dtype " + dtype_name(t.dtype) +
         " but dion3 supports float32, float16 and bfloat16");
  const Device device = be.device();
  if (t.device != device)
    fail(what + " is on " + device_name(t.device) + " but this optimizer runs on " +
         device_name(device));
  // The kernels run on the backend's GPU and would dereference another GPU's pointers there.
  if (device == Device::CUDA && t.device_index != be.device_index())
    fail(what + " is on CUDA device " + std::to_string(t.device_index) + " but this optimizer runs on " +
         "CUDA device " + std::to_string(be.device_index()));
  for (int64_t s : t.shape)
    if (s < 0) fail(what + " has a negative dimension in shape " + t.shape_str());
  // Products of some of the dimensions (rows x cols of a batched tensor) must fit as well, also
  // where an empty dimension makes the whole count 0.
  int64_t nonzero = 1;
  for (int64_t s : t.shape)
    if (s > 0 && __builtin_mul_overflow(nonzero, s, &nonzero))
      fail(what + " has shape " + t.shape_str() + ", whose dimensions multiply past 2^63 - 1");
  std::size_t bytes = 0;
  try {
    bytes = t.bytes();
  } catch (const Error& e) {
    fail(what + ": " + std::string(e.what()).substr(7));
  }
  if (!t.data && bytes > 0) fail(what + " has a null data pointer");
  // The backends read elements as their type (and the GPU in wider packs where it can).
  if (bytes > 0 && reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    fail(what + " is not aligned to its " + std::string(dtype_name(t.dtype)) + " elements (" +
         std::to_string(dtype_size(t.dtype)) + " bytes)");
  if (t.data && reinterpret_cast<std::uintptr_t>(t.data) > UINTPTR_MAX - bytes)
    fail(what + " of " + std::to_string(bytes) + " bytes runs past the end of the address space");
}

void check_grad(const std::string& who, const TensorView& weight, const TensorView& grad, const Backend& be) {
  check_tensor(who, "gradient", grad, be);
  if (grad.shape != weight.shape)
    fail(who + " has weight shape " + weight.shape_str() + " but its gradient has shape " + grad.shape_str());
}

std::pair<std::uintptr_t, std::uintptr_t> memory_of(const TensorView& t) {
  const auto a = reinterpret_cast<std::uintptr_t>(t.data);
  return {a, a + t.bytes()};
}

}  // namespace

std::string Optimizer::Impl::memory_clash(const TensorView& t, bool written_role) const {
  const auto [a, b] = memory_of(t);
  if (a == b) return {};
  auto it = written.upper_bound(a);  // the first written range starting after a
  if (it != written.end() && it->first < b) return it->second.second;
  if (it != written.begin() && std::prev(it)->second.first > a) return std::prev(it)->second.second;
  if (written_role)
    for (int cls = 0; cls < static_cast<int>(grad_ranges.size()); ++cls) {
      const auto& ranges = grad_ranges[cls];
      if (ranges.empty()) continue;
      const std::uintptr_t reach = cls + 1 < 64 ? (std::uintptr_t{1} << (cls + 1)) : UINTPTR_MAX;
      for (auto g = ranges.lower_bound(a > reach ? a - reach : 0); g != ranges.end() && g->first < b; ++g)
        if (g->second.first > a) return "the gradient of " + describe(g->second.second);
    }
  return {};
}

namespace {

// The length class of a gradient range of `bytes` > 0: floor(log2(bytes)).
int length_class(std::uintptr_t bytes) { return 63 - __builtin_clzll(static_cast<unsigned long long>(bytes)); }

}  // namespace

void Optimizer::Impl::note_grad_range(int param) {
  const TensorView& grad = params[param].grad;
  const auto [a, b] = memory_of(grad);
  if (!grad.data || a == b) return;
  grad_ranges[length_class(b - a)].emplace(a, std::make_pair(b, param));
}

void Optimizer::Impl::forget_grad_range(int param) {
  const TensorView& grad = params[param].grad;
  const auto [a, b] = memory_of(grad);
  if (!grad.data || a == b) return;
  auto& ranges = grad_ranges[length_class(b - a)];
  for (auto [g, end] = ranges.equal_range(a); g != end; ++g)
    if (g->second.second == param) {
      ranges.erase(g);
      return;
    }
}

int Optimizer::add_param(int group, const ParamSpec& spec) {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  const int index = static_cast<int>(s.params.size());
  const std::string who = "parameter " + std::to_string(index) + " '" + spec.name + "'";
  if (group < 0 || group >= static_cast<int>(s.groups.size()))
    fail(who + " names group " + std::to_string(group) + " but the optimizer has " +
         std::to_string(s.groups.size()) + " groups");
  if (const std::string e = s.structure_error(group); !e.empty()) fail(who + ": " + e);
  const GroupConfig& g = s.groups[group];
  const Backend& be = *s.backend;
  const Device device = be.device();
  check_tensor(who, "weight", spec.weight, be);
  if (spec.grad.data || !spec.grad.shape.empty()) check_grad(who, spec.weight, spec.grad, be);
  if (spec.name.empty()) fail(who + ": a parameter needs a name (error messages and checkpoints use it)");
  if (s.param_index.count(spec.name))
    fail(who + ": the optimizer already has a parameter named '" + spec.name + "'; names must be unique");
  // A step writes weights and state: none may share memory with anything else registered, or
  // it would be updated twice or read after it was written.
  {
    std::vector<std::pair<std::string, const TensorView*>> written_here = {{"weight", &spec.weight}};
    for (const auto& [name, view] : spec.state) {
      check_tensor(who, ("state '" + name + "'").c_str(), view, be);
      written_here.emplace_back("state '" + name + "'", &view);
    }
    for (std::size_t i = 0; i < written_here.size(); ++i) {
      const auto& [role, view] = written_here[i];
      if (std::string c = s.memory_clash(*view, true); !c.empty())
        fail(who + ": its " + role + " overlaps the memory of " + c);
      const auto [a, b] = memory_of(*view);
      if (spec.grad.data && a < b) {
        const auto [ga, gb] = memory_of(spec.grad);
        if (ga < b && a < gb) fail(who + ": its " + role + " overlaps its own gradient");
      }
      for (std::size_t j = 0; j < i; ++j) {
        const auto [c, d] = memory_of(*written_here[j].second);
        if (a < b && c < d && c < b && a < d) fail(who + ": its " + role + " overlaps its " + written_here[j].first);
      }
    }
    if (spec.grad.data)
      if (std::string c = s.memory_clash(spec.grad, false); !c.empty())
        fail(who + ": its gradient overlaps the memory of " + c);
  }

  Param p;
  p.name = spec.name;
  p.group = group;
  p.weight = spec.weight;
  p.grad = spec.grad;
  // An empty weight needs no gradient. Unbound, its gradient is an empty view of the weight's
  // shape: the default view has shape [], one element, which the step would read at address 0.
  if (!p.grad.data && p.grad.shape.empty() && spec.weight.numel() == 0)
    p.grad = TensorView{nullptr, spec.weight.dtype, device, spec.weight.device_index, spec.weight.shape};
  p.step_offset = s.read_counters()[0];  // AdamW's t starts at 1 for a parameter added late
  p.layout = spec.layout;
  const auto& shape = spec.weight.shape;
  const ParamLayout& L = spec.layout;
  if (L.kind != Layout::Local && !L.comm)
    fail(who + " has a " + layout_name(L.kind) + " layout but no communicator");
  if (L.kind == Layout::Local && L.comm)
    fail(who + " has a communicator but a local layout; give it a replicated or row-sharded layout");
  for (const Communicator* c : {L.comm.get(), L.col_comm.get()})
    if (c && c->device() != device)
      fail(who + ": its communicator (" + c->describe() + ") moves " + device_name(c->device()) +
           " buffers but this optimizer runs on " + device_name(device));
  // The communicators this parameter would add to those the others span (each object counts).
  std::vector<Communicator*> new_comms;
  for (Communicator* c : {L.comm.get(), L.col_comm.get()})
    if (c && std::find(s.comms_met.begin(), s.comms_met.end(), c) == s.comms_met.end() &&
        std::find(new_comms.begin(), new_comms.end(), c) == new_comms.end())
      new_comms.push_back(c);
  if (s.comms_met.size() + new_comms.size() > static_cast<std::size_t>(kAgreementRegions))
    fail(who + ": the optimizer's parameters would span " + std::to_string(s.comms_met.size() + new_comms.size()) +
         " communicator objects; one optimizer agrees on its steps over at most " +
         std::to_string(kAgreementRegions) + " (share one object per process group)");
  if ((L.kind == Layout::Block) != static_cast<bool>(L.col_comm))
    fail(who + ": a block-sharded layout needs a column communicator, and only it takes one");
  // One communicator of one rank may serve both (a 1 x 1 grid): nothing is cut.
  if (L.col_comm && L.col_comm == L.comm && L.comm->size() > 1)
    fail(who + ": a block-sharded layout cuts rows and columns over two communicators (two dimensions of a "
         "mesh), but both are " + L.comm->describe());
  // Far past any real matrix: a bound that keeps every row and column product within int64.
  constexpr int64_t kMaxGlobal = int64_t{1} << 40;
  if (L.global_rows < 0 || L.global_rows > kMaxGlobal || L.global_cols < 0 || L.global_cols > kMaxGlobal)
    fail(who + ": global_rows " + std::to_string(L.global_rows) + " and global_cols " + std::to_string(L.global_cols) +
         " must lie in [0, 2^40]");
  if (is_matrix_algorithm(g.algorithm)) {
    if (shape.size() < 2)
      fail(who + " has shape " + spec.weight.shape_str() + " but " +
           algorithm_name(g.algorithm) + " needs a matrix; put 1-D tensors in an 'adamw' or 'lion' group");
    if (g.algorithm == Algorithm::Dion2 && (L.kind == Layout::ColShard || L.kind == Layout::Block))
      fail(who + " is " + layout_name(L.kind) + ": dion2 is not available where the columns are sharded (the "
           "reference's Dion2 selects each shard's columns there; dion3 selects whole rows): use dion3");
    // Stepped by columns, a transposed matrix may be cut along its stored rows (its input
    // features: FSDP2's Shard(0)) in the standard chunks, and stepped column-sharded.
    if (steps_by_columns(g) && L.kind != Layout::Local && L.kind != Layout::Replicated &&
        !(L.kind == Layout::RowShard && L.row_offset < 0 && L.row_chunk == 0))
      fail(who + " is " + layout_name(L.kind) + (L.kind == Layout::RowShard ? " in other than ceil(m/P) chunks" : "") +
           " in a 'transposed' group: " + algorithm_name(g.algorithm) +
           " steps a matrix stored (in, out) by its columns, whole or cut along its stored rows (the input "
           "features) in ceil(m/P) chunks in rank order (FSDP2's Shard(0)); store it (out, in), or shard it so");
    if (g.transposed && g.flatten && shape.size() > 2)
      fail(who + " has shape " + spec.weight.shape_str() + " in a 'transposed' group with flatten=True, whose "
           "(dim0, rest) matrices have no stored (in, out) orientation; use flatten=False");
    int64_t trailing = 1;
    for (std::size_t d = 1; d < shape.size(); ++d) trailing *= shape[d];
    if (g.flatten || shape.size() == 2) {
      p.count = 1;
      p.rows = shape[0];
      p.cols = trailing;
    } else {
      if (L.kind == Layout::RowShard || L.kind == Layout::ColShard || L.kind == Layout::Block)
        fail(who + " has shape " + spec.weight.shape_str() + ": a " + layout_name(L.kind) +
             " parameter must be a matrix (or use flatten=True, which treats it as (dim0, rest))");
      p.rows = shape[shape.size() - 2];
      p.cols = shape.back();
      p.count = spec.weight.numel() / std::max<int64_t>(p.rows * p.cols, 1);
    }
    if (L.kind == Layout::Block) {
      // Rows cut over comm and columns over col_comm, each in ceil chunks in rank order.
      auto check_cut = [&](const char* what, int64_t held, int64_t total, const Communicator& c) {
        const int64_t chunk = ceil_div(std::max<int64_t>(total, 1), c.size());
        const int64_t first = std::min(total, c.rank() * chunk), want = std::min(chunk, total - first);
        if (total < 1 || held != want)
          fail(who + " is block-sharded: its " + what + " are cut over " + c.describe() + " into ceil(" +
               std::to_string(total) + "/" + std::to_string(c.size()) + ") chunks, so rank " +
               std::to_string(c.rank()) + " must hold " + std::to_string(want) + " of them, but its block has shape " +
               spec.weight.shape_str());
      };
      check_cut("rows", p.rows, L.global_rows, *L.comm);
      check_cut("columns", p.cols, L.global_cols, *L.col_comm);
      if (selects_rows(g.algorithm) && g.selection_scope == SelectionScope::Global)
        fail(who + ": selection_scope 'global' is not available for block-sharded parameters; use 'local'");
    } else if (L.kind == Layout::RowShard && L.row_offset >= 0) {
      const int64_t m = L.global_rows, P = L.comm->size();
      if (m < 1 || p.cols < 1)
        fail(who + " is row-sharded with " + std::to_string(m) + " rows and " + std::to_string(p.cols) +
             " columns; a matrix needs rows and columns");
      int64_t covered = 0;  // rows the P shards can hold; a chunk past m (or wrapping) is no cut of the matrix
      if (L.row_chunk < 1 || L.row_chunk > m || __builtin_mul_overflow(L.row_chunk, P, &covered) || covered < m ||
          p.rows > L.row_chunk || L.row_offset > m - p.rows)
        fail(who + " holds rows [" + std::to_string(L.row_offset) + ", " + std::to_string(L.row_offset + p.rows) +
             ") of " + std::to_string(m) + " with shards of at most " + std::to_string(L.row_chunk) + " rows over " +
             std::to_string(P) + " ranks: not a cut of the matrix into contiguous shards");
      if (selects_rows(g.algorithm) && g.selection_scope == SelectionScope::Global)
        fail(who + ": selection_scope 'global' needs the standard cut (ceil(m/P) rows in rank order); this "
             "parameter is cut otherwise (e.g. FSDP2 over tensor parallel): use 'local'");
    } else if (L.kind == Layout::RowShard) {
      if (L.row_chunk != 0)
        fail(who + " gives row_chunk " + std::to_string(L.row_chunk) + " without row_offset: a cut of its own "
             "needs both (this rank's first row, the largest shard's rows); the standard cut neither");
      const int64_t m = L.global_rows, P = L.comm->size(), r = L.comm->rank();
      if (m < 1 || p.cols < 1)
        fail(who + " is row-sharded with " + std::to_string(m) + " rows and " + std::to_string(p.cols) +
             " columns; a matrix needs rows and columns");
      const int64_t c = ceil_div(m, P);
      const int64_t first = std::min(m, r * c), want = std::min(c, m - first);
      if (p.rows != want)
        fail(who + " is row-sharded over " + std::to_string(P) + " ranks (" + L.comm->describe() + ") with " +
             std::to_string(m) + " rows, so rank " + std::to_string(r) + " must hold rows [" + std::to_string(first) +
             ", " + std::to_string(first + want) + ") (" + std::to_string(want) +
             " rows: contiguous chunks of ceil(m/P), as FSDP2's Shard(0)), but its shard has shape " +
             spec.weight.shape_str());
    } else if (L.kind == Layout::ColShard) {
      const int64_t n = L.global_cols, P = L.comm->size(), r = L.comm->rank();
      if (p.rows < 1 || n < 1)
        fail(who + " is column-sharded with " + std::to_string(p.rows) + " rows and " + std::to_string(n) +
             " columns; a matrix needs rows and columns");
      const int64_t c = ceil_div(n, P);
      const int64_t first = std::min(n, r * c), want = std::min(c, n - first);
      if (p.cols != want)
        fail(who + " is column-sharded over " + std::to_string(P) + " ranks (" + L.comm->describe() + ") with " +
             std::to_string(n) + " columns, so rank " + std::to_string(r) + " must hold columns [" +
             std::to_string(first) + ", " + std::to_string(first + want) + ") (" + std::to_string(want) +
             " columns: contiguous chunks of ceil(n/P), as Shard(1)), but its shard has shape " +
             spec.weight.shape_str());
    } else if (p.rows < 1 || p.cols < 1) {
      // An empty stack (no matrices: a rank's share of experts sharded between ranks) steps nothing.
      fail(who + " has shape " + spec.weight.shape_str() + " with an empty dimension; a matrix needs rows and columns");
    }
  }

  // State: validate the caller's tensors first, then allocate the missing ones.
  s.params.push_back(std::move(p));
  Param& added = s.params.back();
  try {
    if (is_matrix_algorithm(g.algorithm)) s.row_blocks(index);  // its group's row blocks must fit it
    const auto specs = s.state_specs(added);
    for (std::size_t i = 0; i < spec.state.size(); ++i) {
      const std::string& name = spec.state[i].first;
      for (std::size_t j = 0; j < i; ++j)
        if (spec.state[j].first == name) fail(who + " was given state '" + name + "' twice");
      bool known = false;
      for (const auto& want : specs) known |= (want.name == name);
      if (!known) fail(who + " was given state '" + name + "', which " + algorithm_name(g.algorithm) + " does not use");
    }
    for (const auto& want : specs) {
      const TensorView* given = nullptr;
      for (const auto& [name, view] : spec.state)
        if (name == want.name) given = &view;
      if (given) {
        if (given->dtype != want.dtype || given->shape != want.shape || given->device != device)
          fail(who + " state '" + want.name + "' must be " + dtype_name(want.dtype) + " " + shape_string(want.shape) +
               " on " + device_name(device) + ", got " + dtype_name(given->dtype) + " " + given->shape_str() +
               " on " + device_name(given->device));
        added.state.emplace_back(want.name, *given);
      }
    }
    for (const auto& want : specs) {
      if (added.find_state(want.name)) continue;
      TensorView t{nullptr, want.dtype, device, 0, want.shape};
      added.owned.emplace_back(s.backend->allocator(), std::max<std::size_t>(t.bytes(), 1));
      t.data = added.owned.back().get();
      s.backend->fill_zero(t.data, t.bytes());
      added.state.emplace_back(want.name, t);
    }
    // Keep the algorithm's order regardless of the order the caller gave.
    std::vector<std::pair<std::string, TensorView>> ordered;
    for (const auto& want : specs) ordered.emplace_back(want.name, *added.find_state(want.name));
    added.state = std::move(ordered);
  } catch (...) {
    s.params.pop_back();
    throw;
  }
  // Each step below may fail to allocate: a failed call undoes the ones before it and leaves
  // nothing registered (a retry would otherwise register the weight twice).
  const std::size_t comms_before = s.comms_met.size();
  const bool had_structure = s.structure.size() > static_cast<std::size_t>(group) && s.structure[group];
  std::vector<std::uintptr_t> remembered;
  bool indexed = false;
  try {
    s.comms_met.insert(s.comms_met.end(), new_comms.begin(), new_comms.end());
    if (s.structure.size() <= static_cast<std::size_t>(group)) s.structure.resize(group + 1);
    if (!s.structure[group]) s.structure[group] = g;  // its state is sized by these settings from now on
    remembered.reserve(1 + spec.state.size());
    auto remember = [&](const TensorView& t, const std::string& what) {
      const auto [a, b] = memory_of(t);
      if (a < b && s.written.emplace(a, std::make_pair(b, what)).second) remembered.push_back(a);
    };
    remember(added.weight, "the weight of " + who);
    for (const auto& [name, view] : spec.state) remember(view, "state '" + name + "' of " + who);
    indexed = s.param_index.emplace(added.name, index).second;
    s.note_grad_range(index);
  } catch (...) {
    if (indexed) s.param_index.erase(added.name);
    for (std::uintptr_t a : remembered) s.written.erase(a);
    if (!had_structure && s.structure.size() > static_cast<std::size_t>(group)) s.structure[group].reset();
    s.comms_met.resize(comms_before);
    s.params.pop_back();
    throw;
  }
  s.plan_valid = false;
  ++s.binding;
  return index;
}

void Optimizer::set_grad(int param, const TensorView& grad) {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  if (param < 0 || param >= static_cast<int>(s.params.size()))
    fail("set_grad: no parameter " + std::to_string(param) + " (the optimizer has " +
         std::to_string(s.params.size()) + ")");
  check_grad(s.describe(param), s.params[param].weight, grad, *s.backend);
  if (std::string c = s.memory_clash(grad, false); !c.empty())
    fail(s.describe(param) + ": its new gradient overlaps the memory of " + c);
  Param& p = s.params[param];
  if (p.grad.data != grad.data || p.grad.dtype != grad.dtype || p.grad.shape != grad.shape) ++s.binding;
  s.set_absent(p, false);
  s.forget_grad_range(param);
  p.grad = grad;
  s.note_grad_range(param);
}

void Optimizer::clear_grad(int param) {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  if (param < 0 || param >= static_cast<int>(s.params.size()))
    fail("clear_grad: no parameter " + std::to_string(param) + " (the optimizer has " +
         std::to_string(s.params.size()) + ")");
  Param& p = s.params[param];
  const Algorithm a = s.groups[p.group].algorithm;
  if (!is_matrix_algorithm(a))
    fail(s.describe(param) + " is stepped by " + algorithm_name(a) + ", whose steps count per parameter: it cannot "
         "skip a step in this plan; bind a gradient, or register the optimizer again without it");
  if (p.absent) return;
  s.forget_grad_range(param);
  // The dtype stays as last bound (the plan is keyed by it), or the weight's if none ever was.
  const DType dtype = p.grad.data ? p.grad.dtype : p.weight.dtype;
  p.grad = TensorView{nullptr, dtype, p.weight.device, p.weight.device_index, p.weight.shape};
  s.set_absent(p, true);
}

void Optimizer::Impl::set_absent(Param& p, bool absent) {
  if (p.absent == absent) return;
  p.absent = absent;
  ++binding;  // its matrices point elsewhere
  ++absence;
  absent_now += absent ? 1 : -1;
}

GroupConfig& Optimizer::group(int index) {
  if (index < 0 || index >= num_groups()) fail("no group " + std::to_string(index));
  return impl_->groups[index];
}
const GroupConfig& Optimizer::group(int index) const { return const_cast<Optimizer*>(this)->group(index); }
static_assert(std::is_nothrow_move_constructible_v<GroupConfig> && std::is_nothrow_move_assignable_v<GroupConfig>,
              "set_group swaps settings in and back without a failure in between");

void Optimizer::set_group(int index, const GroupConfig& config) {
  const Impl::Use use(*impl_);
  group(index);  // the range check
  try {
    config.validate();
  } catch (const Error& e) {
    fail(group_error(index, std::string(e.what()).substr(7)));
  }
  if (const std::string e = impl_->structure_error(index, config); !e.empty()) fail(e);
  Impl& s = *impl_;
  // Copied before the group changes and swapped in (moves do not allocate): a failed copy, or a
  // refusal below, leaves the group's settings as they were.
  GroupConfig kept = config;
  std::swap(s.groups[index], kept);
  // Blocks that do not fit a parameter's rows are refused here rather than at the next step.
  if (is_matrix_algorithm(config.algorithm) && (config.num_heads != kept.num_heads || config.split_sizes != kept.split_sizes)) {
    try {
      for (int i = 0; i < num_params(); ++i)
        if (s.params[i].group == index) s.row_blocks(i);
    } catch (...) {
      std::swap(s.groups[index], kept);
      throw;
    }
  }
}
int Optimizer::num_groups() const { return static_cast<int>(impl_->groups.size()); }
int Optimizer::num_params() const { return static_cast<int>(impl_->params.size()); }
const std::string& Optimizer::param_name(int param) const {
  if (param < 0 || param >= num_params()) fail("no parameter " + std::to_string(param));
  return impl_->params[param].name;
}
std::array<int64_t, 2> Optimizer::Impl::read_counters() const {
  std::array<int64_t, 2> c{};
  backend->copy_to_host(c.data(), counters.get(), sizeof(c));
  return c;
}
int64_t Optimizer::steps_taken() const { return impl_->read_counters()[0]; }
int64_t Optimizer::steps_skipped() const { return impl_->read_counters()[1]; }
Backend& Optimizer::backend() { return *impl_->backend; }
const OptimizerOptions& Optimizer::options() const { return impl_->options; }

void Optimizer::state_changed() {
  const Impl::Use use(*impl_);
  impl_->forget_state_bounds();
  impl_->all_written = true;
}

void Optimizer::state_changed(int param) { state_changed(std::span<const int>(&param, 1)); }

void Optimizer::state_changed(std::span<const int> params) {
  const Impl::Use use(*impl_);
  for (int param : params)
    if (param < 0 || param >= num_params()) fail("state_changed: no parameter " + std::to_string(param));
  if (params.empty()) return;
  impl_->forget_state_bounds();
  // Each parameter once (replays may call this before every one), in time linear in the counts.
  std::vector<int>& w = impl_->written_params;
  std::vector<char> listed(static_cast<std::size_t>(num_params()), 0);
  for (int i : w)
    if (i < num_params()) listed[static_cast<std::size_t>(i)] = 1;
  for (int param : params)
    if (!std::exchange(listed[static_cast<std::size_t>(param)], 1)) w.push_back(param);
}

std::vector<std::pair<std::string, TensorView>> Optimizer::state_views(int param) const {
  if (param < 0 || param >= num_params()) fail("no parameter " + std::to_string(param));
  return impl_->params[param].state;
}

std::vector<Optimizer::Impl::RowBlock> Optimizer::Impl::row_blocks(int i) const {
  const Param& p = params[i];
  const ParamLayout& L = p.layout;
  const bool row_cut = L.kind == Layout::RowShard || L.kind == Layout::Block;
  // Stepped by columns, the blocks are of stored columns, which no layout cuts.
  const bool by_columns = steps_by_columns(groups[p.group]);
  const int64_t M = by_columns ? p.cols : row_cut ? L.global_rows : p.rows;
  std::vector<int64_t> heights;
  try {
    heights = groups[p.group].row_blocks(M);
  } catch (const Error& e) {
    fail(describe(i) + " (group " + std::to_string(p.group) + "): " + std::string(e.what()).substr(7));
  }
  if (heights.size() == 1 && !by_columns)
    return {RowBlock{0, p.rows, M, 0, L.kind, L.kind == Layout::RowShard ? L.row_chunk : 0}};
  if (L.kind == Layout::Block)
    fail(describe(i) + ": split_sizes / num_heads are not available for block-sharded parameters (rows and "
         "columns both cut); give the blocks as separate parameters");
  std::vector<RowBlock> out;
  int64_t b0 = 0;
  if (by_columns || L.kind != Layout::RowShard) {  // whole blocks on every rank
    for (int64_t s : heights) {
      out.push_back(RowBlock{b0, s, s, b0, L.kind, 0});
      b0 += s;
    }
    return out;
  }
  const int64_t P = L.comm->size(), r = L.comm->rank();
  const bool standard = L.row_offset < 0;
  const int64_t c = standard ? ceil_div(M, P) : L.row_chunk;
  const int64_t R0 = standard ? std::min(M, r * c) : L.row_offset;  // this rank's first row
  for (int64_t s : heights) {
    const int64_t lo = std::max(b0, R0), hi = std::min(b0 + s, R0 + p.rows);
    const int64_t held = std::max<int64_t>(hi - lo, 0);
    if (standard && b0 / c == (b0 + s - 1) / c) {  // within shard b0 / c
      if (b0 / c == r) out.push_back(RowBlock{b0 - R0, s, s, b0, Layout::Local, 0});
    } else {
      // Every rank's rows of the block, padded to the most any rank holds.
      int64_t chunk = std::min(s, c);
      if (standard) {
        chunk = 0;
        for (int64_t q = b0 / c; q <= (b0 + s - 1) / c; ++q)
          chunk = std::max(chunk, std::min({b0 + s, (q + 1) * c, M}) - std::max(b0, q * c));
      }
      out.push_back(RowBlock{held ? lo - R0 : 0, held, s, b0, Layout::RowShard, chunk});
    }
    b0 += s;
  }
  return out;
}

void Optimizer::Impl::build_plan() {
  // Refused before anything changes, so that the plan in place can still run this rank's refusal
  // with the others (refuse_invalid) where a group was edited into what cannot be planned.
  std::vector<std::vector<RowBlock>> blocks_of(params.size());
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    const Param& p = params[i];
    const GroupConfig& g = groups[p.group];
    if (!is_matrix_algorithm(g.algorithm)) continue;
    blocks_of[i] = row_blocks(i);
    if (!(selects_rows(g.algorithm) && g.selection_scope == SelectionScope::Global && p.layout.comm &&
          p.layout.comm->size() > 1))
      continue;
    for (const RowBlock& b : blocks_of[i])
      if (b.layout == Layout::RowShard && b.row_chunk > 0)
        fail(group_error(p.group, "selection_scope 'global' needs the standard row cut (ceil(m/P) rows in rank "
                                  "order); '" + p.name + "' is cut otherwise (FSDP2 over tensor parallel, or "
                                  "split_sizes / num_heads blocks that straddle shards): use 'local'"));
  }
  plan_valid = false;  // until it is built whole
  megabatches.clear();
  // Sized afresh for the new plan at its first use: grown later, it would leave the sets bound
  // before the growth pointing at freed memory.
  zeros = DeviceBuffer();
  // Communicators are keyed by their order of first appearance, never by address: every rank
  // must build its megabatches (and so start its collectives) in the same order.
  std::vector<const Communicator*> comms;
  auto comm_index = [&](const Communicator* c) -> int {
    if (!c) return -1;
    for (std::size_t i = 0; i < comms.size(); ++i)
      if (comms[i] == c) return static_cast<int>(i);
    comms.push_back(c);
    return static_cast<int>(comms.size()) - 1;
  };
  // Fields 13-15 single a matrix (block) out when megabatching is off; the last keeps matrices
  // stepped by columns apart from those stepped by rows.
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, int, int, int, int,
                         int64_t, int, bool>;
  std::map<Key, std::size_t> index;
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    const Param& p = params[i];
    const GroupConfig& g = groups[p.group];
    const int ci = comm_index(p.layout.comm.get());
    const int cci = comm_index(p.layout.col_comm.get());
    if (!is_matrix_algorithm(g.algorithm)) continue;
    const DType mom = state_specs(p)[0].dtype;
    const bool col_cut = p.layout.kind == Layout::ColShard || p.layout.kind == Layout::Block;
    const int64_t n = col_cut ? p.layout.global_cols : p.cols;
    const std::vector<RowBlock>& blocks = blocks_of[i];
    // Dion2 selects along the shorter side of the (out, in) matrix when no rank cuts it (the
    // reference's rule: rows unless it is tall), a transposed one's rows being stored columns; a
    // sharded one selects along its cut, the stored rows. A transposed matrix cut along its stored
    // rows is column-sharded as Dion3 and NorMuon step it.
    const bool whole = p.layout.kind == Layout::Local || p.layout.kind == Layout::Replicated;
    const bool dion2_columns = g.transposed ? p.rows >= p.cols : p.rows > p.cols;
    const bool cut_inputs = steps_by_columns(g) && p.layout.kind == Layout::RowShard;
    const bool columns =
        cut_inputs || (whole && (g.algorithm == Algorithm::Dion2 ? dion2_columns : steps_by_columns(g)));
    for (int64_t j = 0; j < p.count; ++j) {
      for (int b = 0; b < static_cast<int>(blocks.size()); ++b) {
        const RowBlock& rb = blocks[b];
        const bool local = rb.layout == Layout::Local;
        const Layout layout = cut_inputs ? Layout::ColShard : rb.layout;
        // The set's whole rows and columns (a transposed one's columns cut as its stored rows are);
        // stepped by columns, a block is of stored columns (only a transposed group's has several).
        const int64_t width = steps_by_columns(g) ? rb.rows : p.cols;
        const int64_t set_rows = columns ? width : rb.global_rows;
        const int64_t set_cols = cut_inputs ? p.layout.global_rows : columns ? p.rows : n;
        // A row-sharded block's cut depends on where it lies in the whole matrix: blocks share a
        // megabatch only where their cuts, and so their shards' rows, are the same.
        const bool cut = layout == Layout::RowShard;
        const Key key{p.group, set_rows, set_cols, rb.row_chunk, cut ? p.layout.global_rows : -1,
                      cut ? rb.global_first : -1, static_cast<int>(p.weight.dtype), static_cast<int>(p.grad.dtype),
                      static_cast<int>(mom), static_cast<int>(layout), local ? -1 : ci, local ? -1 : cci,
                      options.megabatch ? -1 : i, options.megabatch ? -1 : j, options.megabatch ? -1 : b, columns};
        auto [it, fresh] = index.try_emplace(key, megabatches.size());
        if (fresh) {
          Megabatch mb;
          mb.group = p.group;
          mb.columns = columns;
          mb.rows = columns ? width : rb.rows;
          mb.cols = columns ? p.rows : p.cols;
          mb.global_rows = set_rows;
          mb.global_cols = set_cols;
          mb.row_chunk = rb.row_chunk;
          mb.weight_dtype = p.weight.dtype;
          mb.grad_dtype = p.grad.dtype;
          mb.momentum_dtype = mom;
          mb.layout = layout;
          mb.comm = local ? nullptr : p.layout.comm.get();
          mb.col_comm = local ? nullptr : p.layout.col_comm.get();
          megabatches.push_back(std::move(mb));
        }
        megabatches[it->second].members.push_back(Member{i, j, rb.first_row});
      }
    }
  }
  for (std::size_t i = 0; i < megabatches.size(); ++i) plan_distribution(megabatches[i], static_cast<int>(i));

  Allocator& alloc = backend->allocator();
  std::size_t limit = options.workspace_limit;
  if (limit == 0) {  // automatic (OptimizerOptions::workspace_limit)
    std::size_t momentum_bytes = 0;
    for (const Megabatch& mb : megabatches)
      momentum_bytes += static_cast<std::size_t>(mb.members.size() * mb.rows * mb.cols) * dtype_size(mb.momentum_dtype);
    limit = std::max(std::size_t{1} << 30, momentum_bytes / 4);
  }
  std::size_t arena_bytes = 0;
  for (Megabatch& mb : megabatches) {
    const GroupConfig& g = groups[mb.group];
    const auto n = static_cast<int64_t>(mb.members.size());
    // Arena layout of a chunk of `count` members: the update rows U are read only by the
    // orthogonalizer's first pass, so they lie inside its workspace where they fit there (and
    // take no room when the gather writes the orthogonalizer's normalised input itself).
    // Row-sharded megabatches normalise after the exchange (the norm spans every rank's rows),
    // except over one rank, where the rank's rows are the whole input. Block ones always gather
    // U (their rows are whole only after the column all-gather).
    const bool sharded = mb.layout == Layout::RowShard || mb.layout == Layout::ColShard || mb.layout == Layout::Block;
    mb.gathers_normalized = selects_rows(g.algorithm) && (!sharded || mb.ranks == 1) &&
                            mb.layout != Layout::Block && mb.orth_rows <= mb.orth_cols;
    auto layout = [&](int64_t count, Chunk* c) {
      const std::size_t u = mb.gathers_normalized
                                ? 0
                                : align_up(static_cast<std::size_t>(count * mb.orth_rows * mb.orth_cols) *
                                           dtype_size(mb.update_dtype));
      const std::size_t ws =
          Orthogonalizer::required_workspace(*backend, g.orth, count, mb.orth_rows, mb.orth_cols, mb.orth_real_rows);
      const std::size_t in_ws =
          Orthogonalizer::input_offset(*backend, g.orth, count, mb.orth_rows, mb.orth_cols, u, mb.orth_real_rows);
      const bool inside = in_ws != Orthogonalizer::kNoInputRoom;
      if (c) {
        c->update_offset = inside ? in_ws : 0;
        c->orth_offset = inside ? 0 : u;
        c->update_bytes = u;
      }
      return inside ? align_up(ws) : u + align_up(ws);
    };
    auto need = [&](int64_t count) { return layout(count, nullptr); };
    int64_t chunk = std::max<int64_t>(mb.owned_count, 1);
    while (chunk > 1 && need(chunk) > limit) chunk = (chunk + 1) / 2;
    // The arena holds the chunk that needs most, which need not be the largest: a smaller last
    // chunk can leave its update rows no room inside the orthogonalizer's workspace.
    const int64_t rest = mb.owned_count % chunk;
    mb.chunk_bytes = mb.owned_count > 0 ? std::max(need(chunk), rest > 0 ? need(rest) : std::size_t{0}) : 0;
    arena_bytes = std::max(arena_bytes, mb.chunk_bytes);
    mb.set = backend->new_matrix_set();
    if (selects_rows(g.algorithm)) {
      mb.scores = DeviceBuffer(alloc, static_cast<std::size_t>(n * std::max<int64_t>(mb.rows, 1)) * sizeof(float));
      const int64_t listed = mb.global_scope                   ? selected_rows(g.fraction, mb.global_rows)
                             : mb.layout == Layout::RowShard ? mb.rows  // before padding to `piece`
                                                             : mb.k;
      mb.indices = DeviceBuffer(alloc, static_cast<std::size_t>(n * std::max<int64_t>(listed, 1)) * sizeof(int32_t));
      if (mb.global_scope) backend->fill_zero(mb.indices.get(), mb.indices.bytes());  // see Megabatch::slots
    }
    // Row selection: every layout selects from scores that include the row l1 norms of the rank's
    // own momentum (whole rows, its columns' part, or those summed over ranks, or all shards'
    // gathered), so the largest of them bounds every element of it. Muon and NorMuon: accumulate
    // raises the bound over the rank's own momentum, which nothing else in a step writes.
    mb.bounds = DeviceBuffer(alloc, static_cast<std::size_t>(n) * sizeof(float));
    backend->fill_zero(mb.bounds.get(), mb.bounds.bytes());
    if (mb.gathers_normalized || gathers_whole_rows(mb)) {
      mb.row_sumsq = DeviceBuffer(
          alloc, static_cast<std::size_t>(mb.gathers_normalized ? n * (mb.rows + 1) : n * mb.k) * sizeof(float));
      // Zero from the start: an empty shard selects nothing and leaves its members' sums so.
      backend->fill_zero(mb.row_sumsq.get(), mb.row_sumsq.bytes());
    }
    for (int64_t first = mb.owned_first; first < mb.owned_first + mb.owned_count; first += chunk) {
      Chunk c;
      c.first = first;
      c.count = std::min(chunk, mb.owned_first + mb.owned_count - first);
      if (layout(c.count, &c) > mb.chunk_bytes)
        fail("internal error: a chunk of " + mb.label + " needs more workspace than the arena was sized for",
             Status::Internal);
      c.set = backend->new_matrix_set();
      mb.chunks.push_back(std::move(c));
    }
  }
  arena = DeviceBuffer(alloc, arena_bytes);
  // Each parameter's momentum bound: its member's slot where the parameter is one whole member.
  std::vector<int> members_of(params.size(), 0);
  for (const Megabatch& mb : megabatches)
    for (const Member& m : mb.members) ++members_of[m.param];
  for (Param& p : params) p.state_bound = nullptr;
  for (const Megabatch& mb : megabatches)
    for (std::size_t i = 0; i < mb.members.size(); ++i)
      if (members_of[mb.members[i].param] == 1)
        params[mb.members[i].param].state_bound = mb.bounds.as<float>() + i;
  // Element-wise parameters' bounds: two floats for AdamW, one for Lion.
  std::vector<std::pair<Param*, std::size_t>> elementwise;  // parameter, its first float
  std::size_t floats = 0;
  for (Param& p : params) {
    const Algorithm a = groups[p.group].algorithm;
    if (a != Algorithm::AdamW && a != Algorithm::Lion) continue;
    elementwise.emplace_back(&p, floats);
    floats += a == Algorithm::AdamW ? 2 : 1;
  }
  elementwise_bounds = DeviceBuffer();
  if (floats > 0) {
    elementwise_bounds = DeviceBuffer(alloc, floats * sizeof(float));
    backend->fill_zero(elementwise_bounds.get(), elementwise_bounds.bytes());
    for (auto [p, at] : elementwise) p->state_bound = elementwise_bounds.as<float>() + at;
  }
  // Orthogonalizers are planned on the arena (Chunk::orth_offset).
  for (Megabatch& mb : megabatches) {
    const GroupConfig& g = groups[mb.group];
    for (Chunk& c : mb.chunks) {
      for (auto& o : mb.orths)
        if (o->batch() == c.count) c.orth = o.get();
      if (c.orth) continue;
      char* ws = arena.as<char>() + c.orth_offset;
      mb.orths.push_back(
          std::make_unique<Orthogonalizer>(*backend, g.orth, c.count, mb.orth_rows, mb.orth_cols, ws, mb.orth_real_rows));
      c.orth = mb.orths.back().get();
      if (c.orth->iteration_dtype() != mb.orth_dtype)
        fail("internal: the orthogonalizer's dtype differs from the exchange's", Status::Internal);
    }
  }
  for (std::size_t i = 0; i < megabatches.size(); ++i)
    megabatches[i].hyper_slot = static_cast<int>(groups.size() * kGroupHyper + i);
  hyper = DeviceBuffer(alloc, (groups.size() * kGroupHyper + megabatches.size()) * sizeof(float));
  hyper_uploaded.clear();
  ++plan_generation;
  ++binding;
  planned = groups;
  plan_agreement();  // checked against the other ranks' plans by the next step's agreement
  plan_valid = true;
}

Hyper Optimizer::Impl::group_hyper(int g, GroupHyper which) const {
  const float* at = hyper.as<float>() + g * kGroupHyper + which;
  const GroupConfig& c = groups[g];
  switch (which) {  // the value, for backends that read it on the host before the step runs
    case kMu: return {static_cast<float>(c.mu), at};
    case kDecay: return {1.0f - static_cast<float>(c.base_lr()) * static_cast<float>(c.weight_decay), at};
    case kMuonBeta2: return {static_cast<float>(c.muon_beta2), at};
    case kLr: return {static_cast<float>(c.lr), at};
    case kBeta1: return {static_cast<float>(c.betas[0]), at};
    case kBeta2: return {static_cast<float>(c.betas[1]), at};
    case kWeightDecay: return {static_cast<float>(c.weight_decay), at};
    case kEpsilon: return {static_cast<float>(c.epsilon), at};
    case kGradScale: return {c.ema_momentum ? static_cast<float>(1.0 - c.mu) : 1.0f, at};
    default: break;
  }
  fail("internal: no such hyper-parameter slot", Status::Internal);
}

Hyper Optimizer::Impl::megabatch_lr(const Megabatch& mb) const {
  const auto [m, n] = mb.logical_shape(groups[mb.group].transposed);
  return {static_cast<float>(groups[mb.group].adjusted_lr(m, n)),  // the whole matrix's shape
          hyper.as<float>() + mb.hyper_slot};
}

std::vector<float> Optimizer::Impl::hyper_values() const {
  std::vector<float> v(groups.size() * kGroupHyper + megabatches.size());
  for (int g = 0; g < static_cast<int>(groups.size()); ++g)
    for (int w = 0; w < kGroupHyper; ++w) v[g * kGroupHyper + w] = group_hyper(g, static_cast<GroupHyper>(w)).value;
  for (const Megabatch& mb : megabatches) v[mb.hyper_slot] = megabatch_lr(mb).value;
  return v;
}

void Optimizer::Impl::upload_hyper(bool capturing) {
  if (capturing) {  // a captured step reads what the last refresh left there
    if (hyper_uploaded.empty())
      fail("a step is being captured before its hyper-parameters were ever written to the device: take one "
           "step (or call refresh_hyperparameters()) before the capture");
    if (!regions.empty() && absence_written != absence)
      fail("a distributed step is being captured after a parameter's gradient came or went (set_grad, clear_grad) "
           "since the last step: take one step (not captured) first, so that the ranks compare which parameters "
           "they step");
    return;
  }
  std::vector<float> v = hyper_values();
  const bool absence_moved = absence_written != absence;
  if (v == hyper_uploaded && !absence_moved) return;
  if (v != hyper_uploaded) backend->upload(hyper.get(), v.data(), v.size() * sizeof(float));
  if (!regions.empty()) write_starts(v);  // the agreement compares them, and the absent members
  hyper_uploaded = std::move(v);
}

ExchangePlan exchange_plan(Layout layout, const GroupConfig& g, int64_t count, int64_t m, int64_t cols, int ranks,
                           DType update_dtype, DType orth_dtype, int64_t row_chunk, int col_ranks) {
  ExchangePlan x;
  const bool selects = selects_rows(g.algorithm);
  const int64_t P = layout == Layout::Local ? 1 : ranks;
  x.k = selects ? selected_rows(g.fraction, m) : m;
  x.orth_rows = x.k;
  x.orth_cols = cols;
  x.block = layout == Layout::Local ? count : ceil_div(count, P);
  const std::size_t es_u = dtype_size(update_dtype), es_o = dtype_size(orth_dtype);
  // Rows of a stack of P pieces of `piece` rows that can be non-zero: each rank's rows of its
  // chunk of c, at most `piece` of them (the rest of a short shard's piece is zero padding). With
  // a cut of its own (row_chunk) the ranks' rows are not known here: a bound.
  auto real_rows = [&](int64_t c, int64_t piece) {
    if (row_chunk > 0) return std::min(P * piece, m);
    int64_t real = 0;
    for (int64_t r = 0; r < P; ++r) real += std::min(piece, std::clamp<int64_t>(m - r * c, 0, c));
    return real;
  };
  if (layout == Layout::Replicated) {
    // One all-gather of every rank's block of results.
    x.rounds = 1;
    x.bytes_sent = static_cast<std::size_t>((P - 1) * x.block * x.k * cols) * es_o;
  } else if (layout == Layout::RowShard) {
    // Selected rows to the owner and back: two all-to-alls of `piece` rows per matrix and rank;
    // the global scope first all-gathers every shard's row scores.
    const int64_t c = row_chunk > 0 ? row_chunk : ceil_div(m, P);
    // Over one rank the whole matrix is the shard: both scopes select the same rows.
    const bool global = selects && g.selection_scope == SelectionScope::Global && P > 1;
    x.piece = !selects ? c : global ? std::min(x.k, c) : selected_rows(g.fraction, c);
    // Global scope: the owner compacts the k selected rows out of the padded pieces.
    x.orth_rows = global ? x.k : P * x.piece;
    if (!global) x.real_rows = real_rows(c, x.piece);
    x.k = x.piece;
    x.rounds = 2;
    x.bytes_sent = static_cast<std::size_t>((P - 1) * x.block * x.piece * cols) * (es_u + es_o);
    if (global) {
      x.rounds += 1;
      x.bytes_sent += static_cast<std::size_t>((P - 1) * count * c) * sizeof(float);
    }
  } else if (layout == Layout::ColShard) {
    // Row scores summed over the ranks' columns (Dion3: an all-gather of partial scores), each
    // rank's columns of the selected rows to the owner (all-to-all), whole result rows back to
    // every rank (all-gather): selection and NorMuon see whole rows.
    // The owner packs the ranks' columns side by side, n wide (no padding: zero columns would
    // leave a tall matrix's Gram rank-deficient where one device transposes it).
    const int64_t c = ceil_div(cols, P);
    x.orth_cols = cols;
    x.rounds = selects ? 3 : 2;
    x.bytes_sent = static_cast<std::size_t>((P - 1) * x.block * x.k) *
                   (static_cast<std::size_t>(c) * es_u + static_cast<std::size_t>(cols) * es_o);
    if (selects) x.bytes_sent += static_cast<std::size_t>((P - 1) * count * m) * sizeof(float);
  }
  if (P == 1) x.rounds = 0;  // a rank alone exchanges nothing
  if (layout == Layout::Block) {
    // Row scores summed over the column ranks (Dion3), each rank's block of its pieces gathered
    // over the column ranks into whole-width pieces, then the row-sharded exchange of those over
    // the row ranks (every column rank of a row group runs it alike).
    const int64_t c = ceil_div(m, P), Pc = col_ranks, cc = ceil_div(cols, Pc);
    x.piece = selects ? selected_rows(g.fraction, c) : c;
    x.k = x.piece;
    x.orth_rows = P * x.piece;
    x.real_rows = real_rows(c, x.piece);
    x.orth_cols = cols;  // the column blocks packed, as for ColShard
    x.rounds = (P > 1 ? 2 : 0) + (Pc > 1 ? (selects ? 2 : 1) : 0);
    x.bytes_sent = static_cast<std::size_t>((P - 1) * x.block * x.piece * x.orth_cols) * (es_u + es_o) +
                   static_cast<std::size_t>((Pc - 1) * count * x.piece * cc) * es_u;
    if (selects) x.bytes_sent += static_cast<std::size_t>((Pc - 1) * count * c) * sizeof(float);
  }
  return x;
}

void Optimizer::Impl::plan_distribution(Megabatch& mb, int index) {
  const GroupConfig& g = groups[mb.group];
  const auto n = static_cast<int64_t>(mb.members.size());
  const bool selects = selects_rows(g.algorithm);
  Allocator& alloc = backend->allocator();
  mb.ranks = mb.comm ? mb.comm->size() : 1;
  mb.rank = mb.comm ? mb.comm->rank() : 0;
  mb.col_ranks = mb.col_comm ? mb.col_comm->size() : 1;
  mb.col_rank = mb.col_comm ? mb.col_comm->rank() : 0;
  mb.update_dtype = update_rows_dtype(g, mb.momentum_dtype);
  const int64_t P = mb.ranks, m = mb.global_rows;
  mb.global_scope =
      mb.layout == Layout::RowShard && selects && g.selection_scope == SelectionScope::Global && mb.ranks > 1;
  // The exchange's row counts decide the orthogonalizer's shape, and so its result dtype (decided
  // from the shape alone so that every rank agrees, even one that orthogonalizes nothing).
  const int64_t ncols = mb.global_cols;
  const int64_t chunk = mb.row_chunk;  // 0 under the global scope (build_plan refuses the rest)
  const ExchangePlan shape =
      exchange_plan(mb.layout, g, n, m, ncols, mb.ranks, mb.update_dtype, DType::F32, chunk, mb.col_ranks);
  const OrthMethod method = choose_orth_method(*backend, g.orth, shape.orth_rows, shape.orth_cols);
  mb.orth_dtype = choose_iteration_dtype(*backend, g.orth, method);
  const ExchangePlan x =
      exchange_plan(mb.layout, g, n, m, ncols, mb.ranks, mb.update_dtype, mb.orth_dtype, chunk, mb.col_ranks);
  mb.k = x.k;
  mb.piece = x.piece;
  mb.orth_rows = x.orth_rows;
  mb.orth_real_rows = x.real_rows;
  mb.orth_cols = x.orth_cols;
  mb.block = x.block;
  mb.rounds = x.rounds;
  mb.bytes_sent = x.bytes_sent;
  mb.owned_first = std::min(n, mb.rank * mb.block);
  mb.owned_count = std::min(mb.block, n - mb.owned_first);
  char label[160];
  std::snprintf(label, sizeof(label), "megabatch %d (%lld x %lldx%lld %s%s, %s over %d ranks)", index,
                static_cast<long long>(n), static_cast<long long>(m), static_cast<long long>(ncols),
                dtype_name(mb.weight_dtype), mb.columns ? " by columns" : "", layout_name(mb.layout), mb.ranks);
  mb.label = label;
  const std::size_t es_u = dtype_size(mb.update_dtype), es_o = dtype_size(mb.orth_dtype);
  if (mb.layout != Layout::Local) {  // the members other ranks orthogonalize
    for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, mb.owned_first},
                          std::pair<int64_t, int64_t>{mb.owned_first + mb.owned_count, n}})
      if (hi > lo) {
        mb.others.emplace_back(lo, backend->new_matrix_set());
        mb.others.back().second->mats.resize(static_cast<std::size_t>(hi - lo));
      }
  }
  // Exchange buffers only where something leaves the rank.
  if (mb.layout == Layout::Block) {
    const int64_t Pc = mb.col_ranks, cc = ceil_div(ncols, Pc);
    plan_piece_lists(mb, selects);
    // colbuf: every column rank's block of every member's pieces (all-gathered in place); send:
    // whole-width pieces, member order; recv: the forward pieces of this rank's block; back: the
    // results for the other row ranks.
    mb.colbuf = DeviceBuffer(alloc, static_cast<std::size_t>(Pc * n * mb.piece * cc) * es_u);
    const std::size_t slot = static_cast<std::size_t>(mb.piece * mb.orth_cols);
    mb.send = DeviceBuffer(alloc, P * mb.block * slot * es_u);
    if (P > 1) {
      mb.recv = DeviceBuffer(alloc, P * mb.block * slot * std::max(es_u, es_o));
      mb.back = DeviceBuffer(alloc, P * mb.block * slot * es_o);
    }
    if (selects && Pc > 1) plan_score_sum(mb, static_cast<int>(Pc));
  } else if (mb.layout == Layout::ColShard && P > 1) {
    // send: the forward pieces, then (in place) the all-gathered whole result rows; recv: the
    // forward pieces of this rank's block.
    const int64_t c = ceil_div(ncols, P);
    const std::size_t piece = static_cast<std::size_t>(mb.k * c) * es_u;
    const std::size_t rows = static_cast<std::size_t>(mb.k * ncols) * es_o;
    mb.send = DeviceBuffer(alloc, P * mb.block * std::max(piece, rows));
    mb.recv = DeviceBuffer(alloc, P * mb.block * piece);
    if (selects) plan_score_sum(mb, static_cast<int>(P));
  } else if (mb.layout == Layout::Replicated && P > 1) {
    const std::size_t slot = static_cast<std::size_t>(mb.k * mb.cols) * es_o;
    mb.recv = DeviceBuffer(alloc, P * mb.block * slot);  // all-gathered in place
  } else if (mb.layout == Layout::RowShard) {
    const std::size_t slot = static_cast<std::size_t>(mb.piece * mb.cols) * std::max(es_u, es_o);
    if (P > 1) {
      mb.send = DeviceBuffer(alloc, P * mb.block * slot);
      mb.recv = DeviceBuffer(alloc, P * mb.block * slot);
    }
    plan_piece_lists(mb, selects);
    if (mb.global_scope) {
      // Each rank's scores padded to c rows with -1 (below any real score, so never selected).
      std::vector<float> pad(static_cast<std::size_t>(n * ceil_div(m, P)), -1.0f);
      mb.score_send = DeviceBuffer(alloc, pad.size() * sizeof(float));
      backend->copy_from_host(mb.score_send.get(), pad.data(), pad.size() * sizeof(float));
      mb.score_recv = DeviceBuffer(alloc, P * pad.size() * sizeof(float));
      mb.all_scores = DeviceBuffer(alloc, P * pad.size() * sizeof(float));
      // Slot rows of the compaction; the selection starts valid (zeros), as copy_rows reads it
      // whatever the step's verdict.
      mb.slots = DeviceBuffer(alloc, static_cast<std::size_t>(std::max<int64_t>(mb.owned_count, 1) * mb.orth_rows) *
                                         sizeof(int32_t));
    }
  }
}

namespace {
// FNV-1a over 64-bit numbers: the agreement's digests.
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void mix(int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  void mix(double x) {
    int64_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    mix(bits);
  }
  void mix(const std::string& s) {
    for (unsigned char c : s) {
      h ^= c;
      h *= 1099511628211ull;
    }
    mix(static_cast<int64_t>(s.size()));
  }
};
}  // namespace

// Every rank must have planned the same megabatches in the same order with the same settings, or
// their collectives would pair up wrongly (or hang) or their replicas part. Each communicator's
// region of the step's agreement carries a digest of the megabatches over it, their groups' plan
// settings and every parameter's algorithm (comm.hpp), so the check costs no collective of its
// own and a rank that planned anew (a weight given new storage on that rank alone) still pairs
// with the others' step. The region's hyper-parameters are hashed apart (write_starts): they
// change from step to step, the plan does not.
void Optimizer::Impl::plan_agreement() {
  const std::vector<Communicator*>& comms = communicators();
  regions.assign(comms.size(), Region{});
  flag_words = comms.empty() ? 2 : kAgreementRegions * kAgreementWords;
  for (std::size_t r = 0; r < comms.size(); ++r) {
    const Communicator* comm = comms[r];
    Region& region = regions[r];
    Fnv f;
    // Every setting same_plan() compares: a rank whose setting differs would run other collectives
    // (selection_scope) or leave its replicas apart (nesterov, cautious_wd, the orthogonalizer).
    auto mix_settings = [&f](const GroupConfig& g) {
      for (int64_t v : {static_cast<int64_t>(g.algorithm), static_cast<int64_t>(g.flatten),
                        g.momentum_dtype ? static_cast<int64_t>(*g.momentum_dtype) : -1,
                        static_cast<int64_t>(g.nesterov), static_cast<int64_t>(g.cautious_wd), g.num_heads,
                        static_cast<int64_t>(g.orth.method), static_cast<int64_t>(g.orth.restarts.size()),
                        g.orth.iteration_dtype ? static_cast<int64_t>(*g.orth.iteration_dtype) : -1,
                        static_cast<int64_t>(g.selection_scope), static_cast<int64_t>(g.split_sizes.size()),
                        static_cast<int64_t>(g.orth.coefficients.size()), static_cast<int64_t>(g.orth.norm.floor),
                        static_cast<int64_t>(g.transposed)})
        f.mix(v);
      f.mix(g.fraction);
      f.mix(static_cast<double>(g.orth.norm.eps));
      for (int64_t v : g.split_sizes) f.mix(v);
      for (int v : g.orth.restarts) f.mix(static_cast<int64_t>(v));
      for (const Coefficients& c : g.orth.coefficients)
        for (double x : c) f.mix(x);
    };
    std::vector<bool> reads_group(groups.size(), false);
    for (const Megabatch& mb : megabatches) {
      if (mb.comm != comm && mb.col_comm != comm) continue;
      ++region.count;
      region.megabatches.push_back(static_cast<int>(&mb - megabatches.data()));
      for (int64_t v : {static_cast<int64_t>(mb.members.size()), mb.global_rows, mb.global_cols, mb.piece, mb.k,
                        static_cast<int64_t>(mb.layout), static_cast<int64_t>(mb.weight_dtype),
                        static_cast<int64_t>(mb.momentum_dtype), static_cast<int64_t>(mb.orth_dtype),
                        static_cast<int64_t>(mb.global_scope)})
        f.mix(v);
      mix_settings(groups[mb.group]);
      if (options.agree_on_names)
        for (const Member& m : mb.members) f.mix(params[static_cast<std::size_t>(m.param)].name);
      region.hyper_slots.push_back(mb.hyper_slot);
    }
    // Every parameter over the communicator, element-wise ones included (their algorithm: AdamW
    // against Lion on one rank would part the replicas; the shape of one whole on every rank,
    // global_rows given: a vector longer on one rank would step other elements there).
    // A matrix one's group settings and whole shape as well: cut into blocks that each lie within
    // one shard (split_sizes, num_heads), it steps in local megabatches that the loop above skips.
    for (const Param& p : params)
      if (p.layout.comm.get() == comm || p.layout.col_comm.get() == comm) {
        f.mix(static_cast<int64_t>(p.layout.kind));
        f.mix(static_cast<int64_t>(groups[p.group].algorithm));
        if (is_matrix_algorithm(groups[p.group].algorithm)) {
          const Layout k = p.layout.kind;
          const bool rows_cut = k == Layout::RowShard || k == Layout::Block;
          const bool cols_cut = k == Layout::ColShard || k == Layout::Block;
          for (int64_t v : {p.count, rows_cut ? p.layout.global_rows : p.rows, cols_cut ? p.layout.global_cols : p.cols,
                            k == Layout::RowShard ? p.layout.row_chunk : 0, static_cast<int64_t>(p.weight.dtype)})
            f.mix(v);
          mix_settings(groups[p.group]);
          region.matrix_params.push_back(static_cast<int>(&p - params.data()));
        } else if (p.layout.kind == Layout::Replicated && p.layout.global_rows > 0) {
          f.mix(static_cast<int64_t>(p.weight.shape.size()));
          for (int64_t d : p.weight.shape) f.mix(d);
        }
        reads_group[p.group] = true;
      }
    for (int g = 0; g < static_cast<int>(groups.size()); ++g) {
      for (int w = 0; reads_group[g] && w < kGroupHyper; ++w) region.hyper_slots.push_back(g * kGroupHyper + w);
      if (reads_group[g] && is_matrix_algorithm(groups[g].algorithm)) region.matrix_groups.push_back(g);
    }
    region.plan = f.h;
  }
  const std::size_t bytes = static_cast<std::size_t>(flag_words) * sizeof(int);
  if (flag.bytes() < bytes) flag = DeviceBuffer(backend->allocator(), bytes);
  if (flag_starts.bytes() < kStarts * bytes) flag_starts = DeviceBuffer(backend->allocator(), kStarts * bytes);
  write_starts(hyper_values());
  plan_confirmed = comms.empty();
}

void Optimizer::Impl::write_starts(const std::vector<float>& hyper) {
  absence_written = absence;
  static constexpr int kVerdicts[kStarts][2] = {{0, 1}, {kRankWithoutGradients, 0}, {kRankRefused, 0}};
  std::vector<int> starts(static_cast<std::size_t>(kStarts * flag_words), 0);
  for (std::size_t r = 0; r < regions.size(); ++r) {
    const Region& region = regions[r];
    Fnv f;
    for (int slot : region.hyper_slots) {
      const float x = hyper[static_cast<std::size_t>(slot)] == 0.0f ? 0.0f : hyper[static_cast<std::size_t>(slot)];
      uint32_t bits;  // -0 and +0 step alike
      std::memcpy(&bits, &x, sizeof(bits));
      f.mix(static_cast<int64_t>(bits));
    }
    // What turns a group's lr into each matrix's, for the matrices whose blocks step in local
    // megabatches (heads within shards), whose lr slots are not in hyper_slots.
    for (int gi : region.matrix_groups) {
      const GroupConfig& g = groups[static_cast<std::size_t>(gi)];
      f.mix(static_cast<int64_t>(g.adjust_lr));
      f.mix(static_cast<int64_t>(g.scale_lr_by_fraction));
    }
    const auto hy = static_cast<uint32_t>(f.h ^ (f.h >> 32));
    // Which members have no gradient this step is part of the plan: a rank stepping a matrix that
    // another leaves alone would part the replicas (or pair zeros with real rows).
    Fnv a;
    a.h = region.plan;
    for (int i = 0; absent_now > 0 && i < static_cast<int>(region.megabatches.size()); ++i) {
      const Megabatch& mb = megabatches[static_cast<std::size_t>(region.megabatches[i])];
      for (std::size_t j = 0; j < mb.members.size(); ++j)
        if (params[static_cast<std::size_t>(mb.members[j].param)].absent) {
          a.mix(static_cast<int64_t>(i));
          a.mix(static_cast<int64_t>(j));
        }
    }
    for (int i = 0; absent_now > 0 && i < static_cast<int>(region.matrix_params.size()); ++i)
      if (params[static_cast<std::size_t>(region.matrix_params[i])].absent) {
        a.mix(static_cast<int64_t>(-1));
        a.mix(static_cast<int64_t>(i));
      }
    const uint64_t plan = a.h;
    const uint32_t digest[kDigestWords] = {static_cast<uint32_t>(plan), static_cast<uint32_t>(plan >> 16),
                                           static_cast<uint32_t>(plan >> 32), static_cast<uint32_t>(plan >> 48),
                                           region.count, region.count >> 16, hy, hy >> 16};
    for (int start = 0; start < kStarts; ++start) {
      int* w = starts.data() + start * flag_words + r * kAgreementWords;
      for (int i = 0; i < kDigestWords; ++i) {
        w[2 + i] = static_cast<int>(digest[i] & 0xFFFF);
        w[2 + kDigestWords + i] = 0xFFFF - w[2 + i];
      }
    }
  }
  for (int r = static_cast<int>(regions.size()); !regions.empty() && r < kAgreementRegions; ++r)
    for (int start = 0; start < kStarts; ++start)  // an empty digest: words 0, complements 0xFFFF
      std::fill_n(starts.data() + start * flag_words + r * kAgreementWords + 2 + kDigestWords, kDigestWords, 0xFFFF);
  for (int start = 0; start < kStarts; ++start) {
    starts[static_cast<std::size_t>(start * flag_words)] = kVerdicts[start][0];
    starts[static_cast<std::size_t>(start * flag_words + 1)] = kVerdicts[start][1];
  }
  backend->upload(flag_starts.get(), starts.data(), starts.size() * sizeof(int));
}

std::string Optimizer::Impl::disagreement_error(const int* words) const {
  const std::string none = std::string("; ") + kNotApplied;
  if (words[0] & kRankRefused)
    return "another rank refused this step: a setting or input was invalid there (that rank's error names it)" +
           none;
  const std::vector<Communicator*>& comms = communicators();
  if (words[0] & kPlansDiffer) {
    // A region empty on some rank but not on all (each complement at its most, or past this rank's
    // communicators): the ranks' parameters span different numbers of communicators.
    for (int r = 0; r < kAgreementRegions; ++r) {
      const int* d = words + r * kAgreementWords + 2;
      if (agreement_plans_differ(words + r * kAgreementWords) &&
          (r >= static_cast<int>(comms.size()) ||
           std::all_of(d + kDigestWords, d + 2 * kDigestWords, [](int w) { return w == 0xFFFF; })))
        return "the ranks planned different steps: their parameters span different numbers of communicators (" +
               std::to_string(comms.size()) + " on this rank); every rank must register the same parameters, in "
               "the same order, with the same layouts" + none;
    }
    for (int r = 0; r < static_cast<int>(comms.size()); ++r) {
      if (!agreement_plans_differ(words + r * kAgreementWords)) continue;
      const int* d = words + r * kAgreementWords + 2;
      // Words 4 and 5 hold the count of distributed megabatches: the most and the fewest any rank has.
      auto count = [&](int off, bool complement) {
        const auto lo = static_cast<uint32_t>(complement ? 0xFFFF - d[off + 4] : d[off + 4]);
        const auto hi = static_cast<uint32_t>(complement ? 0xFFFF - d[off + 5] : d[off + 5]);
        return std::to_string(lo | (hi << 16));
      };
      const std::string most = count(0, false), fewest = count(kDigestWords, true);
      const std::string counts =
          most != fewest ? "the ranks have from " + fewest + " to " + most + " distributed megabatches"
                         : "each rank has " + most + (most == "1" ? " distributed megabatch" : " distributed megabatches") +
                               ", whose parameters' shapes, dtypes, layouts, algorithms or plan settings differ "
                               "(fraction, selection_scope, nesterov, cautious_wd, split_sizes, num_heads, the "
                               "orthogonalizer)" +
                               (options.agree_on_names ? ", or the parameters' names, in order" : "") +
                               ", or which of them have a gradient this step";
      return "the ranks of " + comms[static_cast<std::size_t>(r)]->describe() + " planned different steps (" + counts +
             "): every rank must register the same parameters, in the same order, with the same groups, "
             "settings and global shapes" + none;
    }
    return "the ranks planned different steps" + none;
  }
  if (words[0] & kHyperDiffer) {
    std::string where = "the ranks";
    for (std::size_t r = 0; r < comms.size(); ++r)
      if (agreement_hypers_differ(words + r * kAgreementWords)) {
        where = "the ranks of " + comms[r]->describe();
        break;
      }
    return where + " stepped with different hyper-parameters (lr, weight_decay, mu, muon_beta2, betas, epsilon, "
                   "ema_momentum, or an lr after adjust_lr): applied, the step would part their replicas and shards; every rank "
                   "must use the same values" + none;
  }
  if (words[0] & kRankWithoutGradients)
    return "another rank took no part in this step (none of its parameters had a gradient): every rank must step "
           "the same parameters" + none;
  return "";
}

std::vector<MegabatchInfo> Optimizer::plan() {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  // The plan the next step runs: what it depends on may have changed since the last one.
  if (s.plan_stale()) {
    if (s.backend->capturing() && !s.communicators().empty())
      fail("plan: a distributed plan cannot be made during a CUDA graph capture (the ranks compare it on the "
           "host); take one step (not captured) after the change, then capture");
    // Planned only from settings a step accepts: a later refusal runs through this plan.
    for (int g = 0; g < num_groups(); ++g) s.check_group(g);
    s.build_plan();
  }
  std::vector<MegabatchInfo> out;
  for (const Megabatch& mb : s.megabatches) {
    const GroupConfig& g = s.groups[mb.group];
    MegabatchInfo info;
    info.group = mb.group;
    info.algorithm = g.algorithm;
    info.rows = mb.global_rows;
    info.columns = mb.columns;
    info.cols = mb.global_cols;
    info.dtype = mb.weight_dtype;
    info.count = static_cast<int64_t>(mb.members.size());
    info.selected_rows = mb.layout == Layout::RowShard && !mb.global_scope ? mb.piece * mb.ranks : mb.k;
    if (mb.global_scope) info.selected_rows = selected_rows(g.fraction, mb.global_rows);
    info.method = choose_orth_method(*s.backend, g.orth, mb.orth_rows, mb.orth_cols);
    info.iteration_dtype = mb.orth_dtype;
    info.workspace_bytes = mb.chunk_bytes + mb.scores.bytes() + mb.indices.bytes() + mb.row_sumsq.bytes() +
                           mb.send.bytes() + mb.recv.bytes() + mb.piece_idx.bytes() + mb.score_send.bytes() +
                           mb.score_recv.bytes() + mb.all_scores.bytes();
    info.chunk = mb.chunks.empty() ? 0 : mb.chunks.front().count;
    info.layout = mb.layout;
    info.ranks = mb.ranks;
    info.owned = mb.owned_count;
    info.piece_rows = mb.piece;
    info.orth_rows = mb.orth_rows;
    info.orth_cols = mb.orth_cols;
    info.rounds = mb.rounds;
    info.bytes_sent = mb.bytes_sent;
    out.push_back(info);
  }
  return out;
}

void Optimizer::Impl::check_group(int g) const {
  try {
    groups[g].validate();
  } catch (const Error& e) {
    fail(group_error(g, std::string(e.what()).substr(7)));
  }
  // Gram asked for in the backend's own dtype (validate() checks a dtype given): refused here,
  // before the plan is built, rather than by the orthogonalizer's planning.
  const OrthConfig& orth = groups[g].orth;
  if (is_matrix_algorithm(groups[g].algorithm) && orth.method == OrthMethod::Gram && !orth.iteration_dtype)
    if (const std::string e = orth.gram_divergence_error(choose_iteration_dtype(*backend, orth, OrthMethod::Gram));
        !e.empty())
      fail(group_error(g, e));
  if (const std::string e = structure_error(g); !e.empty()) fail(e);
}

bool Optimizer::Impl::plan_stale(bool grad_dtypes) const {
  if (!plan_valid) return true;
  for (std::size_t g = 0; g < groups.size(); ++g)
    if (!same_plan(groups[g], planned[g])) return true;
  if (!grad_dtypes) return false;
  for (const Megabatch& mb : megabatches)
    for (const Member& m : mb.members)
      if (params[m.param].grad.dtype != mb.grad_dtype) return true;
  return false;
}

void Optimizer::Impl::validate_for_step(bool grads_bound) {
  Impl& s = *this;
  // 1. Validate everything before touching memory.
  if (s.groups.empty()) fail("step: the optimizer has no parameter groups");
  const int num_groups = static_cast<int>(s.groups.size());
  // The parameters' checks see nothing new while the binding stays where they passed.
  const bool params_checked = s.validated == s.binding;
  std::vector<int> group_size(params_checked ? 0 : s.groups.size(), 0);
  if (!params_checked)
    for (const Param& p : s.params) ++group_size[p.group];
  for (int g = 0; g < num_groups; ++g) {
    if (!params_checked && group_size[g] == 0)
      fail(group_error(g, "the group is empty; every group needs at least one parameter"));
    s.check_group(g);
  }
  for (int i = 0; !params_checked && i < static_cast<int>(s.params.size()); ++i) {
    const Param& p = s.params[i];
    if (grads_bound && !p.grad.data && !p.absent && p.weight.numel() > 0)
      fail(s.describe(i) + " has no gradient; call set_grad (or clear_grad) before step");
  }
  // A plan whose settings changed stays valid until build_plan() replaces it: a new setting that
  // cannot be planned (num_heads that does not divide the rows) leaves the old plan to refuse with.
  // Gradient dtypes can have changed (set_grad) only where the binding moved.
  if (s.plan_stale(!params_checked)) {
    // Planning allocates and uploads, which a CUDA graph cannot capture.
    if (s.backend->capturing())
      fail("step: this step must be planned anew (the first step, or parameters, groups, a setting the plan "
           "depends on or a gradient's dtype changed), which cannot be captured in a CUDA graph; take one step "
           "(not captured) first, then capture");
    s.build_plan();
  }
  if (grads_bound) s.validated = s.binding;
  s.check_adjusted_lrs();
  // Last, with a plan: a refusal (refuse_invalid) runs through it. Not a replay's (no host reads).
  if ((s.all_written || !s.written_params.empty()) && !s.backend->capturing()) s.check_written_state();
}

void Optimizer::Impl::check_adjusted_lrs() const {
  // The learning rate a matrix update applies depends on its shape: it too must be a float32.
  for (const Megabatch& mb : megabatches) {
    const auto [m, n] = mb.logical_shape(groups[mb.group].transposed);
    const double lr = groups[mb.group].adjusted_lr(m, n);
    if (!std::isfinite(static_cast<float>(lr)))
      fail(group_error(mb.group, "the learning rate of its " + std::to_string(m) + " x " + std::to_string(n) +
                                     " matrices after adjust_lr is " +
                                     format_number(lr) + ", which is not finite in float32, the precision the step uses"));
  }
}

UpdateParams Optimizer::Impl::update_params(const Megabatch& mb) const {
  const GroupConfig& g = groups[mb.group];
  UpdateParams up;
  up.decay = group_hyper(mb.group, kDecay);
  up.adjusted_lr = megabatch_lr(mb);
  if (mb.layout == Layout::ColShard) up.o_col_offset = std::min(mb.global_cols, mb.rank * ceil_div(mb.global_cols, mb.ranks));
  if (mb.layout == Layout::Block)
    up.o_col_offset = std::min(mb.global_cols, mb.col_rank * ceil_div(mb.global_cols, mb.col_ranks));
  up.beta2 = group_hyper(mb.group, kMuonBeta2);
  up.cautious_wd = g.cautious_wd;
  up.normuon = normalizes_rows(g.algorithm);
  return up;
}

// Every rank takes the same decision on a non-finite gradient: the flag is the maximum over the
// ranks of every communicator, before anything is written. The same collectives compare the
// ranks' plans (plan_agreement); where they differ the flag drops the step on every rank. A rank
// reads that on the host, so that it raises before its next collective (which the others would
// not match), unless the step only enqueues (step_async, a capture) and its plan was seen to
// agree before: after planning anew, in every step that waits for its verdict anyway, and always
// on the CPU, where the read costs nothing.
void Optimizer::Impl::agree_on_flag(int* flag, bool blocking) {
  const std::vector<Communicator*>& comms = communicators();
  if (comms.empty()) return;
  for (Communicator* c : comms)
    c->all_reduce_max(flag, static_cast<std::size_t>(flag_words), backend->stream(), "the step's agreement")->wait();
  backend->settle_agreement(flag, kAgreementRegions);
  if (!blocking && !capturing_now) {  // a replay's verdict is not this call's to post
    if (agreement_posted_words != flag_words) {
      agreement_posted = backend->new_host_copy(static_cast<std::size_t>(flag_words) * sizeof(int));
      agreement_posted_words = flag_words;
    }
    agreement_posted->start(flag);
    agreement_pending = true;
  }
  if (plan_confirmed && !blocking && backend->device() != Device::CPU) return;
  settle_collectives();  // a rank that never joins raises a timeout here, not a wait without end
  const std::vector<int> words = read_agreement();
  if (words[0] & kPlansDiffer) {
    plan_valid = false;  // planned again (and checked again) by the next step
    agreement_pending = false;  // raised now
    fail(disagreement_error(words.data()));
  }
  plan_confirmed = true;
}

std::vector<int> Optimizer::Impl::read_agreement() const {
  std::vector<int> words(static_cast<std::size_t>(flag_words));
  backend->copy_to_host(words.data(), flag.get(), words.size() * sizeof(int));
  return words;
}

std::string Optimizer::Impl::posted_disagreement() {
  if (!agreement_pending) return "";
  agreement_pending = false;
  // The copy was started at that step's agreement, early in it: mostly it has arrived. Where not,
  // the communicators settle first (their pending collectives, with their timeout), so a rank
  // that never joined that agreement is raised instead of a wait that never ends.
  const void* ready = agreement_posted->ready();
  if (!ready) {
    settle_collectives();
    ready = agreement_posted->wait();
  }
  const int* words = static_cast<const int*>(ready);
  // Only what every rank's own call left unsaid: a rank that refused the step (no gradients, an
  // invalid setting) raised then, and goes on with its next call as the others must.
  if (!(words[0] & (kHyperDiffer | kPlansDiffer)) || (words[0] & (kRankRefused | kRankWithoutGradients))) return "";
  if (words[0] & kPlansDiffer) plan_valid = false;  // planned again (and checked again) by the next step
  return "the last step, only enqueued (step_async), was not applied: " + disagreement_error(words);
}

void Optimizer::Impl::check_posted_agreement() {
  if (const std::string e = posted_disagreement(); !e.empty()) fail(e);
}

void Optimizer::check_last_agreement() {
  const Impl::Use use(*impl_);
  impl_->check_posted_agreement();
}

// piece_idx of a row-cut megabatch; Muon / NorMuon (and an empty shard) keep fixed lists: every
// row of the shard in order, then padding.
void Optimizer::Impl::plan_piece_lists(Megabatch& mb, bool selects) {
  const auto n = static_cast<int64_t>(mb.members.size());
  mb.piece_idx = DeviceBuffer(backend->allocator(), static_cast<std::size_t>(n * mb.piece) * sizeof(int32_t));
  if (selects && mb.rows > 0) return;  // selected every step
  std::vector<int32_t> idx(static_cast<std::size_t>(n * mb.piece), kPadRow);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < (selects ? 0 : mb.rows); ++r) idx[i * mb.piece + r] = static_cast<int32_t>(r);
  backend->copy_from_host(mb.piece_idx.get(), idx.data(), idx.size() * sizeof(int32_t));
}

// Buffers to sum partial row scores over `ranks` ranks (ColShard, Block).
void Optimizer::Impl::plan_score_sum(Megabatch& mb, int ranks) {
  Allocator& alloc = backend->allocator();
  const std::size_t scores = static_cast<std::size_t>(mb.members.size() * std::max<int64_t>(mb.rows, 1));
  const std::vector<float> ones(static_cast<std::size_t>(ranks), 1.0f);
  mb.ones = DeviceBuffer(alloc, ones.size() * sizeof(float));
  backend->copy_from_host(mb.ones.get(), ones.data(), ones.size() * sizeof(float));
  mb.score_recv = DeviceBuffer(alloc, ranks * scores * sizeof(float));
  mb.all_scores = DeviceBuffer(alloc, scores * sizeof(float));
}

// Row l1 scores over this rank's columns (mb.scores), summed over the ranks of `comm` that hold
// the other columns: one GEMM with a row of ones, the same arithmetic on every rank, so every
// rank selects the same rows.
const float* Optimizer::Impl::summed_scores(Megabatch& mb, Communicator& comm) {
  Backend& be = *backend;
  const int64_t P = comm.size(), count = static_cast<int64_t>(mb.members.size()) * mb.rows;
  comm_wait(comm.all_gather(mb.scores.get(), mb.score_recv.get(), static_cast<std::size_t>(count) * sizeof(float),
                            be.stream(), "the score all-gather of " + mb.label));
  be.gemm(false, false, 1.0f, MatrixView::contiguous(mb.ones.get(), DType::F32, 1, 1, P),
          MatrixView::contiguous(mb.score_recv.get(), DType::F32, 1, P, count), 0.0f,
          MatrixView::contiguous(mb.all_scores.get(), DType::F32, 1, 1, count));
  return mb.all_scores.as<float>();
}

// Local selection of a row-cut megabatch into piece_idx: the shard's top `piece` rows, or all of
// a short shard's rows then padding (an empty shard keeps its padding lists). With row_sumsq,
// also the selected rows' sums of squares (selected_sumsq).
void Optimizer::Impl::select_pieces(Megabatch& mb, const float* scores, const float* row_sumsq, int* flag) {
  Backend& be = *backend;
  const auto n = static_cast<int64_t>(mb.members.size());
  int32_t* piece_idx = mb.piece_idx.as<int32_t>();
  float* sums = row_sumsq ? selected_sumsq(mb) : nullptr;
  if (mb.rows >= mb.piece) {
    be.select_rows(scores, n, mb.rows, mb.piece, piece_idx, flag, mb.bounds.as<float>(), row_sumsq, sums);
  } else if (mb.rows > 0) {
    int32_t* idx = mb.indices.as<int32_t>();
    be.select_rows(scores, n, mb.rows, mb.rows, idx, flag, mb.bounds.as<float>(), row_sumsq, sums);
    be.remap_rows(idx, n, mb.rows, 0, mb.rows, mb.piece, piece_idx, flag);
  }
}

namespace {

// The rows Dion3 / Muon / NorMuon hand to the orthogonalizer, with error feedback where the
// algorithm has it (algorithm.md §1 steps 3-4, Muon's momentum or its Nesterov mix).
void gather_update_rows(Backend& be, const GroupConfig& g, Hyper mu, Hyper grad_scale, const MatrixSet& set,
                        const int32_t* idx, int64_t k, MatrixView out, float* row_sumsq, const int* flag) {
  if (selects_rows(g.algorithm)) be.gather_rows(set, idx, k, 1.0f, 0.0f, mu, out, row_sumsq, flag);
  else if (g.nesterov) be.gather_rows(set, idx, k, mu, grad_scale, 1.0f, out, row_sumsq, flag);
  else be.gather_rows(set, idx, k, 1.0f, 0.0f, 1.0f, out, row_sumsq, flag);
}

// `count` matrices of rows x cols at `data`, `stride` elements apart.
MatrixView strided(void* data, DType dtype, int64_t count, int64_t rows, int64_t cols, int64_t stride) {
  return MatrixView{data, dtype, count, rows, cols, cols, stride};
}

}  // namespace

void Optimizer::Impl::bind(Megabatch& mb) {
  // Under the caller's capture the tables are written again, so that the graph carries them.
  if (mb.bound == binding && !capturing_now) return;
  Backend& be = *backend;
  mb.set->mats.clear();
  for (const Member& m : mb.members) {
    Param& p = params[m.param];
    // Stepped by columns, a member is every stored row of the block of mb.rows stored columns
    // from column first_row; else mb.rows whole rows from there.
    const int64_t row = m.matrix * p.rows + (mb.columns ? 0 : m.first_row);  // in the flattened rows
    const int64_t col = mb.columns ? m.first_row : 0;
    const int64_t rows = mb.columns ? p.rows : mb.rows, cols = mb.columns ? mb.rows : p.cols;
    ParamMatrix pm;
    // NorMuon's variance holds one entry per set row: a stored column when stepped by columns.
    const int64_t variance_first = mb.columns ? m.matrix * p.cols + col : row;
    if (p.absent) {
      pm.weight = zero_matrix(rows, cols, p.weight.dtype);
      pm.grad = zero_matrix(rows, cols, p.grad.dtype);
      pm.momentum = zero_matrix(rows, cols, mb.momentum_dtype);
      if (p.state.size() > 1) pm.variance = static_cast<float*>(zero_matrix(mb.rows, 1, DType::F32).data);
    } else {
      pm.weight = block_of(p.weight, p.weight.dtype, row, rows, col, cols, p.cols);
      pm.grad = block_of(p.grad, p.grad.dtype, row, rows, col, cols, p.cols);
      pm.momentum = block_of(p.state[0].second, mb.momentum_dtype, row, rows, col, cols, p.cols);
      if (p.state.size() > 1) pm.variance = static_cast<float*>(p.state[1].second.data) + variance_first;
    }
    mb.set->mats.push_back(pm);
  }
  mb.set->columns = mb.columns;
  be.refresh(*mb.set);
  auto part = [&](MatrixSet& set, int64_t first, int64_t count) {
    set.columns = mb.columns;
    set.mats.assign(mb.set->mats.begin() + first, mb.set->mats.begin() + first + count);
    be.refresh(set);
  };
  for (auto& [first, set] : mb.others) part(*set, first, static_cast<int64_t>(set->mats.size()));
  for (Chunk& c : mb.chunks) part(*c.set, c.first, c.count);
  // A captured upload runs only when the graph is replayed: the next eager step uploads again.
  mb.bound = capturing_now ? 0 : binding;
}

MatrixView Optimizer::Impl::zero_matrix(int64_t rows, int64_t cols, DType dtype) {
  const auto bytes_of = [](int64_t r, int64_t c, DType t) { return static_cast<std::size_t>(r * c) * dtype_size(t); };
  if (zeros.bytes() < bytes_of(rows, cols, dtype)) {
    // Memory allocated inside a capture belongs to the graph: later eager steps must not use it.
    if (backend->capturing())
      fail("a step is being captured with a parameter without a gradient (clear_grad) for the first time since "
           "the plan was made: take one step (not captured) with the parameters' gradients as they will be at "
           "the capture first");
    // Once per plan: room for any matrix of it, so that a step captured with some parameters
    // absent keeps reading the same memory.
    std::size_t need = bytes_of(rows, cols, dtype);
    for (const Megabatch& mb : megabatches) {
      const Param& p = params[mb.members.front().param];
      const int64_t r = mb.columns ? p.rows : mb.rows;
      need = std::max(need, bytes_of(mb.rows, 1, DType::F32));  // NorMuon's variance, one entry per set row
      for (DType t : {mb.weight_dtype, mb.grad_dtype, mb.momentum_dtype}) need = std::max(need, bytes_of(r, p.cols, t));
    }
    zeros = DeviceBuffer(backend->allocator(), align_up(need));
    backend->fill_zero(zeros.get(), zeros.bytes());
  }
  return MatrixView::contiguous(zeros.get(), dtype, 1, rows, cols);
}

void Optimizer::Impl::skip_absent_counts() {
  if (absent_now == 0) return;
  for (Param& p : params)
    if (p.absent) ++p.step_offset;
}

int Optimizer::Impl::absent_slot() {
  if (absent_now == 0) return -1;
  if (!absent_sets.empty() && absent_sets.back().absence == absence) return static_cast<int>(absent_sets.size()) - 1;
  if (absent_counts.get() == nullptr) {
    absent_counts = DeviceBuffer(backend->allocator(), kAbsentSlots * 2 * sizeof(int64_t));
    backend->fill_zero(absent_counts.get(), absent_counts.bytes());
  }
  if (static_cast<int>(absent_sets.size()) == kAbsentSlots) fold_absent_counts();
  AbsentSet set{absence, {}};
  for (int i = 0; i < static_cast<int>(params.size()); ++i)
    if (params[i].absent) set.params.push_back(i);
  absent_sets.push_back(std::move(set));
  return static_cast<int>(absent_sets.size()) - 1;
}

void Optimizer::Impl::fold_absent_counts() {
  if (absent_sets.empty()) return;
  std::vector<int64_t> applied(2 * absent_sets.size());
  backend->copy_to_host(applied.data(), absent_counts.get(), applied.size() * sizeof(int64_t));
  backend->fill_zero(absent_counts.get(), applied.size() * sizeof(int64_t));
  for (std::size_t i = 0; i < absent_sets.size(); ++i)
    for (int p : absent_sets[i].params) params[p].step_offset += applied[2 * i];
  absent_sets.clear();
}

void Optimizer::Impl::forget_absent_bounds() {
  for (Megabatch& mb : megabatches) {
    if (!selects_rows(groups[mb.group].algorithm)) continue;
    const auto n = static_cast<int64_t>(mb.members.size());
    for (int64_t i = 0; i < n;) {  // runs of absent members, one fill each
      int64_t end = i;
      while (end < n && params[mb.members[end].param].absent) ++end;
      if (end > i) backend->fill_zero(mb.bounds.as<float>() + i, static_cast<std::size_t>(end - i) * sizeof(float));
      i = end + 1;
    }
  }
}

// Stage 1: momentum, scores and selection; for row-sharded megabatches over several ranks also
// the gather of the rows other ranks orthogonalize and the start of the forward all-to-all.
void Optimizer::Impl::prepare(Megabatch& mb, int* flag) {
  Backend& be = *backend;
  const GroupConfig& g = groups[mb.group];
  bind(mb);
  const auto n = static_cast<int64_t>(mb.members.size());
  const Hyper mu = group_hyper(mb.group, kMu);
  const Hyper gs = group_hyper(mb.group, kGradScale);  // the gradient's coefficient in M
  const bool selects = selects_rows(g.algorithm);
  float* scores = mb.scores.as<float>();
  int32_t* idx = mb.indices.as<int32_t>();
  float* row_sumsq = mb.gathers_normalized ? mb.row_sumsq.as<float>() : nullptr;
  if (mb.layout == Layout::Block) {
    prepare_block(mb, flag);
    return;
  }
  if (mb.layout == Layout::ColShard && mb.ranks > 1) {
    const int64_t P = mb.ranks;
    if (selects) {
      // Row l1 scores over this rank's columns, summed over the ranks (one GEMM with a row of
      // ones, the same arithmetic on every rank, so every rank selects the same rows).
      be.accumulate(*mb.set, 1.0f, 1.0f, scores, nullptr, nullptr, flag);
      be.select_rows(summed_scores(mb, *mb.comm), n, mb.rows, mb.k, idx, flag, mb.bounds.as<float>(), nullptr,
                     nullptr);
    } else {
      be.accumulate(*mb.set, mu, gs, nullptr, nullptr, mb.bounds.as<float>(), flag);
    }
    // The others' columns of the selected rows into `send` ([owner][member][k][c], member
    // order), zero-padded to c columns.
    const int64_t c = ceil_div(mb.global_cols, P);
    const std::size_t slot = static_cast<std::size_t>(mb.k * c) * dtype_size(mb.update_dtype);
    if (mb.cols < c) be.fill_zero(mb.send.get(), n * slot);
    for (auto& [first, set] : mb.others) {
      const auto count = static_cast<int64_t>(set->mats.size());
      if (mb.cols > 0)
        gather_update_rows(be, g, mu, gs, *set, selects ? idx + first * mb.k : nullptr, mb.k,
                           MatrixView{byte_offset(mb.send, first * slot), mb.update_dtype, count, mb.k, mb.cols, c,
                                      mb.k * c},
                           nullptr, flag);
    }
    mb.inflight = mb.comm->all_to_all(mb.send.get(), mb.recv.get(), mb.block * slot, be.stream(),
                                      "the forward all-to-all of " + mb.label);
    return;
  }
  if (mb.layout != Layout::RowShard) {
    if (selects) {
      // M += G, row l1 scores (and sums of squares, for the normalisation in the gather)
      be.accumulate(*mb.set, 1.0f, 1.0f, scores, row_sumsq, nullptr, flag);
      // S = top-k rows (and, when the gather normalises, their sum of squares)
      be.select_rows(scores, n, mb.rows, mb.k, idx, flag, mb.bounds.as<float>(), row_sumsq,
                     row_sumsq ? selected_sumsq(mb) : nullptr);
    } else {
      be.accumulate(*mb.set, mu, gs, nullptr, nullptr, mb.bounds.as<float>(), flag);  // M = mu M + gs G
    }
    return;
  }

  // Row-sharded: `piece` rows of this rank's shard of each member.
  const int64_t P = mb.ranks, c = ceil_div(mb.global_rows, P), shard_first = std::min(mb.global_rows, mb.rank * c);
  int32_t* piece_idx = mb.piece_idx.as<int32_t>();
  if (selects) {
    be.accumulate(*mb.set, 1.0f, 1.0f, scores, row_sumsq, nullptr, flag);
    if (mb.global_scope) {
      // Every rank gathers every shard's scores and selects the whole matrix's top k (the
      // single-device selection), then keeps the rows that fall in its shard.
      const std::size_t fs = sizeof(float);
      if (mb.rows > 0) be.copy_2d(mb.score_send.get(), c * fs, scores, mb.rows * fs, mb.rows * fs, n);
      comm_wait(mb.comm->all_gather(mb.score_send.get(), mb.score_recv.get(), n * c * fs, be.stream(),
                                    "the score all-gather of " + mb.label));
      for (int64_t r = 0; r < P; ++r)
        be.copy_2d(mb.all_scores.as<float>() + r * c, P * c * fs, mb.score_recv.as<float>() + r * n * c, c * fs,
                   c * fs, n);
      const int64_t kg = selected_rows(g.fraction, mb.global_rows);
      be.select_rows(mb.all_scores.as<float>(), n, P * c, kg, idx, flag, mb.bounds.as<float>(), nullptr, nullptr);
      be.remap_rows(idx, n, kg, shard_first, shard_first + mb.rows, mb.piece, piece_idx, flag);
    } else {
      select_pieces(mb, scores, row_sumsq, flag);
    }
  } else {
    be.accumulate(*mb.set, mu, gs, nullptr, nullptr, mb.bounds.as<float>(), flag);
  }
  if (P == 1) return;  // nothing leaves the rank
  // The pieces other ranks orthogonalize (global scope: every piece, the owner compacts them)
  // into `send`, in member order; padding rows (a short or empty shard) are zeros.
  const std::size_t slot = static_cast<std::size_t>(mb.piece * mb.cols) * dtype_size(mb.update_dtype);
  auto gather_into_send = [&](const MatrixSet& set, int64_t first) {
    const auto count = static_cast<int64_t>(set.mats.size());
    gather_update_rows(be, g, mu, gs, set, piece_idx + first * mb.piece, mb.piece,
                       MatrixView::contiguous(byte_offset(mb.send, first * slot), mb.update_dtype, count, mb.piece,
                                              mb.cols),
                       nullptr, flag);
  };
  if (mb.global_scope) gather_into_send(*mb.set, 0);
  else
    for (auto& [first, set] : mb.others) gather_into_send(*set, first);
  mb.inflight = mb.comm->all_to_all(mb.send.get(), mb.recv.get(), mb.block * slot, be.stream(),
                                    "the forward all-to-all of " + mb.label);
}

// Stage 2: orthogonalize this rank's members and apply them; distributed megabatches also start
// the collective that takes the results to the ranks that hold the others.
void Optimizer::Impl::orthogonalize(Megabatch& mb, int* flag) {
  if (mb.layout == Layout::Block) {
    orthogonalize_block(mb, flag);
    return;
  }
  Backend& be = *backend;
  const GroupConfig& g = groups[mb.group];
  const Hyper mu = group_hyper(mb.group, kMu);
  const Hyper gs = group_hyper(mb.group, kGradScale);  // the gradient's coefficient in M
  const bool selects = selects_rows(g.algorithm);
  int32_t* idx = mb.indices.as<int32_t>();
  float* row_sumsq = mb.row_sumsq.as<float>();
  const std::size_t es_o = dtype_size(mb.orth_dtype), es_u = dtype_size(mb.update_dtype);
  const UpdateParams up = update_params(mb);
  const int64_t P = mb.ranks;
  const bool row_shard = mb.layout == Layout::RowShard;
  const bool col_shard = mb.layout == Layout::ColShard && P > 1;
  if ((row_shard || col_shard) && P > 1) comm_wait(std::move(mb.inflight));
  const int32_t* piece_idx = mb.piece_idx.as<int32_t>();
  // Rows per member in the index lists the chunk's gather and update read.
  const int64_t listed = row_shard ? mb.piece : mb.k;
  const std::size_t in_slot = static_cast<std::size_t>(listed * mb.cols) * es_u;
  const std::size_t out_slot = static_cast<std::size_t>(listed * mb.cols) * es_o;

  for (Chunk& c : mb.chunks) {
    const int64_t jl = c.first - mb.owned_first;
    const int32_t* rows = row_shard ? piece_idx + c.first * mb.piece : selects ? idx + c.first * mb.k : nullptr;
    MatrixView O;
    if (mb.gathers_normalized) {
      // X = M[S] / ||M[S]||, straight into the orthogonalizer's buffer; M[S] *= mu.
      be.gather_normalized(*c.set, rows, listed, mu, selected_sumsq(mb) + c.first, c.orth->norm(),
                           c.orth->normalized_input(), flag);
      O = run_orthogonalizer(c, [&] { return c.orth->run_normalized(); });
    } else {
      const MatrixView U = update_rows_in_arena(mb, c);
      if (col_shard) {
        // Each member's selected rows, the ranks' column blocks packed side by side, n wide (this
        // rank's gathered in place; the pieces in `recv` are padded to cc).
        const int64_t cc = ceil_div(mb.global_cols, P);
        const std::size_t piece = static_cast<std::size_t>(cc) * es_u, pitch = mb.orth_cols * es_u;
        for (int64_t r = 0; r < P; ++r) {
          const int64_t held = std::min(cc, mb.global_cols - r * cc);  // rank r's columns
          if (r == mb.rank || held <= 0) continue;
          be.copy_2d(static_cast<char*>(U.data) + r * piece, pitch,
                     byte_offset(mb.recv, (r * mb.block + jl) * mb.k * piece), piece, held * es_u, c.count * mb.k);
        }
        if (mb.cols > 0)
          gather_update_rows(be, g, mu, gs, *c.set, rows, mb.k,
                             MatrixView{static_cast<char*>(U.data) + mb.rank * piece, mb.update_dtype, c.count, mb.k,
                                        mb.cols, mb.orth_cols, mb.k * mb.orth_cols},
                             nullptr, flag);
        O = run_orthogonalizer(c, [&] { return c.orth->run(U); });
      } else if (gathers_whole_rows(mb)) {
        float* ss = row_sumsq + c.first * mb.k;  // U's row sums of squares, for its norm
        gather_update_rows(be, g, mu, gs, *c.set, rows, mb.k, U, ss, flag);
        O = run_orthogonalizer(c, [&] { return c.orth->run(U, ss); });
      } else if (mb.global_scope) {
        // The k selected rows of each member, compacted out of the ranks' padded pieces.
        be.selection_slots(idx + c.first * mb.orth_rows, c.count, mb.orth_rows, ceil_div(mb.global_rows, P),
                           mb.piece, mb.block, jl, mb.slots.as<int32_t>(), nullptr);
        be.copy_rows(U.data, mb.cols * es_u, nullptr, mb.recv.get(), mb.cols * es_u, mb.slots.as<int32_t>(),
                     mb.cols * es_u, c.count * mb.orth_rows);
        O = run_orthogonalizer(c, [&] { return c.orth->run(U); });
      } else {
        // Each member's rows stacked by rank: the others' pieces from `recv` ([rank][member]
        // [piece]), this rank's gathered in place.
        for (int64_t r = 0; r < P; ++r) {
          if (r == mb.rank) continue;
          be.copy_2d(static_cast<char*>(U.data) + r * in_slot, P * in_slot,
                     byte_offset(mb.recv, (r * mb.block + jl) * in_slot), in_slot, in_slot, c.count);
        }
        gather_update_rows(be, g, mu, gs, *c.set, rows, mb.piece,
                           strided(static_cast<char*>(U.data) + mb.rank * in_slot, mb.update_dtype, c.count, mb.piece,
                                   mb.cols, mb.orth_rows * mb.cols),
                           nullptr, flag);
        O = run_orthogonalizer(c, [&] { return c.orth->run(U); });
      }
    }
    if (col_shard) {
      // The whole rows (O is n wide) into this rank's slot of the all-gather, then this rank's
      // columns applied from there: laid out as the other column ranks read them, so that every
      // rank takes the same NorMuon statistics.
      const MatrixView whole =
          MatrixView::contiguous(byte_offset(mb.send, c.first * mb.k * mb.global_cols * es_o), mb.orth_dtype, c.count,
                                 mb.k, mb.global_cols);
      be.copy(whole.data, O.data, c.count * mb.k * mb.global_cols * es_o);
      if (applies_update(mb, up)) be.apply_update(*c.set, rows, mb.k, whole, up, flag);
      continue;
    }
    if (!row_shard) {
      be.apply_update(*c.set, rows, mb.k, O, up, flag);  // reads O in its iteration dtype
      if (mb.layout == Layout::Replicated && P > 1)  // this rank's slot of the all-gather
        be.copy(byte_offset(mb.recv, c.first * out_slot), O.data, c.count * out_slot);
      continue;
    }
    if (mb.global_scope) {
      // The results back where each rank reads its rows; this rank's own from `send` at once.
      be.copy_rows(mb.send.get(), mb.cols * es_o, mb.slots.as<int32_t>(), O.data, mb.cols * es_o, nullptr,
                   mb.cols * es_o, c.count * mb.orth_rows);
      if (mb.rows > 0)
        be.apply_update(*c.set, rows, mb.piece,
                        MatrixView::contiguous(byte_offset(mb.send, (mb.rank * mb.block + jl) * out_slot),
                                               mb.orth_dtype, c.count, mb.piece, mb.cols),
                        up, flag);
      continue;
    }
    if (mb.rows > 0)  // this rank's rows of the results, applied from the orthogonalizer's buffer
      be.apply_update(*c.set, rows, mb.piece,
                      mb.gathers_normalized ? O
                                            : strided(static_cast<char*>(O.data) + mb.rank * out_slot, mb.orth_dtype,
                                                      c.count, mb.piece, mb.cols, mb.orth_rows * mb.cols),
                      up, flag);
    for (int64_t r = 0; r < P; ++r) {
      if (r == mb.rank) continue;
      be.copy_2d(byte_offset(mb.send, (r * mb.block + jl) * out_slot), out_slot,
                 static_cast<const char*>(O.data) + r * out_slot, P * out_slot, out_slot, c.count);
    }
  }
  if (mb.layout == Layout::Replicated && selects) {
    // Error feedback on the rows other ranks orthogonalize (every rank keeps the whole momentum).
    for (auto& [first, set] : mb.others)
      be.gather_rows(*set, idx + first * mb.k, mb.k, 1.0f, 0.0f, mu, MatrixView{}, nullptr, flag);
  }
  if (P == 1) return;
  if (col_shard) {
    const std::size_t slot = static_cast<std::size_t>(mb.k * mb.global_cols) * es_o;
    // In place: this rank's block of the buffer (rank * block; owned_first is n on a rank that owns
    // no matrices, which would overlap another block).
    mb.inflight = mb.comm->all_gather(byte_offset(mb.send, mb.rank * mb.block * slot), mb.send.get(), mb.block * slot,
                                      be.stream(), "the all-gather of " + mb.label);
  } else if (mb.layout == Layout::Replicated) {
    const std::size_t slot = static_cast<std::size_t>(mb.k * mb.cols) * es_o;
    mb.inflight = mb.comm->all_gather(byte_offset(mb.recv, mb.rank * mb.block * slot), mb.recv.get(),
                                      mb.block * slot, be.stream(), "the all-gather of " + mb.label);
  } else if (row_shard) {
    mb.inflight = mb.comm->all_to_all(mb.send.get(), mb.recv.get(), mb.block * out_slot, be.stream(),
                                      "the return all-to-all of " + mb.label);
  }
}

// Stage 3: apply the results other ranks computed to the rows this rank holds.
void Optimizer::Impl::apply(Megabatch& mb, int* flag) {
  if (mb.layout == Layout::Local || mb.ranks == 1) return;
  comm_wait(std::move(mb.inflight));
  const UpdateParams up = update_params(mb);
  if (!applies_update(mb, up)) return;
  const bool selects = selects_rows(groups[mb.group].algorithm);
  const bool row_shard = mb.layout == Layout::RowShard || mb.layout == Layout::Block;
  const int64_t listed = row_shard ? mb.piece : mb.k;
  // Whole rows: ColShard's in `send` (the all-gather's buffer), Block's in `recv`.
  const DeviceBuffer& results = mb.layout == Layout::ColShard ? mb.send : mb.recv;
  const std::size_t slot = static_cast<std::size_t>(listed * mb.global_cols) * dtype_size(mb.orth_dtype);
  for (auto& [first, set] : mb.others) {
    const int32_t* rows = row_shard ? mb.piece_idx.as<int32_t>() + first * mb.piece
                          : selects   ? mb.indices.as<int32_t>() + first * mb.k
                                    : nullptr;
    const MatrixView O = MatrixView::contiguous(byte_offset(results, first * slot), mb.orth_dtype,
                                                static_cast<int64_t>(set->mats.size()), listed, mb.global_cols);
    backend->apply_update(*set, rows, listed, O, up, flag);
  }
}

// Block (see Megabatch): stage 1. The column ranks of a row group hold the same rows, so they
// select alike; their collectives involve only them.
void Optimizer::Impl::prepare_block(Megabatch& mb, int* flag) {
  Backend& be = *backend;
  const GroupConfig& g = groups[mb.group];
  const auto n = static_cast<int64_t>(mb.members.size());
  const bool selects = selects_rows(g.algorithm);
  const int64_t Pc = mb.col_ranks, cc = ceil_div(mb.global_cols, Pc), W = mb.orth_cols;
  const std::size_t es_u = dtype_size(mb.update_dtype);
  const Hyper mu = group_hyper(mb.group, kMu);
  const Hyper gs = group_hyper(mb.group, kGradScale);  // the gradient's coefficient in M
  int32_t* piece_idx = mb.piece_idx.as<int32_t>();
  if (selects) {
    float* scores = mb.scores.as<float>();
    be.accumulate(*mb.set, 1.0f, 1.0f, scores, nullptr, nullptr, flag);
    // Row scores over this rank's columns, summed over the column ranks.
    select_pieces(mb, Pc > 1 && mb.rows > 0 ? summed_scores(mb, *mb.col_comm) : scores, nullptr, flag);
  } else {
    be.accumulate(*mb.set, mu, gs, nullptr, nullptr, mb.bounds.as<float>(), flag);
  }
  // This rank's columns of every member's pieces, into its block of colbuf (zero-padded to cc).
  const std::size_t block = static_cast<std::size_t>(n * mb.piece * cc) * es_u;
  char* mine = byte_offset(mb.colbuf, mb.col_rank * block);
  if (mb.cols < cc) be.fill_zero(mine, block);
  if (mb.cols > 0)
    gather_update_rows(be, g, mu, gs, *mb.set, piece_idx, mb.piece,
                       MatrixView{mine, mb.update_dtype, n, mb.piece, mb.cols, cc, mb.piece * cc}, nullptr, flag);
  if (Pc > 1)
    comm_wait(mb.col_comm->all_gather(mine, mb.colbuf.get(), block, be.stream(),
                                      "the column all-gather of " + mb.label));
  // Whole-width pieces, member order, the column blocks packed (W = n): the row exchange's `send`.
  for (int64_t t = 0; t < Pc; ++t) {
    const int64_t held = std::min(cc, mb.global_cols - t * cc);  // column rank t's columns
    if (held > 0)
      be.copy_2d(mb.send.as<char>() + t * cc * es_u, W * es_u, byte_offset(mb.colbuf, t * block), cc * es_u,
                 held * es_u, n * mb.piece);
  }
  if (mb.ranks > 1)
    mb.inflight = mb.comm->all_to_all(mb.send.get(), mb.recv.get(),
                                      mb.block * static_cast<std::size_t>(mb.piece * W) * es_u, be.stream(),
                                      "the forward all-to-all of " + mb.label);
}

MatrixView Optimizer::Impl::update_rows_in_arena(const Megabatch& mb, const Chunk& c) {
  const MatrixView U = MatrixView::contiguous(arena.as<char>() + c.update_offset, mb.update_dtype, c.count,
                                              mb.orth_rows, mb.orth_cols);
  // U written where the plan left it less room would overwrite the orthogonalizer's workspace,
  // or run past the arena.
  const std::size_t bytes = static_cast<std::size_t>(c.count * mb.orth_rows * mb.orth_cols) * dtype_size(U.dtype);
  if (bytes > c.update_bytes || c.update_offset + bytes > arena.bytes())
    fail("internal error: the update rows of " + mb.label + " do not fit the workspace planned for them",
         Status::Internal);
  return U;
}

// Block: stage 2. Each member's whole-width pieces stacked by row rank, orthogonalized; this
// rank's rows applied at once (its columns), the others' sent back whole-width.
void Optimizer::Impl::orthogonalize_block(Megabatch& mb, int* flag) {
  Backend& be = *backend;
  const int64_t P = mb.ranks, W = mb.orth_cols;
  if (P > 1) comm_wait(std::move(mb.inflight));
  const std::size_t es_u = dtype_size(mb.update_dtype), es_o = dtype_size(mb.orth_dtype);
  const std::size_t in_slot = static_cast<std::size_t>(mb.piece * W) * es_u;
  const std::size_t out_slot = static_cast<std::size_t>(mb.piece * W) * es_o;
  const UpdateParams up = update_params(mb);
  for (Chunk& c : mb.chunks) {
    const int64_t jl = c.first - mb.owned_first;
    const MatrixView U = update_rows_in_arena(mb, c);
    for (int64_t r = 0; r < P; ++r) {
      const char* from = r == mb.rank ? byte_offset(mb.send, (r * mb.block + jl) * in_slot)
                                      : byte_offset(mb.recv, (r * mb.block + jl) * in_slot);
      be.copy_2d(static_cast<char*>(U.data) + r * in_slot, P * in_slot, from, in_slot, in_slot, c.count);
    }
    const MatrixView O = run_orthogonalizer(c, [&] { return c.orth->run(U); });
    if (applies_update(mb, up))
      be.apply_update(*c.set, mb.piece_idx.as<int32_t>() + c.first * mb.piece, mb.piece,
                      MatrixView{static_cast<char*>(O.data) + mb.rank * out_slot, mb.orth_dtype, c.count, mb.piece,
                                 mb.global_cols, W, mb.orth_rows * W},
                      up, flag);
    for (int64_t r = 0; r < P; ++r) {
      if (r == mb.rank) continue;
      be.copy_2d(byte_offset(mb.back, (r * mb.block + jl) * out_slot), out_slot,
                 static_cast<const char*>(O.data) + r * out_slot, P * out_slot, out_slot, c.count);
    }
  }
  if (P > 1)
    mb.inflight = mb.comm->all_to_all(mb.back.get(), mb.recv.get(), mb.block * out_slot, be.stream(),
                                      "the return all-to-all of " + mb.label);
}

template <class Run>
MatrixView Optimizer::Impl::run_orthogonalizer(Chunk& c, Run&& run) {
  // Under the caller's capture the ops join the caller's graph as they are.
  if (!options.record_orthogonalizer || c.eager_only || capturing_now) return run();
  if (c.recording) {
    if (c.recording->replay()) return c.recorded_out;
    c.recording.reset();  // its memory or kernel choices changed: record again
  }
  if (!c.ran) {  // the first run sizes the backend's scratch and loads kernels
    c.ran = true;
    return run();
  }
  try {
    c.recording = backend->record([&] { c.recorded_out = run(); });
  } catch (const Error&) {
    // Run eagerly from now on; a real fault raises again there.
  }
  if (c.recording && c.recording->replay()) return c.recorded_out;
  c.recording.reset();
  c.eager_only = true;
  return run();
}

void Optimizer::Impl::build_lists() {
  std::vector<bool> nesterov(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) nesterov[g] = groups[g].nesterov;
  if (lists.bound == binding && lists.nesterov == nesterov) return;
  Elementwise l;
  l.nesterov = std::move(nesterov);
  for (const Param& p : params)
    if (p.weight.numel() > 0 && !p.absent) l.checks.push_back(step_check(p));
  // Element-wise parameters: values are read from `hyper` when the update runs (the `live`
  // pointers), so the lists hold for any schedule.
  for (const Param& p : params) {
    const GroupConfig& g = groups[p.group];
    if (is_matrix_algorithm(g.algorithm) || p.weight.numel() == 0) continue;
    ElementwiseParam e;
    e.weight = flat_of(p.weight);
    e.grad = flat_of(p.grad);
    e.exp_avg = flat_of(p.state[0].second);
    e.state_bound = p.state_bound;
    const float lr = static_cast<float>(g.lr), wd = static_cast<float>(g.weight_decay);
    const float b1 = static_cast<float>(g.betas[0]), b2 = static_cast<float>(g.betas[1]);
    if (g.algorithm == Algorithm::AdamW) {
      e.exp_avg_sq = flat_of(p.state[1].second);
      l.adamw_ps.push_back(e);
      l.adamw_hs.push_back({lr, b1, b2, wd, static_cast<float>(g.epsilon), counters.as<int64_t>(), p.step_offset,
                            group_hyper(p.group, kLr).at});
    } else {
      l.lion_ps.push_back(e);
      l.lion_hs.push_back({lr, b1, b2, wd, group_hyper(p.group, kLr).at});
    }
  }
  l.bound = binding;
  lists = std::move(l);
}

void Optimizer::Impl::forget_state_bounds() {
  // Under the caller's capture the fills go into the graph (a write captured with the step is
  // forgotten at every replay) and run again at the next step or refresh_hyperparameters()
  // outside it: an eager step may come before the graph's first replay.
  bounds_forget_pending = backend->capturing();
  for (Megabatch& mb : megabatches) backend->fill_zero(mb.bounds.get(), mb.bounds.bytes());
  if (elementwise_bounds.get() != nullptr) backend->fill_zero(elementwise_bounds.get(), elementwise_bounds.bytes());
}

StepCheck Optimizer::Impl::step_check(const Param& p) const {
  const GroupConfig& g = groups[p.group];
  StepCheck c;
  c.grad = flat_of(p.grad);
  c.state = flat_of(p.state[0].second);
  c.state_bound = p.state_bound;
  switch (g.algorithm) {
    case Algorithm::Dion3:  // M += G (the selected rows decay after they are read)
    case Algorithm::Dion2:
      c.a = 1.0f;
      break;
    case Algorithm::NorMuon:
    case Algorithm::Muon:
      c.a = group_hyper(p.group, kMu);
      c.b = g.nesterov ? group_hyper(p.group, kMu) : Hyper(0.0f);
      c.c = group_hyper(p.group, kGradScale);
      break;
    case Algorithm::AdamW:
      c.rule = StepCheck::AdamW;
      c.state2 = flat_of(p.state[1].second);
      c.a = group_hyper(p.group, kBeta1);
      c.b = group_hyper(p.group, kBeta2);
      break;
    case Algorithm::Lion:
      c.rule = StepCheck::Lion;
      c.b = group_hyper(p.group, kBeta2);
      break;
  }
  return c;
}

void Optimizer::Impl::enqueue_step(bool count_dropped, Start start, bool blocking) {
  Impl& s = *this;
  Backend& be = *s.backend;
  // 1. Non-finite gradients, and finite ones that would overflow the state, raise a device flag that every mutating op below obeys; distributed
  //    runs agree on it across ranks first.
  be.begin_step();
  struct EndStep {
    Backend& be;
    ~EndStep() { be.end_step(); }
  } const end_step{be};
  int* flag = s.flag.as<int>();
  s.capturing_now = be.capturing();
  if (s.capturing_now) s.captured_binding = s.binding;
  if (s.bounds_forget_pending && !s.capturing_now) s.forget_state_bounds();
  s.upload_hyper(s.capturing_now);
  s.build_lists();
  // A copy on the device, not a host write, so that a captured step starts it afresh.
  be.copy(flag, s.flag_starts.as<int>() + start * s.flag_words, s.flag_words * sizeof(int));
  const Range step_range(s, "dion3::step");
  {
    const Range r(s, "dion3::check");
    if (start == kStep) be.check_step(s.lists.checks, flag);  // a refusal's gradients are not this step's to judge
    agree_on_flag(flag, blocking);
  }

  // 2. Matrix megabatches, stage by stage across all of them: every forward collective is
  //    started before the first orthogonalization waits for its own, and each return collective
  //    is in flight while the next megabatch orthogonalizes.
  auto stage = [&](const char* name, void (Impl::*run)(Megabatch&, int*)) {
    const Range r(s, name);
    for (Megabatch& mb : s.megabatches) {
      const Range m(s, mb.label.c_str());
      (this->*run)(mb, flag);
    }
  };
  stage("dion3::prepare", &Impl::prepare);  // momentum, scores, selection, gather, forward collectives
  stage("dion3::orthogonalize", &Impl::orthogonalize);
  stage("dion3::update", &Impl::apply);  // return collectives, NorMuon, weight update
  if (s.absent_now > 0) s.forget_absent_bounds();
  const Range r(s, "dion3::elementwise");

  // 3. Element-wise parameters: all AdamW ones in one call, all Lion ones in another (the backend
  //    batches them into as few launches as their dtypes allow).
  if (!s.lists.adamw_ps.empty()) be.adamw(s.lists.adamw_ps, s.lists.adamw_hs, flag);
  if (!s.lists.lion_ps.empty()) be.lion(s.lists.lion_ps, s.lists.lion_hs, flag);
  be.finish_step(flag, s.counters.as<int64_t>(), count_dropped);
}

void Optimizer::refresh_hyperparameters() {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  if (!s.plan_valid) fail("refresh_hyperparameters: no step has been planned yet (take one step first)");
  for (int g = 0; g < num_groups(); ++g) {
    try {
      s.groups[g].validate();
    } catch (const Error& e) {
      fail(group_error(g, std::string(e.what()).substr(7)));
    }
    if (!same_plan(s.groups[g], s.planned[g]))
      fail(group_error(g, "a setting the step's plan depends on changed (fraction, split_sizes, num_heads, nesterov, "
                          "cautious_wd, the orthogonalizer and its norm guard, or the structure); a captured step "
                          "cannot follow it: capture the step again"));
  }
  if (s.captured_binding != 0 && s.binding != s.captured_binding)
    fail("refresh_hyperparameters: the memory the captured step reads moved since the capture (a gradient given "
         "anew with set_grad, an imported state, a new parameter or plan): capture the step again");
  s.check_adjusted_lrs();
  s.upload_hyper(s.backend->capturing());
  if (s.bounds_forget_pending) s.forget_state_bounds();  // before the replay's check reads them
}

uint64_t Optimizer::plan_generation() const { return impl_->plan_generation; }

bool Optimizer::needs_new_plan() const { return impl_->plan_stale(); }

void Optimizer::set_tracer(std::shared_ptr<StepTracer> tracer) { impl_->tracer = std::move(tracer); }

void Optimizer::Impl::post_counters() {
  if (capturing_now) return;  // a replay's counters are not this call's to post
  if (!posted) posted = backend->new_host_copy(2 * sizeof(int64_t));
  posted->start(counters.get());
}

void Optimizer::step_async() {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  // Before anything is planned or enqueued: planning uploads to the device, and the agreement of
  // a new plan is read on the host.
  if (s.backend->capturing() && !s.communicators().empty() && (s.plan_stale() || !s.plan_confirmed))
    fail("a distributed step cannot be captured before the ranks' plans were compared: take one step (not "
         "captured) after the plan was made, then capture");
  if (!s.backend->capturing()) s.check_posted_agreement();
  s.validate_or_refuse();
  // Absent parameters' step counts leave out this step if it is applied: a counter on the device
  // follows its verdict (replays of a capture are counted for them).
  const int slot = s.backend->capturing() ? -1 : s.absent_slot();
  s.enqueue_step(true, Impl::kStep, false);  // nothing is raised here, so a dropped step is counted
  if (slot >= 0) s.backend->finish_step(s.flag.as<int>(), s.absent_counts.as<int64_t>() + 2 * slot, false);
  s.post_counters();
}

bool Optimizer::posted_counters(int64_t out[2]) const {
  const void* host = impl_->posted ? impl_->posted->ready() : nullptr;
  if (host == nullptr) return false;
  std::memcpy(out, host, 2 * sizeof(int64_t));
  return true;
}

// Collectives that never finish raise here, naming themselves, instead of hanging the verdict.
void Optimizer::Impl::settle_collectives() {
  for (Communicator* c : communicators()) c->settle();
}

void Optimizer::Impl::refuse_invalid() {
  if (!plan_valid || communicators().empty() || backend->capturing()) return;
  // The refusal runs the plan with the settings it was made for: this rank's current ones may be
  // what is invalid.
  struct AsPlanned {
    Impl& s;
    const bool swapped = s.planned.size() == s.groups.size();
    explicit AsPlanned(Impl& impl) : s(impl) {
      if (swapped) std::swap(s.groups, s.planned);
    }
    ~AsPlanned() {
      if (swapped) std::swap(s.groups, s.planned);
    }
  };
  try {
    // The other ranks' next call raises for an enqueued step they disagreed on before any
    // collective: this rank runs none either.
    if (!posted_disagreement().empty()) return;
    const AsPlanned as_planned(*this);
    enqueue_step(false, kInvalidHere, true);
    settle_collectives();
  } catch (...) {
    // The others stop here as well (the agreement told them); this rank's own reason is the news,
    // raised by the caller.
  }
}

void Optimizer::Impl::validate_or_refuse(bool grads_bound) {
  try {
    validate_for_step(grads_bound);
  } catch (const Error&) {
    refuse_invalid();
    throw;
  }
}

void Optimizer::refuse_invalid() {
  const Impl::Use use(*impl_);
  impl_->refuse_invalid();
}

bool Optimizer::refuse_step() {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  // It reads the agreement on the host: not in a capture.
  if (s.backend->capturing()) fail("refuse_step cannot be captured in a CUDA graph; call it eagerly");
  s.check_posted_agreement();
  s.validate_or_refuse(false);  // a refusal reads no gradient: none need be bound
  s.enqueue_step(false, Impl::kNoGradients, true);  // a refused step is not a dropped one: not counted
  s.post_counters();
  s.settle_collectives();
  if (s.backend->read_flag(s.flag.as<int>()) & kRankRefused) fail(s.disagreement_error(s.read_agreement().data()));
  if (s.backend->read_flag(s.flag.as<int>() + 1) == 0) return false;  // no rank stepped: nothing to refuse
  fail("no parameter of this rank has a gradient this step while other ranks step: every rank must step the "
       "same parameters; " + std::string(kNotApplied));
}

bool Optimizer::step() {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  Backend& be = *s.backend;
  s.check_posted_agreement();
  s.validate_or_refuse();
  s.enqueue_step(s.options.on_nonfinite == NonFinitePolicy::Skip, Impl::kStep, true);
  s.post_counters();
  int* flag = s.flag.as<int>();
  s.settle_collectives();
  // The verdict: one host synchronisation.
  const int verdict = be.read_flag(flag);
  if (verdict == 0) {
    s.skip_absent_counts();
    return true;
  }
  if (verdict & kNotAStep) {
    // Every rank keeps its plan (a refusing one's registration is unchanged), so the next step's
    // first collective is this agreement again on all of them, steps enqueued only included.
    fail(s.disagreement_error(s.read_agreement().data()));
  }
  if (s.options.on_nonfinite == NonFinitePolicy::Raise) {
    // Spelled for every front end (Python's on_nonfinite, C++'s NonFinitePolicy, C's DION3_NONFINITE_*).
    const char* policy = "(the non-finite policy is raise; the skip policy drops such steps instead)";
    for (int i = 0; i < num_params(); ++i) {
      const Param& p = s.params[i];
      if (p.weight.numel() == 0 || p.absent) continue;
      const MatrixView grad = flat_of(p.grad);
      be.fill_zero(flag, sizeof(int));
      be.check_finite(std::span<const MatrixView>(&grad, 1), flag);
      if (be.read_flag(flag))
        fail(s.describe(i) + " has a non-finite gradient (NaN or Inf); the step was not applied " + policy,
             Status::NonFinite);
      const StepCheck c = s.step_check(p);
      be.check_step(std::span<const StepCheck>(&c, 1), flag);
      if (be.read_flag(flag))
        fail(s.describe(i) + " has a finite gradient, but its " + dtype_name(c.state.dtype) + " " +
             (c.rule == StepCheck::AdamW ? "moments" : "momentum") +
             " would become non-finite at this step (a gradient too large for them, or a NaN or Inf written "
             "into them), so it was not applied " + policy, Status::NonFinite);
    }
    fail(std::string("a gradient on another rank is non-finite (NaN or Inf) or would make its optimizer state "
                     "non-finite; ") + kNotApplied + " " + policy, Status::NonFinite);
  }
  return false;
}

}  // namespace dion3
