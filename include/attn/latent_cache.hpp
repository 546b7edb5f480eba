// attn/latent_cache.hpp: the cache of DeepSeek's multi-head latent attention (MLA): per token
// one latent c of C values and one rotary key k_rope of R values for all the heads, in pages.
//
//   pool     (pages, P, C + R) stored as S: each row is [c ; k_rope], P = page_size tokens;
//            S is float, double, Eigen::half, Eigen::bfloat16, or q8_0 / q4_0 blocks
//            (C and R multiples of 32)
//   table    per sequence, the pool page of each P of its tokens (attn/cache/page_table.hpp)
//
// Attention reads the rows twice over: as keys of dim C + R, and as values of dim C, the
// first C columns of the same rows. The kernels get two views of one pool, K (B, 1, L, C + R)
// and V (B, 1, L, C) with K's row stride, so nothing is copied and V is never stored.
//
// Memory: the pool is the cache, (C + R) stored values per token (blocks counted in their
// bytes): 576 values for DeepSeek-V2/V3's C = 512, R = 64, that is 2304 bytes in float, 1152
// in 16 bits, 612 in q8_0; a KVCache holding K (C + R) and V (C) apart would need 1088 values
// per token, the un-absorbed heads H (192 + 128) (5120 for DeepSeek-V2-Lite's 16 heads). A
// call to attend builds a (B, max pages) table of page ids; the kernels' workspaces are those
// of PagedKVCache.
//
// With the absorbed projections (attn/mla.hpp), one decoding step of H heads is
//   q_latent = [q_nope W_UK[h] ; q_rope]          (B, H, Lq, C + R)   mla_absorb_queries
//   o_latent = softmax(scale q_latent K^T) V      (B, H, Lq, C)       attend
//   out      = o_latent W_UV[h]                   (B, H, Lq, Dv)      mla_project_output
// an attention of H query heads against one kv head (G = H), which the decode kernel runs
// with all H query rows of a sequence as one tile. The scale is the caller's and must be
// given: MLA's is that of the un-absorbed heads, 1 / sqrt(nope + rope) (1 / sqrt(192) for
// DeepSeek), not 1 / sqrt(C + R) (docs/mla.md).
//
// Sequences come and go by id as in PagedKVCache (add_sequence, fork, truncate, remove,
// release_outside_window; copy-on-write of a shared partly filled last page), and attend
// reads the pages in place with the decode or the flash kernel. append takes c and k_rope
// apart (vLLM's concat_and_cache_mla): the rotary embedding, if given, turns k_rope alone, at
// the token's position.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/cache/huge_pages.hpp"
#include "attn/cache/page_table.hpp"
#include "attn/cache/paged_attend.hpp"
#include "attn/cache/paged_sequences.hpp"
#include "attn/cache/rows.hpp"
#include "attn/config.hpp"
#include "attn/outputs.hpp"
#include "attn/precision.hpp"
#include "attn/quantized.hpp"
#include "attn/rope.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// MLA's latent cache: per token a latent of C values and a rotary key of R values, stored
/// as S in pages of `page_size` tokens; the keys are the rows [c ; k_rope], the values their
/// first C columns.
template <class S>
class LatentCache : public detail::PagedSequences {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, double> || is_16bit_scalar_v<S> ||
                    is_quantized_v<S>,
                "LatentCache: S must be float, double, Eigen::half, Eigen::bfloat16, "
                "attn::BlockQ8_0 or attn::BlockQ4_0");

 public:
  using storage_type = S;
  /// The type of queries, outputs and accumulation: double for a double cache, else float.
  using compute_type = std::conditional_t<std::is_same_v<S, double>, double, float>;

  LatentCache() = default;
  /// An empty cache: no sequence, a pool of `pages` free pages of `page_size` tokens, each
  /// token a latent of `latent_dim` (C) values and a rotary key of `rope_dim` (R) values,
  /// growing (at least doubling) when an append needs more pages unless allow_growth is off.
  LatentCache(Index latent_dim, Index rope_dim, Index page_size, Index pages = 0,
              bool allow_growth = true)
      : detail::PagedSequences(page_size, "LatentCache"),
        latent_dim_(latent_dim),
        rope_dim_(rope_dim),
        allow_growth_(allow_growth) {
    constexpr const char* function = "LatentCache";
    if (latent_dim < 1 || rope_dim < 0 || page_size < 1 || pages < 0) {
      detail::throw_invalid_argument(
          function, "(C, R) is " + detail::shape_string({latent_dim, rope_dim}) + ", page_size " +
                        std::to_string(page_size) + " and pages " + std::to_string(pages) +
                        ": C and the page size must be positive, R and pages >= 0");
    }
    check_dims(function, latent_dim, rope_dim);
    grow_pool(pages);
  }

  /// C, the latent's values per token (the value dim of attend).
  Index latent_dim() const { return latent_dim_; }
  /// R, the rotary key's values per token.
  Index rope_dim() const { return rope_dim_; }
  /// C + R, the key dim of attend (the queries' dim).
  Index dim() const { return latent_dim_ + rope_dim_; }
  /// C, the value dim of attend (the output's dim).
  Index value_dim() const { return latent_dim_; }
  bool allow_growth() const { return allow_growth_; }
  /// Bytes stored per token: C + R values, or (C + R) / 32 blocks. Throws for the (C, R) the
  /// constructor refuses.
  static Index bytes_per_token(Index latent_dim, Index rope_dim) {
    check_dims("LatentCache::bytes_per_token", latent_dim, rope_dim);
    return (latent_dim + rope_dim) / values_per_unit_v<S> * Index(sizeof(S));
  }
  Index bytes_per_token() const { return bytes_per_token(latent_dim_, rope_dim_); }
  /// Makes the pool hold at least `pages` pages (never shrinks); allowed when allow_growth
  /// is off.
  void reserve(Index pages) {
    if (pages > this->pages())
      grow_pool(pages - this->pages());
  }

  /// Appends Lnew tokens to each of the B listed sequences (distinct live ids; batch row b
  /// of the tensors belongs to sequences[b]): their latents (B, 1, Lnew, C) and rotary keys
  /// (B, 1, Lnew, R), already rotated, any strided layout of any floating type; `counts` (B),
  /// if given, says how many rows are real per sequence. Throws, leaving the cache unchanged,
  /// on bad shapes or ids, or when the pool is full and allow_growth is off.
  template <class U>
  void append(const std::vector<Index>& sequences,
              const HeadsView<const U>& latent,  // (B, 1, Lnew, C)
              const HeadsView<const U>& rope,    // (B, 1, Lnew, R)
              const std::vector<Index>& counts = {}) {
    constexpr const char* function = "LatentCache::append";
    check_append(function, sequences, latent, rope, counts);
    store_all(sequences, latent, rope, counts);
  }

  /// append() that first turns each new rotary key by `rotary` (head dim R) at its position,
  /// length + t: the latent is not rotated. The queries' rotary part q_rope must be turned
  /// at the same positions by the caller.
  template <class U>
  void append(const std::vector<Index>& sequences,
              const HeadsView<const U>& latent,  // (B, 1, Lnew, C)
              const HeadsView<const U>& rope,    // (B, 1, Lnew, R)
              const RotaryEmbedding<compute_type>& rotary, const std::vector<Index>& counts = {}) {
    constexpr const char* function = "LatentCache::append";
    check_append(function, sequences, latent, rope, counts);
    if (rotary.dim() == 0 || rotary.dim() != rope_dim_) {
      detail::throw_invalid_argument(
          function, rotary.dim() == 0
                        ? std::string("the rotary embedding is empty (default-constructed)")
                        : "the rotary embedding's head dim is " + std::to_string(rotary.dim()) +
                              " but the cache's rotary keys have R = " + std::to_string(rope_dim_) +
                              " values");
    }
    const detail::RotatedKeys<C> rotated =
        detail::rotate_new_keys(function, rope, counts, table_.lengths_of(sequences), rotary);
    store_all(sequences, latent, HeadsView<const C>(rotated.view), rotated.counts);
  }

  /// append() for rank-4 tensors or tensor maps (B, 1, Lnew, C) and (B, 1, Lnew, R).
  template <class TL, class TR, class = std::enable_if_t<detail::is_rank4_tensor_v<TL>>>
  void append(const std::vector<Index>& sequences,
              const TL& latent,  // (B, 1, Lnew, C)
              const TR& rope,    // (B, 1, Lnew, R)
              const std::vector<Index>& counts = {}) {
    append<detail::rank4_scalar_t<TL>>(sequences, detail::as_heads_view(latent),
                                       detail::as_heads_view(rope), counts);
  }
  /// The rotating append() for rank-4 tensors or tensor maps.
  template <class TL, class TR, class = std::enable_if_t<detail::is_rank4_tensor_v<TL>>>
  void append(const std::vector<Index>& sequences,
              const TL& latent,  // (B, 1, Lnew, C)
              const TR& rope,    // (B, 1, Lnew, R)
              const RotaryEmbedding<compute_type>& rotary, const std::vector<Index>& counts = {}) {
    append<detail::rank4_scalar_t<TL>>(sequences, detail::as_heads_view(latent),
                                       detail::as_heads_view(rope), rotary, counts);
  }

  /// Attention of q_latent (B, H, Lq, C + R), the absorbed queries [q_nope W_UK ; q_rope] of
  /// the last Lq tokens of each listed sequence (batch row b is sequences[b]), against its
  /// cached rows, written into o_latent (B, H, Lq, C): softmax(scale q K^T) V with K the rows
  /// [c ; k_rope] and V their first C columns, the bottom-right causal mask per sequence.
  /// options.scale must be given (MLA's scale is not 1 / sqrt(C + R)); the other options,
  /// the optional log-sum-exp and the kernels (decode, flash) are PagedKVCache::attend_into's.
  void attend_into(const std::vector<Index>& sequences,
                   const HeadsView<const compute_type>& q,             // (B, H, Lq, C + R)
                   const AttentionOutputViews<compute_type>& outputs,  // out (B, H, Lq, C), ...
                   const AttentionOptions<compute_type>& options) const {
    attend_latent("LatentCache::attend", sequences, q, outputs, options, true);
  }

  /// attend_into() without the causal mask: every query sees every cached token of its
  /// sequence (a prefix attended before the queries' own tokens, attn/shared_prefix.hpp).
  void attend_all_into(const std::vector<Index>& sequences,
                       const HeadsView<const compute_type>& q,             // (B, H, Lq, C + R)
                       const AttentionOutputViews<compute_type>& outputs,  // (B, H, Lq, C), ...
                       const AttentionOptions<compute_type>& options) const {
    attend_latent("LatentCache::attend_all", sequences, q, outputs, options, false);
  }

  /// attend_into() returning o_latent (B, H, Lq, C); q is a rank-4 tensor (B, H, Lq, C + R).
  Tensor<compute_type, 4> attend(const std::vector<Index>& sequences,
                                 const Tensor<compute_type, 4>& q,  // (B, H, Lq, C + R)
                                 const AttentionOptions<compute_type>& options) const {
    Tensor<compute_type, 4> out(q.dimension(0), q.dimension(1), q.dimension(2), latent_dim_);
    attend_into(sequences, bhld_view(q), bhld_view(out), options);
    return out;
  }

 private:
  /// C positive, R >= 0, both multiples of 32 (the block size) for a quantized format.
  static void check_dims(const char* function, Index latent_dim, Index rope_dim) {
    if (latent_dim < 1 || rope_dim < 0) {
      detail::throw_invalid_argument(function, "(C, R) is " +
                                                   detail::shape_string({latent_dim, rope_dim}) +
                                                   ": C must be positive and R >= 0");
    }
    if (is_quantized_v<S> &&
        (latent_dim % quantized_block_values != 0 || rope_dim % quantized_block_values != 0)) {
      detail::throw_invalid_argument(
          function, "(C, R) is " + detail::shape_string({latent_dim, rope_dim}) +
                        ": a quantized format needs multiples of 32 (its block size)");
    }
  }

  using C = compute_type;

  /// Storage units per row ([c ; k_rope]) and of its latent part.
  Index row_units() const { return dim() / values_per_unit_v<S>; }
  Index latent_units() const { return latent_dim_ / values_per_unit_v<S>; }
  /// Row `row` (< page_size) of pool page `page`, in storage units.
  Index offset(Index page, Index row) const { return (page * page_size() + row) * row_units(); }

  /// Adds `count` free pages to the pool (the held ones keep their ids and contents).
  void grow_pool(Index count) {
    const Index new_pages = pages() + count;
    pool_.resize(static_cast<std::size_t>(new_pages * page_size() * row_units()));
    table_.add_pages(count);
  }

  /// The checks of append(), before anything changes.
  template <class U>
  void check_append(const char* function, const std::vector<Index>& sequences,
                    const HeadsView<const U>& latent,  // (B, 1, Lnew, C)
                    const HeadsView<const U>& rope,    // (B, 1, Lnew, R)
                    const std::vector<Index>& counts) const {
    table_.check_sequences(function, sequences, latent.batch);
    const auto shapes = [&] {
      return "latent is " +
             detail::shape_string({latent.batch, latent.heads, latent.length, latent.dim}) +
             ", rope is " + detail::shape_string({rope.batch, rope.heads, rope.length, rope.dim}) +
             " and the cache's (C, R) is " + detail::shape_string({latent_dim_, rope_dim_});
    };
    if (rope.batch != latent.batch)
      detail::throw_invalid_argument(function, shapes() + ": batch sizes differ");
    if (latent.heads != 1 || rope.heads != 1) {
      detail::throw_invalid_argument(function, shapes() +
                                                   ": both must have one head (MLA's latent is "
                                                   "shared by every query head)");
    }
    if (latent.dim != latent_dim_ || rope.dim != rope_dim_)
      detail::throw_invalid_argument(function, shapes() + ": head dims differ");
    if (latent.length != rope.length)
      detail::throw_invalid_argument(function, shapes() + ": latent and rope lengths differ");
    detail::check_counts(function, counts, latent.batch, latent.length);
    const Index needed = table_.pages_needed(sequences, latent.length, counts);
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
  template <class U, class V>
  void store_all(const std::vector<Index>& sequences,
                 const HeadsView<const U>& latent,  // (B, 1, Lnew, C)
                 const HeadsView<const V>& rope,    // (B, 1, Lnew, R)
                 const std::vector<Index>& counts) {
    const Index needed = table_.pages_needed(sequences, latent.length, counts);
    if (needed > free_pages())
      grow_pool(std::max(needed - free_pages(), pages()));  // geometric: at least doubles
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      const Index id = sequences[b], n = counts.empty() ? latent.length : counts[b];
      const auto batch_row = static_cast<Index>(b);
      for (Index done = 0; done < n;) {
        const PageTable::Write at = table_.writable_page(id);
        const Index run = std::min(n - done, page_size() - at.row);
        if (at.copy_from != released_page) {  // copy-on-write of a shared last page
          std::copy_n(pool_.begin() + offset(at.copy_from, 0), at.row * row_units(),
                      pool_.begin() + offset(at.page, 0));
        }
        S* rows = pool_.data() + offset(at.page, at.row);
        detail::store_cache_rows<C>(latent, batch_row, 0, done, run, KVRotation::none, rows,
                                    row_units());
        if (rope_dim_ > 0) {  // (an empty rope view may have no data to offset)
          detail::store_cache_rows<C>(rope, batch_row, 0, done, run, KVRotation::none,
                                      rows + latent_units(), row_units());
        }
        table_.advance(id, run);
        done += run;
      }
    }
  }

  void attend_latent(const char* function, const std::vector<Index>& sequences,
                     const HeadsView<const C>& q,             // (B, H, Lq, C + R)
                     const AttentionOutputViews<C>& outputs,  // out (B, H, Lq, C), ...
                     const AttentionOptions<C>& options, bool causal) const {
    if (!options.scale) {
      detail::throw_invalid_argument(
          function,
          "options.scale is unset: give MLA's scale, that of the un-absorbed heads (1 / "
          "sqrt(nope + rope), 1 / sqrt(192) for DeepSeek), not the default 1 / sqrt(C + R) = 1 "
          "/ sqrt(" +
              std::to_string(dim()) + ")");
    }
    detail::PagedPools<S, S> pools;
    pools.keys = pool_.data();
    pools.values = pool_.data();  // V: the first C columns of the same rows
    pools.kv_heads = 1;
    pools.dim = dim();
    pools.value_dim = latent_dim_;
    pools.key_stride = pools.value_stride = row_units();
    pools.key_name = "[c ; k_rope] (cached)";
    pools.value_name = "c (cached)";
    detail::attend_pages(function, table_, pools, sequences, q, outputs, options, causal);
  }

  Index latent_dim_ = 0, rope_dim_ = 0;
  bool allow_growth_ = true;
  // the sequences, their block tables, the pages' reference counts
  detail::CacheBuffer<S> pool_;  // (pages, P, (C + R) / values_per_unit_v<S>)
};

}  // namespace attn
