// attn/mods.hpp: user functions of the scores and of visibility, PyTorch FlexAttention's
// score_mod and mask_mod.
//
//   score_mod(score, b, h, q_idx, kv_idx) -> score   the scaled score q . k * scale, changed
//   mask_mod(b, h, q_idx, kv_idx) -> bool            true = key kv_idx visible to q_idx
//
// b is the batch entry (the sequence of a packed call), h the query head, q_idx and kv_idx
// positions within the sequence. Either may be any callable; it is copied into the mod.
//
// How a scalar callable meets vector code (measured in docs/mods.md): the kernels never call
// the callable per element through a pointer. A mod keeps pointers to loops over a whole
// tile of scores (attn/kernels/mod_loops.hpp), instantiated for the callable's own type, in
// which the callable is inlined, once per instruction set; a kernel makes one indirect call
// per tile (thousands of scores), and the loop of the call's instruction set runs (the
// one its plan chose, attn/plan.hpp).
// The loop walks the tile's contiguous direction, so a callable the compiler can vectorise
// (arithmetic, look-ups along a table) runs on the CPU's widest vectors, whatever flags the
// translation unit that created the mod was built with.
#pragma once

#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "attn/config.hpp"
#include "attn/kernels/mod_loops.hpp"

namespace attn {

/// FlexAttention's score_mod: `f(score, b, h, q_idx, kv_idx)` returns the new score of one
/// (query, key) pair. It sees the scaled score before attn's own score modifiers (softcap,
/// ALiBi, the bias) and is evaluated on masked positions of a tile too (their result is
/// discarded), so it must accept any index in [0, Lq) x [0, Lk). An empty ScoreMod is none.
template <class T>
class ScoreMod {
 public:
  ScoreMod() = default;

  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, ScoreMod> &&
                                              std::is_invocable_r_v<T, const std::decay_t<F>&, T,
                                                                    Index, Index, Index, Index>>>
  explicit ScoreMod(F&& f)
      : callable_(std::make_shared<const std::decay_t<F>>(std::forward<F>(f))),
        loops_(detail::score_tile_loops<std::decay_t<F>, T>()) {}

  explicit operator bool() const { return callable_ != nullptr; }

  /// The new score of one pair (one indirect call: for tests, not for kernels).
  T operator()(T score, Index b, Index h, Index q_idx, Index kv_idx) const {
    T s = score;
    apply(ScoreTile<T>{&s, 1, 1, 1, 1, b, h, q_idx, kv_idx});
    return s;
  }

  /// Replaces every score of the tile by the mod's value, with the loop of `isa` (the
  /// call's plan's; the values do not depend on it).
  void apply(const ScoreTile<T>& tile, Isa isa = Isa::generic) const {
    if (callable_ != nullptr && tile.rows > 0 && tile.cols > 0)
      loops_[isa](callable_.get(), tile);
  }

 private:
  std::shared_ptr<const void> callable_;
  detail::PerIsa<detail::ScoreTileLoop<T>> loops_;
};

/// How a rectangular tile of (query, key) positions relates to a mask.
enum class TileVisibility : std::uint8_t {
  hidden,   ///< no (i, j) in the tile is visible: skip it
  visible,  ///< every (i, j) is visible: no mask evaluation needed (a bias may still apply)
  partial,  ///< evaluate the mask element by element
};

/// FlexAttention's mask_mod: `f(b, h, q_idx, kv_idx)` is true when key kv_idx is visible to
/// query q_idx. It only hides keys: what attn's other mask options hide stays hidden. Like
/// a ScoreMod, it must accept any index in [0, Lq) x [0, Lk). An empty MaskMod is none.
class MaskMod {
 public:
  MaskMod() = default;

  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, MaskMod> &&
                                              std::is_invocable_r_v<bool, const std::decay_t<F>&,
                                                                    Index, Index, Index, Index>>>
  explicit MaskMod(F&& f)
      : callable_(std::make_shared<const std::decay_t<F>>(std::forward<F>(f))),
        hide_float_(detail::hide_tile_loops<std::decay_t<F>, float>()),
        hide_double_(detail::hide_tile_loops<std::decay_t<F>, double>()),
        hide_long_double_(detail::hide_tile_loops<std::decay_t<F>, long double>()),
        count_(detail::count_visible_loops<std::decay_t<F>>()) {}

  explicit operator bool() const { return callable_ != nullptr; }

  /// Whether key kv_idx is visible to query q_idx (one indirect call: for tests).
  bool operator()(Index b, Index h, Index q_idx, Index kv_idx) const {
    return classify(b, h, q_idx, q_idx + 1, kv_idx, kv_idx + 1) != TileVisibility::hidden;
  }

  /// Sets the scores of the pairs the mod hides to -inf (T: float, double or long double),
  /// with the loop of `isa`.
  template <class T>
  void hide(const ScoreTile<T>& tile, Isa isa = Isa::generic) const {
    if (callable_ == nullptr || tile.rows <= 0 || tile.cols <= 0)
      return;
    if constexpr (std::is_same_v<T, float>)
      hide_float_[isa](callable_.get(), tile);
    else if constexpr (std::is_same_v<T, double>)
      hide_double_[isa](callable_.get(), tile);
    else
      hide_long_double_[isa](callable_.get(), tile);
  }

  /// Evaluates the mod on every pair of [i0, i1) x [j0, j1) with the loop of `isa`: hidden,
  /// visible or partial. An empty tile is hidden.
  TileVisibility classify(Index b, Index h, Index i0, Index i1, Index j0, Index j1,
                          Isa isa = Isa::generic) const {
    if (callable_ == nullptr)
      return TileVisibility::visible;
    if (i0 >= i1 || j0 >= j1)
      return TileVisibility::hidden;
    const Index visible = count_[isa](callable_.get(), b, h, i0, i1, j0, j1);
    if (visible == 0)
      return TileVisibility::hidden;
    return visible == (i1 - i0) * (j1 - j0) ? TileVisibility::visible
                                            : TileVisibility::partial;  // -1: mixed
  }

 private:
  std::shared_ptr<const void> callable_;
  detail::PerIsa<detail::ScoreTileLoop<float>> hide_float_;
  detail::PerIsa<detail::ScoreTileLoop<double>> hide_double_;
  detail::PerIsa<detail::ScoreTileLoop<long double>> hide_long_double_;
  detail::PerIsa<detail::CountLoop> count_;
};

}  // namespace attn
