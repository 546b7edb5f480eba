// Tests for attn/softmax.hpp against tests/reference/softmax.json and closed-form properties.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include <attn/softmax.hpp>

#include "support/fixtures.hpp"

using attn::Index;

TEMPLATE_TEST_CASE("softmax and logsumexp match the NumPy fixture rows", "[softmax]", float,
                   double) {
  using T = TestType;
  for (const attn_test::json& row : ATTN_FIXTURE_CASES("softmax.json", "rows", 10)) {
    SECTION(row.at("name").get<std::string>()) {
      const std::vector<T> x = attn_test::values<T>(row.at("x"));
      const std::vector<double> expected = attn_test::values<double>(row.at("softmax"));
      const Eigen::Map<const attn::Vector<T>> xv(x.data(), static_cast<Index>(x.size()));

      const attn::Vector<T> y = attn::softmax(xv);
      ATTN_REQUIRE_CLOSE(y.data(), y.size(), expected, attn_test::tolerance<T>());

      const double expected_lse = attn_test::number(row.at("logsumexp"));
      const double lse = static_cast<double>(attn::logsumexp(xv));
      const double lse_error = std::isinf(expected_lse) ? (lse == expected_lse ? 0.0 : 1.0)
                                                        : std::abs(lse - expected_lse) /
                                                              std::max(std::abs(expected_lse), 1.0);
      INFO("logsumexp " << lse << " expected " << expected_lse);
      REQUIRE(lse_error <= attn_test::tolerance<T>());
    }
  }
}

TEMPLATE_TEST_CASE("softmax_rows and logsumexp_rows match the NumPy fixture matrix", "[softmax]",
                   float, double) {
  using T = TestType;
  const auto& m = attn_test::fixture("softmax.json").at("matrix");
  const attn::Matrix<T> x = attn_test::matrix<T>(m.at("x"));
  const attn::Matrix<T> y = attn::softmax_rows(x);
  ATTN_REQUIRE_CLOSE(y.data(), y.size(), attn_test::values<double>(m.at("softmax")),
                     attn_test::tolerance<T>());
  const attn::Vector<T> lse = attn::logsumexp_rows(x);
  ATTN_REQUIRE_CLOSE(lse.data(), lse.size(), attn_test::values<double>(m.at("logsumexp")),
                     attn_test::tolerance<T>());

  // A column-major input gives the same rows.
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor> x_col = x;
  REQUIRE(attn::softmax_rows(x_col) == y);
}

TEMPLATE_TEST_CASE("softmax: NaN propagates, +inf gives NaN, shifts cancel", "[softmax]", float,
                   double) {
  using T = TestType;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T inf = std::numeric_limits<T>::infinity();

  attn::Matrix<T> x(3, 4);
  x << 1, 2, nan, 4,  //
      1, inf, 3, 4,   //
      1, 2, 3, 4;
  const attn::Matrix<T> y = attn::softmax_rows(x);
  REQUIRE(y.row(0).array().isNaN().all());  // NaN is never masked away
  REQUIRE(y.row(1).array().isNaN().any());  // inf - inf, as NumPy and PyTorch
  REQUIRE(y.row(2).allFinite());
  const attn::Vector<T> lse = attn::logsumexp_rows(x);
  REQUIRE(std::isnan(lse(0)));

  // softmax(x + c) == softmax(x), even for c large enough to overflow a naive exp.
  attn::Matrix<T> shifted = x.row(2);
  shifted.array() += T(500);
  const attn::Matrix<T> y_shifted = attn::softmax_rows(shifted);
  const attn::Matrix<T> y_row = y.row(2);
  ATTN_REQUIRE_CLOSE(y_shifted.data(), y_shifted.size(),
                     std::vector<T>(y_row.data(), y_row.data() + y_row.size()),
                     attn_test::tolerance<T>());
  REQUIRE(std::abs(attn::logsumexp_rows(shifted)(0) - (lse(2) + T(500))) <=
          T(attn_test::tolerance<T>()) * T(504));
}

TEMPLATE_TEST_CASE("softmax of an empty row is empty and its logsumexp is -inf", "[softmax]", float,
                   double) {
  using T = TestType;
  const attn::Matrix<T> x(2, 0);
  REQUIRE(attn::softmax_rows(x).rows() == 2);
  const attn::Vector<T> lse = attn::logsumexp_rows(x);
  REQUIRE(lse.size() == 2);
  REQUIRE(lse(0) == -std::numeric_limits<T>::infinity());
}
