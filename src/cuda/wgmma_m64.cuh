// wgmma_m64.cuh — the Hopper wgmma.mma_async m64nNk16 instructions (fp16/bf16 in, fp32
// accumulate, both operands from shared memory through descriptors, each K-major or MN-major)
// for N = 64, 128, 192, 256,
// over one 128-register accumulator array: N = 64·n uses registers 0 .. 32·n − 1, which hold the
// first N columns of the m64n256 fragment layout, so a narrower product leaves the layout of the
// columns it computes unchanged. kAccumulate = false starts a new sum (D = A·B, the registers
// written only, so the compiler sees no dependence on their old values); true adds (D += A·B).
// sm_90a only; empty elsewhere.
#pragma once

#include <cstdint>

namespace dion3::cuda {

// The accumulator operand lists: R, the register names of the asm text; W / RW, write-only or
// read-write constraints on d[0 .. n-1].
#define DION3_R32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define DION3_R64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define DION3_R96 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}"
#define DION3_R128 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define DION3_ACC8_W(i) "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), "=f"(d[i + 6]), "=f"(d[i + 7])
#define DION3_ACC32AT_W(i) DION3_ACC8_W(i), DION3_ACC8_W(i + 8), DION3_ACC8_W(i + 16), DION3_ACC8_W(i + 24)
#define DION3_ACC8_RW(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define DION3_ACC32AT_RW(i) DION3_ACC8_RW(i), DION3_ACC8_RW(i + 8), DION3_ACC8_RW(i + 16), DION3_ACC8_RW(i + 24)
#define DION3_ACC32_W DION3_ACC32AT_W(0)
#define DION3_ACC64_W DION3_ACC32AT_W(0), DION3_ACC32AT_W(32)
#define DION3_ACC96_W DION3_ACC64_W, DION3_ACC32AT_W(64)
#define DION3_ACC128_W DION3_ACC96_W, DION3_ACC32AT_W(96)
#define DION3_ACC32_RW DION3_ACC32AT_RW(0)
#define DION3_ACC64_RW DION3_ACC32AT_RW(0), DION3_ACC32AT_RW(32)
#define DION3_ACC96_RW DION3_ACC64_RW, DION3_ACC32AT_RW(64)
#define DION3_ACC128_RW DION3_ACC96_RW, DION3_ACC32AT_RW(96)
// One instruction: n accumulator registers, N columns, type T, the operand names of the two
// descriptors DESC ("%n, %n+1") and of the two transpose immediates TR ("%n+2, %n+3"), scale-d S
// (0: new sum, 1: add).
#define DION3_WGMMA(n, N, T, S, MODE, DESC, TR)                                                                \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #T "." #T " " DION3_R##n ", " DESC ", " #S  \
               ", 1, 1, " TR ";\n"                                                                            \
               : DION3_ACC##n##_##MODE                                                                       \
               : "l"(da), "l"(db), "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0))

// kTransA / kTransB: that operand is MN-major in shared memory (smem_desc_mn), else K-major.
template <bool kBF16, int kN, bool kAccumulate, bool kTransA = false, bool kTransB = false>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[128], uint64_t da, uint64_t db) {
  static_assert(kN == 64 || kN == 128 || kN == 192 || kN == 256, "wgmma m64nNk16: N in {64, 128, 192, 256}");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DION3_WGMMA_N(n, N, DESC, TR)                                             \
  if constexpr (kN == N) {                                                        \
    if constexpr (kBF16 && kAccumulate) DION3_WGMMA(n, N, bf16, 1, RW, DESC, TR); \
    else if constexpr (kBF16) DION3_WGMMA(n, N, bf16, 0, W, DESC, TR);           \
    else if constexpr (kAccumulate) DION3_WGMMA(n, N, f16, 1, RW, DESC, TR);     \
    else DION3_WGMMA(n, N, f16, 0, W, DESC, TR);                                 \
  }
  DION3_WGMMA_N(32, 64, "%32, %33", "%34, %35")
  DION3_WGMMA_N(64, 128, "%64, %65", "%66, %67")
  DION3_WGMMA_N(96, 192, "%96, %97", "%98, %99")
  DION3_WGMMA_N(128, 256, "%128, %129", "%130, %131")
#undef DION3_WGMMA_N
#endif
}

#undef DION3_WGMMA
#undef DION3_R32
#undef DION3_R64
#undef DION3_R96
#undef DION3_R128
#undef DION3_ACC64_W
#undef DION3_ACC96_W
#undef DION3_ACC128_W
#undef DION3_ACC32_W
#undef DION3_ACC32AT_W
#undef DION3_ACC8_W
#undef DION3_ACC64_RW
#undef DION3_ACC96_RW
#undef DION3_ACC128_RW
#undef DION3_ACC32_RW
#undef DION3_ACC32AT_RW
#undef DION3_ACC8_RW

}  // namespace dion3::cuda
