// attn/projection.hpp: linear layers and the Q/K/V projection of attention.
//
// Shape legend: B batch, S (Lq, Lk) sequence length, N = B*S rows, E / in input width,
// out output width, Dq / Dk / Dv projected widths of q, k and v.
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
// Backward (training): Linear::backward(x, dy) and QKVProjection::backward(x, dq, dk, dv)
// need only the forward's input x and the gradient of the loss with respect to the output;
// they return dx and the parameter gradients in PyTorch's names and layouts, so that they
// compare one to one with torch's .grad: Linear's weight gradient is (out, in) like
// nn.Linear.weight, QKVProjection's are named as MultiHeadAttention's state_dict
// (in_proj_weight, or q_proj_weight / k_proj_weight / v_proj_weight, and in_proj_bias).
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
  Input dx;          ///< (N, in) or (B, S, in): the gradient with respect to the input
  Matrix<T> weight;  ///< (out, in): torch's weight.grad, our W transposed
  Vector<T> bias;    ///< (out): torch's bias.grad; empty without a bias
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
    backward_rows("Linear::backward", as_const_rows(xr), as_const_rows(dyr), &dx, grads.weight,
                  grads.bias, false);
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
    backward_rows("Linear::backward", detail::rows_of(x), detail::rows_of(dy), &dx, grads.weight,
                  grads.bias, false);
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

/// The result of a QKV projection: q (B, Lq, Dq), k (B, Lk, Dk), v (B, Lk, Dv), either in
/// one fused buffer (B, S, Dq + Dk + Dv) (self-attention, fused weights) or in three
/// buffers. Either way the accessors are zero-copy views.
template <class T>
class QKV {
 public:
  Index batch() const { return batch_; }
  Index q_length() const { return q_length_; }
  Index kv_length() const { return kv_length_; }
  Index q_dim() const { return q_dim_; }
  Index k_dim() const { return k_dim_; }
  Index v_dim() const { return v_dim_; }
  bool is_fused() const { return fused_; }

  /// (B*Lq, Dq), (B*Lk, Dk), (B*Lk, Dv) row views (a column block of the fused buffer).
  ConstRowsMap<T> q() const { return rows(q_data(), batch_ * q_length_, q_dim_, q_stride()); }
  ConstRowsMap<T> k() const { return rows(k_data(), batch_ * kv_length_, k_dim_, k_stride()); }
  ConstRowsMap<T> v() const { return rows(v_data(), batch_ * kv_length_, v_dim_, v_stride()); }

  /// Head views (B, H, L, D) over the (B, L, H, D) memory: what the attention kernels read.
  /// `heads` must divide the width.
  HeadsView<const T> q_heads(Index heads) const {
    return heads_view("QKV::q_heads", q_data(), q_length_, q_dim_, q_stride(), heads);
  }
  HeadsView<const T> k_heads(Index heads) const {
    return heads_view("QKV::k_heads", k_data(), kv_length_, k_dim_, k_stride(), heads);
  }
  HeadsView<const T> v_heads(Index heads) const {
    return heads_view("QKV::v_heads", v_data(), kv_length_, v_dim_, v_stride(), heads);
  }

  /// The buffers (fused: only `fused_buffer` is used, (B*S, Dq+Dk+Dv)).
  const Matrix<T>& fused_buffer() const { return qkv_; }

 private:
  template <class>
  friend class QKVProjection;

  static ConstRowsMap<T> rows(const T* p, Index r, Index c, Index stride) {
    return ConstRowsMap<T>(p, r, c, Eigen::OuterStride<>(stride));
  }
  HeadsView<const T> heads_view(const char* function, const T* p, Index length, Index width,
                                Index stride, Index heads) const {
    if (heads < 1 || width % heads != 0) {
      detail::throw_invalid_argument(
          function,
          "width " + std::to_string(width) + " is not divisible by heads " + std::to_string(heads));
    }
    return {p, batch_, heads, length, width / heads, length * stride, width / heads, stride};
  }
  Index total() const { return q_dim_ + k_dim_ + v_dim_; }
  const T* q_data() const { return fused_ ? qkv_.data() : q_.data(); }
  const T* k_data() const { return fused_ ? qkv_.data() + q_dim_ : k_.data(); }
  const T* v_data() const { return fused_ ? qkv_.data() + q_dim_ + k_dim_ : v_.data(); }
  Index q_stride() const { return fused_ ? total() : q_dim_; }
  Index k_stride() const { return fused_ ? total() : k_dim_; }
  Index v_stride() const { return fused_ ? total() : v_dim_; }

  Index batch_ = 0, q_length_ = 0, kv_length_ = 0, q_dim_ = 0, k_dim_ = 0, v_dim_ = 0;
  bool fused_ = false;
  Matrix<T> qkv_;        // fused: (B*S, Dq + Dk + Dv)
  Matrix<T> q_, k_, v_;  // separate: (B*Lq, Dq), (B*Lk, Dk), (B*Lk, Dv)
};

/// The gradients of a QKVProjection, named as MultiHeadAttention's state_dict names the
/// parameters (torch.nn.MultiheadAttention's; shapes (out, in) as there), so that each
/// compares one to one with torch's .grad of the same name.
template <class T>
struct QKVProjectionGradients {
  Tensor<T, 3> dx;           ///< self-attention backward(x, ...): (B, S, E), the q, k and v paths
                             ///< summed; empty after the cross-attention backward
  Tensor<T, 3> dx_q;         ///< cross-attention: (B, Lq, Eq); empty after the self-attention one
  Tensor<T, 3> dx_k;         ///< cross-attention: (B, Lk, Ek)
  Tensor<T, 3> dx_v;         ///< cross-attention: (B, Lk, Ev)
  Matrix<T> in_proj_weight;  ///< fused: (Dq + Dk + Dv, E); empty when separate
  Matrix<T> q_proj_weight;   ///< separate: (Dq, Eq); empty when fused
  Matrix<T> k_proj_weight;   ///< separate: (Dk, Ek)
  Matrix<T> v_proj_weight;   ///< separate: (Dv, Ev)
  Vector<T> in_proj_bias;    ///< (Dq + Dk + Dv) in both forms (torch keeps one in_proj_bias
                             ///< even with separate weights); empty without biases
};

/// Q, K and V projections: q = x_q Wq + bq, k = x_k Wk + bk, v = x_v Wv + bv.
///   separate: three Linear layers, each with its own input and output width (cross-attention
///             from other widths; Dk may differ from Dv and from E);
///   fused:    one weight (E, Dq + Dk + Dv) = [Wq | Wk | Wv] and one GEMM for self-attention;
///             q, k and v are column blocks of the one result (views, no copy).
/// Both forms give the same numbers for the same weights (to rounding of the GEMM blocking).
/// Dq and Dk may differ (grouped-query attention: Dq = H*D, Dk = Hkv*D); what must agree is
/// the per-head dim, which the head views check.
template <class T>
class QKVProjection {
 public:
  QKVProjection() = default;

  /// Separate projections.
  QKVProjection(Linear<T> q, Linear<T> k, Linear<T> v)
      : q_(std::move(q)), k_(std::move(k)), v_(std::move(v)) {
    if (q_.has_bias() != k_.has_bias() || q_.has_bias() != v_.has_bias()) {
      detail::throw_invalid_argument("QKVProjection",
                                     "q, k and v must all have a bias or all have none");
    }
  }

  /// Fresh projections like PyTorch's MultiheadAttention: xavier_uniform on the stacked
  /// (E, Dq + Dk + Dv) weight (or on each weight when the input widths differ), drawn with
  /// std::mt19937_64(seed); zero biases. kdim/vdim are the key and value input widths.
  /// The fused form is used when kdim == vdim == embed_dim.
  static QKVProjection make(Index embed_dim, Index q_dim, Index k_dim, Index v_dim, bool bias,
                            std::uint64_t seed = 0, Index kdim = 0, Index vdim = 0) {
    if (kdim == 0)
      kdim = embed_dim;
    if (vdim == 0)
      vdim = embed_dim;
    if (embed_dim < 1 || q_dim < 1 || k_dim < 1 || v_dim < 1 || kdim < 1 || vdim < 1) {
      detail::throw_invalid_argument(
          "QKVProjection::make",
          "widths (embed_dim, q_dim, k_dim, v_dim, kdim, vdim) are " +
              detail::shape_string({embed_dim, q_dim, k_dim, v_dim, kdim, vdim}) +
              ": all must be positive");
    }
    std::mt19937_64 engine(seed);
    const auto zeros = [bias](Index n) {
      return bias ? Vector<T>(Vector<T>::Zero(n)) : Vector<T>();
    };
    if (kdim == embed_dim && vdim == embed_dim) {
      return fused(xavier_uniform<T>(embed_dim, q_dim + k_dim + v_dim, engine),
                   zeros(q_dim + k_dim + v_dim), q_dim, k_dim, v_dim);
    }
    Matrix<T> wq = xavier_uniform<T>(embed_dim, q_dim, engine);
    Matrix<T> wk = xavier_uniform<T>(kdim, k_dim, engine);
    Matrix<T> wv = xavier_uniform<T>(vdim, v_dim, engine);
    return QKVProjection(Linear<T>(std::move(wq), zeros(q_dim)),
                         Linear<T>(std::move(wk), zeros(k_dim)),
                         Linear<T>(std::move(wv), zeros(v_dim)));
  }

  /// Fused form from W = [Wq | Wk | Wv] (E, Dq + Dk + Dv) and b = [bq, bk, bv] or empty.
  static QKVProjection fused(Matrix<T> weight, Vector<T> bias, Index q_dim, Index k_dim,
                             Index v_dim) {
    if (q_dim < 1 || k_dim < 1 || v_dim < 1 || q_dim + k_dim + v_dim != weight.cols()) {
      detail::throw_invalid_argument(
          "QKVProjection::fused",
          "weight (E, Dq + Dk + Dv) is " + detail::shape_string({weight.rows(), weight.cols()}) +
              " but (Dq, Dk, Dv) is " + detail::shape_string({q_dim, k_dim, v_dim}) +
              ": need positive widths and Dq + Dk + Dv columns");
    }
    QKVProjection p;
    p.fused_ = Linear<T>(std::move(weight), std::move(bias));
    p.is_fused_ = true;
    p.q_dim_ = q_dim;
    p.k_dim_ = k_dim;
    p.v_dim_ = v_dim;
    return p;
  }

  /// Fused form from PyTorch's in_proj_weight (Dq + Dk + Dv, E) and in_proj_bias or empty.
  static QKVProjection fused_from_torch(const Eigen::Ref<const Matrix<T>>& in_proj_weight,
                                        const Eigen::Ref<const Vector<T>>& in_proj_bias,
                                        Index q_dim, Index k_dim, Index v_dim) {
    if (in_proj_bias.size() != 0 && in_proj_bias.size() != in_proj_weight.rows()) {
      detail::throw_invalid_argument(
          "QKVProjection::fused_from_torch",
          "in_proj_weight is " +
              detail::shape_string({in_proj_weight.rows(), in_proj_weight.cols()}) +
              " but in_proj_bias is " + detail::shape_string({in_proj_bias.size()}) +
              ": need one bias per weight row");
    }
    return fused(Matrix<T>(in_proj_weight.transpose()), Vector<T>(in_proj_bias), q_dim, k_dim,
                 v_dim);
  }

  /// The separate form of a fused projection (copies the weight blocks).
  QKVProjection separated() const {
    if (!is_fused_)
      return *this;
    const Matrix<T>& w = fused_.weight();
    const auto part = [&](Index first, Index n) {
      return Linear<T>(
          Matrix<T>(w.middleCols(first, n)),
          fused_.has_bias() ? Vector<T>(fused_.bias().segment(first, n)) : Vector<T>());
    };
    return QKVProjection(part(0, q_dim_), part(q_dim_, k_dim_), part(q_dim_ + k_dim_, v_dim_));
  }

  /// The fused form of separate projections with one input width (copies the weights).
  QKVProjection fused_form() const {
    if (is_fused_)
      return *this;
    if (q_.in_features() != k_.in_features() || q_.in_features() != v_.in_features()) {
      detail::throw_invalid_argument(
          "QKVProjection::fused_form",
          "input widths (q, k, v) are " +
              detail::shape_string({q_.in_features(), k_.in_features(), v_.in_features()}) +
              ": fusing needs one input width");
    }
    Matrix<T> w(q_.in_features(), q_dim() + k_dim() + v_dim());
    w << q_.weight(), k_.weight(), v_.weight();
    Vector<T> b;
    if (q_.has_bias()) {
      b.resize(w.cols());
      b << q_.bias(), k_.bias(), v_.bias();
    }
    return fused(std::move(w), std::move(b), q_dim(), k_dim(), v_dim());
  }

  bool is_fused() const { return is_fused_; }
  bool has_bias() const { return is_fused_ ? fused_.has_bias() : q_.has_bias(); }
  Index q_dim() const { return is_fused_ ? q_dim_ : q_.out_features(); }
  Index k_dim() const { return is_fused_ ? k_dim_ : k_.out_features(); }
  Index v_dim() const { return is_fused_ ? v_dim_ : v_.out_features(); }
  Index q_in() const { return is_fused_ ? fused_.in_features() : q_.in_features(); }
  Index k_in() const { return is_fused_ ? fused_.in_features() : k_.in_features(); }
  Index v_in() const { return is_fused_ ? fused_.in_features() : v_.in_features(); }

  /// Weight (in, out) views of Wq, Wk, Wv (column blocks of the fused weight when fused).
  ConstRowsMap<T> wq() const { return weight_block(0); }
  ConstRowsMap<T> wk() const { return weight_block(1); }
  ConstRowsMap<T> wv() const { return weight_block(2); }
  /// Bias pointers (null without bias).
  const T* bq() const { return bias_block(0); }
  const T* bk() const { return bias_block(1); }
  const T* bv() const { return bias_block(2); }
  /// The fused (E, Dq + Dk + Dv) layer (valid only when is_fused()).
  const Linear<T>& fused_linear() const { return fused_; }

  /// Self-attention: q, k, v from one x (B, S, E). Fused: one GEMM into one buffer.
  QKV<T> operator()(const Tensor<T, 3>& x) const {
    QKV<T> out;
    project_into(x, x, x, out);
    return out;
  }

  /// Cross-attention: q from x_q (B, Lq, Eq), k from x_k (B, Lk, Ek), v from x_v (B, Lk, Ev).
  QKV<T> operator()(const Tensor<T, 3>& x_q, const Tensor<T, 3>& x_k,
                    const Tensor<T, 3>& x_v) const {
    QKV<T> out;
    project_into(x_q, x_k, x_v, out);
    return out;
  }

  /// Same, reusing `out`'s buffers (no allocation when the shapes repeat). The fused
  /// one-GEMM path is taken when the projection is fused and x_q, x_k and x_v are the same
  /// tensor (same data pointer).
  void project_into(const Tensor<T, 3>& x_q, const Tensor<T, 3>& x_k, const Tensor<T, 3>& x_v,
                    QKV<T>& out) const {
    constexpr const char* function = "QKVProjection";
    const auto shapes = [&] {
      return detail::shape3("x_q", x_q.dimension(0), x_q.dimension(1), x_q.dimension(2)) + ", " +
             detail::shape3("x_k", x_k.dimension(0), x_k.dimension(1), x_k.dimension(2)) + ", " +
             detail::shape3("x_v", x_v.dimension(0), x_v.dimension(1), x_v.dimension(2));
    };
    if (q_dim() == 0)
      detail::throw_invalid_argument(function, "the projection is empty");
    if (x_q.dimension(0) != x_k.dimension(0) || x_q.dimension(0) != x_v.dimension(0)) {
      detail::throw_invalid_argument(function, shapes() + ": batch sizes differ");
    }
    if (x_k.dimension(1) != x_v.dimension(1)) {
      detail::throw_invalid_argument(function, shapes() + ": key and value lengths differ");
    }
    if (x_q.dimension(2) != q_in() || x_k.dimension(2) != k_in() || x_v.dimension(2) != v_in()) {
      detail::throw_invalid_argument(function, shapes() + " but the input widths (q, k, v) are " +
                                                   detail::shape_string({q_in(), k_in(), v_in()}));
    }
    const Index batch = x_q.dimension(0);
    out.batch_ = batch;
    out.q_length_ = x_q.dimension(1);
    out.kv_length_ = x_k.dimension(1);
    out.q_dim_ = q_dim();
    out.k_dim_ = k_dim();
    out.v_dim_ = v_dim();
    const bool same_input = x_q.data() == x_k.data() && x_q.data() == x_v.data() &&
                            x_q.dimension(1) == x_k.dimension(1);
    out.fused_ = is_fused_ && same_input;
    if (out.fused_) {
      const Index n = batch * x_q.dimension(1);
      out.qkv_.resize(n, out.total());
      fused_.apply_into(detail::rows_of(x_q), as_rows(out.qkv_));  // one GEMM
      return;
    }
    out.q_.resize(batch * out.q_length_, q_dim());
    out.k_.resize(batch * out.kv_length_, k_dim());
    out.v_.resize(batch * out.kv_length_, v_dim());
    detail::linear_into<T>(detail::rows_of(x_q), wq(), bq(), as_rows(out.q_));
    detail::linear_into<T>(detail::rows_of(x_k), wk(), bk(), as_rows(out.k_));
    detail::linear_into<T>(detail::rows_of(x_v), wv(), bv(), as_rows(out.v_));
  }

  /// Self-attention backward: from the forward's input x (B, S, E) and the gradients dq
  /// (B, S, Dq), dk (B, S, Dk), dv (B, S, Dv) of the loss with respect to q, k and v: dx
  /// (B, S, E) = dq Wq^T + dk Wk^T + dv Wv^T and the parameter gradients (fused or separate
  /// names, as the projection is). Fused: one GEMM for dx and one for in_proj_weight.
  QKVProjectionGradients<T> backward(const Tensor<T, 3>& x,           // (B, S, E)
                                     const Tensor<T, 3>& dq,          // (B, S, Dq)
                                     const Tensor<T, 3>& dk,          // (B, S, Dk)
                                     const Tensor<T, 3>& dv) const {  // (B, S, Dv)
    check_backward_tensors(x, x, x, dq, dk, dv);
    QKVProjectionGradients<T> grads;
    grads.dx.resize(x.dimension(0), x.dimension(1), x.dimension(2));
    RowsMap<T> dx = detail::rows_of(grads.dx);
    const ConstRowsMap<T> xr = detail::rows_of(x);
    backward_into(xr, xr, xr, detail::rows_of(dq), detail::rows_of(dk), detail::rows_of(dv), &dx,
                  &dx, &dx, grads);
    return grads;
  }

  /// Cross-attention backward: x_q (B, Lq, Eq), x_k (B, Lk, Ek), x_v (B, Lk, Ev) and dq
  /// (B, Lq, Dq), dk (B, Lk, Dk), dv (B, Lk, Dv) give dx_q, dx_k, dx_v (each input's own;
  /// sum them yourself if two inputs were one tensor) and the parameter gradients.
  QKVProjectionGradients<T> backward(const Tensor<T, 3>& x_q,         // (B, Lq, Eq)
                                     const Tensor<T, 3>& x_k,         // (B, Lk, Ek)
                                     const Tensor<T, 3>& x_v,         // (B, Lk, Ev)
                                     const Tensor<T, 3>& dq,          // (B, Lq, Dq)
                                     const Tensor<T, 3>& dk,          // (B, Lk, Dk)
                                     const Tensor<T, 3>& dv) const {  // (B, Lk, Dv)
    check_backward_tensors(x_q, x_k, x_v, dq, dk, dv);
    QKVProjectionGradients<T> grads;
    grads.dx_q.resize(x_q.dimension(0), x_q.dimension(1), x_q.dimension(2));
    grads.dx_k.resize(x_k.dimension(0), x_k.dimension(1), x_k.dimension(2));
    grads.dx_v.resize(x_v.dimension(0), x_v.dimension(1), x_v.dimension(2));
    RowsMap<T> dx_q = detail::rows_of(grads.dx_q), dx_k = detail::rows_of(grads.dx_k),
               dx_v = detail::rows_of(grads.dx_v);
    backward_into(detail::rows_of(x_q), detail::rows_of(x_k), detail::rows_of(x_v),
                  detail::rows_of(dq), detail::rows_of(dk), detail::rows_of(dv), &dx_q, &dx_k,
                  &dx_v, grads);
    return grads;
  }

  /// The backward on strided rows, for building larger backwards (MultiHeadAttention's):
  /// x_q (Nq, Eq), x_k (Nk, Ek), x_v (Nk, Ev) as the forward read them, dq (Nq, Dq), dk
  /// (Nk, Dk), dv (Nk, Dv) (any strides: e.g. the column blocks of one (N, Dq + Dk + Dv)
  /// buffer). dx_q, dx_k, dx_v receive the input gradients (null: not computed); when two or
  /// three of them have the same data they are one input's gradient and the paths are summed
  /// there (self-attention). The parameter gradients go to `grads` (its dx fields are left
  /// alone): overwritten, or with accumulate added to, as torch's .grad. One GEMM for dx and
  /// one for in_proj_weight when the projection is fused, the three inputs are one, dq, dk
  /// and dv are adjacent column blocks of one buffer and dx is one destination.
  void backward_into(const ConstRowsMap<T>& x_q,  // (Nq, Eq)
                     const ConstRowsMap<T>& x_k,  // (Nk, Ek)
                     const ConstRowsMap<T>& x_v,  // (Nk, Ev)
                     const ConstRowsMap<T>& dq,   // (Nq, Dq)
                     const ConstRowsMap<T>& dk,   // (Nk, Dk)
                     const ConstRowsMap<T>& dv,   // (Nk, Dv)
                     RowsMap<T>* dx_q,            // (Nq, Eq) or null
                     RowsMap<T>* dx_k,            // (Nk, Ek) or null
                     RowsMap<T>* dx_v,            // (Nk, Ev) or null
                     QKVProjectionGradients<T>& grads, bool accumulate = false) const {
    constexpr const char* function = "QKVProjection::backward";
    if (q_dim() == 0)
      detail::throw_invalid_argument(function, "the projection is empty");
    const auto pair = [](Index r, Index c) { return detail::shape_string({r, c}); };
    const auto check = [&](const char* name, const ConstRowsMap<T>& x, const char* gname,
                           const ConstRowsMap<T>& g, Index in, Index out) {
      if (x.cols() != in || g.cols() != out || g.rows() != x.rows()) {
        detail::throw_invalid_argument(
            function, std::string(name) + " is " + pair(x.rows(), x.cols()) + " and " + gname +
                          " is " + pair(g.rows(), g.cols()) + " but must be " + pair(x.rows(), in) +
                          " and " + pair(x.rows(), out) +
                          " (the projection's input and output widths)");
      }
    };
    check("x_q", x_q, "dq", dq, q_in(), q_dim());
    check("x_k", x_k, "dk", dk, k_in(), k_dim());
    check("x_v", x_v, "dv", dv, v_in(), v_dim());
    const auto check_dx = [&](const char* name, const RowsMap<T>* dx, const ConstRowsMap<T>& x) {
      if (dx != nullptr && (dx->rows() != x.rows() || dx->cols() != x.cols())) {
        detail::throw_invalid_argument(function,
                                       std::string(name) + " is " + pair(dx->rows(), dx->cols()) +
                                           " but its input is " + pair(x.rows(), x.cols()));
      }
    };
    check_dx("dx_q", dx_q, x_q);
    check_dx("dx_k", dx_k, x_k);
    check_dx("dx_v", dx_v, x_v);
    const auto same = [](const RowsMap<T>* a, const RowsMap<T>* b) {
      return a != nullptr && b != nullptr && a->data() == b->data();
    };
    const Index total = q_dim() + k_dim() + v_dim();
    if (has_bias())
      detail::prepare_gradient(function, "in_proj_bias", grads.in_proj_bias, total, 1, accumulate);
    else
      grads.in_proj_bias.resize(0);
    T* bias = has_bias() ? grads.in_proj_bias.data() : nullptr;
    const auto block = [](Matrix<T>& m, Index first, Index rows) {  // rows of a torch weight
      return RowsMap<T>(m.data() + first * m.cols(), rows, m.cols(),
                        Eigen::OuterStride<>(m.cols()));
    };
    if (is_fused_) {
      const Index e = fused_.in_features();
      detail::prepare_gradient(function, "in_proj_weight", grads.in_proj_weight, total, e,
                               accumulate);
      const bool one_input = x_q.data() == x_k.data() && x_q.data() == x_v.data() &&
                             x_q.rows() == x_k.rows() && x_q.outerStride() == x_k.outerStride() &&
                             x_q.outerStride() == x_v.outerStride();
      const bool adjacent = dk.data() == dq.data() + q_dim() && dv.data() == dk.data() + k_dim() &&
                            dq.outerStride() == dk.outerStride() &&
                            dq.outerStride() == dv.outerStride() && dq.rows() == dk.rows();
      const bool one_dx = (dx_q == nullptr && dx_k == nullptr && dx_v == nullptr) ||
                          (same(dx_q, dx_k) && same(dx_q, dx_v));
      if (one_input && adjacent && one_dx) {
        const ConstRowsMap<T> dqkv(dq.data(), dq.rows(), total,
                                   Eigen::OuterStride<>(dq.outerStride()));
        RowsMap<T> wg = block(grads.in_proj_weight, 0, total);
        detail::linear_backward_into<T>(x_q, weight_rows(fused_.weight(), 0, total), dqkv, dx_q,
                                        false, &wg, bias, accumulate);
        return;
      }
    } else {
      grads.in_proj_weight.resize(0, 0);
    }
    // One Linear backward per path; an input gradient shared with an earlier path adds to it.
    const ConstRowsMap<T>* xs[3] = {&x_q, &x_k, &x_v};
    const ConstRowsMap<T>* gs[3] = {&dq, &dk, &dv};
    RowsMap<T>* dxs[3] = {dx_q, dx_k, dx_v};
    Matrix<T>* separate[3] = {&grads.q_proj_weight, &grads.k_proj_weight, &grads.v_proj_weight};
    const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
    const Index first[3] = {0, q_dim(), q_dim() + k_dim()};
    const Index widths[3] = {q_dim(), k_dim(), v_dim()};
    for (int p = 0; p < 3; ++p) {
      if (!is_fused_) {
        detail::prepare_gradient(function, names[p], *separate[p], widths[p], xs[p]->cols(),
                                 accumulate);
      }
      RowsMap<T> wg = is_fused_ ? block(grads.in_proj_weight, first[p], widths[p])
                                : block(*separate[p], 0, widths[p]);
      // A dx shared with an earlier path sums this path into it.
      const bool accumulate_dx =
          (p >= 1 && same(dxs[p], dxs[0])) || (p == 2 && same(dxs[2], dxs[1]));
      const bool accumulate_parameters = accumulate;
      detail::linear_backward_into<T>(*xs[p], weight_block(p), *gs[p], dxs[p], accumulate_dx, &wg,
                                      bias != nullptr ? bias + first[p] : nullptr,
                                      accumulate_parameters);
    }
    if (is_fused_) {
      grads.q_proj_weight.resize(0, 0);
      grads.k_proj_weight.resize(0, 0);
      grads.v_proj_weight.resize(0, 0);
    }
  }

 private:
  static ConstRowsMap<T> weight_rows(const Matrix<T>& w, Index first, Index n) {  // columns
    return ConstRowsMap<T>(w.data() + first, w.rows(), n, Eigen::OuterStride<>(w.cols()));
  }
  void check_backward_tensors(const Tensor<T, 3>& x_q, const Tensor<T, 3>& x_k,
                              const Tensor<T, 3>& x_v, const Tensor<T, 3>& dq,
                              const Tensor<T, 3>& dk, const Tensor<T, 3>& dv) const {
    const auto shape = [](const char* name, const Tensor<T, 3>& t) {
      return detail::shape3(name, t.dimension(0), t.dimension(1), t.dimension(2));
    };
    const auto fail = [&](const std::string& rule) {
      detail::throw_invalid_argument("QKVProjection::backward",
                                     shape("x_q", x_q) + ", " + shape("x_k", x_k) + ", " +
                                         shape("x_v", x_v) + ", " + shape("dq", dq) + ", " +
                                         shape("dk", dk) + ", " + shape("dv", dv) + ": " + rule);
    };
    if (q_dim() == 0)
      detail::throw_invalid_argument("QKVProjection::backward", "the projection is empty");
    if (x_q.dimension(0) != x_k.dimension(0) || x_q.dimension(0) != x_v.dimension(0))
      fail("batch sizes differ");
    if (x_k.dimension(1) != x_v.dimension(1))
      fail("key and value lengths differ");
    if (x_q.dimension(2) != q_in() || x_k.dimension(2) != k_in() || x_v.dimension(2) != v_in()) {
      fail("the input widths (q, k, v) are " + detail::shape_string({q_in(), k_in(), v_in()}));
    }
    const auto matches = [](const Tensor<T, 3>& g, const Tensor<T, 3>& x, Index width) {
      return g.dimension(0) == x.dimension(0) && g.dimension(1) == x.dimension(1) &&
             g.dimension(2) == width;
    };
    if (!matches(dq, x_q, q_dim()) || !matches(dk, x_k, k_dim()) || !matches(dv, x_v, v_dim())) {
      fail("dq, dk and dv must be (B, Lq, Dq), (B, Lk, Dk), (B, Lk, Dv) with (Dq, Dk, Dv) = " +
           detail::shape_string({q_dim(), k_dim(), v_dim()}));
    }
  }
  static RowsMap<T> as_rows(Matrix<T>& m) {
    return RowsMap<T>(m.data(), m.rows(), m.cols(), Eigen::OuterStride<>(m.cols()));
  }
  ConstRowsMap<T> weight_block(int which) const {
    if (!is_fused_) {
      const Matrix<T>& w = which == 0 ? q_.weight() : which == 1 ? k_.weight() : v_.weight();
      return ConstRowsMap<T>(w.data(), w.rows(), w.cols(), Eigen::OuterStride<>(w.cols()));
    }
    const Matrix<T>& w = fused_.weight();
    const Index first = which == 0 ? 0 : which == 1 ? q_dim_ : q_dim_ + k_dim_;
    const Index n = which == 0 ? q_dim_ : which == 1 ? k_dim_ : v_dim_;
    return ConstRowsMap<T>(w.data() + first, w.rows(), n, Eigen::OuterStride<>(w.cols()));
  }
  const T* bias_block(int which) const {
    if (!has_bias())
      return nullptr;
    if (!is_fused_) {
      return (which == 0 ? q_.bias() : which == 1 ? k_.bias() : v_.bias()).data();
    }
    return fused_.bias().data() + (which == 0 ? 0 : which == 1 ? q_dim_ : q_dim_ + k_dim_);
  }

  Linear<T> q_, k_, v_;  // separate form
  Linear<T> fused_;      // fused form: (E, Dq + Dk + Dv)
  bool is_fused_ = false;
  Index q_dim_ = 0, k_dim_ = 0, v_dim_ = 0;
};

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_PROJECTION_CLASSES(ATTN_EXTERN_CLASS)
#endif
