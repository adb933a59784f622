// kernels.cuh — host-side launchers of the CUDA backend's kernels (step_kernels.cu,
// elementwise_kernels.cu, symmetric.cu, sym_wgmma.cu). Every launcher enqueues on `stream` and
// never syncs.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <span>

#include "cuda/cuda_common.cuh"
#include "dion3/backend.hpp"

namespace dion3::cuda {

// --- step kernels (step_kernels.cu) ------------------------------------------------------
void launch_accumulate(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt,
                       DType gdt, Hyper decay, Hyper grad_scale, float* scores, float* row_sumsq, float* largest,
                       const int* skip, cudaStream_t s,
                       bool vec);  // vec: every row pointer 4-element aligned, cols % 4 == 0
void launch_select_rows(const float* scores, int64_t count, int64_t m, int64_t k, int32_t* idx,
                        float* largest, const float* row_sumsq, float* selected_sumsq, const int* skip,
                        cudaStream_t s);
void launch_gather_rows(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt,
                        DType gdt, const int32_t* idx, int64_t k, Hyper scale_m, Hyper scale_g,
                        Hyper decay, const float* selected_sumsq, NormGuard norm, const MatrixView& out,
                        float* row_sumsq, const int* skip, cudaStream_t s,
                        bool vec);  // vec: as launch_accumulate's (out is checked here); selected_sumsq, row_sumsq may be null
// (with selected_sumsq, each matrix's rows are scaled by inverse_norm_of(sqrt(selected_sumsq[i]), norm): gather_normalized)
// scratch: at least apply_update_scratch_floats(nmats, k) floats.
int64_t apply_update_scratch_floats(int64_t nmats, int64_t k);
void launch_apply_update(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType wdt,
                         const int32_t* idx, int64_t k, const MatrixView& O, const UpdateParams& p,
                         float* scratch, const int* skip, cudaStream_t s);  // alignment checked per row
// NorMuon on O's k rows per matrix (entry s updates set row idx[s]; those >= rows are padding):
// the variance moves, and scratch holds the square sums [nmats*k], then the rows' inverse roots
// [nmats*k], then each matrix's rescale [nmats] (apply_update_scratch_floats in all).
void launch_normuon_factors(const DeviceMat* mats, int64_t nmats, int64_t rows, const int32_t* idx, int64_t k,
                            const MatrixView& O, Hyper beta2, float* scratch, const int* skip, cudaStream_t s);
// Column-stepped sets (column_kernels.cu): rows x cols is the stored shape; the set's rows are
// its columns. scores / row_sumsq per column; out is k x rows per matrix, O too or wider (its
// columns [o_col_offset, + rows) update these rows). scratch: at least the *_scratch_floats floats.
int64_t accumulate_columns_scratch_floats(int64_t nmats, int64_t rows, int64_t cols);
void launch_accumulate_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt,
                               DType gdt, Hyper decay, Hyper grad_scale, float* scores, float* row_sumsq,
                               float* largest, float* scratch, const int* skip, cudaStream_t s,
                               bool vec);  // vec: every stored row 4-element aligned, cols % 4 == 0
int64_t gather_columns_scratch_floats(int64_t nmats, int64_t rows, int64_t k);
// With selected_sumsq, each matrix's gathered columns are scaled by
// inverse_norm_of(sqrt(selected_sumsq[i]), norm), as gather_normalized's rows.
void launch_gather_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType mdt, DType gdt,
                           const int32_t* idx, int64_t k, Hyper scale_m, Hyper scale_g, Hyper decay,
                           const float* selected_sumsq, NormGuard norm, const MatrixView& out, float* row_sumsq,
                           float* scratch, const int* skip, cudaStream_t s);
void launch_update_columns(const DeviceMat* mats, int64_t nmats, int64_t rows, int64_t cols, DType wdt,
                           const int32_t* idx, int64_t k, const MatrixView& O, const UpdateParams& p,
                           float* scratch, const int* skip, cudaStream_t s);  // scratch: as launch_apply_update's
void launch_remap_rows(const int32_t* in, int64_t count, int64_t k_in, int64_t lo, int64_t hi, int64_t k_out,
                       int32_t* out, const int* skip, cudaStream_t s);
void launch_selection_slots(const int32_t* idx, int64_t count, int64_t k, int64_t c, int64_t piece, int64_t block,
                            int64_t first_slot, int32_t* out, const int* skip, cudaStream_t s);
void launch_copy_rows(void* dst, std::size_t dst_pitch, const int32_t* dst_idx, const void* src,
                      std::size_t src_pitch, const int32_t* src_idx, std::size_t width, int64_t rows,
                      cudaStream_t s);
void launch_check_finite(std::span<const MatrixView> xs, int* flag, cudaStream_t s);
void launch_check_step(std::span<const StepCheck> xs, int* flag, cudaStream_t s);
void launch_finish_step(const int* flag, int64_t* counters, bool count_dropped, cudaStream_t s);
void launch_settle_agreement(int* words, int regions, cudaStream_t s);

// --- element-wise kernels (elementwise_kernels.cu) ---------------------------------------
int64_t normalize_scratch_floats(int64_t batch);
// row_sumsq: null, or in's rows' sums of squares (gather_rows'), which spare the first pass.
// transpose: out is in's shape transposed and receives the normalised in^T.
void launch_normalize(const MatrixView& in, const MatrixView& out, NormGuard norm, const float* row_sumsq,
                      float* scratch, bool transpose, cudaStream_t s);
void launch_transpose(const MatrixView& in, const MatrixView& out, cudaStream_t s);
void launch_convert(const MatrixView& in, const MatrixView& out, cudaStream_t s);  // same shape
// Multi-tensor: ps[i] with hs[i]; one launch per dtype combination and per kMultiTensors small
// tensors, one per large tensor.
void launch_adamw(std::span<const ElementwiseParam> ps, std::span<const AdamWParams> hs, const int* skip,
                  cudaStream_t s);
void launch_lion(std::span<const ElementwiseParam> ps, std::span<const LionParams> hs, const int* skip,
                 cudaStream_t s);
// C[r][c] = beta*D[r][c] + gamma*(r==c) for every (r, c) with c < (r/tile + 1)*tile (the
// lower-triangle tiles, diagonal tiles whole; tile = p: everything). D may alias C.
void launch_sym_prepare(const MatrixView& D, float beta, float gamma, const MatrixView& C,
                        int64_t tile, cudaStream_t s);
// C[r][c] = C[c][r] for r < c; then C[r][r] += gamma. mirror=false: only the diagonal add.
void launch_mirror_lower(const MatrixView& C, float gamma, bool mirror, cudaStream_t s);

// --- symmetric products (symmetric.cu) ----------------------------------------------------
// Lower-triangle tiles (i >= j, tile edge `tile`) of C = alpha * A * B^T + beta * C, where A and
// B are batches of p x kdim row-major matrices; the upper tiles are left untouched.
// ptr_scratch: at least sym_ptr_scratch_bytes(batch, p, tile) bytes of device memory.
std::size_t sym_ptr_scratch_bytes(int64_t batch, int64_t p, int64_t tile);
void sym_lower_gemm(cublasHandle_t h, cudaStream_t s, const MatrixView& A, const MatrixView& B,
                    float alpha, float beta, const MatrixView& C, int64_t tile, void* ptr_scratch);
// One sm_90a kernel for the same products with the epilogue fused (sym_wgmma.cu): every
// element of C = alpha * A * B^T + beta * D + gamma * I is computed from the lower triangle
// (D is read there and in the diagonal blocks only, and may alias C) and written to (r, c) and
// (c, r), so C is exactly symmetric. A, B, C and D all fp16 or all bf16, TMA-addressable (16-byte
// aligned, ld and batch stride multiples of 8 elements). sym_wgmma_supported() says whether it
// runs here (a Hopper sm_90 device and these operands); D may be null.
bool sym_wgmma_supported(const MatrixView& A, const MatrixView& B, const MatrixView* D,
                         const MatrixView& C);
bool sym_wgmma_available();  // a Hopper sm_90 device is current
// The multiply-adds the kernel performs for a p x p output, over a full GEMM's: the 64-column
// blocks on or below the diagonal of each 64-row block (one consumer warpgroup's), padding included.
double sym_wgmma_flop_fraction(int64_t p);
// Banded symmetric matrices (square, p x p): the lower triangle and the diagonal 256 x 256 blocks
// are stored, the rest of the upper triangle is not (kSymBand). banded_in: A and B are symmetric
// and banded (their upper blocks are read transposed from the lower ones); banded_out: C is
// written banded (its mirrored stores outside the diagonal blocks are left out).
// skip_epilogue (benchmarks only): compute the tiles but store nothing. max_ctas > 0 caps the
// persistent grid (one CTA per multiprocessor) below the device's multiprocessor count. pairs:
// the tiles in clusters of two CTAs that share B's loads (false: one CTA each).
constexpr int64_t kSymBand = 256;
void launch_sym_wgmma(const MatrixView& A, const MatrixView& B, float alpha, float beta,
                      const MatrixView* D, float gamma, const MatrixView& C, cudaStream_t s,
                      bool banded_in = false, bool banded_out = false, bool skip_epilogue = false,
                      int max_ctas = 0, bool pairs = true);
// Full C = alpha * op(A) * op(B) + beta * C through cublasGemmStridedBatchedEx (row-major views).
void cublas_gemm(cublasHandle_t h, bool trans_a, bool trans_b, float alpha, const MatrixView& A,
                 const MatrixView& B, float beta, const MatrixView& C);

}  // namespace dion3::cuda
