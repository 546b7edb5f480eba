// attn/kernels/online_softmax.hpp: the flash and decode kernels of every instruction set,
// and the dispatch to the one that runs.
//
// kernels/online_softmax.inl is compiled three times, as generic::Kernels (Eigen's
// products, any scalar), avx2::Kernels and avx512::Kernels (float, the vector products of
// simd/tile_products.inl inside their target regions). One source, so the online softmax,
// the finishing step and the merge of partial results are the same code for all of them;
// an instruction set supplies only its tile products.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/generic.hpp"
#include "attn/kernels/simd/avx2.hpp"
#include "attn/kernels/simd/avx512.hpp"
#include "attn/kernels/simd/target.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/mask.hpp"
#include "attn/tensor.hpp"

namespace attn::detail::generic {
#include "attn/kernels/online_softmax.inl"
}  // namespace attn::detail::generic

#if ATTN_X86_DISPATCH
ATTN_BEGIN_TARGET_AVX2
namespace attn::detail::avx2 {
inline constexpr bool widens_in_registers = true;
#include "attn/kernels/online_softmax.inl"  // NOLINT(readability-duplicate-include): per ISA
}  // namespace attn::detail::avx2
ATTN_END_TARGET

ATTN_BEGIN_TARGET_AVX512
namespace attn::detail::avx512 {
inline constexpr bool widens_in_registers = true;
#include "attn/kernels/online_softmax.inl"  // NOLINT(readability-duplicate-include): per ISA
}  // namespace attn::detail::avx512
ATTN_END_TARGET
#endif

namespace attn::detail {

/// f(Kernels{}) with the kernels of `isa` (the generic ones for any scalar but float).
template <class T, class F>
decltype(auto) with_kernels(Isa isa, F&& f) {
#if ATTN_X86_DISPATCH
  if constexpr (std::is_same_v<T, float>) {
    if (isa == Isa::avx512)
      return f(avx512::Kernels{});
    if (isa == Isa::avx2)
      return f(avx2::Kernels{});
  }
#endif
  (void)isa;
  return f(generic::Kernels{});
}

}  // namespace attn::detail
