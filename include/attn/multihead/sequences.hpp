// attn/multihead/sequences.hpp: MultiHeadAttention's self-attention over sequences held
// elsewhere than in one padded batch: forward_incremental, which decodes against a KVCache,
// and forward_packed, over packed sequences (cu_seqlens). Both project with the one fused
// GEMM and read q, k and v through the self-attention layout of attn/multihead/layout.hpp.
// Members of the class in attn/multihead/module.hpp; include attn/multihead.hpp.
#pragma once

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
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/projection.hpp"
#include "attn/tensor.hpp"

namespace attn {

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
  const Index heads = config_.num_heads, kv_heads = config_.num_kv_heads;
  if (!is_same_embed_dim() || config_.add_bias_kv || config_.add_zero_attn) {
    detail::throw_invalid_argument(
        function, "needs kdim = vdim = embed_dim and neither add_bias_kv nor add_zero_attn");
  }
  if (x_new.dimension(2) != e) {
    detail::throw_invalid_argument(function, "x_new is " + shape3(x_new) + " but embed_dim is " +
                                                 std::to_string(e) + ": widths differ");
  }
  if (cache.batch() != batch || cache.kv_heads() != kv_heads || cache.dim() != d ||
      cache.value_dim() != d) {
    detail::throw_invalid_argument(
        function, "x_new is " + shape3(x_new) + " but the cache is (B, Hkv, D, Dv) = " +
                      detail::shape_string(
                          {cache.batch(), cache.kv_heads(), cache.dim(), cache.value_dim()}) +
                      ": it must be " + detail::shape_string({batch, kv_heads, d, d}));
  }
  if (attention.causal != Causal::none || !attention.key_lengths.empty() ||
      !attention.query_lengths.empty()) {
    detail::throw_invalid_argument(
        function,
        "attention.causal, attention.key_lengths and attention.query_lengths must be unset: "
        "the cache applies the bottom-right causal mask and its own lengths");
  }
  const std::vector<Index> positions = cache.lengths();  // (B) of the first new token
  if (has_rotary()) {
    for (Index b = 0; b < batch; ++b) {
      const Index first = positions[static_cast<std::size_t>(b)];
      if (length > 0 && first > rotary_.max_positions() - length) {
        detail::throw_invalid_argument(
            function, "sequence " + std::to_string(b) + " holds " + std::to_string(first) +
                          " tokens: its " + std::to_string(length) +
                          " new tokens need rotary positions [" + std::to_string(first) + ", " +
                          std::to_string(first + length) + ") but the table holds [0, " +
                          std::to_string(rotary_.max_positions()) +
                          ") (config.rotary->max_positions)");
      }
    }
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
  if constexpr (std::is_same_v<T, C>) {
    if (has_rotary())
      rotary_.apply(layout.q_view(qkv.data()), positions);
    cache.attend_into(layout.q_view(static_cast<const T*>(qkv.data())),
                      blhd_view(merged.data(), batch, length, heads, d), attention);
  } else {  // 16-bit T: the queries widened (exactly), the output rounded to T once
    Matrix<C> q_wide(batch * length, e), merged_wide(batch * length, e);
    const Isa isa = plan_isa<C>();
    for (Index r = 0; r < batch * length; ++r)
      detail::widen(isa, qkv.row(r).data(), q_wide.row(r).data(), e);
    // q_wide is a q buffer of its own: the cross-attention layout's (B*Lnew, E).
    const detail::ProjectionLayout wide = projection_layout(false, batch, length, length);
    if (has_rotary())  // rotated in float, not rounded to T again
      rotary_.apply(wide.q_view(q_wide.data()), positions);
    cache.attend_into(wide.q_view(static_cast<const C*>(q_wide.data())),
                      blhd_view(merged_wide.data(), batch, length, heads, d), attention);
    merged = merged_wide.template cast<T>();
  }
  // pass 3: output projection.
  Tensor<T, 3> output(batch, length, e);
  out_proj_.apply_into(ConstRowsMap<T>(merged.data(), batch * length, e, Eigen::OuterStride<>(e)),
                       RowsMap<T>(output.data(), batch * length, e, Eigen::OuterStride<>(e)));
  return output;
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
