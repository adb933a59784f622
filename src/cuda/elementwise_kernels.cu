// elementwise_kernels.cu — memory-bound kernels of the CUDA backend: Frobenius normalisation
// (deterministic two-pass reduction, or one pass over the matrix from its rows' sums of squares
// as gather_rows gives them), batched transpose with dtype conversion, multi-tensor fused AdamW and
// Lion, and the helpers of the symmetric products (scaled-add prologue, mirror of the lower
// triangle with a diagonal shift).
#include <algorithm>
#include <bit>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda/kernels.cuh"

namespace dion3::cuda {
namespace {

constexpr int kNormBlocks = 128;  // partial sums per matrix (fixed: results are reproducible)

template <class T>
__global__ void sumsq_partial_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                     int64_t bstride, float* __restrict__ partial) {
  __shared__ float red[32];
  const int64_t b = blockIdx.y;
  const T* xb = x + b * bstride;
  const int64_t total = rows * cols;
  float acc = 0.0f;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = to_f32(xb[(e / cols) * ld + e % cols]);
    acc += v * v;
  }
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[b * gridDim.x + blockIdx.x] = acc;
}

// Matrix b's sum of squares from its rows' (row_sumsq[b*rows ...], gather_rows') as
// kRowSumParts partial sums, each block's in a fixed order. Several blocks per matrix: the
// transpose waits for this kernel, and one block would walk the sums one load after another.
constexpr int kRowSumParts = 32;
__global__ void sum_row_sumsq_kernel(const float* __restrict__ row_sumsq, int64_t rows, float* __restrict__ partial) {
  pdl_wait();
  __shared__ float red[32];
  const int64_t b = blockIdx.y;
  float acc = 0.0f;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x)
    acc += row_sumsq[b * rows + r];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[b * gridDim.x + blockIdx.x] = acc;
}

// inverse_norm_of(||x_b||_F, norm) from the per-block partial sums of squares of matrix b, for every
// thread of the block (the first warp reduces, the block waits on shared memory).
__device__ __forceinline__ float inverse_norm(const float* __restrict__ partial, int nparts, int64_t b, NormGuard norm) {
  __shared__ float s_inv;
  if (threadIdx.x < 32) {
    float a = 0.0f;
    for (int j = threadIdx.x; j < nparts; j += 32) a += partial[b * nparts + j];
    a = warp_sum(a);
    if (threadIdx.x == 0) s_inv = inverse_norm_of(sqrtf(a), norm);
  }
  __syncthreads();
  return s_inv;
}

template <class TI, class TO>
__global__ void scale_by_norm_kernel(const TI* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                     int64_t bstride, TO* __restrict__ y, int64_t ldy, int64_t bstride_y,
                                     const float* __restrict__ partial, int nparts, NormGuard norm) {
  const int64_t b = blockIdx.y;
  const float inv = inverse_norm(partial, nparts, b, norm);  // multiply by it, as the CPU reference does
  const TI* xb = x + b * bstride;
  TO* yb = y + b * bstride_y;
  const int64_t total = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / cols, c = e % cols;
    yb[r * ldy + c] = from_f32<TO>(to_f32(xb[r * ld + c]) * inv);
  }
}

// Flat, 4-wide variants for contiguous batches (every matrix rows*cols elements apart, start
// 4-element aligned, rows*cols % 4 == 0): no per-element index division, 8/16-byte accesses.
// The row-general kernels above divide a 64-bit index per element, which caps their bandwidth.
template <class T>
__global__ void sumsq_flat_kernel(const T* __restrict__ x, int64_t n4, int64_t bstride,
                                  float* __restrict__ partial) {
  __shared__ float red[32];
  const int64_t b = blockIdx.y;
  const Pack4<T>* xb = reinterpret_cast<const Pack4<T>*>(x + b * bstride);
  float acc = 0.0f;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < n4;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Pack4<T> v = xb[q];
#pragma unroll
    for (int e = 0; e < 4; ++e) acc += to_f32(v.v[e]) * to_f32(v.v[e]);
  }
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[b * gridDim.x + blockIdx.x] = acc;
}

template <class TI, class TO>
__global__ void scale_flat_kernel(const TI* __restrict__ x, int64_t n4, int64_t bstride, TO* __restrict__ y,
                                  int64_t bstride_y, const float* __restrict__ partial, int nparts, NormGuard norm) {
  const int64_t b = blockIdx.y;
  const float inv = inverse_norm(partial, nparts, b, norm);
  const Pack4<TI>* xb = reinterpret_cast<const Pack4<TI>*>(x + b * bstride);
  Pack4<TO>* yb = reinterpret_cast<Pack4<TO>*>(y + b * bstride_y);
  // Four packs loaded before any is stored: more bytes in flight per thread than one at a time.
  constexpr int U = 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t q0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q0 < n4; q0 += U * stride) {
    Pack4<TI> v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (q0 + u * stride < n4) v[u] = xb[q0 + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (q0 + u * stride >= n4) continue;
      Pack4<TO> o;
#pragma unroll
      for (int e = 0; e < 4; ++e) o.v[e] = from_f32<TO>(to_f32(v[u].v[e]) * inv);
      yb[q0 + u * stride] = o;
    }
  }
}

template <class TI, class TO>
__global__ void convert_flat_kernel(const TI* __restrict__ in, int64_t n4, int64_t bstride, TO* __restrict__ out,
                                    int64_t bstride_o) {
  const int64_t b = blockIdx.y;
  const Pack4<TI>* ib = reinterpret_cast<const Pack4<TI>*>(in + b * bstride);
  Pack4<TO>* ob = reinterpret_cast<Pack4<TO>*>(out + b * bstride_o);
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < n4;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Pack4<TI> v = ib[q];
    Pack4<TO> o;
#pragma unroll
    for (int e = 0; e < 4; ++e) o.v[e] = from_f32<TO>(to_f32(v.v[e]));
    ob[q] = o;
  }
}

// out = in^T (times inverse_norm_of(||in_b||_F) where partial is given: normalize's second pass), by
// 64 x 64 tiles through shared memory in fp32. Two kernels: transpose_pack_kernel moves 16-byte
// packs (rows of in and out start 16-byte aligned and hold whole packs, out in fp16 or bf16), a
// warp's access covering 128 contiguous bytes of each row; the element-wise transpose_kernel takes
// everything else. Both issue a tile's loads before the inverse norm's, so those reads overlap;
// with partial they are launched dependent on the kernel that writes it (launch_pdl), which only
// reads in, so the loads go before pdl_wait() and overlap that kernel too.
constexpr int kTT = 64;
constexpr int kTransposeThreads = 256;
constexpr int kTransposeWarps = kTransposeThreads / 32;

template <class TI, class TO>
__global__ void __launch_bounds__(kTransposeThreads)
    transpose_kernel(const TI* __restrict__ in, int64_t rows, int64_t cols, int64_t ld, int64_t bstride,
                     TO* __restrict__ out, int64_t ldo, int64_t bstride_o, const float* __restrict__ partial,
                     int nparts, NormGuard norm) {
  constexpr int kSteps = kTT * kTT / kTransposeThreads;
  __shared__ float tile[kTT][kTT + 1];  // +1: a warp's column reads hit 32 banks
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.z;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTT, c0 = static_cast<int64_t>(blockIdx.x) * kTT;
  const TI* ib = in + b * bstride;
  TO* ob = out + b * bstride_o;
  // Step u: a warp's 32 consecutive elements of tile row (or, storing, tile column) q % 64.
  TI v[kSteps];
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int q = u * kTransposeWarps + warp, r = q % kTT, c = (q / kTT) * 32 + lane;
    if (r0 + r < rows && c0 + c < cols) v[u] = ib[(r0 + r) * ld + c0 + c];
  }
  pdl_wait();
  const float inv = partial ? inverse_norm(partial, nparts, b, norm) : 1.0f;
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int q = u * kTransposeWarps + warp, r = q % kTT, c = (q / kTT) * 32 + lane;
    tile[r][c] = to_f32(v[u]) * inv;
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int q = u * kTransposeWarps + warp, c = q % kTT, r = (q / kTT) * 32 + lane;
    if (c0 + c < cols && r0 + r < rows) ob[(c0 + c) * ldo + r0 + r] = from_f32<TO>(tile[r][c]);
  }
}

// The bits of a 2-byte element.
template <class T>
__device__ __forceinline__ uint16_t bits16(T x) {
  static_assert(sizeof(T) == 2, "2-byte elements");
  uint16_t u;
  memcpy(&u, &x, 2);
  return u;
}

// The pack kernel's tile: 64 rows of sixteen 4-float groups (16 bytes), group g of row r stored
// at position g ^ (r / 8 % 8) ^ (g / 8). Then the 16-byte group stores of eight lanes along a
// row, and the element reads of a warp down eight rows (8 rows apart) of four columns, each hit
// 32 distinct banks.
__device__ __forceinline__ int swizzled_group(int r, int g) { return g ^ ((r >> 3) & 7) ^ ((g >> 3) & 1); }

template <class TI, class TO>
__global__ void __launch_bounds__(kTransposeThreads)
    transpose_pack_kernel(const TI* __restrict__ in, int64_t rows, int64_t cols, int64_t ld, int64_t bstride,
                          TO* __restrict__ out, int64_t ldo, int64_t bstride_o, const float* __restrict__ partial,
                          int nparts, NormGuard norm) {
  static_assert(sizeof(TO) == 2, "out packs of eight 2-byte elements");
  constexpr int VI = 16 / sizeof(TI), VO = 8;
  constexpr int kInPacks = kTT / VI;                // packs along a tile row of in
  constexpr int kLoads = kTT * kInPacks / kTransposeThreads, kStores = kTT * kTT / VO / kTransposeThreads;
  __shared__ __align__(16) float tile[kTT][kTT];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.z;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTT, c0 = static_cast<int64_t>(blockIdx.x) * kTT;
  const TI* ib = in + b * bstride;
  TO* ob = out + b * bstride_o;
  // Load step u: a warp reads 32 / kInPacks whole tile rows (128 or 256 bytes each).
  auto load_at = [&](int u, int& r, int& c) {
    r = (u * kTransposeWarps + warp) * (32 / kInPacks) + lane / kInPacks;
    c = (lane % kInPacks) * VI;
  };
  PackV<TI, VI> v[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    int r, c;
    load_at(u, r, c);
    if (r0 + r < rows && c0 + c < cols)
      v[u] = load_streaming(reinterpret_cast<const PackV<TI, VI>*>(ib + (r0 + r) * ld + c0 + c));
  }
  pdl_wait();
  const float inv = partial ? inverse_norm(partial, nparts, b, norm) : 1.0f;
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    int r, c;
    load_at(u, r, c);
#pragma unroll
    for (int h = 0; h < VI / 4; ++h) {
      float4 f;
      f.x = to_f32(v[u].v[4 * h]) * inv;
      f.y = to_f32(v[u].v[4 * h + 1]) * inv;
      f.z = to_f32(v[u].v[4 * h + 2]) * inv;
      f.w = to_f32(v[u].v[4 * h + 3]) * inv;
      *reinterpret_cast<float4*>(&tile[r][4 * swizzled_group(r, c / 4 + h)]) = f;
    }
  }
  __syncthreads();
  // Store step u: out rows c .. c + 3 (tile columns), eight lanes along each: 128 bytes.
#pragma unroll
  for (int u = 0; u < kStores; ++u) {
    const int c = (u * kTransposeWarps + warp) * 4 + lane / 8, r = (lane % 8) * VO;
    if (c0 + c >= cols || r0 + r >= rows) continue;
    // Words packed by hand and stored by __stwb: one 16-byte store (a plain assignment of a pack
    // of 2-byte elements may be split into narrower stores).
    auto word = [&](int e) {
      const float lo = tile[r + e][4 * swizzled_group(r + e, c / 4) + c % 4];
      const float hi = tile[r + e + 1][4 * swizzled_group(r + e + 1, c / 4) + c % 4];
      return static_cast<uint32_t>(bits16(from_f32<TO>(lo))) | (static_cast<uint32_t>(bits16(from_f32<TO>(hi))) << 16);
    };
    __stwb(reinterpret_cast<uint4*>(ob + (c0 + c) * ldo + r0 + r), make_uint4(word(0), word(2), word(4), word(6)));
  }
}

template <class TI, class TO>
__global__ void convert_kernel(const TI* __restrict__ in, int64_t rows, int64_t cols, int64_t ld,
                               int64_t bstride, TO* __restrict__ out, int64_t ldo, int64_t bstride_o) {
  const int64_t b = blockIdx.y, total = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / cols, c = e % cols;
    out[b * bstride_o + r * ldo + c] = from_f32<TO>(to_f32(in[b * bstride + r * ld + c]));
  }
}

// Multi-tensor AdamW and Lion: one launch updates up to kMultiTensors parameters of one dtype
// combination, blockIdx.y picking the parameter (its pointers, size and hyperparameters ride in
// the kernel's parameter space). vec[i]: 4 elements per access (n % 4 == 0, every pointer
// 4-element aligned).
constexpr int kMultiTensors = 32;  // with AdamW's table, within the 4 KB parameter space (asserted below)
template <class H>
struct MultiTensor {
  void* w[kMultiTensors];
  const void* g[kMultiTensors];
  void* m[kMultiTensors];
  void* v[kMultiTensors];  // AdamW's second moment
  float* bound[kMultiTensors];  // ElementwiseParam::state_bound, or null
  int64_t n[kMultiTensors];
  H h[kMultiTensors];
  bool vec[kMultiTensors];
};
static_assert(sizeof(MultiTensor<AdamWParams>) <= 4096, "the 4 KB kernel parameter space");
// Parameter i of a table, typed.
template <class TW, class TG, class TS, class H>
struct TableEntry {
  TW* __restrict__ w;
  const TG* __restrict__ g;
  TS* __restrict__ m;
  TS* __restrict__ v;
  int64_t n;
  const H& h;
};
template <class TW, class TG, class TS, class H>
__device__ __forceinline__ TableEntry<TW, TG, TS, H> entry(const MultiTensor<H>& t, int i) {
  return {static_cast<TW*>(t.w[i]), static_cast<const TG*>(t.g[i]), static_cast<TS*>(t.m[i]),
          static_cast<TS*>(t.v[i]), t.n[i], t.h[i]};
}

// The largest |x| of 16-bit floats kept as two 16-bit lanes of a word: the stored bits without
// their sign order as the magnitudes do (NaN above Inf), so a packed max takes four at a time.
template <class TS>
__device__ __forceinline__ unsigned packed_max(unsigned most, const Pack4<TS>& p) {
  static_assert(sizeof(TS) == 2);
  const uint2 u = reinterpret_cast<const uint2&>(p);
  return __vmaxu2(most, __vmaxu2(u.x & 0x7fff7fffu, u.y & 0x7fff7fffu));
}
// packed_max's word as bound_bits of the larger lane.
template <class TS>
__device__ __forceinline__ unsigned packed_bound_bits(unsigned most) {
  const unsigned bits = max(most & 0xffffu, most >> 16);
  if constexpr (std::is_same_v<TS, __half>) return bound_bits(__half2float(__ushort_as_half(static_cast<unsigned short>(bits))));
  else return bits << 16;  // bfloat16: the top half of a float32
}

// The element rules of the multi-tensor kernel, the CPU backend's (AdamWRule, LionRule): the
// state tensors an element has (kMoments: exp_avg, and AdamW's exp_avg_sq), what a parameter's
// hyper-parameters give every element (setup), and one element's step.
struct AdamWElem {
  using Params = AdamWParams;
  static constexpr int kMoments = 2;
  struct Setup {
    AdamWParams h;
    float decay, step_size, sqrt_bc2;
  };
  __device__ __forceinline__ static Setup setup(const AdamWParams& given) {
    const AdamWParams h = given.resolved();
    // Bias correction from the device step counter, by the CPU backend's rule.
    const double tt = adamw_step_number(h, *h.applied_steps);
    return {h, 1.0f - h.lr * h.weight_decay, AdamWRule::step_size(h.lr, h.beta1, tt),
            AdamWRule::sqrt_bias_correction2(h.beta2, tt)};
  }
  __device__ __forceinline__ static void apply(float& w, float g, float (&s)[2], const Setup& c) {
    s[0] = AdamWRule::exp_avg(s[0], g, c.h.beta1);
    s[1] = AdamWRule::exp_avg_sq(s[1], g, c.h.beta2);
    w = AdamWRule::weight(w, s[0], s[1], c.step_size, c.decay, c.h.epsilon, c.sqrt_bc2);
  }
};
struct LionElem {
  using Params = LionParams;
  static constexpr int kMoments = 1;
  struct Setup {
    LionParams h;
    float decay;
  };
  __device__ __forceinline__ static Setup setup(const LionParams& given) {
    const LionParams h = given.resolved();
    return {h, 1.0f - h.lr * h.weight_decay};
  }
  __device__ __forceinline__ static void apply(float& w, float g, float (&s)[1], const Setup& c) {
    const float u = LionRule::direction(s[0], g, c.h.beta1);
    s[0] = LionRule::exp_avg(s[0], g, c.h.beta2);
    w = LionRule::weight(w, u, c.h.lr, c.decay);
  }
};

// One parameter per blockIdx.y, a grid-stride loop over its elements (4-element packs where
// t.vec allows), and the parameter's state bound raised to the largest |state| each moment stores.
template <class Rule, class TW, class TG, class TS>
__global__ void multi_tensor_kernel(const __grid_constant__ MultiTensor<typename Rule::Params> t, const int* skip) {
  constexpr int K = Rule::kMoments;
  pdl_wait();
  if (skipped(skip)) return;
  const auto [w, g, m, v, n, given] = entry<TW, TG, TS>(t, blockIdx.y);
  TS* const state[2] = {m, v};
  float* const bound = t.bound[blockIdx.y];
  const bool vec = t.vec[blockIdx.y];
  // Blocks past a smaller parameter's end (whole blocks: raise_bounds needs every thread).
  if (blockIdx.x * static_cast<int64_t>(blockDim.x) * (vec ? 4 : 1) >= n) return;
  const typename Rule::Setup c = Rule::setup(given);
  const int64_t start = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // The largest |state| this thread stores, per moment: bound_bits, or for 16-bit moments in
  // 4-element packs, two 16-bit lanes of stored bits (packed_max).
  unsigned most[K] = {};
  if (vec) {
    for (int64_t q = start; 4 * q < n; q += stride) {
      Pack4<TW> wp = reinterpret_cast<const Pack4<TW>*>(w)[q];
      const Pack4<TG> gp = reinterpret_cast<const Pack4<TG>*>(g)[q];
      Pack4<TS> sp[K];
#pragma unroll
      for (int k = 0; k < K; ++k) sp[k] = reinterpret_cast<const Pack4<TS>*>(state[k])[q];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float wv = to_f32(wp.v[e]), sv[K];
#pragma unroll
        for (int k = 0; k < K; ++k) sv[k] = to_f32(sp[k].v[e]);
        Rule::apply(wv, to_f32(gp.v[e]), sv, c);
        wp.v[e] = from_f32<TW>(wv);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          sp[k].v[e] = from_f32<TS>(sv[k]);
          if constexpr (sizeof(TS) != 2) most[k] = max(most[k], bound_bits(to_f32(sp[k].v[e])));
        }
      }
      reinterpret_cast<Pack4<TW>*>(w)[q] = wp;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if constexpr (sizeof(TS) == 2) most[k] = packed_max(most[k], sp[k]);
        reinterpret_cast<Pack4<TS>*>(state[k])[q] = sp[k];
      }
    }
    if constexpr (sizeof(TS) == 2) {
#pragma unroll
      for (int k = 0; k < K; ++k) most[k] = packed_bound_bits<TS>(most[k]);
    }
  } else {
    for (int64_t e = start; e < n; e += stride) {
      float wv = to_f32(w[e]), sv[K];
#pragma unroll
      for (int k = 0; k < K; ++k) sv[k] = to_f32(state[k][e]);
      Rule::apply(wv, to_f32(g[e]), sv, c);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const TS stored = from_f32<TS>(sv[k]);
        state[k][e] = stored;
        most[k] = max(most[k], bound_bits(to_f32(stored)));
      }
      w[e] = from_f32<TW>(wv);
    }
  }
  if (bound) raise_bounds(bound, most);
}

// sym_prepare: one warp per row. With VEC (every row of C and D 16-byte aligned) each lane moves
// groups of V = 16 bytes of the wider of the two element types (8 halfs, or 4 with fp32), four
// groups loaded before any is stored; the row's last elements one at a time (a block per row with
// 2-byte accesses kept too few bytes in flight to approach the memory bandwidth).
constexpr int kPrepWarps = 8;  // rows per block

// Elements [j0, j0 + V*ng) of row r: c = beta*d (0 without D), plus gamma on the diagonal. D may
// alias C: each group is read before it is written, by the same thread.
template <int V, class TD, class TC>
__device__ __forceinline__ void prepare_span(const TD* d, TC* c, int64_t r, int64_t j0, int64_t ng, float beta,
                                             float gamma, int lane) {
  constexpr int U = 4;
  const PackV<TD, V>* di = d ? reinterpret_cast<const PackV<TD, V>*>(d + j0) : nullptr;
  PackV<TC, V>* ci = reinterpret_cast<PackV<TC, V>*>(c + j0);
  for (int64_t q0 = lane; q0 < ng; q0 += 32 * U) {
    PackV<TD, V> dp[U];
    if (di) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (q0 + 32 * u < ng) dp[u] = di[q0 + 32 * u];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t q = q0 + 32 * u;
      if (q >= ng) continue;
      PackV<TC, V> cp;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float x = di ? beta * to_f32(dp[u].v[e]) : 0.0f;
        if (j0 + V * q + e == r) x += gamma;
        cp.v[e] = from_f32<TC>(x);
      }
      ci[q] = cp;
    }
  }
}

template <class TD, class TC, bool VEC>
__global__ void __launch_bounds__(32 * kPrepWarps)
    sym_prepare_kernel(const TD* d, int64_t ldd, int64_t bsd, float beta, float gamma, TC* c, int64_t p, int64_t ldc,
                       int64_t bsc, int64_t tile) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kPrepWarps + (threadIdx.x >> 5), b = blockIdx.y;
  if (r >= p) return;
  const int64_t lim = min(p, (r / tile + 1) * tile);
  const TD* dr = d ? d + b * bsd + r * ldd : nullptr;
  TC* cr = c + b * bsc + r * ldc;
  if constexpr (VEC) {
    constexpr int V = 16 / (sizeof(TD) > sizeof(TC) ? sizeof(TD) : sizeof(TC));
    const int64_t body = lim / V;
    prepare_span<V>(dr, cr, r, 0, body, beta, gamma, lane);
    prepare_span<1>(dr, cr, r, V * body, lim - V * body, beta, gamma, lane);
  } else {
    prepare_span<1>(dr, cr, r, 0, lim, beta, gamma, lane);
  }
}

template <class T>
__global__ void mirror_lower_kernel(T* c, int64_t p, int64_t ldc, int64_t bsc, float gamma) {
  const int64_t tr = blockIdx.y, tc = blockIdx.x;  // destination tile (upper: tr <= tc)
  if (tr > tc) return;
  __shared__ T tile[32][33];
  T* cb = c + blockIdx.z * bsc;
  // Source: rows tc*32.., cols tr*32.. (the mirrored lower tile).
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int64_t r = tc * 32 + dy, col = tr * 32 + threadIdx.x;
    if (r < p && col < p) tile[dy][threadIdx.x] = cb[r * ldc + col];
  }
  __syncthreads();
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int64_t r = tr * 32 + dy, col = tc * 32 + threadIdx.x;  // dest (r, col) = src (col, r)
    if (r < p && col < p) {
      if (r < col) cb[r * ldc + col] = tile[threadIdx.x][dy];
      else if (r == col && gamma != 0.0f) cb[r * ldc + col] = from_f32<T>(to_f32(tile[threadIdx.x][dy]) + gamma);
    }
  }
}

template <class T>
__global__ void diag_add_kernel(T* c, int64_t p, int64_t ldc, int64_t bsc, float gamma) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= p) return;
  T* e = c + blockIdx.y * bsc + r * ldc + r;
  *e = from_f32<T>(to_f32(*e) + gamma);
}

int64_t bstride_of(const MatrixView& v) { return v.batch > 1 ? v.batch_stride : v.rows * v.ld; }

// Contiguous batch of 4-element-aligned matrices with rows*cols % 4 == 0 (the flat kernels).
bool flat4(const MatrixView& v) {
  const int64_t n = v.rows * v.cols;
  return (v.ld == v.cols || v.rows == 1) && (v.batch == 1 || v.batch_stride == n) && n % 4 == 0 &&
         aligned4(v.data, dtype_size(v.dtype));
}

unsigned grid_for(int64_t n, int threads, unsigned cap = 4096) {
  return std::max(1u, std::min<unsigned>(ceil_div_u(n, threads * 4), cap));
}

// The pack kernel where it applies (packs: both views allow it), else the element-wise one.
template <class TI, class TO>
auto transpose_kernel_for(bool packs) {
  if constexpr (sizeof(TO) == 2)
    if (packs) return transpose_pack_kernel<TI, TO>;
  return transpose_kernel<TI, TO>;
}

// Whether every row of v starts on a 16-byte boundary and holds whole 16-byte packs.
bool rows_in_packs(const MatrixView& v) {
  const int64_t pack = 16 / static_cast<int64_t>(dtype_size(v.dtype));
  return reinterpret_cast<std::uintptr_t>(v.data) % 16 == 0 && v.cols % pack == 0 && v.ld % pack == 0 &&
         (v.batch == 1 || v.batch_stride % pack == 0);
}

// out = in^T, scaled by matrix b's inverse norm from `partial` where given (see transpose_kernel).
void transpose_scaled(const MatrixView& in, const MatrixView& out, const float* partial, int nparts, NormGuard norm,
                      cudaStream_t s) {
  if (in.batch == 0 || in.rows * in.cols == 0) return;
  if (in.rows > 65535LL * kTT || in.batch > 65535)
    fail("transpose: at most " + std::to_string(65535LL * kTT) + " rows and 65535 matrices, got " +
         std::to_string(in.batch) + " of " + std::to_string(in.rows) + "x" + std::to_string(in.cols));
  const dim3 grid(ceil_div_u(in.cols, kTT), ceil_div_u(in.rows, kTT), static_cast<unsigned>(in.batch));
  const bool packs = rows_in_packs(in) && rows_in_packs(out) && dtype_size(out.dtype) == 2;
  DION3_DISPATCH_FLOAT(in.dtype, TI, [&] {
    DION3_DISPATCH_FLOAT(out.dtype, TO, [&] {
      auto kernel = transpose_kernel_for<TI, TO>(packs);
      const auto* i = static_cast<const TI*>(in.data);
      auto* o = static_cast<TO*>(out.data);
      if (partial)
        launch_pdl(kernel, grid, kTransposeThreads, 0, s, i, in.rows, in.cols, in.ld, bstride_of(in), o, out.ld,
                   bstride_of(out), partial, nparts, norm);
      else  // the previous kernel may be the one that writes in
        kernel<<<grid, kTransposeThreads, 0, s>>>(i, in.rows, in.cols, in.ld, bstride_of(in), o, out.ld,
                                                  bstride_of(out), partial, nparts, norm);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

}  // namespace

int64_t normalize_scratch_floats(int64_t batch) { return batch * kNormBlocks; }

void launch_normalize(const MatrixView& in, const MatrixView& out, NormGuard norm, const float* row_sumsq,
                      float* scratch, bool transpose, cudaStream_t s) {
  if (in.batch == 0 || in.rows * in.cols == 0) return;
  if (out.batch != in.batch || out.rows != (transpose ? in.cols : in.rows) ||
      out.cols != (transpose ? in.rows : in.cols))
    fail(transpose ? "normalize: out must be in's shape transposed" : "normalize: out has a different shape than in");
  const unsigned nb = static_cast<unsigned>(in.batch);
  const bool flat = flat4(in) && flat4(out);
  // First pass: each matrix's sum of squares as partial sums in scratch, from its rows' sums
  // where given (kRowSumParts partials), else from the elements (kNormBlocks partials).
  const int nparts = row_sumsq ? kRowSumParts : kNormBlocks;
  static_assert(kRowSumParts <= kNormBlocks, "normalize_scratch_floats");
  if (row_sumsq) {
    launch_pdl(sum_row_sumsq_kernel, dim3(kRowSumParts, nb), 256, 0, s, row_sumsq, in.rows, scratch);
  } else {
    DION3_DISPATCH_FLOAT(in.dtype, TI, [&] {
      if (flat)
        sumsq_flat_kernel<TI><<<dim3(kNormBlocks, nb), 256, 0, s>>>(static_cast<const TI*>(in.data),
                                                                    in.rows * in.cols / 4, in.rows * in.cols, scratch);
      else
        sumsq_partial_kernel<TI><<<dim3(kNormBlocks, nb), 256, 0, s>>>(
            static_cast<const TI*>(in.data), in.rows, in.cols, in.ld, bstride_of(in), scratch);
    });
  }
  DION3_CUDA_LAUNCH_CHECK();
  if (transpose) return transpose_scaled(in, out, scratch, nparts, norm, s);
  DION3_DISPATCH_FLOAT(in.dtype, TI, [&] {
    DION3_DISPATCH_FLOAT(out.dtype, TO, [&] {
      if (flat) {
        const int64_t n4 = in.rows * in.cols / 4;
        scale_flat_kernel<TI, TO><<<dim3(grid_for(n4, 256, 1024), nb), 256, 0, s>>>(
            static_cast<const TI*>(in.data), n4, in.rows * in.cols, static_cast<TO*>(out.data), out.rows * out.cols,
            scratch, nparts, norm);
      } else {
        scale_by_norm_kernel<TI, TO><<<dim3(grid_for(in.rows * in.cols, 256, 1024), nb), 256, 0, s>>>(
            static_cast<const TI*>(in.data), in.rows, in.cols, in.ld, bstride_of(in),
            static_cast<TO*>(out.data), out.ld, bstride_of(out), scratch, nparts, norm);
      }
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

void launch_transpose(const MatrixView& in, const MatrixView& out, cudaStream_t s) {
  if (out.rows != in.cols || out.cols != in.rows || out.batch != in.batch)
    fail("transpose: out must be in's shape transposed");
  transpose_scaled(in, out, nullptr, 0, NormGuard{}, s);
}

void launch_convert(const MatrixView& in, const MatrixView& out, cudaStream_t s) {
  if (out.rows != in.rows || out.cols != in.cols || out.batch != in.batch)
    fail("convert: out must have in's shape");
  if (in.batch == 0 || in.rows * in.cols == 0) return;
  if (in.data == out.data) {
    if (in.dtype == out.dtype && in.ld == out.ld && bstride_of(in) == bstride_of(out)) return;
    fail("convert: in and out alias but differ in dtype or layout");
  }
  if (flat4(in) && flat4(out)) {
    const int64_t n4 = in.rows * in.cols / 4;
    DION3_DISPATCH_FLOAT(in.dtype, TI, [&] {
      DION3_DISPATCH_FLOAT(out.dtype, TO, [&] {
        convert_flat_kernel<TI, TO><<<dim3(grid_for(n4, 256, 1024), static_cast<unsigned>(in.batch)), 256, 0, s>>>(
            static_cast<const TI*>(in.data), n4, in.rows * in.cols, static_cast<TO*>(out.data), out.rows * out.cols);
      });
    });
    DION3_CUDA_LAUNCH_CHECK();
    return;
  }
  const unsigned gx = grid_for(in.rows * in.cols, 256, 1024);
  DION3_DISPATCH_FLOAT(in.dtype, TI, [&] {
    DION3_DISPATCH_FLOAT(out.dtype, TO, [&] {
      convert_kernel<TI, TO><<<dim3(gx, static_cast<unsigned>(in.batch)), 256, 0, s>>>(
          static_cast<const TI*>(in.data), in.rows, in.cols, in.ld, bstride_of(in),
          static_cast<TO*>(out.data), out.ld, bstride_of(out));
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

namespace {
// A launch's grid covers its largest parameter, and the blocks past a smaller one's end leave at
// once. So parameters of at least kLargeTable elements share launches only with those of the same
// power-of-two size class (at most half a launch's blocks idle); smaller ones share freely. One
// launch a large parameter left a gap at each launch's ramp and tail.
constexpr int64_t kLargeTable = int64_t{1} << 20;
int size_class(int64_t n) { return n >= kLargeTable ? std::bit_width(static_cast<uint64_t>(n)) : 0; }

int64_t numel_of(const ElementwiseParam& p) { return p.weight.batch * p.weight.rows * p.weight.cols; }

// Fills MultiTensor tables with the parameters of one dtype combination and launches `launch`
// on each, up to kMultiTensors parameters of one size class (size_class) per table.
template <class H, class Launch>
void for_each_table(std::span<const ElementwiseParam> ps, std::span<const H> hs, const char* what, Launch&& launch) {
  if (ps.size() != hs.size()) fail(std::string(what) + ": one set of hyperparameters per parameter");
  std::vector<std::size_t> order(ps.size());
  for (std::size_t i = 0; i < ps.size(); ++i) order[i] = i;
  auto key = [&](std::size_t i) {
    return std::tuple(static_cast<int>(ps[i].weight.dtype), static_cast<int>(ps[i].grad.dtype),
                      static_cast<int>(ps[i].exp_avg.dtype), size_class(numel_of(ps[i])));
  };
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return key(a) < key(b); });
  MultiTensor<H> t{};
  int used = 0;
  int64_t max_n = 0;
  std::size_t first = 0;  // a parameter of this table, for its dtypes
  auto flush = [&] {
    if (used > 0 && max_n > 0) launch(t, used, max_n, ps[first]);
    t = MultiTensor<H>{};
    used = 0;
    max_n = 0;
  };
  for (std::size_t o = 0; o < order.size(); ++o) {
    const std::size_t i = order[o];
    const ElementwiseParam& p = ps[i];
    const int64_t n = numel_of(p);
    if (n == 0) continue;
    if (used > 0 && (key(i) != key(first) || used == kMultiTensors)) flush();
    if (used == 0) first = i;
    t.w[used] = p.weight.data;
    t.g[used] = p.grad.data;
    t.m[used] = p.exp_avg.data;
    t.v[used] = p.exp_avg_sq.data;
    t.bound[used] = p.state_bound;
    t.n[used] = n;
    t.h[used] = hs[i];
    t.vec[used] = n % 4 == 0 && aligned4(p.weight.data, dtype_size(p.weight.dtype)) &&
                  aligned4(p.grad.data, dtype_size(p.grad.dtype)) && aligned4(p.exp_avg.data, dtype_size(p.exp_avg.dtype)) &&
                  (!p.exp_avg_sq.data || aligned4(p.exp_avg_sq.data, dtype_size(p.exp_avg_sq.dtype)));
    max_n = std::max(max_n, n);
    ++used;
  }
  flush();
}
}  // namespace

namespace {
template <class Rule>
void launch_multi_tensor(std::span<const ElementwiseParam> ps, std::span<const typename Rule::Params> hs,
                         const char* what, const int* skip, cudaStream_t s) {
  for_each_table(ps, hs, what, [&](const MultiTensor<typename Rule::Params>& t, int used, int64_t max_n,
                                   const ElementwiseParam& p) {
    DION3_DISPATCH_FLOAT(p.weight.dtype, TW, [&] {
      DION3_DISPATCH_FLOAT(p.grad.dtype, TG, [&] {
        DION3_DISPATCH_FLOAT(p.exp_avg.dtype, TS, [&] {
          launch_pdl(multi_tensor_kernel<Rule, TW, TG, TS>, dim3(grid_for(max_n / 4 + 1, 256), used), 256, 0, s, t,
                     skip);
        });
      });
    });
    DION3_CUDA_LAUNCH_CHECK();
  });
}
}  // namespace

void launch_adamw(std::span<const ElementwiseParam> ps, std::span<const AdamWParams> hs, const int* skip,
                  cudaStream_t s) {
  check_elementwise_params(ps, true, "adamw");
  for (const ElementwiseParam& p : ps)  // one state dtype a launch (the CPU takes mixed moments)
    if (p.exp_avg.dtype != p.exp_avg_sq.dtype) fail("adamw: exp_avg and exp_avg_sq dtypes differ");
  launch_multi_tensor<AdamWElem>(ps, hs, "adamw", skip, s);
}

void launch_lion(std::span<const ElementwiseParam> ps, std::span<const LionParams> hs, const int* skip,
                 cudaStream_t s) {
  check_elementwise_params(ps, false, "lion");
  launch_multi_tensor<LionElem>(ps, hs, "lion", skip, s);
}

void launch_sym_prepare(const MatrixView& D, float beta, float gamma, const MatrixView& C,
                        int64_t tile, cudaStream_t s) {
  const int64_t p = C.rows;
  if (p == 0 || C.batch == 0) return;
  const dim3 grid(ceil_div_u(p, kPrepWarps), static_cast<unsigned>(C.batch));
  const bool has_d = D.data != nullptr;
  // Every row start 16-byte aligned: the data, its ld and (batches) its batch stride.
  auto rows16 = [](const MatrixView& v) {
    const std::size_t e = dtype_size(v.dtype);
    return reinterpret_cast<std::uintptr_t>(v.data) % 16 == 0 && (v.ld * e) % 16 == 0 &&
           (v.batch == 1 || (bstride_of(v) * e) % 16 == 0);
  };
  const bool vec = rows16(C) && (!has_d || rows16(D));
  DION3_DISPATCH_FLOAT(has_d ? D.dtype : C.dtype, TD, [&] {
    DION3_DISPATCH_FLOAT(C.dtype, TC, [&] {
      auto* d = static_cast<const TD*>(D.data);
      auto* c = static_cast<TC*>(C.data);
      const int64_t ldd = has_d ? D.ld : 0, bsd = has_d ? bstride_of(D) : 0;
      if (vec)
        sym_prepare_kernel<TD, TC, true><<<grid, 32 * kPrepWarps, 0, s>>>(d, ldd, bsd, beta, gamma, c, p, C.ld,
                                                                         bstride_of(C), tile);
      else
        sym_prepare_kernel<TD, TC, false><<<grid, 32 * kPrepWarps, 0, s>>>(d, ldd, bsd, beta, gamma, c, p, C.ld,
                                                                          bstride_of(C), tile);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

void launch_mirror_lower(const MatrixView& C, float gamma, bool mirror, cudaStream_t s) {
  const int64_t p = C.rows;
  if (p == 0 || C.batch == 0) return;
  if (!mirror && gamma == 0.0f) return;
  DION3_DISPATCH_FLOAT(C.dtype, T, [&] {
    if (mirror) {
      const unsigned nt = ceil_div_u(p, 32);
      mirror_lower_kernel<T><<<dim3(nt, nt, static_cast<unsigned>(C.batch)), dim3(32, 8), 0, s>>>(
          static_cast<T*>(C.data), p, C.ld, bstride_of(C), gamma);
    } else {
      diag_add_kernel<T><<<dim3(ceil_div_u(p, 256), static_cast<unsigned>(C.batch)), 256, 0, s>>>(
          static_cast<T*>(C.data), p, C.ld, bstride_of(C), gamma);
    }
  });
  DION3_CUDA_LAUNCH_CHECK();
}

}  // namespace dion3::cuda
