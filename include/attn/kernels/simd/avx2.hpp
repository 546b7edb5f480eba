// attn/kernels/simd/avx2.hpp: the vector primitives of AVX2 + FMA + F16C (8 floats per
// __m256) and its register-block sizes, in namespace attn::detail::avx2 inside its target
// region, whatever flags the translation unit is built with.
//
// The kernels are written once, on these primitives (tile_products.inl, gemm_micro.inl,
// rope.inl), and compiled for each instruction set by simd/foreach_isa.hpp. Every primitive
// gives the same bits as its AVX-512 namesake.
#pragma once

#include "attn/kernels/simd/target.hpp"

#if ATTN_X86_DISPATCH

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/dropout.hpp"

ATTN_BEGIN_TARGET_AVX2
namespace attn::detail::avx2 {

inline constexpr Isa isa = Isa::avx2;
/// The decode products read 16-bit k and v themselves, widening them in registers.
inline constexpr bool widens_in_registers = true;
inline constexpr Index lanes = 8;  // floats per vector
using vec = __m256;
using ivec = __m256i;

// Register blocks (16 ymm registers):
//   flash scores    6 keys x 2 vectors of queries: 12 accumulators
//   flash values    4 value dims x 3 vectors of queries: 12 accumulators
//   decode scores   2 rows x 4 keys of dot products: 8 accumulators (4 x 2 for quantized K)
//   decode values   2 rows x 4 vectors of value dims: 8 accumulators
//   gemm            6 rows x 2 vectors (16 columns): 12 accumulators
inline constexpr Index score_rows = 6;
inline constexpr Index score_vectors = 2;
inline constexpr Index value_rows = 4;
inline constexpr Index value_vectors = 3;
inline constexpr Index decode_rows = 2;
inline constexpr Index decode_vectors = 4;
/// Query rows per pass of decode's scores over K. Quantized keys take 4 rows x 2 keys: each
/// block is widened once for 4 rows (2 x 4 widened it twice for GQA 32/8, and spilled the
/// accumulators beside four keys' scales). Callgrind, q4_0 at GQA 32/8: 21% fewer instructions.
constexpr int decode_score_rows(bool quantized) {
  return quantized ? 4 : static_cast<int>(decode_rows);
}
/// Keys per register block of decode's scores for `rows` rows.
constexpr int decode_block_keys(int rows) {
  return rows > 2 ? 2 : 4;
}
inline constexpr Index gemm_rows = 6;
inline constexpr Index gemm_vectors = 2;
/// Rows of a packed per GEMM block (kernels/gemm.hpp): mc x kc of a stays in L2.
inline constexpr Index gemm_block_rows = 144;

inline vec zero() {
  return _mm256_setzero_ps();
}
inline vec set1(float x) {
  return _mm256_set1_ps(x);
}
inline vec load(const float* p) {
  return _mm256_loadu_ps(p);
}
inline void store(float* p, vec x) {
  _mm256_storeu_ps(p, x);
}
inline vec add(vec a, vec b) {
  return _mm256_add_ps(a, b);
}
inline vec mul(vec a, vec b) {
  return _mm256_mul_ps(a, b);
}
/// a * b + c, one rounding.
inline vec fmadd(vec a, vec b, vec c) {
  return _mm256_fmadd_ps(a, b, c);
}
/// max(a, b); b when either is NaN.
inline vec maximum(vec a, vec b) {
  return _mm256_max_ps(a, b);
}

/// All-ones in lanes [0, n), n < lanes.
inline ivec first_lanes(Index n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/// p[0:n) and zeros, n < lanes.
inline vec load_first(const float* p, Index n) {
  return _mm256_maskload_ps(p, first_lanes(n));
}
/// p[0:n) = x[0:n), n < lanes.
inline void store_first(float* p, vec x, Index n) {
  _mm256_maskstore_ps(p, first_lanes(n), x);
}

inline float reduce_add(vec x) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

/// out[0:4) = [sum a, sum b, sum c, sum d].
/// 8 int8 widened to float (q8_0's quants).
inline vec load_int8_widened(const std::int8_t* src) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
/// Vector i < 4 of a q4_0 block as float n - 8, from its 16 bytes of nibbles (elements 0..15
/// in the low nibbles, 16..31 in the high ones). With i a constant (unrolled loops), a block's
/// four vectors share one load, and each half its unpacking.
inline vec load_nibbles_centered(const std::uint8_t* nibbles, int i) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles));
  const __m128i n = i < 2 ? _mm_and_si128(bytes, _mm_set1_epi8(15))
                          : _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
  const __m128i centered = _mm_sub_epi8(n, _mm_set1_epi8(8));
  const __m128i eight = i % 2 == 0 ? centered : _mm_unpackhi_epi64(centered, centered);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
}
/// An fp16 value (a block's scale) as float, in one conversion instruction.
inline float half_to_float(Eigen::half x) {
  return _cvtsh_ss(x.x);
}
/// out[b, j] = the fp16 scale of block b of row j as float, for rows j < count of quantized
/// blocks `stride` blocks apart and b < blocks (out (blocks, out_stride); 0 from count up to
/// a whole vector): one conversion each (a gather is not measured on an AVX2 CPU).
template <class Block>
inline void block_scales(const Block* rows, Index stride, Index count, Index blocks, float* out,
                         Index out_stride) {
  for (Index j = 0; j < count; ++j) {
    for (Index b = 0; b < blocks; ++b)
      out[b * out_stride + j] = half_to_float(rows[j * stride + b].scale);
  }
  for (Index j = count; j < (count + lanes - 1) / lanes * lanes; ++j) {
    for (Index b = 0; b < blocks; ++b)
      out[b * out_stride + j] = 0.0f;
  }
}

inline void sum_each4(vec a, vec b, vec c, vec d, float* out) {
  // [a01 a23 b01 b23 | a45 a67 b45 b67], the same for c, d; then [a b c d | a b c d] partials
  const vec abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

/// src[0:8) widened to float.
inline vec load_widened(const float* src) {
  return _mm256_loadu_ps(src);
}
inline vec load_widened(const Eigen::half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
/// bfloat16 is the upper half of a float's bits: widening is a 16-bit shift.
inline vec load_widened(const Eigen::bfloat16* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/// a * b - c, one rounding.
inline vec fmsub(vec a, vec b, vec c) {
  return _mm256_fmsub_ps(a, b, c);
}
/// a * b - c in the even lanes, a * b + c in the odd ones (one rounding each).
inline vec fmaddsub(vec a, vec b, vec c) {
  return _mm256_fmaddsub_ps(a, b, c);
}
/// [x1, x0, x3, x2, ...]: the two floats of every pair swapped.
inline vec swap_pairs(vec x) {
  return _mm256_permute_ps(x, 0xb1);
}
/// [p0, p0, p1, p1, p2, p2, p3, p3]: lanes / 2 floats, each twice.
inline vec load_pairs(const float* p) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)),
                                  _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

/// dst[0:8) = x, rounded to the nearest (ties to even) storage value: the same bits as
/// Eigen's scalar conversions, NaN included for bfloat16 (0x7fc0 with the sign).
inline void store_narrowed(float* dst, vec x) {
  _mm256_storeu_ps(dst, x);
}
inline void store_narrowed(Eigen::half* dst, vec x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store_narrowed(Eigen::bfloat16* dst, vec x) {
  const ivec bits = _mm256_castps_si256(x);
  const ivec high = _mm256_srli_epi32(bits, 16);
  const ivec bias =
      _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
  const ivec rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const ivec quiet_nan =
      _mm256_or_si256(_mm256_and_si256(high, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc0));
  const ivec nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const ivec result = _mm256_blendv_epi8(rounded, quiet_nan, nan);
  // 32 to 16 bits (every value fits): packus works per 128-bit half, so gather the halves
  const ivec packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(result, result), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

/// [base[0], base[stride], ..., base[7 stride]]; stride * 8 must fit in 32 bits.
inline vec gather_strided(const float* base, Index stride) {
  const ivec offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(static_cast<int>(stride)));
  return _mm256_i32gather_ps(base, offsets, 4);
}

inline ivec load_indices(const std::int32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

/// score, or -inf in the lanes where key j lies outside [first, last).
inline vec hide_outside(vec score, std::int32_t j, ivec first, ivec last) {
  const ivec key = _mm256_set1_epi32(j);
  // visible: first <= j (not first > j) and j < last
  const ivec visible =
      _mm256_andnot_si256(_mm256_cmpgt_epi32(first, key), _mm256_cmpgt_epi32(last, key));
  return _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), score,
                          _mm256_castsi256_ps(visible));
}

/// exp(x - shift) for x <= shift (or NaN), the same bits as avx512::exp_shifted: the same
/// reduction and polynomial, 2^n built in the exponent field instead of by scalef (n lies in
/// [-126, 0] wherever d >= -87, so 2^n and the product are normal), lanes below -87 and -inf
/// zeroed by a mask (no subnormal is ever produced).
inline vec exp_shifted(vec x, vec shift) {
  const vec d = _mm256_sub_ps(x, shift);
  const vec normal = _mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ);  // NaN kept
  const vec n = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), d);  // ln 2, high part: exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);   // ln 2, low part
  vec p = _mm256_set1_ps(1.383683993e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.374815807e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166822508e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666641980e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.999999106e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const ivec power = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(power)), normal);
}

/// a / b, correctly rounded.
inline vec divide(vec a, vec b) {
  return _mm256_div_ps(a, b);
}
/// |x| (the sign bit cleared).
inline vec absolute(vec x) {
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
}

/// [start, start + step, ..., start + 7 step] (mod 2^32).
inline ivec counters(std::uint32_t start, std::uint32_t step) {
  const ivec lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(start)),
                          _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(step))));
}
/// MurmurHash3's fmix32 in every lane (Dropout::mix32).
inline ivec mix32(ivec x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
/// value in the lanes where x >= threshold (unsigned: max(x, threshold) == x), 0 elsewhere.
inline vec where_at_least(ivec x, std::uint32_t threshold, vec value) {
  const ivec at_least =
      _mm256_cmpeq_epi32(_mm256_max_epu32(x, _mm256_set1_epi32(static_cast<int>(threshold))), x);
  return _mm256_and_ps(_mm256_castsi256_ps(at_least), value);
}

/// Requests the cache line at `address` into L2: a hint, which never faults. L2, not L1
/// (T1, not T0), as on AVX-512 (simd/avx512.hpp says why).
inline void prefetch(std::uintptr_t address) {
  // An integer, because the address may lie past the data, where a pointer may not point.
  _mm_prefetch(reinterpret_cast<const char*>(address),  // NOLINT(performance-no-int-to-ptr)
               _MM_HINT_T1);
}

/// The same into L1 (T0): the quantized readers, which spend more instructions per byte
/// read, measured no gain from L2 prefetches (slightly slower with grouped-query heads).
inline void prefetch_to_l1(std::uintptr_t address) {
  _mm_prefetch(reinterpret_cast<const char*>(address),  // NOLINT(performance-no-int-to-ptr)
               _MM_HINT_T0);
}

}  // namespace attn::detail::avx2
ATTN_END_TARGET

#endif  // ATTN_X86_DISPATCH
