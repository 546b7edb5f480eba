// attn/kernels/dispatch.hpp: the one place that turns an instruction set into its kernels.
//
// Every instruction-set namespace (generic, avx2, avx512) ends with one Table
// (simd/table.inl) of its entry points; avx512_vnni's Table is avx512's with decode's and
// flash's scores on int8 dot products added (kernels/int8_decode.hpp, kernels/int8_tiles.hpp),
// and avx512_bf16's is avx512_vnni's with the flash kernel and the backward's tile step on bf16
// dot products added (kernels/bf16_tiles.hpp, kernels/bf16_backward.hpp):
//
//   forward<T, SK, SV>  flash_tile                           (kernels/online_softmax.inl)
//   decode<T, SK, SV>  decode_split, merge_splits            (kernels/online_softmax.inl)
//   backward<T>     backward_key_tile                        (kernels/flash_backward.inl)
//   gemm<float>     the projections' GEMM                    (kernels/gemm.hpp)
//   rope<S>         the rotation of RoPE rows                (kernels/simd/rope.inl)
//   widening<S>     16-bit rows widened to float             (simd/tile_products.inl)
//
// and dispatch(isa, pick) is the only switch on Isa in the library: the callers below take
// the instruction set from their plan (attn/plan.hpp, the only reader of the active set), so a
// call never runs two instruction sets, whatever set_isa() does meanwhile on another thread.
// The mods' tile loops (kernels/mod_loops.hpp) are compiled per instruction set for each
// user's callable and picked by the same plan's isa. Every scalar but float has only the
// generic kernels. Adding an instruction set: its primitives header, one block in
// simd/foreach_isa.hpp and one case here (docs/instruction-sets.md).
#pragma once

#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/backward_tiles.hpp"
#include "attn/kernels/bf16_backward.hpp"
#include "attn/kernels/bf16_tiles.hpp"
#include "attn/kernels/gemm.hpp"
#include "attn/kernels/int8_decode.hpp"
#include "attn/kernels/int8_tiles.hpp"
#include "attn/kernels/online_softmax.hpp"
#include "attn/kernels/rope.hpp"
#include "attn/precision.hpp"

namespace attn::detail {

/// The flash kernel of one instruction set for compute scalar T, K stored as SK and V as SV
/// (each T, 16-bit, or quantized blocks).
template <class T, class SK, class SV = SK>
struct ForwardKernels {
  Isa isa;
  Index lanes;  ///< flash query tiles are padded to whole vectors of this many
  decltype(&generic::flash_tile<T, SK, SV>) flash_tile;
  /// The same on bf16 dot products (KernelPlan::bf16_products): null but on avx512_bf16.
  decltype(&generic::flash_tile<T, SK, SV>) flash_tile_bf16 = nullptr;
  /// The same with q k^T on int8 dot products (KernelPlan::int8_products): null but on
  /// avx512_vnni and avx512_bf16.
  decltype(&generic::flash_tile<T, SK, SV>) flash_tile_int8 = nullptr;

  Index padded(Index n) const { return (n + lanes - 1) / lanes * lanes; }
};

/// The decode kernel of one instruction set for compute scalar T, K stored as SK and V as SV
/// (each T, 16-bit, or quantized blocks).
template <class T, class SK, class SV>
struct DecodeKernels {
  Isa isa;
  bool widens_kv_in_registers;  ///< decode reads stored K/V itself (else widened per block)
  decltype(&generic::decode_split<T, SK, SV>) decode_split;
  decltype(&generic::merge_splits<T>) merge_splits;
  /// decode_split with the scores on int8 products (KernelPlan::int8_products): null but on
  /// avx512_vnni and avx512_bf16, for K stored as q8_0 or q4_0.
  decltype(&generic::decode_split<T, SK, SV>) decode_split_int8 = nullptr;
};

/// The flash backward's tile step of one instruction set for compute scalar T.
template <class T>
struct BackwardKernels {
  Isa isa;
  Index lanes;  ///< key tiles are padded to whole vectors of this many
  decltype(&generic::backward_key_tile<T>) backward_key_tile;
  /// The same on bf16 dot products (KernelPlan::bf16_products): null but on avx512_bf16.
  decltype(&generic::backward_key_tile<T>) backward_key_tile_bf16 = nullptr;

  Index padded(Index n) const { return (n + lanes - 1) / lanes * lanes; }
};

/// c (M, N) = a (M, K) * b (K, N) [+ c] [+ bias]: kernels/gemm.hpp's gemm_of.
using GemmKernel = void (*)(Index m, Index n, Index k, const float* a, Index lda, const float* b,
                            Index ldb, float* c, Index ldc, const float* bias, bool accumulate,
                            bool parallel);
/// Rotates rows of S in place by a float table (kernels/rope.hpp).
template <class S>
using RopeKernel = void (*)(S* x, Index rows, Index row_stride, const float* table,
                            Index rotary_dim, const Index* positions, bool interleaved);
/// dst[0:n) = src[0:n) widened to float.
template <class S>
using WidenKernel = void (*)(const S* src, float* dst, Index n);

}  // namespace attn::detail

#define ATTN_ISA_SOURCE "attn/kernels/simd/table.inl"
#include "attn/kernels/simd/foreach_isa.hpp"

#if ATTN_X86_DISPATCH
ATTN_BEGIN_TARGET_AVX512_VNNI
namespace attn::detail::avx512_vnni {

/// decode_split on int8 products where it applies (float compute, K stored as q8_0 or q4_0),
/// else null.
template <class T, class SK, class SV>
constexpr decltype(&avx512::decode_split<T, SK, SV>) int8_decode_split() {
  if constexpr (std::is_same_v<T, float> && is_quantized_v<SK>)
    return &decode_split_int8<T, SK, SV>;
  else
    return nullptr;
}

/// The flash tile on int8 q k^T where it applies (float compute), else null.
template <class T, class SK, class SV>
constexpr decltype(&avx512::flash_tile<T, SK, SV>) int8_flash_tile() {
  if constexpr (std::is_same_v<T, float>)
    return &flash_tile_int8<T, SK, SV>;
  else
    return nullptr;
}

/// avx512's table, and decode's and flash's scores on int8 products.
struct Table : avx512::Table {
  static constexpr Isa level = isa;
  static const char* name() { return isa_name(level); }

  template <class T, class SK, class SV>
  static constexpr ForwardKernels<T, SK, SV> forward{level, lanes, &avx512::flash_tile<T, SK, SV>,
                                                     nullptr, int8_flash_tile<T, SK, SV>()};

  template <class T, class SK, class SV>
  static constexpr DecodeKernels<T, SK, SV> decode{
      level, avx512::widens_in_registers, &avx512::decode_split<T, SK, SV>,
      &avx512::merge_splits<T>, int8_decode_split<T, SK, SV>()};
};

}  // namespace attn::detail::avx512_vnni
ATTN_END_TARGET

ATTN_BEGIN_TARGET_AVX512_BF16
namespace attn::detail::avx512_bf16 {

/// The flash tile on bf16 products where it applies (float compute, K and V stored as float
/// or bfloat16), else null.
template <class T, class SK, class SV>
constexpr decltype(&avx512::flash_tile<T, SK, SV>) bf16_flash_tile() {
  if constexpr (std::is_same_v<T, float> && bf16_readable_v<SK> && bf16_readable_v<SV>)
    return &flash_tile_bf16<T, SK, SV>;
  else
    return nullptr;
}

/// The flash backward's tile step on bf16 products where it applies (float compute), else
/// null.
template <class T>
constexpr decltype(&avx512::backward_key_tile<T>) bf16_backward_key_tile() {
  if constexpr (std::is_same_v<T, float>)
    return &backward_key_tile_bf16<T>;
  else
    return nullptr;
}

/// avx512_vnni's table, and the flash tile and the backward's tile step on bf16 products.
struct Table : avx512_vnni::Table {
  static constexpr Isa level = isa;
  static const char* name() { return isa_name(level); }

  template <class T, class SK, class SV>
  static constexpr ForwardKernels<T, SK, SV> forward{level, lanes, &avx512::flash_tile<T, SK, SV>,
                                                     bf16_flash_tile<T, SK, SV>(),
                                                     avx512_vnni::int8_flash_tile<T, SK, SV>()};
  template <class T, class SK, class SV>
  static constexpr DecodeKernels<T, SK, SV> decode{
      level, avx512::widens_in_registers, &avx512::decode_split<T, SK, SV>,
      &avx512::merge_splits<T>, avx512_vnni::int8_decode_split<T, SK, SV>()};
  template <class T>
  static constexpr BackwardKernels<T> backward{level, lanes, &avx512::backward_key_tile<T>,
                                               bf16_backward_key_tile<T>()};
};

}  // namespace attn::detail::avx512_bf16
ATTN_END_TARGET
#endif

namespace attn::detail {

/// pick(the Table of `isa`): the only switch on the instruction set.
template <class Pick>
decltype(auto) dispatch(Isa isa, const Pick& pick) {
  ATTN_DISPATCH_OBSERVER(isa);
#if ATTN_X86_DISPATCH
  switch (isa) {
    case Isa::avx512_bf16:
      return pick(avx512_bf16::Table{});
    case Isa::avx512_vnni:
      return pick(avx512_vnni::Table{});
    case Isa::avx512:
      return pick(avx512::Table{});
    case Isa::avx2:
      return pick(avx2::Table{});
    case Isa::generic:
      break;
  }
#endif
  return pick(generic::Table{});
}

/// The flash kernel of `isa` (the generic one for any scalar but float).
template <class T, class SK, class SV = SK>
const ForwardKernels<T, SK, SV>& forward_kernels(Isa isa) {
  if constexpr (std::is_same_v<T, float>) {
    return dispatch(isa, [](auto table) -> const ForwardKernels<T, SK, SV>& {
      return decltype(table)::template forward<T, SK, SV>;
    });
  } else {
    ATTN_DISPATCH_OBSERVER(isa);
    return generic::Table::forward<T, SK, SV>;
  }
}

/// The decode kernel of `isa` (the generic one for any scalar but float).
template <class T, class SK, class SV>
const DecodeKernels<T, SK, SV>& decode_kernels(Isa isa) {
  if constexpr (std::is_same_v<T, float>) {
    return dispatch(isa, [](auto table) -> const DecodeKernels<T, SK, SV>& {
      return decltype(table)::template decode<T, SK, SV>;
    });
  } else {
    ATTN_DISPATCH_OBSERVER(isa);
    return generic::Table::decode<T, SK, SV>;
  }
}

/// The flash backward's tile step of `isa` (the generic one for any scalar but float).
template <class T>
const BackwardKernels<T>& backward_kernels(Isa isa) {
  if constexpr (std::is_same_v<T, float>) {
    return dispatch(isa, [](auto table) -> const BackwardKernels<T>& {
      return decltype(table)::template backward<T>;
    });
  } else {
    ATTN_DISPATCH_OBSERVER(isa);
    return generic::Table::backward<T>;
  }
}

/// c (M, N) = a (M, K) * b (K, N) [+ c if accumulate] [+ bias (N) on every row], row-major,
/// strides in elements: attn's packed GEMM on `isa` for float (kernels/gemm.hpp), Eigen's
/// product for every other scalar. c must not overlap a, b or bias. With `parallel` (the
/// plan's, attn/plan.hpp: plan_gemm) the OpenMP threads share it (the same bits for any
/// thread count).
template <class T>
void gemm(Isa isa, Index m, Index n, Index k, const T* a, Index lda, const T* b, Index ldb, T* c,
          Index ldc, const T* bias = nullptr, bool accumulate = false, bool parallel = true) {
  if constexpr (std::is_same_v<T, float>) {
    const GemmKernel kernel =
        dispatch(isa, [](auto table) { return decltype(table)::template gemm<float>; });
    kernel(m, n, k, a, lda, b, ldb, c, ldc, bias, accumulate, parallel);
  } else {
    ATTN_DISPATCH_OBSERVER(isa);
    (void)parallel;
    gemm_generic(m, n, k, a, lda, b, ldb, c, ldc, bias, accumulate);
  }
}

/// Rotates `rows` rows of x (row r at x + r * row_stride) at positions[r] by `table`
/// (kernels/rope.hpp): the vector rotation of `isa` for float tables, else the generic loop.
template <class T, class S>
void rope_rows(Isa isa, S* x, Index rows, Index row_stride, const T* table, Index rotary_dim,
               const Index* positions, bool interleaved) {
  if constexpr (std::is_same_v<T, float> && !std::is_same_v<S, double>) {
    const RopeKernel<S> kernel =
        dispatch(isa, [](auto set) { return decltype(set)::template rope<S>; });
    kernel(x, rows, row_stride, table, rotary_dim, positions, interleaved);
  } else {
    ATTN_DISPATCH_OBSERVER(isa);
    generic::rope_rows(x, rows, row_stride, table, rotary_dim, positions, interleaved);
  }
}

/// dst[0:n) = src[0:n) widened to float (exact), with the vector conversions of `isa`:
/// Eigen 3.4's cast<float>() of half converts one scalar at a time (about 1 ns per element),
/// a vector conversion 8 or 16 per instruction.
template <class S, class = std::enable_if_t<std::is_same_v<S, Eigen::half> ||
                                            std::is_same_v<S, Eigen::bfloat16>>>
void widen(Isa isa, const S* src, float* dst, Index n) {
  const WidenKernel<S> kernel =
      dispatch(isa, [](auto table) { return decltype(table)::template widening<S>; });
  kernel(src, dst, n);
}

}  // namespace attn::detail

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_GENERIC_KERNEL_INSTANCES(ATTN_EXTERN_INSTANCE)
#if ATTN_X86_DISPATCH
ATTN_VECTOR_KERNEL_INSTANCES(ATTN_EXTERN_INSTANCE, attn::detail::avx2)
ATTN_VECTOR_KERNEL_INSTANCES(ATTN_EXTERN_INSTANCE, attn::detail::avx512)
ATTN_INT8_KERNEL_INSTANCES(ATTN_EXTERN_INSTANCE)
ATTN_BF16_KERNEL_INSTANCES(ATTN_EXTERN_INSTANCE)
#endif
#endif
