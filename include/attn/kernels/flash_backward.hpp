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
// Extra memory per thread, with P = 16: (W + P)(D + Dv) + 3 Bq (W + P) + 2 Bq scalars for
// the tiles (2 Bq (W + P) without softcap, one more with dropout; W = Bk rounded up to whole
// vectors), W (D + P) + Bq (D + Dv + 2 P) for the copies of the k, q and dout rows, and
// G * Lq for the rows' deltas, independent of Lk and only G * Lq scalars in Lq: 396 KiB at
// the default Bq = 64, Bk = 128, D = Dv = 128 (a key tile of 128 halves the passes over q,
// dout and dq that a tile of 64 makes: at L = 4096 they no longer fit in L2). With
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
#include "attn/kernels/backward_views.hpp"
#include "attn/kernels/gemm.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/kernels/online_softmax.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/mask.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Every row of a backward tile is this many elements longer than its width: with rows of
/// a power-of-two length (128 keys, D = 128: 512 bytes) the 64 to 128 rows a product reads
/// for one register block fall into a few L1 sets and evict each other.
inline constexpr Index backward_row_padding = 16;

/// The per-thread scratch of the flash backward: key tiles of up to `width` (padded) keys,
/// query tiles of up to `rows` rows; all rows `backward_row_padding` longer than they need.
template <class T>
struct BackwardWorkspace {
  Index width = 0, rows = 0, stride = 0;  // stride: of kt, vt, s, dp, raw and drop
  Scratch<T> kt, vt;                      // (D, W), (Dv, W)
  Scratch<T> s, dp, raw, drop;            // (Bq, W) each; raw with softcap, drop with dropout
  Scratch<T> shift, sums;                 // (Bq), (Bq)
  Scratch<T> k, q, dout;                  // (W, D), (Bq, D), (Bq, Dv): copies of the tiles' rows

  void reserve(Index w, Index bq, Index dim, Index value_dim, bool softcap, bool dropout) {
    width = w;
    rows = bq;
    stride = w + backward_row_padding;
    kt.resize(dim, stride);
    vt.resize(value_dim, stride);
    s.resize(bq, stride);
    dp.resize(bq, stride);
    if (softcap)
      raw.resize(bq, stride);
    if (dropout)
      drop.resize(bq, stride);
    shift.resize(bq);
    sums.resize(bq);
    k.resize(w, dim + backward_row_padding);
    q.resize(bq, dim + backward_row_padding);
    dout.resize(bq, value_dim + backward_row_padding);
  }
};

/// dst[r, 0:cols) = src[r, 0:cols) for r < rows (row strides in elements).
template <class T>
void copy_rows(const T* src, Index src_stride, Index rows, Index cols, T* dst, Index dst_stride) {
  if (cols == 0)
    return;  // src may be null
  for (Index r = 0; r < rows; ++r)
    std::copy_n(src + r * src_stride, cols, dst + r * dst_stride);
}

/// What the backward reads and writes for one query head: q, dout and dq rows, the saved
/// log-sum-exp and delta_i = dout_i . out_i.
template <class T>
struct BackwardHead {
  HeadMatrix<const T> q;     // (Lq, D)
  HeadMatrix<const T> dout;  // (Lq, Dv)
  const T* lse;              // (Lq)
  const T* delta;            // (Lq)
  HeadMatrix<T> dq;          // (Lq, D), accumulated
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
void run_flash_backward(const KernelPlan& plan, const BackwardViews<S>& x,
                        const Mask<compute_scalar_t<S>>& mask,
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
  with_backward_kernels<T>(plan.isa, [&](auto kernels) {
    using K = decltype(kernels);
    const auto make_scratch = [&] {
      Scratch s;
      s.workspace.reserve(K::padded_width(std::max<Index>(1, std::min(key_tile, x.k.length))),
                          query_tile, x.q.dim, x.v.dim, softcap.has_value(),
                          mask.dropout().active());
      s.delta.resize(group, q_length);
      s.q_heads.resize(static_cast<std::size_t>(group));
      s.dout_heads.resize(static_cast<std::size_t>(group));
      s.dq_heads.resize(static_cast<std::size_t>(group));
      return s;
    };
    for_each_item(plan.work_items, plan.parallel, make_scratch, [&](Index i, Scratch& s) {
      const auto [b, kv_head] = x.item(i);
      const Index keys = x.k.rows(b);
      const HeadMatrix<const T> k_head = s.k_head(x.k, b, kv_head);
      const HeadMatrix<const T> v_head = s.v_head(x.v, b, kv_head);
      HeadMatrix<T> dk_head = s.dk_head.rows(x.dk.head(b, kv_head), 0, keys);
      HeadMatrix<T> dv_head = s.dv_head.rows(x.dv.head(b, kv_head), 0, keys);
      std::vector<BackwardHead<T>> heads;
      heads.reserve(static_cast<std::size_t>(group));
      for (Index g = 0; g < group; ++g) {
        const Index h = kv_head * group + g;
        const auto at = static_cast<std::size_t>(g);
        const HeadMatrix<const T> dout_head = s.dout_heads[at](x.dout, b, h);
        row_deltas<T>(dout_head, s.out_head(x.out, b, h), s.delta.row(g).data());
        HeadMatrix<T> dq_head = s.dq_heads[at].rows(x.dq.head(b, h), 0, x.q.rows(b));
        dq_head.setZero();
        heads.push_back(
            {s.q_heads[at](x.q, b, h), dout_head, x.lse_of(b, h), s.delta.row(g).data(), dq_head});
      }
      const auto head_of = [&heads](Index g) -> const BackwardHead<T>& {
        return heads[static_cast<std::size_t>(g)];
      };
      // Padding keys (j >= n_k(b)) are never visible: zeros, and no tile reaches them, so
      // that a NaN row cannot reach them through 0 * NaN (naive does not score them either).
      const Index real_keys = std::min(keys, mask.key_length(b));
      for (Index j0 = 0; j0 < real_keys; j0 += key_tile) {
        K::template backward_key_tile<T>(
            k_head, v_head, dk_head, dv_head, head_of, group, mask, softcap, b, kv_head, scale, j0,
            std::min(key_tile, real_keys - j0), query_tile, s.workspace);
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
  });
}

}  // namespace attn::detail
