// examples/numpy_random.hpp: NumPy's legacy random stream, bit for bit, for the examples.
//
//   numpy_random rng(42);             // np.random.seed(42)
//   attn::Matrix<double> x = rng.randn(3, 4);  // np.random.randn(3, 4)
//
// NumPy's legacy generator (np.random.seed / np.random.randn, i.e. RandomState) is:
//   seed             MT19937 seeded with init_genrand(seed & 0xffffffff), which is exactly
//                    what std::mt19937(seed) does;
//   random_sample    a 53-bit double in [0, 1) from two 32-bit draws a, b:
//                    ((a >> 5) * 2^26 + (b >> 6)) / 2^53;
//   standard_normal  Marsaglia's polar method: draws pairs (x1, x2) uniform on [-1, 1)^2
//                    until 0 < r2 = x1^2 + x2^2 < 1, returns f * x2 with
//                    f = sqrt(-2 ln(r2) / r2) and keeps f * x1 for the next call.
//   randn(r, c)      r * c standard normals in C (row-major) order.
//
// Reproducing it lets the examples print the same numbers as the NumPy tutorials they
// follow. Every step above is exact IEEE arithmetic except std::log and std::sqrt, which
// come from the same C library NumPy itself calls, so the doubles match bit for bit on
// the same platform. Not part of the library: header-only, examples and tests only.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

#include "attn/tensor.hpp"

namespace attn_examples {

class numpy_random {
 public:
  /// np.random.seed(seed); NumPy accepts seeds in [0, 2^32 - 1].
  explicit numpy_random(std::uint32_t seed) { this->seed(seed); }

  /// Restarts the stream, as np.random.seed(seed). Also drops a cached normal.
  void seed(std::uint32_t seed) {
    engine_.seed(seed);
    has_cached_normal_ = false;
    cached_normal_ = 0.0;
  }

  /// One raw 32-bit MT19937 output.
  std::uint32_t next_uint32() { return static_cast<std::uint32_t>(engine_()); }

  /// np.random.random_sample(): uniform on [0, 1) with 53 random bits.
  double random_sample() {
    const std::uint32_t a = next_uint32() >> 5;        // 27 bits, drawn first
    const std::uint32_t b = next_uint32() >> 6;        // 26 bits
    return (a * 67108864.0 + b) / 9007199254740992.0;  // (a * 2^26 + b) / 2^53
  }

  /// np.random.standard_normal(): N(0, 1) by the polar method, two values per accepted pair.
  double standard_normal() {
    if (has_cached_normal_) {
      has_cached_normal_ = false;
      return cached_normal_;
    }
    double x1 = 0.0;
    double x2 = 0.0;
    double r2 = 0.0;
    do {
      x1 = 2.0 * random_sample() - 1.0;
      x2 = 2.0 * random_sample() - 1.0;
      // Each square is rounded on its own, as in NumPy's C code: a fused multiply-add
      // (which a compiler may form under -ffp-contract=fast) would change the last bit.
      const volatile double x1_squared = x1 * x1;
      const volatile double x2_squared = x2 * x2;
      r2 = x1_squared + x2_squared;
    } while (r2 >= 1.0 || r2 == 0.0);
    const double f = std::sqrt(-2.0 * std::log(r2) / r2);
    cached_normal_ = f * x1;
    has_cached_normal_ = true;
    return f * x2;
  }

  /// np.random.randn(rows, cols): a (rows, cols) matrix filled row by row, like NumPy.
  attn::Matrix<double> randn(attn::Index rows, attn::Index cols) {
    attn::Matrix<double> m(rows, cols);  // (rows, cols)
    for (attn::Index r = 0; r < rows; ++r) {
      for (attn::Index c = 0; c < cols; ++c) {
        m(r, c) = standard_normal();
      }
    }
    return m;
  }

 private:
  std::mt19937 engine_;
  bool has_cached_normal_ = false;
  double cached_normal_ = 0.0;
};

}  // namespace attn_examples
