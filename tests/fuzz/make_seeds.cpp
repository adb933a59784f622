// tests/fuzz/make_seeds.cpp — writes the fuzzers' seed corpus (tests/fuzz/corpus), or checks it.
//
//   dion3-fuzz-seeds write DIR   DIR/state/*: states of the fuzz model (fuzz_model.hpp) after 0..3
//                                steps, exported and prefixed with the harness's flag byte
//                                (valid-*), broken ones (bad-*) and well-framed ones import must
//                                refuse (edge-*); DIR/capi/*: C API programs
//                                (capi_program.hpp) covering every algorithm, dtype, call and
//                                error path.
//   dion3-fuzz-seeds check DIR   every state seed named valid-* imports into the fuzz model and
//                                every bad-* is refused: the corpus still fits the format.
//
// State seeds hold the bits of CPU steps, which may differ across machines and compilers; they
// only need to be valid states, so the committed ones are not compared with a fresh run.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "capi_program.hpp"
#include "dion3/state_format.hpp"
#include "fuzz_input.hpp"
#include "fuzz_model.hpp"

namespace {

namespace fs = std::filesystem;
using namespace fuzz;

void write_file(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  check(f.good(), "cannot write " + path.string());
}

std::vector<uint8_t> read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// --- state seeds ---------------------------------------------------------------------------------
constexpr uint8_t kFixHash = 1, kStepAfter = 2;  // fuzz_state.cpp's flag bits

std::vector<uint8_t> with_flags(uint8_t flags, const std::vector<uint8_t>& state) {
  std::vector<uint8_t> out{flags};
  out.insert(out.end(), state.begin(), state.end());
  return out;
}

void write_state_seeds(const fs::path& dir) {
  for (int steps : {0, 1, 3}) {
    Model m;
    for (int t = 0; t < steps; ++t) m.step(t);
    const std::vector<uint8_t> st = export_state(m.opt());
    const std::string n = std::to_string(steps);
    write_file(dir / ("valid-after-" + n + "-steps.bin"), with_flags(0, st));
    write_file(dir / ("valid-after-" + n + "-steps-fixhash.bin"), with_flags(kFixHash, st));
    write_file(dir / ("valid-after-" + n + "-steps-then-step.bin"), with_flags(kFixHash | kStepAfter, st));
  }
  // A step skipped for a NaN gradient counts in the state too.
  {
    Model m(DION3_NONFINITE_SKIP);
    m.step(7);
    m.fill_grads(8);
    m.poison_grad();
    check(dion3_step(m.opt(), nullptr) == DION3_OK, "a skipped step failed");
    dion3_set_lr(m.opt(), 0, 0.02);
    m.step(9);
    write_file(dir / "valid-after-2-steps-1-skipped.bin", with_flags(kFixHash | kStepAfter, export_state(m.opt())));
  }
  Model m;
  m.step(1);
  const std::vector<uint8_t> st = export_state(m.opt());
  std::vector<uint8_t> b = st;
  b[0] = 'X';
  write_file(dir / "bad-magic.bin", with_flags(0, b));
  b = st;
  b[8] = 2;  // version 2
  write_file(dir / "bad-version.bin", with_flags(kFixHash, b));
  b = st;
  b[b.size() / 2] ^= 0x40;
  write_file(dir / "bad-hash.bin", with_flags(0, b));
  b.assign(st.begin(), st.begin() + static_cast<std::ptrdiff_t>(st.size() / 2));
  write_file(dir / "bad-truncated.bin", with_flags(kFixHash, b));
  b = st;
  b.insert(b.end() - 8, {0, 0, 0, 0});
  write_file(dir / "bad-trailing-bytes.bin", with_flags(kFixHash, b));
  b = st;
  b[32] = 5;  // parameter count 5 of 6
  write_file(dir / "bad-parameter-count.bin", with_flags(kFixHash, b));
  b = st;
  b[36 + 4] = 'A';  // the first parameter's name ("attn.w" -> "Attn.w")
  write_file(dir / "bad-parameter-name.bin", with_flags(kFixHash, b));
  write_file(dir / "bad-empty.bin", with_flags(0, {}));
  auto reserialized = [&](uint8_t flags, auto&& edit) {
    dion3::OptimizerState parsed = dion3::parse_state(st.data(), st.size());
    edit(parsed);
    std::vector<uint8_t> out(dion3::serialize_state(parsed, nullptr));
    dion3::serialize_state(parsed, out.data());
    return with_flags(flags, out);
  };
  write_file(dir / "bad-missing-tensor.bin",
             reserialized(kFixHash, [](dion3::OptimizerState& p) { p.params[0].tensors.pop_back(); }));
  write_file(dir / "bad-tensor-dtype.bin", reserialized(kFixHash, [](dion3::OptimizerState& p) {
               auto& t = p.params[0].tensors[0].second;  // fp32 momentum as int32: same bytes
               t.dtype = dion3::DType::I32;
             }));
  write_file(dir / "bad-tensor-shape.bin", reserialized(kFixHash, [](dion3::OptimizerState& p) {
               auto& t = p.params[0].tensors[0].second;  // [6, 4] as [4, 6]: same bytes
               std::swap(t.shape[0], t.shape[1]);
             }));
  write_file(dir / "bad-parameter-step.bin", reserialized(kFixHash, [](dion3::OptimizerState& p) {
               p.params[1].step = p.steps + 1;  // more updates than the optimizer's steps
             }));

  // Well-framed states a step cannot use, which import refuses (the strict checks
  // DION3_FUZZ_STRICT=state_reserved,state_values,state_step hold it to that): regression seeds.
  auto edited = [&](auto&& edit) { return reserialized(kFixHash | kStepAfter, edit); };
  auto first_float = [](dion3::OptimizerState& p, const char* tensor) -> unsigned char* {
    for (auto& [name, t] : p.params[0].tensors)
      if (name == tensor) return t.data.data();
    die(std::string("the fuzz model has no ") + tensor);
  };
  auto put_float = [](unsigned char* at, float v) { std::memcpy(at, &v, 4); };
  b = with_flags(kFixHash | kStepAfter, st);
  b[1 + 12] = 1;  // the reserved u32
  write_file(dir / "edge-reserved-nonzero.bin", b);
  write_file(dir / "edge-nan-momentum.bin",
             edited([&](dion3::OptimizerState& p) { put_float(first_float(p, "momentum"), NAN); }));
  write_file(dir / "edge-negative-variance.bin",
             edited([&](dion3::OptimizerState& p) { put_float(first_float(p, "variance"), -1.0f); }));
  write_file(dir / "edge-steps-int64-max.bin", edited([](dion3::OptimizerState& p) {
               p.steps = std::numeric_limits<int64_t>::max();
               for (auto& param : p.params) param.step = p.steps;
             }));
}

// --- C API programs ------------------------------------------------------------------------------
struct Tensor {
  std::vector<int64_t> shape;
  int32_t dtype = DION3_F32;
  int32_t device = DION3_DEVICE_CPU;
  DataMode mode = kDataOwn;
  uint8_t alias = 0;
  FillKind fill = kFillNoise;
  uint8_t seed = 1;
  int32_t ndim = -100;  // -100: shape.size()
};

struct Grad {
  GradMode mode = kGradOwn;
  FillKind fill = kFillNoise;
  uint8_t seed = 2;
  Tensor spec;      // kGradSpec
  uint8_t alias = 0;  // kGradAlias
};

// A config edit: field and value (ints and doubles; kOrthCustom and kOrthRestart take a slot).
struct Edit {
  ConfigField field;
  double value;
  unsigned slot = 0, coefficient = 0;
};

class Program {
 public:
  explicit Program(int policy = DION3_NONFINITE_RAISE, int device = DION3_DEVICE_CPU) {
    o_.int_field(0, 0, device).int_field(0, 1, policy);
  }
  const std::vector<uint8_t>& bytes() const { return o_.data(); }

  Program& create(int device, int policy, bool out_null = false) {
    op(kCreate).int_field(0, 0, device).int_field(0, 1, policy).flag(out_null);
    return *this;
  }
  Program& add_group(std::initializer_list<Edit> edits = {}, bool cfg_null = false) {
    op(kAddGroup).flag(cfg_null);
    config(edits);
    o_.flag(false);
    return *this;
  }
  Program& set_group_config(int group, std::initializer_list<Edit> edits, bool from_current = true) {
    op(kSetGroupConfig).int_field(0, 7, group).flag(false).flag(from_current);
    config(edits);
    return *this;
  }
  Program& set_lr(int group, double lr) {
    op(kSetLr).int_field(0, 7, group).real(lr);
    return *this;
  }
  Program& add_param(int group, unsigned name, const Tensor& w, const Grad& g = {}, LayoutMode layout = kLayoutNone,
                     int32_t kind = 0, int64_t rows = 0, int64_t cols = 0) {
    op(kAddParam).int_field(0, 7, group).byte(static_cast<uint8_t>(name));
    tensor(w);
    grad(g);
    o_.byte(layout);
    if (layout == kLayoutStruct) o_.int_field(0, 4, kind).dim(6, rows).dim(6, cols);
    o_.flag(false);
    return *this;
  }
  Program& set_grad(int param, const Grad& g) {
    op(kSetGrad).int_field(0, 7, param);
    grad(g);
    return *this;
  }
  Program& fill(uint8_t buffer, FillKind kind, uint8_t seed) {
    op(kFill).byte(buffer).byte(kind).byte(seed);
    return *this;
  }
  Program& step(int times = 1) {
    for (int i = 0; i < times; ++i) op(kStep).flag(false);
    return *this;
  }
  // export mode: 0 exact, 1 one byte short, 2 16 bytes spare, 3 NULL buffer; import mode: 0
  // exact, 1 one byte short, 2 one byte more.
  Program& export_import(unsigned export_mode = 0, unsigned import_mode = 0) {
    op(kExportImport).byte(static_cast<uint8_t>(export_mode)).byte(static_cast<uint8_t>(import_mode));
    return *this;
  }
  Program& import_mutated(std::initializer_list<std::pair<uint16_t, uint8_t>> changes, bool fix_hash) {
    op(kImportMutated).byte(static_cast<uint8_t>(changes.size()));
    for (const auto& [at, v] : changes) o_.u16(at).byte(v);
    o_.flag(fix_hash);
    return *this;
  }
  Program& import_raw(const std::vector<uint8_t>& raw, bool null = false) {
    op(kImportRaw).bytes(raw).flag(null);
    return *this;
  }
  Program& plan(unsigned mode = 2, bool count_null = false) {
    op(kPlan).byte(static_cast<uint8_t>(mode)).flag(count_null);
    return *this;
  }
  Program& get_group_config(int group, bool out_null = false) {
    op(kGetGroupConfig).int_field(0, 7, group).flag(out_null);
    return *this;
  }
  Program& queries() {
    op(kQueries);
    return *this;
  }
  Program& destroy() {
    op(kDestroy);
    return *this;
  }
  Program& misc(int status, double timeout) {
    op(kMisc).int_field(0, 4, status).real(timeout);
    return *this;
  }

 private:
  Output& op(Op o) { return o_.byte(o); }
  void config(std::initializer_list<Edit> edits) {
    check(edits.size() < kMaxEdits, "too many edits for one config");
    o_.byte(static_cast<uint8_t>(edits.size()));
    for (const Edit& e : edits) {
      o_.byte(e.field);
      // Only integer fields use it (a double field may hold NaN or 1e39).
      const auto i = std::fabs(e.value) < 1e9 ? static_cast<int32_t>(e.value) : 0;
      switch (e.field) {
        case kAlgorithm: o_.int_field(0, 5, i); break;
        case kAdjustLr: o_.int_field(0, 2, i); break;
        case kFlatten:
        case kNesterov:
        case kCautiousWd:
        case kScaleLrByFraction:
        case kSelectionScope:
        case kTransposed: o_.int_field(0, 1, i); break;
        case kMomentumDtype:
        case kOrthIterDtype: o_.int_field(-1, 2, i); break;
        case kOrthMethod:
        case kOrthCoefficients: o_.int_field(0, 2, i); break;
        case kOrthNumCustom: o_.int_field(1, 16, i); break;
        case kOrthCustom: o_.byte(static_cast<uint8_t>(e.slot)).byte(static_cast<uint8_t>(e.coefficient)).real(e.value); break;
        case kOrthNumRestarts: o_.int_field(0, 4, i); break;
        case kOrthRestart: o_.byte(static_cast<uint8_t>(e.slot)).int_field(0, 6, i); break;
        default: o_.real(e.value); break;
      }
    }
  }
  void tensor(const Tensor& t) {
    const int32_t ndim = t.ndim == -100 ? static_cast<int32_t>(t.shape.size()) : t.ndim;
    o_.int_field(0, 4, ndim);
    for (int64_t d : t.shape) o_.dim(6, d);
    o_.int_field(0, 2, t.dtype).int_field(0, 0, t.device).byte(t.mode);
    if (t.mode == kDataAlias) o_.byte(t.alias);
    o_.byte(t.fill).byte(t.seed);
  }
  void grad(const Grad& g) {
    o_.byte(g.mode);
    if (g.mode == kGradSpec) tensor(g.spec);
    if (g.mode == kGradAlias) o_.byte(g.alias);
    if (g.mode == kGradOwn) o_.byte(g.fill).byte(g.seed);
  }
  Output o_;
};

Tensor T(std::vector<int64_t> shape, int32_t dtype = DION3_F32) {
  Tensor t;
  t.shape = std::move(shape);
  t.dtype = dtype;
  return t;
}

Grad mode_grad(GradMode mode) {
  Grad g;
  g.mode = mode;
  return g;
}
Grad own_grad(FillKind fill, uint8_t seed) {
  Grad g;
  g.fill = fill;
  g.seed = seed;
  return g;
}
Grad spec_grad(Tensor t) {
  Grad g;
  g.mode = kGradSpec;
  g.spec = std::move(t);
  return g;
}
Grad alias_grad(uint8_t buffer) {
  Grad g;
  g.mode = kGradAlias;
  g.alias = buffer;
  return g;
}

// The name picks of fuzz_capi.cpp: NULL, "", "w0".."w3", a long name, odd bytes.
constexpr unsigned kNull = 0, kEmpty = 1, kW0 = 2, kW1 = 3, kW2 = 4, kW3 = 5, kLong = 6, kOdd = 7;

void write_capi_seeds(const fs::path& dir) {
  auto put = [&](const char* name, const Program& p) { write_file(dir / (std::string(name) + ".bin"), p.bytes()); };
  const Edit dion3{kAlgorithm, DION3_ALGO_DION3}, normuon{kAlgorithm, DION3_ALGO_NORMUON},
      muon{kAlgorithm, DION3_ALGO_MUON}, adamw{kAlgorithm, DION3_ALGO_ADAMW}, lion{kAlgorithm, DION3_ALGO_LION};

  put("dion3-f32", Program().add_group({dion3, {kFraction, 0.5}}).add_param(0, kW0, T({6, 4}))
                       .step(2).export_import().plan().queries());
  put("normuon-f16-batch", Program().add_group({normuon}).add_param(0, kW0, T({2, 3, 4}, DION3_F16))
                               .step(2).export_import());
  put("muon-bf16-fp32-momentum", Program().add_group({muon, {kNesterov, 1}, {kMomentumDtype, DION3_F32}})
                                     .add_param(0, kW0, T({5, 3}, DION3_BF16)).step(2).export_import());
  put("adamw-vectors", Program().add_group({adamw}).add_param(0, kW0, T({7})).add_param(0, kW1, T({3, 2}, DION3_BF16))
                           .step(3).export_import());
  put("lion-f16", Program().add_group({lion, {kBeta0, 0.95}, {kBeta1, 0.99}}).add_param(0, kW0, T({4}, DION3_F16)).step(2));
  put("all-algorithms",
      Program().add_group({dion3}).add_group({normuon}).add_group({muon}).add_group({adamw}).add_group({lion})
          .add_param(0, kW0, T({6, 4})).add_param(1, kW1, T({2, 3, 4}, DION3_F16)).add_param(2, kW2, T({5, 3}, DION3_BF16))
          .add_param(3, kW3, T({7})).add_param(4, kLong, T({4}, DION3_F16))
          .step(2).export_import().import_mutated({{40, 0x7f}, {100, 0xff}}, true).plan().get_group_config(0)
          .set_lr(0, 0.02).step().queries());
  put("gram-custom-coefficients",
      Program().add_group({dion3, {kOrthMethod, DION3_ORTH_GRAM}, {kOrthCoefficients, DION3_COEFF_CUSTOM},
                           {kOrthNumCustom, 3}, {kOrthNumRestarts, 1}})
          .set_group_config(0, {{kOrthCustom, 3.4445, 0, 0}, {kOrthCustom, -4.775, 0, 1}, {kOrthCustom, 2.0315, 0, 2},
                                {kOrthRestart, 1, 0}})
          .add_param(0, kW0, T({8, 6})).step(3));
  put("standard-bf16-iteration-flatten",
      Program().add_group({dion3, {kOrthMethod, DION3_ORTH_STANDARD}, {kOrthIterDtype, DION3_BF16},
                           {kAdjustLr, DION3_ADJUST_LR_RMS_NORM}, {kFlatten, 1}})
          .add_param(0, kW0, T({3, 2, 2})).step(2).plan());
  put("wide-and-tall", Program().add_group({dion3, {kScaleLrByFraction, 1}, {kCautiousWd, 1}})
                           .add_param(0, kW0, T({3, 6})).add_param(0, kW1, T({6, 3})).add_param(0, kW2, T({6, 3}))
                           .step(2).plan());
  put("transposed-in-out", Program().add_group({dion3, {kTransposed, 1}, {kCautiousWd, 1}})
                               .add_param(0, kW0, T({3, 6})).add_param(0, kW1, T({2, 6, 3})).step(2).plan());
  put("nonfinite-raise", Program().add_group({adamw}).add_param(0, kW0, T({5})).fill(1, kFillNaN, 3).step()
                             .fill(1, kFillNoise, 4).step().queries());
  put("nonfinite-skip", Program(DION3_NONFINITE_SKIP).add_group({dion3}).add_param(0, kW0, T({4, 4}))
                            .fill(1, kFillInf, 5).step().fill(1, kFillNoise, 6).step().queries());
  {
    Tensor cuda = T({4, 4});
    cuda.device = DION3_DEVICE_CUDA;
    Tensor null_data = T({4, 4});
    null_data.mode = kDataNull;
    Tensor nine = T({1, 1, 1, 1, 1, 1, 1, 1});
    nine.ndim = 9;
    put("bad-parameters", Program().add_group({dion3})
                              .add_param(0, kW0, T({4}))               // 1-D in a Dion3 group
                              .add_param(0, kW0, T({4, 4}, DION3_I32)) // not a float dtype
                              .add_param(0, kW0, nine).add_param(0, kW0, T({-1, 4})).add_param(0, kNull, T({4, 4}))
                              .add_param(0, kW0, null_data).add_param(7, kW0, T({4, 4})).add_param(0, kW0, cuda)
                              .add_param(0, kW0, T({4, 0})).add_param(0, kW0, T({4, 4}), spec_grad(T({4, 3})))
                              .step());
  }
  put("bad-configs", Program().add_group({{kLr, std::nan("")}}).add_group({{kEpsilon, 0.0}}).add_group({{kFraction, 0.0}})
                         .add_group({{kFraction, 1.5}}).add_group({{kMu, 1.0}}).add_group({adamw, {kBeta1, 1.0}})
                         .add_group({{kOrthCoefficients, DION3_COEFF_CUSTOM}, {kOrthNumCustom, 17}})
                         .add_group({{kOrthRestart, 5, 0}}).add_group({{kMomentumDtype, DION3_I32}})
                         .add_group({{kSelectionScope, 2}}).add_group({{kAlgorithm, 6}}).add_group({}, true)
                         .add_group({}).add_param(0, kW0, T({3, 3}))
                         .set_group_config(0, {adamw}).set_lr(0, -1.0).set_lr(0, INFINITY).set_lr(9, 0.1)
                         .set_group_config(0, {{kWeightDecay, -1.0}}).step());
  put("set-grad", Program().add_group({muon}).add_param(0, kW0, T({4, 3}), mode_grad(kGradNull)).step()
                      .set_grad(0, own_grad(kFillNoise, 9)).step()
                      .set_grad(0, spec_grad(T({3, 4}))).set_grad(0, mode_grad(kGradIsWeight))
                      .set_grad(3, mode_grad(kGradOwn)).step());
  {
    Tensor shared = T({4, 4});
    shared.mode = kDataAlias;
    put("aliasing", Program().add_group({normuon}).add_param(0, kW0, T({4, 4}))
                        .add_param(0, kW1, shared, alias_grad(1))
                        .add_param(0, kW0, T({4, 4}), mode_grad(kGradIsWeight)).step(2));
  }
  put("empty-tensors", Program().add_group({adamw}).add_group({dion3}).add_param(0, kW0, T({0}))
                           .add_param(0, kW1, T({2, 0, 3})).add_param(1, kW2, T({0, 4})).add_param(1, kW3, T({3, 0}))
                           .add_param(0, kEmpty, T({})).step(2).export_import());
  put("export-import-sizes", Program().add_group({lion}).add_param(0, kW0, T({6})).step()
                                 .export_import(1, 0).export_import(2, 0).export_import(3, 0)
                                 .export_import(0, 1).export_import(0, 2).export_import(0, 0));
  put("import-garbage", Program().add_group({adamw}).add_param(0, kW0, T({3}))
                            .import_raw({'D', 'I', 'O', 'N', '3', 'S', 'T', 0, 1, 0, 0, 0})
                            .import_raw({1, 2, 3}, true).import_raw({})
                            .import_mutated({{9, 0}}, false).import_mutated({{30, 1}, {31, 2}}, true));
  put("destroyed", Program().add_group({dion3}).add_param(0, kW0, T({2, 2})).destroy().add_group({})
                       .add_param(0, kW0, T({2, 2})).step().queries().export_import().plan().get_group_config(0)
                       .set_lr(0, 0.1).misc(1, 0.0));
  put("layouts", Program().add_group({dion3})
                     .add_param(0, kW0, T({4, 4}), Grad{}, kLayoutNull)
                     .add_param(0, kW1, T({4, 4}), Grad{}, kLayoutStruct, 0, 4, 4)
                     .add_param(0, kW2, T({2, 4}), Grad{}, kLayoutStruct, 2, 4, 4)
                     .add_param(0, kW3, T({4, 2}), Grad{}, kLayoutStruct, 4, 4, 4).step());
  put("names", Program().add_group({adamw}).add_param(0, kLong, T({2})).add_param(0, kEmpty, T({2}))
                   .add_param(0, kOdd, T({2})).add_param(0, kW0, T({2})).add_param(0, kW0, T({2})).step().export_import());
  put("create", Program().create(DION3_DEVICE_CUDA, 0).create(0, 2).create(0, 0, true).create(0, 1).add_group({lion})
                    .add_param(0, kW0, T({3})).step().misc(7, -1.0).misc(0, 1e300));
  put("huge-gradients-then-mu-0",
      Program().add_group({dion3}).add_param(0, kW0, T({4, 4}), own_grad(kFillHuge, 1)).step(2)
          .set_group_config(0, {{kMu, 0.0}}).step().plan());
  put("large-values", Program().add_group({normuon, {kLr, 1e39}}).add_group({adamw, {kEpsilon, 1e-50}})
                          .add_param(1, kW1, T({5}), own_grad(kFillVeryLarge, 3))
                          .add_param(0, kW0, T({3, 5}, DION3_BF16), own_grad(kFillTiny, 4)).step(2));
  // A finite step that leaves fp16's range (lr·λ far above 1): not judged by "finite_steps".
  put("overflowing-step", Program().add_group({normuon, {kLr, 3.4028234663852886e38}})
                              .add_param(0, kW0, T({3, 5}, DION3_F16)).step());
  {
    Tensor big = T({4096, 4096});  // more than the harness backs: skipped
    Tensor wraps = T({4, 4});      // [2^62+1, 2, 2]: wraps to 4 elements
    wraps.shape = {(int64_t{1} << 62) + 1, 2, 2};
    put("large-shapes", Program().add_group({adamw}).add_param(0, kW0, big).add_param(0, kW1, wraps)
                            .add_param(0, kW2, T({3})).step());
  }
}

int check_state_seeds(const fs::path& dir) {
  int failures = 0, checked = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool valid = name.rfind("valid-", 0) == 0, bad = name.rfind("bad-", 0) == 0;
    if (!valid && !bad) continue;
    std::vector<uint8_t> data = read_file(entry.path());
    std::vector<uint8_t> buf(data.begin() + (data.empty() ? 0 : 1), data.end());
    if (!data.empty() && (data[0] & kFixHash)) fix_hash(buf);
    Model m;
    const dion3_status s = dion3_import_state(m.opt(), buf.data(), buf.size());
    ++checked;
    if ((s == DION3_OK) != valid) {
      std::fprintf(stderr, "%s: import returned %d (%s), expected %s\n", entry.path().c_str(), s, dion3_last_error(),
                   valid ? "success" : "an error");
      ++failures;
    }
  }
  std::printf("%d state seeds checked, %d wrong\n", checked, failures);
  return failures == 0 && checked > 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode != "write" && mode != "check") {
    std::fprintf(stderr, "usage: %s write|check CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path dir = argv[2];
  if (mode == "check") return check_state_seeds(dir / "state");
  fs::create_directories(dir / "state");
  fs::create_directories(dir / "capi");
  write_state_seeds(dir / "state");
  write_capi_seeds(dir / "capi");
  return 0;
}
