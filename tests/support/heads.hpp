// Test support: owning (B, H, L, D) storage, random heads and the error measure that the
// kernel, decode and precision tests share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include <attn/precision.hpp>
#include <attn/tensor.hpp>

namespace attn_test {

using attn::Index;

/// Owning contiguous (B, H, L, D) storage of scalar T with its views.
template <class T>
struct Heads {
  std::vector<T> data;
  Index b, h, l, d;
  Heads(Index batch, Index heads, Index length, Index dim)
      : data(static_cast<std::size_t>(batch * heads * length * dim)),
        b(batch),
        h(heads),
        l(length),
        d(dim) {}
  attn::HeadsView<T> view() { return attn::bhld_view(data.data(), b, h, l, d); }
  attn::HeadsView<const T> cview() const {
    return attn::bhld_view(static_cast<const T*>(data.data()), b, h, l, d);
  }
  /// The same values as U (16-bit values are widened through float, exactly).
  template <class U>
  Heads<U> cast() const {
    Heads<U> r(b, h, l, d);
    std::transform(data.begin(), data.end(), r.data.begin(), [](T x) {
      if constexpr (attn::is_16bit_scalar_v<T>)
        return static_cast<U>(static_cast<float>(x));
      else
        return static_cast<U>(x);
    });
    return r;
  }
};

/// (B, H, L, D) heads of N(0, sigma^2) values, rounded to T.
template <class T>
Heads<T> random_heads(Index b, Index h, Index l, Index d, std::mt19937& rng, double sigma = 1.0) {
  std::normal_distribution<double> normal(0.0, sigma);
  Heads<T> x(b, h, l, d);
  for (T& e : x.data)
    e = static_cast<T>(normal(rng));
  return x;
}

/// Largest |a - e|; a mismatch in non-finite values counts as infinity.
template <class T>
double max_abs_error(const std::vector<T>& actual, const std::vector<double>& expected) {
  double worst = 0;
  for (std::size_t n = 0; n < expected.size(); ++n) {
    const auto a = static_cast<double>(actual[n]);
    const double e = expected[n];
    if (!std::isfinite(e) || !std::isfinite(a)) {
      if (!(a == e || (std::isnan(a) && std::isnan(e))))
        worst = std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, std::abs(a - e));
  }
  return worst;
}

// The tests draw and convert tens of millions of numbers. These instantiations are compiled
// once, in tests/support/helpers.cpp, and the test files only call them.
#define ATTN_TEST_HEADS_INSTANCES(X, T)                                                   \
  X template struct Heads<T>;                                                             \
  X template Heads<T> random_heads<T>(Index, Index, Index, Index, std::mt19937&, double); \
  X template Heads<float> Heads<T>::cast<float>() const;

ATTN_TEST_HEADS_INSTANCES(extern, float)
ATTN_TEST_HEADS_INSTANCES(extern, double)
ATTN_TEST_HEADS_INSTANCES(extern, Eigen::half)
ATTN_TEST_HEADS_INSTANCES(extern, Eigen::bfloat16)
extern template Heads<Eigen::half> Heads<float>::cast<Eigen::half>() const;
extern template Heads<Eigen::bfloat16> Heads<float>::cast<Eigen::bfloat16>() const;

}  // namespace attn_test
