// attn/kernels/simd/avx512.hpp: the vector primitives of AVX-512F (16 floats per __m512) and
// its register-block sizes, in namespace attn::detail::avx512 inside its target region,
// whatever flags the translation unit is built with.
//
// The kernels are written once, on these primitives (tile_products.inl, gemm_micro.inl,
// rope.inl), and compiled for each instruction set by simd/foreach_isa.hpp.
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

ATTN_BEGIN_TARGET_AVX512
namespace attn::detail::avx512 {

inline constexpr Isa isa = Isa::avx512;
/// The decode products read 16-bit k and v themselves, widening them in registers.
inline constexpr bool widens_in_registers = true;
inline constexpr Index lanes = 16;  // floats per vector
using vec = __m512;
using ivec = __m512i;

// Register blocks (32 zmm registers):
//   flash scores   12 keys x 2 vectors of queries: 24 accumulators
//   flash values    8 value dims x 3 vectors of queries: 24 accumulators
//   decode scores   4 rows x 4 keys of dot products: 16 accumulators
//   decode values   4 rows x 4 vectors of value dims: 16 accumulators
//   gemm            14 rows x 2 vectors (32 columns): 28 accumulators
inline constexpr Index score_rows = 12;
inline constexpr Index score_vectors = 2;
inline constexpr Index value_rows = 8;
inline constexpr Index value_vectors = 3;
inline constexpr Index decode_rows = 4;
inline constexpr Index decode_vectors = 4;
/// Query rows per pass of decode's scores over K (every format), and keys per register block.
constexpr int decode_score_rows(bool /*quantized*/) {
  return static_cast<int>(decode_rows);
}
constexpr int decode_block_keys(int /*rows*/) {
  return 4;
}
inline constexpr Index gemm_rows = 14;
inline constexpr Index gemm_vectors = 2;
/// Rows of a packed per GEMM block (kernels/gemm.hpp): mc x kc of a stays in L2.
inline constexpr Index gemm_block_rows = 112;

inline vec zero() {
  return _mm512_setzero_ps();
}
inline vec set1(float x) {
  return _mm512_set1_ps(x);
}
inline vec load(const float* p) {
  return _mm512_loadu_ps(p);
}
inline void store(float* p, vec x) {
  _mm512_storeu_ps(p, x);
}
inline vec add(vec a, vec b) {
  return _mm512_add_ps(a, b);
}
inline vec mul(vec a, vec b) {
  return _mm512_mul_ps(a, b);
}
/// a * b + c, one rounding.
inline vec fmadd(vec a, vec b, vec c) {
  return _mm512_fmadd_ps(a, b, c);
}
// GCC 12's unmasked AVX-512 intrinsics pass _mm512_undefined_ps() (`__m512 __Y = __Y;`) as
// the merge source, which trips -Wmaybe-uninitialized in every user's -Wall build once
// inlined (GCC bug 105593). The primitives below use the zero-masked forms with a full mask
// instead: the same instruction, no warning.
inline constexpr __mmask16 all_lanes = 0xffff;

/// max(a, b); b when either is NaN (so NaN scores may or may not enter a running max: they
/// reach the output through their probabilities either way).
inline vec maximum(vec a, vec b) {
  return _mm512_maskz_max_ps(all_lanes, a, b);
}

inline __mmask16 first_lanes(Index n) {
  return static_cast<__mmask16>((1u << static_cast<unsigned>(n)) - 1u);
}
/// p[0:n) and zeros, n < lanes.
inline vec load_first(const float* p, Index n) {
  return _mm512_maskz_loadu_ps(first_lanes(n), p);
}
/// p[0:n) = x[0:n), n < lanes.
inline void store_first(float* p, vec x, Index n) {
  _mm512_mask_storeu_ps(p, first_lanes(n), x);
}

/// The lower (0) or upper (1) eight floats of x.
template <int half>
inline __m256 eight(vec x) {
  return _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, _mm512_castps_pd(x), half));
}

inline float reduce_add(vec x) {
  const __m256 halves = _mm256_add_ps(eight<0>(x), eight<1>(x));
  const __m128 quarters =
      _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
  const __m128 pairs = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

/// out[0:4) = [sum a, sum b, sum c, sum d]: one transpose-and-add tree for four dot products.
/// 16 int8 widened to float (q8_0's quants).
inline vec load_int8_widened(const std::int8_t* src) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm512_maskz_cvtepi32_ps(all_lanes, _mm512_maskz_cvtepi8_epi32(all_lanes, bytes));
}
/// The low nibbles n of src[0:16) as float n - 8 (q4_0's elements 0..15): one permute looks
/// each up in a table of -8 .. 7, and it reads only an index's low 4 bits (no mask needed).
inline vec load_low_nibbles_centered(const std::uint8_t* src) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const vec centered = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return _mm512_maskz_permutexvar_ps(all_lanes, _mm512_maskz_cvtepu8_epi32(all_lanes, bytes),
                                     centered);
}
/// The high nibbles n of src[0:16) as float n - 8 (q4_0's elements 16..31).
inline vec load_high_nibbles_centered(const std::uint8_t* src) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const vec centered = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i nibbles =
      _mm512_maskz_srli_epi32(all_lanes, _mm512_maskz_cvtepu8_epi32(all_lanes, bytes), 4);
  return _mm512_maskz_permutexvar_ps(all_lanes, nibbles, centered);
}
/// Vector i < 2 of a q4_0 block as float n - 8, from its 16 bytes of nibbles: elements 0..15
/// (low nibbles) or 16..31 (high nibbles).
inline vec load_nibbles_centered(const std::uint8_t* nibbles, int i) {
  return i == 0 ? load_low_nibbles_centered(nibbles) : load_high_nibbles_centered(nibbles);
}
/// An fp16 value (a block's scale) as float, in one conversion instruction.
inline float half_to_float(Eigen::half x) {
  return _cvtsh_ss(x.x);
}
// Without optimisation GCC implements the intrinsics that take an immediate (the gathers
// too) as macros, which pass their __mmask16 to a builtin taking a signed short:
// -Wsign-conversion would fire at -O0 in the user's code for a conversion that is GCC's own.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion"
#endif

/// out[b, j] = the fp16 scale of block b of row j as float, for rows j < count of quantized
/// blocks `stride` blocks apart and b < blocks (out (blocks, out_stride); 0 from count up to
/// a whole vector): one gather per vector of rows, of the 4 bytes at each block's start (its
/// scale and 2 bytes of its values), instead of 16 scalar conversions.
template <class Block>
inline void block_scales(const Block* rows, Index stride, Index count, Index blocks, float* out,
                         Index out_stride) {
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(stride * static_cast<Index>(sizeof(Block)))));
  for (Index b = 0; b < blocks; ++b) {
    for (Index j = 0; j < count; j += lanes) {
      const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(),
                                                        first_lanes(std::min(lanes, count - j)),
                                                        offsets, rows + j * stride + b, 1);
      _mm512_storeu_ps(
          out + b * out_stride + j,
          _mm512_maskz_cvtph_ps(all_lanes, _mm512_maskz_cvtepi32_epi16(all_lanes, words)));
    }
  }
}

inline void sum_each4(vec a, vec b, vec c, vec d, float* out) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
  const vec ab = _mm512_add_ps(_mm512_maskz_unpacklo_ps(all_lanes, a, b),
                               _mm512_maskz_unpackhi_ps(all_lanes, a, b));
  const vec cd = _mm512_add_ps(_mm512_maskz_unpacklo_ps(all_lanes, c, d),
                               _mm512_maskz_unpackhi_ps(all_lanes, c, d));
  // per 128-bit lane: [a, b, c, d] partial sums
  const __m512d ab2 = _mm512_castps_pd(ab), cd2 = _mm512_castps_pd(cd);
  const vec abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xff, ab2, cd2)),
                                 _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xff, ab2, cd2)));
  const __m256 halves = _mm256_add_ps(eight<0>(abcd), eight<1>(abcd));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1)));
}

/// src[0:16) widened to float.
inline vec load_widened(const float* src) {
  return _mm512_loadu_ps(src);
}
inline vec load_widened(const Eigen::half* src) {
  return _mm512_maskz_cvtph_ps(all_lanes,
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
/// bfloat16 is the upper half of a float's bits: widening is a 16-bit shift.
inline vec load_widened(const Eigen::bfloat16* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(all_lanes, _mm512_maskz_cvtepu16_epi32(all_lanes, bits), 16));
}

/// a * b - c, one rounding.
inline vec fmsub(vec a, vec b, vec c) {
  return _mm512_fmsub_ps(a, b, c);
}
/// a / b, correctly rounded.
inline vec divide(vec a, vec b) {
  return _mm512_div_ps(a, b);
}
/// |x| (the sign bit cleared).
inline vec absolute(vec x) {
  return _mm512_abs_ps(x);
}
/// a * b - c in the even lanes, a * b + c in the odd ones (one rounding each).
inline vec fmaddsub(vec a, vec b, vec c) {
  return _mm512_fmaddsub_ps(a, b, c);
}
/// [x1, x0, x3, x2, ...]: the two floats of every pair swapped.
inline vec swap_pairs(vec x) {
  return _mm512_maskz_permute_ps(all_lanes, x, 0xb1);
}
/// [p0, p0, p1, p1, ..., p7, p7]: lanes / 2 floats, each twice.
inline vec load_pairs(const float* p) {
  const ivec twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  return _mm512_maskz_permutexvar_ps(all_lanes, twice, _mm512_maskz_loadu_ps(0xff, p));
}

/// dst[0:16) = x, rounded to the nearest (ties to even) storage value: the same bits as
/// Eigen's scalar conversions, NaN included for bfloat16 (0x7fc0 with the sign).
inline void store_narrowed(float* dst, vec x) {
  _mm512_storeu_ps(dst, x);
}
inline void store_narrowed(Eigen::half* dst, vec x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_maskz_cvtps_ph(all_lanes, x, _MM_FROUND_TO_NEAREST_INT));
}
inline void store_narrowed(Eigen::bfloat16* dst, vec x) {
  const ivec bits = _mm512_castps_si512(x);
  const ivec high = _mm512_maskz_srli_epi32(all_lanes, bits, 16);
  const ivec bias =
      _mm512_add_epi32(_mm512_and_epi32(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  const ivec rounded = _mm512_maskz_srli_epi32(all_lanes, _mm512_add_epi32(bits, bias), 16);
  const ivec quiet_nan =
      _mm512_or_epi32(_mm512_and_epi32(high, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const ivec result = _mm512_mask_mov_epi32(rounded, nan, quiet_nan);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_maskz_cvtepi32_epi16(all_lanes, result));
}

/// [base[0], base[stride], ..., base[15 stride]]; stride * 16 must fit in 32 bits.
inline vec gather_strided(const float* base, Index stride) {
  const ivec offsets =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(stride)));
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), all_lanes, offsets, base, 4);
}

inline ivec load_indices(const std::int32_t* p) {
  return _mm512_loadu_si512(p);
}

/// score, or -inf in the lanes where key j lies outside [first, last).
inline vec hide_outside(vec score, std::int32_t j, ivec first, ivec last) {
  const ivec key = _mm512_set1_epi32(j);
  const auto hidden = static_cast<__mmask16>(_mm512_cmplt_epi32_mask(key, first) |
                                             _mm512_cmpge_epi32_mask(key, last));
  return _mm512_mask_mov_ps(score, hidden, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
}

/// exp(x - shift) for x <= shift (or NaN); see tile_products.inl for the method. Lanes below
/// the smallest normal float (d < -87, and -inf) are exactly 0 and cost no microcode assist:
/// the masked-off lanes of scalef neither compute nor underflow.
inline vec exp_shifted(vec x, vec shift) {
  const vec d = _mm512_sub_ps(x, shift);
  // "not less than" is true for NaN, so NaN is kept; -inf (a hidden key) is not
  const __mmask16 normal = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  const vec n =
      _mm512_maskz_roundscale_ps(all_lanes, _mm512_mul_ps(d, _mm512_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), d);  // ln 2, high part: exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);   // ln 2, low part
  vec p = _mm512_set1_ps(1.383683993e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.374815807e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166822508e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666641980e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999999106e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

/// [start, start + step, ..., start + 15 step] (mod 2^32).
inline ivec counters(std::uint32_t start, std::uint32_t step) {
  const ivec lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(start)),
                          _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(step))));
}
/// MurmurHash3's fmix32 in every lane (Dropout::mix32).
inline ivec mix32(ivec x) {
  x = _mm512_xor_si512(x, _mm512_maskz_srli_epi32(all_lanes, x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  x = _mm512_xor_si512(x, _mm512_maskz_srli_epi32(all_lanes, x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm512_xor_si512(x, _mm512_maskz_srli_epi32(all_lanes, x, 16));
}
/// value in the lanes where x >= threshold (unsigned), 0 in the others.
inline vec where_at_least(ivec x, std::uint32_t threshold, vec value) {
  return _mm512_maskz_mov_ps(
      _mm512_cmpge_epu32_mask(x, _mm512_set1_epi32(static_cast<int>(threshold))), value);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// Requests the cache line at `address` into L2: a hint, which never faults (the address
/// may lie past the data). L2, not L1 (T1, not T0): on Zen 4 decode streamed K and V 1.5x
/// faster so (docs/performance.md, "Tuning choices"); an L2 hit is soon enough for a
/// kernel that spends a few cycles per loaded vector, and L2 tracks more lines in flight.
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

}  // namespace attn::detail::avx512
ATTN_END_TARGET

#endif  // ATTN_X86_DISPATCH
