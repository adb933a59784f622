// bench/cuda_sym_bench.cu — dion3-cuda-sym-bench: the symmetric products (gram C = X·Xᵀ and
// sym_product C = 2·R·R − R) three ways in one run, same inputs: one full cuBLAS GEMM (+ the
// mirror pass), the lower-triangle tile schedule on cuBLAS (+ prepare/mirror passes, best of
// tiles 256/512), and the fused sm_90a kernel (sym_wgmma.cu). First a correctness table: the
// fused kernel against the cuBLAS tile schedule (itself tested against the CPU backend) on
// ragged and batched shapes, output poisoned with NaN beforehand. Times are CUDA-event medians
// after warm-up, the three ways (and the kernel without stores) timed in turn; markdown on stdout and --out FILE.
// --shapes LIST times the listed shapes instead; --once launches the full GEMM and the fused
// kernel's variants once each, untimed, behind marker kernels (tools/sym-ncu.py profiles them).
// --energy-s S: after the timing, the full GEMM, the fused kernel and its main loop alone again
// under NVML's energy counter, S seconds each: joules a product and per TFLOP, the clock, the cap.
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
#include "nvml_power.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/kernels.cuh"
#include "dion3/backend.hpp"

namespace {

using bench::dtype_short;
using bench::fill;
using bench::fmt;
using bench::Out;

using dion3::DType;
using dion3::MatrixView;

using bench::download;

struct Case { int op; DType in, out; int64_t b, p, q; };  // op 0 gram, 1 sym_product

}  // namespace

// Launched before each candidate under --once, so that a profiler's list of kernels tells them apart.
__global__ void ncu_marker() {}

using Shape = bench::SymShape;

int main(int argc, char** argv) {
  bench::Session session(argc, argv, "dion3-cuda-sym-bench");
  const bench::Args& args = session.args;
  const bool quick = args.quick;
  const int iters = args.iters;
  auto& be = session.be;
  const cudaStream_t s = session.s;
  Out& o = session.o;
  using dion3::cuda::set_symmetric_options;
  int failures = 0;
  std::unique_ptr<bench::PowerMeter> pm;
  if (args.energy_s > 0 && !args.once) pm = bench::open_power_meter("dion3-cuda-sym-bench");
  struct EnergyRow {
    std::string shape, candidate;
    double real_flops;  // the lower triangle's, a call
    bench::EnergyWindow e;
  };
  std::vector<EnergyRow> energy_rows;

  if (args.only.empty() && args.shapes.empty() && !args.once) {  // the correctness table, unless profiling shapes
    // ---- 1. correctness: fused kernel vs the cuBLAS tile schedule ------------------------------
    o.line("## Fused symmetric kernel: correctness against the cuBLAS tile schedule");
    o.line("");
    o.line("gram, then sym_product C = 2·R·R − 1.5·R (D aliasing neither), C = R·Z + 3·I, and C = 0.5·R·Z + 0.25·C + I "
           "(D aliasing C). err = max |kernel − ref| / max |ref|; C poisoned with NaN before the kernel.");
    o.line("");
    o.line("| in | C | b | p | q | kernel runs | gram err | 2RR-1.5R err | RZ+3I err | aliased err | symmetric | result |");
    o.line("|---|---|---|---|---|---|---|---|---|---|---|---|");
    const std::vector<Case> checks = {
        {0, DType::F16, DType::F16, 3, 200, 520}, {0, DType::BF16, DType::BF16, 3, 200, 520},
        {0, DType::F16, DType::F16, 2, 520, 1000}, {0, DType::BF16, DType::BF16, 2, 384, 40},
        {0, DType::F16, DType::F16, 1, 1000, 64}, {0, DType::BF16, DType::BF16, 5, 129, 136},
        {0, DType::F16, DType::F16, 2, 1536, 2048}, {0, DType::BF16, DType::BF16, 1, 2752, 1024},
        {0, DType::F16, DType::F16, 3, 1376, 512}, {0, DType::F16, DType::F16, 2, 72, 4096}};
    for (const Case& c : checks) {
      const int64_t b = c.b, p = c.p, q = c.q;
      const int64_t ein = dion3::dtype_size(c.in), eout = dion3::dtype_size(c.out);
      dion3::DeviceBuffer X(be->allocator(), b * p * q * ein), R(be->allocator(), b * p * p * ein),
          Z(be->allocator(), b * p * p * ein), C1(be->allocator(), b * p * p * eout),
          C2(be->allocator(), b * p * p * eout);
      MatrixView Xv = MatrixView::contiguous(X.get(), c.in, b, p, q);
      MatrixView Rv = MatrixView::contiguous(R.get(), c.in, b, p, p);
      MatrixView Zv = MatrixView::contiguous(Z.get(), c.in, b, p, p);
      MatrixView C1v = MatrixView::contiguous(C1.get(), c.out, b, p, p);
      MatrixView C2v = MatrixView::contiguous(C2.get(), c.out, b, p, p);
      MatrixView C1o = C1v, C2o = C2v;  // the aliased D
      fill(X.get(), c.in, b * p * q, 11 + p, 2.0f / std::sqrt(static_cast<float>(q)), s);
      set_symmetric_options(*be, {true, 64, false});
      be->gram(Xv, Rv, false);                                              // a symmetric R
      be->sym_product(2.0f, Rv, Rv, -1.0f, &Rv, 0.0f, Zv, false, false);  // a symmetric Z
      bool runs = true;  // every kernel call of this case ran the kernel (not the fallback)
      auto kern = [&](const MatrixView& A, const MatrixView& B, const MatrixView* D, const MatrixView& C) {
        const bool ok = dion3::cuda::sym_wgmma_supported(A, B, D, C);
        runs = runs && ok;
        return ok;
      };
      double err[4] = {0, 0, 0, 0};
      bool sym_ok = true, nan_free = true;
      for (int k = 0; k < 4; ++k) {
        for (int which = 0; which < 2; ++which) {
          set_symmetric_options(*be, {true, 64, false});
          MatrixView Cv = which == 0 ? C1v : C2v;
          if (k < 3) CK(cudaMemsetAsync(Cv.data, 0xFF, b * p * p * eout, s));  // NaN
          if (k == 3 && which == 0)  // both start from the reference's C (the aliased D)
            CK(cudaMemcpyAsync(C2v.data, C1v.data, b * p * p * eout, cudaMemcpyDeviceToDevice, s));
          if (k == 0) {
            // gram of X into C (C may be fp32)
            if (which == 1 && kern(Xv, Xv, nullptr, Cv)) dion3::cuda::launch_sym_wgmma(Xv, Xv, 1.0f, 0.0f, nullptr, 0.0f, Cv, s);
            else be->gram(Xv, Cv, false);
          } else if (k == 1) {
            if (c.out != c.in) {
              // D must have C's dtype: use C = 2·R·R + 3·I instead
              if (which == 1 && kern(Rv, Rv, nullptr, Cv)) dion3::cuda::launch_sym_wgmma(Rv, Rv, 2.0f, 0.0f, nullptr, 3.0f, Cv, s);
              else be->sym_product(2.0f, Rv, Rv, 0.0f, nullptr, 3.0f, Cv, false, false);
            } else {
              if (which == 1 && kern(Rv, Rv, &Rv, Cv)) dion3::cuda::launch_sym_wgmma(Rv, Rv, 2.0f, -1.5f, &Rv, 0.0f, Cv, s);
              else be->sym_product(2.0f, Rv, Rv, -1.5f, &Rv, 0.0f, Cv, false, false);
            }
          } else if (k == 2) {
            if (which == 1 && kern(Rv, Zv, nullptr, Cv)) dion3::cuda::launch_sym_wgmma(Rv, Zv, 1.0f, 0.0f, nullptr, 3.0f, Cv, s);
            else be->sym_product(1.0f, Rv, Zv, 0.0f, nullptr, 3.0f, Cv, false, false);
          } else {
            MatrixView& Dv = which == 0 ? C1o : C2o;
            if (which == 1 && kern(Rv, Zv, &Dv, Cv)) dion3::cuda::launch_sym_wgmma(Rv, Zv, 0.5f, 0.25f, &Dv, 1.0f, Cv, s);
            else be->sym_product(0.5f, Rv, Zv, 0.25f, &Dv, 1.0f, Cv, false, false);
          }
          CK(cudaGetLastError());
        }
        // k == 3 reads C1 (ref) and C2 (kernel), which both hold the k == 2 result beforehand.
        const auto ref = download(C1v, s), got = download(C2v, s);
        double mx = 0, md = 0;
        for (std::size_t i = 0; i < ref.size(); ++i) {
          mx = std::max(mx, static_cast<double>(std::fabs(ref[i])));
          const double d = std::fabs(static_cast<double>(ref[i]) - got[i]);
          if (!(d == d)) nan_free = false;
          else md = std::max(md, d);
        }
        err[k] = md / std::max(mx, 1e-30);
        for (int64_t bb = 0; bb < b && sym_ok; ++bb)
          for (int64_t r = 0; r < p && sym_ok; ++r)
            for (int64_t cc = 0; cc < r; ++cc)
              if (got[bb * p * p + r * p + cc] != got[bb * p * p + cc * p + r]) { sym_ok = false; break; }
      }
      const double tol = c.out == DType::F32 ? 2e-3 : (c.out == DType::F16 ? 4e-3 : 2e-2);
      const bool ok = nan_free && sym_ok && err[0] <= tol && err[1] <= 2 * tol && err[2] <= 2 * tol && err[3] <= 2 * tol;
      if (!ok) ++failures;
      o.line(fmt("| %s | %s | %lld | %lld | %lld | %s | %.2e | %.2e | %.2e | %.2e | %s | %s |", dtype_short(c.in),
                 dtype_short(c.out), (long long)b, (long long)p, (long long)q, runs ? "yes" : "partly (fallback)",
                 err[0], err[1], err[2], err[3], sym_ok ? "yes" : "NO", ok ? "pass" : (nan_free ? "FAIL" : "FAIL (NaN: unwritten)")));
    }
    o.line("");
  }

  // ---- 2. timing ------------------------------------------------------------------------------
  std::vector<Shape> shapes;
  if (!args.shapes.empty()) {
    shapes = bench::parse_sym_shapes(args.shapes);
  } else if (quick) {
    shapes = {{0, DType::F16, 8, 4096, 11008}, {1, DType::F16, 8, 4096, 4096}};
  } else {
    for (auto sh : std::vector<Shape>{{0, DType::F16, 8, 4096, 11008}, {0, DType::F16, 8, 4096, 4096},
                                      {0, DType::F16, 32, 1024, 4096}, {0, DType::F16, 64, 2752, 4096},
                                      {0, DType::F16, 16, 2048, 8192}, {0, DType::F16, 4, 8192, 8192},
                                      {0, DType::BF16, 8, 4096, 4096},
                                      {1, DType::F16, 8, 4096, 4096}, {1, DType::F16, 32, 1024, 1024},
                                      {1, DType::F16, 64, 2752, 2752}, {1, DType::F16, 16, 2048, 2048},
                                      {1, DType::F16, 4, 8192, 8192}, {1, DType::BF16, 8, 4096, 4096},
                                      {0, DType::F16, 32, 512, 2048}, {1, DType::F16, 32, 512, 512},
                                      {0, DType::F16, 64, 512, 2048}, {1, DType::F16, 64, 512, 512},
                                      {0, DType::BF16, 16, 2048, 2048}, {1, DType::BF16, 16, 2048, 2048}})
      shapes.push_back(sh);
  }
  o.line("## Symmetric products: full cuBLAS GEMM vs cuBLAS tile schedule vs fused sm_90a kernel");
  o.line("");
  o.line("Same inputs, C in the input dtype. eff. TFLOP/s counts the full GEMM's 2·p²·q FLOPs; real TFLOP/s counts "
         "the lower triangle's p·(p+1)·q. Each time includes the prepare/mirror passes of that path. \"banded\": the "
         "fused kernel writing C banded (mirrored only in the diagonal 256 x 256 blocks) and, for sym_product, reading "
         "its operands so (their upper blocks transposed from the lower ones); the last column is the fused kernel with "
         "its stores left out, and the one before it the fused kernel with one CTA per tile (no CTA pairs).");
  o.line("");
  o.line("| op | dt | b | p | q | full ms | full eff. TFLOP/s | tiled ms (tile) | tiled real TFLOP/s | kernel ms | "
         "kernel real TFLOP/s | kernel vs full | kernel vs tiled | banded ms (real TFLOP/s) | "
         "kernel, one CTA per tile ms (real TFLOP/s) | kernel main loop only ms (real TFLOP/s) |");
  o.line("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
  for (const Shape& sh : shapes) {
    const std::string label = fmt("%s %s %lldx%lldx%lld", sh.op == 0 ? "gram" : "sym_product", dtype_short(sh.dt),
                                  (long long)sh.b, (long long)sh.p, (long long)sh.q);
    if (!args.only.empty() && label.find(args.only) == std::string::npos) continue;
    const int64_t q = sh.op == 0 ? sh.q : sh.p, es = dion3::dtype_size(sh.dt);
    dion3::DeviceBuffer X(be->allocator(), sh.b * sh.p * q * es), C(be->allocator(), sh.b * sh.p * sh.p * es),
        R(be->allocator(), sh.op == 1 ? sh.b * sh.p * sh.p * es : 16);
    MatrixView Xv = MatrixView::contiguous(X.get(), sh.dt, sh.b, sh.p, q);
    MatrixView Cv = MatrixView::contiguous(C.get(), sh.dt, sh.b, sh.p, sh.p);
    MatrixView Rv = MatrixView::contiguous(R.get(), sh.dt, sh.b, sh.p, sh.p);
    fill(X.get(), sh.dt, sh.b * sh.p * q, 1, 2.0f / std::sqrt(static_cast<float>(q)), s);
    if (sh.op == 1) {
      set_symmetric_options(*be, {true, 0, false});
      be->gram(Xv, Rv, false);
    }
    auto run = [&] {
      if (sh.op == 0) be->gram(Xv, Cv, false);
      else be->sym_product(2.0f, Rv, Rv, -1.0f, &Rv, 0.0f, Cv, false, false);
    };
    const double flops = 2.0 * sh.b * sh.p * sh.p * q, real = static_cast<double>(sh.b) * sh.p * (sh.p + 1) * q;
    // The candidates, timed in turn: one full GEMM, the cuBLAS tile schedules, the fused kernel,
    // and the kernel's main loop alone (no stores: what the epilogue costs).
    const MatrixView& A = sh.op == 0 ? Xv : Rv;
    const bool runs = dion3::cuda::sym_wgmma_supported(A, A, nullptr, Cv);
    std::vector<std::function<void()>> cands{[&] {
      set_symmetric_options(*be, {false, 0, false});
      run();
    }};
    std::vector<int64_t> tiles;
    for (int64_t t : {256, 512}) {
      if (t >= sh.p) continue;
      tiles.push_back(t);
      cands.push_back([&, t] {
        set_symmetric_options(*be, {true, t, false});
        run();
      });
    }
    cands.push_back([&] {
      set_symmetric_options(*be, {true, 0, true});
      run();
    });
    if (runs)
      cands.push_back([&] {  // banded (R is full, which a banded read takes as well)
        if (sh.op == 0) dion3::cuda::launch_sym_wgmma(Xv, Xv, 1.0f, 0.0f, nullptr, 0.0f, Cv, s, false, true);
        else dion3::cuda::launch_sym_wgmma(Rv, Rv, 2.0f, -1.0f, &Rv, 0.0f, Cv, s, true, true);
      });
    if (runs)
      cands.push_back([&] {
        if (sh.op == 0) dion3::cuda::launch_sym_wgmma(Xv, Xv, 1.0f, 0.0f, nullptr, 0.0f, Cv, s, false, false, true);
        else dion3::cuda::launch_sym_wgmma(Rv, Rv, 2.0f, -1.0f, &Rv, 0.0f, Cv, s, false, false, true);
      });
    if (runs)
      cands.push_back([&] {  // one CTA per tile
        set_symmetric_options(*be, {true, 0, true, false});
        run();
      });
    if (args.once) {  // for ncu: marker k (a grid of k blocks), then candidate k's kernels
      const std::size_t fused = 1 + tiles.size();  // full, fused, banded, main loop only
      const std::vector<std::size_t> picked =
          runs ? std::vector<std::size_t>{0, fused, fused + 1, fused + 2} : std::vector<std::size_t>{0, fused};
      for (std::size_t k = 0; k < picked.size(); ++k) {
        ncu_marker<<<static_cast<unsigned>(k + 1), 32, 0, s>>>();
        cands[picked[k]]();
      }
      CK(cudaStreamSynchronize(s));
      o.line(fmt("- %s: %s, once each", label.c_str(), runs ? "full, fused, banded, main loop only" : "full, fallback"));
      continue;
    }
    const std::vector<double> ms = bench::interleaved_medians(s, 2, iters, cands);
    const std::size_t k = 1 + tiles.size();  // full, tiles..., fused, banded, main loop only, one CTA per tile
    const double full = ms[0], kern = ms[k], banded = runs ? ms[k + 1] : 0.0, mainloop = runs ? ms[k + 2] : 0.0;
    const double single = runs ? ms[k + 3] : 0.0;
    double tiled = 1e30;
    int64_t best_tile = 0;
    for (std::size_t c = 0; c < tiles.size(); ++c)
      if (ms[1 + c] < tiled) {
        tiled = ms[1 + c];
        best_tile = tiles[c];
      }
    o.line(fmt("| %s | %s | %lld | %lld | %lld | %.3f | %.0f | %.3f (%lld) | %.0f | %.3f%s | %.0f | %.2fx | %.2fx | "
               "%.3f (%.0f) | %.3f (%.0f) | %.3f (%.0f) |",
               sh.op == 0 ? "gram" : "sym_product", dtype_short(sh.dt), (long long)sh.b, (long long)sh.p, (long long)q,
               full,
               flops / full / 1e9, tiled, (long long)best_tile, real / tiled / 1e9, kern, runs ? "" : " (fallback)",
               real / kern / 1e9, full / kern, tiled / kern, banded, banded > 0 ? real / banded / 1e9 : 0.0, single,
               single > 0 ? real / single / 1e9 : 0.0, mainloop, mainloop > 0 ? real / mainloop / 1e9 : 0.0));
    if (pm) {
      // Calls in batches of about 20 ms, each batch waited for: the host's clock then reads the
      // GPU's, at a wait's cost every 20 ms.
      auto measure = [&](const char* name, std::size_t c) {
        const int reps = std::max(1, static_cast<int>(20.0 / std::max(ms[c], 1e-3)));
        bench::EnergyWindow e = bench::energy_window(*pm, args.energy_s, 0.5, [&] {
          for (int r = 0; r < reps; ++r) cands[c]();
          CK(cudaStreamSynchronize(s));
        });
        e.joules /= reps;
        e.ms /= reps;
        energy_rows.push_back({label, name, real, e});
      };
      measure("full cuBLAS GEMM", 0);
      measure(runs ? "fused" : "fallback", k);
      if (runs) measure("fused, no stores", k + 2);
    }
  }
  set_symmetric_options(*be, {true, 0, true});
  o.line("");
  if (!energy_rows.empty()) {
    o.line(fmt("## Energy a product (NVML's counter, each candidate back to back for %.1f s; enforced power limit %.0f W)",
               args.energy_s, pm->limit_w()));
    o.line("");
    o.line("J per TFLOP counts the lower triangles' b·p·(p+1)·q FLOPs for every candidate, so that the columns compare "
           "the energy of the same useful work. Under a power cap time follows energy: a candidate that spends less "
           "a product gets faster there.");
    o.line("");
    o.line("| shape | candidate | ms a call | mJ a call | J per TFLOP | mean W | SM MHz mean (min-max) | power cap held the "
           "clock |");
    o.line("|---|---|---|---|---|---|---|---|");
    for (const EnergyRow& r : energy_rows)
      o.line(fmt("| %s | %s | %.3f | %.2f | %.3f | %.0f | %.0f (%u-%u) | %.0f%% |", r.shape.c_str(), r.candidate.c_str(),
                 r.e.ms, r.e.joules * 1e3, r.e.joules / (r.real_flops * 1e-12), r.e.joules / r.e.ms * 1e3,
                 r.e.clocks.mean_mhz, r.e.clocks.min_mhz, r.e.clocks.max_mhz, 100 * r.e.clocks.power_capped));
    o.line("");
  }
  o.line(fmt("correctness failures: %d", failures));
  session.save();
  return failures == 0 ? 0 : 1;
}
