// ComputePrecision::int8 in the flash kernel (Isa::avx512_vnni and avx512_bf16,
// kernels/int8_tiles.hpp): q k^T on int8 dot products over keys stored as float, half,
// bfloat16 or q8_0/q4_0 blocks, smoothed by the head's mean key. On those levels: against the long
// double reference over the values the kernel multiplies (the mean key, each key row minus it and
// each query row quantized by the rule of docs/precision.md, re-implemented here on its own),
// within twice the error of a plain float implementation over the same values, for every mask
// kind, tiles around the edges, odd D, Dv != D and grouped-query heads; the log-sum-exp
// likewise; the same bits for any thread count and in pages; NaN propagates to the rows that
// see it and no further. On every other level the same calls give the bits of
// ComputePrecision::fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <attn/attention.hpp>
#include <attn/cpu.hpp>
#include <attn/kv_cache.hpp>
#include <attn/quantized.hpp>

#include "support/heads.hpp"
#include "support/masked_problem.hpp"
#include "support/out_and_lse.hpp"
#include "support/paged_prefill.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using attn::Index;
using attn_test::Heads;
using attn_test::max_error;
using attn_test::random_heads;
using attn_test::reference::Problem;

bool int8_level() {
  return attn::has_int8_products(attn::active_isa());
}

/// A row of `dim` floats quantized as docs/precision.md states the rule (d = amax / 127,
/// q = round(x * (127 / amax)) to nearest even, zeros below 2^-100, NaN for a row holding a
/// non-finite value): d q in long double, times `factor`.
void quantize_row(const float* x, Index dim, long double factor, long double* out) {
  float amax = 0;
  bool finite = true;
  for (Index d = 0; d < dim; ++d) {
    finite = finite && std::isfinite(x[d]);
    amax = std::max(amax, std::abs(x[d]));
  }
  if (!finite) {
    std::fill_n(out, dim, std::numeric_limits<long double>::quiet_NaN());
    return;
  }
  if (amax < std::ldexp(1.0f, -100)) {
    std::fill_n(out, dim, 0.0L);
    return;
  }
  const float inverse = 127.0f / amax, step = amax / 127.0f;
  for (Index d = 0; d < dim; ++d)
    out[d] = factor * static_cast<long double>(step) * std::nearbyint(x[d] * inverse);
}

/// What the kernel multiplies, as one dot product of 2 D values per score:
///   q' = [scale d_q q_quantized, scale q]   (B, Hq, Lq, 2 D)
///   k' = [d_k (k - mean)_quantized, mean]   (B, Hkv, Lk, 2 D)
/// so that q' . k' = scale (d_q d_k I + q . mean), the kernel's score.
struct Multiplied {
  std::vector<long double> q, k;
};

template <class S>
Multiplied multiplied(const Heads<S>& q, const Heads<S>& k, float scale) {
  const Index dim = q.d;
  Multiplied m{std::vector<long double>(q.data.size() * 2),
               std::vector<long double>(k.data.size() * 2)};
  std::vector<float> row(static_cast<std::size_t>(dim));
  const auto value = [](S x) { return static_cast<float>(x); };
  for (Index r = 0; r < q.b * q.h * q.l; ++r) {
    for (Index d = 0; d < dim; ++d)
      row[static_cast<std::size_t>(d)] = value(q.data[static_cast<std::size_t>(r * dim + d)]);
    long double* to = m.q.data() + 2 * r * dim;
    quantize_row(row.data(), dim, scale, to);
    for (Index d = 0; d < dim; ++d)
      to[dim + d] = static_cast<long double>(scale) * row[static_cast<std::size_t>(d)];
  }
  for (Index head = 0; head < k.b * k.h; ++head) {
    // The mean: each column summed in float in row order (finite values only), divided.
    std::vector<float> mean(static_cast<std::size_t>(dim), 0.0f);
    for (Index j = 0; j < k.l; ++j) {
      for (Index d = 0; d < dim; ++d) {
        const float x = value(k.data[static_cast<std::size_t>((head * k.l + j) * dim + d)]);
        if (std::isfinite(x))
          mean[static_cast<std::size_t>(d)] += x;
      }
    }
    for (float& x : mean)
      x = k.l > 0 ? x / static_cast<float>(k.l) : 0.0f;
    for (Index j = 0; j < k.l; ++j) {
      const Index r = head * k.l + j;
      for (Index d = 0; d < dim; ++d) {
        row[static_cast<std::size_t>(d)] = value(k.data[static_cast<std::size_t>(r * dim + d)]) -
                                           mean[static_cast<std::size_t>(d)];
      }
      long double* to = m.k.data() + 2 * r * dim;
      quantize_row(row.data(), dim, 1.0L, to);
      std::copy(mean.begin(), mean.end(), to + dim);
    }
  }
  return m;
}

/// The long double reference of problem p over what the kernel multiplies (q', k' of
/// `multiplied`, p's dim doubled and the scale inside q'; v as given), and a plain float
/// implementation of the same, whose error the kernel's is held to.
struct Reference {
  attn_test::reference::Result<long double> exact;
  attn_test::reference::Result<float> plain;
};

template <class S, class SV>
Reference multiplied_reference(Problem p, const Heads<S>& q, const Heads<S>& k, const Heads<SV>& v,
                               float scale) {
  const Multiplied m = multiplied(q, k, scale);
  p.dim *= 2;
  p.scale = 1.0L;
  const std::vector<long double> vr = attn_test::exact(v);
  return {attn_test::reference::attention<long double>(p, m.q, m.k, vr),
          attn_test::reference::attention<float>(p, m.q, m.k, vr)};
}

using Outputs = attn_test::OutAndLse;
using attn_test::out_and_lse;

/// The sweep of one storage type S of q, k, v.
template <class S>
void check_against_reference(const char* name) {
  std::mt19937 rng(3451);
  struct Sizes {
    Index q_length, k_length, dim, value_dim, query_tile, key_tile;
  };
  // one query (fewer rows per kv head than int8_flash_min_rows: fp32 products); odd D (words
  // of four bytes padded) with odd tiles; D under a vector; key counts around the register
  // block of 8 keys; the default tiles at D = 128. Two query heads per kv head.
  const Sizes sizes[] = {{1, 7, 64, 64, 0, 0},
                         {64, 300, 64, 24, 0, 0},
                         {67, 300, 33, 40, 5, 7},
                         {64, 45, 6, 16, 16, 13},
                         {130, 513, 128, 64, 0, 0}};
  for (const Sizes& z : sizes) {
    // keys with a shared offset per column, which the mean takes out before quantizing
    Heads<float> k_float = random_heads<float>(3, 2, z.k_length, z.dim, rng, 1.5);
    for (std::size_t n = 0; n < k_float.data.size(); ++n)
      k_float.data[n] += 0.5f * static_cast<float>(n % static_cast<std::size_t>(z.dim) % 5);
    const Heads<S> q = random_heads<S>(3, 4, z.q_length, z.dim, rng, 1.5);
    const Heads<S> k = k_float.cast<S>();
    const Heads<S> v = random_heads<S>(3, 2, z.k_length, z.value_dim, rng);
    for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
      if (z.q_length > 100 && kind != 0 && kind != 1 && kind != 10 && kind != 16)
        continue;
      Problem p =
          attn_test::masked_problem(3, 4, 2, z.q_length, z.k_length, z.dim, z.value_dim, kind, rng);
      attn_test::round_numbers_to<float>(p);
      attn_test::AttnOptions<float> o(p);
      o.options.algorithm = attn::Algorithm::flash;
      o.options.query_tile = z.query_tile;
      o.options.key_tile = z.key_tile;
      o.options.compute = attn::ComputePrecision::int8;
      INFO(name << ", " << attn_test::describe(p, kind) << ", D " << z.dim << ", tiles "
                << z.query_tile << " x " << z.key_tile << ", "
                << attn::isa_name(attn::active_isa()));
      const Outputs got = out_and_lse(q, k, v, o.options);
      if (!int8_level() || 2 * z.q_length < attn::int8_flash_min_rows) {  // fp32, bit for bit
        attn::AttentionOptions<float> fp32 = o.options;
        fp32.compute = attn::ComputePrecision::fp32;
        const Outputs expected = out_and_lse(q, k, v, fp32);
        CHECK(got.out.data == expected.out.data);
        CHECK(got.lse.data == expected.lse.data);
        continue;
      }
      const Reference r = multiplied_reference(p, q, k, v, static_cast<float>(*p.scale));
      const double plain_error = max_error(r.plain.out, r.exact.out);
      const double error = max_error(got.out.data, r.exact.out);
      INFO("error " << error << ", plain float error " << plain_error);
      CHECK(error <= attn_test::error_bound<float>(plain_error));
      const double lse_error = max_error(got.lse.data, r.exact.lse);
      const double plain_lse_error = max_error(r.plain.lse, r.exact.lse);
      INFO("lse error " << lse_error << ", plain float " << plain_lse_error);
      CHECK(lse_error <= attn_test::error_bound<float>(plain_lse_error));
    }
  }
}

/// x as a cache in Block stores it and reads it back: each row quantized and dequantized.
template <class Block>
Heads<float> read_back(const Heads<float>& x) {
  Heads<float> out = x;
  const auto dim = static_cast<std::ptrdiff_t>(x.d);
  for (auto row = x.data.begin(); row != x.data.end(); row += dim) {
    const std::vector<float> back =
        attn::dequantize_blocks(attn::quantize_blocks<Block>(std::vector<float>(row, row + dim)));
    std::copy(back.begin(), back.end(), out.data.begin() + (row - x.data.begin()));
  }
  return out;
}

/// A chunk of prefill from a KVCache<BK, BV> on int8 products: the kernel dequantizes the
/// keys, then quantizes them as float keys, so the reference is check_against_reference's
/// over the values the blocks read back.
template <class BK, class BV>
void check_blocks(const char* name) {
  std::mt19937 rng(3455);
  const Index kv_heads = 2, q_heads = 4, q_length = 70, k_length = 300, dim = 64, value_dim = 32;
  Heads<float> k = random_heads<float>(1, kv_heads, k_length, dim, rng, 1.5);
  for (std::size_t n = 0; n < k.data.size(); ++n)
    k.data[n] += 0.5f * static_cast<float>(n % static_cast<std::size_t>(dim) % 5);
  const Heads<float> v = random_heads<float>(1, kv_heads, k_length, value_dim, rng);
  const Heads<float> q = random_heads<float>(1, q_heads, q_length, dim, rng, 1.5);
  attn::KVCache<BK, BV> cache(1, kv_heads, dim, value_dim, 0);
  cache.append(k.cview(), v.cview());
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.compute = attn::ComputePrecision::int8;
  Heads<float> got(1, q_heads, q_length, value_dim), fp32(1, q_heads, q_length, value_dim);
  cache.attend_all_into(q.cview(), got.view(), options);
  options.compute = attn::ComputePrecision::fp32;
  cache.attend_all_into(q.cview(), fp32.view(), options);
  INFO(name << ", " << attn::isa_name(attn::active_isa()));
  if (!int8_level()) {
    CHECK(got.data == fp32.data);
    return;
  }
  const float scale = 0.125f;  // 1 / sqrt(64), the default
  const Reference r = multiplied_reference(
      attn_test::sized_problem(1, q_heads, kv_heads, q_length, k_length, dim, value_dim), q,
      read_back<BK>(k), read_back<BV>(v), scale);
  const double plain_error = max_error(r.plain.out, r.exact.out);
  const double error = max_error(got.data, r.exact.out);
  INFO("error " << error << ", plain float error " << plain_error);
  CHECK(error <= attn_test::error_bound<float>(plain_error));
  CHECK(got.data != fp32.data);
}

}  // namespace

TEST_CASE("int8 flash: keys and values in q8_0 and q4_0 blocks, dequantized as they are read",
          "[isa][int8]") {
  check_blocks<attn::BlockQ8_0, attn::BlockQ8_0>("K q8_0, V q8_0");
  check_blocks<attn::BlockQ4_0, attn::BlockQ8_0>("K q4_0, V q8_0");
  check_blocks<attn::BlockQ8_0, attn::BlockQ4_0>("K q8_0, V q4_0");
  std::mt19937 rng(3456);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.compute = attn::ComputePrecision::int8;
  const attn_test::PagedPrefill r = attn_test::paged_prefill<attn::BlockQ4_0>(128, options, rng);
  CHECK(r.paged == r.contiguous);
  CHECK((r.contiguous != r.fp32) == int8_level());
}

TEST_CASE("int8 flash: float inputs within twice a plain float implementation's error",
          "[isa][int8][sweep]") {
  check_against_reference<float>("float");
}

TEST_CASE("int8 flash: half and bfloat16 inputs, widened as they are read", "[isa][int8][sweep]") {
  check_against_reference<Eigen::half>("half");
  check_against_reference<Eigen::bfloat16>("bfloat16");
}

TEST_CASE("int8 flash: what the plan says, and fp32 wherever it does not apply", "[isa][int8]") {
  const attn::AttentionShape floats{1, 8, 8, 512, 512, 64, 64, 4};
  attn::AttentionOptions<float> flash;
  flash.algorithm = attn::Algorithm::flash;
  CHECK_FALSE(attn::plan_attention<float>(floats, flash).int8_products);  // fp32 by default
  attn::AttentionOptions<float> opt_in = flash;
  opt_in.compute = attn::ComputePrecision::int8;
  const attn::KernelPlan asked = attn::plan_attention<float>(floats, opt_in);
  CHECK(asked.int8_products == int8_level());
  CHECK((asked.describe().find("int8 products") != std::string::npos) == int8_level());
  attn::AttentionShape half = floats;
  half.kv_element_bytes = 2;
  CHECK(attn::plan_attention<float>(half, opt_in).int8_products == int8_level());
  attn::AttentionOptions<float> automatic = opt_in;  // Lq 512: flash
  automatic.algorithm = attn::Algorithm::automatic;
  CHECK(attn::plan_attention<float>(floats, automatic).algorithm == attn::Algorithm::flash);
  CHECK(attn::plan_attention<float>(floats, automatic).int8_products == int8_level());
  // keys in blocks too (dequantized as they are read)
  attn::AttentionShape blocks = floats;
  blocks.kv_element_bytes = 1;
  blocks.kv_quantized = true;
  blocks.k_int8_readable = true;
  CHECK(attn::plan_attention<float>(blocks, opt_in).int8_products == int8_level());
  // from int8_flash_min_rows query rows per kv head (G Lq) on: 64 queries of one head per kv
  // head are too few, of two enough
  attn::AttentionShape chunk = floats;
  chunk.q_length = attn::int8_flash_min_rows / 2;
  CHECK_FALSE(attn::plan_attention<float>(chunk, opt_in).int8_products);
  chunk.kv_heads = 4;
  CHECK(attn::plan_attention<float>(chunk, opt_in).int8_products == int8_level());
  // never: decode over keys not in blocks, the other kernels, double
  for (const attn::Algorithm other :
       {attn::Algorithm::decode, attn::Algorithm::naive, attn::Algorithm::chunked}) {
    attn::AttentionOptions<float> options = opt_in;
    options.algorithm = other;
    CHECK_FALSE(attn::plan_attention<float>(floats, options).int8_products);
  }
  attn::AttentionOptions<double> in_double;
  in_double.algorithm = attn::Algorithm::flash;
  in_double.compute = attn::ComputePrecision::int8;
  CHECK_FALSE(attn::plan_attention<double>(floats, in_double).int8_products);
}

TEST_CASE("int8 flash: the same bits for any thread count, and NaN reaches only what sees it",
          "[isa][int8]") {
  std::mt19937 rng(3452);
  const Index dim = 64, q_length = 200, k_length = 333;
  const Heads<float> q = random_heads<float>(2, 4, q_length, dim, rng);
  Heads<float> k = random_heads<float>(2, 2, k_length, dim, rng);
  Heads<float> v = random_heads<float>(2, 2, k_length, dim, rng);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.causal = attn::Causal::top_left;
  options.query_tile = 32;
  options.compute = attn::ComputePrecision::int8;
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Outputs one = out_and_lse(q, k, v, options);
  omp_set_num_threads(3);
  const Outputs three = out_and_lse(q, k, v, options);
  omp_set_num_threads(threads);
  CHECK(one.out.data == three.out.data);
  CHECK(one.lse.data == three.lse.data);
#endif
  // A NaN in key 150 of b 0, kv head 1: its score is NaN for every query that sees it (rows
  // 150 and later under the top-left causal mask, query heads 2 and 3). The head's mean
  // counts it as 0, so against keys with a 0 there every other score is as it was.
  const auto at = static_cast<std::size_t>(((0 * 2 + 1) * k_length + 150) * dim + 7);
  k.data[at] = 0.0f;
  const Outputs clean = out_and_lse(q, k, v, options);
  k.data[at] = std::nanf("");
  // A NaN query: b 1, head 0, row 20.
  Heads<float> q_nan = q;
  q_nan.data[static_cast<std::size_t>(((1 * 4 + 0) * q_length + 20) * dim + 3)] = std::nanf("");
  const Outputs nan = out_and_lse(q_nan, k, v, options);
  const auto out_at = [&](const Outputs& o, Index b, Index h, Index i, Index e) {
    return o.out.data[static_cast<std::size_t>(((b * 4 + h) * q_length + i) * dim + e)];
  };
  for (Index h = 2; h < 4; ++h) {
    for (Index i = 0; i < q_length; ++i) {
      INFO("b 0, head " << h << ", row " << i);
      if (i >= 150) {
        CHECK(std::isnan(out_at(nan, 0, h, i, 0)));
      } else {
        CHECK(out_at(nan, 0, h, i, 0) == out_at(clean, 0, h, i, 0));
      }
    }
  }
  for (Index i = 0; i < q_length; ++i) {
    INFO("b 1, head 0, row " << i);
    if (i == 20) {
      CHECK(std::isnan(out_at(nan, 1, 0, i, 5)));
    } else {
      CHECK(out_at(nan, 1, 0, i, 5) == out_at(clean, 1, 0, i, 5));
    }
  }
  for (Index i = 0; i < q_length; ++i)  // b 0, query head 0: kv head 0, untouched
    CHECK(out_at(nan, 0, 0, i, 1) == out_at(clean, 0, 0, i, 1));
}

TEST_CASE("int8 flash: a paged cache gives the contiguous cache's bits", "[isa][int8]") {
  std::mt19937 rng(3453);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;  // a chunk of prefill
  options.compute = attn::ComputePrecision::int8;
  const attn_test::PagedPrefill r = attn_test::paged_prefill<float>(128, options, rng);
  CHECK(r.paged == r.contiguous);
  // and the opt-in changes the result exactly where the level has the products
  CHECK((r.contiguous != r.fp32) == int8_level());
}

TEST_CASE("int8 flash: SageAttention's metrics against the unrounded reference", "[isa][int8]") {
  // docs/precision.md "int8 products": q, v of N(0, 1) and k of N(0, 1) plus a per-column
  // offset of N(0, 1) shared by every key (the bias SageAttention's smoothing removes),
  // 256 queries, 1024 keys, against long double attention over the float values.
  std::mt19937 rng(3454);
  for (const Index dim : {Index(64), Index(128)}) {
    const Index q_length = 256, k_length = 1024;
    const Heads<float> q = random_heads<float>(1, 2, q_length, dim, rng);
    Heads<float> k = random_heads<float>(1, 2, k_length, dim, rng);
    const Heads<float> offsets = random_heads<float>(1, 1, 1, dim, rng);
    for (std::size_t n = 0; n < k.data.size(); ++n)
      k.data[n] += offsets.data[n % static_cast<std::size_t>(dim)];
    const Heads<float> v = random_heads<float>(1, 2, k_length, dim, rng);
    const Problem p = attn_test::sized_problem(1, 2, 2, q_length, k_length, dim, dim);
    const auto reference = attn_test::reference::attention<long double>(
        p, attn_test::exact(q), attn_test::exact(k), attn_test::exact(v));
    attn::AttentionOptions<float> options;
    options.algorithm = attn::Algorithm::flash;
    options.compute = attn::ComputePrecision::int8;
    const std::vector<float> int8 = out_and_lse(q, k, v, options).out.data;
    options.compute = attn::ComputePrecision::fp32;
    const std::vector<float> fp32 = out_and_lse(q, k, v, options).out.data;
    long double dot = 0, norm = 0, reference_norm = 0, l1 = 0, reference_l1 = 0, largest = 0,
                fp32_l1 = 0;
    for (std::size_t n = 0; n < reference.out.size(); ++n) {
      const long double x = int8[n], r = reference.out[n];
      dot += x * r;
      norm += x * x;
      reference_norm += r * r;
      l1 += std::abs(x - r);
      reference_l1 += std::abs(r);
      largest = std::max(largest, std::abs(x - r));
      fp32_l1 += std::abs(fp32[n] - r);
    }
    const auto cosine = static_cast<double>(dot / std::sqrt(norm * reference_norm));
    const auto relative_l1 = static_cast<double>(l1 / reference_l1);
    const auto fp32_relative_l1 = static_cast<double>(fp32_l1 / reference_l1);
    INFO("D " << dim << ", " << attn::isa_name(attn::active_isa()) << ": int8 cosine " << cosine
              << ", relative L1 " << relative_l1 << ", largest error "
              << static_cast<double>(largest) << "; fp32 relative L1 " << fp32_relative_l1);
    CHECK(fp32_relative_l1 < 2e-6);
    if (!int8_level()) {
      CHECK(relative_l1 == fp32_relative_l1);  // the fp32 path
      continue;
    }
    CHECK(cosine > 0.9999);
    CHECK(relative_l1 < 0.02);
    CHECK(largest < 0.02);
    CHECK(relative_l1 > 100 * fp32_relative_l1);  // the int8 path did run
  }
}
