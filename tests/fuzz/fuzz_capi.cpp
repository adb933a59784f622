// tests/fuzz/fuzz_capi.cpp — libFuzzer target over the C API's argument validation.
//
// The input is a program of C API calls (capi_program.hpp) with fuzzed arguments: options,
// group configurations (NaN, Inf, huge, negative, out-of-range enums), parameters of odd
// shapes, dtypes, names, layouts and NULL pointers, steps, state export and import. Every
// tensor points into a buffer the harness owns, exactly as large as the tensor it describes
// (and alive until the optimizer is destroyed), so any memory error the sanitizers report is
// the library's.
//
// Checks besides the sanitizers: a failing call returns an error status and changes nothing
// observable (parameter count, the group's configuration, weights, exported state); an export
// that fails writes nothing; importing what was just exported restores the same bytes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "capi_program.hpp"
#include "dion3/backend.hpp"
#include "dion3/state_format.hpp"
#include "fuzz_input.hpp"
#include "fuzz_model.hpp"

namespace {

using fuzz::check;

constexpr int64_t kMaxElems = 4096;  // per tensor: steps stay fast
constexpr size_t kMaxOps = 64;
constexpr int kMaxSteps = 8;
constexpr int kMaxParams = 16;
constexpr size_t kMaxBuffers = 48;
// The exported state's "skipped" counter (after magic, version, reserved and steps).
constexpr size_t kSkippedAt = 24, kSkippedEnd = 32;

struct Buffer {
  std::vector<unsigned char> bytes;
  int32_t dtype = DION3_F32;
};

enum class Backing { Ok, TooLarge, Overflow };

// How many elements a tensor description needs. Descriptions the C API must refuse anyway
// (rank outside 0..8, negative dimensions) get none. A product that overflows int64 is no
// tensor at all; a large one is legal but more than the harness backs with memory.
Backing backing(const dion3_tensor& t, int64_t& numel) {
  numel = 0;
  if (t.ndim < 0 || t.ndim > DION3_MAX_DIMS) return Backing::Ok;
  int64_t product = 1;
  bool empty = false, negative = false, overflow = false;
  for (int d = 0; d < t.ndim; ++d) {
    const int64_t e = t.shape[d];
    if (e < 0) negative = true;
    if (e == 0) empty = true;
    if (e > 0 && __builtin_mul_overflow(product, e, &product)) overflow = true;
  }
  if (negative) return Backing::Ok;
  if (overflow) return Backing::Overflow;
  if (empty) return Backing::Ok;
  if (product > kMaxElems) return Backing::TooLarge;
  numel = product;
  return Backing::Ok;
}

const char* name_of(unsigned pick, std::string& storage) {
  switch (pick) {
    case 0: return nullptr;
    case 1: return "";
    case 6: storage.assign(300, 'n'); return storage.c_str();
    case 7: storage = "odd\t\x01\xff name"; return storage.c_str();
    default: storage = "w" + std::to_string(pick - 2); return storage.c_str();
  }
}

void fill(Buffer& b, unsigned kind, uint8_t seed) {
  const size_t es = fuzz::dtype_bytes(b.dtype);
  const int64_t n = static_cast<int64_t>(b.bytes.size() / es);
  const bool is_float = b.dtype == DION3_F32 || b.dtype == DION3_F16 || b.dtype == DION3_BF16;
  uint64_t s = 0x9E3779B97F4A7C15ull * (seed + 1);
  if (!is_float) {
    for (unsigned char& c : b.bytes) {
      fuzz::noise(s);
      c = static_cast<unsigned char>(s >> 56);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    float v = fuzz::noise(s);
    switch (kind) {
      case fuzz::kFillZero: v = 0; break;
      case fuzz::kFillLarge: v *= 1e3f; break;
      case fuzz::kFillHuge: v = (i % 2 ? -3e38f : 3e38f); break;
      case fuzz::kFillTiny: v *= 1e-40f; break;
      case fuzz::kFillVeryLarge: v *= 1e20f; break;
      default: break;
    }
    fuzz::store(b.bytes.data(), b.dtype, i, v);
  }
  if (n > 0 && (kind == fuzz::kFillNaN || kind == fuzz::kFillInf))
    fuzz::store(b.bytes.data(), b.dtype, seed % n, kind == fuzz::kFillNaN ? NAN : INFINITY);
}

// DION3_FUZZ_TRACE=1: every call and its status on stderr (to read what a crashing input does).
bool tracing() {
  static const bool on = std::getenv("DION3_FUZZ_TRACE") != nullptr;
  return on;
}

dion3_status traced(dion3_status s, const std::string& call) {
  if (tracing())
    std::fprintf(stderr, "%s -> %d%s%s\n", call.c_str(), s, s ? ": " : "", s ? dion3_last_error() : "");
  return s;
}

std::string describe(const dion3_tensor* t) {
  if (!t) return "NULL";
  std::string d = "{dtype " + std::to_string(t->dtype) + ", device " + std::to_string(t->device) + ", shape [";
  for (int i = 0; i < std::clamp(t->ndim, 0, DION3_MAX_DIMS); ++i) d += (i ? "," : "") + std::to_string(t->shape[i]);
  char ptr[32];
  std::snprintf(ptr, sizeof ptr, "%p", t->data);
  return d + "] (ndim " + std::to_string(t->ndim) + "), data " + ptr + "}";
}

class Session {
 public:
  explicit Session(fuzz::Input& in) : in_(in) {}
  ~Session() { reset(); }

  void run() {
    const int device = in_.int_field(0, 0), policy = in_.int_field(0, 1);
    create(device, policy, false);
    for (size_t ops = 0; ops < kMaxOps && !in_.empty(); ++ops) {
      switch (in_.pick(fuzz::kOpCount)) {
        case fuzz::kCreate: {
          const int d = in_.int_field(0, 0), p = in_.int_field(0, 1);
          create(d, p, in_.flag());
          break;
        }
        case fuzz::kAddGroup: add_group(); break;
        case fuzz::kSetGroupConfig: set_group_config(); break;
        case fuzz::kSetLr: set_lr(); break;
        case fuzz::kAddParam: add_param(); break;
        case fuzz::kSetGrad: set_grad(); break;
        case fuzz::kFill: refill(); break;
        case fuzz::kStep: step(); break;
        case fuzz::kExportImport: export_import(); break;
        case fuzz::kImportMutated: import_mutated(); break;
        case fuzz::kImportRaw: import_raw(); break;
        case fuzz::kPlan: plan(); break;
        case fuzz::kGetGroupConfig: get_group_config(); break;
        case fuzz::kQueries: queries(); break;
        case fuzz::kDestroy: reset(); break;
        case fuzz::kMisc: misc(); break;
      }
    }
  }

 private:
  // A failed call returns an error status; with an optimizer, its parameters are as they were.
  void failed(dion3_status s, const char* call) {
    check(s == DION3_INVALID_ARGUMENT || s == DION3_UNSUPPORTED || s == DION3_NON_FINITE,
          std::string(call) + " failed with status " + std::to_string(s) + ": " + dion3_last_error());
    if (opt_) {
      int n = -1;
      check(dion3_num_params(opt_, &n) == DION3_OK && n == params_, std::string("a failed ") + call +
                                                                      " changed the parameter count");
    }
  }

  void reset() {
    dion3_destroy(opt_);  // first: the buffers must outlive the optimizer
    opt_ = nullptr;
    buffers_.clear();
    weights_.clear();
    weight_groups_.clear();
    groups_ = params_ = steps_ = 0;
  }

  void create(int device, int policy, bool out_null) {
    reset();
    const dion3_status s = traced(dion3_create(out_null ? nullptr : &opt_, device, 0, nullptr, policy),
                                    "dion3_create(device " + std::to_string(device) + ", policy " + std::to_string(policy) + ")");
    if (s != DION3_OK) {
      failed(s, "dion3_create");
      check(opt_ == nullptr, "a failed dion3_create left an optimizer");
    } else {
      check(!out_null && opt_ != nullptr, "dion3_create succeeded without an optimizer");
    }
  }

  // --- group configurations ------------------------------------------------------------------
  void edit_config(dion3_group_config& c) {
    const unsigned edits = in_.byte() % fuzz::kMaxEdits;
    for (unsigned e = 0; e < edits; ++e) {
      switch (in_.pick(fuzz::kConfigFields)) {
        case fuzz::kAlgorithm: c.algorithm = in_.int_field(0, 5); break;
        case fuzz::kLr: c.lr = in_.real(); break;
        case fuzz::kFraction: c.fraction = in_.real(); break;
        case fuzz::kMu: c.mu = in_.real(); break;
        case fuzz::kMuonBeta2: c.muon_beta2 = in_.real(); break;
        case fuzz::kBeta0: c.betas[0] = in_.real(); break;
        case fuzz::kBeta1: c.betas[1] = in_.real(); break;
        case fuzz::kWeightDecay: c.weight_decay = in_.real(); break;
        case fuzz::kEpsilon: c.epsilon = in_.real(); break;
        case fuzz::kAdjustLr: c.adjust_lr = in_.int_field(0, 2); break;
        case fuzz::kFlatten: c.flatten = in_.int_field(0, 1); break;
        case fuzz::kNesterov: c.nesterov = in_.int_field(0, 1); break;
        case fuzz::kCautiousWd: c.cautious_wd = in_.int_field(0, 1); break;
        case fuzz::kScaleLrByFraction: c.scale_lr_by_fraction = in_.int_field(0, 1); break;
        case fuzz::kMomentumDtype: c.momentum_dtype = in_.int_field(-1, 2); break;
        case fuzz::kOrthMethod: c.orth_method = in_.int_field(0, 2); break;
        case fuzz::kOrthCoefficients: c.orth_coefficients = in_.int_field(0, 2); break;
        case fuzz::kOrthNumCustom: c.orth_num_custom = in_.int_field(1, 16); break;
        case fuzz::kOrthCustom: {
          const unsigned i = in_.pick(DION3_MAX_ORTH_STEPS), j = in_.pick(3);
          c.orth_custom[i][j] = in_.real();
          break;
        }
        case fuzz::kOrthNumRestarts: c.orth_num_restarts = in_.int_field(0, 4); break;
        case fuzz::kOrthRestart: {
          const unsigned i = in_.pick(DION3_MAX_ORTH_RESTARTS);
          c.orth_restarts[i] = in_.int_field(0, 6);
          break;
        }
        case fuzz::kOrthIterDtype: c.orth_iteration_dtype = in_.int_field(-1, 2); break;
        case fuzz::kSelectionScope: c.selection_scope = in_.int_field(0, 1); break;
        case fuzz::kTransposed: c.transposed = in_.int_field(0, 1); break;
      }
    }
  }

  bool get_config(int group, dion3_group_config& out) {
    std::memset(&out, 0, sizeof out);
    return opt_ && group >= 0 && group < groups_ && dion3_get_group_config(opt_, group, &out) == DION3_OK;
  }

  void add_group() {
    const bool cfg_null = in_.flag();
    dion3_group_config c;
    dion3_group_config_default(&c);
    edit_config(c);
    const bool index_null = in_.flag();
    int index = -1;
    const dion3_status s = traced(dion3_add_group(opt_, cfg_null ? nullptr : &c, index_null ? nullptr : &index), "dion3_add_group");
    if (s != DION3_OK) return failed(s, "dion3_add_group");
    check(index_null || index == groups_, "dion3_add_group returned an unexpected index");
    ++groups_;
  }

  // Reading a group's configuration back gives what was set; a refused edit changes nothing.
  void set_group_config() {
    const int group = in_.int_field(0, 7);
    const bool cfg_null = in_.flag(), from_current = in_.flag();
    dion3_group_config c, before;
    dion3_group_config_default(&c);
    const bool had = get_config(group, before);
    if (from_current && had) c = before;
    edit_config(c);
    const dion3_status s = traced(dion3_set_group_config(opt_, group, cfg_null ? nullptr : &c),
                                    "dion3_set_group_config(" + std::to_string(group) + ")");
    dion3_group_config after;
    const bool has = get_config(group, after);
    check(had == has, "dion3_set_group_config changed whether the group can be read");
    if (s != DION3_OK) {
      failed(s, "dion3_set_group_config");
      check(!had || std::memcmp(&before, &after, sizeof after) == 0, "a refused dion3_set_group_config changed the group");
    }
  }

  void set_lr() {
    const int group = in_.int_field(0, 7);
    const double lr = in_.real();
    dion3_group_config before, after;
    const bool had = get_config(group, before);
    const dion3_status s = traced(dion3_set_lr(opt_, group, lr), "dion3_set_lr(" + std::to_string(group) + ", " + std::to_string(lr) + ")");
    get_config(group, after);
    if (s != DION3_OK) {
      failed(s, "dion3_set_lr");
      check(!had || std::memcmp(&before, &after, sizeof after) == 0, "a refused dion3_set_lr changed the group");
    } else {
      check(after.lr == lr, "dion3_set_lr did not set lr");
    }
  }

  void get_group_config() {
    const int group = in_.int_field(0, 7);
    const bool out_null = in_.flag();
    dion3_group_config c;
    const dion3_status s = dion3_get_group_config(opt_, group, out_null ? nullptr : &c);
    if (s != DION3_OK) return failed(s, "dion3_get_group_config");
    // What was read is a valid edit of the same group (every setter validated it).
    check(dion3_set_group_config(opt_, group, &c) == DION3_OK,
          "dion3_set_group_config refused the configuration dion3_get_group_config returned");
  }

  // --- tensors and parameters ----------------------------------------------------------------
  Buffer* new_buffer(int32_t dtype, int64_t numel) {
    if (buffers_.size() >= kMaxBuffers) return nullptr;
    auto b = std::make_unique<Buffer>();
    b->dtype = dtype;
    b->bytes.assign(static_cast<size_t>(numel) * fuzz::dtype_bytes(dtype), 0);
    buffers_.push_back(std::move(b));
    return buffers_.back().get();
  }

  // Points t at memory for `numel` elements as `mode` says; false when the harness cannot.
  bool place(dion3_tensor& t, int64_t numel, unsigned mode, uint8_t alias, unsigned kind, uint8_t seed) {
    const size_t bytes = static_cast<size_t>(numel) * fuzz::dtype_bytes(t.dtype);
    if (mode == fuzz::kDataNull) {
      t.data = nullptr;
      return true;
    }
    if (mode == fuzz::kDataAlias && !buffers_.empty()) {
      Buffer& b = *buffers_[alias % buffers_.size()];
      if (b.bytes.size() >= bytes && !b.bytes.empty()) {
        t.data = b.bytes.data();
        return true;
      }
    }
    Buffer* b = new_buffer(t.dtype, numel);
    if (!b) return false;
    fill(*b, kind, seed);
    t.data = b->bytes.empty() ? nullptr : b->bytes.data();
    return true;
  }

  // Reads a tensor; false when the harness skips the call that would use it.
  bool read_tensor(dion3_tensor& t) {
    std::memset(&t, 0, sizeof t);
    t.ndim = in_.int_field(0, 4);
    const int dims = std::clamp(t.ndim, 0, DION3_MAX_DIMS);
    for (int d = 0; d < dims; ++d) t.shape[d] = in_.dim(6);
    t.dtype = in_.int_field(0, 2);
    t.device = in_.int_field(0, 0);
    const unsigned mode = in_.pick(fuzz::kDataModes);
    const uint8_t alias = mode == fuzz::kDataAlias ? in_.byte() : 0;
    const unsigned kind = in_.pick(fuzz::kFillKinds);
    const uint8_t seed = in_.byte();
    int64_t numel = 0;
    switch (backing(t, numel)) {
      case Backing::TooLarge: return false;
      case Backing::Overflow:
        // Shapes whose element count overflows int64: the library must refuse them.
        if (!fuzz::strict("huge_shapes")) return false;
        overflow_ = true;
        numel = 1;
        break;
      case Backing::Ok: break;
    }
    return place(t, numel, mode, alias, kind, seed);
  }

  // A gradient for a parameter whose weight is w.
  bool read_grad(const dion3_tensor& w, dion3_tensor& g, bool& null) {
    null = false;
    int64_t numel = 0;
    if (backing(w, numel) != Backing::Ok) numel = 0;
    switch (in_.pick(fuzz::kGradModes)) {
      case fuzz::kGradNull: null = true; return true;
      case fuzz::kGradSpec: return read_tensor(g);
      case fuzz::kGradIsWeight: g = w; return true;
      case fuzz::kGradAlias: {
        g = w;
        const uint8_t alias = in_.byte();
        return place(g, numel, fuzz::kDataAlias, alias, fuzz::kFillNoise, alias);
      }
      default: {
        g = w;
        const unsigned kind = in_.pick(fuzz::kFillKinds);
        return place(g, numel, fuzz::kDataOwn, 0, kind, in_.byte());
      }
    }
  }

  void add_param() {
    const int group = in_.int_field(0, 7);
    std::string storage;
    const char* name = name_of(in_.pick(fuzz::kNames), storage);
    overflow_ = false;
    dion3_tensor w, g;
    bool grad_null = false;
    bool ok = read_tensor(w);
    ok = read_grad(w, g, grad_null) && ok;
    const unsigned layout_mode = in_.pick(fuzz::kLayoutModes);
    dion3_layout layout{};
    if (layout_mode == fuzz::kLayoutStruct) {
      layout.kind = in_.int_field(0, 4);
      layout.global_rows = in_.dim(6);
      layout.global_cols = in_.dim(6);
    }
    const bool index_null = in_.flag();
    if (!ok || params_ >= kMaxParams) return;
    int index = -1;
    int* out = index_null ? nullptr : &index;
    const dion3_tensor* gp = grad_null ? nullptr : &g;
    const dion3_status s = traced(
        layout_mode == fuzz::kLayoutNone
            ? dion3_add_param(opt_, group, name, &w, gp, out)
            : dion3_add_param_layout(opt_, group, name, &w, gp, layout_mode == fuzz::kLayoutNull ? nullptr : &layout, out),
        "dion3_add_param(group " + std::to_string(group) + ", '" + (name ? name : "NULL") + "', weight " + describe(&w) +
            ", grad " + describe(gp) + ", layout mode " + std::to_string(layout_mode) + ")");
    if (overflow_) check(s != DION3_OK, "dion3_add_param accepted a shape whose element count overflows int64");
    if (s != DION3_OK) return failed(s, "dion3_add_param");
    check(index_null || index == params_, "dion3_add_param returned an unexpected index");
    ++params_;
    weights_.push_back(w);
    weight_groups_.push_back(group);
  }

  void set_grad() {
    const int param = in_.int_field(0, 7);
    overflow_ = false;
    dion3_tensor w{}, g;
    if (param >= 0 && param < params_) w = weights_[param];
    bool null = false;
    if (!read_grad(w, g, null)) return;
    const dion3_status s = traced(dion3_set_grad(opt_, param, null ? nullptr : &g),
                                    "dion3_set_grad(" + std::to_string(param) + ", " + describe(null ? nullptr : &g) + ")");
    if (overflow_) check(s != DION3_OK, "dion3_set_grad accepted a shape whose element count overflows int64");
    if (s != DION3_OK) failed(s, "dion3_set_grad");
  }

  void refill() {
    const uint8_t which = in_.byte();
    const unsigned kind = in_.pick(fuzz::kFillKinds);
    const uint8_t seed = in_.byte();
    if (!buffers_.empty()) fill(*buffers_[which % buffers_.size()], kind, seed);
  }

  // --- step and state -------------------------------------------------------------------------
  std::vector<std::vector<unsigned char>> snapshot() const {
    std::vector<std::vector<unsigned char>> s;
    for (const auto& b : buffers_) s.push_back(b->bytes);
    return s;
  }

  // Weights and state hold only finite values (the gradients of an applied step are finite).
  bool all_finite() const {
    for (const dion3_tensor& w : weights_) {
      int64_t n = 0;
      if (!w.data || backing(w, n) != Backing::Ok) continue;
      for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(fuzz::load(static_cast<const unsigned char*>(w.data), w.dtype, i))) return false;
    }
    const std::vector<uint8_t> st = fuzz::export_state(opt_);
    return fuzz::sane_values(dion3::parse_state(st.data(), st.size()));
  }

  // Whether a step's arithmetic stays inside every weight's dtype whatever the update's signs:
  // max|w|·|1 − η·λ| + η·S within half the dtype's largest finite value, η the group's base lr
  // and S a bound of one entry of η′/η times the update: orthogonalized updates have entries of
  // at most about 1 and NorMuon's at most ‖O‖_F, both scaled by η′/η <= √numel (so 2·numel
  // bounds them); Lion's are ±1. AdamW's m̂/(√v̂ + ε) has no such bound (imported moments, or a
  // small β₂ after a large gradient), so a program stepping an AdamW parameter is not judged.
  bool steps_fit() {
    for (size_t i = 0; i < weights_.size(); ++i) {
      const dion3_tensor& w = weights_[i];
      dion3_group_config c;
      if (!get_config(weight_groups_[i], c)) return false;
      int64_t n = 0;
      if (!w.data || backing(w, n) != Backing::Ok || n == 0) continue;  // nothing to overflow
      if (c.algorithm == DION3_ALGO_ADAMW) return false;
      double eta = c.lr;
      const bool selects = c.algorithm == DION3_ALGO_DION3 || c.algorithm == DION3_ALGO_DION2;
      if (selects && c.scale_lr_by_fraction) eta /= std::sqrt(c.fraction);
      const double entry = c.algorithm == DION3_ALGO_LION ? 1.0 : 2.0 * static_cast<double>(n);
      double largest_w = 0.0;
      for (int64_t j = 0; j < n; ++j)
        largest_w = std::max(largest_w, std::fabs(double(fuzz::load(static_cast<const unsigned char*>(w.data), w.dtype, j))));
      const double limit = dion3::largest_finite(static_cast<dion3::DType>(w.dtype));  // C and C++ dtypes agree
      const double reach = largest_w * std::fabs(1.0 - eta * c.weight_decay) + eta * entry;
      if (!(reach <= 0.5 * limit)) return false;
    }
    return true;
  }

  // A step that fails or is skipped changes no weight and no state (a skipped one only counts
  // itself in steps_skipped). Strict check "finite_steps": an applied step from finite weights
  // and state whose size fits the weights' dtypes (steps_fit) leaves them finite.
  void step() {
    const bool applied_null = in_.flag();
    if (steps_ >= kMaxSteps) return;
    ++steps_;
    const auto weights_before = snapshot();
    const std::vector<uint8_t> state_before = opt_ ? fuzz::export_state(opt_) : std::vector<uint8_t>{};
    const bool finite_before = opt_ && fuzz::strict("finite_steps") && all_finite() && steps_fit();
    int applied = -1;
    const dion3_status s = traced(dion3_step(opt_, applied_null ? nullptr : &applied), "dion3_step");
    if (s == DION3_OK && finite_before && (applied_null || applied == 1))
      check(all_finite(), "a step from finite weights, gradients and state left a non-finite weight or state value");
    if (s == DION3_OK && (applied_null || applied == 1)) return;
    if (s != DION3_OK) failed(s, "dion3_step");
    check(applied_null || applied == 0, "dion3_step failed but reported the step applied");
    check(snapshot() == weights_before, "a failed or skipped dion3_step changed a weight");
    if (!opt_) return;
    std::vector<uint8_t> state_after = fuzz::export_state(opt_);
    check(state_after.size() == state_before.size(), "a failed or skipped dion3_step changed the state's size");
    std::vector<uint8_t> a = state_before;
    if (s == DION3_OK) {  // skipped: the skipped counter may move, nothing else
      for (size_t i = kSkippedAt; i < kSkippedEnd && i < a.size(); ++i) a[i] = state_after[i];
      fuzz::fix_hash(a);
    }
    check(a == state_after, "a failed or skipped dion3_step changed the optimizer's state");
  }

  void import_checked(const uint8_t* buf, size_t size, bool expect_same) {
    const std::vector<uint8_t> before = opt_ ? fuzz::export_state(opt_) : std::vector<uint8_t>{};
    const dion3_status s = traced(dion3_import_state(opt_, buf, size), "dion3_import_state(" + std::to_string(size) + " bytes)");
    if (s != DION3_OK) {
      failed(s, "dion3_import_state");
      check(!opt_ || fuzz::export_state(opt_) == before, "a refused dion3_import_state changed the state");
      return;
    }
    if (expect_same)
      check(fuzz::export_state(opt_) == std::vector<uint8_t>(buf, buf + size),
            "importing an exported state does not export the same bytes");
  }

  void export_import() {
    const unsigned export_mode = in_.pick(4), import_mode = in_.pick(3);
    size_t need = 0;
    dion3_status s = dion3_export_size(opt_, &need);
    if (s != DION3_OK) return failed(s, "dion3_export_size");
    size_t capacity = export_mode == 1 && need > 0 ? need - 1 : export_mode == 2 ? need + 16 : need;
    std::vector<uint8_t> buf(capacity, 0xA5);
    size_t written = 0;
    s = dion3_export_state(opt_, export_mode == 3 ? nullptr : buf.data(), capacity, &written);
    if (s != DION3_OK) {
      failed(s, "dion3_export_state");
      check(std::all_of(buf.begin(), buf.end(), [](uint8_t b) { return b == 0xA5; }),
            "a failed dion3_export_state wrote into the buffer");
      return;
    }
    check(written == need, "dion3_export_state wrote another size than dion3_export_size said");
    buf.resize(need);
    if (import_mode == 1 && !buf.empty()) buf.pop_back();
    if (import_mode == 2) buf.push_back(0);
    import_checked(buf.data(), buf.size(), import_mode == 0);
  }

  void import_mutated() {
    std::vector<uint8_t> buf = opt_ ? fuzz::export_state(opt_) : std::vector<uint8_t>(16, 0);
    const unsigned n = in_.byte() % 8;
    for (unsigned i = 0; i < n; ++i) {
      const uint16_t at = in_.u16();
      const uint8_t v = in_.byte();
      if (!buf.empty()) buf[at % buf.size()] = v;
    }
    if (in_.flag()) fuzz::fix_hash(buf);
    import_checked(buf.data(), buf.size(), false);
  }

  void import_raw() {
    const std::vector<uint8_t> raw = in_.bytes(4096);
    const bool null = in_.flag();
    const dion3_status s = dion3_import_state(opt_, null ? nullptr : raw.data(), raw.size());
    if (s != DION3_OK) failed(s, "dion3_import_state");
  }

  void plan() {
    const unsigned mode = in_.pick(4);
    const bool count_null = in_.flag();
    size_t total = 0;
    dion3_status s = dion3_plan(opt_, nullptr, 0, &total);
    if (s != DION3_OK) return failed(s, "dion3_plan");
    size_t capacity = mode == 0 ? 0 : mode == 1 ? 3 : mode == 2 ? total : 1;
    std::vector<dion3_megabatch_info> out(capacity);  // exactly capacity entries
    size_t count = 0;
    s = dion3_plan(opt_, mode == 1 ? nullptr : out.data(), capacity, count_null ? nullptr : &count);
    if (mode == 1 || count_null) check(s != DION3_OK, "dion3_plan accepted a NULL output");
    if (s != DION3_OK) return failed(s, "dion3_plan");
    check(count == total, "dion3_plan counts differently on a second call");
  }

  void queries() {
    int n = 0;
    int64_t taken = 0, skipped = 0;
    size_t bytes = 0;
    dion3_status s;
    if ((s = dion3_num_params(opt_, &n)) != DION3_OK) failed(s, "dion3_num_params");
    if ((s = dion3_num_params(opt_, nullptr)) != DION3_OK) failed(s, "dion3_num_params");
    if ((s = dion3_steps(opt_, &taken, &skipped)) != DION3_OK) failed(s, "dion3_steps");
    if ((s = dion3_steps(opt_, nullptr, nullptr)) != DION3_OK) failed(s, "dion3_steps");
    if ((s = dion3_state_size(opt_, &bytes)) != DION3_OK) failed(s, "dion3_state_size");
    if ((s = dion3_state_size(opt_, nullptr)) != DION3_OK) failed(s, "dion3_state_size");
    if ((s = dion3_export_size(opt_, nullptr)) != DION3_OK) failed(s, "dion3_export_size");
    if (opt_) check(n == params_ && taken >= 0 && skipped >= 0, "dion3 counts disagree with the calls made");
  }

  void misc() {
    const int status = in_.int_field(0, 4);
    const double timeout = in_.real();
    check(std::strlen(dion3_status_name(status)) > 0 && std::strlen(dion3_version()) > 0, "empty name");
    dion3_group_config_default(nullptr);
    (void)dion3_cuda_available();
    dion3_status s;
    // Communicators are created from NULL handles only: real ones need an initialised MPI/NCCL.
    if ((s = dion3_comm_create_mpi(nullptr, nullptr, timeout)) != DION3_OK) failed(s, "dion3_comm_create_mpi");
    if ((s = dion3_comm_create_nccl(nullptr, nullptr, 0)) != DION3_OK) failed(s, "dion3_comm_create_nccl");
    int rank = 0, size = 0;
    if ((s = dion3_comm_rank(nullptr, &rank, &size)) != DION3_OK) failed(s, "dion3_comm_rank");
    dion3_comm_destroy(nullptr);
    if ((s = dion3_set_stream(opt_, nullptr)) != DION3_OK) failed(s, "dion3_set_stream");
  }

  fuzz::Input& in_;
  dion3_optimizer* opt_ = nullptr;
  std::vector<std::unique_ptr<Buffer>> buffers_;  // outlive opt_: destroyed after it in reset()
  std::vector<dion3_tensor> weights_;             // of the accepted parameters, by index
  std::vector<int> weight_groups_;                // their groups
  int groups_ = 0, params_ = 0, steps_ = 0;
  bool overflow_ = false;  // the call being decoded has a shape whose element count overflows
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  Session(in).run();
  return 0;
}
