// attn/distributed/ring_blocks.hpp: what the ring forward and backward share: the agreed
// layout of a call (every rank's runs of queries and keys), the options a ring supports, and
// the walk over the pieces of one block (attn/distributed/block_pieces.hpp) on sub-views.
//
//   q    (B, Hq,  lq, D)    this rank's queries: its runs of the Lq global rows, in order
//   k    (B, Hkv, lk, D)    this rank's keys: its runs of the Lk global rows
//   v    (B, Hkv, lk, Dv)
//
// Every option is global: causal (both alignments, measured on Lq and Lk), window, key and
// query lengths (B entries, global), sink tokens, learned sinks, scale, softcap, algorithm,
// tiles. The options that name positions by the local view (keep_mask, bias, ALiBi,
// score_mod, mask_mod, block_mask) and dropout are refused, as are packed views: packed
// sequences are RingOptions::cu_seqlens_q and cu_seqlens_k over the global token streams,
// each block then cut by sequence before it is cut into pieces.
//
// Extra memory: none beyond the layout (the callers state theirs).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/config.hpp"
#include "attn/distributed/agreement.hpp"
#include "attn/distributed/block_pieces.hpp"
#include "attn/distributed/ring_transfer.hpp"
#include "attn/distributed/sequence_split.hpp"
#include "attn/options.hpp"
#include "attn/problem.hpp"
#include "attn/tensor.hpp"

namespace attn::distributed {

/// How a ring call is laid out across the ranks, and where it reports its timings.
struct RingOptions {
  SequenceSplit split = SequenceSplit::contiguous;  ///< the same split for queries and keys
  RingStats* stats = nullptr;                       ///< filled in when given
  /// Query rows per attention call (0: a whole run): between calls the ring lets MPI move
  /// the transfers along, so a block is not one long call (measured: docs/distributed.md).
  /// Changes the rounding, not the result; need not agree across ranks.
  Index query_chunk = 512;
  /// Packed sequences (FlashAttention's varlen): the offsets (B + 1) of B sequences in the
  /// global stream of Lq query tokens and of Lk key tokens, the same on every rank; empty:
  /// not packed. The split then deals the token streams, the local views are (1, H, l, D) of
  /// this rank's tokens, and every option applies per sequence (key_lengths and
  /// query_lengths must be empty). Both or neither.
  std::vector<Index> cu_seqlens_q{}, cu_seqlens_k{};
};

namespace detail {

/// Rows [row, row + rows) of batch entries [b0, b0 + nb) of a view.
template <class T>
HeadsView<T> sub_view(HeadsView<T> x, Index b0, Index nb, Index row, Index rows) {
  if (x.data != nullptr)
    x.data += b0 * x.batch_stride + row * x.row_stride;
  x.batch = nb;
  x.length = rows;
  return x;
}

template <class T>
RowsView<T> sub_rows(RowsView<T> x, Index b0, Index nb, Index row, Index rows) {
  if (x.data != nullptr)
    x.data += b0 * x.batch_stride + row;
  x.batch = nb;
  x.length = rows;
  return x;
}

/// The agreed shape of a ring call: every rank's runs and the global lengths.
struct RingLayout {
  int ranks = 1, rank = 0;
  Index batch = 0, q_heads = 0, kv_heads = 0, dim = 0, value_dim = 0;
  Index q_length = 0, k_length = 0;                   // global Lq, Lk
  std::vector<std::vector<TokenRun>> q_runs, k_runs;  // per rank
  std::vector<Index> k_rows;                          // per rank: lk_r
  Index query_chunk = 0;                              // query rows a call (0: a whole run)
  std::vector<Index> cu_q, cu_k;                      // packed: (B + 1) offsets, else empty

  int next() const { return (rank + 1) % ranks; }
  int previous() const { return (rank + ranks - 1) % ranks; }
  /// Elements of rank r's K and V block: B Hkv lk_r (D + Dv).
  Index kv_elements(int r) const {
    return batch * kv_heads * k_rows[static_cast<std::size_t>(r)] * (dim + value_dim);
  }
  Index max_kv_elements() const {
    Index n = 0;
    for (int r = 0; r < ranks; ++r)
      n = std::max(n, kv_elements(r));
    return n;
  }
};

/// Throws unless the options are ones a split sequence supports (the header's list); with
/// `whole_heads` (all-to-all heads: each rank attends whole heads) ALiBi too.
template <class T>
void check_ring_options(const char* function, const AttentionOptions<T>& options,
                        bool whole_heads = false) {
  const char* refused = !options.keep_mask.empty()                      ? "keep_mask"
                        : !options.bias.empty()                         ? "bias"
                        : !options.alibi_slopes.empty() && !whole_heads ? "alibi_slopes"
                        : options.score_mod                             ? "score_mod"
                        : options.mask_mod                              ? "mask_mod"
                        : !options.block_mask.empty()                   ? "block_mask"
                        : options.dropout_p != 0                        ? "dropout_p"
                                                                        : nullptr;
  if (refused != nullptr) {
    attn::detail::throw_invalid_argument(
        function, std::string("options.") + refused +
                      " is given: a split sequence supports causal, window, key and query "
                      "lengths, sink tokens, learned sinks, scale and softcap "
                      "(docs/distributed.md)");
  }
}

/// The numbers every rank must share: shapes and options (not the vectors' values).
template <class T>
std::vector<SignatureField> ring_signature(const HeadsView<const T>& q,  // (B, Hq, lq, D)
                                           const HeadsView<const T>& k,  // (B, Hkv, lk, D)
                                           const HeadsView<const T>& v,  // (B, Hkv, lk, Dv)
                                           const AttentionOptions<T>& options,
                                           const RingOptions& ring) {
  const auto i64 = [](auto x) { return static_cast<std::int64_t>(x); };
  const SequenceSplit split = ring.split;
  return {{"B", i64(q.batch)},
          {"Hq", i64(q.heads)},
          {"Hkv", i64(k.heads)},
          {"D", i64(q.dim)},
          {"Dv", i64(v.dim)},
          {"split", i64(split)},
          {"options.causal", i64(options.causal)},
          {"options.window.left", i64(options.window.left)},
          {"options.window.right", i64(options.window.right)},
          {"options.sink_tokens", i64(options.sink_tokens)},
          {"options.key_lengths.size()", i64(options.key_lengths.size())},
          {"options.query_lengths.size()", i64(options.query_lengths.size())},
          {"options.sinks.size()", i64(options.sinks.size())},
          {"options.alibi_slopes.size()", i64(options.alibi_slopes.size())},
          {"options.scale given", i64(options.scale.has_value())},
          {"options.scale", double_bits(double(options.scale.value_or(T(0)))), true, true},
          {"options.softcap given", i64(options.softcap.has_value())},
          {"options.softcap", double_bits(double(options.softcap.value_or(T(0)))), true, true},
          {"options.algorithm", i64(options.algorithm)},
          {"options.compute", i64(options.compute)},
          {"ring.cu_seqlens_q.size()", i64(ring.cu_seqlens_q.size())},
          {"ring.cu_seqlens_k.size()", i64(ring.cu_seqlens_k.size())},
          {"lq (this rank's queries)", i64(q.length), false},
          {"lk (this rank's keys)", i64(k.length), false}};
}

/// The option vectors, once their sizes agree.
template <class T>
std::vector<SignatureField> ring_vectors(const AttentionOptions<T>& options,
                                         const RingOptions& ring) {
  std::vector<SignatureField> fields;
  for (const Index n : ring.cu_seqlens_q)
    fields.push_back({"ring.cu_seqlens_q[b]", static_cast<std::int64_t>(n)});
  for (const Index n : ring.cu_seqlens_k)
    fields.push_back({"ring.cu_seqlens_k[b]", static_cast<std::int64_t>(n)});
  for (const Index n : options.key_lengths)
    fields.push_back({"options.key_lengths[b]", static_cast<std::int64_t>(n)});
  for (const Index n : options.query_lengths)
    fields.push_back({"options.query_lengths[b]", static_cast<std::int64_t>(n)});
  for (const T z : options.sinks)
    fields.push_back({"options.sinks[h]", double_bits(double(z)), true, true});
  for (const T slope : options.alibi_slopes)
    fields.push_back({"options.alibi_slopes[h]", double_bits(double(slope)), true, true});
  return fields;
}

/// Throws unless packed sequences are given whole: both offsets, B = 1, no lengths, offsets
/// of the global streams (the same on every rank: the arguments agree by then).
template <class T>
void check_packed_ring(const char* function, const RingLayout& layout,
                       const AttentionOptions<T>& options, const RingOptions& ring) {
  if (ring.cu_seqlens_q.size() != ring.cu_seqlens_k.size()) {
    attn::detail::throw_invalid_argument(
        function, "ring.cu_seqlens_q has " + std::to_string(ring.cu_seqlens_q.size()) +
                      " entries but ring.cu_seqlens_k " + std::to_string(ring.cu_seqlens_k.size()) +
                      ": give both, B + 1 each");
  }
  if (layout.batch != 1 || !options.key_lengths.empty() || !options.query_lengths.empty()) {
    attn::detail::throw_invalid_argument(
        function,
        "packed sequences (ring.cu_seqlens_q) need B = 1 (the views are (1, H, l, D) "
        "of this rank's tokens; B is " +
            std::to_string(layout.batch) + ") and no options.key_lengths or options.query_lengths");
  }
  attn::detail::check_sequence_offsets(function, "ring.cu_seqlens_q", ring.cu_seqlens_q,
                                       layout.q_length);
  attn::detail::check_sequence_offsets(function, "ring.cu_seqlens_k", ring.cu_seqlens_k,
                                       layout.k_length);
}

/// The agreement of a ring call (agreement.hpp) and its layout: every rank throws the same
/// error when one failed its local checks (`local_error`), when shapes or options differ, or
/// when a rank's lengths are not those of the split; then the global options are validated
/// (the same on every rank).
template <class T>
RingLayout agree_on_ring(const char* function, MPI_Comm comm,
                         const HeadsView<const T>& q,  // (B, Hq, lq, D)
                         const HeadsView<const T>& k,  // (B, Hkv, lk, D)
                         const HeadsView<const T>& v,  // (B, Hkv, lk, Dv)
                         const AttentionOptions<T>& options, const RingOptions& ring,
                         const std::string& local_error) {
  const SequenceSplit split = ring.split;
  const std::vector<SignatureField> fields = ring_signature(q, k, v, options, ring);
  const RankValues all = agree_or_throw(function, comm, fields, local_error);
  agree_or_throw(function, comm, ring_vectors(options, ring), "");
  RingLayout layout;
  layout.ranks = all.ranks;
  MPI_Comm_rank(comm, &layout.rank);
  layout.batch = q.batch;
  layout.q_heads = q.heads;
  layout.kv_heads = k.heads;
  layout.dim = q.dim;
  layout.value_dim = v.dim;
  const std::size_t lq_field = fields.size() - 2, lk_field = fields.size() - 1;
  for (int r = 0; r < all.ranks; ++r) {
    layout.q_length += all.at(r, lq_field);
    layout.k_length += all.at(r, lk_field);
  }
  for (int r = 0; r < all.ranks; ++r) {
    layout.q_runs.push_back(token_runs(split, layout.q_length, all.ranks, r));
    layout.k_runs.push_back(token_runs(split, layout.k_length, all.ranks, r));
    layout.k_rows.push_back(all.at(r, lk_field));
    const Index lq = local_length(split, layout.q_length, all.ranks, r);
    const Index lk = local_length(split, layout.k_length, all.ranks, r);
    if (all.at(r, lq_field) != lq || all.at(r, lk_field) != lk) {
      attn::detail::throw_invalid_argument(
          function, "rank " + std::to_string(r) + " holds " + std::to_string(all.at(r, lq_field)) +
                        " queries and " + std::to_string(all.at(r, lk_field)) + " keys but the " +
                        split_name(split) + " split of Lq = " + std::to_string(layout.q_length) +
                        ", Lk = " + std::to_string(layout.k_length) + " over " +
                        std::to_string(all.ranks) + " ranks gives it " + std::to_string(lq) +
                        " and " + std::to_string(lk));
    }
  }
  if (!ring.cu_seqlens_q.empty() || !ring.cu_seqlens_k.empty())
    check_packed_ring(function, layout, options, ring);
  layout.cu_q = ring.cu_seqlens_q;
  layout.cu_k = ring.cu_seqlens_k;
  // The global problem's own checks (windows, lengths, sinks), equal on every rank.
  const AttentionProblem<T> problem(function, layout.batch, layout.q_heads, layout.q_length,
                                    layout.k_length, options);
  (void)problem;
  return layout;
}

/// The local checks of q, k, v and the forward's outputs, as a message ("" when fine).
template <class T>
std::string local_ring_error(const char* function,
                             const HeadsView<const T>& q,  // (B, Hq, lq, D)
                             const HeadsView<const T>& k,  // (B, Hkv, lk, D)
                             const HeadsView<const T>& v,  // (B, Hkv, lk, Dv)
                             const AttentionOptions<T>& options, bool whole_heads = false) {
  try {
    if (q.row_offsets != nullptr || k.row_offsets != nullptr || v.row_offsets != nullptr ||
        q.pages != nullptr || k.pages != nullptr || v.pages != nullptr) {
      attn::detail::throw_invalid_argument(
          function, "packed or paged views are not supported: give padded (B, H, L, D) views");
    }
    attn::detail::check_attention_shapes(function, q, k, v);
    check_ring_options(function, options, whole_heads);
    attn::detail::resolve_scale(function, options.scale, q.dim);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return {};
}

/// Batch entries [first, end) that share their lengths, hence their pieces.
struct BatchGroup {
  Index first = 0, end = 0;
};

template <class T>
std::vector<BatchGroup> batch_groups(const AttentionOptions<T>& options, Index batch) {
  if (options.key_lengths.empty() && options.query_lengths.empty())
    return {{0, batch}};
  std::vector<BatchGroup> groups;
  for (Index b = 0; b < batch; ++b) {
    const auto same = [&](const std::vector<Index>& n) {
      return n.empty() || n[static_cast<std::size_t>(b)] == n[static_cast<std::size_t>(b - 1)];
    };
    if (b > 0 && same(options.key_lengths) && same(options.query_lengths))
      groups.back().end = b + 1;
    else
      groups.push_back({b, b + 1});
  }
  return groups;
}

/// The rules of sequence b.
template <class T>
SequenceRules sequence_rules(const AttentionOptions<T>& options, const RingLayout& layout,
                             Index b) {
  SequenceRules rules;
  rules.causal = options.causal;
  rules.window = options.window;
  rules.sink_tokens = options.sink_tokens;
  rules.query_length = options.query_lengths.empty()
                           ? layout.q_length
                           : options.query_lengths[static_cast<std::size_t>(b)];
  rules.key_length = options.key_lengths.empty() ? layout.k_length
                                                 : options.key_lengths[static_cast<std::size_t>(b)];
  return rules;
}

/// One call of a block: batch entries [b0, b0 + nb), local query rows [q_row, q_row + rows)
/// against rows [k_row, k_row + keys) of the key block, and the options of the call.
template <class T>
struct PieceCall {
  Index b0 = 0, nb = 0, q_row = 0, rows = 0, k_row = 0, keys = 0;
  AttentionOptions<T> options;
};

/// Calls `run(PieceCall)` for every piece of this rank's queries against the key block of
/// rank `source`, in a fixed order (query runs, key runs, batch groups, pieces); returns
/// how many calls were made. `options` are the caller's; each call gets the piece's causal
/// and window, no lengths or sinks, and the global scale.
template <class T, class Run>
int for_each_piece(const RingLayout& layout, int source, const AttentionOptions<T>& options,
                   Run&& run) {
  AttentionOptions<T> piece_options = options;
  piece_options.key_lengths.clear();
  piece_options.query_lengths.clear();
  piece_options.sinks.clear();
  piece_options.sink_tokens = 0;
  piece_options.scale = attn::detail::resolve_scale("ring", options.scale, layout.dim);
  const std::vector<BatchGroup> groups = batch_groups(options, layout.batch);
  int calls = 0;
  // This rank's query runs, cut into chunks of query_chunk rows.
  std::vector<TokenRun> chunks;
  for (const TokenRun& qr : layout.q_runs[static_cast<std::size_t>(layout.rank)]) {
    const Index step = layout.query_chunk > 0 ? layout.query_chunk : qr.size();
    for (Index first = 0; first < qr.size(); first += step) {
      const Index n = std::min(step, qr.size() - first);
      chunks.push_back({qr.begin + first, qr.begin + first + n, qr.local_begin + first});
    }
  }
  const auto emit = [&](Index b0, Index nb, const SequenceRules& rules, const TokenRun& qr,
                        Index q0, const TokenRun& kr, Index k0) {
    // Block pieces of rows from q0 and keys from k0 in the sequence's own coordinates.
    for (const BlockPiece& p : block_pieces(rules, q0, qr.size(), k0, kr.size())) {
      PieceCall<T> call{b0,
                        nb,
                        qr.local_begin + p.row_begin,
                        p.row_end - p.row_begin,
                        kr.local_begin + p.key_begin,
                        p.key_end - p.key_begin,
                        piece_options};
      call.options.causal = p.causal;
      call.options.window = p.window;
      run(call);
      ++calls;
    }
  };
  if (!layout.cu_q.empty()) {  // packed: each sequence's share of the two runs
    for (const TokenRun& qr : chunks) {
      for (const TokenRun& kr : layout.k_runs[static_cast<std::size_t>(source)]) {
        for (std::size_t b = 0; b + 1 < layout.cu_q.size(); ++b) {
          const Index qa = std::max(qr.begin, layout.cu_q[b]);
          const Index qb = std::min(qr.end, layout.cu_q[b + 1]);
          const Index ka = std::max(kr.begin, layout.cu_k[b]);
          const Index kb = std::min(kr.end, layout.cu_k[b + 1]);
          if (qa >= qb || ka >= kb)
            continue;
          SequenceRules rules = sequence_rules(options, layout, 0);
          rules.query_length = layout.cu_q[b + 1] - layout.cu_q[b];
          rules.key_length = layout.cu_k[b + 1] - layout.cu_k[b];
          emit(0, 1, rules, {qa, qb, qr.local_begin + qa - qr.begin}, qa - layout.cu_q[b],
               {ka, kb, kr.local_begin + ka - kr.begin}, ka - layout.cu_k[b]);
        }
      }
    }
    return calls;
  }
  for (const TokenRun& qr : chunks) {
    for (const TokenRun& kr : layout.k_runs[static_cast<std::size_t>(source)]) {
      for (const BatchGroup& g : groups) {
        emit(g.first, g.end - g.first, sequence_rules(options, layout, g.first), qr, qr.begin, kr,
             kr.begin);
      }
    }
  }
  return calls;
}

/// Copies a (B, H, L, D) view into contiguous memory at `to`; returns the end.
template <class T>
T* pack_heads(const HeadsView<const T>& x, T* to) {
  for (Index b = 0; b < x.batch; ++b) {
    for (Index h = 0; h < x.heads; ++h) {
      Eigen::Map<Matrix<T>>(to, x.length, x.dim) = x.head(b, h);
      to += x.length * x.dim;
    }
  }
  return to;
}

}  // namespace detail
}  // namespace attn::distributed
