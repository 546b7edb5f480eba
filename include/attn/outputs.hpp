// attn/outputs.hpp: what the attention calls return besides out, and where they write it.
//
//   forward   out (B, Hq, Lq, Dv)   and on request  logsumexp (B, Hq, Lq), weights (B, Hq, Lq, Lk)
//   backward  dq, dk, dv            and on request  dbias (the bias's dims), dsinks (Hq)
//
// The _into forms take views, strided like every input (AttentionOutputViews,
// AttentionGradientViews): an optional member left empty is not computed. The value forms
// allocate the same results as tensors (AttentionOutputs, AttentionGradients) and compute
// the optional ones named by a `Return` set, e.g. Return::logsumexp | Return::weights.
#pragma once

#include <optional>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// The optional results a value form computes besides its main ones.
enum class Return : unsigned {
  nothing_else = 0,
  logsumexp = 1u << 0,  ///< forward: the log-sum-exp of every query row (the backward's input)
  weights = 1u << 1,    ///< forward: the attention weights (Algorithm::naive only)
  dbias = 1u << 2,      ///< backward: the gradient of options.bias, in the bias's dims
  dsinks = 1u << 3,     ///< backward: the gradient of options.sinks
};

constexpr Return operator|(Return a, Return b) {
  return static_cast<Return>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}

namespace detail {

/// Whether `set` holds every result of `wanted`.
constexpr bool wants(Return set, Return wanted) {
  return (static_cast<unsigned>(set) & static_cast<unsigned>(wanted)) ==
         static_cast<unsigned>(wanted);
}

}  // namespace detail

/// Where scaled_dot_product_attention_into writes: `out` always, the others when given.
/// C is the compute scalar (float for half and bfloat16 storage).
template <class TO>
struct AttentionOutputViews {
  using C = compute_scalar_t<TO>;
  HeadsView<TO> out;                     ///< (B, Hq, Lq, Dv)
  std::optional<RowsView<C>> logsumexp;  ///< (B, Hq, Lq); packed: packed_view() of (Hq, Tq)
  std::optional<HeadsView<C>> weights;   ///< (B, Hq, Lq, Lk); padded views only

  // Implicit: a plain output view is an AttentionOutputViews without optional results.
  AttentionOutputViews(  // NOLINT(google-explicit-constructor)
      const HeadsView<TO>& out_view, std::optional<RowsView<C>> logsumexp_view = std::nullopt,
      std::optional<HeadsView<C>> weights_view = std::nullopt)
      : out(out_view), logsumexp(logsumexp_view), weights(weights_view) {}
};

/// What the forward value form returns for a `Return` set: out, and the log-sum-exp and the
/// weights when the set names them (empty tensors otherwise).
template <class T>
struct AttentionOutputs {
  using C = compute_scalar_t<T>;
  Tensor<T, 4> out;        ///< (B, Hq, Lq, Dv)
  Tensor<C, 3> logsumexp;  ///< (B, Hq, Lq) with Return::logsumexp
  Tensor<C, 4> weights;    ///< (B, Hq, Lq, Lk) with Return::weights
};

/// The same for one head (Eigen matrices).
template <class T>
struct HeadAttentionOutputs {
  using C = compute_scalar_t<T>;
  Matrix<T> out;        ///< (Lq, Dv)
  Vector<C> logsumexp;  ///< (Lq) with Return::logsumexp
  Matrix<C> weights;    ///< (Lq, Lk) with Return::weights
};

/// Where scaled_dot_product_attention_backward_into writes: dq, dk and dv always, the others
/// when given (dbias needs options.bias, dsinks options.sinks).
template <class T>
struct AttentionGradientViews {
  using C = compute_scalar_t<T>;
  HeadsView<T> dq;                                ///< (B, Hq, Lq, D)
  HeadsView<T> dk;                                ///< (B, Hkv, Lk, D)
  HeadsView<T> dv;                                ///< (B, Hkv, Lk, Dv)
  std::optional<HeadsView<C>> dbias = {};         ///< options.bias's dims (each 1 or full)
  std::optional<Eigen::Map<Vector<C>>> dsinks{};  ///< (Hq)
};

/// What the backward value form returns: dq, dk, dv, and dbias and dsinks when the `Return`
/// set names them (empty otherwise).
template <class T>
struct AttentionGradients {
  using C = compute_scalar_t<T>;
  Tensor<T, 4> dq;        ///< (B, Hq, Lq, D)
  Tensor<T, 4> dk;        ///< (B, Hkv, Lk, D)
  Tensor<T, 4> dv;        ///< (B, Hkv, Lk, Dv)
  Tensor<C, 4> dbias;     ///< options.bias's dims, with Return::dbias
  std::vector<C> dsinks;  ///< (Hq), with Return::dsinks
};

}  // namespace attn
