// attn/shared_prefix.hpp: decoding many sequences that share one prefix (cascade attention).
//
//   prefix    KVCache, batch 1: the N tokens every sequence starts with (a system prompt)
//   suffixes  KVCache, batch B: each sequence's own tokens after the prefix, lengths n_b
//   q         (B, Hq, Lq, D)   the queries of each sequence's last Lq tokens (in its suffix)
//   out       (B, Hq, Lq, Dv)
//
// The result is attention over each sequence's N + n_b tokens with the cache's rule (query
// i of sequence b sees the whole prefix and suffix tokens j <= n_b - Lq + i), computed in
// two passes and merged (attn/merge.hpp, FlashInfer's cascade attention):
//   the prefix, once for all B sequences: the queries of the G = Hq / Hkv query heads of
//     each kv head and of every sequence stacked as the rows of one problem,
//     (1, Hkv, G B Lq, D) against (1, Hkv, N, D), so the flash kernel reads the prefix's
//     K and V once per call, not once per sequence, in GEMM-shaped tiles;
//   each suffix: KVCache::attend_into, the decode kernel for a few queries;
//   the merge of the two states, in place into out, with learned sinks counted once.
// Options: scale, softcap, learned sinks, and the kernel of the suffix pass. Refused, because
// the prefix pass has no per-sequence positions: window, sink tokens, ALiBi, keep-mask, bias,
// score_mod, mask_mod, block mask, dropout (and causal and lengths, which the caches decide).
// With RoPE, rotate the suffix keys at positions N + t yourself (RotaryEmbedding::apply with
// those positions) and append them without the rotary argument.
//
// Extra memory (the one statement of it): the stacked queries, the prefix pass's output and
// log-sum-exp, and the suffix pass's log-sum-exp when outputs.logsumexp is not given:
// B Hq Lq (D + Dv + 2) values of the compute type, beside the kernels' own workspaces.
#pragma once

#include <string>
#include <vector>

#include "attn/config.hpp"
#include "attn/kv_cache.hpp"
#include "attn/merge.hpp"
#include "attn/options.hpp"
#include "attn/outputs.hpp"
#include "attn/tensor.hpp"

namespace attn {

namespace detail {

/// The refusals of shared_prefix_attend_into, before anything runs.
template <class S, class SV, class C>
void check_shared_prefix(const char* function, const KVCache<S, SV>& prefix,
                         const KVCache<S, SV>& suffixes,
                         const HeadsView<const C>& q,  // (B, Hq, Lq, D)
                         const AttentionOutputViews<C>& outputs,
                         const AttentionOptions<C>& options) {
  if (prefix.batch() != 1) {
    throw_invalid_argument(function, "the prefix cache holds " + std::to_string(prefix.batch()) +
                                         " sequences: it must hold one, the shared prefix");
  }
  if (prefix.kv_heads() != suffixes.kv_heads() || prefix.dim() != suffixes.dim() ||
      prefix.value_dim() != suffixes.value_dim() || prefix.rotation() != suffixes.rotation()) {
    throw_invalid_argument(
        function, "the prefix cache is (Hkv, D, Dv) = " +
                      shape_string({prefix.kv_heads(), prefix.dim(), prefix.value_dim()}) +
                      " and the suffix cache " +
                      shape_string({suffixes.kv_heads(), suffixes.dim(), suffixes.value_dim()}) +
                      (prefix.rotation() != suffixes.rotation() ? " with another rotation" : "") +
                      ": the two must agree");
  }
  if (outputs.weights)
    throw_invalid_argument(function, "outputs.weights was given: a merged call forms no weights");
  if (options.causal != Causal::none || !options.key_lengths.empty() ||
      !options.query_lengths.empty()) {
    throw_invalid_argument(function,
                           "options.causal, options.key_lengths and options.query_lengths must "
                           "be unset: the caches' lengths and the bottom-right causal rule decide "
                           "them");
  }
  const auto refuse = [&](bool given, const char* what) {
    if (given) {
      throw_invalid_argument(function, std::string("options.") + what +
                                           " is not supported: the prefix pass is shared by "
                                           "every sequence and has no per-sequence positions");
    }
  };
  refuse(options.window.left >= 0 || options.window.right >= 0, "window");
  refuse(options.sink_tokens != 0, "sink_tokens");
  refuse(!options.alibi_slopes.empty(), "alibi_slopes");
  refuse(!options.keep_mask.empty(), "keep_mask");
  refuse(!options.bias.empty(), "bias");
  refuse(static_cast<bool>(options.score_mod), "score_mod");
  refuse(static_cast<bool>(options.mask_mod) || !options.block_mask.empty(),
         "mask_mod (or block_mask)");
  refuse(options.dropout_p != 0, "dropout_p");
  if (q.batch != suffixes.batch()) {
    throw_invalid_argument(function, "q is " + shape_string({q.batch, q.heads, q.length, q.dim}) +
                                         " but the suffix cache holds " +
                                         std::to_string(suffixes.batch()) + " sequences");
  }
  for (Index b = 0; b < suffixes.batch(); ++b) {
    if (suffixes.lengths()[static_cast<std::size_t>(b)] < q.length) {
      throw_invalid_argument(
          function, "q has " + std::to_string(q.length) + " queries but the suffix of sequence " +
                        std::to_string(b) + " holds only " +
                        std::to_string(suffixes.lengths()[static_cast<std::size_t>(b)]) +
                        " tokens: the queries' tokens must be appended to the suffixes first");
    }
  }
}

}  // namespace detail

/// Attention of each sequence's last Lq queries against the shared prefix and its own
/// suffix, into outputs.out (B, Hq, Lq, Dv) and, when given, outputs.logsumexp (B, Hq, Lq):
/// the same result as KVCache::attend_into over a cache holding prefix + suffix for every
/// sequence (within rounding: the two passes sum in another order). See the top of this
/// header for the passes, the options and the extra memory.
template <class S, class SV>
void shared_prefix_attend_into(
    const KVCache<S, SV>& prefix,                                     // batch 1, N tokens
    const KVCache<S, SV>& suffixes,                                   // batch B
    const HeadsView<const typename KVCache<S, SV>::compute_type>& q,  // (B, Hq, Lq, D)
    const AttentionOutputViews<typename KVCache<S, SV>::compute_type>& outputs,  // (B, Hq, Lq, Dv)
    const AttentionOptions<typename KVCache<S, SV>::compute_type>& options = {}) {
  using C = typename KVCache<S, SV>::compute_type;
  constexpr const char* function = "shared_prefix_attend";
  detail::check_shared_prefix(function, prefix, suffixes, q, outputs, options);
  const Index batch = q.batch, heads = q.heads, length = q.length, kv_heads = suffixes.kv_heads();
  const Index value_dim = suffixes.value_dim();
  // The passes without the sinks: the merge adds them once.
  AttentionOptions<C> pass = options;
  pass.sinks.clear();
  // Each suffix, straight into out (it checks q, out and logsumexp against the cache).
  std::vector<C> suffix_lse;
  RowsView<C> suffix_rows;
  if (outputs.logsumexp) {
    suffix_rows = *outputs.logsumexp;
  } else {
    suffix_lse.resize(static_cast<std::size_t>(batch * heads * length));
    suffix_rows = bhl_view(suffix_lse.data(), batch, heads, length);
  }
  suffixes.attend_into(q, {outputs.out, suffix_rows}, prefix.max_length() == 0 ? options : pass);
  if (prefix.max_length() == 0 || length == 0)
    return;
  // The prefix once: rows (g, b, i) of kv head h are query head h G + g of sequence b, so
  // the stacked queries and the prefix's out are (Hq, B, Lq, .) in memory.
  const Index group = heads / kv_heads, rows = group * batch * length;
  std::vector<C> stacked(static_cast<std::size_t>(heads * batch * length * q.dim));
  std::vector<C> prefix_out(static_cast<std::size_t>(heads * batch * length * value_dim));
  std::vector<C> prefix_lse(static_cast<std::size_t>(heads * batch * length));
  const HeadsView<C> stacked_by_sequence{
      stacked.data(), batch, heads, length, q.dim, length * q.dim, batch * length * q.dim, q.dim};
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h)
      stacked_by_sequence.head(b, h) = q.head(b, h);
  }
  prefix.attend_all_into(bhld_view(static_cast<const C*>(stacked.data()), 1, kv_heads, rows, q.dim),
                         {bhld_view(prefix_out.data(), 1, kv_heads, rows, value_dim),
                          bhl_view(prefix_lse.data(), 1, kv_heads, rows)},
                         pass);
  // The two states of every (b, h, i), merged in place into the suffix's.
  const AttentionState<C> prefix_state{
      HeadsView<const C>{prefix_out.data(), batch, heads, length, value_dim, length * value_dim,
                         batch * length * value_dim, value_dim},
      RowsView<const C>{prefix_lse.data(), batch, heads, length, length, batch * length}};
  const AttentionState<C> suffix_state{HeadsView<const C>(outputs.out),
                                       RowsView<const C>(suffix_rows)};
  merge_attention_states<C>({prefix_state, suffix_state}, {outputs.out, outputs.logsumexp},
                            options.sinks);
}

/// shared_prefix_attend_into() returning out (B, Hq, Lq, Dv); q a rank-4 tensor.
template <class S, class SV>
Tensor<typename KVCache<S, SV>::compute_type, 4> shared_prefix_attend(
    const KVCache<S, SV>& prefix, const KVCache<S, SV>& suffixes,
    const Tensor<typename KVCache<S, SV>::compute_type, 4>& q,  // (B, Hq, Lq, D)
    const AttentionOptions<typename KVCache<S, SV>::compute_type>& options = {}) {
  Tensor<typename KVCache<S, SV>::compute_type, 4> out(q.dimension(0), q.dimension(1),
                                                       q.dimension(2), suffixes.value_dim());
  shared_prefix_attend_into(prefix, suffixes, bhld_view(q), bhld_view(out), options);
  return out;
}

}  // namespace attn
