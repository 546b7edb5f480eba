// Tests for attn/kernels/chunked.hpp and attn/kernels/flash.hpp through
// scaled_dot_product_attention_into: the PyTorch fixtures with tiny tiles, randomised
// agreement with a double-precision reference over sizes around the tile width, every mask
// kind, GQA, thread-count independence and the weights rule.
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
#include "support/sdpa_case.hpp"

using attn::Index;
using attn_test::Heads;
using attn_test::json;
using attn_test::max_abs_error;

namespace {

constexpr attn::Algorithm tiled_algorithms[] = {attn::Algorithm::chunked, attn::Algorithm::flash};

/// Absolute floor of the error bound: the flash/chunked error may exceed twice the naive
/// kernel's error by at most this much (outputs are convex combinations of v, |v| <= ~4).
template <class T>
constexpr double error_floor() {
  return 32 * static_cast<double>(std::numeric_limits<T>::epsilon());
}

}  // namespace

TEMPLATE_TEST_CASE("chunked and flash match the PyTorch fixtures with tiny tiles", "[kernels][isa]",
                   float, double) {
  using T = TestType;
  // Accumulation order differs from naive's: allow twice the naive test's tolerance.
  const double rtol = 2 * attn_test::tolerance<T>();
  for (const json& c : attn_test::fixture("sdpa.json").at("cases")) {
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
              attn::scaled_dot_product_attention(fx.q, fx.k, fx.v, options, nullptr, &lse);
          ATTN_REQUIRE_CLOSE(out.data(), out.size(), fx.out, rtol);
          ATTN_REQUIRE_CLOSE(lse.data(), lse.size(), fx.lse, rtol);
        }
      }
    }
  }
}

namespace {

/// One randomised problem: sizes, mask kind, and the tensors it needs.
struct Problem {
  Index batch, q_heads, kv_heads, q_length, k_length, dim, value_dim;
  int mask_kind;  // see describe()
};

std::string describe(const Problem& p) {
  static const char* const kinds[] = {
      "none",
      "causal top-left",
      "causal bottom-right",
      "window (3, 2)",
      "window (-1, 0) + key lengths",
      "window (0, 4)",
      "keep-mask (B, H, Lq, Lk)",
      "bias (1, H, Lq, Lk) with -inf",
      "causal bottom-right + window left 5 + key lengths + keep-mask (B, 1, 1, Lk) + bias",
      "causal top-left + window (4, -1) + bias (1, 1, Lq, Lk)",
      "causal bottom-right + ALiBi + softcap 3",
  };
  return "B " + std::to_string(p.batch) + ", Hq " + std::to_string(p.q_heads) + ", Hkv " +
         std::to_string(p.kv_heads) + ", Lq " + std::to_string(p.q_length) + ", Lk " +
         std::to_string(p.k_length) + ", D " + std::to_string(p.dim) + ", Dv " +
         std::to_string(p.value_dim) + ", mask: " + kinds[p.mask_kind];
}
constexpr int mask_kinds = 11;

/// Runs `p` with kernel `algorithm` in scalar T on the given inputs (already rounded to T).
template <class T>
std::vector<T> run(const Problem& p, const Heads<T>& q, const Heads<T>& k, const Heads<T>& v,
                   attn::Algorithm algorithm, Index query_tile, Index key_tile,
                   std::vector<T>* lse_out, const attn::Tensor<bool, 4>& keep_mask,
                   const attn::Tensor<double, 4>& bias_double) {
  attn::AttentionOptions<T> options;
  options.algorithm = algorithm;
  options.query_tile = query_tile;
  options.key_tile = key_tile;
  attn::Tensor<T, 4> bias;
  if (bias_double.size() > 0) {
    bias = bias_double.template cast<T>();
    options.bias = bias;
  }
  if (keep_mask.size() > 0)
    options.keep_mask = keep_mask;
  std::vector<Index> key_lengths;
  for (Index b = 0; b < p.batch; ++b)
    key_lengths.push_back(b % 2 == 0 ? p.k_length : p.k_length / 2);
  switch (p.mask_kind) {
    case 1:
      options.causal = attn::Causal::top_left;
      break;
    case 2:
      options.causal = attn::Causal::bottom_right;
      break;
    case 3:
      options.window = {3, 2};
      break;
    case 4:
      options.window = {-1, 0};
      options.key_lengths = key_lengths;
      break;
    case 5:
      options.window = {0, 4};
      break;
    case 8:
      options.causal = attn::Causal::bottom_right;
      options.window = {5, -1};
      options.key_lengths = key_lengths;
      break;
    case 9:
      options.causal = attn::Causal::top_left;
      options.window = {4, -1};
      break;
    case 10:
      options.causal = attn::Causal::bottom_right;
      options.alibi_slopes = attn::alibi_slopes<T>(p.q_heads);
      options.softcap = T(3);
      break;
    default:
      break;
  }
  Heads<T> out(p.batch, p.q_heads, p.q_length, p.value_dim);
  std::vector<T> lse(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length));
  attn::scaled_dot_product_attention_into<T>(q.cview(), k.cview(), v.cview(), out.view(), options,
                                             nullptr, lse.data());
  if (lse_out != nullptr)
    *lse_out = lse;
  return out.data;
}

template <class T>
void check_agreement(const Problem& p, std::mt19937& rng, Index query_tile, Index key_tile) {
  INFO(describe(p) << ", query_tile " << query_tile << ", key_tile " << key_tile);
  std::normal_distribution<double> normal(0.0, 1.0);
  Heads<T> q(p.batch, p.q_heads, p.q_length, p.dim), k(p.batch, p.kv_heads, p.k_length, p.dim),
      v(p.batch, p.kv_heads, p.k_length, p.value_dim);
  for (Heads<T>* t : {&q, &k, &v})
    for (T& x : t->data)
      x = static_cast<T>(normal(rng));

  attn::Tensor<bool, 4> keep_mask;
  attn::Tensor<double, 4> bias;
  std::bernoulli_distribution keep(0.7), hide(0.1);
  if (p.mask_kind == 6) {
    keep_mask.resize(p.batch, p.q_heads, p.q_length, p.k_length);
    for (Index n = 0; n < keep_mask.size(); ++n)
      keep_mask.data()[n] = keep(rng);
  } else if (p.mask_kind == 8) {
    keep_mask.resize(p.batch, 1, 1, p.k_length);
    for (Index n = 0; n < keep_mask.size(); ++n)
      keep_mask.data()[n] = keep(rng);
  }
  if (p.mask_kind == 7 || p.mask_kind == 8 || p.mask_kind == 9) {
    if (p.mask_kind == 9) {
      bias.resize(1, 1, p.q_length, p.k_length);
    } else {
      bias.resize(1, p.q_heads, p.q_length, p.k_length);
    }
    for (Index n = 0; n < bias.size(); ++n) {
      bias.data()[n] =
          p.mask_kind == 7 && hide(rng) ? -std::numeric_limits<double>::infinity() : normal(rng);
    }
  }

  // The reference: naive in double on the same (T-rounded) inputs.
  const Heads<double> qd = q.template cast<double>(), kd = k.template cast<double>(),
                      vd = v.template cast<double>();
  std::vector<double> lse_reference;
  const std::vector<double> reference =
      run<double>(p, qd, kd, vd, attn::Algorithm::naive, 0, 0, &lse_reference, keep_mask, bias);
  const double naive_error = max_abs_error(
      run<T>(p, q, k, v, attn::Algorithm::naive, 0, 0, nullptr, keep_mask, bias), reference);
  const double bound = 2 * naive_error + error_floor<T>();
  for (const attn::Algorithm algorithm : tiled_algorithms) {
    INFO(attn::algorithm_name(algorithm));
    std::vector<T> lse;
    const double error = max_abs_error(
        run<T>(p, q, k, v, algorithm, query_tile, key_tile, &lse, keep_mask, bias), reference);
    INFO("error " << error << ", naive error " << naive_error << ", bound " << bound);
    REQUIRE(error <= bound);
    // log-sum-exp: same -inf rows, close elsewhere (relative to max(|lse|, 1)).
    std::vector<double> lse_tolerance_scaled(lse.size());
    const auto cmp =
        attn_test::compare(lse.data(), lse_reference.data(), lse.size(),
                           64 * static_cast<double>(std::numeric_limits<T>::epsilon()));
    INFO(cmp.detail);
    REQUIRE(cmp.ok);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("chunked and flash agree with a double-precision reference", "[kernels][isa]",
                   float, double) {
  using T = TestType;
  constexpr Index tile = 16;
  const Index lengths[] = {1, 2, 7, tile - 1, tile, tile + 1, 3 * tile + 5, 300};
  const Index dims[] = {1, 8, 64, 80, 128};
  std::mt19937 rng(20240601u);
  std::uniform_int_distribution<int> pick_dim(0, 4), pick_shape(0, 3);
  // Every (Lq, Lk) pair, with the mask kinds cycling through the pairs and D, Dv, the head
  // layout sampled: a sample of the full product that still covers each value of each axis.
  int counter = 0;
  for (const Index q_length : lengths) {
    for (const Index k_length : lengths) {
      const int mask_kind = counter++ % mask_kinds;
      // Keep the 300 x 300 cases cheap: small head dims and a single head there.
      const bool big = q_length * k_length > 20000;
      const Index dim = big ? dims[pick_dim(rng) % 3] : dims[pick_dim(rng)];
      const Index value_dim = big ? dims[pick_dim(rng) % 3] : dims[pick_dim(rng)];
      // (B, Hq, Hkv): plain, B and H > 1, GQA (Hq = 4, Hkv = 2) and MQA (Hkv = 1).
      const Index shapes[4][3] = {{1, 1, 1}, {2, 3, 3}, {2, 4, 2}, {1, 3, 1}};
      const Index* shape = shapes[pick_shape(rng)];
      const Problem p{shape[0], shape[1], shape[2], q_length, k_length, dim, value_dim, mask_kind};
      check_agreement<T>(p, rng, tile, tile);
    }
  }
  // Every mask kind with Lq < Lk and Lq > Lk around odd tile sizes, both causal alignments
  // included, with B = 2 and GQA.
  for (int mask_kind = 0; mask_kind < mask_kinds; ++mask_kind) {
    check_agreement<T>({2, 4, 2, 37, 91, 8, 8, mask_kind}, rng, 5, 7);
    check_agreement<T>({2, 4, 2, 91, 37, 16, 8, mask_kind}, rng, 7, 5);
    check_agreement<T>({1, 2, 1, 300, 300, 64, 64, mask_kind}, rng, 0, 0);  // default tiles
    // Tiles that are not whole vectors or register blocks, Dv past one column block.
    check_agreement<T>({1, 2, 2, 150, 200, 72, 130, mask_kind}, rng, 50, 37);
  }
}

TEMPLATE_TEST_CASE("chunked and flash give the same bits with 1 and 2 threads", "[kernels][isa]",
                   float, double) {
#if ATTN_HAS_OPENMP
  using T = TestType;
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
        attn::scaled_dot_product_attention_into<T>(q.cview(), k.cview(), v.cview(), out.view(),
                                                   options, nullptr, lse[threads - 1].data());
        results[threads - 1] = out.data;
      }
      omp_set_num_threads(saved);
      REQUIRE(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(T)) ==
              0);
      REQUIRE(std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * sizeof(T)) == 0);
    }
  }
#else
  SUCCEED("built without OpenMP: single-threaded only");
#endif
}

TEST_CASE("chunked and flash refuse to return weights; automatic falls back to naive",
          "[kernels][errors][isa]") {
  attn::Matrix<float> q = attn::Matrix<float>::Random(100, 8);
  attn::Matrix<float> k = attn::Matrix<float>::Random(90, 8);
  attn::Matrix<float> v = attn::Matrix<float>::Random(90, 4);
  attn::Matrix<float> weights;
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q, k, v, options, &weights),
                      "scaled_dot_product_attention: weights were requested with "
                      "Algorithm::flash: only Algorithm::naive (or automatic) returns them");
  options.algorithm = attn::Algorithm::chunked;
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q, k, v, options, &weights),
                      "scaled_dot_product_attention: weights were requested with "
                      "Algorithm::chunked: only Algorithm::naive (or automatic) returns them");
  options.algorithm = attn::Algorithm::automatic;
  const attn::Matrix<float> out = attn::scaled_dot_product_attention(q, k, v, options, &weights);
  REQUIRE(weights.rows() == 100);
  REQUIRE(weights.cols() == 90);
  options.query_tile = -1;
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q, k, v, options),
                      "scaled_dot_product_attention: query_tile is -1 and key_tile is 0: tile "
                      "sizes must be >= 0 (0 = default)");
}

TEMPLATE_TEST_CASE("flash handles empty problems and NaN like naive", "[kernels][isa]", float,
                   double) {
  using T = TestType;
  attn::AttentionOptions<T> options;
  options.algorithm = attn::Algorithm::flash;
  options.query_tile = 3;
  options.key_tile = 2;
  // No keys: zeros and lse -inf.
  attn::Tensor<T, 4> q1(1, 1, 5, 4), k0(1, 1, 0, 4), v0(1, 1, 0, 3);
  q1.setConstant(1);
  attn::Tensor<T, 3> lse;
  const attn::Tensor<T, 4> out =
      attn::scaled_dot_product_attention(q1, k0, v0, options, nullptr, &lse);
  for (Index n = 0; n < out.size(); ++n)
    REQUIRE(out.data()[n] == T(0));
  REQUIRE(lse(0, 0, 4) == -std::numeric_limits<T>::infinity());
  // Dv = 0: an empty output, and the log-sum-exp of two zero scores, log 2 (the AVX-512
  // kernel once did pointer arithmetic on its empty output workspace here: found by the fuzzer).
  attn::Tensor<T, 4> k2(1, 1, 2, 4), v_empty(1, 1, 2, 0);
  k2.setZero();
  const attn::Tensor<T, 4> empty =
      attn::scaled_dot_product_attention(q1, k2, v_empty, options, nullptr, &lse);
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

TEST_CASE(
    "the vector kernels' exp is accurate down to the smallest normal float, exactly 0 below "
    "it and at -inf, keeps NaN, and gives the same bits on every instruction set",
    "[kernels][isa]") {
#if ATTN_X86_DISPATCH
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
#else
  WARN("this build contains only the generic kernels: no vector exp to test");
#endif
}
