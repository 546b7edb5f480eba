// attn/cache/page_table.hpp: the bookkeeping of a paged cache, without its storage: a pool
// of page ids, a block table per sequence, reference counts and a free list (vLLM's block
// manager, llama.cpp's seq_cp / seq_rm / seq_keep).
//
//   pages    ids [0, pages()), each held by references(page) sequences (0: free)
//   table    per sequence, the pool page of each page_size tokens (released_page where a
//            sliding window gave it back)
//
// PagedKVCache (attn/paged_kv_cache.hpp) keeps its rows in pools indexed by these ids; the
// table says which page a write goes to and which page a copy-on-write copies from, the
// owner moves the rows. Errors name the owner's function ("PagedKVCache::fork").
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "attn/config.hpp"

namespace attn {

class PageTable {
 public:
  /// The block table's entry for a page given back by release_outside_window.
  static constexpr Index released_page = -1;

  /// Where the next token of a sequence goes: `row` of pool page `page`. When `copy_from`
  /// is not released_page, the owner first copies rows [0, row) of page copy_from into
  /// `page` (a shared partly filled last page, copied on write).
  struct Write {
    Index page = released_page, row = 0, copy_from = released_page;
  };

  PageTable() = default;
  /// No sequence and no page; pages of `page_size` tokens. `owner` names the class in
  /// errors ("PagedKVCache" gives "PagedKVCache::fork: ...").
  PageTable(Index page_size, std::string owner) : page_size_(page_size), owner_(std::move(owner)) {}

  Index page_size() const { return page_size_; }
  /// Pages in the pool, and of them those no sequence holds.
  Index pages() const { return static_cast<Index>(references_.size()); }
  Index free_pages() const { return static_cast<Index>(free_.size()); }
  /// Pages that hold `tokens` tokens.
  Index pages_for(Index tokens) const { return (tokens + page_size_ - 1) / page_size_; }

  /// How many sequences hold pool page `page` (0: free).
  Index references(Index page) const {
    if (page < 0 || page >= pages()) {
      detail::throw_invalid_argument(name("references").c_str(),
                                     "page " + std::to_string(page) + " is outside the pool of " +
                                         std::to_string(pages()) + " pages");
    }
    return references_[static_cast<std::size_t>(page)];
  }

  /// Whether `sequence` is a live id.
  bool contains(Index sequence) const {
    return sequence >= 0 && sequence < static_cast<Index>(sequences_.size()) &&
           sequences_[static_cast<std::size_t>(sequence)].live;
  }
  /// The live ids, ascending.
  std::vector<Index> sequences() const {
    std::vector<Index> ids;
    for (Index s = 0; s < static_cast<Index>(sequences_.size()); ++s) {
      if (contains(s))
        ids.push_back(s);
    }
    return ids;
  }
  /// Tokens held by `sequence`.
  Index length(Index sequence) const { return get("length", sequence).length; }
  /// The pool page of each page_size tokens of `sequence`.
  const std::vector<Index>& block_table(Index sequence) const {
    return get("block_table", sequence).table;
  }
  /// Tokens [first, last) of `sequence` lie in released pages (first == last: none).
  std::pair<Index, Index> released(Index sequence) const {
    const Sequence& s = get("released", sequence);
    return {s.released_begin, s.released_end};
  }

  /// A new empty sequence; returns its id (the smallest id not in use).
  Index add_sequence() {
    const Index id = free_id();
    sequences_[static_cast<std::size_t>(id)].live = true;
    return id;
  }

  /// A new sequence holding the same pages as `sequence` (each referenced once more).
  Index fork(Index sequence) {
    const Sequence parent = get("fork", sequence);  // a copy: free_id may move sequences_
    const Index id = free_id();
    for (Index page : parent.table) {
      if (page >= 0)
        ++references_[static_cast<std::size_t>(page)];
    }
    sequences_[static_cast<std::size_t>(id)] = parent;
    return id;
  }

  /// Keeps the first `length` tokens of `sequence` (0 <= length <= its length), giving
  /// back the pages past them.
  void truncate(Index sequence, Index length) {
    Sequence& s = get("truncate", sequence);
    if (length < 0 || length > s.length) {
      detail::throw_invalid_argument(
          name("truncate").c_str(), "sequence " + std::to_string(sequence) + " holds " +
                                        std::to_string(s.length) +
                                        " tokens: cannot truncate it to " + std::to_string(length));
    }
    const Index kept = pages_for(length);
    for (auto p = static_cast<std::size_t>(kept); p < s.table.size(); ++p)
      unreference(s.table[p]);
    s.table.resize(static_cast<std::size_t>(kept));
    s.length = length;
    s.released_end = std::min(s.released_end, kept * page_size_);
    s.released_begin = std::min(s.released_begin, s.released_end);
  }

  /// Removes `sequence`, giving back its pages; its id may be reused.
  void remove(Index sequence) {
    Sequence& s = get("remove", sequence);
    for (Index page : s.table)
      unreference(page);
    s = Sequence{};
  }

  /// Gives back the pages of `sequence` whose every token is before length - window_left,
  /// except those holding the first `sink_tokens` tokens.
  void release_outside_window(Index sequence, Index window_left, Index sink_tokens) {
    Sequence& s = get("release_outside_window", sequence);
    if (window_left < 0 || sink_tokens < 0) {
      detail::throw_invalid_argument(name("release_outside_window").c_str(),
                                     "window_left is " + std::to_string(window_left) +
                                         " and sink_tokens " + std::to_string(sink_tokens) +
                                         ": both must be >= 0");
    }
    const Index first_seen = s.length - window_left;  // of the query at position length
    const Index keep_before = pages_for(std::min(sink_tokens, s.length));      // sink pages
    const Index release_until = first_seen > 0 ? first_seen / page_size_ : 0;  // whole pages
    if (release_until <= keep_before)
      return;
    for (Index p = keep_before; p < release_until; ++p) {
      Index& page = s.table[static_cast<std::size_t>(p)];
      unreference(page);
      page = released_page;
    }
    s.released_begin = s.released_end == s.released_begin
                           ? keep_before * page_size_
                           : std::min(s.released_begin, keep_before * page_size_);
    s.released_end = std::max(s.released_end, release_until * page_size_);
  }

  /// Adds `count` free pages to the pool, the lowest new id taken first.
  void add_pages(Index count) {
    const Index old_pages = pages(), new_pages = old_pages + count;
    references_.resize(static_cast<std::size_t>(new_pages), 0);
    for (Index page = new_pages - 1; page >= old_pages; --page)
      free_.push_back(page);
  }

  /// Throws unless `sequences` are B distinct live ids; `function` names the caller.
  void check_sequences(const char* function, const std::vector<Index>& sequences,
                       Index batch) const {
    if (static_cast<Index>(sequences.size()) != batch) {
      detail::throw_invalid_argument(function, "sequences has " + std::to_string(sequences.size()) +
                                                   " ids but the batch size is " +
                                                   std::to_string(batch));
    }
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      if (!contains(sequences[b]))
        throw_missing(function, sequences[b]);
      for (std::size_t c = 0; c < b; ++c) {
        if (sequences[c] == sequences[b]) {
          detail::throw_invalid_argument(
              function, "sequences is " + detail::list_string(sequences) + ": sequence " +
                            std::to_string(sequences[b]) + " is listed twice");
        }
      }
    }
  }

  /// The lengths of the listed (live) sequences.
  std::vector<Index> lengths_of(const std::vector<Index>& sequences) const {
    std::vector<Index> lengths;
    lengths.reserve(sequences.size());
    for (Index id : sequences)
      lengths.push_back(sequences_[static_cast<std::size_t>(id)].length);
    return lengths;
  }

  /// The block tables of the listed sequences as rows of one (B, max_pages) table,
  /// released_page past each one's end.
  std::vector<Index> tables_of(const std::vector<Index>& sequences, Index max_pages) const {
    std::vector<Index> table(sequences.size() * static_cast<std::size_t>(max_pages), released_page);
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      const std::vector<Index>& pages = sequences_[static_cast<std::size_t>(sequences[b])].table;
      std::copy(pages.begin(), pages.end(), table.begin() + static_cast<Index>(b) * max_pages);
    }
    return table;
  }

  /// Pages an append of counts[b] (all `rows` if empty) tokens to sequences[b] takes from
  /// the pool: new pages, and copies of shared (or released) last pages it writes into.
  Index pages_needed(const std::vector<Index>& sequences, Index rows,
                     const std::vector<Index>& counts) const {
    Index needed = 0;
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      const Sequence& s = sequences_[static_cast<std::size_t>(sequences[b])];
      const Index n = counts.empty() ? rows : counts[b];
      if (n == 0)
        continue;
      needed += pages_for(s.length + n) - static_cast<Index>(s.table.size());
      if (s.length % page_size_ != 0) {  // the write starts inside the last page
        const Index page = s.table.back();
        needed += page < 0 || references_[static_cast<std::size_t>(page)] > 1 ? 1 : 0;
      }
    }
    return needed;
  }

  /// Makes the page holding position length(sequence) writable and says where it is: a new
  /// page at a page start, else the last page if the sequence alone holds it, else a fresh
  /// page replacing it (the owner copies the shared one's first rows, Write::copy_from).
  /// A free page must exist (pages_needed).
  Write writable_page(Index sequence) {
    Sequence& s = sequences_[static_cast<std::size_t>(sequence)];
    const Index row = s.length % page_size_;
    if (row == 0) {
      s.table.push_back(take_page());
      return {s.table.back(), 0, released_page};
    }
    Index& page = s.table.back();
    if (page >= 0 && references_[static_cast<std::size_t>(page)] == 1)
      return {page, row, released_page};
    const Index shared = page;
    unreference(shared);
    page = take_page();
    return {page, row, shared};
  }

  /// Counts `n` tokens written into `sequence` (within its last page).
  void advance(Index sequence, Index n) {
    sequences_[static_cast<std::size_t>(sequence)].length += n;
  }

 private:
  struct Sequence {
    bool live = false;
    Index length = 0;
    std::vector<Index> table;  // pool page per page_size tokens; released_page where given back
    // Tokens [released_begin, released_end) lie in released pages (whole pages; empty when
    // equal).
    Index released_begin = 0, released_end = 0;
  };

  std::string name(const char* member) const { return owner_ + "::" + member; }

  [[noreturn]] void throw_missing(const char* function, Index sequence) const {
    detail::throw_invalid_argument(
        function, "sequence " + std::to_string(sequence) +
                      " is not in the cache (live ids: " + detail::list_string(sequences()) + ")");
  }

  const Sequence& get(const char* member, Index sequence) const {
    if (!contains(sequence))
      throw_missing(name(member).c_str(), sequence);
    return sequences_[static_cast<std::size_t>(sequence)];
  }
  Sequence& get(const char* member, Index sequence) {
    return const_cast<Sequence&>(std::as_const(*this).get(member, sequence));
  }

  Index free_id() {
    for (Index s = 0; s < static_cast<Index>(sequences_.size()); ++s) {
      if (!sequences_[static_cast<std::size_t>(s)].live)
        return s;
    }
    sequences_.emplace_back();
    return static_cast<Index>(sequences_.size()) - 1;
  }

  void unreference(Index page) {
    if (page < 0)
      return;
    if (--references_[static_cast<std::size_t>(page)] == 0)
      free_.push_back(page);
  }

  Index take_page() {
    const Index page = free_.back();
    free_.pop_back();
    references_[static_cast<std::size_t>(page)] = 1;
    return page;
  }

  Index page_size_ = 1;
  std::string owner_ = "PageTable";
  std::vector<Sequence> sequences_;  // by id
  std::vector<Index> references_;    // (pages) sequences holding each page
  std::vector<Index> free_;          // free page ids; taken from the back
};

}  // namespace attn
