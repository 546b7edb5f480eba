// attn/dropout.hpp: attention dropout from a counter-based generator, so that the backward
// regenerates the forward's mask instead of storing it.
//
// With probability p each weight p_ij of the softmax is dropped, and the kept ones are
// scaled by 1 / (1 - p) (PyTorch's dropout_p): out_i = sum_j f_ij p_ij v_j with
// f_ij = keep_ij / (1 - p). The log-sum-exp is that of the softmax before dropout. Whether
// (b, h, i, j) is kept depends only on the seed and on those four numbers (sequence b, query
// head h, query i and key j, positions within the sequence), never on tiles, threads,
// kernels or the instruction set:
//
//   row(b, h, i) = the high 32 bits of mix64(mix64(mix64(mix64(seed) ^ b) ^ h) ^ i)
//                  (mix64: SplitMix64's step, its increment added, then its finaliser)
//   x = mix32(row(b, h, i) + j * 0x9E3779B9)  (mod 2^32; mix32: MurmurHash3's fmix32)
//   kept iff x >= threshold = round(p * 2^32)
//
// so a row costs four 64-bit mixes once and each weight one 32-bit mix, which vectorises.
// docs/training.md states the rule; tests re-implement it from there (in C++ and Python).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "attn/config.hpp"

namespace attn {

/// The dropout of one call: p in [0, 1) and the seed (p = 0: no dropout).
template <class T>
class Dropout {
 public:
  Dropout() = default;
  /// Validates p (finite, in [0, 1)); `function` names the caller in errors.
  Dropout(const char* function, T p, std::uint64_t seed) : p_(p), seed_(seed) {
    if (!(p >= T(0) && p < T(1))) {
      detail::throw_invalid_argument(function,
                                     "dropout_p is " + std::to_string(p) + ": must lie in [0, 1)");
    }
    const long double scaled = std::round(static_cast<long double>(p) * 4294967296.0L);
    threshold_ = static_cast<std::uint32_t>(std::min(scaled, 4294967295.0L));
    scale_ = T(1) / (T(1) - p);
  }

  bool active() const { return p_ > T(0); }
  T probability() const { return p_; }
  /// 1 / (1 - p): the factor of a kept weight.
  T scale() const { return scale_; }
  /// round(p * 2^32): a weight is kept iff its 32-bit hash is at least this.
  std::uint32_t threshold() const { return threshold_; }
  /// The hash of weight j of a row is mix32(row + j * key_step) (mod 2^32).
  static constexpr std::uint32_t key_step = 0x9E3779B9u;

  /// The key of query i of sequence b, head h: every weight of the row derives from it.
  std::uint32_t row_key(Index b, Index h, Index i) const {
    std::uint64_t k = mix64(seed_);
    k = mix64(k ^ static_cast<std::uint64_t>(b));
    k = mix64(k ^ static_cast<std::uint64_t>(h));
    k = mix64(k ^ static_cast<std::uint64_t>(i));
    return static_cast<std::uint32_t>(k >> 32);
  }

  /// Whether key j of the row whose key is `row` is kept.
  bool kept(std::uint32_t row, Index j) const {
    return mix32(row + static_cast<std::uint32_t>(j) * key_step) >= threshold_;
  }

  /// The factor f of weight j of the row: 1 / (1 - p) when kept, else 0.
  T factor(std::uint32_t row, Index j) const { return kept(row, j) ? scale_ : T(0); }

  /// f[c] = factor(row, j0 + c) for c < n: one row against n consecutive keys.
  void factors_for_row(std::uint32_t row, Index j0, Index n, T* f) const {
    for (Index c = 0; c < n; ++c) {
      const std::uint32_t x = row + static_cast<std::uint32_t>(j0 + c) * key_step;
      f[c] = mix32(x) >= threshold_ ? scale_ : T(0);
    }
  }

  /// x[c] *= factor(rows[c], j) for c < n.
  void apply_for_key(const std::uint32_t* rows, Index n, Index j, T* x) const {
    const std::uint32_t step = static_cast<std::uint32_t>(j) * key_step;
    for (Index c = 0; c < n; ++c)
      x[c] *= mix32(rows[c] + step) >= threshold_ ? scale_ : T(0);
  }

  /// x[c] *= factor(row, j0 + c) for c < n.
  void apply_for_row(std::uint32_t row, Index j0, Index n, T* x) const {
    for (Index c = 0; c < n; ++c) {
      const std::uint32_t v = row + static_cast<std::uint32_t>(j0 + c) * key_step;
      x[c] *= mix32(v) >= threshold_ ? scale_ : T(0);
    }
  }

  static std::uint64_t mix64(std::uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  static std::uint32_t mix32(std::uint32_t x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
  }

 private:
  T p_ = 0;
  T scale_ = 1;
  std::uint64_t seed_ = 0;
  std::uint32_t threshold_ = 0;
};

}  // namespace attn
