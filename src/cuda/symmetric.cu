// symmetric.cu — GEMMs of the CUDA backend on cuBLAS: the general batched GEMM on row-major
// views, and the lower-triangle tile schedule of the symmetric products (X·Xᵀ and sym·sym):
// only tiles (i >= j) are computed, as up to three pointer-array batched GEMMs (full tiles,
// the ragged last tile row, the ragged corner) over every matrix of the batch at once. The
// pointer arrays are built on the device by a small kernel, so nothing syncs with the host and
// the sequence can be captured in a CUDA graph.
#include <cmath>

#include "cuda/kernels.cuh"

namespace dion3::cuda {
namespace {

int64_t bstride_of(const MatrixView& v) { return v.batch > 1 ? v.batch_stride : v.rows * v.ld; }

cublasComputeType_t compute_type_for(DType ab) {
  (void)ab;
  return CUBLAS_COMPUTE_32F;  // fp32 accumulation for every input dtype (fp32 stays IEEE fp32)
}

void check_gemm_types(DType ab, DType c, const char* what) {
  const bool ok = (ab == DType::F32 && c == DType::F32) ||
                  ((ab == DType::F16 || ab == DType::BF16) && (c == ab || c == DType::F32));
  if (!ok)
    fail(std::string(what) + ": unsupported dtype combination A/B " + dtype_name(ab) + ", C " +
             dtype_name(c) + " (C must be float32 or the operands' dtype)",
         Status::Unsupported);
}

struct TileArgs {
  const char* a;  // operand whose row blocks index the tile's rows (i)
  const char* b;  // operand whose row blocks index the tile's columns (j)
  char* c;
  int64_t lda, ldb, ldc;               // elements
  int64_t sa, sb, sc;                  // batch strides, elements
  int64_t esa, esc;                    // element sizes in bytes (A/B, C)
  int64_t T, bs;                       // tile rows, tile edge
  int64_t n1, n2;                      // tiles per matrix in group 1 (full) and 2 (last row)
  int64_t batch;
  bool ragged;                         // last tile row shorter than bs
};

// Pointer arrays, group-major then batch-major: cublas "A" = B_j, "B" = A_i, "C" = C_ij.
__global__ void build_tile_ptrs(TileArgs t, const void** pa, const void** pb, void** pc) {
  const int64_t ntiles = t.T * (t.T + 1) / 2;
  const int64_t id = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (id >= ntiles * t.batch) return;
  const int64_t b = id / ntiles, lin = id % ntiles;
  int64_t i = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(lin) + 1.0) - 1.0) / 2.0);
  while (i * (i + 1) / 2 > lin) --i;
  while ((i + 1) * (i + 2) / 2 <= lin) ++i;
  const int64_t j = lin - i * (i + 1) / 2;
  int64_t slot;
  if (!t.ragged) {
    slot = b * ntiles + lin;
  } else if (i < t.T - 1) {
    slot = b * t.n1 + lin;
  } else if (j < t.T - 1) {
    slot = t.n1 * t.batch + b * t.n2 + j;
  } else {
    slot = (t.n1 + t.n2) * t.batch + b;
  }
  pa[slot] = t.b + (b * t.sb + j * t.bs * t.ldb) * t.esa;
  pb[slot] = t.a + (b * t.sa + i * t.bs * t.lda) * t.esa;
  pc[slot] = t.c + (b * t.sc + i * t.bs * t.ldc + j * t.bs) * t.esc;
}

}  // namespace

void cublas_gemm(cublasHandle_t h, bool trans_a, bool trans_b, float alpha, const MatrixView& A,
                 const MatrixView& B, float beta, const MatrixView& C) {
  const int64_t M = trans_a ? A.cols : A.rows, K = trans_a ? A.rows : A.cols;
  const int64_t KB = trans_b ? B.cols : B.rows, N = trans_b ? B.rows : B.cols;
  if (K != KB || C.rows != M || C.cols != N)
    fail("gemm: shapes do not match: op(A) is " + std::to_string(M) + "x" + std::to_string(K) +
         ", op(B) is " + std::to_string(KB) + "x" + std::to_string(N) + ", C is " +
         std::to_string(C.rows) + "x" + std::to_string(C.cols));
  if (A.dtype != B.dtype) fail("gemm: A and B must have the same dtype", Status::Unsupported);
  check_gemm_types(A.dtype, C.dtype, "gemm");
  const int64_t batch = C.batch;
  if ((A.batch != batch && A.batch != 1) || (B.batch != batch && B.batch != 1))
    fail("gemm: batch sizes differ");
  if (batch == 0 || M == 0 || N == 0) return;
  const int64_t sa = A.batch == 1 ? 0 : A.batch_stride, sb = B.batch == 1 ? 0 : B.batch_stride;
  const int64_t sc = bstride_of(C);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
  DION3_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha, B.data,
      cuda_dtype(B.dtype), static_cast<int>(B.ld), sb, A.data, cuda_dtype(A.dtype),
      static_cast<int>(A.ld), sa, &beta, C.data, cuda_dtype(C.dtype), static_cast<int>(C.ld), sc,
      static_cast<int>(batch), compute_type_for(A.dtype), CUBLAS_GEMM_DEFAULT));
}

std::size_t sym_ptr_scratch_bytes(int64_t batch, int64_t p, int64_t tile) {
  const int64_t T = (p + tile - 1) / tile;
  return static_cast<std::size_t>(3 * batch * T * (T + 1) / 2) * sizeof(void*);
}

void sym_lower_gemm(cublasHandle_t h, cudaStream_t s, const MatrixView& A, const MatrixView& B,
                    float alpha, float beta, const MatrixView& C, int64_t tile, void* ptr_scratch) {
  const int64_t p = C.rows, kdim = A.cols, batch = C.batch;
  if (A.rows != p || B.rows != p || B.cols != kdim || C.cols != p)
    fail("symmetric product: operand shapes do not match");
  if (A.dtype != B.dtype) fail("symmetric product: operands' dtypes differ", Status::Unsupported);
  check_gemm_types(A.dtype, C.dtype, "symmetric product");
  if (batch == 0 || p == 0) return;
  TileArgs t{};
  t.a = static_cast<const char*>(A.data);
  t.b = static_cast<const char*>(B.data);
  t.c = static_cast<char*>(C.data);
  t.lda = A.ld; t.ldb = B.ld; t.ldc = C.ld;
  t.sa = A.batch == 1 ? 0 : A.batch_stride;
  t.sb = B.batch == 1 ? 0 : B.batch_stride;
  t.sc = bstride_of(C);
  t.esa = static_cast<int64_t>(dtype_size(A.dtype));
  t.esc = static_cast<int64_t>(dtype_size(C.dtype));
  t.bs = tile;
  t.T = (p + tile - 1) / tile;
  t.batch = batch;
  const int64_t r = p - (t.T - 1) * tile;  // last block's size
  t.ragged = r != tile;
  t.n1 = t.ragged ? (t.T - 1) * t.T / 2 : t.T * (t.T + 1) / 2;
  t.n2 = t.ragged ? t.T - 1 : 0;
  const int64_t ntot = batch * t.T * (t.T + 1) / 2;
  char* base = static_cast<char*>(ptr_scratch);
  auto** pa = reinterpret_cast<const void**>(base);
  auto** pb = reinterpret_cast<const void**>(base + ntot * sizeof(void*));
  auto** pc = reinterpret_cast<void**>(base + 2 * ntot * sizeof(void*));
  build_tile_ptrs<<<ceil_div_u(ntot, 256), 256, 0, s>>>(t, pa, pb, pc);
  DION3_CUDA_LAUNCH_CHECK();
  const cudaDataType_t ab = cuda_dtype(A.dtype), ct = cuda_dtype(C.dtype);
  auto call = [&](int64_t offset, int64_t count, int64_t m, int64_t n) {
    if (count == 0) return;
    // Column-major: C_ij^T (m = cols of tile, n = rows of tile) = B_j · A_i^T, both "T,N".
    DION3_CUBLAS_CHECK(cublasGemmBatchedEx(
        h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
        static_cast<int>(kdim), &alpha, pa + offset, ab, static_cast<int>(t.ldb), pb + offset, ab,
        static_cast<int>(t.lda), &beta, pc + offset, ct, static_cast<int>(t.ldc),
        static_cast<int>(count), compute_type_for(A.dtype), CUBLAS_GEMM_DEFAULT));
  };
  call(0, t.n1 * batch, tile, tile);
  if (t.ragged) {
    call(t.n1 * batch, t.n2 * batch, tile, r);
    call((t.n1 + t.n2) * batch, batch, r, r);
  }
}

}  // namespace dion3::cuda
