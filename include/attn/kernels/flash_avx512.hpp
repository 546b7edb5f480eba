// attn/kernels/flash_avx512.hpp: the flash kernel for float with AVX-512 micro-kernels.
//
// Same algorithm and results (within rounding) as kernels/flash.hpp, with hand-written
// register-blocked products instead of Eigen's GEMM, whose packing and blocking do not pay
// off at the depth of one head (D = 64): this kernel runs at 68-72% of the FMA peak, 1.05x
// (L = 512) to 2.2x (L = 4096) Eigen's GEMM rate at the same shapes (README, Performance).
//
//   qt       (D, Bq')    scale * q tile^T, Bq' = Bq rounded up to 16 (padding columns 0)
//   st       (Bk, Bq')   scores^T, then probabilities^T, of one key tile
//   ot       (Dv, Bq')   unnormalised output^T, rescaled in place
//   m, l     (Bq')       running max and running sum of each query
//   k tile   (Bk, D)     read in place through the strided head view, not transposed,
//                        not packed: each k[j, d] is broadcast from memory
//   v tile   (Bk, Dv)    read in place, the same way: each v[j, e] is broadcast
//
// Why everything is transposed (queries along the vector lanes): st = k qt and
// ot += v^T st are then products whose vector operand is a row of qt or st (16 queries) and
// whose scalar operand is one element of a k or v row, so neither k nor v is packed or
// transposed; the online softmax reduces over keys, i.e. down the columns of st, an
// elementwise max/add of 16-query vectors; and the rescale of ot by alpha is a product of
// 16-query vectors. Only the last step, out = ot^T / l, transposes, once per query tile.
//
// Extra memory per thread: Bq' * (D + Bk + Dv + 4) floats, plus Bk * (D + Dv) when k and v are
// stored in 16 bits; independent of Lq and Lk.
// Compiled only when the translation unit targets AVX-512F (e.g. -march=native on a CPU
// that has it) and ATTN_NO_AVX512 is not defined; otherwise attention.hpp uses
// kernels/flash.hpp for float too.
#pragma once

#if defined(__AVX512F__) && !defined(ATTN_NO_AVX512)
#define ATTN_HAS_AVX512_FLASH 1

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/mask.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn::detail::avx512 {

inline constexpr Index lanes = 16;  // floats per __m512

/// Scratch of one thread, sized once per call; rows are padded to whole vectors.
struct FlashWorkspace {
  Matrix<float> qt;                          // (D, Bq')
  Matrix<float> st;                          // (Bk, Bq')
  Matrix<float> ot;                          // (Dv, Bq')
  Vector<float> m;                           // (Bq')
  Vector<float> l;                           // (Bq')
  Vector<float> alpha;                       // (Bq')
  Vector<float> tile_max;                    // (Bq')
  std::vector<std::int32_t> key_lo, key_hi;  // (Bq') visible keys of each query in a tile
  Matrix<float> k;                           // (Bk, D)  widened key tile (16-bit storage)
  Matrix<float> v;                           // (Bk, Dv) widened value tile (16-bit storage)

  static Index padded(Index n) { return (n + lanes - 1) / lanes * lanes; }

  void reserve(Index query_tile, Index key_tile, Index dim, Index value_dim,
               bool widens_kv = false) {
    if (widens_kv) {
      k.resize(key_tile, dim);
      v.resize(key_tile, value_dim);
    }
    const Index width = padded(query_tile);
    qt.resize(dim, width);
    st.resize(key_tile, width);
    ot.resize(value_dim, width);
    m.resize(width);
    l.resize(width);
    alpha.resize(width);
    tile_max.resize(width);
    key_lo.resize(static_cast<std::size_t>(width));
    key_hi.resize(static_cast<std::size_t>(width));
  }
};

/// exp(x - shift) for x <= shift (or NaN). With d = x - shift (exact when x is near shift, so
/// large logits lose nothing), n = round(d log2(e)) and r = d - n ln(2) in two parts
/// (Cody-Waite, so r is exact to float precision), exp(d) = 2^n * p(r), p the degree-6
/// minimax polynomial of exp on |r| <= ln(2)/2 (relative error 1.9e-9); 13 vector operations
/// per 16 scores. Results below the smallest normal float are flushed to exactly 0 (d < -87,
/// and -inf): producing a subnormal or an underflow costs a microcode assist of about 150
/// cycles per vector on Intel cores, which made causal flash 11% slower, and a probability
/// below 1.2e-38 beside the row's maximum of 1 changes nothing. NaN stays NaN.
inline __m512 exp_shifted(__m512 x, __m512 shift) {
  const __m512 d = _mm512_sub_ps(x, shift);
  // "not less than" is true for NaN, so NaN is kept; -inf (a hidden key) is not
  const __mmask16 normal = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), d);  // ln 2, high part: exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // ln 2, low part
  __m512 p = _mm512_set1_ps(1.383683993e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.374815807e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166822508e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666641980e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999999106e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, p, n);  // masked-off lanes neither compute nor assist
}

/// qt[d, 0:rows] = scale * q[0:rows, d]: the query tile transposed, 16 rows per gather.
inline void pack_queries_transposed(const float* q, Index q_stride,  // (rows, D)
                                    Index rows, Index dim, float scale, float* qt,
                                    Index qt_stride) {  // (D, rows)
  const __m512 scale_vector = _mm512_set1_ps(scale);
  Index r0 = 0;
  if (q_stride <= (Index{1} << 26)) {  // 32-bit gather offsets
    const __m512i offsets =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(static_cast<int>(q_stride)));
    for (; r0 + lanes <= rows; r0 += lanes) {
      const float* column = q + r0 * q_stride;
      for (Index d = 0; d < dim; ++d) {
        const __m512 x = _mm512_i32gather_ps(offsets, column + d, 4);
        _mm512_storeu_ps(qt + d * qt_stride + r0, _mm512_mul_ps(x, scale_vector));
      }
    }
  }
  for (Index d = 0; d < dim; ++d) {
    for (Index r = r0; r < rows; ++r)
      qt[d * qt_stride + r] = scale * q[r * q_stride + d];
  }
}

/// The elementwise max of x[0], ..., x[N - 1], as a balanced tree (depth log2 N).
template <std::size_t N>
inline __m512 max_tree(const __m512* x) {
  if constexpr (N == 1)
    return x[0];
  else
    return _mm512_max_ps(max_tree<N / 2>(x), max_tree<N - N / 2>(x + N / 2));
}

/// st[r, 0:16C] = sum_d k[r, d] * qt[d, 0:16C] for r < R: an (R x 16C) register block.
/// With `column_max`, also column_max[0:16C] = max(column_max, max_r st[r, 0:16C]) while the
/// block is still in registers (NaN scores may or may not enter the max: they reach the
/// output through their probabilities either way).
template <std::size_t R, std::size_t C>
inline void scores_block(const float* k, Index k_stride,    // (R, D) rows of k
                         const float* qt, Index qt_stride,  // (D, 16C) columns of qt
                         Index dim, float* st, Index st_stride,
                         float* column_max) {  // (16C) or null
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      acc[r][c] = _mm512_setzero_ps();
  }
  // unrolled: at D = 64 a call is only ~800 cycles, so its loop overhead and exit count
  // (2-5% faster in interleaved runs; the exit of a 16-trip loop is more likely predicted)
#pragma GCC unroll 4
  for (Index d = 0; d < dim; ++d) {
    __m512 q[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      q[c] = _mm512_loadu_ps(qt + d * qt_stride + lanes * static_cast<Index>(c));
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
      const __m512 key = _mm512_set1_ps(k[static_cast<Index>(r) * k_stride + d]);
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(key, q[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      _mm512_storeu_ps(st + static_cast<Index>(r) * st_stride + lanes * static_cast<Index>(c),
                       acc[r][c]);
  }
  if (column_max != nullptr) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) {
      // a tree, not a chain: R - 1 dependent maxes (4 cycles each) are a large share of a
      // call at D = 64 (this product alone, W = 96: 183 -> 220 GFLOP/s)
      __m512 column[R];
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r)
        column[r] = acc[r][c];
      const __m512 block_max = max_tree<R>(column);
      float* running = column_max + lanes * static_cast<Index>(c);
      _mm512_storeu_ps(running, _mm512_max_ps(block_max, _mm512_loadu_ps(running)));
    }
  }
}

/// ot[e, 0:16C] = alpha[0:16C] * ot[e, 0:16C] + sum_j v[j, e] * pt[j, 0:16C] for e < R: an
/// (R x 16C) register block of the transposed output. With `first`, the old ot is neither
/// read nor rescaled (it may be uninitialised); with alpha null, it is accumulated into as it
/// is.
template <std::size_t R, std::size_t C>
inline void values_block(const float* pt, Index pt_stride,          // (keys, 16C) block of st
                         const float* v, Index v_stride,            // (keys, R) block of v
                         Index keys, const float* alpha,            // (16C) or null
                         bool first, float* ot, Index ot_stride) {  // (R, 16C) block of ot
  __m512 acc[R][C];
  if (first) {
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = _mm512_setzero_ps();
    }
  } else {
    __m512 rescale[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) {
      rescale[c] = alpha != nullptr ? _mm512_loadu_ps(alpha + lanes * static_cast<Index>(c))
                                    : _mm512_set1_ps(1.0f);
    }
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c) {
        const float* from = ot + static_cast<Index>(r) * ot_stride + lanes * static_cast<Index>(c);
        acc[r][c] = _mm512_mul_ps(rescale[c], _mm512_loadu_ps(from));
      }
    }
  }
#pragma GCC unroll 4  // as in scores_block
  for (Index j = 0; j < keys; ++j) {
    __m512 p[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      p[c] = _mm512_loadu_ps(pt + j * pt_stride + lanes * static_cast<Index>(c));
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
      const __m512 value = _mm512_set1_ps(v[j * v_stride + static_cast<Index>(r)]);
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(value, p[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) {
      _mm512_storeu_ps(ot + static_cast<Index>(r) * ot_stride + lanes * static_cast<Index>(c),
                       acc[r][c]);
    }
  }
}

// Register blocks: scores (12 keys x 32 queries), values (8 value dims x 48 queries): 24
// accumulators of the 32 zmm registers each; remainders use smaller blocks.
inline constexpr Index score_rows = 12;
inline constexpr Index value_rows = 8;
inline constexpr Index value_vectors = 3;
/// Keys per pass of ot += v^T p over all the blocks of ot: the chunks of st (32 KiB at 128
/// queries) and of v (16 KiB at Dv = 64) stay near L1 while ot's blocks pass over them (32
/// and 128 keys measured within 1% of 64).
inline constexpr Index value_keys = 64;
static_assert(value_vectors == 3, "flash_attention_tile dispatches 1 to 3 vectors of queries");

template <std::size_t C>
inline void scores_rows(Index rows, const float* k, Index k_stride, const float* qt,
                        Index qt_stride, Index dim, float* st, Index st_stride, float* column_max) {
  switch (rows) {
#define ATTN_SCORES_CASE(R) \
  case R:                   \
    return scores_block<R, C>(k, k_stride, qt, qt_stride, dim, st, st_stride, column_max);
    ATTN_SCORES_CASE(1)
    ATTN_SCORES_CASE(2)
    ATTN_SCORES_CASE(3)
    ATTN_SCORES_CASE(4)
    ATTN_SCORES_CASE(5)
    ATTN_SCORES_CASE(6)
    ATTN_SCORES_CASE(7)
    ATTN_SCORES_CASE(8)
    ATTN_SCORES_CASE(9)
    ATTN_SCORES_CASE(10)
    ATTN_SCORES_CASE(11)
    ATTN_SCORES_CASE(12)
#undef ATTN_SCORES_CASE
    default:
      ATTN_ASSERT(false);
  }
}

template <std::size_t C>
inline void values_rows(Index rows, const float* pt, Index pt_stride, const float* v,
                        Index v_stride, Index keys, const float* alpha, bool first, float* ot,
                        Index ot_stride) {
  switch (rows) {
#define ATTN_VALUES_CASE(R) \
  case R:                   \
    return values_block<R, C>(pt, pt_stride, v, v_stride, keys, alpha, first, ot, ot_stride);
    ATTN_VALUES_CASE(1)
    ATTN_VALUES_CASE(2)
    ATTN_VALUES_CASE(3)
    ATTN_VALUES_CASE(4)
    ATTN_VALUES_CASE(5)
    ATTN_VALUES_CASE(6)
    ATTN_VALUES_CASE(7)
    ATTN_VALUES_CASE(8)
#undef ATTN_VALUES_CASE
    default:
      ATTN_ASSERT(false);
  }
}

/// st[j, r] = -inf for every key j outside [lo[r], hi[r]) (tile-relative): the causal
/// limit, the window and the key length, 16 queries per vector; and tile_max[0:width] = the
/// column maxima of the result, in the same pass (one pass over st instead of two: causal
/// flash 1-4% faster in interleaved runs).
inline void hide_outside_intervals(float* st, Index st_stride, Index keys,  // (keys, width)
                                   Index width, const std::int32_t* lo,
                                   const std::int32_t* hi,  // (width) each
                                   float* tile_max) {       // (width)
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (Index c0 = 0; c0 < width; c0 += lanes) {
    const __m512i first = _mm512_loadu_si512(lo + c0);
    const __m512i last = _mm512_loadu_si512(hi + c0);
    __m512 m[2] = {minus_inf, minus_inf};  // two chains, so that the max latency overlaps
    for (Index j = 0; j < keys; ++j) {
      const __m512i key = _mm512_set1_epi32(static_cast<std::int32_t>(j));
      const __mmask16 hidden = static_cast<__mmask16>(_mm512_cmplt_epi32_mask(key, first) |
                                                      _mm512_cmpge_epi32_mask(key, last));
      float* at = st + j * st_stride + c0;
      const __m512 score = _mm512_mask_mov_ps(_mm512_loadu_ps(at), hidden, minus_inf);
      _mm512_storeu_ps(at, score);
      m[j & 1] = _mm512_max_ps(score, m[j & 1]);
    }
    _mm512_storeu_ps(tile_max + c0, _mm512_max_ps(m[0], m[1]));
  }
}

/// Column maxima of a (keys, 16) block of st, four chains so that the max latency overlaps.
inline __m512 column_maxima(const float* st, Index st_stride, Index keys) {
  __m512 m[4];
  for (__m512& x : m)
    x = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  Index j = 0;
  for (; j + 4 <= keys; j += 4) {
#pragma GCC unroll 4
    for (std::size_t u = 0; u < 4; ++u)
      m[u] = _mm512_max_ps(_mm512_loadu_ps(st + (j + static_cast<Index>(u)) * st_stride), m[u]);
  }
  for (; j < keys; ++j)
    m[0] = _mm512_max_ps(_mm512_loadu_ps(st + j * st_stride), m[0]);
  return _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
}

/// Online-softmax update of one key tile for 16 queries (one column block of st), given the
/// tile's column maxima:
///   m' = max(m, tile_max);  p[j] = exp(s[j] - m');  l = l * exp(m - m') + sum_j p[j]
/// A query that has seen only hidden keys (m' = -inf) gets p = exp(s - 0) = 0 and alpha 1.
/// NaN scores give NaN probabilities, so they propagate to the output.
inline void softmax_update(float* st, Index st_stride, Index keys,               // (keys, 16) of st
                           __m512 tile_max, float* m, float* l, float* alpha) {  // (16) each
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 m_new = _mm512_max_ps(tile_max, m_old);
  const __mmask16 nothing_seen = _mm512_cmp_ps_mask(m_new, minus_inf, _CMP_EQ_OQ);
  const __m512 shift = _mm512_mask_blend_ps(nothing_seen, m_new, _mm512_setzero_ps());
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  Index j = 0;
  for (; j + 1 < keys; j += 2) {  // two chains: the adds do not wait for each other
    const __m512 p0 = exp_shifted(_mm512_loadu_ps(st + j * st_stride), shift);
    const __m512 p1 = exp_shifted(_mm512_loadu_ps(st + (j + 1) * st_stride), shift);
    _mm512_storeu_ps(st + j * st_stride, p0);
    _mm512_storeu_ps(st + (j + 1) * st_stride, p1);
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
  }
  if (j < keys) {
    const __m512 p0 = exp_shifted(_mm512_loadu_ps(st + j * st_stride), shift);
    _mm512_storeu_ps(st + j * st_stride, p0);
    sum0 = _mm512_add_ps(sum0, p0);
  }
  const __m512 rescale =
      _mm512_mask_blend_ps(nothing_seen, exp_shifted(m_old, shift), _mm512_set1_ps(1.0f));
  _mm512_storeu_ps(alpha, rescale);
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), rescale, _mm512_add_ps(sum0, sum1)));
  _mm512_storeu_ps(m, m_new);
}

/// Flash attention for queries [i0, i0 + rows) of one (batch b, query head h) pair; the
/// contract of detail::flash_attention_tile (kernels/flash.hpp), for float compute with k and
/// v stored as S (float, or 16-bit widened tile by tile into the workspace).
///   pass 1: qt = scale * q[i0:i1]^T                  (the scale folded into the operand)
///   pass 2: for each key tile [j0, j1) the mask does not hide:
///             st = k[j0:j1] qt                        (12 x 32 register blocks; the column
///                                                      maxima in the same pass when the tile
///                                                      needs no mask)
///             otherwise mask st, then its column maxima
///             online softmax down the columns of st   (16 queries per vector)
///             ot = alpha ot + v[j0:j1]^T st           (8 x 48 register blocks)
///   pass 3: out = ot^T / l (zeros when l = 0), logsumexp = m + log l
template <class S = float>
void flash_attention_tile(const HeadMatrix<const float>& q,  // (rows, D)  queries i0 ..
                          const HeadMatrix<const S>& k,      // (Lk, D)    the whole head
                          const HeadMatrix<const S>& v,      // (Lk, Dv)
                          HeadMatrix<float> out,             // (rows, Dv) written
                          const Mask<float>& mask, Index b, Index h, float scale, Index i0,
                          Index key_tile, FlashWorkspace& workspace,
                          float* logsumexp) {  // (rows) or null
  constexpr float minus_inf = -std::numeric_limits<float>::infinity();
  const Index rows = q.rows();
  const Index i1 = i0 + rows;
  const Index width = FlashWorkspace::padded(rows);
  const Index dim = q.cols(), value_dim = v.cols();
  const Index stride = workspace.qt.cols();  // row stride of qt and st
  ATTN_ASSERT(rows > 0 && width <= stride && key_tile <= workspace.st.rows() &&
              workspace.ot.cols() == stride);

  const auto [keys_first, keys_last] = mask.key_range(b, i0, i1);
  float* m = workspace.m.data();
  float* l = workspace.l.data();
  float* tile_max = workspace.tile_max.data();
  float* alpha = workspace.alpha.data();
  std::fill_n(m, width, minus_inf);
  std::fill_n(l, width, 0.0f);
  bool first_tile = true;

  if (keys_first < keys_last) {
    float* qt = workspace.qt.data();
    pack_queries_transposed(q.data(), q.outerStride(), rows, dim, scale, qt,
                            stride);  // pass 1
    for (Index d = 0; d < dim; ++d)
      std::fill(qt + d * stride + rows, qt + d * stride + width, 0.0f);

    float* st = workspace.st.data();
    float* ot = workspace.ot.data();
    for (Index j0 = keys_first; j0 < keys_last; j0 += key_tile) {  // pass 2
      const Index j1 = std::min(j0 + key_tile, keys_last);
      const Index cols = j1 - j0;
      const TileVisibility visibility = mask.classify(b, h, i0, i1, j0, j1);
      if (visibility == TileVisibility::hidden)
        continue;
      const bool masked = visibility == TileVisibility::partial || mask.modifies_scores();
      const HeadMatrix<const float> k_tile = rows_as<float, S>(k, j0, cols, workspace.k);
      const HeadMatrix<const float> v_tile = rows_as<float, S>(v, j0, cols, workspace.v);

      std::fill_n(tile_max, width, minus_inf);
      for (Index j = 0; j < cols; j += score_rows) {
        const Index block_rows = std::min(score_rows, cols - j);
        const float* k_rows = k_tile.row(j).data();
        float* st_rows = st + j * stride;
        Index c0 = 0;
        for (; c0 + 2 * lanes <= width; c0 += 2 * lanes) {
          scores_rows<2>(block_rows, k_rows, k_tile.outerStride(), qt + c0, stride, dim,
                         st_rows + c0, stride, masked ? nullptr : tile_max + c0);
        }
        if (c0 < width) {
          scores_rows<1>(block_rows, k_rows, k_tile.outerStride(), qt + c0, stride, dim,
                         st_rows + c0, stride, masked ? nullptr : tile_max + c0);
        }
      }
      if (masked) {
        // generic path: (rows, cols) of scores seen as a column-major view of st
        if (mask.has_keep_mask() || mask.modifies_scores()) {
          Eigen::Map<Eigen::MatrixXf, 0, Eigen::OuterStride<>> scores(st, rows, cols,
                                                                      Eigen::OuterStride<>(stride));
          mask.apply(b, h, i0, j0, scores);
          for (Index c0 = 0; c0 < width; c0 += lanes)
            _mm512_storeu_ps(tile_max + c0, column_maxima(st + c0, stride, cols));
        } else {  // only intervals: vectorised (the diagonal tiles of a causal mask)
          std::int32_t* lo = workspace.key_lo.data();
          std::int32_t* hi = workspace.key_hi.data();
          for (Index r = 0; r < width; ++r) {
            const auto [first, last] =
                r < rows ? mask.key_interval(b, i0 + r) : std::array<Index, 2>{j0, j1};
            lo[r] = static_cast<std::int32_t>(std::clamp(first - j0, Index(0), cols));
            hi[r] = static_cast<std::int32_t>(std::clamp(last - j0, Index(0), cols));
          }
          hide_outside_intervals(st, stride, cols, width, lo, hi, tile_max);
        }
      }
      for (Index c0 = 0; c0 < width; c0 += lanes) {
        softmax_update(st + c0, stride, cols, _mm512_loadu_ps(tile_max + c0), m + c0, l + c0,
                       alpha + c0);
      }
      // ot = alpha ot + v^T st, in chunks of value_keys keys, so that the chunks of st and v
      // stay in L1 while every block of ot passes over them; the first chunk rescales ot.
      for (Index c0 = 0; c0 < cols; c0 += value_keys) {
        const Index chunk = std::min(value_keys, cols - c0);
        const bool first = first_tile && c0 == 0;
        const float* pt = st + c0 * stride;
        const float* v_rows = v_tile.row(c0).data();
        for (Index q0 = 0; q0 < width; q0 += lanes * value_vectors) {
          const Index vectors = std::min(value_vectors, (width - q0) / lanes);
          const float* rescale = c0 == 0 ? alpha + q0 : nullptr;
          for (Index e = 0; e < value_dim; e += value_rows) {
            const Index block_rows = std::min(value_rows, value_dim - e);
            const auto block = [&](auto vectors_constant) {
              values_rows<decltype(vectors_constant)::value>(
                  block_rows, pt + q0, stride, v_rows + e, v_tile.outerStride(), chunk, rescale,
                  first, ot + e * stride + q0, stride);
            };
            if (vectors == 3)
              block(std::integral_constant<std::size_t, 3>{});
            else if (vectors == 2)
              block(std::integral_constant<std::size_t, 2>{});
            else
              block(std::integral_constant<std::size_t, 1>{});
          }
        }
      }
      first_tile = false;
    }
  }

  // pass 3
  const float* ot = workspace.ot.data();
  for (Index r = 0; r < rows; ++r) {
    auto out_row = out.row(r);
    if (first_tile || l[r] == 0.0f) {  // the row sees no key: zeros, lse -inf
      out_row.setZero();
      if (logsumexp != nullptr)
        logsumexp[r] = minus_inf;
    } else {
      const float inverse = 1.0f / l[r];
      for (Index e = 0; e < value_dim; ++e)  // column r of ot (ot is empty when Dv = 0)
        out_row(e) = ot[e * stride + r] * inverse;
      if (logsumexp != nullptr)
        logsumexp[r] = m[r] + std::log(l[r]);
    }
  }
}

}  // namespace attn::detail::avx512

#else
#define ATTN_HAS_AVX512_FLASH 0
#endif  // __AVX512F__ && !ATTN_NO_AVX512
