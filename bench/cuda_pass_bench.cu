// bench/cuda_pass_bench.cu — dion3-cuda-pass-bench: memory passes against the bytes they must
// move. First the step's non-finite check (Backend::check_step), with experimental variants of its
// kernel beside it, each checked against the library's flag before it is timed; then the pass that
// turns a tall matrix wide for orthogonalization (Backend::normalize transposed) and a plain
// transpose (Backend::convert transposed) against the copy bandwidth.
//
// The check reads every gradient and momentum element once (it proves that the momentum the step
// would store stays finite) and writes nothing, so its ceiling is the rate at which the device can
// read, not the copy bandwidth. For the matrices of gpt-1b and llama-7b (bf16 gradients and
// momentum, Dion3's rule M' = M + G, one allocation per matrix as in training) each row gives: the
// library's check; a plain read of the same bytes (one persistent grid, 16-byte loads); a 1 GiB
// device-to-device copy (read + written); and the variants, a persistent grid that walks a device
// table of all the matrices, with U packs of 8 elements per thread in flight and T threads per
// block; and the library's check given a bound on the momentum (StepCheck::state_bound, what a
// Dion3 step keeps between steps), which then reads the gradients alone. --only TEXT keeps the
// workloads whose name contains TEXT.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_common.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/kernels.cuh"
#include "dion3/backend.hpp"
#include "model_shapes.hpp"

namespace {

using bench::fmt;
using dion3::DType;
using dion3::MatrixView;
using dion3::StepCheck;

// One matrix of the check: n elements of bf16 gradient and momentum.
struct Seg {
  const __nv_bfloat16* g;
  const __nv_bfloat16* m;
  int64_t n;
};

// Rounding a float32 to bf16 gives a finite value iff |x| is below this (the halfway point above
// bf16's largest value rounds to Inf); NaN compares false.
__device__ __forceinline__ bool momentum_finite(float m, float g, float a) {
  return fabsf(a * m + g) < __uint_as_float(0x7F7F8000u);
}

// Two bf16 in a 32-bit word, as floats.
__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ bool pack_finite(const uint4& g, const uint4& m, float a) {
  const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, mw[4] = {m.x, m.y, m.z, m.w};
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    ok &= momentum_finite(lo_bf16(mw[i]), lo_bf16(gw[i]), a) && momentum_finite(hi_bf16(mw[i]), hi_bf16(gw[i]), a);
  return ok;
}

// Packs base, base + stride, ... (U of them, those below np) of g and m, read with streaming
// loads (read once: nothing to keep in L2), all issued before any is used.
template <int U>
__device__ __forceinline__ void load_packs(const uint4* g, const uint4* m, int64_t base, int64_t stride, int64_t np,
                                           uint4 (&gp)[U], uint4 (&mp)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t q = base + u * stride;
    if (q < np) {
      gp[u] = __ldcs(g + q);
      mp[u] = __ldcs(m + q);
    }
  }
}

// The variants (kCheck) and the ceiling (!kCheck: the same bytes read by the same loop, nothing
// checked, an XOR kept alive): every block walks every matrix, each thread U packs of G and of M
// in flight per round; a matrix whose length or pointers do not allow 16-byte loads goes element
// by element.
template <int U, bool kCheck>
__global__ void walk_persistent(const Seg* segs, int count, float a, int* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool ok = true;
  uint32_t x = 0;
  for (int s = 0; s < count; ++s) {
    const Seg sg = segs[s];
    const bool vec = sg.n % 8 == 0 && reinterpret_cast<uintptr_t>(sg.g) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(sg.m) % 16 == 0;
    if (vec) {
      const uint4* g = reinterpret_cast<const uint4*>(sg.g);
      const uint4* m = reinterpret_cast<const uint4*>(sg.m);
      const int64_t np = sg.n / 8;
      for (int64_t base = tid; base < np; base += stride * U) {
        uint4 gp[U], mp[U];
        load_packs<U>(g, m, base, stride, np, gp, mp);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (base + u * stride < np) {
            if constexpr (kCheck) ok &= pack_finite(gp[u], mp[u], a);
            else x ^= gp[u].x ^ gp[u].w ^ mp[u].y ^ mp[u].z;
          }
      }
    } else {
      for (int64_t e = tid; e < sg.n; e += stride) {
        if constexpr (kCheck) ok &= momentum_finite(__bfloat162float(sg.m[e]), __bfloat162float(sg.g[e]), a);
        else x ^= __bfloat16_as_ushort(sg.g[e]) ^ __bfloat16_as_ushort(sg.m[e]);
      }
    }
  }
  if constexpr (kCheck) {
    if (__syncthreads_or(!ok) && threadIdx.x == 0) atomicOr(out, 1);
  } else if (x == 0x9E3779B9u) {
    atomicAdd(out, 1);
  }
}

struct Launch {
  const char* label;
  void (*kernel)(const Seg*, int, float, int*);
  int threads;
};

const std::vector<Launch>& variants() {
  static const std::vector<Launch> v = {
      {"persistent U=4 T=256", walk_persistent<4, true>, 256},
      {"persistent U=8 T=256", walk_persistent<8, true>, 256},
      {"persistent U=4 T=512", walk_persistent<4, true>, 512},
      {"persistent U=2 T=1024", walk_persistent<2, true>, 1024},
  };
  return v;
}

// The matrices of one workload on the device: G and M per matrix, their views and the table.
struct Workload {
  std::vector<dion3::DeviceBuffer> bufs;
  std::vector<StepCheck> checks;
  std::vector<StepCheck> bounded;  // the same with a momentum bound (StepCheck::state_bound)
  std::vector<Seg> segs;
  dion3::DeviceBuffer table;
  dion3::DeviceBuffer bound;  // one float above every |m| the fills make
  int64_t elements = 0;
  Workload(dion3::Backend& be, cudaStream_t s, const std::vector<int64_t>& sizes, float a)
      : table(be.allocator(), std::max<std::size_t>(1, sizes.size()) * sizeof(Seg)), bound(be.allocator(), 4) {
    const float b = 1e4f;
    CK(cudaMemcpyAsync(bound.get(), &b, 4, cudaMemcpyHostToDevice, s));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const int64_t n = sizes[i];
      void* g = bufs.emplace_back(be.allocator(), n * 2).get();
      void* m = bufs.emplace_back(be.allocator(), n * 2).get();
      bench::fill(g, DType::BF16, n, 2 * i + 1, 0.02f, s);
      bench::fill(m, DType::BF16, n, 2 * i + 2, 2.0f, s);
      StepCheck c;
      c.rule = StepCheck::Momentum;
      c.grad = MatrixView::contiguous(g, DType::BF16, 1, 1, n);
      c.state = MatrixView::contiguous(m, DType::BF16, 1, 1, n);
      c.a = a;
      checks.push_back(c);
      c.state_bound = bound.as<float>();
      bounded.push_back(c);
      segs.push_back({static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(m), n});
      elements += n;
    }
    CK(cudaMemcpyAsync(table.get(), segs.data(), segs.size() * sizeof(Seg), cudaMemcpyHostToDevice, s));
    CK(cudaStreamSynchronize(s));
  }
  void set(std::size_t i, int64_t at, float g, float m, cudaStream_t s) {
    const __nv_bfloat16 gv = __float2bfloat16(g), mv = __float2bfloat16(m);
    CK(cudaMemcpyAsync(const_cast<__nv_bfloat16*>(segs[i].g) + at, &gv, 2, cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(const_cast<__nv_bfloat16*>(segs[i].m) + at, &mv, 2, cudaMemcpyHostToDevice, s));
    CK(cudaStreamSynchronize(s));
  }
};

void run_variant(const Launch& v, const Workload& w, float a, int* flag, int blocks, cudaStream_t s) {
  v.kernel<<<blocks, v.threads, 0, s>>>(static_cast<const Seg*>(w.table.get()), static_cast<int>(w.segs.size()), a,
                                        flag);
  CK(cudaGetLastError());
}

// The tall megabatches of Muon's step (a chunk of bf16 momentum, orthogonalized in fp16): the
// input normalised and transposed in one pass (from its elements, two reads and a write, or from
// its rows' sums of squares, a read and a write), a transpose alone (Backend::convert: a read and
// a write), and the plain normalisation of the same bytes beside them. Checked first: the
// normalised transpose equals the transpose of the normalised matrix. Returns the failures.
int transpose_section(bench::Session& ses, double copy) {
  dion3::Backend& be = *ses.be;
  cudaStream_t s = ses.s;
  auto line = [&](const std::string& l) { ses.o.line(l); };
  line("## Tall matrices turned wide (GB/s: bytes each pass must move, median of interleaved runs)");
  line("");
  line("| workload | n x rows x cols | normalize ms (GB/s, of copy) | normalize transposed | ... from row sums | "
       "transpose |");
  line("|---|---|---|---|---|---|");
  struct Tall {
    const char* label;
    int64_t n, rows, cols;
  };
  int failures = 0;
  for (const Tall& t : {Tall{"gpt-1b MLP", 8, 8192, 2048}, Tall{"llama-7b MLP", 8, 11008, 4096}}) {
    if (!ses.args.only.empty() && std::string(t.label).find(ses.args.only) == std::string::npos) continue;
    const int64_t e = t.n * t.rows * t.cols;
    dion3::DeviceBuffer in(be.allocator(), e * 2), x(be.allocator(), e * 2), y(be.allocator(), e * 2),
        z(be.allocator(), e * 2), ss(be.allocator(), t.n * t.rows * sizeof(float));
    bench::fill(in.get(), DType::BF16, e, 11, 1.0f, s);
    CK(cudaMemsetAsync(ss.get(), 0, t.n * t.rows * sizeof(float), s));
    const MatrixView vin = MatrixView::contiguous(in.get(), DType::BF16, t.n, t.rows, t.cols);
    const MatrixView wide = MatrixView::contiguous(x.get(), DType::F16, t.n, t.cols, t.rows);
    const MatrixView tall = MatrixView::contiguous(y.get(), DType::F16, t.n, t.rows, t.cols);
    const MatrixView twide = MatrixView::contiguous(z.get(), DType::F16, t.n, t.cols, t.rows);
    const float* rss = static_cast<const float*>(ss.get());
    be.normalize(vin, tall, dion3::NormGuard{}, nullptr, false);
    be.normalize(vin, wide, dion3::NormGuard{}, nullptr, true);
    be.convert(tall, twide, true);
    std::vector<uint16_t> a(e), b(e);
    CK(cudaMemcpyAsync(a.data(), x.get(), e * 2, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(b.data(), z.get(), e * 2, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    if (a != b) {
      ++failures;
      line(fmt("- %s: the normalised transpose differs from the transpose of the normalised matrix", t.label));
    }
    const auto ms = bench::interleaved_medians(s, 2, ses.args.iters,
                                               {[&] { be.normalize(vin, tall, dion3::NormGuard{}, nullptr, false); },
                                                [&] { be.normalize(vin, wide, dion3::NormGuard{}, nullptr, true); },
                                                [&] { be.normalize(vin, wide, dion3::NormGuard{}, rss, true); },
                                                [&] { be.convert(wide, tall, true); }});
    const double el = static_cast<double>(e) * 2;  // bytes of one bf16 or fp16 pass over the matrices
    auto cell = [&](double m, double bytes) {
      return fmt("%.3f (%.0f, %.0f%%)", m, bytes / (m * 1e6), 100 * bytes / (m * 1e6) / copy);
    };
    line(fmt("| %s | %lldx%lldx%lld | %s | %s | %s | %s |", t.label, static_cast<long long>(t.n),
             static_cast<long long>(t.rows), static_cast<long long>(t.cols), cell(ms[0], 3 * el).c_str(),
             cell(ms[1], 3 * el).c_str(), cell(ms[2], 2 * el).c_str(), cell(ms[3], 2 * el).c_str()));
  }
  return failures;
}

// ---- the gather's traffic ----------------------------------------------------------------------
// Dion3's gather (f < 1) reads the selected rows of M once and writes them twice: into the
// orthogonalizer's input (fp16, scaled) and back into M (decayed). Beside the library's gather
// (launch_gather_rows as gather_normalized calls it): the same rows moved by the plainest kernels
// of the same traffic, a read and two writes (out = M row, M row written back unchanged) and a read and one write (out =
// M row only), one warp per row with U 16-byte packs per lane in flight; and the library's
// arithmetic in 16-byte packs (8 elements) instead of 8-byte ones. Their rates bound what the
// gather can reach for its mix of reads and writes.
// Lane `lane`'s packs of a row of np packs, U loaded before visit(q, pack) sees any.
template <int U, class P, class Visit>
__device__ __forceinline__ void row_packs(const P* src, int64_t np, int lane, Visit&& visit) {
  for (int64_t q0 = lane; q0 < np; q0 += 32 * U) {
    P v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (q0 + 32 * u < np) v[u] = src[q0 + 32 * u];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (q0 + 32 * u < np) visit(q0 + 32 * u, v[u]);
  }
}

template <int U, bool kWriteBack>
__global__ void move_rows(const __nv_bfloat16* m, int64_t rows, int64_t cols, const int32_t* idx, int64_t k,
                          __nv_bfloat16* out, int64_t nmats) {
  const int lane = threadIdx.x & 31;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32, i = blockIdx.y;
  if (s >= k || i >= nmats) return;
  const int64_t r = idx[i * k + s];
  uint4* src = reinterpret_cast<uint4*>(const_cast<__nv_bfloat16*>(m) + (i * rows + r) * cols);
  uint4* dst = reinterpret_cast<uint4*>(out + (i * k + s) * cols);
  row_packs<U>(src, cols / 8, lane, [&](int64_t q, const uint4& v) {
    dst[q] = v;
    if (kWriteBack) src[q] = v;
  });
}

// The library's gather_normalized arithmetic (out = c_i * M row in fp16, M row *= decay) with each
// lane moving 8-element (16-byte) packs, U of them in flight.
template <int U>
__global__ void gather_rows_16(__nv_bfloat16* m, int64_t rows, int64_t cols, const int32_t* idx, int64_t k,
                               const float* sumsq, float eps, float decay, __half* out, int64_t nmats) {
  const int lane = threadIdx.x & 31;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32, i = blockIdx.y;
  if (s >= k || i >= nmats) return;
  const int64_t r = idx[i * k + s];
  auto* src = reinterpret_cast<dion3::cuda::PackV<__nv_bfloat16, 8>*>(m + (i * rows + r) * cols);
  auto* dst = reinterpret_cast<dion3::cuda::PackV<__half, 8>*>(out + (i * k + s) * cols);
  const float c = 1.0f / (sqrtf(sumsq[i]) + eps);  // as the library's gather (its default guard)
  row_packs<U>(src, cols / 8, lane, [&](int64_t q, dion3::cuda::PackV<__nv_bfloat16, 8> v) {
    dion3::cuda::PackV<__half, 8> o;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float x = __bfloat162float(v.v[e]);
      o.v[e] = __float2half_rn(c * x);
      v.v[e] = __float2bfloat16_rn(decay * x);
    }
    dst[q] = o;
    src[q] = v;
  });
}

int gather_section(bench::Session& ses, double copy) {
  dion3::Backend& be = *ses.be;
  cudaStream_t s = ses.s;
  auto line = [&](const std::string& l) { ses.o.line(l); };
  line("## The gather at f = 1/4: a read and two writes per selected row (GB/s: bytes moved, median of "
       "interleaved runs)");
  line("");
  line("Rows: n matrices of rows x cols (bf16 M), k selected rows each (random, ascending), out fp16. The library's "
       "gather_normalized (launch_gather_rows handed the selected rows' sums of squares, as select_rows leaves them) against kernels of the same traffic: "
       "1R+2W (out = row, row written back), 1R+1W (out = row only, two thirds of the bytes), and the library's "
       "arithmetic in 16-byte packs. Checked first (gpt-1b): the 16-byte variant's out and M equal the library's.");
  line("");
  line("| workload | n x rows x cols, k | library ms (GB/s, of copy) | 1R+2W U=4 | 1R+2W U=8 | 1R+1W U=4 | "
       "16-byte library arithmetic U=4 |");
  line("|---|---|---|---|---|---|---|");
  struct G {
    const char* label;
    int64_t n, rows, cols, k;
  };
  int failures = 0;
  const float decay = 0.999f;
  for (const G& g : {G{"gpt-1b attn", 64, 2048, 2048, 512}, G{"gpt-1b MLP up", 16, 8192, 2048, 2048},
                     G{"gpt-1b MLP down", 16, 2048, 8192, 512}, G{"llama-7b attn", 128, 4096, 4096, 1024},
                     G{"llama-7b MLP up", 64, 11008, 4096, 2752}, G{"llama-7b MLP down", 32, 4096, 11008, 1024}}) {
    if (!ses.args.only.empty() && std::string(g.label).find(ses.args.only) == std::string::npos) continue;
    const int64_t e = g.n * g.rows * g.cols, eo = g.n * g.k * g.cols;
    dion3::DeviceBuffer mb(be.allocator(), e * 2), ob(be.allocator(), eo * 2), ob2(be.allocator(), eo * 2),
        idxb(be.allocator(), g.n * g.k * 4), ssb(be.allocator(), g.n * 4),
        tab(be.allocator(), g.n * sizeof(dion3::cuda::DeviceMat));
    bench::fill(mb.get(), DType::BF16, e, 21, 1.0f, s);
    // Each selection's sum of squares: k plus the matrix's index (one per matrix, so that the check
    // below tells a kernel that scales by another matrix's sum).
    std::vector<float> ss(static_cast<std::size_t>(g.n));
    for (int64_t i = 0; i < g.n; ++i) ss[i] = static_cast<float>(g.k + i);
    CK(cudaMemcpyAsync(ssb.get(), ss.data(), ss.size() * 4, cudaMemcpyHostToDevice, s));
    std::mt19937_64 rng(5);
    std::vector<int32_t> idx;
    for (int64_t i = 0; i < g.n; ++i) {
      std::vector<int32_t> all(static_cast<std::size_t>(g.rows));
      for (int64_t r = 0; r < g.rows; ++r) all[r] = static_cast<int32_t>(r);
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(static_cast<std::size_t>(g.k));
      std::sort(all.begin(), all.end());
      idx.insert(idx.end(), all.begin(), all.end());
    }
    CK(cudaMemcpyAsync(idxb.get(), idx.data(), idx.size() * 4, cudaMemcpyHostToDevice, s));
    std::vector<dion3::cuda::DeviceMat> mats(static_cast<std::size_t>(g.n));
    for (int64_t i = 0; i < g.n; ++i)
      mats[i] = {nullptr, nullptr, static_cast<__nv_bfloat16*>(mb.get()) + i * g.rows * g.cols, nullptr, g.cols, g.cols,
                 g.cols};
    CK(cudaMemcpyAsync(tab.get(), mats.data(), mats.size() * sizeof(mats[0]), cudaMemcpyHostToDevice, s));
    const auto* table = static_cast<const dion3::cuda::DeviceMat*>(tab.get());
    const auto* id = static_cast<const int32_t*>(idxb.get());
    auto* m = static_cast<__nv_bfloat16*>(mb.get());
    const MatrixView out = MatrixView::contiguous(ob.get(), DType::F16, g.n, g.k, g.cols);
    auto library = [&] {
      dion3::cuda::launch_gather_rows(table, g.n, g.rows, g.cols, DType::BF16, DType::BF16, id, g.k, 1.0f, 0.0f, decay,
                                      static_cast<const float*>(ssb.get()), dion3::NormGuard{}, out, nullptr, nullptr, s, true);
    };
    const dim3 grid(static_cast<unsigned>((g.k + 3) / 4), static_cast<unsigned>(g.n));
    auto variant16 = [&] {
      gather_rows_16<4><<<grid, 128, 0, s>>>(m, g.rows, g.cols, id, g.k, static_cast<const float*>(ssb.get()), 1e-7f, decay,
                                             static_cast<__half*>(ob2.get()), g.n);
    };
    // Check (the gpt-1b workloads; the llama-7b ones run the same kernels): one call of each from
    // the same M (restored between them) gives the same out and M.
    if (e <= (int64_t{1} << 29)) {
      dion3::DeviceBuffer saved(be.allocator(), e * 2);
      CK(cudaMemcpyAsync(saved.get(), mb.get(), e * 2, cudaMemcpyDeviceToDevice, s));
      library();
      std::vector<uint16_t> out_a(eo), out_b(eo), m_a(e), m_b(e);
      CK(cudaMemcpyAsync(out_a.data(), ob.get(), eo * 2, cudaMemcpyDeviceToHost, s));
      CK(cudaMemcpyAsync(m_a.data(), mb.get(), e * 2, cudaMemcpyDeviceToHost, s));
      CK(cudaMemcpyAsync(mb.get(), saved.get(), e * 2, cudaMemcpyDeviceToDevice, s));
      variant16();
      CK(cudaGetLastError());
      CK(cudaMemcpyAsync(out_b.data(), ob2.get(), eo * 2, cudaMemcpyDeviceToHost, s));
      CK(cudaMemcpyAsync(m_b.data(), mb.get(), e * 2, cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      if (out_a != out_b || m_a != m_b) {
        ++failures;
        line(fmt("- %s: the 16-byte variant differs from the library's gather (out %s, M %s)", g.label,
                 out_a == out_b ? "equal" : "differs", m_a == m_b ? "equal" : "differs"));
      }
    }
    auto* o16 = static_cast<__nv_bfloat16*>(ob2.get());
    const auto ms = bench::interleaved_medians(
        s, 2, ses.args.iters,
        {library, [&] { move_rows<4, true><<<grid, 128, 0, s>>>(m, g.rows, g.cols, id, g.k, o16, g.n); },
         [&] { move_rows<8, true><<<grid, 128, 0, s>>>(m, g.rows, g.cols, id, g.k, o16, g.n); },
         [&] { move_rows<4, false><<<grid, 128, 0, s>>>(m, g.rows, g.cols, id, g.k, o16, g.n); }, variant16});
    CK(cudaGetLastError());
    const double b3 = 6.0 * static_cast<double>(eo), b2 = 4.0 * static_cast<double>(eo);
    auto cell = [&](double t, double bytes) {
      return fmt("%.3f (%.0f, %.0f%%)", t, bytes / (t * 1e6), 100 * bytes / (t * 1e6) / copy);
    };
    line(fmt("| %s | %lldx%lldx%lld, %lld | %s | %s | %s | %s | %s |", g.label, static_cast<long long>(g.n),
             static_cast<long long>(g.rows), static_cast<long long>(g.cols), static_cast<long long>(g.k),
             cell(ms[0], b3).c_str(), cell(ms[1], b3).c_str(), cell(ms[2], b3).c_str(), cell(ms[3], b2).c_str(),
             cell(ms[4], b3).c_str()));
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Session ses(argc, argv, "dion3-cuda-pass-bench");
  dion3::Backend& be = *ses.be;
  cudaStream_t s = ses.s;
  auto line = [&](const std::string& l) { ses.o.line(l); };
  const float a = 1.0f;  // Dion3: M' = M + G
  dion3::DeviceBuffer flag_buf(be.allocator(), 2 * sizeof(int));
  int* flag = flag_buf.as<int>();
  int* sink = flag + 1;
  auto read_flag = [&] {
    int h = 0;
    CK(cudaMemcpyAsync(&h, flag, sizeof(int), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    return h;
  };
  std::vector<int> blocks;
  for (const Launch& v : variants()) blocks.push_back(static_cast<int>(dion3::cuda::persistent_blocks(v.kernel, v.threads)));

  // ---- each variant's flag against the library's, planted elements anywhere ----------------
  line("## The variants' flags against the library's check_step");
  line("");
  line("Matrices of 10000, 10003 (element by element), 3·8192+8 and 2^20 elements; one element planted at a random place "
       "of one of them, or none. Expected: 1 for an overflow (g = 2e38, m = 1.5e38) or a NaN gradient, 0 otherwise "
       "(g = 2e38, m = -1.5e38 fits).");
  line("");
  int failures = 0;
  {
    Workload w(be, s, {10000, 10003, 3 * 8192 + 8, int64_t{1} << 20}, a);
    std::mt19937_64 rng(7);
    struct Plant {
      float g, m;
      int expect;
    };
    const std::vector<Plant> plants = {{0, 0, 0}, {2e38f, 1.5e38f, 1}, {2e38f, -1.5e38f, 0}, {NAN, 0.0f, 1},
                                       {1e37f, 0.0f, 0}};
    int cases = 0;
    for (int trial = 0; trial < 6; ++trial)
      for (const Plant& p : plants) {
        const std::size_t i = rng() % w.segs.size();
        const int64_t at = static_cast<int64_t>(rng() % static_cast<uint64_t>(w.segs[i].n));
        if (p.expect || p.g != 0) w.set(i, at, p.g, p.m, s);
        be.fill_zero(flag, sizeof(int));
        be.check_step(w.checks, flag);
        const int lib = read_flag();
        if (lib != p.expect) ++failures;
        be.fill_zero(flag, sizeof(int));
        be.check_step(w.bounded, flag);  // the planted g exceed the bound's limit, or need no m
        if (const int got = read_flag(); got != p.expect) {
          ++failures;
          line(fmt("- library, momentum bounded: flag %d, expected %d (g %g, m %g)", got, p.expect, p.g, p.m));
        }
        for (std::size_t v = 0; v < variants().size(); ++v) {
          be.fill_zero(flag, sizeof(int));
          run_variant(variants()[v], w, a, flag, blocks[v], s);
          const int got = read_flag();
          if (got != lib) {
            ++failures;
            line(fmt("- %s: flag %d, library %d (matrix %zu, element %lld, g %g, m %g)", variants()[v].label, got, lib,
                     i, static_cast<long long>(at), p.g, p.m));
          }
        }
        w.set(i, at, 0.0f, 0.0f, s);
        ++cases;
      }
    line(fmt("%d cases, %zu variants: %d disagreements with the expected flag or the library's.", cases,
             variants().size(), failures));
    line("");
  }

  // ---- bandwidth ------------------------------------------------------------------------------
  const double copy = bench::copy_bandwidth_gbs(s);
  line(fmt("## Bandwidth of the check (GB/s: gradient and momentum bytes over the median of %d, interleaved)",
           ses.args.iters));
  line("");
  line(fmt("Copy: 1 GiB device-to-device, read + written: %.0f GB/s. Read: the same bytes as the check, read by "
           "walk_persistent<4, false> (256 threads), nothing checked.",
           copy));
  line("");
  std::string head = "| workload | matrices | GB read | library check_step ms (GB/s, of copy, of read) | read ms (GB/s) |"
                     " library, momentum bounded ms (vs library) |";
  std::string rule = "|---|---|---|---|---|---|";
  for (const Launch& v : variants()) {
    head += fmt(" %s ms (GB/s) |", v.label);
    rule += "---|";
  }
  line(head);
  line(rule);
  const int read_blocks = static_cast<int>(dion3::cuda::persistent_blocks(walk_persistent<4, false>, 256));
  for (const char* model : {"gpt-1b", "llama-7b"}) {
    if (!ses.args.only.empty() && std::string(model).find(ses.args.only) == std::string::npos) continue;
    const auto shapes = dion3::bench::model_matrices(dion3::bench::find_preset(model), 0);
    std::vector<int64_t> sizes;
    for (const auto& sh : shapes) sizes.push_back(sh.rows * sh.cols);
    Workload w(be, s, sizes, a);
    std::vector<std::function<void()>> fs;
    fs.push_back([&] { be.check_step(w.checks, flag); });
    fs.push_back([&] {
      walk_persistent<4, false><<<read_blocks, 256, 0, s>>>(static_cast<const Seg*>(w.table.get()),
                                                             static_cast<int>(w.segs.size()), a, sink);
    });
    fs.push_back([&] { be.check_step(w.bounded, flag); });
    for (std::size_t v = 0; v < variants().size(); ++v)
      fs.push_back([&, v] { run_variant(variants()[v], w, a, flag, blocks[v], s); });
    const auto t = bench::interleaved_medians(s, 2, ses.args.iters, fs);
    const double bytes = 4.0 * static_cast<double>(w.elements);
    auto gbs = [&](double ms) { return bytes / (ms * 1e6); };
    std::string row = fmt("| %s | %zu | %.2f | %.3f (%.0f, %.0f%%, %.0f%%) | %.3f (%.0f) | %.3f (%.2fx) |", model,
                          w.segs.size(), bytes / 1e9, t[0], gbs(t[0]), 100 * gbs(t[0]) / copy, 100 * t[1] / t[0], t[1],
                          gbs(t[1]), t[2], t[0] / t[2]);
    for (std::size_t v = 0; v < variants().size(); ++v) row += fmt(" %.3f (%.0f) |", t[3 + v], gbs(t[3 + v]));
    line(row);
  }
  line("");
  failures += transpose_section(ses, copy);
  line("");
  failures += gather_section(ses, copy);
  line("");
  line(fmt("correctness failures: %d", failures));
  ses.save();
  return failures == 0 ? 0 : 1;
}
