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

#include "attn/cache/page_table.hpp"
#include "attn/cache/rows.hpp"
#include "attn/config.hpp"
#include "attn/kv_cache.hpp"
#include "attn/mask.hpp"
#include "attn/outputs.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/rope.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Key/value cache of sequences held in pages of `page_size` tokens from one pool, Hkv
/// heads, head dims D (keys, stored as S) and Dv (values, stored as SV).
template <class S, class SV = S>
class PagedKVCache {
 public:
  using key_storage = S;
  using value_storage = SV;
  /// The type of queries, outputs and accumulation (KVCache's rule; naming KVCache<S, SV>
  /// also runs its checks of the formats).
  using compute_type = typename KVCache<S, SV>::compute_type;
  /// The block table's entry for a page given back by release_outside_window.
  static constexpr Index released_page = PageTable::released_page;

  PagedKVCache() = default;
  /// An empty cache: no sequence, a pool of `pages` free pages of `page_size` tokens, growing
  /// (at least doubling) when an append needs more unless allow_growth is off.
  PagedKVCache(Index kv_heads, Index dim, Index value_dim, Index page_size, Index pages = 0,
               bool allow_growth = true, KVRotation rotation = KVRotation::none)
      : kv_heads_(kv_heads),
        dim_(dim),
        value_dim_(value_dim),
        allow_growth_(allow_growth),
        rotation_(rotation),
        table_(page_size, "PagedKVCache") {
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
  Index page_size() const { return table_.page_size(); }
  bool allow_growth() const { return allow_growth_; }
  KVRotation rotation() const { return rotation_; }
  /// The sequences, their block tables and the pages' reference counts.
  const PageTable& page_table() const { return table_; }
  /// Pages in the pool, and of them those no sequence holds.
  Index pages() const { return table_.pages(); }
  Index free_pages() const { return table_.free_pages(); }
  /// How many sequences hold pool page `page` (0: free).
  Index references(Index page) const { return table_.references(page); }
  /// Whether `sequence` is a live id.
  bool contains(Index sequence) const { return table_.contains(sequence); }
  /// The live ids, ascending.
  std::vector<Index> sequences() const { return table_.sequences(); }
  /// Tokens held by `sequence`.
  Index length(Index sequence) const { return table_.length(sequence); }
  /// The pool page of each page_size tokens of `sequence` (released_page where given back).
  const std::vector<Index>& block_table(Index sequence) const {
    return table_.block_table(sequence);
  }

  /// A new empty sequence; returns its id (the smallest id not in use).
  Index add_sequence() { return table_.add_sequence(); }

  /// A new sequence holding the same tokens as `sequence`, sharing its pages (prefix caching,
  /// beam search, n > 1 sampling): no row is copied until one of them writes into a shared
  /// page. Returns the new id.
  Index fork(Index sequence) { return table_.fork(sequence); }

  /// Keeps the first `length` tokens of `sequence` (0 <= length <= its length), giving
  /// back the pages past them.
  void truncate(Index sequence, Index length) { table_.truncate(sequence, length); }

  /// Removes `sequence`, giving back its pages; its id may be reused.
  void remove(Index sequence) { table_.remove(sequence); }

  /// Gives back the pages of `sequence` that a sliding window of `window_left` keys left of
  /// the diagonal hides from every query at or after its next position (length): pages whose
  /// every token is before length - window_left, except those holding the first
  /// `sink_tokens` tokens (StreamingLLM's sinks stay). Later attend calls must hide them too
  /// (a window at most as wide and at most these sink tokens), or they throw.
  void release_outside_window(Index sequence, Index window_left, Index sink_tokens = 0) {
    table_.release_outside_window(sequence, window_left, sink_tokens);
  }

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
    const PlannedCall call =
        plan_call(function, sequences, lengths, q_heads, q_length, options, true);
    const AttentionProblem<C> problem(function, batch, q_heads, q_length, call.max_length,
                                      call.options, call.plan.isa);
    check_released(function, sequences, problem.mask(), q_length);
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

  /// A paged (B, Hkv, max length, units) view of the pool for `table` (B, max pages).
  template <class X>
  HeadsView<const X> paged_view(const X* pool, Index batch, Index length, Index units,
                                const std::vector<Index>& table, Index max_pages) const {
    HeadsView<const X> view{
        pool, batch, kv_heads_, length, units, kv_heads_ * page_size() * units, page_size() * units,
        units};
    view.pages = table.data();
    view.page_rows = page_size();
    view.pages_stride = max_pages;
    return view;
  }

  /// What an attend of q_length queries of q_heads heads (head dim D) per listed sequence,
  /// whose lengths are `lengths`, gives the kernels: the options with the cache's mask, the
  /// plan and the scale, after the checks of everything but the tensors. The problem is
  /// built from `options` by the caller (it is not movable into a result).
  struct PlannedCall {
    AttentionOptions<C> options;
    KernelPlan plan;
    C scale = 0;
    Index max_length = 0;
  };

  PlannedCall plan_call(const char* function, const std::vector<Index>& sequences,
                        const std::vector<Index>& lengths, Index q_heads, Index q_length,
                        const AttentionOptions<C>& options, bool causal) const {
    if (options.causal != Causal::none || !options.key_lengths.empty() ||
        !options.query_lengths.empty()) {
      detail::throw_invalid_argument(
          function, std::string("options.causal, options.key_lengths and options.query_lengths "
                                "must be unset: the cache applies ") +
                        (causal ? "the bottom-right causal mask and its own lengths"
                                : "its own lengths (every query sees every cached token)"));
    }
    for (std::size_t b = 0; b < lengths.size() && causal; ++b) {
      if (lengths[b] < q_length) {
        detail::throw_invalid_argument(
            function, "q is " +
                          detail::shape_string(
                              {static_cast<Index>(lengths.size()), q_heads, q_length, dim_}) +
                          ": " + std::to_string(q_length) + " queries but sequence " +
                          std::to_string(sequences[b]) + " holds only " +
                          std::to_string(lengths[b]) + " tokens (append the new tokens first)");
      }
    }
    if (options.algorithm != Algorithm::automatic && options.algorithm != Algorithm::decode &&
        options.algorithm != Algorithm::flash) {
      detail::throw_invalid_argument(
          function, std::string("options.algorithm is ") + algorithm_name(options.algorithm) +
                        ": a paged cache runs the decode or the flash kernel (automatic, decode "
                        "or flash)");
    }
    PlannedCall call;
    call.max_length = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
    AttentionOptions<C>& o = call.options;
    o = options;
    o.causal = causal ? Causal::bottom_right : Causal::none;
    if (std::any_of(lengths.begin(), lengths.end(), [&](Index n) { return n != call.max_length; }))
      o.key_lengths = lengths;
    call.scale = detail::resolve_scale(function, o.scale, dim_);
    const auto batch = static_cast<Index>(lengths.size());
    AttentionShape shape{batch, q_heads, kv_heads_, q_length, call.max_length, dim_, value_dim_};
    shape.kv_element_bytes = is_quantized_v<S> || is_quantized_v<SV> ? 1 : Index(sizeof(S));
    shape.kv_quantized = is_quantized_v<S> || is_quantized_v<SV>;
    shape.kv_paged = true;
    shape.bf16_readable_kv = detail::bf16_readable_v<S> && detail::bf16_readable_v<SV>;
    call.plan = plan_attention<C>(shape, o, false, function);
    return call;
  }

  void attend_paged(const char* function, const std::vector<Index>& sequences,
                    const HeadsView<const C>& q,             // (B, Hq, Lq, D)
                    const AttentionOutputViews<C>& outputs,  // out (B, Hq, Lq, Dv), ...
                    const AttentionOptions<C>& options, bool causal) const {
    table_.check_sequences(function, sequences, q.batch);
    const Index batch = q.batch;
    const std::vector<Index> lengths = table_.lengths_of(sequences);
    const Index max_length =
        lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
    const Index max_pages = std::max(table_.pages_for(max_length), Index(1));
    const std::vector<Index> table = table_.tables_of(sequences, max_pages);
    const HeadsView<const S> keys =
        paged_view(keys_.data(), batch, max_length, key_units(), table, max_pages);
    const HeadsView<const SV> values =
        paged_view(values_.data(), batch, max_length, value_units(), table, max_pages);
    // KVCache's rules and wording, the cache's pages standing for k and v.
    const HeadsView<C>& out = outputs.out;
    detail::check_attention_packing(function, q, keys, values, outputs);
    detail::check_attention_shapes(function, q, shape_of(keys, dim_), shape_of(values, value_dim_),
                                   "k (cached)", "v (cached)");
    detail::check_output_shape(function, q, value_dim_, out);
    detail::check_output_aliasing(function, q, all_pages(keys), all_pages(values), out);
    if (outputs.weights) {
      detail::throw_invalid_argument(
          function,
          "weights are not available from a paged cache (its kernels, decode and "
          "flash, never form them)");
    }
    detail::check_optional_outputs(function, q, all_pages(keys), all_pages(values), outputs);
    const PlannedCall call =
        plan_call(function, sequences, lengths, q.heads, q.length, options, causal);
    const AttentionProblem<C> problem(function, q.batch, q.heads, q.length, max_length,
                                      call.options, call.plan.isa);
    check_released(function, sequences, problem.mask(), q.length);
    if (q.length == 0)
      return;
    const detail::RowValues<C> logsumexp =
        outputs.logsumexp ? detail::row_values(*outputs.logsumexp) : detail::RowValues<C>{};
    const KernelPlan& plan = call.plan;
    const C scale = call.scale;
    if (rotation_ == KVRotation::none)
      return run(plan, q, keys, values, out, problem, scale, logsumexp);
    // The queries rotated like the keys; the output, rotated like the values, turned back.
    std::vector<C> rotated(static_cast<std::size_t>(q.batch * q.heads * q.length * dim_));
    const HeadsView<C> q_rotated = bhld_view(rotated.data(), q.batch, q.heads, q.length, dim_);
    for (Index b = 0; b < q.batch; ++b) {
      for (Index h = 0; h < q.heads; ++h) {
        q_rotated.head(b, h) = q.head(b, h);
        for (Index i = 0; i < q.length; ++i)
          hadamard_rotate(q_rotated.head(b, h).row(i).data(), dim_);
      }
    }
    run(plan, q_rotated, keys, values, out, problem, scale, logsumexp);
    for (Index b = 0; b < out.batch; ++b) {
      for (Index h = 0; h < out.heads; ++h) {
        for (Index i = 0; i < out.length; ++i)
          hadamard_rotate(out.head(b, h).row(i).data(), value_dim_);
      }
    }
  }

  static void run(const KernelPlan& plan, const HeadsView<const C>& q,
                  const HeadsView<const S>& keys, const HeadsView<const SV>& values,
                  const HeadsView<C>& out, const AttentionProblem<C>& problem, C scale,
                  const detail::RowValues<C>& logsumexp) {
    if (plan.algorithm == Algorithm::decode)
      detail::decode_attention<C, S, SV>(plan, q, keys, values, out, problem, scale, logsumexp);
    else
      detail::run_flash(plan, q, keys, values, out, problem, scale, logsumexp);
  }

  /// Throws when a query of the call could see a token of a released page.
  void check_released(const char* function, const std::vector<Index>& sequences, const Mask& mask,
                      Index q_length) const {
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      const auto [released_begin, released_end] = table_.released(sequences[b]);
      if (released_begin == released_end)
        continue;
      for (Index i = 0; i < q_length; ++i) {
        const Mask::KeyIntervals keys = mask.key_intervals(static_cast<Index>(b), i);
        for (std::size_t n = 0; n < keys.count; ++n) {
          const auto [first, last] = keys.interval[n];
          if (first < released_end && last > released_begin) {
            detail::throw_invalid_argument(
                function, "sequence " + std::to_string(sequences[b]) + ": query " +
                              std::to_string(i) + " would see keys [" + std::to_string(first) +
                              ", " + std::to_string(last) + ") but tokens [" +
                              std::to_string(released_begin) + ", " + std::to_string(released_end) +
                              ") were released (release_outside_window): give the window "
                              "and sink tokens that released them");
          }
        }
      }
    }
  }

  /// The whole pool as one unpaged view: what the overlap checks measure.
  template <class X>
  HeadsView<const X> all_pages(const HeadsView<const X>& paged) const {
    return {paged.data, 1, 1, pages() * kv_heads_ * page_size(), paged.dim, 0, 0, paged.dim};
  }

  /// A view's shape with `dim` values per row and no data: what the shape checks measure.
  template <class X>
  static HeadsView<const C> shape_of(const HeadsView<const X>& x, Index dim) {
    return {nullptr, x.batch, x.heads, x.length, dim, 0, 0, dim};
  }

  Index kv_heads_ = 0, dim_ = 0, value_dim_ = 0;
  bool allow_growth_ = true;
  KVRotation rotation_ = KVRotation::none;
  PageTable table_;         // the sequences, their block tables, the pages' reference counts
  std::vector<S> keys_;     // (pages, Hkv, P, D / values_per_unit_v<S>)
  std::vector<SV> values_;  // (pages, Hkv, P, Dv / values_per_unit_v<SV>)
};

}  // namespace attn
