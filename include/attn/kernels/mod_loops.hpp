// attn/kernels/mod_loops.hpp: the tile loops of user mods (attn/mods.hpp), compiled for each
// instruction set (generic, avx2, avx512; simd/foreach_isa.hpp), whatever flags the
// translation unit has, so that a mod created in a plain -O2 unit still runs vectorised on the
// CPU's widest vectors. They are instantiated for each user's callable where the mod is made,
// so they are not in the kernels' tables (kernels/dispatch.hpp); a mod keeps one pointer per
// instruction set and a call takes the one of its plan.
#pragma once

#include <limits>

#include "attn/config.hpp"
#include "attn/cpu.hpp"

// GCC's -O2 vectorises only loops its very cheap cost model accepts; a mod's loop needs
// the dynamic one. Clang's -O2 vectorises these loops already.
#if defined(__GNUC__) && !defined(__clang__)
#define ATTN_VECTORIZED_LOOP \
  __attribute__((optimize("tree-loop-vectorize", "vect-cost-model=dynamic")))
#else
#define ATTN_VECTORIZED_LOOP
#endif

namespace attn {

/// A tile of scores handed to a mod: rows queries from i0 and cols keys from j0 of batch
/// entry b, head h; element (r, c) at data[r * row_stride + c * col_stride].
template <class T>
struct ScoreTile {
  T* data;
  Index rows, cols, row_stride, col_stride;
  Index b, h, i0, j0;
};

}  // namespace attn

#define ATTN_ISA_SOURCE "attn/kernels/mod_loops.inl"
#include "attn/kernels/simd/foreach_isa.hpp"

namespace attn::detail {

/// One function of a mod per instruction set, indexed by Isa: a call runs the one of its
/// plan's instruction set.
template <class Function>
struct PerIsa {
  Function function[3] = {nullptr, nullptr, nullptr};  // generic, avx2, avx512
  Function operator[](Isa isa) const {
    ATTN_DISPATCH_OBSERVER(isa);
    return function[static_cast<int>(float_kernels_isa(isa))];  // avx512_bf16: avx512's
  }
};

template <class T>
using ScoreTileLoop = void (*)(const void*, const ScoreTile<T>&);
using CountLoop = Index (*)(const void*, Index, Index, Index, Index, Index, Index);

// The instantiations for callable F of each loop, for every instruction set (generic where
// the build has no x86 dispatch).
#if ATTN_X86_DISPATCH
template <class F, class T>
PerIsa<ScoreTileLoop<T>> score_tile_loops() {
  return {{&generic::score_tile<F, T>, &avx2::score_tile<F, T>, &avx512::score_tile<F, T>}};
}
template <class F, class T>
PerIsa<ScoreTileLoop<T>> hide_tile_loops() {
  return {{&generic::hide_tile<F, T>, &avx2::hide_tile<F, T>, &avx512::hide_tile<F, T>}};
}
template <class F>
PerIsa<CountLoop> count_visible_loops() {
  return {{&generic::count_visible<F>, &avx2::count_visible<F>, &avx512::count_visible<F>}};
}
#else
template <class F, class T>
PerIsa<ScoreTileLoop<T>> score_tile_loops() {
  return {{&generic::score_tile<F, T>, &generic::score_tile<F, T>, &generic::score_tile<F, T>}};
}
template <class F, class T>
PerIsa<ScoreTileLoop<T>> hide_tile_loops() {
  return {{&generic::hide_tile<F, T>, &generic::hide_tile<F, T>, &generic::hide_tile<F, T>}};
}
template <class F>
PerIsa<CountLoop> count_visible_loops() {
  return {{&generic::count_visible<F>, &generic::count_visible<F>, &generic::count_visible<F>}};
}
#endif

}  // namespace attn::detail
