// PagedKVCache: attention over pages against KVCache holding the same tokens contiguously
// (bit for bit when the page size is a multiple of the decode key block, within rounding
// otherwise), for every storage format, page sizes 1 to 128, pages taken in a shuffled
// order, ragged lengths, D != Dv and grouped-query heads; fork with copy-on-write, truncate,
// remove, the sliding-window ring, rotation and RoPE on append, and every refusal.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <attn/kv_cache.hpp>
#include <attn/paged_kv_cache.hpp>
#include <attn/quantized.hpp>
#include <attn/rope.hpp>

#include "support/heads.hpp"

namespace {

using attn::Index;
using attn_test::Heads;

/// Rows [first, first + count) of sequence b of x, as a batch of one (a view of x's memory).
template <class T>
attn::HeadsView<const T> rows_of(const Heads<T>& x, Index b, Index first, Index count) {
  attn::HeadsView<const T> view = x.cview();
  view.data += b * view.batch_stride + first * view.row_stride;
  view.batch = 1;
  view.length = count;
  return view;
}

/// Sequences of different lengths, the same tokens in a KVCache and in a PagedKVCache.
struct Case {
  Index q_heads = 8, kv_heads = 2, dim = 64, value_dim = 32, page_size = 16;
  std::vector<Index> lengths{700, 83, 130, 1100};  // each at least the longest Lq below
};

template <class S, class SV>
struct Built {
  attn::KVCache<S, SV> contiguous;
  attn::PagedKVCache<S, SV> paged;
  std::vector<Index> ids;  // the paged cache's id of batch row b
  Heads<float> k, v;       // (B, Hkv, longest, D), (B, Hkv, longest, Dv)
};

/// Appends the tokens to the paged cache in chunks of 1 to 90 tokens, the sequences taking
/// turns at random and a filler sequence grown and removed between them, so that each
/// sequence's pages come from all over the pool, in no order.
template <class S, class SV>
Built<S, SV> build(const Case& c, std::mt19937& rng,
                   attn::KVRotation rotation = attn::KVRotation::none,
                   const attn::RotaryEmbedding<float>* rotary = nullptr) {
  const auto batch = static_cast<Index>(c.lengths.size());
  const Index longest = *std::max_element(c.lengths.begin(), c.lengths.end());
  Built<S, SV> r{{batch, c.kv_heads, c.dim, c.value_dim, 0, true, rotation},
                 {c.kv_heads, c.dim, c.value_dim, c.page_size, 3, true, rotation},
                 {},
                 attn_test::random_heads<float>(batch, c.kv_heads, longest, c.dim, rng),
                 attn_test::random_heads<float>(batch, c.kv_heads, longest, c.value_dim, rng)};
  if (rotary != nullptr)
    r.contiguous.append(r.k.cview(), r.v.cview(), *rotary, c.lengths);
  else
    r.contiguous.append(r.k.cview(), r.v.cview(), c.lengths);
  for (Index b = 0; b < batch; ++b)
    r.ids.push_back(r.paged.add_sequence());
  const Index filler = r.paged.add_sequence();
  const Heads<float> filler_k = attn_test::random_heads<float>(1, c.kv_heads, 90, c.dim, rng);
  const Heads<float> filler_v = attn_test::random_heads<float>(1, c.kv_heads, 90, c.value_dim, rng);
  std::vector<Index> done(static_cast<std::size_t>(batch), 0);
  std::uniform_int_distribution<Index> chunk(1, 90);
  for (;;) {
    std::vector<Index> open;
    for (Index b = 0; b < batch; ++b) {
      if (done[static_cast<std::size_t>(b)] < c.lengths[static_cast<std::size_t>(b)])
        open.push_back(b);
    }
    if (open.empty())
      break;
    const Index b = open[std::uniform_int_distribution<std::size_t>(0, open.size() - 1)(rng)];
    auto& first = done[static_cast<std::size_t>(b)];
    const Index n = std::min(chunk(rng), c.lengths[static_cast<std::size_t>(b)] - first);
    const std::vector<Index> id{r.ids[static_cast<std::size_t>(b)]};
    if (rotary != nullptr)
      r.paged.append(id, rows_of(r.k, b, first, n), rows_of(r.v, b, first, n), *rotary);
    else
      r.paged.append(id, rows_of(r.k, b, first, n), rows_of(r.v, b, first, n));
    first += n;
    const Index f = chunk(rng);
    r.paged.append({filler}, rows_of(filler_k, 0, 0, f), rows_of(filler_v, 0, 0, f));
    if (chunk(rng) < 30) {  // give the filler's pages back, between other sequences' pages
      r.paged.remove(filler);
      REQUIRE(r.paged.add_sequence() == filler);
    }
  }
  r.paged.remove(filler);
  return r;
}

/// out of both caches for q (B, Hq, Lq, D) under `options`.
template <class S, class SV>
std::pair<Heads<float>, Heads<float>> attend_both(const Built<S, SV>& built, const Case& c,
                                                  const Heads<float>& q,
                                                  const attn::AttentionOptions<float>& options,
                                                  bool causal = true) {
  Heads<float> paged(q.b, q.h, q.l, c.value_dim), contiguous(q.b, q.h, q.l, c.value_dim);
  if (causal) {
    built.paged.attend_into(built.ids, q.cview(), paged.view(), options);
    built.contiguous.attend_into(q.cview(), contiguous.view(), options);
  } else {
    built.paged.attend_all_into(built.ids, q.cview(), paged.view(), options);
    built.contiguous.attend_all_into(q.cview(), contiguous.view(), options);
  }
  return {std::move(paged), std::move(contiguous)};
}

/// Options forcing one algorithm.
attn::AttentionOptions<float> with_algorithm(attn::Algorithm algorithm) {
  attn::AttentionOptions<float> options;
  options.algorithm = algorithm;
  return options;
}

/// Largest |a - b| / (1 + |b|).
double relative_difference(const Heads<float>& a, const Heads<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.data.size(); ++i) {
    const double d = std::abs(static_cast<double>(a.data[i]) - static_cast<double>(b.data[i]));
    worst = std::max(worst, std::isnan(d) ? INFINITY : d / (1 + std::abs(b.data[i])));
  }
  return worst;
}

/// Every page size and both kernels for one storage format: bitwise for P a multiple of the
/// decode key block (and for flash at every P: it copies the same values into its tile).
template <class S, class SV>
void check_format(std::mt19937& rng) {
  for (const Index page_size : {Index(1), Index(16), Index(64), Index(100), Index(128)}) {
    Case c;
    c.page_size = page_size;
    const Built<S, SV> built = build<S, SV>(c, rng);
    CHECK(built.paged.free_pages() < built.paged.pages());
    for (const Index q_length : {Index(1), Index(3), Index(80)}) {
      if (q_length > 1 && page_size == 1)
        continue;  // (P = 1 is slow in flash's per-row copies; its decode is checked)
      const Heads<float> q = attn_test::random_heads<float>(4, c.q_heads, q_length, c.dim, rng);
      for (const attn::Algorithm algorithm : {attn::Algorithm::decode, attn::Algorithm::flash}) {
        for (const bool causal : {true, false}) {
          attn::AttentionOptions<float> options;
          options.algorithm = algorithm;
          const auto [paged, contiguous] = attend_both(built, c, q, options, causal);
          INFO("P " << page_size << ", Lq " << q_length << ", " << attn::algorithm_name(algorithm)
                    << (causal ? ", causal" : ", attend_all"));
          if (page_size % attn::decode_key_block == 0 || algorithm == attn::Algorithm::flash)
            CHECK(paged.data == contiguous.data);
          else
            CHECK(relative_difference(paged, contiguous) < 1e-5);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("paged cache equals the contiguous cache, every format and page size", "[paged]") {
  std::mt19937 rng(801);
  SECTION("float") {
    check_format<float, float>(rng);
  }
  SECTION("half") {
    check_format<Eigen::half, Eigen::half>(rng);
  }
  SECTION("bfloat16") {
    check_format<Eigen::bfloat16, Eigen::bfloat16>(rng);
  }
  SECTION("q8_0 keys, q4_0 values") {
    check_format<attn::BlockQ8_0, attn::BlockQ4_0>(rng);
  }
  SECTION("q4_0") {
    check_format<attn::BlockQ4_0, attn::BlockQ4_0>(rng);
  }
}

TEST_CASE("paged cache in double, bit for bit with the contiguous one", "[paged]") {
  std::mt19937 rng(802);
  Case c;
  c.page_size = 64;
  c.lengths = {300, 77};
  // Double tokens built from the float ones (the build helper works in float rows).
  const Built<float, float> floats = build<float, float>(c, rng);
  attn::KVCache<double> contiguous(2, c.kv_heads, c.dim, c.value_dim, 0);
  attn::PagedKVCache<double> paged(c.kv_heads, c.dim, c.value_dim, c.page_size);
  const Heads<double> k = floats.k.cast<double>(), v = floats.v.cast<double>();
  contiguous.append(k.cview(), v.cview(), c.lengths);
  const std::vector<Index> ids{paged.add_sequence(), paged.add_sequence()};
  paged.append(ids, k.cview(), v.cview(), c.lengths);
  const Heads<double> q = attn_test::random_heads<double>(2, c.q_heads, 2, c.dim, rng);
  Heads<double> a(2, c.q_heads, 2, c.value_dim), b(2, c.q_heads, 2, c.value_dim);
  paged.attend_into(ids, q.cview(), a.view());
  attn::AttentionOptions<double> decode;
  decode.algorithm = attn::Algorithm::decode;
  contiguous.attend_into(q.cview(), b.view(), decode);
  CHECK(a.data == b.data);
}

TEST_CASE("paged cache with masks, sinks, softcap and logsumexp", "[paged]") {
  std::mt19937 rng(803);
  Case c;
  c.page_size = 64;
  const Built<float, float> built = build<float, float>(c, rng);
  const Heads<float> q = attn_test::random_heads<float>(4, c.q_heads, 2, c.dim, rng);
  const std::vector<float> sinks{0.5F, -1, 2, 0, 1, -3, 0.25F, 4};
  const std::vector<float> slopes{0.5F, 0.25F, 0.125F, 0.0625F, 0.03F, 0.02F, 0.01F, 0.005F};
  for (int variant = 0; variant < 4; ++variant) {
    attn::AttentionOptions<float> options;
    options.algorithm = attn::Algorithm::decode;
    if (variant == 0)
      options.window = {100, 0};
    if (variant == 1) {
      options.window = {37, 0};
      options.sink_tokens = 5;
    }
    if (variant == 2) {
      options.sinks = sinks;
      options.softcap = 20;
    }
    if (variant == 3)
      options.alibi_slopes = slopes;
    Heads<float> lse_paged(4, c.q_heads, 2, 1), lse_contiguous(4, c.q_heads, 2, 1);
    Heads<float> paged(4, c.q_heads, 2, c.value_dim), contiguous(4, c.q_heads, 2, c.value_dim);
    attn::AttentionOutputViews<float> out_p(paged.view()), out_c(contiguous.view());
    const auto lse_view = [](Heads<float>& x) {
      return attn::RowsView<float>{x.data.data(), x.b, x.h, x.l, x.h * x.l, x.l, nullptr};
    };
    out_p.logsumexp = lse_view(lse_paged);
    out_c.logsumexp = lse_view(lse_contiguous);
    built.paged.attend_into(built.ids, q.cview(), out_p, options);
    built.contiguous.attend_into(q.cview(), out_c, options);
    INFO("variant " << variant);
    CHECK(paged.data == contiguous.data);
    CHECK(lse_paged.data == lse_contiguous.data);
  }
  // Without the causal mask (attend_all), and the automatic choice against itself.
  const auto [all_paged, all_contiguous] =
      attend_both(built, c, q, with_algorithm(attn::Algorithm::decode), false);
  CHECK(all_paged.data == all_contiguous.data);
}

TEST_CASE("paged cache: rotation and RoPE on append equal the contiguous cache", "[paged]") {
  std::mt19937 rng(804);
  Case c;
  c.page_size = 128;
  c.lengths = {400, 129};
  attn::RopeConfig config;
  config.dim = c.dim;
  config.max_positions = 2048;
  const attn::RotaryEmbedding<float> rotary(config);
  const Built<attn::BlockQ4_0, attn::BlockQ4_0> built =
      build<attn::BlockQ4_0, attn::BlockQ4_0>(c, rng, attn::KVRotation::hadamard, &rotary);
  const Heads<float> q = attn_test::random_heads<float>(2, c.q_heads, 1, c.dim, rng);
  const auto [paged, contiguous] = attend_both(built, c, q, {});
  CHECK(paged.data == contiguous.data);
}

TEST_CASE("paged cache: fork shares pages and copies a shared page on write", "[paged]") {
  std::mt19937 rng(805);
  // Pages of 64 (a multiple of the decode key block): the results are KVCache's bit for bit.
  const Index kv_heads = 2, dim = 32, page = 64;
  const Heads<float> k = attn_test::random_heads<float>(1, kv_heads, 160, dim, rng);
  const Heads<float> v = attn_test::random_heads<float>(1, kv_heads, 160, dim, rng);
  const Heads<float> k_a = attn_test::random_heads<float>(1, kv_heads, 30, dim, rng);
  const Heads<float> v_a = attn_test::random_heads<float>(1, kv_heads, 30, dim, rng);
  const Heads<float> k_b = attn_test::random_heads<float>(1, kv_heads, 5, dim, rng);
  const Heads<float> v_b = attn_test::random_heads<float>(1, kv_heads, 5, dim, rng);
  attn::PagedKVCache<float> cache(kv_heads, dim, dim, page);
  const Index parent = cache.add_sequence();
  cache.append({parent}, rows_of(k, 0, 0, 160), rows_of(v, 0, 0, 160));  // 2.5 pages
  const Index child = cache.fork(parent);
  REQUIRE(cache.length(child) == 160);
  REQUIRE(cache.block_table(child) == cache.block_table(parent));
  for (const Index p : cache.block_table(parent))
    CHECK(cache.references(p) == 2);
  const std::vector<Index> shared = cache.block_table(parent);
  cache.append({parent}, rows_of(k_a, 0, 0, 30), rows_of(v_a, 0, 0, 30));
  cache.append({child}, rows_of(k_b, 0, 0, 5), rows_of(v_b, 0, 0, 5));
  // The full pages stay shared; the partly filled third was copied for the parent (the
  // first writer), and the child, then its only holder, wrote into it in place.
  const std::vector<Index>& a = cache.block_table(parent);
  const std::vector<Index>& b = cache.block_table(child);
  CHECK(a[0] == shared[0]);
  CHECK(a[1] == shared[1]);
  CHECK(a[2] != shared[2]);
  CHECK(b[2] == shared[2]);
  CHECK(cache.references(shared[0]) == 2);
  CHECK(cache.references(shared[2]) == 1);
  // Each equals a contiguous cache of its own tokens.
  const auto expect = [&](Index id, const Heads<float>& k2, const Heads<float>& v2, Index n) {
    attn::KVCache<float> alone(1, kv_heads, dim, dim, 0);
    alone.append(rows_of(k, 0, 0, 160), rows_of(v, 0, 0, 160));
    alone.append(rows_of(k2, 0, 0, n), rows_of(v2, 0, 0, n));
    const Heads<float> q = attn_test::random_heads<float>(1, 4, 1, dim, rng);
    Heads<float> x(1, 4, 1, dim), y(1, 4, 1, dim);
    const attn::AttentionOptions<float> decode = with_algorithm(attn::Algorithm::decode);
    cache.attend_into({id}, q.cview(), x.view(), decode);
    alone.attend_into(q.cview(), y.view(), decode);
    CHECK(x.data == y.data);
  };
  expect(parent, k_a, v_a, 30);
  expect(child, k_b, v_b, 5);
  // Removing both gives every page back.
  cache.remove(parent);
  cache.remove(child);
  CHECK(cache.free_pages() == cache.pages());
  CHECK_FALSE(cache.contains(parent));
}

TEST_CASE("paged cache: truncate equals a cache never appended past n", "[paged]") {
  std::mt19937 rng(806);
  const Index kv_heads = 2, dim = 32, page = 64, total = 400;  // 7 pages, the last partly filled
  const Heads<float> k = attn_test::random_heads<float>(1, kv_heads, total, dim, rng);
  const Heads<float> v = attn_test::random_heads<float>(1, kv_heads, total, dim, rng);
  const Heads<float> k2 = attn_test::random_heads<float>(1, kv_heads, 20, dim, rng);
  const Heads<float> v2 = attn_test::random_heads<float>(1, kv_heads, 20, dim, rng);
  for (const Index n : {Index(0), Index(64), Index(150), total}) {
    attn::PagedKVCache<float> cache(kv_heads, dim, dim, page);
    const Index id = cache.add_sequence();
    const Index sibling = cache.fork(id);  // shares nothing yet; later shares after a fork
    cache.append({id}, rows_of(k, 0, 0, total), rows_of(v, 0, 0, total));
    cache.remove(sibling);
    const Index twin = cache.fork(id);  // shares all 7 pages
    cache.truncate(id, n);
    CHECK(cache.length(id) == n);
    CHECK(static_cast<Index>(cache.block_table(id).size()) == (n + page - 1) / page);
    cache.append({id}, rows_of(k2, 0, 0, 20), rows_of(v2, 0, 0, 20));
    attn::KVCache<float> alone(1, kv_heads, dim, dim, 0);
    alone.append(rows_of(k, 0, 0, n), rows_of(v, 0, 0, n));
    alone.append(rows_of(k2, 0, 0, 20), rows_of(v2, 0, 0, 20));
    const Heads<float> q = attn_test::random_heads<float>(1, 4, 1, dim, rng);
    Heads<float> x(1, 4, 1, dim), y(1, 4, 1, dim), t(1, 4, 1, dim), u(1, 4, 1, dim);
    const attn::AttentionOptions<float> decode = with_algorithm(attn::Algorithm::decode);
    cache.attend_into({id}, q.cview(), x.view(), decode);
    alone.attend_into(q.cview(), y.view(), decode);
    INFO("n " << n);
    CHECK(x.data == y.data);
    // The twin still holds the first tokens untouched.
    attn::KVCache<float> full(1, kv_heads, dim, dim, 0);
    full.append(rows_of(k, 0, 0, total), rows_of(v, 0, 0, total));
    cache.attend_into({twin}, q.cview(), t.view(), decode);
    full.attend_into(q.cview(), u.view(), decode);
    CHECK(t.data == u.data);
  }
}

TEST_CASE("paged cache: the sliding-window ring keeps the pool bounded", "[paged]") {
  std::mt19937 rng(807);
  // Pages of 64 (a multiple of the decode key block): the results are KVCache's bit for bit.
  const Index kv_heads = 2, dim = 32, page = 64, window = 100, steps = 600;
  for (const Index sink_tokens : {Index(0), Index(4)}) {
    const Heads<float> k = attn_test::random_heads<float>(1, kv_heads, steps, dim, rng);
    const Heads<float> v = attn_test::random_heads<float>(1, kv_heads, steps, dim, rng);
    attn::PagedKVCache<float> ring(kv_heads, dim, dim, page);
    attn::KVCache<float> full(1, kv_heads, dim, dim, 0);
    const Index id = ring.add_sequence();
    attn::AttentionOptions<float> options;
    options.algorithm = attn::Algorithm::decode;
    options.window = {window, 0};
    options.sink_tokens = sink_tokens;
    Index most_pages = 0;
    for (Index t = 0; t < steps; ++t) {
      ring.append({id}, rows_of(k, 0, t, 1), rows_of(v, 0, t, 1));
      full.append(rows_of(k, 0, t, 1), rows_of(v, 0, t, 1));
      const Heads<float> q = attn_test::random_heads<float>(1, 4, 1, dim, rng);
      Heads<float> x(1, 4, 1, dim), y(1, 4, 1, dim);
      ring.attend_into({id}, q.cview(), x.view(), options);
      full.attend_into(q.cview(), y.view(), options);
      if (x.data != y.data)
        FAIL("step " << t << ", sink tokens " << sink_tokens);
      ring.release_outside_window(id, window, sink_tokens);
      most_pages = std::max(most_pages, ring.pages() - ring.free_pages());
    }
    INFO("sink tokens " << sink_tokens);
    // The window (101 keys) spans at most 3 pages of 64, plus the sink page.
    CHECK(most_pages <= 3 + (sink_tokens > 0 ? 1 : 0));
    CHECK(ring.pages() <= 8);
    // A wider window would see released pages: refused, the outputs unchanged.
    const Heads<float> q = attn_test::random_heads<float>(1, 4, 1, dim, rng);
    Heads<float> x(1, 4, 1, dim);
    std::fill(x.data.begin(), x.data.end(), 7.0F);
    options.window = {2 * window, 0};
    CHECK_THROWS_WITH(ring.attend_into({id}, q.cview(), x.view(), options),
                      Catch::Contains("PagedKVCache::attend") && Catch::Contains("released"));
    CHECK(std::all_of(x.data.begin(), x.data.end(), [](float e) { return e == 7.0F; }));
  }
}

TEST_CASE("paged cache refuses bad input and leaves itself unchanged", "[paged][errors]") {
  std::mt19937 rng(808);
  using Cache = attn::PagedKVCache<float>;
  CHECK_THROWS_WITH(Cache(2, 32, 32, 0),
                    Catch::Contains("PagedKVCache") && Catch::Contains("page_size 0"));
  CHECK_THROWS_WITH(Cache(0, 32, 32, 16), Catch::Contains("PagedKVCache"));
  CHECK_THROWS_WITH((attn::PagedKVCache<attn::BlockQ8_0, attn::BlockQ8_0>(2, 48, 32, 16)),
                    Catch::Contains("PagedKVCache") && Catch::Contains("multiple of 32"));
  Cache cache(2, 32, 32, 16, 2, false);
  const Index id = cache.add_sequence();
  const Heads<float> k = attn_test::random_heads<float>(1, 2, 40, 32, rng);
  const Heads<float> v = attn_test::random_heads<float>(1, 2, 40, 32, rng);
  cache.append({id}, rows_of(k, 0, 0, 20), rows_of(v, 0, 0, 20));
  const std::vector<Index> table = cache.block_table(id);
  const auto unchanged = [&] {
    CHECK(cache.length(id) == 20);
    CHECK(cache.block_table(id) == table);
    CHECK(cache.free_pages() == 0);
    CHECK(cache.sequences() == std::vector<Index>{id});
  };
  CHECK_THROWS_WITH(cache.fork(5), Catch::Contains("PagedKVCache::fork") &&
                                       Catch::Contains("sequence 5 is not in the cache"));
  CHECK_THROWS_WITH(cache.truncate(id, 21), Catch::Contains("PagedKVCache::truncate") &&
                                                Catch::Contains("cannot truncate it to 21"));
  CHECK_THROWS_WITH(cache.truncate(id, -1), Catch::Contains("PagedKVCache::truncate"));
  CHECK_THROWS_WITH(cache.remove(-1), Catch::Contains("PagedKVCache::remove"));
  CHECK_THROWS_WITH(cache.length(3), Catch::Contains("PagedKVCache::length"));
  CHECK_THROWS_WITH(cache.references(2), Catch::Contains("PagedKVCache::references") &&
                                             Catch::Contains("page 2 is outside the pool of 2"));
  CHECK_THROWS_WITH(cache.release_outside_window(id, -1),
                    Catch::Contains("PagedKVCache::release_outside_window"));
  // The pool is full (2 pages of 16 hold the 20 tokens) and may not grow.
  CHECK_THROWS_WITH(cache.append({id}, rows_of(k, 0, 20, 20), rows_of(v, 0, 20, 20)),
                    Catch::Contains("PagedKVCache::append") && Catch::Contains("allow_growth"));
  CHECK_THROWS_WITH(cache.append({id, id}, k.cview(), v.cview()),
                    Catch::Contains("sequences has 2 ids but the batch size is 1"));
  CHECK_THROWS_WITH(cache.append({7}, rows_of(k, 0, 20, 1), rows_of(v, 0, 20, 1)),
                    Catch::Contains("sequence 7 is not in the cache"));
  const Heads<float> wide = attn_test::random_heads<float>(1, 2, 4, 64, rng);
  CHECK_THROWS_WITH(cache.append({id}, wide.cview(), rows_of(v, 0, 0, 4)),
                    Catch::Contains("PagedKVCache::append") && Catch::Contains("head dims differ"));
  unchanged();
  // attend: ids, shapes, the cache's own mask options, weights, algorithms.
  const Heads<float> q = attn_test::random_heads<float>(1, 4, 1, 32, rng);
  Heads<float> out(1, 4, 1, 32);
  std::fill(out.data.begin(), out.data.end(), 3.0F);
  CHECK_THROWS_WITH(cache.attend_into({9}, q.cview(), out.view()),
                    Catch::Contains("PagedKVCache::attend") && Catch::Contains("sequence 9"));
  const Heads<float> q2 = attn_test::random_heads<float>(2, 4, 1, 32, rng);
  Heads<float> out2(2, 4, 1, 32);
  const Index other = cache.add_sequence();
  CHECK_THROWS_WITH(cache.attend_into({id, id}, q2.cview(), out2.view()),
                    Catch::Contains("sequence 0 is listed twice"));
  CHECK_THROWS_WITH(cache.attend_into({id, other}, q2.cview(), out2.view()),
                    Catch::Contains("holds only 0 tokens"));
  cache.remove(other);
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::top_left;
  CHECK_THROWS_WITH(cache.attend_into({id}, q.cview(), out.view(), causal),
                    Catch::Contains("options.causal"));
  CHECK_THROWS_WITH(
      cache.attend_into({id}, q.cview(), out.view(), with_algorithm(attn::Algorithm::naive)),
      Catch::Contains("decode or the flash kernel"));
  Heads<float> weights(1, 4, 1, 20);
  attn::AttentionOutputViews<float> with_weights(out.view());
  with_weights.weights = weights.view();
  CHECK_THROWS_WITH(cache.attend_into({id}, q.cview(), with_weights),
                    Catch::Contains("weights are not available from a paged cache"));
  const Heads<float> q_wrong = attn_test::random_heads<float>(1, 3, 1, 32, rng);
  Heads<float> out_wrong(1, 3, 1, 32);
  CHECK_THROWS_WITH(cache.attend_into({id}, q_wrong.cview(), out_wrong.view()),
                    Catch::Contains("PagedKVCache::attend"));
  CHECK(std::all_of(out.data.begin(), out.data.end(), [](float e) { return e == 3.0F; }));
  unchanged();
}
