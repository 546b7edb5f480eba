// attn/kernels/widening.hpp: 16-bit storage read and written by the kernels, which compute in
// float (attn/precision.hpp): rows widened on the instruction set of the call's plan
// (kernels/dispatch.hpp), heads widened once, rows narrowed after they are written.
#pragma once

#include <algorithm>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/dispatch.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Rows [first, first + count) of `m` in the compute scalar T: `m` itself when S is T (no
/// copy), otherwise widened into `buffer`, which grows but never shrinks, so a buffer
/// reserved for the largest block is never reallocated.
template <class T, class S>
HeadMatrix<const T> rows_as(Isa isa,
                            const HeadMatrix<const S>& m,  // (L, D)
                            Index first, Index count,
                            Matrix<T>& buffer) {  // (>= count, D), used when S != T
  if constexpr (std::is_same_v<S, T>) {
    (void)isa;
    return middle_rows(m, first, count);
  } else {
    if (buffer.rows() < count || buffer.cols() != m.cols())
      buffer.resize(std::max(count, buffer.rows()), m.cols());
    static_assert(std::is_same_v<T, float>, "16-bit data widen to float");
    for (Index r = 0; r < count; ++r)
      widen(isa, m.row(first + r).data(), buffer.data() + r * m.cols(), m.cols());
    return HeadMatrix<const T>(buffer.data(), count, m.cols(), Eigen::OuterStride<>(m.cols()));
  }
}

/// One (L, D) head of a view in the compute scalar T, widened once per head: consecutive
/// requests for the same (b, h) reuse the widened copy. Extra memory (L, D) when S != T.
template <class T, class S>
class WidenedHead {
 public:
  HeadMatrix<const T> operator()(Isa isa, const HeadsView<const S>& view, Index b, Index h) {
    if constexpr (std::is_same_v<S, T>) {
      (void)isa;
      return view.head(b, h);
    } else {
      if (b != batch_ || h != head_) {
        rows_as<T, S>(isa, view.head(b, h), 0, view.rows(b), buffer_);
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

}  // namespace attn::detail
