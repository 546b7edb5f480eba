// attn/kernels/flash_backward.hpp: the gradients of attention tile by tile (FlashAttention-2's
// backward): the probabilities are recomputed from the saved log-sum-exp, never stored.
//
//   q, dq      (B, Hq, Lq, D)     work items: (b, kv head); an item owns the dk and dv of
//   k, dk      (B, Hkv, Lk, D)    its kv head and the dq of the G = Hq / Hkv query heads
//   v, dv      (B, Hkv, Lk, Dv)   that read it, so no two threads write one element and
//   out, dout  (B, Hq, Lq, Dv)    every sum runs in one fixed order: the result is bitwise
//   lse        (B, Hq, Lq)        the same for any thread count (no atomics)
//
// Inside an item: for each query head of the group, for each query tile (Bq rows), for each
// key tile (Bk keys) the mask does not hide, the tile loop of kernels/flash_backward.inl.
// Query tiles are the outer loop, as in the forward, so that the mask and the tile products
// are the forward's own: dq of a tile is summed in scratch (D, W) over the key tiles, dk and dv in
// the output over the query tiles (FlashAttention-2 keeps dk, dv local and sums dq with atomics;
// here one item owns a whole kv head instead).
//
// Extra memory per thread: W * (2 D + Dv + 3 Bk + 7) scalars (Bk W fewer without softcap's
// raw scores), independent of Lq and Lk (W = Bq rounded up to whole
// vectors); with 16-bit storage add one widened head of each of q, out and dout (Lq, D + 2 Dv),
// of k and v (Lk, D + Dv), and float accumulators for dk, dv (Lk, D + Dv) and dq (Lq, D).
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
#include "attn/kernels/gemm.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/kernels/online_softmax.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/mask.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// The per-thread scratch of the flash backward: W query columns, Bk keys.
template <class T>
struct BackwardWorkspace {
  Index width = 0, keys = 0;
  Scratch<T> qt, dot, st, dpt, raw, dqt;          // (D, W), (Dv, W), (Bk, W) x 3, (D, W)
  Scratch<T> shift, delta, ones, tile_max, sums;  // (W) each
  std::vector<std::int32_t> key_lo, key_hi;       // (W) each

  void reserve(Index w, Index bk, Index dim, Index value_dim, bool softcap) {
    width = w;
    keys = bk;
    qt.resize(dim, w);
    dot.resize(value_dim, w);
    st.resize(bk, w);
    dpt.resize(bk, w);
    if (softcap)
      raw.resize(bk, w);
    dqt.resize(dim, w);
    for (Scratch<T>* x : {&shift, &delta, &ones, &tile_max, &sums})
      x->resize(w);
    key_lo.resize(static_cast<std::size_t>(w));
    key_hi.resize(static_cast<std::size_t>(w));
  }
};

}  // namespace attn::detail

namespace attn::detail::generic {
#include "attn/kernels/flash_backward.inl"
}  // namespace attn::detail::generic

#if ATTN_X86_DISPATCH
ATTN_BEGIN_TARGET_AVX2
namespace attn::detail::avx2 {
#include "attn/kernels/flash_backward.inl"  // NOLINT(readability-duplicate-include): per ISA
}  // namespace attn::detail::avx2
ATTN_END_TARGET

ATTN_BEGIN_TARGET_AVX512
namespace attn::detail::avx512 {
#include "attn/kernels/flash_backward.inl"  // NOLINT(readability-duplicate-include): per ISA
}  // namespace attn::detail::avx512
ATTN_END_TARGET
#endif

namespace attn::detail {

/// f(BackwardKernels{}) of `isa` (the generic ones for any scalar but float).
template <class T, class F>
decltype(auto) with_backward_kernels(Isa isa, F&& f) {
#if ATTN_X86_DISPATCH
  if constexpr (std::is_same_v<T, float>) {
    if (isa == Isa::avx512)
      return f(avx512::BackwardKernels{});
    if (isa == Isa::avx2)
      return f(avx2::BackwardKernels{});
  }
#endif
  (void)isa;
  return f(generic::BackwardKernels{});
}

/// delta[i] = dout_i . out_i for the rows of one head (FlashAttention-2's D_i): the row sums
/// of p * dp, since sum_j p_ij (dout_i . v_j) = dout_i . out_i.
template <class T>
void row_deltas(const HeadMatrix<const T>& dout,  // (rows, Dv)
                const HeadMatrix<const T>& out,   // (rows, Dv)
                T* delta) {                       // (rows)
  for (Index r = 0; r < dout.rows(); ++r)
    delta[r] = dout.row(r).dot(out.row(r));
}

/// The flash backward over all (b, kv head) items of `plan`: dq, dk and dv written (every
/// element: rows no query sees get zeros). The inputs are in the compute scalar T or
/// 16-bit S (widened per head); the gradients are stored as S.
template <class S>
void run_flash_backward(const KernelPlan& plan,
                        const HeadsView<const S>& q,     // (B, Hq, Lq, D)
                        const HeadsView<const S>& k,     // (B, Hkv, Lk, D)
                        const HeadsView<const S>& v,     // (B, Hkv, Lk, Dv)
                        const HeadsView<const S>& out,   // (B, Hq, Lq, Dv)
                        const HeadsView<const S>& dout,  // (B, Hq, Lq, Dv)
                        const compute_scalar_t<S>* lse,  // (B, Hq, Lq)
                        const HeadsView<S>& dq,          // (B, Hq, Lq, D)
                        const HeadsView<S>& dk,          // (B, Hkv, Lk, D)
                        const HeadsView<S>& dv,          // (B, Hkv, Lk, Dv)
                        const Mask<compute_scalar_t<S>>& mask,
                        const std::optional<compute_scalar_t<S>>& softcap,
                        compute_scalar_t<S> scale) {
  using T = compute_scalar_t<S>;
  constexpr bool widened = !std::is_same_v<S, T>;
  const Index group = q.heads / k.heads, q_length = q.length;
  const Index query_tile = plan.query_tile;
  const Index key_tile = std::max<Index>(1, std::min(plan.key_tile, k.length));
  struct Scratch {
    BackwardWorkspace<T> workspace;
    Vector<T> delta;  // (Lq) of one query head
    WidenedHead<T, S> q_head, k_head, v_head, out_head, dout_head;
    Matrix<T> dq_rows, dk_rows, dv_rows;  // float accumulators for 16-bit gradients
  };
  with_backward_kernels<T>(plan.isa, [&](auto kernels) {
    using K = decltype(kernels);
    const auto make_scratch = [&] {
      Scratch s;
      s.workspace.reserve(K::padded_width(std::max<Index>(1, std::min(query_tile, q_length))),
                          key_tile, q.dim, v.dim, softcap.has_value());
      s.delta.resize(q_length);
      return s;
    };
    for_each_item(plan.work_items, plan.parallel, make_scratch, [&](Index item, Scratch& s) {
      const Index b = item / k.heads, kv_head = item % k.heads;
      const Index rows = q.rows(b), keys = k.rows(b);
      const HeadMatrix<const T> k_head = s.k_head(k, b, kv_head);
      const HeadMatrix<const T> v_head = s.v_head(v, b, kv_head);
      const auto accumulator = [&](const HeadsView<S>& g, Index h, Matrix<T>& buffer,
                                   Index n) -> HeadMatrix<T> {
        if constexpr (widened) {
          buffer.setZero(n, g.dim);
          return HeadMatrix<T>(buffer.data(), n, g.dim, Eigen::OuterStride<>(g.dim));
        } else {
          (void)buffer;
          (void)n;
          HeadMatrix<T> m = g.head(b, h);
          m.setZero();
          return m;
        }
      };
      HeadMatrix<T> dk_head = accumulator(dk, kv_head, s.dk_rows, keys);
      HeadMatrix<T> dv_head = accumulator(dv, kv_head, s.dv_rows, keys);
      for (Index g = 0; g < group; ++g) {
        const Index h = kv_head * group + g;
        const HeadMatrix<const T> q_head = s.q_head(q, b, h);
        const HeadMatrix<const T> dout_head = s.dout_head(dout, b, h);
        row_deltas<T>(dout_head, s.out_head(out, b, h), s.delta.data());
        HeadMatrix<T> dq_head = accumulator(dq, h, s.dq_rows, rows);
        const T* lse_head = lse + (b * q.heads + h) * q_length;
        for (Index i0 = 0; i0 < rows; i0 += query_tile) {
          const Index n = std::min(query_tile, rows - i0);
          K::template backward_tile<T>(middle_rows(q_head, i0, n), middle_rows(dout_head, i0, n),
                                       lse_head + i0, s.delta.data() + i0, k_head, v_head,
                                       middle_rows(dq_head, i0, n), dk_head, dv_head, mask, softcap,
                                       b, h, scale, i0, key_tile, s.workspace);
        }
        if constexpr (widened)
          dq.head(b, h) = dq_head.template cast<S>();
      }
      if constexpr (widened) {
        dk.head(b, kv_head) = dk_head.template cast<S>();
        dv.head(b, kv_head) = dv_head.template cast<S>();
      }
    });
  });
}

}  // namespace attn::detail
