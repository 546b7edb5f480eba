// attn/kernels/bf16_tiles.hpp: the flash kernel on bf16 dot products (AVX512-BF16), the
// products of the Isa::avx512_bf16 level, whose table (kernels/dispatch.hpp) is avx512's with
// this flash tile added as ForwardKernels::flash_tile_bf16.
//
// `vdpbf16ps acc, a, b` adds a[2i] b[2i] + a[2i+1] b[2i+1] to float lane i: pairs along the
// sum, twice the multiply-adds of an fp32 FMA per instruction. So the operands are kept in
// pairs along the dimension each product sums over (bfloat16 bits in uint16_t):
//
//   q pairs   (D2, W, 2)    q^T: row d2 holds (q[i, 2 d2], q[i, 2 d2 + 1]) for each query i
//   k         (Bk, 2 D2)    a key tile's rows: (k[j, 2 d2], k[j, 2 d2 + 1]) is one 32-bit word,
//                           broadcast; bfloat16 K is read in place, float K rounded into it
//   p pairs   (Bk2, W, 2)   P^T: row j2 holds (p[2 j2, i], p[2 j2 + 1, i]), rounded from st
//   v pairs   (Bk2, Dv, 2)  V^T interleaved: row j2 holds (v[2 j2, e], v[2 j2 + 1, e])
//
// D2 = ceil(D / 2), Bk2 = ceil(Bk / 2); odd ends are padded with zeros in both operands. The
// online softmax between the products is flash_tile_with's (kernels/online_softmax.inl), in
// float, unchanged: the scores st = scale * (q k^T) are float (the scale multiplies the sums,
// so that only q, k and v themselves are rounded), and so are m, l, alpha and the
// accumulator. P is rounded to bfloat16 for P V only (l sums the float p, as PyTorch's CPU
// flash attention and FlashAttention do). Rounding: round to nearest even (vcvtneps2bf16,
// which reads float subnormals as zero; the exp already flushes p below the smallest normal).
//
// Extra memory, per thread, beside flash's float workspace (kernels/flash.hpp): 2 D2 W + 2
// Bk2 W + 2 Bk D2 + 2 Bk2 Dv 16-bit values (workspace.hpp's bf16 buffers; the k buffer
// holds float keys rounded, or bfloat16 keys of a packed, paged or odd-D view).
#pragma once

#include "attn/kernels/simd/target.hpp"

#if ATTN_X86_DISPATCH

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/kernels/online_softmax.hpp"
#include "attn/kernels/simd/avx512.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/tensor.hpp"

ATTN_BEGIN_TARGET_AVX512_BF16
namespace attn::detail::avx512_bf16 {

inline constexpr Isa isa = Isa::avx512_bf16;
using avx512::lanes;
using avx512::vec;

/// P V's register blocks are avx512's (value_rows x value_vectors); its chunks of keys are a
/// whole default key tile instead of avx512::value_keys (64): each chunk loads and stores the
/// accumulator block once, and pairs of keys halve the chunk's depth. Measured on AMD Zen 4
/// (bench_attention's flash_bf16, one thread, L = 2048): 256 keys ran D = 64 2-4% and D = 128
/// 7-8% faster than 64, and 8 x 3 blocks as fast as 12 x 2 and faster than 6 x 4.
inline constexpr Index bf16_value_rows = avx512::value_rows;
inline constexpr Index bf16_value_vectors = avx512::value_vectors;
inline constexpr Index bf16_value_keys = 256;

/// 16-bit element indices that interleave the two 256-bit halves of a vector: element 2i
/// from the low half's i, 2i + 1 from the high half's i.
inline __m512i interleave_halves_index() {
  alignas(64) static constexpr std::uint16_t index[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(index);
}

/// 16 pairs (lo[i], hi[i]) of float vectors rounded to bfloat16, as 16 32-bit words.
inline __m512i round_pairs(vec lo, vec hi) {
  const auto halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo | hi
  return _mm512_permutexvar_epi16(interleave_halves_index(), halves);
}

/// 16 floats at p (the first n, the rest read as 0).
inline vec load_floats(const float* p, Index n) {
  return n >= lanes ? _mm512_loadu_ps(p)
                    : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}

/// dst[0:2 n2) = src[0:count) rounded to bfloat16, zeros in [count, 2 n2).
inline void round_row(const float* src, Index count, Index n2, std::uint16_t* dst) {
  for (Index d = 0; d < 2 * n2; d += 2 * lanes) {
    const Index left = count - d;
    const vec lo = left > 0 ? load_floats(src + d, left) : _mm512_setzero_ps();
    const vec hi = left > lanes ? load_floats(src + d + lanes, left - lanes) : _mm512_setzero_ps();
    const auto halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    const Index words = std::min<Index>(2 * lanes, 2 * n2 - d);  // 16-bit elements to store
    _mm512_mask_storeu_epi16(dst + d, static_cast<__mmask32>((std::uint64_t{1} << words) - 1u),
                             halves);
  }
}

/// dst[0:2 n2) = src[0:count) (bfloat16 bits), zeros in [count, 2 n2).
inline void copy_row(const Eigen::bfloat16* src, Index count, Index n2, std::uint16_t* dst) {
  std::memcpy(dst, src, static_cast<std::size_t>(count) * sizeof(std::uint16_t));
  std::fill(dst + count, dst + 2 * n2, std::uint16_t(0));
}

/// pairs[(r / 2) * pairs_stride + c] = the word (x[r, c], x[r + 1, c]) rounded, for even r <
/// rows and c < cols (x[rows, c] read as 0 when rows is odd): the rows of x in pairs along
/// the sum that runs down its columns.
inline void pair_rows(const float* x, Index x_stride, Index rows, Index cols,  // (rows, cols)
                      std::uint32_t* pairs, Index pairs_stride) {  // (ceil(rows / 2), cols)
  for (Index r = 0; r < rows; r += 2) {
    const float* even = x + r * x_stride;
    const float* odd = r + 1 < rows ? even + x_stride : nullptr;
    std::uint32_t* dst = pairs + (r / 2) * pairs_stride;
    for (Index c = 0; c < cols; c += lanes) {
      const Index n = std::min(lanes, cols - c);
      const vec lo = load_floats(even + c, n);
      const vec hi = odd != nullptr ? load_floats(odd + c, n) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(dst + c, static_cast<__mmask16>((1u << n) - 1u),
                               round_pairs(lo, hi));
    }
  }
}

/// Row `count` values of x (float or bfloat16) into dst as bfloat16, zero-padded to 2 n2.
template <class S>
inline void bf16_row(const S* src, Index count, Index n2, std::uint16_t* dst) {
  if constexpr (std::is_same_v<S, float>)
    round_row(src, count, n2, dst);
  else
    copy_row(src, count, n2, dst);
}

/// The flash tile's products on bf16 dot products, for K stored as SK and V as SV (float or
/// bfloat16), with flash_tile_with's interface (kernels/online_softmax.inl).
template <class SK, class SV>
struct Bf16TileProducts {
  /// q pairs (D2, width, 2) = q^T rounded, zero columns past q's rows. (The scale multiplies
  /// the scores, tile_scores.)
  static void pack_query_tile(const HeadMatrix<const float>& q,  // (rows, D)
                              float /*scale*/, Index width, Workspace<float>& workspace) {
    const Index rows = q.rows(), dim = q.cols(), dim2 = (dim + 1) / 2;
    auto* pairs = reinterpret_cast<std::uint32_t*>(workspace.bf16_q.data());  // (D2, width)
    std::uint16_t* row = workspace.bf16_k.data();  // one row's scratch (the k buffer is free)
    for (Index i = 0; i < rows; ++i) {
      round_row(q.row(i).data(), dim, dim2, row);
      for (Index d2 = 0; d2 < dim2; ++d2) {
        std::uint32_t word = 0;
        std::memcpy(&word, row + 2 * d2, sizeof(word));
        pairs[d2 * width + i] = word;
      }
    }
    for (Index d2 = 0; d2 < dim2; ++d2)
      std::fill(pairs + d2 * width + rows, pairs + (d2 + 1) * width, std::uint32_t(0));
  }

  /// st (cols, width) = scale * (k[j0:j0+cols] q^T) on bf16 products, and tile_max (width)
  /// its column maxima when not null.
  static void tile_scores(const HeadsView<const SK>& k,  // (B, Hkv, Lk, D)
                          Index b, Index kv_head, Index j0, Index cols, Index dim, Index width,
                          float scale, Workspace<float>& workspace, float* tile_max) {
    const Index dim2 = (dim + 1) / 2;
    const std::uint16_t* rows = nullptr;
    Index row_stride = 0;  // in 16-bit elements
    if constexpr (std::is_same_v<SK, Eigen::bfloat16>) {
      if (dim % 2 == 0 && cols <= contiguous_rows(k, j0)) {  // in place: pairs are words
        rows = reinterpret_cast<const std::uint16_t*>(row_data(k, b, kv_head, j0));
        row_stride = k.row_stride;
      }
    }
    if (rows == nullptr) {
      std::uint16_t* tile = workspace.bf16_k.data();
      for (Index j = 0; j < cols; ++j)
        bf16_row(row_data(k, b, kv_head, j0 + j), dim, dim2, tile + j * 2 * dim2);
      rows = tile;
      row_stride = 2 * dim2;
    }
    scores(rows, row_stride, cols, reinterpret_cast<const std::uint32_t*>(workspace.bf16_q.data()),
           width, dim2, scale, workspace.s.data(), width, tile_max);
  }

  /// ot (Dv, width) = alpha ot + v[j0:j0+cols]^T round(st) on bf16 products (alpha null:
  /// ot = v^T round(st)).
  static void tile_accumulate(const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv)
                              Index b, Index kv_head, Index j0, Index cols, Index width,
                              const float* alpha, Workspace<float>& workspace) {
    const Index value_dim = v.dim, cols2 = (cols + 1) / 2;
    auto* p_pairs = reinterpret_cast<std::uint32_t*>(workspace.bf16_p.data());  // (Bk2, width)
    pack_probabilities(workspace.s.data(), width, cols, width, p_pairs);
    auto* v_pairs = reinterpret_cast<std::uint32_t*>(workspace.bf16_v.data());  // (Bk2, Dv)
    for (Index j2 = 0; j2 < cols2; ++j2) {
      const SV* even = row_data(v, b, kv_head, j0 + 2 * j2);
      const SV* odd = 2 * j2 + 1 < cols ? row_data(v, b, kv_head, j0 + 2 * j2 + 1) : nullptr;
      pack_value_pairs(even, odd, value_dim, v_pairs + j2 * value_dim);
    }
    accumulate(p_pairs, width, cols2, width, v_pairs, value_dim, value_dim, alpha,
               workspace.acc.data(), width);
  }

  /// p pairs (keys2, width) = st (keys, width) rounded, in pairs of keys (a zero key past
  /// an odd end).
  static void pack_probabilities(const float* st, Index st_stride, Index keys, Index width,
                                 std::uint32_t* pairs) {
    pair_rows(st, st_stride, keys, width, pairs, width);
  }

  /// dst (Dv) = the words (even[e], odd[e]) rounded (odd null: zeros).
  static void pack_value_pairs(const SV* even, const SV* odd, Index value_dim, std::uint32_t* dst) {
    Index e = 0;
    for (; e + lanes <= value_dim; e += lanes) {
      if constexpr (std::is_same_v<SV, float>) {
        const vec lo = _mm512_loadu_ps(even + e);
        const vec hi = odd != nullptr ? _mm512_loadu_ps(odd + e) : _mm512_setzero_ps();
        _mm512_storeu_si512(dst + e, round_pairs(lo, hi));
      } else {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + e));
        const __m256i hi = odd != nullptr
                               ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + e))
                               : _mm256_setzero_si256();
        // (zero-masked inserts: GCC 12's plain one, also inside _mm512_zextsi256_si512,
        // trips -Wmaybe-uninitialized, bug 105593)
        const __m512i halves = _mm512_maskz_inserti64x4(
            0xff, _mm512_maskz_inserti64x4(0xff, _mm512_setzero_si512(), lo, 0), hi, 1);
        _mm512_storeu_si512(dst + e, _mm512_permutexvar_epi16(interleave_halves_index(), halves));
      }
    }
    for (; e < value_dim; ++e) {
      const std::uint32_t lo = bits_of(even[e]), hi = odd != nullptr ? bits_of(odd[e]) : 0u;
      dst[e] = lo | (hi << 16);
    }
  }

  /// The bfloat16 bits of x (float: rounded as the vector instruction does).
  template <class S>
  static std::uint32_t bits_of(S x) {
    if constexpr (std::is_same_v<S, float>) {
      std::uint16_t pair[2] = {0, 0};
      round_row(&x, 1, 1, pair);  // (x and a zero pad)
      return pair[0];
    } else {
      return Eigen::numext::bit_cast<std::uint16_t>(x);
    }
  }

  /// st[r, 0:C lanes) = scale * sum_d2 k[r, d2 pair] . q pairs[d2, :] for r < R: an (R x C
  /// vectors) register block, as scores_block of tile_products.inl; with `column_max`, also
  /// its column maxima.
  template <std::size_t R, std::size_t C>
  static void scores_block(const std::uint16_t* k, Index k_stride,  // (R, 2 D2)
                           const std::uint32_t* q, Index q_stride,  // (D2, C lanes)
                           Index dim2, float scale, float* st, Index st_stride,
                           float* column_max) {  // (C lanes) or null
    vec acc[R][C];
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = _mm512_setzero_ps();
    }
#pragma GCC unroll 2
    for (Index d2 = 0; d2 < dim2; ++d2) {
      __m512bh queries[C];
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c) {
        queries[c] = reinterpret_cast<__m512bh>(
            _mm512_loadu_si512(q + d2 * q_stride + lanes * static_cast<Index>(c)));
      }
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r) {
        std::int32_t word = 0;
        std::memcpy(&word, k + static_cast<Index>(r) * k_stride + 2 * d2, sizeof(word));
        const auto key = reinterpret_cast<__m512bh>(_mm512_set1_epi32(word));
#pragma GCC unroll 4
        for (std::size_t c = 0; c < C; ++c)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], key, queries[c]);
      }
    }
    const vec scales = _mm512_set1_ps(scale);
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c) {
        acc[r][c] = _mm512_mul_ps(acc[r][c], scales);
        _mm512_storeu_ps(st + static_cast<Index>(r) * st_stride + lanes * static_cast<Index>(c),
                         acc[r][c]);
      }
    }
    if (column_max != nullptr)
      avx512::update_column_max(acc, column_max);
  }

  /// scores_block for `rows` (1 .. R) keys.
  template <std::size_t C, std::size_t R = static_cast<std::size_t>(avx512::score_rows)>
  static void scores_rows(Index rows, const std::uint16_t* k, Index k_stride,
                          const std::uint32_t* q, Index q_stride, Index dim2, float scale,
                          float* st, Index st_stride, float* column_max) {
    if constexpr (R > 0) {
      if (rows == static_cast<Index>(R))
        return scores_block<R, C>(k, k_stride, q, q_stride, dim2, scale, st, st_stride, column_max);
      scores_rows<C, R - 1>(rows, k, k_stride, q, q_stride, dim2, scale, st, st_stride, column_max);
    }
  }

  /// st (keys, width) = scale * k q^T; column_max (width) its column maxima when not null.
  static void scores(const std::uint16_t* k, Index k_stride, Index keys,  // (keys, 2 D2)
                     const std::uint32_t* q, Index q_stride,              // (D2, width)
                     Index dim2, float scale, float* st, Index st_stride, float* column_max) {
    const Index width = q_stride;
    if (column_max != nullptr)
      std::fill(column_max, column_max + width, -std::numeric_limits<float>::infinity());
    constexpr Index block_width = avx512::score_vectors * lanes;
    for (Index j = 0; j < keys; j += avx512::score_rows) {
      const Index rows = std::min(avx512::score_rows, keys - j);
      const std::uint16_t* k_rows = k + j * k_stride;
      float* st_rows = st + j * st_stride;
      Index c0 = 0;
      for (; c0 + block_width <= width; c0 += block_width) {
        scores_rows<static_cast<std::size_t>(avx512::score_vectors)>(
            rows, k_rows, k_stride, q + c0, q_stride, dim2, scale, st_rows + c0, st_stride,
            column_max != nullptr ? column_max + c0 : nullptr);
      }
      for (; c0 < width; c0 += lanes) {
        scores_rows<1>(rows, k_rows, k_stride, q + c0, q_stride, dim2, scale, st_rows + c0,
                       st_stride, column_max != nullptr ? column_max + c0 : nullptr);
      }
    }
  }

  /// ot[e, 0:C lanes) = alpha ot[e, :] + sum_j2 v pairs[j2, e] . p pairs[j2, :] for e < R:
  /// values_block of tile_products.inl on pairs of keys.
  template <std::size_t R, std::size_t C>
  static void values_block(const std::uint32_t* p, Index p_stride,  // (keys2, C lanes)
                           const std::uint32_t* v, Index v_stride,  // (keys2, R)
                           Index keys2, const float* alpha, bool first, float* ot,
                           Index ot_stride) {  // (R, C lanes)
    vec acc[R][C];
    if (first) {
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (std::size_t c = 0; c < C; ++c)
          acc[r][c] = _mm512_setzero_ps();
      }
    } else {
      vec rescale[C];
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c) {
        rescale[c] = alpha != nullptr ? _mm512_loadu_ps(alpha + lanes * static_cast<Index>(c))
                                      : _mm512_set1_ps(1.0f);
      }
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (std::size_t c = 0; c < C; ++c) {
          const float* from =
              ot + static_cast<Index>(r) * ot_stride + lanes * static_cast<Index>(c);
          acc[r][c] = _mm512_mul_ps(rescale[c], _mm512_loadu_ps(from));
        }
      }
    }
#pragma GCC unroll 2
    for (Index j2 = 0; j2 < keys2; ++j2) {
      __m512bh probabilities[C];
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c) {
        probabilities[c] = reinterpret_cast<__m512bh>(
            _mm512_loadu_si512(p + j2 * p_stride + lanes * static_cast<Index>(c)));
      }
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r) {
        const auto value = reinterpret_cast<__m512bh>(
            _mm512_set1_epi32(static_cast<std::int32_t>(v[j2 * v_stride + static_cast<Index>(r)])));
#pragma GCC unroll 4
        for (std::size_t c = 0; c < C; ++c)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], value, probabilities[c]);
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

  /// values_block for `vectors` (1 .. C) vectors of queries and `rows` (1 .. R) value dims.
  template <std::size_t C = static_cast<std::size_t>(bf16_value_vectors),
            std::size_t R = static_cast<std::size_t>(bf16_value_rows)>
  static void values_rows(Index vectors, Index rows, const std::uint32_t* p, Index p_stride,
                          const std::uint32_t* v, Index v_stride, Index keys2, const float* alpha,
                          bool first, float* ot, Index ot_stride) {
    if constexpr (C > 0 && R > 0) {
      if (vectors < static_cast<Index>(C)) {
        return values_rows<C - 1, R>(vectors, rows, p, p_stride, v, v_stride, keys2, alpha, first,
                                     ot, ot_stride);
      }
      if (rows == static_cast<Index>(R))
        return values_block<R, C>(p, p_stride, v, v_stride, keys2, alpha, first, ot, ot_stride);
      values_rows<C, R - 1>(vectors, rows, p, p_stride, v, v_stride, keys2, alpha, first, ot,
                            ot_stride);
    }
  }

  /// ot (Dv, width) = alpha ot + v^T p over keys2 pairs of keys (alpha null: ot = v^T p),
  /// in chunks of avx512::value_keys keys as accumulate of tile_products.inl.
  static void accumulate(const std::uint32_t* p, Index p_stride, Index keys2, Index width,
                         const std::uint32_t* v, Index v_stride, Index value_dim,
                         const float* alpha, float* ot, Index ot_stride) {
    constexpr Index block_width = bf16_value_vectors * lanes;
    constexpr Index chunk_pairs = bf16_value_keys / 2;
    for (Index c0 = 0; c0 < keys2; c0 += chunk_pairs) {
      const Index chunk = std::min(chunk_pairs, keys2 - c0);
      const bool first = alpha == nullptr && c0 == 0;
      const std::uint32_t* p_rows = p + c0 * p_stride;
      const std::uint32_t* v_rows = v + c0 * v_stride;
      for (Index q0 = 0; q0 < width; q0 += block_width) {
        const Index vectors = std::min(bf16_value_vectors, (width - q0) / lanes);
        const float* rescale = c0 == 0 && alpha != nullptr ? alpha + q0 : nullptr;
        for (Index e = 0; e < value_dim; e += bf16_value_rows) {
          values_rows(vectors, std::min(bf16_value_rows, value_dim - e), p_rows + q0, p_stride,
                      v_rows + e, v_stride, chunk, rescale, first, ot + e * ot_stride + q0,
                      ot_stride);
        }
      }
    }
  }
};

/// flash_tile on bf16 products: the avx512 online softmax with Bf16TileProducts.
template <class T, class SK, class SV>
void flash_tile_bf16(const HeadMatrix<const T>& q,  // (rows, D)  queries i0 ..
                     const HeadsView<const SK>& k,  // (B, Hkv, Lk, D)
                     const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv)
                     HeadMatrix<T> out,             // (rows, Dv) written
                     const AttentionProblem<T>& problem, Index b, Index h, Index kv_head, T scale,
                     Index i0, Index key_tile, Workspace<T>& workspace,
                     T* logsumexp) {  // (rows) or null
  avx512::flash_tile_with<T, SK, SV, Bf16TileProducts<SK, SV>>(
      q, k, v, out, problem, b, h, kv_head, scale, i0, key_tile, workspace, logsumexp);
}

}  // namespace attn::detail::avx512_bf16
ATTN_END_TARGET

#endif  // ATTN_X86_DISPATCH
