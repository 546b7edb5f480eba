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

/// Everything about an attention call except the tensors: the problem (ProblemOptions, in
/// attn/problem.hpp: the mask's visibility rules, the score modifiers, learned sinks and
/// dropout), the scale and the kernel.
template <class T>
struct AttentionOptions : ProblemOptions<T> {
  std::optional<T> scale;  ///< multiplies q k^T; default 1/sqrt(D)
  Algorithm algorithm = Algorithm::automatic;
  /// Query rows per work item of chunked and flash; 0 = the plan's default (attn/plan.hpp).
  Index query_tile = 0;
  /// Keys per tile of flash; 0 = the plan's default.
  Index key_tile = 0;
};

}  // namespace attn
