// attn/precision.hpp: storage scalars and the scalar the arithmetic runs in.
//
// Tensors may be stored in float, double, Eigen::half or Eigen::bfloat16. The arithmetic
// (GEMMs, softmax, the running sums of flash) always runs in the compute scalar: double for
// double, float for everything else. 16-bit data are widened tile by tile as the kernels
// stream them; nothing ever accumulates in 16 bits. (Over 16384 keys an fp16 accumulator
// stalls once the softmax denominator reaches 2048, where fp16's spacing is 2: in
// tests/test_precision.cpp it is off by 2.3 on outputs near 2, float accumulation by 1e-3,
// the rounding of the half output itself.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/generic.hpp"
#include "attn/kernels/simd/avx2.hpp"
#include "attn/kernels/simd/avx512.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// The 16-bit storage scalars: widened to float for all arithmetic.
template <class S>
inline constexpr bool is_16bit_scalar_v =
    std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>;

/// The scalars a tensor may be stored in: the standard floating types and the 16-bit ones.
template <class S>
inline constexpr bool is_storage_scalar_v = std::is_floating_point_v<S> || is_16bit_scalar_v<S>;

/// The scalar the arithmetic on S-stored data runs in: float for the 16-bit types, S itself
/// otherwise (float, double, or long double, which tests use as a wider reference).
template <class S>
using compute_scalar_t = std::conditional_t<is_16bit_scalar_v<S>, float, S>;

namespace detail {

/// dst[0:n) = src[0:n) widened to float (exact), with the vector conversions of the active
/// instruction set (attn/cpu.hpp): Eigen 3.4's cast<float>() of half converts one scalar at a
/// time (about 1 ns per element), a vector conversion 8 or 16 per instruction.
template <class S, class = std::enable_if_t<is_16bit_scalar_v<S>>>
void widen(const S* src, float* dst, Index n) {
#if ATTN_X86_DISPATCH
  switch (active_isa()) {
    case Isa::avx512:
      return avx512::widen(src, dst, n);
    case Isa::avx2:
      return avx2::widen(src, dst, n);
    case Isa::generic:
      break;
  }
#endif
  generic::widen(src, dst, n);
}

/// Rows [first, first + count) of `m` in the compute scalar T: `m` itself when S is T (no
/// copy), otherwise widened into `buffer`, which grows but never shrinks, so a buffer
/// reserved for the largest block is never reallocated.
template <class T, class S>
HeadMatrix<const T> rows_as(const HeadMatrix<const S>& m,  // (L, D)
                            Index first, Index count,
                            Matrix<T>& buffer) {  // (>= count, D), used when S != T
  if constexpr (std::is_same_v<S, T>) {
    return middle_rows(m, first, count);
  } else {
    if (buffer.rows() < count || buffer.cols() != m.cols())
      buffer.resize(std::max(count, buffer.rows()), m.cols());
    static_assert(std::is_same_v<T, float>, "16-bit data widen to float");
    for (Index r = 0; r < count; ++r)
      widen(m.row(first + r).data(), buffer.data() + r * m.cols(), m.cols());
    return HeadMatrix<const T>(buffer.data(), count, m.cols(), Eigen::OuterStride<>(m.cols()));
  }
}

/// One (L, D) head of a view in the compute scalar T, widened once per head: consecutive
/// requests for the same (b, h) reuse the widened copy. Extra memory (L, D) when S != T.
template <class T, class S>
class WidenedHead {
 public:
  HeadMatrix<const T> operator()(const HeadsView<const S>& view, Index b, Index h) {
    if constexpr (std::is_same_v<S, T>) {
      return view.head(b, h);
    } else {
      if (b != batch_ || h != head_) {
        rows_as<T, S>(view.head(b, h), 0, view.rows(b), buffer_);
        batch_ = b;
        head_ = h;
      }
      return HeadMatrix<const T>(buffer_.data(), view.rows(b), view.dim,
                                 Eigen::OuterStride<>(view.dim));
    }
  }

 private:
  Matrix<T> buffer_;
  Index batch_ = -1, head_ = -1;
};

/// Rows written in the compute scalar T and stored as O: `out` itself when O is T,
/// otherwise a buffer that store() narrows into `out`.
template <class T, class O>
class NarrowedRows {
 public:
  HeadMatrix<T> rows(const HeadMatrix<O>& out, Index first, Index count) {
    if constexpr (std::is_same_v<O, T>) {
      return middle_rows(out, first, count);
    } else {
      if (buffer_.rows() < count || buffer_.cols() != out.cols())
        buffer_.resize(std::max(count, buffer_.rows()), out.cols());
      return HeadMatrix<T>(buffer_.data(), count, out.cols(), Eigen::OuterStride<>(out.cols()));
    }
  }

  void store(HeadMatrix<O> out, Index first, Index count) const {
    if constexpr (!std::is_same_v<O, T>) {
      const Eigen::Map<const Matrix<T>> rows(buffer_.data(), count, out.cols());
      out.middleRows(first, count) = rows.template cast<O>();
    } else {
      (void)out;
      (void)first;
      (void)count;
    }
  }

 private:
  Matrix<T> buffer_;
};

}  // namespace detail
}  // namespace attn
