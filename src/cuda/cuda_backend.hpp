// cuda_backend.hpp — CUDA-specific knobs of the CUDA backend for tests and benchmarks (plain
// C++, no CUDA headers): choosing full-GEMM or symmetric (lower-triangle tile) products, the
// tile size, the fused symmetric kernel, and reaching the backend's stream.
#pragma once

#include <cstdint>

#include "dion3/backend.hpp"

namespace dion3::cuda {

struct SymmetricOptions {
  bool enabled = true;  // false: gram/sym_product run as one full cuBLAS GEMM per matrix
  int64_t tile = 0;     // tile edge of the lower-triangle schedule; 0 = automatic by size
  // With enabled: true, the fused sm_90a lower-triangle kernel (sym_wgmma.cu) wherever it supports
  // the operands; false, the tile schedule on cuBLAS. DION3_SYM_KERNEL=0 turns it off.
  bool kernel = true;
  // The fused kernel's tiles in clusters of two CTAs that share B's loads (one CTA each: false).
  // DION3_SYM_PAIRS=0 turns it off.
  bool pairs = true;
};

// Throws dion3::Error(InvalidArgument) if `backend` is not a CUDA backend.
void set_symmetric_options(Backend& backend, const SymmetricOptions& options);
SymmetricOptions symmetric_options(Backend& backend);
void* backend_stream(Backend& backend);  // the cudaStream_t the backend enqueues on
// The tile edge the backend uses for a p x p symmetric product (p when it uses a full GEMM).
int64_t symmetric_tile_for(Backend& backend, int64_t p);
// The multiply-adds a p x p symmetric product (X·Xᵀ, sym·sym) really performs on this backend,
// as a fraction of one full GEMM's: the tiles it computes, padding included (0.51-0.56 with the
// fused kernel for p = 4096-512; 1 when it runs full GEMMs). What a roofline floor counts.
double symmetric_flop_fraction(Backend& backend, int64_t p);
// At most `sms` multiprocessors for the products (the fused symmetric kernel's persistent grid and
// cuBLAS's SM target), so that kernels on other streams keep the rest; 0 restores the whole GPU.
// Results are the same bits either way. Throws InvalidArgument for a negative count.
void set_product_sm_limit(Backend& backend, int sms);
int product_sm_limit(Backend& backend);

}  // namespace dion3::cuda
