// step_kernels.cu — fused kernels of the matrix step (algorithm.md §1): momentum accumulate with row-ℓ1
// scores, batched top-k row selection (radix select, ties to the lower index), row gather with
// error-feedback decay, NorMuon normalisation + weight decay + scatter update, and the
// non-finite check. Every kernel honours the device `skip` flag and never syncs with the host;
// each is launched with launch_pdl() and starts with pdl_wait() (cuda_common.cuh).
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <type_traits>

#include "cuda/kernels.cuh"

// The scalar tails after `if constexpr (VEC) { ...; return; }` are unreachable in VEC builds.
#pragma nv_diag_suppress 128

namespace dion3::cuda {
namespace {

constexpr int kRowWarps = 4;      // warp-per-row kernels: rows per block

// One row of M (and of G, with_g) in 4-element packs, the warp-per-row way of the accumulate, the
// gather and the NorMuon row sums (there M is a row of O): each lane loads its next U packs
// (q = lane, lane + 32, ... below n4) before it hands any to visit(q, m_pack, g_pack), so U packs
// of each array are in flight per lane.
template <int U, class TM, class TG, class Visit>
__device__ __forceinline__ void for_row_packs(const Pack4<TM>* m4, const Pack4<TG>* g4, int64_t n4, int lane,
                                              bool with_g, Visit&& visit) {
  for (int64_t q0 = lane; q0 < n4; q0 += 32 * U) {
    Pack4<TM> mp[U];
    Pack4<TG> gp[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t q = q0 + 32 * u;
      if (q < n4) {
        mp[u] = m4[q];
        if (with_g) gp[u] = g4[q];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (q0 + 32 * u < n4) visit(q0 + 32 * u, mp[u], gp[u]);
  }
}

// ---- accumulate: M = decay*M + grad_scale*G; scores[r] = sum_j |M[r, j]|, row_sumsq[r] = sum_j M[r, j]^2
// (of the rounded values); largest[i] raised to the largest |M_i| stored ---------------------------
// One warp per row; with VEC each lane loads four 4-element packs of M and of G before it
// stores any (more bytes in flight than a block per row with one pack per thread). Each lane
// sums in a fixed order, then a fixed shuffle tree: reproducible.
template <class TM, class TG, bool VEC>
__global__ void __launch_bounds__(32 * kRowWarps)
    accumulate_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols, Hyper decay_h,
                      Hyper grad_scale_h, float* __restrict__ scores, float* __restrict__ row_sumsq,
                      float* __restrict__ largest, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const float decay = decay_h.get(), gs = grad_scale_h.get();
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5), i = blockIdx.y;
  unsigned most[1] = {0};  // the largest |M| this lane stores (bound_bits)
  if (r < rows) {  // warps past the last row stay for raise_bounds, which needs every thread
    const DeviceMat d = mats[i];
    TM* m = static_cast<TM*>(d.m) + r * d.ldm;
    const TG* g = static_cast<const TG*>(d.g) + r * d.ldg;
    float2 sums = make_float2(0.0f, 0.0f);  // l1, sum of squares
    auto add = [&](float v) {
      sums.x += fabsf(v);
      sums.y += v * v;
      most[0] = max(most[0], bound_bits(v));
    };
    if constexpr (VEC) {
      Pack4<TM>* m4 = reinterpret_cast<Pack4<TM>*>(m);
      for_row_packs<4>(m4, reinterpret_cast<const Pack4<TG>*>(g), cols / 4, lane, true,
                       [&](int64_t q, Pack4<TM>& mp, const Pack4<TG>& gp) {
#pragma unroll
                         for (int e = 0; e < 4; ++e) {
                           mp.v[e] = from_f32<TM>(decay * to_f32(mp.v[e]) + gs * to_f32(gp.v[e]));
                           add(to_f32(mp.v[e]));
                         }
                         m4[q] = mp;
                       });
    } else {
      for (int64_t j = lane; j < cols; j += 32) {
        const TM nv = from_f32<TM>(decay * to_f32(m[j]) + gs * to_f32(g[j]));
        m[j] = nv;
        add(to_f32(nv));
      }
    }
    if (scores != nullptr || row_sumsq != nullptr) {
      sums = warp_sum(sums);
      if (lane == 0) {
        if (scores) scores[i * rows + r] = sums.x;
        if (row_sumsq) row_sumsq[i * rows + r] = sums.y;
      }
    }
  }
  if (largest) raise_bounds(largest + i, most);
}

// ---- select_rows: per score vector, the k largest (ties: lower index), ascending output ----
// One block per vector. A radix select finds the k-th largest key 8 bits at a time; each pass
// builds a histogram with warp-aggregated shared atomics (scores of one magnitude share a top
// byte, and per-lane atomics on one bin serialised 32-fold) and finds its bin with one scan.
// Then one pass writes the rows: the keys above the k-th, and the first of those equal to it (and,
// given row_sumsq, sums the written rows' squares for gather_normalized).
// With kCached > 0 (vectors of at most kCached * kSelectThreads scores) each thread reads its keys
// once into registers; with 0 every pass reads them again from L2 (any length). Eight is the most
// that fits: at 1024 threads a thread has 64 registers, and 16 cached keys spilled.
constexpr int kSelectThreads = 1024;

__device__ __forceinline__ uint32_t order_key(float f) {
  // Monotone map of floats to unsigned integers (larger float -> larger key).
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_order_key(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

template <int kCached>
__global__ void __launch_bounds__(kSelectThreads)
    select_rows_kernel(const float* __restrict__ scores, int64_t m, int64_t k, int32_t* __restrict__ idx,
                       float* __restrict__ largest, const float* __restrict__ row_sumsq,
                       float* __restrict__ selected_sumsq, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  const float* s = scores + blockIdx.x * m;
  int32_t* out = idx + blockIdx.x * k;
  const int t = threadIdx.x, lane = t & 31;
  // Chunk u holds rows u * kSelectThreads + t; every thread runs all chunks (the warps vote).
  const int64_t chunks = kCached > 0 ? kCached : (m + kSelectThreads - 1) / kSelectThreads;
  uint32_t cached[kCached > 0 ? kCached : 1];
  if constexpr (kCached > 0) {
#pragma unroll
    for (int u = 0; u < kCached; ++u) {
      const int64_t r = static_cast<int64_t>(u) * kSelectThreads + t;
      cached[u] = r < m ? order_key(__ldg(s + r)) : 0u;
    }
  }
  auto key_at = [&](int u, int64_t r) -> uint32_t {
    if constexpr (kCached > 0) return cached[u];
    else return r < m ? order_key(__ldg(s + r)) : 0u;
  };

  if (largest) {  // the largest score, plus one (Backend::select_rows)
    __shared__ uint32_t s_largest;
    uint32_t mx = 0;
#pragma unroll
    for (int u = 0; u < chunks; ++u) {
      const int64_t r = static_cast<int64_t>(u) * kSelectThreads + t;
      if (r < m) mx = max(mx, key_at(u, r));
    }
    for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (t == 0) s_largest = 0;
    __syncthreads();
    if (lane == 0) atomicMax(&s_largest, mx);
    __syncthreads();
    if (t == 0) largest[blockIdx.x] = from_order_key(s_largest) + 1.0f;
  }

  uint32_t prefix = 0, mask = 0;
  int need = static_cast<int>(k);  // of the keys matching prefix, how many are still to take
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (t < 256) hist[t] = 0;
    __syncthreads();
#pragma unroll
    for (int u = 0; u < chunks; ++u) {
      const int64_t r = static_cast<int64_t>(u) * kSelectThreads + t;
      const uint32_t key = key_at(u, r);
      const bool counts = r < m && (key & mask) == prefix;
      const unsigned active = __ballot_sync(0xffffffffu, counts);
      if (counts) {
        const uint32_t bin = (key >> shift) & 255u;
        const unsigned same = __match_any_sync(active, bin);
        if (lane == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
      }
    }
    __syncthreads();
    // Bins from the top: the one in which the running count reaches `need`.
    const int c = t < 256 ? hist[255 - t] : 0;
    int before;
    Scan(scan_tmp).ExclusiveSum(c, before);
    if (t < 256 && before < need && need <= before + c) {
      s_need = need - before;
      s_prefix = prefix | (static_cast<uint32_t>(255 - t) << shift);
    }
    __syncthreads();
    need = s_need;
    prefix = s_prefix;
    mask |= 255u << shift;
  }
  // Keys > T are all taken; of the keys == T, the first `need` in index order. One scan per
  // chunk counts both: equal keys in the high 16 bits, greater ones in the low (a chunk has
  // kSelectThreads < 2^16 rows).
  // With row_sumsq, the taken rows' sums of squares too: each thread's in chunk order, then a
  // fixed tree (reproducible).
  const uint32_t T = prefix;
  int base_eq = 0, base_out = 0;
  float ss = 0.0f;
#pragma unroll
  for (int u = 0; u < chunks; ++u) {
    const int64_t r = static_cast<int64_t>(u) * kSelectThreads + t;
    const uint32_t key = key_at(u, r);
    const int gt = r < m && key > T, eq = r < m && key == T;
    int before, total;
    Scan(scan_tmp).ExclusiveSum((eq << 16) | gt, before, total);
    const int rem = max(0, need - base_eq);  // equal keys still to take
    const int eq_before = before >> 16;
    if (gt || (eq && eq_before < rem)) {
      out[base_out + (before & 0xFFFF) + min(eq_before, rem)] = static_cast<int32_t>(r);
      if (row_sumsq) ss += row_sumsq[blockIdx.x * m + r];
    }
    base_out += (total & 0xFFFF) + min(total >> 16, rem);
    base_eq += total >> 16;
    __syncthreads();  // scan_tmp is used again
  }
  if (row_sumsq) {
    __shared__ float red[32];
    ss = block_sum(ss, red);
    if (t == 0) selected_sumsq[blockIdx.x] = ss;
  }
}

// ---- gather_rows: out[i][s] = c_i*(scale_m*M[idx[s]] + scale_g*G[idx[s]]); M[idx[s]] *= decay,
// with c_i = inverse_norm_of(sqrt(selected_sumsq[i]), norm) (gather_normalized's inverse norm) or 1 ----
// One warp per gathered row. With VEC each lane moves 4-element packs, four of them loaded before
// any is stored (more bytes in flight than a block per row with one pack per thread). With
// row_sumsq, also the sum of squares of the row as stored (each lane's sum in a fixed order, then
// a fixed shuffle tree: reproducible).
template <class TM, class TG, class TO, bool VEC>
__global__ void __launch_bounds__(32 * kRowWarps)
    gather_rows_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols, const int32_t* __restrict__ idx, int64_t k,
                       Hyper scale_m_h, Hyper scale_g_h, Hyper decay_h, const float* __restrict__ selected_sumsq,
                       NormGuard norm,
                       TO* __restrict__ out, int64_t out_ld, int64_t out_bstride, float* __restrict__ row_sumsq,
                       const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const float scale_m = scale_m_h.get(), scale_g = scale_g_h.get(), decay = decay_h.get();
  const int lane = threadIdx.x & 31;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5), i = blockIdx.y;
  if (s >= k) return;
  const int64_t r = idx ? idx[i * k + s] : s;
  TO* o = out ? out + i * out_bstride + s * out_ld : nullptr;  // null: only the decay
  if (r >= rows) {  // padding: a zero row
    if (o)
      for (int64_t j = lane; j < cols; j += 32) o[j] = from_f32<TO>(0.0f);
    if (row_sumsq && lane == 0) row_sumsq[i * k + s] = 0.0f;
    return;
  }
  const DeviceMat d = mats[i];
  TM* m = static_cast<TM*>(d.m) + r * d.ldm;
  const TG* g = static_cast<const TG*>(d.g) + r * d.ldg;
  const bool use_g = scale_g != 0.0f, do_decay = decay != 1.0f;
  // Applied after the loads (a branch on it would hold them back behind this one).
  const float c = selected_sumsq ? inverse_norm_of(sqrtf(selected_sumsq[i]), norm) : 1.0f;
  float ss = 0.0f;
  if constexpr (VEC) {
    Pack4<TM>* m4 = reinterpret_cast<Pack4<TM>*>(m);
    Pack4<TO>* o4 = reinterpret_cast<Pack4<TO>*>(o);
    for_row_packs<4>(m4, reinterpret_cast<const Pack4<TG>*>(g), cols / 4, lane, use_g,
                     [&](int64_t q, Pack4<TM>& mp, const Pack4<TG>& gp) {
                       Pack4<TO> op;
#pragma unroll
                       for (int e = 0; e < 4; ++e) {
                         const float mv = to_f32(mp.v[e]);
                         float v = scale_m * mv;
                         if (use_g) v += scale_g * to_f32(gp.v[e]);
                         op.v[e] = from_f32<TO>(c * v);
                         mp.v[e] = from_f32<TM>(decay * mv);
                         const float stored = to_f32(op.v[e]);
                         ss += stored * stored;
                       }
                       if (o4) o4[q] = op;
                       if (do_decay) m4[q] = mp;
                     });
  } else {
    for (int64_t j = lane; j < cols; j += 32) {
      const float mv = to_f32(m[j]);
      float v = scale_m * mv;
      if (use_g) v += scale_g * to_f32(g[j]);
      const TO ov = from_f32<TO>(c * v);
      if (o) o[j] = ov;
      if (do_decay) m[j] = from_f32<TM>(decay * mv);
      ss += to_f32(ov) * to_f32(ov);
    }
  }
  if (row_sumsq) {
    ss = warp_sum(ss);
    if (lane == 0) row_sumsq[i * k + s] = ss;
  }
}

// ---- row-wise helpers of apply_update -----------------------------------------------------
// One warp per row. Each lane moves groups of V consecutive elements, V = 16 bytes of the
// widest element type of the row's arrays (8 for 2-byte types, 4 with fp32), so every warp
// access is contiguous and the widest one 16 bytes per lane; and it loads several groups
// (~64-96 bytes) before it stores any, so independent accesses are in flight per thread (one
// 4-element access per thread left the memory system underused on long rows).

template <class... T>
constexpr int group_of() {
  return static_cast<int>(16 / std::max({sizeof(T)...}));
}
// Groups per lane loaded before any is stored, for groups of `bytes` loaded bytes.
constexpr int unroll_for(std::size_t bytes) { return std::clamp(static_cast<int>(96 / bytes), 1, 4); }

template <int V, class T>
__device__ __forceinline__ bool group_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (V * sizeof(T)) == 0;
}
// Elements of p before its first V-group boundary (at most n).
template <int V, class T>
__device__ __forceinline__ int group_head(const T* p, int n) {
  constexpr uintptr_t bytes = V * sizeof(T);
  const int h = static_cast<int>((bytes - reinterpret_cast<uintptr_t>(p) % bytes) % bytes / sizeof(T));
  return h < n ? h : n;
}

// Position of r in the ascending list id[0, k), or -1. The whole warp searches: each step splits
// the range into 32 parts (k <= 32768: at most three dependent loads instead of log2(k)).
__device__ __forceinline__ int64_t warp_find(const int32_t* __restrict__ id, int64_t k, int64_t r, int lane) {
  int64_t lo = 0, n = k;
  while (n > 32) {
    const int64_t step = (n + 31) >> 5, p = lo + lane * step;
    const unsigned le = __ballot_sync(0xffffffffu, p < lo + n && id[p] <= r);  // a prefix of lanes
    if (le == 0) return -1;
    const int64_t nlo = lo + (__popc(le) - 1) * step;
    n = min(step, lo + n - nlo);
    lo = nlo;
  }
  const unsigned eq = __ballot_sync(0xffffffffu, lane < n && id[lo + lane] == r);
  return eq ? lo + __ffs(eq) - 1 : -1;
}

// ---- apply_update ------------------------------------------------------------------------
// Pass 1 (NorMuon): per selected row, sum of squares of O; v = b2*v + (1-b2)*mean(O^2);
// inv = 1/(sqrt(v)+1e-8). Pass 2: per matrix, the Frobenius rescale factor. Pass 3: decay all
// rows, subtract the scaled update from the selected ones. O is read twice (passes 1 and 3):
// the rescale needs every row's sum before any row is updated.
// One warp per selected row (kRowWarps rows per block), four 4-element packs per lane in
// flight; each lane sums its elements in a fixed order, then a fixed shuffle tree (reproducible).
template <class TO>
__global__ void __launch_bounds__(32 * kRowWarps)
    normuon_rows_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols, const int32_t* __restrict__ idx, int64_t k,
                        const TO* __restrict__ O, int64_t o_ld, int64_t o_bstride, bool vec, Hyper beta2_h,
                        float* __restrict__ rowsq, float* __restrict__ inv, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const float beta2 = beta2_h.get();
  const int lane = threadIdx.x & 31;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5), i = blockIdx.y;
  if (s >= k) return;
  const TO* o = O + i * o_bstride + s * o_ld;
  const int64_t r = idx ? idx[i * k + s] : s;
  if (r >= rows) {  // padding: no part in the norms, never applied
    if (lane == 0) rowsq[i * k + s] = inv[i * k + s] = 0.0f;
    return;
  }
  // The variance element is fetched up front, so its latency overlaps the row's loads.
  float* v = mats[i].v + r;
  const float v_old = lane == 0 ? *v : 0.0f;
  float acc = 0.0f;
  if (vec) {
    const Pack4<TO>* o4 = reinterpret_cast<const Pack4<TO>*>(o);
    for_row_packs<4>(o4, o4, cols / 4, lane, false, [&](int64_t, const Pack4<TO>& p, const Pack4<TO>&) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc += to_f32(p.v[e]) * to_f32(p.v[e]);
    });
  } else {
    for (int64_t j = lane; j < cols; j += 32) {
      const float x = to_f32(o[j]);
      acc += x * x;
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    const float nv = beta2 * v_old + (1.0f - beta2) * (acc / static_cast<float>(cols));
    *v = nv;
    rowsq[i * k + s] = acc;
    inv[i * k + s] = 1.0f / (sqrtf(nv) + 1e-8f);
  }
}

__global__ void normuon_factor_kernel(int64_t k, const float* __restrict__ rowsq,
                                      float* __restrict__ inv, float* __restrict__ factor,
                                      const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  __shared__ float2 red[32];
  const int64_t i = blockIdx.x;
  float2 ab = make_float2(0.0f, 0.0f);
  for (int64_t s = threadIdx.x; s < k; s += blockDim.x) {
    const float q = rowsq[i * k + s], w = inv[i * k + s];
    ab.x += q;
    ab.y += q * w * w;
  }
  ab = block_sum(ab, red);
  if (threadIdx.x == 0) factor[i] = sqrtf(ab.x) / fmaxf(sqrtf(ab.y), 1e-8f);
}

struct UpdateArgs {
  float decay, scale;  // scale: lr_upd (times the NorMuon factors on selected rows)
  bool cautious;
};

// Elements [j0, j0 + V*ng) of one weight row: SEL (the row has an update row o): w = w*dec - o*scale
// with dec = 1 where cautious decay vetoes it; otherwise plain decay w = w*decay.
template <int V, bool SEL, class TW, class TO>
__device__ __forceinline__ void update_span(TW* w, const TO* o, int j0, int ng, const UpdateArgs& a, int lane) {
  using PW = PackV<TW, V>;
  using PO = PackV<TO, V>;
  constexpr int U = unroll_for(sizeof(PW) + (SEL ? sizeof(PO) : 0));
  PW* wi = reinterpret_cast<PW*>(w + j0);
  const PO* oi = nullptr;
  if constexpr (SEL) oi = reinterpret_cast<const PO*>(o + j0);
  for (int q0 = lane; q0 < ng; q0 += 32 * U) {
    PW wp[U];
    PO op[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + 32 * u;
      if (q < ng) {
        wp[u] = wi[q];
        if constexpr (SEL) op[u] = oi[q];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + 32 * u;
      if (q >= ng) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float wv = to_f32(wp[u].v[e]);
        if constexpr (SEL) {
          const float x = to_f32(op[u].v[e]) * a.scale;
          float dec = a.decay;
          if (a.cautious && !(x * wv > 0.0f)) dec = 1.0f;
          wp[u].v[e] = from_f32<TW>(wv * dec - x);
        } else {
          wp[u].v[e] = from_f32<TW>(wv * a.decay);
        }
      }
      wi[q] = wp[u];
    }
  }
}

// The whole row: groups from the first element at which w (and o) are group-aligned, the
// elements before and after them one at a time.
template <bool SEL, class TW, class TO>
__device__ __forceinline__ void update_row(TW* w, const TO* o, int n, const UpdateArgs& a, int lane) {
  constexpr int V = SEL ? group_of<TW, TO>() : group_of<TW>();
  const int h = group_head<V>(w, n);
  if constexpr (SEL) {
    if (!group_aligned<V>(o + h)) {
      update_span<1, SEL>(w, o, 0, n, a, lane);
      return;
    }
  }
  const int body = (n - h) / V;
  update_span<1, SEL>(w, o, 0, h, a, lane);
  update_span<V, SEL>(w, o, h, body, a, lane);
  update_span<1, SEL>(w, o, h + V * body, n - h - V * body, a, lane);
}

template <class TW, class TO>
__global__ void __launch_bounds__(32 * kRowWarps)
    update_rows_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols, const int32_t* __restrict__ idx,
                       int64_t k, const TO* __restrict__ O, int64_t o_ld, int64_t o_bstride, Hyper decay_h,
                       Hyper lr_upd_h, bool cautious, const float* __restrict__ inv, const float* __restrict__ factor,
                       const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const float decay = decay_h.get(), lr_upd = lr_upd_h.get();
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5), i = blockIdx.y;
  if (r >= rows) return;
  const DeviceMat& d = mats[i];
  TW* w = static_cast<TW*>(d.w) + r * d.ldw;
  const int64_t pos = idx ? warp_find(idx + i * k, k, r, lane) : r;
  if (pos < 0) {
    // Unselected row: only weight decay (cautious decay: the update is zero, so no decay).
    if (decay == 1.0f || cautious) return;
    update_row<false>(w, static_cast<const TO*>(nullptr), static_cast<int>(cols), UpdateArgs{decay, 0.0f, false}, lane);
    return;
  }
  float scale = lr_upd;
  if (inv != nullptr) scale *= inv[i * k + pos] * factor[i];
  update_row<true>(w, O + i * o_bstride + pos * o_ld, static_cast<int>(cols), UpdateArgs{decay, scale, cautious}, lane);
}

// ---- check_finite -------------------------------------------------------------------------
// Contiguous 16-byte-aligned views (gradients, in practice all of them) are read as one flat
// sequence of 16-byte words: every block checks kFiniteChunk words of one view, eight loads in
// flight per thread, so big and small views alike keep the memory system busy (a fixed grid per
// view left the many small views' blocks idle early). Other views take the
// element-wise kernel.
constexpr int kFiniteThreads = 256, kFiniteWordsPerThread = 8, kFiniteSegments = 64;
constexpr int64_t kFiniteChunk = kFiniteThreads * kFiniteWordsPerThread;
struct FiniteSegment {
  const uint4* words;
  int64_t nwords, tail;  // whole 16-byte words, then elements after them
  int dtype;             // 0 f32, 1 f16, 2 bf16
};
struct FiniteSegments {
  FiniteSegment seg[kFiniteSegments];
  int64_t first_block[kFiniteSegments];  // ascending; segment s owns blocks [first_block[s], first_block[s+1])
  int count;
};
struct FiniteView {
  const void* data;
  int64_t batch, rows, cols, ld, bstride, total;
  int dtype;
};
struct FiniteViews {
  FiniteView v[kFiniteSegments];
};

// The segment owning this block: the last one whose first block is at or before it
// (first_block ascending, first_block[0] == 0).
__device__ __forceinline__ int segment_of_block(const int64_t* first_block, int count) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_block[mid] <= static_cast<int64_t>(blockIdx.x)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// True when no element of the 16 bytes is Inf/NaN (exponent bits all ones), read bitwise.
template <class T>
__device__ __forceinline__ bool words_finite(const uint4 w) {
  const uint32_t x[4] = {w.x, w.y, w.z, w.w};
  bool ok = true;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if constexpr (sizeof(T) == 4) {
      ok &= (x[e] & 0x7F800000u) != 0x7F800000u;
    } else {
      constexpr uint32_t M = std::is_same_v<T, __half> ? 0x7C00u : 0x7F80u;
      ok &= ((x[e] & M) != M) & (((x[e] >> 16) & M) != M);
    }
  }
  return ok;
}

template <class T>
__device__ bool chunk_finite(const FiniteSegment& sg, int64_t chunk) {
  uint4 w[kFiniteWordsPerThread];
  const int64_t base = chunk * kFiniteChunk + threadIdx.x;
#pragma unroll
  for (int u = 0; u < kFiniteWordsPerThread; ++u) {
    const int64_t q = base + u * kFiniteThreads;
    w[u] = q < sg.nwords ? __ldg(sg.words + q) : make_uint4(0, 0, 0, 0);
  }
  bool ok = true;
#pragma unroll
  for (int u = 0; u < kFiniteWordsPerThread; ++u) ok &= words_finite<T>(w[u]);
  if ((chunk + 1) * kFiniteChunk >= sg.nwords && threadIdx.x < sg.tail)
    ok &= isfinite(to_f32(reinterpret_cast<const T*>(sg.words + sg.nwords)[threadIdx.x]));
  return ok;
}

__global__ void __launch_bounds__(kFiniteThreads) check_finite_flat_kernel(const __grid_constant__ FiniteSegments a,
                                                                           int* flag) {
  pdl_wait();
  const int lo = segment_of_block(a.first_block, a.count);
  const FiniteSegment& sg = a.seg[lo];
  const int64_t chunk = blockIdx.x - a.first_block[lo];
  bool ok;
  switch (sg.dtype) {
    case 0: ok = chunk_finite<float>(sg, chunk); break;
    case 1: ok = chunk_finite<__half>(sg, chunk); break;
    default: ok = chunk_finite<__nv_bfloat16>(sg, chunk); break;
  }
  if (__syncthreads_or(!ok) && threadIdx.x == 0) atomicOr(flag, 1);
}

template <class T>
__device__ bool view_finite(const FiniteView& fv) {
  const T* p = static_cast<const T*>(fv.data);
  bool ok = true;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < fv.total; e += stride) {
    const int64_t c = e % fv.cols, rr = e / fv.cols;
    ok &= isfinite(to_f32(p[(rr / fv.rows) * fv.bstride + (rr % fv.rows) * fv.ld + c]));
  }
  return ok;
}

__global__ void check_finite_kernel(const __grid_constant__ FiniteViews args, int* flag) {
  pdl_wait();
  const FiniteView& fv = args.v[blockIdx.y];
  bool ok = true;
  switch (fv.dtype) {
    case 0: ok = view_finite<float>(fv); break;
    case 1: ok = view_finite<__half>(fv); break;
    default: ok = view_finite<__nv_bfloat16>(fv); break;
  }
  if (__syncthreads_or(!ok) && threadIdx.x == 0) atomicOr(flag, 1);
}


// ---- check_step ----------------------------------------------------------------------------
// The state a step would store, evaluated and not written (Backend::check_step). A persistent
// grid (as many blocks as fit on the device at once) walks up to kStepSegments parameters of one
// (gradient, state) dtype pair per launch, each with a grid-stride loop of kStepPacks packs of 8
// elements per thread in flight (16-byte loads of 16-bit data, streaming: read once). One short
// block per chunk instead left the memory system idle between blocks and fell well short of the
// device's read rate (bench/cuda_pass_bench.cu measures both against a plain read).
constexpr int kStepThreads = 256, kStepPacks = 4, kStepSegments = 40;
// Segments with a known momentum bound mostly read their gradient alone (CheckMode::Known), half
// the bytes a pack of the whole read brings; they keep more packs in flight instead, at as many
// blocks an SM as the whole read (bench/results/ has the pack counts tried).
constexpr int kKnownPacks = 6, kKnownBlocksPerSm = 3;
struct StepSegment {
  const void* g;
  const void* s;
  const void* s2;
  const float* bound;  // StepCheck::state_bound, or null
  int64_t n;
  Hyper a, b, c;  // StepCheck's (the rule is the launch's: one kernel per rule)
  bool vec;  // n % 8 == 0 and every pointer aligned to 8 elements
};
struct StepSegments {
  StepSegment seg[kStepSegments];
  int count;
};
// Kernel parameters past 4 KB need a newer driver path and cost launch time.
static_assert(sizeof(StepSegments) <= 4096, "fewer segments per launch");

// Rounding a float32 x to T gives a finite value iff |x| < this (round to nearest even: the
// halfway point above T's largest value rounds up to Inf). NaN compares false, so one test
// also catches a NaN or Inf gradient, which makes x non-finite.
template <class T>
__device__ __forceinline__ float overflow_bound() {
  if constexpr (std::is_same_v<T, __half>) return 65520.0f;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(0x7F7F8000u);
  else return __uint_as_float(0x7F800000u);  // Inf: every finite float32
}

template <class T>
__device__ constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, __half>) return DType::F16;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::BF16;
  else return DType::F32;
}

// Whether one element's new state (and gradient) is finite, by the rules the update kernels
// use: accumulate_kernel's decay*m + grad_scale*g (a, c here), AdamWRule, LionRule.
template <int kRule, class TS>
__device__ __forceinline__ bool step_element_finite(float g, float m, float v, float a, float b, float c) {
  const float bound = overflow_bound<TS>();
  if constexpr (kRule == StepCheck::Momentum) {
    const float m1 = a * m + c * g;
    if (!(fabsf(m1) < bound)) return false;
    return b == 0.0f || fabsf(b * to_f32(from_f32<TS>(m1)) + c * g) < overflow_bound<float>();
  } else if constexpr (kRule == StepCheck::AdamW) {
    // The second moment also >= 0: the update divides by its square root (a negative one can only
    // have been written from outside, and the step would make the weights NaN).
    const float v1 = AdamWRule::exp_avg_sq(v, g, b);
    return fabsf(AdamWRule::exp_avg(m, g, a)) < bound && v1 >= 0.0f && v1 < bound;
  } else {
    return fabsf(LionRule::exp_avg(m, g, b)) < bound;
  }
}

// Packs base + u * stride for each bit u of `need`, gradient and state loaded again and checked
// exactly, one pack at a time: rare (a gradient the state bound does not settle), and a rolled
// loop keeps the common path's registers few.
template <int kRule, class TG, class TS>
__device__ __forceinline__ bool packs_finite(const TG* g, const TS* m, const TS* v, int64_t base, int64_t stride,
                                          unsigned need, float ca, float cb, float cc) {
  bool ok = true;
#pragma unroll 1
  for (; need != 0; need &= need - 1) {
    const int64_t q = base + (__ffs(need) - 1) * stride;
    const PackV<TG, 8> gq = load_streaming(reinterpret_cast<const PackV<TG, 8>*>(g) + q);
    const PackV<TS, 8> mq = load_streaming(reinterpret_cast<const PackV<TS, 8>*>(m) + q);
    PackV<TS, 8> vq{};
    if constexpr (kRule == StepCheck::AdamW) vq = load_streaming(reinterpret_cast<const PackV<TS, 8>*>(v) + q);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      ok &= step_element_finite<kRule, TS>(to_f32(gq.v[e]), to_f32(mq.v[e]), to_f32(vq.v[e]), ca, cb, cc);
  }
  return ok;
}

// This thread's share of one segment: packs tid, tid + stride, ... (kPacks of them loaded
// before any is used), or elements so where the segment does not allow 16-byte loads. kBounded
// (a known state bound): only the gradient packs are loaded ahead; a pack whose gradient is not
// below the bound's limit (state_gradient_limit) is then loaded again with its state and checked
// exactly, the others being finite whatever the state holds.
template <int kRule, class TG, class TS, bool kBounded, int kPacks>
__device__ __forceinline__ bool segment_finite(const StepSegment& sg, int64_t tid, int64_t stride, float limit) {
  constexpr bool kSecond = kRule == StepCheck::AdamW;
  const float ca = sg.a.get(), cb = sg.b.get(), cc = sg.c.get();
  const TG* __restrict__ g = static_cast<const TG*>(sg.g);
  const TS* __restrict__ m = static_cast<const TS*>(sg.s);
  const TS* __restrict__ v = static_cast<const TS*>(sg.s2);
  bool ok = true;
  if (sg.vec) {
    using PG = PackV<TG, 8>;
    using PS = PackV<TS, 8>;
    const int64_t npacks = sg.n / 8;
    for (int64_t base = tid; base < npacks; base += stride * kPacks) {
      PG gp[kPacks];
      [[maybe_unused]] PS mp[kBounded ? 1 : kPacks], vp[kSecond && !kBounded ? kPacks : 1];
#pragma unroll
      for (int u = 0; u < kPacks; ++u) {
        const int64_t q = base + u * stride;
        if (q < npacks) {
          gp[u] = load_streaming(reinterpret_cast<const PG*>(g) + q);
          if constexpr (!kBounded) mp[u] = load_streaming(reinterpret_cast<const PS*>(m) + q);
          if constexpr (kSecond && !kBounded) vp[u] = load_streaming(reinterpret_cast<const PS*>(v) + q);
        }
      }
      if constexpr (kBounded) {
        unsigned need = 0;  // packs whose gradient the bound does not settle
#pragma unroll
        for (int u = 0; u < kPacks; ++u) {
          if (base + u * stride >= npacks) continue;
          bool small = true;
#pragma unroll
          for (int e = 0; e < 8; ++e) small &= fabsf(to_f32(gp[u].v[e])) <= limit;
          if (!small) need |= 1u << u;
        }
        if (need != 0) ok &= packs_finite<kRule, TG, TS>(g, m, v, base, stride, need, ca, cb, cc);
      } else {
#pragma unroll
        for (int u = 0; u < kPacks; ++u)
          if (base + u * stride < npacks)
#pragma unroll
            for (int e = 0; e < 8; ++e)
              ok &= step_element_finite<kRule, TS>(to_f32(gp[u].v[e]), to_f32(mp[u].v[e]),
                                                   kSecond ? to_f32(vp[u].v[e]) : 0.0f, ca, cb, cc);
      }
    }
  } else {
    for (int64_t e = tid; e < sg.n; e += stride) {
      const float ge = to_f32(g[e]);
      if (kBounded && fabsf(ge) <= limit) continue;
      ok &= step_element_finite<kRule, TS>(ge, to_f32(m[e]), kSecond ? to_f32(v[e]) : 0.0f, ca, cb, cc);
    }
  }
  return ok;
}

// One rule per kernel: the three rules' bodies in one kernel took twice the registers of the
// Momentum rule's alone, halving the blocks per SM and the loads in flight. A table of segments
// with state bounds takes two launches, each lean in registers: Known, the segments whose bound
// the device finds known, reading the gradients alone (with more packs in flight, kKnownPacks);
// then Unknown, the others, read whole.
enum class CheckMode { Whole, Known, Unknown };
template <int kRule, class TG, class TS, CheckMode kMode>
__global__ void __launch_bounds__(kStepThreads, kMode == CheckMode::Known ? kKnownBlocksPerSm : 1)
    check_step_kernel(const __grid_constant__ StepSegments a, int* flag) {
  pdl_wait();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kStepThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kStepThreads + threadIdx.x;
  bool ok = true;
  if constexpr (kMode == CheckMode::Whole) {
    for (int i = 0; i < a.count; ++i) ok &= segment_finite<kRule, TG, TS, false, kStepPacks>(a.seg[i], tid, stride, -1.0f);
  } else {
    // Every segment's gradient limit, one thread each: the bounds' loads in parallel rather than
    // one latency per segment. Known and Unknown launches compute the same values: each segment
    // is checked by one of them, and a launch with none of its own leaves at once.
    __shared__ float s_limit[kStepSegments];
    static_assert(kStepSegments <= kStepThreads);
    if (threadIdx.x < a.count) {
      const StepSegment& sg = a.seg[threadIdx.x];
      s_limit[threadIdx.x] = state_gradient_limit(static_cast<StepCheck::Rule>(kRule), sg.bound, sg.a.get(),
                                                  sg.b.get(), largest_finite(dtype_of<TS>()));
    }
    const bool mine = threadIdx.x < a.count && (s_limit[threadIdx.x] >= 0.0f) == (kMode == CheckMode::Known);
    if (!__syncthreads_or(mine)) return;
    for (int i = 0; i < a.count; ++i) {
      const float limit = s_limit[i];
      if ((limit >= 0.0f) != (kMode == CheckMode::Known)) continue;
      if constexpr (kMode == CheckMode::Known) ok &= segment_finite<kRule, TG, TS, true, kKnownPacks>(a.seg[i], tid, stride, limit);
      else ok &= segment_finite<kRule, TG, TS, false, kStepPacks>(a.seg[i], tid, stride, -1.0f);
    }
  }
  if (__syncthreads_or(!ok) && threadIdx.x == 0) atomicOr(flag, 1);
}

}  // namespace

void launch_accumulate(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt,
                       DType gdt, Hyper decay, Hyper grad_scale, float* scores, float* row_sumsq, float* largest,
                       const int* skip, cudaStream_t s, bool vec) {
  if (nmats == 0 || rows == 0) return;
  const dim3 grid(ceil_div_u(rows, kRowWarps), static_cast<unsigned>(nmats));
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      if (vec)
        launch_pdl(accumulate_kernel<TM, TG, true>, grid, 32 * kRowWarps, 0, s, mats, rows, cols, decay,
                   grad_scale, scores, row_sumsq, largest, skip);
      else
        launch_pdl(accumulate_kernel<TM, TG, false>, grid, 32 * kRowWarps, 0, s, mats, rows, cols, decay,
                   grad_scale, scores, row_sumsq, largest, skip);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

void launch_select_rows(const float* scores, int64_t count, int64_t m, int64_t k, int32_t* idx,
                        float* largest, const float* row_sumsq, float* selected_sumsq, const int* skip,
                        cudaStream_t s) {
  if (count == 0 || k == 0) return;
  if (k > m) fail("select_rows: k = " + std::to_string(k) + " exceeds m = " + std::to_string(m));
  if (row_sumsq && !selected_sumsq) fail("select_rows: row_sumsq without selected_sumsq");
  const unsigned grid = static_cast<unsigned>(count);
  const int64_t chunks = (m + kSelectThreads - 1) / kSelectThreads;
  auto launch = [&](auto kernel) {
    launch_pdl(kernel, grid, kSelectThreads, 0, s, scores, m, k, idx, largest, row_sumsq, selected_sumsq, skip);
  };
  if (chunks <= 2) launch(select_rows_kernel<2>);
  else if (chunks <= 4) launch(select_rows_kernel<4>);
  else if (chunks <= 8) launch(select_rows_kernel<8>);
  else launch(select_rows_kernel<0>);
}

void launch_gather_rows(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt,
                        DType gdt, const int32_t* idx, int64_t k, Hyper scale_m, Hyper scale_g,
                        Hyper decay, const float* selected_sumsq, NormGuard norm, const MatrixView& out,
                        float* row_sumsq, const int* skip, cudaStream_t s, bool vec) {
  if (nmats == 0 || k == 0) return;
  dim3 grid(ceil_div_u(k, kRowWarps), static_cast<unsigned>(nmats));
  const int64_t obs = out.batch > 1 ? out.batch_stride : k * out.ld;
  const bool vo = vec && out.ld % 4 == 0 && obs % 4 == 0 && aligned4(out.data, dtype_size(out.dtype));
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      DION3_DISPATCH_FLOAT(out.dtype, TO, [&] {
        auto* o = static_cast<TO*>(out.data);
        if (vo)
          launch_pdl(gather_rows_kernel<TM, TG, TO, true>, grid, 32 * kRowWarps, 0, s, mats, rows, cols, idx, k, scale_m,
                     scale_g, decay, selected_sumsq, norm, o, out.ld, obs, row_sumsq, skip);
        else
          launch_pdl(gather_rows_kernel<TM, TG, TO, false>, grid, 32 * kRowWarps, 0, s, mats, rows, cols, idx, k, scale_m,
                     scale_g, decay, selected_sumsq, norm, o, out.ld, obs, row_sumsq, skip);
      });
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

int64_t apply_update_scratch_floats(int64_t nmats, int64_t k) { return 2 * nmats * k + nmats; }

void launch_normuon_factors(const DeviceMat* mats, int64_t nmats, int64_t rows, const int32_t* idx, int64_t k,
                            const MatrixView& O, Hyper beta2, float* scratch, const int* skip, cudaStream_t s) {
  if (nmats == 0 || k == 0) return;
  const int64_t obs = O.batch > 1 ? O.batch_stride : k * O.ld;
  float* rowsq = scratch;
  float* inv = scratch + nmats * k;
  float* factor = scratch + 2 * nmats * k;
  DION3_DISPATCH_FLOAT(O.dtype, TO, [&] {
    const bool o4 = O.cols % 4 == 0 && O.ld % 4 == 0 && obs % 4 == 0 && aligned4(O.data, sizeof(TO));
    launch_pdl(normuon_rows_kernel<TO>, dim3(ceil_div_u(k, kRowWarps), static_cast<unsigned>(nmats)), 32 * kRowWarps,
               0, s, mats, rows, O.cols, idx, k, static_cast<const TO*>(O.data), O.ld, obs, o4, beta2, rowsq, inv,
               skip);
    launch_pdl(normuon_factor_kernel, static_cast<unsigned>(nmats), 256, 0, s, k, rowsq, inv, factor, skip);
  });
  DION3_CUDA_LAUNCH_CHECK();
}

// Bytes moved: NorMuon pass nmats*k*cols*sizeof(O); update nmats*(rows*cols*2*sizeof(W) +
// k*cols*sizeof(O)) (unselected rows are not touched when decay == 1 or under cautious decay).
void launch_apply_update(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType wdt,
                         const int32_t* idx, int64_t k, const MatrixView& O, const UpdateParams& p,
                         float* scratch, const int* skip, cudaStream_t s) {
  if (nmats == 0 || rows == 0) return;
  if (cols > INT32_MAX) fail("apply_update: rows longer than 2^31 - 1 elements");
  const int64_t obs = O.batch > 1 ? O.batch_stride : k * O.ld;
  const float* inv = scratch + nmats * k;
  const float* factor = scratch + 2 * nmats * k;
  // Statistics over all of O's columns (whole rows when column-sharded).
  if (p.normuon) launch_normuon_factors(mats, nmats, rows, idx, k, O, p.beta2, scratch, skip, s);
  DION3_DISPATCH_FLOAT(O.dtype, TO, [&] {
    const TO* o = static_cast<const TO*>(O.data);
    DION3_DISPATCH_FLOAT(wdt, TW, [&] {
      const dim3 grid(ceil_div_u(rows, kRowWarps), static_cast<unsigned>(nmats));
      const float* iv = p.normuon && k > 0 ? inv : nullptr;
      launch_pdl(update_rows_kernel<TW, TO>, grid, 32 * kRowWarps, 0, s, mats, rows, cols, idx, k,
                 o + p.o_col_offset, O.ld, obs, p.decay, p.adjusted_lr, p.cautious_wd, iv, factor, skip);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

void launch_check_step(std::span<const StepCheck> xs, int* flag, cudaStream_t s) {
  // One table per (rule, gradient dtype, state dtype, bounded), launched when full and at the end.
  struct Table {
    int rule;
    DType gdt, sdt;
    bool bounded;
    StepSegments t{};
  };
  std::vector<Table> tables;
  auto flush = [&](Table& tb) {
    if (tb.t.count == 0) return;
    auto launch = [&](auto rule, auto mode) {
      DION3_DISPATCH_FLOAT(tb.gdt, TG, [&] {
        DION3_DISPATCH_FLOAT(tb.sdt, TS, [&] {
          constexpr int kRule = decltype(rule)::value;
          constexpr CheckMode kMode = decltype(mode)::value;
          static const unsigned blocks = persistent_blocks(check_step_kernel<kRule, TG, TS, kMode>, kStepThreads);
          launch_pdl(check_step_kernel<kRule, TG, TS, kMode>, blocks, kStepThreads, 0, s, tb.t, flag);
        });
      });
    };
    // A table with state bounds: Known, then Unknown; else one Whole launch.
    auto launch_rule = [&](auto rule) {
      if (tb.bounded) {
        launch(rule, std::integral_constant<CheckMode, CheckMode::Known>{});
        launch(rule, std::integral_constant<CheckMode, CheckMode::Unknown>{});
      } else {
        launch(rule, std::integral_constant<CheckMode, CheckMode::Whole>{});
      }
    };
    switch (tb.rule) {
      case StepCheck::Momentum: launch_rule(std::integral_constant<int, StepCheck::Momentum>{}); break;
      case StepCheck::AdamW: launch_rule(std::integral_constant<int, StepCheck::AdamW>{}); break;
      default: launch_rule(std::integral_constant<int, StepCheck::Lion>{});
    }
    DION3_CUDA_LAUNCH_CHECK();
    tb.t = StepSegments{};
  };
  auto aligned8 = [](const void* p, DType t) { return reinterpret_cast<std::uintptr_t>(p) % (8 * dtype_size(t)) == 0; };
  for (const StepCheck& x : xs) {
    const int64_t n = x.grad.cols * x.grad.rows * x.grad.batch;
    if (n == 0) continue;
    const bool second = x.rule == StepCheck::AdamW;
    if (second && x.state2.dtype != x.state.dtype) fail("check_step: exp_avg and exp_avg_sq dtypes differ");
    const bool bounded = x.state_bound != nullptr;
    Table* tb = nullptr;
    for (Table& t : tables)
      if (t.rule == x.rule && t.gdt == x.grad.dtype && t.sdt == x.state.dtype && t.bounded == bounded) tb = &t;
    if (!tb) tb = &tables.emplace_back(Table{x.rule, x.grad.dtype, x.state.dtype, bounded});
    tb->t.seg[tb->t.count++] =
        StepSegment{x.grad.data, x.state.data, second ? x.state2.data : nullptr, bounded ? x.state_bound : nullptr, n,
                    x.a, x.b, x.c,
                    n % 8 == 0 && aligned8(x.grad.data, x.grad.dtype) && aligned8(x.state.data, x.state.dtype) &&
                        (!second || aligned8(x.state2.data, x.state2.dtype))};
    if (tb->t.count == kStepSegments) flush(*tb);
  }
  for (Table& t : tables) flush(t);
}

void launch_check_finite(std::span<const MatrixView> xs, int* flag, cudaStream_t s) {
  auto code_of = [](DType t) {
    switch (t) {
      case DType::F32: return 0;
      case DType::F16: return 1;
      case DType::BF16: return 2;
      default: fail(std::string("check_finite: unsupported dtype ") + dtype_name(t));
    }
  };
  FiniteSegments flat{};
  int64_t blocks = 0;
  auto flush_flat = [&] {
    if (flat.count == 0) return;
    launch_pdl(check_finite_flat_kernel, static_cast<unsigned>(blocks), kFiniteThreads, 0, s, flat, flag);
    flat = FiniteSegments{};
    blocks = 0;
  };
  FiniteViews strided{};
  int nstrided = 0;
  int64_t max_total = 0;
  auto flush_strided = [&] {
    if (nstrided == 0) return;
    const unsigned gx = std::min<unsigned>(ceil_div_u(max_total, 256 * 8), 1024);
    launch_pdl(check_finite_kernel, dim3(gx, static_cast<unsigned>(nstrided)), 256, 0, s, strided, flag);
    strided = FiniteViews{};
    nstrided = 0;
    max_total = 0;
  };
  for (const MatrixView& x : xs) {
    const int code = code_of(x.dtype);
    const int64_t total = x.batch * x.rows * x.cols, ld = x.ld ? x.ld : x.cols;
    if (total == 0) continue;
    const bool contiguous = ld == x.cols && (x.batch == 1 || x.batch_stride == x.rows * x.cols);
    if (contiguous && reinterpret_cast<uintptr_t>(x.data) % 16 == 0) {
      const int64_t per = 16 / static_cast<int64_t>(dtype_size(x.dtype));
      FiniteSegment& sg = flat.seg[flat.count];
      sg = FiniteSegment{static_cast<const uint4*>(x.data), total / per, total % per, code};
      flat.first_block[flat.count++] = blocks;
      blocks += std::max<int64_t>(1, (sg.nwords + kFiniteChunk - 1) / kFiniteChunk);
      if (flat.count == kFiniteSegments) flush_flat();
    } else {
      strided.v[nstrided++] = FiniteView{x.data, x.batch, x.rows, x.cols, ld, x.batch_stride, total, code};
      max_total = std::max(max_total, total);
      if (nstrided == kFiniteSegments) flush_strided();
    }
  }
  flush_flat();
  flush_strided();
}

// ---- remap_rows: one block per list; the list is ascending, so the entries in [lo, hi) are one
// run, found by two binary searches ------------------------------------------------------------
__global__ void remap_rows_kernel(const int32_t* __restrict__ in, int64_t k_in, int64_t lo, int64_t hi,
                                  int64_t k_out, int32_t* __restrict__ out, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  __shared__ int64_t run[2];
  const int32_t* a = in + blockIdx.x * k_in;
  if (threadIdx.x == 0) {
    run[0] = lower_bound_i32(a, k_in, lo);
    run[1] = lower_bound_i32(a, k_in, hi);
  }
  __syncthreads();
  const int64_t first = run[0], n = min(run[1] - run[0], k_out);
  int32_t* o = out + blockIdx.x * k_out;
  for (int64_t t = threadIdx.x; t < k_out; t += blockDim.x)
    o[t] = t < n ? static_cast<int32_t>(a[first + t] - lo) : kPadRow;
}

void launch_remap_rows(const int32_t* in, int64_t count, int64_t k_in, int64_t lo, int64_t hi, int64_t k_out,
                       int32_t* out, const int* skip, cudaStream_t s) {
  if (count == 0 || k_out == 0) return;
  launch_pdl(remap_rows_kernel, static_cast<unsigned>(count), 256, 0, s, in, k_in, lo, hi, k_out, out, skip);
  DION3_CUDA_LAUNCH_CHECK();
}

// ---- selection_slots: one block per selection, one thread per entry; start_s by binary search --
__global__ void selection_slots_kernel(const int32_t* __restrict__ idx, int64_t k, int64_t c, int64_t piece,
                                       int64_t block, int64_t first_slot, int32_t* __restrict__ out,
                                       const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const int64_t i = blockIdx.x;
  const int32_t* g = idx + i * k;
  for (int64_t t = threadIdx.x; t < k; t += blockDim.x) {
    const int64_t s = g[t] / c;
    const int64_t start = lower_bound_i32(g, k, s * c);
    out[i * k + t] = static_cast<int32_t>((s * block + first_slot + i) * piece + t - start);
  }
}

void launch_selection_slots(const int32_t* idx, int64_t count, int64_t k, int64_t c, int64_t piece, int64_t block,
                            int64_t first_slot, int32_t* out, const int* skip, cudaStream_t s) {
  if (count == 0 || k == 0) return;
  launch_pdl(selection_slots_kernel, static_cast<unsigned>(count), 256, 0, s, idx, k, c, piece, block, first_slot,
             out, skip);
  DION3_CUDA_LAUNCH_CHECK();
}

// ---- copy_rows: one block per row; 16-byte words where every address allows it ---------------
template <class W>
__global__ void copy_rows_kernel(char* __restrict__ dst, std::size_t dst_pitch, const int32_t* __restrict__ dst_idx,
                                 const char* __restrict__ src, std::size_t src_pitch,
                                 const int32_t* __restrict__ src_idx, std::size_t words) {
  pdl_wait();
  const int64_t i = blockIdx.x;
  W* d = reinterpret_cast<W*>(dst + (dst_idx ? dst_idx[i] : i) * dst_pitch);
  const W* q = reinterpret_cast<const W*>(src + (src_idx ? src_idx[i] : i) * src_pitch);
  for (std::size_t e = threadIdx.x; e < words; e += blockDim.x) d[e] = q[e];
}

void launch_copy_rows(void* dst, std::size_t dst_pitch, const int32_t* dst_idx, const void* src,
                      std::size_t src_pitch, const int32_t* src_idx, std::size_t width, int64_t rows,
                      cudaStream_t s) {
  if (rows == 0 || width == 0) return;
  const bool wide = width % 16 == 0 && dst_pitch % 16 == 0 && src_pitch % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  auto* d = static_cast<char*>(dst);
  auto* q = static_cast<const char*>(src);
  if (wide)
    launch_pdl(copy_rows_kernel<uint4>, static_cast<unsigned>(rows), 256, 0, s, d, dst_pitch, dst_idx, q, src_pitch,
               src_idx, width / 16);
  else
    launch_pdl(copy_rows_kernel<char>, static_cast<unsigned>(rows), 256, 0, s, d, dst_pitch, dst_idx, q, src_pitch,
               src_idx, width);
  DION3_CUDA_LAUNCH_CHECK();
}

// One thread: the step's verdict into the applied / dropped counters (see Backend::finish_step).
__global__ void finish_step_kernel(const int* flag, int64_t* counters, int count_dropped) {
  pdl_wait();
  if (!*flag) ++counters[0];
  else if (count_dropped && !(*flag & kNotAStep)) ++counters[1];
}

void launch_finish_step(const int* flag, int64_t* counters, bool count_dropped, cudaStream_t s) {
  launch_pdl(finish_step_kernel, 1, 1, 0, s, flag, counters, static_cast<int>(count_dropped));
}

// One thread: the agreement's regions into the step's flag (see Backend::settle_agreement).
__global__ void settle_agreement_kernel(int* words, int regions) {
  pdl_wait();
  settle_agreement_words(words, regions);
}

void launch_settle_agreement(int* words, int regions, cudaStream_t s) {
  launch_pdl(settle_agreement_kernel, 1, 1, 0, s, words, regions);
  DION3_CUDA_LAUNCH_CHECK();
}

}  // namespace dion3::cuda
