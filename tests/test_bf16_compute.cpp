// ComputePrecision and the flash kernel on bf16 dot products (Isa::avx512_bf16,
// kernels/bf16_tiles.hpp). With ComputePrecision::bf16 on that level: against the long double
// reference over the inputs rounded to bfloat16, within twice the error of a plain implementation
// that rounds the same (products of the rounded inputs summed in float, probabilities rounded to
// bfloat16, P V summed in float: FlashAttention's rule, support/masked_problem.hpp), for every mask
// kind, tiles around the edges, odd D, Dv != D, grouped-query heads; the log-sum-exp within twice a
// float implementation's error (it never sees the rounded P); the same bits for any thread
// count; NaN propagates. On every other level the same calls run the fp32 path: the bits of
// ComputePrecision::fp32 (the default). Calls without the opt-in give avx512's bits on both
// levels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <attn/attention.hpp>
#include <attn/cpu.hpp>

#include "support/bf16.hpp"
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

using attn_test::bf16_level;
using attn_test::round_to_bf16;

using Outputs = attn_test::OutAndLse;
using attn_test::out_and_lse;

/// The sweep of one storage type S (bfloat16, or float with ComputePrecision::bf16).
template <class S>
void check_against_rounded_reference(attn::ComputePrecision compute, const char* name) {
  std::mt19937 rng(1601);
  struct Sizes {
    Index q_length, k_length, dim, value_dim, query_tile, key_tile;
  };
  // tiles around the edges: one query, odd key tiles (a pair padded with zeros), odd D
  // (the k rows copied and padded), Dv not a multiple of the value block, the defaults
  // (the largest, with the default tiles of D = 128, under four mask kinds: the reference's
  // time grows with it)
  const Sizes sizes[] = {{1, 7, 64, 64, 0, 0},
                         {37, 300, 64, 24, 0, 0},
                         {37, 300, 33, 40, 5, 7},
                         {20, 45, 16, 16, 16, 16},
                         {130, 513, 128, 64, 0, 0}};
  for (const Sizes& z : sizes) {
    const Heads<S> q = random_heads<S>(3, 4, z.q_length, z.dim, rng, 1.5);
    const Heads<S> k = random_heads<S>(3, 2, z.k_length, z.dim, rng, 1.5);
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
      o.options.compute = compute;
      INFO(name << ", " << attn_test::describe(p, kind) << ", tiles " << z.query_tile << " x "
                << z.key_tile << ", " << attn::isa_name(attn::active_isa()));
      const Outputs got = out_and_lse(q, k, v, o.options);
      if (!bf16_level()) {  // the fp32 path, bit for bit
        attn::AttentionOptions<float> fp32 = o.options;
        fp32.compute = attn::ComputePrecision::fp32;
        const Outputs expected = out_and_lse(q, k, v, fp32);
        CHECK(got.out.data == expected.out.data);
        CHECK(got.lse.data == expected.lse.data);
        continue;
      }
      const std::vector<long double> qr = attn_test::rounded_to_bf16(q),
                                     kr = attn_test::rounded_to_bf16(k),
                                     vr = attn_test::rounded_to_bf16(v);
      const auto exact = attn_test::reference::attention<long double>(p, qr, kr, vr);
      const auto to_bf16 = [](float x) { return round_to_bf16(x); };
      const auto plain =
          attn_test::reference::attention<float>(p, qr, kr, vr, {nullptr, to_bf16, nullptr});
      const double plain_error = max_error(plain.out, exact.out);
      const double error = max_error(got.out.data, exact.out);
      INFO("error " << error << ", plain bf16 error " << plain_error);
      CHECK(error <= attn_test::error_bound<float>(plain_error));
      // The log-sum-exp never sees the rounded P: a float implementation's error.
      const auto plain_float = attn_test::reference::attention<float>(p, qr, kr, vr);
      const double lse_error = max_error(got.lse.data, exact.lse);
      const double plain_lse_error = max_error(plain_float.lse, exact.lse);
      INFO("lse error " << lse_error << ", plain float " << plain_lse_error);
      CHECK(lse_error <= attn_test::error_bound<float>(plain_lse_error));
    }
  }
}

}  // namespace

TEST_CASE("bf16 products: bfloat16 inputs within twice a plain bf16 implementation's error",
          "[isa][bf16]") {
  check_against_rounded_reference<Eigen::bfloat16>(attn::ComputePrecision::bf16, "bfloat16");
}

TEST_CASE("bf16 products: float inputs with ComputePrecision::bf16, rounded as they are read",
          "[isa][bf16]") {
  check_against_rounded_reference<float>(attn::ComputePrecision::bf16, "float, bf16");
}

TEST_CASE("bf16 products: what the plan says, and fp32 wherever they do not apply", "[isa][bf16]") {
  const attn::AttentionShape shape{1, 8, 8, 512, 512, 64, 64, 2};
  attn::AttentionShape bf16 = shape;
  bf16.bf16_readable_kv = true;
  attn::AttentionOptions<float> flash;
  flash.algorithm = attn::Algorithm::flash;
  // fp32 by default, bfloat16 inputs included
  CHECK(flash.compute == attn::ComputePrecision::fp32);
  CHECK_FALSE(attn::plan_attention<float>(bf16, flash).bf16_products);
  attn::AttentionOptions<float> opt_in = flash;
  opt_in.compute = attn::ComputePrecision::bf16;
  const attn::KernelPlan asked = attn::plan_attention<float>(bf16, opt_in);
  CHECK(asked.bf16_products == bf16_level());
  CHECK((asked.describe().find("bf16 products") != std::string::npos) == bf16_level());
  attn::AttentionShape floats = bf16;
  floats.kv_element_bytes = 4;
  CHECK(attn::plan_attention<float>(floats, opt_in).bf16_products == bf16_level());
  // never: half storage, quantized blocks, another kernel, double
  attn::AttentionShape half = shape;
  CHECK_FALSE(attn::plan_attention<float>(half, opt_in).bf16_products);
  attn::AttentionShape blocks = bf16;
  blocks.kv_quantized = true;
  CHECK_FALSE(attn::plan_attention<float>(blocks, opt_in).bf16_products);
  attn::AttentionOptions<float> decode = opt_in;
  decode.algorithm = attn::Algorithm::decode;
  CHECK_FALSE(attn::plan_attention<float>(bf16, decode).bf16_products);
  attn::AttentionOptions<double> in_double;
  in_double.algorithm = attn::Algorithm::flash;
  in_double.compute = attn::ComputePrecision::bf16;
  CHECK_FALSE(attn::plan_attention<double>(bf16, in_double).bf16_products);
}

TEST_CASE("bf16 products: the same bits for any thread count, and NaN propagates", "[isa][bf16]") {
  std::mt19937 rng(1602);
  const Heads<Eigen::bfloat16> q = random_heads<Eigen::bfloat16>(2, 4, 200, 64, rng);
  Heads<Eigen::bfloat16> k = random_heads<Eigen::bfloat16>(2, 4, 333, 64, rng);
  Heads<Eigen::bfloat16> v = random_heads<Eigen::bfloat16>(2, 4, 333, 64, rng);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.causal = attn::Causal::bottom_right;
  options.query_tile = 32;
  options.compute = attn::ComputePrecision::bf16;
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
  // A NaN value reaches every output row that sees its key; a NaN key every score of it.
  v.data[static_cast<std::size_t>(10 * 64 + 3)] =
      Eigen::bfloat16(std::nanf(""));  // b 0, h 0, key 10
  k.data[static_cast<std::size_t>(((1 * 4 + 2) * 333 + 5) * 64)] = Eigen::bfloat16(std::nanf(""));
  const Outputs nan = out_and_lse(q, k, v, options);
  // b 0, query head 0 (kv head 0): every query sees key 10 (bottom-right, Lk > Lq)
  for (Index i = 0; i < 200; ++i)
    CHECK(std::isnan(nan.out.data[static_cast<std::size_t>(i * 64 + 3)]));
  // b 1, query head 2 (kv head 2): every output of every query is NaN
  for (Index i = 0; i < 200; ++i) {
    const Index row = (Index(1 * 4 + 2) * 200 + i);
    CHECK(std::isnan(nan.out.data[static_cast<std::size_t>(row * 64)]));
    CHECK(std::isnan(nan.lse.data[static_cast<std::size_t>(row)]));
  }
  // and nothing else: b 1, head 1 is untouched
  const Outputs clean = out_and_lse(q, k, v, options);
  for (Index i = 0; i < Index(200) * 64; ++i) {
    const auto at = static_cast<std::size_t>(Index(1 * 4 + 1) * 200 * 64 + i);
    CHECK(nan.out.data[at] == clean.out.data[at]);
  }
}

/// SageAttention's accuracy metrics of out against the reference r: cosine similarity,
/// relative L1 (sum |out - r| / sum |r|) and the largest absolute error.
struct Accuracy {
  double cosine, relative_l1, max_abs;
};

Accuracy accuracy(const std::vector<float>& out, const std::vector<long double>& r) {
  long double dot = 0, out2 = 0, r2 = 0, diff1 = 0, r1 = 0, worst = 0;
  for (std::size_t i = 0; i < r.size(); ++i) {
    const long double o = out[i], d = std::abs(o - r[i]);
    dot += o * r[i];
    out2 += o * o;
    r2 += r[i] * r[i];
    diff1 += d;
    r1 += std::abs(r[i]);
    worst = std::max(worst, d);
  }
  return {static_cast<double>(dot / std::sqrt(out2 * r2)), static_cast<double>(diff1 / r1),
          static_cast<double>(worst)};
}

TEST_CASE("bf16 products: accuracy against the unrounded reference on typical inputs",
          "[isa][bf16]") {
  // Float q, k, v of N(0, 1) (scores of standard deviation 1 after the scale), compared with
  // long double attention over the float values themselves: the rounding of q, k, v and P to
  // bfloat16 is now part of the error (docs/precision.md quotes these metrics).
  std::mt19937 rng(1604);
  for (const Index dim : {64, 128}) {
    const Index q_length = 256, k_length = 1024;
    const Heads<float> q = random_heads<float>(1, 2, q_length, dim, rng);
    const Heads<float> k = random_heads<float>(1, 2, k_length, dim, rng);
    const Heads<float> v = random_heads<float>(1, 2, k_length, dim, rng);
    const attn_test::reference::Problem p =
        attn_test::sized_problem(1, 2, 2, q_length, k_length, dim, dim);
    const auto exact = [](const Heads<float>& x) {
      return std::vector<long double>(x.data.begin(), x.data.end());
    };
    const auto reference =
        attn_test::reference::attention<long double>(p, exact(q), exact(k), exact(v));
    attn::AttentionOptions<float> options;
    options.algorithm = attn::Algorithm::flash;
    options.compute = attn::ComputePrecision::bf16;
    const Accuracy bf16 = accuracy(out_and_lse(q, k, v, options).out.data, reference.out);
    options.compute = attn::ComputePrecision::fp32;
    const Accuracy fp32 = accuracy(out_and_lse(q, k, v, options).out.data, reference.out);
    INFO("D " << dim << ", " << attn::isa_name(attn::active_isa()) << ": bf16 cosine "
              << bf16.cosine << ", relative L1 " << bf16.relative_l1 << ", max " << bf16.max_abs
              << "; fp32 cosine " << fp32.cosine << ", relative L1 " << fp32.relative_l1 << ", max "
              << fp32.max_abs);
    // Measured on a Xeon: bf16 cosine 0.999994, relative L1 0.0033, max 0.0012 (one rounding
    // to bfloat16 is 2^-9 relative: about its mean size); fp32 relative L1 6e-7.
    CHECK(fp32.relative_l1 < 2e-6);
    if (bf16_level()) {
      CHECK(bf16.cosine > 0.9999);
      CHECK(bf16.relative_l1 < 0.0078125);  // 2^-7
      CHECK(bf16.max_abs < 0.004);
      CHECK(bf16.relative_l1 > 100 * fp32.relative_l1);  // the bf16 path did run
    } else {
      CHECK(bf16.relative_l1 == fp32.relative_l1);  // the fp32 path
    }
  }
}

TEST_CASE(
    "bf16 products: float calls give the avx512 bits on the bf16 level; elsewhere the "
    "opt-in changes nothing",
    "[isa][bf16]") {
  std::mt19937 rng(1603);
  const Heads<float> q = random_heads<float>(1, 4, 100, 64, rng);
  const Heads<float> k = random_heads<float>(1, 2, 300, 64, rng);
  const Heads<float> v = random_heads<float>(1, 2, 300, 64, rng);
  const Heads<Eigen::bfloat16> qb = q.cast<Eigen::bfloat16>(), kb = k.cast<Eigen::bfloat16>(),
                               vb = v.cast<Eigen::bfloat16>();
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::top_left;
  for (const attn::Algorithm algorithm :
       {attn::Algorithm::flash, attn::Algorithm::naive, attn::Algorithm::decode}) {
    options.algorithm = algorithm;
    INFO(attn::algorithm_name(algorithm) << ", " << attn::isa_name(attn::active_isa()));
    if (bf16_level()) {  // the two levels that run the avx512 kernels agree
      const auto both = [&](auto&& call) {
        const Outputs a = call();
        attn::ScopedIsa without(attn::Isa::avx512);
        const Outputs b = call();
        CHECK(a.out.data == b.out.data);
        CHECK(a.lse.data == b.lse.data);
      };
      both([&] { return out_and_lse(q, k, v, options); });     // float
      both([&] { return out_and_lse(qb, kb, vb, options); });  // bfloat16
    } else {  // no bf16 products here: asking for them changes no bit
      attn::AttentionOptions<float> opt_in = options;
      opt_in.compute = attn::ComputePrecision::bf16;
      const Outputs a = out_and_lse(q, k, v, options), b = out_and_lse(q, k, v, opt_in);
      CHECK(a.out.data == b.out.data);
      const Outputs c = out_and_lse(qb, kb, vb, options), d = out_and_lse(qb, kb, vb, opt_in);
      CHECK(c.out.data == d.out.data);
    }
  }
}

TEST_CASE("bf16 products: a paged bfloat16 cache gives the contiguous cache's bits",
          "[isa][bf16]") {
  std::mt19937 rng(1604);
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;  // a chunk of prefill
  options.compute = attn::ComputePrecision::bf16;
  const attn_test::PagedPrefill r = attn_test::paged_prefill<Eigen::bfloat16>(64, options, rng);
  CHECK(r.paged == r.contiguous);
  // and the opt-in changes the result exactly where the level has the products
  CHECK((r.contiguous != r.fp32) == bf16_level());
}
