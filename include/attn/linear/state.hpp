// attn/linear/state.hpp: the recurrent state of causal linear attention, for token-by-token
// decoding (attn/linear_attention.hpp).
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/linear/feature_map.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// The recurrent form of causal linear attention, one head, for token-by-token decoding:
///
///   update(k, v):  S += phi(k) v^T  (M, Dv),  z += phi(k)  (M)             O(M * Dv)
///   query(q):      phi(q) S / (phi(q) . z + eps)  -> (Dv)                  O(M * Dv)
///   step(q, k, v): update(k, v), then query(q): the next output of causal linear attention
///
/// Feeding a sequence through step() gives the causal batch result (tested), in time and
/// memory independent of the position. For grouped-query attention, update once per kv head
/// and query it with each of its query heads. Not thread-safe (query uses internal buffers).
/// Extra memory: (M, Dv) + 3 M + D scalars. With FAVOR+, S and z are stored divided by
/// exp(key_shift()), the largest key exponent so far.
template <class T>
class LinearAttentionState {
 public:
  LinearAttentionState(Index dim,        // D
                       Index value_dim,  // Dv
                       FeatureMap<T> feature_map = {}, T eps = T(1e-6))
      : dim_(dim), value_dim_(value_dim), map_(std::move(feature_map)), eps_(eps) {
    constexpr const char* function = "LinearAttentionState";
    if (dim < 1 || value_dim < 0) {
      detail::throw_invalid_argument(function, "D is " + std::to_string(dim) + " and Dv is " +
                                                   std::to_string(value_dim) +
                                                   ": need D >= 1 and Dv >= 0");
    }
    if (!(eps >= T(0)) || !std::isfinite(eps)) {
      detail::throw_invalid_argument(function,
                                     "eps is " + std::to_string(eps) + ": must be finite and >= 0");
    }
    if (map_.kind() == FeatureKind::favor_plus && map_.projection().cols() != dim) {
      detail::throw_invalid_argument(
          function, "the FAVOR+ projection is " +
                        detail::shape_string({map_.projection().rows(), map_.projection().cols()}) +
                        " (m, D) but D = " + std::to_string(dim));
    }
    const Index features = map_.features(dim);
    state_.setZero(features, value_dim);
    normaliser_.setZero(features);
    input_.resize(1, dim);
    phi_.resize(1, features);
    reset();
  }

  /// Forgets every token.
  void reset() {
    state_.setZero();
    normaliser_.setZero();
    shift_ = -std::numeric_limits<T>::infinity();
    position_ = 0;
  }

  /// Adds one key k (D) and value v (Dv) to the state.
  template <class DK, class DV>
  void update(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v) {
    check_vector("update", "k", k.rows(), k.cols(), dim_);
    check_vector("update", "v", v.rows(), v.cols(), value_dim_);
    input_.row(0) = k.reshaped().transpose().template cast<T>();
    const T rescale = map_.apply_keys(input_, phi_, shift_);
    if (rescale != T(1)) {
      state_ *= rescale;
      normaliser_ *= rescale;
    }
    state_.noalias() += phi_.transpose() * v.reshaped().transpose().template cast<T>();
    normaliser_ += phi_.row(0).transpose();
    ++position_;
  }

  /// The output for query q (D) against every token so far, written to out (Dv).
  template <class DQ>
  void query_into(const Eigen::MatrixBase<DQ>& q, Eigen::Ref<Vector<T>> out) {
    check_vector("query", "q", q.rows(), q.cols(), dim_);
    if (out.size() != value_dim_) {
      detail::throw_invalid_argument("LinearAttentionState::query",
                                     "out has " + std::to_string(out.size()) +
                                         " elements but Dv = " + std::to_string(value_dim_));
    }
    input_.row(0) = q.reshaped().transpose().template cast<T>();
    map_.apply_queries(input_, phi_);
    const T denominator = phi_.row(0).dot(normaliser_.transpose()) + eps_;
    out.noalias() = (phi_ * state_).transpose();
    out /= denominator;
  }

  /// The output for query q (D): (Dv).
  template <class DQ>
  Vector<T> query(const Eigen::MatrixBase<DQ>& q) {
    Vector<T> out(value_dim_);
    query_into(q, out);
    return out;
  }

  /// update(k, v), then query(q): the output of causal linear attention at this position.
  template <class DQ, class DK, class DV>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v) {
    update(k, v);
    return query(q);
  }

  /// step() without allocating: out (Dv).
  template <class DQ, class DK, class DV>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, Eigen::Ref<Vector<T>> out) {
    update(k, v);
    query_into(q, out);
  }

  Index dim() const { return dim_; }
  Index value_dim() const { return value_dim_; }
  Index features() const { return state_.rows(); }
  /// Tokens absorbed since construction or reset().
  Index position() const { return position_; }
  /// S = sum phi(k_j) v_j^T (M, Dv) and z = sum phi(k_j) (M), divided by exp(key_shift()).
  const Matrix<T>& state() const { return state_; }
  const Vector<T>& normaliser() const { return normaliser_; }
  /// FAVOR+: the shift subtracted from every key exponent; -inf before the first key, and
  /// 0 for the other feature maps.
  T key_shift() const { return map_.kind() == FeatureKind::favor_plus ? shift_ : T(0); }

 private:
  void check_vector(const char* what, const char* name, Index rows, Index cols,
                    Index expected) const {
    if ((rows != 1 && cols != 1) || rows * cols != expected) {
      detail::throw_invalid_argument(
          (std::string("LinearAttentionState::") + what).c_str(),
          std::string(name) + " is " + detail::shape_string({rows, cols}) +
              " but must be a vector of " + std::to_string(expected) + " elements (D = " +
              std::to_string(dim_) + ", Dv = " + std::to_string(value_dim_) + ")");
    }
  }

  Index dim_, value_dim_;
  FeatureMap<T> map_;
  T eps_;
  Matrix<T> state_;       // (M, Dv)
  Vector<T> normaliser_;  // (M)
  Matrix<T> input_;       // (1, D)
  Matrix<T> phi_;         // (1, M)
  T shift_ = -std::numeric_limits<T>::infinity();
  Index position_ = 0;
};

}  // namespace attn
