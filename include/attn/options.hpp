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
/// "bf16 products"). bf16 is a permission, not a demand: the flash kernel takes it on an
/// instruction set with bf16 dot products (Isa::avx512_bf16), rounding q, k, v and the
/// probabilities P to bfloat16 and accumulating in float; every other kernel and CPU, and K
/// or V stored as half or quantized blocks, computes in fp32. KernelPlan::bf16_products says
/// which a call does. fp32 is the default everywhere, bfloat16 inputs included: on the Xeon
/// measured, bf16 dot products ran at half the FLOP rate of its fp32 FMAs.
enum class ComputePrecision : std::uint8_t {
  fp32,  ///< 16-bit inputs widened to float, products in float (the same bits on every CPU)
  bf16,  ///< bf16 products where they exist, for bfloat16 or float inputs (rounded as read)
};

inline const char* precision_name(ComputePrecision precision) {
  switch (precision) {
    case ComputePrecision::fp32:
      return "fp32";
    case ComputePrecision::bf16:
      return "bf16";
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
