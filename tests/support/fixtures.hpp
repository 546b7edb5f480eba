// Test support: loading the reference fixtures (tests/reference/*.json) and comparing
// results against them with a tolerance stated per scalar type.
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include <attn/tensor.hpp>

namespace attn_test {

using attn::Index;
using json = nlohmann::json;

/// Parsed fixture file, cached: tests/reference/<name>.
const json& fixture(const std::string& name);

/// A fixture number: a JSON number or one of the strings "inf", "-inf", "nan".
double number(const json& x);

/// A fixture tensor's {"shape"}.
std::vector<Index> shape_of(const json& t);

/// A fixture tensor's {"data"} as a flat row-major vector of double.
std::vector<double> values_of(const json& t);

/// The number of cases in tests/reference/sdpa.json (tests/reference/generate.py).
inline constexpr std::size_t sdpa_case_count = 59;

/// fixture(name).at(key), REQUIRE'd to hold `count` entries: a fixture file that lost its
/// cases must fail the tests that loop over them, not pass them.
#define ATTN_FIXTURE_CASES(name, key, count)                               \
  ([&]() -> const attn_test::json& {                                       \
    const attn_test::json& attn_cases_ = attn_test::fixture(name).at(key); \
    REQUIRE(attn_cases_.size() == static_cast<std::size_t>(count));        \
    return attn_cases_;                                                    \
  }())

/// A fixture tensor {"shape", "data"} as a flat row-major vector of T.
template <class T>
std::vector<T> values(const json& t) {
  const std::vector<double> data = values_of(t);
  if constexpr (std::is_same_v<T, double>) {
    return data;
  } else {
    std::vector<T> out(data.size());
    std::transform(data.begin(), data.end(), out.begin(),
                   [](double x) { return static_cast<T>(x); });
    return out;
  }
}

template <class T, int Rank>
attn::Tensor<T, Rank> tensor(const json& t) {
  const std::vector<Index> shape = shape_of(t);
  if (static_cast<int>(shape.size()) != Rank)
    throw std::runtime_error("fixture rank mismatch");
  std::array<Index, static_cast<std::size_t>(Rank)> dims{};
  std::copy(shape.begin(), shape.end(), dims.begin());
  attn::Tensor<T, Rank> out(dims);
  const std::vector<T> data = values<T>(t);
  std::copy(data.begin(), data.end(), out.data());
  return out;
}

template <class T>
attn::Matrix<T> matrix(const json& t) {
  const std::vector<Index> shape = shape_of(t);
  attn::Matrix<T> out(shape.at(0), shape.at(1));
  const std::vector<T> data = values<T>(t);
  std::copy(data.begin(), data.end(), out.data());
  return out;
}

/// Relative tolerance per scalar type: the error bound of the comparisons below.
template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

/// Outcome of comparing `actual` with `expected`: passes when every element satisfies
///   |actual - expected| <= rtol * max(|expected|, 1)
/// (relative for large values, absolute for values below 1, e.g. attention weights), and
/// non-finite expected values (-inf, inf, NaN) are matched exactly. Describes the worst
/// element when it fails.
struct Comparison {
  bool ok = true;
  double worst_error = 0;
  std::string detail;
};

template <class TA, class TE>
Comparison compare(const TA* actual, const TE* expected, std::size_t n, double rtol) {
  Comparison result;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double a = static_cast<double>(actual[i]);
    const double e = static_cast<double>(expected[i]);
    double error = 0;
    if (std::isnan(e)) {
      error = std::isnan(a) ? 0 : std::numeric_limits<double>::infinity();
    } else if (std::isinf(e)) {
      error = a == e ? 0 : std::numeric_limits<double>::infinity();
    } else {
      error = std::isfinite(a) ? std::abs(a - e) / std::max(std::abs(e), 1.0)
                               : std::numeric_limits<double>::infinity();
    }
    if (error > result.worst_error || (i == 0 && error > 0)) {
      result.worst_error = error;
      worst = i;
    }
  }
  result.ok = result.worst_error <= rtol;
  if (n > 0) {
    std::ostringstream s;
    s.precision(17);
    s << "worst relative error " << result.worst_error << " (bound " << rtol << ") at flat index "
      << worst << ": actual " << static_cast<double>(actual[worst]) << ", expected "
      << static_cast<double>(expected[worst]);
    result.detail = s.str();
  }
  return result;
}

template <class TA, class TE>
Comparison compare(const std::vector<TA>& actual, const std::vector<TE>& expected, double rtol) {
  if (actual.size() != expected.size())
    return {false, 0, "sizes differ"};
  return compare(actual.data(), expected.data(), actual.size(), rtol);
}

// Compiled once, in tests/support/fixtures.cpp: the comparisons of the MHA,
// gradient and kernel tests cover millions of elements.
#define ATTN_TEST_COMPARE_INSTANCES(X, TA, TE) \
  X template Comparison compare<TA, TE>(const TA*, const TE*, std::size_t, double);

ATTN_TEST_COMPARE_INSTANCES(extern, float, double)
ATTN_TEST_COMPARE_INSTANCES(extern, double, double)
ATTN_TEST_COMPARE_INSTANCES(extern, float, long double)
ATTN_TEST_COMPARE_INSTANCES(extern, double, long double)

}  // namespace attn_test

/// REQUIRE that `actual` (n values at a pointer) matches fixture tensor `expected_json`.
#define ATTN_REQUIRE_CLOSE(actual_ptr, count, expected_vector, rtol)                  \
  do {                                                                                \
    REQUIRE(static_cast<std::size_t>(count) == (expected_vector).size());             \
    const auto attn_cmp_ = attn_test::compare((actual_ptr), (expected_vector).data(), \
                                              (expected_vector).size(), (rtol));      \
    INFO(attn_cmp_.detail);                                                           \
    REQUIRE(attn_cmp_.ok);                                                            \
  } while (false)
