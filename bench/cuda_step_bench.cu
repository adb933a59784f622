// bench/cuda_step_bench.cu — dion3-cuda-step-bench: optimizer step time of the CUDA backend on
// model-shaped parameter sets (bench/model_shapes: gpt-1b, llama-7b), with weights and
// gradients filled on the device (a 7B set is too large to fill from the host quickly).
// Rows: AdamW, Lion, Muon as issue 3 defines its baseline (standard NS in bf16 on full cuBLAS
// GEMMs), Muon, NorMuon, Dion3 at f = 1, 1/2, 1/4, 1/8 (library defaults: auto method, symmetric
// kernels); each with its median step time, the ratios to both Muons and AdamW of the same run,
// a roofline floor (max of FLOPs really performed — the symmetric products counted by the tiles
// they compute, dion3::cuda::symmetric_flop_fraction — / 790 TFLOP/s and the bytes a step must
// move / 4.3 TB/s), the time from constructing the optimizer to the end of its first step, and the
// device memory it holds beyond its state.
// --profile: where the time of one step goes — per megabatch and phase (accumulate, select,
// gather, orthogonalization ops, update), timed with CUDA events around every backend op, with
// the achieved bandwidth of the memory-bound phases and their share of the device's copy bandwidth
// (measured in the same run); for several workspace limits and methods; with --transposed, of
// the weights stored (in, out) in a transposed group (stepped by columns).
// --energy-s S: after each row's timing, its steps again for S seconds under NVML's energy counter:
// joules a step, mean power against the enforced limit, the SM clock and how often the power cap
// held it.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_bench_common.cuh"
#include "profiling_backend.cuh"
#include "cuda/cuda_backend.hpp"
#include "dion3/backend.hpp"
#include "dion3/optimizer.hpp"
#include "dion3/orthogonalize.hpp"
#include "model_shapes.hpp"
#include "nvml_power.hpp"

namespace {

using bench::fmt;

struct Variant {
  std::string label;
  dion3::Algorithm algo;
  double fraction;
  // Issue 3's Muon baseline: standard NS in bf16 on full cuBLAS GEMMs (no Gram NS, no symmetric
  // kernels); the other rows use the library's defaults (auto method, symmetric kernels).
  bool plain_cublas = false;
  // Optimizer::state_changed() before every step, as after a caller writes the state: the non-finite
  // check reads all the momentum (the bound on it is forgotten), and the step first reads the
  // written second moments back to the host to check them.
  bool exact_check = false;
  // With exact_check, state_changed(0) instead: the bounds forgotten alike, one parameter's second
  // moment read back (what the row costs beyond the forgotten bounds is the read-back).
  bool one_written = false;
  // The weights stored (in, out) in a transposed group: Dion3 steps them by columns.
  bool transposed = false;
};

// Registers every matrix of `shapes` in group g: bf16 weights W[i] and gradients G[i] on the GPU,
// stored (cols, rows) when `transposed`.
void add_matrices(dion3::Optimizer& opt, int g, const std::vector<dion3::bench::MatrixShape>& shapes,
                  const std::vector<void*>& W, const std::vector<void*>& G, bool transposed = false) {
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    dion3::ParamSpec spec;
    spec.name = shapes[i].name;
    const std::vector<int64_t> shape = transposed ? std::vector<int64_t>{shapes[i].cols, shapes[i].rows}
                                                  : std::vector<int64_t>{shapes[i].rows, shapes[i].cols};
    spec.weight = {W[i], dion3::DType::BF16, dion3::Device::CUDA, 0, shape};
    spec.grad = {G[i], dion3::DType::BF16, dion3::Device::CUDA, 0, shape};
    opt.add_param(g, spec);
  }
}

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
  double energy_s = 0;
  std::string out_path;
  std::string only;  // --only LABEL: just the optimizer rows whose label contains LABEL (=LABEL: is LABEL)
  bool profile = false, prof_transposed = false;
  std::vector<double> prof_fractions = {0.25};
  std::vector<std::size_t> prof_ws_mib = {512};
  std::vector<std::string> prof_methods = {"auto"};
  auto split = [](const std::string& list) {
    std::vector<std::string> out;
    std::stringstream ss(list);
    for (std::string item; std::getline(ss, item, ',');)
      if (!item.empty()) out.push_back(item);
    return out;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--profile") { profile = true; continue; }
    if (a == "--transposed") { prof_transposed = true; continue; }
    if (a == "--fractions" && i + 1 < argc) {
      prof_fractions.clear();
      for (auto& x : split(argv[++i])) prof_fractions.push_back(std::atof(x.c_str()));
      continue;
    }
    if (a == "--workspace-mib" && i + 1 < argc) {
      prof_ws_mib.clear();
      for (auto& x : split(argv[++i])) prof_ws_mib.push_back(std::strtoull(x.c_str(), nullptr, 10));
      continue;
    }
    if (a == "--methods" && i + 1 < argc) { prof_methods = split(argv[++i]); continue; }
    if (a == "--model" && i + 1 < argc) models = {argv[++i]};
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc) warmup = std::atoi(argv[++i]);
    else if (a == "--energy-s" && i + 1 < argc && std::atof(argv[i + 1]) > 0) energy_s = std::atof(argv[++i]);
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else {
      std::fprintf(stderr, "usage: dion3-cuda-step-bench [--model NAME] [--iters N] [--warmup N] [--out FILE] [--only LABEL or =LABEL]\n"
                           "       [--energy-s S]\n"
                           "       [--profile [--fractions 0.25,...] [--workspace-mib 512,...] [--methods auto,gram,standard]\n"
                           "                  [--transposed]]\n");
      return 2;
    }
  }
  std::ostringstream md;
  auto line = [&](const std::string& s) {
    std::printf("%s\n", s.c_str());
    std::fflush(stdout);
    md << s << "\n";
  };
  struct EnergyRow {
    std::string label;
    bench::EnergyWindow e;
  };
  std::vector<EnergyRow> energy_rows;
  std::unique_ptr<bench::PowerMeter> pm;
  double limit_w = 0;
  if (energy_s > 0) {
    pm = bench::open_power_meter("dion3-cuda-step-bench");
    limit_w = pm->limit_w();
  }
  const std::vector<Variant> variants = {{"AdamW", dion3::Algorithm::AdamW, 1.0},
                                         {"Lion", dion3::Algorithm::Lion, 1.0},
                                         {"Muon, std NS on cuBLAS", dion3::Algorithm::Muon, 1.0, true},
                                         {"Muon", dion3::Algorithm::Muon, 1.0},
                                         {"NorMuon", dion3::Algorithm::NorMuon, 1.0},
                                         {"Dion3 f=1", dion3::Algorithm::Dion3, 1.0},
                                         {"Dion3 f=1/2", dion3::Algorithm::Dion3, 0.5},
                                         {"Dion3 f=1/4", dion3::Algorithm::Dion3, 0.25},
                                         {"Dion3 f=1/8", dion3::Algorithm::Dion3, 0.125},
                                         {"Dion3 f=1/4, after state_changed", dion3::Algorithm::Dion3, 0.25, false, true},
                                         {"Dion3 f=1/8, after state_changed", dion3::Algorithm::Dion3, 0.125, false, true},
                                         {.label = "Dion3 f=1/4, after state_changed(0)",
                                          .algo = dion3::Algorithm::Dion3,
                                          .fraction = 0.25,
                                          .exact_check = true,
                                          .one_written = true},
                                         {.label = "Dion3 f=1/4, stored (in, out)",
                                          .algo = dion3::Algorithm::Dion3,
                                          .fraction = 0.25,
                                          .transposed = true}};
  for (const std::string& model : models) {
    const auto shapes = dion3::bench::model_matrices(dion3::bench::find_preset(model), 0);
    const int64_t total = dion3::bench::total_elements(shapes);
    std::vector<void*> W, G;
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const int64_t n = shapes[i].rows * shapes[i].cols;
      void *w, *g;
      CK(cudaMalloc(&w, n * 2));
      CK(cudaMalloc(&g, n * 2));
      bench::fill(w, dion3::DType::BF16, n, 2 * i + 1, 0.04f, nullptr);
      bench::fill(g, dion3::DType::BF16, n, 2 * i + 2, 2e-3f, nullptr);
      W.push_back(w);
      G.push_back(g);
    }
    CK(cudaDeviceSynchronize());
    if (profile) {
      const double copy_gbs = bench::copy_bandwidth_gbs(nullptr);
      line(fmt("Copy bandwidth (1 GiB device-to-device, read + written): %.0f GB/s; the phases' share of it is "
               "in the 'all' row of each table.",
               copy_gbs));
      line("");
      for (double frac : prof_fractions)
        for (std::size_t ws : prof_ws_mib)
          for (const std::string& meth : prof_methods) {
            dion3::OptimizerOptions oo;
            oo.workspace_limit = ws << 20;
            auto pb_owned = std::make_unique<bench::ProfilingBackend>(dion3::make_cuda_backend(0));
            bench::ProfilingBackend* pb = pb_owned.get();
            dion3::Optimizer opt(std::move(pb_owned), oo);
            dion3::GroupConfig cfg;
            cfg.algorithm = dion3::Algorithm::Dion3;
            cfg.fraction = frac;
            if (meth == "gram") cfg.orth.method = dion3::OrthMethod::Gram;
            else if (meth == "standard") cfg.orth.method = dion3::OrthMethod::Standard;
            cfg.transposed = prof_transposed;
            add_matrices(opt, opt.add_group(cfg), shapes, W, G, prof_transposed);
            for (int i = 0; i < 2; ++i) opt.step();
            std::vector<double> t;
            for (int i = 0; i < iters; ++i) {
              const auto a = std::chrono::steady_clock::now();
              opt.step();
              t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
            }
            std::sort(t.begin(), t.end());
            const double step_ms = t[t.size() / 2];
            pb->enabled = true;
            const int prof_steps = 3;
            for (int i = 0; i < prof_steps; ++i) {
              opt.step();
              pb->collect();
            }
            pb->enabled = false;
            double sum_ms = 0;
            for (auto& [key, ms] : pb->totals) sum_ms += ms / prof_steps;
            line(fmt("### Where the time goes: %s Dion3 f=%g, workspace limit %zu MiB, method %s%s", model.c_str(), frac,
                     ws, meth.c_str(), prof_transposed ? ", stored (in, out)" : ""));
            line("");
            line(fmt("Step %.2f ms (median of %d, unprofiled); the profiled ops sum to %.2f ms (mean of %d steps; "
                     "events around every backend op). GB/s: bytes each phase must move (bf16 W/G/M and U, O in "
                     "the iteration dtype) over its time.",
                     step_ms, iters, sum_ms, prof_steps));
            line("");
            line("| megabatch | n | k | method | chunk | accumulate ms (GB/s) | select | gather ms (GB/s) | orth ms | "
                 "update ms (GB/s) | refresh |");
            line("|---|---|---|---|---|---|---|---|---|---|---|");
            auto gbs = [](double bytes, double ms) { return ms > 0 ? bytes / (ms * 1e6) : 0.0; };
            auto get = [&](const std::string& sh, const std::string& op) {
              auto it = pb->totals.find({sh, op});
              return it == pb->totals.end() ? 0.0 : it->second / prof_steps;
            };
            const char* orth_ops[] = {"orth.normalize", "orth.transpose", "orth.convert", "orth.gram",
                                      "orth.sym_product", "orth.gemm", "orth.copy", "orth.add_identity"};
            std::ostringstream orth_tab;
            double tot[6] = {0, 0, 0, 0, 0, 0};
            double moved[3] = {0, 0, 0};  // bytes of accumulate, gather, update over all megabatches
            double check_bytes = 0;       // check_step reads every bf16 gradient and momentum once
            for (const auto& m : opt.plan()) {
              const std::string sh = fmt("%lldx%lld", (long long)m.rows, (long long)m.cols);
              const double n = m.count, R = m.rows, C = m.cols, K = m.selected_rows;
              const double acc = get(sh, "accumulate"), sel = get(sh, "select"), gat = get(sh, "gather"),
                           upd = get(sh, "update"), ref = get(sh, "refresh");
              double orth = 0;
              std::string ops;
              for (const char* o : orth_ops) {
                orth += get(sh, o);
                ops += fmt(" %.2f |", get(sh, o));
              }
              // accumulate: G read, M read and written; gather: M rows read and rescaled, U (bf16)
              // written; update: W read and written (all rows), O read twice (NorMuon row sums,
              // update) in its dtype.
              const double o_bytes = static_cast<double>(dion3::dtype_size(m.iteration_dtype));
              const double b_acc = n * R * C * 6, b_gat = n * K * C * 6, b_upd = n * R * C * 4 + n * K * C * 2 * o_bytes;
              line(fmt("| %s | %lld | %lld | %s | %lld | %.2f (%.0f) | %.2f | %.2f (%.0f) | %.2f | %.2f (%.0f) | %.2f |",
                       sh.c_str(), (long long)m.count, (long long)m.selected_rows,
                       m.method == dion3::OrthMethod::Gram ? "gram" : "standard", (long long)m.chunk, acc,
                       gbs(b_acc, acc), sel, gat, gbs(b_gat, gat), orth, upd, gbs(b_upd, upd), ref));
              orth_tab << fmt("| %s |%s\n", sh.c_str(), ops.c_str());
              tot[0] += acc; tot[1] += sel; tot[2] += gat; tot[3] += orth; tot[4] += upd; tot[5] += ref;
              check_bytes += n * R * C * 4;
              moved[0] += b_acc;
              moved[1] += b_gat;
              moved[2] += b_upd;
            }
            auto share = [&](double bytes, double ms) { return 100.0 * gbs(bytes, ms) / copy_gbs; };
            line(fmt("| all (share of copy bandwidth) | | | | | %.2f (%.0f%%) | %.2f | %.2f (%.0f%%) | %.2f | %.2f (%.0f%%) | %.2f |",
                     tot[0], share(moved[0], tot[0]), tot[1], tot[2], share(moved[1], tot[2]), tot[3], tot[4],
                     share(moved[2], tot[4]), tot[5]));
            const double check_ms = get("all", "check_step");
            line(fmt("| (check_step %.2f (%.0f%%), other %.2f) | | | | | | | | | | |", check_ms,
                     share(check_bytes, check_ms), get("all", "other")));
            line("");
            line("| megabatch | normalize | transpose | convert | gram | sym_product | gemm | copy | add_identity |");
            line("|---|---|---|---|---|---|---|---|---|");
            std::string ot = orth_tab.str();
            if (!ot.empty()) ot.pop_back();
            line(ot);
            line("");
            // For tools/sym-ncu.py: the shapes to profile, as dion3-cuda-sym-bench --shapes takes them.
            std::string listed;
            for (const auto& [shape, count] : pb->products)
              listed += fmt("%s%s", listed.empty() ? "" : ",", shape.c_str());
            line(fmt("Symmetric products of one step (x%d steps recorded): `%s`", prof_steps, listed.c_str()));
            for (const auto& [shape, count] : pb->products) line(fmt("- %s: %d per step", shape.c_str(), count / prof_steps));
            line("");
          }
      for (void* p : W) cudaFree(p);
      for (void* p : G) cudaFree(p);
      continue;
    }
    line(fmt("## Optimizer step, %s (%zu matrices, %.2fB weights, bf16 weights/grads/momentum), median of %d steps",
             model.c_str(), shapes.size(), total / 1e9, iters));
    line("");
    line("| optimizer | step ms | vs Muon | vs Muon std NS cuBLAS | vs AdamW | floor ms (flop / byte) | step / floor | "
         "construct→1st step s | workspace beyond state GiB | methods |");
    line("|---|---|---|---|---|---|---|---|---|---|");
    double muon_ms = 0, plain_muon_ms = 0, adamw_ms = 0;
    for (const Variant& v : variants) {
      if (only.starts_with('=') ? v.label != only.substr(1) : v.label.find(only) == std::string::npos) continue;
      const double base = used_bytes();
      const auto t0 = std::chrono::steady_clock::now();
      double first_s = 0, median_ms = 0, beyond = 0, flops = 0;
      std::string methods;
      {
        dion3::Optimizer opt(dion3::make_cuda_backend(0));
        dion3::GroupConfig cfg;
        cfg.algorithm = v.algo;
        cfg.fraction = v.fraction;
        cfg.transposed = v.transposed;
        if (v.plain_cublas) {
          dion3::cuda::set_symmetric_options(opt.backend(), {false, 0, false});
          cfg.orth.method = dion3::OrthMethod::Standard;
          cfg.orth.iteration_dtype = dion3::DType::BF16;
        }
        add_matrices(opt, opt.add_group(cfg), shapes, W, G, v.transposed);
        opt.step();
        first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double after = used_bytes();
        // State: momentum (bf16) + variance (fp32 per row) for NorMuon and Dion3; AdamW two bf16
        // moments; Muon and Lion one.
        double state = 0;
        for (const auto& s : shapes)
          state += v.algo == dion3::Algorithm::AdamW                                          ? 4.0 * s.rows * s.cols
                   : v.algo == dion3::Algorithm::Muon || v.algo == dion3::Algorithm::Lion ? 2.0 * s.rows * s.cols
                                                                                          : 2.0 * s.rows * s.cols + 4.0 * s.rows;
        beyond = (after - base - state) / (1024.0 * 1024 * 1024);
        for (const auto& m : opt.plan()) {
          if (!dion3::is_matrix_algorithm(m.algorithm)) continue;
          const int64_t p = std::min(m.selected_rows, m.cols), q = std::max(m.selected_rows, m.cols);
          // The symmetric products' FLOPs as performed (their tiles), not the cost model's factor.
          const double sym = dion3::cuda::symmetric_flop_fraction(opt.backend(), p);
          flops += m.method == dion3::OrthMethod::Gram ? dion3::gram_ns_flops(m.count, p, q, 5, 1, sym)
                                                       : dion3::standard_ns_flops(m.count, p, q, 5, sym);
          methods += fmt("%s%lldx%lld:%s", methods.empty() ? "" : " ", (long long)m.selected_rows, (long long)m.cols,
                         m.method == dion3::OrthMethod::Gram ? "G" : "S");
        }
        for (int i = 0; i < warmup; ++i) {
          if (v.exact_check) v.one_written ? opt.state_changed(0) : opt.state_changed();
          opt.step();
        }
        std::vector<double> t;
        for (int i = 0; i < iters; ++i) {
          if (v.exact_check) v.one_written ? opt.state_changed(0) : opt.state_changed();  // memsets enqueued before the step
          const auto a = std::chrono::steady_clock::now();
          opt.step();  // ends with the one host synchronisation of the non-finite verdict
          t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
        }
        std::sort(t.begin(), t.end());
        median_ms = t[t.size() / 2];
        if (energy_s > 0) {
          // Each step ends with the host synchronisation of its verdict: host time is GPU time.
          energy_rows.push_back({v.label, bench::energy_window(*pm, energy_s, 1.0, [&] {
                                   if (v.exact_check) v.one_written ? opt.state_changed(0) : opt.state_changed();
                                   opt.step();
                                 })});
        }
      }
      // Bytes a step must move: read G, read+write M and W (bf16; Lion too); AdamW: G, W, two moments.
      const double bytes = (v.algo == dion3::Algorithm::AdamW ? 7.0 : 5.0) * 2.0 * static_cast<double>(total);
      const double floor_flop = flops / 790e12 * 1e3, floor_byte = bytes / 4.3e12 * 1e3;
      const double floor_ms = std::max(floor_flop, floor_byte);
      if (v.algo == dion3::Algorithm::Muon) (v.plain_cublas ? plain_muon_ms : muon_ms) = median_ms;
      if (v.algo == dion3::Algorithm::AdamW) adamw_ms = median_ms;
      line(fmt("| %s | %.2f | %s | %s | %s | %.2f (%.2f / %.2f) | %.2fx | %.2f | %.2f | %s |", v.label.c_str(), median_ms,
               muon_ms > 0 ? fmt("%.2fx faster", muon_ms / median_ms).c_str() : "-",
               plain_muon_ms > 0 ? fmt("%.2fx faster", plain_muon_ms / median_ms).c_str() : "-",
               adamw_ms > 0 ? fmt("%.2fx", median_ms / adamw_ms).c_str() : "-", floor_ms, floor_flop, floor_byte,
               median_ms / floor_ms, first_s, beyond, methods.c_str()));
    }
    line("");
    if (!energy_rows.empty()) {
      line(fmt("Energy: each row's steps again back to back for %.1f s (NVML's energy counter; enforced power limit "
               "%.0f W). A row near the limit is held by power: it gets faster only by spending less energy a step.",
               energy_s, limit_w));
      line("");
      line("| optimizer | ms a step | J a step | mean W | SM MHz mean (min-max) | power cap held the clock |");
      line("|---|---|---|---|---|---|");
      for (const auto& [label, e] : energy_rows)
        line(fmt("| %s | %.2f | %.3f | %.0f | %.0f (%u-%u) | %.0f%% |", label.c_str(), e.ms, e.joules,
                 e.joules / e.ms * 1e3, e.clocks.mean_mhz, e.clocks.min_mhz, e.clocks.max_mhz,
                 100 * e.clocks.power_capped));
      line("");
      energy_rows.clear();
    }
    for (void* p : W) cudaFree(p);
    for (void* p : G) cudaFree(p);
  }
  if (!out_path.empty()) std::ofstream(out_path) << md.str();
  return 0;
}
