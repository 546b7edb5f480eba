// attn/kernels/online_softmax.hpp: the flash and decode kernels of every instruction set.
//
// kernels/online_softmax.inl is compiled once per instruction set (simd/foreach_isa.hpp):
// generic (Eigen's products, any scalar), avx2 and avx512 (float, the vector products of
// simd/tile_products.inl). One source, so the online softmax, the finishing step and the
// merge of partial results are the same code for all of them; an instruction set supplies
// only its tile products. kernels/dispatch.hpp picks the set a call runs.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/generic.hpp"
#include "attn/kernels/simd/tile_products.hpp"
#include "attn/kernels/workspace.hpp"
#include "attn/problem.hpp"
#include "attn/quantized.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// The rows `decode_far_blocks` blocks of `count` rows after `row`, which decode requests into
/// L2 besides the next block's into L1, where decode_far_prefetch<S> and the view has no pages
/// (a paged cache's rows that far on may lie on any page); null otherwise. On the Xeon of
/// docs/performance.md ("Tuning choices") this took q8_0 decode on int8 products from memory
/// to 0.9x of its time.
template <class S>
const S* far_rows(const HeadsView<const S>& x, Index b, Index h, Index row, Index count) {
  if constexpr (decode_far_prefetch<S>)
    return x.pages == nullptr ? rows_after(x, b, h, row, decode_far_blocks * count) : nullptr;
  else
    return nullptr;
}

}  // namespace attn::detail

#define ATTN_ISA_SOURCE "attn/kernels/online_softmax.inl"
#include "attn/kernels/simd/foreach_isa.hpp"
