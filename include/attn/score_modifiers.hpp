// attn/score_modifiers.hpp: changes to the attention scores other than masks and biases.
//
//   s[b, h, i, j] = cap * tanh(scale * q_i . k_j / cap)     logit soft-capping (if cap given)
//                   - slope[h] * |c(i) - j|                  ALiBi (if slopes given)
//                   + bias[b, h, i, j]                       (attn/mask.hpp)
//
// c(i) = i + offset is the query's diagonal, the same one the causal mask and the window use
// (offset 0 for Causal::top_left, Lk - Lq otherwise), so under a causal mask the ALiBi
// distance is the plain "how many tokens back" of the original paper, for either alignment.
// Soft-capping comes first, as in Gemma 2 (cap = 50): it bounds the logits the model
// produced, not the position bias added to them. Masked keys stay excluded either way.
#pragma once

#include <cmath>
#include <vector>

#include "attn/config.hpp"

namespace attn {

/// The ALiBi authors' slope schedule for `heads` heads (Press et al. 2022, "Train Short,
/// Test Long", and their get_slopes): for a power of two n, the geometric sequence
/// 2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise the schedule of the power of two below n
/// followed by every other slope of the schedule of the power of two above it.
template <class T = float>
std::vector<T> alibi_slopes(Index heads) {
  if (heads < 1) {
    detail::throw_invalid_argument("alibi_slopes",
                                   "heads is " + std::to_string(heads) + ": must be positive");
  }
  const auto power_of_two_schedule = [](Index n) {
    std::vector<T> slopes;
    const double start = std::exp2(-8.0 / static_cast<double>(n));
    double slope = start;
    for (Index h = 0; h < n; ++h, slope *= start)
      slopes.push_back(static_cast<T>(slope));
    return slopes;
  };
  Index below = 1;
  while (below * 2 <= heads)
    below *= 2;
  std::vector<T> slopes = power_of_two_schedule(below);
  if (below != heads) {
    const std::vector<T> above = power_of_two_schedule(2 * below);
    for (Index h = 0; h < heads - below; ++h)
      slopes.push_back(above[static_cast<std::size_t>(2 * h)]);
  }
  return slopes;
}

}  // namespace attn
