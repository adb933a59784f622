// optimizer.cpp — the engine: registration and validation, megabatch planning, the step (SPEC §1).
#include "dion3/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "core/engine.hpp"
#include "dion3/error.hpp"

namespace dion3 {

namespace {

MatrixView matrix_of(const TensorView& t, DType dtype, int64_t index, int64_t rows, int64_t cols) {
  char* base = static_cast<char*>(t.data) + static_cast<std::size_t>(index * rows * cols) * dtype_size(dtype);
  return MatrixView::contiguous(base, dtype, 1, rows, cols);
}

MatrixView flat_of(const TensorView& t) {
  return MatrixView::contiguous(t.data, t.dtype, 1, 1, t.numel());
}

// Structural settings that decide the plan and the state layout.
bool same_structure(const GroupConfig& a, const GroupConfig& b) {
  return a.algorithm == b.algorithm && a.flatten == b.flatten && a.momentum_dtype == b.momentum_dtype;
}
bool same_plan(const GroupConfig& a, const GroupConfig& b) {
  return same_structure(a, b) && a.fraction == b.fraction && a.orth.method == b.orth.method &&
         a.orth.coefficients == b.orth.coefficients && a.orth.restarts == b.orth.restarts &&
         a.orth.iteration_dtype == b.orth.iteration_dtype;
}

std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// dtype of the gathered update rows U handed to the orthogonalizer: Dion3 gathers momentum
// rows unchanged, so the momentum dtype holds them exactly (half the bytes of fp32 for bf16
// momentum); Muon/NorMuon may mix in the gradient (Nesterov), so fp32.
DType update_rows_dtype(const GroupConfig& g, DType momentum_dtype) {
  return g.algorithm == Algorithm::Dion3 ? momentum_dtype : DType::F32;
}

std::string group_error(int g, const std::string& what) { return "group " + std::to_string(g) + ": " + what; }

}  // namespace

const TensorView* Param::find_state(const std::string& key) const {
  for (const auto& [name, view] : state)
    if (name == key) return &view;
  return nullptr;
}

std::string Optimizer::Impl::describe(int param) const {
  return "parameter " + std::to_string(param) + " '" + params[param].name + "'";
}

std::vector<Optimizer::Impl::StateSpec> Optimizer::Impl::state_specs(const Param& p) const {
  const GroupConfig& g = groups[p.group];
  switch (g.algorithm) {
    case Algorithm::Dion3:
    case Algorithm::NorMuon:
      return {{"momentum", g.momentum_dtype.value_or(p.weight.dtype), p.weight.shape},
              {"variance", DType::F32, {p.count * p.rows}}};
    case Algorithm::Muon: return {{"momentum", g.momentum_dtype.value_or(p.weight.dtype), p.weight.shape}};
    case Algorithm::AdamW:
      return {{"exp_avg", p.weight.dtype, p.weight.shape}, {"exp_avg_sq", p.weight.dtype, p.weight.shape}};
    case Algorithm::Lion: return {{"exp_avg", p.weight.dtype, p.weight.shape}};
  }
  return {};
}

Optimizer::Optimizer(std::unique_ptr<Backend> backend, OptimizerOptions options) : impl_(new Impl) {
  if (!backend) fail("Optimizer needs a backend, got null");
  impl_->backend = std::move(backend);
  impl_->options = options;
  impl_->flag = DeviceBuffer(impl_->backend->allocator(), sizeof(int));
  impl_->counters = DeviceBuffer(impl_->backend->allocator(), 2 * sizeof(int64_t));
  impl_->backend->fill_zero(impl_->counters.get(), 2 * sizeof(int64_t));
}

Optimizer::~Optimizer() = default;

int Optimizer::add_group(const GroupConfig& config) {
  const int g = static_cast<int>(impl_->groups.size());
  try {
    config.validate();
  } catch (const Error& e) {
    fail(group_error(g, std::string(e.what()).substr(7)));  // strip the "dion3: " prefix
  }
  impl_->groups.push_back(config);
  impl_->plan_valid = false;
  return g;
}

namespace {

void check_tensor(const std::string& who, const char* role, const TensorView& t, Device device) {
  if (!is_float_param_dtype(t.dtype))
    fail(who + " " + role + " has dtype " + dtype_name(t.dtype) +
         " but dion3 supports float32, float16 and bfloat16");
  if (t.device != device)
    fail(who + " " + role + " is on " + device_name(t.device) + " but this optimizer runs on " +
         device_name(device));
  for (int64_t s : t.shape)
    if (s < 0) fail(who + " " + role + " has a negative dimension in shape " + t.shape_str());
  if (!t.data && t.numel() > 0) fail(who + " " + role + " has a null data pointer");
}

void check_grad(const std::string& who, const TensorView& weight, const TensorView& grad, Device device) {
  check_tensor(who, "gradient", grad, device);
  if (grad.shape != weight.shape)
    fail(who + " has weight shape " + weight.shape_str() + " but its gradient has shape " + grad.shape_str());
}

}  // namespace

int Optimizer::add_param(int group, const ParamSpec& spec) {
  Impl& s = *impl_;
  const int index = static_cast<int>(s.params.size());
  const std::string who = "parameter " + std::to_string(index) + " '" + spec.name + "'";
  if (group < 0 || group >= static_cast<int>(s.groups.size()))
    fail(who + " names group " + std::to_string(group) + " but the optimizer has " +
         std::to_string(s.groups.size()) + " groups");
  const GroupConfig& g = s.groups[group];
  const Device device = s.backend->device();
  check_tensor(who, "weight", spec.weight, device);
  if (spec.grad.data || !spec.grad.shape.empty()) check_grad(who, spec.weight, spec.grad, device);

  Param p;
  p.name = spec.name;
  p.group = group;
  p.weight = spec.weight;
  p.grad = spec.grad;
  p.step_offset = s.read_counters()[0];  // AdamW's t starts at 1 for a parameter added late
  const auto& shape = spec.weight.shape;
  if (is_matrix_algorithm(g.algorithm)) {
    if (shape.size() < 2)
      fail(who + " has shape " + spec.weight.shape_str() + " but " +
           (g.algorithm == Algorithm::Dion3 ? "Dion3" : g.algorithm == Algorithm::Muon ? "Muon" : "NorMuon") +
           " needs a matrix; put 1-D tensors in an 'adamw' or 'lion' group");
    if (g.flatten || shape.size() == 2) {
      p.count = 1;
      p.rows = shape[0];
      p.cols = spec.weight.numel() / std::max<int64_t>(shape[0], 1);
    } else {
      p.rows = shape[shape.size() - 2];
      p.cols = shape.back();
      p.count = spec.weight.numel() / std::max<int64_t>(p.rows * p.cols, 1);
    }
    if (p.rows < 1 || p.cols < 1 || p.count < 1)
      fail(who + " has shape " + spec.weight.shape_str() + " with an empty dimension; a matrix needs rows and columns");
  }

  // State: validate the caller's tensors first, then allocate the missing ones.
  s.params.push_back(std::move(p));
  Param& added = s.params.back();
  try {
    const auto specs = s.state_specs(added);
    for (const auto& [name, view] : spec.state) {
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
  s.plan_valid = false;
  return index;
}

void Optimizer::set_grad(int param, const TensorView& grad) {
  Impl& s = *impl_;
  if (param < 0 || param >= static_cast<int>(s.params.size()))
    fail("set_grad: no parameter " + std::to_string(param) + " (the optimizer has " +
         std::to_string(s.params.size()) + ")");
  check_grad(s.describe(param), s.params[param].weight, grad, s.backend->device());
  s.params[param].grad = grad;
}

GroupConfig& Optimizer::group(int index) {
  if (index < 0 || index >= num_groups()) fail("no group " + std::to_string(index));
  return impl_->groups[index];
}
const GroupConfig& Optimizer::group(int index) const { return const_cast<Optimizer*>(this)->group(index); }
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

std::vector<std::pair<std::string, TensorView>> Optimizer::state_views(int param) const {
  if (param < 0 || param >= num_params()) fail("no parameter " + std::to_string(param));
  return impl_->params[param].state;
}

void Optimizer::Impl::build_plan() {
  megabatches.clear();
  using Key = std::tuple<int, int64_t, int64_t, int, int, int>;
  std::map<Key, std::size_t> index;
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    const Param& p = params[i];
    const GroupConfig& g = groups[p.group];
    if (!is_matrix_algorithm(g.algorithm)) continue;
    const DType mom = state_specs(p)[0].dtype;
    const Key key{p.group, p.rows, p.cols, static_cast<int>(p.weight.dtype), static_cast<int>(p.grad.dtype),
                  static_cast<int>(mom)};
    auto [it, fresh] = index.try_emplace(key, megabatches.size());
    if (fresh) {
      Megabatch mb;
      mb.group = p.group;
      mb.rows = p.rows;
      mb.cols = p.cols;
      mb.weight_dtype = p.weight.dtype;
      mb.grad_dtype = p.grad.dtype;
      mb.momentum_dtype = mom;
      mb.k = g.algorithm == Algorithm::Dion3
                 ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(g.fraction * static_cast<double>(p.rows))))
                 : p.rows;
      megabatches.push_back(std::move(mb));
    }
    for (int64_t j = 0; j < p.count; ++j) megabatches[it->second].members.emplace_back(i, j);
  }
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
    mb.gathers_normalized = g.algorithm == Algorithm::Dion3 && mb.k <= mb.cols;
    auto layout = [&](int64_t count, Chunk* c) {
      const std::size_t u = mb.gathers_normalized
                                ? 0
                                : align_up(static_cast<std::size_t>(count * mb.k * mb.cols) *
                                           dtype_size(update_rows_dtype(g, mb.momentum_dtype)));
      const std::size_t ws = Orthogonalizer::required_workspace(*backend, g.orth, count, mb.k, mb.cols);
      const std::size_t in_ws = Orthogonalizer::input_offset(*backend, g.orth, count, mb.k, mb.cols, u);
      const bool inside = in_ws != Orthogonalizer::kNoInputRoom;
      if (c) {
        c->update_offset = inside ? in_ws : 0;
        c->orth_offset = inside ? 0 : u;
      }
      return inside ? align_up(ws) : u + align_up(ws);
    };
    auto need = [&](int64_t count) { return layout(count, nullptr); };
    int64_t chunk = n;
    while (chunk > 1 && need(chunk) > limit) chunk = (chunk + 1) / 2;
    mb.chunk_bytes = need(chunk);
    arena_bytes = std::max(arena_bytes, mb.chunk_bytes);
    mb.set = backend->new_matrix_set();
    if (g.algorithm == Algorithm::Dion3) {
      mb.scores = DeviceBuffer(alloc, static_cast<std::size_t>(n * mb.rows) * sizeof(float));
      mb.indices = DeviceBuffer(alloc, static_cast<std::size_t>(n * mb.k) * sizeof(int32_t));
    }
    mb.row_sumsq = DeviceBuffer(alloc, static_cast<std::size_t>(n * (mb.gathers_normalized ? mb.rows : mb.k)) *
                                           sizeof(float));
    for (int64_t first = 0; first < n; first += chunk) {
      Chunk c;
      c.first = first;
      c.count = std::min(chunk, n - first);
      layout(c.count, &c);
      c.set = backend->new_matrix_set();
      mb.chunks.push_back(std::move(c));
    }
  }
  arena = DeviceBuffer(alloc, arena_bytes);
  // Orthogonalizers are planned on the arena (Chunk::orth_offset).
  for (Megabatch& mb : megabatches) {
    const GroupConfig& g = groups[mb.group];
    for (Chunk& c : mb.chunks) {
      for (auto& o : mb.orths)
        if (o->batch() == c.count) c.orth = o.get();
      if (c.orth) continue;
      char* ws = arena.as<char>() + c.orth_offset;
      mb.orths.push_back(std::make_unique<Orthogonalizer>(*backend, g.orth, c.count, mb.k, mb.cols, ws));
      c.orth = mb.orths.back().get();
    }
  }
  planned = groups;
  plan_valid = true;
}

std::vector<MegabatchInfo> Optimizer::plan() {
  Impl& s = *impl_;
  if (!s.plan_valid) s.build_plan();
  std::vector<MegabatchInfo> out;
  for (const Megabatch& mb : s.megabatches) {
    MegabatchInfo info;
    info.group = mb.group;
    info.algorithm = s.groups[mb.group].algorithm;
    info.rows = mb.rows;
    info.cols = mb.cols;
    info.dtype = mb.weight_dtype;
    info.count = static_cast<int64_t>(mb.members.size());
    info.selected_rows = mb.k;
    info.method = mb.chunks.front().orth->method();
    info.iteration_dtype = mb.chunks.front().orth->iteration_dtype();
    info.workspace_bytes = mb.chunk_bytes + mb.scores.bytes() + mb.indices.bytes() + mb.row_sumsq.bytes();
    info.chunk = mb.chunks.front().count;
    out.push_back(info);
  }
  return out;
}

void Optimizer::Impl::validate_for_step() {
  Impl& s = *this;
  // 1. Validate everything before touching memory.
  if (s.groups.empty()) fail("step: the optimizer has no parameter groups");
  std::vector<int> group_size(s.groups.size(), 0);
  for (const Param& p : s.params) ++group_size[p.group];
  const int num_groups = static_cast<int>(s.groups.size());
  for (int g = 0; g < num_groups; ++g) {
    if (group_size[g] == 0) fail(group_error(g, "the group is empty; every group needs at least one parameter"));
    try {
      s.groups[g].validate();
    } catch (const Error& e) {
      fail(group_error(g, std::string(e.what()).substr(7)));
    }
    if (s.plan_valid && !same_structure(s.groups[g], s.planned[g]) && s.state_created)
      fail(group_error(g, "'algorithm', 'flatten' and 'momentum_dtype' cannot change once state exists"));
  }
  for (int i = 0; i < static_cast<int>(s.params.size()); ++i) {
    const Param& p = s.params[i];
    if (!p.grad.data && p.weight.numel() > 0) fail(s.describe(i) + " has no gradient; call set_grad before step");
  }
  for (int g = 0; s.plan_valid && g < num_groups; ++g)
    if (!same_plan(s.groups[g], s.planned[g])) s.plan_valid = false;
  if (!s.plan_valid) s.build_plan();
  // Gradient dtypes are part of the megabatch key: re-plan if set_grad changed one.
  for (const Megabatch& mb : s.megabatches)
    for (const auto& [pi, j] : mb.members)
      if (s.params[pi].grad.dtype != mb.grad_dtype) s.plan_valid = false;
  if (!s.plan_valid) s.build_plan();
  s.state_created = true;
}

void Optimizer::Impl::enqueue_step() {
  Impl& s = *this;
  Backend& be = *s.backend;
  // 2. Non-finite gradients raise a device flag that every mutating op below obeys.
  int* flag = s.flag.as<int>();
  be.fill_zero(flag, sizeof(int));
  std::vector<MatrixView> grads;
  for (const Param& p : s.params) grads.push_back(flat_of(p.grad));
  be.check_finite(grads, flag);

  // 3. Matrix megabatches.
  for (Megabatch& mb : s.megabatches) {
    const GroupConfig& g = s.groups[mb.group];
    mb.set->mats.clear();
    for (const auto& [pi, j] : mb.members) {
      Param& p = s.params[pi];
      ParamMatrix pm;
      pm.weight = matrix_of(p.weight, p.weight.dtype, j, p.rows, p.cols);
      pm.grad = matrix_of(p.grad, p.grad.dtype, j, p.rows, p.cols);
      pm.momentum = matrix_of(p.state[0].second, mb.momentum_dtype, j, p.rows, p.cols);
      if (p.state.size() > 1) pm.variance = static_cast<float*>(p.state[1].second.data) + j * p.rows;
      mb.set->mats.push_back(pm);
    }
    be.refresh(*mb.set);
    const auto n = static_cast<int64_t>(mb.members.size());
    UpdateParams up;
    up.lr = static_cast<float>(g.base_lr());
    up.weight_decay = static_cast<float>(g.weight_decay);
    up.adjusted_lr = static_cast<float>(g.adjusted_lr(mb.rows, mb.cols));
    up.beta2 = static_cast<float>(g.muon_beta2);
    up.cautious_wd = g.cautious_wd;
    const float mu = static_cast<float>(g.mu);
    const bool dion3 = g.algorithm == Algorithm::Dion3;
    float* scores = mb.scores.as<float>();
    int32_t* idx = mb.indices.as<int32_t>();
    float* row_sumsq = mb.row_sumsq.as<float>();
    if (dion3) {
      // M += G, row l1 scores (and sums of squares, for the normalisation in the gather)
      be.accumulate(*mb.set, 1.0f, scores, mb.gathers_normalized ? row_sumsq : nullptr, flag);
      be.select_rows(scores, n, mb.rows, mb.k, idx, flag);  // S = top-k rows
    } else {
      be.accumulate(*mb.set, mu, nullptr, nullptr, flag);  // M = mu M + G
    }
    up.normuon = g.algorithm != Algorithm::Muon;
    for (Chunk& c : mb.chunks) {
      c.set->mats.assign(mb.set->mats.begin() + c.first, mb.set->mats.begin() + c.first + c.count);
      be.refresh(*c.set);
      const int32_t* rows = dion3 ? idx + c.first * mb.k : nullptr;
      MatrixView O;
      if (mb.gathers_normalized) {
        // X = M[S] / ||M[S]||, straight into the orthogonalizer's buffer; M[S] *= mu.
        be.gather_normalized(*c.set, rows, mb.k, mu, row_sumsq + c.first * mb.rows, Orthogonalizer::kNormEps,
                             c.orth->normalized_input(), flag);
        O = c.orth->run_normalized();
      } else {
        MatrixView U = MatrixView::contiguous(s.arena.as<char>() + c.update_offset,
                                              update_rows_dtype(g, mb.momentum_dtype), c.count, mb.k, mb.cols);
        float* ss = row_sumsq + c.first * mb.k;  // U's row sums of squares
        if (dion3) be.gather_rows(*c.set, rows, mb.k, 1.0f, 0.0f, mu, U, ss, flag);  // U = M[S]; M[S] *= mu
        else if (g.nesterov) be.gather_rows(*c.set, nullptr, mb.k, mu, 1.0f, 1.0f, U, ss, flag);  // U = mu M + G
        else be.gather_rows(*c.set, nullptr, mb.k, 1.0f, 0.0f, 1.0f, U, ss, flag);                 // U = M
        // U's norm comes from the row sums (no pass over U before the normalising one).
        O = c.orth->run(U, ss);
      }
      // The update reads the orthogonalizer's result in its iteration dtype (no conversion pass).
      be.apply_update(*c.set, rows, mb.k, O, up, flag);
    }
  }

  // 4. Element-wise parameters: all AdamW ones in one call, all Lion ones in another (the backend
  //    batches them into as few launches as their dtypes allow).
  std::vector<ElementwiseParam> adamw_ps, lion_ps;
  std::vector<AdamWParams> adamw_hs;
  std::vector<LionParams> lion_hs;
  for (Param& p : s.params) {
    const GroupConfig& g = s.groups[p.group];
    if (is_matrix_algorithm(g.algorithm) || p.weight.numel() == 0) continue;
    ElementwiseParam e;
    e.weight = flat_of(p.weight);
    e.grad = flat_of(p.grad);
    e.exp_avg = flat_of(p.state[0].second);
    const float lr = static_cast<float>(g.lr), wd = static_cast<float>(g.weight_decay);
    const float b1 = static_cast<float>(g.betas[0]), b2 = static_cast<float>(g.betas[1]);
    if (g.algorithm == Algorithm::AdamW) {
      e.exp_avg_sq = flat_of(p.state[1].second);
      adamw_ps.push_back(e);
      adamw_hs.push_back({lr, b1, b2, wd, static_cast<float>(g.epsilon), s.counters.as<int64_t>(), p.step_offset});
    } else {
      lion_ps.push_back(e);
      lion_hs.push_back({lr, b1, b2, wd});
    }
  }
  if (!adamw_ps.empty()) be.adamw(adamw_ps, adamw_hs, flag);
  if (!lion_ps.empty()) be.lion(lion_ps, lion_hs, flag);
  be.finish_step(flag, s.counters.as<int64_t>());
}

void Optimizer::step_async() {
  impl_->validate_for_step();
  impl_->enqueue_step();
}

bool Optimizer::step() {
  Impl& s = *impl_;
  Backend& be = *s.backend;
  s.validate_for_step();
  s.enqueue_step();
  int* flag = s.flag.as<int>();
  // The verdict: one host synchronisation.
  if (be.read_flag(flag) == 0) return true;
  if (s.options.on_nonfinite == NonFinitePolicy::Raise) {
    for (int i = 0; i < num_params(); ++i) {
      const MatrixView grad = flat_of(s.params[i].grad);
      be.fill_zero(flag, sizeof(int));
      be.check_finite(std::span<const MatrixView>(&grad, 1), flag);
      if (be.read_flag(flag))
        fail(s.describe(i) + " has a non-finite gradient (NaN or Inf); the step was not applied "
             "(on_nonfinite='raise'; use 'skip' to drop such steps)", Status::NonFinite);
    }
    fail("a gradient is non-finite; the step was not applied", Status::NonFinite);
  }
  return false;
}

}  // namespace dion3
