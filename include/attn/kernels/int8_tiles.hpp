// attn/kernels/int8_tiles.hpp: the flash kernel with q k^T on int8 dot products (AVX512-VNNI),
// for the calls that ask for ComputePrecision::int8: ForwardKernels::flash_tile_int8 of the
// avx512_vnni and avx512_bf16 levels (kernels/dispatch.hpp). Keys stored as half or bfloat16
// are widened and keys in q8_0 or q4_0 blocks dequantized (exactly) as they are read, then
// quantized as float keys are. P V stays in fp32. SageAttention's recipe, per token:
//
//   k̄ = the mean key of the head (over its rows; non-finite values count as 0)
//   each key row k_j - k̄ and each query row q_i, quantized on its own (docs/precision.md):
//     d = amax / 127, q = round(x (127 / amax)) (nearest even), -127..127; a row below 2^-100
//     quantizes to zeros, one holding NaN or infinity gets d = NaN (its scores are NaN)
//   s[j, i] = scale (d_k[j] d_q[i] I[j, i] + q_i . k̄),   I = sum_d q_i,d k_j,d  (int32, exact)
//
// Subtracting k̄ is exact in exact arithmetic (q_i . k̄ is added back in float, so masks,
// softcap and the log-sum-exp see the true scores, not scores shifted per row); it takes the
// component all keys share out of the keys before they are quantized, so that each row's
// steps are those of what distinguishes it. I is exact in float for D <= 1040.
//
// `vpdpbusd acc, a, b` adds to each int32 lane the four products of the unsigned bytes of a
// and the signed bytes of b in the same lane. The queries are the vectors, offset to unsigned:
//
//   query words  (D4, W)   word (d4, i) = bytes q[i, 4 d4 .. 4 d4 + 3] + 128
//   key rows     (Lk, 4 D4) the head's keys, int8, zeros past D; a word of one key is
//                           broadcast against a vector of queries
//
// so the 16 scores of a key against 16 queries come out in one vector, like flash's fp32
// scores (tile_products.inl), and the +128 adds 128 sum_d k_j,d, which the accumulator starts
// at minus (`offsets`). D4 = ceil(D / 4).
//
// The keys of a head are quantized once per thread, when the first query tile of (b, kv head)
// arrives: items run (b, query head)-major, so the tiles of a head, and the query heads of a
// group, follow one another. Extra memory, per thread, beside flash's (kernels/flash.hpp):
// Lk (4 D4 + 8) bytes for the head's keys, scales and offsets, D floats of its mean, a chunk of
// 64 widened key rows, and 4 D4 W bytes plus 2 W floats for the query tile: 1.1 MiB at
// Lk = 8192, D = 128, W = 128.
#pragma once

#include "attn/kernels/simd/target.hpp"

#if ATTN_X86_DISPATCH

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attn/config.hpp"
#include "attn/kernels/int8_decode.hpp"
#include "attn/kernels/online_softmax.hpp"
#include "attn/kernels/simd/avx512.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/problem.hpp"
#include "attn/tensor.hpp"

ATTN_BEGIN_TARGET_AVX512_VNNI
namespace attn::detail::avx512_vnni {

/// The scores' register block: 8 keys x 2 vectors of queries, 16 int32 accumulators. (The
/// fp32 scores' 12 x 2 ran 0.90-0.95x as fast here: GCC moves registers around 24 chains of
/// vpdpbusd, whose accumulator is also its destination.)
inline constexpr Index score_rows = 8;
inline constexpr Index score_vectors = 2;

/// Words of four int8 along a row of `dim` values.
inline Index quad_count(Index dim) {
  return (dim + 3) / 4;
}

/// x[0:dim) quantized by the rule above into out[0:4 D4) (zeros past dim). Returns d (0 for a
/// row below 2^-100, NaN for one holding NaN or infinity, whose values are then zeros) and
/// the sum of the quantized values in *sum.
inline float quantize_row(const float* x, Index dim, std::int8_t* out, std::int32_t* sum) {
  const vec limit = avx512::set1(std::numeric_limits<float>::max());
  vec magnitude = avx512::zero();
  __mmask16 not_finite = 0;
  for (Index d = 0; d < dim; d += lanes) {
    const __mmask16 valid = avx512::first_lanes(std::min(lanes, dim - d));
    const vec a = avx512::absolute(_mm512_maskz_loadu_ps(valid, x + d));
    // (max_ps may drop a NaN, the unordered compare does not)
    not_finite =
        static_cast<__mmask16>(not_finite | _mm512_mask_cmp_ps_mask(valid, a, limit, _CMP_NLE_UQ));
    magnitude = avx512::maximum(magnitude, a);
  }
  const Index bytes = 4 * quad_count(dim);
  const float amax = reduce_max(magnitude);
  if (not_finite != 0 || amax < 0x1p-100f) {
    std::memset(out, 0, static_cast<std::size_t>(bytes));
    *sum = 0;
    return not_finite != 0 ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  }
  const vec inverse = avx512::set1(127.0f / amax);
  __m512i total = _mm512_setzero_si512();
  for (Index d = 0; d < dim; d += lanes) {
    const __mmask16 valid = avx512::first_lanes(std::min(lanes, dim - d));
    // cvtps rounds to nearest even (the default MXCSR mode); |x| 127 / amax <= 127 (1 + u).
    const __m512i q =
        _mm512_maskz_cvtps_epi32(valid, avx512::mul(_mm512_maskz_loadu_ps(valid, x + d), inverse));
    _mm512_mask_cvtepi32_storeu_epi8(out + d, valid, q);
    total = _mm512_add_epi32(total, q);
  }
  std::fill(out + dim, out + bytes, std::int8_t(0));
  // (the sum, at most 127 D in size, is exact in float)
  *sum = static_cast<std::int32_t>(
      avx512::reduce_add(_mm512_maskz_cvtepi32_ps(avx512::all_lanes, total)));
  return amax / 127.0f;
}

/// row(j, x) for each row j of head (b, h) of k, x its D values in float (16-bit keys widened,
/// blocks dequantized and paged rows gathered, `chunk` rows at a time into `buffer`).
template <class SK, class Row>
void for_each_key_row(const HeadsView<const SK>& k,  // (B, Hkv, Lk, D)
                      Index b, Index h, Scratch<float>& buffer, const Row& row) {
  constexpr Index chunk = 64;
  const Index rows = k.rows(b);
  buffer.resize(chunk, k.dim * values_per_unit_v<SK>);
  for (Index j0 = 0; j0 < rows; j0 += chunk) {
    const Index count = std::min(chunk, rows - j0);
    const HeadMatrix<const float> x = avx512::tile_rows<float, SK>(k, b, h, j0, count, buffer);
    for (Index j = 0; j < count; ++j)
      row(j0 + j, x.row(j).data());
  }
}

/// Quantizes the keys of head (b, kv_head) into workspace.int8_head (kept while the calls are
/// for the same head of the same view): their mean, then each row minus the mean.
template <class SK>
void quantize_key_head(const HeadsView<const SK>& k,  // (B, Hkv, Lk, D)
                       Index b, Index kv_head, Workspace<float>& workspace) {
  QuantizedKeyHead& head = workspace.int8_head;
  if (head.source == k.data && head.batch == b && head.head == kv_head)
    return;
  const Index rows = k.rows(b), dim = k.dim * values_per_unit_v<SK>;
  const Index row_bytes = 4 * quad_count(dim);
  const Index dim_padded = (dim + lanes - 1) / lanes * lanes;
  head.keys.resize(rows, row_bytes);
  head.scales.resize(rows);
  head.offsets.resize(rows);
  head.mean.resize(dim_padded);
  head.centered.resize(dim_padded);
  float* mean = head.mean.data();
  std::fill_n(mean, dim_padded, 0.0f);
  const vec limit = avx512::set1(std::numeric_limits<float>::max());
  // The mean: each column summed in row order, finite values only, then divided by the rows.
  for_each_key_row(k, b, kv_head, head.rows, [&](Index /*j*/, const float* x) {
    for (Index d = 0; d < dim; d += lanes) {
      const __mmask16 valid = avx512::first_lanes(std::min(lanes, dim - d));
      const vec value = _mm512_maskz_loadu_ps(valid, x + d);
      const __mmask16 finite =
          _mm512_mask_cmp_ps_mask(valid, avx512::absolute(value), limit, _CMP_LE_OQ);
      const vec sum = _mm512_load_ps(mean + d);
      _mm512_store_ps(mean + d, _mm512_mask_add_ps(sum, finite, sum, value));
    }
  });
  if (rows > 0) {
    const vec count = avx512::set1(static_cast<float>(rows));
    for (Index d = 0; d < dim_padded; d += lanes)
      _mm512_store_ps(mean + d, avx512::divide(_mm512_load_ps(mean + d), count));
  }
  float* centered = head.centered.data();
  for_each_key_row(k, b, kv_head, head.rows, [&](Index j, const float* x) {
    for (Index d = 0; d < dim; d += lanes) {
      const __mmask16 valid = avx512::first_lanes(std::min(lanes, dim - d));
      _mm512_store_ps(centered + d, _mm512_maskz_sub_ps(valid, _mm512_maskz_loadu_ps(valid, x + d),
                                                        _mm512_load_ps(mean + d)));
    }
    std::int32_t sum = 0;
    head.scales.data()[j] = quantize_row(centered, dim, head.keys.data() + j * row_bytes, &sum);
    head.offsets.data()[j] = -128 * sum;
  });
  head.source = k.data;
  head.batch = b;
  head.head = kv_head;
}

/// The flash tile's products with q k^T on int8 dot products (keys quantized per head by
/// quantize_key_head, which flash_tile_int8 runs first) and P V in fp32, for K stored as SK and
/// V as SV, with flash_tile_with's interface (kernels/online_softmax.inl).
template <class SK, class SV>
struct Int8TileProducts {
  /// The query tile quantized row by row: words (D4, width) offset to unsigned, scale d_q
  /// (width) with the call's scale folded in, and scale q . k̄ (width); zeros past q's rows.
  static void pack_query_tile(const HeadMatrix<const float>& q,  // (rows, D)
                              float scale, Index width, Workspace<float>& workspace) {
    const Index rows = q.rows(), dim = q.cols(), quads = quad_count(dim);
    auto* words = workspace.int8_query_words.data();  // (D4, width)
    float* scales = workspace.int8_query_scales.data();
    float* means = workspace.int8_query_means.data();
    std::int8_t* row = workspace.int8_query_row.data();
    const float* mean = workspace.int8_head.mean.data();
    for (Index i = 0; i < rows; ++i) {
      const float* x = q.row(i).data();
      std::int32_t sum = 0;
      scales[i] = scale * quantize_row(x, dim, row, &sum);
      vec dot = avx512::zero();
      for (Index d = 0; d < dim; d += lanes) {
        const __mmask16 valid = avx512::first_lanes(std::min(lanes, dim - d));
        dot = avx512::fmadd(_mm512_maskz_loadu_ps(valid, x + d), _mm512_load_ps(mean + d), dot);
      }
      means[i] = scale * avx512::reduce_add(dot);
      for (Index d4 = 0; d4 < quads; ++d4) {
        std::uint32_t word = 0;
        std::memcpy(&word, row + 4 * d4, sizeof(word));
        words[d4 * width + i] = word ^ 0x80808080u;  // q + 128 in each byte
      }
    }
    for (Index i = rows; i < width; ++i) {
      scales[i] = 0.0f;
      means[i] = 0.0f;
    }
    for (Index d4 = 0; d4 < quads; ++d4)
      std::fill(words + d4 * width + rows, words + (d4 + 1) * width, 0x80808080u);
  }

  /// st (cols, width) = the scores of keys j0 .. j0 + cols against the query tile, and
  /// tile_max (width) their column maxima when not null.
  static void tile_scores(const HeadsView<const SK>& /*k: quantized in workspace.int8_head*/,
                          Index /*b*/, Index /*kv_head*/, Index j0, Index cols, Index dim,
                          Index width, float /*scale: in the query scales*/,
                          Workspace<float>& workspace, float* tile_max) {
    const QuantizedKeyHead& head = workspace.int8_head;
    const Index quads = quad_count(dim), row_bytes = 4 * quads;
    scores(head.keys.data() + j0 * row_bytes, row_bytes, head.scales.data() + j0,
           head.offsets.data() + j0, cols, workspace.int8_query_words.data(), width, quads,
           workspace.int8_query_scales.data(), workspace.int8_query_means.data(),
           workspace.s.data(), width, tile_max);
  }

  /// ot (Dv, width) = alpha ot + v[j0:j0+cols]^T st in fp32 (alpha null: ot = v^T st).
  static void tile_accumulate(const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv)
                              Index b, Index kv_head, Index j0, Index cols, Index width,
                              const float* alpha, Workspace<float>& workspace) {
    avx512::ScalarTileProducts<float, SK, SV>::tile_accumulate(v, b, kv_head, j0, cols, width,
                                                               alpha, workspace);
  }

  /// st[r, 0:C lanes) for keys r < R: int32 sums of R x C vpdpbusd per word of the keys, then
  /// in float d_k d_q I + q . k̄; with `column_max`, also the block's column maxima.
  template <std::size_t R, std::size_t C>
  static void scores_block(const std::int8_t* k, Index k_stride,                  // (R, 4 D4)
                           const float* k_scales, const std::int32_t* k_offsets,  // (R)
                           const std::uint32_t* q, Index q_stride,                // (D4, C lanes)
                           Index quads, const float* q_scales, const float* q_means, float* st,
                           Index st_stride,
                           float* column_max) {  // (C lanes) or null
    __m512i acc[R][C];
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = _mm512_set1_epi32(k_offsets[r]);
    }
#pragma GCC unroll 2
    for (Index d4 = 0; d4 < quads; ++d4) {
      __m512i queries[C];
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        queries[c] = _mm512_loadu_si512(q + d4 * q_stride + lanes * static_cast<Index>(c));
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r) {
        std::int32_t word = 0;
        std::memcpy(&word, k + static_cast<Index>(r) * k_stride + 4 * d4, sizeof(word));
        const __m512i key = _mm512_set1_epi32(word);
#pragma GCC unroll 4
        for (std::size_t c = 0; c < C; ++c)
          acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], queries[c], key);
      }
    }
    vec scores[R][C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) {
      const vec scales = _mm512_loadu_ps(q_scales + lanes * static_cast<Index>(c));
      const vec means = _mm512_loadu_ps(q_means + lanes * static_cast<Index>(c));
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r) {
        const vec products = _mm512_maskz_cvtepi32_ps(lanes32, acc[r][c]);
        scores[r][c] =
            avx512::fmadd(products, avx512::mul(scales, avx512::set1(k_scales[r])), means);
        _mm512_storeu_ps(st + static_cast<Index>(r) * st_stride + lanes * static_cast<Index>(c),
                         scores[r][c]);
      }
    }
    if (column_max != nullptr)
      avx512::update_column_max(scores, column_max);
  }

  /// scores_block for `rows` (1 .. R) keys.
  template <std::size_t C, std::size_t R = static_cast<std::size_t>(score_rows)>
  static void scores_rows(Index rows, const std::int8_t* k, Index k_stride, const float* k_scales,
                          const std::int32_t* k_offsets, const std::uint32_t* q, Index q_stride,
                          Index quads, const float* q_scales, const float* q_means, float* st,
                          Index st_stride, float* column_max) {
    if constexpr (R > 0) {
      if (rows == static_cast<Index>(R)) {
        return scores_block<R, C>(k, k_stride, k_scales, k_offsets, q, q_stride, quads, q_scales,
                                  q_means, st, st_stride, column_max);
      }
      scores_rows<C, R - 1>(rows, k, k_stride, k_scales, k_offsets, q, q_stride, quads, q_scales,
                            q_means, st, st_stride, column_max);
    }
  }

  /// st (keys, width) = the scores of `keys` quantized keys against the query words (D4,
  /// width); column_max (width) their column maxima when not null.
  static void scores(const std::int8_t* k, Index k_stride, const float* k_scales,
                     const std::int32_t* k_offsets, Index keys,  // (keys, 4 D4), (keys)
                     const std::uint32_t* q, Index q_stride,     // (D4, width)
                     Index quads, const float* q_scales, const float* q_means,  // (width)
                     float* st, Index st_stride, float* column_max) {
    const Index width = q_stride;
    if (column_max != nullptr)
      std::fill(column_max, column_max + width, -std::numeric_limits<float>::infinity());
    constexpr Index block_width = score_vectors * lanes;
    for (Index j = 0; j < keys; j += score_rows) {
      const Index rows = std::min(score_rows, keys - j);
      const std::int8_t* k_rows = k + j * k_stride;
      float* st_rows = st + j * st_stride;
      Index c0 = 0;
      for (; c0 + block_width <= width; c0 += block_width) {
        scores_rows<static_cast<std::size_t>(score_vectors)>(
            rows, k_rows, k_stride, k_scales + j, k_offsets + j, q + c0, q_stride, quads,
            q_scales + c0, q_means + c0, st_rows + c0, st_stride,
            column_max != nullptr ? column_max + c0 : nullptr);
      }
      for (; c0 < width; c0 += lanes) {
        scores_rows<1>(rows, k_rows, k_stride, k_scales + j, k_offsets + j, q + c0, q_stride, quads,
                       q_scales + c0, q_means + c0, st_rows + c0, st_stride,
                       column_max != nullptr ? column_max + c0 : nullptr);
      }
    }
  }
};

/// flash_tile on int8 q k^T: the head's keys quantized (once per head per thread), then the
/// avx512 online softmax with Int8TileProducts.
template <class T, class SK, class SV>
void flash_tile_int8(const HeadMatrix<const T>& q,  // (rows, D)  queries i0 ..
                     const HeadsView<const SK>& k,  // (B, Hkv, Lk, D)
                     const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv)
                     HeadMatrix<T> out,             // (rows, Dv) written
                     const AttentionProblem<T>& problem, Index b, Index h, Index kv_head, T scale,
                     Index i0, Index key_tile, Workspace<T>& workspace,
                     T* logsumexp) {  // (rows) or null
  static_assert(std::is_same_v<T, float>);
  quantize_key_head(k, b, kv_head, workspace);
  avx512::flash_tile_with<T, SK, SV, Int8TileProducts<SK, SV>>(
      q, k, v, out, problem, b, h, kv_head, scale, i0, key_tile, workspace, logsumexp);
}

}  // namespace attn::detail::avx512_vnni
ATTN_END_TARGET

#endif  // ATTN_X86_DISPATCH
