// cuda_common.cuh — shared pieces of the CUDA backend: error checks, the one dtype-dispatch
// switch (DION3_DISPATCH_FLOAT), fp32 load/store of fp32/fp16/bf16 elements, launch helpers.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "dion3/error.hpp"
#include "dion3/view.hpp"

namespace dion3::cuda {

[[noreturn]] void throw_cuda(cudaError_t e, const char* what, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t s, const char* what, const char* file, int line);

#define DION3_CUDA_CHECK(expr)                                                           \
  do {                                                                                   \
    cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) ::dion3::cuda::throw_cuda(e_, #expr, __FILE__, __LINE__);     \
  } while (0)
#define DION3_CUBLAS_CHECK(expr)                                                         \
  do {                                                                                   \
    cublasStatus_t s_ = (expr);                                                          \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                     \
      ::dion3::cuda::throw_cublas(s_, #expr, __FILE__, __LINE__);                        \
  } while (0)
// After every kernel launch: launch-configuration errors surface here, not later.
#define DION3_CUDA_LAUNCH_CHECK() DION3_CUDA_CHECK(cudaGetLastError())

// The single place where a runtime DType becomes a compile-time element type. `T` is bound
// to float, __half or __nv_bfloat16 inside the body.
#define DION3_DISPATCH_FLOAT(dtype, T, ...)                                              \
  [&] {                                                                                  \
    switch (dtype) {                                                                     \
      case ::dion3::DType::F32: { using T = float; return __VA_ARGS__(); }               \
      case ::dion3::DType::F16: { using T = __half; return __VA_ARGS__(); }              \
      case ::dion3::DType::BF16: { using T = __nv_bfloat16; return __VA_ARGS__(); }      \
      default:                                                                           \
        ::dion3::fail(std::string("CUDA backend: unsupported dtype ") +                  \
                      ::dion3::dtype_name(dtype) + " (expected float32, float16 or bfloat16)"); \
    }                                                                                    \
  }()

template <class T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// V consecutive elements, loaded/stored as one access of V * sizeof(T) bytes (at most 16).
template <class T, int V>
struct alignas(V * sizeof(T)) PackV {
  T v[V];
};
template <class T>
using Pack4 = PackV<T, 4>;
// A pack read once (evict-first: nothing of it is kept in L2), 16 bytes at a time.
template <class P>
__device__ __forceinline__ P load_streaming(const P* p) {
  static_assert(sizeof(P) % 16 == 0 && alignof(P) >= 16, "whole, aligned 16-byte words");
  P out;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(P) / 16); ++i)
    reinterpret_cast<uint4*>(&out)[i] = __ldcs(reinterpret_cast<const uint4*>(p) + i);
  return out;
}
inline bool aligned4(const void* p, std::size_t elem) {
  return (reinterpret_cast<std::uintptr_t>(p) % (4 * elem)) == 0;
}

__device__ __forceinline__ bool skipped(const int* skip) { return skip != nullptr && *skip != 0; }

// Programmatic dependent launch (sm_90). A kernel started by launch_pdl() may be scheduled while
// the previous kernel on its stream drains (its blocks take SMs as they free up and do their
// set-up meanwhile), so it must call pdl_wait() before it first touches global memory:
// griddepcontrol.wait returns once the previous kernel has completed and its writes are visible.
// pdl_wait() then lets the stream's next kernel be scheduled in turn. Elsewhere it is a no-op.
// Every kernel before the previous one has completed by the time this one starts (the previous
// one waited for them first), so a kernel may read before pdl_wait() what only those wrote, where
// its launch site knows that the previous kernel does not write it (the normalize's transposes).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, s>>>(args...) with programmatic stream serialization: the gap
// between kernels (launch latency, the previous kernel's tail) overlaps this one's start. The
// kernel must call pdl_wait() before it touches global memory (see above for the exception).
template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t s,
                Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DION3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

inline cudaDataType_t cuda_dtype(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::F16: return CUDA_R_16F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F64: return CUDA_R_64F;
    default: fail(std::string("CUDA backend: no cuBLAS type for dtype ") + dtype_name(t));
  }
}

// Blocks of `threads` threads of `kernel` that the current device runs at once: the grid of a
// persistent kernel.
template <class... Params>
unsigned persistent_blocks(void (*kernel)(Params...), int threads) {
  int dev = 0, sms = 0, per_sm = 0;
  DION3_CUDA_CHECK(cudaGetDevice(&dev));
  DION3_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  DION3_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return static_cast<unsigned>(sms * (per_sm > 0 ? per_sm : 1));
}
inline unsigned ceil_div_u(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// One matrix of a megabatch as the kernels see it (uploaded by CudaBackend::refresh).
struct DeviceMat {
  void* w;
  const void* g;
  void* m;
  float* v;
  int64_t ldw, ldg, ldm;
};

// The first position of the ascending a[0..n) whose value is >= x (n if none).
__device__ __forceinline__ int64_t lower_bound_i32(const int32_t* a, int64_t n, int64_t x) {
  int64_t lo = 0;
  while (n > 0) {
    const int64_t half = n / 2;
    if (a[lo + half] < x) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

// lower_bound_i32 searched by a whole warp (every lane calls it and gets the result): each step
// probes 32 evenly spaced entries, so n <= 32768 takes three dependent loads instead of log2(n).
__device__ __forceinline__ int64_t warp_lower_bound_i32(const int32_t* __restrict__ a, int64_t n, int64_t x,
                                                        int lane) {
  int64_t lo = 0;
  while (n > 32) {
    const int64_t step = (n + 31) >> 5, p = lo + lane * step;
    // The probes below x are a prefix; the answer lies after the last of them, up to the next probe.
    const int below = __popc(__ballot_sync(0xffffffffu, p < lo + n && a[p] < x));
    if (below == 0) return lo;
    const int64_t next = lo + (below - 1) * step + 1;
    n = min(step - 1, lo + n - next);
    lo = next;
  }
  return lo + __popc(__ballot_sync(0xffffffffu, lane < n && a[lo + lane] < x));
}

// Warp-wide sum (all 32 lanes); result valid in every lane. Fixed order: reproducible.
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Two sums at once, in the same order as two warp_sum calls.
__device__ __forceinline__ float2 warp_sum(float2 x) { return make_float2(warp_sum(x.x), warp_sum(x.y)); }

// Block-wide sum of a float or a float2 (blockDim.x a multiple of 32, <= 1024); result valid in
// every thread. Fixed reduction order, so results are bitwise reproducible.
template <class V>
__device__ __forceinline__ V block_sum(V x, V* smem32) {
  x = warp_sum(x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // smem32 may still be read by a previous call
  if (lane == 0) smem32[warp] = x;
  __syncthreads();
  const int nw = (blockDim.x + 31) >> 5;
  return warp_sum(lane < nw ? smem32[lane] : V{});
}

// |x| as bits that order as unsigned integers (NaN above every number): the state bounds are
// raised by comparing these.
__device__ __forceinline__ unsigned bound_bits(float x) { return __float_as_uint(fabsf(x)); }

// Raises bound[0 .. N) to the block's largest of x[0 .. N) (bound_bits). Every thread of the block
// takes part (blockDim.x a multiple of 32). One thread per block compares with the bounds before
// it raises them: atomics of every warp on the same words would serialise, and once the bounds
// settle most blocks have none to do.
template <int N>
__device__ __forceinline__ void raise_bounds(float* bound, const unsigned (&x)[N]) {
  __shared__ unsigned part[N][32];
  unsigned a[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    a[j] = x[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a[j] = max(a[j], __shfl_xor_sync(0xffffffffu, a[j], o));
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int j = 0; j < N; ++j) part[j][warp] = a[j];
  __syncthreads();
  if (threadIdx.x != 0) return;
  auto* words = reinterpret_cast<unsigned*>(bound);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) a[j] = max(a[j], part[j][w]);
    if (a[j] > __ldcg(words + j)) atomicMax(words + j, a[j]);
  }
}

}  // namespace dion3::cuda
