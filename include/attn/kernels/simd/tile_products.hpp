// attn/kernels/simd/tile_products.hpp: the vector kernels' building blocks, compiled for every
// vector instruction set (simd/foreach_isa.hpp): the tile products of flash, decode and the
// backward (tile_products.inl, decode_products.inl, backward_products.inl) and the GEMM's
// micro-kernel and packing (gemm_micro.inl), in attn::detail::avx2 and attn::detail::avx512. Their
// generic counterparts, on Eigen, are in kernels/generic.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/dropout.hpp"
#include "attn/kernels/simd/avx2.hpp"
#include "attn/kernels/simd/avx512.hpp"
#include "attn/quantized.hpp"

#define ATTN_ISA_SOURCE "attn/kernels/simd/gemm_micro.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"

#define ATTN_ISA_SOURCE "attn/kernels/simd/tile_products.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"

namespace attn::detail {

/// Key blocks between the rows decode reads and those it also requests into L2.
inline constexpr Index decode_far_blocks = 2;

/// Whether decode requests rows of S decode_far_blocks blocks on into L2, besides the next
/// block's into L1 (BlockRowReader in decode_products.inl, far_rows in
/// kernels/online_softmax.hpp): q8_0 only. Float and 16-bit rows go to L2 a block ahead
/// already, and q4_0 decode, bound by its arithmetic, ran 1.06-1.08x slower with the requests
/// (docs/performance.md, "Tuning choices": "Decode's far prefetch").
template <class S>
inline constexpr bool decode_far_prefetch = std::is_same_v<S, BlockQ8_0>;

}  // namespace attn::detail

#define ATTN_ISA_SOURCE "attn/kernels/simd/decode_products.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"

#define ATTN_ISA_SOURCE "attn/kernels/simd/backward_products.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"
