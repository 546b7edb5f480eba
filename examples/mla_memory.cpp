// MLA's latent cache in memory: N tokens of DeepSeek's attention (C = 512, R = 64) held as
// latents in a LatentCache (C + R values a token, V read from the keys' rows), then the same
// tokens in an ordinary PagedKVCache that keeps K (C + R) and V (C) apart, each measured as
// the growth of the peak resident set (getrusage). Prints both next to what their sizes
// predict, and the un-absorbed heads' cache (H (192 + 128) values a token) for scale; exits
// non-zero if the latent cache's growth is not within 5% (+ 1 MiB) of (C + R) values a token,
// or if it is not at least 1.8x smaller than the K and V cache. ATTN_MLA_MEMORY_TOKENS
// changes N (default 32768).
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <vector>

#include <attn/latent_cache.hpp>
#include <attn/paged_kv_cache.hpp>

namespace {

using attn::Index;

long max_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;  // KiB on Linux
}

constexpr Index latent = 512, rope = 64, page = 64, chunk = 1024;

/// Peak RSS growth (MiB) over `base` once a cache of `tokens` tokens has lived: `make` builds
/// it with every page reserved (one allocation), `append` fills it a chunk at a time. The peak
/// is a running maximum: measure the smaller cache first (its memory is given back when it
/// goes, and the larger one's peak then covers it).
template <class Make, class Append>
double measure(long base, Index tokens, const Make& make, const Append& append) {
  {
    auto cache = make((tokens + page - 1) / page);
    const Index id = cache.add_sequence();
    for (Index t = 0; t < tokens; t += chunk)
      append(cache, id, std::min(chunk, tokens - t));
  }
  return static_cast<double>(max_rss_kib() - base) / 1024.0;
}

/// Measures and prints both caches of `tokens` tokens; returns the exit status.
int run(Index tokens) {
  // One chunk of tokens, reused for every append: c (1, 1, chunk, C), k_rope (1, 1, chunk, R)
  // and the same rows as K = [c ; k_rope] (1, 1, chunk, C + R) for the ordinary cache.
  std::vector<float> c(static_cast<std::size_t>(chunk * latent));
  std::vector<float> k_rope(static_cast<std::size_t>(chunk * rope));
  std::vector<float> k(static_cast<std::size_t>(chunk * (latent + rope)));
  std::mt19937 rng(1u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Index j = 0; j < chunk; ++j) {
    for (Index x = 0; x < latent + rope; ++x) {
      const float value = normal(rng);
      k[static_cast<std::size_t>(j * (latent + rope) + x)] = value;
      if (x < latent)
        c[static_cast<std::size_t>(j * latent + x)] = value;
      else
        k_rope[static_cast<std::size_t>(j * rope + x - latent)] = value;
    }
  }
  const auto view = [](const std::vector<float>& x, Index n, Index dim) {
    return attn::bhld_view(x.data(), Index(1), Index(1), n, dim);
  };
  const long base = max_rss_kib();  // the inputs above are allocated and touched
  const double latent_mib = measure(
      base, tokens, [](Index pages) { return attn::LatentCache<float>(latent, rope, page, pages); },
      [&](attn::LatentCache<float>& cache, Index id, Index n) {
        cache.append({id}, view(c, n, latent), view(k_rope, n, rope));
      });
  const double kv_mib = measure(
      base, tokens,
      [](Index pages) { return attn::PagedKVCache<float>(1, latent + rope, latent, page, pages); },
      [&](attn::PagedKVCache<float>& cache, Index id, Index n) {
        cache.append({id}, view(k, n, latent + rope), view(c, n, latent));
      });
  const double mib_per_value = static_cast<double>(tokens) * 4.0 / (1024.0 * 1024.0);
  const double latent_expected = (latent + rope) * mib_per_value;
  const double kv_expected = (2 * latent + rope) * mib_per_value;
  const Index heads = 16, head_values = heads * (128 + 64 + 128);  // DeepSeek-V2-Lite
  std::printf("MLA caches of %ld tokens (C = %ld, R = %ld, float, pages of %ld)\n",
              static_cast<long>(tokens), static_cast<long>(latent), static_cast<long>(rope),
              static_cast<long>(page));
  std::printf("%-44s %14s %14s %18s\n", "cache", "values/token", "expected MiB",
              "peak RSS growth MiB");
  std::printf("%-44s %14ld %14.1f %18.1f\n", "LatentCache ([c ; k_rope], V in K's rows)",
              static_cast<long>(latent + rope), latent_expected, latent_mib);
  std::printf("%-44s %14ld %14.1f %18.1f\n", "PagedKVCache (K = [c ; k_rope], V = c apart)",
              static_cast<long>(2 * latent + rope), kv_expected, kv_mib);
  std::printf("%-44s %14ld %14.1f %18s\n", "un-absorbed heads (H 16: K 192, V 128)",
              static_cast<long>(head_values), head_values * mib_per_value, "(not built)");
  std::printf("K and V cache over latent cache: %.2fx\n", kv_mib / latent_mib);
  bool ok = std::abs(latent_mib - latent_expected) <= 0.05 * latent_expected + 1.0;
  ok = ok && kv_mib >= 1.8 * latent_mib;
  if (!ok)
    std::printf("FAILED: the latent cache is not (C + R) values a token\n");
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}

}  // namespace

int main() {
  const char* env = std::getenv("ATTN_MLA_MEMORY_TOKENS");
  const Index tokens = env != nullptr ? std::atol(env) : 32768;
  if (tokens < 1) {
    std::fprintf(stderr,
                 "mla_memory: ATTN_MLA_MEMORY_TOKENS is '%s': it must be a positive "
                 "number of tokens\n",
                 env);
    return EXIT_FAILURE;
  }
  try {
    return run(tokens);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mla_memory: %s\n", e.what());
    return EXIT_FAILURE;
  }
}
