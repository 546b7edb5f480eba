// attn/kernels/decode_avx512.hpp: the two products of the decode kernel for float compute,
// with K and V widened in registers as they are read.
//
//   q      (R, D)      scale * the group's query rows, float (R = G * Lq)
//   k      (keys, D)   one key block, float / Eigen::half / Eigen::bfloat16, read in place
//   s      (R, keys)   scores, then probabilities
//   v      (keys, Dv)  one value block, like k
//   acc    (R, Dv)     unnormalised output, float
//
// Why: decoding streams every key and value once and does little arithmetic on each, so
// the time is the time to read K and V. The portable path widens a 16-bit block into a
// float buffer and then multiplies the buffer: one extra write and read per element, and
// products too short for Eigen's blocking. Here each 16-element piece of a k or v row is
// loaded, widened (one vcvtph2ps, or a shift for bfloat16) and used by all R rows while it
// is in a register; a block of 4 keys x 4 rows keeps 16 dot products in flight, reduced to
// scalars with one transpose-and-add tree per 4 keys.
//
// Extra memory: none (registers and the caller's s and acc).
// Compiled only when the translation unit targets AVX-512F and ATTN_NO_AVX512 is not
// defined; otherwise kernels/decode.hpp uses its portable products.
#pragma once

#if defined(__AVX512F__) && !defined(ATTN_NO_AVX512)
#define ATTN_HAS_AVX512_DECODE 1

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn::detail::avx512 {

/// Rows this far ahead of the one being read are requested from memory (_MM_HINT_T0).
/// Blocks of K and V alternate and a 256-byte row crosses a page every 16 rows, and the
/// hardware prefetcher alone lets the loads wait: with it, GQA decoding at Lk = 32768 went
/// from 55% to 70-95% of the streaming probe (bench_decode, distances 8-64 tried: 32 best).
inline constexpr Index prefetch_keys = 32;

/// Requests the cache line of `row` + `offset` elements; a hint only, which never faults,
/// so the address may lie past the data (computed as an integer, not as a pointer).
template <class S>
inline void prefetch(const S* row, Index offset) {
  const auto address =
      reinterpret_cast<std::uintptr_t>(row) + static_cast<std::uintptr_t>(offset) * sizeof(S);
  _mm_prefetch(reinterpret_cast<const char*>(address), _MM_HINT_T0);
}

/// [sum a, sum b, sum c, sum d]: one transpose-and-add tree for four dot products.
inline __m128 sum_each(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a, b, c, d] partial sums
  const __m512d ab2 = _mm512_castps_pd(ab), cd2 = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab2, cd2)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(ab2, cd2)));
  const __m256 halves =
      _mm256_add_ps(_mm512_castps512_ps256(abcd),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

/// s[r, j] = q[r, 0:dim) . k[j, 0:dim) for r < Rb, j < Kb, dim a multiple of 16: Rb x Kb
/// dot products in registers. (Nothing else in the loop: a call or a branch to a tail path
/// makes GCC keep the accumulators on the stack.)
template <int Rb, int Kb, class S>
inline void dot_block(const float* q, Index q_stride,  // (Rb, dim)
                      const S* k, Index k_stride,      // (Kb, dim)
                      Index dim, float* s, Index s_stride) {
  static_assert(Kb == 1 || Kb == 4, "dot_block: 1 or 4 keys");
  __m512 acc[static_cast<std::size_t>(Rb)][static_cast<std::size_t>(Kb)];
  for (int r = 0; r < Rb; ++r)
    for (int j = 0; j < Kb; ++j)
      acc[r][j] = _mm512_setzero_ps();
  for (Index d = 0; d < dim; d += 16) {
    __m512 key[static_cast<std::size_t>(Kb)];
    for (int j = 0; j < Kb; ++j) {
      key[j] = load_widened(k + j * k_stride + d);
      prefetch(k, (j + prefetch_keys) * k_stride + d);
    }
    for (int r = 0; r < Rb; ++r) {
      const __m512 query = _mm512_loadu_ps(q + r * q_stride + d);
      for (int j = 0; j < Kb; ++j)
        acc[r][j] = _mm512_fmadd_ps(query, key[j], acc[r][j]);
    }
  }
  for (int r = 0; r < Rb; ++r) {
    if constexpr (Kb == 4)
      _mm_storeu_ps(s + r * s_stride, sum_each(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    else
      s[r * s_stride] = _mm512_reduce_add_ps(acc[r][0]);
  }
}

template <int Rb, class S>
inline void dot_rows(const float* q, Index q_stride, const S* k, Index k_stride, Index keys,
                     Index dim, float* s, Index s_stride) {
  Index j = 0;
  for (; j + 4 <= keys; j += 4)
    dot_block<Rb, 4>(q, q_stride, k + j * k_stride, k_stride, dim, s + j, s_stride);
  for (; j < keys; ++j)
    dot_block<Rb, 1>(q, q_stride, k + j * k_stride, k_stride, dim, s + j, s_stride);
}

/// The first `width` (< 16) lanes of a vector.
inline __mmask16 first_lanes(Index width) {
  return static_cast<__mmask16>((1u << static_cast<unsigned>(width)) - 1u);
}

/// The last `width` (< 16) columns of rows of x, widened to float and zero-padded to 16
/// lanes, 64 rows at a time: the tails go through one vector path whatever S is, so that
/// 16-bit data gives the same bits as the same values in float (a scalar loop did not: GCC
/// compiled it differently for the two types).
template <class S>
struct WidenedTails {
  static constexpr Index max_rows = 64;
  alignas(64) float lanes[max_rows][16];

  /// body(j0, count) for each chunk of rows [j0, j0 + count) of x (rows in all), with
  /// lanes[j] holding row j0 + j.
  template <class Body>
  void for_each_chunk(const S* x, Index x_stride, Index rows, Index width, Body body) {
    for (Index j0 = 0; j0 < rows; j0 += max_rows) {
      const Index count = std::min(max_rows, rows - j0);
      for (Index j = 0; j < count; ++j) {
        for (Index c = 0; c < 16; ++c)
          lanes[j][c] = c < width ? static_cast<float>(x[(j0 + j) * x_stride + c]) : 0.0f;
      }
      body(j0, count);
    }
  }
};

/// s[r, j] += q[r, 0:width) . k[j, 0:width) for r < rows, j < keys (width < 16).
template <class S>
inline void dot_tails(const float* q, Index q_stride, Index rows, const S* k, Index k_stride,
                      Index keys, Index width, float* s, Index s_stride) {
  WidenedTails<S> tails;
  tails.for_each_chunk(k, k_stride, keys, width, [&](Index j0, Index count) {
    for (Index r = 0; r < rows; ++r) {
      const __m512 query = _mm512_maskz_loadu_ps(first_lanes(width), q + r * q_stride);
      for (Index j = 0; j < count; ++j) {
        s[r * s_stride + j0 + j] +=
            _mm512_reduce_add_ps(_mm512_mul_ps(query, _mm512_load_ps(tails.lanes[j])));
      }
    }
  });
}

/// acc[r, 0:width) = alpha[r] acc[r, 0:width) + sum_j p[r, j] v[j, 0:width) (width < 16).
template <class S>
inline void weighted_sum_tails(const float* p, Index p_stride, Index rows, const S* v,
                               Index v_stride, Index keys, Index width, const float* alpha,
                               bool first, float* acc, Index acc_stride) {
  const __mmask16 lanes = first_lanes(width);
  WidenedTails<S> tails;
  tails.for_each_chunk(v, v_stride, keys, width, [&](Index j0, Index count) {
    for (Index r = 0; r < rows; ++r) {
      float* row = acc + r * acc_stride;
      __m512 sum = _mm512_setzero_ps();
      if (j0 > 0)
        sum = _mm512_maskz_loadu_ps(lanes, row);
      else if (!first)
        sum = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row), _mm512_set1_ps(alpha[r]));
      for (Index j = 0; j < count; ++j) {
        sum = _mm512_fmadd_ps(_mm512_set1_ps(p[r * p_stride + j0 + j]),
                              _mm512_load_ps(tails.lanes[j]), sum);
      }
      _mm512_mask_storeu_ps(row, lanes, sum);
    }
  });
}

/// s = q k^T: s[r, j] = q[r] . k[j] for r < rows, j < keys.
template <class S>
inline void decode_scores(const float* q, Index q_stride,                      // (rows, D)
                          Index rows, const S* k, Index k_stride, Index keys,  // (keys, D)
                          Index dim, float* s, Index s_stride) {               // (rows, keys)
  const Index vector_dim = dim / 16 * 16;
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    dot_rows<4>(q + r * q_stride, q_stride, k, k_stride, keys, vector_dim, s + r * s_stride,
                s_stride);
  }
  switch (rows - r) {
    case 3:
      dot_rows<3>(q + r * q_stride, q_stride, k, k_stride, keys, vector_dim, s + r * s_stride,
                  s_stride);
      break;
    case 2:
      dot_rows<2>(q + r * q_stride, q_stride, k, k_stride, keys, vector_dim, s + r * s_stride,
                  s_stride);
      break;
    case 1:
      dot_rows<1>(q + r * q_stride, q_stride, k, k_stride, keys, vector_dim, s + r * s_stride,
                  s_stride);
      break;
    default:
      break;
  }
  if (vector_dim < dim)
    dot_tails(q + vector_dim, q_stride, rows, k + vector_dim, k_stride, keys, dim - vector_dim, s,
              s_stride);
}

/// acc[r, 0:16C) = alpha[r] acc[r, 0:16C) + sum_j p[r, j] v[j, 0:16C) for r < Rb (with
/// `first`, acc is only written): Rb x C vectors of sums in registers, full vectors only.
template <int Rb, int C, class S>
inline void weighted_sum_block(const float* p, Index p_stride,  // (Rb, keys)
                               const S* v, Index v_stride,      // (keys, 16C)
                               Index keys, const float* alpha, bool first, float* acc,
                               Index acc_stride) {  // (Rb, 16C)
  __m512 sum[static_cast<std::size_t>(Rb)][static_cast<std::size_t>(C)];
  for (int r = 0; r < Rb; ++r) {
    const __m512 rescale = _mm512_set1_ps(first ? 0.0f : alpha[r]);
    for (int c = 0; c < C; ++c)
      sum[r][c] = first ? _mm512_setzero_ps()
                        : _mm512_mul_ps(_mm512_loadu_ps(acc + r * acc_stride + 16 * c), rescale);
  }
  for (Index j = 0; j < keys; ++j) {
    __m512 value[static_cast<std::size_t>(C)];
    for (int c = 0; c < C; ++c) {
      value[c] = load_widened(v + j * v_stride + 16 * c);
      prefetch(v, (j + prefetch_keys) * v_stride + 16 * c);
    }
    for (int r = 0; r < Rb; ++r) {
      const __m512 weight = _mm512_set1_ps(p[r * p_stride + j]);
      for (int c = 0; c < C; ++c)
        sum[r][c] = _mm512_fmadd_ps(weight, value[c], sum[r][c]);
    }
  }
  for (int r = 0; r < Rb; ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(acc + r * acc_stride + 16 * c, sum[r][c]);
}

template <int Rb, class S>
inline void weighted_sum_rows(const float* p, Index p_stride, const S* v, Index v_stride,
                              Index keys, Index vector_dim, const float* alpha, bool first,
                              float* acc, Index acc_stride) {
  Index e = 0;
  for (; e + 64 <= vector_dim; e += 64)
    weighted_sum_block<Rb, 4>(p, p_stride, v + e, v_stride, keys, alpha, first, acc + e,
                              acc_stride);
  switch ((vector_dim - e) / 16) {
    case 3:
      return weighted_sum_block<Rb, 3>(p, p_stride, v + e, v_stride, keys, alpha, first, acc + e,
                                       acc_stride);
    case 2:
      return weighted_sum_block<Rb, 2>(p, p_stride, v + e, v_stride, keys, alpha, first, acc + e,
                                       acc_stride);
    case 1:
      return weighted_sum_block<Rb, 1>(p, p_stride, v + e, v_stride, keys, alpha, first, acc + e,
                                       acc_stride);
    default:
      return;
  }
}

/// acc = diag(alpha) acc + p v (acc = p v with `first`): the rows of p weight the rows of v.
template <class S>
inline void decode_weighted_sum(const float* p, Index p_stride,          // (rows, keys)
                                Index rows, const S* v, Index v_stride,  // (keys, Dv)
                                Index keys, Index value_dim,
                                const float* alpha,                          // (rows)
                                bool first, float* acc, Index acc_stride) {  // (rows, Dv)
  const Index vector_dim = value_dim / 16 * 16;
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    weighted_sum_rows<4>(p + r * p_stride, p_stride, v, v_stride, keys, vector_dim, alpha + r,
                         first, acc + r * acc_stride, acc_stride);
  }
  switch (rows - r) {
    case 3:
      weighted_sum_rows<3>(p + r * p_stride, p_stride, v, v_stride, keys, vector_dim, alpha + r,
                           first, acc + r * acc_stride, acc_stride);
      break;
    case 2:
      weighted_sum_rows<2>(p + r * p_stride, p_stride, v, v_stride, keys, vector_dim, alpha + r,
                           first, acc + r * acc_stride, acc_stride);
      break;
    case 1:
      weighted_sum_rows<1>(p + r * p_stride, p_stride, v, v_stride, keys, vector_dim, alpha + r,
                           first, acc + r * acc_stride, acc_stride);
      break;
    default:
      break;
  }
  if (vector_dim < value_dim) {
    weighted_sum_tails(p, p_stride, rows, v + vector_dim, v_stride, keys, value_dim - vector_dim,
                       alpha, first, acc + vector_dim, acc_stride);
  }
}

}  // namespace attn::detail::avx512

#else
#define ATTN_HAS_AVX512_DECODE 0
#endif  // __AVX512F__ && !ATTN_NO_AVX512
