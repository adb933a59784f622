// bindings.cpp — dion3._C: the PyTorch extension. Wraps torch tensors into the engine's
// TensorViews (pointer, dtype, device, shape), binds gradients before each step, runs the step on
// the current CUDA stream with workspace from PyTorch's caching allocator, and turns dion3::Error
// into Python exceptions. It holds no optimizer math: that is all in dion3::Optimizer.
// ATen plus torch's pybind11 casters only: torch/extension.h (the whole C++ frontend) doubles
// the compile time of this file.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <map>
#include <memory>
#include <optional>
#include <unordered_set>
#include <string>
#include <vector>

#include "core/c_config.hpp"
#include "core/one_thread.hpp"
#include "dion3/backend.hpp"
#include "dion3/config.hpp"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "dion3/orthogonalize.hpp"

#ifdef DION3_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace py = pybind11;

namespace {

PyObject* g_nonfinite_error = nullptr;  // dion3._C.NonFiniteError (a FloatingPointError)

dion3::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return dion3::DType::F32;
    case at::kHalf: return dion3::DType::F16;
    case at::kBFloat16: return dion3::DType::BF16;
    case at::kDouble: return dion3::DType::F64;
    case at::kInt: return dion3::DType::I32;
    case at::kLong: return dion3::DType::I64;
    default:
      throw dion3::Error(dion3::Status::InvalidArgument,
                         std::string("tensors of dtype ") + c10::toString(t) +
                             " are not supported; use float32, float16 or bfloat16");
  }
}

at::ScalarType to_scalar_type(const std::string& name) {
  if (name == "float32" || name == "float") return at::kFloat;
  if (name == "float16" || name == "half") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float64" || name == "double") return at::kDouble;
  throw dion3::Error(dion3::Status::InvalidArgument, "unknown dtype '" + name + "'");
}

dion3::TensorView view_of(const at::Tensor& t, const std::string& who) {
  if (!t.is_contiguous())
    throw dion3::Error(dion3::Status::InvalidArgument,
                       who + " is not contiguous (strides " +
                           dion3::shape_string(std::vector<int64_t>(t.strides().begin(), t.strides().end())) +
                           "); dion3 needs contiguous tensors");
  // A storage shrunk in place (untyped_storage().resize_) would have the engine write past its end.
  if (t.numel() > 0 &&
      static_cast<std::size_t>(t.storage_offset() + t.numel()) * t.itemsize() > t.storage().nbytes())
    throw dion3::Error(dion3::Status::InvalidArgument,
                       who + " reaches past the end of its storage (was the storage resized in place?)");
  // The engine reads memory as it lies: a lazy negation (the neg bit) would be read unnegated.
  if (t.is_neg())
    throw dion3::Error(dion3::Status::InvalidArgument,
                       who + " is a lazily negated view (is_neg()); pass t.resolve_neg()");
  dion3::TensorView v;
  v.data = t.data_ptr();
  // A tensor without memory (torch's FakeTensor reports the CPU): nothing the engine may read.
  if (t.numel() > 0 && v.data == nullptr)
    throw dion3::Error(dion3::Status::InvalidArgument,
                       who + " has no data (a fake tensor?); dion3 runs on real cpu and cuda tensors");
  v.dtype = to_dtype(t.scalar_type());
  if (t.is_cuda()) {
    v.device = dion3::Device::CUDA;
    v.device_index = t.get_device();
  } else if (t.is_cpu()) {
    v.device = dion3::Device::CPU;
  } else {
    throw dion3::Error(dion3::Status::InvalidArgument,
                       who + " is on device '" + t.device().str() + "'; dion3 runs on cpu and cuda");
  }
  v.shape.assign(t.sizes().begin(), t.sizes().end());
  return v;
}

// A dtype key of the group dict as a dion3_dtype value, -1 when None (the engine's choice).
int32_t c_dtype(const py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return -1;
  return static_cast<int32_t>(to_dtype(to_scalar_type(py::cast<std::string>(d[key]))));
}

// Copies a list into a fixed array of the C struct, refusing more than it holds.
template <class T, std::size_t N>
int32_t c_list(const std::vector<T>& v, T (&out)[N], const char* key) {
  if (v.size() > N)
    throw dion3::Error(dion3::Status::InvalidArgument, std::string("'") + key + "' has " + std::to_string(v.size()) +
                                                           " entries; at most " + std::to_string(N));
  std::copy(v.begin(), v.end(), out);
  return static_cast<int32_t>(v.size());
}

// The group dict the Python layer normalises (see dion3/optimizer.py: _engine_config), as the C
// API's struct: GroupConfig is then made by the converter the C API uses (core/c_config.hpp).
dion3::GroupConfig group_config(const py::dict& d) {
  dion3_group_config c;
  dion3_group_config_default(&c);
  c.algorithm = static_cast<int32_t>(dion3::parse_algorithm(py::cast<std::string>(d["algorithm"])));
  c.lr = py::cast<double>(d["lr"]);
  c.fraction = py::cast<double>(d["fraction"]);
  c.mu = py::cast<double>(d["mu"]);
  c.muon_beta2 = py::cast<double>(d["muon_beta2"]);
  c.betas[0] = py::cast<double>(d["beta1"]);
  c.betas[1] = py::cast<double>(d["beta2"]);
  c.weight_decay = py::cast<double>(d["weight_decay"]);
  c.epsilon = py::cast<double>(d["epsilon"]);
  c.adjust_lr = static_cast<int32_t>(dion3::parse_adjust_lr(py::cast<std::string>(d["adjust_lr"])));
  c.flatten = py::cast<bool>(d["flatten"]);
  c.nesterov = py::cast<bool>(d["nesterov"]);
  c.ema_momentum = py::cast<bool>(d["ema_momentum"]);
  c.cautious_wd = py::cast<bool>(d["cautious_wd"]);
  c.scale_lr_by_fraction = py::cast<bool>(d["scale_lr_by_fraction"]);
  c.momentum_dtype = c_dtype(d, "momentum_dtype");
  c.orth_method = static_cast<int32_t>(dion3::parse_orth_method(py::cast<std::string>(d["orthogonalizer"])));
  const auto steps = py::cast<py::list>(d["coefficients"]);
  if (steps.empty())
    throw dion3::Error(dion3::Status::InvalidArgument, "'coefficients' must hold at least one (a, b, c) step");
  if (steps.size() > DION3_MAX_ORTH_STEPS)
    throw dion3::Error(dion3::Status::InvalidArgument, "'coefficients' has " + std::to_string(steps.size()) +
                                                           " steps; at most " + std::to_string(DION3_MAX_ORTH_STEPS));
  c.orth_coefficients = DION3_COEFF_CUSTOM;  // the Python layer resolves named sets to their steps
  c.orth_num_custom = static_cast<int32_t>(steps.size());
  for (std::size_t i = 0; i < steps.size(); ++i) {
    auto abc = py::cast<std::vector<double>>(steps[i]);
    if (abc.size() != 3)
      throw dion3::Error(dion3::Status::InvalidArgument,
                         "'coefficients' must be a list of (a, b, c) triples, got a step of " +
                             std::to_string(abc.size()) + " numbers");
    std::copy(abc.begin(), abc.end(), c.orth_custom[i]);
  }
  c.orth_num_restarts = c_list(py::cast<std::vector<int32_t>>(d["restarts"]), c.orth_restarts, "restarts");
  c.orth_iteration_dtype = c_dtype(d, "iteration_dtype");
  c.orth_norm_eps = py::cast<double>(d["norm_eps"]);
  c.orth_norm_floor = py::cast<bool>(d["norm_floor"]);
  c.transposed = py::cast<bool>(d["transposed"]);
  c.selection_scope = static_cast<int32_t>(dion3::parse_selection_scope(py::cast<std::string>(d["selection_scope"])));
  c.num_split_sizes = c_list(py::cast<std::vector<int64_t>>(d["split_sizes"]), c.split_sizes, "split_sizes");
  const auto heads = py::cast<int64_t>(d["num_heads"]);
  if (heads > INT32_MAX || heads < INT32_MIN)
    throw dion3::Error(dion3::Status::InvalidArgument, "'num_heads' is " + std::to_string(heads) + ", out of range");
  c.num_heads = static_cast<int32_t>(heads);
  return dion3::capi::config_from_c(c);
}

// The engine's step ranges as torch.profiler ranges (record_function): free when no profiler is
// active, since RecordFunction checks for callbacks when it is made.
class TorchTracer final : public dion3::StepTracer {
 public:
  void begin(const char* name) override {
    std::unique_ptr<at::RecordFunction> rf;
    if (at::hasCallbacks()) {  // no allocation per range when nothing observes them
      rf = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
      if (rf->isActive()) rf->before(std::string_view(name), c10::ArrayRef<const c10::IValue>{});
    }
    open_.push_back(std::move(rf));
  }
  void end() override {
    if (!open_.empty()) open_.pop_back();  // ~RecordFunction ends the range
  }

 private:
  std::vector<std::unique_ptr<at::RecordFunction>> open_;
};

#ifdef DION3_HAVE_CUDA
// Workspace and engine-owned state from PyTorch's caching allocator (CUDA-graph capture needs it).
class TorchCudaAllocator final : public dion3::Allocator {
 public:
  void* allocate(std::size_t bytes) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
  }
  void deallocate(void* ptr, std::size_t) override { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }
};
#endif

// torch.distributed as a dion3::Communicator: the collectives run on the user's own process
// group (NCCL on GPUs, gloo on CPUs) through the public torch.distributed functions, with
// async_op=True; the engine's buffers are wrapped as byte tensors without copies. The engine
// steps with the GIL released, so each call takes it back for the Python call only. On CUDA,
// torch orders the collective after the current stream (the engine's) and Work.wait() makes
// that stream wait for it: no host synchronisation. The group is held weakly: one the user
// destroys (destroy_process_group) is freed then, not at the interpreter's teardown (where a
// gloo group can abort the process), and a step on it says so.
// Whether Python objects may still be released: an engine collected while the interpreter
// shuts down (a reference cycle) must not take the GIL then (that aborts the process).
bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// Drops a Python reference from code that may run without the GIL.
void release_object(py::object& o) {
  if (!o) return;
  if (!python_alive()) {
    o.release();  // the interpreter is going away: leave it to it
    return;
  }
  py::gil_scoped_acquire gil;
  o = py::object();
}

class TorchRequest final : public dion3::CommRequest {
 public:
  TorchRequest(py::object work, std::string label) : work_(std::move(work)), label_(std::move(label)) {}
  ~TorchRequest() override { release_object(work_); }
  void wait() override {
    py::gil_scoped_acquire gil;
    try {
      work_.attr("wait")();
    } catch (py::error_already_set& e) {
      throw dion3::Error(dion3::Status::Internal, label_ + " failed: " + e.what());
    }
  }

 private:
  py::object work_;
  std::string label_;
};

class TorchCommunicator final : public dion3::Communicator {
 public:
  TorchCommunicator(const py::object& group, dion3::Device device, int device_index)
      : group_(py::handle(group), py::handle()), device_(device), device_index_(device_index) {
    dist_ = py::module_::import("torch.distributed");
    rank_ = py::cast<int>(dist_.attr("get_rank")(group));
    size_ = py::cast<int>(dist_.attr("get_world_size")(group));
    backend_ = py::str(dist_.attr("get_backend")(group));
  }
  // The group, or None once it was destroyed. With the GIL held.
  py::object group() const { return group_(); }
  ~TorchCommunicator() override {
    release_object(group_);
    release_object(dist_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  dion3::Device device() const override { return device_; }
  std::string describe() const override {
    return "torch.distributed " + backend_ + " group, " + std::to_string(size_) + " ranks";
  }

  std::unique_ptr<dion3::CommRequest> all_gather(const void* send, void* recv, std::size_t bytes, void*,
                                                 const std::string& label) override {
    return call(label, [&] {
      return dist_.attr("all_gather_into_tensor")(bytes_of(recv, size_ * bytes), bytes_of(send, bytes),
                                                  py::arg("group") = live_group(label), py::arg("async_op") = true);
    });
  }
  std::unique_ptr<dion3::CommRequest> all_to_all(const void* send, void* recv, std::size_t bytes, void*,
                                                 const std::string& label) override {
    return call(label, [&] {
      return dist_.attr("all_to_all_single")(bytes_of(recv, size_ * bytes), bytes_of(send, size_ * bytes),
                                             py::arg("group") = live_group(label), py::arg("async_op") = true);
    });
  }
  std::unique_ptr<dion3::CommRequest> all_reduce_max(int32_t* data, std::size_t count, void*,
                                                     const std::string& label) override {
    return call(label, [&] {
      at::Tensor t = at::from_blob(data, {static_cast<int64_t>(count)}, options(at::kInt));
      return dist_.attr("all_reduce")(t, py::arg("op") = dist_.attr("ReduceOp").attr("MAX"),
                                      py::arg("group") = live_group(label), py::arg("async_op") = true);
    });
  }

 private:
  at::TensorOptions options(at::ScalarType t) const {
    auto o = at::TensorOptions().dtype(t);
    return device_ == dion3::Device::CUDA ? o.device(at::kCUDA, device_index_) : o.device(at::kCPU);
  }
  at::Tensor bytes_of(const void* p, std::size_t bytes) const {
    return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(bytes)}, options(at::kByte));
  }
  py::object live_group(const std::string& label) const {
    py::object g = group();
    if (g.is_none())
      throw dion3::Error(dion3::Status::InvalidArgument,
                         label + ": the process group this optimizer steps on was destroyed "
                                 "(torch.distributed.destroy_process_group); make the optimizer anew on a live group");
    return g;
  }
  template <class F>
  std::unique_ptr<dion3::CommRequest> call(const std::string& label, F&& start) {
    py::gil_scoped_acquire gil;
    try {
      return std::make_unique<TorchRequest>(start(), label);
    } catch (py::error_already_set& e) {
      throw dion3::Error(dion3::Status::Internal, label + " could not start: " + e.what());
    }
  }

  py::weakref group_;
  py::object dist_;
  dion3::Device device_;
  int device_index_ = 0;
  int rank_ = 0, size_ = 1;
  std::string backend_;
};

dion3::Layout parse_layout(const std::string& kind) {
  if (kind == "local") return dion3::Layout::Local;
  if (kind == "replicated") return dion3::Layout::Replicated;
  if (kind == "row_shard") return dion3::Layout::RowShard;
  if (kind == "col_shard") return dion3::Layout::ColShard;
  if (kind == "block") return dion3::Layout::Block;
  throw dion3::Error(dion3::Status::InvalidArgument, "unknown layout '" + kind + "'");
}

// One dion3::Optimizer on one device, with the tensors it points into kept alive.
// Engines alive in this process: the front end drops its own at interpreter exit, while torch
// is still whole (its test counts them).
std::atomic<int64_t> live_engines{0};

class Engine {
 public:
  Engine(const std::string& device_type, int device_index, const std::string& on_nonfinite,
         int64_t workspace_limit, bool megabatch, bool record_orthogonalizer, bool agree_on_names)
      : device_index_(device_index) {
    dion3::OptimizerOptions options;
    options.on_nonfinite = dion3::parse_nonfinite(on_nonfinite);
    options.megabatch = megabatch;
    options.record_orthogonalizer = record_orthogonalizer;
    options.agree_on_names = agree_on_names;
    if (workspace_limit >= 0) options.workspace_limit = static_cast<std::size_t>(workspace_limit);
    std::unique_ptr<dion3::Backend> backend;
    if (device_type == "cpu") {
      backend = dion3::make_cpu_backend();
    } else if (device_type == "cuda") {
#ifdef DION3_HAVE_CUDA
      cuda_ = true;
      c10::cuda::CUDAGuard guard(device_index);
      allocator_ = std::make_unique<TorchCudaAllocator>();
      backend = dion3::make_cuda_backend(device_index, at::cuda::getCurrentCUDAStream(device_index).stream(),
                                         allocator_.get());
#else
      backend = dion3::make_cuda_backend(device_index, nullptr, nullptr);  // throws Unsupported
#endif
    } else {
      throw dion3::Error(dion3::Status::InvalidArgument, "dion3 runs on cpu and cuda, not '" + device_type + "'");
    }
    opt_ = std::make_unique<dion3::Optimizer>(std::move(backend), options);
    opt_->set_tracer(std::make_shared<TorchTracer>());
    ++live_engines;
  }
  ~Engine() { --live_engines; }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Every call from Python holds one (see guarded): an engine serves one thread at a time. Its
  // steps run without the GIL, so a second thread could otherwise rebind the gradients, or step,
  // beneath a running step (freed memory, NaN weights); it is told so instead. A call from the
  // thread already inside passes.
  struct Entry : dion3::ThreadOwner::Use {
    explicit Entry(const Engine& e)
        : dion3::ThreadOwner::Use(live(e).user_, dion3::Status::Internal,
                                  "this optimizer is in use by another thread (a step runs there): an optimizer "
                                  "steps, saves and loads in one thread at a time") {}
    static const Engine& live(const Engine& e) {
      if (e.cleared_)
        throw dion3::Error(dion3::Status::Internal, "this optimizer's engine was cleared by the garbage collector");
      return e;
    }
  };

  // The cycle collector's view of the Python objects the engine holds (the parameters, their
  // state dicts, the groups): without it a cycle through the engine (a parameter's hook that
  // refers to the optimizer) is never collected. clear() drops them; the engine then refuses calls.
  int traverse(visitproc visit, void* arg) const {
    for (const auto* held : {&weights_, &wrappers_, &watched_})
      for (const Held& h : *held) Py_VISIT(h.object());
    for (const auto& [state, tensors] : state_watch_) {
      Py_VISIT(state.ptr());
      Py_VISIT(tensors.ptr());
    }
    for (const auto& [group, params] : groups_watch_) {
      Py_VISIT(group.ptr());
      for (const py::object& p : params) Py_VISIT(p.ptr());
    }
    return 0;
  }
  void clear() {
    cleared_ = true;
    for (auto* held : {&weights_, &wrappers_, &watched_}) held->clear();
    state_watch_.clear();
    groups_watch_.clear();
  }

  int add_group(const py::dict& cfg) { return opt_->add_group(group_config(cfg)); }

  // Hyper-parameters are re-read before every step, so schedules that edit the group dict work.
  // Validated as it is set: an invalid value never reaches a step.
  void update_group(int index, const py::dict& cfg) { opt_->set_group(index, group_config(cfg)); }

  // Registers a parameter; its gradient (weight.grad(), or the one given, for DTensor shards whose
  // gradient lives on the DTensor) is read again before every step. layout: "local",
  // "replicated", "row_shard" or "col_shard" over `process_group` (a torch.distributed group);
  // global_rows / global_cols: the whole matrix's rows (row_shard) / columns (col_shard).
  int add_param(int group, const std::string& name, const py::object& weight_object, const py::dict& state,
                const std::string& layout, const py::object& process_group, int64_t global_rows,
                int64_t global_cols, int64_t row_offset, int64_t row_chunk, const py::object& col_process_group,
                const std::optional<at::Tensor>& given_grad, const py::object& wrapper_object,
                const std::vector<int64_t>& order, bool absent) {
    const at::Tensor& weight = unpack(weight_object, "parameter '" + name + "'");
    const std::optional<at::Tensor> wrapper =
        wrapper_object.is_none() ? std::nullopt : std::optional<at::Tensor>(unpack(wrapper_object, name));
    // absent: a matrix without a gradient now, registered so that the plan holds it when it has one
    // (Optimizer::clear_grad until then).
    at::Tensor grad;
    try {
      if (!absent) grad = contiguous(given_grad ? *given_grad : weight.grad());
    } catch (const dion3::Error& e) {
      throw dion3::Error(e.status(), "parameter '" + name + "': " + std::string(e.what()).substr(7));
    }
    if (!grad.defined() && !absent)
      throw dion3::Error(dion3::Status::InvalidArgument, "parameter '" + name + "' has no gradient");
    dion3::ParamSpec spec;
    spec.layout.kind = parse_layout(layout);
    spec.layout.global_rows = global_rows;
    spec.layout.global_cols = global_cols;
    spec.layout.row_offset = row_offset;
    spec.layout.row_chunk = row_chunk;
    if (!process_group.is_none()) spec.layout.comm = communicator(process_group, weight);
    if (!col_process_group.is_none()) spec.layout.col_comm = communicator(col_process_group, weight);
    spec.name = name;
    spec.weight = view_of(weight, "parameter '" + name + "'");
    if (!absent) spec.grad = view_of(grad, "the gradient of parameter '" + name + "'");
    // The weight is held through its Python object (Held), a channels-last weight's view in memory
    // order (made detached, so that it references no parameter) here.
    std::vector<at::Tensor> held{order.empty() ? at::Tensor() : weight};
    for (auto item : state) {
      auto key = py::cast<std::string>(item.first);
      auto t = py::cast<at::Tensor>(item.second);
      spec.state.emplace_back(key, view_of(t, "state '" + key + "' of parameter '" + name + "'"));
      held.push_back(t);
    }
    const int index = opt_->add_param(group, spec);
    if (absent) {
      opt_->clear_grad(index);
      ++absent_count_;
    }
    skippable_.push_back(dion3::is_matrix_algorithm(opt_->group(group).algorithm));
    absent_.push_back(absent);
    weights_.push_back(order.empty() ? Held(weight_object) : Held(weight));
    wrappers_.push_back(wrapper ? Held(wrapper_object) : Held());
    wrapper_pins_.push_back(wrapper ? Pin(*wrapper) : Pin());
    weight_pins_.emplace_back(weight);
    held_.push_back(std::move(held));
    grads_.push_back(grad);
    grad_pins_.push_back(grad.defined() ? Pin(grad) : Pin());
    orders_.push_back(order);
    sources_.push_back(!order.empty() && wrapper && !absent ? wrapper->grad() : at::Tensor());
    source_pins_.push_back(sources_.back().defined() ? Pin(sources_.back()) : Pin());
    bound_memory_.push_back(0);
    return index;
  }

  // Parameters of the optimizer that had no gradient when the engine was built: if one gains a
  // gradient, step() asks for a rebuild.
  void watch(const py::list& params) {
    watched_.clear();
    for (py::handle p : params) {
      unpack(py::reinterpret_borrow<py::object>(p), "a watched parameter");
      watched_.emplace_back(py::reinterpret_borrow<py::object>(p));
    }
  }

  // Every param group and the parameters its "params" list held when the engine was built: if a
  // list stops holding exactly these (a parameter replaced in place, a new list of the same
  // length), step() asks for a rebuild instead of stepping the old parameters.
  void watch_groups(const std::vector<std::pair<py::dict, std::vector<py::object>>>& groups) { groups_watch_ = groups; }
  bool groups_changed() const {
    for (const auto& [group, params] : groups_watch_) {
      PyObject* now = PyDict_GetItemString(group.ptr(), "params");  // borrowed
      // A list, or a tuple set by hand (torch's optimizers take either).
      if (now == nullptr || !(PyList_Check(now) || PyTuple_Check(now)) ||
          PySequence_Fast_GET_SIZE(now) != static_cast<Py_ssize_t>(params.size()))
        return true;
      PyObject** items = PySequence_Fast_ITEMS(now);
      for (std::size_t j = 0; j < params.size(); ++j)
        if (items[j] != params[j].ptr()) return true;
    }
    return false;
  }

  // For each registered parameter, its state dict (optimizer.state[p]) and the state tensors the
  // engine was given: if the dict stops holding one of them (state[p][k] = other), step() asks for
  // a rebuild, which registers what the state holds then, instead of updating tensors nobody sees
  // any more. (The Python side notices state[p] = {} and state.clear() itself.)
  void watch_state(const std::vector<std::pair<py::dict, py::dict>>& entries) {
    state_watch_ = entries;
    // The tensors whose versions (note_state_written) and places (storage_moved) are
    // followed: what optimizer.state holds and what the engine was given (a DTensor counts writes
    // through it on itself, not on its local tensor, and a write to the local tensor on that alone).
    // Each tensor once: most state tensors are both.
    // Entry i is parameter i's (registration order).
    state_tensors_.clear();
    std::unordered_set<const c10::TensorImpl*> seen;
    auto add = [&](const at::Tensor& t, int param) {
      if (seen.insert(t.unsafeGetTensorImpl()).second) state_tensors_.push_back({t, t._version(), Pin(t), param});
    };
    for (std::size_t i = 0; i < state_watch_.size(); ++i)
      for (auto item : state_watch_[i].second) add(py::cast<at::Tensor>(item.second), static_cast<int>(i));
    for (std::size_t i = 0; i < held_.size(); ++i)
      for (std::size_t j = 1; j < held_[i].size(); ++j) add(held_[i][j], static_cast<int>(i));
  }
  // Whether a weight or a state tensor now has other storage (p.data = ..., state[p][k].data = ...,
  // resize_): the engine would go on updating the old one, which nobody reads; a rebuild registers
  // the new one.
  bool storage_moved() const {
    for (std::size_t i = 0; i < weights_.size(); ++i) {
      if (weight_pins_[i].moved(weights_[i].get())) return true;
      if (wrappers_[i].defined() && wrapper_pins_[i].moved(wrappers_[i].get())) return true;
    }
    for (const Watched& w : state_tensors_)
      if (w.pin.moved(w.tensor)) return true;
    return false;
  }
  // Whether a parameter's .grad is still the tensor bound last but now has other storage
  // (p.grad.data = ..., set_): step() rebinds it, a replay of a captured step would read the old.
  bool grads_moved() const {
    for (std::size_t i = 0; i < weights_.size(); ++i) {
      const at::Tensor g = source_grad(static_cast<int>(i));
      const bool permuted = !orders_[i].empty();
      const Pin& pin = permuted ? source_pins_[i] : grad_pins_[i];
      if (g.defined() && pin.holds(g) && pin.moved(g))
        return true;
    }
    return false;
  }
  // The gradient the caller holds for parameter i: its weight's, or for a weight the engine holds
  // as a view in memory order (channels-last), the parameter's.
  at::Tensor source_grad(int i) const {
    return orders_[i].empty() ? weights_[i].get().grad() : wrappers_[i].get().grad();
  }
  // The gradient as the engine takes it. A channels-last parameter's in memory order: a view while
  // it is laid out alike, kept from step to step while it is the same tensor in the same place.
  at::Tensor engine_grad(int i) {
    if (orders_[i].empty()) return contiguous(source_grad(i));
    const at::Tensor src = source_grad(i);
    if (src.defined() && source_pins_[i].same(src) && grads_[i].defined() && grads_[i].data_ptr() == src.data_ptr())
      return grads_[i];
    sources_[i] = src;
    source_pins_[i] = src.defined() ? Pin(src) : Pin();
    return src.defined() ? contiguous(src.permute(orders_[i])) : src;
  }
  // What step() rebuilds the engine for (its -1): a state tensor replaced in its dict, a weight or
  // state tensor moved, a group's params changed. A captured step cannot follow these either, nor
  // a gradient moved in place (which step() rebinds): stale_for_replay().
  bool needs_rebuild() const { return state_moved() || storage_moved() || groups_changed(); }
  // A parameter without a gradient at the build that has one now would never be stepped by a replay.
  bool stale_for_replay() const { return needs_rebuild() || grads_moved() || watched_gained_gradient(); }
  // A parameter's .grad now lies in other memory than the one the last step bound (model.zero_grad()
  // sets them to None and backward makes new ones): a replay reads by address, so it would read
  // the old memory. A new tensor over the same memory (a view of a flat buffer) is still read.
  // Given gradients (DTensor shards): the front end passes this step's, as to step_with.
  bool grads_replaced(const std::optional<std::vector<std::optional<at::Tensor>>>& given) const {
    if (given_ && (!given || given->size() != weights_.size())) return true;  // cannot tell: capture again
    for (std::size_t i = 0; i < weights_.size(); ++i) {
      if (absent_[i]) continue;
      const at::Tensor g = given_ ? ((*given)[i] ? *(*given)[i] : at::Tensor()) : source_grad(static_cast<int>(i));
      if (g.defined() && bound_memory_[i] != memory_key(g)) return true;
    }
    return false;
  }
  // Where a gradient's elements lie: its first element's address, shape, strides and dtype, as one
  // number (no allocation, per parameter and step).
  static std::size_t memory_key(const at::Tensor& g) {
    std::size_t h = std::hash<const void*>{}(g.data_ptr()) ^ static_cast<std::size_t>(g.scalar_type());
    auto mix = [&](int64_t v) { h ^= std::hash<int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    for (int64_t d : g.sizes()) mix(d);
    for (int64_t d : g.strides()) mix(d);
    return h;
  }
  // Nor would one without a gradient at the last step (a capture), and one that has none now would
  // be stepped. Given gradients (DTensor shards) are compared by the front end.
  bool absence_changed() const {
    if (given_) return false;
    for (std::size_t i = 0; i < absent_.size(); ++i)
      if (source_grad(static_cast<int>(i)).defined() == absent_[i]) return true;
    return false;
  }
  // The parameters the last step left alone for want of a gradient (Optimizer::clear_grad).
  std::vector<int> absent() const {
    std::vector<int> out;
    for (std::size_t i = 0; absent_count_ > 0 && i < absent_.size(); ++i)
      if (absent_[i]) out.push_back(static_cast<int>(i));
    return out;
  }
  bool watched_gained_gradient() const {
    for (const Held& w : watched_)
      if (w.get().grad().defined()) return true;
    return false;
  }
  bool state_moved() const {
    for (const auto& [st, held] : state_watch_)
      for (auto item : held) {  // string keys: their hashes are cached
        PyObject* now = PyDict_GetItemWithError(st.ptr(), item.first.ptr());
        if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
        if (now != item.second.ptr()) return true;
      }
    return false;
  }

  // Per-parameter step counters (AdamW bias correction) after a rebuild: the engine offers them
  // only through export/import, so this round-trips the state through host memory. Called only
  // when resuming (a counter > 0), never on the hot path.
  void set_param_steps(const std::vector<int64_t>& steps, int64_t steps_taken, int64_t steps_skipped) {
    if (static_cast<int>(steps.size()) != opt_->num_params())
      throw dion3::Error(dion3::Status::InvalidArgument, "set_param_steps: wrong number of counters");
    Guard g(*this);
    dion3::OptimizerState st = opt_->export_state();
    for (std::size_t i = 0; i < steps.size(); ++i) st.params[i].step = steps[i];
    st.steps = steps_taken;
    st.skipped = steps_skipped;
    opt_->import_state(st);
  }

  // Binds this step's gradients (each registered weight's .grad) and runs the step. Returns 1
  // (applied), 0 (skipped: a gradient was not finite under on_nonfinite="skip"), or -1 (the
  // caller must rebuild the engine: a weight's or a state tensor's storage moved, a group's params
  // changed, or the set of parameters with a gradient did; nothing was changed). Doing this here
  // keeps per-parameter work out of Python.
  int step() { return run(false, nullptr); }
  // This rank has no gradient this step while others may step (Optimizer::refuse_step): the step's
  // collectives with the gradients bound last. False when every rank refused.
  bool refuse_step() {
    if (!cuda_) at::get_num_threads();
    Guard guard(*this);
    py::gil_scoped_release release;
    return opt_->refuse_step();
  }
  // What the next step would raise first for the last enqueued one (Optimizer::check_last_agreement).
  void check_last_agreement() {
    Guard guard(*this);
    py::gil_scoped_release release;
    opt_->check_last_agreement();
  }
  // This rank cannot step: the front end found a setting invalid here (Optimizer::refuse_invalid).
  void refuse_invalid() {
    if (!cuda_) at::get_num_threads();
    Guard guard(*this);
    py::gil_scoped_release release;
    opt_->refuse_invalid();
  }
  // The same with this step's gradients given in registration order (DTensor parameters: the
  // local shards of their gradients; None where a parameter has none this step).
  int step_with(const std::vector<std::optional<at::Tensor>>& grads) { return run(false, &grads); }
  int step_async_with(const std::vector<std::optional<at::Tensor>>& grads) { return run(true, &grads); }

  // The capture-safe step (Optimizer::step_async): enqueued on the current stream with no host
  // synchronisation; a non-finite gradient drops the step on the device. Returns 2 (enqueued)
  // or -1 (rebuild needed, as for step()).
  int step_async() { return run(true, nullptr); }

 private:
  int run(bool async, const std::vector<std::optional<at::Tensor>>* given) {
    const int n = opt_->num_params();
    if (given && static_cast<int>(given->size()) != n)
      throw dion3::Error(dion3::Status::InvalidArgument, "step: " + std::to_string(given->size()) +
                                                              " gradients for " + std::to_string(n) + " parameters");
    given_ = given != nullptr;
    auto has_grad = [&](int i) {
      return given ? (*given)[i].has_value() && (*given)[i]->defined() : source_grad(i).defined();
    };
    {  // a profiler range around the binding alone
      RECORD_FUNCTION("dion3::bind_gradients", std::vector<c10::IValue>());
      if (watched_gained_gradient()) return -1;
      if (needs_rebuild()) return -1;
      // A matrix without a gradient is left alone in this plan; an element-wise parameter's step
      // counter is kept per parameter by the engine's plan, which is made anew without it.
      // None at all: no step (the front end refuses it with the other ranks where distributed).
      has_.resize(static_cast<std::size_t>(n));
      bool any = false;
      for (int i = 0; i < n; ++i) {
        has_[i] = has_grad(i);
        if (!skippable_[i] && !has_[i]) return -1;
        any |= has_[i] != 0;
      }
      if (!any) return -1;
      // A gradient refused here is refused on this rank alone: the others, distributed, learn it
      // from this rank's refusal of their step (Optimizer::refuse_invalid) instead of waiting.
      try {
        for (int i = 0; i < n; ++i) {
          if (!has_[i]) {
            if (!absent_[i]) {
              opt_->clear_grad(i);
              absent_[i] = true;
              ++absent_count_;
              grads_[i] = at::Tensor();
              grad_pins_[i] = Pin();
            }
            continue;
          }
          if (absent_[i]) {
            absent_[i] = false;
            --absent_count_;
          }
          at::Tensor g;
          try {
            g = given ? contiguous(*(*given)[i]) : engine_grad(i);
          } catch (const dion3::Error& e) {
            throw dion3::Error(e.status(), "parameter '" + opt_->param_name(i) + "': " + std::string(e.what()).substr(7));
          }
          // The caller's memory, which a captured step reads (through its copy, where one is made).
          bound_memory_[i] = memory_key(given ? *(*given)[i] : source_grad(i));
          // The same tensor may have been given other storage in place (p.grad.data = ..., set_).
          if (!grad_pins_[i].same(g)) {
            opt_->set_grad(i, view_of(g, "the gradient of " + opt_->param_name(i)));
            grad_pins_[i] = Pin(g);
            grads_[i] = std::move(g);
          } else if (!grads_[i].defined()) {
            grads_[i] = std::move(g);  // held again (released after the last blocking step)
          }
        }
      } catch (const dion3::Error&) {
        release_gradients();
        refuse_invalid();
        throw;
      }
    }
    // The CPU backend works on this thread's OpenMP threads, PyTorch's intra-op pool; PyTorch sets
    // their count in a thread when it first asks for it, which a thread new to PyTorch has not.
    if (!cuda_) at::get_num_threads();
    Guard guard(*this);
    // A step that must plan anew cannot be captured (planning allocates and uploads): -1, as for a
    // rebuild, with nothing enqueued, so that the front end raises CaptureNotReady.
    if (async && opt_->backend().capturing() && opt_->needs_new_plan()) return -1;
    const bool capturing = opt_->backend().capturing();
    if (!capturing && replayed_) forget_graph_writes();
    note_state_written();
    py::gil_scoped_release release;
    if (async) {
      opt_->step_async();
      // The engine checks written state now, or under a capture at its next eager step: until
      // then a rebuild must still hand it on (state_pending).
      if (!capturing) written_ = false;
      bump_versions();
      if (capturing) graph_unseen_ = true;
      return 2;
    }
    bool applied = false;
    try {
      applied = opt_->step();
    } catch (...) {
      release_gradients();  // a raised step reads them no more than an applied one
      throw;
    }
    written_ = false;
    release_gradients();
    if (!applied) return 0;
    bump_versions();
    return 1;
  }
  // After a blocking step nothing reads the gradients until the next step binds them again, so
  // the engine lets them go (their pins stay): zero_grad(set_to_none=True) then frees them, as
  // torch's optimizers do. An enqueued step keeps them (a captured step reads them at every replay).
  void release_gradients() {
    for (std::size_t i = 0; i < grads_.size(); ++i) {
      grads_[i] = at::Tensor();
      sources_[i] = at::Tensor();
    }
  }
  // As an in-place update by torch would: autograd then refuses a backward through a graph that
  // saved a weight before the step (a GAN's second loss) instead of using the stepped values.
  void bump_versions() {
    for (std::size_t i = 0; i < weights_.size(); ++i)
      for (const Held* h : {&weights_[i], &wrappers_[i]}) {
        const at::Tensor& t = h->get();
        if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
      }
  }

 public:

  py::list plan() {
    Guard g(*this);
    py::list out;
    for (const auto& mb : opt_->plan()) {
      py::dict d;
      d["group"] = mb.group;
      d["algorithm"] = dion3::algorithm_name(mb.algorithm);
      d["rows"] = mb.rows;
      d["cols"] = mb.cols;
      d["columns"] = mb.columns;
      d["dtype"] = dion3::dtype_name(mb.dtype);
      d["count"] = mb.count;
      d["selected_rows"] = mb.selected_rows;
      d["method"] = mb.method == dion3::OrthMethod::Gram ? "gram" : "standard";
      d["iteration_dtype"] = dion3::dtype_name(mb.iteration_dtype);
      d["workspace_bytes"] = mb.workspace_bytes;
      d["layout"] = dion3::layout_name(mb.layout);
      d["ranks"] = mb.ranks;
      d["owned"] = mb.owned;
      d["piece_rows"] = mb.piece_rows;
      d["orth_rows"] = mb.orth_rows;
      d["orth_cols"] = mb.orth_cols;
      d["rounds"] = mb.rounds;
      d["bytes_sent"] = mb.bytes_sent;
      out.append(d);
    }
    return out;
  }

  int num_params() const { return opt_->num_params(); }
  int num_groups() const { return opt_->num_groups(); }
  int64_t steps_taken() const { return opt_->steps_taken(); }
  int64_t steps_skipped() const { return opt_->steps_skipped(); }
  uint64_t plan_generation() const { return opt_->plan_generation(); }
  // The state was written in a way its tensors' versions do not show (through .data, or by code
  // outside PyTorch): the next step's non-finite check reads it whole (Optimizer::state_changed).
  void state_changed() {
    Guard guard(*this);
    opt_->state_changed();
    written_ = true;
  }
  // Whether state was written since this engine's last step checked it: a rebuild hands that on
  // to the new engine (state_changed), whose first step then checks it.
  bool state_pending() { return note_state_written() || written_; }
  void refresh_hyperparameters() {
    Guard guard(*this);
    // Before a replay of a captured step: state written in place since is noticed here, eagerly,
    // and what the graph itself writes after its step is forgotten (see written_by_graph_).
    note_state_written();
    forget_graph_writes();
    replayed_ = true;
    opt_->refresh_hyperparameters();
    bump_versions();  // the replay that follows updates the weights
  }
  // (steps applied, steps dropped) as of the last step_async(), once their copy to the host
  // has arrived; None before (never waits).
  py::object posted_counters() const {
    int64_t c[2];
    if (!opt_->posted_counters(c)) return py::none();
    return py::make_tuple(c[0], c[1]);
  }

 private:
  // Device and stream of the engine's calls: the current CUDA stream of the engine's device.
  struct Guard {
#ifdef DION3_HAVE_CUDA
    std::optional<c10::cuda::CUDAGuard> device;
    explicit Guard(Engine& e) {
      if (e.cuda_) {
        device.emplace(e.device_index_);
        e.opt_->backend().set_stream(at::cuda::getCurrentCUDAStream(e.device_index_).stream());
      }
    }
#else
    explicit Guard(Engine&) {}
#endif
  };

  // The parameters whose state a graph captured on this engine writes after its step
  // (written_by_graph_): the next check reads their state (Optimizer::state_changed).
  void forget_graph_writes() {
    if (!written_by_graph_.empty()) {
      opt_->state_changed(written_by_graph_);
      written_ = true;
    }
    replayed_ = false;
  }

  // Tells the engine of each parameter whose state tensor was written in place since the last
  // call (its version moved; the engine's own writes do not move it): its next step checks that
  // state again (Optimizer::state_changed). Whether there was any.
  // The first call outside a capture after one also takes such a parameter for one whose state
  // the graph writes after its step: a replay writes it again and moves no version, so from then
  // on each refresh before a replay, and the next eager step after one, forget its bounds (for
  // every graph of this engine, whichever replays; an eager write since the capture is taken for
  // such a write too).
  bool note_state_written() {
    const bool mark = graph_unseen_ && !opt_->backend().capturing();
    std::vector<int> moved;
    for (const Watched& w : state_tensors_)
      if (w.tensor._version() != w.version) moved.push_back(w.param);
    if (!moved.empty()) opt_->state_changed(moved);  // first: where it throws, they are noticed again
    if (mark) graph_unseen_ = false;
    if (moved.empty()) return false;
    for (Watched& w : state_tensors_)
      if (const int64_t now = w.tensor._version(); now != w.version) {
        w.version = now;
        if (mark) written_by_graph_.push_back(w.param);
      }
    if (mark) {  // each parameter once
      std::sort(written_by_graph_.begin(), written_by_graph_.end());
      written_by_graph_.erase(std::unique(written_by_graph_.begin(), written_by_graph_.end()), written_by_graph_.end());
    }
    written_ = true;
    return true;
  }

  static at::Tensor contiguous(at::Tensor g) {
    if (g.defined() && g.layout() != at::kStrided)  // is_contiguous() itself throws on sparse tensors
      throw dion3::Error(dion3::Status::InvalidArgument,
                         std::string("a gradient is ") + (g.is_sparse() ? "sparse" : "not a dense (strided) tensor") +
                             "; dion3 steps dense gradients only (for an embedding, nn.Embedding(sparse=False))");
    if (g.defined() && !g.is_contiguous()) g = g.contiguous();
    return g;
  }

  // One communicator per process group, shared by every parameter on it.
  std::shared_ptr<dion3::Communicator> communicator(const py::object& group, const at::Tensor& weight) {
    for (auto& c : comms_)
      if (c->group().is(group)) return c;
    const dion3::Device device = weight.is_cuda() ? dion3::Device::CUDA : dion3::Device::CPU;
    comms_.push_back(std::make_shared<TorchCommunicator>(group, device, device_index_));
    return comms_.back();
  }

  int device_index_ = 0;
  bool cuda_ = false;
#ifdef DION3_HAVE_CUDA
  std::unique_ptr<TorchCudaAllocator> allocator_;
#endif
  std::unique_ptr<dion3::Optimizer> opt_;  // after allocator_: destroyed first
  // A parameter as the engine holds it: by its Python object, which keeps no reference to the
  // tensor itself (torch.utils.swap_tensors, which model.to() uses in swap mode, refuses to swap
  // a tensor anything else references, weakly or not); get() gives the tensor the object holds
  // now, a new one after a swap (its pin then reports it moved). A view made for the engine (a
  // channels-last weight in memory order) is held as a tensor.
  class Held {
   public:
    Held() = default;
    explicit Held(py::object object) : object_(std::move(object)) {}
    explicit Held(at::Tensor tensor) : tensor_(std::move(tensor)) {}
    bool defined() const { return object_ ? true : tensor_.defined(); }
    const at::Tensor& get() const { return object_ ? THPVariable_Unpack(object_.ptr()) : tensor_; }
    PyObject* object() const { return object_.ptr(); }  // null where a tensor is held

   private:
    py::object object_;
    at::Tensor tensor_;
  };
  static const at::Tensor& unpack(const py::object& o, const std::string& what) {
    if (!THPVariable_Check(o.ptr()))
      throw dion3::Error(dion3::Status::InvalidArgument, what + " is not a torch.Tensor");
    return THPVariable_Unpack(o.ptr());
  }
  std::vector<Held> weights_;
  // Where the engine was given a tensor's elements: the tensor's storage (a weak reference: it
  // keeps the StorageImpl object, not its memory, so no later storage can share its identity),
  // its first element's address, sizes and strides. moved(): the tensor now lies elsewhere
  // (p.data = ..., a state tensor's .data = ..., resize_, set_), and the engine would update memory
  // nobody reads (or that was freed). A DTensor's storage holds no memory: its identity alone is
  // compared, and the local tensor the engine holds is pinned as well.
  struct Pin {
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
    const void* first = nullptr;
    std::vector<int64_t> sizes, strides;
    // The tensor itself, compared only (nothing holds it): with the storage's weak reference, a
    // later tensor at the same address is told apart by its storage.
    const c10::TensorImpl* impl = nullptr;
    Pin() = default;
    explicit Pin(const at::Tensor& t) {
      impl = t.unsafeGetTensorImpl();
      const c10::Storage& s = t.unsafeGetTensorImpl()->unsafe_storage();
      if (!s) return;
      storage = s.getWeakStorageImpl();
      if (s.data() == nullptr) return;
      first = t.data_ptr();
      sizes = t.sizes().vec();
      strides = t.strides().vec();
    }
    bool moved(const at::Tensor& t) const {
      if (!storage) return false;
      if (t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl() != storage->_unsafe_get_target())
        return true;
      return first != nullptr && (t.data_ptr() != first || !t.sizes().equals(sizes) || !t.strides().equals(strides));
    }
    bool holds(const at::Tensor& t) const { return impl != nullptr && t.unsafeGetTensorImpl() == impl; }
    // The tensor pinned, where it was.
    bool same(const at::Tensor& t) const { return holds(t) && !moved(t); }
  };
  std::vector<Pin> weight_pins_;
  // The parameter a weight was given for, where the engine holds another tensor: a DTensor's
  // local shard, or a channels-last weight's view in memory order. Its version is bumped with the
  // weight's; its storage is pinned as well (model.to(...) gives the parameter, not the view,
  // other storage).
  std::vector<Held> wrappers_;
  std::vector<Pin> wrapper_pins_;
  // A channels-last weight's permutation to memory order (the view the engine holds; empty for
  // others), and the parameter's gradient its bound one was made from.
  std::vector<std::vector<int64_t>> orders_;
  std::vector<at::Tensor> sources_;
  std::vector<Pin> source_pins_;
  std::vector<std::size_t> bound_memory_;  // each gradient's memory_key() as the last step bound it
  std::vector<std::vector<at::Tensor>> held_;  // weights and state tensors the engine points into
  struct Watched {
    at::Tensor tensor;
    int64_t version = 0;  // its last seen _version()
    Pin pin;
    int param = 0;  // whose state it is
  };
  bool written_ = false;  // state written since the last step that checked it
  std::vector<int> written_by_graph_;  // see note_state_written()
  bool graph_unseen_ = false;          // a step was captured; no look at the versions outside one since
  bool replayed_ = false;              // a refresh (so a replay) since the graph writes were last forgotten
  std::vector<Watched> state_tensors_;  // the state tensors
  std::vector<at::Tensor> grads_;              // the gradients bound for the current step
  std::vector<bool> skippable_;                // a matrix algorithm's: it may be absent (clear_grad)
  std::vector<bool> absent_;                   // without a gradient at the last step
  int absent_count_ = 0;
  std::vector<char> has_;                      // run(): whether each parameter has a gradient this step
  bool given_ = false;                         // the last step's gradients were given (step_with)
  std::vector<Pin> grad_pins_;                 // ... and where they were when bound
  std::vector<Held> watched_;                  // parameters without a gradient at build time
  std::vector<std::pair<py::dict, py::dict>> state_watch_;  // (state[p], {key: its state tensor})
  std::vector<std::pair<py::dict, std::vector<py::object>>> groups_watch_;  // (group, its params)
  std::vector<std::shared_ptr<TorchCommunicator>> comms_;
  dion3::ThreadOwner user_;  // the thread inside a call (see Entry)
  bool cleared_ = false;                         // by the collector (see clear)
};

void validate_group(const py::dict& cfg) { group_config(cfg).validate(); }

// The backend dion3.orthogonalize runs on for a device: one per device for the process (a CUDA
// backend holds a cuBLAS handle), on the current stream at each call. Used with the GIL held.
dion3::Backend& backend_for(const at::Tensor& x) {
  if (x.is_cpu()) {
    static std::unique_ptr<dion3::Backend> cpu = dion3::make_cpu_backend();
    return *cpu;
  }
#ifdef DION3_HAVE_CUDA
  if (x.is_cuda()) {
    static TorchCudaAllocator allocator;
    static std::map<int, std::unique_ptr<dion3::Backend>> cuda;
    const int index = x.get_device();
    c10::cuda::CUDAGuard guard(index);
    auto& be = cuda[index];
    const auto stream = at::cuda::getCurrentCUDAStream(index).stream();
    if (!be) be = dion3::make_cuda_backend(index, stream, &allocator);
    be->set_stream(stream);
    return *be;
  }
#endif
  if (x.is_cuda()) dion3::make_cuda_backend(x.get_device(), nullptr, nullptr);  // throws Unsupported
  throw dion3::Error(dion3::Status::InvalidArgument,
                     "orthogonalize: the tensor is on '" + x.device().str() + "'; dion3 runs on cpu and cuda");
}

// dion3.orthogonalize: the polar factor of each matrix of x (rows x cols, or batch x rows x cols)
// by the group config's Newton-Schulz settings, into a new tensor of x's dtype.
at::Tensor orthogonalize(const at::Tensor& x, const py::dict& cfg) {
  dion3::GroupConfig g = group_config(cfg);
  g.orth.validate();
  if (x.layout() != at::kStrided)
    throw dion3::Error(dion3::Status::InvalidArgument, "orthogonalize: the tensor must be dense (strided)");
  if (x.dim() != 2 && x.dim() != 3)
    throw dion3::Error(dion3::Status::InvalidArgument,
                       "orthogonalize: expected a matrix or a batch of matrices (2 or 3 dimensions), got " +
                           std::to_string(x.dim()));
  const at::Tensor in = x.resolve_neg().contiguous();  // a negated view's values, as they read
  at::Tensor out = at::empty_like(in);
  const dion3::TensorView v = view_of(in, "orthogonalize: the tensor");
  if (!dion3::is_float_param_dtype(v.dtype))
    throw dion3::Error(dion3::Status::InvalidArgument, std::string("orthogonalize: dtype ") +
                                                           dion3::dtype_name(v.dtype) +
                                                           " (expected float32, float16 or bfloat16)");
  const int64_t batch = x.dim() == 3 ? x.size(0) : 1, rows = x.size(-2), cols = x.size(-1);
  if (in.numel() == 0) return out;
  dion3::Backend& be = backend_for(in);
  dion3::Orthogonalizer o(be, g.orth, batch, rows, cols);
  o.run(dion3::MatrixView::contiguous(in.data_ptr(), v.dtype, batch, rows, cols),
        dion3::MatrixView::contiguous(out.data_ptr(), v.dtype, batch, rows, cols));
  return out;
}

bool cuda_built() {
#ifdef DION3_HAVE_CUDA
  return true;
#else
  return false;
#endif
}



// Sets the Python exception matching a dion3::Error.
void set_python_error(const dion3::Error& e) {
  switch (e.status()) {
    case dion3::Status::InvalidArgument: PyErr_SetString(PyExc_ValueError, e.what()); break;
    case dion3::Status::NonFinite: PyErr_SetString(g_nonfinite_error, e.what()); break;
    case dion3::Status::Unsupported: PyErr_SetString(PyExc_NotImplementedError, e.what()); break;
    default: PyErr_SetString(PyExc_RuntimeError, e.what()); break;
  }
}

// Every entry point turns dion3::Error into its Python exception itself and leaves through
// py::error_already_set, which pybind11's dispatcher handles before any registered exception
// translator. On the H200 image (torch 2.11) the first dion3::Error that reached the translator
// list crashed the interpreter; this path does not depend on that list.
template <class R, class C, class... A>
auto guarded(R (C::*f)(A...)) {
  return [f](C& self, A... a) -> R {
    try {
      const Engine::Entry entry(self);
      return (self.*f)(std::forward<A>(a)...);
    } catch (const dion3::Error& e) {
      set_python_error(e);
      throw py::error_already_set();
    }
  };
}
template <class R, class C, class... A>
auto guarded(R (C::*f)(A...) const) {
  return [f](const C& self, A... a) -> R {
    try {
      const Engine::Entry entry(self);
      return (self.*f)(std::forward<A>(a)...);
    } catch (const dion3::Error& e) {
      set_python_error(e);
      throw py::error_already_set();
    }
  };
}
template <class R, class... A>
auto guarded(R (*f)(A...)) {
  return [f](A... a) -> R {
    try {
      return f(std::forward<A>(a)...);
    } catch (const dion3::Error& e) {
      set_python_error(e);
      throw py::error_already_set();
    }
  };
}

// The state tensors the engine keeps for a parameter of `shape` in a group of `algorithm` (the
// settings that decide them: flatten, momentum_dtype, None = the weight's, transposed).
py::list state_specs_of(const std::string& algorithm, bool flatten, const std::optional<std::string>& momentum_dtype,
                        const std::string& weight_dtype, const std::vector<int64_t>& shape, bool transposed) {
  dion3::GroupConfig g;
  g.algorithm = dion3::parse_algorithm(algorithm);
  g.flatten = flatten;
  g.transposed = transposed;
  if (momentum_dtype) g.momentum_dtype = to_dtype(to_scalar_type(*momentum_dtype));
  py::list out;
  for (const auto& s : dion3::state_specs(g, to_dtype(to_scalar_type(weight_dtype)), shape))
    out.append(py::make_tuple(s.name, dion3::dtype_name(s.dtype), py::tuple(py::cast(s.shape))));
  return out;
}

// A plain pointer, which pybind11 owns from the moment it has it. Returned in a unique_ptr, the
// engine would be owned twice while pybind11 registers the instance: an allocation failing there
// freed it once through the unique_ptr and once more when the half-made instance was released
// (now such a failure frees it once, without running its destructor: a leak, not a corruption).
Engine* make_engine(const std::string& device_type, int device_index, const std::string& on_nonfinite,
                    int64_t workspace_limit, bool megabatch, bool record_orthogonalizer, bool agree_on_names) {
  return new Engine(device_type, device_index, on_nonfinite, workspace_limit, megabatch, record_orthogonalizer,
                    agree_on_names);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dion3 engine binding (internal; use dion3.Dion3 / NorMuon / Muon)";
  g_nonfinite_error = PyErr_NewException("dion3._C.NonFiniteError", PyExc_FloatingPointError, nullptr);
  m.attr("NonFiniteError") = py::handle(g_nonfinite_error);

  // Whether an Engine object's C++ value exists (__init__ ran): the collector may visit one before.
  static constexpr auto constructed = [](PyObject* self) {
    return reinterpret_cast<py::detail::instance*>(self)->get_value_and_holder().holder_constructed();
  };
  py::class_<Engine>(m, "Engine", py::custom_type_setup([](PyHeapTypeObject* heap_type) {
                       auto* type = &heap_type->ht_type;
                       type->tp_flags |= Py_TPFLAGS_HAVE_GC;
                       type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
                         Py_VISIT(Py_TYPE(self));  // a heap type: its instances hold it
                         if (!constructed(self)) return 0;
                         return py::cast<const Engine&>(py::handle(self)).traverse(visit, arg);
                       };
                       type->tp_clear = [](PyObject* self) {
                         if (constructed(self)) py::cast<Engine&>(py::handle(self)).clear();
                         return 0;
                       };
                     }))
      .def(py::init(guarded(&make_engine)), py::arg("device_type"), py::arg("device_index"),
           py::arg("on_nonfinite"), py::arg("workspace_limit") = -1, py::arg("megabatch") = true,
           py::arg("record_orthogonalizer") = true, py::arg("agree_on_names") = false)
      .def("add_group", guarded(&Engine::add_group))
      .def("update_group", guarded(&Engine::update_group))
      .def("add_param", guarded(&Engine::add_param), py::arg("group"), py::arg("name"), py::arg("weight"),
           py::arg("state"), py::arg("layout") = "local", py::arg("process_group") = py::none(),
           py::arg("global_rows") = 0, py::arg("global_cols") = 0, py::arg("row_offset") = -1,
           py::arg("row_chunk") = 0, py::arg("col_process_group") = py::none(), py::arg("grad") = std::nullopt,
           py::arg("wrapper") = std::nullopt, py::arg("order") = std::vector<int64_t>{}, py::arg("absent") = false)
      .def("step_with", guarded(&Engine::step_with))
      .def("step_async_with", guarded(&Engine::step_async_with))
      .def("watch", guarded(&Engine::watch))
      .def("watch_state", guarded(&Engine::watch_state))
      .def("watch_groups", guarded(&Engine::watch_groups))
      .def("stale_for_replay", guarded(&Engine::stale_for_replay))
      .def("grads_replaced", guarded(&Engine::grads_replaced), py::arg("grads") = std::nullopt)
      .def("absent", guarded(&Engine::absent))
      .def("absence_changed", guarded(&Engine::absence_changed))
      .def("set_param_steps", guarded(&Engine::set_param_steps))
      .def("step", guarded(&Engine::step))
      .def("refuse_step", guarded(&Engine::refuse_step))
      .def("step_async", guarded(&Engine::step_async))
      .def("refuse_invalid", guarded(&Engine::refuse_invalid))
      .def("check_last_agreement", guarded(&Engine::check_last_agreement))
      .def("plan", guarded(&Engine::plan))
      .def_property_readonly("num_params", guarded(&Engine::num_params))
      .def_property_readonly("num_groups", guarded(&Engine::num_groups))
      .def_property_readonly("steps_taken", guarded(&Engine::steps_taken))
      .def_property_readonly("steps_skipped", guarded(&Engine::steps_skipped))
      .def_property_readonly("plan_generation", guarded(&Engine::plan_generation))
      .def("refresh_hyperparameters", guarded(&Engine::refresh_hyperparameters))
      .def("state_changed", guarded(&Engine::state_changed))
      .def("state_pending", guarded(&Engine::state_pending))
      .def("posted_counters", guarded(&Engine::posted_counters));
  m.def("validate_group", guarded(&validate_group), "Raise ValueError if a normalised group config is invalid");
  m.def("orthogonalize", guarded(&orthogonalize), "Polar factor of each matrix (see dion3.orthogonalize)");
  m.def("cuda_built", &cuda_built, "Whether this build has the CUDA backend");
  m.def("_live_engines", [] { return live_engines.load(); }, "Engines alive in this process (for tests)");
  // The limit the Python front end checks its own keys against (dion3.optim.Muon's ns_steps).
  m.attr("MAX_ORTH_STEPS") = DION3_MAX_ORTH_STEPS;
  m.attr("MIN_NORM_EPS") = dion3::OrthConfig::kMinNormEps;
  m.def("coefficient_sets", [] {
    py::dict sets;
    auto put = [&](const char* name, const std::vector<dion3::Coefficients>& steps) {
      py::list l;
      for (const auto& s : steps) l.append(py::make_tuple(s[0], s[1], s[2]));
      sets[name] = l;
    };
    put("polar_express", dion3::polar_express_coefficients());
    put("you", dion3::you_coefficients());
    put("reference", dion3::reference_coefficients());
    return sets;
  }, "The engine's named quintic coefficient sets: {name: [(a, b, c), ...]}");
  m.def("state_specs", guarded(&state_specs_of),
        "The engine's state tensors of a parameter: [(engine name, dtype name, shape)]");
  m.def("group_defaults", [] {
    // The group settings' defaults as the engine defines them, under the Python front end's keys.
    const dion3::GroupConfig g;
    const char* adjust = g.adjust_lr == dion3::AdjustLR::SpectralNorm ? "spectral_norm"
                         : g.adjust_lr == dion3::AdjustLR::RmsNorm    ? "rms_norm"
                         : g.adjust_lr == dion3::AdjustLR::SpectralNormClamped ? "spectral_norm_clamped"
                                                                      : nullptr;
    py::dict d;
    d["algorithm"] = dion3::algorithm_name(g.algorithm);
    d["lr"] = g.lr;
    d["fraction"] = g.fraction;
    d["mu"] = g.mu;
    d["muon_beta2"] = g.muon_beta2;
    d["betas"] = py::make_tuple(g.betas[0], g.betas[1]);
    d["weight_decay"] = g.weight_decay;
    d["epsilon"] = g.epsilon;
    d["adjust_lr"] = adjust ? py::object(py::str(adjust)) : py::object(py::none());
    d["flatten"] = g.flatten;
    d["nesterov"] = g.nesterov;
    d["ema_momentum"] = g.ema_momentum;
    d["cautious_wd"] = g.cautious_wd;
    d["scale_lr_by_fraction"] = g.scale_lr_by_fraction;
    d["selection_scope"] = g.selection_scope == dion3::SelectionScope::Local ? "local" : "global";
    d["restarts"] = py::cast(g.orth.restarts);
    return d;
  }, "The engine's defaults of the group settings, by the Python front end's key");
}
