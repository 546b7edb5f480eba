// attn/kernels/generic.hpp: the tile products of the flash and decode kernels on Eigen, for
// any scalar (float, double, long double) and any CPU, in namespace attn::detail::generic.
//
// The same contracts as the vector products of simd/tile_products.inl (which see): queries
// on the columns of st and ot for flash, on the rows of s and acc for decode. Products are
// Eigen's GEMMs and the exp is Eigen's vectorised exp, so this code runs at the speed of the
// translation unit's own -march (SSE2 in a plain x86-64 build). No padding: W = the query
// tile. 16-bit k and v are widened, and quantized blocks dequantized, into the workspace
// before the products.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/dropout.hpp"
#include "attn/quantized.hpp"
#include "attn/softmax.hpp"
#include "attn/tensor.hpp"

namespace attn::detail::generic {

inline constexpr Isa isa = Isa::generic;
/// No vectors of its own: tiles are not padded.
inline constexpr Index lanes = 1;
/// The decode products read T only: 16-bit blocks are widened before them.
inline constexpr bool widens_in_registers = false;

/// The GEMM of this instruction set is Eigen's product (kernels/gemm.hpp: gemm_of).
struct Gemm {
  static constexpr bool packed = false;
};

template <class T>
using RowsMap = Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using ConstRowsMap = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using RowArray = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>;
template <class T>
using ConstRowArray = Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>;

inline Index padded(Index n) {
  return n;
}

// --- Flash: queries on the columns ------------------------------------------------------

template <class T>
void pack_queries(const T* q, Index q_stride, Index rows, Index dim, T scale, T* qt,
                  Index qt_stride, Index /*width*/) {
  RowsMap<T>(qt, dim, rows, Eigen::OuterStride<>(qt_stride)).noalias() =
      scale * ConstRowsMap<T>(q, rows, dim, Eigen::OuterStride<>(q_stride)).transpose();
}

template <class T>
void column_maxima(const T* st, Index st_stride, Index keys, Index width, T* column_max) {
  RowArray<T> result(column_max, width);
  result.setConstant(-std::numeric_limits<T>::infinity());
  for (Index j = 0; j < keys; ++j)
    result = result.max(ConstRowArray<T>(st + j * st_stride, width));
}

template <class T>
void scores(const T* k, Index k_stride, Index keys, const T* qt, Index qt_stride, Index dim,
            Index width, T* st, Index st_stride, T* column_max) {
  RowsMap<T>(st, keys, width, Eigen::OuterStride<>(st_stride)).noalias() =
      ConstRowsMap<T>(k, keys, dim, Eigen::OuterStride<>(k_stride)) *
      ConstRowsMap<T>(qt, dim, width, Eigen::OuterStride<>(qt_stride));
  if (column_max != nullptr)
    column_maxima(st, st_stride, keys, width, column_max);
}

template <class T>
void hide_outside_intervals(T* st, Index st_stride, Index keys, Index width, const std::int32_t* lo,
                            const std::int32_t* hi, T* column_max) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  for (Index j = 0; j < keys; ++j) {
    T* row = st + j * st_stride;
    for (Index c = 0; c < width; ++c) {
      if (j < lo[c] || j >= hi[c])
        row[c] = minus_inf;
    }
  }
  column_maxima(st, st_stride, keys, width, column_max);
}

template <class T>
void exp_columns(T* st, Index st_stride, Index keys, Index width, const T* shift, T* sums) {
  const ConstRowArray<T> s(shift, width);
  RowArray<T> total(sums, width);
  total.setZero();
  for (Index j = 0; j < keys; ++j) {
    RowArray<T> p(st + j * st_stride, width);
    p = (p - s).exp();
    p -= p.min(flush_below<T>());  // exp(-inf) is not 0 in Eigen (softmax.hpp)
    total += p;
  }
}

template <class T>
void exp_difference(const T* x, const T* shift, T* out, Index n) {
  RowArray<T> result(out, n);
  result = (ConstRowArray<T>(x, n) - ConstRowArray<T>(shift, n)).exp();
  result -= result.min(flush_below<T>());
}

template <class T>
void accumulate(const T* st, Index st_stride, Index keys, Index width, const T* v, Index v_stride,
                Index value_dim, const T* alpha, T* ot, Index ot_stride) {
  RowsMap<T> o(ot, value_dim, width, Eigen::OuterStride<>(ot_stride));
  const ConstRowsMap<T> p(st, keys, width, Eigen::OuterStride<>(st_stride));
  const ConstRowsMap<T> values(v, keys, value_dim, Eigen::OuterStride<>(v_stride));
  if (alpha == nullptr) {
    o.noalias() = values.transpose() * p;
  } else {
    o.array().rowwise() *= ConstRowArray<T>(alpha, width);
    o.noalias() += values.transpose() * p;
  }
}

// --- Flash backward ----------------------------------------------------------------------

template <class T>
void score_gradient_row(const T* p, const T* f, T delta, T scale, Index width, T* ds) {
  RowArray<T> d(ds, width);
  const ConstRowArray<T> probabilities(p, width);
  if (f != nullptr)
    d = scale * (probabilities * (ConstRowArray<T>(f, width) * d - delta));
  else
    d = scale * (probabilities * (d - delta));
}

template <bool a_transposed = false, class T>
void add_product(const T* a, Index a_stride, Index rows, const T* b, Index b_stride, Index depth,
                 Index cols, T* c, Index c_stride) {
  RowsMap<T> sums(c, rows, cols, Eigen::OuterStride<>(c_stride));
  const ConstRowsMap<T> weights(b, depth, cols, Eigen::OuterStride<>(b_stride));
  if constexpr (a_transposed)
    sums.noalias() +=
        ConstRowsMap<T>(a, depth, rows, Eigen::OuterStride<>(a_stride)).transpose() * weights;
  else
    sums.noalias() += ConstRowsMap<T>(a, rows, depth, Eigen::OuterStride<>(a_stride)) * weights;
}

template <class T>
void dropout_row(const Dropout<T>& dropout, std::uint32_t row, Index j0, Index keys, Index width,
                 const T* p, T* f, T* pf) {
  dropout.factors_for_row(row, j0, keys, f);
  RowArray<T>(pf, keys) = ConstRowArray<T>(p, keys) * ConstRowArray<T>(f, keys);
  std::fill(f + keys, f + width, T(0));
  std::fill(pf + keys, pf + width, T(0));
}

template <class T>
void softcap_derivative(const T* raw, Index n, T cap, T* ds) {
  RowArray<T>(ds, n) *= T(1) - (ConstRowArray<T>(raw, n) * (T(1) / cap)).tanh().square();
}

// --- Widening ---------------------------------------------------------------------------

template <class S>
void widen(const S* src, float* dst, Index n) {
  for (Index i = 0; i < n; ++i)
    dst[i] = static_cast<float>(src[i]);
}

/// n values (a multiple of 32) of q8_0 or q4_0 blocks, dequantized.
inline void widen(const BlockQ8_0* src, float* dst, Index n) {
  dequantize_blocks(src, n / quantized_block_values, dst);
}
inline void widen(const BlockQ4_0* src, float* dst, Index n) {
  dequantize_blocks(src, n / quantized_block_values, dst);
}

// --- Decode: queries on the rows --------------------------------------------------------

// (The vector sets' dot_scores and weighted_sum take the next block's rows, which their
// software prefetches request; Eigen's products here prefetch nothing.)
template <class T>
void dot_scores(const T* q, Index q_stride, Index rows, const T* k, Index k_stride, Index keys,
                Index dim, T* s, Index s_stride, const T* /*k_ahead*/) {
  const ConstRowsMap<T> k_block(k, keys, dim, Eigen::OuterStride<>(k_stride));
  RowsMap<T> scores_block(s, rows, keys, Eigen::OuterStride<>(s_stride));
  // One matrix-vector product per row: Eigen's GEMM packs both operands, which at
  // G * Lq <= 64 rows costs more than the arithmetic (docs/performance.md, "Tuning choices").
  for (Index r = 0; r < rows; ++r) {
    scores_block.row(r).noalias() =
        ConstRowsMap<T>(q + r * q_stride, 1, dim, Eigen::OuterStride<>(q_stride)) *
        k_block.transpose();
  }
}

template <class T>
void row_maxima(const T* s, Index s_stride, Index rows, Index cols, T* out) {
  for (Index r = 0; r < rows; ++r) {
    out[r] = cols == 0 ? -std::numeric_limits<T>::infinity()
                       : ConstRowArray<T>(s + r * s_stride, cols).maxCoeff();
  }
}

template <class T>
void exp_rows(T* s, Index s_stride, Index rows, Index cols, const T* shift, T* sums) {
  for (Index r = 0; r < rows; ++r) {
    RowArray<T> p(s + r * s_stride, cols);
    p = (p - shift[r]).exp();
    p -= p.min(flush_below<T>());
    sums[r] = p.sum();
  }
}

template <class T>
void weighted_sum(const T* p, Index p_stride, Index rows, const T* v, Index v_stride, Index keys,
                  Index value_dim, const T* alpha, T* acc, Index acc_stride, const T* /*v_ahead*/,
                  const T* /*v_far*/) {
  const ConstRowsMap<T> v_block(v, keys, value_dim, Eigen::OuterStride<>(v_stride));
  for (Index r = 0; r < rows; ++r) {
    RowsMap<T> acc_row(acc + r * acc_stride, 1, value_dim, Eigen::OuterStride<>(acc_stride));
    const ConstRowsMap<T> p_row(p + r * p_stride, 1, keys, Eigen::OuterStride<>(p_stride));
    if (alpha == nullptr) {
      acc_row.noalias() = p_row * v_block;
    } else {
      if (alpha[r] != T(1))
        acc_row *= alpha[r];
      acc_row.noalias() += p_row * v_block;
    }
  }
}

}  // namespace attn::detail::generic
