// attn/quantized.hpp: 8-bit and 4-bit blocks of 32 values, GGUF's q8_0 and q4_0.
//
//   BlockQ8_0   34 bytes: an fp16 scale d and 32 int8 q;            x ~ d * q
//   BlockQ4_0   18 bytes: an fp16 scale d and 16 bytes of nibbles;  x ~ d * (n - 8)
//               element j (< 16) in the low nibble of byte j, element j + 16 in its high one
//
// Both are byte for byte the blocks of llama.cpp's ggml (block_q8_0, block_q4_0) made by its
// reference quantizers (quantize_row_q8_0_ref, quantize_row_q4_0_ref), so rows can be
// exchanged with GGUF tooling:
//   q8_0: amax = max |x|, d = amax / 127, q = round(x / d) (half away from zero), d stored
//         as fp16 (round to nearest even); the quotient uses the float d, not the fp16 one;
//   q4_0: m = the x of largest |x| (the first one on ties), d = m / -8, n = min(15,
//         trunc(x / d + 8.5)), so m maps to nibble 0 and its sign is kept by d's.
// Every operation rounds to float on its own (no fused multiply-add): a contracted x / d + 8.5
// would round differently from the reference on some values.
//
// Not a number: a block holding a NaN or an infinity gets a NaN scale (and zero quants), so
// all 32 of its values read back as NaN; a quantized cache never turns a NaN into a number.
// (ggml's reference leaves the result undefined there: a NaN to int8 conversion.) A finite
// amax above 127 * 65504 (q8_0) or 8 * 65504 (q4_0) overflows the fp16 scale to infinity, as
// in ggml. A scale below fp16's smallest subnormal is stored as 0 (its block reads back as
// zeros); where the float 1 / d itself overflows (amax below about 1e-37) the quants are 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"

// The quantizers must not be contracted into FMAs (GCC contracts across statements by
// default; clang only within one expression, which these functions never write).
#if defined(__GNUC__) && !defined(__clang__)
#define ATTN_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define ATTN_NO_FP_CONTRACT
#endif

namespace attn {

/// Values per quantized block (QK8_0 and QK4_0 in ggml).
inline constexpr Index quantized_block_values = 32;

/// 32 values as an fp16 scale and 32 int8: x ~ scale * values[j].
struct BlockQ8_0 {
  Eigen::half scale;
  std::int8_t values[quantized_block_values];
};

/// 32 values as an fp16 scale and 32 nibbles: x_j ~ scale * (n_j - 8), n_j = nibbles[j] & 15
/// and n_{j+16} = nibbles[j] >> 4 for j < 16.
struct BlockQ4_0 {
  Eigen::half scale;
  std::uint8_t nibbles[quantized_block_values / 2];
};

static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18,
              "BlockQ8_0 and BlockQ4_0 must have GGUF's sizes (34 and 18 bytes)");
static_assert(std::is_trivially_copyable_v<BlockQ8_0> && std::is_trivially_copyable_v<BlockQ4_0>);

/// The quantized block formats.
template <class S>
inline constexpr bool is_quantized_v = std::is_same_v<S, BlockQ8_0> || std::is_same_v<S, BlockQ4_0>;

/// Values one storage unit of S holds: 32 for a block, 1 for a scalar.
template <class S>
inline constexpr Index values_per_unit_v = is_quantized_v<S> ? quantized_block_values : 1;

namespace detail {

/// Throws unless n is a non-negative multiple of 32.
inline void check_block_count(const char* function, Index n) {
  if (n < 0 || n % quantized_block_values != 0) {
    throw_invalid_argument(function, "the number of values is " + std::to_string(n) +
                                         ": it must be a multiple of 32 (the block size)");
  }
}

/// The block every non-finite row maps to: a NaN scale (all 32 values read back as NaN).
template <class Block>
Block not_a_number_block() {
  Block block{};
  block.scale = Eigen::half(std::numeric_limits<float>::quiet_NaN());
  return block;
}

/// ggml's quantize_row_q8_0_ref on 32 values (a NaN block for non-finite ones).
ATTN_NO_FP_CONTRACT inline BlockQ8_0 quantize_q8_0(const float* x) {
  float amax = 0.0f;
  for (Index j = 0; j < quantized_block_values; ++j) {
    if (!std::isfinite(x[j]))
      return not_a_number_block<BlockQ8_0>();
    amax = std::max(amax, std::fabs(x[j]));
  }
  const float d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ8_0 block{};
  block.scale = Eigen::half(d);
  for (Index j = 0; j < quantized_block_values; ++j) {
    const float scaled = x[j] * inverse;
    // |scaled| <= 127 (up to rounding), so the conversion is exact
    block.values[j] = static_cast<std::int8_t>(std::isfinite(scaled) ? std::round(scaled) : 0.0f);
  }
  return block;
}

/// ggml's quantize_row_q4_0_ref on 32 values (a NaN block for non-finite ones).
ATTN_NO_FP_CONTRACT inline BlockQ4_0 quantize_q4_0(const float* x) {
  float amax = 0.0f, max = 0.0f;
  for (Index j = 0; j < quantized_block_values; ++j) {
    if (!std::isfinite(x[j]))
      return not_a_number_block<BlockQ4_0>();
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ4_0 block{};
  block.scale = Eigen::half(d);
  const auto nibble = [&](float value) -> std::uint8_t {
    const float scaled = value * inverse;
    const float shifted = scaled + 8.5f;
    if (!std::isfinite(shifted))
      return 0;
    return static_cast<std::uint8_t>(std::min(15, static_cast<int>(shifted)));
  };
  constexpr Index half = quantized_block_values / 2;
  for (Index j = 0; j < half; ++j)
    block.nibbles[j] = static_cast<std::uint8_t>(nibble(x[j]) | (nibble(x[j + half]) << 4));
  return block;
}

}  // namespace detail

/// blocks[0, n / 32) = x[0, n) quantized (n a multiple of 32), as ggml's reference quantizer.
template <class Block, class = std::enable_if_t<is_quantized_v<Block>>>
void quantize_blocks(const float* x, Index n, Block* blocks) {
  detail::check_block_count("quantize_blocks", n);
  for (Index b = 0; b < n / quantized_block_values; ++b) {
    const float* values = x + b * quantized_block_values;
    if constexpr (std::is_same_v<Block, BlockQ8_0>)
      blocks[b] = detail::quantize_q8_0(values);
    else
      blocks[b] = detail::quantize_q4_0(values);
  }
}

/// x (n values, a multiple of 32) as blocks.
template <class Block, class = std::enable_if_t<is_quantized_v<Block>>>
std::vector<Block> quantize_blocks(const std::vector<float>& x) {
  const auto n = static_cast<Index>(x.size());
  detail::check_block_count("quantize_blocks", n);
  std::vector<Block> blocks(static_cast<std::size_t>(n / quantized_block_values));
  quantize_blocks(x.data(), n, blocks.data());
  return blocks;
}

/// The value x_j = scale * q_j of element j (< 32) of a block.
inline float block_value(const BlockQ8_0& block, Index j) {
  return static_cast<float>(block.scale) * static_cast<float>(block.values[j]);
}
inline float block_value(const BlockQ4_0& block, Index j) {
  constexpr Index half = quantized_block_values / 2;
  const int nibble = j < half ? block.nibbles[j] & 15 : block.nibbles[j - half] >> 4;
  return static_cast<float>(block.scale) * static_cast<float>(nibble - 8);
}

/// x[0, 32 * count) = the values of blocks[0, count).
template <class Block, class = std::enable_if_t<is_quantized_v<Block>>>
void dequantize_blocks(const Block* blocks, Index count, float* x) {
  if (count < 0) {
    detail::throw_invalid_argument(
        "dequantize_blocks",
        "the number of blocks is " + std::to_string(count) + ": it must not be negative");
  }
  for (Index b = 0; b < count; ++b) {
    for (Index j = 0; j < quantized_block_values; ++j)
      x[b * quantized_block_values + j] = block_value(blocks[b], j);
  }
}

/// The values of `blocks`, 32 per block.
template <class Block, class = std::enable_if_t<is_quantized_v<Block>>>
std::vector<float> dequantize_blocks(const std::vector<Block>& blocks) {
  std::vector<float> x(blocks.size() * static_cast<std::size_t>(quantized_block_values));
  dequantize_blocks(blocks.data(), static_cast<Index>(blocks.size()), x.data());
  return x;
}

}  // namespace attn
