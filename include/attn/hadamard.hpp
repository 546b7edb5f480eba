// attn/hadamard.hpp: the orthonormal Hadamard rotation of a quantized cache's rows.
//
//   x (n)   rotated in place by blockdiag(H_m, ..., H_m), m = hadamard_block_size(n)
//
// H_m (m a power of two) is the Sylvester Hadamard matrix scaled by 1 / sqrt(m): symmetric and
// orthonormal, so H_m H_m = I. Rotating keys and queries by the same H leaves every score
// unchanged, (q H)(k H)^T = q k^T, and rotating values by H rotates the output by H, which a
// second rotation undoes. Its use: a row with a few large coordinates is spread over all m,
// so a block's scale (set by its largest value) fits the others better, and 4-bit blocks
// lose far less (llama.cpp rotates quantized caches the same way; docs/quantized-cache.md).
//
// The block m is the largest power of two that divides n: n itself for the usual head dims
// (64, 128, 256), 32 for 96 or 160, 16 for 80. The transform is the fast Walsh-Hadamard
// butterfly, n log2 m additions and n multiplications.
#pragma once

#include <cmath>

#include "attn/config.hpp"

namespace attn {

/// The size of the Hadamard blocks that rotate rows of n values: the largest power of two
/// dividing n (1 for odd n, which is no rotation).
inline Index hadamard_block_size(Index n) {
  return n > 0 ? (n & -n) : 1;
}

/// x[0, n) = x blockdiag(H_m, ...) in place, m = hadamard_block_size(n): its own inverse.
template <class T>
void hadamard_rotate(T* x, Index n) {
  const Index m = hadamard_block_size(n);
  if (m < 2)
    return;
  const T norm = T(1) / std::sqrt(static_cast<T>(m));
  for (Index first = 0; first < n; first += m) {
    T* block = x + first;
    for (Index half = 1; half < m; half *= 2) {
      for (Index i = 0; i < m; i += 2 * half) {
        for (Index j = i; j < i + half; ++j) {
          const T a = block[j], b = block[j + half];
          block[j] = a + b;
          block[j + half] = a - b;
        }
      }
    }
    for (Index j = 0; j < m; ++j)
      block[j] *= norm;
  }
}

}  // namespace attn
