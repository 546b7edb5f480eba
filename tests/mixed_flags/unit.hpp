// tests/mixed_flags: one program whose translation units are built with different flags
// (none, -mavx2 -mfma -mf16c, -march=native; tests/mixed_flags/CMakeLists.txt), each computing the
// same attention calls. attn's kernels are chosen at run time and compiled with target
// attributes, so every unit must reach the same kernels, make the same plans and get the
// same bits; the old design chose kernels with #if __AVX512F__ inside inline functions,
// which gave units different bodies of the same function.
#pragma once

#include <string>
#include <vector>

namespace mixed_flags {

struct Results {
  std::vector<float> flash, flash_causal, decode, naive, flash_half_kv;
  std::vector<std::string> plans;
  std::string isa;
};

/// q, k, v (1, heads, length, dim), made once by main.cpp: random numbers drawn in each
/// unit would differ already (FMA contraction inside std::normal_distribution).
struct Inputs {
  static constexpr long heads = 4, length = 300, dim = 64;
  std::vector<float> q, k, v;
};

/// The same calls in each unit.
Results compute_plain(const Inputs& inputs);
Results compute_avx2(const Inputs& inputs);
Results compute_native(const Inputs& inputs);

}  // namespace mixed_flags
