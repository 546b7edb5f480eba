// attn/kernels/flash_backward.hpp: the gradients of attention tile by tile (FlashAttention-2's
// backward): the probabilities are recomputed from the saved log-sum-exp, never stored.
//
//   q, dq      (B, Hq, Lq, D)     work items: (b, kv head); an item owns the dk and dv of
//   k, dk      (B, Hkv, Lk, D)    its kv head and the dq of the G = Hq / Hkv query heads
//   v, dv      (B, Hkv, Lk, Dv)   that read it, so no two threads write one element and
//   out, dout  (B, Hq, Lq, Dv)    every sum runs in one fixed order: the result is bitwise
//   lse        (B, Hq, Lq)        the same for any thread count (no atomics)
//
// Inside an item, FlashAttention-2's order: for each key tile (Bk keys), for each query head
// of the group and each query tile (Bq rows) the mask does not hide on it, the tile step of
// kernels/flash_backward.inl. dk and dv of a key tile are summed in place in its rows over
// the query tiles, dq in the output over the key tiles (FlashAttention-2 parallelises over key
// tiles and sums dq with atomics; here one item owns a whole kv head and its query heads instead,
// so the order is fixed).
//
// The tiles' rows are copied into (or packed as) rows 16 elements longer than they need (k,
// q and dout tiles, and kt, vt, s, dp): the heads' own row strides are usually a power of two
// (D = 128: 512 bytes), and the rows one register block reads then share a few L1 sets.
//
// Extra memory per thread (the one statement of it; docs/kernels.md links here), with P = 16
// and W = Bk rounded up to whole vectors (kernels/backward_tiles.hpp): (W + P)(D + Dv) +
// 2 Bq (W + P) + 2 Bq scalars for the tiles (kt, vt, s, dp, two row vectors), Bq (W + P) more
// with softcap and again with dropout, W (D + P) + Bq (D + Dv + 2 P) for the copies of the
// k, q and dout rows, and G * Lq for the rows' deltas, independent of Lk and only G * Lq
// scalars in Lq: 360 KiB of float tiles and rows at Bq = 64, Bk = 128, D = Dv = 128 (396
// KiB with softcap; a key tile of 128 halves the passes over q, dout and dq that a tile of 64
// makes: at L = 4096 they no longer fit in L2), 833 KiB at AVX-512's 128 x 256 for D >= 128
// (505 KiB at its causal 128 x 128; default_backward_tiles in attn/plan.hpp). With
// 16-bit storage add one widened head of each of q, out and dout (Lq, D + 2 Dv) per query
// head of the group, of k and v (Lk, D + Dv), and float accumulators for dq (G Lq, D) and
// dk, dv (Lk, D + Dv).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/backward_tiles.hpp"
#include "attn/kernels/backward_views.hpp"
#include "attn/kernels/dispatch.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/kernels/widening.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// delta[i] = dout_i . out_i for the rows of one head (FlashAttention-2's D_i): the row sums
/// of p * dp, since sum_j p_ij (dout_i . v_j) = dout_i . out_i.
template <class T>
void row_deltas(const HeadMatrix<const T>& dout,  // (rows, Dv)
                const HeadMatrix<const T>& out,   // (rows, Dv)
                T* delta) {                       // (rows)
  for (Index r = 0; r < dout.rows(); ++r)
    delta[r] = dout.row(r).dot(out.row(r));
}

/// row_deltas with dout read as bf16 products read it, rounded to bfloat16 (a no-op for
/// bfloat16 storage), so that delta_i = sum_j p_ij dp_ij holds for the dp they compute: float
/// dout under ComputePrecision::bf16 then gives the bits of its bfloat16 rounding. (Eigen's
/// rounding keeps subnormal floats, which the products read as zero: a difference below
/// 1.2e-38 in one term.)
template <class T>
void row_deltas_of_bf16(const HeadMatrix<const T>& dout,  // (rows, Dv)
                        const HeadMatrix<const T>& out,   // (rows, Dv)
                        T* delta) {                       // (rows)
  const auto rounded = [](T x) {
    return static_cast<T>(static_cast<float>(Eigen::bfloat16(static_cast<float>(x))));
  };
  for (Index r = 0; r < dout.rows(); ++r)
    delta[r] = dout.row(r).unaryExpr(rounded).dot(out.row(r));
}

/// The flash backward over all (b, kv head) items of `plan`: dq, dk and dv written (every
/// element: rows no query sees get zeros). The inputs are in the compute scalar T or
/// 16-bit S (widened per head); the gradients are stored as S.
template <class S>
void run_flash_backward(const KernelPlan& plan, const BackwardViews<S>& x,
                        const AttentionProblem<compute_scalar_t<S>>& problem,
                        const std::optional<compute_scalar_t<S>>& softcap,
                        compute_scalar_t<S> scale) {
  using T = compute_scalar_t<S>;
  const Index group = x.group(), q_length = x.q.length;
  const Index query_tile = std::max<Index>(1, std::min(plan.query_tile, q_length));
  const Index key_tile = plan.key_tile;
  struct Scratch {
    BackwardWorkspace<T> workspace;
    Matrix<T> delta;  // (G, Lq): delta of the group's query heads
    // 16-bit storage: the item's heads widened, and float accumulators for the gradients
    std::vector<WidenedHead<T, S>> q_heads, dout_heads;  // G of each
    std::vector<NarrowedRows<T, S>> dq_heads;            // G
    WidenedHead<T, S> out_head, k_head, v_head;
    NarrowedRows<T, S> dk_head, dv_head;
  };
  const BackwardKernels<T>& kernels = backward_kernels<T>(plan.isa);
  const auto key_tile_step =
      plan.bf16_products ? kernels.backward_key_tile_bf16 : kernels.backward_key_tile;
  ATTN_ASSERT(key_tile_step != nullptr);
  const auto make_scratch = [&] {
    Scratch s;
    s.workspace.reserve(kernels.padded(std::max<Index>(1, std::min(key_tile, x.k.length))),
                        query_tile, x.q.dim, x.v.dim, softcap.has_value(),
                        problem.dropout().active(), plan.bf16_products);
    s.delta.resize(group, q_length);
    s.q_heads.resize(static_cast<std::size_t>(group));
    s.dout_heads.resize(static_cast<std::size_t>(group));
    s.dq_heads.resize(static_cast<std::size_t>(group));
    return s;
  };
  for_each_item(plan.work_items, plan.parallel, make_scratch, [&](Index i, Scratch& s) {
    const auto [b, kv_head] = x.item(i);
    const Index keys = x.k.rows(b);
    const HeadMatrix<const T> k_head = s.k_head(plan.isa, x.k, b, kv_head);
    const HeadMatrix<const T> v_head = s.v_head(plan.isa, x.v, b, kv_head);
    HeadMatrix<T> dk_head = s.dk_head.rows(x.dk.head(b, kv_head), 0, keys);
    HeadMatrix<T> dv_head = s.dv_head.rows(x.dv.head(b, kv_head), 0, keys);
    std::vector<BackwardHead<T>> heads;
    heads.reserve(static_cast<std::size_t>(group));
    for (Index g = 0; g < group; ++g) {
      const Index h = kv_head * group + g;
      const auto at = static_cast<std::size_t>(g);
      const HeadMatrix<const T> dout_head = s.dout_heads[at](plan.isa, x.dout, b, h);
      const HeadMatrix<const T> out_head = s.out_head(plan.isa, x.out, b, h);
      if (plan.bf16_products)
        row_deltas_of_bf16<T>(dout_head, out_head, s.delta.row(g).data());
      else
        row_deltas<T>(dout_head, out_head, s.delta.row(g).data());
      HeadMatrix<T> dq_head = s.dq_heads[at].rows(x.dq.head(b, h), 0, x.q.rows(b));
      dq_head.setZero();
      heads.push_back({s.q_heads[at](plan.isa, x.q, b, h), dout_head, x.lse_of(b, h),
                       s.delta.row(g).data(), dq_head});
    }
    // Padding keys (j >= n_k(b)) are never visible: zeros, and no tile reaches them, so
    // that a NaN row cannot reach them through 0 * NaN (naive does not score them either).
    const Index real_keys = std::min(keys, problem.mask().key_length(b));
    for (Index j0 = 0; j0 < real_keys; j0 += key_tile) {
      key_tile_step(k_head, v_head, dk_head, dv_head, heads.data(), group, problem, softcap, b,
                    kv_head, scale, j0, std::min(key_tile, real_keys - j0), query_tile,
                    s.workspace);
    }
    dk_head.bottomRows(keys - real_keys).setZero();
    dv_head.bottomRows(keys - real_keys).setZero();
    for (Index g = 0; g < group; ++g) {
      s.dq_heads[static_cast<std::size_t>(g)].store(x.dq.head(b, kv_head * group + g), 0,
                                                    x.q.rows(b));
    }
    s.dk_head.store(x.dk.head(b, kv_head), 0, keys);
    s.dv_head.store(x.dv.head(b, kv_head), 0, keys);
  });
}

}  // namespace attn::detail
