// attn/softmax.hpp: numerically stable softmax and log-sum-exp over rows.
//
// softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m) with m = max_k x_k, so no exp overflows
// (logits of 1e4 are fine). Conventions, shared by every kernel of the library:
//   - entries equal to -inf get weight 0 (they are masked keys);
//   - a row that is entirely -inf (or empty) has softmax 0 everywhere and log-sum-exp -inf:
//     "attends to nothing" rather than NaN (FlashAttention's convention; PyTorch's math
//     path returns NaN);
//   - NaN anywhere in a row makes the whole row NaN: NaN is never masked away;
//   - +inf in a row gives NaN, as in NumPy and PyTorch (inf - inf).
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/tensor.hpp"

namespace attn {

namespace detail {

// Eigen 3.4's vectorised exp clamps its argument (to about -88.7 for float, -709.4 for
// double), so it maps -inf to a tiny number, not 0: a masked key would keep a weight of
// about 1e-39. Both functions below flush every exp below flush_below<T>() to exactly 0 with
// e - min(e, flush), which vectorises (Eigen 3.4's select() does not, and cost 7x). The
// terms flushed are below 1e-37 of the row's largest term (which is 1), so the sums do not
// change in any digit that float or double keeps.
template <class T>
constexpr T flush_below() {
  return std::is_same_v<T, float> ? T(1e-37) : T(1e-300);
}

/// Softmax of the n contiguous values at `row`, in place; returns their log-sum-exp.
template <class T>
T softmax_in_place(T* row, Index n) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  if (n == 0)
    return minus_inf;
  Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> x(row, n);
  const T max = x.template maxCoeff<Eigen::PropagateNaN>();
  if (max == minus_inf) {
    x.setZero();
    return minus_inf;
  }
  x = (x - max).exp();  // coefficient-wise: no aliasing
  x -= x.min(flush_below<T>());
  const T sum = x.sum();
  x *= T(1) / sum;
  return max + std::log(sum);
}

/// Softmax of the n values at `row` and one more logit, `sink`, whose probability is then
/// dropped (a learned attention sink): the row sums to 1 - p(sink). Returns the log-sum-exp
/// of all n + 1; a row of only -inf becomes zeros and returns the sink. NaN propagates.
template <class T>
T softmax_in_place(T* row, Index n, T sink) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> x(row, n);
  const T row_max = n == 0 ? minus_inf : x.template maxCoeff<Eigen::PropagateNaN>();
  if (row_max == minus_inf) {
    x.setZero();
    return sink;
  }
  const T max = std::isnan(row_max) || row_max > sink ? row_max : sink;
  x = (x - max).exp();
  x -= x.min(flush_below<T>());
  const T sum = x.sum() + std::exp(sink - max);
  x *= T(1) / sum;
  return max + std::log(sum);
}

/// softmax_in_place with a sink when `sink` is not null.
template <class T>
T softmax_in_place(T* row, Index n, const T* sink) {
  return sink == nullptr ? softmax_in_place(row, n) : softmax_in_place(row, n, *sink);
}

/// Log-sum-exp of the n contiguous values at `row`, without changing them.
template <class T>
T logsumexp(const T* row, Index n) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  if (n == 0)
    return minus_inf;
  Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>> x(row, n);
  const T max = x.template maxCoeff<Eigen::PropagateNaN>();
  if (max == minus_inf)
    return minus_inf;
  return max + std::log(((x - max).exp() - (x - max).exp().min(flush_below<T>())).sum());
}

}  // namespace detail

/// Row-wise softmax: (R, C) -> (R, C). Each row sums to 1, or is all 0 when the row is
/// entirely -inf.
template <class Derived>
Matrix<typename Derived::Scalar> softmax_rows(const Eigen::MatrixBase<Derived>& x) {  // (R, C)
  Matrix<typename Derived::Scalar> y = x;  // row-major: each row is contiguous
  for (Index r = 0; r < y.rows(); ++r)
    detail::softmax_in_place(y.row(r).data(), y.cols());
  return y;
}

/// Row-wise log-sum-exp: (R, C) -> (R); -inf for a row that is entirely -inf or empty.
template <class Derived>
Vector<typename Derived::Scalar> logsumexp_rows(const Eigen::MatrixBase<Derived>& x) {  // (R, C)
  using T = typename Derived::Scalar;
  const Matrix<T> rows = x;
  Vector<T> lse(rows.rows());
  for (Index r = 0; r < rows.rows(); ++r)
    lse(r) = detail::logsumexp(rows.row(r).data(), rows.cols());
  return lse;
}

/// Softmax of one vector (row or column).
template <class Derived>
Eigen::Matrix<typename Derived::Scalar, Derived::RowsAtCompileTime, Derived::ColsAtCompileTime>
softmax(const Eigen::MatrixBase<Derived>& x) {  // (n)
  static_assert(Derived::IsVectorAtCompileTime, "attn::softmax takes a vector; use softmax_rows");
  Eigen::Matrix<typename Derived::Scalar, Derived::RowsAtCompileTime, Derived::ColsAtCompileTime>
      y = x;
  detail::softmax_in_place(y.data(), y.size());
  return y;
}

/// Log-sum-exp of one vector.
template <class Derived>
typename Derived::Scalar logsumexp(const Eigen::MatrixBase<Derived>& x) {  // (n)
  static_assert(Derived::IsVectorAtCompileTime,
                "attn::logsumexp takes a vector; use logsumexp_rows");
  const Vector<typename Derived::Scalar> y = x;
  return detail::logsumexp(y.data(), y.size());
}

}  // namespace attn
