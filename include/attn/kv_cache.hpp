// attn/kv_cache.hpp: a key/value cache for autoregressive decoding.
//
//   keys    (B, Hkv, capacity, D)    S: float, double, Eigen::half, Eigen::bfloat16, or
//                                    BlockQ8_0 / BlockQ4_0 (blocks of 32 along D)
//   values  (B, Hkv, capacity, Dv)   SV (S by default): the same choices
//   lengths (B)                      tokens held per sequence; each <= capacity
//
// Quantized formats (attn/quantized.hpp, docs/quantized-cache.md): K and V each float, 16-bit
// or q8_0 / q4_0 blocks, chosen independently (KVCache<BlockQ8_0, BlockQ4_0>, say); D (or
// Dv) of a quantized side must be a multiple of 32. Rows are quantized as they are appended,
// by ggml's reference rounding, and attend() reads the blocks in the decode kernel for a few
// queries (dequantized in registers) and in the flash kernel for a prompt (a key tile at a
// time into its workspace): no float copy of the cache is made. A block holding NaN or
// infinity reads back as 32 NaNs. Without a quantized side, S and SV must be the same.
//
// Rotation (KVRotation::hadamard): every appended key and value row is rotated by the
// orthonormal Hadamard matrix H of attn/hadamard.hpp before it is stored (after RoPE), the
// queries are rotated by H at attend() and the output rotated back, so the result is the
// same in exact arithmetic, (q H)(k H)^T = q k^T, while each quantized block sees its values
// spread evenly. Available for every format; it pays for 4-bit blocks.
//
// Each (b, kv head) owns `capacity` contiguous rows, so appending a token writes one row per
// head and never moves the others. Sequences may hold different numbers of tokens (ragged
// prompts): rows at or beyond lengths[b] are unused. When an append does not fit, the
// capacity grows geometrically (at least doubling) if allow_growth is set, so a sequence
// built token by token is copied O(log L) times, O(1) amortised per token; otherwise the
// append throws and the cache is unchanged.
//
// Rotary position embeddings: append(keys, values, rotary) rotates new token t of sequence b
// at position lengths[b] + t before storing it, so the cache holds rotated keys, each rotated
// once (never again on later appends or growth). The queries are rotated by the caller at
// the same positions (rotary.apply(q, lengths()) before the append); attend() itself knows
// nothing of positions.
//
// attend() computes the attention of Lq new queries against every cached token with the
// bottom-right causal alignment: the queries are the last Lq tokens of each sequence (they
// must have been appended first), so query i of sequence b sees keys j <= lengths[b] - Lq + i.
// Compute type C: double for S = double, float otherwise. K and V in half or bfloat16 are
// converted to float as they are streamed and every sum is accumulated in float
// (kernels/decode.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/attention.hpp"
#include "attn/cache/huge_pages.hpp"
#include "attn/cache/rows.hpp"
#include "attn/config.hpp"
#include "attn/hadamard.hpp"
#include "attn/kernels/decode.hpp"
#include "attn/outputs.hpp"
#include "attn/problem.hpp"
#include "attn/quantized.hpp"
#include "attn/rope.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Key/value cache of B sequences, Hkv heads, head dims D (keys) and Dv (values), keys
/// stored as S and values as SV.
template <class S, class SV = S>
class KVCache {
  template <class X>
  static constexpr bool is_format_v = std::is_same_v<X, float> || std::is_same_v<X, double> ||
                                      is_16bit_scalar_v<X> || is_quantized_v<X>;
  static_assert(is_format_v<S> && is_format_v<SV>,
                "KVCache: S and SV must be float, double, Eigen::half, Eigen::bfloat16, "
                "attn::BlockQ8_0 or attn::BlockQ4_0");
  static constexpr bool quantized = is_quantized_v<S> || is_quantized_v<SV>;
  static_assert(std::is_same_v<S, SV> ||
                    (quantized && !std::is_same_v<S, double> && !std::is_same_v<SV, double>),
                "KVCache: keys and values may differ only when one of them is quantized (and "
                "neither is double)");

 public:
  using storage_type = S;
  using key_storage = S;
  using value_storage = SV;
  /// The type of queries, outputs and accumulation: double for a double cache, else float.
  using compute_type = std::conditional_t<std::is_same_v<S, double>, double, float>;

  KVCache() = default;
  /// An empty cache (every length 0) with room for `capacity` tokens per sequence.
  KVCache(Index batch, Index kv_heads, Index dim, Index value_dim, Index capacity,
          bool allow_growth = true, KVRotation rotation = KVRotation::none)
      : batch_(batch),
        kv_heads_(kv_heads),
        dim_(dim),
        value_dim_(value_dim),
        allow_growth_(allow_growth),
        rotation_(rotation),
        lengths_(static_cast<std::size_t>(std::max(batch, Index(0))), 0) {
    if (batch < 1 || kv_heads < 1 || dim < 1 || value_dim < 1 || capacity < 0) {
      detail::throw_invalid_argument("KVCache",
                                     "(B, Hkv, D, Dv) is " +
                                         detail::shape_string({batch, kv_heads, dim, value_dim}) +
                                         " and capacity " + std::to_string(capacity) +
                                         ": sizes must be positive and the capacity >= 0");
    }
    const auto refuse_partial_blocks = [&](bool blocks, const char* name, Index d) {
      if (blocks && d % quantized_block_values != 0) {
        detail::throw_invalid_argument(
            "KVCache", "(B, Hkv, D, Dv) is " +
                           detail::shape_string({batch, kv_heads, dim, value_dim}) + ": " + name +
                           " is " + std::to_string(d) +
                           " but a quantized format needs a multiple of 32 (its block size)");
      }
    };
    refuse_partial_blocks(is_quantized_v<S>, "D", dim);
    refuse_partial_blocks(is_quantized_v<SV>, "Dv", value_dim);
    if (rotation != KVRotation::none && rotation != KVRotation::hadamard) {
      detail::throw_invalid_argument(
          "KVCache",
          "rotation is " + std::to_string(static_cast<int>(rotation)) + ": not a KVRotation");
    }
    allocate(capacity);
  }

  Index batch() const { return batch_; }
  Index kv_heads() const { return kv_heads_; }
  Index dim() const { return dim_; }
  Index value_dim() const { return value_dim_; }
  Index capacity() const { return capacity_; }
  bool allow_growth() const { return allow_growth_; }
  KVRotation rotation() const { return rotation_; }
  /// (B) tokens held per sequence.
  const std::vector<Index>& lengths() const { return lengths_; }
  /// The longest sequence: the L of keys_view() and values_view().
  Index max_length() const {
    return lengths_.empty() ? 0 : *std::max_element(lengths_.begin(), lengths_.end());
  }

  /// Empties every sequence; keeps the capacity.
  void clear() { std::fill(lengths_.begin(), lengths_.end(), Index(0)); }

  /// Makes room for at least `capacity` tokens per sequence (never shrinks). Allowed even
  /// when allow_growth is off: that flag only stops append() from growing implicitly.
  void reserve(Index capacity) {
    if (capacity > capacity_)
      allocate(capacity);
  }

  /// (B, Hkv, max_length, D) view of the keys: rows j >= lengths()[b] of sequence b are
  /// unused (pass lengths() as AttentionOptions::key_lengths with Causal::bottom_right: each
  /// sequence's diagonal is then measured from its own length). B and H strides span the
  /// whole capacity; valid until the next append, reserve or destruction. For a quantized S
  /// its dim counts blocks, D / 32 per row, and its strides are in blocks; with rotation the
  /// rows are rotated.
  HeadsView<const S> keys_view() const { return view(keys_.data(), dim_ / values_per_unit_v<S>); }
  /// (B, Hkv, max_length, Dv) view of the values, as keys_view().
  HeadsView<const SV> values_view() const {
    return view(values_.data(), value_dim_ / values_per_unit_v<SV>);
  }

  /// Appends Lnew tokens to every sequence, converting them to S. keys (B, Hkv, Lnew, D),
  /// values (B, Hkv, Lnew, Dv), any strided layout, of any floating type U (float, double
  /// or S). `counts` (B), if given, says how many of the Lnew rows are real for each
  /// sequence (ragged prompts; the rest are ignored); by default all Lnew are.
  template <class U>
  void append(const HeadsView<const U>& keys,    // (B, Hkv, Lnew, D)
              const HeadsView<const U>& values,  // (B, Hkv, Lnew, Dv)
              const std::vector<Index>& counts = {}) {
    check_append("KVCache::append", keys, values, counts);
    store_all(keys, values, counts);
  }

  /// append() that first rotates the keys with `rotary` (RoPE): new token t of sequence b
  /// turns by its position lengths()[b] + t, so the cache holds rotated keys and each key
  /// is rotated exactly once, when it enters. The queries that attend to them must be
  /// rotated at the same positions (rotary.apply(q, lengths()) before this call). The
  /// rotation runs in compute_type on a copy of the new keys, then the keys are rounded to
  /// S once; the caller's keys are not modified. Throws, leaving the cache unchanged, when
  /// the table's head dim is not D or a new token's position is beyond its max_positions.
  template <class U>
  void append(const HeadsView<const U>& keys,    // (B, Hkv, Lnew, D)
              const HeadsView<const U>& values,  // (B, Hkv, Lnew, Dv)
              const RotaryEmbedding<compute_type>& rotary, const std::vector<Index>& counts = {}) {
    constexpr const char* function = "KVCache::append";
    check_append(function, keys, values, counts);
    const detail::RotatedKeys<C> rotated =
        detail::rotate_new_keys(function, keys, counts, lengths_, rotary);
    store_all(HeadsView<const C>(rotated.view), values, rotated.counts);
  }

  /// append() for rank-4 tensors or tensor maps (B, Hkv, Lnew, D) and (B, Hkv, Lnew, Dv).
  template <class TK, class TV, class = std::enable_if_t<detail::is_rank4_tensor_v<TK>>>
  void append(const TK& keys, const TV& values, const std::vector<Index>& counts = {}) {
    append<detail::rank4_scalar_t<TK>>(detail::as_heads_view(keys), detail::as_heads_view(values),
                                       counts);
  }
  /// The rotating append() for rank-4 tensors or tensor maps.
  template <class TK, class TV, class = std::enable_if_t<detail::is_rank4_tensor_v<TK>>>
  void append(const TK& keys, const TV& values, const RotaryEmbedding<compute_type>& rotary,
              const std::vector<Index>& counts = {}) {
    append<detail::rank4_scalar_t<TK>>(detail::as_heads_view(keys), detail::as_heads_view(values),
                                       rotary, counts);
  }

  /// Attention of Lq new queries q (B, Hq, Lq, D), the last Lq tokens of every sequence,
  /// against the cache, written into out (B, Hq, Lq, Dv) (any strided views), with the
  /// bottom-right causal alignment per sequence, in one call through the kernels (ragged
  /// sequences included). `options` may add a window, sink tokens, ALiBi slopes, a softcap,
  /// learned sinks, a scale, a keep-mask and a bias (both broadcastable to (B, Hq, Lq, Lk),
  /// Lk = max_length(), key j being cache row j of each sequence); its causal, key_lengths
  /// and query_lengths must be left unset (the cache decides them). Optional results as
  /// in scaled_dot_product_attention_into: outputs.logsumexp (B, Hq, Lq) and outputs.weights
  /// (B, Hq, Lq, Lk), Lk = max_length().
  void attend_into(const HeadsView<const compute_type>& q,             // (B, Hq, Lq, D)
                   const AttentionOutputViews<compute_type>& outputs,  // out (B, Hq, Lq, Dv), ...
                   const AttentionOptions<compute_type>& options = {}) const {
    attend_cached("KVCache::attend", q, outputs, options, true);
  }

  /// attend_into() without the causal mask: every query sees every cached token of its
  /// sequence (its own length when they are ragged), and the queries need not be in the
  /// cache. Cross-attention to a cached encoder output, or a prefix that comes before all
  /// the queries (attn/shared_prefix.hpp). The same options, outputs and kernels.
  void attend_all_into(const HeadsView<const compute_type>& q,             // (B, Hq, Lq, D)
                       const AttentionOutputViews<compute_type>& outputs,  // (B, Hq, Lq, Dv), ...
                       const AttentionOptions<compute_type>& options = {}) const {
    attend_cached("KVCache::attend_all", q, outputs, options, false);
  }

  /// attend_into() returning out (B, Hq, Lq, Dv); q is a rank-4 tensor (B, Hq, Lq, D).
  Tensor<compute_type, 4> attend(const Tensor<compute_type, 4>& q,  // (B, Hq, Lq, D)
                                 const AttentionOptions<compute_type>& options = {}) const {
    Tensor<compute_type, 4> out(q.dimension(0), q.dimension(1), q.dimension(2), value_dim_);
    attend_into(bhld_view(q), bhld_view(out), options);
    return out;
  }

 private:
  using C = compute_type;

  /// attend_into() (causal) or attend_all_into(), `function` naming it in errors.
  void attend_cached(const char* function, const HeadsView<const C>& q,  // (B, Hq, Lq, D)
                     const AttentionOutputViews<C>& outputs,             // (B, Hq, Lq, Dv), ...
                     const AttentionOptions<C>& options, bool causal) const {
    const HeadsView<compute_type>& out = outputs.out;
    // The rules and wording of scaled_dot_product_attention, k and v being the cache's.
    const HeadsView<const S> keys = keys_view();
    const HeadsView<const SV> values = values_view();
    // Packing first, as in scaled_dot_product_attention: the cache's rows are not packed.
    detail::check_attention_packing(function, q, keys, values, outputs);
    detail::check_attention_shapes(function, q, shape_of(keys, dim_), shape_of(values, value_dim_),
                                   "k (cached)", "v (cached)");
    detail::check_output_shape(function, q, value_dim_, out);
    if (options.causal != Causal::none || !options.key_lengths.empty() ||
        !options.query_lengths.empty()) {
      detail::throw_invalid_argument(
          function, std::string("options.causal, options.key_lengths and options.query_lengths "
                                "must be unset: the cache applies ") +
                        (causal ? "the bottom-right causal mask and its own lengths"
                                : "its own lengths (every query sees every cached token)"));
    }
    for (Index b = 0; b < batch_ && causal; ++b) {
      if (lengths_[static_cast<std::size_t>(b)] < q.length) {
        detail::throw_invalid_argument(
            function, "q is " + detail::shape_string({q.batch, q.heads, q.length, q.dim}) + ": " +
                          std::to_string(q.length) + " queries but sequence " + std::to_string(b) +
                          " holds only " + std::to_string(lengths_[static_cast<std::size_t>(b)]) +
                          " tokens (append the new tokens first)");
      }
    }
    if (q.length == 0)
      return;
    // One call: the mask aligns each sequence's diagonal to its own length (query i of b
    // sees j <= lengths[b] - Lq + i), so ragged sequences run in parallel together. The
    // kernels of scaled_dot_product_attention (decode for a few queries, flash for a prompt;
    // a 16-bit cache widened as it is read, a quantized one dequantized), their messages
    // naming KVCache::attend.
    AttentionOptions<C> o = options;
    o.causal = causal ? Causal::bottom_right : Causal::none;
    if (std::any_of(lengths_.begin(), lengths_.end(), [&](Index n) { return n != max_length(); }))
      o.key_lengths = lengths_;
    if (rotation_ == KVRotation::none)
      return attend_stored(function, q, outputs, o);
    // The queries rotated like the keys; the output, rotated like the values, turned back.
    // The outputs are checked against the caller's q here: the kernels see only a copy.
    detail::check_output_aliasing(function, q, keys, values, out);
    detail::check_optional_outputs(function, q, keys, values, outputs);
    std::vector<C> rotated(static_cast<std::size_t>(q.batch * q.heads * q.length * dim_));
    const HeadsView<C> q_rotated = bhld_view(rotated.data(), q.batch, q.heads, q.length, dim_);
    for (Index b = 0; b < q.batch; ++b) {
      for (Index h = 0; h < q.heads; ++h) {
        q_rotated.head(b, h) = q.head(b, h);
        for (Index i = 0; i < q.length; ++i)
          hadamard_rotate(q_rotated.head(b, h).row(i).data(), dim_);
      }
    }
    attend_stored(function, q_rotated, outputs, o);
    for (Index b = 0; b < out.batch; ++b) {
      for (Index h = 0; h < out.heads; ++h) {
        for (Index i = 0; i < out.length; ++i)
          hadamard_rotate(out.head(b, h).row(i).data(), value_dim_);
      }
    }
  }

  template <class X>
  HeadsView<const X> view(const X* data, Index units) const {
    return {data,
            batch_,
            kv_heads_,
            max_length(),
            units,
            kv_heads_ * capacity_ * units,
            capacity_ * units,
            units};
  }

  /// A view's shape with `dim` values per row and no data: what the shape checks measure.
  template <class X>
  static HeadsView<const C> shape_of(const HeadsView<const X>& x, Index dim) {
    return {nullptr, x.batch, x.heads, x.length, dim, 0, 0, dim};
  }

  /// attend_into() after the cache's own checks and options, q rotated when the rows are.
  void attend_stored(const char* function,
                     const HeadsView<const C>& q,             // (B, Hq, Lq, D)
                     const AttentionOutputViews<C>& outputs,  // out (B, Hq, Lq, Dv), ...
                     const AttentionOptions<C>& options) const {
    const HeadsView<const S> keys = keys_view();
    const HeadsView<const SV> values = values_view();
    if constexpr (!quantized) {
      detail::attention_into<C, S, C>(function, q, keys, values, outputs, options);
    } else {
      // The checks of attention_into that concern a quantized cache, in its words.
      detail::check_output_aliasing(function, q, keys, values, outputs.out);
      if (outputs.weights) {
        detail::throw_invalid_argument(function,
                                       "weights are not available with a quantized cache (its "
                                       "kernels, decode and flash, never form them)");
      }
      detail::check_optional_outputs(function, q, keys, values, outputs);
      if (options.algorithm != Algorithm::automatic && options.algorithm != Algorithm::decode &&
          options.algorithm != Algorithm::flash) {
        detail::throw_invalid_argument(
            function, std::string("options.algorithm is ") + algorithm_name(options.algorithm) +
                          ": a quantized cache runs the decode or the flash kernel (automatic, "
                          "decode or flash)");
      }
      const C scale = detail::resolve_scale(function, options.scale, q.dim);
      AttentionShape shape{q.batch,      q.heads, kv_heads_,  q.length,
                           max_length(), dim_,    value_dim_, 1};
      shape.kv_quantized = true;
      shape.k_int8_readable = is_quantized_v<S>;
      const KernelPlan plan = plan_attention<C>(shape, options, false, function);
      const AttentionProblem<C> problem(function, q.batch, q.heads, q.length, max_length(), options,
                                        plan.isa);
      const detail::RowValues<C> logsumexp =
          outputs.logsumexp ? detail::row_values(*outputs.logsumexp) : detail::RowValues<C>{};
      if (plan.algorithm == Algorithm::decode)
        detail::decode_attention<C, S, SV>(plan, q, keys, values, outputs.out, problem, scale,
                                           logsumexp);
      else
        detail::run_flash(plan, q, keys, values, outputs.out, problem, scale, logsumexp);
    }
  }

  /// Storage units per row: values, or blocks of 32 for a quantized format.
  Index key_units() const { return dim_ / values_per_unit_v<S>; }
  Index value_units() const { return value_dim_ / values_per_unit_v<SV>; }

  Index row_offset(Index b, Index h, Index row, Index units) const {
    return ((b * kv_heads_ + h) * capacity_ + row) * units;
  }

  std::string lengths_string() const { return detail::list_string(lengths_); }

  template <class U>
  static Index count_of(const HeadsView<const U>& keys, const std::vector<Index>& counts, Index b) {
    return counts.empty() ? keys.length : counts[static_cast<std::size_t>(b)];
  }

  /// The shape and counts checks of append(), before anything changes.
  template <class U, class V>
  void check_append(const char* function, const HeadsView<const U>& keys,
                    const HeadsView<const V>& values, const std::vector<Index>& counts) const {
    detail::check_new_rows(function, keys, values, counts, batch_, kv_heads_, dim_, value_dim_);
    Index needed = 0;
    for (Index b = 0; b < batch_; ++b)
      needed = std::max(needed, lengths_[static_cast<std::size_t>(b)] + count_of(keys, counts, b));
    if (needed > capacity_ && !allow_growth_) {
      detail::throw_invalid_argument(
          function, "appending " + std::to_string(keys.length) + " tokens to lengths " +
                        lengths_string() + " needs " + std::to_string(needed) +
                        " rows but the capacity is " + std::to_string(capacity_) +
                        " and allow_growth is off");
    }
  }

  /// The first counts[b] (all, if counts is empty) rows of each sequence into the cache,
  /// growing it when needed; the inputs have been checked.
  template <class K, class V>
  void store_all(const HeadsView<const K>& keys, const HeadsView<const V>& values,
                 const std::vector<Index>& counts) {
    Index needed = 0;
    for (Index b = 0; b < batch_; ++b)
      needed = std::max(needed, lengths_[static_cast<std::size_t>(b)] + count_of(keys, counts, b));
    if (needed > capacity_)
      allocate(std::max(needed, 2 * capacity_));  // geometric: O(1) amortised per token
    for (Index b = 0; b < batch_; ++b) {
      const Index length = lengths_[static_cast<std::size_t>(b)], n = count_of(keys, counts, b);
      for (Index h = 0; h < kv_heads_; ++h) {
        detail::store_cache_rows<C>(keys, b, h, 0, n, rotation_,
                                    keys_.data() + row_offset(b, h, length, key_units()));
        detail::store_cache_rows<C>(values, b, h, 0, n, rotation_,
                                    values_.data() + row_offset(b, h, length, value_units()));
      }
      lengths_[static_cast<std::size_t>(b)] = length + n;
    }
  }

  /// Moves the held tokens into buffers of `capacity` rows per (b, kv head).
  void allocate(Index capacity) {
    detail::CacheBuffer<S> keys(
        static_cast<std::size_t>(batch_ * kv_heads_ * capacity * key_units()));
    detail::CacheBuffer<SV> values(
        static_cast<std::size_t>(batch_ * kv_heads_ * capacity * value_units()));
    const auto move_rows = [&](const auto& from, auto& to, Index b, Index h, Index units) {
      const auto* first = from.data() + ((b * kv_heads_ + h) * capacity_) * units;
      std::copy(first, first + lengths_[static_cast<std::size_t>(b)] * units,
                to.data() + ((b * kv_heads_ + h) * capacity) * units);
    };
    for (Index b = 0; b < batch_; ++b) {
      for (Index h = 0; h < kv_heads_; ++h) {
        move_rows(keys_, keys, b, h, key_units());
        move_rows(values_, values, b, h, value_units());
      }
    }
    keys_ = std::move(keys);
    values_ = std::move(values);
    capacity_ = capacity;
  }

  Index batch_ = 0, kv_heads_ = 0, dim_ = 0, value_dim_ = 0, capacity_ = 0;
  bool allow_growth_ = true;
  KVRotation rotation_ = KVRotation::none;
  std::vector<Index> lengths_;      // (B)
  detail::CacheBuffer<S> keys_;     // (B, Hkv, capacity, D / values_per_unit_v<S>)
  detail::CacheBuffer<SV> values_;  // (B, Hkv, capacity, Dv / values_per_unit_v<SV>)
};

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_KV_CACHE_CLASSES(ATTN_EXTERN_CLASS)
#endif
