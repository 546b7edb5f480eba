// attn/kernels/int8_decode.hpp: decode's scores on int8 dot products (AVX512-VNNI), the
// kernel of the Isa::avx512_vnni level (and of avx512_bf16 above it), whose table
// (kernels/dispatch.hpp) is avx512's with DecodeKernels::decode_split_int8 added. It reads the
// keys of a q8_0 or q4_0 cache as the int8 they are stored as, instead of widening each to
// float, for the calls that ask for ComputePrecision::int8 (docs/precision.md, "int8 products").
//
// The queries are quantized as they enter a split: each row of scale * q, per block of 32
// values, to x ~ d q with d = amax / 127 and q = round(x 127 / amax) (nearest, ties to even),
// -127..127, d kept in float. A score is then
//   s[r, j] = sum_b (d_q[r, b] d_k[j, b]) I[r, j, b],   I = sum_{i in block b} q_i k_i,
// where I, at most 32 * 127 * 127 in size, is exact in int32 and in float, and the sum over
// the D / 32 blocks runs in float (each term one rounding for the product of the scales, one
// for the FMA). A query block whose largest magnitude is below 2^-100 quantizes to zeros; one
// holding NaN or infinity gets a NaN scale, so its row's scores are NaN. Against the scores over
// the dequantized q and k this is a few float ulps; against the unquantized query it adds the
// query's quantization error, which the opt-in accepts.
//
// `vpdpbusd acc, a, b` adds to each int32 lane the four products of unsigned bytes of a and
// signed bytes of b in the same lane. The keys go in a (u8) and the query's four bytes,
// broadcast, in b, with the keys on the lanes: a panel holds 16 keys transposed so that lane
// j of vector (b, g) is bytes 4g .. 4g + 3 of key j's block b. One instruction then does
// four products for each of 16 keys, and the 16 scores of a row come out in one vector: no
// horizontal sums. Unsigned keys: q8_0's k is read as k + 128 (its sign bit flipped), q4_0's
// nibble n as itself (k = n - 8); the difference, 128 sum q or 8 sum q over the block, is a
// per-row, per-block constant `offsets` subtracted by starting the accumulator at it.
//
// Extra memory, per thread, beside decode's (kernels/decode.hpp): R D bytes of queries, R D /
// 32 scales and offsets (4 bytes each), a panel of 16 D bytes and D / 2 floats: 3.5 KiB at
// R = 4, D = 128.
#pragma once

#include "attn/kernels/simd/target.hpp"

#if ATTN_X86_DISPATCH

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attn/config.hpp"
#include "attn/kernels/online_softmax.hpp"
#include "attn/kernels/simd/avx512.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/quantized.hpp"

ATTN_BEGIN_TARGET_AVX512_VNNI
namespace attn::detail::avx512_vnni {

inline constexpr Isa isa = Isa::avx512_vnni;
using avx512::lanes;
using avx512::vec;

/// Keys per panel: one per int32 lane.
inline constexpr Index panel_keys = 16;

// GCC 12's unmasked forms of most intrinsics below trip -Wmaybe-uninitialized in users'
// -Wall builds (bug 105593, as simd/avx512.hpp says): the zero-masked forms with every lane
// set are the same instructions.
inline constexpr __mmask16 lanes32 = 0xffff;  // every 32-bit lane
inline constexpr __mmask8 lanes64 = 0xff;     // every 64-bit lane

/// The largest of the 16 floats of x (none NaN).
inline float reduce_max(vec x) {
  const __m256 halves = _mm256_max_ps(avx512::eight<0>(x), avx512::eight<1>(x));
  const __m128 quarters =
      _mm_max_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
  const __m128 pairs = _mm_max_ps(quarters, _mm_movehl_ps(quarters, quarters));
  return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)));
}

/// Rows of scale * q (rows, dim) quantized per block of 32: int8 values (rows, dim), float
/// scales and int32 offsets (rows, dim / 32). `offset_per_sum` is what the stored keys add
/// per unit of sum q: 128 for q8_0 (k + 128), 8 for q4_0 (n = k + 8). A block holding a
/// non-finite value gets the scale NaN (and zeros), so that its row's scores are NaN.
inline void quantize_queries(const float* q, Index rows, Index dim, std::int32_t offset_per_sum,
                             std::int8_t* values, float* scales, std::int32_t* offsets) {
  const Index blocks = dim / quantized_block_values;
  const vec limit = _mm512_set1_ps(std::numeric_limits<float>::max());
  for (Index r = 0; r < rows; ++r) {
    for (Index b = 0; b < blocks; ++b) {
      const float* x = q + r * dim + b * quantized_block_values;
      const vec x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + lanes);
      const vec magnitude = avx512::maximum(avx512::absolute(x0), avx512::absolute(x1));
      // Not <= max: NaN or infinity somewhere (max_ps may drop a NaN, the compare does not:
      // both operands are checked).
      const bool finite =
          _mm512_cmp_ps_mask(avx512::absolute(x0), limit, _CMP_LE_OQ) == avx512::all_lanes &&
          _mm512_cmp_ps_mask(avx512::absolute(x1), limit, _CMP_LE_OQ) == avx512::all_lanes;
      const float amax = reduce_max(magnitude);
      std::int8_t* out = values + r * dim + b * quantized_block_values;
      const Index at = r * blocks + b;
      // Blocks below 2^-100 (127 / amax would overflow near the subnormals) count as zeros.
      if (!finite || amax < 0x1p-100f) {
        std::memset(out, 0, quantized_block_values);
        scales[at] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
        offsets[at] = 0;
        continue;
      }
      const vec inverse = _mm512_set1_ps(127.0f / amax);
      // cvtps rounds to nearest even (the default MXCSR mode); |x| 127 / amax <= 127 (1 + u).
      const __m512i q0 = _mm512_maskz_cvtps_epi32(lanes32, _mm512_mul_ps(x0, inverse));
      const __m512i q1 = _mm512_maskz_cvtps_epi32(lanes32, _mm512_mul_ps(x1, inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_maskz_cvtepi32_epi8(lanes32, q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + lanes),
                       _mm512_maskz_cvtepi32_epi8(lanes32, q1));
      scales[at] = amax / 127.0f;
      // (the sum, at most 32 * 127 in size, is exact in float)
      const float sum =
          avx512::reduce_add(_mm512_maskz_cvtepi32_ps(lanes32, _mm512_add_epi32(q0, q1)));
      offsets[at] = -offset_per_sum * static_cast<std::int32_t>(sum);
    }
  }
}

/// The first `keys` (<= 16) rows of q8_0 keys, `stride` blocks apart, as a panel: for each
/// block b, 8 vectors, vector (b, g) holding bytes 4g .. 4g + 3 of each key's block b (plus
/// 128: the sign bit flipped) in its lane j; missing keys read a zero block.
inline void pack_panel(const BlockQ8_0* k, Index stride, Index keys, Index blocks,
                       std::uint8_t* panel) {
  static const BlockQ8_0 zero_block{};
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (Index b = 0; b < blocks; ++b) {
    const auto row = [&](Index j) {
      return reinterpret_cast<const __m256i*>(j < keys ? k[j * stride + b].values
                                                       : zero_block.values);
    };
    // z[j] = rows j | j + 4 and z[4 + j] = rows 8 + j | 12 + j (256 bits each), so that the
    // 4 x 4 transposes below and one shuffle of 128-bit lanes leave the keys in order.
    // (The pragmas unroll what -O3 would: GCC's -O2 keeps these loops rolled and z and u in
    // memory, docs/performance.md, "Tuning choices".)
    __m512i z[8];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      z[j] = _mm512_maskz_inserti64x4(lanes64, _mm512_castsi256_si512(_mm256_loadu_si256(row(j))),
                                      _mm256_loadu_si256(row(j + 4)), 1);
      z[4 + j] =
          _mm512_maskz_inserti64x4(lanes64, _mm512_castsi256_si512(_mm256_loadu_si256(row(8 + j))),
                                   _mm256_loadu_si256(row(12 + j)), 1);
    }
    __m512i u[2][4];  // u[h][c], 128-bit lane l: word 4 (l % 2) + c of four keys
#pragma GCC unroll 4
    for (std::size_t h = 0; h < 2; ++h) {
      const __m512i a0 = _mm512_maskz_unpacklo_epi32(lanes32, z[4 * h], z[4 * h + 1]);
      const __m512i a1 = _mm512_maskz_unpackhi_epi32(lanes32, z[4 * h], z[4 * h + 1]);
      const __m512i a2 = _mm512_maskz_unpacklo_epi32(lanes32, z[4 * h + 2], z[4 * h + 3]);
      const __m512i a3 = _mm512_maskz_unpackhi_epi32(lanes32, z[4 * h + 2], z[4 * h + 3]);
      u[h][0] = _mm512_maskz_unpacklo_epi64(lanes64, a0, a2);
      u[h][1] = _mm512_maskz_unpackhi_epi64(lanes64, a0, a2);
      u[h][2] = _mm512_maskz_unpacklo_epi64(lanes64, a1, a3);
      u[h][3] = _mm512_maskz_unpackhi_epi64(lanes64, a1, a3);
    }
    auto* out = reinterpret_cast<__m512i*>(panel) + b * 8;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      _mm512_store_si512(out + c,
                         _mm512_xor_si512(_mm512_maskz_shuffle_i32x4(lanes32, u[0][c], u[1][c],
                                                                     _MM_SHUFFLE(2, 0, 2, 0)),
                                          sign));
      _mm512_store_si512(out + 4 + c,
                         _mm512_xor_si512(_mm512_maskz_shuffle_i32x4(lanes32, u[0][c], u[1][c],
                                                                     _MM_SHUFFLE(3, 1, 3, 1)),
                                          sign));
    }
  }
}

/// The same for q4_0 keys: the nibbles n = k + 8 as bytes 0 .. 15 (elements 4g .. 4g + 3 in
/// vector g < 4 from the low nibbles, elements 16 + 4g .. in vector 4 + g from the high ones).
inline void pack_panel(const BlockQ4_0* k, Index stride, Index keys, Index blocks,
                       std::uint8_t* panel) {
  static const BlockQ4_0 zero_block{};
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (Index b = 0; b < blocks; ++b) {
    const auto row = [&](Index j) {
      return reinterpret_cast<const __m128i*>(j < keys ? k[j * stride + b].nibbles
                                                       : zero_block.nibbles);
    };
    __m512i z[4];  // z[j], 128-bit lane l: key j + 4 l (the pragmas: as in the q8_0 panel)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i x = _mm512_castsi128_si512(_mm_loadu_si128(row(j)));
      x = _mm512_maskz_inserti32x4(lanes32, x, _mm_loadu_si128(row(j + 4)), 1);
      x = _mm512_maskz_inserti32x4(lanes32, x, _mm_loadu_si128(row(j + 8)), 2);
      z[j] = _mm512_maskz_inserti32x4(lanes32, x, _mm_loadu_si128(row(j + 12)), 3);
    }
    const __m512i a0 = _mm512_maskz_unpacklo_epi32(lanes32, z[0], z[1]);
    const __m512i a1 = _mm512_maskz_unpackhi_epi32(lanes32, z[0], z[1]);
    const __m512i a2 = _mm512_maskz_unpacklo_epi32(lanes32, z[2], z[3]);
    const __m512i a3 = _mm512_maskz_unpackhi_epi32(lanes32, z[2], z[3]);
    const __m512i words[4] = {
        _mm512_maskz_unpacklo_epi64(lanes64, a0, a2), _mm512_maskz_unpackhi_epi64(lanes64, a0, a2),
        _mm512_maskz_unpacklo_epi64(lanes64, a1, a3), _mm512_maskz_unpackhi_epi64(lanes64, a1, a3)};
    auto* out = reinterpret_cast<__m512i*>(panel) + b * 8;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      _mm512_store_si512(out + c, _mm512_and_si512(words[c], low));
      _mm512_store_si512(out + 4 + c, _mm512_and_si512(_mm512_srli_epi16(words[c], 4), low));
    }
  }
}

/// s[r, 0:keys) for rows r < Rb of the quantized queries against a panel: per block, the
/// int32 sums of 8 vpdpbusd (two chains, so that the adds overlap), then in float, block by
/// block, s += (d_q d_k) I.
template <int Rb>
inline void panel_scores(const std::int8_t* q, Index dim,                       // (Rb, D)
                         const float* q_scales, const std::int32_t* q_offsets,  // (Rb, D / 32)
                         const std::uint8_t* panel, const float* k_scales,      // (D / 32, 16)
                         Index keys, float* s, Index s_stride) {
  const Index blocks = dim / quantized_block_values;
  vec out[static_cast<std::size_t>(Rb)];
#pragma GCC unroll 4
  for (int r = 0; r < Rb; ++r)
    out[r] = avx512::zero();
  for (Index b = 0; b < blocks; ++b) {
    __m512i sums[static_cast<std::size_t>(Rb)][2];
#pragma GCC unroll 4
    for (int r = 0; r < Rb; ++r) {
      sums[r][0] = _mm512_set1_epi32(q_offsets[r * blocks + b]);
      sums[r][1] = _mm512_setzero_si512();
    }
    const auto* vectors = reinterpret_cast<const __m512i*>(panel) + b * 8;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i key_bytes = _mm512_load_si512(vectors + g);
#pragma GCC unroll 4
      for (int r = 0; r < Rb; ++r) {
        std::int32_t word = 0;
        std::memcpy(&word, q + r * dim + b * quantized_block_values + Index{4} * g, sizeof(word));
        sums[r][g & 1] = _mm512_dpbusd_epi32(sums[r][g & 1], key_bytes, _mm512_set1_epi32(word));
      }
    }
    const vec scales = _mm512_load_ps(k_scales + b * lanes);
#pragma GCC unroll 4
    for (int r = 0; r < Rb; ++r) {
      const vec total = _mm512_maskz_cvtepi32_ps(lanes32, _mm512_add_epi32(sums[r][0], sums[r][1]));
      out[r] =
          avx512::fmadd(total, avx512::mul(scales, avx512::set1(q_scales[r * blocks + b])), out[r]);
    }
  }
  const __mmask16 stored = avx512::first_lanes(keys);
#pragma GCC unroll 4
  for (int r = 0; r < Rb; ++r)
    _mm512_mask_storeu_ps(s + r * s_stride, stored, out[r]);
}

/// decode_split_with's KeyScores on int8 products, for keys stored as q8_0 or q4_0 blocks.
template <class Block>
struct Int8KeyScores {
  static_assert(is_quantized_v<Block>);
  static constexpr std::int32_t offset_per_sum = std::is_same_v<Block, BlockQ8_0> ? 128 : 8;

  static void prepare(const float* q_tile, Index rows, Index dim,  // (rows, D)
                      Workspace<float>& workspace) {
    workspace.reserve_int8(rows, dim);
    quantize_queries(q_tile, rows, dim, offset_per_sum, workspace.int8_q.data(),
                     workspace.int8_scales.data(), workspace.int8_offsets.data());
  }

  static void scores(const float* /*q_tile*/, Index rows, const Block* k_rows, Index k_stride,
                     Index cols,                           // (cols, D / 32)
                     Index dim, float* s, Index s_stride,  // (rows, cols)
                     const Block* ahead, const Block* far, Workspace<float>& workspace) {
    const Index blocks = dim / quantized_block_values;
    const std::int8_t* q = workspace.int8_q.data();
    const float* q_scales = workspace.int8_scales.data();
    const std::int32_t* q_offsets = workspace.int8_offsets.data();
    std::uint8_t* panel = workspace.int8_keys.data();
    float* k_scales = workspace.int8_key_scales.data();
    for (Index j0 = 0; j0 < cols; j0 += panel_keys) {
      const Index keys = std::min(panel_keys, cols - j0);
      const Block* k = k_rows + j0 * k_stride;
      // The lines of the next block's rows into L1, once each, while these are read
      // (decode_products.inl's distance), and those `far` on into L2 (far_rows).
      const auto first_line =
          reinterpret_cast<std::uintptr_t>(ahead + j0 * k_stride) & ~std::uintptr_t{63};
      const auto end = reinterpret_cast<std::uintptr_t>(ahead + (j0 + keys) * k_stride);
      const std::uintptr_t far_offset = far != nullptr ? reinterpret_cast<std::uintptr_t>(far) -
                                                             reinterpret_cast<std::uintptr_t>(ahead)
                                                       : 0;
      for (std::uintptr_t line = first_line; line < end; line += 64) {
        avx512::prefetch_to_l1(line);
        if (far != nullptr)
          avx512::prefetch(line + far_offset);
      }
      pack_panel(k, k_stride, keys, blocks, panel);
      avx512::block_scales(k, k_stride, keys, blocks, k_scales, lanes);
      float* out = s + j0;
      Index r = 0;
      for (; r + 4 <= rows; r += 4)
        panel_scores<4>(q + r * dim, dim, q_scales + r * blocks, q_offsets + r * blocks, panel,
                        k_scales, keys, out + r * s_stride, s_stride);
      const auto rest = [&](auto count) {
        panel_scores<decltype(count)::value>(q + r * dim, dim, q_scales + r * blocks,
                                             q_offsets + r * blocks, panel, k_scales, keys,
                                             out + r * s_stride, s_stride);
      };
      switch (rows - r) {
        case 3:
          rest(std::integral_constant<int, 3>{});
          break;
        case 2:
          rest(std::integral_constant<int, 2>{});
          break;
        case 1:
          rest(std::integral_constant<int, 1>{});
          break;
        default:
          break;
      }
    }
  }
};

/// decode_split (kernels/online_softmax.inl) with the scores on int8 products: keys stored as
/// q8_0 or q4_0, values as anything decode reads.
template <class T, class SK, class SV>
void decode_split_int8(const HeadsView<const T>& q,   // (B, Hq, Lq, D)
                       const HeadsView<const SK>& k,  // (B, Hkv, Lk, D / 32)
                       const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv / values_per_unit_v<SV>)
                       const AttentionProblem<T>& problem, T scale, Index b, Index kv_head,
                       Index j0, Index j1, Index key_block, Workspace<T>& workspace,
                       T* partial) {  // m (R), l (R), acc (R, Dv)
  static_assert(std::is_same_v<T, float> && is_quantized_v<SK>);
  avx512::decode_split_with<T, SK, SV, Int8KeyScores<SK>>(q, k, v, problem, scale, b, kv_head, j0,
                                                          j1, key_block, workspace, partial);
}

}  // namespace attn::detail::avx512_vnni
ATTN_END_TARGET

#endif  // ATTN_X86_DISPATCH
