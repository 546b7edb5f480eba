// MultiHeadAttention::forward_incremental over a PagedKVCache: the padded overload against
// the KVCache overload (bit for bit when the page size is a multiple of the decode key
// block, within rounding otherwise; every module scalar, a quantized cache, pages shuffled,
// grouped-query heads, RoPE), the packed overload with ragged counts against each sequence
// stepped alone (the layer's batch invariance), forked sequences against caches that hold
// the whole prompt, check_attend, and every refusal leaving the cache as it was.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <attn/kv_cache.hpp>
#include <attn/multihead.hpp>
#include <attn/paged_kv_cache.hpp>
#include <attn/quantized.hpp>

#include "support/isa_cases.hpp"

namespace {

using attn::Index;
using Catch::Contains;

/// E = 64, four query heads of 16 sharing `kv_heads`, RoPE over 512 positions if `rotary`,
/// non-zero biases (so that a wrong bias path shows).
template <class T>
attn::MultiHeadAttention<T> make_module(Index kv_heads, bool rotary, Index heads = 4) {
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 64;
  config.num_heads = heads;
  config.num_kv_heads = kv_heads;
  config.seed = 7;
  if (rotary) {
    attn::RopeConfig rope;
    rope.max_positions = 512;
    config.rotary = rope;
  }
  attn::MultiHeadAttention<T> mha(config);
  auto state = mha.state_dict();
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 0.5);
  for (auto& x : state["in_proj_bias"].data)
    x = static_cast<T>(normal(rng));
  for (auto& x : state["out_proj.bias"].data)
    x = static_cast<T>(normal(rng));
  mha.load_state_dict(state);
  return mha;
}

/// A tensor of the given dimensions, N(0, 1) values rounded to T.
template <class T, class... Dims>
attn::Tensor<T, static_cast<int>(sizeof...(Dims))> random_tensor(std::mt19937& rng, Dims... dims) {
  std::normal_distribution<double> normal(0.0, 1.0);
  attn::Tensor<T, static_cast<int>(sizeof...(Dims))> x(static_cast<Index>(dims)...);
  for (Index n = 0; n < x.size(); ++n)
    x.data()[n] = static_cast<T>(normal(rng));
  return x;
}

/// Rows [first, first + count) of a (B, L, E) tensor, as (B, count, E).
template <class T>
attn::Tensor<T, 3> steps_of(const attn::Tensor<T, 3>& x, Index first, Index count) {
  attn::Tensor<T, 3> part(x.dimension(0), count, x.dimension(2));
  for (Index b = 0; b < x.dimension(0); ++b)
    for (Index t = 0; t < count; ++t)
      for (Index e = 0; e < x.dimension(2); ++e)
        part(b, t, e) = x(b, first + t, e);
  return part;
}

/// Rows [first, first + count) of a packed (T, E) tensor as a batch of one (1, count, E).
template <class T>
attn::Tensor<T, 3> batch_of(const attn::Tensor<T, 2>& x, Index first, Index count) {
  attn::Tensor<T, 3> rows(1, count, x.dimension(1));
  for (Index t = 0; t < count; ++t)
    for (Index e = 0; e < x.dimension(1); ++e)
      rows(0, t, e) = x(first + t, e);
  return rows;
}

double as_double(float x) {
  return static_cast<double>(x);
}
double as_double(double x) {
  return x;
}
double as_double(Eigen::half x) {
  return static_cast<double>(static_cast<float>(x));
}

/// Every element of `actual` equals `expected` exactly (`exact`), or within rtol of it.
template <class T, int N>
void require_close(const attn::Tensor<T, N>& actual, const attn::Tensor<T, N>& expected, bool exact,
                   double rtol) {
  REQUIRE(actual.size() == expected.size());
  for (Index n = 0; n < actual.size(); ++n) {
    const double a = as_double(actual.data()[n]), e = as_double(expected.data()[n]);
    if (exact)
      REQUIRE(a == e);
    else
      REQUIRE(std::abs(a - e) <= rtol * std::max(std::abs(e), 1.0));
  }
}

/// Whether a row of a call is computed exactly as in a call of other rows: attn's own float
/// GEMM (AVX2, AVX-512) sums every output in one fixed chain whatever the row count; Eigen's
/// products, which the generic path and double run, choose their kernels by shape.
template <class T>
bool rows_are_batch_invariant() {
  return std::is_same_v<T, float> && attn::active_isa() != attn::Isa::generic;
}

/// Appends `count` random rows to the filler sequence of `cache`: the layer's sequences then
/// take their pages from all over the pool.
template <class S>
void grow_filler(attn::PagedKVCache<S>& cache, Index filler, Index count, std::mt19937& rng) {
  const Index kv_heads = cache.kv_heads(), d = cache.dim();
  const auto k = random_tensor<float>(rng, 1, kv_heads, count, d);
  const auto v = random_tensor<float>(rng, 1, kv_heads, count, d);
  cache.append({filler}, k, v);
}

// --- the padded overload against the KVCache overload ---------------------------------------

/// Three sequences fed in steps of 70, 1, 1, 3, 1, 60 and 1 tokens through both overloads,
/// batch row b being paged sequence ids[b] (ids permuted, pages interleaved with a filler's).
template <class T, class S = T>
void paged_steps_equal_contiguous_steps(const attn::MultiHeadAttention<T>& mha, Index page_size,
                                        bool exact, double rtol) {
  const Index batch = 3, kv_heads = mha.num_kv_heads(), d = mha.head_dim();
  const std::vector<Index> steps{70, 1, 1, 3, 1, 60, 1};
  std::mt19937 rng(static_cast<unsigned>(page_size));
  const auto x = random_tensor<T>(rng, batch, 137, 64);
  attn::KVCache<S> contiguous(batch, kv_heads, d, d, 0);
  attn::PagedKVCache<S> paged(kv_heads, d, d, page_size, 1);
  const Index filler = paged.add_sequence();
  std::vector<Index> ids;
  for (Index b = 0; b < batch; ++b)
    ids.push_back(paged.add_sequence());
  std::swap(ids[0], ids[2]);
  std::uniform_int_distribution<Index> filler_rows(1, 40);
  Index t0 = 0;
  for (const Index n : steps) {
    INFO("page size " << page_size << ", tokens [" << t0 << ", " << t0 + n << ")");
    grow_filler(paged, filler, filler_rows(rng), rng);
    const attn::Tensor<T, 3> part = steps_of(x, t0, n);
    const attn::Tensor<T, 3> want = mha.forward_incremental(part, contiguous);
    const attn::Tensor<T, 3> got = mha.forward_incremental(part, paged, ids);
    require_close(got, want, exact, rtol);
    t0 += n;
    for (Index b = 0; b < batch; ++b)
      REQUIRE(paged.length(ids[static_cast<std::size_t>(b)]) == t0);
  }
}

template <class T>
void paged_forward_incremental_equals_the_kvcache_overload() {
  const double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  for (const Index kv_heads : {2, 1}) {
    for (const bool rotary : {true, false}) {
      const attn::MultiHeadAttention<T> mha = make_module<T>(kv_heads, rotary);
      INFO("Hkv " << kv_heads << ", rotary " << rotary);
      // Pages of a multiple of 64 keys: decode cuts its key blocks where it does on the
      // contiguous cache, flash reads the same tiles: the same bits.
      for (const Index page : {64, 128})
        paged_steps_equal_contiguous_steps(mha, page, true, 0);
      // Other page sizes: decode cuts blocks at page ends too, so the sums round differently.
      for (const Index page : {1, 16, 100})
        paged_steps_equal_contiguous_steps(mha, page, false, rtol);
    }
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "forward_incremental over a PagedKVCache equals the KVCache overload",
    "[paged_kv_cache][multihead]", paged_forward_incremental_equals_the_kvcache_overload)

TEST_CASE("forward_incremental over a PagedKVCache: a half module, a quantized cache",
          "[paged_kv_cache][multihead][isa]") {
  // A half module widens its queries and rounds its output once, as over a KVCache.
  paged_steps_equal_contiguous_steps<Eigen::half, float>(make_module<Eigen::half>(2, true), 64,
                                                         true, 0);
  // q8_0 blocks (D = 32: two heads of 32 sharing one kv head) in pages and contiguous.
  paged_steps_equal_contiguous_steps<float, attn::BlockQ8_0>(make_module<float>(1, true, 2), 64,
                                                             true, 0);
}

// --- the packed overload: ragged counts in one call ------------------------------------------

namespace {

/// Five sequences with histories of different lengths, then one call of counts 9, 1, 0, 1
/// and 20 (a prompt chunk and single tokens side by side) against each sequence stepped alone
/// through the padded overload on a twin cache: the same bits where the GEMM rows do not
/// depend on the call (rows_are_batch_invariant), within rounding otherwise.
template <class T>
void ragged_counts_in_one_call_equal_each_sequence_alone() {
  const double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  const bool exact = rows_are_batch_invariant<T>();
  const attn::MultiHeadAttention<T> mha = make_module<T>(2, true);
  std::mt19937 rng(5);
  attn::PagedKVCache<T> together(2, 16, 16, 64), alone(2, 16, 16, 64);
  std::vector<Index> ids;
  for (const Index history : {40, 3, 70, 1, 130}) {
    const Index a = together.add_sequence();
    REQUIRE(alone.add_sequence() == a);
    ids.push_back(a);
    const auto x = random_tensor<T>(rng, 1, history, 64);
    mha.forward_incremental(x, together, {a});
    mha.forward_incremental(x, alone, {a});
  }
  const std::vector<Index> order{ids[3], ids[0], ids[4], ids[1], ids[2]};
  const std::vector<Index> counts{9, 1, 0, 1, 20};
  std::vector<Index> cu{0};
  for (const Index n : counts)
    cu.push_back(cu.back() + n);
  const auto x = random_tensor<T>(rng, cu.back(), 64);
  const attn::Tensor<T, 2> y = mha.forward_incremental(x, together, order, cu);
  REQUIRE(y.dimension(0) == 31);
  for (std::size_t b = 0; b < order.size(); ++b) {
    INFO("sequence " << order[b] << ", " << counts[b] << " new tokens");
    const attn::Tensor<T, 3> want =
        mha.forward_incremental(batch_of(x, cu[b], counts[b]), alone, {order[b]});
    require_close(batch_of(y, cu[b], counts[b]), want, exact, rtol);
    REQUIRE(together.length(order[b]) == alone.length(order[b]));
  }
}

}  // namespace

ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(
    "forward_incremental over a PagedKVCache: ragged counts in one call equal each sequence "
    "alone",
    "[paged_kv_cache][multihead]", ragged_counts_in_one_call_equal_each_sequence_alone)

TEST_CASE("forward_incremental over a PagedKVCache: forks of a prompt equal whole prompts",
          "[paged_kv_cache][multihead][isa]") {
  // A prompt of 40 tokens (a partly filled page of 64) forked twice; the three sequences
  // then take different tokens in one packed call (copy-on-write of the shared page), each
  // against a KVCache that was given the prompt and its own tokens in the same steps.
  const attn::MultiHeadAttention<float> mha = make_module<float>(2, true);
  const bool exact = rows_are_batch_invariant<float>();
  std::mt19937 rng(9);
  const auto prompt = random_tensor<float>(rng, 1, 40, 64);
  attn::PagedKVCache<float> paged(2, 16, 16, 64);
  const Index parent = paged.add_sequence();
  mha.forward_incremental(prompt, paged, {parent});
  const Index first = paged.fork(parent), second = paged.fork(parent);
  REQUIRE(paged.references(paged.block_table(parent)[0]) == 3);
  const std::vector<Index> counts{1, 3, 2};
  const auto x = random_tensor<float>(rng, 6, 64);
  const attn::Tensor<float, 2> y =
      mha.forward_incremental(x, paged, {second, parent, first}, {0, 1, 4, 6});
  REQUIRE(paged.references(paged.block_table(parent)[0]) == 1);  // each holds its own copy
  Index row = 0;
  for (const Index n : counts) {
    attn::KVCache<float> whole(1, 2, 16, 16, 0);
    mha.forward_incremental(prompt, whole);
    const attn::Tensor<float, 3> want = mha.forward_incremental(batch_of(x, row, n), whole);
    require_close(batch_of(y, row, n), want, exact, 1e-5);
    row += n;
  }
  REQUIRE(paged.length(parent) == 43);
  REQUIRE(paged.length(first) == 42);
  REQUIRE(paged.length(second) == 41);
}

// --- refusals ------------------------------------------------------------------------------

namespace {

/// What a throw must leave as it was: the ids, lengths, block tables, pool and reference
/// counts, and what the sequences' tokens give an attend.
struct Snapshot {
  std::vector<Index> ids, lengths, free;
  std::vector<std::vector<Index>> tables;
  std::vector<float> attended;

  static Snapshot of(const attn::PagedKVCache<float>& cache) {
    Snapshot s;
    s.ids = cache.sequences();
    for (const Index id : s.ids) {
      s.lengths.push_back(cache.length(id));
      s.tables.push_back(cache.block_table(id));
    }
    s.free.push_back(cache.pages());
    s.free.push_back(cache.free_pages());
    for (Index p = 0; p < cache.pages(); ++p)
      s.free.push_back(cache.references(p));
    std::mt19937 rng(1);
    for (const Index id : s.ids) {
      const Index length = cache.length(id);
      const auto q = random_tensor<float>(rng, 1, 4, std::min(length, Index(2)), 16);
      attn::AttentionOptions<float> recent;  // the last keys: none in a released page
      recent.window = {5, 0};
      attn::Tensor<float, 4> out(1, 4, q.dimension(2), 16);
      cache.attend_all_into({id}, attn::bhld_view(q), attn::bhld_view(out), recent);
      s.attended.insert(s.attended.end(), out.data(), out.data() + out.size());
    }
    return s;
  }
  bool operator==(const Snapshot& o) const {
    return ids == o.ids && lengths == o.lengths && free == o.free && tables == o.tables &&
           attended == o.attended;
  }
};

}  // namespace

TEST_CASE("forward_incremental over a PagedKVCache: refusals leave the cache unchanged",
          "[paged_kv_cache][multihead]") {
  const attn::MultiHeadAttention<float> mha = make_module<float>(2, true);
  std::mt19937 rng(3);
  // Pages of 16, the pool of 8 may not grow; sequence a holds 20 tokens, b (a fork of a)
  // the same pages, c 30 tokens of which the first 16 were released by a window of 8.
  attn::PagedKVCache<float> cache(2, 16, 16, 16, 8, false);
  const Index a = cache.add_sequence(), c = cache.add_sequence();
  mha.forward_incremental(random_tensor<float>(rng, 1, 20, 64), cache, {a});
  const Index b = cache.fork(a);
  mha.forward_incremental(random_tensor<float>(rng, 1, 30, 64), cache, {c});
  cache.release_outside_window(c, 8);
  REQUIRE(cache.block_table(c)[0] == attn::PagedKVCache<float>::released_page);
  const Snapshot before = Snapshot::of(cache);
  const auto x2 = random_tensor<float>(rng, 2, 1, 64);
  const auto x1 = random_tensor<float>(rng, 1, 1, 64);
  const auto packed = random_tensor<float>(rng, 3, 64);
  const std::string function = "MultiHeadAttention::forward_incremental: ";
  const auto unchanged = [&] { REQUIRE(Snapshot::of(cache) == before); };

  SECTION("the module, the input and the cache") {
    attn::MultiHeadAttentionConfig config = mha.config();
    config.rotary.reset();
    config.add_zero_attn = true;
    const attn::MultiHeadAttention<float> zero_attn(config);
    CHECK_THROWS_WITH(zero_attn.forward_incremental(x1, cache, {a}),
                      function +
                          "needs kdim = vdim = embed_dim and neither add_bias_kv nor "
                          "add_zero_attn");
    CHECK_THROWS_WITH(mha.forward_incremental(random_tensor<float>(rng, 1, 1, 32), cache, {a}),
                      function + "x_new is [1, 1, 32] but embed_dim is 64: widths differ");
    CHECK_THROWS_WITH(mha.forward_incremental(random_tensor<float>(rng, 3, 32), cache, {a}, {0, 3}),
                      function + "x_new is [3, 32] but embed_dim is 64: widths differ");
    attn::PagedKVCache<float> four_heads(4, 16, 16, 16);
    four_heads.add_sequence();
    CHECK_THROWS_WITH(mha.forward_incremental(x1, four_heads, {0}),
                      function +
                          "the cache is (Hkv, D, Dv) = [4, 16, 16] but the module's is "
                          "[2, 16, 16]");
    REQUIRE(four_heads.length(0) == 0);
    unchanged();
  }
  SECTION("the sequences") {
    CHECK_THROWS_WITH(mha.forward_incremental(x2, cache, {a}),
                      function + "sequences has 1 ids but the batch size is 2");
    CHECK_THROWS_WITH(mha.forward_incremental(x2, cache, {a, 9}),
                      Contains(function + "sequence 9 is not in the cache (live ids: [0, 1, 2])"));
    CHECK_THROWS_WITH(mha.forward_incremental(x2, cache, {b, b}),
                      Contains(function) && Contains("sequence 2 is listed twice"));
    unchanged();
  }
  SECTION("cu_seqlens") {
    CHECK_THROWS_WITH(mha.forward_incremental(packed, cache, {a, b}, {1, 2, 3}),
                      Contains(function + "cu_seqlens is [1, 2, 3]") && Contains("starting at 0"));
    CHECK_THROWS_WITH(mha.forward_incremental(packed, cache, {a, b}, {0, 2, 1}),
                      Contains("offsets must not decrease"));
    CHECK_THROWS_WITH(mha.forward_incremental(packed, cache, {a, b}, {0, 1, 2}),
                      Contains("its last entry must equal the number of tokens, 3"));
    CHECK_THROWS_WITH(mha.forward_incremental(packed, cache, {a, b}, {0, 3}),
                      function +
                          "cu_seqlens is [0, 3] but sequences is [0, 2]: it must have "
                          "one entry more");
    unchanged();
  }
  SECTION("options the cache decides or a paged call cannot index") {
    attn::AttentionOptions<float> o;
    o.causal = attn::Causal::bottom_right;
    CHECK_THROWS_WITH(mha.forward_incremental(x1, cache, {a}, o), Contains("must be unset"));
    o = {};
    o.key_lengths = {1};
    CHECK_THROWS_WITH(mha.forward_incremental(x1, cache, {a}, o), Contains("must be unset"));
    const attn::Tensor<bool, 4> keep(1, 1, 1, 21);
    const attn::Tensor<float, 4> bias(1, 1, 1, 21);
    const auto refused = [&](const std::string& name, const attn::AttentionOptions<float>& with) {
      CHECK_THROWS_WITH(mha.forward_incremental(x1, cache, {a}, with),
                        function + "attention." + name +
                            " is set: over a paged cache the sequences of each count of new "
                            "tokens attend in a call of their own, so a batch index names no "
                            "sequence (keep-mask, bias, mods, block mask and dropout are "
                            "refused; window, sink tokens, ALiBi, softcap, sinks and the scale "
                            "apply to all alike)");
    };
    o = {};
    o.keep_mask = keep;
    refused("keep_mask", o);
    o = {};
    o.bias = bias;
    refused("bias", o);
    const attn::MaskMod everything([](Index, Index, Index, Index) { return true; });
    o = {};
    o.mask_mod = everything;
    refused("mask_mod", o);
    o = {};
    o.block_mask = attn::BlockMask(everything, 1, 1, 1, 21);
    refused("block_mask", o);
    o = {};
    o.score_mod = attn::ScoreMod<float>([](float s, Index, Index, Index, Index) { return s; });
    refused("score_mod", o);
    o = {};
    o.dropout_p = 0.1F;
    refused("dropout_p", o);
    unchanged();
  }
  SECTION("attention options the kernels refuse, checked before the append") {
    attn::AttentionOptions<float> o;
    o.algorithm = attn::Algorithm::naive;
    CHECK_THROWS_WITH(mha.forward_incremental(x1, cache, {a}, o),
                      Contains(function) && Contains("decode or the flash kernel"));
    o = {};
    o.window = {-2, 0};
    CHECK_THROWS_WITH(mha.forward_incremental(x1, cache, {a}, o),
                      Contains(function) && Contains("each side must be >= -1"));
    o = {};
    o.sinks = {0.5F};
    CHECK_THROWS_WITH(mha.forward_incremental(x1, cache, {a}, o),
                      function + "sinks has 1 entries but there are 4 query heads");
    o = {};
    o.alibi_slopes = {1.0F, 2.0F};
    CHECK_THROWS_WITH(mha.forward_incremental(x1, cache, {a}, o),
                      Contains("alibi_slopes has 2 entries but there are 4 query heads"));
    // The window has released c's first page: a query without one would see it.
    CHECK_THROWS_WITH(mha.forward_incremental(x1, cache, {c}),
                      Contains(function + "sequence 1: query 0 would see keys [0, 31)") &&
                          Contains("were released"));
    // In a packed call c's check fails before a's and b's tokens are appended.
    CHECK_THROWS_WITH(mha.forward_incremental(packed, cache, {a, b, c}, {0, 1, 2, 3}),
                      Contains("were released"));
    unchanged();
    o = {};
    o.window = {8, 0};  // the window that released it: accepted
    mha.forward_incremental(x1, cache, {c}, o);
    REQUIRE(cache.length(c) == 31);
  }
  SECTION("positions beyond the rotary table, a full pool") {
    attn::MultiHeadAttentionConfig config = mha.config();
    config.rotary->max_positions = 21;
    const attn::MultiHeadAttention<float> short_table(config);
    CHECK_THROWS_WITH(
        short_table.forward_incremental(random_tensor<float>(rng, 3, 64), cache, {b, a}, {0, 1, 3}),
        function +
            "sequence 0 holds 20 tokens: its 2 new tokens need rotary "
            "positions [20, 22) but the table holds [0, 21) "
            "(config.rotary->max_positions)");
    // a and b hold 2 pages, c 1 of its 2 (the first released): 5 of 8 are free. 80 tokens
    // for a need its own copy of the shared last page and 5 new ones.
    CHECK_THROWS_WITH(mha.forward_incremental(random_tensor<float>(rng, 1, 80, 64), cache, {a}),
                      Contains("PagedKVCache::append") && Contains("needs 6 free pages") &&
                          Contains("allow_growth is off"));
    unchanged();
  }
}

TEST_CASE("PagedKVCache::check_attend", "[paged_kv_cache]") {
  std::mt19937 rng(2);
  attn::PagedKVCache<float> cache(2, 16, 16, 16);
  const Index a = cache.add_sequence(), b = cache.add_sequence();
  cache.append({a, b}, random_tensor<float>(rng, 2, 2, 40, 16),
               random_tensor<float>(rng, 2, 2, 40, 16), {40, 3});
  cache.release_outside_window(a, 8);
  attn::AttentionOptions<float> window;
  window.window = {8, 0};
  const char* f = "Caller";
  // What attend_into would accept, it accepts; with tokens still to come, their queries
  // count: the window of 8 released a's tokens [0, 32), which the query of a's next token
  // does not see, but the query of its last one (position 39) would.
  CHECK_NOTHROW(cache.check_attend(f, {a, b}, 4, 1, window, {1, 1}));
  CHECK_NOTHROW(cache.check_attend(f, {b}, 4, 5, {}, {2}));
  CHECK_THROWS_WITH(cache.check_attend(f, {a}, 4, 1, window),
                    Contains("Caller: sequence 0: query 0 would see keys [31, 40)"));
  CHECK_THROWS_WITH(cache.check_attend(f, {b}, 4, 5, {}),
                    "Caller: q is [1, 4, 5, 16]: 5 queries but sequence 1 holds only 3 tokens "
                    "(append the new tokens first)");
  CHECK_THROWS_WITH(cache.check_attend(f, {a}, 4, 1, {}, {1}),
                    Contains("Caller: sequence 0: query 0 would see keys [0, 41)"));
  CHECK_THROWS_WITH(cache.check_attend(f, {a, 5}, 4, 1, window),
                    Contains("Caller: sequence 5 is not in the cache"));
  CHECK_THROWS_WITH(cache.check_attend(f, {a}, 4, 1, window, {1, 1}),
                    "Caller: added has 2 entries but there are 1 sequences");
  CHECK_THROWS_WITH(cache.check_attend(f, {a}, 0, 1, window),
                    "Caller: q_heads is 0, q_length 1 and added []: q_heads must be positive, "
                    "the others >= 0");
  CHECK_THROWS_WITH(cache.check_attend(f, {a}, 4, 1, window, {-1}), Contains("added [-1]"));
  attn::AttentionOptions<float> naive = window;
  naive.algorithm = attn::Algorithm::naive;
  CHECK_THROWS_WITH(cache.check_attend(f, {a}, 4, 1, naive, {1}),
                    Contains("Caller: options.algorithm is naive"));
  REQUIRE(cache.length(a) == 40);
}
