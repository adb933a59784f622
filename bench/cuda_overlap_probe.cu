// bench/cuda_overlap_probe.cu — dion3-cuda-overlap-probe: would a step gain from running two
// megabatches' work on two streams? Times pairs of gpt-1b Dion3 f = 1/4 workloads, each pair
// one after the other and side by side (fork/join through events, the second stream at normal,
// low and high priority): Gram NS chains at p = 512 (64 x 512 x 2048 and 16 x 512 x 8192),
// standard NS on 16 x 2048 x 2048, and a memory-bound stand-in (a device copy of the bytes one
// megabatch's accumulate moves). Then the products held to fewer multiprocessors
// (set_product_sm_limit) with a memory pass on the rest: can a memory-bound pass hide under the
// orthogonalization when it gets SMs of its own? Interleaved CUDA-event medians; markdown on
// stdout and --out. --only pairs|halves|partition runs one section.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cuda_bench_common.cuh"
#include "cuda/cuda_backend.hpp"
#include "dion3/backend.hpp"
#include "dion3/orthogonalize.hpp"

namespace {

using dion3::DType;
using dion3::MatrixView;

struct Work {
  std::string name;
  std::function<void()> run;  // enqueues on its backend's current stream
};

using bench::orth_config;

__device__ uint4 decay_add8(uint4 m, uint4 g, float decay) {
  uint4 r;
  const auto* mv = reinterpret_cast<const __nv_bfloat162*>(&m);
  const auto* gv = reinterpret_cast<const __nv_bfloat162*>(&g);
  auto* rv = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const float2 a = __bfloat1622float2(mv[h]), b = __bfloat1622float2(gv[h]);
    rv[h] = __floats2bfloat162_rn(fmaf(decay, a.x, b.x), fmaf(decay, a.y, b.y));
  }
  return r;
}

// The accumulate pass's bytes (m = decay·m + g, bf16; n 16-byte words each) on exactly gridDim.x
// multiprocessors: one 1024-thread block per SM (its shared memory request keeps a second block
// and any orthogonalization CTA off that SM), four loads of g and of m in flight per thread.
constexpr int kPassSmem = 120 * 1024;
__global__ void __launch_bounds__(1024, 1) memory_pass_kernel(const uint4* __restrict__ g, uint4* __restrict__ m,
                                                              std::size_t n, float decay) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 gv[4], mv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      gv[u] = g[i + u * stride];
      mv[u] = m[i + u * stride];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) m[i + u * stride] = decay_add8(mv[u], gv[u], decay);
  }
  for (; i < n; i += stride) m[i] = decay_add8(m[i], g[i], decay);
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Args args = bench::parse_args(argc, argv, "dion3-cuda-overlap-probe");
  bench::Out o;
  bench::device_line(o);
  int least = 0, greatest = 0;
  CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t sa, sb_normal, sb_low, sb_high;
  CK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&sb_normal, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithPriority(&sb_low, cudaStreamNonBlocking, least));
  CK(cudaStreamCreateWithPriority(&sb_high, cudaStreamNonBlocking, greatest));
  std::unique_ptr<dion3::Backend> be_a = dion3::make_cuda_backend(0, sa);
  std::unique_ptr<dion3::Backend> be_b = dion3::make_cuda_backend(0, sb_normal);

  // Inputs in bf16 as the step gathers them (k x n, k <= n), one per workload.
  struct Input {
    dion3::DeviceBuffer buf;
    MatrixView view;
  };
  auto input = [&](dion3::Backend& be, int64_t b, int64_t p, int64_t q, uint64_t seed) {
    Input in{dion3::DeviceBuffer(be.allocator(), b * p * q * 2), {}};
    in.view = MatrixView::contiguous(in.buf.get(), DType::BF16, b, p, q);
    bench::fill(in.buf.get(), DType::BF16, b * p * q, seed, 1.0f, sa);
    return in;
  };
  Input x1 = input(*be_a, 64, 512, 2048, 1), x3 = input(*be_a, 16, 2048, 2048, 3);
  Input x2 = input(*be_b, 16, 512, 8192, 2);
  dion3::Orthogonalizer g1(*be_a, orth_config(dion3::OrthMethod::Gram, DType::F16), 64, 512, 2048);
  dion3::Orthogonalizer s3(*be_a, orth_config(dion3::OrthMethod::Standard, DType::BF16), 16, 2048, 2048);
  dion3::Orthogonalizer g2(*be_b, orth_config(dion3::OrthMethod::Gram, DType::F16), 16, 512, 8192);
  const std::size_t copy_bytes = std::size_t{268435456} * 2;  // one megabatch's momentum, bf16
  dion3::DeviceBuffer c_src(be_b->allocator(), copy_bytes), c_dst(be_b->allocator(), copy_bytes);
  CK(cudaMemsetAsync(c_src.get(), 0, copy_bytes, sa));
  CK(cudaStreamSynchronize(sa));

  cudaStream_t sb = sb_normal;
  auto section = [&](const std::string& key) { return args.only.empty() || key.find(args.only) != std::string::npos; };
  const Work w1{"Gram NS 64x512x2048", [&] { g1.run(x1.view); }};
  const Work w3{"standard NS 16x2048x2048", [&] { s3.run(x3.view); }};
  const Work w2{"Gram NS 16x512x8192", [&] { g2.run(x2.view); }};
  const Work wm{"copy 0.54 GB", [&] { CK(cudaMemcpyAsync(c_dst.get(), c_src.get(), copy_bytes, cudaMemcpyDeviceToDevice, sb)); }};

  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  auto on_b = [&](cudaStream_t s) {
    sb = s;
    be_b->set_stream(s);
  };
  // a on stream A, b on stream B; `together`: b starts with a, else after it. Joined back on A.
  auto pair = [&](const Work& a, const Work& b, cudaStream_t s, bool together) {
    return [&, s, together] {
      on_b(s);
      if (together) {
        CK(cudaEventRecord(fork, sa));
        CK(cudaStreamWaitEvent(s, fork));
        a.run();
        b.run();
      } else {
        a.run();
        CK(cudaEventRecord(fork, sa));
        CK(cudaStreamWaitEvent(s, fork));
        b.run();
      }
      CK(cudaEventRecord(join, s));
      CK(cudaStreamWaitEvent(sa, join));
    };
  };
  auto alone = [&](const Work& w, bool is_b) {
    return [&, is_b] {
      if (!is_b) {
        w.run();
        return;
      }
      on_b(sb_normal);
      CK(cudaEventRecord(fork, sa));
      CK(cudaStreamWaitEvent(sb_normal, fork));
      w.run();
      CK(cudaEventRecord(join, sb_normal));
      CK(cudaStreamWaitEvent(sa, join));
    };
  };

  o.line("## Two workloads on two streams (ms, medians of " + std::to_string(args.iters) + ", interleaved)");
  o.line("");
  o.line("| A | B | A alone | B alone | one after the other | side by side | B low priority | B high priority | "
         "best side by side / one after the other |");
  o.line("|---|---|---|---|---|---|---|---|---|");
  const std::vector<std::pair<const Work*, const Work*>> pairs = {{&w1, &w2}, {&w3, &w2}, {&w3, &wm}, {&w1, &wm}};
  for (const auto& [a, b] : section("pairs") ? pairs : decltype(pairs){}) {
    const std::vector<double> t = bench::interleaved_medians(
        sa, 2, args.iters,
        {alone(*a, false), alone(*b, true), pair(*a, *b, sb_normal, false), pair(*a, *b, sb_normal, true),
         pair(*a, *b, sb_low, true), pair(*a, *b, sb_high, true)});
    const double best = std::min({t[3], t[4], t[5]});
    o.line(bench::fmt("| %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2fx |", a->name.c_str(), b->name.c_str(),
                      t[0], t[1], t[2], t[3], t[4], t[5], best / t[2]));
  }

  // One megabatch's chunk split in two halves, each on its own stream and its own half of the
  // workspace (the same bytes as the whole chunk): the halves side by side against the whole.
  o.line("");
  o.line("## One batch against its two halves on two streams (ms, medians of " + std::to_string(args.iters) + ")");
  o.line("");
  o.line("| batch | method | whole | halves one after the other | halves side by side | side by side / whole |");
  o.line("|---|---|---|---|---|---|");
  struct Split { int64_t b, p, q; dion3::OrthMethod m; DType dt; const char* name; };
  const std::vector<Split> splits = {
      {64, 512, 2048, dion3::OrthMethod::Gram, DType::F16, "Gram fp16"},
      {16, 512, 8192, dion3::OrthMethod::Gram, DType::F16, "Gram fp16"},
      {16, 2048, 2048, dion3::OrthMethod::Standard, DType::BF16, "standard bf16"},
      {128, 1024, 4096, dion3::OrthMethod::Gram, DType::F16, "Gram fp16"},
      {32, 1024, 11008, dion3::OrthMethod::Gram, DType::F16, "Gram fp16"},
      {16, 2752, 4096, dion3::OrthMethod::Gram, DType::F16, "Gram fp16"}};
  on_b(sb_normal);
  for (const Split& sp : section("halves") ? splits : std::vector<Split>{}) {
    Input whole_in = input(*be_a, sp.b, sp.p, sp.q, 11);
    const int64_t h = sp.b / 2;
    MatrixView lo = whole_in.view, hi = whole_in.view;
    lo.batch = hi.batch = h;
    hi.data = static_cast<char*>(whole_in.buf.get()) + static_cast<std::size_t>(h * sp.p * sp.q) * 2;
    dion3::Orthogonalizer whole(*be_a, orth_config(sp.m, sp.dt), sp.b, sp.p, sp.q);
    dion3::Orthogonalizer half_a(*be_a, orth_config(sp.m, sp.dt), h, sp.p, sp.q);
    dion3::Orthogonalizer half_b(*be_b, orth_config(sp.m, sp.dt), h, sp.p, sp.q);
    CK(cudaDeviceSynchronize());
    const Work wa{"a", [&] { half_a.run(lo); }}, wb{"b", [&] { half_b.run(hi); }};
    const std::vector<double> t = bench::interleaved_medians(
        sa, 2, args.iters, {[&] { whole.run(whole_in.view); }, pair(wa, wb, sb_normal, false), pair(wa, wb, sb_normal, true)});
    o.line(bench::fmt("| (%lld, %lld, %lld) | %s | %.3f | %.3f | %.3f | %.2fx |", static_cast<long long>(sp.b),
                      static_cast<long long>(sp.p), static_cast<long long>(sp.q), sp.name, t[0], t[1], t[2], t[2] / t[0]));
    CK(cudaDeviceSynchronize());
  }
  if (section("partition")) {
    // The products on sms - r multiprocessors (stream A) beside a memory pass on r (stream B),
    // against both on every SM one after the other: the largest orthogonalization chunk of each
    // model set with its megabatch chunk's accumulate bytes.
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute(memory_pass_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPassSmem));
    o.line("");
    o.line("## The products on fewer multiprocessors, a memory pass on the rest (ms, medians of " +
           std::to_string(args.iters) + ")");
    o.line("");
    o.line("Pass: m = decay·m + g over bf16 arrays (read g and m, write m), one 1024-thread block per SM. "
           "GB/s: its bytes over its time.");
    o.line("");
    o.line("| orthogonalization | pass GB | r | orth on sms - r | pass on r (GB/s) | side by side | "
           "orth then pass, all SMs | side by side / one after the other |");
    o.line("|---|---|---|---|---|---|---|---|");
    struct Part { int64_t b, p, q; dion3::OrthMethod m; DType dt; const char* name; int64_t pass_elems; };
    const std::vector<Part> parts = {
        {16, 2048, 2048, dion3::OrthMethod::Standard, DType::BF16, "standard NS bf16 16x2048x2048",
         int64_t{16} * 8192 * 2048},
        {16, 2752, 4096, dion3::OrthMethod::Gram, DType::F16, "Gram NS fp16 16x2752x4096", int64_t{16} * 11008 * 4096}};
    on_b(sb_normal);
    for (const Part& pt : parts) {
      Input x = input(*be_a, pt.b, pt.p, pt.q, 21);
      // Limited and whole-GPU runs on two backends of stream A, each limit set once per r: changing
      // a backend's limit drops its recordings, which the timed runs would then make again.
      std::unique_ptr<dion3::Backend> be_lim = dion3::make_cuda_backend(0, sa);
      dion3::Orthogonalizer orth(*be_lim, orth_config(pt.m, pt.dt), pt.b, pt.p, pt.q);
      dion3::Orthogonalizer orth_all(*be_a, orth_config(pt.m, pt.dt), pt.b, pt.p, pt.q);
      const std::size_t words = static_cast<std::size_t>(pt.pass_elems) / 8;
      dion3::DeviceBuffer g(be_b->allocator(), words * 16), m(be_b->allocator(), words * 16);
      CK(cudaMemsetAsync(g.get(), 0, words * 16, sa));
      CK(cudaMemsetAsync(m.get(), 0, words * 16, sa));
      CK(cudaStreamSynchronize(sa));
      const double gb = 3.0 * static_cast<double>(words) * 16 / 1e9;
      auto pass = [&](int blocks, cudaStream_t s) {
        memory_pass_kernel<<<blocks, 1024, kPassSmem, s>>>(static_cast<const uint4*>(g.get()),
                                                          static_cast<uint4*>(m.get()), words, 0.95f);
        CK(cudaGetLastError());
      };
      for (const int r : {8, 16, 24, 32, 48}) {
        dion3::cuda::set_product_sm_limit(*be_lim, sms - r);
        const Work wo{"orth", [&] { orth.run(x.view); }};
        const Work wp{"pass", [&, r] { pass(r, sb); }};
        const Work wo_all{"orth all", [&] { orth_all.run(x.view); }};
        const Work wp_all{"pass all", [&] { pass(sms, sb); }};
        const std::vector<double> t = bench::interleaved_medians(
            sa, 2, args.iters, {alone(wo, false), alone(wp, true), pair(wo, wp, sb_normal, true), pair(wo_all, wp_all, sb_normal, false)});
        o.line(bench::fmt("| %s | %.2f | %d | %.3f | %.3f (%.0f) | %.3f | %.3f | %.2fx |", pt.name, gb, r, t[0], t[1],
                          gb / t[1] * 1e3, t[2], t[3], t[2] / t[3]));
      }
      const std::vector<double> t = bench::interleaved_medians(sa, 2, args.iters, {[&] { pass(sms, sa); }});
      o.line(bench::fmt("| (the pass alone on all %d SMs) | %.2f | 0 | | %.3f (%.0f) | | | |", sms, gb, t[0], gb / t[0] * 1e3));
      CK(cudaDeviceSynchronize());
    }
  }
  CK(cudaStreamSynchronize(sa));
  if (!args.out_path.empty()) std::ofstream(args.out_path) << o.md.str();
  return 0;
}
