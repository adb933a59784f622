// bench/cuda_orth_bench.cu — dion3-cuda-bench: the CUDA backend's orthogonalization numbers.
//
// 1. Symmetric products (X·Xᵀ and sym·sym) on the lower-triangle tile schedule, for several
//    tile edges, against one full cuBLAS GEMM of the same size (same run, same inputs).
// 2. Orthogonalization of batches (SPEC §2 effective TFLOP/s): standard NS on cuBLAS bf16,
//    Gram NS (fp16) on full GEMMs, Gram NS on the symmetric tile schedule.
// Times are CUDA-event medians after warm-up; output is markdown (stdout and --out FILE).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_bench_common.cuh"
#include "cuda/cuda_backend.hpp"
#include "dion3/backend.hpp"
#include "dion3/orthogonalize.hpp"

namespace {

using bench::fill;
using bench::fmt;
using bench::median_ms;
using bench::Out;

using dion3::DType;
using dion3::MatrixView;

struct Shape { int64_t b, p, q; };

}  // namespace

int main(int argc, char** argv) {
  bench::Session session(argc, argv, "dion3-cuda-bench");
  const bench::Args& args = session.args;
  const bool quick = args.quick;
  const int iters = args.iters;
  auto& be = session.be;
  const cudaStream_t s = session.s;
  Out& o = session.o;

  // ---- 1. symmetric products vs full cuBLAS GEMM ---------------------------------------------
  const std::vector<Shape> gram_shapes = quick ? std::vector<Shape>{{8, 4096, 11008}}
                                               : std::vector<Shape>{{8, 4096, 11008}, {8, 4096, 4096}, {32, 1024, 4096},
                                                                    {64, 2752, 4096}, {16, 2048, 8192}, {4, 8192, 8192}};
  const std::vector<int64_t> tiles = {256, 384, 512, 768, 1024, 2048};
  o.line("## Symmetric kernels vs one full cuBLAS GEMM (fp16 in, fp32 accumulate)");
  o.line("");
  o.line("Gram C = X·Xᵀ (batch b of p×q) and sym_product C = 2·R·R − R (b of p×p). TFLOP/s counts the full GEMM's "
         "2·p²·q FLOPs (effective); speed-up = full time / tiled time.");
  o.line("");
  o.line("| op | b | p | q | full ms | full TFLOP/s | best tile | tiled ms | eff. TFLOP/s | speed-up | all tiles (ms) |");
  o.line("|---|---|---|---|---|---|---|---|---|---|---|");
  for (int op = 0; op < 2; ++op) {
    for (const Shape& sh : gram_shapes) {
      const int64_t q = op == 0 ? sh.q : sh.p;
      if (op == 1 && (sh.q == sh.p && sh.p == 4096 && sh.b == 8)) continue;  // same p as the first row
      dion3::DeviceBuffer X(be->allocator(), sh.b * sh.p * q * 2), C(be->allocator(), sh.b * sh.p * sh.p * 2),
          R(be->allocator(), op == 1 ? sh.b * sh.p * sh.p * 2 : 16);
      MatrixView Xv = MatrixView::contiguous(X.get(), DType::F16, sh.b, sh.p, q);
      MatrixView Cv = MatrixView::contiguous(C.get(), DType::F16, sh.b, sh.p, sh.p);
      MatrixView Rv = MatrixView::contiguous(R.get(), DType::F16, sh.b, sh.p, sh.p);
      fill(X.get(), DType::F16, sh.b * sh.p * q, 1, 2.0f / std::sqrt(static_cast<float>(q)), s);
      if (op == 1) be->gram(Xv, Rv);  // a real symmetric operand
      auto run = [&] {
        if (op == 0) be->gram(Xv, Cv);
        else be->sym_product(2.0f, Rv, Rv, -1.0f, &Rv, 0.0f, Cv);
      };
      const double flops = 2.0 * sh.b * sh.p * sh.p * q;
      dion3::cuda::set_symmetric_options(*be, {false, 0});
      const double full = median_ms(s, 2, iters, run);
      double best = 1e30;
      int64_t best_tile = 0;
      std::string all;
      for (int64_t t : tiles) {
        if (t >= sh.p) continue;
        dion3::cuda::set_symmetric_options(*be, {true, t, false});  // the cuBLAS tile schedule
        const double ms = median_ms(s, 2, iters, run);
        all += fmt("%s%lld:%.3f", all.empty() ? "" : " ", static_cast<long long>(t), ms);
        if (ms < best) { best = ms; best_tile = t; }
      }
      o.line(fmt("| %s | %lld | %lld | %lld | %.3f | %.0f | %lld | %.3f | %.0f | %.2fx | %s |", op == 0 ? "gram" : "sym_product",
                 (long long)sh.b, (long long)sh.p, (long long)q, full, flops / full / 1e9, (long long)best_tile, best,
                 flops / best / 1e9, full / best, all.c_str()));
    }
  }
  dion3::cuda::set_symmetric_options(*be, {true, 0});
  o.line("");

  // ---- 2. orthogonalization ------------------------------------------------------------------
  const std::vector<Shape> orth_shapes = quick ? std::vector<Shape>{{8, 4096, 11008}}
                                               : std::vector<Shape>{{8, 4096, 4096}, {8, 4096, 11008}, {32, 1024, 4096},
                                                                    {64, 2752, 4096}, {16, 1024, 11008}};
  o.line("## Orthogonalization, effective TFLOP/s (SPEC §2: T·(4p²q + 2p³) per matrix, T = 5)");
  o.line("");
  o.line("| batch | standard NS bf16 (ms / TFLOP/s) | Gram NS fp16, full GEMMs | Gram NS fp16, symmetric tiles | "
         "Gram-sym / standard | Gram-sym / Gram-full | auto picks |");
  o.line("|---|---|---|---|---|---|---|");
  for (const Shape& sh : orth_shapes) {
    dion3::DeviceBuffer in(be->allocator(), sh.b * sh.p * sh.q * 4), out(be->allocator(), sh.b * sh.p * sh.q * 4);
    MatrixView iv = MatrixView::contiguous(in.get(), DType::F32, sh.b, sh.p, sh.q);
    MatrixView ov = MatrixView::contiguous(out.get(), DType::F32, sh.b, sh.p, sh.q);
    fill(in.get(), DType::F32, sh.b * sh.p * sh.q, 7, 1.0f, s);
    const double eff = dion3::effective_ns_flops(sh.b, sh.p, sh.q, 5);
    auto time_cfg = [&](dion3::OrthMethod m, DType dt, bool sym) {
      dion3::cuda::set_symmetric_options(*be, {sym, 0});
      dion3::OrthConfig cfg;
      cfg.method = m;
      cfg.iteration_dtype = dt;
      dion3::Orthogonalizer orth(*be, cfg, sh.b, sh.p, sh.q);
      return median_ms(s, 2, std::max(3, iters / 2), [&] { orth.run(iv, ov); });
    };
    const double st = time_cfg(dion3::OrthMethod::Standard, DType::BF16, false);
    const double gf = time_cfg(dion3::OrthMethod::Gram, DType::F16, false);
    const double gs = time_cfg(dion3::OrthMethod::Gram, DType::F16, true);
    dion3::cuda::set_symmetric_options(*be, {true, 0});
    dion3::OrthConfig auto_cfg;
    const auto pick = dion3::choose_orth_method(*be, auto_cfg, sh.p, sh.q);
    o.line(fmt("| (%lld, %lld, %lld) | %.2f / %.0f | %.2f / %.0f | %.2f / %.0f | %.2fx | %.2fx | %s |", (long long)sh.b,
               (long long)sh.p, (long long)sh.q, st, eff / st / 1e9, gf, eff / gf / 1e9, gs, eff / gs / 1e9, st / gs,
               gf / gs, pick == dion3::OrthMethod::Gram ? "gram" : "standard"));
  }
  o.line("");
  o.line(fmt("symmetric_cost_factor() reported by the backend: %.3f", be->symmetric_cost_factor()));
  session.save();
  return 0;
}
