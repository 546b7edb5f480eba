// attn/kernels/naive_backward.hpp: the reference backward, with the (Lq, Lk) probabilities
// materialised; and the gradients of the bias and of the learned sinks, for every algorithm.
//
//   q, dq      (B, Hq, Lq, D)      p = exp(z - lse)             (z: the masked, modified scores)
//   k, dk      (B, Hkv, Lk, D)     dp = dout v^T, delta = rowsum(dout * out), f = dropout
//   v, dv      (B, Hkv, Lk, Dv)    ds = p * (f dp - delta) * (1 - tanh^2(s / cap) with softcap)
//   out, dout  (B, Hq, Lq, Dv)     dq = scale ds k,  dk = scale ds^T q,  dv = (p f)^T dout
//   lse        (B, Hq, Lq)         dbias = p * (dp - delta), summed over the bias's broadcast
//                                  dimensions; dsink_h = -sum_i exp(sink_h - lse_i) delta_i
//
// Work items: (b, kv head), each owning its kv head's dk, dv and its query heads' dq, so
// every sum runs in one order whatever the thread count. Extra memory per thread: three
// (Lq, n_k) matrices (n_k = the sequence's key length); with 16-bit storage also one widened
// head of q, out, dout, k, v and float accumulators for dq, dk, dv.
//
// The bias gradient is a pass of its own (both algorithms): items are the elements of the
// bias's own (B, H) dimensions times query tiles, each recomputing its rows' ds and summing
// them into its own slice of dbias in a fixed order. It costs about two fifths of a backward
// more and one (Bq, Lk) tile of ds per thread.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/kernels/backward_views.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/kernels/widening.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Scratch of the score gradients of a block of rows.
template <class T>
struct ScoreGradientScratch {
  Matrix<T> p, ds, raw, f;  // (rows, n_k) each; raw with softcap, f with dropout
};

/// The weights p (after dropout, if any: p f) and score gradients ds (with respect to the
/// masked, modified scores z) of queries [i0, i0 + rows) of one (b, query head h) pair
/// against its first n_k(b) keys, into s.p and s.ds (rows, n_k). The softcap factor is not applied
/// (scale_score_gradients does it), so that ds is also the bias's gradient.
template <class T>
void score_gradients(const HeadMatrix<const T>& q,     // (rows, D)
                     const HeadMatrix<const T>& k,     // (Lk, D)
                     const HeadMatrix<const T>& v,     // (Lk, Dv)
                     const HeadMatrix<const T>& out,   // (rows, Dv)
                     const HeadMatrix<const T>& dout,  // (rows, Dv)
                     const T* lse,                     // (rows)
                     const AttentionProblem<T>& problem, bool softcap, Index b, Index h, Index i0,
                     T scale, ScoreGradientScratch<T>& s) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const Index rows = q.rows(), keys = std::min(k.rows(), problem.mask().key_length(b));
  s.p.resize(rows, keys);
  s.ds.resize(rows, keys);
  s.p.noalias() = scale * (q * k.topRows(keys).transpose());
  if (softcap)
    s.raw = s.p;
  if (!problem.is_trivial())
    problem.apply(b, h, i0, 0, s.p);
  for (Index r = 0; r < rows; ++r) {
    const T shift = lse[r] == minus_inf ? T(0) : lse[r];  // such rows see only -inf scores
    for (Index j = 0; j < keys; ++j)
      s.p(r, j) = std::exp(s.p(r, j) - shift);
  }
  s.ds.noalias() = dout * v.topRows(keys).transpose();
  const Dropout<T>& dropout = problem.dropout();
  if (dropout.active()) {  // ds = p (f dp - delta); then p becomes the dropped weights p f
    s.f.resize(rows, keys);
    for (Index r = 0; r < rows; ++r)
      dropout.factors_for_row(dropout.row_key(b, h, i0 + r), 0, keys, s.f.row(r).data());
    s.ds.array() *= s.f.array();
  }
  for (Index r = 0; r < rows; ++r) {
    const T delta = dout.row(r).dot(out.row(r));
    s.ds.row(r) = s.p.row(r).cwiseProduct((s.ds.row(r).array() - delta).matrix());
  }
  if (dropout.active())
    s.p.array() *= s.f.array();
}

/// ds *= 1 - tanh^2(raw / cap), the derivative of the soft-capping (no-op without it).
template <class T>
void scale_score_gradients(const std::optional<T>& softcap, ScoreGradientScratch<T>& s) {
  if (!softcap)
    return;
  const T inverse = T(1) / *softcap;
  s.ds.array() *= T(1) - (s.raw.array() * inverse).tanh().square();
}

/// The naive backward over all (b, kv head) items of `plan`; every element of dq, dk and dv
/// written (rows no query sees get zeros). 16-bit inputs are widened per head and the
/// gradients summed in float, then stored as S.
template <class S>
void run_naive_backward(const KernelPlan& plan, const BackwardViews<S>& x,
                        const AttentionProblem<compute_scalar_t<S>>& problem,
                        const std::optional<compute_scalar_t<S>>& softcap,
                        compute_scalar_t<S> scale) {
  using T = compute_scalar_t<S>;
  const Index group = x.group();
  struct Scratch {
    ScoreGradientScratch<T> gradients;
    WidenedHead<T, S> q_head, k_head, v_head, out_head, dout_head;
    Matrix<T> dq_head, dk_head, dv_head;  // (Lq, D), (Lk, D), (Lk, Dv)
  };
  for_each_item(
      plan.work_items, plan.parallel, [] { return Scratch(); },
      [&](Index i, Scratch& s) {
        const auto [b, kv_head] = x.item(i);
        const HeadMatrix<const T> k_head = s.k_head(plan.isa, x.k, b, kv_head);
        const HeadMatrix<const T> v_head = s.v_head(plan.isa, x.v, b, kv_head);
        s.dk_head.setZero(x.k.rows(b), x.k.dim);
        s.dv_head.setZero(x.v.rows(b), x.v.dim);
        for (Index g = 0; g < group; ++g) {
          const Index h = kv_head * group + g;
          const HeadMatrix<const T> q_head = s.q_head(plan.isa, x.q, b, h);
          const HeadMatrix<const T> dout_head = s.dout_head(plan.isa, x.dout, b, h);
          score_gradients<T>(q_head, k_head, v_head, s.out_head(plan.isa, x.out, b, h), dout_head,
                             x.lse_of(b, h), problem, softcap.has_value(), b, h, 0, scale,
                             s.gradients);
          scale_score_gradients(softcap, s.gradients);
          const Index keys = s.gradients.ds.cols();
          s.dq_head.noalias() = scale * (s.gradients.ds * k_head.topRows(keys));
          s.dk_head.topRows(keys).noalias() += scale * (s.gradients.ds.transpose() * q_head);
          s.dv_head.topRows(keys).noalias() += s.gradients.p.transpose() * dout_head;
          x.dq.head(b, h) = s.dq_head.template cast<S>();
        }
        x.dk.head(b, kv_head) = s.dk_head.template cast<S>();
        x.dv.head(b, kv_head) = s.dv_head.template cast<S>();
      });
}

/// The gradient of the bias (options.bias, of dims `bias_dims`, each 1 or the full size),
/// written into the view `dbias` of those dims: the score gradients ds summed over the
/// dimensions the bias broadcasts along, plan.query_tile rows at a time.
template <class S>
void run_bias_gradient(const KernelPlan& plan, const BackwardViews<S>& x,
                       const AttentionProblem<compute_scalar_t<S>>& problem,
                       compute_scalar_t<S> scale,
                       const HeadsView<compute_scalar_t<S>>& dbias) {  // the bias's dims
  using T = compute_scalar_t<S>;
  const std::array<Index, 4> bias_dims = dbias.shape();
  const Index group = x.group(), q_length = x.q.length, query_tile = plan.query_tile;
  const bool per_batch = bias_dims[0] != 1, per_head = bias_dims[1] != 1;
  const bool per_query = bias_dims[2] != 1, per_key = bias_dims[3] != 1;
  const Index tiles = per_query ? std::max<Index>(1, (q_length + query_tile - 1) / query_tile) : 1;
  const Index items = bias_dims[0] * bias_dims[1] * tiles;
  struct Scratch {
    ScoreGradientScratch<T> gradients;
    Matrix<T> q_rows, out_rows, dout_rows;
    WidenedHead<T, S> k_head, v_head;
  };
  for_each_item(
      items, plan.parallel, [] { return Scratch(); },
      [&](Index item, Scratch& s) {
        const Index tile = item % tiles, bias_head = item / tiles;
        const Index bb = bias_head / bias_dims[1], hh = bias_head % bias_dims[1];
        const Index i0 = per_query ? tile * query_tile : 0;
        const Index i1 = per_query ? std::min(q_length, i0 + query_tile) : q_length;
        HeadMatrix<T> target = dbias.head(bb, hh);  // (Lq or 1, Lk or 1)
        target.middleRows(per_query ? i0 : 0, per_query ? i1 - i0 : 1).setZero();
        for (Index b = per_batch ? bb : 0; b < (per_batch ? bb + 1 : x.q.batch); ++b) {
          for (Index h = per_head ? hh : 0; h < (per_head ? hh + 1 : x.q.heads); ++h) {
            const HeadMatrix<const T> k_head = s.k_head(plan.isa, x.k, b, h / group);
            const HeadMatrix<const T> v_head = s.v_head(plan.isa, x.v, b, h / group);
            for (Index r0 = i0; r0 < i1; r0 += query_tile) {
              const Index n = std::min(query_tile, i1 - r0);
              score_gradients<T>(rows_as<T, S>(plan.isa, x.q.head(b, h), r0, n, s.q_rows), k_head,
                                 v_head,
                                 rows_as<T, S>(plan.isa, x.out.head(b, h), r0, n, s.out_rows),
                                 rows_as<T, S>(plan.isa, x.dout.head(b, h), r0, n, s.dout_rows),
                                 x.lse_of(b, h) + r0, problem, false, b, h, r0, scale, s.gradients);
              const Index keys = s.gradients.ds.cols();
              for (Index r = 0; r < n; ++r) {
                T* row = target.row(per_query ? r0 + r : 0).data();
                for (Index j = 0; j < keys; ++j)
                  row[per_key ? j : 0] += s.gradients.ds(r, j);
              }
            }
          }
        }
      });
}

/// The gradients of the learned sinks (problem.sink(h)) into dsinks (Hq):
/// dsink_h = -sum over b and the real queries i of exp(sink_h - lse_i) * delta_i.
template <class S>
void sink_gradients(const HeadsView<const S>& out,                    // (B, Hq, Lq, Dv)
                    const HeadsView<const S>& dout,                   // (B, Hq, Lq, Dv)
                    const RowValues<const compute_scalar_t<S>>& lse,  // (B, Hq, Lq) or (Hq, T)
                    const AttentionProblem<compute_scalar_t<S>>& problem,
                    Eigen::Map<Vector<compute_scalar_t<S>>> dsinks) {  // (Hq)
  using T = compute_scalar_t<S>;
  for (Index h = 0; h < out.heads; ++h) {
    T sum = 0;
    for (Index b = 0; b < out.batch; ++b) {
      const HeadMatrix<const S> o = out.head(b, h), d = dout.head(b, h);
      for (Index i = 0; i < std::min(out.rows(b), problem.mask().query_length(b)); ++i) {
        T delta = 0;
        for (Index e = 0; e < out.dim; ++e)
          delta += static_cast<T>(d(i, e)) * static_cast<T>(o(i, e));
        sum += std::exp(*problem.sink(h) - lse.head(b, h)[i]) * delta;
      }
    }
    dsinks[h] = -sum;
  }
}

}  // namespace attn::detail
