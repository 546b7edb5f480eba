// Document masking with a mask_mod and a BlockMask (attn/mods.hpp, attn/block_mask.hpp):
// 32 documents of different lengths packed into one sequence of T = 32768 tokens, each
// token attending causally within its own document, one head, D = 64 (float).
//
// The mask is the gallery's document mask combined with its causal mask, classified once
// into 128 x 128 blocks (256 x 256 blocks: 64 KiB) and reused for every call; a dense
// (T, T) keep-mask would take 1 GiB. Prints the block classes, the time of building them and
// of the attention, and the peak extra memory (the growth of the resident set, getrusage,
// after the inputs are allocated and touched); checks the result against the same documents
// as packed sequences (scaled_dot_product_attention_into on packed_view()s, causal). Exits
// non-zero if they differ by more than 1e-5 or the peak extra memory reaches 16 MiB.
// ATTN_DOCUMENT_MASK_TOKENS runs another T (the sanitizer build uses 4096).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <attn/attention.hpp>
#include <attn/block_mask.hpp>
#include <attn/mod_gallery.hpp>

namespace {

long max_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;  // KiB on Linux
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main() {
  using attn::Index;
  const char* env = std::getenv("ATTN_DOCUMENT_MASK_TOKENS");
  const Index tokens = env != nullptr ? std::atol(env) : 32768;
  const Index documents = 32, dim = 64;

  // Document lengths from 1/2 to 3/2 of the mean, summing to T; ids per token.
  std::mt19937 rng(7u);
  std::vector<Index> offsets{0};
  for (Index d = 0; d < documents - 1; ++d) {
    std::uniform_int_distribution<Index> length(tokens / documents / 2, 3 * tokens / documents / 2);
    offsets.push_back(offsets.back() + length(rng));
  }
  offsets.push_back(tokens);
  std::vector<Index> ids(static_cast<std::size_t>(tokens));
  for (Index d = 0; d < documents; ++d) {
    std::fill(ids.begin() + offsets[static_cast<std::size_t>(d)],
              ids.begin() + offsets[static_cast<std::size_t>(d + 1)], d);
  }

  const auto n = static_cast<std::size_t>(tokens * dim);
  std::vector<float> q(n), k(n), v(n), out(n, 0.0f), packed_out(n, 0.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::vector<float>* t : {&q, &k, &v})
    for (float& x : *t)
      x = normal(rng);
  const auto in = [&](const std::vector<float>& x) {
    return attn::bhld_view(x.data(), Index(1), Index(1), tokens, dim);
  };
  const long before = max_rss_kib();

  auto start = std::chrono::steady_clock::now();
  attn::AttentionOptions<float> options;
  options.block_mask = attn::BlockMask(
      attn::MaskMod(attn::gallery::all_of(attn::gallery::document(ids), attn::gallery::causal())),
      1, 1, tokens, tokens);
  const double build_seconds = seconds_since(start);

  start = std::chrono::steady_clock::now();
  attn::scaled_dot_product_attention_into<float>(
      in(q), in(k), in(v), attn::bhld_view(out.data(), Index(1), Index(1), tokens, dim), options);
  const double seconds = seconds_since(start);
  const double extra_mib = static_cast<double>(max_rss_kib() - before) / 1024.0;

  // The same documents as packed sequences, causal within each: positions within a
  // document are the same as the mask_mod sees them here, since a document's tokens are
  // consecutive.
  attn::AttentionOptions<float> packed;
  packed.causal = attn::Causal::top_left;
  const auto tokens_view = [&](const std::vector<float>& x) {  // (T, 1, D), packed
    return attn::packed_view(attn::blhd_view(x.data(), Index(1), tokens, Index(1), dim), offsets);
  };
  attn::scaled_dot_product_attention_into<float>(
      tokens_view(q), tokens_view(k), tokens_view(v),
      attn::packed_view(attn::blhd_view(packed_out.data(), Index(1), tokens, Index(1), dim),
                        offsets),
      packed);
  float difference = 0.0f;
  for (std::size_t x = 0; x < n; ++x)
    difference = std::max(difference, std::abs(out[x] - packed_out[x]));

  double pairs = 0;  // visible (query, key) pairs
  for (Index d = 0; d < documents; ++d) {
    const auto length = static_cast<double>(offsets[static_cast<std::size_t>(d + 1)] -
                                            offsets[static_cast<std::size_t>(d)]);
    pairs += length * (length + 1) / 2;
  }
  const double dense_mib = static_cast<double>(tokens) * static_cast<double>(tokens) / 1048576.0;
  std::printf("%ld documents causal within each, T = %ld, one head, D = %ld, float\n",
              static_cast<long>(documents), static_cast<long>(tokens), static_cast<long>(dim));
  std::printf("%s\n", options.block_mask.describe().c_str());
  std::printf("block mask: %zu bytes, built in %.3f s (a dense keep-mask: %.0f MiB)\n",
              options.block_mask.bytes(), build_seconds, dense_mib);
  std::printf("attention: %.3f s, %.1f GFLOP/s over the visible pairs (%.1f%% of all)\n", seconds,
              4.0 * pairs * static_cast<double>(dim) / seconds / 1e9,
              100.0 * pairs / (static_cast<double>(tokens) * static_cast<double>(tokens)));
  std::printf("peak extra memory: %.2f MiB; largest difference from packed sequences: %.3g\n",
              extra_mib, static_cast<double>(difference));
  bool ok = true;
  if (!(difference <= 1e-5f)) {
    std::printf("FAILED: the block-masked attention differs from the packed sequences\n");
    ok = false;
  }
  if (extra_mib >= 16.0) {
    std::printf("FAILED: peak extra memory %.2f MiB >= 16 MiB\n", extra_mib);
    ok = false;
  }
  if (ok)
    std::printf("OK\n");
  return ok ? 0 : 1;
}
