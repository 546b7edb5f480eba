// One wording per option rule: each entry point that takes attention options refuses the same
// bad option with the same words, its own name first. Each rule is one row naming the entry
// points it applies to (KVCache::attend decides causal and the lengths itself; linear
// attention takes only causal, key_lengths and its own options).
#include <catch2/catch.hpp>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/kv_cache.hpp>
#include <attn/linear_attention.hpp>

#include "support/heads.hpp"

namespace {

using attn::Index;
using attn_test::Heads;

// The problem of every row: B 2, Hq 4, Hkv 2, Lq 3, Lk 5, D 8, Dv 6.
constexpr Index B = 2, Hq = 4, Hkv = 2, Lq = 3, Lk = 5, D = 8, Dv = 6;

enum Entry : unsigned {
  forward = 1u << 0,
  backward = 1u << 1,
  cache = 1u << 2,
  linear = 1u << 3,
};

struct OptionRule {
  const char* name;
  std::function<void(attn::AttentionOptions<float>&)> set;
  unsigned applies_to;
  const char* words;  // the message after "<function>: "
};

const OptionRule option_rules[] = {
    {"window",
     [](auto& o) {
       o.window = {-2, 0};
     },
     forward | backward | cache, "window is (-2, 0): each side must be >= -1 (-1 = unbounded)"},
    {"softcap", [](auto& o) { o.softcap = 0.0f; }, forward | backward | cache,
     "softcap is 0.000000: must be finite and > 0"},
    {"sink tokens", [](auto& o) { o.sink_tokens = -1; }, forward | backward | cache,
     "sink_tokens is -1: must be >= 0"},
    {"scale", [](auto& o) { o.scale = std::numeric_limits<float>::infinity(); },
     forward | backward | cache, "scale is inf: must be finite"},
    {"tiles", [](auto& o) { o.query_tile = -1; }, forward | backward | cache,
     "query_tile is -1 and key_tile is 0: tile sizes must be >= 0 (0 = default)"},
    {"alibi slopes",
     [](auto& o) {
       o.alibi_slopes = {0.5f, 0.25f, 0.125f};
     },
     forward | backward | cache, "alibi_slopes has 3 entries but there are 4 query heads"},
    {"sinks", [](auto& o) { o.sinks = {0.0f}; }, forward | backward | cache,
     "sinks has 1 entries but there are 4 query heads"},
    {"key_lengths count", [](auto& o) { o.key_lengths = {5}; }, forward | backward | linear,
     "key_lengths has 1 entries but the batch size is 2"},
    {"key_lengths range",
     [](auto& o) {
       o.key_lengths = {5, 6};
     },
     forward | backward | linear, "key_lengths[1] is 6: must lie in [0, Lk] with Lk = 5"},
    {"query_lengths range",
     [](auto& o) {
       o.query_lengths = {-1, 3};
     },
     forward | backward, "query_lengths[0] is -1: must lie in [0, Lq] with Lq = 3"},
};

Heads<float> make(Index b, Index h, Index l, Index d) {
  Heads<float> x(b, h, l, d);
  for (std::size_t i = 0; i < x.data.size(); ++i)
    x.data[i] = 0.01f * static_cast<float>(i % 89);
  return x;
}

struct EntryPoint {
  Entry entry;
  const char* prefix;
  std::function<void(const attn::AttentionOptions<float>&)> call;
};

const EntryPoint entry_points[] = {
    {forward, "scaled_dot_product_attention: ",
     [](const attn::AttentionOptions<float>& o) {
       const Heads<float> q = make(B, Hq, Lq, D), k = make(B, Hkv, Lk, D), v = make(B, Hkv, Lk, Dv);
       Heads<float> out = make(B, Hq, Lq, Dv);
       attn::scaled_dot_product_attention_into<float>(q.cview(), k.cview(), v.cview(), out.view(),
                                                      o);
     }},
    {backward, "scaled_dot_product_attention_backward: ",
     [](const attn::AttentionOptions<float>& o) {
       const Heads<float> q = make(B, Hq, Lq, D), k = make(B, Hkv, Lk, D), v = make(B, Hkv, Lk, Dv);
       const Heads<float> out = make(B, Hq, Lq, Dv);
       Heads<float> dq = make(B, Hq, Lq, D), dk = make(B, Hkv, Lk, D), dv = make(B, Hkv, Lk, Dv);
       const std::vector<float> lse(static_cast<std::size_t>(B * Hq * Lq), 1.0f);
       attn::scaled_dot_product_attention_backward_into<float>(
           q.cview(), k.cview(), v.cview(), out.cview(), attn::bhl_view(lse.data(), B, Hq, Lq),
           out.cview(), {dq.view(), dk.view(), dv.view()}, o);
     }},
    {cache, "KVCache::attend: ",
     [](const attn::AttentionOptions<float>& o) {
       attn::KVCache<float> kv(B, Hkv, D, Dv, Lk);
       const Heads<float> k = make(B, Hkv, Lk, D), v = make(B, Hkv, Lk, Dv), q = make(B, Hq, Lq, D);
       kv.append(k.cview(), v.cview());
       Heads<float> out = make(B, Hq, Lq, Dv);
       kv.attend_into(q.cview(), out.view(), o);
     }},
    {linear, "linear_attention: ",
     [](const attn::AttentionOptions<float>& o) {
       const Heads<float> q = make(B, Hq, Lq, D), k = make(B, Hkv, Lk, D), v = make(B, Hkv, Lk, Dv);
       Heads<float> out = make(B, Hq, Lq, Dv);
       attn::LinearAttentionOptions<float> lo;
       lo.causal = o.causal;
       lo.key_lengths = o.key_lengths;
       attn::linear_attention_into<float>(q.cview(), k.cview(), v.cview(), out.view(), lo);
     }},
};

}  // namespace

TEST_CASE("every entry point words each option rule the same way", "[errors]") {
  for (const OptionRule& rule : option_rules) {
    for (const EntryPoint& entry : entry_points) {
      if ((rule.applies_to & entry.entry) == 0)
        continue;
      INFO("rule " << rule.name << ", " << entry.prefix);
      attn::AttentionOptions<float> options;
      rule.set(options);
      REQUIRE_THROWS_WITH(entry.call(options), std::string(entry.prefix) + rule.words);
    }
  }
  // And every entry point accepts the options of no row (the rows are the only fault).
  for (const EntryPoint& entry : entry_points) {
    INFO(entry.prefix);
    REQUIRE_NOTHROW(entry.call({}));
  }
}
