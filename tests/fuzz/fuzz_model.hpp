// tests/fuzz/fuzz_model.hpp — the small optimizer the state fuzzer imports into, and that the
// seed generator steps and exports: every algorithm and every parameter dtype, a batch of
// matrices, state dtypes that differ from the weight's. Built through the C API.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_numeric.hpp"
#include "dion3/dion3.h"
#include "dion3/optimizer.hpp"

namespace fuzz {

// Aborts with a message: libFuzzer reports the abort as a crash and saves the input.
[[noreturn]] inline void die(const std::string& what) {
  std::fprintf(stderr, "fuzz check failed: %s\n", what.c_str());
  std::abort();
}
inline void check(bool ok, const std::string& what) {
  if (!ok) die(what);
}

// Checks of defects that are known and being fixed (docs/testing.md lists them): off in the
// committed run so that it passes today, on with DION3_FUZZ_STRICT=name,name,... or =all.
inline bool strict(const char* name) {
  static const std::string list = [] {
    const char* e = std::getenv("DION3_FUZZ_STRICT");
    return "," + std::string(e ? e : "") + ",";
  }();
  return list == ",all," || list.find("," + std::string(name) + ",") != std::string::npos;
}

inline size_t dtype_bytes(int32_t dtype) {
  switch (dtype) {
    case DION3_F16:
    case DION3_BF16: return 2;
    case DION3_F64:
    case DION3_I64: return 8;
    default: return 4;
  }
}

// Writes v into element i of a buffer of a float dtype (rounded to nearest even).
inline void store(unsigned char* base, int32_t dtype, int64_t i, float v) {
  if (dtype == DION3_F32) {
    std::memcpy(base + 4 * i, &v, 4);
  } else if (dtype == DION3_F16 || dtype == DION3_BF16) {
    const uint16_t h = dtype == DION3_F16 ? dion3::cpu::float_to_f16(v) : dion3::cpu::float_to_bf16(v);
    std::memcpy(base + 2 * i, &h, 2);
  }
}

// Element i of a buffer of a float dtype (0 for other dtypes).
inline float load(const unsigned char* base, int32_t dtype, int64_t i) {
  float v = 0;
  uint16_t h;
  switch (dtype) {
    case DION3_F32: std::memcpy(&v, base + 4 * i, 4); break;
    case DION3_F16: std::memcpy(&h, base + 2 * i, 2); v = dion3::cpu::f16_to_float(h); break;
    case DION3_BF16: std::memcpy(&h, base + 2 * i, 2); v = dion3::cpu::bf16_to_float(h); break;
    default: break;
  }
  return v;
}

// Whether every state tensor holds finite values, and second moments none below zero.
inline bool sane_values(const dion3::OptimizerState& st) {
  for (const dion3::ParamState& p : st.params)
    for (const auto& [name, t] : p.tensors) {
      const bool second_moment = name == "variance" || name == "exp_avg_sq";
      const auto dtype = static_cast<int32_t>(t.dtype);
      const auto n = static_cast<int64_t>(t.data.size() / dion3::dtype_size(t.dtype));
      for (int64_t i = 0; i < n; ++i) {
        const float v = load(t.data.data(), dtype, i);
        if (!std::isfinite(v) || (second_moment && v < 0)) return false;
      }
    }
  return true;
}

// Deterministic values in [-1, 1).
inline float noise(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return static_cast<float>((s >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

// FNV-1a over the body: the hash dion3's state format ends with.
inline uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
inline void fix_hash(std::vector<uint8_t>& buf) {
  if (buf.size() < 8) return;
  const uint64_t h = fnv1a(buf.data(), buf.size() - 8);
  for (int i = 0; i < 8; ++i) buf[buf.size() - 8 + i] = static_cast<uint8_t>(h >> (8 * i));
}

inline std::vector<uint8_t> export_state(const dion3_optimizer* opt) {
  size_t n = 0;
  check(dion3_export_size(opt, &n) == DION3_OK, "dion3_export_size failed");
  std::vector<uint8_t> buf(n);
  size_t written = 0;
  check(dion3_export_state(opt, buf.data(), buf.size(), &written) == DION3_OK && written == n,
        "dion3_export_state failed");
  return buf;
}

class Model {
 public:
  struct Param {
    const char* name;
    int group;
    int32_t dtype;
    std::vector<int64_t> shape;
    std::vector<unsigned char> weight, grad;
  };

  explicit Model(int on_nonfinite = DION3_NONFINITE_SKIP) {
    check(dion3_create(&opt_, DION3_DEVICE_CPU, 0, nullptr, on_nonfinite) == DION3_OK, "dion3_create failed");
    dion3_group_config c;
    dion3_group_config_default(&c);
    c.fraction = 0.5;
    add_group(c);  // 0: Dion3
    c.algorithm = DION3_ALGO_NORMUON;
    add_group(c);  // 1: NorMuon
    c.algorithm = DION3_ALGO_MUON;
    c.momentum_dtype = DION3_F32;
    c.nesterov = 1;
    add_group(c);  // 2: Muon, fp32 momentum for bf16 weights
    dion3_group_config_default(&c);
    c.algorithm = DION3_ALGO_ADAMW;
    add_group(c);  // 3: AdamW
    c.algorithm = DION3_ALGO_LION;
    add_group(c);  // 4: Lion
    params_.push_back({"attn.w", 0, DION3_F32, {6, 4}, {}, {}});
    params_.push_back({"mlp.w", 1, DION3_F16, {2, 3, 4}, {}, {}});  // a batch of two 3x4 matrices
    params_.push_back({"proj.w", 2, DION3_BF16, {5, 3}, {}, {}});
    params_.push_back({"ln.b", 3, DION3_F32, {7}, {}, {}});
    params_.push_back({"emb", 3, DION3_BF16, {3, 2}, {}, {}});
    params_.push_back({"head.b", 4, DION3_F16, {4}, {}, {}});
    uint64_t seed = 0x5EED;
    for (Param& p : params_) {
      const size_t bytes = numel(p) * dtype_bytes(p.dtype);
      p.weight.assign(bytes, 0);
      p.grad.assign(bytes, 0);
      for (int64_t i = 0; i < numel(p); ++i) store(p.weight.data(), p.dtype, i, 0.5f * noise(seed));
      dion3_tensor w = tensor(p, p.weight), g = tensor(p, p.grad);
      check(dion3_add_param(opt_, p.group, p.name, &w, &g, nullptr) == DION3_OK, "dion3_add_param failed");
    }
  }
  ~Model() { dion3_destroy(opt_); }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  dion3_optimizer* opt() { return opt_; }
  // New finite gradients (different for every seed).
  void fill_grads(uint64_t seed) {
    seed = seed * 0x9E3779B97F4A7C15ull + 1;
    for (Param& p : params_)
      for (int64_t i = 0; i < numel(p); ++i) store(p.grad.data(), p.dtype, i, noise(seed));
  }
  // A NaN in the first gradient: the next step is skipped (or raises).
  void poison_grad() { store(params_[0].grad.data(), params_[0].dtype, 0, NAN); }
  void step(uint64_t seed) {
    fill_grads(seed);
    check(dion3_step(opt_, nullptr) == DION3_OK, "dion3_step failed");
  }

 private:
  static int64_t numel(const Param& p) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    return n;
  }
  static dion3_tensor tensor(const Param& p, std::vector<unsigned char>& data) {
    dion3_tensor t{};
    t.data = data.data();
    t.dtype = p.dtype;
    t.device = DION3_DEVICE_CPU;
    t.ndim = static_cast<int32_t>(p.shape.size());
    for (size_t d = 0; d < p.shape.size(); ++d) t.shape[d] = p.shape[d];
    return t;
  }
  void add_group(const dion3_group_config& c) {
    check(dion3_add_group(opt_, &c, nullptr) == DION3_OK, "dion3_add_group failed");
  }

  dion3_optimizer* opt_ = nullptr;
  std::vector<Param> params_;
};

}  // namespace fuzz
