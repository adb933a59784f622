// sym_wgmma.cu — the symmetric products (X·Xᵀ and sym·sym) as one Hopper (sm_90a) kernel:
// only the lower-triangle output tiles of C = alpha·A·Bᵀ + beta·D + gamma·I are computed
// (A, B: batches of p x k row-major fp16/bf16 matrices, "K-contiguous" both; C and D in the
// same dtype), with fp32 accumulation. Persistent grid (one CTA per SM), linearized triangular
// schedule over 128 x 256 tiles (tile t -> (matrix, row block i, column block j <= i/2);
// the costly tiles first, see decode_tile; pairs take units row by row), TMA loads (128-byte swizzle) into a 3-stage
// mbarrier pipeline fed by one producer thread, and two consumer warpgroups issuing wgmma m64nNk16
// from shared memory, each owning 64 rows: N = 256, narrower on diagonal tiles (only the
// 64-column blocks on or below the diagonal). By default the CTAs run in clusters of two
// ("pairs") over the tiles (2m, j) and (2m + 1, j), which read the same 256 B rows: each loads
// half of them for both (TMA multicast), so L2 serves a third less per stage.
//
// Epilogue, per consumer warpgroup, in 64 x 64 blocks (one 128-byte-swizzled TMA box each): the
// warpgroup writes its results into its staging buffer (stmatrix, with D's blocks read from
// there), and a helper warp of the producer warpgroup finishes the tile while the consumers run
// the next main loop: it makes the diagonal block exactly symmetric, stores the blocks by TMA,
// transposes the strictly lower ones in place and stores them into their mirrored upper blocks,
// then prefetches D's blocks of the warpgroup's next tile. Every element of C comes from its
// lower-triangle value, so C is exactly symmetric; D is read in the lower triangle (and the
// diagonal blocks) only and may alias C.
//
// Banded matrices (kernels.cuh): with banded_out the mirrored stores are left out except on the
// diagonal 256 x 256 blocks (tiles j == i/2), which saves half the stores and all the helper's
// transposes of the other tiles; with banded_in (a template parameter, kBandedIn) A and B are such
// matrices, and the k-blocks past a row block's diagonal 256 x 256 block are loaded as the 64 x 64
// blocks below the diagonal and fed to wgmma transposed (MN-major). The chained products of Gram
// NS run banded; only what cuBLAS reads next is written whole (fewer stores, and the H200 runs in
// bench/results/ show the banded products faster).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <type_traits>

#include "cuda/kernels.cuh"
#include "cuda/sm90_async.cuh"
#include "cuda/wgmma_m64.cuh"

namespace dion3::cuda {
namespace {

// Three 64-deep stages: shallower k-blocks in more stages (the same bytes in flight) were slower,
// a fourth stage gained nothing and two stages starved the main loop (the kernel-experiment runs
// in bench/results/ record each).
constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 3;
// Two consumer warpgroups (0, 1) and a producer warpgroup (2: one thread issues the loads, warps
// 1 and 2 are the consumers' epilogue helpers). A block launches with at most 168 registers per
// thread (12 warps, three on each of the SM's four register-file quarters of 16384; probed on the
// H200 with 9 warps: 163 launched, 183 not); then the producer warpgroup gives registers back
// (setmaxnreg.dec 40) and the consumers take them (setmaxnreg.inc 232, exactly what was freed of
// the block's 384 x 168: asking for more makes the inc wait forever): 128 accumulators and room
// for ptxas to keep the wgmma pipeline. (With 288 threads at 163 registers each, small changes
// made ptxas serialize the wgmma.) The CTest cuda.sym_wgmma_ptxas checks both.
constexpr int kThreads = 384;
// A stage holds one k-block: A's 128 rows, then B's 256 rows (rows of 128 bytes, 1024-byte aligned).
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
constexpr int kEB = 64;                                 // epilogue block edge: one TMA box
constexpr int kEBBytes = kEB * kEB * 2;                 // 8 KiB
constexpr int kStagingBytes = (kBN / kEB) * kEBBytes;   // per consumer warpgroup: 64 x 256
constexpr int kSmemBytes =
    kStages * kStageBytes + 2 * kStagingBytes + 1024 /*align*/ + 256 /*barriers*/;
static_assert(kSmemBytes <= 232448, "shared memory of one sm_90 CTA");

__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DION3_SM90A 1
#endif

// One 64-deep k-block of a warpgroup's 64 x kN product: four k16 steps, the first of them starting
// a new sum where kFirst (the tile's first k-block). kN == 0: nothing (rows past p). kTA / kTB: that
// operand's stage holds 64 x 64 blocks transposed (MN-major: a banded input's upper blocks, read
// from their lower mirror images); a k16 step is then 16 rows on instead of 32 bytes along a row.
template <bool kBF16, int kN, bool kFirst, bool kTA = false, bool kTB = false>
__device__ __forceinline__ void mma_kblock(float (&acc)[128], uint32_t a0, uint32_t b0) {
  if constexpr (kN > 0) {
    auto desc = [](bool mn, uint32_t addr, int k) {
      return mn ? smem_desc_mn(addr + k * 2048) : smem_desc(addr + k * 32);
    };
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    wgmma_m64k16<kBF16, kN, !kFirst, kTA, kTB>(acc, desc(kTA, a0, 0), desc(kTB, b0, 0));
#pragma unroll
    for (int k = 1; k < kBK / 16; ++k) wgmma_m64k16<kBF16, kN, true, kTA, kTB>(acc, desc(kTA, a0, k), desc(kTB, b0, k));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  }
}

// Position in the ring of stages: the stage index and the parity of its mbarrier phase.
struct StageRing {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  // Until every consumer warp has released the stage used last (and so every earlier one).
  __device__ __forceinline__ void wait_released(uint64_t* empty) const {
    mbar_wait(&empty[stage == 0 ? kStages - 1 : stage - 1], stage == 0 ? phase ^ 1 : phase);
  }
};
// Where consumer warpgroup cw puts the transposed block k of the CTA's last tile: the pipeline
// stages, free by then (see the consumers' epilogue).
__device__ __forceinline__ uint8_t* mirror_base(uint8_t* smem, int cw, int k) {
  return smem + (4 * cw + k) * kEBBytes;
}

// A warpgroup's part of one tile's main loop: kblocks k-blocks through the stage ring (which
// carries on across the kernel's tiles), one wgmma group in flight behind the one being issued,
// each stage released (one arrival per warp, from the `signal` lane) once its products finished.
// The first k-block is peeled so that its products start new sums.
// With kBandedIn, k-blocks [1, kb_tb) read both operands K-major, [kb_tb, kb_ta) B transposed and
// [kb_ta, kblocks) both (see TileSplit); the first k-block is always K-major. (A template
// parameter: as a run-time choice the three loops slowed the kernel even where no input was
// banded.)
// With pairs a stage is free once the consumers of both CTAs are done with it (the producers of
// both write into both: see the kernel's pairs): lanes 0 and 1 of each consumer warp arrive on
// the empty barrier of CTA 0 and CTA 1, at empty_cluster (empty[0]'s shared::cluster address in
// CTA lane % 2), one instruction for both.
template <bool kBF16, int kN, bool kBandedIn, bool kPair>
__device__ __forceinline__ void tile_mainloop(float (&acc)[128], uint32_t a0, uint32_t b0, uint64_t* full,
                                              uint64_t* empty, StageRing& ring, int kblocks, int kb_tb, int kb_ta,
                                              bool signal, uint32_t empty_cluster) {
  auto release = [&](int stage) {
    if constexpr (kPair) mbar_arrive_cluster_if(empty_cluster + stage * 8, signal);
    else mbar_arrive_if(&empty[stage], signal);
  };
  int s = ring.stage;
  mbar_wait(&full[s], ring.phase);
  mma_kblock<kBF16, kN, true>(acc, a0 + s * kStageBytes, b0 + s * kStageBytes);
  int prev = s;
  ring.next();
  int kb = 1;
  auto run = [&](auto ta, auto tb, int kb_end) {
    for (; kb < kb_end; ++kb, ring.next()) {
      s = ring.stage;
      mbar_wait(&full[s], ring.phase);
      mma_kblock<kBF16, kN, false, decltype(ta)::value, decltype(tb)::value>(acc, a0 + s * kStageBytes,
                                                                               b0 + s * kStageBytes);
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      release(prev);
      prev = s;
    }
  };
  if constexpr (kBandedIn) {
    run(std::false_type{}, std::false_type{}, kb_tb);
    run(std::false_type{}, std::true_type{}, kb_ta);
    run(std::true_type{}, std::true_type{}, kblocks);
  } else {
    run(std::false_type{}, std::false_type{}, kblocks);
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_acc(acc);
  release(prev);
}

struct SymParams {
  float alpha, beta, gamma;
  int p, kblocks;
  int a_batched, b_batched, d_batched;
  int same_ab;          // A and B are one operand (X·Xᵀ, R·R): see stage_load
  int full_per_mat;     // tiles of one matrix in the first group of the schedule (see decode_tile)
  int full_tiles;       // ... of all matrices
  int even_diag_per_mat;  // its diagonal tiles on even row blocks (the second group)
  int total_tiles;
  int skip_epilogue;    // benchmarks only: no stores (times the main loop alone)
  int banded_out;       // C banded: no mirrored stores outside the diagonal 256 x 256 blocks
  int units_per_mat;    // CTA pairs (the kernel's kPair): work units of one matrix (total_tiles counts them)
};

// Integer square root of l >= 0.
__device__ __forceinline__ int isqrt(int l) {
  int m = static_cast<int>(sqrtf(static_cast<float>(l)));
  while (m > 0 && m * m > l) --m;
  while ((m + 1) * (m + 1) <= l) ++m;
  return m;
}

// The schedule: tile t -> (matrix b, 128-row block i, 256-column block j <= i/2), in two groups,
// each matrix by matrix and row by row. The first holds every tile that costs a whole or nearly
// a whole tile of tensor-core work: those strictly below the diagonal (j < i/2, 8 of 8 64-column
// blocks) and the diagonal tiles of odd row blocks (7 of 8); the second, the diagonal tiles of
// even row blocks (3 of 8). The persistent CTAs take tiles round robin, so the costly ones come
// first and the cheap ones fill the last round: H200 profile of gpt-1b, where the tiles of one
// kernel span two to nine rounds. Tiles of equal cost keep the CTAs in step along k, so they
// share each k-block of a matrix in L2 (interleaving the cheap diagonal tiles let CTAs drift
// apart, and L2 hits fell; the tile-order run in bench/results/ has the profile).
// Row block i holds i/2 tiles of the first group when even, i/2 + 1 when odd, so 2m rows hold
// m² of them and 2m + 1 rows m² + m.
// With pairs, t is a unit (matrix b, 256-row block m, 256-column block j <= m), matrix by matrix
// and row by row; CTA `rank` of the pair takes its 128-row block i = 2m + rank.
template <bool kPair>
__device__ __forceinline__ void decode_tile(int t, const SymParams& prm, int rank, int& b, int& i, int& j) {
  if constexpr (kPair) {
    b = t / prm.units_per_mat;
    const int l = t - b * prm.units_per_mat;
    int m = (isqrt(8 * l + 1) - 1) / 2;  // m(m+1)/2 <= l
    j = l - m * (m + 1) / 2;
    i = 2 * m + rank;
    return;
  }
  if (t >= prm.full_tiles) {
    const int u = t - prm.full_tiles;
    b = u / prm.even_diag_per_mat;
    const int e = u - b * prm.even_diag_per_mat;
    i = 2 * e;
    j = e;
    return;
  }
  b = t / prm.full_per_mat;
  const int l = t - b * prm.full_per_mat;
  const int m = isqrt(l);
  if (l >= m * (m + 1)) {
    i = 2 * m + 1;
    j = l - m * (m + 1);
  } else {
    i = 2 * m;
    j = l - m * m;
  }
}

// What a tile loads into a stage: A's 128 rows at offset 0 and B's 256 rows at kABytes, except on
// a diagonal tile where A and B are one operand (same_ab), whose A rows are B rows: with i even,
// the only B rows the tile reads (its first 128) are its A rows, so it loads A alone; with i odd,
// its A rows are B's last 128, so it loads B alone.
enum class StageLoad { Both, AOnly, BOnly };
__device__ __forceinline__ StageLoad stage_load(int i, int j, bool same_ab) {
  if (!same_ab || j != (i >> 1)) return StageLoad::Both;
  return (i & 1) ? StageLoad::BOnly : StageLoad::AOnly;
}
// Where warpgroup cw finds its operands in stage 0 of the ring (shared address `stage0`): its 64
// A rows at a0, the tile's B rows at b0.
__device__ __forceinline__ void operands_in_stage(StageLoad load, int cw, uint32_t stage0, uint32_t& a0, uint32_t& b0) {
  b0 = load == StageLoad::AOnly ? stage0 : stage0 + kABytes;
  a0 = (load == StageLoad::BOnly ? b0 + kBM * 128 : stage0) + cw * 64 * 128;
}
// The same for a CTA of a pair: B's 256 rows always arrive whole (a half from each CTA), so on a
// diagonal unit where A and B are one operand, the CTA's A rows are B's half `rank`, not loaded.
__device__ __forceinline__ bool pair_loads_a(int i, int j, bool same_ab) { return !(same_ab && j == (i >> 1)); }
__device__ __forceinline__ void operands_in_pair_stage(bool loads_a, int rank, int cw, uint32_t stage0, uint32_t& a0,
                                                       uint32_t& b0) {
  b0 = stage0 + kABytes;
  a0 = (loads_a ? stage0 : b0 + rank * kABytes) + cw * 64 * 128;
}

// Where a tile's k-blocks switch to transposed reads of banded operands (kernels with kBandedIn): a
// banded matrix holds its lower triangle and its diagonal 256 x 256 blocks whole, so B's rows
// (256-row block j) are stored up to k-block 4j + 3 and A's (128-row block i, inside 256-row block
// i/2) up to 4(i/2) + 3; past those their 64 x 64 blocks are loaded from the mirror images below
// the diagonal, transposed. Never before k-block 4 (a tile's first k-block is K-major).
struct TileSplit {
  int kb_tb, kb_ta;  // first k-block with B, with A transposed (kblocks: none)
  __device__ __forceinline__ TileSplit(int i, int j, const SymParams& prm) {
    kb_tb = min(4 * j + 4, prm.kblocks);
    kb_ta = min(4 * (i >> 1) + 4, prm.kblocks);
  }
};

template <bool kBF16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (kBF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}
template <bool kBF16>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (kBF16) return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
  else return __half22float2(*reinterpret_cast<const __half2*>(&u));
}

// ---- the epilogue ---------------------------------------------------------------------------
// A consumer warpgroup packs its 64 x 256 results into its staging buffer as they are, blocks on
// or below the diagonal only (stage_block), and hands the buffer to its helper warp, one of the
// producer warpgroup's, which makes the diagonal block exactly symmetric, stores the blocks by TMA,
// transposes the strictly lower ones in place and stores them mirrored, then refills the buffer
// with D's blocks of the warpgroup's next tile. Meanwhile the consumers run the next main loop.
// On a CTA's last tile the consumers write the transposed blocks themselves, from registers, into
// the pipeline stages (free by then), and the helper only stores.

// v = alpha·acc + beta·D (+ gamma on the diagonal) for 64-column block k of the warpgroup's rows,
// written to the 128-byte-swizzled staging block at `block` (where D's block was prefetched).
// Slot 4·nn + 2·h + {0, 1} of acc holds row 16·warp + 8·h + lane/4, columns 8·nn + 2·(lane%4) +
// {0, 1} (the wgmma m64nNk16 fragment). kKeep: also leave v packed in pairs in the low half of
// acc (slot 2·n8 + m holds what stmatrix wrote from register m for chunk pair n8; every slot is
// written only after the accumulators it overlays were read), for store_block_transposed. k must
// be known at compile time (an unrolled loop, blocks in ascending order), so that acc stays in
// registers.
template <bool kBF16, bool kHasD, bool kDiag, bool kKeep>
__device__ __forceinline__ void stage_block(float (&acc)[128], int k, uint32_t block, const SymParams& prm, int mrow,
                                            int mchunk, int warp, int lane) {
  // D's four fragments of the block are loaded before any is used (the asm's memory clobbers keep
  // every ldmatrix behind the stmatrix before it, which serialised their latencies).
  uint32_t dv_all[4][4];
  if constexpr (kHasD) {
#pragma unroll
    for (int c = 0; c < 4; ++c) ldmatrix_x4<false>(dv_all[c], block + swz(mrow, 8 * ((8 * k + 2 * c + mchunk) & 7)));
  }
#pragma unroll
  for (int n8 = 8 * k; n8 < 8 * k + 8; n8 += 2) {
    const uint32_t addr = block + swz(mrow, 8 * ((n8 + mchunk) & 7));
    uint32_t v[4];
    const uint32_t(&dv)[4] = dv_all[(n8 - 8 * k) / 2];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int nn = n8 + (m >> 1), h = m & 1;
      float v0, v1;
      if constexpr (kHasD) {
        const float2 d2 = unpack2<kBF16>(dv[m]);
        v0 = prm.alpha * acc[4 * nn + 2 * h] + prm.beta * d2.x;
        v1 = prm.alpha * acc[4 * nn + 2 * h + 1] + prm.beta * d2.y;
      } else {
        v0 = prm.alpha * acc[4 * nn + 2 * h];
        v1 = prm.alpha * acc[4 * nn + 2 * h + 1];
      }
      if constexpr (kDiag) {
        const int rl = 16 * warp + 8 * h + (lane >> 2), cl = 8 * (nn & 7) + 2 * (lane & 3);
        if (rl == cl) v0 += prm.gamma;
        if (rl == cl + 1) v1 += prm.gamma;
      }
      v[m] = pack2<kBF16>(v0, v1);
    }
    if constexpr (kKeep) {
#pragma unroll
      for (int m = 0; m < 4; ++m) acc[2 * n8 + m] = __uint_as_float(v[m]);
    }
    stmatrix_x4<false>(addr, v[0], v[1], v[2], v[3]);
  }
}
// The transpose of block k's values that stage_block<..., kKeep> left packed in acc, written
// with stmatrix.trans into the 128-byte-swizzled block at `block`.
__device__ __forceinline__ void store_block_transposed(const float (&acc)[128], uint32_t block, int k, int warp,
                                                       int lane) {
#pragma unroll
  for (int n8 = 8 * k; n8 < 8 * k + 8; n8 += 2) {
    const uint32_t addr = block + swz(8 * ((n8 + (lane >> 4)) & 7) + (lane & 7), 8 * (2 * warp + ((lane >> 3) & 1)));
    stmatrix_x4<true>(addr, __float_as_uint(acc[2 * n8]), __float_as_uint(acc[2 * n8 + 1]),
                      __float_as_uint(acc[2 * n8 + 2]), __float_as_uint(acc[2 * n8 + 3]));
  }
}

// The helper warp moves 8 x 8 sub-blocks of a 64 x 64 staging block four at a time: lanes 8m ..
// 8m + 7 load sub-block (I, J) (byte m of a group word holds 8·I + J) transposed, row lane % 8
// each, and store it at (J, I). kGroups groups at once, all loads before all stores (their
// sub-blocks are disjoint), so that the shared-memory round trips overlap.
template <int kGroups>
__device__ __forceinline__ void move_transposed(uint32_t block, const uint32_t* groups, int lane) {
  uint32_t x[kGroups][4], dst[kGroups];
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {
    const int sub = static_cast<int>((groups[q] >> (8 * (lane >> 3))) & 0xFF), r = lane & 7;
    const int I = sub >> 3, J = sub & 7;
    ldmatrix_x4<true>(x[q], block + swz(8 * I + r, 8 * J));
    dst[q] = block + swz(8 * J + r, 8 * I);
  }
#pragma unroll
  for (int q = 0; q < kGroups; ++q) stmatrix_x4<false>(dst[q], x[q][0], x[q][1], x[q][2], x[q][3]);
}
constexpr uint32_t sub_at(int I, int J, int slot) { return static_cast<uint32_t>(8 * I + J) << (8 * slot); }
// Group g of a whole block's transpose: groups 0-13 swap two mirrored pairs of sub-blocks each
// (the 28 pairs I < J in row order), groups 14 and 15 transpose the diagonal sub-blocks in place.
constexpr uint32_t transpose_group(int g) {
  uint32_t v = 0;
  if (g >= 14) {
    for (int m = 0; m < 4; ++m) v |= sub_at(4 * (g - 14) + m, 4 * (g - 14) + m, m);
    return v;
  }
  int q = 0;
  for (int I = 0; I < 8; ++I)
    for (int J = I + 1; J < 8; ++J, ++q)
      if (q / 2 == g) v |= sub_at(I, J, 2 * (q % 2)) | sub_at(J, I, 2 * (q % 2) + 1);
  return v;
}
// Group g (0-6) of the 28 sub-blocks strictly below a block's diagonal, in row order.
constexpr uint32_t lower_group(int g) {
  uint32_t v = 0;
  int q = 0;
  for (int I = 0; I < 8; ++I)
    for (int J = 0; J < I; ++J, ++q)
      if (q / 4 == g) v |= sub_at(I, J, q % 4);
  return v;
}
// The groups as tables, read two per iteration of a loop that is not unrolled: the helper warps
// run with 40 registers (setmaxnreg); four groups at once spilled.
__constant__ uint32_t kTransposeGroups[16] = {
    transpose_group(0), transpose_group(1), transpose_group(2),   transpose_group(3),
    transpose_group(4), transpose_group(5), transpose_group(6),   transpose_group(7),
    transpose_group(8), transpose_group(9), transpose_group(10),  transpose_group(11),
    transpose_group(12), transpose_group(13), transpose_group(14), transpose_group(15)};
__constant__ uint32_t kLowerGroups[7] = {lower_group(0), lower_group(1), lower_group(2), lower_group(3),
                                         lower_group(4), lower_group(5), lower_group(6)};
__device__ __forceinline__ void transpose_block(uint32_t block, int lane) {
#pragma unroll 1
  for (int g = 0; g < 16; g += 2) move_transposed<2>(block, kTransposeGroups + g, lane);
}
// The diagonal block made exactly symmetric: its upper triangle replaced by the transpose of its
// lower one (sub-blocks below the diagonal mirrored; on the diagonal sub-blocks, elementwise).
__device__ __forceinline__ void symmetrize_block(uint32_t block, int lane) {
#pragma unroll 1
  for (int g = 0; g < 6; g += 2) move_transposed<2>(block, kLowerGroups + g, lane);
  move_transposed<1>(block, kLowerGroups + 6, lane);
  const int row = lane >> 2, c0 = 2 * (lane & 3);  // this lane's two elements of each 8 x 8 fragment
  const uint32_t keep = (c0 <= row ? 0x0000FFFFu : 0u) | (c0 + 1 <= row ? 0xFFFF0000u : 0u);
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    const int I = 4 * half + (lane >> 3);
    const uint32_t addr = block + swz(8 * I + (lane & 7), 8 * I);
    uint32_t n[4], t[4];
    ldmatrix_x4<false>(n, addr);
    ldmatrix_x4<true>(t, addr);
    stmatrix_x4<false>(addr, (n[0] & keep) | (t[0] & ~keep), (n[1] & keep) | (t[1] & ~keep),
                       (n[2] & keep) | (t[2] & ~keep), (n[3] & keep) | (t[3] & ~keep));
  }
}

// One tile's blocks as seen by consumer warpgroup cw: its 64-row block R, the blocks 4j ..
// 4j + nblk - 1 on or below the diagonal, the diagonal block kd (if kd < 4), the strictly lower
// ones (nlow), and whether its rows exist at all.
struct TileRows {
  int b, i, j, R, nblk, kd, nlow;
  bool rows_in;
  // Tile t of the schedule (a unit's tile `rank` with pairs).
  template <bool kPair>
  __device__ __forceinline__ static TileRows of(int t, const SymParams& prm, int rank, int cw) {
    TileRows tr;
    decode_tile<kPair>(t, prm, rank, tr.b, tr.i, tr.j);
    tr.R = 2 * tr.i + cw;
    tr.rows_in = tr.R * kEB < prm.p;
    tr.nblk = min(4, tr.R - 4 * tr.j + 1);
    tr.kd = tr.R - 4 * tr.j;
    tr.nlow = min(tr.nblk, tr.kd);
    return tr;
  }
  // Whether the strictly lower blocks are also stored mirrored: always for a full C, and for a
  // banded one on the diagonal 256 x 256 blocks (kd < 4) only.
  __device__ __forceinline__ bool mirrored(const SymParams& prm) const { return !prm.banded_out || kd < 4; }
};

// stage_block for every block of the warpgroup's part of the tile (the diagonal one with gamma).
template <bool kBF16, bool kHasD, bool kKeep>
__device__ __forceinline__ void stage_blocks(float (&acc)[128], const TileRows& tr, uint32_t staging,
                                             const SymParams& prm, int mrow, int mchunk, int warp, int lane) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k >= tr.nblk) continue;
    if (k == tr.kd) stage_block<kBF16, kHasD, true, kKeep>(acc, k, staging + k * kEBBytes, prm, mrow, mchunk, warp, lane);
    else stage_block<kBF16, kHasD, false, kKeep>(acc, k, staging + k * kEBBytes, prm, mrow, mchunk, warp, lane);
  }
}

// Pairs (kPair, launched in clusters of two CTAs): the CTAs of a cluster take the tiles (2m, j) and
// (2m + 1, j) of one unit (decode_tile), which read the same 256 B rows; each CTA's producer loads
// its own A rows and one half of B's, the half multicast into both CTAs' stage. A stage is then
// refilled only once the consumers of both CTAs have released it (each consumer warp arrives on
// both CTAs' empty barrier), and a CTA leaves only after the cluster barrier at the end, when no
// peer can still arrive on its barriers. L2 serves a third less per stage.
template <bool kBF16, bool kHasD, bool kBandedIn, bool kPair>
__global__ void __launch_bounds__(kThreads, 1)
    sym_wgmma_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                     const __grid_constant__ CUtensorMap tmC, const __grid_constant__ CUtensorMap tmD,
                     const __grid_constant__ CUtensorMap tmA64, const __grid_constant__ CUtensorMap tmB64,
                     const SymParams prm) {
#if defined(DION3_SM90A)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* sOut = smem + kStages * kStageBytes;  // two staging buffers of 4 blocks
  uint64_t* full = reinterpret_cast<uint64_t*>(sOut + 2 * kStagingBytes);
  uint64_t* empty = full + kStages;
  uint64_t* ready = empty + kStages;  // per consumer warpgroup: its staging buffer is free (and holds D)
  uint64_t* staged = ready + 2;       // per consumer warpgroup: its results are in the staging buffer

  // The warpgroup index, broadcast so that the compiler knows it is warp-uniform.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  // This CTA's work: tiles (units with pairs) first, first + stride, ...
  const uint32_t rank = kPair ? cluster_rank() : 0;
  const int first = kPair ? static_cast<int>(blockIdx.x >> 1) : static_cast<int>(blockIdx.x);
  const int stride = kPair ? static_cast<int>(gridDim.x >> 1) : static_cast<int>(gridDim.x);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kPair ? 16 : 8);  // one arrival per consumer warp (of both CTAs of a pair)
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(&ready[c], 1);
      mbar_init(&staged[c], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  if constexpr (kPair) cluster_sync();  // the peer's barriers are set up before anything reaches them
  else __syncthreads();
  pdl_wait();  // the set-up above may overlap the previous kernel's tail; its outputs are read below

  const int lane = threadIdx.x & 31;
  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    const int warp = (threadIdx.x / 32) & 3;
    if (warp == 0) {
      // The producer: one thread issues every TMA load of A and B.
      if (lane != 0) return;
      StageRing ring;
      for (int t = first; t < prm.total_tiles; t += stride) {
        int b, i, j;
        decode_tile<kPair>(t, prm, rank, b, i, j);
        const int ba = prm.a_batched ? b : 0, bb = prm.b_batched ? b : 0;
        const TileSplit split(i, j, prm);
        if constexpr (kPair) {
          // Both halves of B arrive (this CTA's and the peer's); A unless it is B's half `rank`.
          const bool loads_a = pair_loads_a(i, j, prm.same_ab);
          for (int kb = 0; kb < prm.kblocks; ++kb, ring.next()) {
            const int s = ring.stage;
            uint8_t* stage = smem + s * kStageBytes;
            mbar_wait(&empty[s], ring.phase ^ 1);
            mbar_expect_tx(&full[s], (loads_a ? kABytes : 0) + kBBytes);
            if (loads_a) {
              if (!kBandedIn || kb < split.kb_ta) tma_load_3d(stage, &tmA, &full[s], kb * kBK, i * kBM, ba);
              else
                for (int h = 0; h < 2; ++h) tma_load_3d(stage + h * kEBBytes, &tmA64, &full[s], (2 * i + h) * kEB, kb * kBK, ba);
            }
            if (!kBandedIn || kb < split.kb_tb) {
              tma_load_3d_multicast(stage + kABytes + rank * kABytes, &tmB, &full[s], kb * kBK, j * kBN + rank * kBM, bb, 0x3);
            } else {
              for (int h = 0; h < 2; ++h) {
                const int c = 2 * static_cast<int>(rank) + h;
                tma_load_3d_multicast(stage + kABytes + c * kEBBytes, &tmB64, &full[s], (4 * j + c) * kEB, kb * kBK, bb, 0x3);
              }
            }
          }
          continue;
        }
        const StageLoad load = stage_load(i, j, prm.same_ab);
        const int bytes = load == StageLoad::AOnly ? kABytes : load == StageLoad::BOnly ? kBBytes : kStageBytes;
        for (int kb = 0; kb < prm.kblocks; ++kb, ring.next()) {
          const int s = ring.stage;
          uint8_t* stage = smem + s * kStageBytes;
          mbar_wait(&empty[s], ring.phase ^ 1);
          mbar_expect_tx(&full[s], bytes);
          // Transposed: the 64 x 64 block (kb, r) for each 64-row block r of the operand, in place of (r, kb).
          if (load != StageLoad::BOnly) {
            if (!kBandedIn || kb < split.kb_ta) tma_load_3d(stage, &tmA, &full[s], kb * kBK, i * kBM, ba);
            else
              for (int h = 0; h < 2; ++h) tma_load_3d(stage + h * kEBBytes, &tmA64, &full[s], (2 * i + h) * kEB, kb * kBK, ba);
          }
          if (load != StageLoad::AOnly) {
            if (!kBandedIn || kb < split.kb_tb) tma_load_3d(stage + kABytes, &tmB, &full[s], kb * kBK, j * kBN, bb);
            else
              for (int c = 0; c < 4; ++c)
                tma_load_3d(stage + kABytes + c * kEBBytes, &tmB64, &full[s], (4 * j + c) * kEB, kb * kBK, bb);
          }
        }
      }
      return;
    }
    if (warp == 3 || prm.skip_epilogue) return;
    // Warps 1 and 2: the helpers of consumer warpgroups 0 and 1 (see "the epilogue" above).
    const int cw = warp - 1;
    uint8_t* staging = sOut + cw * kStagingBytes;
    const uint32_t stage_u32 = smem_u32(staging);
    auto next_tile = [&](int t) {  // the next tile from t on where this warpgroup has rows
      for (; t < prm.total_tiles; t += stride)
        if (TileRows::of<kPair>(t, prm, rank, cw).rows_in) return t;
      return prm.total_tiles;
    };
    // Hand the staging buffer to the consumers for tile t: with D's blocks in it, or as it is.
    auto refill = [&](int t) {
      if (lane != 0) return;
      if constexpr (kHasD) {
        const TileRows tr = TileRows::of<kPair>(t, prm, rank, cw);
        mbar_expect_tx(&ready[cw], tr.nblk * kEBBytes);
        const int bd = prm.d_batched ? tr.b : 0;
        for (int k = 0; k < tr.nblk; ++k)
          tma_load_3d(staging + k * kEBBytes, &tmD, &ready[cw], (4 * tr.j + k) * kEB, tr.R * kEB, bd);
      } else {
        mbar_arrive_if(&ready[cw], true);
      }
    };
    uint32_t sphase = 0;
    int t = next_tile(first);
    if (t < prm.total_tiles) refill(t);
    while (t < prm.total_tiles) {
      const TileRows tr = TileRows::of<kPair>(t, prm, rank, cw);
      mbar_wait(&staged[cw], sphase);
      sphase ^= 1;
      if (tr.kd < 4) symmetrize_block(stage_u32 + tr.kd * kEBBytes, lane);
      fence_async_smem();
      __syncwarp();
      const bool last = t + stride >= prm.total_tiles;  // mirrored blocks at mirror_base
      const bool mirror = tr.mirrored(prm);
      if (lane == 0) {
        for (int k = 0; k < tr.nblk; ++k) tma_store_3d(&tmC, staging + k * kEBBytes, (4 * tr.j + k) * kEB, tr.R * kEB, tr.b);
        if (last && mirror)
          for (int k = 0; k < tr.nlow; ++k)
            tma_store_3d(&tmC, mirror_base(smem, cw, k), tr.R * kEB, (4 * tr.j + k) * kEB, tr.b);
        bulk_commit();
      }
      if (tr.nlow > 0 && !last && mirror) {
        if (lane == 0) bulk_wait_read();
        __syncwarp();
        for (int k = 0; k < tr.nlow; ++k)
          transpose_block(stage_u32 + k * kEBBytes, lane);
        fence_async_smem();
        __syncwarp();
        if (lane == 0) {
          for (int k = 0; k < tr.nlow; ++k)
            tma_store_3d(&tmC, staging + k * kEBBytes, tr.R * kEB, (4 * tr.j + k) * kEB, tr.b);
          bulk_commit();
        }
      }
      if (lane == 0) bulk_wait_read();
      __syncwarp();
      t = next_tile(t + stride);
      if (t < prm.total_tiles) refill(t);
    }
    if (lane == 0) bulk_wait_all();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int cw = wg;  // rows cw*64 .. cw*64+63 of the tile
  const int warp = (threadIdx.x / 32) & 3;
  const uint32_t stage_u32 = smem_u32(sOut + cw * kStagingBytes);
  // This lane's row address for ldmatrix/stmatrix x4 over the warp's 16 rows and a pair of
  // 8-column chunks (n8, n8 + 1): matrix m = lane / 8 is (rows + 8·(m & 1), chunk n8 + m / 2).
  const int mrow = 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7);
  const int mchunk = lane >> 4;
  float acc[128];
  StageRing ring;
  uint32_t rphase = 0;
  const uint32_t empty_cl = kPair ? mapa_shared(smem_u32(empty), lane & 1) : 0;
  const int p = prm.p;
  for (int t = first; t < prm.total_tiles; t += stride) {
    const TileRows tr = TileRows::of<kPair>(t, prm, rank, cw);
    const int ncols = tr.rows_in ? min(tr.nblk, (p - 4 * tr.j * kEB + kEB - 1) / kEB) : 0;  // blocks computed
    // This warpgroup's 64 A rows and the B rows in stage 0 (operands_in_stage).
    uint32_t a0, b0;
    if constexpr (kPair) operands_in_pair_stage(pair_loads_a(tr.i, tr.j, prm.same_ab), rank, cw, smem_u32(smem), a0, b0);
    else operands_in_stage(stage_load(tr.i, tr.j, prm.same_ab), cw, smem_u32(smem), a0, b0);
    const bool signal = kPair ? lane < 2 : lane == 0;  // see tile_mainloop
    const TileSplit sp(tr.i, tr.j, prm);
    switch (ncols) {
      case 4: tile_mainloop<kBF16, 256, kBandedIn, kPair>(acc, a0, b0, full, empty, ring, prm.kblocks, sp.kb_tb, sp.kb_ta, signal, empty_cl); break;
      case 3: tile_mainloop<kBF16, 192, kBandedIn, kPair>(acc, a0, b0, full, empty, ring, prm.kblocks, sp.kb_tb, sp.kb_ta, signal, empty_cl); break;
      case 2: tile_mainloop<kBF16, 128, kBandedIn, kPair>(acc, a0, b0, full, empty, ring, prm.kblocks, sp.kb_tb, sp.kb_ta, signal, empty_cl); break;
      case 1: tile_mainloop<kBF16, 64, kBandedIn, kPair>(acc, a0, b0, full, empty, ring, prm.kblocks, sp.kb_tb, sp.kb_ta, signal, empty_cl); break;
      default: tile_mainloop<kBF16, 0, kBandedIn, kPair>(acc, a0, b0, full, empty, ring, prm.kblocks, sp.kb_tb, sp.kb_ta, signal, empty_cl); break;
    }

    if (prm.skip_epilogue) {  // keep the accumulators live, store nothing
      float x = 0.0f;
#pragma unroll
      for (int n = 0; n < 128; ++n) x += acc[n];
      if (x == 1234.5f) acc[0] = x * 2.0f;
      continue;
    }
    if (!tr.rows_in) continue;
    mbar_wait(&ready[cw], rphase);
    rphase ^= 1;
    if (t + stride < prm.total_tiles || !tr.mirrored(prm)) {
      stage_blocks<kBF16, kHasD, false>(acc, tr, stage_u32, prm, mrow, mchunk, warp, lane);
    } else {
      // The CTA's last tile: nothing is loaded into the pipeline stages any more, so once every
      // consumer warp (of both CTAs of a pair) has released the last one, the transposed blocks go there (mirror_base),
      // written from registers, and the helper only stores.
      stage_blocks<kBF16, kHasD, true>(acc, tr, stage_u32, prm, mrow, mchunk, warp, lane);
      ring.wait_released(empty);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (k >= tr.nlow) continue;
        store_block_transposed(acc, smem_u32(mirror_base(smem, cw, k)), k, warp, lane);
      }
    }
    fence_async_smem();
    mbar_arrive_if(&staged[cw], true);
  }
  if constexpr (kPair) cluster_sync();  // the peer's consumers have made their last arrivals here
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    else
      (void)cudaGetLastError();
  });
  return fn;
}

CUtensorMap make_map(const MatrixView& v, int box_rows) {
  const int64_t es = 2;
  const int64_t nb = v.batch > 1 ? v.batch : 1;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(v.cols), static_cast<cuuint64_t>(v.rows),
                        static_cast<cuuint64_t>(nb)};
  const int64_t bstride = v.batch > 1 ? v.batch_stride : v.rows * v.ld;
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(v.ld * es),
                           static_cast<cuuint64_t>(bstride * es)};
  cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_rows), 1};  // 64 columns: 128 bytes
  cuuint32_t estr[3] = {1, 1, 1};
  CUtensorMap m{};
  const CUresult r = encode_fn()(
      &m, v.dtype == DType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      3, const_cast<void*>(v.data), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) fail("sym_wgmma: cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
  return m;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Per device (ids below kMaxDevices): its multiprocessor count where it is an sm_90 device and
// the driver has cuTensorMapEncodeTiled (0 otherwise, -1 not yet asked), and whether each
// instantiation's shared-memory limit was raised there.
constexpr int kMaxDevices = 64;
std::mutex g_mutex;
int g_sms[kMaxDevices];
bool g_sms_known[kMaxDevices];
uint32_t g_smem_set[kMaxDevices];  // bit per instantiation

int sm_count_and_check(int* device_out = nullptr) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (device_out) *device_out = dev;
  if (dev < 0 || dev >= kMaxDevices) return 0;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_sms_known[dev]) {
    int major = 0, minor = 0, n = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 0;
    }
    g_sms[dev] = (major == 9 && minor == 0 && encode_fn() != nullptr) ? n : 0;
    g_sms_known[dev] = true;
  }
  return g_sms[dev];
}

// The launch of the pair kernels (clusters of two CTAs along x), with programmatic dependent launch
// where `pdl`; the occupancy query below asks about the same configuration. Not copyable: cfg
// points at attr.
struct PairConfig {
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg{};
  PairConfig(int grid, cudaStream_t s, bool pdl) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = kSmemBytes;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 2 : 1;
  }
  PairConfig(const PairConfig&) = delete;
  PairConfig& operator=(const PairConfig&) = delete;
};

template <bool kBF16, bool kHasD, bool kBandedIn, bool kPair>
void launch_typed(const CUtensorMap (&maps)[6], const SymParams& prm, int grid, int dev, cudaStream_t s) {
  constexpr auto kernel = sym_wgmma_kernel<kBF16, kHasD, kBandedIn, kPair>;
  constexpr uint32_t bit = 1u << ((kPair ? 8 : 0) + (kBF16 ? 4 : 0) + (kHasD ? 2 : 0) + (kBandedIn ? 1 : 0));
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!(g_smem_set[dev] & bit)) {
      DION3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
      g_smem_set[dev] |= bit;
    }
  }
  if constexpr (!kPair) {
    launch_pdl(kernel, grid, kThreads, kSmemBytes, s, maps[0], maps[1], maps[2], maps[3], maps[4], maps[5], prm);
  } else {
    const PairConfig pc(grid, s, true);
    DION3_CUDA_CHECK(cudaLaunchKernelEx(&pc.cfg, kernel, maps[0], maps[1], maps[2], maps[3], maps[4], maps[5], prm));
  }
}

// How many clusters of two of the kernel's CTAs can be resident on this device at once (asked
// once per device): the persistent grid of pairs is no larger, so that it runs in one wave; 0 (no
// cluster fits): launches take one CTA per tile.
int g_pair_clusters[kMaxDevices];
bool g_pairs_asked[kMaxDevices];
int resident_pair_clusters(int dev) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_pairs_asked[dev]) {
    constexpr auto kernel = sym_wgmma_kernel<false, false, false, true>;
    const PairConfig pc(2, nullptr, false);
    int clusters = 0;
    const bool ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) == cudaSuccess &&
                    cudaOccupancyMaxActiveClusters(&clusters, kernel, &pc.cfg) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();  // the query's own error: launches then take one CTA per tile
    g_pair_clusters[dev] = ok ? clusters : 0;
    g_pairs_asked[dev] = true;
  }
  return g_pair_clusters[dev];
}

// A TMA-addressable operand: 16-byte aligned base, rows and matrices 16-byte multiples apart.
bool tma_ok(const MatrixView& v) {
  if (!aligned16(v.data) || (v.ld * 2) % 16 != 0) return false;
  return v.batch > 1 ? (v.batch_stride * 2) % 16 == 0 : (v.rows * v.ld * 2) % 16 == 0;
}

}  // namespace

bool sym_wgmma_available() { return sm_count_and_check() > 0; }

double sym_wgmma_flop_fraction(int64_t p) {
  // Each consumer warpgroup's 64-row block R multiplies the 64-column blocks 0..R (TileRows:
  // nblk), rows of R past p included: 1 + 2 + ... + c blocks over c blocks of rows.
  const double c = static_cast<double>((p + kEB - 1) / kEB);
  return kEB * kEB * c * (c + 1) / 2 / (static_cast<double>(p) * p);
}

bool sym_wgmma_supported(const MatrixView& A, const MatrixView& B, const MatrixView* D,
                         const MatrixView& C) {
  if (sm_count_and_check() <= 0) return false;
  if (A.dtype != B.dtype || (A.dtype != DType::F16 && A.dtype != DType::BF16)) return false;
  if (C.dtype != A.dtype) return false;
  if (D && (D->dtype != C.dtype || D->rows != C.rows || D->cols != C.cols ||
            (D->batch != C.batch && D->batch != 1) || !tma_ok(*D)))
    return false;
  const int64_t p = C.rows, k = A.cols;
  if (p <= 0 || k <= 0 || C.cols != p || A.rows != p || B.rows != p || B.cols != k) return false;
  if (p > (int64_t{1} << 30) || k > (int64_t{1} << 30) || C.batch > (int64_t{1} << 30)) return false;
  for (const MatrixView* v : {&A, &B})
    if ((v->batch != C.batch && v->batch != 1) || !tma_ok(*v)) return false;
  if (!tma_ok(C)) return false;
  const int64_t tiles = (p + kBM - 1) / kBM;
  const int64_t m = tiles / 2;
  const int64_t tpm = (tiles & 1) ? (m + 1) * (m + 1) : m * (m + 1);
  if (tpm * C.batch > (int64_t{1} << 30)) return false;
  return true;
}

void launch_sym_wgmma(const MatrixView& A, const MatrixView& B, float alpha, float beta,
                      const MatrixView* D, float gamma, const MatrixView& C, cudaStream_t s,
                      bool banded_in, bool banded_out, bool skip_epilogue, int max_ctas, bool pairs) {
  static_assert(kSymBand == kBN, "a banded matrix's diagonal blocks are the schedule's 256-column blocks");
  if (!sym_wgmma_supported(A, B, D, C)) fail("sym_wgmma: unsupported operands", Status::Unsupported);
  const int64_t p = C.rows, batch = C.batch;
  if (banded_in && A.cols != p) fail("sym_wgmma: banded operands must be square");
  if (batch == 0 || p == 0) return;
  SymParams prm{};
  const bool has_d = D != nullptr && beta != 0.0f;
  prm.alpha = alpha;
  prm.beta = has_d ? beta : 0.0f;
  prm.gamma = gamma;
  prm.skip_epilogue = skip_epilogue ? 1 : 0;
  prm.banded_out = banded_out ? 1 : 0;
  prm.p = static_cast<int>(p);
  prm.kblocks = static_cast<int>((A.cols + kBK - 1) / kBK);
  prm.a_batched = A.batch > 1;
  prm.b_batched = B.batch > 1;
  prm.same_ab = A.data == B.data && A.ld == B.ld && A.batch == B.batch && A.batch_stride == B.batch_stride;
  prm.d_batched = has_d && D->batch > 1;
  const int tiles = static_cast<int>((p + kBM - 1) / kBM), m = tiles / 2;
  int dev = 0;
  const int sms = sm_count_and_check(&dev);
  const int ctas = max_ctas > 0 ? std::min(sms, max_ctas) : sms;
  const int pair_clusters = pairs && ctas >= 2 ? std::min(ctas / 2, resident_pair_clusters(dev)) : 0;
  const bool pair = pair_clusters > 0;
  int grid = 0;
  if (pair) {  // units of two 128-row blocks (see the kernel's pairs)
    const int units = (tiles + 1) / 2;
    prm.units_per_mat = units * (units + 1) / 2;
    prm.total_tiles = static_cast<int>(prm.units_per_mat * batch);
    grid = 2 * static_cast<int>(std::min<int64_t>(pair_clusters, prm.total_tiles));
  } else {
    const int tiles_per_mat = (tiles & 1) ? (m + 1) * (m + 1) : m * (m + 1);
    prm.even_diag_per_mat = (tiles + 1) / 2;
    prm.full_per_mat = tiles_per_mat - prm.even_diag_per_mat;
    prm.full_tiles = static_cast<int>(prm.full_per_mat * batch);
    prm.total_tiles = static_cast<int>(tiles_per_mat * batch);
    grid = static_cast<int>(std::min<int64_t>(ctas, prm.total_tiles));
  }
  static_assert(kBK == 64 && kEB == 64, "every tensor map box is 64 columns wide");
  const CUtensorMap mc = make_map(C, kEB);
  // B's boxes: its 256 rows of a tile, or with pairs the 128 of one CTA's half. The 64-row maps
  // of A and B: their transposed blocks (banded_in); otherwise unused.
  const CUtensorMap ma = make_map(A, kBM), mb = make_map(B, pair ? kBM : kBN);
  const CUtensorMap maps[6] = {ma, mb, mc, has_d ? make_map(*D, kEB) : mc, banded_in ? make_map(A, kEB) : ma,
                               banded_in ? make_map(B, kEB) : mb};
  // The one dtype (D or not, banded inputs or not, pairs or not) dispatch of the kernel.
  auto go = [&](auto bf16, auto hd) {
    constexpr bool kB = decltype(bf16)::value, kD = decltype(hd)::value;
    if (pair) {
      if (banded_in) launch_typed<kB, kD, true, true>(maps, prm, grid, dev, s);
      else launch_typed<kB, kD, false, true>(maps, prm, grid, dev, s);
    } else {
      if (banded_in) launch_typed<kB, kD, true, false>(maps, prm, grid, dev, s);
      else launch_typed<kB, kD, false, false>(maps, prm, grid, dev, s);
    }
  };
  if (A.dtype == DType::BF16) {
    if (has_d) go(std::true_type{}, std::true_type{});
    else go(std::true_type{}, std::false_type{});
  } else {
    if (has_d) go(std::false_type{}, std::true_type{});
    else go(std::false_type{}, std::false_type{});
  }
}

}  // namespace dion3::cuda
