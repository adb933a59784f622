// bench/cuda_cutlass_bench.cu — dion3-cuda-cutlass-bench: can CUTLASS's sm_90 building blocks do
// the symmetric products (gram C = X·Xᵀ, sym_product C = 2·R·R − R) at least as well as the
// hand-written fused kernel (sym_wgmma.cu)? Same inputs, timed in turn:
//   cuBLAS     one full strided-batched GEMM (no mirror): the rate a tuned full GEMM reaches (for
//              sym_product after copying D into C, which its in-place beta needs);
//   fused      the library's symmetric path as the step runs it (fused kernel where it applies);
//   CUTLASS    CUTLASS's warp-specialized persistent GEMM (TMA, cooperative, 256 x 128 x 64 tiles)
//              over every tile, with clusters of 1 x 2 and of one CTA;
//   triangle   the same kernel over the tiles that touch the lower triangle only (a tile scheduler
//              of our own), then the library's mirror pass; also timed without the mirror;
//   sym        the triangle kernel whose epilogue also stores each tile's mirror (an aux store with
//              a column-major stride onto C): all of C in one kernel, as the fused one writes it
//              (its diagonal blocks computed whole, not mirrored);
//              cooperative (256 x 128 tiles) and pingpong (128 x 128, one math warp group's
//              epilogue under the other's main loop);
//   banded     the fused kernel writing C banded (no mirror outside the diagonal blocks), the
//              fair match for the triangle kernel alone.
// Each row checks every candidate that writes a whole C against cuBLAS (C poisoned with NaN
// beforehand; the errors in the last column) before timing them. CUTLASS kernels are set up once per
// shape, outside the timed calls (Runner). Built only with -DDION3_CUTLASS_INCLUDE=<dir> (the headers
// from tools/fetch-cutlass). --once launches each candidate once behind marker kernels (for ncu).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "cuda/kernels.cuh"
#include "cuda_bench_common.cuh"

// ---- the lower-triangle tile scheduler --------------------------------------------------------
// CUTLASS's static persistent scheduler walks every (m, n) tile of every batch; this one walks only
// the tiles that hold an element on or below the diagonal (row >= column), batch after batch, a
// row of tiles at a time. Clusters of one CTA only: a cluster's CTAs would need tiles that share
// their multicast operand, which a ragged triangle row does not always have. The kernels call the
// scheduler's members by name, so every member that reads the current tile is shadowed here (the
// base's own index is never used), and the swizzle stays 1 (the default arguments): a larger one
// pads the tile counts this walk reads.
namespace dion3_bench {

struct LowerTriangleScheduler {};  // the tag GemmUniversal takes

template <int TileM, int TileN>
class LowerTriangleSchedulerSm90 : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  static_assert(TileM % TileN == 0, "a row block's diagonal block is whole tiles");

 public:
  using Params = typename Base::Params;
  using WorkTileInfo = typename Base::WorkTileInfo;

  CUTLASS_HOST_DEVICE LowerTriangleSchedulerSm90() {}
  CUTLASS_DEVICE explicit LowerTriangleSchedulerSm90(Params const& params) : Base(params) {
#if defined(__CUDA_ARCH__)
    idx_ = uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x + uint64_t(blockIdx.z) * gridDim.x * gridDim.y;
    step_ = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
#endif
    tiles_m_ = static_cast<int>(params.problem_tiles_m_);
    tiles_n_ = static_cast<int>(params.problem_tiles_n_);
    batches_ = static_cast<int>(params.problem_tiles_l_);
    per_batch_ = 0;
    for (int i = 0; i < tiles_m_; ++i) per_batch_ += row_tiles(i);
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) { return get_current_work(); }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return work_for(idx_); }
  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) { idx_ += step_ * count; }
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const {
    return !work_for(idx_ + step_ * count).is_valid();
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w, Pipeline&, PipelineState) { return fetch_next_work(w); }

 private:
  // Tiles of row i with an element on or below the diagonal: columns 0 .. (last row of i) / TileN.
  CUTLASS_HOST_DEVICE int row_tiles(int i) const {
    const int last = (i * TileM + TileM - 1) / TileN + 1;
    return last < tiles_n_ ? last : tiles_n_;
  }
  CUTLASS_DEVICE WorkTileInfo work_for(uint64_t linear) const {
    if (linear >= uint64_t(per_batch_) * batches_) return WorkTileInfo::invalid_work_tile();
    const int l = static_cast<int>(linear / per_batch_);
    int t = static_cast<int>(linear % per_batch_), i = 0;
    while (t >= row_tiles(i)) t -= row_tiles(i++);
    return {i, t, l, true};
  }
  uint64_t idx_ = 0, step_ = 1;
  int tiles_m_ = 0, tiles_n_ = 0, batches_ = 0;
  int per_batch_ = 0;
};

}  // namespace dion3_bench

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<dion3_bench::LowerTriangleScheduler, arch::Sm90, TileShape, ClusterShape, Stages> {
  static_assert(cute::size(ClusterShape{}) == 1, "the lower-triangle scheduler takes clusters of one CTA");
  using Scheduler = dion3_bench::LowerTriangleSchedulerSm90<cute::size<0>(TileShape{}), cute::size<1>(TileShape{})>;
};
}  // namespace cutlass::gemm::kernel::detail

// ---- the mirrored store ------------------------------------------------------------------------
// An epilogue node that also stores each tile transposed (an aux store with a column-major stride
// onto C itself), except for tiles that reach into their row block's diagonal TileM x TileM block:
// the triangle scheduler computes those blocks whole, and a transposed store there would race with
// the tiles beside it. With it the triangle kernel writes all of C in one pass.
namespace dion3_bench {

template <int Stages, class EpilogueTile, class Element, cutlass::FloatRoundStyle Round, class StrideMNL,
          class SmemLayoutAtom, class CopyOpR2S, int TileM, int TileN>
struct MirrorStore
    : cutlass::epilogue::fusion::Sm90AuxStore<Stages, EpilogueTile, Element, Round, StrideMNL, SmemLayoutAtom,
                                              CopyOpR2S> {
  using Base = cutlass::epilogue::fusion::Sm90AuxStore<Stages, EpilogueTile, Element, Round, StrideMNL,
                                                       SmemLayoutAtom, CopyOpR2S>;
  using Base::Base;
  static_assert(TileM % TileN == 0, "a row block's diagonal block is whole tiles");

  template <class BaseCallbacks>
  struct Callbacks : BaseCallbacks {
    bool skip;
    CUTLASS_DEVICE Callbacks(BaseCallbacks&& base, bool skip_) : BaseCallbacks(cute::move(base)), skip(skip_) {}
    CUTLASS_DEVICE void postreduce(int epi_m, int epi_n, int iteration, bool issue) {
      BaseCallbacks::postreduce(epi_m, epi_n, iteration, issue && !skip);
    }
    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int iteration, bool issue) {
      BaseCallbacks::tma_store(epi_m, epi_n, iteration, issue && !skip);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto base = Base::template get_consumer_store_callbacks<ReferenceSrc>(args);
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const bool diagonal = (int(n) + 1) * TileN > int(m) * TileM;
    return Callbacks<decltype(base)>(cute::move(base), diagonal);
  }
};

}  // namespace dion3_bench

namespace {

using bench::fmt;
using bench::Out;
using dion3::DType;
using dion3::MatrixView;

// A CUTLASS kernel's adapter and its workspace, on batched row-major A (m x k), B (n x k), C and D
// (m x n). The kernel is set up (arguments, TMA descriptors, workspace) only when the operands or
// scalars change, so a timed call is the launch alone, as a step that kept its set-up would pay;
// any CUTLASS error exits.
template <class Kernel, class Element>
struct Runner {
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  struct Key {
    const void *A, *B, *D;
    void* C;
    int64_t b, m, n, k;
    float alpha, beta;
    bool operator==(const Key&) const = default;
  };
  Gemm gemm;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  Key last{};
  bool ready = false;

  // fill(args, key): the fusion's own arguments (scalars, aux pointers), left to the caller.
  template <class Fill>
  void run(const Key& key, Fill&& fill, cudaStream_t s) {
    if (!ready || !(key == last)) {
      auto args = arguments(key);
      fill(args, key);
      const size_t need = Gemm::get_workspace_size(args);
      if (need > workspace_bytes) {
        if (workspace) CK(cudaFree(workspace));
        CK(cudaMalloc(&workspace, need));
        workspace_bytes = need;
      }
      if (gemm.can_implement(args) != cutlass::Status::kSuccess ||
          gemm.initialize(args, workspace, s) != cutlass::Status::kSuccess)
        fail(key);
      last = key;
      ready = true;
    }
    if (gemm.run(s) != cutlass::Status::kSuccess) fail(key);
  }
  ~Runner() {
    if (workspace) cudaFree(workspace);
  }

 private:
  typename Gemm::Arguments arguments(const Key& key) const {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideC = typename Kernel::StrideC;
    const int M = static_cast<int>(key.m), N = static_cast<int>(key.n), K = static_cast<int>(key.k),
              L = static_cast<int>(key.b);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    return {cutlass::gemm::GemmUniversalMode::kGemm,
            {M, N, K, L},
            {static_cast<const Element*>(key.A), cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, L)),
             static_cast<const Element*>(key.B), cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, L))},
            {{},
             static_cast<const Element*>(key.D ? key.D : key.C),
             cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(M, N, L)),
             static_cast<Element*>(key.C),
             cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(M, N, L))},
            hw};
  }
  [[noreturn]] static void fail(const Key& key) {
    std::fprintf(stderr, "CUTLASS cannot run %lldx%lldx%lldx%lld\n", (long long)key.b, (long long)key.m,
                 (long long)key.n, (long long)key.k);
    std::exit(1);
  }
};

// Cooperative: both math warp groups on one 256 x 128 tile, the epilogue after its main loop.
// Pingpong: a 128 x 128 tile each, one group's epilogue under the other's main loop.
struct Cooperative {
  using TileShape = cute::Shape<cute::_256, cute::_128, cute::_64>;
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct Pingpong {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

// CUTLASS's sm_90 kernel for C = alpha·A·Bᵀ + beta·D over a batch, A and B row-major (K
// contiguous: B stored n x k is CUTLASS's column-major k x n), C and D row-major, with Config's
// tiles and schedules, a cluster shape, a tile scheduler (tag) and an epilogue fusion.
template <class Element, class Config, class ClusterShape, class Scheduler, class Fusion>
struct Build {
  static constexpr int kAlign = 16 / sizeof(Element);
  using Layout = cutlass::layout::RowMajor;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, Layout, kAlign, Element, Layout, kAlign,
      typename Config::Epilogue, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, Layout, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, typename Config::TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
};

// Cooperative tiles, CUTLASS's own linear combination in the epilogue.
template <class Element, class ClusterShape, class Scheduler>
struct CutlassGemm {
  using Kernel = typename Build<Element, Cooperative, ClusterShape, Scheduler,
                                cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float>>::Kernel;
  Runner<Kernel, Element> runner;

  void run(const void* A, const void* B, const void* D, void* C, int64_t b, int64_t m, int64_t n, int64_t k,
           float alpha, float beta, cudaStream_t s) {
    runner.run({A, B, D, C, b, m, n, k, alpha, beta}, [](auto& args, const auto& key) {
      args.epilogue.thread.alpha = key.alpha;
      args.epilogue.thread.beta = key.beta;
    }, s);
  }
};

// The triangle kernel whose epilogue also writes each tile's mirror (MirrorStore above):
// C = alpha·A·Aᵀ + beta·D, all of it, in one kernel.
template <class Element, class Config>
struct CutlassSymGemm {
  using TileShape = typename Config::TileShape;
  using EpiDesc = cutlass::epilogue::collective::detail::EpilogueDescriptor<
      TileShape, cutlass::epilogue::collective::EpilogueTileAuto, Element, Element, typename Config::Epilogue>;
  using AuxDesc = cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpiDesc, cutlass::layout::ColumnMajor, Element>;
  using Mirror = dion3_bench::MirrorStore<AuxDesc::Stages, typename EpiDesc::EpilogueTile, Element,
                                          cutlass::FloatRoundStyle::round_to_nearest, typename AuxDesc::Stride,
                                          typename AuxDesc::SmemLayoutAtom, typename AuxDesc::CopyOpR2S,
                                          cute::size<0>(TileShape{}), cute::size<1>(TileShape{})>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      Mirror, cutlass::epilogue::fusion::Sm90LinearCombination<Element, float, Element, float>>;
  using Kernel = typename Build<Element, Config, cute::Shape<cute::_1, cute::_1, cute::_1>,
                                dion3_bench::LowerTriangleScheduler, Fusion>::Kernel;
  Runner<Kernel, Element> runner;

  // C = alpha·A·Aᵀ + beta·D, A p x k.
  void run(const void* A, const void* D, void* C, int64_t b, int64_t p, int64_t k, float alpha, float beta,
           cudaStream_t s) {
    runner.run({A, A, D, C, b, p, p, k, alpha, beta}, [](auto& args, const auto& key) {
      auto& lincomb = args.epilogue.thread.op_0;  // beta·C + alpha·acc
      lincomb.op_0.scalars[0] = key.beta;
      lincomb.op_2.op_0.scalars[0] = key.alpha;
      args.epilogue.thread.op_1.ptr_aux = static_cast<Element*>(key.C);
      const int P = static_cast<int>(key.m), L = static_cast<int>(key.b);
      args.epilogue.thread.op_1.dAux =
          cutlass::make_cute_packed_stride(typename AuxDesc::Stride{}, cute::make_shape(P, P, L));
    }, s);
  }
};

using Cluster12 = cute::Shape<cute::_1, cute::_2, cute::_1>;
using Cluster11 = cute::Shape<cute::_1, cute::_1, cute::_1>;
using Persistent = cutlass::gemm::PersistentScheduler;
using Triangle = dion3_bench::LowerTriangleScheduler;

// The CUTLASS candidates of one element type.
template <class Element>
struct Candidates {
  CutlassGemm<Element, Cluster12, Persistent> full12;
  CutlassGemm<Element, Cluster11, Persistent> full11;
  CutlassGemm<Element, Cluster11, Triangle> triangle;
  CutlassSymGemm<Element, Cooperative> sym;
  CutlassSymGemm<Element, Pingpong> sym_pingpong;
};

__global__ void ncu_marker() {}

// max |x - ref| / max |ref| (a NaN in x, an unwritten element, counts as infinite).
double rel_err(const std::vector<float>& x, const std::vector<float>& ref) {
  double err = 0, mag = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    err = std::max(err, std::fabs(static_cast<double>(x[i]) - ref[i]));
    mag = std::max(mag, std::fabs(static_cast<double>(ref[i])));
  }
  return err / mag;
}

using Shape = bench::SymShape;

}  // namespace

int main(int argc, char** argv) {
  bench::Session session(argc, argv, "dion3-cuda-cutlass-bench");
  const bench::Args& args = session.args;
  auto& be = session.be;
  const cudaStream_t s = session.s;
  Out& o = session.o;
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS || cublasSetStream(handle, s) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cuBLAS set-up failed\n");
    return 1;
  }
  Candidates<cutlass::half_t> h;
  Candidates<cutlass::bfloat16_t> bf;

  std::vector<Shape> shapes;
  if (!args.shapes.empty()) shapes = bench::parse_sym_shapes(args.shapes);
  else if (args.quick) shapes = {{0, DType::F16, 4, 1024, 2048}, {1, DType::BF16, 4, 1024, 1024}};
  else
    shapes = {{0, DType::F16, 8, 4096, 11008}, {1, DType::F16, 8, 4096, 4096}, {0, DType::F16, 32, 1024, 4096},
              {1, DType::F16, 32, 1024, 1024}, {0, DType::F16, 16, 2048, 8192}, {1, DType::F16, 16, 2048, 2048},
              {0, DType::F16, 64, 512, 2048},  {1, DType::F16, 64, 512, 512},   {0, DType::BF16, 16, 2048, 2048},
              {1, DType::BF16, 16, 2048, 2048}, {0, DType::F16, 64, 2752, 4096}, {1, DType::F16, 64, 2752, 2752}};

  o.line("## Symmetric products: cuBLAS, the fused kernel and CUTLASS");
  o.line("");
  o.line("Same inputs, C in the input dtype. eff. TFLOP/s counts a full GEMM's 2·p²·q FLOPs; real TFLOP/s the lower "
         "triangle's p·(p+1)·q. cuBLAS and CUTLASS full: one strided-batched GEMM, no mirror. fused: the library's "
         "path (its fused kernel, or its fallback, with whatever passes it takes). triangle: CUTLASS's kernel over the "
         "tiles touching the lower triangle, then the library's mirror pass (alone in the next column). cuBLAS for "
         "sym_product: the copy of D into C that its in-place beta needs, then the GEMM. CUTLASS kernels are set up once "
         "per shape, outside the timed calls. CUTLASS sym: the triangle kernel storing each "
         "tile's mirror from its epilogue (cooperative 256 x 128 tiles; pingpong 128 x 128). fused banded: the fused kernel "
         "without the mirrored stores outside its diagonal 256 x 256 blocks. err: max "
         "|x - cuBLAS| / max |cuBLAS|, C poisoned with NaN first. fused / X: the fused kernel's time over X's.");
  o.line("");
  o.line("| op | dt | b | p | q | cuBLAS ms (eff.) | fused ms (real) | CUTLASS 1x2 ms (eff.) | CUTLASS 1x1 ms (eff.) | "
         "triangle + mirror ms (real) | triangle alone ms (real) | CUTLASS sym ms (real) | fused / CUTLASS sym | "
         "CUTLASS sym pingpong ms (real) | fused / pingpong | fused banded ms (real) | "
         "err full / triangle / sym / fused |");
  o.line("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
  int failures = 0;
  for (const Shape& sh : shapes) {
    const int64_t q = sh.q, p = sh.p, b = sh.b;
    const std::string label = fmt("%s %s %lldx%lldx%lld", sh.op == 0 ? "gram" : "sym", bench::dtype_short(sh.dt),
                                  (long long)b, (long long)p, (long long)q);
    if (!args.only.empty() && label.find(args.only) == std::string::npos) continue;
    const int64_t es = 2;
    dion3::DeviceBuffer X(be->allocator(), b * p * q * es), C(be->allocator(), b * p * p * es),
        Ref(be->allocator(), b * p * p * es), R(be->allocator(), sh.op == 1 ? b * p * p * es : 16);
    MatrixView Xv = MatrixView::contiguous(X.get(), sh.dt, b, p, q);
    MatrixView Cv = MatrixView::contiguous(C.get(), sh.dt, b, p, p);
    MatrixView Rv = MatrixView::contiguous(R.get(), sh.dt, b, p, p);
    bench::fill(X.get(), sh.dt, b * p * q, 1, 2.0f / std::sqrt(static_cast<float>(q)), s);
    if (sh.op == 1) be->gram(Xv, Rv, false);
    // The product's operands: gram X·Xᵀ (k = q), sym_product 2·R·R − R (R symmetric, so R = Rᵀ).
    const void* A = sh.op == 0 ? X.get() : R.get();
    const void* D = sh.op == 0 ? nullptr : R.get();
    const float alpha = sh.op == 0 ? 1.0f : 2.0f, beta = sh.op == 0 ? 0.0f : -1.0f;
    const int64_t k = sh.op == 0 ? q : p;
    const cudaDataType_t ct = sh.dt == DType::F16 ? CUDA_R_16F : CUDA_R_16BF;
    auto cublas = [&](void* out) {
      // Row-major C = A·Aᵀ is column-major Cᵀ = A·Aᵀ too: op(A) = Aᵀ on the column-major k x p view.
      if (D && out != D) CK(cudaMemcpyAsync(out, D, b * p * p * es, cudaMemcpyDeviceToDevice, s));
      const cublasStatus_t st = cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(p), static_cast<int>(p), static_cast<int>(k), &alpha, A,
          ct, static_cast<int>(k), p * k, A, ct, static_cast<int>(k), p * k, &beta, out, ct, static_cast<int>(p),
          p * p, static_cast<int>(b), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) {
        std::fprintf(stderr, "cublasGemmStridedBatchedEx failed (%d)\n", static_cast<int>(st));
        std::exit(1);
      }
    };
    auto cutlass_run = [&](auto& g, void* out) {
      g.run(A, A, D, out, b, p, p, k, alpha, beta, s);
    };
    auto with = [&](auto&& f) {  // the candidate of this shape's dtype
      if (sh.dt == DType::F16) f(h);
      else f(bf);
    };
    auto full12 = [&] { with([&](auto& c) { cutlass_run(c.full12, C.get()); }); };
    auto full11 = [&] { with([&](auto& c) { cutlass_run(c.full11, C.get()); }); };
    auto triangle = [&] { with([&](auto& c) { cutlass_run(c.triangle, C.get()); }); };
    auto sym = [&] { with([&](auto& c) { c.sym.run(A, D, C.get(), b, p, k, alpha, beta, s); }); };
    auto sym_pingpong = [&] { with([&](auto& c) { c.sym_pingpong.run(A, D, C.get(), b, p, k, alpha, beta, s); }); };
    auto mirror = [&] { dion3::cuda::launch_mirror_lower(Cv, 0.0f, true, s); };
    // The fused kernel writing C banded (no mirrored stores outside the diagonal 256 x 256 blocks):
    // what CUTLASS's triangle kernel alone compares with, where a banded C is all a product needs.
    const bool banded_runs = dion3::cuda::sym_wgmma_supported(sh.op == 0 ? Xv : Rv, sh.op == 0 ? Xv : Rv,
                                                              sh.op == 0 ? nullptr : &Rv, Cv);
    auto banded = [&] {
      if (!banded_runs) return;
      if (sh.op == 0) dion3::cuda::launch_sym_wgmma(Xv, Xv, 1.0f, 0.0f, nullptr, 0.0f, Cv, s, false, true);
      else dion3::cuda::launch_sym_wgmma(Rv, Rv, 2.0f, -1.0f, &Rv, 0.0f, Cv, s, false, true);
    };
    auto fused = [&] {
      if (sh.op == 0) be->gram(Xv, Cv, false);
      else be->sym_product(2.0f, Rv, Rv, -1.0f, &Rv, 0.0f, Cv, false, false);
    };
    // Correctness: cuBLAS into Ref; each candidate into C poisoned first.
    cublas(Ref.get());
    const std::vector<float> ref = bench::download(MatrixView::contiguous(Ref.get(), sh.dt, b, p, p), s);
    auto check = [&](const std::function<void()>& f) {
      CK(cudaMemsetAsync(C.get(), 0xFF, b * p * p * es, s));  // NaN in float16 and in bfloat16
      f();
      return rel_err(bench::download(Cv, s), ref);
    };
    const double err_full = check(full12), err_full11 = check(full11);
    const double err_tri = check([&] { triangle(); mirror(); });
    const double err_sym = std::max(check(sym), check(sym_pingpong));
    const double err_fused = check(fused);
    const double tol = sh.dt == DType::F16 ? 2e-3 : 1.6e-2;
    const bool ok = err_full <= tol && err_full11 <= tol && err_tri <= tol && err_sym <= tol && err_fused <= tol;
    if (!ok) ++failures;
    std::vector<std::function<void()>> cands{[&] { cublas(C.get()); }, fused, full12, full11,
                                             [&] { triangle(); mirror(); }, triangle, sym,
                                             sym_pingpong, banded};
    if (args.once) {  // marker k (a grid of k blocks), then candidate k's kernels
      for (std::size_t c = 0; c < cands.size(); ++c) {
        ncu_marker<<<static_cast<unsigned>(c + 1), 32, 0, s>>>();
        cands[c]();
      }
      CK(cudaStreamSynchronize(s));
      o.line(fmt("- %s: cuBLAS, fused, CUTLASS 1x2, CUTLASS 1x1, triangle + mirror, triangle, CUTLASS sym, CUTLASS sym pingpong, fused banded; once each%s",
                 label.c_str(), ok ? "" : " (WRONG)"));
      continue;
    }
    const std::vector<double> ms = bench::interleaved_medians(s, 2, args.iters, cands);
    const double eff = 2.0 * b * p * p * k, real = static_cast<double>(b) * p * (p + 1) * k;
    o.line(fmt("| %s | %s | %lld | %lld | %lld | %.3f (%.0f) | %.3f (%.0f) | %.3f (%.0f) | %.3f (%.0f) | %.3f (%.0f) | "
               "%.3f (%.0f) | %.3f (%.0f) | %.2fx | %.3f (%.0f) | %.2fx | %s | %.1e / %.1e / %.1e / %.1e%s |",
               sh.op == 0 ? "gram" : "sym_product", bench::dtype_short(sh.dt), (long long)b, (long long)p,
               (long long)q, ms[0], eff / ms[0] / 1e9, ms[1], real / ms[1] / 1e9, ms[2], eff / ms[2] / 1e9, ms[3],
               eff / ms[3] / 1e9, ms[4], real / ms[4] / 1e9, ms[5], real / ms[5] / 1e9, ms[6], real / ms[6] / 1e9,
               ms[1] / ms[6], ms[7], real / ms[7] / 1e9, ms[1] / ms[7],
               banded_runs ? fmt("%.3f (%.0f)", ms[8], real / ms[8] / 1e9).c_str() : "-",
               std::max(err_full, err_full11), err_tri, err_sym, err_fused, ok ? "" : " WRONG"));
  }
  o.line("");
  o.line(fmt("correctness failures: %d", failures));
  cublasDestroy(handle);
  session.save();
  return failures == 0 ? 0 : 1;
}
