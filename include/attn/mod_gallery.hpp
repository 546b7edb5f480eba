// attn/mod_gallery.hpp: ready-made mask_mods and score_mods (attn/mods.hpp), the attention
// variants of FlexAttention's examples. Each function returns a plain callable (wrap it in
// MaskMod or ScoreMod<T>), so that combining two of them with all_of / any_of keeps both
// inlined in the kernels' tile loops. Indices are positions within the sequence: q_idx of
// the query, kv_idx of the key (docs/mods.md shows each against the option it replaces).
// Each callable owns its tables through a shared pointer and reads them through a plain
// pointer it also captures: GCC vectorises a tile loop through that one indirection, not
// through a shared_ptr's and a vector's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attn/config.hpp"

namespace attn::gallery {

/// Causal, top-left aligned (Causal::top_left): key kv_idx visible iff kv_idx <= q_idx + offset;
/// offset Lk - Lq gives the bottom-right alignment (Causal::bottom_right).
inline auto causal(Index offset = 0) {
  return [offset](Index, Index, Index q_idx, Index kv_idx) { return kv_idx <= q_idx + offset; };
}

/// A sliding window around the diagonal q_idx + offset, inclusive: left keys before it and
/// right after it; -1 = unbounded on that side (the option Window{left, right}).
inline auto sliding_window(Index left, Index right, Index offset = 0) {
  return [left, right, offset](Index, Index, Index q_idx, Index kv_idx) {
    const Index c = q_idx + offset;
    return (left < 0 || kv_idx >= c - left) && (right < 0 || kv_idx <= c + right);
  };
}

/// Prefix-LM (T5, UniLM): the first prefix_lengths[b] keys of sequence b are visible to every
/// query (bidirectional), the rest causally.
inline auto prefix_lm(std::vector<Index> prefix_lengths) {
  auto owner = std::make_shared<const std::vector<Index>>(std::move(prefix_lengths));
  return [owner, prefix = owner->data()](Index b, Index, Index q_idx, Index kv_idx) {
    return kv_idx <= q_idx || kv_idx < prefix[b];
  };
}

/// Documents packed into one sequence: a query sees the keys of its own document,
/// document_ids[position] (one id per position, queries and keys alike).
inline auto document(std::vector<Index> document_ids) {
  auto owner = std::make_shared<const std::vector<Index>>(std::move(document_ids));
  return [owner, ids = owner->data()](Index, Index, Index q_idx, Index kv_idx) {
    return ids[q_idx] == ids[kv_idx];
  };
}

/// Longformer: a sliding window of `radius` keys each side, plus global tokens that see
/// every key and are seen by every query (global[position], queries and keys alike).
inline auto global_and_window(Index radius, std::vector<bool> global) {
  auto owner = std::make_shared<const std::vector<char>>(global.begin(), global.end());
  return [owner, g = owner->data(), radius](Index, Index, Index q_idx, Index kv_idx) {
    return std::abs(q_idx - kv_idx) <= radius || g[q_idx] != 0 || g[kv_idx] != 0;
  };
}

/// The pair is visible when every mask_mod says so. Every mask_mod is evaluated (no
/// short circuit: a branch-free loop vectorises).
template <class... Masks>
auto all_of(Masks... masks) {
  return [masks...](Index b, Index h, Index q_idx, Index kv_idx) {
    return (static_cast<int>(masks(b, h, q_idx, kv_idx)) & ...) != 0;
  };
}

/// The pair is visible when some mask_mod says so; every one is evaluated.
template <class... Masks>
auto any_of(Masks... masks) {
  return [masks...](Index b, Index h, Index q_idx, Index kv_idx) {
    return (static_cast<int>(masks(b, h, q_idx, kv_idx)) | ...) != 0;
  };
}

/// ALiBi as a score_mod: score - slopes[h] * |q_idx + offset - kv_idx| (the option
/// alibi_slopes, whose diagonal offset is 0 for Causal::top_left and Lk - Lq otherwise).
template <class T>
auto alibi(std::vector<T> slopes, Index offset = 0) {
  auto owner = std::make_shared<const std::vector<T>>(std::move(slopes));
  // The distance through int32 and its absolute value in T: 64-bit integers become vectors
  // of floats only with AVX-512DQ, 32-bit ones with every instruction set.
  return [owner, s = owner->data(), offset](T score, Index, Index h, Index q_idx, Index kv_idx) {
    const auto distance = static_cast<std::int32_t>(q_idx + offset - kv_idx);
    return score - s[h] * std::abs(static_cast<T>(distance));
  };
}

/// Logit soft-capping as a score_mod: cap * tanh(score / cap) (the option softcap).
template <class T>
auto softcap(T cap) {
  return [cap](T score, Index, Index, Index, Index) { return cap * std::tanh(score / cap); };
}

/// T5's relative-position bucket of relative_position = kv_idx - q_idx (Raffel et al. 2020):
/// with bidirectional buckets, half of them for keys after the query; the first half of a
/// side's buckets hold distances 0, 1, ..., n / 2 - 1 exactly, the rest cover distances up
/// to max_distance logarithmically, and farther keys share the last bucket.
inline Index t5_bucket(Index relative_position, bool bidirectional, Index buckets,
                       Index max_distance) {
  Index bucket = 0, n = 0;
  if (bidirectional) {
    buckets /= 2;
    bucket = relative_position > 0 ? buckets : 0;
    n = std::abs(relative_position);
  } else {
    n = std::max(-relative_position, Index(0));
  }
  const Index exact = buckets / 2;
  if (n < exact)
    return bucket + n;
  const double log_ratio = std::log(static_cast<double>(n) / static_cast<double>(exact)) /
                           std::log(static_cast<double>(max_distance) / static_cast<double>(exact));
  const auto large = exact + static_cast<Index>(log_ratio * static_cast<double>(buckets - exact));
  return bucket + std::min(large, buckets - 1);
}

/// T5's relative-position bias as a score_mod: score + table[bucket * heads + h], table
/// (buckets, heads) row-major as T5's relative_attention_bias embedding. The buckets of every
/// relative position in (-max_length, max_length) are computed once, here, so the kernels'
/// loop only looks them up.
template <class T>
auto t5_relative_bias(std::vector<T> table, Index heads, Index max_length, bool bidirectional,
                      Index buckets = 32, Index max_distance = 128) {
  constexpr const char* function = "gallery::t5_relative_bias";
  if (heads < 1 || buckets < 2 || max_distance < 2 || max_length < 1) {
    detail::throw_invalid_argument(
        function, "heads " + std::to_string(heads) + ", buckets " + std::to_string(buckets) +
                      ", max_distance " + std::to_string(max_distance) + ", max_length " +
                      std::to_string(max_length) +
                      ": need heads >= 1, buckets >= 2, max_distance >= 2, max_length >= 1");
  }
  if (static_cast<Index>(table.size()) != buckets * heads) {
    detail::throw_invalid_argument(function, "table has " + std::to_string(table.size()) +
                                                 " entries but must have buckets * heads = " +
                                                 std::to_string(buckets * heads));
  }
  // bias[h * span + relative_position + max_length - 1]: per head, so that a tile's column
  // (consecutive queries) reads consecutive entries
  const Index span = 2 * max_length - 1;
  auto bias = std::make_shared<std::vector<T>>(static_cast<std::size_t>(span * heads));
  for (Index r = -(max_length - 1); r < max_length; ++r) {
    const Index bucket = t5_bucket(r, bidirectional, buckets, max_distance);
    for (Index h = 0; h < heads; ++h) {
      (*bias)[static_cast<std::size_t>(h * span + r + max_length - 1)] =
          table[static_cast<std::size_t>(bucket * heads + h)];
    }
  }
  const std::shared_ptr<const std::vector<T>> owner = std::move(bias);
  const Index origin = max_length - 1;
  return [owner, values = owner->data(), span, origin](T score, Index, Index h, Index q_idx,
                                                       Index kv_idx) {
    return score + values[h * span + kv_idx - q_idx + origin];
  };
}

}  // namespace attn::gallery
