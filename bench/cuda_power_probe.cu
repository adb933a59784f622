// bench/cuda_power_probe.cu — dion3-cuda-power-probe: is the optimizer step held by the GPU's power
// limit rather than by its FLOPs or bytes? Runs each workload sustained (after a warm-up) and reads
// NVML's energy counter around it: the idle GPU; a kernel on every SM that only sleeps (clocks up,
// nothing moved); cuBLAS's bf16 GEMM; a copy kernel, cudaMemcpyAsync, a read-only and a write-only
// kernel; and the GEMM beside the copy kernel and beside cudaMemcpyAsync on a second stream. For
// each: its rate, the share of its rate alone that it keeps side by side, mean power, the SM clock
// and how often the power cap held it, and its energy per TFLOP or GB above the sleeping kernel's.
// For a side-by-side pair, the power the pair would draw if each kept its energy per unit of work
// alone, against what it drew: below 1, the pair spent less energy per unit than alone (a lower
// clock and voltage), and the bound below would overstate.
// Then, for rows given as --row label:flop_ms:byte_ms[:target_ms] (the step bench's floor columns:
// FLOPs at 790 TFLOP/s, bytes at 4.3 TB/s): the least time a step with those FLOPs and bytes takes at
// the enforced power limit if every byte moved under the products, from the products' energy at the
// GEMM's, the bytes read and written (--read-share of them read) at the cheapest read's and
// write's energy per byte, each above a baseline, over the power the limit leaves above it (never
// below the two floors). A higher baseline gives a lower bound: the
// sleeping kernel's (the higher of a cool and a hot reading) is the bound.
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

// Reads every word; one word per thread is written, and only if the data say so (never, for
// finite bf16 fills), so that the compiler keeps the loads.
__global__ void read_kernel(const uint4* __restrict__ src, size_t n, uint4* __restrict__ sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  uint4 acc{0, 0, 0, 0};
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    acc.x ^= a.x ^ b.x ^ c.x ^ d.x;
    acc.y ^= a.y ^ b.y ^ c.y ^ d.y;
    acc.z ^= a.z ^ b.z ^ c.z ^ d.z;
    acc.w ^= a.w ^ b.w ^ c.w ^ d.w;
  }
  for (; i < n; i += stride) acc.x ^= src[i].x;
  if (acc.x == 0xFFFFFFFFu && acc.y == 0xFFFFFFFFu) sink[threadIdx.x] = acc;
}

// Writes every word with values that change from word to word (as the step's results do; zeros
// would cost the memory less energy than real data).
__global__ void write_kernel(uint4* __restrict__ dst, size_t n, unsigned salt) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const unsigned h = static_cast<unsigned>(i) * 0x9E3779B9u + salt;
    dst[i] = uint4{h, h ^ 0x5bd1e995u, h * 0x85ebca6bu, h ^ (h >> 13)};
  }
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
  double work;  // FLOPs or bytes (read + written) of one unit; 0 for the sleeping kernel
  bool flops;   // work counts FLOPs (else bytes)
  cudaStream_t s;
};

struct Measured {
  std::string name;
  int round = 0;
  std::vector<Lane> lanes;
  std::vector<long> units;  // each lane's units finished in the window
  unsigned temp_c = 0;      // GPU temperature at the window's end
  double seconds = 0, joules = 0, watts = 0;
  bench::ClockSampler::Summary clocks;
  // Lane l's work per second over the window.
  double rate(std::size_t l) const { return units[l] * lanes[l].work / seconds; }
};

// Runs the lanes side by side: `warm_s` of warm-up, then a window of at least `run_s` from one step
// of the energy counter to another, taken while the lanes run (each kept about 20 ms of work ahead),
// so the window holds no idle gap. Each lane's rate: the units it finished within the window.
Measured sustain(const std::string& name, int round, const std::vector<Lane>& lanes, const bench::PowerMeter& pm,
                 double warm_s, double run_s) {
  Measured m{name, round, lanes};
  std::vector<std::deque<cudaEvent_t>> flight(lanes.size());
  std::vector<int> depth(lanes.size(), 3);
  std::vector<long> done(lanes.size(), 0);
  auto pump = [&] {
    for (std::size_t l = 0; l < lanes.size(); ++l) {
      while (!flight[l].empty()) {
        const cudaError_t q = cudaEventQuery(flight[l].front());
        if (q == cudaErrorNotReady) break;
        CK(q);
        CK(cudaEventDestroy(flight[l].front()));
        flight[l].pop_front();
        ++done[l];
      }
      while (static_cast<int>(flight[l].size()) < depth[l]) {
        lanes[l].unit(lanes[l].s);
        cudaEvent_t e;
        CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        CK(cudaEventRecord(e, lanes[l].s));
        flight[l].push_back(e);
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  };
  auto pump_for = [&](double seconds) {
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    while (Clock::now() < until) pump();
  };
  // A short first warm-up tells each lane's unit time; the queue then holds about 20 ms of it.
  const double probe_s = 0.3;
  pump_for(probe_s);
  for (std::size_t l = 0; l < lanes.size(); ++l) {
    const double unit_ms = 1e3 * probe_s / static_cast<double>(std::max(done[l], 1L));
    depth[l] = static_cast<int>(std::clamp(std::ceil(20.0 / std::max(unit_ms, 1e-3)), 3.0, 256.0));
  }
  pump_for((lanes.empty() ? std::max(warm_s, 3.0) : warm_s) - probe_s);  // idle settles longer
  const auto e0 = pm.energy_edge(pump);  // the lanes kept busy between reads (idle: pump only sleeps)
  std::fill(done.begin(), done.end(), 0);
  bench::ClockSampler clocks(pm);
  pump_for(run_s);
  const auto e1 = pm.energy_edge(pump);
  m.units = done;
  m.clocks = clocks.summary();
  CK(cudaDeviceSynchronize());
  for (auto& f : flight)
    for (cudaEvent_t e : f) CK(cudaEventDestroy(e));
  m.seconds = std::chrono::duration<double>(e1.at - e0.at).count();
  m.joules = e1.joules - e0.joules;
  m.watts = m.joules / m.seconds;
  m.temp_c = pm.temperature_c();
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
  double warm_s = 1.0, run_s = 3.0;
  int n = 8192, rounds = 2;
  std::size_t copy_mib = 1024;
  std::string out_path;
  std::vector<Row> rows;
  // The share of a row's bytes that are reads: the step bench's floor bytes read G, M and W and
  // write M and W (AdamW: four reads, three writes).
  double read_share = 0.6;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--seconds" && i + 1 < argc) run_s = std::atof(argv[++i]);
    else if (s == "--warm" && i + 1 < argc) warm_s = std::atof(argv[++i]);
    else if (s == "--rounds" && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (s == "--gemm-n" && i + 1 < argc) n = std::atoi(argv[++i]);
    else if (s == "--copy-mib" && i + 1 < argc) copy_mib = std::strtoull(argv[++i], nullptr, 10);
    else if (s == "--row" && i + 1 < argc) rows.push_back(parse_row(argv[++i]));
    else if (s == "--read-share" && i + 1 < argc) read_share = std::atof(argv[++i]);
    else if (s == "--out" && i + 1 < argc) out_path = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: dion3-cuda-power-probe [--seconds S] [--warm S] [--rounds N] [--gemm-n N] [--copy-mib M] "
                   "[--row label:flop_ms:byte_ms[:target_ms]]... [--read-share R] [--out FILE]\n");
      return 2;
    }
  }
  if (run_s <= 0 || warm_s < 0.3 || rounds < 1 || n < 256 || n % 8 != 0 || copy_mib < 16 || read_share < 0 ||
      read_share > 1) {
    std::fprintf(stderr, "dion3-cuda-power-probe: need --seconds > 0, --warm >= 0.3, --rounds >= 1, --gemm-n >= 256 "
                         "(a multiple of 8), --copy-mib >= 16, --read-share in [0, 1]\n");
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
  const std::size_t bytes = copy_mib << 20, words = bytes / 16;
  if (bytes < 4 * static_cast<std::size_t>(prop.l2CacheSize)) {  // else the moves measure L2, not memory
    std::fprintf(stderr, "dion3-cuda-power-probe: --copy-mib must be at least four times L2 (%d MiB)\n",
                 4 * prop.l2CacheSize >> 20);
    return 2;
  }
  void *src, *dst, *sink;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMalloc(&sink, 1024 * sizeof(uint4)));
  bench::fill(src, dion3::DType::BF16, bytes / 2, 3, 1.0f, sc);
  CK(cudaDeviceSynchronize());

  const float alpha = 1.0f, beta = 0.0f;
  const int blocks = prop.multiProcessorCount * 4;
  const Lane gemm{"GEMM", [&](cudaStream_t) {
                    CKB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF,
                                     n, &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                  },
                  2.0 * n * n * static_cast<double>(n), true, sg};
  const Lane copy{"copy kernel", [&](cudaStream_t s) {
                    copy_kernel<<<blocks, 512, 0, s>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst), words);
                    CK(cudaGetLastError());
                  },
                  2.0 * bytes, false, sc};
  const Lane dcopy{"cudaMemcpyAsync", [&](cudaStream_t s) {
                     CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
                   },
                   2.0 * bytes, false, sc};
  const Lane reader{"read kernel", [&](cudaStream_t s) {
                      read_kernel<<<blocks, 512, 0, s>>>(static_cast<const uint4*>(src), words, static_cast<uint4*>(sink));
                      CK(cudaGetLastError());
                    },
                    1.0 * bytes, false, sc};
  unsigned salt = 0;
  const Lane writer{"write kernel", [&](cudaStream_t s) {
                      write_kernel<<<blocks, 512, 0, s>>>(static_cast<uint4*>(dst), words, ++salt);
                      CK(cudaGetLastError());
                    },
                    1.0 * bytes, false, sc};
  const Lane sleeper{"sleeping kernel", [&](cudaStream_t s) {
                       sleep_kernel<<<prop.multiProcessorCount * 2, 256, 0, s>>>(500000);
                       CK(cudaGetLastError());
                     },
                     0.0, false, sg};

  o.line(fmt("## Power probe: each workload %.1f s (between two steps of the energy counter) after %.1f s of warm-up, "
             "%d round(s); enforced power limit %.0f W",
             run_s, warm_s, rounds, limit_w));
  o.line("");
  o.line(fmt("GEMM: cuBLAS bf16 %d x %d x %d (fp32 accumulate); copies, reads and writes of %zu MiB (a copy's rate "
             "counts the bytes read and written). Side by side: the GEMM on one stream, the copy on another.",
             n, n, n, copy_mib));
  o.line("");
  const std::vector<std::pair<std::string, std::vector<Lane>>> plan = {
      {"idle", {}},
      {"sleeping kernel", {sleeper}},
      {"GEMM", {gemm}},
      {"copy kernel", {copy}},
      {"cudaMemcpyAsync", {dcopy}},
      {"read kernel", {reader}},
      {"write kernel", {writer}},
      {"GEMM + copy kernel", {gemm, copy}},
      {"GEMM + cudaMemcpyAsync", {gemm, dcopy}},
      // Again when the GPU is at its hottest: leakage grows with temperature, and the higher of the
      // two baselines keeps the bound a bound.
      {"sleeping kernel, hot", {sleeper}}};
  std::vector<Measured> ms;
  for (int r = 1; r <= rounds; ++r)
    for (const auto& [name, lanes] : plan) ms.push_back(sustain(name, r, lanes, pm, warm_s, run_s));

  // Each workload's mean over the rounds (power, rates): the numbers the model below uses.
  struct Alone {
    double watts = 0, rate = 0;
  };
  auto mean_of = [&](const std::string& name) {
    Alone x;
    int k = 0;
    for (const auto& m : ms)
      if (m.name == name) {
        x.watts += m.watts;
        x.rate += m.lanes.empty() ? 0 : m.rate(0);
        ++k;
      }
    if (k == 0) {
      std::fprintf(stderr, "dion3-cuda-power-probe: no workload named '%s' was measured\n", name.c_str());
      std::exit(1);
    }
    x.watts /= k;
    x.rate /= k;
    return x;
  };
  const double p_idle = mean_of("idle").watts;
  const double p_sleep = std::max(mean_of("sleeping kernel").watts, mean_of("sleeping kernel, hot").watts);
  // A rate from fewer units than this is too coarse (one unit more or less at either end of the window).
  constexpr long kMinUnits = 50;
  bool coarse = false;
  for (const auto& m : ms)
    for (std::size_t l = 0; l < m.lanes.size(); ++l)
      if (m.lanes[l].work > 0 && m.units[l] < kMinUnits) {
        o.line(fmt("Round %d, %s: %s finished %ld units in the window (under %ld): lengthen --seconds.", m.round,
                   m.name.c_str(), m.lanes[l].what.c_str(), m.units[l], kMinUnits));
        coarse = true;
      }
  o.line("| round | workload | rate | share of its rate alone | mean W | W if each kept its energy a unit alone "
         "(measured / that) | SM MHz mean (min-max) | power cap held the clock | other limits seen | GPU C | "
         "J per TFLOP or GB above the sleeping kernel |");
  o.line("|---|---|---|---|---|---|---|---|---|---|---|");
  for (const auto& m : ms) {
    std::string rate, share, energy, predicted = "-";
    double model_w = p_sleep;
    for (std::size_t l = 0; l < m.lanes.size(); ++l) {
      const Lane& ln = m.lanes[l];
      if (ln.work == 0) continue;
      const Alone al = mean_of(ln.what);
      const double r = m.rate(l), sh = r / al.rate, unit = ln.flops ? 1e12 : 1e9;
      model_w += sh * (al.watts - p_sleep);
      rate += fmt("%s%s %.1f %s", rate.empty() ? "" : ", ", ln.what.c_str(), r / unit, ln.flops ? "TFLOP/s" : "GB/s");
      share += fmt("%s%.3f", share.empty() ? "" : ", ", sh);
      if (m.lanes.size() == 1) energy = fmt("%.3f", (m.watts - p_sleep) / (r / unit));
    }
    if (m.lanes.size() > 1) predicted = fmt("%.0f (%.3f)", model_w, m.watts / model_w);
    // Beyond the software power cap (0x4): hardware slowdown 0x8, thermal 0x20/0x40, power brake 0x80.
    const unsigned long long other = m.clocks.reasons & 0xE8ull;
    o.line(fmt("| %d | %s | %s | %s | %.0f | %s | %.0f (%u-%u) | %.0f%% | %s | %u | %s |", m.round, m.name.c_str(),
               rate.empty() ? "-" : rate.c_str(), share.empty() ? "-" : share.c_str(), m.watts, predicted.c_str(),
               m.clocks.mean_mhz, m.clocks.min_mhz, m.clocks.max_mhz, 100 * m.clocks.power_capped,
               other ? fmt("0x%llx", other).c_str() : "-", m.temp_c, energy.empty() ? "-" : energy.c_str()));
  }
  o.line("");
  o.line("Side by side, shares summing past 1 get more done than one after the other; a measured power below what "
         "each workload's energy a unit alone predicts (ratio under 1) says the pair spent less energy a unit (lower "
         "clock and voltage), which the bound below does not allow for.");
  o.line("");

  if (!rows.empty() && limit_w <= p_sleep) o.line("No bound: the sleeping kernel drew as much as the limit.");
  if (!rows.empty() && coarse) o.line("No bound: some rates rest on too few units (above).");
  if (!rows.empty() && limit_w > p_sleep && !coarse) {
    const Alone g = mean_of("GEMM");
    // Bytes: the highest rate of the four ways of moving them. Energy: a byte read at the least of
    // the read kernel's and the two copies' energy a byte, a byte written at the least of the write
    // kernel's and the copies' (the bound assumes the step's passes read and write no cheaper).
    double r_move = 0;
    for (const char* w : {"copy kernel", "cudaMemcpyAsync", "read kernel", "write kernel"}) r_move = std::max(r_move, mean_of(w).rate);
    auto joules_per_byte = [&](const char* own, double base) {
      double j = 1e30;
      for (const char* w : {"copy kernel", "cudaMemcpyAsync", own}) {
        const Alone x = mean_of(w);
        j = std::min(j, (x.watts - base) / x.rate);
      }
      return std::max(j, 0.0);
    };
    o.line(fmt("## The least step time at the %.0f W limit, every byte moved under the products", limit_w));
    o.line("");
    o.line(fmt("Products at the GEMM's energy a FLOP (%.0f TFLOP/s sustained at %.0f W); bytes at the least energy a "
               "byte read or written (%.0f%% of the bytes read; the best move %.0f GB/s); above a baseline of the idle GPU (%.0f W) or the "
               "sleeping kernel (%.0f W), the power the limit leaves above it; never below the 790 TFLOP/s and "
               "4.3 TB/s floors. The sleeping kernel's column is the bound (the higher baseline; the higher of its "
               "cool and hot readings). For comparison: the products and the bytes each at its best rate alone.",
               g.rate / 1e12, g.watts, 100 * read_share, r_move / 1e9, p_idle, p_sleep));
    o.line("");
    o.line("| row | floor ms (flop / byte) | products at the GEMM's rate ms | bytes at the best move's rate ms | "
           "at the limit, above idle ms | at the limit, above the sleeping kernel ms (binding) | target ms | "
           "target below the bound |");
    o.line("|---|---|---|---|---|---|---|---|");
    for (const Row& r : rows) {
      const double flops = r.flop_ms * 1e-3 * 790e12, moved = r.byte_ms * 1e-3 * 4.3e12;
      const double t_f = flops / g.rate, t_b = moved / r_move;
      auto energy_term = [&](double base) {
        const double bytes_j = moved * (read_share * joules_per_byte("read kernel", base) +
                                        (1 - read_share) * joules_per_byte("write kernel", base));
        return (flops * (g.watts - base) / g.rate + bytes_j) / (limit_w - base);
      };
      const double floor_s = std::max(r.flop_ms, r.byte_ms) * 1e-3;
      const double bound = std::max(floor_s, energy_term(p_sleep));
      const char* binding = energy_term(p_sleep) >= floor_s ? "power" : "floor";
      o.line(fmt("| %s | %.2f / %.2f | %.2f | %.2f | %.2f | %.2f (%s) | %s | %s |", r.label.c_str(), r.flop_ms,
                 r.byte_ms, t_f * 1e3, t_b * 1e3, std::max(floor_s, energy_term(p_idle)) * 1e3, bound * 1e3, binding,
                 r.target_ms > 0 ? fmt("%.2f", r.target_ms).c_str() : "-",
                 r.target_ms <= 0 ? "-" : r.target_ms < bound * 1e3 ? "yes: out of reach" : "no"));
    }
    o.line("");
  }
  if (!out_path.empty()) std::ofstream(out_path) << o.md.str();
  CKB(cublasDestroy(h));
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(c), src, dst, sink}) CK(cudaFree(p));
  return 0;
}
