// attn/paged_kv_cache.hpp: a key/value cache in pages, for serving many sequences.
//
//   pool     (pages, Hkv, P, D) keys and (pages, Hkv, P, Dv) values, P = page_size tokens
//            (vLLM's CPU layout, K and V in two pools), stored as S and SV: every format of
//            KVCache (float, double, half, bfloat16, q8_0, q4_0 blocks)
//   table    per sequence, the pool page of each P of its tokens (vLLM's block table)
//
// Sequences come and go by id (the bookkeeping is a PageTable, attn/cache/page_table.hpp):
// add_sequence, fork (a new sequence sharing every page of another, reference counted),
// truncate (roll back rejected speculative tokens), remove, and release_outside_window (a
// sliding-window ring: pages no future query sees go back to the pool). A page shared by several
// sequences is copied when one of them writes into it (copy-on-write of a partly filled last page);
// full shared pages are never copied.
//
// append and attend take a list of B sequence ids, one per batch row of their tensors, so
// ragged sequences run in one parallel call as with KVCache. attend reads the pages in
// place: the decode kernel cuts its key blocks at page ends, the flash kernel copies a key
// tile that spans pages into its workspace (kernels/flash.hpp); the cache is never gathered
// into a copy. When P is a multiple of decode_key_block (64; attn/plan.hpp) the decode
// kernel cuts blocks exactly where it does on a contiguous cache, so the results equal
// KVCache's bit for bit under the same algorithm; other page sizes differ by rounding.
// Rotation (KVRotation) and rotary embeddings on append behave exactly as in KVCache.
//
// Extra memory: the pool itself, (pages * Hkv * P) * (D + Dv) stored values, is the cache;
// a call builds a (B, max pages) table of page ids, and the kernels' workspaces are those
// of KVCache (the flash kernel's key-tile copy included, Bk * (D + Dv) floats per thread).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "attn/cache/huge_pages.hpp"
#include "attn/cache/page_table.hpp"
#include "attn/cache/paged_attend.hpp"
#include "attn/cache/paged_sequences.hpp"
#include "attn/cache/rows.hpp"
#include "attn/config.hpp"
#include "attn/kv_cache.hpp"
#include "attn/outputs.hpp"
#include "attn/problem.hpp"
#include "attn/rope.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Key/value cache of sequences held in pages of `page_size` tokens from one pool, Hkv
/// heads, head dims D (keys, stored as S) and Dv (values, stored as SV).
template <class S, class SV = S>
class PagedKVCache : public detail::PagedSequences {
 public:
  using key_storage = S;
  using value_storage = SV;
  /// The type of queries, outputs and accumulation (KVCache's rule; naming KVCache<S, SV>
  /// also runs its checks of the formats).
  using compute_type = typename KVCache<S, SV>::compute_type;

  PagedKVCache() = default;
  /// An empty cache: no sequence, a pool of `pages` free pages of `page_size` tokens, growing
  /// (at least doubling) when an append needs more unless allow_growth is off.
  PagedKVCache(Index kv_heads, Index dim, Index value_dim, Index page_size, Index pages = 0,
               bool allow_growth = true, KVRotation rotation = KVRotation::none)
      : detail::PagedSequences(page_size, "PagedKVCache"),
        kv_heads_(kv_heads),
        dim_(dim),
        value_dim_(value_dim),
        allow_growth_(allow_growth),
        rotation_(rotation) {
    constexpr const char* function = "PagedKVCache";
    if (kv_heads < 1 || dim < 1 || value_dim < 1 || page_size < 1 || pages < 0) {
      detail::throw_invalid_argument(
          function, "(Hkv, D, Dv) is " + detail::shape_string({kv_heads, dim, value_dim}) +
                        ", page_size " + std::to_string(page_size) + " and pages " +
                        std::to_string(pages) +
                        ": sizes and the page size must be positive and pages >= 0");
    }
    const auto refuse_partial_blocks = [&](bool blocks, const char* name, Index d) {
      if (blocks && d % quantized_block_values != 0) {
        detail::throw_invalid_argument(
            function, "(Hkv, D, Dv) is " + detail::shape_string({kv_heads, dim, value_dim}) + ": " +
                          name + " is " + std::to_string(d) +
                          " but a quantized format needs a multiple of 32 (its block size)");
      }
    };
    refuse_partial_blocks(is_quantized_v<S>, "D", dim);
    refuse_partial_blocks(is_quantized_v<SV>, "Dv", value_dim);
    if (rotation != KVRotation::none && rotation != KVRotation::hadamard) {
      detail::throw_invalid_argument(
          function,
          "rotation is " + std::to_string(static_cast<int>(rotation)) + ": not a KVRotation");
    }
    grow_pool(pages);
  }

  Index kv_heads() const { return kv_heads_; }
  Index dim() const { return dim_; }
  Index value_dim() const { return value_dim_; }
  bool allow_growth() const { return allow_growth_; }
  KVRotation rotation() const { return rotation_; }

  /// Makes the pool hold at least `pages` pages (never shrinks); allowed when allow_growth
  /// is off. Views into the pool are invalidated when it grows.
  void reserve(Index pages) {
    if (pages > this->pages())
      grow_pool(pages - this->pages());
  }

  /// Appends Lnew tokens to each of the B listed sequences (distinct live ids; batch row b
  /// of the tensors belongs to sequences[b]): keys (B, Hkv, Lnew, D), values (B, Hkv, Lnew,
  /// Dv), any strided layout of any floating type; `counts` (B), if given, says how many
  /// rows are real per sequence. Shared pages written into are copied first. Throws,
  /// leaving the cache unchanged, on bad shapes or ids, or when the pool is full and
  /// allow_growth is off.
  template <class U>
  void append(const std::vector<Index>& sequences,
              const HeadsView<const U>& keys,    // (B, Hkv, Lnew, D)
              const HeadsView<const U>& values,  // (B, Hkv, Lnew, Dv)
              const std::vector<Index>& counts = {}) {
    constexpr const char* function = "PagedKVCache::append";
    check_append(function, sequences, keys, values, counts);
    store_all(sequences, keys, values, counts);
  }

  /// append() that first rotates the keys with `rotary` (RoPE) at positions length + t, as
  /// KVCache::append does.
  template <class U>
  void append(const std::vector<Index>& sequences,
              const HeadsView<const U>& keys,    // (B, Hkv, Lnew, D)
              const HeadsView<const U>& values,  // (B, Hkv, Lnew, Dv)
              const RotaryEmbedding<compute_type>& rotary, const std::vector<Index>& counts = {}) {
    constexpr const char* function = "PagedKVCache::append";
    check_append(function, sequences, keys, values, counts);
    const detail::RotatedKeys<C> rotated =
        detail::rotate_new_keys(function, keys, counts, table_.lengths_of(sequences), rotary);
    store_all(sequences, HeadsView<const C>(rotated.view), values, rotated.counts);
  }

  /// append() for rank-4 tensors or tensor maps (B, Hkv, Lnew, D) and (B, Hkv, Lnew, Dv).
  template <class TK, class TV, class = std::enable_if_t<detail::is_rank4_tensor_v<TK>>>
  void append(const std::vector<Index>& sequences, const TK& keys, const TV& values,
              const std::vector<Index>& counts = {}) {
    append<detail::rank4_scalar_t<TK>>(sequences, detail::as_heads_view(keys),
                                       detail::as_heads_view(values), counts);
  }
  /// The rotating append() for rank-4 tensors or tensor maps.
  template <class TK, class TV, class = std::enable_if_t<detail::is_rank4_tensor_v<TK>>>
  void append(const std::vector<Index>& sequences, const TK& keys, const TV& values,
              const RotaryEmbedding<compute_type>& rotary, const std::vector<Index>& counts = {}) {
    append<detail::rank4_scalar_t<TK>>(sequences, detail::as_heads_view(keys),
                                       detail::as_heads_view(values), rotary, counts);
  }

  /// KVCache::attend_into over the listed sequences (batch row b of q and the outputs is
  /// sequences[b]): q (B, Hq, Lq, D) the last Lq tokens of each, out (B, Hq, Lq, Dv), the
  /// bottom-right causal mask per sequence, the same options and optional logsumexp; the
  /// decode or flash kernel (naive cannot read pages, so weights are refused).
  void attend_into(const std::vector<Index>& sequences,
                   const HeadsView<const compute_type>& q,             // (B, Hq, Lq, D)
                   const AttentionOutputViews<compute_type>& outputs,  // out (B, Hq, Lq, Dv), ...
                   const AttentionOptions<compute_type>& options = {}) const {
    attend_paged("PagedKVCache::attend", sequences, q, outputs, options, true);
  }

  /// attend_into() without the causal mask (KVCache::attend_all_into).
  void attend_all_into(const std::vector<Index>& sequences,
                       const HeadsView<const compute_type>& q,             // (B, Hq, Lq, D)
                       const AttentionOutputViews<compute_type>& outputs,  // (B, Hq, Lq, Dv), ...
                       const AttentionOptions<compute_type>& options = {}) const {
    attend_paged("PagedKVCache::attend_all", sequences, q, outputs, options, false);
  }

  /// attend_into() returning out (B, Hq, Lq, Dv); q is a rank-4 tensor (B, Hq, Lq, D).
  Tensor<compute_type, 4> attend(const std::vector<Index>& sequences,
                                 const Tensor<compute_type, 4>& q,  // (B, Hq, Lq, D)
                                 const AttentionOptions<compute_type>& options = {}) const {
    Tensor<compute_type, 4> out(q.dimension(0), q.dimension(1), q.dimension(2), value_dim_);
    attend_into(sequences, bhld_view(q), bhld_view(out), options);
    return out;
  }

  /// Throws, naming `function`, what attend_into(sequences, q, outputs, options) would throw
  /// for queries q (B, q_heads, q_length, D) and outputs of the right shapes once added[b]
  /// more tokens (none if `added` is empty) have been appended to sequences[b]: the ids, the
  /// options, the mask, the plan and the released pages are checked, nothing runs. For a
  /// caller that must know an attend will pass before it makes an append it cannot undo
  /// (MultiHeadAttention::forward_incremental).
  void check_attend(const char* function, const std::vector<Index>& sequences, Index q_heads,
                    Index q_length, const AttentionOptions<compute_type>& options,
                    const std::vector<Index>& added = {}) const {
    const auto batch = static_cast<Index>(sequences.size());
    table_.check_sequences(function, sequences, batch);
    if (!added.empty() && added.size() != sequences.size()) {
      detail::throw_invalid_argument(function, "added has " + std::to_string(added.size()) +
                                                   " entries but there are " +
                                                   std::to_string(batch) + " sequences");
    }
    if (q_heads < 1 || q_length < 0 ||
        std::any_of(added.begin(), added.end(), [](Index n) { return n < 0; })) {
      detail::throw_invalid_argument(function, "q_heads is " + std::to_string(q_heads) +
                                                   ", q_length " + std::to_string(q_length) +
                                                   " and added " + detail::list_string(added) +
                                                   ": q_heads must be positive, the others >= 0");
    }
    std::vector<Index> lengths = table_.lengths_of(sequences);
    for (std::size_t b = 0; b < added.size(); ++b)
      lengths[b] += added[b];
    const detail::PagedCall<C> call = detail::plan_paged_call(function, pools(), sequences, lengths,
                                                              q_heads, q_length, options, true);
    const AttentionProblem<C> problem(function, batch, q_heads, q_length, call.max_length,
                                      call.options, call.plan.isa);
    detail::check_released(function, table_, sequences, problem.mask(), q_length);
  }

 private:
  using C = compute_type;

  Index key_units() const { return dim_ / values_per_unit_v<S>; }
  Index value_units() const { return value_dim_ / values_per_unit_v<SV>; }

  /// Row `row` (< page_size) of head h of pool page `page`, in storage units.
  Index key_offset(Index page, Index h, Index row) const {
    return ((page * kv_heads_ + h) * page_size() + row) * key_units();
  }
  Index value_offset(Index page, Index h, Index row) const {
    return ((page * kv_heads_ + h) * page_size() + row) * value_units();
  }

  /// Adds `count` free pages to the pool (the held ones keep their ids and contents).
  void grow_pool(Index count) {
    const Index new_pages = pages() + count;
    keys_.resize(static_cast<std::size_t>(new_pages * kv_heads_ * page_size() * key_units()));
    values_.resize(static_cast<std::size_t>(new_pages * kv_heads_ * page_size() * value_units()));
    table_.add_pages(count);
  }

  template <class U, class V>
  void check_append(const char* function, const std::vector<Index>& sequences,
                    const HeadsView<const U>& keys, const HeadsView<const V>& values,
                    const std::vector<Index>& counts) const {
    table_.check_sequences(function, sequences, keys.batch);
    detail::check_new_rows(function, keys, values, counts, keys.batch, kv_heads_, dim_, value_dim_);
    const Index needed = table_.pages_needed(sequences, keys.length, counts);
    if (needed > free_pages() && !allow_growth_) {
      detail::throw_invalid_argument(
          function, "appending to sequences " + detail::list_string(sequences) + " needs " +
                        std::to_string(needed) + " free pages but the pool has " +
                        std::to_string(free_pages()) + " of " + std::to_string(pages()) +
                        " and allow_growth is off");
    }
  }

  /// The first counts[b] (all, if empty) rows of batch row b into sequences[b], page by
  /// page, a shared last page copied first; the inputs have been checked.
  template <class K, class V>
  void store_all(const std::vector<Index>& sequences, const HeadsView<const K>& keys,
                 const HeadsView<const V>& values, const std::vector<Index>& counts) {
    const Index needed = table_.pages_needed(sequences, keys.length, counts);
    if (needed > free_pages())
      grow_pool(std::max(needed - free_pages(), pages()));  // geometric: at least doubles
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      const Index id = sequences[b], n = counts.empty() ? keys.length : counts[b];
      for (Index done = 0; done < n;) {
        const PageTable::Write at = table_.writable_page(id);
        const Index run = std::min(n - done, page_size() - at.row);
        const auto batch_row = static_cast<Index>(b);
        for (Index h = 0; h < kv_heads_; ++h) {
          if (at.copy_from != released_page) {  // copy-on-write of a shared last page
            std::copy_n(keys_.begin() + key_offset(at.copy_from, h, 0), at.row * key_units(),
                        keys_.begin() + key_offset(at.page, h, 0));
            std::copy_n(values_.begin() + value_offset(at.copy_from, h, 0), at.row * value_units(),
                        values_.begin() + value_offset(at.page, h, 0));
          }
          detail::store_cache_rows<C>(keys, batch_row, h, done, run, rotation_,
                                      keys_.data() + key_offset(at.page, h, at.row));
          detail::store_cache_rows<C>(values, batch_row, h, done, run, rotation_,
                                      values_.data() + value_offset(at.page, h, at.row));
        }
        table_.advance(id, run);
        done += run;
      }
    }
  }

  /// The pools as the paged attend reads them (cache/paged_attend.hpp).
  detail::PagedPools<S, SV> pools() const {
    detail::PagedPools<S, SV> p;
    p.keys = keys_.data();
    p.values = values_.data();
    p.kv_heads = kv_heads_;
    p.dim = dim_;
    p.value_dim = value_dim_;
    p.key_stride = key_units();
    p.value_stride = value_units();
    p.rotation = rotation_;
    return p;
  }

  void attend_paged(const char* function, const std::vector<Index>& sequences,
                    const HeadsView<const C>& q,             // (B, Hq, Lq, D)
                    const AttentionOutputViews<C>& outputs,  // out (B, Hq, Lq, Dv), ...
                    const AttentionOptions<C>& options, bool causal) const {
    detail::attend_pages(function, table_, pools(), sequences, q, outputs, options, causal);
  }

  Index kv_heads_ = 0, dim_ = 0, value_dim_ = 0;
  bool allow_growth_ = true;
  KVRotation rotation_ = KVRotation::none;
  // the sequences, their block tables, the pages' reference counts
  detail::CacheBuffer<S> keys_;     // (pages, Hkv, P, D / values_per_unit_v<S>)
  detail::CacheBuffer<SV> values_;  // (pages, Hkv, P, Dv / values_per_unit_v<SV>)
};

}  // namespace attn
