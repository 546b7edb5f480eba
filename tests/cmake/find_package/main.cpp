// Smallest useful program against attn, shared by the consumer projects (find_package,
// add_subdirectory, pkg-config). Exits non-zero unless the output of
// scaled_dot_product_attention is finite and every element lies between the smallest and
// largest value of its column of v, up to rounding (attention outputs are convex
// combinations of v's rows), and, when the project says what to expect
// (ATTN_CONSUMER_EXPECT_OPENMP), unless attn sees OpenMP exactly when the consumer enabled it;
// and unless attn::gallery::causal() from the same header masks query 0 to key 0.
#include <attn/attn.hpp>

// attn/attn.hpp leaves out attn/safetensors.hpp, so attn::attn needs no JSON library.
#ifdef INCLUDE_NLOHMANN_JSON_HPP_
#error "attn/attn.hpp must not include nlohmann/json.hpp"
#endif

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>

int main() {
#ifdef ATTN_CONSUMER_EXPECT_OPENMP
  if (ATTN_HAS_OPENMP != ATTN_CONSUMER_EXPECT_OPENMP) {
    std::cerr << "attn_consumer: ATTN_HAS_OPENMP is " << ATTN_HAS_OPENMP << ", expected "
              << ATTN_CONSUMER_EXPECT_OPENMP << "\n";
    return 1;
  }
#endif
  attn::Matrix<float> q(2, 3);  // [Lq, D]  = [2, 3]
  attn::Matrix<float> k(2, 3);  // [Lk, D]  = [2, 3]
  attn::Matrix<float> v(2, 2);  // [Lk, Dv] = [2, 2]
  q << 0.5f, -1.0f, 2.0f,       //
      1.5f, 0.25f, -0.75f;
  k << 1.0f, 0.0f, -1.0f,  //
      -0.5f, 2.0f, 0.5f;
  v << 1.0f, -2.0f,  //
      3.0f, 4.0f;

  const attn::Matrix<float> out = attn::scaled_dot_product_attention(q, k, v);  // [Lq, Dv]

  if (out.rows() != 2 || out.cols() != 2) {
    std::cerr << "attn_consumer: expected a 2x2 output, got " << out.rows() << "x" << out.cols()
              << "\n";
    return 1;
  }
  for (Eigen::Index i = 0; i < out.rows(); ++i) {
    for (Eigen::Index j = 0; j < out.cols(); ++j) {
      const float lo = v.col(j).minCoeff();
      const float hi = v.col(j).maxCoeff();
      // A few ulps of slack: the softmax weights sum to 1 only up to rounding.
      const float slack =
          8.0f * std::numeric_limits<float>::epsilon() * std::max(std::abs(lo), std::abs(hi));
      const float x = out(i, j);
      if (!std::isfinite(x) || x < lo - slack || x > hi + slack) {
        std::cerr << "attn_consumer: out(" << i << ", " << j << ") = " << x << " is not within ["
                  << lo << ", " << hi << "]\n";
        return 1;
      }
    }
  }
  // The umbrella header includes the gallery of mask_mods: causally, query 0 sees key 0 only,
  // so its output is v's row 0 exactly (one weight of 1).
  attn::AttentionOptions<float> causal;
  causal.mask_mod = attn::MaskMod(attn::gallery::causal());
  const attn::Matrix<float> causal_out = attn::scaled_dot_product_attention(q, k, v, causal);
  if (causal_out(0, 0) != v(0, 0) || causal_out(0, 1) != v(0, 1) ||
      !causal_out.row(1).isApprox(out.row(1), 1e-6f)) {  // query 1 sees both keys
    std::cerr << "attn_consumer: attention with gallery::causal() gave\n" << causal_out << "\n";
    return 1;
  }
  std::cout << "attn_consumer: ok\n" << out << "\n";
  return 0;
}
