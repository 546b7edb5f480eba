// tests/mixed_flags (unit.hpp): the units built with -mavx2 and -march=native must agree with
// the plain one, bit for bit, for every instruction set the CPU has forced in turn; except
// that naive and the generic kernels run Eigen's products, which are compiled for each
// unit's own flags, so there they must agree within rounding. Exit 77 (skipped) on a CPU
// without AVX2, where the -mavx2 unit could not run at all.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <attn/cpu.hpp>

#include "unit.hpp"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what.c_str());
    ++failures;
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool close(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || a.empty())
    return false;
  float worst = 0;
  for (std::size_t n = 0; n < a.size(); ++n)
    worst = std::max(worst, std::abs(a[n] - b[n]));
  return worst <= 1e-5f;
}

}  // namespace

int main() {
  if (!attn::isa_supported(attn::Isa::avx2)) {
    std::printf("skipped: this CPU lacks AVX2, which the -mavx2 unit needs\n");
    return 77;
  }
  mixed_flags::Inputs inputs;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::vector<float>* t : {&inputs.q, &inputs.k, &inputs.v}) {
    t->resize(static_cast<std::size_t>(inputs.heads * inputs.length * inputs.dim));
    for (float& x : *t)
      x = normal(rng);
  }
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    const attn::ScopedIsa forced(isa);
    const mixed_flags::Results plain = mixed_flags::compute_plain(inputs);
    const bool exact = isa != attn::Isa::generic;
    for (const auto& [name, other] :
         {std::pair{"-mavx2", mixed_flags::compute_avx2(inputs)},
          std::pair{"-march=native", mixed_flags::compute_native(inputs)}}) {
      const std::string where = std::string(attn::isa_name(isa)) + ", unit " + name + ": ";
      check(other.isa == plain.isa && plain.isa == attn::isa_name(isa), where + "active isa");
      check(other.plans == plain.plans, where + "plans differ");
      const auto agree = [&](const std::vector<float>& a, const std::vector<float>& b) {
        return exact ? same_bits(a, b) : close(a, b);
      };
      check(agree(other.flash, plain.flash), where + "flash");
      check(agree(other.flash_causal, plain.flash_causal), where + "causal flash");
      check(agree(other.decode, plain.decode), where + "decode");
      check(agree(other.flash_half_kv, plain.flash_half_kv), where + "flash, half k and v");
      check(close(other.naive, plain.naive), where + "naive");
      check(close(plain.flash_causal, plain.naive), where + "causal flash against naive");
    }
    std::printf("%s: %s\n", attn::isa_name(isa), failures == 0 ? "all units agree" : "FAILED");
  }
  return failures == 0 ? 0 : 1;
}
