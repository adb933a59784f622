// sym_wgmma.cu — the symmetric products (X·Xᵀ and sym·sym) as one Hopper (sm_90a) kernel:
// only the lower-triangle output tiles of C = alpha·A·Bᵀ + beta·D + gamma·I are computed
// (A, B: batches of p x k row-major fp16/bf16 matrices, "K-contiguous" both), with fp32
// accumulation, and each tile's epilogue writes C[r][c] and its mirror C[c][r] directly, so no
// prepare or mirror pass is needed. Persistent grid (one CTA per SM), linearized triangular
// schedule over 128 x 256 tiles (tile t -> (matrix, row block i, column block j <= i/2)),
// TMA loads (128-byte swizzle) into a 4-stage mbarrier pipeline fed by one producer warp, and
// two consumer warpgroups issuing wgmma m64n256k16 from shared memory.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cmath>
#include <mutex>
#include <type_traits>

#include "cuda/kernels.cuh"

namespace dion3::cuda {
namespace {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4, kThreads = 384;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2;  // 16 KiB, 32 KiB per stage
constexpr int kSmemBytes = kStages * (kABytes + kBBytes) + 1024 /*align*/ + 256 /*barriers*/;

#define DION3_WGMMA_REGS "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define DION3_WGMMA_OUTS "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

template <bool kBF16>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db,
                                                 int scale_d) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kBF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " DION3_WGMMA_REGS
                 ", %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : DION3_WGMMA_OUTS
                 : "l"(da), "l"(db), "r"(scale_d));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " DION3_WGMMA_REGS
                 ", %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : DION3_WGMMA_OUTS
                 : "l"(da), "l"(db), "r"(scale_d));
  }
#endif
}

__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DION3_SM90A 1
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// Shared-memory matrix descriptor: K-major tile, rows of 128 bytes, 128-byte swizzle (8-row
// atoms of 1024 bytes: stride byte offset 1024, leading byte offset unused).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

struct SymParams {
  void* c;
  const void* d;        // null: no beta·D term
  int64_t ldc, ldd, sc, sd;
  float alpha, beta, gamma;
  int p, kblocks;
  int a_batched, b_batched;
  int tiles_per_mat;    // S(T): lower-triangle 128x256 tiles of one matrix
  int total_tiles;
  int vec2;             // C and D rows allow 2-element stores and loads
  int skip_epilogue;    // benchmarks only: no stores (times the main loop alone)
};

// Tiles before row block i: sum_{k<i} (k/2 + 1).
__device__ __forceinline__ int tiles_before(int i) {
  const int m = i >> 1;
  return (i & 1) ? (m + 1) * (m + 1) : m * (m + 1);
}

template <class T> struct Pair;
template <> struct Pair<float> { using type = float2; };
template <> struct Pair<__half> { using type = __half2; };
template <> struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };

template <class Tout>
__device__ __forceinline__ void store_pair(Tout* p, float a, float b) {
  typename Pair<Tout>::type v;
  if constexpr (std::is_same_v<Tout, float>) v = make_float2(a, b);
  else if constexpr (std::is_same_v<Tout, __half>) v = __floats2half2_rn(a, b);
  else v = __floats2bfloat162_rn(a, b);
  *reinterpret_cast<typename Pair<Tout>::type*>(p) = v;
}

template <bool kBF16, class Tout>
__global__ void __launch_bounds__(kThreads, 1)
    sym_wgmma_kernel(const __grid_constant__ CUtensorMap tmA,
                     const __grid_constant__ CUtensorMap tmB, const SymParams prm) {
#if defined(DION3_SM90A)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* sA = smem;
  uint8_t* sB = smem + kStages * kABytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * (kABytes + kBBytes));
  uint64_t* empty = full + kStages;

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  const int tpm = prm.tiles_per_mat;
  if (wg == 0) {
    // Producer warpgroup: one thread issues every TMA load.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      uint32_t it = 0;
      for (int t = blockIdx.x; t < prm.total_tiles; t += gridDim.x) {
        const int b = t / tpm, l = t - b * tpm;
        int i = static_cast<int>(2.0f * sqrtf(static_cast<float>(l)));
        while (i > 0 && tiles_before(i) > l) --i;
        while (tiles_before(i + 1) <= l) ++i;
        const int j = l - tiles_before(i);
        const int ba = prm.a_batched ? b : 0, bb = prm.b_batched ? b : 0;
        for (int kb = 0; kb < prm.kblocks; ++kb, ++it) {
          const int s = it % kStages;
          mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
          mbar_expect_tx(&full[s], kABytes + kBBytes);
          tma_load_3d(sA + s * kABytes, &tmA, &full[s], kb * kBK, i * kBM, ba);
          tma_load_3d(sB + s * kBBytes, &tmB, &full[s], kb * kBK, j * kBN, bb);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1;  // rows cw*64 .. cw*64+63 of the tile
    const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    float acc[128];
    uint32_t it = 0;
    const int p = prm.p;
    for (int t = blockIdx.x; t < prm.total_tiles; t += gridDim.x) {
      const int b = t / tpm, l = t - b * tpm;
      int i = static_cast<int>(2.0f * sqrtf(static_cast<float>(l)));
      while (i > 0 && tiles_before(i) > l) --i;
      while (tiles_before(i + 1) <= l) ++i;
      const int j = l - tiles_before(i);
      int prev = -1;
      for (int kb = 0; kb < prm.kblocks; ++kb, ++it) {
        const int s = it % kStages;
        mbar_wait(&full[s], (it / kStages) & 1);
        const uint32_t a0 = smem_u32(sA + s * kABytes + cw * 64 * 128);
        const uint32_t b0 = smem_u32(sB + s * kBBytes);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < kBK / 16; ++k)
          wgmma_m64n256k16<kBF16>(acc, smem_desc(a0 + k * 32), smem_desc(b0 + k * 32),
                                  (kb > 0 || k > 0) ? 1 : 0);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        fence_acc(acc);
        if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
        prev = s;
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      fence_acc(acc);
      if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);

      if (prm.skip_epilogue) {  // keep the accumulators live, store nothing
        float x = 0.0f;
#pragma unroll
        for (int n = 0; n < 128; ++n) x += acc[n];
        if (x == 1234.5f) static_cast<float*>(prm.c)[0] = x;
        continue;
      }
      // Epilogue: element (r, c) with r >= c; C[r][c] = v and C[c][r] = v.
      Tout* C = static_cast<Tout*>(prm.c) + b * prm.sc;
      const Tout* D = prm.d ? static_cast<const Tout*>(prm.d) + b * prm.sd : nullptr;
      const int r0 = i * kBM + cw * 64 + warp * 16 + (lane >> 2);
      const int c0 = j * kBN + (lane & 3) * 2;
      // Columns in chunks of 8 x 8: the chunk's D values are loaded first (independent loads in
      // flight together; D may alias C, so no load may pass an earlier store), then stored.
#pragma unroll
      for (int n0 = 0; n0 < 32; n0 += 8) {
        float dv[8][2][2];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            dv[n][h][0] = 0.0f;
            dv[n][h][1] = 0.0f;
            const int r = r0 + 8 * h, c = c0 + 8 * (n0 + n);
            if (D == nullptr || r >= p || c > r) continue;
            const Tout* drow = D + static_cast<int64_t>(r) * prm.ldd;
            if (c + 1 <= r && prm.vec2) {
              const auto d2 = *reinterpret_cast<const typename Pair<Tout>::type*>(drow + c);
              dv[n][h][0] = to_f32(d2.x);
              dv[n][h][1] = to_f32(d2.y);
            } else {
              dv[n][h][0] = to_f32(drow[c]);
              if (c + 1 <= r) dv[n][h][1] = to_f32(drow[c + 1]);
            }
          }
        }
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h, c = c0 + 8 * (n0 + n);
            if (r >= p || c > r) continue;
            const int a = 4 * (n0 + n) + 2 * h;
            float v0 = prm.alpha * acc[a] + prm.beta * dv[n][h][0];
            float v1 = prm.alpha * acc[a + 1] + prm.beta * dv[n][h][1];
            const bool two = c + 1 <= r;
            if (r == c) v0 += prm.gamma;
            if (r == c + 1) v1 += prm.gamma;
            Tout* row = C + static_cast<int64_t>(r) * prm.ldc;
            if (two && prm.vec2) {
              store_pair(row + c, v0, v1);
            } else {
              row[c] = from_f32<Tout>(v0);
              if (two) row[c + 1] = from_f32<Tout>(v1);
            }
            if (c < r) C[static_cast<int64_t>(c) * prm.ldc + r] = from_f32<Tout>(v0);
            if (two && c + 1 < r) C[static_cast<int64_t>(c + 1) * prm.ldc + r] = from_f32<Tout>(v1);
          }
        }
      }
    }
  }
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    else
      (void)cudaGetLastError();
  });
  return fn;
}

CUtensorMap make_map(const MatrixView& v, int box_rows) {
  const int64_t es = 2;
  const int64_t nb = v.batch > 1 ? v.batch : 1;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(v.cols), static_cast<cuuint64_t>(v.rows),
                        static_cast<cuuint64_t>(nb)};
  const int64_t bstride = v.batch > 1 ? v.batch_stride : v.rows * v.ld;
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(v.ld * es),
                           static_cast<cuuint64_t>(bstride * es)};
  cuuint32_t box[3] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows), 1};
  cuuint32_t estr[3] = {1, 1, 1};
  CUtensorMap m{};
  const CUresult r = encode_fn()(
      &m, v.dtype == DType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      3, const_cast<void*>(v.data), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) fail("sym_wgmma: cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
  return m;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Per device (ids below kMaxDevices): its multiprocessor count where it is an sm_90 device and
// the driver has cuTensorMapEncodeTiled (0 otherwise, -1 not yet asked), and whether each
// instantiation's shared-memory limit was raised there.
constexpr int kMaxDevices = 64;
std::mutex g_mutex;
int g_sms[kMaxDevices];
bool g_sms_known[kMaxDevices];
uint32_t g_smem_set[kMaxDevices];  // bit per instantiation

int sm_count_and_check(int* device_out = nullptr) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (device_out) *device_out = dev;
  if (dev < 0 || dev >= kMaxDevices) return 0;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_sms_known[dev]) {
    int major = 0, minor = 0, n = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 0;
    }
    g_sms[dev] = (major == 9 && minor == 0 && encode_fn() != nullptr) ? n : 0;
    g_sms_known[dev] = true;
  }
  return g_sms[dev];
}

template <bool kBF16, class Tout>
void launch_typed(const CUtensorMap& ma, const CUtensorMap& mb, const SymParams& prm, int grid,
                  int dev, cudaStream_t s) {
  constexpr uint32_t bit = 1u << ((kBF16 ? 2 : 0) + (std::is_same_v<Tout, float> ? 1 : 0));
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!(g_smem_set[dev] & bit)) {
      DION3_CUDA_CHECK(cudaFuncSetAttribute(sym_wgmma_kernel<kBF16, Tout>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            kSmemBytes));
      g_smem_set[dev] |= bit;
    }
  }
  sym_wgmma_kernel<kBF16, Tout><<<grid, kThreads, kSmemBytes, s>>>(ma, mb, prm);
  DION3_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool sym_wgmma_supported(const MatrixView& A, const MatrixView& B, const MatrixView* D,
                         const MatrixView& C) {
  if (sm_count_and_check() <= 0) return false;
  if (A.dtype != B.dtype || (A.dtype != DType::F16 && A.dtype != DType::BF16)) return false;
  if (C.dtype != DType::F32 && C.dtype != A.dtype) return false;
  if (D && (D->dtype != C.dtype || D->rows != C.rows || D->cols != C.cols ||
            (D->batch != C.batch && D->batch != 1)))
    return false;
  const int64_t p = C.rows, k = A.cols;
  if (p <= 0 || k <= 0 || C.cols != p || A.rows != p || B.rows != p || B.cols != k) return false;
  if (p > (int64_t{1} << 30) || k > (int64_t{1} << 30) || C.batch > (int64_t{1} << 30)) return false;
  for (const MatrixView* v : {&A, &B}) {
    if (v->batch != C.batch && v->batch != 1) return false;
    if (!aligned16(v->data) || (v->ld * 2) % 16 != 0) return false;
    if (v->batch > 1 && (v->batch_stride * 2) % 16 != 0) return false;
    if (v->batch == 1 && (v->rows * v->ld * 2) % 16 != 0) return false;
  }
  const int64_t tiles = (p + kBM - 1) / kBM;
  const int64_t m = tiles / 2;
  const int64_t tpm = (tiles & 1) ? (m + 1) * (m + 1) : m * (m + 1);
  if (tpm * C.batch > (int64_t{1} << 30)) return false;
  return true;
}

void launch_sym_wgmma(const MatrixView& A, const MatrixView& B, float alpha, float beta,
                      const MatrixView* D, float gamma, const MatrixView& C, cudaStream_t s,
                      bool skip_epilogue) {
  if (!sym_wgmma_supported(A, B, D, C)) fail("sym_wgmma: unsupported operands", Status::Unsupported);
  const int64_t p = C.rows, batch = C.batch;
  if (batch == 0 || p == 0) return;
  SymParams prm{};
  prm.c = C.data;
  prm.d = D ? D->data : nullptr;
  prm.ldc = C.ld;
  prm.sc = C.batch > 1 ? C.batch_stride : 0;
  prm.ldd = D ? D->ld : 0;
  prm.sd = D && D->batch > 1 ? D->batch_stride : 0;
  prm.alpha = alpha;
  prm.beta = D ? beta : 0.0f;
  prm.gamma = gamma;
  prm.skip_epilogue = skip_epilogue ? 1 : 0;
  prm.p = static_cast<int>(p);
  prm.kblocks = static_cast<int>((A.cols + kBK - 1) / kBK);
  prm.a_batched = A.batch > 1;
  prm.b_batched = B.batch > 1;
  const int tiles = static_cast<int>((p + kBM - 1) / kBM), m = tiles / 2;
  prm.tiles_per_mat = (tiles & 1) ? (m + 1) * (m + 1) : m * (m + 1);
  prm.total_tiles = static_cast<int>(prm.tiles_per_mat * batch);
  const std::size_t es = dtype_size(C.dtype);
  prm.vec2 = (C.ld % 2 == 0) && (reinterpret_cast<uintptr_t>(C.data) % (2 * es) == 0) &&
             (prm.sc % 2 == 0) &&
             (!D || ((D->ld % 2 == 0) && (reinterpret_cast<uintptr_t>(D->data) % (2 * es) == 0) &&
                     (prm.sd % 2 == 0)));
  const CUtensorMap ma = make_map(A, kBM), mb = make_map(B, kBN);
  int dev = 0;
  const int sms = sm_count_and_check(&dev);
  const int grid = static_cast<int>(std::min<int64_t>(sms, prm.total_tiles));
  const bool bf = A.dtype == DType::BF16;
  if (C.dtype == DType::F32) {
    if (bf) launch_typed<true, float>(ma, mb, prm, grid, dev, s);
    else launch_typed<false, float>(ma, mb, prm, grid, dev, s);
  } else if (bf) {
    launch_typed<true, __nv_bfloat16>(ma, mb, prm, grid, dev, s);
  } else {
    launch_typed<false, __half>(ma, mb, prm, grid, dev, s);
  }
}

}  // namespace dion3::cuda
