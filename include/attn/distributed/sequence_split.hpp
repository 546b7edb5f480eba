// attn/distributed/sequence_split.hpp: which tokens of one sequence each of P ranks holds.
//
// Context parallelism splits the L tokens of every sequence of a batch across P ranks
// (docs/distributed.md). Two splits:
//   contiguous  rank r holds tokens [r L / P, (r + 1) L / P): one run of L / P tokens
//               (floor division, so the runs differ by at most one token and some ranks
//               hold none when L < P);
//   zigzag      the tokens cut into 2P chunks alike, rank r holding chunks r and 2P - 1 - r
//               (Megatron's and ring-flash-attention's load balance for causal masks: every
//               rank gets one early and one late chunk, so the same work).
// A rank's local tensors hold its runs one after another, in this order: the local rows
// [0, n_0) are run 0, [n_0, n_0 + n_1) run 1. The same split applies to the queries (Lq)
// and to the keys and values (Lk), each with its own global length.
//
// No MPI here: every rank computes every rank's runs from (split, L, P).
// Extra memory: none (two runs a rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attn/config.hpp"

namespace attn::distributed {

/// How the tokens of a sequence are dealt to the ranks.
enum class SequenceSplit : std::uint8_t {
  contiguous,  ///< rank r holds [r L / P, (r + 1) L / P)
  zigzag,      ///< rank r holds chunks r and 2P - 1 - r of 2P equal chunks
};

inline const char* split_name(SequenceSplit split) {
  return split == SequenceSplit::zigzag ? "zigzag" : "contiguous";
}

/// One run of tokens [begin, end) of the global sequence, stored at local rows
/// [local_begin, local_begin + end - begin) of its rank.
struct TokenRun {
  Index begin = 0, end = 0;
  Index local_begin = 0;
  Index size() const { return end - begin; }
};

/// The runs of rank `rank` of `ranks` for a sequence of `length` tokens, in local order
/// (empty runs left out). Throws std::invalid_argument unless 0 <= rank < ranks and
/// length >= 0.
inline std::vector<TokenRun> token_runs(SequenceSplit split, Index length, int ranks, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks || length < 0) {
    attn::detail::throw_invalid_argument(
        "token_runs", "rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                          " ranks, length " + std::to_string(length) +
                          ": needs 0 <= rank < ranks and length >= 0");
  }
  const auto cut = [length](Index part, Index parts) { return part * length / parts; };
  std::vector<TokenRun> runs;
  Index local = 0;
  const auto add = [&](Index begin, Index end) {
    if (end > begin) {
      runs.push_back({begin, end, local});
      local += end - begin;
    }
  };
  if (split == SequenceSplit::contiguous) {
    add(cut(rank, ranks), cut(rank + 1, ranks));
  } else {
    const Index chunks = 2 * Index(ranks);
    add(cut(rank, chunks), cut(rank + 1, chunks));
    add(cut(chunks - 1 - rank, chunks), cut(chunks - rank, chunks));
  }
  return runs;
}

/// How many tokens rank `rank` holds: the sum of its runs.
inline Index local_length(SequenceSplit split, Index length, int ranks, int rank) {
  Index n = 0;
  for (const TokenRun& run : token_runs(split, length, ranks, rank))
    n += run.size();
  return n;
}

}  // namespace attn::distributed
