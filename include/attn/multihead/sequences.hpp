// attn/multihead/sequences.hpp: MultiHeadAttention's self-attention over sequences held
// elsewhere than in one padded batch: forward_incremental, which decodes against a KVCache
// or against the sequences of a PagedKVCache (a padded batch, or packed rows of different
// counts), and forward_packed, over packed sequences (cu_seqlens). All project with the one
// fused GEMM and read q, k and v through the self-attention layout of
// attn/multihead/layout.hpp.
// Members of the class in attn/multihead/module.hpp; include attn/multihead.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/attention.hpp"
#include "attn/config.hpp"
#include "attn/kv_cache.hpp"
#include "attn/multihead/layout.hpp"
#include "attn/multihead/module.hpp"
#include "attn/options.hpp"
#include "attn/paged_kv_cache.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/projection.hpp"
#include "attn/tensor.hpp"

namespace attn {

namespace detail {

/// Throws unless the module's configuration allows forward_incremental (kdim = vdim = E,
/// no appended rows) and x_new's row width `width` is E; `x_shape` names x_new's shape.
inline void check_incremental_module(const char* function, const MultiHeadAttentionConfig& c,
                                     Index width, const std::string& x_shape) {
  if (c.kdim != c.embed_dim || c.vdim != c.embed_dim || c.add_bias_kv || c.add_zero_attn) {
    throw_invalid_argument(
        function, "needs kdim = vdim = embed_dim and neither add_bias_kv nor add_zero_attn");
  }
  if (width != c.embed_dim) {
    throw_invalid_argument(function, "x_new is " + x_shape + " but embed_dim is " +
                                         std::to_string(c.embed_dim) + ": widths differ");
  }
}

/// Throws unless `attention` leaves the causal mask and the lengths to the cache; for a
/// paged call (`paged`), also unless it sets nothing indexed by batch row: the rows of one
/// attention call there are the sequences of one count, not the call's batch rows.
template <class C>
void check_incremental_options(const char* function, const AttentionOptions<C>& attention,
                               bool paged) {
  if (attention.causal != Causal::none || !attention.key_lengths.empty() ||
      !attention.query_lengths.empty()) {
    throw_invalid_argument(
        function,
        "attention.causal, attention.key_lengths and attention.query_lengths must be unset: "
        "the cache applies the bottom-right causal mask and its own lengths");
  }
  if (!paged)
    return;
  const char* refused = !attention.keep_mask.empty()    ? "keep_mask"
                        : !attention.bias.empty()       ? "bias"
                        : attention.mask_mod            ? "mask_mod"
                        : !attention.block_mask.empty() ? "block_mask"
                        : attention.score_mod           ? "score_mod"
                        : attention.dropout_p != C(0)   ? "dropout_p"
                                                        : nullptr;
  if (refused != nullptr) {
    throw_invalid_argument(
        function, std::string("attention.") + refused +
                      " is set: over a paged cache the sequences of each count of new tokens "
                      "attend in a call of their own, so a batch index names no sequence "
                      "(keep-mask, bias, mods, block mask and dropout are refused; window, "
                      "sink tokens, ALiBi, softcap, sinks and the scale apply to all alike)");
  }
}

/// Throws unless counts[b] new tokens of sequence b from position positions[b] on fit the
/// rotary table; names[b] is sequence b's name in the message.
template <class C>
void check_rotary_room(const char* function, const RotaryEmbedding<C>& rotary,
                       const std::vector<Index>& positions, const std::vector<Index>& counts,
                       const std::vector<Index>& names) {
  for (std::size_t b = 0; b < positions.size(); ++b) {
    const Index first = positions[b], n = counts[b];
    if (n > 0 && first > rotary.max_positions() - n) {
      throw_invalid_argument(
          function, "sequence " + std::to_string(names[b]) + " holds " + std::to_string(first) +
                        " tokens: its " + std::to_string(n) +
                        " new tokens need rotary positions [" + std::to_string(first) + ", " +
                        std::to_string(first + n) + ") but the table holds [0, " +
                        std::to_string(rotary.max_positions()) +
                        ") (config.rotary->max_positions)");
    }
  }
}

}  // namespace detail

// The queries of the new tokens after their keys entered the cache: rotated at the positions
// the keys were, attended, written as (B, L, H, D) = (B, L, E).
template <class T>
template <class Attend>
void MultiHeadAttention<T>::attend_new_tokens(const HeadsView<T>& q,                // (B, H, L, D)
                                              const std::vector<Index>& positions,  // (B)
                                              T* merged,                            // (B*L, E)
                                              const Attend& attend) const {
  const Index batch = q.batch, length = q.length, e = config_.embed_dim;
  const Index heads = config_.num_heads, d = head_dim();
  if constexpr (std::is_same_v<T, C>) {
    if (has_rotary())
      rotary_.apply(q, positions);
    attend(HeadsView<const C>(q), blhd_view(merged, batch, length, heads, d));
  } else {  // 16-bit T: the queries widened (exactly), the output rounded to T once
    ATTN_ASSERT(q.head_stride == d);  // the heads of a token side by side: rows of E values
    Matrix<C> q_wide(batch * length, e), merged_wide(batch * length, e);
    const Isa isa = plan_isa<C>();
    for (Index b = 0; b < batch; ++b) {
      for (Index t = 0; t < length; ++t) {
        detail::widen(isa, q.data + b * q.batch_stride + t * q.row_stride,
                      q_wide.row(b * length + t).data(), e);
      }
    }
    const HeadsView<C> wide = blhd_view(q_wide.data(), batch, length, heads, d);
    if (has_rotary())  // rotated in float, not rounded to T again
      rotary_.apply(wide, positions);
    attend(HeadsView<const C>(wide), blhd_view(merged_wide.data(), batch, length, heads, d));
    Eigen::Map<Matrix<T>>(merged, batch * length, e) = merged_wide.template cast<T>();
  }
}

// The new tokens' keys enter the cache (rotated on their way in), the queries attend to
// everything cached with the bottom-right causal mask.
template <class T>
template <class S, class SV>
Tensor<T, 3> MultiHeadAttention<T>::forward_incremental(
    const Tensor<T, 3>& x_new,  // (B, Lnew, E)
    KVCache<S, SV>& cache, const AttentionOptions<C>& attention) const {
  static_assert(std::is_same_v<C, typename KVCache<S, SV>::compute_type>,
                "MultiHeadAttention::forward_incremental: the cache must compute in T's "
                "arithmetic scalar (a double cache for double; float, half or bfloat16 "
                "otherwise)");
  constexpr const char* function = "MultiHeadAttention::forward_incremental";
  const Index batch = x_new.dimension(0), length = x_new.dimension(1);
  const Index e = config_.embed_dim, d = head_dim();
  const Index kv_heads = config_.num_kv_heads;
  detail::check_incremental_module(function, config_, x_new.dimension(2), shape3(x_new));
  if (cache.batch() != batch || cache.kv_heads() != kv_heads || cache.dim() != d ||
      cache.value_dim() != d) {
    detail::throw_invalid_argument(
        function, "x_new is " + shape3(x_new) + " but the cache is (B, Hkv, D, Dv) = " +
                      detail::shape_string(
                          {cache.batch(), cache.kv_heads(), cache.dim(), cache.value_dim()}) +
                      ": it must be " + detail::shape_string({batch, kv_heads, d, d}));
  }
  detail::check_incremental_options(function, attention, false);
  const std::vector<Index> positions = cache.lengths();  // (B) of the first new token
  if (has_rotary()) {
    std::vector<Index> names(static_cast<std::size_t>(batch));
    for (Index b = 0; b < batch; ++b)
      names[static_cast<std::size_t>(b)] = b;
    detail::check_rotary_room(function, rotary_, positions,
                              std::vector<Index>(static_cast<std::size_t>(batch), length), names);
  }
  // pass 1: q | k | v of the new tokens, one GEMM into (B, Lnew, E + 2*Ekv).
  const detail::ProjectionLayout layout = projection_layout(true, batch, length, length);
  Matrix<T> qkv(layout.kv_buffer_rows(), layout.kv_stride);
  project_rows(x_new, in_proj_.fused_weight(), in_proj_.bq(), qkv.data(), layout.kv_rows_per_batch,
               layout.kv_stride);
  const HeadsView<const T> new_keys = layout.k_view(static_cast<const T*>(qkv.data()));
  const HeadsView<const T> new_values = layout.v_view(static_cast<const T*>(qkv.data()));
  if (has_rotary())
    cache.append(new_keys, new_values, rotary_);  // rotated once, on their way in
  else
    cache.append(new_keys, new_values);
  // pass 2: attention against the whole cache, written as (B, Lnew, H, D) = (B, Lnew, E).
  Matrix<T> merged(batch * length, e);
  attend_new_tokens(layout.q_view(qkv.data()), positions, merged.data(),
                    [&](const HeadsView<const C>& q, const HeadsView<C>& out) {
                      cache.attend_into(q, out, attention);
                    });
  // pass 3: output projection.
  Tensor<T, 3> output(batch, length, e);
  out_proj_.apply_into(ConstRowsMap<T>(merged.data(), batch * length, e, Eigen::OuterStride<>(e)),
                       RowsMap<T>(output.data(), batch * length, e, Eigen::OuterStride<>(e)));
  return output;
}

// A padded batch is the packed case with every sequence Lnew rows long.
template <class T>
template <class S, class SV>
Tensor<T, 3> MultiHeadAttention<T>::forward_incremental(
    const Tensor<T, 3>& x_new,  // (B, Lnew, E)
    PagedKVCache<S, SV>& cache, const std::vector<Index>& sequences,
    const AttentionOptions<C>& attention) const {
  static_assert(std::is_same_v<C, typename PagedKVCache<S, SV>::compute_type>,
                "MultiHeadAttention::forward_incremental: the cache must compute in T's "
                "arithmetic scalar (a double cache for double; float, half or bfloat16 "
                "otherwise)");
  constexpr const char* function = "MultiHeadAttention::forward_incremental";
  const Index batch = x_new.dimension(0), length = x_new.dimension(1);
  detail::check_incremental_module(function, config_, x_new.dimension(2), shape3(x_new));
  std::vector<Index> cu_seqlens(static_cast<std::size_t>(batch + 1));
  for (Index b = 0; b <= batch; ++b)
    cu_seqlens[static_cast<std::size_t>(b)] = b * length;
  Tensor<T, 3> output(batch, length, config_.embed_dim);
  forward_paged(function, x_new.data(), batch * length, cache, sequences, cu_seqlens, attention,
                output.data());
  return output;
}

template <class T>
template <class S, class SV>
Tensor<T, 2> MultiHeadAttention<T>::forward_incremental(
    const Tensor<T, 2>& x_new,  // (T, E)
    PagedKVCache<S, SV>& cache,
    const std::vector<Index>& sequences,   // (B)
    const std::vector<Index>& cu_seqlens,  // (B + 1)
    const AttentionOptions<C>& attention) const {
  static_assert(std::is_same_v<C, typename PagedKVCache<S, SV>::compute_type>,
                "MultiHeadAttention::forward_incremental: the cache must compute in T's "
                "arithmetic scalar (a double cache for double; float, half or bfloat16 "
                "otherwise)");
  constexpr const char* function = "MultiHeadAttention::forward_incremental";
  const Index tokens = x_new.dimension(0);
  detail::check_incremental_module(function, config_, x_new.dimension(1),
                                   detail::shape_string({tokens, x_new.dimension(1)}));
  detail::check_sequence_offsets(function, "cu_seqlens", cu_seqlens, tokens);
  if (cu_seqlens.size() != sequences.size() + 1) {
    detail::throw_invalid_argument(
        function, "cu_seqlens is " + detail::list_string(cu_seqlens) + " but sequences is " +
                      detail::list_string(sequences) + ": it must have one entry more");
  }
  Tensor<T, 2> output(tokens, config_.embed_dim);
  forward_paged(function, x_new.data(), tokens, cache, sequences, cu_seqlens, attention,
                output.data());
  return output;
}

// One projection GEMM over every new token; the keys and values of all sequences appended
// in one call; the attention once per distinct count of new tokens (a sequence's queries
// attend exactly as they would alone: the kernels compute each sequence on its own, and a
// count picks the kernel); one output GEMM.
template <class T>
template <class S, class SV>
void MultiHeadAttention<T>::forward_paged(const char* function,
                                          const T* x,  // (tokens, E)
                                          Index tokens, PagedKVCache<S, SV>& cache,
                                          const std::vector<Index>& sequences,   // (B)
                                          const std::vector<Index>& cu_seqlens,  // (B + 1)
                                          const AttentionOptions<C>& attention,
                                          T* y) const {  // (tokens, E)
  const Index e = config_.embed_dim, d = head_dim();
  const Index heads = config_.num_heads, kv_heads = config_.num_kv_heads;
  const auto batch = static_cast<Index>(cu_seqlens.size()) - 1;
  if (cache.kv_heads() != kv_heads || cache.dim() != d || cache.value_dim() != d) {
    detail::throw_invalid_argument(
        function, "the cache is (Hkv, D, Dv) = " +
                      detail::shape_string({cache.kv_heads(), cache.dim(), cache.value_dim()}) +
                      " but the module's is " + detail::shape_string({kv_heads, d, d}));
  }
  cache.page_table().check_sequences(function, sequences, batch);
  detail::check_incremental_options(function, attention, true);
  const std::vector<Index> positions = cache.page_table().lengths_of(sequences);  // (B)
  std::vector<Index> counts(static_cast<std::size_t>(batch));                     // (B)
  for (std::size_t b = 0; b < counts.size(); ++b)
    counts[b] = cu_seqlens[b + 1] - cu_seqlens[b];
  if (has_rotary())
    detail::check_rotary_room(function, rotary_, positions, counts, sequences);
  // The batch rows of each count, in order of first appearance. Each group's attention is
  // checked now: an append cannot be taken back exactly (a copy-on-write stays copied).
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t b = 0; b < counts.size(); ++b) {
    if (counts[b] == 0)  // nothing to append or attend
      continue;
    const auto same = [&](const std::vector<std::size_t>& g) { return counts[g[0]] == counts[b]; };
    const auto group = std::find_if(groups.begin(), groups.end(), same);
    if (group == groups.end())
      groups.push_back({b});
    else
      group->push_back(b);
  }
  const auto ids_of = [&](const std::vector<std::size_t>& group) {
    std::vector<Index> ids;
    ids.reserve(group.size());
    for (const std::size_t b : group)
      ids.push_back(sequences[b]);
    return ids;
  };
  for (const std::vector<std::size_t>& group : groups) {
    const Index count = counts[group[0]];
    cache.check_attend(function, ids_of(group), heads, count, attention,
                       std::vector<Index>(group.size(), count));
  }
  if (tokens == 0)
    return;
  // pass 1: q | k | v of every new token, one GEMM into (tokens, E + 2*Ekv), read as packed
  // sequences; the keys and values appended (the append checks the pool's room first).
  const detail::ProjectionLayout layout = projection_layout(true, 1, tokens, tokens);
  Matrix<T> qkv(tokens, layout.kv_stride);
  detail::linear_into<T>(
      ConstRowsMap<T>(x, tokens, e, Eigen::OuterStride<>(e)), in_proj_.fused_weight(),
      in_proj_.bq(),
      RowsMap<T>(qkv.data(), tokens, layout.kv_stride, Eigen::OuterStride<>(layout.kv_stride)));
  const T* data = qkv.data();
  const HeadsView<const T> new_keys =
      detail::unchecked_packed_view(layout.k_view(data), cu_seqlens);
  const HeadsView<const T> new_values =
      detail::unchecked_packed_view(layout.v_view(data), cu_seqlens);
  if (has_rotary())
    cache.append(sequences, new_keys, new_values, rotary_, counts);  // rotated on the way in
  else
    cache.append(sequences, new_keys, new_values, counts);
  // pass 2: each count's queries, (group, H, count, D), against the cache.
  Matrix<T> merged(tokens, e);  // (tokens, H, D) = (tokens, E)
  for (const std::vector<std::size_t>& group : groups) {
    const Index count = counts[group[0]], rows = static_cast<Index>(group.size()) * count;
    const std::vector<Index> ids = ids_of(group);
    std::vector<Index> first;  // the group's positions
    first.reserve(group.size());
    for (const std::size_t b : group)
      first.push_back(positions[b]);
    const auto attend = [&](const HeadsView<const C>& q, const HeadsView<C>& out) {
      cache.attend_into(ids, q, out, attention);
    };
    const auto n = static_cast<Index>(group.size());
    if (rows == tokens) {  // every sequence, in order, `count` rows each: no copy
      const detail::ProjectionLayout all = projection_layout(true, n, count, count);
      attend_new_tokens(all.q_view(qkv.data()), first, merged.data(), attend);
      continue;
    }
    Matrix<T> q(rows, e), out(rows, e);  // (group, count, E): the group's rows gathered
    for (std::size_t k = 0; k < group.size(); ++k)
      q.middleRows(static_cast<Index>(k) * count, count) =
          qkv.block(cu_seqlens[group[k]], 0, count, e);
    attend_new_tokens(blhd_view(q.data(), n, count, heads, d), first, out.data(), attend);
    for (std::size_t k = 0; k < group.size(); ++k)
      merged.middleRows(cu_seqlens[group[k]], count) =
          out.middleRows(static_cast<Index>(k) * count, count);
  }
  // pass 3: output projection, one GEMM.
  out_proj_.apply_into(ConstRowsMap<T>(merged.data(), tokens, e, Eigen::OuterStride<>(e)),
                       RowsMap<T>(y, tokens, e, Eigen::OuterStride<>(e)));
}

// One fused GEMM over the T tokens, attention per sequence through packed views, one output
// GEMM.
template <class T>
Tensor<T, 2> MultiHeadAttention<T>::forward_packed(const Tensor<T, 2>& x,                 // (T, E)
                                                   const std::vector<Index>& cu_seqlens,  // (B + 1)
                                                   const AttentionOptions<C>& attention) const {
  constexpr const char* function = "MultiHeadAttention::forward_packed";
  const Index tokens = x.dimension(0);
  const Index e = config_.embed_dim, d = head_dim(), heads = config_.num_heads;
  if (!is_same_embed_dim() || config_.add_bias_kv || config_.add_zero_attn) {
    detail::throw_invalid_argument(
        function, "needs kdim = vdim = embed_dim and neither add_bias_kv nor add_zero_attn");
  }
  if (x.dimension(1) != e) {
    detail::throw_invalid_argument(
        function, "x is " + detail::shape_string({tokens, x.dimension(1)}) + " but embed_dim is " +
                      std::to_string(e) + ": widths differ");
  }
  detail::check_sequence_offsets(function, "cu_seqlens", cu_seqlens, tokens);
  if (has_rotary()) {  // checked here: the rotation runs before the attention checks them
    for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
      const Index n = cu_seqlens[b + 1] - cu_seqlens[b];
      if (n > rotary_.max_positions()) {
        detail::throw_invalid_argument(
            function, "sequence " + std::to_string(b) + " has " + std::to_string(n) +
                          " tokens but the rotary table holds positions [0, " +
                          std::to_string(rotary_.max_positions()) +
                          ") (config.rotary->max_positions)");
      }
    }
  }
  // The self-attention layout of one sequence of all T tokens, which packed views split.
  const detail::ProjectionLayout layout = projection_layout(true, 1, tokens, tokens);
  Matrix<T> qkv(tokens, layout.kv_stride);  // (T, E + 2*Ekv): q | k | v of every token
  detail::linear_into<T>(
      ConstRowsMap<T>(x.data(), tokens, e, Eigen::OuterStride<>(e)), in_proj_.fused_weight(),
      in_proj_.bq(),
      RowsMap<T>(qkv.data(), tokens, layout.kv_stride, Eigen::OuterStride<>(layout.kv_stride)));
  Matrix<T> merged(tokens, e);  // (T, H, D) = (T, E)
  const auto packed = [&](const auto& view) {
    return detail::unchecked_packed_view(view, cu_seqlens);
  };
  if (has_rotary()) {  // each sequence's tokens at positions 0, 1, ... of their own
    rotary_.apply(packed(layout.q_view(qkv.data())));
    rotary_.apply(packed(layout.k_view(qkv.data())));
  }
  const T* data = qkv.data();
  scaled_dot_product_attention_into<T>(
      packed(layout.q_view(data)), packed(layout.k_view(data)), packed(layout.v_view(data)),
      packed(blhd_view(merged.data(), 1, tokens, heads, d)), attention);
  Tensor<T, 2> output(tokens, e);
  out_proj_.apply_into(ConstRowsMap<T>(merged.data(), tokens, e, Eigen::OuterStride<>(e)),
                       RowsMap<T>(output.data(), tokens, e, Eigen::OuterStride<>(e)));
  return output;
}

}  // namespace attn
