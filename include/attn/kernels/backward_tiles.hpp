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

/// The bf16 backward's operands (kernels/bf16_backward.hpp), in 32-bit words of two bfloat16
/// neighbours along each product's depth; rows backward_row_padding words longer than they
/// need, as the float tiles'.
struct Bf16BackwardWorkspace {
  Index k_pairs_stride = 0, q_words_stride = 0, dout_words_stride = 0, ds_words_stride = 0,
        q_pairs_stride = 0, dout_pairs_stride = 0;
  // (D2, S), (Dv2, S), (W2, D), (max(D2, Dv2)); S = W + padding
  Scratch<std::uint32_t> kt, vt, k_pairs, row;
  // (Bq, D2), (Bq, Dv2), (Bq, W2)
  Scratch<std::uint32_t> q_words, dout_words, ds_words;
  // (Bq2, D), (Bq2, Dv), (Bq2, S), (Bq2, S)
  Scratch<std::uint32_t> q_pairs, dout_pairs, p_pairs, ds_pairs;

  void reserve(Index w, Index stride, Index bq, Index dim, Index value_dim) {
    const Index dim2 = (dim + 1) / 2, value_dim2 = (value_dim + 1) / 2, w2 = (w + 1) / 2;
    const Index bq2 = (bq + 1) / 2, padding = backward_row_padding;
    k_pairs_stride = dim + padding;
    q_words_stride = dim2 + padding;
    dout_words_stride = value_dim2 + padding;
    ds_words_stride = w2 + padding;
    q_pairs_stride = dim + padding;
    dout_pairs_stride = value_dim + padding;
    kt.resize(dim2, stride);
    vt.resize(value_dim2, stride);
    k_pairs.resize(w2, k_pairs_stride);
    row.resize(std::max(dim2, value_dim2));
    q_words.resize(bq, q_words_stride);
    dout_words.resize(bq, dout_words_stride);
    ds_words.resize(bq, ds_words_stride);
    q_pairs.resize(bq2, q_pairs_stride);
    dout_pairs.resize(bq2, dout_pairs_stride);
    p_pairs.resize(bq2, stride);
    ds_pairs.resize(bq2, stride);
  }
};

/// The per-thread scratch of the flash backward: key tiles of up to `width` (padded) keys,
/// query tiles of up to `rows` rows; all rows `backward_row_padding` longer than they need.
template <class T>
struct BackwardWorkspace {
  Index width = 0, rows = 0, stride = 0;  // stride: of kt, vt, s, dp, raw and drop
  Scratch<T> kt, vt;                      // (D, W), (Dv, W)
  Scratch<T> s, dp, raw, drop;            // (Bq, W) each; raw with softcap, drop with dropout
  Scratch<T> shift, sums;                 // (Bq), (Bq)
  Scratch<T> k, q, dout;                  // (W, D), (Bq, D), (Bq, Dv): copies of the tiles' rows
  Bf16BackwardWorkspace bf16;             // with bf16 products, instead of kt, vt, k, q, dout

  void reserve(Index w, Index bq, Index dim, Index value_dim, bool softcap, bool dropout,
               bool bf16_products = false) {
    width = w;
    rows = bq;
    stride = w + backward_row_padding;
    s.resize(bq, stride);
    dp.resize(bq, stride);
    if (softcap)
      raw.resize(bq, stride);
    if (dropout)
      drop.resize(bq, stride);
    shift.resize(bq);
    sums.resize(bq);
    if (bf16_products) {
      bf16.reserve(w, stride, bq, dim, value_dim);
      return;
    }
    kt.resize(dim, stride);
    vt.resize(value_dim, stride);
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
