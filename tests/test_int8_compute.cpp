// ComputePrecision::int8 and decode's scores on int8 dot products (Isa::avx512_vnni and
// avx512_bf16, kernels/int8_decode.hpp). On those levels, with keys stored as q8_0 or q4_0:
// against the long double reference over the values the kernel multiplies (the query rows of
// scale * q quantized per block of 32 by the rule of docs/precision.md, re-implemented here
// on its own; the keys and values the blocks read back), within twice the error of a plain
// float implementation over the same values, for every mask kind, one to eight query rows per
// head, grouped-query heads, key counts around the panel of 16 and D of one to four blocks;
// the log-sum-exp likewise; the same bits for any thread count and in pages; NaN propagates.
// On every other level, and for any other storage or kernel, the same calls give the bits of
// ComputePrecision::fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <attn/attention.hpp>
#include <attn/cpu.hpp>
#include <attn/kernels/dispatch.hpp>
#include <attn/kv_cache.hpp>
#include <attn/paged_kv_cache.hpp>
#include <attn/quantized.hpp>

#include "support/heads.hpp"
#include "support/masked_problem.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using attn::BlockQ4_0;
using attn::BlockQ8_0;
using attn::Index;
using attn_test::Heads;
using attn_test::max_error;
using attn_test::reference::Problem;

bool int8_level() {
  return attn::has_int8_products(attn::active_isa());
}

/// One block of 32 floats quantized as docs/precision.md states the rule (d = amax / 127,
/// q = round(x * (127 / amax)) to nearest even, zeros below 2^-100, NaN for a non-finite
/// block), read back in long double.
void quantize_query_block(const float* x, long double* out) {
  float amax = 0;
  bool finite = true;
  for (int i = 0; i < 32; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::abs(x[i]));
  }
  if (!finite) {
    std::fill_n(out, 32, std::numeric_limits<long double>::quiet_NaN());
    return;
  }
  if (amax < std::ldexp(1.0f, -100)) {
    std::fill_n(out, 32, 0.0L);
    return;
  }
  const float inverse = 127.0f / amax, d = amax / 127.0f;
  for (int i = 0; i < 32; ++i)
    out[i] = static_cast<long double>(d) * std::nearbyint(x[i] * inverse);
}

/// The queries the kernel multiplies: scale * q in float, quantized per block of 32.
std::vector<long double> quantized_queries(const Heads<float>& q, float scale) {
  std::vector<long double> out(q.data.size());
  std::vector<float> row(static_cast<std::size_t>(q.d));
  for (std::size_t at = 0; at < q.data.size(); at += static_cast<std::size_t>(q.d)) {
    for (Index d = 0; d < q.d; ++d)
      row[static_cast<std::size_t>(d)] = scale * q.data[at + static_cast<std::size_t>(d)];
    for (Index b = 0; b < q.d; b += 32)
      quantize_query_block(row.data() + b, out.data() + at + static_cast<std::size_t>(b));
  }
  return out;
}

template <class Block>
std::vector<Block> blocks_of(const Heads<float>& x) {
  std::vector<Block> blocks(x.data.size() / 32);
  attn::quantize_blocks(x.data.data(), static_cast<Index>(x.data.size()), blocks.data());
  return blocks;
}

/// The values blocks of x read back as, long double.
template <class Block>
std::vector<long double> read_back(const Heads<float>& x) {
  const std::vector<float> values = attn::dequantize_blocks(blocks_of<Block>(x));
  return {values.begin(), values.end()};
}

struct Outputs {
  std::vector<float> out, lse;
};

/// The decode kernel over K stored as SK and V as SV, the compute precision asked for (the
/// plan decides what the level gives), keys split every `split_keys` in blocks of
/// `key_block`.
template <class SK, class SV>
Outputs decode(const Problem& p, const Heads<float>& q, const Heads<float>& k,
               const Heads<float>& v, attn::ComputePrecision compute, Index split_keys = 512,
               Index key_block = 64) {
  attn_test::AttnOptions<float> o(p);
  o.options.algorithm = attn::Algorithm::decode;
  o.options.compute = compute;
  const attn::AttentionProblem<float> problem("int8", p.batch, p.q_heads, p.q_length, p.k_length,
                                              o.options);
  attn::AttentionShape shape{p.batch,    p.q_heads, p.kv_heads,  p.q_length,
                             p.k_length, p.dim,     p.value_dim, 1};
  shape.kv_quantized = true;
  shape.k_int8_readable = true;
  attn::KernelPlan plan = attn::plan_attention<float>(shape, o.options);
  REQUIRE(plan.int8_products == (compute == attn::ComputePrecision::int8 && int8_level()));
  plan.split_keys = split_keys;
  plan.key_block = key_block;
  const std::vector<SK> ks = blocks_of<SK>(k);
  const std::vector<SV> vs = blocks_of<SV>(v);
  Outputs r{
      std::vector<float>(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length * p.value_dim)),
      std::vector<float>(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length))};
  attn::detail::decode_attention<float, SK, SV>(
      plan, q.cview(), attn::bhld_view(ks.data(), p.batch, p.kv_heads, p.k_length, p.dim / 32),
      attn::bhld_view(vs.data(), p.batch, p.kv_heads, p.k_length, p.value_dim / 32),
      attn::bhld_view(r.out.data(), p.batch, p.q_heads, p.q_length, p.value_dim), problem,
      static_cast<float>(*p.scale), attn::detail::padded_rows(r.lse.data(), p.q_heads, p.q_length));
  return r;
}

template <class SK, class SV>
void check_formats(const char* formats) {
  INFO(formats << ", " << attn::isa_name(attn::active_isa()));
  std::mt19937 rng(3401);
  struct Sizes {
    Index q_length, k_length, dim, group, split_keys, key_block;
  };
  // keys around the panel of 16 (one key; 15, 16, 17 in a block; splits and blocks cut
  // inside a panel), one to eight query rows per head, D of one to four blocks
  const Sizes sizes[] = {{1, 1, 32, 1, 512, 64},    {1, 300, 128, 4, 512, 64},
                         {3, 47, 64, 1, 16, 15},    {1, 33, 96, 2, 17, 16},
                         {8, 700, 128, 4, 512, 64}, {2, 1100, 64, 1, 512, 64}};
  for (const Sizes& z : sizes) {
    for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
      if (z.k_length >= 700 && kind % 3 != 0)
        continue;
      Problem p = attn_test::masked_problem(2, 2 * z.group, 2, z.q_length, z.k_length, z.dim, 64,
                                            kind, rng);
      attn_test::round_numbers_to<float>(p);
      INFO(attn_test::describe(p, kind) << ", D " << z.dim << ", G " << z.group << ", splits of "
                                        << z.split_keys << " in blocks of " << z.key_block);
      const auto q = attn_test::random_heads<float>(2, p.q_heads, z.q_length, z.dim, rng, 1.5);
      const auto k = attn_test::random_heads<float>(2, 2, z.k_length, z.dim, rng, 1.5);
      const auto v = attn_test::random_heads<float>(2, 2, z.k_length, 64, rng);
      const Outputs got =
          decode<SK, SV>(p, q, k, v, attn::ComputePrecision::int8, z.split_keys, z.key_block);
      if (!int8_level()) {  // the fp32 path, bit for bit
        const Outputs fp32 =
            decode<SK, SV>(p, q, k, v, attn::ComputePrecision::fp32, z.split_keys, z.key_block);
        CHECK(got.out == fp32.out);
        CHECK(got.lse == fp32.lse);
        continue;
      }
      // The reference multiplies the quantized values with scale 1: the kernel's scores are
      // sums of d_q q d_k k with d_q q standing for scale * q.
      Problem unscaled = p;
      unscaled.scale = 1.0L;
      const std::vector<long double> qr = quantized_queries(q, static_cast<float>(*p.scale));
      const std::vector<long double> kr = read_back<SK>(k), vr = read_back<SV>(v);
      const auto exact = attn_test::reference::attention<long double>(unscaled, qr, kr, vr);
      const auto plain = attn_test::reference::attention<float>(unscaled, qr, kr, vr);
      const double plain_error = max_error(plain.out, exact.out);
      const double error = max_error(got.out, exact.out);
      INFO("error " << error << ", plain float error " << plain_error);
      CHECK(error <= attn_test::error_bound<float>(plain_error));
      const double lse_error = max_error(got.lse, exact.lse);
      const double plain_lse_error = max_error(plain.lse, exact.lse);
      INFO("lse error " << lse_error << ", plain float " << plain_lse_error);
      CHECK(lse_error <= attn_test::error_bound<float>(plain_lse_error));
    }
  }
}

}  // namespace

TEST_CASE("int8 products: q8_0 keys within twice a plain float implementation's error",
          "[isa][int8][sweep]") {
  check_formats<BlockQ8_0, BlockQ8_0>("K q8_0, V q8_0");
}

TEST_CASE("int8 products: q4_0 keys within twice a plain float implementation's error",
          "[isa][int8][sweep]") {
  check_formats<BlockQ4_0, BlockQ8_0>("K q4_0, V q8_0");
  check_formats<BlockQ4_0, BlockQ4_0>("K q4_0, V q4_0");
}

TEST_CASE("int8 products: what the plan says, and fp32 wherever they do not apply", "[isa][int8]") {
  attn::AttentionShape blocks{1, 8, 8, 1, 4096, 128, 128, 1};
  blocks.kv_quantized = true;
  blocks.k_int8_readable = true;
  attn::AttentionOptions<float> decode;
  decode.algorithm = attn::Algorithm::decode;
  CHECK(decode.compute == attn::ComputePrecision::fp32);  // fp32 by default
  CHECK_FALSE(attn::plan_attention<float>(blocks, decode).int8_products);
  attn::AttentionOptions<float> opt_in = decode;
  opt_in.compute = attn::ComputePrecision::int8;
  const attn::KernelPlan asked = attn::plan_attention<float>(blocks, opt_in);
  CHECK(asked.int8_products == int8_level());
  CHECK((asked.describe().find("int8 products") != std::string::npos) == int8_level());
  attn::AttentionOptions<float> automatic = opt_in;
  automatic.algorithm = attn::Algorithm::automatic;  // Lq = 1: decode
  CHECK(attn::plan_attention<float>(blocks, automatic).int8_products == int8_level());
  // Decode on int8 products takes up to 16 queries (quantized_decode_max_queries), on fp32
  // products 8; then flash, without them.
  const auto automatic_at = [&](Index q_length, const attn::AttentionOptions<float>& options) {
    attn::AttentionShape chunk = blocks;
    chunk.q_length = q_length;
    return attn::plan_attention<float>(chunk, options);
  };
  attn::AttentionOptions<float> fp32_automatic = automatic;
  fp32_automatic.compute = attn::ComputePrecision::fp32;
  const bool vector_level = attn::active_isa() != attn::Isa::generic;
  CHECK(automatic_at(8, fp32_automatic).algorithm == attn::Algorithm::decode);
  CHECK((automatic_at(16, fp32_automatic).algorithm == attn::Algorithm::decode) == !vector_level);
  CHECK((automatic_at(16, automatic).algorithm == attn::Algorithm::decode) ==
        (int8_level() || !vector_level));
  CHECK(automatic_at(16, automatic).int8_products == int8_level());
  CHECK((automatic_at(17, automatic).algorithm == attn::Algorithm::decode) == !vector_level);
  CHECK_FALSE(automatic_at(17, automatic).int8_products);
  // flash from int8_flash_min_rows query rows per kv head (tests/test_int8_flash.cpp)
  CHECK(automatic_at(attn::int8_flash_min_rows, automatic).algorithm == attn::Algorithm::flash);
  CHECK(automatic_at(attn::int8_flash_min_rows, automatic).int8_products == int8_level());
  attn::AttentionOptions<float> flash = opt_in;
  flash.algorithm = attn::Algorithm::flash;
  CHECK_FALSE(attn::plan_attention<float>(blocks, flash).int8_products);  // Lq = 1
  // never: decode over keys not in blocks (V in blocks only, half, float), double
  attn::AttentionShape values_only = blocks;
  values_only.k_int8_readable = false;
  CHECK_FALSE(attn::plan_attention<float>(values_only, opt_in).int8_products);
  CHECK_FALSE(attn::plan_attention<float>({1, 8, 8, 1, 4096, 128, 128, 2}, opt_in).int8_products);
  attn::AttentionOptions<double> in_double;
  in_double.algorithm = attn::Algorithm::decode;
  in_double.compute = attn::ComputePrecision::int8;
  CHECK_FALSE(attn::plan_attention<double>(blocks, in_double).int8_products);
  CHECK(std::string(attn::precision_name(attn::ComputePrecision::int8)) == "int8");
}

TEST_CASE("int8 products: a KVCache and a PagedKVCache give the same bits, for any thread count",
          "[isa][int8]") {
  std::mt19937 rng(3402);
  const Index batch = 2, kv_heads = 2, q_heads = 8, dim = 128, length = 777;
  const auto k = attn_test::random_heads<float>(batch, kv_heads, length, dim, rng);
  const auto v = attn_test::random_heads<float>(batch, kv_heads, length, dim, rng);
  const auto q = attn_test::random_heads<float>(batch, q_heads, 1, dim, rng);
  attn::AttentionOptions<float> options;
  options.compute = attn::ComputePrecision::int8;
  attn::KVCache<BlockQ4_0, BlockQ8_0> cache(batch, kv_heads, dim, dim, length);
  cache.append(k.cview(), v.cview());
  const auto attend = [&] {
    Heads<float> out(batch, q_heads, 1, dim);
    cache.attend_into(q.cview(), out.view(), options);
    return out.data;
  };
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<float> one = attend();
  omp_set_num_threads(3);
  const std::vector<float> three = attend();
  omp_set_num_threads(threads);
  CHECK(one == three);
#endif
  const std::vector<float> contiguous = attend();
  // fp32 differs where int8 products run (the query is quantized), and only there
  attn::AttentionOptions<float> fp32 = options;
  fp32.compute = attn::ComputePrecision::fp32;
  Heads<float> exact(batch, q_heads, 1, dim);
  cache.attend_into(q.cview(), exact.view(), fp32);
  CHECK((exact.data != contiguous) == int8_level());
  // pages of 64 rows, cut where the contiguous cache cuts its key blocks: the same bits
  attn::PagedKVCache<BlockQ4_0, BlockQ8_0> paged(kv_heads, dim, dim, 64, 2 * (length / 64 + 1));
  std::vector<Index> ids;
  for (Index b = 0; b < batch; ++b)
    ids.push_back(paged.add_sequence());
  paged.append(ids, k.cview(), v.cview());
  Heads<float> out(batch, q_heads, 1, dim);
  paged.attend_into(ids, q.cview(), out.view(), options);
  CHECK(out.data == contiguous);
}

TEST_CASE("int8 products: NaN in a query or a key block propagates", "[isa][int8]") {
  const Index dim = 64, length = 40;
  std::mt19937 rng(3403);
  const auto k = attn_test::random_heads<float>(1, 1, length, dim, rng);
  const auto v = attn_test::random_heads<float>(1, 1, length, dim, rng);
  auto q = attn_test::random_heads<float>(1, 2, 1, dim, rng);
  attn::AttentionOptions<float> options;
  options.compute = attn::ComputePrecision::int8;
  options.window = {4, 0};  // the query sees keys 35 .. 39
  attn::KVCache<BlockQ8_0> cache(1, 1, dim, dim, length);
  cache.append(k.cview(), v.cview());
  q.data[40] = std::numeric_limits<float>::quiet_NaN();  // head 0, block 1
  Heads<float> out(1, 2, 1, dim);
  cache.attend_into(q.cview(), out.view(), options);
  for (Index e = 0; e < dim; ++e) {
    CHECK(std::isnan(out.data[static_cast<std::size_t>(e)]));
    CHECK(std::isfinite(out.data[static_cast<std::size_t>(dim + e)]));
  }
  // a NaN key value: its block's scale is NaN (docs/quantized-cache.md), the key's score NaN
  auto k_nan = k;
  k_nan.data[static_cast<std::size_t>(37 * dim + 3)] = std::numeric_limits<float>::quiet_NaN();
  attn::KVCache<BlockQ8_0> with_nan(1, 1, dim, dim, length);
  with_nan.append(k_nan.cview(), v.cview());
  q.data[40] = 0.5f;
  with_nan.attend_into(q.cview(), out.view(), options);
  for (const float x : out.data)
    CHECK(std::isnan(x));
  // outside the window the NaN key is not seen
  k_nan.data[static_cast<std::size_t>(37 * dim + 3)] = 0.25f;
  k_nan.data[static_cast<std::size_t>(3 * dim + 3)] = std::numeric_limits<float>::quiet_NaN();
  attn::KVCache<BlockQ8_0> outside(1, 1, dim, dim, length);
  outside.append(k_nan.cview(), v.cview());
  outside.attend_into(q.cview(), out.view(), options);
  for (const float x : out.data)
    CHECK(std::isfinite(x));
}

TEST_CASE("int8 products: SageAttention's metrics against the fp32 path on the same cache",
          "[isa][int8]") {
  // docs/precision.md "int8 products": q, k, v of N(0, 1), 1024 keys, 32 query heads on 8 kv
  // heads, one query each: the error the query's quantization adds over the cache's own.
  std::mt19937 rng(3404);
  for (const Index dim : {Index(64), Index(128)}) {
    const auto k = attn_test::random_heads<float>(1, 8, 1024, dim, rng);
    const auto v = attn_test::random_heads<float>(1, 8, 1024, dim, rng);
    const auto q = attn_test::random_heads<float>(1, 32, 1, dim, rng);
    attn::KVCache<BlockQ8_0> cache(1, 8, dim, dim, 1024);
    cache.append(k.cview(), v.cview());
    attn::AttentionOptions<float> options;
    options.compute = attn::ComputePrecision::int8;
    Heads<float> got(1, 32, 1, dim), fp32(1, 32, 1, dim);
    cache.attend_into(q.cview(), got.view(), options);
    options.compute = attn::ComputePrecision::fp32;
    cache.attend_into(q.cview(), fp32.view(), options);
    double dot = 0, got_norm = 0, fp32_norm = 0, l1 = 0, l1_fp32 = 0, largest = 0;
    for (std::size_t i = 0; i < got.data.size(); ++i) {
      const double a = got.data[i], b = fp32.data[i];
      dot += a * b;
      got_norm += a * a;
      fp32_norm += b * b;
      l1 += std::abs(a - b);
      l1_fp32 += std::abs(b);
      largest = std::max(largest, std::abs(a - b));
    }
    const double cosine = dot / std::sqrt(got_norm * fp32_norm), relative_l1 = l1 / l1_fp32;
    INFO("D " << dim << ": cosine " << cosine << ", relative L1 " << relative_l1
              << ", largest error " << largest);
    if (!int8_level()) {
      CHECK(largest == 0.0);
      continue;
    }
    CHECK(cosine > 0.9999);
    CHECK(relative_l1 < 0.01);
    CHECK(largest > 0.0);  // the query was quantized
  }
}

#if ATTN_X86_DISPATCH
namespace {

template <class SK, class SV>
void check_same_int8_kernels(const char* formats) {
  INFO(formats);
  const auto int8_kernels = [](attn::Isa isa) {
    return attn::detail::dispatch(isa, [](auto table) {
      using Table = decltype(table);
      return std::make_pair(Table::template decode<float, SK, SV>.decode_split_int8,
                            Table::template forward<float, SK, SV>.flash_tile_int8);
    });
  };
  const auto vnni = int8_kernels(attn::Isa::avx512_vnni);
  CHECK((vnni.first != nullptr) == attn::is_quantized_v<SK>);  // decode's: quantized keys only
  CHECK(vnni.second != nullptr);
  CHECK(int8_kernels(attn::Isa::avx512_bf16) == vnni);
}

}  // namespace

// ctest runs the [sweep] cases (one kernel over many shapes) on avx512_vnni only: this is what
// makes that enough for avx512_bf16 too (tests/CMakeLists.txt).
TEST_CASE("int8 products: avx512_bf16 runs avx512_vnni's int8 kernels", "[int8]") {
  check_same_int8_kernels<BlockQ8_0, BlockQ8_0>("K q8_0, V q8_0");
  check_same_int8_kernels<BlockQ8_0, BlockQ4_0>("K q8_0, V q4_0");
  check_same_int8_kernels<BlockQ4_0, BlockQ8_0>("K q4_0, V q8_0");
  check_same_int8_kernels<BlockQ4_0, BlockQ4_0>("K q4_0, V q4_0");
  check_same_int8_kernels<float, float>("K, V float");
}
#endif  // ATTN_X86_DISPATCH
