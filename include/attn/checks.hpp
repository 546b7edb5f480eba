// attn/checks.hpp: the input checks every attention call shares (scaled-dot-product and
// linear attention, the backward): q, k and v shapes, an output that must not alias its
// inputs, the scale, and packed views; each throws std::invalid_argument naming the calling
// function.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attn/config.hpp"
#include "attn/outputs.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Throws unless q (B, Hq, Lq, D), k (B, Hkv, Lk, D) and v (B, Hkv, Lk, Dv) agree: one batch,
/// one head dim of q and k (at least 1), k and v alike, Hq a multiple of Hkv. Every call
/// that takes q, k and v words these rules so; `k_name` and `v_name` say where k and v come
/// from when the caller did not pass them (KVCache::attend: "k (cached)").
template <class TQ, class TKV>
void check_attention_shapes(const char* function, const HeadsView<const TQ>& q,
                            const HeadsView<const TKV>& k, const HeadsView<const TKV>& v,
                            const char* k_name = "k", const char* v_name = "v") {
  const std::string kn = k_name, vn = v_name;
  const auto shapes = [&] {
    return "q is " + shape_string({q.batch, q.heads, q.length, q.dim}) + ", " + kn + " is " +
           shape_string({k.batch, k.heads, k.length, k.dim}) + ", " + vn + " is " +
           shape_string({v.batch, v.heads, v.length, v.dim});
  };
  if (q.batch != k.batch || q.batch != v.batch) {
    throw_invalid_argument(function, shapes() + ": batch sizes differ");
  }
  if (q.dim != k.dim)
    throw_invalid_argument(function, shapes() + ": q and " + kn + " head dims differ");
  if (q.dim < 1)
    throw_invalid_argument(function, shapes() + ": the head dim must be positive");
  if (k.heads != v.heads)
    throw_invalid_argument(function, shapes() + ": " + kn + " and " + vn + " head counts differ");
  if (k.length != v.length)
    throw_invalid_argument(function, shapes() + ": " + kn + " and " + vn + " lengths differ");
  if (k.heads == 0 ? q.heads != 0 : q.heads % k.heads != 0) {
    throw_invalid_argument(function, shapes() + ": query heads (" + std::to_string(q.heads) +
                                         ") must be a multiple of key/value heads (" +
                                         std::to_string(k.heads) + ")");
  }
}

/// Throws unless the view `name` has the shape `wanted`; `legend` names its axes, e.g.
/// "(B, Hq, Lq, Dv)". One wording for every output and gradient shape.
inline void check_shape(const char* function, const char* name, const std::array<Index, 4>& actual,
                        const std::array<Index, 4>& wanted, const char* legend) {
  if (actual != wanted) {
    throw_invalid_argument(
        function, std::string(name) + " is " +
                      shape_string({actual[0], actual[1], actual[2], actual[3]}) + " but must be " +
                      shape_string({wanted[0], wanted[1], wanted[2], wanted[3]}) + " " + legend);
  }
}

/// T itself, in a parameter that must not take part in template argument deduction (so
/// that a braced list or a converting argument still matches).
template <class T>
struct identity {
  using type = T;
};
template <class T>
using identity_t = typename identity<T>::type;

/// Throws unless `rows` (e.g. the log-sum-exp) is (B, Hq, Lq), q's batch, heads and length;
/// packed views are held to q's offsets by check_packing.
template <class TR, class TQ>
void check_rows_shape(const char* function, const char* name, const RowsView<TR>& rows,
                      const HeadsView<const TQ>& q) {
  const std::array<Index, 3> wanted{q.batch, q.heads, q.length};
  if (rows.shape() != wanted) {
    throw_invalid_argument(
        function, std::string(name) + " is " + shape_string({rows.batch, rows.heads, rows.length}) +
                      " but must be " + shape_string({wanted[0], wanted[1], wanted[2]}) +
                      (q.row_offsets != nullptr ? " (B, Hq, Lq), packed like q" : " (B, Hq, Lq)"));
  }
  if (rows.data == nullptr && q.batch * q.heads * q.length > 0)
    throw_invalid_argument(function, std::string(name) + " has no data");
}

/// Throws unless a forward's `Return` set names only forward results.
inline void check_forward_returns(const char* function, Return returns) {
  if (wants(returns, Return::dbias) || wants(returns, Return::dsinks)) {
    throw_invalid_argument(function,
                           "Return::dbias and Return::dsinks are gradients: ask "
                           "scaled_dot_product_attention_backward for them");
  }
}

/// Throws unless a backward's `Return` set names only gradients.
inline void check_backward_returns(const char* function, Return returns) {
  if (wants(returns, Return::logsumexp) || wants(returns, Return::weights)) {
    throw_invalid_argument(function,
                           "Return::logsumexp and Return::weights are forward results: ask "
                           "scaled_dot_product_attention for them");
  }
}

/// Throws unless out is (B, Hq, Lq, Dv): q's batch, heads and length, the values' head dim.
template <class TQ, class TO>
void check_output_shape(const char* function, const HeadsView<const TQ>& q, Index value_dim,
                        const HeadsView<TO>& out) {
  check_shape(function, "out", out.shape(), {q.batch, q.heads, q.length, value_dim},
              "(B, Hq, Lq, Dv)");
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
template <class TQ, class TK, class TV, class TO>
void check_output_aliasing(const char* function, const HeadsView<const TQ>& q,
                           const HeadsView<const TK>& k, const HeadsView<const TV>& v,
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

/// One view of a call as the packing check sees it.
struct PackedRows {
  const char* name;
  const Index* row_offsets;  // (B + 1), or null for a padded view
  Index batch, length;
};

template <class T>
PackedRows packed_rows(const char* name, const HeadsView<T>& x) {
  return {name, x.row_offsets, x.batch, x.length};
}

/// Whether a call runs on packed views (packed_view()). Throws unless every view is packed
/// or none is; in each group (the query side: q, out, ...; the key side: k, v, ...) the views
/// hold the same sequences (equal offsets, entry by entry) and the first view's offsets are a
/// packed view's (from 0, non-decreasing, `length` the longest sequence), so that a view
/// built by hand is held to what packed_view() checks.
inline bool check_packing(const char* function, std::initializer_list<PackedRows> query_side,
                          std::initializer_list<PackedRows> key_side) {
  const PackedRows& first = *query_side.begin();
  const bool packed = first.row_offsets != nullptr;
  for (const auto& group : {query_side, key_side}) {
    for (const PackedRows& x : group) {
      if ((x.row_offsets != nullptr) != packed) {
        const PackedRows& p = packed ? first : x;
        const PackedRows& u = packed ? x : first;
        throw_invalid_argument(function, std::string(p.name) + " is a packed view but " + u.name +
                                             " is not: pass packed views (packed_view()) for "
                                             "all tensors or for none");
      }
    }
  }
  if (!packed)
    return false;
  for (const auto& group : {query_side, key_side}) {
    const PackedRows& lead = *group.begin();
    const std::vector<Index> offsets(lead.row_offsets, lead.row_offsets + lead.batch + 1);
    Index longest = 0;
    for (Index b = 0; b < lead.batch; ++b)
      longest = std::max(longest, lead.row_offsets[b + 1] - lead.row_offsets[b]);
    if (offsets.front() != 0 || !std::is_sorted(offsets.begin(), offsets.end()) ||
        longest != lead.length) {
      throw_invalid_argument(function, std::string(lead.name) + "'s row offsets " +
                                           list_string(offsets) + " with length " +
                                           std::to_string(lead.length) +
                                           " are not a packed view's: build it with packed_view()");
    }
    for (const PackedRows& x : group) {
      if (x.batch != lead.batch || !std::equal(offsets.begin(), offsets.end(), x.row_offsets)) {
        throw_invalid_argument(
            function,
            std::string(x.name) + " holds other sequences than " + lead.name + " (" +
                list_string(std::vector<Index>(x.row_offsets, x.row_offsets + x.batch + 1)) +
                " against " + list_string(offsets) + "): pack it with " + lead.name +
                "'s cu_seqlens");
      }
    }
  }
  return true;
}

/// The options a packed call refuses: per-sequence lengths (the offsets give them), a
/// keep-mask or a bias (a (B, H, Lq, Lk) tensor has no meaning on packed tokens).
template <class OptionsT>
void check_packed_options(const char* function, const OptionsT& options) {
  if (!options.key_lengths.empty() || !options.query_lengths.empty()) {
    throw_invalid_argument(function,
                           "options.key_lengths and options.query_lengths must be empty on "
                           "packed views: their row offsets give the lengths");
  }
  if (!options.keep_mask.empty() || !options.bias.empty()) {
    throw_invalid_argument(function,
                           "options.keep_mask and options.bias are not supported on packed "
                           "views: pad the sequences, or express the mask with causal, window, "
                           "sink tokens, ALiBi or a mask_mod");
  }
}

/// The options of a packed call as the kernels see them: each sequence's query and key
/// lengths from the views' offsets, so that every rule applies within a sequence.
template <class OptionsT, class TQ, class TKV>
OptionsT per_sequence_options(const OptionsT& options,
                              const HeadsView<TQ>& q,     // packed (B, Hq, Lq, D)
                              const HeadsView<TKV>& k) {  // packed (B, Hkv, Lk, D)
  OptionsT per_sequence = options;
  per_sequence.query_lengths.resize(static_cast<std::size_t>(q.batch));
  per_sequence.key_lengths.resize(static_cast<std::size_t>(q.batch));
  for (Index b = 0; b < q.batch; ++b) {
    per_sequence.query_lengths[static_cast<std::size_t>(b)] = q.rows(b);
    per_sequence.key_lengths[static_cast<std::size_t>(b)] = k.rows(b);
  }
  return per_sequence;
}

}  // namespace attn::detail
