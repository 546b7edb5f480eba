// attn/merge.hpp: one attention result from partial results over disjoint sets of keys.
//
// Attention over keys split into parts (split-K decoding, a shared prefix and each
// sequence's suffix, keys on other machines) is a merge of each part's state: its output,
// normalised over its own keys, and the natural log-sum-exp of its scores,
//   out_s = sum_{j in s} exp(x_j - lse_s) v_j,   lse_s = log sum_{j in s} exp(x_j).
// With M = max_s lse_s (and the learned sink z of the head, if given),
//   Z   = sum_s exp(lse_s - M) [+ exp(z - M)]
//   out = sum_s exp(lse_s - M) out_s / Z,        lse = M + log Z,
// which is exactly the attention over all the keys (docs/serving.md). A part that sees no
// key has lse -inf and weight 0; when every part is empty the row is 0 with lse -inf (the
// sink z with one). The sink belongs to the softmax once, so compute the parts without it
// and give it here. NaN propagates: a NaN log-sum-exp makes its row NaN, a NaN output
// element its column.
//
// The log-sum-exp is in base e, as FlashAttention, PyTorch and attn's kernels return it.
// FlashInfer returns log2 of the sum; convert with logsumexp_from_base2 before merging
// (mixing the two is a silent error, not a shape error).
//
// Extra memory: one row of Dv accumulators and one entry per state (the one statement of it).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attn/checks.hpp"
#include "attn/config.hpp"
#include "attn/outputs.hpp"
#include "attn/precision.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// The state of attention over one part of the keys: views of its output and its natural
/// log-sum-exp (e.g. the outputs of scaled_dot_product_attention_into with a logsumexp).
template <class TO>
struct AttentionState {
  HeadsView<const TO> out;                         ///< (B, H, L, Dv)
  RowsView<const compute_scalar_t<TO>> logsumexp;  ///< (B, H, L), base e
};

namespace detail {

template <class TO>
bool same_view(const HeadsView<const TO>& a, const HeadsView<const TO>& b) {
  return a.data == b.data && a.shape() == b.shape() && a.batch_stride == b.batch_stride &&
         a.head_stride == b.head_stride && a.row_stride == b.row_stride &&
         a.row_offsets == b.row_offsets;
}

/// The checks of merge_attention_states, before anything is written.
template <class TO>
void check_merge(const char* function, const std::vector<AttentionState<TO>>& states,
                 const AttentionOutputViews<TO>& merged,
                 const std::vector<compute_scalar_t<TO>>& sinks) {
  using C = compute_scalar_t<TO>;
  if (states.empty())
    throw_invalid_argument(function, "states is empty: give at least one state to merge");
  if (merged.weights)
    throw_invalid_argument(function, "merged.weights was given: a merge has no weights");
  const HeadsView<TO>& out = merged.out;
  for (std::size_t s = 0; s < states.size(); ++s) {
    const std::string name = "states[" + std::to_string(s) + "]";
    check_shape(function, (name + ".out").c_str(), states[s].out.shape(), out.shape(),
                "(B, H, L, Dv), merged.out's shape");
    const HeadsView<const C> lse = rows_as_heads(states[s].logsumexp);
    if (states[s].logsumexp.shape() != std::array<Index, 3>{out.batch, out.heads, out.length}) {
      throw_invalid_argument(
          function, name + ".logsumexp is " + shape_string({lse.batch, lse.heads, lse.length}) +
                        " but must be " + shape_string({out.batch, out.heads, out.length}) +
                        " (B, H, L) of merged.out");
    }
    for (Index b = 0; b < out.batch; ++b) {
      if (states[s].out.rows(b) != out.rows(b) || lse.rows(b) != out.rows(b)) {
        throw_invalid_argument(function, name + " holds " + std::to_string(states[s].out.rows(b)) +
                                             " rows (out) and " + std::to_string(lse.rows(b)) +
                                             " (logsumexp) of sequence " + std::to_string(b) +
                                             " but merged.out " + std::to_string(out.rows(b)) +
                                             ": the states must be of the same rows");
      }
    }
  }
  if (merged.logsumexp)
    check_rows_shape(function, "merged.logsumexp", *merged.logsumexp, HeadsView<const TO>(out));
  if (!sinks.empty() && static_cast<Index>(sinks.size()) != out.heads) {
    throw_invalid_argument(function, "sinks has " + std::to_string(sinks.size()) +
                                         " entries but there are " + std::to_string(out.heads) +
                                         " heads");
  }
  for (std::size_t h = 0; h < sinks.size(); ++h) {
    if (!std::isfinite(sinks[h])) {
      throw_invalid_argument(function, "sinks[" + std::to_string(h) + "] is " +
                                           std::to_string(sinks[h]) + ": must be finite");
    }
  }
  // In place means the very same view; any other overlap would read what was written.
  for (std::size_t s = 0; s < states.size(); ++s) {
    const std::string name = "states[" + std::to_string(s) + "]";
    const HeadsView<const C> lse = rows_as_heads(states[s].logsumexp);
    if (!same_view(HeadsView<const TO>(out), states[s].out) &&
        (byte_ranges_overlap<TO, TO>(out, states[s].out) || byte_ranges_overlap<TO, C>(out, lse))) {
      throw_invalid_argument(function, "merged.out overlaps " + name +
                                           " without being its out view: merge in place into "
                                           "one state's own out, or into separate memory");
    }
    if (merged.logsumexp) {
      const HeadsView<const C> merged_lse = rows_as_heads(*merged.logsumexp);
      if (!same_view(merged_lse, lse) && (byte_ranges_overlap<C, C>(merged_lse, lse) ||
                                          byte_ranges_overlap<C, TO>(merged_lse, states[s].out))) {
        throw_invalid_argument(
            function, "merged.logsumexp overlaps " + name + " without being its logsumexp view");
      }
    }
  }
  if (merged.logsumexp && byte_ranges_overlap<TO, C>(out, rows_as_heads(*merged.logsumexp)))
    throw_invalid_argument(function, "merged.out and merged.logsumexp overlap");
}

}  // namespace detail

/// Merges the states of attention over disjoint parts of the keys of the same query rows
/// into merged.out (B, H, L, Dv) and, when given, merged.logsumexp (B, H, L): the formula at
/// the top of this header. `sinks` (H, or empty) are learned sinks, counted once here (the
/// states must not include them). merged.out may be the very view of one state's out, and
/// merged.logsumexp of one state's logsumexp (in place); otherwise no output may overlap a
/// state. Padded or packed views (all packed alike). TO: float, double, long double, or
/// 16-bit storage of the outputs (the arithmetic in float, accumulated in double).
template <class TO>
void merge_attention_states(const std::vector<AttentionState<TO>>& states,
                            const AttentionOutputViews<TO>& merged,
                            const std::vector<compute_scalar_t<TO>>& sinks = {}) {
  static_assert(is_storage_scalar_v<TO>,
                "merge_attention_states: scalars must be floating point, Eigen::half or "
                "Eigen::bfloat16");
  using C = compute_scalar_t<TO>;
  // Sums in at least double, so that the order of the states changes no float result.
  using A = std::conditional_t<(sizeof(C) < sizeof(double)), double, C>;
  constexpr A minus_inf = -std::numeric_limits<A>::infinity();
  constexpr const char* function = "merge_attention_states";
  detail::check_merge(function, states, merged, sinks);
  const HeadsView<TO>& out = merged.out;
  const std::size_t parts = states.size();
  std::vector<A> lse(parts), acc(static_cast<std::size_t>(out.dim));
  for (Index b = 0; b < out.batch; ++b) {
    for (Index h = 0; h < out.heads; ++h) {
      const A sink = sinks.empty() ? minus_inf : A(sinks[static_cast<std::size_t>(h)]);
      for (Index i = 0; i < out.rows(b); ++i) {
        A max = sink;
        bool nan = false;
        for (std::size_t s = 0; s < parts; ++s) {
          lse[s] = A(detail::rows_as_heads(states[s].logsumexp).head(b, h)(i, 0));
          nan = nan || std::isnan(lse[s]);
          max = std::max(max, lse[s]);
        }
        A sum = sink == minus_inf ? A(0) : std::exp(sink - max);
        std::fill(acc.begin(), acc.end(), A(0));
        for (std::size_t s = 0; s < parts; ++s) {
          // An empty part (lse -inf) weighs 0; 0 * its out keeps a NaN in it.
          const A weight = lse[s] == minus_inf ? A(0) : std::exp(lse[s] - max);
          sum += weight;
          const auto row = states[s].out.head(b, h).row(i);
          for (Index e = 0; e < out.dim; ++e)
            acc[static_cast<std::size_t>(e)] += weight * A(static_cast<C>(row(e)));
        }
        // Every part empty: zeros (or NaN) and lse -inf, or the sink's lse with one.
        const A inverse = nan ? std::numeric_limits<A>::quiet_NaN() : sum > 0 ? A(1) / sum : A(1);
        auto merged_row = out.head(b, h).row(i);
        for (Index e = 0; e < out.dim; ++e)
          merged_row(e) =
              static_cast<TO>(static_cast<C>(acc[static_cast<std::size_t>(e)] * inverse));
        if (merged.logsumexp) {
          const A value = nan       ? std::numeric_limits<A>::quiet_NaN()
                          : sum > 0 ? max + std::log(sum)
                                    : minus_inf;
          detail::rows_as_heads(*merged.logsumexp).head(b, h)(i, 0) = static_cast<C>(value);
        }
      }
    }
  }
}

/// FlashInfer's log-sum-exp (log2 of the sum of exponentials) as attn's natural one, in
/// place: lse_e = lse_2 * ln 2.
template <class T>
void logsumexp_from_base2(const RowsView<T>& logsumexp) {  // (B, H, L)
  const HeadsView<T> rows = detail::rows_as_heads(logsumexp);
  for (Index b = 0; b < rows.batch; ++b) {
    for (Index h = 0; h < rows.heads; ++h)
      rows.head(b, h) *= T(0.693147180559945309417232121458176568L);
  }
}

/// attn's natural log-sum-exp as FlashInfer's base 2, in place: lse_2 = lse_e / ln 2.
template <class T>
void logsumexp_to_base2(const RowsView<T>& logsumexp) {  // (B, H, L)
  const HeadsView<T> rows = detail::rows_as_heads(logsumexp);
  for (Index b = 0; b < rows.batch; ++b) {
    for (Index h = 0; h < rows.heads; ++h)
      rows.head(b, h) *= T(1.442695040888963407359924681001892137L);
  }
}

}  // namespace attn
