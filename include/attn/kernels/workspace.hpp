// attn/kernels/workspace.hpp: the per-thread scratch of the flash and decode kernels.
//
// One type for both (kernels/online_softmax.inl). Flash keeps the queries of a tile on the
// columns (W = the query tile rounded up to whole vectors of the instruction set), decode
// keeps its R = G * Lq queries on the rows:
//
//              flash                         decode
//   q          (D, W)   scale * q tile^T      (R, D)   scale * the group's queries
//   s          (Bk, W)  scores^T -> p^T       (R, Bk)  scores -> probabilities
//   acc        (Dv, W)  unnormalised out^T    unused   (each split writes its own partial)
//   m, l       (W)      running max and sum   unused   (in the partial)
//   alpha, shift, tile_max, sums   (W) or (R) the rescale factor, the exp's shift, the
//                                   tile's maxima and its sums of probabilities
//   key_lo, key_hi  (W)  visible keys of each query in a tile (flash), int32
//   dropout_rows    (W)  the dropout's row keys of the tile's queries (flash), uint32
//   k, v       (Bk, D), (Bk, Dv)  a key/value tile widened to the compute scalar, when k
//                                   or v is stored in 16 bits or quantized blocks and the
//                                   products do not widen in registers
//   bf16_q, bf16_p, bf16_k, bf16_v  flash's operands on bf16 products, in pairs along the
//                                   sum (kernels/bf16_tiles.hpp): (D/2, W, 2) q^T,
//                                   (Bk/2, W, 2) p^T, (Bk, D) k, (Bk/2, Dv, 2) v, 16-bit
//   int8_q, int8_scales, int8_offsets  decode's queries on int8 products
//                                   (kernels/int8_decode.hpp): (R, D) int8, and per block
//                                   of 32, (R, D/32) float scales and int32 offsets
//   int8_keys, int8_key_scales      a panel of 16 keys transposed for int8 products: (D/4,
//                                   16, 4) bytes, (D/32, 16) float scales
//   int8_query_words, _scales, _means, _row   flash's query tile on int8 products
//                                   (kernels/int8_tiles.hpp): (D4, W) words of four bytes,
//                                   (W) scales and q . mean key, one row's bytes (4 D4)
//   int8_head                       flash's keys of one head quantized for int8 products
//                                   (QuantizedKeyHead)
//
// Sized once per call, reused for every work item of the thread; what that costs is stated
// with each kernel (kernels/flash.hpp, kernels/decode.hpp).
//
// The buffers are 64-byte aligned whatever the translation unit's flags. Eigen's own heap
// alignment follows them (16 bytes in a build without -march), and the AVX-512 kernels,
// which run in such builds too, would lose time on rows that straddle cache lines.
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "attn/config.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// A row-major (rows, cols) scratch buffer, 64-byte aligned, contents uninitialised. It
/// grows and never shrinks, so that resizing to the same shapes again allocates nothing.
template <class T>
class Scratch {
  static_assert(std::is_trivially_default_constructible_v<T> &&
                std::is_trivially_destructible_v<T>);

 public:
  static constexpr std::size_t alignment = 64;

  void resize(Index rows, Index cols = 1) {
    const auto count = static_cast<std::size_t>(rows * cols);
    if (count > capacity_) {
      data_.reset(static_cast<T*>(::operator new (count * sizeof(T), std::align_val_t{alignment})));
      capacity_ = count;
    }
    rows_ = rows;
    cols_ = cols;
  }
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete (p, std::align_val_t{alignment}); }
  };
  std::unique_ptr<T, Free> data_;
  std::size_t capacity_ = 0;
  Index rows_ = 0, cols_ = 0;
};

/// The keys of one (b, kv head) quantized for flash's int8 products (kernels/int8_tiles.hpp),
/// kept while consecutive work items read the same head of the same view.
struct QuantizedKeyHead {
  Scratch<std::int8_t> keys;      // (Lk, 4 D4) each row minus the mean, quantized
  Scratch<float> scales;          // (Lk) each row's d
  Scratch<std::int32_t> offsets;  // (Lk) -128 * the sum of each row's values
  Scratch<float> mean;            // (D rounded up to 16) the mean key, zeros past D
  Scratch<float> rows, centered;  // a chunk of widened rows, (D) one row minus the mean
  const void* source = nullptr;   // the view's data, and the head below: what `keys` holds
  Index batch = -1, head = -1;
};

template <class T>
struct Workspace {
  Scratch<T> q, s, acc;
  Scratch<T> m, l, alpha, shift, tile_max, sums;
  std::vector<std::int32_t> key_lo, key_hi;
  std::vector<std::uint32_t> dropout_rows;  // (W) the dropout's row keys of a tile's queries
  Scratch<T> k, v;
  Scratch<std::uint16_t> bf16_q, bf16_p, bf16_k, bf16_v;  // bfloat16 bits
  Scratch<std::int8_t> int8_q;
  Scratch<float> int8_scales, int8_key_scales;
  Scratch<std::int32_t> int8_offsets;
  Scratch<std::uint8_t> int8_keys;
  Scratch<std::uint32_t> int8_query_words;
  Scratch<float> int8_query_scales, int8_query_means;
  Scratch<std::int8_t> int8_query_row;
  QuantizedKeyHead int8_head;

  /// Flash: query tiles of up to `width` (padded) queries, key tiles of up to `keys` keys.
  void reserve_flash(Index width, Index keys, Index dim, Index value_dim, bool widens_kv) {
    q.resize(dim, width);
    s.resize(keys, width);
    acc.resize(value_dim, width);
    reserve_vectors(width);
    key_lo.resize(static_cast<std::size_t>(width));
    key_hi.resize(static_cast<std::size_t>(width));
    dropout_rows.resize(static_cast<std::size_t>(width));
    if (widens_kv)
      reserve_kv(keys, dim, value_dim);
  }

  /// Flash on bf16 products: the operands in pairs along each sum (D and keys rounded up
  /// to even), for query tiles of up to `width` queries and key tiles of up to `keys` keys.
  void reserve_bf16(Index width, Index keys, Index dim, Index value_dim) {
    const Index dim2 = (dim + 1) / 2 * 2, keys2 = (keys + 1) / 2 * 2;
    bf16_q.resize(dim2, width);
    bf16_p.resize(keys2, width);
    bf16_k.resize(keys, dim2);
    bf16_v.resize(keys2, value_dim);
  }

  /// Flash on int8 products: query tiles of up to `width` (padded) queries of `dim` values
  /// (the head's keys are sized as they are quantized).
  void reserve_int8_flash(Index width, Index dim) {
    const Index quads = (dim + 3) / 4;
    int8_query_words.resize(quads, width);
    int8_query_scales.resize(width);
    int8_query_means.resize(width);
    int8_query_row.resize(4 * quads);
  }

  /// Decode on int8 products: `rows` = G * Lq queries of `dim` (a multiple of 32) values.
  void reserve_int8(Index rows, Index dim) {
    const Index blocks = dim / 32;
    int8_q.resize(rows, dim);
    int8_scales.resize(rows, blocks);
    int8_offsets.resize(rows, blocks);
    int8_keys.resize(dim / 4, Index{64});  // 16 keys of 4 bytes
    int8_key_scales.resize(blocks, 16);
  }

  /// Decode: `rows` = G * Lq queries, key blocks of up to `keys` keys.
  void reserve_decode(Index rows, Index keys, Index dim, Index value_dim, bool widens_kv) {
    q.resize(rows, dim);
    s.resize(rows, keys);
    reserve_vectors(rows);
    if (widens_kv)
      reserve_kv(keys, dim, value_dim);
  }

 private:
  void reserve_vectors(Index n) {
    for (Scratch<T>* x : {&m, &l, &alpha, &shift, &tile_max, &sums})
      x->resize(n);
  }
  void reserve_kv(Index keys, Index dim, Index value_dim) {
    k.resize(keys, dim);
    v.resize(keys, value_dim);
  }
};

}  // namespace attn::detail
