// attn/distributed/block_pieces.hpp: the pieces of a block see exactly what the global rules
// let the block's queries see of the block's keys, each pair once. No MPI: the visibility
// of every (query, key) pair of many blocks against the long double reference's rule.
#include <catch2/catch.hpp>

#include <random>
#include <sstream>
#include <vector>

#include <attn/distributed/block_pieces.hpp>
#include <attn/mask.hpp>

#include "distributed/support.hpp"

namespace {

using attn::Index;
using attn::distributed::detail::block_pieces;
using attn::distributed::detail::BlockPiece;
using attn::distributed::detail::SequenceRules;

/// How many pieces see each (local query, local key) pair of the block.
std::vector<int> piece_visibility(const std::vector<BlockPiece>& pieces, Index nq, Index nk) {
  std::vector<int> seen(static_cast<std::size_t>(nq * nk), 0);
  for (const BlockPiece& p : pieces) {
    const Index rows = p.row_end - p.row_begin, keys = p.key_end - p.key_begin;
    const attn::Mask mask("test", 1, 1, rows, keys, p.causal, p.window);
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < keys; ++j)
        if (mask.visible(0, 0, i, j))
          ++seen[static_cast<std::size_t>((p.row_begin + i) * nk + p.key_begin + j)];
  }
  return seen;
}

}  // namespace

TEST_CASE("block pieces see what the global rules let a block see, once", "[distributed][pieces]") {
  std::mt19937 gen(7);
  const auto pick = [&](Index lo, Index hi) {
    return std::uniform_int_distribution<Index>(lo, hi)(gen);
  };
  int blocks = 0, mismatches = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    attn_test::reference::Problem p;
    p.q_length = pick(1, 24);
    p.k_length = pick(1, 24);
    const int causal = static_cast<int>(pick(0, 2));
    p.causal = causal == 0   ? attn_test::reference::Causal::none
               : causal == 1 ? attn_test::reference::Causal::top_left
                             : attn_test::reference::Causal::bottom_right;
    p.window_left = pick(-1, 6);
    p.window_right = pick(-1, 6);
    p.sink_tokens = pick(0, 1) == 0 ? 0 : pick(1, 5);
    p.key_lengths = {pick(0, p.k_length)};
    p.query_lengths = {pick(0, p.q_length)};
    SequenceRules rules;
    rules.causal = causal == 0   ? attn::Causal::none
                   : causal == 1 ? attn::Causal::top_left
                                 : attn::Causal::bottom_right;
    rules.window = {p.window_left, p.window_right};
    rules.sink_tokens = p.sink_tokens;
    rules.query_length = p.query_lengths[0];
    rules.key_length = p.key_lengths[0];
    const Index q0 = pick(0, p.q_length - 1), nq = pick(1, p.q_length - q0);
    const Index k0 = pick(0, p.k_length - 1), nk = pick(1, p.k_length - k0);
    const std::vector<BlockPiece> pieces = block_pieces(rules, q0, nq, k0, nk);
    CHECK(pieces.size() <= 4);
    const std::vector<int> seen = piece_visibility(pieces, nq, nk);
    bool same = true;
    for (Index i = 0; i < nq; ++i)
      for (Index j = 0; j < nk; ++j)
        same = same && seen[static_cast<std::size_t>(i * nk + j)] ==
                           (p.visible(0, 0, q0 + i, k0 + j) ? 1 : 0);
    ++blocks;
    if (!same) {
      ++mismatches;
      std::ostringstream s;
      s << "Lq " << p.q_length << " Lk " << p.k_length << " causal " << causal << " window ("
        << p.window_left << ", " << p.window_right << ") sinks " << p.sink_tokens << " n_q "
        << rules.query_length << " n_k " << rules.key_length << " block q [" << q0 << ", "
        << q0 + nq << ") k [" << k0 << ", " << k0 + nk << ")";
      INFO(s.str());
      CHECK(same);
    }
    if (mismatches > 5)
      break;
  }
  CHECK(blocks > 1000);
  CHECK(mismatches == 0);
}
