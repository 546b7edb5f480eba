// One wording per shape rule (attn/checks.hpp): every entry point that takes q, k and v (or a
// cache in their place) and writes out refuses the same mistake with the same words. Each
// rule is one row; each entry point builds its own arguments from the row's shapes.
#include <catch2/catch.hpp>

#include <array>
#include <functional>
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
using Shape = std::array<Index, 4>;

struct Rule {
  const char* name;
  Shape q, k, v, out;
  const char* words;  // the message's end, after the shapes
};

// q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), out (B, Hq, Lq, Dv)
const Rule rules[] = {
    {"batch", {1, 4, 3, 8}, {2, 2, 5, 8}, {2, 2, 5, 6}, {1, 4, 3, 6}, ": batch sizes differ"},
    {"head dim", {2, 4, 3, 7}, {2, 2, 5, 8}, {2, 2, 5, 6}, {2, 4, 3, 6}, " head dims differ"},
    {"query heads",
     {2, 3, 3, 8},
     {2, 2, 5, 8},
     {2, 2, 5, 6},
     {2, 3, 3, 6},
     ": query heads (3) must be a multiple of key/value heads (2)"},
    {"out",
     {2, 4, 3, 8},
     {2, 2, 5, 8},
     {2, 2, 5, 6},
     {2, 4, 3, 7},
     "out is [2, 4, 3, 7] but must be [2, 4, 3, 6] (B, Hq, Lq, Dv)"},
};

Heads<float> make(const Shape& s) {
  Heads<float> h(s[0], s[1], s[2], s[3]);
  for (std::size_t i = 0; i < h.data.size(); ++i)
    h.data[i] = 0.01f * static_cast<float>(i % 97);
  return h;
}

/// The entry points, each run on one rule's shapes, and the name their messages begin with.
struct EntryPoint {
  const char* name;
  const char* prefix;
  std::function<void(const Rule&)> call;
};
const std::vector<EntryPoint> entry_points = {
    {"scaled_dot_product_attention_into", "scaled_dot_product_attention: ",
     [](const Rule& r) {
       const Heads<float> q = make(r.q), k = make(r.k), v = make(r.v);
       Heads<float> out = make(r.out);
       attn::scaled_dot_product_attention_into<float>(q.cview(), k.cview(), v.cview(), out.view());
     }},
    {"scaled_dot_product_attention_backward_into", "scaled_dot_product_attention_backward: ",
     [](const Rule& r) {
       const Heads<float> q = make(r.q), k = make(r.k), v = make(r.v), out = make(r.out);
       Heads<float> dq = make(r.q), dk = make(r.k), dv = make(r.v);
       const std::vector<float> lse(static_cast<std::size_t>(r.q[0] * r.q[1] * r.q[2]), 0.0f);
       attn::scaled_dot_product_attention_backward_into<float>(
           q.cview(), k.cview(), v.cview(), out.cview(),
           attn::bhl_view(lse.data(), r.q[0], r.q[1], r.q[2]), out.cview(),
           {dq.view(), dk.view(), dv.view()});
     }},
    {"linear_attention_into", "linear_attention: ",
     [](const Rule& r) {
       const Heads<float> q = make(r.q), k = make(r.k), v = make(r.v);
       Heads<float> out = make(r.out);
       attn::linear_attention_into<float>(q.cview(), k.cview(), v.cview(), out.view());
     }},
    {"KVCache::attend_into", "KVCache::attend: ",
     [](const Rule& r) {
       attn::KVCache<float> cache(r.k[0], r.k[1], r.k[3], r.v[3], r.k[2]);
       const Heads<float> k = make(r.k), v = make(r.v), q = make(r.q);
       cache.append(k.cview(), v.cview());
       Heads<float> out = make(r.out);
       cache.attend_into(q.cview(), out.view());
     }},
};

}  // namespace

TEST_CASE("every entry point words each shape rule the same way", "[errors]") {
  for (const Rule& rule : rules) {
    for (const EntryPoint& entry : entry_points) {
      INFO("rule " << rule.name << ", " << entry.name);
      std::string message;
      try {
        entry.call(rule);
      } catch (const std::invalid_argument& e) {
        message = e.what();
      }
      REQUIRE_FALSE(message.empty());
      // The function's name first, the rule's words at the end.
      CHECK(message.rfind(entry.prefix, 0) == 0);
      const std::string words = rule.words;
      REQUIRE(message.size() >= words.size());
      CHECK(message.substr(message.size() - words.size()) == words);
    }
  }
}
