// Long context: flash attention on one head with Lq = Lk = 65536, D = 64 (float), where the
// naive kernel would need a 16 GiB score matrix. Asserts that the peak extra memory (the
// growth of the resident set, measured with getrusage after the inputs are allocated and
// touched) stays under 64 MiB, and exits non-zero otherwise. Causal, so it does half the
// work (~0.55 TFLOP); set ATTN_LONG_CONTEXT_LENGTH to try another length.
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <attn/attention.hpp>

namespace {

long max_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;  // KiB on Linux
}

}  // namespace

int main() {
  using attn::Index;
  const char* env = std::getenv("ATTN_LONG_CONTEXT_LENGTH");
  const Index length = env != nullptr ? std::atol(env) : 65536;
  const Index dim = 64;
  const auto n = static_cast<std::size_t>(length * dim);
  // q, k, v (1, 1, L, D) and out (1, 1, L, D): allocated and touched before the first reading.
  std::vector<float> q(n), k(n), v(n), out(n, 0.0f);
  std::mt19937 rng(1u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::vector<float>* t : {&q, &k, &v})
    for (float& x : *t)
      x = normal(rng);

  const long before = max_rss_kib();
  attn::AttentionOptions<float> options;
  options.algorithm = attn::Algorithm::flash;
  options.causal = attn::Causal::top_left;
  const auto start = std::chrono::steady_clock::now();
  attn::scaled_dot_product_attention_into<float>(
      attn::bhld_view(static_cast<const float*>(q.data()), Index(1), Index(1), length, dim),
      attn::bhld_view(static_cast<const float*>(k.data()), Index(1), Index(1), length, dim),
      attn::bhld_view(static_cast<const float*>(v.data()), Index(1), Index(1), length, dim),
      attn::bhld_view(out.data(), Index(1), Index(1), length, dim), options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const long after = max_rss_kib();
  const double extra_mib = static_cast<double>(after - before) / 1024.0;

  bool finite = true;
  for (const float x : out)
    finite = finite && std::isfinite(x);
  const double lf = static_cast<double>(length);
  std::printf("flash, causal, L = %ld, D = %ld: %.2f s, %.1f GFLOP/s, peak extra memory %.2f MiB\n",
              static_cast<long>(length), static_cast<long>(dim), seconds,
              4.0 * lf * (lf + 1) / 2 * static_cast<double>(dim) / seconds / 1e9, extra_mib);
  if (!finite) {
    std::printf("FAILED: non-finite output\n");
    return 1;
  }
  if (extra_mib >= 64.0) {
    std::printf("FAILED: peak extra memory %.2f MiB >= 64 MiB\n", extra_mib);
    return 1;
  }
  std::printf("OK: peak extra memory < 64 MiB (naive would need %.1f GiB of scores)\n",
              lf * lf * 4 / (1024.0 * 1024.0 * 1024.0));
  return 0;
}
