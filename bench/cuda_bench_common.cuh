// bench/cuda_bench_common.cuh — what the CUDA benchmark programs share: a CUDA error check that
// exits, a deterministic device-side fill (hash of the index, uniform in [-scale/2, scale/2]),
// CUDA-event median timing of candidates in turn, a device view's values on the host, printf-style
// formatting, a markdown sink that also echoes to stdout, the symmetric-product shapes of --shapes, and the session of the kernel
// benches (arguments, backend, stream, report). Header-only; each program is its own
// translation unit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "dion3/backend.hpp"
#include "dion3/config.hpp"
#include "dion3/view.hpp"

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

namespace bench {

template <class T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = (static_cast<uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f) - 0.5f;
    p[i] = static_cast<T>(u * scale);
  }
}

inline void fill(void* p, dion3::DType dt, int64_t n, uint64_t seed, float scale, cudaStream_t s) {
  if (dt == dion3::DType::F32) fill_kernel<float><<<4096, 256, 0, s>>>(static_cast<float*>(p), n, seed, scale);
  else if (dt == dion3::DType::F16) fill_kernel<__half><<<4096, 256, 0, s>>>(static_cast<__half*>(p), n, seed, scale);
  else fill_kernel<__nv_bfloat16><<<4096, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  CK(cudaGetLastError());
}

// Medians of `iters` CUDA-event timings of each candidate, after `warmup` untimed calls of each,
// the candidates timed in turn (f0, f1, ..., f0, f1, ...): a drift of the clocks or the power
// state during the run reaches every candidate alike, so the ratios between them hold steadier
// than those of medians taken one candidate after the other.
inline std::vector<double> interleaved_medians(cudaStream_t s, int warmup, int iters,
                                               const std::vector<std::function<void()>>& fs) {
  for (int i = 0; i < warmup; ++i)
    for (const auto& f : fs) f();
  std::vector<std::vector<double>> t(fs.size());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < iters; ++i) {
    for (std::size_t c = 0; c < fs.size(); ++c) {
      CK(cudaEventRecord(a, s));
      fs[c]();
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      t[c].push_back(ms);
    }
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::vector<double> med;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

// The device's copy bandwidth, the yardstick of the memory-bound passes: a 1 GiB device-to-device
// copy on `s`, bytes read plus written over the median of 7 copies (after one to warm up), in GB/s.
inline double copy_bandwidth_gbs(cudaStream_t s) {
  const std::size_t bytes = std::size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemsetAsync(src, 1, bytes, s));
  const auto t = interleaved_medians(s, 1, 7, {[&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)); }});
  CK(cudaFree(src));
  CK(cudaFree(dst));
  return 2.0 * static_cast<double>(bytes) / (t[0] * 1e6);
}

// An orthogonalization config with the method and iteration dtype fixed (the rest default).
inline dion3::OrthConfig orth_config(dion3::OrthMethod method, dion3::DType iteration_dtype) {
  dion3::OrthConfig cfg;
  cfg.method = method;
  cfg.iteration_dtype = iteration_dtype;
  return cfg;
}

// Lines of a markdown report, echoed to stdout as they come.
struct Out {
  std::ostringstream md;
  void line(const std::string& s) {
    std::printf("%s\n", s.c_str());
    std::fflush(stdout);
    md << s << "\n";
  }
};

inline std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// The options every CUDA benchmark takes: --out FILE (markdown copy), --quick, --iters N.
struct Args {
  std::string out_path;
  bool quick = false;
  int iters = 10;
  std::string only;  // --only TEXT: just the timing rows whose label contains TEXT (profiling one shape)
  std::string shapes;  // --shapes LIST: the sym bench's timing rows, e.g. "gram:f16:16x2752x4096,sym:bf16:8x4096"
  bool once = false;   // --once: each candidate run once, untimed (for a profiler such as ncu)
  double energy_s = 0;  // --energy-s S (> 0): the sym bench's products again under NVML's energy counter
};

// The short dtype names of the bench tables and of dion3-cuda-sym-bench --shapes.
inline const char* dtype_short(dion3::DType t) {
  return t == dion3::DType::F32 ? "f32" : t == dion3::DType::F16 ? "f16" : "bf16";
}

// Parses Args; on anything else prints the usage line and exits with status 2.
inline Args parse_args(int argc, char** argv, const char* program) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--out" && i + 1 < argc) a.out_path = argv[++i];
    else if (s == "--quick") a.quick = true;
    else if (s == "--iters" && i + 1 < argc) a.iters = std::atoi(argv[++i]);
    else if (s == "--only" && i + 1 < argc) a.only = argv[++i];
    else if (s == "--shapes" && i + 1 < argc) a.shapes = argv[++i];
    else if (s == "--once") a.once = true;
    else if (s == "--energy-s" && i + 1 < argc && std::atof(argv[i + 1]) > 0) a.energy_s = std::atof(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: %s [--out FILE] [--quick] [--iters N] [--only TEXT] [--shapes LIST] [--once] [--energy-s S]\n",
                   program);
      std::exit(2);
    }
  }
  return a;
}

// A contiguous view's values, as floats on the host (after the stream's work so far).
inline std::vector<float> download(const dion3::MatrixView& v, cudaStream_t s) {
  const int64_t n = v.batch * v.rows * v.cols;
  std::vector<char> raw(n * dion3::dtype_size(v.dtype));
  CK(cudaStreamSynchronize(s));
  CK(cudaMemcpy(raw.data(), v.data, raw.size(), cudaMemcpyDeviceToHost));
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    if (v.dtype == dion3::DType::F32) out[i] = reinterpret_cast<const float*>(raw.data())[i];
    else if (v.dtype == dion3::DType::F16) out[i] = __half2float(reinterpret_cast<const __half*>(raw.data())[i]);
    else out[i] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(raw.data())[i]);
  }
  return out;
}

// A symmetric product of the sym and CUTLASS benches: op 0 gram (C = X·Xᵀ, X p x q), op 1
// sym_product (C = 2·R·R − R, R p x p, q = p); b matrices of dtype dt.
struct SymShape { int op; dion3::DType dt; int64_t b, p, q; };

// --shapes: comma-separated OP:DTYPE:BxPxQ (gram) or OP:DTYPE:BxP (sym), OP gram|sym, DTYPE f16|bf16;
// anything else exits with status 2.
inline std::vector<SymShape> parse_sym_shapes(const std::string& list) {
  std::vector<SymShape> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char op[8] = {}, dt[8] = {};
    long long b = 0, p = 0, q = 0;
    const int got = std::sscanf(item.c_str(), "%7[a-z]:%7[a-z0-9]:%lldx%lldx%lld", op, dt, &b, &p, &q);
    const std::string o(op), d(dt);
    const bool gram = o == "gram";
    if (got < 4 || (!gram && o != "sym") || (d != "f16" && d != "bf16") || got != (gram ? 5 : 4) || b <= 0 ||
        p <= 0 || (gram && q <= 0)) {
      std::fprintf(stderr, "--shapes: cannot read '%s' (gram:f16:BxPxQ or sym:bf16:BxP)\n", item.c_str());
      std::exit(2);
    }
    out.push_back({gram ? 0 : 1, d == "f16" ? dion3::DType::F16 : dion3::DType::BF16, b, p, gram ? q : p});
  }
  return out;
}

// The report's first line: which GPU the numbers come from.
inline void device_line(Out& o, int device = 0) {
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, device));
  o.line(fmt("Device: %s, %d SMs, %.0f MB L2", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6));
  o.line("");
}

// A kernel bench's run: its arguments, one CUDA backend on device 0 and that backend's stream,
// and the markdown report (the device line first); save() writes the report to --out, if given.
struct Session {
  Args args;
  std::unique_ptr<dion3::Backend> be;
  cudaStream_t s;
  Out o;
  Session(int argc, char** argv, const char* program)
      : args(parse_args(argc, argv, program)),
        be(dion3::make_cuda_backend(0)),
        s(static_cast<cudaStream_t>(dion3::cuda::backend_stream(*be))) {
    device_line(o);
  }
  void save() const {
    if (!args.out_path.empty()) std::ofstream(args.out_path) << o.md.str();
  }
};

}  // namespace bench
