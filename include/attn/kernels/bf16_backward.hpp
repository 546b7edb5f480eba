// attn/kernels/bf16_backward.hpp: the flash backward's key-tile step on bf16 dot products
// (AVX512-BF16), the avx512_bf16 level's BackwardKernels::backward_key_tile_bf16
// (kernels/dispatch.hpp). The loop, the masks, the softmax's recomputation, dropout and softcap
// are kernels/flash_backward.inl's, in float; only its five products change:
//
//   s  = scale * (q k^T)       dp = dout v^T          (float, as the forward's scores)
//   dv += round(p f)^T dout    dk += round(ds)^T q    dq += round(ds) k
//
// with q, k, v and dout rounded to bfloat16 (no-ops for bfloat16 storage, which reaches the
// kernel widened) and p f and ds = scale p (f dp - delta) (softcap's factor included) rounded
// to bfloat16 before the products that read them, FlashAttention-2's rule for 16-bit training;
// every sum is in float. `vdpbf16ps` sums pairs along the product's depth, so each operand is
// kept as 32-bit words of two bfloat16 neighbours along that depth (kernels/bf16_tiles.hpp):
//
//   kt, vt        (D2, W), (Dv2, W)    word (k[j, 2 d2], k[j, 2 d2 + 1]) at [d2, j]
//   k pairs       (W2, D)              word (k[2 j2, d], k[2 j2 + 1, d]) at [j2, d]
//   q, dout words (Bq, D2), (Bq, Dv2)  the rows rounded: word [i, d2] = (q[i, 2 d2], ..)
//   q, dout pairs (Bq2, D), (Bq2, Dv)  word (q[2 i2, d], q[2 i2 + 1, d]) at [i2, d]
//   p, ds pairs   (Bq2, W)             word (p[2 i2, j], p[2 i2 + 1, j]) at [i2, j]
//   ds words      (Bq, W2)             the rows of ds rounded
//
// (odd ends padded with zeros in both operands). Each product is one register-block kernel,
// pair_product: a word of its left operand broadcast, a row of its right operand's words as
// vectors; dv and dk read their left operand (p, ds pairs) transposed.
//
// Extra memory per thread: the float backward's tiles (kernels/flash_backward.hpp) without
// kt, vt and the copied k, q and dout rows, which this kernel does not use, plus in 32-bit
// words with P = 16: (D2 + Dv2)(W + P) + W2 (D + P) for the key tile and Bq (D2 + Dv2 + W2 +
// 3 P) + Bq2 (D + Dv + 2 W + 4 P) for the query tile (Bq2 = ceil(Bq / 2)): 568 KiB at Bq =
// 128, W = 256, D = Dv = 128, independent of L.
#pragma once

#include "attn/kernels/simd/target.hpp"

#if ATTN_X86_DISPATCH

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>

#include "attn/config.hpp"
#include "attn/kernels/backward_tiles.hpp"
#include "attn/kernels/bf16_tiles.hpp"
#include "attn/kernels/simd/avx512.hpp"
#include "attn/kernels/simd/tile_products.hpp"
#include "attn/problem.hpp"
#include "attn/tensor.hpp"

ATTN_BEGIN_TARGET_AVX512_BF16
namespace attn::detail::avx512_bf16 {

/// words[r * words_stride + d2] = (x[r, 2 d2], x[r, 2 d2 + 1]) rounded for r < rows, d2 <
/// ceil(cols / 2), zero past cols: the rows of x rounded to bfloat16 (a sum along them).
inline void round_rows(const float* x, Index x_stride, Index rows, Index cols,  // (rows, cols)
                       std::uint32_t* words, Index words_stride) {
  const Index cols2 = (cols + 1) / 2;
  for (Index r = 0; r < rows; ++r) {
    round_row(x + r * x_stride, cols, cols2,
              reinterpret_cast<std::uint16_t*>(words + r * words_stride));
  }
}

/// pairs[d2 * pairs_stride + r] = (x[r, 2 d2], x[r, 2 d2 + 1]) rounded for r < rows, zero
/// for rows <= r < width: x^T in pairs along its rows (the keys' scores operand, kt).
inline void pair_columns(const float* x, Index x_stride, Index rows, Index cols,  // (rows, cols)
                         Index width, std::uint32_t* row_scratch,     // (ceil(cols / 2))
                         std::uint32_t* pairs, Index pairs_stride) {  // (ceil(cols / 2), width)
  const Index cols2 = (cols + 1) / 2;
  for (Index r = 0; r < rows; ++r) {
    round_rows(x + r * x_stride, x_stride, 1, cols, row_scratch, cols2);
    for (Index d2 = 0; d2 < cols2; ++d2)
      pairs[d2 * pairs_stride + r] = row_scratch[d2];
  }
  for (Index d2 = 0; d2 < cols2; ++d2)
    std::fill(pairs + d2 * pairs_stride + rows, pairs + d2 * pairs_stride + width, 0u);
}

/// c[r, 0:C lanes) = scale * sum_d2 a(r, d2) . b[d2, 0:C lanes) for r < R, or with
/// `accumulate` that sum added to c; a(r, d2) is the word a[r * a_stride + d2], or with
/// `a_transposed` a[d2 * a_stride + r]. `last` limits the last vector's lanes (its loads and
/// stores of c). Each element is summed in the order d2 = 0, 1, ... .
template <std::size_t R, std::size_t C, bool a_transposed, bool accumulate>
void pair_product_block(const std::uint32_t* a, Index a_stride,  // (R, depth2) words
                        const std::uint32_t* b, Index b_stride,  // (depth2, C lanes) words
                        Index depth2, float scale, float* c, Index c_stride,  // (R, C lanes)
                        __mmask16 last) {
  vec acc[R][C];
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t v = 0; v < C; ++v)
      acc[r][v] = _mm512_setzero_ps();
  }
#pragma GCC unroll 2
  for (Index d2 = 0; d2 < depth2; ++d2) {
    __m512bh columns[C];
#pragma GCC unroll 4
    for (std::size_t v = 0; v < C; ++v) {
      columns[v] = reinterpret_cast<__m512bh>(
          _mm512_loadu_si512(b + d2 * b_stride + lanes * static_cast<Index>(v)));
    }
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
      const auto row = static_cast<Index>(r);
      const std::uint32_t word = a_transposed ? a[d2 * a_stride + row] : a[row * a_stride + d2];
      const auto broadcast =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<std::int32_t>(word)));
#pragma GCC unroll 4
      for (std::size_t v = 0; v < C; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], broadcast, columns[v]);
    }
  }
  const vec scales = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t v = 0; v < C; ++v) {
      float* to = c + static_cast<Index>(r) * c_stride + lanes * static_cast<Index>(v);
      const __mmask16 lanes_of = v + 1 == C ? last : static_cast<__mmask16>(0xffff);
      const vec sum = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(lanes_of, to), acc[r][v])
                                 : _mm512_mul_ps(acc[r][v], scales);
      _mm512_mask_storeu_ps(to, lanes_of, sum);
    }
  }
}

/// pair_product_block for `rows` (1 .. R) rows.
template <std::size_t C, bool a_transposed, bool accumulate,
          std::size_t R = static_cast<std::size_t>(avx512::score_rows)>
void pair_product_rows(Index rows, const std::uint32_t* a, Index a_stride, const std::uint32_t* b,
                       Index b_stride, Index depth2, float scale, float* c, Index c_stride,
                       __mmask16 last) {
  if constexpr (R > 0) {
    if (rows == static_cast<Index>(R)) {
      return pair_product_block<R, C, a_transposed, accumulate>(a, a_stride, b, b_stride, depth2,
                                                                scale, c, c_stride, last);
    }
    pair_product_rows<C, a_transposed, accumulate, R - 1>(rows, a, a_stride, b, b_stride, depth2,
                                                          scale, c, c_stride, last);
  }
}

/// c (rows, cols) = scale * a b, or with `accumulate` c += a b: a (rows, depth2) words (read
/// transposed, (depth2, rows), with `a_transposed`), b (depth2, cols) words. Columns outside,
/// so that a (depth2 x 2 vectors) block of b stays in L1 while the row blocks of c use it.
template <bool a_transposed, bool accumulate>
void pair_product(const std::uint32_t* a, Index a_stride, Index rows, const std::uint32_t* b,
                  Index b_stride, Index depth2, Index cols, float scale, float* c, Index c_stride) {
  constexpr Index block_width = avx512::score_vectors * lanes;
  constexpr auto block_vectors = static_cast<std::size_t>(avx512::score_vectors);
  const auto a_rows = [&](Index r) { return a_transposed ? a + r : a + r * a_stride; };
  Index c0 = 0;
  for (; c0 + block_width <= cols; c0 += block_width) {
    for (Index r = 0; r < rows; r += avx512::score_rows) {
      pair_product_rows<block_vectors, a_transposed, accumulate>(
          std::min(avx512::score_rows, rows - r), a_rows(r), a_stride, b + c0, b_stride, depth2,
          scale, c + r * c_stride + c0, c_stride, static_cast<__mmask16>(0xffff));
    }
  }
  for (; c0 < cols; c0 += lanes) {
    const Index n = std::min(lanes, cols - c0);
    const auto last = static_cast<__mmask16>((1u << n) - 1u);
    for (Index r = 0; r < rows; r += avx512::score_rows) {
      pair_product_rows<1, a_transposed, accumulate>(std::min(avx512::score_rows, rows - r),
                                                     a_rows(r), a_stride, b + c0, b_stride, depth2,
                                                     scale, c + r * c_stride + c0, c_stride, last);
    }
  }
}

/// backward_key_tile (kernels/flash_backward.inl) with its five products on bf16 dot
/// products, for float compute; the same arguments.
template <class T>
void backward_key_tile_bf16(const HeadMatrix<const T>& k,  // (Lk, D)   the whole kv head
                            const HeadMatrix<const T>& v,  // (Lk, Dv)
                            HeadMatrix<T> dk,              // (Lk, D)   rows j0.. written
                            HeadMatrix<T> dv,              // (Lk, Dv)
                            const BackwardHead<T>* heads, Index group,
                            const AttentionProblem<T>& problem, const std::optional<T>& softcap,
                            Index b, Index kv_head, T scale, Index j0, Index keys, Index query_tile,
                            BackwardWorkspace<T>& workspace) {
  static_assert(std::is_same_v<T, float>, "bf16 products compute in float");
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const Index j1 = j0 + keys, width = avx512::padded(keys), stride = workspace.stride;
  const Index dim = k.cols(), value_dim = v.cols();
  const Index dim2 = (dim + 1) / 2, value_dim2 = (value_dim + 1) / 2, keys2 = (keys + 1) / 2;
  ATTN_ASSERT(keys > 0 && width <= workspace.width && query_tile <= workspace.rows);
  Bf16BackwardWorkspace& w = workspace.bf16;
  float* s = workspace.s.data();
  float* dp = workspace.dp.data();
  float* shift = workspace.shift.data();
  T* dk_tile = avx512::row_of(dk, j0);
  T* dv_tile = avx512::row_of(dv, j0);
  // the key tile: kt, vt and the k pairs
  pair_columns(avx512::row_of(k, j0), k.outerStride(), keys, dim, width, w.row.data(), w.kt.data(),
               stride);
  pair_columns(avx512::row_of(v, j0), v.outerStride(), keys, value_dim, width, w.row.data(),
               w.vt.data(), stride);
  pair_rows(avx512::row_of(k, j0), k.outerStride(), keys, dim, w.k_pairs.data(), w.k_pairs_stride);
  dk.middleRows(j0, keys).setZero();
  dv.middleRows(j0, keys).setZero();
  for (Index g = 0; g < group; ++g) {
    const Index h = kv_head * group + g;
    const BackwardHead<T> head = heads[g];  // the maps, by value
    const Index rows_of_head = head.q.rows();
    for (Index i0 = 0; i0 < rows_of_head; i0 += query_tile) {
      const Index rows = std::min(query_tile, rows_of_head - i0), i1 = i0 + rows;
      const Index rows2 = (rows + 1) / 2;
      const TileVisibility visibility = problem.mask().classify(b, h, i0, i1, j0, j1);
      if (visibility == TileVisibility::hidden)
        continue;
      const float* q_rows = avx512::row_of(head.q, i0);
      const float* dout_rows = avx512::row_of(head.dout, i0);
      round_rows(q_rows, head.q.outerStride(), rows, dim, w.q_words.data(), w.q_words_stride);
      round_rows(dout_rows, head.dout.outerStride(), rows, value_dim, w.dout_words.data(),
                 w.dout_words_stride);
      pair_rows(q_rows, head.q.outerStride(), rows, dim, w.q_pairs.data(), w.q_pairs_stride);
      pair_rows(dout_rows, head.dout.outerStride(), rows, value_dim, w.dout_pairs.data(),
                w.dout_pairs_stride);
      pair_product<false, false>(w.q_words.data(), w.q_words_stride, rows, w.kt.data(), stride,
                                 dim2, width, scale, s, stride);
      if (softcap) {  // the raw scores, for the derivative of tanh
        for (Index r = 0; r < rows; ++r)
          std::copy_n(s + r * stride, width, workspace.raw.data() + r * stride);
      }
      avx512::mask_backward_scores(problem, visibility, b, h, i0, rows, j0, keys, width, s, stride);
      for (Index r = 0; r < rows; ++r) {
        const T lse = head.lse[i0 + r];
        shift[r] = lse == minus_inf ? T(0) : lse;
      }
      avx512::exp_rows(s, stride, rows, width, shift, workspace.sums.data());  // p
      const Dropout<T>& dropout = problem.dropout();
      if (dropout.active()) {  // f: the forward's dropout factors, regenerated; dv takes p f
        for (Index r = 0; r < rows; ++r) {
          avx512::dropout_row(dropout, dropout.row_key(b, h, i0 + r), j0, keys, width,
                              s + r * stride, workspace.drop.data() + r * stride, dp + r * stride);
        }
      }
      pair_rows(dropout.active() ? dp : s, stride, rows, width, w.p_pairs.data(), stride);
      // a_transposed: the keys are the rows of the product and the query pairs its depth
      // NOLINTNEXTLINE(readability-suspicious-call-argument)
      pair_product<true, true>(w.p_pairs.data(), stride, keys, w.dout_pairs.data(),
                               w.dout_pairs_stride, rows2, value_dim, 1.0f, dv_tile,
                               dv.outerStride());
      if (value_dim > 0) {
        pair_product<false, false>(w.dout_words.data(), w.dout_words_stride, rows, w.vt.data(),
                                   stride, value_dim2, width, 1.0f, dp, stride);
      } else {  // Dv = 0: dp is 0
        std::fill_n(dp, rows * stride, T(0));
      }
      for (Index r = 0; r < rows; ++r) {  // ds = scale p (f dp - delta)
        avx512::score_gradient_row(s + r * stride,
                                   dropout.active() ? workspace.drop.data() + r * stride : nullptr,
                                   head.delta[i0 + r], scale, width, dp + r * stride);
      }
      if (softcap) {
        for (Index r = 0; r < rows; ++r) {
          avx512::softcap_derivative(workspace.raw.data() + r * stride, width, *softcap,
                                     dp + r * stride);
        }
      }
      pair_rows(dp, stride, rows, width, w.ds_pairs.data(), stride);
      round_rows(dp, stride, rows, keys, w.ds_words.data(), w.ds_words_stride);
      // a_transposed: the keys are the rows of the product and the query pairs its depth
      // NOLINTNEXTLINE(readability-suspicious-call-argument)
      pair_product<true, true>(w.ds_pairs.data(), stride, keys, w.q_pairs.data(), w.q_pairs_stride,
                               rows2, dim, 1.0f, dk_tile, dk.outerStride());
      pair_product<false, true>(w.ds_words.data(), w.ds_words_stride, rows, w.k_pairs.data(),
                                w.k_pairs_stride, keys2, dim, 1.0f, avx512::row_of(head.dq, i0),
                                head.dq.outerStride());
    }
  }
}

}  // namespace attn::detail::avx512_bf16
ATTN_END_TARGET

#endif  // ATTN_X86_DISPATCH
