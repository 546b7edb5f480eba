// Test support: one chunk of prefill against the same keys and values in a KVCache and in a
// PagedKVCache, for the tests that a kernel's bits do not depend on the pages.
#pragma once

#include <random>
#include <vector>

#include <attn/kv_cache.hpp>
#include <attn/paged_kv_cache.hpp>

#include "support/heads.hpp"

namespace attn_test {

/// The outputs of one chunk of prefill (8 query heads, 90 queries) against 500 rows of random
/// keys and values (2 kv heads, `dim` values each) stored as S.
struct PagedPrefill {
  std::vector<float> contiguous;  ///< (1, 8, 90, dim) from a KVCache, with the options given
  std::vector<float> paged;       ///< the same from a PagedKVCache of 64-row pages
  std::vector<float> fp32;        ///< the KVCache's with ComputePrecision::fp32
};

template <class S>
PagedPrefill paged_prefill(Index dim, attn::AttentionOptions<float> options, std::mt19937& rng) {
  const Index kv_heads = 2, length = 500, page = 64, q_heads = 8, queries = 90;
  const Heads<float> k = random_heads<float>(1, kv_heads, length, dim, rng);
  const Heads<float> v = random_heads<float>(1, kv_heads, length, dim, rng);
  attn::KVCache<S> contiguous(1, kv_heads, dim, dim, 0);
  attn::PagedKVCache<S> paged(kv_heads, dim, dim, page);
  contiguous.append(k.cview(), v.cview());
  const std::vector<Index> ids{paged.add_sequence()};
  paged.append(ids, k.cview(), v.cview());
  const Heads<float> q = random_heads<float>(1, q_heads, queries, dim, rng);
  Heads<float> a(1, q_heads, queries, dim), b(1, q_heads, queries, dim);
  Heads<float> c(1, q_heads, queries, dim);
  contiguous.attend_into(q.cview(), a.view(), options);
  paged.attend_into(ids, q.cview(), b.view(), options);
  options.compute = attn::ComputePrecision::fp32;
  contiguous.attend_into(q.cview(), c.view(), options);
  return {a.data, b.data, c.data};
}

}  // namespace attn_test
