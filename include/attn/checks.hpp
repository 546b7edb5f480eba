// attn/checks.hpp: the input checks every attention call shares (scaled-dot-product and
// linear attention, the backward): q, k and v shapes, an output that must not alias its
// inputs, and the scale; each throws std::invalid_argument naming the calling function.
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>

#include "attn/config.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Throws unless q (B, Hq, Lq, D), k (B, Hkv, Lk, D) and v (B, Hkv, Lk, Dv) agree: one batch,
/// one head dim of q and k (at least 1), k and v alike, Hq a multiple of Hkv.
template <class TQ, class TKV>
void check_attention_shapes(const char* function, const HeadsView<const TQ>& q,
                            const HeadsView<const TKV>& k, const HeadsView<const TKV>& v) {
  const auto shapes = [&] {
    return "q is " + shape_string({q.batch, q.heads, q.length, q.dim}) + ", k is " +
           shape_string({k.batch, k.heads, k.length, k.dim}) + ", v is " +
           shape_string({v.batch, v.heads, v.length, v.dim});
  };
  if (q.batch != k.batch || q.batch != v.batch) {
    throw_invalid_argument(function, shapes() + ": batch sizes differ");
  }
  if (q.dim != k.dim)
    throw_invalid_argument(function, shapes() + ": q and k head dims differ");
  if (q.dim < 1)
    throw_invalid_argument(function, shapes() + ": the head dim must be positive");
  if (k.heads != v.heads)
    throw_invalid_argument(function, shapes() + ": k and v head counts differ");
  if (k.length != v.length)
    throw_invalid_argument(function, shapes() + ": k and v lengths differ");
  if (k.heads == 0 ? q.heads != 0 : q.heads % k.heads != 0) {
    throw_invalid_argument(function, shapes() + ": query heads (" + std::to_string(q.heads) +
                                         ") must be a multiple of key/value heads (" +
                                         std::to_string(k.heads) + ")");
  }
}

/// The scale given, or 1 / sqrt(dim) without one; throws unless it is finite.
template <class T>
T resolve_scale(const char* function, const std::optional<T>& scale, Index dim) {
  if (!scale)
    return T(1) / std::sqrt(static_cast<T>(dim));
  if (!std::isfinite(*scale)) {
    throw_invalid_argument(function, "scale is " + std::to_string(*scale) + ": must be finite");
  }
  return *scale;
}

/// Throws unless `out` is exactly `q` (same scalar, memory and strides: computing in place
/// is supported, each kernel reads a query row before it writes that row's output) or
/// shares no element with q, k and v (an output overlapping k or v would change keys that
/// later rows still read).
template <class TQ, class TKV, class TO>
void check_output_aliasing(const char* function, const HeadsView<const TQ>& q,
                           const HeadsView<const TKV>& k, const HeadsView<const TKV>& v,
                           const HeadsView<TO>& out_view) {
  const HeadsView<const TO> out = out_view;
  bool out_is_q = false;
  if constexpr (std::is_same_v<TQ, TO>) {
    out_is_q = out.data == q.data && out.batch_stride == q.batch_stride &&
               out.head_stride == q.head_stride && out.row_stride == q.row_stride &&
               out.dim == q.dim;
  }
  const auto overlap = [](const HeadsView<const TO>& x, const auto& y) {
    if constexpr (std::is_same_v<decltype(x), decltype(y)>)
      return views_may_overlap(x, y);  // knows disjoint column blocks of one buffer
    else
      return byte_ranges_overlap(x, y);
  };
  const char* overlapped = (!out_is_q && overlap(out, q)) ? "q"
                           : overlap(out, k)              ? "k"
                           : overlap(out, v)              ? "v"
                                                          : nullptr;
  if (overlapped != nullptr) {
    throw_invalid_argument(function, std::string("out overlaps ") + overlapped +
                                         ": out must be q itself (in place) or share no "
                                         "element with q, k and v");
  }
}

}  // namespace attn::detail
