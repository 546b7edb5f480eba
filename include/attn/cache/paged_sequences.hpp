// attn/cache/paged_sequences.hpp: the sequence operations every paged cache offers, over its
// PageTable: add, fork (shared pages, copy-on-write), truncate, remove, the sliding-window
// ring, and what they hold. PagedKVCache and LatentCache derive from it; the rows in the
// pages are theirs.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "attn/cache/page_table.hpp"
#include "attn/config.hpp"

namespace attn::detail {

class PagedSequences {
 public:
  /// The block table's entry for a page given back by release_outside_window.
  static constexpr Index released_page = PageTable::released_page;

  Index page_size() const { return table_.page_size(); }
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

 protected:
  PagedSequences() = default;
  /// `owner` names the cache in the table's errors.
  PagedSequences(Index page_size, std::string owner) : table_(page_size, std::move(owner)) {}

  PageTable table_;  // the sequences, their block tables, the pages' reference counts
};

}  // namespace attn::detail
