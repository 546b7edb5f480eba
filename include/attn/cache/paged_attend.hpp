// attn/cache/paged_attend.hpp: attention over the pages of a pool, shared by PagedKVCache and
// LatentCache: the checks of a paged attend, the paged row views handed to the decode and
// flash kernels (never a gathered copy), the Hadamard rotation of q and out around them.
//
//   keys    (pages, Hkv, P, key_stride)     storage units; a row's D values are its first
//   values  (pages, Hkv, P, value_stride)   units, Dv likewise; keys and values may be one
//                                           pool (LatentCache: V is the first C columns of K)
//   table   the cache's PageTable: each sequence's pool page per P tokens
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/cache/page_table.hpp"
#include "attn/cache/rows.hpp"
#include "attn/config.hpp"
#include "attn/hadamard.hpp"
#include "attn/kernels/decode.hpp"
#include "attn/kernels/flash.hpp"
#include "attn/mask.hpp"
#include "attn/outputs.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/quantized.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Where a paged cache keeps its rows and what they hold. Strides are in storage units
/// (values, or blocks of 32 for a quantized format) from one row to the next within a page;
/// a page holds Hkv heads of P rows each.
template <class S, class SV>
struct PagedPools {
  const S* keys = nullptr;                     // (pages, Hkv, P, key_stride)
  const SV* values = nullptr;                  // (pages, Hkv, P, value_stride)
  Index kv_heads = 0, dim = 0, value_dim = 0;  // Hkv, D and Dv in values
  Index key_stride = 0, value_stride = 0;      // storage units per row
  KVRotation rotation = KVRotation::none;
  const char* key_name = "k (cached)";  // what errors call the cached keys and values
  const char* value_name = "v (cached)";
};

/// A paged (B, Hkv, length, units) view of a pool whose rows are `stride` units apart, for
/// `table` (B, max_pages).
template <class X>
HeadsView<const X> paged_view(const X* pool, Index batch, Index kv_heads, Index length, Index units,
                              Index stride, Index page_size, const std::vector<Index>& table,
                              Index max_pages) {
  HeadsView<const X> view{
      pool,  batch, kv_heads, length, units, kv_heads * page_size * stride, page_size * stride,
      stride};
  view.pages = table.data();
  view.page_rows = page_size;
  view.pages_stride = max_pages;
  return view;
}

/// The whole pool of a paged view as one unpaged view: what the overlap checks measure.
template <class X>
HeadsView<const X> all_pages(const HeadsView<const X>& paged, Index pages) {
  return {paged.data, 1, 1, pages * paged.heads * paged.page_rows,
          paged.dim,  0, 0, paged.row_stride};
}

/// A view's shape with `dim` values per row and no data: what the shape checks measure.
template <class C, class X>
HeadsView<const C> shape_of(const HeadsView<const X>& x, Index dim) {
  return {nullptr, x.batch, x.heads, x.length, dim, 0, 0, dim};
}

/// Throws when a query of the call could see a token of a released page.
inline void check_released(const char* function, const PageTable& table,
                           const std::vector<Index>& sequences, const Mask& mask, Index q_length) {
  for (std::size_t b = 0; b < sequences.size(); ++b) {
    const auto [released_begin, released_end] = table.released(sequences[b]);
    if (released_begin == released_end)
      continue;
    for (Index i = 0; i < q_length; ++i) {
      const Mask::KeyIntervals keys = mask.key_intervals(static_cast<Index>(b), i);
      for (std::size_t n = 0; n < keys.count; ++n) {
        const auto [first, last] = keys.interval[n];
        if (first < released_end && last > released_begin) {
          throw_invalid_argument(
              function, "sequence " + std::to_string(sequences[b]) + ": query " +
                            std::to_string(i) + " would see keys [" + std::to_string(first) + ", " +
                            std::to_string(last) + ") but tokens [" +
                            std::to_string(released_begin) + ", " + std::to_string(released_end) +
                            ") were released (release_outside_window): give the window "
                            "and sink tokens that released them");
        }
      }
    }
  }
}

/// The checks of a paged attend's tensors: the shapes of q, the cached rows and the outputs,
/// overlaps, and what a paged cache cannot give (weights). The options: plan_paged_call.
template <class C, class S, class SV>
void check_paged_attend(const char* function, const PageTable& table,
                        const PagedPools<S, SV>& pools,
                        const HeadsView<const S>& keys,            // (B, Hkv, Lk, D) paged
                        const HeadsView<const SV>& values,         // (B, Hkv, Lk, Dv) paged
                        const HeadsView<const C>& q,               // (B, Hq, Lq, D)
                        const AttentionOutputViews<C>& outputs) {  // out (B, Hq, Lq, Dv), ...
  const HeadsView<C>& out = outputs.out;
  check_attention_packing(function, q, keys, values, outputs);
  check_attention_shapes(function, q, shape_of<C>(keys, pools.dim),
                         shape_of<C>(values, pools.value_dim), pools.key_name, pools.value_name);
  check_output_shape(function, q, pools.value_dim, out);
  const HeadsView<const S> key_pool = all_pages(keys, table.pages());
  const HeadsView<const SV> value_pool = all_pages(values, table.pages());
  check_output_aliasing(function, q, key_pool, value_pool, out);
  if (outputs.weights) {
    throw_invalid_argument(function,
                           "weights are not available from a paged cache (its kernels, decode and "
                           "flash, never form them)");
  }
  check_optional_outputs(function, q, key_pool, value_pool, outputs);
}

/// What a paged attend gives the kernels once the options are checked: the options with the
/// cache's mask and lengths, the plan, the scale. (The problem is built from `options` by the
/// caller: it is not movable into a result.)
template <class C>
struct PagedCall {
  AttentionOptions<C> options;
  KernelPlan plan;
  C scale = 0;
  Index max_length = 0;
};

/// The checks of the options a paged attend of q_length queries of q_heads heads per listed
/// sequence (holding `lengths` tokens) makes, and its plan. Shared by the attend and by
/// PagedKVCache::check_attend, which asks before an append it cannot undo.
template <class C, class S, class SV>
PagedCall<C> plan_paged_call(const char* function, const PagedPools<S, SV>& pools,
                             const std::vector<Index>& sequences, const std::vector<Index>& lengths,
                             Index q_heads, Index q_length, const AttentionOptions<C>& options,
                             bool causal) {
  if (options.causal != Causal::none || !options.key_lengths.empty() ||
      !options.query_lengths.empty()) {
    throw_invalid_argument(
        function, std::string("options.causal, options.key_lengths and options.query_lengths "
                              "must be unset: the cache applies ") +
                      (causal ? "the bottom-right causal mask and its own lengths"
                              : "its own lengths (every query sees every cached token)"));
  }
  const auto batch = static_cast<Index>(lengths.size());
  for (std::size_t b = 0; b < lengths.size() && causal; ++b) {
    if (lengths[b] < q_length) {
      throw_invalid_argument(
          function, "q is " + shape_string({batch, q_heads, q_length, pools.dim}) + ": " +
                        std::to_string(q_length) + " queries but sequence " +
                        std::to_string(sequences[b]) + " holds only " + std::to_string(lengths[b]) +
                        " tokens (append the new tokens first)");
    }
  }
  if (options.algorithm != Algorithm::automatic && options.algorithm != Algorithm::decode &&
      options.algorithm != Algorithm::flash) {
    throw_invalid_argument(
        function, std::string("options.algorithm is ") + algorithm_name(options.algorithm) +
                      ": a paged cache runs the decode or the flash kernel (automatic, decode "
                      "or flash)");
  }
  PagedCall<C> call;
  call.max_length = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
  AttentionOptions<C>& o = call.options;
  o = options;
  o.causal = causal ? Causal::bottom_right : Causal::none;
  if (std::any_of(lengths.begin(), lengths.end(), [&](Index n) { return n != call.max_length; }))
    o.key_lengths = lengths;
  call.scale = resolve_scale(function, o.scale, pools.dim);
  constexpr bool quantized = is_quantized_v<S> || is_quantized_v<SV>;
  AttentionShape shape{batch,           q_heads,   pools.kv_heads, q_length,
                       call.max_length, pools.dim, pools.value_dim};
  shape.kv_element_bytes = quantized ? 1 : Index(sizeof(S));
  shape.kv_quantized = quantized;
  shape.k_int8_readable = is_quantized_v<S>;
  shape.kv_paged = true;
  shape.bf16_readable_kv = bf16_readable_v<S> && bf16_readable_v<SV>;
  call.plan = plan_attention<C>(shape, o, false, function);
  return call;
}

/// KVCache::attend_into over the listed sequences of a paged cache (batch row b of q and the
/// outputs is sequences[b]): q (B, Hq, Lq, D) the last Lq tokens of each (causal) or any
/// queries (attend_all), the pools read in place by the decode or the flash kernel. Throws,
/// writing nothing, on bad input; `function` names the caller in errors.
template <class C, class S, class SV>
void attend_pages(const char* function, const PageTable& table, const PagedPools<S, SV>& pools,
                  const std::vector<Index>& sequences,
                  const HeadsView<const C>& q,             // (B, Hq, Lq, D)
                  const AttentionOutputViews<C>& outputs,  // out (B, Hq, Lq, Dv), ...
                  const AttentionOptions<C>& options, bool causal) {
  table.check_sequences(function, sequences, q.batch);
  const std::vector<Index> lengths = table.lengths_of(sequences);
  const Index max_length = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
  const Index max_pages = std::max(table.pages_for(max_length), Index(1));
  const std::vector<Index> block_tables = table.tables_of(sequences, max_pages);
  const Index page_size = table.page_size();
  const HeadsView<const S> keys =
      paged_view(pools.keys, q.batch, pools.kv_heads, max_length, pools.dim / values_per_unit_v<S>,
                 pools.key_stride, page_size, block_tables, max_pages);
  const HeadsView<const SV> values = paged_view(
      pools.values, q.batch, pools.kv_heads, max_length, pools.value_dim / values_per_unit_v<SV>,
      pools.value_stride, page_size, block_tables, max_pages);
  check_paged_attend(function, table, pools, keys, values, q, outputs);
  const PagedCall<C> call =
      plan_paged_call(function, pools, sequences, lengths, q.heads, q.length, options, causal);
  const KernelPlan& plan = call.plan;
  const C scale = call.scale;
  const AttentionProblem<C> problem(function, q.batch, q.heads, q.length, max_length, call.options,
                                    plan.isa);
  check_released(function, table, sequences, problem.mask(), q.length);
  if (q.length == 0)
    return;
  const RowValues<C> logsumexp =
      outputs.logsumexp ? row_values(*outputs.logsumexp) : RowValues<C>{};
  const auto run = [&](const HeadsView<const C>& queries) {
    if (plan.algorithm == Algorithm::decode)
      decode_attention<C, S, SV>(plan, queries, keys, values, outputs.out, problem, scale,
                                 logsumexp);
    else
      run_flash(plan, queries, keys, values, outputs.out, problem, scale, logsumexp);
  };
  if (pools.rotation == KVRotation::none)
    return run(q);
  // The queries rotated like the keys; the output, rotated like the values, turned back.
  std::vector<C> rotated(static_cast<std::size_t>(q.batch * q.heads * q.length * pools.dim));
  const HeadsView<C> q_rotated = bhld_view(rotated.data(), q.batch, q.heads, q.length, pools.dim);
  for (Index b = 0; b < q.batch; ++b) {
    for (Index h = 0; h < q.heads; ++h) {
      q_rotated.head(b, h) = q.head(b, h);
      for (Index i = 0; i < q.length; ++i)
        hadamard_rotate(q_rotated.head(b, h).row(i).data(), pools.dim);
    }
  }
  run(q_rotated);
  const HeadsView<C>& out = outputs.out;
  for (Index b = 0; b < out.batch; ++b) {
    for (Index h = 0; h < out.heads; ++h) {
      for (Index i = 0; i < out.length; ++i)
        hadamard_rotate(out.head(b, h).row(i).data(), pools.value_dim);
    }
  }
}

}  // namespace attn::detail
