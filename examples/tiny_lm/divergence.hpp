// examples/tiny_lm/divergence.hpp: how far one run's next-token distributions are from
// another's, used by tiny_lm_kv_formats and tests/test_tiny_lm.cpp to compare a cache format
// against the float cache.
#pragma once

#include <cmath>

#include <Eigen/Core>

namespace tiny_lm {

/// The log-softmax of every row of logits (L, V), in double.
template <class Derived>
Eigen::MatrixXd log_softmax_rows(const Eigen::MatrixBase<Derived>& logits) {  // (L, V)
  Eigen::MatrixXd out = logits.template cast<double>();
  for (Eigen::Index r = 0; r < out.rows(); ++r) {
    const double m = out.row(r).maxCoeff();
    out.row(r).array() -= m + std::log((out.row(r).array() - m).exp().sum());
  }
  return out;
}

/// Sums over positions of the argmax agreement and of KL(exact || approx) in nats.
struct Divergence {
  double agreement = 0, kl = 0;
  Eigen::Index positions = 0;

  /// Adds rows [0, rows) of two runs' log-probabilities (L, V) each.
  void add(const Eigen::MatrixXd& exact, const Eigen::MatrixXd& approx, Eigen::Index rows) {
    for (Eigen::Index r = 0; r < rows; ++r) {
      Eigen::Index best_exact = 0, best_approx = 0;
      exact.row(r).maxCoeff(&best_exact);
      approx.row(r).maxCoeff(&best_approx);
      agreement += best_exact == best_approx ? 1 : 0;
      kl += (exact.row(r).array().exp() * (exact.row(r).array() - approx.row(r).array())).sum();
      ++positions;
    }
  }
  double mean_agreement() const { return agreement / static_cast<double>(positions); }
  double mean_kl() const { return kl / static_cast<double>(positions); }
};

}  // namespace tiny_lm
