// attn/kernels/decode.hpp: attention for a few queries against many keys (decoding).
//
//   q      (B, Hq, Lq, D)     Lq small (1 when generating a token)
//   k      (B, Hkv, Lk, D)    S: the compute scalar, or Eigen::half / Eigen::bfloat16 (float)
//   v      (B, Hkv, Lk, Dv)   S
//   out    (B, Hq, Lq, Dv)
//
// Decoding is memory-bound: each call reads every visible key and value once and does only
// about 4 * G FLOPs per element read (G = Hq / Hkv query heads per key/value head). The
// prefill kernels take one (b, query head) per work item, so with grouped-query attention
// they read each key/value head G times, and a one-row query tile fills one lane of a
// vector. This kernel instead:
//   - takes all G * Lq query rows of one (b, kv head) as one tile: K and V are streamed once
//     per group, not once per query head;
//   - splits the keys of each (b, kv head) into splits of `split_keys` keys (a constant, not
//     derived from the thread count) and runs (b, kv head, split) items in parallel, so one
//     long sequence keeps every core busy;
//   - per split keeps a partial online softmax (running max m, sum l, unnormalised
//     accumulator acc) for every row, then merges the splits of a (b, kv head) by
//     log-sum-exp in split order. Every item is computed the same way whatever the thread
//     count and the merge order is fixed, so results are bitwise identical for any number
//     of threads;
//   - reads K and V in S, so a half cache costs half the bandwidth: the vector products
//     (simd/decode_products.inl) widen each piece of a k or v row in a register and prefetch
//     the next key block's rows; the generic ones widen blocks of `key_block` rows into the
//     workspace.
// Accumulation (scores, softmax sums, P V) is always in the compute scalar, never in half:
// a half accumulator has an 11-bit significand, so summing thousands of weights stops
// growing once the sum reaches 2^11 ulps of the terms (see the long-context test).
//
// Masks: the whole problem (attn/problem.hpp: causal either alignment, window, key and query
// lengths, sink tokens, keep-mask, mods, bias, ALiBi, softcap, learned sinks in the merge). Splits
// and key blocks outside every row's visible interval are skipped without arithmetic. A row that
// sees no key gives zeros and log-sum-exp -inf; NaN propagates.
//
// Extra memory (the one statement of it; docs/kernels.md links here), G = Hq / Hkv,
// split_keys = decode_split_keys (512), key_block = decode_key_block (64), attn/plan.hpp:
// per call, partials of splits * G * Lq * (Dv + 2) scalars for every (b, kv head),
// splits = ceil(Lk / split_keys): 1 MiB of floats at B = 1, Hkv = 8, Hq = 32, Lq = 1,
// Lk = 32768, Dv = 128; per thread, G * Lq * (D + key_block + 6) scalars (kernels/workspace.hpp:
// the scaled queries, a block of scores, six row vectors), plus key_block * (D + Dv) when S
// is 16-bit on the generic path (the vector paths widen in registers); 16-bit q and out are
// widened whole, (B, Hq, Lq, D + Dv) floats.
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "attn/config.hpp"
#include "attn/kernels/dispatch.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/quantized.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// The K/V formats a float decode reads: float, 16-bit, or quantized blocks.
template <class S>
inline constexpr bool is_float_readable_v =
    std::is_same_v<S, float> || is_16bit_scalar_v<S> || is_quantized_v<S>;

/// Decode attention over all (b, kv head, split) items of the plan, then the merge of each
/// (b, kv head)'s splits. Shapes and the mask must already be validated; tests may shrink
/// plan.split_keys and plan.key_block (> 0) to exercise many splits cheaply. K and V may be
/// stored in different formats (a q8_0 K with a q4_0 V, say); the views of quantized ones
/// count blocks in their dim.
template <class T, class SK, class SV = SK>
void decode_attention(const KernelPlan& plan,
                      const HeadsView<const T>& q,   // (B, Hq, Lq, D)
                      const HeadsView<const SK>& k,  // (B, Hkv, Lk, D / values_per_unit_v<SK>)
                      const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv / values_per_unit_v<SV>)
                      const HeadsView<T>& out,       // (B, Hq, Lq, Dv)
                      const AttentionProblem<T>& problem, T scale,
                      const RowValues<T>& logsumexp) {  // (B, Hq, Lq), (Hq, Tq) or null
  static_assert(
      (std::is_same_v<SK, T> && std::is_same_v<SV, T>) ||
          (std::is_same_v<T, float> && is_float_readable_v<SK> && is_float_readable_v<SV>),
      "decode_attention: K and V must be stored as T, or with T = float as float, "
      "Eigen::half, Eigen::bfloat16 or quantized blocks");
  ATTN_ASSERT(plan.split_keys > 0 && plan.key_block > 0);
  const Index batch = q.batch, q_heads = q.heads, kv_heads = k.heads, q_length = q.length;
  if (batch == 0 || q_heads == 0 || q_length == 0)
    return;
  const Index group = q_heads / kv_heads, rows = group * q_length, value_dim = out.dim;
  const Index splits = (k.length + plan.split_keys - 1) / plan.split_keys;
  const Index partial_size = rows * (value_dim + 2);
  const Index groups = batch * kv_heads, work_items = groups * splits;
  // Not cut to Lk: the block is the row stride of the scores, and a call must give the same
  // bits whatever the longest sequence it holds (Eigen's products round differently at
  // different strides).
  const Index key_block = plan.key_block;
  std::vector<T> partials(static_cast<std::size_t>(work_items * partial_size));
  const DecodeKernels<T, SK, SV>& kernels = decode_kernels<T, SK, SV>(plan.isa);
  // int8 products: the plan's choice, available only where the table has them.
  const auto decode_split = plan.int8_products && kernels.decode_split_int8 != nullptr
                                ? kernels.decode_split_int8
                                : kernels.decode_split;
  const bool widened = !(std::is_same_v<SK, T> && std::is_same_v<SV, T>);
  const auto make_workspace = [&] {
    Workspace<T> workspace;
    workspace.reserve_decode(rows, key_block, q.dim, value_dim,
                             widened && !kernels.widens_kv_in_registers);
    return workspace;
  };
  // Runs of consecutive splits a thread: one at a time, two threads took turns along a kv
  // head's keys, and each split began on rows the other thread's prefetches had requested
  // (docs/performance.md, "Tuning choices": "Decode's runs of splits").
  constexpr Index runs_per_thread = 8;
  for_each_item(
      work_items, plan.parallel, make_workspace,
      [&](Index item, Workspace<T>& workspace) {
        const Index pair = item / splits, split = item % splits;  // b * Hkv + kv head
        const Index j0 = split * plan.split_keys;
        const Index j1 = std::min(j0 + plan.split_keys, k.length);
        decode_split(q, k, v, problem, scale, pair / kv_heads, pair % kv_heads, j0, j1, key_block,
                     workspace, partials.data() + item * partial_size);
      },
      runs_per_thread);
  for_each_item(
      groups, plan.parallel, [] { return 0; },
      [&](Index pair, int) {
        kernels.merge_splits(partials.data() + pair * splits * partial_size, splits, partial_size,
                             pair / kv_heads, pair % kv_heads, group, out, problem, logsumexp);
      });
}

/// decode_attention for storage scalars TQ, TKV, TO: 16-bit q and out are widened and
/// narrowed whole (there are few query rows).
template <class TQ, class TKV, class TO>
void run_decode(const KernelPlan& plan,
                const HeadsView<const TQ>& q,   // (B, Hq, Lq, D)
                const HeadsView<const TKV>& k,  // (B, Hkv, Lk, D)
                const HeadsView<const TKV>& v,  // (B, Hkv, Lk, Dv)
                const HeadsView<TO>& out,       // (B, Hq, Lq, Dv)
                const AttentionProblem<compute_scalar_t<TQ>>& problem, compute_scalar_t<TQ> scale,
                const RowValues<compute_scalar_t<TQ>>& logsumexp) {  // or null
  using T = compute_scalar_t<TQ>;
  const Index batch = q.batch, q_heads = q.heads;
  std::vector<T> q_wide, out_wide;  // (B, Hq, Lq, D), (B, Hq, Lq, Dv) for 16-bit q, out
  // Contiguous views of the same shape as `like`: (B, H, L, width), or packed (T, H, width).
  const auto wide_view = [&](std::vector<T>& buffer, const auto& like, Index width) {
    const Index tokens =
        like.row_offsets != nullptr ? like.row_offsets[batch] : batch * like.length;
    buffer.resize(static_cast<std::size_t>(tokens * q_heads * width));
    HeadsView<T> view = bhld_view(buffer.data(), batch, q_heads, like.length, width);
    if (like.row_offsets != nullptr)
      view = {buffer.data(), batch,           q_heads,         like.length, width, 0,
              width,         q_heads * width, like.row_offsets};
    return view;
  };
  HeadsView<const T> q_view;
  HeadsView<T> out_view;
  if constexpr (std::is_same_v<TQ, T>) {
    q_view = q;
  } else {
    const HeadsView<T> wide = wide_view(q_wide, q, q.dim);
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < q_heads; ++h) {
        for (Index i = 0; i < q.rows(b); ++i)
          widen(plan.isa, q.head(b, h).row(i).data(), wide.head(b, h).row(i).data(), q.dim);
      }
    }
    q_view = wide;
  }
  if constexpr (std::is_same_v<TO, T>) {
    out_view = out;
  } else {
    out_view = wide_view(out_wide, out, v.dim);
  }
  decode_attention<T, TKV, TKV>(plan, q_view, k, v, out_view, problem, scale, logsumexp);
  if constexpr (!std::is_same_v<TO, T>) {
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < q_heads; ++h)
        out.head(b, h) = out_view.head(b, h).template cast<TO>();
    }
  }
}

}  // namespace attn::detail

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_DECODE_INSTANCES(ATTN_EXTERN_INSTANCE)
#endif
