// bench/cuda_step_bench.cu — dion3-cuda-step-bench: optimizer step time of the CUDA backend on
// model-shaped parameter sets (bench/model_shapes: gpt-1b, llama-7b), with weights and
// gradients filled on the device (a 7B set is too large to fill from the host quickly).
// Rows: AdamW, Muon, NorMuon, Dion3 at f = 1, 1/2, 1/4, 1/8; each with its median step time,
// the ratios to Muon and AdamW of the same run, a roofline floor (max of FLOPs really performed
// / 790 TFLOP/s and the bytes a step must move / 4.3 TB/s), the time from constructing the
// optimizer to the end of its first step, and the device memory it holds beyond its state.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "dion3/backend.hpp"
#include "dion3/optimizer.hpp"
#include "dion3/orthogonalize.hpp"
#include "model_shapes.hpp"

namespace {

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));           \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = (static_cast<uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = __float2bfloat16((static_cast<float>(z >> 40) * (1.0f / 16777216.0f) - 0.5f) * scale);
  }
}

std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

struct Variant {
  std::string label;
  dion3::Algorithm algo;
  double fraction;
};

double used_bytes() {
  size_t free_b = 0, total = 0;
  CK(cudaDeviceSynchronize());
  CK(cudaMemGetInfo(&free_b, &total));
  return static_cast<double>(total - free_b);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> models = {"gpt-1b", "llama-7b"};
  int iters = 5, warmup = 1;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) models = {argv[++i]};
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc) warmup = std::atoi(argv[++i]);
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: dion3-cuda-step-bench [--model NAME] [--iters N] [--warmup N] [--out FILE]\n");
      return 2;
    }
  }
  std::ostringstream md;
  auto line = [&](const std::string& s) {
    std::printf("%s\n", s.c_str());
    std::fflush(stdout);
    md << s << "\n";
  };
  const std::vector<Variant> variants = {{"AdamW", dion3::Algorithm::AdamW, 1.0},
                                         {"Muon", dion3::Algorithm::Muon, 1.0},
                                         {"NorMuon", dion3::Algorithm::NorMuon, 1.0},
                                         {"Dion3 f=1", dion3::Algorithm::Dion3, 1.0},
                                         {"Dion3 f=1/2", dion3::Algorithm::Dion3, 0.5},
                                         {"Dion3 f=1/4", dion3::Algorithm::Dion3, 0.25},
                                         {"Dion3 f=1/8", dion3::Algorithm::Dion3, 0.125}};
  for (const std::string& model : models) {
    const auto shapes = dion3::bench::model_matrices(dion3::bench::find_preset(model), 0);
    const int64_t total = dion3::bench::total_elements(shapes);
    std::vector<void*> W, G;
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const int64_t n = shapes[i].rows * shapes[i].cols;
      void *w, *g;
      CK(cudaMalloc(&w, n * 2));
      CK(cudaMalloc(&g, n * 2));
      fill_bf16<<<2048, 256>>>(static_cast<__nv_bfloat16*>(w), n, 2 * i + 1, 0.04f);
      fill_bf16<<<2048, 256>>>(static_cast<__nv_bfloat16*>(g), n, 2 * i + 2, 2e-3f);
      W.push_back(w);
      G.push_back(g);
    }
    CK(cudaDeviceSynchronize());
    line(fmt("## Optimizer step, %s (%zu matrices, %.2fB weights, bf16 weights/grads/momentum), median of %d steps",
             model.c_str(), shapes.size(), total / 1e9, iters));
    line("");
    line("| optimizer | step ms | vs Muon | vs AdamW | floor ms (flop / byte) | step / floor | construct→1st step s | "
         "workspace beyond state GiB | methods |");
    line("|---|---|---|---|---|---|---|---|---|");
    double muon_ms = 0, adamw_ms = 0;
    for (const Variant& v : variants) {
      const double base = used_bytes();
      const auto t0 = std::chrono::steady_clock::now();
      double first_s = 0, median_ms = 0, beyond = 0, flops = 0;
      std::string methods;
      {
        dion3::Optimizer opt(dion3::make_cuda_backend(0));
        dion3::GroupConfig cfg;
        cfg.algorithm = v.algo;
        cfg.fraction = v.fraction;
        const int g = opt.add_group(cfg);
        for (std::size_t i = 0; i < shapes.size(); ++i) {
          dion3::ParamSpec spec;
          spec.name = shapes[i].name;
          spec.weight = {W[i], dion3::DType::BF16, dion3::Device::CUDA, 0, {shapes[i].rows, shapes[i].cols}};
          spec.grad = {G[i], dion3::DType::BF16, dion3::Device::CUDA, 0, {shapes[i].rows, shapes[i].cols}};
          opt.add_param(g, spec);
        }
        opt.step();
        first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double after = used_bytes();
        // State: momentum (bf16) + variance (fp32 per row) for matrix methods; AdamW two bf16 moments.
        double state = 0;
        for (const auto& s : shapes)
          state += v.algo == dion3::Algorithm::AdamW ? 4.0 * s.rows * s.cols
                   : v.algo == dion3::Algorithm::Muon ? 2.0 * s.rows * s.cols
                                                       : 2.0 * s.rows * s.cols + 4.0 * s.rows;
        beyond = (after - base - state) / (1024.0 * 1024 * 1024);
        const double sym = opt.backend().symmetric_cost_factor();
        for (const auto& m : opt.plan()) {
          if (!dion3::is_matrix_algorithm(m.algorithm)) continue;
          const int64_t p = std::min(m.selected_rows, m.cols), q = std::max(m.selected_rows, m.cols);
          flops += m.method == dion3::OrthMethod::Gram ? dion3::gram_ns_flops(m.count, p, q, 5, 1, sym)
                                                       : dion3::standard_ns_flops(m.count, p, q, 5, sym);
          methods += fmt("%s%lldx%lld:%s", methods.empty() ? "" : " ", (long long)m.selected_rows, (long long)m.cols,
                         m.method == dion3::OrthMethod::Gram ? "G" : "S");
        }
        for (int i = 0; i < warmup; ++i) opt.step();
        std::vector<double> t;
        for (int i = 0; i < iters; ++i) {
          const auto a = std::chrono::steady_clock::now();
          opt.step();  // ends with the one host synchronisation of the non-finite verdict
          t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
        }
        std::sort(t.begin(), t.end());
        median_ms = t[t.size() / 2];
      }
      // Bytes a step must move: read G, read+write M and W (bf16); AdamW: G, W, two moments.
      const double bytes = (v.algo == dion3::Algorithm::AdamW ? 7.0 : 5.0) * 2.0 * static_cast<double>(total);
      const double floor_flop = flops / 790e12 * 1e3, floor_byte = bytes / 4.3e12 * 1e3;
      const double floor_ms = std::max(floor_flop, floor_byte);
      if (v.algo == dion3::Algorithm::Muon) muon_ms = median_ms;
      if (v.algo == dion3::Algorithm::AdamW) adamw_ms = median_ms;
      line(fmt("| %s | %.2f | %s | %s | %.2f (%.2f / %.2f) | %.2fx | %.2f | %.2f | %s |", v.label.c_str(), median_ms,
               muon_ms > 0 ? fmt("%.2fx faster", muon_ms / median_ms).c_str() : "-",
               adamw_ms > 0 ? fmt("%.2fx", median_ms / adamw_ms).c_str() : "-", floor_ms, floor_flop, floor_byte,
               median_ms / floor_ms, first_s, beyond, methods.c_str()));
    }
    line("");
    for (void* p : W) cudaFree(p);
    for (void* p : G) cudaFree(p);
  }
  if (!out_path.empty()) std::ofstream(out_path) << md.str();
  return 0;
}
