// Tests for attn/quantized.hpp, attn/hadamard.hpp and the quantized KVCache: q8_0 and q4_0
// blocks byte for byte against a plain Python re-implementation of ggml's reference
// quantizers (tests/reference/generate_quantized.py); the NaN rule; the decode kernel over
// blocks against the same kernel over the dequantized values on every instruction set, for
// every mask kind and every pair of formats; against the long double reference on the
// unquantized values within the bound docs/quantized-cache.md derives; the Hadamard
// rotation's invariance in double and its gain for 4-bit keys with outlier channels;
// thread-count independence; every error path, each leaving the cache unchanged.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/hadamard.hpp>
#include <attn/kv_cache.hpp>
#include <attn/multihead.hpp>
#include <attn/quantized.hpp>

#include "support/fixtures.hpp"
#include "support/heads.hpp"
#include "support/masked_problem.hpp"

using attn::BlockQ4_0;
using attn::BlockQ8_0;
using attn::Index;
using attn_test::Heads;
using attn_test::json;
using attn_test::reference::Problem;
using Catch::Matchers::Contains;

namespace {

constexpr std::size_t quantized_case_count = 21;

template <class Block>
std::string hex_of(const std::vector<Block>& blocks) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  const auto* bytes = reinterpret_cast<const unsigned char*>(blocks.data());
  for (std::size_t n = 0; n < blocks.size() * sizeof(Block); ++n) {
    out += digits[bytes[n] >> 4];
    out += digits[bytes[n] & 15];
  }
  return out;
}

std::vector<float> fixture_values(const json& c) {
  std::vector<float> x;
  for (const json& v : c.at("values"))
    x.push_back(static_cast<float>(v.get<double>()));
  return x;
}

/// Blocks of a (B, H, L, D) float tensor, row by row: (B, H, L, D / 32) blocks.
template <class Block>
std::vector<Block> quantized(const Heads<float>& x) {
  std::vector<Block> blocks(x.data.size() / 32);
  attn::quantize_blocks(x.data.data(), static_cast<Index>(x.data.size()), blocks.data());
  return blocks;
}

template <class S>
attn::HeadsView<const S> blocks_view(const std::vector<S>& blocks, Index b, Index h, Index l,
                                     Index units) {
  return attn::bhld_view(blocks.data(), b, h, l, units);
}

/// The values a stored format reads back as, (B, H, L, D) floats.
template <class S>
Heads<float> read_back(const Heads<float>& x) {
  Heads<float> out(x.b, x.h, x.l, x.d);
  if constexpr (attn::is_quantized_v<S>) {
    attn::dequantize_blocks(quantized<S>(x).data(), static_cast<Index>(x.data.size() / 32),
                            out.data.data());
  } else {
    std::transform(x.data.begin(), x.data.end(), out.data.begin(),
                   [](float v) { return static_cast<float>(static_cast<S>(v)); });
  }
  return out;
}

/// The kernel `algorithm` (decode with `split_keys` and `key_block`, or flash with tiles of
/// split_keys queries and key_block keys) with K stored as SK and V as SV (float K/V stored
/// as they are).
template <class SK, class SV>
std::vector<float> run_stored(attn::Algorithm algorithm, const Problem& p, const Heads<float>& q,
                              const Heads<float>& k, const Heads<float>& v, Index split_keys,
                              Index key_block, std::vector<float>* lse = nullptr) {
  const attn_test::AttnOptions<float> o(p);
  const attn::AttentionProblem<float> problem("stored", p.batch, p.q_heads, p.q_length, p.k_length,
                                              o.options);
  const bool flash = algorithm == attn::Algorithm::flash;
  attn::KernelPlan plan = attn::plan_attention<float>(
      {p.batch, p.q_heads, p.kv_heads, p.q_length, p.k_length, p.dim, p.value_dim}, algorithm,
      flash ? split_keys : 0, flash ? key_block : 0, false);
  if (!flash) {
    plan.split_keys = split_keys;
    plan.key_block = key_block;
  }
  Heads<float> out(p.batch, p.q_heads, p.q_length, p.value_dim);
  std::vector<float> l(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length));
  const auto stored = [&](const Heads<float>& x, auto format) {
    using S = decltype(format);
    if constexpr (attn::is_quantized_v<S>)
      return quantized<S>(x);
    else
      return x.template cast<S>().data;
  };
  const auto ks = stored(k, SK{});
  const auto vs = stored(v, SV{});
  const auto k_view =
      blocks_view(ks, p.batch, p.kv_heads, p.k_length, p.dim / attn::values_per_unit_v<SK>);
  const auto v_view =
      blocks_view(vs, p.batch, p.kv_heads, p.k_length, p.value_dim / attn::values_per_unit_v<SV>);
  const auto lse_rows = attn::detail::padded_rows(l.data(), p.q_heads, p.q_length);
  if (flash) {
    attn::detail::run_flash(plan, q.cview(), k_view, v_view, out.view(), problem,
                            static_cast<float>(*p.scale), lse_rows);
  } else {
    attn::detail::decode_attention<float, SK, SV>(plan, q.cview(), k_view, v_view, out.view(),
                                                  problem, static_cast<float>(*p.scale), lse_rows);
  }
  if (lse != nullptr)
    *lse = l;
  return out.data;
}

/// run_stored with the decode kernel.
template <class SK, class SV>
std::vector<float> decode_stored(const Problem& p, const Heads<float>& q, const Heads<float>& k,
                                 const Heads<float>& v, Index split_keys, Index key_block,
                                 std::vector<float>* lse = nullptr) {
  return run_stored<SK, SV>(attn::Algorithm::decode, p, q, k, v, split_keys, key_block, lse);
}

/// Largest |a - b| over entries, NaN where one side is NaN and the other not; and largest
/// |b|.
std::pair<double, double> difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, size = 0;
  for (std::size_t n = 0; n < a.size(); ++n) {
    if (std::isnan(a[n]) != std::isnan(b[n]) || std::isinf(a[n]) != std::isinf(b[n]))
      return {std::numeric_limits<double>::infinity(), 0};
    if (std::isfinite(a[n])) {
      worst = std::max(worst, std::abs(static_cast<double>(a[n]) - b[n]));
      size = std::max(size, std::abs(static_cast<double>(b[n])));
    }
  }
  return {worst, size};
}

template <class SK, class SV>
void blocks_read_like_their_values(const char* formats, int kind_step = 1) {
  INFO(formats);
  std::mt19937 rng(31);
  for (const Index k_length : {Index(7), Index(300), Index(1100)}) {
    for (const Index q_length : {Index(1), Index(3), Index(8)}) {
      for (const Index group : {Index(1), Index(4)}) {
        for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
          // The longest keys and the most query rows on every third mask kind, and the pairs
          // with a 16-bit side on every third kind only (under ASan the full sweep over six
          // pairs took 45 s per instruction set).
          if (kind % kind_step != 0 ||
              ((k_length == 1100 || q_length == 8) && kind % (3 * kind_step) != 0) ||
              (k_length == 1100 && q_length > 1))
            continue;
          Problem p =
              attn_test::masked_problem(2, 2 * group, 2, q_length, k_length, 64, 32, kind, rng);
          attn_test::round_numbers_to<float>(p);
          INFO(attn_test::describe(p, kind));
          const auto q = attn_test::random_heads<float>(p.batch, p.q_heads, q_length, 64, rng);
          const auto k = attn_test::random_heads<float>(p.batch, 2, k_length, 64, rng);
          const auto v = attn_test::random_heads<float>(p.batch, 2, k_length, 32, rng);
          const Heads<float> k_values = read_back<SK>(k), v_values = read_back<SV>(v);
          for (const auto& [split, block] : {std::pair<Index, Index>{512, 64}, {7, 3}}) {
            std::vector<float> lse_blocks, lse_values;
            const std::vector<float> from_blocks =
                decode_stored<SK, SV>(p, q, k, v, split, block, &lse_blocks);
            const std::vector<float> from_values =
                decode_stored<float, float>(p, q, k_values, v_values, split, block, &lse_values);
            const auto [out_error, out_size] = difference(from_blocks, from_values);
            const auto [lse_error, lse_size] = difference(lse_blocks, lse_values);
            CAPTURE(split, out_error, out_size, lse_error, lse_size);
            // A few float ulps of the largest output: the same kernel on the same values,
            // only the order of some products may differ (the generic path widens first).
            REQUIRE(out_error <= 4 * std::numeric_limits<float>::epsilon() * out_size);
            REQUIRE(lse_error <= 4 * std::numeric_limits<float>::epsilon() * lse_size);
          }
          // Flash dequantizes a key tile into its workspace, then runs as on float K/V:
          // bitwise the result on the dequantized values, for default and small tiles.
          for (const auto& [rows, keys] : {std::pair<Index, Index>{0, 0}, {2, 32}}) {
            std::vector<float> lse_blocks, lse_values;
            CAPTURE(rows, keys);
            REQUIRE(
                run_stored<SK, SV>(attn::Algorithm::flash, p, q, k, v, rows, keys, &lse_blocks) ==
                run_stored<float, float>(attn::Algorithm::flash, p, q, k_values, v_values, rows,
                                         keys, &lse_values));
            REQUIRE(lse_blocks == lse_values);
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("q8_0 and q4_0 blocks equal ggml's reference quantizers byte for byte", "[quantized]") {
  const json& cases = ATTN_FIXTURE_CASES("quantized.json", "cases", quantized_case_count);
  for (const json& c : cases) {
    INFO(c.at("name").get<std::string>());
    const std::vector<float> x = fixture_values(c);
    REQUIRE(hex_of(attn::quantize_blocks<BlockQ8_0>(x)) == c.at("q8_0").get<std::string>());
    REQUIRE(hex_of(attn::quantize_blocks<BlockQ4_0>(x)) == c.at("q4_0").get<std::string>());
  }
}

TEST_CASE(
    "dequantized blocks are scale * quant, within half a step of the values (q4_0: a "
    "step where its top nibble clips)",
    "[quantized]") {
  const json& cases = ATTN_FIXTURE_CASES("quantized.json", "cases", quantized_case_count);
  for (const json& c : cases) {
    const std::string name = c.at("name").get<std::string>();
    INFO(name);
    const std::vector<float> x = fixture_values(c);
    const auto q8 = attn::quantize_blocks<BlockQ8_0>(x);
    const auto q4 = attn::quantize_blocks<BlockQ4_0>(x);
    const std::vector<float> x8 = attn::dequantize_blocks(q8), x4 = attn::dequantize_blocks(q4);
    REQUIRE(x8.size() == x.size());
    for (std::size_t n = 0; n < x.size(); ++n) {
      const std::size_t block = n / 32, j = n % 32;
      CAPTURE(n);
      const auto d8 = static_cast<double>(static_cast<float>(q8[block].scale));
      const auto d4 = static_cast<double>(static_cast<float>(q4[block].scale));
      const int nibble = j < 16 ? q4[block].nibbles[j] & 15 : q4[block].nibbles[j - 16] >> 4;
      if (std::isfinite(d8))
        REQUIRE(x8[n] == static_cast<float>(d8 * q8[block].values[j]));  // exact products
      if (std::isfinite(d4))
        REQUIRE(x4[n] == static_cast<float>(d4 * (nibble - 8)));
      // The bounds hold where the fp16 scale is the float one up to fp16's rounding.
      if (name.rfind("tiny", 0) == 0 || name == "fp16 scale overflow")
        continue;
      const double tolerance = 1e-3 * std::abs(x[n]) + 1e-30;
      REQUIRE(std::abs(x8[n] - x[n]) <= 0.5 * std::abs(d8) + tolerance);
      REQUIRE(std::abs(x4[n] - x[n]) <= (nibble == 15 ? 1.0 : 0.5) * std::abs(d4) + tolerance);
    }
  }
}

TEST_CASE("a block holding NaN or infinity reads back as 32 NaNs", "[quantized]") {
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(64, 0.5f);
    x[40] = bad;
    const std::vector<float> x8 = attn::dequantize_blocks(attn::quantize_blocks<BlockQ8_0>(x));
    const std::vector<float> x4 = attn::dequantize_blocks(attn::quantize_blocks<BlockQ4_0>(x));
    for (std::size_t n = 0; n < 64; ++n) {
      CAPTURE(bad, n);
      REQUIRE(std::isnan(x8[n]) == (n >= 32));
      REQUIRE(std::isnan(x4[n]) == (n >= 32));
    }
    REQUIRE(x8[0] == Approx(0.5f).epsilon(1e-3));  // the finite block is unharmed
  }
}

TEST_CASE("quantize_blocks and dequantize_blocks refuse partial blocks and negative counts",
          "[quantized][errors]") {
  std::vector<float> x(48, 1.0f);
  std::vector<BlockQ8_0> blocks(2);
  REQUIRE_THROWS_WITH(
      attn::quantize_blocks(x.data(), 48, blocks.data()),
      Contains("quantize_blocks: the number of values is 48") && Contains("multiple of 32"));
  REQUIRE_THROWS_WITH(attn::quantize_blocks<BlockQ4_0>(x),
                      Contains("quantize_blocks: the number of values is 48"));
  REQUIRE_THROWS_WITH(attn::dequantize_blocks(blocks.data(), -1, x.data()),
                      Contains("dequantize_blocks: the number of blocks is -1"));
}

TEST_CASE(
    "decode and flash over q8_0 and q4_0 blocks equal the same kernel over their values, every "
    "mask kind",
    "[quantized][isa]") {
  blocks_read_like_their_values<BlockQ8_0, BlockQ8_0>("K q8_0, V q8_0");
  blocks_read_like_their_values<BlockQ8_0, BlockQ4_0>("K q8_0, V q4_0");
  blocks_read_like_their_values<BlockQ4_0, BlockQ8_0>("K q4_0, V q8_0");
  blocks_read_like_their_values<BlockQ4_0, BlockQ4_0>("K q4_0, V q4_0");
  blocks_read_like_their_values<Eigen::half, BlockQ8_0>("K half, V q8_0", 3);
  blocks_read_like_their_values<BlockQ4_0, Eigen::bfloat16>("K q4_0, V bfloat16", 3);
}

TEST_CASE("decode over blocks is within the quantization bound of the exact result",
          "[quantized][isa]") {
  // docs/quantized-cache.md: with dk_j = the error of key j and dv_j of value j,
  //   delta = scale max_j |q . dk_j|,  |out - exact| <= max_j |dv_j| + (e^(2 delta) - 1) max_j
  //   |v_j|
  // per query row (the softmax weights change by at most a factor e^(+-2 delta)); plus the
  // float kernel's own rounding, far below it here.
  std::mt19937 rng(5);
  for (int kind = 0; kind < attn_test::mask_kinds; kind += 2) {
    Problem p = attn_test::masked_problem(1, 4, 2, 2, 600, 64, 64, kind, rng);
    attn_test::round_numbers_to<float>(p);
    INFO(attn_test::describe(p, kind));
    const auto q = attn_test::random_heads<float>(1, 4, 2, 64, rng);
    const auto k = attn_test::random_heads<float>(1, 2, 600, 64, rng);
    const auto v = attn_test::random_heads<float>(1, 2, 600, 64, rng);
    const auto truth = attn_test::reference::attention<long double>(
        p, attn_test::exact(q), attn_test::exact(k), attn_test::exact(v));
    const auto check = [&](const std::vector<float>& out, const Heads<float>& k_read,
                           const Heads<float>& v_read, const char* formats) {
      INFO(formats);
      for (Index h = 0; h < 4; ++h) {
        for (Index i = 0; i < 2; ++i) {
          const Index kv = h / 2;
          double delta = 0, dv = 0, vmax = 0;
          for (Index j = 0; j < 600; ++j) {
            double dot = 0;
            for (Index d = 0; d < 64; ++d) {
              const auto at = static_cast<std::size_t>((kv * 600 + j) * 64 + d);
              dot += static_cast<double>(q.data[static_cast<std::size_t>((h * 2 + i) * 64 + d)]) *
                     (static_cast<double>(k_read.data[at]) - k.data[at]);
              dv = std::max(dv, std::abs(static_cast<double>(v_read.data[at]) - v.data[at]));
              vmax = std::max(vmax, std::abs(static_cast<double>(v.data[at])));
            }
            delta = std::max(delta, std::abs(dot) * static_cast<double>(*p.scale));
          }
          const double bound = dv + std::expm1(2 * delta) * vmax + 1e-5 * vmax;
          double error = 0;
          for (Index e = 0; e < 64; ++e) {
            const auto at = static_cast<std::size_t>((h * 2 + i) * 64 + e);
            const double exact = static_cast<double>(truth.out[at]);
            if (std::isfinite(exact))
              error = std::max(error, std::abs(static_cast<double>(out[at]) - exact));
          }
          CAPTURE(h, i, delta, dv, error, bound);
          REQUIRE(error <= bound);
        }
      }
    };
    check(decode_stored<BlockQ8_0, BlockQ8_0>(p, q, k, v, 512, 64), read_back<BlockQ8_0>(k),
          read_back<BlockQ8_0>(v), "q8_0");
    check(decode_stored<BlockQ4_0, BlockQ4_0>(p, q, k, v, 512, 64), read_back<BlockQ4_0>(k),
          read_back<BlockQ4_0>(v), "q4_0");
  }
}

TEST_CASE("a quantized cache gives the same bits for any thread count", "[quantized][isa]") {
  std::mt19937 rng(8);
  const auto k = attn_test::random_heads<float>(1, 2, 3000, 64, rng);
  const auto v = attn_test::random_heads<float>(1, 2, 3000, 64, rng);
  const auto q = attn_test::random_heads<float>(1, 8, 1, 64, rng);
  std::vector<std::vector<float>> results;
  for (const int threads : {1, 2, 3}) {
#if ATTN_HAS_OPENMP
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
#endif
    attn::KVCache<BlockQ8_0, BlockQ4_0> cache(1, 2, 64, 64, 16);
    cache.append(k.cview(), v.cview());
    Heads<float> out(1, 8, 1, 64);
    cache.attend_into(q.cview(), out.view());
    results.push_back(out.data);
#if ATTN_HAS_OPENMP
    omp_set_num_threads(saved);
#else
    (void)threads;
#endif
  }
  REQUIRE(std::memcmp(results[0].data(), results[1].data(), results[0].size() * 4) == 0);
  REQUIRE(std::memcmp(results[0].data(), results[2].data(), results[0].size() * 4) == 0);
}

TEST_CASE("a quantized KVCache attends like a float cache holding the values it reads back",
          "[quantized][isa]") {
  std::mt19937 rng(9);
  const Index batch = 2, kv_heads = 2, q_heads = 8, dim = 64, value_dim = 96;
  const auto prompt_k = attn_test::random_heads<float>(batch, kv_heads, 150, dim, rng);
  const auto prompt_v = attn_test::random_heads<float>(batch, kv_heads, 150, value_dim, rng);
  attn::KVCache<BlockQ4_0, BlockQ8_0> cache(batch, kv_heads, dim, value_dim, 4);
  attn::KVCache<float> values(batch, kv_heads, dim, value_dim, 4);
  const std::vector<Index> counts{150, 97};  // ragged prompts
  cache.append(prompt_k.cview(), prompt_v.cview(), counts);
  values.append(read_back<BlockQ4_0>(prompt_k).cview(), read_back<BlockQ8_0>(prompt_v).cview(),
                counts);
  REQUIRE(cache.lengths() == values.lengths());
  attn::AttentionOptions<float> options;
  options.window = {40, 0};
  options.softcap = 20.0f;
  const std::vector<float> slopes{0.5f, 0.25f, 0.125f, 0.0625f, 0.03f, 0.02f, 0.01f, 0.0f};
  options.alibi_slopes = slopes;
  // Lq = 1 (a token) and Lq = 90 (a chunk of prompt), through each kernel that reads blocks
  // (automatic: decode for the token, flash for the chunk), against the same kernel over the
  // float cache of the dequantized values.
  for (const Index q_length : {Index(1), Index(90)}) {
    const auto q = attn_test::random_heads<float>(batch, q_heads, q_length, dim, rng);
    for (const attn::Algorithm algorithm :
         {attn::Algorithm::automatic, attn::Algorithm::decode, attn::Algorithm::flash}) {
      Heads<float> out(batch, q_heads, q_length, value_dim), expected = out;
      std::vector<float> lse(static_cast<std::size_t>(batch * q_heads * q_length)),
          lse_expected = lse;
      attn::AttentionOptions<float> chosen = options, same = options;
      chosen.algorithm = algorithm;
      same.algorithm = algorithm != attn::Algorithm::automatic ? algorithm
                       : q_length == 1                         ? attn::Algorithm::decode
                                                               : attn::Algorithm::flash;
      cache.attend_into(q.cview(),
                        attn::AttentionOutputViews<float>{
                            out.view(), attn::bhl_view(lse.data(), batch, q_heads, q_length)},
                        chosen);
      values.attend_into(
          q.cview(),
          attn::AttentionOutputViews<float>{
              expected.view(), attn::bhl_view(lse_expected.data(), batch, q_heads, q_length)},
          same);
      const auto [error, size] = difference(out.data, expected.data);
      CAPTURE(q_length, attn::algorithm_name(algorithm), error, size);
      REQUIRE(error <= 4 * std::numeric_limits<float>::epsilon() * size);
      REQUIRE(difference(lse, lse_expected).first <= 1e-5);
    }
  }
}

TEST_CASE("a NaN appended to a quantized cache reaches exactly the rows that see it",
          "[quantized]") {
  const Index dim = 32;
  attn::KVCache<BlockQ8_0> cache(2, 1, dim, dim, 8);
  Heads<float> k(2, 1, 6, dim), v(2, 1, 6, dim);
  std::fill(k.data.begin(), k.data.end(), 0.25f);
  std::fill(v.data.begin(), v.data.end(), 1.0f);
  v.data[static_cast<std::size_t>(2 * dim + 5)] =
      std::numeric_limits<float>::quiet_NaN();  // b 0, key 2
  cache.append(k.cview(), v.cview());
  Heads<float> q(2, 1, 1, dim);
  std::fill(q.data.begin(), q.data.end(), 0.1f);
  attn::AttentionOptions<float> sees_last_two;
  sees_last_two.window = {1, 0};
  const Heads<float> all = [&] {
    Heads<float> out(2, 1, 1, dim);
    cache.attend_into(q.cview(), out.view());
    return out;
  }();
  Heads<float> windowed(2, 1, 1, dim);
  cache.attend_into(q.cview(), windowed.view(), sees_last_two);
  for (Index e = 0; e < dim; ++e) {
    CAPTURE(e);
    REQUIRE(std::isnan(all.data[static_cast<std::size_t>(e)]));  // b 0 sees key 2
    // b 1 does not see it, nor b 0's keys 4 and 5 (1.0 within q8_0's step of 1 / 127)
    REQUIRE(all.data[static_cast<std::size_t>(dim + e)] == Approx(1.0f).epsilon(1e-3));
    REQUIRE(windowed.data[static_cast<std::size_t>(e)] == Approx(1.0f).epsilon(1e-3));
  }
}

TEST_CASE("Hadamard rotation leaves a double cache's attention unchanged to 1e-12", "[quantized]") {
  for (const Index dim : {Index(64), Index(96), Index(80)}) {
    CAPTURE(dim, attn::hadamard_block_size(dim));
    std::mt19937 rng(static_cast<unsigned>(dim));
    const auto k = attn_test::random_heads<double>(2, 2, 40, dim, rng);
    const auto v = attn_test::random_heads<double>(2, 2, 40, dim, rng);
    const auto q = attn_test::random_heads<double>(2, 4, 3, dim, rng);
    attn::KVCache<double> plain(2, 2, dim, dim, 40);
    attn::KVCache<double> rotated(2, 2, dim, dim, 40, true, attn::KVRotation::hadamard);
    plain.append(k.cview(), v.cview());
    rotated.append(k.cview(), v.cview());
    Heads<double> a(2, 4, 3, dim), b = a;
    plain.attend_into(q.cview(), a.view());
    rotated.attend_into(q.cview(), b.view());
    double worst = 0;
    for (std::size_t n = 0; n < a.data.size(); ++n)
      worst = std::max(worst, std::abs(a.data[n] - b.data[n]));
    CAPTURE(worst);
    REQUIRE(worst <= 1e-12);
    // The stored rows are rotated: H is not the identity.
    REQUIRE(rotated.keys_view().head(0, 0)(0, 0) != plain.keys_view().head(0, 0)(0, 0));
  }
  // H H = I, and H of a unit vector has every entry +-1 / sqrt(m).
  std::vector<double> x(64, 0.0);
  x[3] = 1.0;
  attn::hadamard_rotate(x.data(), 64);
  for (const double e : x)
    REQUIRE(std::abs(std::abs(e) - 0.125) <= 1e-15);
  attn::hadamard_rotate(x.data(), 64);
  for (std::size_t n = 0; n < 64; ++n)
    REQUIRE(std::abs(x[n] - (n == 3 ? 1.0 : 0.0)) <= 1e-15);
}

TEST_CASE("with outlier channels in the keys, rotation brings q4_0 attention closer to float",
          "[quantized]") {
  // Keys as in trained models: a few channels far larger than the rest (here 2 of 64, at
  // 10x), which set their blocks' scales and leave the other values a step or less. V is
  // float, so that the errors are the keys'. Measured as the RMS error of the log-sum-exp
  // (the scores' error) and of the output over 32 query heads.
  std::mt19937 rng(12);
  const Index length = 512, dim = 64, q_heads = 32;
  auto k = attn_test::random_heads<float>(1, 1, length, dim, rng);
  for (Index j = 0; j < length; ++j) {
    k.data[static_cast<std::size_t>(j * dim + 7)] *= 10.0f;
    k.data[static_cast<std::size_t>(j * dim + 41)] *= 10.0f;
  }
  const auto v = attn_test::random_heads<float>(1, 1, length, dim, rng);
  const auto q = attn_test::random_heads<float>(1, q_heads, 1, dim, rng);
  const auto attend = [&](auto cache) {
    cache.append(k.cview(), v.cview());
    std::pair<Heads<float>, std::vector<float>> result{Heads<float>(1, q_heads, 1, dim),
                                                       std::vector<float>(q_heads)};
    cache.attend_into(
        q.cview(), attn::AttentionOutputViews<float>{
                       result.first.view(), attn::bhl_view(result.second.data(), 1, q_heads, 1)});
    return result;
  };
  const auto exact = attend(attn::KVCache<float>(1, 1, dim, dim, length));
  const auto rms = [](const std::vector<float>& a, const std::vector<float>& b) {
    double sum = 0;
    for (std::size_t n = 0; n < a.size(); ++n)
      sum += (static_cast<double>(a[n]) - b[n]) * (static_cast<double>(a[n]) - b[n]);
    return std::sqrt(sum / static_cast<double>(a.size()));
  };
  const auto plain = attend(attn::KVCache<BlockQ4_0, float>(1, 1, dim, dim, length));
  const auto rotated = attend(
      attn::KVCache<BlockQ4_0, float>(1, 1, dim, dim, length, true, attn::KVRotation::hadamard));
  const double lse_plain = rms(plain.second, exact.second);
  const double lse_rotated = rms(rotated.second, exact.second);
  const double out_plain = rms(plain.first.data, exact.first.data);
  const double out_rotated = rms(rotated.first.data, exact.first.data);
  CAPTURE(lse_plain, lse_rotated, out_plain, out_rotated);
  REQUIRE(lse_rotated < 0.6 * lse_plain);
  REQUIRE(out_rotated < 0.6 * out_plain);
}

TEST_CASE(
    "KVCache refuses quantized formats that do not fit, and options a quantized cache "
    "cannot run, changing nothing",
    "[quantized][errors]") {
  using Q8 = attn::KVCache<BlockQ8_0>;
  using Q84 = attn::KVCache<BlockQ8_0, BlockQ4_0>;
  REQUIRE_THROWS_WITH(Q8(1, 2, 48, 64, 4),
                      Contains("KVCache: (B, Hkv, D, Dv) is [1, 2, 48, 64]: D is 48 but a "
                               "quantized format needs a multiple of 32"));
  REQUIRE_THROWS_WITH(Q84(1, 2, 64, 40, 4), Contains("Dv is 40"));
  REQUIRE_THROWS_WITH((attn::KVCache<float, BlockQ4_0>(1, 2, 64, 33, 4)), Contains("Dv is 33"));
  REQUIRE_NOTHROW(attn::KVCache<BlockQ8_0, float>(1, 2, 64, 33, 4));  // V unquantized

  std::mt19937 rng(4);
  Q84 cache(1, 2, 64, 64, 4, /*allow_growth=*/false);
  const auto k = attn_test::random_heads<float>(1, 2, 3, 64, rng);
  const auto v = attn_test::random_heads<float>(1, 2, 3, 64, rng);
  cache.append(k.cview(), v.cview());
  const auto keys_before = std::vector<unsigned char>(
      reinterpret_cast<const unsigned char*>(cache.keys_view().data),
      reinterpret_cast<const unsigned char*>(cache.keys_view().data) + 2 * 4 * 2 * 34);
  const auto long_k = attn_test::random_heads<float>(1, 2, 2, 64, rng);
  REQUIRE_THROWS_WITH(cache.append(long_k.cview(), long_k.cview()),
                      Contains("capacity is 4 and allow_growth is off"));
  const auto wide = attn_test::random_heads<float>(1, 2, 1, 96, rng);
  REQUIRE_THROWS_WITH(cache.append(wide.cview(), wide.cview()), Contains("head dims differ"));
  REQUIRE(cache.lengths() == std::vector<Index>{3});
  REQUIRE(std::memcmp(keys_before.data(), cache.keys_view().data, keys_before.size()) == 0);

  const auto q = attn_test::random_heads<float>(1, 4, 1, 64, rng);
  Heads<float> out(1, 4, 1, 64), weights(1, 4, 1, 3);
  std::fill(out.data.begin(), out.data.end(), 7.0f);
  REQUIRE_THROWS_WITH(
      cache.attend_into(q.cview(),
                        attn::AttentionOutputViews<float>{out.view(), {}, weights.view()}),
      Contains("KVCache::attend: weights are not available with a quantized cache"));
  for (const attn::Algorithm other : {attn::Algorithm::naive, attn::Algorithm::chunked}) {
    attn::AttentionOptions<float> refused;
    refused.algorithm = other;
    REQUIRE_THROWS_WITH(cache.attend_into(q.cview(), out.view(), refused),
                        "KVCache::attend: options.algorithm is " +
                            std::string(attn::algorithm_name(other)) +
                            ": a quantized cache runs the decode or the flash kernel "
                            "(automatic, decode or flash)");
  }
  const auto q_wide = attn_test::random_heads<float>(1, 4, 1, 32, rng);
  REQUIRE_THROWS_WITH(
      cache.attend_into(q_wide.cview(), out.view()),
      Contains("KVCache::attend: q is [1, 4, 1, 32], k (cached) is [1, 2, 3, 64]") &&
          Contains("head dims differ"));
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::top_left;
  REQUIRE_THROWS_WITH(cache.attend_into(q.cview(), out.view(), causal),
                      Contains("options.causal, options.key_lengths and options.query_lengths "
                               "must be unset"));
  REQUIRE(std::all_of(out.data.begin(), out.data.end(), [](float x) { return x == 7.0f; }));

  // A rotating cache checks the outputs against the caller's q, not its rotated copy.
  {
    Q8 rotating(1, 2, 64, 64, 4, true, attn::KVRotation::hadamard);
    rotating.append(k.cview(), v.cview());
    Heads<float> q_and_lse(1, 4, 1, 64), out_rotated(1, 4, 1, 64);
    const attn::RowsView<float> lse_on_q = attn::bhl_view(q_and_lse.data.data(), 1, 4, 1);
    REQUIRE_THROWS_WITH(
        rotating.attend_into(q_and_lse.cview(),
                             attn::AttentionOutputViews<float>{out_rotated.view(), lse_on_q}),
        Contains("KVCache::attend: logsumexp overlaps q"));
  }

  // Packed queries against a cache (rotating or not): refused before any rotation.
  for (const attn::KVRotation rotation : {attn::KVRotation::none, attn::KVRotation::hadamard}) {
    Q8 two(2, 2, 64, 64, 4, true, rotation);
    const auto k2 = attn_test::random_heads<float>(2, 2, 3, 64, rng);
    two.append(k2.cview(), k2.cview());
    Heads<float> tokens(1, 4, 3, 64), out_tokens(1, 4, 3, 64);
    const std::vector<Index> cu_seqlens{0, 1, 3};
    REQUIRE_THROWS_WITH(two.attend_into(attn::packed_view(tokens.cview(), cu_seqlens),
                                        attn::packed_view(out_tokens.view(), cu_seqlens)),
                        Contains("KVCache::attend: q is a packed view but k is not"));
  }
}

TEST_CASE("MultiHeadAttention decodes on a quantized cache close to a float cache", "[quantized]") {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 128;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.seed = 3;
  attn::MultiHeadAttention<float> mha(config);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  attn::Tensor<float, 3> x(1, 40, 128);
  for (Index n = 0; n < x.size(); ++n)
    x.data()[n] = normal(rng);
  attn::KVCache<float> exact(1, 2, 32, 32, 8);
  attn::KVCache<BlockQ8_0> q8(1, 2, 32, 32, 8);
  attn::KVCache<BlockQ4_0> q4(1, 2, 32, 32, 8, true, attn::KVRotation::hadamard);
  const attn::Tensor<float, 3> a = mha.forward_incremental(x, exact);
  const attn::Tensor<float, 3> b = mha.forward_incremental(x, q8);
  const attn::Tensor<float, 3> c = mha.forward_incremental(x, q4);
  double size = 0, error8 = 0, error4 = 0;
  for (Index n = 0; n < a.size(); ++n) {
    size = std::max(size, static_cast<double>(std::abs(a.data()[n])));
    error8 = std::max(error8, static_cast<double>(std::abs(a.data()[n] - b.data()[n])));
    error4 = std::max(error4, static_cast<double>(std::abs(a.data()[n] - c.data()[n])));
  }
  CAPTURE(size, error8, error4);
  REQUIRE(error8 > 0);  // the cache really holds 8-bit blocks
  REQUIRE(error8 <= 0.02 * size);
  REQUIRE(error4 <= 0.15 * size);
  REQUIRE(q8.lengths() == std::vector<Index>{40});
}
