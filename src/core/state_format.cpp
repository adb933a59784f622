// state_format.cpp — the self-describing binary form of an OptimizerState (see
// dion3/state_format.hpp): little-endian fields, an FNV-1a hash at the end, and a parser that
// bounds-checks every read and names what it was reading when a buffer is wrong.
#include "dion3/state_format.hpp"

#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "dion3/error.hpp"

namespace dion3 {
namespace {

constexpr uint32_t kMaxDims = 8;

void require(bool ok, const std::string& message) {
  if (!ok) fail(message);
}

DType to_dtype(int32_t v, const std::string& what) {
  require(v >= static_cast<int32_t>(DType::F32) && v <= static_cast<int32_t>(DType::I64),
          what + ": dtype " + std::to_string(v) + " is not a dion3 dtype (0..5)");
  return static_cast<DType>(v);
}

constexpr char kMagic[8] = {'D', 'I', 'O', 'N', '3', 'S', 'T', '\0'};
constexpr uint32_t kFormatVersion = 1;

uint64_t fnv1a(const unsigned char* p, size_t n) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

// Appends little-endian integers and raw bytes. With out == nullptr it only counts.
class Writer {
 public:
  explicit Writer(unsigned char* out) : out_(out) {}
  template <class T>
  void integer(T v) {
    using U = std::make_unsigned_t<T>;
    U u = static_cast<U>(v);
    for (size_t i = 0; i < sizeof(T); ++i) {
      if (out_) out_[n_] = static_cast<unsigned char>(u >> (8 * i));
      ++n_;
    }
  }
  void bytes(const void* p, size_t n) {
    if (out_ && n) std::memcpy(out_ + n_, p, n);
    n_ += n;
  }
  void str(const std::string& s) {
    integer<uint32_t>(static_cast<uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }
  size_t size() const { return n_; }

 private:
  unsigned char* out_;
  size_t n_ = 0;
};

// Reads what Writer wrote; every read is bounds-checked and failures name the offset.
class Reader {
 public:
  Reader(const unsigned char* p, size_t n) : p_(p), n_(n) {}
  void need(size_t k, const char* what) {
    require(k <= n_ - pos_, std::string("state buffer is truncated while reading ") + what +
                                " at byte " + std::to_string(pos_));
  }
  template <class T>
  T integer(const char* what) {
    need(sizeof(T), what);
    std::make_unsigned_t<T> u = 0;
    for (size_t i = 0; i < sizeof(T); ++i)
      u |= static_cast<std::make_unsigned_t<T>>(p_[pos_ + i]) << (8 * i);
    pos_ += sizeof(T);
    return static_cast<T>(u);
  }
  const unsigned char* bytes(size_t k, const char* what) {
    need(k, what);
    const unsigned char* r = p_ + pos_;
    pos_ += k;
    return r;
  }
  std::string str(const char* what) {
    uint32_t len = integer<uint32_t>(what);
    const unsigned char* b = bytes(len, what);
    return std::string(reinterpret_cast<const char*>(b), len);
  }
  size_t pos() const { return pos_; }

 private:
  const unsigned char* p_;
  size_t n_;
  size_t pos_ = 0;
};

}  // namespace

std::size_t serialize_state(const OptimizerState& st, unsigned char* out) {
  Writer w(out);
  w.bytes(kMagic, sizeof kMagic);
  w.integer<uint32_t>(kFormatVersion);
  w.integer<uint32_t>(0);
  w.integer<int64_t>(st.steps);
  w.integer<int64_t>(st.skipped);
  w.integer<uint32_t>(static_cast<uint32_t>(st.params.size()));
  for (const auto& p : st.params) {
    w.str(p.name);
    w.integer<int64_t>(p.step);
    w.integer<uint32_t>(static_cast<uint32_t>(p.tensors.size()));
    for (const auto& [name, t] : p.tensors) {
      w.str(name);
      w.integer<int32_t>(static_cast<int32_t>(t.dtype));
      w.integer<uint32_t>(static_cast<uint32_t>(t.shape.size()));
      for (int64_t d : t.shape) w.integer<int64_t>(d);
      w.integer<uint64_t>(t.data.size());
      w.bytes(t.data.data(), t.data.size());
    }
  }
  size_t body = w.size();
  w.integer<uint64_t>(out ? fnv1a(out, body) : 0);
  return w.size();
}

OptimizerState parse_state(const unsigned char* buf, std::size_t size) {
  require(size >= sizeof kMagic + 8 && std::memcmp(buf, kMagic, sizeof kMagic) == 0,
          "state buffer does not start with the dion3 state magic \"DION3ST\"");
  require(size >= sizeof kMagic + 16, "state buffer is truncated");
  // The hash covers everything but its own 8 bytes: check it first, so corrupted buffers are
  // rejected with one clear message instead of a confusing field error.
  {
    Reader tail(buf + size - 8, 8);
    uint64_t stored = tail.integer<uint64_t>("hash");
    require(stored == fnv1a(buf, size - 8),
            "state buffer is corrupted or truncated (hash mismatch over " + std::to_string(size) +
                " bytes)");
  }
  Reader r(buf, size - 8);
  r.bytes(sizeof kMagic, "magic");
  uint32_t version = r.integer<uint32_t>("version");
  require(version == kFormatVersion, "state buffer has format version " + std::to_string(version) +
                                         ", this build reads version " +
                                         std::to_string(kFormatVersion));
  // Reserved for a later version's flags: a buffer that sets any is not one this build can read.
  const uint32_t reserved = r.integer<uint32_t>("reserved");
  require(reserved == 0, "state buffer's reserved field (bytes 12..15) is " + std::to_string(reserved) +
                             ", not 0; this build reads only buffers that leave it 0");
  OptimizerState st;
  st.steps = r.integer<int64_t>("steps");
  st.skipped = r.integer<int64_t>("skipped");
  require(st.steps >= 0, "state buffer's step counter 'steps' is negative (" + std::to_string(st.steps) + ")");
  require(st.skipped >= 0,
          "state buffer's step counter 'skipped' is negative (" + std::to_string(st.skipped) + ")");
  uint32_t nparams = r.integer<uint32_t>("parameter count");
  for (uint32_t i = 0; i < nparams; ++i) {
    ParamState ps;
    ps.name = r.str("parameter name");
    ps.step = r.integer<int64_t>("parameter step");
    require(ps.step >= 0, "state of parameter '" + ps.name + "' has a negative step count");
    uint32_t ntensors = r.integer<uint32_t>("tensor count");
    for (uint32_t j = 0; j < ntensors; ++j) {
      std::string tname = r.str("tensor name");
      std::string where = "state of parameter '" + ps.name + "', tensor '" + tname + "'";
      HostTensor t;
      t.dtype = to_dtype(r.integer<int32_t>("tensor dtype"), where);
      uint32_t ndim = r.integer<uint32_t>("tensor rank");
      require(ndim <= kMaxDims, where + ": rank " + std::to_string(ndim) + " is above 8");
      uint64_t numel = 1;
      for (uint32_t d = 0; d < ndim; ++d) {
        int64_t e = r.integer<int64_t>("tensor shape");
        require(e >= 0 && (e == 0 || numel <= std::numeric_limits<uint64_t>::max() / uint64_t(e)),
                where + ": invalid dimension " + std::to_string(e));
        t.shape.push_back(e);
        numel *= static_cast<uint64_t>(e);
      }
      uint64_t nbytes = r.integer<uint64_t>("tensor size");
      require(nbytes / dtype_size(t.dtype) == numel &&
                  nbytes % dtype_size(t.dtype) == 0,
              where + ": " + std::to_string(nbytes) + " bytes do not match shape " +
                  shape_string(t.shape) + " of " + dtype_name(t.dtype));
      const unsigned char* data = r.bytes(static_cast<size_t>(nbytes), "tensor data");
      t.data.assign(data, data + nbytes);
      ps.tensors.emplace_back(std::move(tname), std::move(t));
    }
    st.params.push_back(std::move(ps));
  }
  require(r.pos() == size - 8, "state buffer has " + std::to_string(size - 8 - r.pos()) +
                                   " unexpected bytes after the last parameter");
  return st;
}


}  // namespace dion3
