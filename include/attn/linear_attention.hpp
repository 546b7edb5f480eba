// attn/linear_attention.hpp: linear attention (Katharopoulos et al. 2020, "Transformers are
// RNNs"), its causal form by chunked prefix sums, a recurrent state for token-by-token
// decoding, and FAVOR+ positive random features (Choromanski et al. 2021, "Performer").
//
//   out_i = phi(q_i) S / (phi(q_i) . z + eps),   S = sum_j phi(k_j) v_j^T   (M, Dv)
//                                                z = sum_j phi(k_j)         (M)
//
// the sums running over the keys j that query i may see: every key below key_lengths[b]
// (non-causal), and also j <= i + offset (causal; offset per sequence as in mask.hpp: 0 for
// top_left, key_lengths[b] - Lq for bottom_right, Lk - Lq without key_lengths). That is
// softmax attention with exp(q . k) replaced by the kernel phi(q) . phi(k): the weights
// phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j') are a proper
// average over the keys as long as phi is positive.
//
//   q    (B, Hq,  Lq, D)   or one head (Lq, D)
//   k    (B, Hkv, Lk, D)   or (Lk, D)
//   v    (B, Hkv, Lk, Dv)  or (Lk, Dv)
//   out  (B, Hq,  Lq, Dv)  or (Lq, Dv)
//   M    features of phi: D for elu_plus_one, relu and identity; m for FAVOR+; your choice
//        for a custom map.
//
// Grouped-query attention as in attention.hpp (query head h reads kv head h / (Hq / Hkv)).
//
// Cost per kv head: non-causal O((Lq * group + Lk) * M * Dv), causal the same plus
// O(L * C * (M + Dv)) for the intra-chunk products (C = chunk rows, default 16); no (Lq, Lk)
// matrix is ever formed, and the causal form has no per-token loop: each chunk is a handful
// of GEMMs against the running state.
// Extra memory per thread: the state (M, Dv) + (M), and chunk workspaces of C * (2 M + C + 1)
// scalars: 6480 scalars (25 KiB for float) at D = Dv = M = 64, C = 16, whatever L is.
//
// Not supported (rejected with std::invalid_argument, never ignored): keep_mask and bias,
// which act on individual (query, key) scores that linear attention never forms.
//
// The self-attention tutorial (section 12) normalises by 1 / sum(q_i) with no feature map: the keys
// are missing from its normaliser, which can be zero or negative. README, "Linear attention".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/checks.hpp"
#include "attn/config.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/mask.hpp"
#include "attn/plan.hpp"
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

/// Default rows per chunk of the causal prefix sums (and of every pass over q and k), the
/// fastest in bench/bench_linear.cpp (docs/performance.md, "Tuning choices"); non-causal
/// attention does not depend on it.
inline constexpr Index default_linear_chunk = 16;

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

/// Everything about a linear attention call except the tensors.
template <class T>
struct LinearAttentionOptions {
  FeatureMap<T> feature_map;       ///< phi; default elu(x) + 1
  Causal causal = Causal::none;    ///< query i sees keys j <= i + offset (mask.hpp's alignment)
  std::vector<Index> key_lengths;  ///< (B) valid keys per batch entry; empty = all
  T eps = T(1e-6);                 ///< added to every normaliser phi(q_i) . z; with eps = 0 a
                                   ///< row whose normaliser is 0 gives NaN, not 0
  Index chunk = 0;                 ///< rows per chunk; 0 = default_linear_chunk
  /// Not supported by linear attention: must stay empty. Present so that options carried
  /// over from scaled_dot_product_attention fail loudly instead of being ignored.
  Broadcast<bool> keep_mask;
  Broadcast<T> bias;  ///< not supported either: must stay empty
};

namespace detail {

/// Per-thread buffers of the linear attention kernels: allocated once per call.
template <class T>
struct LinearWorkspace {
  Matrix<T> q_features;   // (C, M)
  Matrix<T> k_features;   // (C, M)
  Matrix<T> scores;       // (C, C) intra-chunk phi(q) phi(k)^T, causal only
  Matrix<T> state;        // (M, Dv)  S = sum phi(k_j) v_j^T
  Vector<T> normaliser;   // (M)      z = sum phi(k_j)
  Vector<T> denominator;  // (C)
  T key_shift = -std::numeric_limits<T>::infinity();  // FAVOR+ only

  void reserve(Index chunk, Index features, Index value_dim, bool causal) {
    q_features.resize(chunk, features);
    k_features.resize(chunk, features);
    if (causal)
      scores.resize(chunk, chunk);
    state.resize(features, value_dim);
    normaliser.resize(features);
    denominator.resize(chunk);
  }
  void reset() {
    state.setZero();
    normaliser.setZero();
    key_shift = -std::numeric_limits<T>::infinity();
  }
  void rescale(T factor) {
    if (factor != T(1)) {
      state *= factor;
      normaliser *= factor;
    }
  }
};

/// Adds keys [j0, j1) of one kv head to the state, `chunk` rows at a time.
template <class T>
void absorb_keys(const FeatureMap<T>& map, const HeadMatrix<const T>& k,  // (Lk, D)
                 const HeadMatrix<const T>& v,                            // (Lk, Dv)
                 Index j0, Index j1, Index chunk, LinearWorkspace<T>& ws) {
  for (Index a = j0; a < j1; a += chunk) {
    const Index n = std::min(chunk, j1 - a);
    auto phi_k = ws.k_features.topRows(n);  // (n, M)
    ws.rescale(map.apply_keys(k.middleRows(a, n), phi_k, ws.key_shift));
    ws.state.noalias() += phi_k.transpose() * v.middleRows(a, n);
    ws.normaliser.noalias() += phi_k.colwise().sum().transpose();
  }
}

/// out rows [i0, i0 + n) of one query head: phi(q) S / (phi(q) z + eps), plus, when
/// `intra_keys` > 0, the keys [kv0, kv0 + intra_keys) not yet in the state, whose features
/// are in ws.k_features: local key c is visible to local row r iff c <= r + diagonal.
template <class T>
void linear_query_chunk(const FeatureMap<T>& map, const HeadMatrix<const T>& q,  // (Lq, D)
                        const HeadMatrix<const T>& v,                            // (Lk, Dv)
                        HeadMatrix<T>& out,                                      // (Lq, Dv)
                        Index i0, Index n, Index kv0, Index intra_keys, Index diagonal, T eps,
                        LinearWorkspace<T>& ws) {
  auto phi_q = ws.q_features.topRows(n);  // (n, M)
  map.apply_queries(q.middleRows(i0, n), phi_q);
  auto out_chunk = out.middleRows(i0, n);         // (n, Dv)
  auto denominator = ws.denominator.head(n);      // (n)
  out_chunk.noalias() = phi_q * ws.state;         // pass 1: the state (keys before the chunk)
  denominator.noalias() = phi_q * ws.normaliser;  //         and its normaliser
  if (intra_keys > 0) {                           // pass 2: keys on the chunk's diagonal
    auto scores = ws.scores.topLeftCorner(n, intra_keys);  // (n, nk)
    scores.noalias() = phi_q * ws.k_features.topRows(intra_keys).transpose();
    for (Index r = 0; r < n; ++r) {  // hide keys c > r + diagonal (tril mask)
      const Index first_hidden = std::clamp(r + diagonal + 1, Index(0), intra_keys);
      scores.row(r).tail(intra_keys - first_hidden).setZero();
    }
    out_chunk.noalias() += scores * v.middleRows(kv0, intra_keys);
    denominator += scores.rowwise().sum();
  }
  out_chunk.array().colwise() /= denominator.array() + eps;  // pass 3: normalise
}

/// Linear attention for every query head that reads kv head g of batch entry b.
template <class T>
void linear_attention_kv_head(const HeadsView<const T>& q, const HeadsView<const T>& k,
                              const HeadsView<const T>& v, const HeadsView<T>& out,
                              const FeatureMap<T>& map, Index b, Index g, Index group,
                              Index key_length, Causal causal, Index chunk, T eps,
                              LinearWorkspace<T>& ws) {
  const HeadMatrix<const T> k_head = k.head(b, g);  // (Lk, D)
  const HeadMatrix<const T> v_head = v.head(b, g);  // (Lk, Dv)
  const Index q_length = q.length;
  ws.reset();
  if (causal == Causal::none) {
    absorb_keys(map, k_head, v_head, 0, key_length, chunk, ws);
    for (Index h = g * group; h < (g + 1) * group; ++h) {
      const HeadMatrix<const T> q_head = q.head(b, h);
      HeadMatrix<T> out_head = out.head(b, h);
      for (Index i0 = 0; i0 < q_length; i0 += chunk) {
        linear_query_chunk(map, q_head, v_head, out_head, i0, std::min(chunk, q_length - i0), 0, 0,
                           0, eps, ws);
      }
    }
    return;
  }
  // Causal: query i sees keys j <= i + offset (and j < key_length). Chunk [i0, i0 + n) takes
  // the keys before i0 + offset from the state and the keys [i0 + offset, i0 + offset + n)
  // (its diagonal block) through one masked (n, n) product; then those keys join the state.
  // offset: mask.hpp's per-sequence rule, from this sequence's key length.
  const Index offset = causal == Causal::top_left ? 0 : key_length - q_length;
  Index absorbed = 0;  // the state holds keys [0, absorbed)
  for (Index i0 = 0; i0 < q_length; i0 += chunk) {
    const Index n = std::min(chunk, q_length - i0);
    const Index diagonal_key = i0 + offset;  // key on row i0's diagonal
    const Index lo = std::clamp(diagonal_key, Index(0), key_length);
    const Index hi = std::clamp(diagonal_key + n, Index(0), key_length);
    if (absorbed < lo) {  // only before the first chunk (bottom_right with Lk > Lq)
      absorb_keys(map, k_head, v_head, absorbed, lo, chunk, ws);
      absorbed = lo;
    }
    const Index intra_keys = hi - lo;
    if (intra_keys > 0) {
      auto phi_k = ws.k_features.topRows(intra_keys);
      ws.rescale(map.apply_keys(k_head.middleRows(lo, intra_keys), phi_k, ws.key_shift));
    }
    for (Index h = g * group; h < (g + 1) * group; ++h) {
      HeadMatrix<T> out_head = out.head(b, h);
      linear_query_chunk(map, q.head(b, h), v_head, out_head, i0, n, lo, intra_keys,
                         diagonal_key - lo, eps, ws);
    }
    if (intra_keys > 0) {
      const auto phi_k = ws.k_features.topRows(intra_keys);
      ws.state.noalias() += phi_k.transpose() * v_head.middleRows(lo, intra_keys);
      ws.normaliser.noalias() += phi_k.colwise().sum().transpose();
      absorbed = hi;
    }
  }
}

template <class T>
void check_linear_options(const char* function, const LinearAttentionOptions<T>& options,
                          const HeadsView<const T>& q, const HeadsView<const T>& k) {
  if (!options.keep_mask.empty()) {
    const auto& d = options.keep_mask.dims();
    throw_invalid_argument(function, "keep_mask is " + shape_string({d[0], d[1], d[2], d[3]}) +
                                         ": linear attention never forms the (Lq, Lk) scores, "
                                         "so it cannot apply a boolean mask (use causal and "
                                         "key_lengths, or scaled_dot_product_attention)");
  }
  if (!options.bias.empty()) {
    const auto& d = options.bias.dims();
    throw_invalid_argument(function, "bias is " + shape_string({d[0], d[1], d[2], d[3]}) +
                                         ": linear attention never forms the (Lq, Lk) scores, "
                                         "so it cannot add a bias to them (use "
                                         "scaled_dot_product_attention)");
  }
  if (!(options.eps >= T(0)) || !std::isfinite(options.eps)) {
    throw_invalid_argument(function,
                           "eps is " + std::to_string(options.eps) + ": must be finite and >= 0");
  }
  if (options.chunk < 0) {
    throw_invalid_argument(
        function, "chunk is " + std::to_string(options.chunk) + ": must be >= 0 (0 = default)");
  }
  const FeatureMap<T>& map = options.feature_map;
  if (map.kind() == FeatureKind::favor_plus && map.projection().cols() != q.dim) {
    throw_invalid_argument(function,
                           "the FAVOR+ projection is " +
                               shape_string({map.projection().rows(), map.projection().cols()}) +
                               " (m, D) but q and k have D = " + std::to_string(q.dim));
  }
  // key_lengths: the same rules and messages as scaled_dot_product_attention.
  (void)Mask<T>(function, q.batch, q.heads, q.length, k.length, options.causal, Window{},
                options.key_lengths, {}, {});
}

/// body(b, kv head, n_k(b), workspace) for every (b, kv head) item of a call of `flops`
/// FLOPs, on the OpenMP threads when plan.hpp's rule says so (kernels/item_loop.hpp): each
/// item is computed by one thread in one order, so any thread count gives the same bits.
template <class T, class MakeWorkspace, class Body>
void for_each_kv_head(const HeadsView<const T>& q, const HeadsView<const T>& k,
                      const LinearAttentionOptions<T>& options, double flops,
                      const MakeWorkspace& make_workspace, const Body& body) {
  const Index items = q.batch * k.heads;
  for_each_item(items, runs_parallel(items, flops), make_workspace, [&](Index item, auto& ws) {
    const Index b = item / k.heads;
    const Index key_length =
        options.key_lengths.empty() ? k.length : options.key_lengths[static_cast<std::size_t>(b)];
    body(b, item % k.heads, key_length, ws);
  });
}

}  // namespace detail

/// Linear attention on (B, H, L, D) views, written into `out` (B, Hq, Lq, Dv), which may be
/// any strided view. Work is split over (batch, kv head) items with OpenMP; each item computes
/// its key/value sums once for all the query heads that share them, in the same way on any
/// thread, so results are bitwise identical for any thread count (tested).
template <class T>
void linear_attention_into(const HeadsView<const T>& q,  // (B, Hq, Lq, D)
                           const HeadsView<const T>& k,  // (B, Hkv, Lk, D)
                           const HeadsView<const T>& v,  // (B, Hkv, Lk, Dv)
                           const HeadsView<T>& out,      // (B, Hq, Lq, Dv)
                           const LinearAttentionOptions<T>& options = {}) {
  constexpr const char* function = "linear_attention";
  detail::check_attention_shapes(function, q, k, v);
  if (out.batch != q.batch || out.heads != q.heads || out.length != q.length || out.dim != v.dim) {
    detail::throw_invalid_argument(
        function, "out is " + detail::shape_string({out.batch, out.heads, out.length, out.dim}) +
                      " but must be " + detail::shape_string({q.batch, q.heads, q.length, v.dim}) +
                      " (B, Hq, Lq, Dv)");
  }
  detail::check_linear_options(function, options, q, k);
  detail::check_output_aliasing(function, q, k, v, out);

  const FeatureMap<T>& map = options.feature_map;
  const Index features = map.features(q.dim);
  const Index chunk = options.chunk > 0 ? options.chunk : default_linear_chunk;
  const bool causal = options.causal != Causal::none;
  const Index group = k.heads == 0 ? 1 : q.heads / k.heads;
  const double flops = 4.0 * static_cast<double>(q.batch * q.heads) *
                       static_cast<double>(std::max(q.length, k.length)) *
                       static_cast<double>(features) * static_cast<double>(v.dim + 1);
  const auto make_workspace = [&] {  // one per thread
    detail::LinearWorkspace<T> ws;
    ws.reserve(chunk, features, v.dim, causal);
    return ws;
  };
  detail::for_each_kv_head(q, k, options, flops, make_workspace,
                           [&](Index b, Index g, Index key_length, detail::LinearWorkspace<T>& ws) {
                             detail::linear_attention_kv_head(q, k, v, out, map, b, g, group,
                                                              key_length, options.causal, chunk,
                                                              options.eps, ws);
                           });
}

/// Batched linear attention on rank-4 row-major tensors or tensor maps (B, H, L, D).
/// Returns out (B, Hq, Lq, Dv).
template <class TQ, class TK, class TV,
          class = std::enable_if_t<detail::is_rank4_tensor_v<TQ> && detail::is_rank4_tensor_v<TK> &&
                                   detail::is_rank4_tensor_v<TV>>>
Tensor<detail::rank4_scalar_t<TQ>, 4> linear_attention(
    const TQ& q,  // (B, Hq, Lq, D)
    const TK& k,  // (B, Hkv, Lk, D)
    const TV& v,  // (B, Hkv, Lk, Dv)
    const LinearAttentionOptions<detail::rank4_scalar_t<TQ>>& options = {}) {
  using T = detail::rank4_scalar_t<TQ>;
  static_assert(std::is_same_v<T, detail::rank4_scalar_t<TK>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TV>>,
                "linear_attention: q, k and v must have the same scalar type");
  const HeadsView<const T> qv = detail::as_heads_view(q);
  const HeadsView<const T> kv = detail::as_heads_view(k);
  const HeadsView<const T> vv = detail::as_heads_view(v);
  detail::check_attention_shapes("linear_attention", qv, kv, vv);
  Tensor<T, 4> out(qv.batch, qv.heads, qv.length, vv.dim);
  linear_attention_into<T>(qv, kv, vv, bhld_view(out), options);
  return out;
}

/// One head: q (Lq, D), k (Lk, D), v (Lk, Dv) -> out (Lq, Dv). Any Eigen matrix expression
/// (column-major inputs are copied to row-major first); key_lengths, if given, has one entry.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> linear_attention(
    const Eigen::MatrixBase<DQ>& q,  // (Lq, D)
    const Eigen::MatrixBase<DK>& k,  // (Lk, D)
    const Eigen::MatrixBase<DV>& v,  // (Lk, Dv)
    const LinearAttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  static_assert(std::is_same_v<T, typename DK::Scalar> && std::is_same_v<T, typename DV::Scalar>,
                "linear_attention: q, k and v must have the same scalar type");
  using RowMajorRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
  const RowMajorRef qr(q), kr(k), vr(v);
  const auto view = [](const RowMajorRef& m) {
    return HeadsView<const T>{m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.outerStride()};
  };
  const HeadsView<const T> qv = view(qr), kv = view(kr), vv = view(vr);
  detail::check_attention_shapes("linear_attention", qv, kv, vv);
  Matrix<T> out(qr.rows(), vr.cols());
  linear_attention_into<T>(qv, kv, vv,
                           HeadsView<T>{out.data(), 1, 1, out.rows(), out.cols(), 0, 0, out.cols()},
                           options);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Backward: the gradients of a scalar loss with respect to q, k and v, given dout = dL/dout.
//
// Per query row i (of one query head) and visible key j, with A_ij = phi(q_i) . phi(k_j),
// den_i = sum_j A_ij and out_i = sum_j A_ij v_j / (den_i + eps):
//
//   u_i = dout_i / (den_i + eps)                  (Dv)
//   c_i = -(dout_i . out_i) / (den_i + eps)       scalar
//   dA_ij = u_i . v_j + c_i
//   d phi(q_i) = S_i u_i + c_i z_i                S_i, z_i: the forward's sums over i's keys
//   d phi(k_j) = R_j v_j + r_j,  dv_j = R_j^T phi(k_j)
//                R_j = sum_i phi(q_i) u_i^T  (M, Dv),  r_j = sum_i c_i phi(q_i)  (M)
//                over the query rows i that see key j (of every query head of the group)
//   dq_i, dk_j = the feature map's vector-Jacobian product of d phi(q_i), d phi(k_j)
//
// Non-causal: one S, z and one R, r for the head. Causal: pass 1 runs over the chunks in the
// forward's order with the running S, z (recomputing out_i and den_i as the forward did) and
// gives dq; pass 2 runs over them in reverse with the running R, r and gives dk and dv. The
// intra-chunk pairs go through the same masked (C, C) blocks as the forward. u and c of
// every row are kept between the passes: (group * Lq) * (Dv + 1) scalars; nothing is (L, L)
// or per position (L, M, Dv).
//
// FAVOR+ shifts are differentiated exactly, not held constant (Performer's implementations
// stop the gradient at the max). Query row i's features are exp(a_i - max(a_i)) / sqrt(m),
// and a chunk's key features exp(a_j - s_c) / sqrt(m) with s_c the head's key shift when that
// chunk ran, itself one key's exponent. Scaling all of a row's features (or all the keys a
// chunk sees) by one factor changes out_i only through eps: d out_i / d shift =
// -out_i eps / (den_i + eps), so the gradient on the shift is eps * c_i, summed over the rows
// that used it; it flows to the exponent the shift is (its row and feature). With eps = 0 it
// vanishes, and the constant treatment and the exact one coincide.
// ---------------------------------------------------------------------------------------------

/// dq, dk and dv of linear_attention_backward, shaped like q, k and v.
template <class Storage>  // Tensor<T, 4> or Matrix<T>
struct LinearAttentionGradients {
  Storage dq;  ///< (B, Hq, Lq, D) or (Lq, D)
  Storage dk;  ///< (B, Hkv, Lk, D) or (Lk, D)
  Storage dv;  ///< (B, Hkv, Lk, Dv) or (Lk, Dv)
};

namespace detail {

/// Per-thread buffers of the linear attention backward: allocated once per call.
template <class T>
struct LinearBackwardWorkspace {
  Matrix<T> q_features;       // (C, M)   phi(Q_c)
  Matrix<T> k_features;       // (C, M)   phi(K_c)
  Matrix<T> d_q_features;     // (C, M)   d phi(Q_c)
  Matrix<T> d_k_features;     // (C, M)   d phi(K_c)
  Matrix<T> scores;           // (C, C)   causal: masked phi(Q_c) phi(K_c)^T
  Matrix<T> d_scores;         // (C, C)   causal: masked dA
  Matrix<T> out;              // (C, Dv)  the forward's output rows
  Matrix<T> d_values;         // (C, Dv)  dv of the chunk's keys
  Vector<T> denominator;      // (C)      den + eps
  Matrix<T> state;            // (M, Dv)  S = sum phi(k_j) v_j^T
  Vector<T> normaliser;       // (M)      z = sum phi(k_j)
  Matrix<T> d_state;          // (M, Dv)  R = sum phi(q_i) u_i^T
  Vector<T> d_normaliser;     // (M)      r = sum c_i phi(q_i)
  Matrix<T> u;                // (group * Lq, Dv) causal, (C, Dv) non-causal
  Vector<T> c;                // (group * Lq)     causal, (C)     non-causal
  std::vector<Index> argmax;  // (C) FAVOR+: each query row's largest exponent
  // FAVOR+, one entry per chunk of queries (one for non-causal): the key shift it saw, the
  // key row and feature that shift is the exponent of ({-1, -1}: none), the gradient on it.
  std::vector<T> shifts;
  std::vector<std::pair<Index, Index>> owners;
  std::vector<T> d_shifts;
  T key_shift = -std::numeric_limits<T>::infinity();
  std::pair<Index, Index> owner{-1, -1};

  void reserve(Index chunk, Index features, Index value_dim, bool causal, Index rows) {
    q_features.resize(chunk, features);
    k_features.resize(chunk, features);
    d_q_features.resize(chunk, features);
    d_k_features.resize(chunk, features);
    if (causal) {
      scores.resize(chunk, chunk);
      d_scores.resize(chunk, chunk);
    }
    out.resize(chunk, value_dim);
    d_values.resize(chunk, value_dim);
    denominator.resize(chunk);
    state.resize(features, value_dim);
    normaliser.resize(features);
    d_state.resize(features, value_dim);
    d_normaliser.resize(features);
    u.resize(causal ? rows : chunk, value_dim);
    c.resize(causal ? rows : chunk);
  }
  void reset() {
    state.setZero();
    normaliser.setZero();
    d_state.setZero();
    d_normaliser.setZero();
    key_shift = -std::numeric_limits<T>::infinity();
    owner = {-1, -1};
    shifts.clear();
    owners.clear();
    d_shifts.clear();
  }
  /// Key features of rows [j0, j0 + n) into k_features, raising the shift as the forward
  /// does (and rescaling S, z), noting which exponent the shift comes from.
  void key_features(const FeatureMap<T>& map, const HeadMatrix<const T>& k, Index j0, Index n) {
    std::pair<Index, Index> raised{-1, -1};
    auto phi_k = k_features.topRows(n);  // (n, M)
    const T factor = map.apply_keys(k.middleRows(j0, n), phi_k, key_shift, &raised);
    if (raised.first >= 0)
      owner = {j0 + raised.first, raised.second};
    if (factor != T(1)) {
      state *= factor;
      normaliser *= factor;
    }
  }
  void absorb(const HeadMatrix<const T>& v, Index j0, Index n) {
    const auto phi_k = k_features.topRows(n);
    state.noalias() += phi_k.transpose() * v.middleRows(j0, n);
    normaliser.noalias() += phi_k.colwise().sum().transpose();
  }
};

/// Zeroes local key c > r + diagonal of row r of block (n, nk): the forward's tril mask.
template <class Block>
void hide_future_keys(Block&& block, Index diagonal) {
  const Index keys = block.cols();
  for (Index r = 0; r < block.rows(); ++r) {
    const Index first_hidden = std::clamp(r + diagonal + 1, Index(0), keys);
    block.row(r).tail(keys - first_hidden).setZero();
  }
}

/// Pass 1 on query rows [i0, i0 + n) of one head: recomputes out and den as the forward did
/// (state S, z = keys before the chunk; plus keys [kv0, kv0 + intra_keys), whose features
/// are in ws.k_features, local key c visible to local row r iff c <= r + diagonal), writes
/// u (n, Dv), c (n) and dq rows. Returns sum_r eps * c_r, the gradient on the key shift.
template <class T>
T linear_backward_query_chunk(const FeatureMap<T>& map, const HeadMatrix<const T>& q,  // (Lq, D)
                              const HeadMatrix<const T>& v,                            // (Lk, Dv)
                              const HeadMatrix<const T>& dout,                         // (Lq, Dv)
                              HeadMatrix<T>& dq,                                       // (Lq, D)
                              Index i0, Index n, Index kv0, Index intra_keys, Index diagonal, T eps,
                              Eigen::Ref<Matrix<T>> u,  // (n, Dv)
                              Eigen::Ref<Vector<T>> c,  // (n)
                              LinearBackwardWorkspace<T>& ws) {
  const auto q_rows = q.middleRows(i0, n);  // (n, D)
  const auto g = dout.middleRows(i0, n);    // (n, Dv)
  auto phi_q = ws.q_features.topRows(n);    // (n, M)
  map.apply_queries(q_rows, phi_q, ws.argmax);
  auto out = ws.out.topRows(n);               // (n, Dv)
  auto denominator = ws.denominator.head(n);  // (n)
  out.noalias() = phi_q * ws.state;           // the forward's passes 1 and 2
  denominator.noalias() = phi_q * ws.normaliser;
  const auto phi_k = ws.k_features.topRows(intra_keys);  // (nk, M)
  const auto v_intra = v.middleRows(kv0, intra_keys);    // (nk, Dv)
  if (intra_keys > 0) {
    auto scores = ws.scores.topLeftCorner(n, intra_keys);  // (n, nk)
    scores.noalias() = phi_q * phi_k.transpose();
    hide_future_keys(scores, diagonal);
    out.noalias() += scores * v_intra;
    denominator += scores.rowwise().sum();
  }
  denominator.array() += eps;
  out.array().colwise() /= denominator.array();           // the forward's output
  u.array() = g.array().colwise() / denominator.array();  // dout / (den + eps)
  c.array() = -(g.array() * out.array()).rowwise().sum() / denominator.array();
  auto d_phi_q = ws.d_q_features.topRows(n);  // (n, M)
  d_phi_q.noalias() = u * ws.state.transpose();
  d_phi_q.noalias() += c * ws.normaliser.transpose();
  if (intra_keys > 0) {
    auto d_scores = ws.d_scores.topLeftCorner(n, intra_keys);  // (n, nk)
    d_scores.noalias() = u * v_intra.transpose();
    d_scores.colwise() += c;
    hide_future_keys(d_scores, diagonal);
    d_phi_q.noalias() += d_scores * phi_k;
  }
  auto dq_rows = dq.middleRows(i0, n);
  map.vjp(q_rows, phi_q, d_phi_q, dq_rows);
  if (map.kind() == FeatureKind::favor_plus) {  // each row's own shift: its largest exponent
    for (Index r = 0; r < n; ++r) {
      auto dq_row = dq_rows.row(r);
      map.add_exponent_gradient(q_rows.row(r), ws.argmax[static_cast<std::size_t>(r)], eps * c(r),
                                dq_row);
    }
  }
  return eps * c.sum();
}

/// Pass 2 on keys [j0, j0 + n) whose features at shift `shift` the state R, r (every query
/// row that sees them, rescaled to that shift) covers: dk = vjp(R v + r), dv = R^T phi(k).
/// With `intra`, the chunk's own rows are added first (the masked (n, nk) blocks).
template <class T>
void linear_backward_keys(const FeatureMap<T>& map, const HeadMatrix<const T>& k,  // (Lk, D)
                          const HeadMatrix<const T>& v,                            // (Lk, Dv)
                          HeadMatrix<T>& dk, HeadMatrix<T>& dv, Index j0, Index n, T shift,
                          LinearBackwardWorkspace<T>& ws) {
  auto phi_k = ws.k_features.topRows(n);      // (n, M)
  auto d_phi_k = ws.d_k_features.topRows(n);  // (n, M)
  map.apply_keys_at(k.middleRows(j0, n), phi_k, shift);
  d_phi_k.noalias() = v.middleRows(j0, n) * ws.d_state.transpose();
  d_phi_k.rowwise() += ws.d_normaliser.transpose();
  auto dv_rows = dv.middleRows(j0, n);
  dv_rows.noalias() = phi_k * ws.d_state;
  auto dk_rows = dk.middleRows(j0, n);
  map.vjp(k.middleRows(j0, n), phi_k, d_phi_k, dk_rows);
}

/// The backward for every query head that reads kv head g of batch entry b.
template <class T>
void linear_backward_kv_head(const HeadsView<const T>& q, const HeadsView<const T>& k,
                             const HeadsView<const T>& v, const HeadsView<const T>& dout,
                             const HeadsView<T>& dq, const HeadsView<T>& dk, const HeadsView<T>& dv,
                             const FeatureMap<T>& map, Index b, Index g, Index group,
                             Index key_length, Causal causal, Index chunk, T eps,
                             LinearBackwardWorkspace<T>& ws) {
  const HeadMatrix<const T> k_head = k.head(b, g);  // (Lk, D)
  const HeadMatrix<const T> v_head = v.head(b, g);  // (Lk, Dv)
  HeadMatrix<T> dk_head = dk.head(b, g);            // (Lk, D)
  HeadMatrix<T> dv_head = dv.head(b, g);            // (Lk, Dv)
  const Index q_length = q.length;
  const bool favor = map.kind() == FeatureKind::favor_plus;
  ws.reset();
  Index covered = 0;  // keys [0, covered) receive gradients, the others none
  if (causal == Causal::none) {
    for (Index a = 0; a < key_length; a += chunk) {  // S, z: the forward's absorb_keys
      const Index n = std::min(chunk, key_length - a);
      ws.key_features(map, k_head, a, n);
      ws.absorb(v_head, a, n);
    }
    T d_shift = 0;
    for (Index h = g * group; h < (g + 1) * group; ++h) {  // pass 1: dq, and R, r
      const HeadMatrix<const T> q_head = q.head(b, h), dout_head = dout.head(b, h);
      HeadMatrix<T> dq_head = dq.head(b, h);
      for (Index i0 = 0; i0 < q_length; i0 += chunk) {
        const Index n = std::min(chunk, q_length - i0);
        auto u = ws.u.topRows(n);
        auto c = ws.c.head(n);
        d_shift += linear_backward_query_chunk<T>(map, q_head, v_head, dout_head, dq_head, i0, n, 0,
                                                  0, 0, eps, u, c, ws);
        const auto phi_q = ws.q_features.topRows(n);
        ws.d_state.noalias() += phi_q.transpose() * u;
        ws.d_normaliser.noalias() += phi_q.transpose() * c;
      }
    }
    for (Index a = 0; a < key_length; a += chunk)  // pass 2: dk, dv
      linear_backward_keys(map, k_head, v_head, dk_head, dv_head, a,
                           std::min(chunk, key_length - a), ws.key_shift, ws);
    covered = key_length;
    if (favor) {
      ws.owners.push_back(ws.owner);
      ws.d_shifts.push_back(d_shift);
    }
  } else {
    // Pass 1, the forward's chunk loop: query chunk [i0, i0 + n) sees the keys before
    // i0 + offset through S, z and its diagonal block [lo, hi) through the masked scores.
    const Index offset = causal == Causal::top_left ? 0 : key_length - q_length;  // as forward
    const auto bounds = [&](Index i0, Index n, Index& lo, Index& hi) {
      lo = std::clamp(i0 + offset, Index(0), key_length);
      hi = std::clamp(i0 + offset + n, Index(0), key_length);
    };
    Index absorbed = 0;
    for (Index i0 = 0; i0 < q_length; i0 += chunk) {
      const Index n = std::min(chunk, q_length - i0);
      Index lo = 0, hi = 0;
      bounds(i0, n, lo, hi);
      for (; absorbed < lo; absorbed += std::min(chunk, lo - absorbed)) {  // bottom_right
        const Index m = std::min(chunk, lo - absorbed);
        ws.key_features(map, k_head, absorbed, m);
        ws.absorb(v_head, absorbed, m);
      }
      const Index intra_keys = hi - lo;
      if (intra_keys > 0)
        ws.key_features(map, k_head, lo, intra_keys);
      T d_shift = 0;
      for (Index h = g * group; h < (g + 1) * group; ++h) {
        const HeadMatrix<const T> q_head = q.head(b, h), dout_head = dout.head(b, h);
        HeadMatrix<T> dq_head = dq.head(b, h);
        const Index row0 = (h - g * group) * q_length + i0;
        auto u = ws.u.middleRows(row0, n);
        auto c = ws.c.segment(row0, n);
        d_shift += linear_backward_query_chunk<T>(map, q_head, v_head, dout_head, dq_head, i0, n,
                                                  lo, intra_keys, i0 + offset - lo, eps, u, c, ws);
      }
      ws.shifts.push_back(ws.key_shift);
      ws.owners.push_back(ws.owner);
      ws.d_shifts.push_back(d_shift);
      if (intra_keys > 0) {
        ws.absorb(v_head, lo, intra_keys);
        absorbed = hi;
      }
    }
    // Pass 2, the chunks in reverse: R, r hold the query rows of the later chunks, in units
    // of the current chunk's key shift (it only grows along the forward, so the rescaling
    // factors are <= 1).
    const auto chunks = static_cast<Index>(ws.shifts.size());
    for (Index ci = chunks - 1; ci >= 0; --ci) {
      const Index i0 = ci * chunk, n = std::min(chunk, q_length - i0);
      Index lo = 0, hi = 0;
      bounds(i0, n, lo, hi);
      const T shift = ws.shifts[static_cast<std::size_t>(ci)];
      if (favor && ci + 1 < chunks) {
        const T later = ws.shifts[static_cast<std::size_t>(ci + 1)];
        if (later != shift) {
          const T factor = std::exp(shift - later);
          ws.d_state *= factor;
          ws.d_normaliser *= factor;
        }
      }
      const Index intra_keys = hi - lo;
      auto phi_k = ws.k_features.topRows(intra_keys);      // (nk, M)
      auto d_phi_k = ws.d_k_features.topRows(intra_keys);  // (nk, M)
      auto d_values = ws.d_values.topRows(intra_keys);     // (nk, Dv)
      const auto v_intra = v_head.middleRows(lo, intra_keys);
      if (intra_keys > 0) {  // the later chunks' rows
        map.apply_keys_at(k_head.middleRows(lo, intra_keys), phi_k, shift);
        d_phi_k.noalias() = v_intra * ws.d_state.transpose();
        d_phi_k.rowwise() += ws.d_normaliser.transpose();
        d_values.noalias() = phi_k * ws.d_state;
      }
      for (Index h = g * group; h < (g + 1) * group; ++h) {
        auto phi_q = ws.q_features.topRows(n);
        map.apply_queries(q.head(b, h).middleRows(i0, n), phi_q);
        const Index row0 = (h - g * group) * q_length + i0;
        const auto u = ws.u.middleRows(row0, n);
        const auto c = ws.c.segment(row0, n);
        if (intra_keys > 0) {  // this chunk's own rows, through the masked blocks
          auto scores = ws.scores.topLeftCorner(n, intra_keys);
          auto d_scores = ws.d_scores.topLeftCorner(n, intra_keys);
          scores.noalias() = phi_q * phi_k.transpose();
          hide_future_keys(scores, i0 + offset - lo);
          d_scores.noalias() = u * v_intra.transpose();
          d_scores.colwise() += c;
          hide_future_keys(d_scores, i0 + offset - lo);
          d_phi_k.noalias() += d_scores.transpose() * phi_q;
          d_values.noalias() += scores.transpose() * u;
        }
        ws.d_state.noalias() += phi_q.transpose() * u;
        ws.d_normaliser.noalias() += phi_q.transpose() * c;
      }
      if (intra_keys > 0) {
        auto dk_rows = dk_head.middleRows(lo, intra_keys);
        map.vjp(k_head.middleRows(lo, intra_keys), phi_k, d_phi_k, dk_rows);
        dv_head.middleRows(lo, intra_keys) = d_values;
      }
      if (ci == chunks - 1)
        covered = hi;
    }
    // The keys absorbed before the first chunk (bottom_right with Lk > Lq): every row sees
    // them, at the first chunk's shift.
    const Index leading = std::clamp(offset, Index(0), key_length);
    if (q_length > 0) {
      for (Index a = 0; a < leading; a += chunk)
        linear_backward_keys(map, k_head, v_head, dk_head, dv_head, a, std::min(chunk, leading - a),
                             ws.shifts.front(), ws);
    }
    covered = q_length > 0 ? std::max(covered, leading) : 0;
  }
  const Index hidden = k.length - covered;  // keys no query sees: padding, or beyond the last
  dk_head.bottomRows(hidden).setZero();
  dv_head.bottomRows(hidden).setZero();
  if (favor) {  // the key shifts, through the exponents they are
    for (std::size_t e = 0; e < ws.owners.size(); ++e) {
      const auto [row, feature] = ws.owners[e];
      if (row < 0 || ws.d_shifts[e] == T(0))
        continue;
      auto dk_row = dk_head.row(row);
      map.add_exponent_gradient(k_head.row(row), feature, ws.d_shifts[e], dk_row);
    }
  }
}

template <class T>
void check_gradient_aliasing(
    const char* function, std::initializer_list<std::pair<const char*, HeadsView<const T>>> in,
    std::initializer_list<std::pair<const char*, HeadsView<const T>>> out) {
  for (auto o = out.begin(); o != out.end(); ++o) {
    for (const auto& i : in) {
      if (views_may_overlap(o->second, i.second)) {
        throw_invalid_argument(function, std::string(o->first) + " overlaps " + i.first +
                                             ": the gradients must share no element with q, k, "
                                             "v, dout or each other");
      }
    }
    for (auto p = out.begin(); p != o; ++p) {
      if (views_may_overlap(o->second, p->second)) {
        throw_invalid_argument(function, std::string(o->first) + " overlaps " + p->first +
                                             ": the gradients must share no element with q, k, "
                                             "v, dout or each other");
      }
    }
  }
}

}  // namespace detail

/// The backward of linear_attention_into: dq (B, Hq, Lq, D), dk (B, Hkv, Lk, D) and
/// dv (B, Hkv, Lk, Dv) of a loss whose gradient with respect to the output is dout
/// (B, Hq, Lq, Dv), for the same q, k, v and options as the forward (feature map, causal
/// alignment, key_lengths, eps, chunk: the same chunks, so the same FAVOR+ shifts). Needs
/// only the forward's inputs: the forward's sums are recomputed. Padding keys and keys no
/// query sees get zero gradients. Any strided views; the gradients must not overlap the
/// inputs or each other. Work is split over (batch, kv head) items with OpenMP, results
/// bitwise identical for any thread count.
///
/// Cost: about 3x the forward's GEMM FLOPs (dq, dk and dv each need a pass like the
/// forward's). Extra memory per thread: the states S, z, R, r, 2 (M * Dv + M); chunk buffers
/// C * (4 M + 2 Dv + 1), plus C * (Dv + 1) non-causal or 2 C^2 causal; and, causal only, u
/// and c of every query row of the item: group * Lq * (Dv + 1), group = Hq / Hkv.
template <class T>
void linear_attention_backward_into(const HeadsView<const T>& q,     // (B, Hq, Lq, D)
                                    const HeadsView<const T>& k,     // (B, Hkv, Lk, D)
                                    const HeadsView<const T>& v,     // (B, Hkv, Lk, Dv)
                                    const HeadsView<const T>& dout,  // (B, Hq, Lq, Dv)
                                    const HeadsView<T>& dq,          // (B, Hq, Lq, D)
                                    const HeadsView<T>& dk,          // (B, Hkv, Lk, D)
                                    const HeadsView<T>& dv,          // (B, Hkv, Lk, Dv)
                                    const LinearAttentionOptions<T>& options = {}) {
  constexpr const char* function = "linear_attention_backward";
  detail::check_attention_shapes(function, q, k, v);
  const auto check_shape = [&](const char* name, const auto& x, const auto& like, Index dim,
                               const char* legend) {
    if (x.batch != like.batch || x.heads != like.heads || x.length != like.length || x.dim != dim) {
      detail::throw_invalid_argument(
          function,
          std::string(name) + " is " + detail::shape_string({x.batch, x.heads, x.length, x.dim}) +
              " but must be " + detail::shape_string({like.batch, like.heads, like.length, dim}) +
              " " + legend);
    }
  };
  check_shape("dout", dout, q, v.dim, "(B, Hq, Lq, Dv)");
  check_shape("dq", dq, q, q.dim, "(B, Hq, Lq, D), the shape of q");
  check_shape("dk", dk, k, k.dim, "(B, Hkv, Lk, D), the shape of k");
  check_shape("dv", dv, v, v.dim, "(B, Hkv, Lk, Dv), the shape of v");
  detail::check_linear_options(function, options, q, k);
  const FeatureMap<T>& map = options.feature_map;
  if (!map.has_derivative()) {
    detail::throw_invalid_argument(function,
                                   "the custom feature map has no derivative: build it with "
                                   "FeatureMap::custom(function, vjp, features)");
  }
  detail::check_gradient_aliasing<T>(function, {{"q", q}, {"k", k}, {"v", v}, {"dout", dout}},
                                     {{"dq", HeadsView<const T>(dq)},
                                      {"dk", HeadsView<const T>(dk)},
                                      {"dv", HeadsView<const T>(dv)}});

  const Index features = map.features(q.dim);
  const Index chunk = options.chunk > 0 ? options.chunk : default_linear_chunk;
  const bool causal = options.causal != Causal::none;
  const Index group = k.heads == 0 ? 1 : q.heads / k.heads;
  const double flops = 10.0 * static_cast<double>(q.batch * q.heads) *
                       static_cast<double>(std::max(q.length, k.length)) *
                       static_cast<double>(features) * static_cast<double>(v.dim + 1);
  const auto make_workspace = [&] {  // one per thread
    detail::LinearBackwardWorkspace<T> ws;
    ws.reserve(chunk, features, v.dim, causal, group * q.length);
    return ws;
  };
  detail::for_each_kv_head(
      q, k, options, flops, make_workspace,
      [&](Index b, Index g, Index key_length, detail::LinearBackwardWorkspace<T>& ws) {
        detail::linear_backward_kv_head(q, k, v, dout, dq, dk, dv, map, b, g, group, key_length,
                                        options.causal, chunk, options.eps, ws);
      });
}

/// The backward of the batched linear_attention on rank-4 row-major tensors or maps:
/// {dq (B, Hq, Lq, D), dk (B, Hkv, Lk, D), dv (B, Hkv, Lk, Dv)}.
template <class TQ, class TK, class TV, class TO,
          class = std::enable_if_t<detail::is_rank4_tensor_v<TQ> && detail::is_rank4_tensor_v<TK> &&
                                   detail::is_rank4_tensor_v<TV> && detail::is_rank4_tensor_v<TO>>>
LinearAttentionGradients<Tensor<detail::rank4_scalar_t<TQ>, 4>> linear_attention_backward(
    const TQ& q,     // (B, Hq, Lq, D)
    const TK& k,     // (B, Hkv, Lk, D)
    const TV& v,     // (B, Hkv, Lk, Dv)
    const TO& dout,  // (B, Hq, Lq, Dv)
    const LinearAttentionOptions<detail::rank4_scalar_t<TQ>>& options = {}) {
  using T = detail::rank4_scalar_t<TQ>;
  static_assert(std::is_same_v<T, detail::rank4_scalar_t<TK>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TV>> &&
                    std::is_same_v<T, detail::rank4_scalar_t<TO>>,
                "linear_attention_backward: q, k, v and dout must have the same scalar type");
  const HeadsView<const T> qv = detail::as_heads_view(q), kv = detail::as_heads_view(k),
                           vv = detail::as_heads_view(v), ov = detail::as_heads_view(dout);
  detail::check_attention_shapes("linear_attention_backward", qv, kv, vv);
  LinearAttentionGradients<Tensor<T, 4>> grads;
  grads.dq.resize(qv.batch, qv.heads, qv.length, qv.dim);
  grads.dk.resize(kv.batch, kv.heads, kv.length, kv.dim);
  grads.dv.resize(vv.batch, vv.heads, vv.length, vv.dim);
  linear_attention_backward_into<T>(qv, kv, vv, ov, bhld_view(grads.dq), bhld_view(grads.dk),
                                    bhld_view(grads.dv), options);
  return grads;
}

/// One head: q (Lq, D), k (Lk, D), v (Lk, Dv), dout (Lq, Dv) -> {dq (Lq, D), dk (Lk, D),
/// dv (Lk, Dv)}. Any Eigen matrix expression; key_lengths, if given, has one entry.
template <class DQ, class DK, class DV, class DO>
LinearAttentionGradients<Matrix<typename DQ::Scalar>> linear_attention_backward(
    const Eigen::MatrixBase<DQ>& q,     // (Lq, D)
    const Eigen::MatrixBase<DK>& k,     // (Lk, D)
    const Eigen::MatrixBase<DV>& v,     // (Lk, Dv)
    const Eigen::MatrixBase<DO>& dout,  // (Lq, Dv)
    const LinearAttentionOptions<typename DQ::Scalar>& options = {}) {
  using T = typename DQ::Scalar;
  static_assert(std::is_same_v<T, typename DK::Scalar> && std::is_same_v<T, typename DV::Scalar> &&
                    std::is_same_v<T, typename DO::Scalar>,
                "linear_attention_backward: q, k, v and dout must have the same scalar type");
  using RowMajorRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
  const RowMajorRef qr(q), kr(k), vr(v), orr(dout);
  const auto view = [](const RowMajorRef& m) {
    return HeadsView<const T>{m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.outerStride()};
  };
  const auto out_view = [](Matrix<T>& m) {
    return HeadsView<T>{m.data(), 1, 1, m.rows(), m.cols(), 0, 0, m.cols()};
  };
  const HeadsView<const T> qv = view(qr), kv = view(kr), vv = view(vr), ov = view(orr);
  detail::check_attention_shapes("linear_attention_backward", qv, kv, vv);
  LinearAttentionGradients<Matrix<T>> grads{Matrix<T>(qr.rows(), qr.cols()),
                                            Matrix<T>(kr.rows(), kr.cols()),
                                            Matrix<T>(vr.rows(), vr.cols())};
  linear_attention_backward_into<T>(qv, kv, vv, ov, out_view(grads.dq), out_view(grads.dk),
                                    out_view(grads.dv), options);
  return grads;
}

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

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_LINEAR_ATTENTION_INSTANCES(ATTN_EXTERN_INSTANCE)
ATTN_LINEAR_ATTENTION_CLASSES(ATTN_EXTERN_CLASS)
#endif
