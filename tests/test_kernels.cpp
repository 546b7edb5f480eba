// Tests for attn/kernels/naive.hpp, chunked.hpp and flash.hpp through
// scaled_dot_product_attention_into: the PyTorch fixtures with tiny tiles, randomised
// agreement with the long double reference of support/reference.hpp over sizes around the
// tile width, every mask kind, GQA, thread-count independence and the weights rule.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <attn/attention.hpp>

#include "support/fixtures.hpp"
#include "support/heads.hpp"
#include "support/masked_problem.hpp"
#include "support/results.hpp"
#include "support/sdpa_case.hpp"

using attn::Index;
using attn_test::Heads;
using attn_test::json;

namespace {

constexpr attn::Algorithm tiled_algorithms[] = {attn::Algorithm::chunked, attn::Algorithm::flash};

/// The PyTorch fixtures through chunked and flash with tiny tiles.
template <class T>
void fixtures_with_tiny_tiles() {
  // Accumulation order differs from naive's: allow twice the naive test's tolerance.
  const double rtol = 2 * attn_test::tolerance<T>();
  const json& cases = ATTN_FIXTURE_CASES("sdpa.json", "cases", attn_test::sdpa_case_count);
  for (const json& c : cases) {
    const std::string name = c.at("name").get<std::string>();
    attn_test::SdpaCase<T> fx(c);
    attn::AttentionOptions<T>& options = fx.options;
    for (const attn::Algorithm algorithm : tiled_algorithms) {
      for (const Index query_tile : {1, 2, 3}) {
        for (const Index key_tile : {2, 3}) {
          INFO(name << ": " << attn::algorithm_name(algorithm) << ", query_tile " << query_tile
                    << ", key_tile " << key_tile);
          options.algorithm = algorithm;
          options.query_tile = query_tile;
          options.key_tile = key_tile;
          attn::Tensor<T, 3> lse;
          const attn::Tensor<T, 4> out =
              attn_test::out_of(attn::scaled_dot_product_attention(fx.q, fx.k, fx.v, options,
                                                                   attn::Return::logsumexp),
                                nullptr, &lse);
          ATTN_REQUIRE_CLOSE(out.data(), out.size(), fx.out, rtol);
          ATTN_REQUIRE_CLOSE(lse.data(), lse.size(), fx.lse, rtol);
        }
      }
    }
  }
}

/// Every kernel on one random problem against the long double reference: the output within
/// twice the error of a plain implementation in T (support/reference.hpp), log-sum-exp within
/// 64 eps relative, -inf exactly where the reference has it.
template <class T>
void check_against_reference(attn_test::reference::Problem p, int kind, std::mt19937& rng,
                             Index query_tile, Index key_tile) {
  attn_test::round_numbers_to<T>(p);
  INFO(attn_test::describe(p, kind) << ", query_tile " << query_tile << ", key_tile " << key_tile);
  const Heads<T> q = attn_test::random_heads<T>(p.batch, p.q_heads, p.q_length, p.dim, rng);
  const Heads<T> k = attn_test::random_heads<T>(p.batch, p.kv_heads, p.k_length, p.dim, rng);
  const Heads<T> v = attn_test::random_heads<T>(p.batch, p.kv_heads, p.k_length, p.value_dim, rng);
  const auto qe = attn_test::exact(q), ke = attn_test::exact(k), ve = attn_test::exact(v);
  const auto truth = attn_test::reference::attention<long double>(p, qe, ke, ve);
  const double plain_error =
      attn_test::max_error(attn_test::reference::attention<T>(p, qe, ke, ve).out, truth.out);
  const double bound = attn_test::error_bound<T>(plain_error);
  attn_test::AttnOptions<T> o(p);
  for (const attn::Algorithm algorithm :
       {attn::Algorithm::naive, attn::Algorithm::chunked, attn::Algorithm::flash}) {
    INFO(attn::algorithm_name(algorithm));
    o.options.algorithm = algorithm;
    o.options.query_tile = query_tile;
    o.options.key_tile = key_tile;
    Heads<T> out(p.batch, p.q_heads, p.q_length, p.value_dim);
    std::vector<T> lse(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length));
    attn::scaled_dot_product_attention_into<T>(
        q.cview(), k.cview(), v.cview(),
        attn::AttentionOutputViews{out.view(),
                                   attn::bhl_view(lse.data(), p.batch, p.q_heads, p.q_length)},
        o.options);
    const double error = attn_test::max_error(out.data, truth.out);
    INFO("error " << error << ", plain error " << plain_error << ", bound " << bound);
    REQUIRE(error <= bound);
    const auto cmp =
        attn_test::compare(lse.data(), truth.lse.data(), lse.size(),
                           64 * static_cast<double>(std::numeric_limits<T>::epsilon()));
    INFO(cmp.detail);
    REQUIRE(cmp.ok);
  }
}

/// Lengths around the tile width, head dims 1 to 128, every head layout and mask kind.
template <class T>
void sweep_against_reference() {
  constexpr Index tile = 16;
  const Index lengths[] = {1, 2, 7, tile - 1, tile, tile + 1, 3 * tile + 5, 150};
  const Index dims[] = {1, 8, 64, 80, 128};
  std::mt19937 rng(20240601u);
  std::uniform_int_distribution<int> pick_dim(0, 4), pick_shape(0, 3);
  // (B, Hq, Hkv): plain, B and H > 1, GQA (Hq = 4, Hkv = 2) and MQA (Hkv = 1).
  const Index shapes[4][3] = {{1, 1, 1}, {2, 3, 3}, {2, 4, 2}, {1, 3, 1}};
  // Every (Lq, Lk) pair, with the mask kinds cycling through the pairs and D, Dv, the head
  // layout sampled: a sample of the full product that still covers each value of each axis.
  int counter = 0;
  for (const Index q_length : lengths) {
    for (const Index k_length : lengths) {
      const int kind = counter++ % attn_test::mask_kinds;
      // Keep the long cases cheap: small head dims and a single head there.
      const bool big = q_length * k_length > 5000;
      const Index dim = big ? dims[pick_dim(rng) % 3] : dims[pick_dim(rng)];
      const Index value_dim = big ? dims[pick_dim(rng) % 3] : dims[pick_dim(rng)];
      const Index* shape = big ? shapes[0] : shapes[pick_shape(rng)];
      check_against_reference<T>(attn_test::masked_problem(shape[0], shape[1], shape[2], q_length,
                                                           k_length, dim, value_dim, kind, rng),
                                 kind, rng, tile, tile);
    }
  }
  // Every mask kind with Lq < Lk and Lq > Lk around odd tile sizes, both causal alignments
  // included, with B = 3 (a sequence of each key-length pattern) and GQA; the default tiles;
  // tiles that are not whole vectors or register blocks, Dv past one column block.
  for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
    check_against_reference<T>(attn_test::masked_problem(3, 4, 2, 37, 91, 8, 8, kind, rng), kind,
                               rng, 5, 7);
    check_against_reference<T>(attn_test::masked_problem(2, 4, 2, 91, 37, 16, 8, kind, rng), kind,
                               rng, 7, 5);
    check_against_reference<T>(attn_test::masked_problem(1, 1, 1, 300, 300, 64, 64, kind, rng),
                               kind, rng, 0, 0);
    check_against_reference<T>(attn_test::masked_problem(1, 2, 2, 150, 200, 72, 130, kind, rng),
                               kind, rng, 50, 37);
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("chunked and flash match the PyTorch fixtures with tiny tiles",
                                    "[kernels]", fixtures_with_tiny_tiles)
ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("every kernel agrees with a long double reference", "[kernels]",
                                    sweep_against_reference)

#if ATTN_HAS_OPENMP
namespace {

template <class T>
void same_bits_for_one_and_two_threads() {
  std::mt19937 rng(7u);
  std::normal_distribution<double> normal(0.0, 1.0);
  Heads<T> q(2, 3, 300, 64), k(2, 3, 260, 64), v(2, 3, 260, 40);
  for (Heads<T>* t : {&q, &k, &v})
    for (T& x : t->data)
      x = static_cast<T>(normal(rng));
  const int saved = omp_get_max_threads();
  for (const attn::Algorithm algorithm : tiled_algorithms) {
    for (const attn::Causal causal : {attn::Causal::none, attn::Causal::top_left}) {
      attn::AttentionOptions<T> options;
      options.algorithm = algorithm;
      options.causal = causal;
      options.query_tile = 32;
      options.key_tile = 48;
      std::vector<T> results[2];
      std::vector<T> lse[2];
      for (int threads = 1; threads <= 2; ++threads) {
        omp_set_num_threads(threads);
        Heads<T> out(2, 3, 300, 40);
        lse[threads - 1].resize(2 * 3 * 300);
        attn::scaled_dot_product_attention_into<T>(
            q.cview(), k.cview(), v.cview(),
            {out.view(), attn::bhl_view(lse[threads - 1].data(), 2, 3, 300)}, options);
        results[threads - 1] = out.data;
      }
      omp_set_num_threads(saved);
      REQUIRE(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(T)) ==
              0);
      REQUIRE(std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * sizeof(T)) == 0);
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("chunked and flash give the same bits with 1 and 2 threads",
                                    "[kernels][determinism]", same_bits_for_one_and_two_threads)
#endif  // ATTN_HAS_OPENMP

TEST_CASE("chunked and flash refuse to return weights; automatic falls back to naive",
          "[kernels][errors][isa]") {
  attn::Matrix<float> q = attn::Matrix<float>::Random(100, 8);
  attn::Matrix<float> k = attn::Matrix<float>::Random(90, 8);
  attn::Matrix<float> v = attn::Matrix<float>::Random(90, 4);
  attn::Matrix<float> weights;
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  REQUIRE_THROWS_WITH(
      attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, options, attn::Return::weights),
                        &weights, nullptr),
      "scaled_dot_product_attention: weights were requested with "
      "Algorithm::flash: only Algorithm::naive (or automatic) returns them");
  options.algorithm = attn::Algorithm::chunked;
  REQUIRE_THROWS_WITH(
      attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, options, attn::Return::weights),
                        &weights, nullptr),
      "scaled_dot_product_attention: weights were requested with "
      "Algorithm::chunked: only Algorithm::naive (or automatic) returns them");
  options.algorithm = attn::Algorithm::automatic;
  const attn::Matrix<float> out =
      attn_test::out_of(attn::scaled_dot_product_attention(q, k, v, options, attn::Return::weights),
                        &weights, nullptr);
  REQUIRE(weights.rows() == 100);
  REQUIRE(weights.cols() == 90);
  options.query_tile = -1;
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q, k, v, options),
                      "scaled_dot_product_attention: query_tile is -1 and key_tile is 0: tile "
                      "sizes must be >= 0 (0 = default)");
}

TEST_CASE("flash plans 64-row query tiles for causal attention, 128 otherwise", "[flash]") {
  const attn::AttentionShape shape{1, 8, 8, 2048, 2048, 64, 64};
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  const auto planned = [&] { return attn::plan_attention<float>(shape, options); };
  REQUIRE(planned().query_tile == 128);
  REQUIRE(planned().key_tile == 256);
  REQUIRE(planned().work_items == 8 * 16);
  for (const attn::Causal causal : {attn::Causal::top_left, attn::Causal::bottom_right}) {
    options.causal = causal;
    REQUIRE(planned().query_tile == 64);
    REQUIRE(planned().key_tile == 256);
    REQUIRE(planned().work_items == 8 * 32);
    REQUIRE(planned().describe().find("query tiles of 64, key tiles of 256") != std::string::npos);
  }
  // The tiles asked for win over the causal default.
  options.query_tile = 96;
  REQUIRE(planned().query_tile == 96);
  REQUIRE(planned().work_items == 8 * 22);
  // The low-level plan reads causality from the shape.
  attn::AttentionShape causal_shape = shape;
  causal_shape.causal = true;
  REQUIRE(
      attn::plan_attention<float>(causal_shape, attn::Algorithm::flash, 0, 0, false).query_tile ==
      64);
}

namespace {

template <class T>
void empty_problems_and_nan() {
  attn::AttentionOptions<T> options;
  options.algorithm = attn::Algorithm::flash;
  options.query_tile = 3;
  options.key_tile = 2;
  // No keys: zeros and lse -inf.
  attn::Tensor<T, 4> q1(1, 1, 5, 4), k0(1, 1, 0, 4), v0(1, 1, 0, 3);
  q1.setConstant(1);
  attn::Tensor<T, 3> lse;
  const attn::Tensor<T, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q1, k0, v0, options, attn::Return::logsumexp), nullptr,
      &lse);
  for (Index n = 0; n < out.size(); ++n)
    REQUIRE(out.data()[n] == T(0));
  REQUIRE(lse(0, 0, 4) == -std::numeric_limits<T>::infinity());
  // Dv = 0: an empty output, and the log-sum-exp of two zero scores, log 2 (the AVX-512
  // kernel once did pointer arithmetic on its empty output workspace here: found by the fuzzer).
  attn::Tensor<T, 4> k2(1, 1, 2, 4), v_empty(1, 1, 2, 0);
  k2.setZero();
  const attn::Tensor<T, 4> empty = attn_test::out_of(
      attn::scaled_dot_product_attention(q1, k2, v_empty, options, attn::Return::logsumexp),
      nullptr, &lse);
  REQUIRE(empty.size() == 0);
  for (Index i = 0; i < 5; ++i)
    REQUIRE_THAT(static_cast<double>(lse(0, 0, i)),
                 Catch::Matchers::WithinAbs(std::log(2.0), 1e-6));
  // NaN in a query row reaches only that row; NaN in a key reaches the rows that see it.
  const T nan = std::numeric_limits<T>::quiet_NaN();
  attn::Matrix<T> q = attn::Matrix<T>::Random(7, 8), k = attn::Matrix<T>::Random(9, 8),
                  v = attn::Matrix<T>::Random(9, 3);
  options.causal = attn::Causal::top_left;
  q(2, 5) = nan;
  k(4, 0) = nan;
  for (const attn::Algorithm algorithm : tiled_algorithms) {
    options.algorithm = algorithm;
    const attn::Matrix<T> result = attn::scaled_dot_product_attention(q, k, v, options);
    for (Index i = 0; i < 7; ++i)
      REQUIRE(result.row(i).array().isNaN().all() == (i == 2 || i >= 4));
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE("flash handles empty problems and NaN like naive", "[kernels]",
                                    empty_problems_and_nan)

#if ATTN_X86_DISPATCH
TEST_CASE(
    "the vector kernels' exp is accurate down to the smallest normal float, exactly 0 below "
    "it and at -inf, keeps NaN, and gives the same bits on every instruction set",
    "[kernels]") {
  using Exp = void (*)(const float*, const float*, float*, Index);
  std::vector<std::pair<attn::Isa, Exp>> kernels;
  if (attn::isa_supported(attn::Isa::avx2))
    kernels.emplace_back(attn::Isa::avx2, &attn::detail::avx2::exp_difference);
  if (attn::isa_supported(attn::Isa::avx512))
    kernels.emplace_back(attn::Isa::avx512, &attn::detail::avx512::exp_difference);
  // One call over many values: 23 is not a multiple of a vector, so the tail runs too.
  std::vector<float> xs, shifts;
  for (float x = -103.0f; x <= 0.0f; x += 0.0137f) {
    xs.push_back(x);
    shifts.push_back(0.0f);
  }
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[][2] = {{-87.0f, 0.0f},
                               {0.0f, 0.0f},
                               {-inf, 0.0f},
                               {-inf, -3.0f},
                               {-200.0f, 0.0f},
                               {997.5f, 1000.0f},
                               {std::numeric_limits<float>::quiet_NaN(), 0.0f}};
  const std::size_t first_special = xs.size();
  for (const auto& special : specials) {
    xs.push_back(special[0]);
    shifts.push_back(special[1]);
  }
  std::vector<float> first_result;
  for (const auto& [isa, exp_difference] : kernels) {
    INFO(attn::isa_name(isa));
    std::vector<float> got(xs.size());
    exp_difference(xs.data(), shifts.data(), got.data(), static_cast<Index>(xs.size()));
    // Relative error where x - shift >= -87 (exp >= 1.6e-38, a normal float); below that the
    // result is flushed to 0, because a subnormal result costs a microcode assist.
    double worst_relative = 0;
    bool flushed_below = true;
    for (std::size_t n = 0; n < first_special; ++n) {
      const double expected = std::exp(static_cast<double>(xs[n]));
      if (xs[n] >= -87.0f)
        worst_relative = std::max(worst_relative, std::abs(got[n] - expected) / expected);
      else
        flushed_below = flushed_below && got[n] == 0.0f;
    }
    INFO("worst relative error " << worst_relative);
    CHECK(worst_relative <= 2 * static_cast<double>(std::numeric_limits<float>::epsilon()));
    CHECK(flushed_below);
    const float* special = got.data() + first_special;
    CHECK(special[0] >= std::numeric_limits<float>::min());
    CHECK(special[1] == 1.0f);
    CHECK(special[2] == 0.0f);
    CHECK(special[3] == 0.0f);
    CHECK(special[4] == 0.0f);
    // exp(x - shift) with large logits: the difference is exact, so is the result.
    const double shifted = std::exp(-2.5);
    CHECK(std::abs(special[5] - shifted) / shifted <=
          4 * static_cast<double>(std::numeric_limits<float>::epsilon()));
    CHECK(std::isnan(special[6]));
    if (first_result.empty())
      first_result = got;
    else
      CHECK(std::memcmp(first_result.data(), got.data(), got.size() * sizeof(float)) == 0);
  }
}
#endif  // ATTN_X86_DISPATCH
