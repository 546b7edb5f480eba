// attn/precision.hpp: storage scalars and the scalar the arithmetic runs in.
//
// Tensors may be stored in float, double, Eigen::half or Eigen::bfloat16. The arithmetic
// (GEMMs, softmax, the running sums of flash) always runs in the compute scalar: double for
// double, float for everything else. 16-bit data are widened tile by tile as the kernels
// stream them; nothing ever accumulates in 16 bits. (Over 16384 keys an fp16 accumulator
// stalls once the softmax denominator reaches 2048, where fp16's spacing is 2: in
// tests/test_precision.cpp it is off by 2.3 on outputs near 2, float accumulation by 1e-3,
// the rounding of the half output itself.) ComputePrecision::bf16 (attn/options.hpp) lets
// flash multiply bfloat16 operands where the CPU has bf16 dot products; the sums stay float.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"

namespace attn {

/// The 16-bit storage scalars: widened to float for all arithmetic.
template <class S>
inline constexpr bool is_16bit_scalar_v =
    std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>;

/// The scalars a tensor may be stored in: the standard floating types and the 16-bit ones.
template <class S>
inline constexpr bool is_storage_scalar_v = std::is_floating_point_v<S> || is_16bit_scalar_v<S>;

/// The scalar the arithmetic on S-stored data runs in: float for the 16-bit types, S itself
/// otherwise (float, double, or long double, which tests use as a wider reference).
template <class S>
using compute_scalar_t = std::conditional_t<is_16bit_scalar_v<S>, float, S>;

namespace detail {
/// The storage bf16 products read (ComputePrecision::bf16): float, rounded to bfloat16 as it
/// is read, and bfloat16 itself; half and quantized blocks are not rounded a second time.
template <class S>
inline constexpr bool bf16_readable_v =
    std::is_same_v<S, float> || std::is_same_v<S, Eigen::bfloat16>;
}  // namespace detail

}  // namespace attn
