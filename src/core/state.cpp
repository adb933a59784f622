// state.cpp — Optimizer::export_state / import_state: host copies of every state tensor, and
// an import that checks every name, dtype, shape, value and counter before it copies anything.
#include <cmath>
#include <cstring>
#include <limits>

#include "core/engine.hpp"
#include "core/format.hpp"
#include "cpu/cpu_numeric.hpp"
#include "dion3/error.hpp"

namespace dion3 {

// Second moments (NorMuon's row variance, AdamW's exp_avg_sq) are running means of squares.
bool is_second_moment(const std::string& name) { return name == "variance" || name == "exp_avg_sq"; }

// What no optimizer run can have produced in a state tensor, read in its stored dtype: the
// first NaN or Inf, or a negative second moment ("" when every value is fine). Such a value
// would poison every later step (NaN spreads, sqrt of a negative variance is NaN).
std::string bad_state_value(DType dtype, const unsigned char* p, std::size_t n, bool second_moment) {
  if (dtype == DType::F32) {
    // Every value in range, told in one pass the compiler vectorises (NaN fails both tests);
    // only a tensor that fails it is walked for the first bad value.
    const float lo = second_moment ? 0.0f : -std::numeric_limits<float>::max(),
                hi = std::numeric_limits<float>::max();
    int bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      bad |= static_cast<int>(!(v >= lo)) | static_cast<int>(!(v <= hi));
    }
    if (!bad) return "";
  }
  for (std::size_t i = 0; i < n; ++i) {
    float v = 0.0f;
    uint16_t h = 0;
    switch (dtype) {
      case DType::F32: std::memcpy(&v, p + 4 * i, 4); break;
      case DType::F16: std::memcpy(&h, p + 2 * i, 2); v = cpu::f16_to_float(h); break;
      case DType::BF16: std::memcpy(&h, p + 2 * i, 2); v = cpu::bf16_to_float(h); break;
      default: return "";  // state tensors are float; the dtype check has refused anything else
    }
    if (std::isfinite(v) && !(second_moment && v < 0.0f)) continue;
    const std::string value = std::isnan(v) ? "NaN" : std::isinf(v) ? (v > 0 ? "+Inf" : "-Inf") : format_number(v);
    return value + " at element " + std::to_string(i) +
           (std::isfinite(v) ? "; a second moment cannot be negative" : "; state values must be finite");
  }
  return "";
}

std::string bad_state_value(const HostTensor& t, bool second_moment) {
  return bad_state_value(t.dtype, t.data.data(), t.data.size() / dtype_size(t.dtype), second_moment);
}

namespace {
// A state tensor's bytes on the host.
HostTensor host_copy(Backend& backend, const TensorView& view) {
  HostTensor h{view.dtype, view.shape, std::vector<unsigned char>(view.bytes())};
  if (!h.data.empty()) backend.copy_to_host(h.data.data(), view.data, h.data.size());
  return h;
}
}  // namespace

void Optimizer::Impl::check_written_state() {
  std::vector<char> read(params.size(), all_written ? 1 : 0);
  for (int i : written_params)
    if (i < static_cast<int>(params.size())) read[static_cast<std::size_t>(i)] = 1;
  auto check = [&](std::size_t i, const std::string& name, const TensorView& view, const unsigned char* host) {
    const std::size_t n = view.bytes() / dtype_size(view.dtype);
    if (const std::string bad = bad_state_value(view.dtype, host, n, true); !bad.empty())
      fail(describe(static_cast<int>(i)) + ": state '" + name + "' (" + dtype_name(view.dtype) + "), written " +
           "since the last step (state_changed), holds " + bad + "; the step was not applied");
  };
  // Read back in batches: the tensors gathered into one device buffer and copied to pinned host
  // memory at once (both kept for the next call), so that many small second moments cost one
  // wait for the device, not one each.
  struct Entry {
    std::size_t param, offset;
    const std::string* name;
    const TensorView* view;
  };
  std::vector<Entry> batch;
  std::size_t batch_bytes = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    if (!written_readback || written_gathered.bytes() < batch_bytes) {
      written_readback.reset();  // the pair is remade together (either may fail to allocate)
      written_gathered = DeviceBuffer(backend->allocator(), batch_bytes);
      written_readback = backend->new_host_copy(batch_bytes);
    }
    for (const Entry& e : batch)
      backend->copy(written_gathered.as<unsigned char>() + e.offset, e.view->data, e.view->bytes());
    written_readback->start(written_gathered.get());
    const auto* host = static_cast<const unsigned char*>(written_readback->wait());
    for (const Entry& e : batch) check(e.param, *e.name, *e.view, host + e.offset);
    batch.clear();
    batch_bytes = 0;
  };
  for (std::size_t i = 0; i < params.size(); ++i)
    for (const auto& [name, view] : params[i].state) {
      const std::size_t bytes = view.bytes();
      if (!read[i] || !is_second_moment(name) || bytes == 0) continue;
      if (bytes > kReadBackBatchBytes) {
        flush();  // in parameter order, so that the first bad tensor is the one named
        const HostTensor h = host_copy(*backend, view);
        check(i, name, view, h.data.data());
        continue;
      }
      std::size_t offset = (batch_bytes + 15) / 16 * 16;
      if (offset + bytes > kReadBackBatchBytes) {
        flush();
        offset = 0;
      }
      batch.push_back({i, offset, &name, &view});
      batch_bytes = offset + bytes;
    }
  flush();
  written_params.clear();
  all_written = false;
}

OptimizerState Optimizer::export_state() const {
  const Impl::Use use(*impl_);
  impl_->fold_absent_counts();  // what step_async counted on the device (the counts are unchanged)
  const Impl& s = *impl_;
  OptimizerState out;
  const auto counters = s.read_counters();
  out.steps = counters[0];
  out.skipped = counters[1];
  for (const Param& p : s.params) {
    ParamState ps;
    ps.name = p.name;
    ps.step = counters[0] - p.step_offset;
    for (const auto& [name, view] : p.state) ps.tensors.emplace_back(name, host_copy(*s.backend, view));
    out.params.push_back(std::move(ps));
  }
  return out;
}

void Optimizer::import_state(const OptimizerState& state) {
  const Impl::Use use(*impl_);
  Impl& s = *impl_;
  // The counters advance on the device by one per step, unchecked: a count above 2^62 (no run's)
  // is refused, so that no number of steps after an import can overflow it.
  constexpr int64_t kMaxCount = int64_t{1} << 62;
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"steps", state.steps},
                                     std::pair<const char*, int64_t>{"skipped", state.skipped}}) {
    if (value < 0) fail(std::string("import_state: step counter '") + field + "' is " + std::to_string(value) +
                        "; step counters cannot be negative");
    if (value > kMaxCount)
      fail(std::string("import_state: step counter '") + field + "' is " + std::to_string(value) +
           "; step counters above 2^62 are refused (the steps after it could overflow the counter)");
  }
  if (state.params.size() != s.params.size())
    fail("import_state: the state holds " + std::to_string(state.params.size()) +
         " parameters but the optimizer has " + std::to_string(s.params.size()));
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    const Param& p = s.params[i];
    const ParamState& ps = state.params[i];
    const std::string who = s.describe(static_cast<int>(i));
    if (ps.name != p.name) fail("import_state: " + who + " meets state saved for '" + ps.name + "'");
    if (ps.step < 0 || ps.step > state.steps)
      fail("import_state: " + who + " has step count " + std::to_string(ps.step) + ", outside [0, " +
           std::to_string(state.steps) + "] (the optimizer's steps)");
    if (ps.tensors.size() != p.state.size())
      fail("import_state: " + who + " needs " + std::to_string(p.state.size()) + " state tensors, got " +
           std::to_string(ps.tensors.size()));
    for (std::size_t j = 0; j < p.state.size(); ++j) {
      const auto& [want_name, want] = p.state[j];
      const auto& [name, got] = ps.tensors[j];
      if (name != want_name)
        fail("import_state: " + who + " state " + std::to_string(j) + " must be '" + want_name + "', got '" + name + "'");
      if (got.dtype != want.dtype || got.shape != want.shape)
        fail("import_state: " + who + " state '" + name + "' must be " + dtype_name(want.dtype) + " " +
             want.shape_str() + ", got " + dtype_name(got.dtype) + " " + shape_string(got.shape));
      if (got.data.size() != want.bytes())
        fail("import_state: " + who + " state '" + name + "' holds " + std::to_string(got.data.size()) +
             " bytes, expected " + std::to_string(want.bytes()));
      if (const std::string bad = bad_state_value(got, is_second_moment(name)); !bad.empty())
        fail("import_state: " + who + " state '" + name + "' (" + dtype_name(got.dtype) + ") holds " + bad);
    }
  }
  // Everything checked: now copy (the momentum bounds forgotten first, so that a copy that fails
  // part way leaves none trusted).
  s.forget_state_bounds();
  s.fold_absent_counts();  // the offsets are set anew below
  ++s.binding;  // the step offsets AdamW's cached parameters carry
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    Param& p = s.params[i];
    p.step_offset = state.steps - state.params[i].step;
    for (std::size_t j = 0; j < p.state.size(); ++j) {
      const HostTensor& h = state.params[i].tensors[j].second;
      if (!h.data.empty()) s.backend->copy_from_host(p.state[j].second.data, h.data.data(), h.data.size());
    }
  }
  const int64_t counters[2] = {state.steps, state.skipped};
  s.backend->copy_from_host(s.counters.get(), counters, sizeof(counters));
}

}  // namespace dion3
