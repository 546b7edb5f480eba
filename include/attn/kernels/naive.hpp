// attn/kernels/naive.hpp: the reference kernel. Materialises the (Lq, Lk) scores.
//
// Extra memory: one (Lq, n_k) score matrix per thread (reused across heads; n_k = the
// sequence's key length, padding keys are not scored), or none beyond
// the caller's weights buffer when the weights are requested (the scores are built there).
// With 16-bit inputs add one widened (Lq, D) q head, (Lk, D + Dv) k and v head and (Lq, Dv)
// output per thread. It is the only kernel that can return the full attention weights.
#pragma once

#include <algorithm>
#include <optional>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/kernels/widening.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/softmax.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Attention for one (batch b, query head h) pair, over its first n_k(b) keys (the rest are
/// padding: their weights are 0 and they cost nothing).
///   pass 1: S = scale * q k^T          one GEMM, scale folded into its alpha
///   pass 2: mask S (hidden -> -inf, add the bias)
///   pass 3: row softmax of S in place (with the head's sink), keeping each row's log-sum-exp,
///           then the dropout of the weights, if any
///   pass 4: out = S v                  one GEMM
template <class T>
void naive_attention_head(const HeadMatrix<const T>& q,  // (Lq, D)
                          const HeadMatrix<const T>& k,  // (Lk, D)
                          const HeadMatrix<const T>& v,  // (Lk, Dv)
                          HeadMatrix<T> out,             // (Lq, Dv)
                          const AttentionProblem<T>& problem, Index b, Index h, T scale,
                          Matrix<T>& workspace,    // reused between calls; resized to (Lq, n_k)
                          HeadMatrix<T>* weights,  // (Lq, Lk), or null
                          T* logsumexp) {          // (Lq), or null
  const Index q_length = q.rows();
  const Index k_length = k.rows();
  const Index keys = std::min(k_length, problem.mask().key_length(b));
  if (weights == nullptr)
    workspace.resize(q_length, keys);
  HeadMatrix<T> scores(weights != nullptr ? weights->data() : workspace.data(), q_length, keys,
                       Eigen::OuterStride<>(weights != nullptr ? weights->outerStride() : keys));
  if (weights != nullptr && keys < k_length)
    weights->rightCols(k_length - keys).setZero();

  scores.noalias() = scale * (q * k.topRows(keys).transpose());  // pass 1
  if (!problem.is_trivial())
    problem.apply(b, h, 0, 0, scores);    // pass 2
  for (Index i = 0; i < q_length; ++i) {  // pass 3
    const T lse = softmax_in_place(scores.row(i).data(), keys, problem.sink(h));
    if (logsumexp != nullptr)
      logsumexp[i] = lse;
    if (problem.dropout().active())  // the weights after dropout, as PyTorch's math path
      problem.dropout().apply_for_row(problem.dropout().row_key(b, h, i), 0, keys,
                                      scores.row(i).data());
  }
  out.noalias() = scores * v.topRows(keys);  // pass 4
}

/// The naive kernel over all (b, query head) items; 16-bit inputs are widened once per head.
template <class TQ, class TKV, class TO>
void run_naive(const KernelPlan& plan,
               const HeadsView<const TQ>& q,   // (B, Hq, Lq, D)
               const HeadsView<const TKV>& k,  // (B, Hkv, Lk, D)
               const HeadsView<const TKV>& v,  // (B, Hkv, Lk, Dv)
               const HeadsView<TO>& out,       // (B, Hq, Lq, Dv)
               const AttentionProblem<compute_scalar_t<TQ>>& problem, compute_scalar_t<TQ> scale,
               const HeadsView<compute_scalar_t<TQ>>* weights,      // (B, Hq, Lq, Lk) or null
               const RowValues<compute_scalar_t<TQ>>& logsumexp) {  // (B, Hq, Lq) or null
  using T = compute_scalar_t<TQ>;
  const Index q_heads = q.heads;
  const Index group = q_heads / k.heads;
  struct Scratch {
    Matrix<T> scores;  // (Lq, Lk), reused across heads
    WidenedHead<T, TQ> q_head;
    WidenedHead<T, TKV> k_head, v_head;
    NarrowedRows<T, TO> out_rows;
  };
  for_each_item(
      plan.work_items, plan.parallel, [] { return Scratch(); },
      [&](Index item, Scratch& s) {
        const Index b = item / q_heads, h = item % q_heads;
        const Index rows = q.rows(b);
        std::optional<HeadMatrix<T>> weights_head =
            weights != nullptr ? std::optional<HeadMatrix<T>>(weights->head(b, h)) : std::nullopt;
        naive_attention_head<T>(
            s.q_head(plan.isa, q, b, h), s.k_head(plan.isa, k, b, h / group),
            s.v_head(plan.isa, v, b, h / group), s.out_rows.rows(out.head(b, h), 0, rows), problem,
            b, h, scale, s.scores, weights_head ? &*weights_head : nullptr, logsumexp.head(b, h));
        s.out_rows.store(out.head(b, h), 0, rows);
      });
}

}  // namespace attn::detail
