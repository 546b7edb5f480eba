// Test support for the bf16 products tests (test_bf16_compute.cpp, test_bf16_backward.cpp):
// rounding to bfloat16 written out on the bits for their references (no code shared with the
// library), and whether the level under test has bf16 products.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <attn/cpu.hpp>

#include "support/heads.hpp"

namespace attn_test {

/// Whether the instruction set under test (--isa) runs bf16 dot products: otherwise
/// ComputePrecision::bf16 must give the fp32 bits.
inline bool bf16_level() {
  return attn::active_isa() == attn::Isa::avx512_bf16;
}

/// x rounded to the nearest bfloat16, ties to even (what vcvtneps2bf16 does to normal
/// floats).
inline float round_to_bf16(float x) {
  if (std::isnan(x))
    return x;
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  float rounded = 0;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}

/// The values of x rounded to bfloat16, as long double.
template <class T>
std::vector<long double> rounded_to_bf16(const Heads<T>& x) {
  std::vector<long double> r(x.data.size());
  for (std::size_t i = 0; i < r.size(); ++i)
    r[i] = round_to_bf16(static_cast<float>(x.data[i]));
  return r;
}

}  // namespace attn_test
