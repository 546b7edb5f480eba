// attn/distributed/block_pieces.hpp: one block of a split attention problem (a run of queries
// against a run of keys of the same sequence) as a few ordinary attention calls.
//
// A rank of ring attention holds queries at global rows [q0, q0 + nq) and, at some step, the
// keys of another rank at global rows [k0, k0 + nk). The global rules (causal with either
// alignment, a window, key and query lengths, sink tokens; attn/mask.hpp) measure from the
// global diagonal C(i) = i + off (off = 0 top-left, n_k - n_q otherwise). In the block, local
// query i has the diagonal c(i) = i + d, d = q0 + off - k0, which no option of a single call
// expresses (a call's diagonal is i + Lk - Lq of its own views). But the visible keys of a
// row form one interval [f(i), g(i)) whose ends are lines of slope one clipped to [0, m):
//   rows whose right end is the line (g = i + d + 1 <= m) are one call with causal (or a
//   window right side of 0) bottom-right aligned on a key view [0, i_hi + d);
//   rows whose right end is clipped (g = m) are one call without causal, whose window's left
//   side is chosen so that its bottom-right diagonal meets the line f;
//   rows that see nothing are no call at all (and a block of such rows is skipped);
// a window with a right side r > 0 and no causal mask is first rewritten as (left + r, 0)
// about the diagonal c + r (the same interval). Sink tokens inside the block become a key
// run of their own with the causal limit only. So every block costs at most four calls on
// sub-views of the same memory, each through the normal kernels and their tile skipping.
//
// No MPI here (tests/distributed/test_block_pieces.cpp checks every piece against the rules).
// Extra memory: the list of pieces.
#pragma once

#include <algorithm>
#include <vector>

#include "attn/config.hpp"
#include "attn/mask.hpp"

namespace attn::distributed::detail {

/// One attention call of a block: local query rows [row_begin, row_end) of the query run
/// against keys [key_begin, key_end) of the key run, with `causal` (none or bottom_right)
/// and `window`, aligned on the piece's own rows and keys and without lengths.
struct BlockPiece {
  Index row_begin = 0, row_end = 0;
  Index key_begin = 0, key_end = 0;
  Causal causal = Causal::none;
  Window window{};
};

/// The global rules of one sequence, as far as a block needs them.
struct SequenceRules {
  Causal causal = Causal::none;
  Window window{};
  Index sink_tokens = 0;
  Index query_length = 0;  ///< n_q(b): valid queries of the sequence (global)
  Index key_length = 0;    ///< n_k(b): valid keys of the sequence (global)
};

/// Pieces of keys [key_offset, key_offset + m) of the block, every row i < r having the
/// diagonal i + d in those keys' coordinates and no sink token among them.
inline void add_interval_pieces(std::vector<BlockPiece>& pieces, Index d, Index r, Index m,
                                bool causal, Window window, Index key_offset) {
  Index left = window.left;
  const bool limited = causal || window.right >= 0;  // a right end on the diagonal's line
  if (!causal && window.right > 0) {
    // (left, right) about c is (left + right, 0) about c + right.
    d += window.right;
    if (left >= 0)
      left += window.right;
  }
  Index start = 0;  // first row whose right end is clipped at m
  if (limited) {
    const Index lo = std::clamp(-d, Index(0), r);  // rows before see nothing
    const Index hi = std::clamp(m - d, lo, r);     // rows from here on are clipped
    if (hi > lo) {
      const Window w{left, causal ? Index(-1) : Index(0)};
      pieces.push_back({lo, hi, key_offset, key_offset + hi + d,
                        causal ? Causal::bottom_right : Causal::none, w});
    }
    start = hi;
  }
  // Clipped rows: [max(0, i + d - left), m); those whose window starts past m see nothing.
  const Index end = left >= 0 ? std::clamp(m - d + left, start, r) : r;
  if (end > start) {
    const Index rows = end - start;
    const Index shifted_left = left >= 0 ? m - rows - start - d + left : Index(-1);
    pieces.push_back({start, end, key_offset, key_offset + m, Causal::none, {shifted_left, -1}});
  }
}

/// The pieces of the block of global query rows [q_begin, q_begin + q_count) against global
/// keys [k_begin, k_begin + k_count) of a sequence with `rules`; empty when the block sees
/// nothing. Local rows and keys not covered by a piece see no key of the block.
inline std::vector<BlockPiece> block_pieces(const SequenceRules& rules, Index q_begin,
                                            Index q_count, Index k_begin, Index k_count) {
  std::vector<BlockPiece> pieces;
  const Index r = std::clamp(rules.query_length - q_begin, Index(0), q_count);
  const Index m = std::clamp(rules.key_length - k_begin, Index(0), k_count);
  if (r == 0 || m == 0)
    return pieces;
  const Index offset = rules.causal == Causal::top_left ? 0 : rules.key_length - rules.query_length;
  const Index d = q_begin + offset - k_begin;
  const bool causal = rules.causal != Causal::none;
  const Index sinks = std::clamp(rules.sink_tokens - k_begin, Index(0), m);
  if (sinks > 0)  // sink tokens: visible beside any window, under the causal limit
    add_interval_pieces(pieces, d, r, sinks, causal, Window{}, 0);
  if (m > sinks)
    add_interval_pieces(pieces, d - sinks, r, m - sinks, causal, rules.window, sinks);
  return pieces;
}

}  // namespace attn::distributed::detail
