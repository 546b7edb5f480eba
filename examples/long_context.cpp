// Long context: flash attention on one head, causal, D = 64 (float), at Lq = Lk = 32768 and
// 65536, where the naive kernel would need a 4 GiB and a 16 GiB score matrix. Prints, per
// length, the time, the GFLOP/s and the peak extra memory next to what naive would need, and
// exits non-zero if the peak extra memory (the growth of the resident set, measured with
// getrusage after the inputs of the longest run are allocated and touched; a running
// maximum, so each row reports the peak up to and including that run) reaches 64 MiB.
// Causal, so each run does half the work (~0.14 and ~0.55 TFLOP). Then the flash backward
// (attn/attention_backward.hpp) at the lengths up to 32768 (~0.34 TFLOP there), under the same
// 64 MiB rule: its extra memory does not grow with L either; again on bf16 products
// (ComputePrecision::bf16) where the CPU has them. Then the forward with q k^T on
// int8 products (ComputePrecision::int8) where the CPU has them: its one cost that grows with
// L, the head's keys quantized, L (D + 8) bytes per thread (kernels/int8_tiles.hpp), is
// printed beside the peak. ATTN_LONG_CONTEXT_LENGTH runs one other length instead (the
// sanitizer build uses 8192).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <vector>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/cpu.hpp>

namespace {

long max_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;  // KiB on Linux
}

/// The runs above; 0 when every check passed.
int run() {
  using attn::Index;
  const char* env = std::getenv("ATTN_LONG_CONTEXT_LENGTH");
  const std::vector<Index> lengths =
      env != nullptr ? std::vector<Index>{std::atol(env)} : std::vector<Index>{32768, 65536};
  const Index longest = *std::max_element(lengths.begin(), lengths.end());
  const Index dim = 64;
  const auto n = static_cast<std::size_t>(longest * dim);
  // q, k, v (1, 1, L, D) and out (1, 1, L, D) for the longest L (shorter runs use the first
  // L rows): allocated and touched before the first reading.
  std::vector<float> q(n), k(n), v(n), out(n, 0.0f);
  // The backward's inputs and outputs: dout, the log-sum-exp, dq, dk, dv.
  constexpr Index longest_backward = 32768;
  const Index backward_rows = std::min(longest, longest_backward);
  const auto nb = static_cast<std::size_t>(backward_rows * dim);
  std::vector<float> dout(nb), lse(static_cast<std::size_t>(backward_rows), 0.0f), dq(nb, 0.0f),
      dk(nb, 0.0f), dv(nb, 0.0f);
  std::mt19937 rng(1u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::vector<float>* t : {&q, &k, &v, &dout})
    for (float& x : *t)
      x = normal(rng);

  const long before = max_rss_kib();
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.causal = attn::Causal::top_left;
  std::printf("flash, causal, one head, D = %ld, float, %d thread(s)\n", static_cast<long>(dim),
              attn::detail::max_threads());
  std::printf("%8s %9s %9s %19s %23s\n", "L", "time", "GFLOP/s", "peak extra memory",
              "naive: (L, L) scores");
  bool ok = true;
  // One forward at `length` with `o`, timed: its seconds.
  const auto timed_forward = [&](Index length, const attn::AttentionOptions<float>& o) {
    const auto start = std::chrono::steady_clock::now();
    attn::scaled_dot_product_attention_into<float>(
        attn::bhld_view(static_cast<const float*>(q.data()), Index(1), Index(1), length, dim),
        attn::bhld_view(static_cast<const float*>(k.data()), Index(1), Index(1), length, dim),
        attn::bhld_view(static_cast<const float*>(v.data()), Index(1), Index(1), length, dim),
        attn::bhld_view(out.data(), Index(1), Index(1), length, dim), o);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (const Index length : lengths) {
    const double seconds = timed_forward(length, options);
    const double extra_mib = static_cast<double>(max_rss_kib() - before) / 1024.0;

    bool finite = true;
    for (std::size_t x = 0; x < static_cast<std::size_t>(length * dim); ++x)
      finite = finite && std::isfinite(out[x]);
    const auto lf = static_cast<double>(length);
    const double flops = 4.0 * lf * (lf + 1) / 2 * static_cast<double>(dim);  // visible pairs
    const double naive_gib = lf * lf * 4.0 / (1024.0 * 1024.0 * 1024.0);
    std::printf("%8ld %7.2f s %9.1f %15.2f MiB %19.1f GiB\n", static_cast<long>(length), seconds,
                flops / seconds / 1e9, extra_mib, naive_gib);
    if (!finite) {
      std::printf("FAILED: non-finite output at L = %ld\n", static_cast<long>(length));
      ok = false;
    }
    if (extra_mib >= 64.0) {
      std::printf("FAILED: peak extra memory %.2f MiB >= 64 MiB at L = %ld\n", extra_mib,
                  static_cast<long>(length));
      ok = false;
    }
  }
  // The flash backward at each length up to longest_backward with `o`, under `title`.
  const auto backward_rows_of = [&](const attn::AttentionOptions<float>& o, const char* title) {
    std::printf("\n%s (dq, dk, dv), the same problems up to L = %ld\n", title,
                static_cast<long>(longest_backward));
    std::printf("%8s %9s %9s %19s\n", "L", "time", "GFLOP/s", "peak extra memory");
    for (const Index length : lengths) {
      if (length > longest_backward)
        continue;
      const auto view = [&](std::vector<float>& x) {
        return attn::bhld_view(x.data(), Index(1), Index(1), length, dim);
      };
      const auto cview = [&](const std::vector<float>& x) {
        return attn::bhld_view(x.data(), Index(1), Index(1), length, dim);
      };
      const attn::RowsView<float> rows = attn::bhl_view(lse.data(), Index(1), Index(1), length);
      attn::scaled_dot_product_attention_into<float>(cview(q), cview(k), cview(v),
                                                     {view(out), rows}, o);
      const auto start = std::chrono::steady_clock::now();
      attn::scaled_dot_product_attention_backward_into<float>(cview(q), cview(k), cview(v),
                                                              cview(out), rows, cview(dout),
                                                              {view(dq), view(dk), view(dv)}, o);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double extra_mib = static_cast<double>(max_rss_kib() - before) / 1024.0;
      bool finite = true;
      for (std::size_t x = 0; x < static_cast<std::size_t>(length * dim); ++x)
        finite = finite && std::isfinite(dq[x]) && std::isfinite(dk[x]) && std::isfinite(dv[x]);
      const auto lf = static_cast<double>(length);
      const double flops = 10.0 * lf * (lf + 1) / 2 * static_cast<double>(dim);  // five products
      std::printf("%8ld %7.2f s %9.1f %15.2f MiB\n", static_cast<long>(length), seconds,
                  flops / seconds / 1e9, extra_mib);
      if (!finite) {
        std::printf("FAILED: non-finite gradients at L = %ld\n", static_cast<long>(length));
        ok = false;
      }
      if (extra_mib >= 64.0) {
        std::printf("FAILED: peak extra memory %.2f MiB >= 64 MiB in the backward at L = %ld\n",
                    extra_mib, static_cast<long>(length));
        ok = false;
      }
    }
  };
  backward_rows_of(options, "flash backward");
  // The backward (and its forward) on bf16 products (ComputePrecision::bf16) where the CPU has
  // them: their operands in pairs of bfloat16, no more than the float tiles
  // (kernels/bf16_backward.hpp).
  options.compute = attn::ComputePrecision::bf16;
  if (attn::active_isa() == attn::Isa::avx512_bf16)
    backward_rows_of(options, "flash backward on bf16 products");
  options.compute = attn::ComputePrecision::int8;
  const int threads = attn::detail::max_threads();
  if (attn::has_int8_products(attn::active_isa())) {
    std::printf("\nflash on int8 q k^T, the same problems\n");
    std::printf("%8s %9s %9s %19s %23s\n", "L", "time", "GFLOP/s", "peak extra memory",
                "quantized keys, all threads");
    for (const Index length : lengths) {
      const double seconds = timed_forward(length, options);
      const double extra_mib = static_cast<double>(max_rss_kib() - before) / 1024.0;
      const auto lf = static_cast<double>(length);
      const double flops = 4.0 * lf * (lf + 1) / 2 * static_cast<double>(dim);
      const double keys_mib = lf * static_cast<double>(dim + 8) * threads / (1024.0 * 1024.0);
      std::printf("%8ld %7.2f s %9.1f %15.2f MiB %19.2f MiB\n", static_cast<long>(length), seconds,
                  flops / seconds / 1e9, extra_mib, keys_mib);
      if (extra_mib >= 64.0) {
        std::printf("FAILED: peak extra memory %.2f MiB >= 64 MiB on int8 products at L = %ld\n",
                    extra_mib, static_cast<long>(length));
        ok = false;
      }
    }
  }
  if (ok)
    std::printf(
        "OK: peak extra memory < 64 MiB at every length, forward and backward; naive "
        "would need the GiB above\n");
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "long_context: %s\n", e.what());
    return 1;
  }
}
