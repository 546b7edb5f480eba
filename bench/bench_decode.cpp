// bench/bench_decode.cpp: decoding, a few new queries against a KV length of 512 to 32768.
//
//   q    (B, Hq, Lq, D)     the new tokens' queries, float; Lq = 1 unless said otherwise
//   k, v (B, Hkv, Lk, D)    the keys and values seen so far (a KV cache), float or half
//   out  (B, Hq, Lq, D)
//
// Decoding is memory-bound: every call streams K and V once and does 4 * Hq * Lk * D FLOPs
// against 2 * Hkv * Lk * D * sizeof(K) bytes. The counter that matters is "KV_bytes", the
// bytes of K and V a call must read (once per kv head, however many query heads share it),
// as a rate; "bandwidth" is a plain streaming probe (the sum of a 512 MiB float array, one
// pass per iteration) in the same binary, the ceiling to read it against, and
// "bandwidth_huge_pages" the same array on transparent huge pages.
//
// Families (args Lq, Lk, Hq, Hkv, D, threads, half, kernel; kernel 1 flash, 2 decode,
// 3 naive):
//   decode                 the decode kernel (kernels/decode.hpp), Hq = Hkv = 8 and GQA 32/8,
//                          D = 64, 128, K and V float (half:0) or Eigen::half (half:1, the
//                          kernel called directly)
//   decode_formats         the decode kernel with K and V stored as float, half, q8_0 or q4_0
//                          (format 0..3), Lk = 4096 and 32768, D = 128, Hq = Hkv = 8 and GQA
//                          32/8, one and two threads
//   decode_formats_int8    the same for q8_0 and q4_0 with decode's scores on int8 products
//                          (ComputePrecision::int8), where the CPU has them (avx512_vnni)
//   decode_formats_cold, decode_formats_int8_cold   the same at Lk = 32768 with the caches
//                          evicted before each call (common.hpp's evict_caches, not timed):
//                          K and V from memory even where the last-level cache could hold
//                          them between calls, as it cannot in a model's decode step
//   decode_formats_cold_huge_pages, decode_formats_int8_cold_huge_pages   the same with K and
//                          V on transparent huge pages (attn::CacheHugePagesScope), against
//                          bandwidth_huge_pages, the streaming probe on huge pages
//   kv_cache_decode_cold   one query per head against a KVCache of each format (format 0..3)
//                          through attend_into, Lk = 32768, from memory, the cache's buffers
//                          on huge pages (huge:1, attn/cache/huge_pages.hpp's default) or not
//                          (huge:0); "resident_over_stored" is the resident memory the cache
//                          added over its stored bytes
//   stream_compute         a probe of how far arithmetic overlaps a memory stream on this CPU:
//                          two byte arrays read in alternating blocks of 8704 bytes (the K and
//                          V blocks of 64 keys of a q8_0 cache, D = 128; 71 MiB in all, as at
//                          Lk = 32768, Hkv = 8), each 64-byte line widened and given `fmas`
//                          FMAs (0, 8, 16, 32), prefetched one block ahead into L1 as decode's
//                          quantized readers do; from memory (cold:1, the caches evicted
//                          before each call) and from L2 (cold:0, 2 x 256 KiB read over and
//                          over: the arithmetic alone). Full overlap would make a cold call
//                          take the larger of the stream's time and the arithmetic's.
//   fma_peak               the FMA probe (common.hpp), for prefill_formats
//   prefill_formats        Lq = 1 .. 256 new queries against a KVCache of 4096 tokens of each
//                          format through attend_into, decode against flash: the quantized
//                          crossover of attn/plan.hpp (quantized_decode_max_queries)
//   prefill_formats_int8   the same on int8 products (ComputePrecision::int8; q8_0 and q4_0):
//                          decode (Lq <= 64) and flash (Lq >= 16)
//   decode_before          what one query ran before the decode kernel: naive (automatic's
//                          choice for Lq * Lk <= 64 * 64 until bench_plan's crossovers) and
//                          flash
//   decode_vs_flash_by_Lq  Lq = 1 .. 32 at Lk = 4096: where decode stops paying
//   decode_isa/<isa>, decode_vs_flash_by_Lq_isa/<isa>   the same with the products of one
//                          instruction set forced (attn/cpu.hpp), for each one this CPU has:
//                          Lk = 8192 and 32768, D = 128, one thread
// B = 1; bottom-right causal (the new tokens see every key). Every benchmark is validated
// against naive on the same (rounded) inputs before timing.
//
//   build/dev/bench/bench_decode --benchmark_filter='decode/'
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <attn/attention.hpp>
#include <attn/cpu.hpp>
#include <attn/kernels/simd/avx2.hpp>
#include <attn/kernels/simd/avx512.hpp>
#include <attn/kv_cache.hpp>
#include <attn/quantized.hpp>

#include "common.hpp"

#if defined(__linux__)
#include <unistd.h>
#endif

namespace {

using attn::Index;
using attn_bench::BM_bandwidth;
using attn_bench::BM_bandwidth_huge_pages;
using attn_bench::set_threads;
using attn_bench::smoke;

enum class Kernel : std::int64_t { automatic = 0, flash = 1, decode = 2, naive = 3 };

/// One call of Lq queries (B = 1) against Lk keys, K and V stored as float (half = 0) or
/// Eigen::half (half = 1; the decode kernel is called directly, so the call allocates
/// nothing the float one does not). Validated against naive on the same (rounded) values
/// before timing.
void BM_decode(benchmark::State& state) {
  const Index q_length = state.range(0), k_length = state.range(1), q_heads = state.range(2),
              kv_heads = state.range(3), dim = state.range(4);
  const int threads = static_cast<int>(state.range(5));
  const bool half = state.range(6) != 0;
  const auto kernel = static_cast<Kernel>(state.range(7));
  set_threads(threads);
  const auto elements = [](Index n) { return static_cast<std::size_t>(n); };
  std::vector<float> q(elements(q_heads * q_length * dim)), k(elements(kv_heads * k_length * dim)),
      v(elements(kv_heads * k_length * dim)), out(elements(q_heads * q_length * dim)),
      reference(out.size());
  attn_bench::fill_normal(q, 1u);
  attn_bench::fill_normal(k, 2u);
  attn_bench::fill_normal(v, 3u);
  std::vector<Eigen::half> k_half, v_half;
  if (half) {
    k_half.resize(k.size());
    v_half.resize(v.size());
    for (std::size_t n = 0; n < k.size(); ++n) {  // the reference sees the rounded values
      k_half[n] = Eigen::half(k[n]);
      v_half[n] = Eigen::half(v[n]);
      k[n] = static_cast<float>(k_half[n]);
      v[n] = static_cast<float>(v_half[n]);
    }
  }
  const auto qv =
      attn::bhld_view(static_cast<const float*>(q.data()), Index(1), q_heads, q_length, dim);
  const auto kv =
      attn::bhld_view(static_cast<const float*>(k.data()), Index(1), kv_heads, k_length, dim);
  const auto vv =
      attn::bhld_view(static_cast<const float*>(v.data()), Index(1), kv_heads, k_length, dim);
  const auto kh = attn::bhld_view(static_cast<const Eigen::half*>(k_half.data()), Index(1),
                                  kv_heads, k_length, dim);
  const auto vh = attn::bhld_view(static_cast<const Eigen::half*>(v_half.data()), Index(1),
                                  kv_heads, k_length, dim);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::bottom_right;
  const attn::AttentionProblem<float> problem("bench_decode", 1, q_heads, q_length, k_length,
                                              options);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const auto run = [&](std::vector<float>& result, Kernel which) {
    const auto out_view = attn::bhld_view(result.data(), Index(1), q_heads, q_length, dim);
    if (half) {
      const attn::KernelPlan plan =
          attn::plan_attention<float>({1, q_heads, kv_heads, q_length, k_length, dim, dim},
                                      attn::Algorithm::decode, 0, 0, false);
      attn::detail::decode_attention<float, Eigen::half, Eigen::half>(
          plan, qv, kh, vh, out_view, problem, scale, attn::detail::RowValues<float>{});
      return;
    }
    options.algorithm = which == Kernel::flash    ? attn::Algorithm::flash
                        : which == Kernel::decode ? attn::Algorithm::decode
                        : which == Kernel::naive  ? attn::Algorithm::naive
                                                  : attn::Algorithm::automatic;
    attn::scaled_dot_product_attention_into<float>(qv, kv, vv, out_view, options);
  };
  options.algorithm = attn::Algorithm::naive;
  attn::scaled_dot_product_attention_into<float>(
      qv, kv, vv, attn::bhld_view(reference.data(), Index(1), q_heads, q_length, dim), options);
  run(out, kernel);
  const float worst = attn_bench::max_abs_diff(out.data(), reference.data(), out.size());
  if (!(worst < 1e-4f)) {
    attn_bench::fail_check(state, ("differs from naive by " + std::to_string(worst)));
    return;
  }
  for (auto _ : state) {
    run(out, kernel);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double kv_bytes = 2.0 * static_cast<double>(kv_heads * k_length * dim) *
                          static_cast<double>(half ? sizeof(Eigen::half) : sizeof(float));
  state.counters["KV_bytes"] = benchmark::Counter(
      kv_bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  state.counters["FLOPS"] =
      benchmark::Counter(4.0 * static_cast<double>(q_heads * q_length * k_length * dim),
                         benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

// --- The stream and compute probe ------------------------------------------------------
// stream_compute.inl, compiled for AVX-512 and AVX2 by target regions as the FMA probe is
// (common.hpp).
constexpr std::size_t stream_block_bytes = 8704;  // 64 rows of 136 bytes (q8_0, D = 128)

#if ATTN_X86_DISPATCH
ATTN_BEGIN_TARGET_AVX512
namespace avx512_stream {
namespace simd = attn::detail::avx512;
#include "stream_compute.inl"  // NOLINT(readability-duplicate-include): once per instruction set
}  // namespace avx512_stream
ATTN_END_TARGET

ATTN_BEGIN_TARGET_AVX2
namespace avx2_stream {
namespace simd = attn::detail::avx2;
#include "stream_compute.inl"  // NOLINT(readability-duplicate-include): once per instruction set
}  // namespace avx2_stream
ATTN_END_TARGET
#endif

/// stream_compute<Fmas> of the widest vector set this CPU has (0 without AVX2).
template <int Fmas>
float stream_compute(const std::int8_t* a, const std::int8_t* b, std::size_t bytes) {
#if ATTN_X86_DISPATCH
  if (attn::isa_supported(attn::Isa::avx512))
    return avx512_stream::stream_compute<Fmas>(a, b, bytes);
  if (attn::isa_supported(attn::Isa::avx2))
    return avx2_stream::stream_compute<Fmas>(a, b, bytes);
#endif
  (void)a, (void)b, (void)bytes;
  return 0.0f;
}

/// stream_compute with fmas FMAs per line (arg 0: 0, 8, 16 or 32), from memory (arg 1 = 1,
/// 2 x 36 MiB, the caches evicted before each call) or from L2 (2 x 256 KiB). "bytes" counts
/// both arrays; "ns_per_line" the time per 64-byte line.
void BM_stream_compute(benchmark::State& state) {
  const int fmas = static_cast<int>(state.range(0));
  const bool cold = state.range(1) != 0;
  if (!attn::isa_supported(attn::Isa::avx2)) {
    state.SkipWithError("no AVX2 on this CPU");
    return;
  }
  const std::size_t bytes = smoke() ? (std::size_t{1} << 18)
                            : cold  ? (std::size_t{36} << 20)
                                    : (std::size_t{1} << 18);
  // One block past the end: the prefetches of the last block stay inside the allocation.
  std::vector<std::int8_t> data(2 * (bytes + stream_block_bytes));
  for (std::size_t n = 0; n < data.size(); ++n)
    data[n] = static_cast<std::int8_t>(n * 7 % 251);
  const std::int8_t* a = data.data();
  const std::int8_t* b = a + bytes + stream_block_bytes;
  const auto call = [&] {
    switch (fmas) {
      case 0:
        return stream_compute<0>(a, b, bytes);
      case 8:
        return stream_compute<8>(a, b, bytes);
      case 16:
        return stream_compute<16>(a, b, bytes);
      default:
        return stream_compute<32>(a, b, bytes);
    }
  };
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      attn_bench::evict_caches();
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(call());
  }
  state.counters["bytes"] = benchmark::Counter(static_cast<double>(2 * bytes),
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ns_per_line"] = benchmark::Counter(
      static_cast<double>(2 * bytes) / 64.0 * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

enum class Format : std::int64_t { f32 = 0, f16 = 1, q8_0 = 2, q4_0 = 3 };

/// Bytes of K and V one call reads, per stored value.
double bytes_per_value(Format format) {
  switch (format) {
    case Format::f32:
      return 4.0;
    case Format::f16:
      return 2.0;
    case Format::q8_0:
      return static_cast<double>(sizeof(attn::BlockQ8_0)) / 32.0;
    case Format::q4_0:
      return static_cast<double>(sizeof(attn::BlockQ4_0)) / 32.0;
  }
  return 0.0;
}

/// K and V (B = 1, Hkv, Lk, D) stored in one format: the values as stored, and their views,
/// on huge pages or not (the caches' allocator, attn_bench::PageVector).
struct StoredKV {
  template <class T>
  using Stored = attn_bench::PageVector<T>;
  Stored<float> f32;
  Stored<Eigen::half> f16;
  Stored<attn::BlockQ8_0> q8_0;
  Stored<attn::BlockQ4_0> q4_0;

  /// Stores x in `format` and replaces x with the values the format reads back.
  StoredKV(std::vector<float>& x, Format format, bool huge_pages = false) {
    const attn::CacheHugePagesScope pages(huge_pages);
    const auto n = static_cast<Index>(x.size());
    switch (format) {
      case Format::f32:
        f32.assign(x.begin(), x.end());
        break;
      case Format::f16:
        f16.reserve(x.size());
        for (float& e : x) {
          f16.emplace_back(e);
          e = static_cast<float>(f16.back());
        }
        break;
      case Format::q8_0:
        q8_0.resize(x.size() / 32);
        attn::quantize_blocks(x.data(), n, q8_0.data());
        attn::dequantize_blocks(q8_0.data(), n / 32, x.data());
        break;
      case Format::q4_0:
        q4_0.resize(x.size() / 32);
        attn::quantize_blocks(x.data(), n, q4_0.data());
        attn::dequantize_blocks(q4_0.data(), n / 32, x.data());
        break;
    }
  }
};

/// One decode call of Lq = 1 against Lk keys with K and V stored as `format` (arg 6: 0 float,
/// 1 half, 2 q8_0, 3 q4_0), the decode kernel called directly for each, its scores on int8
/// products if `int8` (where the CPU has them: ComputePrecision::int8), the caches evicted
/// before each call if `cold` (the eviction not timed), K and V on huge pages if `huge_pages`;
/// validated against naive on the values the format reads back (within 1e-4; 5e-3 with int8
/// products, which quantize the query). "KV_bytes" counts the stored bytes.
void decode_format(benchmark::State& state, bool int8, bool cold, bool huge_pages = false) {
  const Index k_length = state.range(0), q_heads = state.range(1), kv_heads = state.range(2),
              dim = state.range(3);
  const int threads = static_cast<int>(state.range(4));
  const auto format = static_cast<Format>(state.range(5));
  set_threads(threads);
  const auto elements = [](Index n) { return static_cast<std::size_t>(n); };
  std::vector<float> q(elements(q_heads * dim)), k(elements(kv_heads * k_length * dim)),
      v(k.size()), out(q.size()), reference(q.size());
  attn_bench::fill_normal(q, 1u);
  attn_bench::fill_normal(k, 2u);
  attn_bench::fill_normal(v, 3u);
  const StoredKV ks(k, format, huge_pages), vs(v, format, huge_pages);
  const auto qv = attn::bhld_view(static_cast<const float*>(q.data()), Index(1), q_heads, 1, dim);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::bottom_right;
  const attn::AttentionProblem<float> problem("bench_decode", 1, q_heads, 1, k_length, options);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  attn::AttentionShape shape{1, q_heads, kv_heads, 1, k_length, dim, dim};
  shape.kv_quantized = format == Format::q8_0 || format == Format::q4_0;
  shape.k_int8_readable = shape.kv_quantized;
  attn::AttentionOptions<float> decode;
  decode.algorithm = attn::Algorithm::decode;
  decode.compute = int8 ? attn::ComputePrecision::int8 : attn::ComputePrecision::fp32;
  const attn::KernelPlan plan = attn::plan_attention<float>(shape, decode);
  if (int8 && !plan.int8_products) {
    state.SkipWithError("no int8 products on this CPU");
    return;
  }
  const auto out_view = attn::bhld_view(out.data(), Index(1), q_heads, 1, dim);
  const auto run = [&] {
    const auto call = [&](const auto& kk, const auto& vv, Index units) {
      using S = typename std::decay_t<decltype(kk)>::value_type;
      const auto view = [&](const auto& x) {
        return attn::bhld_view(static_cast<const S*>(x.data()), Index(1), kv_heads, k_length,
                               units);
      };
      attn::detail::decode_attention<float, S, S>(plan, qv, view(kk), view(vv), out_view, problem,
                                                  scale, attn::detail::RowValues<float>{});
    };
    switch (format) {
      case Format::f32:
        return call(ks.f32, vs.f32, dim);
      case Format::f16:
        return call(ks.f16, vs.f16, dim);
      case Format::q8_0:
        return call(ks.q8_0, vs.q8_0, dim / 32);
      case Format::q4_0:
        return call(ks.q4_0, vs.q4_0, dim / 32);
    }
  };
  options.algorithm = attn::Algorithm::naive;
  attn::scaled_dot_product_attention_into<float>(
      qv, attn::bhld_view(static_cast<const float*>(k.data()), Index(1), kv_heads, k_length, dim),
      attn::bhld_view(static_cast<const float*>(v.data()), Index(1), kv_heads, k_length, dim),
      attn::bhld_view(reference.data(), Index(1), q_heads, 1, dim), options);
  run();
  const float worst = attn_bench::max_abs_diff(out.data(), reference.data(), out.size());
  if (!(worst < (int8 ? 5e-3f : 1e-4f))) {
    attn_bench::fail_check(state, ("differs from naive by " + std::to_string(worst)));
    return;
  }
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      attn_bench::evict_caches();
      state.ResumeTiming();
    }
    run();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double kv_bytes =
      2.0 * static_cast<double>(kv_heads * k_length * dim) * bytes_per_value(format);
  state.counters["KV_bytes"] = benchmark::Counter(
      kv_bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  state.counters["FLOPS"] = benchmark::Counter(4.0 * static_cast<double>(q_heads * k_length * dim),
                                               benchmark::Counter::kIsIterationInvariantRate);
  set_threads(1);
}

void BM_decode_format(benchmark::State& state) {
  decode_format(state, false, false);
}
void BM_decode_format_int8(benchmark::State& state) {
  decode_format(state, true, false);
}
void BM_decode_format_cold(benchmark::State& state) {
  decode_format(state, false, true);
}
void BM_decode_format_int8_cold(benchmark::State& state) {
  decode_format(state, true, true);
}
void BM_decode_format_cold_huge_pages(benchmark::State& state) {
  decode_format(state, false, true, true);
}
void BM_decode_format_int8_cold_huge_pages(benchmark::State& state) {
  decode_format(state, true, true, true);
}

/// The process's resident memory in bytes (Linux; 0 elsewhere).
double resident_bytes() {
#if defined(__linux__)
  std::ifstream statm("/proc/self/statm");
  double pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE));
#else
  return 0;
#endif
}

/// One query per head against a KVCache<S> of Lk tokens through the public attend_into, from
/// memory (the caches evicted before each call), its buffers on huge pages (huge:1, the
/// default of attn/cache/huge_pages.hpp) or on small ones (huge:0, set_cache_huge_pages
/// off). "resident_over_stored": the resident memory the cache's allocation and append
/// added, over its stored bytes.
template <class S>
void kv_cache_decode(benchmark::State& state, const std::vector<float>& k,
                     const std::vector<float>& v, Format format) {
  const Index k_length = state.range(0), q_heads = state.range(1), kv_heads = state.range(2),
              dim = 128;
  const bool huge = state.range(5) != 0;
  std::vector<float> q(static_cast<std::size_t>(q_heads * dim)), out(q.size());
  attn_bench::fill_normal(q, 1u);
  const double resident_before = resident_bytes();
  auto cache = [&] {
    const attn::CacheHugePagesScope pages(huge);
    return attn::KVCache<S>(1, kv_heads, dim, dim, k_length);
  }();
  cache.append(
      attn::bhld_view(static_cast<const float*>(k.data()), Index(1), kv_heads, k_length, dim),
      attn::bhld_view(static_cast<const float*>(v.data()), Index(1), kv_heads, k_length, dim));
  const double stored =
      2.0 * static_cast<double>(kv_heads * k_length * dim) * bytes_per_value(format);
  const double resident_added = resident_bytes() - resident_before;
  const auto qv = attn::bhld_view(static_cast<const float*>(q.data()), Index(1), q_heads, 1, dim);
  const auto out_view = attn::bhld_view(out.data(), Index(1), q_heads, 1, dim);
  for (auto _ : state) {
    state.PauseTiming();
    attn_bench::evict_caches();
    state.ResumeTiming();
    cache.attend_into(qv, out_view);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["KV_bytes"] = benchmark::Counter(
      stored, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  state.counters["resident_over_stored"] = resident_added / stored;
}

void BM_kv_cache_decode_cold(benchmark::State& state) {
  const Index k_length = state.range(0), kv_heads = state.range(2), dim = 128;
  const int threads = static_cast<int>(state.range(3));
  set_threads(threads);
  std::vector<float> k(static_cast<std::size_t>(kv_heads * k_length * dim)), v(k.size());
  attn_bench::fill_normal(k, 2u);
  attn_bench::fill_normal(v, 3u);
  switch (static_cast<Format>(state.range(4))) {
    case Format::f32:
      kv_cache_decode<float>(state, k, v, Format::f32);
      break;
    case Format::f16:
      kv_cache_decode<Eigen::half>(state, k, v, Format::f16);
      break;
    case Format::q8_0:
      kv_cache_decode<attn::BlockQ8_0>(state, k, v, Format::q8_0);
      break;
    case Format::q4_0:
      kv_cache_decode<attn::BlockQ4_0>(state, k, v, Format::q4_0);
      break;
  }
  set_threads(1);
}

/// Lq new queries (the cache's last Lq tokens) against a KVCache<S> of Lk tokens through the
/// public attend_into, the kernel forced (arg 5: 0 decode, 1 flash, 2 decode and 3 flash on
/// int8 products, ComputePrecision::int8): where a quantized cache
/// should stop decoding and dequantize tiles for flash. Validated against naive on the values
/// the format reads back.
template <class S>
void prefill_from_cache(benchmark::State& state, std::vector<float>& k, std::vector<float>& v,
                        Format format) {
  const Index q_length = state.range(0), k_length = state.range(1), q_heads = state.range(2),
              kv_heads = state.range(3), dim = 128;
  const bool flash = state.range(5) == 1 || state.range(5) == 3;
  const bool int8 = state.range(5) >= 2;
  if (int8 && !attn::has_int8_products(attn::active_isa())) {
    state.SkipWithError("no int8 products on this CPU");
    return;
  }
  attn::KVCache<S> cache(1, kv_heads, dim, dim, k_length);
  cache.append(
      attn::bhld_view(static_cast<const float*>(k.data()), Index(1), kv_heads, k_length, dim),
      attn::bhld_view(static_cast<const float*>(v.data()), Index(1), kv_heads, k_length, dim));
  const StoredKV read_k(k, format), read_v(v, format);  // k, v: the values as read back
  std::vector<float> q(static_cast<std::size_t>(q_heads * q_length * dim));
  attn_bench::fill_normal(q, 1u);
  std::vector<float> out(q.size()), reference(q.size());
  const auto qv =
      attn::bhld_view(static_cast<const float*>(q.data()), Index(1), q_heads, q_length, dim);
  attn::AttentionOptions<float> options;
  options.algorithm = flash ? attn::Algorithm::flash : attn::Algorithm::decode;
  options.compute = int8 ? attn::ComputePrecision::int8 : attn::ComputePrecision::fp32;
  const auto out_view = attn::bhld_view(out.data(), Index(1), q_heads, q_length, dim);
  attn::AttentionOptions<float> naive;
  naive.algorithm = attn::Algorithm::naive;
  naive.causal = attn::Causal::bottom_right;
  attn::scaled_dot_product_attention_into<float>(
      qv, attn::bhld_view(static_cast<const float*>(k.data()), Index(1), kv_heads, k_length, dim),
      attn::bhld_view(static_cast<const float*>(v.data()), Index(1), kv_heads, k_length, dim),
      attn::bhld_view(reference.data(), Index(1), q_heads, q_length, dim), naive);
  cache.attend_into(qv, out_view, options);
  const float worst = attn_bench::max_abs_diff(out.data(), reference.data(), out.size());
  if (!(worst < (int8 ? 5e-3f : 1e-4f))) {  // int8: the query's quantization too
    attn_bench::fail_check(state, ("differs from naive by " + std::to_string(worst)));
    return;
  }
  for (auto _ : state) {
    cache.attend_into(qv, out_view, options);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] =
      benchmark::Counter(4.0 * static_cast<double>(q_heads * q_length * k_length * dim),
                         benchmark::Counter::kIsIterationInvariantRate);
}

void BM_prefill_format(benchmark::State& state) {
  const Index k_length = state.range(1), kv_heads = state.range(3);
  const auto format = static_cast<Format>(state.range(4));
  set_threads(1);
  std::vector<float> k(static_cast<std::size_t>(kv_heads * k_length * 128)), v(k.size());
  attn_bench::fill_normal(k, 2u);
  attn_bench::fill_normal(v, 3u);
  switch (format) {
    case Format::f32:
      return prefill_from_cache<float>(state, k, v, format);
    case Format::f16:
      return prefill_from_cache<Eigen::half>(state, k, v, format);
    case Format::q8_0:
      return prefill_from_cache<attn::BlockQ8_0>(state, k, v, format);
    case Format::q4_0:
      return prefill_from_cache<attn::BlockQ4_0>(state, k, v, format);
  }
}

/// BM_decode with the products of `isa` forced.
void BM_decode_isa(benchmark::State& state, attn::Isa isa) {
  const attn::ScopedIsa forced(isa);
  state.SetLabel(attn::isa_name(isa));
  BM_decode(state);
}

void register_all() {
  const bool tiny = smoke();
  attn_bench::on_one_and_two_threads(benchmark::RegisterBenchmark("bandwidth", BM_bandwidth));
  attn_bench::on_one_and_two_threads(
      benchmark::RegisterBenchmark("bandwidth_huge_pages", BM_bandwidth_huge_pages));
  const std::vector<std::int64_t> lengths =
      tiny ? std::vector<std::int64_t>{512}
           : std::vector<std::int64_t>{512, 2048, 8192, 16384, 32768};
  const std::vector<std::string> arg_names{"Lq", "Lk",      "Hq",   "Hkv",
                                           "D",  "threads", "half", "kernel"};
  const auto kernel = [](Kernel k) { return static_cast<std::int64_t>(k); };
  // The decode kernel (explicitly, as automatic's choice depends on the instruction set), K
  // and V in float and in half.
  for (const auto& [q_heads, kv_heads] : {std::pair<std::int64_t, std::int64_t>{8, 8},
                                          std::pair<std::int64_t, std::int64_t>{32, 8}}) {
    benchmark::RegisterBenchmark("decode", BM_decode)
        ->ArgNames(arg_names)
        ->ArgsProduct({{1},
                       lengths,
                       {q_heads},
                       {kv_heads},
                       {64, 128},
                       {1, 2},
                       {0, 1},
                       {kernel(Kernel::decode)}})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // Every K/V format of the cache (float, half, q8_0, q4_0), Lq = 1, D = 128.
  benchmark::RegisterBenchmark("decode_formats", BM_decode_format)
      ->ArgNames({"Lk", "Hq", "Hkv", "D", "threads", "format"})
      ->ArgsProduct({tiny ? std::vector<std::int64_t>{512} : std::vector<std::int64_t>{4096, 32768},
                     {8, 32},
                     {8},
                     {128},
                     {1, 2},
                     {0, 1, 2, 3}})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  // The quantized ones again with decode's scores on int8 products (ComputePrecision::int8).
  if (attn::isa_supported(attn::Isa::avx512_vnni)) {
    benchmark::RegisterBenchmark("decode_formats_int8", BM_decode_format_int8)
        ->ArgNames({"Lk", "Hq", "Hkv", "D", "threads", "format"})
        ->ArgsProduct(
            {tiny ? std::vector<std::int64_t>{512} : std::vector<std::int64_t>{4096, 32768},
             {8, 32},
             {8},
             {128},
             {1, 2},
             {2, 3}})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // Both again at Lk = 32768 from memory: the caches evicted before each call. Each eviction
  // (untimed) reads 512 MiB: 0.2 s of timed calls, and one call in the smoke runs.
  const auto evicting = [tiny](benchmark::internal::Benchmark* b) {
    b->UseRealTime()->Unit(benchmark::kMicrosecond);
    if (tiny)
      b->Iterations(1);
    else
      b->MinTime(0.2);
  };
  const auto cold = [&](benchmark::internal::Benchmark* b,
                        const std::vector<std::int64_t>& formats) {
    evicting(b->ArgNames({"Lk", "Hq", "Hkv", "D", "threads", "format"})
                 ->ArgsProduct({{tiny ? 512 : 32768}, {8, 32}, {8}, {128}, {1, 2}, formats}));
  };
  cold(benchmark::RegisterBenchmark("decode_formats_cold", BM_decode_format_cold), {0, 1, 2, 3});
  if (attn::isa_supported(attn::Isa::avx512_vnni))
    cold(benchmark::RegisterBenchmark("decode_formats_int8_cold", BM_decode_format_int8_cold),
         {2, 3});
  // The same with K and V on huge pages, against bandwidth_huge_pages.
  cold(benchmark::RegisterBenchmark("decode_formats_cold_huge_pages",
                                    BM_decode_format_cold_huge_pages),
       {0, 1, 2, 3});
  if (attn::isa_supported(attn::Isa::avx512_vnni))
    cold(benchmark::RegisterBenchmark("decode_formats_int8_cold_huge_pages",
                                      BM_decode_format_int8_cold_huge_pages),
         {2, 3});
  // A user's KVCache from memory, its buffers on huge pages (the default) or not.
  evicting(benchmark::RegisterBenchmark("kv_cache_decode_cold", BM_kv_cache_decode_cold)
               ->ArgNames({"Lk", "Hq", "Hkv", "threads", "format", "huge"})
               ->ArgsProduct({{tiny ? 512 : 32768}, {8, 32}, {8}, {1, 2}, {0, 1, 2, 3}, {0, 1}}));
  // How far arithmetic overlaps the memory stream: cold against warm at 0 .. 32 FMAs per line.
  evicting(benchmark::RegisterBenchmark("stream_compute", BM_stream_compute)
               ->ArgNames({"fmas", "cold"})
               ->ArgsProduct({{0, 8, 16, 32}, {0, 1}}));
  attn_bench::register_fma_peak();  // the arithmetic ceiling prefill_formats is quoted against
  // Chunks of prompt against a cache of every format: decode against flash, by Lq.
  benchmark::RegisterBenchmark("prefill_formats", BM_prefill_format)
      ->ArgNames({"Lq", "Lk", "Hq", "Hkv", "format", "flash"})
      ->ArgsProduct({tiny ? std::vector<std::int64_t>{2, 16}
                          : std::vector<std::int64_t>{1, 4, 8, 16, 32, 64, 128, 256},
                     {tiny ? 512 : 4096},
                     {8, 32},
                     {8},
                     {0, 1, 2, 3},
                     {0, 1}})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  // Decode (kernel 2) and flash (kernel 3) on int8 products from q8_0 and q4_0: the crossover
  // of ComputePrecision::int8, and flash's gain from it.
  benchmark::RegisterBenchmark("prefill_formats_int8", BM_prefill_format)
      ->ArgNames({"Lq", "Lk", "Hq", "Hkv", "format", "flash"})
      ->ArgsProduct(
          {tiny ? std::vector<std::int64_t>{2, 16} : std::vector<std::int64_t>{1, 4, 8, 16, 32, 64},
           {tiny ? 512 : 4096},
           {8, 32},
           {8},
           {2, 3},
           {2}})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("prefill_formats_int8", BM_prefill_format)
      ->ArgNames({"Lq", "Lk", "Hq", "Hkv", "format", "flash"})
      ->ArgsProduct(
          {tiny ? std::vector<std::int64_t>{16} : std::vector<std::int64_t>{16, 32, 64, 128, 256},
           {tiny ? 512 : 4096},
           {8, 32},
           {8},
           {2, 3},
           {3}})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  // What one query used before: naive for Lk <= 4096 (automatic's tiny rule), else flash.
  for (const Kernel before : {Kernel::naive, Kernel::flash}) {
    const std::vector<std::int64_t> before_lengths =
        tiny ? lengths
             : (before == Kernel::naive ? std::vector<std::int64_t>{512, 2048}
                                        : std::vector<std::int64_t>{8192, 32768});
    benchmark::RegisterBenchmark("decode_before", BM_decode)
        ->ArgNames(arg_names)
        ->ArgsProduct({{1}, before_lengths, {8, 32}, {8}, {64, 128}, {1, 2}, {0}, {kernel(before)}})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // Where decode stops paying: Lq queries per head, decode kernel against flash.
  benchmark::RegisterBenchmark("decode_vs_flash_by_Lq", BM_decode)
      ->ArgNames(arg_names)
      ->ArgsProduct(
          {tiny ? std::vector<std::int64_t>{2} : std::vector<std::int64_t>{1, 2, 4, 8, 16, 32},
           {tiny ? 512 : 4096},
           {8, 32},
           {8},
           {128},
           {1},
           {0},
           {kernel(Kernel::flash), kernel(Kernel::decode)}})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  // Every instruction set this CPU has, in the same run.
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    const std::string suffix = std::string("/") + attn::isa_name(isa);
    benchmark::RegisterBenchmark(("decode_isa" + suffix).c_str(), BM_decode_isa, isa)
        ->ArgNames(arg_names)
        ->ArgsProduct(
            {{1},
             tiny ? std::vector<std::int64_t>{512} : std::vector<std::int64_t>{8192, 32768},
             {8, 32},
             {8},
             {128},
             {1},
             {0, 1},
             {kernel(Kernel::decode)}})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("decode_vs_flash_by_Lq_isa" + suffix).c_str(), BM_decode_isa, isa)
        ->ArgNames(arg_names)
        ->ArgsProduct(
            {tiny ? std::vector<std::int64_t>{2} : std::vector<std::int64_t>{1, 2, 4, 8, 16, 32},
             {tiny ? 512 : 4096},
             {8, 32},
             {8},
             {128},
             {1},
             {0},
             {kernel(Kernel::flash), kernel(Kernel::decode)}})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
