// attn/mask.hpp: which keys each query may see, and what is added to its scores.
//
// One description combines every kind of mask the library supports:
//   causal        top-left (PyTorch `is_causal`: key j visible to query i iff j <= i) or
//                 bottom-right (FlashAttention, KV-cache decoding: j <= i + Lk - Lq);
//   window        (left, right), inclusive, -1 = unbounded (FlashAttention's convention);
//   key lengths   per batch entry: keys j >= key_lengths[b] are padding;
//   keep-mask     boolean, broadcastable to (B, H, Lq, Lk); true = may attend (PyTorch SDPA);
//   bias          additive, broadcastable to (B, H, Lq, Lk); -inf hides a key;
//   ALiBi, softcap score modifiers (attn/score_modifiers.hpp), applied with the bias.
//
// Both the causal limit and the window are measured from the query's *diagonal*
//   c(i) = i + offset,  offset = 0 for Causal::top_left, Lk - Lq otherwise,
// so the window follows the causal alignment and is bottom-right aligned (as in
// FlashAttention) when there is no causal mask. For one query row the causal limit, the
// window and the key length leave a single interval of visible keys [first, last); the
// keep-mask can only remove keys from it. Intervals move right as i grows, which is what
// lets a tiled kernel classify a whole tile at once.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attn/config.hpp"
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

/// How a rectangular tile of (query, key) positions relates to the mask.
enum class TileVisibility : std::uint8_t {
  hidden,   ///< no (i, j) in the tile is visible: skip it
  visible,  ///< every (i, j) is visible: no mask evaluation needed (a bias may still apply)
  partial,  ///< evaluate the mask element by element
};

/// A mask description resolved for one problem of shape (B, H, Lq, Lk) and validated.
template <class T>
class Mask {
 public:
  /// Validates every part against (B, H, Lq, Lk); `function` names the caller in errors.
  Mask(const char* function, Index batch, Index heads, Index q_length, Index k_length,
       Causal causal, Window window, const std::vector<Index>& key_lengths,
       Broadcast<bool> keep_mask, Broadcast<T> bias, const std::vector<T>& alibi_slopes = {},
       std::optional<T> softcap = std::nullopt)
      : batch_(batch),
        heads_(heads),
        q_length_(q_length),
        k_length_(k_length),
        causal_(causal),
        window_(window),
        key_lengths_(key_lengths),
        keep_mask_(keep_mask),
        bias_(bias),
        alibi_slopes_(alibi_slopes),
        softcap_(softcap) {
    if (!alibi_slopes.empty() && static_cast<Index>(alibi_slopes.size()) != heads) {
      detail::throw_invalid_argument(
          function, "alibi_slopes has " + std::to_string(alibi_slopes.size()) +
                        " entries but there are " + std::to_string(heads) + " query heads");
    }
    for (std::size_t h = 0; h < alibi_slopes.size(); ++h) {
      if (!std::isfinite(alibi_slopes[h])) {
        detail::throw_invalid_argument(function, "alibi_slopes[" + std::to_string(h) + "] is " +
                                                     std::to_string(alibi_slopes[h]) +
                                                     ": must be finite");
      }
    }
    if (softcap && !(std::isfinite(*softcap) && *softcap > T(0))) {
      detail::throw_invalid_argument(
          function, "softcap is " + std::to_string(*softcap) + ": must be finite and > 0");
    }
    if (window.left < -1 || window.right < -1) {
      detail::throw_invalid_argument(function, "window is (" + std::to_string(window.left) + ", " +
                                                   std::to_string(window.right) +
                                                   "): each side must be >= -1 (-1 = unbounded)");
    }
    if (!key_lengths.empty()) {
      if (static_cast<Index>(key_lengths.size()) != batch) {
        detail::throw_invalid_argument(
            function, "key_lengths has " + std::to_string(key_lengths.size()) +
                          " entries but the batch size is " + std::to_string(batch));
      }
      for (std::size_t b = 0; b < key_lengths.size(); ++b) {
        if (key_lengths[b] < 0 || key_lengths[b] > k_length) {
          detail::throw_invalid_argument(
              function, "key_lengths[" + std::to_string(b) + "] is " +
                            std::to_string(key_lengths[b]) +
                            ": must lie in [0, Lk] with Lk = " + std::to_string(k_length));
        }
      }
    }
    keep_strides_ = broadcast_strides(function, "keep_mask", keep_mask_);
    bias_strides_ = broadcast_strides(function, "bias", bias_);
    offset_ = causal == Causal::top_left ? 0 : k_length - q_length;
  }

  bool has_keep_mask() const { return !keep_mask_.empty(); }
  bool has_bias() const { return !bias_.empty(); }
  /// True when the scores of visible keys change: a bias, ALiBi or soft-capping.
  bool modifies_scores() const { return has_bias() || !alibi_slopes_.empty() || softcap_; }
  /// True when nothing is masked and nothing is changed: every key is visible.
  bool is_trivial() const {
    return causal_ == Causal::none && window_.left < 0 && window_.right < 0 &&
           key_lengths_.empty() && !has_keep_mask() && !modifies_scores();
  }

  /// First and one-past-last key visible to query i of batch b by the causal limit, the
  /// window and the key length (the keep-mask may hide more); both lie in [0, Lk], and
  /// first == last when none is visible.
  std::array<Index, 2> key_interval(Index b, Index i) const {
    const Index diagonal = i + offset_;
    Index first = 0;
    Index last = key_lengths_.empty() ? k_length_ : key_lengths_[static_cast<std::size_t>(b)];
    if (causal_ != Causal::none)
      last = std::min(last, diagonal + 1);
    if (window_.right >= 0)
      last = std::min(last, diagonal + window_.right + 1);
    if (window_.left >= 0)
      first = std::clamp(diagonal - window_.left, Index(0), k_length_);
    return {first, std::max(first, last)};
  }

  /// [first, last) covering every key visible (by the causal limit, the window and the key
  /// length) to some query in [i0, i1) of batch b; first == last when there is none.
  std::array<Index, 2> key_range(Index b, Index i0, Index i1) const {
    Index first = k_length_, last = 0;
    for (Index i = i0; i < i1; ++i) {
      const auto [lo, hi] = key_interval(b, i);
      if (lo < hi) {
        first = std::min(first, lo);
        last = std::max(last, hi);
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
    const auto [first, last] = key_interval(b, i);
    return j >= first && j < last && keep(b, h, i, j);
  }

  /// Classifies the tile [i0, i1) x [j0, j1) of batch b, head h.
  TileVisibility classify(Index b, Index /*h*/, Index i0, Index i1, Index j0, Index j1) const {
    bool any_visible = false;
    bool all_visible = true;
    for (Index i = i0; i < i1; ++i) {
      const auto [first, last] = key_interval(b, i);
      const Index lo = std::max(first, j0);
      const Index hi = std::min(last, j1);
      if (lo < hi)
        any_visible = true;
      if (lo != j0 || hi != j1)
        all_visible = false;
    }
    if (!any_visible)
      return TileVisibility::hidden;
    return all_visible && !has_keep_mask() ? TileVisibility::visible : TileVisibility::partial;
  }

  /// Applies the mask to a block of scores for queries [i0, i0 + rows) and keys
  /// [j0, j0 + cols) of batch b, head h: hidden entries become -inf; the others are
  /// soft-capped, then get the ALiBi term and the bias. NaN scores of visible keys stay NaN.
  template <class Derived>
  void apply(Index b, Index h, Index i0, Index j0, Eigen::MatrixBase<Derived>& scores) const {
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    for (Index r = 0; r < scores.rows(); ++r) {
      const Index i = i0 + r;
      const auto [first, last] = key_interval(b, i);
      const Index lo = std::clamp(first - j0, Index(0), scores.cols());
      const Index hi = std::clamp(last - j0, lo, scores.cols());
      for (Index c = 0; c < lo; ++c)
        scores(r, c) = minus_inf;
      for (Index c = hi; c < scores.cols(); ++c)
        scores(r, c) = minus_inf;
      if (softcap_) {
        const T cap = *softcap_, inverse = T(1) / *softcap_;
        for (Index c = lo; c < hi; ++c)
          scores(r, c) = cap * std::tanh(scores(r, c) * inverse);
      }
      if (!alibi_slopes_.empty()) {
        const T slope = alibi_slopes_[static_cast<std::size_t>(h)];
        const Index diagonal = i + offset_;
        for (Index c = lo; c < hi; ++c)
          scores(r, c) -= slope * static_cast<T>(std::abs(diagonal - (j0 + c)));
      }
      if (has_bias()) {
        for (Index c = lo; c < hi; ++c)
          scores(r, c) += bias(b, h, i, j0 + c);
      }
      // After the bias: a key the keep-mask hides is excluded whatever its bias or score
      // (before, -inf + a bias of +inf or NaN made the row NaN).
      if (has_keep_mask()) {
        for (Index c = lo; c < hi; ++c) {
          if (!keep(b, h, i, j0 + c))
            scores(r, c) = minus_inf;
        }
      }
    }
  }

 private:
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

  Index batch_, heads_, q_length_, k_length_;
  Causal causal_;
  Window window_;
  std::vector<Index> key_lengths_;
  Broadcast<bool> keep_mask_;
  Broadcast<T> bias_;
  std::vector<T> alibi_slopes_;  // (H) or empty
  std::optional<T> softcap_;
  std::array<Index, 4> keep_strides_{}, bias_strides_{};
  Index offset_ = 0;
};

}  // namespace attn
