// attn/score_modifiers.hpp: what changes the scores of visible keys.
//
//   s[b, h, i, j] = score_mod(scale * q_i . k_j, b, h, i, j)  FlexAttention's (attn/mods.hpp)
//   s            <- cap * tanh(s / cap)                       logit soft-capping (if cap given)
//                   - slope[h] * |c(i) - j|                   ALiBi (if slopes given)
//                   + bias[b, h, i, j]                        additive, broadcastable
//
// c(i) = i + offset is the query's diagonal, the same one the causal mask and the window use
// (attn/mask.hpp: offset 0 for Causal::top_left, n_k(b) - n_q(b) otherwise), so under a causal mask
// the ALiBi distance is the plain "how many tokens back" of the original paper, for either
// alignment. Soft-capping comes first, as in Gemma 2 (cap = 50): it bounds the logits the model
// produced, not the position bias added to them. Masked keys stay excluded either way: the mask
// hides them after the modifiers ran.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/mask.hpp"
#include "attn/mods.hpp"

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

/// The score modifiers of a call, as its options give them (ProblemOptions and
/// AttentionOptions derive from this). All are optional.
template <class T>
struct ScoreOptions {
  /// FlexAttention's score_mod (attn/mods.hpp): changes each scaled score, before softcap,
  /// ALiBi and the bias. Forward only (the backward refuses it).
  ScoreMod<T> score_mod;
  /// Logit soft-capping: scores become softcap * tanh(scores / softcap) before the ALiBi
  /// term, the bias and the mask; must be > 0. Gemma 2 uses 50.
  std::optional<T> softcap;
  /// (Hq) ALiBi slopes, e.g. alibi_slopes<T>(Hq); empty = no ALiBi. Adds
  /// -slope[h] * |c_b(i) - j|.
  std::vector<T> alibi_slopes;
  Broadcast<T> bias;  ///< broadcastable to (B, Hq, Lq, Lk); added to scores
};

/// The score modifiers resolved for one problem and validated: each runs as a score mod in
/// the mods' vectorised tile loops, in the order of the formula above.
template <class T>
class ScoreModifiers {
 public:
  /// Validates the modifiers against the problem's mask (its (B, H, Lq, Lk) and the
  /// diagonals ALiBi measures from); `function` names the caller in errors.
  ScoreModifiers(const char* function, const Mask& mask, const ScoreOptions<T>& options,
                 Isa isa = Isa::generic)
      : isa_(isa),
        score_mod_(options.score_mod),
        softcap_(options.softcap),
        has_alibi_(!options.alibi_slopes.empty()),
        has_bias_(!options.bias.empty()) {
    const std::array<Index, 4> dims = mask.dims();
    if (has_alibi_ && static_cast<Index>(options.alibi_slopes.size()) != dims[1]) {
      detail::throw_invalid_argument(
          function, "alibi_slopes has " + std::to_string(options.alibi_slopes.size()) +
                        " entries but there are " + std::to_string(dims[1]) + " query heads");
    }
    for (std::size_t h = 0; h < options.alibi_slopes.size(); ++h) {
      if (!std::isfinite(options.alibi_slopes[h])) {
        detail::throw_invalid_argument(function, "alibi_slopes[" + std::to_string(h) + "] is " +
                                                     std::to_string(options.alibi_slopes[h]) +
                                                     ": must be finite");
      }
    }
    if (softcap_ && !(std::isfinite(*softcap_) && *softcap_ > T(0))) {
      detail::throw_invalid_argument(
          function, "softcap is " + std::to_string(*softcap_) + ": must be finite and > 0");
    }
    const std::array<Index, 4> bias_strides =
        detail::broadcast_strides(function, "bias", options.bias, dims);
    make_mods(mask, options, bias_strides);
  }

  /// True when some modifier changes the scores.
  bool active() const { return score_mod_ || softcap_ || has_alibi_ || has_bias_; }
  bool has_softcap() const { return softcap_.has_value(); }

  /// Applies every modifier to every entry of the tile, in order.
  void apply(const ScoreTile<T>& tile) const {
    for (const ScoreMod<T>* mod : {&score_mod_, &softcap_mod_, &alibi_mod_, &bias_mod_}) {
      if (*mod)
        mod->apply(tile, isa_);
    }
  }

 private:
  /// Softcap, ALiBi and the bias as score mods. Each owns what it reads (a copy stays
  /// valid) but the bias, which is the caller's for the duration of the call.
  void make_mods(const Mask& mask, const ScoreOptions<T>& options,
                 const std::array<Index, 4>& bias_strides) {
    if (softcap_) {
      const T cap = *softcap_, inverse = T(1) / *softcap_;
      softcap_mod_ = ScoreMod<T>(
          [cap, inverse](T s, Index, Index, Index, Index) { return cap * std::tanh(s * inverse); });
    }
    if (has_alibi_) {
      // The diagonal c_b(i) = i + offset_b; the distance through int32 vectorises.
      const Index batch = mask.dims()[0];
      auto offsets = std::make_shared<std::vector<Index>>(static_cast<std::size_t>(batch));
      for (Index b = 0; b < batch; ++b)
        (*offsets)[static_cast<std::size_t>(b)] = mask.diagonal(b, 0);
      auto slopes = std::make_shared<const std::vector<T>>(options.alibi_slopes);
      alibi_mod_ = ScoreMod<T>([offsets, slopes, offset = offsets->data(), slope = slopes->data()](
                                   T s, Index b, Index h, Index i, Index j) {
        const auto distance = static_cast<std::int32_t>(i + offset[b] - j);
        return s - slope[h] * std::abs(static_cast<T>(distance));
      });
    }
    if (has_bias_) {
      const T* data = options.bias.data();
      const auto [sb, sh, si, sj] = bias_strides;
      bias_mod_ = ScoreMod<T>(
          [data, sb = sb, sh = sh, si = si, sj = sj](T s, Index b, Index h, Index i, Index j) {
            return s + data[b * sb + h * sh + i * si + j * sj];
          });
    }
  }

  Isa isa_;  // of the mods' tile loops
  ScoreMod<T> score_mod_;
  std::optional<T> softcap_;
  bool has_alibi_, has_bias_;
  ScoreMod<T> softcap_mod_, alibi_mod_, bias_mod_;  // the options, as mods (make_mods)
};

}  // namespace attn
