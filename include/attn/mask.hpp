// attn/mask.hpp: which keys each query may see, and what is added to its scores.
//
// One description combines every kind of mask the library supports:
//   causal        top-left (PyTorch `is_causal`: key j visible to query i iff j <= i) or
//                 bottom-right (FlashAttention, KV-cache decoding: j <= i + Lk - Lq);
//   window        (left, right), inclusive, -1 = unbounded (FlashAttention's convention);
//   key lengths   per batch entry: keys j >= key_lengths[b] are padding;
//   query lengths per batch entry: queries i >= query_lengths[b] are padding (they see no key);
//   sink tokens   the first n keys of every sequence stay visible beside a window (StreamingLLM);
//   keep-mask     boolean, broadcastable to (B, H, Lq, Lk); true = may attend (PyTorch SDPA);
//   bias          additive, broadcastable to (B, H, Lq, Lk); -inf hides a key;
//   ALiBi, softcap score modifiers (attn/score_modifiers.hpp), applied with the bias.
//
// The causal limit, the window and ALiBi are measured from the query's *diagonal*, per
// sequence:
//   c_b(i) = i + offset_b,  offset_b = 0 for Causal::top_left, n_k(b) - n_q(b) otherwise,
// with n_k(b) = key_lengths[b] (Lk when not given) and n_q(b) = query_lengths[b] (Lq), so the
// window follows the causal alignment and is bottom-right aligned (as in FlashAttention) when
// there is no causal mask, and the last real query of every sequence sits on its last real
// key. For one query row the causal limit, the window and the key length leave one interval
// of visible keys [first, last); sink tokens add [0, min(n, causal limit)); the keep-mask can
// only remove keys. Intervals move right as i grows, which is what lets a tiled kernel
// classify a whole tile at once. Learned sinks (one logit per query head) are not a mask:
// the kernels add them to the softmax's denominator (docs/masks.md).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attn/block_mask.hpp"
#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/dropout.hpp"
#include "attn/mods.hpp"
#include "attn/score_modifiers.hpp"
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

/// Every part of a mask, as the options of an attention call give it (AttentionOptions
/// derives from this). All parts are optional; an empty vector or view means "not given".
template <class T>
struct MaskOptions {
  Causal causal = Causal::none;      ///< causal mask and its alignment
  Window window{};                   ///< sliding window (left, right); -1 = unbounded
  std::vector<Index> key_lengths;    ///< (B) valid keys per sequence; empty = all Lk
  std::vector<Index> query_lengths;  ///< (B) valid queries per sequence; empty = all Lq
  /// The first `sink_tokens` keys of every sequence stay visible to every query whatever the
  /// window (the causal limit and the key length still apply): StreamingLLM's attention
  /// sinks beside a sliding window.
  Index sink_tokens = 0;
  Broadcast<bool> keep_mask;  ///< broadcastable to (B, Hq, Lq, Lk); true = may attend
  Broadcast<T> bias;          ///< broadcastable to (B, Hq, Lq, Lk); added to scores
  /// (Hq) ALiBi slopes, e.g. alibi_slopes<T>(Hq); empty = no ALiBi. Adds
  /// -slope[h] * |c_b(i) - j| (attn/score_modifiers.hpp).
  std::vector<T> alibi_slopes;
  /// Logit soft-capping: scores become softcap * tanh(scores / softcap) before the ALiBi
  /// term, the bias and the mask; must be > 0. Gemma 2 uses 50.
  std::optional<T> softcap;
  /// (Hq) learned attention sinks (gpt-oss), one finite logit per query head: the softmax
  /// runs over the visible scores and the sink, whose column is then dropped, so the weights
  /// sum to less than 1 and the log-sum-exp includes the sink. Not scaled, capped or biased.
  std::vector<T> sinks;
  /// Attention dropout (attn/dropout.hpp): each weight is dropped with this probability,
  /// in [0, 1), the others scaled by 1 / (1 - p); 0 = none. Not a mask of the scores, but
  /// resolved with the mask so that every kernel sees one description. Naive and flash only.
  T dropout_p = 0;
  /// The seed of the dropout's generator: the same seed gives the same mask, in the forward
  /// and the backward, whatever the kernel, tiles or threads.
  std::uint64_t dropout_seed = 0;
  /// FlexAttention's score_mod (attn/mods.hpp): changes each scaled score, before softcap,
  /// ALiBi and the bias. Forward only (the backward refuses it).
  ScoreMod<T> score_mod;
  /// FlexAttention's mask_mod (attn/mods.hpp), evaluated on every tile the other options
  /// leave visible. Give either this or block_mask, not both.
  MaskMod mask_mod;
  /// A mask_mod classified block by block (attn/block_mask.hpp): kernels skip its hidden
  /// blocks and evaluate its mask_mod only on partial ones. Its sizes must be (B or 1,
  /// Hq or 1, Lq, Lk) of the call (for packed sequences: the longest ones).
  BlockMask block_mask;
};

/// A mask description resolved for one problem of shape (B, H, Lq, Lk) and validated.
template <class T>
class Mask {
 public:
  /// The visible keys of one query row apart from the keep-mask: at most two disjoint
  /// intervals [first, last), sorted (the sink tokens, then the causal/window interval).
  struct KeyIntervals {
    std::array<std::array<Index, 2>, 2> interval{};
    std::size_t count = 0;
  };

  /// Validates every part against (B, H, Lq, Lk); `function` names the caller in errors.
  /// `isa` is the instruction set of the mods' tile loops: the plan's in a call (generic for
  /// a mask used outside one; the results do not depend on it).
  Mask(const char* function, Index batch, Index heads, Index q_length, Index k_length,
       const MaskOptions<T>& options, Isa isa = Isa::generic)
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
        bias_(options.bias),
        alibi_slopes_(options.alibi_slopes),
        softcap_(options.softcap),
        sinks_(options.sinks),
        dropout_(function, options.dropout_p, options.dropout_seed),
        score_mod_(options.score_mod),
        mask_mod_(options.block_mask.empty() ? options.mask_mod : options.block_mask.mask_mod()),
        block_mask_(options.block_mask) {
    check_block_mask(function, options);
    check_per_head(function, "alibi_slopes", alibi_slopes_);
    check_per_head(function, "sinks", sinks_);
    if (softcap_ && !(std::isfinite(*softcap_) && *softcap_ > T(0))) {
      detail::throw_invalid_argument(
          function, "softcap is " + std::to_string(*softcap_) + ": must be finite and > 0");
    }
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
    keep_strides_ = broadcast_strides(function, "keep_mask", keep_mask_);
    bias_strides_ = broadcast_strides(function, "bias", bias_);
    make_modifier_mods();
  }

  /// The same from the parts of a mask without per-sequence query lengths, sink tokens or
  /// learned sinks.
  Mask(const char* function, Index batch, Index heads, Index q_length, Index k_length,
       Causal causal, Window window, const std::vector<Index>& key_lengths,
       Broadcast<bool> keep_mask, Broadcast<T> bias, const std::vector<T>& alibi_slopes = {},
       std::optional<T> softcap = std::nullopt)
      : Mask(function, batch, heads, q_length, k_length,
             options_of(causal, window, key_lengths, keep_mask, bias, alibi_slopes, softcap)) {}

  bool has_keep_mask() const { return !keep_mask_.empty(); }
  bool has_bias() const { return !bias_.empty(); }
  bool has_sink_tokens() const { return sink_tokens_ > 0; }
  bool has_score_mod() const { return static_cast<bool>(score_mod_); }
  bool has_mask_mod() const { return static_cast<bool>(mask_mod_); }
  /// True when a partial tile needs a look at every element: a keep-mask or a mask_mod.
  bool has_elementwise_mask() const { return has_keep_mask() || has_mask_mod(); }
  Index sink_tokens() const { return sink_tokens_; }
  /// True when the scores of visible keys change: a score_mod, a bias, ALiBi or soft-capping.
  bool modifies_scores() const {
    return has_score_mod() || has_bias() || !alibi_slopes_.empty() || softcap_;
  }
  /// True when nothing is masked and nothing is changed: every key is visible.
  bool is_trivial() const {
    return causal_ == Causal::none && window_.left < 0 && window_.right < 0 &&
           key_lengths_.empty() && query_lengths_.empty() && !has_elementwise_mask() &&
           !modifies_scores();
  }

  /// The dropout of the probabilities (inactive when dropout_p is 0).
  const Dropout<T>& dropout() const { return dropout_; }

  /// The learned sink logit of query head h, or null when there are none.
  const T* sink(Index h) const {
    return sinks_.empty() ? nullptr : &sinks_[static_cast<std::size_t>(h)];
  }

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
    return keep_mask_.empty() || keep_mask_.data()[offset_of(keep_strides_, b, h, i, j)];
  }

  /// Additive bias (0 when there is none).
  T bias(Index b, Index h, Index i, Index j) const {
    return bias_.empty() ? T(0) : bias_.data()[offset_of(bias_strides_, b, h, i, j)];
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

  /// Applies the mask to a block of scores for queries [i0, i0 + rows) and keys
  /// [j0, j0 + cols) of batch b, head h: every entry gets the score_mod, softcap, the ALiBi
  /// term and the bias, in that order; then what the rules, the keep-mask and the mask_mod
  /// hide becomes -inf. `visibility` is the block's class: on a visible block nothing is
  /// hidden, so neither the rules nor the mask_mod are evaluated. NaN scores of visible keys
  /// stay NaN.
  template <class Derived>
  void apply(Index b, Index h, Index i0, Index j0, Eigen::MatrixBase<Derived>& scores,
             TileVisibility visibility = TileVisibility::partial) const {
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    const Index cols = scores.cols();
    const auto tile = [&] {
      auto& m = scores.derived();
      return ScoreTile<T>{m.data(), m.rows(), m.cols(), m.rowStride(), m.colStride(), b, h, i0, j0};
    };
    // The score modifiers on every entry of the tile, in the vectorised tile loops of mods
    // (attn/mods.hpp); what is hidden below is overwritten, whatever they made of it.
    for (const ScoreMod<T>* mod : {&score_mod_, &softcap_mod_, &alibi_mod_, &bias_mod_}) {
      if (*mod)
        mod->apply(tile(), isa_);
    }
    if (visibility == TileVisibility::visible)
      return;  // nothing in the tile is hidden
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
        // After the bias: a key the keep-mask hides is excluded whatever its bias or score
        // (before, -inf + a bias of +inf or NaN made the row NaN).
        if (n < keys.count && has_keep_mask()) {
          for (Index c = lo; c < hi; ++c) {
            if (!keep(b, h, i, j0 + c))
              scores(r, c) = minus_inf;
          }
        }
      }
    }
    if (has_mask_mod())
      mask_mod_.hide(tile(), isa_);
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

  static MaskOptions<T> options_of(Causal causal, Window window,
                                   const std::vector<Index>& key_lengths, Broadcast<bool> keep_mask,
                                   Broadcast<T> bias, const std::vector<T>& alibi_slopes,
                                   std::optional<T> softcap) {
    MaskOptions<T> o;
    o.causal = causal;
    o.window = window;
    o.key_lengths = key_lengths;
    o.keep_mask = keep_mask;
    o.bias = bias;
    o.alibi_slopes = alibi_slopes;
    o.softcap = softcap;
    return o;
  }

  /// Softcap, ALiBi and the bias as score mods, so that they run in the mods' vectorised
  /// tile loops. Each owns what it reads (a copied Mask stays valid) but the bias, which is
  /// the caller's for the duration of the call.
  void make_modifier_mods() {
    if (softcap_) {
      const T cap = *softcap_, inverse = T(1) / *softcap_;
      softcap_mod_ = ScoreMod<T>(
          [cap, inverse](T s, Index, Index, Index, Index) { return cap * std::tanh(s * inverse); });
    }
    if (!alibi_slopes_.empty()) {
      // The diagonal c_b(i) = i + offset_b; the distance through int32 vectorises.
      auto offsets = std::make_shared<std::vector<Index>>(static_cast<std::size_t>(batch_));
      for (Index b = 0; b < batch_; ++b)
        (*offsets)[static_cast<std::size_t>(b)] = diagonal(b, 0);
      auto slopes = std::make_shared<const std::vector<T>>(alibi_slopes_);
      alibi_mod_ = ScoreMod<T>([offsets, slopes, offset = offsets->data(), slope = slopes->data()](
                                   T s, Index b, Index h, Index i, Index j) {
        const auto distance = static_cast<std::int32_t>(i + offset[b] - j);
        return s - slope[h] * std::abs(static_cast<T>(distance));
      });
    }
    if (has_bias()) {
      const T* data = bias_.data();
      const auto [sb, sh, si, sj] = bias_strides_;
      bias_mod_ = ScoreMod<T>(
          [data, sb = sb, sh = sh, si = si, sj = sj](T s, Index b, Index h, Index i, Index j) {
            return s + data[b * sb + h * sh + i * si + j * sj];
          });
    }
  }

  void check_block_mask(const char* function, const MaskOptions<T>& options) const {
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

  void check_per_head(const char* function, const char* name, const std::vector<T>& values) const {
    if (!values.empty() && static_cast<Index>(values.size()) != heads_) {
      detail::throw_invalid_argument(
          function, std::string(name) + " has " + std::to_string(values.size()) +
                        " entries but there are " + std::to_string(heads_) + " query heads");
    }
    for (std::size_t h = 0; h < values.size(); ++h) {
      if (!std::isfinite(values[h])) {
        detail::throw_invalid_argument(function, std::string(name) + "[" + std::to_string(h) +
                                                     "] is " + std::to_string(values[h]) +
                                                     ": must be finite");
      }
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

  template <class U>
  std::array<Index, 4> broadcast_strides(const char* function, const char* name,
                                         const Broadcast<U>& view) const {
    std::array<Index, 4> strides{0, 0, 0, 0};
    if (view.empty())
      return strides;
    const std::array<Index, 4> full{batch_, heads_, q_length_, k_length_};
    const auto& dims = view.dims();
    Index stride = 1;
    for (std::size_t d = 4; d-- > 0;) {
      if (dims[d] != 1 && dims[d] != full[d]) {
        detail::throw_invalid_argument(
            function, std::string(name) + " is " +
                          detail::shape_string({dims[0], dims[1], dims[2], dims[3]}) +
                          " but the scores are " +
                          detail::shape_string({full[0], full[1], full[2], full[3]}) +
                          ": each dimension must be 1 or equal (broadcasting)");
      }
      strides[d] = dims[d] == 1 ? 0 : stride;
      stride *= dims[d];
    }
    return strides;
  }

  static Index offset_of(const std::array<Index, 4>& s, Index b, Index h, Index i, Index j) {
    return b * s[0] + h * s[1] + i * s[2] + j * s[3];
  }

  Isa isa_;  // of the mods' tile loops
  Index batch_, heads_, q_length_, k_length_;
  Causal causal_;
  Window window_;
  std::vector<Index> key_lengths_, query_lengths_;  // (B) or empty
  Index sink_tokens_;
  Broadcast<bool> keep_mask_;
  Broadcast<T> bias_;
  std::vector<T> alibi_slopes_;  // (H) or empty
  std::optional<T> softcap_;
  std::vector<T> sinks_;  // (H) or empty
  Dropout<T> dropout_;
  ScoreMod<T> score_mod_;
  ScoreMod<T> softcap_mod_, alibi_mod_, bias_mod_;  // the options, as mods (make_modifier_mods)
  MaskMod mask_mod_;
  BlockMask block_mask_;
  std::array<Index, 4> keep_strides_{}, bias_strides_{};
};

}  // namespace attn
