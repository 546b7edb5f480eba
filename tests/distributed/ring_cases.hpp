// The problems every ring test runs: each option a ring supports, lengths that do not
// divide by the ranks, ranks without tokens.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <attn/options.hpp>

namespace attn_dist_test {

using attn::Index;

struct RingCase {
  std::string name;
  Index B, Hq, Hkv, Lq, Lk, D, Dv;
  attn::AttentionOptions<float> options;
};

inline std::vector<RingCase> ring_cases() {
  std::vector<RingCase> cases;
  const auto add = [&](std::string name, Index B, Index Hq, Index Hkv, Index Lq, Index Lk, Index D,
                       Index Dv, auto edit) {
    attn::AttentionOptions<float> o;
    edit(o);
    cases.push_back({std::move(name), B, Hq, Hkv, Lq, Lk, D, Dv, o});
  };
  add("no mask, L 37", 1, 2, 2, 37, 37, 8, 6, [](auto&) {});
  add("causal top-left, L 40", 2, 2, 1, 40, 40, 8, 8,
      [](auto& o) { o.causal = attn::Causal::top_left; });
  add("causal bottom-right, Lq 23 Lk 41", 1, 4, 2, 23, 41, 8, 5,
      [](auto& o) { o.causal = attn::Causal::bottom_right; });
  add("causal top-left, Lq 41 Lk 23", 1, 2, 2, 41, 23, 6, 6,
      [](auto& o) { o.causal = attn::Causal::top_left; });
  add("causal bottom-right, Lq 41 Lk 23", 1, 2, 1, 41, 23, 6, 6,
      [](auto& o) { o.causal = attn::Causal::bottom_right; });
  add("window (5, 3), no causal", 1, 2, 2, 33, 33, 8, 8, [](auto& o) { o.window = {5, 3}; });
  add("causal + window (7, -1)", 1, 3, 1, 45, 45, 8, 8, [](auto& o) {
    o.causal = attn::Causal::top_left;
    o.window = {7, -1};
  });
  add("window (-1, 4) bottom-right, Lq 20 Lk 31", 1, 2, 2, 20, 31, 8, 8, [](auto& o) {
    o.window = {-1, 4};
  });
  add("GQA 8/2, causal", 1, 8, 2, 29, 29, 8, 8, [](auto& o) { o.causal = attn::Causal::top_left; });
  add("ragged key and query lengths, causal bottom-right", 3, 2, 1, 30, 34, 8, 8, [](auto& o) {
    o.causal = attn::Causal::bottom_right;
    o.key_lengths = {34, 17, 0};
    o.query_lengths = {25, 9, 30};
  });
  add("ragged key lengths, window (4, 2)", 2, 2, 2, 26, 26, 8, 8, [](auto& o) {
    o.window = {4, 2};
    o.key_lengths = {26, 11};
  });
  add("sink tokens 3, causal, window (4, 0)", 1, 2, 2, 38, 38, 8, 8, [](auto& o) {
    o.causal = attn::Causal::top_left;
    o.window = {4, 0};
    o.sink_tokens = 3;
  });
  add("sink tokens 5, window (2, 3), no causal", 1, 2, 2, 27, 27, 8, 8, [](auto& o) {
    o.window = {2, 3};
    o.sink_tokens = 5;
  });
  add("learned sinks, softcap, scale", 1, 2, 1, 31, 31, 8, 8, [](auto& o) {
    o.causal = attn::Causal::top_left;
    o.sinks = {0.5f, -1.0f};
    o.softcap = 3.0f;
    o.scale = 0.4f;
  });
  add("L 3: ranks without tokens", 1, 2, 2, 3, 3, 8, 8,
      [](auto& o) { o.causal = attn::Causal::top_left; });
  add("Lq 1 against Lk 9, causal bottom-right", 1, 2, 2, 1, 9, 8, 8,
      [](auto& o) { o.causal = attn::Causal::bottom_right; });
  add("flash with tiny tiles, causal", 1, 2, 2, 50, 50, 8, 8, [](auto& o) {
    o.causal = attn::Causal::top_left;
    o.algorithm = attn::Algorithm::flash;
    o.query_tile = 4;
    o.key_tile = 3;
  });
  return cases;
}

}  // namespace attn_dist_test
