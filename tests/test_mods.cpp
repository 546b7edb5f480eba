// Tests for attn/mods.hpp, attn/block_mask.hpp and attn/mod_gallery.hpp: every gallery mod
// against the torch fixtures (tests/reference/generate_mods.py) and against the built-in
// option it replaces, seeded random mask_mods and score_mods against the dense keep-mask and
// bias and the long double reference, the block classes against brute force, the tiles the
// kernels evaluate, NaN, packed sequences, the backward, and every error.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/block_mask.hpp>
#include <attn/mod_gallery.hpp>
#include <attn/mods.hpp>

#include "support/fixtures.hpp"
#include "support/reference.hpp"
#include "support/results.hpp"

using attn::Algorithm;
using attn::AttentionOptions;
using attn::BlockMask;
using attn::Index;
using attn::MaskMod;
using attn::ScoreMod;
using attn::Tensor;
using attn::TileVisibility;

namespace {

constexpr Algorithm every_algorithm[] = {Algorithm::naive, Algorithm::chunked, Algorithm::flash,
                                         Algorithm::decode};

template <class T>
std::vector<T> flat(const Tensor<T, 4>& t) {
  return std::vector<T>(t.data(), t.data() + t.size());
}

template <class T>
Tensor<T, 4> random_tensor(std::mt19937& rng, Index b, Index h, Index l, Index d) {
  Tensor<T, 4> t(b, h, l, d);
  std::uniform_real_distribution<double> u(-2, 2);
  for (Index n = 0; n < t.size(); ++n)
    t.data()[n] = static_cast<T>(u(rng));
  return t;
}

/// out of attention(q, k, v, options) with `algorithm` and small tiles (so that tiles and
/// blocks cross), and its log-sum-exp.
template <class T>
std::pair<std::vector<T>, std::vector<T>> run(const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                                              const Tensor<T, 4>& v, AttentionOptions<T> options,
                                              Algorithm algorithm) {
  options.algorithm = algorithm;
  if (options.query_tile == 0 && options.block_mask.empty()) {
    options.query_tile = 8;
    options.key_tile = 16;
  }
  Tensor<T, 3> lse;
  const Tensor<T, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q, k, v, options, attn::Return::logsumexp), nullptr, &lse);
  return {flat(out), std::vector<T>(lse.data(), lse.data() + lse.size())};
}

#define REQUIRE_CLOSE(actual, expected, rtol)                                                   \
  do {                                                                                          \
    const attn_test::Comparison comparison_ = attn_test::compare((actual), (expected), (rtol)); \
    INFO(comparison_.detail);                                                                   \
    REQUIRE(comparison_.ok);                                                                    \
  } while (false)

const char* name_of(Algorithm a) {
  return attn::algorithm_name(a);
}

}  // namespace

// --- The gallery against the torch fixtures and the built-in options -----------------

TEMPLATE_TEST_CASE("gallery mods equal the torch fixtures and the built-in options", "[mods][isa]",
                   float, double) {
  using T = TestType;
  const attn_test::json& f = attn_test::fixture("mods.json");
  const Tensor<T, 4> q = attn_test::tensor<T, 4>(f.at("q"));
  const Tensor<T, 4> k = attn_test::tensor<T, 4>(f.at("k"));
  const Tensor<T, 4> v = attn_test::tensor<T, 4>(f.at("v"));
  const Index batch = q.dimension(0), heads = q.dimension(1), length = q.dimension(2);
  const std::vector<Index> documents = f.at("documents").get<std::vector<Index>>();
  std::vector<bool> global(static_cast<std::size_t>(length), false);
  for (const Index g : f.at("global").get<std::vector<Index>>())
    global[static_cast<std::size_t>(g)] = true;
  std::vector<T> slopes;
  for (const double s : f.at("slopes").get<std::vector<double>>())
    slopes.push_back(static_cast<T>(s));
  const T cap = static_cast<T>(f.at("softcap").get<double>());
  const std::vector<T> table = attn_test::values<T>(f.at("t5_table"));

  struct Variant {
    AttentionOptions<T> mod;      // the mod, as a mask_mod / score_mod
    AttentionOptions<T> builtin;  // the built-in option, where there is one
    bool has_builtin = false;
  };
  const auto mask_variant = [&](MaskMod m) {
    Variant variant;
    variant.mod.mask_mod = std::move(m);
    return variant;
  };
  std::map<std::string, Variant> variants;
  variants["causal"] = mask_variant(MaskMod(attn::gallery::causal()));
  variants["causal"].builtin.causal = attn::Causal::top_left;
  variants["causal"].has_builtin = true;
  variants["sliding_window"] = mask_variant(MaskMod(attn::gallery::sliding_window(5, 2)));
  variants["sliding_window"].builtin.window = {5, 2};
  variants["sliding_window"].has_builtin = true;
  variants["prefix_lm"] =
      mask_variant(MaskMod(attn::gallery::prefix_lm(f.at("prefix").get<std::vector<Index>>())));
  variants["document"] = mask_variant(MaskMod(attn::gallery::document(documents)));
  variants["document_causal"] = mask_variant(
      MaskMod(attn::gallery::all_of(attn::gallery::document(documents), attn::gallery::causal())));
  variants["longformer"] = mask_variant(MaskMod(attn::gallery::global_and_window(3, global)));
  variants["alibi"].mod.score_mod = ScoreMod<T>(attn::gallery::alibi<T>(slopes));
  variants["alibi"].builtin.alibi_slopes = slopes;
  variants["alibi"].has_builtin = true;
  variants["softcap"].mod.score_mod = ScoreMod<T>(attn::gallery::softcap<T>(cap));
  variants["softcap"].builtin.softcap = cap;
  variants["softcap"].has_builtin = true;
  variants["t5_bias"].mod.score_mod =
      ScoreMod<T>(attn::gallery::t5_relative_bias<T>(table, heads, length, /*bidirectional=*/true));

  const auto& cases = ATTN_FIXTURE_CASES("mods.json", "cases", 9);
  for (const auto& c : cases) {
    const std::string name = c.at("name").template get<std::string>();
    REQUIRE(variants.count(name) == 1);
    const Variant& variant = variants.at(name);
    const std::vector<T> expected = attn_test::values<T>(c.at("out"));
    // The dense path: the mod written out as a keep-mask, or as a bias when it adds one.
    Tensor<bool, 4> keep(batch, heads, length, length);
    Tensor<T, 4> bias(batch, heads, length, length);
    AttentionOptions<T> dense;
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < heads; ++h)
        for (Index i = 0; i < length; ++i)
          for (Index j = 0; j < length; ++j) {
            keep(b, h, i, j) = !variant.mod.mask_mod || variant.mod.mask_mod(b, h, i, j);
            bias(b, h, i, j) =
                variant.mod.score_mod ? variant.mod.score_mod(T(0), b, h, i, j) : T(0);
          }
    if (variant.mod.mask_mod)
      dense.keep_mask = keep;
    const bool additive = name == "alibi" || name == "t5_bias";
    if (additive)
      dense.bias = bias;
    for (const bool blocks : {false, true}) {
      AttentionOptions<T> options = variant.mod;
      if (blocks && options.mask_mod) {  // the same mask_mod, classified in 8 x 16 blocks
        options.block_mask = BlockMask(options.mask_mod, batch, heads, length, length, 8, 16);
        options.mask_mod = MaskMod();
      }
      for (const Algorithm algorithm : every_algorithm) {
        INFO(name << (blocks ? " with a block mask" : "") << ", " << name_of(algorithm));
        const auto [out, lse] = run(q, k, v, options, algorithm);
        REQUIRE_CLOSE(out, expected, attn_test::tolerance<T>());
        if (variant.mod.mask_mod || additive) {
          const auto [dense_out, dense_lse] = run(q, k, v, dense, algorithm);
          REQUIRE_CLOSE(out, dense_out, attn_test::tolerance<T>());
          REQUIRE_CLOSE(lse, dense_lse, attn_test::tolerance<T>());
        }
        if (variant.has_builtin) {
          const auto [builtin_out, builtin_lse] = run(q, k, v, variant.builtin, algorithm);
          REQUIRE_CLOSE(out, builtin_out, attn_test::tolerance<T>());
          REQUIRE_CLOSE(lse, builtin_lse, attn_test::tolerance<T>());
        }
      }
    }
  }
}

TEST_CASE("gallery::t5_bucket equals the torch buckets", "[mods]") {
  const attn_test::json& f = attn_test::fixture("mods.json");
  const auto range = f.at("positions").get<std::vector<Index>>();
  REQUIRE(f.at("buckets").size() == 4);
  for (const auto& c : f.at("buckets")) {
    const bool bidirectional = c.at("bidirectional").get<bool>();
    const Index buckets = c.at("buckets").get<Index>(),
                distance = c.at("max_distance").get<Index>();
    const auto values = c.at("values").get<std::vector<Index>>();
    REQUIRE(static_cast<Index>(values.size()) == range[1] - range[0] + 1);
    for (Index r = range[0]; r <= range[1]; ++r) {
      INFO("relative position " << r << ", bidirectional " << bidirectional << ", buckets "
                                << buckets << ", max distance " << distance);
      REQUIRE(attn::gallery::t5_bucket(r, bidirectional, buckets, distance) ==
              values[static_cast<std::size_t>(r - range[0])]);
    }
  }
}

// --- Random mods against the dense masks and the long double reference ---------------

namespace {

/// A random (B, H, Lq, Lk) visibility with block structure: of each 8 x 8 block of pairs,
/// some all visible, some all hidden, the rest random, so that block masks of any size see
/// every class.
std::vector<char> random_visibility(std::mt19937& rng, Index batch, Index heads, Index lq,
                                    Index lk) {
  std::vector<char> keep(static_cast<std::size_t>(batch * heads * lq * lk));
  std::uniform_int_distribution<int> kind(0, 2), coin(0, 3);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      for (Index i0 = 0; i0 < lq; i0 += 8) {
        for (Index j0 = 0; j0 < lk; j0 += 8) {
          const int k = kind(rng);
          for (Index i = i0; i < std::min(i0 + 8, lq); ++i) {
            for (Index j = j0; j < std::min(j0 + 8, lk); ++j) {
              keep[static_cast<std::size_t>(((b * heads + h) * lq + i) * lk + j)] =
                  k == 0   ? 1
                  : k == 1 ? 0
                           : static_cast<char>(coin(rng) != 0);
            }
          }
        }
      }
    }
  }
  return keep;
}

}  // namespace

TEMPLATE_TEST_CASE("random mask_mods and score_mods equal the dense keep-mask and bias",
                   "[mods][isa]", float, double) {
  using T = TestType;
  std::mt19937 rng(19);
  std::uniform_int_distribution<Index> length(1, 90), dim(1, 12), block(1, 40), coin(0, 1);
  for (int trial = 0; trial < 24; ++trial) {
    const Index batch = 2, kv_heads = 2, heads = 2 * kv_heads;
    const Index lq = trial % 4 == 0 ? 1 + trial % 3 : length(rng), lk = length(rng), d = dim(rng);
    const Tensor<T, 4> q = random_tensor<T>(rng, batch, heads, lq, d);
    const Tensor<T, 4> k = random_tensor<T>(rng, batch, kv_heads, lk, d);
    const Tensor<T, 4> v = random_tensor<T>(rng, batch, kv_heads, lk, d);
    const bool per_head = coin(rng) != 0;  // else one visibility for every head (H = 1)
    const Index mask_heads = per_head ? heads : 1;
    const std::vector<char> visible = random_visibility(rng, batch, mask_heads, lq, lk);
    const auto lookup = [&visible, mask_heads, lq, lk](Index b, Index h, Index i, Index j) {
      const Index hh = mask_heads == 1 ? 0 : h;
      return visible[static_cast<std::size_t>(((b * mask_heads + hh) * lq + i) * lk + j)] != 0;
    };
    // A bias by (head, relative position), finite.
    std::vector<T> relative(static_cast<std::size_t>(heads * (lq + lk)));
    std::uniform_real_distribution<double> u(-3, 3);
    for (T& x : relative)
      x = static_cast<T>(u(rng));
    const auto bias_of = [&relative, lq, lk](Index h, Index i, Index j) {
      return relative[static_cast<std::size_t>(h * (lq + lk) + (j - i + lq))];
    };

    // The dense forms, written out element by element.
    Tensor<bool, 4> keep(batch, mask_heads, lq, lk);
    Tensor<T, 4> bias(1, heads, lq, lk);
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < mask_heads; ++h)
        for (Index i = 0; i < lq; ++i)
          for (Index j = 0; j < lk; ++j)
            keep(b, h, i, j) = lookup(b, h, i, j);
    for (Index h = 0; h < heads; ++h)
      for (Index i = 0; i < lq; ++i)
        for (Index j = 0; j < lk; ++j)
          bias(0, h, i, j) = bias_of(h, i, j);

    const bool with_score_mod = coin(rng) != 0;
    const bool causal = trial % 3 == 0;  // the mods combine with the built-in rules
    AttentionOptions<T> dense;
    dense.keep_mask = keep;
    dense.causal = causal ? attn::Causal::bottom_right : attn::Causal::none;
    if (with_score_mod)
      dense.bias = bias;
    AttentionOptions<T> modded;
    modded.causal = dense.causal;
    const MaskMod mask_mod(lookup);
    const Index q_block = block(rng), k_block = block(rng);
    const bool blocks = coin(rng) != 0;
    if (blocks)
      modded.block_mask = BlockMask(mask_mod, batch, mask_heads, lq, lk, q_block, k_block);
    else
      modded.mask_mod = mask_mod;
    if (with_score_mod) {
      modded.score_mod = ScoreMod<T>(
          [bias_of](T s, Index, Index h, Index i, Index j) { return s + bias_of(h, i, j); });
    }

    // The long double reference with the mods as plain functions.
    attn_test::reference::Problem p;
    p.batch = batch;
    p.q_heads = heads;
    p.kv_heads = kv_heads;
    p.q_length = lq;
    p.k_length = lk;
    p.dim = p.value_dim = d;
    p.causal =
        causal ? attn_test::reference::Causal::bottom_right : attn_test::reference::Causal::none;
    p.mask_mod = lookup;
    if (with_score_mod) {
      p.score_mod = [bias_of](long double s, Index, Index h, Index i, Index j) {
        return s + static_cast<long double>(bias_of(h, i, j));
      };
    }
    const auto wide = [](const Tensor<T, 4>& t) {
      return std::vector<long double>(t.data(), t.data() + t.size());
    };
    const auto expected =
        attn_test::reference::attention<long double>(p, wide(q), wide(k), wide(v));

    for (const Algorithm algorithm : every_algorithm) {
      INFO("trial " << trial << ", " << name_of(algorithm) << ", Lq " << lq << ", Lk " << lk
                    << ", D " << d << (blocks ? ", block mask " : ", mask_mod ") << q_block << " x "
                    << k_block << (per_head ? ", per head" : ", one for all heads")
                    << (with_score_mod ? ", score_mod" : "") << (causal ? ", causal" : ""));
      const auto [out, lse] = run(q, k, v, modded, algorithm);
      const auto [dense_out, dense_lse] = run(q, k, v, dense, algorithm);
      REQUIRE_CLOSE(out, dense_out, attn_test::tolerance<T>());
      REQUIRE_CLOSE(lse, dense_lse, attn_test::tolerance<T>());
      REQUIRE_CLOSE(out, expected.out, 4 * attn_test::tolerance<T>());
      REQUIRE_CLOSE(lse, expected.lse, 4 * attn_test::tolerance<T>());
    }
  }
}

// --- Block classes ---------------------------------------------------------------------

TEST_CASE("BlockMask classes equal brute force, and the rules classify alike", "[mods]") {
  SECTION("causal, 300 x 300 in blocks of 64: the closed form") {
    const BlockMask m(MaskMod(attn::gallery::causal()), 1, 1, 300, 300, 64, 64);
    // 5 x 5 blocks: the 5 on the diagonal partial, the 10 below visible, the 10 above hidden.
    REQUIRE(m.q_blocks() == 5);
    REQUIRE(m.k_blocks() == 5);
    REQUIRE(m.counts() == std::array<Index, 3>{10, 10, 5});
    REQUIRE(m.bytes() == 25);
    REQUIRE(m.describe() ==
            "BlockMask [1, 1, 300, 300] in blocks of 64 x 64: 10 hidden, 10 visible, 5 partial");
  }
  SECTION("random visibility, every block against its elements") {
    std::mt19937 rng(7);
    std::uniform_int_distribution<Index> length(1, 50), block(1, 17);
    for (int trial = 0; trial < 40; ++trial) {
      const Index batch = 2, heads = 3, lq = length(rng), lk = length(rng);
      const std::vector<char> visible = random_visibility(rng, batch, heads, lq, lk);
      const auto lookup = [&](Index b, Index h, Index i, Index j) {
        return visible[static_cast<std::size_t>(((b * heads + h) * lq + i) * lk + j)] != 0;
      };
      const Index qb = block(rng), kb = block(rng);
      const BlockMask m(MaskMod(lookup), batch, heads, lq, lk, qb, kb);
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < heads; ++h) {
          for (Index x = 0; x < m.q_blocks(); ++x) {
            for (Index y = 0; y < m.k_blocks(); ++y) {
              Index shown = 0, total = 0;
              for (Index i = x * qb; i < std::min((x + 1) * qb, lq); ++i) {
                for (Index j = y * kb; j < std::min((y + 1) * kb, lk); ++j) {
                  shown += lookup(b, h, i, j) ? 1 : 0;
                  ++total;
                }
              }
              const TileVisibility expected = shown == 0       ? TileVisibility::hidden
                                              : shown == total ? TileVisibility::visible
                                                               : TileVisibility::partial;
              INFO("trial " << trial << " block (" << x << ", " << y << ")");
              REQUIRE(m.block(b, h, x, y) == expected);
            }
          }
          // A tile over several blocks: hidden iff all are, visible iff all are.
          const Index i0 = lq / 3, i1 = lq, j0 = 0, j1 = (lk + 1) / 2;
          Index shown = 0, hidden_blocks = 0, visible_blocks = 0, blocks = 0;
          for (Index x = i0 / qb; x <= (i1 - 1) / qb; ++x) {
            for (Index y = j0 / kb; y <= (j1 - 1) / kb; ++y) {
              hidden_blocks += m.block(b, h, x, y) == TileVisibility::hidden ? 1 : 0;
              visible_blocks += m.block(b, h, x, y) == TileVisibility::visible ? 1 : 0;
              ++blocks;
            }
          }
          (void)shown;
          const TileVisibility tile = m.classify(b, h, i0, i1, j0, j1);
          REQUIRE((tile == TileVisibility::hidden) == (hidden_blocks == blocks));
          REQUIRE((tile == TileVisibility::visible) == (visible_blocks == blocks));
        }
      }
    }
  }
  SECTION("the gallery's rules as block masks classify every block as the built-in rules do") {
    // One tile classifier: Mask::classify of the built-in causal / window options and of the
    // gallery's mask_mods as block masks agree on every block.
    for (const Index block : {1, 7, 16, 64}) {
      const Index lq = 100, lk = 130;
      struct Rule {
        attn::VisibilityOptions builtin;
        MaskMod mod;
      };
      std::vector<Rule> rules(3);
      rules[0].builtin.causal = attn::Causal::top_left;
      rules[0].mod = MaskMod(attn::gallery::causal());
      rules[1].builtin.causal = attn::Causal::bottom_right;
      rules[1].mod = MaskMod(attn::gallery::causal(lk - lq));
      rules[2].builtin.window = {9, 3};  // bottom-right aligned without a causal mask
      rules[2].mod = MaskMod(attn::gallery::sliding_window(9, 3, lk - lq));
      for (const Rule& rule : rules) {
        const attn::Mask builtin("test", 1, 1, lq, lk, rule.builtin);
        attn::VisibilityOptions modded;
        modded.block_mask = BlockMask(rule.mod, 1, 1, lq, lk, block, block);
        const attn::Mask by_blocks("test", 1, 1, lq, lk, modded);
        for (Index i0 = 0; i0 < lq; i0 += block) {
          for (Index j0 = 0; j0 < lk; j0 += block) {
            const Index i1 = std::min(i0 + block, lq), j1 = std::min(j0 + block, lk);
            INFO("block " << block << " tile (" << i0 << ", " << j0 << ")");
            REQUIRE(by_blocks.classify(0, 0, i0, i1, j0, j1) ==
                    builtin.classify(0, 0, i0, i1, j0, j1));
          }
        }
      }
    }
  }
}

TEST_CASE("flash evaluates a block mask's mask_mod only on its partial blocks", "[mods]") {
  // Counted through the mod itself, 256 x 256 scores per head, a causal block mask: with
  // blocks of 64 (the flash tiles by default) or of 32 with tiles of 32, the mod runs on the
  // diagonal blocks only, once per pair; without a block mask, on every pair.
  const Index length = 256, heads = 2;
  std::mt19937 rng(3);
  const Tensor<float, 4> q = random_tensor<float>(rng, 1, heads, length, 8);
  const Tensor<float, 4> k = random_tensor<float>(rng, 1, heads, length, 8);
  const Tensor<float, 4> v = random_tensor<float>(rng, 1, heads, length, 8);
  auto evaluations = std::make_shared<std::atomic<Index>>(0);
  const MaskMod counted([evaluations](Index, Index, Index i, Index j) {
    evaluations->fetch_add(1, std::memory_order_relaxed);
    return j <= i;
  });
  AttentionOptions<float> options;
  options.algorithm = Algorithm::flash;
  options.mask_mod = counted;
  const Tensor<float, 4> without = attn::scaled_dot_product_attention(q, k, v, options);
  REQUIRE(evaluations->load() == heads * length * length);
  options.mask_mod = MaskMod();
  for (const Index block : {64, 32}) {
    INFO("blocks of " << block);
    options.block_mask = BlockMask(counted, 1, 1, length, length, block, block);
    options.query_tile = options.key_tile = block == 64 ? 0 : block;
    evaluations->store(0);
    const Tensor<float, 4> with_blocks = attn::scaled_dot_product_attention(q, k, v, options);
    REQUIRE(evaluations->load() == heads * (length / block) * block * block);
    REQUIRE_CLOSE(flat(with_blocks), flat(without), 1e-6);
  }
}

TEMPLATE_TEST_CASE("a block mask per head: query heads sharing a kv head see their own keys",
                   "[mods][isa]", float, double) {
  // Decoding handles the query heads of a kv head together: a key block hidden (or wholly
  // visible) for one head of the group may be partial for the other.
  using T = TestType;
  std::mt19937 rng(17);
  const Index heads = 4, kv_heads = 1, lq = 2, lk = 300, d = 8;
  const Tensor<T, 4> q = random_tensor<T>(rng, 1, heads, lq, d);
  const Tensor<T, 4> k = random_tensor<T>(rng, 1, kv_heads, lk, d);
  const Tensor<T, 4> v = random_tensor<T>(rng, 1, kv_heads, lk, d);
  const auto by_head = [](Index, Index h, Index i, Index j) {
    switch (h) {
      case 0:
        return j < 64;  // the first key block wholly visible, the rest hidden
      case 1:
        return j >= 64 && j % 3 != i;  // the first block hidden, the rest partial
      case 2:
        return j % 5 == 0;
      default:
        return j >= 200;
    }
  };
  Tensor<bool, 4> keep(1, heads, lq, lk);
  for (Index h = 0; h < heads; ++h)
    for (Index i = 0; i < lq; ++i)
      for (Index j = 0; j < lk; ++j)
        keep(0, h, i, j) = by_head(0, h, i, j);
  AttentionOptions<T> dense;
  dense.keep_mask = keep;
  for (const Index block : {16, 64}) {
    AttentionOptions<T> modded;
    modded.block_mask = BlockMask(MaskMod(by_head), 1, heads, lq, lk, block, block);
    for (const Algorithm algorithm : every_algorithm) {
      INFO(name_of(algorithm) << ", blocks of " << block);
      const auto [out, lse] = run(q, k, v, modded, algorithm);
      const auto [expected, expected_lse] = run(q, k, v, dense, algorithm);
      REQUIRE_CLOSE(out, expected, attn_test::tolerance<T>());
      REQUIRE_CLOSE(lse, expected_lse, attn_test::tolerance<T>());
    }
  }
}

// --- NaN, packed sequences, the backward ----------------------------------------------

TEMPLATE_TEST_CASE("NaN from a score_mod propagates; a mask_mod hides like the keep-mask",
                   "[mods][isa]", float, double) {
  using T = TestType;
  std::mt19937 rng(5);
  const Index length = 40;
  const Tensor<T, 4> q = random_tensor<T>(rng, 1, 1, length, 4);
  Tensor<T, 4> k = random_tensor<T>(rng, 1, 1, length, 4);
  const Tensor<T, 4> v = random_tensor<T>(rng, 1, 1, length, 4);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (const Algorithm algorithm : every_algorithm) {
    INFO(name_of(algorithm));
    AttentionOptions<T> options;
    options.score_mod = ScoreMod<T>(
        [nan](T s, Index, Index, Index i, Index j) { return i == 7 && j == 3 ? nan : s; });
    const auto [out, lse] = run(q, k, v, options, algorithm);
    for (Index i = 0; i < length; ++i) {
      for (Index e = 0; e < 4; ++e)
        REQUIRE(std::isnan(out[static_cast<std::size_t>(i * 4 + e)]) == (i == 7));
    }
    // The same pair hidden by a mask_mod as well: no NaN anywhere.
    options.mask_mod = MaskMod([](Index, Index, Index i, Index j) { return !(i == 7 && j == 3); });
    const auto [hidden_out, hidden_lse] = run(q, k, v, options, algorithm);
    for (const T x : hidden_out)
      REQUIRE(std::isfinite(x));
  }
  // NaN in a key the mask_mod shows reaches every row that sees it.
  k(0, 0, 5, 1) = nan;
  AttentionOptions<T> options;
  options.mask_mod = MaskMod(attn::gallery::causal());
  for (const Algorithm algorithm : every_algorithm) {
    INFO(name_of(algorithm));
    const auto [out, lse] = run(q, k, v, options, algorithm);
    for (Index i = 0; i < length; ++i)
      REQUIRE(std::isnan(out[static_cast<std::size_t>(i * 4)]) == (i >= 5));
  }
}

TEST_CASE("mods on packed sequences see positions within each sequence", "[mods][isa]") {
  // Three sequences of 5, 17 and 30 tokens; the gallery's causal mask_mod (positions within
  // the sequence) equals the causal option on the same packed call, and a block mask sized
  // by the longest sequence does too.
  std::mt19937 rng(11);
  const std::vector<Index> offsets{0, 5, 22, 52};
  const Index tokens = 52, heads = 2, d = 6;
  Tensor<float, 3> q(tokens, heads, d), k(tokens, heads, d), v(tokens, heads, d);
  std::uniform_real_distribution<float> u(-2, 2);
  for (Tensor<float, 3>* t : {&q, &k, &v})
    for (Index n = 0; n < t->size(); ++n)
      t->data()[n] = u(rng);
  const auto packed_attention = [&](const AttentionOptions<float>& options) {
    Tensor<float, 3> out(q.dimension(0), q.dimension(1), v.dimension(2));
    attn::scaled_dot_product_attention_into<float>(
        attn::packed_view(q, offsets), attn::packed_view(k, offsets), attn::packed_view(v, offsets),
        attn::packed_view(out, offsets), options);
    return out;
  };
  AttentionOptions<float> builtin;
  builtin.causal = attn::Causal::top_left;
  for (const Algorithm algorithm : every_algorithm) {
    INFO(name_of(algorithm));
    builtin.algorithm = algorithm;
    const Tensor<float, 3> expected = packed_attention(builtin);
    AttentionOptions<float> modded;
    modded.algorithm = algorithm;
    modded.mask_mod = MaskMod(attn::gallery::causal());
    const Tensor<float, 3> with_mod = packed_attention(modded);
    REQUIRE_CLOSE(std::vector<float>(with_mod.data(), with_mod.data() + with_mod.size()),
                  std::vector<float>(expected.data(), expected.data() + expected.size()), 1e-6);
    modded.mask_mod = MaskMod();
    modded.block_mask = BlockMask(MaskMod(attn::gallery::causal()), 3, 1, 30, 30, 8, 8);
    const Tensor<float, 3> with_blocks = packed_attention(modded);
    REQUIRE_CLOSE(std::vector<float>(with_blocks.data(), with_blocks.data() + with_blocks.size()),
                  std::vector<float>(expected.data(), expected.data() + expected.size()), 1e-6);
  }
}

TEMPLATE_TEST_CASE("the backward with a mask_mod or block mask equals the keep-mask's",
                   "[mods][isa]", float, double) {
  using T = TestType;
  std::mt19937 rng(13);
  const Index batch = 2, kv_heads = 1, heads = 2, lq = 45, lk = 61, d = 5;
  const Tensor<T, 4> q = random_tensor<T>(rng, batch, heads, lq, d);
  const Tensor<T, 4> k = random_tensor<T>(rng, batch, kv_heads, lk, d);
  const Tensor<T, 4> v = random_tensor<T>(rng, batch, kv_heads, lk, d);
  const Tensor<T, 4> dout = random_tensor<T>(rng, batch, heads, lq, d);
  const std::vector<char> visible = random_visibility(rng, batch, heads, lq, lk);
  const auto lookup = [&visible](Index b, Index h, Index i, Index j) {
    return visible[static_cast<std::size_t>(((b * heads + h) * lq + i) * lk + j)] != 0;
  };
  Tensor<bool, 4> keep(batch, heads, lq, lk);
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < heads; ++h)
      for (Index i = 0; i < lq; ++i)
        for (Index j = 0; j < lk; ++j)
          keep(b, h, i, j) = lookup(b, h, i, j);
  AttentionOptions<T> dense;
  dense.keep_mask = keep;
  Tensor<T, 3> lse;
  const Tensor<T, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q, k, v, dense, attn::Return::logsumexp), nullptr, &lse);
  for (const Algorithm algorithm : {Algorithm::naive, Algorithm::flash}) {
    dense.algorithm = algorithm;
    const auto expected =
        attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, dense);
    for (const bool blocks : {false, true}) {
      INFO(name_of(algorithm) << (blocks ? ", block mask" : ", mask_mod"));
      AttentionOptions<T> modded;
      modded.algorithm = algorithm;
      if (blocks)
        modded.block_mask = BlockMask(MaskMod(lookup), batch, heads, lq, lk, 16, 16);
      else
        modded.mask_mod = MaskMod(lookup);
      const auto g = attn::scaled_dot_product_attention_backward(q, k, v, out, lse, dout, modded);
      REQUIRE_CLOSE(flat(g.dq), flat(expected.dq), attn_test::tolerance<T>());
      REQUIRE_CLOSE(flat(g.dk), flat(expected.dk), attn_test::tolerance<T>());
      REQUIRE_CLOSE(flat(g.dv), flat(expected.dv), attn_test::tolerance<T>());
    }
  }
}

// --- Errors ----------------------------------------------------------------------------

TEST_CASE("mods and block masks reject bad arguments", "[mods]") {
  using Catch::Matchers::Contains;
  const MaskMod causal(attn::gallery::causal());
  REQUIRE_THROWS_WITH(BlockMask(MaskMod(), 1, 1, 8, 8), Contains("BlockMask: mask_mod is empty"));
  REQUIRE_THROWS_WITH(BlockMask(causal, 0, 1, 8, 8),
                      Contains("BlockMask: sizes are [0, 1, 8, 8] (B, H, Lq, Lk)"));
  REQUIRE_THROWS_WITH(BlockMask(causal, 1, 1, -1, 8), Contains("the lengths >= 0"));
  REQUIRE_THROWS_WITH(BlockMask(causal, 1, 1, 8, 8, 0, 4),
                      Contains("BlockMask: blocks are 0 x 4: must be >= 1"));
  REQUIRE_THROWS_AS(BlockMask(causal, 1, 1, 8, 8, 4, -2), std::invalid_argument);

  std::mt19937 rng(1);
  const Tensor<float, 4> q = random_tensor<float>(rng, 2, 2, 8, 4);
  const Tensor<float, 4> kv = random_tensor<float>(rng, 2, 2, 8, 4);
  AttentionOptions<float> both;
  both.mask_mod = causal;
  both.block_mask = BlockMask(causal, 1, 1, 8, 8);
  REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q, kv, kv, both),
                      Contains("scaled_dot_product_attention: both mask_mod and block_mask"));
  for (const BlockMask& wrong : {BlockMask(causal, 3, 1, 8, 8), BlockMask(causal, 1, 3, 8, 8),
                                 BlockMask(causal, 1, 1, 9, 8), BlockMask(causal, 1, 1, 8, 7)}) {
    AttentionOptions<float> options;
    options.block_mask = wrong;
    REQUIRE_THROWS_WITH(attn::scaled_dot_product_attention(q, kv, kv, options),
                        Contains("block_mask was built for") &&
                            Contains("but the scores are [2, 2, 8, 8]: B and H must be 1 or "
                                     "equal, Lq and Lk equal"));
  }

  AttentionOptions<float> with_score_mod;
  with_score_mod.score_mod = ScoreMod<float>(attn::gallery::softcap<float>(5.0f));
  Tensor<float, 3> lse;
  const Tensor<float, 4> out = attn_test::out_of(
      attn::scaled_dot_product_attention(q, kv, kv, with_score_mod, attn::Return::logsumexp),
      nullptr, &lse);
  REQUIRE_THROWS_WITH(
      attn::scaled_dot_product_attention_backward(q, kv, kv, out, lse, out, with_score_mod),
      Contains("scaled_dot_product_attention_backward: options.score_mod is forward only"));

  REQUIRE_THROWS_WITH(attn::gallery::t5_relative_bias<float>(std::vector<float>(31), 1, 8, true),
                      Contains("gallery::t5_relative_bias: table has 31 entries but must have "
                               "buckets * heads = 32"));
  REQUIRE_THROWS_WITH(attn::gallery::t5_relative_bias<float>(std::vector<float>(32), 0, 8, true),
                      Contains("need heads >= 1"));
  REQUIRE_THROWS_WITH(attn::gallery::t5_relative_bias<float>(std::vector<float>(32), 1, 0, true),
                      Contains("max_length 0"));
}

TEST_CASE("empty mods change nothing; a mod's single calls match its tile loop", "[mods]") {
  const ScoreMod<double> none;
  REQUIRE_FALSE(static_cast<bool>(none));
  double s = 1.5;
  none.apply(attn::ScoreTile<double>{&s, 1, 1, 1, 1, 0, 0, 0, 0});
  REQUIRE(s == 1.5);
  const MaskMod all;
  REQUIRE_FALSE(static_cast<bool>(all));
  REQUIRE(all.classify(0, 0, 0, 4, 0, 4) == TileVisibility::visible);
  const ScoreMod<double> shifted([](double x, Index b, Index h, Index i, Index j) {
    return x + static_cast<double>(1000 * b + 100 * h + 10 * i + j);
  });
  REQUIRE(shifted(0.5, 1, 2, 3, 4) == 1234.5);
  std::vector<double> tile(6, 0.0);  // 2 x 3, column-major (row stride 1)
  shifted.apply(attn::ScoreTile<double>{tile.data(), 2, 3, 1, 2, 0, 1, 5, 7});
  REQUIRE(tile == std::vector<double>{157, 167, 158, 168, 159, 169});
  const MaskMod diagonal([](Index, Index, Index i, Index j) { return i == j; });
  REQUIRE(diagonal(0, 0, 3, 3));
  REQUIRE_FALSE(diagonal(0, 0, 3, 4));
  REQUIRE(diagonal.classify(0, 0, 0, 2, 2, 4) == TileVisibility::hidden);
  REQUIRE(diagonal.classify(0, 0, 0, 1, 0, 1) == TileVisibility::visible);
  REQUIRE(diagonal.classify(0, 0, 0, 2, 0, 2) == TileVisibility::partial);
  std::vector<float> scores(4, 1.0f);  // 2 x 2, row-major
  diagonal.hide(attn::ScoreTile<float>{scores.data(), 2, 2, 2, 1, 0, 0, 0, 0});
  REQUIRE(scores[0] == 1.0f);
  REQUIRE(scores[1] == -std::numeric_limits<float>::infinity());
  REQUIRE(scores[2] == -std::numeric_limits<float>::infinity());
  REQUIRE(scores[3] == 1.0f);
}
