// cpu_numeric.hpp — the CPU backend's one dtype-dispatch place.
//
// Every CPU operation computes in fp32 (double for reductions) and touches memory only through
// load_row / store_row / load_matrix / store_matrix below, which convert to and from the
// storage dtype with round-to-nearest-even. Storing to float16 or bfloat16 is therefore how
// the CPU backend emulates a half-precision iteration dtype (each primitive's output rounded,
// fp32 accumulation inside it, as on tensor cores).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "dion3/error.hpp"
#include "dion3/view.hpp"

namespace dion3::cpu {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu))  // NaN stays NaN
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

#ifdef __FLT16_MAX__
inline float f16_to_float(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

inline uint16_t float_to_f16(float f) {
  _Float16 v = static_cast<_Float16>(f);  // IEEE round to nearest even
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}
#else
// Compilers without _Float16 on this target (clang before 15 on x86-64, used by the sanitizer
// and fuzzing builds): the same IEEE conversions in integer arithmetic, bit for bit.
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u);  // NaN comes out quiet
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {
    const float v = static_cast<float>(mant) * 0x1p-24f;  // zero or subnormal: exact in fp32
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  // Round to nearest even: drop `shift` low bits of the 24-bit significand.
  auto round_shift = [](uint32_t sig, uint32_t shift) {
    const uint32_t r = sig >> shift, rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return r + ((rem > half || (rem == half && (r & 1u))) ? 1u : 0u);
  };
  const uint32_t e = abs >> 23, sig = (abs & 0x7fffffu) | 0x800000u;
  if (e >= 113) return static_cast<uint16_t>(sign | round_shift((e - 112) << 23 | (sig & 0x7fffffu), 13));
  if (e < 102) return sign;  // below half the smallest subnormal (2^-25): zero
  return static_cast<uint16_t>(sign | round_shift(sig, 126 - e));  // subnormal (or the smallest normal)
}
#endif

// Rounds a float to what `t` can hold (identity for fp32).
inline float round_to(DType t, float f) {
  switch (t) {
    case DType::F16: return f16_to_float(float_to_f16(f));
    case DType::BF16: return bf16_to_float(float_to_bf16(f));
    default: return f;
  }
}

inline const char* elem_ptr(const MatrixView& v, int64_t b, int64_t r) {
  return static_cast<const char*>(v.data) +
         static_cast<std::size_t>(b * v.batch_stride + r * v.ld) * v.elem_bytes();
}

// Reads row r of matrix b as floats into dst[0..cols).
inline void load_row(const MatrixView& v, int64_t b, int64_t r, float* dst) {
  const int64_t n = v.cols;
  if (n == 0) return;  // an empty column shard's view may have no data at all
  const char* p = elem_ptr(v, b, r);
  switch (v.dtype) {
    case DType::F32: std::memcpy(dst, p, n * 4); return;
    case DType::F16: {
      auto* s = reinterpret_cast<const uint16_t*>(p);
      for (int64_t j = 0; j < n; ++j) dst[j] = f16_to_float(s[j]);
      return;
    }
    case DType::BF16: {
      auto* s = reinterpret_cast<const uint16_t*>(p);
      for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_float(s[j]);
      return;
    }
    case DType::F64: {
      auto* s = reinterpret_cast<const double*>(p);
      for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(s[j]);
      return;
    }
    default: fail(std::string("the CPU backend cannot read ") + dtype_name(v.dtype) + " matrices");
  }
}

// Writes src[0..cols) into row r of matrix b, rounding to the view's dtype.
inline void store_row(const MatrixView& v, int64_t b, int64_t r, const float* src) {
  const int64_t n = v.cols;
  if (n == 0) return;
  char* p = const_cast<char*>(elem_ptr(v, b, r));
  switch (v.dtype) {
    case DType::F32: std::memcpy(p, src, n * 4); return;
    case DType::F16: {
      auto* d = reinterpret_cast<uint16_t*>(p);
      for (int64_t j = 0; j < n; ++j) d[j] = float_to_f16(src[j]);
      return;
    }
    case DType::BF16: {
      auto* d = reinterpret_cast<uint16_t*>(p);
      for (int64_t j = 0; j < n; ++j) d[j] = float_to_bf16(src[j]);
      return;
    }
    case DType::F64: {
      auto* d = reinterpret_cast<double*>(p);
      for (int64_t j = 0; j < n; ++j) d[j] = src[j];
      return;
    }
    default: fail(std::string("the CPU backend cannot write ") + dtype_name(v.dtype) + " matrices");
  }
}

// Matrix b as a dense rows x cols fp32 array (a std::vector of float, any allocator).
template <class Floats>
void load_matrix(const MatrixView& v, int64_t b, Floats& dst) {
  dst.resize(static_cast<std::size_t>(v.rows * v.cols));
  for (int64_t r = 0; r < v.rows; ++r) load_row(v, b, r, dst.data() + r * v.cols);
}

inline void store_matrix(const MatrixView& v, int64_t b, const float* src) {
  for (int64_t r = 0; r < v.rows; ++r) store_row(v, b, r, src + r * v.cols);
}

}  // namespace dion3::cpu
