// attn/kernels/simd/foreach_isa.hpp: compiles one per-instruction-set source once for every
// instruction set (Highway's foreach_target), the only place that lists them:
//
//   #define ATTN_ISA_SOURCE "attn/kernels/online_softmax.inl"
//   #include "attn/kernels/simd/foreach_isa.hpp"
//
// includes the source inside namespace attn::detail::generic, then (x86-64 with GCC or Clang)
// inside attn::detail::avx2 and attn::detail::avx512, each in its target region
// (simd/target.hpp), so that every function the source defines exists once per instruction
// set, compiled for it whatever flags the translation unit has. Define ATTN_ISA_VECTOR_ONLY as
// well for a source written on the vector primitives (simd/avx2.hpp, simd/avx512.hpp), which
// the generic namespace does not have. Both macros are undefined afterwards.
//
// The includer includes what the source uses first (the primitives of simd/avx2.hpp and
// simd/avx512.hpp, kernels/generic.hpp). No include guard: included once per source (without
// ATTN_ISA_SOURCE it does nothing). Adding an instruction set is one more block here, its
// primitives header and its case in kernels/dispatch.hpp (docs/instruction-sets.md).

#include "attn/kernels/simd/target.hpp"

#ifdef ATTN_ISA_SOURCE

#ifndef ATTN_ISA_VECTOR_ONLY
namespace attn::detail::generic {
#include ATTN_ISA_SOURCE  // NOLINT(readability-duplicate-include): once per instruction set
}  // namespace attn::detail::generic
#endif

#if ATTN_X86_DISPATCH
ATTN_BEGIN_TARGET_AVX2
namespace attn::detail::avx2 {
#include ATTN_ISA_SOURCE  // NOLINT(readability-duplicate-include): once per instruction set
}  // namespace attn::detail::avx2
ATTN_END_TARGET

ATTN_BEGIN_TARGET_AVX512
namespace attn::detail::avx512 {
#include ATTN_ISA_SOURCE  // NOLINT(readability-duplicate-include): once per instruction set
}  // namespace attn::detail::avx512
ATTN_END_TARGET
#endif

#undef ATTN_ISA_SOURCE
#undef ATTN_ISA_VECTOR_ONLY

#endif  // ATTN_ISA_SOURCE
