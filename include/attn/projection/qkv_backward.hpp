// attn/projection/qkv_backward.hpp: the backward of QKVProjection (attn/projection/qkv.hpp):
// the input gradients dx = dq Wq^T + dk Wk^T + dv Wv^T (summed where the inputs are one
// tensor) and the parameter gradients, named and laid out as MultiHeadAttention's state_dict
// (in_proj_weight, or q_proj_weight / k_proj_weight / v_proj_weight, and in_proj_bias), so
// that they compare one to one with torch's .grad.
//
// Shape legend: as attn/projection/qkv.hpp.
#pragma once

#include <string>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/projection/linear.hpp"
#include "attn/projection/qkv.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Self-attention backward: from the forward's input x (B, S, E) and the gradients dq
/// (B, S, Dq), dk (B, S, Dk), dv (B, S, Dv) of the loss with respect to q, k and v: dx
/// (B, S, E) = dq Wq^T + dk Wk^T + dv Wv^T and the parameter gradients (fused or separate
/// names, as the projection is). Fused: one GEMM for dx and one for in_proj_weight.
template <class T>
QKVProjectionGradients<T> QKVProjection<T>::backward(const Tensor<T, 3>& x,           // (B, S, E)
                                                     const Tensor<T, 3>& dq,          // (B, S, Dq)
                                                     const Tensor<T, 3>& dk,          // (B, S, Dk)
                                                     const Tensor<T, 3>& dv) const {  // (B, S, Dv)
  check_backward_tensors(x, x, x, dq, dk, dv);
  QKVProjectionGradients<T> grads;
  grads.dx.resize(x.dimension(0), x.dimension(1), x.dimension(2));
  RowsMap<T> dx = detail::rows_of(grads.dx);
  const ConstRowsMap<T> xr = detail::rows_of(x);
  backward_into(xr, xr, xr, detail::rows_of(dq), detail::rows_of(dk), detail::rows_of(dv), &dx, &dx,
                &dx, grads);
  return grads;
}

/// Cross-attention backward: x_q (B, Lq, Eq), x_k (B, Lk, Ek), x_v (B, Lk, Ev) and dq
/// (B, Lq, Dq), dk (B, Lk, Dk), dv (B, Lk, Dv) give dx_q, dx_k, dx_v (each input's own;
/// sum them yourself if two inputs were one tensor) and the parameter gradients.
template <class T>
QKVProjectionGradients<T> QKVProjection<T>::backward(const Tensor<T, 3>& x_q,         // (B, Lq, Eq)
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
                detail::rows_of(dq), detail::rows_of(dk), detail::rows_of(dv), &dx_q, &dx_k, &dx_v,
                grads);
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
template <class T>
void QKVProjection<T>::backward_into(const ConstRowsMap<T>& x_q,  // (Nq, Eq)
                                     const ConstRowsMap<T>& x_k,  // (Nk, Ek)
                                     const ConstRowsMap<T>& x_v,  // (Nk, Ev)
                                     const ConstRowsMap<T>& dq,   // (Nq, Dq)
                                     const ConstRowsMap<T>& dk,   // (Nk, Dk)
                                     const ConstRowsMap<T>& dv,   // (Nk, Dv)
                                     RowsMap<T>* dx_q,            // (Nq, Eq) or null
                                     RowsMap<T>* dx_k,            // (Nk, Ek) or null
                                     RowsMap<T>* dx_v,            // (Nk, Ev) or null
                                     QKVProjectionGradients<T>& grads, bool accumulate) const {
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
      detail::throw_invalid_argument(function, std::string(name) + " is " +
                                                   pair(dx->rows(), dx->cols()) +
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
    detail::prepare_gradient(function, "in_proj_bias", grads.din_proj_bias, total, 1, accumulate);
  else
    grads.din_proj_bias.resize(0);
  T* bias = has_bias() ? grads.din_proj_bias.data() : nullptr;
  const auto block = [](Matrix<T>& m, Index first, Index rows) {  // rows of a torch weight
    return RowsMap<T>(m.data() + first * m.cols(), rows, m.cols(), Eigen::OuterStride<>(m.cols()));
  };
  if (is_fused()) {
    const Index e = q_in();
    detail::prepare_gradient(function, "in_proj_weight", grads.din_proj_weight, total, e,
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
      RowsMap<T> wg = block(grads.din_proj_weight, 0, total);
      detail::linear_backward_into<T>(x_q, fused_weight(), dqkv, dx_q, false, &wg, bias,
                                      accumulate);
      return;
    }
  } else {
    grads.din_proj_weight.resize(0, 0);
  }
  // One Linear backward per path; an input gradient shared with an earlier path adds to it.
  const ConstRowsMap<T>* xs[3] = {&x_q, &x_k, &x_v};
  const ConstRowsMap<T>* gs[3] = {&dq, &dk, &dv};
  RowsMap<T>* dxs[3] = {dx_q, dx_k, dx_v};
  Matrix<T>* separate[3] = {&grads.dq_proj_weight, &grads.dk_proj_weight, &grads.dv_proj_weight};
  const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
  const Index first[3] = {0, q_dim(), q_dim() + k_dim()};
  const Index widths[3] = {q_dim(), k_dim(), v_dim()};
  for (int p = 0; p < 3; ++p) {
    if (!is_fused()) {
      detail::prepare_gradient(function, names[p], *separate[p], widths[p], xs[p]->cols(),
                               accumulate);
    }
    RowsMap<T> wg = is_fused() ? block(grads.din_proj_weight, first[p], widths[p])
                               : block(*separate[p], 0, widths[p]);
    // A dx shared with an earlier path sums this path into it.
    const bool accumulate_dx = (p >= 1 && same(dxs[p], dxs[0])) || (p == 2 && same(dxs[2], dxs[1]));
    const bool accumulate_parameters = accumulate;
    detail::linear_backward_into<T>(*xs[p], weight(p), *gs[p], dxs[p], accumulate_dx, &wg,
                                    bias != nullptr ? bias + first[p] : nullptr,
                                    accumulate_parameters);
  }
  if (is_fused()) {
    grads.dq_proj_weight.resize(0, 0);
    grads.dk_proj_weight.resize(0, 0);
    grads.dv_proj_weight.resize(0, 0);
  }
}

template <class T>
void QKVProjection<T>::check_backward_tensors(const Tensor<T, 3>& x_q,         // (B, Lq, Eq)
                                              const Tensor<T, 3>& x_k,         // (B, Lk, Ek)
                                              const Tensor<T, 3>& x_v,         // (B, Lk, Ev)
                                              const Tensor<T, 3>& dq,          // (B, Lq, Dq)
                                              const Tensor<T, 3>& dk,          // (B, Lk, Dk)
                                              const Tensor<T, 3>& dv) const {  // (B, Lk, Dv)
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

}  // namespace attn
