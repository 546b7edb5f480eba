// attn/mask.hpp: which keys each query may see.
//
// The visibility rules of an attention problem (attn/problem.hpp has the whole problem:
// these, the score modifiers of attn/score_modifiers.hpp, learned sinks and dropout):
//   causal        top-left (PyTorch `is_causal`: key j visible to query i iff j <= i) or
//                 bottom-right (FlashAttention, KV-cache decoding: j <= i + Lk - Lq);
//   window        (left, right), inclusive, -1 = unbounded (FlashAttention's convention);
//   key lengths   per batch entry: keys j >= key_lengths[b] are padding;
//   query lengths per batch entry: queries i >= query_lengths[b] are padding (they see no key);
//   sink tokens   the first n keys of every sequence stay visible beside a window (StreamingLLM);
//   keep-mask     boolean, broadcastable to (B, H, Lq, Lk); true = may attend (PyTorch SDPA);
//   mask_mod      FlexAttention's predicate (attn/mods.hpp), or a block mask built from one.
//
// The causal limit and the window are measured from the query's *diagonal*, per sequence:
//   c_b(i) = i + offset_b,  offset_b = 0 for Causal::top_left, n_k(b) - n_q(b) otherwise,
// with n_k(b) = key_lengths[b] (Lk when not given) and n_q(b) = query_lengths[b] (Lq), so the
// window follows the causal alignment and is bottom-right aligned (as in FlashAttention) when
// there is no causal mask, and the last real query of every sequence sits on its last real
// key. For one query row the causal limit, the window and the key length leave one interval
// of visible keys [first, last); sink tokens add [0, min(n, causal limit)); the keep-mask and
// the mask_mod can only remove keys. Intervals move right as i grows, which is what lets a
// tiled kernel classify a whole tile at once (Mask::classify).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attn/block_mask.hpp"
#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/mods.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Causal alignment. The two agree when Lq == Lk.
enum class Causal : std::uint8_t {
  none,
  top_left,      ///< key j visible to query i iff j <= i (PyTorch is_causal)
  bottom_right,  ///< key j visible to query i iff j <= i + Lk - Lq (FlashAttention, KV cache)
};

/// Sliding window around the diagonal, inclusive on both sides; -1 means unbounded.
/// Query i sees keys c(i) - left <= j <= c(i) + right.
struct Window {
  Index left = -1;
  Index right = -1;
};

/// A non-owning view of a rank-4 tensor broadcastable to (B, H, Lq, Lk): each of its four
/// dimensions is 1 or the full size. A rank-2 (Lq, Lk) tensor or matrix is taken as
/// (1, 1, Lq, Lk). An empty view means "not given". The data must outlive every call it
/// is used in.
template <class T>
class Broadcast {
 public:
  Broadcast() = default;
  Broadcast(const T* data, std::array<Index, 4> dims) : data_(data), dims_(dims) {}

  // NOLINTBEGIN(google-explicit-constructor): converting from a tensor is the intended use.
  Broadcast(const Tensor<T, 4>& t)
      : Broadcast(t.data(), {t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)}) {}
  Broadcast(const TensorMap<const T, 4>& t)
      : Broadcast(t.data(), {t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)}) {}
  Broadcast(const Tensor<T, 2>& t) : Broadcast(t.data(), {1, 1, t.dimension(0), t.dimension(1)}) {}
  Broadcast(const Matrix<T>& m) : Broadcast(m.data(), {1, 1, m.rows(), m.cols()}) {}
  // NOLINTEND(google-explicit-constructor)

  // A view of a temporary would dangle.
  Broadcast(Tensor<T, 4>&&) = delete;
  Broadcast(Tensor<T, 2>&&) = delete;
  Broadcast(Matrix<T>&&) = delete;

  bool empty() const { return data_ == nullptr; }
  const T* data() const { return data_; }
  const std::array<Index, 4>& dims() const { return dims_; }

 private:
  const T* data_ = nullptr;
  std::array<Index, 4> dims_{0, 0, 0, 0};
};

namespace detail {

/// The strides that read a broadcastable view at (b, h, i, j) of `full` = (B, H, Lq, Lk):
/// 0 along a dimension of size 1; throws when a dimension is neither 1 nor the full size.
template <class U>
std::array<Index, 4> broadcast_strides(const char* function, const char* name,
                                       const Broadcast<U>& view, const std::array<Index, 4>& full) {
  std::array<Index, 4> strides{0, 0, 0, 0};
  if (view.empty())
    return strides;
  const auto& dims = view.dims();
  Index stride = 1;
  for (std::size_t d = 4; d-- > 0;) {
    if (dims[d] != 1 && dims[d] != full[d]) {
      throw_invalid_argument(function, std::string(name) + " is " +
                                           shape_string({dims[0], dims[1], dims[2], dims[3]}) +
                                           " but the scores are " +
                                           shape_string({full[0], full[1], full[2], full[3]}) +
                                           ": each dimension must be 1 or equal (broadcasting)");
    }
    strides[d] = dims[d] == 1 ? 0 : stride;
    stride *= dims[d];
  }
  return strides;
}

inline Index broadcast_offset(const std::array<Index, 4>& s, Index b, Index h, Index i, Index j) {
  return b * s[0] + h * s[1] + i * s[2] + j * s[3];
}

}  // namespace detail

/// The visibility rules of a call, as its options give them (ProblemOptions and
/// AttentionOptions derive from this). All parts are optional; an empty vector or view
/// means "not given".
struct VisibilityOptions {
  Causal causal = Causal::none;      ///< causal mask and its alignment
  Window window{};                   ///< sliding window (left, right); -1 = unbounded
  std::vector<Index> key_lengths;    ///< (B) valid keys per sequence; empty = all Lk
  std::vector<Index> query_lengths;  ///< (B) valid queries per sequence; empty = all Lq
  /// The first `sink_tokens` keys of every sequence stay visible to every query whatever the
  /// window (the causal limit and the key length still apply): StreamingLLM's attention
  /// sinks beside a sliding window.
  Index sink_tokens = 0;
  Broadcast<bool> keep_mask;  ///< broadcastable to (B, Hq, Lq, Lk); true = may attend
  /// FlexAttention's mask_mod (attn/mods.hpp), evaluated on every tile the other options
  /// leave visible. Give either this or block_mask, not both.
  MaskMod mask_mod;
  /// A mask_mod classified block by block (attn/block_mask.hpp): kernels skip its hidden
  /// blocks and evaluate its mask_mod only on partial ones. Its sizes must be (B or 1,
  /// Hq or 1, Lq, Lk) of the call (for packed sequences: the longest ones).
  BlockMask block_mask;
};

/// The visibility rules resolved for one problem of shape (B, H, Lq, Lk) and validated:
/// which keys each query sees, tile classes, and hiding what is not seen.
class Mask {
 public:
  /// The visible keys of one query row apart from the keep-mask: at most two disjoint
  /// intervals [first, last), sorted (the sink tokens, then the causal/window interval).
  struct KeyIntervals {
    std::array<std::array<Index, 2>, 2> interval{};
    std::size_t count = 0;
  };

  /// Validates every rule against (B, H, Lq, Lk); `function` names the caller in errors.
  /// `isa` is the instruction set of the mask_mod's tile loops: the plan's in a call
  /// (generic for a mask used outside one; the results do not depend on it).
  Mask(const char* function, Index batch, Index heads, Index q_length, Index k_length,
       const VisibilityOptions& options, Isa isa = Isa::generic)
      : isa_(isa),
        batch_(batch),
        heads_(heads),
        q_length_(q_length),
        k_length_(k_length),
        causal_(options.causal),
        window_(options.window),
        key_lengths_(options.key_lengths),
        query_lengths_(options.query_lengths),
        sink_tokens_(options.sink_tokens),
        keep_mask_(options.keep_mask),
        mask_mod_(options.block_mask.empty() ? options.mask_mod : options.block_mask.mask_mod()),
        block_mask_(options.block_mask) {
    check_block_mask(function, options);
    if (window_.left < -1 || window_.right < -1) {
      detail::throw_invalid_argument(function, "window is (" + std::to_string(window_.left) + ", " +
                                                   std::to_string(window_.right) +
                                                   "): each side must be >= -1 (-1 = unbounded)");
    }
    if (sink_tokens_ < 0) {
      detail::throw_invalid_argument(
          function, "sink_tokens is " + std::to_string(sink_tokens_) + ": must be >= 0");
    }
    check_lengths(function, "key_lengths", key_lengths_, "Lk", k_length);
    check_lengths(function, "query_lengths", query_lengths_, "Lq", q_length);
    keep_strides_ = detail::broadcast_strides(function, "keep_mask", keep_mask_, dims());
  }

  /// The same from the rules of a mask without query lengths, sink tokens or mods.
  Mask(const char* function, Index batch, Index heads, Index q_length, Index k_length,
       Causal causal, Window window, const std::vector<Index>& key_lengths = {},
       Broadcast<bool> keep_mask = {})
      : Mask(function, batch, heads, q_length, k_length,
             options_of(causal, window, key_lengths, keep_mask)) {}

  /// (B, H, Lq, Lk) of the problem.
  std::array<Index, 4> dims() const { return {batch_, heads_, q_length_, k_length_}; }

  bool has_keep_mask() const { return !keep_mask_.empty(); }
  bool has_sink_tokens() const { return sink_tokens_ > 0; }
  bool has_mask_mod() const { return static_cast<bool>(mask_mod_); }
  /// True when a partial tile needs a look at every element: a keep-mask or a mask_mod.
  bool has_elementwise_mask() const { return has_keep_mask() || has_mask_mod(); }
  Index sink_tokens() const { return sink_tokens_; }
  /// True when every key is visible to every query.
  bool hides_nothing() const { return !has_interval_rules() && !has_elementwise_mask(); }

  /// Valid keys and queries of sequence b: n_k(b) and n_q(b).
  Index key_length(Index b) const {
    return key_lengths_.empty() ? k_length_ : key_lengths_[static_cast<std::size_t>(b)];
  }
  Index query_length(Index b) const {
    return query_lengths_.empty() ? q_length_ : query_lengths_[static_cast<std::size_t>(b)];
  }

  /// The diagonal c_b(i) of query i of sequence b (ALiBi's zero, the causal limit).
  Index diagonal(Index b, Index i) const {
    return causal_ == Causal::top_left ? i : i + key_length(b) - query_length(b);
  }

  /// First and one-past-last key visible to query i of batch b by the causal limit, the
  /// window and the key length (sink tokens and the keep-mask aside); both lie in [0, Lk],
  /// and first == last when none is visible (always for a padding query).
  std::array<Index, 2> key_interval(Index b, Index i) const {
    if (i >= query_length(b))
      return {0, 0};
    const Index c = diagonal(b, i), n = key_length(b);
    Index first = 0, last = n;
    if (causal_ != Causal::none)
      last = std::min(last, c + 1);
    if (window_.right >= 0)
      last = std::min(last, c + window_.right + 1);
    if (window_.left >= 0)
      first = std::clamp(c - window_.left, Index(0), n);
    return {first, std::max(first, last)};
  }

  /// One-past-last sink token visible to query i of batch b: [0, that) is visible whatever
  /// the window; 0 without sink tokens.
  Index sink_end(Index b, Index i) const {
    if (sink_tokens_ == 0 || i >= query_length(b))
      return 0;
    Index last = std::min(sink_tokens_, key_length(b));
    if (causal_ != Causal::none)
      last = std::min(last, diagonal(b, i) + 1);
    return std::max(last, Index(0));
  }

  /// Every key visible to query i of batch b apart from the keep-mask.
  KeyIntervals key_intervals(Index b, Index i) const {
    KeyIntervals r;
    const auto [first, last] = key_interval(b, i);
    const Index sinks = sink_end(b, i);
    if (sinks > 0 && first <= sinks && first < last) {
      r.interval[0] = {0, std::max(sinks, last)};  // the two touch or overlap
      r.count = 1;
      return r;
    }
    if (sinks > 0)
      r.interval[r.count++] = {0, sinks};
    if (first < last)
      r.interval[r.count++] = {first, last};
    return r;
  }

  /// [first, last) covering every key visible (apart from the keep-mask) to some query in
  /// [i0, i1) of batch b; first == last == 0 when there is none.
  std::array<Index, 2> key_range(Index b, Index i0, Index i1) const {
    Index first = k_length_, last = 0;
    for (Index i = i0; i < std::min(i1, query_length(b)); ++i) {
      const KeyIntervals keys = key_intervals(b, i);
      for (std::size_t n = 0; n < keys.count; ++n) {
        first = std::min(first, keys.interval[n][0]);
        last = std::max(last, keys.interval[n][1]);
      }
    }
    return first < last ? std::array<Index, 2>{first, last} : std::array<Index, 2>{0, 0};
  }

  /// Keep-mask value (true when there is no keep-mask).
  bool keep(Index b, Index h, Index i, Index j) const {
    return keep_mask_.empty() ||
           keep_mask_.data()[detail::broadcast_offset(keep_strides_, b, h, i, j)];
  }

  /// Whether key j is visible to query i of batch b, head h (the bias aside).
  bool visible(Index b, Index h, Index i, Index j) const {
    const KeyIntervals keys = key_intervals(b, i);
    bool inside = false;
    for (std::size_t n = 0; n < keys.count; ++n)
      inside = inside || (j >= keys.interval[n][0] && j < keys.interval[n][1]);
    return inside && keep(b, h, i, j) && (!has_mask_mod() || mask_mod_(b, h, i, j));
  }

  /// Classifies the tile [i0, i1) x [j0, j1) of batch b, head h: the one tile classifier of
  /// every kernel. The rules (causal, window, lengths, sink tokens) give their class from
  /// each row's key intervals, a block mask from its blocks; the tile is hidden when either
  /// hides it, visible when both see all of it and no keep-mask or unclassified mask_mod
  /// could hide a pair.
  TileVisibility classify(Index b, Index h, Index i0, Index i1, Index j0, Index j1) const {
    // The block mask first: it answers in O(blocks), the rules in O(rows).
    const TileVisibility blocks =
        block_mask_.empty() ? TileVisibility::partial : block_mask_.classify(b, h, i0, i1, j0, j1);
    if (blocks == TileVisibility::hidden)
      return blocks;
    const TileVisibility rules = classify_by_rules(b, i0, i1, j0, j1);
    if (rules == TileVisibility::hidden || !has_mask_mod())
      return rules;
    return rules == TileVisibility::visible && blocks == TileVisibility::visible
               ? TileVisibility::visible
               : TileVisibility::partial;
  }

  /// The class of the tile for the query heads [h0, h1) together (decoding's groups):
  /// hidden when hidden for every head, visible when visible for every head.
  TileVisibility classify_heads(Index b, Index h0, Index h1, Index i0, Index i1, Index j0,
                                Index j1) const {
    if (!has_mask_mod() || block_mask_.empty() || block_mask_.heads() == 1)  // one class
      return classify(b, h0, i0, i1, j0, j1);
    bool any_shown = false, all_visible = true;
    for (Index h = h0; h < h1; ++h) {
      const TileVisibility c = classify(b, h, i0, i1, j0, j1);
      any_shown = any_shown || c != TileVisibility::hidden;
      all_visible = all_visible && c == TileVisibility::visible;
    }
    if (!any_shown)
      return TileVisibility::hidden;
    return all_visible ? TileVisibility::visible : TileVisibility::partial;
  }

  /// Sets the scores of the block for queries [i0, i0 + rows) and keys [j0, j0 + cols) of
  /// batch b, head h that the rules, the keep-mask or the mask_mod hide to -inf, whatever
  /// they were (a bias of +inf or a NaN score of a hidden key cannot leak). `visibility` is
  /// the block's class: nothing is hidden in a visible block. NaN scores of visible keys
  /// stay NaN.
  template <class Derived>
  void hide(Index b, Index h, Index i0, Index j0, Eigen::MatrixBase<Derived>& scores,
            TileVisibility visibility = TileVisibility::partial) const {
    using T = typename Derived::Scalar;
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    if (visibility == TileVisibility::visible)
      return;
    const Index cols = scores.cols();
    for (Index r = 0; r < scores.rows(); ++r) {
      const Index i = i0 + r;
      const KeyIntervals keys = key_intervals(b, i);
      Index hidden_from = 0;  // the columns before each interval are hidden
      for (std::size_t n = 0; n <= keys.count; ++n) {
        const Index lo =
            n < keys.count ? std::clamp(keys.interval[n][0] - j0, Index(0), cols) : cols;
        const Index hi = n < keys.count ? std::clamp(keys.interval[n][1] - j0, lo, cols) : cols;
        for (Index c = hidden_from; c < lo; ++c)
          scores(r, c) = minus_inf;
        hidden_from = hi;
        if (n < keys.count && has_keep_mask()) {
          for (Index c = lo; c < hi; ++c) {
            if (!keep(b, h, i, j0 + c))
              scores(r, c) = minus_inf;
          }
        }
      }
    }
    if (has_mask_mod()) {
      auto& m = scores.derived();
      mask_mod_.hide(
          ScoreTile<T>{m.data(), m.rows(), m.cols(), m.rowStride(), m.colStride(), b, h, i0, j0},
          isa_);
    }
  }

 private:
  /// The class of a tile by the causal limit, the window, the lengths, the sink tokens and
  /// (which can only make it partial) the keep-mask.
  TileVisibility classify_by_rules(Index b, Index i0, Index i1, Index j0, Index j1) const {
    if (i0 >= i1 || j0 >= j1)
      return TileVisibility::hidden;
    if (!has_interval_rules())
      return has_keep_mask() ? TileVisibility::partial : TileVisibility::visible;
    bool any_visible = false;
    bool all_visible = true;
    for (Index i = i0; i < i1; ++i) {
      const KeyIntervals keys = key_intervals(b, i);
      bool row_covers = false;
      for (std::size_t n = 0; n < keys.count; ++n) {
        const Index lo = std::max(keys.interval[n][0], j0);
        const Index hi = std::min(keys.interval[n][1], j1);
        any_visible = any_visible || lo < hi;
        row_covers = row_covers || (lo == j0 && hi == j1);  // disjoint: one must cover it all
      }
      all_visible = all_visible && row_covers;
    }
    if (!any_visible)
      return TileVisibility::hidden;
    return all_visible && !has_keep_mask() ? TileVisibility::visible : TileVisibility::partial;
  }

  /// Whether some rule narrows a row's visible keys to less than [0, Lk).
  bool has_interval_rules() const {
    return causal_ != Causal::none || window_.left >= 0 || window_.right >= 0 ||
           !key_lengths_.empty() || !query_lengths_.empty();
  }

  static VisibilityOptions options_of(Causal causal, Window window,
                                      const std::vector<Index>& key_lengths,
                                      Broadcast<bool> keep_mask) {
    VisibilityOptions o;
    o.causal = causal;
    o.window = window;
    o.key_lengths = key_lengths;
    o.keep_mask = keep_mask;
    return o;
  }

  void check_block_mask(const char* function, const VisibilityOptions& options) const {
    const BlockMask& m = options.block_mask;
    if (m.empty())
      return;
    if (options.mask_mod) {
      detail::throw_invalid_argument(function,
                                     "both mask_mod and block_mask are given: give one (a block "
                                     "mask carries the mask_mod it was built from)");
    }
    if ((m.batch() != 1 && m.batch() != batch_) || (m.heads() != 1 && m.heads() != heads_) ||
        m.q_length() != q_length_ || m.k_length() != k_length_) {
      detail::throw_invalid_argument(
          function, "block_mask was built for " +
                        detail::shape_string({m.batch(), m.heads(), m.q_length(), m.k_length()}) +
                        " but the scores are " +
                        detail::shape_string({batch_, heads_, q_length_, k_length_}) +
                        ": B and H must be 1 or equal, Lq and Lk equal");
    }
  }

  void check_lengths(const char* function, const char* name, const std::vector<Index>& lengths,
                     const char* extent_name, Index extent) const {
    if (lengths.empty())
      return;
    if (static_cast<Index>(lengths.size()) != batch_) {
      detail::throw_invalid_argument(
          function, std::string(name) + " has " + std::to_string(lengths.size()) +
                        " entries but the batch size is " + std::to_string(batch_));
    }
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      if (lengths[b] < 0 || lengths[b] > extent) {
        detail::throw_invalid_argument(
            function, std::string(name) + "[" + std::to_string(b) + "] is " +
                          std::to_string(lengths[b]) + ": must lie in [0, " + extent_name +
                          "] with " + extent_name + " = " + std::to_string(extent));
      }
    }
  }

  Isa isa_;  // of the mask_mod's tile loops
  Index batch_, heads_, q_length_, k_length_;
  Causal causal_;
  Window window_;
  std::vector<Index> key_lengths_, query_lengths_;  // (B) or empty
  Index sink_tokens_;
  Broadcast<bool> keep_mask_;
  MaskMod mask_mod_;
  BlockMask block_mask_;
  std::array<Index, 4> keep_strides_{};
};

}  // namespace attn
