// attn/options.hpp: everything about an attention call except the tensors.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "attn/config.hpp"
#include "attn/problem.hpp"

namespace attn {

/// Which kernel computes the attention (kernels/*.hpp; the extra memory of each is in
/// docs/kernels.md). Only naive can return the attention weights: asking chunked, flash or
/// decode for them throws std::invalid_argument (automatic falls back to naive when weights
/// are requested).
enum class Algorithm : std::uint8_t {
  automatic,  ///< chosen by attn/plan.hpp from the shape, the scalar and the CPU
  naive,      ///< materialises the (Lq, Lk) scores; the only one that returns weights
  chunked,    ///< query blocks of query_tile rows against all their visible keys
  flash,      ///< query tiles x key tiles with an online softmax; never holds (Lq, Lk)
  decode,     ///< few queries, many keys: a GQA group per tile, keys split across threads
};

inline const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::automatic:
      return "automatic";
    case Algorithm::naive:
      return "naive";
    case Algorithm::chunked:
      return "chunked";
    case Algorithm::flash:
      return "flash";
    case Algorithm::decode:
      return "decode";
  }
  return "unknown";
}

/// The arithmetic of the two products of attention, q k^T and P V (docs/precision.md,
/// "bf16 products" and "int8 products"). Each low precision is a permission, not a demand;
/// KernelPlan::bf16_products and KernelPlan::int8_products say which a call got.
///   bf16: the flash kernel, on an instruction set with bf16 dot products (Isa::avx512_bf16),
///     rounds q, k, v and the probabilities P to bfloat16 and accumulates in float; so does
///     the flash backward, which also rounds dout and the score gradients dS (FlashAttention-2's
///     rule); K or V stored as half or quantized blocks, other kernels and other CPUs compute
///     in fp32.
///   int8: q k^T on int8 dot products with int32 sums, on an instruction set that has them
///     (Isa::avx512_vnni and above); P V in fp32. The decode kernel reads keys stored as q8_0
///     or q4_0 blocks as int8 and quantizes each query row per block of 32; the flash kernel
///     reads keys in any storage (blocks dequantized first), subtracts the mean key of the
///     head and quantizes each key and query row (SageAttention's smoothing, the mean's share
///     added back in float). Other storage, kernels and CPUs compute in fp32.
/// fp32 is the default everywhere, bfloat16 inputs and quantized caches included: bf16
/// products change the result by bfloat16's rounding (and on the Xeon measured ran at half
/// the FLOP rate of its fp32 FMAs; on AMD Zen 4, 1.6-2.0x fp32), int8 products by the
/// query's quantization.
enum class ComputePrecision : std::uint8_t {
  fp32,  ///< 16-bit inputs widened to float, products in float (the same bits on every CPU)
  bf16,  ///< bf16 products where they exist, for bfloat16 or float inputs (rounded as read)
  int8,  ///< q k^T on int8 products where they exist: decode over q8_0/q4_0 keys, flash
};

inline const char* precision_name(ComputePrecision precision) {
  switch (precision) {
    case ComputePrecision::fp32:
      return "fp32";
    case ComputePrecision::bf16:
      return "bf16";
    case ComputePrecision::int8:
      return "int8";
  }
  return "unknown";
}

/// Everything about an attention call except the tensors: the problem (ProblemOptions, in
/// attn/problem.hpp: the mask's visibility rules, the score modifiers, learned sinks and
/// dropout), the scale, the kernel and its arithmetic.
template <class T>
struct AttentionOptions : ProblemOptions<T> {
  std::optional<T> scale;  ///< multiplies q k^T; default 1/sqrt(D)
  Algorithm algorithm = Algorithm::automatic;
  /// Query rows per work item of chunked and flash; 0 = the plan's default (attn/plan.hpp).
  Index query_tile = 0;
  /// Keys per tile of flash; 0 = the plan's default.
  Index key_tile = 0;
  /// The arithmetic of the products (ComputePrecision).
  ComputePrecision compute = ComputePrecision::fp32;
};

}  // namespace attn
