// Tests for attn/init.hpp: PyTorch's gain table, bounds, moments, reproducibility, errors.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include <attn/init.hpp>

using attn::Index;
using Catch::Matchers::Contains;
using Catch::Matchers::WithinRel;

TEST_CASE("calculate_gain follows PyTorch's table", "[init]") {
  REQUIRE(attn::calculate_gain("linear") == 1.0);
  REQUIRE(attn::calculate_gain("conv2d") == 1.0);
  REQUIRE(attn::calculate_gain("conv_transpose3d") == 1.0);
  REQUIRE(attn::calculate_gain("sigmoid") == 1.0);
  REQUIRE_THAT(attn::calculate_gain("tanh"), WithinRel(5.0 / 3.0, 1e-15));
  REQUIRE_THAT(attn::calculate_gain("relu"), WithinRel(std::sqrt(2.0), 1e-15));
  REQUIRE_THAT(attn::calculate_gain("leaky_relu"),
               WithinRel(std::sqrt(2.0 / (1.0 + 0.0001)), 1e-15));
  REQUIRE_THAT(attn::calculate_gain("leaky_relu", 0.2), WithinRel(std::sqrt(2.0 / 1.04), 1e-15));
  REQUIRE_THAT(attn::calculate_gain(attn::Nonlinearity::selu), WithinRel(0.75, 1e-15));
  // torch.nn.init.calculate_gain('leaky_relu', 0.2) printed 1.3867504905630728
  REQUIRE_THAT(attn::calculate_gain(attn::Nonlinearity::leaky_relu, 0.2),
               WithinRel(1.3867504905630728, 1e-15));
  REQUIRE_THROWS_WITH(attn::calculate_gain("gelu"),
                      "calculate_gain: unsupported nonlinearity \"gelu\"");
  REQUIRE_THROWS_AS(attn::calculate_gain("leaky_relu", std::nan("")), std::invalid_argument);
}

namespace {

struct Moments {
  double mean = 0, variance = 0, min = 0, max = 0;
};

template <class T>
Moments moments(const attn::Matrix<T>& w) {
  const Eigen::ArrayXd x = w.template cast<double>().reshaped().array();
  const double mean = x.mean();
  return {mean, (x - mean).square().sum() / static_cast<double>(x.size() - 1), x.minCoeff(),
          x.maxCoeff()};
}

/// Sample mean and variance of n draws agree with (mean 0, variance `variance`, fourth
/// moment `fourth`) within 5 standard errors.
void require_moments(const Moments& m, double n, double variance, double fourth) {
  const double mean_se = std::sqrt(variance / n);
  const double variance_se = std::sqrt((fourth - variance * variance) / n);
  INFO("mean " << m.mean << " (se " << mean_se << "), variance " << m.variance << " vs " << variance
               << " (se " << variance_se << ")");
  REQUIRE(std::abs(m.mean) <= 5 * mean_se);
  REQUIRE(std::abs(m.variance - variance) <= 5 * variance_se);
}

}  // namespace

TEMPLATE_TEST_CASE("initialisers: bounds, moments and reproducibility", "[init]", float, double) {
  using T = TestType;
  const Index fan_in = 512, fan_out = 512;
  const auto n = static_cast<double>(fan_in * fan_out);

  SECTION("xavier_uniform: U(-a, a), a = gain sqrt(6 / (in + out))") {
    std::mt19937_64 rng(7);
    const double gain = 5.0 / 3.0;
    const attn::Matrix<T> w = attn::xavier_uniform<T>(fan_in, fan_out, rng, gain);
    REQUIRE(w.rows() == fan_in);
    REQUIRE(w.cols() == fan_out);
    const double a = gain * std::sqrt(6.0 / double(fan_in + fan_out));
    const Moments m = moments(w);
    REQUIRE(m.min >= -a);
    REQUIRE(m.max <= a);
    REQUIRE(m.max > 0.99 * a);  // the bound is the bound, not a loose cap
    require_moments(m, n, a * a / 3, a * a * a * a / 5);
  }
  SECTION("xavier_normal: N(0, gain^2 2 / (in + out))") {
    std::mt19937 rng(8);
    const attn::Matrix<T> w = attn::xavier_normal<T>(fan_in, 256, rng);
    const double s2 = 2.0 / double(fan_in + 256);
    require_moments(moments(w), double(fan_in * 256), s2, 3 * s2 * s2);
  }
  SECTION("he_uniform: U(-a, a), a = sqrt(2) sqrt(3 / fan), fan_in and fan_out modes") {
    std::mt19937_64 rng(9);
    const attn::Matrix<T> w_in = attn::he_uniform<T>(fan_in, 128, rng);
    const double a_in = std::sqrt(2.0) * std::sqrt(3.0 / double(fan_in));
    REQUIRE(moments(w_in).max <= a_in);
    require_moments(moments(w_in), double(fan_in * 128), a_in * a_in / 3, std::pow(a_in, 4) / 5);
    const attn::Matrix<T> w_out = attn::he_uniform<T>(fan_in, 128, rng, attn::FanMode::fan_out);
    const double a_out = std::sqrt(2.0) * std::sqrt(3.0 / 128.0);
    REQUIRE(moments(w_out).max <= a_out);
    REQUIRE(moments(w_out).max > 0.99 * a_out);
    require_moments(moments(w_out), double(fan_in * 128), a_out * a_out / 3,
                    std::pow(a_out, 4) / 5);
  }
  SECTION("he_normal: N(0, gain^2 / fan)") {
    std::mt19937_64 rng(10);
    const double gain = attn::calculate_gain("leaky_relu", 0.2);
    const attn::Matrix<T> w =
        attn::kaiming_normal<T>(fan_in, fan_out, rng, attn::FanMode::fan_in, gain);
    const double s2 = gain * gain / double(fan_in);
    require_moments(moments(w), n, s2, 3 * s2 * s2);
  }
  SECTION("the same seed gives the same matrix, another seed another one") {
    std::mt19937_64 a(42), b(42), c(43);
    const attn::Matrix<T> wa = attn::xavier_uniform<T>(4, 3, a);
    REQUIRE(wa == attn::xavier_uniform<T>(4, 3, b));
    REQUIRE(wa != attn::xavier_uniform<T>(4, 3, c));
    std::mt19937_64 d(42), e(42);
    REQUIRE(attn::he_normal<T>(5, 6, d) == attn::he_normal<T>(5, 6, e));
  }
}

TEST_CASE("initialisers reject bad shapes and gains", "[init][errors]") {
  std::mt19937_64 rng(1);
  REQUIRE_THROWS_WITH(attn::xavier_uniform<float>(0, 3, rng),
                      "xavier_uniform: shape is [0, 3]: fan_in and fan_out must be positive");
  REQUIRE_THROWS_WITH(attn::xavier_normal<float>(4, -1, rng),
                      "xavier_normal: shape is [4, -1]: fan_in and fan_out must be positive");
  REQUIRE_THROWS_WITH(attn::he_uniform<double>(4, 0, rng),
                      "he_uniform: shape is [4, 0]: fan_in and fan_out must be positive");
  REQUIRE_THROWS_WITH(attn::he_normal<double>(4, 3, rng, attn::FanMode::fan_in, -1.0),
                      Contains("he_normal: gain is -1") && Contains("must be finite and >= 0"));
  REQUIRE_THROWS_AS(attn::xavier_uniform<float>(4, 3, rng, std::nan("")), std::invalid_argument);
}
