// column_kernels.cu — the matrix step on column-stepped sets (MatrixSet::columns: Dion2 on a
// tall matrix, Dion3 and NorMuon on a transposed group's, whose set rows are the stored columns):
// accumulate with column ℓ1 scores, the gather of selected columns with error-feedback decay, and
// the update of the selected columns (with NorMuon's factors).
// Rows are cut into chunks so that a few wide matrices still fill the GPU; per-chunk partial sums
// go to scratch and are added in chunk order afterwards, so results do not depend on scheduling.
// Selected columns of the gather travel through 32 x 32 shared-memory tiles, so that the rows of
// the gathered matrix are written along their length; the update stages bands of weight rows in
// shared memory instead, reading and writing the weights once. Each kernel honours `skip`.
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
constexpr int kTile = 32;              // selected columns x rows per gather tile
constexpr int kTileRowsPerPass = 8;    // block: kTile x kTileRowsPerPass threads

int64_t row_chunks(int64_t rows) { return std::min<int64_t>(kMaxRowChunks, (rows + 63) / 64); }

// M = decay*M + grad_scale*G on rows [z*chunk, (z+1)*chunk) of a stored rows x cols matrix; thread q
// walks column q (VEC: columns 4q.. 4q+3, in 4-element packs, kColumnRowsInFlight rows of them
// loaded before any is stored), neighbouring threads reading neighbouring elements of a row.
// Partial ℓ1 and squared sums of the stored values per (chunk, column), each summed in row order.
template <class TM, class TG, bool VEC>
__global__ void accumulate_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                          int64_t chunk, Hyper decay_h, Hyper grad_scale_h,
                                          float* __restrict__ part_l1,
                                          float* __restrict__ part_sq, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  constexpr int V = VEC ? 4 : 1;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, i = blockIdx.y, z = blockIdx.z;
  if (q * V >= cols) return;
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
  if (part_l1 == nullptr) return;
  const int64_t at = (i * gridDim.z + z) * cols + q * V;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    part_l1[at + e] = l1[e];
    part_sq[at + e] = sq[e];
  }
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

// One tile: selected columns s0.. (entries idx[i*k + s]) x stored rows r0... Threads (x, y): x
// runs along the selection when reading M (entries of one row), along the rows when writing out.
// out[i][s][r] = c_i*(scale_m*M[r, c_s] + scale_g*G[r, c_s]) (padding: zeros), then M[r, c_s] *= decay,
// with c_i = inverse_norm_of(sqrt(selected_sumsq[i]), norm) or 1;
// part_sq[(i*k + s)*rtiles + tile] = the tile's sum of squares of out's stored values.
template <class TM, class TG, class TO>
__global__ void gather_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                      const int32_t* __restrict__ idx, int64_t k, Hyper scale_m_h, Hyper scale_g_h,
                                      Hyper decay_h, const float* __restrict__ selected_sumsq, NormGuard norm,
                                      TO* __restrict__ out, int64_t out_ld, int64_t out_bstride,
                                      float* __restrict__ part_sq, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  __shared__ float tile[kTile][kTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile, i = blockIdx.y, s0 = static_cast<int64_t>(blockIdx.z) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const float scale_m = scale_m_h.get(), scale_g = scale_g_h.get(), decay = decay_h.get();
  const DeviceMat d = mats[i];
  {
    const int64_t s = s0 + tx;
    const int64_t c = s < k ? (idx ? idx[i * k + s] : s) : cols;  // beyond k, or padding: no column
    for (int rr = ty; rr < kTile; rr += kTileRowsPerPass) {
      const int64_t r = r0 + rr;
      float u = 0.0f;
      if (c < cols && r < rows) {
        TM* m = static_cast<TM*>(d.m) + r * d.ldm + c;
        const float mv = to_f32(*m);
        u = scale_m * mv;
        if (scale_g != 0.0f) u += scale_g * to_f32(static_cast<const TG*>(d.g)[r * d.ldg + c]);
        if (decay != 1.0f) *m = from_f32<TM>(mv * decay);
      }
      tile[rr][tx] = u;
    }
  }
  __syncthreads();
  if (out == nullptr) return;
  const int64_t r = r0 + tx;
  const float c = selected_sumsq ? inverse_norm_of(sqrtf(selected_sumsq[i]), norm) : 1.0f;
  for (int ss = ty; ss < kTile; ss += kTileRowsPerPass) {
    const int64_t s = s0 + ss;
    if (s >= k) break;
    float v = 0.0f;
    if (r < rows) {
      const TO stored = from_f32<TO>(c * tile[tx][ss]);
      out[i * out_bstride + s * out_ld + r] = stored;
      v = to_f32(stored);
    }
    if (part_sq) {
      const float t = warp_sum(v * v);  // the warp is the tile's 32 rows of row s
      if (tx == 0) part_sq[(i * k + s) * gridDim.x + blockIdx.x] = t;
    }
  }
}

// Elements from one band row of the column update to the next (see update_columns_kernel).
template <class TW>
__host__ __device__ constexpr int64_t band_pitch(int64_t chunk) { return chunk + 16 / static_cast<int64_t>(sizeof(TW)); }

// The update of one band of kBandRows stored rows x `chunk` columns, staged in shared memory so
// that the weights are read and written once, along their rows: the selected columns of the band
// (the entries of the ascending idx in the chunk, found by a binary search; O's rows read
// kBandRows values at a time) take W*decay - lr'*O[s, r] (cautious: no decay where the update and
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
  // kBandRows x chunk, rows band_pitch apart: 16 bytes more than a row, so that the threads that
  // walk one column down the band (the selected update) reach different shared-memory banks.
  const int64_t pitch = band_pitch<TW>(chunk);
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
  if (packed) {
    uint4 p[kBandRows];
#pragma unroll
    for (int rr = 0; rr < kBandRows; ++rr)
      if (rr < nr && has_pack) p[rr] = reinterpret_cast<const uint4*>(w + rr * ldw)[tid];
#pragma unroll
    for (int rr = 0; rr < kBandRows; ++rr)
      if (rr < nr && has_pack) reinterpret_cast<uint4*>(band + rr * pitch)[tid] = p[rr];
  } else {
    for (int64_t rr = 0; rr < nr; ++rr)
      for (int64_t c = tid; c < nc; c += nt) band[rr * pitch + c] = w[rr * ldw + c];
  }
  // The entries whose columns lie in the chunk: [s_lo, s_hi) of the ascending selection.
  __shared__ int64_t s_range[2];
  if (tid == 0) {
    if (idx == nullptr) {
      s_range[0] = min(c0, k);
      s_range[1] = min(c0 + nc, k);
    } else {
      s_range[0] = lower_bound_i32(idx + i * k, k, c0);
      s_range[1] = lower_bound_i32(idx + i * k, k, c0 + nc);
    }
  }
  __syncthreads();
  const float decay = decay_h.get(), lr = lr_h.get();
  const int64_t s_lo = s_range[0], s_hi = s_range[1];
  for (int64_t e = tid; e < (s_hi - s_lo) * kBandRows; e += nt) {
    const int64_t s = s_lo + e / kBandRows, rr = e % kBandRows;
    const int64_t c = (idx ? idx[i * k + s] : s) - c0;
    if (rr >= nr || c < 0 || c >= nc) continue;  // a list out of order: no write outside the band
    if (rr == 0) atomicOr(&selected[c >> 5], 1u << (c & 31));
    float l = lr;
    if (inv != nullptr) l *= inv[i * k + s] * factor[i];
    TW* b = band + rr * pitch + c;
    const float wv = to_f32(*b), x = to_f32(O[i * o_bstride + s * o_ld + r0 + rr]) * l;
    float dec = decay;
    if (cautious && !(x * wv > 0.0f)) dec = 1.0f;
    *b = from_f32<TW>(wv * dec - x);
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
                               float* scratch, const int* skip, cudaStream_t s, bool vec) {
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
                 kColumnThreads, 0, s, mats, rows, cols, chunk, decay, grad_scale, part_l1, part_sq, skip);
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
  return nmats * k * ((rows + kTile - 1) / kTile);
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
  const int64_t rtiles = (rows + kTile - 1) / kTile;
  if ((k + kTile - 1) / kTile > 65535) fail("gather of columns: more than 2^21 selected columns per matrix");
  const dim3 grid(static_cast<unsigned>(rtiles), static_cast<unsigned>(nmats), ceil_div_u(k, kTile));
  const dim3 block(kTile, kTileRowsPerPass);
  const int64_t obs = out.batch > 1 ? out.batch_stride : k * out.ld;
  const DType odt = out.data ? out.dtype : DType::F32;
  float* part = row_sumsq && out.data ? scratch : nullptr;
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      DION3_DISPATCH_FLOAT(odt, TO, [&] {
        launch_pdl(gather_columns_kernel<TM, TG, TO>, grid, block, 0, s, mats, rows, cols, idx, k, scale_m, scale_g,
                   decay, selected_sumsq, norm, static_cast<TO*>(out.data), out.ld, obs, part, skip);
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
      const std::size_t smem = kBandRows * band_pitch<TW>(chunk) * sizeof(TW) + chunk / 8;
      launch_pdl(update_columns_kernel<TW, TO>, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(nmats)),
                 kColumnThreads, smem, s, mats, rows, cols, idx, k, static_cast<const TO*>(O.data) + p.o_col_offset,
                 O.ld, obs, p.decay, p.adjusted_lr, p.cautious_wd, inv, factor, chunk, skip);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

}  // namespace dion3::cuda
