// attn/kernels/chunked.hpp: attention by query blocks (the tutorial's chunked_attention).
//
//   q block  (Bq, D)     rows [i0, i1) of one (b, h) head, read in place
//   k, v     (Lk, D), (Lk, Dv)   only the keys some row of the block may see, read in place
//   s block  (Bq, Lk')   scores then weights of the block, Lk' <= Lk, in the workspace
//
// Extra memory per thread: one (Bq, Lk) block, i.e. O(Bq * Lk) instead of the naive
// kernel's O(Lq * Lk). With 16-bit inputs add a widened (Bq, D + Dv) q and output block
// and a (Lk, D + Dv) k and v head per thread, widened once per head. The block's key range is cut
// to the union of its rows' visible intervals, so a causal mask or a window also saves work here
// (not as finely as flash).
#pragma once

#include <algorithm>
#include <limits>

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

/// Chunked attention for queries [i0, i0 + rows) of one (batch b, query head h) pair, whose
/// rows of q and out are given.
///   pass 1: s = scale * q[i0:i1] k[first:last]^T    one GEMM, scale folded into its alpha
///   pass 2: mask s unless the block is fully visible (then only add the bias, if any)
///   pass 3: row softmax of s in place, keeping each row's log-sum-exp
///   pass 4: out[i0:i1] = s v[first:last]             one GEMM
/// `workspace` is resized to at most (i1 - i0, Lk) and reused between calls.
template <class T>
void chunked_attention_block(const HeadMatrix<const T>& q,  // (rows, D)  queries i0 ..
                             const HeadMatrix<const T>& k,  // (Lk, D)    the whole head
                             const HeadMatrix<const T>& v,  // (Lk, Dv)
                             HeadMatrix<T> out,             // (rows, Dv) written
                             const AttentionProblem<T>& problem, Index b, Index h, T scale,
                             Index i0,
                             Matrix<T>& workspace,  // grows to (Bq, Lk)
                             T* logsumexp) {        // (rows) or null
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const Index rows = q.rows();
  const Index i1 = i0 + rows;
  const auto [first, last] = problem.mask().key_range(b, i0, i1);
  const Index cols = last - first;
  const TileVisibility visibility =
      cols == 0 ? TileVisibility::hidden : problem.mask().classify(b, h, i0, i1, first, last);
  if (visibility == TileVisibility::hidden) {
    out.setZero();
    if (logsumexp != nullptr)
      std::fill(logsumexp, logsumexp + rows,
                problem.sink(h) != nullptr ? *problem.sink(h) : minus_inf);
    return;
  }
  if (workspace.size() < rows * cols)
    workspace.resize(rows, cols);
  Eigen::Map<Matrix<T>> s(workspace.data(), rows, cols);

  s.noalias() = scale * (q * k.middleRows(first, cols).transpose());  // pass 1
  if (visibility == TileVisibility::partial || problem.modifies_scores())
    problem.apply(b, h, i0, first, s, visibility);  // 2
  for (Index r = 0; r < rows; ++r) {                // pass 3
    const T lse = softmax_in_place(s.row(r).data(), cols, problem.sink(h));
    if (logsumexp != nullptr)
      logsumexp[r] = lse;
  }
  out.noalias() = s * v.middleRows(first, cols);  // pass 4
}

/// The chunked kernel over all (b, query head, query block) items, last block first (under a
/// top-left causal mask the last blocks carry the most work); 16-bit k and v are widened
/// once per head, q and out block by block.
template <class TQ, class TKV, class TO>
void run_chunked(const KernelPlan& plan,
                 const HeadsView<const TQ>& q,   // (B, Hq, Lq, D)
                 const HeadsView<const TKV>& k,  // (B, Hkv, Lk, D)
                 const HeadsView<const TKV>& v,  // (B, Hkv, Lk, Dv)
                 const HeadsView<TO>& out,       // (B, Hq, Lq, Dv)
                 const AttentionProblem<compute_scalar_t<TQ>>& problem, compute_scalar_t<TQ> scale,
                 const RowValues<compute_scalar_t<TQ>>& logsumexp) {  // (B, Hq, Lq) or null
  using T = compute_scalar_t<TQ>;
  const Index q_heads = q.heads, q_length = q.length;
  const Index group = q_heads / k.heads, query_tile = plan.query_tile;
  const Index q_tiles = (q_length + query_tile - 1) / query_tile;
  struct Scratch {
    Matrix<T> block, q_rows;
    WidenedHead<T, TKV> k_head, v_head;
    NarrowedRows<T, TO> out_rows;
  };
  for_each_item(
      plan.work_items, plan.parallel, [] { return Scratch(); },
      [&](Index item, Scratch& s) {
        const auto [b, h, i0, rows] = query_tile_item(item, q_tiles, query_tile, q);
        if (rows <= 0)
          return;
        T* lse = logsumexp.head(b, h);
        chunked_attention_block<T>(rows_as<T, TQ>(plan.isa, q.head(b, h), i0, rows, s.q_rows),
                                   s.k_head(plan.isa, k, b, h / group),
                                   s.v_head(plan.isa, v, b, h / group),
                                   s.out_rows.rows(out.head(b, h), i0, rows), problem, b, h, scale,
                                   i0, s.block, lse != nullptr ? lse + i0 : nullptr);
        s.out_rows.store(out.head(b, h), i0, rows);
      });
}

}  // namespace attn::detail
