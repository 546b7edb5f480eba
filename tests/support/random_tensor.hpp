// tests/support/random_tensor.hpp: a (B, H, L, D) tensor of standard normal values, header-only
// (the ThreadSanitizer and dispatch executables build without the tests' support library).
#pragma once

#include <cstdint>
#include <random>

#include <attn/tensor.hpp>

namespace attn_test {

/// (b, h, l, d) values drawn from N(0, 1) by std::mt19937(seed), rounded to T.
template <class T = float>
attn::Tensor<T, 4> random_tensor(attn::Index b, attn::Index h, attn::Index l, attn::Index d,
                                 std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  attn::Tensor<T, 4> t(b, h, l, d);
  for (attn::Index n = 0; n < t.size(); ++n)
    t.data()[n] = static_cast<T>(normal(rng));
  return t;
}

}  // namespace attn_test
