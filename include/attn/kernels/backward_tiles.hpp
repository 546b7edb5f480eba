// attn/kernels/backward_tiles.hpp: the tile step of the flash backward for every instruction
// set (kernels/flash_backward.inl, compiled once per set by simd/foreach_isa.hpp), with the
// workspace and the per-head inputs it works on. kernels/flash_backward.hpp drives it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/kernels/generic.hpp"
#include "attn/kernels/online_softmax.hpp"
#include "attn/kernels/simd/tile_products.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/problem.hpp"
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

#define ATTN_ISA_SOURCE "attn/kernels/flash_backward.inl"
#include "attn/kernels/simd/foreach_isa.hpp"
