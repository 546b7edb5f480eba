// attn/cache/rows.hpp: what a cache does with the rows of a new token, shared by KVCache and
// PagedKVCache: the checks of an append, the rotary embedding of new keys, and the storing
// of a run of rows (converted, Hadamard-rotated, quantized) into the cache's memory.
//
//   keys    (B, Hkv, Lnew, D)    any strided layout, any floating type U
//   values  (B, Hkv, Lnew, Dv)
//   counts  (B) or empty         real rows per sequence
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "attn/config.hpp"
#include "attn/hadamard.hpp"
#include "attn/precision.hpp"
#include "attn/quantized.hpp"
#include "attn/rope.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Whether a cache rotates its rows by a Hadamard matrix (attn/hadamard.hpp).
enum class KVRotation { none, hadamard };

namespace detail {

/// Rows [first, first + n) of head (b, h) of x (D values each, any floating type U) into
/// `dst`, n rows `dst_stride` storage units apart (0: D / values_per_unit_v<X>, contiguous)
/// stored as X: converted, rotated by the Hadamard matrix first when `rotation` says so (in
/// compute type C, then rounded to X once), quantized when X is a block. What a cache stores
/// when a token enters.
template <class C, class U, class X>
void store_cache_rows(const HeadsView<const U>& x,  // (B, H, L, D)
                      Index b, Index h, Index first, Index n, KVRotation rotation, X* dst,
                      Index dst_stride = 0) {
  if (n <= 0)
    return;
  const Index dim = x.dim;
  const Index stride = dst_stride > 0 ? dst_stride : dim / values_per_unit_v<X>;
  const auto value = [](U u) {
    if constexpr (is_16bit_scalar_v<U>)  // half <-> bfloat16 convert through float
      return static_cast<float>(u);
    else
      return u;
  };
  if constexpr (!is_quantized_v<X>) {
    if (rotation == KVRotation::none) {
      for (Index r = 0; r < n; ++r) {
        const U* src = row_data(x, b, h, first + r);
        if constexpr (std::is_same_v<U, X>)
          std::copy(src, src + dim, dst + r * stride);
        else
          for (Index d = 0; d < dim; ++d)
            dst[r * stride + d] = static_cast<X>(value(src[d]));
      }
      return;
    }
  }
  // Each row through a buffer in the compute type: rotated, then rounded to X once.
  std::vector<C> row(static_cast<std::size_t>(dim));
  std::vector<float> narrow(is_quantized_v<X> ? static_cast<std::size_t>(dim) : 0);
  for (Index r = 0; r < n; ++r) {
    const U* src = row_data(x, b, h, first + r);
    for (Index d = 0; d < dim; ++d)
      row[static_cast<std::size_t>(d)] = static_cast<C>(value(src[d]));
    if (rotation == KVRotation::hadamard)
      hadamard_rotate(row.data(), dim);
    if constexpr (is_quantized_v<X>) {
      std::copy(row.begin(), row.end(), narrow.begin());
      quantize_blocks(narrow.data(), dim, dst + r * stride);
    } else {
      for (Index d = 0; d < dim; ++d)
        dst[r * stride + d] = static_cast<X>(row[static_cast<std::size_t>(d)]);
    }
  }
}

/// Throws unless `counts` is empty or has B entries in [0, Lnew]: how many of the Lnew new
/// rows of each sequence an append stores.
inline void check_counts(const char* function, const std::vector<Index>& counts, Index batch,
                         Index new_rows) {
  if (counts.empty())
    return;
  if (static_cast<Index>(counts.size()) != batch) {
    detail::throw_invalid_argument(function, "counts has " + std::to_string(counts.size()) +
                                                 " entries but the batch size is " +
                                                 std::to_string(batch));
  }
  for (std::size_t b = 0; b < counts.size(); ++b) {
    if (counts[b] < 0 || counts[b] > new_rows) {
      detail::throw_invalid_argument(
          function, "counts[" + std::to_string(b) + "] is " + std::to_string(counts[b]) +
                        ": must lie in [0, Lnew] with Lnew = " + std::to_string(new_rows));
    }
  }
}

/// The checks of a cache's append on the new keys (B, Hkv, Lnew, D), values (B, Hkv, Lnew,
/// Dv) and counts (empty, or B entries in [0, Lnew]) against the cache's (B, Hkv, D, Dv).
template <class U, class V>
void check_new_rows(const char* function, const HeadsView<const U>& keys,
                    const HeadsView<const V>& values, const std::vector<Index>& counts, Index batch,
                    Index kv_heads, Index dim, Index value_dim) {
  const auto shapes = [&] {
    return "keys are " + detail::shape_string({keys.batch, keys.heads, keys.length, keys.dim}) +
           ", values are " +
           detail::shape_string({values.batch, values.heads, values.length, values.dim}) +
           " and the cache is (B, Hkv, D, Dv) = " +
           detail::shape_string({batch, kv_heads, dim, value_dim});
  };
  if (keys.batch != batch || values.batch != batch)
    detail::throw_invalid_argument(function, shapes() + ": batch sizes differ");
  if (keys.heads != kv_heads || values.heads != kv_heads)
    detail::throw_invalid_argument(function, shapes() + ": head counts differ");
  if (keys.dim != dim || values.dim != value_dim)
    detail::throw_invalid_argument(function, shapes() + ": head dims differ");
  if (keys.length != values.length)
    detail::throw_invalid_argument(function, shapes() + ": keys and values lengths differ");
  check_counts(function, counts, batch, keys.length);
}

/// New keys turned by a rotary embedding, packed: sequence b's counts[b] rows start at
/// offsets[b] of `rows`; `view` reads them as (B, Hkv, max count, D).
template <class C>
struct RotatedKeys {
  std::vector<Index> offsets;  // (B + 1)
  std::vector<Index> counts;   // (B)
  std::vector<C> rows;         // (sum of counts, Hkv, D)
  HeadsView<C> view;           // packed over rows and offsets
};

/// The first counts[b] (all, if empty) of the new keys (B, Hkv, Lnew, D) of each sequence b
/// turned by `rotary` from position lengths[b] on, in compute type C, the caller's keys
/// untouched. Throws when the table's head dim is not D or a position is beyond its
/// max_positions; `function` names the caller.
template <class C, class U>
RotatedKeys<C> rotate_new_keys(const char* function, const HeadsView<const U>& keys,
                               const std::vector<Index>& counts, const std::vector<Index>& lengths,
                               const RotaryEmbedding<C>& rotary) {
  const Index batch = keys.batch, kv_heads = keys.heads, dim = keys.dim;
  if (rotary.dim() != dim) {
    throw_invalid_argument(
        function, rotary.dim() == 0
                      ? std::string("the rotary embedding is empty (default-constructed)")
                      : "the rotary embedding's head dim is " + std::to_string(rotary.dim()) +
                            " but the cache's key head dim D is " + std::to_string(dim));
  }
  RotatedKeys<C> rotated;
  rotated.offsets.assign(static_cast<std::size_t>(batch + 1), 0);
  rotated.counts.resize(static_cast<std::size_t>(batch));
  for (Index b = 0; b < batch; ++b) {
    const auto i = static_cast<std::size_t>(b);
    const Index first = lengths[i], n = counts.empty() ? keys.length : counts[i];
    if (n > 0 && first > rotary.max_positions() - n) {
      throw_invalid_argument(
          function, "sequence " + std::to_string(b) + " holds " + std::to_string(first) +
                        " tokens: its " + std::to_string(n) + " new keys need positions [" +
                        std::to_string(first) + ", " + std::to_string(first + n) +
                        ") but the rotary table holds [0, " +
                        std::to_string(rotary.max_positions()) + ")");
    }
    rotated.counts[i] = n;
    rotated.offsets[i + 1] = rotated.offsets[i] + n;
  }
  const Index rows = rotated.offsets.back();
  rotated.rows.resize(static_cast<std::size_t>(rows * kv_heads * dim));
  rotated.view = unchecked_packed_view(
      blhd_view(rotated.rows.data(), Index(1), rows, kv_heads, dim), rotated.offsets);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < kv_heads; ++h) {
      const HeadMatrix<const U> from = keys.head(b, h);
      HeadMatrix<C> to = rotated.view.head(b, h);
      for (Index r = 0; r < to.rows(); ++r) {
        for (Index d = 0; d < dim; ++d) {
          if constexpr (is_16bit_scalar_v<U>)
            to(r, d) = static_cast<C>(static_cast<float>(from(r, d)));
          else
            to(r, d) = static_cast<C>(from(r, d));
        }
      }
    }
  }
  rotary.apply(rotated.view, lengths);
  return rotated;
}

}  // namespace detail

}  // namespace attn
