// attn/kernels/backward_views.hpp: the tensors of one attention backward call, as the naive
// and flash backward drivers (kernels/naive_backward.hpp, kernels/flash_backward.hpp) and the
// bias gradient take them, and their (b, kv head) work items.
//
//   q, dq      (B, Hq, Lq, D)     work items: (b, kv head), B * Hkv of them; an item owns
//   k, dk      (B, Hkv, Lk, D)    the dk and dv of its kv head and the dq of the
//   v, dv      (B, Hkv, Lk, Dv)   G = Hq / Hkv query heads that read it
//   out, dout  (B, Hq, Lq, Dv)
//   lse        (B, Hq, Lq)        the forward's log-sum-exp: contiguous, or (Hq, T) packed
#pragma once

#include "attn/config.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// One (b, kv head) work item of a backward.
struct KvHeadItem {
  Index b, kv_head;
};

/// The inputs and gradients of one backward call (validated by attention_backward_into):
/// storage scalar S, log-sum-exp in the compute scalar.
template <class S>
struct BackwardViews {
  using T = compute_scalar_t<S>;
  HeadsView<const S> q;     // (B, Hq, Lq, D)
  HeadsView<const S> k;     // (B, Hkv, Lk, D)
  HeadsView<const S> v;     // (B, Hkv, Lk, Dv)
  HeadsView<const S> out;   // (B, Hq, Lq, Dv)
  HeadsView<const S> dout;  // (B, Hq, Lq, Dv)
  RowValues<const T> lse;   // (B, Hq, Lq), or (Hq, T) for packed views
  HeadsView<S> dq;          // (B, Hq, Lq, D)
  HeadsView<S> dk;          // (B, Hkv, Lk, D)
  HeadsView<S> dv;          // (B, Hkv, Lk, Dv)

  /// G: the query heads per kv head.
  Index group() const { return q.heads / k.heads; }
  KvHeadItem item(Index i) const { return {i / k.heads, i % k.heads}; }
  /// The log-sum-exp of query head h of sequence b: (Lq).
  const T* lse_of(Index b, Index h) const { return lse.head(b, h); }
};

}  // namespace attn::detail
