// bench/cuda_orth_bench.cu — dion3-cuda-bench: the CUDA backend's orthogonalization numbers:
// batches (algorithm.md §2 effective TFLOP/s) by standard NS on cuBLAS bf16, Gram NS (fp16) on full
// GEMMs, and Gram NS on the symmetric products (the fused kernel where it runs), then where the
// time of the first and the last goes, per backend op. The symmetric products alone are
// dion3-cuda-sym-bench's.
// Times are CUDA-event medians after warm-up, the three ways timed in turn; output is markdown
// (stdout and --out FILE).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_bench_common.cuh"
#include "profiling_backend.cuh"
#include "cuda/cuda_backend.hpp"
#include "dion3/backend.hpp"
#include "dion3/orthogonalize.hpp"

namespace {

using bench::fill;
using bench::fmt;
using bench::Out;

using dion3::DType;
using dion3::MatrixView;

struct Shape { int64_t b, p, q; };

using bench::orth_config;

}  // namespace

int main(int argc, char** argv) {
  bench::Session session(argc, argv, "dion3-cuda-bench");
  const bench::Args& args = session.args;
  const bool quick = args.quick;
  const int iters = args.iters;
  auto& be = session.be;
  const cudaStream_t s = session.s;
  Out& o = session.o;

  // ---- orthogonalization ---------------------------------------------------------------------
  const std::vector<Shape> orth_shapes = quick ? std::vector<Shape>{{8, 4096, 11008}}
                                               : std::vector<Shape>{{8, 4096, 4096}, {8, 4096, 11008}, {32, 1024, 4096},
                                                                    {64, 2752, 4096}, {16, 1024, 11008}};
  o.line("## Orthogonalization, effective TFLOP/s (algorithm.md §2: T·(4p²q + 2p³) per matrix, T = 5)");
  o.line("");
  o.line("| batch | standard NS bf16 (ms / TFLOP/s) | Gram NS fp16, full GEMMs | Gram NS fp16, symmetric tiles | "
         "Gram-sym / standard | Gram-sym / Gram-full | auto picks |");
  o.line("|---|---|---|---|---|---|---|");
  // Where the time goes: one more run of the baseline and of Gram NS per shape, through a
  // profiling backend (its own CUDA backend and stream), after two unprofiled runs.
  std::unique_ptr<dion3::Backend> prof_inner = dion3::make_cuda_backend(0);
  dion3::Backend& prof_cuda = *prof_inner;
  bench::ProfilingBackend prof(std::move(prof_inner));
  std::vector<std::string> profile_rows;
  for (const Shape& sh : orth_shapes) {
    dion3::DeviceBuffer in(be->allocator(), sh.b * sh.p * sh.q * 4), out(be->allocator(), sh.b * sh.p * sh.q * 4);
    MatrixView iv = MatrixView::contiguous(in.get(), DType::F32, sh.b, sh.p, sh.q);
    MatrixView ov = MatrixView::contiguous(out.get(), DType::F32, sh.b, sh.p, sh.q);
    fill(in.get(), DType::F32, sh.b * sh.p * sh.q, 7, 1.0f, s);
    const double eff = dion3::effective_ns_flops(sh.b, sh.p, sh.q, 5);
    // The three ways, timed in turn (bench::interleaved_medians), each with its own workspace.
    struct Way { dion3::OrthMethod method; DType dtype; bool sym; };
    const Way ways[] = {{dion3::OrthMethod::Standard, DType::BF16, false},
                        {dion3::OrthMethod::Gram, DType::F16, false},
                        {dion3::OrthMethod::Gram, DType::F16, true}};
    std::vector<std::unique_ptr<dion3::Orthogonalizer>> orths;
    std::vector<std::function<void()>> cands;
    for (const Way& w : ways) {
      orths.push_back(std::make_unique<dion3::Orthogonalizer>(*be, orth_config(w.method, w.dtype), sh.b, sh.p, sh.q));
      cands.push_back([&, w, orth = orths.back().get()] {
        dion3::cuda::set_symmetric_options(*be, {w.sym, 0});
        orth->run(iv, ov);
      });
    }
    const std::vector<double> ms = bench::interleaved_medians(s, 2, iters, cands);
    orths.clear();
    const double st = ms[0], gf = ms[1], gs = ms[2];
    for (const bool gram : {false, true}) {
      dion3::cuda::set_symmetric_options(prof_cuda, {gram, 0});
      const auto cfg = gram ? orth_config(dion3::OrthMethod::Gram, DType::F16)
                            : orth_config(dion3::OrthMethod::Standard, DType::BF16);
      dion3::Orthogonalizer orth(prof, cfg, sh.b, sh.p, sh.q);
      for (int i = 0; i < 2; ++i) orth.run(iv, ov);
      prof.enabled = true;
      orth.run(iv, ov);
      prof.enabled = false;
      prof.collect();
      auto op = [&](const char* name) { return prof.totals[{"all", name}]; };
      double sum = 0;
      for (const auto& [key, ms] : prof.totals) sum += ms;
      profile_rows.push_back(fmt("| (%lld, %lld, %lld) | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |",
                                 (long long)sh.b, (long long)sh.p, (long long)sh.q,
                                 gram ? "Gram NS fp16, symmetric" : "standard NS bf16, full GEMMs", sum,
                                 op("orth.normalize"), op("orth.gram"), op("orth.sym_product"), op("orth.gemm"),
                                 op("orth.convert") + op("orth.transpose")));
      prof.totals.clear();
    }
    dion3::cuda::set_symmetric_options(*be, {true, 0});
    dion3::OrthConfig auto_cfg;
    const auto pick = dion3::choose_orth_method(*be, auto_cfg, sh.p, sh.q);
    o.line(fmt("| (%lld, %lld, %lld) | %.2f / %.0f | %.2f / %.0f | %.2f / %.0f | %.2fx | %.2fx | %s |", (long long)sh.b,
               (long long)sh.p, (long long)sh.q, st, eff / st / 1e9, gf, eff / gf / 1e9, gs, eff / gs / 1e9, st / gs,
               gf / gs, pick == dion3::OrthMethod::Gram ? "gram" : "standard"));
  }
  o.line("");
  o.line("### Where the time goes (ms, one run each; CUDA events around every backend op)");
  o.line("");
  o.line("| batch | method | sum | normalize | X·Xᵀ (gram) | sym_product | gemm | convert / transpose |");
  o.line("|---|---|---|---|---|---|---|---|");
  for (const std::string& row : profile_rows) o.line(row);
  o.line("");
  o.line(fmt("symmetric_cost_factor() reported by the backend: %.3f", be->symmetric_cost_factor()));
  session.save();
  return 0;
}
