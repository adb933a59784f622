// wgmma_m64.cuh — the Hopper wgmma.mma_async m64nNk16 instructions (fp16/bf16 in, fp32
// accumulate, both operands from shared memory through descriptors) for N = 64, 128, 192, 256,
// over one 128-register accumulator array: N = 64·n uses registers 0 .. 32·n − 1, which hold the
// first N columns of the m64n256 fragment layout, so a narrower product leaves the layout of the
// columns it computes unchanged. sm_90a only; empty elsewhere.
#pragma once

#include <cstdint>

namespace dion3::cuda {

#define DION3_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define DION3_ACC32 DION3_ACC8(0), DION3_ACC8(8), DION3_ACC8(16), DION3_ACC8(24)
#define DION3_ACC64 DION3_ACC8(0), DION3_ACC8(8), DION3_ACC8(16), DION3_ACC8(24), DION3_ACC8(32), DION3_ACC8(40), DION3_ACC8(48), DION3_ACC8(56)
#define DION3_ACC96 DION3_ACC8(0), DION3_ACC8(8), DION3_ACC8(16), DION3_ACC8(24), DION3_ACC8(32), DION3_ACC8(40), DION3_ACC8(48), DION3_ACC8(56), DION3_ACC8(64), DION3_ACC8(72), DION3_ACC8(80), DION3_ACC8(88)
#define DION3_ACC128 DION3_ACC8(0), DION3_ACC8(8), DION3_ACC8(16), DION3_ACC8(24), DION3_ACC8(32), DION3_ACC8(40), DION3_ACC8(48), DION3_ACC8(56), DION3_ACC8(64), DION3_ACC8(72), DION3_ACC8(80), DION3_ACC8(88), DION3_ACC8(96), DION3_ACC8(104), DION3_ACC8(112), DION3_ACC8(120)

template <bool kBF16, int kN>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  static_assert(kN == 64 || kN == 128 || kN == 192 || kN == 256, "wgmma m64nNk16: N in {64, 128, 192, 256}");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kN == 64 && kBF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : DION3_ACC32
                 : "l"(da), "l"(db), "r"(scale_d));
  else if constexpr (kN == 64 && !kBF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : DION3_ACC32
                 : "l"(da), "l"(db), "r"(scale_d));
  else if constexpr (kN == 128 && kBF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : DION3_ACC64
                 : "l"(da), "l"(db), "r"(scale_d));
  else if constexpr (kN == 128 && !kBF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : DION3_ACC64
                 : "l"(da), "l"(db), "r"(scale_d));
  else if constexpr (kN == 192 && kBF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}, %96, %97, p, 1, 1, 0, 0;\n}\n"
                 : DION3_ACC96
                 : "l"(da), "l"(db), "r"(scale_d));
  else if constexpr (kN == 192 && !kBF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}, %96, %97, p, 1, 1, 0, 0;\n}\n"
                 : DION3_ACC96
                 : "l"(da), "l"(db), "r"(scale_d));
  else if constexpr (kN == 256 && kBF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : DION3_ACC128
                 : "l"(da), "l"(db), "r"(scale_d));
  else if constexpr (kN == 256 && !kBF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : DION3_ACC128
                 : "l"(da), "l"(db), "r"(scale_d));
#endif
}

#undef DION3_ACC32
#undef DION3_ACC64
#undef DION3_ACC96
#undef DION3_ACC128
#undef DION3_ACC8

}  // namespace dion3::cuda
