// dion3/orthogonalize.hpp — batched polar-factor approximation (algorithm.md §2).
//
// Standard Newton–Schulz and Gram Newton–Schulz with restarts, written once over the backend's
// primitives (gemm, gram, sym_product), so every backend runs the same algorithm. An
// Orthogonalizer is planned once for a (batch, rows, cols) problem — method and iteration dtype
// resolved, workspace allocated — and then run any number of times without allocating.
#pragma once

#include <cstdint>

#include "dion3/export.h"
#include "dion3/backend.hpp"
#include "dion3/config.hpp"

namespace dion3 {

// FLOPs of standard NS on a batch of p x q (p <= q) inputs, the "effective" convention of algorithm.md §2:
// T*(4p^2 q + 2p^3) per matrix, no symmetry savings.
DION3_API double effective_ns_flops(int64_t batch, int64_t rows, int64_t cols, int steps);
// FLOPs a method really performs (full GEMMs; symmetric products scaled by `sym_factor`; Gram's
// R update after each restart, which forms one of its products whole, counted as if each has one).
DION3_API double standard_ns_flops(int64_t batch, int64_t p, int64_t q, int steps, double sym_factor);
DION3_API double gram_ns_flops(int64_t batch, int64_t p, int64_t q, int steps, int n_restarts, double sym_factor);
// The method `auto` resolves to for p x q (p <= q) on this backend (always standard when p == q,
// where Gram would iterate in bfloat16, and where its coefficients and restarts would let it
// diverge in its iteration dtype: OrthConfig::gram_diverges).
DION3_API OrthMethod choose_orth_method(const Backend& backend, const OrthConfig& cfg, int64_t rows, int64_t cols);
// The dtype `method` iterates in: the configured one, else the backend's choice.
DION3_API DType choose_iteration_dtype(const Backend& backend, const OrthConfig& cfg, OrthMethod method);

class DION3_API Orthogonalizer {
 public:
  // With workspace == null the Orthogonalizer allocates its own; else it uses the caller's
  // memory (at least required_workspace() bytes, not owned), e.g. an arena shared by several
  // Orthogonalizers whose runs are ordered on one stream. real_rows > 0: each input has at most
  // that many non-zero rows, the others zero padding (a row-sharded stack); where those number at
  // most cols, a tall input iterates untransposed, as one device orients the real rows (the
  // padding stays exactly zero; transposed, it would iterate on a Gram of too small a rank).
  Orthogonalizer(Backend& backend, const OrthConfig& cfg, int64_t batch, int64_t rows, int64_t cols,
                 void* workspace = nullptr, int64_t real_rows = 0);
  // Bytes of workspace a (batch, rows, cols) problem needs with this config on this backend.
  static std::size_t required_workspace(const Backend& backend, const OrthConfig& cfg, int64_t batch,
                                        int64_t rows, int64_t cols, int64_t real_rows = 0);
  // Byte offset inside that workspace where an input of in_bytes may lie during run(): the part
  // run() writes only after it has read its input (behind X, which it normalises the input into),
  // 256-byte aligned. kNoInputRoom where the input does not fit there.
  static constexpr std::size_t kNoInputRoom = ~std::size_t{0};
  static std::size_t input_offset(const Backend& backend, const OrthConfig& cfg, int64_t batch, int64_t rows,
                                  int64_t cols, std::size_t in_bytes, int64_t real_rows = 0);
  // in: batch x rows x cols, contiguous, any float dtype (normalised in fp32, algorithm.md §2).
  // out: same shape, contiguous, any float dtype. in and out may be the same memory.
  void run(MatrixView in, MatrixView out);
  // As above, but leaves the result in the workspace, in the iteration dtype, and returns a
  // view of it (batch x rows x cols, contiguous), valid until the next run on this workspace.
  // Saves the final conversion pass when the caller can read the iteration dtype directly.
  // in_row_sumsq, if not null: the sums of squares of in's rows (batch x rows, as
  // Backend::gather_rows gives them), which spare the normalisation a pass over in.
  MatrixView run(MatrixView in, const float* in_row_sumsq = nullptr);
  // For callers that normalise while they gather (Backend::gather_normalized, with the config's
  // norm): where non-transposed runs (rows <= cols) iterate, in the iteration dtype. Write the
  // normalised input there and call run_normalized(), which returns as run(in) does; the
  // normalising pass over the input is gone.
  MatrixView normalized_input() const;
  MatrixView run_normalized();

  OrthMethod method() const { return method_; }
  DType iteration_dtype() const { return dtype_; }
  bool transposed() const { return transposed_; }
  NormGuard norm() const { return cfg_.norm; }
  int64_t batch() const { return batch_; }
  std::size_t workspace_bytes() const { return bytes_; }

 private:
  // Each iterates on X (in wide(0)) and returns where its result is, in the caller's shape (see
  // last_product): wide(0), wide(1) or, for square standard NS, the square X shares with A.
  MatrixView standard(MatrixView X);
  MatrixView gram(MatrixView X);
  // The final product S X (S symmetric) into out's memory, in the caller's shape (rows x cols):
  // for a tall problem X^T S = (S X)^T, written q x p by the product itself.
  MatrixView last_product(MatrixView S, MatrixView X, MatrixView out);
  MatrixView square(int slot) const;  // p x p scratch matrices
  MatrixView wide(int slot) const;    // p x q scratch matrices

  Backend& backend_;
  OrthConfig cfg_;
  int64_t batch_, p_, q_;
  bool transposed_;
  OrthMethod method_;
  DType dtype_;
  DeviceBuffer owned_;      // when the caller gave no workspace
  char* workspace_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace dion3
