// column_kernels.cu — the matrix step on column-stepped sets (MatrixSet::columns: Dion2 on a
// tall matrix, Dion3 and NorMuon on a transposed group's, whose set rows are the stored columns):
// accumulate with column ℓ1 scores, the gather of selected columns with error-feedback decay, and
// the update of the selected columns (with NorMuon's factors).
// Rows are cut into chunks so that a few wide matrices still fill the GPU; per-chunk partial sums
// go to scratch and are added in chunk order afterwards, so results do not depend on scheduling.
// The gather stages 32 stored rows of a chunk of columns in shared memory, so that M is read along
// its rows and the rows of the gathered matrix are written along their length; the update stages
// bands of weight rows likewise, reading and writing the weights once. Both find a chunk's entries
// of the ascending selection with a search by two warps. Each kernel honours `skip`.
#include <algorithm>

#include "cuda/kernels.cuh"

namespace dion3::cuda {
namespace {

constexpr int kColumnThreads = 256;
// The update's band of weights (and its bitmap) stays within the default dynamic shared memory
// of a block, leaving room for several blocks per multiprocessor.
constexpr int kBandRows = 8;
constexpr int64_t kBandBytes = 32 * 1024;
// A band row is one 16-byte pack per thread of the update's block.
static_assert(kBandBytes / kBandRows / 16 == kColumnThreads);
constexpr int64_t kMaxRowChunks = 32;  // row chunks of the accumulate
constexpr int kColumnRowsInFlight = 4;  // rows of 4-element packs the vectorized accumulate loads ahead
constexpr int kGatherRows = 32;         // stored rows of a gather block: one per lane
constexpr int kGatherThreads = 256;
constexpr int kGatherBlocksPerSm = 4;  // compiled for four blocks an SM: at most 64 registers
constexpr int64_t kGatherRowBytes = 1024;  // bytes of M (and G, staged) per row of a gather block

int64_t row_chunks(int64_t rows) { return std::min<int64_t>(kMaxRowChunks, (rows + 63) / 64); }

// M = decay*M + grad_scale*G on rows [z*chunk, (z+1)*chunk) of a stored rows x cols matrix; thread q
// walks column q (VEC: columns 4q.. 4q+3, in 4-element packs, kColumnRowsInFlight rows of them
// loaded before any is stored), neighbouring threads reading neighbouring elements of a row.
// Partial ℓ1 and squared sums of the stored values per (chunk, column), each summed in row order;
// largest[i] raised to the largest |M_i| stored.
template <class TM, class TG, bool VEC>
__global__ void accumulate_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                          int64_t chunk, Hyper decay_h, Hyper grad_scale_h,
                                          float* __restrict__ part_l1, float* __restrict__ part_sq,
                                          float* __restrict__ largest, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  constexpr int V = VEC ? 4 : 1;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, i = blockIdx.y, z = blockIdx.z;
  unsigned most[1] = {0};  // the largest |M| this thread stores (bound_bits)
  if (q * V < cols) {  // threads past the last column stay for raise_bounds, which needs every thread
    const float decay = decay_h.get(), gs = grad_scale_h.get();
    const DeviceMat d = mats[i];
    float l1[V] = {}, sq[V] = {};
    const int64_t r_end = min(rows, (z + 1) * chunk);
    auto step = [&](TM* m, const TG* g, int e) {
      const TM nv = from_f32<TM>(decay * to_f32(*m) + gs * to_f32(*g));
      *m = nv;
      const float v = to_f32(nv);
      l1[e] += fabsf(v);
      sq[e] += v * v;
      most[0] = max(most[0], bound_bits(v));
    };
    if constexpr (VEC) {
      for (int64_t r0 = z * chunk; r0 < r_end; r0 += kColumnRowsInFlight) {
        Pack4<TM> mp[kColumnRowsInFlight];
        Pack4<TG> gp[kColumnRowsInFlight];
#pragma unroll
        for (int u = 0; u < kColumnRowsInFlight; ++u)
          if (r0 + u < r_end) {
            mp[u] = reinterpret_cast<const Pack4<TM>*>(static_cast<TM*>(d.m) + (r0 + u) * d.ldm)[q];
            gp[u] = reinterpret_cast<const Pack4<TG>*>(static_cast<const TG*>(d.g) + (r0 + u) * d.ldg)[q];
          }
#pragma unroll
        for (int u = 0; u < kColumnRowsInFlight; ++u)
          if (r0 + u < r_end) {
#pragma unroll
            for (int e = 0; e < 4; ++e) step(&mp[u].v[e], &gp[u].v[e], e);
            reinterpret_cast<Pack4<TM>*>(static_cast<TM*>(d.m) + (r0 + u) * d.ldm)[q] = mp[u];
          }
      }
    } else {
      for (int64_t r = z * chunk; r < r_end; ++r)
        step(static_cast<TM*>(d.m) + r * d.ldm + q, static_cast<const TG*>(d.g) + r * d.ldg + q, 0);
    }
    if (part_l1 != nullptr) {
      const int64_t at = (i * gridDim.z + z) * cols + q * V;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        part_l1[at + e] = l1[e];
        part_sq[at + e] = sq[e];
      }
    }
  }
  if (largest) raise_bounds(largest + i, most);
}

// out[o*inner + c] = the sum over z < parts, in order, of part[(o*parts + z)*inner + c]: the
// accumulate's per-chunk column sums (inner = columns) and the gather's per-tile row sums (inner = 1).
__global__ void sum_parts_kernel(const float* __restrict__ part, int64_t outer, int64_t inner, int64_t parts,
                                 float* __restrict__ out, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= outer * inner) return;
  const int64_t o = t / inner, c = t % inner;
  float a = 0.0f;
  for (int64_t z = 0; z < parts; ++z) a += part[(o * parts + z) * inner + c];
  out[t] = a;
}

// The entries of the ascending list idx[0, k) (null: 0, 1, ..) whose columns lie in
// [c0, c0 + nc), as [lo, hi); in the last chunk (c0 + nc == cols) hi = k, so that padding entries
// (>= cols) fall there too. Warps 0 and 1 search one bound each; every thread of the block calls
// this, and the result is in range[0..1] after the block's next __syncthreads().
__device__ __forceinline__ void chunk_entries(const int32_t* __restrict__ idx, int64_t k, int64_t c0, int64_t nc,
                                              int64_t cols, int64_t* range) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp > 1) return;
  const int64_t x = warp == 0 ? c0 : c0 + nc;
  int64_t at;
  if (warp == 1 && c0 + nc >= cols) at = k;
  else if (idx == nullptr) at = min(x, k);
  else if (x == 0) at = 0;
  else at = warp_lower_bound_i32(idx, k, x, lane);
  if (lane == 0) range[warp] = at;
}

// Shared-memory tiles of the gather: kGatherRows stored rows of a chunk of columns, each row one
// 4-byte word longer than the chunk, so that the rows' entries of one column lie in 32 banks.
template <class T>
__host__ __device__ constexpr int64_t tile_pitch(int64_t chunk) { return chunk + 4 / static_cast<int64_t>(sizeof(T)); }

// Where the e-th 16-byte pack of a tile goes: packs move in groups of 32, four rows x eight
// neighbouring packs (lane l: pack l % 8 of row l / 8), so that a warp's loads take whole 128-byte
// lines and its four-word accesses to the padded rows fall in 32 banks. A row quad takes a power
// of two of groups (shifts, not divisions); slots past the tile are skipped.
struct PackSlots {
  int nr, per_row, shift = 0;
  __device__ PackSlots(int nr_, int per_row_) : nr(nr_), per_row(per_row_) {
    while ((8 << shift) < per_row) ++shift;
  }
  __device__ int count() const { return ((nr + 3) / 4) << shift << 5; }
  __device__ bool at(int e, int& rr, int& q) const {
    const int g = e >> 5, l = e & 31;
    rr = ((g >> shift) << 2) + (l >> 3);
    q = ((g & ((1 << shift) - 1)) << 3) + (l & 7);
    return rr < nr && q < per_row;
  }
};

// Column chunks of a gather block row; one where there are no columns (its entries are padding).
__host__ __device__ inline int64_t column_chunks(int64_t cols, int64_t chunk) {
  return cols > 0 ? (cols + chunk - 1) / chunk : 1;
}

// tile[rr * pitch + c] = g[rr * ld + c] for rr < nr, c < nc: 16-byte packs along the rows, several
// in flight per thread, where `packed` (g and ld 16-byte aligned, nc whole packs).
template <class T>
__device__ __forceinline__ void load_tile(const T* __restrict__ g, int64_t ld, int nr, int nc, T* tile, int64_t pitch,
                                          bool packed) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if (!packed) {
    for (int e = tid; e < nr * nc; e += nt) tile[(e / nc) * pitch + e % nc] = g[(e / nc) * ld + e % nc];
    return;
  }
  constexpr int kVec = 16 / sizeof(T), kInFlight = 4;
  const PackSlots slots(nr, nc / kVec);
  const int n = slots.count();
  for (int e0 = 0; e0 < n; e0 += kInFlight * nt) {
    uint4 p[kInFlight];
    int rr, q;
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (slots.at(e0 + u * nt + tid, rr, q)) p[u] = reinterpret_cast<const uint4*>(g + rr * ld)[q];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (!slots.at(e0 + u * nt + tid, rr, q)) continue;
      // Rows start 4-byte aligned in the padded tile: the pack goes in as four words.
      uint32_t* d = reinterpret_cast<uint32_t*>(tile + rr * pitch + q * kVec);
      d[0] = p[u].x;
      d[1] = p[u].y;
      d[2] = p[u].z;
      d[3] = p[u].w;
    }
  }
}

// One block: stored rows r0.. (kGatherRows, one per lane) x the chunk of columns c0.. of matrix i.
// M's tile (and G's, where its scale is non-zero) is read along its rows into shared memory; each warp takes the
// chunk's selected entries s in turn (entry idx[i*k + s], ascending; padding past the last column):
// out[i][s][r] = c_i*(scale_m*M[r, c_s] + scale_g*G[r, c_s]) (padding: zeros), M[r, c_s] *= decay,
// with c_i = inverse_norm_of(sqrt(selected_sumsq[i]), norm) or 1, so the rows of the gathered matrix
// are written along their length; part_sq[(i*k + s)*rtiles + tile] = the sum of squares of out's
// stored values over the block's rows. The decayed columns go back (whole 16-byte packs, where M's
// rows are read in packs). With no stored columns (cols == 0) one block per row tile writes the
// padding rows.
template <class TM, class TG, class TO>
__global__ void __launch_bounds__(kGatherThreads, kGatherBlocksPerSm)
    gather_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols, const int32_t* __restrict__ idx,
                          int64_t k, int64_t chunk, bool with_g, Hyper scale_m_h, Hyper scale_g_h, Hyper decay_h,
                          const float* __restrict__ selected_sumsq, NormGuard norm, TO* __restrict__ out,
                          int64_t out_ld, int64_t out_bstride, float* __restrict__ part_sq, const int* skip) {
  extern __shared__ __align__(16) unsigned char gather_bytes[];
  const int64_t pm = tile_pitch<TM>(chunk), pg = tile_pitch<TG>(chunk);
  TM* const mt = reinterpret_cast<TM*>(gather_bytes);
  TG* const gt = reinterpret_cast<TG*>(mt + kGatherRows * pm);
  uint32_t* const selected = reinterpret_cast<uint32_t*>(gt + (with_g ? kGatherRows * pg : 0));  // bit per column
  __shared__ int64_t range[2];
  pdl_wait();
  if (skipped(skip)) return;
  const int64_t i = blockIdx.y, chunks = column_chunks(cols, chunk), tile = blockIdx.x / chunks;
  const int64_t r0 = tile * kGatherRows, c0 = (blockIdx.x % chunks) * chunk;
  const int nr = static_cast<int>(min(static_cast<int64_t>(kGatherRows), rows - r0));
  const int nc = static_cast<int>(min(chunk, cols - c0));
  const int32_t* const list = idx ? idx + i * k : nullptr;
  chunk_entries(list, k, c0, nc, cols, range);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  for (int w = tid; w < (nc + 31) / 32; w += blockDim.x) selected[w] = 0u;
  const DeviceMat d = mats[i];
  TM* const m = static_cast<TM*>(d.m) + r0 * d.ldm + c0;
  const TG* const g = static_cast<const TG*>(d.g) + r0 * d.ldg + c0;
  const float scale_m = scale_m_h.get(), scale_g = scale_g_h.get(), decay = decay_h.get();
  const bool use_g = with_g && scale_g != 0.0f;
  __syncthreads();
  const int64_t lo = range[0], hi = range[1];
  if (lo >= hi) return;  // nothing selected in the chunk
  constexpr int kVecM = 16 / sizeof(TM), kVecG = 16 / sizeof(TG);
  const bool packed_m = reinterpret_cast<uintptr_t>(m) % 16 == 0 && (d.ldm * sizeof(TM)) % 16 == 0 && nc % kVecM == 0;
  load_tile(m, d.ldm, nr, nc, mt, pm, packed_m);
  if (use_g) {
    const bool packed_g = reinterpret_cast<uintptr_t>(g) % 16 == 0 && (d.ldg * sizeof(TG)) % 16 == 0 && nc % kVecG == 0;
    load_tile(g, d.ldg, nr, nc, gt, pg, packed_g);
  }
  __syncthreads();
  const float ci = selected_sumsq ? inverse_norm_of(sqrtf(selected_sumsq[i]), norm) : 1.0f;
  const int64_t rtiles = (rows + kGatherRows - 1) / kGatherRows;
  TM* const m_lane = mt + lane * pm;
  const TG* const g_lane = gt + lane * pg;
  TO* const out_lane = out ? out + i * out_bstride + r0 + lane : nullptr;
  // Warp w takes entries lo + w, lo + w + warps, ..; each lane loads one of the next 32 of them.
  for (int64_t base = lo + warp; base < hi; base += 32 * warps) {
    const int64_t mine = base + lane * warps;
    // Entries relative to the chunk; past the list (and padding past the last column): none.
    const int my_c = mine < hi ? static_cast<int>((list ? list[mine] : mine) - c0) : nc;
    const int count = static_cast<int>(min(static_cast<int64_t>(32), (hi - base + warps - 1) / warps));
    for (int j = 0; j < count; ++j) {
      const int64_t s = base + j * warps;
      const int c = __shfl_sync(0xffffffffu, my_c, j);
      const bool in = c >= 0 && c < nc;  // else padding: a row of zeros
      float u = 0.0f;
      if (in && lane < nr) {
        const float mv = to_f32(m_lane[c]);
        u = scale_m * mv;
        if (use_g) u += scale_g * to_f32(g_lane[c]);
        if (decay != 1.0f) m_lane[c] = from_f32<TM>(mv * decay);
      }
      if (in && lane == 0) atomicOr(&selected[c >> 5], 1u << (c & 31));
      if (out == nullptr) continue;
      float v = 0.0f;
      if (lane < nr) {
        const TO stored = in ? from_f32<TO>(ci * u) : from_f32<TO>(0.0f);
        out_lane[s * out_ld] = stored;
        v = to_f32(stored);
      }
      if (part_sq) {
        const float t = warp_sum(v * v);
        if (lane == 0) part_sq[(i * k + s) * rtiles + tile] = t;
      }
    }
  }
  if (decay == 1.0f) return;  // M unchanged
  __syncthreads();
  // The decayed columns go back: whole 16-byte packs that hold one (their other columns as read).
  if (packed_m) {
    const PackSlots slots(nr, nc / kVecM);
    for (int e = tid; e < slots.count(); e += blockDim.x) {
      int rr, q;
      if (!slots.at(e, rr, q)) continue;
      if (((selected[(q * kVecM) >> 5] >> ((q * kVecM) & 31)) & ((1u << kVecM) - 1u)) == 0u) continue;
      const uint32_t* sw = reinterpret_cast<const uint32_t*>(mt + rr * pm + q * kVecM);
      reinterpret_cast<uint4*>(m + rr * d.ldm)[q] = make_uint4(sw[0], sw[1], sw[2], sw[3]);
    }
    return;
  }
  for (int e = tid; e < nr * nc; e += blockDim.x) {
    const int rr = e / nc, c = e % nc;
    if ((selected[c >> 5] >> (c & 31)) & 1u) m[rr * d.ldm + c] = mt[rr * pm + c];
  }
}

// The update of one band of kBandRows stored rows x `chunk` columns, staged in shared memory so
// that the weights are read and written once, along their rows: the selected columns of the band
// (the entries of the ascending idx in the chunk, a thread per entry reading kBandRows values of
// its row of O at once) take W*decay - lr'*O[s, r] (cautious: no decay where the update and
// the weight differ in sign), lr' times NorMuon's factors with inv; the other columns take the
// decay (none under cautious decay, their update being zero, nor without decay: written back only
// as they were read, where they share a 16-byte pack with a selected column).
template <class TW, class TO>
__global__ void update_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                      const int32_t* __restrict__ idx, int64_t k, const TO* __restrict__ O,
                                      int64_t o_ld, int64_t o_bstride, Hyper decay_h, Hyper lr_h, bool cautious,
                                      const float* __restrict__ inv, const float* __restrict__ factor,
                                      int64_t chunk, const int* skip) {
  extern __shared__ __align__(16) unsigned char band_bytes[];
  const int64_t pitch = chunk;  // kBandRows x chunk
  TW* const band = reinterpret_cast<TW*>(band_bytes);
  uint32_t* const selected = reinterpret_cast<uint32_t*>(band + kBandRows * pitch);  // bit per chunk column
  pdl_wait();
  if (skipped(skip)) return;
  const int64_t i = blockIdx.y, chunks = (cols + chunk - 1) / chunk;
  const int64_t r0 = (blockIdx.x / chunks) * kBandRows, c0 = (blockIdx.x % chunks) * chunk;
  const int64_t nr = min(static_cast<int64_t>(kBandRows), rows - r0), nc = min(chunk, cols - c0);
  TW* const w = static_cast<TW*>(mats[i].w) + r0 * mats[i].ldw + c0;
  const int64_t ldw = mats[i].ldw;
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t word = tid; word < (nc + 31) / 32; word += nt) selected[word] = 0u;
  // Rows whose start and length are 16-byte multiples move 16 bytes per thread, each thread one
  // pack of every row of the band (a band row is at most nt packs), all loaded before any is kept.
  constexpr int kVec = 16 / sizeof(TW);
  const bool packed = reinterpret_cast<uintptr_t>(w) % 16 == 0 && (ldw * sizeof(TW)) % 16 == 0 && nc % kVec == 0;
  const bool has_pack = tid < nc / kVec;
  __shared__ int64_t range[2];
  const int32_t* const list = idx ? idx + i * k : nullptr;
  if (packed) {
    uint4 p[kBandRows];
#pragma unroll
    for (int rr = 0; rr < kBandRows; ++rr)
      if (rr < nr && has_pack) p[rr] = reinterpret_cast<const uint4*>(w + rr * ldw)[tid];
    chunk_entries(list, k, c0, nc, cols, range);  // while the band's loads are in flight
#pragma unroll
    for (int rr = 0; rr < kBandRows; ++rr)
      if (rr < nr && has_pack) reinterpret_cast<uint4*>(band + rr * pitch)[tid] = p[rr];
  } else {
    chunk_entries(list, k, c0, nc, cols, range);
    for (int64_t rr = 0; rr < nr; ++rr)
      for (int64_t c = tid; c < nc; c += nt) band[rr * pitch + c] = w[rr * ldw + c];
  }
  __syncthreads();
  const float decay = decay_h.get(), lr = lr_h.get();
  const int64_t s_lo = range[0], s_hi = range[1];
  // A thread per entry of the chunk: its column of the band takes O[s, r0 .. r0 + nr), read as one
  // 16-byte load where O's band rows allow it.
  const TO* const o_band = O + i * o_bstride + r0;
  constexpr int kVecO = 16 / sizeof(TO);
  const bool o_packed = kBandRows % kVecO == 0 && nr == kBandRows && reinterpret_cast<uintptr_t>(o_band) % 16 == 0 &&
                        (o_ld * sizeof(TO)) % 16 == 0;
  for (int64_t s = s_lo + tid; s < s_hi; s += nt) {
    const int64_t c = (list ? list[s] : s) - c0;
    float x[kBandRows];
    if (o_packed) {
      uint4 q[kBandRows / kVecO];
#pragma unroll
      for (int h = 0; h < kBandRows / kVecO; ++h) q[h] = reinterpret_cast<const uint4*>(o_band + s * o_ld)[h];
      const TO* const o = reinterpret_cast<const TO*>(q);
#pragma unroll
      for (int rr = 0; rr < kBandRows; ++rr) x[rr] = to_f32(o[rr]);
    } else {
#pragma unroll
      for (int rr = 0; rr < kBandRows; ++rr) x[rr] = rr < nr ? to_f32(o_band[s * o_ld + rr]) : 0.0f;
    }
    if (c < 0 || c >= nc) continue;  // padding, or a list out of order: no write outside the band
    atomicOr(&selected[c >> 5], 1u << (c & 31));
    float l = lr;
    if (inv != nullptr) l *= inv[i * k + s] * factor[i];
#pragma unroll
    for (int rr = 0; rr < kBandRows; ++rr) {
      if (rr >= nr) break;
      TW* b = band + rr * pitch + c;
      const float wv = to_f32(*b), xv = x[rr] * l;
      float dec = decay;
      if (cautious && !(xv * wv > 0.0f)) dec = 1.0f;
      *b = from_f32<TW>(wv * dec - xv);
    }
  }
  __syncthreads();
  const bool keep_others = cautious || decay == 1.0f;  // unselected columns keep their values
  if (packed) {
    if (!has_pack) return;
    // The pack's kVec columns share a bitmap word; a pack with nothing to change is not written,
    // one with a selected column is written whole (its other columns as they were read, or decayed).
    const uint32_t bits = (selected[(tid * kVec) >> 5] >> ((tid * kVec) & 31)) & ((1u << kVec) - 1u);
    if (keep_others && bits == 0u) return;
#pragma unroll
    for (int rr = 0; rr < kBandRows; ++rr) {
      if (rr >= nr) break;
      uint4 p = reinterpret_cast<const uint4*>(band + rr * pitch)[tid];
      if (!keep_others) {
        TW* e = reinterpret_cast<TW*>(&p);
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (!((bits >> j) & 1u)) e[j] = from_f32<TW>(to_f32(e[j]) * decay);
      }
      reinterpret_cast<uint4*>(w + rr * ldw)[tid] = p;
    }
    return;
  }
  for (int64_t rr = 0; rr < nr; ++rr)
    for (int64_t c = tid; c < nc; c += nt) {
      const bool sel = (selected[c >> 5] >> (c & 31)) & 1u;
      if (!sel && keep_others) continue;  // unchanged
      const TW v = band[rr * pitch + c];
      w[rr * ldw + c] = sel ? v : from_f32<TW>(to_f32(v) * decay);
    }
}

}  // namespace

int64_t accumulate_columns_scratch_floats(int64_t nmats, int64_t rows, int64_t cols) {
  return 2 * nmats * row_chunks(rows) * cols;
}

void launch_accumulate_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt,
                               DType gdt, Hyper decay, Hyper grad_scale, float* scores, float* row_sumsq,
                               float* largest, float* scratch, const int* skip, cudaStream_t s, bool vec) {
  if (nmats == 0 || cols == 0) return;
  if (rows == 0) {  // empty columns: zero scores
    for (float* out : {scores, row_sumsq})
      if (out) DION3_CUDA_CHECK(cudaMemsetAsync(out, 0, nmats * cols * sizeof(float), s));
    return;
  }
  const int64_t chunks = row_chunks(rows), chunk = (rows + chunks - 1) / chunks;
  const bool sums = scores != nullptr || row_sumsq != nullptr;
  float* part_l1 = sums ? scratch : nullptr;
  float* part_sq = sums ? scratch + nmats * chunks * cols : nullptr;
  const dim3 grid(ceil_div_u(vec ? cols / 4 : cols, kColumnThreads), static_cast<unsigned>(nmats),
                  static_cast<unsigned>(chunks));
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      launch_pdl(vec ? accumulate_columns_kernel<TM, TG, true> : accumulate_columns_kernel<TM, TG, false>, grid,
                 kColumnThreads, 0, s, mats, rows, cols, chunk, decay, grad_scale, part_l1, part_sq, largest, skip);
    });
  });
  const unsigned sum_grid = ceil_div_u(nmats * cols, kColumnThreads);
  if (scores)
    launch_pdl(sum_parts_kernel, sum_grid, kColumnThreads, 0, s, static_cast<const float*>(part_l1), nmats, cols,
               chunks, scores, skip);
  if (row_sumsq)
    launch_pdl(sum_parts_kernel, sum_grid, kColumnThreads, 0, s, static_cast<const float*>(part_sq), nmats, cols,
               chunks, row_sumsq, skip);
  DION3_CUDA_LAUNCH_CHECK();
}

int64_t gather_columns_scratch_floats(int64_t nmats, int64_t rows, int64_t k) {
  return nmats * k * ((rows + kGatherRows - 1) / kGatherRows);
}

void launch_gather_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt, DType gdt,
                           const int32_t* idx, int64_t k, Hyper scale_m, Hyper scale_g, Hyper decay,
                           const float* selected_sumsq, NormGuard norm, const MatrixView& out, float* row_sumsq,
                           float* scratch, const int* skip, cudaStream_t s) {
  if (nmats == 0 || k == 0) return;
  if (rows == 0) {  // empty columns: zero rows and zero sums
    if (row_sumsq && out.data) DION3_CUDA_CHECK(cudaMemsetAsync(row_sumsq, 0, nmats * k * sizeof(float), s));
    return;
  }
  const int64_t rtiles = (rows + kGatherRows - 1) / kGatherRows;
  // G is staged only where its scale may be non-zero (a device value may change between launches).
  const bool with_g = scale_g.at != nullptr || scale_g.value != 0.0f;
  const int64_t obs = out.batch > 1 ? out.batch_stride : k * out.ld;
  const DType odt = out.data ? out.dtype : DType::F32;
  float* part = row_sumsq && out.data ? scratch : nullptr;
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      // Columns per block: kGatherRowBytes of M and G together per row, whole bitmap words.
      const int64_t row_bytes = sizeof(TM) + (with_g ? sizeof(TG) : 0);
      const int64_t chunk = std::clamp<int64_t>((cols + 31) / 32 * 32, 32, kGatherRowBytes / row_bytes / 32 * 32);
      const int64_t blocks = rtiles * column_chunks(cols, chunk);
      if (blocks > 0x7fffffff) fail("gather of columns: too many blocks in a matrix stepped by columns");
      const std::size_t smem = kGatherRows * tile_pitch<TM>(chunk) * sizeof(TM) +
                               (with_g ? kGatherRows * tile_pitch<TG>(chunk) * sizeof(TG) : 0) + chunk / 8;
      DION3_DISPATCH_FLOAT(odt, TO, [&] {
        launch_pdl(gather_columns_kernel<TM, TG, TO>, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(nmats)),
                   kGatherThreads, smem, s, mats, rows, cols, idx, k, chunk, with_g, scale_m, scale_g, decay,
                   selected_sumsq, norm, static_cast<TO*>(out.data), out.ld, obs, part, skip);
      });
    });
  });
  if (part)  // row_sumsq[i*k + s] = the tiles' sums in order
    launch_pdl(sum_parts_kernel, ceil_div_u(nmats * k, kColumnThreads), kColumnThreads, 0, s,
               static_cast<const float*>(part), nmats * k, int64_t{1}, rtiles, row_sumsq, skip);
  DION3_CUDA_LAUNCH_CHECK();
}

void launch_update_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType wdt,
                           const int32_t* idx, int64_t k, const MatrixView& O, const UpdateParams& p,
                           float* scratch, const int* skip, cudaStream_t s) {
  if (nmats == 0 || cols == 0) return;
  // Statistics over all of O's columns: a rank that holds none of the stored rows (column-sharded
  // as the rule sees it) still moves the variance.
  if (p.normuon) launch_normuon_factors(mats, nmats, cols, idx, k, O, p.beta2, scratch, skip, s);
  if (rows == 0) return;
  const float* inv = p.normuon && k > 0 ? scratch + nmats * k : nullptr;
  const float* factor = scratch + 2 * nmats * k;
  const int64_t obs = O.batch > 1 ? O.batch_stride : k * O.ld;
  DION3_DISPATCH_FLOAT(O.dtype, TO, [&] {
    DION3_DISPATCH_FLOAT(wdt, TW, [&] {
      // Columns per band: kBandBytes of weights, a multiple of 32 (whole bitmap words).
      const int64_t chunk = std::min<int64_t>(kBandBytes / (kBandRows * sizeof(TW)), (cols + 31) / 32 * 32);
      const int64_t blocks = ((rows + kBandRows - 1) / kBandRows) * ((cols + chunk - 1) / chunk);
      if (blocks > 0x7fffffff) fail("apply_update: too many row bands in a matrix stepped by columns");
      const std::size_t smem = kBandRows * chunk * sizeof(TW) + chunk / 8;
      launch_pdl(update_columns_kernel<TW, TO>, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(nmats)),
                 kColumnThreads, smem, s, mats, rows, cols, idx, k, static_cast<const TO*>(O.data) + p.o_col_offset,
                 O.ld, obs, p.decay, p.adjusted_lr, p.cautious_wd, inv, factor, chunk, skip);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

}  // namespace dion3::cuda
