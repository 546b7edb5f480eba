// One call, one instruction set: attn::set_isa() changes the instruction set on another thread
// while calls run, and each call must still run one set from start to end (its plan's:
// attn/plan.hpp reads active_isa() once per call, and every table lookup and mod loop takes
// the plan's set, kernels/dispatch.hpp).
//
// Built alone (attn_tests_dispatch, tests/CMakeLists.txt): header-only and without OpenMP, so
// that every part of a call runs on the calling thread, with ATTN_DISPATCH_OBSERVER recording
// the instruction set of every lookup of that thread. (Only this executable defines it: every
// translation unit of a program must agree on it.)
#include <cstdint>
#include <cstring>

namespace attn_test {
/// Bit i set: the calling thread looked up a kernel or mod loop of Isa i.
inline thread_local unsigned dispatched_isas = 0;
}  // namespace attn_test
#define ATTN_DISPATCH_OBSERVER(isa) (attn_test::dispatched_isas |= 1u << static_cast<unsigned>(isa))

#include <catch2/catch.hpp>

#include <atomic>
#include <bitset>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/mods.hpp>
#include <attn/projection.hpp>
#include <attn/rope.hpp>

#include "support/random_tensor.hpp"
#include "support/results.hpp"

using attn::Index;

namespace {

using attn_test::random_tensor;

unsigned count_isas(unsigned bits) {
  return static_cast<unsigned>(std::bitset<8>(bits).count());
}

}  // namespace

TEST_CASE("a call runs one instruction set while set_isa changes it on another thread",
          "[dispatch][threads]") {
  std::vector<attn::Isa> isas;
  for (const attn::Isa isa : attn::all_isas) {
    if (attn::isa_supported(isa))
      isas.push_back(isa);
  }
  if (isas.size() < 2)
    WARN("this CPU has only the generic kernels: nothing to switch between");

  // Inputs: float queries against half K/V (the widening), GQA, a score_mod and a mask_mod
  // (the mods' loops), every kernel of the forward, the flash backward, a projection's GEMM
  // and RoPE.
  const auto q = random_tensor<float>(1, 4, 40, 16, 1u);
  const auto k = random_tensor<float>(1, 2, 70, 16, 2u);
  const auto v = random_tensor<float>(1, 2, 70, 16, 3u);
  const auto k_half = random_tensor<Eigen::half>(1, 2, 70, 16, 2u);
  const auto v_half = random_tensor<Eigen::half>(1, 2, 70, 16, 3u);
  const auto q_half = random_tensor<Eigen::half>(1, 4, 40, 16, 1u);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::bottom_right;
  options.score_mod = attn::ScoreMod<float>([](float s, Index, Index h, Index i, Index j) {
    return s - 0.01f * static_cast<float>(h + 1) * static_cast<float>(i >= j ? i - j : j - i);
  });
  options.mask_mod = attn::MaskMod([](Index, Index, Index i, Index j) { return (i + j) % 7 != 3; });
  const attn::Linear<float> linear(16, 24, /*bias=*/true, 5u);
  attn::Matrix<float> x = attn::Matrix<float>::Random(33, 16);
  attn::RopeConfig rope_config;
  rope_config.dim = 16;
  const attn::RotaryEmbedding<float> rope(rope_config);

  std::vector<std::pair<std::string, std::function<void()>>> calls;
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::chunked,
                                          attn::Algorithm::flash, attn::Algorithm::decode}) {
    calls.emplace_back(std::string("forward, half K/V, ") + attn::algorithm_name(algorithm),
                       [&, algorithm] {
                         attn::AttentionOptions<float> o = options;
                         o.algorithm = algorithm;
                         (void)attn::scaled_dot_product_attention<float>(q, k_half, v_half, o);
                       });
  }
  calls.emplace_back("forward, half q, naive", [&] {
    attn::AttentionOptions<float> o = options;
    o.algorithm = attn::Algorithm::naive;
    (void)attn::scaled_dot_product_attention(q_half, k_half, v_half, o);
  });
  attn::AttentionOptions<float> backward_options = options;
  backward_options.algorithm = attn::Algorithm::flash;
  backward_options.score_mod = {};  // the backward takes mask_mods only
  attn::Tensor<float, 3> lse;
  const attn::Tensor<float, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q, k, v, backward_options, attn::Return::logsumexp),
      nullptr, &lse);
  calls.emplace_back("flash backward", [&] {
    (void)attn::scaled_dot_product_attention_backward(q, k, v, out, lse, out, backward_options);
  });
  calls.emplace_back("Linear", [&] { (void)linear(x); });
  calls.emplace_back("RotaryEmbedding::apply", [&] {
    attn::Tensor<float, 4> t = q;
    rope.apply(t);
  });

  for (const auto& [name, call] : calls) {  // each call on its own first
    INFO(name);
    REQUIRE_NOTHROW(call());
  }
  // A thread that keeps switching the instruction set until the guard goes out of scope.
  struct Flipper {
    std::atomic<bool> stop{false};
    std::thread thread;
    explicit Flipper(const std::vector<attn::Isa>& sets)
        : thread([this, sets] {
            for (std::size_t n = 0; !stop.load(); ++n)
              attn::set_isa(sets[n % sets.size()]);
          }) {}
    Flipper(const Flipper&) = delete;
    Flipper& operator=(const Flipper&) = delete;
    ~Flipper() {
      stop = true;
      thread.join();
      attn::reset_isa();
    }
  };
  unsigned seen_overall = 0;
  std::size_t mixed = 0, runs = 0, rounds = 0;
  {
    const Flipper flipper(isas);
    // 60 rounds, and more (up to 3000) until the switching has reached every set: on a loaded
    // machine the flipper may be descheduled for a whole round (five sets on a VNNI and BF16
    // CPU took longer to cover than four).
    for (; rounds < 60 || (count_isas(seen_overall) < isas.size() && rounds < 3000); ++rounds) {
      for (const auto& [name, call] : calls) {
        attn_test::dispatched_isas = 0;
        call();
        ++runs;
        seen_overall |= attn_test::dispatched_isas;
        if (count_isas(attn_test::dispatched_isas) != 1) {
          ++mixed;
          UNSCOPED_INFO(name << ": instruction sets looked up " << attn_test::dispatched_isas);
        }
      }
    }
  }
  CHECK(mixed == 0);
  // The switching reached the calls: over all of them, every instruction set ran.
  CHECK(count_isas(seen_overall) == isas.size());
  CHECK(runs == rounds * calls.size());
}
