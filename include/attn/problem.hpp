// attn/problem.hpp: everything about one attention problem but its tensors and its kernel.
//
// Four parts, each its own concern, that every kernel reads the same way:
//   the mask            which keys each query sees (attn/mask.hpp: causal, window, lengths,
//                       sink tokens, keep-mask, mask_mod, block mask);
//   the score modifiers what changes the scores of visible keys (attn/score_modifiers.hpp:
//                       score_mod, softcap, ALiBi, bias);
//   learned sinks       one logit per query head in every softmax's denominator (gpt-oss);
//   dropout             of the probabilities (attn/dropout.hpp).
// A kernel applies a tile's modifiers, then hides what the mask hides (AttentionProblem::
// apply), runs the softmax with the head's sink, and drops out what the dropout drops.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/dropout.hpp"
#include "attn/mask.hpp"
#include "attn/mods.hpp"
#include "attn/score_modifiers.hpp"

namespace attn {

/// Every option of an attention problem (AttentionOptions derives from this): the
/// visibility rules, the score modifiers, learned sinks and dropout. All parts are optional;
/// an empty vector or view means "not given".
template <class T>
struct ProblemOptions : VisibilityOptions, ScoreOptions<T> {
  /// (Hq) learned attention sinks (gpt-oss), one finite logit per query head: the softmax
  /// runs over the visible scores and the sink, whose column is then dropped, so the weights
  /// sum to less than 1 and the log-sum-exp includes the sink. Not scaled, capped or biased.
  std::vector<T> sinks;
  /// Attention dropout (attn/dropout.hpp): each weight is dropped with this probability,
  /// in [0, 1), the others scaled by 1 / (1 - p); 0 = none. Naive and flash only.
  T dropout_p = 0;
  /// The seed of the dropout's generator: the same seed gives the same mask, in the forward
  /// and the backward, whatever the kernel, tiles or threads.
  std::uint64_t dropout_seed = 0;
};

/// An attention problem of shape (B, H, Lq, Lk) resolved from its options and validated.
template <class T>
class AttentionProblem {
 public:
  /// Validates every part; `function` names the caller in errors. `isa` is the instruction
  /// set of the mods' tile loops: the plan's in a call (the results do not depend on it).
  AttentionProblem(const char* function, Index batch, Index heads, Index q_length, Index k_length,
                   const ProblemOptions<T>& options, Isa isa = Isa::generic)
      : mask_(function, batch, heads, q_length, k_length, options, isa),
        scores_(function, mask_, options, isa),
        sinks_(options.sinks),
        dropout_(function, options.dropout_p, options.dropout_seed) {
    if (!sinks_.empty() && static_cast<Index>(sinks_.size()) != heads) {
      detail::throw_invalid_argument(function, "sinks has " + std::to_string(sinks_.size()) +
                                                   " entries but there are " +
                                                   std::to_string(heads) + " query heads");
    }
    for (std::size_t h = 0; h < sinks_.size(); ++h) {
      if (!std::isfinite(sinks_[h])) {
        detail::throw_invalid_argument(function, "sinks[" + std::to_string(h) + "] is " +
                                                     std::to_string(sinks_[h]) +
                                                     ": must be finite");
      }
    }
  }

  const Mask& mask() const { return mask_; }
  const ScoreModifiers<T>& score_modifiers() const { return scores_; }
  /// The dropout of the probabilities (inactive when dropout_p is 0).
  const Dropout<T>& dropout() const { return dropout_; }
  /// The learned sink logit of query head h, or null when there are none.
  const T* sink(Index h) const {
    return sinks_.empty() ? nullptr : &sinks_[static_cast<std::size_t>(h)];
  }

  /// True when the scores of visible keys change.
  bool modifies_scores() const { return scores_.active(); }
  /// True when nothing is hidden and nothing is changed (sinks and dropout aside).
  bool is_trivial() const { return mask_.hides_nothing() && !scores_.active(); }

  /// Applies the problem to a block of scores for queries [i0, i0 + rows) and keys
  /// [j0, j0 + cols) of batch b, head h: every entry gets the score modifiers, then what
  /// the mask hides becomes -inf. `visibility` is the block's class: on a visible block
  /// the mask is not evaluated.
  template <class Derived>
  void apply(Index b, Index h, Index i0, Index j0, Eigen::MatrixBase<Derived>& scores,
             TileVisibility visibility = TileVisibility::partial) const {
    if (scores_.active()) {
      auto& m = scores.derived();
      scores_.apply(
          ScoreTile<T>{m.data(), m.rows(), m.cols(), m.rowStride(), m.colStride(), b, h, i0, j0});
    }
    mask_.hide(b, h, i0, j0, scores, visibility);
  }

 private:
  Mask mask_;
  ScoreModifiers<T> scores_;
  std::vector<T> sinks_;  // (H) or empty
  Dropout<T> dropout_;
};

}  // namespace attn
