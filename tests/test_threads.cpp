// Thread safety: several std::threads call scaled_dot_product_attention, linear_attention
// and one shared const MultiHeadAttention at once. Part of the suite, and built alone under
// ThreadSanitizer (attn_tests_tsan, tests/CMakeLists.txt), without OpenMP.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <attn/attention.hpp>
#include <attn/linear_attention.hpp>
#include <attn/multihead.hpp>

#include "support/random_tensor.hpp"

using attn::Index;

namespace {

using attn_test::random_tensor;

constexpr attn::Algorithm all_algorithms[] = {attn::Algorithm::naive, attn::Algorithm::chunked,
                                              attn::Algorithm::flash};

bool same_bits(const float* a, const float* b, Index n) {
  return n == 0 || std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("threads calling attention and a shared const MultiHeadAttention concurrently",
          "[robustness][threads][isa]") {
  // Every entry point is reentrant: calls share no mutable state (workspaces are local).
  // The results must match the sequential ones bit for bit.
  const attn::Tensor<float, 4> q = random_tensor(2, 4, 70, 16, 31u),
                               k = random_tensor(2, 2, 90, 16, 32u),
                               v = random_tensor(2, 2, 90, 12, 33u);
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.seed = 3;
  const attn::MultiHeadAttention<float> mha(config);
  attn::Tensor<float, 3> x(2, 40, 32);
  {
    std::mt19937 rng(34u);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (Index n = 0; n < x.size(); ++n)
      x.data()[n] = normal(rng);
  }
  constexpr int tasks = 8;
  const auto run = [&](int task) {
    attn::AttentionOptions<float> options;
    options.algorithm = all_algorithms[task % 3];
    options.causal = task % 2 == 0 ? attn::Causal::top_left : attn::Causal::none;
    options.query_tile = 16;
    options.key_tile = 32;
    attn::MultiHeadForwardOptions<float> mha_options;
    mha_options.is_causal = task % 2 == 1;
    mha_options.need_weights = task % 4 == 1;
    std::vector<float> result;
    const attn::Tensor<float, 4> out = attn::scaled_dot_product_attention(q, k, v, options);
    result.assign(out.data(), out.data() + out.size());
    const attn::MultiHeadAttentionOutput<float> m = mha.forward(x, mha_options);
    result.insert(result.end(), m.output.data(), m.output.data() + m.output.size());
    result.insert(result.end(), m.averaged_weights.data(),
                  m.averaged_weights.data() + m.averaged_weights.size());
    const attn::Tensor<float, 4> linear = attn::linear_attention(q, k, v);
    result.insert(result.end(), linear.data(), linear.data() + linear.size());
    return result;
  };
  std::vector<std::vector<float>> sequential(tasks), concurrent(tasks);
  for (int t = 0; t < tasks; ++t)
    sequential[static_cast<std::size_t>(t)] = run(t);
  std::vector<std::thread> threads;
  threads.reserve(tasks);
  for (int t = 0; t < tasks; ++t)
    threads.emplace_back([&, t] { concurrent[static_cast<std::size_t>(t)] = run(t); });
  for (std::thread& thread : threads)
    thread.join();
  for (int t = 0; t < tasks; ++t) {
    INFO("task " << t);
    const auto& s = sequential[static_cast<std::size_t>(t)];
    const auto& c = concurrent[static_cast<std::size_t>(t)];
    REQUIRE(s.size() == c.size());
    REQUIRE(same_bits(s.data(), c.data(), static_cast<Index>(s.size())));
  }
}
