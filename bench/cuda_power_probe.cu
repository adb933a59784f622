// bench/cuda_power_probe.cu — dion3-cuda-power-probe: is the optimizer step held by the GPU's power
// limit rather than by its FLOPs or bytes? Runs each workload sustained (after a warm-up) and reads
// NVML's energy counter around it: the idle GPU; a kernel on every SM that only sleeps (clocks up,
// nothing moved); cuBLAS's bf16 GEMM; a copy kernel and cudaMemcpyAsync (device to device); and the
// GEMM beside each copy on a second stream. For each: its rate, the share of its rate alone that it
// keeps beside the other, mean power, the SM clock and how often the power cap held it, and its
// energy per TFLOP or GB above a baseline (idle, or the sleeping kernel).
// Then, for rows given as --row label:flop_ms:byte_ms[:target_ms] (the step bench's floor columns:
// FLOPs at 790 TFLOP/s, bytes at 4.3 TB/s), the least time a step with those FLOPs and bytes can take
// at the enforced power limit if every byte moved under the products: the products' and the bytes'
// energy above the baseline over the power the limit leaves above it (and never less than either
// alone at its own rate). The GEMM and copy here are the most efficient forms of each; the step's
// products and passes spend at least as much energy per unit, so this time is a lower bound as long
// as energy per unit does not fall when the two share the GPU (the side-by-side rows test that).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_bench_common.cuh"
#include "nvml_power.hpp"

namespace {

using bench::fmt;
using Clock = std::chrono::steady_clock;

#define CKB(x)                                                           \
  do {                                                                   \
    cublasStatus_t st_ = (x);                                            \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                  \
      std::fprintf(stderr, "%s failed: status %d\n", #x, int(st_));      \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// Every thread sleeps until `ns` have passed on the global timer: the SMs are busy to the power
// manager (clocks up) while they issue almost nothing.
__global__ void sleep_kernel(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// One stream's share of a workload: a unit of work enqueued again and again, and what one unit does.
struct Lane {
  std::string what;  // "GEMM", "copy kernel", ...
  std::function<void(cudaStream_t)> unit;
  double work;        // FLOPs or bytes (read + written) of one unit; 0 for the sleeping kernel
  bool flops;         // work counts FLOPs (else bytes)
  cudaStream_t s;
};

struct LaneResult {
  double rate = 0;  // work per second over the window all lanes were busy
};

struct Measured {
  std::string name;
  std::vector<Lane> lanes;
  std::vector<LaneResult> per_lane;
  double seconds = 0, joules = 0, watts = 0;
  unsigned mhz_min = 0, mhz_max = 0;
  double mhz_mean = 0, capped_share = 0;  // share of clock samples with the software power cap bit set
};

// Runs the lanes side by side, each kept `depth` units ahead, for `warm_s` and then `run_s` seconds;
// energy and mean power over the second window, each lane's rate over the time until the first lane's
// last unit ended (so every counted unit ran beside the others).
Measured sustain(const std::string& name, std::vector<Lane> lanes, const bench::PowerMeter& pm, double warm_s,
                 double run_s) {
  constexpr int depth = 3;
  Measured m{name, lanes, std::vector<LaneResult>(lanes.size())};
  auto drive = [&](double seconds, std::vector<std::vector<cudaEvent_t>>* ends) {
    std::vector<std::deque<cudaEvent_t>> flight(lanes.size());
    std::vector<double> mhz;
    int capped = 0;
    auto next_sample = Clock::now();
    const auto t0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
      for (std::size_t l = 0; l < lanes.size(); ++l) {
        while (!flight[l].empty() && cudaEventQuery(flight[l].front()) == cudaSuccess) {
          if (!ends) CK(cudaEventDestroy(flight[l].front()));
          flight[l].pop_front();
        }
        while (flight[l].size() < depth) {
          lanes[l].unit(lanes[l].s);
          cudaEvent_t e;
          CK(cudaEventCreate(&e));
          CK(cudaEventRecord(e, lanes[l].s));
          flight[l].push_back(e);
          if (ends) (*ends)[l].push_back(e);
        }
      }
      if (ends && Clock::now() >= next_sample) {
        mhz.push_back(pm.sm_mhz());
        capped += (pm.clock_reasons() & 0x4) != 0;
        next_sample += std::chrono::milliseconds(10);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    CK(cudaDeviceSynchronize());
    if (!ends)
      for (auto& f : flight)
        for (cudaEvent_t e : f) CK(cudaEventDestroy(e));
    if (!mhz.empty()) {
      m.mhz_min = static_cast<unsigned>(*std::min_element(mhz.begin(), mhz.end()));
      m.mhz_max = static_cast<unsigned>(*std::max_element(mhz.begin(), mhz.end()));
      double sum = 0;
      for (double v : mhz) sum += v;
      m.mhz_mean = sum / mhz.size();
      m.capped_share = static_cast<double>(capped) / mhz.size();
    }
  };
  if (lanes.empty()) {  // idle: the GPU left alone
    std::this_thread::sleep_for(std::chrono::duration<double>(warm_s));
    const double e0 = pm.energy_j();
    const auto t0 = Clock::now();
    std::vector<double> mhz;
    while (std::chrono::duration<double>(Clock::now() - t0).count() < run_s) {
      mhz.push_back(pm.sm_mhz());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    m.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    m.joules = pm.energy_j() - e0;
    m.watts = m.joules / m.seconds;
    m.mhz_min = static_cast<unsigned>(*std::min_element(mhz.begin(), mhz.end()));
    m.mhz_max = static_cast<unsigned>(*std::max_element(mhz.begin(), mhz.end()));
    return m;
  }
  drive(warm_s, nullptr);
  cudaEvent_t start;
  CK(cudaEventCreate(&start));
  CK(cudaEventRecord(start, lanes[0].s));
  for (std::size_t l = 1; l < lanes.size(); ++l) CK(cudaStreamWaitEvent(lanes[l].s, start, 0));
  std::vector<std::vector<cudaEvent_t>> ends(lanes.size());
  const double e0 = pm.energy_j();
  const auto t0 = Clock::now();
  drive(run_s, &ends);
  m.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  m.joules = pm.energy_j() - e0;
  m.watts = m.joules / m.seconds;
  // The window every lane was busy: until the first lane's last unit ended.
  auto at = [&](cudaEvent_t e) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, start, e));
    return static_cast<double>(ms);
  };
  double window_ms = 1e30;
  for (const auto& e : ends) window_ms = std::min(window_ms, at(e.back()));
  for (std::size_t l = 0; l < lanes.size(); ++l) {
    int done = 0;
    for (cudaEvent_t e : ends[l]) done += at(e) <= window_ms;
    m.per_lane[l].rate = done * lanes[l].work / (window_ms * 1e-3);
    for (cudaEvent_t e : ends[l]) CK(cudaEventDestroy(e));
  }
  CK(cudaEventDestroy(start));
  return m;
}

struct Row {
  std::string label;
  double flop_ms, byte_ms, target_ms;
};

Row parse_row(const std::string& s) {
  Row r{};
  std::vector<std::string> f;
  std::size_t a = 0;
  for (std::size_t b; (b = s.find(':', a)) != std::string::npos; a = b + 1) f.push_back(s.substr(a, b - a));
  f.push_back(s.substr(a));
  if (f.size() < 3 || f.size() > 4) {
    std::fprintf(stderr, "--row wants label:flop_ms:byte_ms[:target_ms], got '%s'\n", s.c_str());
    std::exit(2);
  }
  r.label = f[0];
  r.flop_ms = std::atof(f[1].c_str());
  r.byte_ms = std::atof(f[2].c_str());
  r.target_ms = f.size() == 4 ? std::atof(f[3].c_str()) : 0;
  if (r.flop_ms < 0 || r.byte_ms < 0 || r.target_ms < 0 || r.flop_ms + r.byte_ms <= 0) {
    std::fprintf(stderr, "--row '%s': times must be >= 0 and not both 0\n", s.c_str());
    std::exit(2);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  double warm_s = 1.0, run_s = 2.0;
  int n = 8192;
  std::size_t copy_mib = 1024;
  std::string out_path;
  std::vector<Row> rows;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--seconds" && i + 1 < argc) run_s = std::atof(argv[++i]);
    else if (s == "--warm" && i + 1 < argc) warm_s = std::atof(argv[++i]);
    else if (s == "--gemm-n" && i + 1 < argc) n = std::atoi(argv[++i]);
    else if (s == "--copy-mib" && i + 1 < argc) copy_mib = std::strtoull(argv[++i], nullptr, 10);
    else if (s == "--row" && i + 1 < argc) rows.push_back(parse_row(argv[++i]));
    else if (s == "--out" && i + 1 < argc) out_path = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: dion3-cuda-power-probe [--seconds S] [--warm S] [--gemm-n N] [--copy-mib M] "
                   "[--row label:flop_ms:byte_ms[:target_ms]]... [--out FILE]\n");
      return 2;
    }
  }
  if (run_s <= 0 || warm_s < 0 || n < 256 || n % 8 != 0 || copy_mib < 16) {
    std::fprintf(stderr, "dion3-cuda-power-probe: need --seconds > 0, --warm >= 0, --gemm-n >= 256 (a multiple of 8), "
                         "--copy-mib >= 16\n");
    return 2;
  }
  bench::Out o;
  bench::device_line(o);
  bench::PowerMeter pm(0);
  if (!pm.ok()) {
    o.line("No power readings: " + pm.why_not() + ".");
    return 1;
  }
  const double limit_w = pm.limit_w();
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));

  cudaStream_t sg, sc;
  CK(cudaStreamCreateWithFlags(&sg, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&sc, cudaStreamNonBlocking));
  cublasHandle_t h;
  CKB(cublasCreate(&h));
  CKB(cublasSetStream(h, sg));
  const std::size_t mat = static_cast<std::size_t>(n) * n;
  __nv_bfloat16 *a, *b, *c;
  CK(cudaMalloc(&a, mat * 2));
  CK(cudaMalloc(&b, mat * 2));
  CK(cudaMalloc(&c, mat * 2));
  bench::fill(a, dion3::DType::BF16, mat, 1, 1.0f, sg);
  bench::fill(b, dion3::DType::BF16, mat, 2, 1.0f, sg);
  const std::size_t bytes = copy_mib << 20;
  void *src, *dst;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  bench::fill(src, dion3::DType::BF16, bytes / 2, 3, 1.0f, sc);
  CK(cudaDeviceSynchronize());

  const float alpha = 1.0f, beta = 0.0f;
  const Lane gemm{"GEMM", [&](cudaStream_t) {
                    CKB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF,
                                     n, &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                  },
                  2.0 * n * n * static_cast<double>(n), true, sg};
  const int copy_blocks = prop.multiProcessorCount * 4;
  const Lane copy{"copy kernel", [&](cudaStream_t s) {
                    copy_kernel<<<copy_blocks, 512, 0, s>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                                                          bytes / 16);
                    CK(cudaGetLastError());
                  },
                  2.0 * bytes, false, sc};
  const Lane dcopy{"cudaMemcpyAsync", [&](cudaStream_t s) {
                      CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
                    },
                    2.0 * bytes, false, sc};
  const Lane sleeper{"sleeping kernel", [&](cudaStream_t s) {
                       sleep_kernel<<<prop.multiProcessorCount * 2, 256, 0, s>>>(500000);
                       CK(cudaGetLastError());
                     },
                     0.0, false, sg};

  o.line(fmt("## Power probe: each workload %.1f s after %.1f s of warm-up; enforced power limit %.0f W", run_s, warm_s,
             limit_w));
  o.line("");
  o.line(fmt("GEMM: cuBLAS bf16 %d x %d x %d (fp32 accumulate); copy: %zu MiB device to device (rate counts bytes "
             "read + written). Side by side: the GEMM on one stream, the copy on another.",
             n, n, n, copy_mib));
  o.line("");
  std::vector<Measured> ms;
  ms.push_back(sustain("idle", {}, pm, warm_s, run_s));
  ms.push_back(sustain("sleeping kernel", {sleeper}, pm, warm_s, run_s));
  ms.push_back(sustain("GEMM", {gemm}, pm, warm_s, run_s));
  ms.push_back(sustain("copy kernel", {copy}, pm, warm_s, run_s));
  ms.push_back(sustain("cudaMemcpyAsync", {dcopy}, pm, warm_s, run_s));
  ms.push_back(sustain("GEMM + copy kernel", {gemm, copy}, pm, warm_s, run_s));
  ms.push_back(sustain("GEMM + cudaMemcpyAsync", {gemm, dcopy}, pm, warm_s, run_s));

  auto alone = [&](const std::string& what) {
    for (const auto& m : ms)
      if (m.lanes.size() == 1 && m.lanes[0].what == what) return m.per_lane[0].rate;
    return 0.0;
  };
  const double p_idle = ms[0].watts, p_sleep = ms[1].watts;
  o.line("| workload | rate | share of its rate alone | sum of shares | mean W | SM MHz mean (min-max) | "
         "power cap held the clock | J per TFLOP or GB above idle / above sleeping |");
  o.line("|---|---|---|---|---|---|---|---|");
  for (const auto& m : ms) {
    std::string rate, share, energy;
    double sum = 0;
    for (std::size_t l = 0; l < m.lanes.size(); ++l) {
      const Lane& ln = m.lanes[l];
      if (ln.work == 0) continue;
      const double r = m.per_lane[l].rate, s = r / alone(ln.what);
      sum += s;
      rate += fmt("%s%s %.1f %s", rate.empty() ? "" : ", ", ln.what.c_str(), ln.flops ? r / 1e12 : r / 1e9,
                  ln.flops ? "TFLOP/s" : "GB/s");
      share += fmt("%s%.3f", share.empty() ? "" : ", ", s);
      if (m.lanes.size() == 1)
        energy = fmt("%.3f / %.3f", (m.watts - p_idle) / (ln.flops ? r / 1e12 : r / 1e9),
                     (m.watts - p_sleep) / (ln.flops ? r / 1e12 : r / 1e9));
    }
    o.line(fmt("| %s | %s | %s | %s | %.0f | %.0f (%u-%u) | %s | %s |", m.name.c_str(), rate.empty() ? "-" : rate.c_str(),
               share.empty() ? "-" : share.c_str(), m.lanes.size() > 1 ? fmt("%.3f", sum).c_str() : "-", m.watts,
               m.mhz_mean, m.mhz_min, m.mhz_max, m.lanes.empty() ? "-" : fmt("%.0f%%", 100 * m.capped_share).c_str(),
               energy.empty() ? "-" : energy.c_str()));
  }
  o.line("");
  o.line("A sum of shares near 1 says the two workloads side by side get no more done than one after the other.");
  o.line("");

  if (!rows.empty()) {
    const double r_gemm = alone("GEMM"), p_gemm = ms[2].watts;
    // The cheaper of the two copies per byte, at the higher of their rates: the bound stays a bound.
    const double r_copy = std::max(alone("copy kernel"), alone("cudaMemcpyAsync"));
    auto copy_watts_per_rate = [&](double base) {
      return std::min((ms[3].watts - base) / ms[3].per_lane[0].rate, (ms[4].watts - base) / ms[4].per_lane[0].rate);
    };
    o.line(fmt("## The least step time at the %.0f W limit, every byte moved under the products", limit_w));
    o.line("");
    o.line(fmt("Products at the GEMM's sustained %.0f TFLOP/s and %.0f W, bytes at %.0f GB/s and the cheaper copy's "
               "energy per byte; baseline power idle %.0f W or sleeping %.0f W (a higher baseline gives the lower "
               "bound). Serial: the products, then the bytes, each at its own rate.",
               r_gemm / 1e12, p_gemm, r_copy / 1e9, p_idle, p_sleep));
    o.line("");
    o.line("| row | flop / byte floor ms (790 TFLOP/s, 4.3 TB/s) | products ms | bytes ms | serial ms | "
           "at the limit ms (above idle / above sleeping) | target ms | target under the bound |");
    o.line("|---|---|---|---|---|---|---|---|");
    for (const Row& r : rows) {
      const double flops = r.flop_ms * 1e-3 * 790e12, moved = r.byte_ms * 1e-3 * 4.3e12;
      const double t_f = flops / r_gemm, t_b = moved / r_copy;
      auto at_limit = [&](double base) {
        const double joules = flops * (p_gemm - base) / r_gemm + moved * copy_watts_per_rate(base);
        return std::max({t_f, t_b, joules / (limit_w - base)});
      };
      const double lo = std::min(at_limit(p_idle), at_limit(p_sleep));
      o.line(fmt("| %s | %.2f / %.2f | %.2f | %.2f | %.2f | %.2f / %.2f | %s | %s |", r.label.c_str(), r.flop_ms,
                 r.byte_ms, t_f * 1e3, t_b * 1e3, (t_f + t_b) * 1e3, at_limit(p_idle) * 1e3, at_limit(p_sleep) * 1e3,
                 r.target_ms > 0 ? fmt("%.2f", r.target_ms).c_str() : "-",
                 r.target_ms <= 0 ? "-" : r.target_ms < lo * 1e3 ? "yes: out of reach" : "no"));
    }
    o.line("");
  }
  if (!out_path.empty()) std::ofstream(out_path) << o.md.str();
  CKB(cublasDestroy(h));
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(c));
  CK(cudaFree(src));
  CK(cudaFree(dst));
  return 0;
}
