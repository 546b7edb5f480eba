// attn/multihead/layout.hpp: where MultiHeadAttention's projections lie in its buffers,
// computed once from (self-attention or not, the shapes) and read by every call path: the
// forward's q, k, v views, the training forward's, and the backward's dq, dk, dv views over
// gradient buffers of the same layout.
//
// Shape legend (attn/multihead.hpp): B batch, L query length, S key length, extra rows
// appended to k and v (add_bias_kv, add_zero_attn), S' = S + extra, H / Hkv heads, D head
// dim, E = H*D, Ekv = Hkv*D.
//
//   self-attention (one input, kdim = vdim = E): ONE buffer (B*(L + extra), E + 2*Ekv) of
//     q | k | v column blocks, L + extra rows a sequence (q reads the first L of them);
//   otherwise: a q buffer (B*L, E) and a k | v buffer (B*S', 2*Ekv), S' rows a sequence.
// The appended rows follow the S projected rows of each sequence in the k | v columns.
#pragma once

#include "attn/config.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// The projection-buffer layout of one MultiHeadAttention call (see the top of this file).
struct ProjectionLayout {
  bool self = false;                            ///< one q | k | v buffer (self-attention)
  Index batch = 0, q_length = 0, k_length = 0;  ///< B, L, S
  Index extra = 0;                              ///< rows appended to k and v
  Index heads = 0, kv_heads = 0, dim = 0;       ///< H, Hkv, D
  /// q: q_rows_per_batch rows a sequence, q_stride apart, from column 0 of its buffer.
  Index q_rows_per_batch = 0, q_stride = 0;
  /// k and v: kv_rows_per_batch rows a sequence, kv_stride apart, k from column k_column of
  /// the k | v buffer (the q | k | v one for self-attention), v Ekv columns later.
  Index kv_rows_per_batch = 0, kv_stride = 0, k_column = 0;

  static ProjectionLayout make(bool self, Index batch, Index q_length, Index k_length, Index extra,
                               Index heads, Index kv_heads, Index dim) {
    ProjectionLayout l{self, batch, q_length, k_length, extra, heads, kv_heads, dim};
    const Index e = heads * dim, ekv = kv_heads * dim;
    l.kv_rows_per_batch = k_length + extra;  // self: L = S
    l.kv_stride = self ? e + 2 * ekv : 2 * ekv;
    l.k_column = self ? e : 0;
    l.q_rows_per_batch = self ? l.kv_rows_per_batch : q_length;
    l.q_stride = self ? l.kv_stride : e;
    return l;
  }

  Index kv_length() const { return k_length + extra; }  ///< S'
  Index q_width() const { return heads * dim; }         ///< E
  Index kv_width() const { return kv_heads * dim; }     ///< Ekv
  Index v_column() const { return k_column + kv_width(); }
  /// Rows of the k | v buffer (of the q | k | v one) and of the q buffer (none for self).
  Index kv_buffer_rows() const { return batch * kv_rows_per_batch; }
  Index q_buffer_rows() const { return self ? 0 : batch * q_length; }

  /// The buffer q lies in: the one buffer for self-attention, else its own.
  template <class U>
  U* q_buffer(U* kv_buffer, U* own) const {
    return self ? kv_buffer : own;
  }

  /// The first entries of the k and v blocks in the k | v buffer (the q | k | v one).
  template <class U>
  U* k_block(U* kv_buffer) const {
    return column(kv_buffer, k_column);
  }
  template <class U>
  U* v_block(U* kv_buffer) const {
    return column(kv_buffer, v_column());
  }

  /// (B, H, L, D) and (B, Hkv, S', D) head views of the blocks.
  template <class U>
  HeadsView<U> q_view(U* q_buffer) const {
    return strided(q_buffer, q_length, heads, q_rows_per_batch, q_stride);
  }
  template <class U>
  HeadsView<U> k_view(U* kv_buffer) const {
    return strided(k_block(kv_buffer), kv_length(), kv_heads, kv_rows_per_batch, kv_stride);
  }
  template <class U>
  HeadsView<U> v_view(U* kv_buffer) const {
    return strided(v_block(kv_buffer), kv_length(), kv_heads, kv_rows_per_batch, kv_stride);
  }

  /// The k entries of appended row i (0 <= i < extra) of sequence b; its v entries follow at
  /// + Ekv.
  template <class U>
  U* appended_row(U* kv_buffer, Index b, Index i) const {
    return kv_buffer + (b * kv_rows_per_batch + k_length + i) * kv_stride + k_column;
  }

 private:
  /// The column block at `offset` of a buffer; an empty buffer's null data stays null
  /// (no arithmetic on a null pointer, e.g. for L = 0).
  template <class U>
  static U* column(U* data, Index offset) {
    return data == nullptr ? data : data + offset;
  }

  template <class U>
  HeadsView<U> strided(U* data, Index length, Index h, Index rows_per_batch, Index stride) const {
    return {data, batch, h, length, dim, rows_per_batch * stride, dim, stride};
  }
};

}  // namespace attn::detail
