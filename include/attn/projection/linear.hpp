// attn/projection/linear.hpp: the linear layer y = x W + b, its row-view GEMMs and its
// backward (attn/projection.hpp includes it with the Q/K/V projection).
//
// Shape legend: N rows (B*S), in input width, out output width.
//
// Weight layout. Our weights are stored (in x out) and applied as y = x * W + b: the
// tutorials' `X @ Wq`. PyTorch's nn.Linear stores the same weight transposed, (out x in),
// and computes x @ W.T + b. Never transpose by hand: import with Linear<T>::from_torch
// (and export with Linear<T>::torch_weight).
//
// The einsum trap of the QKV-projection tutorial: it writes
//     Q = np.einsum('bsd,hd->bsh', X, W_q)
// and calls it "X @ W_q". It is not: 'bsd,hd->bsh' contracts d with the *second* index of
// W, i.e. it computes X @ W_q.T, which equals X @ W_q only for a symmetric W_q (and fails
// outright when W_q is not square). 'bsd,dh->bsh' is X @ W_q. The tutorial's
// "Matmul vs Einsum" check therefore prints False for its random weights. PyTorch's
// (out x in) weight *is* applied as X @ W.T, so that einsum is the right formula for a
// PyTorch-layout weight: Linear<T>::from_torch transposes once and the trap is gone.
//
// Backward (training): Linear::backward(x, dy) needs only the forward's input x and the
// gradient dy of the loss with respect to the output; it returns dx and the parameter
// gradients in PyTorch's layout (weight (out, in) like nn.Linear.weight):
//   dx = dy W^T,   weight grad = dy^T x  (out, in),   bias grad = sum of dy over the rows
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/init.hpp"
#include "attn/kernels/dispatch.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// A read-only row-major matrix view with a free row stride (e.g. a column block of a
/// wider row-major buffer).
template <class T>
using ConstRowsMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// A writable row-major matrix view with a free row stride.
template <class T>
using RowsMap = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

namespace detail {

/// y (N, out) = x (N, in) * w (in, out) + b (out; null = none). One GEMM: for float,
/// attn's own (kernels/gemm.hpp, on the instruction set chosen at run time, so that a build
/// without -march still runs AVX2 or AVX-512); for double, Eigen's. 16-bit data are widened
/// to float for the GEMM (Eigen's half GEMM would round every partial sum to half) and the
/// result is rounded once: extra memory (N, in + out) + (in, out) floats per call.
template <class T>
void linear_into(const ConstRowsMap<T>& x,  // (N, in)
                 const ConstRowsMap<T>& w,  // (in, out)
                 const T* bias,             // (out) or null
                 RowsMap<T> y) {            // (N, out)
  ATTN_ASSERT(x.cols() == w.rows() && y.cols() == w.cols() && y.rows() == x.rows());
  using C = compute_scalar_t<T>;
  if constexpr (std::is_same_v<T, C>) {
    const LoopPlan plan = plan_gemm<C>(x.rows(), w.cols(), x.cols());
    gemm(plan.isa, x.rows(), w.cols(), x.cols(), x.data(), x.outerStride(), w.data(),
         w.outerStride(), y.data(), y.outerStride(), bias, false, plan.parallel);
  } else {
    const Matrix<C> x_wide = x.template cast<C>(), w_wide = w.template cast<C>();
    Vector<C> bias_wide;
    if (bias != nullptr)
      bias_wide = Eigen::Map<const Vector<T>>(bias, w.cols()).template cast<C>();
    Matrix<C> y_wide(x.rows(), w.cols());
    const LoopPlan plan = plan_gemm<C>(x.rows(), w.cols(), x.cols());
    gemm(plan.isa, x.rows(), w.cols(), x.cols(), x_wide.data(), x.cols(), w_wide.data(), w.cols(),
         y_wide.data(), w.cols(), bias != nullptr ? bias_wide.data() : nullptr, false,
         plan.parallel);
    y = y_wide.template cast<T>();
  }
}

/// The backward of linear_into: dx (N, in) = dy W^T [+ dx], weight_grad (out, in) = dy^T x
/// [+ weight_grad] (torch's layout), bias_grad (out) = the column sums of dy [+ bias_grad];
/// a null destination is not computed. Two GEMMs on attn's own kernels like the forward
/// (Eigen's for double), each with one operand transposed into a packed copy first: extra
/// memory (out, N) + (out, in) scalars. 16-bit data are widened to float, as in linear_into.
template <class T>
void linear_backward_into(const ConstRowsMap<T>& x,   // (N, in)
                          const ConstRowsMap<T>& w,   // (in, out)
                          const ConstRowsMap<T>& dy,  // (N, out)
                          RowsMap<T>* dx,             // (N, in) or null
                          bool accumulate_dx,
                          RowsMap<T>* weight_grad,  // (out, in) or null
                          T* bias_grad,             // (out) or null
                          bool accumulate_parameters) {
  ATTN_ASSERT(x.cols() == w.rows() && dy.cols() == w.cols() && dy.rows() == x.rows());
  using C = compute_scalar_t<T>;
  const Index n = x.rows(), in = w.rows(), out = w.cols();
  if constexpr (std::is_same_v<T, C>) {
    if (weight_grad != nullptr || bias_grad != nullptr) {
      const Matrix<T> dy_t = dy.transpose();  // (out, N)
      if (weight_grad != nullptr) {
        ATTN_ASSERT(weight_grad->rows() == out && weight_grad->cols() == in);
        const LoopPlan plan = plan_gemm<T>(out, in, n);
        gemm(plan.isa, out, in, n, dy_t.data(), n, x.data(), x.outerStride(), weight_grad->data(),
             weight_grad->outerStride(), static_cast<const T*>(nullptr), accumulate_parameters,
             plan.parallel);
      }
      if (bias_grad != nullptr) {
        Eigen::Map<Vector<T>> b(bias_grad, out);
        if (accumulate_parameters)
          b += dy_t.rowwise().sum();
        else
          b = dy_t.rowwise().sum();
      }
    }
    if (dx != nullptr) {
      ATTN_ASSERT(dx->rows() == n && dx->cols() == in);
      const Matrix<T> w_t = w.transpose();  // (out, in): torch's layout
      const LoopPlan plan = plan_gemm<T>(n, in, out);
      gemm(plan.isa, n, in, out, dy.data(), dy.outerStride(), w_t.data(), in, dx->data(),
           dx->outerStride(), static_cast<const T*>(nullptr), accumulate_dx, plan.parallel);
    }
  } else {
    const Matrix<C> x_wide = x.template cast<C>(), w_wide = w.template cast<C>(),
                    dy_wide = dy.template cast<C>();
    const auto rows = [](const Matrix<C>& m) {
      return ConstRowsMap<C>(m.data(), m.rows(), m.cols(), Eigen::OuterStride<>(m.cols()));
    };
    Matrix<C> dx_wide(dx != nullptr ? n : 0, in), wg_wide(weight_grad != nullptr ? out : 0, in);
    Vector<C> bg_wide(bias_grad != nullptr ? out : 0);
    RowsMap<C> dx_map(dx_wide.data(), dx_wide.rows(), in, Eigen::OuterStride<>(in));
    RowsMap<C> wg_map(wg_wide.data(), wg_wide.rows(), in, Eigen::OuterStride<>(in));
    linear_backward_into<C>(rows(x_wide), rows(w_wide), rows(dy_wide),
                            dx != nullptr ? &dx_map : nullptr, false,
                            weight_grad != nullptr ? &wg_map : nullptr,
                            bias_grad != nullptr ? bg_wide.data() : nullptr, false);
    // Added in the compute scalar, rounded once.
    if (dx != nullptr) {
      if (accumulate_dx)
        dx_wide += dx->template cast<C>();
      *dx = dx_wide.template cast<T>();
    }
    if (weight_grad != nullptr) {
      if (accumulate_parameters)
        wg_wide += weight_grad->template cast<C>();
      *weight_grad = wg_wide.template cast<T>();
    }
    if (bias_grad != nullptr) {
      Eigen::Map<Vector<T>> b(bias_grad, out);
      if (accumulate_parameters)
        bg_wide += b.template cast<C>();
      b = bg_wide.template cast<T>();
    }
  }
}

/// The (B*S, E) rows of a (B, S, E) tensor.
template <class T>
ConstRowsMap<T> rows_of(const Tensor<T, 3>& x) {
  return ConstRowsMap<T>(x.data(), x.dimension(0) * x.dimension(1), x.dimension(2),
                         Eigen::OuterStride<>(x.dimension(2)));
}

inline std::string shape3(const char* name, Index b, Index s, Index e) {
  return std::string(name) + " is " + shape_string({b, s, e});
}

/// Writable (B*S, E) rows of a (B, S, E) tensor.
template <class T>
RowsMap<T> rows_of(Tensor<T, 3>& x) {
  return RowsMap<T>(x.data(), x.dimension(0) * x.dimension(1), x.dimension(2),
                    Eigen::OuterStride<>(x.dimension(2)));
}

/// Sizes a parameter gradient: resized when overwritten; when accumulated, it must already
/// have the parameter's shape.
template <class M>
void prepare_gradient(const char* function, const char* name, M& grad, Index rows, Index cols,
                      bool accumulate) {
  if (!accumulate) {
    if constexpr (M::ColsAtCompileTime == 1)
      grad.resize(rows);
    else
      grad.resize(rows, cols);
    return;
  }
  if (grad.rows() != rows || grad.cols() != cols) {
    throw_invalid_argument(function,
                           std::string(name) + " is " + shape_string({grad.rows(), grad.cols()}) +
                               " but accumulating into it needs " + shape_string({rows, cols}));
  }
}

}  // namespace detail

/// The gradients of a Linear layer, named and laid out as PyTorch's nn.Linear parameters
/// (compare one to one with weight.grad and bias.grad).
template <class T, class Input = Matrix<T>>  // Input: Matrix<T> (N, in) or Tensor<T, 3>
struct LinearGradients {
  Input dx;           ///< (N, in) or (B, S, in): the gradient with respect to the input
  Matrix<T> dweight;  ///< (out, in): torch's weight.grad, our W transposed
  Vector<T> dbias;    ///< (out): torch's bias.grad; empty without a bias
};

/// y = x * W + b with W (in x out) and an optional bias (out).
template <class T>
class Linear {
 public:
  Linear() = default;

  /// Fresh layer: W from xavier_uniform (fan_in = in, fan_out = out) drawn with
  /// std::mt19937_64(seed), bias zero (like PyTorch's MultiheadAttention projections).
  Linear(Index in_features, Index out_features, bool bias = true, std::uint64_t seed = 0) {
    if (in_features < 1 || out_features < 1) {
      detail::throw_invalid_argument(
          "Linear", "shape (in, out) is " + detail::shape_string({in_features, out_features}) +
                        ": both must be positive");
    }
    std::mt19937_64 engine(seed);
    weight_ = xavier_uniform<T>(in_features, out_features, engine);
    if (bias)
      bias_ = Vector<T>::Zero(out_features);
  }

  /// From a weight in our layout (in x out) and a bias (out), or an empty bias for none.
  explicit Linear(Matrix<T> weight, Vector<T> bias = Vector<T>())
      : weight_(std::move(weight)), bias_(std::move(bias)) {
    if (weight_.rows() < 1 || weight_.cols() < 1) {
      detail::throw_invalid_argument("Linear",
                                     "weight (in, out) is " +
                                         detail::shape_string({weight_.rows(), weight_.cols()}) +
                                         ": must not be empty");
    }
    if (bias_.size() != 0 && bias_.size() != weight_.cols()) {
      detail::throw_invalid_argument(
          "Linear", "weight (in, out) is " +
                        detail::shape_string({weight_.rows(), weight_.cols()}) + " but bias is " +
                        detail::shape_string({bias_.size()}) +
                        ": the bias needs one entry per output");
    }
  }

  /// From PyTorch's nn.Linear layout: weight (out x in), bias (out) or empty. Transposes once
  /// here, so that nobody transposes by hand (see the einsum trap at the top of this file).
  static Linear from_torch(const Eigen::Ref<const Matrix<T>>& weight,  // (out, in)
                           const Eigen::Ref<const Vector<T>>& bias = Vector<T>()) {
    if (bias.size() != 0 && bias.size() != weight.rows()) {
      detail::throw_invalid_argument("Linear::from_torch",
                                     "weight (out, in) is " +
                                         detail::shape_string({weight.rows(), weight.cols()}) +
                                         " but bias is " + detail::shape_string({bias.size()}) +
                                         ": the bias needs one entry per output (weight rows)");
    }
    return Linear(Matrix<T>(weight.transpose()), Vector<T>(bias));
  }

  Index in_features() const { return weight_.rows(); }
  Index out_features() const { return weight_.cols(); }
  bool has_bias() const { return bias_.size() != 0; }
  /// (in, out), applied as x * W.
  const Matrix<T>& weight() const { return weight_; }
  /// (out), empty when there is no bias.
  const Vector<T>& bias() const { return bias_; }
  /// The weight in PyTorch's layout (out, in).
  Matrix<T> torch_weight() const { return weight_.transpose(); }

  /// (N, in) -> (N, out).
  template <class Derived>
  Matrix<T> operator()(const Eigen::MatrixBase<Derived>& x) const {
    if (x.cols() != in_features()) {
      detail::throw_invalid_argument("Linear",
                                     "x is " + detail::shape_string({x.rows(), x.cols()}) +
                                         " but the weight (in, out) is " +
                                         detail::shape_string({weight_.rows(), weight_.cols()}) +
                                         ": x needs one column per input feature");
    }
    const Matrix<T> xr = x;  // expressions and column-major inputs: evaluate row-major once
    Matrix<T> y(xr.rows(), out_features());
    apply_into(ConstRowsMap<T>(xr.data(), xr.rows(), xr.cols(), Eigen::OuterStride<>(xr.cols())),
               RowsMap<T>(y.data(), y.rows(), y.cols(), Eigen::OuterStride<>(y.cols())));
    return y;
  }
  Matrix<T> operator()(const Matrix<T>& x) const {
    check_rows("Linear", x.rows(), x.cols());
    Matrix<T> y(x.rows(), out_features());
    apply_into(ConstRowsMap<T>(x.data(), x.rows(), x.cols(), Eigen::OuterStride<>(x.cols())),
               RowsMap<T>(y.data(), y.rows(), y.cols(), Eigen::OuterStride<>(y.cols())));
    return y;
  }

  /// (B, S, in) -> (B, S, out): one GEMM over the B*S rows.
  Tensor<T, 3> operator()(const Tensor<T, 3>& x) const {
    if (x.dimension(2) != in_features()) {
      detail::throw_invalid_argument(
          "Linear", detail::shape3("x", x.dimension(0), x.dimension(1), x.dimension(2)) +
                        " but the weight (in, out) is " +
                        detail::shape_string({weight_.rows(), weight_.cols()}) +
                        ": the last dimension must equal in");
    }
    Tensor<T, 3> y(x.dimension(0), x.dimension(1), out_features());
    apply_into(detail::rows_of(x),
               RowsMap<T>(y.data(), x.dimension(0) * x.dimension(1), out_features(),
                          Eigen::OuterStride<>(out_features())));
    return y;
  }

  /// The backward of operator(): from the forward's input x (N, in) and dy = dL/dy
  /// (N, out), dx (N, in) = dy W^T and the parameter gradients in torch's layout, weight
  /// (out, in) = dy^T x and bias (out) = the column sums of dy (empty without a bias).
  template <class DX, class DY>
  LinearGradients<T> backward(const Eigen::MatrixBase<DX>& x,           // (N, in)
                              const Eigen::MatrixBase<DY>& dy) const {  // (N, out)
    const Matrix<T> xr = x, dyr = dy;  // expressions and column-major inputs: row-major once
    LinearGradients<T> grads;
    grads.dx.resize(xr.rows(), xr.cols());
    RowsMap<T> dx(grads.dx.data(), xr.rows(), xr.cols(), Eigen::OuterStride<>(xr.cols()));
    backward_rows("Linear::backward", as_const_rows(xr), as_const_rows(dyr), &dx, grads.dweight,
                  grads.dbias, false);
    return grads;
  }

  /// (B, S, in) and dy (B, S, out): dx (B, S, in) and the parameter gradients, one GEMM each
  /// over the B*S rows.
  LinearGradients<T, Tensor<T, 3>> backward(const Tensor<T, 3>& x,           // (B, S, in)
                                            const Tensor<T, 3>& dy) const {  // (B, S, out)
    if (x.dimension(0) != dy.dimension(0) || x.dimension(1) != dy.dimension(1) ||
        x.dimension(2) != in_features() || dy.dimension(2) != out_features()) {
      detail::throw_invalid_argument(
          "Linear::backward",
          detail::shape3("x", x.dimension(0), x.dimension(1), x.dimension(2)) + " and " +
              detail::shape3("dy", dy.dimension(0), dy.dimension(1), dy.dimension(2)) +
              " but the weight (in, out) is " +
              detail::shape_string({weight_.rows(), weight_.cols()}) +
              ": need x (B, S, in) and dy (B, S, out)");
    }
    LinearGradients<T, Tensor<T, 3>> grads;
    grads.dx.resize(x.dimension(0), x.dimension(1), x.dimension(2));
    RowsMap<T> dx = detail::rows_of(grads.dx);
    backward_rows("Linear::backward", detail::rows_of(x), detail::rows_of(dy), &dx, grads.dweight,
                  grads.dbias, false);
    return grads;
  }

  /// The backward on strided rows, for building larger backwards: x (N, in) and dy (N, out)
  /// give dx (N, in) (not computed when null; overwritten) and the parameter gradients
  /// weight_grad (out, in) and bias_grad (out) in torch's layout (bias_grad left empty
  /// without a bias). accumulate = false resizes and overwrites them; true adds to them, as
  /// torch's .grad does across backward calls (they must then have their shapes already).
  void backward_into(const ConstRowsMap<T>& x,   // (N, in)
                     const ConstRowsMap<T>& dy,  // (N, out)
                     RowsMap<T>* dx,             // (N, in) or null
                     Matrix<T>& weight_grad,     // (out, in)
                     Vector<T>& bias_grad,       // (out) or empty
                     bool accumulate = false) const {
    backward_rows("Linear::backward_into", x, dy, dx, weight_grad, bias_grad, accumulate);
  }

  /// y (N, out) = x (N, in) * W + b into any strided row-major destination (no allocation).
  void apply_into(const ConstRowsMap<T>& x, RowsMap<T> y) const {
    if (x.cols() != in_features() || y.cols() != out_features() || y.rows() != x.rows()) {
      detail::throw_invalid_argument(
          "Linear::apply_into", "x is " + detail::shape_string({x.rows(), x.cols()}) + ", y is " +
                                    detail::shape_string({y.rows(), y.cols()}) +
                                    " and the weight (in, out) is " +
                                    detail::shape_string({weight_.rows(), weight_.cols()}) +
                                    ": need x (N, in) and y (N, out)");
    }
    detail::linear_into<T>(x,
                           ConstRowsMap<T>(weight_.data(), weight_.rows(), weight_.cols(),
                                           Eigen::OuterStride<>(weight_.cols())),
                           has_bias() ? bias_.data() : nullptr, y);
  }

 private:
  static ConstRowsMap<T> as_const_rows(const Matrix<T>& m) {
    return ConstRowsMap<T>(m.data(), m.rows(), m.cols(), Eigen::OuterStride<>(m.cols()));
  }

  void backward_rows(const char* function, const ConstRowsMap<T>& x, const ConstRowsMap<T>& dy,
                     RowsMap<T>* dx, Matrix<T>& weight_grad, Vector<T>& bias_grad,
                     bool accumulate) const {
    if (weight_.size() == 0)
      detail::throw_invalid_argument(function, "the layer is empty (default-constructed)");
    if (x.cols() != in_features() || dy.cols() != out_features() || dy.rows() != x.rows()) {
      detail::throw_invalid_argument(
          function, "x is " + detail::shape_string({x.rows(), x.cols()}) + " and dy is " +
                        detail::shape_string({dy.rows(), dy.cols()}) +
                        " but the weight (in, out) is " +
                        detail::shape_string({weight_.rows(), weight_.cols()}) +
                        ": need x (N, in) and dy (N, out)");
    }
    if (dx != nullptr && (dx->rows() != x.rows() || dx->cols() != x.cols())) {
      detail::throw_invalid_argument(
          function, "dx is " + detail::shape_string({dx->rows(), dx->cols()}) + " but x is " +
                        detail::shape_string({x.rows(), x.cols()}));
    }
    detail::prepare_gradient(function, "weight_grad", weight_grad, out_features(), in_features(),
                             accumulate);
    if (has_bias()) {
      detail::prepare_gradient(function, "bias_grad", bias_grad, out_features(), 1, accumulate);
    } else {
      bias_grad.resize(0);
    }
    RowsMap<T> wg(weight_grad.data(), out_features(), in_features(),
                  Eigen::OuterStride<>(in_features()));
    detail::linear_backward_into<T>(x,
                                    ConstRowsMap<T>(weight_.data(), weight_.rows(), weight_.cols(),
                                                    Eigen::OuterStride<>(weight_.cols())),
                                    dy, dx, false, &wg, has_bias() ? bias_grad.data() : nullptr,
                                    accumulate);
  }

  void check_rows(const char* function, Index rows, Index cols) const {
    if (cols != in_features()) {
      detail::throw_invalid_argument(
          function, "x is " + detail::shape_string({rows, cols}) + " but the weight (in, out) is " +
                        detail::shape_string({weight_.rows(), weight_.cols()}) +
                        ": x needs one column per input feature");
    }
  }

  Matrix<T> weight_;  // (in, out)
  Vector<T> bias_;    // (out) or empty
};

}  // namespace attn
