// column_kernels.cu — the matrix step on column-stepped sets (MatrixSet::columns: Dion2 on a
// tall matrix, whose set rows are the stored columns): accumulate with column ℓ1 scores, the
// gather of selected columns with error-feedback decay, and the update of the selected columns.
// Plain one-thread-per-column (or per selected column, per element) kernels: this path serves
// the reference's Dion2 and is not tuned. Each honours the device `skip` flag.
#include "cuda/kernels.cuh"

namespace dion3::cuda {
namespace {

constexpr int kColumnThreads = 256;

// M = decay*M + G over a stored rows x cols matrix; thread c walks column c (neighbouring
// threads read neighbouring elements of a row). scores[c] / row_sumsq[c] of the stored values.
template <class TM, class TG>
__global__ void accumulate_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                          Hyper decay_h, float* __restrict__ scores, float* __restrict__ row_sumsq,
                                          const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, i = blockIdx.y;
  if (c >= cols) return;
  const float decay = decay_h.get();
  const DeviceMat d = mats[i];
  float l1 = 0.0f, sq = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    TM* m = static_cast<TM*>(d.m) + r * d.ldm + c;
    const TM nv = from_f32<TM>(decay * to_f32(*m) + to_f32(static_cast<const TG*>(d.g)[r * d.ldg + c]));
    *m = nv;
    const float v = to_f32(nv);
    l1 += fabsf(v);
    sq += v * v;
  }
  if (scores) scores[i * cols + c] = l1;
  if (row_sumsq) row_sumsq[i * cols + c] = sq;
}

// out[i][s][r] = scale_m*M[r, c] + scale_g*G[r, c] for c = idx[i*k + s] (padding: zeros); then
// M[r, c] *= decay. One thread per selected column.
template <class TM, class TG, class TO>
__global__ void gather_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                      const int32_t* __restrict__ idx, int64_t k, Hyper scale_m_h, Hyper scale_g_h,
                                      Hyper decay_h, TO* __restrict__ out, int64_t out_ld, int64_t out_bstride,
                                      float* __restrict__ row_sumsq, const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, i = blockIdx.y;
  if (s >= k) return;
  const float scale_m = scale_m_h.get(), scale_g = scale_g_h.get(), decay = decay_h.get();
  const DeviceMat d = mats[i];
  const int64_t c = idx ? idx[i * k + s] : s;
  TO* o = out ? out + i * out_bstride + s * out_ld : nullptr;
  float sq = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    float u = 0.0f;
    if (c < cols) {
      TM* m = static_cast<TM*>(d.m) + r * d.ldm + c;
      const float mv = to_f32(*m);
      u = scale_m * mv;
      if (scale_g != 0.0f) u += scale_g * to_f32(static_cast<const TG*>(d.g)[r * d.ldg + c]);
      if (decay != 1.0f) *m = from_f32<TM>(mv * decay);
    }
    if (o) {
      const TO stored = from_f32<TO>(u);
      o[r] = stored;
      const float v = to_f32(stored);
      sq += v * v;
    }
  }
  if (row_sumsq && o) row_sumsq[i * k + s] = sq;
}

// W = W*decay - lr' * O^T on the selected columns, W*decay elsewhere (cautious: no decay where
// the update and the weight differ in sign). One thread per stored element.
template <class TW, class TO>
__global__ void update_columns_kernel(const DeviceMat* __restrict__ mats, int64_t rows, int64_t cols,
                                      const int32_t* __restrict__ idx, int64_t k, const TO* __restrict__ O,
                                      int64_t o_ld, int64_t o_bstride, Hyper decay_h, Hyper lr_h, bool cautious,
                                      const int* skip) {
  pdl_wait();
  if (skipped(skip)) return;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, i = blockIdx.y;
  if (e >= rows * cols) return;
  const int64_t r = e / cols, c = e % cols;
  const float decay = decay_h.get(), lr = lr_h.get();
  // Position of c in the ascending selection (padding entries sort last), or -1.
  int64_t pos = -1;
  if (idx) {
    const int32_t* sel = idx + i * k;
    int64_t lo = 0, hi = k;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (sel[mid] < c) lo = mid + 1;
      else hi = mid;
    }
    if (lo < k && sel[lo] == c) pos = lo;
  } else {
    pos = c < k ? c : -1;
  }
  if (pos < 0 && (decay == 1.0f || cautious)) return;
  TW* w = static_cast<TW*>(mats[i].w) + r * mats[i].ldw + c;
  const float wv = to_f32(*w);
  if (pos < 0) {
    *w = from_f32<TW>(wv * decay);
    return;
  }
  const float x = to_f32(O[i * o_bstride + pos * o_ld + r]) * lr;
  float dec = decay;
  if (cautious && !(x * wv > 0.0f)) dec = 1.0f;
  *w = from_f32<TW>(wv * dec - x);
}

}  // namespace

void launch_accumulate_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt,
                               DType gdt, Hyper decay, float* scores, float* row_sumsq, const int* skip,
                               cudaStream_t s) {
  if (nmats == 0 || cols == 0) return;
  const dim3 grid(ceil_div_u(cols, kColumnThreads), static_cast<unsigned>(nmats));
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      launch_pdl(accumulate_columns_kernel<TM, TG>, grid, kColumnThreads, 0, s, mats, rows, cols, decay, scores,
                 row_sumsq, skip);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

void launch_gather_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt, DType gdt,
                           const int32_t* idx, int64_t k, Hyper scale_m, Hyper scale_g, Hyper decay,
                           const MatrixView& out, float* row_sumsq, const int* skip, cudaStream_t s) {
  if (nmats == 0 || k == 0) return;
  const dim3 grid(ceil_div_u(k, kColumnThreads), static_cast<unsigned>(nmats));
  const int64_t obs = out.batch > 1 ? out.batch_stride : k * out.ld;
  const DType odt = out.data ? out.dtype : DType::F32;
  DION3_DISPATCH_FLOAT(mdt, TM, [&] {
    DION3_DISPATCH_FLOAT(gdt, TG, [&] {
      DION3_DISPATCH_FLOAT(odt, TO, [&] {
        launch_pdl(gather_columns_kernel<TM, TG, TO>, grid, kColumnThreads, 0, s, mats, rows, cols, idx, k, scale_m,
                   scale_g, decay, static_cast<TO*>(out.data), out.ld, obs, row_sumsq, skip);
      });
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

void launch_update_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType wdt,
                           const int32_t* idx, int64_t k, const MatrixView& O, const UpdateParams& p,
                           const int* skip, cudaStream_t s) {
  if (nmats == 0 || rows == 0 || cols == 0) return;
  if (p.normuon || p.o_col_offset != 0)
    fail("apply_update: a column-stepped set takes no NorMuon and no column offset");
  const dim3 grid(ceil_div_u(rows * cols, kColumnThreads), static_cast<unsigned>(nmats));
  const int64_t obs = O.batch > 1 ? O.batch_stride : k * O.ld;
  DION3_DISPATCH_FLOAT(O.dtype, TO, [&] {
    DION3_DISPATCH_FLOAT(wdt, TW, [&] {
      launch_pdl(update_columns_kernel<TW, TO>, grid, kColumnThreads, 0, s, mats, rows, cols, idx, k,
                 static_cast<const TO*>(O.data), O.ld, obs, p.decay, p.adjusted_lr, p.cautious_wd, skip);
    });
  });
  DION3_CUDA_LAUNCH_CHECK();
}

}  // namespace dion3::cuda
