// Tests for attn/kernels/decode.hpp, attn/kv_cache.hpp and
// MultiHeadAttention::forward_incremental: the decode kernel against the long double
// reference of support/reference.hpp for Lq 1..8, Lk {1, 7, 300, 1100}, GQA groups 1..8 and
// every mask kind, in float, double and with half / bfloat16 K and V; a long context where a
// half accumulator fails; thread-count independence; the cache's growth, overflow and every
// error message; and token-by-token decoding through MultiHeadAttention against its full
// causal forward.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/kv_cache.hpp>
#include <attn/multihead.hpp>

#include "support/fixtures.hpp"
#include "support/heads.hpp"
#include "support/masked_problem.hpp"
#include "support/results.hpp"

using attn::Index;
using attn_test::Heads;
using attn_test::random_heads;
using attn_test::reference::Problem;
using Catch::Matchers::Contains;

namespace {

/// The decode kernel itself (K and V stored as S), with split and key block sizes of the
/// test's choosing, so that many splits and ragged blocks run on small problems.
template <class S>
std::vector<float> run_decode(const Problem& p, const Heads<float>& q, const Heads<S>& k,
                              const Heads<S>& v, Index split_keys, Index key_block,
                              std::vector<float>* lse = nullptr) {
  const attn_test::AttnOptions<float> o(p);
  const attn::AttentionOptions<float>& a = o.options;
  const attn::AttentionProblem<float> problem("decode", p.batch, p.q_heads, p.q_length, p.k_length,
                                              a);
  Heads<float> out(p.batch, p.q_heads, p.q_length, p.value_dim);
  std::vector<float> l(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length));
  attn::KernelPlan plan = attn::plan_attention<float>(
      {p.batch, p.q_heads, p.kv_heads, p.q_length, p.k_length, p.dim, p.value_dim},
      attn::Algorithm::decode, 0, 0, false);
  plan.split_keys = split_keys;
  plan.key_block = key_block;
  attn::detail::decode_attention<float, S>(
      plan, q.cview(), k.cview(), v.cview(), out.view(), problem, static_cast<float>(*p.scale),
      attn::detail::padded_rows(l.data(), p.q_heads, p.q_length));
  if (lse != nullptr)
    *lse = l;
  return out.data;
}

/// Decode (and naive, its yardstick) against the long double reference on one problem.
template <class T>
void check_decode(Problem p, int kind, std::mt19937& rng) {
  attn_test::round_numbers_to<T>(p);
  INFO(attn_test::describe(p, kind));
  const Heads<T> q = random_heads<T>(p.batch, p.q_heads, p.q_length, p.dim, rng);
  const Heads<T> k = random_heads<T>(p.batch, p.kv_heads, p.k_length, p.dim, rng);
  const Heads<T> v = random_heads<T>(p.batch, p.kv_heads, p.k_length, p.value_dim, rng);
  const auto qe = attn_test::exact(q), ke = attn_test::exact(k), ve = attn_test::exact(v);
  const auto truth = attn_test::reference::attention<long double>(p, qe, ke, ve);
  const double plain_error =
      attn_test::max_error(attn_test::reference::attention<T>(p, qe, ke, ve).out, truth.out);
  const double bound = attn_test::error_bound<T>(plain_error);
  attn_test::AttnOptions<T> o(p);
  for (const attn::Algorithm algorithm : {attn::Algorithm::naive, attn::Algorithm::decode}) {
    INFO(attn::algorithm_name(algorithm));
    o.options.algorithm = algorithm;
    Heads<T> out(p.batch, p.q_heads, p.q_length, p.value_dim);
    std::vector<T> lse(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length));
    attn::scaled_dot_product_attention_into<T>(
        q.cview(), k.cview(), v.cview(),
        attn::AttentionOutputViews{out.view(),
                                   attn::bhl_view(lse.data(), p.batch, p.q_heads, p.q_length)},
        o.options);
    const double error = attn_test::max_error(out.data, truth.out);
    CAPTURE(plain_error, error, bound);
    REQUIRE(error <= bound);
    const auto cmp =
        attn_test::compare(lse.data(), truth.lse.data(), lse.size(),
                           64 * static_cast<double>(std::numeric_limits<T>::epsilon()));
    INFO(cmp.detail);
    REQUIRE(cmp.ok);
  }
  if constexpr (std::is_same_v<T, float>) {
    // Many splits and ragged blocks on a small problem: the merge path.
    const double small_splits_error =
        attn_test::max_error(run_decode<float>(p, q, k, v, 7, 3), truth.out);
    CAPTURE(small_splits_error);
    REQUIRE(small_splits_error <= bound);
  }
}

template <class T>
void decode_against_reference() {
  std::mt19937 rng(7);
  // Lk 1100 = 2 * 512 + 76: several splits of decode_split_keys, a ragged last split and in it
  // a ragged key block (76 = 64 + 12); 300: one split of several key blocks, and many splits
  // with run_decode's 7-key splits.
  for (const Index k_length : {1, 7, 300, 1100}) {
    for (const Index q_length : {1, 3, 8}) {
      for (const Index group : {1, 2, 4, 8}) {
        for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
          // Long contexts only for a few mask kinds: the reference is O(Lq * Lk) per head.
          if (k_length == 1100 && (group == 2 || group == 4 || kind % 4 != 0 || q_length > 1))
            continue;
          if (k_length == 300 && (kind + group + q_length) % 2 == 1)
            continue;
          check_decode<T>(
              attn_test::masked_problem(3, 2 * group, 2, q_length, k_length, 19, 13, kind, rng),
              kind, rng);
        }
      }
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "decode matches a long double reference within 2x a plain "
    "implementation's error",
    "[decode]", decode_against_reference)

TEMPLATE_TEST_CASE("decode with half and bfloat16 K and V accumulates in float", "[decode][isa]",
                   Eigen::half, Eigen::bfloat16) {
  using S = TestType;
  std::mt19937 rng(11);
  for (const Index k_length : {1, 7, 300, 1100}) {  // as in decode_against_reference
    for (const Index q_length : {1, 2, 8}) {
      for (const Index group : {1, 4, 8}) {
        for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
          if ((k_length == 1100 && (kind % 4 != 0 || q_length > 1)) ||
              (k_length == 300 && (kind + group) % 2 == 1) || (q_length == 2 && kind % 2))
            continue;
          Problem p =
              attn_test::masked_problem(2, 2 * group, 2, q_length, k_length, 40, 24, kind, rng);
          attn_test::round_numbers_to<float>(p);
          INFO(attn_test::describe(p, kind));
          const auto q = random_heads<float>(p.batch, p.q_heads, p.q_length, p.dim, rng);
          const Heads<S> ks =
              random_heads<float>(p.batch, p.kv_heads, p.k_length, p.dim, rng).template cast<S>();
          const Heads<S> vs = random_heads<float>(p.batch, p.kv_heads, p.k_length, p.value_dim, rng)
                                  .template cast<S>();
          // The exact result on the values the kernel sees (q in float, K and V rounded to S),
          // and what a plain 16-bit implementation computes: scores, probabilities and output
          // rounded to S, sums in float.
          const auto qe = attn_test::exact(q), ke = attn_test::exact(ks), ve = attn_test::exact(vs);
          const auto truth = attn_test::reference::attention<long double>(p, qe, ke, ve);
          const auto to_s = [](float x) { return static_cast<float>(S(x)); };
          const double plain_16bit_error = attn_test::max_error(
              attn_test::reference::attention<float>(p, qe, ke, ve, {to_s, to_s, to_s}).out,
              truth.out);
          for (const Index split : {Index(7), attn::decode_split_keys}) {
            std::vector<float> lse;
            const double error = attn_test::max_error(
                run_decode<S>(p, q, ks, vs, split, split == 7 ? 3 : 64, &lse), truth.out);
            CAPTURE(split, plain_16bit_error, error);
            REQUIRE(error <= attn_test::error_bound<float>(plain_16bit_error));
            REQUIRE(attn_test::max_error(lse, truth.lse) <= 1e-4);
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("decode at the head dims models use (whole vectors of 16) and remainders",
                   "[decode][isa]", float, Eigen::half, Eigen::bfloat16) {
  // The vector products (kernels/simd/tile_products.inl) take whole vectors (16 floats on
  // AVX-512, 8 on AVX2) and 4 keys x 4 rows (AVX2: 2) at a time; these shapes give every row-block
  // remainder (rows 1 .. 8) and key remainder (Lk % 4, block ends) with whole-vector dims, and a
  // 16-lane tail (D 80, Dv 48 are whole too; 72 / 40 are not).
  using S = TestType;
  std::mt19937 rng(13);
  for (const auto& [dim, value_dim] : {std::pair<Index, Index>{64, 128}, {128, 64}, {72, 40}}) {
    // Rows per group G * Lq: 1, 2, 3, 6, 8, 16, every remainder of 4 and of 2.
    for (const Index group : {1, 3, 8}) {
      for (const Index q_length : {1, 2}) {
        for (const int kind : {0, 2, 12}) {
          Problem p =
              attn_test::masked_problem(1, 2 * group, 2, q_length, 1031, dim, value_dim, kind, rng);
          attn_test::round_numbers_to<float>(p);
          INFO(attn_test::describe(p, kind));
          const auto q = random_heads<float>(p.batch, p.q_heads, p.q_length, p.dim, rng);
          const Heads<S> k =
              random_heads<float>(p.batch, p.kv_heads, p.k_length, p.dim, rng).template cast<S>();
          const Heads<S> v = random_heads<float>(p.batch, p.kv_heads, p.k_length, p.value_dim, rng)
                                 .template cast<S>();
          const auto qe = attn_test::exact(q), ke = attn_test::exact(k), ve = attn_test::exact(v);
          const auto truth = attn_test::reference::attention<long double>(p, qe, ke, ve);
          // The float kernel's own rounding: a plain float implementation on the same values.
          const double plain_error = attn_test::max_error(
              attn_test::reference::attention<float>(p, qe, ke, ve).out, truth.out);
          const double error = attn_test::max_error(run_decode<S>(p, q, k, v, 512, 64), truth.out);
          CAPTURE(plain_error, error);
          REQUIRE(error <= attn_test::error_bound<float>(plain_error));
        }
      }
    }
  }
}

TEST_CASE("decode over 16384 half keys stays accurate where a half accumulator fails",
          "[decode][isa]") {
  // Small scores: every key gets a weight near 1, so the softmax sum approaches Lk. A half
  // accumulator stops growing at 2048 (adding 1 to 2048 rounds back to 2048 in half), so
  // its outputs come out ~8x too large; ours sums in float.
  std::mt19937 rng(3);
  Problem p = attn_test::masked_problem(1, 4, 1, 1, 16384, 64, 64, 0, rng);
  attn_test::round_numbers_to<float>(p);
  auto q = random_heads<float>(1, 4, 1, 64, rng);
  for (float& x : q.data)
    x *= 0.01f;
  const auto k = random_heads<float>(1, 1, p.k_length, 64, rng);
  const auto v = random_heads<float>(1, 1, p.k_length, 64, rng);
  const Heads<Eigen::half> ks = k.cast<Eigen::half>(), vs = v.cast<Eigen::half>();
  const std::vector<long double> expected =
      attn_test::reference::attention<long double>(p, attn_test::exact(q), attn_test::exact(ks),
                                                   attn_test::exact(vs))
          .out;
  const double error =
      attn_test::max_error(run_decode<Eigen::half>(p, q, ks, vs, 512, 64), expected);

  // The same online softmax with half running sum and half accumulator.
  std::vector<float> half_out(expected.size());
  for (Index h = 0; h < p.q_heads; ++h) {
    std::vector<double> s(static_cast<std::size_t>(p.k_length));
    double max = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < p.k_length; ++j) {
      double dot = 0;
      for (Index d = 0; d < p.dim; ++d)
        dot +=
            q.data[static_cast<std::size_t>(h * 64 + d)] *
            static_cast<double>(static_cast<float>(ks.data[static_cast<std::size_t>(j * 64 + d)]));
      s[static_cast<std::size_t>(j)] = dot / 8;
      max = std::max(max, s[static_cast<std::size_t>(j)]);
    }
    Eigen::half l(0.0f);
    std::vector<Eigen::half> acc(64, Eigen::half(0.0f));
    for (Index j = 0; j < p.k_length; ++j) {
      const Eigen::half w(static_cast<float>(std::exp(s[static_cast<std::size_t>(j)] - max)));
      l = Eigen::half(static_cast<float>(l) + static_cast<float>(w));
      for (Index d = 0; d < 64; ++d) {
        const auto n = static_cast<std::size_t>(d);
        acc[n] = Eigen::half(static_cast<float>(acc[n]) +
                             static_cast<float>(w) *
                                 static_cast<float>(vs.data[static_cast<std::size_t>(j * 64 + d)]));
      }
    }
    for (Index d = 0; d < 64; ++d)
      half_out[static_cast<std::size_t>(h * 64 + d)] =
          static_cast<float>(acc[static_cast<std::size_t>(d)]) / static_cast<float>(l);
  }
  const double half_error = attn_test::max_error(half_out, expected);
  double magnitude = 0;
  for (const long double x : expected)
    magnitude = std::max(magnitude, static_cast<double>(std::abs(x)));
  CAPTURE(error, half_error, magnitude);
  REQUIRE(error <= 1e-6);            // K and V already rounded: only float rounding is left
  REQUIRE(half_error >= magnitude);  // the half accumulator is wrong by more than the output
}

#if ATTN_HAS_OPENMP
TEST_CASE("decode results are bitwise identical for 1, 2 and 3 threads",
          "[decode][determinism][isa]") {
  const int saved = omp_get_max_threads();
  std::mt19937 rng(5);
  for (int kind : {0, 2, 12}) {
    Problem p = attn_test::masked_problem(2, 8, 2, 2, 5000, 64, 64, kind, rng);
    attn_test::round_numbers_to<float>(p);
    INFO(attn_test::describe(p, kind));
    const auto q = random_heads<float>(p.batch, p.q_heads, p.q_length, p.dim, rng);
    const auto k = random_heads<float>(p.batch, p.kv_heads, p.k_length, p.dim, rng);
    const auto v = random_heads<float>(p.batch, p.kv_heads, p.k_length, p.value_dim, rng);
    const Heads<Eigen::half> kh = k.cast<Eigen::half>(), vh = v.cast<Eigen::half>();
    // 40 items (2 batch entries x 2 kv heads x 10 splits): runs of 2 on 2 threads, of 1 on 3
    std::vector<float> results[3], half_results[3], lse[3];
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      results[threads - 1] = run_decode<float>(p, q, k, v, attn::decode_split_keys,
                                               attn::decode_key_block, &lse[threads - 1]);
      half_results[threads - 1] =
          run_decode<Eigen::half>(p, q, kh, vh, attn::decode_split_keys, attn::decode_key_block);
    }
    omp_set_num_threads(saved);
    for (int t : {1, 2}) {
      REQUIRE(std::memcmp(results[0].data(), results[t].data(), results[0].size() * 4) == 0);
      REQUIRE(std::memcmp(lse[0].data(), lse[t].data(), lse[0].size() * 4) == 0);
      REQUIRE(std::memcmp(half_results[0].data(), half_results[t].data(),
                          half_results[0].size() * 4) == 0);
    }
  }
}
#endif

TEST_CASE("decode: fully masked rows give zeros and -inf, NaN propagates", "[decode][isa]") {
  std::mt19937 rng(9);
  // Mask kind 4: key_lengths[1] = 0, so batch 1 sees nothing.
  Problem p = attn_test::masked_problem(2, 4, 2, 1, 700, 16, 16, 4, rng);
  attn_test::round_numbers_to<float>(p);
  REQUIRE(p.key_lengths == std::vector<Index>{700, 0});
  auto q = random_heads<float>(p.batch, p.q_heads, p.q_length, p.dim, rng);
  auto k = random_heads<float>(p.batch, p.kv_heads, p.k_length, p.dim, rng);
  const auto v = random_heads<float>(p.batch, p.kv_heads, p.k_length, p.value_dim, rng);
  std::vector<float> lse;
  std::vector<float> out = run_decode<float>(p, q, k, v, 512, 64, &lse);
  for (Index n = 4 * 16; n < 8 * 16; ++n)
    REQUIRE(out[static_cast<std::size_t>(n)] == 0.0f);
  for (Index n = 4; n < 8; ++n)
    REQUIRE(lse[static_cast<std::size_t>(n)] == -std::numeric_limits<float>::infinity());
  // A NaN key in the second split of (b 0, kv head 0) reaches its two query heads only.
  k.data[static_cast<std::size_t>(600 * 16 + 3)] = std::numeric_limits<float>::quiet_NaN();
  out = run_decode<float>(p, q, k, v, 512, 64, &lse);
  for (Index n = 0; n < 4 * 16; ++n)
    REQUIRE(std::isnan(out[static_cast<std::size_t>(n)]) == (n < 2 * 16));
}

TEST_CASE("decode handles no keys and no queries", "[decode][isa]") {
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::decode;
  attn::Tensor<float, 4> q(1, 4, 2, 8), k0(1, 2, 0, 8), v0(1, 2, 0, 3);
  q.setConstant(1);
  attn::Tensor<float, 3> lse;
  const attn::Tensor<float, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q, k0, v0, options, attn::Return::logsumexp), nullptr,
      &lse);
  for (Index n = 0; n < out.size(); ++n)
    REQUIRE(out.data()[n] == 0.0f);
  for (Index n = 0; n < lse.size(); ++n)
    REQUIRE(lse.data()[n] == -std::numeric_limits<float>::infinity());
  attn::Tensor<float, 4> q0(1, 4, 0, 8), k(1, 2, 5, 8), v(1, 2, 5, 3);
  REQUIRE(attn::scaled_dot_product_attention(q0, k, v, options).size() == 0);
}

TEST_CASE("automatic picks decode for few queries", "[decode][isa]") {
  const attn::Isa isa = attn::active_isa();
  const auto plan = [](Index q_heads, Index q_length, Index k_length, attn::Algorithm algorithm,
                       bool weights, Index kv_bytes = 4) {
    return attn::plan_attention<float>({1, q_heads, 8, q_length, k_length, 64, 64, kv_bytes},
                                       algorithm, 0, 0, weights, false, "f");
  };
  const auto automatic = [&](Index q_heads, Index q_length, Index k_length, Index kv_bytes = 4) {
    return plan(q_heads, q_length, k_length, attn::Algorithm::automatic, false, kv_bytes).algorithm;
  };
  // The crossovers of plan.hpp's table, on both sides of each: flash's pass over one kv head
  // of 32768 keys reads 16 MiB in float (beyond flash_cached_bytes), of 1024 keys 512 KiB.
  for (const Index k_length : {Index(1024), Index(32768)}) {
    const double flash_bytes = static_cast<double>(k_length) * 128 * 4;  // G = 1
    const Index most = attn::decode_max_queries(isa, false, flash_bytes);
    CAPTURE(k_length, most);
    REQUIRE(most >= 4);
    REQUIRE(automatic(32, 1, k_length) == attn::Algorithm::decode);  // G * Lq = 4 rows
    REQUIRE(automatic(8, most, k_length) == attn::Algorithm::decode);
    REQUIRE(automatic(8, most + 1, k_length) == attn::Algorithm::flash);
  }
  // One query against a short cache: decode on the vector paths (the old rule sent every
  // problem of at most 64 * 64 scores per head to naive), naive on the generic one.
  const bool one_row_naive = attn::automatic_choice(isa, false).naive_max_rows >= 1;
  REQUIRE(automatic(8, 1, 1024) ==
          (one_row_naive ? attn::Algorithm::naive : attn::Algorithm::decode));
  REQUIRE(automatic(8, 1, 64) ==
          (one_row_naive ? attn::Algorithm::naive : attn::Algorithm::decode));
  // With G = 4 flash makes four passes: 1024 float keys read 2 MiB, 8192 keys 16 MiB.
  for (const Index k_length : {Index(1024), Index(8192)}) {
    const Index most =
        attn::decode_max_queries(isa, false, 4.0 * static_cast<double>(k_length) * 128 * 4);
    CAPTURE(k_length, most);
    REQUIRE(automatic(32, most, k_length) == attn::Algorithm::decode);
    REQUIRE(automatic(32, most + 1, k_length) == attn::Algorithm::flash);
  }
  // 16-bit K and V: half the bytes per key.
  const Index most_16bit = attn::decode_max_queries(isa, true, 32768.0 * 128 * 2);
  REQUIRE(automatic(8, most_16bit, 32768, 2) == attn::Algorithm::decode);
  REQUIRE(automatic(8, most_16bit + 1, 32768, 2) == attn::Algorithm::flash);
  // Weights force naive; explicit algorithms are kept.
  REQUIRE(plan(8, 1, 1024, attn::Algorithm::automatic, true).algorithm == attn::Algorithm::naive);
  REQUIRE(plan(8, 1, 1024, attn::Algorithm::flash, false).algorithm == attn::Algorithm::flash);
  REQUIRE_THROWS_WITH(plan(8, 1, 8192, attn::Algorithm::decode, true),
                      Contains("weights were requested with Algorithm::decode"));
}

// --- KVCache -----------------------------------------------------------------------------

TEST_CASE("KVCache grows geometrically and keeps its tokens", "[kv_cache][isa]") {
  attn::KVCache<float> cache(2, 3, 4, 5, 1);
  std::vector<Index> capacities;
  std::mt19937 rng(1);
  Heads<float> all_k(2, 3, 100, 4), all_v(2, 3, 100, 5);
  for (Index t = 0; t < 100; ++t) {
    auto k = random_heads<float>(2, 3, 1, 4, rng);
    auto v = random_heads<float>(2, 3, 1, 5, rng);
    for (Index b = 0; b < 2; ++b)
      for (Index h = 0; h < 3; ++h) {
        all_k.view().head(b, h).row(t) = k.cview().head(b, h).row(0);
        all_v.view().head(b, h).row(t) = v.cview().head(b, h).row(0);
      }
    cache.append(k.cview(), v.cview());
    if (capacities.empty() || capacities.back() != cache.capacity())
      capacities.push_back(cache.capacity());
  }
  REQUIRE(cache.lengths() == std::vector<Index>{100, 100});
  REQUIRE(capacities == std::vector<Index>{1, 2, 4, 8, 16, 32, 64, 128});
  const auto kv = cache.keys_view();
  const auto vv = cache.values_view();
  REQUIRE(kv.shape() == std::array<Index, 4>{2, 3, 100, 4});
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 3; ++h) {
      REQUIRE(kv.head(b, h) == all_k.cview().head(b, h));
      REQUIRE(vv.head(b, h) == all_v.cview().head(b, h));
    }
  cache.clear();
  REQUIRE(cache.max_length() == 0);
  REQUIRE(cache.capacity() == 128);
}

TEST_CASE("KVCache overflow without growth throws and leaves the cache unchanged",
          "[kv_cache][isa]") {
  attn::KVCache<Eigen::half> cache(2, 1, 4, 4, 4, /*allow_growth=*/false);
  Heads<float> k(2, 1, 3, 4), v(2, 1, 3, 4);
  cache.append(k.cview(), v.cview());
  Heads<float> k2(2, 1, 2, 4), v2(2, 1, 2, 4);
  REQUIRE_THROWS_WITH(cache.append(k2.cview(), v2.cview()),
                      "KVCache::append: appending 2 tokens to lengths [3, 3] needs 5 rows but the "
                      "capacity is 4 and allow_growth is off");
  REQUIRE_THROWS_AS(cache.append(k2.cview(), v2.cview()), std::invalid_argument);
  REQUIRE(cache.lengths() == std::vector<Index>{3, 3});
  cache.append(k2.cview(), v2.cview(), std::vector<Index>{1, 0});  // ragged: fits
  REQUIRE(cache.lengths() == std::vector<Index>{4, 3});
  cache.reserve(16);  // explicit growth is allowed
  REQUIRE(cache.capacity() == 16);
}

TEST_CASE("KVCache validates every argument", "[kv_cache][isa]") {
  REQUIRE_THROWS_WITH((attn::KVCache<float>(0, 1, 4, 4, 8)),
                      "KVCache: (B, Hkv, D, Dv) is [0, 1, 4, 4] and capacity 8: sizes must be "
                      "positive and the capacity >= 0");
  REQUIRE_THROWS_WITH((attn::KVCache<float>(1, 1, 4, 4, -1)), Contains("capacity -1"));
  attn::KVCache<float> cache(2, 2, 4, 3, 8);
  const std::string tail = " and the cache is (B, Hkv, D, Dv) = [2, 2, 4, 3]";
  const auto append = [&](Index kb, Index kh, Index kl, Index kd, Index vb, Index vh, Index vl,
                          Index vd, std::vector<Index> counts = {}) {
    Heads<float> k(kb, kh, kl, kd), v(vb, vh, vl, vd);
    cache.append(k.cview(), v.cview(), counts);
  };
  REQUIRE_THROWS_WITH(append(1, 2, 1, 4, 1, 2, 1, 3),
                      "KVCache::append: keys are [1, 2, 1, 4], values are [1, 2, 1, 3]" + tail +
                          ": batch sizes differ");
  REQUIRE_THROWS_WITH(append(2, 2, 1, 4, 2, 1, 1, 3), Contains(": head counts differ"));
  REQUIRE_THROWS_WITH(append(2, 2, 1, 5, 2, 2, 1, 3), Contains(": head dims differ"));
  REQUIRE_THROWS_WITH(append(2, 2, 1, 4, 2, 2, 1, 4), Contains(": head dims differ"));
  REQUIRE_THROWS_WITH(append(2, 2, 2, 4, 2, 2, 1, 3),
                      Contains("keys are [2, 2, 2, 4], values are [2, 2, 1, 3]" + tail +
                               ": keys and values lengths differ"));
  REQUIRE_THROWS_WITH(append(2, 2, 2, 4, 2, 2, 2, 3, {1}),
                      "KVCache::append: counts has 1 entries but the batch size is 2");
  REQUIRE_THROWS_WITH(append(2, 2, 2, 4, 2, 2, 2, 3, {1, 3}),
                      "KVCache::append: counts[1] is 3: must lie in [0, Lnew] with Lnew = 2");
  REQUIRE(cache.lengths() == std::vector<Index>{0, 0});

  append(2, 2, 2, 4, 2, 2, 2, 3);
  const auto attend = [&](Index qb, Index qh, Index ql, Index qd, Index ob, Index oh, Index ol,
                          Index od, attn::AttentionOptions<float> o = {}) {
    Heads<float> q(qb, qh, ql, qd), out(ob, oh, ol, od);
    cache.attend_into(q.cview(), out.view(), o);
  };
  // The rules and words of scaled_dot_product_attention, k and v being the cache's.
  const std::string cached = ", k (cached) is [2, 2, 2, 4], v (cached) is [2, 2, 2, 3]";
  REQUIRE_THROWS_WITH(attend(1, 4, 1, 4, 1, 4, 1, 3),
                      "KVCache::attend: q is [1, 4, 1, 4]" + cached + ": batch sizes differ");
  REQUIRE_THROWS_WITH(
      attend(2, 4, 1, 5, 2, 4, 1, 3),
      "KVCache::attend: q is [2, 4, 1, 5]" + cached + ": q and k (cached) head dims differ");
  REQUIRE_THROWS_WITH(attend(2, 3, 1, 4, 2, 3, 1, 3),
                      "KVCache::attend: q is [2, 3, 1, 4]" + cached +
                          ": query heads (3) must be a multiple of key/value heads (2)");
  REQUIRE_THROWS_WITH(
      attend(2, 4, 1, 4, 2, 4, 1, 4),
      "KVCache::attend: out is [2, 4, 1, 4] but must be [2, 4, 1, 3] (B, Hq, Lq, Dv)");
  REQUIRE_THROWS_WITH(attend(2, 4, 3, 4, 2, 4, 3, 3),
                      Contains(": 3 queries but sequence 0 holds only 2 tokens (append the new "
                               "tokens first)"));
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::top_left;
  REQUIRE_THROWS_WITH(attend(2, 4, 1, 4, 2, 4, 1, 3, causal),
                      "KVCache::attend: options.causal, options.key_lengths and "
                      "options.query_lengths must be unset: the cache applies the bottom-right "
                      "causal mask and its own lengths");
  attn::AttentionOptions<float> lengths;
  lengths.key_lengths = {1, 1};
  REQUIRE_THROWS_WITH(attend(2, 4, 1, 4, 2, 4, 1, 3, lengths), Contains("must be unset"));
  attn::AttentionOptions<float> bad_softcap;
  bad_softcap.softcap = -1.0f;
  REQUIRE_THROWS_WITH(attend(2, 4, 1, 4, 2, 4, 1, 3, bad_softcap),
                      Contains("softcap is -1.000000: must be finite and > 0"));

  Heads<float> k(2, 2, 1, 4), v(2, 2, 1, 3);
  cache.append(k.cview(), v.cview(), std::vector<Index>{1, 0});  // lengths [3, 2]
  attn::Tensor<float, 4> bias(1, 1, 1, 3);
  bias.setZero();
  attn::AttentionOptions<float> with_bias;
  with_bias.bias = bias;
  // Ragged sequences are one call now: a bias with a Lk extent is read at cache row j of
  // every sequence, so it is accepted (test_packed.cpp compares with each sequence alone).
  REQUIRE_NOTHROW(attend(2, 4, 1, 4, 2, 4, 1, 3, with_bias));
}

TEMPLATE_TEST_CASE("KVCache::attend equals attention on each sequence, ragged and not",
                   "[kv_cache][isa]", float, double, Eigen::half, Eigen::bfloat16) {
  using S = TestType;
  using C = typename attn::KVCache<S>::compute_type;
  std::mt19937 rng(2);
  attn::KVCache<S> cache(2, 2, 8, 6, 4);
  const auto k0 = random_heads<C>(2, 2, 9, 8, rng), v0 = random_heads<C>(2, 2, 9, 6, rng);
  cache.append(k0.cview(), v0.cview(), std::vector<Index>{9, 6});  // ragged prompt
  const auto q = random_heads<C>(2, 4, 3, 8, rng);
  const auto k1 = random_heads<C>(2, 2, 3, 8, rng), v1 = random_heads<C>(2, 2, 3, 6, rng);
  cache.append(k1.cview(), v1.cview());  // lengths [12, 9]
  REQUIRE(cache.lengths() == std::vector<Index>{12, 9});
  attn::AttentionOptions<C> o;
  o.alibi_slopes = attn::alibi_slopes<C>(4);
  o.window = {7, -1};
  attn::Tensor<C, 4> q_tensor(2, 4, 3, 8);
  std::copy(q.data.begin(), q.data.end(), q_tensor.data());
  const attn::Tensor<C, 4> out = cache.attend(q_tensor, o);
  // Reference: each sequence alone, its cached rows (as S, then C) with bottom-right causal.
  for (Index b = 0; b < 2; ++b) {
    const Index length = cache.lengths()[static_cast<std::size_t>(b)];
    Heads<C> kb(1, 2, length, 8), vb(1, 2, length, 6), qb(1, 4, 3, 8);
    for (Index h = 0; h < 2; ++h) {
      kb.view().head(0, h) = cache.keys_view().head(b, h).topRows(length).template cast<C>();
      vb.view().head(0, h) = cache.values_view().head(b, h).topRows(length).template cast<C>();
    }
    for (Index h = 0; h < 4; ++h)
      qb.view().head(0, h) = q.cview().head(b, h);
    attn::AttentionOptions<C> ob = o;
    ob.causal = attn::Causal::bottom_right;
    ob.algorithm = attn::Algorithm::naive;
    Heads<C> expected(1, 4, 3, 6);
    attn::scaled_dot_product_attention_into<C>(qb.cview(), kb.cview(), vb.cview(), expected.view(),
                                               ob);
    for (Index n = 0; n < 4 * 3 * 6; ++n) {
      const double e = static_cast<double>(expected.data[static_cast<std::size_t>(n)]);
      const double a = static_cast<double>(out.data()[b * 4 * 3 * 6 + n]);
      REQUIRE(std::abs(a - e) <= 1e-5 * std::max(std::abs(e), 1.0));
    }
  }
  // The stored keys are the appended ones, rounded to S.
  REQUIRE(static_cast<float>(cache.keys_view().head(1, 1)(7, 2)) ==
          static_cast<float>(S(static_cast<float>(k1.cview().head(1, 1)(1, 2)))));
}

// --- MultiHeadAttention::forward_incremental -------------------------------------------

namespace {

template <class TestType>
void decoding_token_by_token_through_multiheadattention_equals() {
  using T = TestType;
  const double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  for (const Index kv_heads : {4, 2, 1}) {
    for (const bool bias : {true, false}) {
      attn::MultiHeadAttentionConfig config;
      config.embed_dim = 32;
      config.num_heads = 4;
      config.num_kv_heads = kv_heads;
      config.bias = bias;
      config.seed = 42;
      attn::MultiHeadAttention<T> mha(config);
      if (bias) {  // non-zero biases, so that a wrong bias path shows
        auto state = mha.state_dict();
        std::mt19937 rng(4);
        std::normal_distribution<double> normal(0.0, 0.5);
        for (auto& x : state["in_proj_bias"].data)
          x = static_cast<T>(normal(rng));
        for (auto& x : state["out_proj.bias"].data)
          x = static_cast<T>(normal(rng));
        mha.load_state_dict(state);
      }
      const Index batch = 2, length = 11;
      std::mt19937 rng(8);
      std::normal_distribution<double> normal(0.0, 1.0);
      attn::Tensor<T, 3> x(batch, length, 32);
      for (Index n = 0; n < x.size(); ++n)
        x.data()[n] = static_cast<T>(normal(rng));
      attn::MultiHeadForwardOptions<T> causal;
      causal.is_causal = true;
      const attn::Tensor<T, 3> expected = mha.forward(x, causal).output;
      for (const Index chunk : {1, 3}) {
        INFO("Hkv " << kv_heads << ", bias " << bias << ", chunk " << chunk);
        attn::KVCache<T> cache(batch, kv_heads, 8, 8, 2);
        for (Index t0 = 0; t0 < length; t0 += chunk) {
          const Index n = std::min(chunk, length - t0);
          attn::Tensor<T, 3> part(batch, n, 32);
          for (Index b = 0; b < batch; ++b)
            for (Index t = 0; t < n; ++t)
              for (Index e = 0; e < 32; ++e)
                part(b, t, e) = x(b, t0 + t, e);
          const attn::Tensor<T, 3> y = mha.forward_incremental(part, cache);
          REQUIRE(y.dimension(1) == n);
          for (Index b = 0; b < batch; ++b)
            for (Index t = 0; t < n; ++t)
              for (Index e = 0; e < 32; ++e) {
                const double want = static_cast<double>(expected(b, t0 + t, e));
                REQUIRE(std::abs(static_cast<double>(y(b, t, e)) - want) <=
                        rtol * std::max(std::abs(want), 1.0));
              }
        }
        REQUIRE(cache.lengths() == std::vector<Index>{length, length});
      }
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "decoding token by token through MultiHeadAttention equals the causal forward",
    "[kv_cache][multihead]", decoding_token_by_token_through_multiheadattention_equals)

TEST_CASE("forward_incremental with a half cache and its errors", "[kv_cache][multihead][isa]") {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  attn::MultiHeadAttention<float> mha(config);
  attn::Tensor<float, 3> x(1, 5, 32);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Index n = 0; n < x.size(); ++n)
    x.data()[n] = normal(rng);
  attn::MultiHeadForwardOptions<float> causal;
  causal.is_causal = true;
  const attn::Tensor<float, 3> expected = mha.forward(x, causal).output;
  attn::KVCache<Eigen::bfloat16> cache(1, 2, 8, 8, 8);
  const attn::Tensor<float, 3> y = mha.forward_incremental(x, cache);
  for (Index n = 0; n < y.size(); ++n)  // bfloat16 K and V: 8 significant bits
    REQUIRE(std::abs(y.data()[n] - expected.data()[n]) <= 2e-2f);

  attn::KVCache<float> wrong(1, 4, 8, 8, 8);
  REQUIRE_THROWS_WITH(mha.forward_incremental(x, wrong),
                      "MultiHeadAttention::forward_incremental: x_new is [1, 5, 32] but the cache "
                      "is (B, Hkv, D, Dv) = [1, 4, 8, 8]: it must be [1, 2, 8, 8]");
  attn::Tensor<float, 3> narrow(1, 5, 16);
  attn::KVCache<float> cache2(1, 2, 8, 8, 8);
  REQUIRE_THROWS_WITH(mha.forward_incremental(narrow, cache2),
                      "MultiHeadAttention::forward_incremental: x_new is [1, 5, 16] but embed_dim "
                      "is 32: widths differ");
  attn::AttentionOptions<float> top_left;
  top_left.causal = attn::Causal::top_left;
  REQUIRE_THROWS_WITH(mha.forward_incremental(x, cache2, top_left), Contains("must be unset"));
  REQUIRE(cache2.max_length() == 0);
  config.add_zero_attn = true;
  attn::MultiHeadAttention<float> zero_attn(config);
  REQUIRE_THROWS_WITH(zero_attn.forward_incremental(x, cache2),
                      Contains("needs kdim = vdim = embed_dim and neither add_bias_kv nor "
                               "add_zero_attn"));
}

TEST_CASE("decode requests q8_0 rows two blocks on into L2 only where they continue in memory",
          "[decode]") {
  // (B = 1, Hkv = 2, Lk = 256, D = 64: two q8_0 blocks a row)
  std::vector<attn::BlockQ8_0> q8(2 * 256 * 2);
  std::vector<attn::BlockQ4_0> q4(q8.size());
  std::vector<float> floats(2 * 256 * 64);
  const auto contiguous =
      attn::bhld_view(static_cast<const attn::BlockQ8_0*>(q8.data()), attn::Index(1),
                      attn::Index(2), attn::Index(256), attn::Index(2));
  // Rows 64..127 of head 1, a block of 64: the rows from 192 on, in memory (also past the
  // last row: the address of a prefetch, never read).
  CHECK(attn::detail::far_rows(contiguous, 0, 1, 64, 64) == q8.data() + (256 + 192) * 2);
  CHECK(attn::detail::far_rows(contiguous, 0, 1, 192, 64) == q8.data() + (256 + 320) * 2);
  CHECK(attn::detail::far_rows(
            attn::bhld_view(static_cast<const attn::BlockQ4_0*>(q4.data()), attn::Index(1),
                            attn::Index(2), attn::Index(256), attn::Index(2)),
            0, 1, 64, 64) == nullptr);
  CHECK(attn::detail::far_rows(
            attn::bhld_view(static_cast<const float*>(floats.data()), attn::Index(1),
                            attn::Index(2), attn::Index(256), attn::Index(64)),
            0, 1, 64, 64) == nullptr);
  // The same rows in pages of 128 (pages 1 and 0 of the pool, in that order): nothing.
  const attn::Index pages[] = {1, 0};
  auto paged = contiguous;
  paged.pages = pages;
  paged.page_rows = 128;
  paged.pages_stride = 2;
  paged.length = 256;
  CHECK(attn::detail::far_rows(paged, 0, 1, 0, 64) == nullptr);
}
