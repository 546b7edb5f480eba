// examples/tiny_lm/serving.hpp: the tiny language model (examples/tiny_lm/model.hpp) serving
// many sequences at once: their keys and values in one attn::PagedKVCache per layer, and a
// step that feeds tokens of several sequences, as many for each as it has (a prompt beside
// single tokens), through one forward.
//
//   PagedState   one PagedKVCache per layer; a sequence has the same id in every layer's
//                cache (they are added, forked and removed together), so one id names it
//   step         sequences (B) and tokens[b] for each: one embedding, one GEMM per product
//                over all the new tokens, MultiHeadAttention::forward_incremental's packed
//                overload per layer (attention run once per distinct count of new tokens)
//
// A sequence's logits equal those it gets alone through Model::step on a contiguous
// KVCache, bit for bit, when the page size is a multiple of 64 (the decode kernel's key
// block) and the products run on attn's AVX2 or AVX-512 GEMM (docs/tiny_lm.md, "Serving").
#pragma once

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include <attn/multihead.hpp>
#include <attn/paged_kv_cache.hpp>
#include <attn/quantized.hpp>

#include "model.hpp"

namespace tiny_lm {

/// Every sequence of a server: one paged cache per layer, the keys stored as SK and the
/// values as SV (any PagedKVCache format).
template <class SK = float, class SV = SK>
class PagedState {
 public:
  using Cache = attn::PagedKVCache<SK, SV>;

  /// No sequence; pools of `pages` pages of `page_size` tokens per layer, growing as needed.
  PagedState(const Model& model, Index page_size, Index pages = 0) {
    const Config& c = model.config();
    for (Index i = 0; i < c.layers; ++i)
      caches_.emplace_back(c.kv_heads, c.head_dim(), c.head_dim(), page_size, pages);
  }

  /// A new empty sequence; returns its id.
  Index add_sequence() {
    return each([](Cache& cache) { return cache.add_sequence(); });
  }
  /// A new sequence sharing every page of `sequence` (its tokens, without a copy).
  Index fork(Index sequence) {
    return each([&](Cache& cache) { return cache.fork(sequence); });
  }
  /// Gives the pages of `sequence` back to the pools.
  void remove(Index sequence) {
    for (Cache& cache : caches_)
      cache.remove(sequence);
  }

  /// The live ids, ascending.
  std::vector<Index> sequences() const { return caches_.front().sequences(); }
  Index length(Index sequence) const { return caches_.front().length(sequence); }
  bool contains(Index sequence) const { return caches_.front().contains(sequence); }
  Index page_size() const { return caches_.front().page_size(); }
  /// Pages of one layer's pool, and of them those held by a sequence (every layer the same).
  Index pages() const { return caches_.front().pages(); }
  Index pages_in_use() const { return pages() - caches_.front().free_pages(); }
  /// The caches' bytes: keys and values of every page of every layer's pool.
  double pool_bytes() const {
    const Cache& c = caches_.front();
    const auto row_bytes = [](Index dim, double unit_bytes, Index values_per_unit) {
      return static_cast<double>(dim / values_per_unit) * unit_bytes;
    };
    return static_cast<double>(caches_.size()) * static_cast<double>(pages()) *
           static_cast<double>(c.kv_heads() * c.page_size()) *
           (row_bytes(c.dim(), sizeof(SK), attn::values_per_unit_v<SK>) +
            row_bytes(c.value_dim(), sizeof(SV), attn::values_per_unit_v<SV>));
  }

  /// Layer i's cache.
  Cache& cache(std::size_t i) { return caches_[i]; }
  std::size_t layers() const { return caches_.size(); }

 private:
  // The same operation on every layer's cache; they hand out the same ids.
  template <class F>
  Index each(const F& f) {
    const Index id = f(caches_.front());
    for (std::size_t i = 1; i < caches_.size(); ++i) {
      if (f(caches_[i]) != id)
        throw std::logic_error("tiny_lm::PagedState: the layers' caches hand out different ids");
    }
    return id;
  }

  std::vector<Cache> caches_;  // one per layer
};

/// Feeds tokens[b] (any number, none included) to sequence sequences[b] for every b, all in
/// one forward, and returns the logits of every new token, (sum of the sizes, V), sequence
/// by sequence in the order given. Throws, leaving the state unchanged, on a bad id or token
/// or a sequence beyond max_positions.
template <class SK, class SV>
Matrix step(const Model& model, PagedState<SK, SV>& state, const std::vector<Index>& sequences,
            const std::vector<std::vector<int>>& tokens) {
  constexpr const char* function = "tiny_lm::step";
  if (sequences.size() != tokens.size()) {
    throw std::invalid_argument(std::string(function) + ": " + std::to_string(sequences.size()) +
                                " sequences but " + std::to_string(tokens.size()) +
                                " lists of tokens");
  }
  if (static_cast<Index>(state.layers()) != model.config().layers)
    throw std::invalid_argument(std::string(function) + ": the state is not this model's");
  state.cache(0).page_table().check_sequences(function, sequences,
                                              static_cast<Index>(sequences.size()));
  std::vector<int> all;  // the new tokens, packed
  std::vector<Index> cu_seqlens{0};
  for (std::size_t b = 0; b < tokens.size(); ++b) {
    model.check_tokens(function, tokens[b], state.length(sequences[b]));
    all.insert(all.end(), tokens[b].begin(), tokens[b].end());
    cu_seqlens.push_back(static_cast<Index>(all.size()));
  }
  const auto count = static_cast<Index>(all.size());
  return model.run(all, [&](std::size_t i, const attn::MultiHeadAttention<float>& attention,
                            const Matrix& x) {  // x (T, E), packed
    attn::Tensor<float, 2> packed(count, x.cols());
    std::copy(x.data(), x.data() + x.size(), packed.data());
    return attention.forward_incremental(packed, state.cache(i), sequences, cu_seqlens);
  });
}

}  // namespace tiny_lm
