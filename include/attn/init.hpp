// attn/init.hpp: weight initialisers (Xavier/Glorot and He/Kaiming), as torch.nn.init.
//
// Shapes are (fan_in, fan_out) because our weights are applied as x * W (the tutorials'
// X @ Wq). PyTorch stores the same weight transposed, as (out, in) = (fan_out, fan_in), so
// our W equals PyTorch's weight.T, and fan_in/fan_out mean the same thing in both.
//
//   xavier_uniform  U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out))
//   xavier_normal   N(0, s^2), s = gain * sqrt(2 / (fan_in + fan_out))
//   he_uniform      U(-a, a), a = gain * sqrt(3 / fan)     fan = fan_in or fan_out (mode)
//   he_normal       N(0, s^2), s = gain / sqrt(fan)
//
// He's default gain is sqrt(2) (ReLU), as PyTorch's kaiming_* with nonlinearity "relu".
// Any standard random engine works; the same engine state gives the same matrix (within
// one standard library: the <random> distributions are not bit-specified across vendors).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>

#include "attn/config.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// The nonlinearities of torch.nn.init.calculate_gain.
enum class Nonlinearity : std::uint8_t { linear, sigmoid, tanh, relu, leaky_relu, selu };

/// Which fan He initialisation preserves the variance of.
enum class FanMode : std::uint8_t { fan_in, fan_out };

/// Recommended gain for a nonlinearity (PyTorch's table): linear and sigmoid 1, tanh 5/3,
/// relu sqrt(2), leaky_relu sqrt(2 / (1 + slope^2)) with slope = param (default 0.01),
/// selu 3/4. `param` is used only by leaky_relu.
inline double calculate_gain(Nonlinearity nonlinearity,
                             std::optional<double> param = std::nullopt) {
  switch (nonlinearity) {
    case Nonlinearity::linear:
    case Nonlinearity::sigmoid:
      return 1.0;
    case Nonlinearity::tanh:
      return 5.0 / 3.0;
    case Nonlinearity::relu:
      return std::sqrt(2.0);
    case Nonlinearity::leaky_relu: {
      const double slope = param.value_or(0.01);
      if (!std::isfinite(slope)) {
        detail::throw_invalid_argument(
            "calculate_gain", "leaky_relu slope is " + std::to_string(slope) + ": must be finite");
      }
      return std::sqrt(2.0 / (1.0 + slope * slope));
    }
    case Nonlinearity::selu:
      return 3.0 / 4.0;
  }
  detail::throw_invalid_argument("calculate_gain", "unknown nonlinearity");
}

/// Same, by PyTorch's name ("linear", "conv1d".."conv_transpose3d", "sigmoid", "tanh",
/// "relu", "leaky_relu", "selu").
inline double calculate_gain(std::string_view name, std::optional<double> param = std::nullopt) {
  const std::string_view linear_names[] = {
      "linear",           "conv1d",           "conv2d",          "conv3d",
      "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"};
  for (const std::string_view linear_name : linear_names) {
    if (name == linear_name)
      return calculate_gain(Nonlinearity::linear, param);
  }
  if (name == "sigmoid")
    return calculate_gain(Nonlinearity::sigmoid, param);
  if (name == "tanh")
    return calculate_gain(Nonlinearity::tanh, param);
  if (name == "relu")
    return calculate_gain(Nonlinearity::relu, param);
  if (name == "leaky_relu")
    return calculate_gain(Nonlinearity::leaky_relu, param);
  if (name == "selu")
    return calculate_gain(Nonlinearity::selu, param);
  detail::throw_invalid_argument("calculate_gain",
                                 "unsupported nonlinearity \"" + std::string(name) + "\"");
}

namespace detail {

inline void check_init_arguments(const char* function, Index fan_in, Index fan_out, double gain) {
  if (fan_in < 1 || fan_out < 1) {
    throw_invalid_argument(function, "shape is " + shape_string({fan_in, fan_out}) +
                                         ": fan_in and fan_out must be positive");
  }
  if (!(gain >= 0.0) || !std::isfinite(gain)) {
    throw_invalid_argument(function,
                           "gain is " + std::to_string(gain) + ": must be finite and >= 0");
  }
}

template <class T, class Distribution, class Engine>
Matrix<T> sample(Index rows, Index cols, Distribution distribution, Engine& engine) {
  Matrix<T> w(rows, cols);
  for (Index i = 0; i < w.size(); ++i)
    w.data()[i] = static_cast<T>(distribution(engine));
  return w;
}

}  // namespace detail

/// (fan_in, fan_out) matrix from U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out)).
template <class T, class Engine>
Matrix<T> xavier_uniform(Index fan_in, Index fan_out, Engine& engine, double gain = 1.0) {
  detail::check_init_arguments("xavier_uniform", fan_in, fan_out, gain);
  const double bound = gain * std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  return detail::sample<T>(fan_in, fan_out, std::uniform_real_distribution<double>(-bound, bound),
                           engine);
}

/// (fan_in, fan_out) matrix from N(0, s^2), s = gain * sqrt(2 / (fan_in + fan_out)).
template <class T, class Engine>
Matrix<T> xavier_normal(Index fan_in, Index fan_out, Engine& engine, double gain = 1.0) {
  detail::check_init_arguments("xavier_normal", fan_in, fan_out, gain);
  const double stddev = gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
  return detail::sample<T>(fan_in, fan_out, std::normal_distribution<double>(0.0, stddev), engine);
}

/// (fan_in, fan_out) matrix from U(-a, a), a = gain * sqrt(3 / fan); PyTorch's
/// kaiming_uniform_. Default gain sqrt(2) (ReLU).
template <class T, class Engine>
Matrix<T> he_uniform(Index fan_in, Index fan_out, Engine& engine, FanMode mode = FanMode::fan_in,
                     double gain = std::sqrt(2.0)) {
  detail::check_init_arguments("he_uniform", fan_in, fan_out, gain);
  const Index fan = mode == FanMode::fan_in ? fan_in : fan_out;
  const double bound = gain * std::sqrt(3.0 / static_cast<double>(fan));
  return detail::sample<T>(fan_in, fan_out, std::uniform_real_distribution<double>(-bound, bound),
                           engine);
}

/// (fan_in, fan_out) matrix from N(0, s^2), s = gain / sqrt(fan); PyTorch's
/// kaiming_normal_. Default gain sqrt(2) (ReLU).
template <class T, class Engine>
Matrix<T> he_normal(Index fan_in, Index fan_out, Engine& engine, FanMode mode = FanMode::fan_in,
                    double gain = std::sqrt(2.0)) {
  detail::check_init_arguments("he_normal", fan_in, fan_out, gain);
  const Index fan = mode == FanMode::fan_in ? fan_in : fan_out;
  const double stddev = gain / std::sqrt(static_cast<double>(fan));
  return detail::sample<T>(fan_in, fan_out, std::normal_distribution<double>(0.0, stddev), engine);
}

/// Aliases with PyTorch's names.
template <class T, class Engine>
Matrix<T> kaiming_uniform(Index fan_in, Index fan_out, Engine& engine,
                          FanMode mode = FanMode::fan_in, double gain = std::sqrt(2.0)) {
  return he_uniform<T>(fan_in, fan_out, engine, mode, gain);
}
template <class T, class Engine>
Matrix<T> kaiming_normal(Index fan_in, Index fan_out, Engine& engine,
                         FanMode mode = FanMode::fan_in, double gain = std::sqrt(2.0)) {
  return he_normal<T>(fan_in, fan_out, engine, mode, gain);
}

}  // namespace attn
