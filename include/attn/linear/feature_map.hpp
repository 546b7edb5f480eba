// attn/linear/feature_map.hpp: the feature maps phi of linear attention
// (attn/linear_attention.hpp): elu(x) + 1, relu, identity, a custom callable (with its
// vector-Jacobian product for the backward), and FAVOR+ positive random features (Choromanski et
// al. 2021, "Performer").
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// The feature maps phi of linear attention.
enum class FeatureKind : std::uint8_t {
  elu_plus_one,  ///< elu(x) + 1 > 0 (Katharopoulos et al.; the default)
  relu,          ///< max(x, 0) >= 0; a row whose normaliser is 0 outputs 0
  identity,      ///< x (the tutorial's): UNSAFE, the normaliser can be zero or negative
  favor_plus,    ///< Performer's positive random features: approximates softmax attention
  custom,        ///< a user callable applied row by row
};

/// A feature map phi: (n, D) rows -> (n, M) features, applied row by row to queries and keys.
///
///   FeatureMap<T>{} or elu_plus_one()   M = D
///   relu(), identity()                  M = D
///   custom(function, M)                 M given (0 = D); function(x (n, D), phi (n, M)) must
///                                       fill phi row by row: row r of phi may depend only on
///                                       row r of x, because the library calls it on blocks of
///                                       any height (a single row when decoding), from
///                                       several threads at once when heads run in parallel
///                                       (so it must be thread-safe). It should be positive,
///                                       or normalisers can vanish (as identity's).
///   custom(function, vjp, M)            the same with its derivative, which the backward
///                                       (linear_attention_backward) needs: see Vjp below.
///   favor_plus<T>(m, D, seed)           M = m, see favor_plus below.
template <class T>
class FeatureMap {
 public:
  /// Reads x (n, D) and writes phi (n, M), both row-major with any row stride.
  using Function =
      std::function<void(const Eigen::Ref<const Matrix<T>>& x, Eigen::Ref<Matrix<T>> phi)>;
  /// The derivative of a custom map as a vector-Jacobian product: given x (n, D), its
  /// features phi (n, M) (as `Function` computed them, passed to save recomputing them) and
  /// the gradient dphi (n, M) of a loss with respect to phi, write (overwrite) dx (n, D), row
  /// r being dphi.row(r) * J(x.row(r)) with J the (M, D) Jacobian of the map at that row.
  /// This form works for maps that mix the coordinates of a row (a projection, a
  /// normaliser): a diagonal derivative could not express them. Row by row and
  /// thread-safe, like Function.
  using Vjp = std::function<void(
      const Eigen::Ref<const Matrix<T>>& x, const Eigen::Ref<const Matrix<T>>& phi,
      const Eigen::Ref<const Matrix<T>>& dphi, Eigen::Ref<Matrix<T>> dx)>;

  FeatureMap() = default;  // elu_plus_one

  static FeatureMap elu_plus_one() { return FeatureMap(FeatureKind::elu_plus_one); }
  static FeatureMap relu() { return FeatureMap(FeatureKind::relu); }
  /// phi(x) = x: the tutorial's choice. Only safe when every q_i . sum_j k_j is positive.
  static FeatureMap identity() { return FeatureMap(FeatureKind::identity); }

  /// A user feature map with `features` outputs per row (0 = as many as the head dim D).
  static FeatureMap custom(Function function, Index features = 0) {
    if (!function)
      detail::throw_invalid_argument("FeatureMap::custom", "the function is empty");
    if (features < 0) {
      detail::throw_invalid_argument(
          "FeatureMap::custom",
          "features is " + std::to_string(features) + ": must be >= 0 (0 = D)");
    }
    FeatureMap map(FeatureKind::custom);
    map.function_ = std::move(function);
    map.features_ = features;
    return map;
  }

  /// A user feature map with its derivative (see Vjp), so that linear_attention_backward
  /// accepts it.
  static FeatureMap custom(Function function, Vjp vjp, Index features = 0) {
    if (!vjp)
      detail::throw_invalid_argument("FeatureMap::custom", "the derivative (vjp) is empty");
    FeatureMap map = custom(std::move(function), features);
    map.vjp_ = std::move(vjp);
    return map;
  }

  /// FAVOR+ from a given projection omega (m, D): phi(x) = exp(omega x' - |x'|^2 / 2) / sqrt(m)
  /// with x' = x D^(-1/4). favor_plus() below draws omega.
  static FeatureMap favor_plus_from(const Matrix<T>& omega) {  // (m, D)
    if (omega.rows() < 1 || omega.cols() < 1) {
      detail::throw_invalid_argument(
          "favor_plus", "the projection is " + detail::shape_string({omega.rows(), omega.cols()}) +
                            ": need m >= 1 features and D >= 1");
    }
    FeatureMap map(FeatureKind::favor_plus);
    map.omega_ = omega;
    map.features_ = omega.rows();
    const T input_scale = T(1) / std::sqrt(std::sqrt(static_cast<T>(omega.cols())));  // D^-1/4
    map.omega_t_scaled_ = omega.transpose() * input_scale;                            // (D, m)
    map.half_squared_scale_ = T(0.5) * input_scale * input_scale;
    map.output_scale_ = T(1) / std::sqrt(static_cast<T>(omega.rows()));
    return map;
  }

  FeatureKind kind() const { return kind_; }
  /// M for queries and keys of head dim `dim`.
  Index features(Index dim) const {
    return kind_ == FeatureKind::custom || kind_ == FeatureKind::favor_plus
               ? (features_ > 0 ? features_ : dim)
               : dim;
  }
  /// FAVOR+: the random projection omega (m, D); empty for the other maps.
  const Matrix<T>& projection() const { return omega_; }
  /// Whether the backward can differentiate the map: every built-in map, and custom maps
  /// built with a Vjp.
  bool has_derivative() const { return kind_ != FeatureKind::custom || static_cast<bool>(vjp_); }

  const char* name() const {
    switch (kind_) {
      case FeatureKind::elu_plus_one:
        return "elu_plus_one";
      case FeatureKind::relu:
        return "relu";
      case FeatureKind::identity:
        return "identity";
      case FeatureKind::favor_plus:
        return "favor_plus";
      case FeatureKind::custom:
        return "custom";
    }
    return "unknown";
  }

  /// Query features, phi (n, M). FAVOR+ subtracts each row's largest exponent before exp (a
  /// per-row factor, which cancels between numerator and normaliser).
  void apply_queries(const Eigen::Ref<const Matrix<T>>& x,  // (n, D)
                     Eigen::Ref<Matrix<T>> phi) const {     // (n, M)
    if (kind_ == FeatureKind::favor_plus) {
      favor_exponents(x, phi);
      for (Index r = 0; r < phi.rows(); ++r)
        phi.row(r).array() = ((phi.row(r).array() - phi.row(r).maxCoeff()).exp()) * output_scale_;
      return;
    }
    apply_elementwise(x, phi);
  }

  /// FAVOR+ key features may reach exp(favor_shift_margin) / sqrt(m) before the shift is
  /// raised: e^20 = 4.9e8, far from overflow even summed over millions of keys in float.
  static constexpr T favor_shift_margin = T(20);

  /// Key features, phi (n, M). FAVOR+ subtracts one shift shared by every key of a head
  /// (which cancels between numerator and normaliser): `shift` (start at -inf) may be raised
  /// by this block's keys, and the function returns the factor exp(old - new) by which sums
  /// over earlier keys must be rescaled (1 for the other maps).
  ///
  /// `owner`, if given, receives where the shift now comes from when this block raises it:
  /// {row of x, feature}; left alone otherwise. The backward differentiates through that
  /// exponent (the shift is a function of one key's exponent, not a constant).
  T apply_keys(const Eigen::Ref<const Matrix<T>>& x,  // (n, D)
               Eigen::Ref<Matrix<T>> phi,             // (n, M)
               T& shift, std::pair<Index, Index>* owner = nullptr) const {
    if (kind_ != FeatureKind::favor_plus) {
      apply_elementwise(x, phi);
      return T(1);
    }
    favor_exponents(x, phi);
    // The shift is the first key's largest exponent, raised to a later key's when that one
    // exceeds it by more than favor_shift_margin. Scanning the keys in order makes the shift
    // the same however the keys are grouped into blocks (one at a time when decoding), so
    // the recurrent state and the chunked batch agree to rounding, eps included.
    T new_shift = shift;
    const T minus_infinity = -std::numeric_limits<T>::infinity();
    for (Index r = 0; r < phi.rows(); ++r) {
      Index feature = 0;
      const T row_max = owner == nullptr ? phi.row(r).maxCoeff() : phi.row(r).maxCoeff(&feature);
      if (new_shift == minus_infinity ? row_max > minus_infinity
                                      : row_max > new_shift + favor_shift_margin) {
        new_shift = row_max;  // comparisons are false for NaN: NaN then reaches phi below
        if (owner != nullptr)
          *owner = {r, feature};
      }
    }
    const T rescale = new_shift == shift ? T(1) : std::exp(shift - new_shift);
    shift = new_shift;
    phi.array() = (phi.array() - shift).exp() * output_scale_;
    return rescale;
  }

  /// Key features with a given shift (FAVOR+: exp(exponent - shift) / sqrt(m); the other
  /// maps ignore it): the backward recomputes the features a chunk of queries saw.
  void apply_keys_at(const Eigen::Ref<const Matrix<T>>& x,  // (n, D)
                     Eigen::Ref<Matrix<T>> phi,             // (n, M)
                     T shift) const {
    if (kind_ != FeatureKind::favor_plus) {
      apply_elementwise(x, phi);
      return;
    }
    favor_exponents(x, phi);
    phi.array() = (phi.array() - shift).exp() * output_scale_;
  }

  /// apply_queries, also giving (FAVOR+) each row's largest exponent's feature, argmax (n):
  /// the row's shift is that exponent, which the backward differentiates through.
  void apply_queries(const Eigen::Ref<const Matrix<T>>& x,  // (n, D)
                     Eigen::Ref<Matrix<T>> phi,             // (n, M)
                     std::vector<Index>& argmax) const {
    argmax.assign(static_cast<std::size_t>(x.rows()), 0);
    if (kind_ != FeatureKind::favor_plus) {
      apply_elementwise(x, phi);
      return;
    }
    favor_exponents(x, phi);
    for (Index r = 0; r < phi.rows(); ++r) {
      Index feature = 0;
      const T row_max = phi.row(r).maxCoeff(&feature);
      argmax[static_cast<std::size_t>(r)] = feature;
      phi.row(r).array() = ((phi.row(r).array() - row_max).exp()) * output_scale_;
    }
  }

  /// The vector-Jacobian product of the map, shifts held fixed: dx (n, D) from x (n, D), its
  /// features phi (n, M) and dphi (n, M). Throws for a custom map without a derivative.
  ///   elu + 1   dx = dphi * exp(min(x, 0))        (1 for x > 0; continuous at 0)
  ///   relu      dx = dphi * (x > 0)               (0 at x = 0, as torch)
  ///   identity  dx = dphi
  ///   FAVOR+    dx = da omega D^(-1/4) - x D^(-1/2) rowsum(da),  da = dphi * phi
  ///   custom    the Vjp it was built with
  /// Products, not selects, so that a NaN dphi stays NaN where the derivative is 0.
  void vjp(const Eigen::Ref<const Matrix<T>>& x,     // (n, D)
           const Eigen::Ref<const Matrix<T>>& phi,   // (n, M)
           const Eigen::Ref<const Matrix<T>>& dphi,  // (n, M)
           Eigen::Ref<Matrix<T>> dx) const {         // (n, D)
    switch (kind_) {
      case FeatureKind::elu_plus_one:
        dx.array() = dphi.array() * x.array().min(T(0)).exp();
        return;
      case FeatureKind::relu:
        dx.array() = dphi.array() * (x.array() > T(0)).template cast<T>();
        return;
      case FeatureKind::identity:
        dx = dphi;
        return;
      case FeatureKind::favor_plus: {
        // da is formed in dx's place only when M = D; a temporary otherwise.
        const Matrix<T> da = (dphi.array() * phi.array()).matrix();  // (n, M)
        dx.noalias() = da * omega_t_scaled_.transpose();
        dx -= (T(2) * half_squared_scale_ * da.rowwise().sum()).asDiagonal() * x;
        return;
      }
      case FeatureKind::custom:
        if (!vjp_) {
          detail::throw_invalid_argument("FeatureMap::vjp",
                                         "this custom feature map has no derivative: build it "
                                         "with FeatureMap::custom(function, vjp, features)");
        }
        vjp_(x, phi, dphi, dx);
        return;
    }
  }

  /// FAVOR+: dx (1, D) += weight * d(exponent `feature`)/dx at x (1, D), the gradient
  /// through a shift that is that exponent: omega_feature D^(-1/4) - x D^(-1/2).
  template <class DX, class DOut>
  void add_exponent_gradient(const Eigen::MatrixBase<DX>& x, Index feature, T weight,
                             Eigen::MatrixBase<DOut>& dx) const {
    dx += weight * (omega_t_scaled_.col(feature).transpose() - T(2) * half_squared_scale_ * x);
  }

 private:
  explicit FeatureMap(FeatureKind kind) : kind_(kind) {}

  void apply_elementwise(const Eigen::Ref<const Matrix<T>>& x, Eigen::Ref<Matrix<T>> phi) const {
    switch (kind_) {
      // Written with max/min rather than select(), which Eigen 3.4 does not vectorise (the
      // scalar exp then cost more than the GEMMs). Eigen's max(x, 0) and min(x, 0) follow
      // std::max/std::min, scalar and vectorised: a NaN x comes back as NaN (tested).
      case FeatureKind::elu_plus_one:  // max(x, 0) + exp(min(x, 0)) = x + 1 or exp(x)
        phi.array() = x.array().max(T(0)) + x.array().min(T(0)).exp();
        return;
      case FeatureKind::relu:
        phi.array() = x.array().max(T(0));
        return;
      case FeatureKind::identity:
        phi = x;
        return;
      case FeatureKind::custom:
        function_(x, phi);
        return;
      case FeatureKind::favor_plus:
        break;
    }
  }

  // phi = omega x' - |x'|^2 / 2, x' = x D^(-1/4), before the exp.
  void favor_exponents(const Eigen::Ref<const Matrix<T>>& x, Eigen::Ref<Matrix<T>> phi) const {
    phi.noalias() = x * omega_t_scaled_;
    for (Index r = 0; r < x.rows(); ++r)
      phi.row(r).array() -= half_squared_scale_ * x.row(r).squaredNorm();
  }

  FeatureKind kind_ = FeatureKind::elu_plus_one;
  Function function_;
  Vjp vjp_;
  Index features_ = 0;
  Matrix<T> omega_;           // (m, D)
  Matrix<T> omega_t_scaled_;  // (D, m) = omega^T D^(-1/4)
  T half_squared_scale_ = T(0);
  T output_scale_ = T(1);
};

namespace detail {

/// A standard normal draw from a 64-bit engine (Box-Muller, in double), so that FAVOR+
/// projections are the same with every standard library (std::normal_distribution is not).
class NormalSampler {
 public:
  explicit NormalSampler(std::uint64_t seed) : engine_(seed) {}
  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    constexpr double two_pi = 6.283185307179586476925286766559;
    constexpr double to_unit = 1.0 / 9007199254740992.0;                       // 2^-53
    const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * to_unit;  // (0, 1]
    const double u2 = static_cast<double>(engine_() >> 11) * to_unit;          // [0, 1)
    const double radius = std::sqrt(-2.0 * std::log(u1));
    spare_ = radius * std::sin(two_pi * u2);
    has_spare_ = true;
    return radius * std::cos(two_pi * u2);
  }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace detail

/// FAVOR+ (Performer) positive orthogonal random features, m of them for head dim D,
/// drawn deterministically from `seed` (std::mt19937_64 and our own normal sampler, so the
/// same seed gives the same projection with any standard library).
///
///   phi(x) = exp(omega x' - |x'|^2 / 2) / sqrt(m),  x' = x D^(-1/4)   (M = m)
///
/// E[phi(q) . phi(k)] = exp(q . k / sqrt(D)), so linear attention with this map is an unbiased
/// estimate (per kernel value) of softmax attention with the default scale 1/sqrt(D); the
/// error falls like 1/sqrt(m). omega: blocks of D orthogonal rows (Gram-Schmidt on Gaussian
/// matrices, in double), each row rescaled to the norm of an independent Gaussian vector.
/// Stabilisers: each query row subtracts its own largest exponent, keys one shift per head
/// (the first key's largest exponent, raised when a later key exceeds it by more than 20), so
/// exp never overflows; both cancel in the ratio except against eps.
template <class T>
FeatureMap<T> favor_plus(Index features,  // m
                         Index dim,       // D
                         std::uint64_t seed) {
  if (features < 1 || dim < 1) {
    detail::throw_invalid_argument("favor_plus", "m is " + std::to_string(features) + " and D is " +
                                                     std::to_string(dim) + ": both must be >= 1");
  }
  detail::NormalSampler normal(seed);
  Eigen::MatrixXd omega(features, dim);  // (m, D)
  Eigen::MatrixXd block(dim, dim);       // (D, D): rows made orthonormal
  for (Index row0 = 0; row0 < features; row0 += dim) {
    for (Index r = 0; r < dim; ++r)
      for (Index c = 0; c < dim; ++c)
        block(r, c) = normal();
    // Modified Gram-Schmidt on the rows (a Gaussian matrix has full rank almost surely).
    for (Index r = 0; r < dim; ++r) {
      for (Index s = 0; s < r; ++s)
        block.row(r) -= block.row(r).dot(block.row(s)) * block.row(s);
      block.row(r) /= block.row(r).norm();
    }
    const Index rows = std::min(dim, features - row0);
    for (Index r = 0; r < rows; ++r) {
      double squared = 0;  // the norm of an independent Gaussian vector: chi with D dof
      for (Index c = 0; c < dim; ++c) {
        const double g = normal();
        squared += g * g;
      }
      omega.row(row0 + r) = block.row(r) * std::sqrt(squared);
    }
  }
  return FeatureMap<T>::favor_plus_from(Matrix<T>(omega.cast<T>()));
}

}  // namespace attn
