// column_kernels.cu — the matrix step on column-stepped sets (MatrixSet::columns: Dion2 on a
// tall matrix, Dion3 and NorMuon on a transposed group's, whose set rows are the stored columns):
// accumulate with column ℓ1 scores, the gather of selected columns with error-feedback decay, and
// the update of the selected columns (with NorMuon's factors).
// Rows are cut into chunks so that a few wide matrices still fill the GPU; per-chunk partial sums
// go to scratch and are added in chunk order afterwards, so results do not depend on scheduling.
// Selected columns travel through 32 x 32 shared-memory tiles: the rows of the gathered matrix
// (and of the update O) are read and written along their length. Each kernel honours `skip`.
#include <algorithm>

#include "cuda/kernels.cuh"

namespace dion3::cuda {
namespace {

constexpr int kColumnThreads = 256;
// The decay's selection bitmap stays within the default dynamic shared memory of a block.
constexpr std::size_t kMaxBitmapBytes = 32 * 1024;
constexpr int64_t kDecayBlocks = 4096;  // blocks of the decay, over all matrices
constexpr int64_t kMaxRowChunks = 32;  // row chunks of the accumulate
constexpr int kTile = 32;              // selected columns x rows per gather / update tile
constexpr int kTileRowsPerPass = 8;    // block: kTile x kTileRowsPerPass threads

int64_t row_chunks(int64_t rows) { return std::min<int64_t>(kMaxRowChunks, (rows + 63) / 64); }

// M = decay*M + grad_scale*G on rows [z*chunk, (z+1)*chunk) of a stored rows x cols matrix; thread c walks
// column c (neighbouring threads read neighbouring elements of a row). Partial ℓ1 and squared
// sums of the stored values per (chunk, column).
template <class TM, class TG>
__global__ void accumulate_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                          int64_t chunk, Hyper decay_h, Hyper grad_scale_h,
                                          float* __restrict__ part_l1,
                                          float* __restrict__ part_sq, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, i = blockIdx.y, z = blockIdx.z;
  if (c >= cols) return;
  const float decay = decay_h.get(), gs = grad_scale_h.get();
  const DeviceMat d = mats[i];
  float l1 = 0.0f, sq = 0.0f;
  const int64_t r_end = min(rows, (z + 1) * chunk);
  for (int64_t r = z * chunk; r < r_end; ++r) {
    TM* m = static_cast<TM*>(d.m) + r * d.ldm + c;
    const TM nv = from_f32<TM>(decay * to_f32(*m) + gs * to_f32(static_cast<const TG*>(d.g)[r * d.ldg + c]));
    *m = nv;
    const float v = to_f32(nv);
    l1 += fabsf(v);
    sq += v * v;
  }
  if (part_l1 == nullptr) return;
  const int64_t at = (i * gridDim.z + z) * cols + c;
  part_l1[at] = l1;
  part_sq[at] = sq;
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
// out[i][s][r] = scale_m*M[r, c_s] + scale_g*G[r, c_s] (padding: zeros), then M[r, c_s] *= decay;
// part_sq[(i*k + s)*rtiles + tile] = the tile's sum of squares of out's stored values.
template <class TM, class TG, class TO>
__global__ void gather_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                      const int32_t* __restrict__ idx, int64_t k, Hyper scale_m_h, Hyper scale_g_h,
                                      Hyper decay_h, TO* __restrict__ out, int64_t out_ld, int64_t out_bstride,
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
  for (int ss = ty; ss < kTile; ss += kTileRowsPerPass) {
    const int64_t s = s0 + ss;
    if (s >= k) break;
    float v = 0.0f;
    if (r < rows) {
      const TO stored = from_f32<TO>(tile[tx][ss]);
      out[i * out_bstride + s * out_ld + r] = stored;
      v = to_f32(stored);
    }
    if (part_sq) {
      const float t = warp_sum(v * v);  // the warp is the tile's 32 rows of row s
      if (tx == 0) part_sq[(i * k + s) * gridDim.x + blockIdx.x] = t;
    }
  }
}

// Weight decay on the columns no selection entry names (nothing under cautious decay: their
// update is zero). Each block marks its matrix's selected columns in a shared bitmap, then walks
// rows of the matrix, a row's elements across the threads (coalesced), decaying the unmarked ones.
template <class TW>
__global__ void decay_unselected_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                                const int32_t* __restrict__ idx, int64_t k, Hyper decay_h,
                                                const int* skip) {
  extern __shared__ uint32_t selected[];  // bit c % 32 of word c / 32: column c is selected
  pdl_wait();
  if (skipped(skip)) return;
  const float decay = decay_h.get();
  if (decay == 1.0f) return;
  const int64_t i = blockIdx.y, words = (cols + 31) / 32;
  for (int64_t word = threadIdx.x; word < words; word += blockDim.x) selected[word] = 0u;
  __syncthreads();
  for (int64_t s = threadIdx.x; s < k; s += blockDim.x) {
    const int64_t c = idx ? idx[i * k + s] : s;
    if (c < cols) atomicOr(&selected[c >> 5], 1u << (c & 31));  // padding entries name no column
  }
  __syncthreads();
  TW* const w = static_cast<TW*>(mats[i].w);
  const int64_t ldw = mats[i].ldw;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      if (!((selected[c >> 5] >> (c & 31)) & 1u)) w[r * ldw + c] = from_f32<TW>(to_f32(w[r * ldw + c]) * decay);
}

// The selected columns, tile by tile: O's rows (one per selected column, along the stored rows)
// are read along their length into the tile, then W[r, c_s] = W*decay - lr'*O[s, r] (cautious:
// no decay where the update and the weight differ in sign), lr' times NorMuon's factors with inv.
template <class TW, class TO>
__global__ void update_selected_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                               const int32_t* __restrict__ idx, int64_t k, const TO* __restrict__ O,
                                               int64_t o_ld, int64_t o_bstride, Hyper decay_h, Hyper lr_h,
                                               bool cautious, const float* __restrict__ inv,
                                               const float* __restrict__ factor, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  __shared__ float tile[kTile][kTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile, i = blockIdx.y, s0 = static_cast<int64_t>(blockIdx.z) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int ss = ty; ss < kTile; ss += kTileRowsPerPass) {
    const int64_t s = s0 + ss, r = r0 + tx;
    tile[ss][tx] = s < k && r < rows ? to_f32(O[i * o_bstride + s * o_ld + r]) : 0.0f;
  }
  __syncthreads();
  const float decay = decay_h.get();
  const int64_t s = s0 + tx;
  const int64_t c = s < k ? (idx ? idx[i * k + s] : s) : cols;
  if (c >= cols) return;
  float lr = lr_h.get();
  if (inv != nullptr) lr *= inv[i * k + s] * factor[i];
  for (int rr = ty; rr < kTile; rr += kTileRowsPerPass) {
    const int64_t r = r0 + rr;
    if (r >= rows) break;
    TW* w = static_cast<TW*>(mats[i].w) + r * mats[i].ldw + c;
    const float wv = to_f32(*w), x = tile[tx][rr] * lr;
    float dec = decay;
    if (cautious && !(x * wv > 0.0f)) dec = 1.0f;
    *w = from_f32<TW>(wv * dec - x);
  }
}

}  // namespace

int64_t accumulate_columns_scratch_floats(int64_t nmats, int64_t rows, int64_t cols) {
  return 2 * nmats * row_chunks(rows) * cols;
}

void launch_accumulate_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt,
                               DType gdt, Hyper decay, Hyper grad_scale, float* scores, float* row_sumsq,
                               float* scratch, const int* skip, cudaStream_t s) {
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
  const dim3 grid(ceil_div_u(cols, kColumnThreads), static_cast<unsigned>(nmats), static_cast<unsigned>(chunks));
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      launch_pdl(accumulate_columns_kernel<TM, TG>, grid, kColumnThreads, 0, s, mats, rows, cols, chunk, decay,
                 grad_scale, part_l1, part_sq, skip);
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
                           const MatrixView& out, float* row_sumsq, float* scratch, const int* skip,
                           cudaStream_t s) {
  if (nmats == 0 || k == 0) return;
  if (rows == 0) {  // empty columns: zero rows and zero sums
    if (row_sumsq && out.data) DION3_CUDA_CHECK(cudaMemsetAsync(row_sumsq, 0, nmats * k * sizeof(float), s));
    return;
  }
  const int64_t rtiles = (rows + kTile - 1) / kTile;
  if ((k + kTile - 1) / kTile > 65535) fail("gather_rows: more than 2^21 selected columns per matrix");
  const dim3 grid(static_cast<unsigned>(rtiles), static_cast<unsigned>(nmats), ceil_div_u(k, kTile));
  const dim3 block(kTile, kTileRowsPerPass);
  const int64_t obs = out.batch > 1 ? out.batch_stride : k * out.ld;
  const DType odt = out.data ? out.dtype : DType::F32;
  float* part = row_sumsq && out.data ? scratch : nullptr;
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      DION3_DISPATCH_FLOAT(odt, TO, [&] {
        launch_pdl(gather_columns_kernel<TM, TG, TO>, grid, block, 0, s, mats, rows, cols, idx, k, scale_m, scale_g,
                   decay, static_cast<TO*>(out.data), out.ld, obs, part, skip);
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
  const int64_t rtiles = (rows + kTile - 1) / kTile;
  if ((k + kTile - 1) / kTile > 65535) fail("apply_update: more than 2^21 selected columns per matrix");
  const int64_t obs = O.batch > 1 ? O.batch_stride : k * O.ld;
  DION3_DISPATCH_FLOAT(O.dtype, TO, [&] {
    DION3_DISPATCH_FLOAT(wdt, TW, [&] {
      if (!p.cautious_wd) {  // else unselected columns keep their weights (their update is zero)
        // Blocks enough to fill the GPU a few times over, each building its bitmap once.
        const std::size_t bitmap = static_cast<std::size_t>((cols + 31) / 32) * sizeof(uint32_t);
        if (bitmap > kMaxBitmapBytes) fail("apply_update: more than 2^18 columns in a matrix stepped by columns");
        const unsigned row_blocks =
            static_cast<unsigned>(std::min<int64_t>(rows, std::max<int64_t>(1, kDecayBlocks / nmats)));
        launch_pdl(decay_unselected_columns_kernel<TW>, dim3(row_blocks, static_cast<unsigned>(nmats)),
                   kColumnThreads, bitmap, s, mats, rows, cols, idx, k, p.decay, skip);
      }
      if (k > 0)
        launch_pdl(update_selected_columns_kernel<TW, TO>,
                   dim3(static_cast<unsigned>(rtiles), static_cast<unsigned>(nmats), ceil_div_u(k, kTile)),
                   dim3(kTile, kTileRowsPerPass), 0, s, mats, rows, cols, idx, k,
                   static_cast<const TO*>(O.data) + p.o_col_offset, O.ld, obs, p.decay, p.adjusted_lr, p.cautious_wd,
                   inv, factor, skip);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

}  // namespace dion3::cuda
