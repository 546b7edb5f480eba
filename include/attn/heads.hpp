// attn/heads.hpp: splitting a (B, S, H*D) tensor into heads and merging them back.
//
// Shape legend: B batch, S sequence length, H heads (Hq query heads, Hkv key/value heads),
// D head dim, E = H*D.
//
// Two ways to get per-head (S, D) matrices out of (B, S, E):
//   - split_heads / merge_heads copy into and out of PyTorch's (B, H, S, D) layout with the
//     Eigen Tensor module (reshape, then shuffle). Useful for export and for tests.
//   - heads_view / blhd_view give the same (B, H, S, D) *view* of the (B, S, H, D) memory
//     with no copy at all: only the strides differ. That is what MultiHeadAttention uses.
//
// The QKV-projection tutorial's "mistake two": (B, S, E) must be reshaped to (B, S, H, D) and
// *then* transposed to (B, H, S, D). Reshaping straight to (B, H, S, D) reinterprets the memory:
// "head" h would then hold rows h*S/H .. of the sequence with the features of several
// heads interleaved. The shapes look right and the numbers are wrong (tested).
#pragma once

#include <algorithm>
#include <array>
#include <string>

#include "attn/config.hpp"
#include "attn/tensor.hpp"

namespace attn {

namespace detail {

/// Throws unless a (B, S, width) tensor splits into `heads` heads of equal width.
inline void check_heads_divide_width(const char* function, Index batch, Index length, Index width,
                                     Index heads) {
  if (heads < 1 || width % heads != 0) {
    throw_invalid_argument(function, "x is " + shape_string({batch, length, width}) +
                                         ": the width " + std::to_string(width) +
                                         " is not divisible by heads " + std::to_string(heads));
  }
}

}  // namespace detail

/// (B, S, H*D) -> (B, H, S, D): reshape to (B, S, H, D), then swap S and H (a copy).
template <class T>
Tensor<T, 4> split_heads(const Tensor<T, 3>& x,  // (B, S, H*D)
                         Index heads) {
  const Index batch = x.dimension(0), length = x.dimension(1), width = x.dimension(2);
  detail::check_heads_divide_width("split_heads", batch, length, width, heads);
  const std::array<Index, 4> bshd{batch, length, heads, width / heads};
  const std::array<int, 4> swap_s_h{0, 2, 1, 3};
  return x.reshape(bshd).shuffle(swap_s_h);  // (B, H, S, D)
}

/// (B, H, S, D) -> (B, S, H*D): swap H and S back, then reshape (a copy). Inverse of
/// split_heads.
template <class T>
Tensor<T, 3> merge_heads(const Tensor<T, 4>& x) {  // (B, H, S, D)
  const Index batch = x.dimension(0), heads = x.dimension(1), length = x.dimension(2),
              dim = x.dimension(3);
  const std::array<int, 4> swap_h_s{0, 2, 1, 3};
  const std::array<Index, 3> bse{batch, length, heads * dim};
  return x.shuffle(swap_h_s).reshape(bse);  // (B, S, H*D)
}

/// Zero-copy (B, H, S, D) view of a (B, S, H*D) tensor (its memory is (B, S, H, D)).
template <class T>
HeadsView<const T> heads_view(const Tensor<T, 3>& x,  // (B, S, H*D)
                              Index heads) {
  const Index batch = x.dimension(0), length = x.dimension(1), width = x.dimension(2);
  detail::check_heads_divide_width("heads_view", batch, length, width, heads);
  return blhd_view(x.data(), batch, length, heads, width / heads);
}
template <class T>
HeadsView<T> heads_view(Tensor<T, 3>& x, Index heads) {  // (B, S, H*D)
  const HeadsView<const T> v = heads_view(static_cast<const Tensor<T, 3>&>(x), heads);
  return {x.data(), v.batch, v.heads, v.length, v.dim, v.batch_stride, v.head_stride, v.row_stride};
}

/// Zero-copy (B, H, S, D) view of H*D consecutive columns of a (B, S, W) row-major buffer
/// whose rows are `row_stride` >= H*D elements apart, e.g. the q, k or v block of a fused
/// QKV buffer (W = Dq + Dk + Dv). `data` points at the block's first element.
template <class T>
HeadsView<T> strided_heads_view(T* data, Index batch, Index length, Index heads, Index dim,
                                Index row_stride) {
  if (batch < 0 || length < 0 || heads < 1 || dim < 1 || row_stride < heads * dim) {
    detail::throw_invalid_argument("strided_heads_view",
                                   "(B, S, H, D) is " +
                                       detail::shape_string({batch, length, heads, dim}) +
                                       " with row stride " + std::to_string(row_stride) +
                                       ": need H, D >= 1 and a row stride of at least H*D");
  }
  return {data, batch, heads, length, dim, length * row_stride, dim, row_stride};
}

/// Grouped-query attention: the key/value head that query head `q_head` reads. Hq must be
/// a multiple of Hkv; each group of Hq/Hkv consecutive query heads shares one kv head
/// (PyTorch's repeat_interleave on the head dimension; Hkv = 1 is multi-query attention).
inline Index kv_head_for(Index q_head, Index num_heads, Index num_kv_heads) {
  if (num_kv_heads < 1 || num_heads < 1 || num_heads % num_kv_heads != 0) {
    detail::throw_invalid_argument("kv_head_for", "num_heads " + std::to_string(num_heads) +
                                                      " is not a multiple of num_kv_heads " +
                                                      std::to_string(num_kv_heads));
  }
  if (q_head < 0 || q_head >= num_heads) {
    detail::throw_invalid_argument(
        "kv_head_for",
        "q_head " + std::to_string(q_head) + " is outside [0, " + std::to_string(num_heads) + ")");
  }
  return q_head / (num_heads / num_kv_heads);
}

/// Explicit GQA expansion (a copy, for tests and export): (B, Hkv, S, D) ->
/// (B, Hkv*repeats, S, D), each kv head repeated `repeats` times consecutively.
template <class T>
Tensor<T, 4> repeat_kv_heads(const Tensor<T, 4>& x,  // (B, Hkv, S, D)
                             Index repeats) {
  if (repeats < 1) {
    detail::throw_invalid_argument("repeat_kv_heads",
                                   "repeats is " + std::to_string(repeats) + ": must be >= 1");
  }
  const Index batch = x.dimension(0), heads = x.dimension(1), length = x.dimension(2),
              dim = x.dimension(3);
  Tensor<T, 4> out(batch, heads * repeats, length, dim);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads * repeats; ++h) {
      const T* src = x.data() + ((b * heads + h / repeats) * length) * dim;
      T* dst = out.data() + ((b * heads * repeats + h) * length) * dim;
      std::copy(src, src + length * dim, dst);
    }
  }
  return out;
}

}  // namespace attn
