// attn/kernels/rope.hpp: the rotation of rotary position embeddings (attn/rope.hpp), per
// instruction set (kernels/dispatch.hpp picks the one that runs).
//
//   x      rows of D features (one token of one head each), `row_stride` apart, stored as S
//          (float, double, Eigen::half or Eigen::bfloat16), rotated in place
//   table  (max_positions, R) in T: row p holds cos[0:R/2) then sin[0:R/2) of position p
//   R      rotary_dim <= D; features [R, D) are left untouched
//
// Pairings: half_split rotates (x[i], x[i + R/2]) (GPT-NeoX, Llama), interleaved rotates
// (x[2i], x[2i + 1]) (GPT-J); pair i by the angle of frequency i:
//   (a, b) -> (a cos - b sin, b cos + a sin).
// 16-bit rows are widened to float, rotated and rounded once (ties to even).
//
// generic: plain loops for any T, compiled for the translation unit's own flags. avx2 and
// avx512 (float tables only, kernels/simd/rope.inl, compiled once per vector instruction set
// by simd/foreach_isa.hpp): whole vectors of 8 or 16 floats, 16-bit rows widened and narrowed
// in registers; the pairs past the last whole vector go through the generic loop.
#pragma once

#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/simd/tile_products.hpp"

namespace attn::detail {

/// The arithmetic of one pair, in T; 16-bit values go through float.
template <class T, class S>
T rope_load(S x) {
  if constexpr (std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>)
    return static_cast<T>(static_cast<float>(x));
  else
    return static_cast<T>(x);
}

namespace generic {

/// Pairs [first, R/2) of one row: `cosines` and `sines` are its table row's halves.
template <class T, class S>
void rope_pairs(S* row, const T* cosines, const T* sines, Index half, Index first,
                bool interleaved) {
  for (Index i = first; i < half; ++i) {
    S& x0 = interleaved ? row[2 * i] : row[i];
    S& x1 = interleaved ? row[2 * i + 1] : row[i + half];
    const T a = rope_load<T>(x0), b = rope_load<T>(x1);
    x0 = static_cast<S>(a * cosines[i] - b * sines[i]);
    x1 = static_cast<S>(b * cosines[i] + a * sines[i]);
  }
}

/// Rotates `rows` rows of x (row r at x + r * row_stride) at positions[r].
template <class T, class S>
void rope_rows(S* x, Index rows, Index row_stride, const T* table, Index rotary_dim,
               const Index* positions, bool interleaved) {
  const Index half = rotary_dim / 2;
  for (Index r = 0; r < rows; ++r) {
    const T* cosines = table + positions[r] * rotary_dim;
    rope_pairs(x + r * row_stride, cosines, cosines + half, half, Index(0), interleaved);
  }
}

}  // namespace generic
}  // namespace attn::detail

#define ATTN_ISA_SOURCE "attn/kernels/simd/rope.inl"
#define ATTN_ISA_VECTOR_ONLY
#include "attn/kernels/simd/foreach_isa.hpp"
