// tests/fuzz/fuzz_input.hpp — how the fuzz harnesses turn bytes into values, and how the seed
// generator (make_seeds.cpp) writes bytes that decode to the values it wants.
//
// One byte per value, most of the time: below a threshold it picks a typical value (an index
// into a field's normal range), above it an odd one from a fixed table (negative, huge, NaN,
// limits); doubles may also take their 8 raw bytes. An exhausted input reads as zeros, so every
// byte string is a valid program.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace fuzz {

// Odd values for int32 fields: out of every enum's range, limits, off-by-one at the C API's
// array sizes (8 dims, 16 orthogonalization steps and restarts).
inline constexpr int32_t kOddInt32[] = {
    -1, -2, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 100, 255, 256, 1000,
    65535, 65536, 1 << 20, 1 << 30, std::numeric_limits<int32_t>::max(),
    std::numeric_limits<int32_t>::max() - 1, std::numeric_limits<int32_t>::min(),
    std::numeric_limits<int32_t>::min() + 1, -100, -65536, 3, 4, 2, 1, 0, 10};
// Odd tensor dimensions: negative, too large for a buffer, and products that overflow int64.
inline constexpr int64_t kOddDim[] = {
    -1, -2, 64, 100, 1000, 4096, 65536, int64_t{1} << 31, int64_t{1} << 32, int64_t{1} << 40,
    std::numeric_limits<int64_t>::min(), -(int64_t{1} << 62), 8, 9, 16, 17,
    int64_t{1} << 62, (int64_t{1} << 62) + 1, std::numeric_limits<int64_t>::max(),
    std::numeric_limits<int64_t>::max() - 1, int64_t{1} << 61, (int64_t{1} << 61) + 3,
    int64_t{3} << 61, int64_t{1} << 59, 7, 6, 5, 4, 3, 2, 1, 0};
// Typical hyper-parameter values (index = byte % size).
inline constexpr double kTypicalDouble[] = {0.01, 0.25, 0.95, 0.9, 0.5, 0.0, 1.0, 1e-8,
                                            0.1, 0.02, 0.99, 0.125, 1e-3, 0.75, 0.3, 2.0};
inline const double kOddDouble[] = {
    std::nan(""), -std::nan(""), std::numeric_limits<double>::infinity(),
    -std::numeric_limits<double>::infinity(), -0.0, -1.0, 1e39, -1e39, 1e-50, 1e300, -1e300,
    1e-320 /* subnormal */, std::numeric_limits<double>::min(), std::numeric_limits<double>::max(),
    3.4028234663852886e38 /* FLT_MAX */, 3.5e38, 1.0 - 1e-16, 1.0 + 1e-15, 0.9999999,
    std::nextafter(1.0, 0.0), std::nextafter(0.0, 1.0), 1e20, -1e20, 1e-38, 1e-45, 65504.0, 65520.0,
    1e10, -0.5, 1.5, 1e5, 4.0};

inline constexpr size_t kOddInt32Count = sizeof kOddInt32 / sizeof kOddInt32[0];
inline constexpr size_t kOddDimCount = sizeof kOddDim / sizeof kOddDim[0];
inline constexpr size_t kTypicalDoubleCount = sizeof kTypicalDouble / sizeof kTypicalDouble[0];
inline constexpr size_t kOddDoubleCount = sizeof kOddDouble / sizeof kOddDouble[0];

// Byte thresholds of the encoding.
inline constexpr uint8_t kOddIntByte = 0xE0;      // >= : kOddInt32 / kOddDim[byte - 0xE0]
inline constexpr uint8_t kOddDoubleByte = 0xC0;   // >= : kOddDouble[byte - 0xC0]
inline constexpr uint8_t kRawDoubleByte = 0xE0;   // >= : 8 raw little-endian bytes follow

static_assert(kOddInt32Count == 0x100 - kOddIntByte && kOddDimCount == 0x100 - kOddIntByte);
static_assert(kOddDoubleCount == kRawDoubleByte - kOddDoubleByte);

class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  bool empty() const { return pos_ >= n_; }
  size_t remaining() const { return empty() ? 0 : n_ - pos_; }

  uint8_t byte() { return pos_ < n_ ? p_[pos_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(byte() | (byte() << 8)); }
  // 0 .. n-1
  unsigned pick(unsigned n) { return byte() % n; }
  bool flag() { return byte() & 1; }

  // An int32 field whose normal values are lo..hi (a range of at most 224 values).
  int32_t int_field(int32_t lo, int32_t hi) {
    const uint8_t b = byte();
    if (b >= kOddIntByte) return kOddInt32[b - kOddIntByte];
    return lo + static_cast<int32_t>(b % static_cast<uint32_t>(hi - lo + 1));
  }
  // A tensor dimension: normally 0..max_typical.
  int64_t dim(int64_t max_typical) {
    const uint8_t b = byte();
    if (b >= kOddIntByte) return kOddDim[b - kOddIntByte];
    return b % (max_typical + 1);
  }
  double real() {
    const uint8_t b = byte();
    if (b < kOddDoubleByte) return kTypicalDouble[b % kTypicalDoubleCount];
    if (b < kRawDoubleByte) return kOddDouble[b - kOddDoubleByte];
    uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits |= static_cast<uint64_t>(byte()) << (8 * i);
    double d;
    std::memcpy(&d, &bits, 8);
    return d;
  }
  // Up to max_len raw bytes (a length byte first).
  std::vector<uint8_t> bytes(size_t max_len) {
    size_t len = std::min<size_t>(u16(), max_len);
    len = std::min(len, remaining());
    std::vector<uint8_t> out(p_ + pos_, p_ + pos_ + len);
    pos_ += len;
    return out;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

// The seed generator's side: bytes that Input decodes back to the given values.
class Output {
 public:
  Output& byte(uint8_t b) {
    out_.push_back(b);
    return *this;
  }
  Output& u16(uint16_t v) { return byte(v & 0xff).byte(v >> 8); }
  Output& flag(bool v) { return byte(v ? 1 : 0); }
  // v as Input::int_field(lo, hi) reads it: typical, or one of kOddInt32.
  Output& int_field(int32_t lo, int32_t hi, int32_t v) {
    if (v >= lo && v <= hi) return byte(static_cast<uint8_t>(v - lo));
    return byte(static_cast<uint8_t>(kOddIntByte + index_of(kOddInt32, kOddInt32Count, v)));
  }
  // v as Input::dim(max_typical) reads it.
  Output& dim(int64_t max_typical, int64_t v) {
    if (v >= 0 && v <= max_typical) return byte(static_cast<uint8_t>(v));
    return byte(static_cast<uint8_t>(kOddIntByte + index_of(kOddDim, kOddDimCount, v)));
  }
  // v as Input::real() reads it: a table entry when one has the same bits, else raw.
  Output& real(double v) {
    for (size_t i = 0; i < kTypicalDoubleCount; ++i)
      if (same_bits(kTypicalDouble[i], v)) return byte(static_cast<uint8_t>(i));
    for (size_t i = 0; i < kOddDoubleCount; ++i)
      if (same_bits(kOddDouble[i], v)) return byte(static_cast<uint8_t>(kOddDoubleByte + i));
    byte(kRawDoubleByte);
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    for (int i = 0; i < 8; ++i) byte(static_cast<uint8_t>(bits >> (8 * i)));
    return *this;
  }
  Output& bytes(const std::vector<uint8_t>& b) {
    u16(static_cast<uint16_t>(b.size()));
    out_.insert(out_.end(), b.begin(), b.end());
    return *this;
  }
  const std::vector<uint8_t>& data() const { return out_; }

 private:
  template <class T>
  static size_t index_of(const T* table, size_t n, T v) {
    for (size_t i = 0; i < n; ++i)
      if (table[i] == v) return i;
    std::abort();  // the generator asked for a value the encoding cannot express
  }
  static bool same_bits(double a, double b) { return std::memcmp(&a, &b, 8) == 0; }
  std::vector<uint8_t> out_;
};

}  // namespace fuzz
